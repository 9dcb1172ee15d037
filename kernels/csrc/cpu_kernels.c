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
#if defined(__AVX512BF16__)
#include <immintrin.h>
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

static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest, ties to even */
    return (bf16_t)(u >> 16);
}

static inline float round_to(float f, int dtype) { return dtype == BF16 ? bf16_to_f32(f32_to_bf16(f)) : f; }

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

static inline void *at(const void *base, int64_t index, int dtype) {
    return (char *)base + index * (dtype == BF16 ? 2 : 4);
}

/* ---- linear: y[b, :] = x[b, :] @ w.T + bias, for the few rows of a decode step ---- */

static inline vecf load_vec(const void *p, int dtype) {
    vecf f;
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

/* Rows [o0, o1) of w for NB (1..4) input rows: each weight row is read once and used NB
   times. `always_inline` + constant NB lets the compiler keep the accumulators in registers. */
static inline __attribute__((always_inline)) void linear_block(const float *x, const void *w, const int wdtype, float *y,
                                                               int64_t K, int64_t O, int64_t o0, int64_t o1, const int NB) {
    const int64_t KV = K & ~(int64_t)(VLEN - 1);
    for (int64_t o = o0; o < o1; o++) {
        const void *row = at(w, o * K, wdtype);
        vecf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t k = 0; k < KV; k += VLEN) {
            vecf wv = load_vec(at(row, k, wdtype), wdtype);
            a0 += wv * load_vec(x + k, F32);
            if (NB > 1) a1 += wv * load_vec(x + K + k, F32);
            if (NB > 2) a2 += wv * load_vec(x + 2 * K + k, F32);
            if (NB > 3) a3 += wv * load_vec(x + 3 * K + k, F32);
        }
        float s[4] = {hsum(a0), NB > 1 ? hsum(a1) : 0.f, NB > 2 ? hsum(a2) : 0.f, NB > 3 ? hsum(a3) : 0.f};
        for (int64_t k = KV; k < K; k++) {
            float wk = wdtype == BF16 ? bf16_to_f32(((const bf16_t *)row)[k]) : ((const float *)row)[k];
            for (int b = 0; b < NB; b++) s[b] += wk * x[b * K + k];
        }
        for (int b = 0; b < NB; b++) y[b * O + o] = s[b];
    }
}

#if defined(__AVX512BF16__)
/* The same for bf16 x and w with the AVX512-BF16 dot-product instruction: 32 weights per
   instruction, no conversion (products are exact in fp32; pairs are summed first). (Two
   weight rows per pass, to share x's loads, measured slower here: 1.3-1.6x at 1-8 rows.) */
static inline __attribute__((always_inline)) void linear_block_dpbf16(const bf16_t *x, const bf16_t *w, float *y,
                                                                      int64_t K, int64_t O, int64_t o0, int64_t o1,
                                                                      const int NB) {
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t o = o0; o < o1; o++) {
        const bf16_t *row = w + o * K;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K32; k += 32) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);
            a0 = _mm512_dpbf16_ps(a0, wv, (__m512bh)_mm512_loadu_si512(x + k));
            if (NB > 1) a1 = _mm512_dpbf16_ps(a1, wv, (__m512bh)_mm512_loadu_si512(x + K + k));
            if (NB > 2) a2 = _mm512_dpbf16_ps(a2, wv, (__m512bh)_mm512_loadu_si512(x + 2 * K + k));
            if (NB > 3) a3 = _mm512_dpbf16_ps(a3, wv, (__m512bh)_mm512_loadu_si512(x + 3 * K + k));
        }
        float s[4] = {_mm512_reduce_add_ps(a0), _mm512_reduce_add_ps(a1), _mm512_reduce_add_ps(a2),
                      _mm512_reduce_add_ps(a3)};
        for (int b = 0; b < NB; b++) {
            for (int64_t k = K32; k < K; k++) s[b] += bf16_to_f32(row[k]) * bf16_to_f32(x[b * K + k]);
            y[b * O + o] = s[b];
        }
    }
}
#endif

