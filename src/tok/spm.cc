/*
 * spm.cc — tok.h over SentencePiece. The only C++ file of the engine: every entry point is a
 * try block, so no exception crosses into C (bad_alloc and the rest become FSDP_ERR), and every
 * util::Status becomes an fsdp_error message. Training reads the input files here (a
 * SentenceIterator over their lines) so that a file that cannot be read is named, and gets
 * the model back as bytes, written through the io layer's atomic file (no .vocab file beside
 * it, and no half-written model after a failure).
 */
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

extern "C" {
#include "core/core.h"
#include "io/io.h"
}
#include "tok/tok.h"

/* Exported by libsentencepiece but not declared in its public headers: the trainer logs its
 * command line at INFO before it reads --minloglevel, so the level is set here first. */
namespace sentencepiece {
namespace logging {
void SetMinLogLevel(int v);
}  // namespace logging
}  // namespace sentencepiece

/* SentencePiece writes a space as U+2581 (kSpace below) before it looks for pieces, and decodes
 * that symbol in a piece as a space. So a U+2581 of the text would come back as a space, and in a
 * model without a piece for the symbol (a corpus without spaces) a space becomes the symbol's
 * three byte pieces, which decode as U+2581. For a model that keeps text as is (every byte
 * piece, no dummy prefix: those trained here), encode() gives such a character its byte pieces
 * itself: a U+2581 always (byte pieces decode as the bytes they are), a space when the model
 * has no piece for it, and encodes the text between them with SentencePiece. Text holding no
 * U+2581 thus gets SentencePiece's own ids (a model without a piece for the symbol has no piece
 * that spans a space either), write_dataset's pieces of a file those of the whole file. */
struct fsdp_tok {
  sentencepiece::SentencePieceProcessor sp;
  bool literal;       /* encode() gives U+2581 (and spaces when space_bytes) their byte pieces */
  bool space_bytes;   /* the model has no piece for a space */
  int byte_id[256];   /* the id of the byte piece <0xXX> */
};

namespace {

/* SentencePiece's --max_sentence_length: it leaves longer lines (in bytes) out of training. */
constexpr size_t kMaxLine = 65536;

/* The lines of the input files, in order, each without its newline. Opening or reading a file
 * that fails stops the iteration with a status naming the file. */
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  LineIterator(const char *const *paths, int n, int64_t max)
      : paths_(paths), n_(n), max_(max) {
    Next();
  }
  ~LineIterator() override {
    if (f_ != nullptr) fclose(f_);
  }
  bool done() const override { return done_; }
  const std::string &value() const override { return line_; }
  sentencepiece::util::Status status() const override { return status_; }
  /* a line SentencePiece trains on: not empty, and not longer than kMaxLine */
  bool any_text() const { return text_; }
  int64_t long_lines() const { return long_; }
  void Next() override {
    if (done_) return;
    if (max_ > 0 && lines_ >= max_) {
      done_ = true;
      return;
    }
    for (;;) {
      if (f_ == nullptr) {
        if (next_ >= n_) {
          done_ = true;
          return;
        }
        cur_ = paths_[next_++];
        f_ = fopen(cur_, "rb");
        if (f_ == nullptr) return fail("cannot open");
      }
      line_.clear();
      int c;
      bool any = false;
      while ((c = getc(f_)) != EOF) {
        any = true;
        if (c == '\n') break;
        line_.push_back((char)c);
      }
      if (ferror(f_)) return fail("cannot read");
      if (!any) {
        fclose(f_);
        f_ = nullptr;
        continue;
      }
      if (!line_.empty() && line_.back() == '\r') line_.pop_back();
      lines_++;
      if (line_.size() > kMaxLine)
        long_++;
      else if (!line_.empty())
        text_ = true;
      return;
    }
  }

 private:
  void fail(const char *what) {
    status_ = sentencepiece::util::Status(sentencepiece::util::StatusCode::kNotFound,
                                          std::string(what) + " " + cur_ + ": " +
                                              strerror(errno));
    done_ = true;
  }
  const char *const *paths_;
  int n_, next_ = 0;
  int64_t max_, lines_ = 0, long_ = 0;
  const char *cur_ = "";
  FILE *f_ = nullptr;
  std::string line_;
  bool done_ = false;
  bool text_ = false;
  sentencepiece::util::Status status_;
};

/* SentencePiece's messages start with "<file>(<line>) [<check>] "; keep what follows. */
const char *spm_message(const sentencepiece::util::Status &s) {
  const char *m = s.error_message();
  const char *p = strstr(m, "] ");
  return p != nullptr ? p + 2 : m;
}

const char kSpace[] = "\xe2\x96\x81"; /* U+2581, SentencePiece's symbol for a space */

/* Fills t's byte ids and decides whether encode() keeps U+2581 and spaces itself (struct
 * fsdp_tok). A model without every byte piece, or one that adds a dummy prefix (it starts
 * every text with a space, so it could not encode the text in parts), is left to
 * SentencePiece. */
