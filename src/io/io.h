/*
 * io.h — the file-format layer of the engine: atomic files, the safetensors format (streaming
 * writer, validating reader with per-tensor checksums), tensors of every dtype through it, a
 * JSON helper for checkpoint indexes, the sharded checkpoint index's schema check and a few
 * folder operations. This layer knows nothing of FSDP, units or ranks: it moves bytes between
 * buffers and files. The file formats (atomic.c, st_read.c, st_write.c, json.c,
 * index.c, fs.c, util.c) call src/core only (errors), so the fuzz targets build from them
 * alone; st_tensor.c moves tensors of any dtype, device and strides through them and calls
 * the kernels (src/kernels: conversions and copies between devices). The fsdp layer
 * (lua/fsdp/checkpoint.lua) builds collective, sharded saving and loading on top of it. The
 * format is specified in docs/checkpoints.md.
 *
 * Errors: fallible functions return FSDP_OK / FSDP_ERR and leave a message in the calling
 * thread's error slot that names the file (and the tensor, where there is one), e.g.
 *   "/ckpt/model.safetensors: tensor 'h.0.attn.w': checksum mismatch (stored 1f.., computed ..)".
 * Nothing here exits, aborts on user input or touches Lua.
 *
 * Threads: every object is used by one thread at a time, except a reader, whose read and
 * verify calls may run concurrently from several threads (ranks sharing one file): they use
 * pread and keep no state between calls. The fault injector is per thread (one rank).
 */
#ifndef FSDP_IO_H
#define FSDP_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/core.h"

typedef struct cJSON cJSON;

/* ---- atomic files (atomic.c) ------------------------------------------------------------ */

/* A file that appears under its final name whole or not at all. open creates
 * "<dir>/.<name>.tmp.<host>.<pid>.<tid>" in the folder of `path` (so the rename cannot cross
 * file systems; <host> is this machine's name, letters, digits and '-' only); commit flushes,
 * fsyncs, renames it over `path` and fsyncs the folder; abort (or a failed commit) removes it.
 * Until commit, an existing file at `path` is never touched. open first removes from the
 * folder the temporaries of processes of this host that are no longer running (a save killed
 * midway); those of running processes, and of other hosts, stay.
 * A write that fails leaves the handle failed: later writes and commit return an error and the
 * caller aborts. One writer per path per thread at a time: a leftover temporary of the same
 * name (a crashed process whose pid and tid this one reuses) is replaced. Writes are buffered
 * (1 MiB); writes larger than the buffer go straight to the file. */
typedef struct fsdp_io_atomic fsdp_io_atomic;

int fsdp_io_atomic_open(fsdp_io_atomic **out, const char *path);
/* Append `bytes` bytes. */
int fsdp_io_atomic_write(fsdp_io_atomic *f, const void *data, size_t bytes);
/* Overwrite bytes already written, [offset, offset + bytes) within the current size (for
 * fields patched after the fact, such as checksums in a header). */
int fsdp_io_atomic_pwrite(fsdp_io_atomic *f, const void *data, size_t bytes, uint64_t offset);
uint64_t fsdp_io_atomic_size(const fsdp_io_atomic *f); /* bytes written so far */
const char *fsdp_io_atomic_path(const fsdp_io_atomic *f);      /* the final path */
const char *fsdp_io_atomic_temp_path(const fsdp_io_atomic *f); /* the temporary's path */
/* Make the file durable under its final name. Frees f whether it succeeds or not; on error the
 * temporary is removed and an existing file at the final path is left as it was (unless only
 * the final fsync of the folder failed: the message says so). */
int fsdp_io_atomic_commit(fsdp_io_atomic *f);
/* Remove the temporary and free f. NULL is a no-op. */
void fsdp_io_atomic_abort(fsdp_io_atomic *f);

/* Fault injection for tests of the layers above (disk full or permission denied on rank 1):
 * this thread's next atomic-file system call at `point` fails with errno `err` as if the
 * system had refused it; for FSDP_IO_FAULT_WRITE, once the file being written has reached
 * `after_bytes` bytes. One shot: the fault clears when it fires. FSDP_IO_FAULT_NONE clears it. */
