/* CPU kernels for the decode step's hot ops (built and loaded by kernels/cpu.py).

Why: at decode batch sizes every op is tiny, and torch's eager path pays a fixed cost per
op (dispatch, allocation, oneDNN primitive lookup) that dwarfs the work; the small-row
GEMV in oneDNN also streams weights at well under the memory bandwidth. Each function
here does one op in one pass, in plain C with GCC vector extensions, compiled on the
machine for its own ISA (-march=native minus any capability forced off), so the same
source becomes AVX-512, AVX2 or SSE code.

Invariants shared by every function:
  - tensors are float32 (dtype 0) or bfloat16 (dtype 1), given as raw pointers plus the
    element strides the caller passes; the last dimension is always contiguous;
  - all arithmetic is float32; bf16 results are rounded to nearest-even, as torch rounds;
  - `nthreads` OpenMP threads (the caller passes torch's intra-op count; torch's own
    libgomp is the one loaded, so the pool is shared, not doubled).
*/
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

enum { F32 = 0, BF16 = 1 };
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

/* row[0..n) = softmax(scale row[0..n)) in place, exact fp32 (the max subtracted first). The
   loops run over width >= n entries, which the caller's row has room for: past n, -inf on
   entry (their exp, clamped to ~1e-38 each, the sum can take) and zero on return. Rows with
   room pass n rounded up to VLEN, and no loop is left a scalar remainder, which a prompt
   chunk's many short rows paid for (a 256-token chunk's attention, 30 layers, 1 thread, AMD
   EPYC: 0.96x the time in bf16, 0.95x in fp32). Returns the row's log-sum-exp, log(sum(exp(scale
   row[0..n)))): what the parts of one softmax are combined by (paged_attention's context parts). */
static inline float softmax_row(float *row, int64_t n, int64_t width, float scale) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t p = n; p < width; p++) row[p] = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t p = 0; p < width; p++) {
        row[p] *= scale;
        mx = row[p] > mx ? row[p] : mx;
    }
    for (int64_t p = 0; p < width; p++) row[p] = exp_nonpositive(row[p] - mx);
#pragma omp simd reduction(+ : sum)
    for (int64_t p = 0; p < width; p++) sum += row[p];
    const float inv = 1.f / sum;
    for (int64_t p = 0; p < width; p++) row[p] = p < n ? row[p] * inv : 0.f;
    return mx + logf(sum);
}

/* RMSNorm of one row in place, Hugging Face numerics: normalise in fp32, round to x's dtype,
   then scale (the product is left for the caller to round to its output dtype). */
static void normalize_row(float *row, const float *wf, int64_t H, float eps, int dtype) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; j++) ss += row[j] * row[j];
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    for (int64_t j = 0; j < H; j++) row[j] = wf[j] * round_to(row[j] * inv, dtype);
}

/* ---- linear: y[b, :] = x[b, :] @ w.T + bias, for the few rows of a decode step ---- */

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

/* acc + a b, rounded once (a fused multiply-add) on every ISA that has one. Left to itself
   GCC contracts `acc += a * b` in some inlined variants of a loop and not in others (the AVX2
   build's linear of 1 row and 1 output block used a multiply and an add, its other row counts
   FMAs): a row's result then depended on how many rows shared its call. The attention's
   accumulations are left to GCC: contracted alike in every variant (tests/unit/test_cpu_kernels.py
   checks a row alone and in a batch), and 2-3% faster in bf16 than with fmadd. */
static inline __attribute__((always_inline)) vecf fmadd(vecf acc, vecf a, vecf b) {
#if VLEN == 16
    return (vecf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif VLEN == 8 && defined(__FMA__)
    return (vecf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
    return acc + a * b;
#endif
}

/* x in every lane (`(vecf){0} + x` costs an add: GCC may not drop a + 0.f, -0.f + 0.f being +0.f). */
static inline __attribute__((always_inline)) vecf splat(float x) {
#if VLEN == 16
    return (vecf)_mm512_set1_ps(x);
#elif VLEN == 8
    return (vecf)_mm256_set1_ps(x);
#else
    return (vecf){x, x, x, x}; /* SSE or another ISA: no AVX header is included */
#endif
}

/* The sum of v's lanes by folding halves (log2(VLEN) adds deep; a lane-by-lane loop is a
   serial chain of VLEN - 1 dependent adds, which GCC also emits for `omp simd` reductions). */
typedef float vec4f __attribute__((vector_size(16)));
static inline float hsum(vecf v) {
#if VLEN == 16
    typedef float vec8f __attribute__((vector_size(32)));
    vec8f v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vec4f v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
#elif VLEN == 8
    vec4f v4 = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
    vec4f v4 = v;
#endif
    vec4f v2 = v4 + __builtin_shufflevector(v4, v4, 2, 3, 0, 1);
    return v2[0] + v2[1];
}

/* The weight is packed once, at model load, into blocks of output columns, so that one
   SIMD load holds the same k for a block of outputs and each input row's x[k] is
   broadcast against it: every row of a small batch (a decode step) reuses each loaded
   weight vector from a register, with no horizontal sums at all.
     AVX512-BF16, bf16:  [O/16][KP][16][2]    (vdpbf16ps multiplies k pairs; so does AMX's
                                               TDPBF16PS, a [16 x 16 x 2] weight tile at a time)
     other bf16:         [O/VLEN][K/2][VLEN][2] (widened in registers, fp32 FMAs)
     fp32:               [O/VLEN][K][VLEN]
   O is padded with zero columns to whole blocks; in pairs, K with zeros to whole AMX tiles
   (KP = K/2 rounded up to 16 pairs: nothing for the usual K, a multiple of 32); in widened
   pairs, to even. A widened pair is one 32-bit lane per output: its k + 1 weight is the
   high half, fp32 already once the low half is masked off, and its k weight becomes fp32
   in one shift. Loaded as [K][VLEN], each vector took a widening of its own (AVX2: a
   vpmovzxwd and a shift, on the FMA units' ports): the linears of a step (smollm2 shapes,
   weights cold, 1 thread, 8 rows, AVX2 build on an AMD EPYC) took 36.5 ms against 24.1 ms
   with fp32 weights; as widened pairs, 25.2 ms (and 19 ms with widened_block_4x3). */
#if defined(__AVX512BF16__)
#define PAIRS(dtype) ((dtype) == BF16)
#else
#define PAIRS(dtype) 0
#endif
#define WIDENED_PAIRS(dtype) (!PAIRS(dtype) && (dtype) == BF16)
#define PACK_BLOCK(dtype) (PAIRS(dtype) ? 16 : VLEN)
/* Input rows per register block: M accumulators x 2 output blocks must fit the registers. */
#define PACK_ROWS (VLEN >= 16 ? 8 : 4)
/* Output blocks per pass of the fp32-FMA kernels (packed_block, widened_block): with AVX2's 16
   registers, 4 rows x 3 blocks = 12 independent sums (2 x 4 = 8 left the FMA units waiting on
   their latency: AVX2, 1 thread, 8 rows, 576 x 1536, weights in cache: 67 GFLOP/s); with
   AVX-512's 32, 8 rows x 2 blocks already give 16. The bf16-pairs kernels take 2. */
#define PACK_NO (VLEN >= 16 ? 2 : 3)

/* The linear's weights come from memory (a step reads every layer's once; they are long gone
   from the caches by the next step), and the hardware prefetcher does not run far enough
   ahead: a cold linear took its compute time plus its memory time (1 thread, AMD EPYC, bf16
   576 x 1536: 8 rows 71 us with the weights in cache, 133 us without; 1 row 30 / 85 us). So
   while a block pair computes, its row groups prefetch the weights of the pass this thread
   runs next, each group a share spread over its k steps: the loads overlap the FMAs, in every
   row group. prefetch_share: at step i, the bytes [i step, (i + 1) step) from pf (NULL: none). */
/* Consecutive passes a thread claims at a time (pd_linear): one stream for the hardware prefetcher. */
#define LINEAR_CLAIM_PASSES 2
static inline int64_t claim_passes(int64_t *claimed) {
    return __atomic_fetch_add(claimed, 1, __ATOMIC_RELAXED) * LINEAR_CLAIM_PASSES;
}
/* Below PREFETCH_MIN_ROWS rows of fp32 weights, the memory is the whole cost: the hardware
   prefetcher alone streams faster. bf16 weights widened to fp32 (no pairs) take more work per
   byte, and there the requests pay at every row count (AVX2 Zen 3, 2 threads, a step's cold
   linears, compact weights, paired against no requests below 4 rows: 1 row 0.92x, 2 rows
   0.87x; fp32 weights 1.15x and 1.21x). */
#define PREFETCH_MIN_ROWS 4
static inline __attribute__((always_inline)) void prefetch_share(const char *pf, int64_t i, int64_t step) {
    if (pf)
        for (int64_t b = i * step & ~(int64_t)63; b < (i + 1) * step; b += 64) __builtin_prefetch(pf + b, 0, 2);
}

static int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }
#define TILE_PAIRS 16 /* k pairs in an AMX weight tile: 16 rows of 64 bytes */
static int64_t packed_pairs(int64_t K) { return round_up(K, 2 * TILE_PAIRS) / 2; }

/* k per block of the packed weight: K padded as the layout pads it. */
static int64_t packed_k(int64_t K, int dtype) {
    return PAIRS(dtype) ? 2 * packed_pairs(K) : WIDENED_PAIRS(dtype) ? round_up(K, 2) : K;
}

/* Elements the packed weight takes, and the layout's name: its block width, plus 1000 when
   k comes in pairs, 2000 in widened pairs (kernels/cpu.py checks it: a library built for
   another ISA packs differently). */
int64_t pd_packed_linear_numel(int64_t K, int64_t O, int dtype) {
    return round_up(O, PACK_BLOCK(dtype)) * packed_k(K, dtype);
}
int pd_packed_linear_layout(int dtype) {
    return PAIRS(dtype) ? 1016 : WIDENED_PAIRS(dtype) ? 2000 + VLEN : VLEN;
}
/* Whether pd_linear takes bf16 weights for fp32 x: where bf16 packs as fp32 does (no pairs). */
int pd_compact_weights(void) { return !PAIRS(BF16); }

/* w: [O, K] (dtype) -> wp (the layout above). */
void pd_pack_linear_weight(const void *w, void *wp, int64_t K, int64_t O, int dtype) {
    const int64_t n = PACK_BLOCK(dtype), pair = dtype == BF16 ? 2 : 1, KP = packed_k(K, dtype);
    const int64_t size = dtype == BF16 ? 2 : 4;
    memset(wp, 0, pd_packed_linear_numel(K, O, dtype) * size);
    for (int64_t o = 0; o < O; o++)
        for (int64_t k = 0; k < K; k++) {
            const int64_t dst = ((o / n * KP + k / pair * pair) * n + o % n * pair + k % pair);
            memcpy((char *)wp + dst * size, (const char *)w + (o * K + k) * size, size);
        }
}

#if defined(__AVX512BF16__)
/* Where the pairs kernel stores its sums: y [B, O] in bf16, pd_linear's epilogue applied to
   each register as it is stored (bias [O] and residual [B, O] bf16, or NULL). Against an
   fp32 buffer and a second pass over it: 0.95-0.99x the time of a step's linears at 39 rows
   (7 decodes and a 32-token chunk), 30 layers, weights cold, 1 thread, AMD EPYC. */
typedef struct {
    bf16_t *y;
    const bf16_t *bias, *residual;
    int64_t O;
} linear_out;

/* 16 bf16 values at p as fp32 lanes (the live ones; zeros in the others, which are not read). */
static inline __attribute__((always_inline)) __m512 load16_bf16(const bf16_t *p, __mmask16 live) {
    return widen_bf16(_mm256_maskz_loadu_epi16(live, p));
}

/* v rounded to bf16 as bf16_bits rounds (nearest, ties to even; NaN stays NaN), in fp32 lanes. */
static inline __attribute__((always_inline)) __m512i bf16_bits16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                                             _mm512_set1_epi32((int)0xffff0000u));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
}

/* Columns [c, c + 16) of row m of out from the sum acc: + bias, rounded, + residual, stored
   in bf16, as pd_linear's epilogue computes them (columns past O are neither read nor written). */
static inline __attribute__((always_inline)) void store_out16(const linear_out *out, int64_t m, int64_t c, __m512 acc) {
    const int64_t left = out->O - c;
    const __mmask16 live = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
    if (out->bias) acc = _mm512_add_ps(acc, load16_bf16(out->bias + c, live));
    if (out->residual)
        acc = _mm512_add_ps(_mm512_castsi512_ps(bf16_bits16(acc)), load16_bf16(out->residual + m * out->O + c, live));
    _mm256_mask_storeu_epi16(out->y + m * out->O + c, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(acc), 16)));
}

/* Rows [m0, m0 + M) x columns [c0, c0 + 16 NO) of the output, from x (M rows, x_stride apart)
   and NO consecutive output blocks starting at wp; stored through out. */
static inline __attribute__((always_inline)) void packed_block_pairs(const bf16_t *x, int64_t x_stride, const bf16_t *wp,
                                                                     int64_t KP, const linear_out *out, int64_t m0,
                                                                     int64_t c0, const int M, const int NO, const char *pf,
                                                                     int64_t pf_step) {
    __m512 acc[PACK_ROWS][2];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO; j++) acc[m][j] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < KP; kp++) {
        prefetch_share(pf, kp, pf_step);
        __m512bh wv[2];
        for (int j = 0; j < NO; j++) wv[j] = (__m512bh)_mm512_loadu_si512(wp + (j * KP + kp) * 32);
        for (int m = 0; m < M; m++) {
            int32_t pair;
            memcpy(&pair, x + m * x_stride + 2 * kp, 4);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int j = 0; j < NO; j++) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], wv[j], xb);
        }
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO && c0 + j * 16 < out->O; j++) store_out16(out, m0 + m, c0 + j * 16, acc[m][j]);
}
#endif

