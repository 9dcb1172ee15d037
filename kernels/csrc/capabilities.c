/* ---- what this build multiplies bf16 with (kernels/cpu.py asks once per load) ---- */

#include "cpu_kernels.h"

/* Whether this build multiplies bf16 in hardware: AVX512-BF16 dot products (with AMX tiles or
   not), in the linear and in a prompt chunk's attention (kernels/cpu.py: bf16_products). */
int pd_bf16_products(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* Whether this build multiplies in AMX tiles on this machine (kernels/cpu.py: amx_tiles). */
int pd_amx_tiles(void) {
#if defined(HAVE_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}
