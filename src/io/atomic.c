/*
 * atomic.c — files that appear whole or not at all (io.h), and the per-thread fault injector
 * that lets tests of the layers above fail a write on one rank.
 *
 * The sequence is the one that survives a crash or a power cut on Linux file systems: write a
 * temporary in the destination folder, fsync it, rename it over the final name (atomic within
 * one file system), then fsync the folder so the rename itself is durable. A reader therefore
 * sees either the old file or the new one, never a prefix. The temporary's name starts with a
 * dot and ends in .tmp.<host>.<pid>.<tid>, so leftovers of a crash are recognizable and never
 * mistaken for a checkpoint; opening an atomic file removes those of dead processes of this
 * host from its folder (a process killed mid-save cannot do it itself). The host is in the name
 * because a folder may be shared between machines, where a pid says nothing.
 *
 * Invariants: `used` bytes of `buf` are pending at file offset `flushed`; size = flushed +
 * used. Once a system call fails, `failed` is set and the handle only accepts abort/commit
 * (which then cleans up and reports the first error again).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io.h"

#define ATOMIC_BUF_BYTES ((size_t)1 << 20)
#define ERRMSG_CAP 512

struct fsdp_io_atomic {
  int fd;
  char *path; /* final */
  char *tmp;  /* temporary */
  char *dir;  /* folder of both, for the fsync after rename */
  unsigned char *buf;
  size_t used;
  uint64_t flushed;
  bool failed;
  char errmsg[ERRMSG_CAP]; /* the first failure, repeated by later calls */
};

/* ---- fault injection ------------------------------------------------------------------ */

static _Thread_local struct {
  fsdp_io_fault_point point;
  int err;
  uint64_t after;
} fault;

void fsdp_io_fault_set(fsdp_io_fault_point point, int err, uint64_t after_bytes) {
  fault.point = point;
  fault.err = err;
  fault.after = after_bytes;
}

int fsdp_io_fault_point_from_name(const char *name) {
  static const char *const names[] = {"none", "open", "write", "fsync", "rename"};
  for (int i = 0; i < (int)(sizeof names / sizeof names[0]); i++)
    if (strcmp(name, names[i]) == 0) return i;
  return -1;
}

/* true (with errno set) when the armed fault fires at this point. */
static bool fault_fires(fsdp_io_fault_point point) {
  if (fault.point != point || point == FSDP_IO_FAULT_NONE) return false;
  errno = fault.err;
  fault.point = FSDP_IO_FAULT_NONE;
  return true;
}

/* ---- helpers --------------------------------------------------------------------------- */

static int fail(fsdp_io_atomic *f, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(fsdp_io_atomic *f, const char *fmt, ...) {
  if (!f->failed) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(f->errmsg, sizeof f->errmsg, fmt, ap);
    va_end(ap);
    f->failed = true;
  }
  return fsdp_error("%s", f->errmsg);
}

/* write all of data at offset, retrying short writes and EINTR; the WRITE fault fires when the
 * file would grow past its threshold. Returns 0 or -1 with errno. */
static int pwrite_all(int fd, const unsigned char *data, size_t n, uint64_t off) {
  while (n > 0) {
    size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
    if (fault.point == FSDP_IO_FAULT_WRITE && off + chunk > fault.after) {
      if (off < fault.after) chunk = (size_t)(fault.after - off); /* the bytes before the fault */
      else if (fault_fires(FSDP_IO_FAULT_WRITE)) return -1;
    }
    ssize_t w = pwrite(fd, data, chunk, (off_t)off);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (w == 0) { /* no progress and no error: treat as a full device */
      errno = ENOSPC;
      return -1;
    }
    data += w;
    n -= (size_t)w;
    off += (uint64_t)w;
  }
  return 0;
}

static int flush_buf(fsdp_io_atomic *f) {
  if (f->used == 0) return FSDP_OK;
  if (pwrite_all(f->fd, f->buf, f->used, f->flushed) != 0)
    return fail(f, "%s: write failed at byte %llu: %s", f->path,
                (unsigned long long)f->flushed, strerror(errno));
  f->flushed += f->used;
  f->used = 0;
  return FSDP_OK;
}

static void free_handle(fsdp_io_atomic *f) {
  if (f->fd >= 0) close(f->fd);
  free(f->path);
  free(f->tmp);
  free(f->dir);
  free(f->buf);
  free(f);
}

/* ---- temporaries ------------------------------------------------------------------------ */

#define HOST_TAG_MAX 40

/* This machine's name as it goes into temporaries: letters, digits and '-' (anything else
 * becomes '-', so the name has no dot), at most HOST_TAG_MAX bytes. */
