/*
 * spm_stub.c — tok.h in a build without SentencePiece (libsentencepiece-dev not found): every
 * call fails saying so, and fsdp_tok_available() is 0 so tests skip.
 */
#include "core/core.h"
#include "tok/tok.h"

#define MISSING "built without SentencePiece (install libsentencepiece-dev: scripts/install-deps)"

int fsdp_tok_available(void) { return 0; }
int fsdp_tok_train(const fsdp_tok_train_opts *o) {
  (void)o;
  return fsdp_error("tokenizer train: " MISSING);
}
int fsdp_tok_load(fsdp_tok **out, const char *path) {
  *out = NULL;
  return fsdp_error("tokenizer: cannot load %s: " MISSING, path);
}
void fsdp_tok_free(fsdp_tok *t) { (void)t; }
int fsdp_tok_vocab_size(const fsdp_tok *t) {
  (void)t;
  return 0;
}
const char *fsdp_tok_piece(const fsdp_tok *t, int id) {
  (void)t, (void)id;
  return NULL;
}
int fsdp_tok_special_id(const fsdp_tok *t, const char *name) {
  (void)t, (void)name;
  return -1;
}
int fsdp_tok_encode(const fsdp_tok *t, const char *text, size_t len, int32_t **ids, size_t *n) {
  (void)t, (void)text, (void)len;
  *ids = NULL;
  *n = 0;
  return fsdp_error("tokenizer encode: " MISSING);
}
int fsdp_tok_decode(const fsdp_tok *t, const int32_t *ids, size_t n, char **text, size_t *len) {
  (void)t, (void)ids, (void)n;
  *text = NULL;
  *len = 0;
  return fsdp_error("tokenizer decode: " MISSING);
}
