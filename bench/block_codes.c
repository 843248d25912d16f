/*
 * A GGML block format's one-row product, and its codes alone, with the row hot: how much of a
 * decode step's product is making a block's values (bench/RESULTS.md, "The grid i-quants in
 * their blocks"). One thread, `rows` rows of k = 1024 random blocks (their d made 0.0076),
 * best of 20 passes: ns a block of 256 weights for the stream tile of one row of A
 * (block_format's `one`: the codes, the values, the products) and for the 16-weight formats'
 * codes and scales alone (s16_codes). Built as one unit with the library's quantized.c (its
 * tiles are static), for a level as the runner builds it:
 *
 *   cc -O3 -march=native -ffp-contract=fast -pthread -Irunner/native -o /tmp/block_codes \
 *      bench/block_codes.c -ldl -lm
 *   /tmp/block_codes FORMAT [ROWS]   # FORMAT: runner_native.h's W_*, e.g. 15 (IQ3_S), 9 (IQ4_XS)
 */
#include "../runner/native/quantized.c"

#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The 16-weight tiles' type of a GGML format (-1: none, e.g. Q4_K's own tiles, IQ4_NL's). */
static int s16_type(int format) {
    switch (format) {
    case W_Q6K: return S16_Q6K;
    case W_Q3K: return S16_Q3K;
    case W_Q2K: return S16_Q2K;
    case W_IQ4XS: return S16_IQ4XS;
    case W_IQ2XXS: return S16_IQ2XXS;
    case W_IQ2XS: return S16_IQ2XS;
    case W_IQ2S: return S16_IQ2S;
    case W_IQ3XXS: return S16_IQ3XXS;
    case W_IQ3S: return S16_IQ3S;
    case W_IQ1S: return S16_IQ1S;
    case W_IQ1M: return S16_IQ1M;
    default: return -1;
    }
}

int main(int argc, char **argv) {
    const int format = argc > 1 ? atoi(argv[1]) : W_IQ3S;
    const int n = (argc > 2 ? atoi(argv[2]) : 256) / BLOCK_RW * BLOCK_RW;
    const int k = 1024;
    const struct block_format *f = block_format_of(format);
    if (!f || n < BLOCK_RW) {
        fprintf(stderr, "usage: %s FORMAT [ROWS]  (a GGML block format of runner_native.h, 4+ rows)\n", argv[0]);
        return 2;
    }
    const size_t row = (size_t)k / (size_t)f->weights * f->bytes, blocks = (size_t)n * (size_t)(k / f->weights);
    unsigned char *w = malloc((size_t)n * row);
    float *a = malloc((size_t)k * sizeof(float));
    if (!w || !a) return 1;
    srand(1);
    for (size_t i = 0; i < (size_t)n * row; i++) w[i] = (unsigned char)rand();
    if (format != W_IQ1M) /* every format's d but IQ1_M's (in its scales' nibbles) leads its block */
        for (size_t b = 0; b < blocks; b++) w[b * f->bytes] = 0x1f, w[b * f->bytes + 1] = 0x20;
    for (int t = 0; t < k; t++) a[t] = (float)rand() / (float)RAND_MAX - 0.5f;
    float dot[2 * BLOCK_RW];
    volatile float sink = 0;
    double tile = 1e9, codes = 1e9;
    for (int pass = 0; pass < 20; pass++) {
        double t = now();
        for (int j = 0; j < n; j += BLOCK_RW) {
            const unsigned char *rows[BLOCK_RW];
            for (int r = 0; r < BLOCK_RW; r++) rows[r] = w + (size_t)(j + r) * row; /* n whole BLOCK_RWs */
            const float *rows_a[2] = {a, a};
            f->one(k, rows, rows_a, dot, NULL, 0);
            sink += dot[0];
        }
        t = now() - t;
        tile = t < tile ? t : tile;
    }
    const int type = s16_type(format);
    if (type >= 0) {
        signed char out[256] __attribute__((aligned(64)));
        float scale[16], bias[16];
        for (int pass = 0; pass < 20; pass++) {
            double t = now();
            for (size_t b = 0; b < blocks; b++) {
                const unsigned char *x = w + b * f->bytes;
                switch (type) { /* each instance with its type a constant, as the tiles have it */
                case S16_Q6K: s16_codes(S16_Q6K, x, out, scale, bias); break;
                case S16_Q3K: s16_codes(S16_Q3K, x, out, scale, bias); break;
                case S16_Q2K: s16_codes(S16_Q2K, x, out, scale, bias); break;
                case S16_IQ4XS: s16_codes(S16_IQ4XS, x, out, scale, bias); break;
                case S16_IQ2XXS: s16_codes(S16_IQ2XXS, x, out, scale, bias); break;
                case S16_IQ2XS: s16_codes(S16_IQ2XS, x, out, scale, bias); break;
                case S16_IQ2S: s16_codes(S16_IQ2S, x, out, scale, bias); break;
                case S16_IQ3XXS: s16_codes(S16_IQ3XXS, x, out, scale, bias); break;
                case S16_IQ3S: s16_codes(S16_IQ3S, x, out, scale, bias); break;
                case S16_IQ1S: s16_codes(S16_IQ1S, x, out, scale, bias); break;
                default: s16_codes(S16_IQ1M, x, out, scale, bias); break;
                }
                sink += out[b & 255] + scale[b & 15];
            }
            t = now() - t;
            codes = t < codes ? t : codes;
        }
    }
    const double per = 256.0 / f->weights / (double)blocks * 1e9; /* ns a 256 weights */
    printf("format %d, %d rows of %d: one row's product %.1f ns a 256 weights (%.1f GFLOP/s)", format, n, k,
           tile * per, 2.0 * n * k / tile / 1e9);
    if (type >= 0) printf(", codes and scales alone %.1f ns", codes * per);
    printf("\n");
    free(w);
    free(a);
    return 0;
}
