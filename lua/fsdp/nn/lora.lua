-- fsdp.nn.lora — low-rank adapters (LoRA) on Linear layers. See docs/nn.md ("LoRA").
--
-- nn.lora.apply(model, {targets =, rank =, alpha =}) gives every Linear whose path matches one
-- of the targets an adapter: the Linear becomes a LoRALinear (the same object, its class
-- changed; weight and bias keep their identity and paths) with a child `lora`, an nn.LoRA
-- holding A (rank x in) and B (out x rank):
--     y = x W^T + b + (alpha / rank) (x A^T) B^T
-- A starts small and random (uniform +-1/sqrt(in), as PEFT), B at zeros, so an adapted model
-- computes what the base did until B trains. apply freezes every other parameter of the model
-- (module:freeze) but earlier applies' adapters, so an optimizer over the model trains the
-- adapters only.
-- nn.lora.merge(model) folds each adapter into its Linear (W += (alpha / rank) B A), removes
-- the adapter and makes the Linear a Linear again: the model's parameters and paths are the
-- base model's once more.
--
-- Sharding: adapters are parameters like any other; add them before fsdp.wrap (on a model
-- built with fsdp.meta they are meta too and fsdp.materialize gives them their values, the same
-- as an eager build). A wrapped model is refused by both functions: apply would add parameters
-- no unit holds, merge would remove parameters the units hold (fsdp.unwrap it first).

local core = require "fsdp.core"
local state = require "fsdp.state"
local util = require "fsdp.util"
local base = require "fsdp.nn.module"
local L = require "fsdp.nn.layers"

local Module, release, raise = base.Module, base.release, util.raise

local lora = {}

-- ---- the adapter ----------------------------------------------------------------------------

local LoRA = Module:extend("LoRA")
lora.LoRA = LoRA

local function check_opts(fn, opts)
  opts = util.check_opts(fn, opts, {"rank", "alpha"})
  local r = opts.rank or 8
  if not util.is_int(r, 1) then
    raise(("%s: rank must be %s (got %s)"):format(fn, util.int_range(r, 1), util.got(opts.rank)))
  end
  local alpha = opts.alpha or r
  if type(alpha) ~= "number" or alpha ~= alpha or alpha <= 0 or alpha == math.huge then
    raise(("%s: alpha must be a finite number > 0 (got %s)"):format(fn, tostring(opts.alpha)))
  end
  return r, alpha
end

-- LoRA(in, out, {rank = 8, alpha = rank}): x (..., in) -> (alpha / rank) (x A^T) B^T (..., out).
function LoRA:init(i, o, opts)
  for _, v in ipairs{{i, "in_features"}, {o, "out_features"}} do
    if not util.is_int(v[1], 1) then
      raise(("nn.LoRA: %s must be %s (got %s)"):format(v[2], util.int_range(v[1], 1), util.got(v[1])))
    end
  end
  local r, alpha = check_opts("nn.LoRA", opts)
  self.in_features, self.out_features, self.rank, self.alpha = i, o, r, alpha
  self.scale = alpha / r
  self.A = L.new_param{r, i}
  self.B = L.new_param{o, r}
end

function LoRA:reset_parameters()
  local k = 1 / math.sqrt(self.in_features)
  self:init_param("A", "uniform", -k, k)
  self:init_param("B", "constant", 0)
end

function LoRA:forward(x)
  local h = core.F.linear(x, self.A) -- (..., r)
  local s = h * self.scale
  release(h, x, s)
  local out = core.F.linear(s, self.B) -- (..., out)
  release(s, x, out)
  return out
end
base.library_forward(LoRA)

function LoRA:extra_repr()
  return ("%d -> %d, rank=%d, alpha=%g"):format(self.in_features, self.out_features, self.rank,
    self.alpha)
end

-- ---- a Linear with an adapter ---------------------------------------------------------------

local LoRALinear = L.Linear:extend("LoRALinear")
lora.LoRALinear = LoRALinear

function LoRALinear:forward(x)
  local y = core.F.linear(x, self.weight, self.bias)
  local d = self.lora(x)
  local out = y + d
  release(y, x, out)
  release(d, x, out)
  return out
end
base.library_forward(LoRALinear)

-- ---- apply / merge --------------------------------------------------------------------------

local function refuse_wrapped(fn, model, what)
  if not base.is_module(model) then
    raise(("%s: expected a module (got %s)"):format(fn, type(model)))
  end
  if state.of(model) ~= nil then raise(("%s: the model is wrapped; %s"):format(fn, what)) end
end

