/*
 * tokens.h — token files (nanoGPT's layout: a raw array of little-endian uint16 or uint32 ids,
 * no header; docs/data.md names the sidecar JSON that says which), memory-mapped read-only.
 * Reading windows touches only their pages, and each call gives those pages back to the
 * kernel (madvise DONTNEED) after copying: the process's resident memory stays the size of
 * one batch's windows whatever the file's size, while the page cache keeps what the machine
 * can spare. Part of the io layer: calls src/core only.
 *
 * Threads: a map is read-only; several threads may read windows from one map at once.
 */
#ifndef FSDP_IO_TOKENS_H
#define FSDP_IO_TOKENS_H

#include <stdint.h>

typedef struct fsdp_io_tokens fsdp_io_tokens;

/* Map `path`, which must hold exactly `count` ids of `elem_size` bytes (2 or 4): a file of
 * another size is an error naming both sizes (a truncated or mislabelled file). vocab > 0:
 * the windows read are checked to hold ids below it. */
int fsdp_io_tokens_open(fsdp_io_tokens **out, const char *path, int elem_size, int64_t count,
                        int64_t vocab);
void fsdp_io_tokens_close(fsdp_io_tokens *t); /* NULL is a no-op */
int64_t fsdp_io_tokens_count(const fsdp_io_tokens *t);
const char *fsdp_io_tokens_path(const fsdp_io_tokens *t);

/* B windows of T ids: x[b*T + i] = id[starts[b] + i] and y[b*T + i] = id[starts[b] + i + 1]
 * (0 <= i < T), as int64. Every start must lie in [0, count - T - 1] (room for the target).
 * An id >= vocab is an error naming the file and the position (a corrupt file). y may be NULL
 * (windows of T ids, starts in [0, count - T]). */
int fsdp_io_tokens_windows(const fsdp_io_tokens *t, int64_t *x, int64_t *y, const int64_t *starts,
                           int B, int64_t T);

#endif
