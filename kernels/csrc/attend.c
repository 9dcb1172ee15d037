/* ---- attend: the attention of a few query rows of one sequence (a decode token's heads),
   each cache row read in place ---- */

#include "attention.h"

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

/* Cache rows attend's passes take at a time (or a whole block, if smaller; both are powers of two) */
#define ROW_GROUP 16

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
