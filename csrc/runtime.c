/* runtime.c - process-wide settings shared by every kernel: the thread
 * count, and the BLAS kept single-threaded so that the OpenMP pool is the
 * only one (two pools on two cores would oversubscribe them).
 *
 * Fork: a child created by fork() inherits GNU OpenMP's record of the
 * parent's worker threads but not the threads themselves, so its first
 * parallel region with more than one thread waits for them forever (GNU
 * OpenMP has no fork support; multiprocessing's default start method on
 * Linux, DataLoader workers and Pools all fork). A child therefore runs
 * attnx on one thread: a team of one never touches the pool. The child
 * cannot tell whether the parent ever started the pool, so this holds in
 * every forked child; processes started by spawn or forkserver are new
 * processes and use every thread. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#if !defined(_WIN32)
#include <pthread.h>
#endif

#include "attnx.h"
#include "blas.h"

static int num_threads = 1;
static int amx_enabled = 1;
/* set in a process created by fork(): every call then runs on one thread */
static int forked_child = 0;

int attnx_get_num_threads(void) { return num_threads; }

void attnx_set_num_threads(int threads)
{
    num_threads = threads > 0 && !forked_child ? threads : 1;
}

#if !defined(_WIN32)
static void on_fork_child(void)
{
    forked_child = 1;
    num_threads = 1;
}
#endif

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
#if !defined(_WIN32)
    /* registered once per process (module init runs once); a failure only
     * loses the protection, so it is not an import error */
    (void)pthread_atfork(NULL, NULL, on_fork_child);
#endif
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
