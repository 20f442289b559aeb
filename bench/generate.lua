-- generate.lua — tokens/s of GPT:generate with and without the key/value cache, as the context
-- grows from --prompt to --prompt + --new tokens (defaults 448 -> 512), greedy, one sequence.
--   fsdprun bench/generate.lua [--d=256 --layers=4 --heads=4 --prompt=448 --new=64 --rounds=3]
-- Prints one line per mode: the median over rounds of new tokens / seconds of the whole call
-- (the prompt's forward included), and the tokens agree between the modes.
local fsdp = require "fsdp"
local lib = dofile((arg[0]:match("^(.*[/\\])") or "") .. "lib.lua")

local a = fsdp.args {
  description = "Tokens/s of GPT:generate with and without the key/value cache (not a test).",
  { "d", 256, "integer", "model width", min = 1 },
  { "layers", 4, "integer", "transformer blocks", min = 1 },
  { "heads", 4, "integer", "attention heads (divides --d)", min = 1 },
  { "prompt", 448, "integer", "prompt length in tokens", min = 1 },
  { "new", 64, "integer", "tokens generated", min = 1 },
  { "rounds", 3, "integer", "calls per mode (the median is printed)", min = 1 },
}
local d, layers, heads = a.d, a.layers, a.heads
local P, N, rounds = a.prompt, a.new, a.rounds
fsdp.manual_seed(1)
local model = fsdp.nn.GPT{vocab = 256, ctx = P + N, d = d, layers = layers, heads = heads}
math.randomseed(1)
local prompt = {}
for i = 1, P do prompt[i] = math.random(0, 255) end

local texts = {}
for _, cache in ipairs{true, false} do
  local rates = {}
  for r = 1, rounds do
    local t0 = fsdp.core.clock() -- wall seconds
    local ids = model:generate(prompt, {max_new_tokens = N, temperature = 0, cache = cache})
    rates[r] = N / (fsdp.core.clock() - t0)
    texts[cache] = table.concat(ids, " ", P + 1)
  end
  print(("generate: d=%d layers=%d heads=%d context %d -> %d, cache=%-5s %8.1f tokens/s (median of %d)")
    :format(d, layers, heads, P, P + N, tostring(cache), lib.median(rates), rounds))
end
assert(texts[true] == texts[false], "the tokens differ with and without the cache")
