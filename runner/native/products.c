/*
 * A product C = A W^T of a few rows, W in any of the weight formats: its columns cut into
 * chunks of whole blocks of W's rows, which the pool's threads take in turn, each chunk
 * computed by the tiles of its format (tiles.c, panels.c), or the whole product sent to the
 * BLAS where that is faster. A column's sums are the same whichever chunk or thread holds it.
 */
#include "internal.h"

/* How many of C's columns a block of a product's W is: its columns are shared over the pool
 * in whole blocks. */
int column_block(const struct product *p) {
    if (p->format == W_AFFINE) return affine_block(p);
    if (ggml_format(p->format)) return ggml_block(p);
#if HALF_WEIGHTS
    if (p->format != W_F32) return panel_block(p);
#endif
    return p->m == 1 ? 8 : 6;
}

/* The columns [*j0, *j1) of share `index` of `count` of a product: whole blocks of W's rows,
 * the same for any two products of one shape and weight format. */
void share_columns(const struct product *p, int index, int count, int *j0, int *j1) {
    const int rw = column_block(p);
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

struct products {
    const struct product *p;
    int n;
    atomic_int next; /* the next chunk to take */
};

/* A job's products in CHUNKS_PER_THREAD chunks a thread, taken in turn by whichever thread
 * is free: with one share fixed to each thread the job waited for the slowest (a worker that
 * saw the job late, a core the VM gave elsewhere for a while). Qwen3-0.6B's Q4_K_M decode
 * token 27.08 -> 26.44 ms; forwards of 18 to 512 rows the same (bench/RESULTS.md, "The pool's
 * chunks, and attention's path by the cores"). */
static void products_share(const void *arg, int index, int count) {
    (void)index;
    struct products *ps = (struct products *)arg;
    const int chunks = count * CHUNKS_PER_THREAD;
    for (int c; (c = atomic_fetch_add_explicit(&ps->next, 1, memory_order_relaxed)) < ps->n * chunks;)
        product_share(&ps->p[c / chunks], c % chunks, chunks);
}

void small_product(const struct product *p) {
    /* Narrow products are not worth waking anyone for. */
    if ((long)p->n * p->k * p->m < (1L << 18)) {
        columns(p, 0, p->n);
        return;
    }
    struct products ps = {p, 1, 0};
    parallel(products_share, &ps);
}

/* C = A W^T: the dispatch's tiles up to BLAS_ROWS rows (from W's half panels where there
 * are: half the bytes), the BLAS (which packs) above, on AVX2 (256-bit tiles): SmolLM2
 * forwards after 480 cached tokens, BLAS above 40 rows against above 128: 64 tokens 209
 * against 178-197 ms, 128: 407 against 364. Quantized weights have no float32 copy: their
 * tiles take any number of rows. */
enum { BLAS_ROWS = 128 };

/* The product of A (rows of k, `lda` apart; for W_AFFINE in its tiles' order: rows_for) with
 * w, into C. */
struct product tiles_product(int m, int n, int k, const float *a, int lda,
                             const struct step_weight *w, float *c, int ldc, const void *limbs) {
    return (struct product){m, n, k, lda, k, ldc, 1.0f, 0.0f, a, w->data, c, w->format,
                            w->bits, w->group, w->scale_format, w->scales, w->biases, limbs, NULL};
}

/* Whether a product of m rows with W goes to the BLAS: above BLAS_ROWS rows when it has W in
 * float32, except from half panels where there are wide tiles, which beat OpenBLAS's AVX-512
 * kernels too (SmolLM2, decisions of 64 rows x 18 tokens over 480 shared, whole request:
 * 1.18 s against 1.34 with OpenBLAS above 128 rows, its Cooperlake kernels at ~400
 * GFLOP/s; 1.10-1.16 against 2.05 with the Haswell kernels OPENBLAS_CORETYPE=Haswell asks
 * for). */
int to_blas(int m, const struct step_weight *w) {
    const float *f32 = w->format == W_F32 ? w->data : w->f32;
    if (m <= BLAS_ROWS || !f32 || (WIDE_PANELS && w->format != W_F32)) return 0;
    return blas_sgemm() != NULL;
}

/* A's rows as w's tiles read them: `a` itself, or (W_AFFINE codes that the tiles unpack in
 * another order than k's) copied into `reordered` (m * k floats) in that order. */
float *rows_for(const struct step_weight *w, int m, int k, const float *a, int lda,
                float *reordered) {
    if (w->format != W_AFFINE || !affine_reordered(w->bits)) return (float *)a;
    affine_rows(w->bits, m, k, a, lda, reordered);
    return reordered;
}

/* C = A W^T; `reordered`: m * k floats of scratch (rows_for); `limbs`: NULL, or A's rows
 * as limbs (a decode step's). */
void product(int m, int n, int k, const float *a, int lda, const struct step_weight *w,
             float *c, int ldc, float *reordered, const void *limbs) {
    if (to_blas(m, w)) {
        const float *f32 = w->format == W_F32 ? w->data : w->f32;
        pool_rest();
        blas_sgemm()(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0f, a, lda, f32, k, 0.0f, c, ldc);
        return;
    }
    struct amx_rows amx;
    const struct amx_rows *split = amx_rows_of(m, k, a, lda, w, limbs, &amx);
    /* the tiles read A's digits, not its rows: no reordered copy for them */
    const float *rows = split ? a : rows_for(w, m, k, a, lda, reordered);
    const int ld = rows == a ? lda : k;
    struct product p = tiles_product(m, n, k, rows, ld, w, c, ldc, limbs);
    p.amx = split;
    small_product(&p);
}

/* Products with the same rows of A (k apart), one job on the pool: no barrier between them.
 * `reordered`: m * k floats of scratch, filled once for the products that read A in another
 * order (affine_rows: one order, 4-bit codes'). */
void products_of(int m, int k, const float *a, int n_products, const int *n,
                 const struct step_weight *const *w, float *const *c, float *reordered,
                 const void *limbs) {
    int blas = 0;
    for (int i = 0; i < n_products; i++) blas |= to_blas(m, w[i]);
    if (blas) {
        for (int i = 0; i < n_products; i++)
            product(m, n[i], k, a, k, w[i], c[i], n[i], reordered, limbs);
        return;
    }
    struct product p[3];
    int filled = 0, tried = 0; /* A split for the tiles once, for every product that takes them */
    struct amx_rows amx;
    const struct amx_rows *split = NULL;
    for (int i = 0; i < n_products; i++) {
        const float *rows = a;
        const struct amx_rows *tiles = NULL;
        if (amx_takes(m, k, w[i], limbs)) {
            if (!tried) split = amx_rows_of(m, k, a, k, w[i], limbs, &amx), tried = 1;
            tiles = split;
        }
        if (!tiles && w[i]->format == W_AFFINE && affine_reordered(w[i]->bits)) {
            if (!filled) affine_rows(w[i]->bits, m, k, a, k, reordered);
            filled = 1;
            rows = reordered;
        }
        p[i] = tiles_product(m, n[i], k, rows, k, w[i], c[i], n[i], limbs);
        p[i].amx = tiles;
    }
    struct products ps = {p, n_products, 0};
    if ((long)m * k * n[0] < (1L << 18))
        products_share(&ps, 0, 1);
    else
        parallel(products_share, &ps);
}


/* C[m, n] = A[m, k] W[n, k]^T (a head: W_F32, an exact half copy, W_AFFINE or a GGML block format);
 * `decode`: A's rows are a decode step's (GGML blocks and 5-bit codes take limbs where the
 * build has them: limbs_read). */
int runner_weight_product(int m, int n, int k, const float *a, const struct step_weight *w,
                          float *c, int decode) {
    if (m < 1 || n < 1 || k < 1 || !w || !runner_weight_supported(w, n, k)) return -1;
    float *reordered = NULL, *limbs = NULL;
    if (w->format == W_AFFINE && affine_reordered(w->bits)) {
        reordered = malloc(sizeof(float) * (size_t)m * k);
        if (!reordered) return -1;
    }
    if (decode && limbs_read(w, k) && limb_floats(m, k)) {
        limbs = aligned_alloc(64, (sizeof(float) * (size_t)limb_floats(m, k) + 63) / 64 * 64);
        if (limbs && !limb_split(m, k, a, k, limbs)) {
            free(limbs);
            limbs = NULL;
        }
    }
    const struct step_weight tiles = {w->format, w->bits, w->group, w->scale_format, w->data,
                                      w->scales, w->biases, NULL}; /* never the BLAS */
    product(m, n, k, a, k, &tiles, c, n, reordered, limbs);
    free(reordered);
    free(limbs);
    return 0;
}

int runner_weight_supported(const struct step_weight *w, int n, int k) {
    if (!w || !w->data || n < 1 || k < 1) return 0;
    switch (w->format) {
    case W_F32: return 1;
    case W_F16: case W_BF16: return HALF_WEIGHTS;
    case W_AFFINE: return affine_supported(w, n, k);
    default: return ggml_format(w->format) ? ggml_supported(w, n, k) : 0;
    }
}
