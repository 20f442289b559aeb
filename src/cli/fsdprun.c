/*
 * fsdprun.c — the `fsdprun` launcher: runs a Lua recipe (and -e chunks, and an interactive loop)
 * on the statically linked engine. Owner: cli.
 *
 *   fsdprun [-n N] [-e CODE]... [-i] [--] recipe.lua [args...]
 *
 * Shaped like lua.c / luajit.c: the whole run happens inside one lua_cpcall; every chunk runs
 * under lua_pcall with a traceback message handler, so an error prints
 * "fsdprun: <message>\n<traceback>" and the process exits 1. Usage errors exit 2, an interrupt
 * (SIGINT) exits 130.
 *
 * Library discovery never depends on the user's environment: package.path gets the first
 * existing of <exe dir>/../share/fsdprun/lua (installed tree) and FSDP_SOURCE_LUA_DIR (build
 * tree) prepended, and package.preload["fsdp.core"] is the engine linked into this executable
 * (a core.so found on LUA_CPATH is never loaded here: two engines in one process would not
 * share tensors).
 *
 * SIGINT: like lua.c, the handler sets a Lua hook that raises "interrupted" at the next Lua
 * instruction. LuaJIT does not run hooks inside compiled traces (`while true do end` never
 * leaves its trace), so the handler also arms a grace timer: if the Lua code has not stopped
 * within FSDPRUN_INTERRUPT_GRACE_S seconds, the process prints "fsdprun: interrupted" and exits
 * 130 on its own. A second SIGINT kills at once (the handler resets itself to SIG_DFL).
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <time.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <lauxlib.h>
#include <lua.h>
#include <luajit.h>
#include <lualib.h>

#include "fsdp.h"

#ifndef FSDP_SOURCE_LUA_DIR
#define FSDP_SOURCE_LUA_DIR ""
#endif

#define PROGNAME "fsdprun"
#define EXIT_USAGE 2
#define EXIT_INTERRUPTED 130
#define FSDPRUN_INTERRUPT_GRACE_S 2
#define REPL_PROMPT "fsdp> "
#define REPL_PROMPT2 ">> "

/* What the command line asked for; argv indices refer to main's argv. */
typedef struct fsdprun_opts {
  int argc;
  char **argv;
  int nranks;        /* -n; 1 when absent */
  bool interactive;  /* -i */
  int nexec;         /* number of -e chunks */
  const char **exec; /* (nexec) their code, in command-line order */
  int script;        /* argv index of the recipe; 0 when none */
  int status;        /* process exit status, set by fsdprun_main */
  char *line;        /* REPL line buffer (getline), freed by main */
  size_t line_cap;
} fsdprun_opts;

/* ---- signals --------------------------------------------------------------------------- */

static lua_State *volatile g_running_L; /* the state whose chunk a SIGINT should stop */
static volatile sig_atomic_t g_interrupted;

static void interrupt_hook(lua_State *L, lua_Debug *ar) {
  (void)ar;
  lua_sethook(L, NULL, 0, 0);
  luaL_error(L, "interrupted");
}

static void on_sigalrm(int sig) {
  (void)sig;
  static const char msg[] = PROGNAME ": interrupted (the running code did not stop in time)\n";
  ssize_t w = write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)w;
  _exit(EXIT_INTERRUPTED);
}

static double monotonic_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts); /* async-signal-safe */
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void on_sigint(int sig) {
  (void)sig;
  static volatile double first_at;
  double now = monotonic_s();
  if (g_interrupted) {
    /* A second ^C kills at once. One ^C can arrive twice (coreutils timeout signals the child
     * and then its process group), so a repeat within half a second is the same ^C. */
    if (now - first_at < 0.5) return;
    on_sigalrm(SIGALRM);
  }
  g_interrupted = 1;
  first_at = now;
  if (g_running_L != NULL) {
    /* lua_sethook is safe to call from a signal handler (lua.c and luajit.c rely on it). */
    lua_sethook(g_running_L, interrupt_hook, LUA_MASKCALL | LUA_MASKRET | LUA_MASKCOUNT, 1);
    signal(SIGALRM, on_sigalrm);
    alarm(FSDPRUN_INTERRUPT_GRACE_S);
  } else {
    _exit(EXIT_INTERRUPTED);
  }
}

/* ---- running chunks -------------------------------------------------------------------- */

/* Message handler: the error message (or a description of a non-string error object) followed
 * by the stack traceback. */
