/* mk_backward.h - the softmax backward's products (softmax_backward.c) for
 * one vector width: included by microkernel.h in each of its bodies (MK_W,
 * MK_REAL, MK_VEC, MK_TYPED defined), so that the same source gives the
 * AVX-512, AVX2+FMA and NEON kernels, float32 and float64.
 *
 *   c (rows, cols) = alpha a b   (or += when accumulate)
 *
 * with a's element (r, p) at a[r a_row + p a_col], so that a transposed
 * operand costs nothing, and b (depth, cols) rows b_row apart, cols a whole
 * number of vectors. A block of MK_GEMM_ROWS rows by 2 vectors keeps its
 * sums in registers; each step of p loads 2 vectors of b and broadcasts
 * MK_GEMM_ROWS numbers of a, for 2 MK_GEMM_ROWS fused multiply-adds. The
 * softmax backward runs it without BLAS, whose kernels may be chosen for a
 * lesser CPU (OPENBLAS_CORETYPE). */
#ifndef MK_W
#error "mk_backward.h is included by microkernel.h, in each of its bodies"
#endif

/* Rows per block: 16 sums of the 32 registers of AVX-512 and NEON, 12 of
 * the 16 of AVX2 (with 2 of b and the broadcast, 15) */
#if MK_KB_W == 8 || defined(MK_HAVE_NEON)
#define MK_GEMM_ROWS 8
#else
#define MK_GEMM_ROWS 6
#endif

/* one block of block_rows x vecs vectors (constants once inlined, as
 * `pairs`: a and b hold pairs of bfloat16 values, depth counts them;
 * MK_PAIRS only) */
