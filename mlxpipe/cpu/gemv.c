/* A cblas_sgemm for mlx's CPU backend that sends one-row and one-column products to cblas_sgemv.
 *
 * mlx computes every float32 matrix product with cblas_sgemm, also x @ W.T for a single token (M = 1),
 * which is all a one-stream decode step does. OpenBLAS's sgemm packs the whole weight matrix for that and
 * reads it less than half as fast as its sgemv does (bench/RESULTS.md). mlxpipe.cpu.gemv compiles this file, calls mlxpipe_gemv_init with the BLAS's own
 * functions, and puts this library before the BLAS in the global symbol scope, so that libmlx's
 * cblas_sgemm binds here. Everything that is not one row or one column goes to the BLAS's sgemm unchanged,
 * and so do small matrices (attention's per-head products at --batch), where sgemm was as fast or faster.
 *
 * A weight matrix can also be registered with its quantized form (mlx's affine 4- or 8-bit layout, the one
 * a GGUF loads as): a one-row product by that matrix then reads the quantized bytes instead of the float32
 * ones, 5-8x fewer, and computes the same sums (scale * q + bias, summed in another order).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86_AVX512 1
#endif
enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 };
enum { MIN_ELEMENTS = 32768 }; /* the smallest matrix worth sgemv: 128 KB of float32 */

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int, float,
                         float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *, int);

static sgemm_fn blas_sgemm;
static sgemv_fn blas_sgemv;

int mlxpipe_gemv_init(void *sgemm, void *sgemv) {
    blas_sgemm = (sgemm_fn)sgemm;
    blas_sgemv = (sgemv_fn)sgemv;
    return blas_sgemm != 0 && blas_sgemv != 0;
}

/* ---- quantized one-row products ------------------------------------------------------------------- */

typedef struct {
    const float *w; /* the float32 matrix mlx multiplies by (n x k, row-major): the key */
    int n, k, bits, group;
    const uint8_t *q;                   /* n x k values of `bits` bits, packed low bits first */
    const float *scales, *biases;       /* n x (k / group) */
} qmat;

enum { TABLE = 4096 }; /* open addressing, power of two, far more than the matrices of one model */
static qmat table[TABLE];
static int registered;
static long qgemv_calls;

static unsigned slot_of(const float *w) { return (unsigned)(((uintptr_t)w >> 6) * 2654435761u) & (TABLE - 1); }

int mlxpipe_qgemv_available(void);

int mlxpipe_qgemv_register(const float *w, int n, int k, int bits, int group, const void *q, const float *scales,
                           const float *biases) {
    if (!mlxpipe_qgemv_available() || (bits != 4 && bits != 8) || group % 32 || k % group || registered >= TABLE / 2)
        return 0;
    unsigned i = slot_of(w), dead = TABLE;
    for (; table[i].w && table[i].w != w; i = (i + 1) & (TABLE - 1))
        if (table[i].n < 0 && dead == TABLE) dead = i; /* a dead entry's slot can be taken again */
    if (!table[i].w && dead != TABLE) i = dead;
    else if (!table[i].w) registered++;
    table[i] = (qmat){w, n, k, bits, group, (const uint8_t *)q, scales, biases};
    return 1;
}

/* Marks w's entry dead (its products go back to the BLAS); the slot stays, so that lookups probe past it. */
void mlxpipe_qgemv_unregister(const float *w) {
    for (unsigned i = slot_of(w); table[i].w; i = (i + 1) & (TABLE - 1))
        if (table[i].w == w) {
            table[i].n = -1;
            return;
        }
}

long mlxpipe_qgemv_calls(void) { return qgemv_calls; }

static const qmat *lookup(const float *w, int n, int k) {
    if (!registered) return 0;
    for (unsigned i = slot_of(w); table[i].w; i = (i + 1) & (TABLE - 1))
        if (table[i].w == w) return table[i].n == n && table[i].k == k ? &table[i] : 0;
    return 0;
}

#ifdef X86_AVX512
/* y[r] = sum_j W[r,j] x[j], W[r,j] = scale[r,g] * q[r,j] + bias[r,g] for j in group g; with AVX-512 (the
 * plain C version the compiler made was slower than sgemv on float32: only AVX-512 machines register).
 * Two rows at a time, each sum in its own registers: a multiply-add waits ~4 cycles for the one before
 * it on the same sum, so one row alone kept the core waiting (an array of sums indexed by group, as
 * before, went through memory: half the speed). And the quantized bytes are fetched 8 KB ahead: read
 * that fast, the CPU's own prefetching fell behind (one-row products from memory 17 -> 44 G weights/s for
 * 4 bits, 17 -> 35 for 8, in a scratch benchmark on the project machine). */
