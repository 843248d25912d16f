/*
 * What exact integer activations would buy a decode step (bench/RESULTS.md, "Decode:
 * attention's split items, the greedy argmax on the host"): one row of float32 activations
 * against Q4_K-shaped weights (4-bit codes, a float scale and min per 32-weight sub-block),
 * two ways, one thread, rows of a Qwen3-0.6B head's size by default:
 *
 *   float: the runner's way: every weight's float32 value made in registers, one FMA each
 *          (here: convert the code, one FMA for s q + b, one FMA into the row's lanes);
 *   limbs: the activations split into L 8-bit limbs per 32-weight block (x ~ a (l0 + l1 / 128
 *          + l2 / 16384)), the codes multiplied with each limb by vpdpbusd (64 products an
 *          instruction), 16 rows of W interleaved in a register's lanes; each sub-block's
 *          integer sum converted once and scaled (the min's term from the block's exact sum of x).
 *
 * Prints each way's rate (G weights/s, best of 15) and its largest error against a float64
 * dot product of the same values, relative to the row's sum of |w x|. A prototype for the
 * measurement (x86-64 with AVX512-VNNI: Zen 4, Ice Lake and later), not the runner's kernel:
 *
 *   cc -O3 -march=native -o /tmp/int_limbs bench/int_limbs.c -lm
 *   /tmp/int_limbs [ROWS K]          # default 151936 1024 (Qwen3-0.6B's head)
 */
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { SUB = 32, GROUP_ROWS = 16 };

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* W: codes[n][k] (0..15), scale[n][k / SUB], bias[n][k / SUB]; w = scale q + bias. */
struct weights {
    int n, k;
    unsigned char *codes, *rows; /* rows: [n][k / 2], the float way's packing */
    float *scale, *bias;
    unsigned char *packed; /* [n / 16][k / 8][64]: a zmm of 16 rows x 4 k's codes, two k-groups a byte */
    float *scale_t, *bias_t; /* [n / 16][k / SUB][16] */
};

/* The float way: one row of A against rows [0, n) (codes two a byte, row by row: byte i of a
 * sub-block holds k = i low, i + 16 high): a sub-block's 16-value table (s q + b, one FMA:
 * the runner builds its tables with two roundings), vpermps, one FMA into the row's lanes. */
static void float_rows(const struct weights *w, const float *x, float *out) {
    const int k = w->k;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int r = 0; r < w->n; r++) {
        const unsigned char *c = w->rows + (size_t)r * (k / 2);
        __m512 acc = _mm512_setzero_ps();
        for (int t = 0; t < k; t += SUB) {
            const __m512 s = _mm512_set1_ps(w->scale[(size_t)r * (k / SUB) + t / SUB]);
            const __m512 b = _mm512_set1_ps(w->bias[(size_t)r * (k / SUB) + t / SUB]);
            const __m512 table = _mm512_fmadd_ps(s, iota, b);
            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + t / 2)));
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + t), _mm512_permutexvar_ps(q, table), acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + t + 16),
                                  _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table), acc);
        }
        out[r] = _mm512_reduce_add_ps(acc);
    }
}

/* x split into `limbs` signed 8-bit limbs per SUB block: limb 0 in [-127, 127] at step a,
 * the others in [-64, 64] at steps a / 128, a / 16384. */
struct limbs {
    int count;
    signed char *l[3]; /* [k] each */
    float *a, *sum;    /* [k / SUB]: the block's step, its exact (float64-rounded) sum of x */
};

static void split(const float *x, int k, int count, struct limbs *out) {
    out->count = count;
    for (int i = 0; i < 3; i++) out->l[i] = calloc(k, 1);
    out->a = malloc(sizeof(float) * (k / SUB));
    out->sum = malloc(sizeof(float) * (k / SUB));
    for (int b = 0; b < k / SUB; b++) {
        double top = 0, sum = 0;
        for (int i = 0; i < SUB; i++) {
            top = fmax(top, fabs(x[b * SUB + i]));
            sum += x[b * SUB + i];
        }
        const double a = top > 0 ? top / 127 : 1;
        out->a[b] = (float)a;
        out->sum[b] = (float)sum;
        for (int i = 0; i < SUB; i++) {
            double rest = x[b * SUB + i] / (double)out->a[b];
            for (int j = 0; j < count; j++) {
                const double step = j == 0 ? 1 : j == 1 ? 1.0 / 128 : 1.0 / 16384;
                long l = lround(rest / step);
                const long most = j == 0 ? 127 : 64;
                l = l > most ? most : l < -most ? -most : l;
                out->l[j][b * SUB + i] = (signed char)l;
                rest -= l * step;
            }
        }
    }
}

