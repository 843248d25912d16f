/*
 * Attention alone for a decode step: one query row of every head against `cached` positions,
 * through the native library's attention() (runner/native/attention.c), every layer's keys and
 * values in buffers of their own (cold, as a decode step finds them), best of 30 passes over
 * the layers; the KV bytes read and their rate. What the decode attention's changes were
 * measured with (bench/RESULTS.md, "Quantized decode against llama.cpp"). Built against the
 * library's sources, as the runner builds them (bench/README.md):
 *
 *   cc -O3 -march=native -ffp-contract=fast -pthread -Irunner/native -o /tmp/attention_decode \
 *      bench/attention_decode.c $(ls runner/native/[a-z]*.c | grep -v abi.c) -ldl -lm
 *   /tmp/attention_decode HEADS KV_HEADS HEAD_DIM CACHED LAYERS [TOKENS]
 *   /tmp/attention_decode 16 8 128 640 28     # Qwen3-0.6B's shapes
 *   /tmp/attention_decode 9 3 64 640 30       # SmolLM2-135M's
 *   /tmp/attention_decode 16 8 128 968 28 13  # a scoring suffix of 13 tokens over 968 cached
 *
 * RUNNER_BLAS_THREADS=1 runs it on one thread (the library's pool).
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "internal.h"

void attention(const struct step_args *a, const struct step_cache *cache, const float *q,
               const float *nk, const float *nv, float *out, float *scratch);
long attention_scratch_floats(const struct step_args *a);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 6 && argc != 7) {
        fprintf(stderr, "usage: %s HEADS KV_HEADS HEAD_DIM CACHED LAYERS [TOKENS]\n", argv[0]);
        return 2;
    }
    const int heads = atoi(argv[1]), kv_heads = atoi(argv[2]), d = atoi(argv[3]);
    const int cached = atoi(argv[4]), layers = atoi(argv[5]), capacity = cached + 64;
    const int tokens = argc == 7 ? atoi(argv[6]) : 1;
    struct step_args a = {0};
    a.batch = 1, a.tokens = tokens, a.heads = heads, a.kv_heads = kv_heads, a.head_dim = d;
    a.offset = cached, a.scale = 0.1f;
    struct step_cache *caches = calloc(layers, sizeof *caches);
    const long per_layer = (long)kv_heads * capacity * d;
    for (int l = 0; l < layers; l++) {
        float *k = malloc(sizeof(float) * per_layer), *v = malloc(sizeof(float) * per_layer);
        for (long i = 0; i < per_layer; i++) {
            k[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;
            v[i] = (float)((i * 31) % 1000) / 1000.0f;
        }
        caches[l] = (struct step_cache){.keys = k, .values = v, .head_stride = (long)capacity * d};
    }
    const long rows = (long)tokens * heads * d, own = (long)tokens * kv_heads * d;
    float *q = malloc(sizeof(float) * rows), *out = malloc(sizeof(float) * rows);
    float *nk = malloc(sizeof(float) * own), *nv = malloc(sizeof(float) * own);
    for (long i = 0; i < rows; i++) q[i] = (float)(i % 13) / 13.0f;
    for (long i = 0; i < own; i++) nk[i] = 0.1f, nv[i] = 0.2f;
    float *scratch = aligned_alloc(64, sizeof(float) * ((attention_scratch_floats(&a) + 15) / 16 * 16));
    double best = 1e9;
    for (int pass = 0; pass < 30; pass++) {
        const double t = now();
        for (int l = 0; l < layers; l++) attention(&a, &caches[l], q, nk, nv, out, scratch);
        const double took = now() - t;
        best = took < best ? took : best;
    }
    const double bytes = 2.0 * layers * kv_heads * (double)cached * d * sizeof(float);
    const double flops = 4.0 * layers * heads * tokens * (cached + (tokens + 1) / 2.0) * d;
    printf("heads %d over %d, head %d, %d cached, %d tokens, %d layers: %.3f ms, %.1f GB/s, "
           "%.1f GFLOP/s (out[0] %g)\n", heads, kv_heads, d, cached, tokens, layers, best * 1e3,
           bytes / best / 1e9, flops / best / 1e9, out[0]);
    return 0;
}
