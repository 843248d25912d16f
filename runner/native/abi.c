/*
 * The ABI handshake (runner_native.h): the version, and every exported struct's size and its
 * fields' names and offsets, which runner/native/abi.py compares with its ctypes mirror.
 */
#include "internal.h"

int runner_native_abi_version(void) { return RUNNER_NATIVE_ABI_VERSION; }

const char *runner_native_level(void) {
#if WIDE_PANELS
    return "avx512";
#elif HALF_WEIGHTS
    return "avx2";
#elif defined(__AVX__)
    return "avx";
#elif defined(__SSE2__)
    return "sse";
#elif defined(__ARM_NEON)
    return "neon";
#else
    return "generic";
#endif
}

struct field {
    const char *name;
    long offset;
};
#define FIELD(S, F) {#F, (long)offsetof(struct S, F)}

static const struct field step_weight_fields[] = {
    FIELD(step_weight, format), FIELD(step_weight, bits), FIELD(step_weight, group),
    FIELD(step_weight, scale_format), FIELD(step_weight, data), FIELD(step_weight, scales),
    FIELD(step_weight, biases), FIELD(step_weight, f32),
};
static const struct field step_layer_fields[] = {
    FIELD(step_layer, input_norm), FIELD(step_layer, q_bias), FIELD(step_layer, k_bias),
    FIELD(step_layer, v_bias), FIELD(step_layer, o_bias), FIELD(step_layer, q_norm),
    FIELD(step_layer, k_norm), FIELD(step_layer, post_norm), FIELD(step_layer, attn_out_norm),
    FIELD(step_layer, mlp_out_norm), FIELD(step_layer, q), FIELD(step_layer, k),
    FIELD(step_layer, v), FIELD(step_layer, o), FIELD(step_layer, gate), FIELD(step_layer, up),
    FIELD(step_layer, down), FIELD(step_layer, rope_table), FIELD(step_layer, experts),
    FIELD(step_layer, sinks),
};
static const struct field step_experts_fields[] = {
    FIELD(step_experts, count), FIELD(step_experts, top_k), FIELD(step_experts, norm_topk),
    FIELD(step_experts, intermediate), FIELD(step_experts, router), FIELD(step_experts, gate),
    FIELD(step_experts, up), FIELD(step_experts, down), FIELD(step_experts, gate_up_stride),
    FIELD(step_experts, down_stride), FIELD(step_experts, router_bias),
    FIELD(step_experts, gate_bias), FIELD(step_experts, up_bias), FIELD(step_experts, down_bias),
};
static const struct field step_cache_fields[] = {
    FIELD(step_cache, keys), FIELD(step_cache, values), FIELD(step_cache, head_stride),
    FIELD(step_cache, start), FIELD(step_cache, window), FIELD(step_cache, append_keys),
    FIELD(step_cache, append_values), FIELD(step_cache, wrap), FIELD(step_cache, keys2),
    FIELD(step_cache, values2),
};
static const struct field step_args_fields[] = {
    FIELD(step_args, batch), FIELD(step_args, tokens), FIELD(step_args, hidden),
    FIELD(step_args, heads), FIELD(step_args, kv_heads), FIELD(step_args, head_dim),
    FIELD(step_args, intermediate), FIELD(step_args, layers), FIELD(step_args, offset),
    FIELD(step_args, rope_dims), FIELD(step_args, activation), FIELD(step_args, eps),
    FIELD(step_args, scale), FIELD(step_args, act_alpha), FIELD(step_args, act_limit),
    FIELD(step_args, softcap), FIELD(step_args, cos),
    FIELD(step_args, sin), FIELD(step_args, query_scale),
    FIELD(step_args, layer), FIELD(step_args, cache), FIELD(step_args, final_norm),
    FIELD(step_args, x), FIELD(step_args, new_keys), FIELD(step_args, new_values),
    FIELD(step_args, scratch),
    FIELD(step_args, decode),
};

#define TABLE(S) {#S, S##_fields, sizeof(S##_fields) / sizeof(S##_fields[0]), sizeof(struct S)}
static const struct {
    const char *type;
    const struct field *fields;
    size_t count, size;
} tables[] = {TABLE(step_weight), TABLE(step_experts), TABLE(step_layer), TABLE(step_cache),
              TABLE(step_args)};

int runner_native_field(const char *type, int index, const char **name, long *offset) {
    for (size_t t = 0; t < sizeof(tables) / sizeof(tables[0]); t++) {
        if (strcmp(tables[t].type, type) != 0) continue;
        if (index == -1) {
            *offset = (long)tables[t].size;
            return 1;
        }
        if (index < 0 || (size_t)index >= tables[t].count) return 0;
        *name = tables[t].fields[index].name;
        *offset = tables[t].fields[index].offset;
        return 1;
    }
    return 0;
}
