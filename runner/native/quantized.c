/*
 * Products from MLX's affine-quantized weights (W_AFFINE, runner_native.h), read as MLX stores
 * them: the codes packed in uint32 words, a scale and a bias per group of a row. No float copy
 * of W is ever made: each tile unpacks the codes it reads into float32 weights in registers.
 *
 * Numbers. The weight a code q stands for is MLX's dequantized value in float32,
 * w = (scale * q) + bias with each operation rounded to float32 (what mx.dequantize computes
 * from float32 scales, and what MLX's quantized_matmul multiplies with a float32 input). Every
 * value of C is the float32 sum over k of a[t] * w[t] in one fixed order, whatever the number
 * of rows and whichever tile computes it: lane l of a QL-lane accumulator takes the products
 * of the positions the format's unpacking puts in lane l (below: `unit`), one fused
 * multiply-add each, in order of k; then the QL lanes are summed by halving (lane l plus lane
 * l + QL/2, until one is left: `lanes_sum`). Only the build (its QL) changes the order.
 *
 * Units: the codes are unpacked a unit at a time, QL values (2, 3, 5, 6 and 8 bits; natural
 * order: lane l holds position t0 + l) or 2 QL (4 bits: the unit's bytes widened one to a lane, the
 * low nibbles, positions t0 + 2l, making the first vector and the high ones, t0 + 2l + 1, the
 * second). A's rows are read in the same order: for 4 bits the caller copies them into it
 * once per product (affine_rows), so a tile reads both operands as plain vectors.
 *
 * Dequantizing: with AVX-512, 2-, 3-, 4- and 5-bit codes index a table of the group's 4 to 32
 * dequantized values held in one or two registers (vpermps / vpermt2ps: one instruction for
 * 16 weights, the table computed once a group with the same two roundings; 2 and 3 bits
 * repeat it over the 16 entries), as 2- and 3-bit codes do on AVX2 (a table of 8); 6- and
 * 8-bit codes, and 4 and 5 bits on AVX2, are converted and scaled (cvtdq2ps, mul, add);
 * elsewhere one value at a time, in the same order.
 *
 * Tiles. Few rows (decode, a few rows of a forward: STREAM_ROWS) take stream tiles: STREAM_RW
 * rows of W unpacked in registers against one or two rows of A, W read once from memory.
 * More rows take block tiles: BLOCK_RW rows of W dequantized into a buffer of the thread's
 * (a few KB, in L1/L2: never the matrix), then dot products of RA x BLOCK_RW against every row
 * of A in a chunk of rows that fits L2, the dequantizing paid once per chunk.
 */
#include "internal.h"

#include <unistd.h>

/* The tiles' vectors: 512-bit with AVX-512 (F and BW), 256-bit with AVX2 and FMA, else the
 * library's (128-bit, or 256-bit with AVX alone). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QBYTES 64
#define QPATH 512
#define QPIN(v) __asm__("" : "+v"(v))
#elif defined(__AVX2__) && defined(__FMA__)
#define QBYTES 32
#define QPATH 256
#define QPIN(v) __asm__("" : "+x"(v))
#else
#define QBYTES VBYTES
#define QPATH 0
#define QPIN(v) PIN(v)
#endif
enum { QL = QBYTES / 4 };
typedef float qv __attribute__((vector_size(QBYTES)));
typedef float qv_unaligned __attribute__((vector_size(QBYTES), aligned(4), may_alias));

#define ALWAYS static inline __attribute__((always_inline))

ALWAYS qv qload(const float *p) { return *(const qv_unaligned *)p; }

/* *p in every lane, as it is (one broadcast from memory: `(qv){0} + *p` compiles to a scalar
 * add of +0, which turns -0 into +0, then the broadcast: two instructions where the tiles make
 * a table or a scale every 32 weights). */
ALWAYS qv qsplat_at(const float *p) {
#if QPATH == 512
    return (qv)_mm512_set1_ps(*p);
#elif QPATH == 256
    return (qv)_mm256_broadcast_ss(p);
#else
    qv v;
    for (int l = 0; l < QL; l++) v[l] = *p;
    return v;
#endif
}
ALWAYS void qstore(float *p, qv v) { *(qv_unaligned *)p = v; }

/* A float kept from being fused with the operation that follows it (the dequantizing rounds
 * the product and the sum each: -ffp-contract=fast would make them one FMA). */
#if defined(__x86_64__) || defined(__i386__)
#define FPIN(f) __asm__("" : "+x"(f))
#elif defined(__aarch64__)
#define FPIN(f) __asm__("" : "+w"(f))
#else
#define FPIN(f) do { volatile float pinned_ = (f); (f) = pinned_; } while (0)
#endif

/* --- scales, codes, values: one at a time --------------------------------------------------- */

static inline float half_to_float(unsigned short h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    unsigned sign = (unsigned)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0x1f)
        bits = sign | 0x7f800000u | (man << 13);
    else if (exp)
        bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man)
        bits = sign;
    else { /* subnormal: normalised */
        unsigned e = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* An e8m0 scale (MLX's mxfp4 mode): 2^(e - 127) exactly (e = 0: 2^-127, subnormal; e = 255:
 * infinity, which MLX's dequantization meets as its NaN and infinities too). */
static inline float e8m0_to_float(unsigned char e) {
    const unsigned bits = e ? (unsigned)e << 23 : 0x00400000u;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Scale (or bias) i of an array in `format` (W_F32, W_F16, W_BF16, W_E8M0), widened exactly. */
static inline float scale_at(const void *base, int format, size_t i) {
    if (format == W_E8M0) return e8m0_to_float(((const unsigned char *)base)[i]);
    if (format == W_F16) return half_to_float(((const unsigned short *)base)[i]);
    if (format == W_BF16) {
        const unsigned bits = (unsigned)((const unsigned short *)base)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)base)[i];
}

/* Code t of a row (a little-endian bit stream of `bits`-bit codes), reading no byte past it. */
static inline unsigned code_at(const unsigned char *row, int bits, size_t t) {
    const size_t bit = t * bits, byte = bit / 8;
    const int shift = (int)(bit % 8);
    unsigned v = (unsigned)row[byte] >> shift;
    if (shift + bits > 8) v |= (unsigned)row[byte + 1] << (8 - shift);
    return v & ((1u << bits) - 1);
}

/* MLX's dequantized value: the product rounded, then the sum. */
static inline float dequantized(float scale, unsigned q, float bias) {
    float p = scale * (float)q;
    FPIN(p);
    return p + bias;
}

/* Scales (or biases) [i0, i0 + n) of an array in `format` as float32: the array itself when it
 * is float32, else widened into `out`. A tile widens its rows' scales once (16 a vector), not
 * one at a time for each group. */
static const float *float_scales(const void *base, int format, size_t i0, int n, float *out) {
    if (format == W_F32) return (const float *)base + i0;
    if (format == W_E8M0) {
        for (int i = 0; i < n; i++) out[i] = e8m0_to_float(((const unsigned char *)base)[i0 + i]);
        return out;
    }
    const unsigned short *h = (const unsigned short *)base + i0;
    int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    for (; i < n; i += 16) { /* the last vector masked */
        const __mmask16 mask = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m256i x = _mm256_maskz_loadu_epi16(mask, h + i);
        const __m512 y = format == W_F16 ? _mm512_cvtph_ps(x)
                                         : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
        _mm512_mask_storeu_ps(out + i, mask, y);
    }
#elif defined(__AVX2__) && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(h + i));
        const __m256 y = format == W_F16 ? _mm256_cvtph_ps(x)
                                         : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
        _mm256_storeu_ps(out + i, y);
    }
#endif
    (void)h; /* read by the vector loops above, where the build has them */
    for (; i < n; i++) out[i] = scale_at(base, format, i0 + i);
    return out;
}

/* MLX's mxfp4 mode (W_AFFINE with scale_format W_E8M0): 4-bit e2m1 codes, packed as the
 * affine 4-bit codes are, worth e2m1[q] * 2^(e - 127) (exact in float32, as MLX's dequantized
 * value), a scale a group of 32 and no bias. FP4 stands for it where the tiles take `bits`
 * (a constant in each instance, as 2, 3, 4, 5, 6 and 8 are); CODE_BITS is its codes' width. */
enum { FP4 = 36 };
#define CODE_BITS(bits) ((bits) == FP4 ? 4 : (bits))
/* Widths whose codes straddle bytes (2, 3, 5, 6 bits): a unit's codes are gathered by a byte
 * shuffle, each lane's code from the 4 bytes at bit bits * l, shifted right by its offset in
 * the first (mlx-community's 3- and 6-bit conversions and its mixed 3/6-bit recipes). */
#define PACKED(bits) ((bits) == 2 || (bits) == 3 || (bits) == 5 || (bits) == 6)
static const float e2m1[16] __attribute__((aligned(64))) = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* Values per unit, and the position (from the unit's first) of lane l of vector v. */
#define UNIT(bits) (CODE_BITS(bits) == 4 ? 2 * QL : QL)
static inline int lane_position(int bits, int v, int l) { return CODE_BITS(bits) == 4 ? 2 * l + v : l; }

/* --- units: a group's constants, a unit's codes, its vectors of values ------------------------ */

/* What a tile keeps for a (row, group): a table of the dequantized values of every code (4 and
 * 5 bits with AVX-512: t0 codes 0-15, t1 16-31), or the scale and bias in every lane. */
struct qgroup {
    qv t0, t1;
};

#if QPATH == 512

ALWAYS struct qgroup group_of(const int bits, const float *scale, const float *bias) {
    const qv low = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const qv s = qsplat_at(scale);
    struct qgroup g;
    if (bits == FP4) { /* e2m1 times a power of two: exact; no bias (`bias` is not read) */
        g.t0 = qload(e2m1) * s;
        g.t1 = g.t0;
        return g;
    }
    const qv b = qsplat_at(bias);
    if (bits == 8 || bits == 6) {
        g.t0 = s;
        g.t1 = b;
        return g;
    }
    /* 2 and 3 bits: the table repeats every 4 (8) codes, so the bits above a lane's code that
     * vpermps reads (its low 4) pick the same value */
    const qv codes = bits == 2 ? (qv){0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3}
                     : bits == 3 ? (qv){0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7}
                                 : low;
    qv p = codes * s;
    QPIN(p);
    g.t0 = p + b;
    if (bits == 5) {
        qv p1 = (low + 16.0f) * s;
        QPIN(p1);
        g.t1 = p1 + b;
    } else {
        g.t1 = g.t0;
    }
    return g;
}

typedef __m512i qraw;

/* lane l of a PACKED unit: the 4 bytes from byte bits * l / 8 of its 2 * bits (each 128-bit
 * lane of the register holds the unit's first 16), shifted right by bits * l % 8 */
#define PB(bits, l) ((bits) * (l) / 8)
#define PC(bits, l) PB(bits, l), PB(bits, l) + 1, PB(bits, l) + 2, PB(bits, l) + 3
#define PC4(bits, l) PC(bits, l), PC(bits, l + 1), PC(bits, l + 2), PC(bits, l + 3)
#define PCTRL(bits) {PC4(bits, 0), PC4(bits, 4), PC4(bits, 8), PC4(bits, 12)}
#define PS(bits, l) (bits) * (l) % 8
#define PS4(bits, l) PS(bits, l), PS(bits, l + 1), PS(bits, l + 2), PS(bits, l + 3)
#define PSHIFTS(bits) {PS4(bits, 0), PS4(bits, 4), PS4(bits, 8), PS4(bits, 12)}
static const char packed_ctrl[7][64] __attribute__((aligned(64))) = {
    [2] = PCTRL(2), [3] = PCTRL(3), [5] = PCTRL(5), [6] = PCTRL(6)};
static const int packed_shifts[7][16] __attribute__((aligned(64))) = {
    [2] = PSHIFTS(2), [3] = PSHIFTS(3), [5] = PSHIFTS(5), [6] = PSHIFTS(6)};

/* The codes of the unit that starts at position t of a row. PACKED units read 16 bytes, up
 * to 12 past their 2 * bits (columns_of reads the matrix's last row from a padded copy); a
 * lane's bits above its code are the next codes' (2, 3 and 5 bits: the tables repeat over
 * them; 6: masked). */
ALWAYS qraw unit_load(const int bits, const unsigned char *row, size_t t) {
    if (PACKED(bits)) {
        const __m512i x = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + t * bits / 8)));
        const __m512i codes = _mm512_srlv_epi32(_mm512_shuffle_epi8(x, _mm512_load_si512(packed_ctrl[bits])),
                                                _mm512_load_si512(packed_shifts[bits]));
        return bits == 6 ? _mm512_and_si512(codes, _mm512_set1_epi32(63)) : codes;
    }
    /* 4 bits: 16 bytes, each byte's two codes; 8 bits: 16 codes */
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + t * CODE_BITS(bits) / 8)));
}

ALWAYS qv unit_values(const int bits, qraw raw, int v, const struct qgroup *g) {
    if (CODE_BITS(bits) == 4) /* vpermps reads the low 4 bits of each lane: the low nibble, then the high */
        return (qv)_mm512_permutexvar_ps(v ? _mm512_srli_epi32(raw, 4) : raw, (__m512)g->t0);
    if (bits == 2 || bits == 3) /* the low 4 bits: the code, and what the table repeats over */
        return (qv)_mm512_permutexvar_ps(raw, (__m512)g->t0);
    if (bits == 5) /* the low 5 bits: t0 for 0-15, t1 for 16-31 */
        return (qv)_mm512_permutex2var_ps((__m512)g->t0, raw, (__m512)g->t1);
    qv p = (qv)_mm512_cvtepi32_ps(raw) * g->t0;
    QPIN(p);
    return p + g->t1;
}

#elif QPATH == 256

/* FP4: t0 the magnitudes e2m1[0 .. 8) times the scale, its codes' bit 3 their sign; 2 and 3
 * bits: t0 a table of the group's values (2 bits: repeated, vpermps reading a lane's low 3
 * bits); else the scale and the bias. */
ALWAYS struct qgroup group_of(const int bits, const float *scale, const float *bias) {
    if (bits == FP4) return (struct qgroup){qload(e2m1) * qsplat_at(scale), (qv){0}};
    if (bits == 2 || bits == 3) {
        qv p = (bits == 2 ? (qv){0, 1, 2, 3, 0, 1, 2, 3} : (qv){0, 1, 2, 3, 4, 5, 6, 7}) * qsplat_at(scale);
        QPIN(p);
        return (struct qgroup){p + qsplat_at(bias), (qv){0}};
    }
    return (struct qgroup){qsplat_at(scale), qsplat_at(bias)};
}

typedef __m256i qraw;

#define PB(bits, l) ((bits) * (l) / 8)
#define PC(bits, l) PB(bits, l), PB(bits, l) + 1, PB(bits, l) + 2, PB(bits, l) + 3
#define PS(bits, l) (bits) * (l) % 8

/* PACKED units read 8 bytes, up to 6 past their `bits` (see the 512-bit unit_load; each
 * 128-bit half holds the 8 bytes twice, so a lane's 4th byte may be the unit's first again:
 * above its code, masked or repeated over). */
ALWAYS qraw unit_load(const int bits, const unsigned char *row, size_t t) {
    if (PACKED(bits)) {
        const __m256i ctrl = _mm256_setr_epi8(PC(bits, 0), PC(bits, 1), PC(bits, 2), PC(bits, 3),
                                              PC(bits, 4), PC(bits, 5), PC(bits, 6), PC(bits, 7));
        const __m256i shifts = _mm256_setr_epi32(PS(bits, 0), PS(bits, 1), PS(bits, 2), PS(bits, 3),
                                                 PS(bits, 4), PS(bits, 5), PS(bits, 6), PS(bits, 7));
        const __m256i x = _mm256_broadcastq_epi64(_mm_loadl_epi64((const __m128i *)(row + t * bits / 8)));
        const __m256i codes = _mm256_srlv_epi32(_mm256_shuffle_epi8(x, ctrl), shifts);
        return bits == 2 || bits == 3 ? codes : _mm256_and_si256(codes, _mm256_set1_epi32((1 << bits) - 1));
    }
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + t * CODE_BITS(bits) / 8)));
}

ALWAYS qv unit_values(const int bits, qraw raw, int v, const struct qgroup *g) {
    if (bits == FP4) { /* vpermps reads a lane's low 3 bits: the magnitude; bit 3 the sign */
        const __m256i q = v ? _mm256_srli_epi32(raw, 4) : raw;
        const __m256 magnitude = _mm256_permutevar8x32_ps((__m256)g->t0, q);
        const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(8)), 28);
        return (qv)_mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
    }
    if (bits == 2 || bits == 3) /* vpermps reads a lane's low 3 bits */
        return (qv)_mm256_permutevar8x32_ps((__m256)g->t0, raw);
    if (bits == 4)
        raw = v ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, _mm256_set1_epi32(15));
    qv p = (qv)_mm256_cvtepi32_ps(raw) * g->t0;
    QPIN(p);
    return p + g->t1;
}

#else /* one value at a time */

ALWAYS struct qgroup group_of(const int bits, const float *scale, const float *bias) {
    return (struct qgroup){qsplat_at(scale), bits == FP4 ? (qv){0} : qsplat_at(bias)};
}

typedef struct {
    const unsigned char *row;
    size_t t;
    int bits;
} qraw;

ALWAYS qraw unit_load(const int bits, const unsigned char *row, size_t t) {
    return (qraw){row, t, bits};
}

ALWAYS qv unit_values(const int bits, qraw raw, int v, const struct qgroup *g) {
    float out[QL];
    for (int l = 0; l < QL; l++) {
        const unsigned q = code_at(raw.row, CODE_BITS(bits), raw.t + lane_position(bits, v, l));
        out[l] = bits == FP4 ? e2m1[q] * g->t0[0] : dequantized(g->t0[0], q, g->t1[0]);
    }
    return qload(out);
}

#endif

/* Whether unit_load reads past a unit's bytes (then the matrix's last row is read from a
 * padded copy), and how far at most. */
static inline int overread(int bits) { return QPATH && PACKED(bits) ? 16 : 0; }

/* --- sums --------------------------------------------------------------------------------- */

/* The sum of a vector's lanes by halving: lane l plus lane l + QL/2, until one is left. The
 * order every value of C is summed in (with the lanes' own sums before it). */
ALWAYS float lanes_sum(qv v) {
    float t[QL];
    memcpy(t, &v, sizeof t);
    _Pragma("GCC unroll 8") for (int w = QL / 2; w >= 1; w /= 2)
        _Pragma("GCC unroll 8") for (int l = 0; l < w; l++) t[l] = t[l] + t[l + w];
    return t[0];
}

/* out[0..3] = lanes_sum of a, b, c, d: the same additions, four sums in each instruction. */
ALWAYS void lanes_sum4(float *out, qv a, qv b, qv c, qv d) {
#if QPATH == 512
    const __m512 A = (__m512)a, B = (__m512)b, C = (__m512)c, D = (__m512)d;
    /* lanes l + 8: [a, b] and [c, d] halves */
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, 0x44), _mm512_shuffle_f32x4(A, B, 0xee));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(C, D, 0x44), _mm512_shuffle_f32x4(C, D, 0xee));
    /* lanes l + 4: a, b, c, d's 4 lanes each */
    __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4e)); /* lanes l + 2 */
    x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xb1)); /* lane l + 1 */
    const __m512i at = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(at, x)));
#elif QPATH == 256
    const __m256 A = (__m256)a, B = (__m256)b, C = (__m256)c, D = (__m256)d;
    /* lanes l + 4: [a, b] and [c, d] halves */
    const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(A, B, 0x20), _mm256_permute2f128_ps(A, B, 0x31));
    const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(C, D, 0x20), _mm256_permute2f128_ps(C, D, 0x31));
    /* lanes l + 2, then l + 1, within each half; then the four sums gathered */
    __m256 x = _mm256_add_ps(ab, _mm256_permute_ps(ab, 0x4e)), y = _mm256_add_ps(cd, _mm256_permute_ps(cd, 0x4e));
    x = _mm256_add_ps(x, _mm256_permute_ps(x, 0xb1));
    y = _mm256_add_ps(y, _mm256_permute_ps(y, 0xb1));
    /* x: a's sum in lane 0, b's in lane 4; y: c's, d's */
    const __m256 xy = _mm256_shuffle_ps(x, y, 0x00); /* [a, a, c, c | b, b, d, d] */
    out[0] = _mm256_cvtss_f32(xy);
    out[1] = _mm_cvtss_f32(_mm256_extractf128_ps(xy, 1));
    out[2] = xy[2];
    out[3] = xy[6];
#else
    out[0] = lanes_sum(a);
    out[1] = lanes_sum(b);
    out[2] = lanes_sum(c);
    out[3] = lanes_sum(d);
#endif
}

/* dot[q] = lanes_sum(acc[q]) for q < n (a multiple of 4). */
ALWAYS void sums(float *dot, const qv *acc, const int n) {
    _Pragma("GCC unroll 8") for (int q = 0; q < n; q += 4)
        lanes_sum4(dot + q, acc[q], acc[q + 1], acc[q + 2], acc[q + 3]);
}

/* --- stream tiles: W unpacked in registers ------------------------------------------------- */

/* Few rows: at most STREAM_ROWS rows of A take stream tiles (one or two rows of A against
 * STREAM_RW rows of W); more take block tiles. */
enum { STREAM_ROWS = 2 };
#if QPATH == 512
enum { STREAM_RW = 8 };
#else
enum { STREAM_RW = 4 };
#endif
_Static_assert(STREAM_RW % 4 == 0, "sums are taken 4 at a time");
_Static_assert(STREAM_RW >= 4, "a block tile's rows' scales fit where a stream tile's do");
/* Lines a stream tile prefetches a unit step: a block's lines over its steps are
 * STREAM_RW * bits * UNIT / 512, at most 2 (8 rows of 4-bit units of 32 or 8-bit ones of 16). */
enum { STREAM_FETCH = 2 };
enum { MAX_ACC = 2 * STREAM_RW > 24 ? 2 * STREAM_RW : 24 }; /* a tile's accumulators at most */

