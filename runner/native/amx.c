/*
 * Products of a forward's rows from GGML Q4_K and Q5_K blocks by Intel's AMX tiles (AMX-INT8: Sapphire
 * Rapids and later Xeons), where the build has them (internal.h: AMX_PRODUCTS) and the machine
 * runs them: a probe in a child process (a VM may list AMX and fault on its tile loads, as the
 * one of 2026-12-03 did), and OLLAMA_MLX_RUNNER_AMX=0 turns them off. A decode step's rows keep
 * the VNNI limbs (quantized.c), which stream W at memory's rate where the tiles, at one or two
 * rows, do not (bench/RESULTS.md, "AMX tiles in the library").
 *
 * Numbers. A's rows are split as a decode step's are (limb_split): each run of 32 values, with
 * a = max |x| / 127 over the run, as three signed 8-bit limbs, x ~ a (l0 + l1 / 128 +
 * l2 / 16384). A tile product `tdpbsud` multiplies a limb of up to 16 rows of A by 16 rows of
 * W's codes (unsigned bytes, a run of 32 a row) and sums each run's 32 products exactly in
 * int32; the three limbs' sums combine exactly as S = (S0 128 + S1) 128 + S2 (< 2^31 for codes
 * below 32). Then for each row of A and each row of W, in order of the runs:
 * acc = fma(S, scale * (a / 16384), acc), acc = fma(bias, the run's float32 sum of x, acc),
 * W's value being scale * code + bias (Q4_K's and Q5_K's d * sc and -(dmin * m)). So a value is the
 * dequantized weights' product within the limbs' bound (~1e-6 of sum |w x|, as a decode
 * step's), its bits those of its own row of A and its own row of W alone: the same for any
 * number of rows, whichever group of A's rows it falls in, and any share of the columns. They
 * are not the float tiles' bits, nor a decode step's (whose lanes sum four products at a time):
 * on an AMX machine a forward's Q4_K products differ from another CPU's in their last bits, as
 * the builds of other vector widths do. A row with an infinite or NaN value has no limbs: the
 * whole product then takes the float tiles (amx_split declines).
 *
 * Layout. A column block of 16 rows of W is unpacked once (ggml_tile_codes: each run's codes in
 * the layout `tdpbsud` reads its second operand in, 8 rows of 4 codes x 16 rows of W; 16 KB
 * for k = 1024) and multiplied by every group of 16 rows of A (amx_split made their limbs once a
 * product, a run's limb l of row i at row l rows + i of the group's). A group of 16 takes three
 * tile products a run (tiles 0-2: C a limb; 3-5: A's limbs; 6: W's codes); a group of 5 rows or
 * fewer (the last of a product, or all of a short one) takes one, its three limbs stacked in
 * one tile of A, alternating between two sets of tiles run by run (0, 3, 6 and 1, 4, 7): tiles
 * have no renaming, so a run's tile products would otherwise wait for the run before's. The
 * int32 sums go to memory (`tilestored`) and are combined a run later, while the next run's
 * tile products go on.
 */
#include "internal.h"

#if AMX_PRODUCTS
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

enum { RUN = 32, LIMBS = 3 };
#ifndef LAG
#define LAG 2
#endif
enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-2: C (`rows` rows of A x 16 rows of W, int32), one a limb; 3-5: A's limbs (`rows`
 * x 32 bytes); 6: W's codes (8 rows of 4 codes x 16 rows of W). `stacked` (3 rows at most
 * 16): a run's three limbs of each row in one tile of A, 3 `rows` rows (limb l of row i at
 * row l rows + i) and so one C; two such sets, runs alternating between them (tiles 0, 3, 6
 * and 1, 4, 7), so that a run's tile products need not wait for the run before's. */
static void configure(int rows, int stacked) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int a = stacked ? LIMBS * rows : rows;
    for (int t = 0; t < 3; t++) c.rows[t] = (uint8_t)a, c.colsb[t] = AMX_BLOCK * 4;
    for (int t = 3; t < 6; t++) c.rows[t] = (uint8_t)a, c.colsb[t] = RUN;
    c.rows[6] = c.rows[7] = RUN / 4, c.colsb[6] = c.colsb[7] = AMX_BLOCK * 4;
    _tile_loadconfig(&c);
}

