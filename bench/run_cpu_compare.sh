#!/bin/sh
# fsdprun against PyTorch on the CPU, the GPT train step (not a test): bench/gpt_step.lua and
# bench/anchors/torch_cpu_gpt.py run interleaved (fsdprun, PyTorch, fsdprun, PyTorch, ...), so
# that load from elsewhere hits both alike; each run's `uptime` is recorded with it.
#   sh bench/run_cpu_compare.sh [--only=L4] [--steps=5] [--rounds=3] [--ranks="1 2"] [--mp=bf16]
#     --ranks: 1 = fsdprun 1 rank against PyTorch 1 process (its default threads);
#              N = fsdprun -n N against PyTorch FSDP2 with N processes over gloo
# Environment: PYTHON, a python with torch (default python3; see the header of
# bench/anchors/torch_cpu_gpt.py to make one); BUILD, the build folder (default build).
# Prints, per model and rank count, the median over rounds of each run's median step time,
# fsdprun / PyTorch, and each one's ratio to its own same-run sgemm rate. Every JSON line is
# kept in $OUT (default a file under ${TMPDIR:-/tmp}, named at the end).
set -eu
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-python3}
ONLY="" STEPS=5 ROUNDS=3 RANKS="1 2" MP=""
for a in "$@"; do
  case "$a" in
    --only=*) ONLY=${a#--only=} ;;
    --steps=*) STEPS=${a#--steps=} ;;
    --rounds=*) ROUNDS=${a#--rounds=} ;;
    --ranks=*) RANKS=${a#--ranks=} ;;
    --mp=*) MP=${a#--mp=} ;;
    --sgemm_s=*) SGEMM_S=${a#--sgemm_s=} ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "run_cpu_compare.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done
SGEMM_S=${SGEMM_S:-1}
FSDPRUN="$BUILD/bin/fsdprun"
[ -x "$FSDPRUN" ] ||
  { echo "run_cpu_compare.sh: no $FSDPRUN (build first, or set BUILD)" >&2; exit 2; }
"$PYTHON" -c "import torch" 2>/dev/null ||
  { echo "run_cpu_compare.sh: $PYTHON cannot import torch (set PYTHON)" >&2; exit 2; }
ANCHOR="$(dirname "$0")/anchors/torch_cpu_gpt.py"
OUT=${OUT:-$(mktemp "${TMPDIR:-/tmp}/cpu_compare.XXXXXX")}
: > "$OUT"

echo "nproc $(nproc); $(uptime)"
TORCH=$("$PYTHON" -c 'import torch; print(torch.__version__)')
echo "fsdprun: $FSDPRUN; PyTorch: $TORCH ($PYTHON)"
opts_l="--steps=$STEPS --sgemm_s=$SGEMM_S${ONLY:+ --only=$ONLY}${MP:+ --mp=$MP}"
opts_p="--steps $STEPS --sgemm-s $SGEMM_S${ONLY:+ --only $ONLY}${MP:+ --mp $MP}"
# one run: its text for people, its JSON lines (tagged with the round and the uptime taken just
# before it) to $OUT; a failed run stops the comparison
run() { # round label command...
  round=$1 label=$2
  shift 2
  up=$(uptime | sed 's/.*load average: *//')
  echo "== round $round, $label, load $up: $*"
  if ! "$@" > "$OUT.run" 2>&1; then
    cat "$OUT.run"
    echo "run_cpu_compare.sh: failed: $*" >&2
    exit 1
  fi
  grep -v '^{' "$OUT.run" || true
  grep '^{' "$OUT.run" | while IFS= read -r line; do
    printf '{"round": %s, "uptime_load": "%s", "run": %s}\n' "$round" "$up" "$line"
  done >> "$OUT"
  rm -f "$OUT.run"
}
r=1
while [ "$r" -le "$ROUNDS" ]; do
  for n in $RANKS; do
    # word splitting of the option strings is meant: each holds separate arguments
    # shellcheck disable=SC2086
    if [ "$n" = 1 ]; then
      run "$r" "fsdprun 1 rank" "$FSDPRUN" bench/gpt_step.lua $opts_l
      run "$r" "pytorch 1 process" "$PYTHON" "$ANCHOR" $opts_p
    else
      run "$r" "fsdprun -n $n" "$FSDPRUN" -n "$n" bench/gpt_step.lua $opts_l
      run "$r" "pytorch fsdp2 x$n" "$PYTHON" "$ANCHOR" --world "$n" $opts_p
    fi
  done
  r=$((r + 1))
done
echo "nproc $(nproc); $(uptime)"

"$PYTHON" - "$OUT" <<'EOF'
import json, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    rec = json.loads(line)
    r = rec["run"]
    key = (r["model"], r["ranks"], r["precision"])
    rows.setdefault(key, {}).setdefault(r["impl"], []).append(r)
med = statistics.median
print()
print(f"{'model':9} {'ranks':>5} {'prec':>5} {'fsdprun s':>10} {'pytorch s':>10} "
      f"{'fsdprun/pt':>10} {'fsdprun:sgemm':>13} {'pt:sgemm':>9} {'GEMM:sg':>8} {'GEMM %':>7} "
      f"{'runs':>5}  loads")
def order(kv):  # L4-d256 before L12-d768; then ranks, f32 first
    (model, ranks, prec), _ = kv
    return (int(model[1:].split("-")[0]), model, ranks, prec != "f32")
for (model, ranks, prec), by in sorted(rows.items(), key=order):
    f, p = by.get("fsdprun", []), by.get("pytorch", [])
    fs = med([x["step_s"] for x in f]) if f else float("nan")
    ps = med([x["step_s"] for x in p]) if p else float("nan")
    fr = med([x["ratio"] for x in f]) if f else float("nan")
    pr = med([x["ratio"] for x in p]) if p else float("nan")
    # fsdprun's library GEMMs inside its step (absent from older JSON lines)
    gr = [x["gemm_ratio"] for x in f if "gemm_ratio" in x]
    gs = [x["gemm_share"] for x in f if "gemm_share" in x]
    gr = med(gr) if gr else float("nan")
    gs = 100 * med(gs) if gs else float("nan")
    loads = sorted({x["loadavg"][0] for x in f + p if x.get("loadavg")}) or ["?"]
    print(f"{model:9} {ranks:5d} {prec:>5} {fs:10.3f} {ps:10.3f} {fs / ps:10.2f} {fr:13.2f} "
          f"{pr:9.2f} {gr:8.2f} {gs:6.0f}% {len(f):2d}+{len(p):<2d}  {loads[0]}-{loads[-1]}")
print("fsdprun/pt: step time ratio (< 1: fsdprun faster); x:sgemm: achieved GFLOP/s over the")
print("same run's sgemm rate (docs/PERFORMANCE.md for the FLOPs convention); GEMM:sg, GEMM %:")
print("fsdprun's library GEMMs inside its step, their rate over the sgemm's and their share of")
print("the step's time; loads: 1-minute load average over the runs")
EOF
echo "JSON lines: $OUT"
