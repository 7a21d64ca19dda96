/* dispatch.h - which kernels each family runs on this CPU (dispatch.c).
 *
 * Every family has its own table of kernel sets, best first, each with the
 * CPU features it needs (dispatch.c). At import the table's first set that
 * this build compiled and whose features the CPU has, less those
 * ATTNX_DISABLE_CPU_FEATURES leaves out, becomes the family's choice; a
 * kernel asks attnx_kernels(family) once per call and runs that set's code
 * where the call's shape suits it, the plain C + BLAS code otherwise.
 * A test (attnx._C._set_dispatch) fills the tables again through the same
 * function, with other features left out, or a family held to a set
 * further down its table. */
#ifndef ATTNX_DISPATCH_H
#define ATTNX_DISPATCH_H
#include "cpu_features.h"

enum {
    ATTNX_FAMILY_SOFTMAX_FWD,  /* softmax.c, softmax_mk.c, softmax_amx.c */
    ATTNX_FAMILY_SOFTMAX_BWD,  /* softmax_backward.c */
    ATTNX_FAMILY_LINEAR_FWD,   /* linear.c's forms forward, features.c */
    ATTNX_FAMILY_LINEAR_BWD,   /* linear.c's backward */
    ATTNX_FAMILY_DECODE,       /* linear.c's single-token steps of a state */
    ATTNX_FAMILY_LSH,          /* lsh.c */
    ATTNX_FAMILY_CONVERT,      /* convert.c, bfloat16 <-> float32 */
    ATTNX_FAMILY_DELTA,        /* delta.c's chunk products */
    ATTNX_FAMILIES
};

/* The kernel sets. avx512_bf16: AVX-512 with the bfloat16 dot products
 * (microkernel.h, mk_dot_pairs) where the operands are bfloat16 values;
 * amx: the AMX tiles for float32 softmax (amx.h), AVX-512's FMAs in the
 * calls AMX does not take (AMX is Intel's, whose cores run those dot
 * products at half the FMAs' rate: dispatch.c); avx512_group: AVX-512 decoding steps of four
 * heads at once where one of them takes its turn (linear.c, decode_group). */
enum {
    ATTNX_KERNELS_PLAIN,
    ATTNX_KERNELS_AVX2,
    ATTNX_KERNELS_AVX512,
    ATTNX_KERNELS_AVX512_BF16,
    ATTNX_KERNELS_AVX512_GROUP,
    ATTNX_KERNELS_AMX,
    ATTNX_KERNELS_NEON,
    ATTNX_KERNEL_SETS
};

/* the families' choices; written only by attnx_dispatch_fill */
extern int attnx_dispatch_table[ATTNX_FAMILIES];

static inline int attnx_kernels(int family) { return attnx_dispatch_table[family]; }

/* the float32 lanes of the register-blocked kernels of a set (16 AVX-512,
 * 8 AVX2, 4 NEON, 0 none) */
static inline int attnx_kernels_width(int set)
{
    return set == ATTNX_KERNELS_AVX2   ? 8
           : set == ATTNX_KERNELS_NEON ? 4
           : set == ATTNX_KERNELS_PLAIN ? 0
                                        : 16;
}

/* 1 for the sets with the bfloat16 dot products */
static inline int attnx_kernels_bf16_dot(int set)
{
    return set == ATTNX_KERNELS_AVX512_BF16;
}

/* Fill every family's choice: its table's first set this build has whose
 * features the CPU has outside `disabled`, no earlier in the table than
 * limits[family] (a set, or -1 for none). Returns -1 - family when a limit
 * names a set that family's table does not hold (nothing changed), 0 otherwise. */
int attnx_dispatch_fill(attnx_cpu_set disabled, const int *limits);
/* what the last fill was given */
attnx_cpu_set attnx_dispatch_disabled(void);
int attnx_dispatch_limit(int family);

/* "softmax_forward", ... and "plain", "avx512", ...; -1 for an unknown name */
const char *attnx_family_name(int family);
int attnx_family_from_name(const char *name);
const char *attnx_kernels_name(int set);
int attnx_kernels_from_name(const char *name);
/* the sets family's table holds that this build compiled, best first;
 * returns their count */
int attnx_family_sets(int family, int *sets);

#endif
