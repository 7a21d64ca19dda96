/* bf16_dot_throughput.c - how many float32 multiply-adds per second one
 * core sustains through VDPBF16PS (avx512_bf16: per float32 lane, two
 * bfloat16 products added to the lane) against VFMADD231PS, both on zmm
 * registers with 12 independent accumulators, so that throughput, not
 * latency, bounds them. This decides whether attnx's bfloat16 dot products
 * (csrc/microkernel.h, mk_dot_pairs) pay on a CPU.
 *
 *   gcc -O2 -o /tmp/bf16_dot_throughput benchmarks/bf16_dot_throughput.c
 *   taskset -c 0 /tmp/bf16_dot_throughput
 *
 * The loops are asm (nothing for the compiler to fold), timed on the
 * thread's CPU clock; the best of 200 interleaved rounds is kept, the
 * figure least disturbed by other work on the core. Needs a CPU with
 * avx512_bf16 (SIGILL otherwise). */
#include <stdio.h>
#include <time.h>

static double thread_seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 24 instructions on 12 accumulators (zmm0-11) from zmm30, zmm31, which
 * hold bfloat16 pairs near 1 (the accumulators grow but stay normal) */
#define TWELVE(I) I("0") I("1") I("2") I("3") I("4") I("5") I("6") I("7") I("8") I("9") I("10") I("11")
#define DOT(n) "vdpbf16ps %%zmm30, %%zmm31, %%zmm" n "\n\t"
#define FMA(n) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" n "\n\t"
#define OPERANDS                                                              \
    "movl $0x3f813f7f, %%eax\n\tvpbroadcastd %%eax, %%zmm30\n\t"              \
    "movl $0x3f7e3f82, %%eax\n\tvpbroadcastd %%eax, %%zmm31\n\t"
#define CLOBBERS "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                 "xmm9", "xmm10", "xmm11", "xmm30", "xmm31", "eax", "cc"

__attribute__((target("avx512f"))) static double run(long rounds, int dot)
{
    double start = thread_seconds();
    if (dot)
        __asm__ volatile(OPERANDS "1:\n\t" TWELVE(DOT) TWELVE(DOT) "dec %0\n\tjnz 1b"
                         : "+r"(rounds)::CLOBBERS);
    else
        __asm__ volatile(OPERANDS "1:\n\t" TWELVE(FMA) TWELVE(FMA) "dec %0\n\tjnz 1b"
                         : "+r"(rounds)::CLOBBERS);
    return thread_seconds() - start;
}

int main(void)
{
    const long rounds = 2000000;
    double best_dot = 1e9, best_fma = 1e9;
    for (int r = 0; r < 200; r++) {
        double dot = run(rounds, 1), fma = run(rounds, 0);
        if (dot < best_dot) best_dot = dot;
        if (fma < best_fma) best_fma = fma;
    }
    double instructions = 24.0 * (double)rounds;
    /* flops: a VDPBF16PS lane does 2 multiplies and 2 adds, an FMA lane 1 and 1 */
    printf("VDPBF16PS   %.2f instructions/ns, %.0f GFLOP/s\n", instructions / best_dot * 1e-9,
           instructions * 64 / best_dot * 1e-9);
    printf("VFMADD231PS %.2f instructions/ns, %.0f GFLOP/s\n", instructions / best_fma * 1e-9,
           instructions * 32 / best_fma * 1e-9);
    printf("VDPBF16PS / VFMADD231PS flops: %.2f\n", (64 / best_dot) / (32 / best_fma));
    return 0;
}
