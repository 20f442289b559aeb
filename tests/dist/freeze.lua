-- Frozen parameters (tests/recipes/dist_freeze.sh): a wrapped GPT with some parameters frozen
-- (model:freeze) trains like the plain one, the frozen parameters keep their bits, and the
-- traffic and memory counters show what freezing saved.
--
--   fsdprun -n N tests/dist/freeze.lua --case=top|bottom|attn|ln_f --mode=plain|full|grad_op|none
--     [--steps=6] [--out=path] [--odd_rank=R] [--unfreeze=true] [--no_freeze=true]
--
-- Cases (GPT of 3 blocks, tied head; each Block a unit, the root holds wte, wpe, ln_f):
--   top     block 3 frozen: a fully frozen unit that gradients pass through (to blocks 1-2 and
--           the embeddings): it gathers in backward and reduces nothing
--   bottom  wte (so the tied head), wpe and block 1 frozen: no gradient reaches block 1, which
--           is then not in backward at all; the root is partly frozen (ln_f trains)
--   attn    every block's attention frozen: partly frozen units
--   ln_f    everything but ln_f frozen (model:freeze():unfreeze("^ln_f")): no block is in
--           backward, only the root reduces
-- Every rank takes its rows of one global batch of 4 rows; rank 0 writes the losses and final
-- parameters (%a) to --out for tests/dist/compare.lua.
-- Checks made here: frozen parameters have no .grad / no u:has_grad after each backward and are
-- bitwise unchanged at the end (the trainable ones did change); wrapped "full": the bytes and
-- calls of every collective per step are what the units' padded sizes and their frozen state
-- say (a unit with no trainable parameter reduce-scatters nothing; one no gradient passes
-- through is gathered once); wrapped: the gradient memory is the trainable units' shards only
-- and the optimizer's state covers the trainable slices only.
-- --odd_rank=R: only rank R freezes (block 3): every rank must stop with the collectives'
-- mismatch named. --unfreeze=true unfreezes everything after step 2 (a frozen unit's gradient
-- shard comes back; training goes on as a model frozen for two steps). --no_freeze=true
-- freezes nothing: its run must FAIL the comparison with a frozen one.
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check

local case = a.case or "top"
local mode = a.mode or "full"
local steps = a.steps or 6
local W, rank = fsdp.world_size(), fsdp.rank()
local B, T, V = 4, 8, 32
assert(B % W == 0, "the global batch must divide among the ranks")
local rows = B / W

fsdp.manual_seed(77)
local model = nn.GPT{vocab = V, ctx = T, d = 32, layers = 3, heads = 2}
local patterns = ({
  top = {"^blocks%.3%."},
  bottom = {"^wte%.", "^wpe%.", "^blocks%.1%."},
  attn = {"%.attn%."},
})[case]
if a.no_freeze then -- luacheck: ignore (nothing frozen)
elseif a.odd_rank == nil then
  if case == "ln_f" then
    model:freeze():unfreeze("^ln_f%.")
  else
    model:freeze(patterns)
  end
elseif rank == a.odd_rank then
  model:freeze("^blocks%.3%.")
end

local frozen = {}
for path, p in model:named_parameters() do frozen[path] = not p.requires_grad end

if mode ~= "plain" then
  fsdp.wrap(model, {strategy = mode, policy = fsdp.policy.modules{nn.Block}})
end
local opt = fsdp.optim.AdamW(model, {lr = 3e-3, weight_decay = 0.1, eps = 1e-6})

-- every parameter's values (exact), collective when wrapped
local function values()
  local out = {}
  local function read(m)
    for path, p in m:named_parameters() do out[path] = C.flat(p) end
  end
  if mode == "plain" then read(model) else fsdp.full_params(model, read, {writeback = false}) end
  return out
end

local function batch(step)
  local x, y = {}, {}
  for r = 1, rows do
    local i = rank * rows + r
    x[r], y[r] = {}, {}
    for t = 1, T do
      x[r][t] = (step * 7 + i * 5 + t * 3) % V
      y[r][t] = (x[r][t] * 3 + 1) % V
    end
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

