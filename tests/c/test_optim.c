/*
 * test_optim.c — below the binding: optimizer updates and sums of squares (src/fsdp/optim.h)
 * against PyTorch's formulas computed here in double, the versions they bump, every check on
 * their buffers; parameters made in place and filled from their streams (src/fsdp/param.h):
 * a slice filled from `first` equals that slice of a whole fill, meta is left as it is.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "fsdp/optim.h"
#include "fsdp/param.h"

#define SHAPE(...) ((const int64_t[]){__VA_ARGS__})
#define NP 37

static fsdp_tensor *vec(int64_t n, uint64_t seed) {
  fsdp_tensor *t;
  if (fsdp_tensor_new_f32(&t, 1, SHAPE(n))) return NULL;
  if (seed) fsdp_rng_normal(fsdp_tensor_data(t, "test"), n, fsdp_rng_key(seed, "v"), 0, 0, 1);
  return t;
}
static float *F(fsdp_tensor *t) { return fsdp_tensor_data(t, "test"); }

static void assert_msg_has(const char *want) {
  if (!strstr(fsdp_error_msg(), want))
    fail_msg("error message \"%s\" lacks \"%s\"", fsdp_error_msg(), want);
}

static void assert_near(const float *got, const double *want, int n, const char *what) {
  for (int i = 0; i < n; i++)
    if (fabs(got[i] - want[i]) > 1e-5 * (1 + fabs(want[i])))
      fail_msg("%s: element %d is %.9g, want %.9g", what, i, (double)got[i], want[i]);
}

/* torch.optim.SGD (dampening 0, no nesterov), three steps with momentum and weight decay */
static void test_sgd(void **state) {
  (void)state;
  fsdp_tensor *p = vec(NP, 1), *g = vec(NP, 2), *buf = vec(NP, 0);
  double rp[NP], rb[NP];
  const double lr = 0.1, mom = 0.9, wd = 0.01;
  for (int i = 0; i < NP; i++) rp[i] = F(p)[i];
  for (int s = 1; s <= 3; s++) {
    uint64_t vp = p->version, vb = buf->version, vg = g->version;
    assert_int_equal(fsdp_optim_sgd_step(p, g, buf, (float)lr, (float)mom, (float)wd, s == 1),
                     FSDP_OK);
    assert_true(p->version > vp && buf->version > vb && g->version == vg);
    for (int i = 0; i < NP; i++) {
      double d = F(g)[i] + wd * rp[i];
      rb[i] = s == 1 ? d : mom * rb[i] + d;
      rp[i] -= lr * rb[i];
    }
  }
  assert_near(F(p), rp, NP, "sgd parameter");
  assert_near(F(buf), rb, NP, "sgd momentum buffer");
  /* without momentum no buffer is needed */
  for (int i = 0; i < NP; i++) rp[i] = F(p)[i] - lr * F(g)[i];
  assert_int_equal(fsdp_optim_sgd_step(p, g, NULL, (float)lr, 0, 0, false), FSDP_OK);
  assert_near(F(p), rp, NP, "plain sgd");
  fsdp_tensor_release(p), fsdp_tensor_release(g), fsdp_tensor_release(buf);
}

/* torch.optim.AdamW, three steps */
static void test_adamw(void **state) {
  (void)state;
  fsdp_tensor *p = vec(NP, 3), *g = vec(NP, 4), *m = vec(NP, 0), *v = vec(NP, 0);
  double rp[NP], rm[NP] = {0}, rv[NP] = {0};
  const double lr = 1e-2, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.1;
  for (int i = 0; i < NP; i++) rp[i] = F(p)[i];
  for (int s = 1; s <= 3; s++) {
    uint64_t vm = m->version, vv = v->version;
    assert_int_equal(fsdp_optim_adamw_step(p, g, m, v, NULL, (float)lr, (float)b1, (float)b2,
                                           (float)eps, (float)wd, 1.0f, s),
                     FSDP_OK);
    assert_true(m->version > vm && v->version > vv);
    for (int i = 0; i < NP; i++) {
      double gi = F(g)[i];
      rp[i] *= 1 - lr * wd;
      rm[i] = b1 * rm[i] + (1 - b1) * gi;
      rv[i] = b2 * rv[i] + (1 - b2) * gi * gi;
      double mh = rm[i] / (1 - pow(b1, s)), vh = sqrt(rv[i]) / sqrt(1 - pow(b2, s));
      rp[i] -= lr * mh / (vh + eps);
    }
  }
  assert_near(F(p), rp, NP, "adamw parameter");
  assert_near(F(m), rm, NP, "adamw first moment");
  fsdp_tensor_release(p), fsdp_tensor_release(g), fsdp_tensor_release(m), fsdp_tensor_release(v);
}

