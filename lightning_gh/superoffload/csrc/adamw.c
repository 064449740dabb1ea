/* lightning-gh: one AdamW step on fp32 host state, written to a second set of buffers.
 *
 * SuperOffload keeps two copies of each host bucket's master weights and moments and flips between them: a
 * speculative update writes the other copy, so undoing it is free (the old copy was never touched) instead of
 * costing a 12 B/parameter copy before every speculative update and another to restore it. The arithmetic is,
 * operation for operation, that of the vectorised loop of torch's fused CPU AdamW (torch._fused_adamw_), so the
 * results are bitwise equal to it; lightning_gh/superoffload/cpu_adamw.py checks that on the running machine
 * before using this file and falls back to torch's kernel when they differ.
 *
 * Inputs p, m, v (weights, exp_avg, exp_avg_sq) and g (gradient, fp32 or bf16); outputs po, mo, vo are either
 * the inputs themselves (an in-place step) or memory that does not overlap them. A bf16 gradient is widened to
 * fp32 exactly (its 16 bits become the high half), so the results equal those of the fp32 copy of it; reading it
 * as bf16 moves 2 B/parameter less through the host's memory, which bounds this loop.
 * c[8] = {gradient multiplier (clipping), 1 - lr * weight_decay (1 when weight_decay == 0), 1 - beta1, beta2,
 *         1 - beta2, sqrt(1 - beta2^step), eps, -lr / (1 - beta1^step)}, each rounded to fp32 as torch does.
 * sq_mode picks how the second moment's multiply-add is rounded (it depends on how torch itself was compiled):
 * 0 v*b2 + (c*g)*g, 1 fma(v, b2, (c*g)*g), 2 fma(c*g, g, v*b2).
 *
 * lgh_adamw_weights runs the same arithmetic but stores only the new weights, into wo, as fp32 or as bf16 (rounded
 * to nearest even, as torch casts a finite or infinite fp32 value; a NaN becomes a NaN): the weights the next
 * forward needs, at 16 B/parameter of memory traffic instead of 26, with the state written back by a later
 * lgh_adamw call on the same inputs (lightning_gh/superoffload/weights_first.py). */
#include <math.h>
#include <stdint.h>
#include <pthread.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
  const float *p, *m, *v;
  const void *g;
  float *po, *mo, *vo;
  void *wo;  /* lgh_adamw_weights' output (w_mode 1: fp32, 2: bf16); unused when w_mode is 0 */
  int64_t lo, hi;
  const float *c;
  int lerp_small, sq_mode, g_bf16, w_mode;
  int64_t *next; /* shared chunk counter of the call (NULL: run [lo, hi) as one piece) */
} job_t;

static inline float grad_at(const job_t *j, int64_t i) {
  if (!j->g_bf16) return ((const float *)j->g)[i];
  union { uint32_t u; float f; } x;
  x.u = (uint32_t)((const uint16_t *)j->g)[i] << 16;
  return x.f;
}

static inline float sq_scalar(int mode, float v, float cg, float g, float b2) {
  if (mode == 1) return fmaf(v, b2, cg * g);
  if (mode == 2) return fmaf(cg, g, v * b2);
  return v * b2 + cg * g;
}

static inline uint16_t bf16_rne(float f) {
  union { uint32_t u; float f; } x;
  x.f = f;
  if (f != f) return 0x7FC0;
  return (uint16_t)((x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16);
}

static void run_scalar(const job_t *j, int64_t lo, int64_t hi) {
  const float *c = j->c;
  const float lc = j->lerp_small ? c[2] : c[2] - 1.0f;
  for (int64_t i = lo; i < hi; i++) {
    float gi = grad_at(j, i) * c[0];
    float pi = j->p[i] * c[1];
    float mi = j->m[i];
    mi = fmaf(lc, gi - mi, j->lerp_small ? mi : gi);
    float vi = sq_scalar(j->sq_mode, j->v[i], c[4] * gi, gi, c[3]);
    float den = sqrtf(vi) / c[5] + c[6];
    float np = pi + c[7] * mi / den;
    if (j->w_mode == 1) {
      ((float *)j->wo)[i] = np;
    } else if (j->w_mode == 2) {
      ((uint16_t *)j->wo)[i] = bf16_rne(np);
    } else {
      j->po[i] = np;
      j->mo[i] = mi;
      j->vo[i] = vi;
    }
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
#define V_LOAD_BF16(q) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(q))), 16))
/* fp32 -> bf16, rounded to nearest even, NaN -> 0x7FC0, 16 lanes stored at q */
static inline void v_store_bf16(uint16_t *q, __m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                  _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i *)q, _mm512_cvtepi32_epi16(r));
}
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
#define V_LOAD_BF16(q) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(q))), 16))
/* fp32 -> bf16, rounded to nearest even, NaN -> 0x7FC0, 8 lanes stored at q */
static inline void v_store_bf16(uint16_t *q, __m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)),
                                  _mm256_set1_epi32(0x7FFF));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* lanes 0-3, then 4-7 */
  _mm_storeu_si128((__m128i *)q, _mm256_castsi256_si128(packed));
}
#endif
#ifndef LGH_STREAM
#define LGH_STREAM 1
#endif

