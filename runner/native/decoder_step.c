/*
 * The decoder layers of a Llama-shaped model (Llama, Qwen3) for a few tokens, in one call:
 * included by sgemm_dispatch.c, whose tiles do the products and whose pool runs them.
 *
 * Why: on MLX's CPU backend a decode step of SmolLM2 is ~3,000 primitive operations at
 * ~5 us each, beside reading the weights once (docs/DESIGN.md §4). Here a step is 7
 * products a layer plus loops over a few rows, all in float32 like MLX's own path:
 *
 *   h = rms_norm(x) ; q, k, v = h Wq^T (+b), h Wk^T (+b), h Wv^T (+b)
 *   (Qwen3) q, k = rms_norm per head ; rotary on q, k (cos/sin tables from the caller)
 *   o = softmax(q k^T * scale, causal) v over the cached keys and these ; x += o Wo^T (+b)
 *   h = rms_norm(x) ; x += (silu(h Wg^T) * h Wu^T) Wd^T
 *   then the final rms_norm.
 *
 * The caches are read, never written: the caller appends `new_keys` / `new_values` to them
 * through MLX (its copy-on-write keeps every other reference to a cache buffer intact).
 *
 * `batch` rows of `tokens` tokens each may share one cache (scoring rows over a shared
 * prefix): every row attends to the cached positions and to its own tokens, at the same
 * positions (offset + t).
 */

struct step_layer {
    const float *input_norm, *q, *k, *v, *o;
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* NULL: none */
    const float *q_norm, *k_norm;                   /* NULL: none (Llama); [head_dim] */
    const float *post_norm, *gate, *up, *down;
};

struct step_cache {
    const float *keys, *values; /* [kv_heads, capacity, head_dim]: head h at h * head_stride */
    long head_stride;
};

struct step_args {
    int batch, tokens, hidden, heads, kv_heads, head_dim, intermediate, layers, offset, rope_dims;
    float eps, scale;
    const float *cos, *sin; /* [tokens, rope_dims]: [cos, cos] and [-sin, sin] (rotate-half) */
    const struct step_layer *layer;
    const struct step_cache *cache; /* per layer; unread when offset is 0 */
    const float *final_norm;
    float *x;                       /* [batch, tokens, hidden]: embeddings in, final hidden out */
    float *new_keys, *new_values;   /* [layers, batch, kv_heads, tokens, head_dim] out */
    float *scratch;                 /* runner_step_scratch_floats() floats */
};

typedef int vi __attribute__((vector_size(VBYTES)));

static inline vf splat(float f) {
    vf v;
    for (int i = 0; i < VL; i++) v[i] = f;
    return v;
}

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

static inline void store_vec(float *p, vf v) { *(vf_unaligned *)p = v; }

/* out[n] = x[n] / sqrt(mean(x^2) + eps) * w[n] */
static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

/* C = A W^T: the dispatch's tiles up to BLAS_ROWS rows, the BLAS (which packs) above:
 * SmolLM2 forwards after 480 cached tokens, BLAS above 40 rows against above 128: 64 tokens
 * 209 against 178-197 ms, 128: 407 against 364. */
enum { BLAS_ROWS = 128 };
static void product(int m, int n, int k, const float *a, int lda, const float *w, int ldw,
                    float *c, int ldc) {
    if (m > BLAS_ROWS && next_blas()) {
        next_sgemm(ROW_MAJOR, NO_TRANS, TRANS, m, n, k, 1.0f, a, lda, w, ldw, 0.0f, c, ldc);
        return;
    }
    const struct product p = {m, n, k, lda, ldw, ldc, 1.0f, 0.0f, a, w, c};
    small_product(&p);
}

struct products {
    const struct product *p;
    int n;
};

static void products_share(const void *arg, int index, int count) {
    const struct products *ps = arg;
    for (int i = 0; i < ps->n; i++) product_share(&ps->p[i], index, count);
}

/* Products with the same rows of A, one job on the pool: no barrier between them. */
static void products_of(int m, int k, const float *a, int n_products, const int *n,
                        const float *const *w, float *const *c) {
    if (m > BLAS_ROWS && next_blas()) {
        for (int i = 0; i < n_products; i++) product(m, n[i], k, a, k, w[i], k, c[i], n[i]);
        return;
    }
    struct product p[3];
    for (int i = 0; i < n_products; i++)
        p[i] = (struct product){m, n[i], k, k, k, n[i], 1.0f, 0.0f, a, w[i], c[i]};
    const struct products ps = {p, n_products};
    if ((long)m * k * n[0] < (1L << 18))
        products_share(&ps, 0, 1);
    else
        parallel(products_share, &ps);
}

static void add_bias(float *c, const float *bias, int m, int n) {
    if (!bias) return;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) c[(size_t)i * n + j] += bias[j];
}

