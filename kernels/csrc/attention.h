/* ---- attention over the paged KV cache: each row a query token with its own context ---- */

/* What the attention files share (attend.c, attention_run.c, then paged_attention.c, which
   splits a step's rows into work items and gives each item to the function that suits it). */
#ifndef PD_ATTENTION_H
#define PD_ATTENTION_H

#include "cpu_kernels.h"

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
#define HEAD_CASES(CALL) HEAD_CASES_N(heads, CALL)
#define HEAD_CASES_N(count, CALL)                                                                              \
    switch (count) {                                                                                           \
    case 1: CALL(1); break;                                                                                    \
    case 2: CALL(2); break;                                                                                    \
    case 3: CALL(3); break;                                                                                    \
    default: CALL(4); break;                                                                                   \
    }

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

/* Cache-line-aligned scratch (aligned_alloc wants a whole number of lines). */
static void *scratch(int64_t bytes) { return aligned_alloc(64, round_up(bytes, 64)); }

/* A work item's attention (paged_attention picks one by its rows; each is described where
   it is defined). attend: any rows (attend.c). */
static void attend(float *acc, float *qf, int q_dtype, float scale, float *scores, const void *k_cache,
                   const void *v_cache, int kv_dtype, const int32_t *table, const int32_t *L, int64_t R,
                   int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G, int64_t D, next_rows *ahead,
                   float *lse);

/* run_attend: a run of many query rows as two small GEMMs (attention_run.c), from this many
   query rows per KV head. */
#define RUN_GEMM_MIN_QUERIES 8
static void run_attend(float *acc, const float *qf, int q_dtype, float scale, const void *k_cache, const void *v_cache,
                       int kv_dtype, const int32_t *table, const int32_t *L, int64_t R, int64_t block_size, int64_t row,
                       int64_t h0, int64_t h1, int64_t G, int64_t D);

#if defined(HAVE_AMX)
/* amx_attend: a run of many query rows in AMX tiles (attention_run.c), from a tile's worth
   of rows per KV head. */
#define AMX_ATTEND_MIN_ROWS 16
static void amx_attend(float *acc, const float *qf, const void *k_cache, const void *v_cache, const int32_t *table,
                       const int32_t *L, int64_t R, int64_t block_size, int64_t row, int64_t h0, int64_t h1, int64_t G,
                       int64_t D, float scale);
#endif

#endif
