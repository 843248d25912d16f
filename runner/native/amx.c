/*
 * Products of a forward's rows from GGML Q4_K and Q5_K blocks, and from MLX's affine codes of
 * 2 to 5 bits (affine_tile_codes: each run's scale and bias its group's), by Intel's AMX
 * tiles (AMX-INT8: Sapphire Rapids and later Xeons), where the build has them (internal.h:
 * AMX_PRODUCTS) and
 * the machine runs them: a probe in a child process (a VM may list AMX and fault on its tile
 * loads, as the one of 2026-12-03 did); OLLAMA_MLX_RUNNER_AMX=0 turns them off. A decode
 * step's rows keep the VNNI limbs (quantized.c), which stream W at memory's rate where the
 * tiles, at one or two rows, do not (bench/RESULTS.md, "AMX tiles in the library"); a decode
 * step's affine rows their stream tiles (limbs_read marks them).
 *
 * Numbers. A's rows are split as a decode step's are (limb_split): each run of 32 values, with
 * a = max |x| / 127 over the run, as three signed 8-bit limbs, x ~ a (l0 + l1 / 128 +
 * l2 / 16384), that is a L / 16384 with the integer L = 16384 l0 + 128 l1 + l2
 * (|L| <= 2,089,024). The run's products with W's codes q (unsigned, below 32) are the
 * integer S = sum q L, which the tiles compute exactly: L = 2048 P_hi + P_lo (P_lo in
 * [-1028, 1019], P_hi in [-1020, 1020]), each P = 8 m0 + m1 with m0, m1 signed bytes, and
 * `tdpbsud` multiplies a row of A's digits [m0 of the 32 values, m1 of them] (64 bytes) by W's
 * [8 q, q] of the run (codes below 32: 8 q fits a byte), so a tile row of C is
 * S_hi = sum q P_hi (of P_lo: S_lo), and S = 2048 S_hi + S_lo (< 2^31 in magnitude). Then for
 * each row of A and each row of W, in order of the runs: acc = fma(S, scale * (a / 16384),
 * acc), acc = fma(bias, the run's float32 sum of x, acc), W's value being scale * q + bias
 * (Q4_K's and Q5_K's d * sc and -(dmin * m)). So a value is the dequantized weights' product
 * within the limbs' bound (~1e-6 of sum |w x|, as a decode step's), its bits those of its own
 * row of A and its own row of W alone: the same for any number of rows, whichever group of
 * A's rows it falls in, and any share of the columns. They are not the float tiles' bits, nor
 * a decode step's (whose lanes sum four products at a time): on an AMX machine a forward's
 * Q4_K products differ from another CPU's in their last bits, as the builds of other vector
 * widths do. A row with an infinite or NaN value has no limbs: the whole product then takes
 * the float tiles (amx_split declines).
 *
 * Layout. A column block of 16 rows of W is unpacked once (ggml_tile_codes: each run's [8 q, q]
 * in the layout `tdpbsud` reads its second operand in, 16 rows of 4 bytes x 16 rows of W; 32 KB
 * for k = 1024) and multiplied by every group of 8 rows of A in a chunk of groups whose digits
 * fit in L2 (amx_split made them once a product: a run's tile holds the group's P_hi rows,
 * then its P_lo rows; each column block is unpacked again for each chunk). One tile product a
 * run and group (16 x 16 x 64), alternating between two sets of tiles run by run (tiles have
 * no renaming: a run's product would otherwise wait for the run before's); the int32 sums go
 * to memory (`tilestored`) and are combined two runs later, while the tile products go on.
 */
#include "internal.h"

#if AMX_PRODUCTS
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* GROUP rows of A a tile product (two digits each: 16 tile rows); a tile row of A is a run's
 * two digits, K = 64 bytes; W's tile holds the codes times 8, then the codes (16 rows of K). */
enum { RUN = 32, GROUP = AMX_BLOCK / 2, K = 2 * RUN, A_BYTES = AMX_BLOCK * K };
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
/* how many runs later a run's int32 sums are combined: a run's tile product and the store
 * of its sums take longer than the combining of one run (measured at 128 rows, one thread:
 * a run later 238 GFLOP/s, two runs later 273) */
enum { LAG = 2 };
/* A's digits a chunk of groups (half a Sapphire Rapids core's L2): Qwen3-0.6B's 3072 x 1024,
 * two threads, 1024 rows 261 -> 371 GFLOP/s, 512 rows 324 -> 376 (256 KB chunks: 357, 341;
 * 2 MB: 324, 346) */
