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

#include "attention.h"

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
