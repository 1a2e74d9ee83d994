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
 * ones, 5-8x fewer, and computes the same sums (scale * q + bias, summed in another order). So does a
 * product of several rows (a --batch decode step, a prompt), each row summed exactly as alone. Where the CPU
 * has VNNI, all of them are integer products instead, from activations split into 8-bit parts (within ~1e-4
 * of those sums; below, "8-bit activations"), each row's numbers still its own.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <stdatomic.h>
#include <pthread.h>
#include <unistd.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include <cpuid.h>
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
    uint8_t *i8;                        /* W repacked for 8-bit activations, once used (i8_weights) */
    int i8_form;                        /* I8_HALF, I8_SYMMETRIC: how its scales and biases are kept */
    int i8_borrowed;                    /* i8 is the caller's (mlxpipe_qmatrix_adopt): never freed here */
} qmat;

enum { TABLE = 4096 }; /* open addressing, power of two, far more than the matrices of one model */
static qmat table[TABLE];
static int registered;
static long qgemv_calls;
static int qgemm_max_rows = 1 << 30; /* products of more rows go to the BLAS (0: one-row products only) */

/* Sets the most rows a product may have for the quantized kernels (0: one-row products only). */
void mlxpipe_qgemm_max_rows(int rows) { qgemm_max_rows = rows; }

static unsigned slot_of(const float *w) { return (unsigned)(((uintptr_t)w >> 6) * 2654435761u) & (TABLE - 1); }

int mlxpipe_qgemv_available(void);
static int integer_products(void);

/* Registers W (key w, n x k) and returns its entry, which stays where it is (a handle for mlxpipe_qproduct);
 * 0 when the CPU or the layout has no kernel. */
static qmat *enter(const float *w, int n, int k, int bits, int group, const void *q, const float *scales,
                   const float *biases) {
    /* 2, 3, 5 and 6 bits: the integer products only (their copy packed for them alone) */
    int wide = bits == 2 || bits == 3 || bits == 5 || bits == 6;
    if (!mlxpipe_qgemv_available() || !(bits == 4 || bits == 8 || (wide && integer_products())) || group % 32 ||
        k % group || registered >= TABLE / 2)
        return 0;
    unsigned i = slot_of(w), dead = TABLE;
    /* keyed by address and rows: a matrix and a view of its first rows (a fused product's part) share one */
    for (; table[i].w && !(table[i].w == w && table[i].n == n); i = (i + 1) & (TABLE - 1))
        if (table[i].n < 0 && dead == TABLE) dead = i; /* a dead entry's slot can be taken again */
    if (!table[i].w && dead != TABLE) i = dead;
    else if (!table[i].w) registered++;
    if (!table[i].i8_borrowed) free(table[i].i8);
    table[i] = (qmat){w, n, k, bits, group, (const uint8_t *)q, scales, biases, 0, 0, 0};
    return &table[i];
}

/* (enter, not the exported functions, from inside: a second copy of this library calling its own exported
 * functions would reach the first copy's, which is global) */
void *mlxpipe_qmatrix(const float *w, int n, int k, int bits, int group, const void *q, const float *scales,
                      const float *biases) {
    return enter(w, n, k, bits, group, q, scales, biases);
}

int mlxpipe_qgemv_register(const float *w, int n, int k, int bits, int group, const void *q, const float *scales,
                           const float *biases) {
    return enter(w, n, k, bits, group, q, scales, biases) != 0;
}

/* Marks w's entries dead (their products go back to the BLAS); the slots stay, so that lookups probe past.
 * Their repacked copies stay too, until mlxpipe_qgemv_release: a product may still be reading one. */
void mlxpipe_qgemv_unregister(const float *w) {
    for (unsigned i = slot_of(w); table[i].w; i = (i + 1) & (TABLE - 1))
        if (table[i].w == w) table[i].n = -1;
}

/* Frees the repacked copies of dead entries, once no product can be reading them. */
void mlxpipe_qgemv_release(void) {
    for (unsigned i = 0; i < TABLE; i++)
        if (table[i].n < 0 && table[i].i8) {
            if (!table[i].i8_borrowed) free(table[i].i8);
            table[i].i8 = 0;
        }
}

long mlxpipe_qgemv_calls(void) { return qgemv_calls; }

/* A repacked copy's form: its scales and biases in 16 bits (float16 values all: GGUF's); its biases left out,
 * every one being -2^(bits-1) times its scale (GGUF's Q8_0, Q4_0, Q5_0): a Q8_0 weight then reads 8.5 bits, as
 * in the file, instead of 9 (a one-row product reads W from memory). */
enum { I8_HALF = 1, I8_SYMMETRIC = 2 };
static int i8_half_allowed = 1, i8_symmetric_allowed = 1;
/* Whether repacked copies keep float16 scales and biases in 16 bits (1, the default) or in 32 (0, tests; -1
 * only asks); the setting. Copies already made keep theirs. */
int mlxpipe_qgemm_int8_half(int on) {
    if (on >= 0) i8_half_allowed = on;
    return i8_half_allowed;
}

/* Whether repacked copies of symmetric matrices leave their biases out (1, the default) or keep them (0, tests;
 * -1 only asks); the setting. Copies already made keep theirs. */
int mlxpipe_qgemm_int8_symmetric(int on) {
    if (on >= 0) i8_symmetric_allowed = on;
    return i8_symmetric_allowed;
}

/* Live matrices whose repacked copy has all of `form` (I8_HALF, I8_SYMMETRIC) */
long mlxpipe_qgemm_int8_forms(int form) {
    long count = 0;
    for (unsigned i = 0; i < TABLE; i++) count += table[i].n > 0 && table[i].i8 && (table[i].i8_form & form) == form;
    return count;
}

/* Value j of a row of `bits`-bit values packed as mlx packs them (a little-endian stream, lowest bits first) */
static uint32_t value_at(const uint8_t *row, long row_bytes, long j, int bits) {
    long bit = j * bits, byte = bit / 8;
    uint32_t word = row[byte] | (byte + 1 < row_bytes ? (uint32_t)row[byte + 1] << 8 : 0);
    return word >> (bit % 8) & ((1u << bits) - 1);
}

static const qmat *lookup(const float *w, int n, int k) {
    if (!registered) return 0;
    for (unsigned i = slot_of(w); table[i].w; i = (i + 1) & (TABLE - 1))
        if (table[i].w == w && table[i].n == n && table[i].k == k) return &table[i];
    return 0;
}

#ifdef X86_AVX512
/* y[r] = sum_j W[r,j] x[j], W[r,j] = scale[r,g] * q[r,j] + bias[r,g] for j in group g; with AVX-512, or
 * AVX2 below (the plain C version the compiler made was slower than sgemv on float32: only machines with
 * one of the two register).
 * Two rows at a time, each sum in its own registers: a multiply-add waits ~4 cycles for the one before
 * it on the same sum, so one row alone kept the core waiting (an array of sums indexed by group, as
 * before, went through memory: half the speed). And the quantized bytes are fetched 8 KB ahead: read
 * that fast, the CPU's own prefetching fell behind (one-row products from memory 17 -> 44 G weights/s for
 * 4 bits, 17 -> 35 for 8, in a scratch benchmark on the project machine). */
enum { PREFETCH = 8192, PREFETCH_ROWS = 8 };
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


/* ---- quantized products of several rows (--batch) ----------------------------------------------------
 * C (M x n) = A (M x k) W^T from the quantized bytes, M > 1: each row of W is decoded once for a block of MB
 * rows of A, and every row of A gets the very sums the one-row kernels above compute for it alone (same
 * weights, same operations in the same order): a record's logits do not depend on how many records share
 * its step, nor on the float32 matrix (5-8x the bytes), which is never read. */
enum { MB = 8, CHUNK = 256 * 1024 }; /* rows of A a block; bytes of W a pass over A stays in L2 for */

/* 4 bits: a row of A in the scratch is its k / 2 even columns, then its odd ones (xe, xo of qgemv). */
__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
block4(const qmat *m, int group, const float *x, int rows, int r, float *c, int ldc) {
    int groups = m->k / group, half = group / 2, k = m->k, k2 = k / 2;
    const uint8_t *q0 = m->q + (long)r * (k / 2);
    const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 lo[MB], hi[MB];
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 v = _mm512_fmadd_ps(iota, _mm512_set1_ps(s0[g]), _mm512_set1_ps(b0[g]));
        if ((g & 3) == 0) _mm_prefetch((const char *)(q0 + g * half) + PREFETCH, _MM_HINT_T0);
        for (int j = g * half; j < g * half + half; j += 16) {
            __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q0 + j)));
            __m512 wl = _mm512_permutexvar_ps(w, v), wh = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), v);
            _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) {
                lo[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (long)i * k + j), wl, lo[i]);
                hi[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + (long)i * k + k2 + j), wh, hi[i]);
            }
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) c[(long)i * ldc + r] =
        _mm512_reduce_add_ps(_mm512_add_ps(lo[i], hi[i]));
}

/* 8 bits: scale * (q . x) + bias * sum(x) per group, as rows8; xsum holds each row's group sums. */
__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
block8(const qmat *m, int group, const float *x, const float *xsum, int rows, int r, float *c, int ldc) {
    int groups = m->k / group, k = m->k;
    const uint8_t *q0 = m->q + (long)r * k;
    const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
    __m512 sum[MB];
    float bias[MB];
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) sum[i] = _mm512_setzero_ps(), bias[i] = 0;
    for (int g = 0; g < groups; g++) {
        __m512 v[MB];
        _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) v[i] = _mm512_setzero_ps();
        for (int j = g * group; j < g * group + group; j += 16) {
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q0 + j))));
            _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) v[i] =
                _mm512_fmadd_ps(_mm512_loadu_ps(x + (long)i * k + j), w, v[i]);
        }
        if ((g & 1) == 0) _mm_prefetch((const char *)(q0 + g * group) + PREFETCH, _MM_HINT_T0);
        __m512 sc = _mm512_set1_ps(s0[g]);
        _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) {
            sum[i] = _mm512_fmadd_ps(v[i], sc, sum[i]);
            bias[i] += b0[g] * xsum[(long)i * groups + g];
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) c[(long)i * ldc + r] =
        _mm512_reduce_add_ps(sum[i]) + bias[i];
}

/* Rows [r0, r1) of W against `rows` <= MB rows of A; `group` a constant where inlined. */
#define BLOCKS(rows_)                                                                                         \
    for (int r = r0; r < r1; r++)                                                                             \
        if (m->bits == 4) block4(m, group, x, rows_, r, c, ldc);                                              \
        else block8(m, group, x, xsum, rows_, r, c, ldc)

__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
span_group(const qmat *m, int group, const float *x, const float *xsum, int rows, int r0, int r1, float *c,
           int ldc) {
    switch (rows) { /* a constant count of rows: their sums stay in registers */
    case 8: BLOCKS(8); break;
    case 7: BLOCKS(7); break;
    case 6: BLOCKS(6); break;
    case 5: BLOCKS(5); break;
    case 4: BLOCKS(4); break;
    case 3: BLOCKS(3); break;
    case 2: BLOCKS(2); break;
    default: BLOCKS(1); break;
    }
}

__attribute__((target("avx512f,avx512bw,fma"))) static void span(const qmat *m, const float *x, const float *xsum,
                                                                  int rows, int r0, int r1, float *c, int ldc) {
    if (m->group == 32) span_group(m, 32, x, xsum, rows, r0, r1, c, ldc);
    else span_group(m, m->group, x, xsum, rows, r0, r1, c, ldc);
}

/* ---- the same kernels with AVX2 (8 lanes), for x86-64 CPUs without AVX-512 -----------------------------
 * Each weight is dequantized as the AVX-512 kernels' table holds it, fma(q, scale, bias), and summed in the
 * same pattern per lane; a row of several (block*_avx2) gets the very sums the one-row kernels give it. */
__attribute__((target("avx2,fma"), always_inline)) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 weights of a 4-bit row from 8 bytes: the low halves' (even columns) and the high ones' (odd), each
 * fma(q, scale, bias): the very weights of the AVX-512 table, for the AVX2 GEMM's rows. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
weights4_avx2(const uint8_t *q, __m256 scale, __m256 bias, __m256 *lo, __m256 *hi) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    *lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))), scale, bias);
    *hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), scale, bias);
}

/* A 4-bit group's q . x (its even columns' x in xe, its odd ones' in xo; half = group / 2 bytes): products,
 * not weights, so that a weight costs one multiply-add. Its scale and bias come after (the callers, and
 * biases4_avx2), as the 8-bit kernels apply theirs: scale * (q . x) + bias * sum(x). */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 dot4_avx2(const uint8_t *q,
                                                                                  const float *xe,
                                                                                  const float *xo, int half) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q)), low = _mm256_set1_epi32(15);
    __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(xe), _mm256_cvtepi32_ps(_mm256_and_si256(v, low)));
    __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(xo), _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
    for (int j = 8; j < half; j += 8) {
        v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(xe + j), _mm256_cvtepi32_ps(_mm256_and_si256(v, low)), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(xo + j), _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), hi);
    }
    return _mm256_add_ps(lo, hi);
}

/* A row's biases times x's group sums, the second term of every 4-bit AVX2 result. */
__attribute__((target("avx2,fma"), always_inline)) static inline float biases4_avx2(const float *b,
                                                                                   const float *xsum, int groups) {
    __m256 acc = _mm256_setzero_ps();
    int g = 0;
    for (; g + 8 <= groups; g += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(xsum + g), acc);
    float tail = 0.0f;
    for (; g < groups; g++) tail += b[g] * xsum[g];
    return hsum8(acc) + tail;
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
rows4_half_avx2(const int half, const qmat *m, const float *xe, const float *xo, const float *xsum, int r0, int r1,
                float *y) {
    int groups = m->k / m->group;
    long stride = m->k / 2;
    int r = r0;
    for (; r + 1 < r1; r += 2) { /* two rows a pass: x's loads shared */
        const uint8_t *q0 = m->q + r * stride, *q1 = q0 + stride;
        const float *s0 = m->scales + (long)r * groups, *s1 = s0 + groups;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0;
        for (int g = 0; g < groups; g++) {
            if ((g & 3) == 0) {
                _mm_prefetch((const char *)(q0 + g * half) + PREFETCH, _MM_HINT_T0);
                _mm_prefetch((const char *)(q1 + g * half) + PREFETCH, _MM_HINT_T0);
            }
            acc0 = _mm256_fmadd_ps(dot4_avx2(q0 + g * half, xe + g * half, xo + g * half, half),
                                   _mm256_set1_ps(s0[g]), acc0);
            acc1 = _mm256_fmadd_ps(dot4_avx2(q1 + g * half, xe + g * half, xo + g * half, half),
                                   _mm256_set1_ps(s1[g]), acc1);
        }
        const float *b0 = m->biases + (long)r * groups;
        y[r] = hsum8(acc0) + biases4_avx2(b0, xsum, groups);
        y[r + 1] = hsum8(acc1) + biases4_avx2(b0 + groups, xsum, groups);
    }
    if (r < r1) {
        const uint8_t *q0 = m->q + r * stride;
        const float *s0 = m->scales + (long)r * groups;
        __m256 acc0 = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++)
            acc0 = _mm256_fmadd_ps(dot4_avx2(q0 + g * half, xe + g * half, xo + g * half, half),
                                   _mm256_set1_ps(s0[g]), acc0);
        y[r] = hsum8(acc0) + biases4_avx2(m->biases + (long)r * groups, xsum, groups);
    }
}

/* A constant half for groups of 32 (GGUF's): dot4_avx2's loop unrolled. */
__attribute__((target("avx2,fma"))) static void rows4_avx2(const qmat *m, const float *xe, const float *xo,
                                                          const float *xsum, int r0, int r1, float *y) {
    if (m->group == 32) rows4_half_avx2(16, m, xe, xo, xsum, r0, r1, y);
    else rows4_half_avx2(m->group / 2, m, xe, xo, xsum, r0, r1, y);
}

#define ROWS8_STEP2(q, s, b, sum, bias)                                                                      \
    do {                                                                                                      \
        __m256 v_ = _mm256_setzero_ps();                                                                      \
        for (int j = 0; j < group; j += 8) {                                                                  \
            __m256i w_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((q) + g * group + j)));      \
            v_ = _mm256_fmadd_ps(_mm256_loadu_ps(x + g * group + j), _mm256_cvtepi32_ps(w_), v_);            \
        }                                                                                                     \
        if ((g & 1) == 0) _mm_prefetch((const char *)((q) + g * group) + PREFETCH, _MM_HINT_T0);           \
        sum = _mm256_fmadd_ps(v_, _mm256_set1_ps((s)[g]), sum);                                               \
        bias += (b)[g] * xsum[g];                                                                             \
    } while (0)

__attribute__((target("avx2,fma"))) static void rows8_avx2(const qmat *m, const float *x, const float *xsum,
                                                          int r0, int r1, float *y) {
    int group = m->group, groups = m->k / group;
    long stride = m->k;
    int r = r0;
    for (; r + 1 < r1; r += 2) {
        const uint8_t *q0 = m->q + r * stride, *q1 = q0 + stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m256 sum0 = _mm256_setzero_ps(), sum1 = sum0;
        float bias0 = 0, bias1 = 0;
        for (int g = 0; g < groups; g++) {
            ROWS8_STEP2(q0, s0, b0, sum0, bias0);
            ROWS8_STEP2(q1, s0 + groups, b0 + groups, sum1, bias1);
        }
        y[r] = hsum8(sum0) + bias0;
        y[r + 1] = hsum8(sum1) + bias1;
    }
    if (r < r1) {
        const uint8_t *q0 = m->q + r * stride;
        const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
        __m256 sum0 = _mm256_setzero_ps();
        float bias0 = 0;
        for (int g = 0; g < groups; g++) ROWS8_STEP2(q0, s0, b0, sum0, bias0);
        y[r] = hsum8(sum0) + bias0;
    }
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
block4_half_avx2(const int half, const qmat *m, const float *x, const float *xsum, int rows, int r, float *c,
                 int ldc) {
    int groups = m->k / m->group, k = m->k, k2 = k / 2;
    const uint8_t *q0 = m->q + (long)r * (k / 2);
    const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
    __m256 acc[MB];
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) acc[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256 sc = _mm256_set1_ps(s0[g]);
        if ((g & 3) == 0) _mm_prefetch((const char *)(q0 + g * half) + PREFETCH, _MM_HINT_T0);
        _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) { /* as rows4_avx2 sums each row alone */
            const float *xi = x + (long)i * k + g * half;
            acc[i] = _mm256_fmadd_ps(dot4_avx2(q0 + g * half, xi, xi + k2, half), sc, acc[i]);
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) c[(long)i * ldc + r] =
        hsum8(acc[i]) + biases4_avx2(b0, xsum + (long)i * groups, groups);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
block4_avx2(const qmat *m, const float *x, const float *xsum, int rows, int r, float *c, int ldc) {
    if (m->group == 32) block4_half_avx2(16, m, x, xsum, rows, r, c, ldc);
    else block4_half_avx2(m->group / 2, m, x, xsum, rows, r, c, ldc);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
block8_avx2(const qmat *m, const float *x, const float *xsum, int rows, int r, float *c, int ldc) {
    int group = m->group, groups = m->k / group, k = m->k;
    const uint8_t *q0 = m->q + (long)r * k;
    const float *s0 = m->scales + (long)r * groups, *b0 = m->biases + (long)r * groups;
    __m256 sum[MB];
    float bias[MB];
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) sum[i] = _mm256_setzero_ps(), bias[i] = 0;
    for (int g = 0; g < groups; g++) {
        __m256 v[MB];
        _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) v[i] = _mm256_setzero_ps();
        for (int j = g * group; j < g * group + group; j += 8) {
            __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q0 + j))));
            _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) v[i] =
                _mm256_fmadd_ps(_mm256_loadu_ps(x + (long)i * k + j), w, v[i]);
        }
        if ((g & 1) == 0) _mm_prefetch((const char *)(q0 + g * group) + PREFETCH, _MM_HINT_T0);
        __m256 sc = _mm256_set1_ps(s0[g]);
        _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) {
            sum[i] = _mm256_fmadd_ps(v[i], sc, sum[i]);
            bias[i] += b0[g] * xsum[(long)i * groups + g];
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < rows; i++) c[(long)i * ldc + r] = hsum8(sum[i]) + bias[i];
}

