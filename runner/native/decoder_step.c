/*
 * The decoder layers of a Llama-shaped model (Llama, Qwen2, Qwen3, Mistral; Gemma2, Gemma3,
 * Qwen3-MoE and gpt-oss with their parameters) for a few tokens, in one call: the products on
 * products.c's tiles and pool, attention in attention.c.
 *
 * Why: on MLX's CPU backend a decode step of SmolLM2 is ~3,000 primitive operations at
 * ~5 us each, beside reading the weights once (docs/DESIGN.md §4). Here a step is 7
 * products a layer plus loops over a few rows, all in float32 like MLX's own path:
 *
 *   h = rms_norm(x) ; q, k, v = h Wq^T (+b), h Wk^T (+b), h Wv^T (+b)
 *   (Qwen3) q, k = rms_norm per head ; rotary on q, k (cos/sin tables from the caller)
 *   (Ministral3) q *= the caller's scale of its position
 *   o = softmax(q k^T * scale, causal) v over the cached keys and these (a layer's window,
 *       where its cache says; Gemma2's soft-capped scores; gpt-oss's sinks: attention.c) ;
 *   x += o Wo^T (+b)            (Gemma: x += rms_norm(o Wo^T), `attn_out_norm`)
 *   h = rms_norm(x) ; x += (act(h Wg^T) * h Wu^T) Wd^T   (Gemma: the sum's rms_norm added,
 *       `mlp_out_norm`; act: SiLU, or Gemma's tanh-approximate GELU, or gpt-oss's clamped
 *       SwiGLU), or a layer's mixture of experts (struct step_experts: `experts_mlp`)
 *   then the final rms_norm.
 * Gemma's norms scale by 1 + weight: the caller passes that sum, as MLX computes it; its
 * embeddings' scale is the caller's too (x comes in embedded and scaled).
 *
 * Weights: each product's in its own format (struct step_weight): float32; exact
 * half-precision copies in panels (runner_narrow_panels), with the float32 weights beside them
 * for the BLAS where `to_blas` says; or MLX's affine-quantized codes, read as they are stored
 * (quantized.c). Every format's products are float32 sums of the weights' values.
 *
 * The step's keys and values are returned in `new_keys` / `new_values`, and also written
 * into the cache where the caller says (`append_keys`: a buffer only the caller holds,
 * runner/backend/native_step.py); cached positions are only read.
 *
 * `batch` rows of `tokens` tokens each may share one cache (scoring rows over a shared
 * prefix): every row attends to the cached positions and to its own tokens, at the same
 * positions (offset + t).
 */
#include "internal.h"

