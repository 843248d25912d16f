/*
 * One layer's attention for the decoder step (decoder_step.c): the step's query rows against
 * the cached keys and their own, causal, by KV head group; on a sliding-window layer
 * (step_cache.window) each row sees only the keys within its window.
 *
 * Windows: the query of token t (position offset + t) sees positions p with
 * offset + t - window < p <= offset + t. A row's lowest visible key is kept as `lo` in the
 * index space of the keys it reads (cached rows from position `start`, or its own new keys),
 * and masked keys weigh exactly 0, as MLX's masked softmax gives them. A row may see no key of
 * a whole chunk of the cache (the chunks start at the same keys for every row, so a row's sums
 * run in the same order whichever rows share its block), which the online softmax allows for
 * by starting its running max at -FLT_MAX rather than -inf.
 */
#include <float.h>
#include <limits.h>

#include "internal.h"

/* out[r][0, width) = (add ? out[r][0, width) : 0) + sum_i w[r][i ws] * v[i * ldv + (0, width)]
 * for rows r < RA, i < n; width a multiple of VL. RA rows at a time against 4 vectors of
 * each row of v (4 * RA accumulators; the 4 vectors loaded once for the RA rows, each w[r][i]
 * broadcast from memory). */
#define ROWS_TIMES(NAME, RA)                                                                 \
    static void NAME(const float *const *w, long ws, int n, const float *v, long ldv,       \
                     int width, float *const *out, int add) {                               \
        int t = 0;                                                                          \
        for (; t + 4 * VL <= width; t += 4 * VL) {                                          \
            vf acc[4 * RA], zero = {0};                                                     \
            PIN(zero);                                                                      \
            _Pragma("GCC unroll 16") for (int q = 0; q < 4 * RA; q++)                       \
                acc[q] = add ? load(out[q / 4] + t + q % 4 * VL) : zero;                    \
            for (int i = 0; i < n; i++) {                                                   \
                const float *vi = v + i * ldv + t;                                          \
                vf b[RA];                                                                   \
                _Pragma("GCC unroll 4") for (int r = 0; r < RA; r++) {                      \
                    b[r] = splat_at(w[r] + i * ws);                                         \
                    PIN(b[r]);                                                              \
                }                                                                           \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                       \
                    vf y = load(vi + c * VL);                                               \
                    PIN(y); /* loaded once for the RA rows, not folded into each FMA */     \
                    _Pragma("GCC unroll 4") for (int r = 0; r < RA; r++) acc[r * 4 + c] += b[r] * y; \
                }                                                                           \
            }                                                                               \
            _Pragma("GCC unroll 16") for (int q = 0; q < 4 * RA; q++)                       \
                store_vec(out[q / 4] + t + q % 4 * VL, acc[q]);                             \
        }                                                                                   \
        for (; t < width; t += VL) {                                                        \
            vf acc[RA];                                                                     \
            for (int r = 0; r < RA; r++) acc[r] = add ? load(out[r] + t) : splat(0.0f);    \
            for (int i = 0; i < n; i++) {                                                   \
                const vf y = load(v + i * ldv + t);                                         \
                for (int r = 0; r < RA; r++) acc[r] += splat_at(w[r] + i * ws) * y;         \
            }                                                                               \
            for (int r = 0; r < RA; r++) store_vec(out[r] + t, acc[r]);                     \
        }                                                                                   \
    }
ROWS_TIMES(rows_times_3, 3)
ROWS_TIMES(rows_times_2, 2)
ROWS_TIMES(rows_times_1, 1)

#if WIDE_PANELS
/* ROWS_TIMES with 512-bit vectors, for widths of whole 64-float columns (a head of 64: one
 * column): the same sums in the same order. */
#define WIDE_ROWS_TIMES(NAME, RA)                                                            \
    static void NAME(const float *const *w, long ws, int n, const float *v, long ldv,       \
                     int width, float *const *out, int add) {                               \
        for (int t = 0; t < width; t += 64) {                                               \
            vw acc[4 * RA], zero = {0};                                                     \
            __asm__("" : "+v"(zero));                                                       \
            _Pragma("GCC unroll 16") for (int q = 0; q < 4 * RA; q++)                       \
                acc[q] = add ? (vw)_mm512_loadu_ps(out[q / 4] + t + q % 4 * 16) : zero;     \
            for (int i = 0; i < n; i++) {                                                   \
                const float *vi = v + i * ldv + t;                                          \
                vw b[RA];                                                                   \
                _Pragma("GCC unroll 4") for (int r = 0; r < RA; r++) {                      \
                    b[r] = (vw)_mm512_set1_ps(w[r][i * ws]);                                \
                    __asm__("" : "+v"(b[r]));                                               \
                }                                                                           \
                _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                       \
                    vw y = (vw)_mm512_loadu_ps(vi + c * 16);                                \
                    __asm__("" : "+v"(y));                                                  \
                    _Pragma("GCC unroll 4") for (int r = 0; r < RA; r++) acc[r * 4 + c] += b[r] * y; \
                }                                                                           \
            }                                                                               \
            _Pragma("GCC unroll 16") for (int q = 0; q < 4 * RA; q++)                       \
                _mm512_storeu_ps(out[q / 4] + t + q % 4 * 16, (__m512)acc[q]);              \
        }                                                                                   \
    }
WIDE_ROWS_TIMES(wide_rows_times_3, 3)
WIDE_ROWS_TIMES(wide_rows_times_2, 2)
WIDE_ROWS_TIMES(wide_rows_times_1, 1)
#endif

