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
  if not util.is_int(v, min) then
    base.raise(("nn.GPT: %s must be %s (got %s)"):format(k, util.int_range(v, min), util.got(v)))
  end
  return v
end

local CONFIG_KEYS = {"vocab", "ctx", "d", "layers", "heads", "tie", "dropout", "hidden", "eps"}

-- GPT{vocab =, ctx =, d =, layers =, heads =, tie = true, dropout = 0, hidden = 4d, eps = 1e-5}
-- eps: every LayerNorm's (GPT-2's layer_norm_epsilon). GPT:config() gives the table back.
function GPT:init(cfg)
  if type(cfg) ~= "table" then base.raise("nn.GPT: expects a table {vocab=, ctx=, d=, layers=, heads=}") end
  util.check_opts("nn.GPT", cfg, CONFIG_KEYS)
  if cfg.tie ~= nil and type(cfg.tie) ~= "boolean" then
    base.raise(("nn.GPT: tie must be true or false (got %s)"):format(tostring(cfg.tie)))
  end
  self.vocab = need_int(cfg, "vocab", 1)
  self.ctx = need_int(cfg, "ctx", 1)
  self.d = need_int(cfg, "d", 1)
  self.layers = need_int(cfg, "layers", 0)
  self.heads = need_int(cfg, "heads", 1)
  self.hidden = cfg.hidden == nil and 4 * self.d or need_int(cfg, "hidden", 1)
  self.tie = cfg.tie ~= false
  self.dropout = cfg.dropout or 0
  if type(self.dropout) ~= "number" or not (self.dropout >= 0 and self.dropout < 1) then
    base.raise(("nn.GPT: dropout must be a number in [0, 1) (got %s)"):format(tostring(cfg.dropout)))
  end
  self.eps = cfg.eps or 1e-5
  if type(self.eps) ~= "number" or not (self.eps > 0) then
    base.raise(("nn.GPT: eps must be a positive number (got %s)"):format(tostring(cfg.eps)))
  end
  local d = self.d
  self.wte = L.Embedding(self.vocab, d)
  self.wpe = L.Embedding(self.ctx, d)
  self.blocks = L.ModuleList()
  for _ = 1, self.layers do
    self.blocks:append(L.Block(d, self.heads, {dropout = self.dropout, hidden = self.hidden,
      eps = self.eps}))
  end
  self.ln_f = L.LayerNorm(d, {eps = self.eps})
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