typedef enum {
  FSDP_IO_FAULT_NONE = 0,
  FSDP_IO_FAULT_OPEN,   /* creating the temporary */
  FSDP_IO_FAULT_WRITE,  /* writing data */
  FSDP_IO_FAULT_FSYNC,  /* fsync of the file at commit */
  FSDP_IO_FAULT_RENAME, /* the rename at commit */
} fsdp_io_fault_point;
void fsdp_io_fault_set(fsdp_io_fault_point point, int err, uint64_t after_bytes);
/* "open", "write", "fsync", "rename" (and "none") -> point; -1 for an unknown name. */
int fsdp_io_fault_point_from_name(const char *name);

/* ---- safetensors (dtypes: util.c; writer: st_write.c; reader: st_read.c) ---------------- */

/* The dtypes of the safetensors format with a whole number of bytes per element. F32 is 0 so
 * that a zero-initialized entry means f32. Eight of them are tensor dtypes (F32, BF16, F16,
 * F64, I64, I32, U8, BOOL: fsdp_io_dtype_to_tensor); the others are listed (their sizes make
 * the layout checkable) and can be written and read as bytes, but not as tensors. */
typedef enum {
  FSDP_IO_F32 = 0,
  FSDP_IO_F16,
  FSDP_IO_BF16,
  FSDP_IO_F64,
  FSDP_IO_BOOL,
  FSDP_IO_U8,
  FSDP_IO_I8,
  FSDP_IO_F8_E5M2,
  FSDP_IO_F8_E4M3,
  FSDP_IO_I16,
  FSDP_IO_U16,
  FSDP_IO_I32,
  FSDP_IO_U32,
  FSDP_IO_I64,
  FSDP_IO_U64,
  FSDP_IO_DTYPE_COUNT
} fsdp_io_dtype;
const char *fsdp_io_dtype_name(fsdp_io_dtype dt); /* "F32", ... */
size_t fsdp_io_dtype_size(fsdp_io_dtype dt);
/* The dtype of a safetensors name ("F32"); -1 for a name this build does not know. */
int fsdp_io_dtype_from_name(const char *name);
/* The tensor dtype of a stored dtype (bit for bit the same encoding): true and *out set for
 * the eight above, false for the others. */
bool fsdp_io_dtype_to_tensor(fsdp_io_dtype dt, fsdp_dtype *out);
/* The stored dtype of a tensor dtype; -1 for an unknown one. */
int fsdp_io_dtype_of_tensor(fsdp_dtype dt);

/* One tensor of a safetensors file. The writer reads name, dtype and the shape;
 * the reader fills every field. Offsets are bytes within the data section (the file's bytes
 * after the header), as in the format's "data_offsets". */
typedef struct fsdp_io_st_entry {
  const char *name;
  fsdp_io_dtype dtype;
  int ndim;
  int64_t shape[FSDP_MAX_DIMS];
  int64_t numel;       /* reader */
  uint64_t begin, end; /* reader: data_offsets */
  bool has_checksum;   /* reader: the file stores fsdp.xxh3_64.<name> */
  uint64_t checksum;   /* reader: XXH3_64bits (seed 0) of the tensor's bytes in the file */
} fsdp_io_st_entry;

/* A __metadata__ pair (safetensors metadata is a map of strings to strings). */
typedef struct fsdp_io_kv {
  const char *key;
  const char *value;
} fsdp_io_kv;

/* Keys this layer writes into __metadata__ (users may not set them): the checksum of the
 * header ("fsdp.header.xxh3_64", always the first member of the header) and one checksum per
 * tensor ("fsdp.xxh3_64." followed by the tensor's name). Values are 16 lowercase hex digits. */
#define FSDP_IO_HEADER_CHECKSUM_KEY "fsdp.header.xxh3_64"
#define FSDP_IO_CHECKSUM_PREFIX "fsdp.xxh3_64."
/* The largest header accepted (as in the reference implementation). */
#define FSDP_IO_ST_MAX_HEADER 100000000u

/* -- writer (st_write.c): streams tensors to an atomic file; memory use is the header plus a
 * 1 MiB buffer. open takes every entry (names unique, valid UTF-8, not "__metadata__"; any dtype; at most
 * FSDP_MAX_DIMS dims) and the metadata, lays the data out in entry order and writes the
 * header. Then the tensors' bytes arrive in entry order, each tensor in one or several write
 * calls (element ranges in order: one call per shard, say); entries with no elements need no
 * call. commit checks every byte arrived, patches the checksums into the header and commits
 * the file. Nothing appears at `path` before a successful commit. */
