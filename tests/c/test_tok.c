/*
 * test_tok.c — the tokenizer shim (src/tok/tok.h: SentencePiece behind a C API) and the
 * memory-mapped token files (src/io/tokens.h): training on a fortunes file, loading, exact
 * round trips of valid UTF-8 (newlines, characters never seen in training), what invalid UTF-8
 * becomes, every error path with the thing it names; token files of both widths, windows and
 * their targets, and refusals (wrong size, bad width, starts out of range, ids past the
 * vocabulary).
 *
 * Skips (77) when the build has no SentencePiece or Debian's fortunes is not installed. Each
 * test works in a fresh folder under $TMPDIR (or /tmp) and removes it.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "core/core.h"
#include "io/tokens.h"
#include "tok/tok.h"

#define CORPUS "/usr/share/games/fortunes/debian"

static char g_dir[256];
static char g_model[320];

static void path_in(char *out, size_t n, const char *name) {
  snprintf(out, n, "%s/%s", g_dir, name);
}

static void assert_error_has(const char *needle) {
  const char *m = fsdp_error_msg();
  if (strstr(m, needle) == NULL) fail_msg("error \"%s\" lacks \"%s\"", m, needle);
}

static fsdp_tok *load_model(void) {
  fsdp_tok *t = NULL;
  if (fsdp_tok_load(&t, g_model)) fail_msg("%s", fsdp_error_msg());
  return t;
}

/* ---- tokenizer ------------------------------------------------------------------------------ */

static void test_train_and_load(void **state) {
  (void)state;
  fsdp_tok *t = load_model();
  assert_int_equal(fsdp_tok_vocab_size(t), 600);
  assert_string_equal(fsdp_tok_piece(t, 0), "<unk>");
  assert_int_equal(fsdp_tok_special_id(t, "unk"), 0);
  assert_int_equal(fsdp_tok_special_id(t, "bos"), 1);
  assert_int_equal(fsdp_tok_special_id(t, "eos"), 2);
  assert_int_equal(fsdp_tok_special_id(t, "nope"), -1);
  assert_string_equal(fsdp_tok_piece(t, 3), "<0x00>"); /* byte pieces follow the specials */
  assert_string_equal(fsdp_tok_piece(t, 3 + 255), "<0xFF>");
  assert_null(fsdp_tok_piece(t, 600));
  assert_null(fsdp_tok_piece(t, -1));
  fsdp_tok_free(t);
  fsdp_tok_free(NULL);
}

static void round_trip(fsdp_tok *t, const char *s, size_t len, const char *want, size_t want_len) {
  int32_t *ids;
  size_t n;
  assert_int_equal(fsdp_tok_encode(t, s, len, &ids, &n), FSDP_OK);
  for (size_t i = 0; i < n; i++) {
    assert_true(ids[i] >= 0);
    assert_true(ids[i] < fsdp_tok_vocab_size(t));
  }
  char *text;
  size_t tl;
  assert_int_equal(fsdp_tok_decode(t, ids, n, &text, &tl), FSDP_OK);
  assert_int_equal(tl, want_len);
  assert_memory_equal(text, want, want_len);
  assert_int_equal(text[tl], '\0');
  free(ids);
  free(text);
}

static void test_round_trip(void **state) {
  (void)state;
  fsdp_tok *t = load_model();
  static const char *const texts[] = {
      "Debian GNU/Linux is a free operating system.",
      "  leading and  double  spaces, trailing \n",
      "line one\nline two\r\n\ttabbed\n\n",
      "\xc3\xa9t\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80", /* été 日本語 😀 */
      "\x01\x02\x7f control bytes",
      "",
  };
  for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
    round_trip(t, texts[i], strlen(texts[i]), texts[i], strlen(texts[i]));
  /* an embedded NUL is a byte like any other */
  round_trip(t, "a\0b", 3, "a\0b", 3);
  /* text that uses no merge is bytes: more ids than a common word */
  int32_t *ids;
  size_t n_common, n_rare;
  assert_int_equal(fsdp_tok_encode(t, "the the the", 11, &ids, &n_common), FSDP_OK);
  free(ids);
  assert_int_equal(fsdp_tok_encode(t, "\xe6\x97\xa5\xe6\x9c\xac", 6, &ids, &n_rare), FSDP_OK);
  assert_int_equal(n_rare, 6); /* two unseen characters: six byte pieces */
  assert_int_equal(ids[0], 3 + 0xe6);
  free(ids);
  assert_true(n_common < 11);
  fsdp_tok_free(t);
}