/* AMX (Sapphire Rapids+): TDPBF16PS multiplies a [16 rows x 32 k] bf16 tile of x by a
   [16 pairs x 16 columns x 2] weight tile, which is 1 KB of the pairs layout as it lies, into
   a [16 x 16] fp32 tile. x comes in whole tiles of 16 rows (zero rows pad a smaller batch:
   the tile costs the same, and a decode step's linears are bound by the weight reads). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#define AMX_ROWS 16
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

/* y[0..16, 0..16 * NO) += x [16 rows, 2 KP] (rows x_stride apart) times NO packed blocks at wp. */
static inline __attribute__((always_inline)) void amx_blocks(const bf16_t *x, int64_t x_stride, const bf16_t *wp, int64_t KP,
                                                             float *y, int64_t y_stride, const int NO) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kp = 0; kp < KP; kp += TILE_PAIRS) {
        _tile_loadd(2, x + 2 * kp, x_stride * 2);
        _tile_loadd(3, wp + kp * 32, 64);
        _tile_dpbf16ps(0, 2, 3);
        if (NO == 2) {
            _tile_loadd(4, wp + (KP + kp) * 32, 64);
            _tile_dpbf16ps(1, 2, 4);
        }
    }
    _tile_stored(0, y, y_stride * 4);
    if (NO == 2) _tile_stored(1, y + 16, y_stride * 4);
}
#endif

/* Whether this build multiplies bf16 in hardware: AVX512-BF16 dot products (with AMX tiles or
   not), in the linear and in a prompt chunk's attention (kernels/cpu.py: bf16_products). */
int pd_bf16_products(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Whether this build multiplies in AMX tiles on this machine (kernels/cpu.py: amx_tiles). */
int pd_amx_tiles(void) {
#if defined(HAVE_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

/* acc[m][j] += x[m K + k] w[j] for M rows and NO blocks of a register block. */
static inline __attribute__((always_inline)) void rows_fma(vecf acc[][PACK_NO], const float *x, int64_t K, int64_t k,
                                                           const vecf *w, const int M, const int NO) {
    for (int m = 0; m < M; m++) {
        const vecf xk = splat(x[m * K + k]);
        for (int j = 0; j < NO; j++) acc[m][j] = fmadd(acc[m][j], xk, w[j]);
    }
}

/* y [M, NO VLEN] (y_stride apart) = x [M, K] (fp32, rows K apart) @ NO blocks of fp32 weights. */
static inline __attribute__((always_inline)) void packed_block(const float *x, int64_t K, const float *wp, float *y,
                                                               int64_t y_stride, const int M, const int NO,
                                                               const char *pf, int64_t pf_step) {
    vecf acc[PACK_ROWS][PACK_NO];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO; j++) acc[m][j] = (vecf){0};
    for (int64_t k = 0; k < K; k++) {
        prefetch_share(pf, k, pf_step);
        vecf wv[PACK_NO];
        for (int j = 0; j < NO; j++) wv[j] = load_vec(wp + (j * K + k) * VLEN, F32);
        rows_fma(acc, x, K, k, wv, M, NO);
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO; j++) memcpy(y + m * y_stride + j * VLEN, &acc[m][j], sizeof(vecf));
}

/* A widened pair's weights as fp32: of k (the low halves, shifted up) and of k + 1 (the high
   halves, the low ones masked off). */
static inline __attribute__((always_inline)) vecf widen_low(const bf16_t *pair) {
    vecu u;
    memcpy(&u, pair, sizeof u);
    return (vecf)(u << 16);
}
static inline __attribute__((always_inline)) vecf widen_high(const bf16_t *pair) {
    vecu u;
    memcpy(&u, pair, sizeof u);
    return (vecf)(u & 0xffff0000u);
}

/* packed_block over widened pairs of bf16 weights ([K/2][VLEN][2] per block): each sum takes
   the same products in the same order as over the fp32 weights, so the results are the same. */
static inline __attribute__((always_inline)) void widened_block(const float *x, int64_t K, const bf16_t *wp, float *y,
                                                                int64_t y_stride, const int M, const int NO,
                                                                const char *pf, int64_t pf_step) {
    const int64_t KH = round_up(K, 2) / 2;
    vecf acc[PACK_ROWS][PACK_NO], w[PACK_NO];
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO; j++) acc[m][j] = (vecf){0};
    for (int64_t p = 0; p < KH; p++) {
        prefetch_share(pf, p, pf_step);
        const int64_t k = 2 * p;
        for (int j = 0; j < NO; j++) w[j] = widen_low(wp + (j * KH + p) * 2 * VLEN);
        rows_fma(acc, x, K, k, w, M, NO);
        if (k + 1 == K) break; /* odd K: the last pair's high halves are padding */
        for (int j = 0; j < NO; j++) w[j] = widen_high(wp + (j * KH + p) * 2 * VLEN);
        rows_fma(acc, x, K, k + 1, w, M, NO);
    }
    for (int m = 0; m < M; m++)
        for (int j = 0; j < NO; j++) memcpy(y + m * y_stride + j * VLEN, &acc[m][j], sizeof(vecf));
}

#if VLEN == 8 && defined(__FMA__) && defined(__AVX2__)
/* widened_block of 4 rows x 3 blocks for AVX2, its k loop in assembly: 12 sums, 3 weight vectors
   and a broadcast take all 16 registers, and GCC, given the same loop in C, kept a sum or two
   on the stack (a store and a load at every k; 4 x 2 blocks, the most it kept in registers,
   runs at 8 independent sums, just the FMA units' latency times their width: the same
   linears at 8 rows, 1 thread, took 21.0-21.8 ms with it, 18.2-19.1 ms with this). The k + 1
   weights are the k ones' zero low halves blended with the pair's high halves, read again from
   memory: no mask register. Same products in the same order as widened_block. */
#define WIDENED_ASM /* PACK_ROWS x PACK_NO: 4 x 3 */
static inline __attribute__((always_inline)) void widened_block_4x3(const float *x, int64_t K, const bf16_t *wp,
                                                                    float *y, int64_t y_stride, const char *pf,
                                                                    int64_t pf_step) {
    const int64_t KH = round_up(K, 2) / 2, w_stride = KH * 2 * VLEN * sizeof(bf16_t);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00, c20 = c00, c21 = c00,
           c22 = c00, c30 = c00, c31 = c00, c32 = c00;
    const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
    const char *w = (const char *)wp;
#define ROW_FMAS(X, OFF, A, B, C)                         \
    "vbroadcastss " OFF "(%[" X "]), %%ymm15\n\t"         \
    "vfmadd231ps %%ymm12, %%ymm15, %[" A "]\n\t"          \
    "vfmadd231ps %%ymm13, %%ymm15, %[" B "]\n\t"          \
    "vfmadd231ps %%ymm14, %%ymm15, %[" C "]\n\t"
    for (int64_t p = 0; p < K / 2; p++, w += 2 * VLEN * sizeof(bf16_t), x0 += 2, x1 += 2, x2 += 2, x3 += 2) {
        prefetch_share(pf, p, pf_step);
        __asm__("vpslld $16, (%[w]), %%ymm12\n\t"
                "vpslld $16, (%[w],%[ws]), %%ymm13\n\t"
                "vpslld $16, (%[w],%[ws],2), %%ymm14\n\t"
                ROW_FMAS("x0", "", "c00", "c01", "c02") ROW_FMAS("x1", "", "c10", "c11", "c12")
                ROW_FMAS("x2", "", "c20", "c21", "c22") ROW_FMAS("x3", "", "c30", "c31", "c32")
                "vpblendw $0xaa, (%[w]), %%ymm12, %%ymm12\n\t"
                "vpblendw $0xaa, (%[w],%[ws]), %%ymm13, %%ymm13\n\t"
                "vpblendw $0xaa, (%[w],%[ws],2), %%ymm14, %%ymm14\n\t"
                ROW_FMAS("x0", "4", "c00", "c01", "c02") ROW_FMAS("x1", "4", "c10", "c11", "c12")
                ROW_FMAS("x2", "4", "c20", "c21", "c22") ROW_FMAS("x3", "4", "c30", "c31", "c32")
                : [c00] "+x"(c00), [c01] "+x"(c01), [c02] "+x"(c02), [c10] "+x"(c10), [c11] "+x"(c11),
                  [c12] "+x"(c12), [c20] "+x"(c20), [c21] "+x"(c21), [c22] "+x"(c22), [c30] "+x"(c30),
                  [c31] "+x"(c31), [c32] "+x"(c32)
                : [w] "r"(w), [ws] "r"(w_stride), [x0] "r"(x0), [x1] "r"(x1), [x2] "r"(x2), [x3] "r"(x3)
                : "xmm12", "xmm13", "xmm14", "xmm15", "memory");
    }
#undef ROW_FMAS
    vecf acc[4][3] = {{(vecf)c00, (vecf)c01, (vecf)c02}, {(vecf)c10, (vecf)c11, (vecf)c12},
                      {(vecf)c20, (vecf)c21, (vecf)c22}, {(vecf)c30, (vecf)c31, (vecf)c32}};
    if (K % 2) { /* the last pair's k; its high halves are padding */
        vecf w[3];
        for (int j = 0; j < 3; j++) w[j] = widen_low(wp + (j * KH + K / 2) * 2 * VLEN);
        rows_fma(acc, x, K, K - 1, w, 4, 3);
    }
    for (int m = 0; m < 4; m++)
        for (int j = 0; j < 3; j++) memcpy(y + m * y_stride + j * VLEN, &acc[m][j], sizeof(vecf));
}
#endif

#define PACK_CASES(CALL)                                                                                       \
    switch (mm) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    case 4: CALL(4); break;                                                                                    \
    PACK_CASES_WIDE(CALL)                                                                                      \
    }
#if VLEN >= 16
#define PACK_CASES_WIDE(CALL)                                                                                  \
    case 5: CALL(5); break;                                                                                    \
    case 6: CALL(6); break;                                                                                    \
    case 7: CALL(7); break;                                                                                    \
    case 8: CALL(8); break;
#else
#define PACK_CASES_WIDE(CALL)
#endif

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

/* x: [N, 2I] rows x_stride apart -> out: [N, I] contiguous, both dtype (a prefill's rows). */
void pd_silu_and_mul(void *out, const void *x, int64_t x_stride, int64_t N, int64_t I, int dtype, int nthreads) {
#pragma omp parallel num_threads(N >= PARALLEL_MIN_ROWS ? nthreads : 1)
    {
        float *row = malloc(I * sizeof(float)), *scratch = malloc(2 * I * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            silu_mul_row(row, scratch, at(x, n * x_stride, dtype), I, dtype);
            store_row(at(out, n * I, dtype), row, I, dtype);
        }
        free(row), free(scratch);
    }
}

/* What a linear may compute on its input rows as it reads them (the op before it, fused):
     LINEAR_RMS_NORM  x: [B, K]  -> rms_norm(x) * norm_w, as pd_rms_norm computes it;
     LINEAR_SILU_MUL  x: [B, 2K] -> silu(x[:, :K]) * x[:, K:], each rounded to dtype as torch's
                                    `F.silu(gate) * up` rounds it. */
enum { LINEAR_PLAIN = 0, LINEAR_RMS_NORM = 1, LINEAR_SILU_MUL = 2 };

/* Input row b of a linear, its prologue applied, into row (fp32, K values). */
static void linear_input_row(float *row, float *scratch, const void *x, int64_t b, int64_t K, int dtype, int prologue,
                             const float *norm_wf, float eps) {
    if (prologue == LINEAR_SILU_MUL) {
        silu_mul_row(row, scratch, at(x, b * 2 * K, dtype), K, dtype);
        return;
    }
    load_row(row, at(x, b * K, dtype), K, dtype);
    if (prologue == LINEAR_RMS_NORM) {
        normalize_row(row, norm_wf, K, eps, dtype);
        for (int64_t k = 0; k < K; k++) row[k] = round_to(row[k], dtype); /* the norm's output, in dtype */
    }
}

/* x: [B, K] (dtype; [B, 2K] for LINEAR_SILU_MUL), wp: pd_pack_linear_weight's in wdtype, bias:
   [O] or NULL, residual: [B, O] or NULL, y: [B, O] (dtype); norm_w: [K] (dtype) for
   LINEAR_RMS_NORM. wdtype is dtype, or bf16 for fp32 x where the bf16 layout has no pairs
   (pd_compact_weights): an fp32 model's weights that bf16 holds exactly, read at half the
   bytes and widened in registers, so the products are the fp32 weights' own.
   y = prologue(x) @ w.T + bias, then + residual: the linear's output is rounded to dtype
   before the residual is added, as torch's `h + linear(x)` rounds it.
   Each pass over 2 or 3 output blocks (PACK_NO; L2-sized) serves every group of PACK_ROWS
   input rows before the next pass reads its blocks, so the weights come from memory once
   whatever B is. Threads claim passes as they go, not a fixed share: on cores shared
   with other processes (the gateway, HAProxy, a client), a thread that loses its core leaves
   the rest of the linear to the others instead of holding every thread at the region's end
   (offline, 2 threads beside a process taking a third of one core: a fixed share lost 29% of
   the engine's throughput, where the CPU taken was 17%). Each thread claims its next passes
   before it computes these, so that it prefetches weights it will read itself (OpenMP's
   dynamic schedule hands out passes without saying which comes next: prefetching pass + 1
   warmed the other thread's pass half the time, and 8 fp32 rows took 1.20x a fixed share). */