/* rows_times for any number of rows: three at a time, then two or one (each row's sums in
 * the same order whichever: a decode step's two rows a group read the values once). Both of
 * attention's products are this: scores = q K^T (w: query rows, v: the keys transposed) and
 * out += p V (w: the rows' softmax weights, v: the values). */
static void rows_times(const float *const *w, long ws, int rows, int n, const float *v, long ldv,
                       int width, float *const *out, int add) {
    int r = 0;
#if WIDE_PANELS
    if (width % 64 == 0) {
        for (; r + 3 <= rows; r += 3) wide_rows_times_3(w + r, ws, n, v, ldv, width, out + r, add);
        if (rows - r == 2) wide_rows_times_2(w + r, ws, n, v, ldv, width, out + r, add);
        else if (rows - r == 1) wide_rows_times_1(w + r, ws, n, v, ldv, width, out + r, add);
        return;
    }
#endif
    for (; r + 3 <= rows; r += 3) rows_times_3(w + r, ws, n, v, ldv, width, out + r, add);
    if (rows - r == 2) rows_times_2(w + r, ws, n, v, ldv, width, out + r, add);
    else if (rows - r == 1) rows_times_1(w + r, ws, n, v, ldv, width, out + r, add);
}

/*
 * Attention of one layer. Two ways, the same softmax: with rows enough for the pool, row
 * items (below: a block of query rows against all its keys, online softmax); otherwise (a
 * decode step's few rows, a few tokens) split items, which split the cached keys into
 * ranges so that even one query row keeps every thread busy:
 *
 * Split items are work over (KV head group, block of query rows, range of keys). The query
 * heads that share a KV head are taken together, and a block's rows are multiplied with a
 * chunk of keys at once (the product tiles), so each key and value is read once per block
 * instead of once per query head and token. Items are:
 *   - prefix items: (group, one of `splits` ranges of the cached positions, a block of the
 *     group's rows over every batch row): no mask;
 *   - own items: (batch row, group, a block of that row's rows) against the row's own new
 *     keys, causal (token t sees new keys 0..t).
 * Each item leaves, per query row, a partial softmax (running max m, sum l, weighted values
 * o) in its slot: prefix range s in slot s, own keys in slot `splits`; the merge then
 * combines a row's slots (the split-softmax identity), so the cached keys can be split
 * across threads even for one query row (a decode step).
 *
 * Rows of a group are ordered (batch row b, token t, head in group j), so the rows of one
 * token are adjacent and, within a batch row, t grows with the row index.
 *
 * Blocks of 4 rows or more get their scores as rows times the chunk's keys transposed (no
 * horizontal sums); fewer (a decode step's 1-3 rows a group) take the dot-product tiles.
 * Measured with SmolLM2's shapes on the 2-core VM (attention alone, 30 layers): 64 rows of
 * 20 tokens over 480 cached 0.72 s against 1.0-1.1 s for one (row, head) at a time with
 * 8-key dot products; 15 tokens over 483 cached 11.5-11.8 against 12.5-13.5 ms.
 */
/* TARGET_ITEMS: split items a layer aims at. A constant, not the pool's size, so that the
 * numbers (the split-softmax merge's roundings) do not depend on the machine's cores. 8, not
 * 16: each split re-reads the group's query rows and adds a partial to merge; decode
 * attention alone (bench/attention_decode.c, 2 threads, 3 runs) Qwen3-0.6B's shapes at 640
 * cached 6.1-6.8 -> 5.6-5.8 ms, at 2000 19.9-20.4 -> 19.2-19.6, SmolLM2's 0.65-0.68 ->
 * 0.64-0.65, Gemma3-1B's 2.1-2.3 -> 2.0-2.1. */
enum { KEY_CHUNK = 128, ROW_BLOCK = 48, TRANSPOSED_ROWS = 4, MIN_SPLIT_KEYS = 32, TARGET_ITEMS = 8, MAX_SPLITS = 16 };
/* ROW_ITEMS_ENOUGH: row items a layer must make to take them rather than split items (two
 * for each of a 2-core machine's threads). A constant for the same reason as TARGET_ITEMS:
 * it was twice the pool's threads, so a prompt's attention took split items (the merge's
 * roundings) on a pool of 3 or more threads where 2 took row items, and the same prompt's
 * numbers differed with the machine's cores (tests/test_gguf_models.py, 1, 2 and 3 threads). */
enum { ROW_ITEMS_ENOUGH = 4 };

struct attention_job {
    const struct step_args *a;
    const struct step_cache *cache;
    const float *sinks;         /* NULL, or [heads]: the layer's sinks (step_layer) */
    const float *q;             /* [batch * tokens, heads, head_dim] */
    const float *nk, *nv;       /* this step's keys, values: [batch, kv_heads, tokens, head_dim] */
    float *out;                 /* [batch * tokens, heads, head_dim] */
    float *part;                /* [splits + 1][batch * tokens * heads] of (m, l, o[head_dim]) */
    float *scores;              /* per thread: ROW_BLOCK * KEY_CHUNK, then head_dim * KEY_CHUNK */
    int cached;                 /* cached keys read: positions [cache->start, a->offset) */
    int splits, prefix_blocks, own_blocks, items;
    atomic_int next;            /* the next item to take */
};

/* The lowest key a row of token t sees among `keys` read from position `first` of the
 * sequence (the cached keys: `start`; its own: offset), or INT_MIN for full attention. */
