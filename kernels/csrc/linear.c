/* ---- linear: y[b, :] = x[b, :] @ w.T + bias, for the few rows of a decode step ---- */

#include "cpu_kernels.h"

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
#define PACK_BLOCK(dtype) (PAIRS(dtype) || QUANTIZED(dtype) ? 16 : VLEN) /* quantized: QBLOCK_OUT */
/* Input rows per register block: M accumulators x 2 output blocks must fit the registers. */
#define PACK_ROWS (VLEN >= 16 ? 8 : 4)
/* Output blocks per pass of the fp32-FMA kernels (packed_block, widened_block): with AVX2's 16
   registers, 4 rows x 3 blocks = 12 independent sums (2 x 4 = 8 left the FMA units waiting on
   their latency: AVX2, 1 thread, 8 rows, 576 x 1536, weights in cache: 67 GFLOP/s); with
   AVX-512's 32, 8 rows x 2 blocks already give 16. The bf16-pairs kernels take 2. */
#define PACK_NO (VLEN >= 16 ? 2 : 3)
/* Output blocks (of 16) per pass over quantized records: 8 rows x 2 vectors with AVX-512;
   with AVX2, a block is 2 vectors already: 4 rows x 2, and the scales, mins and weights. */
#define QUANTIZED_NO (VLEN >= 16 ? 2 : 1)

/* Defined in quantized.c (included after this file). */
static inline __attribute__((always_inline)) void quantized_block(const float *x, int64_t K, const uint8_t *wp, float *y,
                                                                  int64_t y_stride, const int M, const int NB,
                                                                  const int wdtype, const char *pf, int64_t pf_step);
static int64_t quantized_record_bytes(int wdtype);

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
#if defined(HAVE_AMX)
#define AMX_ROWS 16
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
   bytes and widened in registers, so the products are the fp32 weights' own;
   or a quantized format (Q4_0, Q4_1, Q8_0: quantized.c's records), for x of either dtype.
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
        const int quantized = QUANTIZED(wdtype);
        const int64_t block_k = packed_k(K, wdtype);
        const int64_t block_bytes = quantized ? K / 32 * quantized_record_bytes(wdtype) : n * block_k * (wdtype == BF16 ? 2 : 4);
        const int64_t per_pass = pairs ? 2 : quantized ? QUANTIZED_NO : PACK_NO;
        const int64_t groups = (B + PACK_ROWS - 1) / PACK_ROWS, passes = (blocks + per_pass - 1) / per_pass;
        /* the k steps a block's loop takes (prefetching a share at each) */
        const int64_t steps = quantized ? K / 32 : wdtype == BF16 ? block_k / 2 : K;
        const int64_t pf_step = (per_pass * block_bytes / groups + steps - 1) / steps;
        const int64_t last = amx ? 0 : passes;
        /* This thread's passes [mine, mine + LINEAR_CLAIM_PASSES), and its next claim, made now
           where its weights are to be prefetched (otherwise `last`, and the claim is made when
           due: a thread that loses its core then holds up no passes but those it computes). */
        const int ahead = B >= PREFETCH_MIN_ROWS || (wdtype == BF16 && !pairs) || quantized;
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
                float *yb = yf + m0 * OP + ob * n;
                if (quantized) {
                    const uint8_t *wq = (const uint8_t *)wp + ob * block_bytes;
                    /* the format constant in each call, as the rows and blocks are */
#define CALL_QF(M, F) (no == 2 ? quantized_block(xb, K, wq, yb, OP, M, 2, F, pf, pf_step) \
                               : quantized_block(xb, K, wq, yb, OP, M, 1, F, pf, pf_step))
#define CALL_Q(M) (wdtype == Q8_0 ? CALL_QF(M, Q8_0) : wdtype == Q4_1 ? CALL_QF(M, Q4_1) : CALL_QF(M, Q4_0))
                    PACK_CASES(CALL_Q)
#undef CALL_Q
#undef CALL_QF
                    continue;
                }
                const void *wb = at(wp, ob * block_k * VLEN, wdtype);
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
