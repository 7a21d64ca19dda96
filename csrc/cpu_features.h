/* cpu_features.h - what this CPU can run, asked once at import
 * (cpu_features.c), and the features ATTNX_DISABLE_CPU_FEATURES leaves out.
 *
 * The names are numpy's (NPY_DISABLE_CPU_FEATURES): a user who knows one
 * variable knows the other. A feature counts only when the operating
 * system saves its registers too (xgetbv for AVX, AVX-512 and the AMX
 * tiles; Linux's per-process permission for the tiles). */
#ifndef ATTNX_CPU_FEATURES_H
#define ATTNX_CPU_FEATURES_H
#include <stdint.h>

enum {
    ATTNX_CPU_AVX2,
    ATTNX_CPU_FMA3,
    ATTNX_CPU_F16C,   /* float16 <-> float32 conversions (VCVTPH2PS, VCVTPS2PH) */
    ATTNX_CPU_AVX512F,
    ATTNX_CPU_AVX512DQ,
    ATTNX_CPU_AVX512BW,
    ATTNX_CPU_AVX512VL,
    ATTNX_CPU_AVX512_BF16,
    ATTNX_CPU_AMX_TILE,
    ATTNX_CPU_AMX_BF16,
    ATTNX_CPU_ASIMD,  /* aarch64 Advanced SIMD (NEON) */
    ATTNX_CPU_SVE,
    ATTNX_CPU_FEATURES
};

/* one bit per feature, 1u << ATTNX_CPU_* */
typedef uint32_t attnx_cpu_set;
#define ATTNX_CPU_BIT(feature) ((attnx_cpu_set)1 << (feature))

/* the features this CPU and operating system have (asked on the first call) */
attnx_cpu_set attnx_cpu_detected(void);
/* the bytes of one core's level-2 cache, 0 where this build cannot ask
 * (CPUID leaf 0x80000006, which Intel and AMD both fill; x86-64 only),
 * asked on the first call */
long attnx_cpu_l2_bytes(void);
/* Who made the CPU, for the choices between kernels that the features
 * alone do not settle: the same instruction runs at different rates on
 * Intel's and AMD's cores (dispatch.c's slower_on). Asked on the first
 * call (CPUID leaf 0's vendor string); ATTNX_VENDOR_OTHER off x86-64. */
enum { ATTNX_VENDOR_OTHER, ATTNX_VENDOR_INTEL, ATTNX_VENDOR_AMD, ATTNX_VENDORS };
int attnx_cpu_vendor(void);
/* "intel", "amd", "other" */
const char *attnx_cpu_vendor_name(int vendor);
/* numpy's spelling of a feature: "AVX512F", "AVX512_BF16", "ASIMD", ... */
const char *attnx_cpu_feature_name(int feature);

/* The features a list names: names separated by commas or spaces (as
 * numpy reads NPY_DISABLE_CPU_FEATURES), case-sensitive; "AMX" names both
 * AMX features. Names it does not know are copied, space-separated, to
 * unknown (at most unknown_size bytes, "" when none); they leave nothing out. */
attnx_cpu_set attnx_cpu_parse(const char *list, char *unknown, int unknown_size);
/* the names of `set`, comma-separated, into text ("" for none) */
void attnx_cpu_format(attnx_cpu_set set, char *text, int text_size);

#endif
