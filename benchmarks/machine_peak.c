/* machine_peak.c - the machine's ceilings, measured in the benchmarks' own
 * run: the multiply-add peak (float32 and float64) and the read bandwidth
 * of memory, on a given number of threads. benchmarks/harness.py builds it
 * on the fly (cc -O2 -fopenmp -shared) and calls it through ctypes
 * (harness.machine_peak), so that every benchmark can give its rates as a
 * fraction of them.
 *
 * The peak: per thread, a loop of vector multiply-adds on 16 independent
 * accumulators, more than the latency times the ports of any core here
 * (4 cycles x 2 ports), in the widest vectors the CPU has, chosen at run
 * time: AVX-512 (unless ATTNX_DISABLE_CPU_FEATURES names AVX512F), AVX2 +
 * FMA, NEON (aarch64), else scalar. Each step is
 * acc = acc * a + b with a and b read at run time, so nothing folds, and
 * the accumulators converge (|a| < 1) and stay normal.
 *
 * The bandwidth: every thread sums its share of a buffer much larger than
 * the last-level cache, touched first by the thread that reads it.
 *
 * Both keep the fastest of `repeats` runs (other work on a shared machine
 * only slows a run): the peak on each thread's CPU clock, the bandwidth on
 * the wall clock around the parallel region. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Independent accumulators per loop step: enough to cover the latency of
 * a multiply-add on every pipe (4 cycles x 2 pipes on current x86 cores),
 * and few enough that they and the two operands stay in registers: 16 of
 * the 32 registers of AVX-512 and NEON, 12 of the 16 of AVX2 and SSE (16
 * there spilled an accumulator to memory every step: on AMD Zen 4, AVX2's
 * peak measured 135 GFLOP/s on two threads, under attnx's own 149) */
#define WIDE_ACCUMULATORS 16
#define NARROW_ACCUMULATORS 12

/* One instruction set's loop: `steps` rounds of `count` multiply-adds on
 * vectors of `type`; returns a sum of the accumulators (kept, so that the
 * loop is not dead). */
#define FMA_LOOP(name, target, real, lanes, count)                                          \
    target static double name(long steps, real a_in, real b_in)                             \
    {                                                                                       \
        typedef real vec __attribute__((vector_size(lanes * sizeof(real))));               \
        vec acc[count], a = (vec){0} + a_in, b = (vec){0} + b_in;                            \
        for (int i = 0; i < count; i++) acc[i] = (vec){0} + (real)i;                        \
        for (long s = 0; s < steps; s++) {                                                  \
            _Pragma("GCC unroll 16") for (int i = 0; i < count; i++) acc[i] =               \
                acc[i] * a + b;                                                             \
        }                                                                                   \
        double total = 0;                                                                   \
        for (int i = 0; i < count; i++)                                                     \
            for (int l = 0; l < lanes; l++) total += (double)acc[i][l];                     \
        return total;                                                                       \
    }

#if defined(__x86_64__)
FMA_LOOP(fma_avx512_f32, __attribute__((target("avx512f"))), float, 16, WIDE_ACCUMULATORS)
FMA_LOOP(fma_avx512_f64, __attribute__((target("avx512f"))), double, 8, WIDE_ACCUMULATORS)
FMA_LOOP(fma_avx2_f32, __attribute__((target("avx2,fma"))), float, 8, NARROW_ACCUMULATORS)
FMA_LOOP(fma_avx2_f64, __attribute__((target("avx2,fma"))), double, 4, NARROW_ACCUMULATORS)
#elif defined(__aarch64__)
FMA_LOOP(fma_neon_f32, , float, 4, WIDE_ACCUMULATORS)
FMA_LOOP(fma_neon_f64, , double, 2, WIDE_ACCUMULATORS)
#endif
FMA_LOOP(fma_scalar_f32, , float, 1, NARROW_ACCUMULATORS)
FMA_LOOP(fma_scalar_f64, , double, 1, NARROW_ACCUMULATORS)

/* Whether ATTNX_DISABLE_CPU_FEATURES (comma-separated) names `feature`:
 * the peak then leaves it out as attnx does (benchmarks/isa_held.py) */
static int left_out(const char *feature)
{
    const char *list = getenv("ATTNX_DISABLE_CPU_FEATURES");
    size_t length = strlen(feature);
    for (const char *at = list; at && *at; at = strchr(at, ',') ? strchr(at, ',') + 1 : NULL)
        if (strncmp(at, feature, length) == 0 && (at[length] == ',' || at[length] == 0)) return 1;
    return 0;
}

/* The instruction set the peak runs on: "avx512", "avx2", "neon" or "scalar" */
const char *peak_isa(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && !left_out("AVX512F")) return "avx512";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "avx2";
    return "scalar";
#elif defined(__aarch64__)
    return "neon";
#else
    return "scalar";
#endif
}

/* multiply-adds of one step of the loop, per accumulator: the vector's lanes */
static int lanes_of(const char *isa, int is_double)
{
    int bytes = strcmp(isa, "avx512") == 0 ? 64 : strcmp(isa, "avx2") == 0 ? 32
                : strcmp(isa, "neon") == 0 ? 16 : (is_double ? 8 : 4);
    return bytes / (is_double ? 8 : 4);
}