void pd_linear(const void *x, int prologue, const void *norm_w, float eps, const void *wp, const void *bias,
               const void *residual, void *y, int64_t B, int64_t K, int64_t O, int dtype, int wdtype, int nthreads) {
    if (B <= 0) return; /* a step that samples no row asks for no logits */
    const int64_t n = PACK_BLOCK(wdtype), blocks = round_up(O, n) / n, OP = blocks * n;
    const int pairs = PAIRS(wdtype); /* then dtype == wdtype: kernels/cpu.py packs no compact weight */
    const int64_t KP = pairs ? packed_pairs(K) : 0;
#if defined(HAVE_AMX)
    const int amx = pairs && amx_permitted(); /* from one row: it costs what vdpbf16ps does there */
    const int64_t rows = amx ? round_up(B, AMX_ROWS) : B;
#else
    const int amx = 0;
    const int64_t rows = B;
#endif
    /* the pairs kernel stores into y itself (linear_out); the others into yf, fp32, for the
       epilogue pass at the end */
    const int direct = pairs && !amx;
    float *yf = direct ? NULL : aligned_alloc(64, round_up(rows * OP * 4, 64));
    /* x as the kernel reads it: in pairs, bf16 rows of 2 KP with zeros past K (and zero rows
       up to whole AMX tiles); otherwise fp32 */
    void *xc = aligned_alloc(64, round_up(rows * (pairs ? KP * 4 : K * 4), 64));
    if (pairs && (2 * KP != K || rows != B)) memset(xc, 0, rows * KP * 4); /* zeros past K, and padding rows */
    if (prologue == LINEAR_PLAIN && pairs) {
        for (int64_t b = 0; b < B; b++) memcpy((bf16_t *)xc + b * KP * 2, at(x, b * K, dtype), K * 2);
    } else if (prologue == LINEAR_PLAIN) {
        load_row(xc, x, B * K, dtype);
    } else {
        float *norm_wf = NULL;
        if (prologue == LINEAR_RMS_NORM) {
            norm_wf = malloc(K * sizeof(float));
            load_row(norm_wf, norm_w, K, dtype);
        }
#pragma omp parallel num_threads(B >= PARALLEL_MIN_ROWS ? nthreads : 1)
        {
            float *row = malloc(K * sizeof(float)), *scratch = malloc(2 * K * sizeof(float));
#pragma omp for schedule(static)
            for (int64_t b = 0; b < B; b++) {
                float *dst = pairs ? row : (float *)xc + b * K;
                linear_input_row(dst, scratch, x, b, K, dtype, prologue, norm_wf, eps);
                if (pairs) store_row((bf16_t *)xc + b * KP * 2, row, K, BF16); /* exact: row is already rounded */
            }
            free(row), free(scratch);
        }
        free(norm_wf);
    }
    int64_t claimed = 0; /* claims of LINEAR_CLAIM_PASSES passes handed out */
#pragma omp parallel num_threads(nthreads < blocks ? nthreads : (int)blocks)
    {
#if defined(HAVE_AMX)
        if (amx) { /* a fixed share of the blocks per thread */
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
            amx_configure();
            for (int64_t ob = b0; ob < b1; ob += 2)
                for (int64_t m0 = 0; m0 < rows; m0 += AMX_ROWS) {
                    const bf16_t *xb = (const bf16_t *)xc + m0 * KP * 2, *wb = (const bf16_t *)wp + ob * KP * 32;
                    if (b1 - ob >= 2)
                        amx_blocks(xb, KP * 2, wb, KP, yf + m0 * OP + ob * n, OP, 2);
                    else
                        amx_blocks(xb, KP * 2, wb, KP, yf + m0 * OP + ob * n, OP, 1);
                }
            _tile_release();
        }
#endif
        /* a block's weight bytes; the blocks of the next pass, shared among its row groups */
        const int64_t block_k = packed_k(K, wdtype), block_bytes = n * block_k * (wdtype == BF16 ? 2 : 4);
        const int64_t per_pass = pairs ? 2 : PACK_NO;
        const int64_t groups = (B + PACK_ROWS - 1) / PACK_ROWS, passes = (blocks + per_pass - 1) / per_pass;
        const int64_t steps = wdtype == BF16 ? block_k / 2 : K, pf_step = (per_pass * block_bytes / groups + steps - 1) / steps;
        const int64_t last = amx ? 0 : passes;
        /* This thread's passes [mine, mine + LINEAR_CLAIM_PASSES), and its next claim, made now
           where its weights are to be prefetched (otherwise `last`, and the claim is made when
           due: a thread that loses its core then holds up no passes but those it computes). */
        const int ahead = B >= PREFETCH_MIN_ROWS || (wdtype == BF16 && !pairs);
        for (int64_t mine = claim_passes(&claimed), after = ahead ? claim_passes(&claimed) : last; mine < last;
             mine = ahead ? after : claim_passes(&claimed), after = ahead ? claim_passes(&claimed) : last)
        for (int64_t pass = mine, end = mine + LINEAR_CLAIM_PASSES < last ? mine + LINEAR_CLAIM_PASSES : last; pass < end;
             pass++) {
            const int64_t ob = pass * per_pass, following = pass + 1 < end ? pass + 1 : after;
            const int no = blocks - ob >= per_pass ? (int)per_pass : (int)(blocks - ob);
            const char *next = ahead && following < last ? (const char *)wp + following * per_pass * block_bytes : NULL;
            for (int64_t m0 = 0; m0 < B; m0 += PACK_ROWS) {
                const int mm = B - m0 < PACK_ROWS ? (int)(B - m0) : PACK_ROWS;
                const char *pf = next ? next + m0 / PACK_ROWS * pf_step * steps : NULL;
#if defined(__AVX512BF16__)
                if (pairs) {
                    const bf16_t *xb = (const bf16_t *)xc + m0 * KP * 2, *wb = (const bf16_t *)wp + ob * KP * 32;
                    /* made here, not once outside the parallel region: a shared struct's fields are
                       loaded again at every store (a step's linears at 39 rows took 1.04x the time) */
                    const linear_out out = {y, bias, residual, O};
#define CALL_PAIRS(M) (no == 2 ? packed_block_pairs(xb, KP * 2, wb, KP, &out, m0, ob * n, M, 2, pf, pf_step) \
                               : packed_block_pairs(xb, KP * 2, wb, KP, &out, m0, ob * n, M, 1, pf, pf_step))
                    PACK_CASES(CALL_PAIRS)
#undef CALL_PAIRS
                    continue;
                }
#endif
                const float *xb = (const float *)xc + m0 * K;
                const void *wb = at(wp, ob * block_k * VLEN, wdtype);
                float *yb = yf + m0 * OP + ob * n;
                /* constant rows and blocks in each call: no branch is left in the loop */
#define CALL_F32(M) (no == 3   ? packed_block(xb, K, wb, yb, OP, M, PACK_NO, pf, pf_step) \
                     : no == 2 ? packed_block(xb, K, wb, yb, OP, M, 2, pf, pf_step)       \
                               : packed_block(xb, K, wb, yb, OP, M, 1, pf, pf_step))
#define CALL_BF16(M) (no == 3   ? widened_block(xb, K, wb, yb, OP, M, PACK_NO, pf, pf_step) \
                      : no == 2 ? widened_block(xb, K, wb, yb, OP, M, 2, pf, pf_step)       \
                                : widened_block(xb, K, wb, yb, OP, M, 1, pf, pf_step))
                if (wdtype == BF16) {
#if defined(WIDENED_ASM)
                    if (mm == PACK_ROWS && no == PACK_NO) {
                        widened_block_4x3(xb, K, wb, yb, OP, pf, pf_step);
                        continue;
                    }
#endif
                    PACK_CASES(CALL_BF16)
                } else {
                    PACK_CASES(CALL_F32)
                }
#undef CALL_F32
#undef CALL_BF16
            }
        }
    }
    if (!direct) {
#pragma omp parallel for schedule(static) num_threads(B >= PARALLEL_MIN_ROWS ? nthreads : 1)
        for (int64_t b = 0; b < B; b++) {
            float *row = yf + b * OP;
            if (bias)
                for (int64_t o = 0; o < O; o++)
                    row[o] += dtype == BF16 ? bf16_to_f32(((const bf16_t *)bias)[o]) : ((const float *)bias)[o];
            if (residual) {
                for (int64_t o = 0; o < O; o++) {
                    const float add = dtype == BF16 ? bf16_to_f32(((const bf16_t *)residual)[b * O + o])
                                                    : ((const float *)residual)[b * O + o];
                    row[o] = round_to(row[o], dtype) + add;
                }
            }
            store_row(at(y, b * O, dtype), row, O, dtype);
        }
    }
    free(xc);
    free(yf);
}


/* ---- RMSNorm, Hugging Face numerics: normalise in fp32, round to x's dtype, then scale ---- */

/* x: [N, H] rows x_stride apart; weight: [H] (w_dtype); out: [N, H] contiguous (out_dtype). */
void pd_rms_norm(void *out, const void *x, int64_t x_stride, const void *weight, int64_t N, int64_t H, float eps,
                 int dtype, int w_dtype, int out_dtype, int nthreads) {
#pragma omp parallel num_threads(N >= PARALLEL_MIN_ROWS ? nthreads : 1)
    {
        float *row = malloc(H * sizeof(float)), *wf = malloc(H * sizeof(float));
        load_row(wf, weight, H, w_dtype);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            load_row(row, at(x, i * x_stride, dtype), H, dtype);
            normalize_row(row, wf, H, eps, dtype);
            store_row(at(out, i * H, out_dtype), row, H, out_dtype);
        }
        free(row), free(wf);
    }
}

/* ---- rotary embedding (rotate-half layout), Hugging Face numerics ---- */

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

/* x: [T, H, D], token stride x_stride, heads D apart; out: [T, H, D] contiguous; cos_sin:
   fp32 [P, D]. */
void pd_rotary(void *out, const void *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const int64_t *positions,
               const float *cos_sin, int dtype, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel num_threads(T >= PARALLEL_MIN_ROWS ? nthreads : 1)
    {
        float *row = malloc(D * sizeof(float)), *res = malloc(D * sizeof(float));
        float *c = malloc(half * sizeof(float)), *s = malloc(half * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            rotary_coefficients(c, s, cos_sin, positions[t], D, dtype);
            for (int64_t h = 0; h < H; h++) {
                load_row(row, at(x, t * x_stride + h * D, dtype), D, dtype);
                rotate_row(res, row, c, s, D, dtype);
                store_row(at(out, (t * H + h) * D, dtype), res, D, dtype);
            }
        }
        free(row), free(res), free(c), free(s);
    }
}

/* ---- write new tokens' K/V rows into the paged cache ---- */

/* key/value: [T, row] with token strides; caches: [slots, row] contiguous; slot < 0: skip. */
void pd_store_kv(const void *key, int64_t k_stride, const void *value, int64_t v_stride, void *k_cache, void *v_cache,
                 const int64_t *slots, int64_t T, int64_t row, int src_dtype, int cache_dtype) {
    float *buf = malloc(row * sizeof(float));
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        int64_t dst = slots[t] * row;
        if (src_dtype == cache_dtype) {
            int64_t bytes = row * (src_dtype == BF16 ? 2 : 4);
            memcpy(at(k_cache, dst, cache_dtype), at(key, t * k_stride, src_dtype), bytes);
            memcpy(at(v_cache, dst, cache_dtype), at(value, t * v_stride, src_dtype), bytes);
        } else {
            load_row(buf, at(key, t * k_stride, src_dtype), row, src_dtype);
            store_row(at(k_cache, dst, cache_dtype), buf, row, cache_dtype);
            load_row(buf, at(value, t * v_stride, src_dtype), row, src_dtype);
            store_row(at(v_cache, dst, cache_dtype), buf, row, cache_dtype);
        }
    }
    free(buf);
}

/* ---- attention over the paged KV cache: each row a query token with its own context ---- */

/* The cache block after block b of a sequence (NULL after its last), and a part i of parts
   of it to prefetch: asked for a part per head while block b computes, the next block is in
   cache when its turn comes. Blocks lie anywhere in the cache, so the hardware prefetcher
   cannot guess the next one; without this a cold step (as every real one is) waits on
   each block (measured 25% of the attention at batch 8-16). Into L2 (prefetcht1), as the
   other prefetches here: into L1 (prefetcht0, the default) was slower in fp32 (decode of
   8 x 300 and 8 x 1000 tokens, cold, 30 layers, AMD EPYC: 0.74-0.83x the time with L2, 1 or
   2 threads, AVX2 or AVX-512; bf16 0.99-1.03x), likely as a block's requests held the
   core's few L1 miss buffers that the pass's own loads then waited for. */
static inline const char *block_after(const void *cache, int dtype, const int32_t *table, int64_t b, int64_t L,
                                      int64_t block_size, int64_t row) {
    return (b + 1) * block_size < L ? at(cache, (int64_t)table[b + 1] * block_size * row, dtype) : NULL;
}
static inline void prefetch_part(const char *block, int64_t bytes, int64_t i, int64_t parts) {
    if (block)
        for (int64_t off = i * bytes / parts & ~(int64_t)63; off < (i + 1) * bytes / parts; off += 64)
            __builtin_prefetch(block + off, 0, 2);
}

/* The first `bytes` of each of a block's `rows` rows (row_bytes apart) from `first`. */
static inline void prefetch_rows(const char *first, int64_t rows, int64_t row_bytes, int64_t bytes) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(first + r * row_bytes + off, 0, 2);
}

/* The KV rows of the item a thread computes next, requested a few at a time while it computes
   the current one (next_rows_ticks in its loops over the cache), so that the next item's
   memory reads overlap this item's compute instead of following it. Requesting a whole item
   before computing it (prefetch_item) stalls on the miss buffers until most of it has
   arrived: decode of 8 x 300 tokens, cold, 1 thread, AMD EPYC, bf16, took the time of the
   reads plus the time of the compute with the cache warm; requested ahead, 0.83-0.89x that
   (2 threads 0.79-0.99x; 16 x 300 0.85x, 8 x 1000 0.90x, 4 x 300 0.99x), and an engine's
   decode step of 8 and 16 sequences 0.92-0.97x and 0.89-0.92x. Spread over the whole item,
   not front-loaded: all within its first third was slower. The bf16 passes take rows ahead
   (pair_scores, amx_scores, pair_values); the fp32 ones were no faster with them. A row is
   its item's KV heads' part of a cache row, of K and of V. */
typedef struct {
    const char *k, *v;
    const int32_t *table; /* the next item's block table; NULL: nothing ahead */
    int64_t rows, done;   /* its rows to request, and how many are */
    int64_t per_tick;     /* rows per tick: its rows over the ticks the current item takes */
    int64_t block_size, row_bytes, first, last; /* [first, last): its heads' bytes in a cache row */
} next_rows;

/* Requests the next `count` of n's rows, K and V line by line (a block of K then one of V
   took 1.07x the time: 8 x 300 tokens, cold, 1 thread, AMD EPYC; all of K first 1.02-1.13x). */
static inline void request_next_rows(next_rows *n, int64_t count) {
    const int64_t end = n->done + count < n->rows ? n->done + count : n->rows;
    for (; n->done < end; n->done++) {
        const int64_t pos = n->done, block = n->table[pos / n->block_size];
        const int64_t start = (block * n->block_size + pos % n->block_size) * n->row_bytes;
        for (int64_t off = (start + n->first) & ~(int64_t)63; off < start + n->last; off += 64)
            __builtin_prefetch(n->k + off, 0, 2), __builtin_prefetch(n->v + off, 0, 2);
        __asm__ volatile("" ::: "memory"); /* GCC drops a finite loop of nothing but prefetches as dead code */
    }
}

/* A tick is 16 positions of one KV head in one pass over the cache. */
static inline void next_rows_ticks(next_rows *n, int64_t ticks) {
    if (n && n->done < n->rows) request_next_rows(n, ticks * n->per_tick);
}

