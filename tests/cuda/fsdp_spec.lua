-- fsdp_spec.lua — the sharding layer at one rank on the device under test, each feature held to
-- the same run on the cpu: wrap{device =} of a meta model, a model moved there and then wrapped,
-- ties, masks, unwrap and re-wrap, full_params with writeback, and checkpoints (sharded with the
-- optimizer, and safetensors) saved there and loaded there, on the cpu and into another unit
-- layout (resharding). f32 throughout: losses within 1e-4 relative of the cpu's.
-- The device: cuda, or cpu2 when FSDP_CUDA_TEST_DEVICE=cpu2 (the harness). Run through
-- tests/cuda/run_spec.sh, which skips (77) without a GPU.

local DEV = os.getenv("FSDP_CUDA_TEST_DEVICE") or "cuda"
if DEV == "cpu2" then require "fsdp_cpu2" end -- before fsdp.core: the engine cpu2 lives in
local fsdp = require "fsdp"
local nn = fsdp.nn
local core = fsdp.core
local H = require "helpers"

local V, T, B = 32, 16, 3
local blocks = function() return fsdp.policy.modules{nn.Block} end

local function gpt(tie)
  fsdp.manual_seed(3)
  return nn.GPT{vocab = V, ctx = T, d = 32, layers = 2, heads = 2, tie = tie ~= false}
end

local function batch(k, dev)
  local x, y = {}, {}
  for b = 1, B do
    x[b], y[b] = {}, {}
    for t = 1, T do
      x[b][t] = (k * 13 + b * 7 + t * 5) % V
      y[b][t] = (x[b][t] * 3 + k) % V
    end
  end
  return fsdp.tensor(x, {dtype = "i64"}):to(dev), fsdp.tensor(y, {dtype = "i64"}):to(dev)
end