static void test_invalid_utf8(void **state) {
  (void)state;
  fsdp_tok *t = load_model();
  /* each malformed byte is read as U+FFFD (EF BF BD), documented in tok.h */
  round_trip(t, "a\xff" "b", 3, "a\xef\xbf\xbd" "b", 5);
  round_trip(t, "\xc3", 1, "\xef\xbf\xbd", 3);
  fsdp_tok_free(t);
}

/* SentencePiece writes a space as U+2581 ("\xe2\x96\x81") and turns that symbol back into a
 * space when decoding: a U+2581 of the text itself must come back as U+2581, not a space. */
static void test_space_symbol(void **state) {
  (void)state;
  fsdp_tok *t = load_model();
  static const char *const texts[] = {
      "\xe2\x96\x81", "a\xe2\x96\x81" "b", "\xe2\x96\x81the the\xe2\x96\x81\xe2\x96\x81 x ",
      " \xe2\x96\x81 ",
  };
  for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
    round_trip(t, texts[i], strlen(texts[i]), texts[i], strlen(texts[i]));
  /* text without the symbol is encoded as SentencePiece encodes it: "the" after a space is one
   * piece with the space */
  int32_t *ids;
  size_t n;
  assert_int_equal(fsdp_tok_encode(t, "the the", 7, &ids, &n), FSDP_OK);
  assert_true(n <= 3);
  free(ids);
  fsdp_tok_free(t);
}

/* A corpus without spaces gives a model without a space piece: a space of the text is a byte
 * piece, and decodes as a space (not as SentencePiece's U+2581). */
static void test_no_space_piece(void **state) {
  (void)state;
  char corpus[320], out[320];
  path_in(corpus, sizeof corpus, "nospace.txt");
  path_in(out, sizeof out, "nospace.model");
  FILE *f = fopen(corpus, "wb");
  assert_non_null(f);
  fputs("abcabc\nbcabca\ncab\n", f);
  fclose(f);
  const char *inputs[] = {corpus};
  fsdp_tok_train_opts o = {.inputs = inputs, .ninputs = 1, .vocab_size = 263, .model = out};
  if (fsdp_tok_train(&o)) fail_msg("%s", fsdp_error_msg());
  fsdp_tok *t;
  assert_int_equal(fsdp_tok_load(&t, out), FSDP_OK);
  static const char *const texts[] = {
      " ", "abc abc", "  abc\n cab  ", "\xe2\x96\x81 \xe2\x96\x81", "a b\xe2\x96\x81" "c",
  };
  for (size_t i = 0; i < sizeof texts / sizeof *texts; i++)
    round_trip(t, texts[i], strlen(texts[i]), texts[i], strlen(texts[i]));
  int32_t *ids;
  size_t n;
  assert_int_equal(fsdp_tok_encode(t, " ", 1, &ids, &n), FSDP_OK);
  assert_int_equal(n, 1);
  assert_int_equal(ids[0], 3 + ' '); /* the byte piece <0x20> */
  free(ids);
  fsdp_tok_free(t);
}

static void test_decode_errors(void **state) {
  (void)state;
  fsdp_tok *t = load_model();
  int32_t ids[] = {5, 600};
  char *text = (char *)1;
  size_t len = 7;
  assert_int_equal(fsdp_tok_decode(t, ids, 2, &text, &len), FSDP_ERR);
  assert_error_has("id 600 at position 1 is out of range [0, 600)");
  assert_null(text);
  assert_int_equal(len, 0);
  ids[1] = -3;
  assert_int_equal(fsdp_tok_decode(t, ids, 2, &text, &len), FSDP_ERR);
  assert_error_has("id -3 at position 1");
  /* special pieces decode to nothing */
  int32_t sp[] = {1, 2};
  assert_int_equal(fsdp_tok_decode(t, sp, 2, &text, &len), FSDP_OK);
  assert_int_equal(len, 0);
  free(text);
  fsdp_tok_free(t);
}