static int window_lo(const struct step_args *a, const struct step_cache *cache, int t,
                     int first) {
    if (!cache->window) return INT_MIN;
    return a->offset + t - cache->window + 1 - first;
}

/* Row i of a head's cached keys (or values) held in one run (`wrap` 0) or two (a ring that
 * has wrapped: rows [0, wrap) of `run`, then from row 0 of `run2`; struct step_cache). */
static inline const float *cached_row(const float *run, const float *run2, int wrap, int i,
                                      int D) {
    return wrap && i >= wrap ? run2 + (size_t)(i - wrap) * D : run + (size_t)i * D;
}

/* Where the run holding cached row i ends, within [0, end): a chunk of rows never crosses it. */
static inline int run_end(int wrap, int i, int end) {
    return wrap && i < wrap && wrap < end ? wrap : end;
}

/* How many ranges the `cached` keys are split into: enough items for the pool, each range at
 * least MIN_SPLIT_KEYS keys (more cached keys never make fewer). */
static int attention_splits(const struct step_args *a, int prefix_blocks, int cached) {
    if (cached <= 0) return 0;
    int s = ceil_div(TARGET_ITEMS, (long)a->kv_heads * prefix_blocks);
    const int most = cached / MIN_SPLIT_KEYS;
    if (s > most) s = most;
    if (s > MAX_SPLITS) s = MAX_SPLITS;
    return s < 1 ? 1 : s;
}

/* Where range s of `splits` of the cached positions [0, offset) starts: the even share
 * rounded down to a multiple of SPLIT_ALIGN keys (the last range ends at offset), so every
 * range but the last fills whole 4-vector columns of rows_times (a 16-key remainder takes
 * its one-vector loop, a third of the rate: 15 tokens over 483 cached, ranges of ~80 keys). */
enum { SPLIT_ALIGN = 4 * VL };
static int split_start(int offset, int s, int splits) {
    if (s >= splits) return offset;
    const int even = (int)((long)offset * s / splits);
    return even - even % SPLIT_ALIGN;
}

#if defined(__AVX__) && VBYTES == 32
/* dst[j * ld + i] = src[i * ls + j] for i, j < 8 (transpose8). */
static inline void transpose_8x8(const float *src, long ls, float *dst, long ld) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    transpose8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ld, r[i]);
}
#endif

/* kt[d * KEY_CHUNK + i] = keys[i * d_ + d] for keys i < n, zeros up to a multiple of VL. */
static void transpose_keys(const float *keys, int n, int d_, float *kt) {
    const int padded = (n + VL - 1) / VL * VL;
    int i0 = 0;
#if defined(__AVX__) && VBYTES == 32
    for (; i0 + 8 <= n; i0 += 8)
        for (int d0 = 0; d0 < d_; d0 += 8)
            transpose_8x8(keys + (size_t)i0 * d_ + d0, d_, kt + (size_t)d0 * KEY_CHUNK + i0, KEY_CHUNK);
#endif
    for (int d = 0; d < d_; d++)
        for (int i = i0; i < padded; i++)
            kt[(size_t)d * KEY_CHUNK + i] = i < n ? keys[(size_t)i * d_ + d] : 0.0f;
}

/* Gemma2's soft-cap, s = cap * tanh(s * scale / cap), on n scores in place; the softmax then
 * takes them with a scale of 1 (`score_scale`). */
static void softcapped(float *s, int n, float scale, float cap) {
    int i = 0;
    for (; i + VL <= n; i += VL) store_vec(s + i, vtanh(load(s + i) * (scale / cap)) * cap);
    if (i < n) {
        float t[VL] = {0};
        memcpy(t, s + i, sizeof(float) * (n - i));
        store_vec(t, vtanh(load(t) * (scale / cap)) * cap);
        memcpy(s + i, t, sizeof(float) * (n - i));
    }
}

/* What the softmax multiplies a layer's scores by: the attention's scale, or 1 for scores
 * already soft-capped (which took it). */
static float score_scale(const struct step_args *a) { return a->softcap > 0 ? 1.0f : a->scale; }

static float *partial(const struct attention_job *j, int slot, int row) {
    const struct step_args *a = j->a;
    const size_t rows = (size_t)a->batch * a->tokens * a->heads;
    return j->part + ((size_t)slot * rows + row) * (a->head_dim + 2);
}

/* srow[r][i] = q_r . key c0 + i, i < nc, for the 1-3 rows of a decode step's block, every key
 * read once for all of them (3 rows: 3x4 tiles, 2: 2x6, 1: 1x8; each dot product's sums in
 * the same order whichever tile). Meanwhile the keys two tiles on and these keys' values (p V
 * reads them next) are fetched: a layer's keys and values were last touched a forward ago,
 * and a decode step is bound by reading them (Qwen3-0.6B's shapes, 28 layers at 640 cached,
 * attention alone: 147 MB at 17 GB/s before). Keys past k1 are not fetched. Into L2, as the
 * weights' stream tiles fetch theirs (quantized.c, fetch_share): into L1 a whole Qwen3-0.6B
 * Q4_K_M decode token at ~1,400 cached took 1.05-1.09x as long (bench/RESULTS.md,
 * "Prefetching into L2"). */
