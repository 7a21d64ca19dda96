/* runtime.c - process-wide settings shared by every kernel: the thread
 * count, the BLAS kept single-threaded so that the OpenMP pool is the only
 * one (two pools on two cores would oversubscribe them).
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
#include <time.h>

#if !defined(_WIN32)
#include <pthread.h>
#endif

#include "attnx.h"
#include "blas.h"
#include "portable.h"

static int num_threads = 1;
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

void attnx_runtime_init(void)
{
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

const char *attnx_blas_core(void) { return ATTNX_OPENBLAS(openblas_get_corename)(); }

const char *attnx_simd_level(void)
{
#ifdef ATTNX_HAVE_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "AVX-512 (x86-64-v4 clones)";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2+FMA (x86-64-v3 clones)";
    return "baseline x86-64 (SSE2)";
#else
    /* no target_clones in this build (portable.h) */
    return "compiler default";
#endif
}

int attnx_interrupted(attnx_interrupt *interrupt, int calling_thread)
{
    if (!interrupt) return 0;
    if (interrupt->stopped) return 1;
    if (!calling_thread || !interrupt->poll) return 0;
    double seconds = attnx_monotonic_seconds();
    /* the first poll 20 ms into the call: shorter calls never pay for one
     * (Python sees a signal when they return anyway) */
    if (interrupt->next_poll == 0) interrupt->next_poll = seconds + 0.02;
    if (seconds < interrupt->next_poll) return 0;
    interrupt->next_poll = seconds + 0.02;
    if (interrupt->poll(interrupt->context)) interrupt->stopped = 1;
    return interrupt->stopped;
}
