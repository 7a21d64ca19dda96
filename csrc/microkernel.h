/* microkernel.h - register-blocked float32 products for the softmax tiles,
 * for AVX-512 and AVX2+FMA, picked at run time (attnx_mk_width).
 *
 * BLAS is slow on these tiles: K = d is short, and sgemm re-packs each key
 * and value tile for every query tile. Here the keys are packed once per
 * head (attnx_mk_pack_keys) into panels of MK_NR(w) keys stored feature by
 * feature, which the scores kernel streams; the values are streamed from
 * their own rows (a row of e floats is already contiguous).
 *
 * Both skip the register blocks that the band (causal, window) hides
 * entirely: on the tiles that straddle the diagonal, half the work. Scores
 * left unwritten there lie outside every row's visible range, which the
 * softmax pass never reads, and the P V product skips exactly the keys
 * whose p is 0 because the band hides them.
 *
 * Legend (as in softmax.c): rows query rows, cols keys of the tile,
 *   d features, e value features, W floats per vector, NR = 2 W keys per
 *   panel, MR rows per register block.
 *   kt     (panels, d, NR)    packed keys, zero past the last key
 *   scores (rows, panels NR)  scale * Q K^T, whole panels stored
 *   out    (rows, e)          += P V, e a multiple of W
 *
 * Measured on one AVX-512 core (n = 2048, 8 heads): the kernels run the
 * two products at ~150 GF/s where sgemm on the same tiles gave ~115.
 *
 * The file includes itself once per width with MK_W defined; each body is
 * compiled for its instruction set under #pragma GCC target. */
#ifndef MK_W
#ifndef ATTNX_MICROKERNEL_H
#define ATTNX_MICROKERNEL_H
#include <stddef.h>
#include <string.h>

#include "attnx.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* keys per packed panel for vectors of w floats */
#define MK_NR(w) (2 * (w))

/* The tile: queries [i0, i0 + rows), keys [j0, j0 + cols), and the band
 * that decides which of them meet. */
typedef struct {
    const attnx_band *band;
    ptrdiff_t i0, rows, j0, cols;
} mk_tile;

/* Keys [*lo, *hi) of the tile (0-based in it) that some row of [r0, r0 +
 * count) sees through the band; *hi <= *lo when none. */
