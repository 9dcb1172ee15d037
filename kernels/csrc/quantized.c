/* ---- quantized linear weights: GGUF's 4- and 8-bit blocks, read as they are stored ---- */

#include "cpu_kernels.h"

/* A quantized weight [O, K] is packed (kernels/quantized.py, from the GGUF file's rows) into
   records of QBLOCK_OUT output columns x QGROUP k, [O / QBLOCK_OUT][K / QGROUP][record]:
     Q4_0  scales fp16 [16] | codes [16 i][16 o]         w = scale (q - 8)        288 bytes
     Q4_1  scales fp16 [16] | mins fp16 [16] | codes     w = scale q + min        320 bytes
     Q8_0  scales fp16 [16] | codes int8 [32 k][16 o]    w = scale q              544 bytes
   A Q4 code byte holds k = i in its low nibble and k = i + 16 in its high one, as GGUF's own
   block does, so one 16-byte load gives a k's weights for all 16 outputs of the record, and
   each record is the file's bytes for those outputs and k, rearranged (the same size: resident
   weights are the file's tensor bytes). The layout is the same on every ISA (16 outputs are
   1, 2 or 4 vectors), so a library rebuilt for another ISA never repacks.
   Each weight is dequantized in registers to fp32 (one FMA, scale q + min) and multiplied
   with fp32 rows. Q4_0's and Q8_0's weights are gguf's reference values exactly (one rounding
   each); Q4_1's differ from them by at most an ulp (the reference rounds the product, then
   the sum); beyond that only the order of the sums differs from the reference's. */
#define QBLOCK_OUT 16
#define QGROUP 32
#define QVECS (QBLOCK_OUT / VLEN) /* vectors per record's row of outputs */

static int64_t quantized_record_bytes(int wdtype) {
    return wdtype == Q4_0 ? 288 : wdtype == Q4_1 ? 320 : wdtype == Q8_0 ? 544 : 0;
}
int64_t pd_quantized_record_bytes(int wdtype) { return quantized_record_bytes(wdtype); }

typedef uint8_t vecb __attribute__((vector_size(VLEN)));
typedef int8_t vecsb __attribute__((vector_size(VLEN)));
typedef int32_t veci __attribute__((vector_size(VLEN * 4)));

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float f;
    if (exp == 0) { /* zero or subnormal: mant 2^-24 */
        f = (float)mant * 5.9604644775390625e-8f;
        uint32_t u;
        memcpy(&u, &f, 4);
        u |= sign;
        memcpy(&f, &u, 4);
        return f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u | mant << 13 : (exp + 112) << 23 | mant << 13);
    memcpy(&f, &u, 4);
    return f;
}

/* VLEN fp16 values at p as fp32 lanes. */
static inline __attribute__((always_inline)) vecf load_f16(const uint8_t *p) {
#if VLEN == 16
    return (vecf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif VLEN == 8 && defined(__F16C__)
    return (vecf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    vecf f;
    for (int i = 0; i < VLEN; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        f[i] = f16_to_f32(h);
    }
    return f;
#endif
}

/* VLEN code bytes at p as integer lanes, zero- or sign-extended: one vpmovzxbd / vpmovsxbd
   (GCC's generic conversion of a byte vector went lane by lane: the linear took 5x the time). */
static inline __attribute__((always_inline)) veci load_u8(const uint8_t *p) {
#if VLEN == 16
    return (veci)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VLEN == 8 && defined(__AVX2__)
    return (veci)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vecb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, veci);
#endif
}
static inline __attribute__((always_inline)) veci load_s8(const uint8_t *p) {
#if VLEN == 16
    return (veci)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
#elif VLEN == 8 && defined(__AVX2__)
    return (veci)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    vecsb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, veci);
#endif
}

static inline __attribute__((always_inline)) vecf dequantized(vecf scale, veci q, vecf min) {
    return fmadd(min, scale, __builtin_convertvector(q, vecf));
}

/* acc[m][c] += x[m K + k] w[c] for M rows and C vectors of outputs. */
static inline __attribute__((always_inline)) void rows_fma_q(vecf acc[][2 * QVECS], const float *x, int64_t K, int64_t k,
                                                             const vecf *w, const int M, const int C) {
    for (int m = 0; m < M; m++) {
        const vecf xk = splat(x[m * K + k]);
        for (int c = 0; c < C; c++) acc[m][c] = fmadd(acc[m][c], xk, w[c]);
    }
}

/* y [M, NB 16] (y_stride apart) = x [M, K] (fp32, rows K apart) @ NB consecutive output blocks
   of quantized records at wp (wdtype's). */
static inline __attribute__((always_inline)) void quantized_block(const float *x, int64_t K, const uint8_t *wp, float *y,
                                                                  int64_t y_stride, const int M, const int NB,
                                                                  const int wdtype, const char *pf, int64_t pf_step) {
    const int64_t groups = K / QGROUP, rec = quantized_record_bytes(wdtype);
    const int C = NB * QVECS; /* accumulator vectors per row */
    vecf acc[PACK_ROWS][2 * QVECS], scale[2 * QVECS], min[2 * QVECS], w[2 * QVECS];
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) acc[m][c] = (vecf){0};
    for (int64_t g = 0; g < groups; g++) {
        prefetch_share(pf, g, pf_step);
        const uint8_t *codes[2];
        for (int j = 0; j < NB; j++) {
            const uint8_t *r = wp + (j * groups + g) * rec;
            for (int v = 0; v < QVECS; v++) {
                const int c = j * QVECS + v;
                scale[c] = load_f16(r + v * VLEN * 2);
                min[c] = wdtype == Q4_1   ? load_f16(r + QBLOCK_OUT * 2 + v * VLEN * 2)
                         : wdtype == Q4_0 ? scale[c] * -8.f /* exact: scale (q - 8) rounded once */
                                          : (vecf){0};
            }
            codes[j] = r + (wdtype == Q4_1 ? 4 : 2) * QBLOCK_OUT;
        }
        const float *xg = x + g * QGROUP;
        if (wdtype == Q8_0) {
            for (int k = 0; k < QGROUP; k++) {
                for (int j = 0; j < NB; j++)
                    for (int v = 0; v < QVECS; v++)
                        w[j * QVECS + v] = scale[j * QVECS + v] *
                                           __builtin_convertvector(load_s8(codes[j] + k * QBLOCK_OUT + v * VLEN), vecf);
                rows_fma_q(acc, xg, K, k, w, M, C);
            }
        } else {
            for (int i = 0; i < QGROUP / 2; i++) {
                veci q[2 * QVECS];
                for (int j = 0; j < NB; j++)
                    for (int v = 0; v < QVECS; v++) q[j * QVECS + v] = load_u8(codes[j] + i * QBLOCK_OUT + v * VLEN);
                for (int c = 0; c < C; c++) w[c] = dequantized(scale[c], q[c] & 15, min[c]);
                rows_fma_q(acc, xg, K, i, w, M, C);
                for (int c = 0; c < C; c++) w[c] = dequantized(scale[c], q[c] >> 4, min[c]);
                rows_fma_q(acc, xg, K, i + QGROUP / 2, w, M, C);
            }
        }
    }
    for (int m = 0; m < M; m++)
        for (int c = 0; c < C; c++) memcpy(y + m * y_stride + c * VLEN, &acc[m][c], sizeof(vecf));
}
