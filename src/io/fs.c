/*
 * fs.c — the few folder operations a sharded checkpoint needs (io.h): create a folder (and
 * its parents), list a folder's plain files, remove a file, fsync a folder after removals, and
 * open a regular file for reading.
 * Errors name the path, the call and strerror, like the atomic files'.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io/io.h"

int fsdp_io_mkdirs(const char *path) {
  if (path == NULL || path[0] == '\0') return fsdp_error("mkdir: empty path");
  size_t n = strlen(path);
  char *p = malloc(n + 1);
  if (p == NULL) return fsdp_error("%s: out of memory", path);
  memcpy(p, path, n + 1);
  while (n > 1 && p[n - 1] == '/') p[--n] = '\0';
  /* create each prefix in turn; existing folders are fine */
  for (size_t i = 1; i <= n; i++) {
    if (p[i] != '/' && p[i] != '\0') continue;
    char c = p[i];
    p[i] = '\0';
    if (mkdir(p, 0777) != 0 && errno != EEXIST) {
      int e = errno;
      int rc = fsdp_error("%s: cannot create folder %s: %s", path, p, strerror(e));
      free(p);
      return rc;
    }
    p[i] = c;
  }
  struct stat st;
  int rc = FSDP_OK;
  if (stat(p, &st) != 0) rc = fsdp_error("%s: cannot stat: %s", path, strerror(errno));
  else if (!S_ISDIR(st.st_mode)) rc = fsdp_error("%s: exists and is not a folder", path);
  free(p);
  return rc;
}

int fsdp_io_listdir(const char *path, char ***names, int *count) {
  *names = NULL;
  *count = 0;
  DIR *d = opendir(path);
  if (d == NULL) return fsdp_error("%s: cannot open folder: %s", path, strerror(errno));
  int cap = 16, n = 0;
  char **out = malloc(sizeof *out * (size_t)cap);
  if (out == NULL) {
    closedir(d);
    return fsdp_error("%s: out of memory", path);
  }
  struct dirent *e;
  errno = 0;
  while ((e = readdir(d)) != NULL) {
    if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
    if (n == cap) {
      cap *= 2;
      char **grown = realloc(out, sizeof *out * (size_t)cap);
      if (grown == NULL) goto oom;
      out = grown;
    }
    out[n] = strdup(e->d_name);
    if (out[n] == NULL) goto oom;
    n++;
  }
  closedir(d);
  *names = out;
  *count = n;
  return FSDP_OK;
oom:
  closedir(d);
  fsdp_io_listdir_free(out, n);
  return fsdp_error("%s: out of memory listing the folder", path);
}

void fsdp_io_listdir_free(char **names, int count) {
  for (int i = 0; i < count; i++) free(names[i]);
  free(names);
}

int fsdp_io_remove(const char *path) {
  if (unlink(path) != 0 && errno != ENOENT)
    return fsdp_error("%s: cannot remove: %s", path, strerror(errno));
  return FSDP_OK;
}

int fsdp_io_fsync_dir(const char *path) {
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return fsdp_error("%s: cannot open folder: %s", path, strerror(errno));
  int rc = FSDP_OK;
  if (fsync(fd) != 0) rc = fsdp_error("%s: fsync of the folder failed: %s", path, strerror(errno));
  close(fd);
  return rc;
}

int fsdp_io_open_regular(const char *path, int *fd, uint64_t *size) {
  *fd = open(path, O_RDONLY | O_CLOEXEC);
  if (*fd < 0) return fsdp_error("%s: cannot open: %s", path, strerror(errno));
  struct stat st;
  if (fstat(*fd, &st) != 0) {
    int e = errno;
    close(*fd);
    *fd = -1;
    return fsdp_error("%s: cannot stat: %s", path, strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    close(*fd);
    *fd = -1;
    return fsdp_error("%s: not a regular file", path);
  }
  *size = (uint64_t)st.st_size;
  return FSDP_OK;
}