/* out[n] = x[n] / sqrt(mean(x^2) + eps) * w[n] */
static void rms_norm(const float *x, const float *w, float eps, int n, float *out) {
    /* the sum of squares in VL lanes: one scalar chain would wait on every add (~4 cycles an
     * element; a decision batch's norms are ~44M elements on one thread) */
    const int nv = n - n % VL;
    vf lanes = {0};
    for (int i = 0; i < nv; i += VL) {
        const vf v = load(x + i);
        lanes += v * v;
    }
    float ss = hsum(lanes);
    for (int i = nv; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}


/* How a gated MLP combines its gate and up products (step_args' activation and its
 * parameters; an expert's biases, added to both before the activation, or NULL). */
struct glu {
    int activation;
    float alpha, limit;
    const float *gate_bias, *up_bias;
};

/* act(g) * u: silu(g) = g / (1 + e^-g), or GELU's tanh approximation as MLX's gelu_approx
 * computes it, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))); or gpt-oss's clamped
 * SwiGLU as mlx-lm's swiglu_oai, (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha g') with
 * g' = min(g, limit). */
static inline vf glu_of(vf g, vf u, const struct glu *f) {
    if (f->activation == ACT_GELU_TANH) {
        const vf inner = (g + g * g * g * 0.044715f) * 0.7978845608028654f;
        return g * 0.5f * (vtanh(inner) + 1.0f) * u;
    }
    if (f->activation == ACT_SWIGLU_OAI) {
        const vf lim = splat(f->limit), low = splat(-f->limit);
        g = select_(g > lim, lim, g);
        u = select_(u > lim, lim, select_(u < low, low, u));
        return (u + 1.0f) * (g * (1.0f / (vexp(-(g * f->alpha)) + 1.0f)));
    }
    return g / (vexp(-g) + 1.0f) * u;
}

/* gate[r, j0:j1] = act(gate) * up over rows [0, m) of [m, n] (each first plus its bias where
 * `f` has one), every element through `glu_of` (a partial vector through a copy): the same
 * value whichever share of the columns it falls in. */
static void glu_columns(float *gate, const float *up, int m, int n, int j0, int j1,
                        const struct glu *f) {
    for (int r = 0; r < m; r++) {
        float *g = gate + (size_t)r * n;
        const float *u = up + (size_t)r * n;
        int j = j0;
        for (; j + VL <= j1; j += VL) {
            vf gv = load(g + j), uv = load(u + j);
            if (f->gate_bias) gv += load(f->gate_bias + j);
            if (f->up_bias) uv += load(f->up_bias + j);
            store_vec(g + j, glu_of(gv, uv, f));
        }
        if (j < j1) { /* the last partial vector, through copies */
            float tg[VL] = {0}, tu[VL] = {0}, bg[VL] = {0}, bu[VL] = {0};
            memcpy(tg, g + j, sizeof(float) * (j1 - j));
            memcpy(tu, u + j, sizeof(float) * (j1 - j));
            if (f->gate_bias) memcpy(bg, f->gate_bias + j, sizeof(float) * (j1 - j));
            if (f->up_bias) memcpy(bu, f->up_bias + j, sizeof(float) * (j1 - j));
            store_vec(tg, glu_of(load(tg) + load(bg), load(tu) + load(bu), f));
            memcpy(g + j, tg, sizeof(float) * (j1 - j));
        }
    }
}

struct gate_up_job {
    struct product p[2]; /* gate, up: one shape and format, so the same column shares */
    float *gate;
    const float *up;
    const struct glu *f;
    atomic_int next; /* the next chunk to take */
};

static void gate_up_share(const void *arg, int index, int count) {
    (void)index;
    struct gate_up_job *job = (struct gate_up_job *)arg;
    const int chunks = count * CHUNKS_PER_THREAD;
    for (int c; (c = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) < chunks;) {
        product_share(&job->p[0], c, chunks);
        product_share(&job->p[1], c, chunks);
        int j0, j1;
        share_columns(&job->p[0], c, chunks, &j0, &j1);
        if (j0 < j1) glu_columns(job->gate, job->up, job->p[0].m, job->p[0].n, j0, j1, job->f);
    }
}

/* gate = act(A Wg^T) * (A Wu^T), up = A Wu^T: one job on the pool, each thread applying the
 * activation to the columns it computed (on one thread, ~16 us a SmolLM2 layer of 15 rows
 * while the other waited). */
static void gate_up(int m, int k, int n, const float *a, const struct step_weight *wg,
                    const struct step_weight *wu, float *gate, float *up, float *reordered,
                    const void *limbs, const struct glu *f) {
    const int widths[2] = {n, n};
    const struct step_weight *ws[2] = {wg, wu};
    float *cs[2] = {gate, up};
    /* one job when both read A alike and share their columns alike */
    const int alike = wg->format == wu->format && (wg->format != W_AFFINE || wg->bits == wu->bits);
    if (!alike || to_blas(m, wg) || to_blas(m, wu)) {
        products_of(m, k, a, 2, widths, ws, cs, reordered, limbs); /* the BLAS, or shares that differ */
        glu_columns(gate, up, m, n, 0, n, f);
        return;
    }
    struct amx_rows amx; /* a forward's Q4_K / Q5_K / affine rows on AMX's tiles (amx.c) */
    const struct amx_rows *split = amx_rows_of(m, k, a, k, wg, limbs, &amx);
    const float *rows = split ? a : rows_for(wg, m, k, a, k, reordered); /* the tiles read digits */
    struct gate_up_job job = {
        {tiles_product(m, n, k, rows, k, wg, gate, n, limbs), tiles_product(m, n, k, rows, k, wu, up, n, limbs)},
        gate, up, f, 0};
    job.p[0].amx = job.p[1].amx = split;
    if ((long)m * k * n < (1L << 18))
        gate_up_share(&job, 0, 1);
    else
        parallel(gate_up_share, &job);
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
            if (dims % 2) {
                for (int i = 0; i < dims; i++) v[i] = tmp[i] * c[i] + tmp[(i + half) % dims] * s[i];
                continue;
            }
            /* (i + half) % dims without a division an element: two loops the compiler vectorises */
            for (int i = 0; i < half; i++) v[i] = tmp[i] * c[i] + tmp[i + half] * s[i];
            for (int i = half; i < dims; i++) v[i] = tmp[i] * c[i] + tmp[i - half] * s[i];
        }
}

