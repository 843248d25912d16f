/*
 * The native library's ABI: what runner/native/abi.py binds with ctypes. Everything the
 * library exports is declared here (RUNNER_API; the sources are built with
 * -fvisibility=hidden), and the structs it takes are defined here once.
 *
 * Changing a struct or a signature here changes the ABI: bump RUNNER_NATIVE_ABI_VERSION, and
 * change runner/native/abi.py's mirror the same way. At load the runner checks the version and
 * every struct's size and fields' names and offsets (runner_native_field, abi.c) against its
 * mirror; on any difference it logs why and keeps the decoder layers on MLX's path.
 */
#ifndef RUNNER_NATIVE_H
#define RUNNER_NATIVE_H

#include <stddef.h>

#define RUNNER_API __attribute__((visibility("default")))
#define RUNNER_NATIVE_ABI_VERSION 27

/* How a product's W is stored (struct step_weight's `format`).
 * - W_F32: float32, [n, k] row-major.
 * - W_F16, W_BF16: float16 / bfloat16 copies of float32 weights whose every value they
 *   represent exactly (made and checked by runner_narrow_panels), in panels (panels.c), so a
 *   product reads half the bytes and computes float32 sums of the same values: a checkpoint
 *   stored in half precision, which the runner computes in float32 on the CPU.
 * - W_AFFINE: MLX's affine quantization as MLX stores it (mx.quantize, mode "affine"): each
 *   row's k codes of `bits` bits packed as one little-endian bit stream in uint32 words
 *   ([n, k * bits / 32]); per group of `group` consecutive codes of a row, a scale and a bias
 *   ([n, k / group] each, in `scale_format`: W_F32, W_F16 or W_BF16). The weight a code q
 *   stands for is MLX's dequantized value in float32, (scale * q) + bias, each operation
 *   rounded to float32 (scale and bias widened exactly): products read the codes and compute
 *   float32 sums of those values (quantized.c), never a float32 copy of W.
 *   With `scale_format` W_E8M0 it is MLX's mxfp4 mode (mx.quantize, mode "mxfp4"; GGUF's
 *   MXFP4 maps onto it): 4-bit e2m1 codes packed the same way, `group` 32, one scale byte e a
 *   group, `biases` NULL; the weight code q stands for is e2m1(q) * 2^(e - 127), exact in
 *   float32 (MLX's dequantized value).
 * - W_Q6K: GGML's Q6_K blocks as a GGUF file stores them ([n, k / 256] blocks of 210 bytes,
 *   k a multiple of 256): the weight is llama.cpp's dequantized value in float32 (quantized.c
 *   says how it is computed); products compute float32 sums of those values.
 * - W_Q4K: GGML's Q4_K blocks, the same way ([n, k / 256] blocks of 144 bytes).
 * - W_Q5K: GGML's Q5_K blocks, the same way ([n, k / 256] blocks of 176 bytes).
 * - W_Q3K: GGML's Q3_K blocks, the same way ([n, k / 256] blocks of 110 bytes).
 * - W_Q2K: GGML's Q2_K blocks, the same way ([n, k / 256] blocks of 84 bytes).
 * - W_IQ4XS: GGML's IQ4_XS blocks, the same way ([n, k / 256] blocks of 136 bytes).
 * - W_IQ4NL: GGML's IQ4_NL blocks, the same way ([n, k / 32] blocks of 18 bytes).
 * - W_IQ2XXS, W_IQ2XS, W_IQ2S, W_IQ3XXS, W_IQ3S, W_IQ1S, W_IQ1M: GGML's grid i-quants, the
 *   same way ([n, k / 256] blocks of 66, 74, 82, 98, 110, 50 and 56 bytes).
 * - W_GF16, W_GBF16: GGML's F16 and BF16 matrices as a GGUF stores them, [n, k] row-major
 *   halves (k a multiple of 32): each value widened exactly; products compute float32 sums,
 *   made into panels a block at a time where the build has half panels (a decode step's rows:
 *   by rows), no float32 beside them. */
enum { W_F32 = 0, W_F16 = 1, W_BF16 = 2, W_AFFINE = 3, W_Q6K = 4, W_Q4K = 5, W_Q5K = 6, W_Q3K = 7, W_Q2K = 8,
       W_IQ4XS = 9, W_IQ4NL = 10, W_IQ2XXS = 11, W_IQ2XS = 12, W_IQ2S = 13, W_IQ3XXS = 14, W_IQ3S = 15,
       W_IQ1S = 16, W_IQ1M = 17,
       /* a scale format only (W_AFFINE's mxfp4 mode): a byte e a scale, 2^(e - 127) */
       W_E8M0 = 18,
       W_GF16 = 19, W_GBF16 = 20 };

