-- fsdp.nn.gpt — a GPT-2 style decoder-only transformer and its sampler.
--
-- Children, in order: wte (Embedding vocab x d), wpe (Embedding ctx x d), blocks (ModuleList of
-- Block), ln_f (LayerNorm), head (Linear d -> vocab, no bias). With tie = true (the default)
-- head.weight IS wte.weight: one parameter object reached from two places, reported once
-- under "wte.weight"; both uses accumulate into its one .grad.
--
-- Initialisation follows GPT-2 / nanoGPT: every Linear weight and both embeddings N(0, 0.02),
-- Linear biases 0, LayerNorms 1/0, and the two residual projections of each block
-- (attn.proj.weight, mlp.proj.weight) N(0, 0.02/sqrt(2*layers)). GPT sets these as init specs on
-- its descendants (Module:set_init), so each module's own reset_parameters produces them.

local core = require "fsdp.core"
local util = require "fsdp.util"
local base = require "fsdp.nn.module"
local L = require "fsdp.nn.layers"

local Module, release = base.Module, base.release
local GPT = Module:extend("GPT")

local function need_int(cfg, k, min)
  local v = cfg[k]
  if type(v) ~= "number" or v ~= math.floor(v) or v < min then
    base.raise(("nn.GPT: %s must be an integer >= %d (got %s)"):format(k, min, tostring(v)))
  end
  return v
end

-- GPT{vocab =, ctx =, d =, layers =, heads =, tie = true, dropout = 0, hidden = 4d}
function GPT:init(cfg)
  if type(cfg) ~= "table" then base.raise("nn.GPT: expects a table {vocab=, ctx=, d=, layers=, heads=}") end
  util.check_opts("nn.GPT", cfg, {"vocab", "ctx", "d", "layers", "heads", "tie", "dropout", "hidden"})
  if cfg.tie ~= nil and type(cfg.tie) ~= "boolean" then
    base.raise(("nn.GPT: tie must be true or false (got %s)"):format(tostring(cfg.tie)))
  end
  self.vocab = need_int(cfg, "vocab", 1)
  self.ctx = need_int(cfg, "ctx", 1)
  self.d = need_int(cfg, "d", 1)
  self.layers = need_int(cfg, "layers", 0)
  self.heads = need_int(cfg, "heads", 1)
  self.tie = cfg.tie ~= false
  self.dropout = cfg.dropout or 0
  if type(self.dropout) ~= "number" or self.dropout < 0 or self.dropout >= 1 then
    base.raise(("nn.GPT: dropout must be a number in [0, 1) (got %s)"):format(tostring(cfg.dropout)))
  end
  local d = self.d
  self.wte = L.Embedding(self.vocab, d)
  self.wpe = L.Embedding(self.ctx, d)
  self.blocks = L.ModuleList()
  for _ = 1, self.layers do
    self.blocks:append(L.Block(d, self.heads, {dropout = self.dropout, hidden = cfg.hidden}))
  end
  self.ln_f = L.LayerNorm(d)
  if self.tie then
    -- the head's own weight is replaced by the tie at once: build it with no storage, or it
    -- would stay allocated (and counted by fsdp.memory()) until Lua collected it
    local device = L.param_device
    L.param_device = "meta"
    local ok, head = pcall(L.Linear, d, self.vocab, {bias = false})
    L.param_device = device
    if not ok then error(head, 0) end
    self.head = head
    self.head.weight = self.wte.weight
  else
    self.head = L.Linear(d, self.vocab, {bias = false})
  end

  -- GPT-2 initialisation, as specs on the descendants (see the file header)
  for _, m in ipairs(self:modules()) do
    if base.isinstance(m, L.Linear) then
      m:set_init("weight", "normal", 0, 0.02)
      m:set_init("bias", "constant", 0)
    elseif base.isinstance(m, L.Embedding) then
      m:set_init("weight", "normal", 0, 0.02)
    end
  end
  local std = 0.02 / math.sqrt(2 * math.max(self.layers, 1))
  for i = 1, #self.blocks do
    self.blocks[i].attn.proj:set_init("weight", "normal", 0, std)
    self.blocks[i].mlp.proj:set_init("weight", "normal", 0, std)
  end
end

-- Positions 0..T-1 (i64) as a view of one cached arange(ctx) (no tensor per step but the view).
function GPT:positions(T)
  local pos = rawget(self, "__positions")
  local device = self.wpe.weight.device -- the positions live where the weights compute
  if pos == nil or pos.device ~= device then
    pos = core.arange(self.ctx, {dtype = "i64", device = device})
    rawset(self, "__positions", pos)
    rawset(self, "__row_positions", nil)
  end
  if T == self.ctx then return pos end
  return pos:narrow(1, 1, T)
end

-- Positions for every row of a (B, T) batch, cached per shape. Used when the model computes in
-- bf16 / f16 (mixed precision): wpe(positions (T)) + tokens sums the position embedding's
-- gradient over the batch in that dtype, so a rank's rounding of its partial sum would make N
-- ranks differ from one rank by bf16's precision; looked up per row, the gradient reaches wpe's
-- (f32) gradient unrounded.
function GPT:row_positions(B, T)
  local cache = rawget(self, "__row_positions")
  if cache == nil or cache.B ~= B or cache.T ~= T then
    local rows = {}
    for b = 1, B do rows[b] = self:positions(T) end
    cache = {B = B, T = T, pos = core.stack(rows)}
    rawset(self, "__row_positions", cache)
  end
  return cache.pos
end

