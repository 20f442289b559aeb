-- fsdp.nn.layers — the built-in layers and containers.
--
-- Every forward is a few fsdp.F calls on whole tensors (no per-element Lua) and creates no
-- tensor it does not need; the composite ones release their intermediates as soon as they are
-- used (module.lua, "releasing intermediates"), so dead activations never wait for Lua's
-- collector. Dropout is applied only in training mode and only when p > 0.
-- Each class with parameters defines reset_parameters() over its own parameters only (see
-- module.lua, "construction and initialisation"); the values follow PyTorch's defaults.

local core = require "fsdp.core"
local base = require "fsdp.nn.module"
local U = require "fsdp.util"
local ckpt = require "fsdp.nn.checkpoint"

local Module, is_module, release = base.Module, base.is_module, base.release
local L = {}

-- The device new parameters are created on: nil (cpu) or "meta" (shape only), set through
-- nn.set_param_device while fsdp.meta builds a model.
L.param_device = nil

-- A new parameter of the given shape (zeros, or meta). Its values are set by reset_parameters
-- once the outermost constructor returns. Every built-in layer allocates through here.
function L.new_param(shape)
  local t
  if L.param_device ~= nil then
    t = core.empty(shape, {device = L.param_device})
  else
    t = core.zeros(shape)
  end
  return base.mark_new(core.parameter(t))
end

local function check_int(v, what, fn, min)
  min = min or 1
  if not U.is_int(v, min) then
    base.raise(("%s: %s must be %s (got %s)"):format(fn, what, U.int_range(v, min), U.got(v)))
  end
end

local function check_p(p, fn)
  if type(p) ~= "number" or not (p >= 0 and p < 1) then
    base.raise(("%s: dropout p must be a number in [0, 1) (got %s)"):format(fn, tostring(p)))
  end
end

local function check_bias(opts, fn)
  if opts.bias ~= nil and type(opts.bias) ~= "boolean" then
    base.raise(("%s: bias must be true or false (got %s)"):format(fn, tostring(opts.bias)))
  end
end

local function dropout(self, x, p)
  if p > 0 and self.training then return core.F.dropout(x, p) end
  return x
end
L.dropout = dropout

-- ---- Linear -------------------------------------------------------------------------------

local Linear = Module:extend("Linear")
L.Linear = Linear

-- Linear(in, out, {bias = true}): y = x W^T + b with W (out, in), b (out).
function Linear:init(i, o, opts)
  check_int(i, "in_features", "nn.Linear")
  check_int(o, "out_features", "nn.Linear")
  opts = U.check_opts("nn.Linear", opts, {"bias"})
  check_bias(opts, "nn.Linear")
  self.in_features, self.out_features = i, o
  self.weight = L.new_param{o, i}
  if opts.bias ~= false then self.bias = L.new_param{o} end
end

function Linear:reset_parameters()
  local k = 1 / math.sqrt(self.in_features) -- PyTorch default (kaiming_uniform(a=sqrt 5))
  self:init_param("weight", "uniform", -k, k)
  if self.bias ~= nil then self:init_param("bias", "uniform", -k, k) end
end

function Linear:forward(x)
  return core.F.linear(x, self.weight, self.bias)
end

function Linear:extra_repr()
  return ("%d -> %d%s"):format(self.in_features, self.out_features,
    self.bias == nil and ", bias=false" or "")
end

-- ---- Embedding ----------------------------------------------------------------------------

local Embedding = Module:extend("Embedding")
L.Embedding = Embedding

-- Embedding(n, d): ids (any shape, integral values in [0, n)) -> (ids.shape..., d).
function Embedding:init(n, d)
  check_int(n, "num_embeddings", "nn.Embedding")
  check_int(d, "embedding_dim", "nn.Embedding")
  self.num_embeddings, self.embedding_dim = n, d
  self.weight = L.new_param{n, d}
end

function Embedding:reset_parameters()
  self:init_param("weight", "normal", 0, 1)
end

function Embedding:forward(ids)
  return core.F.embedding(ids, self.weight)
end

function Embedding:extra_repr()
  return ("%d, %d"):format(self.num_embeddings, self.embedding_dim)
end

-- ---- LayerNorm ----------------------------------------------------------------------------

local LayerNorm = Module:extend("LayerNorm")
L.LayerNorm = LayerNorm

