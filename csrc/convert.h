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

/* the narrowing paths: VCVTNEPS2BF16 (avx512_bf16) or portable integer
 * rounding; both give the same bits */
enum { ATTNX_BF16_PORTABLE = 0, ATTNX_BF16_AVX512 = 1 };

/* 1 when this CPU (and build) has the avx512_bf16 narrowing */
int attnx_bf16_avx512_available(void);
/* the path narrowing uses now: the best available unless set */
int attnx_bf16_path(void);
/* use `path` from now on; returns the one before, or -1 (nothing
 * changed) when `path` is unknown or unavailable here */
int attnx_set_bf16_path(int path);
const char *attnx_bf16_path_name(int path);

/* dst (C order, the shape of src) = src widened or narrowed.
 * src: `ndim` axes of sizes shape[0..ndim), strides src_strides in
 * elements (any sign, 0 for a broadcast axis). ndim >= 1. Runs on
 * attnx's threads when there is enough work. Returns 0. */
int attnx_bf16_to_float(float *dst, const uint16_t *src, int ndim, const ptrdiff_t *shape,
                        const ptrdiff_t *src_strides);
int attnx_float_to_bf16(uint16_t *dst, const float *src, int ndim, const ptrdiff_t *shape,
                        const ptrdiff_t *src_strides);

#endif