/* Rows of w are taken in tiles small enough to stay in L1 while every group of 4 input rows
   passes over them: the weights come from memory once, whatever B is. */
#define LINEAR_TILE_ROWS 16

/* x: [B, K] (dtype), w: [O, K] (dtype), bias: [O] or NULL, y: [B, O] (dtype). */
void pd_linear(const void *x, const void *w, const void *bias, void *y, int64_t B, int64_t K, int64_t O, int dtype,
               int nthreads) {
    float *yf = aligned_alloc(64, ((B * O * sizeof(float) + 63) / 64) * 64);
#if defined(__AVX512BF16__)
    const int dpbf16 = dtype == BF16;
#else
    const int dpbf16 = 0;
#endif
    float *xf = NULL;
    if (!dpbf16) {
        xf = aligned_alloc(64, ((B * K * sizeof(float) + 63) / 64) * 64);
        load_row(xf, x, B * K, dtype);
    }
#pragma omp parallel num_threads(nthreads)
    {
        int t = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t o0 = O * t / n, o1 = O * (t + 1) / n;
        for (int64_t tile = o0; tile < o1; tile += LINEAR_TILE_ROWS) {
            int64_t tile_end = tile + LINEAR_TILE_ROWS < o1 ? tile + LINEAR_TILE_ROWS : o1;
            for (int64_t b = 0; b < B; b += 4) {
                const int nb = B - b < 4 ? (int)(B - b) : 4;
                float *yb = yf + b * O;
#if defined(__AVX512BF16__)
                if (dpbf16) {
                    const bf16_t *xb = (const bf16_t *)x + b * K;
                    switch (nb) {
                    case 1: linear_block_dpbf16(xb, w, yb, K, O, tile, tile_end, 1); break;
                    case 2: linear_block_dpbf16(xb, w, yb, K, O, tile, tile_end, 2); break;
                    case 3: linear_block_dpbf16(xb, w, yb, K, O, tile, tile_end, 3); break;
                    default: linear_block_dpbf16(xb, w, yb, K, O, tile, tile_end, 4); break;
                    }
                    continue;
                }
#endif
                const float *xb = xf + b * K;
                /* constant dtype and row count in each call: no branch is left in the loop */
#define LINEAR_BLOCK(DT)                                                       \
    switch (nb) {                                                              \
    case 1: linear_block(xb, w, DT, yb, K, O, tile, tile_end, 1); break;       \
    case 2: linear_block(xb, w, DT, yb, K, O, tile, tile_end, 2); break;       \
    case 3: linear_block(xb, w, DT, yb, K, O, tile, tile_end, 3); break;       \
    default: linear_block(xb, w, DT, yb, K, O, tile, tile_end, 4); break;      \
    }
                if (dtype == BF16) {
                    LINEAR_BLOCK(BF16)
                } else {
                    LINEAR_BLOCK(F32)
                }
#undef LINEAR_BLOCK
            }
        }
    }
    if (bias) {
        for (int64_t b = 0; b < B; b++)
            for (int64_t o = 0; o < O; o++)
                yf[b * O + o] += dtype == BF16 ? bf16_to_f32(((const bf16_t *)bias)[o]) : ((const float *)bias)[o];
    }
    store_row(y, yf, B * O, dtype);
    free(xf);
    free(yf);
}

/* Row-wise ops split their rows over the threads only from this many rows (a prefill):
   below it, waking the pool costs more than the work. */
#define PARALLEL_MIN_ROWS 32

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
            float ss = 0.f;
#pragma omp simd reduction(+ : ss)
            for (int64_t j = 0; j < H; j++) ss += row[j] * row[j];
            float inv = 1.f / sqrtf(ss / (float)H + eps);
            for (int64_t j = 0; j < H; j++) row[j] = wf[j] * round_to(row[j] * inv, dtype);
            store_row(at(out, i * H, out_dtype), row, H, out_dtype);
        }
        free(row), free(wf);
    }
}