static inline float load_one(const void *p, int64_t i, const int dtype) {
    return dtype == BF16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

/* Query heads taken together by the attention's inner loops: each cache vector is loaded
   once for all of them, and their sums are independent chains (one alone waits on FMA
   latency). Value sums keep HEADS x VALUE_VECS accumulators in registers. */
#define ATTEND_HEADS 4
#define VALUE_VECS (VLEN >= 16 ? 4 : 2)
/* Cache rows attend's passes take at a time (or a whole block, if smaller; both are powers of two) */
#define ROW_GROUP 16
#define HEAD_CASES(CALL) HEAD_CASES_N(heads, CALL)
#define HEAD_CASES_N(count, CALL)                                                                              \
    switch (count) {                                                                                           \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    default: CALL(4); break;                                                                                   \
    }

/* s[i * s_stride] = q_i . k for the `heads` query heads q_i (fp32, D apart at q) and one
   cache row k (dtype). */
static inline __attribute__((always_inline)) void head_scores(float *s, int64_t s_stride, const float *q, const void *k,
                                                              int64_t D, const int heads, const int dtype) {
    const int64_t DV = D & ~(int64_t)(VLEN - 1);
    vecf dot[ATTEND_HEADS] = {{0}};
    for (int64_t d = 0; d < DV; d += VLEN) {
        const vecf kv = load_vec(at(k, d, dtype), dtype);
        for (int i = 0; i < heads; i++) dot[i] += load_vec(q + i * D + d, F32) * kv;
    }
    for (int i = 0; i < heads; i++) {
        float sum = hsum(dot[i]);
        for (int64_t d = DV; d < D; d++) sum += q[i * D + d] * load_one(k, d, dtype);
        s[i * s_stride] = sum;
    }
}

#if VLEN == 8
/* The sums of v[0..8)'s lanes, as one vector (lane j: v[j]'s): a transposing tree of 7 adds
   instead of a horizontal sum (3 shuffles and adds) per vector. */
static inline __attribute__((always_inline)) __m256 sums8(const __m256 *v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* halves: 4 partials of each v[j] */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* s[0..8) = q . k_j for the 8 cache rows k_j (dtype, row apart from k), D a multiple of 8. */
static inline __attribute__((always_inline)) void eight_scores(float *s, const float *q, const void *k, int64_t row,
                                                               int64_t D, const int dtype) {
    __m256 dot[8];
    for (int j = 0; j < 8; j++) dot[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) dot[j] = _mm256_fmadd_ps(qv, (__m256)load_vec(at(k, j * row + d, dtype), dtype), dot[j]);
    }
    _mm256_storeu_ps(s, sums8(dot));
}
#endif

/* acc_i += sum_j w_i[j] v_j over dims [d0, d0 + VECS VLEN), for the `heads` query heads (acc_i
   at acc + i D, w_i at w + i w_stride) and n cache rows v_j (dtype, row apart from v). */
static inline __attribute__((always_inline)) void head_values_at(float *acc, const float *w, int64_t w_stride,
                                                                 const void *v, int64_t row, int64_t n, int64_t D,
                                                                 int64_t d0, const int VECS, const int heads,
                                                                 const int dtype) {
    vecf a[ATTEND_HEADS][VALUE_VECS];
    for (int i = 0; i < heads; i++)
        for (int c = 0; c < VECS; c++) a[i][c] = load_vec(acc + i * D + d0 + c * VLEN, F32);
    for (int64_t j = 0; j < n; j++) {
        vecf vv[VALUE_VECS];
        for (int c = 0; c < VECS; c++) vv[c] = load_vec(at(v, j * row + d0 + c * VLEN, dtype), dtype);
        for (int i = 0; i < heads; i++) {
            const float wj = w[i * w_stride + j];
            for (int c = 0; c < VECS; c++) a[i][c] += wj * vv[c];
        }
    }
    for (int i = 0; i < heads; i++)
        for (int c = 0; c < VECS; c++) memcpy(acc + i * D + d0 + c * VLEN, &a[i][c], sizeof(vecf));
}

/* head_values_at over all D dims: whole chunks of VALUE_VECS vectors, then single vectors,
   then the scalar tail (constant counts in each call: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void head_values(float *acc, const float *w, int64_t w_stride, const void *v,
                                                              int64_t row, int64_t n, int64_t D, const int heads,
                                                              const int dtype) {
    const int64_t DV = D & ~(int64_t)(VLEN - 1);
    int64_t d0 = 0;
    for (; d0 + VALUE_VECS * VLEN <= DV; d0 += VALUE_VECS * VLEN)
        head_values_at(acc, w, w_stride, v, row, n, D, d0, VALUE_VECS, heads, dtype);
    for (; d0 < DV; d0 += VLEN) head_values_at(acc, w, w_stride, v, row, n, D, d0, 1, heads, dtype);
    for (int i = 0; i < heads; i++)
        for (int64_t d = DV; d < D; d++)
            for (int64_t j = 0; j < n; j++) acc[i * D + d] += w[i * w_stride + j] * load_one(v, j * row + d, dtype);
}

/* The two passes of attend over the cache (dtype a constant in each instance): all scores,
   then, once scores holds the softmax weights, the value sums. Each cache row is read in
   place, once per pass for all R rows and all of its KV head's query heads. */
static inline __attribute__((always_inline)) void attend_pass(int values, float *acc, const float *qf, float *scores,
                                                              const void *cache, const int dtype, const int32_t *table,
                                                              const int32_t *L, int64_t R, int64_t block_size, int64_t row,
                                                              int64_t h0, int64_t h1, int64_t G, int64_t D) {
    const int64_t nq = (h1 - h0) * G, Lmax = L[R - 1];
    const int64_t block_bytes = block_size * row * (dtype == BF16 ? 2 : 4);
    /* a group of cache rows at a time, all their heads before the next rows: a block is read
       in order (the hardware prefetcher's pattern), whatever its size */
    const int64_t group = block_size < ROW_GROUP ? block_size : ROW_GROUP, groups = block_size / group;
    for (int64_t p0 = 0; p0 < Lmax; p0 += group) {
        const int64_t b = p0 / block_size, gi = p0 % block_size / group;
        const char *block = at(cache, ((int64_t)table[b] * block_size + gi * group) * row, dtype);
        const char *next = block_after(cache, dtype, table, b, Lmax, block_size, row);
        for (int64_t r = 0; r < R; r++) {
            const int64_t nr = L[r] - p0 < group ? L[r] - p0 : group; /* the rows row r sees */
            for (int64_t h = 0; h < h1 - h0; h++) {
                const char *kv = at(block, (h0 + h) * D, dtype);
                if (r == 0)
                    for (int64_t hq = h * G; hq < (h + 1) * G; hq++)
                        prefetch_part(next, block_bytes, gi * nq + hq, groups * nq);
                for (int64_t hq = h * G; hq < (h + 1) * G; hq += ATTEND_HEADS) {
                    const int heads = (h + 1) * G - hq < ATTEND_HEADS ? (int)((h + 1) * G - hq) : ATTEND_HEADS;
                    float *sh = scores + (r * nq + hq) * Lmax + p0;
                    /* a constant head count in each call: the accumulators stay in registers */
                    if (values) {
                        float *ah = acc + (r * nq + hq) * D;
#define VALUES(H) head_values(ah, sh, Lmax, kv, row, nr, D, H, dtype)
                        HEAD_CASES(VALUES)
#undef VALUES
                        continue;
                    }
                    const float *qh = qf + (r * nq + hq) * D;
                    int64_t j = 0;
#if VLEN == 8
                    if (D % 8 == 0) /* AVX2: 8 rows' scores at a time, head by head */
                        for (; j + 8 <= nr; j += 8)
                            for (int i = 0; i < heads; i++)
                                eight_scores(sh + i * Lmax + j, qh + i * D, at(kv, j * row, dtype), row, D, dtype);
#endif
                    for (; j < nr; j++) {
#define SCORES(H) head_scores(sh + j, Lmax, qh, at(kv, j * row, dtype), D, H, dtype)
                        HEAD_CASES(SCORES)
#undef SCORES
                    }
                }
            }
        }
    }
}

#if defined(HAVE_AMX)
/* attend's scores in AMX tiles, for rows whose query heads fit one tile's 16 columns (R G <=
   AMX_SCORE_COLUMNS: a decode token's heads; amx_attend takes R G >= 16): per KV head,
   S^T = K Q^T, with K's tiles (16 positions x 32 dims) loaded as the cache holds them and Q^T
   packed once into [16 dim pairs x 16 columns x 2] tiles, column r G + g for row r's query
   head g. Products of bf16 are exact in fp32, so only the order of the sums departs from
   head_scores. Needs bf16 queries (qf holds them exactly, unscaled) and cache, D % 32 == 0,
   and block_size % 16 == 0 so that a tile's rows lie in one block (rows past a row's context
   are computed and dropped). */
#define AMX_SCORE_COLUMNS 16
static void amx_scores(float *scores, const float *qf, float scale, const void *k_cache, const int32_t *table,
                       const int32_t *L, int64_t R, int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G,
                       int64_t D, next_rows *ahead) {
    const int64_t heads = h1 - h0, nq = heads * G, Lmax = L[R - 1], KT = D / 32, block_bytes = block_size * row * 2;
    bf16_t *qt = aligned_alloc(64, heads * KT * 512 * sizeof(bf16_t)); /* per KV head, KT tiles of Q^T */
    float sums[16 * AMX_SCORE_COLUMNS] __attribute__((aligned(64)));
    memset(qt, 0, heads * KT * 512 * sizeof(bf16_t));
    for (int64_t h = 0; h < heads; h++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t g = 0; g < G; g++)
                for (int64_t d = 0; d < D; d++)
                    qt[((h * KT + d / 32) * 16 + d % 32 / 2) * 32 + (r * G + g) * 2 + d % 2] =
                        f32_to_bf16(qf[(r * nq + h * G + g) * D + d]);
    amx_configure();
    for (int64_t p0 = 0; p0 < Lmax; p0 += 16) { /* 16 rows, all heads, then the next (as attend_pass) */
        const int64_t b = p0 / block_size, gi = p0 % block_size / 16, groups = block_size / 16;
        const bf16_t *rows = (const bf16_t *)k_cache + ((int64_t)table[b] * block_size + gi * 16) * row;
        const char *next = block_after(k_cache, BF16, table, b, Lmax, block_size, row);
        for (int64_t h = 0; h < heads; h++) {
            next_rows_ticks(ahead, 1);
            prefetch_part(next, block_bytes, gi * heads + h, groups * heads);
            _tile_zero(0);
            for (int64_t t = 0; t < KT; t++) {
                _tile_loadd(2, rows + (h0 + h) * D + 32 * t, row * 2);
                _tile_loadd(3, qt + (h * KT + t) * 512, 64);
                _tile_dpbf16ps(0, 2, 3);
            }
            _tile_stored(0, sums, AMX_SCORE_COLUMNS * 4);
            for (int64_t r = 0; r < R; r++) {
                const int64_t nr = L[r] - p0 < 16 ? L[r] - p0 : 16;
                for (int64_t g = 0; g < G; g++) {
                    float *sh = scores + (r * nq + h * G + g) * Lmax + p0;
                    for (int64_t j = 0; j < nr; j++) sh[j] = scale * sums[j * AMX_SCORE_COLUMNS + r * G + g];
                }
            }
        }
    }
    _tile_release();
    free(qt);
}
#endif

/* ---- a run of many query rows (a prompt chunk's tokens) without AMX: both products as small GEMMs ----

   attend reads each cache row in place for every query row, and a score is a horizontal sum per
   (query, position): cheap for a decode token's few queries, slow for a chunk's many. Here, per
   KV head, a group of VLEN positions is packed once for all M = R G query rows of the run:
     S = Q K^T   K^T packed [D][VLEN positions], each query's VLEN scores one register of FMAs
                 (AVX512-BF16 with a bf16 cache and bf16-exact queries: K^T in dimension pairs
                 [D/2][16][2], vdpbf16ps; products of bf16 are exact in fp32 either way);
     P = softmax(scale S) per row over its own context, exact fp32 (zero past it);
     O = P V     V's group widened to fp32 once, value sums in registers (head_values).
   Only the order of the sums departs from attend. Worth it from RUN_GEMM_MIN_QUERIES query rows. */
#define RUN_GEMM_MIN_QUERIES 8
#define SCORE_QUERIES (VLEN >= 16 ? 8 : 4) /* query rows per register block of scores */

/* s[i * s_stride .. + VLEN) = q_i . K^T for QN queries q_i (D apart) and kt [D][VLEN] fp32. */
static inline __attribute__((always_inline)) void group_scores(float *s, int64_t s_stride, const float *q, const float *kt,
                                                               int64_t D, const int QN) {
    vecf a[SCORE_QUERIES];
    for (int i = 0; i < QN; i++) a[i] = (vecf){0};
    for (int64_t d = 0; d < D; d++) {
        const vecf kv = load_vec(kt + d * VLEN, F32);
        for (int i = 0; i < QN; i++) a[i] += q[i * D + d] * kv;
    }
    for (int i = 0; i < QN; i++) memcpy(s + i * s_stride, &a[i], sizeof(vecf));
}

#if defined(__AVX512BF16__)
/* The same from bf16 queries qb (D apart) and kt2 [D/2][16][2] bf16: one vdpbf16ps per pair. */
static inline __attribute__((always_inline)) void group_scores_pairs(float *s, int64_t s_stride, const bf16_t *qb,
                                                                     const uint32_t *kt2, int64_t D, const int QN) {
    __m512 a[SCORE_QUERIES];
    for (int i = 0; i < QN; i++) a[i] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < D / 2; dp++) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kt2 + dp * 16);
        for (int i = 0; i < QN; i++) {
            int32_t pair;
            memcpy(&pair, qb + i * D + 2 * dp, 4);
            a[i] = _mm512_dpbf16_ps(a[i], kv, (__m512bh)_mm512_set1_epi32(pair));
        }
    }
    for (int i = 0; i < QN; i++) _mm512_storeu_ps(s + i * s_stride, a[i]);
}

/* o_i [D] += p_i . V for QN queries (o_i D apart; p_i: bf16 weights of the group's 16
   positions, p_stride apart) and vt2 [8 position pairs][D][2] bf16: VECS vectors of dims at
   a time from d0, one vdpbf16ps per position pair and vector. */
static inline __attribute__((always_inline)) void group_values_pairs(float *o, const bf16_t *p, int64_t p_stride,
                                                                     const uint32_t *vt2, int64_t D, int64_t d0,
                                                                     const int VECS, const int QN) {
    __m512 a[ATTEND_HEADS][VALUE_VECS];
    for (int i = 0; i < QN; i++)
        for (int c = 0; c < VECS; c++) a[i][c] = _mm512_loadu_ps(o + i * D + d0 + c * 16);
    for (int64_t pp = 0; pp < 8; pp++) {
        __m512bh vv[VALUE_VECS];
        for (int c = 0; c < VECS; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vt2 + pp * D + d0 + c * 16);
        for (int i = 0; i < QN; i++) {
            int32_t pair;
            memcpy(&pair, p + i * p_stride + 2 * pp, 4);
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < VECS; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], vv[c], w);
        }
    }
    for (int i = 0; i < QN; i++)
        for (int c = 0; c < VECS; c++) _mm512_storeu_ps(o + i * D + d0 + c * 16, a[i][c]);
}
#endif

