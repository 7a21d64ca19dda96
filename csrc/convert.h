/* convert.h - half precision <-> float32 conversion (convert.c), for the
 * half-precision tensors attnx.torch computes in float32.
 *
 * Two formats, held here as uint16_t bit patterns (attnx_half_format):
 * bfloat16, the upper half of a float32 (1 sign, 8 exponent and 7 mantissa
 * bits), and IEEE float16 (1, 5 and 10). Widening is exact; narrowing
 * rounds to nearest, ties to even (denormals kept, overflow to infinity,
 * NaN stays NaN with its sign, made quiet). Every path, scalar or vector,
 * gives the same bits. */
#ifndef ATTNX_CONVERT_H
#define ATTNX_CONVERT_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef enum { ATTNX_BF16 = 1, ATTNX_F16 = 2 } attnx_half_format;

/* one bfloat16 number (its bits) as a float32: exact */
static inline float attnx_bf16_widened(uint16_t bits)
{
    uint32_t wide = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &wide, sizeof x);
    return x;
}

/* one float16 number (its bits) as a float32: exact. A signalling NaN
 * comes out quiet, as from F16C's VCVTPH2PS and NEON's FCVTL. Selects
 * rather than branches, so that the plain loops that call it vectorise. */
static inline float attnx_f16_widened(uint16_t bits)
{
    uint32_t exponent = (bits >> 10) & 0x1fu, mantissa = bits & 0x3ffu;
    /* normal numbers, infinities and NaN: the fields moved, rebiased */
    uint32_t fields = (exponent == 0x1f ? 0x7f800000u | (mantissa ? 0x00400000u : 0)
                                        : (exponent + 127 - 15) << 23) | mantissa << 13;
    float magnitude;
    memcpy(&magnitude, &fields, sizeof magnitude);
    /* zero and the subnormals: mantissa units of 2^-24, exact in a float */
    magnitude = exponent == 0 ? (float)mantissa * 0x1p-24f : magnitude;
    return bits & 0x8000u ? -magnitude : magnitude;
}

/* this build has VCVTNEPS2BF16 narrowing (avx512_bf16), which the
 * conversions' table (dispatch.c) offers where the CPU has it; it gives
 * the bits the portable integer rounding gives */
#if defined(__x86_64__) && defined(__GNUC__)
#define ATTNX_CONVERT_X86 1
#endif

/* numpy's limit on dimensions */
#define ATTNX_CONVERT_MAX_DIMS 64

typedef struct {
    int ndim;
    ptrdiff_t shape[ATTNX_CONVERT_MAX_DIMS];
    ptrdiff_t strides[ATTNX_CONVERT_MAX_DIMS];
} attnx_conversion_layout;

/* One conversion, dst (C order) = src widened (widen: half-precision bits
 * of `format` to float32) or float32 narrowed to them, prepared by
 * attnx_conversion_prepare. src: `ndim` axes of sizes shape[0..ndim),
 * strides src_strides in elements (any sign, 0 for a broadcast axis);
 * 1 <= ndim <= ATTNX_CONVERT_MAX_DIMS, else -1. */
typedef struct attnx_conversion {
    void *dst;
    const void *src;
    int widen;
    attnx_half_format format;
    ptrdiff_t total;                  /* elements */
    attnx_conversion_layout from;     /* src's layout, axes merged */
} attnx_conversion;

int attnx_conversion_prepare(attnx_conversion *job, void *dst, const void *src, int widen,
                             attnx_half_format format, int ndim, const ptrdiff_t *shape,
                             const ptrdiff_t *src_strides);

/* rows x cols half-precision numbers of `format` widened into float32,
 * rows src_row and dst_row apart, on the calling thread (a kernel's block
 * of keys) */
void attnx_widen_rows(float *dst, ptrdiff_t dst_row, const uint16_t *src, ptrdiff_t src_row,
                      ptrdiff_t rows, ptrdiff_t cols, attnx_half_format format);

/* the `count` jobs (whose destinations overlap nothing they read or
 * write), in one parallel region of attnx's threads when they have
 * enough work together */
void attnx_conversion_run(const attnx_conversion *jobs, int count);

#endif
