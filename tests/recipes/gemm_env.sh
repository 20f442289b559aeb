#!/bin/sh
# gemm_env.sh — FSDP_GEMM and FSDP_BF16_GEMM through the launcher: each library this build and
# processor can run is taken when asked and shows in fsdp.info() on every rank; asking for one
# that cannot run here, or an unknown value, fails at require "fsdp" with a message naming the
# variable, before any rank runs. Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"

SHOW='local f = require "fsdp"; print(f.rank() .. " " .. f.info().devices[1].description)'
run env -u FSDP_GEMM -u FSDP_BF16_GEMM "$FSDPRUN" -e "$SHOW"
expect_rc 0 "defaults"
default=$(cat "$T/out")
echo "default here: $default"
# what the default took tells what this build and processor can run
case "$default" in
  *"f32 onednn"*) f32_onednn=yes ;;
  *"f32 openblas"*) f32_onednn=no ;;
  *) fail "no f32 library in '$default'"; f32_onednn=no ;;
esac
case "$default" in
  *"bf16 onednn"*) bf16_native=yes ;;
  *"bf16 by conversion"*) bf16_native=no ;;
  *) fail "no bf16 path in '$default'"; bf16_native=no ;;
esac

# both ranks take what the variables ask for
check() { # FSDP_GEMM FSDP_BF16_GEMM expected-f32-words expected-bf16-words
  run env FSDP_GEMM="$1" FSDP_BF16_GEMM="$2" "$FSDPRUN" -n 2 -e "$SHOW"
  expect_rc 0 "FSDP_GEMM=$1 FSDP_BF16_GEMM=$2"
  n=$(grep -cF -- "$3" "$T/out")
  [ "$n" -eq 2 ] || fail "FSDP_GEMM=$1: '$3' on $n of 2 ranks: $(cat "$T/out")"
  n=$(grep -cF -- "$4" "$T/out")
  [ "$n" -eq 2 ] || fail "FSDP_BF16_GEMM=$2: '$4' on $n of 2 ranks: $(cat "$T/out")"
}
check openblas convert "f32 openblas" "bf16 by conversion to f32"
check OpenBLAS auto "f32 openblas" "bf16"
check auto Convert "f32" "bf16 by conversion to f32"
check "" "" "f32" "bf16"
[ "$f32_onednn" = yes ] && {
  check onednn native "f32 onednn" "bf16"
  check openblas "" "f32 openblas 0.3" "bf16"
  expect_has out "(onednn off)" "FSDP_GEMM=openblas where oneDNN could run"
}
[ "$bf16_native" = yes ] && check auto native "f32" "bf16 onednn"

# asking for a library that cannot run: here when it cannot, and everywhere with oneDNN held to
# AVX2 (DNNL_MAX_CPU_ISA; what a processor without AVX-512 gets)
for hold in "" DNNL_MAX_CPU_ISA=AVX2; do
  if [ -n "$hold" ] || [ "$f32_onednn" = no ]; then
    run env $hold FSDP_GEMM=onednn "$FSDPRUN" -n 2 -e "$SHOW"
    expect_rc 1 "FSDP_GEMM=onednn where oneDNN cannot run ($hold)"
    expect_has err "FSDP_GEMM=onednn: oneDNN cannot run f32 GEMMs here" "FSDP_GEMM=onednn"
    [ -s "$T/out" ] && fail "FSDP_GEMM=onednn: a rank ran: $(cat "$T/out")"
  fi
  if [ -n "$hold" ] || [ "$bf16_native" = no ]; then
    run env $hold FSDP_BF16_GEMM=native "$FSDPRUN" -n 2 -e "$SHOW"
    expect_rc 1 "FSDP_BF16_GEMM=native where it cannot run ($hold)"
    expect_has err "FSDP_BF16_GEMM=native: no native bf16 GEMMs here" "FSDP_BF16_GEMM=native"
    [ -s "$T/out" ] && fail "FSDP_BF16_GEMM=native: a rank ran: $(cat "$T/out")"
  fi
done

for bad in mkl blis 1; do
  run env FSDP_GEMM=$bad "$FSDPRUN" -n 2 -e "$SHOW"
  expect_rc 1 "FSDP_GEMM=$bad"
  expect_has err "FSDP_GEMM='$bad': unknown (openblas, onednn or auto)" "FSDP_GEMM=$bad"
  [ -s "$T/out" ] && fail "FSDP_GEMM=$bad: a rank ran: $(cat "$T/out")"
  run env FSDP_BF16_GEMM=$bad "$FSDPRUN" -e "$SHOW"
  expect_rc 1 "FSDP_BF16_GEMM=$bad"
  expect_has err "FSDP_BF16_GEMM='$bad': unknown (convert, native or auto)" "FSDP_BF16_GEMM=$bad"
done

finish