#define QUERY_CASES(CALL)                                                                                      \
    switch (qn) {                                                                                              \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    case 4: CALL(4); break;                                                                                    \
    QUERY_CASES_WIDE(CALL)                                                                                     \
    }
#if SCORE_QUERIES > 4
#define QUERY_CASES_WIDE(CALL)                                                                                 \
    case 5: CALL(5); break;                                                                                    \
    case 6: CALL(6); break;                                                                                    \
    case 7: CALL(7); break;                                                                                    \
    default: CALL(8); break;
#else
#define QUERY_CASES_WIDE(CALL)
#endif

/* Cache-line-aligned scratch (aligned_alloc wants a whole number of lines). */
static void *scratch(int64_t bytes) { return aligned_alloc(64, round_up(bytes, 64)); }

/* The cache row of position pos of KV head h (dtype), through the block table. */
static inline const void *cache_row(const void *cache, int dtype, const int32_t *table, int64_t pos, int64_t block_size,
                                    int64_t row, int64_t h, int64_t D) {
    return at(cache, ((int64_t)table[pos / block_size] * block_size + pos % block_size) * row + h * D, dtype);
}

/* Rows m < M of s (LS apart; row m sees L[m / G] positions): softmax(scale s) over each
   row's own context, exact fp32, zero weights past it. Not inlined: its constants would
   hold vector registers across run_attend's loops, and the value sums' accumulators
   spilled to the stack (measured). */
static __attribute__((noinline)) void softmax_rows(float *s, int64_t LS, const int32_t *L, int64_t M, int64_t G,
                                                   float scale) {
    for (int64_t m = 0; m < M; m++) {
        float *sm = s + m * LS;
        const int64_t Lr = L[m / G], width = round_up(Lr, VLEN); /* <= LS: LS is Lmax rounded up */
        softmax_row(sm, Lr, width, scale);
        memset(sm + width, 0, (LS - width) * sizeof(float));
    }
}

#if defined(__AVX512BF16__)
/* kt2 [D/2][16] = K^T of 16 cache rows as dimension pairs (rows[j]: D/2 dwords, bf16 pairs;
   NULL: zeros), 16 pairs at a time as a 16 x 16 transpose of dwords in registers. With
   interleave_rows, against a copy element by element: a 32-token chunk's attention at 96
   and 192 positions of context 0.87x and 0.90-0.96x the time (30 layers, 1 thread, AMD EPYC). */
static void transpose_pairs(uint32_t *kt2, const uint32_t *const *rows, int64_t D) {
    const int64_t chunks = D / 32; /* of 16 pairs */
    for (int64_t c = 0; c < chunks; c++) {
        __m512i r[16], t[16];
        for (int j = 0; j < 16; j++) r[j] = rows[j] ? _mm512_loadu_si512(rows[j] + 16 * c) : _mm512_setzero_si512();
        for (int j = 0; j < 16; j += 2) /* per 128-bit lane: columns 4L, 4L+1 | 4L+2, 4L+3 of rows j, j+1 */
            t[j] = _mm512_unpacklo_epi32(r[j], r[j + 1]), t[j + 1] = _mm512_unpackhi_epi32(r[j], r[j + 1]);
        for (int g = 0; g < 16; g += 4) { /* r[g + k], lane L: column 4L + k of rows g .. g+3 */
            r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
            r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
        }
        for (int k = 0; k < 4; k++) { /* gather lane L of r[k], r[4+k], r[8+k], r[12+k]: column 4L + k */
            const __m512i lo = _mm512_shuffle_i32x4(r[k], r[4 + k], 0x88), hi = _mm512_shuffle_i32x4(r[k], r[4 + k], 0xdd);
            const __m512i lo2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0x88);
            const __m512i hi2 = _mm512_shuffle_i32x4(r[8 + k], r[12 + k], 0xdd);
            uint32_t *out = kt2 + 16 * 16 * c;
            _mm512_storeu_si512(out + 16 * k, _mm512_shuffle_i32x4(lo, lo2, 0x88));
            _mm512_storeu_si512(out + 16 * (8 + k), _mm512_shuffle_i32x4(lo, lo2, 0xdd));
            _mm512_storeu_si512(out + 16 * (4 + k), _mm512_shuffle_i32x4(hi, hi2, 0x88));
            _mm512_storeu_si512(out + 16 * (12 + k), _mm512_shuffle_i32x4(hi, hi2, 0xdd));
        }
    }
    for (int64_t dp = 16 * chunks; dp < D / 2; dp++) /* a last part of fewer than 16 pairs */
        for (int j = 0; j < 16; j++) kt2[dp * 16 + j] = rows[j] ? rows[j][dp] : 0;
}

/* vt2 [D] = cache rows v0 and v1 (bf16; NULL: zeros) interleaved, dimension by dimension:
   (v0[d], v1[d]) as the dword pair a vdpbf16ps multiplies. D % 16 == 0. */
static inline void interleave_rows(uint32_t *vt2, const bf16_t *v0, const bf16_t *v1, int64_t D) {
    for (int64_t d = 0; d < D; d += 16) {
        const __m512i a = v0 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + d))) : _mm512_setzero_si512();
        const __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + d))) : _mm512_setzero_si512();
        _mm512_storeu_si512(vt2 + d, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
}
#endif

/* attend's arguments (qf unscaled), for R G >= RUN_GEMM_MIN_QUERIES and D % VLEN == 0. */
static void run_attend(float *acc, const float *qf, int q_dtype, float scale, const void *k_cache, const void *v_cache,
                       int kv_dtype, const int32_t *table, const int32_t *L, int64_t R, int64_t block_size, int64_t row,
                       int64_t h0, int64_t h1, int64_t G, int64_t D) {
    const int64_t nq = (h1 - h0) * G, M = R * G, Lmax = L[R - 1], LS = round_up(Lmax, VLEN);
#if defined(__AVX512BF16__)
    const int pairs = q_dtype == BF16 && kv_dtype == BF16; /* qf then holds bf16 values exactly */
#else
    const int pairs = 0;
    (void)q_dtype;
#endif
    float *s = scratch(M * LS * sizeof(float)), *q = scratch(M * D * sizeof(float)), *o = scratch(M * D * sizeof(float));
    float *kt = scratch(D * VLEN * sizeof(float)), *vg = scratch(VLEN * D * sizeof(float));
    bf16_t *qb = scratch(M * D * sizeof(bf16_t)), *pb = scratch(M * LS * sizeof(bf16_t));
    for (int64_t h = 0; h < h1 - h0; h++) {
        for (int64_t m = 0; m < M; m++) { /* this head's query rows, contiguous: row m / G, head g = m % G */
            const float *src = qf + ((m / G) * nq + h * G + m % G) * D;
            if (pairs)
                store_row(qb + m * D, src, D, BF16);
            else
                memcpy(q + m * D, src, D * sizeof(float));
        }
        int64_t first = 0; /* the first query row that sees the group: rows' contexts grow by one */
        for (int64_t p0 = 0; p0 < Lmax; p0 += VLEN) {
            const int64_t n = Lmax - p0 < VLEN ? Lmax - p0 : VLEN;
            while (L[first / G] <= p0) first += G;
            if (pairs) {
#if defined(__AVX512BF16__)
                uint32_t *kt2 = (uint32_t *)kt;
                const uint32_t *rows[16];
                for (int64_t j = 0; j < 16; j++)
                    rows[j] = j < n ? cache_row(k_cache, BF16, table, p0 + j, block_size, row, h0 + h, D) : NULL;
                transpose_pairs(kt2, rows, D);
                for (int64_t m = first; m < M; m += SCORE_QUERIES) {
                    const int qn = M - m < SCORE_QUERIES ? (int)(M - m) : SCORE_QUERIES;
#define PAIR_SCORES(QN) group_scores_pairs(s + m * LS + p0, LS, qb + m * D, kt2, D, QN)
                    QUERY_CASES(PAIR_SCORES)
#undef PAIR_SCORES
                }
#endif
            } else {
                for (int64_t j = 0; j < VLEN; j++) {
                    const void *kr =
                        j < n ? cache_row(k_cache, kv_dtype, table, p0 + j, block_size, row, h0 + h, D) : NULL;
                    for (int64_t d = 0; d < D; d++) kt[d * VLEN + j] = kr ? load_one(kr, d, kv_dtype) : 0.f;
                }
                for (int64_t m = first; m < M; m += SCORE_QUERIES) {
                    const int qn = M - m < SCORE_QUERIES ? (int)(M - m) : SCORE_QUERIES;
#define F32_SCORES(QN) group_scores(s + m * LS + p0, LS, q + m * D, kt, D, QN)
                    QUERY_CASES(F32_SCORES)
#undef F32_SCORES
                }
            }
        }
        softmax_rows(s, LS, L, M, G, scale);
        memset(o, 0, M * D * sizeof(float));
        first = 0;
        if (pairs) {
#if defined(__AVX512BF16__)
            for (int64_t m = 0; m < M; m++) store_row(pb + m * LS, s + m * LS, LS, BF16);
            uint32_t *vt2 = (uint32_t *)vg;
            for (int64_t p0 = 0; p0 < Lmax; p0 += 16) {
                while (L[first / G] <= p0) first += G;
                for (int64_t pp = 0; pp < 8; pp++) { /* positions p0 + 2 pp and + 1, interleaved (zeros past Lmax) */
                    const int64_t p = p0 + 2 * pp;
                    const bf16_t *v0 = p < Lmax ? cache_row(v_cache, BF16, table, p, block_size, row, h0 + h, D) : NULL;
                    const bf16_t *v1 =
                        p + 1 < Lmax ? cache_row(v_cache, BF16, table, p + 1, block_size, row, h0 + h, D) : NULL;
                    interleave_rows(vt2 + pp * D, v0, v1, D);
                }
                for (int64_t m = first; m < M; m += ATTEND_HEADS) {
                    const int qn = M - m < ATTEND_HEADS ? (int)(M - m) : ATTEND_HEADS;
                    int64_t d0 = 0;
                    for (; d0 + VALUE_VECS * 16 <= D; d0 += VALUE_VECS * 16) {
#define PAIR_VALUES(QN) group_values_pairs(o + m * D, pb + m * LS + p0, LS, vt2, D, d0, VALUE_VECS, QN)
                        HEAD_CASES_N(qn, PAIR_VALUES)
#undef PAIR_VALUES
                    }
                    for (; d0 < D; d0 += 16) {
#define PAIR_VALUES(QN) group_values_pairs(o + m * D, pb + m * LS + p0, LS, vt2, D, d0, 1, QN)
                        HEAD_CASES_N(qn, PAIR_VALUES)
#undef PAIR_VALUES
                    }
                }
            }
#endif
        } else
        for (int64_t p0 = 0; p0 < Lmax; p0 += VLEN) {
            const int64_t n = Lmax - p0 < VLEN ? Lmax - p0 : VLEN;
            while (L[first / G] <= p0) first += G;
            for (int64_t j = 0; j < n; j++)
                load_row(vg + j * D, cache_row(v_cache, kv_dtype, table, p0 + j, block_size, row, h0 + h, D), D,
                         kv_dtype);
            for (int64_t m = first; m < M; m += ATTEND_HEADS) {
                const int heads = M - m < ATTEND_HEADS ? (int)(M - m) : ATTEND_HEADS;
#define VALUES(H) head_values(o + m * D, s + m * LS + p0, LS, vg, D, n, D, H, F32)
                HEAD_CASES(VALUES)
#undef VALUES
            }
        }
        for (int64_t m = 0; m < M; m++) memcpy(acc + ((m / G) * nq + h * G + m % G) * D, o + m * D, D * sizeof(float));
    }
    free(s), free(q), free(o), free(kt), free(vg), free(qb), free(pb);
}

#if defined(__AVX512BF16__)
/* The 16 lanes' sums of each of v[0..16), as one vector (lane j: v[j]'s sum): a transposing
   tree of adds (8 + 4 + 2 + 1 pairs, 45 instructions for 16 sums; a horizontal sum each
   would take ~7). */
static inline __attribute__((always_inline)) __m512 sums16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* 256-bit halves: t[i] = 8 partials of v[2i], then 8 of v[2i+1] */
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
    for (int i = 0; i < 4; i++) /* 128-bit lanes: u[i] = 4 partials each of v[4i .. 4i+4) */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xdd));
    for (int i = 0; i < 2; i++) /* lane k of w[i]: 2 partials of v[8i + k], then of v[8i + 4 + k] */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xee));
    /* lane (k, l) of x: the sum of v[k + 4 l] */
    const __m512 x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xdd));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, x);
}

/* The 16 dot products of query q (bf16, 32 DC dims) with cache rows rows[j] + koff, one
   lane each. A constant DC in each call: the 16 sums stay in registers, q's vectors too.
   (A loop of runtime bounds kept them on the stack. With this, the value pass's walks of two
   chunks and its next-block requests: decode attention, cold, 30 layers, 1 thread, AMD EPYC,
   bf16, 0.70-0.71x the time at 8 x 300, 8 x 1000 and 1 x 1000 tokens.) */
static inline __attribute__((always_inline)) __m512 rows_scores(const bf16_t *const *rows, int64_t koff, const bf16_t *q,
                                                                const int DC) {
    __m512bh qv[4];
    for (int c = 0; c < DC && c < 4; c++) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
    __m512 acc[16];
    for (int j = 0; j < 16; j++) {
        const bf16_t *kh = rows[j] + koff;
        acc[j] = _mm512_setzero_ps();
        for (int c = 0; c < DC; c++)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(kh + 32 * c),
                                      c < 4 ? qv[c] : (__m512bh)_mm512_loadu_si512(q + 32 * c));
    }
    return sums16(acc);
}

/* attend's scores (scores [R, nq, s_stride], scaled) from bf16 queries and cache, D % 32 == 0:
   each score's products in vdpbf16ps, 16 positions' sums at once (sums16) instead of a
   horizontal sum per score. qf holds the rotated queries exactly (they were rounded to bf16),
   unscaled. Cache blocks are read in order and the next prefetched, as attend_pass does. */