enum { PREFETCH = 8192 };
/* 4 bits: a group has 16 possible weights, scale * q + bias; they are computed once and looked up with
 * vpermps, which reads just the low 4 bits of each index: the byte's low nibble as it is, its high one
 * shifted down. So the products use the very float32 weights that dequantizing gives. */
#define ROWS4_STEP(q, s, b, lo, hi)                                                                          \
    do {                                                                                                      \
        __m512 v_ = _mm512_fmadd_ps(iota, _mm512_set1_ps((s)[g]), _mm512_set1_ps((b)[g]));                  \
        if ((g & 3) == 0) _mm_prefetch((const char *)((q) + g * half) + PREFETCH, _MM_HINT_T0);            \
        for (int j = 0; j < half; j += 16) {                                                                  \
            __m512i w_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((q) + g * half + j)));       \
            lo = _mm512_fmadd_ps(_mm512_loadu_ps(xe + g * half + j), _mm512_permutexvar_ps(w_, v_), lo);      \
            hi = _mm512_fmadd_ps(_mm512_loadu_ps(xo + g * half + j),                                          \
                                 _mm512_permutexvar_ps(_mm512_srli_epi32(w_, 4), v_), hi);                    \
        }                                                                                                     \
    } while (0)

/* `group` is a constant where it is inlined for 32 (GGUF's group size): the loops over a group unroll. */
__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
rows4_group(const qmat *m, int group, const float *xe, const float *xo, int r0, int r1, float *y) {
    int groups = m->k / group, half = group / 2;
    long stride = m->k / 2;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int r = r0;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *q0 = m->q + r * stride, *q1 = q0 + stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m512 lo0 = _mm512_setzero_ps(), hi0 = lo0, lo1 = lo0, hi1 = lo0;
        for (int g = 0; g < groups; g++) {
            ROWS4_STEP(q0, s0, b0, lo0, hi0);
            ROWS4_STEP(q1, s0 + groups, b0 + groups, lo1, hi1);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo0, hi0));
        y[r + 1] = _mm512_reduce_add_ps(_mm512_add_ps(lo1, hi1));
    }
    if (r < r1) {
        const uint8_t *q0 = m->q + r * stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m512 lo0 = _mm512_setzero_ps(), hi0 = lo0;
        for (int g = 0; g < groups; g++) ROWS4_STEP(q0, s0, b0, lo0, hi0);
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(lo0, hi0));
    }
}

__attribute__((target("avx512f,avx512bw,fma"))) static void rows4_avx512(const qmat *m, const float *xe,
                                                                          const float *xo, int r0, int r1,
                                                                          float *y) {
    if (m->group == 32) rows4_group(m, 32, xe, xo, r0, r1, y);
    else rows4_group(m, m->group, xe, xo, r0, r1, y);
}

/* 8 bits: 256 possible weights, too many to look up; scale * (q . x) + bias * sum(x) per group instead. */
#define ROWS8_STEP(q, s, b, sum, bias)                                                                       \
    do {                                                                                                      \
        __m512 v_ = _mm512_setzero_ps();                                                                      \
        for (int j = 0; j < group; j += 16) {                                                                 \
            __m512i w_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)((q) + g * group + j)));      \
            v_ = _mm512_fmadd_ps(_mm512_loadu_ps(x + g * group + j), _mm512_cvtepi32_ps(w_), v_);            \
        }                                                                                                     \
        if ((g & 1) == 0) _mm_prefetch((const char *)((q) + g * group) + PREFETCH, _MM_HINT_T0);           \
        sum = _mm512_fmadd_ps(v_, _mm512_set1_ps((s)[g]), sum);                                               \
        bias += (b)[g] * xsum[g];                                                                             \
    } while (0)