/* The widest MLP of the layers: their gated MLP's, or their experts'. */
static long widest_intermediate(const struct step_args *a) {
    long n = a->intermediate;
    for (int l = 0; l < a->layers; l++) {
        const struct step_experts *e = a->layer[l].experts;
        if (e && e->intermediate > n) n = e->intermediate;
    }
    return n;
}

/* The widest A a layer's products read: what `reordered` holds (rows_for). */
static long widest_rows(const struct step_args *a) {
    long k = a->hidden;
    if ((long)a->heads * a->head_dim > k) k = (long)a->heads * a->head_dim;
    if (widest_intermediate(a) > k) k = widest_intermediate(a);
    return k;
}

/* The most experts, and the most a token takes, of the layers (0 without experts). */
static void expert_counts(const struct step_args *a, long *count, long *top_k) {
    *count = *top_k = 0;
    for (int l = 0; l < a->layers; l++) {
        const struct step_experts *e = a->layer[l].experts;
        if (e && e->count > *count) *count = e->count;
        if (e && e->top_k > *top_k) *top_k = e->top_k;
    }
}

/* Scratch of the experts' MLP (experts_mlp): the router's probabilities [T, count], the rows
 * an expert takes and its outputs [T, hidden] each, the tokens' choices [T, top_k] (an
 * expert and its weight) twice (in order of token, then of expert), and where each expert's
 * choices start [count + 1] and are filled to [count]. */
static long experts_floats(const struct step_args *a) {
    long count, top_k;
    expert_counts(a, &count, &top_k);
    if (!count) return 0;
    const long T = (long)a->batch * a->tokens;
    return T * count + T * a->hidden * 2 + T * top_k * 4 + count * 2 + 1;
}

/* Scratch for a decode step's limbs of the widest A (limb_split), 0 for other steps. */
static long decode_limb_floats(const struct step_args *a) {
    return a->decode ? limb_floats(a->batch * a->tokens, (int)widest_rows(a)) + 16 : 0;
}

/* Whether any product of the layers reads limbs in this build (limbs_read). */
static int limb_weights(const struct step_args *a) {
    const int H = a->hidden, I = a->intermediate, qd = a->heads * a->head_dim;
    for (int l = 0; l < a->layers; l++) {
        const struct step_layer *w = &a->layer[l];
        const struct step_weight *ws[7] = {&w->q, &w->k, &w->v, &w->o, &w->gate, &w->up, &w->down};
        const int ks[7] = {H, H, H, qd, H, H, I};
        for (int i = 0; i < 7; i++)
            if ((i < 4 || !w->experts) && limbs_read(ws[i], ks[i])) return 1;
        const struct step_experts *e = w->experts;
        if (e && (limbs_read(&e->router, H) || limbs_read(&e->gate, H) || limbs_read(&e->up, H) ||
                  limbs_read(&e->down, e->intermediate)))
            return 1;
    }
    return 0;
}

/* A's rows as limbs into `scratch` for a decode step: `scratch`, or NULL (other steps, or a
 * build or an A that limbs do not take: the float tiles then). */
static const void *limbs_of(const struct step_args *a, int m, int k, const float *rows, float *scratch) {
    if (!a->decode || !scratch || !limb_floats(m, k)) return NULL;
    return limb_split(m, k, rows, k, scratch) ? scratch : NULL;
}