/* dot[i * RW + r] = row i of A (a[i]) . row r of W (codes rows[r], scales and biases as
 * float32 scale[r], bias[r]). */
ALWAYS void stream_tile(const int bits, const int RA, const int RW, const struct product *p,
                        const unsigned char *const *rows, const float *const *scale,
                        const float *const *bias, const float *const *a, float *dot,
                        const char *ahead, int lines) {
    const int k = p->k, G = p->group, U = UNIT(bits), V = CODE_BITS(bits) == 4 ? 2 : 1;
    /* `lines` cache lines from `ahead` prefetched, spread over the unit steps (16.16 fixed
     * point, as the panel tiles do; a line asked for twice is on its way already) */
    const char *fetch = ahead ? ahead : (const char *)rows[0];
    const unsigned long step = ahead ? ((unsigned long)lines << 16) / (unsigned)(k / U) : 0;
    unsigned long at = 0;
    /* fixed sizes (RA and RW are constants where this is inlined, but an array sized by them
     * would be a variable-length one, kept in memory) */
    qv acc[MAX_ACC], zero = {0};
    QPIN(zero);
    _Pragma("GCC unroll 16") for (int q = 0; q < RA * RW; q++) acc[q] = zero;
    for (int g0 = 0, g = 0; g0 < k; g0 += G, g++) {
        struct qgroup c[STREAM_RW];
        _Pragma("GCC unroll 8") for (int r = 0; r < RW; r++) c[r] = group_of(bits, scale[r] + g, bias[r] + g);
        for (int t = g0; t < g0 + G; t += U, at += step) {
            _Pragma("GCC unroll 2") for (int q = 0; q < STREAM_FETCH; q++)
                __builtin_prefetch(fetch + ((at >> 16) + q) * 64, 0, 3);
            qv x[4];
            _Pragma("GCC unroll 4") for (int i = 0; i < RA; i++)
                _Pragma("GCC unroll 2") for (int v = 0; v < V; v++) x[i * 2 + v] = qload(a[i] + t + v * QL);
            _Pragma("GCC unroll 8") for (int r = 0; r < RW; r++) {
                const qraw raw = unit_load(bits, rows[r], (size_t)t);
                _Pragma("GCC unroll 2") for (int v = 0; v < V; v++) {
                    const qv w = unit_values(bits, raw, v, &c[r]);
                    _Pragma("GCC unroll 4") for (int i = 0; i < RA; i++)
                        acc[i * RW + r] += x[i * 2 + v] * w;
                }
            }
        }
    }
    sums(dot, acc, RA * RW);
}

#define STREAM_TILE(BITS, RA)                                                                   \
    static void stream##RA##_##BITS(const struct product *p, const unsigned char *const *rows,  \
                                     const float *const *scale, const float *const *bias,       \
                                     const float *const *a, float *dot, const char *ahead,      \
                                     int lines) {                                               \
        stream_tile(BITS, RA, STREAM_RW, p, rows, scale, bias, a, dot, ahead, lines);           \
    }
STREAM_TILE(2, 1)
STREAM_TILE(2, 2)
STREAM_TILE(3, 1)
STREAM_TILE(3, 2)
STREAM_TILE(4, 1)
STREAM_TILE(4, 2)
STREAM_TILE(5, 1)
STREAM_TILE(5, 2)
STREAM_TILE(6, 1)
STREAM_TILE(6, 2)
STREAM_TILE(8, 1)
STREAM_TILE(8, 2)
STREAM_TILE(FP4, 1)
STREAM_TILE(FP4, 2)

/* f's instance for `bits` (FP4 for mxfp4) */
#define BY_BITS(bits, f)                                                                    \
    ((bits) == 2 ? f##_2 : (bits) == 3 ? f##_3 : (bits) == 4 ? f##_4 : (bits) == 5 ? f##_5 \
     : (bits) == 6 ? f##_6 : (bits) == 8 ? f##_8 : f##_FP4)

typedef void (*stream_fn)(const struct product *, const unsigned char *const *,
                          const float *const *, const float *const *, const float *const *, float *,
                          const char *, int);

/* --- block tiles: W dequantized into a buffer, dot products over many rows ------------------ */

/* Rows of A a block tile takes: as many as leave registers for one vector of W and their
 * accumulators (AVX2: 3 x 4 accumulators + 3 + 1 of 16 registers; measured on the AVX2 build:
 * 2 rows 1.38-1.41x the half panels' time, 3 rows 1.24-1.25x, 4 rows (spilled) 1.74-1.91x). */
#ifndef BLOCK_RA_
#if QPATH == 512
#define BLOCK_RA_ 4
#else
#define BLOCK_RA_ 3
#endif
#endif
enum { BLOCK_RW = 4, BLOCK_RA = BLOCK_RA_ };
/* Bytes of A's rows in a chunk: the chunk's rows stay in L2 while every block of W's rows
 * passes, each block dequantized once a chunk, so the more rows a chunk the less the
 * dequantizing costs: half the core's L2 where the C library says its size, never below 256
 * KB (Zen 4's 1 MB L2: 512 KB chunks prefill the Qwen3-0.6B shape's Q4_K_M and Q5_K_M files
 * 3-6% faster than 256 KB ones, 768 KB no faster; bench/RESULTS.md, "Q5_K in its blocks"). */
static long chunk_bytes(void) {
    static atomic_long bytes;
    long b = atomic_load_explicit(&bytes, memory_order_relaxed);
    if (!b) {
        b = 256L << 10;
#if defined(_SC_LEVEL2_CACHE_SIZE)
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
        if (l2 / 2 > b && l2 <= (64L << 20)) b = l2 / 2;
#endif
        atomic_store_explicit(&bytes, b, memory_order_relaxed);
    }
    return b;
}

/* Row `row` of W dequantized into out[k], in the tiles' order (units in order of k, each's
 * vectors in order). */
ALWAYS void dequantize_row(const int bits, const struct product *p, const unsigned char *row,
                           const float *scale, const float *bias, float *out) {
    const int k = p->k, G = p->group, U = UNIT(bits), V = CODE_BITS(bits) == 4 ? 2 : 1;
    for (int g0 = 0, g = 0; g0 < k; g0 += G, g++) {
        const struct qgroup c = group_of(bits, scale + g, bias + g);
        for (int t = g0; t < g0 + G; t += U) {
            const qraw raw = unit_load(bits, row, (size_t)t);
            _Pragma("GCC unroll 2") for (int v = 0; v < V; v++)
                qstore(out + t + v * QL, unit_values(bits, raw, v, &c));
        }
    }
}

#define DEQUANTIZE_ROW(BITS)                                                                   \
    static void dequantize_##BITS(const struct product *p, const unsigned char *row,          \
                                  const float *scale, const float *bias, float *out) {         \
        dequantize_row(BITS, p, row, scale, bias, out);                                        \
    }
DEQUANTIZE_ROW(2)
DEQUANTIZE_ROW(3)
DEQUANTIZE_ROW(4)
DEQUANTIZE_ROW(5)
DEQUANTIZE_ROW(6)
DEQUANTIZE_ROW(8)
DEQUANTIZE_ROW(FP4)

/* dot[i * RW + r] = a[i] . w[r] over k (both in the tiles' order): the same lanes, the same
 * order as the stream tiles. */
ALWAYS void block_tile(const int RA, const int RW, const float *const *a, const float *const *w,
                       int k, float *dot) {
    qv acc[MAX_ACC], zero = {0};
    QPIN(zero);
    _Pragma("GCC unroll 16") for (int q = 0; q < RA * RW; q++) acc[q] = zero;
    for (int t = 0; t < k; t += QL) {
        qv x[6];
        _Pragma("GCC unroll 8") for (int i = 0; i < RA; i++) {
            x[i] = qload(a[i] + t);
            QPIN(x[i]);
        }
        _Pragma("GCC unroll 8") for (int r = 0; r < RW; r++) {
            qv y = qload(w[r] + t);
            QPIN(y);
            _Pragma("GCC unroll 8") for (int i = 0; i < RA; i++) acc[i * RW + r] += x[i] * y;
        }
    }
    _Static_assert(BLOCK_RW % 4 == 0, "sums are taken 4 at a time");
    sums(dot, acc, RA * RW);
}

#define BLOCK_TILE(RA)                                                                          \
    static void block_##RA(const float *const *a, const float *const *w, int k, float *dot) {  \
        block_tile(RA, BLOCK_RW, a, w, k, dot);                                                 \
    }
BLOCK_TILE(1)
BLOCK_TILE(2)
BLOCK_TILE(3)
#if BLOCK_RA_ > 3
BLOCK_TILE(4)
#endif
#if BLOCK_RA_ > 4
BLOCK_TILE(5)
BLOCK_TILE(6)
#endif

typedef void (*block_fn)(const float *const *, const float *const *, int, float *);
static const block_fn block_tiles[BLOCK_RA + 1] = {
    NULL, block_1, block_2, block_3,
#if BLOCK_RA_ > 3
    block_4,
#endif
#if BLOCK_RA_ > 4
    block_5, block_6,
#endif
};

float *thread_buffer(int slot, size_t floats) {
    static __thread float *buffer[THREAD_BUFFERS];
    static __thread size_t size[THREAD_BUFFERS];
    if (floats > size[slot]) {
        free(buffer[slot]);
        buffer[slot] = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        size[slot] = buffer[slot] ? floats : 0;
        if (!buffer[slot]) abort();
    }
    return buffer[slot];
}

/* Fills w[r * k ...] with rows j .. j + nj - 1 of W dequantized (in the tiles' order). */
typedef void (*fill_fn)(const struct product *p, int j, int nj, float *w, const void *ctx);

/* Columns [j0, j1) of C by block tiles: BLOCK_RW rows of W at a time dequantized by `fill`
 * into a buffer of the thread's, then dot products against every row of A in chunks of rows
 * that fit L2 (each block of W dequantized once a chunk). `row_bytes`: a row of W as stored,
 * for the prefetches. */
static void block_columns(const struct product *p, int j0, int j1, size_t row_bytes,
                          fill_fn fill, const void *ctx) {
    const int k = p->k;
    const unsigned char *base = p->w;
    float dot[BLOCK_RA * BLOCK_RW];
    float *w = thread_buffer(0, (size_t)BLOCK_RW * k);
    const float *wr[BLOCK_RW];
    for (int r = 0; r < BLOCK_RW; r++) wr[r] = w + (size_t)r * k;
    /* rows of A a chunk, as even as they divide */
    const long per = chunk_bytes() / ((long)k * 4);
    const int most = per > BLOCK_RA ? (int)per : BLOCK_RA;
    const int chunks = ceil_div(p->m, most);
    for (int ch = 0; ch < chunks; ch++) {
        const int i0 = (int)((long)p->m * ch / chunks), i1 = (int)((long)p->m * (ch + 1) / chunks);
        const int groups_a = ceil_div(i1 - i0, BLOCK_RA);
        for (int j = j0; j < j1; j += BLOCK_RW) {
            const int nj = j1 - j < BLOCK_RW ? j1 - j : BLOCK_RW;
            /* the rows PREFETCH_BLOCKS blocks ahead (the first chunk's pass reads them from
             * memory; later chunks find them in L3 if at all), into L2: into L1 (a block's
             * rows all at once), one-decision requests on Qwen3-0.6B's Q4_K_M file took
             * 1.06-1.09x as long, prefill the same (bench/RESULTS.md, "Row items' and block
             * tiles' prefetch into L2") */
            const int ahead = j + PREFETCH_BLOCKS * BLOCK_RW;
            if (ahead + BLOCK_RW <= j1) {
                const char *next = (const char *)(base + (size_t)ahead * row_bytes);
                for (size_t o = 0; o < BLOCK_RW * row_bytes; o += 64) __builtin_prefetch(next + o, 0, 2);
            }
            fill(p, j, nj, w, ctx);
            for (int r = nj; r < BLOCK_RW; r++) wr[r] = wr[0];
            for (int g = 0, i = i0; g < groups_a; g++) {
                const int ni = (i1 - i0) / groups_a + (g < (i1 - i0) % groups_a);
                const float *a[BLOCK_RA];
                for (int ii = 0; ii < BLOCK_RA; ii++)
                    a[ii] = p->a + (size_t)(i + (ii < ni ? ii : 0)) * p->lda;
                block_tiles[ni](a, wr, k, dot);
                for (int ii = 0; ii < ni; ii++)
                    for (int r = 0; r < nj; r++) store(p, i + ii, j + r, dot[ii * BLOCK_RW + r]);
                i += ni;
            }
            for (int r = nj; r < BLOCK_RW; r++) wr[r] = w + (size_t)r * k;
        }
    }
}

/* What the affine block tiles' `fill` reads: the codes (the last row from its padded copy),
 * and room for a block's rows' scales and biases widened to float32. */
struct affine_fill {
    int bits;
    const unsigned char *base, *last;
    size_t row_bytes;
    int groups;
    float *widened;
};

static void affine_rows_fill(const struct product *p, int j, int nj, float *w, const void *ctx) {
    const struct affine_fill *f = ctx;
    const int k = p->k, groups = f->groups;
    void (*const dequantize)(const struct product *, const unsigned char *, const float *,
                             const float *, float *) =
        BY_BITS(f->bits, dequantize);
    const size_t first = (size_t)j * groups, count = (size_t)nj * groups;
    const float *s0 = float_scales(p->scales, p->scale_format, first, (int)count, f->widened);
    const float *b0 = f->bits == FP4 ? s0 /* no bias: not read */
                                     : float_scales(p->biases, p->scale_format, first, (int)count,
                                                    f->widened + (size_t)STREAM_RW * groups);
    for (int r = 0; r < nj; r++) {
        const unsigned char *row = j + r == p->n - 1 ? f->last : f->base + (size_t)(j + r) * f->row_bytes;
        dequantize(p, row, s0 + (size_t)r * groups, b0 + (size_t)r * groups, w + (size_t)r * k);
    }
}

/* --- products ------------------------------------------------------------------------------ */

int affine_block(const struct product *p) {
    return p->amx ? AMX_BLOCK : p->m <= STREAM_ROWS ? STREAM_RW : BLOCK_RW;
}

int affine_reordered(int bits) { return bits == 4; }

/* into[i] = row i of A in the tiles' order for `bits` (4: each unit's even positions, then its
 * odd ones). */
void affine_rows(int bits, int m, int k, const float *a, int lda, float *into) {
    (void)bits;
    const int U = 2 * QL;
    for (int i = 0; i < m; i++) {
        const float *row = a + (size_t)i * lda;
        float *out = into + (size_t)i * k;
        for (int t = 0; t < k; t += U)
            for (int l = 0; l < QL; l++) {
                out[t + l] = row[t + lane_position(4, 0, l)];
                out[t + QL + l] = row[t + lane_position(4, 1, l)];
            }
    }
}

int affine_supported(const struct step_weight *w, int n, int k) {
    if (w->format != W_AFFINE || !w->data || !w->scales || n < 1 || k < 1) return 0;
    if (w->scale_format == W_E8M0) /* mxfp4: MLX's only form of it, and no biases */
        return w->bits == 4 && w->group == 32 && !w->biases && k % 32 == 0;
    const int bits_ok = PACKED(w->bits) || w->bits == 4 || w->bits == 8;
    const int group_ok = w->group == 32 || w->group == 64 || w->group == 128;
    const int scales_ok = w->scale_format == W_F32 || w->scale_format == W_F16 ||
                          w->scale_format == W_BF16;
    return bits_ok && group_ok && scales_ok && w->biases && k % w->group == 0;
}

/* Columns [j0, j1) of C from W_AFFINE weights; bits fixed (a constant in each instance). */
ALWAYS void columns_of(const int bits, const struct product *p, int j0, int j1) {
    const int k = p->k, groups = k / p->group;
    const size_t row_bytes = (size_t)k * CODE_BITS(bits) / 8;
    const unsigned char *base = p->w;
    /* the matrix's last row, copied with room for what unit_load reads past it */
    unsigned char *padded = NULL;
    const unsigned char *last = base + (size_t)(p->n - 1) * row_bytes;
    if (overread(bits) && j1 == p->n) {
        padded = malloc(row_bytes + overread(bits));
        if (!padded) abort();
        memcpy(padded, last, row_bytes);
        memset(padded + row_bytes, 0, overread(bits));
        last = padded;
    }
#define ROW(j) ((j) == p->n - 1 ? last : base + (size_t)(j) * row_bytes)
    /* the scales and biases of the rows in hand, as float32 */
    float *widened = thread_buffer(1, (size_t)2 * STREAM_RW * groups);
    float dot[BLOCK_RA * STREAM_RW > 2 * STREAM_RW ? BLOCK_RA * STREAM_RW : 2 * STREAM_RW];
    if (p->m <= STREAM_ROWS) {
        const stream_fn one = BY_BITS(bits, stream1), two = BY_BITS(bits, stream2);
        for (int j = j0; j < j1; j += STREAM_RW) {
            const int nj = j1 - j < STREAM_RW ? j1 - j : STREAM_RW;
            const unsigned char *rows[STREAM_RW];
            const float *scale[STREAM_RW], *bias[STREAM_RW];
            /* the block's rows' scales and biases (one run each) widened at once */
            const size_t first = (size_t)j * groups, count = (size_t)nj * groups;
            const float *s0 = float_scales(p->scales, p->scale_format, first, (int)count, widened);
            const float *b0 = bits == FP4 ? s0 /* no bias: not read */
                                          : float_scales(p->biases, p->scale_format, first, (int)count,
                                                         widened + (size_t)STREAM_RW * groups);
            for (int r = 0; r < STREAM_RW; r++) {
                const int row = r < nj ? r : 0;
                rows[r] = ROW(j + row);
                scale[r] = s0 + (size_t)row * groups;
                bias[r] = b0 + (size_t)row * groups;
            }
            /* the block PREFETCH_BLOCKS ahead: its rows' codes (one run), and its scales and
             * biases now */
            const int ahead = j + PREFETCH_BLOCKS * STREAM_RW;
            const int fetch = ahead + STREAM_RW <= j1;
            const char *codes = fetch ? (const char *)(base + (size_t)ahead * row_bytes) : NULL;
            const int lines = (int)(STREAM_RW * row_bytes / 64);
            if (fetch) {
                const int size = p->scale_format == W_F32 ? 4 : p->scale_format == W_E8M0 ? 1 : 2;
                const char *sa = (const char *)p->scales + (size_t)ahead * groups * size;
                const char *ba = bits == FP4 ? NULL : (const char *)p->biases + (size_t)ahead * groups * size;
                for (size_t o = 0; o < (size_t)STREAM_RW * groups * size; o += 64) {
                    __builtin_prefetch(sa + o, 0, 3);
                    if (ba) __builtin_prefetch(ba + o, 0, 3);
                }
            }
            for (int i = 0; i < p->m; i += 2) {
                const int ni = p->m - i < 2 ? p->m - i : 2;
                const float *a[2] = {p->a + (size_t)i * p->lda, p->a + (size_t)(i + ni - 1) * p->lda};
                (ni == 2 ? two : one)(p, rows, scale, bias, a, dot, i ? NULL : codes, lines);
                for (int ii = 0; ii < ni; ii++)
                    for (int r = 0; r < nj; r++) store(p, i + ii, j + r, dot[ii * STREAM_RW + r]);
            }
        }
    } else {
        struct affine_fill fill = {bits, base, last, row_bytes, groups, widened};
        block_columns(p, j0, j1, row_bytes, affine_rows_fill, &fill);
    }
#undef ROW
    free(padded);
}

#define COLUMNS(BITS) \
    static void columns_##BITS(const struct product *p, int j0, int j1) { columns_of(BITS, p, j0, j1); }
COLUMNS(2)
COLUMNS(3)
COLUMNS(4)
COLUMNS(5)
COLUMNS(6)
COLUMNS(8)
COLUMNS(FP4)

/* Decode products by limbs (below): W_Q4K, W_Q5K and W_Q6K blocks with AVX512-VNNI, or with
 * AVX2 (256-bit tiles); MLX's 5-bit affine codes (GGUF's Q5_0 and Q5_1 map onto them) with
 * AVX512-VBMI too, whose vpmultishiftqb spreads 5-bit codes into bytes, or with AVX2 (vpshufb
 * and a multiply do). AVX-512 without VNNI keeps the float tiles: there the 256-bit limbs
 * measured no faster than its tables (bench/RESULTS.md, "Decode by limbs on AVX2"). */
#if QPATH == 512 && defined(__AVX512VNNI__)
#define LIMB_PRODUCTS 1
#define LIMB_PATH 512
#elif QPATH == 256
#define LIMB_PRODUCTS 1
#define LIMB_PATH 256
#else
#define LIMB_PRODUCTS 0
#define LIMB_PATH 0
#endif
#if (LIMB_PATH == 512 && defined(__AVX512VBMI__)) || LIMB_PATH == 256
#define AFFINE_LIMBS 1
#else
#define AFFINE_LIMBS 0
#endif

/* Whether a W_AFFINE product of A [., k] by limbs can read these codes: 5 bits in groups of
 * 32, 64 or 128 (whole groups in a block of 256 of A's values), two runs of 32 a step. */
static int affine_limbs_read(int bits, int group, int k) {
    return AFFINE_LIMBS && bits == 5 && (group == 32 || group == 64 || group == 128) && k % 64 == 0;
}

#if AFFINE_LIMBS
static void affine5_limb_columns(const struct product *p, int j0, int j1);
#endif

void affine_columns(const struct product *p, int j0, int j1) {
#if AMX_PRODUCTS
    if (p->amx) { /* a forward's rows on AMX tiles (amx_rows_of) */
        amx_columns(p, j0, j1);
        return;
    }
#endif
#if AFFINE_LIMBS
    if (p->limbs && affine_limbs_read(p->bits, p->group, p->k)) { /* a decode step's rows */
        affine5_limb_columns(p, j0, j1);
        return;
    }
#endif
    BY_BITS(p->scale_format == W_E8M0 ? FP4 : p->bits, columns)(p, j0, j1);
}

