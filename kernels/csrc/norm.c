/* ---- RMSNorm, Hugging Face numerics: normalise in fp32, round to x's dtype, then scale ---- */
/* (normalize_row, cpu_kernels.h: the row, which pd_linear's prologue and pd_step_layers'
   per-head norms share) */

#include "cpu_kernels.h"

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
