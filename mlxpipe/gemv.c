/* A cblas_sgemm for mlx's CPU backend that sends one-row and one-column products to cblas_sgemv.
 *
 * mlx computes every float32 matrix product with cblas_sgemm, also x @ W.T for a single token (M = 1),
 * which is all a one-stream decode step does. OpenBLAS's sgemm packs the whole weight matrix for that and
 * reads it at ~20 GB/s on the project machine; its sgemv reads the same matrix at ~50 GB/s
 * (bench/RESULTS.md). mlxpipe.gemv compiles this file, calls mlxpipe_gemv_init with the BLAS's own
 * functions, and puts this library before the BLAS in the global symbol scope, so that libmlx's
 * cblas_sgemm binds here. Everything that is not one row or one column goes to the BLAS's sgemm unchanged,
 * and so do small matrices (attention's per-head products at --batch), where sgemm was as fast or faster.
 */
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
