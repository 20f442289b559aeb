/*
 * tok.h — subword tokenizers through SentencePiece (Debian's libsentencepiece-dev), as a small C
 * API: train a BPE or unigram model on text files, load a .model file, encode text to ids and
 * decode ids to text. spm.cc implements it in C++; nothing of SentencePiece (or of C++) shows
 * above this header: every call catches what SentencePiece throws and turns its util::Status
 * into FSDP_ERR with an fsdp_error message naming the file or the argument at fault. Without
 * SentencePiece the build compiles spm_stub.c, whose every call fails with "built without
 * SentencePiece".
 *
 * Models trained here always fall back to bytes (byte_fallback: 256 pieces <0x00>..<0xFF>), use
 * the identity normalization and no dummy prefix, so decode(encode(s)) == s for every valid
 * UTF-8 string s (newlines and characters never seen in training become byte pieces; a
 * U+2581, SentencePiece's symbol for a space, and a space in a model without a piece for it
 * are given their byte pieces by fsdp_tok_encode, since SentencePiece would decode them as each
 * other). Invalid UTF-8 is not kept: SentencePiece reads each malformed byte as U+FFFD, which
 * decodes as the three bytes EF BF BD. Ids: 0 <unk>, 1 <s>, 2 </s> (SentencePiece's defaults),
 * then the bytes.
 *
 * Threads: a loaded tokenizer is read-only and may encode and decode from several threads at
 * once; training uses `threads` threads of its own.
 */
#ifndef FSDP_TOK_H
#define FSDP_TOK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct fsdp_tok fsdp_tok;

typedef struct fsdp_tok_train_opts {
  const char *const *inputs; /* text files, read line by line (a line is a sentence) */
  int ninputs;
  int vocab_size;             /* pieces in the model, byte and special pieces included */
  const char *model;          /* the .model file written (atomically: whole or not at all) */
  const char *model_type;     /* "bpe" or "unigram"; NULL: "bpe" */
  int threads;                /* training threads; 0: 1 */
  double character_coverage;  /* share of characters given pieces of their own; 0: 0.9995 */
  int64_t max_sentences;      /* sample at most this many lines (0: all) */
} fsdp_tok_train_opts;

/* 1 when this build has SentencePiece, 0 when it has the stub. */
int fsdp_tok_available(void);
/* Train a model and write it to o->model. Errors name the input file that cannot be read, or
 * pass on SentencePiece's message (a vocabulary too large for the corpus says the largest size
 * it can reach). */
int fsdp_tok_train(const fsdp_tok_train_opts *o);
/* Load a .model file into *out (free with fsdp_tok_free). A missing or malformed file is an
 * error naming it. */
int fsdp_tok_load(fsdp_tok **out, const char *path);
void fsdp_tok_free(fsdp_tok *t); /* NULL is a no-op */
/* Pieces in the vocabulary: ids are 0 .. vocab_size - 1. */
int fsdp_tok_vocab_size(const fsdp_tok *t);
/* The piece of id (owned by t), or NULL for an id out of range. */
const char *fsdp_tok_piece(const fsdp_tok *t, int id);
/* The id of "unk", "bos", "eos" or "pad"; -1 when the model has none (or for another name). */
int fsdp_tok_special_id(const fsdp_tok *t, const char *name);
/* Encode len bytes of text: *ids (malloc'd; free() it) holds *n ids. */
int fsdp_tok_encode(const fsdp_tok *t, const char *text, size_t len, int32_t **ids, size_t *n);
/* Decode n ids: *text (malloc'd, NUL-terminated; free() it) holds *len bytes. An id out of
 * range is an error naming it and its position (0-based). */
int fsdp_tok_decode(const fsdp_tok *t, const int32_t *ids, size_t n, char **text, size_t *len);

#ifdef __cplusplus
}
#endif

#endif