static void pair_scores(float *scores, int64_t s_stride, const float *qf, float scale, const void *k_cache,
                        const int32_t *table, const int32_t *L, int64_t R, int64_t block_size, int64_t row, int64_t h0,
                        int64_t h1, int64_t G, int64_t D, next_rows *ahead) {
    const int64_t nq = (h1 - h0) * G, Lmax = L[R - 1], DC = D / 32, block_bytes = block_size * row * 2;
    bf16_t *qb = scratch(R * nq * D * sizeof(bf16_t));
    store_row(qb, qf, R * nq * D, BF16); /* exact */
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t p0 = 0; p0 < Lmax; p0 += 16) {
        next_rows_ticks(ahead, h1 - h0);
        const int64_t n = Lmax - p0 < 16 ? Lmax - p0 : 16;
        const bf16_t *rows[16];
        for (int64_t j = 0, b0 = -1; j < n; j++) { /* a block's rows are row apart */
            const int64_t blk = (p0 + j) / block_size;
            if (blk != b0)
                b0 = blk, rows[j] = (const bf16_t *)k_cache +
                                    ((int64_t)table[blk] * block_size + (p0 + j) % block_size) * row + h0 * D;
            else
                rows[j] = rows[j - 1] + row;
        }
        const int64_t b = p0 / block_size; /* the block after p0's, a part per query head */
        const char *next = p0 % block_size == 0 ? block_after(k_cache, BF16, table, b, Lmax, block_size, row) : NULL;
        for (int64_t j = n; j < 16; j++) rows[j] = rows[0]; /* a real row: its lanes are not stored */
        const __mmask16 live = n == 16 ? 0xffff : (__mmask16)((1u << n) - 1);
        for (int64_t r = 0; r < R; r++) {
            if (L[r] <= p0) continue; /* sees none of these positions */
            for (int64_t hq = 0; hq < nq; hq++) {
                if (r == 0) prefetch_part(next, block_bytes, hq, nq);
                const bf16_t *q = qb + (r * nq + hq) * D;
                const int64_t koff = hq / G * D; /* its KV head's dims in a cache row */
                __m512 sums;
#define SCORES(DCN) sums = rows_scores(rows, koff, q, DCN)
                switch (DC) {
                case 1: SCORES(1); break;
                case 2: SCORES(2); break;
                case 4: SCORES(4); break;
                default: SCORES(DC); break;
                }
#undef SCORES
                _mm512_mask_storeu_ps(scores + (r * nq + hq) * s_stride + p0, live, _mm512_mul_ps(sums, vscale));
            }
        }
    }
    free(qb);
}
#endif

#if defined(__AVX512BF16__)
/* out_i [32 CW dims from 32 c] = sum over the context's positions of P_i V, for QN query
   heads (out_i D apart; P_i: bf16 weights LS apart, zero past each context) of one KV head's
   V (at v_head, rows row apart): P and V a pair of positions at a time by vdpbf16ps, each
   pair's V rows interleaved in registers (vpunpck{l,h}wd, lane by lane: the sums come out in
   a fixed permutation of the dims, undone as they are stored). Constant QN and CW (1 or 2
   chunks of 32 dims per walk over the context: each weight broadcast serves all of them);
   the sums stay in registers. pf_bytes > 0: each block also requests the next block's
   first pf_bytes of every row (a walk that reads the rows first). */
static inline __attribute__((always_inline)) void pair_values_chunk(float *out, int64_t D, const bf16_t *p, int64_t LS,
                                                                    const bf16_t *v_head, const int32_t *table,
                                                                    int64_t block_size, int64_t row, int64_t Lr,
                                                                    int64_t Lmax, int64_t c, int64_t pf_bytes, next_rows *ahead,
                                                                    const int QN, const int CW) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 lo[ATTEND_HEADS][2], hi[ATTEND_HEADS][2];
    for (int i = 0; i < QN; i++)
        for (int w = 0; w < CW; w++) lo[i][w] = hi[i][w] = _mm512_setzero_ps();
    for (int64_t p0 = 0; p0 < Lr; p0 += block_size) { /* a block at a time: its rows are row apart */
        next_rows_ticks(ahead, (block_size + 15) / 16);
        const bf16_t *v = v_head + (int64_t)table[p0 / block_size] * block_size * row + 32 * c;
        const int64_t n = Lr - p0 < block_size ? Lr - p0 : block_size;
        if (pf_bytes && p0 + block_size < Lr) /* the next block's rows, while this one computes */
            prefetch_rows((const char *)(v_head + (int64_t)table[p0 / block_size + 1] * block_size * row), block_size,
                          row * 2, pf_bytes);
        for (int64_t j = 0; j < n; j += 2) { /* a pair of positions (block sizes are even) */
            const int second_row = p0 + j + 1 < Lmax;
            __m512bh vlo[2], vhi[2];
            for (int w = 0; w < CW; w++) {
                const __m512i a = _mm512_loadu_si512(v + j * row + 32 * w);
                const __m512i b = second_row ? _mm512_loadu_si512(v + (j + 1) * row + 32 * w) : _mm512_setzero_si512();
                vlo[w] = (__m512bh)_mm512_unpacklo_epi16(a, b), vhi[w] = (__m512bh)_mm512_unpackhi_epi16(a, b);
            }
            for (int i = 0; i < QN; i++) {
                int32_t pair;
                memcpy(&pair, p + i * LS + p0 + j, 4);
                const __m512bh wt = (__m512bh)_mm512_set1_epi32(pair);
                for (int w = 0; w < CW; w++) {
                    lo[i][w] = _mm512_dpbf16_ps(lo[i][w], vlo[w], wt);
                    hi[i][w] = _mm512_dpbf16_ps(hi[i][w], vhi[w], wt);
                }
            }
        }
    }
    for (int i = 0; i < QN; i++)
        for (int w = 0; w < CW; w++) {
            float *o = out + i * D + 32 * (c + w);
            _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo[i][w], first, hi[i][w]));
            _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo[i][w], second, hi[i][w]));
        }
}

/* acc [R, nq, D] = P V for attend's softmax weights (scores [R, nq, s_stride], fp32, each row
   over its own context) and a bf16 cache, D % 32 == 0: P rounded to bf16, as torch's SDPA
   rounds it for P V; up to ATTEND_HEADS query heads share each V load (pair_values_chunk). */
static void pair_values(float *acc, const float *scores, int64_t s_stride, const void *v_cache, const int32_t *table,
                        const int32_t *L, int64_t R, int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G,
                        int64_t D, next_rows *ahead) {
    const int64_t nq = (h1 - h0) * G, M = R * nq, Lmax = L[R - 1], LS = round_up(Lmax + 1, 16);
    const int64_t pf_bytes = (h1 - h0) * D * 2; /* the first walk prefetches all of the item's heads */
    bf16_t *pb = scratch(M * LS * sizeof(bf16_t)); /* P in bf16, zero past each row's context */
    for (int64_t m = 0; m < M; m++) {
        const int64_t Lr = L[m / nq];
        store_row(pb + m * LS, scores + m * s_stride, Lr, BF16);
        memset(pb + m * LS + Lr, 0, (LS - Lr) * sizeof(bf16_t));
    }
    for (int64_t h = 0; h < h1 - h0; h++)
        for (int64_t r = 0; r < R; r++)
            for (int64_t g0 = 0; g0 < G; g0 += ATTEND_HEADS) {
                const int qn = G - g0 < ATTEND_HEADS ? (int)(G - g0) : ATTEND_HEADS;
                const int64_t m0 = r * nq + h * G + g0; /* its query heads: m0 .. m0 + qn */
                for (int64_t c = 0; c < D / 32;) { /* two chunks of 32 dims per walk, while two are left */
                    const int64_t pf = r == 0 && h == 0 && g0 == 0 && c == 0 ? pf_bytes : 0; /* the first walk */
#define CHUNK(QN) pair_values_chunk(acc + m0 * D, D, pb + m0 * LS, LS, (const bf16_t *)v_cache + (h0 + h) * D, table, \
                                    block_size, row, L[r], Lmax, c, pf, ahead, QN, CW)
                    if (c + 2 <= D / 32) {
                        enum { CW = 2 };
                        HEAD_CASES_N(qn, CHUNK)
                        c += 2;
                    } else {
                        enum { CW = 1 };
                        HEAD_CASES_N(qn, CHUNK)
                        c += 1;
                    }
#undef CHUNK
                }
            }
    free(pb);
}
#endif

/* Attention of R query rows of one sequence (a decode token, or consecutive tokens of a
   prompt chunk: they share the block table, and row r sees the cache's first L[r]
   positions), each with its query heads [h0 * G, h1 * G) (KV heads [h0, h1)): qf
   [R, nq, D] fp32 (scaled here: scratch), acc [R, nq, D] out, scores [R, nq, max L]
   scratch, lse [R, nq] out (each softmax's log-sum-exp; NULL: not wanted). Exact softmax in
   fp32: all scores first, then the weights. */
static void attend(float *acc, float *qf, int q_dtype, float scale, float *scores, const void *k_cache,
                   const void *v_cache, int kv_dtype, const int32_t *table, const int32_t *L, int64_t R,
                   int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G, int64_t D, next_rows *ahead,
                   float *lse) {
    const int64_t nq = (h1 - h0) * G, Lmax = L[R - 1];
#if defined(HAVE_AMX)
    if (q_dtype == BF16 && kv_dtype == BF16 && D % 32 == 0 && block_size % 16 == 0 && R * G <= AMX_SCORE_COLUMNS &&
        amx_permitted()) {
        amx_scores(scores, qf, scale, k_cache, table, L, R, block_size, row, h0, h1, G, D, ahead);
    } else
#endif
#if defined(__AVX512BF16__)
    if (q_dtype == BF16 && kv_dtype == BF16 && D % 32 == 0) {
        pair_scores(scores, Lmax, qf, scale, k_cache, table, L, R, block_size, row, h0, h1, G, D, ahead);
    } else
#endif
    {
        /* the fp32 passes take no rows ahead: slower with them (AVX2-only AMD EPYC, 8 x 290 tokens,
           cold, 1.17-1.21x the time), as was one pass with an online softmax (1.25-1.40x) */
        (void)q_dtype, (void)ahead;
        for (int64_t i = 0; i < R * nq * D; i++) qf[i] *= scale;
        if (kv_dtype == BF16)
            attend_pass(0, acc, qf, scores, k_cache, BF16, table, L, R, block_size, row, h0, h1, G, D);
        else
            attend_pass(0, acc, qf, scores, k_cache, F32, table, L, R, block_size, row, h0, h1, G, D);
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t hq = 0; hq < nq; hq++) {
            const float l = softmax_row(scores + (r * nq + hq) * Lmax, L[r], L[r], 1.f);
            if (lse) lse[r * nq + hq] = l;
        }
#if defined(__AVX512BF16__)
    if (q_dtype == BF16 && kv_dtype == BF16 && D % 32 == 0) {
        pair_values(acc, scores, Lmax, v_cache, table, L, R, block_size, row, h0, h1, G, D, ahead);
        return;
    }
#endif
    memset(acc, 0, R * nq * D * sizeof(float));
    if (kv_dtype == BF16)
        attend_pass(1, acc, qf, scores, v_cache, BF16, table, L, R, block_size, row, h0, h1, G, D);
    else
        attend_pass(1, acc, qf, scores, v_cache, F32, table, L, R, block_size, row, h0, h1, G, D);
}

#if defined(HAVE_AMX)
/* The attention of attend (same arguments but unscaled qf) in AMX tiles, for bf16 queries and
   cache and D a multiple of 32: per KV head, with its R x G query rows as M = R G tile rows,
     S = Q K^T   Q [M, D] bf16 (exact: the rotated query was rounded to bf16) by K^T, packed
                 from the cache into [16 k pairs x 16 positions x 2] tiles;
     P = softmax(scale S) per row over its own context (fp32), rounded to bf16 as torch's
                 SDPA rounds it;
     O = P V     V packed into [16 position pairs x 16 dims x 2] tiles.
   Products of bf16 are exact in fp32 and sums are fp32, so only P's rounding departs from
   attend's exact fp32. Positions past the context are zero in the packed tiles (P is zero
   there, and 0 x a stale NaN would not be). The packing is shared by all M rows: worth it
   from a tile's worth of rows (AMX_ATTEND_MIN_ROWS). */
#define AMX_ATTEND_MIN_ROWS 16

/* KV head h's positions [0, LP) of a sequence packed as tiles (zeros past Lmax):
     kt: tile (position group j, k tile t) at (j D/32 + t) 512, [kp][n][i] = K[16 j + n][32 t + 2 kp + i]
     vt: tile (position pair group j, column tile c) at (j D/16 + c) 512, [kp][d][i] = V[32 j + 2 kp + i][16 c + d] */
static void amx_pack_kv(bf16_t *kt, bf16_t *vt, const void *k_cache, const void *v_cache, const int32_t *table,
                        int64_t Lmax, int64_t LP, int64_t block_size, int64_t row, int64_t h, int64_t D,
                        const bf16_t *zeros) {
    const int64_t KT = D / 32, DT = D / 16;
    for (int64_t pos = 0; pos < LP; pos += 2) { /* a pair of positions: one row of a V tile */
        const bf16_t *vr[2];
        for (int i = 0; i < 2; i++) {
            const int64_t at_pos = pos + i;
            const int64_t slot = at_pos < Lmax ? (int64_t)table[at_pos / block_size] * block_size + at_pos % block_size : -1;
            const uint32_t *kw = (const uint32_t *)(slot < 0 ? zeros : (const bf16_t *)k_cache + slot * row + h * D);
            vr[i] = slot < 0 ? zeros : (const bf16_t *)v_cache + slot * row + h * D;
            uint32_t *ktile = (uint32_t *)kt + (at_pos / 16) * KT * 256 + at_pos % 16;
            for (int64_t kp = 0; kp < D / 2; kp++) ktile[kp / 16 * 256 + kp % 16 * 16] = kw[kp];
        }
        uint32_t *vrow = (uint32_t *)vt + (pos / 32) * DT * 256 + pos % 32 / 2 * 16;
        for (int64_t c = 0; c < DT; c++)
            for (int64_t d = 0; d < 16; d++) vrow[c * 256 + d] = (uint32_t)vr[0][16 * c + d] | (uint32_t)vr[1][16 * c + d] << 16;
    }
}

/* p [16, LT] (bf16) = softmax(scale q kt^T) of 16 query rows qa [16, D] over the first LT
   positions, row r over its first lens[r] (0: a zero row); s [16, LT] fp32 scratch. */
