#!/bin/sh
# Smoke test of recipes/gpt_lora.lua in its short mode at 2 ranks: it trains a tiny base GPT,
# saves it, loads it into a sharded model with LoRA adapters built on meta, trains the
# adapters only, merges and exports. The recipe itself fails when the merged logits differ
# from the adapted model's by more than 1e-5 or the export computes other logits. Checked
# here: the adapter training reduce-scatters only the adapters (far less than every parameter
# would), the merged export holds exactly the base GPT's tensors (no adapters), and a given
# --base is used as is (no base training).
. "${0%/*}/lib.sh"
must "gpt_lora --short exited nonzero" "$FSDPRUN" -n 2 recipes/gpt_lora.lua --short --out="$T/run"
cat "$T/log"
grep -q "^merged: largest logit difference" "$T/log" || die_log "no merge line"
grep -q "^the export loads into a plain GPT" "$T/log" || die_log "no export check"
rs=$(sed -n 's/^per step: reduce_scatter \([0-9]*\) B (every parameter trainable: \([0-9]*\) B).*/\1 \2/p' "$T/log")
[ -n "$rs" ] || die_log "no traffic line"
# the optimizer holds AdamW's two moments of the adapter slices only, exactly twice their
# gradient shards: the base model trained first and its optimizer are gone
og=$(sed -n 's/.*; gradient shards \([0-9]*\) B (all trainable: [0-9]* B), optimizer state \([0-9]*\) B on rank 0$/\1 \2/p' "$T/log")
[ -n "$og" ] || die_log "no memory figures"
set -- $rs
[ "$1" -gt 0 ] && [ $(($1 * 10)) -lt "$2" ] || die "adapter training reduce-scattered $1 B per step, every parameter: $2 B"
# the export: the base GPT's names, no adapter
cat >"$T/check.lua" <<'LUA'
local fsdp = require "fsdp"
local r = fsdp.core.st_open(fsdp.args[1])
local n, bad = 0, {}
for _, e in ipairs(r:entries()) do
  n = n + 1
  if e.name:find("lora") then bad[#bad + 1] = e.name end
end
assert(#bad == 0, "adapters in the export: " .. table.concat(bad, ", "))
assert(n == 2 + 2 * 12 + 2, "expected 28 tensors, got " .. n)
LUA
must "the export's tensors" "$FSDPRUN" "$T/check.lua" "$T/run/model.safetensors"
set -- $rs $og
[ "$4" -eq $(($3 * 2)) ] || die_log "optimizer state $4 B on rank 0, expected twice the adapters' gradient shards ($3 B)"
echo "ok: gpt_lora --short: reduce_scatter $1 B/step against $2 B; optimizer state $4 B; export of 28 base tensors"
must "gpt_lora --base exited nonzero" "$FSDPRUN" -n 2 recipes/gpt_lora.lua --short \
  --base="$T/run/base.safetensors" --out="$T/again"
grep -q "training a base GPT" "$T/log" && die_log "--base given, a base was trained anyway"
[ -f "$T/again/model.safetensors" ] || die_log "--base: no export"
echo "ok: gpt_lora --short --base=FILE: no base training, export written"
# the arguments are declared: --help lists them without running, a typo is refused
must "gpt_lora --help" "$FSDPRUN" -n 2 recipes/gpt_lora.lua --help
grep -q -- "--rank=INTEGER" "$T/log" || die_log "--help lists no --rank"
grep -q "training a base" "$T/log" && die_log "--help ran the recipe"
if "$FSDPRUN" -n 2 recipes/gpt_lora.lua --short --rnak=2 --out="$T/typo" >"$T/log" 2>&1; then rc=0; else rc=$?; fi
[ "$rc" -eq 2 ] || die_log "--rnak: exit status $rc, expected 2"
grep -q "unknown argument --rnak; did you mean --rank?" "$T/log" || die_log "--rnak: no message"
echo "ok: gpt_lora --help and an unknown argument"
# --out is a path, not shell text; one that cannot be made stops every rank, naming it
q="$T/it's \$(touch $T/injected)"
must "gpt_lora --out with a quote" "$FSDPRUN" recipes/gpt_lora.lua --short --steps=1 --base_steps=1 --out="$q"
[ -f "$q/model.safetensors" ] || die_log "--out with a quote: no export in '$q'"
[ -e "$T/injected" ] && die "--out was run as shell text"
: >"$T/file"
if "$FSDPRUN" -n 2 recipes/gpt_lora.lua --short --out="$T/file/sub" >"$T/log" 2>&1; then rc=0; else rc=$?; fi
[ "$rc" -eq 1 ] || die_log "--out under a file: exit status $rc, expected 1"
grep -q "gpt_lora: --out=$T/file/sub: .*Not a directory" "$T/log" || die_log "--out under a file: no message naming it"
echo "ok: gpt_lora --out: a path with a quote, a path that cannot be made"
finish