#define BLOCKS2(rows_)                                                                                        \
    for (int r = r0; r < r1; r++)                                                                             \
        if (m->bits == 4) block4_avx2(m, x, xsum, rows_, r, c, ldc);                                          \
        else block8_avx2(m, x, xsum, rows_, r, c, ldc)

__attribute__((target("avx2,fma"))) static void span_avx2(const qmat *m, const float *x, const float *xsum,
                                                         int rows, int r0, int r1, float *c, int ldc) {
    /* AVX2 has 16 vector registers: four rows' sums and the weights fit; eight rows' spilled (bench/RESULTS.md) */
    if (rows > 4) {
        span_avx2(m, x, xsum, 4, r0, r1, c, ldc);
        x += 4L * m->k, xsum += 4L * (m->k / m->group), c += 4L * ldc, rows -= 4;
    }
    switch (rows) { /* a constant count of rows: their sums stay in registers */
    case 4: BLOCKS2(4); break;
    case 3: BLOCKS2(3); break;
    case 2: BLOCKS2(2); break;
    default: BLOCKS2(1); break;
    }
}

/* Which kernels run: 2 AVX-512, 1 AVX2 (also where AVX-512 is, when asked: tests), 0 none. */
static int isa = -1;
static int avx2_forced;

static int kernels(void) {
    if (isa < 0) {
        int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                     __builtin_cpu_supports("fma");
        int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        isa = avx512 && !avx2_forced ? 2 : avx2 ? 1 : 0;
    }
    return isa;
}

/* 1: the AVX2 kernels even where AVX-512 is (tests); call before registering any matrix. */
void mlxpipe_qgemv_avx2(int on) {
    avx2_forced = on;
    isa = -1;
}

static void rows4(const qmat *m, const float *xe, const float *xo, const float *xsum, int r0, int r1, float *y) {
    if (kernels() == 2) rows4_avx512(m, xe, xo, r0, r1, y);
    else rows4_avx2(m, xe, xo, xsum, r0, r1, y);
}

static void rows8(const qmat *m, const float *x, const float *xsum, int r0, int r1, float *y) {
    if (kernels() == 2) rows8_avx512(m, x, xsum, r0, r1, y);
    else rows8_avx2(m, x, xsum, r0, r1, y);
}

static void span_any(const qmat *m, const float *x, const float *xsum, int rows, int r0, int r1, float *c,
                     int ldc) {
    if (kernels() == 2) span(m, x, xsum, rows, r0, r1, c, ldc);
    else span_avx2(m, x, xsum, rows, r0, r1, c, ldc);
}

/* ---- AVX2, 16 rows or more: a GEMM on W's rows dequantized six at a time -------------------------------
 * The kernels above load a row of A for every multiply-add; here A is transposed once a product (k x M, its
 * columns in the kernels' order: for 4 bits the even ones, then the odd ones), six rows of W are dequantized
 * into L1 (fma(q, scale, bias), the weights every kernel uses), and a tile of 6 rows of W by 16 of A keeps 12
 * sums in registers: 12 multiply-adds for 2 loads and 6 broadcasts. Each sum runs over k in one order,
 * whatever the tile: a row's results depend on that row alone, but are added in another order than the
 * one-row kernels add them (the last bits can differ from --batch 1's, as on AMX). */
enum { GEMM_W = 6, GEMM_A = 16, GEMM_MIN_ROWS = 16, GEMM_CHUNK = 64, GEMM_STRETCH = 1 << 20 };

/* r[t] = column t of the 8 x 8 block in r (rows in, columns out). */
__attribute__((target("avx2,fma"), always_inline)) static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(1, 0, 1, 0));
            u[i + h + 2] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        }
    /* u[0..3]: rows 0-3's columns (0 4) (2 6) (1 5) (3 7) in 128-bit halves; u[4..7] rows 4-7's */
    static const int order[4] = {0, 2, 1, 3};
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[order[c]], u[4 + order[c]], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[order[c]], u[4 + order[c]], 0x31);
    }
}

/* at (k x mpad) = A (M x k) transposed, columns in the kernels' order, rows past M zero: eight rows of A at
 * a time by 8 x 8 transposes (a copy: cheaper than the strided scalar loop). */
__attribute__((target("avx2,fma"))) static void gemm_pack(const qmat *m, int M, const float *a, int lda, float *at,
                                                          int mpad) {
    int k = m->k, k2 = k / 2, M8 = k % 16 ? 0 : M / 8 * 8;
    for (int i = 0; i < M8; i += 8) {
        const float *src = a + (long)i * lda;
        if (m->bits == 4)
            for (int c = 0; c < k; c += 16) { /* the even columns go to c / 2, the odd ones to k2 + c / 2 */
                __m256 even[8], odd[8];
                for (int r = 0; r < 8; r++) {
                    __m256 v0 = _mm256_loadu_ps(src + (long)r * lda + c), v1 = _mm256_loadu_ps(src + (long)r * lda + c + 8);
                    __m256 e = _mm256_shuffle_ps(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(v0, v1, _MM_SHUFFLE(3, 1, 3, 1));
                    even[r] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0)));
                    odd[r] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0)));
                }
                transpose8(even), transpose8(odd);
                for (int t = 0; t < 8; t++) {
                    _mm256_storeu_ps(at + (long)(c / 2 + t) * mpad + i, even[t]);
                    _mm256_storeu_ps(at + (long)(k2 + c / 2 + t) * mpad + i, odd[t]);
                }
            }
        else
            for (int c = 0; c < k; c += 8) {
                __m256 r8[8];
                for (int r = 0; r < 8; r++) r8[r] = _mm256_loadu_ps(src + (long)r * lda + c);
                transpose8(r8);
                for (int t = 0; t < 8; t++) _mm256_storeu_ps(at + (long)(c + t) * mpad + i, r8[t]);
            }
    }
    for (int j = 0; j < k; j++) {
        int src = m->bits == 4 ? (j < k2 ? 2 * j : 2 * (j - k2) + 1) : j;
        float *row = at + (long)j * mpad;
        for (int i = M8; i < M; i++) row[i] = a[(long)i * lda + src];
        for (int i = M; i < mpad; i++) row[i] = 0.0f;
    }
}

__attribute__((target("avx2,fma"))) static void gemm_weights(const qmat *m, int r, int rows, float *w) {
    int k = m->k, group = m->group, groups = k / group, half = group / 2, k2 = k / 2;
    for (int i = 0; i < rows; i++) {
        const float *s = m->scales + (long)(r + i) * groups, *b = m->biases + (long)(r + i) * groups;
        float *wi = w + (long)i * k;
        /* a group at a time: its scale and bias broadcast once (a division an 8 weights cost ~10 cycles) */
        if (m->bits == 4) {
            const uint8_t *q = m->q + (long)(r + i) * k2;
            for (int g = 0, j = 0; g < groups; g++) {
                __m256 scale = _mm256_set1_ps(s[g]), bias = _mm256_set1_ps(b[g]);
                for (int end = j + half; j < end; j += 8) {
                    __m256 lo, hi;
                    weights4_avx2(q + j, scale, bias, &lo, &hi);
                    _mm256_storeu_ps(wi + j, lo);
                    _mm256_storeu_ps(wi + k2 + j, hi);
                }
            }
        } else {
            const uint8_t *q = m->q + (long)(r + i) * k;
            for (int g = 0, j = 0; g < groups; g++) {
                __m256 scale = _mm256_set1_ps(s[g]), bias = _mm256_set1_ps(b[g]);
                for (int end = j + group; j < end; j += 8) {
                    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)));
                    _mm256_storeu_ps(wi + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, bias));
                }
            }
        }
    }
}

/* c[i0 + l][r + rr] for rr < R, l < cols: W's rows in w (R x k) times at's columns i0 .. i0 + 16. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
gemm_tile(const int R, const float *w, int k, const float *at, int mpad, int i0, int cols, float *c, int ldc,
          int r) {
    __m256 acc[GEMM_W][2];
    _Pragma("GCC unroll 6") for (int rr = 0; rr < R; rr++) acc[rr][0] = acc[rr][1] = _mm256_setzero_ps();
    const float *ap = at + i0;
    for (int j = 0; j < k; j++, ap += mpad) {
        __m256 a0 = _mm256_loadu_ps(ap), a1 = _mm256_loadu_ps(ap + 8);
        _Pragma("GCC unroll 6") for (int rr = 0; rr < R; rr++) {
            __m256 wv = _mm256_broadcast_ss(w + (long)rr * k + j);
            acc[rr][0] = _mm256_fmadd_ps(wv, a0, acc[rr][0]);
            acc[rr][1] = _mm256_fmadd_ps(wv, a1, acc[rr][1]);
        }
    }
    float out[GEMM_A];
    _Pragma("GCC unroll 6") for (int rr = 0; rr < R; rr++) {
        _mm256_storeu_ps(out, acc[rr][0]);
        _mm256_storeu_ps(out + 8, acc[rr][1]);
        for (int l = 0; l < cols; l++) c[(long)(i0 + l) * ldc + r + rr] = out[l];
    }
}

#define GEMM_TILES(R_)                                                                                        \
    for (int i0 = 0; i0 < M; i0 += GEMM_A) gemm_tile(R_, w, k, at, mpad, i0, M - i0 < GEMM_A ? M - i0 : GEMM_A, c, ldc, r)

/* Rows [r0, r1) of c^T: W's rows six at a time against every column of at (M of them, mpad apart). */
__attribute__((target("avx2,fma"))) static int gemm_rows_avx2(const qmat *m, const float *at, int mpad, int M,
                                                             float *c, int ldc, int r0, int r1) {
    static __thread float *w;
    static __thread long w_len;
    int k = m->k;
    if ((long)GEMM_W * k > w_len) {
        float *grown = realloc(w, (long)GEMM_W * k * sizeof(float));
        if (!grown) return 0;
        w = grown, w_len = (long)GEMM_W * k;
    }
    for (int r = r0; r < r1; r += GEMM_W) {
        int rows = r1 - r < GEMM_W ? r1 - r : GEMM_W;
        gemm_weights(m, r, rows, w);
        switch (rows) { /* a constant count of W's rows: their sums stay in registers */
        case 6: GEMM_TILES(6); break;
        case 5: GEMM_TILES(5); break;
        case 4: GEMM_TILES(4); break;
        case 3: GEMM_TILES(3); break;
        case 2: GEMM_TILES(2); break;
        default: GEMM_TILES(1); break;
        }
    }
    return 1;
}

/* ---- the same GEMM with AVX-512: a tile of 12 rows of W by 32 of A (24 sums in registers) -----------------
 * Its sums are the AVX2 GEMM's, each over k in the same order (one multiply-add a step), so a row's results
 * are those the AVX2 GEMM gives it, on 16 lanes instead of 8. k goes in chunks of GEMM_KB columns, W's rows
 * dequantized GEMM_KB apart: the broadcasts' offsets are constants (12 row offsets in registers spilled). */
enum { GEMM_W16 = 12, GEMM_KB = 256 };
static int gemm512_min_rows = 16; /* products of fewer rows keep the kernels above */

/* Sets the fewest rows of A for the AVX-512 GEMM (1 << 30: never; bench and tests); whether it runs here. */
int mlxpipe_qgemm_gemm512(int rows) {
    gemm512_min_rows = rows;
    return kernels() == 2;
}

/* Columns [j0, j1) (multiples of 16, in the kernels' order) of W's rows r .. r + rows, GEMM_KB apart in w:
 * fma(q, scale, bias), the weights of every kernel. `group` a constant where inlined. */
__attribute__((target("avx512f,avx512bw,fma"), always_inline)) static inline void
gemm_weights512_group(const qmat *m, int group, int r, int rows, int j0, int j1, float *w) {
    int k = m->k, groups = k / group, k2 = k / 2, half = group / 2;
    for (int i = 0; i < rows; i++) {
        const float *s = m->scales + (long)(r + i) * groups, *b = m->biases + (long)(r + i) * groups;
        float *wi = w + (long)i * GEMM_KB - j0;
        if (m->bits == 4) {
            const uint8_t *q = m->q + (long)(r + i) * k2;
            for (int odd = 0; odd < 2; odd++) { /* the even columns (low nibbles), then the odd ones */
                int start = odd * k2, from = j0 > start ? j0 : start, to = j1 < start + k2 ? j1 : start + k2;
                for (int j = from; j < to; j += 16) { /* 16 columns lie in one group: half is a multiple of 16 */
                    unsigned byte = (unsigned)(j - start), g = byte / (unsigned)half;
                    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + byte)));
                    v = odd ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
                    _mm512_storeu_ps(wi + j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(s[g]),
                                                             _mm512_set1_ps(b[g])));
                }
            }
        } else {
            const uint8_t *q = m->q + (long)(r + i) * k;
            for (int j = j0; j < j1; j += 16) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j)));
                unsigned g = (unsigned)j / (unsigned)group;
                _mm512_storeu_ps(wi + j, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(s[g]),
                                                         _mm512_set1_ps(b[g])));
            }
        }
    }
}

__attribute__((target("avx512f,avx512bw,fma"))) static void gemm_weights512(const qmat *m, int r, int rows, int j0,
                                                                           int j1, float *w) {
    if (m->group == 32) gemm_weights512_group(m, 32, r, rows, j0, j1, w);
    else gemm_weights512_group(m, m->group, r, rows, j0, j1, w);
}

/* sums[rr][l] (+)= W's rows in w (R x kc, GEMM_KB apart) times at's columns from ap (kc rows, mpad apart),
 * 16 * NA of them; sums start at zero when `first`. */
__attribute__((target("avx512f,fma"), always_inline)) static inline void
gemm_tile512(const int R, const int NA, const float *w, int kc, const float *ap, int mpad, float *sums, int first) {
    __m512 acc[GEMM_W16][2];
    _Pragma("GCC unroll 12") for (int rr = 0; rr < R; rr++) {
        acc[rr][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + rr * 32);
        acc[rr][1] = first || NA < 2 ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + rr * 32 + 16);
    }
    for (int j = 0; j < kc; j++, ap += mpad) {
        __m512 a0 = _mm512_loadu_ps(ap), a1 = NA > 1 ? _mm512_loadu_ps(ap + 16) : a0;
        _Pragma("GCC unroll 12") for (int rr = 0; rr < R; rr++) {
            __m512 wv = _mm512_set1_ps(w[rr * GEMM_KB + j]);
            acc[rr][0] = _mm512_fmadd_ps(wv, a0, acc[rr][0]);
            if (NA > 1) acc[rr][1] = _mm512_fmadd_ps(wv, a1, acc[rr][1]);
        }
    }
    _Pragma("GCC unroll 12") for (int rr = 0; rr < R; rr++) {
        _mm512_storeu_ps(sums + rr * 32, acc[rr][0]);
        if (NA > 1) _mm512_storeu_ps(sums + rr * 32 + 16, acc[rr][1]);
    }
}

/* at's columns 32 at a time, the last 16 or fewer alone (mpad is a multiple of 16, its columns past M zero) */
#define GEMM_TILES512(R_)                                                                                     \
    for (int i0 = 0, t = 0; i0 < M; i0 += 32, t++)                                                            \
        if (M - i0 > 16) gemm_tile512(R_, 2, w, j1 - j0, at + (long)j0 * mpad + i0, mpad, sums + t * 384, !j0); \
        else gemm_tile512(R_, 1, w, j1 - j0, at + (long)j0 * mpad + i0, mpad, sums + t * 384, !j0)

/* Rows [r0, r1) of c^T: W's rows twelve at a time against every column of at (M <= GEMM_CHUNK of them, mpad
 * apart). */
__attribute__((target("avx512f,avx512bw,fma"))) static int gemm_rows_avx512(const qmat *m, const float *at, int mpad,
                                                                            int M, float *c, int ldc, int r0,
                                                                            int r1) {
    float w[GEMM_W16 * GEMM_KB] __attribute__((aligned(64)));
    float sums[(GEMM_CHUNK + 31) / 32 * GEMM_W16 * 32] __attribute__((aligned(64))); /* [tile][rr][32] */
    int k = m->k;
    for (int r = r0; r < r1; r += GEMM_W16) {
        int rows = r1 - r < GEMM_W16 ? r1 - r : GEMM_W16;
        for (int j0 = 0; j0 < k; j0 += GEMM_KB) {
            int j1 = k - j0 < GEMM_KB ? k : j0 + GEMM_KB;
            gemm_weights512(m, r, rows, j0, j1, w);
            switch (rows) { /* a constant count of W's rows: their sums stay in registers */
            case 12: GEMM_TILES512(12); break;
            case 11: GEMM_TILES512(11); break;
            case 10: GEMM_TILES512(10); break;
            case 9: GEMM_TILES512(9); break;
            case 8: GEMM_TILES512(8); break;
            case 7: GEMM_TILES512(7); break;
            case 6: GEMM_TILES512(6); break;
            case 5: GEMM_TILES512(5); break;
            case 4: GEMM_TILES512(4); break;
            case 3: GEMM_TILES512(3); break;
            case 2: GEMM_TILES512(2); break;
            default: GEMM_TILES512(1); break;
            }
        }
        for (int i = 0; i < M; i++)
            for (int rr = 0; rr < rows; rr++) c[(long)i * ldc + r + rr] = sums[(i / 32) * 384 + rr * 32 + i % 32];
    }
    return 1;
}

/* ---- the same products on AMX tiles (bfloat16), where the CPU has them ---------------------------------
 * Past ~16 rows the float32 kernels above are compute-bound. AMX multiplies 16x32 bfloat16 tiles in one
 * instruction: a tile of 16 rows of W (their quantized values q, exact in bfloat16) by one of x for 16 rows
 * of A and one group, giving each (row of W, row of A) its group's q . x in float32, which is scaled then as
 * the 8-bit kernels do: scale * (q . x) + bias * sum(x). x is split into three bfloat16 parts (hi + mid +
 * lo == x), so only the order of the float32 sums differs from the one-row kernels: a row's results still
 * depend on nothing but that row, yet may differ in the last bits from what qgemv gives it alone. */
static int amx_min_rows = 1 << 30; /* products of fewer rows keep the kernels above (huge: AMX off) */
static int amx_state;              /* 0 not asked yet, 1 usable, -1 not */

static int amx_usable(void) {
    if (amx_state) return amx_state > 0;
    unsigned a, b, c, d, a1 = 0, b1, c1, d1;
    int ok = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 22 & 1) && /* AMX-TILE, -BF16 */
             __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && (a1 >> 5 & 1) &&               /* AVX512_BF16 */
             kernels() == 2;
    /* Linux hands a process the tiles' state only when asked (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
    if (ok) ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    amx_state = ok ? 1 : -1;
    return ok;
}

/* Products of at least `rows` rows go to AMX where the CPU has it (0: never); whether it has it. */
int mlxpipe_qgemm_amx(int rows) {
    int ok = amx_usable();
    amx_min_rows = ok && rows > 0 ? rows : 1 << 30;
    return ok;
}

enum { TILE = 1024 }; /* bytes of one tile: 16 rows of 64 */

/* r[n][i] -> r[i][n], 16 x 16 floats (or any 32-bit values) in registers */
__attribute__((target("avx512f"), always_inline)) static inline void transpose16(__m512 *r) {
    __m512 t[16];
    _Pragma("GCC unroll 8") for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 16; i += 4) {
        __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]), c = _mm512_castps_pd(t[i + 2]),
                d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

/* A's rows, once a product, as AMX's second operand: per group g and block of 16 rows, three 16x16 tiles
 * of dword pairs (hi, mid, lo; pair p of a row = its values 2p, 2p + 1 in the group's order, the 4-bit
 * layout's low nibbles then high ones), then the rows' group sums (16 floats). Rows past M are zeros. */