static void amx_softmax_rows(bf16_t *p, float *s, const bf16_t *qa, const bf16_t *kt, const int64_t *lens, int64_t LT,
                             int64_t D, float scale) {
    const int64_t KT = D / 32;
    for (int64_t j = 0; j < LT / 16; j++) {
        _tile_zero(0);
        for (int64_t t = 0; t < KT; t++) {
            _tile_loadd(2, qa + 32 * t, D * 2);
            _tile_loadd(3, kt + (j * KT + t) * 512, 64);
            _tile_dpbf16ps(0, 2, 3);
        }
        _tile_stored(0, s + 16 * j, LT * 4);
    }
    for (int64_t r = 0; r < 16; r++) {
        float *sr = s + r * LT, sum = 0.f;
        /* whole vectors: past the row's context -inf, whose exp (clamped: ~1e-38 each) the sum
           can take; they are zeroed below */
        const int64_t Lr = lens[r], L16 = round_up(Lr, 16);
        for (int64_t q = Lr; q < L16; q++) sr[q] = -INFINITY;
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t q = 0; q < L16; q += 16) vmax = _mm512_max_ps(vmax, _mm512_load_ps(sr + q));
        const float mx = _mm512_reduce_max_ps(vmax);
#pragma omp simd reduction(+ : sum)
        for (int64_t q = 0; q < L16; q++) {
            sr[q] = exp_nonpositive((sr[q] - mx) * scale);
            sum += sr[q];
        }
        const __m512 inv = _mm512_set1_ps(Lr ? 1.f / sum : 0.f);
        for (int64_t q = 0; q < LT; q += 16) { /* normalized, zero past the row's context, to bf16 */
            const __mmask16 live = q + 16 <= Lr ? 0xffff : q >= Lr ? 0 : (1u << (Lr - q)) - 1;
            const __m512 w = _mm512_maskz_mul_ps(live, _mm512_load_ps(sr + q), inv);
            _mm256_store_si256((__m256i *)(p + r * LT + q), (__m256i)_mm512_cvtneps_pbh(w));
        }
    }
}

/* o [16, D] fp32 = p [16, LT] (bf16) times V, packed in vt: up to 4 column tiles at once
   (accumulators 0, 1, 4, 5; p in 2; V in 3, 6, 7). */
static void amx_weighted_values(float *o, const bf16_t *p, const bf16_t *vt, int64_t LT, int64_t D) {
    const int64_t DT = D / 16;
    for (int64_t c0 = 0; c0 < DT; c0 += 4) {
        const int64_t nc = DT - c0 < 4 ? DT - c0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t j = 0; j < LT / 32; j++) {
            _tile_loadd(2, p + 32 * j, LT * 2);
            const bf16_t *vj = vt + (j * DT + c0) * 512;
            _tile_loadd(3, vj, 64);
            _tile_dpbf16ps(0, 2, 3);
            if (nc > 1) {
                _tile_loadd(6, vj + 512, 64);
                _tile_dpbf16ps(1, 2, 6);
            }
            if (nc > 2) {
                _tile_loadd(7, vj + 1024, 64);
                _tile_dpbf16ps(4, 2, 7);
            }
            if (nc > 3) {
                _tile_loadd(3, vj + 1536, 64);
                _tile_dpbf16ps(5, 2, 3);
            }
        }
        _tile_stored(0, o + c0 * 16, D * 4);
        if (nc > 1) _tile_stored(1, o + c0 * 16 + 16, D * 4);
        if (nc > 2) _tile_stored(4, o + c0 * 16 + 32, D * 4);
        if (nc > 3) _tile_stored(5, o + c0 * 16 + 48, D * 4);
    }
}

/* The attention of attend (same arguments but unscaled qf) in AMX tiles, for bf16 queries and
   cache and D a multiple of 32: per KV head, its R x G query rows (M of them) 16 at a time,
     S = Q K^T   Q [16, D] bf16 (exact: the rotated query was rounded to bf16) by K^T;
     P = softmax(scale S) per row over its own context (fp32), rounded to bf16 as torch's
                 SDPA rounds it;
     O = P V.
   Products of bf16 are exact in fp32 and sums are fp32, so only P's rounding departs from
   attend's exact fp32. K and V are packed into tiles once per KV head for all M rows
   (worth it from a tile's worth of rows: AMX_ATTEND_MIN_ROWS), with zeros past the context
   (P is zero there, and 0 x a stale NaN would not be). A row tile reads positions up to its
   longest row's context only, and its P V runs after the next tile's softmax: a tile load
   right after the stores that wrote its data stalls. */
static void amx_attend(float *acc, const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
                       const int32_t *L, int64_t R, int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G,
                       int64_t D, float scale) {
    const int64_t nq = (h1 - h0) * G, M = R * G, tiles = round_up(M, 16) / 16, Lmax = L[R - 1], LP = round_up(Lmax, 32);
    bf16_t *qa = aligned_alloc(64, 16 * D * 2), *kt = aligned_alloc(64, LP * D * 2), *vt = aligned_alloc(64, LP * D * 2);
    bf16_t *p = aligned_alloc(64, 2 * 16 * LP * 2), *zeros = calloc(D, 2); /* zeros: K and V past the context */
    float *s = aligned_alloc(64, 16 * LP * 4), *o = aligned_alloc(64, 16 * D * 4);
    int64_t lens[2][16], width[2] = {0, 0}; /* per row tile in flight: its rows' contexts, its positions */
    amx_configure();
    for (int64_t h = h0; h < h1; h++) {
        amx_pack_kv(kt, vt, k_cache, v_cache, table, Lmax, LP, block_size, row, h, D, zeros);
        for (int64_t i = 0; i <= tiles; i++) {
            if (i < tiles) { /* tile i's softmax */
                int64_t *li = lens[i % 2];
                memset(qa, 0, 16 * D * 2);
                for (int64_t r = 0; r < 16; r++) {
                    const int64_t m = 16 * i + r;
                    li[r] = m < M ? L[m / G] : 0;
                    if (m < M) store_row(qa + r * D, qf + ((m / G) * nq + (h - h0) * G + m % G) * D, D, BF16);
                }
                width[i % 2] = round_up(li[15] ? li[15] : L[(M - 1) / G], 32); /* lens grow with the row */
                amx_softmax_rows(p + i % 2 * 16 * LP, s, qa, kt, li, width[i % 2], D, scale);
            }
            if (i > 0) { /* tile i - 1's values */
                amx_weighted_values(o, p + (i - 1) % 2 * 16 * LP, vt, width[(i - 1) % 2], D);
                for (int64_t m = 16 * (i - 1); m < 16 * i && m < M; m++)
                    memcpy(acc + ((m / G) * nq + (h - h0) * G + m % G) * D, o + (m - 16 * (i - 1)) * D, D * sizeof(float));
            }
        }
    }
    _tile_release();
    free(qa), free(kt), free(vt), free(p), free(s), free(o), free(zeros);
}
#endif

/* Rows that share one attention work item: a run of consecutive rows whose context lengths
   go up by one and whose block tables agree over the longer context (a prompt chunk's
   tokens; a decode token is a run of one), at most RUN_MAX_ROWS of them. Returns the
   run's length from row b. Merging rows of equal tables is exact whoever they belong to:
   attention reads nothing but the query, the table and the length. 64 rows: amx_attend
   packs a run's K and V once for all its rows (a 256-token chunk after 1024 cached tokens,
   AMX, 1 thread: ~10% faster than with runs of 32). */
#define RUN_MAX_ROWS 64
#define RUN_MIN_ROWS 16

#define ITEM_PREFETCH_BYTES (4 << 20) /* of an item's K and V requested ahead of it: see prefetch_item */
/* next_rows for an item of L positions (its KV heads [h0, h1), table its block table), to be
   requested over `ticks` ticks, up to ITEM_PREFETCH_BYTES. */
static next_rows next_rows_of(const void *k_cache, const void *v_cache, int dtype, const int32_t *table, int64_t L,
                              int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t D, int64_t ticks) {
    const int64_t esize = dtype == BF16 ? 2 : 4, first = h0 * D * esize, last = h1 * D * esize;
    const int64_t bound = ITEM_PREFETCH_BYTES / (2 * (last - first)), rows = L < bound ? L : bound;
    return (next_rows){.k = k_cache, .v = v_cache, .table = table, .rows = rows, .done = 0,
                       .per_tick = (rows + ticks - 1) / (ticks > 0 ? ticks : 1), .block_size = block_size,
                       .row_bytes = row * esize, .first = first, .last = last};
}

/* An item's K and V (its KV heads' part of the rows of the first L positions of its table),
   requested before it computes, up to ITEM_PREFETCH_BYTES: its passes then find them in
   cache. The next-block prefetch inside the passes alone keeps too few reads in flight.
   Side by side over a cold cache (30 layers, 2 threads, AMD EPYC), with this: decode of 8
   sequences at 300 tokens 0.78x the time in fp32 capped at AVX2, 0.94x in bf16
   (AVX512-BF16); at 1000 tokens, more than L2 holds (the rest waits in L3), 0.82-0.94x and
   0.95x; a 32-token prompt chunk at 1024 0.95x and 0.79x. An item of one KV head (a batch-1
   decode is split by head across the threads) requests only that head's part of each row:
   0.84-0.92x the time of requesting whole rows at 1 x 300 and 1 x 1000 tokens in bf16,
   0.87-0.96x in fp32. The bound keeps a very long context from evicting its own first blocks
   before they are read. An item whose rows the thread's previous item requested ahead
   (next_rows) requests only what is left of them instead. */
static void prefetch_item(const void *k_cache, const void *v_cache, int dtype, const int32_t *table, int64_t L,
                          int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t D) {
    next_rows item = next_rows_of(k_cache, v_cache, dtype, table, L, block_size, row, h0, h1, D, 1);
    request_next_rows(&item, item.rows);
}

/* A decode row's context of more than ATTEND_PART_TOKENS positions is split into parts of
   at most that many (equal, in whole blocks), each a work item of its own over all the KV
   heads, and their outputs, each normalized over its own positions, are combined by their
   log-sum-exp (as flash-decoding splits the KV). Before, a batch-1 decode was an item per KV
   head, 3 for 2 threads, each reading a third of every row. A model's step (smollm2 shapes,
   2 threads, AMD EPYC, builds alternating in one engine) at 1536-1600 positions: batch 1 in
   fp32 on AVX2 0.85x the time, in bf16 0.95-1.00x; batch 8 0.96x and 0.99x. A part costs a little
   of its own (its query rotated, its scores set up): parts of 256 took a batch-8 bf16 step at
   800 positions 1.06x the time. A row's parts depend on its own context length alone: its
   result is the same in any batch. */
#define ATTEND_PART_TOKENS 1024

/* Work item of paged_attention: rows [b0, b0 + R) of one run, with KV heads [h0, h1), over
   positions [p0, p1) of their context (p1: the last row's context length, unless the run is
   a decode row whose context is split into `parts` > 1 parts; this item is part `part`, and
   its output goes to the parts' buffers at `slot`, its row's parts at consecutive slots). */
typedef struct {
    int64_t b0, R, h0, h1, p0, p1, part, parts, slot;
} attention_item;

/* The positions of each part of a context of L (whole blocks, as equal as they come). */
static int64_t part_size(int64_t L, int64_t block_size) {
    const int64_t parts = (L + ATTEND_PART_TOKENS - 1) / ATTEND_PART_TOKENS;
    return round_up((L + parts - 1) / parts, block_size);
}

/* The items of the runs (in `order`), each run's KV heads split `split` ways, or a decode
   row's context into parts; returns how many (*out: malloc'd), *slots: how many are parts. */
static int64_t attention_items(attention_item **out, int64_t *slots, const int64_t *run_start, const int64_t *order,
                               int64_t runs, int64_t split, int64_t Hk, const int32_t *context_lens, int64_t block_size) {
    int64_t n = 0;
    for (int64_t pass = 0; pass < 2; pass++) { /* count, then fill */
        attention_item *items = pass ? malloc((n > 0 ? n : 1) * sizeof(attention_item)) : NULL;
        n = 0, *slots = 0;
        for (int64_t i = 0; i < runs; i++) {
            const int64_t b0 = run_start[order[i]], R = run_start[order[i] + 1] - b0, L = context_lens[b0 + R - 1];
            const int64_t size = R == 1 && L > ATTEND_PART_TOKENS ? part_size(L, block_size) : L;
            const int64_t parts = size < L ? (L + size - 1) / size : 1;
            const int64_t heads = parts > 1 ? 1 : split; /* a part reads whole rows, not a head's slice of each */
            for (int64_t h = 0; h < heads; h++)
                for (int64_t p = 0; p < parts; p++, n++) {
                    if (items)
                        items[n] = (attention_item){b0, R, h * Hk / heads, (h + 1) * Hk / heads, p * size,
                                                    p + 1 < parts ? (p + 1) * size : L, p, parts, parts > 1 ? *slots : -1};
                    *slots += parts > 1;
                }
        }
        *out = items;
    }
    return n;
}

/* out [nq, D] = the attention of a row's context from its parts' (acc [parts][Hq, D] each
   normalized over its own positions, lse [parts][Hq] their log-sum-exps; nq heads used). */
static void combine_parts(float *out, const float *acc, const float *lse, int64_t parts, int64_t Hq, int64_t nq,
                          int64_t D) {
    for (int64_t h = 0; h < nq; h++) {
        float most = -INFINITY, total = 0.f;
        for (int64_t p = 0; p < parts; p++) most = fmaxf(most, lse[p * Hq + h]);
        memset(out + h * D, 0, D * sizeof(float));
        for (int64_t p = 0; p < parts; p++) {
            const float w = expf(lse[p * Hq + h] - most);
            total += w;
            for (int64_t d = 0; d < D; d++) out[h * D + d] += w * acc[(p * Hq + h) * D + d];
        }
        for (int64_t d = 0; d < D; d++) out[h * D + d] /= total;
    }
}

/* Run i's attention work: its rows times its longest context. */
static inline int64_t run_work(const int64_t *run_start, const int32_t *lens, int64_t i) {
    return (run_start[i + 1] - run_start[i]) * lens[run_start[i + 1] - 1];
}

static int64_t run_length(const int32_t *tables, int64_t table_stride, const int32_t *lens, int64_t b, int64_t B,
                          int64_t block_size, int64_t max_rows) {
    int64_t n = 1;
    while (b + n < B && n < max_rows && lens[b + n] == lens[b + n - 1] + 1 && lens[b + n - 1] > 0 &&
           memcmp(tables + (b + n - 1) * table_stride, tables + (b + n) * table_stride,
                  (lens[b + n] + block_size - 1) / block_size * sizeof(int32_t)) == 0)
        n++;
    return n;
}

