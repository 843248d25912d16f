/*
 * Products from exact half-precision copies of float32 weights, stored as panels.
 */
#include "internal.h"

/* Which half formats products can read here: 1 when they can, else 0. */
int runner_half_weights(void) { return HALF_WEIGHTS; }

/* --- products from half-precision panels ---------------------------------------------------
 *
 * The half copies are stored in panels (runner_narrow_panels): for every PANEL rows of W (PANEL
 * columns of C), their k values interleaved, panel[t * PANEL + c] = W[j0 + c][t], rows past n
 * zero. A product on them is a sum of outer products: each step t broadcasts A[i][t] for a
 * group of rows and multiplies it with the panel's row t (two vectors, widened in registers),
 * into R x 2 accumulators that are C's values themselves. No horizontal sums, no tails in k,
 * and the panel is one contiguous run of memory.
 *
 * Measured on the 2-core AVX2 VM, one core, m = 15, SmolLM2's 576 x 3072 (gate and up), hot
 * weights: 5 x 2 panel tiles 75-91 GFLOP/s against 58-65 for the 2x6 dot-product tiles on the
 * same float16 values stored by rows (whose 12 horizontal sums a tile, and every row of A
 * re-read from L2 for every 6 rows of W, cost a third); 6 x 2 75-80, 4 x 2 60-64.
 *
 * Numbers: every value of C is the sum over t of A[i][t] W[j][t], in order of t, with one
 * fused multiply-add a step: the same bits whatever the number of rows (batched rows, one row,
 * a decode step) and however rows are grouped. */
#if HALF_WEIGHTS

static inline void load_panel(int format, const unsigned short *p, vf *lo, vf *hi) {
    if (format == W_F16) {
        *lo = load_f16(p);
        *hi = load_f16(p + 8);
    } else {
        *lo = load_bf16(p);
        *hi = load_bf16(p + 8);
    }
}

/* R rows of A (a[r * lda]) times P consecutive panels (stride `panel_step` halves) over all of
 * k, into out[r][0, P * PANEL) (stride ldo). `lines` cache lines from `ahead` on are
 * prefetched, spread evenly over the k steps: every step prefetches P lines from the one its
 * share has reached (a 16.16 fixed-point position), so no branch decides when; a line asked
 * for again is already on its way. (Deciding with a branch every few steps measured 48
 * against 87 GFLOP/s without prefetches, one core, 15 rows, hot weights; even a branch on
 * whether to prefetch at all, the same at every step, made a 15-token forward 1.15x slower:
 * GCC then compiles the loop worse.) */
#define TILE_PREFETCH_START                                                                    \
    const char *fetch = ahead ? ahead : (const char *)w; /* no lines: w's, at hand */         \
    const unsigned long step = ahead ? ((unsigned long)lines << 16) / (unsigned)k : 0;        \
    unsigned long at = 0 /* the line reached, 16.16 */
#define TILE_PREFETCH(P)                                                                       \
    _Pragma("GCC unroll 4") for (int q = 0; q < P; q++)                                       \
        __builtin_prefetch(fetch + ((at >> 16) + q) * 64, 0, 3)