enum { CHUNK_BYTES = 1 << 20 };

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Two sets of tiles, runs alternating between them (tiles have no renaming: a run's tile
 * products would otherwise wait for the run before's): C 0 and 1 (2 `rows` rows of A's
 * digits x 16 rows of W, int32), A 2 and 3 (2 `rows` x 64 bytes), W 4 and 5 (16 x 64). */
static void configure(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)(2 * rows), c.colsb[t] = 64;
    for (int t = 4; t < 6; t++) c.rows[t] = AMX_BLOCK, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* In the probe's child: 0 when a tile product equals its integer reference. */
static int tiles_compute(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
    signed char a[AMX_BLOCK][K] __attribute__((aligned(64)));
    unsigned char b[AMX_BLOCK][K] __attribute__((aligned(64)));
    int32_t c[AMX_BLOCK][AMX_BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < AMX_BLOCK; i++)
        for (int t = 0; t < K; t++) {
            a[i][t] = (signed char)((i * 7 + t * 13) % 255 - 127);
            b[i][t] = (unsigned char)((i * 29 + t * 11) % 256);
        }
    configure(GROUP);
    _tile_zero(0);
    _tile_loadd(2, a, K);
    _tile_loadd(4, b, K);
    _tile_dpbsud(0, 2, 4);
    _tile_stored(0, c, AMX_BLOCK * 4);
    _tile_release();
    for (int i = 0; i < AMX_BLOCK; i++)
        for (int j = 0; j < AMX_BLOCK; j++) {
            int32_t want = 0;
            for (int t = 0; t < K; t++) want += a[i][t] * b[t / 4][j * 4 + t % 4];
            if (c[i][j] != want) return 3;
        }
    return 0;
}

/* Whether this process may run the tiles: not turned off by OLLAMA_MLX_RUNNER_AMX=0, a child
 * (forked without the parent's fork handlers: it only runs the tiles and exits) computed a
 * tile product right, and the kernel granted this process the tiles' state. */
static int probe(void) {
    const char *setting = getenv("OLLAMA_MLX_RUNNER_AMX");
    if (setting && strcmp(setting, "0") == 0) return 0;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 34))
    const pid_t child = _Fork();
#else
    const pid_t child = fork();
#endif
    if (child == 0) _exit(tiles_compute());
    if (child < 0) return 0;
    int status;
    pid_t done;
    while ((done = waitpid(child, &status, 0)) < 0 && errno == EINTR) {
    }
    if (done != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static pthread_once_t probed = PTHREAD_ONCE_INIT;
static int runs_tiles;           /* the probe's answer */
static atomic_int turned_on = 1; /* runner_amx_products */

static void probe_once(void) { runs_tiles = probe(); }

static int amx_on(void) {
    if (!atomic_load_explicit(&turned_on, memory_order_relaxed)) return 0;
    pthread_once(&probed, probe_once);
    return runs_tiles;
}

int runner_amx_products(int set) {
    if (set == 0 || set == 1) atomic_store(&turned_on, set);
    pthread_once(&probed, probe_once);
    return runs_tiles && atomic_load(&turned_on);
}

/* MLX's affine codes below 32 (2 to 5 bits; mxfp4's e2m1 codes are not linear in their
 * values) in steps of two runs */
static int affine_takes(int k, const struct step_weight *w) {
    return w->format == W_AFFINE && w->scale_format != W_E8M0 && w->bits >= 2 && w->bits <= 5 &&
           k % 64 == 0;
}

int amx_takes(int m, int k, const struct step_weight *w, const void *limbs) {
    const int ggml = (w->format == W_Q4K || w->format == W_Q5K) && k % 256 == 0;
    return !limbs && m > 0 && (ggml || affine_takes(k, w)) && amx_on();
}

int amx_affine(int k, const struct step_weight *w) { return affine_takes(k, w) && amx_on(); }

static int amx_split(int m, int k, const float *a, int lda, struct amx_rows *out);

const struct amx_rows *amx_rows_of(int m, int k, const float *a, int lda,
                                   const struct step_weight *w, const void *limbs,
                                   struct amx_rows *into) {
    return amx_takes(m, k, w, limbs) && amx_split(m, k, a, lda, into) ? into : NULL;
}

/* A run's 32 values' two digits pairs (see the top) at hi and lo (64 bytes each: m0 of the
 * 32 values, then m1), from the limbs l0, l1, l2 (32 each). */
static void run_digits(const signed char *l0, const signed char *l1, const signed char *l2,
                       signed char *hi, signed char *lo) {
    for (int h = 0; h < 2; h++) {
        const __m512i v0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(l0 + 16 * h)));
        const __m512i v1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(l1 + 16 * h)));
        const __m512i v2 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(l2 + 16 * h)));
        /* L = 16384 l0 + 128 l1 + l2; P_lo = L mod 2048 in [-1028, 1019]; P_hi = (L - P_lo) / 2048 */
        const __m512i L = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(_mm512_slli_epi32(v0, 7), v1), 7), v2);
        const __m512i plo = _mm512_sub_epi32(
            _mm512_and_si512(_mm512_add_epi32(L, _mm512_set1_epi32(1028)), _mm512_set1_epi32(2047)),
            _mm512_set1_epi32(1028));
        const __m512i phi = _mm512_srai_epi32(_mm512_sub_epi32(L, plo), 11);
        /* P = 8 m0 + m1: m1 in [-3, 4] for P_hi (in [-1020, 1020]), in [-4, 3] for P_lo */
        const __m512i m1h = _mm512_sub_epi32(
            _mm512_and_si512(_mm512_add_epi32(phi, _mm512_set1_epi32(3)), _mm512_set1_epi32(7)),
            _mm512_set1_epi32(3));
        const __m512i m1l = _mm512_sub_epi32(
            _mm512_and_si512(_mm512_add_epi32(plo, _mm512_set1_epi32(4)), _mm512_set1_epi32(7)),
            _mm512_set1_epi32(4));
        const __m512i m0h = _mm512_srai_epi32(_mm512_sub_epi32(phi, m1h), 3);
        const __m512i m0l = _mm512_srai_epi32(_mm512_sub_epi32(plo, m1l), 3);
        _mm_storeu_si128((__m128i *)(hi + 16 * h), _mm512_cvtepi32_epi8(m0h));
        _mm_storeu_si128((__m128i *)(hi + RUN + 16 * h), _mm512_cvtepi32_epi8(m1h));
        _mm_storeu_si128((__m128i *)(lo + 16 * h), _mm512_cvtepi32_epi8(m0l));
        _mm_storeu_si128((__m128i *)(lo + RUN + 16 * h), _mm512_cvtepi32_epi8(m1l));
    }
}

