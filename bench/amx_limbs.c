/*
 * What Intel's AMX int8 tiles would buy the products of many rows (prefill, decisions,
 * requests: bench/RESULTS.md, "AMX tiles for many rows"): M rows of float32 activations
 * against Q4_K-shaped weights (4-bit codes, a float scale and min per 32-weight sub-block:
 * w = s q + b), one thread, exact to float32's grade the way the decode steps' limbs are:
 *
 *   each 32-run of a row's x split into three signed 8-bit limbs, x ~ a (l0 + l1 / 128 +
 *   l2 / 16384) (runner/native/quantized.c's limb_split; bench/int_limbs.c measured them for
 *   one row with vpdpbusd); a 16-row x 32-k tile of each limb times a 32-k x 16-column tile of
 *   the codes (pre-packed in the tiles' 4-k groups) by `tdpbsud` (signed x unsigned 8-bit,
 *   int32 sums), three tiles a sub-block; their sums combined in AVX-512 registers as
 *   s a (S0 + S1 / 128 + S2 / 16384) + b sum(x), 16 rows x 16 columns of float32
 *   accumulators kept in registers over k.
 *
 * Prints whether the kernel grants the tiles (arch_prctl XTILEDATA), the rate (G weight-row
 * products a second, best of 7) and the largest error against a float64 product of the same
 * values relative to its row's sum of |w x|. A prototype for the measurement, not the
 * runner's kernel; x86-64 with AMX-INT8 and AVX-512 (Sapphire Rapids and later), Linux:
 *
 *   cc -O3 -march=native -mamx-tile -mamx-int8 -o /tmp/amx_limbs bench/amx_limbs.c -lm
 *   /tmp/amx_limbs [M N K]          # default 64 3072 1024 (Qwen3-0.6B's gate, 64 rows)
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum { SUB = 32, TILE = 16, LIMBS = 3 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-2: C (16 x 16 int32) a limb; 3-5: A (16 rows x 32 limbs); 6: B (8 rows of 4 k's
 * x 16 columns of codes). */
static void configure(void) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 3; t++) c.rows[t] = TILE, c.colsb[t] = TILE * 4;
    for (int t = 3; t < 6; t++) c.rows[t] = TILE, c.colsb[t] = SUB;
    c.rows[6] = SUB / 4, c.colsb[6] = TILE * 4;
    _tile_loadconfig(&c);
}