/* ---- rotary embedding (rotate-half layout), Hugging Face numerics ---- */

/* x: [T, H, D], token stride x_stride, heads D apart; out: [T, H, D] contiguous; cos_sin:
   fp32 [P, D] (cos in the first half, sin in the second). In bf16 every product and the
   sum are rounded, as torch's `x * cos + rotate_half(x) * sin` rounds them. */
void pd_rotary(void *out, const void *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const int64_t *positions,
               const float *cos_sin, int dtype, int nthreads) {
    const int64_t half = D / 2;
#pragma omp parallel num_threads(T >= PARALLEL_MIN_ROWS ? nthreads : 1)
    {
        float *row = malloc(D * sizeof(float)), *res = malloc(D * sizeof(float));
        float *c = malloc(half * sizeof(float)), *s = malloc(half * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            const float *cs = cos_sin + positions[t] * D;
            for (int64_t i = 0; i < half; i++) c[i] = round_to(cs[i], dtype), s[i] = round_to(cs[half + i], dtype);
            for (int64_t h = 0; h < H; h++) {
                load_row(row, at(x, t * x_stride + h * D, dtype), D, dtype);
                for (int64_t i = 0; i < half; i++) {
                    float x1 = row[i], x2 = row[half + i];
                    res[i] = round_to(round_to(x1 * c[i], dtype) + round_to(-x2 * s[i], dtype), dtype);
                    res[half + i] = round_to(round_to(x2 * c[i], dtype) + round_to(x1 * s[i], dtype), dtype);
                }
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

/* ---- decode attention over the paged KV cache (one query token per sequence) ---- */

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

/* One cache block's rows [n, piece] -> fp32 blk [n, piece]: KV heads [h0, h0 + piece / D). */
static void load_block(float *blk, const void *cache, int dtype, int64_t first, int64_t n, int64_t row, int64_t h0,
                       int64_t D, int64_t piece) {
    if (piece == row) {
        load_row(blk, at(cache, first * row, dtype), n * row, dtype); /* whole rows: one run */
    } else {
        for (int64_t j = 0; j < n; j++) load_row(blk + j * piece, at(cache, (first + j) * row + h0 * D, dtype), piece, dtype);
    }
}

/* Attention of one sequence's query heads [h0 * G, h1 * G) (KV heads [h0, h1)) over its L
   cached positions: qf [nq, D] pre-scaled fp32, acc [nq, D] out, scores [nq, L], blk
   [block_size, row] scratch. Exact softmax in fp32: all scores first, then the weights.
   The cache is read a block at a time into blk (fp32, L1-resident), so the value sums
   keep their accumulators in registers across the block's positions. */
static void attend(float *acc, const float *qf, float *scores, float *blk, const void *k_cache, const void *v_cache,
                   int kv_dtype, const int32_t *table, int64_t L, int64_t block_size, int64_t row, int64_t h0,
                   int64_t h1, int64_t G, int64_t D) {
    const int64_t nq = (h1 - h0) * G, piece = (h1 - h0) * D, DV = D & ~(int64_t)(VLEN - 1);
    for (int64_t b = 0, p0 = 0; p0 < L; b++, p0 += block_size) {
        const int64_t n = L - p0 < block_size ? L - p0 : block_size;
        load_block(blk, k_cache, kv_dtype, (int64_t)table[b] * block_size, n, row, h0, D, piece);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int64_t hq = h * G; hq < (h + 1) * G; hq++) {
                const float *qh = qf + hq * D;
                for (int64_t j = 0; j < n; j++) {
                    const float *kh = blk + j * piece + h * D;
                    vecf dot = {0};
                    for (int64_t d = 0; d < DV; d += VLEN) dot += load_vec(qh + d, F32) * load_vec(kh + d, F32);
                    float s = hsum(dot);
                    for (int64_t d = DV; d < D; d++) s += qh[d] * kh[d];
                    scores[hq * L + p0 + j] = s;
                }
            }
        }
    }
    for (int64_t hq = 0; hq < nq; hq++) {
        float *sh = scores + hq * L, m = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t p = 0; p < L; p++) m = sh[p] > m ? sh[p] : m;
        for (int64_t p = 0; p < L; p++) sh[p] = exp_nonpositive(sh[p] - m);
        for (int64_t p = 0; p < L; p++) sum += sh[p];
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < L; p++) sh[p] *= inv;
    }
    memset(acc, 0, nq * D * sizeof(float));
    for (int64_t b = 0, p0 = 0; p0 < L; b++, p0 += block_size) {
        const int64_t n = L - p0 < block_size ? L - p0 : block_size;
        load_block(blk, v_cache, kv_dtype, (int64_t)table[b] * block_size, n, row, h0, D, piece);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int64_t hq = h * G; hq < (h + 1) * G; hq++) {
                const float *w = scores + hq * L + p0;
                float *ah = acc + hq * D;
                for (int64_t d = 0; d < DV; d += VLEN) {
                    vecf a = load_vec(ah + d, F32);
                    for (int64_t j = 0; j < n; j++) a += w[j] * load_vec(blk + j * piece + h * D + d, F32);
                    memcpy(ah + d, &a, sizeof a);
                }
                for (int64_t d = DV; d < D; d++)
                    for (int64_t j = 0; j < n; j++) ah[d] += w[j] * blk[j * piece + h * D + d];
            }
        }
    }
}

