/* ---- rotary embedding (rotate-half layout), Hugging Face numerics ---- */
/* (rotary_coefficients and rotate_row, cpu_kernels.h: a head's row, which the attention's
   query rotation and pd_rotary_store_attend share) */

#include "cpu_kernels.h"

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