-- LayerNorm(d, {eps = 1e-5, bias = true}): normalises over the last dimension.
function LayerNorm:init(d, opts)
  check_int(d, "normalized_shape", "nn.LayerNorm")
  opts = U.check_opts("nn.LayerNorm", opts, {"eps", "bias"})
  check_bias(opts, "nn.LayerNorm")
  if opts.eps ~= nil and (type(opts.eps) ~= "number" or not (opts.eps > 0)) then
    base.raise(("nn.LayerNorm: eps must be a positive number (got %s)"):format(tostring(opts.eps)))
  end
  self.dim, self.eps = d, opts.eps or 1e-5
  self.weight = L.new_param{d}
  if opts.bias ~= false then self.bias = L.new_param{d} end
end

function LayerNorm:reset_parameters()
  self:init_param("weight", "constant", 1)
  if self.bias ~= nil then self:init_param("bias", "constant", 0) end
end

function LayerNorm:forward(x)
  return core.F.layernorm(x, self.weight, self.bias, self.eps)
end

function LayerNorm:extra_repr()
  return ("%d, eps=%g%s"):format(self.dim, self.eps, self.bias == nil and ", bias=false" or "")
end

-- ---- activations and dropout --------------------------------------------------------------

local ReLU = Module:extend("ReLU")
L.ReLU = ReLU
function ReLU:forward(x) return core.F.relu(x) end

local GELU = Module:extend("GELU")
L.GELU = GELU
function GELU:forward(x) return core.F.gelu(x) end -- tanh form, as GPT-2

local Dropout = Module:extend("Dropout")
L.Dropout = Dropout

-- Dropout(p = 0.5): zeroes elements with probability p and scales the rest by 1/(1-p) in
-- training mode; the identity in eval mode or when p == 0.
function Dropout:init(p)
  if p == nil then p = 0.5 end
  check_p(p, "nn.Dropout")
  self.p = p
end

function Dropout:forward(x) return dropout(self, x, self.p) end
function Dropout:extra_repr() return ("p=%g"):format(self.p) end

-- ---- containers ---------------------------------------------------------------------------

-- Accepts f{a, b, c} and f(a, b, c); the children become self[1], self[2], ...
local function fill_list(self, fn, ...)
  local n, list = select("#", ...), {...}
  if n == 1 and type(list[1]) == "table" and not is_module(list[1]) then
    list = list[1]
    n = #list
  end
  for i = 1, n do
    if not is_module(list[i]) then
      base.raise(("%s: element %d is not a module (got %s)"):format(fn, i, type(list[i])))
    end
    self[i] = list[i]
  end
end

local Sequential = Module:extend("Sequential")
L.Sequential = Sequential

-- Sequential{m1, m2, ...} (or Sequential(m1, m2, ...)): forward feeds each child's output to
-- the next. Children are s[1], s[2], ... with paths "1", "2", ...
function Sequential:init(...) fill_list(self, "nn.Sequential", ...) end

function Sequential:forward(x)
  for i = 1, #self do x = self[i](x) end
  return x
end

