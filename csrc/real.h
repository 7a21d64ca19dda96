/* real.h - instantiate a kernel family for float and double from one source.
 *
 * A family file (softmax.c, linear.c, ...) defines ATTNX_FAMILY_FILE as its
 * own name and includes this header; this header then includes the family
 * file twice, once per type, with REAL, SFX() and the typed helpers of
 * vec_real.h defined. The family body sits under `#ifdef REAL`. */
#ifndef ATTNX_FAMILY_FILE
#error "define ATTNX_FAMILY_FILE before including real.h"
#endif

#define REAL float
#define REAL_IS_DOUBLE 0
#define SFX(name) name##_f32
#include "vec_real.h"
#include ATTNX_FAMILY_FILE
#undef REAL
#undef REAL_IS_DOUBLE
#undef SFX

#define REAL double
#define REAL_IS_DOUBLE 1
#define SFX(name) name##_f64
#include "vec_real.h"
#include ATTNX_FAMILY_FILE
#undef REAL
#undef REAL_IS_DOUBLE
#undef SFX