/* q: [B, Hq, D] with token stride q_stride (heads D apart); caches: [num_blocks, block_size,
   Hk, D] contiguous; block_tables: [B, table_stride] int32; context_lens: [B] int32; out:
   [B, Hq, D] contiguous (q's dtype). Query head h reads KV head h / (Hq / Hk); context_len 0
   gives zeros.
   A work item is one sequence with all its heads, so each cache slot's row (all KV heads,
   contiguous) is read once and in order: the cache is cold in a real step (every layer's
   weights passed through since), and whole rows stream better than per-head pieces. With
   fewer sequences than threads, an item is one KV head's group, so no thread idles. */
void pd_paged_attention_decode(void *out, const void *q, int64_t q_stride, int q_dtype, const void *k_cache,
                               const void *v_cache, int kv_dtype, const int32_t *block_tables, int64_t table_stride,
                               const int32_t *context_lens, int64_t B, int64_t Hq, int64_t Hk, int64_t D,
                               int64_t block_size, float scale, int nthreads) {
    const int64_t G = Hq / Hk, row = Hk * D, split = B < nthreads ? Hk : 1, items = B * split;
#pragma omp parallel num_threads(items < nthreads ? (int)(items > 0 ? items : 1) : nthreads)
    {
        int64_t cap = 0;
        float *scores = NULL; /* [nq, L] */
        float *qf = malloc(Hq * D * sizeof(float)), *acc = malloc(Hq * D * sizeof(float));
        float *blk = malloc(block_size * row * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            const int64_t b = item / split, h0 = item % split * Hk / split, h1 = (item % split + 1) * Hk / split;
            const int64_t L = context_lens[b], nq = (h1 - h0) * G;
            if (L > 0) {
                if (L * nq > cap) {
                    cap = L * nq;
                    free(scores);
                    scores = malloc(cap * sizeof(float));
                }
                load_row(qf, at(q, b * q_stride + h0 * G * D, q_dtype), nq * D, q_dtype);
                for (int64_t i = 0; i < nq * D; i++) qf[i] *= scale;
                attend(acc, qf, scores, blk, k_cache, v_cache, kv_dtype, block_tables + b * table_stride, L, block_size,
                       row, h0, h1, G, D);
            } else {
                memset(acc, 0, nq * D * sizeof(float));
            }
            store_row(at(out, (b * Hq + h0 * G) * D, q_dtype), acc, nq * D, q_dtype);
        }
        free(scores), free(qf), free(acc), free(blk);
    }
}
