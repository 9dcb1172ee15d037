/* ---- write new tokens' K/V rows into the paged cache ---- */

#include "cpu_kernels.h"

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
