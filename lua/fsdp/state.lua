-- fsdp.state — the state of a wrapped model: one Root object per fsdp.wrap, and the events
-- the library's modules subscribe to. lua/fsdp/wrap.lua builds and tears down Roots; every
-- other module reads them through the methods below.
--
--   state.of(module) -> the live Root whose tree holds module, or nil
--   state.root(model) -> the live Root when model is its root, or nil
--   state.of_unit(u) -> the live Root that built unit u, or nil
--   state.on(event, fn)         subscribe; state.emit(event, ...) announce
--
-- Events (fn gets the arguments listed; subscribers run in the order they subscribed):
--   "wrap" (R)                      a Root was built: its units exist, its modules are marked
--   "teardown" (R)                  collective, before R's units are unsharded (unwrap, or an
--                                   outer wrap absorbing R)
--   "writeback" (R, u, was_sharded) unit u's gathered values were written back to its shard
--                                   (full_params, apply, materialize with a function)
--   "materialize" (model)           meta parameters of model (plain or wrapped) got values
--
-- A Root keeps the user's tree as it is (invariant 1, docs/ARCHITECTURE.md): every module of
-- a wrapped tree carries the raw field MARK = its Root (a raw field rather than a weak table,
-- so a dropped model is collectable); teardown removes it. Units are the core units of
-- src/fsdp (fsdp.core.unit_new), listed in construction order (innermost first, root last),
-- each with the module it wraps and the policy it was built with. Everything a Root does
-- that communicates walks units in an order that depends only on the tree (the same on every
-- rank).
--
-- Fields are this file's; other modules call methods.

local core = require "fsdp.core"
local util = require "fsdp.util"
local collective = require "fsdp.collective"

local M = {}

local MARK = "__fsdp_wrap"
-- unit -> the Root that built it. Weak both ways: a Root holds its units, and LuaJIT's weak
-- keys are not ephemerons (a value that reaches its key keeps the entry, and with it the
-- whole wrapped model, alive for good); the model's mark keeps its Root alive while in use.
local root_of_unit = setmetatable({}, {__mode = "kv"})
M.ROOT_PATH = "(root)" -- the root unit's path (a label in collectives and reports)

-- ---- events ------------------------------------------------------------------------------------

local subscribers = {wrap = {}, teardown = {}, writeback = {}, materialize = {}}