static void test_train_errors(void **state) {
  (void)state;
  char out[320];
  path_in(out, sizeof out, "bad.model");
  const char *inputs[] = {CORPUS};
  fsdp_tok_train_opts o = {.inputs = inputs, .ninputs = 1, .vocab_size = 100000, .model = out};
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("Vocabulary size too high (100000)");
  assert_int_equal(access(out, F_OK), -1); /* nothing written */

  o.vocab_size = 100;
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("vocab_size 100 is too small");

  o.vocab_size = 600;
  o.model_type = "wordpiece";
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("model_type must be \"bpe\" or \"unigram\", got \"wordpiece\"");
  o.model_type = NULL;

  const char *missing[] = {CORPUS, "/nonexistent/corpus.txt"};
  o.inputs = missing;
  o.ninputs = 2;
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("cannot open /nonexistent/corpus.txt");
  o.ninputs = 0;
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("no input files");

  o.inputs = inputs;
  o.ninputs = 1;
  o.model = "/nonexistent-dir/x.model";
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("/nonexistent-dir/");
  o.model = out;
  o.character_coverage = 1.5;
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("character_coverage 1.5 is above 1");
  o.character_coverage = 0;

  /* every line with text longer than SentencePiece's sentence limit: it trains on none of
   * them, and the refusal says so (SentencePiece's own message is empty) */
  char longf[320];
  path_in(longf, sizeof longf, "long.txt");
  FILE *f = fopen(longf, "wb");
  assert_non_null(f);
  for (int i = 0; i < 70000; i++) fputc("ab c"[i % 4], f);
  fputs("\n\n", f);
  fclose(f);
  const char *long_inputs[] = {longf};
  o.inputs = long_inputs;
  o.ninputs = 1;
  o.vocab_size = 300;
  assert_int_equal(fsdp_tok_train(&o), FSDP_ERR);
  assert_error_has("the input has no line to train on: 1 line is longer than 65536 bytes "
                   "(SentencePiece leaves those out)");
}

static void test_unigram(void **state) {
  (void)state;
  char out[320];
  path_in(out, sizeof out, "uni.model");
  const char *inputs[] = {CORPUS};
  fsdp_tok_train_opts o = {.inputs = inputs, .ninputs = 1, .vocab_size = 700, .model = out,
                           .model_type = "unigram", .threads = 2};
  if (fsdp_tok_train(&o)) fail_msg("%s", fsdp_error_msg());
  fsdp_tok *t;
  assert_int_equal(fsdp_tok_load(&t, out), FSDP_OK);
  assert_int_equal(fsdp_tok_vocab_size(t), 700);
  const char *s = "Debian is\nunigram \xc3\xa9t\xc3\xa9";
  round_trip(t, s, strlen(s), s, strlen(s));
  fsdp_tok_free(t);
}

static void test_load_errors(void **state) {
  (void)state;
  fsdp_tok *t = (fsdp_tok *)1;
  assert_int_equal(fsdp_tok_load(&t, "/nonexistent/tok.model"), FSDP_ERR);
  assert_null(t);
  assert_error_has("cannot open /nonexistent/tok.model");
  /* a text file is not a model */
  assert_int_equal(fsdp_tok_load(&t, CORPUS), FSDP_ERR);
  assert_error_has(CORPUS " is not a SentencePiece model");
  /* nor is a model cut short */
  FILE *f = fopen(g_model, "rb");
  assert_non_null(f);
  char buf[4096];
  size_t got = fread(buf, 1, sizeof buf, f);
  fclose(f);
  char cut[320];
  path_in(cut, sizeof cut, "cut.model");
  f = fopen(cut, "wb");
  assert_non_null(f);
  fwrite(buf, 1, got / 2, f);
  fclose(f);
  assert_int_equal(fsdp_tok_load(&t, cut), FSDP_ERR);
  assert_error_has("cut.model is not a SentencePiece model");
}

/* ---- token files ---------------------------------------------------------------------------- */

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

