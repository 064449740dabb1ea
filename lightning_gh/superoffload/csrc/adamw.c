/* lightning-gh: one AdamW step on fp32 host state, written to a second set of buffers.
 *
 * SuperOffload keeps two copies of each host bucket's master weights and moments and flips between them: a
 * speculative update writes the other copy, so undoing it is free (the old copy was never touched) instead of
 * costing a 12 B/parameter copy before every speculative update and another to restore it. The arithmetic is,
 * operation for operation, that of the vectorised loop of torch's fused CPU AdamW (torch._fused_adamw_), so the
 * results are bitwise equal to it; lightning_gh/superoffload/cpu_adamw.py checks that on the running machine
 * before using this file and falls back to torch's kernel when they differ.
 *
 * Inputs p, m, v (weights, exp_avg, exp_avg_sq) and g (gradient); outputs po, mo, vo must not overlap them.
 * c[8] = {gradient multiplier (clipping), 1 - lr * weight_decay (1 when weight_decay == 0), 1 - beta1, beta2,
 *         1 - beta2, sqrt(1 - beta2^step), eps, -lr / (1 - beta1^step)}, each rounded to fp32 as torch does.
 * sq_mode picks how the second moment's multiply-add is rounded (it depends on how torch itself was compiled):
 * 0 v*b2 + (c*g)*g, 1 fma(v, b2, (c*g)*g), 2 fma(c*g, g, v*b2). */
#include <math.h>
#include <stdint.h>
#include <pthread.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

typedef struct {
  const float *p, *m, *v, *g;
  float *po, *mo, *vo;
  int64_t lo, hi;
  const float *c;
  int lerp_small, sq_mode;
} job_t;

static inline float sq_scalar(int mode, float v, float cg, float g, float b2) {
  if (mode == 1) return fmaf(v, b2, cg * g);
  if (mode == 2) return fmaf(cg, g, v * b2);
  return v * b2 + cg * g;
}

static void run_scalar(const job_t *j, int64_t lo, int64_t hi) {
  const float *c = j->c;
  const float lc = j->lerp_small ? c[2] : c[2] - 1.0f;
  for (int64_t i = lo; i < hi; i++) {
    float gi = j->g[i] * c[0];
    float pi = j->p[i] * c[1];
    float mi = j->m[i];
    mi = fmaf(lc, gi - mi, j->lerp_small ? mi : gi);
    float vi = sq_scalar(j->sq_mode, j->v[i], c[4] * gi, gi, c[3]);
    float den = sqrtf(vi) / c[5] + c[6];
    j->po[i] = pi + c[7] * mi / den;
    j->mo[i] = mi;
    j->vo[i] = vi;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 lanes at a time with streaming stores: the outputs are not read again soon, and a streaming store skips
 * reading each output cache line first, so an out-of-place update moves no more memory than an in-place one. */
static void run_avx2(const job_t *j) {
  const float *c = j->c;
  const __m256 coef = _mm256_set1_ps(c[0]), wdf = _mm256_set1_ps(c[1]), b2 = _mm256_set1_ps(c[3]),
               c2 = _mm256_set1_ps(c[4]), bc = _mm256_set1_ps(c[5]), eps = _mm256_set1_ps(c[6]),
               ns = _mm256_set1_ps(c[7]);
  const __m256 lc = _mm256_set1_ps(j->lerp_small ? c[2] : c[2] - 1.0f);
  int64_t i = j->lo;
  const float *restrict gp = j->g, *restrict pp = j->p, *restrict mp = j->m, *restrict vp = j->v;
  float *restrict pop = j->po, *restrict mop = j->mo, *restrict vop = j->vo;
  const int small = j->lerp_small, mode = j->sq_mode; const int64_t hi = j->hi;
  /* streaming stores need 32-byte aligned addresses: run the scalar loop up to the first aligned element */
  int64_t head = i;
  while (head < j->hi && (((uintptr_t)(j->po + head)) & 31u)) head++;
  int aligned = (((uintptr_t)(j->mo + head)) & 31u) == 0 && (((uintptr_t)(j->vo + head)) & 31u) == 0;
  if (!aligned) { run_scalar(j, j->lo, j->hi); return; }
  run_scalar(j, i, head);
  i = head;
  for (; i + 8 <= hi; i += 8) {
    __m256 g = _mm256_mul_ps(_mm256_loadu_ps(gp + i), coef);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(pp + i), wdf);
    __m256 m = _mm256_loadu_ps(mp + i);
    m = _mm256_fmadd_ps(lc, _mm256_sub_ps(g, m), small ? m : g);
    __m256 v = _mm256_loadu_ps(vp + i);
    __m256 cg = _mm256_mul_ps(c2, g);
    if (mode == 1) v = _mm256_fmadd_ps(v, b2, _mm256_mul_ps(cg, g));
    else if (mode == 2) v = _mm256_fmadd_ps(cg, g, _mm256_mul_ps(v, b2));
    else v = _mm256_add_ps(_mm256_mul_ps(v, b2), _mm256_mul_ps(cg, g));
    __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(ns, m), den));
    _mm256_stream_ps(pop + i, p);
    _mm256_stream_ps(mop + i, m);
    _mm256_stream_ps(vop + i, v);
  }
  run_scalar(j, i, j->hi);
  _mm_sfence();
}
#endif

static void *job_main(void *x) {
  job_t *j = (job_t *)x;
#if defined(__AVX2__) && defined(__FMA__)
  run_avx2(j);
#else
  run_scalar(j, j->lo, j->hi);
#endif
  return 0;
}

#define MAX_THREADS 256

/* The step over n elements, split into 64-byte-aligned chunks over nthreads threads. Returns -1 for a bad
 * sq_mode, else the number of threads that could not be started (their chunks ran on the calling thread). */
int lgh_adamw(const float *p, const float *m, const float *v, const float *g, float *po, float *mo, float *vo,
              int64_t n, const float *c, int lerp_small, int sq_mode, int nthreads) {
  if (sq_mode < 0 || sq_mode > 2) return -1;
  int64_t units = (n + 15) / 16;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads > units) nthreads = (int)units;
  if (nthreads < 1) nthreads = 1;
  int64_t per = (units + nthreads - 1) / nthreads * 16;
  job_t jobs[MAX_THREADS];
  pthread_t th[MAX_THREADS];
  int started[MAX_THREADS];
  int failed = 0;
  for (int t = 0; t < nthreads; t++) {
    int64_t lo = per * t < n ? per * t : n, hi = lo + per < n ? lo + per : n;
    jobs[t] = (job_t){p, m, v, g, po, mo, vo, lo, hi, c, lerp_small, sq_mode};
    started[t] = 0;
    if (t > 0 && lo < hi) {
      started[t] = pthread_create(&th[t], 0, job_main, &jobs[t]) == 0;
      if (!started[t]) failed++;
    }
  }
  job_main(&jobs[0]);
  for (int t = 1; t < nthreads; t++) {
    if (started[t]) pthread_join(th[t], 0);
    else if (jobs[t].lo < jobs[t].hi) job_main(&jobs[t]);
  }
  return failed;
}
