-- threads_spec.lua — fsdp.core.set_threads / get_threads: the calling rank's cpu threads (the
-- kernels' pool), their bounds, fsdp.info().threads, and a training computation that gives
-- results within 1e-6 at 1 and 2 threads and the same bits run to run at 2.
-- Run: busted --lua=luajit tests/lua/threads_spec.lua

local fsdp = require "fsdp"
local core = fsdp.core
local nn = fsdp.nn

local H = require "helpers"

-- one forward + backward + AdamW step of a small GPT at `threads` threads: loss, parameters
local function step(threads)
  core.set_threads(threads)
  fsdp.manual_seed(3)
  local model = nn.GPT { vocab = 32, ctx = 70, d = 64, layers = 1, heads = 2, tie = true }
  local opt = fsdp.optim.AdamW(model, { lr = 1e-2 })
  local ids = {}
  for i = 1, 2 * 71 do ids[i] = (i * 7) % 32 end
  local t = fsdp.tensor(ids):view { 2, 71 }
  local x, y = t:narrow(2, 1, 70):contiguous(), t:narrow(2, 2, 70):contiguous()
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  opt:step()
  local params = {}
  for _, p in ipairs(model:parameters()) do
    for _, v in ipairs(H.flat(p.data)) do params[#params + 1] = v end
  end
  return loss:item(), params
end

describe("threads", function()
  local before
  before_each(function() before = core.get_threads() end)
  after_each(function() core.set_threads(before) end)

  it("set_threads and get_threads", function()
    assert.is_true(before >= 1)
    core.set_threads(3)
    assert.are.equal(3, core.get_threads())
    assert.are.equal(3, fsdp.info().threads)
    assert.truthy(tostring(fsdp.info()):find("threads 3", 1, true))
    core.set_threads(1)
    assert.are.equal(1, core.get_threads())
    core.set_threads(1024)
    assert.are.equal(1024, core.get_threads())
  end)

  it("rejects counts outside 1 .. 1024", function()
    H.assert_error_has(function() core.set_threads(0) end,
      "set_threads: the thread count must be 1 .. 1024, got 0")
    H.assert_error_has(function() core.set_threads(1025) end, "got 1025")
    H.assert_error_has(function() core.set_threads(-3) end, "got -3")
    H.assert_error_has(function() core.set_threads("x") end, "number expected")
    assert.are.equal(before, core.get_threads())
  end)

  it("gives the same training step at 1 and 2 threads", function()
    local l1, p1 = step(1)
    local l2, p2 = step(2)
    local l2b, p2b = step(2)
    assert.is_true(math.abs(l1 - l2) <= 1e-6 * math.abs(l1), ("loss %.9g vs %.9g"):format(l1, l2))
    H.make_assert_close(1e-6, "%.9g")(p2, p1, 1e-6, "parameters at 2 threads vs 1")
    assert.are.equal(l2, l2b)
    assert.is_true(H.same_values(p2, p2b), "2 threads: the same bits run to run")
  end)
end)