__attribute__((target("avx512f,avx512bw,avx512bf16,fma"))) static void
amx_pack(const qmat *m, int M, const float *a, int lda, uint8_t *xt, float *xs, int blocks) {
    int groups = m->k / 32;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    uint32_t rows[3][256] __attribute__((aligned(64))); /* [part][row i][pair p] */
    for (int ib = 0; ib < blocks; ib++)
        for (int g = 0; g < groups; g++) {
            float *sums = xs + ((long)g * blocks + ib) * 16;
            for (int i = 0; i < 16; i++) {
                int row = ib * 16 + i;
                __m512 v0 = _mm512_setzero_ps(), v1 = v0;
                if (row < M) {
                    v0 = _mm512_loadu_ps(a + (long)row * lda + g * 32);
                    v1 = _mm512_loadu_ps(a + (long)row * lda + g * 32 + 16);
                }
                sums[i] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
                if (m->bits == 4) { /* the group's even columns, then its odd ones */
                    __m512 e = _mm512_permutex2var_ps(v0, even, v1), o = _mm512_permutex2var_ps(v0, odd, v1);
                    v0 = e, v1 = o;
                }
                for (int part = 0; part < 3; part++) {
                    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* v0 -> low 16, v1 -> high 16 */
                    _mm512_store_si512((__m512i *)rows[part] + i, h);
                    /* what that part holds, back in float32: the rest goes to the next part */
                    __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
                    __m512 h1 = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
                    v0 = _mm512_sub_ps(v0, h0), v1 = _mm512_sub_ps(v1, h1);
                }
            }
            /* a tile's row p holds pair p of each of the 16 rows (AMX's layout for its second operand): the
             * 16 x 16 pairs transposed in registers (cheaper than 16 gathers a part) */
            uint8_t *tiles = xt + ((long)g * blocks + ib) * 3 * TILE;
            for (int part = 0; part < 3; part++) {
                __m512 r[16];
                float *tile = (float *)(tiles + part * TILE);
                _Pragma("GCC unroll 16") for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps((float *)rows[part] + i * 16);
                transpose16(r);
                _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) _mm512_store_ps(tile + p * 16, r[p]);
            }
        }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

/* Rows [nb, nb + valid) of W, every group, as bfloat16 q (exact) in tiles of 16 rows of 32, wt + g * 512 for
 * group g (rows past `valid` zeros; 4 bits as the group's low nibbles, then its high ones: amx_pack orders x
 * alike). Decoded for a whole pass of rows before the tiles read it (a tile loaded right after the stores
 * that wrote it waited for them), while the next pass's bytes, scales and biases are fetched. */
__attribute__((target("avx512f,avx512bw,avx512bf16,fma"))) static void amx_decode(const qmat *m, int nb, int valid,
                                                                                   uint16_t *wt) {
    int k = m->k, groups = k / 32;
    long stride = (long)k * m->bits / 8;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* a group's 16 bytes twice as words, the second copy shifted down 4: its low nibbles, then its high
     * ones; vpermw reads the low 5 bits of each, so the table holds bf16(i & 15) twice */
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(iota, iota);
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (int n = 0; n < 16; n++) {
        const uint8_t *q = m->q + (long)(nb + n) * stride;
        __m512i *row = (__m512i *)wt + n;
        if (nb + 16 + n < m->n) { /* the same row of the next pass: fetched meanwhile */
            for (long at = 0; at < stride; at += 64) _mm_prefetch((const char *)q + 16 * stride + at, _MM_HINT_T0);
            long next = (long)(nb + 16 + n) * groups;
            for (int at = 0; at < groups; at += 16) {
                _mm_prefetch((const char *)(m->scales + next + at), _MM_HINT_T0);
                _mm_prefetch((const char *)(m->biases + next + at), _MM_HINT_T0);
            }
        }
        if (n >= valid)
            for (int g = 0; g < groups; g++) _mm512_store_si512(row + g * 16, _mm512_setzero_si512());
        else if (m->bits == 4)
            for (int g = 0; g < groups; g++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(q + g * 16));
                __m512i b = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(bytes));
                _mm512_store_si512(row + g * 16, _mm512_permutexvar_epi16(_mm512_srlv_epi16(b, shifts), table));
            }
        else
            for (int g = 0; g < groups; g++) {
                const __m128i *at = (const __m128i *)(q + g * 32);
                __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at)));
                __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(at + 1)));
                _mm512_store_si512(row + g * 16, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
    }
}

/* acc (16 rows of W, each a register of 16 rows of A) += scale * dots + bias * sums, for one group */
__attribute__((target("avx512f,fma"), always_inline)) static inline void
amx_scale(__m512 *acc, const float *dots, const float *s, const float *b, __m512 sums) {
    _Pragma("GCC unroll 16") for (int n = 0; n < 16; n++) {
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(dots + n * 16), _mm512_set1_ps(s[n]), acc[n]);
        acc[n] = _mm512_fmadd_ps(sums, _mm512_set1_ps(b[n]), v);
    }
}

/* The pass's scales and biases, 16 a group (rows past `valid` repeat the last one's: their sums are never
 * written), transposed 16 groups at a time: scale[g * 16 + n], then the biases alike. */
__attribute__((target("avx512f"))) static void amx_scales(const qmat *m, int nb, int valid, float *scale) {
    int groups = m->k / 32;
    for (int part = 0; part < 2; part++)
        for (int g0 = 0; g0 < groups; g0 += 16) {
            const float *from = (part ? m->biases : m->scales) + g0;
            __mmask16 some = groups - g0 >= 16 ? 0xFFFF : (__mmask16)((1u << (groups - g0)) - 1);
            __m512 r[16];
            _Pragma("GCC unroll 16") for (int n = 0; n < 16; n++) r[n] =
                _mm512_maskz_loadu_ps(some, from + (long)(nb + (n < valid ? n : valid - 1)) * groups);
            transpose16(r);
            for (int j = 0; j < 16 && g0 + j < groups; j++)
                _mm512_store_ps(scale + ((long)part * groups + g0 + j) * 16, r[j]);
        }
}

enum { AMX_PASSES = 8 }; /* passes of 16 rows of W decoded together: A's tiles of a group serve them all */

/* One block of A against `passes` decoded passes of W: every group's tile products, dots[g * passes + s]
 * for pass s. A tile's sums are stored only after the next products are queued, on the other pair of
 * tiles (W 0 or 6, sums 1 or 5): storing them at once waited for the products' whole latency. */
__attribute__((target("amx-tile,amx-bf16"))) static void amx_dots(const uint16_t *wt, const uint8_t *x, long xstep,
                                                                int groups, int passes, float *dots) {
    int units = groups * passes;
    for (int u = 0, g = 0, s = 0; u < units; u++) {
        if (s == 0) { /* A's three parts of group g */
            _tile_loadd(2, x + g * xstep, 64);
            _tile_loadd(3, x + g * xstep + TILE, 64);
            _tile_loadd(4, x + g * xstep + 2 * TILE, 64);
        }
        const uint16_t *w = wt + ((long)s * groups + g) * 512;
        if (u & 1) {
            _tile_loadd(6, w, 64);
            _tile_zero(5);
            _tile_dpbf16ps(5, 6, 2);
            _tile_dpbf16ps(5, 6, 3);
            _tile_dpbf16ps(5, 6, 4);
            _tile_stored(1, dots + (long)(u - 1) * 256, 64);
        } else {
            _tile_loadd(0, w, 64);
            _tile_zero(1);
            _tile_dpbf16ps(1, 0, 2);
            _tile_dpbf16ps(1, 0, 3);
            _tile_dpbf16ps(1, 0, 4);
            if (u) _tile_stored(5, dots + (long)(u - 1) * 256, 64);
        }
        if (++s == passes) s = 0, g++;
    }
    if (units & 1) _tile_stored(1, dots + (long)(units - 1) * 256, 64);
    else _tile_stored(5, dots + (long)(units - 1) * 256, 64);
}

/* Rows [r0, r1) of c from the packed A: up to AMX_PASSES passes of 16 rows of W decoded at a time, then per
 * block of A their tile products (amx_dots), then each pass's groups scaled in registers and written; 0
 * when memory for the decoded rows ran out. */
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512bf16,fma"))) static int
amx_rows(const qmat *m, const uint8_t *xt, const float *xs, int blocks, int M, float *c, int ldc, int r0, int r1) {
    static __thread uint8_t *scratch;
    static __thread int scratch_groups;
    int groups = m->k / 32;
    long per_pass = (long)groups * (2 * TILE + 32 * sizeof(float)); /* W's tiles, their sums, scales and biases */
    if (groups > scratch_groups) {
        free(scratch);
        scratch = aligned_alloc(64, AMX_PASSES * per_pass);
        scratch_groups = scratch ? groups : 0;
        if (!scratch) return 0;
    }
    uint16_t *wt = (uint16_t *)scratch;
    float *dots = (float *)(scratch + AMX_PASSES * (long)groups * TILE);
    float *scales = (float *)(scratch + AMX_PASSES * 2L * groups * TILE);
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
    long xstep = (long)blocks * 3 * TILE; /* A's tiles of one group to the next */
    for (int s0 = r0; s0 < r1; s0 += 16 * AMX_PASSES) {
        int passes = (r1 - s0 + 15) / 16;
        if (passes > AMX_PASSES) passes = AMX_PASSES;
        for (int s = 0; s < passes; s++) {
            int nb = s0 + 16 * s, valid = r1 - nb < 16 ? r1 - nb : 16;
            amx_decode(m, nb, valid, wt + (long)s * groups * 512);
            amx_scales(m, nb, valid, scales + (long)s * groups * 32);
        }
        for (int ib = 0; ib < blocks; ib++) {
            amx_dots(wt, xt + (long)ib * 3 * TILE, xstep, groups, passes, dots);
            for (int s = 0; s < passes; s++) {
                const float *scale = scales + (long)s * groups * 32, *bias = scale + groups * 16;
                __m512 acc[16];
                _Pragma("GCC unroll 16") for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
                for (int g = 0; g < groups; g++)
                    amx_scale(acc, dots + ((long)g * passes + s) * 256, scale + g * 16, bias + g * 16,
                              _mm512_loadu_ps(xs + ((long)g * blocks + ib) * 16));
                transpose16(acc); /* acc[i]: row i of this block of A, against the pass's 16 rows of W */
                int nb = s0 + 16 * s, valid = r1 - nb < 16 ? r1 - nb : 16;
                __mmask16 mask = (__mmask16)((1u << valid) - 1);
                for (int i = 0; i < 16 && ib * 16 + i < M; i++)
                    _mm512_mask_storeu_ps(c + (long)(ib * 16 + i) * ldc + nb, mask, acc[i]);
            }
        }
    }
    _tile_release();
    return 1;
}
#endif

/* ---- 8-bit activations: integer dot products (AVX-512 VNNI, AVX-VNNI) -----------------------------------
 * Where the CPU has VNNI, a product by an attached matrix (one row, a batch's rows, a prompt's) multiplies
 * integers: each row of A is split per group of W (scale sx = max|x| / 127) into two 8-bit parts, x / sx =
 * q1 + q2 / 256 (|error| <= sx / 512: answers as float32's), or with MLXPIPE_INT8=1 into one, as llama.cpp's
 * CPU products do (faster; greedy answers part from float32's); vpdpbusd multiplies W's 4- to 8-bit values
 * by those bytes, 64 at a time, exactly. Each output then adds, group by group, (scale * sx) * dot +
 * bias * sum(x), by the same float32 operations whatever the number of rows of A and however the rows of W
 * are split between the threads: a row's numbers depend on that row alone, the same at --batch 1 and in any
 * batch or prompt.
 * W is repacked once, on its first such product, 16 rows a register: lane n holds 4 bytes of row n, for
 * 4 bits the values j (low nibble) and j + 4 (high) of 8 consecutive ones, for 8 bits 4 consecutive ones.
 * 2-, 3-, 5- and 6-bit values are kept in as many bits (a 6-bit copy streams 7 bits a weight with its scales,
 * not 9): their low lb bits (4, or 2 below 4 bits) in registers whose byte j holds values j, j + 4, ... lb bits
 * each (as 4-bit ones), their hb high bits (3, 5, 6 bits) in a plane after each unit of vr "values registers"
 * (8 values a row each: vr = 4 / hb); the plane's byte j holds field t = 2 c + h (hb bits at hb t) of the
 * unit's value 8 c + 4 h + j. The tiles join the two in registers (shifts, masks, or) before vpdpbusd: the
 * same bytes as a copy of a byte a value. */
static int i8_wanted = 2; /* 8-bit parts an activation is split into: 0 (the float32 kernels), 1, 2 (gemv.py) */
#ifdef X86_AVX512
enum { I8_W = 32, I8_AHEAD = 16384 }; /* a tile's rows of W (two registers of 16); bytes fetched ahead */
static int i8_cpu = -1;

/* The kernels the integer products take here: 2 AVX-512 VNNI's, 1 AVX-VNNI's, 3 AVX2's alone (below 8 bits
 * vpmaddubsw, vpaddw, vpmaddwd and vpaddd in vpdpbusd's place, as llama.cpp's AVX2 dots, exact: a value's byte
 * products stay below 2^15; 8-bit values by vpmaddwd, x's two parts as one 16-bit word: i8_tile256w), 0 none */
static int i8_emulated_allowed = 1;
static int i8_kind(void) {
    if (i8_cpu < 0) {
        unsigned a = 0, b, c, d;
        int avxvnni = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 4 & 1); /* CPUID.(7,1):EAX[4] */
        i8_cpu = (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") ? 2 : 0) |
                 (avxvnni ? 1 : 0);
#ifdef MLXPIPE_WITHOUT_VNNI512
        i8_cpu &= ~2;
#endif
    }
    if (kernels() == 2 && (i8_cpu & 2)) return 2;
    if (kernels() == 1 && (i8_cpu & 1) && i8_emulated_allowed < 2) return 1;
    return kernels() > 0 && i8_emulated_allowed ? 3 : 0;
}

/* the parts that run here: i8_wanted where i8_kind has kernels (for every width), else 0 */
static int i8_runs(void) { return i8_kind() ? i8_wanted : 0; }

/* the parts m's products take: i8_runs(), or two where m's packed copy is its only one (mlxpipe_qmatrix_pack) */
static int i8_parts_for(const qmat *m) {
    int parts = i8_runs();
    if (parts || m->q) return parts;
    int wanted = i8_wanted;
    i8_wanted = 2;
    parts = i8_runs();
    i8_wanted = wanted;
    return parts;
}

/* The bits a value of W takes in its repacked copy: its own (8 for 8-bit ones) */
static int i8_bits(const qmat *m) { return m->bits; }

/* The geometry of a width below 8 bits (above): its low bits, high bits (0: no plane), values registers a
 * unit, and 64-byte registers a unit (its low ones, then its plane) */
static inline int i8_lb(const int bits) { return bits >= 4 ? 4 : 2; }
static inline int i8_hb(const int bits) { return bits == 3 || bits == 5 || bits == 6 ? bits - i8_lb(bits) : 0; }
static inline int i8_vr(const int bits) { return i8_hb(bits) ? 4 / i8_hb(bits) : 4 / i8_lb(bits); }
static inline int i8_lows(const int bits) { return i8_vr(bits) * i8_lb(bits) / 4; }
static inline int i8_unit(const int bits) { return i8_lows(bits) + (i8_hb(bits) > 0); }

/* The register of a group's (64 bytes each) holding values register cc's low bits, and the plane for its high */
static inline int i8_reg(const int bits, int cc) {
    return bits == 8 ? cc : cc / i8_vr(bits) * i8_unit(bits) + cc % i8_vr(bits) * i8_lb(bits) / 4;
}
static inline int i8_plane(const int bits, int cc) { return cc / i8_vr(bits) * i8_unit(bits) + i8_lows(bits); }

/* 64-byte registers a group of 16 rows of W takes */
static int i8_chunks(const qmat *m) { return m->group * i8_bits(m) / 32; }
static int i8_blocks(const qmat *m) { return (m->n + I8_W - 1) / I8_W * (I8_W / 16); }

/* A word's eight 4-bit values, low first, reordered so that byte j holds values j (low nibble) and j + 4. */
static uint32_t nibbles_apart(uint32_t x) {
    x = (x & 0xFF0000FFu) | ((x >> 8) & 0x0000FF00u) | ((x << 8) & 0x00FF0000u);
    return (x & 0xF00FF00Fu) | ((x << 4) & 0x0F000F00u) | ((x >> 4) & 0x00F000F0u);
}

/* Word wd (of 16 lanes' registers) of a row of 2-, 3-, 5- or 6-bit values: of a unit's low bits or its plane */
static uint32_t planes_word(const uint8_t *row, long row_bytes, long wd, int bits) {
    int lb = i8_lb(bits), hb = i8_hb(bits), slot = (int)(wd % i8_unit(bits));
    long first = wd / i8_unit(bits) * 8 * i8_vr(bits); /* the unit's first value */
    uint32_t v = 0;
    if (slot < i8_lows(bits)) { /* byte j: values j + 4 q of the word's 32 / lb, lb bits each */
        for (int j = 0; j < 4; j++)
            for (int q = 0; q < 8 / lb; q++)
                v |= (value_at(row, row_bytes, first + slot * 32 / lb + j + 4 * q, bits) & ((1u << lb) - 1))
                     << (8 * j + lb * q);
        return v;
    }
    for (int c = 0; c < i8_vr(bits); c++)
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                v |= (value_at(row, row_bytes, first + 8 * c + 4 * h + j, bits) >> lb) << (8 * j + hb * (2 * c + h));
    return v;
}

/* Whether every scale and bias of m is a float16 value (a GGUF file's are): then the repacked copy keeps them in
 * 16 bits, the same numbers in a sixth fewer bytes a weight (a one-row product reads W from memory). */
__attribute__((target("f16c"))) static int i8_halves(const qmat *m) {
    if (!i8_half_allowed) return 0;
    long count = (long)m->n * (m->k / m->group);
    for (long i = 0; i < count; i++) {
        float s = m->scales[i], b = m->biases[i];
        if (_cvtsh_ss(_cvtss_sh(s, 0)) != s || _cvtsh_ss(_cvtss_sh(b, 0)) != b) return 0;
    }
    return 1;
}

/* Whether every bias of m is -2^(bits-1) times its scale, exactly: the kernels then compute it from the scale
 * (a product by a power of two: the very number) */
static int i8_symmetric(const qmat *m) {
    if (!i8_symmetric_allowed) return 0;
    long count = (long)m->n * (m->k / m->group);
    float offset = -(float)(1 << (m->bits - 1));
    for (long i = 0; i < count; i++)
        if (m->biases[i] != m->scales[i] * offset) return 0;
    return 1;
}

/* Scale or bias i of a repacked copy's 16 (float16) or 32-bit (float32) ones */
__attribute__((target("f16c"))) static void i8_put(uint8_t *to, long i, int half, float v) {
    if (half) ((uint16_t *)to)[i] = _cvtss_sh(v, 0);
    else ((float *)to)[i] = v;
}

/* W repacked (rows past n zeros), then per block of 16 rows and group the 16 scales, then the biases alike
 * unless symmetric (in 16 bits where i8_halves, setting m->i8_form: racing packers of m set it alike). */
/* The bytes of m's packed copy of `form` (I8_HALF: 16-bit scales and biases; I8_SYMMETRIC: no biases): a
 * multiple of 64 */
static long i8_size(const qmat *m, int form) {
    long groups = m->k / m->group, blocks = i8_blocks(m);
    int tables = form & I8_SYMMETRIC ? 1 : 2;
    return blocks * groups * i8_chunks(m) * 64 + tables * blocks * groups * 16 * (form & I8_HALF ? 2 : 4);
}

static uint8_t *i8_pack(const qmat *m) {
    int n = m->n, groups = m->k / m->group, chunks = i8_chunks(m), blocks = i8_blocks(m);
    long words = (long)m->k * i8_bits(m) / 32, wbytes = (long)blocks * groups * chunks * 64;
    long row_bytes = (long)m->k * m->bits / 8;
    long floats = (long)blocks * groups * 16;
    int half = i8_halves(m), symmetric = i8_symmetric(m);
    int form = (half ? I8_HALF : 0) | (symmetric ? I8_SYMMETRIC : 0);
    uint8_t *p = aligned_alloc(64, i8_size(m, form));
    if (!p) return 0;
    __atomic_store_n(&((qmat *)m)->i8_form, form, __ATOMIC_RELAXED); /* published with p (i8_weights) */
    uint32_t *w = (uint32_t *)p;
    uint8_t *sc = p + wbytes, *bi = sc + floats * (half ? 2 : 4);
    for (int b = 0; b < blocks; b++)
        for (int lane = 0; lane < 16; lane++) {
            long r = (long)b * 16 + lane;
            for (long wd = 0; wd < words; wd++) { /* word wd of a row: group wd / chunks, register wd % chunks */
                uint32_t v = 0;
                if (r < n && m->bits % 4 == 0) memcpy(&v, m->q + (r * words + wd) * 4, 4);
                else if (r < n) v = planes_word(m->q + r * row_bytes, row_bytes, wd, m->bits);
                w[((long)b * groups * chunks + wd) * 16 + lane] = m->bits == 4 ? nibbles_apart(v) : v;
            }
            for (int g = 0; g < groups; g++) {
                i8_put(sc, ((long)b * groups + g) * 16 + lane, half, r < n ? m->scales[r * groups + g] : 0);
                if (!symmetric)
                    i8_put(bi, ((long)b * groups + g) * 16 + lane, half, r < n ? m->biases[r * groups + g] : 0);
            }
        }
    return p;
}