/* Whether a GGML block format has limb tiles: all but IQ4_NL, where the build has limbs (the
 * grid i-quants since bench/RESULTS.md's "The grid i-quants by limbs": their codes are made
 * as the float tiles make them, and summed by limbs). */
static int limb_format(int format) {
    return LIMB_PRODUCTS && ggml_format(format) && format != W_IQ4NL && !half_row_format(format);
}

/* A decode step's rows of W_GF16 / W_GBF16 are marked by limbs too (none read: `p->limbs` is
 * what tells ggml_columns the rows are a decode step's: see half_rows_panels), and so are
 * those of affine codes whose forwards take AMX's tiles (amx_affine: `p->limbs` keeps them
 * on the stream tiles, which stream W at memory's rate where the tiles at one row take 2.6x
 * the time; bench/RESULTS.md, "2-, 3- and 6-bit affine codes; affine codes on AMX's tiles"). */
int limbs_read(const struct step_weight *w, int k) {
    if (ggml_format(w->format)) return limb_format(w->format) || half_row_format(w->format);
#if AMX_PRODUCTS
    if (w->format == W_AFFINE && amx_affine(k, w)) return 1;
#endif
    return w->format == W_AFFINE && affine_limbs_read(w->bits, w->group, k);
}

/* --- GGML's blocks of 16-weight sub-blocks: Q6_K, Q3_K, Q2_K (W_Q6K, W_Q3K, W_Q2K) --------- */

/* A Q6_K block: 256 weights in 210 bytes: ql[128] (the codes' low 4 bits), qh[64] (their high
 * 2 bits), scales[16] (int8, one per 16 weights), d (float16). Weight i of a block, as
 * llama.cpp's dequantize_row_q6_K computes it: in half h = i / 128, with l = i % 32 and
 * quarter s = (i % 128) / 32, the code is (ql[64h + 32(s & 1) + l] >> 4(s >> 1)) & 15 with
 * ((qh[32h + l] >> 2s) & 3) << 4, and the value (d * scales[i / 16]) * (code - 32): d times
 * the scale exact in float32, the product with the code rounded once.
 *
 * A Q3_K block (Q3_K_M and Q3_K_S files; Q2_K files' attn_v and ffn_down): 256 weights in 110
 * bytes: hmask[32] (each code's third bit), qs[64] (its low 2 bits), scales[12] (sixteen 6-bit
 * scales, packed as llama.cpp unpacks them), d (float16). Weight i, with h, s and l as above:
 * low bits (qs[32h + l] >> 2s) & 3, less 4 where bit 4h + s of hmask[l] is clear; the value
 * (d * (sc_{i/16} - 32)) * code (llama.cpp's dequantize_row_q3_K): every product exact.
 *
 * A Q2_K block (Q2_K files): 256 weights in 84 bytes: scales[16] (a 4-bit scale and a 4-bit
 * min a 16 weights), qs[64] (2-bit codes, as Q3_K's low bits), d and dmin (float16). Weight
 * i's value is (d * (sc & 15)) * q - dmin * (sc >> 4), sc = scales[i / 16] (llama.cpp's
 * dequantize_row_q2_K): both products exact, the difference rounded once, which the tiles'
 * q * scale + bias (bias = -(dmin * m)) is, fused or not.
 *
 * An IQ4_XS block (llama.cpp's i-quant of 4.25 bits a weight, common in GGUFs others publish):
 * 256 weights in 136 bytes: d (float16), scales_h (a uint16: each 32 weights' scale's high 2
 * bits), scales_l[4] (their low 4 bits, two a byte), qs[128] (4-bit indices into llama.cpp's
 * table of 16 int8 values, kvalues_iq4nl): in sub-block b (32 weights), weight 32b + l is the
 * low nibble of qs[16b + l] and 32b + 16 + l its high one (l < 16); its value (d * (ls_b - 32))
 * * kvalues[index] (llama.cpp's dequantize_row_iq4_xs): every product exact (24 bits at most).
 * The tiles take the looked-up values as codes and each 32 weights' scale as two 16s'.
 *
 * The tiles take a block's codes as int8 and its 16 scales (and Q2_K's biases) as float32
 * (s16_codes), and make each vector of QL values the same way, (float)code * scale (+ bias)
 * (s16_values), in order of k. Few rows (STREAM_ROWS) take stream tiles: BLOCK_RW rows of W,
 * a block at a time, the values made in registers against one or two rows of A; more rows take
 * the block tiles, BLOCK_RW rows of W made into a buffer of the thread's. The lanes and the
 * order of every sum are the block tile's either way, so the same bits for any number of rows;
 * never a float32 copy of W. */
enum { Q6K_WEIGHTS = 256, Q6K_BYTES = 210, Q3K_BYTES = 110, Q2K_BYTES = 84, IQ4XS_BYTES = 136 };
/* the formats the 16-weight tiles read: a compile-time constant of each instance */
enum { S16_Q6K, S16_Q3K, S16_Q2K, S16_IQ4XS, S16_IQ2XXS, S16_IQ2XS, S16_IQ2S, S16_IQ3XXS, S16_IQ3S, S16_IQ1S,
       S16_IQ1M };
/* Whether a 16-weight type is a grid i-quant's (IQ2_XXS .. IQ1_M: codes made by s16_codes). */
#define S16_GRID(type) ((type) >= S16_IQ2XXS)

typedef unsigned char u8x32 __attribute__((vector_size(32)));
typedef unsigned short u16x16 __attribute__((vector_size(32)));

/* Share b of `blocks` of the `lines` cache lines from `ahead` (none when NULL) prefetched: a
 * stream tile spreads the rows a few blocks on over its steps. Into L2 (prefetcht1), not L1:
 * a one-row tile reads each line once, soon after. Measured on Zen 4 (bench/RESULTS.md,
 * "Prefetching into L2"): Q6_K's decode limb tile (which now reads a row at a time instead,
 * s16_limb_tile) 21-24 -> 28-31 GFLOP/s on one thread (9 -> 12 GB/s), the other formats' the
 * same or faster on two, and a whole Qwen3-0.6B Q4_K_M decode token (its head is Q6_K)
 * 42.6 -> 37.5 ms; an AVX2 build's the same. */
ALWAYS void fetch_share(const char *ahead, int lines, int b, int blocks) {
    if (ahead)
        for (int q = lines * b / blocks; q < lines * (b + 1) / blocks; q++)
            __builtin_prefetch(ahead + (size_t)q * 64, 0, 2);
}

/* scale[16] = d * scales[j] of Q6_K block x. */
ALWAYS void q6k_scales(const unsigned char *x, float *scale) {
    unsigned short half;
    memcpy(&half, x + 208, 2);
    const float d = half_to_float(half);
    const signed char *s = (const signed char *)(x + 192);
#if QPATH == 512
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)s)));
    _mm512_storeu_ps(scale, _mm512_mul_ps(v, _mm512_set1_ps(d)));
#elif QPATH == 256
    const __m128i q = _mm_loadu_si128((const __m128i *)s);
    const __m256 dd = _mm256_set1_ps(d);
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), dd));
    _mm256_storeu_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), dd));
#else
    for (int j = 0; j < 16; j++) scale[j] = (float)s[j] * d;
#endif
}

/* codes[256] = Q6_K block x's codes less 32, in order of k. */
ALWAYS void q6k_codes(const unsigned char *x, signed char *codes) {
    const u8x32 low4 = (u8x32){0} + 15, low2 = (u8x32){0} + 3, bias = (u8x32){0} + 32;
    for (int h = 0; h < 2; h++) {
        const unsigned char *ql = x + 64 * h, *qh = x + 128 + 32 * h;
        u8x32 lo, hi, top;
        memcpy(&lo, ql, 32);
        memcpy(&hi, ql + 32, 32);
        memcpy(&top, qh, 32);
        /* the high bits moved up 4 in 16-bit lanes (no byte's bits reach the next) */
        const u8x32 quarter[4] = {
            ((lo & low4) | (u8x32)((u16x16)(top & low2) << 4)) - bias,
            ((hi & low4) | (u8x32)((u16x16)((top >> 2) & low2) << 4)) - bias,
            ((lo >> 4) | (u8x32)((u16x16)((top >> 4) & low2) << 4)) - bias,
            ((hi >> 4) | (u8x32)((u16x16)(top >> 6) << 4)) - bias,
        };
        memcpy(codes + 128 * h, quarter, sizeof quarter);
    }
}

/* codes[256] = the 2-bit codes of qs[64] (Q3_K's low bits, Q2_K's codes), in order of k: weight
 * 128h + 32s + l is bits 2s, 2s + 1 of qs[32h + l]; with `hmask`, less 4 where bit 4h + s of
 * hmask[l] is clear (Q3_K). */
ALWAYS void two_bit_codes(const unsigned char *qs, const unsigned char *hmask, signed char *codes) {
    const u8x32 low2 = (u8x32){0} + 3, one = (u8x32){0} + 1, four = (u8x32){0} + 4;
    u8x32 high = {0};
    if (hmask) memcpy(&high, hmask, 32);
    for (int h = 0; h < 2; h++) {
        u8x32 q;
        memcpy(&q, qs + 32 * h, 32);
        _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {
            u8x32 code = (q >> (2 * s)) & low2;
            if (hmask) code = code + (((high >> (4 * h + s)) & one) << 2) - four;
            memcpy(codes + 128 * h + 32 * s, &code, 32);
        }
    }
}

/* scale[16] = d * (sc_j - 32) of Q3_K block x: its sixteen 6-bit scales as llama.cpp's
 * dequantize_row_q3_K unpacks them. */
ALWAYS void q3k_scales(const unsigned char *x, float *scale) {
    unsigned aux[4];
    memcpy(aux, x + 96, 12);
    const unsigned kmask1 = 0x03030303u, kmask2 = 0x0f0f0f0fu, tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | ((tmp & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
    unsigned short half;
    memcpy(&half, x + 108, 2);
    const float d = half_to_float(half);
#if QPATH == 512
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)aux));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32)));
    _mm512_storeu_ps(scale, _mm512_mul_ps(v, _mm512_set1_ps(d)));
#elif QPATH == 256
    const __m128i sc = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)aux), _mm_set1_epi8(32));
    const __m256 dd = _mm256_set1_ps(d);
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)), dd));
    _mm256_storeu_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))), dd));
#else
    unsigned char sc[16];
    memcpy(sc, aux, 16);
    for (int j = 0; j < 16; j++) scale[j] = (float)((int)sc[j] - 32) * d;
#endif
}

/* scale[16] = d * (sc_j & 15) and bias[16] = -(dmin * (sc_j >> 4)) of Q2_K block x. */
ALWAYS void q2k_scales(const unsigned char *x, float *scale, float *bias) {
    unsigned short hd, hm;
    memcpy(&hd, x + 80, 2);
    memcpy(&hm, x + 82, 2);
    const float d = half_to_float(hd), dmin = half_to_float(hm);
#if QPATH == 512 || QPATH == 256 /* -(dmin * m) is (-dmin) * m */
    const __m128i sc = _mm_loadu_si128((const __m128i *)x), low4 = _mm_set1_epi8(15);
    const __m128i sc4 = _mm_and_si128(sc, low4), m4 = _mm_and_si128(_mm_srli_epi16(sc, 4), low4);
#if QPATH == 512
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc4)), _mm512_set1_ps(d)));
    _mm512_storeu_ps(bias, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(m4)), _mm512_set1_ps(-dmin)));
#else
    const __m256 dd = _mm256_set1_ps(d), mm = _mm256_set1_ps(-dmin);
    _mm256_storeu_ps(scale, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc4)), dd));
    _mm256_storeu_ps(scale + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc4, 8))), dd));
    _mm256_storeu_ps(bias, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m4)), mm));
    _mm256_storeu_ps(bias + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m4, 8))), mm));
#endif
#else
    for (int j = 0; j < 16; j++) {
        scale[j] = (float)(x[j] & 15) * d;
        bias[j] = -(dmin * (float)(x[j] >> 4));
    }
#endif
}

/* llama.cpp's kvalues_iq4nl: the values IQ4_XS's 4-bit indices stand for (0-7 negative). */
static const signed char IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                           1,    13,   25,  38,  53,  69,  89,  113};

/* scale[16] = d * (ls_b - 32) of IQ4_XS block x for each 16 weights (sub-block b's twice). */
ALWAYS void iq4xs_scales(const unsigned char *x, float *scale) {
    unsigned short half, high;
    memcpy(&half, x, 2);
    memcpy(&high, x + 2, 2);
    const float d = half_to_float(half);
    for (int b = 0; b < 8; b++) {
        const int ls = ((x[4 + b / 2] >> 4 * (b % 2)) & 15) | ((high >> 2 * b) & 3) << 4;
        scale[2 * b] = scale[2 * b + 1] = d * (float)(ls - 32);
    }
}

/* codes[256] = IQ4_XS block x's values, IQ4_VALUES[index], in order of k. */
ALWAYS void iq4xs_codes(const unsigned char *x, signed char *codes) {
    const signed char *kvalues = IQ4_VALUES;
#if QPATH == 512 || QPATH == 256
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues));
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int b = 0; b < 8; b += 2) { /* sub-blocks b and b + 1: 16 bytes of qs each */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(x + 8 + 16 * b));
        const __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(q, low4));
        const __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(q, 4), low4));
        _mm256_storeu_si256((__m256i *)(codes + 32 * b), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256((__m256i *)(codes + 32 * b + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
#else
    for (int b = 0; b < 8; b++)
        for (int l = 0; l < 16; l++) {
            codes[32 * b + l] = kvalues[x[8 + 16 * b + l] & 15];
            codes[32 * b + 16 + l] = kvalues[x[8 + 16 * b + l] >> 4];
        }
#endif
}

/* --- GGML's grid i-quants (W_IQ2XXS .. W_IQ1M) ------------------------------------------- */

/* IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M (what llama.cpp's quantizer writes
 * for its IQ1 to IQ3 files): 256 weights a block, each 8 (IQ3: 4) of them an index into a
 * fixed grid of small integers (iq_grids.h, llama.cpp's tables), with eight signs (IQ1: an
 * offset delta of +-1/8 instead) and a scale per 32 or 16 weights. The tiles take them as the
 * 16-weight formats' codes and scales (s16_codes): IQ2 and IQ3 a code the grid value with its
 * sign and llama.cpp's scale (d * (0.5 + s) / 4, d * (0.5 + s) / 2, d * (1 + 2s)); IQ1 the
 * code 8 * grid + 8 * delta (an odd integer, -9 .. 9) and the scale dl / 8, whose product is
 * dl * (grid + delta) before its one rounding. So every value is llama.cpp's
 * dequantize_row_iq*'s (the scale times the grid value, times the sign: exact) bit for bit,
 * and a block is read from its own bytes (2.06 to 3.44 bits a weight), never a copy of W. No
 * limb tiles: a decode step reads these with the float tiles. */
#include "iq_grids.h"

enum { IQ2XXS_BYTES = 66, IQ2XS_BYTES = 74, IQ2S_BYTES = 82, IQ3XXS_BYTES = 98, IQ3S_BYTES = 110,
       IQ1S_BYTES = 50, IQ1M_BYTES = 56 };

/* A block's codes are made 32 (a sub-block) at a time: with AVX2 (and AVX-512) the 4 or 8 grid
 * entries loaded into a 256-bit register, the 32 signs applied at once (AVX-512's masked
 * subtract, AVX2's byte mask); elsewhere 8 at a time in the same order. */
#if QPATH == 512 || QPATH == 256
#define GRID_VECTORS 1
#else
#define GRID_VECTORS 0
#endif

/* The sign bytes of four 7-bit sign indices (bits 0-6 of each byte of `b`, the eighth clear):
 * llama.cpp's ksigns_iq2xs, each byte's bit 7 the parity of its seven, so that the eight signs
 * have an even number of minuses. */
static inline unsigned with_parity(unsigned b) {
    unsigned p = b ^ (b >> 4); /* bit 8i of p ends as the parity of byte i */
    p ^= p >> 2;
    p ^= p >> 1;
    return b | (p & 0x01010101u) << 7;
}

/* Four 7-bit sign indices packed at bits 0, 7, 14, 21 of `a` (IQ2_XXS's, IQ3_XXS's), as bytes. */
static inline unsigned seven_bit_fields(unsigned a) {
    return (a & 0x7fu) | ((a << 1) & 0x7f00u) | ((a << 2) & 0x7f0000u) | ((a << 3) & 0x7f000000u);
}

#if GRID_VECTORS
/* g with byte i negated where bit i of `signs` is set. */
ALWAYS __m256i signed_bytes(__m256i g, unsigned signs) {
#if QPATH == 512 && defined(__AVX512VL__)
    return _mm256_mask_sub_epi8(g, (__mmask32)signs, _mm256_setzero_si256(), g);
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)signs),
                                               _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll,
                                                                 0x0101010101010101ll, 0));
    const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    const __m256i minus = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bits), bits); /* -1 where negated */
    return _mm256_sub_epi8(_mm256_xor_si256(g, minus), minus);
#endif
}

/* Four 8-value entries of `grid` (32 bytes). */
ALWAYS __m256i entries_8(const unsigned long long *grid, unsigned i0, unsigned i1, unsigned i2, unsigned i3) {
    return _mm256_set_epi64x((long long)grid[i3], (long long)grid[i2], (long long)grid[i1], (long long)grid[i0]);
}

/* Eight 4-value entries of `grid` (32 bytes), at indices ix[0 .. 8). */
ALWAYS __m256i entries_4(const unsigned *grid, const unsigned *ix) {
    return _mm256_set_epi32((int)grid[ix[7]], (int)grid[ix[6]], (int)grid[ix[5]], (int)grid[ix[4]],
                            (int)grid[ix[3]], (int)grid[ix[2]], (int)grid[ix[1]], (int)grid[ix[0]]);
}

/* IQ1's codes: 8 * g (g's bytes -1, 0, 1; shifted in 16-bit lanes, the bits a low byte
 * pushes into the high one masked off) plus delta's bytes (+-1). */
ALWAYS __m256i offset_bytes(__m256i g, __m256i delta) {
    return _mm256_add_epi8(_mm256_and_si256(_mm256_slli_epi16(g, 3), _mm256_set1_epi8((char)0xf8)), delta);
}
#else
typedef signed char s8x8 __attribute__((vector_size(8)));

/* out[0 .. 8) = grid entry e's values (bytes, low first), negated where bit j of `signs` is. */
ALWAYS void signed_entry(signed char *out, unsigned long long e, unsigned signs) {
    const s8x8 bit = {1, 2, 4, 8, 16, 32, 64, -128};
    s8x8 g;
    memcpy(&g, &e, 8);
    const s8x8 minus = (((s8x8){0} + (signed char)signs) & bit) != 0; /* -1 where negated */
    const s8x8 code = (g ^ minus) - minus;
    memcpy(out, &code, 8);
}

/* IQ1's out[0 .. 8): 8 * grid entry e's values (-1, 0, 1) plus `delta` (+-1). */
ALWAYS void offset_entry(signed char *out, unsigned long long e, int delta) {
    s8x8 g;
    memcpy(&g, &e, 8);
    const s8x8 code = g * 8 + (signed char)delta;
    memcpy(out, &code, 8);
}
#endif

/* 32 codes at out from four 8-value entries (indices i[0 .. 4)) and 32 signs. */
ALWAYS void signed_32(signed char *out, const unsigned long long *grid, const unsigned *i, unsigned signs) {
#if GRID_VECTORS
    _mm256_storeu_si256((__m256i *)out, signed_bytes(entries_8(grid, i[0], i[1], i[2], i[3]), signs));
#else
    for (int l = 0; l < 4; l++) signed_entry(out + 8 * l, grid[i[l]], signs >> 8 * l);
#endif
}

/* 32 codes at out from eight 4-value entries (indices i[0 .. 8)) and 32 signs. */
ALWAYS void signed_32_of_4(signed char *out, const unsigned *grid, const unsigned *i, unsigned signs) {
#if GRID_VECTORS
    _mm256_storeu_si256((__m256i *)out, signed_bytes(entries_4(grid, i), signs));
#else
    for (int l = 0; l < 4; l++)
        signed_entry(out + 8 * l, grid[i[2 * l]] | (unsigned long long)grid[i[2 * l + 1]] << 32, signs >> 8 * l);
#endif
}

/* IQ1's 32 codes at out from four entries of IQ1S_GRID and the sign of each 8's delta (bit l
 * of `minus`: -1/8, else +1/8). */
ALWAYS void offset_32(signed char *out, const unsigned *i, unsigned minus) {
#if GRID_VECTORS
    const long long plus = 0x0101010101010101ll, less = -1;
    const __m256i delta = _mm256_set_epi64x(minus & 8 ? less : plus, minus & 4 ? less : plus,
                                            minus & 2 ? less : plus, minus & 1 ? less : plus);
    _mm256_storeu_si256((__m256i *)out, offset_bytes(entries_8(IQ1S_GRID, i[0], i[1], i[2], i[3]), delta));
#else
    for (int l = 0; l < 4; l++) offset_entry(out + 8 * l, IQ1S_GRID[i[l]], minus >> l & 1 ? -1 : 1);
#endif
}

/* The d (float16) at x. */
ALWAYS float half_at(const unsigned char *x) {
    unsigned short half;
    memcpy(&half, x, 2);
    return half_to_float(half);
}

/* IQ2_XXS (66 bytes): d, then per 32 weights two uint32: four grid indices (bytes), and four
 * 7-bit sign indices (bits 0, 7, 14, 21) with the scale s (bits 28-31). */
ALWAYS void iq2xxs_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        unsigned aux[2];
        memcpy(aux, x + 2 + 8 * b, 8);
        scale[2 * b] = scale[2 * b + 1] = d * (0.5f + (float)(aux[1] >> 28)) * 0.25f;
        const unsigned i[4] = {aux[0] & 255, (aux[0] >> 8) & 255, (aux[0] >> 16) & 255, aux[0] >> 24};
        signed_32(codes + 32 * b, IQ2XXS_GRID, i, with_parity(seven_bit_fields(aux[1])));
    }
}

