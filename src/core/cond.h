/*
 * cond.h — a condition variable whose timed waits count CLOCK_MONOTONIC, so a deadline is not
 * moved by a step of the wall clock: pass pthread_cond_timedwait an absolute time read with
 * clock_gettime(CLOCK_MONOTONIC).
 */
#ifndef FSDP_CORE_COND_H
#define FSDP_CORE_COND_H

#include <pthread.h>
#include <time.h>

static inline void fsdp_cond_init_monotonic(pthread_cond_t *cv) {
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(cv, &ca);
  pthread_condattr_destroy(&ca);
}

#endif