static inline void mk_block_keys(const mk_tile *t, ptrdiff_t r0, ptrdiff_t count, ptrdiff_t *lo,
                                 ptrdiff_t *hi)
{
    ptrdiff_t r1 = (r0 + count < t->rows ? r0 + count : t->rows) - 1;
    *lo = attnx_band_first(t->band, t->i0 + r0) - t->j0;
    *hi = attnx_band_end(t->band, t->i0 + r1) - t->j0;
    if (*lo < 0) *lo = 0;
    if (*hi > t->cols) *hi = t->cols;
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(ATTNX_NO_CLONES)
#define MK_HAVE_X86 1

#define MK_W 16
#define MK_MR 12 /* 24 of the 32 zmm registers accumulate */
#define MK_TARGET _Pragma("GCC target(\"avx512f\")")
#include "microkernel.h"
#undef MK_W
#undef MK_MR
#undef MK_TARGET

#define MK_W 8
#define MK_MR 6 /* 12 of the 16 ymm registers accumulate */
#define MK_TARGET _Pragma("GCC target(\"avx2,fma\")")
#include "microkernel.h"
#undef MK_W
#undef MK_MR
#undef MK_TARGET
#endif

/* floats per vector of the best kernels this CPU runs, 0 for none */
static inline int attnx_mk_width(void)
{
#ifdef MK_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 16;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 8;
#endif
    return 0;
}

/* kt (panels, d, nr) <- keys [0, count) of k (row stride k_row), transposed
 * panel by panel; the lanes past `count` in the last panel are 0. */
static void attnx_mk_pack_keys(float *kt, const float *k, ptrdiff_t k_row, ptrdiff_t count,
                               ptrdiff_t d, ptrdiff_t nr)
{
    for (ptrdiff_t j0 = 0; j0 < count; j0 += nr) {
        float *panel = kt + j0 * d;
        ptrdiff_t keys = count - j0 < nr ? count - j0 : nr;
        if (keys < nr) memset(panel, 0, (size_t)(d * nr) * sizeof *panel);
        for (ptrdiff_t jj = 0; jj < keys; jj++) {
            const float *k_j = k + (j0 + jj) * k_row;
            for (ptrdiff_t c = 0; c < d; c++) panel[c * nr + jj] = k_j[c];
        }
    }
}

#ifdef MK_HAVE_X86
#define MK_DISPATCH(w, name, ...) \
    ((w) == 16 ? name##_w16(__VA_ARGS__) : name##_w8(__VA_ARGS__))
#else
#define MK_DISPATCH(w, name, ...) ((void)0)
#endif

/* scores (rows, panels NR), row stride s_row, = scale * Q K^T for the
 * visible blocks; kt holds the tile's panels, the first at key j0 */
static inline void attnx_mk_scores(int w, const mk_tile *t, float *scores, ptrdiff_t s_row,
                                   const float *q, ptrdiff_t q_row, const float *kt, ptrdiff_t d,
                                   float scale)
{
    MK_DISPATCH(w, mk_scores, t, scores, s_row, q, q_row, kt, d, scale);
}

/* out (rows, e) += P V over the tile's keys; P row stride p_row; e % w == 0 */
static inline void attnx_mk_add_pv(int w, const mk_tile *t, float *out, ptrdiff_t out_row,
                                   const float *p, ptrdiff_t p_row, const float *v,
                                   ptrdiff_t v_row, ptrdiff_t e)
{
    MK_DISPATCH(w, mk_add_pv, t, out, out_row, p, p_row, v, v_row, e);
}
#undef MK_DISPATCH

#endif /* ATTNX_MICROKERNEL_H */

#else /* MK_W: the kernels for one vector width */

#pragma GCC push_options
MK_TARGET

#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)
#define MK_NAME(name) MK_CAT(name, MK_CAT(_w, MK_W))
#define MK_VEC MK_NAME(mk_vec)

/* unaligned, may alias the float arrays it is loaded from */
typedef float MK_VEC __attribute__((vector_size(MK_W * 4), aligned(4), may_alias));

/* One MR x NR block of scores. Rows past `rows` reread the last row (their
 * results are dropped), so every block runs the same unrolled code. */
static inline __attribute__((always_inline)) void MK_NAME(mk_scores_block)(
    float *scores, ptrdiff_t s_row, const float *q, ptrdiff_t q_row, ptrdiff_t rows,
    const float *panel, ptrdiff_t d, float scale)
{
    const float *q_r[MK_MR];
    MK_VEC acc[MK_MR][2];
#pragma GCC unroll 16
    for (int r = 0; r < MK_MR; r++) {
        q_r[r] = q + (r < rows ? r : rows - 1) * q_row;
        acc[r][0] = acc[r][1] = (MK_VEC){0};
    }
    for (ptrdiff_t c = 0; c < d; c++) {
        MK_VEC k0 = *(const MK_VEC *)(panel + c * 2 * MK_W);
        MK_VEC k1 = *(const MK_VEC *)(panel + c * 2 * MK_W + MK_W);
#pragma GCC unroll 16
        for (int r = 0; r < MK_MR; r++) {
            float q_rc = q_r[r][c];
            acc[r][0] += k0 * q_rc;
            acc[r][1] += k1 * q_rc;
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MK_MR; r++)
        if (r < rows) {
            *(MK_VEC *)(scores + r * s_row) = acc[r][0] * scale;
            *(MK_VEC *)(scores + r * s_row + MK_W) = acc[r][1] * scale;
        }
}

static void MK_NAME(mk_scores)(const mk_tile *t, float *scores, ptrdiff_t s_row, const float *q,
                               ptrdiff_t q_row, const float *kt, ptrdiff_t d, float scale)
{
    /* a panel of keys (d NR floats) stays in L1 while the query rows
     * stream past it from L2 */
    for (ptrdiff_t c0 = 0; c0 < t->cols; c0 += 2 * MK_W)
        for (ptrdiff_t r0 = 0; r0 < t->rows; r0 += MK_MR) {
            ptrdiff_t lo, hi;
            mk_block_keys(t, r0, MK_MR, &lo, &hi);
            if (hi <= c0 || lo >= c0 + 2 * MK_W) continue;
            MK_NAME(mk_scores_block)(scores + r0 * s_row + c0, s_row, q + r0 * q_row, q_row,
                                     t->rows - r0, kt + c0 * d, d, scale);
        }
}

/* out[r][0, nv W) += sum_j p[r][j] v[j][0, nv W) for one block of mr rows;
 * mr and nv (mr nv <= 2 MK_MR accumulators) are constants after inlining.
 * Rows past `rows` reread the last row and are not stored. */
static inline __attribute__((always_inline)) void MK_NAME(mk_pv_block)(
    float *out, ptrdiff_t out_row, const float *p, ptrdiff_t p_row, ptrdiff_t rows,
    const float *v, ptrdiff_t v_row, ptrdiff_t cols, int mr, int nv)
{
    const float *p_r[MK_MR];
    MK_VEC acc[MK_MR][4];
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++) {
        ptrdiff_t row = r < rows ? r : rows - 1;
        p_r[r] = p + row * p_row;
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[r][h] = *(const MK_VEC *)(out + row * out_row + h * MK_W);
    }
    for (ptrdiff_t j = 0; j < cols; j++) {
        MK_VEC v_j[4];
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) v_j[h] = *(const MK_VEC *)(v + j * v_row + h * MK_W);
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            float p_rj = p_r[r][j];
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) acc[r][h] += v_j[h] * p_rj;
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++)
        if (r < rows)
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) *(MK_VEC *)(out + r * out_row + h * MK_W) = acc[r][h];
}