static int traceback_handler(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      msg = lua_tostring(L, -1);
    else
      msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* Call the function below narg arguments on the stack under the traceback handler, with SIGINT
 * turned into a Lua error while it runs. Returns the lua_pcall status. */
static int docall(lua_State *L, int narg, int nres) {
  int base = lua_gettop(L) - narg;
  lua_pushcfunction(L, traceback_handler);
  lua_insert(L, base);
  g_interrupted = 0; /* each run may be interrupted once before a second ^C kills */
  g_running_L = L;
  signal(SIGINT, on_sigint);
  int status = lua_pcall(L, narg, nres, base);
  signal(SIGINT, SIG_DFL);
  alarm(0);
  g_running_L = NULL;
  lua_remove(L, base);
  return status;
}

/* Print the error message on top of the stack (if status is an error) and pop it. */
static int report(lua_State *L, int status) {
  if (status != 0) {
    const char *msg = lua_tostring(L, -1);
    if (msg == NULL) msg = "(error object is not a string)";
    fflush(stdout); /* keep stdout and stderr in order when both go to one pipe */
    fprintf(stderr, PROGNAME ": %s\n", msg);
    fflush(stderr);
    lua_pop(L, 1);
  }
  return status;
}

static int dostring(lua_State *L, const char *code, const char *chunkname) {
  int status = luaL_loadbuffer(L, code, strlen(code), chunkname);
  if (status == 0) status = docall(L, 0, 0);
  return report(L, status);
}

/* Load and run the recipe at argv[o->script] with argv[script+1..] as its varargs. */
static int dorecipe(lua_State *L, const fsdprun_opts *o) {
  const char *fname = o->argv[o->script];
  if (strcmp(fname, "-") == 0) fname = NULL; /* stdin */
  int status = luaL_loadfile(L, fname);
  if (status == 0) {
    int narg = o->argc - o->script - 1;
    luaL_checkstack(L, narg + 3, "too many arguments to the recipe");
    for (int i = o->script + 1; i < o->argc; i++) lua_pushstring(L, o->argv[i]);
    status = docall(L, narg, 0);
  }
  return report(L, status);
}

/* ---- the interactive loop (grows into the SPMD REPL with libedit later) ------------------ */

/* Read one line into o->line without its newline, showing `prompt` when stdin is a terminal.
 * Returns false at end of input. */
static bool repl_readline(fsdprun_opts *o, const char *prompt, bool tty) {
  if (tty) {
    fputs(prompt, stdout);
    fflush(stdout);
  }
  ssize_t n = getline(&o->line, &o->line_cap, stdin);
  if (n < 0) return false;
  while (n > 0 && (o->line[n - 1] == '\n' || o->line[n - 1] == '\r')) o->line[--n] = '\0';
  return true;
}

/* A syntax error that only says the chunk ended too early: read more lines. */
static bool repl_incomplete(lua_State *L, int status) {
  if (status != LUA_ERRSYNTAX) return false;
  size_t len;
  const char *msg = lua_tolstring(L, -1, &len);
  static const char eof[] = "'<eof>'";
  size_t k = sizeof eof - 1;
  return msg != NULL && len >= k && strcmp(msg + len - k, eof) == 0;
}

static bool repl_is_quit(const char *line) {
  while (*line == ' ' || *line == '\t') line++;
  size_t n = strlen(line);
  while (n > 0 && (line[n - 1] == ' ' || line[n - 1] == '\t')) n--;
  return n == 5 && strncmp(line, ":quit", 5) == 0;
}

/* Read and compile one input (a line, or several for an unfinished statement). Returns 0 with
 * the function pushed, an error status with the message pushed, or -1 at EOF / :quit. */
static int repl_load(lua_State *L, fsdprun_opts *o, bool tty) {
  if (!repl_readline(o, REPL_PROMPT, tty)) return -1;
  if (repl_is_quit(o->line)) return -1;
  const char *line = o->line;
  if (line[0] == '=') line++; /* Lua 5.1's "=expr" */
  /* First as an expression, so `1 + 1` prints 2. The values pass through an identity function
   * instead of `return <line>` so that a call in the line is not a tail call: `error("x")`
   * then reports "stdin:1: x" rather than losing its position. The newline keeps a trailing
   * comment from swallowing the closing parenthesis. */
  lua_pushfstring(L, "return (function(...) return ... end)(%s\n)", line);
  size_t len;
  const char *code = lua_tolstring(L, -1, &len);
  int status = luaL_loadbuffer(L, code, len, "=stdin");
  lua_remove(L, -2);
  if (status == 0) return 0;
  lua_pop(L, 1);
  /* Then as statements, reading continuation lines while the chunk is unfinished. */
  lua_pushstring(L, o->line);
  for (;;) {
    code = lua_tolstring(L, -1, &len);
    status = luaL_loadbuffer(L, code, len, "=stdin");
    if (!repl_incomplete(L, status)) break;
    lua_pop(L, 1);
    if (!repl_readline(o, REPL_PROMPT2, tty)) {
      /* End of input inside a statement: report the syntax error as it stands. */
      status = luaL_loadbuffer(L, code, len, "=stdin");
      break;
    }
    lua_pushliteral(L, "\n");
    lua_pushstring(L, o->line);
    lua_concat(L, 3);
  }
  lua_remove(L, -2); /* the source text */
  return status;
}

/* Print the values above `base` with the global print (tostring, tab-separated). */
static void repl_print(lua_State *L, int base) {
  int n = lua_gettop(L) - base;
  if (n <= 0) return;
  lua_getglobal(L, "print");
  lua_insert(L, base + 1);
  if (lua_pcall(L, n, 0, 0) != 0) {
    fflush(stdout);
    fprintf(stderr, PROGNAME ": error calling 'print' (%s)\n", lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  fflush(stdout);
}

static void repl_run(lua_State *L, fsdprun_opts *o) {
  bool tty = isatty(STDIN_FILENO);
  int base = lua_gettop(L);
  for (;;) {
    int status = repl_load(L, o, tty);
    if (status == -1) break;
    if (status == 0) status = docall(L, 0, LUA_MULTRET);
    if (status == 0)
      repl_print(L, base);
    else
      report(L, status);
    lua_settop(L, base);
  }
  if (tty) fputc('\n', stdout);
  fflush(stdout);
}

/* ---- set-up ---------------------------------------------------------------------------- */

static bool is_dir(const char *path) {
  struct stat st;
  return path[0] != '\0' && stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The Lua library folder: installed tree first, then the source tree this binary was built
 * from. Returns false when neither exists. */
static bool find_lua_dir(char *out, size_t n) {
  char exe[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len > 0) {
    exe[len] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash != NULL) {
      *slash = '\0';
      char cand[PATH_MAX + 32];
      snprintf(cand, sizeof cand, "%s/../share/fsdprun/lua", exe);
      char real[PATH_MAX];
      if (is_dir(cand) && realpath(cand, real) != NULL) {
        snprintf(out, n, "%s", real);
        return true;
      }
    }
  }
  if (is_dir(FSDP_SOURCE_LUA_DIR)) {
    snprintf(out, n, "%s", FSDP_SOURCE_LUA_DIR);
    return true;
  }
  return false;
}

static void setup_package(lua_State *L) {
  lua_getglobal(L, "package");
  char dir[PATH_MAX];
  if (find_lua_dir(dir, sizeof dir)) {
    lua_getfield(L, -1, "path");
    const char *old = lua_tostring(L, -1);
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, old != NULL ? old : "");
    lua_setfield(L, -3, "path");
    lua_pop(L, 1);
  }
  lua_getfield(L, -1, "preload");
  lua_pushcfunction(L, luaopen_fsdp_core);
  lua_setfield(L, -2, "fsdp.core");
  lua_pop(L, 2);
}

/* The global `arg`, as luajit sets it: arg[0] is the recipe, arg[1..] its arguments, and the
 * interpreter and its options at negative indices. Without a recipe, arg[0] is the program. */
static void setup_arg(lua_State *L, const fsdprun_opts *o) {
  int zero = o->script > 0 ? o->script : 0;
  lua_createtable(L, o->argc - zero, zero + 1);
  for (int i = 0; i < o->argc; i++) {
    lua_pushstring(L, o->argv[i]);
    lua_rawseti(L, -2, i - zero);
  }
  lua_setglobal(L, "arg");
}

static int fsdprun_main(lua_State *L) {
  fsdprun_opts *o = (fsdprun_opts *)lua_touserdata(L, 1);
  lua_settop(L, 0);
  lua_gc(L, LUA_GCSTOP, 0);
  luaL_openlibs(L);
  lua_gc(L, LUA_GCRESTART, -1);
  setup_package(L);
  setup_arg(L, o);
  for (int i = 0; i < o->nexec; i++) {
    if (dostring(L, o->exec[i], "=(command line)") != 0) {
      o->status = g_interrupted ? EXIT_INTERRUPTED : EXIT_FAILURE;
      return 0;
    }
  }
  if (o->script > 0 && dorecipe(L, o) != 0) {
    o->status = g_interrupted ? EXIT_INTERRUPTED : EXIT_FAILURE;
    return 0;
  }
  if (o->interactive) repl_run(L, o);
  o->status = EXIT_SUCCESS;
  return 0;
}

/* ---- command line ---------------------------------------------------------------------- */

static void print_usage(FILE *f) {
  fprintf(f,
          "usage: " PROGNAME " [options] [--] recipe.lua [args...]\n"
          "Run a Lua training recipe on the fsdprun engine.\n"
          "\n"
          "options:\n"
          "  -n N        number of ranks (default 1)\n"
          "  -e CODE     run the Lua CODE before the recipe (may be repeated)\n"
          "  -i          enter the interactive loop after the recipe (or alone)\n"
          "  --          stop reading options\n"
          "  -h, --help  show this help and exit\n"
          "  -v, --version\n"
          "              print the version and exit\n"
          "\n"
          "A recipe named '-' is read from standard input. Recipe arguments are in the global\n"
          "`arg` (arg[0] is the recipe) and, parsed (--key=value, --flag), in fsdp.args.\n"
          "Exit status: 0 success, 1 Lua error, 2 usage error, 130 interrupted.\n");
}

static int usage_error(const char *fmt, const char *a, const char *b) {
  fprintf(stderr, PROGNAME ": ");
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, " (try '" PROGNAME " --help')\n");
  return EXIT_USAGE;
}

static bool parse_positive_int(const char *s, int *out) {
  if (s[0] < '0' || s[0] > '9') return false;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v <= 0 || v > INT_MAX) return false;
  *out = (int)v;
  return true;
}

