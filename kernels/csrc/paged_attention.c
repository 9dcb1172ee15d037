/* ---- paged attention: a step's rows grouped into work items, each item's attention by
   its rows (attention.h), the threads claiming items ---- */

#include "attention.h"

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