static void few_rows_scores(const float *const *q, int n, const float *keys, const float *values,
                            int c0, int nc, int k1, int D, float *const *srow) {
    const int kb = n == 3 ? 4 : n == 2 ? 6 : 8;
    for (int i = 0; i < nc; i += kb) {
        for (int b = 0; b < kb; b++) {
            const int ahead = c0 + i + 2 * kb + b;
            for (int l = 0; l < D; l += 64 / (int)sizeof(float)) {
                if (ahead < k1) __builtin_prefetch(keys + (size_t)ahead * D + l, 0, 2);
                if (i + b < nc) __builtin_prefetch(values + (size_t)(c0 + i + b) * D + l, 0, 2);
            }
        }
        const float *w[8];
        for (int b = 0; b < kb; b++) w[b] = keys + (size_t)(c0 + (i + b < nc ? i + b : nc - 1)) * D;
        float dot[12];
        (n == 3 ? tile_3x4 : n == 2 ? tile_2x6 : tile_1x8)(q, w, D, dot, NULL, 0);
        for (int r = 0; r < n; r++)
            for (int b = 0; b < kb && i + b < nc; b++) srow[r][i + b] = dot[r * kb + b];
    }
}

/* The partial softmax of `n` query rows against keys [k0, k1) of `keys` / `values` (rows of
 * head_dim floats; a wrapped ring's in two runs, `keys2` / `values2` from row `wrap`:
 * cached_row), into slot `slot`. `causal`: row r sees key i only if i <= tpos[r], and
 * tpos grows with r. `lo`: NULL, or row r sees key i only if i >= lo[r]. */
static void attend(const struct attention_job *j, const float *const *qrow, const int *grow,
                   const int *tpos, const int *lo, int n, const float *keys,
                   const float *values, const float *keys2, const float *values2, int wrap,
                   int k0, int k1, int causal, int slot, float *scores, float *kt) {
    const int D = j->a->head_dim;
    const float scale = score_scale(j->a), cap = j->a->softcap;
    float *out[ROW_BLOCK];
    for (int r = 0; r < n; r++) {
        float *p = partial(j, slot, grow[r]);
        p[0] = -INFINITY;
        p[1] = 0.0f;
        memset(p + 2, 0, sizeof(float) * D);
        out[r] = p + 2;
    }
    for (int c0 = k0, nc; c0 < k1; c0 += nc) {
        const int end = run_end(wrap, c0, k1); /* the chunk's keys lie in one run */
        nc = end - c0 < KEY_CHUNK ? end - c0 : KEY_CHUNK;
        /* the chunk's run, and the chunk's first row in it */
        const int second = wrap && c0 >= wrap, row = second ? c0 - wrap : c0;
        const float *krun = second ? keys2 : keys, *vrun = second ? values2 : values;
        const float *kchunk = krun + (size_t)row * D, *vchunk = vrun + (size_t)row * D;
        int first = 0; /* the rows before it see no key of this chunk */
        if (causal)
            while (first < n && tpos[first] < c0) first++;
        float *srow[ROW_BLOCK];
        for (int r = first; r < n; r++) srow[r] = scores + (size_t)r * KEY_CHUNK;
        if (n - first >= TRANSPOSED_ROWS) { /* q K^T as rows times the keys transposed */
            transpose_keys(kchunk, nc, D, kt);
            rows_times(qrow + first, 1, n - first, D, kt, KEY_CHUNK, (nc + VL - 1) / VL * VL,
                       srow + first, 0);
        } else { /* a few rows (a decode step): dot products, no transposition */
            few_rows_scores(qrow + first, n - first, krun, vrun, row, nc, end - c0 + row, D,
                            srow + first);
        }
        if (cap > 0)
            for (int r = first; r < n; r++) softcapped(srow[r], nc, j->a->scale, cap);
        for (int r = first; r < n; r++) {
            float *s = scores + (size_t)r * KEY_CHUNK, *p = out[r] - 2;
            int seen = nc;
            if (causal && tpos[r] - c0 + 1 < nc) seen = tpos[r] - c0 + 1;
            /* keys [0, from) of the chunk are before the row's window */
            const int from = lo && lo[r] > c0 ? (lo[r] - c0 < nc ? lo[r] - c0 : nc) : 0;
            if (from >= seen) { /* none of the chunk: the row's state stays as it is */
                memset(s, 0, sizeof(float) * nc);
                continue;
            }
            for (int i = 0; i < from; i++) s[i] = -INFINITY;
            const int sv = seen - seen % VL;
            vf most = splat(-INFINITY);
            for (int i = 0; i < sv; i += VL) {
                const vf x = load(s + i);
                most = select_(x > most, x, most);
            }
            float top = -INFINITY;
            for (int i = 0; i < VL; i++) top = most[i] > top ? most[i] : top;
            for (int i = sv; i < seen; i++) top = s[i] > top ? s[i] : top;
            top = top * scale > p[0] ? top * scale : p[0]; /* scale > 0 */
            const float correction = expf(p[0] - top); /* 0 for the first keys (m = -inf) */
            if (correction != 1.0f) {
                p[1] *= correction;
                for (int t = 0; t < D; t++) out[r][t] *= correction;
            }
            vf acc = splat(0.0f);
            for (int i = 0; i < sv; i += VL) {
                const vf e = vexp(load(s + i) * scale - top);
                store_vec(s + i, e);
                acc += e;
            }
            float total = hsum(acc);
            for (int i = sv; i < seen; i++) {
                s[i] = expf(s[i] * scale - top);
                total += s[i];
            }
            for (int i = seen; i < nc; i++) s[i] = 0.0f;
            /* exactly 0 as MLX weighs them (vexp clamps -inf to e^-88: already below what
             * rounding keeps of `total`, which holds e^0 of the maximum) */
            for (int i = 0; i < from; i++) s[i] = 0.0f;
            p[0] = top;
            p[1] += total;
        }
        rows_times((const float *const *)srow + first, 1, n - first, nc, vchunk, D, D,
                   out + first, 1);
    }
}