static void host_tag(char out[HOST_TAG_MAX + 1]) {
  char name[256] = {0};
  if (gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') strcpy(name, "host");
  size_t n = 0;
  for (; name[n] && n < HOST_TAG_MAX; n++) {
    char c = name[n];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
    out[n] = ok ? c : '-';
  }
  out[n] = '\0';
}

/* The digits that end s[0, *end), moved past: their value, or -1 when there are none (or too
 * many for a pid). *end then points at the character before them. */
static long trailing_number(const char *s, size_t *end) {
  size_t e = *end, b = e;
  while (b > 0 && s[b - 1] >= '0' && s[b - 1] <= '9') b--;
  if (b == e || e - b > 9) return -1;
  long v = 0;
  for (size_t i = b; i < e; i++) v = v * 10 + (s[i] - '0');
  *end = b;
  return v;
}

/* The pid in a temporary's name (".<name>.tmp.<host>.<pid>.<tid>") when it was made on this
 * host, else -1. Names from before hosts were recorded (".<name>.tmp.<pid>.<tid>") count as
 * this host's. */
static long temp_pid_here(const char *name, const char *host) {
  size_t end = strlen(name);
  if (name[0] != '.' || trailing_number(name, &end) < 0 || end == 0 || name[--end] != '.')
    return -1;
  long pid = trailing_number(name, &end);
  if (pid <= 0 || end == 0 || name[--end] != '.') return -1;
  size_t hl = strlen(host);
  if (end >= 4 && strncmp(name + end - 4, ".tmp", 4) == 0 && end > 4) return pid; /* no host */
  if (end < hl + 6 || strncmp(name + end - hl, host, hl) != 0) return -1;
  end -= hl;
  return end > 5 && strncmp(name + end - 5, ".tmp.", 5) == 0 ? pid : -1;
}

/* Remove the temporaries in dir that processes of this host left behind when they died (killed
 * during a save). Those of live processes (another save in progress) stay. Best effort: a
 * folder that cannot be read, or a file another process removes first, is not an error. */
static void remove_stale_temps(const char *dir, const char *host) {
  DIR *d = opendir(dir);
  if (d == NULL) return;
  int dfd = dirfd(d);
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    long pid = temp_pid_here(e->d_name, host);
    if (pid <= 0 || pid == (long)getpid()) continue;
    if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue; /* alive (or not ours to ask) */
    unlinkat(dfd, e->d_name, 0);
  }
  closedir(d);
}

/* ---- the handle -------------------------------------------------------------------------- */

int fsdp_io_atomic_open(fsdp_io_atomic **out, const char *path) {
  *out = NULL;
  if (path == NULL || path[0] == '\0') return fsdp_error("atomic file: empty path");
  size_t len = strlen(path);
  if (path[len - 1] == '/') return fsdp_error("%s: is a folder name, not a file name", path);
  fsdp_io_atomic *f = calloc(1, sizeof *f);
  if (f == NULL) return fsdp_error("%s: out of memory", path);
  f->fd = -1;
  const char *slash = strrchr(path, '/');
  const char *base = slash != NULL ? slash + 1 : path;
  int dirlen = slash != NULL ? (int)(slash - path) : 0;
  long tid = (long)gettid();
  char host[HOST_TAG_MAX + 1];
  host_tag(host);
  f->path = strdup(path);
  f->dir = slash == NULL ? strdup(".") : dirlen == 0 ? strdup("/") : strndup(path, (size_t)dirlen);
  long pid = (long)getpid();
  f->tmp = slash != NULL
               ? fsdp_strdup_printf("%.*s/.%s.tmp.%s.%ld.%ld", dirlen, path, base, host, pid, tid)
               : fsdp_strdup_printf(".%s.tmp.%s.%ld.%ld", base, host, pid, tid);
  f->buf = malloc(ATOMIC_BUF_BYTES);
  if (f->path == NULL || f->dir == NULL || f->tmp == NULL || f->buf == NULL) {
    free_handle(f);
    return fsdp_error("%s: out of memory", path);
  }
  /* ".", ".tmp.", the host, two dots and two numbers of up to 10 digits */
  const size_t extra = 28 + HOST_TAG_MAX;
  if (strlen(base) + extra > NAME_MAX) {
    int rc = fsdp_error("%s: file name too long for its temporary (%zu bytes; at most %zu)", path,
                        strlen(base), (size_t)NAME_MAX - extra);
    free_handle(f);
    return rc;
  }
  remove_stale_temps(f->dir, host);
  for (int attempt = 0; attempt < 2; attempt++) {
    if (fault_fires(FSDP_IO_FAULT_OPEN)) break;
    f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (f->fd >= 0 || errno != EEXIST) break;
    /* our pid and tid: a leftover of a dead process, or of this thread (one writer per path) */
    if (unlink(f->tmp) != 0) break;
  }
  if (f->fd < 0) {
    int e = errno;
    int rc = fsdp_error("%s: cannot create %s in %s: %s", path, f->tmp, f->dir, strerror(e));
    free_handle(f);
    return rc;
  }
  *out = f;
  return FSDP_OK;
}