function Sequential:extra_repr() return tostring(#self) end

local ModuleList = Module:extend("ModuleList")
L.ModuleList = ModuleList

-- ModuleList{m1, m2, ...}: a registered list of modules; l[i], #l, ipairs(l), l:append(m).
-- It has no forward: iterate over it.
function ModuleList:init(...) fill_list(self, "nn.ModuleList", ...) end

function ModuleList:append(m)
  if not is_module(m) then
    base.raise(("ModuleList:append: not a module (got %s)"):format(type(m)))
  end
  self[#self + 1] = m
  return self
end

function ModuleList:forward()
  error("ModuleList has no forward: iterate over its modules", 0)
end

function ModuleList:extra_repr() return tostring(#self) end

-- ---- transformer pieces -------------------------------------------------------------------

local CausalSelfAttention = Module:extend("CausalSelfAttention")
L.CausalSelfAttention = CausalSelfAttention

-- CausalSelfAttention(d, heads, {dropout = 0}): x (B, T, d) -> (B, T, d). Children qkv
-- (Linear d -> 3d) and proj (Linear d -> d). The attention itself is the fused causal kernel
-- fsdp.F.attention; dropout (training only) is applied to the output projection (residual
-- dropout), not to the attention weights, which the fused kernel never materialises.
function CausalSelfAttention:init(d, heads, opts)
  check_int(d, "d", "nn.CausalSelfAttention")
  check_int(heads, "heads", "nn.CausalSelfAttention")
  if d % heads ~= 0 then
    base.raise(("nn.CausalSelfAttention: d=%d is not a multiple of heads=%d"):format(d, heads))
  end
  opts = U.check_opts("nn.CausalSelfAttention", opts, {"dropout"})
  self.d, self.heads, self.dropout = d, heads, opts.dropout or 0
  check_p(self.dropout, "nn.CausalSelfAttention")
  self.qkv = Linear(d, 3 * d)
  self.proj = Linear(d, d)
end

-- The key/value cache of one layer (GPT:generate): kv = {pos = tokens already cached, k =, v =
-- (B, heads, ctx, hs) or nil until the first call}. Called with kv, a forward at pos 0 (the
-- prompt: any T) runs the fused kernel and stores the keys and values; at pos > 0 x is one new
-- token (T = 1) whose query attends over the cached keys and its own, so it costs O(pos), not
-- O(pos^2). Used under no_grad only.
local function heads_view(t, B, T, nh, hs) -- (B, T, d) view of qkv's third -> (B, nh, T, hs)
  local c = t:contiguous()
  local out = c:view{B, T, nh, hs}:transpose(2, 3):contiguous()
  if not rawequal(c, t) then c:free() end
  return out
end

local function cached_attention(self, qkv, kv)
  local s = qkv:shape()
  local B, T, d, nh = s[1], s[2], self.d, self.heads
  local hs = d / nh
  local pos = kv.pos
  if kv.k ~= nil and kv.k:shape()[1] ~= B then
    error(("attention cache: %d rows, but the cache holds %d (one cache per batch: new_cache() "
      .. "or free() it)"):format(B, kv.k:shape()[1]), 0)
  end
  if kv.k == nil then
    local ctx = kv.ctx
    kv.k = core.zeros({B, nh, ctx, hs}, {dtype = qkv:dtype(), device = qkv.device})
    kv.v = core.zeros({B, nh, ctx, hs}, {dtype = qkv:dtype(), device = qkv.device})
  end
  local k = heads_view(qkv:narrow(3, d + 1, d), B, T, nh, hs)
  local v = heads_view(qkv:narrow(3, 2 * d + 1, d), B, T, nh, hs)
  kv.k:narrow(3, pos + 1, T):copy(k)
  kv.v:narrow(3, pos + 1, T):copy(v)
  k:free()
  v:free()
  if pos == 0 then return core.F.attention(qkv, nh) end -- (B, T, d)
  if T ~= 1 then
    error(("attention cache: %d new tokens at position %d (one at a time after the prompt)")
      :format(T, pos), 0)
  end
  local n = pos + 1
  local q = heads_view(qkv:narrow(3, 1, d), B, 1, nh, hs) -- (B, nh, 1, hs)
  local kt = kv.k:narrow(3, 1, n):transpose(3, 4):contiguous() -- (B, nh, hs, n)
  local scores = q:matmul(kt) -- (B, nh, 1, n)
  q:free()
  kt:free()
  local scaled = scores * (1 / math.sqrt(hs))
  scores:free()
  local att = scaled:softmax(-1)
  scaled:free()
  local vs = kv.v:narrow(3, 1, n):contiguous() -- (B, nh, n, hs)
  local o = att:matmul(vs) -- (B, nh, 1, hs)
  att:free()
  vs:free()
  local y = o:transpose(2, 3):contiguous():view{B, 1, d}
  o:free()
  return y
end

function CausalSelfAttention:forward(x, kv)
  local qkv = self.qkv(x) -- (B, T, 3d)
  local y
  if kv ~= nil then
    y = cached_attention(self, qkv, kv)
  else
    y = core.F.attention(qkv, self.heads) -- (B, T, d)
  end
  release(qkv, x)
  local p = self.proj(y)
  release(y, x)
  local out = dropout(self, p, self.dropout)
  release(p, x, out)
  return out
end

function CausalSelfAttention:extra_repr()
  return ("d=%d, heads=%d"):format(self.d, self.heads)
end

local MLP = Module:extend("MLP")
L.MLP = MLP

-- MLP(d, hidden = 4d, {dropout = 0}): proj(gelu(fc(x))). Children fc, proj.
function MLP:init(d, hidden, opts)
  check_int(d, "d", "nn.MLP")
  hidden = hidden or 4 * d
  check_int(hidden, "hidden", "nn.MLP")
  opts = U.check_opts("nn.MLP", opts, {"dropout"})
  self.dropout = opts.dropout or 0
  check_p(self.dropout, "nn.MLP")
  self.fc = Linear(d, hidden)
  self.proj = Linear(hidden, d)
end

-- Whether a fused op may stand in for calling module m on x: m is a plain cls (its forward is
-- the library's) without hooks (a hook, e.g. m's own FSDP unit, must see its call), and x is
-- in the dtype and on the device of m's weight.
local function fusable(m, cls, x)
  if base.class_of(m) ~= cls or base.has_hooks(m) then return false end
  local w = m.weight
  return x:dtype() == w:dtype() and x.device == w.device
end

-- fc's bias and the GELU run as one op (F.bias_gelu: one pass each way instead of three) when
-- fc is a plain Linear with a bias and x fits its weight; otherwise fc is called as usual (so
-- hooks run, and a shape error names fc).
local function fused_fc(fc, x)
  if fc.bias == nil or not fusable(fc, Linear, x) then return false end
  local xs, ws = x:shape(), fc.weight:shape()
  return #ws == 2 and #xs >= 1 and xs[#xs] == ws[2]
end

-- fc's linear and bias + GELU, fused (fused_fc)
local function fc_gelu(fc, x)
  local y = core.F.linear(x, fc.weight) -- (..., hidden)
  local h = core.F.bias_gelu(y, fc.bias)
  release(y, x)
  return h
end

function MLP:forward(x)
  local fc, h = self.fc, nil
  if fused_fc(fc, x) then
    -- fc checkpointed (nn.checkpoint): the fused op is its region, so the GELU is recomputed
    -- with it and the bits stay those of the unchecked run (fc(x), then gelu, rounds the bias
    -- into a bf16 output before the GELU)
    if ckpt.is_marked(fc) then h = ckpt.run_as(fc, fc_gelu, x) else h = fc_gelu(fc, x) end
  else
    local y = fc(x) -- (..., hidden)
    h = core.F.gelu(y)
    release(y, x)
  end
  local p = self.proj(h)
  release(h, x)
  local out = dropout(self, p, self.dropout)
  release(p, x, out)
  return out
end

function MLP:extra_repr()
  return ("%d -> %d -> %d"):format(self.fc.in_features, self.fc.out_features,
    self.proj.out_features)
end

local Block = Module:extend("Block")
L.Block = Block

-- Block(d, heads, {dropout = 0, hidden = 4d, eps = 1e-5}): pre-norm transformer block,
--   x = x + attn(ln1(x));  x = x + mlp(ln2(x)).   Children ln1, attn, ln2, mlp; eps is the
-- LayerNorms'. forward(x, kv): kv is the attention's cache (CausalSelfAttention) or nil.
function Block:init(d, heads, opts)
  opts = U.check_opts("nn.Block", opts, {"dropout", "hidden", "eps"})
  self.ln1 = LayerNorm(d, {eps = opts.eps})
  self.attn = CausalSelfAttention(d, heads, {dropout = opts.dropout})
  self.ln2 = LayerNorm(d, {eps = opts.eps})
  self.mlp = MLP(d, opts.hidden or 4 * d, {dropout = opts.dropout})
end

-- x + a and ln2 of it as one op (F.add_layernorm: one pass over the rows, the same values) when
-- ln2 is a plain LayerNorm and x and a match (shape, dtype, device) and fit it; not when ln2 is
-- checkpointed (nn.checkpoint), whose call then runs as a checkpoint (the same values)
local function fused_ln(ln, x, a)
  if not fusable(ln, LayerNorm, x) or ckpt.is_marked(ln) or a:dtype() ~= x:dtype()
    or a.device ~= x.device then
    return false
  end
  local xs, as = x:shape(), a:shape()
  if #xs ~= #as or #xs < 1 or xs[#xs] ~= ln.dim then return false end
  for i = 1, #xs do
    if xs[i] ~= as[i] then return false end
  end
  return true
end

function Block:forward(x, kv)
  local h = self.ln1(x)
  local a = self.attn(h, kv)
  release(h, x)
  local x1
  if fused_ln(self.ln2, x, a) then
    local ln2 = self.ln2
    x1, h = core.F.add_layernorm(x, a, ln2.weight, ln2.bias, ln2.eps)
    release(a, x)
  else
    x1 = x + a
    release(a, x)
    h = self.ln2(x1)
  end
  local m = self.mlp(h)
  release(h, x, x1)
  local out = x1 + m
  release(m, x, x1)
  release(x1, x, out)
  return out
end

function Block:extra_repr()
  return ("d=%d, heads=%d"):format(self.attn.d, self.attn.heads)
end

for _, cls in ipairs{Linear, Embedding, LayerNorm, ReLU, GELU, Dropout, Sequential,
    CausalSelfAttention, MLP, Block} do
  base.library_forward(cls)
end

return L
