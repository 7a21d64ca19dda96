/* dispatch.c - one table of kernel sets per family (dispatch.h), and the
 * choice made from it at import.
 *
 * A new backend (NEON, an AVX2 kernel for a family that has none) is a row
 * in its family's table: the set, the features it needs, and whether this
 * build compiled it; the family's code then runs that set's kernels where
 * attnx_kernels(family) names it. */
#include <string.h>

#include "amx.h"          /* ATTNX_HAVE_AMX */
#include "convert.h"      /* ATTNX_CONVERT_X86 */
#include "dispatch.h"
#include "microkernel.h"  /* MK_HAVE_X86, MK_HAVE_NEON */

#ifdef MK_HAVE_X86
#define BUILT_X86 1
#else
#define BUILT_X86 0
#endif
#ifdef MK_HAVE_NEON
#define BUILT_NEON 1
#else
#define BUILT_NEON 0
#endif
#ifdef ATTNX_CONVERT_X86
#define BUILT_CONVERT_X86 1
#else
#define BUILT_CONVERT_X86 0
#endif
#ifdef ATTNX_HAVE_AMX
#define BUILT_AMX 1
#else
#define BUILT_AMX 0
#endif

#define BIT ATTNX_CPU_BIT
/* F16C for the float16 keys and values the decoding kernels and the conversions
 * read; every CPU with AVX2 has it */
#define NEEDS_AVX2 (BIT(ATTNX_CPU_AVX2) | BIT(ATTNX_CPU_FMA3) | BIT(ATTNX_CPU_F16C))
/* gcc may use AVX2 and FMA in code compiled for AVX-512 (its target implies them) */
#define NEEDS_AVX512 (NEEDS_AVX2 | BIT(ATTNX_CPU_AVX512F) | BIT(ATTNX_CPU_AVX512DQ))
#define NEEDS_AVX512_BF16 (NEEDS_AVX512 | BIT(ATTNX_CPU_AVX512_BF16))
#define NEEDS_AMX (NEEDS_AVX512_BF16 | BIT(ATTNX_CPU_AVX512BW) | BIT(ATTNX_CPU_AMX_TILE) | \
                   BIT(ATTNX_CPU_AMX_BF16))

/* A row: the set, the features it needs, whether this build compiled it,
 * and the CPU makers (1 << ATTNX_VENDOR_*) on whose cores it is slower than
 * the rows below it although the features are there: passed over there
 * unless a limit names it (so tests and measurements still run it). */
typedef struct {
    int set;
    attnx_cpu_set needs;
    int built;
    unsigned slower_on;
} kernel_row;

/* VDPBF16PS does half the flops of the two FMAs a cycle on Intel's cores
 * (benchmarks/bf16_dot_throughput.c: 0.50 on a Xeon with AMX, 1.86 on AMD
 * Zen 5), so bfloat16 operands go faster widened to float32 there */
#define SLOWER_ON_INTEL (1u << ATTNX_VENDOR_INTEL)

#define PLAIN_ROW {ATTNX_KERNELS_PLAIN, 0, 1, 0}
#define END_ROW {-1, 0, 0, 0}