static void test_tokens_u16(void **state) {
  (void)state;
  char p[320];
  path_in(p, sizeof p, "t16.bin");
  uint16_t ids[100];
  for (int i = 0; i < 100; i++) ids[i] = (uint16_t)(i * 600); /* up to 59400: high byte used */
  write_bytes(p, ids, sizeof ids);
  fsdp_io_tokens *t;
  assert_int_equal(fsdp_io_tokens_open(&t, p, 2, 100, 65536), FSDP_OK);
  assert_int_equal(fsdp_io_tokens_count(t), 100);
  assert_string_equal(fsdp_io_tokens_path(t), p);
  int64_t starts[3] = {0, 42, 95}, x[3 * 4], y[3 * 4];
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 3, 4), FSDP_OK);
  for (int b = 0; b < 3; b++)
    for (int i = 0; i < 4; i++) {
      assert_int_equal(x[b * 4 + i], (starts[b] + i) * 600);
      assert_int_equal(y[b * 4 + i], (starts[b] + i + 1) * 600);
    }
  /* without targets the last window may end at the last id */
  starts[0] = 96;
  assert_int_equal(fsdp_io_tokens_windows(t, x, NULL, starts, 1, 4), FSDP_OK);
  assert_int_equal(x[3], 99 * 600);
  /* ... with them it may not */
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 4), FSDP_ERR);
  assert_error_has("window start 96 is out of range [0, 95]");
  starts[0] = -1;
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 4), FSDP_ERR);
  assert_error_has("window start -1");
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 0), FSDP_ERR);
  assert_error_has("window length 0");
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 100), FSDP_ERR);
  assert_error_has("100 tokens; a window of 100 and its target needs 101");
  fsdp_io_tokens_close(t);

  /* a vocabulary the file exceeds: the window holding the id is refused, naming it */
  assert_int_equal(fsdp_io_tokens_open(&t, p, 2, 100, 30000), FSDP_OK);
  starts[0] = 47; /* ids 47..51: 50 * 600 = 30000 */
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 4), FSDP_ERR);
  assert_error_has("token 50 is 30000, not below the vocabulary size 30000");
  starts[0] = 10;
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 1, 4), FSDP_OK);
  fsdp_io_tokens_close(t);
  fsdp_io_tokens_close(NULL);
}

static void test_tokens_u32(void **state) {
  (void)state;
  char p[320];
  path_in(p, sizeof p, "t32.bin");
  uint32_t ids[50];
  for (int i = 0; i < 50; i++) ids[i] = 70000u + (uint32_t)i * 1000003u;
  write_bytes(p, ids, sizeof ids);
  fsdp_io_tokens *t;
  assert_int_equal(fsdp_io_tokens_open(&t, p, 4, 50, 0), FSDP_OK);
  int64_t starts[2] = {7, 0}, x[2 * 5], y[2 * 5];
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, 2, 5), FSDP_OK);
  for (int b = 0; b < 2; b++)
    for (int i = 0; i < 5; i++) {
      assert_int_equal(x[b * 5 + i], (int64_t)ids[starts[b] + i]);
      assert_int_equal(y[b * 5 + i], (int64_t)ids[starts[b] + i + 1]);
    }
  fsdp_io_tokens_close(t);
}

static void test_tokens_refused(void **state) {
  (void)state;
  char p[320];
  path_in(p, sizeof p, "odd.bin");
  char bytes[11] = {0};
  write_bytes(p, bytes, sizeof bytes);
  fsdp_io_tokens *t = (fsdp_io_tokens *)1;
  assert_int_equal(fsdp_io_tokens_open(&t, p, 2, 6, 0), FSDP_ERR);
  assert_null(t);
  assert_error_has("wrong size: 11 bytes, but 6 ids of 2 bytes need 12");
  assert_int_equal(fsdp_io_tokens_open(&t, p, 3, 3, 0), FSDP_ERR);
  assert_error_has("ids of 3 bytes");
  assert_int_equal(fsdp_io_tokens_open(&t, g_dir, 2, 0, 0), FSDP_ERR);
  assert_error_has("not a regular file");
  assert_int_equal(fsdp_io_tokens_open(&t, "/nonexistent/x.bin", 2, 0, 0), FSDP_ERR);
  assert_error_has("/nonexistent/x.bin: cannot open");
  /* an empty file maps to nothing and holds no window */
  path_in(p, sizeof p, "empty.bin");
  write_bytes(p, bytes, 0);
  assert_int_equal(fsdp_io_tokens_open(&t, p, 2, 0, 0), FSDP_OK);
  int64_t s = 0, x[1], y[1];
  assert_int_equal(fsdp_io_tokens_windows(t, x, y, &s, 1, 1), FSDP_ERR);
  assert_error_has("0 tokens");
  fsdp_io_tokens_close(t);
}