/* Rows [r0, r1) of group g in its order (batch row, token, head in the group): their query
 * rows, their rows of the output and partials, and their tokens. */
static void group_rows(const struct attention_job *j, int g, int r0, int r1, const float **qrow,
                       int *grow, int *tpos) {
    const struct step_args *a = j->a;
    const int rep = a->heads / a->kv_heads, row_rows = a->tokens * rep;
    for (int r = r0; r < r1; r++) {
        const int b = r / row_rows, t = r % row_rows / rep, h = g * rep + r % rep;
        tpos[r - r0] = t;
        grow[r - r0] = (b * a->tokens + t) * a->heads + h;
        qrow[r - r0] = j->q + (size_t)grow[r - r0] * a->head_dim;
    }
}

/* Items taken in turn until none is left. */
static void attention_items(const void *arg, int index, int count) {
    (void)count;
    struct attention_job *j = (struct attention_job *)arg;
    const struct step_args *a = j->a;
    const int T = a->tokens, D = a->head_dim, G = a->kv_heads;
    const int own_rows = T * (a->heads / G), all_rows = a->batch * own_rows;
    const int prefix_items = G * j->splits * j->prefix_blocks;
    float *scores = j->scores + (size_t)index * (ROW_BLOCK + D) * KEY_CHUNK;
    float *kt = scores + (size_t)ROW_BLOCK * KEY_CHUNK;
    const float *qrow[ROW_BLOCK];
    int grow[ROW_BLOCK], tpos[ROW_BLOCK], lo[ROW_BLOCK];
    const int *window = j->cache->window ? lo : NULL;
    for (int item; (item = atomic_fetch_add(&j->next, 1)) < j->items;) {
        if (item < prefix_items) { /* every batch row's rows against a range of the cache */
            const int g = item / (j->splits * j->prefix_blocks);
            const int s = item / j->prefix_blocks % j->splits;
            const int r0 = item % j->prefix_blocks * ROW_BLOCK;
            const int r1 = r0 + ROW_BLOCK < all_rows ? r0 + ROW_BLOCK : all_rows;
            group_rows(j, g, r0, r1, qrow, grow, tpos);
            const struct step_cache *c = j->cache;
            const size_t head = (size_t)g * c->head_stride;
            const float *kc2 = c->wrap ? c->keys2 + head : NULL, *vc2 = c->wrap ? c->values2 + head : NULL;
            const int k0 = split_start(j->cached, s, j->splits);
            const int k1 = split_start(j->cached, s + 1, j->splits);
            for (int r = 0; r < r1 - r0; r++) lo[r] = window_lo(a, c, tpos[r], c->start);
            attend(j, qrow, grow, tpos, window, r1 - r0, c->keys + head, c->values + head, kc2, vc2,
                   c->wrap, k0, k1, 0, s, scores, kt);
        } else { /* one batch row's rows against its own new keys */
            const int rest = item - prefix_items, b = rest / j->own_blocks / G;
            const int g = rest / j->own_blocks % G, first = b * own_rows;
            const int r0 = first + rest % j->own_blocks * ROW_BLOCK;
            const int r1 = r0 + ROW_BLOCK < first + own_rows ? r0 + ROW_BLOCK : first + own_rows;
            group_rows(j, g, r0, r1, qrow, grow, tpos);
            const size_t at = ((size_t)b * G + g) * T * D;
            for (int r = 0; r < r1 - r0; r++) lo[r] = window_lo(a, j->cache, tpos[r], a->offset);
            attend(j, qrow, grow, tpos, window, r1 - r0, j->nk + at, j->nv + at, NULL, NULL, 0, 0,
                   tpos[r1 - r0 - 1] + 1, 1, j->splits, scores, kt);
        }
    }
}

/* Each query row's slots combined: out = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s. */
static void attention_merge(const void *arg, int index, int count) {
    const struct attention_job *j = arg;
    const struct step_args *a = j->a;
    const int D = a->head_dim, rows = a->batch * a->tokens * a->heads;
    for (int row = index; row < rows; row += count) {
        float top = -INFINITY;
        for (int s = 0; s <= j->splits; s++) {
            const float m = partial(j, s, row)[0];
            top = m > top ? m : top;
        }
        float *out = j->out + (size_t)row * D, total = 0.0f;
        memset(out, 0, sizeof(float) * D);
        for (int s = 0; s <= j->splits; s++) {
            const float *p = partial(j, s, row);
            if (p[0] == -INFINITY) continue;
            const float w = expf(p[0] - top);
            total += w * p[1];
            for (int t = 0; t < D; t++) out[t] += w * p[2 + t];
        }
        if (j->sinks) total += expf(j->sinks[row % a->heads] - top);
        const float inv = 1.0f / total;
        for (int t = 0; t < D; t++) out[t] *= inv;
    }
}

/*
 * Row items, for steps with rows enough to keep the pool busy (a scoring suffix of 15 tokens:
 * 45 rows a KV head): an item is (KV head group, batch row, block of up to ROW_ITEM_ROWS of
 * that row's rows) against all the keys it sees, cached then its own (causal), chunk by chunk
 * with the softmax kept online (running max and sum per row; the output rescaled when the max
 * grows), so its output is written once: no partials, no merge. Its scores are kept
 * transposed, S^T = K Q^T (a key's scores for the block's rows in up to 3 vectors), so the
 * keys are read as they lie (no transposition: the split items' transposes were 12% of their
 * time) and the softmax runs across rows in vectors (no horizontal max or sum). Each row's
 * result is the same for any batch (chunks start at the same keys, a row's sums run in the
 * same order whichever rows share its block).
 */
