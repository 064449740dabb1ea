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
#if defined(__AVX2__) || defined(__AVX512F__)
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

#if defined(__AVX512F__)
#define LGH_W 16
#define VF __m512
#define V_LOAD _mm512_loadu_ps
#define V_SET1 _mm512_set1_ps
#define V_MUL _mm512_mul_ps
#define V_ADD _mm512_add_ps
#define V_SUB _mm512_sub_ps
#define V_DIV _mm512_div_ps
#define V_SQRT _mm512_sqrt_ps
#define V_FMA _mm512_fmadd_ps
#define V_STREAM _mm512_stream_ps
#define V_STORE _mm512_storeu_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LGH_W 8
#define VF __m256
#define V_LOAD _mm256_loadu_ps
#define V_SET1 _mm256_set1_ps
#define V_MUL _mm256_mul_ps
#define V_ADD _mm256_add_ps
#define V_SUB _mm256_sub_ps
#define V_DIV _mm256_div_ps
#define V_SQRT _mm256_sqrt_ps
#define V_FMA _mm256_fmadd_ps
#define V_STREAM _mm256_stream_ps
#define V_STORE _mm256_storeu_ps
#endif
#ifndef LGH_STREAM
#define LGH_STREAM 1
#endif

#ifdef LGH_W
/* LGH_W lanes at a time. With LGH_STREAM, streaming stores: the outputs are not read again soon, and a streaming
 * store skips reading each output cache line first, so an out-of-place update moves no more memory than an
 * in-place one. */
static void run_vec(const job_t *j) {
  const float *c = j->c;
  const VF coef = V_SET1(c[0]), wdf = V_SET1(c[1]), b2 = V_SET1(c[3]), c2 = V_SET1(c[4]), bc = V_SET1(c[5]),
           eps = V_SET1(c[6]), ns = V_SET1(c[7]);
  const VF lc = V_SET1(j->lerp_small ? c[2] : c[2] - 1.0f);
  const float *restrict gp = j->g, *restrict pp = j->p, *restrict mp = j->m, *restrict vp = j->v;
  float *restrict pop = j->po, *restrict mop = j->mo, *restrict vop = j->vo;
  const int small = j->lerp_small, mode = j->sq_mode;
  const int64_t hi = j->hi;
  const uintptr_t amask = LGH_W * sizeof(float) - 1;
  /* aligned stores: run the scalar loop up to the first element where all three outputs are aligned */
  int64_t i = j->lo;
  while (i < hi && (((uintptr_t)(pop + i)) & amask)) i++;
  if ((((uintptr_t)(mop + i)) & amask) || (((uintptr_t)(vop + i)) & amask)) { run_scalar(j, j->lo, hi); return; }
  run_scalar(j, j->lo, i);
  for (; i + LGH_W <= hi; i += LGH_W) {
    VF g = V_MUL(V_LOAD(gp + i), coef);
    VF p = V_MUL(V_LOAD(pp + i), wdf);
    VF m = V_LOAD(mp + i);
    m = V_FMA(lc, V_SUB(g, m), small ? m : g);
    VF v = V_LOAD(vp + i);
    VF cg = V_MUL(c2, g);
    if (mode == 1) v = V_FMA(v, b2, V_MUL(cg, g));
    else if (mode == 2) v = V_FMA(cg, g, V_MUL(v, b2));
    else v = V_ADD(V_MUL(v, b2), V_MUL(cg, g));
    VF den = V_ADD(V_DIV(V_SQRT(v), bc), eps);
    p = V_ADD(p, V_DIV(V_MUL(ns, m), den));
#if LGH_STREAM
    V_STREAM(pop + i, p);
    V_STREAM(mop + i, m);
    V_STREAM(vop + i, v);
#else
    V_STORE(pop + i, p);
    V_STORE(mop + i, m);
    V_STORE(vop + i, v);
#endif
  }
  run_scalar(j, i, hi);
#if LGH_STREAM
  _mm_sfence();
#endif
}
#endif

static void *job_main(void *x) {
  job_t *j = (job_t *)x;
#ifdef LGH_W
  run_vec(j);
#else
  run_scalar(j, j->lo, j->hi);
#endif
  return 0;
}

#define MAX_THREADS 256

