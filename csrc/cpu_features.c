/* cpu_features.c - the features of this CPU (cpu_features.h), asked in this
 * one place: cpuid and xgetbv on x86-64, the auxiliary vector on aarch64
 * Linux. dispatch.c turns them into each family's kernels. */
#include <stdio.h>
#include <string.h>

#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#define CPU_X86 1
#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>
static void cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    int out[4];
    __cpuidex(out, (int)leaf, (int)sub);
    for (int i = 0; i < 4; i++) r[i] = (unsigned)out[i];
}
static uint64_t xgetbv0(void) { return _xgetbv(0); }
#else
static void cpuid(unsigned leaf, unsigned sub, unsigned r[4])
{
    __asm__("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}
static uint64_t xgetbv0(void)
{
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t)hi << 32 | lo;
}
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#elif defined(__aarch64__) || defined(_M_ARM64)
#define CPU_ARM64 1
#if defined(__linux__)
#include <sys/auxv.h>
#endif
#endif

static const char *const feature_names[ATTNX_CPU_FEATURES] = {
    [ATTNX_CPU_AVX2] = "AVX2",           [ATTNX_CPU_FMA3] = "FMA3",
    [ATTNX_CPU_F16C] = "F16C",
    [ATTNX_CPU_AVX512F] = "AVX512F",     [ATTNX_CPU_AVX512DQ] = "AVX512DQ",
    [ATTNX_CPU_AVX512BW] = "AVX512BW",   [ATTNX_CPU_AVX512VL] = "AVX512VL",
    [ATTNX_CPU_AVX512_BF16] = "AVX512_BF16",
    [ATTNX_CPU_AMX_TILE] = "AMX_TILE",   [ATTNX_CPU_AMX_BF16] = "AMX_BF16",
    [ATTNX_CPU_ASIMD] = "ASIMD",         [ATTNX_CPU_SVE] = "SVE",
};

const char *attnx_cpu_feature_name(int feature) { return feature_names[feature]; }

#ifdef CPU_X86
static attnx_cpu_set detect_x86(void)
{
    attnx_cpu_set set = 0;
    unsigned r[4], leaf7[4] = {0}, leaf7_1[4] = {0};
    cpuid(0, 0, r);
    unsigned max_leaf = r[0];
    cpuid(1, 0, r);
    int osxsave = (r[2] >> 27) & 1, avx = (r[2] >> 28) & 1, fma = (r[2] >> 12) & 1;
    int f16c = (r[2] >> 29) & 1;
    if (!osxsave || !avx) return 0;
    /* the registers the operating system saves: ymm (bits 1, 2), zmm and
     * the mask registers (5, 6, 7), the tile configuration and data (17, 18) */
    uint64_t xcr0 = xgetbv0();
    int ymm = (xcr0 & 0x6) == 0x6, zmm = ymm && (xcr0 & 0xe0) == 0xe0;
    int tiles = (xcr0 & 0x60000) == 0x60000;
    if (max_leaf >= 7) {
        cpuid(7, 0, leaf7);
        if (leaf7[0] >= 1) cpuid(7, 1, leaf7_1);
    }
    if (ymm && (leaf7[1] >> 5) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX2);
    if (ymm && fma) set |= ATTNX_CPU_BIT(ATTNX_CPU_FMA3);
    if (ymm && f16c) set |= ATTNX_CPU_BIT(ATTNX_CPU_F16C);
    if (zmm && (leaf7[1] >> 16) & 1) {
        set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX512F);
        if ((leaf7[1] >> 17) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX512DQ);
        if ((leaf7[1] >> 30) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX512BW);
        if ((leaf7[1] >> 31) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX512VL);
        if ((leaf7_1[0] >> 5) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AVX512_BF16);
    }
    int amx = tiles && (leaf7[3] >> 24) & 1;
#if defined(__linux__)
    /* Linux lends the tile registers to a process that asks
     * (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); harmless when repeated */
    amx = amx && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    amx = 0; /* the tiles' permission is asked on Linux only */
#endif
    if (amx) {
        set |= ATTNX_CPU_BIT(ATTNX_CPU_AMX_TILE);
        if ((leaf7[3] >> 22) & 1) set |= ATTNX_CPU_BIT(ATTNX_CPU_AMX_BF16);
    }
    return set;
}
#endif