#define PANEL_TILE(NAME, R, P, FORMAT)                                                           \
    static void NAME(const float *a, long lda, const unsigned short *w, long panel_step, int k, \
                     float *out, long ldo, const char *ahead, int lines) {                     \
        vf acc[R * P * 2], zero = {0};                                                          \
        PIN(zero);                                                                              \
        _Pragma("GCC unroll 16") for (int q = 0; q < R * P * 2; q++) acc[q] = zero;             \
        TILE_PREFETCH_START;                                                                    \
        for (int t = 0; t < k; t++, at += step) {                                               \
            TILE_PREFETCH(P);                                                                   \
            vf b[P * 2];                                                                        \
            _Pragma("GCC unroll 8") for (int q = 0; q < P; q++) {                               \
                load_panel(FORMAT, w + q * panel_step + (size_t)t * PANEL, &b[2 * q], &b[2 * q + 1]); \
                PIN(b[2 * q]);                                                                  \
                PIN(b[2 * q + 1]);                                                              \
            }                                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                const vf x = splat_at(a + r * lda + t);                                         \
                _Pragma("GCC unroll 8") for (int q = 0; q < P * 2; q++)                         \
                    acc[r * P * 2 + q] += x * b[q];                                             \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 8") for (int q = 0; q < P * 2; q++)                             \
                store_vec(out + r * ldo + q * VL, acc[r * P * 2 + q]);                          \
    }
#define PANEL_TILES(F, FORMAT)                                                                  \
    PANEL_TILE(panel_1x1_##F, 1, 1, FORMAT)                                                     \
    PANEL_TILE(panel_2x1_##F, 2, 1, FORMAT)                                                     \
    PANEL_TILE(panel_3x1_##F, 3, 1, FORMAT)                                                     \
    PANEL_TILE(panel_4x1_##F, 4, 1, FORMAT)                                                     \
    PANEL_TILE(panel_5x1_##F, 5, 1, FORMAT)                                                     \
    PANEL_TILE(panel_6x1_##F, 6, 1, FORMAT)                                                     \
    PANEL_TILE(panel_1x4_##F, 1, ONE_ROW_PANELS, FORMAT)
PANEL_TILES(f16, W_F16)
PANEL_TILES(bf16, W_BF16)

typedef void (*panel_tile_fn)(const float *, long, const unsigned short *, long, int, float *, long,
                              const char *, int);
static const panel_tile_fn panel_tiles[2][PANEL_ROWS + 1] = {
    {NULL, panel_1x1_f16, panel_2x1_f16, panel_3x1_f16, panel_4x1_f16, panel_5x1_f16, panel_6x1_f16},
    {NULL, panel_1x1_bf16, panel_2x1_bf16, panel_3x1_bf16, panel_4x1_bf16, panel_5x1_bf16, panel_6x1_bf16},
};

/* Wide panel tiles (AVX-512), for products of several rows: a panel row is one 512-bit vector
 * and a tile takes two panels (R x 2 accumulators, as many as a 256-bit tile's R x 1 panel),
 * twice the work an instruction where the cores execute 512-bit arithmetic at full width. The
 * same sums in the same order (one fused multiply-add a step, in order of t): the same bits as
 * the 256-bit tiles. Measured on an AVX-512 EPYC (Zen 5), SmolLM2 over 483 cached tokens, one
 * process alternating builds: 15 tokens 24.25 -> 16.31 ms (0.673x), 64 tokens 0.633x, 4
 * tokens 0.994x. One row stays on the 256-bit 1 x 4 tile, which streams the weights as fast
 * (a wide one with 4 accumulators: 1.033x slower). */
#if WIDE_PANELS
static inline vw load_wide(int format, const unsigned short *p) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    if (format == W_F16) return (vw)_mm512_cvtph_ps(h);
    return (vw)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}
#define WIDE_TILE(NAME, R, P, FORMAT)                                                            \
    static void NAME(const float *a, long lda, const unsigned short *w, long panel_step, int k, \
                     float *out, long ldo, const char *ahead, int lines) {                     \
        vw acc[R * P], zero = {0};                                                              \
        __asm__("" : "+v"(zero));                                                               \
        _Pragma("GCC unroll 16") for (int q = 0; q < R * P; q++) acc[q] = zero;                 \
        TILE_PREFETCH_START;                                                                    \
        for (int t = 0; t < k; t++, at += step) {                                               \
            TILE_PREFETCH(P);                                                                   \
            vw b[P];                                                                            \
            _Pragma("GCC unroll 8") for (int q = 0; q < P; q++) {                               \
                b[q] = load_wide(FORMAT, w + q * panel_step + (size_t)t * PANEL);               \
                __asm__("" : "+v"(b[q]));                                                       \
            }                                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                               \
                const vw x = (vw)_mm512_set1_ps(a[r * lda + t]);                                \
                _Pragma("GCC unroll 8") for (int q = 0; q < P; q++) acc[r * P + q] += x * b[q]; \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++)                                    \
            _Pragma("GCC unroll 8") for (int q = 0; q < P; q++)                                 \
                _mm512_storeu_ps(out + r * ldo + q * PANEL, (__m512)acc[r * P + q]);            \
    }
#define WIDE_TILES(F, FORMAT)                                                                   \
    WIDE_TILE(wide_1x2_##F, 1, 2, FORMAT)                                                       \
    WIDE_TILE(wide_2x2_##F, 2, 2, FORMAT)                                                       \
    WIDE_TILE(wide_3x2_##F, 3, 2, FORMAT)                                                       \
    WIDE_TILE(wide_4x2_##F, 4, 2, FORMAT)                                                       \
    WIDE_TILE(wide_5x2_##F, 5, 2, FORMAT)                                                       \
    WIDE_TILE(wide_6x2_##F, 6, 2, FORMAT)
WIDE_TILES(f16, W_F16)
WIDE_TILES(bf16, W_BF16)
static const panel_tile_fn wide_tiles[2][PANEL_ROWS + 1] = {
    {NULL, wide_1x2_f16, wide_2x2_f16, wide_3x2_f16, wide_4x2_f16, wide_5x2_f16, wide_6x2_f16},
    {NULL, wide_1x2_bf16, wide_2x2_bf16, wide_3x2_bf16, wide_4x2_bf16, wide_5x2_bf16, wide_6x2_bf16},
};
#endif

/* How many of C's columns a block of a panel product is: one panel (two with wide tiles),
 * four for one row. */
int panel_block(const struct product *p) {
    return p->m == 1 ? ONE_ROW_PANELS * PANEL : (1 + WIDE_PANELS) * PANEL;
}

/* Columns [j0, j1) of C (j0 a multiple of PANEL) from W's panels: block by block, the rows of
 * A in groups of at most PANEL_ROWS, as even as they divide (15 rows: 5 + 5 + 5). While a
 * block is computed, the block PREFETCH_BLOCKS ahead (one contiguous run: a block's panels
 * are adjacent) is prefetched, each row group a share of it. Requires alpha 1 and beta 0. */
void panel_columns(const struct product *p, int j0, int j1) {
    const int k = p->k, f = p->format == W_BF16, block = panel_block(p);
    const long panel_step = (long)PANEL * k; /* halves from one panel to the next */
    const unsigned short *base = p->w;
    const int groups = ceil_div(p->m, PANEL_ROWS), size = p->m / groups, bigger = p->m % groups;
    const int block_lines = (int)((size_t)block * k * 2 / 64);
    float spill[PANEL_ROWS * PANEL];
    for (int j = j0; j < j1; j += block) {
        const int cols = j1 - j < block ? j1 - j : block;
        const unsigned short *w = base + (size_t)(j / PANEL) * panel_step;
        const int fetch = j + (PREFETCH_BLOCKS + 1) * block <= j1;
        const char *ahead = (const char *)(w + (size_t)PREFETCH_BLOCKS * (block / PANEL) * panel_step);
        for (int g = 0, i = 0; g < groups; g++) {
            const int r = size + (g < bigger);
            const float *a = p->a + (size_t)i * p->lda;
            float *c = p->c + (size_t)i * p->ldc + j;
            const int l0 = block_lines * g / groups, l1 = block_lines * (g + 1) / groups;
            const char *at = fetch ? ahead + (size_t)l0 * 64 : NULL;
            const int lines = fetch ? l1 - l0 : 0;
            if (p->m == 1 && cols == block) {
                /* prefetched on the AVX-512 machine (Zen 5: SmolLM2's decode step 7.58-7.80 ->
                 * 6.81-7.24 ms; Qwen3-0.6B's, bound by memory already, the same), not on the
                 * AVX2 one (17.5 against 20.9 GB/s: its stream prefetcher did better alone) */
                const int spread = WIDE_PANELS;
                (f ? panel_1x4_bf16 : panel_1x4_f16)(a, p->lda, w, panel_step, k, c, p->ldc,
                                                     spread ? at : NULL, spread ? lines : 0);
#if WIDE_PANELS
            } else if (cols == 2 * PANEL) {
                wide_tiles[f][r](a, p->lda, w, panel_step, k, c, p->ldc, at, lines);
#endif
            } else if (cols % PANEL == 0) {
                for (int q = 0; q * PANEL < cols; q++)
                    panel_tiles[f][r](a, p->lda, w + q * panel_step, panel_step, k, c + q * PANEL,
                                      p->ldc, q ? NULL : at, q ? 0 : lines);
            } else { /* the last columns: whole panels into `spill`, the wanted ones copied */
                for (int q = 0; q * PANEL < cols; q++) {
                    const int n = cols - q * PANEL < PANEL ? cols - q * PANEL : PANEL;
                    panel_tiles[f][r](a, p->lda, w + q * panel_step, panel_step, k, spill, PANEL, NULL, 0);
                    for (int ii = 0; ii < r; ii++)
                        memcpy(c + (size_t)ii * p->ldc + q * PANEL, spill + ii * PANEL, sizeof(float) * n);
                }
            }
            i += r;
        }
    }
}

/* --- products from a GGUF's F16 / BF16 rows (W_GF16, W_GBF16) -----------------------------
 *
 * The rows as the file stores them, made into panels a block at a time (a buffer of the
 * thread's, laid out as runner_narrow_panels lays them) and multiplied by the panel tiles
 * above: every value the sum over t in order with one FMA a step, so the same bits for any
 * number of rows, whichever block or thread holds a column, as the half copies' products.
 * The interleaving moves each weight once a block for all rows of A. Measured (2026-12-07,
 * Qwen3-0.6B's matrices x 28 in float16, the 2-core Xeon VM): by the rows' own block tiles
 * (quantized.c, the dot products of the GGML formats) 1.4-1.5x the half copies' time at
 * 8-128 rows; this way, bench/RESULTS.md "A GGUF's half-precision matrices as stored". */

/* panel[t * PANEL + c] = rows[c][t] for t < k (a multiple of 32), c < PANEL. */
static void interleave_rows(const unsigned short *const *rows, int k, unsigned short *panel) {
    int t0 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    /* 32 halves of each row as 16 pairs (dwords), transposed: v[d] holds pair d of every row,
     * whose halves vpermw separates into steps 2d and 2d + 1 (one 64-byte store) */
    const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1,
                                           30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    for (; t0 + 32 <= k; t0 += 32) {
        __m512i r[PANEL], v[PANEL];
        for (int c = 0; c < PANEL; c++) r[c] = _mm512_loadu_si512((const void *)(rows[c] + t0));
        transpose16(r, v);
        for (int d = 0; d < PANEL; d++)
            _mm512_storeu_si512((void *)(panel + (size_t)(t0 + 2 * d) * PANEL), _mm512_permutexvar_epi16(split, v[d]));
    }
#elif defined(__AVX2__)
    /* 16 halves of 8 rows at a time as 8 pairs, transposed (8 x 8 dwords), each pair's halves
     * separated within 128-bit lanes (vpshufb) and the lanes' halves gathered (vpermq) */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (; t0 + 16 <= k; t0 += 16)
        for (int c0 = 0; c0 < PANEL; c0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)(rows[c0 + i] + t0)));
            transpose8(r);
            for (int d = 0; d < 8; d++) { /* pair d of the 8 rows: steps 2d and 2d + 1 */
                const __m256i x = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(_mm256_castps_si256(r[d]), split), 0xD8);
                _mm_storeu_si128((__m128i *)(panel + (size_t)(t0 + 2 * d) * PANEL + c0), _mm256_castsi256_si128(x));
                _mm_storeu_si128((__m128i *)(panel + (size_t)(t0 + 2 * d + 1) * PANEL + c0), _mm256_extracti128_si256(x, 1));
            }
        }
#endif
    for (int t = t0; t < k; t++)
        for (int c = 0; c < PANEL; c++) panel[(size_t)t * PANEL + c] = rows[c][t];
}

void half_rows_columns(const struct product *p, int j0, int j1) {
    const int k = p->k, block = panel_block(p);
    const unsigned short *base = p->w;
    unsigned short *panels = (unsigned short *)thread_buffer(5, (size_t)block * k / 2);
    struct product q = *p;
    q.format = p->format == W_GBF16 ? W_BF16 : W_F16;
    q.w = panels;
    for (int j = j0; j < j1; j += block) {
        const int cols = j1 - j < block ? j1 - j : block;
        /* the next block's rows fetched into L2 while this one is made and multiplied */
        const int next = j1 - j - block < block ? j1 - j - block : block;
        for (int r = 0; r < next; r++)
            for (int t = 0; t < k; t += 32) __builtin_prefetch(base + (size_t)(j + block + r) * k + t, 0, 2);
        for (int c0 = 0; c0 < cols; c0 += PANEL) {
            const unsigned short *rows[PANEL];
            for (int c = 0; c < PANEL; c++) /* past the columns wanted: any row (not kept) */
                rows[c] = base + (size_t)(j + (c0 + c < cols ? c0 + c : 0)) * k;
            interleave_rows(rows, k, panels + (size_t)(c0 / PANEL) * PANEL * k);
        }
        q.c = p->c + j;
        panel_columns(&q, 0, cols);
    }
}

/* The panels of W [n, k] in `format`: panel_halves(n, k) halves. */
long runner_panel_halves(int n, int k) { return (long)ceil_div(n, PANEL) * PANEL * k; }

/* dst[0, n) = src in `format` (W_F16 or W_BF16): 1 when that holds every value exactly (bit
 * for bit back in float32), else 0. */
static int narrow_row(const float *src, int n, unsigned short *dst, int format) {
    if (format == W_BF16) {
        const unsigned *bits = (const unsigned *)src;
        unsigned low = 0;
        for (int i = 0; i < n; i++) {
            low |= bits[i] & 0xffffu;
            dst[i] = (unsigned short)(bits[i] >> 16);
        }
        return low == 0;
    }
    int i = 0;
    __m256i differ = _mm256_setzero_si256();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(src + i);
        const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(dst + i), h);
        differ = _mm256_or_si256(differ, _mm256_xor_si256(_mm256_castps_si256(v),
                                                          _mm256_castps_si256(_mm256_cvtph_ps(h))));
    }
    int same = _mm256_testz_si256(differ, differ);
    for (; i < n; i++) {
        dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const float back = _cvtsh_ss(dst[i]);
        same &= memcmp(&back, src + i, 4) == 0;
    }
    return same;
}

/* dst = the panels of src [n, k] in `format` (W_F16 or W_BF16) when that holds every one of
 * its values exactly (bit for bit back in float32): returns 1; else 0, dst undefined. */
int runner_narrow_panels(const float *src, int n, int k, unsigned short *dst, int format) {
    if (format != W_F16 && format != W_BF16) return 0;
    /* Each row narrowed with vectors into `rows` (16 rows, in L1 or L2), then interleaved:
     * narrowing straight into the panel, one strided value at a time, took ~3 ns a value
     * (1.8 s of load time for Qwen3-0.6B). */
    unsigned short *rows = malloc(sizeof(unsigned short) * PANEL * (size_t)k);
    if (!rows) return 0;
    int same = 1;
    for (int j0 = 0; j0 < n && same; j0 += PANEL) {
        unsigned short *panel = dst + (size_t)(j0 / PANEL) * PANEL * k;
        for (int c = 0; c < PANEL; c++) {
            unsigned short *row = rows + (size_t)c * k;
            if (j0 + c < n)
                same &= narrow_row(src + (size_t)(j0 + c) * k, k, row, format);
            else
                memset(row, 0, sizeof(unsigned short) * k);
        }
        for (int t = 0; t < k; t++)
            for (int c = 0; c < PANEL; c++) panel[(size_t)t * PANEL + c] = rows[(size_t)c * k + t];
    }
    free(rows);
    return same;
}
#else
void panel_columns(const struct product *p, int j0, int j1) { (void)p, (void)j0, (void)j1; }
void half_rows_columns(const struct product *p, int j0, int j1) { (void)p, (void)j0, (void)j1; }
long runner_panel_halves(int n, int k) { (void)n, (void)k; return 0; }
int runner_narrow_panels(const float *src, int n, int k, unsigned short *dst, int format) {
    (void)src, (void)n, (void)k, (void)dst, (void)format;
    return 0;
}
#endif
