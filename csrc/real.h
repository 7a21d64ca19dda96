/* real.h - instantiate a kernel family for float and double from one source.
 *
 * A family file (softmax.c, linear.c, ...) defines ATTNX_FAMILY_FILE as its
 * own name and includes this header; this header then includes the family
 * file twice, once per type, with REAL, SFX() and the typed helpers of
 * vec_real.h defined. The family body sits under `#ifdef REAL`.
 *
 * SFX(name) names a function of the body once per type (name_f32,
 * name_f64). A function called from elsewhere by its typed name is
 * defined as TYPED(name_f32, name_f64) instead, which spells both, so that
 * grep finds its body by the name it is called by (tests/test_dispatch.py
 * checks every one). */
#ifndef ATTNX_FAMILY_FILE
#error "define ATTNX_FAMILY_FILE before including real.h"
#endif

#define REAL float
#define REAL_IS_DOUBLE 0
#define SFX(name) name##_f32
#define TYPED(f32_name, f64_name) f32_name
#include "vec_real.h"
#include ATTNX_FAMILY_FILE
#undef REAL
#undef REAL_IS_DOUBLE
#undef SFX
#undef TYPED

#define REAL double
#define REAL_IS_DOUBLE 1
#define SFX(name) name##_f64
#define TYPED(f32_name, f64_name) f64_name
#include "vec_real.h"
#include ATTNX_FAMILY_FILE
#undef REAL
#undef REAL_IS_DOUBLE
#undef SFX
#undef TYPED