/* Returns -1 to go on running, or an exit status (0 after --help/--version). */
static int parse_args(fsdprun_opts *o) {
  int argc = o->argc;
  char **argv = o->argv;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      o->script = i;
      break;
    }
    if (strcmp(a, "--") == 0) {
      if (i + 1 < argc) o->script = i + 1;
      break;
    }
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      print_usage(stdout);
      return EXIT_SUCCESS;
    }
    if (strcmp(a, "--version") == 0 || strcmp(a, "-v") == 0) {
      printf(PROGNAME " %s (" LUAJIT_VERSION ")\n", fsdp_version());
      return EXIT_SUCCESS;
    }
    if (strcmp(a, "-i") == 0) {
      o->interactive = true;
      continue;
    }
    if (a[1] == 'n' || a[1] == 'e') {
      const char *val = a[2] != '\0' ? a + 2 : (i + 1 < argc ? argv[++i] : NULL);
      if (a[1] == 'n') {
        if (val == NULL) return usage_error("-n needs a number of ranks%s%s", "", "");
        if (!parse_positive_int(val, &o->nranks))
          return usage_error("-n '%s': the number of ranks must be a positive integer%s", val,
                             "");
      } else {
        if (val == NULL) return usage_error("-e needs Lua code as its argument%s%s", "", "");
        o->exec[o->nexec++] = val;
      }
      continue;
    }
    return usage_error("unknown option '%s'%s", a, "");
  }
  if (o->nranks > 1) {
    fprintf(stderr,
            PROGNAME ": -n %d: multi-rank runs need the local communicator, which is not built "
                     "yet\n",
            o->nranks);
    return EXIT_USAGE;
  }
  if (o->script == 0 && o->nexec == 0 && !o->interactive)
    return usage_error("no recipe given%s%s", "", "");
  return -1;
}

int main(int argc, char **argv) {
  fsdprun_opts o = {.argc = argc, .argv = argv, .nranks = 1};
  o.exec = calloc((size_t)argc + 1, sizeof *o.exec);
  if (o.exec == NULL) {
    fprintf(stderr, PROGNAME ": out of memory\n");
    return EXIT_FAILURE;
  }
  int rc = parse_args(&o);
  if (rc >= 0) {
    free(o.exec);
    return rc;
  }
  lua_State *L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, PROGNAME ": cannot create the Lua state: not enough memory\n");
    free(o.exec);
    return EXIT_FAILURE;
  }
  o.status = EXIT_FAILURE;
  int status = lua_cpcall(L, fsdprun_main, &o);
  report(L, status); /* only errors outside docall (e.g. out of memory in set-up) */
  lua_close(L);
  fflush(stdout);
  free(o.line);
  free(o.exec);
  return status != 0 ? EXIT_FAILURE : o.status;
}