static double run_fma(const char *isa, int is_double, long steps)
{
    volatile float a32 = 0.999f, b32 = 1e-3f;
    volatile double a64 = 0.999, b64 = 1e-3;
#if defined(__x86_64__)
    if (strcmp(isa, "avx512") == 0)
        return is_double ? fma_avx512_f64(steps, a64, b64) : fma_avx512_f32(steps, a32, b32);
    if (strcmp(isa, "avx2") == 0)
        return is_double ? fma_avx2_f64(steps, a64, b64) : fma_avx2_f32(steps, a32, b32);
#elif defined(__aarch64__)
    if (strcmp(isa, "neon") == 0)
        return is_double ? fma_neon_f64(steps, a64, b64) : fma_neon_f32(steps, a32, b32);
#endif
    return is_double ? fma_scalar_f64(steps, a64, b64) : fma_scalar_f32(steps, a32, b32);
}

static double thread_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* GFLOP/s (a multiply-add is 2 FLOPs) of `threads` threads running at
 * once, each `repeats` runs of `steps` steps: the sum over the threads of
 * each one's fastest run, timed on its own CPU clock, so that a thread
 * that another process keeps off its core for a while does not count that
 * time (two threads on one core's SMT siblings each run at half rate, and
 * their sum is the core's) */
double fma_gflops(int threads, int is_double, long steps, int repeats)
{
    const char *isa = peak_isa();
    double rate = 0, sink = 0;
    int accumulators = strcmp(isa, "avx512") == 0 || strcmp(isa, "neon") == 0
                           ? WIDE_ACCUMULATORS : NARROW_ACCUMULATORS;
    double flops = 2.0 * (double)steps * accumulators * lanes_of(isa, is_double);
#pragma omp parallel num_threads(threads) reduction(+ : rate, sink)
    {
        double best = 1e30;
        for (int rep = 0; rep < repeats; rep++) {
            double start = thread_seconds();
            sink += run_fma(isa, is_double, steps);
            double took = thread_seconds() - start;
            if (took < best) best = took;
        }
        rate += flops / best / 1e9;
    }
    return sink == 12345.678 ? 0 : rate;
}

/* The sum of x[0 .. count), count a multiple of 8 lanes, on 8 independent
 * accumulators: enough in flight that the adds never wait; in the widest
 * vectors, so that a buffer in the cache is read as fast as the cache
 * delivers (two doubles a load read a state-sized buffer from L2 at a
 * third of what a decoding step reads it at) */
#define READ_LOOP(name, target, lanes)                                                      \
    target static double name(const double *x, long count)                                  \
    {                                                                                       \
        typedef double vec __attribute__((vector_size(lanes * 8), aligned(lanes * 8)));     \
        vec acc[8] = {{0}};                                                                 \
        for (long i = 0; i < count; i += 8 * lanes)                                         \
            for (int a = 0; a < 8; a++) acc[a] += *(const vec *)(x + i + lanes * a);       \
        double total = 0;                                                                   \
        for (int a = 0; a < 8; a++)                                                         \
            for (int l = 0; l < lanes; l++) total += acc[a][l];                             \
        return total;                                                                       \
    }

#if defined(__x86_64__)
READ_LOOP(sum_avx512, __attribute__((target("avx512f"))), 8)
READ_LOOP(sum_avx2, __attribute__((target("avx2"))), 4)
#endif
READ_LOOP(sum_narrow, , 2)

static double sum_of(const double *x, long count)
{
#if defined(__x86_64__)
    const char *isa = peak_isa();
    if (strcmp(isa, "avx512") == 0) return sum_avx512(x, count);
    if (strcmp(isa, "avx2") == 0) return sum_avx2(x, count);
#endif
    return sum_narrow(x, count);
}

/* GB/s (1e9 bytes) at which `threads` threads read a buffer of `bytes`
 * bytes, the fastest of `repeats` sums of all of it; 0 when the buffer
 * cannot be allocated */
double read_gbps(int threads, long bytes, int repeats)
{
    /* whole blocks of 8 AVX-512 vectors per thread, each thread's share
     * starting on a 64-byte line */
    long count = bytes / (long)sizeof(double) / (64L * threads) * (64L * threads);
    long share = count / threads;
    double *buffer = NULL;
    if (count == 0 || posix_memalign((void **)&buffer, 64, (size_t)count * sizeof(double)))
        return 0;
    /* each thread's pages first touched by the thread that reads them */
#pragma omp parallel num_threads(threads)
    {
        double *mine = buffer + share * omp_get_thread_num();
        for (long i = 0; i < share; i++) mine[i] = (double)(i & 7);
    }
    double best = 1e30, sink = 0;
    for (int rep = 0; rep < repeats; rep++) {
        double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += sum_of(buffer + share * omp_get_thread_num(), share);
        double took = now() - start;
        if (took < best) best = took;
    }
    free(buffer);
    return sink < 0 ? 0 : (double)count * sizeof(double) / best / 1e9;
}
