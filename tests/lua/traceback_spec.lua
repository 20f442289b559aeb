-- traceback_spec.lua — an error inside a module's forward prints the traceback of the error
-- point (lua/fsdp/nn/module.lua leaves it for the host's traceback handler, src/host/setup.c):
-- the user's frames inside forward (a helper, the forward itself), then the call of the model
-- and the main chunk; at 1 rank, at 2 ranks and in a wrapped model. A traceback left by an
-- error the recipe caught is not printed for a later, other error.
-- Run: busted --lua=luajit tests/lua/traceback_spec.lua (FSDPRUN: the built fsdprun)

-- A custom module whose forward calls a helper that makes a shape error (no tail calls: a tail
-- call leaves no frame to show). WRAP=1 wraps it first.
local recipe = [[
local fsdp = require "fsdp"
local nn = fsdp.nn
local Net = nn.Module:extend("Net")
function Net:init() self.fc = nn.Linear(4, 3) end
local function helper(y)
  local z = y:matmul(fsdp.zeros{5, 2})
  return z
end
function Net:forward(x)
  local y = self.fc(x)
  local z = helper(y)
  return z
end
local model = Net()
if os.getenv("WRAP") == "1" then fsdp.wrap(model) end
local function step()
  local out = model(fsdp.zeros{2, 4})
  return out
end
step()
]]

local caught = [[
local fsdp = require "fsdp"
local lin = fsdp.nn.Linear(4, 3)
local ok = pcall(lin, fsdp.zeros{2, 5})
assert(not ok)
local function later() error("later error") end
later()
]]

local H = require "helpers"
teardown(H.remove_temps)

-- run fsdprun on text (with args and environment prefix env): its output and exit status
local function run(text, args, env)
  local fsdprun = os.getenv("FSDPRUN")
  if not fsdprun then return nil end
  local path = H.tmpname()
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
  local p = assert(io.popen(("%s %q %s %q 2>&1; echo \"rc=$?\""):format(env or "", fsdprun,
    args or "", path)))
  local out = p:read("*a")
  p:close()
  os.remove(path)
  return out:gsub(path:gsub("%p", "%%%0"), "recipe.lua")
end

local function has(out, s) assert.is_truthy(out:find(s, 1, true), ("lacks %q in:\n%s"):format(s, out)) end

local function check_frames(out)
  has(out, "Net: recipe.lua:6: matmul: shapes (2, 3) and (5, 2) do not match")
  has(out, "stack traceback:")
  has(out, "recipe.lua:6: in function 'helper'")
  has(out, "recipe.lua:11: in function ") -- forward (named 'forward' when hooks call it)
  has(out, "recipe.lua:17: in function 'step'")
  has(out, "recipe.lua:20: in main chunk")
  has(out, "rc=1")
end

describe("an error inside forward", function()
  before_each(function()
    if not os.getenv("FSDPRUN") then pending("FSDPRUN is not set (run through ctest)") end
  end)

  it("prints the user's frames inside forward at 1 rank", function()
    local out = run(recipe)
    if out then check_frames(out) end
  end)

  it("prints them in every rank's report at 2 ranks", function()
    local out = run(recipe, "-n 2")
    if out then
      check_frames(out)
      has(out, "] Net: recipe.lua:6: matmul")
    end
  end)

  it("prints them through the hooks of a wrapped model", function()
    local out = run(recipe, "-n 2", "WRAP=1")
    if out then check_frames(out) end
  end)

  it("leaves nothing for a later, other error once caught", function()
    local out = run(caught)
    if out then
      has(out, "recipe.lua:5: later error")
      has(out, "recipe.lua:6: in main chunk")
      assert.falsy(out:find("linear", 1, true), out)
      local _, n = out:gsub("stack traceback:", "")
      assert.are.equal(1, n, out)
    end
  end)
end)
