#!/bin/sh
# embed_install.sh — the installed tree: `cmake --install <build> --prefix DIR` puts fsdprun in
# DIR/bin, libfsdp and fsdp/core.so in DIR/lib, fsdp.h in DIR/include, the Lua library in
# DIR/share/fsdprun/lua and fsdp.pc in DIR/lib/pkgconfig; the installed fsdprun runs a recipe
# (1 and 2 ranks) with the installed Lua library; examples/host_trainer.c builds with
# `cc ... $(pkg-config --cflags --libs fsdp)` against DIR alone and runs, so does the minimal
# host program of docs/EMBEDDING.md (extracted from the page; its output is the one shown
# there), and a host program built the same way finds the installed Lua library (not the
# source tree's); fsdp.h compiles as strict C99 and as C++.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun (the build folder is its dirname/..).
. "${0%/*}/lib.sh"
B=$(cd "$(dirname "$FSDPRUN")/.." && pwd)
P="$T/prefix"

# a clean environment: nothing points into the source or build tree
clean() { env -u LUA_PATH -u LUA_CPATH -u LD_LIBRARY_PATH -u PKG_CONFIG_PATH "$@"; }
# host NAME WHAT: build $T/NAME.c as strict C99 with $flags (the install's, from pkg-config) and
# run it in $T with only the install's library path, as run does; 1 when it did not build
host() {
  # shellcheck disable=SC2086
  run cc -std=c99 -pedantic -Wall -Wextra -Werror -o "$T/$1" "$T/$1.c" $flags
  expect_rc 0 "building $2 against the install"
  [ -x "$T/$1" ] || return 1
  run clean -C "$T" LD_LIBRARY_PATH="$P/lib" "./$1"
  expect_rc 0 "$2"
}

# ---- install ------------------------------------------------------------------------------------
run cmake --install "$B" --prefix "$P"
expect_rc 0 "cmake --install"
[ "$rc" -eq 0 ] || die "embed_install: cannot go on"
for f in bin/fsdprun include/fsdp.h lib/libfsdp.so lib/pkgconfig/fsdp.pc \
  lib/fsdprun/fsdp/core.so share/fsdprun/lua/fsdp/init.lua share/fsdprun/lua/fsdp/nn.lua; do
  [ -e "$P/$f" ] || fail "the install lacks $f"
done

# ---- the installed fsdprun ----------------------------------------------------------------------
cat >"$T/recipe.lua" <<'LUA'
local fsdp = require "fsdp"
local where = package.searchpath("fsdp", package.path)
local m = fsdp.nn.Linear(4, 2)
fsdp.wrap(m)
local y = m(fsdp.ones{3, 4}):sum()
y:backward()
print(("rank %d of %d lib %s ok"):format(fsdp.rank(), fsdp.world_size(), where))
LUA
(cd "$T" && clean "$P/bin/fsdprun" recipe.lua) >"$T/out" 2>"$T/err"; rc=$?
expect_rc 0 "installed fsdprun, one rank"
expect_has out "rank 0 of 1 lib $P/share/fsdprun/lua/fsdp/init.lua ok" "installed Lua library"
(cd "$T" && clean "$P/bin/fsdprun" -n 2 recipe.lua) >"$T/out" 2>"$T/err"; rc=$?
expect_rc 0 "installed fsdprun, two ranks"
expect_has out "rank 1 of 2 lib $P/share/fsdprun/lua/fsdp/init.lua ok" "installed Lua library, rank 1"

# ---- pkg-config ---------------------------------------------------------------------------------
if ! command -v pkg-config >/dev/null 2>&1; then
  fail "pkg-config is not installed"
else
  flags=$(clean PKG_CONFIG_PATH="$P/lib/pkgconfig" pkg-config --cflags --libs fsdp 2>"$T/err")
  [ -n "$flags" ] || fail "pkg-config --cflags --libs fsdp: $(cat "$T/err")"
  case "$flags" in *"$B"*|*"$SRC/"*) fail "pkg-config points into the build or source tree: $flags" ;; esac
  ver=$(clean PKG_CONFIG_PATH="$P/lib/pkgconfig" pkg-config --modversion fsdp)
  grep -q "FSDP_VERSION_MAJOR $(echo "$ver" | cut -d. -f1)" "$P/include/fsdp.h" ||
    fail "pkg-config version $ver does not match fsdp.h"

  # the example, built against the installed tree only
  # shellcheck disable=SC2086 # flags are words
  run cc -std=c11 -Wall -Wextra -Werror -o "$T/host_trainer" "$SRC/examples/host_trainer.c" $flags
  expect_rc 0 "building host_trainer.c against the install"
  if [ -x "$T/host_trainer" ]; then
    (cd "$T" && clean LD_LIBRARY_PATH="$P/lib" ./host_trainer --steps=20 --quiet) >"$T/out" 2>"$T/err"; rc=$?
    expect_rc 0 "host_trainer built against the install"
    expect_has out "host_trainer: ok" "host_trainer built against the install"
    clean LD_LIBRARY_PATH="$P/lib" ldd "$T/host_trainer" | grep -q "$P/lib/libfsdp.so" ||
      fail "host_trainer does not load the installed libfsdp: $(clean LD_LIBRARY_PATH="$P/lib" ldd "$T/host_trainer" | grep fsdp)"
  fi

  # the minimal host program of docs/EMBEDDING.md, as printed there
  awk '/^```c$/ { inside = 1; next } inside && /^```$/ { exit } inside { print }' \
    "$SRC/docs/EMBEDDING.md" >"$T/minimal.c"
  grep -q "minimal.c" "$T/minimal.c" || fail "docs/EMBEDDING.md: no minimal.c in its first C block"
  if host minimal "docs/EMBEDDING.md's minimal.c"; then
    expect_has out "loss 0.000000: y = 2.000 x + 1.000" "minimal.c fits y = 2x + 1 (the output the doc shows)"
    grep -qF "$(cat "$T/out")" "$SRC/docs/EMBEDDING.md" || fail "docs/EMBEDDING.md does not show minimal.c's output '$(cat "$T/out")'"
  fi

  # a host program: which Lua library does the installed libfsdp load?
  cat >"$T/where.c" <<'C'
#include <fsdp.h>
#include <stdio.h>
static void on_log(void *ud, int rank, const char *line) { (void)ud; printf("%d %s\n", rank, line); }
int main(void) {
  fsdp_runtime *rt;
  if (fsdp_runtime_new(&rt, &(fsdp_runtime_opts){.size = sizeof(fsdp_runtime_opts), .world = 2}) != FSDP_OK) {
    fprintf(stderr, "%s\n", fsdp_last_error(NULL));
    return 1;
  }
  fsdp_set_log_callback(rt, on_log, NULL);
  int st = fsdp_run_string(rt, "print(package.searchpath('fsdp', package.path))");
  if (st != FSDP_OK) fprintf(stderr, "%s\n", fsdp_last_error(rt));
  fsdp_runtime_free(rt);
  return st == FSDP_OK ? 0 : 1;
}
C
  if host where "a C99 host"; then
    expect_has out "0 $P/share/fsdprun/lua/fsdp/init.lua" "libfsdp finds the installed Lua library"
    expect_has out "1 $P/share/fsdprun/lua/fsdp/init.lua" "rank 1 too"
  fi
  if command -v c++ >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    run c++ -x c++ -std=c++11 -Wall -Wextra -Werror -fsyntax-only "$P/include/fsdp.h" $flags
    expect_rc 0 "fsdp.h as C++"
  fi
fi

finish
