/* portable.h - what differs between the compilers and C libraries attnx
 * builds with: GCC and clang on Linux (glibc or musl) and macOS, for x86-64
 * and aarch64; clang-cl on Windows.
 *
 * - ATTNX_X86_KERNELS: the x86 kernels (AVX2+FMA, AVX-512, AMX) are
 *   compiled, each under its own target, and chosen at run time by the CPU's
 *   features. GCC and clang both take GNU vector extensions and target
 *   attributes; -DATTNX_NO_CLONES leaves every run-time-chosen path out (a
 *   plain C + BLAS build).
 * - ATTNX_NEON_KERNELS: the aarch64 kernels (Advanced SIMD, which every
 *   aarch64 core has) are compiled; ATTNX_NO_CLONES leaves them out too.
 * - ATTNX_CLONES: target_clones (several copies of a function, one picked
 *   by the dynamic loader), with GCC on glibc. It needs ifunc, which musl,
 *   macOS and Windows lack; there, and under clang, the plain copy runs and
 *   the kernels above are still chosen by attnx itself.
 * - ATTNX_TARGET_PUSH(features) ... ATTNX_TARGET_POP: compile the functions
 *   between them for an instruction set (GCC's target pragma; clang's is
 *   spelled as an attribute applied to every function in the region).
 * - aligned memory: posix_memalign, or _aligned_malloc on Windows, each
 *   released by its own function.
 * - the monotonic clock: POSIX here, the performance counter on Windows. */
#ifndef ATTNX_PORTABLE_H
#define ATTNX_PORTABLE_H

#include <stdlib.h>
#include <time.h>
#ifdef _WIN32
#include <malloc.h>  /* _aligned_malloc */
/* windows.h without its min and max macros and the rarely used headers
 * (one of which defines `small`) */
#define WIN32_LEAN_AND_MEAN
#define NOMINMAX
#include <windows.h>
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(ATTNX_NO_CLONES)
#define ATTNX_X86_KERNELS 1
#endif
/* the NEON kernels: GNU vector extensions lowered to Advanced SIMD */
#if defined(__aarch64__) && defined(__GNUC__) && !defined(ATTNX_NO_CLONES)
#define ATTNX_NEON_KERNELS 1
#endif

/* __GLIBC__ comes from <features.h>, which stdlib.h includes on glibc.
 * Not under clang: clang 14 (Debian 12's) names the ifunc of an external
 * function f "f.ifunc", so calls to f from other files find no f at link */
#if defined(ATTNX_X86_KERNELS) && defined(__GLIBC__) && !defined(__clang__)
#define ATTNX_HAVE_CLONES 1
#define ATTNX_CLONES(...) __attribute__((target_clones(__VA_ARGS__)))
#else
#define ATTNX_CLONES(...)
#endif

#define ATTNX_PRAGMA(text) _Pragma(#text)
#ifdef __clang__
#define ATTNX_TARGET_PUSH(features) \
    ATTNX_PRAGMA(clang attribute push(__attribute__((target(features))), apply_to = function))
#define ATTNX_TARGET_POP ATTNX_PRAGMA(clang attribute pop)
#else
#define ATTNX_TARGET_PUSH(features) ATTNX_PRAGMA(GCC push_options) ATTNX_PRAGMA(GCC target(features))
#define ATTNX_TARGET_POP ATTNX_PRAGMA(GCC pop_options)
#endif

/* a function or object not exported from the module (calls between its
 * files stay direct); a DLL exports only what it names */
#ifdef _WIN32
#define ATTNX_HIDDEN
#else
#define ATTNX_HIDDEN __attribute__((visibility("hidden")))
#endif

/* `bytes` (at least one) aligned to `alignment`, a power of two and a
 * multiple of sizeof(void *); NULL when out of memory. Released only by
 * attnx_aligned_free: Windows' C library has neither aligned_alloc nor
 * posix_memalign, and what its _aligned_malloc returns cannot go to free. */
static inline void *attnx_aligned_alloc(size_t alignment, size_t bytes)
{
#ifdef _WIN32
    return _aligned_malloc(bytes ? bytes : 1, alignment);
#else
    void *memory = NULL;
    return posix_memalign(&memory, alignment, bytes ? bytes : 1) == 0 ? memory : NULL;
#endif
}

static inline void attnx_aligned_free(void *memory)
{
#ifdef _WIN32
    _aligned_free(memory);
#else
    free(memory);
#endif
}

/* seconds on a clock that never goes back */
static inline double attnx_monotonic_seconds(void)
{
#ifdef _WIN32
    LARGE_INTEGER count, frequency;
    QueryPerformanceCounter(&count);
    QueryPerformanceFrequency(&frequency);
    return (double)count.QuadPart / (double)frequency.QuadPart;
#else
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
#endif
}

#endif /* ATTNX_PORTABLE_H */
