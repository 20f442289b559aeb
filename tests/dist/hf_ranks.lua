-- hf_ranks.lua — fsdp.import_hf / export_hf and GPT:generate on a wrapped model at any world
-- size (tests/recipes/dist_hf.sh runs it at 1, 2 and 4 ranks and compares the exports):
--   * import_hf(fixture, {wrap =}) fills each rank's shards only: the logits are transformers'
--     (1e-4) and equal a plain import's bitwise; each rank holds about 1/N of the parameters
--   * generate on the wrapped model, with and without the cache, greedy and seeded: the plain
--     model's tokens on every rank, and every rank the same
--   * export_hf of the wrapped model to --out (collective; the script compares it byte for
--     byte with the 1-rank export) holds the plain model's tensors; a folder per rank is refused
local fsdp = require "fsdp"
local C = dofile("tests/dist/common.lua")
local collective = require "fsdp.collective"

local FIXTURE = "tests/fixtures/hf_gpt2/model"
local out = assert(fsdp.args.out, "--out=DIR")
local nn = fsdp.nn
local W, rank = fsdp.world_size(), fsdp.rank()

local r = fsdp.core.st_open("tests/fixtures/hf_gpt2/expected.safetensors")
local ids, want = r:read("input_ids"), r:read("logits")
r:close()

local plain = fsdp.import_hf(FIXTURE) -- local: every rank its own
local before = fsdp.memory().params
local m = fsdp.import_hf(FIXTURE, {wrap = {policy = fsdp.policy.modules{nn.Block}}})
local held = fsdp.memory().params - before
if fsdp.args.verbose then print(("rank %d: %d bytes of %d"):format(rank, held, 4 * plain:num_parameters())) end
local total = 4 * plain:num_parameters()
C.check(held <= total / W * 1.05 + 1024,
  ("rank %d holds %d bytes of parameters, the model has %d"):format(rank, held, total))

local function logits(model) return fsdp.no_grad(function() return model(ids) end) end
local got = logits(m)
local d = (got - want):abs():max()
C.check(d < 1e-4, "max |logits - transformers'| = " .. d)
C.check((got - logits(plain)):abs():max() == 0, "wrapped logits differ from the plain model's")

local cases = {
  {max_new_tokens = 30, temperature = 0},
  {max_new_tokens = 30, temperature = 0.9, top_k = 20, top_p = 0.9, seed = 4},
}
for i, c in ipairs(cases) do
  local want_ids = plain:generate({11, 48, 85}, c)
  for _, cache in ipairs{true, false} do
    local o = {cache = cache}
    for k, v in pairs(c) do o[k] = v end
    local ids_w = m:generate({11, 48, 85}, o)
    C.check(C.same(ids_w, want_ids), ("case %d cache %s: %s, plain %s"):format(i, tostring(cache),
      table.concat(ids_w, " "), table.concat(want_ids, " ")))
    local all = collective.all_gather(table.concat(ids_w, " "))
    for k = 2, W do C.check(all[k] == all[1], ("case %d: rank %d's tokens differ from rank 0's"):format(i, k - 1)) end
  end
end

fsdp.export_hf(m, out)
if rank == 0 then
  local a = fsdp.core.st_open(out .. "/model.safetensors")
  local b = fsdp.core.st_open(FIXTURE .. "/model.safetensors")
  for _, e in ipairs(b:entries()) do
    C.check(C.same(C.flat(a:read(e.name)), C.flat(b:read(e.name))), "exported " .. e.name .. " differs")
  end
  C.check(#a:entries() == #b:entries(), "the export has other tensors than the fixture")
end
fsdp.barrier()

-- a plain model is exported by rank 0 as well: a folder per rank is refused on every rank (only
-- rank 0's was written); nothing is written then
if W > 1 then
  local mine = ("%s-plain-rank%d"):format(out, rank)
  local ok, err = pcall(fsdp.export_hf, plain, mine)
  C.check(not ok and tostring(err):find("the folder differs across ranks", 1, true) ~= nil,
    "export_hf of a plain model to a folder per rank: " .. tostring(err))
  C.check(fsdp.core.io_size(mine .. "/model.safetensors") == nil, mine .. " was written")
end

local failures = fsdp.all_reduce(C.failures(), "sum")
if failures > 0 then error(("%d check(s) failed"):format(failures), 0) end
if rank == 0 then print(("hf_ranks: ok at %d rank(s)"):format(W)) end
