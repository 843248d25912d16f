/*
 * cblas_sgemm for MLX's CPU backend, preloaded ahead of the BLAS that does the rest
 * (runner/native/preload.py builds it once with the machine's C compiler, -O3 -march=native).
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
#define _GNU_SOURCE
#include <dlfcn.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { SMALL_ROWS = 40, MAX_THREADS = 16, SPINS = 20000 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);
typedef void (*sgemv_fn)(int, int, int, int, float, const float *, int, const float *, int,
                         float, float *, int);

/* 256-bit vectors wherever there is AVX, AVX-512 machines included: the tiles, the half panels
 * and the attention are written and tuned for them. Built with 512-bit vectors on an AVX-512
 * EPYC (-march=native), the dispatch lost its half panels (HALF_WEIGHTS needs VBYTES 32) and
 * a 15-token SmolLM2 step over 483 cached tokens took 31.1 ms against 21.9. */
#if defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
#define VL (VBYTES / 4)
typedef float vf __attribute__((vector_size(VBYTES)));
/* The same vector, readable at any float's address (rows need not be vector-aligned). */
typedef float vf_unaligned __attribute__((vector_size(VBYTES), aligned(4), may_alias));

static sgemm_fn next_sgemm;
static sgemv_fn next_sgemv;

/* Exported so the runner can tell that this dispatch is in the process. */
int runner_sgemm_dispatch_version(void) { return 6; }

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store_vec(float *p, vf v) { *(vf_unaligned *)p = v; }

/* How a product's W is stored. The half formats hold float16 / bfloat16 copies of float32
 * weights whose every value they represent exactly (made and checked by runner_narrow_panels),
 * in panels (see panel_columns), so a product reads half the bytes and computes float32 sums
 * of the same values: a checkpoint stored in half precision, which the runner computes in
 * float32 on the CPU. */
enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2 };
#if defined(__AVX2__) && defined(__F16C__) && VBYTES == 32
#define HALF_WEIGHTS 1
#include <immintrin.h>
static inline vf load_f16(const unsigned short *p) {
    return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
static inline vf load_bf16(const unsigned short *p) { /* a bfloat16 is a float's high half */
    return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#else
#define HALF_WEIGHTS 0
#endif
/* Wide (512-bit) panel tiles beside the 256-bit ones where there is AVX-512 (see WIDE_TILE). */
#if HALF_WEIGHTS && defined(__AVX512F__)
#define WIDE_PANELS 1
#else
#define WIDE_PANELS 0
#endif

/* f in every lane: one broadcast (a loop over the lanes compiles to a chain of inserts). */
static inline vf splat(float f) { return (vf){0} + f; }

/* *p in every lane, loaded as a broadcast (no register for the zero `splat` adds to). */
#if defined(__AVX__) && VBYTES == 32
static inline vf splat_at(const float *p) { return (vf)_mm256_broadcast_ss(p); }
#else
static inline vf splat_at(const float *p) { return splat(*p); }
#endif

static int ceil_div(long a, long b) { return (int)((a + b - 1) / b); }

/* Which half formats products can read here: 1 when they can, else 0. */
int runner_half_weights(void) { return HALF_WEIGHTS; }

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* The product's operands: C[m, n] = alpha A[m, k] W[n, k]^T + beta C. */
struct product {
    int m, n, k, lda, ldw, ldc;
    float alpha, beta;
    const float *a;
    const void *w; /* stored in `format` */
    float *c;
    int format;
};

static void store(const struct product *p, int i, int j, float dot) {
    float *out = p->c + (size_t)i * p->ldc + j;
    *out = p->beta == 0.0f ? p->alpha * dot : p->alpha * dot + p->beta * *out;
}

#if defined(__AVX__) && VBYTES == 32
#include <immintrin.h>
/* The lane sums of four vectors, stored to out[0..3]. */
static inline void sum4(float *out, vf a, vf b, vf c, vf d) {
    const __m256 ab = _mm256_hadd_ps((__m256)a, (__m256)b), cd = _mm256_hadd_ps((__m256)c, (__m256)d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#else
static inline void sum4(float *out, vf a, vf b, vf c, vf d) {
    out[0] = hsum(a); out[1] = hsum(b); out[2] = hsum(c); out[3] = hsum(d);
}
#endif

/* Keeps a loaded vector in a register: without it the compiler folds the load into every
 * FMA that uses it (one load per product instead of one per vector). */
#if defined(__x86_64__) || defined(__i386__)
#define PIN(v) __asm__("" : "+x"(v))
#else
#define PIN(v) ((void)0)
#endif

/* Dot products of RA rows of A with RW rows of W over the first kv (a multiple of VL) of k,
 * into dot[RA * RW] (row-major): RA*RW accumulators. With `ahead`, `ahead_lines` cache lines
 * from there on are prefetched at every step (see `columns`). For several rows (2x6) the RA vectors
 * of A are held in registers and W's pass one at a time (12 + 2 + 1 of AVX2's 16
 * registers: 8 loads per 12 FMAs); for one row (1x8) W's 8 vectors are loaded against it.
 * Measured here on hot weights, one core (peak 96 GFLOP/s): this 2x6 84 GFLOP/s, 2x6 with
 * W held 71, 3x4 84, 4x3 41 (17 registers: spilled). Measured again in the fifth session,
 * the VM's cores at 2.4 GHz (peak 78): 2x6 45-60 GFLOP/s for 8-32 rows, float16 or float32
 * weights alike (reading float16 is not what bounds it; half copies now go to panel_columns). */
#define TILE(NAME, RA, RW, A_HELD)                                                        \
    static void NAME(const float *const *a, const float *const *w, int kv, float *dot,      \
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

/* Columns [j0, j1) of C, W in float32 (the half formats: panel_columns): RW rows of W at a
 * time (streamed from memory once, the next block fetched while this one is computed from the
 * cache), each against every row of A (from the cache), RA rows at a time.
 *
 * The block PREFETCH_BLOCKS ahead is prefetched while this one is computed: spread over the
 * row groups of A (several rows), or for one row, where a block is one contiguous run of
 * memory, a few lines with every step of the tile. Issued all at once before a one-row tile
 * the prefetches wait on the outstanding misses instead of the arithmetic (measured, one
 * row, both cores, 230 MB of weights: float16 9-10 GB/s at once, 14-18 spread; float32
 * 12-14 either way). */
enum { PREFETCH_BLOCKS = 2 }; /* how far ahead the next weights are fetched, in blocks */
static void panel_columns(const struct product *p, int j0, int j1);
static void columns(const struct product *p, int j0, int j1) {
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
enum { PANEL = 16, PANEL_ROWS = 6, ONE_ROW_PANELS = 4 };

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
typedef float vw __attribute__((vector_size(64)));
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
static int panel_block(const struct product *p) {
    return p->m == 1 ? ONE_ROW_PANELS * PANEL : (1 + WIDE_PANELS) * PANEL;
}

/* Columns [j0, j1) of C (j0 a multiple of PANEL) from W's panels: block by block, the rows of
 * A in groups of at most PANEL_ROWS, as even as they divide (15 rows: 5 + 5 + 5). While a
 * block is computed, the block PREFETCH_BLOCKS ahead (one contiguous run: a block's panels
 * are adjacent) is prefetched, each row group a share of it. Requires alpha 1 and beta 0. */
static void panel_columns(const struct product *p, int j0, int j1) {
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
static void panel_columns(const struct product *p, int j0, int j1) { (void)p, (void)j0, (void)j1; }
long runner_panel_halves(int n, int k) { (void)n, (void)k; return 0; }
int runner_narrow_panels(const float *src, int n, int k, unsigned short *dst, int format) {
    (void)src, (void)n, (void)k, (void)dst, (void)format;
    return 0;
}
#endif

/* --- a small pool: the calling thread takes the first share, workers the others --------- */

static int threads;  /* including the caller */
static pthread_t pool[MAX_THREADS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static atomic_uint generation;
static atomic_int pending, sleeping;

/* The job on the pool: task(task_arg, index, threads) runs once for every index. */
typedef void (*task_fn)(const void *arg, int index, int count);
static task_fn task;
static const void *task_arg;

static void *worker(void *arg) {
    const int index = (int)(size_t)arg;
    unsigned seen = 0;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&generation, memory_order_acquire) == seen) {
            if (++spins < SPINS) continue;
            pthread_mutex_lock(&lock);
            atomic_fetch_add(&sleeping, 1);
            while (atomic_load(&generation) == seen) pthread_cond_wait(&wake, &lock);
            atomic_fetch_sub(&sleeping, 1);
            pthread_mutex_unlock(&lock);
        }
        seen = atomic_load_explicit(&generation, memory_order_acquire);
        task(task_arg, index, threads);
        atomic_fetch_sub_explicit(&pending, 1, memory_order_release);
    }
    return NULL;
}

static pthread_mutex_t callers = PTHREAD_MUTEX_INITIALIZER;

/* A forked child has none of the parent's workers: it starts its own when it needs them. */
static void forked(void) {
    threads = 0;
    pthread_mutex_init(&callers, NULL);
    pthread_mutex_init(&lock, NULL);
    pthread_cond_init(&wake, NULL);
    atomic_store(&sleeping, 0);
}

static void start_pool(void) { /* under `callers` */
    const char *env = getenv("RUNNER_BLAS_THREADS");
    long n = env ? atol(env) : sysconf(_SC_NPROCESSORS_ONLN);
    threads = n < 1 ? 1 : n > MAX_THREADS ? MAX_THREADS : (int)n;
    for (int i = 1; i < threads; i++)
        if (pthread_create(&pool[i], NULL, worker, (void *)(size_t)i) != 0) {
            threads = i;
            break;
        }
    static int registered;
    if (!registered++) pthread_atfork(NULL, NULL, forked);
}

/* fn(arg, i, n) for every i in [0, n), n the pool's threads, the caller taking i = 0; one
 * job on the pool at a time. */
static void parallel(task_fn fn, const void *arg) {
    pthread_mutex_lock(&callers);
    if (threads == 0) start_pool();
    if (threads == 1) {
        pthread_mutex_unlock(&callers);
        fn(arg, 0, 1);
        return;
    }
    task = fn;
    task_arg = arg;
    atomic_store(&pending, threads - 1);
    atomic_fetch_add_explicit(&generation, 1, memory_order_release);
    if (atomic_load(&sleeping) > 0) {
        pthread_mutex_lock(&lock);
        pthread_cond_broadcast(&wake);
        pthread_mutex_unlock(&lock);
    }
    fn(arg, 0, threads);
    while (atomic_load_explicit(&pending, memory_order_acquire) > 0) sched_yield();
    pthread_mutex_unlock(&callers);
}

/* The pool's threads, including the caller (starting the pool if it has not started). */
static int pool_threads(void) {
    pthread_mutex_lock(&callers);
    if (threads == 0) start_pool();
    const int n = threads;
    pthread_mutex_unlock(&callers);
    return n;
}

/* The columns [*j0, *j1) of share `index` of `count` of a product: whole blocks of W's rows,
 * the same for any two products of one shape and weight format. */
static void share_columns(const struct product *p, int index, int count, int *j0, int *j1) {
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
static void product_share(const void *arg, int index, int count) {
    const struct product *p = arg;
    int j0, j1;
    share_columns(p, index, count, &j0, &j1);
    if (j0 < j1) columns(p, j0, j1);
}

static void small_product(const struct product *p) {
    /* Narrow products are not worth waking anyone for. */
    if ((long)p->n * p->k * p->m < (1L << 18)) {
        columns(p, 0, p->n);
        return;
    }
    parallel(product_share, p);
}

/* The BLAS behind this dispatch (OpenBLAS), found once; 0 when there is none. */
static int next_blas(void) {
    if (!next_sgemm) {
        next_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
        next_sgemv = (sgemv_fn)dlsym(RTLD_NEXT, "cblas_sgemv");
    }
    return next_sgemm != NULL;
}

void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, const float *a,
                 int lda, const float *b, int ldb, float beta, float *c, int ldc) {
    next_blas();
    if (order == ROW_MAJOR && m == 1 && !(ta == NO_TRANS && tb == TRANS) && next_sgemv) {
        /* One row against a weight stored [k, n] (or a transposed row): the BLAS's gemv. The
         * usual layout (b stored [n, k]) takes this file's one-row tiles below, which stream
         * the weights at least as fast as OpenBLAS's sgemv (measured here: 10-16 against
         * 9-13 GB/s, both cores). */
        const int incx = ta == NO_TRANS ? 1 : lda;
        if (tb == TRANS) /* b is stored [n, k] */
            next_sgemv(ROW_MAJOR, NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        else /* b is stored [k, n] */
            next_sgemv(ROW_MAJOR, TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        return;
    }
    if (order == ROW_MAJOR && ta == NO_TRANS && tb == TRANS && m <= SMALL_ROWS && m > 0 &&
        n > 0 && k > 0) {
        const struct product p = {m, n, k, lda, ldb, ldc, alpha, beta, a, b, c, W_F32};
        small_product(&p);
        return;
    }
    next_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

/* The decoder layers of Llama-shaped models in one call (runner/backend/native_step.py). */
#include "decoder_step.c"

/* FNV-1a 64 of n bytes from h: the image fold of runner/media/prepare.py (Go's foldValue),
 * one byte at a time by definition, ~120 ms a megabyte in Python. */
unsigned long long runner_fnv1a64(const unsigned char *data, size_t n, unsigned long long h) {
    for (size_t i = 0; i < n; i++) h = (h ^ data[i]) * 0x100000001B3ULL;
    return h;
}
