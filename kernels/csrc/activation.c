/* ---- SiLU-and-mul, the MLP's activation: silu_mul_row (cpu_kernels.h) on each row ---- */

#include "cpu_kernels.h"

/* x: [N, 2I] rows x_stride apart -> out: [N, I] contiguous, both dtype (a prefill's rows). */
void pd_silu_and_mul(void *out, const void *x, int64_t x_stride, int64_t N, int64_t I, int dtype, int nthreads) {
#pragma omp parallel num_threads(N >= PARALLEL_MIN_ROWS ? nthreads : 1)
    {
        float *row = malloc(I * sizeof(float)), *scratch = malloc(2 * I * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            silu_mul_row(row, scratch, at(x, n * x_stride, dtype), I, dtype);
            store_row(at(out, n * I, dtype), row, I, dtype);
        }
        free(row), free(scratch);
    }
}