/* Expert e's weight of a stack (struct step_experts): `w`'s arrays moved by e strides. */
static struct step_weight expert_weight(const struct step_weight *w, int e, const long stride[2]) {
    struct step_weight out = *w;
    out.data = (const char *)w->data + (size_t)e * stride[0];
    if (w->f32) out.f32 = (const float *)out.data; /* W_F32: the same array (weights_supported) */
    if (w->scales) out.scales = (const char *)w->scales + (size_t)e * stride[1];
    if (w->biases) out.biases = (const char *)w->biases + (size_t)e * stride[1];
    return out;
}

/* out[T, H] = the experts' MLP of the normed rows h[T, H] (struct step_experts), as mlx-lm's
 * Qwen3MoeSparseMoeBlock (or gpt_oss MLPBlock: the biases where given) computes it in
 * float32: the router's softmax, each row's top_k
 * experts (of equal probabilities, the lower index first), their probabilities (renormalised
 * where norm_topk says), and the sum of each chosen expert's gated MLP scaled by its
 * probability. Each expert that any row chose runs once, over the rows that chose it
 * (gathered): experts no row chose are never read. The sum of a row's experts is taken in
 * order of expert, not of MLX's choice: the same values, within float32 rounding. */
static void experts_mlp(const struct step_args *a, const struct step_experts *e, int T,
                        const float *h, float *out, float *gate, float *up, float *reordered,
                        float *moe, float *limb_area) {
    const int H = a->hidden, I = e->intermediate, E = e->count, K = e->top_k;
    float *probs = moe, *rows = probs + (size_t)T * E, *done = rows + (size_t)T * H;
    float *picked = done + (size_t)T * H, *chosen_weight = picked + (size_t)T * K;
    int *picks = (int *)(chosen_weight + (size_t)T * K), *chosen = picks + (size_t)T * K;
    int *start = chosen + (size_t)T * K, *fill = start + E + 1;
    product(T, E, H, h, H, &e->router, probs, E, reordered, limbs_of(a, T, H, h, limb_area));
    add_bias(probs, e->router_bias, T, E);
    /* each row's softmax (in place), then its top_k in order of probability, counted per expert */
    for (int x = 0; x <= E; x++) start[x] = 0;
    for (int t = 0; t < T; t++) {
        float *p = probs + (size_t)t * E, top = p[0], sum = 0.0f;
        for (int x = 1; x < E; x++) top = p[x] > top ? p[x] : top;
        for (int x = 0; x < E; x++) sum += p[x] = expf(p[x] - top);
        for (int x = 0; x < E; x++) p[x] /= sum;
        int *pick = picks + (size_t)t * K, n = 0;
        for (int x = 0; x < E; x++) { /* insertion into the K largest so far: a tie stays behind */
            if (n == K && !(p[x] > p[pick[K - 1]])) continue;
            int at = n < K ? n++ : K - 1;
            for (; at > 0 && p[x] > p[pick[at - 1]]; at--) pick[at] = pick[at - 1];
            pick[at] = x;
        }
        float kept = 0.0f;
        for (int j = 0; j < K; j++) {
            picked[t * K + j] = p[pick[j]];
            kept += p[pick[j]];
            start[pick[j] + 1]++;
        }
        if (e->norm_topk)
            for (int j = 0; j < K; j++) picked[t * K + j] /= kept;
    }
    /* the choices grouped by expert: expert x's are chosen[start[x] .. start[x + 1]) */
    for (int x = 0; x < E; x++) start[x + 1] += start[x];
    for (int x = 0; x < E; x++) fill[x] = start[x];
    for (int i = 0; i < T * K; i++) {
        const int at = fill[picks[i]]++;
        chosen[at] = i / K;
        chosen_weight[at] = picked[i];
    }
    memset(out, 0, sizeof(float) * (size_t)T * H);
    for (int x = 0; x < E; x++) {
        const int m = start[x + 1] - start[x];
        if (!m) continue;
        for (int r = 0; r < m; r++)
            memcpy(rows + (size_t)r * H, h + (size_t)chosen[start[x] + r] * H, sizeof(float) * H);
        const struct step_weight wg = expert_weight(&e->gate, x, e->gate_up_stride);
        const struct step_weight wu = expert_weight(&e->up, x, e->gate_up_stride);
        const struct step_weight wd = expert_weight(&e->down, x, e->down_stride);
        const struct glu f = {a->activation, a->act_alpha, a->act_limit,
                              e->gate_bias ? e->gate_bias + (size_t)x * I : NULL,
                              e->up_bias ? e->up_bias + (size_t)x * I : NULL};
        gate_up(m, H, I, rows, &wg, &wu, gate, up, reordered, limbs_of(a, m, H, rows, limb_area), &f);
        product(m, H, I, gate, I, &wd, done, H, reordered, limbs_of(a, m, I, gate, limb_area));
        if (e->down_bias) add_bias(done, e->down_bias + (size_t)x * H, m, H);
        for (int r = 0; r < m; r++) {
            const float w = chosen_weight[start[x] + r];
            float *o = out + (size_t)chosen[start[x] + r] * H;
            const float *d = done + (size_t)r * H;
            for (int i = 0; i < H; i++) o[i] += d[i] * w;
        }
    }
}