enum { ROW_ITEM_ROWS = 3 * VL, ROW_ITEM_KEYS = 64 };

/* st[i][0, NV VL) = sum_d keys[i][d] qt[d][0, NV VL) for keys i < n: KB keys at a time
 * (KB * NV accumulators; the NV vectors of qt loaded once for the KB keys). Meanwhile the
 * rows of `ahead` (the chunk's values, the next chunk's keys: 64 KB of Qwen3-0.6B's, twice
 * L1) are fetched into L2, as few_rows_scores fetches its own: into L1, 13 tokens over 968
 * cached of Qwen3-0.6B's shapes (bench/attention_decode.c, attention alone, 28 layers) took
 * 30.3-31.5 ms against 25.6-25.8 (bench/RESULTS.md, "Row items' and block tiles' prefetch
 * into L2"). */
#define KEYS_TIMES(NAME, NV, KB)                                                             \
    static void NAME(const float *keys, int n, int d_, const float *qt, float *st,          \
                     const float *const *ahead, const int *ahead_rows) {                    \
        int i = 0;                                                                          \
        for (; i + KB <= n; i += KB) {                                                      \
            for (int s = 0; s < 2; s++)                                                     \
                for (int k = i; k < i + KB && k < ahead_rows[s]; k++)                       \
                    for (int c = 0; c < d_; c += 64 / sizeof(float))                        \
                        __builtin_prefetch(ahead[s] + (size_t)k * d_ + c, 0, 2);            \
            vf acc[KB * NV], zero = {0};                                                    \
            PIN(zero);                                                                      \
            _Pragma("GCC unroll 16") for (int q = 0; q < KB * NV; q++) acc[q] = zero;       \
            for (int d = 0; d < d_; d++) {                                                  \
                vf y[NV];                                                                   \
                _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) {                      \
                    y[v] = load(qt + (size_t)d * NV * VL + v * VL);                         \
                    PIN(y[v]);                                                              \
                }                                                                           \
                _Pragma("GCC unroll 8") for (int k = 0; k < KB; k++) {                      \
                    const vf b = splat_at(keys + (size_t)(i + k) * d_ + d);                 \
                    _Pragma("GCC unroll 4") for (int v = 0; v < NV; v++) acc[k * NV + v] += b * y[v]; \
                }                                                                           \
            }                                                                               \
            _Pragma("GCC unroll 16") for (int q = 0; q < KB * NV; q++)                      \
                store_vec(st + (size_t)(i + q / NV) * NV * VL + q % NV * VL, acc[q]);       \
        }                                                                                   \
        for (; i < n; i++) {                                                                \
            vf acc[NV];                                                                     \
            for (int v = 0; v < NV; v++) acc[v] = splat(0.0f);                              \
            for (int d = 0; d < d_; d++) {                                                  \
                const vf b = splat_at(keys + (size_t)i * d_ + d);                           \
                for (int v = 0; v < NV; v++) acc[v] += b * load(qt + (size_t)d * NV * VL + v * VL); \
            }                                                                               \
            for (int v = 0; v < NV; v++) store_vec(st + (size_t)i * NV * VL + v * VL, acc[v]); \
        }                                                                                   \
    }
KEYS_TIMES(keys_times_3, 3, 4)
KEYS_TIMES(keys_times_2, 2, 6)
KEYS_TIMES(keys_times_1, 1, 8)

/* A row item's running state: per row (lanes of NV vectors) the max m of its scaled scores
 * so far and the sum l of their exponentials; its output rows hold the weighted values. */
struct online {
    int rows, nv, started;
    vf m[3], l[3];
    vi tpos[3]; /* each row's token (padding lanes: every key) */
    float *out[ROW_ITEM_ROWS];
};

/* The online softmax over keys [c0, c0 + nc) (their rows at `k` / `v`), `causal`: key i only
 * for rows whose token is >= i (the row's own keys); `windowed`: key i only for rows whose
 * token t has t + shift <= i (window_lo). The next chunk's `next` keys are at `next_keys`.
 * st, qt: scratch of the item. */