-- steps first..last of AdamW on m (inputs on dev); the losses
local function train(m, opt, dev, first, last)
  local losses = {}
  for k = first, last do
    local x, y = batch(k, dev)
    local loss = nn.F.cross_entropy(m(x), y)
    opt:zero_grad()
    loss:backward()
    opt:step()
    losses[#losses + 1] = loss:item()
  end
  return losses
end

local function adamw(m) return fsdp.optim.AdamW(m, {lr = 3e-3, weight_decay = 0.1}) end

local function assert_losses_close(got, want, tol, what)
  assert.are.equal(#want, #got)
  for k = 1, #want do
    local rel = math.abs(got[k] - want[k]) / math.abs(want[k])
    if rel > tol then
      error(("%s: step %d loss %.9g, the reference %.9g (relative %.3g > %g)")
        :format(what, k, got[k], want[k], rel, tol), 2)
    end
  end
end

-- path -> flat f32 values on the cpu (gathering a wrapped model's units)
local function values(m)
  local out = {}
  local function grab()
    fsdp.no_grad(function()
      for path, p in m:named_parameters() do out[path] = p:to("cpu", "f32"):view{p:numel()}:totable() end
    end)
  end
  if fsdp.is_wrapped(m) then fsdp.full_params(m, grab, {writeback = false}) else grab() end
  return out
end

local function assert_values_close(a, b, tol, what)
  for path, vb in pairs(b) do
    local va = assert(a[path], path)
    local d, n = 0, 0
    for i = 1, #vb do
      d = d + (va[i] - vb[i]) ^ 2
      n = n + vb[i] ^ 2
    end
    local r = math.sqrt(d) / math.max(math.sqrt(n), 1e-30)
    if r > tol then error(("%s: parameter %s differs by %.3g (relative norm)"):format(what, path, r), 2) end
  end
end

-- the cpu reference: a plain model trained `steps` steps
local function reference(steps, tie)
  local m = gpt(tie)
  return train(m, adamw(m), "cpu", 1, steps), values(m)
end

local function shards_on(m, dev)
  for _, u in ipairs(fsdp.units(m)) do assert.are.equal(dev, u:shard().device, u.path) end
end

describe("fsdp at one rank on " .. DEV, function()
  it("wrap{device =} puts a meta model's shards there; it trains like the plain cpu model", function()
    local want, want_vals = reference(8)
    fsdp.manual_seed(3)
    local m = fsdp.meta(function() return nn.GPT{vocab = V, ctx = T, d = 32, layers = 2, heads = 2} end)
    fsdp.wrap(m, {policy = blocks(), device = DEV})
    fsdp.materialize(m)
    shards_on(m, DEV)
    assert.are.equal(3, #fsdp.units(m))
    local got = train(m, adamw(m), DEV, 1, 8)
    assert_losses_close(got, want, 1e-4, "wrap{device}")
    assert_values_close(values(m), want_vals, 1e-4, "wrap{device}")
  end)

  it("a model moved there and wrapped keeps its ties and trains like the cpu model", function()
    local want = reference(8)
    local m = gpt()
    local wte = m.wte.weight
    m:to(DEV)
    fsdp.wrap(m, {policy = blocks()})
    shards_on(m, DEV)
    assert.is_true(rawequal(m.head.weight, m.wte.weight))
    assert.is_true(rawequal(wte, m.wte.weight)) -- the same parameter object throughout
    local ties = fsdp.ties(m)
    assert.are.equal(1, #ties)
    assert.are.same({"wte.weight", "head.weight"}, ties[1].paths)
    assert_losses_close(train(m, adamw(m), DEV, 1, 8), want, 1e-4, "moved, wrapped")
    -- and untied: the head is a parameter of its own
    local want_u = reference(4, false)
    local u = gpt(false)
    u:to(DEV)
    fsdp.wrap(u, {policy = blocks()})
    assert.is_false(rawequal(u.head.weight, u.wte.weight))
    assert_losses_close(train(u, adamw(u), DEV, 1, 4), want_u, 1e-4, "untied")
  end)

  it("masks: masked weights stay 0, a tie shares its mask, sparsity counts like the cpu's", function()
    local function masked_run(dev)
      local m = gpt()
      if dev ~= "cpu" then m:to(dev) end
      fsdp.wrap(m, {policy = blocks()})
      local targets = {m.blocks[1].mlp.fc.weight, m.head.weight, m.blocks[2].attn.qkv.bias}
      local masks = {}
      for i, p in ipairs(targets) do
        local shape = p:shape()
        local n = 1
        for _, s in ipairs(shape) do n = n * s end
        local v = {}
        for j = 1, n do v[j] = (j * 7 + i) % 3 == 0 and 0 or 1 end
        masks[i] = fsdp.tensor(v):view(shape)
        fsdp.set_mask(p, masks[i])
      end
      assert.are.same(H.flat(masks[2]), H.flat(fsdp.mask(m.wte.weight))) -- the tie's mask
      local losses = train(m, adamw(m), dev, 1, 6)
      local vals = values(m)
      for i, path in ipairs{"blocks.1.mlp.fc.weight", "wte.weight", "blocks.2.attn.qkv.bias"} do
        local mv, zeros = H.flat(masks[i]), 0
        for j = 1, #mv do
          if mv[j] == 0 then
            assert.are.equal(0, vals[path][j], path .. " regrew at " .. j)
            zeros = zeros + 1
          end
        end
        assert.is_true(zeros > 0)
      end
      return losses, fsdp.sparsity(m)
    end
    local la, sa = masked_run("cpu")
    local lb, sb = masked_run(DEV)
    assert_losses_close(lb, la, 1e-4, "masked")
    assert.are.equal(sa.zeros, sb.zeros)
    assert.are.equal(sa.total, sb.total)
    assert.is_true(sb.zeros > 0)
  end)

  it("unwrap and re-wrap with another policy and strategy keep values and training", function()
    local m = gpt()
    m:to(DEV)
    fsdp.wrap(m, {policy = blocks()})
    local opt = adamw(m)
    local got = train(m, opt, DEV, 1, 3)
    local before = values(m)
    fsdp.unwrap(m)
    assert.are.equal(DEV, m.blocks[1].mlp.fc.weight.device)
    assert_values_close(values(m), before, 0, "unwrap")
    fsdp.wrap(m, {strategy = "grad_op"}) -- the root as the only unit
    assert.are.equal(1, #fsdp.units(m))
    shards_on(m, DEV)
    assert_values_close(values(m), before, 0, "re-wrap")
    -- a new optimizer for the new units: the reference does the same at step 4
    local opt2 = adamw(m)
    local rest = train(m, opt2, DEV, 4, 9)
    local r = gpt()
    local ropt = adamw(r)
    local ref = train(r, ropt, "cpu", 1, 3)
    local ropt2 = adamw(r)
    for _, l in ipairs(train(r, ropt2, "cpu", 4, 9)) do ref[#ref + 1] = l end
    for _, l in ipairs(rest) do got[#got + 1] = l end
    assert.are.equal(9, #got)
    assert_losses_close(got, ref, 1e-4, "re-wrapped")
  end)

  it("full_params shows full weights there and writes changes back", function()
    local m = gpt()
    m:to(DEV)
    fsdp.wrap(m, {policy = blocks()})
    fsdp.full_params(m, function()
      local w = m.blocks[2].mlp.proj.weight
      assert.are.equal(DEV, w.device)
      w:fill(0.25)
    end)
    local v = values(m)["blocks.2.mlp.proj.weight"]
    for i = 1, #v do assert.are.equal(0.25, v[i]) end
    fsdp.full_params(m, function() m.blocks[2].mlp.proj.weight:fill(1) end, {writeback = false})
    assert.are.equal(0.25, values(m)["blocks.2.mlp.proj.weight"][1])
  end)
end)

describe("checkpoints at one rank on " .. DEV, function()
  local dir
  before_each(function()
    dir = os.tmpname()
    os.remove(dir)
    core.io_mkdirs(dir)
  end)
  after_each(function() os.execute("rm -rf '" .. dir .. "'") end)

  -- trains 4 steps there, saves (sharded, with the optimizer), trains 4 more: the reference
  local function saved_run()
    local m = gpt()
    m:to(DEV)
    fsdp.wrap(m, {policy = blocks()})
    local opt = adamw(m)
    train(m, opt, DEV, 1, 4)
    fsdp.save(m, dir .. "/ck", {optimizer = opt})
    fsdp.save(m, dir .. "/m.safetensors")
    local vals = values(m)
    return train(m, opt, DEV, 5, 8), vals
  end

  it("resume there, into the same and into another unit layout (resharding)", function()
    local want, vals = saved_run()
    for _, policy in ipairs{"blocks", "root", "plain"} do
      local m = gpt()
      fsdp.manual_seed(99) -- other values: load must replace them
      m:to(DEV)
      if policy == "blocks" then fsdp.wrap(m, {policy = blocks()})
      elseif policy == "root" then fsdp.wrap(m) end
      local opt = adamw(m)
      local _, info = fsdp.load(m, dir .. "/ck", {optimizer = opt})
      assert.are.equal(4, info.step)
      if policy == "plain" then assert.are.equal(DEV, m.wte.weight.device) else shards_on(m, DEV) end
      assert_values_close(values(m), vals, 0, "loaded (" .. policy .. ")")
      -- the same device and kernels: only the order of atomic adds may differ (no deterministic mode)
      assert_losses_close(train(m, opt, DEV, 5, 8), want, 1e-5, "resumed (" .. policy .. ")")
    end
  end)

  it("resume on the cpu, from the sharded checkpoint and from safetensors", function()
    local want, vals = saved_run()
    local m = gpt()
    local opt = adamw(m)
    fsdp.load(m, dir .. "/ck", {optimizer = opt})
    assert.are.equal("cpu", m.wte.weight.device)
    assert_values_close(values(m), vals, 0, "loaded on the cpu")
    assert_losses_close(train(m, opt, "cpu", 5, 8), want, 1e-4, "resumed on the cpu")
    local s = gpt()
    fsdp.load(s, dir .. "/m.safetensors")
    assert_values_close(values(s), vals, 0, "safetensors on the cpu")
    local sd = gpt()
    sd:to(DEV)
    fsdp.wrap(sd, {policy = blocks()})
    fsdp.load(sd, dir .. "/m.safetensors")
    assert_values_close(values(sd), vals, 0, "safetensors there")
  end)

  it("a cpu checkpoint resumes there", function()
    local m = gpt()
    fsdp.wrap(m, {policy = blocks()})
    local opt = adamw(m)
    train(m, opt, "cpu", 1, 4)
    fsdp.save(m, dir .. "/cpu", {optimizer = opt})
    local want = train(m, opt, "cpu", 5, 8)
    local d = gpt()
    d:to(DEV)
    fsdp.wrap(d, {policy = blocks()})
    local dopt = adamw(d)
    fsdp.load(d, dir .. "/cpu", {optimizer = dopt})
    shards_on(d, DEV)
    assert_losses_close(train(d, dopt, DEV, 5, 8), want, 1e-4, "cpu checkpoint there")
  end)
end)