static int amx_split(int m, int k, const float *a, int lda, struct amx_rows *out) {
    const int runs = k / RUN, groups = (m + GROUP - 1) / GROUP;
    const size_t digit_bytes = (size_t)groups * runs * A_BYTES;
    const size_t floats = digit_bytes / 4 + (size_t)2 * groups * runs * GROUP;
    float *buffer = thread_buffer(3, floats);
    struct limb_block *row = (struct limb_block *)thread_buffer(4, (size_t)limb_floats(1, k));
    signed char *digits = (signed char *)buffer;
    float *unit = buffer + digit_bytes / 4, *sum = unit + (size_t)groups * runs * GROUP;
    for (int i = 0; i < m; i++) {
        if (!limb_split(1, k, a + (size_t)i * lda, lda, row)) return 0;
        const int g = i / GROUP, c = i % GROUP;
        const int rows = g == groups - 1 ? m - g * GROUP : GROUP;
        for (int s = 0; s < runs; s++) {
            const struct limb_block *L = row + s / 8;
            const size_t at = (size_t)g * runs + s;
            const int j = RUN * (s % 8);
            signed char *tile = digits + at * A_BYTES;
            run_digits(L->l[0] + j, L->l[1] + j, L->l[2] + j, tile + (size_t)c * K,
                       tile + (size_t)(rows + c) * K);
            unit[at * GROUP + c] = L->q4k[s % 8];
            sum[at * GROUP + c] = L->q4k[8 + s % 8];
        }
    }
    *out = (struct amx_rows){m, groups, runs, digits, unit, sum};
    return 1;
}

/* Rows g GROUP .. g GROUP + rows - 1 of C's columns j .. j + nj - 1 (a group of A's rows
 * against a column block of W whose codes, scales and biases ggml_tile_codes made): each
 * run's tile product while the sums of the run LAG before are combined (the tiles' stores
 * reach memory before the vector loads that read them). */
