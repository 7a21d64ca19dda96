/* vec_real.h - typed building blocks for the kernels, included by real.h
 * once per REAL. Everything here is static inline, named through SFX().
 *
 * ATTNX_HOT marks the functions holding the elementwise loops: with glibc
 * on x86-64 the compiler makes copies for AVX-512, AVX2+FMA and baseline
 * x86-64 and one is picked at load time, so a wheel built for any x86-64
 * still runs the wide loops where it can (portable.h, ATTNX_CLONES). */
#ifndef ATTNX_VEC_COMMON
#define ATTNX_VEC_COMMON
#include <math.h>
#include <string.h>
#include "portable.h"
#define ATTNX_HOT ATTNX_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
#define ATTNX_MIN(a, b) ((a) < (b) ? (a) : (b))
#define ATTNX_MAX(a, b) ((a) > (b) ? (a) : (b))
#define ATTNX_CACHE_LINE 64
#endif

#if REAL_IS_DOUBLE
#define GEMM_BLAS ATTNX_CBLAS(cblas_dgemm)
#else
#define GEMM_BLAS ATTNX_CBLAS(cblas_sgemm)
#endif

/* Ask the memory for `rows` rows of `count` elements (row stride x_row).
 * Always inlined: gcc deletes calls to a function that only prefetches, as
 * it has no effect it can see. */
static inline __attribute__((always_inline)) void SFX(prefetch_rows)(const REAL *x,
                                                                     ptrdiff_t x_row,
                                                                     ptrdiff_t rows,
                                                                     ptrdiff_t count)
{
    for (ptrdiff_t t = 0; t < rows; t++)
        for (ptrdiff_t c = 0; c < count; c += ATTNX_CACHE_LINE / (ptrdiff_t)sizeof(REAL))
            __builtin_prefetch(x + t * x_row + c);
    if (count > 0)
        for (ptrdiff_t t = 0; t < rows; t++) __builtin_prefetch(x + t * x_row + count - 1);
}

/* C (M x N) = alpha op(A) op(B) + beta C, row-major; trans_a/trans_b say
 * whether A is stored (K x M) and B (N x K). Sizes are checked to fit the
 * 32-bit BLAS interface by the binding. Each sum is held in a local, not
 * in C: C might alias A or B as far as the compiler knows, so a sum kept in
 * memory makes every multiply-add wait for a store and a reload (a decoding
 * step's 1 x 16 x 64 score product took 4 us so). With B stored (N x K),
 * an entry of C is a dot product along contiguous rows; otherwise the row
 * of C is built across N in a local strip. */
static ATTNX_HOT void SFX(gemm_small)(int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N,
                                       ptrdiff_t K, REAL alpha, const REAL *A, ptrdiff_t lda,
                                       const REAL *B, ptrdiff_t ldb, REAL beta, REAL *C,
                                       ptrdiff_t ldc)
{
    enum { STRIP = 64 };
    ptrdiff_t a_step = trans_a ? lda : 1, a_row = trans_a ? 1 : lda;
    for (ptrdiff_t i = 0; i < M; i++) {
        REAL *c_row = C + i * ldc;
        const REAL *a_i = A + i * a_row;
        if (trans_b) {
            for (ptrdiff_t j = 0; j < N; j++) {
                const REAL *b_j = B + j * ldb;
                REAL sum = 0;
#pragma omp simd reduction(+ : sum)
                for (ptrdiff_t p = 0; p < K; p++) sum += a_i[p * a_step] * b_j[p];
                /* beta == 0 overwrites: C may hold garbage, and 0 * NaN is NaN */
                c_row[j] = alpha * sum + (beta == 0 ? 0 : beta * c_row[j]);
            }
            continue;
        }
        for (ptrdiff_t j0 = 0; j0 < N; j0 += STRIP) {
            ptrdiff_t width = ATTNX_MIN(STRIP, N - j0);
            REAL strip[STRIP] = {0};
            for (ptrdiff_t p = 0; p < K; p++) {
                REAL a_ip = a_i[p * a_step];
                const REAL *b_p = B + p * ldb + j0;
#pragma omp simd
                for (ptrdiff_t j = 0; j < width; j++) strip[j] += a_ip * b_p[j];
            }
            for (ptrdiff_t j = 0; j < width; j++)
                c_row[j0 + j] = alpha * strip[j] + (beta == 0 ? 0 : beta * c_row[j0 + j]);
        }
    }
}