static inline __attribute__((always_inline)) void MK_NAME(mk_gemm_block)(
    int block_rows, int vecs, ptrdiff_t depth, MK_REAL alpha, const MK_REAL *a, ptrdiff_t a_row,
    ptrdiff_t a_col, const MK_REAL *b, ptrdiff_t b_row, int accumulate, MK_REAL *c,
    ptrdiff_t c_row, const int pairs)
{
    MK_VEC sum[MK_GEMM_ROWS][2];
    (void)pairs;
#pragma GCC unroll 8
    for (int r = 0; r < block_rows; r++)
#pragma GCC unroll 2
        for (int x = 0; x < vecs; x++) sum[r][x] = (MK_VEC){0};
    for (ptrdiff_t p = 0; p < depth; p++) {
        MK_VEC b_p[2];
#pragma GCC unroll 2
        for (int x = 0; x < vecs; x++) b_p[x] = *(const MK_VEC *)(b + p * b_row + x * MK_W);
#pragma GCC unroll 8
        for (int r = 0; r < block_rows; r++) {
#ifdef MK_PAIRS
            if (pairs) {  /* a constant once inlined: no test in the loop */
                /* a broadcast, no arithmetic: the bits stay as they are */
                __m512 a_rp = _mm512_set1_ps(a[r * a_row + p * a_col]);
#pragma GCC unroll 2
                for (int x = 0; x < vecs; x++)
                    sum[r][x] = (MK_VEC)mk_dot_pairs((__m512)sum[r][x], (__m512)b_p[x], a_rp);
                continue;
            }
#endif
            /* x - 0 is x for every x (x + 0 would turn -0 into +0), so gcc
             * drops the subtraction and broadcasts straight from memory */
            MK_VEC a_rp = a[r * a_row + p * a_col] - (MK_VEC){0};
#pragma GCC unroll 2
            for (int x = 0; x < vecs; x++) sum[r][x] += a_rp * b_p[x];
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < block_rows; r++)
#pragma GCC unroll 2
        for (int x = 0; x < vecs; x++) {
            MK_VEC *c_rx = (MK_VEC *)(c + r * c_row + x * MK_W);
            *c_rx = accumulate ? *c_rx + alpha * sum[r][x] : alpha * sum[r][x];
        }
}

/* the columns of rows [r0, r0 + block_rows) (block_rows a constant once
 * inlined): blocks of 2 vectors, then 1 */
static inline __attribute__((always_inline)) void MK_NAME(mk_gemm_rows)(
    int block_rows, ptrdiff_t r0, ptrdiff_t cols, ptrdiff_t depth, MK_REAL alpha,
    const MK_REAL *a, ptrdiff_t a_row, ptrdiff_t a_col, const MK_REAL *b, ptrdiff_t b_row,
    int accumulate, MK_REAL *c, ptrdiff_t c_row, const int pairs)
{
    const MK_REAL *a_r = a + r0 * a_row;
    MK_REAL *c_r = c + r0 * c_row;
    ptrdiff_t c0 = 0;
    for (; c0 + 2 * MK_W <= cols; c0 += 2 * MK_W)
        MK_NAME(mk_gemm_block)(block_rows, 2, depth, alpha, a_r, a_row, a_col, b + c0, b_row,
                               accumulate, c_r + c0, c_row, pairs);
    if (c0 < cols)
        MK_NAME(mk_gemm_block)(block_rows, 1, depth, alpha, a_r, a_row, a_col, b + c0, b_row,
                               accumulate, c_r + c0, c_row, pairs);
}

/* The rows in blocks of MK_GEMM_ROWS, then of 4, then the 1 to 3 left in
 * one block. A block of few rows has few sums, each a chain of
 * multiply-adds waiting on the one before: 2 rows of 2 vectors run at half
 * the rate, 1 row at a quarter. So where blocks of 6 leave 2 rows (128 =
 * 21 x 6 + 2, the backward's blocks), the last 8 rows go as 2 blocks of 4. */
static inline __attribute__((always_inline)) void MK_NAME(mk_gemm_by)(
    ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t depth, MK_REAL alpha, const MK_REAL *a,
    ptrdiff_t a_row, ptrdiff_t a_col, const MK_REAL *b, ptrdiff_t b_row, int accumulate,
    MK_REAL *c, ptrdiff_t c_row, const int pairs)
{
#define MK_ROWS(count, r0)                                                                    \
    MK_NAME(mk_gemm_rows)(count, r0, cols, depth, alpha, a, a_row, a_col, b, b_row, accumulate, \
                          c, c_row, pairs)
    ptrdiff_t full = rows / MK_GEMM_ROWS * MK_GEMM_ROWS, r0 = 0;
    if (rows - full == 2 && full >= MK_GEMM_ROWS && MK_GEMM_ROWS == 6) full -= MK_GEMM_ROWS;
    for (; r0 < full; r0 += MK_GEMM_ROWS) MK_ROWS(MK_GEMM_ROWS, r0);
    for (; r0 + 4 <= rows; r0 += 4) MK_ROWS(4, r0);
    switch (rows - r0) {
    case 3: MK_ROWS(3, r0); break;
    case 2: MK_ROWS(2, r0); break;
    case 1: MK_ROWS(1, r0); break;
    default: break;
    }
#undef MK_ROWS
}

static __attribute__((unused)) void MK_TYPED(mk_gemm_w16, mk_gemm_d8, mk_gemm_w8, mk_gemm_d4,
                                              mk_gemm_n4, mk_gemm_nd2)(
    ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t depth, MK_REAL alpha, const MK_REAL *a,
    ptrdiff_t a_row, ptrdiff_t a_col, const MK_REAL *b, ptrdiff_t b_row, int accumulate,
    MK_REAL *c, ptrdiff_t c_row)
{
    MK_NAME(mk_gemm_by)(rows, cols, depth, alpha, a, a_row, a_col, b, b_row, accumulate, c, c_row,
                        0);
}

#ifdef MK_PAIRS
/* c (rows, cols) = alpha a b (or += when accumulate) by the bfloat16 dot
 * products: a's pair (r, p) at a[r a_row + p a_col], b (depth_pairs, cols)
 * rows b_row apart, both in pairs along the depth (mk_pair_along,
 * mk_pair_rows and their _rounded twins) */
static __attribute__((unused)) void mk_gemm_pairs_w16(ptrdiff_t rows, ptrdiff_t cols,
                                                      ptrdiff_t depth_pairs, float alpha,
                                                      const float *a, ptrdiff_t a_row,
                                                      ptrdiff_t a_col, const float *b,
                                                      ptrdiff_t b_row, int accumulate, float *c,
                                                      ptrdiff_t c_row)
{
    MK_NAME(mk_gemm_by)(rows, cols, depth_pairs, alpha, a, a_row, a_col, b, b_row, accumulate, c,
                        c_row, 1);
}
#endif

#undef MK_GEMM_ROWS