typedef struct fsdp_io_st_writer fsdp_io_st_writer;

int fsdp_io_st_writer_open(fsdp_io_st_writer **out, const char *path,
                           const fsdp_io_st_entry *entries, int nentries,
                           const fsdp_io_kv *metadata, int nmetadata);
/* Append `count` elements of the entry's dtype (count * its size bytes, little-endian, as
 * they are: no conversion) to tensor `name`, which must be the first tensor not yet complete
 * (a write of 0 elements may name any tensor: an empty shard); a write past its end is an
 * error naming the tensor. */
int fsdp_io_st_writer_write(fsdp_io_st_writer *w, const char *name, const void *data,
                            int64_t count);
/* The entry `name` as given to open (name, dtype, shape), or NULL with an error naming the
 * file and the tensor. Owned by the writer. */
const fsdp_io_st_entry *fsdp_io_st_writer_find(const fsdp_io_st_writer *w, const char *name);
const char *fsdp_io_st_writer_path(const fsdp_io_st_writer *w); /* the final path */
/* Frees w whether it succeeds or not (an error leaves the previous file, if any). */
int fsdp_io_st_writer_commit(fsdp_io_st_writer *w);
void fsdp_io_st_writer_abort(fsdp_io_st_writer *w); /* NULL is a no-op */

/* -- reader (st_read.c): open reads the header once and validates it whole: the length field against the
 * file size, the JSON (cJSON; no string may hold a NUL character, raw or as \u0000, which
 * would alias "a\u0000b" to "a"), every entry (dtype known, shape, data_offsets), sizes =
 * numel * dtype size, offsets inside the data section, no overlaps, no holes, no trailing
 * bytes, the header checksum when the file has one, the form of the tensor checksums. Reads
 * then pread only the bytes asked for. */
typedef struct fsdp_io_st_reader fsdp_io_st_reader;

int fsdp_io_st_reader_open(fsdp_io_st_reader **out, const char *path);
/* The same over bytes in memory (`size` bytes at `data`, borrowed: they must outlive the
 * reader). `name` stands for the file in messages. For fuzzing and for files already read. */
int fsdp_io_st_reader_open_memory(fsdp_io_st_reader **out, const char *name, const void *data,
                                  size_t size);
void fsdp_io_st_reader_close(fsdp_io_st_reader *r); /* NULL is a no-op */

const char *fsdp_io_st_reader_path(const fsdp_io_st_reader *r);
int fsdp_io_st_reader_count(const fsdp_io_st_reader *r);
/* Entry i in the order of the header (0 <= i < count); owned by the reader. */
const fsdp_io_st_entry *fsdp_io_st_reader_entry(const fsdp_io_st_reader *r, int i);
/* The entry named `name`, or NULL with an error naming the file and the tensor. */
const fsdp_io_st_entry *fsdp_io_st_reader_find(const fsdp_io_st_reader *r, const char *name);
/* __metadata__ in the order of the header, checksum keys included; owned by the reader. */
int fsdp_io_st_reader_metadata_count(const fsdp_io_st_reader *r);
fsdp_io_kv fsdp_io_st_reader_metadata_at(const fsdp_io_st_reader *r, int i);
const char *fsdp_io_st_reader_metadata_get(const fsdp_io_st_reader *r, const char *key);

/* out = the stored bytes of elements [first, first + count) of tensor `name` (0-based element
 * offsets into the flattened tensor): count * dtype size bytes, as they are in the file (no
 * conversion: st_tensor.c converts). Reading a whole tensor (first 0, count numel) checks its
 * checksum when the file has one; a range is not checked (see verify). Elements of a BOOL
 * tensor must be 0 or 1: any other byte is an error naming the tensor and the element. */
int fsdp_io_st_reader_read(fsdp_io_st_reader *r, void *out, const char *name, int64_t first,
                           int64_t count);
/* The same range in pieces, through the caller's buffer `buf` of `buf_bytes` bytes (at least
 * one element): each piece (whole elements, at most buf_bytes) is read into buf and handed to
 * sink(ctx, buf, at, n) — n elements starting at element first + at — before the next is
 * read; a sink that fails stops the read with its error. A whole tensor is checked against
 * its checksum after the last piece (so a mismatch is reported after the sink has seen the
 * data: a caller that must not act on bad data stages it). For readers of bounded memory:
 * tensors on other devices, conversions. */
