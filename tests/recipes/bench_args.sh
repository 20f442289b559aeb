#!/bin/sh
# The benchmarks that declare their arguments (fsdp.args): --help prints them and exits 0, a bad
# or unknown value is refused with a line naming it, tokens_rss without --file says so, and the
# cpu-sized runs of mp_step, gpu_step, gpu_offload (the latter two with --device=cpu),
# add_layernorm and clip_step run through. Timings are not judged.
set -eu
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for b in mp_step ckpt prune tokens_rss gpu_step gpu_offload generate add_layernorm clip_step; do
  "$FSDPRUN" "bench/$b.lua" --help > "$tmp" 2>&1 || { cat "$tmp"; echo "FAIL: $b --help"; exit 1; }
  grep -q "^usage: fsdprun" "$tmp" || { cat "$tmp"; echo "FAIL: $b --help printed no usage"; exit 1; }
done
refused() { # expected message, then arguments
  want=$1
  shift
  if "$FSDPRUN" "$@" > "$tmp" 2>&1; then
    cat "$tmp"; echo "FAIL: accepted $*"; exit 1
  fi
  grep -qF -- "$want" "$tmp" || { cat "$tmp"; echo "FAIL: $* did not say: $want"; exit 1; }
  echo "ok: refused $* ($want)"
}
refused "unknown argument --stepz; did you mean --steps?" bench/mp_step.lua --stepz=3
refused "--mp: 'f8' is not one of" bench/mp_step.lua --mp=f8
refused "--repeat: 0 is below the minimum 1" bench/ckpt.lua --repeat=0
refused "--reps: 'x' is not an integer" bench/prune.lua --reps=x
refused "tokens_rss: --file=PATH is required" bench/tokens_rss.lua
refused "--offload: 'disk' is not one of cpu" bench/gpu_offload.lua --offload=disk
refused "--time_limit: -1 is below the minimum 0" bench/gpu_step.lua --time_limit=-1
refused '--widths: "3x" is not a positive integer' bench/add_layernorm.lua --widths=3x
refused "--rounds: 0 is below the minimum 1" bench/clip_step.lua --rounds=0

"$FSDPRUN" bench/mp_step.lua --only=L4 --rounds=1 --steps=1 --batch=2 --ctx=16 > "$tmp" 2>&1 || {
  cat "$tmp"; echo "FAIL: mp_step.lua"; exit 1; }
grep -q "^L4-d256 " "$tmp" || { cat "$tmp"; echo "FAIL: mp_step.lua printed no row"; exit 1; }
"$FSDPRUN" bench/gpu_step.lua --device=cpu --d=32 --layers=1 --heads=2 --ctx=16 --vocab=64 \
  --batch=2 --steps=1 --warmup=1 --peak_n=32 > "$tmp" 2>&1 || {
  cat "$tmp"; echo "FAIL: gpu_step.lua --device=cpu"; exit 1; }
grep -q '"what":"gpu_step"' "$tmp" || { cat "$tmp"; echo "FAIL: gpu_step.lua: no JSON"; exit 1; }
"$FSDPRUN" bench/gpu_offload.lua --device=cpu --d=32 --layers=1 --ctx=16 --vocab=64 > "$tmp" 2>&1 || {
  cat "$tmp"; echo "FAIL: gpu_offload.lua --device=cpu"; exit 1; }
grep -q '"result":"ok"' "$tmp" || { cat "$tmp"; echo "FAIL: gpu_offload.lua did not train"; exit 1; }
# (it also checks that the fused op gives the two ops' bits)
"$FSDPRUN" bench/add_layernorm.lua --widths=8,70 --calls=2 --rounds=1 --batch=1 --ctx=5 \
  > "$tmp" 2>&1 || { cat "$tmp"; echo "FAIL: add_layernorm.lua"; exit 1; }
grep -q "^70 " "$tmp" || { cat "$tmp"; echo "FAIL: add_layernorm.lua printed no row"; exit 1; }
# (it also checks that both ways train the same parameters)
"$FSDPRUN" bench/clip_step.lua --layers=1 --d=32 --heads=2 --rounds=2 > "$tmp" 2>&1 || {
  cat "$tmp"; echo "FAIL: clip_step.lua"; exit 1; }
grep -q "^same parameters after both: yes" "$tmp" || {
  cat "$tmp"; echo "FAIL: clip_step.lua did not compare"; exit 1; }
echo "ok: the benchmarks' arguments"