/* One product's W [n, k]. */
struct step_weight {
    int format; /* W_F32, W_F16, W_BF16, W_AFFINE, or a GGML format (W_Q6K .. W_IQ1M, W_GF16, W_GBF16) */
    int bits, group, scale_format; /* W_AFFINE: 2-6 or 8; 32, 64 or 128; W_F32/F16/BF16/E8M0 */
    const void *data;             /* in `format` (W_F16 / W_BF16: panels) */
    const void *scales, *biases;  /* W_AFFINE: [n, k / group] in `scale_format` (mxfp4: no biases) */
    /* NULL, or W in float32 (the source of an exact half copy), which a product of more rows
     * than the tiles take goes to the BLAS with (products.c: to_blas) */
    const float *f32;
};

/* A layer's sparse mixture of experts in place of its gated MLP (Qwen3-MoE's, as mlx-lm's
 * Qwen3MoeSparseMoeBlock computes it), for each token's normed h:
 *   p = softmax(h Wr^T) over the `count` experts ; its `top_k` largest ;
 *   (norm_topk) those p divided by their sum ;
 *   out = the sum over them of p_e * (act(h Wg_e^T) * h Wu_e^T) Wd_e^T
 * (gpt-oss's, as mlx-lm's gpt_oss MLPBlock computes it: the router's logits plus its bias,
 * the softmax of the top_k of them, which is norm_topk's; each product plus its expert's
 * bias, the gate's before the activation; its clamped SwiGLU, ACT_SWIGLU_OAI)
 * Expert e's gate and up weights [intermediate, hidden] are `gate` and `up` with `data`
 * (and `f32`) `e * gate_up_stride[0]` bytes further and `scales` / `biases`
 * `e * gate_up_stride[1]` bytes further; its down weight [hidden, intermediate] is `down`
 * moved by `down_stride` the same way: the switch layers' stacked arrays, read in place. */
struct step_experts {
    int count, top_k, norm_topk, intermediate;
    struct step_weight router; /* [count, hidden] */
    struct step_weight gate, up, down;
    long gate_up_stride[2], down_stride[2];
    /* NULL: none; else float32 [count], and per expert [count, intermediate] (gate, up) and
     * [count, hidden] (down), added to the products */
    const float *router_bias, *gate_bias, *up_bias, *down_bias;
};

struct step_layer {
    const float *input_norm;
    const float *q_bias, *k_bias, *v_bias, *o_bias; /* NULL: none */
    const float *q_norm, *k_norm;                   /* NULL: none (Llama); [head_dim] */
    const float *post_norm;                         /* the MLP's input norm */
    /* NULL: none; else the norm of the attention's / the MLP's output before it is added to
     * the residual (Gemma's post-attention and post-feedforward norms) */
    const float *attn_out_norm, *mlp_out_norm;
    struct step_weight q, k, v, o, gate, up, down;
    int rope_table; /* which of step_args' rotary tables rotates this layer's q and k */
    /* NULL: the gated MLP of gate, up and down (step_args' `intermediate`); else the layer's
     * experts, and gate, up, down are not read */
    const struct step_experts *experts;
    /* NULL: none; else [heads]: each head's sink, a logit beside its scaled scores in the
     * softmax's denominator that weighs no value (gpt-oss) */
    const float *sinks;
};

/* The gated MLP's activation of its gate (step_args' `activation`): SiLU (SwiGLU), or GELU
 * with tanh's approximation as MLX's gelu_approx computes it (Gemma), or gpt-oss's clamped
 * SwiGLU as mlx-lm's swiglu_oai computes it: with g' = min(g, limit), the product is
 * (clip(u, -limit, limit) + 1) * g' * sigmoid(alpha g') (step_args' act_alpha, act_limit). */
enum { ACT_SILU = 0, ACT_GELU_TANH = 1, ACT_SWIGLU_OAI = 2 };

struct step_cache {
    /* [kv_heads, capacity, head_dim]: head h at h * head_stride; row i holds position
     * start + i, for positions [start, offset) */
    const float *keys, *values;
    long head_stride;
    int start;
    /* 0: full causal attention; else a sliding window: the query at position p sees the
     * positions (p - window, p] (transformers' and mlx-lm's windows; `start` may then skip
     * the positions no query of the step sees) */
    int window;
    /* NULL, or where this step's keys and values go (one row: keys + offset * head_dim,
     * same head stride), written after they are computed (the attention reads only the
     * positions below them) */
    float *append_keys, *append_values;
    /* 0, or the positions' rows in two runs (a ring that has wrapped): rows [0, wrap) of
     * `keys` / `values` hold positions [start, start + wrap), rows from 0 of `keys2` /
     * `values2` (the same head stride) the rest, [start + wrap, offset) */
    int wrap;
    const float *keys2, *values2;
};

