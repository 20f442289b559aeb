-- fsdp.nn.checkpoint — activation checkpointing of modules (docs/nn.md, "Activation
-- checkpointing"). nn.checkpoint(m) marks m; module.lua's call runs a marked module's forward
-- through M.run, inside the module's forward hooks (so a unit's gather and tape hooks enclose
-- the checkpoint: the recomputation uses the gather its backward made, never one of its own).
--
-- M.run: when gradients are recorded and something the forward uses requires one, the forward
-- runs with recording off (it saves no activation) and its output is recorded as ONE node
-- (fsdp.core.checkpoint, src/autograd/checkpoint.c) that keeps the tensor arguments and the
-- random streams' state. Backward reaches the node and calls the closure made here: the forward
-- again, recording on, on a tape of its own, with those arguments and streams; the node then
-- back-propagates its gradient through that tape. Other calls (no_grad, eval loops, a marked
-- module inside another's first pass) are plain forwards.
--
-- The mark is the raw field MARK on the module (module.lua's bookkeeping fields start with
-- "__"). The closure holds the module, the outermost module of its call (for error paths) and
-- the non-tensor arguments only; tensors stay with the node, so dropping the graph frees them.

local core = require "fsdp.core"
local util = require "fsdp.util"

local M = {}

local MARK = "__checkpoint"
local floating = {f32 = true, bf16 = true, f16 = true, f64 = true}
local depth = 0 -- recomputations running (nested checkpoints nest them)

-- module.lua's call of a recomputation (errors named by the module's path) and the module of
-- the outermost module call running, given by module.lua when it loads (it requires this file)
local call_recompute, outer_module

function M.bind(call, outer)
  call_recompute, outer_module = call, outer
end

function M.mark(m, on) rawset(m, MARK, on and true or nil) end
function M.is_marked(m) return rawget(m, MARK) == true end

--- Whether a checkpointed region is being recomputed (a backward is running it again).
function M.recomputing() return depth > 0 end

local function needs_grad(m, n, args)
  if not core.is_grad_enabled() then return false end
  for i = 1, n do
    local a = args[i]
    if util.is_tensor(a) and a.requires_grad then return true end
  end
  for _, p in ipairs(m:parameters()) do
    if p.requires_grad then return true end
  end
  return false
end

local function pack(...) return {n = select("#", ...), ...} end

-- The recomputation of m's forward: tensor arguments come back as the node's inputs, in order;
-- the other arguments are the ones first given. `outer` is the outermost module of the call
-- that first ran it: an error of the recomputation names m's path from there.
-- `p`, when not nil, is a parameter of m that unit `u` (fsdp.wrap) held at the forward: a model
-- unwrapped (or wrapped anew) since would recompute on other parameters than the forward's (dense
-- f32 ones, where the forward computed in the units' dtype), so that is refused first, naming
-- what happened, as the units' own backward hooks do.
local function recomputation(m, forward, n, args, at, outer, p, u)
  local function checked(self, ...)
    if core.param_unit(p) ~= u then
      error(("the model was unwrapped (fsdp.unwrap) after the forward that recorded this graph, "
        .. "so unit '%s' holds none of its parameters any more: run the forward again")
        :format(u.path), 0)
    end
    return forward(self, ...)
  end
  return function(...)
    local a = {unpack(args, 1, n)}
    for k = 1, #at do a[at[k]] = (select(k, ...)) end
    depth = depth + 1
    local r = pack(pcall(call_recompute, m, outer, p and checked or forward, unpack(a, 1, n)))
    depth = depth - 1
    if not r[1] then error(r[2], 0) end
    return r[2]
  end
end

--- forward(m, ...) checkpointed as m's region (see the file header): m's forward, or a fused
--- op standing in for a call of m (nn.MLP's fc and GELU).
function M.run_as(m, forward, ...)
  local n = select("#", ...)
  local args = {...}
  if not needs_grad(m, n, args) then return forward(m, ...) end
  local rng = core.checkpoint_rng()
  local res = pack(util.quiet(forward, m, ...))
  -- caught to restore recording: the library positions go, as module.lua drops them
  if not res[1] then error(type(res[2]) == "string" and util.strip(res[2]) or res[2], 0) end
  local y = res[2]
  if res.n ~= 2 or not util.is_tensor(y) then
    error(("nn.checkpoint: a checkpointed forward must return one tensor (%s's returned %s)")
      :format(m:type_name(), res.n ~= 2 and (res.n - 1 .. " values") or type(y)), 0)
  end
  if not floating[y:dtype()] then return y end -- no gradient flows through it
  local tensors, at = {}, {}
  for i = 1, n do
    if util.is_tensor(args[i]) then
      tensors[#tensors + 1] = args[i]
      at[#at + 1] = i
      args[i] = false
    end
  end
  local held, unit
  for _, p in ipairs(m:parameters()) do
    unit = core.param_unit(p)
    if unit ~= nil then
      held = p
      break
    end
  end
  return core.checkpoint(y, rng,
    recomputation(m, forward, n, args, at, outer_module(), held, unit), unpack(tensors))
end

--- m's forward(...) checkpointed.
function M.run(m, ...) return M.run_as(m, m.forward, ...) end

return M
