/* CPU kernels for the decode step's hot ops (built and loaded by kernels/cpu.py).

Why: at decode batch sizes every op is tiny, and torch's eager path pays a fixed cost per
op (dispatch, allocation, oneDNN primitive lookup) that dwarfs the work; the small-row
GEMV in oneDNN also streams weights at well under the memory bandwidth. Each function
here does one op in one pass, in plain C with GCC vector extensions, compiled on the
machine for its own ISA (-march=native minus any capability forced off), so the same
source becomes AVX-512, AVX2 or SSE code.

Invariants shared by every function:
  - tensors are float32 (dtype 0) or bfloat16 (dtype 1), given as raw pointers plus the
    element strides the caller passes; the last dimension is always contiguous;
  - all arithmetic is float32; bf16 results are rounded to nearest-even, as torch rounds;
  - `nthreads` OpenMP threads (the caller passes torch's intra-op count; torch's own
    libgomp is the one loaded, so the pool is shared, not doubled).

The kernels are one translation unit: kernels/cpu.py compiles this file alone, and it
includes each op's file below, in this order (a file may use what a file before it
defines; the headers declare what is shared). GCC thus sees every function at once, as it
did when they were one file (it inlines and specializes across ops alike: the same code,
the same bits), and the library exports the pd_* functions alone.
  cpu_kernels.h      what every file uses: dtypes and bf16 rounding, rows in and out, SIMD
                     vectors and the ISA switches (VLEN, HAVE_AMX), the row of RMSNorm,
                     SiLU-and-mul and rotary that the fused kernels share, pd_linear's prologues
  linear.c           pd_linear and its packed weights: register blocks, bf16 pairs, AMX tiles
  quantized.c        the register block of pd_linear over GGUF's quantized records (Q4_0, Q4_1, Q8_0)
  capabilities.c     what the build multiplies bf16 with (pd_bf16_products, pd_amx_tiles)
  activation.c       pd_silu_and_mul
  norm.c             pd_rms_norm
  rotary.c           pd_rotary
  kv_store.c         pd_store_kv
  attention.h        what the attention files share: next rows to request, value sums, softmax
  attend.c           attend: a few query rows (a decode token's heads), each cache row read in place
  attention_run.c    run_attend, amx_attend: a run of many query rows (a prompt chunk's tokens)
  paged_attention.c  pd_paged_attention_decode, pd_rotary_store_attend: rows into work items
  step.c             pd_step_layers: a step's decoder layers in one call
*/
#include "linear.c"
#include "quantized.c"
#include "capabilities.c"
#include "activation.c"
#include "norm.c"
#include "rotary.c"
#include "kv_store.c"
#include "attend.c"
#include "attention_run.c"
#include "paged_attention.c"
#include "step.c"