/* m's repacked form, made on first use (two threads may race to make it: one keeps its copy); 0 when memory
 * ran out. */
static const uint8_t *i8_weights(const qmat *m) {
    if (m->group > 256) return 0; /* a group's two parts' integer sums must stay below 2^31 (the tiles) */
    qmat *e = (qmat *)m;
    uint8_t *p = __atomic_load_n(&e->i8, __ATOMIC_ACQUIRE);
    if (p) return p;
    p = i8_pack(m);
    uint8_t *none = 0;
    if (p && !__atomic_compare_exchange_n(&e->i8, &none, p, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        free(p);
        p = none;
    }
    return p;
}

/* An integer product's operands: W repacked (i8_weights), A's bytes in `parts` parts (a row's first part,
 * then its second), each group's scale sx and float32 sum xsum (i8_quantize). */
typedef struct {
    const uint8_t *w;
    const int8_t *xq;
    const float *sx, *xsum;
    int parts;
} i8_input;

/* 16 partial sums added in one fixed order (a tree: lanes i and i + 8, then 4 apart, 2, 1) */
static float lanes_sum(const float *l) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
}

/* lanes_sum of a register's 16 lanes, the same additions in the same order, without a store */
__attribute__((target("avx512f"), always_inline)) static inline float lanes_sum512(__m512 v) {
    __m512 t8 = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));                   /* i + (i + 8) */
    __m128 t = _mm_add_ps(_mm512_castps512_ps128(t8), _mm512_extractf32x4_ps(t8, 1)); /* i + (i + 4) */
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                          /* 0 + 2, 1 + 3 */
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* M rows of A (stride lda) -> bytes xq (M x parts x k: a row's first part, then its second), each group's
 * scale sx and float32 sum xsum (M x groups). x / sx = q1 + q2 / 256: q1 rounded to nearest, q2 the rest
 * rounded (|x / sx - q1 - q2 / 256| <= 1/512, against 1/2 with one part). */
__attribute__((target("avx512f,avx512bw"))) static void i8_quantize(const qmat *m, int parts, int M, const float *a,
                                                                   long lda, int8_t *xq, float *sx, float *xsum) {
    int k = m->k, group = m->group, groups = k / group;
    const __m512 fine = _mm512_set1_ps(256.0f);
    for (int i = 0; i < M; i++)
        for (int g = 0; g < groups; g++) {
            const float *x = a + i * lda + (long)g * group;
            __m512 most = _mm512_setzero_ps(), sum = most;
            for (int j = 0; j < group; j += 16) {
                __m512 v = _mm512_loadu_ps(x + j);
                most = _mm512_max_ps(most, _mm512_abs_ps(v));
                sum = _mm512_add_ps(sum, v);
            }
            float amax = _mm512_reduce_max_ps(most);
            __m512 inverse = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            int8_t *row = xq + (long)i * parts * k + (long)g * group;
            for (int j = 0; j < group; j += 16) {
                __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + j), inverse);
                __m512i q = _mm512_cvtps_epi32(y);
                _mm_storeu_si128((__m128i *)(row + j), _mm512_cvtsepi32_epi8(q));
                if (parts == 2) {
                    __m512 rest = _mm512_mul_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(q)), fine);
                    _mm_storeu_si128((__m128i *)(row + k + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rest)));
                }
            }
            sx[(long)i * groups + g] = amax / 127.0f;
            xsum[(long)i * groups + g] = lanes_sum512(sum);
        }
}

/* i8_quantize with AVX2: the same bytes, scales and sums; with `words` (AVX2 alone) each value's parts as one
 * 16-bit word instead, 256 q1 + q2 (q1 with one part; within +-32640), a row's k words after the row before. */
__attribute__((target("avx2,fma"))) static void i8_quantize256(const qmat *m, int parts, int words, int M,
                                                              const float *a, long lda, int8_t *xq, float *sx,
                                                              float *xsum) {
    int k = m->k, group = m->group, groups = k / group;
    const __m256 fine = _mm256_set1_ps(256.0f), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int i = 0; i < M; i++)
        for (int g = 0; g < groups; g++) {
            const float *x = a + i * lda + (long)g * group;
            __m256 most0 = _mm256_setzero_ps(), most1 = most0, sum0 = most0, sum1 = most0;
            for (int j = 0; j < group; j += 16) { /* lanes 0-7 and 8-15 of the AVX-512 version's registers */
                __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
                most0 = _mm256_max_ps(most0, _mm256_and_ps(v0, magnitude));
                most1 = _mm256_max_ps(most1, _mm256_and_ps(v1, magnitude));
                sum0 = _mm256_add_ps(sum0, v0), sum1 = _mm256_add_ps(sum1, v1);
            }
            float lanes[16], amax = 0;
            _mm256_storeu_ps(lanes, _mm256_max_ps(most0, most1));
            for (int l = 0; l < 8; l++) amax = lanes[l] > amax ? lanes[l] : amax;
            __m256 inverse = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            int8_t *row = xq + (long)i * parts * k + (long)g * group;
            for (int j = 0; j < group; j += 8) {
                __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + j), inverse);
                __m256i q = _mm256_cvtps_epi32(y);
                int32_t first[8], second[8];
                _mm256_storeu_si256((__m256i *)first, q);
                if (parts == 2)
                    _mm256_storeu_si256((__m256i *)second,
                                        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_sub_ps(y, _mm256_cvtepi32_ps(q)), fine)));
                for (int l = 0; l < 8; l++) { /* saturated, as vpmovsdb */
                    int8_t q1 = (int8_t)(first[l] > 127 ? 127 : first[l] < -128 ? -128 : first[l]), q2 = 0;
                    if (parts == 2) q2 = (int8_t)(second[l] > 127 ? 127 : second[l] < -128 ? -128 : second[l]);
                    if (words) {
                        ((int16_t *)xq)[(long)i * k + (long)g * group + j + l] = (int16_t)(q1 * (parts == 2 ? 256 : 1) + q2);
                        continue;
                    }
                    row[j + l] = q1;
                    if (parts == 2) row[k + j + l] = q2;
                }
            }
            _mm256_storeu_ps(lanes, sum0);
            _mm256_storeu_ps(lanes + 8, sum1);
            sx[(long)i * groups + g] = amax / 127.0f;
            xsum[(long)i * groups + g] = lanes_sum(lanes);
        }
}

/* 16 scales (or biases) from element i of a repacked copy's, 16- or 32-bit (`half` in scope) */
#define I8_SCALES512(p, i)                                                                                    \
    (half ? _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)((p) + 2 * (long)(i))))                      \
          : _mm512_load_ps((const float *)(p) + (i)))

/* v's 16-bit lanes shifted left by s (right by -s where s < 0), s a constant after unrolling */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline __m512i shifted512(__m512i v, int s) {
    return s > 0 ? _mm512_slli_epi16(v, s) : s < 0 ? _mm512_srli_epi16(v, -s) : v;
}

/* Values register cc of a group of W's two blocks (at wg and wg + bstride) as the bytes vpdpbusd multiplies:
 * v[0], v[1] the values x's 4 bytes at cc * step meet (step: 4 bytes for 8 bits, else 8), v[2], v[3] (below 8
 * bits) those the next 4 meet: the low bits (shifted down to bit 0, masked), with fields 2 c and 2 c + 1 of the
 * unit's plane moved up to bit lb and or-ed in (0xF8: a | b & c). */
__attribute__((target("avx512f,avx512bw"), always_inline)) static inline void
i8_values512(const int bits, const uint8_t *wg, long bstride, int cc, __m512i *v) {
    const int at = i8_reg(bits, cc), lb = i8_lb(bits), hb = i8_hb(bits), c = bits == 8 ? 0 : cc % i8_vr(bits);
    const int down = c % (4 / lb) * 4, t = 2 * c; /* (2 bits: two values registers a low register) */
    __m512i v0 = _mm512_load_si512(wg + at * 64), v1 = _mm512_load_si512(wg + bstride + at * 64);
    if (bits == 8) {
        v[0] = v[2] = v0, v[1] = v[3] = v1;
        return;
    }
    const __m512i low = _mm512_set1_epi8((char)((1 << lb) - 1));
    v[0] = _mm512_and_si512(shifted512(v0, -down), low), v[2] = _mm512_and_si512(shifted512(v0, -down - lb), low);
    v[1] = _mm512_and_si512(shifted512(v1, -down), low), v[3] = _mm512_and_si512(shifted512(v1, -down - lb), low);
    if (hb) {
        const __m512i high = _mm512_set1_epi8((char)(((1 << hb) - 1) << lb));
        const int plane = i8_plane(bits, cc) * 64;
        __m512i p0 = _mm512_load_si512(wg + plane), p1 = _mm512_load_si512(wg + bstride + plane);
        v[0] = _mm512_ternarylogic_epi32(v[0], shifted512(p0, lb - hb * t), high, 0xF8);
        v[1] = _mm512_ternarylogic_epi32(v[1], shifted512(p1, lb - hb * t), high, 0xF8);
        v[2] = _mm512_ternarylogic_epi32(v[2], shifted512(p0, lb - hb * (t + 1)), high, 0xF8);
        v[3] = _mm512_ternarylogic_epi32(v[3], shifted512(p1, lb - hb * (t + 1)), high, 0xF8);
    }
}

/* 32 rows of W (two blocks of 16, w and w + bstride) by R rows of A (x, each row `parts` parts of k bytes):
 * c[i][0..32) under the masks. CH: W's registers a group when a constant (groups of 32), else 0 (chunks). */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"), always_inline)) static inline void
i8_tile(const int R, const int bits, const int P, const int CH, int groups, int chunks, const uint8_t *w,
        long bstride, const uint8_t *sc, const uint8_t *bi, long sstride, int half, const int8_t *xq, int k,
        int group, const float *sx, const float *xsum, float *c, int ldc, __mmask16 m0, __mmask16 m1) {
    const int es = half ? 2 : 4; /* bytes a scale or bias */
    const int ch = CH ? CH : chunks, step = bits == 8 ? 4 : 8; /* x's bytes a register of values takes */
    const int values = bits == 8 ? ch : group / 8; /* values registers a group (i8_values512) */
    const long row = (long)P * k;
    __m512 f0[R], f1[R];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) f0[i] = f1[i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i d0[R], d1[R], e0[R], e1[R]; /* sums by the first parts, by the second */
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) d0[i] = d1[i] = e0[i] = e1[i] = _mm512_setzero_si512();
        const uint8_t *wg = w + (long)g * ch * 64;
        const int8_t *xg = xq + (long)g * group;
        /* W read from memory at a single row's speed outruns the CPU's own prefetching (as the one-row
         * kernels'). The tile's two blocks lie one after the other, read side by side: the bytes ahead are
         * fetched as one stream, two lines a step; scales and biases alike, a group a step. */
        const char *ahead = (const char *)sc + (I8_AHEAD / ch + g * 128) / 4 * es;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        if (bi) {
            ahead = (const char *)bi + (I8_AHEAD / ch + g * 128) / 4 * es;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
        }
        _Pragma("GCC unroll 8") for (int cc = 0; cc < values; cc++) {
            ahead = (const char *)w + I8_AHEAD + ((long)g * ch + i8_reg(bits, cc)) * 128;
            _mm_prefetch(ahead, _MM_HINT_T0);
            _mm_prefetch(ahead + 64, _MM_HINT_T0);
            if (bits != 8 && i8_hb(bits) && cc % i8_vr(bits) == i8_vr(bits) - 1) { /* the unit's plane */
                ahead = (const char *)w + I8_AHEAD + ((long)g * ch + i8_plane(bits, cc)) * 128;
                _mm_prefetch(ahead, _MM_HINT_T0);
                _mm_prefetch(ahead + 64, _MM_HINT_T0);
            }
            __m512i v[4];
            i8_values512(bits, wg, bstride, cc, v);
            const __m512i lo0 = v[0], lo1 = v[1], hi0 = v[2], hi1 = v[3];
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                    const int8_t *at = xg + i * row + p * k + cc * step;
                    int32_t xa;
                    memcpy(&xa, at, 4);
                    __m512i a = _mm512_set1_epi32(xa), *s0 = p ? e0 : d0, *s1 = p ? e1 : d1;
                    s0[i] = _mm512_dpbusd_epi32(s0[i], lo0, a);
                    s1[i] = _mm512_dpbusd_epi32(s1[i], lo1, a);
                    if (bits != 8) { /* the high nibbles: the next 4 values of x */
                        int32_t xb;
                        memcpy(&xb, at + 4, 4);
                        __m512i b = _mm512_set1_epi32(xb);
                        s0[i] = _mm512_dpbusd_epi32(s0[i], hi0, b);
                        s1[i] = _mm512_dpbusd_epi32(s1[i], hi1, b);
                    }
                }
            }
        }
        __m512 s0 = I8_SCALES512(sc, g * 16), s1 = I8_SCALES512(sc, sstride + g * 16);
        const __m512 offset = _mm512_set1_ps(-(float)(1 << (bits - 1))); /* (bi 0: a symmetric copy's) */
        __m512 b0 = bi ? I8_SCALES512(bi, g * 16) : _mm512_mul_ps(s0, offset);
        __m512 b1 = bi ? I8_SCALES512(bi, sstride + g * 16) : _mm512_mul_ps(s1, offset);
        if (P == 2) { /* the sums as integers d * 256 + e (below 2^31 up to groups of 256): W's scale / 256 */
            const __m512 fine = _mm512_set1_ps(1.0f / 256);
            s0 = _mm512_mul_ps(s0, fine), s1 = _mm512_mul_ps(s1, fine);
        }
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            __m512 scale = _mm512_set1_ps(sx[(long)i * groups + g]), sum = _mm512_set1_ps(xsum[(long)i * groups + g]);
            __m512 t0 = _mm512_cvtepi32_ps(d0[i]), t1 = _mm512_cvtepi32_ps(d1[i]);
            if (P == 2) {
                t0 = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(d0[i], 8), e0[i]));
                t1 = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(d1[i], 8), e1[i]));
            }
            f0[i] = _mm512_fmadd_ps(b0, sum, _mm512_fmadd_ps(t0, _mm512_mul_ps(s0, scale), f0[i]));
            f1[i] = _mm512_fmadd_ps(b1, sum, _mm512_fmadd_ps(t1, _mm512_mul_ps(s1, scale), f1[i]));
        }
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
        _mm512_mask_storeu_ps(c + (long)i * ldc, m0, f0[i]);
        _mm512_mask_storeu_ps(c + (long)i * ldc + 16, m1, f1[i]);
    }
}

/* one tile of R_ rows of A, with the bits, parts and (groups of 32) count of registers as constants */
/* one tile of R_ rows of A, with the width, parts and (groups of 32) count of registers as constants: 4, 6
 * and 8 bits (the common ones; I8_TILE_RARE: 2, 3 and 5, fewer kinds of tiles for a shorter build) */
#define I8_TILE(R_, P_)                                                                                       \
    do {                                                                                                      \
        int bits_ = i8_bits(m), g32_ = m->group == 32;                                                        \
        if (bits_ == 4 && g32_)                                                                               \
            i8_tile(R_, 4, P_, 4, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, 32, s, t, cr, ldc, m0, m1); \
        else if (bits_ == 4)                                                                                  \
            i8_tile(R_, 4, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
        else if (bits_ == 6 && g32_)                                                                          \
            i8_tile(R_, 6, P_, 6, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, 32, s, t, cr, ldc, m0, m1); \
        else if (bits_ == 6)                                                                                  \
            i8_tile(R_, 6, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
        else if (g32_)                                                                                        \
            i8_tile(R_, 8, P_, 8, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, 32, s, t, cr, ldc, m0, m1); \
        else                                                                                                  \
            i8_tile(R_, 8, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
    } while (0)
#define I8_TILE_RARE(R_, P_)                                                                                  \
    do {                                                                                                      \
        if (i8_bits(m) == 5)                                                                                  \
            i8_tile(R_, 5, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
        else if (i8_bits(m) == 3)                                                                             \
            i8_tile(R_, 3, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
        else                                                                                                  \
            i8_tile(R_, 2, P_, 0, groups, chunks, wb, bstride, sc, bi, sstride, half, x, k, m->group, s, t, cr, ldc, m0, m1); \
    } while (0)

/* MLXPIPE_WITHOUT_VNNI512 (gemv.py, on a CPU without AVX-512 VNNI): left out, the costliest tiles to compile */
#ifndef MLXPIPE_WITHOUT_VNNI512
/* Rows [r0, r1) of c (r0 a multiple of 32) from M rows of A: every 8 rows of A (4 with two parts: the sums'
 * registers) against the whole stretch of W (kept in L2 meanwhile); fewer rows in tiles of 4, 2 and 1 (each
 * row's sums are the same in any tile: fewer kinds of tiles, a shorter build). */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) static void i8_rows(const qmat *m, const i8_input *in,
                                                                             int M, float *c, int ldc, int r0,
                                                                             int r1) {
    const uint8_t *p = in->w;
    int parts = in->parts, k = m->k, groups = k / m->group, chunks = i8_chunks(m), blocks = i8_blocks(m), most = parts == 2 ? 4 : 8;
    long bstride = (long)groups * chunks * 64, sstride = (long)groups * 16;
    int form = __atomic_load_n(&m->i8_form, __ATOMIC_RELAXED), half = form & I8_HALF, es = half ? 2 : 4;
    const uint8_t *scales = p + blocks * bstride;
    const uint8_t *biases = form & I8_SYMMETRIC ? 0 : scales + blocks * sstride * es;
    int rare = i8_bits(m) == 2 || i8_bits(m) == 3 || i8_bits(m) == 5; /* tiles of `most` rows or of one */
    for (int i0 = 0, rows; i0 < M; i0 += rows) {
        int left = M - i0;
        rows = left >= most ? most : rare ? 1 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
        const int8_t *x = in->xq + (long)i0 * parts * k;
        const float *s = in->sx + (long)i0 * groups, *t = in->xsum + (long)i0 * groups;
        for (int r = r0; r < r1; r += I8_W) {
            int valid = r1 - r < I8_W ? r1 - r : I8_W, b = r / 16;
            __mmask16 m0 = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);
            __mmask16 m1 = valid >= 32 ? 0xFFFF : valid > 16 ? (__mmask16)((1u << (valid - 16)) - 1) : 0;
            const uint8_t *wb = p + b * bstride;
            const uint8_t *sc = scales + b * sstride * es, *bi = biases ? biases + b * sstride * es : 0;
            float *cr = c + (long)i0 * ldc + r;
            if (rare && parts == 1) {
                if (rows == 8) I8_TILE_RARE(8, 1);
                else I8_TILE_RARE(1, 1);
                continue;
            } else if (rare) {
                if (rows == 4) I8_TILE_RARE(4, 2);
                else I8_TILE_RARE(1, 2);
                continue;
            }
            switch (parts * 16 + rows) { /* a constant count of rows: their sums stay in registers */
            case 24: I8_TILE(8, 1); break;
            case 20: I8_TILE(4, 1); break;
            case 18: I8_TILE(2, 1); break;
            case 17: I8_TILE(1, 1); break;
            case 36: I8_TILE(4, 2); break;
            case 34: I8_TILE(2, 2); break;
            default: I8_TILE(1, 2); break;
            }
        }
    }
}
#endif
/* 8 scales (or biases) from element i of a repacked copy's, 16- or 32-bit (`half` in scope) */
#define I8_SCALES256(p, i)                                                                                    \
    (half ? _mm256_cvtph_ps(_mm_load_si128((const __m128i *)((p) + 2 * (long)(i))))                         \
          : _mm256_load_ps((const float *)(p) + (i)))

/* group g's 16 scales and biases (a symmetric copy's biases: -2^(bits-1) times its scales), x's two parts'
 * 1/256 folded into the scales: what the AVX2 tiles multiply their integer sums by */
__attribute__((target("avx2,f16c"), always_inline)) static inline void
i8_scales256(const uint8_t *sc, const uint8_t *bi, int half, int bits, int P, int g, __m256 *s0, __m256 *s1,
             __m256 *b0, __m256 *b1) {
    const __m256 offset = _mm256_set1_ps(-(float)(1 << (bits - 1)));
    *s0 = I8_SCALES256(sc, g * 16), *s1 = I8_SCALES256(sc, g * 16 + 8);
    *b0 = bi ? I8_SCALES256(bi, g * 16) : _mm256_mul_ps(*s0, offset);
    *b1 = bi ? I8_SCALES256(bi, g * 16 + 8) : _mm256_mul_ps(*s1, offset);
    if (P == 2) {
        const __m256 fine = _mm256_set1_ps(1.0f / 256);
        *s0 = _mm256_mul_ps(*s0, fine), *s1 = _mm256_mul_ps(*s1, fine);
    }
}

/* f += t * s * scale + b * sum: one group's integer sums t of a row of A (its scale and sum) into the row's 16
 * columns */
__attribute__((target("avx2,fma"), always_inline)) static inline void
i8_fold256(__m256 s0, __m256 s1, __m256 b0, __m256 b1, float scale, float sum, __m256 t0, __m256 t1, __m256 *f0,
           __m256 *f1) {
    const __m256 x = _mm256_set1_ps(scale), y = _mm256_set1_ps(sum);
    *f0 = _mm256_fmadd_ps(b0, y, _mm256_fmadd_ps(t0, _mm256_mul_ps(s0, x), *f0));
    *f1 = _mm256_fmadd_ps(b1, y, _mm256_fmadd_ps(t1, _mm256_mul_ps(s1, x), *f1));
}

/* the R rows of a tile's 16 columns into C, the first `valid` of them */
__attribute__((target("avx2"), always_inline)) static inline void
i8_store256(const int R, const __m256 *f0, const __m256 *f1, float *c, int ldc, int valid) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), iota);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid - 8), iota);
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
        _mm256_maskstore_ps(c + (long)i * ldc, m0, f0[i]);
        _mm256_maskstore_ps(c + (long)i * ldc + 8, m1, f1[i]);
    }
}