typedef int (*fsdp_io_st_sink)(void *ctx, const void *bytes, int64_t at, int64_t n);
int fsdp_io_st_reader_read_chunks(fsdp_io_st_reader *r, const char *name, int64_t first,
                                  int64_t count, void *buf, size_t buf_bytes,
                                  fsdp_io_st_sink sink, void *ctx);
/* Read tensor `name` whole, in 1 MiB pieces, and check its checksum: for ranks that read only
 * their range. FSDP_OK when the file has no checksum for it (entry->has_checksum says). */
int fsdp_io_st_reader_verify(fsdp_io_st_reader *r, const char *name);

/* ---- tensors through safetensors files (st_tensor.c; calls src/kernels) ------------------- */

/* The host staging these functions use, per call: at most this many bytes of stored data at a
 * time (plus, when converting, the same number of elements in the other dtype). */
#define FSDP_IO_STAGE_BYTES ((size_t)1 << 20)

/* Append every element of t (any dtype, device with data, strides; flattened in row-major
 * order) to entry `name`, as fsdp_io_st_writer_write. t's dtype should be the entry's (its
 * bytes are then written as they are); another dtype is converted (fsdp_copy's rules) piece
 * by piece. A contiguous tensor in host memory of the entry's dtype is written from its own
 * memory; anything else goes through a host buffer of FSDP_IO_STAGE_BYTES (fsdp_copy of a
 * slice of t into it), so a tensor on a device without host memory is never copied whole. */
int fsdp_io_st_write_tensor(fsdp_io_st_writer *w, const char *name, fsdp_tensor *t);
/* dst <- elements [first, first + count) of tensor `name`, converted to dst's dtype:
 * dst is contiguous, has count elements (any shape), any dtype and any device with data. The
 * stored dtype must be a tensor dtype (fsdp_io_dtype_to_tensor); the conversion follows
 * fsdp_copy (float -> float rounds to nearest even, NaN and infinities kept; float -> integer
 * truncates toward zero and saturates, NaN gives 0; bool is v != 0). A whole tensor is
 * checksummed. dst in host memory of the stored dtype is read into directly; otherwise the
 * data goes through a host buffer of FSDP_IO_STAGE_BYTES and fsdp_copy into slices of dst.
 * dst's version is bumped. On error dst may hold part of the data. */
int fsdp_io_st_read_tensor(fsdp_io_st_reader *r, const char *name, int64_t first, int64_t count,
                           fsdp_tensor *dst);

/* ---- JSON documents (json.c) ------------------------------------------------------------ */

/* Write `doc` (printed formatted, with a final newline) to `path` through an atomic file. */
int fsdp_io_json_write_atomic(const char *path, const cJSON *doc);
/* Write text and a final newline to `path` through an atomic file. */
int fsdp_io_text_write_atomic(const char *path, const char *text);
/* *text = doc printed formatted (the caller's, freed with cJSON_free); errors name path. */
int fsdp_io_json_print(const cJSON *doc, const char *path, char **text);
/* Read and parse the JSON document at `path` (at most 1 GiB); *out is the caller's, freed with
 * cJSON_Delete. Errors name the file and, for bad JSON, the line and column. */
int fsdp_io_json_read(const char *path, cJSON **out);
/* Read the whole file at `path` (at most 1 GiB, as a JSON document): *text (malloc'd, the
 * caller's, with a NUL after the *size bytes read) and *size. Errors name the file. */
int fsdp_io_text_read(const char *path, char **text, size_t *size);
/* The same over `size` bytes in memory; `name` stands for the file in messages. */
int fsdp_io_json_parse(cJSON **out, const char *name, const char *text, size_t size);
/* Flags of fsdp_io_json_parse_ex. */
enum {
  /* the bare words NaN, Infinity and -Infinity (not JSON, but Python's json writes them) parse
   * as the strings "NaN", "Infinity" and "-Infinity" */
  FSDP_IO_JSON_NONFINITE = 1,
};
/* fsdp_io_json_parse with flags; on a syntax error *err_line and *err_col (1-based, in text;
 * either may be NULL) say where, and the message says what was found there ("unexpected end of
 * text", "unexpected ','"). */
int fsdp_io_json_parse_ex(cJSON **out, const char *name, const char *text, size_t size,
                          unsigned flags, size_t *err_line, size_t *err_col);