-- The configuration this model was built from: nn.GPT(m:config()) builds the same
-- architecture. A plain table of numbers and a boolean (JSON-able: checkpoints store it).
function GPT:config()
  return {vocab = self.vocab, ctx = self.ctx, d = self.d, layers = self.layers,
    heads = self.heads, tie = self.tie, dropout = self.dropout, hidden = self.hidden,
    eps = self.eps}
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
-- cache (GPT:new_cache(), generate's): ids are the tokens at positions cache.pos .. cache.pos +
-- T - 1, each layer attends over the keys and values cached before them, and cache.pos
-- advances by T. Without a cache ids start at position 0.
function GPT:forward(ids, cache)
  if not base.is_tensor(ids) then
    error(("expected ids, a (B, T) tensor (got %s)"):format(util.got(ids)), 0)
  end
  local shape = ids:shape()
  if #shape ~= 2 then
    error(("expected ids of shape (B, T), got (%s)"):format(table.concat(shape, ", ")), 0)
  end
  local T = shape[2]
  if cache ~= nil and (type(cache) ~= "table" or type(cache.layers) ~= "table"
      or #cache.layers ~= #self.blocks) then
    error(("expected a cache made by this model's new_cache() (got %s)"):format(
      type(cache) == "table" and "a table that is none" or type(cache)), 0)
  end
  if cache ~= nil and not rawequal(cache.model, self) then
    -- another model's keys and values, though its layers match: the logits would be wrong
    error("the cache was made by another model's new_cache() (a cache is for the model that "
      .. "made it)", 0)
  end
  if cache ~= nil and core.is_grad_enabled() then
    -- the cached keys and values are copies no backward reaches: gradients would be wrong
    error("the key/value cache records nothing for backward: call the model with a cache "
      .. "under fsdp.no_grad (GPT:generate does)", 0)
  end
  local start = cache and cache.pos or 0
  if start + T > self.ctx then
    if cache then
      error(("sequence length T=%d after %d cached tokens exceeds the model's context ctx=%d")
        :format(T, start, self.ctx), 0)
    end
    error(("sequence length T=%d exceeds the model's context ctx=%d"):format(T, self.ctx), 0)
  end
  -- every intermediate is released once used (module.lua, "releasing intermediates")
  local tok = self.wte(ids) -- (B, T, d)
  local pos
  if cache then
    pos = self.wpe(self:positions(start + T):narrow(1, start + 1, T)) -- (T, d)
  elseif self.wpe.weight:dtype() == "f32" then
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
    y = blocks[i](x, cache and cache.layers[i])
    release(x, ids, y)
    x = y
  end
  if cache then
    cache.pos = start + T
    for i = 1, #blocks do cache.layers[i].pos = cache.pos end
  end
  local h = self.ln_f(x)
  release(x, ids, h)
  local logits = self.head(h)
  release(h, ids, logits)
  return logits
end

function GPT:extra_repr()
  return ("vocab=%d, ctx=%d, d=%d, layers=%d, heads=%d, tie=%s%s%s%s"):format(self.vocab, self.ctx,
    self.d, self.layers, self.heads, tostring(self.tie),
    self.dropout > 0 and (", dropout=" .. self.dropout) or "",
    self.hidden ~= 4 * self.d and (", hidden=" .. self.hidden) or "",
    self.eps ~= 1e-5 and (", eps=" .. self.eps) or "")
end

-- An empty key/value cache for forward(ids, cache): per layer the keys and values of the
-- positions seen so far, allocated on the first forward in the activations' dtype and device
-- ((B, heads, ctx, d / heads) each). Cache:free() drops them. cache.model is this model: a
-- forward of any other refuses the cache.
function GPT:new_cache(...)
  if select("#", ...) > 0 then
    base.raise("GPT:new_cache: takes no arguments (the batch size and dtype come from the "
      .. "first call that uses the cache)")
  end
  local layers = {}
  for i = 1, #self.blocks do layers[i] = {pos = 0, ctx = self.ctx} end
  return {pos = 0, layers = layers, model = self, free = function(c)
    for _, l in ipairs(c.layers) do
      if l.k then l.k:free() l.v:free() end
      l.k, l.v, l.pos = nil, nil, 0
    end
    c.pos = 0
  end}
end

-- ---- sampling -----------------------------------------------------------------------------

local sample_calls = 0 -- distinct random streams for successive generate calls

-- One sequence only: a batch of prompts would be flattened into one prompt.
local function prompt_ids(x)
  if base.is_tensor(x) then
    local s = x:shape()
    if not (#s == 1 or (#s == 2 and s[1] == 1)) then
      base.raise(("GPT:generate: the prompt must be one sequence, a (T) or (1, T) tensor (got (%s))")
        :format(table.concat(s, ", ")))
    end
    x = x:totable()
  end
  if type(x) ~= "table" then base.raise("GPT:generate: prompt must be a table of ids or a tensor") end
  if #x == 1 and type(x[1]) == "table" then x = x[1] end -- {{ids}}: one row
  local out = {}
  for i = 1, #x do
    local v = x[i]
    if type(v) ~= "number" or v ~= math.floor(v) then
      base.raise(("GPT:generate: prompt id %d must be an integer (got %s)"):format(i, tostring(v)))
    end
    out[i] = v
  end
  return out
end

-- Draw one id from logits (a Lua array over the vocabulary, ids 0-based) given u in [0, 1).
-- temperature <= 0: the largest logit (the first of equals). Otherwise softmax(logits /
-- temperature) restricted to the top_k largest logits (ties at the k-th all kept), then to the
-- smallest set of most likely ids whose probability reaches top_p (nucleus; the most likely id
-- always stays); u picks from what is left by its cumulative weights in id order. Logits of
-- +inf take all the probability, split evenly among them (the limit of a growing logit); when
-- every logit is -inf they share it evenly. A NaN logit is an error naming its id.
local function draw(logits, temperature, top_k, u, top_p)
  local V = #logits
  for i = 1, V do
    if logits[i] ~= logits[i] then
      base.raise(("GPT:generate: the logit of id %d is nan (the model's output is not finite)")
        :format(i - 1))
    end
  end
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
  local infinite = mx == math.huge or mx == -math.huge -- then l - mx is NaN for l == mx
  for i = 1, V do
    local l = logits[i]
    if l < cut then
      w[i] = 0
    elseif infinite then
      w[i] = l == mx and 1 or 0
    else
      w[i] = math.exp((l - mx) / temperature)
    end
    total = total + w[i]
  end
  if top_p and top_p < 1 then
    local order = {}
    for i = 1, V do if w[i] > 0 then order[#order + 1] = i end end
    table.sort(order, function(a, b)
      if w[a] ~= w[b] then return w[a] > w[b] end
      return a < b
    end)
    local acc, keep = 0, 0
    for n, i in ipairs(order) do
      acc = acc + w[i]
      keep = n
      if acc >= top_p * total then break end
    end
    total = 0
    for n, i in ipairs(order) do
      if n > keep then w[i] = 0 else total = total + w[i] end
    end
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

local GENERATE_OPTS = {"max_new_tokens", "temperature", "top_k", "top_p", "seed", "cache"}

local function check_generate(opts, vocab)
  opts = util.check_opts("GPT:generate", opts, GENERATE_OPTS)
  local function int(k, min, default)
    local v = opts[k]
    if v == nil then return default end
    if not util.is_int(v, min) then
      base.raise(("GPT:generate: %s must be %s (got %s)"):format(k, util.int_range(v, min),
        util.got(v)))
    end
    return v
  end
  local o = {n = int("max_new_tokens", 0, nil), top_k = int("top_k", 1, nil),
    seed = int("seed", 0, nil), temperature = opts.temperature or 1, top_p = opts.top_p,
    cache = opts.cache ~= false}
  if o.n == nil then base.raise("GPT:generate: max_new_tokens is required") end
  if opts.cache ~= nil and type(opts.cache) ~= "boolean" then
    base.raise(("GPT:generate: cache must be a boolean (got %s)"):format(tostring(opts.cache)))
  end
  if type(o.temperature) ~= "number" or not (o.temperature >= 0 and o.temperature < math.huge) then
    base.raise(("GPT:generate: temperature must be a finite number >= 0 (got %s)")
      :format(util.got(opts.temperature)))
  end
  if o.top_p ~= nil and (type(o.top_p) ~= "number" or not (o.top_p > 0 and o.top_p <= 1)) then
    base.raise(("GPT:generate: top_p must be a number in (0, 1] (got %s)"):format(tostring(opts.top_p)))
  end
  if o.top_k and o.top_k > vocab then o.top_k = vocab end
  return o
end

-- generate(ids, {max_new_tokens =, temperature = 1, top_k, top_p, seed, cache = true}) -> Lua
-- array of ids: the prompt (a table of ids, or a (T) / (1, T) tensor) followed by
-- max_new_tokens sampled ids. Runs in eval mode under no_grad (the training flag is restored
-- after). temperature 0 is greedy. Draws come from the counter-based generator: with seed they
-- are keyed by (seed, position), so the same call gives the same text; without it by
-- (fsdp.seed(), call number, position), so successive calls differ but a run is reproducible
-- and every rank samples the same text. With cache (the default) the prompt runs once and each
-- new token attends over the cached keys and values (O(T) per token); once the text outgrows
-- ctx, every token reruns the last ctx ids (the positions shift), as cache = false always does.
-- The older form generate(ids, n, opts) is max_new_tokens = n.
function GPT:generate(prompt, opts, more)
  if type(opts) == "number" then
    local o = {}
    for k, v in pairs(more or {}) do o[k] = v end
    o.max_new_tokens = opts
    opts = o
  end
  local o = check_generate(opts, self.vocab)
  local ids = prompt_ids(prompt)
  if #ids == 0 then base.raise("GPT:generate: empty prompt") end
  local seed, stream = o.seed, "generate/"
  if seed == nil then
    sample_calls = sample_calls + 1
    seed, stream = core.seed(), "generate/" .. sample_calls .. "/"
  end
  local was_training = self.training
  self:eval()
  local u = core.zeros{1}
  local cache = o.cache and self:new_cache() or nil
  local ok, err = pcall(util.no_grad, function()
    for step = 1, o.n do
      local logits
      if cache and #ids <= self.ctx then
        local first = cache.pos + 1 -- the ids not yet in the cache
        local window = {}
        for j = first, #ids do window[#window + 1] = ids[j] end
        logits = self(core.tensor({window}, {dtype = "i64"}), cache) -- (1, T, V)
      else
        if cache then cache:free() cache = nil end
        local first = math.max(1, #ids - self.ctx + 1)
        local window = {}
        for j = first, #ids do window[#window + 1] = ids[j] end
        logits = self(core.tensor({window}, {dtype = "i64"})) -- (1, T, V)
      end
      local T = logits:shape()[2]
      local last = logits:narrow(2, T, 1):reshape{self.vocab}:totable()
      logits:free()
      core.init_uniform(u, seed, stream .. step, 0, 1)
      ids[#ids + 1] = draw(last, o.temperature, o.top_k, u:item(), o.top_p)
    end
  end)
  if cache then cache:free() end
  self:train(was_training)
  if not ok then error(err, 0) end
  return ids
end

base.library_forward(GPT)

return GPT