-- ids (B, T) integral values in [0, vocab), i64 (the data loaders') or f32; a wrapped model
-- with mp casts floating inputs to bf16/f16, which the embedding refuses -> logits (B, T, vocab)
function GPT:forward(ids)
  local shape = ids:shape()
  if #shape ~= 2 then
    error(("expected ids of shape (B, T), got (%s)"):format(table.concat(shape, ", ")), 0)
  end
  local T = shape[2]
  if T > self.ctx then
    error(("sequence length T=%d exceeds the model's context ctx=%d"):format(T, self.ctx), 0)
  end
  -- every intermediate is released once used (module.lua, "releasing intermediates")
  local tok = self.wte(ids) -- (B, T, d)
  local pos
  if self.wpe.weight:dtype() == "f32" then
    pos = self.wpe(self:positions(T)) -- (T, d)
  else
    pos = self.wpe(self:row_positions(shape[1], T)) -- (B, T, d)
  end
  local x = tok + pos
  release(tok, ids)
  release(pos, ids)
  local y = L.dropout(self, x, self.dropout)
  if not rawequal(y, x) then release(x, ids) end
  x = y
  local blocks = self.blocks
  for i = 1, #blocks do
    y = blocks[i](x)
    release(x, ids, y)
    x = y
  end
  local h = self.ln_f(x)
  release(x, ids, h)
  local logits = self.head(h)
  release(h, ids, logits)
  return logits
end

function GPT:extra_repr()
  return ("vocab=%d, ctx=%d, d=%d, layers=%d, heads=%d, tie=%s%s"):format(self.vocab, self.ctx,
    self.d, self.layers, self.heads, tostring(self.tie),
    self.dropout > 0 and (", dropout=" .. self.dropout) or "")
end

-- ---- sampling -----------------------------------------------------------------------------

local sample_calls = 0 -- distinct random streams for successive generate calls

local function prompt_ids(x)
  if base.is_tensor(x) then x = x:totable() end
  if type(x) ~= "table" then base.raise("GPT:generate: prompt must be a table of ids or a tensor") end
  local out = {}
  local function flat(t)
    for i = 1, #t do
      if type(t[i]) == "table" then flat(t[i]) else out[#out + 1] = t[i] end
    end
  end
  flat(x)
  return out
end

-- Draw one id from logits (a Lua array over the vocabulary, ids 0-based) given u in [0, 1).
local function draw(logits, temperature, top_k, u)
  local V = #logits
  if temperature <= 0 then -- greedy
    local best = 1
    for i = 2, V do if logits[i] > logits[best] then best = i end end
    return best - 1
  end
  local cut = -math.huge
  if top_k and top_k < V then
    local sorted = {}
    for i = 1, V do sorted[i] = logits[i] end
    table.sort(sorted, function(a, b) return a > b end)
    cut = sorted[top_k]
  end
  local mx = -math.huge
  for i = 1, V do if logits[i] > mx then mx = logits[i] end end
  local w, total = {}, 0
  for i = 1, V do
    local l = logits[i]
    w[i] = l >= cut and math.exp((l - mx) / temperature) or 0
    total = total + w[i]
  end
  local r, acc = u * total, 0
  for i = 1, V do
    acc = acc + w[i]
    if r < acc then return i - 1 end
  end
  for i = V, 1, -1 do if w[i] > 0 then return i - 1 end end
  return V - 1
end
GPT.draw = draw -- exposed for tests

-- generate(prompt, n, {temperature = 1, top_k = nil, seed = nil}) -> Lua array of ids: the
-- prompt (a table of ids, or a (T) / (1, T) tensor) followed by n sampled ids. Runs in eval
-- mode under no_grad (the training flag is restored after). temperature 0 is greedy. Draws
-- come from the counter-based generator: with opts.seed they are keyed by (seed, position), so
-- the same call gives the same text; without it by (fsdp.seed(), call number, position), so
-- successive calls differ but a run is reproducible and every rank samples the same text.
function GPT:generate(prompt, n, opts)
  opts = util.check_opts("GPT:generate", opts, {"temperature", "top_k", "seed"})
  if type(n) ~= "number" or n % 1 ~= 0 or n < 0 then
    base.raise(("GPT:generate: n must be an integer >= 0 (got %s)"):format(tostring(n)))
  end
  if opts.temperature ~= nil and (type(opts.temperature) ~= "number" or not (opts.temperature >= 0)) then
    base.raise(("GPT:generate: temperature must be a number >= 0 (got %s)"):format(tostring(opts.temperature)))
  end
  local k = opts.top_k
  if k ~= nil and (type(k) ~= "number" or k % 1 ~= 0 or k < 1) then
    base.raise(("GPT:generate: top_k must be an integer >= 1 (got %s)"):format(tostring(k)))
  end
  local ids = prompt_ids(prompt)
  if #ids == 0 then base.raise("GPT:generate: empty prompt") end
  local temperature = opts.temperature or 1
  local seed, stream = opts.seed, "generate/"
  if seed == nil then
    sample_calls = sample_calls + 1
    seed, stream = core.seed(), "generate/" .. sample_calls .. "/"
  end
  local was_training = self.training
  self:eval()
  local u = core.zeros{1}
  local ok, err = pcall(util.no_grad, function()
    for step = 1, n do
      local first = math.max(1, #ids - self.ctx + 1)
      local window = {}
      for j = first, #ids do window[#window + 1] = ids[j] end
      local T = #window
      local logits = self(core.tensor({window}, {dtype = "i64"})) -- (1, T, V)
      local last = logits:narrow(2, T, 1):reshape{self.vocab}:totable()
      core.init_uniform(u, seed, stream .. step, 0, 1)
      ids[#ids + 1] = draw(last, temperature, opts.top_k, u:item())
    end
  end)
  self:train(was_training)
  if not ok then error(err, 0) end
  return ids
end

base.library_forward(GPT)

return GPT