struct step_args {
    int batch, tokens, hidden, heads, kv_heads, head_dim, intermediate, layers, offset, rope_dims;
    int activation; /* ACT_SILU, ACT_GELU_TANH or ACT_SWIGLU_OAI */
    float eps, scale;
    float act_alpha, act_limit; /* ACT_SWIGLU_OAI's */
    /* 0: none; else attention scores are soft-capped, cap * tanh(q.k * scale / cap), before
     * the softmax (Gemma2) */
    float softcap;
    /* [tables][tokens, rope_dims]: [cos, cos] and [-sin, sin] (rotate-half), a table per
     * rotary embedding the layers use (step_layer's `rope_table`) */
    const float *cos, *sin;
    /* NULL: none; else [tokens]: token t's queries are multiplied by query_scale[t] after
     * their rotation (Ministral3's scale by position) */
    const float *query_scale;
    const struct step_layer *layer;
    const struct step_cache *cache; /* per layer; unread when offset is 0 */
    const float *final_norm;
    float *x;                       /* [batch, tokens, hidden]: embeddings in, final hidden out */
    float *new_keys, *new_values;   /* [layers, batch, kv_heads, tokens, head_dim] out */
    float *scratch;                 /* runner_step_scratch_floats() floats */
    /* 1: a decode step (each row a sequence's next token): its GGML block products, and
     * its 5-bit W_AFFINE ones, take A's values as integer limbs where the build has them
     * (runner_limb_products; quantized.c: within ~1e-6 of sum |w x|, not the float tiles'
     * bits); 0: every product in float32 */
    int decode;
};

/* The ABI version (RUNNER_NATIVE_ABI_VERSION); also what tells the runner the library is
 * preloaded in its process (runner/native/preload.py). */
RUNNER_API int runner_native_abi_version(void);
/* Field `index` of struct `type` ("step_weight", "step_layer", "step_cache", "step_args"):
 * its name and offset, returning 1; with index -1 the struct's size in *offset; 0 past the
 * last field or for an unknown type. */
RUNNER_API int runner_native_field(const char *type, int index, const char **name, long *offset);
/* The instruction-set path this build computes with (internal.h chooses it at compile time
 * from -march): "avx512" (256-bit tiles, half panels and 512-bit wide panel tiles), "avx2"
 * (256-bit tiles, half panels: AVX2 + F16C), "avx" (256-bit tiles), "sse", "neon" or
 * "generic" (128-bit vectors, no half panels). */
RUNNER_API const char *runner_native_level(void);

/* Which decode steps' products take limbs here (quantized.c), as flags: 1, the GGML block formats
 * (AVX512-VNNI, or AVX2); 2, 5-bit W_AFFINE codes in groups of 32, 64 or 128 (VNNI and VBMI,
 * or AVX2); 0: none (they take the float tiles, the same bits as any other product). */
RUNNER_API int runner_limb_products(void);
/* Whether a forward's products from GGML Q4_K and Q5_K blocks take Intel's AMX tiles here (amx.c:
 * a build with AMX-INT8 and AVX512-VNNI, on a machine that runs them, not turned off by
 * OLLAMA_MLX_RUNNER_AMX=0): 1 or 0. `set` 0 turns them off, 1 back on where they run, -1
 * asks. */
RUNNER_API int runner_amx_products(int set);
/* Which half formats products can read here: 1 when they can (AVX2 + F16C), else 0. */
RUNNER_API int runner_half_weights(void);
/* The panels of W [n, k] in a half format: this many halves. */
RUNNER_API long runner_panel_halves(int n, int k);
/* dst = the panels of src [n, k] in `format` (W_F16 or W_BF16) when that holds every one of
 * its values exactly (bit for bit back in float32): returns 1; else 0, dst undefined. */
RUNNER_API int runner_narrow_panels(const float *src, int n, int k, unsigned short *dst,
                                    int format);
/* C[m, n] = A[m, k] W[n, k]^T (a head: W_F32, an exact half copy, W_AFFINE or a GGML block format); 0, or -1
 * for arguments it cannot take (runner_weight_supported). `decode`: A's rows are a decode
 * step's (step_args' `decode`: by limbs where the build has them, runner_limb_products). */
RUNNER_API int runner_weight_product(int m, int n, int k, const float *a,
                                     const struct step_weight *w, float *c, int decode);
/* 1 when products can read `w` as a weight [n, k] (its format, bits, group and scale
 * format, k a multiple of its group), else 0. */
RUNNER_API int runner_weight_supported(const struct step_weight *w, int n, int k);

/* Floats of scratch memory runner_decoder_step needs for `a`. */
RUNNER_API long runner_step_scratch_floats(const struct step_args *a);
/* The decoder layers for `a` (decoder_step.c); 0, or -1 for arguments it cannot take. */
RUNNER_API int runner_decoder_step(const struct step_args *a);

/* FNV-1a 64 of n bytes from h: the image fold of runner/media/prepare.py (Go's foldValue). */
RUNNER_API unsigned long long runner_fnv1a64(const unsigned char *data, size_t n,
                                             unsigned long long h);

/* MLX's float32 products (dispatch.c): the library is preloaded ahead of the BLAS. */
RUNNER_API void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                            const float *a, int lda, const float *b, int ldb, float beta,
                            float *c, int ldc);

#endif
