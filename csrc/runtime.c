/* runtime.c - process-wide settings shared by every kernel: the thread
 * count, and the BLAS kept single-threaded so that the OpenMP pool is the
 * only one (two pools on two cores would oversubscribe them). */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h"

static int num_threads = 1;
static int amx_enabled = 1;

int attnx_get_num_threads(void) { return num_threads; }

void attnx_set_num_threads(int threads) { num_threads = threads > 0 ? threads : 1; }

int attnx_amx_enabled(void) { return amx_enabled; }

int attnx_set_amx(int enabled)
{
    int before = amx_enabled;
    amx_enabled = enabled != 0;
    return before;
}

void attnx_blas_init(void)
{
    /* ATTNX_AMX=0 keeps float32 softmax attention on the AVX-512 kernels */
    const char *amx = getenv("ATTNX_AMX");
    amx_enabled = !(amx && strcmp(amx, "0") == 0);
    /* omp_get_max_threads() honours OMP_NUM_THREADS. */
    num_threads = omp_get_max_threads();
    ATTNX_OPENBLAS(openblas_set_num_threads)(1);
}

const char *attnx_blas_name(void) { return ATTNX_BLAS_NAME; }

const char *attnx_simd_level(void)
{
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "AVX-512 (x86-64-v4 clones)";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2+FMA (x86-64-v3 clones)";
    return "baseline x86-64 (SSE2)";
#else
    return "compiler default";
#endif
}