static const kernel_row softmax_fwd_table[] = {
    {ATTNX_KERNELS_AMX, NEEDS_AMX, BUILT_AMX},
    {ATTNX_KERNELS_AVX512_BF16, NEEDS_AVX512_BF16, BUILT_X86, SLOWER_ON_INTEL},
    {ATTNX_KERNELS_AVX512, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};
static const kernel_row softmax_bwd_table[] = {
    {ATTNX_KERNELS_AMX, NEEDS_AMX, BUILT_AMX},
    {ATTNX_KERNELS_AVX512_BF16, NEEDS_AVX512_BF16, BUILT_X86, SLOWER_ON_INTEL},
    {ATTNX_KERNELS_AVX512, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};
/* the forward and the backward have the same sets (mk_linear.h) */
static const kernel_row linear_table[] = {
    {ATTNX_KERNELS_AVX512, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};
static const kernel_row decode_table[] = {
    {ATTNX_KERNELS_AVX512_GROUP, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX512, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};
/* the products on mk_gemm: LSH's chunks (lsh.c), the delta rule's (delta.c) */
static const kernel_row mk_gemm_table[] = {
    {ATTNX_KERNELS_AVX512, NEEDS_AVX512, BUILT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};
/* bfloat16: VCVTNEPS2BF16 narrowing, the integer rounding in vectors;
 * float16: F16C's and NEON's conversions (convert.c) */
static const kernel_row convert_table[] = {
    {ATTNX_KERNELS_AVX512_BF16, NEEDS_AVX2 | BIT(ATTNX_CPU_AVX512F) | BIT(ATTNX_CPU_AVX512_BF16),
     BUILT_CONVERT_X86},
    {ATTNX_KERNELS_AVX2, NEEDS_AVX2, BUILT_X86},
    {ATTNX_KERNELS_NEON, BIT(ATTNX_CPU_ASIMD), BUILT_NEON},
    PLAIN_ROW, END_ROW,
};

static const kernel_row *const tables[ATTNX_FAMILIES] = {
    [ATTNX_FAMILY_SOFTMAX_FWD] = softmax_fwd_table, [ATTNX_FAMILY_SOFTMAX_BWD] = softmax_bwd_table,
    [ATTNX_FAMILY_LINEAR_FWD] = linear_table,       [ATTNX_FAMILY_LINEAR_BWD] = linear_table,
    [ATTNX_FAMILY_DECODE] = decode_table,           [ATTNX_FAMILY_LSH] = mk_gemm_table,
    [ATTNX_FAMILY_CONVERT] = convert_table,         [ATTNX_FAMILY_DELTA] = mk_gemm_table,
};

static const char *const family_names[ATTNX_FAMILIES] = {
    [ATTNX_FAMILY_SOFTMAX_FWD] = "softmax_forward", [ATTNX_FAMILY_SOFTMAX_BWD] = "softmax_backward",
    [ATTNX_FAMILY_LINEAR_FWD] = "linear_forward",   [ATTNX_FAMILY_LINEAR_BWD] = "linear_backward",
    [ATTNX_FAMILY_DECODE] = "decode",               [ATTNX_FAMILY_LSH] = "lsh",
    [ATTNX_FAMILY_CONVERT] = "convert",             [ATTNX_FAMILY_DELTA] = "delta_rule",
};

static const char *const set_names[ATTNX_KERNEL_SETS] = {
    [ATTNX_KERNELS_PLAIN] = "plain",
    [ATTNX_KERNELS_AVX2] = "avx2",
    [ATTNX_KERNELS_AVX512] = "avx512",
    [ATTNX_KERNELS_AVX512_BF16] = "avx512_bf16",
    [ATTNX_KERNELS_AVX512_GROUP] = "avx512_group",
    [ATTNX_KERNELS_AMX] = "amx",
    [ATTNX_KERNELS_NEON] = "neon",
};

int attnx_dispatch_table[ATTNX_FAMILIES];
static attnx_cpu_set disabled_features = 0;
static int family_limits[ATTNX_FAMILIES] = {-1, -1, -1, -1, -1, -1, -1, -1};

static int table_holds(const kernel_row *table, int set)
{
    for (const kernel_row *row = table; row->set >= 0; row++)
        if (row->set == set && row->built) return 1;
    return 0;
}

int attnx_dispatch_fill(attnx_cpu_set disabled, const int *limits)
{
    for (int f = 0; f < ATTNX_FAMILIES; f++)
        if (limits && limits[f] >= 0 && !table_holds(tables[f], limits[f])) return -1 - f;
    attnx_cpu_set usable = attnx_cpu_detected() & ~disabled;
    unsigned vendor = 1u << attnx_cpu_vendor();
    for (int f = 0; f < ATTNX_FAMILIES; f++) {
        int limit = limits ? limits[f] : -1, reached = limit < 0;
        for (const kernel_row *row = tables[f]; row->set >= 0; row++) {
            reached = reached || row->set == limit;
            int slower = (row->slower_on & vendor) && row->set != limit;
            if (reached && row->built && (row->needs & ~usable) == 0 && !slower) {
                attnx_dispatch_table[f] = row->set;
                break;
            }
        }
        family_limits[f] = limit;
    }
    disabled_features = disabled;
    return 0;
}

attnx_cpu_set attnx_dispatch_disabled(void) { return disabled_features; }
int attnx_dispatch_limit(int family) { return family_limits[family]; }

const char *attnx_family_name(int family) { return family_names[family]; }
const char *attnx_kernels_name(int set) { return set_names[set]; }

int attnx_family_from_name(const char *name)
{
    for (int f = 0; f < ATTNX_FAMILIES; f++)
        if (strcmp(name, family_names[f]) == 0) return f;
    return -1;
}

int attnx_kernels_from_name(const char *name)
{
    for (int s = 0; s < ATTNX_KERNEL_SETS; s++)
        if (strcmp(name, set_names[s]) == 0) return s;
    return -1;
}

int attnx_family_sets(int family, int *sets)
{
    int count = 0;
    for (const kernel_row *row = tables[family]; row->set >= 0; row++)
        if (row->built) sets[count++] = row->set;
    return count;
}