void classify(fsdp_tok *t) {
  t->literal = false;
  t->space_bytes = false;
  for (int b = 0; b < 256; b++) {
    char piece[8];
    snprintf(piece, sizeof piece, "<0x%02X>", b);
    t->byte_id[b] = t->sp.PieceToId(piece);
    if (!t->sp.IsByte(t->byte_id[b])) return;
  }
  std::vector<int> probe;
  if (!t->sp.Encode("a", &probe).ok() || probe.empty()) return;
  if (probe[0] == t->byte_id[0xe2] || t->sp.IdToPiece(probe[0]).rfind(kSpace, 0) == 0) return;
  t->literal = true;
  t->space_bytes = t->sp.PieceToId(kSpace) == t->sp.unk_id();
}

/* The length of the character at text[i] that encode() gives byte pieces itself, or 0. */
size_t own_bytes(const fsdp_tok *t, const char *text, size_t len, size_t i) {
  if (text[i] == ' ') return t->space_bytes ? 1 : 0;
  if (i + 3 <= len && memcmp(text + i, kSpace, 3) == 0) return 3;
  return 0;
}

int write_model(const char *path, const std::string &bytes) {
  fsdp_io_atomic *f;
  if (fsdp_io_atomic_open(&f, path)) return FSDP_ERR;
  if (fsdp_io_atomic_write(f, bytes.data(), bytes.size())) {
    fsdp_io_atomic_abort(f);
    return FSDP_ERR;
  }
  return fsdp_io_atomic_commit(f);
}

int train(const fsdp_tok_train_opts *o) {
  if (o->ninputs < 1 || o->inputs == nullptr)
    return fsdp_error("tokenizer train: no input files");
  if (o->model == nullptr || o->model[0] == '\0')
    return fsdp_error("tokenizer train: no model path");
  const char *type = o->model_type != nullptr ? o->model_type : "bpe";
  if (strcmp(type, "bpe") != 0 && strcmp(type, "unigram") != 0)
    return fsdp_error("tokenizer train: model_type must be \"bpe\" or \"unigram\", got \"%s\"",
                      type);
  /* 256 byte pieces and <unk>, <s>, </s> */
  if (o->vocab_size < 260)
    return fsdp_error("tokenizer train: vocab_size %d is too small: byte fallback alone takes "
                      "259 pieces (256 bytes, <unk>, <s>, </s>)", o->vocab_size);
  double cov = o->character_coverage > 0 ? o->character_coverage : 0.9995;
  if (cov > 1) return fsdp_error("tokenizer train: character_coverage %g is above 1", cov);
  for (int i = 0; i < o->ninputs; i++) {
    FILE *f = fopen(o->inputs[i], "rb");
    if (f == nullptr)
      return fsdp_error("tokenizer train: cannot open %s: %s", o->inputs[i], strerror(errno));
    fclose(f);
  }
  char args[512];
  /* identity normalization, no dummy prefix, no whitespace folding: the text comes back
   * byte for byte; minloglevel=2 keeps SentencePiece's progress off stderr */
  snprintf(args, sizeof args,
           "--model_type=%s --vocab_size=%d --byte_fallback=true "
           "--normalization_rule_name=identity --add_dummy_prefix=false "
           "--remove_extra_whitespaces=false --split_digits=false --num_threads=%d "
           "--character_coverage=%.17g --minloglevel=2 --max_sentence_length=%zu "
           "--train_extremely_large_corpus=false",
           type, o->vocab_size, o->threads > 0 ? o->threads : 1, cov, kMaxLine);
  sentencepiece::logging::SetMinLogLevel(2);
  LineIterator it(o->inputs, o->ninputs, o->max_sentences);
  std::string model;
  sentencepiece::util::Status s = sentencepiece::SentencePieceTrainer::Train(args, &it, &model);
  if (!s.ok()) {
    if (!it.status().ok()) return fsdp_error("tokenizer train: %s", it.status().error_message());
    /* SentencePiece's own message for an empty corpus is its failed check, with no words */
    if (!it.any_text() && it.long_lines() > 0)
      return fsdp_error("tokenizer train: the input has no line to train on: %lld line%s "
                        "longer than %zu bytes (SentencePiece leaves those out), the rest empty",
                        (long long)it.long_lines(), it.long_lines() == 1 ? " is" : "s are",
                        kMaxLine);
    if (!it.any_text())
      return fsdp_error("tokenizer train: the input has no text to train on (%d file%s, every "
                        "line empty)", o->ninputs, o->ninputs == 1 ? "" : "s");
    return fsdp_error("tokenizer train: %s", spm_message(s));
  }
  if (write_model(o->model, model)) return fsdp_error_context("tokenizer train");
  return FSDP_OK;
}

}  // namespace

