/* runtime.c - process-wide settings shared by every kernel: the thread
 * count, the BLAS kept single-threaded so that the OpenMP pool is the only
 * one (two pools on two cores would oversubscribe them), and the most
 * capable softmax backend calls may use.
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
#include <time.h>

#if !defined(_WIN32)
#include <pthread.h>
#endif

#include "attnx.h"
#include "blas.h"
#include "microkernel.h" /* attnx_mk_width, MK_HAVE_X86 */

static int num_threads = 1;
static int softmax_backend_limit = ATTNX_BACKEND_AMX;
static int decode_kernel = 1, decode_group = 1;
/* the bfloat16 dot products in use (set at import where available) */
static int bf16_dot = 0;
static const char *const softmax_backend_names[ATTNX_BACKENDS] = {"plain", "mk", "amx"};
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

int attnx_softmax_backend_limit(void) { return softmax_backend_limit; }

int attnx_set_softmax_backend_limit(int limit)
{
    int before = softmax_backend_limit;
    if (limit >= 0 && limit < ATTNX_BACKENDS) softmax_backend_limit = limit;
    return before;
}

int attnx_decode_kernel_enabled(void) { return decode_kernel; }
int attnx_decode_group_enabled(void) { return decode_group; }

static int replace_flag(int *flag, int enabled)
{
    int before = *flag;
    *flag = enabled != 0;
    return before;
}

int attnx_set_decode_kernel(int enabled) { return replace_flag(&decode_kernel, enabled); }
int attnx_set_decode_group(int enabled) { return replace_flag(&decode_group, enabled); }

int attnx_softmax_backend_from_name(const char *name)
{
    for (int b = 0; b < ATTNX_BACKENDS; b++)
        if (strcmp(name, softmax_backend_names[b]) == 0) return b;
    return -1;
}

const char *attnx_softmax_backend_name(int backend) { return softmax_backend_names[backend]; }

int attnx_bf16_dot_available(void)
{
#ifdef MK_HAVE_X86
    __builtin_cpu_init();
    return attnx_mk_width() == 16 && __builtin_cpu_supports("avx512bf16");
#else
    return 0;
#endif
}

int attnx_bf16_dot(void) { return bf16_dot; }

int attnx_set_bf16_dot(int on)
{
    if (on && !attnx_bf16_dot_available()) return -1;
    int before = bf16_dot;
    bf16_dot = on != 0;
    return before;
}

int attnx_runtime_init(void)
{
    /* omp_get_max_threads() honours OMP_NUM_THREADS. */
    num_threads = omp_get_max_threads();
    ATTNX_OPENBLAS(openblas_set_num_threads)(1);
#if !defined(_WIN32)
    /* registered once per process (module init runs once); a failure only
     * loses the protection, so it is not an import error */
    (void)pthread_atfork(NULL, NULL, on_fork_child);
#endif
    /* ATTNX_AMX=0 keeps float32 softmax attention off AMX (the older
     * spelling of ATTNX_SOFTMAX_BACKEND=mk) */
    bf16_dot = attnx_bf16_dot_available();
    const char *amx = getenv("ATTNX_AMX");
    if (amx && strcmp(amx, "0") == 0) softmax_backend_limit = ATTNX_BACKEND_MK;
    const char *backend = getenv("ATTNX_SOFTMAX_BACKEND");
    if (backend && *backend) {
        int limit = attnx_softmax_backend_from_name(backend);
        if (limit < 0) return -1;
        softmax_backend_limit = limit;
    }
    return 0;
}

const char *attnx_blas_name(void) { return ATTNX_BLAS_NAME; }

const char *attnx_blas_core(void) { return ATTNX_OPENBLAS(openblas_get_corename)(); }

const char *attnx_simd_level(void)
{
#if defined(MK_HAVE_X86) && defined(ATTNX_HAVE_CLONES)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "AVX-512 (x86-64-v4 clones)";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2+FMA (x86-64-v3 clones)";
    return "baseline x86-64 (SSE2)";
#elif defined(MK_HAVE_X86)
    /* no target_clones (portable.h): the kernels alone are chosen at run time */
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return "AVX-512 (kernels)";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "AVX2+FMA (kernels)";
    return "baseline x86-64 (SSE2)";
#else
    return "compiler default";
#endif
}

int attnx_interrupted(attnx_interrupt *interrupt, int calling_thread)
{
    if (!interrupt) return 0;
    if (interrupt->stopped) return 1;
    if (!calling_thread || !interrupt->poll) return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    double seconds = (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
    /* the first poll 20 ms into the call: shorter calls never pay for one
     * (Python sees a signal when they return anyway) */
    if (interrupt->next_poll == 0) interrupt->next_poll = seconds + 0.02;
    if (seconds < interrupt->next_poll) return 0;
    interrupt->next_poll = seconds + 0.02;
    if (interrupt->poll(interrupt->context)) interrupt->stopped = 1;
    return interrupt->stopped;
}