/* shifted512 with AVX2 */
__attribute__((target("avx2"), always_inline)) static inline __m256i shifted256(__m256i v, int s) {
    return s > 0 ? _mm256_slli_epi16(v, s) : s < 0 ? _mm256_srli_epi16(v, -s) : v;
}

/* i8_values512 with AVX2, for one block (at wg): v[0], v[1] its 64-byte register's halves (rows 0-7, 8-15) */
__attribute__((target("avx2"), always_inline)) static inline void i8_values256(const int bits, const uint8_t *wg,
                                                                             int cc, __m256i *v) {
    const int at = i8_reg(bits, cc), lb = i8_lb(bits), hb = i8_hb(bits), c = bits == 8 ? 0 : cc % i8_vr(bits);
    const int down = c % (4 / lb) * 4, t = 2 * c;
    __m256i v0 = _mm256_load_si256((const __m256i *)(wg + at * 64));
    __m256i v1 = _mm256_load_si256((const __m256i *)(wg + at * 64 + 32));
    if (bits == 8) {
        v[0] = v[2] = v0, v[1] = v[3] = v1;
        return;
    }
    const __m256i low = _mm256_set1_epi8((char)((1 << lb) - 1));
    v[0] = _mm256_and_si256(shifted256(v0, -down), low), v[2] = _mm256_and_si256(shifted256(v0, -down - lb), low);
    v[1] = _mm256_and_si256(shifted256(v1, -down), low), v[3] = _mm256_and_si256(shifted256(v1, -down - lb), low);
    if (hb) {
        const __m256i high = _mm256_set1_epi8((char)(((1 << hb) - 1) << lb));
        const int plane = i8_plane(bits, cc) * 64;
        __m256i p0 = _mm256_load_si256((const __m256i *)(wg + plane));
        __m256i p1 = _mm256_load_si256((const __m256i *)(wg + plane + 32));
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(shifted256(p0, lb - hb * t), high));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(shifted256(p1, lb - hb * t), high));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(shifted256(p0, lb - hb * (t + 1)), high));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(shifted256(p1, lb - hb * (t + 1)), high));
    }
}

/* acc + vpdpbusd(w, x) by AVX-VNNI, as inline assembly: the AVX2 tiles are built for AVX2 alone (one build for
 * the emulated products below) and run this only where the CPU has it */
__attribute__((target("avx2"), always_inline)) static inline __m256i dpbusd256(__m256i acc, __m256i w, __m256i x) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
}

/* dpbusd256(dpbusd256(acc, w, x), v, y) by AVX2 alone: the bytes' products summed in 16 bits (vpmaddubsw twice,
 * vpaddw: exact while w, v < 64, at most 4 * 63 * 128 < 2^15), then in pairs into 32 bits (vpmaddwd by ones) */
__attribute__((target("avx2"), always_inline)) static inline __m256i
dpbusd_pair256(__m256i acc, __m256i w, __m256i x, __m256i v, __m256i y) {
    const __m256i h = _mm256_add_epi16(_mm256_maddubs_epi16(w, x), _mm256_maddubs_epi16(v, y));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(h, _mm256_set1_epi16(1)));
}

/* i8_tile with AVX2: one block of 16 rows of W, as two registers of 8 (a packed register's halves), by R rows of
 * A; V: by AVX-VNNI, else (below 8 bits) each pair of vpdpbusd by AVX2 alone (dpbusd_pair256). The same
 * integers, the same operations after them lane by lane: the same numbers. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
i8_tile256(const int V, const int R, const int bits, const int P, const int CH, int groups, int chunks, const uint8_t *w,
           const uint8_t *sc, const uint8_t *bi, int half, const int8_t *xq, int k, int group, const float *sx,
           const float *xsum, float *c, int ldc, int valid) {
    const int es = half ? 2 : 4;
    const int ch = CH ? CH : chunks, step = bits == 8 ? 4 : 8;
    const int values = bits == 8 ? ch : group / 8;
    const long row = (long)P * k;
    __m256 f0[R], f1[R];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) f0[i] = f1[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i d0[R], d1[R], e0[R], e1[R];
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) d0[i] = d1[i] = e0[i] = e1[i] = _mm256_setzero_si256();
        const uint8_t *wg = w + (long)g * ch * 64;
        const int8_t *xg = xq + (long)g * group;
        _mm_prefetch((const char *)sc + (I8_AHEAD / ch + g * 64) / 4 * es, _MM_HINT_T0);
        if (bi) _mm_prefetch((const char *)bi + (I8_AHEAD / ch + g * 64) / 4 * es, _MM_HINT_T0);
        _Pragma("GCC unroll 8") for (int cc = 0; cc < values; cc++) {
            const int reg = i8_reg(bits, cc);
            _mm_prefetch((const char *)wg + I8_AHEAD + reg * 64, _MM_HINT_T0);
            if (bits != 8 && i8_hb(bits) && cc % i8_vr(bits) == i8_vr(bits) - 1)
                _mm_prefetch((const char *)wg + I8_AHEAD + i8_plane(bits, cc) * 64, _MM_HINT_T0);
            __m256i v[4];
            i8_values256(bits, wg, cc, v);
            const __m256i lo0 = v[0], lo1 = v[1], hi0 = v[2], hi1 = v[3];
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                _Pragma("GCC unroll 2") for (int p = 0; p < P; p++) {
                    const int8_t *at = xg + i * row + p * k + cc * step;
                    int32_t xa;
                    memcpy(&xa, at, 4);
                    __m256i a = _mm256_set1_epi32(xa), *s0 = p ? e0 : d0, *s1 = p ? e1 : d1;
                    if (bits == 8) { /* (V) */
                        s0[i] = dpbusd256(s0[i], lo0, a), s1[i] = dpbusd256(s1[i], lo1, a);
                        continue;
                    }
                    int32_t xb;
                    memcpy(&xb, at + 4, 4);
                    const __m256i b = _mm256_set1_epi32(xb);
                    s0[i] = V ? dpbusd256(dpbusd256(s0[i], lo0, a), hi0, b) : dpbusd_pair256(s0[i], lo0, a, hi0, b);
                    s1[i] = V ? dpbusd256(dpbusd256(s1[i], lo1, a), hi1, b) : dpbusd_pair256(s1[i], lo1, a, hi1, b);
                }
            }
        }
        __m256 s0, s1, b0, b1;
        i8_scales256(sc, bi, half, bits, P, g, &s0, &s1, &b0, &b1);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            __m256 t0 = _mm256_cvtepi32_ps(d0[i]), t1 = _mm256_cvtepi32_ps(d1[i]);
            if (P == 2) {
                t0 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(d0[i], 8), e0[i]));
                t1 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_slli_epi32(d1[i], 8), e1[i]));
            }
            const float scale = sx[(long)i * groups + g], sum = xsum[(long)i * groups + g];
            i8_fold256(s0, s1, b0, b1, scale, sum, t0, t1, &f0[i], &f1[i]);
        }
    }
    i8_store256(R, f0, f1, c, ldc, valid);
}

/* i8_tile with AVX2 alone for 8-bit values (whose byte products vpmaddubsw would saturate): x's words
 * (i8_quantize256's, a value's two parts as one, 256 q1 + q2), 4 at a time, meet W's bytes widened to 16 bits
 * (vpunpck[lh]bw: rows 0, 1, 4, 5 and rows 2, 3, 6, 7 of a register's 8, two words a row) by vpmaddwd
 * (products summed in pairs, exact), and add in 32 bits (below 2^31 up to groups of 256, as the VNNI tiles'
 * d * 256 + e); each row's two sums join by vphaddd, the rows in order. The same integers, the same operations
 * after them lane by lane: the same numbers. */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
i8_tile256w(const int R, const int P, const int CH, int groups, int chunks, const uint8_t *w, const uint8_t *sc,
            const uint8_t *bi, int half, const int8_t *xq, int k, int group, const float *sx, const float *xsum,
            float *c, int ldc, int valid) {
    const int es = half ? 2 : 4, ch = CH ? CH : chunks;
    const int16_t *xw = (const int16_t *)xq;
    const __m256i zero = _mm256_setzero_si256();
    __m256 f0[R], f1[R];
    _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) f0[i] = f1[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i d0[R], e0[R], d1[R], e1[R]; /* a half's rows 0, 1, 4, 5 (d) and 2, 3, 6, 7 (e) */
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) d0[i] = d1[i] = e0[i] = e1[i] = zero;
        const uint8_t *wg = w + (long)g * ch * 64;
        const int16_t *xg = xw + (long)g * group;
        _mm_prefetch((const char *)sc + (I8_AHEAD / ch + g * 64) / 4 * es, _MM_HINT_T0);
        if (bi) _mm_prefetch((const char *)bi + (I8_AHEAD / ch + g * 64) / 4 * es, _MM_HINT_T0);
        _Pragma("GCC unroll 8") for (int cc = 0; cc < ch; cc++) {
            _mm_prefetch((const char *)wg + I8_AHEAD + cc * 64, _MM_HINT_T0);
            __m256i v0 = _mm256_load_si256((const __m256i *)(wg + cc * 64));
            __m256i v1 = _mm256_load_si256((const __m256i *)(wg + cc * 64 + 32));
            const __m256i w0 = _mm256_unpacklo_epi8(v0, zero), w1 = _mm256_unpackhi_epi8(v0, zero);
            const __m256i w2 = _mm256_unpacklo_epi8(v1, zero), w3 = _mm256_unpackhi_epi8(v1, zero);
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
                int64_t xa;
                memcpy(&xa, xg + (long)i * k + cc * 4, 8);
                const __m256i a = _mm256_set1_epi64x(xa);
                d0[i] = _mm256_add_epi32(d0[i], _mm256_madd_epi16(w0, a));
                e0[i] = _mm256_add_epi32(e0[i], _mm256_madd_epi16(w1, a));
                d1[i] = _mm256_add_epi32(d1[i], _mm256_madd_epi16(w2, a));
                e1[i] = _mm256_add_epi32(e1[i], _mm256_madd_epi16(w3, a));
            }
        }
        __m256 s0, s1, b0, b1;
        i8_scales256(sc, bi, half, 8, P, g, &s0, &s1, &b0, &b1);
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {
            __m256 t0 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(d0[i], e0[i]));
            __m256 t1 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(d1[i], e1[i]));
            const float scale = sx[(long)i * groups + g], sum = xsum[(long)i * groups + g];
            i8_fold256(s0, s1, b0, b1, scale, sum, t0, t1, &f0[i], &f1[i]);
        }
    }
    i8_store256(R, f0, f1, c, ldc, valid);
}

/* one tile of R_ rows of A, with V_ (AVX-VNNI or AVX2 alone: below 8 bits), the width, the parts and (groups of
 * 32) the count of registers as constants */
