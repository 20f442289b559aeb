-- tokens_rss.lua — resident memory of fsdp.data.tokens reading a large token file: the loader
-- maps the file and gives each batch's pages back after copying them, so VmRSS / VmHWM stay
-- near the process's own size whatever the file's size (docs/data.md quotes the figures).
--   fsdprun bench/tokens_rss.lua --file=/tmp/big.bin [--steps=2000] [--ctx=1024] [--batch=64]
-- The file needs its sidecar (/tmp/big.json: {"dtype": "uint16", "vocab_size": 65536, "count": N}).
local fsdp = require "fsdp"
local a = fsdp.args {
  description = "Resident memory of fsdp.data.tokens over a large token file (not a test).",
  { "file", nil, "string", "the token file (with its .json sidecar; required)" },
  { "steps", 2000, "integer", "batches to read", min = 1 },
  { "ctx", 1024, "integer", "tokens per window", min = 1 },
  { "batch", 64, "integer", "windows per batch", min = 1 },
}

local function status()
  local f = assert(io.open("/proc/self/status"))
  local s = f:read("*a")
  f:close()
  local function kb(k) return tonumber(s:match(k .. ":%s*(%d+) kB")) end
  return ("VmRSS %.1f MiB (RssFile %.1f MiB), VmHWM %.1f MiB"):format(kb("VmRSS") / 1024,
    (kb("RssFile") or 0) / 1024, kb("VmHWM") / 1024)
end

if not a.file then error("tokens_rss: --file=PATH is required (a token file with its sidecar)", 0) end
local steps, ctx, batch = a.steps, a.ctx, a.batch
print("before opening:      " .. status())
local L = fsdp.data.tokens(a.file, {ctx = ctx, batch = batch, seed = 1})
print(("opened %s: %d tokens (%.2f GiB, %s)"):format(L.path, L.count,
  L.count * (L.dtype == "uint16" and 2 or 4) / 2^30, L.dtype))
print("after opening:       " .. status())
local t0, sum = os.clock(), 0
for step, x in L:batches(steps) do
  sum = sum + x:get(1, 1)
  if step == steps then print(("after %d steps:    "):format(step) .. status()) end
end
print(("%d steps of (%d, %d) in %.2f s cpu; windows touched %.0f MiB of the file in all"):format(
  steps, batch, ctx, os.clock() - t0, steps * batch * (ctx + 1) * 2 / 2^20))