int main(int argc, char **argv) {
    const int M = argc > 3 ? atoi(argv[1]) : 64, N = argc > 3 ? atoi(argv[2]) : 3072;
    const int K = argc > 3 ? atoi(argv[3]) : 1024, S = K / SUB;
    if (M % TILE || N % TILE || K % SUB) return fprintf(stderr, "M, N multiples of 16; K of 32\n"), 2;
    const long granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */);
    printf("arch_prctl XTILEDATA: %s\n", granted == 0 ? "granted" : "refused");
    if (granted != 0) return 1;
    srand(1);
    /* W: codes [N][K], scale and bias [N][S]; x: [M][K], one outlier a row */
    unsigned char *codes = malloc((size_t)N * K);
    float *scale = malloc(sizeof(float) * N * S), *bias = malloc(sizeof(float) * N * S);
    float *x = malloc(sizeof(float) * M * K);
    for (size_t i = 0; i < (size_t)N * K; i++) codes[i] = rand() % 16;
    for (int i = 0; i < N * S; i++) scale[i] = 0.01f + rand() / (float)RAND_MAX * 0.02f;
    for (int i = 0; i < N * S; i++) bias[i] = -8 * scale[i];
    for (int i = 0; i < M * K; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * 2;
    for (int i = 0; i < M; i++) x[(size_t)i * K + (i * 37) % K] = 40;
    /* B packed: [N / 16][S][8 rows][16 columns x 4 k's] */
    unsigned char *packed = malloc((size_t)N * K);
    for (int cb = 0; cb < N / TILE; cb++)
        for (int s = 0; s < S; s++)
            for (int r = 0; r < SUB / 4; r++)
                for (int c = 0; c < TILE; c++)
                    for (int t = 0; t < 4; t++)
                        packed[(((size_t)cb * S + s) * (SUB / 4) + r) * 64 + c * 4 + t] =
                            codes[(size_t)(cb * TILE + c) * K + s * SUB + r * 4 + t];
    /* scale and bias by column block: [N / 16][S][16] */
    float *scale_t = malloc(sizeof(float) * N * S), *bias_t = malloc(sizeof(float) * N * S);
    for (int cb = 0; cb < N / TILE; cb++)
        for (int s = 0; s < S; s++)
            for (int c = 0; c < TILE; c++) {
                scale_t[((size_t)cb * S + s) * TILE + c] = scale[(size_t)(cb * TILE + c) * S + s];
                bias_t[((size_t)cb * S + s) * TILE + c] = bias[(size_t)(cb * TILE + c) * S + s];
            }
    /* x's limbs [LIMBS][M][K], each run's step a / 16384 and exact sum [M][S] */
    signed char *limb = malloc((size_t)LIMBS * M * K);
    float *unit = malloc(sizeof(float) * M * S), *sum = malloc(sizeof(float) * M * S);
    for (int i = 0; i < M; i++)
        for (int s = 0; s < S; s++) {
            const float *run = x + (size_t)i * K + s * SUB;
            double top = 0, total = 0;
            for (int j = 0; j < SUB; j++) top = fmax(top, fabs(run[j])), total += run[j];
            const float a = top > 0 ? (float)(top / 127) : 1;
            unit[i * S + s] = a / 16384, sum[i * S + s] = (float)total;
            for (int j = 0; j < SUB; j++) {
                double rest = run[j] / (double)a;
                for (int l = 0; l < LIMBS; l++) {
                    const double step = l == 0 ? 1 : l == 1 ? 1.0 / 128 : 1.0 / 16384;
                    long v = lround(rest / step);
                    const long most = l == 0 ? 127 : 64;
                    v = v > most ? most : v < -most ? -most : v;
                    limb[((size_t)l * M + i) * K + s * SUB + j] = (signed char)v;
                    rest -= v * step;
                }
            }
        }
    float *out = malloc(sizeof(float) * M * N);
    configure();
    int32_t c[LIMBS][TILE][TILE];
    double best = 1e30;
    for (int round = 0; round < 7; round++) {
        const double t0 = now();
        for (int rb = 0; rb < M / TILE; rb++)
            for (int cb = 0; cb < N / TILE; cb++) {
                __m512 acc[TILE];
                for (int i = 0; i < TILE; i++) acc[i] = _mm512_setzero_ps();
                for (int s = 0; s < S; s++) {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_loadd(6, packed + ((size_t)cb * S + s) * SUB / 4 * 64, 64);
                    _tile_loadd(3, limb + ((size_t)0 * M + rb * TILE) * K + s * SUB, K);
                    _tile_loadd(4, limb + ((size_t)1 * M + rb * TILE) * K + s * SUB, K);
                    _tile_loadd(5, limb + ((size_t)2 * M + rb * TILE) * K + s * SUB, K);
                    _tile_dpbsud(0, 3, 6);
                    _tile_dpbsud(1, 4, 6);
                    _tile_dpbsud(2, 5, 6);
                    _tile_stored(0, c[0], 64);
                    _tile_stored(1, c[1], 64);
                    _tile_stored(2, c[2], 64);
                    const __m512 sc = _mm512_loadu_ps(scale_t + ((size_t)cb * S + s) * TILE);
                    const __m512 bi = _mm512_loadu_ps(bias_t + ((size_t)cb * S + s) * TILE);
                    for (int i = 0; i < TILE; i++) {
                        const int row = rb * TILE + i;
                        __m512i v = _mm512_loadu_si512(c[0][i]);
                        v = _mm512_add_epi32(_mm512_slli_epi32(v, 7), _mm512_loadu_si512(c[1][i]));
                        v = _mm512_add_epi32(_mm512_slli_epi32(v, 7), _mm512_loadu_si512(c[2][i]));
                        const __m512 su = _mm512_mul_ps(sc, _mm512_set1_ps(unit[row * S + s]));
                        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), su, acc[i]);
                        acc[i] = _mm512_fmadd_ps(bi, _mm512_set1_ps(sum[row * S + s]), acc[i]);
                    }
                }
                for (int i = 0; i < TILE; i++)
                    _mm512_storeu_ps(out + (size_t)(rb * TILE + i) * N + cb * TILE, acc[i]);
            }
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    _tile_release();
    double err = 0;
    for (int i = 0; i < M; i += 7)
        for (int r = 0; r < N; r += 5) {
            double dot = 0, mag = 0;
            for (int k = 0; k < K; k++) {
                const double w = (double)scale[(size_t)r * S + k / SUB] * codes[(size_t)r * K + k] +
                                 bias[(size_t)r * S + k / SUB];
                dot += w * x[(size_t)i * K + k], mag += fabs(w * x[(size_t)i * K + k]);
            }
            err = fmax(err, fabs(out[(size_t)i * N + r] - dot) / mag);
        }
    printf("%d x %d x %d: %.1f G weight-row products/s (%.3f ms), worst error %.1e of sum |w x|\n",
           M, N, K, (double)M * N * K / best / 1e9, best * 1e3, err);
    return 0;
}