/* IQ2_XS (74 bytes): d, qs[32] (uint16: a 9-bit grid index, a 7-bit sign index), scales[8]
 * (a 4-bit s per 16 weights, the low nibble first). */
ALWAYS void iq2xs_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        scale[2 * b] = d * (0.5f + (float)(x[66 + b] & 15)) * 0.25f;
        scale[2 * b + 1] = d * (0.5f + (float)(x[66 + b] >> 4)) * 0.25f;
        unsigned short q[4];
        memcpy(q, x + 2 + 8 * b, 8);
        const unsigned i[4] = {q[0] & 511u, q[1] & 511u, q[2] & 511u, q[3] & 511u};
        const unsigned signs = (unsigned)(q[0] >> 9) | (unsigned)(q[1] >> 9) << 8 | (unsigned)(q[2] >> 9) << 16 |
                               (unsigned)(q[3] >> 9) << 24;
        signed_32(codes + 32 * b, IQ2XS_GRID, i, with_parity(signs));
    }
}

/* IQ2_S (82 bytes): d, qs[32] (grid indices' low 8 bits), signs[32] (a byte per 8 weights),
 * qh[8] (per 32 weights the indices' top 2 bits, 2 a group of 8), scales[8] (as IQ2_XS's). */
ALWAYS void iq2s_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        scale[2 * b] = d * (0.5f + (float)(x[74 + b] & 15)) * 0.25f;
        scale[2 * b + 1] = d * (0.5f + (float)(x[74 + b] >> 4)) * 0.25f;
        const unsigned char *q = x + 2 + 4 * b;
        const unsigned high = x[66 + b];
        const unsigned i[4] = {q[0] | ((high << 8) & 0x300), q[1] | ((high << 6) & 0x300),
                               q[2] | ((high << 4) & 0x300), q[3] | ((high << 2) & 0x300)};
        unsigned signs;
        memcpy(&signs, x + 34 + 4 * b, 4);
        signed_32(codes + 32 * b, IQ2S_GRID, i, signs);
    }
}

/* IQ3_XXS (98 bytes): d, qs[64] (grid indices, 4 values each), then per 32 weights a uint32
 * of four 7-bit sign indices and the scale s (bits 28-31). */
ALWAYS void iq3xxs_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        unsigned aux;
        memcpy(&aux, x + 66 + 4 * b, 4);
        scale[2 * b] = scale[2 * b + 1] = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        const unsigned char *q = x + 2 + 8 * b;
        const unsigned i[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
        signed_32_of_4(codes + 32 * b, IQ3XXS_GRID, i, with_parity(seven_bit_fields(aux)));
    }
}

/* IQ3_S (110 bytes): d, qs[64] (grid indices' low 8 bits), qh[8] (their ninth bits, a byte per
 * 32 weights), signs[32], scales[4] (a 4-bit s per 32 weights, the low nibble first). */
ALWAYS void iq3s_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        scale[2 * b] = scale[2 * b + 1] = d * (float)(1 + 2 * ((x[106 + b / 2] >> 4 * (b % 2)) & 15));
        unsigned signs;
        memcpy(&signs, x + 74 + 4 * b, 4);
        const unsigned char *q = x + 2 + 8 * b;
        const unsigned high = x[66 + b];
        unsigned i[8];
        for (int l = 0; l < 8; l++) i[l] = q[l] | ((high << (8 - l)) & 256);
        signed_32_of_4(codes + 32 * b, IQ3S_GRID, i, signs);
    }
}

/* IQ1_S (50 bytes): d, qs[32] (grid indices' low 8 bits), qh[8] (uint16 per 32 weights: the
 * indices' top 3 bits, 3 a group of 8, then s in bits 12-14 and delta's sign in bit 15). */
ALWAYS void iq1s_codes(const unsigned char *x, signed char *codes, float *scale) {
    const float d = half_at(x);
    for (int b = 0; b < 8; b++) {
        unsigned short h;
        memcpy(&h, x + 34 + 2 * b, 2);
        const float dl = d * (float)(2 * ((h >> 12) & 7) + 1);
        scale[2 * b] = scale[2 * b + 1] = dl * 0.125f;
        const unsigned char *q = x + 2 + 4 * b;
        const unsigned i[4] = {q[0] | (h & 7u) << 8, q[1] | (h >> 3 & 7u) << 8, q[2] | (h >> 6 & 7u) << 8,
                               q[3] | (h >> 9 & 7u) << 8};
        offset_32(codes + 32 * b, i, h & 0x8000 ? 15 : 0);
    }
}

/* IQ1_M (56 bytes): qs[32] (grid indices' low 8 bits), qh[16] (a nibble per 8 weights: the
 * index's top 3 bits, delta's sign in the fourth), scales[8] (uint16 x 4: a 3-bit s per 16
 * weights, 4 a word, and d (float16) in the words' top nibbles). */
ALWAYS void iq1m_codes(const unsigned char *x, signed char *codes, float *scale) {
    unsigned short sc[4];
    memcpy(sc, x + 48, 8);
    const unsigned short half = (unsigned short)((sc[0] >> 12) | ((sc[1] >> 8) & 0xf0) | ((sc[2] >> 4) & 0xf00) |
                                                 (sc[3] & 0xf000));
    const float d = half_to_float(half);
    for (int g = 0; g < 16; g++) {
        const float dl = d * (float)(2 * ((sc[g / 4] >> 3 * (g % 4)) & 7) + 1);
        scale[g] = dl * 0.125f;
    }
    for (int b = 0; b < 8; b++) {
        const unsigned char *q = x + 4 * b;
        unsigned short h; /* the four nibbles of these 32 weights, low first */
        memcpy(&h, x + 32 + 2 * b, 2);
        const unsigned i[4] = {q[0] | (h & 7u) << 8, q[1] | (h >> 4 & 7u) << 8, q[2] | (h >> 8 & 7u) << 8,
                               q[3] | (h >> 12 & 7u) << 8};
        const unsigned minus = (h >> 3 & 1) | (h >> 6 & 2) | (h >> 9 & 4) | (h >> 12 & 8);
        offset_32(codes + 32 * b, i, minus);
    }
}

/* Bytes a block of a 16-weight format. */
#define S16_BYTES(type)                                                                                \
    ((type) == S16_Q6K      ? Q6K_BYTES                                                                \
     : (type) == S16_Q3K    ? Q3K_BYTES                                                                \
     : (type) == S16_Q2K    ? Q2K_BYTES                                                                \
     : (type) == S16_IQ4XS  ? IQ4XS_BYTES                                                              \
     : (type) == S16_IQ2XXS ? IQ2XXS_BYTES                                                             \
     : (type) == S16_IQ2XS  ? IQ2XS_BYTES                                                              \
     : (type) == S16_IQ2S   ? IQ2S_BYTES                                                               \
     : (type) == S16_IQ3XXS ? IQ3XXS_BYTES                                                             \
     : (type) == S16_IQ3S   ? IQ3S_BYTES                                                               \
     : (type) == S16_IQ1S   ? IQ1S_BYTES                                                               \
                            : IQ1M_BYTES)

/* Block x's 16 scales (and Q2_K's 16 biases), as the tiles take them: the float tiles with
 * their codes (s16_codes), the limb tiles alone. */
ALWAYS void s16_scales(const int type, const unsigned char *x, float *scale, float *bias) {
    if (type == S16_Q6K)
        q6k_scales(x, scale);
    else if (type == S16_Q3K)
        q3k_scales(x, scale);
    else if (type == S16_Q2K)
        q2k_scales(x, scale, bias);
    else
        iq4xs_scales(x, scale);
}

/* Block x of a 16-weight format: its codes, scales and (Q2_K) biases. */
ALWAYS void s16_codes(const int type, const unsigned char *x, signed char *codes, float *scale, float *bias) {
    switch (type) { /* the grid i-quants: their codes and scales at once */
    case S16_IQ2XXS: iq2xxs_codes(x, codes, scale); return;
    case S16_IQ2XS: iq2xs_codes(x, codes, scale); return;
    case S16_IQ2S: iq2s_codes(x, codes, scale); return;
    case S16_IQ3XXS: iq3xxs_codes(x, codes, scale); return;
    case S16_IQ3S: iq3s_codes(x, codes, scale); return;
    case S16_IQ1S: iq1s_codes(x, codes, scale); return;
    case S16_IQ1M: iq1m_codes(x, codes, scale); return;
    default: break;
    }
    if (type == S16_Q6K)
        q6k_codes(x, codes);
    else if (type == S16_Q3K)
        two_bit_codes(x + 32, x, codes);
    else if (type == S16_Q2K)
        two_bit_codes(x + 16, NULL, codes);
    else
        iq4xs_codes(x, codes);
    s16_scales(type, x, scale, bias);
}

/* The QL values at position t of a block from its s16_codes. */
ALWAYS qv s16_values(const int type, const signed char *codes, const float *scale, const float *bias, int t) {
#if QPATH == 512
    const qv c = (qv)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + t))));
#elif QPATH == 256
    const qv c = (qv)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + t))));
#else
    qv c;
    for (int l = 0; l < QL; l++) c[l] = (float)codes[t + l];
#endif
    qv w = c * scale[t / 16];
    if (type == S16_Q2K) w += bias[t / 16]; /* the product exact: one rounding, fused or not */
    QPIN(w);
    return w;
}

/* Row `row` of a 16-weight format's blocks (k weights) dequantized into out[k], in order of k. */
ALWAYS void s16_dequantize_row(const int type, int k, const unsigned char *row, float *out) {
    signed char codes[Q6K_WEIGHTS] __attribute__((aligned(64)));
    float scale[16], bias[16];
    for (int b = 0; b < k / Q6K_WEIGHTS; b++) {
        s16_codes(type, row + (size_t)b * S16_BYTES(type), codes, scale, bias);
        float *y = out + (size_t)b * Q6K_WEIGHTS;
        _Pragma("GCC unroll 4") for (int t = 0; t < Q6K_WEIGHTS; t += QL) qstore(y + t, s16_values(type, codes, scale, bias, t));
    }
}

/* dot[i * BLOCK_RW + r] = a[i] . row r of W (rows[r]) over k: block_tile's lanes and order,
 * each block's values made in registers. `lines` cache lines from `ahead` (the rows a few
 * blocks on) prefetched, spread over the blocks. */
ALWAYS void s16_stream_tile(const int type, const int RA, int k, const unsigned char *const *rows,
                            const float *const *a, float *dot, const char *ahead, int lines) {
    enum { RW = BLOCK_RW };
    signed char codes[RW][Q6K_WEIGHTS] __attribute__((aligned(64)));
    float scale[RW][16], bias[RW][16];
    qv acc[2 * RW], zero = {0};
    QPIN(zero);
    _Pragma("GCC unroll 8") for (int q = 0; q < RA * RW; q++) acc[q] = zero;
    const int blocks = k / Q6K_WEIGHTS;
    for (int b = 0; b < blocks; b++) {
        fetch_share(ahead, lines, b, blocks);
        _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++)
            s16_codes(type, rows[r] + (size_t)b * S16_BYTES(type), codes[r], scale[r], bias[r]);
        const int t0 = b * Q6K_WEIGHTS;
        _Pragma("GCC unroll 2") for (int t = 0; t < Q6K_WEIGHTS; t += QL) {
            qv x[2];
            _Pragma("GCC unroll 2") for (int i = 0; i < RA; i++) {
                x[i] = qload(a[i] + t0 + t);
                QPIN(x[i]);
            }
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
                const qv w = s16_values(type, codes[r], scale[r], bias[r], t);
                _Pragma("GCC unroll 2") for (int i = 0; i < RA; i++) acc[i * RW + r] += x[i] * w;
            }
        }
    }
    sums(dot, acc, RA * RW);
}

/* A format's stream tiles (one and two rows of A) and row dequantizer: its family's
 * `family`_stream_tile and `family`_dequantize_row for its `kind` (a constant). */
#define FORMAT_INSTANCES(name, family, kind)                                                         \
    static void name##_stream_1(int k, const unsigned char *const *rows, const float *const *a,     \
                                float *dot, const char *ahead, int lines) {                         \
        family##_stream_tile(kind, 1, k, rows, a, dot, ahead, lines);                               \
    }                                                                                               \
    static void name##_stream_2(int k, const unsigned char *const *rows, const float *const *a,     \
                                float *dot, const char *ahead, int lines) {                         \
        family##_stream_tile(kind, 2, k, rows, a, dot, ahead, lines);                               \
    }                                                                                               \
    static void name##_dequantize_row(int k, const unsigned char *row, float *out) {                \
        family##_dequantize_row(kind, k, row, out);                                                 \
    }
FORMAT_INSTANCES(q6k, s16, S16_Q6K)
FORMAT_INSTANCES(q3k, s16, S16_Q3K)
FORMAT_INSTANCES(q2k, s16, S16_Q2K)
FORMAT_INSTANCES(iq4xs, s16, S16_IQ4XS)
FORMAT_INSTANCES(iq2xxs, s16, S16_IQ2XXS)
FORMAT_INSTANCES(iq2xs, s16, S16_IQ2XS)
FORMAT_INSTANCES(iq2s, s16, S16_IQ2S)
FORMAT_INSTANCES(iq3xxs, s16, S16_IQ3XXS)
FORMAT_INSTANCES(iq3s, s16, S16_IQ3S)
FORMAT_INSTANCES(iq1s, s16, S16_IQ1S)
FORMAT_INSTANCES(iq1m, s16, S16_IQ1M)

/* --- GGML's IQ4_NL blocks (W_IQ4NL) -------------------------------------------------------- */

/* An IQ4_NL block (what llama.cpp's quantizer writes for an IQ4_XS file's matrices whose rows
 * are not whole 256s, e.g. SmolLM2's 576 and Qwen2.5-0.5B's 896, and for IQ4_NL files): 32
 * weights in 18 bytes: d (float16), qs[16]: weight l is the low nibble of qs[l], weight 16 + l
 * its high one, each an index into IQ4_VALUES; its value d * IQ4_VALUES[index]
 * (llama.cpp's dequantize_row_iq4_nl): exact, an 11-bit d times a 7-bit value. The tiles make
 * a block's values QL at a time in order of k, each (float)value * d as s16_values makes
 * IQ4_XS's, so the stream tiles keep the block tiles' lanes and order (the same bits for any
 * number of rows). No limb tiles: a decode step reads these with the float tiles (their
 * blocks of 32 need not fill the limbs' runs of 256). */
enum { IQ4NL_WEIGHTS = 32, IQ4NL_BYTES = 18 };

/* v[0 .. 32 / QL) = the values of IQ4_NL block x, QL at a time in order of k. */
ALWAYS void iq4nl_values(const unsigned char *x, qv *v) {
    unsigned short half;
    memcpy(&half, x, 2);
    const float d = half_to_float(half);
#if QPATH == 512 /* the block's 16 values in a register, each index looking one up (vpermps) */
    const qv values = (qv)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_VALUES)));
    const __m512 table = (__m512)(values * d);
    const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(x + 2)));
    v[0] = (qv)_mm512_permutexvar_ps(raw, table); /* vpermps reads an index's low 4 bits */
    v[1] = (qv)_mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), table);
#elif QPATH == 256 /* the indices' int8 values looked up (vpshufb), widened, scaled */
    const __m128i table = _mm_loadu_si128((const __m128i *)IQ4_VALUES), low4 = _mm_set1_epi8(15);
    const __m128i q = _mm_loadu_si128((const __m128i *)(x + 2));
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(q, low4));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
    const __m128i part[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) v[i] = (qv)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part[i])) * d;
#else
    for (int i = 0; i < IQ4NL_WEIGHTS / QL; i++)
        for (int l = 0; l < QL; l++) {
            const int t = i * QL + l, index = t < 16 ? x[2 + t] & 15 : x[2 + t - 16] >> 4;
            v[i][l] = (float)IQ4_VALUES[index] * d;
        }
#endif
}

/* --- GGML's F16 and BF16 rows (W_GF16, W_GBF16) --------------------------------------------- */

/* A GGUF's float16 or bfloat16 matrix as it stores it, row-major halves, read as blocks of 32
 * weights (64 bytes; k a multiple of 32): each value widened exactly to float32 (float16 by
 * F16C's conversion, bfloat16 as a float32's top half), the sums those of the float32 values
 * in the block tiles' lanes and order as every block format's, so the same bits for any
 * number of rows. A model stored in half precision (gpt-oss's non-expert matrices in
 * Ollama's files) is read in place at 2 bytes a weight, never widened into a float32 copy.
 * No limb tiles: these values are not a scale times small integers. */
enum { HALF_ROW_WEIGHTS = 32, HALF_ROW_BYTES = 64 };

/* v[0 .. 32 / QL) = the float32 values of 32 halves at x (bfloat16 when `bf`), QL at a time. */
ALWAYS void half_row_values(const int bf, const unsigned char *x, qv *v) {
#if QPATH == 512
    _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
        v[i] = bf ? (qv)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                  : (qv)_mm512_cvtph_ps(h);
    }
#elif QPATH == 256 && defined(__F16C__)
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
        const __m128i h = _mm_loadu_si128((const __m128i *)(x + 16 * i));
        v[i] = bf ? (qv)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                  : (qv)_mm256_cvtph_ps(h);
    }
#else
    for (int i = 0; i < HALF_ROW_WEIGHTS / QL; i++)
        for (int l = 0; l < QL; l++) {
            unsigned short h;
            memcpy(&h, x + 2 * (i * QL + l), 2);
            v[i][l] = scale_at(&h, bf ? W_BF16 : W_F16, 0);
        }
#endif
}

/* --- Blocks of 32 weights made in registers: IQ4_NL's, and F16 / BF16 rows -----------------
 *
 * One stream tile and row dequantizer for the families whose blocks hold 32 weights with no
 * limb tiles (`kind`, a constant: B32_IQ4NL, B32_F16, B32_BF16), each block's values made QL
 * at a time in order of k by the family's own function. */
enum { B32_WEIGHTS = 32, B32_IQ4NL = 0, B32_F16 = 1, B32_BF16 = 2 };
_Static_assert((int)IQ4NL_WEIGHTS == (int)B32_WEIGHTS && (int)HALF_ROW_WEIGHTS == (int)B32_WEIGHTS, "blocks of 32");

ALWAYS size_t b32_bytes(const int kind) { return kind == B32_IQ4NL ? IQ4NL_BYTES : HALF_ROW_BYTES; }

ALWAYS void b32_values(const int kind, const unsigned char *x, qv *v) {
    if (kind == B32_IQ4NL)
        iq4nl_values(x, v);
    else
        half_row_values(kind == B32_BF16, x, v);
}

/* Row `row` of the family's blocks (k weights) made into out[k], in order of k. */
ALWAYS void b32_dequantize_row(const int kind, int k, const unsigned char *row, float *out) {
    for (int b = 0; b < k / B32_WEIGHTS; b++) {
        qv w[B32_WEIGHTS / QL];
        b32_values(kind, row + (size_t)b * b32_bytes(kind), w);
        _Pragma("GCC unroll 8") for (int v = 0; v < B32_WEIGHTS / QL; v++)
            qstore(out + (size_t)b * B32_WEIGHTS + v * QL, w[v]);
    }
}

/* dot[i * BLOCK_RW + r] = a[i] . row r of W (rows[r], the family's blocks) over k: block_tile's
 * lanes and order, each block's values made in registers; `lines` cache lines from `ahead`
 * prefetched, spread over the blocks (s16_stream_tile's way). */
ALWAYS void b32_stream_tile(const int kind, const int RA, int k, const unsigned char *const *rows,
                            const float *const *a, float *dot, const char *ahead, int lines) {
    enum { RW = BLOCK_RW, V = B32_WEIGHTS / QL };
    qv acc[2 * RW], zero = {0};
    QPIN(zero);
    _Pragma("GCC unroll 8") for (int q = 0; q < RA * RW; q++) acc[q] = zero;
    const int blocks = k / B32_WEIGHTS;
    for (int b = 0; b < blocks; b++) {
        fetch_share(ahead, lines, b, blocks);
        const int t0 = b * B32_WEIGHTS;
        _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
            qv w[V];
            b32_values(kind, rows[r] + (size_t)b * b32_bytes(kind), w);
            _Pragma("GCC unroll 8") for (int v = 0; v < V; v++)
                _Pragma("GCC unroll 2") for (int i = 0; i < RA; i++) acc[i * RW + r] += qload(a[i] + t0 + v * QL) * w[v];
        }
    }
    sums(dot, acc, RA * RW);
}

FORMAT_INSTANCES(iq4nl, b32, B32_IQ4NL)
FORMAT_INSTANCES(gf16, b32, B32_F16)
FORMAT_INSTANCES(gbf16, b32, B32_BF16)

/* --- GGML's Q4_K and Q5_K blocks (W_Q4K, W_Q5K) ------------------------------------------- */

/* A block: 256 weights in 144 bytes: d and dmin (float16), scales[12] (eight 6-bit scales sc_j
 * and eight 6-bit mins m_j, packed as llama.cpp's get_scale_min_k4 reads them), qs[128] (4-bit
 * codes): in chunk c (64 weights), weights 64c + l are the low nibbles of qs[32c + l] and
 * 64c + 32 + l their high nibbles (l < 32), sub-blocks 2c and 2c + 1. Weight i's value, as
 * llama.cpp's dequantize_row_q4_K computes it, is (d * sc_j) * q - (dmin * m_j), j = i / 32:
 * both factors exact in float32, the product rounded, then the difference; that is MLX's
 * affine value with scale d * sc_j and bias -(dmin * m_j) (`dequantized`), which GGUF loading
 * repacks Q4_K into where the blocks are not kept. Both tiles make the values in order of k
 * from the sub-block's table (AVX-512: one vpermps for 16 weights), by one exact FMA (AVX2)
 * or by the two roundings (q4k_chunk); the stream tile multiplies them in registers, the
 * block tile's fill stores them: the block tile's lanes and order either way, so the same
 * bits for any number of rows.
 * 4.5 bits a weight read, where the affine repack's float32 scales and biases make it 6.
 *
 * GGML's Q5_K blocks (W_Q5K) are Q4_K's with a fifth bit a weight: 176 bytes, d, dmin and
 * scales[12] as Q4_K's, then qh[32], then qs[128] as Q4_K's; weight 64c + l's code is the low
 * nibble of qs[32c + l] plus 16 times bit 2c of qh[l], weight 64c + 32 + l's the high nibble
 * plus 16 times bit 2c + 1 (llama.cpp's dequantize_row_q5_K), its value (d * sc_j) * q -
 * (dmin * m_j) as Q4_K's. The same tiles read them (`bits` 5: a sub-block's table of 32
 * values), 5.5 bits a weight where the affine 5-bit repack's float32 scales make it 7. */