long runner_step_scratch_floats(const struct step_args *a) {
    const long T = (long)a->batch * a->tokens, qd = (long)a->heads * a->head_dim;
    const long kd = (long)a->kv_heads * a->head_dim;
    return T * a->hidden * 2 + T * qd * 2 + T * kd * 2 + T * widest_intermediate(a) * 2 +
           T * widest_rows(a) + decode_limb_floats(a) + attention_scratch_floats(a) +
           experts_floats(a);
}

/* Whether every product weight of the layers can be read as a weight of its shape. */
static int weights_supported(const struct step_args *a) {
    const int H = a->hidden, I = a->intermediate, qd = a->heads * a->head_dim;
    const int kd = a->kv_heads * a->head_dim;
    for (int l = 0; l < a->layers; l++) {
        const struct step_layer *w = &a->layer[l];
        if (!runner_weight_supported(&w->q, qd, H) || !runner_weight_supported(&w->k, kd, H) ||
            !runner_weight_supported(&w->v, kd, H) || !runner_weight_supported(&w->o, H, qd))
            return 0;
        const struct step_experts *e = w->experts;
        if (!e && (!runner_weight_supported(&w->gate, I, H) || !runner_weight_supported(&w->up, I, H) ||
                   !runner_weight_supported(&w->down, H, I)))
            return 0;
        /* the experts' weights alike, expert 0's read as every expert's */
        if (e && (e->count < 1 || e->top_k < 1 || e->top_k > e->count || e->intermediate < 1 ||
                  !runner_weight_supported(&e->router, e->count, H) ||
                  !runner_weight_supported(&e->gate, e->intermediate, H) ||
                  !runner_weight_supported(&e->up, e->intermediate, H) ||
                  !runner_weight_supported(&e->down, H, e->intermediate) ||
                  e->gate.format == W_F16 || e->gate.format == W_BF16 || e->down.format == W_F16 ||
                  e->down.format == W_BF16 || (e->gate.f32 && e->gate.f32 != e->gate.data) ||
                  (e->up.f32 && e->up.f32 != e->up.data) || (e->down.f32 && e->down.f32 != e->down.data)))
            return 0;
    }
    return 1;
}