/* Write `text` and a final newline to `path` through an atomic file. */
int fsdp_io_text_write_atomic(const char *path, const char *text);

/* ---- sharded checkpoint index (index.c) --------------------------------------------------- */

/* The index of a sharded checkpoint (docs/checkpoints.md "Sharded checkpoints"): a JSON object
 * naming one safetensors file per rank and, per parameter, which flat element range each rank
 * file holds. check validates the whole schema (index.c lists every rule: files one per rank,
 * plain names; params unique, shapes, slices tiling [0, numel) exactly; optimizer, rng,
 * loaders); errors name `name` (the file), the field and the parameter. parse and read also
 * check, and leave *out NULL on any error.
 *
 * Version 2 (what write writes) carries a checksum of its own bytes: the text starts with
 * exactly FSDP_IO_INDEX_PREFIX, 16 lowercase hex digits and `",` — the first member,
 * "index_xxh3", is XXH3_64bits (seed 0) of every byte of the file (the final newline
 * included) with those 16 digits read as '0' characters. parse and read find it at that fixed
 * place, before trusting the JSON it protects, and check it first: a mismatch is an error
 * naming the file. A version 2 index that does not start with the prefix is refused (damaged,
 * or rewritten by another program); one of version 1 (written before the checksum) has none
 * and is read unchecked. */
#define FSDP_IO_INDEX_FORMAT "fsdprun.sharded"
#define FSDP_IO_INDEX_VERSION 2
#define FSDP_IO_INDEX_CHECKSUM_KEY "index_xxh3"
#define FSDP_IO_INDEX_PREFIX "{\n\t\"" FSDP_IO_INDEX_CHECKSUM_KEY "\":\t\""
int fsdp_io_index_check(const cJSON *doc, const char *name);
int fsdp_io_index_parse(cJSON **out, const char *name, const char *text, size_t size);
int fsdp_io_index_read(const char *path, cJSON **out);
/* Write doc to `path` (an atomic file) as an index of version FSDP_IO_INDEX_VERSION after
 * checking it as the text a reader will parse. The writer owns "version" and "index_xxh3":
 * doc's values of them, if any, are replaced (an index read and written back is rewritten
 * with a checksum of its new bytes); the checksum comes first, then "version", then doc's
 * other members in doc's order. */
int fsdp_io_index_write(const char *path, const cJSON *doc);
/* Put the checksum of text[0..size) into its 16 digits after FSDP_IO_INDEX_PREFIX (for the
 * writer, and for tests and fuzzers that make an index whose checksum matches); an error
 * naming `name` when the text does not start with the prefix and 16 characters and '"'. */
int fsdp_io_index_stamp(char *text, size_t size, const char *name);

/* ---- folders (fs.c) ------------------------------------------------------------------------ */

/* Create `path` and its missing parents (mode 0777 & umask); an existing folder is fine. */
int fsdp_io_mkdirs(const char *path);
/* The names in folder `path` (not "." and ".."), unsorted; free with fsdp_io_listdir_free. */
int fsdp_io_listdir(const char *path, char ***names, int *count);
void fsdp_io_listdir_free(char **names, int count);
/* unlink; a missing file is not an error. */
int fsdp_io_remove(const char *path);
/* fsync a folder (makes earlier renames and removals in it durable). */
int fsdp_io_fsync_dir(const char *path);
/* Open `path` read-only (O_CLOEXEC) and check that it is a regular file; *size its bytes.
 * On error *fd is -1 and the message names the path and what failed (open, stat, not a
 * regular file). The one way the readers (JSON, safetensors, token files) open a file. */
int fsdp_io_open_regular(const char *path, int *fd, uint64_t *size);

/* ---- helpers shared by the layer (util.c) ----------------------------------------------- */

/* true when s[0..n) is well-formed UTF-8 (no overlongs, no surrogates, at most U+10FFFF). */
bool fsdp_io_utf8_valid(const char *s, size_t n);
/* FSDP_OK, or FSDP_ERR when a string of the JSON text[0..n) holds a NUL character, raw or
 * escaped as \u0000: cJSON would decode it into a C string that ends there, so the key
 * "wte.weight\u0000evil" would read as "wte.weight". The message names the file (name), the
 * part (what: "header") and the string as written, with its byte offset. */
int fsdp_io_json_refuse_nul(const char *name, const char *what, const char *text, size_t n);

#endif