enum { Q4K_WEIGHTS = 256, Q4K_BYTES = 144, Q5K_BYTES = 176, Q4K_CHUNK = 64 };

/* Bytes a block of Q4_K (bits 4) or Q5_K (bits 5). */
#define KQ_BYTES(bits) ((bits) == 4 ? Q4K_BYTES : Q5K_BYTES)

/* sb[j] = d * sc_j (the scales) and sb[8 + j] = -(dmin * m_j) (the biases) for the 8
 * sub-blocks of block x. */
ALWAYS void q4k_scales(const unsigned char *x, float *sb) {
    unsigned short hd, hm;
    memcpy(&hd, x, 2);
    memcpy(&hm, x + 2, 2);
    const float d = half_to_float(hd), dmin = half_to_float(hm);
    /* the 6-bit fields as 16 bytes, sc_0..7 then m_0..7 (llama.cpp's own unpacking) */
    unsigned u[4];
    memcpy(u, x + 4, 12);
    const unsigned k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const unsigned m03 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m03;
    u[0] &= k1;
#if QPATH == 512
    const __m512 f = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(dmin));
    const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u))), f);
    const __m512i sign = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, (int)0x80000000u, (int)0x80000000u,
                                           (int)0x80000000u, (int)0x80000000u, (int)0x80000000u,
                                           (int)0x80000000u, (int)0x80000000u, (int)0x80000000u);
    _mm512_storeu_ps(sb, _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), sign)));
#elif QPATH == 256 /* the same products: -(dmin * m) is (-dmin) * m */
    const __m128i q = _mm_loadu_si128((const __m128i *)u);
    _mm256_storeu_ps(sb, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_set1_ps(d)));
    _mm256_storeu_ps(sb + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
                                           _mm256_set1_ps(-dmin)));
#else
    unsigned char q[16];
    memcpy(q, u, 16);
    for (int j = 0; j < 8; j++) {
        sb[j] = d * (float)q[j];
        sb[8 + j] = -(dmin * (float)q[8 + j]);
    }
#endif
}

#if QPATH == 512 || QPATH == 256
/* What unpacks a block's 6-bit fields in a 128-bit lane holding its first 16 bytes (field
 * byte i at 4 + i): sc_0-3 = q0-3, sc_4-7 = q8-11 (low nibbles) with q0-3's top 2 bits above,
 * m_0-3 = q4-7, m_4-7 = q8-11 (high nibbles) with q4-7's. Byte shuffles a = [q0-3 q8-11 q4-7
 * q8-11] and b = [- q0-3 - q4-7], then (a & keep) | ((a >> 4) & nibble) | ((b >> 2) & top)
 * is sc_0-7 then m_0-7 (q4k_scales' order). */
static const signed char Q4K_FIELDS[5][16] __attribute__((aligned(16))) = {
    {4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15},      /* a */
    {-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11},      /* b */
    {63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0},    /* keep */
    {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15},            /* nibble */
    {0, 0, 0, 0, 48, 48, 48, 48, 0, 0, 0, 0, 48, 48, 48, 48},        /* top */
};
#define Q4K_FIELD(i) _mm_load_si128((const __m128i *)Q4K_FIELDS[i])
#endif

#if QPATH == 512
/* q4k_scales of 4 blocks at once (x[r]: row r's), into sb[r]: the 6-bit fields of each in a
 * 128-bit lane, unpacked by Q4K_FIELDS, then the same products. */
ALWAYS void q4k_scales4(const unsigned char *const *x, __m512 *sb) {
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)x[0]));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[1]), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[2]), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)x[3]), 3);
    const __m512i a = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(Q4K_FIELD(0)));
    const __m512i b = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(Q4K_FIELD(1)));
    const __m512i keep = _mm512_broadcast_i32x4(Q4K_FIELD(2)), nibble = _mm512_broadcast_i32x4(Q4K_FIELD(3));
    const __m512i top = _mm512_broadcast_i32x4(Q4K_FIELD(4));
    const __m512i six = _mm512_or_si512(
        _mm512_or_si512(_mm512_and_si512(a, keep), _mm512_and_si512(_mm512_srli_epi16(a, 4), nibble)),
        _mm512_and_si512(_mm512_srli_epi16(b, 2), top));
    const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i sign = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, (int)0x80000000u, (int)0x80000000u,
                                           (int)0x80000000u, (int)0x80000000u, (int)0x80000000u,
                                           (int)0x80000000u, (int)0x80000000u, (int)0x80000000u);
    _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {
        int both;
        memcpy(&both, x[r], 4);
        const __m512 dd = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(both))));
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(six, r)));
        sb[r] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_mul_ps(f, dd)), sign));
    }
}
#elif QPATH == 256
/* q4k_scales of 2 blocks at once (x[0], x[1]), each in a 128-bit lane, unpacked by
 * Q4K_FIELDS as q4k_scales4 does: scale[r] = d * sc_j, bias[r] = (-dmin) * m_j = -(dmin * m_j) (exact:
 * the same products). */
ALWAYS void q4k_scales2(const unsigned char *const *x, __m256 *scale, __m256 *bias) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)x[0])),
                                              _mm_loadu_si128((const __m128i *)x[1]), 1);
    const __m256i a = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(Q4K_FIELD(0)));
    const __m256i b = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(Q4K_FIELD(1)));
    const __m256i keep = _mm256_broadcastsi128_si256(Q4K_FIELD(2)), nibble = _mm256_broadcastsi128_si256(Q4K_FIELD(3));
    const __m256i top = _mm256_broadcastsi128_si256(Q4K_FIELD(4));
    const __m256i six = _mm256_or_si256(
        _mm256_or_si256(_mm256_and_si256(a, keep), _mm256_and_si256(_mm256_srli_epi16(a, 4), nibble)),
        _mm256_and_si256(_mm256_srli_epi16(b, 2), top));
    _Pragma("GCC unroll 2") for (int r = 0; r < 2; r++) {
        int both;
        memcpy(&both, x[r], 4);
        const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(both)); /* d, dmin */
        const __m128i fields = r ? _mm256_extracti128_si256(six, 1) : _mm256_castsi256_si128(six);
        scale[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields)), _mm256_broadcastss_ps(dd));
        bias[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8))),
                                _mm256_broadcastss_ps(_mm_xor_ps(_mm_movehdup_ps(dd), _mm_set1_ps(-0.0f))));
    }
}
#endif

/* sb[r] = q4k_scales of block b of rows[r], r < 4, blocks of `bytes` (Q4_K's or Q5_K's: the
 * same first 16 bytes); 4 at once where there is AVX-512, 2 where there is AVX2. */
ALWAYS void q4k_scales_of(const unsigned char *const *rows, int b, size_t bytes, float (*sb)[16]) {
    const unsigned char *x[4];
    for (int r = 0; r < 4; r++) x[r] = rows[r] + (size_t)b * bytes;
#if QPATH == 512
    __m512 v[4];
    q4k_scales4(x, v);
    for (int r = 0; r < 4; r++) _mm512_storeu_ps(sb[r], v[r]);
#elif QPATH == 256
    _Pragma("GCC unroll 2") for (int r = 0; r < 4; r += 2) {
        __m256 scale[2], bias[2];
        q4k_scales2(x + r, scale, bias);
        _Pragma("GCC unroll 2") for (int i = 0; i < 2; i++) {
            _mm256_storeu_ps(sb[r + i], scale[i]);
            _mm256_storeu_ps(sb[r + i] + 8, bias[i]);
        }
    }
#else
    for (int r = 0; r < 4; r++) q4k_scales(x[r], sb[r]);
#endif
}

/* The values of chunk c of a block (qs = its 32 bytes, sub-blocks' constants ga and gb), in
 * order of k: Q4K_CHUNK / QL vectors. On AVX2 (no tables) each is one FMA, fma(scale, q,
 * bias), where MLX's value rounds the product and then the sum: the same bits, as a K-quant
 * sub-block's scale d * sc_j has at most 17 significant bits (a float16 d times a 6-bit sc_j,
 * exact in float32), so scale * q (q < 32) is exact. Measured, one row of Qwen3-0.6B's
 * shapes on an AVX2 build: Q4_K 29-30 -> 33.5 GFLOP/s, Q5_K 21.3 -> 23.1; tables made by
 * FMA on AVX-512 measured no faster (Q4_K's one row 59 -> 55-56), so they keep group_of's. */
ALWAYS void q4k_chunk(const unsigned char *qs, const struct qgroup *ga, const struct qgroup *gb,
                      qv *out) {
    enum { V = Q4K_CHUNK / QL, HALF = Q4K_CHUNK / QL / 2 };
#if QPATH == 256 /* each value one FMA (exact: above) */
    _Pragma("GCC unroll 4") for (int u = 0; u < HALF; u++) {
        const __m256i q = unit_load(8, qs, (size_t)u * QL);
        const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
        const __m256 b = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4));
        out[u] = (qv)_mm256_fmadd_ps(a, (__m256)ga->t0, (__m256)ga->t1);
        out[HALF + u] = (qv)_mm256_fmadd_ps(b, (__m256)gb->t0, (__m256)gb->t1);
    }
#elif QPATH
    qraw raw[HALF];
    _Pragma("GCC unroll 8") for (int u = 0; u < HALF; u++) raw[u] = unit_load(8, qs, (size_t)u * QL);
    /* unit_values(4, ...) reads a lane's low nibble (v = 0) or high one (v = 1) */
    _Pragma("GCC unroll 8") for (int u = 0; u < HALF; u++) out[u] = unit_values(4, raw[u], 0, ga);
    _Pragma("GCC unroll 8") for (int u = 0; u < HALF; u++) out[HALF + u] = unit_values(4, raw[u], 1, gb);
#else
    for (int v = 0; v < V; v++) {
        const struct qgroup *g = v < HALF ? ga : gb;
        float w[QL];
        for (int l = 0; l < QL; l++) {
            const unsigned byte = qs[(v % HALF) * QL + l];
            w[l] = dequantized(g->t0[0], v < HALF ? byte & 15 : byte >> 4, g->t1[0]);
        }
        out[v] = qload(w);
    }
#endif
}

/* The values of chunk c of a Q5_K block x (its sub-blocks' constants ga and gb, tables of 32
 * values), in order of k: Q4K_CHUNK / QL vectors, each code (nibble | fifth bit << 4) looked
 * up in the table (AVX-512: two vpermps, the second masked by the fifth bits) or made by the
 * two roundings. */
ALWAYS void q5k_chunk(const unsigned char *x, int c, const struct qgroup *ga, const struct qgroup *gb,
                      qv *out) {
    enum { V = Q4K_CHUNK / QL, HALF = Q4K_CHUNK / QL / 2 };
    const unsigned char *qs = x + 48 + 32 * c, *qh = x + 16;
#if QPATH == 512
    /* the fifth bits as masks (bit l: weight l of the sub-block): vpermps looks a code's low
     * 4 bits up in t0 (codes 0-15), then in t1 (16-31) where the fifth bit is set */
    const __m512i h = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)qh));
    const __mmask64 fa = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << 2 * c)));
    const __mmask64 fb = _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(2 << 2 * c)));
    _Pragma("GCC unroll 2") for (int u = 0; u < HALF; u++) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qs + QL * u)));
        const __m512i high = _mm512_srli_epi32(q, 4);
        const __m512 a = _mm512_permutexvar_ps(q, (__m512)ga->t0);
        const __m512 b = _mm512_permutexvar_ps(high, (__m512)gb->t0);
        out[u] = (qv)_mm512_mask_permutexvar_ps(a, (__mmask16)(fa >> (QL * u)), q, (__m512)ga->t1);
        out[HALF + u] = (qv)_mm512_mask_permutexvar_ps(b, (__mmask16)(fb >> (QL * u)), high, (__m512)gb->t1);
    }
#elif QPATH == 256
    /* the chunk's 64 codes made in bytes at once (nibble | fifth bit << 4: qh's bit 2c or
     * 2c + 1 brought to bit 0 of its byte, then to bit 4; the 16-bit lanes' shifts carry no
     * bit of one byte onto another's bit 4), then widened 8 at a time, one exact FMA each */
    unsigned char codes[64] __attribute__((aligned(32)));
    const __m256i q = _mm256_loadu_si256((const __m256i *)qs), h = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i low = _mm256_set1_epi8(15), fifth = _mm256_set1_epi8(16);
    const __m256i fa = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, 2 * c), 4), fifth);
    const __m256i fb = _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, 2 * c + 1), 4), fifth);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    _mm256_store_si256((__m256i *)codes, _mm256_or_si256(_mm256_and_si256(q, low), fa));
    _mm256_store_si256((__m256i *)(codes + 32), _mm256_or_si256(high, fb));
    _Pragma("GCC unroll 4") for (int u = 0; u < HALF; u++) {
        const __m128i a8 = _mm_loadl_epi64((const __m128i *)(codes + QL * u));
        const __m128i b8 = _mm_loadl_epi64((const __m128i *)(codes + 32 + QL * u));
        const __m256 ca = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a8));
        const __m256 cb = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b8));
        /* one FMA each (exact: q4k_chunk) */
        out[u] = (qv)_mm256_fmadd_ps(ca, (__m256)ga->t0, (__m256)ga->t1);
        out[HALF + u] = (qv)_mm256_fmadd_ps(cb, (__m256)gb->t0, (__m256)gb->t1);
    }
#else
    for (int v = 0; v < V; v++) {
        const struct qgroup *g = v < HALF ? ga : gb;
        float w[QL];
        for (int l = 0; l < QL; l++) {
            const int at = (v % HALF) * QL + l, high = v >= HALF;
            const unsigned code = (high ? qs[at] >> 4 : qs[at] & 15) | ((qh[at] >> (2 * c + high)) & 1u) << 4;
            w[l] = dequantized(g->t0[0], code, g->t1[0]);
        }
        out[v] = qload(w);
    }
#endif
}

/* Chunk c's values of a Q4_K (bits 4) or Q5_K (bits 5) block x. */
ALWAYS void kq_chunk(const int bits, const unsigned char *x, int c, const struct qgroup *ga,
                     const struct qgroup *gb, qv *out) {
    if (bits == 4)
        q4k_chunk(x + 16 + 32 * c, ga, gb, out);
    else
        q5k_chunk(x, c, ga, gb, out);
}

/* Block b's values of a row (its bytes x, scales sb) into out[256], in order of k. */
ALWAYS void kq_block_values(const int bits, const unsigned char *x, const float *sb, float *out) {
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
        const struct qgroup ga = group_of(bits, sb + 2 * c, sb + 8 + 2 * c);
        const struct qgroup gb = group_of(bits, sb + 2 * c + 1, sb + 9 + 2 * c);
        qv v[Q4K_CHUNK / QL];
        kq_chunk(bits, x, c, &ga, &gb, v);
        _Pragma("GCC unroll 8") for (int u = 0; u < Q4K_CHUNK / QL; u++)
            qstore(out + Q4K_CHUNK * c + u * QL, v[u]);
    }
}

/* Row `row` of Q4_K / Q5_K blocks (k weights) dequantized into out[k], in order of k. */
ALWAYS void kq_dequantize_row(const int bits, int k, const unsigned char *row, float *out) {
    float sb[16];
    for (int b = 0; b < k / Q4K_WEIGHTS; b++) {
        const unsigned char *x = row + (size_t)b * KQ_BYTES(bits);
        q4k_scales(x, sb);
        kq_block_values(bits, x, sb, out + (size_t)b * Q4K_WEIGHTS);
    }
}
static void q4k_dequantize_row(int k, const unsigned char *row, float *out) {
    kq_dequantize_row(4, k, row, out);
}
static void q5k_dequantize_row(int k, const unsigned char *row, float *out) {
    kq_dequantize_row(5, k, row, out);
}

/* Rows rows[0..3] of Q4_K / Q5_K blocks dequantized into out + r * k, their scales 4 at a
 * time. */
static void kq_dequantize_rows4(int bits, int k, const unsigned char *const *rows, float *out) {
    float sb[4][16];
    const size_t bytes = KQ_BYTES(bits);
    for (int b = 0; b < k / Q4K_WEIGHTS; b++) {
        q4k_scales_of(rows, b, bytes, sb);
        for (int r = 0; r < 4; r++) {
            float *to = out + (size_t)r * k + (size_t)b * Q4K_WEIGHTS;
            /* `bits` a constant in each call: one inlined block_values per width */
            if (bits == 4)
                kq_block_values(4, rows[r] + (size_t)b * bytes, sb[r], to);
            else
                kq_block_values(5, rows[r] + (size_t)b * bytes, sb[r], to);
        }
    }
}

/* dot[i * BLOCK_RW + r] = a[i] . row r of W (rows[r]) over k: block_tile's lanes and order,
 * the values made in registers a chunk at a time. `lines` cache lines from `ahead` prefetched,
 * spread over the blocks. */
ALWAYS void kq_stream_tile(const int bits, const int RA, int k, const unsigned char *const *rows,
                           const float *const *a, float *dot, const char *ahead, int lines) {
    enum { RW = BLOCK_RW, V = Q4K_CHUNK / QL };
    _Static_assert(RW == 4, "q4k_scales_of makes 4 rows' scales");
    float sb[RW][16];
    qv acc[2 * RW], zero = {0};
    QPIN(zero);
    _Pragma("GCC unroll 8") for (int q = 0; q < RA * RW; q++) acc[q] = zero;
    const int blocks = k / Q4K_WEIGHTS;
    for (int b = 0; b < blocks; b++) {
        fetch_share(ahead, lines, b, blocks);
        q4k_scales_of(rows, b, KQ_BYTES(bits), sb);
        for (int c = 0; c < 4; c++) {
            const int t = b * Q4K_WEIGHTS + c * Q4K_CHUNK;
            qv x[2][V];
            _Pragma("GCC unroll 2") for (int i = 0; i < RA; i++)
                _Pragma("GCC unroll 8") for (int u = 0; u < V; u++) x[i][u] = qload(a[i] + t + u * QL);
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
                const struct qgroup ga = group_of(bits, sb[r] + 2 * c, sb[r] + 8 + 2 * c);
                const struct qgroup gb = group_of(bits, sb[r] + 2 * c + 1, sb[r] + 9 + 2 * c);
                qv w[V];
                kq_chunk(bits, rows[r] + (size_t)b * KQ_BYTES(bits), c, &ga, &gb, w);
                _Pragma("GCC unroll 8") for (int u = 0; u < V; u++)
                    _Pragma("GCC unroll 2") for (int i = 0; i < RA; i++) acc[i * RW + r] += x[i][u] * w[u];
            }
        }
    }
    sums(dot, acc, RA * RW);
}

static void q4k_stream_1(int k, const unsigned char *const *rows, const float *const *a,
                         float *dot, const char *ahead, int lines) {
    kq_stream_tile(4, 1, k, rows, a, dot, ahead, lines);
}
static void q4k_stream_2(int k, const unsigned char *const *rows, const float *const *a,
                         float *dot, const char *ahead, int lines) {
    kq_stream_tile(4, 2, k, rows, a, dot, ahead, lines);
}
static void q5k_stream_1(int k, const unsigned char *const *rows, const float *const *a,
                         float *dot, const char *ahead, int lines) {
    kq_stream_tile(5, 1, k, rows, a, dot, ahead, lines);
}
static void q5k_stream_2(int k, const unsigned char *const *rows, const float *const *a,
                         float *dot, const char *ahead, int lines) {
    kq_stream_tile(5, 2, k, rows, a, dot, ahead, lines);
}

/* --- decode products by limbs (GGML blocks, 5-bit W_AFFINE: AVX512-VNNI, AVX2) ------------ */

/* A decode step's products (struct product's `limbs`, which the caller made with limb_split)
 * multiply the blocks' integer codes by A's values as integers: each run of 32 values of a
 * row of A, with a = max |x| / 127 over the run, as three signed 8-bit limbs,
 *
 *     x ~ a (l0 + l1 / 128 + l2 / 16384),  l0 in [-127, 127], l1, l2 in [-64, 64],
 *
 * (the residual of each limb rounded into the next: at most a / 32768 left, ~2.4e-7 of the
 * run's largest value), and each 4 codes' products with a limb summed exactly by vpdpbusd
 * (64 products an instruction, in int32): S = ((q.l0) 128 + q.l1) 128 + q.l2 per lane of 4
 * weights, < 2^30 for 6-bit codes. A lane's S is converted once and multiplied by its
 * sub-block's scale times a / 16384, one FMA; a Q4_K (Q5_K) sub-block's bias multiplies the
 * run's float32 sum of x (Q2_K's bias each 16 values' sum), Q6_K's and Q3_K's codes are read
 * unsigned (q + 32, q + 4), the 32 (4) taken off with each 16 values' float32 sum of x, and
 * IQ4_XS's signed table values plus 128 the same way (AVX2: as their sizes, each limb's sign
 * moved onto its value's, which vpmaddubsw's int16 pairs hold).
 * So a decode product is the dequantized weights' product up to ~1e-6 of sum |w x|
 * (tests/test_native_abi.py bounds each value against float64), against float32 FMAs'
 * ~1e-7, 1.3-1.5x faster than making each weight's float32 value where the
 * weights are in cache (bench/RESULTS.md, "Decode products by limbs"). Its bits are not the
 * float tiles': a decode step's hidden row is not bit for bit a forward's last row. Every
 * row of A is computed alone, in one order, so the same bits for any number of rows and any
 * share of the columns.
 * MLX's 5-bit affine codes (x (s q + b) over a group: the same S per lane, times s a / 16384,
 * plus b times the run's sum of x) take limbs too: their float tiles make ~17 G values/s, half
 * the rate memory delivers them at (the default model's "Q4_K_M" file is 74% Q5_0); the 4-
 * and 8-bit ones measured no faster by limbs (bench/RESULTS.md, "5-bit codes by limbs").
 * AVX2 builds take the same limbs with 256-bit tiles, 5-bit codes' too (below: vpmaddubsw and
 * vpmaddwd make the same S); AVX-512 without VNNI, and builds without AVX2, have no limb_split
 * (it declines) and decode steps take the float tiles. A's rows need whole runs of 32
 * (k % 32); a last block of fewer than 8 runs is zero past them. */