static void online_chunk(const struct attention_job *j, struct online *o, const float *k,
                         const float *v, int c0, int nc, const float *next_keys, int next,
                         int causal, int windowed, int shift, const float *qt, float *st) {
    const int D = j->a->head_dim, nv = o->nv, W = nv * VL;
    const float scale = score_scale(j->a);
    /* the chunk's values (read next) and the next chunk's keys fetched while its keys are
     * multiplied: a layer's keys and values were last touched a forward ago */
    const float *ahead[2] = {v, next_keys};
    const int ahead_rows[2] = {nc, next};
    if (nv == 3) keys_times_3(k, nc, D, qt, st, ahead, ahead_rows);
    else if (nv == 2) keys_times_2(k, nc, D, qt, st, ahead, ahead_rows);
    else keys_times_1(k, nc, D, qt, st, ahead, ahead_rows);
    if (j->a->softcap > 0) softcapped(st, nc * W, j->a->scale, j->a->softcap);
    const vf ninf = splat(-INFINITY);
    vf most[3] = {ninf, ninf, ninf}, total[3] = {0}, correction[3];
    const int masked = causal || windowed;
    /* per row: the keys it sees, as [low, high] of i */
    vi low[3], high[3];
    for (int v = 0; v < nv; v++) {
        low[v] = windowed ? o->tpos[v] + (shift - c0) : (vi){0} + INT_MIN / 2;
        high[v] = causal ? o->tpos[v] - c0 : (vi){0} + INT_MAX / 2;
    }
    for (int i = 0; i < nc; i++)
        for (int v = 0; v < nv; v++) {
            vf x = load(st + (size_t)i * W + v * VL);
            if (masked) x = select_((high[v] >= i) & (low[v] <= i), x, ninf);
            most[v] = select_(x > most[v], x, most[v]);
        }
    for (int v = 0; v < nv; v++) {
        /* scale > 0. A row that sees no key of the chunk (an own chunk past its token, a
         * cached chunk before its window) keeps its max, which starts at -FLT_MAX: a row
         * that has seen nothing yet corrects by e^0 and then by e^-88 (vexp's clamp), on a
         * sum and output still 0. */
        const vf top = most[v] * scale;
        const vf m = select_(top > o->m[v], top, o->m[v]);
        correction[v] = o->started ? vexp(o->m[v] - m) : splat(0.0f);
        o->m[v] = m;
    }
    for (int i = 0; i < nc; i++)
        for (int v = 0; v < nv; v++) {
            vf e = vexp(load(st + (size_t)i * W + v * VL) * scale - o->m[v]);
            if (masked) e = select_((high[v] >= i) & (low[v] <= i), e, splat(0.0f));
            store_vec(st + (size_t)i * W + v * VL, e);
            total[v] += e;
        }
    for (int v = 0; v < nv; v++) o->l[v] = o->l[v] * correction[v] + total[v];
    if (o->started)
        for (int r = 0; r < o->rows; r++) {
            const float c = correction[r / VL][r % VL];
            if (c != 1.0f)
                for (int t = 0; t < D; t += VL) store_vec(o->out[r] + t, load(o->out[r] + t) * c);
        }
    const float *pcol[ROW_ITEM_ROWS];
    for (int r = 0; r < o->rows; r++) pcol[r] = st + r;
    rows_times(pcol, W, o->rows, nc, v, D, D, o->out, o->started);
    o->started = 1;
}

struct row_items {
    const struct attention_job *j;
    int blocks, block_rows, items;
    atomic_int next;
};

/* The keys of the chunk at c0 of [0, end): up to ROW_ITEM_KEYS, none past the end. */
static int chunk_keys(int end, int c0) {
    return end - c0 < ROW_ITEM_KEYS ? (end > c0 ? end - c0 : 0) : ROW_ITEM_KEYS;
}

/* Rows [r0, r1) of group g, all of batch row b, against the cache and b's own keys. */
static void attend_rows(const struct attention_job *j, int g, int b, int r0, int r1, float *qt,
                        float *st) {
    const struct step_args *a = j->a;
    const int D = a->head_dim, T = a->tokens;
    const float *qrow[ROW_BLOCK];
    int grow[ROW_BLOCK], tpos[ROW_BLOCK];
    group_rows(j, g, r0, r1, qrow, grow, tpos);
    struct online o = {.rows = r1 - r0, .nv = ceil_div(r1 - r0, VL)};
    const int W = o.nv * VL;
    for (int r = 0; r < W; r++) {
        if (r < o.rows) o.out[r] = j->out + (size_t)grow[r] * D;
        o.tpos[r / VL][r % VL] = r < o.rows ? tpos[r] : T;
        for (int d = 0; d < D; d++) qt[(size_t)d * W + r] = r < o.rows ? qrow[r][d] : 0.0f;
    }
    for (int v = 0; v < o.nv; v++) {
        o.m[v] = splat(-FLT_MAX);
        o.l[v] = splat(0.0f);
    }
    const struct step_cache *c = j->cache;
    const int windowed = c->window != 0, cached = j->cached;
    /* window_lo's shifts: a row of token t sees cached key t + shift and on */
    const int cached_shift = windowed ? window_lo(a, c, 0, c->start) : 0;
    const int own_shift = windowed ? window_lo(a, c, 0, a->offset) : 0;
    /* the cache's chunks from the first one the block's first row sees (unread when none) */
    int c0 = windowed && tpos[0] + cached_shift > 0 ? tpos[0] + cached_shift : 0;
    const size_t head = (size_t)g * c->head_stride;
    const float *kc = c->keys + head, *vc = c->values + head;
    const float *kc2 = c->wrap ? c->keys2 + head : NULL, *vc2 = c->wrap ? c->values2 + head : NULL;
    /* chunks of ROW_ITEM_KEYS from a multiple of it, none across the wrap of a ring's runs */
    for (c0 -= c0 % ROW_ITEM_KEYS; c0 < cached;) {
        const int nc = chunk_keys(run_end(c->wrap, c0, cached), c0), c1 = c0 + nc;
        const int next = chunk_keys(run_end(c->wrap, c1, cached), c1);
        online_chunk(j, &o, cached_row(kc, kc2, c->wrap, c0, D), cached_row(vc, vc2, c->wrap, c0, D),
                     c0, nc, cached_row(kc, kc2, c->wrap, c1, D), next, 0, windowed, cached_shift,
                     qt, st);
        c0 = c1;
    }
    const size_t at = ((size_t)b * a->kv_heads + g) * T * D;
    const float *nk = j->nk + at, *nv = j->nv + at;
    const int seen = tpos[o.rows - 1] + 1;
    for (int k0 = 0; k0 < seen; k0 += ROW_ITEM_KEYS) {
        const int nc = chunk_keys(seen, k0), next = chunk_keys(seen, k0 + nc);
        online_chunk(j, &o, nk + (size_t)k0 * D, nv + (size_t)k0 * D, k0, nc,
                     nk + (size_t)(k0 + nc) * D, next, 1, windowed, own_shift, qt, st);
    }
    for (int r = 0; r < o.rows; r++) {
        float l = o.l[r / VL][r % VL];
        if (j->sinks) l += expf(j->sinks[grow[r] % a->heads] - o.m[r / VL][r % VL]);
        const float inv = 1.0f / l;
        for (int t = 0; t < D; t += VL) store_vec(o.out[r] + t, load(o.out[r] + t) * inv);
    }
}