int runner_decoder_step(const struct step_args *a) {
    const int T = a->batch * a->tokens, W = a->tokens, H = a->hidden, D = a->head_dim;
    const int I = a->intermediate;
    const int qd = a->heads * D, kd = a->kv_heads * D;
    if (a->rope_dims > 1024 || a->rope_dims > D || a->heads % a->kv_heads || D % VL) return -1;
    if (a->activation != ACT_SILU && a->activation != ACT_GELU_TANH &&
        a->activation != ACT_SWIGLU_OAI)
        return -1;
    if (!weights_supported(a)) return -1;
    float *h = a->scratch, *tmp = h + (size_t)T * H, *q = tmp + (size_t)T * H;
    float *o = q + (size_t)T * qd, *k = o + (size_t)T * qd, *v = k + (size_t)T * kd;
    const long wide = widest_intermediate(a);
    float *gate = v + (size_t)T * kd, *up = gate + (size_t)T * wide;
    float *reordered = up + (size_t)T * wide, *limbs = reordered + (size_t)T * widest_rows(a);
    float *moe = limbs + decode_limb_floats(a), *scores = moe + experts_floats(a);
    /* limb_split's blocks at a 64-byte boundary, where a decode step has products that read them */
    float *limb_area = a->decode && limb_weights(a) ? (float *)(((size_t)limbs + 63) & ~(size_t)63) : NULL;
    float *x = a->x;
    for (int l = 0; l < a->layers; l++) {
        const struct step_layer *w = &a->layer[l];
        for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, w->input_norm, a->eps, H, h + (size_t)t * H);
        {
            const int n[3] = {qd, kd, kd};
            const struct step_weight *ws[3] = {&w->q, &w->k, &w->v};
            float *cs[3] = {q, k, v};
            products_of(T, H, h, 3, n, ws, cs, reordered, limbs_of(a, T, H, h, limb_area));
        }
        add_bias(q, w->q_bias, T, qd);
        add_bias(k, w->k_bias, T, kd);
        add_bias(v, w->v_bias, T, kd);
        if (w->q_norm)
            for (int r = 0; r < T * a->heads; r++) rms_norm(q + (size_t)r * D, w->q_norm, a->eps, D, q + (size_t)r * D);
        if (w->k_norm)
            for (int r = 0; r < T * a->kv_heads; r++) rms_norm(k + (size_t)r * D, w->k_norm, a->eps, D, k + (size_t)r * D);
        const size_t table = (size_t)w->rope_table * W * a->rope_dims;
        rotate(q, T, W, a->heads, D, a->rope_dims, a->cos + table, a->sin + table);
        rotate(k, T, W, a->kv_heads, D, a->rope_dims, a->cos + table, a->sin + table);
        if (a->query_scale) /* after the rotation, as MLX multiplies them */
            for (int r = 0; r < T; r++) {
                const float s = a->query_scale[r % W];
                float *row = q + (size_t)r * qd;
                for (int i = 0; i < qd; i++) row[i] *= s;
            }
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
        const struct step_cache *c = &a->cache[l];
        if (c->append_keys && a->batch == 1)
            for (int g = 0; g < a->kv_heads; g++)
                for (int t = 0; t < W; t++) {
                    const size_t to = (size_t)g * c->head_stride + (size_t)t * D;
                    memcpy(c->append_keys + to, nk + ((size_t)g * W + t) * D, sizeof(float) * D);
                    memcpy(c->append_values + to, nv + ((size_t)g * W + t) * D, sizeof(float) * D);
                }
        attention(a, &a->cache[l], w->sinks, q, nk, nv, o, scores);
        product(T, H, qd, o, qd, &w->o, tmp, H, reordered, limbs_of(a, T, qd, o, limb_area));
        add_bias(tmp, w->o_bias, T, H);
        if (w->attn_out_norm)
            for (int t = 0; t < T; t++) rms_norm(tmp + (size_t)t * H, w->attn_out_norm, a->eps, H, tmp + (size_t)t * H);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] += tmp[i];
        for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, w->post_norm, a->eps, H, h + (size_t)t * H);
        if (w->experts) {
            experts_mlp(a, w->experts, T, h, tmp, gate, up, reordered, moe, limb_area);
        } else {
            const struct glu f = {a->activation, a->act_alpha, a->act_limit, NULL, NULL};
            gate_up(T, H, I, h, &w->gate, &w->up, gate, up, reordered, limbs_of(a, T, H, h, limb_area),
                    &f);
            product(T, H, I, gate, I, &w->down, tmp, H, reordered, limbs_of(a, T, I, gate, limb_area));
        }
        if (w->mlp_out_norm)
            for (int t = 0; t < T; t++) rms_norm(tmp + (size_t)t * H, w->mlp_out_norm, a->eps, H, tmp + (size_t)t * H);
        for (size_t i = 0; i < (size_t)T * H; i++) x[i] += tmp[i];
    }
    for (int t = 0; t < T; t++) rms_norm(x + (size_t)t * H, a->final_norm, a->eps, H, x + (size_t)t * H);
    return 0;
}
