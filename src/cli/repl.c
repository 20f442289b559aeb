/*
 * repl.c — the SPMD REPL of fsdprun: `fsdprun -n N -i [recipe.lua]` and fsdp.debug().
 * docs/REPL.md is the manual; repl.h the interface with the launcher.
 *
 * One input, on a world of W > 1 ranks:
 *
 *   rank 0  reads it (libedit on a terminal, plain lines otherwise; an unfinished chunk reads
 *           more lines), or a command (:rank K, :all, :timeout, :help, :quit);
 *   all     get it through `ctl`, a communicator the REPL owns (broadcast from rank 0), so the
 *           same protocol runs over threads (local) and processes (MPI);
 *   each    rank that the input is for evaluates it with `print` captured (fsdp_repl_capture),
 *           its values turned into text with tostring, its error caught: an error never ends
 *           the rank and never poisons the recipe's communicator;
 *   rank 0  gathers every rank's outcome through `ctl` (all_gather) and prints results grouped
 *           by rank, identical ones merged ("[0-3] 42", "[0] 1.5  [1] 2.5"), then the errors,
 *           grouped the same way.
 *
 * Collectives inside an input run on the recipe's communicator `comm`. While the REPL runs,
 * its timeout is the REPL's (10 s, FSDP_REPL_TIMEOUT, `:timeout S`), so a collective entered by
 * only some ranks fails with the communicator's "timeout ... rank R has not arrived" instead of
 * hanging; that poisons `comm` (sequence numbers are out of step for good), which the REPL then
 * says once: collectives fail at once from there on, everything else still works, and after
 * fsdp.debug() the recipe cannot go on (fsdp.debug raises). In ":rank K" mode the input runs
 * on rank K alone and comm refuses collectives (fsdp_comm_set_refuse) with a clear error.
 *
 * The post-mortem (fsdp_repl_post_mortem, fsdprun --debug-on-error) is the same loop entered
 * after a failure: the ranks meet on `ctl` instead, and revive `comm` before the first input.
 *
 * Texts travel as bytes (u8 collectives) after their sizes (i64). With W == 1 nothing travels and nothing is captured: values print at once through the
 * global print and errors with their traceback, as in `luajit`.
 */
#include "cli/repl.h"

#include <ctype.h>
#include <errno.h>
#include <histedit.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <lauxlib.h>

#include "lua/binding.h"

#define PROGNAME "fsdprun"
#define REPL_PROMPT "fsdp> "
#define REPL_PROMPT2 ">> "
#define REPL_DEFAULT_TIMEOUT 10.0     /* s: how long an input's collective waits for peers */
#define REPL_CTL_TIMEOUT 1e9          /* s: peers wait for rank 0's user without limit */
#define REPL_MAX_OUT ((size_t)1 << 20) /* captured text per rank and input */
#define REPL_MAX_INPUT ((size_t)16 << 20)
#define REPL_HISTORY_SIZE 1000
#define REPL_RECORDER_LINES 4 /* newest collectives shown of a failure's flight recorder */

/* ---- growable byte buffers --------------------------------------------------------------- */

typedef struct rbuf {
  char *p;
  size_t len, cap;
  bool cut; /* something did not fit (the capture limit, or out of memory) */
} rbuf;

static bool rb_reserve(rbuf *b, size_t extra) {
  if (b->len + extra + 1 <= b->cap) return true;
  size_t cap = b->cap ? b->cap : 256;
  while (cap < b->len + extra + 1) cap *= 2;
  char *p = realloc(b->p, cap);
  if (!p) {
    b->cut = true;
    return false;
  }
  b->p = p;
  b->cap = cap;
  return true;
}