__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
rows8_group(const qmat *m, int group, const float *x, const float *xsum, int r0, int r1, float *y) {
    int groups = m->k / group;
    long stride = m->k;
    int r = r0;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *q0 = m->q + r * stride, *q1 = q0 + stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m512 sum0 = _mm512_setzero_ps(), sum1 = sum0;
        float bias0 = 0, bias1 = 0;
        for (int g = 0; g < groups; g++) {
            ROWS8_STEP(q0, s0, b0, sum0, bias0);
            ROWS8_STEP(q1, s0 + groups, b0 + groups, sum1, bias1);
        }
        y[r] = _mm512_reduce_add_ps(sum0) + bias0;
        y[r + 1] = _mm512_reduce_add_ps(sum1) + bias1;
    }
    if (r < r1) {
        const uint8_t *q0 = m->q + r * stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m512 sum0 = _mm512_setzero_ps();
        float bias0 = 0;
        for (int g = 0; g < groups; g++) ROWS8_STEP(q0, s0, b0, sum0, bias0);
        y[r] = _mm512_reduce_add_ps(sum0) + bias0;
    }
}

__attribute__((target("avx512f,avx512bw,fma"))) static void rows8_avx512(const qmat *m, const float *x,
                                                                          const float *xsum, int r0, int r1,
                                                                          float *y) {
    if (m->group == 32) rows8_group(m, 32, x, xsum, r0, r1, y);
    else rows8_group(m, m->group, x, xsum, r0, r1, y);
}

#endif

/* Whether this machine has the kernels above: only then is registering worth it. */
int mlxpipe_qgemv_available(void) {
#ifdef X86_AVX512
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* c (1 x n) = alpha a (1 x k) W^T for a registered W; 0 when it cannot (the caller then uses the BLAS). */
static int qgemv(const qmat *m, const float *a, int inc_a, float alpha, float *c) {
    static __thread float *scratch;
    static __thread long scratch_len;
    int k = m->k, groups = m->k / m->group;
    long need = 2L * k + groups;
    if (need > scratch_len) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (!grown) return 0;
        scratch = grown;
        scratch_len = need;
    }
    float *x = scratch, *xe = x + k, *xo = xe + k / 2, *xsum = xo + k / 2;
    for (int j = 0; j < k; j++) x[j] = a[(long)j * inc_a];
#ifdef X86_AVX512
    if (m->bits == 4) {
        for (int j = 0; j < k / 2; j++) { /* a byte holds values 2j (low nibble) and 2j + 1 (high) */
            xe[j] = x[2 * j];
            xo[j] = x[2 * j + 1];
        }
        rows4_avx512(m, xe, xo, 0, m->n, c);
    } else {
        for (int g = 0; g < groups; g++) {
            float t = 0;
            for (int j = 0; j < m->group; j++) t += x[g * m->group + j];
            xsum[g] = t;
        }
        rows8_avx512(m, x, xsum, 0, m->n, c);
    }
#else
    (void)xe, (void)xo, (void)xsum;
    return 0;
#endif
    if (alpha != 1.0f)
        for (int r = 0; r < m->n; r++) c[r] *= alpha;
    qgemv_calls++;
    return 1;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (order == COL_MAJOR) { /* column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T */
        int t = ta; ta = tb; tb = t;
        t = m; m = n; n = t;
        t = lda; lda = ldb; ldb = t;
        const float *p = a; a = b; b = p;
    }
    /* c (1 x n) = alpha a (1 x k) op(B) + beta c; a is a row, or a column of stride lda */
    if (m == 1 && (long)n * k >= MIN_ELEMENTS) {
        int inc_a = ta == NO_TRANS ? 1 : lda;
        const qmat *q = tb == TRANS && ldb == k && beta == 0.0f ? lookup(b, n, k) : 0;
        if (q && qgemv(q, a, inc_a, alpha, c)) return;
        if (tb == NO_TRANS) /* B is k x n: c = B^T a */
            blas_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, inc_a, beta, c, 1);
        else /* B is n x k: c = B a */
            blas_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, inc_a, beta, c, 1);
        return;
    }
    /* c (m x 1, stride ldc) = alpha op(A) (m x k) b (k x 1) + beta c */
    if (n == 1 && (long)m * k >= MIN_ELEMENTS) {
        int inc_b = tb == NO_TRANS ? ldb : 1;
        if (ta == NO_TRANS) /* A is m x k */
            blas_sgemv(ROW_MAJOR, NO_TRANS, m, k, alpha, a, lda, b, inc_b, beta, c, ldc);
        else /* A is k x m */
            blas_sgemv(ROW_MAJOR, TRANS, k, m, alpha, a, lda, b, inc_b, beta, c, ldc);
        return;
    }
    blas_sgemm(ROW_MAJOR, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