#define I8_TILE256(V_, R_, P_)                                                                                \
    do {                                                                                                      \
        int bits_ = i8_bits(m), g32_ = m->group == 32;                                                        \
        if (bits_ == 4 && g32_)                                                                               \
            i8_tile256(V_, R_, 4, P_, 4, groups, chunks, wb, sc, bi, half, x, k, 32, s, t, cr, ldc, valid);       \
        else if (bits_ == 4)                                                                                  \
            i8_tile256(V_, R_, 4, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (bits_ == 6)                                                                                  \
            i8_tile256(V_, R_, 6, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (bits_ == 5)                                                                                  \
            i8_tile256(V_, R_, 5, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (bits_ == 3)                                                                                  \
            i8_tile256(V_, R_, 3, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (bits_ == 2)                                                                                  \
            i8_tile256(V_, R_, 2, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (V_ && g32_)                                                                                  \
            i8_tile256(V_, R_, 8, P_, 8, groups, chunks, wb, sc, bi, half, x, k, 32, s, t, cr, ldc, valid);       \
        else if (V_)                                                                                          \
            i8_tile256(V_, R_, 8, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid); \
        else if (g32_) /* AVX2 alone: x's words */                                                            \
            i8_tile256w(R_, P_, 8, groups, chunks, wb, sc, bi, half, x, k, 32, s, t, cr, ldc, valid);             \
        else                                                                                                  \
            i8_tile256w(R_, P_, 0, groups, chunks, wb, sc, bi, half, x, k, m->group, s, t, cr, ldc, valid);       \
    } while (0)

/* i8_rows with AVX2 (V: by AVX-VNNI): 16 rows of W a tile, 2 rows of A (1 with two parts: AVX2 has 16
 * registers). */
__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void
i8_rows256(const int V, const qmat *m, const i8_input *in, int M, float *c, int ldc, int r0, int r1) {
    const uint8_t *p = in->w;
    int parts = in->parts, k = m->k, groups = k / m->group, chunks = i8_chunks(m), blocks = i8_blocks(m);
    int most = parts == 2 && V ? 1 : 2;
    long bstride = (long)groups * chunks * 64, sstride = (long)groups * 16;
    int form = __atomic_load_n(&m->i8_form, __ATOMIC_RELAXED), half = form & I8_HALF, es = half ? 2 : 4;
    const uint8_t *scales = p + blocks * bstride;
    const uint8_t *biases = form & I8_SYMMETRIC ? 0 : scales + blocks * sstride * es;
    int rare = i8_bits(m) == 2 || i8_bits(m) == 3 || i8_bits(m) == 5; /* tiles of `most` rows or of one */
    for (int i0 = 0, rows; i0 < M; i0 += rows) {
        rows = M - i0 >= most ? most : rare ? 1 : M - i0;
        const int8_t *x = in->xq + (long)i0 * (V || i8_bits(m) != 8 ? parts : 2) * k; /* (words: 2 bytes) */
        const float *s = in->sx + (long)i0 * groups, *t = in->xsum + (long)i0 * groups;
        for (int r = r0; r < r1; r += 16) {
            int valid = r1 - r < 16 ? r1 - r : 16, b = r / 16;
            const uint8_t *wb = p + b * bstride;
            const uint8_t *sc = scales + b * sstride * es, *bi = biases ? biases + b * sstride * es : 0;
            float *cr = c + (long)i0 * ldc + r;
            if (parts == 2 && rows == 2 && !V) I8_TILE256(V, 2, 2);
            else if (parts == 2) I8_TILE256(V, 1, 2);
            else if (rows == 2) I8_TILE256(V, 2, 1);
            else I8_TILE256(V, 1, 1);
        }
    }
}

__attribute__((target("avx2,fma,f16c"))) static void i8_rows256_vnni(const qmat *m, const i8_input *in, int M,
                                                                   float *c, int ldc, int r0, int r1) {
    i8_rows256(1, m, in, M, c, ldc, r0, r1);
}

__attribute__((target("avx2,fma,f16c"))) static void i8_rows256_emulated(const qmat *m, const i8_input *in, int M,
                                                                       float *c, int ldc, int r0, int r1) {
    i8_rows256(0, m, in, M, c, ldc, r0, r1);
}

/* Whether m's products take x's values as 16-bit words (i8_quantize256, i8_tile256w): 8-bit ones on AVX2 alone */
static int i8_words(const qmat *m) { return i8_kind() == 3 && m->bits == 8; }

/* The quantizing and tiles of the kernels this CPU runs */
static void i8_quantize_any(const qmat *m, int parts, int M, const float *a, long lda, int8_t *xq, float *sx,
                            float *xsum) {
    int kind = i8_kind();
    if (kind == 2) i8_quantize(m, parts, M, a, lda, xq, sx, xsum);
    else i8_quantize256(m, parts, i8_words(m), M, a, lda, xq, sx, xsum);
}

static void i8_rows_any(const qmat *m, const i8_input *in, int M, float *c, int ldc, int r0, int r1) {
    int kind = i8_kind();
#ifndef MLXPIPE_WITHOUT_VNNI512
    if (kind == 2) {
        i8_rows(m, in, M, c, ldc, r0, r1);
        return;
    }
#endif
    (kind == 1 ? i8_rows256_vnni : i8_rows256_emulated)(m, in, M, c, ldc, r0, r1);
}
#endif

/* The 8-bit parts products by attached matrices split activations into here (0: the float32 kernels) */
static int integer_products(void) {
#ifdef X86_AVX512
    return i8_runs();
#else
    return 0;
#endif
}

/* Products by attached matrices from activations in `parts` 8-bit parts (1 or 2; 0: the float32 kernels
 * everywhere; -1: as they are); the parts that run. */
int mlxpipe_qgemm_int8(int parts) {
    if (parts >= 0) i8_wanted = parts > 2 ? 2 : parts;
    return integer_products();
}

/* The kernels the integer products take here: 2 AVX-512 VNNI's, 1 AVX-VNNI's, 3 AVX2's alone, 0 none. */
int mlxpipe_qgemm_int8_kind(void) {
#ifdef X86_AVX512
    return i8_kind();
#else
    return 0;
#endif
}

/* Whether the integer products may run on AVX2 without VNNI (1, the default; 0 not: then the float32 kernels,
 * and 2-, 3-, 5- and 6-bit matrices are not registered; 2 there even where AVX-VNNI is, tests; -1 only asks);
 * the setting. Call before registering any matrix. */
int mlxpipe_qgemm_int8_emulated(int on) {
#ifdef X86_AVX512
    if (on >= 0) i8_emulated_allowed = on;
    return i8_emulated_allowed;
#else
    (void)on;
    return 0;
#endif
}

/* Whether this machine has the kernels above: only then is registering worth it. */
int mlxpipe_qgemv_available(void) {
#ifdef X86_AVX512
    return kernels() > 0;
#else
    return 0;
#endif
}

#ifdef X86_AVX512
static void one_rows(const qmat *m, const float *xe, const float *xo, const float *xsum, const i8_input *i8,
                     float *c);

/* x's sum a group, summed in order, for the kernels that add bias * sum(x) a group: the 8-bit ones and the
 * AVX2 4-bit ones (the AVX-512 4-bit kernels add the bias into each weight and need none). */
static void group_sums(const qmat *m, const float *x, float *sums) {
    if (m->bits == 4 && kernels() == 2) return;
    for (int g = 0; g < m->k / m->group; g++) {
        float t = 0;
        for (int j = 0; j < m->group; j++) t += x[g * m->group + j];
        sums[g] = t;
    }
}
#endif

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
    int parts = i8_parts_for(m);
    const uint8_t *packed = parts ? i8_weights(m) : 0;
    if (!packed && m->bits != 4 && m->bits != 8) return 0; /* only the integer products take these */
    if (packed) { /* x's bytes where xo was, their scales where xe was */
        i8_quantize_any(m, parts, 1, x, k, (int8_t *)xo, xe, xsum);
        one_rows(m, 0, 0, 0, &(i8_input){packed, (const int8_t *)xo, xe, xsum, parts}, c);
    } else {
    group_sums(m, x, xsum);
    if (m->bits == 4) {
        for (int j = 0; j < k / 2; j++) { /* a byte holds values 2j (low nibble) and 2j + 1 (high) */
            xe[j] = x[2 * j];
            xo[j] = x[2 * j + 1];
        }
    } else {
        xe = x; /* the 8-bit kernels read x whole */
    }
    one_rows(m, xe, xo, xsum, 0, c);
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

static long qgemm_calls;
long mlxpipe_qgemm_calls(void) { return qgemm_calls; }

/* Attention's products of many (record, KV head) pairs in one call (attention_batch): pair p's rows of a and c
 * follow one another, its keys (or values) lie pair_stride floats after the pair before's. */
typedef struct {
    int softmax, rep, pairs, n, k, lda, ldb, ldc;
    long pair_stride;
    const float *a, *b;
    float *c;
} attn_t;
static int attention_pairs(const attn_t *t, int p0, int p1);

#ifdef X86_AVX512
/* Rows [r0, r1) of c: every block of MB rows of A against that stretch of W (kept in L2 meanwhile). */
static int qgemm_rows(const qmat *m, int M, const float *a, int lda, float *c, int ldc, int r0, int r1) {
    static __thread float *scratch;
    static __thread long scratch_len;
    int k = m->k, k2 = k / 2, group = m->group, groups = k / group;
    long need = (long)MB * (k + groups);
    if (need > scratch_len) {
        float *grown = realloc(scratch, need * sizeof(float));
        if (!grown) return 0;
        scratch = grown;
        scratch_len = need;
    }
    float *xsum = scratch + (long)MB * k;
    for (int i0 = 0; i0 < M; i0 += MB) {
        int rows = M - i0 < MB ? M - i0 : MB;
        for (int i = 0; i < rows; i++) { /* each row as qgemv prepares it */
            const float *src = a + (long)(i0 + i) * lda;
            float *dst = scratch + (long)i * k;
            if (m->bits == 4)
                for (int j = 0; j < k2; j++) dst[j] = src[2 * j], dst[k2 + j] = src[2 * j + 1];
            else
                memcpy(dst, src, k * sizeof(float));
            group_sums(m, src, xsum + (long)i * groups);
        }
        span_any(m, scratch, xsum, rows, r0, r1, c + (long)i0 * ldc, ldc);
    }
    return 1;
}

/* One helper thread shares large products: both threads take stretches of W from a counter, so the caller
 * never waits for a helper that has not started (beside a busy process it may not get a core), only for a
 * stretch the helper has taken. The helper sleeps on a futex between products: it never spins. */
typedef struct {
    const qmat *m;
    const attn_t *attn; /* attention's pairs, a stretch of them at a time, when not null */
    const float *a;
    float *c;
    int M, lda, ldc, stretch, stretches;
    const uint8_t *xt; /* A packed for AMX (amx_pack), or null: the float32 kernels */
    const float *at;   /* A transposed for the AVX2 GEMM (gemm_pack), or null */
    int mpad;          /* at's row length */
    const float *xs;
    int blocks;
    const float *xe, *xo, *xsum; /* a one-row product's x as qgemv prepares it, when one_row */
    int one_row;
    i8_input i8; /* an integer product's operands (i8.w null: the float32 kernels) */
    atomic_int next, done, failed, sleeping;
} job_t;

static job_t job;
static atomic_int job_gen, job_busy, helper_state; /* helper_state: 0 none, 1 running, -1 could not start */
static int qgemm_threads = 1;

void mlxpipe_qgemm_threads(int threads) { qgemm_threads = threads; }

static void futex(atomic_int *word, int op, int value) { syscall(SYS_futex, word, op, value, NULL, NULL, 0); }

static void futex_wait_ms(atomic_int *word, int value, int ms) {
    struct timespec t = {0, ms * 1000000L};
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, value, &t, NULL, 0);
}

/* Takes stretches until none is left; how many it computed. */
static int work(job_t *j) {
    int count = 0;
    for (int s; (s = atomic_fetch_add(&j->next, 1)) < j->stretches; count++) {
        if (j->attn) {
            int p0 = s * j->stretch, p1 = p0 + j->stretch < j->attn->pairs ? p0 + j->stretch : j->attn->pairs;
            if (!attention_pairs(j->attn, p0, p1)) atomic_store(&j->failed, 1);
            atomic_fetch_add(&j->done, 1);
            if (atomic_load(&j->sleeping)) futex(&j->done, FUTEX_WAKE_PRIVATE, 1);
            continue;
        }
        int r0 = s * j->stretch, r1 = r0 + j->stretch < j->m->n ? r0 + j->stretch : j->m->n;
        if (j->i8.w) i8_rows_any(j->m, &j->i8, j->M, j->c, j->ldc, r0, r1);
        else if (j->one_row && j->m->bits == 4) rows4(j->m, j->xe, j->xo, j->xsum, r0, r1, j->c);
        else if (j->one_row) rows8(j->m, j->xe, j->xsum, r0, r1, j->c);
        else if (j->at ? !(kernels() == 2 ? gemm_rows_avx512 : gemm_rows_avx2)(j->m, j->at, j->mpad, j->M, j->c,
                                                                                 j->ldc, r0, r1)
                 : j->xt ? !amx_rows(j->m, j->xt, j->xs, j->blocks, j->M, j->c, j->ldc, r0, r1)
                         : !qgemm_rows(j->m, j->M, j->a, j->lda, j->c, j->ldc, r0, r1))
            atomic_store(&j->failed, 1);
        atomic_fetch_add(&j->done, 1);
        if (atomic_load(&j->sleeping)) futex(&j->done, FUTEX_WAKE_PRIVATE, 1);
    }
    return count;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

enum { ALONE = 256 }; /* products computed without the helper after it was found slow (about a decode step's) */
static int alone_for, late_in_row;
static long shared_calls, helper_stretches, all_stretches, alone_spells;

/* Products shared with the helper, stretches it computed, stretches in all, spells without it (bench). */
void mlxpipe_qgemm_shared_stats(long *out) {
    out[0] = shared_calls, out[1] = helper_stretches, out[2] = all_stretches, out[3] = alone_spells;
}

static atomic_int helper_asleep; /* set while the helper may be in the futex: only then is it woken */

/* The helper sleeps as soon as it runs out of stretches: polling for the next product was no faster and
 * takes core time from Python's thread. */
static void *helper(void *unused) {
    (void)unused;
    for (int seen = atomic_load(&job_gen);;) {
        while (atomic_load(&job_gen) == seen) {
            atomic_store(&helper_asleep, 1);
            if (atomic_load(&job_gen) == seen) futex(&job_gen, FUTEX_WAIT_PRIVATE, seen);
            atomic_store(&helper_asleep, 0);
        }
        seen = atomic_load(&job_gen);
        work(&job);
    }
    return NULL;
}

/* Computes the job j (the shared one, job_busy taken) with the helper, waiting for the stretches it took;
 * whether the helper kept up (the caller waited for it no longer than 0.2 ms or two stretches' time). */
static int run_shared(job_t *j) {
    atomic_store(&j->next, 0);
    atomic_store(&j->done, 0);
    atomic_store(&j->failed, 0);
    atomic_store(&j->sleeping, 0);
    atomic_fetch_add(&job_gen, 1);
    if (atomic_load(&helper_asleep)) futex(&job_gen, FUTEX_WAKE_PRIVATE, 1);
    double start = now();
    int mine_done = work(j);
    double t0 = now();
    /* only a stretch the helper is computing: spun for briefly, then slept on (a spinning caller would
     * keep a preempted helper off the core it needs) */
    for (int spins = 0, d; (d = atomic_load(&j->done)) < j->stretches; spins++)
        if (spins < 2000) _mm_pause();
        else {
            atomic_store(&j->sleeping, 1);
            if (atomic_load(&j->done) == d) futex_wait_ms(&j->done, d, 1);
        }
    /* Beside a busy process the helper gets no core, or loses it in a stretch: then products go on alone
     * for a while (a waiting caller would collapse a batch, as OpenBLAS's spinning threads did). */
    double waited = now() - t0, stretch_time = mine_done ? (t0 - start) / mine_done : 0;
    shared_calls++;
    helper_stretches += j->stretches - mine_done;
    all_stretches += j->stretches;
    /* A wait of up to twice a stretch's time is the end of a product, not a helper without a core; a helper
     * that woke too late to take many stretches cost the caller nothing (leaving it out for that left a VM
     * whose wake-ups are slow computing alone most of the time). */
    return waited <= (2e-4 > 2 * stretch_time ? 2e-4 : 2 * stretch_time);
}

static int start_helper(void) {
    int state = atomic_load(&helper_state);
    if (state) return state > 0;
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&t, &attr, helper, NULL) == 0;
    pthread_attr_destroy(&attr);
    atomic_store(&helper_state, ok ? 1 : -1);
    return ok;
}

/* The helper for the caller's product (the job's owner until it stores job_busy 0), unless another product
 * holds it or it cannot start; whether taken. */
static int claim_helper(void) {
    if (atomic_exchange(&job_busy, 1)) return 0;
    if (start_helper()) return 1;
    atomic_store(&job_busy, 0);
    return 0;
}

/* Runs j with the claimed helper: one late twice in a row (a VM's one-off delay is not) is left out for the
 * next ALONE products. */
static void run_with_helper(job_t *j) {
    if (run_shared(j)) late_in_row = 0;
    else if (++late_in_row >= 2) alone_for = ALONE, alone_spells++, late_in_row = 0;
}
#endif

enum { SHARED_MIN = 1 << 21 }; /* multiply-adds worth waking the helper for (a 576x576 product of 8 rows) */

/* c (M x n, stride ldc) = alpha a (M x k, stride lda) W^T for a registered W; 0 when it cannot. */
static int qgemm(const qmat *m, int M, const float *a, int lda, float alpha, float *c, int ldc) {
#ifdef X86_AVX512
    enum { AMX_CHUNK = 256 }; /* rows of A packed at a time (a prompt's product can have thousands) */
    int parts = i8_parts_for(m);
    i8_input i8 = {parts ? i8_weights(m) : 0, 0, 0, 0, parts};
    if (i8.w) { /* A quantized once for every stretch, of both threads */
        static __thread float *quantized;
        static __thread long quantized_len;
        long groups = m->k / m->group, need = (long)M * (2 * groups + 2 * m->k / 4); /* (words: 2 bytes a value) */
        if (need > quantized_len) {
            float *grown = realloc(quantized, need * sizeof(float));
            if (!grown) return 0;
            quantized = grown, quantized_len = need;
        }
        float *sx = quantized, *xsum = sx + M * groups;
        int8_t *xq = (int8_t *)(xsum + M * groups);
        i8_quantize_any(m, parts, M, a, lda, xq, sx, xsum);
        i8.xq = xq, i8.sx = sx, i8.xsum = xsum;
    }
    if (!i8.w && m->bits != 4 && m->bits != 8) return 0; /* only the integer products take these */
    if (!i8.w && M > AMX_CHUNK && M >= amx_min_rows && m->group == 32) {
        for (int i0 = 0; i0 < M; i0 += AMX_CHUNK) /* a row's sums do not depend on the rows beside it */
            if (!qgemm(m, M - i0 < AMX_CHUNK ? M - i0 : AMX_CHUNK, a + (long)i0 * lda, lda, alpha, c + (long)i0 * ldc,
                       ldc))
                return 0;
        return 1;
    }
    int amx = !i8.w && M >= amx_min_rows && m->group == 32;
    int gemm = !i8.w && !amx && M >= (kernels() == 2 ? gemm512_min_rows : GEMM_MIN_ROWS) && kernels() > 0;
    if (gemm && M > GEMM_CHUNK) { /* at stays in L2 (a prompt's product can have thousands of rows) */
        for (int i0 = 0; i0 < M; i0 += GEMM_CHUNK)
            if (!qgemm(m, M - i0 < GEMM_CHUNK ? M - i0 : GEMM_CHUNK, a + (long)i0 * lda, lda, alpha,
                       c + (long)i0 * ldc, ldc))
                return 0;
        return 1;
    }
    const float *at = 0;
    int mpad = (M + GEMM_A - 1) / GEMM_A * GEMM_A;
    if (gemm) { /* A transposed once for every stretch, of both threads (before the helper is taken) */
        static __thread float *transposed;
        static __thread long transposed_len;
        long need = (long)m->k * mpad;
        if (need > transposed_len) {
            float *grown = realloc(transposed, need * sizeof(float));
            if (!grown) return 0;
            transposed = grown, transposed_len = need;
        }
        gemm_pack(m, M, a, lda, transposed, mpad);
        at = transposed;
    }
    int n = m->n;
    long row_bytes = (long)m->k * m->bits / 8 + 2L * (m->k / m->group) * sizeof(float);
    int stretch = (int)(CHUNK / row_bytes);
    int big = qgemm_threads > 1 && (long)M * n * m->k >= SHARED_MIN;
    if (big && alone_for > 0) alone_for--, big = 0;
    int shared = big && claim_helper();
    if (shared) { /* about 8 stretches a thread, for balance */
        if (n / 16 + 1 < stretch) stretch = n / 16 + 1;
        /* the GEMM keeps no stretch of W in L2 for A's rows: stretches of ~1M multiply-adds end together */
        if (at && (long)stretch * M * m->k > GEMM_STRETCH) {
            int gw = kernels() == 2 ? GEMM_W16 : GEMM_W;
            stretch = (int)(GEMM_STRETCH / ((long)M * m->k)) / gw * gw;
            if (stretch < gw) stretch = gw;
        }
    }
    if (stretch < 1) stretch = 1;
    if (i8.w) stretch = stretch < I8_W ? I8_W : stretch / I8_W * I8_W; /* whole tiles */
    const uint8_t *xt = 0;
    const float *xs = 0;
    int blocks = (M + 15) / 16;
    if (amx) { /* A packed once for every stretch, of both threads */
        static __thread uint8_t *packed;
        static __thread float *packed_sums;
        static __thread long packed_len;
        long need = (long)blocks * (m->k / 32);
        if (need > packed_len) {
            free(packed), free(packed_sums);
            packed = aligned_alloc(64, need * 3 * TILE);
            packed_sums = malloc(need * 16 * sizeof(float));
            packed_len = packed && packed_sums ? need : 0;
        }
        if (packed_len) {
            amx_pack(m, M, a, lda, packed, packed_sums, blocks);
            xt = packed, xs = packed_sums;
            stretch = stretch < 32 ? 32 : stretch / 32 * 32; /* whole pairs of tiles of W */
        }
    }
    job_t mine = {.m = m, .a = a, .c = c, .M = M, .lda = lda, .ldc = ldc, .stretch = stretch};
    job_t *j = shared ? &job : &mine;
    if (shared) {
        j->m = m, j->a = a, j->c = c, j->M = M, j->lda = lda, j->ldc = ldc, j->stretch = stretch;
    }
    j->xt = xt, j->xs = xs, j->blocks = blocks;
    j->stretches = (n + stretch - 1) / stretch;
    j->one_row = 0, j->attn = 0;
    j->at = at, j->mpad = mpad;
    j->i8 = i8;
    if (shared) run_with_helper(j);
    else work(j);
    int failed = atomic_load(&j->failed);
    if (shared) atomic_store(&job_busy, 0);
    if (failed) return 0; /* (only when memory for a few rows ran out) */
    if (alpha != 1.0f)
        for (int i = 0; i < M; i++)
            for (int r = 0; r < n; r++) c[(long)i * ldc + r] *= alpha;
    qgemm_calls++;
    return 1;
#else
    (void)m, (void)M, (void)a, (void)lda, (void)alpha, (void)c, (void)ldc;
    return 0;
#endif
}

/* ---- attention: the scores, then softmax(scores) times the values ------------------------------------- */

/* mlxpipe.cpu.layers.attention asks for its two products by their alpha (no real product scales by -2^99 or
 * -2^100). SCORES_ALPHA: c = a b^T (a query's scores over the keys), each sum over d in one fixed order, so
 * a score does not depend on how many keys there are nor where they start (the BLAS's does, in the last
 * bits: a record's numbers would depend on its batch's left padding). SOFTMAX_ALPHA: c = softmax(a) b, the
 * softmax along each row of a (masked scores at float32's lowest): mlx's CPU softmax calls a scalar exp
 * (~20 ns a score), a quarter of a --batch 64 decode step. Computed as mlx's softmax and product compute it:
 * its exp (Cephes' polynomial, mlx/backend/cpu/simd/math.h), the exps summed in order, each weight times
 * 1 / sum, then each output summed over the keys in order. */
#define SCORES_ALPHA (-0x1p99f)
enum { PREFETCH_AHEAD = 2 }; /* blocks ahead: 1, 2, 3 side by side, 2 the fastest */
#define SOFTMAX_ALPHA (-0x1p100f)
static long attention_calls;
static int attention_portable; /* 1: attention's and SwiGLU's portable loops even where AVX2 runs (tests) */

long mlxpipe_attention_calls(void) { return attention_calls; }
void mlxpipe_attention_portable(int on) { attention_portable = on; }
/* Whether attention's kernels run here (AVX-512 or AVX2): elsewhere the portable loops are slower than mlx's. */
int mlxpipe_attention_available(void) {
#ifdef X86_AVX512
    return kernels() > 0;
#else
    return 0;
#endif
}

/* exp's polynomial on [-0.5, 0.5] (Cephes', as mlx's), by Horner's rule: one form for the scalar, AVX2 and
 * AVX-512 exps, so that they compute the same numbers lane by lane. */
#define SAME(x) (x)
#define EXP_POLY(fma_, set1_, f)                                                                               \
    fma_(fma_(fma_(fma_(fma_(fma_(set1_(1.535336188319500e-4f), f, set1_(1.339887440266574e-3f)), f,            \
                             set1_(9.618437357674640e-3f)),                                                  \
                        f, set1_(5.550332471162809e-2f)),                                                    \
                   f, set1_(2.402264791363012e-1f)),                                                         \
              f, set1_(6.931472028550421e-1f)),                                                              \
         f, set1_(1.0f))

static float exp_scalar(float x) {
    float y = fminf(fmaxf(x * 1.442695f, -127.0f), 128.0f); /* clamped: no overflow below (mlx's range) */
    float ip = floorf(y + 0.5f), f = y - ip;
    float p = EXP_POLY(fmaf, SAME, f);
    union { uint32_t i; float f; } two = {.i = (uint32_t)((int32_t)ip + 127) << 23};
    if (x != x) return x;
    if (x > 88.0f) return INFINITY;
    if (x < -88.0f) return 0.0f;
    return two.f * p;
}

static float *attention_scratch(int k) {
    static __thread float *e;
    static __thread int cap;
    if (k > cap) {
        free(e);
        cap = k < 1024 ? 1024 : k;
        e = malloc(sizeof(float) * (size_t)cap);
        if (!e) cap = 0;
    }
    return e;
}

/* One row's weights: e[j] = exp(a[j] - max(a)) / sum, the sum taken in order as mlx's softmax takes it. */
static void weights_scalar(const float *a, int k, float *e) {
    float top = -INFINITY, z = 0.0f;
    for (int j = 0; j < k; j++) top = a[j] > top ? a[j] : top;
    for (int j = 0; j < k; j++) z += e[j] = exp_scalar(a[j] - top);
    float r = 1.0f / z;
    for (int j = 0; j < k; j++) e[j] *= r;
}

#ifdef X86_AVX512
__attribute__((target("avx512f,fma"), always_inline)) static inline __m512 exp16(__m512 x) {
    __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.442695f)), _mm512_set1_ps(-127.0f)),
                             _mm512_set1_ps(128.0f));
    __m512 ip = _mm512_roundscale_ps(_mm512_add_ps(y, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, ip);
    __m512 p = EXP_POLY(_mm512_fmadd_ps, _mm512_set1_ps, f);
    __m512i two = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(ip), _mm512_set1_epi32(127)), 23);
    __m512 r = _mm512_mul_ps(_mm512_castsi512_ps(two), p);
    r = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ), r, _mm512_set1_ps(INFINITY));
    r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-88.0f), _CMP_NLT_UQ), r);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
}

