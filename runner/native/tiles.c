/*
 * Products of a few rows from float32 weights: RA rows of A against RW rows of W in tiles of
 * vector dot products (see the header of dispatch.c for why and what was measured).
 */
#include "internal.h"

/* Dot products of RA rows of A with RW rows of W over the first kv (a multiple of VL) of k,
 * into dot[RA * RW] (row-major): RA*RW accumulators. With `ahead`, `ahead_lines` cache lines
 * from there on are prefetched at every step (see `columns`). For several rows (2x6) the RA vectors
 * of A are held in registers and W's pass one at a time (12 + 2 + 1 of AVX2's 16
 * registers: 8 loads per 12 FMAs); for one row (1x8) W's 8 vectors are loaded against it.
 * Measured here on hot weights, one core (peak 96 GFLOP/s): this 2x6 84 GFLOP/s, 2x6 with
 * W held 71, 3x4 84, 4x3 41 (17 registers: spilled). Measured again at aa507a6 (2026-12-01),
 * the VM's cores at 2.4 GHz (peak 78): 2x6 45-60 GFLOP/s for 8-32 rows, float16 or float32
 * weights alike (reading float16 is not what bounds it; half copies now go to panel_columns). */
#define TILE(NAME, RA, RW, A_HELD)                                                        \
    void NAME(const float *const *a, const float *const *w, int kv, float *dot,      \
                     const char *ahead, int ahead_lines) {                                 \
        _Static_assert((RA * RW) % 4 == 0, "sums are taken 4 at a time");                  \
        vf acc[RA * RW], zero = {0};                                                       \
        PIN(zero); /* else the zeroing is a call to memset and a trip through the stack */ \
        _Pragma("GCC unroll 16") for (int q = 0; q < RA * RW; q++) acc[q] = zero;          \
        for (int t = 0; t < kv; t += VL) {                                                 \
            if (ahead) { /* the lines of a later block, a few with every step */           \
                for (int q = 0; q < ahead_lines; q++) __builtin_prefetch(ahead + q * 64, 0, 3); \
                ahead += ahead_lines * 64;                                                 \
            }                                                                              \
            if (A_HELD) {                                                                  \
                vf x[RA];                                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < RA; r++) {                     \
                    x[r] = load(a[r] + t);                                                 \
                    PIN(x[r]);                                                             \
                }                                                                          \
                _Pragma("GCC unroll 8") for (int b = 0; b < RW; b++) {                     \
                    vf y = load(w[b] + t);                                                 \
                    PIN(y);                                                                \
                    _Pragma("GCC unroll 8") for (int r = 0; r < RA; r++) acc[r * RW + b] += x[r] * y; \
                }                                                                          \
            } else {                                                                       \
                vf y[RW];                                                                  \
                _Pragma("GCC unroll 8") for (int b = 0; b < RW; b++) y[b] = load(w[b] + t);  \
                _Pragma("GCC unroll 8") for (int r = 0; r < RA; r++) {                     \
                    const vf x = load(a[r] + t);                                           \
                    _Pragma("GCC unroll 8") for (int b = 0; b < RW; b++) acc[r * RW + b] += x * y[b]; \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int q = 0; q < RA * RW; q += 4)                                               \
            sum4(dot + q, acc[q], acc[q + 1], acc[q + 2], acc[q + 3]);                     \
    }
TILE(tile_2x6, 2, 6, 1)
TILE(tile_1x8, 1, 8, 0)
TILE(tile_3x4, 3, 4, 1)

/* Columns [j0, j1) of C, W in float32 (the half formats: panel_columns; W_AFFINE:
 * affine_columns): RW rows of W at a
 * time (streamed from memory once, the next block fetched while this one is computed from the
 * cache), each against every row of A (from the cache), RA rows at a time.
 *
 * The block PREFETCH_BLOCKS ahead is prefetched while this one is computed: spread over the
 * row groups of A (several rows), or for one row, where a block is one contiguous run of
 * memory, a few lines with every step of the tile. Issued all at once before a one-row tile
 * the prefetches wait on the outstanding misses instead of the arithmetic (measured, one
 * row, both cores, 230 MB of weights: float16 9-10 GB/s at once, 14-18 spread; float32
 * 12-14 either way). */
void columns(const struct product *p, int j0, int j1) {
    if (p->format == W_AFFINE) {
        affine_columns(p, j0, j1);
        return;
    }
    if (ggml_format(p->format)) {
        ggml_columns(p, j0, j1);
        return;
    }
    if (p->format != W_F32) {
        panel_columns(p, j0, j1);
        return;
    }
    const int one = p->m == 1, RA = one ? 1 : 2, RW = one ? 8 : 6;
    const int k = p->k, kv = k - k % VL, groups = (p->m + RA - 1) / RA;
    const size_t row_bytes = (size_t)p->ldw * 4;
    const char *base = p->w;
    const int spread = one && p->ldw == k && kv >= VL;
    const int spread_lines = spread ? ceil_div((long)((RW * row_bytes + 63) / 64), kv / VL) : 0;
    for (int j = j0; j < j1; j += RW) {
        const int nj = j1 - j < RW ? j1 - j : RW;
        const float *w[8];
        for (int jj = 0; jj < RW; jj++)
            w[jj] = (const float *)(base + (size_t)(j + (jj < nj ? jj : 0)) * row_bytes);
        const int ahead = j + PREFETCH_BLOCKS * RW; /* the first row of the block fetched */
        const char *spread_at = spread && ahead + RW <= j1 ? base + (size_t)ahead * row_bytes : NULL;
        for (int i = 0, g = 0; i < p->m; i += RA, g++) {
            const int ni = p->m - i < RA ? p->m - i : RA;
            const size_t t0 = (size_t)k * g / groups * 4, t1 = (size_t)k * (g + 1) / groups * 4;
            for (int jj = 0; jj < RW && !spread_at; jj++) {
                const int row = ahead + jj;
                if (row >= j1) break;
                const char *next = base + (size_t)row * row_bytes;
                for (size_t t = t0; t < t1; t += 64) __builtin_prefetch(next + t, 0, 3);
            }
            const float *a[2];
            for (int ii = 0; ii < RA; ii++)
                a[ii] = p->a + (size_t)(i + (ii < ni ? ii : 0)) * p->lda;
            float dot[12];
            (one ? tile_1x8 : tile_2x6)(a, w, kv, dot, spread_at, spread_lines);
            for (int ii = 0; ii < ni; ii++)
                for (int jj = 0; jj < nj; jj++) {
                    float d = dot[ii * RW + jj];
                    for (int t = kv; t < k; t++) d += a[ii][t] * w[jj][t];
                    store(p, i + ii, j + jj, d);
                }
        }
    }
}