/* q: [B, Hq, D] with token stride q_stride (heads D apart); caches: [num_blocks, block_size,
   Hk, D] contiguous; block_tables: [B, table_stride] int32; context_lens: [B] int32; out:
   [B, Hq, D] contiguous (q's dtype). Query head h reads KV head h / (Hq / Hk); context_len 0
   gives zeros. With cos_sin (else NULL), q is rotated at positions as it is loaded.
   A work item is one run of rows (run_length) with all its heads, so each cache slot's row
   (all KV heads, contiguous) is read once and in order: the cache is cold in a real step
   (every layer's weights passed through since), and whole rows stream better than
   per-head pieces. With fewer runs than threads, or a run of many rows (a prompt chunk), an
   item is one KV head's group of the run, so no thread idles. */
static void paged_attention(void *out, const void *q, int64_t q_stride, int q_dtype, const int64_t *positions,
                             const float *cos_sin, const void *k_cache, const void *v_cache, int kv_dtype,
                             const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, int64_t B,
                             int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int nthreads) {
    const int64_t G = Hq / Hk, row = Hk * D;
    int64_t *run_start = malloc((B + 1) * sizeof(int64_t)), *order = malloc(B * sizeof(int64_t)), runs = 0, longest = 1;
    /* Runs of up to RUN_MAX_ROWS, halved (down to RUN_MIN_ROWS) until every thread has two
       items or more: a lone 32-token chunk of 3 KV heads is 3 items, one thread's 2 the
       step's critical path. */
    for (int64_t max_rows = RUN_MAX_ROWS;; max_rows /= 2) {
        runs = 0, longest = 1;
        for (int64_t b = 0; b < B; b += run_length(block_tables, table_stride, context_lens, b, B, block_size, max_rows))
            run_start[runs++] = b;
        run_start[runs] = B;
        for (int64_t i = 0; i < runs; i++)
            longest = run_start[i + 1] - run_start[i] > longest ? run_start[i + 1] - run_start[i] : longest;
        if (longest == 1 || runs * Hk >= 2 * nthreads || max_rows / 2 < RUN_MIN_ROWS) break;
    }
    /* Largest runs first (rows x context): the small items that come last even out the threads. */
    for (int64_t i = 0; i < runs; i++) order[i] = i;
    if (longest > 1)
        for (int64_t i = 1; i < runs; i++)
            for (int64_t j = i; j > 0; j--) {
                if (run_work(run_start, context_lens, order[j]) <= run_work(run_start, context_lens, order[j - 1])) break;
                const int64_t t = order[j];
                order[j] = order[j - 1], order[j - 1] = t;
            }
    const int64_t split = runs < nthreads || longest > 1 ? Hk : 1;
    attention_item *work;
    int64_t slots;
    const int64_t items = attention_items(&work, &slots, run_start, order, runs, split, Hk, context_lens, block_size);
    /* context parts' outputs [slots][Hq, D] and log-sum-exps [slots][Hq], combined once all are done */
    float *part_acc = slots ? malloc(slots * Hq * D * sizeof(float)) : NULL;
    float *part_lse = slots ? malloc(slots * Hq * sizeof(float)) : NULL;
    /* With two items or more per thread, a thread claims its next item before it computes
       the current one and requests the next one's rows meanwhile (next_rows); otherwise a
       thread claims an item whenever it is free (a thread that loses its core then holds
       up no item but the one it computes). */
    const int ahead = items >= 2 * nthreads;
    int64_t claimed = 0;
#pragma omp parallel num_threads(items < nthreads ? (int)(items > 0 ? items : 1) : nthreads)
    {
        int64_t cap = 0;
        float *scores = NULL; /* [R, nq, L] */
        float *qf = malloc(longest * Hq * D * sizeof(float)), *acc = malloc(longest * Hq * D * sizeof(float));
        float *cs = malloc(D * sizeof(float)), *rot = malloc(D * sizeof(float));
        next_rows next = {0};
        int64_t requested = -1; /* the item whose rows `next` requests */
        for (int64_t item = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED); item < items;) {
            const int64_t following = ahead ? __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED) : items;
            const attention_item it = work[item];
            const int64_t b0 = it.b0, R = it.R, h0 = it.h0, h1 = it.h1;
            const int64_t L = it.p1 - it.p0, nq = (h1 - h0) * G;
            const int32_t *table = block_tables + b0 * table_stride + it.p0 / block_size;
            /* a context part: its positions alone, its output and log-sum-exps kept for combine_parts */
            const int32_t part_len = (int32_t)L, *lens = it.parts > 1 ? &part_len : context_lens + b0;
            float *o = it.parts > 1 ? part_acc + it.slot * Hq * D : acc;
            if (L > 0) {
                if (requested == item)
                    request_next_rows(&next, next.rows); /* what the item before did not request */
                else
                    prefetch_item(k_cache, v_cache, kv_dtype, table, L, block_size, row, h0, h1, D);
                next.table = NULL, requested = following;
                if (following < items) { /* over this item's ticks: 16 positions x a KV head x 2 passes */
                    const attention_item f = work[following];
                    next = next_rows_of(k_cache, v_cache, kv_dtype, block_tables + f.b0 * table_stride + f.p0 / block_size,
                                        f.p1 - f.p0, block_size, row, f.h0, f.h1, D, 2 * (h1 - h0) * R * ((L + 15) / 16));
                }
                for (int64_t r = 0; r < R; r++) {
                    float *qr = qf + r * nq * D;
                    load_row(qr, at(q, (b0 + r) * q_stride + h0 * G * D, q_dtype), nq * D, q_dtype);
                    if (cos_sin) {
                        rotary_coefficients(cs, cs + D / 2, cos_sin, positions[b0 + r], D, q_dtype);
                        for (int64_t h = 0; h < nq; h++) {
                            rotate_row(rot, qr + h * D, cs, cs + D / 2, D, q_dtype);
                            memcpy(qr + h * D, rot, D * sizeof(float));
                        }
                    }
                }
#if defined(HAVE_AMX)
                if (q_dtype == BF16 && kv_dtype == BF16 && D % 32 == 0 && R * G >= AMX_ATTEND_MIN_ROWS && it.parts == 1 &&
                    amx_permitted())
                    amx_attend(acc, qf, k_cache, v_cache, table, lens, R, block_size, row, h0, h1, G, D, scale);
                else
#endif
                if (R > 1 && R * G >= RUN_GEMM_MIN_QUERIES && D % VLEN == 0)
                    run_attend(acc, qf, q_dtype, scale, k_cache, v_cache, kv_dtype, table, lens, R, block_size, row, h0,
                               h1, G, D);
                else {
                    if (R * L * nq > cap) {
                        cap = R * L * nq;
                        free(scores);
                        scores = malloc(cap * sizeof(float));
                    }
                    attend(o, qf, q_dtype, scale, scores, k_cache, v_cache, kv_dtype, table, lens, R, block_size, row,
                           h0, h1, G, D, next.table ? &next : NULL, it.parts > 1 ? part_lse + it.slot * Hq : NULL);
                }
            } else {
                memset(acc, 0, R * nq * D * sizeof(float));
            }
            for (int64_t r = 0; r < R && it.parts == 1; r++)
                store_row(at(out, ((b0 + r) * Hq + h0 * G) * D, q_dtype), acc + r * nq * D, nq * D, q_dtype);
            item = ahead ? following : __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        }
        if (slots) {
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t item = 0; item < items; item++) { /* each split context's first part */
                const attention_item it = work[item];
                if (it.parts == 1 || it.part != 0) continue;
                const int64_t nq = (it.h1 - it.h0) * G;
                combine_parts(acc, part_acc + it.slot * Hq * D, part_lse + it.slot * Hq, it.parts, Hq, nq, D);
                store_row(at(out, (it.b0 * Hq + it.h0 * G) * D, q_dtype), acc, nq * D, q_dtype);
            }
        }
        free(scores), free(qf), free(acc), free(cs), free(rot);
    }
    free(run_start), free(order), free(work), free(part_acc), free(part_lse);
}

void pd_paged_attention_decode(void *out, const void *q, int64_t q_stride, int q_dtype, const void *k_cache,
                               const void *v_cache, int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                               const int32_t *context_lens, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, int nthreads) {
    paged_attention(out, q, q_stride, q_dtype, NULL, NULL, k_cache, v_cache, kv_dtype, block_tables, table_stride,
                     context_lens, B, Hq, Hk, D, block_size, scale, nthreads);
}

/* A step's attention from its projections, in one call: rotary on q and k, k and v written
   to the cache at slots (slot < 0: not written), then attention as above. The same numbers
   as pd_rotary, pd_store_kv and pd_paged_attention_decode in turn. A row is a decode token
   or a prompt chunk's token (its context_len counts the chunk's tokens up to itself).
   q: [B, Hq, D], k, v: [B, Hk, D], each with its token stride (heads D apart), all in dtype;
   positions, slots: [B] int64; cos_sin: fp32 [P, D]. The new rows are stored before any
   thread reads the cache: each sequence's context_len counts its new token. */
void pd_rotary_store_attend(void *out, const void *q, int64_t q_stride, const void *k, int64_t k_stride, const void *v,
                            int64_t v_stride, int dtype, const int64_t *positions, const float *cos_sin,
                            const int64_t *slots, void *k_cache, void *v_cache, int kv_dtype,
                            const int32_t *block_tables, int64_t table_stride, const int32_t *context_lens, int64_t B,
                            int64_t Hq, int64_t Hk, int64_t D, int64_t block_size, float scale, int nthreads) {
    const int64_t row = Hk * D;
    float *cs = malloc(D * sizeof(float)), *src = malloc(row * sizeof(float)), *res = malloc(row * sizeof(float));
    for (int64_t b = 0; b < B; b++) {
        if (slots[b] < 0) continue;
        rotary_coefficients(cs, cs + D / 2, cos_sin, positions[b], D, dtype);
        load_row(src, at(k, b * k_stride, dtype), row, dtype);
        for (int64_t h = 0; h < Hk; h++) rotate_row(res + h * D, src + h * D, cs, cs + D / 2, D, dtype);
        store_row(at(k_cache, slots[b] * row, kv_dtype), res, row, kv_dtype);
        load_row(src, at(v, b * v_stride, dtype), row, dtype);
        store_row(at(v_cache, slots[b] * row, kv_dtype), src, row, kv_dtype);
    }
    free(cs), free(src), free(res);
    paged_attention(out, q, q_stride, dtype, positions, cos_sin, k_cache, v_cache, kv_dtype, block_tables, table_stride,
                     context_lens, B, Hq, Hk, D, block_size, scale, nthreads);
}

/* ---- a whole step's decoder layers, in one call ---- */

/* One decoder layer's tensors: packed linear weights (pd_pack_linear_weight's layout), norm
   weights [H] or [D] (the model's dtype), its KV cache. qkv_bias, q_norm and k_norm may be
   NULL (Qwen2 has the bias, Qwen3 the per-head norms). */
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o_proj, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache;
} pd_layer;

/* Per-head RMSNorm in place over `heads` heads of D in each of B rows (row_stride apart). */
static void norm_heads(void *x, int64_t row_stride, int64_t B, int64_t heads, int64_t D, const void *weight, float eps,
                       int dtype) {
    float *row = malloc(D * sizeof(float)), *wf = malloc(D * sizeof(float));
    load_row(wf, weight, D, dtype);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < heads; h++) {
            void *p = at(x, b * row_stride + h * D, dtype);
            load_row(row, p, D, dtype);
            normalize_row(row, wf, D, eps, dtype);
            store_row(p, row, D, dtype);
        }
    free(row), free(wf);
}

/* A CPU step's decoder layers, its rows decode tokens and prompt chunks' tokens alike (the
   attention tells them apart by context_lens alone), h: [B, H] (dtype), updated in place
   through every layer: for each,
     h = h + o_proj(attend(rotary(q), store(rotary(k), v))),  q|k|v = qkv(rms_norm(h))
     h = h + down(silu(gate) * up),                           gate|up = gate_up(rms_norm(h))
   with pd_linear's prologues and epilogues, pd_rotary_store_attend, and Qwen3's per-head
   norms of q and k between; every intermediate rounded to dtype as the per-op path rounds
   it. I: the MLP's intermediate size; wdtype: the packed weights' (pd_linear's); the step's
   metadata as pd_rotary_store_attend's. */
void pd_step_layers(void *h, int64_t B, const pd_layer *layers, int64_t num_layers, int64_t H, int64_t Hq, int64_t Hk,
                    int64_t D, int64_t I, float eps, float scale, int dtype, int wdtype, const int64_t *positions,
                    const float *cos_sin, const int64_t *slots, int kv_dtype, const int32_t *block_tables,
                    int64_t table_stride, const int32_t *context_lens, int64_t block_size, int nthreads) {
    const int64_t q_size = Hq * D, kv_size = Hk * D, QKV = q_size + 2 * kv_size, size = dtype == BF16 ? 2 : 4;
    char *qkv = malloc(B * QKV * size), *attn = malloc(B * q_size * size), *gate_up = malloc(B * 2 * I * size);
    for (int64_t l = 0; l < num_layers; l++) {
        const pd_layer *L = layers + l;
        pd_linear(h, LINEAR_RMS_NORM, L->input_norm, eps, L->qkv, L->qkv_bias, NULL, qkv, B, H, QKV, dtype, wdtype, nthreads);
        if (L->q_norm) {
            norm_heads(qkv, QKV, B, Hq, D, L->q_norm, eps, dtype);
            norm_heads(qkv + q_size * size, QKV, B, Hk, D, L->k_norm, eps, dtype);
        }
        pd_rotary_store_attend(attn, qkv, QKV, qkv + q_size * size, QKV, qkv + (q_size + kv_size) * size, QKV, dtype,
                               positions, cos_sin, slots, L->k_cache, L->v_cache, kv_dtype, block_tables, table_stride,
                               context_lens, B, Hq, Hk, D, block_size, scale, nthreads);
        /* residual == y: the epilogue reads each element before it writes it */
        pd_linear(attn, LINEAR_PLAIN, NULL, 0.f, L->o_proj, NULL, h, h, B, q_size, H, dtype, wdtype, nthreads);
        pd_linear(h, LINEAR_RMS_NORM, L->post_norm, eps, L->gate_up, NULL, NULL, gate_up, B, H, 2 * I, dtype, wdtype, nthreads);
        pd_linear(gate_up, LINEAR_SILU_MUL, NULL, 0.f, L->down, NULL, h, h, B, I, H, dtype, wdtype, nthreads);
    }
    free(qkv), free(attn), free(gate_up);
}