#ifdef LGH_W
/* LGH_W lanes from element i up to hi (aligned outputs). Inlined with constant `gbf` (bf16 gradient) and `stream`
 * so each combination gets its own branch-free loop. Streaming stores: the outputs of an out-of-place step are
 * not read again soon, and a streaming store skips reading each output cache line first, so an out-of-place
 * update moves no more memory than an in-place one. An in-place step uses ordinary stores: its output lines are
 * already in the cache (just read), where streaming stores are slower (benchmarks/cpu_adamw_kernel.py). */
static inline __attribute__((always_inline)) int64_t vec_loop(const job_t *j, int64_t i, const int gbf,
                                                              const int stream, const int wmode) {
  const float *c = j->c;
  const VF coef = V_SET1(c[0]), wdf = V_SET1(c[1]), b2 = V_SET1(c[3]), c2 = V_SET1(c[4]), bc = V_SET1(c[5]),
           eps = V_SET1(c[6]), ns = V_SET1(c[7]);
  const VF lc = V_SET1(j->lerp_small ? c[2] : c[2] - 1.0f);
  /* no `restrict`: an in-place step passes the same memory as input and output */
  const float *gp = (const float *)j->g, *pp = j->p, *mp = j->m, *vp = j->v;
  const uint16_t *gh = (const uint16_t *)j->g;
  float *pop = j->po, *mop = j->mo, *vop = j->vo;
  const int small = j->lerp_small, mode = j->sq_mode;
  const int64_t hi = j->hi;
  for (; i + LGH_W <= hi; i += LGH_W) {
    VF g = V_MUL(gbf ? V_LOAD_BF16(gh + i) : V_LOAD(gp + i), coef);
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
    if (wmode == 1) {
      V_STORE((float *)j->wo + i, p);
    } else if (wmode == 2) {
      v_store_bf16((uint16_t *)j->wo + i, p);
    } else if (stream) {
      V_STREAM(pop + i, p);
      V_STREAM(mop + i, m);
      V_STREAM(vop + i, v);
    } else {
      V_STORE(pop + i, p);
      V_STORE(mop + i, m);
      V_STORE(vop + i, v);
    }
  }
  return i;
}

static void run_vec(const job_t *j) {
  const int64_t hi = j->hi;
  const uintptr_t amask = LGH_W * sizeof(float) - 1;
  /* aligned stores: run the scalar loop up to the first element where all three outputs are aligned */
  int64_t i = j->lo;
  if (j->w_mode) {  /* weights only: unaligned stores of one output */
    if (j->g_bf16) i = j->w_mode == 2 ? vec_loop(j, i, 1, 0, 2) : vec_loop(j, i, 1, 0, 1);
    else i = j->w_mode == 2 ? vec_loop(j, i, 0, 0, 2) : vec_loop(j, i, 0, 0, 1);
    run_scalar(j, i, hi);
    return;
  }
  while (i < hi && (((uintptr_t)(j->po + i)) & amask)) i++;
  if ((((uintptr_t)(j->mo + i)) & amask) || (((uintptr_t)(j->vo + i)) & amask)) { run_scalar(j, j->lo, hi); return; }
  run_scalar(j, j->lo, i);
  const int stream = LGH_STREAM && j->po != j->p;
  if (j->g_bf16) i = stream ? vec_loop(j, i, 1, 1, 0) : vec_loop(j, i, 1, 0, 0);
  else i = stream ? vec_loop(j, i, 0, 1, 0) : vec_loop(j, i, 0, 0, 0);
  run_scalar(j, i, hi);
  if (stream) _mm_sfence();
}
#endif

