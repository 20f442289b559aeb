-- optim_ckpt.lua — optimizer state through sharded checkpoints at the edges of the layout
-- (tests/recipes/dist_optim_ckpt.sh). Every rank feeds the same batch, so a wrapped model at
-- N ranks trains as the plain model at 1 rank; each case checks the wrapped run against the
-- plain one made in the same process (local_only) and fails with an error when they differ.
--
--   fsdprun -n N tests/dist/optim_ckpt.lua --case=ada_save|ada_load --dir=D
--
-- ada_save / ada_load: Adafactor over a Linear(4, 4) (16 + 4 elements: at 2 ranks one rank
--   holds the bias only, at 3 one holds padding only), saved after 2 steps at one world size
--   and resumed at another (or the same) for 2 more. A rank holding no slice of any factored
--   parameter imports no factor; the first step after the load completes the factors with an
--   all_reduce every rank must call. Checked: some rank holds no factored slice (the case is
--   what it claims), and the resumed run equals 4 uninterrupted plain steps.
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check

local case = assert(a.case, "--case=NAME")
local W, rank = fsdp.world_size(), fsdp.rank()

-- the gathered parameters of model as {path = flat values} (collective when wrapped)
local function values(model)
  local out = {}
  fsdp.full_params(model, function(m)
    for path, p in m:named_parameters() do out[path] = C.flat(p) end
  end, {writeback = false})
  return out
end

-- every parameter of got within tol (relative to the largest magnitude) of want's
local function close(got, want, tol, what)
  for path, w in pairs(want) do
    local g, worst, scale = got[path], 0, 1e-30
    check(g ~= nil and #g == #w, ("%s: %s missing or of another size"):format(what, path))
    if g then
      for k = 1, #w do
        worst = math.max(worst, math.abs(g[k] - w[k]))
        scale = math.max(scale, math.abs(w[k]))
      end
      check(worst <= tol * scale, ("%s: %s differs by %g (scale %g)"):format(what, path, worst, scale))
    end
  end
end

local function steps(model, opt, n, x)
  for _ = 1, n do
    opt:zero_grad()
    model(x):sum():backward()
    opt:step()
  end
end

if case == "ada_save" or case == "ada_load" then
  local dir = assert(a.dir, "--dir=D")
  local x = fsdp.tensor{{1, 2, 3, 4}, {-1, 0.5, 2, -3}}
  local function linear()
    fsdp.manual_seed(1)
    return nn.Linear(4, 4)
  end
  local m = linear()
  fsdp.wrap(m)
  local opt = fsdp.optim.Adafactor(m, {lr = 0.01})
  if case == "ada_save" then
    steps(m, opt, 2, x)
    fsdp.save(m, dir, {optimizer = opt})
  else
    local factored = 0
    for _, u in ipairs(fsdp.units(m)) do
      for _, s in ipairs(u:local_slices()) do
        if s.param:dim() >= 2 then factored = factored + 1 end
      end
    end
    if W > 1 then
      check(fsdp.all_reduce(factored, "min") == 0,
        "some rank should hold no slice of a factored parameter (the case this tests)")
    end
    fsdp.load(m, dir, {optimizer = opt})
    steps(m, opt, 2, x)
    local plain = linear()
    steps(plain, fsdp.optim.Adafactor(plain, {lr = 0.01, local_only = true}), 4, x)
    close(values(m), values(plain), 1e-5, "Adafactor resumed at " .. W .. " ranks vs 4 plain steps")
    if rank == 0 then print(("ok: Adafactor resumed at %d ranks (factored slices here: %d)"):format(W, factored)) end
  end
else
  error("--case=ada_save|ada_load")
end
if C.failures() > 0 then error(("%d optim_ckpt checks failed"):format(C.failures())) end