__attribute__((target("avx512f,fma"))) static void weights_avx512(const float *a, int k, float *e) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 16 <= k; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(a + j));
    float t = _mm512_reduce_max_ps(top);
    for (; j < k; j++) t = a[j] > t ? a[j] : t;
    __m512 vt = _mm512_set1_ps(t);
    for (j = 0; j + 16 <= k; j += 16) _mm512_storeu_ps(e + j, exp16(_mm512_sub_ps(_mm512_loadu_ps(a + j), vt)));
    if (j < k) {
        __mmask16 m = (__mmask16)((1u << (k - j)) - 1);
        _mm512_mask_storeu_ps(e + j, m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, a + j), vt)));
    }
    float z = 0.0f;
    for (j = 0; j < k; j++) z += e[j];
    __m512 r = _mm512_set1_ps(1.0f / z);
    for (j = 0; j + 16 <= k; j += 16) _mm512_storeu_ps(e + j, _mm512_mul_ps(_mm512_loadu_ps(e + j), r));
    for (; j < k; j++) e[j] *= 1.0f / z;
}

/* c (R x n) = e (R x k) b (k x n), 64 columns at a time, each sum over j in order; R a constant (registers). */
__attribute__((target("avx512f,fma"), always_inline)) static inline void
weighted_rows(const int R, int n, int k, const float *e, int lde, const float *b, int ldb, float *c, int ldc) {
    for (int col = 0; col < n; col += 64) {
        int w = n - col < 64 ? n - col : 64;
        __mmask16 mk[4];
        for (int v = 0; v < 4; v++) {
            int left = w - 16 * v;
            mk[v] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        }
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) acc[i][v] = _mm512_setzero_ps();
        for (int j = 0; j < k; j++) {
            const float *bj = b + (long)j * ldb + col;
            __m512 bv[4];
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) bv[v] = _mm512_maskz_loadu_ps(mk[v], bj + 16 * v);
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                __m512 ej = _mm512_set1_ps(e[(long)i * lde + j]);
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) acc[i][v] = _mm512_fmadd_ps(ej, bv[v], acc[i][v]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(c + (long)i * ldc + col + 16 * v, mk[v], acc[i][v]);
    }
}

/* c (rows x n) = e (rows x k) b (k x n), rows <= 4. */
__attribute__((target("avx512f,fma"))) static void weighted_avx512(int rows, int n, int k, const float *e, int lde,
                                                                   const float *b, int ldb, float *c, int ldc) {
    switch (rows) {
    case 4: weighted_rows(4, n, k, e, lde, b, ldb, c, ldc); break;
    case 3: weighted_rows(3, n, k, e, lde, b, ldb, c, ldc); break;
    case 2: weighted_rows(2, n, k, e, lde, b, ldb, c, ldc); break;
    default: weighted_rows(1, n, k, e, lde, b, ldb, c, ldc); break;
    }
}
#endif

/* c (m x n) = a (m x k) b^T by a kernel of up to three rows of a and KEYS rows of b (a constant R: registers). */
#define SCORES_TILES(kernel, KEYS)                                                                            \
    for (int i = 0; i < m; i += 3)                                                                            \
        for (int j = 0; j < n; j += KEYS) {                                                                   \
            const float *ai = a + (long)i * lda, *bj = b + (long)j * ldb;                                     \
            float *cij = c + (long)i * ldc + j;                                                               \
            int count = n - j < KEYS ? n - j : KEYS, rows = m - i < 3 ? m - i : 3;                            \
            if (rows == 3) kernel(3, ai, lda, k, bj, ldb, cij, ldc, count);                                   \
            else if (rows == 2) kernel(2, ai, lda, k, bj, ldb, cij, ldc, count);                              \
            else kernel(1, ai, lda, k, bj, ldb, cij, ldc, count);                                             \
        }

#ifdef X86_AVX512
/* Eight vectors' sums in the low half of one, each by the same tree of additions; lane j holds the sum
 * of v[j] (the tree leaves key j in lane SUMS8_ORDER[j]). */
static const int32_t SUMS8_ORDER[16] = {0, 1, 8, 9, 4, 5, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0};
__attribute__((target("avx512f"), always_inline)) static inline __m512 sums8(__m512 *v) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) /* 256-bit halves: v[i] and v[i + 4] share a vector */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 4], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 4], 0xEE));
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++) /* 128-bit quarters */
        v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 2], 0x88), _mm512_shuffle_f32x4(v[i], v[i + 2], 0xDD));
    __m512d x = _mm512_castps_pd(v[0]), y = _mm512_castps_pd(v[1]); /* pairs of lanes */
    __m512 p = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    __m512 lanes = _mm512_add_ps(_mm512_shuffle_ps(p, p, 0x88), _mm512_shuffle_ps(p, p, 0xDD)); /* single lanes */
    return _mm512_permutexvar_ps(_mm512_loadu_si512(SUMS8_ORDER), lanes);
}

/* s[r][0..count) = a row r . b rows 0..count (ldb apart), R <= 3 rows and 8 keys; every sum alike. */
__attribute__((target("avx512f,fma"), always_inline)) static inline void
scores8(const int R, const float *a, int lda, int k, const float *b, int ldb, float *s, int lds, int count) {
    __m512 acc[3][8];
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) acc[r][j] = _mm512_setzero_ps();
    for (int d = 0; d < k; d += 16) {
        __mmask16 mk = k - d >= 16 ? 0xFFFF : (__mmask16)((1u << (k - d)) - 1);
        __m512 av[3];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) av[r] = _mm512_maskz_loadu_ps(mk, a + (long)r * lda + d);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            __m512 bv = _mm512_maskz_loadu_ps(j < count ? mk : 0, b + (long)j * ldb + d);
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) acc[r][j] = _mm512_fmadd_ps(av[r], bv, acc[r][j]);
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(s + (long)r * lds, (__mmask16)((1u << count) - 1), sums8(acc[r]));
}

/* c (m x n) = a (m x k) b^T, b n x k: three rows and eight keys at a time, each score's sum alike. */
__attribute__((target("avx512f,fma"))) static void scores_avx512(int m, int n, int k, const float *a, int lda,
                                                                 const float *b, int ldb, float *c, int ldc) {
    SCORES_TILES(scores8, 8);
}
#endif

#ifdef X86_AVX512
/* AVX2: the same exp as exp16 and exp_scalar (the same operations, lane by lane). */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 exp8(__m256 x) {
    __m256 y = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.442695f)), _mm256_set1_ps(-127.0f)),
                             _mm256_set1_ps(128.0f));
    __m256 ip = _mm256_round_ps(_mm256_add_ps(y, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(y, ip);
    __m256 p = EXP_POLY(_mm256_fmadd_ps, _mm256_set1_ps, f);
    __m256i two = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(ip), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(_mm256_castsi256_ps(two), p);
    r = _mm256_blendv_ps(r, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    r = _mm256_and_ps(r, _mm256_cmp_ps(x, _mm256_set1_ps(-88.0f), _CMP_NLT_UQ));
    return _mm256_blendv_ps(r, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

__attribute__((target("avx2,fma"))) static void weights_avx2(const float *a, int k, float *e) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= k; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(a + j));
    float lanes[8], t = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int i = 0; i < 8; i++) t = lanes[i] > t ? lanes[i] : t;
    for (; j < k; j++) t = a[j] > t ? a[j] : t;
    __m256 vt = _mm256_set1_ps(t);
    for (j = 0; j + 8 <= k; j += 8) _mm256_storeu_ps(e + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(a + j), vt)));
    for (; j < k; j++) e[j] = exp_scalar(a[j] - t);
    float z = 0.0f;
    for (j = 0; j < k; j++) z += e[j];
    __m256 r = _mm256_set1_ps(1.0f / z);
    for (j = 0; j + 8 <= k; j += 8) _mm256_storeu_ps(e + j, _mm256_mul_ps(_mm256_loadu_ps(e + j), r));
    for (; j < k; j++) e[j] *= 1.0f / z;
}

/* Lanes 0..left-1 on (left clamped to 0..8): the mask of _mm256_maskload_ps / _mm256_maskstore_ps. */
__attribute__((target("avx2"), always_inline)) static inline __m256i lanes_avx2(int left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(left), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* c (R x n) = e (R x k) b (k x n), 16 columns at a time, each sum over j in order (as the AVX-512 kernel). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
weighted_rows_avx2(const int R, int n, int k, const float *e, int lde, const float *b, int ldb, float *c, int ldc) {
    for (int col = 0; col < n; col += 16) {
        __m256i mk[2] = {lanes_avx2(n - col), lanes_avx2(n - col - 8)};
        __m256 acc[4][2];
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        for (int j = 0; j < k; j++) {
            const float *bj = b + (long)j * ldb + col;
            if (col == 0) /* the first pass brings whole rows: a KV cache comes from memory, a few KB a call */
                for (int l = 0; l < n; l += 16) _mm_prefetch((const char *)(bj + PREFETCH_ROWS * (long)ldb + l), _MM_HINT_T0);
            __m256 b0 = _mm256_maskload_ps(bj, mk[0]), b1 = _mm256_maskload_ps(bj + 8, mk[1]);
#pragma GCC unroll 4
            for (int i = 0; i < R; i++) {
                __m256 ej = _mm256_broadcast_ss(e + (long)i * lde + j);
                acc[i][0] = _mm256_fmadd_ps(ej, b0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(ej, b1, acc[i][1]);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; i++) {
            _mm256_maskstore_ps(c + (long)i * ldc + col, mk[0], acc[i][0]);
            _mm256_maskstore_ps(c + (long)i * ldc + col + 8, mk[1], acc[i][1]);
        }
    }
}

/* weighted_rows_avx2 for R <= 3 rows and 32 columns at a time (n a multiple of 32: heads of 64 or 128): 12
 * sums in flight instead of 6 (a decode step's 3 query heads a key head were bound by the FMAs' latency). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
weighted_rows32_avx2(const int R, int n, int k, const float *e, int lde, const float *b, int ldb, float *c, int ldc) {
    for (int col = 0; col < n; col += 32) {
        __m256 acc[3][4];
#pragma GCC unroll 3
        for (int i = 0; i < R; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_ps();
        for (int j = 0; j < k; j++) {
            const float *bj = b + (long)j * ldb + col;
            if (col == 0)
                for (int l = 0; l < n; l += 16) _mm_prefetch((const char *)(bj + PREFETCH_ROWS * (long)ldb + l), _MM_HINT_T0);
            __m256 bv[4] = {_mm256_loadu_ps(bj), _mm256_loadu_ps(bj + 8), _mm256_loadu_ps(bj + 16), _mm256_loadu_ps(bj + 24)};
#pragma GCC unroll 3
            for (int i = 0; i < R; i++) {
                __m256 ej = _mm256_broadcast_ss(e + (long)i * lde + j);
#pragma GCC unroll 4
                for (int v = 0; v < 4; v++) acc[i][v] = _mm256_fmadd_ps(ej, bv[v], acc[i][v]);
            }
        }
#pragma GCC unroll 3
        for (int i = 0; i < R; i++)
#pragma GCC unroll 4
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(c + (long)i * ldc + col + 8 * v, acc[i][v]);
    }
}

__attribute__((target("avx2,fma"))) static void weighted_avx2(int rows, int n, int k, const float *e, int lde,
                                                              const float *b, int ldb, float *c, int ldc) {
    if (n % 32 == 0 && rows <= 3) {
        switch (rows) {
        case 3: weighted_rows32_avx2(3, n, k, e, lde, b, ldb, c, ldc); return;
        case 2: weighted_rows32_avx2(2, n, k, e, lde, b, ldb, c, ldc); return;
        default: weighted_rows32_avx2(1, n, k, e, lde, b, ldb, c, ldc); return;
        }
    }
    switch (rows) {
    case 4: weighted_rows_avx2(4, n, k, e, lde, b, ldb, c, ldc); break;
    case 3: weighted_rows_avx2(3, n, k, e, lde, b, ldb, c, ldc); break;
    case 2: weighted_rows_avx2(2, n, k, e, lde, b, ldb, c, ldc); break;
    default: weighted_rows_avx2(1, n, k, e, lde, b, ldb, c, ldc); break;
    }
}

/* Four vectors' sums in the four lanes of one, each by the same tree: ((0+1)+(2+3)) + ((4+5)+(6+7)). */
__attribute__((target("avx2"), always_inline)) static inline __m128 sums4_avx2(const __m256 *v) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* s[r][0..count) = a row r . b rows 0..count (ldb apart), R <= 3 rows and 4 keys; every sum alike. */
__attribute__((target("avx2,fma"), always_inline)) static inline void
scores4_avx2(const int R, const float *a, int lda, int k, const float *b, int ldb, float *s, int lds, int count) {
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) /* the keys two tiles on (a KV cache comes from memory, a few KB a call) */
        for (int d = 0; d < k; d += 16) _mm_prefetch((const char *)(b + (long)(j + 8) * ldb + d), _MM_HINT_T0);
    int d = 0;
    if (count == 4) /* whole vectors: plain loads (a masked load costs more), the same sums */
        for (; d + 8 <= k; d += 8) {
            __m256 av[3];
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) av[r] = _mm256_loadu_ps(a + (long)r * lda + d);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256 bv = _mm256_loadu_ps(b + (long)j * ldb + d);
#pragma GCC unroll 3
                for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(av[r], bv, acc[r][j]);
            }
        }
    for (; d < k; d += 8) {
        __m256i mk = lanes_avx2(k - d);
        __m256 av[3];
#pragma GCC unroll 3
        for (int r = 0; r < R; r++) av[r] = _mm256_maskload_ps(a + (long)r * lda + d, mk);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256 bv = j < count ? _mm256_maskload_ps(b + (long)j * ldb + d, mk) : _mm256_setzero_ps();
#pragma GCC unroll 3
            for (int r = 0; r < R; r++) acc[r][j] = _mm256_fmadd_ps(av[r], bv, acc[r][j]);
        }
    }
    __m128i keep = _mm256_castsi256_si128(lanes_avx2(count));
#pragma GCC unroll 3
    for (int r = 0; r < R; r++) _mm_maskstore_ps(s + (long)r * lds, keep, sums4_avx2(acc[r]));
}

/* c (m x n) = a (m x k) b^T, b n x k: three rows and four keys at a time, each score's sum alike. */
__attribute__((target("avx2,fma"))) static void scores_avx2(int m, int n, int k, const float *a, int lda,
                                                            const float *b, int ldb, float *c, int ldc) {
    SCORES_TILES(scores4_avx2, 4);
}
#endif

/* c = a b^T for row-major a (m x k), b (n x k), c (m x n). */
static void attention_scores(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float *c,
                             int ldc) {
#ifdef X86_AVX512
    if (!attention_portable && kernels()) {
        if (kernels() == 2) scores_avx512(m, n, k, a, lda, b, ldb, c, ldc);
        else scores_avx2(m, n, k, a, lda, b, ldb, c, ldc);
        __atomic_fetch_add(&attention_calls, 1, __ATOMIC_RELAXED);
        return;
    }
#endif
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int d = 0; d < k; d++) s = fmaf(a[(long)i * lda + d], b[(long)j * ldb + d], s);
            c[(long)i * ldc + j] = s;
        }
    __atomic_fetch_add(&attention_calls, 1, __ATOMIC_RELAXED);
}

/* c = softmax(a) b for row-major a (m x k), b (k x n), c (m x n); 0 when it cannot (no memory). */
static int attention_product(int m, int n, int k, const float *a, int lda, const float *b, int ldb, float *c,
                             int ldc) {
    float *e = attention_scratch(4 * k);
    if (!e) return 0;
#ifdef X86_AVX512
    if (!attention_portable && kernels()) {
        int wide = kernels() == 2;
        for (int i = 0; i < m; i += 4) {
            int rows = m - i < 4 ? m - i : 4;
            for (int r = 0; r < rows; r++) {
                if (wide) weights_avx512(a + (long)(i + r) * lda, k, e + (long)r * k);
                else weights_avx2(a + (long)(i + r) * lda, k, e + (long)r * k);
            }
            if (wide) weighted_avx512(rows, n, k, e, k, b, ldb, c + (long)i * ldc, ldc);
            else weighted_avx2(rows, n, k, e, k, b, ldb, c + (long)i * ldc, ldc);
        }
        __atomic_fetch_add(&attention_calls, 1, __ATOMIC_RELAXED);
        return 1;
    }
#endif
    for (int i = 0; i < m; i++) {
        weights_scalar(a + (long)i * lda, k, e);
        for (int col = 0; col < n; col++) {
            float s = 0.0f;
            for (int j = 0; j < k; j++) s = fmaf(e[j], b[(long)j * ldb + col], s);
            c[(long)i * ldc + col] = s;
        }
    }
    __atomic_fetch_add(&attention_calls, 1, __ATOMIC_RELAXED);
    return 1;
}

/* Pairs [p0, p1) of t; 0 when memory ran out. The block two pairs ahead is fetched meanwhile (prefetch_next). */
static int attention_pairs(const attn_t *t, int p0, int p1) {
    long bytes = (long)(t->softmax ? t->k : t->n) * t->ldb * sizeof(float);
    for (int p = p0; p < p1; p++) {
        const float *a = t->a + (long)p * t->rep * t->lda, *b = t->b + p * t->pair_stride;
        float *c = t->c + (long)p * t->rep * t->ldc;
#ifdef X86_AVX512
        if (p + PREFETCH_AHEAD < p1)
            for (long i = 0; i < bytes; i += 64)
                _mm_prefetch((const char *)(b + PREFETCH_AHEAD * t->pair_stride) + i, _MM_HINT_T0);
#else
        (void)bytes;
#endif
        if (!t->softmax) attention_scores(t->rep, t->n, t->k, a, t->lda, b, t->ldb, c, t->ldc);
        else if (!attention_product(t->rep, t->n, t->k, a, t->lda, b, t->ldb, c, t->ldc)) return 0;
    }
    return 1;
}

/* ATTENTION_ALPHA's tag: the exponent of 2^98, the mantissa's 23 bits the layout (layers.attention_cached):
 * bit 0 which product (0 the scores, 1 softmax times values), bits 1-5 the query rows of a pair (rep: a KV
 * head's query heads times the queries), bits 6-22 the KV cache's capacity in positions (b is the first pair's
 * keys or values, a row per position, the next pair's `capacity` rows further on). */
#define ATTENTION_ALPHA (-0x1p98f)
enum { ATTENTION_SHARED_MIN = 1 << 19 }; /* multiply-adds worth the helper (~64 records' pairs of 40 keys) */

/* One product of mlxpipe.cpu.layers.attention_cached: every pair's scores (or softmax times values) as the
 * per-pair calls of attention() compute them, the pairs shared with the helper; 0 when it cannot. */
static int attention_batch(float alpha, int tb, int m, int n, int k, const float *a, int lda, const float *b,
                           int ldb, float *c, int ldc) {
    uint32_t bits;
    memcpy(&bits, &alpha, sizeof bits);
    int softmax = bits & 1, rep = bits >> 1 & 31;
    long capacity = bits >> 6 & 0x1FFFF;
    if (rep < 1 || m % rep || capacity < (softmax ? k : n) || tb != (softmax ? NO_TRANS : TRANS)) return 0;
    attn_t t = {softmax, rep, m / rep, n, k, lda, ldb, ldc, capacity * ldb, a, b, c};
#ifdef X86_AVX512
    int shared = qgemm_threads > 1 && t.pairs >= 4 && (long)m * n * k >= ATTENTION_SHARED_MIN;
    if (shared && alone_for > 0) alone_for--, shared = 0;
    if (shared && claim_helper()) {
        job_t *j = &job;
        j->attn = &t, j->m = 0, j->one_row = 0;
        j->stretch = t.pairs / 16 > 1 ? t.pairs / 16 : 1; /* about 8 stretches a thread, for balance */
        j->stretches = (t.pairs + j->stretch - 1) / j->stretch;
        run_with_helper(j);
        int failed = atomic_load(&j->failed);
        j->attn = 0;
        atomic_store(&job_busy, 0);
        return !failed;
    }
#endif
    return attention_pairs(&t, 0, t.pairs);
}

#ifdef X86_AVX512
/* One-row products of at least this many weights share their rows with the helper (0: none). */
static long one_row_min = 1L << 40;
enum { ONE_ALONE_MS = 50 }; /* how long one-row products go on alone after the helper was slow */
/* A one-row product that takes less than this alone is not shared: the helper's wake-up costs the caller more
 * than the half it takes (bench/RESULTS.md). */