int runner_limb_products(void) { return LIMB_PRODUCTS | AFFINE_LIMBS << 1; }

long limb_floats(int m, int k) {
    if (!LIMB_PRODUCTS || k % 32) return 0;
    return (long)m * ((k + 255) / 256) * (long)(sizeof(struct limb_block) / sizeof(float));
}

#if LIMB_PATH == 512
/* v rounded to an integer (ties to even) and clamped to [-most, most]. */
ALWAYS __m512 limb_of(__m512 v, float most) {
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_max_ps(_mm512_min_ps(r, _mm512_set1_ps(most)), _mm512_set1_ps(-most));
}

ALWAYS void limb_store(signed char *to, __m512 limb) {
    _mm_storeu_si128((__m128i *)to, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(limb)));
}

/* Run j (its 32 values at x) of a block's limbs into L; 0 where a value is inf or NaN (a NaN
 * can drop out of a max: each value's bits are checked), and the float tiles say what follows. */
ALWAYS int limb_run(const float *x, int j, struct limb_block *L) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i finite = _mm512_set1_epi32(0x7f7fffff); /* the largest finite |x|'s bits */
    const __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    const __m512 size[2] = {_mm512_andnot_ps(sign, v[0]), _mm512_andnot_ps(sign, v[1])};
    if (_mm512_cmpgt_epi32_mask(_mm512_castps_si512(size[0]), finite) |
        _mm512_cmpgt_epi32_mask(_mm512_castps_si512(size[1]), finite))
        return 0;
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(size[0], size[1]));
    const float step = top / 127.0f, inv = top > 0 ? 127.0f / top : 0.0f;
    for (int h = 0; h < 2; h++) {
        const __m512 l0 = limb_of(_mm512_mul_ps(v[h], _mm512_set1_ps(inv)), 127.0f);
        const __m512 e1 = _mm512_fnmadd_ps(l0, _mm512_set1_ps(step), v[h]);
        const __m512 l1 = limb_of(_mm512_mul_ps(e1, _mm512_set1_ps(inv * 128.0f)), 64.0f);
        const __m512 e2 = _mm512_fnmadd_ps(l1, _mm512_set1_ps(step / 128.0f), e1);
        const __m512 l2 = limb_of(_mm512_mul_ps(e2, _mm512_set1_ps(inv * 16384.0f)), 64.0f);
        limb_store(L->l[0] + 32 * j + 16 * h, l0);
        limb_store(L->l[1] + 32 * j + 16 * h, l1);
        limb_store(L->l[2] + 32 * j + 16 * h, l2);
        const int at = 32 * ((j & 4) | (j & 1) << 1 | (j & 2) >> 1) + 16 * h;
        limb_store(L->l4[0] + at, l0);
        limb_store(L->l4[1] + at, l1);
        limb_store(L->l4[2] + at, l2);
        L->q6k_s[2 * j + h] = _mm512_reduce_add_ps(v[h]);
    }
    const float unit = step / 16384.0f;
    L->q4k[j] = unit;
    L->q4k[8 + j] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    L->q6k_u[2 * j] = L->q6k_u[2 * j + 1] = unit;
    return 1;
}

/* Each lane's 4 codes (unsigned bytes) times the limbs at l (3 runs of 256 apart): S. */
ALWAYS __m512i limb_dot(__m512i codes, const signed char *l) {
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512((const void *)l));
    s = _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 7), codes, _mm512_loadu_si512((const void *)(l + 256)));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(s, 7), codes, _mm512_loadu_si512((const void *)(l + 512)));
}

/* dot[r] = A's row (its limbs L) . row r of W (rows[r], 4 rows) in Q4_K (bits 4) or Q5_K
 * (bits 5) blocks. A half h of a block's qs (64 bytes) holds runs 4h and 4h + 2 in its low
 * nibbles, 4h + 1 and 4h + 3 in its high ones (the order of L's l4); Q5_K's fifth bits of
 * run j are bit j of qh[32], read with qh in both 256-bit halves. Codes below 32 keep S
 * below 2^31 (4 x 31 x 2.09e6). */
ALWAYS void kq_limb_tile(const int bits, int blocks, const unsigned char *const *rows,
                         const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    __m512 acc[RW], rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = rest[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    const size_t bytes = KQ_BYTES(bits), qs = bits == 4 ? 16 : 48;
    for (int b = 0; b < blocks; b++, L++) {
        fetch_share(ahead, lines, b, blocks);
        const __m512 units = _mm512_loadu_ps(L->q4k);
        const unsigned char *x4[RW];
        for (int r = 0; r < RW; r++) x4[r] = rows[r] + (size_t)b * bytes;
        __m512 sb[RW];
        q4k_scales4(x4, sb);
        _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
            const unsigned char *x = x4[r];
            /* lanes 0-7: each sub-block's scale times a / 16384; 8-15: its bias times its sum */
            const __m512 f = _mm512_mul_ps(sb[r], units);
            rest[r] = _mm512_mask_add_ps(rest[r], 0xff00, rest[r], f);
            const __m256i fifths = bits == 5 ? _mm256_loadu_si256((const __m256i *)(x + 16)) : _mm256_setzero_si256();
            const __m512i qh = _mm512_broadcast_i64x4(fifths);
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
                const __m512i z = _mm512_loadu_si512((const void *)(x + qs + 64 * h));
                __m512i codes[2] = {_mm512_and_si512(z, low), _mm512_and_si512(_mm512_srli_epi16(z, 4), low)};
                if (bits == 5)
                    _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                        /* run 4h + v in the low half, 4h + 2 + v in the high one: bit 0 of each
                         * byte after the 16-bit lanes' shift, moved to bit 4 */
                        const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h + v)),
                                                              _mm256_set1_epi16((short)(4 * h + 2 + v)), 1);
                        const __m512i fifth = _mm512_and_si512(_mm512_srlv_epi16(qh, by), one);
                        codes[v] = _mm512_or_si512(codes[v], _mm512_slli_epi16(fifth, 4));
                    }
                _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                    const int s0 = 4 * h + v;
                    const __m512i s = limb_dot(codes[v], L->l4[0] + 128 * h + 64 * v);
                    const __m512i at = _mm512_setr_epi32(s0, s0, s0, s0, s0, s0, s0, s0, s0 + 2, s0 + 2, s0 + 2,
                                                         s0 + 2, s0 + 2, s0 + 2, s0 + 2, s0 + 2);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(at, f), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < RW; r++) dot[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(rest[r]);
}

/* What the AVX-512 limb tiles add to a grid i-quant's codes to read them unsigned: past its
 * largest |code| (IQ1_S's and IQ1_M's 9, IQ3_S's 15, the IQ2 grids' 43, IQ3_XXS's 62), and no
 * further: the offset's products are taken off again with each 16 values' sum of x, and an
 * offset far past the codes (128: IQ1_M's 14 times its codes) left float32 cancellation past
 * the limbs' bound. */
ALWAYS int grid_offset(const int type) {
    return type == S16_IQ1S || type == S16_IQ1M || type == S16_IQ3S ? 16 : 64;
}

/* One block x of a row of W in Q6_K, Q3_K, Q2_K, IQ4_XS or a grid i-quant times A's limbs L,
 * into the row's acc and rest (s16_limb_tile), its codes read unsigned: Q6_K's q + 32 (the 32 taken off with
 * each sub-block's sum of x), Q3_K's q + 4 (its low 2 bits and its third bit as stored: the 4
 * taken off the same way), Q2_K's q (its bias times each sub-block's sum of x). Q6_K: a half h
 * of a block's ql (64 bytes) holds weights 128h .. 128h + 63 in its low nibbles, the next 64
 * in its high ones, qh their top 2 bits; Q3_K and Q2_K: the 32 bytes of qs from 32h hold weight 128h + 32s + l in
 * bits 2s of byte l, read with those 32 bytes in both 256-bit halves (s = 2v, 2v + 1 in the
 * low, high half of step v), Q3_K's third bits bit 4h + s of hmask[l] the same way; IQ4_XS's
 * values looked up (vpshufb) as value + 128 (1 .. 241: S below 4 x 241 x 2.09e6 = 2.01e9 <
 * 2^31), the 128 taken off with each 16 values' sum of x as Q6_K's 32: sub-blocks 4h + 2v
 * and 4h + 2v + 1 (16 bytes of qs each: low nibbles then high ones) in step v; a grid
 * i-quant's codes (s16_codes: signed, in order of k) plus grid_offset, taken off the same
 * way. */
ALWAYS void s16_limb_block(const int type, const unsigned char *x, const struct limb_block *L, __m512 *acc,
                           __m512 *rest) {
    const __m512i iq4_unsigned = /* IQ4_VALUES + 128 */
        _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)IQ4_VALUES), _mm_set1_epi8((char)0x80)));
    const __m512i low4 = _mm512_set1_epi8(15), high2 = _mm512_set1_epi8(0x30);
    const __m512i low2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    /* qh's 2-bit fields moved to bits 4-5: weights 0-31 of a half (<< 4), 32-63 (<< 2) */
    const __m512i up = _mm512_setr_epi64(0x0004000400040004LL, 0x0004000400040004LL, 0x0004000400040004LL,
                                         0x0004000400040004LL, 0x0002000200020002LL, 0x0002000200020002LL,
                                         0x0002000200020002LL, 0x0002000200020002LL);
    /* and for weights 64-95 (as they are), 96-127 (>> 2) */
    const __m512i down = _mm512_setr_epi64(0, 0, 0, 0, 0x0002000200020002LL, 0x0002000200020002LL,
                                           0x0002000200020002LL, 0x0002000200020002LL);
    const __m512 units = _mm512_loadu_ps(L->q6k_u), sums = _mm512_loadu_ps(L->q6k_s);
    float sc[16], bi[16];
    signed char grid[Q6K_WEIGHTS] __attribute__((aligned(64)));
    if (S16_GRID(type)) /* a grid i-quant's codes (signed, |code| <= 62) and scales */
        s16_codes(type, x, grid, sc, bi);
    else
        s16_scales(type, x, sc, bi);
    const __m512 scale = _mm512_loadu_ps(sc);
    const __m512 f = _mm512_mul_ps(scale, units);
    *rest = _mm512_fmadd_ps(type == S16_Q2K ? _mm512_loadu_ps(bi) : scale, sums, *rest);
    const __m512i hmask = type == S16_Q3K ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x))
                                          : _mm512_setzero_si512();
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        __m512i codes[2];
        if (S16_GRID(type)) {
            /* the codes + grid_offset (unsigned), the offset taken off with each 16 values'
             * sum of x, as IQ4_XS's 128 */
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                /* two 32-byte loads, as s16_codes stored them (a 64-byte load of two stores
                 * waits for them to reach the cache) */
                const signed char *at = grid + 128 * h + 64 * v;
                const __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_load_si256((const __m256i *)at)),
                                                     _mm256_load_si256((const __m256i *)(at + 32)), 1);
                codes[v] = _mm512_add_epi8(c, _mm512_set1_epi8((char)grid_offset(type)));
            }
        } else if (type == S16_IQ4XS) {
            /* the 128-bit lanes of a sub-block pair's 32 bytes of qs as [b, b, b + 1, b + 1],
             * shifted 0, 4, 0, 4: b's low nibbles, its high ones, b + 1's */
            const __m512i nibble = _mm512_setr_epi64(0, 0, 0x0004000400040004LL, 0x0004000400040004LL, 0, 0,
                                                     0x0004000400040004LL, 0x0004000400040004LL);
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                const __m512i q = _mm512_castsi256_si512(
                    _mm256_loadu_si256((const __m256i *)(x + 8 + 16 * (4 * h + 2 * v))));
                const __m512i index =
                    _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_i64x2(q, q, 0x50), nibble), low4);
                codes[v] = _mm512_shuffle_epi8(iq4_unsigned, index);
            }
        } else if (type == S16_Q6K) {
            const __m512i ql = _mm512_loadu_si512((const void *)(x + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x + 128 + 32 * h)));
            codes[0] = _mm512_or_si512(_mm512_and_si512(ql, low4), _mm512_and_si512(_mm512_sllv_epi16(qh, up), high2));
            codes[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                       _mm512_and_si512(_mm512_srlv_epi16(qh, down), high2));
        } else {
            const unsigned char *qs = x + (type == S16_Q3K ? 32 : 16) + 32 * h;
            const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qs));
            _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * v)),
                                                      _mm256_set1_epi16((short)(4 * v + 2)), 1);
                codes[v] = _mm512_and_si512(_mm512_srlv_epi16(q, by), low2);
                if (type == S16_Q3K) {
                    const __m512i at = _mm512_inserti64x4(_mm512_set1_epi16((short)(4 * h + 2 * v)),
                                                          _mm256_set1_epi16((short)(4 * h + 2 * v + 1)), 1);
                    const __m512i third = _mm512_and_si512(_mm512_srlv_epi16(hmask, at), one);
                    codes[v] = _mm512_or_si512(codes[v], _mm512_slli_epi16(third, 2));
                }
            }
        }
        _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
            const int s0 = 8 * h + 4 * v;
            const signed char *l = L->l[0] + 128 * h + 64 * v;
            const __m512i s = limb_dot(codes[v], l);
            const __m512i at = _mm512_setr_epi32(s0, s0, s0, s0, s0 + 1, s0 + 1, s0 + 1, s0 + 1, s0 + 2,
                                                 s0 + 2, s0 + 2, s0 + 2, s0 + 3, s0 + 3, s0 + 3, s0 + 3);
            *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(at, f), *acc);
        }
    }
}

/* dot[r] = A's row (its limbs L) . row r of W (rows[r], 4 rows) in Q6_K, Q3_K, Q2_K, IQ4_XS
 * or grid i-quant blocks (s16_limb_block). */
ALWAYS void s16_limb_tile(const int type, int blocks, const unsigned char *const *rows,
                          const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    __m512 acc[RW], rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = rest[r] = _mm512_setzero_ps();
    const size_t bytes = S16_BYTES(type);
    if (type == S16_Q6K) {
        /* Q6_K a row at a time, in the order of its bytes: the 4 rows are one run of memory
         * the hardware prefetcher streams, where block by block across them (4 streams of a
         * row's 210-byte blocks, prefetched ahead) made ~9 GB/s a thread into L1 and ~12
         * into L2 on the Zen 4 (bench/RESULTS.md, "Prefetching into L2"). The rows a few
         * tiles on are prefetched too, spread over the 4 rows' blocks: without, on an Intel
         * Xeon (AMX) VM, two threads streamed 11.5 GB/s where the float tiles reach 13.7;
         * with, 16.0 (a 1B Q4_K_M's decode step, its head Q6_K, 59.6 -> 48.7 ms: "Q6_K's
         * decode rows prefetched"). Each row's sums are the same operations in the same
         * order either way. The other formats measured as fast or faster across the rows
         * (and slower a row at a time on that Xeon). */
        for (int r = 0; r < RW; r++)
            for (int b = 0; b < blocks; b++) {
                fetch_share(ahead, lines, r * blocks + b, RW * blocks);
                s16_limb_block(type, rows[r] + (size_t)b * bytes, L + b, &acc[r], &rest[r]);
            }
    } else
        for (int b = 0; b < blocks; b++) {
            fetch_share(ahead, lines, b, blocks);
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++)
                s16_limb_block(type, rows[r] + (size_t)b * bytes, L + b, &acc[r], &rest[r]);
        }
    const float offset = type == S16_Q6K     ? -32.0f
                         : type == S16_Q3K   ? -4.0f
                         : type == S16_IQ4XS ? -128.0f
                         : S16_GRID(type)    ? -(float)grid_offset(type)
                                             : 1.0f;
    for (int r = 0; r < RW; r++) dot[r] = _mm512_reduce_add_ps(acc[r]) + offset * _mm512_reduce_add_ps(rest[r]);
}

#elif LIMB_PATH == 256

/* The same limbs with 256-bit vectors (AVX2, no 8-bit dot product instruction): vpmaddubsw
 * multiplies two codes (unsigned) by two first limbs (signed) and adds them in int16, exact
 * (|sum| <= 2 x 127 x 127 < 2^15), and vpmaddwd adds two of those into int32 times 16384; the
 * second and third limbs are one int16 a value (l12: l1 * 128 + l2), which vpmaddwd
 * multiplies by the codes widened to int16 (limb_dot). S per lane is the AVX-512 tiles'
 * integer sum, of other codes: for 32 products, four multiplies, two widenings and three
 * adds, one conversion and one FMA, where the float tiles spend a conversion and an FMA
 * making each 8 values and another FMA multiplying them (bench/RESULTS.md, "Decode by limbs
 * on AVX2": a decode step's products 1.3-2x the float tiles' rate on one row; on several rows
 * each row is its own pass, about the float stream tiles' rate; "AVX2 limbs by int16": the
 * four multiplies where three limbs by vpmaddubsw took six). A's runs are read in order of k
 * (l; l4 is not made); each run of 32 codes is one register, whose 8 lanes share a
 * sub-block's scale (Q4_K, Q5_K) or two (Q6_K). With AVX-VNNI, vpdpbusd makes S from the
 * three byte limbs as the AVX-512 tiles do (l12 is not made). */

/* v rounded to an integer (ties to even) and clamped to [-most, most]. */
ALWAYS __m256 limb_of(__m256 v, float most) {
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_max_ps(_mm256_min_ps(r, _mm256_set1_ps(most)), _mm256_set1_ps(-most));
}

/* The sum (the largest) of v's 8 lanes. */
ALWAYS float limb_sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
ALWAYS float limb_max8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* 32 limbs (4 vectors of 8 integers in float) as bytes, in order. */
ALWAYS void limb_store(signed char *to, const __m256 *v) {
    const __m256i a = _mm256_packs_epi32(_mm256_cvtps_epi32(v[0]), _mm256_cvtps_epi32(v[1]));
    const __m256i b = _mm256_packs_epi32(_mm256_cvtps_epi32(v[2]), _mm256_cvtps_epi32(v[3]));
    /* 4-byte groups v0[0:4] v1[0:4] v2[0:4] v3[0:4] v0[4:8] .. v3[4:8], put in order */
    const __m256i bytes = _mm256_packs_epi16(a, b);
    _mm256_storeu_si256((__m256i *)to, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The second and third limbs of a run (4 vectors of 8 each) as one int16 each, l1 * 128 + l2
 * (|v| <= 8256), in the order vpunpcklbw / vpunpckhbw widen the run's 32 codes: values 0-7
 * and 16-23, then 8-15 and 24-31. */
ALWAYS void limb_store12(short *to, const __m256 *l1, const __m256 *l2) {
    __m256i v[4];
    for (int u = 0; u < 4; u++) v[u] = _mm256_cvtps_epi32(_mm256_fmadd_ps(l1[u], _mm256_set1_ps(128.0f), l2[u]));
    /* vpackssdw's 64-bit quarters v[u][0:4] v[u+2][0:4] v[u][4:8] v[u+2][4:8], put in order */
    _mm256_storeu_si256((__m256i *)to, _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[2]), 0xd8));
    _mm256_storeu_si256((__m256i *)(to + 16), _mm256_permute4x64_epi64(_mm256_packs_epi32(v[1], v[3]), 0xd8));
}

/* Run j (its 32 values at x) of a block's limbs into L, as the AVX-512 limb_run. */
ALWAYS int limb_run(const float *x, int j, struct limb_block *L) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i finite = _mm256_set1_epi32(0x7f7fffff); /* the largest finite |x|'s bits */
    __m256 v[4], l0[4], l1[4], l2[4], top = _mm256_setzero_ps();
    __m256i over = _mm256_setzero_si256();
    for (int u = 0; u < 4; u++) {
        v[u] = _mm256_loadu_ps(x + 8 * u);
        const __m256 size = _mm256_andnot_ps(sign, v[u]);
        top = _mm256_max_ps(top, size);
        over = _mm256_or_si256(over, _mm256_cmpgt_epi32(_mm256_castps_si256(size), finite));
    }
    if (!_mm256_testz_si256(over, over)) return 0;
    const float most = limb_max8(top);
    const float step = most / 127.0f, inv = most > 0 ? 127.0f / most : 0.0f;
    for (int u = 0; u < 4; u++) {
        l0[u] = limb_of(_mm256_mul_ps(v[u], _mm256_set1_ps(inv)), 127.0f);
        const __m256 e1 = _mm256_fnmadd_ps(l0[u], _mm256_set1_ps(step), v[u]);
        l1[u] = limb_of(_mm256_mul_ps(e1, _mm256_set1_ps(inv * 128.0f)), 64.0f);
        const __m256 e2 = _mm256_fnmadd_ps(l1[u], _mm256_set1_ps(step / 128.0f), e1);
        l2[u] = limb_of(_mm256_mul_ps(e2, _mm256_set1_ps(inv * 16384.0f)), 64.0f);
    }
    limb_store(L->l[0] + 32 * j, l0);
#if defined(__AVXVNNI__)
    limb_store(L->l[1] + 32 * j, l1);
    limb_store(L->l[2] + 32 * j, l2);
#else
    limb_store12(L->l12 + 32 * j, l1, l2);
#endif
    L->q6k_s[2 * j] = limb_sum8(_mm256_add_ps(v[0], v[1]));
    L->q6k_s[2 * j + 1] = limb_sum8(_mm256_add_ps(v[2], v[3]));
    const float unit = step / 16384.0f;
    L->q4k[j] = unit;
    L->q4k[8 + j] = L->q6k_s[2 * j] + L->q6k_s[2 * j + 1];
    L->q6k_u[2 * j] = L->q6k_u[2 * j + 1] = unit;
    return 1;
}

