/*
 * What the native library's sources share and nothing outside it sees: vector types and
 * helpers, the product descriptor, and the functions one source calls in another (hidden:
 * the library is built with -fvisibility=hidden; runner_native.h is the exported ABI).
 *
 * Each source has one job: dispatch.c (MLX's cblas_sgemm, routed), pool.c (the thread pool),
 * products.c (a product C = A W^T in any weight format, split over the pool or sent to the
 * BLAS), tiles.c (float32 dot-product tiles), panels.c (half-precision panels and their tiles),
 * quantized.c (MLX's affine-quantized weights and their tiles), amx.c (a forward's K-quant rows on Intel's AMX tiles), attention.c (a layer's attention), decoder_step.c (the decoder layers), hash.c (the image
 * fold), abi.c (the ABI handshake).
 */
#ifndef RUNNER_NATIVE_INTERNAL_H
#define RUNNER_NATIVE_INTERNAL_H

#define _GNU_SOURCE
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#include "runner_native.h"

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };
enum { MAX_THREADS = 16 }; /* the pool's threads at most (pool.c), the caller included */
/* How far ahead the next weights are fetched, in blocks (tiles.c, panels.c). */
enum { PREFETCH_BLOCKS = 2 };
/* A product job's columns in this many chunks a pool thread, taken in turn (products.c) */
enum { CHUNKS_PER_THREAD = 4 };

typedef void (*sgemm_fn)(int, int, int, int, int, int, float, const float *, int,
                         const float *, int, float, float *, int);

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

static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store_vec(float *p, vf v) { *(vf_unaligned *)p = v; }

#if defined(__AVX2__) && defined(__F16C__) && VBYTES == 32
#define HALF_WEIGHTS 1
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

static inline int ceil_div(long a, long b) { return (int)((a + b - 1) / b); }

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* The product's operands: C[m, n] = alpha A[m, k] W[n, k]^T + beta C. */
struct product {
    int m, n, k, lda, ldw, ldc;
    float alpha, beta;
    const float *a; /* W_AFFINE: in the order of its tiles' lanes (affine_rows) */
    const void *w;  /* stored in `format` */
    float *c;
    int format;
    int bits, group, scale_format; /* W_AFFINE (struct step_weight) */
    const void *scales, *biases;
    /* NULL, or A's rows as limbs (limb_split): a decode step's products (GGML blocks and 5-bit
     * W_AFFINE read them where the build has their tiles: limbs_read) */
    const void *limbs;
    /* NULL, or A's rows as the AMX tiles read them (amx.c: amx_rows_of), where W's format
     * takes them (amx_takes) */
    const struct amx_rows *amx;
};

static inline void store(const struct product *p, int i, int j, float dot) {
    float *out = p->c + (size_t)i * p->ldc + j;
    *out = p->beta == 0.0f ? p->alpha * dot : p->alpha * dot + p->beta * *out;
}

#if defined(__AVX__) && VBYTES == 32
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

#if WIDE_PANELS
typedef float vw __attribute__((vector_size(64)));
#endif

typedef int vi __attribute__((vector_size(VBYTES)));