/* kB of this process's resident file-backed pages (RssFile in /proc/self/status); -1 when the
 * kernel does not say */
static long rss_file_kb(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (f == NULL) return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "RssFile: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}

/* Windows spread over a 32 MiB file leave no file pages resident: each call gives its pages
 * (and the kernel's fault-around neighbours) back. Without that, this reads most of the file
 * into the process's resident set. */
static void test_tokens_resident(void **state) {
  (void)state;
  /* valgrind maps and reads files of its own while the test runs: RssFile says nothing there */
  const char *vg = getenv("FSDP_UNDER_VALGRIND");
  if (vg != NULL && vg[0] != '\0' && strcmp(vg, "0") != 0) skip();
  char p[320];
  path_in(p, sizeof p, "big.bin");
  const int64_t count = 16 << 20; /* uint16: 32 MiB */
  FILE *f = fopen(p, "wb");
  assert_non_null(f);
  static uint16_t block[65536];
  for (int i = 0; i < 65536; i++) block[i] = (uint16_t)i;
  for (int64_t i = 0; i < count; i += 65536) assert_int_equal(fwrite(block, 2, 65536, f), 65536);
  fclose(f);
  fsdp_io_tokens *t;
  assert_int_equal(fsdp_io_tokens_open(&t, p, 2, count, 0), FSDP_OK);
  long before = rss_file_kb();
  if (before < 0) {
    fsdp_io_tokens_close(t);
    skip();
  }
  enum { B = 16, T = 256 };
  static int64_t x[B * T], y[B * T];
  int64_t starts[B];
  uint64_t h = 88172645463325252ull;
  for (int step = 0; step < 400; step++) {
    for (int b = 0; b < B; b++) {
      h ^= h << 13, h ^= h >> 7, h ^= h << 17;
      starts[b] = (int64_t)(h % (uint64_t)(count - T - 1));
    }
    assert_int_equal(fsdp_io_tokens_windows(t, x, y, starts, B, T), FSDP_OK);
    assert_int_equal(x[0], starts[0] % 65536);
  }
  long after = rss_file_kb();
  fsdp_io_tokens_close(t);
  /* 6400 windows touched up to 6400 * 64 KiB: far more than the file; a few pages may stay */
  if (after - before > 2048) fail_msg("RssFile grew from %ld to %ld kB", before, after);
}

/* ---- setup ---------------------------------------------------------------------------------- */

static int setup(void **state) {
  (void)state;
  const char *tmp = getenv("TMPDIR");
  snprintf(g_dir, sizeof g_dir, "%s/fsdp_test_tok.XXXXXX", tmp != NULL ? tmp : "/tmp");
  if (mkdtemp(g_dir) == NULL) return -1;
  path_in(g_model, sizeof g_model, "tok.model");
  const char *inputs[] = {CORPUS};
  fsdp_tok_train_opts o = {.inputs = inputs, .ninputs = 1, .vocab_size = 600, .model = g_model};
  if (fsdp_tok_train(&o)) {
    fprintf(stderr, "training the test model: %s\n", fsdp_error_msg());
    return -1;
  }
  return 0;
}

static int teardown(void **state) {
  (void)state;
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
  return system(cmd) == 0 ? 0 : -1;
}

int main(void) {
  if (!fsdp_tok_available()) {
    printf("skipped: this build has no SentencePiece (libsentencepiece-dev)\n");
    return 77;
  }
  if (access(CORPUS, R_OK) != 0) {
    printf("skipped: %s not found (install fortunes: scripts/install-deps)\n", CORPUS);
    return 77;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_train_and_load), cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_invalid_utf8),   cmocka_unit_test(test_space_symbol),
      cmocka_unit_test(test_no_space_piece), cmocka_unit_test(test_decode_errors),
      cmocka_unit_test(test_train_errors),   cmocka_unit_test(test_unigram),
      cmocka_unit_test(test_load_errors),    cmocka_unit_test(test_tokens_u16),
      cmocka_unit_test(test_tokens_u32),     cmocka_unit_test(test_tokens_refused),
      cmocka_unit_test(test_tokens_resident),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
