/* What every kernel file uses (cpu_kernels.c includes the files, and states the invariants
   they share): dtypes and bf16 rounding, rows in and out, SIMD vectors of the ISA's width,
   the ISA switches, and one row of the ops that other kernels fuse (RMSNorm, SiLU-and-mul,
   rotary), one code for both, so they round alike. Functions are here only where two files
   or more call them. The header is for the one translation unit of cpu_kernels.c, and its
   functions keep the `static` or `static inline` they had in one file: GCC's inliner weighs
   the keyword (with it, normalize_row, silu_mul_row and rotary_coefficients were inlined
   into every caller, which changed the machine code). */
#ifndef PD_CPU_KERNELS_H
#define PD_CPU_KERNELS_H

#include <math.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Weight dtypes also: GGUF's quantized blocks (kernels/csrc/quantized.c), numbered as ggml numbers them. */
enum { F32 = 0, BF16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
#define QUANTIZED(wdtype) ((wdtype) >= Q4_0)
typedef uint16_t bf16_t;
/* One SIMD register of floats: GCC lowers vectors wider than the ISA's badly, so match it. */
#if defined(__AVX512F__)
#define VLEN 16
#elif defined(__AVX__)
#define VLEN 8
#else
#define VLEN 4
#endif
typedef float vecf __attribute__((vector_size(VLEN * 4)));
typedef uint16_t vech __attribute__((vector_size(VLEN * 2)));
typedef uint32_t vecu __attribute__((vector_size(VLEN * 4)));

static inline float bf16_to_f32(bf16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to bf16 as torch rounds (nearest, ties to even; NaN stays NaN), as fp32 bits: in
   32-bit lanes, so a loop of them vectorizes without narrowing to 16 bits and back. */
static inline uint32_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}

static inline bf16_t f32_to_bf16(float f) { return (bf16_t)(bf16_bits(f) >> 16); }

/* f rounded to dtype, kept in fp32. */
static inline float round_to(float f, int dtype) {
    if (dtype != BF16) return f;
    const uint32_t r = bf16_bits(f);
    memcpy(&f, &r, 4);
    return f;
}

static void load_row(float *dst, const void *src, int64_t n, int dtype) {
    if (dtype == BF16) {
        const bf16_t *s = (const bf16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

static void store_row(void *dst, const float *src, int64_t n, int dtype) {
    if (dtype == BF16) {
        bf16_t *d = (bf16_t *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = f32_to_bf16(src[i]);
    } else {
        memcpy(dst, src, n * sizeof(float));
    }
}

/* Row-wise ops split their rows over the threads only from this many rows (a prefill):
   below it, waking the pool costs more than the work. */
#define PARALLEL_MIN_ROWS 32

static inline void *at(const void *base, int64_t index, int dtype) {
    return (char *)base + index * (dtype == BF16 ? 2 : 4);
}

/* exp(x) for x <= 0, in a form the compiler vectorizes (libm's expf is scalar): Cody-Waite
   range reduction x = k ln2 + r, then Cephes' degree-6 polynomial; within 2 ulp of expf. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x; /* exp(-87) ~ 1.6e-38: the smallest normal scale below */
    float k = __builtin_rintf(x * 1.44269504f);
    float r = x - k * 0.693359375f + k * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return (r * r * p + r + 1.0f) * scale;
}

#if VLEN == 16
/* 16 bf16 values as fp32 lanes: one widening and a shift (GCC's generic conversion takes two
   halves and an insert). */
static inline __attribute__((always_inline)) __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

static inline vecf load_vec(const void *p, int dtype) {
    vecf f;
#if VLEN == 16
    if (dtype == BF16) return (vecf)widen_bf16(_mm256_loadu_si256((const __m256i *)p));
#elif VLEN == 8 && defined(__AVX2__)
    if (dtype == BF16) return (vecf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#endif
    if (dtype == BF16) {
        vech h;
        memcpy(&h, p, sizeof h);
        vecu u = __builtin_convertvector(h, vecu) << 16;
        memcpy(&f, &u, sizeof f);
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

/* AMX tiles (Sapphire Rapids+), which the linear and the attention multiply in where the
   build has them (-march=native on such a CPU, not capped): HAVE_AMX. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
/* Linux gives a process AMX's tile state only when it asks (oneDNN asks too); asked once. */
static int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

/* All 8 tiles 16 rows x 64 bytes. The linear's: 0, 1 the fp32 sums of two output blocks;
   2: x; 3, 4: the blocks' weights. The attention's: amx_attend. */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t bytes_per_row[16];
        uint8_t rows[16];
    } __attribute__((packed)) config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}
#endif

/* ---- one row of an op, shared by its kernel and the kernels that fuse it ---- */

/* RMSNorm of one row in place, Hugging Face numerics: normalise in fp32, round to x's dtype,
   then scale (the product is left for the caller to round to its output dtype). */
static void normalize_row(float *row, const float *wf, int64_t H, float eps, int dtype) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; j++) ss += row[j] * row[j];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int64_t j = 0; j < H; j++) row[j] = wf[j] * round_to(row[j] * inv, dtype);
}

/* sigmoid(x) * x in fp32 for any x: exp only of a non-positive number, so it never overflows. */
static inline float silu(float x) {
    const float e = exp_nonpositive(-fabsf(x)); /* exp(-|x|): sigmoid(x) = 1 / (1 + e), or e / (1 + e) below 0 */
    return x * ((x < 0.f ? e : 1.f) / (1.f + e));
}

/* out [I] = silu(gate) * up from x [2I] = gate | up, rounded as torch's `F.silu(gate) * up`
   rounds: silu to dtype, then the product. scratch: 2I floats. */
static void silu_mul_row(float *out, float *scratch, const void *x, int64_t I, int dtype) {
    load_row(scratch, x, 2 * I, dtype);
    if (dtype == BF16) /* a constant dtype in each loop: both vectorize */
        for (int64_t i = 0; i < I; i++) out[i] = round_to(round_to(silu(scratch[i]), BF16) * scratch[I + i], BF16);
    else
        for (int64_t i = 0; i < I; i++) out[i] = silu(scratch[i]) * scratch[I + i];
}

/* The rounded cos and sin of one position: c, s [D/2] from cos_sin's row (fp32 [P, D]: cos in
   the first half, sin in the second), as torch rounds the table to x's dtype. */
static void rotary_coefficients(float *c, float *s, const float *cos_sin, int64_t position, int64_t D, int dtype) {
    const float *cs = cos_sin + position * D;
    for (int64_t i = 0; i < D / 2; i++) c[i] = round_to(cs[i], dtype), s[i] = round_to(cs[D / 2 + i], dtype);
}

/* One head's row rotated: res [D] from row [D]. In bf16 every product and the sum are
   rounded, as torch's `x * cos + rotate_half(x) * sin` rounds them. */
static void rotate_row(float *res, const float *row, const float *c, const float *s, int64_t D, int dtype) {
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float x1 = row[i], x2 = row[half + i];
        res[i] = round_to(round_to(x1 * c[i], dtype) + round_to(-x2 * s[i], dtype), dtype);
        res[half + i] = round_to(round_to(x2 * c[i], dtype) + round_to(x1 * s[i], dtype), dtype);
    }
}

/* ---- exported functions that other files call (kernels/cpu.py calls them all) ---- */

/* What a linear may compute on its input rows as it reads them (the op before it, fused):
     LINEAR_RMS_NORM  x: [B, K]  -> rms_norm(x) * norm_w, as pd_rms_norm computes it;
     LINEAR_SILU_MUL  x: [B, 2K] -> silu(x[:, :K]) * x[:, K:], each rounded to dtype as torch's
                                    `F.silu(gate) * up` rounds it. */
enum { LINEAR_PLAIN = 0, LINEAR_RMS_NORM = 1, LINEAR_SILU_MUL = 2 };

void pd_linear(const void *x, int prologue, const void *norm_w, float eps, const void *wp, const void *bias,
               const void *residual, void *y, int64_t B, int64_t K, int64_t O, int dtype, int wdtype, int nthreads);

void pd_rotary_store_attend(void *out, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                            int64_t v_stride, int dtype, const int64_t *positions, const float *cos_sin,
                            const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, int64_t B,
                            int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int nthreads);

#endif
