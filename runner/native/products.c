/*
 * A product C = A W^T of a few rows, W in any of the weight formats: its columns shared over
 * the pool in whole blocks of W's rows, each share computed by the tiles of its format
 * (tiles.c, panels.c), or the whole product sent to the BLAS where that is faster.
 */
#include "internal.h"

/* The columns [*j0, *j1) of share `index` of `count` of a product: whole blocks of W's rows,
 * the same for any two products of one shape and weight format. */
void share_columns(const struct product *p, int index, int count, int *j0, int *j1) {
#if HALF_WEIGHTS
    const int rw = p->format != W_F32 ? panel_block(p) : p->m == 1 ? 8 : 6;
#else
    const int rw = p->m == 1 ? 8 : 6;
#endif
    const int blocks = (p->n + rw - 1) / rw, per = blocks / count, extra = blocks % count;
    const int first = index * per + (index < extra ? index : extra);
    *j0 = first * rw;
    *j1 = (first + per + (index < extra ? 1 : 0)) * rw;
    if (*j1 > p->n) *j1 = p->n;
}

/* Share `index` of `count` of a product's columns. */
void product_share(const void *arg, int index, int count) {
    const struct product *p = arg;
    int j0, j1;
    share_columns(p, index, count, &j0, &j1);
    if (j0 < j1) columns(p, j0, j1);
}

void small_product(const struct product *p) {
    /* Narrow products are not worth waking anyone for. */
    if ((long)p->n * p->k * p->m < (1L << 18)) {
        columns(p, 0, p->n);
        return;
    }
    parallel(product_share, p);
}

/* C = A W^T: the dispatch's tiles up to BLAS_ROWS rows (from W's half panels where there
 * are: half the bytes), the BLAS (which packs) above, on AVX2 (256-bit tiles): SmolLM2
 * forwards after 480 cached tokens, BLAS above 40 rows against above 128: 64 tokens 209
 * against 178-197 ms, 128: 407 against 364. */
enum { BLAS_ROWS = 128 };
struct product tiles_product(int m, int n, int k, const float *a, int lda,
                                    struct weight w, int ldw, float *c, int ldc) {
    const int half = w.half != NULL;
    return (struct product){m, n, k, lda, ldw, ldc, 1.0f, 0.0f, a,
                            half ? w.half : (const void *)w.f32, c, half ? w.format : W_F32};
}

/* Whether a product of m rows with W goes to the BLAS: above BLAS_ROWS rows, except from half
 * panels where there are wide tiles, which beat OpenBLAS's AVX-512 kernels too (SmolLM2,
 * decisions of 64 rows x 18 tokens over 480 shared, whole request: 1.18 s against 1.34 with
 * OpenBLAS above 128 rows, its Cooperlake kernels at ~400 GFLOP/s; 1.10-1.16 against 2.05
 * with the Haswell kernels OPENBLAS_CORETYPE=Haswell asks for). */
int to_blas(int m, struct weight w) {
    if (m <= BLAS_ROWS || (WIDE_PANELS && w.half)) return 0;
    return blas_sgemm() != NULL;
}

void product(int m, int n, int k, const float *a, int lda, struct weight w, int ldw,
                    float *c, int ldc) {
    if (to_blas(m, w)) {
        blas_sgemm()(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0f, a, lda, w.f32, ldw, 0.0f, c, ldc);
        return;
    }
    const struct product p = tiles_product(m, n, k, a, lda, w, ldw, c, ldc);
    small_product(&p);
}

struct products {
    const struct product *p;
    int n;
};

static void products_share(const void *arg, int index, int count) {
    const struct products *ps = arg;
    for (int i = 0; i < ps->n; i++) product_share(&ps->p[i], index, count);
}

/* Products with the same rows of A, one job on the pool: no barrier between them. */
void products_of(int m, int k, const float *a, int n_products, const int *n,
                        const struct weight *w, float *const *c) {
    if (to_blas(m, w[0])) {
        for (int i = 0; i < n_products; i++) product(m, n[i], k, a, k, w[i], k, c[i], n[i]);
        return;
    }
    struct product p[3];
    for (int i = 0; i < n_products; i++) p[i] = tiles_product(m, n[i], k, a, k, w[i], k, c[i], n[i]);
    const struct products ps = {p, n_products};
    if ((long)m * k * n[0] < (1L << 18))
        products_share(&ps, 0, 1);
    else
        parallel(products_share, &ps);
}


/* C[m, n] = A[m, k] W[n, k]^T with W in `format` (a head: W_F32, or an exact half copy). */
int runner_weight_product(int m, int n, int k, const float *a, const void *w, int format,
                          float *c) {
    if (m < 1 || n < 1 || k < 1 || (format != W_F32 && !HALF_WEIGHTS)) return -1;
    const struct product p = {m, n, k, k, k, n, 1.0f, 0.0f, a, w, c, format};
    small_product(&p);
    return 0;
}