static void test_update_errors(void **state) {
  (void)state;
  fsdp_tensor *p = vec(4, 1), *g3 = vec(3, 2), *g = vec(4, 2), *m = vec(4, 0), *v, *tr, *d;
  assert_int_equal(fsdp_optim_sgd_step(p, g3, NULL, 0.1f, 0, 0, false), FSDP_ERR);
  assert_msg_has("sgd_step: gradient has 3 elements, the parameter has 4");
  assert_int_equal(fsdp_optim_sgd_step(p, g, NULL, 0.1f, 0.9f, 0, false), FSDP_ERR);
  assert_msg_has("sgd_step: momentum 0.9 needs a buffer");
  assert_int_equal(fsdp_optim_adamw_step(p, g, m, g3, NULL, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 1.0f, 1),
                   FSDP_ERR);
  assert_msg_has("adamw_step: second moment has 3 elements, the parameter has 4");
  assert_int_equal(fsdp_optim_adamw_step(p, g, m, m, g3, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 1.0f, 1),
                   FSDP_ERR);
  assert_msg_has("adamw_step: mask has 3 elements, the parameter has 4");
  assert_int_equal(fsdp_optim_adamw_step(p, g, m, m, NULL, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 1.0f, 0),
                   FSDP_ERR);
  assert_msg_has("adamw_step: step must be an integer >= 1");
  const float bad_scales[] = {-0.5f, NAN, INFINITY};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(fsdp_optim_adamw_step(p, g, m, m, NULL, 0.1f, 0.9f, 0.99f, 1e-8f, 0,
                                           bad_scales[i], 1),
                     FSDP_ERR);
    assert_msg_has("adamw_step: grad_scale must be a finite number >= 0");
  }
  assert_int_equal(fsdp_tensor_view(&v, m, 2, SHAPE(2, 2)), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&tr, v, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_optim_sgd_step(p, g, tr, 0.1f, 0.9f, 0, true), FSDP_ERR);
  assert_msg_has("sgd_step: momentum buffer must be contiguous");
  assert_int_equal(fsdp_tensor_new(&d, &fsdp_device_cpu, FSDP_DTYPE_F64, 1, SHAPE(4),
                                   FSDP_ROLE_ACTIVATIONS),
                   FSDP_OK);
  assert_int_equal(fsdp_optim_adamw_step(p, g, d, m, NULL, 0.1f, 0.9f, 0.99f, 1e-8f, 0, 1.0f, 1),
                   FSDP_ERR);
  assert_msg_has("adamw_step: first moment is f64, the parameter f32");
  /* the kernels decide the dtypes they update */
  assert_int_equal(fsdp_optim_sgd_step(d, d, NULL, 0.1f, 0, 0, false), FSDP_ERR);
  assert_msg_has("sgd_step");
  fsdp_tensor_release(p), fsdp_tensor_release(g3), fsdp_tensor_release(g);
  fsdp_tensor_release(m), fsdp_tensor_release(v), fsdp_tensor_release(tr);
  fsdp_tensor_release(d);
}

static void test_sumsq(void **state) {
  (void)state;
  fsdp_tensor *t = vec(12, 5), *v, *tr;
  double want = 0, got;
  for (int i = 0; i < 12; i++) want += (double)F(t)[i] * F(t)[i];
  assert_int_equal(fsdp_optim_sumsq(t, &got), FSDP_OK);
  assert_true(fabs(got - want) <= 1e-12 * want);
  /* a strided view sums the same elements */
  assert_int_equal(fsdp_tensor_view(&v, t, 2, SHAPE(3, 4)), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&tr, v, 0, 1), FSDP_OK);
  double gs;
  assert_int_equal(fsdp_optim_sumsq(tr, &gs), FSDP_OK);
  assert_true(fabs(gs - want) <= 1e-12 * want);
  /* no data: an error naming sumsq */
  fsdp_tensor *meta;
  assert_int_equal(fsdp_tensor_new(&meta, &fsdp_device_meta, FSDP_DTYPE_F32, 1, SHAPE(3),
                                   FSDP_ROLE_PARAMS),
                   FSDP_OK);
  assert_int_equal(fsdp_optim_sumsq(meta, &gs), FSDP_ERR);
  assert_msg_has("sumsq");
  fsdp_tensor_release(t), fsdp_tensor_release(v), fsdp_tensor_release(tr);
  fsdp_tensor_release(meta);
}

