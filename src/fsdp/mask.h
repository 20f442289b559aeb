/*
 * mask.h — masks and magnitude pruning on one rank's views of parameters (docs/pruning.md):
 * the per-element operations lua/fsdp/mask.lua and prune.lua build on, and the selection of
 * the k smallest elements of a group of views spread over ranks, without gathering them.
 *
 * Every function takes 1-D contiguous views (a parameter flattened, or a slice of a unit's
 * flat shard) that share one device and one dtype, and computes through that device's kernel
 * table (kernels/kernels.h, "masks"), which refuses the dtypes it lacks (the cpu computes masks
 * in f32). A view with no elements needs no data: the results are 0 or nothing. Errors name
 * the function and the argument, counted from 1 in the order the parameters are written here
 * ("mask_select: argument #2 is on the cpu2 device, argument #1 on cpu").
 *
 * Pruning order. Magnitude pruning removes the k elements with the smallest keys, where an
 * element's key is a 32-bit unsigned integer:
 *     key = 0                                  when a mask is given and masks it (m == 0)
 *     key = (bits of |x| as a float) + 1       otherwise
 * Non-negative floats order like their bit patterns, so keys order like magnitudes, with masked
 * elements below every live one (a weight already pruned stays pruned first; a NaN sorts above
 * +inf). Equal keys are ordered by the element's global position (gbase + i: gbase is the
 * position of the view's first element in its group, 0-based; positions never depend on how
 * the model is sharded). So the selection is a total order, the same at any world size.
 *
 * N:M along a row: fsdp_mask_nm keeps the n largest of each group of m consecutive elements, by
 * the value v = -1 for a masked element, +inf for a NaN, |x| otherwise; among equal values the
 * lower index is pruned first (the order of magnitude pruning: by value, then position).
 */
#ifndef FSDP_MASK_H
#define FSDP_MASK_H

#include <stdbool.h>
#include <stdint.h>

#include "comm/comm.h"
#include "core/core.h"

/* x[i] = +0 where m[i] == 0 (other elements keep their bits). Bumps x->version. */
int fsdp_mask_apply(fsdp_tensor *x, const fsdp_tensor *m);
/* *zeros = the elements of x equal to 0 (+0 or -0). */
int fsdp_mask_count_zeros(const fsdp_tensor *x, int64_t *zeros);
/* *bad = elements of m other than 0 and 1, *zeros = elements equal to 0, *hash = a 32-bit
 * FNV-1a of the zero positions (ranks compare it). */
int fsdp_mask_check(const fsdp_tensor *m, int64_t *bad, int64_t *zeros, uint32_t *hash);
/* mout[i] = (x[i] != 0); *zeros = the elements of x equal to 0. Bumps mout->version. */
int fsdp_mask_from_nonzero(fsdp_tensor *mout, const fsdp_tensor *x, int64_t *zeros);
/* mout[i] = 0 when key < T, or key == T and gbase + i < P; else 1 (m may be NULL: no mask;
 * mout may be m itself: element i is read before it is written). *pruned = the zeros written.
 * Bumps mout->version. */
int fsdp_mask_select(fsdp_tensor *mout, const fsdp_tensor *x, const fsdp_tensor *m, uint32_t T,
                     uint64_t gbase, uint64_t P, int64_t *pruned);
/* N:M: over each full group of M elements starting at index lead (0-based; 0 <= keep <= M <=
 * 4096), mout = 1 for the keep largest values, 0 for the rest; elements before lead and a
 * trailing partial group are left as they are. *groups = the full groups. mout may be m. */
int fsdp_mask_nm(fsdp_tensor *mout, const fsdp_tensor *x, const fsdp_tensor *m, int64_t keep,
                 int64_t M, int64_t lead, int64_t *groups);
/* out[i] = the N:M value of element i (for groups a shard boundary cuts: the caller gathers
 * them). Bumps out->version. */
int fsdp_mask_values(fsdp_tensor *out, const fsdp_tensor *x, const fsdp_tensor *m);

/* ---- selection ---------------------------------------------------------------------------- */

/* A view of weights this rank holds, in a group. */
typedef struct fsdp_prune_piece {
  const fsdp_tensor *x; /* 1-D contiguous weights */
  const fsdp_tensor *m; /* their current mask (same length), or NULL */
  uint64_t gbase;       /* the position of x's first element in the group */
  bool counts;          /* false when another rank counts the same elements (a replicated
                         * unit: only rank 0 counts) */
} fsdp_prune_piece;

/* A set of elements to select from: the pieces this rank holds (none is fine) and k, the same
 * on every rank. The selection writes T and P: the k smallest elements of the group (by key,
 * then position) are those with key < T, or key == T and position < P; what fsdp_mask_select
 * takes. k == 0 gives T = P = 0 (nothing). */
typedef struct fsdp_prune_group {
  const fsdp_prune_piece *pieces;
  int npieces;
  int64_t k;
  uint32_t T; /* out */
  uint64_t P; /* out */
} fsdp_prune_group;

/* Find T and P of every group, all groups in lockstep: radix selection over histograms of the
 * keys (three passes of 11, 11 and 10 bits), then, for a group that takes only some of the
 * elements of key T, of their positions (three passes of 11 bits: positions below 2^33).
 * Histograms are int64 counts. With comm non-NULL each pass sums the histograms of every group
 * across its ranks (one all_reduce of ngroups x 2^11 i64, labelled `label`): collective, every
 * rank calls it with the same groups and k. With comm NULL the pieces are all there is.
 * A group whose elements number fewer than k is an error naming label (k is the caller's
 * promise). */
int fsdp_prune_select(fsdp_prune_group *groups, int ngroups, fsdp_comm *comm,
                      const char *label);

#endif
