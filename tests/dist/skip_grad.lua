-- Parameters that receive no gradient (tests/recipes/dist_skip_grad.sh): a wrapped model must
-- train exactly like the plain one, where the optimizer skips a parameter whose p.grad is nil
-- (no update, no weight decay, no moment update, its Adam step count unchanged).
--
--   fsdprun -n N tests/dist/skip_grad.lua --case=drop|unused|outside|moe|zeroed
--     --mode=plain|full|grad_op|none
--     [--steps=8] [--opt=adamw|sgd] [--eps=E] [--out=path] [--zero_fill=true] [--odd_rank=R]
--
-- Cases (a residual MLP: inp, body, out; each body module is a unit when wrapped):
--   drop    layer drop: body block 2 is skipped on steps 3 and 6, on every rank
--   unused  block 2 holds a Linear ("spare") it never calls, the root a parameter never used
--   outside a root parameter ("penalty") that the forward never uses: a penalty on it is added
--           to the loss on even steps only, so its gradient comes from outside the forward
--   moe     body module 2 is a mixture of 4 experts (one unit holding all of them); each row of
--           the global batch is routed by a rule of (step, global row), the same on every
--           rank: on some steps an expert gets rows on every rank, on some only on one rank's
--           rows, on some on none (then it is not called on any rank)
--   zeroed  every parameter gets a gradient, and some modules drop theirs after the backward
--           with module:zero_grad() (p.grad = nil on the plain model): block 2 (a unit) on
--           even steps, block 1's fc1 (part of a unit) on steps 1, 4 and 7, out (part of the
--           root) on step 5
-- Every rank takes its rows of the same global batch (8 rows), so every world size trains the
-- same model; rank 0 writes, as tests/dist/train_equiv.lua does, the loss of every step and
-- the final parameters (%a) to --out for tests/dist/compare.lua.
--
-- Checks made here (the run fails when one does not hold): after each backward, every unit's
-- u:has_grad(i) is what this rank's rows say (wrapped); at the end every parameter's optimizer
-- step count is the number of steps on which some rank gave it a gradient, and a parameter
-- that never got one has no state (plain and wrapped alike).
-- --zero_fill=true (plain only) gives every parameter without a gradient a zero one before
-- each step: what stepping every shard slice amounts to. It must FAIL the comparison.
-- --odd_rank=R (drop, wrapped): only rank R skips the block on step 3; every rank must stop
-- at once with the collectives' mismatch named (the skip decision must be the same on every
-- rank).
local fsdp = require "fsdp"
local nn = fsdp.nn
local a = fsdp.args
local C = dofile("tests/dist/common.lua")
local check = C.check

local case = a.case or "drop"
local mode = a.mode or "full"
local steps = a.steps or 8
local opt_kind = a.opt or "adamw"
local W, rank = fsdp.world_size(), fsdp.rank()
local B, D, E = 8, 16, 4 -- global rows, width, experts
assert(B % W == 0, "the global batch must divide among the ranks")
local rows = B / W
local first = rank * rows + 1 -- this rank's first global row

-- ---- the model ------------------------------------------------------------------------------

local Block = nn.Module:extend("SkipGradBlock")
function Block:init(d, spare)
  self.fc1 = nn.Linear(d, 2 * d)
  self.fc2 = nn.Linear(2 * d, d)
  if spare then self.spare = nn.Linear(d, d) end -- registered, never called
end
function Block:forward(x) return x + self.fc2(self.fc1(x):relu()) end

local Expert = nn.Module:extend("SkipGradExpert")
function Expert:init(d)
  self.fc1 = nn.Linear(d, 2 * d)
  self.fc2 = nn.Linear(2 * d, d)
end
function Expert:forward(x) return self.fc2(self.fc1(x):relu()) end

-- Rows are dispatched with constant 0/1 selection matrices: expert e sees S_e h (its rows) and
-- its output is added back at those rows (S_e^T). An expert without rows is not called.
local MoE = nn.Module:extend("SkipGradMoE")
function MoE:init(d, n)
  local list = {}
  for e = 1, n do list[e] = Expert(d) end
  self.experts = nn.ModuleList(list)