extern "C" {

int fsdp_tok_available(void) { return 1; }

int fsdp_tok_train(const fsdp_tok_train_opts *o) {
  try {
    return train(o);
  } catch (const std::bad_alloc &) {
    return fsdp_error("tokenizer train: out of memory");
  } catch (const std::exception &e) {
    return fsdp_error("tokenizer train: %s", e.what());
  } catch (...) {
    return fsdp_error("tokenizer train: unknown error");
  }
}

int fsdp_tok_load(fsdp_tok **out, const char *path) {
  *out = nullptr;
  fsdp_tok *t = nullptr;
  try {
    FILE *f = fopen(path, "rb");
    if (f == nullptr) return fsdp_error("tokenizer: cannot open %s: %s", path, strerror(errno));
    fclose(f);
    t = new fsdp_tok;
    sentencepiece::util::Status s = t->sp.Load(path);
    if (!s.ok()) {
      delete t;
      const char *why = spm_message(s);
      return fsdp_error("tokenizer: %s is not a SentencePiece model (%s)", path,
                        why[0] != '\0' ? why : "it does not parse as one");
    }
    classify(t);
    *out = t;
    return FSDP_OK;
  } catch (const std::bad_alloc &) {
    delete t;
    return fsdp_error("tokenizer: loading %s: out of memory", path);
  } catch (const std::exception &e) {
    delete t;
    return fsdp_error("tokenizer: loading %s: %s", path, e.what());
  } catch (...) {
    delete t;
    return fsdp_error("tokenizer: loading %s: unknown error", path);
  }
}

void fsdp_tok_free(fsdp_tok *t) { delete t; }

int fsdp_tok_vocab_size(const fsdp_tok *t) { return t->sp.GetPieceSize(); }

const char *fsdp_tok_piece(const fsdp_tok *t, int id) {
  if (id < 0 || id >= t->sp.GetPieceSize()) return nullptr;
  return t->sp.IdToPiece(id).c_str();
}

int fsdp_tok_special_id(const fsdp_tok *t, const char *name) {
  if (strcmp(name, "unk") == 0) return t->sp.unk_id();
  if (strcmp(name, "bos") == 0) return t->sp.bos_id();
  if (strcmp(name, "eos") == 0) return t->sp.eos_id();
  if (strcmp(name, "pad") == 0) return t->sp.pad_id();
  return -1;
}

int fsdp_tok_encode(const fsdp_tok *t, const char *text, size_t len, int32_t **ids, size_t *n) {
  *ids = nullptr;
  *n = 0;
  try {
    std::vector<int> v;
    size_t from = 0; /* the text not yet encoded starts here */
    for (size_t i = 0; t->literal && i < len; i++) {
      size_t k = own_bytes(t, text, len, i);
      if (k == 0) continue;
      if (i > from) {
        std::vector<int> part;
        sentencepiece::util::Status s = t->sp.Encode(absl::string_view(text + from, i - from),
                                                     &part);
        if (!s.ok()) return fsdp_error("tokenizer encode: %s", spm_message(s));
        v.insert(v.end(), part.begin(), part.end());
      }
      for (size_t j = 0; j < k; j++) v.push_back(t->byte_id[(unsigned char)text[i + j]]);
      i += k - 1;
      from = i + 1;
    }
    if (from < len) {
      std::vector<int> part;
      sentencepiece::util::Status s = t->sp.Encode(absl::string_view(text + from, len - from),
                                                   &part);
      if (!s.ok()) return fsdp_error("tokenizer encode: %s", spm_message(s));
      v.insert(v.end(), part.begin(), part.end());
    }
    int32_t *out = (int32_t *)malloc((v.size() > 0 ? v.size() : 1) * sizeof *out);
    if (out == nullptr) return fsdp_error("tokenizer encode: out of memory (%zu ids)", v.size());
    for (size_t i = 0; i < v.size(); i++) out[i] = v[i];
    *ids = out;
    *n = v.size();
    return FSDP_OK;
  } catch (const std::bad_alloc &) {
    return fsdp_error("tokenizer encode: out of memory (%zu bytes of text)", len);
  } catch (const std::exception &e) {
    return fsdp_error("tokenizer encode: %s", e.what());
  } catch (...) {
    return fsdp_error("tokenizer encode: unknown error");
  }
}

int fsdp_tok_decode(const fsdp_tok *t, const int32_t *ids, size_t n, char **text, size_t *len) {
  *text = nullptr;
  *len = 0;
  try {
    const int V = t->sp.GetPieceSize();
    std::vector<int> v(n);
    for (size_t i = 0; i < n; i++) {
      if (ids[i] < 0 || ids[i] >= V)
        return fsdp_error("tokenizer decode: id %d at position %zu is out of range [0, %d)",
                          (int)ids[i], i, V);
      v[i] = ids[i];
    }
    std::string s;
    sentencepiece::util::Status st = t->sp.Decode(v, &s);
    if (!st.ok()) return fsdp_error("tokenizer decode: %s", spm_message(st));
    char *out = (char *)malloc(s.size() + 1);
    if (out == nullptr) return fsdp_error("tokenizer decode: out of memory (%zu bytes)", s.size());
    memcpy(out, s.data(), s.size());
    out[s.size()] = '\0';
    *text = out;
    *len = s.size();
    return FSDP_OK;
  } catch (const std::bad_alloc &) {
    return fsdp_error("tokenizer decode: out of memory (%zu ids)", n);
  } catch (const std::exception &e) {
    return fsdp_error("tokenizer decode: %s", e.what());
  } catch (...) {
    return fsdp_error("tokenizer decode: unknown error");
  }
}

}  // extern "C"