/* ---- parameters ----------------------------------------------------------------------------- */

static void test_param_make(void **state) {
  (void)state;
  fsdp_tensor *t = vec(6, 7), *v, *tr;
  float first = F(t)[1]; /* element (0, 1) of the view below, (1, 0) of its transpose */
  assert_int_equal(fsdp_tensor_view(&v, t, 2, SHAPE(2, 3)), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&tr, v, 0, 1), FSDP_OK);
  fsdp_tensor *obj = tr;
  assert_int_equal(fsdp_param_make(tr), FSDP_OK);
  /* the same object, now dense in a params storage of its own */
  assert_ptr_equal(obj, tr);
  assert_true(tr->is_param && tr->requires_grad);
  assert_int_equal(tr->storage->role, FSDP_ROLE_PARAMS);
  assert_true(fsdp_tensor_is_contiguous(tr) && tr->storage != t->storage);
  assert_true(F(tr)[1 * 2 + 0] == first);
  fsdp_storage *s = tr->storage;
  assert_int_equal(fsdp_param_make(tr), FSDP_OK); /* already one: nothing moves */
  assert_ptr_equal(tr->storage, s);
  t->is_leaf = false; /* as an op's result is */
  assert_int_equal(fsdp_param_make(t), FSDP_ERR);
  assert_msg_has("Parameter: tensor (6) was computed by a recorded op; pass a leaf");
  t->is_leaf = true;
  fsdp_tensor_release(t), fsdp_tensor_release(v), fsdp_tensor_release(tr);
}

static void test_param_init(void **state) {
  (void)state;
  fsdp_tensor *whole = vec(20, 0), *part = vec(8, 0), *meta, *v, *tr;
  const uint64_t seed = 11;
  for (int normal = 0; normal < 2; normal++) {
    uint64_t v0 = whole->version;
    assert_int_equal(fsdp_param_init_random(whole, "init", seed, "blocks.0.w", normal, 0.5, 2, 0),
                     FSDP_OK);
    assert_true(whole->version > v0);
    assert_int_equal(fsdp_param_init_random(part, "init", seed, "blocks.0.w", normal, 0.5, 2, 9),
                     FSDP_OK);
    assert_memory_equal(F(part), F(whole) + 9, 8 * sizeof(float));
    if (!normal)
      for (int i = 0; i < 20; i++) assert_true(F(whole)[i] >= 0.5f && F(whole)[i] < 2.0f);
  }
  /* another path is another stream */
  assert_int_equal(fsdp_param_init_random(part, "init", seed, "blocks.1.w", true, 0, 1, 9),
                   FSDP_OK);
  assert_memory_not_equal(F(part), F(whole) + 9, 8 * sizeof(float));
  /* meta: nothing to fill */
  assert_int_equal(fsdp_tensor_new(&meta, &fsdp_device_meta, FSDP_DTYPE_F32, 1, SHAPE(3),
                                   FSDP_ROLE_PARAMS),
                   FSDP_OK);
  assert_int_equal(fsdp_param_init_random(meta, "init", seed, "w", true, 0, 1, 0), FSDP_OK);
  assert_int_equal(fsdp_tensor_view(&v, whole, 2, SHAPE(4, 5)), FSDP_OK);
  assert_int_equal(fsdp_tensor_transpose(&tr, v, 0, 1), FSDP_OK);
  assert_int_equal(fsdp_param_init_random(tr, "init_normal", seed, "w", true, 0, 1, 0), FSDP_ERR);
  assert_msg_has("init_normal: needs a contiguous tensor, got a strided view (5, 4)");
  fsdp_tensor_release(whole), fsdp_tensor_release(part), fsdp_tensor_release(meta);
  fsdp_tensor_release(v), fsdp_tensor_release(tr);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_sgd),         cmocka_unit_test(test_adamw),
      cmocka_unit_test(test_update_errors), cmocka_unit_test(test_sumsq),
      cmocka_unit_test(test_param_make),  cmocka_unit_test(test_param_init)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