/* The limbs way over rows [0, n): 16 rows a register, 4 k's a lane. */
static void limb_rows(const struct weights *w, const struct limbs *x, float *out) {
    const int k = w->k, L = x->count;
    const __m512i low = _mm512_set1_epi8(15);
    for (int g = 0; g < w->n / GROUP_ROWS; g++) {
        __m512 acc = _mm512_setzero_ps();
        const unsigned char *p = w->packed + (size_t)g * (k / 8) * 64;
        for (int b = 0; b < k / SUB; b++) {
            /* the sub-block's 8 k-groups of codes: 4 registers, two groups each */
            __m512i c[8];
            for (int h = 0; h < 4; h++) {
                const __m512i v = _mm512_loadu_si512((const void *)(p + ((size_t)b * 4 + h) * 64));
                c[2 * h] = _mm512_and_si512(v, low);
                c[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            __m512i sum = _mm512_setzero_si512();
            for (int j = 0; j < L; j++) {
                if (j) sum = _mm512_slli_epi32(sum, 7);
                int l[8];
                memcpy(l, x->l[j] + b * SUB, sizeof l);
                for (int q = 0; q < 8; q++) sum = _mm512_dpbusd_epi32(sum, c[q], _mm512_set1_epi32(l[q]));
            }
            const float unit = x->a[b] / (L == 1 ? 1.0f : L == 2 ? 128.0f : 16384.0f);
            const __m512 s = _mm512_loadu_ps(w->scale_t + ((size_t)g * (k / SUB) + b) * 16);
            const __m512 bias = _mm512_loadu_ps(w->bias_t + ((size_t)g * (k / SUB) + b) * 16);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(s, _mm512_set1_ps(unit)), acc);
            acc = _mm512_fmadd_ps(bias, _mm512_set1_ps(x->sum[b]), acc);
        }
        _mm512_storeu_ps(out + (size_t)g * GROUP_ROWS, acc);
    }
}

static double worst(const struct weights *w, const float *x, const float *got) {
    double err = 0;
    for (int r = 0; r < w->n; r++) {
        double dot = 0, mag = 0;
        for (int t = 0; t < w->k; t++) {
            const float v = w->scale[(size_t)r * (w->k / SUB) + t / SUB] * w->codes[(size_t)r * w->k + t] +
                            w->bias[(size_t)r * (w->k / SUB) + t / SUB];
            dot += (double)v * x[t];
            mag += fabs((double)v * x[t]);
        }
        err = fmax(err, fabs(got[r] - dot) / mag);
    }
    return err;
}

int main(int argc, char **argv) {
    struct weights w;
    w.n = argc > 2 ? atoi(argv[1]) : 151936;
    w.k = argc > 2 ? atoi(argv[2]) : 1024;
    w.n -= w.n % GROUP_ROWS;
    const int n = w.n, k = w.k, subs = k / SUB;
    w.codes = malloc((size_t)n * k);
    w.scale = malloc(sizeof(float) * n * subs);
    w.bias = malloc(sizeof(float) * n * subs);
    unsigned s = 7;
    for (size_t i = 0; i < (size_t)n * k; i++) w.codes[i] = (s = s * 1103515245u + 12345u) >> 28;
    for (size_t i = 0; i < (size_t)n * subs; i++) {
        w.scale[i] = 0.01f + (float)((s = s * 1103515245u + 12345u) >> 20) / 4096.0f * 0.01f;
        w.bias[i] = -8 * w.scale[i];
    }
    w.rows = malloc((size_t)n * k / 2);
    for (size_t r = 0; r < (size_t)n; r++)
        for (int t = 0; t < k; t += SUB)
            for (int i = 0; i < 16; i++)
                w.rows[r * (k / 2) + t / 2 + i] =
                    (unsigned char)(w.codes[r * k + t + i] | w.codes[r * k + t + i + 16] << 4);
    /* the interleaved copy: byte (row, 4 k's) of k-group 2h in the low nibble, 2h + 1 high */
    w.packed = aligned_alloc(64, (size_t)n / GROUP_ROWS * (k / 8) * 64);
    w.scale_t = malloc(sizeof(float) * n * subs);
    w.bias_t = malloc(sizeof(float) * n * subs);
    for (int g = 0; g < n / GROUP_ROWS; g++) {
        for (int h = 0; h < k / 8; h++)
            for (int r = 0; r < GROUP_ROWS; r++)
                for (int e = 0; e < 4; e++) {
                    const size_t row = (size_t)(g * GROUP_ROWS + r) * k;
                    const int t = (h / 4) * SUB + (h % 4) * 8 + e; /* k-group 2 (h % 4) and the next */
                    w.packed[((size_t)g * (k / 8) + h) * 64 + r * 4 + e] =
                        (unsigned char)(w.codes[row + t] | w.codes[row + t + 4] << 4);
                }
        for (int b = 0; b < subs; b++)
            for (int r = 0; r < GROUP_ROWS; r++) {
                w.scale_t[((size_t)g * subs + b) * 16 + r] = w.scale[(size_t)(g * GROUP_ROWS + r) * subs + b];
                w.bias_t[((size_t)g * subs + b) * 16 + r] = w.bias[(size_t)(g * GROUP_ROWS + r) * subs + b];
            }
    }
    /* activations with an outlier channel, as real ones have */
    float *x = malloc(sizeof(float) * k), *out = malloc(sizeof(float) * n);
    for (int t = 0; t < k; t++) x[t] = (float)((s = s * 1103515245u + 12345u) >> 16) / 65536.0f - 0.5f;
    x[k / 3] = 40.0f;
    double best = 1e9;
    for (int i = 0; i < 15; i++) {
        const double t0 = now();
        float_rows(&w, x, out);
        best = fmin(best, now() - t0);
    }
    printf("float    : %6.2f G weights/s, worst error %.2e of sum |w x|\n", (double)n * k / best * 1e-9,
           worst(&w, x, out));
    for (int L = 1; L <= 3; L++) {
        struct limbs l;
        split(x, k, L, &l);
        best = 1e9;
        for (int i = 0; i < 15; i++) {
            const double t0 = now();
            limb_rows(&w, &l, out);
            best = fmin(best, now() - t0);
        }
        printf("%d limb%s : %6.2f G weights/s, worst error %.2e of sum |w x|\n", L, L > 1 ? "s" : " ",
               (double)n * k / best * 1e-9, worst(&w, x, out));
    }
    return 0;
}