end
function MoE:forward(h, route) -- route[r]: the expert of local row r
  local out = h
  for e = 1, #self.experts do
    local sel = {}
    for r = 1, #route do
      if route[r] == e then
        local row = {}
        for j = 1, #route do row[j] = j == r and 1 or 0 end
        sel[#sel + 1] = row
      end
    end
    if #sel > 0 then
      local S = fsdp.tensor(sel)
      out = out + S:transpose(1, 2):matmul(self.experts[e](S:matmul(h)))
    end
  end
  return out
end

local Net = nn.Module:extend("SkipGradNet")
function Net:init()
  self.inp = nn.Linear(20, D)
  if case == "moe" then
    self.body = nn.ModuleList{Block(D), MoE(D, E), Block(D)}
  else
    self.body = nn.ModuleList{Block(D), Block(D, case == "unused"), Block(D)}
  end
  self.out = nn.Linear(D, 10)
  if case == "unused" then self.unused = nn.Parameter(fsdp.randn{4, D}) end -- never used
  if case == "outside" then self.penalty = nn.Parameter(fsdp.randn{4, D}) end
end

-- The modules whose gradients case "zeroed" drops after the backward of a step.
local function zeroed(step)
  if case ~= "zeroed" then return {} end
  local out = {}
  if step % 2 == 0 then out[#out + 1] = "body.2." end
  if step % 3 == 1 then out[#out + 1] = "body.1.fc1." end
  if step == 5 then out[#out + 1] = "out." end
  return out
end

-- The expert of global row i at a step: only expert 1 (2-4 get nothing); expert 2 on the
-- first half of the batch only (at 2 ranks: rank 0's rows only); experts 1-3 (4 gets
-- nothing); all four.
local function route_of(step, i)
  local m = step % 4
  if m == 0 then return 1 end
  if m == 1 then return i <= B / 2 and 2 or 1 end
  if m == 2 then return i % 3 + 1 end
  return (i + step) % E + 1
end

local odd_rank = a.odd_rank
local function dropped(step, r) -- whether rank r skips body block 2 at this step
  if case ~= "drop" then return false end
  if odd_rank ~= nil then return step == 3 and r == odd_rank end
  return step == 3 or step == 6
end

function Net:forward(x, step)
  local h = self.inp(x):relu()
  for k = 1, #self.body do
    if k == 2 and case == "moe" then
      local route = {}
      for r = 1, rows do route[r] = route_of(step, first + r - 1) end
      h = self.body[k](h, route)
    elseif not (k == 2 and dropped(step, rank)) then
      h = self.body[k](h)
    end
  end
  return self.out(h)
end

-- Whether parameter `path` gets a gradient at `step` from the rows of ranks lo..hi.
local function gets_grad(path, step, lo, hi)
  if case == "unused" then
    return not (path:find("%.spare%.") or path == "unused")
  end
  if case == "outside" then return path ~= "penalty" or step % 2 == 0 end
  if case == "zeroed" then
    for _, prefix in ipairs(zeroed(step)) do
      if path:sub(1, #prefix) == prefix then return false end
    end
    return true
  end
  if case == "drop" then
    if path:find("^body%.2%.") then
      for r = lo, hi do if not dropped(step, r) then return true end end
      return false
    end
    return true
  end
  local e = path:match("^body%.2%.experts%.(%d+)%.")
  if e == nil then return true end
  for i = lo * rows + 1, (hi + 1) * rows do
    if route_of(step, i) == tonumber(e) then return true end
  end
  return false
end

-- ---- training -------------------------------------------------------------------------------

fsdp.manual_seed(4321)
local model = Net()
if mode ~= "plain" then
  fsdp.wrap(model, {strategy = mode, policy = fsdp.policy.modules{Block, MoE}})
end
-- AdamW divides each gradient element by its own running RMS, so an element whose gradient is
-- rounding noise (an expert's hidden unit at the edge of its ReLU, computed over other rows
-- groupings at other world sizes) would step by lr with a random sign (docs/fsdp.md, "What the
-- tests prove"). The MoE case uses eps = 1e-5 to keep such elements' steps small; the
-- comparison's tolerance stays the equivalence tests' 1e-5.
local eps = a.eps or (case == "moe" and 1e-5 or 1e-8)
local opt
if opt_kind == "adamw" then
  opt = fsdp.optim.AdamW(model, {lr = 1e-2, weight_decay = 0.1, eps = eps})
else
  opt = fsdp.optim.SGD(model, {lr = 0.05, momentum = 0.9, weight_decay = 0.01})
end

local function batch(step)
  local x, y = {}, {}
  for i = first, first + rows - 1 do
    local xi = {}
    for j = 1, 20 do xi[j] = math.sin(step * 0.37 + i * 1.3 + j * 0.71) end
    x[#x + 1] = xi
    y[#y + 1] = math.floor((xi[1] + xi[2] + 2) * 2.5) % 10
  end
  return fsdp.tensor(x), fsdp.tensor(y)
end

local paths = {}
for path in model:named_parameters() do paths[#paths + 1] = path end

local losses = {}
for step = 1, steps do
  local x, y = batch(step)
  opt:zero_grad()
  local loss = nn.F.cross_entropy(model(x, step), y)
  if case == "outside" and step % 2 == 0 then -- the root is still gathered: readable
    loss = loss + (model.penalty * model.penalty):mean() * 0.5
  end
  loss:backward()
  for _, prefix in ipairs(zeroed(step)) do
    local m = model
    for name in prefix:gmatch("[^.]+") do m = m[tonumber(name) or name] end
    m:zero_grad()
  end
  if mode ~= "plain" then
    for _, u in ipairs(fsdp.units(model)) do
      for i, path in ipairs(u:paths()) do
        local want = gets_grad(path, step, rank, rank)
        check(u:has_grad(i) == want, ("step %d: u:has_grad(%d) of %s is %s, expected %s")
          :format(step, i, path, tostring(u:has_grad(i)), tostring(want)))
      end
    end
  elseif a.zero_fill then
    for _, p in ipairs(model:parameters()) do
      if p.grad == nil then p.grad = fsdp.zeros(p:shape()) end
    end
  end
  opt:step()
  losses[step] = fsdp.all_reduce(loss:item(), "mean")
end

-- optimizer state: stepped exactly on the steps some rank gave a gradient
local pobj = {}
for path, p in model:named_parameters() do pobj[path] = p end
local held = {} -- wrapped: parameters this rank holds a slice of
if mode ~= "plain" then
  for _, u in ipairs(fsdp.units(model)) do
    for _, s in ipairs(u:local_slices()) do held[s.path] = true end
  end
end
if not a.zero_fill then
  for _, path in ipairs(paths) do
    local n = 0
    for step = 1, steps do
      if gets_grad(path, step, 0, W - 1) then n = n + 1 end
    end
    local st = opt.state[pobj[path]]
    if mode == "plain" or held[path] then
      if n == 0 then
        check(st == nil, ("%s never got a gradient but has optimizer state"):format(path))
      else
        check(st ~= nil and st.step == n, ("%s: optimizer step count %s, expected %d")
          :format(path, st and tostring(st.step) or "nil (no state)", n))
      end
    end
  end
end

local lines = C.run_lines(losses, model)

C.write_lines(lines, a.out)
if C.failures() > 0 then error(("%d skip_grad checks failed"):format(C.failures())) end