int fsdp_io_atomic_write(fsdp_io_atomic *f, const void *data, size_t bytes) {
  if (f->failed) return fsdp_error("%s", f->errmsg);
  if (bytes == 0) return FSDP_OK;
  const unsigned char *p = data;
  if (bytes < ATOMIC_BUF_BYTES && f->used + bytes <= ATOMIC_BUF_BYTES) {
    memcpy(f->buf + f->used, p, bytes);
    f->used += bytes;
    return FSDP_OK;
  }
  if (flush_buf(f)) return FSDP_ERR;
  if (bytes < ATOMIC_BUF_BYTES) {
    memcpy(f->buf, p, bytes);
    f->used = bytes;
    return FSDP_OK;
  }
  if (pwrite_all(f->fd, p, bytes, f->flushed) != 0)
    return fail(f, "%s: write failed at byte %llu: %s", f->path,
                (unsigned long long)f->flushed, strerror(errno));
  f->flushed += bytes;
  return FSDP_OK;
}

int fsdp_io_atomic_pwrite(fsdp_io_atomic *f, const void *data, size_t bytes, uint64_t offset) {
  if (f->failed) return fsdp_error("%s", f->errmsg);
  uint64_t size = f->flushed + f->used;
  if (offset > size || bytes > size - offset)
    return fsdp_error("%s: patch of bytes [%llu, %llu) lies past the %llu bytes written", f->path,
                      (unsigned long long)offset, (unsigned long long)(offset + bytes),
                      (unsigned long long)size);
  const unsigned char *p = data;
  /* the part already on disk, then the part still in the buffer */
  if (offset < f->flushed) {
    size_t n = (size_t)(f->flushed - offset) < bytes ? (size_t)(f->flushed - offset) : bytes;
    if (pwrite_all(f->fd, p, n, offset) != 0)
      return fail(f, "%s: write failed at byte %llu: %s", f->path, (unsigned long long)offset,
                  strerror(errno));
    p += n;
    offset += n;
    bytes -= n;
  }
  if (bytes > 0) memcpy(f->buf + (offset - f->flushed), p, bytes);
  return FSDP_OK;
}

uint64_t fsdp_io_atomic_size(const fsdp_io_atomic *f) { return f->flushed + f->used; }
const char *fsdp_io_atomic_path(const fsdp_io_atomic *f) { return f->path; }
const char *fsdp_io_atomic_temp_path(const fsdp_io_atomic *f) { return f->tmp; }

void fsdp_io_atomic_abort(fsdp_io_atomic *f) {
  if (f == NULL) return;
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  unlink(f->tmp); /* may already be gone; nothing useful to report */
  free_handle(f);
}

int fsdp_io_atomic_commit(fsdp_io_atomic *f) {
  int rc = FSDP_OK;
  if (f->failed) {
    fsdp_error("%s", f->errmsg);
    goto failed;
  }
  if (flush_buf(f)) goto failed;
  if (fault_fires(FSDP_IO_FAULT_FSYNC) || fsync(f->fd) != 0) {
    fail(f, "%s: fsync of %s failed: %s", f->path, f->tmp, strerror(errno));
    goto failed;
  }
  int fd = f->fd;
  f->fd = -1;
  if (close(fd) != 0) { /* NFS and others report delayed write errors here */
    fail(f, "%s: close of %s failed: %s", f->path, f->tmp, strerror(errno));
    goto failed;
  }
  if (fault_fires(FSDP_IO_FAULT_RENAME) || rename(f->tmp, f->path) != 0) {
    fail(f, "%s: cannot rename %s over it: %s", f->path, f->tmp, strerror(errno));
    goto failed;
  }
  /* The new file is in place; make the rename durable. A failure here cannot be undone (the
   * old file is gone), so it is reported as such. */
  int dfd = open(f->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || fsync(dfd) != 0) {
    int e = errno;
    rc = fsdp_error("%s: written and renamed, but fsync of its folder %s failed: %s", f->path,
                    f->dir, strerror(e));
  }
  if (dfd >= 0) close(dfd);
  free_handle(f);
  return rc;
failed:
  fsdp_io_atomic_abort(f);
  return FSDP_ERR;
}