static void rb_add(rbuf *b, const char *s, size_t n) {
  if (n == 0 || !rb_reserve(b, n)) return;
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static void rb_str(rbuf *b, const char *s) { rb_add(b, s, strlen(s)); }

static void rb_fmt(rbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void rb_fmt(rbuf *b, const char *fmt, ...) {
  char tmp[512];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (n > 0) rb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static const char *rb_text(const rbuf *b) { return b->p ? b->p : ""; }

static void rb_clear(rbuf *b) {
  b->len = 0;
  b->cut = false;
  if (b->p) b->p[0] = '\0';
}

static void rb_free(rbuf *b) {
  free(b->p);
  *b = (rbuf){0};
}

/* ---- print capture ------------------------------------------------------------------------- */

static _Thread_local rbuf *tl_capture; /* where this rank's print goes during an evaluation */
static _Thread_local int tl_depth;     /* REPLs running on this thread (never more than one) */

static void capture_add(rbuf *b, const char *s, size_t n) {
  if (b->len + n > REPL_MAX_OUT) {
    n = b->len < REPL_MAX_OUT ? REPL_MAX_OUT - b->len : 0;
    b->cut = true;
  }
  rb_add(b, s, n);
}

bool fsdp_repl_capture(const char *s, size_t n) {
  rbuf *b = tl_capture;
  if (!b) return false;
  capture_add(b, s, n);
  return true;
}

/* ---- the channel: bytes over ctl --------------------------------------------------------- */

/* Rank 0's msg to every rank (msg is filled on the others). FSDP_OK, or FSDP_ERR with the
 * message in the error slot. */
static int ctl_bcast(const fsdp_repl_host *h, rbuf *msg) {
  int64_t len = h->rank == 0 ? (int64_t)msg->len : 0;
  if (fsdp_comm_broadcast(h->ctl, &len, 1, FSDP_DTYPE_I64, 0, "repl.input.size") != FSDP_OK)
    return FSDP_ERR;
  if (h->rank != 0) {
    rb_clear(msg);
    if (!rb_reserve(msg, (size_t)len)) {
      fsdp_error("the REPL's channel: out of memory for an input of %lld bytes", (long long)len);
      fsdp_comm_abort(h->ctl, fsdp_error_msg()); /* the peers would wait for this rank forever */
      return FSDP_ERR;
    }
  }
  if (fsdp_comm_broadcast(h->ctl, msg->p, len, FSDP_DTYPE_U8, 0, "repl.input") != FSDP_OK)
    return FSDP_ERR;
  if (h->rank != 0) {
    msg->len = (size_t)len;
    msg->p[len] = '\0';
  }
  return FSDP_OK;
}

/* Every rank's `mine`; rank 0 gets them in all[0..world) (the other ranks pass NULL). */
static int ctl_gather(const fsdp_repl_host *h, const rbuf *mine, rbuf *all) {
  int W = h->world, r = h->rank;
  int64_t *sizes = calloc((size_t)W, sizeof *sizes);
  if (!sizes) {
    fsdp_error("the REPL's channel: out of memory");
    fsdp_comm_abort(h->ctl, fsdp_error_msg());
    return FSDP_ERR;
  }
  sizes[r] = (int64_t)mine->len;
  if (fsdp_comm_all_gather(h->ctl, sizes, sizes + r, 1, FSDP_DTYPE_I64, "repl.output.size") !=
      FSDP_OK) {
    free(sizes);
    return FSDP_ERR;
  }
  size_t max = 0;
  for (int p = 0; p < W; p++)
    if ((size_t)sizes[p] > max) max = (size_t)sizes[p];
  int rc = FSDP_OK;
  if (max > 0) { /* every rank saw the same sizes: all skip or all take part */
    char *f = calloc(max * (size_t)W, 1);
    if (!f) {
      free(sizes);
      fsdp_error("the REPL's channel: out of memory for %d outputs of %zu bytes", W, max);
      fsdp_comm_abort(h->ctl, fsdp_error_msg());
      return FSDP_ERR;
    }
    if (mine->len) memcpy(f + (size_t)r * max, mine->p, mine->len);
    rc = fsdp_comm_all_gather(h->ctl, f, f + (size_t)r * max, (int64_t)max, FSDP_DTYPE_U8,
                              "repl.output");
    if (rc == FSDP_OK && all) {
      for (int p = 0; p < W; p++) {
        size_t n = (size_t)sizes[p];
        rb_clear(&all[p]);
        if (n > 0 && rb_reserve(&all[p], n)) {
          memcpy(all[p].p, f + (size_t)p * max, n);
          all[p].len = n;
          all[p].p[n] = '\0';
        }
      }
    }
    free(f);
  } else if (all) {
    for (int p = 0; p < W; p++) rb_clear(&all[p]);
  }
  free(sizes);
  return rc;
}

/* ---- messages and outcomes --------------------------------------------------------------------- */

/* Rank 0 -> all: kind, then a 32-bit argument, then text. */
enum { MSG_EVAL = 'E', MSG_QUIT = 'Q', MSG_TIMEOUT = 'T' };

static void put_u32(rbuf *b, uint32_t v) {
  char c[4] = {(char)(v & 0xff), (char)(v >> 8 & 0xff), (char)(v >> 16 & 0xff),
               (char)(v >> 24 & 0xff)};
  rb_add(b, c, 4);
}

static uint32_t get_u32(const char *p) {
  const unsigned char *u = (const unsigned char *)p;
  return (uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16 | (uint32_t)u[3] << 24;
}

static void msg_make(rbuf *b, char kind, int32_t arg, const char *text, size_t n) {
  rb_clear(b);
  rb_add(b, &kind, 1);
  put_u32(b, (uint32_t)arg);
  rb_add(b, text, n);
}

/* One rank's result for one input. */
enum { OC_RAN = 1, OC_FAILED = 2, OC_CUT = 4, OC_EXIT = 8 /* os.exit: the session ends */ };
typedef struct outcome {
  unsigned flags;
  rbuf out; /* captured print output and the values' text */
  rbuf err; /* the error message (with its traceback) */
} outcome;

static void outcome_encode(rbuf *b, const outcome *oc) {
  rb_clear(b);
  char f = (char)(oc->flags | (oc->out.cut ? OC_CUT : 0));
  rb_add(b, &f, 1);
  put_u32(b, (uint32_t)oc->out.len);
  rb_add(b, rb_text(&oc->out), oc->out.len);
  put_u32(b, (uint32_t)oc->err.len);
  rb_add(b, rb_text(&oc->err), oc->err.len);
}

static void outcome_decode(outcome *oc, const rbuf *b) {
  rb_clear(&oc->out);
  rb_clear(&oc->err);
  oc->flags = 0;
  if (b->len < 9) return;
  oc->flags = (unsigned char)b->p[0];
  size_t n = get_u32(b->p + 1), at = 5;
  if (n > b->len - at) return;
  rb_add(&oc->out, b->p + at, n);
  at += n;
  if (b->len - at < 4) return;
  size_t m = get_u32(b->p + at);
  at += 4;
  if (m > b->len - at) return;
  rb_add(&oc->err, b->p + at, m);
}

/* ---- evaluation ----------------------------------------------------------------------------- */

/* Compile an input the way every rank runs it: as an expression list first (so `1 + 1` gives
 * 2; "=expr" as in Lua 5.1), else as statements. The values pass through an identity function
 * rather than `return <input>` so that a call in it is not a tail call and its error keeps the
 * position ("stdin:1: x"). When the last line may end in a comment, a newline stops it from
 * eating the closing parenthesis; only then, since LuaJIT gives the code of the last argument
 * the line of that parenthesis (`nosuch.x` would fail on "stdin:2").
 * Pushes the function and returns 0, or pushes the message and returns the status. */
static int load_input(lua_State *L, const char *text, size_t len) {
  const char *s = text;
  size_t n = len;
  if (n > 0 && s[0] == '=') {
    s++;
    n--;
  }
  const char *last = s + n;
  while (last > s && last[-1] != '\n') last--;
  bool comment = false;
  for (const char *c = last; c + 1 < s + n && !comment; c++) comment = c[0] == '-' && c[1] == '-';
  lua_pushliteral(L, "return (function(...) return ... end)(");
  lua_pushlstring(L, s, n);
  if (comment) lua_pushliteral(L, "\n)");
  else lua_pushliteral(L, ")");
  lua_concat(L, 3);
  size_t cl;
  const char *code = lua_tolstring(L, -1, &cl);
  int status = luaL_loadbuffer(L, code, cl, "=stdin");
  lua_remove(L, -2);
  if (status == 0) return 0;
  lua_pop(L, 1);
  return luaL_loadbuffer(L, text, len, "=stdin");
}

/* Whether the input only ended too early (a syntax error at '<eof>'): read more lines. */
static bool input_incomplete(lua_State *L, const char *text, size_t len) {
  int top = lua_gettop(L);
  int status = load_input(L, text, len);
  bool more = false;
  if (status == LUA_ERRSYNTAX) {
    size_t ml;
    const char *msg = lua_tolstring(L, -1, &ml);
    static const char eof[] = "'<eof>'";
    more = msg != NULL && ml >= sizeof eof - 1 && strcmp(msg + ml - (sizeof eof - 1), eof) == 0;
  }
  lua_settop(L, top);
  return more;
}

/* jit.off(f, true) for the compiled input on top: its loops (and the functions it defines) run
 * in the interpreter, where ^C's hook is seen; LuaJIT never runs hooks inside compiled traces,
 * so `while true do n = n + 1 end` typed at the prompt could otherwise only be stopped by
 * ending the process. What the input calls (the recipe, the library) keeps the JIT. */
static void jit_off(lua_State *L) {
  int top = lua_gettop(L);
  lua_getfield(L, LUA_REGISTRYINDEX, "_LOADED");
  if (lua_istable(L, -1)) {
    lua_getfield(L, -1, "jit");
    if (lua_istable(L, -1)) {
      lua_getfield(L, -1, "off");
      if (lua_isfunction(L, -1)) {
        lua_pushvalue(L, top);
        lua_pushboolean(L, 1);
        lua_pcall(L, 2, 0, 0); /* an error here only leaves the JIT on */
      }
    }
  }
  lua_settop(L, top);
}

/* tostring of every argument, tab-separated, as one string (what print would write). */
static int values_text(lua_State *L) {
  fsdp_lua_print_line(L, false);
  return 1;
}

/* Run one input on this rank. capture: collect print output and the values' text into
 * oc->out (W > 1); otherwise values print at once through the global print (W == 1). */
static void eval_input(const fsdp_repl_host *h, lua_State *L, const char *text, size_t len,
                       bool capture, outcome *oc) {
  int base = lua_gettop(L);
  rb_clear(&oc->out);
  rb_clear(&oc->err);
  oc->flags = OC_RAN;
  int status = load_input(L, text, len);
  if (status == 0) {
    jit_off(L);
    if (capture) tl_capture = &oc->out;
    status = h->pcall(h->ctx, L, 0, LUA_MULTRET);
    int n = lua_gettop(L) - base;
    if (status == 0 && n > 0) {
      if (capture) lua_pushcfunction(L, values_text);
      else lua_getglobal(L, "print");
      lua_insert(L, base + 1);
      status = lua_pcall(L, n, capture ? 1 : 0, 0);
      if (status == 0 && capture) {
        size_t tl;
        const char *t = lua_tolstring(L, -1, &tl);
        capture_add(&oc->out, t, tl);
        capture_add(&oc->out, "\n", 1);
      } else if (status != 0) {
        const char *m = lua_tostring(L, -1);
        lua_pushfstring(L, "error calling 'print' (%s)", m ? m : "?");
      }
    }
    tl_capture = NULL;
  }
  if (status != 0 && h->exiting != NULL && h->exiting(h->ctx)) {
    oc->flags |= OC_EXIT; /* not an error: the rank's run ends */
  } else if (status != 0) {
    oc->flags |= OC_FAILED;
    const char *m = lua_tostring(L, -1);
    rb_str(&oc->err, m ? m : "(error object is not a string)");
  }
  lua_settop(L, base);
}

/* ---- grouped output (rank 0) ------------------------------------------------------------------- */

/* "0-3", "0,2", "1-2,5": ranks ascending, runs of two or more as a range. */
static void rankset(rbuf *b, const int *ranks, int k) {
  for (int i = 0; i < k;) {
    int j = i;
    while (j + 1 < k && ranks[j + 1] == ranks[j] + 1) j++;
    if (i > 0) rb_str(b, ",");
    if (j > i) rb_fmt(b, "%d-%d", ranks[i], ranks[j]);
    else rb_fmt(b, "%d", ranks[i]);
    i = j + 1;
  }
}

static int terminal_columns(void) {
  struct winsize ws;
  if (isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col >= 20)
    return ws.ws_col;
  return 100;
}

/* A failure's message with its flight recorder (comm.h: "\nflight recorder (rank R, newest
 * last):\n#11 ...") cut to the newest REPL_RECORDER_LINES collectives: at a prompt the last
 * few say what went wrong; a training loop's 64 would push the answer off the screen. */
static void add_message(rbuf *dst, const char *msg, size_t n) {
  static const char fr[] = "\nflight recorder (";
  const char *at = NULL;
  for (const char *p = msg; p < msg + n; p++) {
    if ((size_t)(msg + n - p) >= sizeof fr - 1 && memcmp(p, fr, sizeof fr - 1) == 0) {
      at = p;
      break;
    }
  }
  if (at == NULL) {
    rb_add(dst, msg, n);
    return;
  }
  const char *body = memchr(at + 1, '\n', (size_t)(msg + n - at - 1));
  if (body == NULL) {
    rb_add(dst, msg, n);
    return;
  }
  int lines = 0;
  for (const char *p = body; p < msg + n; p++) lines += *p == '\n';
  if (lines <= REPL_RECORDER_LINES) {
    rb_add(dst, msg, n);
    return;
  }
  const char *keep = body;
  for (int skip = lines - REPL_RECORDER_LINES; skip > 0; skip--)
    keep = memchr(keep + 1, '\n', (size_t)(msg + n - keep - 1));
  rb_add(dst, msg, (size_t)(body - msg));
  rb_fmt(dst, "\n... (%d older)", lines - REPL_RECORDER_LINES);
  rb_add(dst, keep, (size_t)(msg + n - keep));
}

/* The message without the stack frames that belong to the REPL itself or to the recipe below
 * fsdp.debug(): everything from the input's main chunk down, and the [C] frames of
 * error/assert. What is left (functions the input called) keeps its "stack traceback:". */
static void trim_traceback(rbuf *dst, const char *msg) {
  const char *tb = strstr(msg, "\nstack traceback:");
  size_t head = tb ? (size_t)(tb - msg) : strlen(msg);
  add_message(dst, msg, head);
  if (!tb) return;
  const char *p = strchr(tb + 1, '\n');
  rbuf kept = {0};
  while (p && *p) {
    p++;
    const char *e = strchr(p, '\n');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    bool main_chunk = strncmp(p, "\tstdin:", 7) == 0 && n >= 13 &&
                      memcmp(p + n - 13, "in main chunk", 13) == 0;
    if (main_chunk) break;
    bool noise = strncmp(p, "\t[C]: in function 'error'", 25) == 0 ||
                 strncmp(p, "\t[C]: in function 'assert'", 26) == 0 ||
                 strncmp(p, "\t[C]: at 0x", 11) == 0 || strncmp(p, "\t[C]: in ?", 10) == 0 ||
                 strncmp(p, "\t(tail call): ?", 15) == 0;
    if (!noise) {
      rb_str(&kept, "\n");
      rb_add(&kept, p, n);
    }
    p = e;
  }
  if (kept.len > 0) {
    rb_str(dst, "\nstack traceback:");
    rb_add(dst, kept.p, kept.len);
  }
  rb_free(&kept);
}

/* The length that decides whether two texts are "the same": the whole output, but only the
 * first line of an error (what follows, a flight recorder or a traceback, is per rank; the
 * group shows its first member's). */
static size_t key_len(const rbuf *b, bool errors) {
  if (!errors) return b->len;
  const char *nl = memchr(rb_text(b), '\n', b->len);
  return nl ? (size_t)(nl - b->p) : b->len;
}

/* Group ranks whose text (out or err) is the same. group[p] = the first rank with the same
 * text, or -1 when rank p has none. */
static void group_by(const outcome *oc, int W, bool errors, int *group) {
  for (int p = 0; p < W; p++) {
    const rbuf *a = errors ? &oc[p].err : &oc[p].out;
    group[p] = -1;
    bool has = errors ? (oc[p].flags & OC_FAILED) != 0 : a->len > 0;
    if (!(oc[p].flags & OC_RAN) || !has) continue;
    group[p] = p;
    size_t ka = key_len(a, errors);
    for (int q = 0; q < p; q++) {
      const rbuf *b = errors ? &oc[q].err : &oc[q].out;
      if (group[q] == q && ka == key_len(b, errors) && memcmp(rb_text(a), rb_text(b), ka) == 0) {
        group[p] = q;
        break;
      }
    }
  }
}

/* "[0-3] 42\n", "[0] 1.5  [1] 2.5\n", or a multi-line block per group, into out. */
static void format_results(rbuf *out, const outcome *oc, int W, int *group, int *members) {
  group_by(oc, W, false, group);
  int ngroups = 0;
  bool one_line = true;
  size_t width = 0;
  rbuf label = {0};
  for (int g = 0; g < W; g++) {
    if (group[g] != g) continue;
    ngroups++;
    const rbuf *t = &oc[g].out;
    size_t n = t->len;
    if (n > 0 && t->p[n - 1] == '\n') n--;
    if (memchr(t->p, '\n', n) != NULL) one_line = false;
    width += n + 12;
  }
  if (ngroups < 2 || width > (size_t)terminal_columns()) one_line = false;
  bool first = true;
  for (int g = 0; g < W; g++) {
    if (group[g] != g) continue;
    int k = 0;
    for (int p = g; p < W; p++)
      if (group[p] == g) members[k++] = p;
    rb_clear(&label);
    rb_str(&label, "[");
    rankset(&label, members, k);
    rb_str(&label, "]");
    const rbuf *t = &oc[g].out;
    size_t n = t->len;
    if (n > 0 && t->p[n - 1] == '\n') n--;
    if (one_line) {
      if (!first) rb_str(out, "  ");
      rb_add(out, label.p, label.len);
      rb_str(out, " ");
      rb_add(out, t->p, n);
    } else {
      /* continuation lines line up under the first line's text */
      rb_add(out, label.p, label.len);
      rb_str(out, " ");
      const char *s = t->p, *end = t->p + n;
      while (s < end) {
        const char *nl = memchr(s, '\n', (size_t)(end - s));
        size_t ln = nl ? (size_t)(nl - s) : (size_t)(end - s);
        rb_add(out, s, ln);
        rb_str(out, "\n");
        if (!nl) break;
        s = nl + 1;
        for (size_t i = 0; i <= label.len; i++) rb_str(out, " ");
      }
      if (n == 0) rb_str(out, "\n");
      if (oc[g].flags & OC_CUT)
        rb_fmt(out, "%*s(output cut at %zu bytes)\n", (int)label.len + 1, "", REPL_MAX_OUT);
    }
    first = false;
  }
  if (one_line && ngroups > 0) rb_str(out, "\n");
  rb_free(&label);
}

static void format_errors(rbuf *err, const outcome *oc, int W, int *group, int *members) {
  group_by(oc, W, true, group);
  for (int g = 0; g < W; g++) {
    if (group[g] != g) continue;
    int k = 0;
    for (int p = g; p < W; p++)
      if (group[p] == g) members[k++] = p;
    rb_str(err, PROGNAME ": [");
    rankset(err, members, k);
    rb_str(err, "] ");
    trim_traceback(err, rb_text(&oc[g].err));
    rb_str(err, "\n");
  }
}

/* ---- reading (rank 0) -------------------------------------------------------------------------- */

typedef struct reader {
  bool tty;         /* stdin is a terminal: prompts, and libedit unless turned off */
  bool cancelled;   /* ^C at the prompt: the input so far is dropped */
  EditLine *el;     /* NULL: plain lines (getline) */
  History *hist;
  HistEvent ev;
  char *hist_path;  /* NULL: no history file */
  char *line;       /* the line just read, without its newline */
  size_t cap;
  const char *prompt;
  lua_State *L;     /* rank 0's state: completion looks names up in it */
} reader;

static reader *g_rd; /* the one reader of this process (rank 0's), for libedit's callbacks */

static char *prompt_cb(EditLine *el) {
  (void)el;
  return (char *)(g_rd && g_rd->prompt ? g_rd->prompt : REPL_PROMPT);
}

/* Pushes the function `name` of fsdp.repl (lua/fsdp/repl.lua); false, with nothing pushed,
 * when it cannot be had. */
static bool push_repl_fn(lua_State *L, const char *name) {
  if (!lua_checkstack(L, 8)) return false;
  lua_getglobal(L, "require");
  lua_pushliteral(L, "fsdp.repl");
  if (lua_pcall(L, 1, 1, 0) != 0 || !lua_istable(L, -1)) {
    lua_pop(L, 1);
    return false;
  }
  lua_getfield(L, -1, name);
  lua_remove(L, -2);
  if (lua_isfunction(L, -1)) return true;
  lua_pop(L, 1);
  return false;
}

/* ^C at the prompt (libedit turns ISIG off while it edits, so it arrives as a key): end the
 * line and drop the input typed so far, as a shell does. Leaving is :quit or ^D; a stray ^C
 * must not throw away a session that holds a trained model. */
static unsigned char cancel_cb(EditLine *el, int ch) {
  (void)el;
  (void)ch;
  if (g_rd) g_rd->cancelled = true;
  return CC_NEWLINE;
}

/* Tab: fsdp.repl.complete (lua/fsdp/repl.lua) finds the candidates in rank 0's state; this
 * inserts what they share beyond the typed name, or lists them under the line. */
static unsigned char complete_cb(EditLine *el, int ch) {
  (void)ch;
  reader *rd = g_rd;
  if (!rd || !rd->L) return CC_ERROR;
  lua_State *L = rd->L;
  const LineInfo *li = el_line(el);
  int top = lua_gettop(L);
  unsigned char rc = CC_ERROR; /* nothing: beep */
  if (!push_repl_fn(L, "complete")) return rc;
  lua_pushlstring(L, li->buffer, (size_t)(li->cursor - li->buffer));
  if (lua_pcall(L, 1, 2, 0) != 0 || !lua_istable(L, -2) || !lua_isstring(L, -1)) goto done;
  int names = lua_gettop(L) - 1, n = (int)lua_objlen(L, names);
  size_t add_n;
  const char *add = lua_tolstring(L, -1, &add_n);
  if (n == 0) goto done;
  if (add_n > 0) {
    char *ins = strndup(add, add_n);
    if (ins) el_insertstr(el, ins);
    free(ins);
    rc = CC_REFRESH;
  } else if (n == 1) {
    rc = CC_REFRESH; /* already complete */
  } else {
    /* the candidates in columns under the line, then the line again */
    size_t w = 0;
    for (int i = 1; i <= n; i++) {
      lua_rawgeti(L, names, i);
      if (lua_objlen(L, -1) > w) w = lua_objlen(L, -1);
      lua_pop(L, 1);
    }
    int cols = terminal_columns() / (int)(w + 2);
    if (cols < 1) cols = 1;
    int rows = (n + cols - 1) / cols;
    fputc('\n', stdout);
    for (int r = 0; r < rows; r++) {
      for (int c = 0; c < cols; c++) {
        int i = c * rows + r;
        if (i >= n) continue;
        lua_rawgeti(L, names, i + 1);
        fprintf(stdout, "%-*s", c + 1 < cols ? (int)(w + 2) : 0, lua_tostring(L, -1));
        lua_pop(L, 1);
      }
      fputc('\n', stdout);
    }
    fflush(stdout);
    rc = CC_REDISPLAY;
  }
done:
  lua_settop(L, top);
  return rc;
}

/* ---- the reader ---- */

static void reader_open(reader *rd, lua_State *L) {
  *rd = (reader){.L = L, .prompt = REPL_PROMPT};
  rd->tty = isatty(STDIN_FILENO);
  const char *noedit = getenv("FSDPRUN_NO_EDIT");
  const char *term = getenv("TERM");
  bool edit = rd->tty && !(noedit && noedit[0] && strcmp(noedit, "0") != 0) &&
              !(term && strcmp(term, "dumb") == 0);
  g_rd = rd;
  if (!edit) return;
  rd->el = el_init(PROGNAME, stdin, stdout, stderr);
  if (!rd->el) return;
  rd->hist = history_init();
  if (rd->hist) {
    history(rd->hist, &rd->ev, H_SETSIZE, REPL_HISTORY_SIZE);
    history(rd->hist, &rd->ev, H_SETUNIQUE, 1);
    const char *path = getenv("FSDPRUN_HISTORY");
    if (path == NULL) {
      const char *home = getenv("HOME");
      if (home && home[0]) {
        size_t n = strlen(home) + sizeof "/.fsdprun_history";
        rd->hist_path = malloc(n);
        if (rd->hist_path) snprintf(rd->hist_path, n, "%s/.fsdprun_history", home);
      }
    } else if (path[0] != '\0') {
      rd->hist_path = strdup(path);
    }
    if (rd->hist_path) history(rd->hist, &rd->ev, H_LOAD, rd->hist_path);
    el_set(rd->el, EL_HIST, history, rd->hist);
  }
  el_set(rd->el, EL_EDITOR, "emacs");
  el_set(rd->el, EL_PROMPT, prompt_cb);
  el_set(rd->el, EL_SIGNAL, 1); /* a signal at the prompt gives the terminal back first */
  el_set(rd->el, EL_SETTY, "-d", "-isig", NULL); /* ^C is a key while editing */
  el_wset(rd->el, EL_ADDFN, L"fsdp-cancel", L"drop the input typed so far", cancel_cb);
  el_set(rd->el, EL_BIND, "^C", "fsdp-cancel", NULL);
  /* the wide calls: the narrow el_set copies the names of EL_ADDFN and never frees them */
  el_wset(rd->el, EL_ADDFN, L"fsdp-complete", L"complete a global or a field", complete_cb);
  el_set(rd->el, EL_BIND, "^I", "fsdp-complete", NULL);
  el_source(rd->el, NULL); /* ~/.editrc */
}

static void reader_close(reader *rd) {
  if (rd->el) el_end(rd->el);
  if (rd->hist) history_end(rd->hist);
  free(rd->hist_path);
  free(rd->line);
  if (g_rd == rd) g_rd = NULL;
  *rd = (reader){0};
}

/* One line into rd->line (without its newline), after the prompt; NULL at end of input. */
static const char *reader_line(reader *rd, const char *prompt) {
  rd->prompt = prompt;
  rd->cancelled = false;
  size_t n;
  if (rd->el) {
    int count = 0;
    const char *s = el_gets(rd->el, &count);
    if (s == NULL || count <= 0) return NULL;
    n = (size_t)count;
    if (n + 1 > rd->cap) {
      char *p = realloc(rd->line, n + 1);
      if (!p) return NULL;
      rd->line = p;
      rd->cap = n + 1;
    }
    memcpy(rd->line, s, n);
    rd->line[n] = '\0';
  } else {
    if (rd->tty) {
      fputs(prompt, stdout);
      fflush(stdout);
    }
    ssize_t got = getline(&rd->line, &rd->cap, stdin);
    if (got < 0) return NULL;
    n = (size_t)got;
  }
  while (n > 0 && (rd->line[n - 1] == '\n' || rd->line[n - 1] == '\r')) rd->line[--n] = '\0';
  return rd->line;
}

static void reader_remember(reader *rd, const char *line) {
  if (!rd->hist || line[0] == '\0') return;
  history(rd->hist, &rd->ev, H_ENTER, line);
  if (rd->hist_path) history(rd->hist, &rd->ev, H_SAVE, rd->hist_path);
}

/* ---- the loop ------------------------------------------------------------------------------------ */

typedef struct repl {
  const fsdp_repl_host *h;
  lua_State *L;
  reader rd;       /* rank 0 */
  int target;      /* -1: every rank; else the one rank inputs run on (rank 0's choice) */
  double timeout;  /* the collective timeout while the REPL runs */
  bool poisoned;   /* rank 0 has said that comm is poisoned */
  bool leaving;    /* rank 0: a rank called os.exit, the next message is quit */
  char prompt[32];
  char preloaded[64]; /* rank 0, fsdprun -i: what the banner says of the preloaded globals */
  rbuf input, msg, mine;
  outcome oc;
  outcome *all;    /* rank 0, W > 1: every rank's outcome */
  rbuf *raw;       /* rank 0, W > 1: every rank's encoded outcome */
  int *group, *members;
} repl;

static void out_text(const repl *R, FILE *f, const char *s, size_t n) {
  if (n > 0) R->h->write(R->h->ctx, f, s, n);
}

static void out_str(const repl *R, FILE *f, const char *s) { out_text(R, f, s, strlen(s)); }

static const char help_text[] =
    "Each input runs on every rank (SPMD); rank 0 prints the results grouped by rank:\n"
    "  [0-3] 42              the same on ranks 0 to 3\n"
    "  [0] 1.5  [1] 2.5      different values\n"
    "An expression prints its values; a statement runs; an unfinished chunk continues on the\n"
    "next line (>>). Errors are shown per rank and the REPL goes on. Tab completes globals and\n"
    "fields (fsdp.me<TAB>, t:su<TAB>); up/down recall earlier lines (~/.fsdprun_history).\n"
    "After fsdprun -i, fsdp and nn are globals.\n"
    "\n"
    "  :rank K       run the next inputs on rank K only (collectives are refused there)\n"
    "  :all          run inputs on every rank again (the default)\n"
    "  :timeout [S]  show or set how long a collective waits for the other ranks\n"
    "  :help         this text\n"
    "  :quit         leave (also ^D); after fsdp.debug() the recipe goes on, after a\n"
    "                post-mortem (--debug-on-error) the run ends (exit status 1)\n"
    "\n"
    "A collective that only some ranks enter fails after the timeout and leaves the ranks'\n"
    "communicator poisoned: collectives then fail at once, everything else still works.\n";

static void set_prompt(repl *R) {
  if (R->target < 0) snprintf(R->prompt, sizeof R->prompt, "%s", REPL_PROMPT);
  else snprintf(R->prompt, sizeof R->prompt, "fsdp[%d]> ", R->target);
}

/* A timeout: any finite number of seconds > 0, as --timeout and FSDP_TIMEOUT take (a huge one
 * is no limit in practice: the communicators cap their waits at about 30 years). */
static bool parse_seconds(const char *s, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  while (*end == ' ' || *end == '\t') end++;
  if (end == s || *end != '\0' || errno != 0 || !(v > 0) || !isfinite(v)) return false;
  *out = v;
  return true;
}

/* A command line (":name arg"): handle it on rank 0. Returns true when a message for every
 * rank was put into R->msg (quit, timeout); false when it was handled here. */
static bool command(repl *R, const char *line) {
  const fsdp_repl_host *h = R->h;
  const char *p = line + 1;
  const char *e = p;
  while (*e && *e != ' ' && *e != '\t') e++;
  size_t n = (size_t)(e - p);
  while (*e == ' ' || *e == '\t') e++;
  const char *arg = e;
  char buf[256];
#define IS(word) (n == sizeof(word) - 1 && strncmp(p, word, n) == 0)
  if (IS("quit") || IS("q") || IS("exit")) {
    msg_make(&R->msg, MSG_QUIT, 0, "", 0);
    return true;
  }
  if (IS("help") || IS("h") || IS("?")) {
    out_str(R, stdout, help_text);
    return false;
  }
  if (IS("all")) {
    R->target = -1;
    set_prompt(R);
    snprintf(buf, sizeof buf, "(inputs run on every rank: 0-%d)\n", h->world - 1);
    out_str(R, stdout, buf);
    return false;
  }
  if (IS("rank")) {
    char *end;
    long k = strtol(arg, &end, 10);
    while (*end == ' ' || *end == '\t') end++;
    if (arg[0] == '\0' || *end != '\0' || k < 0 || k >= h->world) {
      snprintf(buf, sizeof buf, PROGNAME ": :rank needs a rank from 0 to %d (got '%s')\n",
               h->world - 1, arg);
      out_str(R, stderr, buf);
      return false;
    }
    R->target = (int)k;
    set_prompt(R);
    snprintf(buf, sizeof buf,
             "(inputs run on rank %ld only; collectives are refused there; :all returns)\n", k);
    out_str(R, stdout, buf);
    return false;
  }
  if (IS("timeout")) {
    if (arg[0] == '\0') {
      /* the communicator's own: an input may have changed it (fsdp.core.set_timeout) */
      double t = h->comm ? fsdp_comm_timeout(h->comm) : R->timeout;
      snprintf(buf, sizeof buf, "(a collective waits %g s for the other ranks)\n", t);
      out_str(R, stdout, buf);
      return false;
    }
    double s;
    if (!parse_seconds(arg, &s)) {
      snprintf(buf, sizeof buf,
               PROGNAME ": :timeout needs a positive number of seconds (got '%s')\n", arg);
      out_str(R, stderr, buf);
      return false;
    }
    msg_make(&R->msg, MSG_TIMEOUT, 0, arg, strlen(arg));
    return true;
  }
#undef IS
  snprintf(buf, sizeof buf, PROGNAME ": unknown command ':%.*s' (:help lists them)\n", (int)n, p);
  out_str(R, stderr, buf);
  return false;
}

static bool is_command(const char *line) {
  return line[0] == ':' && (isalpha((unsigned char)line[1]) || line[1] == '?');
}

static void read_input(repl *R);

/* Rank 0: read the next input (or command) into R->msg. */
static void read_next(repl *R) {
  if (R->leaving) {
    msg_make(&R->msg, MSG_QUIT, 0, "", 0);
    return;
  }
  R->h->reading(R->h->ctx, true);
  read_input(R);
  R->h->reading(R->h->ctx, false);
}

/* read_next's body: R->msg is set on return. */
static void read_input(repl *R) {
  reader *rd = &R->rd;
  for (;;) {
    const char *line = reader_line(rd, R->prompt);
    if (line == NULL) {
      if (rd->tty) out_str(R, stdout, "\n");
      msg_make(&R->msg, MSG_QUIT, 0, "", 0);
      return;
    }
    if (rd->cancelled) {
      out_str(R, stdout, "^C\n");
      continue;
    }
    const char *t = line;
    while (*t == ' ' || *t == '\t') t++;
    if (*t == '\0') continue;
    reader_remember(rd, line);
    if (is_command(t)) {
      size_t n = strlen(t);
      while (n > 0 && (t[n - 1] == ' ' || t[n - 1] == '\t')) n--;
      char cmd[512];
      snprintf(cmd, sizeof cmd, "%.*s", (int)n, t);
      if (command(R, cmd)) return;
      continue;
    }
    rb_clear(&R->input);
    rb_str(&R->input, line);
    while (input_incomplete(R->L, R->input.p, R->input.len)) {
      const char *more = reader_line(rd, REPL_PROMPT2);
      if (more == NULL) break; /* the ranks report the unfinished chunk */
      if (rd->cancelled) break;
      reader_remember(rd, more);
      rb_str(&R->input, "\n");
      rb_str(&R->input, more);
      if (R->input.len > REPL_MAX_INPUT) break;
    }
    if (rd->cancelled) {
      out_str(R, stdout, "^C\n");
      continue;
    }
    if (R->input.cut || R->input.len > REPL_MAX_INPUT) {
      out_str(R, stderr, PROGNAME ": input too long (16 MiB at most)\n");
      continue;
    }
    msg_make(&R->msg, MSG_EVAL, R->target, R->input.p, R->input.len);
    return;
  }
}

/* Rank 0, W > 1: print every rank's outcome, grouped. */
static void show(repl *R) {
  int W = R->h->world;
  for (int p = 0; p < W; p++) {
    outcome_decode(&R->all[p], &R->raw[p]);
    if (R->all[p].flags & OC_EXIT) R->leaving = true;
  }
  rbuf out = {0}, err = {0};
  format_results(&out, R->all, W, R->group, R->members);
  format_errors(&err, R->all, W, R->group, R->members);
  out_text(R, stdout, rb_text(&out), out.len);
  out_text(R, stderr, rb_text(&err), err.len);
  rb_free(&out);
  rb_free(&err);
  if (!R->poisoned && R->h->comm && fsdp_comm_poisoned(R->h->comm)) {
    R->poisoned = true;
    out_str(R, stderr,
            PROGNAME ": the ranks' communicator is now poisoned (a collective failed above): "
                     "collectives fail at once from here on; inputs without collectives still "
                     "run. :quit ends the session.\n");
  }
}

/* World of one: what the input printed went out already; report an error as a recipe's. */
static void show_single(repl *R) {
  if (!(R->oc.flags & OC_FAILED)) return;
  rbuf err = {0};
  rb_str(&err, PROGNAME ": ");
  rb_add(&err, rb_text(&R->oc.err), R->oc.err.len);
  rb_str(&err, "\n");
  out_text(R, stderr, err.p, err.len);
  rb_free(&err);
}

int fsdp_repl_env_timeout(double *out, char *err, size_t errn) {
  const char *env = getenv("FSDP_REPL_TIMEOUT");
  double t = 0;
  if (env != NULL && env[0] != '\0' && !parse_seconds(env, &t)) {
    snprintf(err, errn, "FSDP_REPL_TIMEOUT='%s' must be a positive number of seconds", env);
    return -1;
  }
  if (out != NULL) *out = t;
  return 0;
}

/* FSDP_REPL_TIMEOUT, else 10 s or the communicator's timeout if shorter. A malformed variable
 * (fsdprun refused it at start) counts as unset. */
static double repl_timeout_default(const fsdp_repl_host *h) {
  double t;
  char err[160];
  if (fsdp_repl_env_timeout(&t, err, sizeof err) == 0 && t > 0) return t;
  double def = REPL_DEFAULT_TIMEOUT;
  if (h->comm && fsdp_comm_timeout(h->comm) < def) def = fsdp_comm_timeout(h->comm);
  return def;
}

/* fsdprun -i (where == NULL): the globals fsdp and nn on every rank, through fsdp.repl.preload
 * under the host's pcall (^C and errors as an input's); a failure only leaves them out. */
static void preload(repl *R) {
  lua_State *L = R->L;
  int top = lua_gettop(L);
  if (push_repl_fn(L, "preload") && R->h->pcall(R->h->ctx, L, 0, 1) == 0 && lua_isstring(L, -1))
    snprintf(R->preloaded, sizeof R->preloaded, "%s", lua_tostring(L, -1));
  lua_settop(L, top);
}

static void banner(repl *R, const char *where, bool post_mortem) {
  const fsdp_repl_host *h = R->h;
  if (h->rank != 0 || !R->rd.tty) return;
  char buf[640];
  const char *backend = h->comm ? fsdp_comm_backend(h->comm) : "local";
  if (post_mortem)
    snprintf(buf, sizeof buf,
             "post-mortem: %d rank%s (%s), each stopped where it failed or was told of the "
             "failure (rank 0: %s). The locals of each rank's stack are globals there, `err` "
             "its error. :help for help; :quit or ^D ends the run (exit status 1).\n",
             h->world, h->world == 1 ? "" : "s", backend, where ? where : "?");
  else if (where)
    snprintf(buf, sizeof buf,
             "fsdp.debug() at %s: %d rank%s (%s). :help for help; :quit or ^D goes on with "
             "the recipe.\n",
             where, h->world, h->world == 1 ? "" : "s", backend);
  else
    snprintf(buf, sizeof buf,
             "fsdprun REPL: %d rank%s (%s); every input runs on every rank%s%s. :help for "
             "help, :quit or ^D to leave.\n",
             h->world, h->world == 1 ? "" : "s", backend, R->preloaded[0] ? "; " : "",
             R->preloaded);
  out_str(R, stdout, buf);
}

static void repl_free(repl *R) {
  if (R->h->rank == 0) reader_close(&R->rd);
  rb_free(&R->input);
  rb_free(&R->msg);
  rb_free(&R->mine);
  rb_free(&R->oc.out);
  rb_free(&R->oc.err);
  if (R->all) {
    for (int p = 0; p < R->h->world; p++) {
      rb_free(&R->all[p].out);
      rb_free(&R->all[p].err);
      rb_free(&R->raw[p]);
    }
  }
  free(R->all);
  free(R->raw);
  free(R->group);
  free(R->members);
}

/* Whether the REPL can start here; else -1 with the message in err. */
static int can_start(const fsdp_repl_host *h, char *err, size_t errn) {
  if (tl_depth > 0) {
    snprintf(err, errn, "the REPL is already running (fsdp.debug() inside a REPL input)");
    return -1;
  }
  if (h->world > 1 && !h->ctl) {
    snprintf(err, errn, "the REPL needs a channel between the ranks, which the %s backend did "
                        "not provide", h->comm ? fsdp_comm_backend(h->comm) : "?");
    return -1;
  }
  return 0;
}

static int session(const fsdp_repl_host *h, lua_State *L, const char *where, const char *note,
                   char *err, size_t errn);

int fsdp_repl_run(const fsdp_repl_host *h, lua_State *L, const char *where, char *err,
                  size_t errn) {
  if (can_start(h, err, errn) != 0) return -1;
  /* Every rank must be here: a rank that failed, left or is in another collective makes this
   * an error on every rank (and the communicator's rules apply), never a hang. */
  if (h->world > 1 && fsdp_comm_barrier(h->comm, "fsdp.repl") != FSDP_OK) {
    snprintf(err, errn, "%s", fsdp_error_msg());
    return -1;
  }
  return session(h, L, where, NULL, err, errn);
}

/* The post-mortem's entry: every rank meets on ctl (never on comm, which the failure poisoned),
 * then they revive comm together (fsdp_comm_revive: drain, agree on the sequence number, lift
 * the poison, meet again before anyone issues a collective). A backend that cannot revive
 * leaves comm poisoned: why goes into note. */
static int post_mortem_entry(const fsdp_repl_host *h, char *note, size_t noten, char *err,
                             size_t errn) {
  note[0] = '\0';
  bool multi = h->world > 1;
  if (multi) {
    fsdp_comm_set_timeout(h->ctl, repl_timeout_default(h));
    if (fsdp_comm_barrier(h->ctl, "fsdp.post_mortem") != FSDP_OK) {
      snprintf(err, errn, "the post-mortem REPL needs every rank: %s", fsdp_error_msg());
      return -1;
    }
  }
  if (h->comm == NULL || !fsdp_comm_poisoned(h->comm)) return 0;
  double seq = (double)fsdp_comm_drain(h->comm);
  if (multi && fsdp_comm_all_reduce(h->ctl, &seq, 1, FSDP_DTYPE_F64, FSDP_RED_MAX,
                                    "fsdp.post_mortem.seq") != FSDP_OK) {
    snprintf(err, errn, "the post-mortem REPL's channel failed: %s", fsdp_error_msg());
    return -1;
  }
  if (fsdp_comm_revive(h->comm, (uint64_t)seq) != FSDP_OK)
    snprintf(note, noten, PROGNAME ": the ranks' communicator stays poisoned (%s): collectives "
             "fail at once; inputs without collectives run.\n", fsdp_error_msg());
  if (multi && fsdp_comm_barrier(h->ctl, "fsdp.post_mortem.revived") != FSDP_OK) {
    snprintf(err, errn, "the post-mortem REPL's channel failed: %s", fsdp_error_msg());
    return -1;
  }
  return 0;
}

int fsdp_repl_post_mortem(const fsdp_repl_host *h, lua_State *L, const char *where, char *err,
                          size_t errn) {
  char note[FSDP_ERROR_CAP + 160];
  if (can_start(h, err, errn) != 0 || post_mortem_entry(h, note, sizeof note, err, errn) != 0)
    return -1;
  return session(h, L, where, note, err, errn);
}

/* The REPL once every rank is in: until :quit, end of input or a failed channel. note: NULL
 * (fsdp_repl_run), else a post-mortem's ("" or why comm stays poisoned). */
static int session(const fsdp_repl_host *h, lua_State *L, const char *where, const char *note,
                   char *err, size_t errn) {
  bool multi = h->world > 1;
  repl R = {.h = h, .L = L, .target = -1};
  set_prompt(&R);
  int status = 0;
  if (multi) {
    size_t W = (size_t)h->world;
    if (h->rank == 0) {
      R.all = calloc(W, sizeof *R.all);
      R.raw = calloc(W, sizeof *R.raw);
      R.group = calloc(W, sizeof *R.group);
      R.members = calloc(W, sizeof *R.members);
      if (!R.all || !R.raw || !R.group || !R.members) {
        fsdp_comm_abort(h->ctl, "rank 0 is out of memory for the REPL");
        snprintf(err, errn, "out of memory for the REPL");
        repl_free(&R);
        return -1;
      }
    }
    fsdp_comm_set_timeout(h->ctl, REPL_CTL_TIMEOUT);
  }
  double saved_timeout = h->comm ? fsdp_comm_timeout(h->comm) : 0;
  R.timeout = repl_timeout_default(h);
  if (h->comm) fsdp_comm_set_timeout(h->comm, R.timeout);
  tl_depth++;
  h->pause(h->ctx, true);
  if (where == NULL) preload(&R);
  if (h->rank == 0) reader_open(&R.rd, L);
  banner(&R, where, note != NULL);
  if (note != NULL && note[0] != '\0' && h->rank == 0) {
    out_str(&R, stderr, note);
    R.poisoned = true;
  }
  for (;;) {
    if (h->rank == 0) read_next(&R);
    if (multi && ctl_bcast(h, &R.msg) != FSDP_OK) {
      snprintf(err, errn, "the REPL's channel failed: %s", fsdp_error_msg());
      status = -1;
      break;
    }
    if (R.msg.len < 5) break;
    char kind = R.msg.p[0];
    int32_t arg = (int32_t)get_u32(R.msg.p + 1);
    const char *text = R.msg.p + 5;
    size_t tn = R.msg.len - 5;
    if (kind == MSG_QUIT) break;
    if (kind == MSG_TIMEOUT) {
      double s;
      if (parse_seconds(text, &s)) {
        R.timeout = s;
        if (h->comm) fsdp_comm_set_timeout(h->comm, s);
        if (h->rank == 0) {
          char buf[96];
          snprintf(buf, sizeof buf, "(a collective now waits %g s for the other ranks)\n", s);
          out_str(&R, stdout, buf);
        }
      }
      continue;
    }
    if (kind != MSG_EVAL) continue;
    bool mine = arg < 0 || arg == h->rank;
    bool alone = arg >= 0 && multi;
    rb_clear(&R.oc.out);
    rb_clear(&R.oc.err);
    R.oc.flags = 0;
    if (mine) {
      if (alone && h->comm) {
        char why[160];
        snprintf(why, sizeof why,
                 "collectives are refused in ':rank %d' mode (only rank %d runs this input; "
                 ":all runs inputs on every rank)", (int)arg, (int)arg);
        fsdp_comm_set_refuse(h->comm, why);
      }
      eval_input(h, L, text, tn, multi, &R.oc); /* paused: the host's pcall marks it running */
      if (alone && h->comm) fsdp_comm_set_refuse(h->comm, NULL);
    }
    if (!multi) {
      show_single(&R);
      if (R.oc.flags & OC_EXIT) break;
      continue;
    }
    outcome_encode(&R.mine, &R.oc);
    if (ctl_gather(h, &R.mine, h->rank == 0 ? R.raw : NULL) != FSDP_OK) {
      snprintf(err, errn, "the REPL's channel failed: %s", fsdp_error_msg());
      status = -1;
      break;
    }
    if (h->rank == 0) show(&R);
  }
  if (h->rank == 0) reader_close(&R.rd);
  h->pause(h->ctx, false);
  tl_depth--;
  if (h->comm) fsdp_comm_set_timeout(h->comm, saved_timeout);
  repl_free(&R);
  return status;
}