/* Each lane's 4 codes (unsigned bytes) times run j's limbs in L: S. With AVX-VNNI (Alder
 * Lake and later Intel cores) vpdpbusd makes it as the AVX-512 tiles do. Without it the first
 * limb by vpmaddubsw and vpmaddwd (times 16384), the other two as one int16 (l12) by vpmaddwd
 * on the codes widened to int16 (`high`: their upper bytes): four multiplies a run where
 * three limbs by vpmaddubsw take six. S is the same integer either way; a lane's codes are
 * not the AVX-512 lanes' (still one sub-block of 16: 0-15 in lanes 0-3, 16-31 in 4-7). */
#if defined(__AVXVNNI__)
ALWAYS __m256i limb_dot(__m256i codes, const struct limb_block *L, int j) {
    const signed char *l = L->l[0] + 32 * j;
    __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, _mm256_loadu_si256((const __m256i *)l));
    s = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 7), codes, _mm256_loadu_si256((const __m256i *)(l + 256)));
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 7), codes, _mm256_loadu_si256((const __m256i *)(l + 512)));
}

/* The same for signed codes given as their sizes (`codes`) and the codes themselves
 * (`signs`): each limb's sign moved by vpsignb onto its code's (no code is 0), so S sums the
 * signed codes' products. */
ALWAYS __m256i limb_dot_sign(__m256i codes, __m256i signs, const struct limb_block *L, int j) {
    const signed char *l = L->l[0] + 32 * j;
    __m256i v[3];
    for (int i = 0; i < 3; i++) v[i] = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(l + 256 * i)), signs);
    __m256i s = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), codes, v[0]);
    s = _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 7), codes, v[1]);
    return _mm256_dpbusd_avx_epi32(_mm256_slli_epi32(s, 7), codes, v[2]);
}
#else
/* S of codes whose sizes are `sizes` and first limbs l0 (signs moved onto them), their int16
 * values the bytes `codes` with upper bytes `high`. vpmaddubsw's pairs stay below 2^15 (2 x
 * 127 x 127). */
ALWAYS __m256i limb_parts(__m256i sizes, __m256i l0, __m256i codes, __m256i high, const short *l12) {
    const __m256i first = _mm256_madd_epi16(_mm256_maddubs_epi16(sizes, l0), _mm256_set1_epi16(16384));
    const __m256i rest = _mm256_add_epi32(
        _mm256_madd_epi16(_mm256_unpacklo_epi8(codes, high), _mm256_loadu_si256((const __m256i *)l12)),
        _mm256_madd_epi16(_mm256_unpackhi_epi8(codes, high), _mm256_loadu_si256((const __m256i *)(l12 + 16))));
    return _mm256_add_epi32(first, rest);
}

ALWAYS __m256i limb_dot(__m256i codes, const struct limb_block *L, int j) {
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(L->l[0] + 32 * j));
    return limb_parts(codes, l0, codes, _mm256_setzero_si256(), L->l12 + 32 * j);
}

/* The same for signed codes given as their sizes (`codes`) and the codes themselves
 * (`signs`): the first limb's sign moved by vpsignb onto its code's (no code is 0), the
 * codes sign-extended for the other two. */
ALWAYS __m256i limb_dot_sign(__m256i codes, __m256i signs, const struct limb_block *L, int j) {
    const __m256i l0 = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(L->l[0] + 32 * j)), signs);
    const __m256i high = _mm256_cmpgt_epi8(_mm256_setzero_si256(), signs);
    return limb_parts(codes, l0, signs, high, L->l12 + 32 * j);
}
#endif

/* Bit j of each byte of h at bit 4 (16-bit shifts: no byte's bit reaches another's bit 4). */
ALWAYS __m256i bit_at_4(__m256i h, int j) {
    const __m256i t = j < 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4);
    return _mm256_and_si256(t, _mm256_set1_epi8(16));
}

/* dot[r] = A's row (its limbs L) . row r of W (rows[r], 4 rows) in Q4_K (bits 4) or Q5_K
 * (bits 5) blocks: chunk c's 32 bytes of qs hold run 2c in their low nibbles, 2c + 1 in
 * their high ones; Q5_K's fifth bit of run j is bit j of qh[32]. */
ALWAYS void kq_limb_tile(const int bits, int blocks, const unsigned char *const *rows,
                         const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    __m256 acc[RW], rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = rest[r] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15);
    const size_t bytes = KQ_BYTES(bits), qs = bits == 4 ? 16 : 48;
    for (int b = 0; b < blocks; b++, L++) {
        fetch_share(ahead, lines, b, blocks);
        const __m256 units = _mm256_loadu_ps(L->q4k), sums = _mm256_loadu_ps(L->q4k + 8);
        const unsigned char *x4[RW];
        for (int r = 0; r < RW; r++) x4[r] = rows[r] + (size_t)b * bytes;
        __m256 scale[RW], bias[RW];
        q4k_scales2(x4, scale, bias);
        q4k_scales2(x4 + 2, scale + 2, bias + 2);
        _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
            const unsigned char *x = x4[r];
            float f[8]; /* f[j]: sub-block j's scale times a / 16384 */
            _mm256_storeu_ps(f, _mm256_mul_ps(scale[r], units));
            rest[r] = _mm256_fmadd_ps(bias[r], sums, rest[r]);
            const __m256i h = bits == 5 ? _mm256_loadu_si256((const __m256i *)(x + 16)) : _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                const __m256i z = _mm256_loadu_si256((const __m256i *)(x + qs + 32 * c));
                __m256i codes[2] = {_mm256_and_si256(z, low), _mm256_and_si256(_mm256_srli_epi16(z, 4), low)};
                _Pragma("GCC unroll 2") for (int v = 0; v < 2; v++) {
                    const int j = 2 * c + v;
                    if (bits == 5) codes[v] = _mm256_or_si256(codes[v], bit_at_4(h, j));
                    const __m256i s = limb_dot(codes[v], L, j);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(f + j), acc[r]);
                }
            }
        }
    }
    for (int r = 0; r < RW; r++) dot[r] = limb_sum8(_mm256_add_ps(acc[r], rest[r]));
}

/* One block x of a row of W in Q6_K, Q3_K, Q2_K, IQ4_XS or a grid i-quant times A's limbs L,
 * into the row's acc and rest (s16_limb_tile), the codes unsigned as in the AVX-512
 * s16_limb_block (a grid i-quant's as IQ4_XS's: their sizes, the signs onto the limbs). Q6_K: quarter s of half h (values
 * 128h + 32s ..) has its low 4 bits in ql[64h + 32 (s & 1) ..] (s < 2: low nibbles, else
 * high), its high 2 in bits 2s of qh[32h ..]; Q3_K and Q2_K: in bits 2s of qs[32h ..], Q3_K's
 * third bit in bit 4h + s of hmask; IQ4_XS: sub-block 4h + s, its values looked up (vpshufb),
 * their sizes the codes, the limbs' signs moved onto theirs (limb_dot_sign). A run's lanes 0-3
 * are its first sub-block of 16, 4-7 its second. */
ALWAYS void s16_limb_block(const int type, const unsigned char *x, const struct limb_block *L, __m256 *acc,
                           __m256 *rest) {
    const __m256i low4 = _mm256_set1_epi8(15), high2 = _mm256_set1_epi8(0x30);
    const __m256i low2 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256 units[2] = {_mm256_loadu_ps(L->q6k_u), _mm256_loadu_ps(L->q6k_u + 8)};
    const __m256 sums[2] = {_mm256_loadu_ps(L->q6k_s), _mm256_loadu_ps(L->q6k_s + 8)};
    float sc[16], bi[16];
    signed char grid[Q6K_WEIGHTS] __attribute__((aligned(32)));
    if (S16_GRID(type)) /* a grid i-quant's codes (signed) and scales */
        s16_codes(type, x, grid, sc, bi);
    else
        s16_scales(type, x, sc, bi);
    const __m256i hmask = type == S16_Q3K ? _mm256_loadu_si256((const __m256i *)x) : _mm256_setzero_si256();
    _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
        const __m256 scale = _mm256_loadu_ps(sc + 8 * h);
        /* IQ4_XS's and the grids' signed codes: their sizes, the signs on the limbs (no offset) */
        const int signed_codes = type == S16_IQ4XS || S16_GRID(type);
        if (!signed_codes)
            *rest = _mm256_fmadd_ps(type == S16_Q2K ? _mm256_loadu_ps(bi + 8 * h) : scale, sums[h], *rest);
        const __m256 f = _mm256_mul_ps(scale, units[h]); /* sub-blocks 8h .. 8h + 7 */
        __m256i codes[4], signs[4];
        if (S16_GRID(type)) {
            /* run 4h + s's 32 codes in order of k: their sizes, their signs moved onto the
             * limbs as IQ4_XS's (|code| <= 62) */
            _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {
                signs[s] = _mm256_load_si256((const __m256i *)(grid + 32 * (4 * h + s)));
                codes[s] = _mm256_abs_epi8(signs[s]);
            }
        } else if (type == S16_IQ4XS) {
            const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_VALUES));
            _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {
                const __m128i q = _mm_loadu_si128((const __m128i *)(x + 8 + 16 * (4 * h + s)));
                const __m128i lo = _mm_and_si128(q, _mm_set1_epi8(15));
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), _mm_set1_epi8(15));
                signs[s] = _mm256_shuffle_epi8(table, _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
                codes[s] = _mm256_abs_epi8(signs[s]);
            }
        } else if (type == S16_Q6K) {
            const __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x + 64 * h));
            const __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(x + 128 + 32 * h));
            codes[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), high2));
            codes[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), high2));
            codes[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, high2));
            codes[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), high2));
        } else {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(x + (type == S16_Q3K ? 32 : 16) + 32 * h));
            /* Q3_K: bit 4h + s of hmask moved to bit 2 (16-bit shifts: no byte's bit
             * reaches another's bit 2) */
            const __m256i third[4] = {
                _mm256_and_si256(h ? _mm256_srli_epi16(hmask, 2) : _mm256_slli_epi16(hmask, 2), four),
                _mm256_and_si256(h ? _mm256_srli_epi16(hmask, 3) : _mm256_slli_epi16(hmask, 1), four),
                _mm256_and_si256(h ? _mm256_srli_epi16(hmask, 4) : hmask, four),
                _mm256_and_si256(h ? _mm256_srli_epi16(hmask, 5) : _mm256_srli_epi16(hmask, 1), four),
            };
            codes[0] = _mm256_and_si256(q, low2);
            codes[1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), low2);
            codes[2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low2);
            codes[3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), low2);
            if (type == S16_Q3K)
                _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) codes[s] = _mm256_or_si256(codes[s], third[s]);
        }
        _Pragma("GCC unroll 4") for (int s = 0; s < 4; s++) {
            const __m256i at = _mm256_setr_epi32(2 * s, 2 * s, 2 * s, 2 * s, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1);
            const int j = 4 * h + s;
            const __m256i dots = signed_codes ? limb_dot_sign(codes[s], signs[s], L, j) : limb_dot(codes[s], L, j);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_permutevar8x32_ps(f, at), *acc);
        }
    }
}

/* dot[r] = A's row (its limbs L) . row r of W (rows[r], 4 rows) in Q6_K, Q3_K, Q2_K, IQ4_XS
 * or grid i-quant blocks (s16_limb_block); Q6_K a row at a time, as the AVX-512 tile reads
 * it. */
ALWAYS void s16_limb_tile(const int type, int blocks, const unsigned char *const *rows,
                          const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    __m256 acc[RW], rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = rest[r] = _mm256_setzero_ps();
    const size_t bytes = S16_BYTES(type);
    if (type == S16_Q6K) { /* measured: one row of Qwen3-0.6B's shapes, 24 -> 27.5 GFLOP/s on one thread */
        for (int r = 0; r < RW; r++)
            for (int b = 0; b < blocks; b++) {
                fetch_share(ahead, lines, r * blocks + b, RW * blocks);
                s16_limb_block(type, rows[r] + (size_t)b * bytes, L + b, &acc[r], &rest[r]);
            }
    } else
        for (int b = 0; b < blocks; b++) {
            fetch_share(ahead, lines, b, blocks);
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++)
                s16_limb_block(type, rows[r] + (size_t)b * bytes, L + b, &acc[r], &rest[r]);
        }
    const float offset = type == S16_Q6K ? -32.0f : type == S16_Q3K ? -4.0f : 1.0f;
    for (int r = 0; r < RW; r++) {
        const __m256 total = type == S16_Q2K ? _mm256_add_ps(acc[r], rest[r])
                                             : _mm256_fmadd_ps(_mm256_set1_ps(offset), rest[r], acc[r]);
        dot[r] = limb_sum8(total);
    }
}
#endif

#if LIMB_PRODUCTS
int limb_split(int m, int k, const float *a, int lda, void *out) {
    if (k % 32) return 0;
    struct limb_block *blocks = out;
    const int nb = (k + 255) / 256;
    for (int i = 0; i < m; i++)
        for (int b = 0; b < nb; b++) {
            struct limb_block *L = blocks + (size_t)i * nb + b;
            const float *x = a + (size_t)i * lda + (size_t)b * 256;
            const int runs = k - 256 * b >= 256 ? 8 : (k - 256 * b) / 32;
            if (runs < 8) memset(L, 0, sizeof(*L));
            for (int j = 0; j < runs; j++)
                if (!limb_run(x + 32 * j, j, L)) return 0;
        }
    return 1;
}

/* s16_limb_tile of a grid i-quant's blocks (`format` W_IQ2XXS .. W_IQ1M), its type a constant
 * in each call (the tile is inlined for it). */
static void grid_limb_tile(int format, int blocks, const unsigned char *const *rows,
                           const struct limb_block *L, float *dot, const char *ahead, int lines) {
    switch (format) {
    case W_IQ2XXS: s16_limb_tile(S16_IQ2XXS, blocks, rows, L, dot, ahead, lines); return;
    case W_IQ2XS: s16_limb_tile(S16_IQ2XS, blocks, rows, L, dot, ahead, lines); return;
    case W_IQ2S: s16_limb_tile(S16_IQ2S, blocks, rows, L, dot, ahead, lines); return;
    case W_IQ3XXS: s16_limb_tile(S16_IQ3XXS, blocks, rows, L, dot, ahead, lines); return;
    case W_IQ3S: s16_limb_tile(S16_IQ3S, blocks, rows, L, dot, ahead, lines); return;
    case W_IQ1S: s16_limb_tile(S16_IQ1S, blocks, rows, L, dot, ahead, lines); return;
    default: s16_limb_tile(S16_IQ1M, blocks, rows, L, dot, ahead, lines); return;
    }
}

/* Columns [j0, j1) of C from p's limbs: 4 rows of W at a time against each row of A, the
 * rows PREFETCH_BLOCKS groups ahead fetched over the first row's blocks. */
static void limb_columns(const struct product *p, size_t row_bytes, int j0, int j1) {
    const int blocks = p->k / 256;
    const unsigned char *base = p->w;
    float dot[4];
    for (int j = j0; j < j1; j += 4) {
        const int nj = j1 - j < 4 ? j1 - j : 4;
        const unsigned char *rows[4];
        for (int r = 0; r < 4; r++) rows[r] = base + (size_t)(j + (r < nj ? r : 0)) * row_bytes;
        const int ahead = j + PREFETCH_BLOCKS * 4, fetch = ahead + 4 <= j1;
        const char *next = fetch ? (const char *)(base + (size_t)ahead * row_bytes) : NULL;
        const int lines = (int)(4 * row_bytes / 64);
        for (int i = 0; i < p->m; i++) {
            const struct limb_block *L = (const struct limb_block *)p->limbs + (size_t)i * blocks;
            if (p->format == W_Q6K)
                s16_limb_tile(S16_Q6K, blocks, rows, L, dot, i ? NULL : next, lines);
            else if (p->format == W_Q3K)
                s16_limb_tile(S16_Q3K, blocks, rows, L, dot, i ? NULL : next, lines);
            else if (p->format == W_Q2K)
                s16_limb_tile(S16_Q2K, blocks, rows, L, dot, i ? NULL : next, lines);
            else if (p->format == W_IQ4XS)
                s16_limb_tile(S16_IQ4XS, blocks, rows, L, dot, i ? NULL : next, lines);
            else if (grid_format(p->format))
                grid_limb_tile(p->format, blocks, rows, L, dot, i ? NULL : next, lines);
            else if (p->format == W_Q4K)
                kq_limb_tile(4, blocks, rows, L, dot, i ? NULL : next, lines);
            else
                kq_limb_tile(5, blocks, rows, L, dot, i ? NULL : next, lines);
            for (int r = 0; r < nj; r++) store(p, i, j + r, dot[r]);
        }
    }
}

#if AFFINE_LIMBS
#if LIMB_PATH == 512
/* dot[r] = A's row (its limbs L) . row r of W (rows[r], 4 rows) in 5-bit affine codes, the
 * rows' scales and biases as float32 (scale[r], bias[r]: group G), two runs of 32 a step.
 * A step's 40 bytes of codes hold 8 codes in each 5 bytes: vpermb puts each 5 in a qword and
 * vpmultishiftqb takes code i from bit 5i of it, one code a byte, in order of k. */
ALWAYS void affine5_limb_tile(int k, int G, const unsigned char *const *rows,
                              const float *const *scale, const float *const *bias,
                              const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    static const char spread[64] __attribute__((aligned(64))) = {
        0,  1,  2,  3,  4,  4,  4,  4,  5,  6,  7,  8,  9,  9,  9,  9,
        10, 11, 12, 13, 14, 14, 14, 14, 15, 16, 17, 18, 19, 19, 19, 19,
        20, 21, 22, 23, 24, 24, 24, 24, 25, 26, 27, 28, 29, 29, 29, 29,
        30, 31, 32, 33, 34, 34, 34, 34, 35, 36, 37, 38, 39, 39, 39, 39};
    const __m512i bytes = _mm512_load_si512((const void *)spread);
    const __m512i fields = _mm512_set1_epi64(0x231E19140F0A0500LL); /* bits 0, 5, .., 35 */
    const __m512i low5 = _mm512_set1_epi8(31);
    /* a run's group in a block of 256 values, for G = 32, 64, 128 */
    const __m256i run_group = G == 32 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                              : G == 64 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                        : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m512 acc[RW];
    __m256 rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = _mm512_setzero_ps(), rest[r] = _mm256_setzero_ps();
    const int blocks = (k + 255) / 256;
    for (int b = 0; b < blocks; b++, L++) {
        const int runs = k - 256 * b >= 256 ? 8 : (k - 256 * b) / 32;
        const __mmask8 in = (__mmask8)((1u << ((runs * 32 + G - 1) / G)) - 1);
        const __m256 units = _mm256_loadu_ps(L->q4k), sums = _mm256_loadu_ps(L->q4k + 8);
        __m512 f[RW]; /* lanes 0-7: each run's scale times a / 16384 */
        const size_t g0 = (size_t)b * (256 / G);
        for (int r = 0; r < RW; r++) {
            const __m256 s = _mm256_permutexvar_ps(run_group, _mm256_maskz_loadu_ps(in, scale[r] + g0));
            const __m256 c = _mm256_permutexvar_ps(run_group, _mm256_maskz_loadu_ps(in, bias[r] + g0));
            f[r] = _mm512_castps256_ps512(_mm256_mul_ps(s, units));
            rest[r] = _mm256_fmadd_ps(c, sums, rest[r]);
        }
        for (int j = 0; j < runs; j += 2) {
            const int t = 256 * b + 32 * j;
            fetch_share(ahead, lines, t / 64, k / 64);
            const __m512i at = _mm512_setr_epi32(j, j, j, j, j, j, j, j, j + 1, j + 1, j + 1, j + 1, j + 1,
                                                 j + 1, j + 1, j + 1);
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
                const __m512i raw = _mm512_maskz_loadu_epi8(0xffffffffffULL, rows[r] + (size_t)t * 5 / 8);
                const __m512i codes =
                    _mm512_and_si512(_mm512_multishift_epi64_epi8(fields, _mm512_permutexvar_epi8(bytes, raw)), low5);
                const __m512i s = limb_dot(codes, L->l[0] + 32 * j);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(at, f[r]), acc[r]);
            }
        }
    }
    for (int r = 0; r < RW; r++)
        dot[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(_mm512_zextps256_ps512(rest[r]));
}

#else
/* The same with 256-bit vectors (AVX2), a run of 32 codes (20 bytes) a step: each half of a
 * register takes 16 codes from 10 bytes (the high half's bytes loaded from 8 on, masked so
 * nothing past the run is read), vpshufb puts each code's two bytes in a 16-bit lane, a
 * multiply by 2^(11 - s) brings the code (bits s.. of them) to the lane's top and a shift to
 * its bottom, and vpackuswb makes them bytes in order of k: 10 instructions for 32 codes. */
