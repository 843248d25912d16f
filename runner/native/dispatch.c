/*
 * cblas_sgemm for MLX's CPU backend, preloaded ahead of the BLAS that does the rest
 * (runner/native/build.py builds the library once with the machine's C compiler).
 *
 * MLX's CPU backend hands every float32 product to cblas_sgemm. OpenBLAS (0.3.21, Debian 12)
 * packs both operands of every product, which pays off for many rows and is ruinous for few:
 * a forward of a few tokens reads every weight matrix from memory once, and packing turns
 * that into ~3 GB/s of weights (measured: M=20 rows, 60 cold 576x1536 weights, 28-34
 * GFLOP/s; one row: sgemm 7 GB/s). Products of up to SMALL_ROWS rows against a
 * row-major weight used transposed (C = A W^T: MLX's `x @ W.T`, and attention's q k^T) are
 * computed here instead: each 6-row block of W (8 for one row of A) is streamed from memory
 * once, prefetched two blocks ahead, and multiplied with every row of A from the cache in
 * 2x6 (1x8) tiles of vector dot products, the columns of C split across the machine's cores.
 * Measured on this VM's AVX2 cores (bench/sgemm.py): 2x6 tiles over 4x3 ones, +17% per
 * core on cold weights for 16-40 rows; one row at 10-16 GB/s against OpenBLAS sgemv's 9-13.
 * Everything else passes through unchanged.
 *
 * The decoder step (decoder_step.c) also multiplies with exact half-precision copies of a
 * checkpoint's weights, stored as panels of 16 rows of W interleaved (runner_narrow_panels)
 * and read as sums of outer products (panel_columns): no horizontal sums, half the bytes.
 *
 * Numbers: the same dot products as OpenBLAS, summed in another order (float32 rounding); on
 * the panels, each value summed in order of k.
 */
#include "internal.h"

#include <dlfcn.h>

enum { SMALL_ROWS = 40 };

typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* The BLAS behind this dispatch (OpenBLAS), found once; 0 when there is none. */
static void find_blas(void) {
    if (!next_sgemm) {
        next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
        next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    }
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    find_blas();
    if (order == ROW_MAJOR && m == 1 && !(ta == NO_TRANS && tb == TRANS) && next_sgemv) {
        /* One row against a weight stored [k, n] (or a transposed row): the BLAS's gemv. The
         * usual layout (b stored [n, k]) takes this file's one-row tiles below, which stream
         * the weights at least as fast as OpenBLAS's sgemv (measured here: 10-16 against
         * 9-13 GB/s, both cores). */
        const int incx = ta == NO_TRANS ? 1 : lda;
        pool_rest();
        if (tb == TRANS) /* b is stored [n, k] */
            next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        else /* b is stored [k, n] */
            next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        return;
    }
    if (order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && m <= SMALL_ROWS && m > 0 &&
        n > 0 && k > 0) {
        const struct product p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, W_F32, 0, 0, 0, NULL, NULL, NULL, NULL};
        small_product(&p);
        return;
    }
    pool_rest();
    next_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

sgemm_fn blas_sgemm(void) {
    find_blas();
    return next_sgemm;
}
