/*
 * registry.c — which devices this build has, and the lookup of a device's kernel table.
 *
 * Each device folder under src/kernels/ has one registration function; register_all lists
 * them, one line each. That line (plus the folder) is all a new device adds: autograd, the FSDP
 * units and the Lua library find its kernels through fsdp_kernels_of.
 */
#include <pthread.h>
#include <stdio.h>

#include "kernels/cpu/kernels.h"
#include "kernels/kernels.h"

static pthread_once_t once = PTHREAD_ONCE_INIT;

int fsdp_cuda_register(void); /* src/kernels/cuda (or cuda_stub.c without CUDA) */

static void register_all(void) {
  /* cannot fail: the cpu is already in the registry, this only attaches its kernels */
  (void)fsdp_cpu_register();
  /* a machine without a GPU registers nothing; a failure leaves "cuda" unknown */
  (void)fsdp_cuda_register();
}

void fsdp_kernels_init(void) { pthread_once(&once, register_all); }

const fsdp_kernels_i *fsdp_kernels_of(const fsdp_device_i *dev, const char *what) {
  fsdp_kernels_init();
  const fsdp_kernels_i *k = dev ? __atomic_load_n(&dev->kernels, __ATOMIC_ACQUIRE) : NULL;
  if (!k)
    fsdp_error("%s: no kernels on the %s device", what ? what : "kernel",
               dev ? dev->name : "(null)");
  return k;
}

static bool deterministic;

bool fsdp_kernels_set_deterministic(bool on) {
  fsdp_kernels_init();
  bool prev = __atomic_exchange_n(&deterministic, on, __ATOMIC_ACQ_REL);
  for (int i = 0; i < fsdp_device_count(); i++) {
    const fsdp_device_i *d = fsdp_device_at(i);
    const fsdp_kernels_i *k = __atomic_load_n(&d->kernels, __ATOMIC_ACQUIRE);
    if (k && k->set_deterministic) k->set_deterministic(d->ctx, on);
  }
  return prev;
}

bool fsdp_kernels_deterministic(void) { return __atomic_load_n(&deterministic, __ATOMIC_ACQUIRE); }

int fsdp_kernels_refuse(const char *op, fsdp_dtype dt, const char *device) {
  return fsdp_error("op %s has no kernel for %s on %s", op, fsdp_dtype_name(dt), device);
}

static const char *const unary_names[FSDP_UNARY_COUNT] = {
    "relu", "gelu", "exp", "log", "sqrt", "tanh", "sigmoid", "abs", "sign"};

const char *fsdp_unary_name(fsdp_unary_op op) {
  return (unsigned)op < FSDP_UNARY_COUNT ? unary_names[op] : "?";
}
