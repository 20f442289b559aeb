-- fsdp.nn.module — the Module class protocol.
--
-- What lives here: classes (Module:extend), construction (calling a class), field registration
-- (modules and parameters assigned to fields, in assignment order), traversal (parameters,
-- named_parameters, modules, named_modules, children), train/eval, the module call (m(x) runs
-- m:forward(x); an error raised inside a submodule gets the submodule's path prefixed), and the
-- path-based parameter initialisation scheme (docs/nn.md, "Initialisation").
--
-- Instance layout. A module instance is a Lua table whose user-visible fields live in a side
-- table (rawget(m, FIELDS)): every assignment m.k = v therefore goes through __newindex, so
-- reassigning a registered field keeps its position and assigning nil removes it. The names of
-- registered fields (those holding a module or a parameter) are kept in assignment order in
-- rawget(m, ORDER). Integer keys (m[1], m[2], ... of Sequential / ModuleList) are stored raw in
-- the instance's array part so that #m and ipairs(m) work under LuaJIT (no __len on tables);
-- they come after the named fields in traversal order. Raw fields whose names start with "__"
-- are this file's bookkeeping, never user fields (two exceptions: "__fsdp_wrap", the mark that
-- lua/fsdp/state.lua puts on every module of a wrapped model, and "__checkpoint", the mark of
-- nn.checkpoint, lua/fsdp/nn/checkpoint.lua).
--
-- Invariants: a parameter is an object with a stable identity (invariant 1, docs/ARCHITECTURE.md); this file never
-- copies or replaces a parameter, it only holds references. Traversals deduplicate modules and
-- parameters by identity: a parameter (or module) reachable twice is reported once, under the
-- first path in traversal order.

local core = require "fsdp.core"
local ckpt = require "fsdp.nn.checkpoint"
local seeds = require "fsdp.seed"
local state = require "fsdp.state"
local util = require "fsdp.util"

local M = {}

local FIELDS = "__fields"   -- name -> value, every user field
local ORDER = "__order"     -- array of registered field names, assignment order
local KEYS = "__init_keys"  -- own parameter field name -> init key ("<top>/<path>"), owners only
local SEED = "__init_seed"  -- the seed the keys were assigned under
local SPECS = "__init_specs" -- field name -> {kind, a, b}: init override set by an ancestor
local IN_INIT = "__in_init" -- true while the module's own init runs

