#!/bin/sh
# plot_cli.sh — `fsdprun plot`: metrics written by fsdp.log in a real fsdprun run are drawn as
# an SVG (panels, title escaped, well-formed when xmllint is there), the output defaults beside
# the input and '-o -' writes to stdout, malformed lines are listed but do not fail the run,
# usage errors exit 2 with one line, unreadable input exits 1, --help, and no LUA_PATH needed.
# Run by ctest with FSDPRUN=<build>/bin/fsdprun.
set -u
. "$(dirname "$0")/lib/check.sh"

file_has() { grep -qF -- "$2" "$1" 2>/dev/null || fail "$3: $1 lacks '$2'"; }

# ---- metrics from a real run through fsdp.log --------------------------------------------------
run "$FSDPRUN" -e "
local log = require 'fsdp.log'
log.setup { total = 200, jsonl = '$T/m.jsonl', out = io.stderr }
for s = 1, 200 do
  local m = { loss = 6 * math.exp(-s / 30) + 0.4, lr = s < 20 and 1e-3 * s / 20 or 1e-3 }
  if s % 50 == 0 then m.val_loss = m.loss + 0.1 end
  if s > 100 then m.sparsity = (s - 100) / 200 end
  if s == 7 then m.loss = 0 / 0 end
  log(s, m)
end
log.finish()"
expect_rc 0 "writing metrics with fsdp.log"
[ "$(grep -c '"step"' "$T/m.jsonl")" -eq 200 ] || fail "fsdp.log wrote $(wc -l <"$T/m.jsonl") lines, expected 200"

# ---- the plot ---------------------------------------------------------------------------------
run "$FSDPRUN" plot "$T/m.jsonl" -o "$T/loss.svg" --title='Run <1> & "2"'
expect_rc 0 "plot"
expect_has out "fsdprun plot: wrote $T/loss.svg" "plot says where"
[ -s "$T/err" ] && fail "plot: unexpected stderr: $(cat "$T/err")"
[ -f "$T/loss.svg" ] || fail "plot: no $T/loss.svg"
head -c 5 "$T/loss.svg" | grep -qF "<?xml" || fail "plot: the file does not start with <?xml"
file_has "$T/loss.svg" "<svg xmlns=\"http://www.w3.org/2000/svg\"" "svg root"
for id in panel-loss panel-lr panel-sparsity series-loss series-val_loss series-lr series-sparsity; do
  file_has "$T/loss.svg" "id=\"$id\"" "$id"
done
file_has "$T/loss.svg" "<title>Run &lt;1&gt; &amp; &quot;2&quot;</title>" "title escaped"
file_has "$T/loss.svg" "loss (log scale)" "loss spanning > 10x on a log axis"
file_has "$T/loss.svg" "1 not finite" "the NaN loss counted"
if command -v xmllint >/dev/null 2>&1; then
  xmllint --noout "$T/loss.svg" 2>"$T/xml" || fail "xmllint: $(cat "$T/xml")"
fi
[ ! -e "$T/loss.svg.tmp" ] || fail "a temporary file was left behind"

# default output beside the input; '-o -' to stdout; options before the file; no LUA_PATH
run env -u LUA_PATH "$FSDPRUN" plot --linear --x=time "$T/m.jsonl"
expect_rc 0 "plot without -o and without LUA_PATH"
[ -f "$T/m.svg" ] || fail "default output $T/m.svg missing"
file_has "$T/m.svg" "time (s)" "--x=time"
run "$FSDPRUN" plot -o - --width=1000 "$T/m.jsonl"
expect_rc 0 "-o -"
expect_has out 'viewBox="0 0 1000 ' "-o - writes the SVG to stdout"

# ---- malformed lines: listed, skipped, not fatal ---------------------------------------------
cp "$T/m.jsonl" "$T/bad.jsonl"
printf '{"step":201,"loss":\nnot json\n' >>"$T/bad.jsonl"
run "$FSDPRUN" plot "$T/bad.jsonl" -o "$T/bad.svg"
expect_rc 0 "malformed lines"
expect_has err "fsdprun plot: $T/bad.jsonl:201:20: unexpected end of line (line skipped)" "line and column"
expect_has err "$T/bad.jsonl:202:1:" "second malformed line"
file_has "$T/bad.svg" "2 malformed lines skipped" "subtitle counts them"
run "$FSDPRUN" plot -q "$T/bad.jsonl" -o "$T/bad.svg"
[ "$(lines_of err)" -eq 0 ] || fail "-q still printed: $(cat "$T/err")"

# ---- errors -----------------------------------------------------------------------------------
run "$FSDPRUN" plot --help
expect_rc 0 "plot --help"
expect_has out "usage: fsdprun plot" "plot --help"
run "$FSDPRUN" --help
expect_has out "fsdprun plot" "fsdprun --help mentions plot"
for bad in "" "--bogus" "--width=12" "--x=epoch"; do
  # shellcheck disable=SC2086 # "" must vanish: no arguments at all
  run "$FSDPRUN" plot $bad
  expect_rc 2 "plot $bad"
  expect_has err "(try 'fsdprun plot --help')" "plot $bad"
  [ "$(lines_of err)" -eq 1 ] || fail "plot $bad: $(lines_of err) lines on stderr, expected 1"
done
run "$FSDPRUN" plot "$T/missing.jsonl" -o "$T/x.svg"
expect_rc 1 "missing input"
expect_has err "fsdprun plot: cannot open $T/missing.jsonl" "missing input"
printf '{"step":1,"tokens":5}\n' >"$T/none.jsonl"
run "$FSDPRUN" plot "$T/none.jsonl"
expect_rc 1 "nothing to plot"
expect_has err "no loss, val_loss, lr or sparsity values to plot" "nothing to plot"
[ ! -e "$T/none.svg" ] || fail "nothing to plot still wrote $T/none.svg"
run "$FSDPRUN" plot "$T/m.jsonl" -o "$T/no-such-dir/x.svg"
expect_rc 1 "unwritable output"
expect_has err "fsdprun plot: cannot write $T/no-such-dir/x.svg" "unwritable output"

finish plot_cli
