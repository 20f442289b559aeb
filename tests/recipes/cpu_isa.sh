#!/bin/sh
# cpu_isa.sh — FSDP_CPU_ISA through the launcher: each level this processor has runs and shows
# in fsdp.info() on every rank; a level it lacks and an unknown value fail at require "fsdp"
# with a message naming the variable. Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"

SHOW='local f = require "fsdp"; print(f.rank() .. " " .. f.info().cpu.isa)'
run env -u FSDP_CPU_ISA "$FSDPRUN" -e 'print(require("fsdp").info().cpu.isa)'
expect_rc 0 "FSDP_CPU_ISA unset"
best=$(cat "$T/out")
echo "best level here: $best"
case "$best" in
  avx512) have="avx512 avx2 scalar" ;;
  avx2) have="avx2 scalar" ;;
  scalar) have="scalar" ;;
  *) fail "fsdp.info().cpu.isa is '$best'"; have="" ;;
esac

for isa in $have; do
  run env FSDP_CPU_ISA=$isa "$FSDPRUN" -n 2 -e "$SHOW"
  expect_rc 0 "FSDP_CPU_ISA=$isa"
  [ "$(sort "$T/out")" = "0 $isa
1 $isa" ] || fail "FSDP_CPU_ISA=$isa: ranks report '$(cat "$T/out")'"
  run env FSDP_CPU_ISA=$isa "$FSDPRUN" -e 'print(tostring(require("fsdp").info()))'
  expect_has out ", kernels $isa" "FSDP_CPU_ISA=$isa in tostring(fsdp.info())"
done
run env FSDP_CPU_ISA=AVX2 "$FSDPRUN" -e "$SHOW"
case "$have" in
  *avx2*) expect_rc 0 "FSDP_CPU_ISA=AVX2 (case)"; expect_has out "0 avx2" "FSDP_CPU_ISA=AVX2" ;;
esac

for isa in avx512 avx2; do
  case "$have" in *$isa*) continue ;; esac
  run env FSDP_CPU_ISA=$isa "$FSDPRUN" -e "$SHOW"
  expect_rc 1 "FSDP_CPU_ISA=$isa on a processor without it"
  expect_has err "FSDP_CPU_ISA=$isa: this processor lacks" "FSDP_CPU_ISA=$isa"
done

for bad in sse9 avx512f 1; do
  run env FSDP_CPU_ISA=$bad "$FSDPRUN" -n 2 -e "$SHOW"
  expect_rc 1 "FSDP_CPU_ISA=$bad"
  expect_has err "FSDP_CPU_ISA='$bad': unknown instruction set (avx512, avx2 or scalar)" \
    "FSDP_CPU_ISA=$bad"
  [ -s "$T/out" ] && fail "FSDP_CPU_ISA=$bad: a rank ran: $(cat "$T/out")"
done

finish