/* In the probe's child: 0 when a tile product equals its integer reference. */
static int tiles_compute(void) {
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 2;
    signed char a[AMX_BLOCK][RUN] __attribute__((aligned(64)));
    unsigned char b[RUN / 4][AMX_BLOCK * 4] __attribute__((aligned(64)));
    int32_t c[AMX_BLOCK][AMX_BLOCK] __attribute__((aligned(64)));
    for (int i = 0; i < AMX_BLOCK; i++)
        for (int t = 0; t < RUN; t++) a[i][t] = (signed char)((i * 7 + t * 13) % 255 - 127);
    for (int r = 0; r < RUN / 4; r++)
        for (int t = 0; t < AMX_BLOCK * 4; t++) b[r][t] = (unsigned char)((r * 29 + t * 11) % 32);
    configure(AMX_BLOCK, 0);
    _tile_zero(0);
    _tile_loadd(3, a, RUN);
    _tile_loadd(6, b, AMX_BLOCK * 4);
    _tile_dpbsud(0, 3, 6);
    _tile_stored(0, c, AMX_BLOCK * 4);
    _tile_release();
    for (int i = 0; i < AMX_BLOCK; i++)
        for (int j = 0; j < AMX_BLOCK; j++) {
            int32_t want = 0;
            for (int t = 0; t < RUN; t++) want += a[i][t] * b[t / 4][j * 4 + t % 4];
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
static int runs_tiles;          /* the probe's answer */
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

int amx_takes(int m, int k, const struct step_weight *w) {
    return m > 0 && (w->format == W_Q4K || w->format == W_Q5K) && k % 256 == 0 && amx_on();
}

int amx_split(int m, int k, const float *a, int lda, struct amx_rows *out) {
    const int runs = k / RUN, groups = (m + AMX_BLOCK - 1) / AMX_BLOCK;
    const size_t limb_bytes = (size_t)groups * runs * LIMBS * AMX_BLOCK * RUN;
    const size_t floats = limb_bytes / 4 + (size_t)2 * groups * runs * AMX_BLOCK;
    float *buffer = thread_buffer(3, floats);
    struct limb_block *row = (struct limb_block *)thread_buffer(4, (size_t)limb_floats(1, k));
    signed char *limbs = (signed char *)buffer;
    float *unit = buffer + limb_bytes / 4, *sum = unit + (size_t)groups * runs * AMX_BLOCK;
    for (int i = 0; i < m; i++) {
        if (!limb_split(1, k, a + (size_t)i * lda, lda, row)) return 0;
        const int g = i / AMX_BLOCK, c = i % AMX_BLOCK;
        const int rows = g == groups - 1 ? m - g * AMX_BLOCK : AMX_BLOCK;
        for (int s = 0; s < runs; s++) {
            const struct limb_block *L = row + s / 8;
            const size_t at = (size_t)g * runs + s;
            for (int l = 0; l < LIMBS; l++)
                memcpy(limbs + (at * LIMBS * AMX_BLOCK + (size_t)l * rows + c) * RUN, L->l[l] + RUN * (s % 8), RUN);
            unit[at * AMX_BLOCK + c] = L->q4k[s % 8];
            sum[at * AMX_BLOCK + c] = L->q4k[8 + s % 8];
        }
    }
    *out = (struct amx_rows){m, groups, runs, limbs, unit, sum};
    return 1;
}

/* Rows i0 .. i0 + rows - 1 of C's columns j .. j + nj - 1 (a group of A's rows against a
 * column block of W whose codes, scales and biases ggml_tile_codes made): each run's tile
 * products while the run before's sums are combined (the tiles' stores reach memory before
 * the vector loads that read them). The tiles are configured for `rows`. */
static void group_columns(const struct product *p, int g, int rows, int stacked, int j, int nj,
                          const unsigned char *codes, const float *scale, const float *bias) {
    const struct amx_rows *x = p->amx;
    const int runs = x->runs;
    int32_t c[2][LIMBS][AMX_BLOCK][AMX_BLOCK] __attribute__((aligned(64)));
    __m512 acc[AMX_BLOCK];
    for (int i = 0; i < AMX_BLOCK; i++) acc[i] = _mm512_setzero_ps();
    const signed char *limbs = x->limbs + (size_t)g * runs * LIMBS * AMX_BLOCK * RUN;
    const float *unit = x->unit + (size_t)g * runs * AMX_BLOCK;
    const float *sum = x->sum + (size_t)g * runs * AMX_BLOCK;
    for (int s = 0; s <= runs; s++) {
        if (s > 0) {
            const int t = s - 1;
            const __m512 sc = _mm512_loadu_ps(scale + (size_t)t * AMX_BLOCK);
            const __m512 bi = _mm512_loadu_ps(bias + (size_t)t * AMX_BLOCK);
            const float *u = unit + (size_t)t * AMX_BLOCK, *total = sum + (size_t)t * AMX_BLOCK;
            /* limb l of row i: row i of C l, or (stacked) row l rows + i of C 0 */
            const int32_t(*c0)[AMX_BLOCK] = c[t & 1][0];
            const int32_t(*c1)[AMX_BLOCK] = stacked ? c0 + rows : c[t & 1][1];
            const int32_t(*c2)[AMX_BLOCK] = stacked ? c0 + 2 * rows : c[t & 1][2];
            for (int i = 0; i < rows; i++) {
                __m512i v = _mm512_load_si512((const void *)c0[i]);
                v = _mm512_add_epi32(_mm512_slli_epi32(v, 7), _mm512_load_si512((const void *)c1[i]));
                v = _mm512_add_epi32(_mm512_slli_epi32(v, 7), _mm512_load_si512((const void *)c2[i]));
                const __m512 f = _mm512_mul_ps(sc, _mm512_set1_ps(u[i]));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), f, acc[i]);
                acc[i] = _mm512_fmadd_ps(bi, _mm512_set1_ps(total[i]), acc[i]);
            }
        }
        if (s < runs) {
            const signed char *l = limbs + (size_t)s * LIMBS * AMX_BLOCK * RUN;
            const unsigned char *w = codes + (size_t)s * 512;
            if (stacked && (s & 1)) {
                _tile_loadd(7, w, 64);
                _tile_loadd(4, l, RUN);
                _tile_zero(1);
                _tile_dpbsud(1, 4, 7);
                _tile_stored(1, c[s & 1][0], 64);
            } else if (stacked) {
                _tile_loadd(6, w, 64);
                _tile_loadd(3, l, RUN);
                _tile_zero(0);
                _tile_dpbsud(0, 3, 6);
                _tile_stored(0, c[s & 1][0], 64);
            } else {
                _tile_loadd(6, w, 64);
                _tile_loadd(3, l, RUN);
                _tile_loadd(4, l + (size_t)rows * RUN, RUN);
                _tile_loadd(5, l + (size_t)2 * rows * RUN, RUN);
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_dpbsud(0, 3, 6);
                _tile_dpbsud(1, 4, 6);
                _tile_dpbsud(2, 5, 6);
                _tile_stored(0, c[s & 1][0], 64);
                _tile_stored(1, c[s & 1][1], 64);
                _tile_stored(2, c[s & 1][2], 64);
            }
        }
    }
    const int i0 = g * AMX_BLOCK;
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
    const int runs = x->runs, last = x->m - (x->groups - 1) * AMX_BLOCK;
    unsigned char *codes = (unsigned char *)thread_buffer(2, (size_t)runs * (512 / 4 + 2 * AMX_BLOCK));
    float *scale = (float *)(codes + (size_t)runs * 512), *bias = scale + (size_t)runs * AMX_BLOCK;
    int configured = 0;
    for (int j = j0; j < j1; j += AMX_BLOCK) {
        ggml_tile_codes(p, j, codes, scale, bias);
        const int nj = j1 - j < AMX_BLOCK ? j1 - j : AMX_BLOCK;
        for (int g = 0; g < x->groups; g++) {
            const int rows = g == x->groups - 1 ? last : AMX_BLOCK;
            const int stacked = LIMBS * rows <= AMX_BLOCK, kind = stacked ? -rows : rows;
            if (kind != configured) configure(rows, stacked), configured = kind;
            group_columns(p, g, rows, stacked, j, nj, codes, scale, bias);
        }
    }
    _tile_release();
}
#else
int runner_amx_products(int set) {
    (void)set;
    return 0;
}
int amx_takes(int m, int k, const struct step_weight *w) {
    (void)m, (void)k, (void)w;
    return 0;
}
int amx_split(int m, int k, const float *a, int lda, struct amx_rows *out) {
    (void)m, (void)k, (void)a, (void)lda, (void)out;
    return 0;
}
void amx_columns(const struct product *p, int j0, int j1) { (void)p, (void)j0, (void)j1; }
#endif
