/* convert.h - bfloat16 <-> float32 conversion (convert.c), for the
 * half-precision tensors attnx.torch computes in float32.
 *
 * bfloat16 is the upper half of a float32: 1 sign, 8 exponent and 7
 * mantissa bits, held here as uint16_t bit patterns. Widening is exact;
 * narrowing rounds to nearest, ties to even (denormals kept, infinities
 * kept, NaN stays NaN with its sign). */
#ifndef ATTNX_CONVERT_H
#define ATTNX_CONVERT_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* one bfloat16 number (its bits) as a float32: exact */
static inline float attnx_bf16_widened(uint16_t bits)
{
    uint32_t wide = (uint32_t)bits << 16;
    float x;
    memcpy(&x, &wide, sizeof x);
    return x;
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

/* One conversion, dst (C order) = src widened (widen: bfloat16 bits to
 * float32) or narrowed, prepared by attnx_conversion_prepare (shape and
 * strides as for attnx_bf16_to_float below; -1 for ndim out of range). */
typedef struct attnx_conversion {
    void *dst;
    const void *src;
    int widen;
    ptrdiff_t total;                  /* elements */
    attnx_conversion_layout from;     /* src's layout, axes merged */
} attnx_conversion;

int attnx_conversion_prepare(attnx_conversion *job, void *dst, const void *src, int widen,
                             int ndim, const ptrdiff_t *shape, const ptrdiff_t *src_strides);

/* job, on attnx's threads when it has enough work */
void attnx_conversion_run(const attnx_conversion *job);

/* dst (C order, the shape of src) = src widened or narrowed.
 * src: `ndim` axes of sizes shape[0..ndim), strides src_strides in
 * elements (any sign, 0 for a broadcast axis). ndim >= 1. Runs on
 * attnx's threads when there is enough work. Returns 0. */
int attnx_bf16_to_float(float *dst, const uint16_t *src, int ndim, const ptrdiff_t *shape,
                        const ptrdiff_t *src_strides);
int attnx_float_to_bf16(uint16_t *dst, const float *src, int ndim, const ptrdiff_t *shape,
                        const ptrdiff_t *src_strides);

#endif