/* Keys per slice of the value tile: a slice of MK_KC rows of 4 vectors
 * (16 KB with AVX-512) stays in L1 while the rows of P stream past it. */
#define MK_KC 64

/* columns [c0, c0 + nv W) of out, keys [j0, j1) of the tile, by blocks of
 * mr rows, each over the keys its rows see */
static inline __attribute__((always_inline)) void MK_NAME(mk_pv_columns)(
    const mk_tile *t, float *out, ptrdiff_t out_row, const float *p, ptrdiff_t p_row,
    const float *v, ptrdiff_t v_row, ptrdiff_t c0, ptrdiff_t j0, ptrdiff_t j1, int mr, int nv)
{
    for (ptrdiff_t r0 = 0; r0 < t->rows; r0 += mr) {
        ptrdiff_t lo, hi;
        mk_block_keys(t, r0, mr, &lo, &hi);
        lo = lo > j0 ? lo : j0;
        hi = hi < j1 ? hi : j1;
        if (hi > lo)
            MK_NAME(mk_pv_block)(out + r0 * out_row + c0, out_row, p + r0 * p_row + lo, p_row,
                                 t->rows - r0, v + lo * v_row + c0, v_row, hi - lo, mr, nv);
    }
}

static void MK_NAME(mk_add_pv)(const mk_tile *t, float *out, ptrdiff_t out_row, const float *p,
                               ptrdiff_t p_row, const float *v, ptrdiff_t v_row, ptrdiff_t e)
{
    for (ptrdiff_t j0 = 0; j0 < t->cols; j0 += MK_KC) {
        ptrdiff_t j1 = t->cols - j0 < MK_KC ? t->cols : j0 + MK_KC;
        /* whole rows of 4 vectors where e allows: one load of V feeds MR/2
         * rows of P, fewer loads per multiply-add than 2 vectors x MR rows */
        ptrdiff_t c0 = 0;
        for (; c0 + 4 * MK_W <= e; c0 += 4 * MK_W)
            MK_NAME(mk_pv_columns)(t, out, out_row, p, p_row, v, v_row, c0, j0, j1, MK_MR / 2, 4);
        for (; c0 + 2 * MK_W <= e; c0 += 2 * MK_W)
            MK_NAME(mk_pv_columns)(t, out, out_row, p, p_row, v, v_row, c0, j0, j1, MK_MR, 2);
        if (c0 < e)
            MK_NAME(mk_pv_columns)(t, out, out_row, p, p_row, v, v_row, c0, j0, j1, MK_MR, 1);
    }
}
#undef MK_KC

#if MK_W == 16
/* p_j = exp(s_j - max) in place over s[0, count); returns sum_j p_j and sets
 * *has_zero when some p_j is 0. The same values as vexp_f32(s_j - max) for
 * the arguments softmax makes (<= 0, -inf or NaN): the same reduction and
 * polynomial, but AVX-512's scalef builds p 2^n and a mask gives the 0
 * below EXP_LO, where vexp spends clamps, integer ops and selects: about
 * half the instructions in the loop that dominates the softmax pass. */
static float mk_exp_sum_w16(float *s, ptrdiff_t count, float max, int *has_zero)
{
    const __m512 row_max = _mm512_set1_ps(max), log2e = _mm512_set1_ps(1.44269504088896340736f);
    const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 * 2^23: round to nearest */
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    const __m512 exp_lo = _mm512_set1_ps(-87.0f);
    __m512 sum = _mm512_setzero_ps();
    __mmask16 zero = 0;
    for (ptrdiff_t j = 0; j < count; j += 16) {
        __mmask16 lanes = count - j >= 16 ? 0xffff : (__mmask16)((1u << (count - j)) - 1);
        __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), row_max);
        __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, log2e, magic), magic);
        __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
        r = _mm512_fnmadd_ps(n, ln2_lo, r);
        __m512 p = _mm512_set1_ps(1.0f / 5040.0f); /* Taylor to r^7, as vexp */
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
        /* x >= EXP_LO or NaN keeps p 2^n; -inf and the tail lanes give 0 */
        __mmask16 keep = _mm512_mask_cmp_ps_mask(lanes, x, exp_lo, _CMP_NLT_UQ);
        __m512 y = _mm512_maskz_scalef_ps(keep, p, n);
        _mm512_mask_storeu_ps(s + j, lanes, y);
        sum = _mm512_add_ps(sum, y);
        zero |= _mm512_mask_cmp_ps_mask(lanes, y, _mm512_setzero_ps(), _CMP_EQ_OQ);
    }
    if (zero) *has_zero = 1;
    return _mm512_reduce_add_ps(sum);
}
#endif

#undef MK_CAT2
#undef MK_CAT
#undef MK_NAME
#undef MK_VEC
#pragma GCC pop_options

#endif /* MK_W */