/* Rotate-half rotary embedding of the leading `dims` of each of `heads` heads of every row;
 * row r is at position r % tokens (the tables' rows). */
static void rotate(float *x, int rows, int tokens, int heads, int head_dim, int dims,
                   const float *cos, const float *sin) {
    const int half = dims / 2;
    float tmp[1024];
    for (int t = 0; t < rows; t++)
        for (int h = 0; h < heads; h++) {
            float *v = x + ((size_t)t * heads + h) * head_dim;
            const size_t at = (size_t)(t % tokens) * dims;
            const float *c = cos + at, *s = sin + at;
            memcpy(tmp, v, sizeof(float) * dims);
            for (int i = 0; i < dims; i++) v[i] = tmp[i] * c[i] + tmp[(i + half) % dims] * s[i];
        }
}

/* row[0, n) -> softmax(row[0, n)) */
static void softmax(float *row, int n) {
    float top = row[0];
    for (int i = 1; i < n; i++) top = row[i] > top ? row[i] : top;
    const int nv = n - n % VL;
    vf acc = splat(0.0f);
    for (int i = 0; i < nv; i += VL) {
        const vf e = vexp(load(row + i) - top);
        store_vec(row + i, e);
        acc += e;
    }
    float total = hsum(acc);
    for (int i = nv; i < n; i++) {
        row[i] = expf(row[i] - top);
        total += row[i];
    }
    const float inv = 1.0f / total;
    for (int i = 0; i < n; i++) row[i] *= inv;
}

/* scores[i] = scale * q . keys[i * stride] for i < n (head_dim d, a multiple of VL): eight
 * keys at a time, their dot products in eight accumulators, each q vector loaded once. */
static void dot_keys(const float *q, const float *keys, long stride, int n, int d, float scale,
                     float *scores) {
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        vf acc[8] = {{0}};
        for (int t = 0; t < d; t += VL) {
            const vf x = load(q + t);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] += x * load(keys + (i + r) * stride + t);
        }
        float out[8];
        sum4(out, acc[0], acc[1], acc[2], acc[3]);
        sum4(out + 4, acc[4], acc[5], acc[6], acc[7]);
        for (int r = 0; r < 8; r++) scores[i + r] = out[r] * scale;
    }
    for (; i < n; i++) {
        vf acc = {0};
        for (int t = 0; t < d; t += VL) acc += load(q + t) * load(keys + i * stride + t);
        scores[i] = hsum(acc) * scale;
    }
}

/* out[0, d) += sum_i weights[i] * values[i * stride] for i < n: the output in registers, 64
 * floats at a time. */
static void weigh_values(const float *weights, const float *values, long stride, int n, int d,
                         float *out) {
    int t = 0;
    for (; t + 8 * VL <= d; t += 8 * VL) {
        vf acc[8];
        for (int r = 0; r < 8; r++) acc[r] = load(out + t + r * VL);
        for (int i = 0; i < n; i++) {
            const vf w = splat(weights[i]);
            const float *v = values + i * stride + t;
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] += w * load(v + r * VL);
        }
        for (int r = 0; r < 8; r++) store_vec(out + t + r * VL, acc[r]);
    }
    for (; t < d; t += VL) {
        vf acc = load(out + t);
        for (int i = 0; i < n; i++) acc += splat(weights[i]) * load(values + i * stride + t);
        store_vec(out + t, acc);
    }
}

struct attention_job {
    const struct step_args *a;
    const struct step_cache *cache;
    const float *q, *k, *v; /* this step's rows: [tokens, heads | kv_heads, head_dim] */
    float *out;             /* [tokens, heads, head_dim] */
    float *scores;          /* per thread: one row of offset + tokens */
};

/* (row, query head) pairs index, index + count, ...: each against its KV head's cached keys
 * and its row's keys of this step, causal (token t sees positions <= offset + t). */
static void attention_heads(const void *arg, int index, int count) {
    const struct attention_job *j = arg;
    const struct step_args *a = j->a;
    const int T = a->tokens, D = a->head_dim, off = a->offset, S = off + T;
    const int rep = a->heads / a->kv_heads, qd = a->heads * D, kd = a->kv_heads * D;
    float *row = j->scores + (size_t)index * S; /* one score row at a time */
    for (int bh = index; bh < a->batch * a->heads; bh += count) {
        const int b = bh / a->heads, h = bh % a->heads, g = h / rep;
        const float *kc = j->cache->keys + g * j->cache->head_stride;
        const float *vc = j->cache->values + g * j->cache->head_stride;
        const size_t first = (size_t)b * T; /* the row's first token */
        const float *kn = j->k + first * kd + g * D, *vn = j->v + first * kd + g * D;
        for (int t = 0; t < T; t++) {
            const float *q = j->q + (first + t) * qd + h * D;
            float *out = j->out + (first + t) * qd + h * D;
            const int n = off + t + 1;
            if (off) dot_keys(q, kc, D, off, D, a->scale, row);
            dot_keys(q, kn, kd, t + 1, D, a->scale, row + off);
            softmax(row, n);
            memset(out, 0, sizeof(float) * D);
            if (off) weigh_values(row, vc, D, off, D, out);
            weigh_values(row + off, vn, kd, t + 1, D, out);
        }
    }
}