/* Below this many multiply-adds a BLAS call costs more than it computes
 * (decoding steps, tiny heads): plain loops instead. */
#define ATTNX_SMALL_GEMM 4096

static inline void SFX(gemm)(int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                             REAL alpha, const REAL *A, ptrdiff_t lda,
                             const REAL *B, ptrdiff_t ldb, REAL beta, REAL *C, ptrdiff_t ldc);

/* An operand whose stored rows are all one row: a broadcast input (keys or
 * values np.broadcast_to one row) read in place, row stride 0, which BLAS
 * refuses. The product then has rank one:
 *  - B (K x N) of equal rows b: C_i += alpha (sum_p op(A)_ip) b;
 *  - B stored (N x K) of equal rows b: C_ij += alpha op(A)_i . b, all j;
 *  - A (M x K) of equal rows, beta 0: row 0 once, copied to the others.
 * Other cases (a transposed A of equal rows) take the plain loops, which
 * read any stride. Returns 0 when no operand repeats. */
static int SFX(gemm_repeated)(int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                              REAL alpha, const REAL *A, ptrdiff_t lda, const REAL *B,
                              ptrdiff_t ldb, REAL beta, REAL *C, ptrdiff_t ldc)
{
    int repeated_a = lda == 0 && (trans_a ? K : M) > 1;
    int repeated_b = ldb == 0 && (trans_b ? N : K) > 1;
    if (!repeated_a && !repeated_b) return 0;
    if (repeated_b && !repeated_a) {
        for (ptrdiff_t i = 0; i < M; i++) {
            REAL *c_row = C + i * ldc, sum = 0;
            if (trans_b) {
                for (ptrdiff_t p = 0; p < K; p++) sum += (trans_a ? A[p * lda + i] : A[i * lda + p]) * B[p];
                for (ptrdiff_t j = 0; j < N; j++) c_row[j] = (beta == 0 ? 0 : beta * c_row[j]) + alpha * sum;
            } else {
                for (ptrdiff_t p = 0; p < K; p++) sum += trans_a ? A[p * lda + i] : A[i * lda + p];
                for (ptrdiff_t j = 0; j < N; j++) c_row[j] = (beta == 0 ? 0 : beta * c_row[j]) + alpha * sum * B[j];
            }
        }
        return 1;
    }
    if (repeated_a && !trans_a && beta == 0 && !repeated_b) {
        SFX(gemm)(0, trans_b, 1, N, K, alpha, A, K, B, ldb, 0, C, ldc);
        for (ptrdiff_t i = 1; i < M; i++) memcpy(C + i * ldc, C, (size_t)N * sizeof(REAL));
        return 1;
    }
    SFX(gemm_small)(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return 1;
}

static inline void SFX(gemm)(int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N, ptrdiff_t K,
                             REAL alpha, const REAL *A, ptrdiff_t lda,
                             const REAL *B, ptrdiff_t ldb, REAL beta, REAL *C, ptrdiff_t ldc)
{
    if (M == 0 || N == 0) return;
    if (SFX(gemm_repeated)(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc)) return;
    if (K == 0 || M * N * K <= ATTNX_SMALL_GEMM) {
        /* also K == 0, where BLAS may leave C untouched instead of beta C */
        SFX(gemm_small)(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    GEMM_BLAS(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, (int)M, (int)N, (int)K, alpha,
              A, (int)(lda > 0 ? lda : 1), B, (int)(ldb > 0 ? ldb : 1), beta, C,
              (int)(ldc > 0 ? ldc : 1));
}
#undef GEMM_BLAS

/* exp written to vectorise: x = n ln2 + r with |r| <= ln2/2 (Cody-Waite
 * split of ln2), e^r by its Taylor series (truncation below half an ulp on
 * that interval), 2^n built in the exponent bits. The round-to-nearest of
 * x log2(e) uses the 1.5 * 2^p trick, so no libm call blocks vectorisation.
 * exp(-inf) = 0, exp(nan) = nan; results below the smallest normal flush
 * to 0 and arguments above EXP_HI give +inf (kernels only exponentiate
 * stabilised, non-positive arguments). */
#if REAL_IS_DOUBLE
#define EXP_LO (-708.0)
#define EXP2_LO (-1022.0)
#define EXP_HI 709.0
#define EXP_MAGIC 6755399441055744.0          /* 1.5 * 2^52 */
#define EXP_LN2_HI 6.93147180369123816490e-01
#define EXP_LN2_LO 1.90821492927058770002e-10
typedef int64_t SFX(bits_t);
#define EXP_MANT_BITS 52
#define EXP_BIAS 1023
#else
#define EXP_LO (-87.0f)
#define EXP2_LO (-125.0f)
#define EXP_HI 88.37f
#define EXP_MAGIC 12582912.0f                 /* 1.5 * 2^23 */
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
typedef int32_t SFX(bits_t);
#define EXP_MANT_BITS 23
#define EXP_BIAS 127
#endif

/* e^r for |r| <= ln2/2 by its Taylor series (truncation below half an ulp) */
static inline __attribute__((always_inline)) REAL SFX(exp_reduced)(REAL r)
{
#if REAL_IS_DOUBLE
    REAL p = 1.0 / 6227020800.0;              /* to r^13 */
    p = p * r + 1.0 / 479001600.0;
    p = p * r + 1.0 / 39916800.0;
    p = p * r + 1.0 / 3628800.0;
    p = p * r + 1.0 / 362880.0;
    p = p * r + 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
#else
    REAL p = 1.0f / 5040.0f;                  /* to r^7 */
    p = p * r + 1.0f / 720.0f;
#endif
    p = p * r + (REAL)1 / 120;
    p = p * r + (REAL)1 / 24;
    p = p * r + (REAL)1 / 6;
    p = p * r + (REAL)0.5;
    p = p * r + 1;
    p = p * r + 1;
    return p;
}

/* 2^n for the integer n held in shifted = n + EXP_MAGIC, built in the
 * exponent bits; n must be a normal exponent */
static inline __attribute__((always_inline)) REAL SFX(pow2_shifted)(REAL shifted)
{
    SFX(bits_t) shifted_bits, magic_bits, pow2_bits;
    REAL magic = EXP_MAGIC, pow2;
    memcpy(&shifted_bits, &shifted, sizeof shifted);
    memcpy(&magic_bits, &magic, sizeof magic);
    pow2_bits = (SFX(bits_t))((shifted_bits - magic_bits) + EXP_BIAS) << EXP_MANT_BITS;
    memcpy(&pow2, &pow2_bits, sizeof pow2);
    return pow2;
}

/* e^x for EXP_LO <= x <= EXP_HI (and NaN) */
static inline __attribute__((always_inline)) REAL SFX(vexp_in_range)(REAL x)
{
    REAL shifted = x * (REAL)1.44269504088896340736 + EXP_MAGIC;
    REAL nf = shifted - EXP_MAGIC;
    REAL r = x - nf * EXP_LN2_HI;
    r = r - nf * EXP_LN2_LO;
    return SFX(exp_reduced)(r) * SFX(pow2_shifted)(shifted);
}

/* e^x without vexp's guard against overflow: x > EXP_HI gives garbage,
 * for lanes that a select throws away (elu keeps it only where x <= 0) */
static inline __attribute__((always_inline)) REAL SFX(vexp_nonpositive)(REAL x)
{
    REAL y = SFX(vexp_in_range)(x < EXP_LO ? EXP_LO : x);
    return x < EXP_LO ? 0 : y;
}

/* e^x, as the comment above the constants says */
static inline __attribute__((always_inline)) REAL SFX(vexp)(REAL x)
{
    REAL xc = x < EXP_LO ? EXP_LO : x;
    xc = xc > EXP_HI ? EXP_HI : xc;
    REAL y = SFX(vexp_in_range)(xc);
    y = x < EXP_LO ? 0 : y;
    y = x > EXP_HI ? (REAL)INFINITY : y;
    return y;
}

/* f = e^(x - top) / their sum, top the max of x (so that nothing
 * overflows); f may be x. Returns the sum. */
static inline ATTNX_HOT REAL SFX(exp_normalise)(const REAL *x, ptrdiff_t count, REAL top, REAL *f)
{
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t c = 0; c < count; c++) {
        f[c] = SFX(vexp)(x[c] - top);
        sum += f[c];
    }
    REAL inv = 1 / sum;
#pragma omp simd
    for (ptrdiff_t c = 0; c < count; c++) f[c] *= inv;
    return sum;
}

/* 2^x for x <= 0, written to vectorise, for the softmax tiles (whose
 * scores are kept in log2 units): x = n + f with n = round(x), |f| <= 1/2,
 * 2^f by a polynomial and 2^n in the exponent bits. float: a degree-6 fit
 * on Chebyshev nodes (relative error 1.9e-9; the AVX-512 kernel's is the
 * same fit on [0, 1)); double: e^(f ln2) by Taylor. 2^x = 0 below EXP2_LO (-inf
 * included); NaN stays NaN. */
static inline __attribute__((always_inline)) REAL SFX(vexp2)(REAL x)
{
    REAL xc = x < EXP2_LO ? EXP2_LO : x;
    xc = xc > 0 ? 0 : xc;
    REAL shifted = xc + EXP_MAGIC;
    REAL f = xc - (shifted - EXP_MAGIC);
#if REAL_IS_DOUBLE
    REAL p = SFX(exp_reduced)(f * 0.69314718055994530942);
#else
    REAL p = 1.5337576837119846e-4f;
    p = p * f + 1.3399860363333747e-3f;
    p = p * f + 9.618519534386695e-3f;
    p = p * f + 5.550328997517368e-2f;
    p = p * f + 0.2402264660871246f;
    p = p * f + 0.6931472056005106f;
    p = p * f + 1.0f;
#endif
    REAL y = p * SFX(pow2_shifted)(shifted);
    return x < EXP2_LO ? 0 : y;
}

/* 0 when every entry of the (rows, cols) block is finite: no entry has
 * all exponent bits set (an integer test, free of the latency of a
 * floating-point sum). Each lane of a vector keeps the largest exponent
 * field of its column across the rows, reduced once at the end, not per
 * row (the checks took 2% of a causal forward + backward). */
#define NONFINITE_LANES (64 / (ptrdiff_t)sizeof(REAL))
static inline ATTNX_HOT int SFX(has_nonfinite)(const REAL *block, ptrdiff_t rows, ptrdiff_t cols,
                                        ptrdiff_t row_stride)
{
    const SFX(bits_t) exponent = (SFX(bits_t))((1 << (sizeof(REAL) == 4 ? 8 : 11)) - 1)
                                 << (sizeof(REAL) == 4 ? 23 : 52);
    SFX(bits_t) top[NONFINITE_LANES] = {0}, largest = 0;
    const ptrdiff_t whole = cols / NONFINITE_LANES * NONFINITE_LANES;
    for (ptrdiff_t r = 0; r < rows; r++) {
        const REAL *row = block + r * row_stride;
        for (ptrdiff_t c0 = 0; c0 < whole; c0 += NONFINITE_LANES)
#pragma omp simd
            for (ptrdiff_t lane = 0; lane < NONFINITE_LANES; lane++) {
                SFX(bits_t) bits;
                memcpy(&bits, &row[c0 + lane], sizeof bits);
                bits &= exponent;
                top[lane] = bits > top[lane] ? bits : top[lane];
            }
        for (ptrdiff_t c = whole; c < cols; c++) {
            SFX(bits_t) bits;
            memcpy(&bits, &row[c], sizeof bits);
            bits &= exponent;
            largest = bits > largest ? bits : largest;
        }
    }
    for (ptrdiff_t lane = 0; lane < NONFINITE_LANES; lane++)
        largest = top[lane] > largest ? top[lane] : largest;
    return largest == exponent;
}
#undef NONFINITE_LANES

#undef EXP_LO
#undef EXP2_LO
#undef EXP_HI
#undef EXP_MAGIC
#undef EXP_LN2_HI
#undef EXP_LN2_LO
#undef EXP_MANT_BITS
#undef EXP_BIAS