static void group_columns(const struct product *p, int g, int rows, int j, int nj,
                          const unsigned char *codes, const float *scale, const float *bias) {
    const struct amx_rows *x = p->amx;
    const int runs = x->runs;
    int32_t c[LAG + 1][AMX_BLOCK][AMX_BLOCK] __attribute__((aligned(64)));
    __m512 acc[GROUP];
    for (int i = 0; i < GROUP; i++) acc[i] = _mm512_setzero_ps();
    const signed char *digits = x->digits + (size_t)g * runs * A_BYTES;
    const float *unit = x->unit + (size_t)g * runs * GROUP;
    const float *sum = x->sum + (size_t)g * runs * GROUP;
    for (int s = 0; s < runs + LAG; s++) {
        if (s >= LAG) {
            const int t = s - LAG;
            const __m512 sc = _mm512_loadu_ps(scale + (size_t)t * AMX_BLOCK);
            const __m512 bi = _mm512_loadu_ps(bias + (size_t)t * AMX_BLOCK);
            const float *u = unit + (size_t)t * GROUP, *total = sum + (size_t)t * GROUP;
            const int32_t(*ct)[AMX_BLOCK] = c[t % (LAG + 1)];
            _Pragma("GCC unroll 8") for (int i = 0; i < GROUP; i++) {
                if (i >= rows) break;
                /* S = 2048 S_hi + S_lo: the run's products with L = 16384 l0 + 128 l1 + l2 */
                const __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void *)ct[i]), 11),
                                                   _mm512_load_si512((const void *)ct[rows + i]));
                const __m512 f = _mm512_mul_ps(sc, _mm512_set1_ps(u[i]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), f, acc[i]);
                acc[i] = _mm512_fmadd_ps(bi, _mm512_set1_ps(total[i]), acc[i]);
            }
        }
        if (s < runs && (s & 1)) {
            _tile_loadd(5, codes + (size_t)s * AMX_BLOCK * K, K);
            _tile_loadd(3, digits + (size_t)s * A_BYTES, K);
            _tile_zero(1);
            _tile_dpbsud(1, 3, 5);
            _tile_stored(1, c[s % (LAG + 1)], AMX_BLOCK * 4);
        } else if (s < runs) {
            _tile_loadd(4, codes + (size_t)s * AMX_BLOCK * K, K);
            _tile_loadd(2, digits + (size_t)s * A_BYTES, K);
            _tile_zero(0);
            _tile_dpbsud(0, 2, 4);
            _tile_stored(0, c[s % (LAG + 1)], AMX_BLOCK * 4);
        }
    }
    const int i0 = g * GROUP;
    if (nj == AMX_BLOCK && p->alpha == 1.0f && p->beta == 0.0f) {
        for (int i = 0; i < rows; i++) _mm512_storeu_ps(p->c + (size_t)(i0 + i) * p->ldc + j, acc[i]);
        return;
    }
    float out[AMX_BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < rows; i++) {
        _mm512_store_ps(out, acc[i]);
        for (int r = 0; r < nj; r++) store(p, i0 + i, j + r, out[r]);
    }
}

void amx_columns(const struct product *p, int j0, int j1) {
    const struct amx_rows *x = p->amx;
    const int runs = x->runs, last = x->m - (x->groups - 1) * GROUP;
    unsigned char *codes = (unsigned char *)thread_buffer(2, (size_t)runs * (AMX_BLOCK * K / 4 + 2 * AMX_BLOCK));
    float *scale = (float *)(codes + (size_t)runs * AMX_BLOCK * K), *bias = scale + (size_t)runs * AMX_BLOCK;
    /* A's groups in chunks whose digits stay in L2 while the chunk passes every column block
     * (each block unpacked once a chunk) */
    const int fit = (int)(CHUNK_BYTES / ((size_t)runs * A_BYTES)), chunk = fit > 0 ? fit : 1;
    int configured = 0;
    for (int g0 = 0; g0 < x->groups; g0 += chunk) {
        const int g1 = g0 + chunk < x->groups ? g0 + chunk : x->groups;
        for (int j = j0; j < j1; j += AMX_BLOCK) {
            (p->format == W_AFFINE ? affine_tile_codes : ggml_tile_codes)(p, j, codes, scale, bias);
            const int nj = j1 - j < AMX_BLOCK ? j1 - j : AMX_BLOCK;
            for (int g = g0; g < g1; g++) {
                const int rows = g == x->groups - 1 ? last : GROUP;
                if (rows != configured) configure(rows), configured = rows;
                group_columns(p, g, rows, j, nj, codes, scale, bias);
            }
        }
    }
    _tile_release();
}
#else
int runner_amx_products(int set) {
    (void)set;
    return 0;
}
int amx_takes(int m, int k, const struct step_weight *w, const void *limbs) {
    (void)m, (void)k, (void)w, (void)limbs;
    return 0;
}
const struct amx_rows *amx_rows_of(int m, int k, const float *a, int lda,
                                   const struct step_weight *w, const void *limbs,
                                   struct amx_rows *into) {
    (void)m, (void)k, (void)a, (void)lda, (void)w, (void)limbs, (void)into;
    return NULL;
}
void amx_columns(const struct product *p, int j0, int j1) { (void)p, (void)j0, (void)j1; }
#endif