ALWAYS void affine5_limb_tile(int k, int G, const unsigned char *const *rows,
                              const float *const *scale, const float *const *bias,
                              const struct limb_block *L, float *dot, const char *ahead, int lines) {
    enum { RW = 4 };
    /* code i of 8 (bit 5i) in bytes 5i / 8 and the next: codes 0-7 (pick_a) and 8-15 (pick_b)
     * of each half; the high half's bytes start 2 on (loaded from byte 8 of the run) */
    const __m256i pick_a = _mm256_setr_epi8(0, 1, 0, 1, 1, 2, 1, 2, 2, 3, 3, 4, 3, 4, 4, 5,
                                            2, 3, 2, 3, 3, 4, 3, 4, 4, 5, 5, 6, 5, 6, 6, 7);
    const __m256i pick_b = _mm256_setr_epi8(5, 6, 5, 6, 6, 7, 6, 7, 7, 8, 8, 9, 8, 9, 9, 10,
                                            7, 8, 7, 8, 8, 9, 8, 9, 9, 10, 10, 11, 10, 11, 11, 12);
    const __m256i up = _mm256_setr_epi16(1 << 11, 1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8,
                                         1 << 11, 1 << 6, 1 << 9, 1 << 4, 1 << 7, 1 << 10, 1 << 5, 1 << 8);
    const __m128i upper = _mm_setr_epi32(-1, -1, -1, 0); /* bytes 8-19 of a run */
    /* a run's group in a block of 256 values, for G = 32, 64, 128 */
    const __m256i run_group = G == 32 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                              : G == 64 ? _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)
                                        : _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 acc[RW], rest[RW];
    for (int r = 0; r < RW; r++) acc[r] = rest[r] = _mm256_setzero_ps();
    const int blocks = (k + 255) / 256;
    for (int b = 0; b < blocks; b++, L++) {
        const int runs = k - 256 * b >= 256 ? 8 : (k - 256 * b) / 32;
        const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32((runs * 32 + G - 1) / G),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 units = _mm256_loadu_ps(L->q4k), sums = _mm256_loadu_ps(L->q4k + 8);
        float f[RW][8]; /* each run's scale times a / 16384 */
        const size_t g0 = (size_t)b * (256 / G);
        for (int r = 0; r < RW; r++) {
            const __m256 s = _mm256_permutevar8x32_ps(_mm256_maskload_ps(scale[r] + g0, in), run_group);
            const __m256 c = _mm256_permutevar8x32_ps(_mm256_maskload_ps(bias[r] + g0, in), run_group);
            _mm256_storeu_ps(f[r], _mm256_mul_ps(s, units));
            rest[r] = _mm256_fmadd_ps(c, sums, rest[r]);
        }
        for (int j = 0; j < runs; j++) {
            const int t = 256 * b + 32 * j;
            fetch_share(ahead, lines, t / 32, k / 32);
            _Pragma("GCC unroll 4") for (int r = 0; r < RW; r++) {
                const unsigned char *x = rows[r] + (size_t)t * 5 / 8;
                const __m256i raw = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)x)),
                                                            _mm_maskload_epi32((const int *)(x + 8), upper), 1);
                const __m256i lo = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(raw, pick_a), up), 11);
                const __m256i hi = _mm256_srli_epi16(_mm256_mullo_epi16(_mm256_shuffle_epi8(raw, pick_b), up), 11);
                const __m256i s = limb_dot(_mm256_packus_epi16(lo, hi), L, j);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcast_ss(f[r] + j), acc[r]);
            }
        }
    }
    for (int r = 0; r < RW; r++) dot[r] = limb_sum8(_mm256_add_ps(acc[r], rest[r]));
}
#endif

/* Columns [j0, j1) of C from p's limbs and 5-bit affine codes: 4 rows of W at a time against
 * each row of A, the rows PREFETCH_BLOCKS groups ahead fetched over the first row's steps. */
static void affine5_limb_columns(const struct product *p, int j0, int j1) {
    const int k = p->k, G = p->group, groups = k / G, blocks = (k + 255) / 256;
    const size_t row_bytes = (size_t)k * 5 / 8;
    const unsigned char *base = p->w;
    float *widened = thread_buffer(1, (size_t)8 * groups);
    float dot[4];
    for (int j = j0; j < j1; j += 4) {
        const int nj = j1 - j < 4 ? j1 - j : 4;
        const float *s0 = float_scales(p->scales, p->scale_format, (size_t)j * groups, nj * groups, widened);
        const float *b0 = float_scales(p->biases, p->scale_format, (size_t)j * groups, nj * groups,
                                       widened + (size_t)4 * groups);
        const unsigned char *rows[4];
        const float *scale[4], *bias[4];
        for (int r = 0; r < 4; r++) {
            const int row = r < nj ? r : 0;
            rows[r] = base + (size_t)(j + row) * row_bytes;
            scale[r] = s0 + (size_t)row * groups;
            bias[r] = b0 + (size_t)row * groups;
        }
        const int ahead = j + PREFETCH_BLOCKS * 4, fetch = ahead + 4 <= j1;
        const char *next = fetch ? (const char *)(base + (size_t)ahead * row_bytes) : NULL;
        const int lines = (int)(4 * row_bytes / 64);
        for (int i = 0; i < p->m; i++) {
            const struct limb_block *L = (const struct limb_block *)p->limbs + (size_t)i * blocks;
            affine5_limb_tile(k, G, rows, scale, bias, L, dot, i ? NULL : next, lines);
            for (int r = 0; r < nj; r++) store(p, i, j + r, dot[r]);
        }
    }
}
#endif
#else
int limb_split(int m, int k, const float *a, int lda, void *out) {
    (void)m, (void)k, (void)a, (void)lda, (void)out;
    return 0;
}
#endif

/* --- block formats: the products ---------------------------------------------------------- */

typedef void (*block_stream_fn)(int, const unsigned char *const *, const float *const *, float *,
                                const char *, int);

/* Bytes and weights a block (256, IQ4_NL's 32), the stream tiles and the row dequantizer of a
 * GGML block format. */
struct block_format {
    size_t bytes;
    int weights;
    block_stream_fn one, two;
    void (*dequantize_row)(int k, const unsigned char *row, float *out);
};

static const struct block_format *block_format_of(int format) {
    static const struct block_format q6k = {Q6K_BYTES, 256, q6k_stream_1, q6k_stream_2, q6k_dequantize_row};
    static const struct block_format q4k = {Q4K_BYTES, 256, q4k_stream_1, q4k_stream_2, q4k_dequantize_row};
    static const struct block_format q5k = {Q5K_BYTES, 256, q5k_stream_1, q5k_stream_2, q5k_dequantize_row};
    static const struct block_format q3k = {Q3K_BYTES, 256, q3k_stream_1, q3k_stream_2, q3k_dequantize_row};
    static const struct block_format q2k = {Q2K_BYTES, 256, q2k_stream_1, q2k_stream_2, q2k_dequantize_row};
    static const struct block_format iq4xs = {IQ4XS_BYTES, 256, iq4xs_stream_1, iq4xs_stream_2, iq4xs_dequantize_row};
    static const struct block_format iq4nl = {IQ4NL_BYTES, IQ4NL_WEIGHTS, iq4nl_stream_1, iq4nl_stream_2,
                                              iq4nl_dequantize_row};
    static const struct block_format gf16 = {HALF_ROW_BYTES, HALF_ROW_WEIGHTS, gf16_stream_1, gf16_stream_2,
                                             gf16_dequantize_row};
    static const struct block_format gbf16 = {HALF_ROW_BYTES, HALF_ROW_WEIGHTS, gbf16_stream_1, gbf16_stream_2,
                                              gbf16_dequantize_row};
#define GRID_FORMAT(name, bytes) \
    static const struct block_format name = {bytes, 256, name##_stream_1, name##_stream_2, name##_dequantize_row}
    GRID_FORMAT(iq2xxs, IQ2XXS_BYTES);
    GRID_FORMAT(iq2xs, IQ2XS_BYTES);
    GRID_FORMAT(iq2s, IQ2S_BYTES);
    GRID_FORMAT(iq3xxs, IQ3XXS_BYTES);
    GRID_FORMAT(iq3s, IQ3S_BYTES);
    GRID_FORMAT(iq1s, IQ1S_BYTES);
    GRID_FORMAT(iq1m, IQ1M_BYTES);
#undef GRID_FORMAT
    switch (format) {
    case W_Q6K: return &q6k;
    case W_Q4K: return &q4k;
    case W_Q5K: return &q5k;
    case W_Q3K: return &q3k;
    case W_Q2K: return &q2k;
    case W_IQ4XS: return &iq4xs;
    case W_IQ4NL: return &iq4nl;
    case W_IQ2XXS: return &iq2xxs;
    case W_IQ2XS: return &iq2xs;
    case W_IQ2S: return &iq2s;
    case W_IQ3XXS: return &iq3xxs;
    case W_IQ3S: return &iq3s;
    case W_IQ1S: return &iq1s;
    case W_IQ1M: return &iq1m;
    case W_GF16: return &gf16;
    case W_GBF16: return &gbf16;
    default: return NULL;
    }
}

/* The block tiles' fill (fill_fn) for a GGML format (ctx: its block_format). */
static void ggml_rows_fill(const struct product *p, int j, int nj, float *w, const void *ctx) {
    const struct block_format *f = ctx;
    const size_t row_bytes = (size_t)p->k / f->weights * f->bytes;
    int r = 0;
    if (p->format == W_Q4K || p->format == W_Q5K) /* the scales of 4 rows at once */
        for (; r + 4 <= nj; r += 4) {
            const unsigned char *rows[4];
            for (int i = 0; i < 4; i++) rows[i] = (const unsigned char *)p->w + (size_t)(j + r + i) * row_bytes;
            kq_dequantize_rows4(p->format == W_Q4K ? 4 : 5, p->k, rows, w + (size_t)r * p->k);
        }
    for (; r < nj; r++)
        f->dequantize_row(p->k, (const unsigned char *)p->w + (size_t)(j + r) * row_bytes,
                          w + (size_t)r * p->k);
}

#if AMX_PRODUCTS
void ggml_tile_codes(const struct product *p, int j, unsigned char *codes, float *scale,
                     float *bias) {
    const int blocks = p->k / Q4K_WEIGHTS, five = p->format == W_Q5K;
    const size_t bytes = five ? Q5K_BYTES : Q4K_BYTES, row_bytes = (size_t)blocks * bytes;
    const unsigned char *base = (const unsigned char *)p->w + (size_t)j * row_bytes;
    const unsigned char *row[AMX_BLOCK];
    for (int r = 0; r < AMX_BLOCK; r++) row[r] = base + (size_t)(j + r < p->n ? r : p->n - 1 - j) * row_bytes;
    const __m512i low = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    /* the next block of rows fetched a block of 256 at a time while this one's are read */
    const int ahead = j + 2 * AMX_BLOCK <= p->n;
    for (int b = 0; b < blocks; b++) {
        const size_t at = (size_t)b * bytes;
        if (ahead)
            for (int r = 0; r < AMX_BLOCK; r++)
                for (size_t line = 0; line < bytes; line += 64)
                    __builtin_prefetch(row[r] + AMX_BLOCK * row_bytes + at + line, 0, 1);
        /* the 16 rows' scales (lanes 0-7) and biases (8-15), then each sub-block's across the
         * rows */
        __m512i v[AMX_BLOCK], d[AMX_BLOCK];
        for (int r = 0; r < AMX_BLOCK; r += 4) {
            const unsigned char *four[4] = {row[r] + at, row[r + 1] + at, row[r + 2] + at, row[r + 3] + at};
            q4k_scales4(four, (__m512 *)(v + r));
        }
        transpose16(v, d);
        for (int s = 0; s < 8; s++) {
            _mm512_storeu_si512((void *)(scale + (8 * b + s) * AMX_BLOCK), d[s]);
            _mm512_storeu_si512((void *)(bias + (8 * b + s) * AMX_BLOCK), d[8 + s]);
        }
        /* Q5_K's fifth bits: qh[l] of each row, as dwords 0-7 (a row's 32 bytes) */
        __m512i qh[AMX_BLOCK];
        if (five) {
            for (int r = 0; r < AMX_BLOCK; r++)
                v[r] = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(row[r] + at + 16)));
            transpose16(v, qh);
        }
        /* qs[32c + l]: run 2c's code l in its low nibble, run 2c + 1's in its high one (Q5_K:
         * plus 16 times bit 2c, 2c + 1 of qh[l]); the tile's row t holds codes 4t .. 4t + 3 of
         * each of the 16 rows of W: dword 8c + t of qs, in two halves of 64 bytes */
        const size_t qs = at + (five ? 48 : 16);
        for (int h = 0; h < 2; h++) {
            for (int r = 0; r < AMX_BLOCK; r++) v[r] = _mm512_loadu_si512((const void *)(row[r] + qs + 64 * h));
            transpose16(v, d);
            for (int i = 0; i < 16; i++) {
                const int c = 2 * h + i / 8, t = i % 8;
                __m512i lo = _mm512_and_si512(d[i], low), hi = _mm512_and_si512(_mm512_srli_epi16(d[i], 4), low);
                if (five) { /* bit 2c (2c + 1) of each byte, moved to bit 4 */
                    lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[t], 2 * c), one), 4));
                    hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh[t], 2 * c + 1), one), 4));
                }
                /* run r's tile: rows 0-7 the codes times 8 (the first digit's), 8-15 the codes */
                unsigned char *to = codes + (size_t)(8 * b + 2 * c) * 1024 + 64 * t;
                _mm512_storeu_si512((void *)to, _mm512_slli_epi16(lo, 3));
                _mm512_storeu_si512((void *)(to + 512), lo);
                _mm512_storeu_si512((void *)(to + 1024), _mm512_slli_epi16(hi, 3));
                _mm512_storeu_si512((void *)(to + 1536), hi);
            }
        }
    }
}

#if defined(__AVX512VBMI__)
/* Byte b of qword j of a PACKED step's spread: the step's byte bits * j + b (its 8 codes'
 * `bits` bytes), the last one again past them. */
#define SPB(bits, j, b) ((bits) * (j) + ((b) < (bits) ? (b) : (bits) - 1))
#define SPQ(bits, j) SPB(bits, j, 0), SPB(bits, j, 1), SPB(bits, j, 2), SPB(bits, j, 3), \
                     SPB(bits, j, 4), SPB(bits, j, 5), SPB(bits, j, 6), SPB(bits, j, 7)
#define SPREAD(bits) {SPQ(bits, 0), SPQ(bits, 1), SPQ(bits, 2), SPQ(bits, 3), \
                      SPQ(bits, 4), SPQ(bits, 5), SPQ(bits, 6), SPQ(bits, 7)}
static const char codes_spread[6][64] __attribute__((aligned(64))) = {
    [2] = SPREAD(2), [3] = SPREAD(3), [5] = SPREAD(5)};
#define CODES_OVERREAD 0
#else
#define CODES_OVERREAD 1 /* affine_codes64's unit loads read past a PACKED step's bytes */
#endif

/* 64 codes of a row of `bits`-bit affine codes (bits < 6) from position t, one a byte in
 * order of k: 4 bits' 32 bytes widened to words, each word's two nibbles made its two bytes;
 * PACKED widths' 8 * bits bytes with VBMI by vpermb (each 8 codes' bytes in a qword) and
 * vpmultishiftqb (code i from bit bits * i of it), a masked load reading none past them; else
 * four units (unit_load) masked and narrowed, reading past them (the caller's `tail`). */
ALWAYS __m512i affine_codes64(const int bits, const unsigned char *row, size_t t) {
    if (bits == 4) {
        const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + t / 2)));
        return _mm512_or_si512(_mm512_and_si512(x, _mm512_set1_epi16(0x000f)),
                               _mm512_and_si512(_mm512_slli_epi16(x, 4), _mm512_set1_epi16(0x0f00)));
    }
#if defined(__AVX512VBMI__)
    long long fields = 0; /* bits 0, bits, .., 7 bits (a constant where inlined) */
    for (int i = 0; i < 8; i++) fields |= (long long)(bits * i) << (8 * i);
    const __m512i raw = _mm512_maskz_loadu_epi8((__mmask64)((1ULL << (8 * bits)) - 1), row + t * bits / 8);
    const __m512i spread = _mm512_permutexvar_epi8(_mm512_load_si512((const void *)codes_spread[bits]), raw);
    return _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(fields), spread),
                            _mm512_set1_epi8((char)((1 << bits) - 1)));
#else
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    __m128i q[4];
    for (int u = 0; u < 4; u++)
        q[u] = _mm512_cvtepi32_epi8(_mm512_and_si512(unit_load(bits, row, t + 16 * (size_t)u), mask));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q[1], q[0])), _mm256_set_m128i(q[3], q[2]), 1);
#endif
}

/* ggml_tile_codes for W_AFFINE codes of `bits` (2-5: below 32, as the tiles' [8 q, q] need),
 * k a multiple of 64: two runs a step, 64 codes of each of the 16 rows transposed by dwords;
 * each run's scale and bias its group's. */
ALWAYS void affine_tile_codes_of(const int bits, const struct product *p, int j, unsigned char *codes,
                                 float *scale, float *bias) {
    const int k = p->k, G = p->group, groups = k / G, runs = k / 32;
    const size_t row_bytes = (size_t)k * bits / 8;
    const unsigned char *row[AMX_BLOCK];
    float *widened = thread_buffer(1, (size_t)2 * groups);
    for (int r = 0; r < AMX_BLOCK; r++) {
        const int at = j + r < p->n ? j + r : p->n - 1;
        row[r] = (const unsigned char *)p->w + (size_t)at * row_bytes;
        const float *s0 = float_scales(p->scales, p->scale_format, (size_t)at * groups, groups, widened);
        const float *b0 = float_scales(p->biases, p->scale_format, (size_t)at * groups, groups, widened + groups);
        for (int s = 0; s < runs; s++) {
            scale[s * AMX_BLOCK + r] = s0[s * 32 / G];
            bias[s * AMX_BLOCK + r] = b0[s * 32 / G];
        }
    }
    /* a row's last step read from a copy where unit_load reads past its bytes */
    const int overreads = PACKED(bits) && CODES_OVERREAD;
    unsigned char tail[AMX_BLOCK][64] __attribute__((aligned(64)));
    if (overreads)
        for (int r = 0; r < AMX_BLOCK; r++) {
            memset(tail[r], 0, 64);
            memcpy(tail[r], row[r] + (size_t)(k - 64) * bits / 8, (size_t)8 * bits);
        }
    for (int t = 0; t < k; t += 64) {
        __m512i v[AMX_BLOCK], d[AMX_BLOCK];
        for (int r = 0; r < AMX_BLOCK; r++)
            v[r] = overreads && t + 64 == k ? affine_codes64(bits, tail[r], 0) : affine_codes64(bits, row[r], (size_t)t);
        transpose16(v, d);
        /* dword i of the 64 codes: run t / 32 + i / 8's tile row i % 8 (codes 4i .. 4i + 3) */
        for (int i = 0; i < AMX_BLOCK; i++) {
            unsigned char *to = codes + (size_t)(t / 32 + i / 8) * 1024 + 64 * (i % 8);
            _mm512_storeu_si512((void *)to, _mm512_slli_epi16(d[i], 3));
            _mm512_storeu_si512((void *)(to + 512), d[i]);
        }
    }
}

void affine_tile_codes(const struct product *p, int j, unsigned char *codes, float *scale, float *bias) {
    switch (p->bits) {
    case 2: affine_tile_codes_of(2, p, j, codes, scale, bias); break;
    case 3: affine_tile_codes_of(3, p, j, codes, scale, bias); break;
    case 4: affine_tile_codes_of(4, p, j, codes, scale, bias); break;
    default: affine_tile_codes_of(5, p, j, codes, scale, bias); break;
    }
}
#endif

int ggml_supported(const struct step_weight *w, int n, int k) {
    const struct block_format *f = block_format_of(w->format);
    return f && w->data && n > 0 && k > 0 && k % f->weights == 0;
}

/* Whether a product of GGUF F16 / BF16 rows takes the panel tiles (half_rows_columns): not a
 * decode step's rows (limbs made for them: limbs_read), which the rows' own stream tiles
 * read at memory's rate where making a block's panels for one row's product takes 1.6x the
 * time (Qwen3-0.6B's matrices in float16, 2026-12-07): a decode step's own bits, as the
 * K-quants' limbs give theirs. */
static int half_rows_panels(const struct product *p) {
    return HALF_WEIGHTS && half_row_format(p->format) && p->alpha == 1.0f && p->beta == 0.0f &&
           !p->limbs;
}

int ggml_block(const struct product *p) {
    return p->amx ? AMX_BLOCK : half_rows_panels(p) ? panel_block(p) : BLOCK_RW;
}

/* Columns [j0, j1) of C from W in a GGML block format: stream tiles for up to STREAM_ROWS rows
 * of A (BLOCK_RW rows of W at a time, the block PREFETCH_BLOCKS ahead fetched over the
 * first tile's steps), block tiles for more. */
void ggml_columns(const struct product *p, int j0, int j1) {
    const struct block_format *f = block_format_of(p->format);
    const size_t row_bytes = (size_t)p->k / f->weights * f->bytes;
    if (half_rows_panels(p)) {
        half_rows_columns(p, j0, j1);
        return;
    }
#if AMX_PRODUCTS
    if (p->amx) { /* a forward's rows on AMX tiles (amx_rows_of) */
        amx_columns(p, j0, j1);
        return;
    }
#endif
#if LIMB_PRODUCTS
    if (p->limbs && limb_format(p->format)) { /* a decode step's rows, any number of them */
        limb_columns(p, row_bytes, j0, j1);
        return;
    }
#endif
    if (p->m > STREAM_ROWS) {
        block_columns(p, j0, j1, row_bytes, ggml_rows_fill, f);
        return;
    }
    const unsigned char *base = p->w;
    float dot[2 * BLOCK_RW];
    for (int j = j0; j < j1; j += BLOCK_RW) {
        const int nj = j1 - j < BLOCK_RW ? j1 - j : BLOCK_RW;
        const unsigned char *rows[BLOCK_RW];
        for (int r = 0; r < BLOCK_RW; r++) rows[r] = base + (size_t)(j + (r < nj ? r : 0)) * row_bytes;
        const int ahead = j + PREFETCH_BLOCKS * BLOCK_RW, fetch = ahead + BLOCK_RW <= j1;
        const char *next = fetch ? (const char *)(base + (size_t)ahead * row_bytes) : NULL;
        const int lines = (int)(BLOCK_RW * row_bytes / 64);
        for (int i = 0; i < p->m; i += 2) {
            const int ni = p->m - i < 2 ? p->m - i : 2;
            const float *a[2] = {p->a + (size_t)i * p->lda, p->a + (size_t)(i + ni - 1) * p->lda};
            (ni == 2 ? f->two : f->one)(p->k, rows, a, dot, i ? NULL : next, lines);
            for (int ii = 0; ii < ni; ii++)
                for (int r = 0; r < nj; r++) store(p, i + ii, j + r, dot[ii * BLOCK_RW + r]);
        }
    }
}