function M.on(event, fn)
  local list = subscribers[event]
  if list == nil then
    util.raise(("fsdp.state: no event %s (wrap, teardown, writeback, materialize)"):format(tostring(event)))
  end
  list[#list + 1] = fn
end

function M.emit(event, ...)
  for _, fn in ipairs(subscribers[event]) do fn(...) end
end

-- ---- Root ----------------------------------------------------------------------------------------

local Root = {}
Root.__index = Root

--- A Root for model (not yet attached: its modules are marked by attach). opts: the options
--- fsdp.wrap validated; members: every module of the tree.
function M.new(model, opts, members)
  return setmetatable({_model = model, _opts = opts, _members = members, _units = {},
    _by_module = {}, _by_param = {}, _module_of = {}, _policy_of = {}, _hooks = {}}, Root)
end

--- Add unit u, which wraps `module` and owns `params`, built with `policy` ({strategy =,
--- reshard_after_forward =, mp =, offload =}). Units are added in construction order.
function Root:add_unit(u, module, params, policy)
  self._units[#self._units + 1] = u
  self._by_module[module] = u
  self._module_of[u] = module
  self._policy_of[u] = policy
  root_of_unit[u] = self
  for _, p in ipairs(params) do self._by_param[p] = u end
end

--- Keep a hook handle ({remove = fn}) to remove at teardown.
function Root:add_hook(h) self._hooks[#self._hooks + 1] = h end

--- Mark every module of the tree as part of this Root and announce it ("wrap").
function Root:attach()
  for _, m in ipairs(self._members) do rawset(m, MARK, self) end
  M.emit("wrap", self)
end

--- Collective. Announce "teardown", unshard every unit (construction order), put parameters
--- that never got values back on meta, remove the hooks and marks. The Root is dead after.
function Root:teardown()
  M.emit("teardown", self)
  for _, u in ipairs(self._units) do u:unshard() end
  if self._pending then
    for p in pairs(self._pending) do core.param_to_meta(p) end
  end
  for _, h in ipairs(self._hooks) do h.remove() end
  self._hooks = {}
  for _, m in ipairs(self._members) do
    if rawget(m, MARK) == self then rawset(m, MARK, nil) end
  end
  self._dead = true
end

-- ---- queries -------------------------------------------------------------------------------------

function Root:model() return self._model end
function Root:is_live() return not self._dead end
--- One of the options fsdp.wrap was given (validated: strategy, prefetch, mp, device, ...).
function Root:option(k) return self._opts[k] end
--- The units in construction order (a new array).
function Root:units() return {unpack(self._units)} end
--- The units in forward order once a forward ran (then those never called, in construction
--- order), else construction order (a new array).
function Root:forward_units() return {unpack(self._order or self._units)} end
function Root:unit_of(module) return self._by_module[module] end
function Root:unit_of_param(p) return self._by_param[p] end
function Root:module_of(u) return self._module_of[u] end
--- The policy unit u was built with ({strategy =, reshard_after_forward =, mp =, offload =}).
function Root:policy_of(u) return self._policy_of[u] end

--- Zero every unit's gradient shard.
function Root:zero_grad()
  for _, u in ipairs(self._units) do u:zero_grad() end
end

-- ---- gradient accumulation without reduction (fsdp.no_sync, lua/fsdp/no_sync.lua) ------------

--- Enter fsdp.no_sync (nestable): the outermost entry turns every unit's gradient sync off.
function Root:no_sync_enter()
  self._no_sync = (self._no_sync or 0) + 1
  if self._no_sync > 1 then return end
  for _, u in ipairs(self._units) do u:set_grad_sync(false) end
end

--- Leave it: the outermost exit turns sync back on (the next backward reduces).
function Root:no_sync_leave()
  self._no_sync = self._no_sync - 1
  if self._no_sync > 0 then return end
  self._no_sync = nil
  for _, u in ipairs(self._units) do u:set_grad_sync(true) end
end

function Root:in_no_sync() return self._no_sync ~= nil end

--- Collective. Make the gradient shards hold every gradient, for `what` reading them (a step,
--- clipping, unscaling): an error (located at the user) inside fsdp.no_sync; else reduce what
--- a unit still holds from it (a unit the last backward left out, or every micro-batch run
--- inside no_sync), construction order, as a backward outside would have. Which units hold
--- one is the same on every rank (their backwards were collective).
function Root:reduce_held(what)
  if self._no_sync then
    util.raise(("%s: inside fsdp.no_sync the gradients are not reduced across ranks; call it "
      .. "after the backward outside fsdp.no_sync (the last micro-batch's)"):format(what))
  end
  for _, u in ipairs(self._units) do
    if u:grad_unreduced() then u:reduce_held() end
  end
end

-- ---- walks that hold units gathered (full_params, apply, materialize) ----------------------------

--- What walk is running ("fsdp.full_params", "fsdp.apply", ...), or nil.
function Root:busy() return self._busy end

--- An error (located at the user) when a walk is running: `what` may not run inside one.
function Root:check_idle(what)
  if self._busy then util.raise(("%s: not inside %s"):format(what, self._busy)) end
end

--- Start the walk `what` ("fsdp.apply"): an error when one runs already.
function Root:enter(what)
  self:check_idle(what)
  self._busy = what
end

function Root:leave()
  self._busy = nil
  self._held = nil
end

--- Whether the running walk holds unit u gathered (u is in the list its fn gathers into, see
--- walk): writes into u's gathered parameters are then the walk's to write back (or drop), not
--- stray writes that gather and reshard refuse.
function Root:walk_holds(u)
  if self._held == nil then return false end
  for _, g in ipairs(self._held) do
    if rawequal(g[1], u) then return true end
  end
  return false
end

--- Collective. `what` may start only when no unit holds a gathered copy that differs from its
--- shard on any rank (a parameter written in place outside full_params/apply, or a shard
--- written under the copy): otherwise it fails on every rank, naming the first such unit and
--- the remedy, before anything communicates on one rank only.
function Root:check_clean(what)
  local bad
  for _, u in ipairs(self._units) do
    if u:dirty() then bad = u.path break end
  end
  local msg = collective.check_outcome(bad == nil, bad and M.changed_error(bad), what .. " check")
  if msg then util.raise(what .. ": " .. msg) end
end

--- The message for a unit whose gathered copy no longer matches its shard (u:dirty()).
function M.changed_error(path)
  return ("unit '%s' was changed while gathered (a parameter written outside fsdp.full_params "
    .. "/ fsdp.apply, or its shard written under the copy): change a wrapped model's "
    .. "parameters inside fsdp.full_params or fsdp.apply (by hand: u:gather(), change, "
    .. "u:writeback()), or drop the change with u:reshard{discard = true}"):format(path)
end

--- Collective. fn(...) on every rank, then the ranks agree on how it went: when it raised on
--- any rank it raises on every rank (its own error where it raised, the lowest failing rank's
--- elsewhere), so that what follows (writing back or not) is the same on every rank. Returns
--- fn's results.
function Root:call_agreed(what, fn, ...)
  local res = {pcall(fn, ...)}
  local msg = collective.check_outcome(res[1], not res[1] and res[2] or nil, what)
  if not res[1] then error(res[2], 0) end
  if msg then error(what .. ": " .. msg, 0) end
  return unpack(res, 2, table.maxn(res))
end

--- Collective. Run fn(gathered) as the walk `what`: fn gathers units with R:gather(u, gathered)
--- (and may put some back early: R:restore and remove their entries). What is left in
--- `gathered` is put back when fn returns (written back when writeback), and after an error
--- too (then without writeback), before the error is raised again. fn failing on one rank
--- fails the walk on every rank (call_agreed): no rank writes back then. Returns fn's results.
function Root:walk(what, writeback, fn)
  self:check_idle(what)
  self:check_clean(what)
  self:enter(what)
  local gathered = {}
  self._held = gathered -- walk_holds reads it (fn adds and removes entries in place)
  local res = {pcall(self.call_agreed, self, what, fn, gathered)}
  local restored, why = pcall(self.restore, self, gathered, writeback, res[1])
  self:leave() -- even when restoring failed: the walk is over
  if not res[1] then error(res[2], 0) end
  if not restored then error(why, 0) end
  return unpack(res, 2, table.maxn(res))
end

--- Collective. Gather u, noting in `list` whether this call gathered it.
function Root:gather(u, list)
  local was_sharded = u:state() == "sharded"
  u:gather()
  list[#list + 1] = {u, was_sharded}
end

--- Collective. Put back what `list` (from gather) changed, newest first: write back when
--- asked ("writeback" event after each), then reshard the units this walk gathered. Without
--- writeback the changes are dropped, so that no unit keeps values its shard does not hold:
--- every unit of the list is resharded discarding them, and one that was gathered before the
--- walk is gathered again. After an error (ok false: on every rank, see walk) the same
--- without gathering again, best effort (a later use of such a unit gathers it).
function Root:restore(list, writeback, ok)
  for i = #list, 1, -1 do
    local u, was_sharded = list[i][1], list[i][2]
    if ok and writeback then
      u:writeback()
      M.emit("writeback", self, u, was_sharded)
      if was_sharded then u:reshard() end
    elseif ok then
      u:reshard{discard = true}
      if not was_sharded then u:gather() end
    else
      pcall(u.reshard, u, {discard = true})
    end
  end
end

-- ---- parameters waiting for values (wrapped on meta) ---------------------------------------------

--- Parameters that were on meta when wrapped and have no values yet (set: param -> true).
function Root:set_pending(set)
  self._pending = next(set) ~= nil and set or nil
end

function Root:has_pending() return self._pending ~= nil end

--- The pending parameters as {param =, path =, unit =}, in unit (construction) order.
function Root:pending_list()
  local out = {}
  if self._pending == nil then return out end
  for _, u in ipairs(self._units) do
    local paths = u:paths()
    for i, p in ipairs(u:params()) do
      if self._pending[p] then out[#out + 1] = {param = p, path = paths[i], unit = u} end
    end
  end
  return out
end

--- These parameters hold values now (a loader wrote their shards; nil: all of them).
function Root:given_values(params)
  if self._pending == nil then return end
  if params == nil then self._pending = nil return end
  for _, p in ipairs(params) do self._pending[p] = nil end
  if next(self._pending) == nil then self._pending = nil end
end

--- The message for using a model whose meta parameters never got values (their shards hold
--- zeros, which must never pass for a model).
function Root:pending_error(what)
  local list = self:pending_list()
  local n = #list
  return ("%s: %d parameter%s of this model %s still on the meta device (first: %s): give "
    .. "them values with fsdp.materialize(model[, init_fn]) or fsdp.load, or wrap with init = "
    .. "... or sync_module_states = true"):format(what, n, n == 1 and "" or "s",
      n == 1 and "is" or "are", tostring(list[1] and list[1].path))
end

-- ---- forward order and prefetch ---------------------------------------------------------------------
--
-- The first forward of the root records two orders: the order in which units START their
-- forward (the forward prefetch chain, and forward_units), and the order in which they FINISH
-- it. Backward meets the units' "end" hooks in the reverse of the finish order, so that
-- reversed list is the backward prefetch chain: each unit prefetches the one whose backward
-- comes next. Units never called come last, in construction order, and take part in no chain.

--- A forward of unit u starts: returns the unit to prefetch after gathering u (or nil).
function Root:forward_begin(u)
  if u == self._by_module[self._model] and self._order == nil then
    self._rec = {started = {}, finished = {}, seen_start = {}, seen_finish = {}}
  end
  local rec = self._rec
  if rec and not rec.seen_start[u] then
    rec.seen_start[u] = true
    rec.started[#rec.started + 1] = u
  end
  return self._opts.prefetch and self._next and self._next[u] or nil
end

--- A forward of unit u finished.
function Root:forward_end(u)
  local rec = self._rec
  if rec == nil then return end
  if not rec.seen_finish[u] then
    rec.seen_finish[u] = true
    rec.finished[#rec.finished + 1] = u
  end
  if u ~= self._by_module[self._model] then return end
  self._rec = nil
  local order, done = rec.started, rec.finished
  local all = {unpack(order)}
  for _, v in ipairs(self._units) do
    if not rec.seen_start[v] then all[#all + 1] = v end
  end
  self._order = all
  self._next = {}
  for i, v in ipairs(order) do self._next[v] = order[i + 1] end
  if self._opts.prefetch then
    for i = #done, 1, -1 do done[i]:set_backward_prefetch(done[i - 1]) end
  end
end

-- ---- finding Roots ---------------------------------------------------------------------------------

--- The live Root whose tree holds module m, or nil.
function M.of(m)
  if type(m) ~= "table" then return nil end
  local R = rawget(m, MARK)
  if R == nil or R._dead then return nil end
  return R
end

--- The live Root that built unit u, or nil.
function M.of_unit(u)
  local R = root_of_unit[u]
  if R == nil or R._dead then return nil end
  return R
end

--- Raise (at the user) when module m belongs to a wrapped model whose meta parameters have no
--- values yet: their shards hold zeros, which must not be read as weights (pruned, counted).
function M.check_values(m, what)
  local R = M.of(m)
  if R ~= nil and R:has_pending() then util.raise(R:pending_error(what)) end
end

--- The live Root when model is its root, else nil.
function M.root(model)
  local R = M.of(model)
  if R ~= nil and R._model == model then return R end
  return nil
end

-- the raw field that marks a module of a wrapped model (nn.module refuses rewiring it)
M.MARK = MARK

return M