-- Whose values a parameter holds. Parameters made by nn.new_param (every built-in layer's), and
-- those a module puts in its own fields while its own init runs (a custom module's
-- nn.Parameter(zeros) that its reset_parameters fills), are the constructors' to initialise. A
-- parameter first put into a module's field from outside that module's init (a Linear's weight
-- replaced by the user's nn.Parameter(t), inside a parent's init or after construction) holds
-- the user's values, and keeps them unless an ancestor set an init spec for it.
local made = setmetatable({}, {__mode = "k"})
local constructed = setmetatable({}, {__mode = "k"})
local user_given = setmetatable({}, {__mode = "k"})
function M.mark_new(p)
  made[p] = true
  return p
end
local function note_param(owner, p)
  if rawget(owner, IN_INIT) then
    constructed[p] = true
  elseif not made[p] and not constructed[p] then
    user_given[p] = true
  end
end
local HOOKS = "__hooks"     -- {pre = {...}, post = {...}, user = n} or nil

-- ---- value kinds --------------------------------------------------------------------------

local is_tensor, is_module, is_param = util.is_tensor, util.is_module, util.is_param

M.is_tensor, M.is_module, M.is_param = is_tensor, is_module, is_param

-- ---- traversal ----------------------------------------------------------------------------

local join = util.join

local function describe(v)
  if is_module(v) then return v:type_name() end
  if is_tensor(v) then return "tensor" end
  return type(v)
end

-- m's array part, m[1] .. m[n], checked. A write over an existing element never reaches the
-- module (Lua calls __newindex for new keys only), so what set_field refuses is refused here,
-- when the tree is walked: a value that is neither a module nor a parameter, and a hole (an
-- element set to nil before others, which #m would silently cut off).
local function array_len(m)
  local n = #m
  for k, v in pairs(m) do
    if type(k) == "number" then
      if k > n or k < 1 or k % 1 ~= 0 then
        error(("%s[%s]: the elements must be m[1], m[2], ... without a hole (m[%d] is nil); "
          .. "remove one with table.remove(m, i)"):format(m:type_name(), tostring(k), n + 1), 0)
      end
      if not is_module(v) and not is_param(v) then
        error(("%s[%d]: integer fields hold modules or parameters (got %s)")
          :format(m:type_name(), k, describe(v)), 0)
      end
    end
  end
  return n
end

-- Depth-first, pre-order walk in registration order (named fields, then m[1], m[2], ...).
-- on_module(path, m) once per distinct module; on_param(path, p, owner, name) once per
-- distinct parameter, under its first path. Either callback may be nil.
local function walk(m, prefix, seen, on_module, on_param)
  if on_module then on_module(prefix, m) end
  local fields, order = rawget(m, FIELDS), rawget(m, ORDER)
  local function visit(name, v)
    if v == nil or seen[v] then return end
    seen[v] = true
    if is_module(v) then
      walk(v, join(prefix, name), seen, on_module, on_param)
    elseif on_param then
      on_param(join(prefix, name), v, m, name)
    end
  end
  for i = 1, #order do
    local name = order[i]
    visit(name, fields[name])
  end
  for i = 1, array_len(m) do visit(i, rawget(m, i)) end
end

-- The value of m's field `name` (a module, a parameter or any user value), or nil.
function M.field(m, name) return rawget(m, FIELDS)[name] end

-- The registered children and parameters of m in traversal order (named fields in assignment
-- order, then m[1], m[2], ...), as an array of {name, value}: the order walk uses. For the
-- layers above (wrap, meta) that walk trees themselves.
function M.own_entries(m)
  local fields, order = rawget(m, FIELDS), rawget(m, ORDER)
  local out = {}
  for i = 1, #order do
    local v = fields[order[i]]
    if v ~= nil then out[#out + 1] = {order[i], v} end
  end
  for i = 1, array_len(m) do
    local v = rawget(m, i)
    if v ~= nil then out[#out + 1] = {i, v} end
  end
  return out
end

local function collect_params(m)
  local paths, params = {}, {}
  walk(m, "", {[m] = true}, nil, function(path, p)
    paths[#paths + 1] = path
    params[#params + 1] = p
  end)
  return paths, params
end

local function collect_modules(m)
  local paths, mods = {}, {}
  walk(m, "", {[m] = true}, function(path, sub)
    paths[#paths + 1] = path
    mods[#mods + 1] = sub
  end, nil)
  return paths, mods
end

local function pairs_iter(a, b)
  local i = 0
  return function()
    i = i + 1
    if a[i] ~= nil then return a[i], b[i] end
  end
end

-- ---- classes ------------------------------------------------------------------------------

local call_module, set_field, module_tostring -- defined below
local construct

local function make_class(name, parent)
  local C = {}
  local mt = {
    __fsdp_module = true,
    __class = C,
    __index = function(self, k)
      local v = rawget(self, FIELDS)[k]
      if v ~= nil then return v end
      return C[k]
    end,
    __newindex = function(self, k, v) set_field(self, k, v) end,
    __call = function(self, ...) return call_module(self, ...) end,
    __tostring = function(self) return module_tostring(self) end,
  }
  rawset(C, "__name", name)
  rawset(C, "__mt", mt)
  rawset(C, "super", parent)
  setmetatable(C, {
    __index = parent,
    __call = function(cls, ...) return construct(cls, ...) end,
    __tostring = function() return "nn." .. name end,
  })
  return C
end

local Module = make_class("Module", nil)
M.Module = Module

-- Module:extend(name) -> a new class whose parent is self.
function Module:extend(name)
  if type(name) ~= "string" or name == "" then
    error("Module:extend(name): name must be a non-empty string", 2)
  end
  return make_class(name, self)
end

-- Whether m has forward hooks (a call of m then does more than m:forward).
function M.has_hooks(m) return rawget(m, HOOKS) ~= nil end

-- The class of a module instance (or nil).
function M.class_of(m)
  if not is_module(m) then return nil end
  return rawget(getmetatable(m), "__class")
end

-- isinstance(m, C): m's class is C or derives from it.
function M.isinstance(m, C)
  local c = M.class_of(m)
  while c ~= nil do
    if c == C then return true end
    c = rawget(c, "super")
  end
  return false
end

function Module:type_name() return rawget(M.class_of(self), "__name") end

-- Default constructor and forward.
function Module:init() end

function Module:forward()
  error(("%s has no forward"):format(self:type_name()), 0)
end

-- ---- fields -------------------------------------------------------------------------------

-- Nonzero while the library runs user code whose parameter replacements it checks itself (an
-- init_fn on a wrapped model: lua/fsdp/meta.lua puts a replaced parameter back and names it);
-- additions and removals stay refused.
local rewire_checked = 0
local function checked_done(...)
  rewire_checked = rewire_checked - 1
  return ...
end
--- fn(...) with parameter replacements on a wrapped model let through; fn must not raise (it
--- returns its errors), and must itself put back any parameter the user code replaced.
function M.with_checked_fields(fn, ...)
  rewire_checked = rewire_checked + 1
  return checked_done(fn(...))
end

-- A wrapped model's units own the parameter objects its fields held when it was wrapped: a
-- parameter or module put into (or taken out of) a field afterwards would belong to no unit,
-- and train unsharded, unreduced and unstepped on each rank without a word.
local function refuse_rewire(self, k, old, v)
  if rawget(self, state.MARK) == nil or rawequal(old, v) then return end
  if not (is_module(old) or is_param(old) or is_module(v) or is_param(v)) then return end
  if rewire_checked > 0 and is_param(old) and is_param(v) then return end
  error(("%s.%s: the module belongs to a wrapped model, and %s a %s there would leave it "
    .. "outside the model's units (neither sharded nor reduced nor stepped); fsdp.unwrap the "
    .. "model, change it, and wrap it again"):format(self:type_name(), tostring(k),
      v == nil and "removing" or (old == nil and "adding" or "replacing"),
      is_module(v == nil and old or v) and (v == nil and old or v):type_name() or "parameter"), 4)
end

set_field = function(self, k, v)
  if type(k) == "number" then
    refuse_rewire(self, k, rawget(self, k), v)
    -- array part: only modules and parameters (Sequential, ModuleList, lists of parameters),
    -- at positions 1, 2, ... (walk reads m[1] .. m[#m])
    if k < 1 or k % 1 ~= 0 then
      error(("%s[%s]: integer fields are positions 1, 2, ..."):format(self:type_name(),
        tostring(k)), 3)
    end
    if v ~= nil and not is_module(v) and not is_param(v) then
      error(("%s[%s]: integer fields hold modules or parameters (got %s)")
        :format(self:type_name(), tostring(k), describe(v)), 3)
    end
    if is_param(v) then note_param(self, v) end
    rawset(self, k, v)
    return
  end
  refuse_rewire(self, k, rawget(self, FIELDS)[k], v)
  if is_param(v) then note_param(self, v) end
  -- a field is read before the class: one named like a method would hide it from the library
  if k == "training" and type(v) ~= "boolean" then
    error(("%s.training: the train/eval flag is a boolean (got %s); name the field otherwise")
      :format(self:type_name(), describe(v)), 3)
  end
  if type(M.class_of(self)[k]) == "function" and not (v == nil or type(v) == "function") then
    error(("%s.%s: a field of that name would hide the method %s:%s; name it otherwise")
      :format(self:type_name(), tostring(k), self:type_name(), tostring(k)), 3)
  end
  if type(v) == "table" and not is_module(v) then
    -- a plain table's modules and parameters would be invisible to parameters(), optimizers,
    -- wrapping and checkpoints
    for _, x in pairs(v) do
      if is_module(x) or is_param(x) then
        error(("%s.%s: a plain table of modules or parameters is not registered; use "
          .. "nn.ModuleList{...}, or a field of the module for each"):format(self:type_name(),
            tostring(k)), 3)
      end
    end
  end
  local fields, order = rawget(self, FIELDS), rawget(self, ORDER)
  local pos
  for i = 1, #order do
    if order[i] == k then pos = i break end
  end
  local register = v ~= nil and (is_module(v) or is_param(v))
  fields[k] = v
  if register and pos == nil then
    order[#order + 1] = k
  elseif not register and pos ~= nil then
    table.remove(order, pos)
  end
end

-- ---- traversal API ------------------------------------------------------------------------

-- Array of the distinct parameters, in traversal order.
function Module:parameters()
  local _, params = collect_params(self)
  return params
end

-- Iterator of (path, parameter); a tied parameter appears once, under its first path.
function Module:named_parameters()
  return pairs_iter(collect_params(self))
end

-- Array of the distinct modules (self first), pre-order.
function Module:modules()
  local _, mods = collect_modules(self)
  return mods
end

-- Iterator of (path, module); the root has path "".
function Module:named_modules()
  return pairs_iter(collect_modules(self))
end

-- Direct children (registered modules), in order, deduplicated.
function Module:named_children()
  local names, mods, seen = {}, {}, {}
  local fields, order = rawget(self, FIELDS), rawget(self, ORDER)
  local function add(name, v)
    if is_module(v) and not seen[v] then
      seen[v] = true
      names[#names + 1] = tostring(name)
      mods[#mods + 1] = v
    end
  end
  for i = 1, #order do add(order[i], fields[order[i]]) end
  for i = 1, #self do add(i, rawget(self, i)) end
  return pairs_iter(names, mods)
end

function Module:children()
  local out = {}
  for _, m in self:named_children() do out[#out + 1] = m end
  return out
end

-- Number of elements over the distinct parameters.
function Module:num_parameters()
  local n = 0
  for _, p in ipairs(self:parameters()) do n = n + p:numel() end
  return n
end

-- train(mode) sets m.training on every module of the tree (mode defaults to true); eval() is
-- train(false). Both return self.
function Module:train(mode)
  mode = mode ~= false
  for _, m in ipairs(self:modules()) do rawget(m, FIELDS).training = mode end
  return self
end

function Module:eval() return self:train(false) end

-- ---- freezing -------------------------------------------------------------------------------

-- The parameters of m whose path (named_parameters: a tie under its first path) matches one of
-- the patterns (nil: all). A pattern that matches nothing is an error listing the paths.
local function params_matching(m, patterns, what)
  local pats = util.patterns(patterns, "patterns", what)
  local all, out = {}, {}
  for path, p in m:named_parameters() do all[#all + 1] = {path, p} end
  for _, pat in ipairs(pats or {}) do
    local ok, hit = pcall(function()
      for _, e in ipairs(all) do if e[1]:find(pat) then return true end end
      return false
    end)
    if not ok then util.raise(("%s: bad pattern %q: %s"):format(what, pat, tostring(hit))) end
    if not hit then
      local names = {}
      for i, e in ipairs(all) do names[i] = e[1] end
      util.raise(("%s: the pattern %q matches no parameter; the parameters are: %s")
        :format(what, pat, util.few(names, 12)))
    end
  end
  for _, e in ipairs(all) do
    local take = pats == nil
    for _, pat in ipairs(pats or {}) do take = take or e[1]:find(pat) ~= nil end
    if take then out[#out + 1] = e[2] end
  end
  return out
end

-- The dtypes a parameter may require a gradient in (and Module:to may convert it to); a
-- parameter of another dtype (i64, i32, u8, bool: values kept with the model) never does.
local FLOAT = {f32 = true, bf16 = true, f16 = true, f64 = true}

local function set_requires_grad(m, patterns, on, what)
  for _, p in ipairs(params_matching(m, patterns, what)) do
    if FLOAT[p:dtype()] or on == false then -- unfreeze leaves integer parameters alone
      local ok, err = pcall(function() p.requires_grad = on end)
      if not ok then util.reraise(err) end
    end
  end
  return m
end

-- freeze([patterns]) -> self: p.requires_grad = false for every parameter whose path (as
-- named_parameters gives it, relative to self) matches one of the Lua patterns (a string or a
-- list; nil: every parameter). unfreeze([patterns]) -> self sets it back to true, on the
-- parameters of a float dtype (an integer or bool one never requires a gradient). Frozen
-- parameters get no gradient, optimizers skip them and, wrapped, their units reduce nothing
-- for them when every parameter of the unit is frozen (docs/fsdp.md "Freezing parameters").
function Module:freeze(patterns) return set_requires_grad(self, patterns, false, "freeze") end
function Module:unfreeze(patterns) return set_requires_grad(self, patterns, true, "unfreeze") end

-- Drops every parameter's gradient (p.grad = nil): the next backward allocates afresh. On a
-- wrapped root (fsdp.wrap) it also zeroes every unit's gradient shard, where the gradients of
-- a sharded model accumulate.
-- Module:to(device | dtype [, device | dtype]) -> self: every parameter moved in place (the same
-- parameter objects, so ties and saved references stay; gradients move with them). A model
-- must be moved before it is wrapped (its units' buffers live where its parameters are). The
-- dtype is a float one; it converts the float parameters only (as PyTorch's Module.to):
-- integer and bool parameters keep theirs and move to the device.
function Module:to(a, b)
  local device, dtype
  if a == nil then M.raise("to: expected a device or dtype name (got nothing)") end
  for _, x in ipairs{a, b} do
    if type(x) ~= "string" then M.raise(("to: expected a device or dtype name (got %s)"):format(type(x))) end
    if core.dtype_name(x) then
      if dtype ~= nil then M.raise(("to: two dtypes (%s and %s)"):format(dtype, x)) end
      dtype = x
    else
      if device ~= nil then M.raise(("to: two devices (%s and %s)"):format(device, x)) end
      device = x
    end
  end
  if state.of(self) ~= nil then
    M.raise("to: the model is wrapped: move it and set its dtype before fsdp.wrap (for "
      .. "computing in bf16 or f16, wrap with mp = ...)")
  end
  if dtype ~= nil and not FLOAT[core.dtype_name(dtype)] then
    M.raise(("to: parameters take a float dtype (f32, bf16, f16, f64), not %s")
      :format(core.dtype_name(dtype)))
  end
  for path, p in self:named_parameters() do
    local ok, err = pcall(core.param_to, p, device or p.device, FLOAT[p:dtype()] and dtype or nil)
    if not ok then
      util.reraise(("to: %s: %s"):format(path, (util.strip(err):gsub("^to: ", ""))))
    end
  end
  return self
end

-- Drops the gradients of this module's parameters (p.grad = nil). A wrapped model keeps them in
-- its units' gradient shards (and, under fsdp.no_sync, held full gradients): its root zeroes
-- every unit; a module inside it drops its own parameters' gradients only, their ranges of
-- those buffers and their has-gradient flags (a unit all of whose parameters are its own is
-- zeroed whole), so a step skips them as a plain optimizer skips a nil p.grad. Local: every
-- rank calls it alike, as every rank's flags are agreed at the step.
function Module:zero_grad()
  local params = self:parameters()
  for _, p in ipairs(params) do p.grad = nil end
  local R = state.of(self)
  if R == nil then return end
  if R:model() == self then return R:zero_grad() end
  local mine = {}
  for _, p in ipairs(params) do mine[p] = true end
  for _, u in ipairs(R:units()) do
    local own, all = {}, true
    for i, p in ipairs(u:params()) do
      if mine[p] then own[#own + 1] = i else all = false end
    end
    if #own > 0 and all then
      u:zero_grad()
    else
      for _, i in ipairs(own) do u:zero_param_grad(i) end
    end
  end
end

-- ---- forward hooks (used by sharding to gather/reshard around a unit's forward) -------------

-- fn(module, ...inputs) runs before forward; returns a handle with :remove(). When fn returns
-- values, they replace the inputs (all of them), as a PyTorch forward pre-hook returning a
-- tuple; returning nothing (or a single nil) keeps them.
function Module:register_forward_pre_hook(fn) return M._add_hook(self, "pre", fn) end
-- fn(module, output) runs after forward (first result only). When it returns a value other than
-- nil, that value replaces the first result.
function Module:register_forward_hook(fn) return M._add_hook(self, "post", fn) end

-- internal: a hook of the library itself (sharding's), which keeps no tensor it is handed, so
-- the tensors it sees may still be released (see "releasing intermediates" below).
function M._add_hook(m, kind, fn, internal)
  if type(fn) ~= "function" then error("hook must be a function", 3) end
  local hooks = rawget(m, HOOKS)
  if hooks == nil then
    hooks = {pre = {}, post = {}, user = 0}
    rawset(m, HOOKS, hooks)
  end
  -- The lists are replaced, never changed in place: a call in progress runs the hooks it
  -- started with, whatever a hook adds or removes meanwhile (removing itself, say).
  local list = {unpack(hooks[kind])}
  list[#list + 1] = fn
  hooks[kind] = list
  if not internal then hooks.user = hooks.user + 1 end
  local removed = false
  return {remove = function()
    if removed then return end
    removed = true
    local rest, dropped = {}, false
    for _, h in ipairs(hooks[kind]) do
      if h == fn and not dropped then dropped = true else rest[#rest + 1] = h end
    end
    hooks[kind] = rest
    if not internal then hooks.user = hooks.user - 1 end
    if #hooks.pre == 0 and #hooks.post == 0 and rawget(m, HOOKS) == hooks then rawset(m, HOOKS, nil) end
  end}
end

-- ---- releasing intermediates ----------------------------------------------------------------
--
-- Lua's collector sees a tensor as a few bytes, so the activations a forward leaves behind in
-- dead Lua values would stay allocated (and counted by fsdp.memory()) until a collection,
-- although backward has long released the tape's references. The library's own forwards know
-- which tensors they made and no longer need: they drop their reference at once with
-- M.release (t:free() on that value; the tape keeps its own reference for backward), and the
-- memory goes back as the reverse walk frees each node. A tensor that user code has been
-- handed is never released: the inputs and results of a module whose forward is not one of
-- the library's (M.library_forward), and of a module with user hooks, are marked seen.

local seen = setmetatable({}, {__mode = "k"}) -- tensors user code may hold
local library = {} -- forward functions that only pass tensors to module calls and ops

-- Declare cls.forward one of the library's own (its intermediates may be released).
function M.library_forward(cls) library[rawget(cls, "forward")] = true end

local function mark(...)
  for i = 1, select("#", ...) do
    local v = select(i, ...)
    if type(v) == "userdata" then seen[v] = true end
  end
  return ...
end

-- Free t, a tensor the calling library forward made, unless user code has seen it or it is
-- one of the values kept (an input passed through, the result).
function M.release(t, ...)
  if t == nil or seen[t] then return end
  for i = 1, select("#", ...) do
    if rawequal(t, (select(i, ...))) then return end
  end
  t:free()
end

local function run_post(self, post, first, ...)
  for i = 1, #post do
    local r = post[i](self, first)
    if r ~= nil then first = r end
  end
  return first, ...
end

local function pack(...) return {n = select("#", ...), ...} end

-- self:forward(...), checkpointed when nn.checkpoint marked self: inside the forward hooks, so
-- that a unit's gather and tape hooks enclose the checkpoint.
local function forward(self, ...)
  if ckpt.is_marked(self) then return ckpt.run(self, ...) end
  return self:forward(...)
end

-- Pre-hooks pre[i..] then forward and the post-hooks (the lists as the call found them); a
-- pre-hook that returns values replaces the inputs of the ones after it and of forward
-- (returning nothing, or nil, keeps them).
local function run_pre(self, pre, post, i, ...)
  if i > #pre then return run_post(self, post, forward(self, ...)) end
  local r = pack(pre[i](self, ...))
  if r.n == 0 or (r.n == 1 and r[1] == nil) then return run_pre(self, pre, post, i + 1, ...) end
  return run_pre(self, pre, post, i + 1, unpack(r, 1, r.n))
end

local function run_forward(self, ...)
  local hooks = rawget(self, HOOKS)
  if library[self.forward] and (hooks == nil or hooks.user == 0) then
    if hooks == nil then return forward(self, ...) end
    return run_pre(self, hooks.pre, hooks.post, 1, ...)
  end
  mark(...)
  if hooks == nil then return mark(forward(self, ...)) end
  return mark(run_pre(self, hooks.pre, hooks.post, 1, ...))
end

-- ---- the module call and error paths --------------------------------------------------------
--
-- Every module call runs its forward under xpcall with on_error (one handler for all, no
-- closure per call). The handler runs at the error point, in the innermost module call, while
-- the Lua stack still holds every active call. It finds them by walking the stack up to the
-- outermost call's frame (call_module and call_outer frames hold their module as their first
-- local) and prefixes the innermost module's path relative to the outermost one:
--   "blocks.2.mlp.fc (Linear): linear: ... shapes ..."
-- Each enclosing call raises the message again and their handlers pass it through unchanged
-- (it is one of `made`), so the prefix is applied once, and code that catches an error inside a
-- forward (a pcall of a child, nn.checkpoint, fsdp.no_grad) gets the finished message: raising
-- it again keeps its path and is not prefixed again. Since the stack is the record of active
-- calls, nothing is left behind by an error caught below: a later error gets its own path.
-- Errors that are not strings (tables, tensors) pass through untouched.
--
-- Only the outermost call (`inside` false) marks where the walk stops and clears a traceback
-- left by an earlier error. The flag is one for all threads (a coroutine.running() per call
-- would stop the trace): a module called in a coroutine resumed inside a forward, or while a
-- coroutine is suspended inside its own outermost call, is a nested call, and its path starts
-- at the first module call on its thread.
--
-- The original message is kept whole. When it has no "file:line:" location (errors from C ops)
-- and the innermost Lua frame that raised it is user code (not the nn library), that location is
-- inserted, so errors in a custom forward still say where they happened.
--
-- The outermost call raises the error again, and a traceback taken there would start at
-- module.lua and lose every frame inside forward (the user's). So the handler also takes the
-- traceback at the error point and leaves it, message first, in the registry under
-- TRACEBACK_KEY; the host's traceback handler (src/host/setup.c: fsdprun, the REPL, the
-- embedding runtime) prints it when the message it is given is that message. The next
-- outermost call clears what an error caught by the user's pcall left there.

local is_lib_source, is_lib_file = util.is_lib_source, util.is_lib_file
local TRACEBACK_KEY = "fsdp.traceback" -- also in src/host/setup.c
local registry = debug.getregistry()
local getinfo, getlocal = debug.getinfo, debug.getlocal
local inside = false -- true while an outermost module call runs
local traceback_left = false
-- The messages on_error made lately (passed through, not prefixed again): a set, not the last
-- one, so that a forward which caught two errors can raise the first again. Bounded: emptied
-- when it grows past MADE_MAX (a message made that long ago is raised again rarely, and then
-- only gets a second prefix).
local made, n_made, MADE_MAX = {}, 0, 64
local call_outer -- defined below, after on_error
local call_recompute -- likewise
-- The module of the outermost call running (nil outside one); a checkpointed call keeps it, so
-- that an error of its recomputation in backward can name its path from there.
local outer_module = nil

-- "file:line: " of the innermost stack frame outside the fsdp Lua library (lua/fsdp/util.lua).
M.user_where = util.user_where

-- Raise msg located at the user's code (lua/fsdp/util.lua).
M.raise = util.raise

-- Path of `child` inside `parent`'s tree (first path), or nil if it is not a descendant.
local function path_within(parent, child)
  local found
  walk(parent, "", {[parent] = true}, function(path, m)
    if found == nil and rawequal(m, child) then found = path end
  end, nil)
  return found
end

-- The modules of the module calls active on this thread, outermost first, read from the Lua
-- stack of the caller (up to the outermost call's frame).
-- A recomputation (call_recompute, in backward) is where the walk stops too; its frame also
-- holds the module of the outermost call that first ran it (nil: none), returned third.
local function active_modules()
  local chain, n, outer = {}, 0, nil
  for level = 3, 1e6 do
    local info = getinfo(level, "f")
    if info == nil then break end
    local f = info.func
    if f == call_module or f == call_outer or f == call_recompute then
      n = n + 1
      local _, m = getlocal(level, 1)
      chain[n] = m
      if f == call_recompute then
        local _, o = getlocal(level, 2)
        outer = o
        break
      end
      if f == call_outer then break end
    end
  end
  for i = 1, math.floor(n / 2) do chain[i], chain[n + 1 - i] = chain[n + 1 - i], chain[i] end
  return chain, n, outer
end

local function error_prefix(chain, n, outer)
  -- a recomputation's module has the path it had in the call that first ran it
  local path = outer ~= nil and path_within(outer, chain[1]) or ""
  for i = 2, n do
    local rel = path_within(chain[i - 1], chain[i])
    if rel == nil then
      path = "" -- called from outside its caller's tree: restart from here
    elseif rel ~= "" then
      path = path == "" and rel or (path .. "." .. rel)
    end
  end
  local name = chain[n]:type_name()
  if path == "" then return name .. ": " end
  return ("%s (%s): "):format(path, name)
end

-- Leave the traceback of the error point (on_error's caller) for the host.
local function leave_traceback(msg)
  registry[TRACEBACK_KEY] = debug.traceback(msg, 3)
  traceback_left = true
end

local function on_error(e)
  if type(e) ~= "string" then return e end
  if made[e] then
    -- raised again by an enclosing call, or by code that caught it: its traceback is the one
    -- of its error point, unless a later outermost call cleared that
    if not traceback_left then leave_traceback(e) end
    return e
  end
  local chain, n, outer = active_modules()
  if n == 0 then return e end
  local msg = e
  -- An engine op (a C function other than `error`) locates its message at its Lua caller.
  -- When that caller is the library (a built-in forward, or a tail call that left only the
  -- module-call frame) the location says nothing: drop it, and name the innermost Lua frame
  -- instead when that is user code. Errors raised by Lua code keep their message untouched.
  local raiser = getinfo(2, "Sf")
  if raiser ~= nil and raiser.what == "C" and raiser.func ~= error then
    local file, rest = msg:match("^([^\n]-):%d+: (.*)$")
    if file ~= nil and is_lib_file(file) then msg, file = rest, nil end
    if file == nil then
      for level = 3, 40 do
        local info = getinfo(level, "Sl")
        if info == nil then break end
        if info.what ~= "C" and info.currentline and info.currentline > 0 then
          if not is_lib_source(info.source) then
            msg = ("%s:%d: %s"):format(info.short_src, info.currentline, msg)
          end
          break
        end
      end
    end
  end
  msg = error_prefix(chain, n, outer) .. msg
  leave_traceback(msg)
  if n_made >= MADE_MAX then made, n_made = {}, 0 end
  made[msg], n_made = true, n_made + 1
  return msg
end

local function finish_nested(ok, ...)
  if not ok then error((...), 0) end
  return ...
end

local function finish_outer(ok, ...)
  inside, outer_module = false, nil
  if not ok then error((...), 0) end
  return ...
end

-- The outermost module call (its frame marks where active_modules stops).
call_outer = function(self, ...)
  inside, outer_module = true, self
  if traceback_left then registry[TRACEBACK_KEY], traceback_left = nil, false end
  return finish_outer(xpcall(run_forward, on_error, self, ...))
end

local function finish_recompute(was_inside, was_outer, ok, ...)
  inside, outer_module = was_inside, was_outer
  if not ok then error((...), 0) end
  return ...
end

-- nn.checkpoint's recomputation of self's forward fn in backward: an outermost call of its own
-- (no hooks), whose errors get self's path from `outer`, the outermost module of the call that
-- first ran it (checkpoint.lua keeps it), as a forward error would have.
call_recompute = function(self, outer, fn, ...)
  local was_inside, was_outer = inside, outer_module
  inside, outer_module = true, outer
  return finish_recompute(was_inside, was_outer, xpcall(fn, on_error, self, ...))
end
ckpt.bind(call_recompute, function() return outer_module end)

-- A nested call: not a tail call, so that its frame stays on the stack for active_modules.
call_module = function(self, ...)
  if inside then return finish_nested(xpcall(run_forward, on_error, self, ...)) end
  return call_outer(self, ...)
end

-- ---- construction and initialisation --------------------------------------------------------
--
-- A parameter's initial values are a pure function of (seed, key, element index) where
-- key = "<top>/<path>": <path> is its first path in the tree of the outermost construction
-- that contains it, and <top> counts outermost constructions since the last fsdp.manual_seed.
-- Constructors nest (GPT builds Blocks builds Linears); only when the outermost one returns are
-- keys assigned (assign_keys) and every module's reset_parameters run. A module that is built
-- standalone and then put into a container is initialised again when the container's
-- constructor returns, under its final path, so creation order never matters.
--
-- reset_parameters() of a module initialises only the parameters it owns (those whose first
-- path runs through one of its own fields), through init_param, which honours an init spec
-- that an ancestor set with set_init (GPT does this for its Linears and Embeddings). Keeping
-- every reset local to its module is what lets a sharded materialize initialise unit by unit.

local records = setmetatable({}, {__mode = "k"}) -- parameter -> {seed, key, kind, a, b}
M.init_records = records


local depth = 0
local top_count, top_epoch = 0, nil

-- The k-th outermost construction since the last fsdp.manual_seed (fsdp.seed_epoch counts
-- manual_seed calls), with the seed in force.
local function next_top()
  local epoch = seeds.seed_epoch()
  if epoch ~= top_epoch then top_count, top_epoch = 0, epoch end
  top_count = top_count + 1
  return top_count, seeds.seed()
end

-- A parameter is fresh while it holds exactly what automatic initialisation put there (or was
-- never initialised) and its values are here (dense or meta). Only fresh parameters are
-- re-keyed and re-initialised when an enclosing constructor adopts their module: a trained
-- module (an optimizer step changed its version), values the user wrote, or a sharded
-- parameter (its values live in a unit's shards) are kept.
local function fresh(p)
  if not p.has_data and p.device ~= "meta" then return false end
  local r = records[p]
  if r == nil then return not user_given[p] end
  if r.user then return false end
  if r.version == nil then return true end
  local id, v = core.memory_stamp(p)
  return r.version == p.version and r.mem_id == id and r.mem_version == v
end

-- p (with record r) holds what initialisation put there: fresh() compares writes since through
-- p itself (p.version) and through any other tensor over its memory (a view, detach(), whose
-- versions are their own: core.memory_stamp), so values written either way are kept.
local function note_init(r, p)
  r.version = p.version
  r.mem_id, r.mem_version = core.memory_stamp(p)
end

-- Give every distinct fresh parameter of root's tree its key; owners record it by field name
-- (a kept parameter keeps its key).
local function assign_keys(root, top_index, seed)
  local prefix = tostring(top_index) .. "/"
  walk(root, "", {[root] = true}, function(_, m)
    rawset(m, KEYS, {})
    rawset(m, SEED, seed)
  end, function(path, p, owner, name)
    local r = records[p]
    if r ~= nil and not fresh(p) then
      rawget(owner, KEYS)[name] = r.key
      return
    end
    local key = prefix .. path
    rawget(owner, KEYS)[name] = key
    if r == nil then
      r = {user = user_given[p] or nil} -- the user's own values: kept (fresh is false)
      records[p] = r
    end
    r.seed, r.key, r.kind, r.a, r.b, r.version = seed, key, nil, nil, nil, nil
  end)
end

local auto_init = false -- true while a constructor initialises the tree it just built

-- Run every module's reset_parameters over root's tree (keys already assigned).
function M.init_tree(root)
  for _, m in ipairs(root:modules()) do m:reset_parameters() end
  return root
end

-- The outermost constructor's initialisation: like init_tree, but parameters that are not
-- fresh keep their values.
local function auto_init_tree(root)
  auto_init = true
  local ok, err = pcall(M.init_tree, root)
  auto_init = false
  if not ok then error(err, 0) end
  return root
end

construct = function(C, ...)
  local self = setmetatable({[FIELDS] = {training = true}, [ORDER] = {}}, rawget(C, "__mt"))
  local d = depth
  depth = d + 1
  rawset(self, IN_INIT, true)
  if d > 0 then
    self:init(...)
    rawset(self, IN_INIT, nil)
    depth = d
    return self
  end
  local ok, err = pcall(self.init, self, ...)
  rawset(self, IN_INIT, nil)
  depth = 0
  if not ok then error(err, 0) end
  assign_keys(self, next_top())
  auto_init_tree(self)
  return self
end

-- set_init(name, kind, a, b): from now on this module's parameter field `name` is initialised
-- with kind "normal" (mean a, std b), "uniform" ([a, b)) or "constant" (a), whatever its class's
-- reset_parameters asks for. Used by containers with their own init policy (GPT). Takes effect
-- at the next reset_parameters (the outermost constructor runs it when it returns).
function Module:set_init(name, kind, a, b)
  if kind ~= "normal" and kind ~= "uniform" and kind ~= "constant" then
    error(("set_init: kind must be normal, uniform or constant (got %s)"):format(tostring(kind)), 2)
  end
  local specs = rawget(self, SPECS)
  if specs == nil then
    specs = {}
    rawset(self, SPECS, specs)
  end
  specs[name] = {kind, a, b}
end

-- init_param(name, kind, a, b): fill this module's parameter field `name` from its key: the
-- building block of reset_parameters. An ancestor's set_init spec wins over (kind, a, b).
-- Does nothing (returns false) for a parameter this module does not own (a tie first reached
-- through another module), before keys exist (inside a constructor), or on the meta device
-- (the spec is still recorded for materialize).
function Module:init_param(name, kind, a, b)
  local spec = rawget(self, SPECS)
  spec = spec and spec[name]
  if spec then kind, a, b = spec[1], spec[2], spec[3] end
  local keys = rawget(self, KEYS)
  local key = keys and keys[name]
  local p = self[name]
  if key == nil or p == nil then return false end
  local seed = rawget(self, SEED)
  local r = records[p]
  if r == nil then
    r = {seed = seed, key = key}
    records[p] = r
  end
  -- kept: trained or user-written values, and the user's own parameters, unless an ancestor's
  -- spec names them
  if auto_init and not fresh(p) and not (spec and r.user) then return false end
  r.kind, r.a, r.b, r.user = kind, a, b, nil
  if p.device == "meta" then return false end
  if kind == "normal" then
    core.init_normal(p, seed, key, a, b)
  elseif kind == "uniform" then
    core.init_uniform(p, seed, key, a, b)
  elseif kind == "constant" then
    p:fill(a)
  else
    error(("init_param: unknown kind %s"):format(tostring(kind)), 2)
  end
  note_init(r, p)
  return true
end

-- Default: parameters given by the user (nn.Parameter fields) keep their values unless an
-- ancestor set an init spec for them. Classes with parameters override this.
function Module:reset_parameters()
  local specs = rawget(self, SPECS)
  if specs == nil then return end
  for name in pairs(specs) do self:init_param(name) end
end

-- The init record of a parameter: {seed =, key =, kind =, a =, b =} (kind nil: the values are
-- the user's own). For materialize and inspection.
function M.init_record(p) return records[p] end

-- p was just filled from its init record (fsdp.materialize): it is fresh, as after an eager
-- init. No-op for a parameter without a record of a kind.
function M.note_init(p)
  local r = records[p]
  if r ~= nil and r.kind ~= nil then note_init(r, p) end
end

-- ---- for fsdp.materialize and fsdp.retie (lua/fsdp/meta.lua) --------------------------------

-- The init owner of every distinct parameter of root's tree that has one: param ->
-- {module =, name =}, the module whose own field (with an init key) reaches it first. Only that
-- module's reset_parameters initialises it (see "construction and initialisation").
function M.init_owners(root)
  local out = {}
  walk(root, "", {[root] = true}, nil, function(_, p, owner, name)
    local keys = rawget(owner, KEYS)
    if keys ~= nil and keys[name] ~= nil then out[p] = {module = owner, name = name} end
  end)
  return out
end

-- After fields were reassigned (fsdp.retie made two fields hold one parameter): a module keeps
-- the init key of a field only while it is that parameter's first path, so a tied parameter is
-- still initialised once, by the module that reaches it first, with that module's key (what an
-- eagerly tied model does). Returns root.
function M.drop_unowned_keys(root)
  local first = {}
  walk(root, "", {[root] = true}, nil, function(_, p, owner, name)
    first[p] = {owner, name}
  end)
  for _, m in ipairs(root:modules()) do
    local keys = rawget(m, KEYS)
    if keys ~= nil then
      for name in pairs(keys) do
        local p = rawget(m, FIELDS)[name]
        local f = p ~= nil and first[p]
        if not f or f[1] ~= m or f[2] ~= name then keys[name] = nil end
      end
    end
  end
  return root
end

-- ---- printing -------------------------------------------------------------------------------

function Module:extra_repr() return "" end

local function shape_str(t)
  return table.concat(t:shape(), "x")
end

local function fmt_count(n)
  local s = tostring(n)
  local out = s:reverse():gsub("(%d%d%d)", "%1,"):reverse()
  return (out:gsub("^,", ""))
end

module_tostring = function(root)
  -- first path of every parameter, to point out ties
  local first = {}
  for path, p in root:named_parameters() do first[p] = path end
  local lines, seen = {}, {}
  local n = 0
  for p in pairs(first) do n = n + p:numel() end
  local function line(m, indent, label, path)
    local extra = m:extra_repr()
    local head = m:type_name() .. (extra ~= "" and ("(" .. extra .. ")") or "")
    local notes = {}
    local fields, order = rawget(m, FIELDS), rawget(m, ORDER)
    local own = {}
    for i = 1, #order do own[#own + 1] = {order[i], fields[order[i]]} end
    for i = 1, #m do own[#own + 1] = {i, rawget(m, i)} end
    for _, e in ipairs(own) do
      local name, v = e[1], e[2]
      if is_param(v) then
        local here = path == "" and tostring(name) or (path .. "." .. tostring(name))
        if first[v] ~= here then notes[#notes + 1] = ("%s tied to %s"):format(name, first[v]) end
      end
    end
    if #notes > 0 then head = head .. " [" .. table.concat(notes, "; ") .. "]" end
    lines[#lines + 1] = indent .. (label and (label .. ": ") or "") .. head
    for _, e in ipairs(own) do
      local name, v = e[1], e[2]
      local sub = path == "" and tostring(name) or (path .. "." .. tostring(name))
      if is_module(v) then
        if seen[v] then
          lines[#lines + 1] = indent .. "  " .. tostring(name) .. ": (shared) " .. v:type_name()
        else
          seen[v] = true
          line(v, indent .. "  ", tostring(name), sub)
        end
      elseif is_param(v) and m.extra_repr == Module.extra_repr then
        lines[#lines + 1] = indent .. "  " .. tostring(name) .. ": Parameter(" .. shape_str(v) .. ")"
      end
    end
  end
  seen[root] = true
  line(root, "", nil, "")
  lines[1] = lines[1] .. ("  -- %s parameters"):format(fmt_count(n))
  return table.concat(lines, "\n")
end

return M