static int one_shared_us = 90;
static double one_row_rate; /* weights a second of one-row products computed alone, a running mean (0: none yet) */

/* Sets that time (microseconds; 0: share by size alone), for tests; the time it replaces. */
int mlxpipe_qgemv_shared_us(int us) {
    int was = one_shared_us;
    one_shared_us = us;
    return was;
}
static double one_alone_until;

/* Sets the fewest weights a one-row product shares with the helper (0: never shared); starts afresh. */
void mlxpipe_qgemv_shared_min(long weights) {
    one_row_min = weights > 0 ? weights : 1L << 40;
    one_alone_until = 0;
}

/* c = the rows of W times x, prepared by qgemv: stretches of rows on both threads when W is large and the
 * helper free. Each row's sum is computed as alone, by one thread: the numbers do not depend on the split. */
static void one_rows(const qmat *m, const float *xe, const float *xo, const float *xsum, const i8_input *i8,
                     float *c) {
    int n = m->n;
    long weights = (long)n * m->k;
    int shared = qgemm_threads > 1 && weights >= one_row_min && now() >= one_alone_until &&
                 (one_row_rate == 0 || weights >= one_row_rate * (one_shared_us * 1e-6));
    shared = shared && claim_helper();
    if (!shared) {
        double start = now();
        if (i8) i8_rows_any(m, i8, 1, c, n, 0, n);
        else if (m->bits == 4) rows4(m, xe, xo, xsum, 0, n, c);
        else rows8(m, xe, xsum, 0, n, c);
        double rate = weights / (now() - start + 1e-9);
        one_row_rate = one_row_rate == 0 ? rate : one_row_rate + (rate - one_row_rate) / 8;
        return;
    }
    long row_bytes = (long)m->k * m->bits / 8 + 2L * (m->k / m->group) * sizeof(float);
    int stretch = (int)(CHUNK / row_bytes);
    if (n / 16 + 1 < stretch) stretch = n / 16 + 1; /* about 8 stretches a thread, for balance */
    stretch = stretch < 2 ? 2 : stretch & ~1;        /* whole pairs of rows, as the kernels take them */
    if (i8) stretch = stretch < I8_W ? I8_W : stretch / I8_W * I8_W;
    job_t *j = &job;
    j->m = m, j->c = c, j->xe = xe, j->xo = xo, j->xsum = xsum, j->one_row = 1, j->xt = 0, j->at = 0, j->attn = 0;
    j->i8 = i8 ? *i8 : (i8_input){0}, j->M = 1, j->ldc = n;
    j->stretch = stretch, j->stretches = (n + stretch - 1) / stretch;
    /* a helper that made the caller wait is left out for a while: beside a busy process it may get no core,
     * or lose it in a stretch (as the several-row products' rule) */
    if (!run_shared(j)) one_alone_until = now() + ONE_ALONE_MS * 1e-3, alone_spells++;
    atomic_store(&job_busy, 0);
}
#endif

/* ---- SwiGLU after a gate-and-up product (mlxpipe.cpu.layers' fused MLP) ----------------------------------
 * SWIGLU_ALPHA (row-major): c = a b with b's outputs the gate's then the up projection's, then silu(gate) *
 * up packed at c's start, by the very float32 operations of layers._swiglu_fast (no multiply-add fused, as
 * mlx's compiled kernels run them): mlx ran that chain as scalar loops over strided rows, ~8 ns an element. */
#define SWIGLU_ALPHA (-0x1p101f)
static const float TANH_P[7] = {4.89352455891786e-03f, 6.37261928875436e-04f, 1.48572235717979e-05f,
                                5.12229709037114e-08f, -8.60467152213735e-11f, 2.00018790482477e-13f,
                                -2.76076847742355e-16f};
static const float TANH_Q[4] = {4.89352518554385e-03f, 2.26843463243900e-03f, 1.18534705686654e-04f,
                                1.19825839466702e-06f};
static const float TANH_CLAMP = 7.90531110763549805f;

static float swiglu_scalar(float g, float x) {
    volatile float t = 0.5f * g; /* volatile: each operation rounded alone, whatever the compiler's contraction */
    t = fminf(fmaxf(t, -TANH_CLAMP), TANH_CLAMP);
    volatile float t2 = t * t, p = t2 * TANH_P[6];
    p = p + TANH_P[5];
    for (int i = 4; i >= 0; i--) p = p * t2, p = p + TANH_P[i];
    volatile float q = t2 * TANH_Q[3];
    q = q + TANH_Q[2], q = q * t2, q = q + TANH_Q[1], q = q * t2, q = q + TANH_Q[0];
    volatile float r = p * t;
    r = 0.5f * r, r = r / q, r = 0.5f + r, r = g * r;
    return r * x;
}

#ifdef X86_AVX512
/* out[0..j) = silu(g) * x for the whole vectors of n; j. target avx2 without fma: the compiler cannot fuse a
 * multiply and an add. */
__attribute__((target("avx2"))) static int swiglu_avx2(float *out, const float *g, const float *x, int n) {
    int j = 0;
    __m256 half = _mm256_set1_ps(0.5f), lo = _mm256_set1_ps(-TANH_CLAMP), hi = _mm256_set1_ps(TANH_CLAMP);
    for (; j + 8 <= n; j += 8) {
        __m256 gv = _mm256_loadu_ps(g + j);
        __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(half, gv), lo), hi), t2 = _mm256_mul_ps(t, t);
        __m256 p = _mm256_add_ps(_mm256_mul_ps(t2, _mm256_set1_ps(TANH_P[6])), _mm256_set1_ps(TANH_P[5]));
        for (int i = 4; i >= 0; i--) p = _mm256_add_ps(_mm256_mul_ps(p, t2), _mm256_set1_ps(TANH_P[i]));
        __m256 q = _mm256_add_ps(_mm256_mul_ps(t2, _mm256_set1_ps(TANH_Q[3])), _mm256_set1_ps(TANH_Q[2]));
        q = _mm256_add_ps(_mm256_mul_ps(q, t2), _mm256_set1_ps(TANH_Q[1]));
        q = _mm256_add_ps(_mm256_mul_ps(q, t2), _mm256_set1_ps(TANH_Q[0]));
        __m256 r = _mm256_div_ps(_mm256_mul_ps(half, _mm256_mul_ps(p, t)), q);
        r = _mm256_mul_ps(gv, _mm256_add_ps(half, r));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(r, _mm256_loadu_ps(x + j)));
    }
    return j;
}

#define R_ (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
/* swiglu_avx2 on 16 lanes: the same operations, each rounded alone (the _round_ forms are never fused) */
__attribute__((target("avx512f"))) static int swiglu_avx512(float *out, const float *g, const float *x, int n) {
    int j = 0;
    __m512 half = _mm512_set1_ps(0.5f), lo = _mm512_set1_ps(-TANH_CLAMP), hi = _mm512_set1_ps(TANH_CLAMP);
    for (; j + 16 <= n; j += 16) {
        __m512 gv = _mm512_loadu_ps(g + j);
        __m512 t = _mm512_min_ps(_mm512_max_ps(_mm512_mul_round_ps(half, gv, R_), lo), hi);
        __m512 t2 = _mm512_mul_round_ps(t, t, R_);
        __m512 p = _mm512_add_round_ps(_mm512_mul_round_ps(t2, _mm512_set1_ps(TANH_P[6]), R_),
                                       _mm512_set1_ps(TANH_P[5]), R_);
        for (int i = 4; i >= 0; i--)
            p = _mm512_add_round_ps(_mm512_mul_round_ps(p, t2, R_), _mm512_set1_ps(TANH_P[i]), R_);
        __m512 q = _mm512_add_round_ps(_mm512_mul_round_ps(t2, _mm512_set1_ps(TANH_Q[3]), R_),
                                       _mm512_set1_ps(TANH_Q[2]), R_);
        q = _mm512_add_round_ps(_mm512_mul_round_ps(q, t2, R_), _mm512_set1_ps(TANH_Q[1]), R_);
        q = _mm512_add_round_ps(_mm512_mul_round_ps(q, t2, R_), _mm512_set1_ps(TANH_Q[0]), R_);
        __m512 r = _mm512_div_round_ps(_mm512_mul_round_ps(half, _mm512_mul_round_ps(p, t, R_), R_), q, R_);
        r = _mm512_mul_round_ps(gv, _mm512_add_round_ps(half, r, R_), R_);
        _mm512_storeu_ps(out + j, _mm512_mul_round_ps(r, _mm512_loadu_ps(x + j), R_));
    }
    return j;
}
#undef R_
#endif

static long swiglu_calls;
long mlxpipe_swiglu_calls(void) { return swiglu_calls; }

/* out[0..n) = silu(g) * x elementwise (out may be g). */
static void swiglu_span(float *out, const float *g, const float *x, int n) {
    int j = 0;
#ifdef X86_AVX512
    if (!attention_portable && kernels() == 2) j = swiglu_avx512(out, g, x, n);
    if (!attention_portable && kernels()) j += swiglu_avx2(out + j, g + j, x + j, n - j);
#endif
    for (; j < n; j++) out[j] = swiglu_scalar(g[j], x[j]);
}

/* c (m x n, row-major, ldc >= n: the gate's columns, then up's) becomes silu(gate) * up as an m x n / 2
 * matrix packed at its start (row i at c + i n / 2): a contiguous array for the next product, no copy.
 * Rows in order: row i's result lands on rows before i, already read (i n / 2 + n / 2 <= i ldc); row 0's
 * on its own gate, element by element. */
static void swiglu(int m, int n, float *c, int ldc) {
    int half = n / 2;
    for (int i = 0; i < m; i++) {
        const float *row = c + (long)i * ldc;
        swiglu_span(c + (long)i * half, row, row + half, half);
    }
    swiglu_calls++;
}

/* ---- Greedy tokens (ARGMAX_ALPHA) -------------------------------------------------------------------------
 * ARGMAX_ALPHA (row-major, m x k logits by a k x 2 b that is never read: mlx computes a product by one column
 * without sgemm): c[i][0] and c[i][1] = the index of row i's largest element as mx.argmax picks it (its first
 * NaN, else the first of its largest, -0 and 0 alike), as a float (exact: k < 2^24). mlx's CPU argmax compares
 * one element at a time: ~3 ms a --batch 64 step over a vocabulary of 49152. */
#define ARGMAX_ALPHA (-0x1p102f)
static long argmax_calls;
long mlxpipe_argmax_calls(void) { return argmax_calls; }

static int argmax_scalar(const float *x, int n) {
    int best = 0;
    for (int j = 0; j < n; j++)
        if (x[j] != x[j]) return j;
        else if (x[j] > x[best]) best = j;
    return best;
}

#ifdef X86_AVX512
/* The largest's value in one pass (a NaN: the scalar scan), then its first index in a second. */
__attribute__((target("avx512f"))) static int argmax_avx512(const float *x, int n) {
    int j = 0;
    __m512 most = _mm512_set1_ps(-INFINITY);
    __mmask16 nan = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        most = _mm512_max_ps(most, v);
    }
    float top = _mm512_reduce_max_ps(most);
    for (int t = j; t < n; t++) {
        if (x[t] != x[t]) nan = 1;
        else if (x[t] > top) top = x[t];
    }
    if (nan) return argmax_scalar(x, n);
    __m512 want = _mm512_set1_ps(top);
    for (j = 0; j + 16 <= n; j += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), want, _CMP_EQ_OQ);
        if (hit) return j + __builtin_ctz(hit);
    }
    for (; j < n; j++)
        if (x[j] == top) return j;
    return 0;
}
#endif

static void argmax_rows(int m, int k, const float *a, int lda, float *c, int ldc) {
    for (int i = 0; i < m; i++) {
        const float *x = a + (long)i * lda;
#ifdef X86_AVX512
        int at = !attention_portable && kernels() == 2 ? argmax_avx512(x, k) : argmax_scalar(x, k);
#else
        int at = argmax_scalar(x, k);
#endif
        c[(long)i * ldc] = c[(long)i * ldc + 1] = (float)at;
    }
    argmax_calls++;
}

/* mlx makes a batch's attention products one (record, KV head) at a time, each block of keys (or values) a
 * fixed stride after the one before: the block two calls ahead is fetched while this one is computed (a decode
 * step reads every record's KV cache from memory, and waiting for it was half of attention's time). */

static void prefetch_next(const float *b, long bytes) {
#ifdef X86_AVX512
    static __thread const char *last;
    static __thread long stride;
    const char *here = (const char *)b;
    long step = here - last;
    if (step == stride && step != 0)
        for (long i = 0; i < bytes; i += 64) _mm_prefetch(here + PREFETCH_AHEAD * step + i, _MM_HINT_T0);
    stride = step, last = here;
#else
    (void)b, (void)bytes;
#endif
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                 const float *b, int ldb, float beta, float *c, int ldc) {
    if (alpha == ARGMAX_ALPHA && order == ROW_MAJOR && ta == NO_TRANS && n == 2 && k < (1 << 24)) {
        argmax_rows(m, k, a, lda, c, ldc);
        return;
    }
    if (alpha == SWIGLU_ALPHA && order == ROW_MAJOR && n % 2 == 0) {
        cblas_sgemm(order, ta, tb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
        swiglu(m, n, c, ldc);
        return;
    }
    if (-alpha >= -ATTENTION_ALPHA && -alpha < -SCORES_ALPHA && order == ROW_MAJOR && ta == NO_TRANS &&
        beta == 0.0f && attention_batch(alpha, tb, m, n, k, a, lda, b, ldb, c, ldc))
        return;
    if (alpha == SCORES_ALPHA && order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && beta == 0.0f) {
        prefetch_next(b, (long)n * ldb * sizeof(float));
        attention_scores(m, n, k, a, lda, b, ldb, c, ldc);
        return;
    }
    if (alpha == SOFTMAX_ALPHA && order == ROW_MAJOR && ta == NO_TRANS && tb == NO_TRANS && beta == 0.0f) {
        prefetch_next(b, (long)k * ldb * sizeof(float));
        if (attention_product(m, n, k, a, lda, b, ldb, c, ldc)) return;
    }
    if (order == COL_MAJOR) { /* column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T */
        int t = ta; ta = tb; tb = t;
        t = m; m = n; n = t;
        t = lda; lda = ldb; ldb = t;
        const float *p = a; a = b; b = p;
    }
    /* c (1 x n) = alpha a (1 x k) op(B) + beta c; a is a row, or a column of stride lda; by a registered
     * matrix of any size (as its products of several rows are), else sgemv from MIN_ELEMENTS */
    const qmat *q = m == 1 && tb == TRANS && ldb == k && beta == 0.0f ? lookup(b, n, k) : 0;
    if (q && qgemv(q, a, ta == NO_TRANS ? 1 : lda, alpha, c)) return;
    if (m == 1 && (long)n * k >= MIN_ELEMENTS) {
        int inc_a = ta == NO_TRANS ? 1 : lda;
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
    /* several rows by a registered matrix: from its quantized bytes too, up to qgemm_max_rows of them */
    if (m > 1 && m <= qgemm_max_rows && ta == NO_TRANS && tb == TRANS && ldb == k && beta == 0.0f) {
        q = lookup(b, n, k);
        if (q && qgemm(q, m, a, lda, alpha, c, ldc)) return;
    }
    blas_sgemm(ROW_MAJOR, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* ---- The product mlxpipe's mlx operation asks for (kernels.cpp) ----------------------------------------------
 * c = a W^T for the matrix mlxpipe_qmatrix returned (a: M x k, c: M x n, both packed row-major): W's quantized
 * bytes are its only copy. With PRODUCT_SWIGLU (W: a gate's rows, then up's) c is silu(gate) * up, M x n / 2.
 * Returns 0 when memory for scratch ran out (c is then unset: the caller fails the operation). */
enum { PRODUCT_SWIGLU = 1 };
long mlxpipe_qproduct_calls, mlxpipe_qproduct_plain_calls;

/* c = a W^T one dequantized row of W at a time, in plain C: where no kernel takes W now (its integer
 * products turned off since it was registered, say); slow, for correctness alone. */
static int plain_product(const qmat *m, int M, const float *a, float *c) {
    if (!m->q) return 0; /* (its packed copy alone: the integer products always take it) */
    float *row = malloc((size_t)m->k * sizeof(float));
    if (!row) return 0;
    long row_bytes = (long)m->k * m->bits / 8;
    int groups = m->k / m->group;
    for (int r = 0; r < m->n; r++) {
        const uint8_t *q = m->q + r * row_bytes;
        for (int j = 0; j < m->k; j++)
            row[j] = m->scales[(long)r * groups + j / m->group] * (float)value_at(q, row_bytes, j, m->bits) +
                     m->biases[(long)r * groups + j / m->group];
        for (int i = 0; i < M; i++) {
            float t = 0;
            for (int j = 0; j < m->k; j++) t += a[(long)i * m->k + j] * row[j];
            c[(long)i * m->n + r] = t;
        }
    }
    free(row);
    mlxpipe_qproduct_plain_calls++;
    return 1;
}

int mlxpipe_qproduct(const void *handle, int M, const float *a, float *c, int flags) {
    const qmat *m = (const qmat *)handle;
    float *out = c;
    if (flags & PRODUCT_SWIGLU) { /* the whole product first, then its SwiGLU packed into c */
        static __thread float *scratch;
        static __thread long scratch_len;
        long need = (long)M * m->n;
        if (need > scratch_len) {
            float *grown = realloc(scratch, need * sizeof(float));
            if (!grown) return 0;
            scratch = grown, scratch_len = need;
        }
        out = scratch;
    }
    if (M <= 0) return 1;
    int ok = M == 1 ? qgemv(m, a, 1, 1.0f, out) : qgemm(m, M, a, m->k, 1.0f, out, m->n);
    if (!ok && !plain_product(m, M, a, out)) return 0;
    if (flags & PRODUCT_SWIGLU) {
        swiglu(M, m->n, out, m->n);
        memcpy(c, out, (size_t)M * (m->n / 2) * sizeof(float));
    }
    mlxpipe_qproduct_calls++;
    return 1;
}

/* Makes the packed copy of the matrix mlxpipe_qmatrix returned now, for the integer products (where they
 * run); then, with `only`, forgets its source arrays: the caller may free them, its products read the copy
 * alone (with two 8-bit parts when MLXPIPE_INT8 turns them off). 1 when the copy was made. */
int mlxpipe_qmatrix_pack(void *handle, int only) {
#ifdef X86_AVX512
    qmat *m = (qmat *)handle;
    if (!i8_runs() || !i8_weights(m)) return 0;
    if (only) m->q = 0, m->scales = m->biases = 0;
    return 1;
#else
    (void)handle, (void)only;
    return 0;
#endif
}

/* m's packed copy (made now where it is not yet), its size in bytes and its form (I8_HALF: 16-bit scales,
 * I8_SYMMETRIC: no biases); 0 where the integer products do not run: what a caller keeps (in a file) to adopt
 * it in a later process. */
const void *mlxpipe_qmatrix_packed(void *handle, long *bytes, int *form) {
#ifdef X86_AVX512
    const qmat *m = (const qmat *)handle;
    const uint8_t *p = i8_runs() ? i8_weights(m) : 0;
    if (!p) return 0;
    *form = __atomic_load_n(&m->i8_form, __ATOMIC_RELAXED);
    *bytes = i8_size(m, *form);
    return p;
#else
    (void)handle, (void)bytes, (void)form;
    return 0;
#endif
}

/* Registers W (key w, n x k, bits, group) by its packed copy alone, `bytes` at `packed` (64-byte aligned), as
 * mlxpipe_qmatrix_packed gave it for the same matrix: the caller keeps that memory (a mapped file) while W is
 * registered. 0 where the integer products do not run or the size is not W's. */
void *mlxpipe_qmatrix_adopt(const float *w, int n, int k, int bits, int group, const void *packed, long bytes,
                            int form) {
#ifdef X86_AVX512
    if (!i8_runs() || ((uintptr_t)packed & 63) || group > 256) return 0;
    qmat *m = enter(w, n, k, bits, group, 0, 0, 0);
    if (!m || bytes != i8_size(m, form)) {
        if (m) m->n = -1;
        return 0;
    }
    m->i8_form = form, m->i8_borrowed = 1;
    m->i8 = (uint8_t *)packed;
    return m;
#else
    (void)w, (void)n, (void)k, (void)bits, (void)group, (void)packed, (void)bytes, (void)form;
    return 0;
#endif
}