/* Row items taken in turn, a group's items adjacent (both threads read its keys together). */
static void row_items_run(const void *arg, int index, int count) {
    (void)count;
    struct row_items *ri = (struct row_items *)arg;
    const struct attention_job *j = ri->j;
    const struct step_args *a = j->a;
    const int own_rows = a->tokens * (a->heads / a->kv_heads), per_group = a->batch * ri->blocks;
    float *qt = j->scores + (size_t)index * (ROW_BLOCK + a->head_dim) * KEY_CHUNK;
    float *st = qt + (size_t)a->head_dim * ROW_ITEM_ROWS;
    for (int item; (item = atomic_fetch_add(&ri->next, 1)) < ri->items;) {
        const int g = item / per_group, b = item % per_group / ri->blocks;
        const int k = item % ri->blocks, first = b * own_rows + k * ri->block_rows;
        const int end = (b + 1) * own_rows;
        const int last = first + ri->block_rows < end ? first + ri->block_rows : end;
        attend_rows(j, g, b, first, last, qt, st);
    }
}

static int prefix_blocks(const struct step_args *a) {
    return ceil_div((long)a->batch * a->tokens * (a->heads / a->kv_heads), ROW_BLOCK);
}

long attention_scratch_floats(const struct step_args *a) {
    const int splits = attention_splits(a, prefix_blocks(a), a->offset); /* the most */
    return (long)(splits + 1) * a->batch * a->tokens * a->heads * (a->head_dim + 2) +
           (long)MAX_THREADS * (ROW_BLOCK + a->head_dim) * KEY_CHUNK;
}

/* softmax(q k^T * scale, causal) v for every query row of this layer, into `out` (with a
 * head's sink, e^(sink - m) joins its row's denominator, m the row's running max): row items
 * where a layer makes ROW_ITEMS_ENOUGH (SmolLM2, 15 tokens over 483 cached, attention alone:
 * 6.5-6.7 ms against 9.5-11 for split items; the whole step 0.91x), else split items. */
void attention(const struct step_args *a, const struct step_cache *cache, const float *sinks,
               const float *q, const float *nk, const float *nv, float *out, float *scratch) {
    struct attention_job j = {.a = a, .cache = cache, .sinks = sinks, .q = q, .nk = nk, .nv = nv,
                              .out = out};
    j.prefix_blocks = prefix_blocks(a);
    j.own_blocks = ceil_div((long)a->tokens * (a->heads / a->kv_heads), ROW_BLOCK);
    j.cached = a->offset - cache->start;
    j.splits = attention_splits(a, j.prefix_blocks, j.cached);
    j.items = a->kv_heads * (j.splits * j.prefix_blocks + a->batch * j.own_blocks);
    j.part = scratch;
    j.scores = scratch + (long)(j.splits + 1) * a->batch * a->tokens * a->heads * (a->head_dim + 2);
    atomic_init(&j.next, 0);
    const int own_rows = a->tokens * (a->heads / a->kv_heads), enough = ROW_ITEMS_ENOUGH;
    struct row_items ri = {.j = &j, .blocks = ceil_div(own_rows, ROW_ITEM_ROWS)};
    /* smaller blocks (down to a vector of rows) where they make ROW_ITEMS_ENOUGH items */
    const int wanted = ceil_div(enough, (long)a->kv_heads * a->batch);
    if (ri.blocks < wanted) ri.blocks = wanted < own_rows / VL ? wanted : own_rows / VL;
    /* a block of fewer rows than a vector wastes its lanes (a decode step of Qwen3-0.6B: 8
     * groups of 2 rows, 1.03x the step's time as row items: 11 of 30 pairs faster) */
    if (own_rows >= VL && (long)a->kv_heads * a->batch * ri.blocks >= enough) {
        /* blocks as even as they divide, in whole rows_times triples */
        ri.block_rows = (int)ceil_div(own_rows, ri.blocks);
        ri.block_rows += (3 - ri.block_rows % 3) % 3;
        ri.blocks = ceil_div(own_rows, ri.block_rows);
        ri.items = a->kv_heads * a->batch * ri.blocks;
        atomic_init(&ri.next, 0);
        parallel(row_items_run, &ri);
        return;
    }
    const long work = (long)a->heads * a->batch * a->tokens * (j.cached + a->tokens) * a->head_dim;
    if (work < (1L << 16))
        attention_items(&j, 0, 1);
    else
        parallel(attention_items, &j);
    /* the merge reads (splits + 1) partials a row: a decode step's 9-32 rows are not worth
     * waking the pool for */
    if ((long)a->batch * a->tokens * a->heads * (j.splits + 1) * a->head_dim < (1L << 16))
        attention_merge(&j, 0, 1);
    else
        parallel(attention_merge, &j);
}
