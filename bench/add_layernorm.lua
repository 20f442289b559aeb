-- Residual add + layernorm benchmark (not a test): `x + a` then `F.layernorm` against the fused
-- `F.add_layernorm`, on (batch, ctx, C) f32 operands that stay allocated (hot in cache, as in a
-- transformer block, where both addends were just written), without gradients.
--
--   fsdprun bench/add_layernorm.lua [--widths=256,384,768] [--calls=100] [--rounds=5]
--
-- Prints per width the wall time and the process's CPU time per call of each (the two
-- alternate, `rounds` rounds of `calls` calls; the medians over rounds), and checks that both
-- give the same bits.
local fsdp = require "fsdp"
local core = fsdp.core
local F = fsdp.F

local args = fsdp.args {
  description = "x + a then F.layernorm against the fused F.add_layernorm (not a test).",
  { "widths", "256,384,768", "string", "comma-separated widths C" },
  { "calls", 100, "integer", "calls per round", min = 1 },
  { "rounds", 5, "integer", "rounds (the median is reported)", min = 1 },
  { "batch", 8, "integer", "rows of ctx", min = 1 },
  { "ctx", 256, "integer", "rows per batch row", min = 1 },
}

local widths = {}
for w in args.widths:gmatch("[^,]+") do
  local c = tonumber(w)
  if not c or c < 1 or c ~= math.floor(c) then
    error(("--widths: %q is not a positive integer"):format(w), 0)
  end
  widths[#widths + 1] = c
end

local function median(t)
  table.sort(t)
  local n = #t
  return n % 2 == 1 and t[(n + 1) / 2] or (t[n / 2] + t[n / 2 + 1]) / 2
end

print(("residual add + layernorm, f32, (%d, %d, C), %d calls x %d rounds, %d threads"):format(
  args.batch, args.ctx, args.calls, args.rounds, core.get_threads()))
print(("%-6s %14s %14s %14s %14s %7s"):format("C", "apart ms", "fused ms", "apart cpu ms",
  "fused cpu ms", "ratio"))
fsdp.no_grad(function()
  for _, C in ipairs(widths) do
    fsdp.manual_seed(1)
    local x, a = fsdp.randn{args.batch, args.ctx, C}, fsdp.randn{args.batch, args.ctx, C}
    local w, b = fsdp.randn{C} * 0.1 + 1, fsdp.randn{C}
    local s1, y1 = F.add_layernorm(x, a, w, b)
    local s2 = x + a
    local y2 = F.layernorm(s2, w, b)
    local function maxdiff(p, q)
      local m = (p - q):abs():max()
      return type(m) == "number" and m or m:item()
    end
    local d1, d2 = maxdiff(s1, s2), maxdiff(y1, y2)
    if d1 ~= 0 or d2 ~= 0 then
      error(("C=%d: the fused op differs from the two ops (%g, %g)"):format(C, d1, d2), 0)
    end
    local wall = {apart = {}, fused = {}}
    local cpu = {apart = {}, fused = {}}
    for _ = 1, args.rounds do
      for _, mode in ipairs {"apart", "fused"} do
        local t0, c0 = core.clock(), os.clock()
        for _ = 1, args.calls do
          local s, y
          if mode == "apart" then
            s = x + a
            y = F.layernorm(s, w, b)
          else
            s, y = F.add_layernorm(x, a, w, b)
          end
          s:free()
          y:free()
        end
        local n = #wall[mode] + 1
        wall[mode][n] = (core.clock() - t0) / args.calls * 1e3
        cpu[mode][n] = (os.clock() - c0) / args.calls * 1e3
      end
    end
    local wa, wf = median(wall.apart), median(wall.fused)
    print(("%-6d %14.3f %14.3f %14.3f %14.3f %7.2f"):format(C, wa, wf, median(cpu.apart),
      median(cpu.fused), wf / wa))
  end
end)