-- what the counters must say for one step of strategy "full" (docs/fsdp.md "Freezing
-- parameters"): a unit is in backward when its output needs a gradient, i.e. it or something
-- before it in the forward (the embeddings, earlier blocks) trains; the root always is here
-- (ln_f or the head is reached by the loss's gradient whenever anything trains)
local function expected_comm(units)
  -- all_reduce: the optimizer's has_grad flags, one float per parameter (none at 1 rank)
  local want = {ag = 0, ag_calls = 0, rs = 0, rs_calls = 0, ar = 0, ar_calls = W > 1 and 1 or 0}
  local upstream = model.wte.weight.requires_grad or model.wpe.weight.requires_grad
  local unfrozen = {rs = 0}
  for _, u in ipairs(units) do
    local P = u:padded_numel() * 4
    if W > 1 then want.ar = want.ar + #u:paths() * 4 end
    unfrozen.rs = unfrozen.rs + P
    local in_backward = true
    if not u.is_root then
      upstream = upstream or u:trainable()
      in_backward = upstream
    end
    local k = (not u.is_root and in_backward) and 2 or 1
    want.ag, want.ag_calls = want.ag + k * P, want.ag_calls + k
    if u:trainable() then want.rs, want.rs_calls = want.rs + P, want.rs_calls + 1 end
  end
  return want, unfrozen
end

local before = values()
local losses, measured = {}, nil
for step = 1, steps do
  if a.unfreeze and step == 3 then model:unfreeze() end
  local x, y = batch(step)
  opt:zero_grad()
  if step == 2 and mode == "full" then fsdp.reset_comm_stats() end
  local loss = nn.F.cross_entropy(model(x), y)
  loss:backward()
  if mode == "plain" then
    for path, p in model:named_parameters() do
      check((p.grad == nil) == not p.requires_grad, ("step %d: %s: grad %s, requires_grad %s")
        :format(step, path, tostring(p.grad ~= nil), tostring(p.requires_grad)))
    end
  else
    for _, u in ipairs(fsdp.units(model)) do
      for i, p in ipairs(u:params()) do
        check(u:has_grad(i) == p.requires_grad, ("step %d: u:has_grad(%d) of %s is %s")
          :format(step, i, u:paths()[i], tostring(u:has_grad(i))))
      end
    end
  end
  opt:step()
  if step == 2 and mode == "full" then measured = fsdp.comm_stats() end
  losses[step] = fsdp.all_reduce(loss:item(), "mean")
end

-- frozen parameters kept their bits; the others moved
local after = values()
local any_frozen = false
for path, v in pairs(before) do
  local still = frozen[path] and not a.unfreeze
  any_frozen = any_frozen or still
  if still then
    check(C.same(v, after[path]), path .. " is frozen but changed")
  else
    check(not C.same(v, after[path]), path .. " trains but did not change")
  end
end
check(any_frozen or a.unfreeze or a.no_freeze or a.odd_rank ~= nil, "no parameter was frozen")

local report = {}
if mode ~= "plain" and not a.unfreeze then
  local units = fsdp.units(model)
  -- memory: gradient shards of the trainable units only; optimizer state (AdamW: 2 buffers) of
  -- this rank's slices of the trainable parameters only
  local m = fsdp.memory()
  local grads, grads_all, optim, optim_all = 0, 0, 0, 0
  for _, u in ipairs(units) do
    grads_all = grads_all + u:shard_numel() * 4
    if u:trainable() then grads = grads + u:shard_numel() * 4 end
    for _, s in ipairs(u:local_slices()) do
      local n = (s.shard_last - s.shard_first + 1) * 2 * 4
      optim_all = optim_all + n
      if s.param.requires_grad then optim = optim + n end
    end
  end
  check(m.grads == grads, ("gradient memory %d B, expected %d B (the trainable units' shards)")
    :format(m.grads, grads))
  check(m.optim == optim, ("optimizer memory %d B, expected %d B (the trainable slices)")
    :format(m.optim, optim))
  report[#report + 1] = ("grads %d B (unfrozen %d B), optim %d B (unfrozen %d B)")
    :format(m.grads, grads_all, m.optim, optim_all)
  if mode == "full" then
    local want, unfrozen = expected_comm(units)
    local s = measured
    local function same(label, got, exp)
      check(got == exp, ("%s per step: %d, expected %d"):format(label, got, exp))
    end
    same("all_gather bytes", s.all_gather_bytes, want.ag)
    same("all_gather calls", s.all_gather_calls, want.ag_calls)
    same("reduce_scatter bytes", s.reduce_scatter_bytes, want.rs)
    same("reduce_scatter calls", s.reduce_scatter_calls, want.rs_calls)
    same("all_reduce bytes", s.all_reduce_bytes, want.ar)
    same("all_reduce calls", s.all_reduce_calls, want.ar_calls)
    report[#report + 1] = ("reduce_scatter %d B/step (unfrozen %d B), all_gather %d B/step")
      :format(s.reduce_scatter_bytes, unfrozen.rs, s.all_gather_bytes)
  end
end
if rank == 0 and #report > 0 then
  print(("freeze %s, %s at %d ranks: %s"):format(case, mode, W, table.concat(report, "; ")))
end

C.write_lines(C.run_lines(losses, model), a.out)
if C.failures() > 0 then error(("%d freeze checks failed"):format(C.failures())) end