static void run_piece(const job_t *j) {
#ifdef LGH_W
  run_vec(j);
#else
  run_scalar(j, j->lo, j->hi);
#endif
}

/* Elements per chunk a thread takes at a time (a multiple of 16, so chunks start 64-byte aligned). */
#define CHUNK (1 << 15)

/* Threads take chunks from a shared counter instead of a fixed share each: during training the update shares
 * the cores with the training loop's and the CUDA driver's threads, and with fixed shares one descheduled thread
 * held up the whole call. */
static void *job_main(void *x) {
  const job_t *j = (const job_t *)x;
  if (!j->next) {
    run_piece(j);
    return 0;
  }
  for (;;) {
    int64_t lo = __atomic_fetch_add(j->next, CHUNK, __ATOMIC_RELAXED);
    if (lo >= j->hi) return 0;
    job_t piece = *j;
    piece.lo = lo;
    piece.hi = lo + CHUNK < j->hi ? lo + CHUNK : j->hi;
    run_piece(&piece);
  }
}

#define MAX_THREADS 256

/* A persistent pool: starting threads for every bucket (tens per step) would cost a sizeable share of a bucket's
 * update. Workers sleep on a condition variable between calls. */
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

/* The step over n elements on nthreads threads (the caller's and the pool's), which take CHUNK-element pieces in
 * turn. g is fp32, or bf16 when g_bf16. Returns -1 for a bad sq_mode, else the number of threads the pool lacked
 * (the others then did their share). Calls from several threads are serialised. */
static int run_job(job_t job, int nthreads) {
  const int64_t n = job.hi;
  int64_t chunks = (n + CHUNK - 1) / CHUNK;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads > chunks) nthreads = (int)chunks;
  if (nthreads < 1) nthreads = 1;
  if (nthreads == 1) {
    run_piece(&job);
    return 0;
  }
  int64_t next = 0;
  job.next = &next;
  pthread_mutex_lock(&call_mu);
  pthread_mutex_lock(&pool_mu);
  int workers = pool_grow(nthreads - 1);
  for (int s = 1; s <= pool_size; s++) {
    pool_jobs[s] = (s < nthreads && s <= workers) ? job : (job_t){0};
  }
  pool_pending = pool_size;
  pool_gen++;
  pthread_cond_broadcast(&pool_start);
  pthread_mutex_unlock(&pool_mu);
  job_main(&job);
  pthread_mutex_lock(&pool_mu);
  while (pool_pending > 0) pthread_cond_wait(&pool_done, &pool_mu);
  pthread_mutex_unlock(&pool_mu);
  pthread_mutex_unlock(&call_mu);
  return nthreads - 1 - (workers < nthreads - 1 ? workers : nthreads - 1);
}

int lgh_adamw(const float *p, const float *m, const float *v, const void *g, float *po, float *mo, float *vo,
              int64_t n, const float *c, int lerp_small, int sq_mode, int nthreads, int g_bf16) {
  if (sq_mode < 0 || sq_mode > 2) return -1;
  job_t job = {p, m, v, g, po, mo, vo, 0, 0, n, c, lerp_small, sq_mode, g_bf16 != 0, 0, 0};
  return run_job(job, nthreads);
}

/* The same step's new weights only, into wo: fp32 (w_bf16 == 0) or bf16. Nothing else is written. */
int lgh_adamw_weights(const float *p, const float *m, const float *v, const void *g, void *wo, int64_t n,
                      const float *c, int lerp_small, int sq_mode, int nthreads, int g_bf16, int w_bf16) {
  if (sq_mode < 0 || sq_mode > 2) return -1;
  job_t job = {p, m, v, g, 0, 0, 0, wo, 0, n, c, lerp_small, sq_mode, g_bf16 != 0, w_bf16 ? 2 : 1, 0};
  return run_job(job, nthreads);
}