attnx_cpu_set attnx_cpu_detected(void)
{
    static int asked = 0;
    static attnx_cpu_set detected = 0;
    if (asked) return detected;
#if defined(CPU_X86)
    detected = detect_x86();
#elif defined(CPU_ARM64)
    /* Advanced SIMD is part of every ARMv8-A core */
    detected = ATTNX_CPU_BIT(ATTNX_CPU_ASIMD);
#if defined(__linux__) && defined(AT_HWCAP)
    if (getauxval(AT_HWCAP) & (1ul << 22)) detected |= ATTNX_CPU_BIT(ATTNX_CPU_SVE); /* HWCAP_SVE */
#endif
#endif
    asked = 1;
    return detected;
}

long attnx_cpu_l2_bytes(void)
{
    /* asked once: under a hypervisor each cpuid is a trip out of the guest,
     * and every softmax backward asks */
    static int asked = 0;
    static long l2_bytes = 0;
    if (asked) return l2_bytes;
#if defined(CPU_X86)
    unsigned r[4];
    cpuid(0x80000000u, 0, r);
    if (r[0] >= 0x80000006u) {
        cpuid(0x80000006u, 0, r);
        l2_bytes = (long)(r[2] >> 16) * 1024; /* ECX[31:16]: KiB */
    }
#endif
    asked = 1;
    return l2_bytes;
}

int attnx_cpu_vendor(void)
{
    static int asked = 0;
    static int vendor = ATTNX_VENDOR_OTHER;
    if (asked) return vendor;
#if defined(CPU_X86)
    unsigned r[4];
    char name[13];
    cpuid(0, 0, r);
    /* the vendor string is EBX, EDX, ECX */
    memcpy(name, &r[1], 4);
    memcpy(name + 4, &r[3], 4);
    memcpy(name + 8, &r[2], 4);
    name[12] = '\0';
    if (strcmp(name, "GenuineIntel") == 0) vendor = ATTNX_VENDOR_INTEL;
    if (strcmp(name, "AuthenticAMD") == 0) vendor = ATTNX_VENDOR_AMD;
#endif
    asked = 1;
    return vendor;
}

const char *attnx_cpu_vendor_name(int vendor)
{
    static const char *const names[ATTNX_VENDORS] = {
        [ATTNX_VENDOR_OTHER] = "other", [ATTNX_VENDOR_INTEL] = "intel", [ATTNX_VENDOR_AMD] = "amd"};
    return names[vendor];
}

static int is_separator(char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n'; }

attnx_cpu_set attnx_cpu_parse(const char *list, char *unknown, int unknown_size)
{
    attnx_cpu_set set = 0;
    int used = 0;
    unknown[0] = '\0';
    while (list && *list) {
        while (is_separator(*list)) list++;
        size_t length = 0;
        while (list[length] && !is_separator(list[length])) length++;
        if (!length) break;
        attnx_cpu_set named = 0;
        if (length == 3 && strncmp(list, "AMX", 3) == 0)
            named = ATTNX_CPU_BIT(ATTNX_CPU_AMX_TILE) | ATTNX_CPU_BIT(ATTNX_CPU_AMX_BF16);
        for (int f = 0; f < ATTNX_CPU_FEATURES; f++)
            if (strlen(feature_names[f]) == length && strncmp(list, feature_names[f], length) == 0)
                named = ATTNX_CPU_BIT(f);
        if (!named && used < unknown_size - 1) {
            int wrote = snprintf(unknown + used, (size_t)(unknown_size - used), "%s%.*s",
                                 used ? " " : "", (int)length, list);
            used = wrote < 0 ? used : (used + wrote < unknown_size ? used + wrote : unknown_size - 1);
        }
        set |= named;
        list += length;
    }
    return set;
}

void attnx_cpu_format(attnx_cpu_set set, char *text, int text_size)
{
    int used = 0;
    text[0] = '\0';
    for (int f = 0; f < ATTNX_CPU_FEATURES; f++) {
        if (!(set & ATTNX_CPU_BIT(f)) || used >= text_size - 1) continue;
        int wrote = snprintf(text + used, (size_t)(text_size - used), "%s%s", used ? "," : "",
                             feature_names[f]);
        used = wrote < 0 ? used : (used + wrote < text_size ? used + wrote : text_size - 1);
    }
}