/* A persistent pool: starting threads for every bucket (tens per step) cost ~1 ms per call on the 16-core GPU
 * machine, a fifth of a 16M-parameter bucket's update. Workers sleep on a condition variable between calls. */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t call_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_start = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static int pool_size = 0;          /* workers started (they serve job slots 1..pool_size) */
static unsigned long pool_gen = 0;  /* bumped once per call */
static int pool_pending = 0;        /* workers that have not finished this call's job */
static job_t pool_jobs[MAX_THREADS];
static unsigned long pool_born[MAX_THREADS];  /* pool_gen when each worker was started */

static void *pool_main(void *x) {
  int slot = (int)(intptr_t)x;
  pthread_mutex_lock(&pool_mu);
  unsigned long seen = pool_born[slot];  /* the call that started this worker may already have bumped pool_gen */
  for (;;) {
    while (pool_gen == seen) pthread_cond_wait(&pool_start, &pool_mu);
    seen = pool_gen;
    job_t job = pool_jobs[slot];
    pthread_mutex_unlock(&pool_mu);
    if (job.lo < job.hi) job_main(&job);
    pthread_mutex_lock(&pool_mu);
    if (--pool_pending == 0) pthread_cond_signal(&pool_done);
  }
  return 0;
}

static void pool_after_fork(void) {  /* a forked child has none of the parent's threads */
  pthread_mutex_init(&pool_mu, 0);
  pthread_mutex_init(&call_mu, 0);
  pthread_cond_init(&pool_start, 0);
  pthread_cond_init(&pool_done, 0);
  pool_size = 0;
  pool_pending = 0;
}

/* Start workers until there are `want` (called with pool_mu held). Returns how many there are. */
static int pool_grow(int want) {
  static int fork_hook = 0;
  if (!fork_hook) fork_hook = pthread_atfork(0, 0, pool_after_fork) == 0;
  while (pool_size < want) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pool_born[pool_size + 1] = pool_gen;
    int ok = pthread_create(&th, &attr, pool_main, (void *)(intptr_t)(pool_size + 1)) == 0;
    pthread_attr_destroy(&attr);
    if (!ok) break;
    pool_size++;
  }
  return pool_size;
}

/* The step over n elements, split into 64-byte-aligned chunks over nthreads threads (the caller's and the
 * pool's). Returns -1 for a bad sq_mode, else the number of chunks the pool could not take (run on the calling
 * thread instead). Calls from several threads are serialised. */
int lgh_adamw(const float *p, const float *m, const float *v, const float *g, float *po, float *mo, float *vo,
              int64_t n, const float *c, int lerp_small, int sq_mode, int nthreads) {
  if (sq_mode < 0 || sq_mode > 2) return -1;
  int64_t units = (n + 15) / 16;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads > units) nthreads = (int)units;
  if (nthreads < 1) nthreads = 1;
  int64_t per = (units + nthreads - 1) / nthreads * 16;
  job_t jobs[MAX_THREADS];
  for (int t = 0; t < nthreads; t++) {
    int64_t lo = per * t < n ? per * t : n, hi = lo + per < n ? lo + per : n;
    jobs[t] = (job_t){p, m, v, g, po, mo, vo, lo, hi, c, lerp_small, sq_mode};
  }
  if (nthreads == 1) {
    job_main(&jobs[0]);
    return 0;
  }
  pthread_mutex_lock(&call_mu);
  pthread_mutex_lock(&pool_mu);
  int workers = pool_grow(nthreads - 1);
  for (int s = 1; s <= pool_size; s++) {
    pool_jobs[s] = (s < nthreads && s <= workers) ? jobs[s] : (job_t){0};
  }
  pool_pending = pool_size;
  pool_gen++;
  pthread_cond_broadcast(&pool_start);
  pthread_mutex_unlock(&pool_mu);
  job_main(&jobs[0]);
  int missed = 0;
  for (int t = workers + 1; t < nthreads; t++) {  /* chunks no worker could take */
    job_main(&jobs[t]);
    missed++;
  }
  pthread_mutex_lock(&pool_mu);
  while (pool_pending > 0) pthread_cond_wait(&pool_done, &pool_mu);
  pthread_mutex_unlock(&pool_mu);
  pthread_mutex_unlock(&call_mu);
  return missed;
}