static inline vf select_(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* e^x, Cephes' single-precision polynomial (about 1 ulp), VL lanes at a time. */
static inline vf vexp(vf x) {
    const vf one = splat(1.0f);
    x = select_(x > splat(88.3762626647949f), splat(88.3762626647949f), x);
    x = select_(x < splat(-88.3762626647949f), splat(-88.3762626647949f), x);
    const vf fx = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    n = n - select_(n > fx, one, splat(0.0f)); /* floor */
    x = x - n * 0.693359375f - n * -2.12194440e-4f;
    vf y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + one;
    const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
    return y * (vf)e;
}

/* tanh(x) as (1 - e^-2|x|) / (1 + e^-2|x|) with x's sign: within a few float32 ulps of 1 + tanh,
 * what GELU's approximation adds it to, and exactly +-1 past |x| = 44 (vexp's clamp). */
static inline vf vtanh(vf x) {
    const vf a = select_(x < 0.0f, -x, x), e = vexp(a * -2.0f);
    const vf t = (1.0f - e) / (1.0f + e);
    return select_(x < 0.0f, -t, t);
}

/* Half panels (panels.c): PANEL rows of W interleaved; a product's rows in groups of at most
 * PANEL_ROWS; one row against ONE_ROW_PANELS panels at once. */
enum { PANEL = 16, PANEL_ROWS = 6, ONE_ROW_PANELS = 4 };

/* dispatch.c: the BLAS behind the library (OpenBLAS), found once; NULL when there is none. */
sgemm_fn blas_sgemm(void);

/* pool.c: fn(arg, i, n) for every i in [0, n), n the pool's threads, the caller taking i = 0;
 * one job on the pool at a time. pool_threads: their number, the caller included. pool_rest:
 * idle workers stop spinning (called before the BLAS, which has threads of its own). */
typedef void (*task_fn)(const void *arg, int index, int count);
void parallel(task_fn fn, const void *arg);
int pool_threads(void);
void pool_rest(void);

/* tiles.c: columns [j0, j1) of a product (W_F32 here, the half formats from panels.c); the
 * dot-product tiles, which attention.c uses too. */
void columns(const struct product *p, int j0, int j1);
void tile_2x6(const float *const *a, const float *const *w, int kv, float *dot,
              const char *ahead, int ahead_lines);
void tile_1x8(const float *const *a, const float *const *w, int kv, float *dot,
              const char *ahead, int ahead_lines);
void tile_3x4(const float *const *a, const float *const *w, int kv, float *dot,
              const char *ahead, int ahead_lines);

/* panels.c: columns [j0, j1) from W's half panels; how many columns a block of one is. */
void panel_columns(const struct product *p, int j0, int j1);
/* panels.c: the same from a GGUF's F16 / BF16 rows (W_GF16, W_GBF16), made into panels a
 * block at a time; where HALF_WEIGHTS, with alpha 1 and beta 0. */
void half_rows_columns(const struct product *p, int j0, int j1);
int panel_block(const struct product *p);

/* quantized.c: columns [j0, j1) from W_AFFINE weights (p->a in the order affine_rows
 * leaves it); how many columns a block of one is; whether A's rows are read in another order
 * than k's (then affine_rows copies them into it: m * k floats at `into`). */
void affine_columns(const struct product *p, int j0, int j1);
int affine_block(const struct product *p);
int affine_reordered(int bits);
void affine_rows(int bits, int m, int k, const float *a, int lda, float *into);
int affine_supported(const struct step_weight *w, int n, int k);
/* Whether a weight format is one of GGML's grid i-quants (W_IQ2XXS .. W_IQ1M). */
static inline int grid_format(int format) { return format >= W_IQ2XXS && format <= W_IQ1M; }
/* Whether a weight format is one of GGML's blocks (ggml_columns reads them). */
static inline int half_row_format(int format) { return format == W_GF16 || format == W_GBF16; }
static inline int ggml_format(int format) {
    return format == W_Q6K || format == W_Q4K || format == W_Q5K || format == W_Q3K || format == W_Q2K ||
           format == W_IQ4XS || format == W_IQ4NL || grid_format(format) || half_row_format(format);
}
/* quantized.c: the same for the GGML block formats (ggml_format; A in order of k). */
void ggml_columns(const struct product *p, int j0, int j1);
int ggml_block(const struct product *p);
int ggml_supported(const struct step_weight *w, int n, int k);
/* quantized.c: A's rows as a decode step's limbs (into `out`, limb_floats(m, k) floats),
 * returning 1; 0 where this build has no limb products or A cannot be split (then `out` is
 * not to be read). limbs_read: whether products of w [., k] read limbs in this build. */
int limb_split(int m, int k, const float *a, int lda, void *out);
long limb_floats(int m, int k);
int limbs_read(const struct step_weight *w, int k);

/* A's limbs for 256 of a row's values (quantized.c: limb_split; amx.c reads them too). */
struct limb_block {
    signed char l[3][256];
    signed char l4[3][256]; /* the same in Q4_K's order: 32-value runs 0 2 1 3 4 6 5 7 */
    short l12[256];         /* AVX2 without VNNI: l1 * 128 + l2, a run's values in the order
                             * vpunpcklbw and vpunpckhbw widen its codes (limb_store12) */
    float q4k[16];   /* a / 16384 of the 8 runs of 32, then each run's sum of x */
    float q6k_u[16]; /* a / 16384 of the run holding each 16 values (Q6_K's, Q3_K's, Q2_K's
                      * sub-blocks) */
    float q6k_s[16]; /* each 16 values' sum of x */
};

/* quantized.c: buffer `slot` (< THREAD_BUFFERS) of the calling thread's (the pool's threads
 * keep theirs), `floats` floats at least, 64-byte aligned, grown as needed (aborts when memory
 * runs out). Slots 0-1: quantized.c's tiles; 2: amx.c's codes of W; 3-4: amx.c's rows of A. */
enum { THREAD_BUFFERS = 6 };
float *thread_buffer(int slot, size_t floats);

/* products.c */
int column_block(const struct product *p);
void share_columns(const struct product *p, int index, int count, int *j0, int *j1);
void product_share(const void *arg, int index, int count);
void small_product(const struct product *p);
struct product tiles_product(int m, int n, int k, const float *a, int lda,
                             const struct step_weight *w, float *c, int ldc, const void *limbs);
int to_blas(int m, const struct step_weight *w);
float *rows_for(const struct step_weight *w, int m, int k, const float *a, int lda,
                float *reordered);
/* `limbs`: NULL, or A's rows as limb_split made them (read where limbs_read says) */
void product(int m, int n, int k, const float *a, int lda, const struct step_weight *w,
             float *c, int ldc, float *reordered, const void *limbs);
void products_of(int m, int k, const float *a, int n_products, const int *n,
                 const struct step_weight *const *w, float *const *c, float *reordered,
                 const void *limbs);

#if defined(__AVX__) && VBYTES == 32
/* r[0 .. 8) transposed in place as an 8 x 8 matrix of 32-bit lanes (lane j of r[i] to lane i
 * of r[j]): the usual unpack / shuffle / permute. */
static inline void transpose8(__m256 *r) {
    __m256 t[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        const __m256 lo = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
        t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
        t[i] = lo;
    }
    for (int i = 0; i < 8; i++) r[i] = t[i];
}
#endif

#if defined(__AVX512F__)
/* v[d] = lane d of each of the 16 vectors r[0 .. 16) (lane i of v[d] from r[i]): a 16 x 16
 * transpose of 32-bit lanes (within 128-bit lanes, then the 128-bit lanes). */
static inline void transpose16(const __m512i *r, __m512i *v) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int k = 0; k < 16; k += 4) { /* u[k + j]'s 128-bit lane L: rows k .. k + 3's lane 4L + j */
        u[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        u[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        u[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        u[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
        v[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        v[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        v[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        v[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}
#endif

/* amx.c: products of a forward's rows from GGML Q4_K and Q5_K blocks (and W_AFFINE codes of 2
 * to 5 bits) by Intel's AMX tiles,
 * where the build has them (x86-64 Linux, AMX-INT8 and AVX512-VNNI) and the machine runs
 * them. A's rows as the tiles read them: each 32-run's limbs (limb_split's) as two pairs of
 * signed bytes in the tiles' layout, 8 rows a group, and each run's step a / 16384 and sum
 * of x. */
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && \
    defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__x86_64__) && defined(__linux__)
#define AMX_PRODUCTS 1
#else
#define AMX_PRODUCTS 0
#endif
struct amx_rows {
    int m, groups, runs;       /* rows, groups of 8 of them, runs of 32 a row (k / 32) */
    const signed char *digits; /* [groups][runs][2 x 8 rows][64]: each row's digits (amx.c) */
    const float *unit, *sum;  /* [groups][runs][8 rows] */
};
/* amx_rows_of: A's rows for products of m rows of A [m, k] with w on the tiles, made into
 * *into (in buffers of the calling thread's, kept until its next call) and returned where
 * they take them (a forward's rows, not a decode step's: `limbs` NULL; a format the tiles
 * read; the machine runs them and runner_amx_products has not turned them off; A split:
 * an infinite or NaN value has no limbs), else NULL (the float tiles); amx_takes: all of
 * that but the split. amx_columns: columns [j0, j1) of C (whole blocks of AMX_BLOCK rows of
 * W: ggml_block). */
int amx_takes(int m, int k, const struct step_weight *w, const void *limbs);
/* amx_affine (AMX_PRODUCTS builds): whether a forward's rows of W_AFFINE w [., k] take the
 * tiles (then a decode step's are marked by limbs: limbs_read) */
int amx_affine(int k, const struct step_weight *w);
const struct amx_rows *amx_rows_of(int m, int k, const float *a, int lda,
                                   const struct step_weight *w, const void *limbs,
                                   struct amx_rows *into);
void amx_columns(const struct product *p, int j0, int j1);
enum { AMX_BLOCK = 16 };
/* quantized.c: rows j .. j + 15 of W (rows past n read as row n - 1) as the AMX tiles take
 * them: each 32-run's codes q (unsigned) as [8 q, q] in the tiles' layout,
 * codes[run][t][16 rows x 4] (t < 8: 8 times codes 4t .. 4t + 3 of each row; t >= 8: codes
 * 4(t - 8) .. of each row), and its scale and bias, scale[run][row], bias[run][row] (the
 * value: scale * q + bias); W_Q4K or W_Q5K. */
void ggml_tile_codes(const struct product *p, int j, unsigned char *codes, float *scale,
                     float *bias);
/* the same for W_AFFINE codes of 2 to 5 bits (k a multiple of 64; each run's scale and bias
 * its group's) */
void affine_tile_codes(const struct product *p, int j, unsigned char *codes, float *scale,
                       float *bias);

/* attention.c: one layer's attention, and the scratch floats it needs. */
void attention(const struct step_args *a, const struct step_cache *cache, const float *sinks,
               const float *q, const float *nk, const float *nv, float *out, float *scores);
long attention_scratch_floats(const struct step_args *a);

#endif