long runner_step_scratch_floats(const struct step_args *a) {
    const long T = (long)a->batch * a->tokens, qd = (long)a->heads * a->head_dim;
    const long kd = (long)a->kv_heads * a->head_dim, S = a->offset + a->tokens;
    return T * a->hidden * 2 + T * qd * 2 + T * kd * 2 + T * a->intermediate * 2 +
           (long)MAX_THREADS * S;
}

int runner_decoder_step(const struct step_args *a) {
    const int T = a->batch * a->tokens, W = a->tokens, H = a->hidden, D = a->head_dim;
    const int I = a->intermediate;
    const int qd = a->heads * D, kd = a->kv_heads * D;
    if (a->rope_dims > 1024 || a->rope_dims > D || a->heads % a->kv_heads || D % VL) return -1;
    float *h = a->scratch, *tmp = h + (size_t)T * H, *q = tmp + (size_t)T * H;
    float *o = q + (size_t)T * qd, *k = o + (size_t)T * qd, *v = k + (size_t)T * kd;
    float *gate = v + (size_t)T * kd, *up = gate + (size_t)T * I, *scores = up + (size_t)T * I;
    float *x = a->x;
    for (int l = 0; l < a->layers; l++) {
        const struct step_layer *w = &a->layer[l];
        for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, w->input_norm, a->eps, H, h + (size_t)t * H);
        {
            const int n[3] = {qd, kd, kd};
            const float *ws[3] = {w->q, w->k, w->v};
            float *cs[3] = {q, k, v};
            products_of(T, H, h, 3, n, ws, cs);
        }
        add_bias(q, w->q_bias, T, qd);
        add_bias(k, w->k_bias, T, kd);
        add_bias(v, w->v_bias, T, kd);
        if (w->q_norm)
            for (int r = 0; r < T * a->heads; r++) rms_norm(q + (size_t)r * D, w->q_norm, a->eps, D, q + (size_t)r * D);
        if (w->k_norm)
            for (int r = 0; r < T * a->kv_heads; r++) rms_norm(k + (size_t)r * D, w->k_norm, a->eps, D, k + (size_t)r * D);
        rotate(q, T, W, a->heads, D, a->rope_dims, a->cos, a->sin);
        rotate(k, T, W, a->kv_heads, D, a->rope_dims, a->cos, a->sin);
        /* this step's keys and values, [batch, kv_heads, tokens, head_dim], for the caches */
        float *nk = a->new_keys + (size_t)l * T * kd, *nv = a->new_values + (size_t)l * T * kd;
        for (int b = 0; b < a->batch; b++)
            for (int g = 0; g < a->kv_heads; g++)
                for (int t = 0; t < W; t++) {
                    const size_t to = (((size_t)b * a->kv_heads + g) * W + t) * D;
                    const size_t from = ((size_t)b * W + t) * kd + g * D;
                    memcpy(nk + to, k + from, sizeof(float) * D);
                    memcpy(nv + to, v + from, sizeof(float) * D);
                }
        const struct attention_job job = {a, &a->cache[l], q, k, v, o, scores};
        if ((long)a->heads * T * (a->offset + W) * D < (1L << 16))
            attention_heads(&job, 0, 1);
        else
            parallel(attention_heads, &job);
        product(T, H, qd, o, qd, w->o, qd, tmp, H);
        add_bias(tmp, w->o_bias, T, H);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] += tmp[i];
        for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, w->post_norm, a->eps, H, h + (size_t)t * H);
        {
            const int n[2] = {I, I};
            const float *ws[2] = {w->gate, w->up};
            float *cs[2] = {gate, up};
            products_of(T, H, h, 2, n, ws, cs);
        }
        const size_t n = (size_t)T * I, nv8 = n - n % VL;
        for (size_t i = 0; i < nv8; i += VL) { /* silu(g) * u = g / (1 + e^-g) * u */
            const vf g = load(gate + i);
            store_vec(gate + i, g / (vexp(-g) + 1.0f) * load(up + i));
        }
        for (size_t i = nv8; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        product(T, H, I, gate, I, w->down, I, tmp, H);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] += tmp[i];
    }
    for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, a->final_norm, a->eps, H, x + (size_t)t * H);
    return 0;
}
