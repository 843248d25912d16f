/*
 * cblas_sgemm for MLX's CPU backend, preloaded ahead of the BLAS that does the work
 * (runner/blas.py). MLX's CPU backend calls cblas_sgemm for every float32 product; OpenBLAS
 * (0.3.21, Debian 12) handles products with few rows badly, because it packs the whole
 * weight matrix for them. Measured on a 2-core AMD EPYC, MLX float32, OpenBLAS 2 threads:
 *
 *   one row (decode steps, one query per head): sgemm reads weights at ~10 GB/s, sgemv at
 *     ~20-30 GB/s: such products go to cblas_sgemv;
 *   2..SMALL_ROWS rows (short forwards, one decision over a cached prefix): the same product
 *     computed as (op(B)^T op(A)^T)^T, the orientation OpenBLAS packs cheaply, runs 1.6x
 *     faster (M=20, K=576, N=1536: 55 -> 87 GFLOP/s); the few-row result is transposed back;
 *   everything else: passed through unchanged.
 *
 * Numbers are the underlying BLAS's own: the same dot products, summed in another order.
 * Column-major calls, and anything the paths above do not cover, pass through untouched.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { SMALL_ROWS = 32, MIN_WEIGHT_ELEMENTS = 1 << 16 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;
static __thread float *scratch;
static __thread size_t scratch_floats;

/* Exported so the runner can tell that this dispatch is in the process. */
int runner_sgemm_dispatch_version(void) { return 1; }

static void resolve(void) {
    next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
}

static float *scratch_of(size_t floats) {
    if (floats > scratch_floats) {
        free(scratch);
        scratch = malloc(floats * sizeof(float));
        scratch_floats = scratch ? floats : 0;
    }
    return scratch;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    if (!next_sgemm) resolve();
    if (order == ROW_MAJOR && m == 1 && next_sgemv) {
        /* c[1,n] = alpha a[1,k] op(b)[k,n] + beta c: the row times op(b). */
        int incx = ta == NO_TRANS ? 1 : lda;
        if (tb == TRANS) /* b is stored [n, k] */
            next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        else /* b is stored [k, n] */
            next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        return;
    }
    if (order == ROW_MAJOR && m > 1 && m <= SMALL_ROWS && (long)n * k >= MIN_WEIGHT_ELEMENTS) {
        float *t = scratch_of((size_t)n * m);
        if (t) {
            /* t[n,m] = op(b)^T op(a)^T, then c = t^T (+ beta c). */
            next_sgemm(ROW_MAJOR, tb == TRANS ? NO_TRANS : TRANS, ta == NO_TRANS ? TRANS : NO_TRANS,
                       n, m, k, alpha, b, ldb, a, lda, 0.0f, t, m);
            for (int i = 0; i < m; i++) {
                float *row = c + (size_t)i * ldc;
                const float *col = t + i;
                if (beta == 0.0f)
                    for (int j = 0; j < n; j++) row[j] = col[(size_t)j * m];
                else
                    for (int j = 0; j < n; j++) row[j] = col[(size_t)j * m] + beta * row[j];
            }
            return;
        }
    }
    next_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
