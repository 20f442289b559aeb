#!/bin/sh
# cpu_cache_env.sh — FSDP_CPU_CACHE through the launcher: a size (bytes, or with K, M, G; 0 keeps
# no freed blocks) runs, including a step that frees and reallocates large blocks; a malformed
# value fails at require "fsdp" with a message naming the variable, before any rank runs.
# Run by ctest with FSDPRUN set.
. "${0%/*}/lib.sh"

# large blocks (over the cache's 64 KiB floor) allocated, freed and allocated again
WORK='local f = require "fsdp"
local s = 0
for i = 1, 3 do
  local t = f.zeros({512, 512}) + 1
  s = s + t:sum():item()
  t = nil
  collectgarbage()
end
print(f.rank() .. " " .. s)'
for v in 64M 1048576 0 "" 2g; do
  run env FSDP_CPU_CACHE="$v" "$FSDPRUN" -n 2 -e "$WORK"
  expect_rc 0 "FSDP_CPU_CACHE='$v'"
  [ "$(sort "$T/out")" = "0 786432
1 786432" ] || fail "FSDP_CPU_CACHE='$v': ranks printed '$(cat "$T/out")'"
done

for bad in abc -5 12Q 1.5.5; do
  run env FSDP_CPU_CACHE="$bad" "$FSDPRUN" -n 2 -e "$WORK"
  expect_rc 1 "FSDP_CPU_CACHE=$bad"
  expect_has err "FSDP_CPU_CACHE='$bad': expected bytes, or a number with K, M or G" \
    "FSDP_CPU_CACHE=$bad"
  [ -s "$T/out" ] && fail "FSDP_CPU_CACHE=$bad: a rank ran: $(cat "$T/out")"
done
finish