-- The Linear layers of model (path, module), in named_modules order.
local function linears(model)
  local out = {}
  for path, m in model:named_modules() do
    if base.isinstance(m, L.Linear) then out[#out + 1] = {path, m} end
  end
  return out
end

-- apply(model, {targets = {"%.attn%.qkv$", "%.attn%.proj$"}, rank = 8, alpha = rank,
-- freeze = true}) -> array of the adapted module paths. targets: Lua patterns (a string or a
-- list) matched against module paths; every module a pattern matches must be a Linear without
-- an adapter, and every pattern must match one. freeze = false leaves requires_grad alone.
function lora.apply(model, opts)
  local fn = "nn.lora.apply"
  refuse_wrapped(fn, model, "add the adapters before fsdp.wrap (for a trained model: build it "
    .. "with fsdp.meta, apply, wrap, fsdp.load the checkpoint with strict = false, then "
    .. "fsdp.materialize the adapters)")
  opts = util.check_opts(fn, opts, {"targets", "rank", "alpha", "freeze"})
  if opts.freeze ~= nil and type(opts.freeze) ~= "boolean" then
    util.raise(("%s: freeze must be a boolean (got %s)"):format(fn, tostring(opts.freeze)))
  end
  local targets = util.patterns(opts.targets or {"%.attn%.qkv$", "%.attn%.proj$"}, "targets", fn)
  local r, alpha = check_opts(fn, {rank = opts.rank, alpha = opts.alpha})
  -- how many module fields hold each parameter: a tied weight is held by two
  local holders = {}
  for _, mod in model:named_modules() do
    for _, e in ipairs(base.own_entries(mod)) do
      if base.is_param(e[2]) then holders[e[2]] = (holders[e[2]] or 0) + 1 end
    end
  end
  local chosen = {}
  for _, pat in ipairs(targets) do
    local ok, hit = pcall(function()
      local any = false
      for path, m in model:named_modules() do
        if path:find(pat) then
          any = true
          if not base.isinstance(m, L.Linear) then
            return ("the pattern %q matches %s, a %s (adapters go on Linear layers)")
              :format(pat, path, m:type_name())
          end
          if base.isinstance(m, LoRALinear) then
            return ("%s already has an adapter (merge it first)"):format(path)
          end
          if base.class_of(m) ~= L.Linear then
            return ("%s is a %s: adapters go on nn.Linear itself (the adapter's forward would "
              .. "replace the subclass's)"):format(path, m:type_name())
          end
          if (holders[m.weight] or 0) > 1 then
            return ("%s.weight is tied to another module's parameter: merging an adapter into "
              .. "it would change that module too (leave it out of targets, or untie it)")
              :format(path)
          end
          chosen[m] = path
        end
      end
      return any
    end)
    if not ok then raise(("%s: bad pattern %q: %s"):format(fn, pat, tostring(hit))) end
    if type(hit) == "string" then raise(fn .. ": " .. hit) end
    if not hit then
      local names = {}
      for i, e in ipairs(linears(model)) do names[i] = e[1] end
      raise(("%s: the pattern %q matches no module; the Linear layers are: %s")
        :format(fn, pat, util.few(names, 8)))
    end
  end
  if opts.freeze ~= false then
    -- the adapters of an earlier apply (other targets, another rank) keep their requires_grad:
    -- freezing is for the base
    local kept = {}
    for _, mod in model:named_modules() do
      if base.isinstance(mod, LoRA) then
        for _, p in ipairs{mod.A, mod.B} do kept[#kept + 1] = {p, p.requires_grad} end
      end
    end
    model:freeze()
    for _, e in ipairs(kept) do e[1].requires_grad = e[2] end
  end
  local paths = {}
  for _, e in ipairs(linears(model)) do
    local path, m = e[1], e[2]
    if chosen[m] then
      setmetatable(m, rawget(LoRALinear, "__mt"))
      -- the adapter computes beside the weight: its dtype, and its device when it has values
      local a = LoRA(m.in_features, m.out_features, {rank = r, alpha = alpha})
      local dev = m.weight.device
      if dev ~= "cpu" and dev ~= "meta" then a:to(dev) end
      if m.weight:dtype() ~= "f32" then a:to(m.weight:dtype()) end
      m.lora = a
      paths[#paths + 1] = path
    end
  end
  return paths
end

-- merge(model) -> model: every adapter folded into its Linear and removed (see the header).
-- The base parameters keep their requires_grad (frozen by apply: model:unfreeze() to train
-- them). Needs the values: not on a wrapped model, nor on meta parameters.
function lora.merge(model)
  local fn = "nn.lora.merge"
  refuse_wrapped(fn, model, "fsdp.unwrap it first (collective: every rank then holds the full "
    .. "weights), merge, then save it or wrap it again")
  local list = {}
  for path, m in model:named_modules() do
    if base.isinstance(m, LoRALinear) then
      for _, p in ipairs{m.weight, m.lora.A, m.lora.B} do
        if not p.has_data then
          raise(("%s: %s has no values (a %s parameter): materialize the model first")
            :format(fn, path, p.device))
        end
      end
      list[#list + 1] = m
    end
  end
  util.no_grad(function()
    for _, m in ipairs(list) do
      local a = m.lora
      if m.weight:dtype() == "f32" then
        local ba = a.B:matmul(a.A) -- (out, in)
        m.weight:add_(ba, a.scale)
        ba:free()
      else
        -- in f32 and rounded once: B A rounded to bf16 and then added would round twice
        local b32, a32, w32 = a.B:to("f32"), a.A:to("f32"), m.weight:to("f32")
        local ba = b32:matmul(a32)
        w32:add_(ba, a.scale)
        m.weight:copy(w32)
        ba:free()
        w32:free()
        if b32 ~= a.B then b32:free() end -- :to gives the tensor itself when already f32
        if a32 ~= a.A then a32:free() end
      end
      m.lora = nil
      setmetatable(m, rawget(L.Linear, "__mt"))
    end
  end)
  return model
end

return lora
