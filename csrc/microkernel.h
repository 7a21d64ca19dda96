/* microkernel.h - register-blocked kernels for the softmax tiles, float32
 * and float64, for AVX-512 and AVX2+FMA, picked at import (dispatch.h),
 * and for one chunk of kernelised attention on AVX-512,
 * float32 (at the end of the file).
 * Header functions are static inline, so that a file that uses some of
 * them compiles without the others.
 *
 * softmax.c holds a tile of scores transposed, st[j][r] for key j and query
 * row r, and the tile's output transposed, ot[c][r], so that the query rows
 * lie across the vector lanes. Then:
 *   - the online softmax is vertical: the max and the sum over keys of W
 *     rows are elementwise vector operations, with no horizontal reductions;
 *   - the scores kernel folds the tile's row max into its epilogue, where
 *     the scores are still in registers, and the P V kernel the rescaling
 *     of the output into its prologue;
 *   - the two products are one loop: KB broadcasts from a packed panel (of
 *     keys; of values) times 3 vectors of query rows (of Q^T; of P^T).
 * BLAS is slow on these tiles: K = d is short, and sgemm re-packs each key
 * and value tile for every query tile. Here the keys are packed once per
 * head, the values too when more than one query tile reads them (else they
 * are read in place), and the queries once per query tile.
 *
 * Legend (as in softmax.c): W numbers per vector; a strip is MK_RV vectors,
 *   3 W query rows; a panel is KB = MK_KB keys.
 *   qt  (strips, d, 3 W)     packed Q^T of the query tile, zero past its rows
 *   kt  (slots, d, KB)       packed keys of the head, zero past the last key;
 *                            panel p (keys from p KB) in slot p % slots
 *   vt  (slots, e/KB, KB, KB) packed values, the same panels and slots: per
 *                            group of KB columns, per key, the group's values
 *                            (mk_values: where the P V kernel finds them)
 *   st  (cols, st_ld)        scores (log2 units), then probabilities
 *   ot  (e, st_ld)           += (P V)^T, e a multiple of KB
 *
 * The file includes itself once per number type and instruction set, with
 * MK_W and the other MK_ parameters defined; each body is compiled for its
 * instruction set (MK_TARGET, portable.h). Its kernels are named with the
 * suffix MK_SFX: _w16 and _w8 for float32 on AVX-512 and AVX2, _d8 and _d4
 * for float64, _n4 and _nd2 on NEON, by MK_NAME(name) where only this file
 * calls them; one called from elsewhere is defined as MK_TYPED(name_w16,
 * name_d8, name_w8, name_d4, name_n4, name_nd2), or by its literal name
 * where one width has it, so that grep finds its body by the name it is
 * called by. */
#ifndef MK_W
#ifndef ATTNX_MICROKERNEL_H
#define ATTNX_MICROKERNEL_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attnx.h"
#include "portable.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* vectors of query rows per strip: a strip is 3 W rows for every width, so
 * a query tile that holds whole AVX-512 strips holds whole AVX2 strips */
#define MK_RV 3
#define MK_STRIP(lanes) (MK_RV * (lanes))
/* An instruction set is named by its float32 lanes w (attnx_kernels_width: 16
 * for AVX-512, 8 for AVX2); it holds MK_LANES(w, size) numbers of `size`
 * bytes per vector, and its panels MK_KB(w) keys, so that MK_KB(w) x MK_RV
 * accumulators fill its registers for either type. */
#define MK_LANES(w, size) ((w) * 4 / (ptrdiff_t)(size))
#define MK_KB(w) ((w) == 16 ? 8 : 4)
/* every strip size divides this */
#define MK_ROW_ALIGN 48

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

/* Keys [*lo, *hi) of the tile (0-based in it, maybe beyond its columns)
 * that every row of [r0, r0 + count) sees through the band: the twin of
 * mk_block_keys, for the blocks that need no hiding. */
static inline void mk_block_all_keys(const mk_tile *t, ptrdiff_t r0, ptrdiff_t count,
                                     ptrdiff_t *lo, ptrdiff_t *hi)
{
    ptrdiff_t r1 = (r0 + count < t->rows ? r0 + count : t->rows) - 1;
    *lo = attnx_band_first(t->band, t->i0 + r1) - t->j0;
    *hi = attnx_band_end(t->band, t->i0 + r0) - t->j0;
}

/* The keys [*lo, *hi) whose scores the kernels compute for the strip of
 * rows [r0, r0 + count): those its rows see, widened to whole panels of kb
 * keys (j0 is a multiple of kb); empty when the strip sees nothing. */
static inline void mk_strip_keys(const mk_tile *t, ptrdiff_t r0, ptrdiff_t count, ptrdiff_t kb,
                                 ptrdiff_t *lo, ptrdiff_t *hi)
{
    mk_block_keys(t, r0, count, lo, hi);
    if (*hi <= *lo) {
        *lo = *hi = 0;
        return;
    }
    *lo -= *lo % kb;
    *hi = (*hi + kb - 1) / kb * kb;
}

/* Where the P V kernels find the values of key panel p (keys from p KB):
 * packed, in slot p % slots of vt, the keys KB numbers apart; or in place,
 * in the rows of v, the keys v_row apart (slots larger than any panel). */
typedef struct {
    const void *base;      /* panel 0, key 0, column 0 */
    ptrdiff_t slots;
    ptrdiff_t panel_step;  /* numbers from one slot to the next */
    ptrdiff_t key_step;    /* from one key to the next */
    ptrdiff_t group_step;  /* from one group of KB columns to the next */
} mk_values;

/* Rows [*lo, *hi) of the tile (0-based in it) that see its key j (0-based
 * in the tile): the band's bounds solved for i. */
static inline void mk_key_rows(const mk_tile *t, ptrdiff_t j, ptrdiff_t *lo, ptrdiff_t *hi)
{
    const attnx_band *band = t->band;
    ptrdiff_t key = t->j0 + j;
    *lo = band->has_hi ? key - band->hi_shift - t->i0 : 0;
    *hi = band->has_lo ? key - band->lo_shift - t->i0 + 1 : t->rows;
    if (*lo < 0) *lo = 0;
    if (*hi > t->rows) *hi = t->rows;
    if (*hi < *lo) *hi = *lo;
}

#ifdef ATTNX_X86_KERNELS
#define MK_HAVE_X86 1

/* dst[c][r] = src[r][c] for an 8 x 8 block (row strides in floats) */
__attribute__((target("avx2"))) static inline void mk_transpose8(float *dst, ptrdiff_t dst_row,
                                                                 const float *src,
                                                                 ptrdiff_t src_row)
{
    __m256 row[8], pair[8], quad[8];
    for (int r = 0; r < 8; r++) row[r] = _mm256_loadu_ps(src + r * src_row);
    for (int r = 0; r < 8; r += 2) {
        pair[r] = _mm256_unpacklo_ps(row[r], row[r + 1]);
        pair[r + 1] = _mm256_unpackhi_ps(row[r], row[r + 1]);
    }
    for (int r = 0; r < 8; r += 4) {
        quad[r] = _mm256_shuffle_ps(pair[r], pair[r + 2], 0x44);
        quad[r + 1] = _mm256_shuffle_ps(pair[r], pair[r + 2], 0xee);
        quad[r + 2] = _mm256_shuffle_ps(pair[r + 1], pair[r + 3], 0x44);
        quad[r + 3] = _mm256_shuffle_ps(pair[r + 1], pair[r + 3], 0xee);
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(dst + c * dst_row, _mm256_permute2f128_ps(quad[c], quad[c + 4], 0x20));
        _mm256_storeu_ps(dst + (c + 4) * dst_row, _mm256_permute2f128_ps(quad[c], quad[c + 4], 0x31));
    }
}

/* dst[c][r] = src[r][c] for a 16 x 16 block of floats: each row of dst is
 * written whole, one cache line where dst is aligned (so the line need not
 * be read first) */
__attribute__((target("avx512f"))) static inline void mk_transpose16(float *dst, ptrdiff_t dst_row,
                                                                    const float *src,
                                                                    ptrdiff_t src_row)
{
    __m512 row[16], pair[16], quad[16], col[16];
    for (int r = 0; r < 16; r++) row[r] = _mm512_loadu_ps(src + r * src_row);
    for (int r = 0; r < 16; r += 2) {
        pair[r] = _mm512_unpacklo_ps(row[r], row[r + 1]);
        pair[r + 1] = _mm512_unpackhi_ps(row[r], row[r + 1]);
    }
    /* quad[4 g + m]: in each 128-bit lane k, column 4 k + m of rows 4 g .. 4 g + 3 */
    for (int r = 0; r < 16; r += 4) {
        quad[r] = _mm512_shuffle_ps(pair[r], pair[r + 2], 0x44);
        quad[r + 1] = _mm512_shuffle_ps(pair[r], pair[r + 2], 0xee);
        quad[r + 2] = _mm512_shuffle_ps(pair[r + 1], pair[r + 3], 0x44);
        quad[r + 3] = _mm512_shuffle_ps(pair[r + 1], pair[r + 3], 0xee);
    }
    /* gather lane k of the four row groups: lanes 0, 2 then 1, 3 */
    for (int m = 0; m < 4; m++) {
        __m512 even_lo = _mm512_shuffle_f32x4(quad[m], quad[4 + m], 0x88);
        __m512 odd_lo = _mm512_shuffle_f32x4(quad[m], quad[4 + m], 0xdd);
        __m512 even_hi = _mm512_shuffle_f32x4(quad[8 + m], quad[12 + m], 0x88);
        __m512 odd_hi = _mm512_shuffle_f32x4(quad[8 + m], quad[12 + m], 0xdd);
        col[m] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
        col[8 + m] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xdd);
        col[4 + m] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
        col[12 + m] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xdd);
    }
    for (int c = 0; c < 16; c++) _mm512_storeu_ps(dst + c * dst_row, col[c]);
}

/* dst[c][r] = src[r][c] for a 4 x 4 block of doubles (row strides in doubles) */
__attribute__((target("avx2"))) static inline void mk_transpose4_f64(double *dst,
                                                                     ptrdiff_t dst_row,
                                                                     const double *src,
                                                                     ptrdiff_t src_row)
{
    __m256d row[4], pair[4];
    for (int r = 0; r < 4; r++) row[r] = _mm256_loadu_pd(src + r * src_row);
    pair[0] = _mm256_unpacklo_pd(row[0], row[1]);
    pair[1] = _mm256_unpackhi_pd(row[0], row[1]);
    pair[2] = _mm256_unpacklo_pd(row[2], row[3]);
    pair[3] = _mm256_unpackhi_pd(row[2], row[3]);
    for (int c = 0; c < 2; c++) {
        _mm256_storeu_pd(dst + c * dst_row, _mm256_permute2f128_pd(pair[c], pair[c + 2], 0x20));
        _mm256_storeu_pd(dst + (c + 2) * dst_row, _mm256_permute2f128_pd(pair[c], pair[c + 2], 0x31));
    }
}

/* The bfloat16 dot products (dispatch.h, attnx_kernels_bf16_dot). VDPBF16PS (avx512_bf16)
 * adds to each float32 lane l the products of its two bfloat16 pairs,
 * a[2l] b[2l] + a[2l + 1] b[2l + 1]. A product of two bfloat16 numbers
 * (8-bit significands) is exact in float32, so on operands whose numbers
 * are all bfloat16 values the instruction computes what float32
 * multiply-adds compute, up to the order of the sums, with twice the
 * numbers per instruction. Its documented exceptions, whatever MXCSR says:
 * bfloat16 denormals (under 2^-126) are read as 0, and denormal results
 * are flushed to 0. Operands are packed in pairs: a pair row holds two
 * rows of numbers, each 32-bit lane the upper halves of one number of
 * each (the first in the low 16 bits); for an exact bfloat16 value the
 * upper half is the whole number. */
typedef uint32_t mk_bits __attribute__((may_alias));

/* dst (ceil(depth / 2), lanes): pair row c from rows 2c and 2c + 1 of x
 * (depth, lanes) (the second 0 past an odd depth); rows x_row and dst_row
 * numbers apart. Returns 1 when every number of x is a bfloat16 value (its
 * low 16 bits 0), so that the pairs hold them exactly. */
__attribute__((target("avx512f"))) static inline int mk_pair_rows(float *dst, ptrdiff_t dst_row,
                                                                  const float *x, ptrdiff_t x_row,
                                                                  ptrdiff_t depth, ptrdiff_t lanes)
{
    uint32_t low = 0;
    for (ptrdiff_t c = 0; c < depth; c += 2) {
        const mk_bits *first = (const mk_bits *)(x + c * x_row);
        const mk_bits *second = (const mk_bits *)(x + (c + 1) * x_row);
        mk_bits *pair = (mk_bits *)(dst + c / 2 * dst_row);
        if (c + 1 < depth)
            for (ptrdiff_t l = 0; l < lanes; l++) {
                low |= first[l] | second[l];
                pair[l] = first[l] >> 16 | (second[l] & 0xffff0000u);
            }
        else
            for (ptrdiff_t l = 0; l < lanes; l++) {
                low |= first[l];
                pair[l] = first[l] >> 16;
            }
    }
    return (low & 0xffffu) == 0;
}

/* dst[c] = the pair of x[2c], x[2c + 1] for c < count / 2 (count even): a
 * row paired along itself. Returns 1 when all are bfloat16 values. */
__attribute__((target("avx512f"))) static inline int mk_pair_along(float *dst, const float *x,
                                                                   ptrdiff_t count)
{
    typedef uint64_t pair_bits __attribute__((may_alias, aligned(4)));
    const pair_bits *from = (const pair_bits *)x;
    mk_bits *pair = (mk_bits *)dst;
    uint64_t low = 0;
    for (ptrdiff_t c = 0; c < count / 2; c++) {
        /* the upper halves of the low and the high number */
        low |= from[c];
        pair[c] = (uint32_t)(from[c] >> 16 & 0xffffu) | (uint32_t)(from[c] >> 32 & 0xffff0000u);
    }
    return (low & 0x0000ffff0000ffffu) == 0;
}

/* acc + the dot products of the pairs of a and b, lane by lane: written as
 * asm because the intrinsic needs avx512_bf16 in the target of every
 * function it is inlined into, and that option lets gcc use AVX-512BW
 * (which it implies) anywhere in those kernels */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m512
mk_dot_pairs(__m512 acc, __m512 a, __m512 b)
{
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* AVX-512: both products accumulate in 24 of the 32 zmm registers */
#define MK_REAL float
#define MK_W 16
#define MK_SFX w16
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) w16
#define MK_KB_W 8
#define MK_VMAX(a, b) ((MK_VEC)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx512f,avx512dq")
#define MK_TARGET_POP ATTNX_TARGET_POP
#define MK_PAIRS 1 /* with the bfloat16 dot products */
#include "microkernel.h"

#define MK_REAL double
#define MK_W 8
#define MK_SFX d8
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) d8
#define MK_KB_W 8
#define MK_VMAX(a, b) ((MK_VEC)_mm512_max_pd((__m512d)(a), (__m512d)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx512f,avx512dq")
#define MK_TARGET_POP ATTNX_TARGET_POP
#include "microkernel.h"

/* AVX2: in 12 of the 16 ymm registers */
#define MK_REAL float
#define MK_W 8
#define MK_SFX w8
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) w8
#define MK_KB_W 4
#define MK_VMAX(a, b) ((MK_VEC)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx2,fma")
#define MK_TARGET_POP ATTNX_TARGET_POP
#include "microkernel.h"

#define MK_REAL double
#define MK_W 4
#define MK_SFX d4
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) d4
#define MK_KB_W 4
#define MK_VMAX(a, b) ((MK_VEC)_mm256_max_pd((__m256d)(a), (__m256d)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx2,fma")
#define MK_TARGET_POP ATTNX_TARGET_POP
#include "microkernel.h"

#elif defined(ATTNX_NEON_KERNELS)
#define MK_HAVE_NEON 1
#include <arm_neon.h>

/* Advanced SIMD (NEON), part of every aarch64 core, so compiled without a
 * target of its own: 128-bit vectors, the softmax tiles' products in 12 of
 * the 32 registers. The row max keeps x86's rule (the second operand where
 * either is NaN), as the plain code's `a > b ? a : b` does. */
#define MK_REAL float
#define MK_W 4
#define MK_SFX n4
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) n4
#define MK_KB_W 4
#define MK_VMAX(a, b) \
    ((MK_VEC)vbslq_f32(vcgtq_f32((float32x4_t)(a), (float32x4_t)(b)), (float32x4_t)(a), \
                       (float32x4_t)(b)))
#define MK_TARGET
#define MK_TARGET_POP
#include "microkernel.h"

#define MK_REAL double
#define MK_W 2
#define MK_SFX nd2
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) nd2
#define MK_KB_W 4
#define MK_VMAX(a, b) \
    ((MK_VEC)vbslq_f64(vcgtq_f64((float64x2_t)(a), (float64x2_t)(b)), (float64x2_t)(a), \
                       (float64x2_t)(b)))
#define MK_TARGET
#define MK_TARGET_POP
#include "microkernel.h"
#endif

#endif /* ATTNX_MICROKERNEL_H */

#else /* MK_W: the kernels for one vector width */

MK_TARGET

#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)
#define MK_NAME(name) MK_CAT(name, MK_CAT(_, MK_SFX))
#define MK_VEC MK_NAME(mk_vec)

/* unaligned, may alias the arrays it is loaded from */
typedef MK_REAL MK_VEC __attribute__((vector_size(MK_W * sizeof(MK_REAL)),
                                      aligned(sizeof(MK_REAL)), may_alias));

/* The band hides some scores of the block of keys [c0, c0 + kb) and strip
 * rows [r0, r0 + strip): set those to -inf, then fold the block into the
 * strip's row max. Runs on the few blocks that straddle the band's edges;
 * padding lanes past the tile's rows are left as they are. */
static inline void MK_TYPED(mk_hide_and_max_w16, mk_hide_and_max_d8, mk_hide_and_max_w8,
                            mk_hide_and_max_d4, mk_hide_and_max_n4, mk_hide_and_max_nd2)(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, ptrdiff_t r0, ptrdiff_t strip, ptrdiff_t c0,
    ptrdiff_t kb, MK_REAL *tile_max)
{
    ptrdiff_t r1 = r0 + strip < t->rows ? r0 + strip : t->rows;
    for (ptrdiff_t j = c0; j < c0 + kb; j++) {
        ptrdiff_t lo = r1, hi = r1;
        if (j < t->cols) mk_key_rows(t, j, &lo, &hi);
        MK_REAL *s_j = st + j * st_ld;
        for (ptrdiff_t r = r0; r < r1; r++) {
            if (r < lo || r >= hi) s_j[r] = -INFINITY;
            if (s_j[r] > tile_max[r]) tile_max[r] = s_j[r];
        }
    }
}

/* One block: KB keys of a panel against the rows of a strip, its first
 * `vectors` vectors (a constant where this is inlined). The strip's other
 * lanes score -inf, rows that see nothing, so that the softmax pass, which
 * runs over whole strips, finds defined numbers there. With `pairs` (a
 * constant; MK_PAIRS only), q_strip and panel hold pair rows (mk_pair_rows)
 * and d counts them: the bfloat16 dot products. */
static inline __attribute__((always_inline)) void MK_NAME(mk_scores_block)(
    MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *q_strip, const MK_REAL *panel, ptrdiff_t d,
    MK_REAL scale, const MK_REAL *key_term, MK_REAL *strip_max, int fold_max, const int vectors,
    const int pairs)
{
    MK_VEC acc[MK_KB_W][MK_RV];
#pragma GCC unroll 8
    for (int jj = 0; jj < MK_KB_W; jj++)
        for (int h = 0; h < vectors; h++) acc[jj][h] = (MK_VEC){0};
#ifdef MK_PAIRS
    if (pairs)
        for (ptrdiff_t c = 0; c < d; c++) {
            MK_VEC q_c[MK_RV];
            for (int h = 0; h < vectors; h++) q_c[h] = *(const MK_VEC *)(q_strip + (c * MK_RV + h) * MK_W);
#pragma GCC unroll 8
            for (int jj = 0; jj < MK_KB_W; jj++) {
                /* a broadcast, no arithmetic: the bits stay as they are */
                __m512 k_jc = _mm512_set1_ps(panel[c * MK_KB_W + jj]);
                for (int h = 0; h < vectors; h++)
                    acc[jj][h] = (MK_VEC)mk_dot_pairs((__m512)acc[jj][h], (__m512)q_c[h], k_jc);
            }
        }
    else
#endif
    for (ptrdiff_t c = 0; c < d; c++) {
        MK_VEC q_c[MK_RV];
        for (int h = 0; h < vectors; h++) q_c[h] = *(const MK_VEC *)(q_strip + (c * MK_RV + h) * MK_W);
#pragma GCC unroll 8
        for (int jj = 0; jj < MK_KB_W; jj++) {
            MK_REAL k_jc = panel[c * MK_KB_W + jj];
            for (int h = 0; h < vectors; h++) acc[jj][h] += q_c[h] * k_jc;
        }
    }
    MK_VEC row_max[MK_RV];
    for (int h = 0; h < vectors; h++) row_max[h] = *(const MK_VEC *)(strip_max + h * MK_W);
#pragma GCC unroll 8
    for (int jj = 0; jj < MK_KB_W; jj++) {
        for (int h = 0; h < vectors; h++) {
            /* a masked key (term -inf) must not turn a NaN score into a
             * NaN weight: it is -inf outright */
            MK_VEC s = key_term[jj] == -INFINITY ? (MK_VEC){0} - INFINITY
                                                  : acc[jj][h] * scale + key_term[jj];
            *(MK_VEC *)(st + jj * st_ld + h * MK_W) = s;
            row_max[h] = MK_VMAX(row_max[h], s);
        }
        for (int h = vectors; h < MK_RV; h++)
            *(MK_VEC *)(st + jj * st_ld + h * MK_W) = (MK_VEC){0} - INFINITY;
    }
    if (fold_max)
        for (int h = 0; h < vectors; h++) *(MK_VEC *)(strip_max + h * MK_W) = row_max[h];
}

/* The tile's rows that strips of all MK_RV vectors cover: all of them, or
 * all but a last strip whose rows fit in 1 or 2 vectors (n = 2048 leaves
 * 32 rows: 2 AVX-512 vectors of float32). */
static inline ptrdiff_t MK_NAME(mk_full_strip_rows)(ptrdiff_t rows)
{
    ptrdiff_t tail = rows % MK_STRIP(MK_W);
    return tail <= (MK_RV - 1) * MK_W ? rows - tail : rows;
}

/* mk_scores for the strips from row r_begin to r_end, each computing its
 * first `vectors` vectors of rows (constants where this is inlined, as
 * `pairs`: mk_scores_block) */
static inline __attribute__((always_inline)) void MK_NAME(mk_scores_strips)(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *qt, const MK_REAL *kt,
    ptrdiff_t slots, ptrdiff_t d, MK_REAL scale, const MK_REAL *key_term, MK_REAL *tile_max,
    ptrdiff_t r_begin, ptrdiff_t r_end, const int vectors, const int pairs)
{
    const ptrdiff_t strip = MK_STRIP(MK_W), kb = MK_KB_W;
    /* a strip of queries (3 W d numbers) stays in L1 while the key panels
     * stream past it from L2 */
    for (ptrdiff_t r0 = r_begin; r0 < r_end; r0 += strip) {
        ptrdiff_t lo, hi, all_lo, all_hi;
        mk_strip_keys(t, r0, strip, kb, &lo, &hi);
        /* the padding lanes past the last row are never read: no matter
         * whether they see the keys */
        mk_block_all_keys(t, r0, strip, &all_lo, &all_hi);
        for (ptrdiff_t c0 = lo; c0 < hi; c0 += kb) {
            int whole = all_lo <= c0 && c0 + kb <= all_hi && c0 + kb <= t->cols;
            const MK_REAL *panel = kt + (t->j0 + c0) / kb % slots * kb * d;
            MK_NAME(mk_scores_block)(st + c0 * st_ld + r0, st_ld, qt + r0 * d, panel, d, scale,
                                     key_term + c0, tile_max + r0, whole, vectors, pairs);
            if (!whole) MK_NAME(mk_hide_and_max)(t, st, st_ld, r0, strip, c0, kb, tile_max);
        }
    }
}

/* The last strip of a tile in 1 or 2 vectors, out of line: inlined beside
 * the full strips, it made the compiler spill their registers. */
static __attribute__((noinline)) void MK_NAME(mk_scores_last_strip)(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *qt, const MK_REAL *kt,
    ptrdiff_t slots, ptrdiff_t d, MK_REAL scale, const MK_REAL *key_term, MK_REAL *tile_max,
    ptrdiff_t r0, int pairs)
{
#define MK_LAST(vectors, pairs)                                                               \
    MK_NAME(mk_scores_strips)(t, st, st_ld, qt, kt, slots, d, scale, key_term, tile_max, r0, \
                              t->rows, vectors, pairs)
#ifdef MK_PAIRS
    if (pairs) {
        if (t->rows - r0 > MK_W) MK_LAST(2, 1);
        else MK_LAST(1, 1);
        return;
    }
#endif
    if (t->rows - r0 > MK_W) MK_LAST(2, 0);
    else MK_LAST(1, 0);
#undef MK_LAST
}

/* st = scale Q K^T + key_term for the keys each strip computes
 * (mk_strip_keys), with the keys the band hides at -inf, and tile_max[r]
 * raised to the max of row r's scores. kt holds the tile's panels in
 * their slots; key_term (cols rounded up to a panel) is added per key,
 * and a key whose term is -inf scores -inf whatever q . k is. With
 * `pairs` (a constant), qt and kt hold pair rows and d counts them. */
static inline __attribute__((always_inline)) void MK_NAME(mk_scores_by)(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *qt, const MK_REAL *kt,
    ptrdiff_t slots, ptrdiff_t d, MK_REAL scale, const MK_REAL *key_term, MK_REAL *tile_max,
    const int pairs)
{
    ptrdiff_t full = MK_NAME(mk_full_strip_rows)(t->rows);
    MK_NAME(mk_scores_strips)(t, st, st_ld, qt, kt, slots, d, scale, key_term, tile_max, 0, full,
                              MK_RV, pairs);
    if (full < t->rows)
        MK_NAME(mk_scores_last_strip)(t, st, st_ld, qt, kt, slots, d, scale, key_term, tile_max,
                                      full, pairs);
}

static inline void MK_TYPED(mk_scores_w16, mk_scores_d8, mk_scores_w8, mk_scores_d4,
                            mk_scores_n4, mk_scores_nd2)(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *qt, const MK_REAL *kt,
    ptrdiff_t slots, ptrdiff_t d, MK_REAL scale, const MK_REAL *key_term, MK_REAL *tile_max)
{
    MK_NAME(mk_scores_by)(t, st, st_ld, qt, kt, slots, d, scale, key_term, tile_max, 0);
}

#ifdef MK_PAIRS
/* mk_scores by the bfloat16 dot products: qt (strips, ceil(d / 2), 3 W)
 * and kt (slots, ceil(d / 2), KB) hold pair rows (mk_pair_rows) of
 * bfloat16 values, and d_pairs = ceil(d / 2) */
static inline void mk_scores_pairs_w16(
    const mk_tile *t, MK_REAL *st, ptrdiff_t st_ld, const MK_REAL *qt, const MK_REAL *kt,
    ptrdiff_t slots, ptrdiff_t d_pairs, MK_REAL scale, const MK_REAL *key_term, MK_REAL *tile_max)
{
    MK_NAME(mk_scores_by)(t, st, st_ld, qt, kt, slots, d_pairs, scale, key_term, tile_max, 1);
}
#endif

/* One block: one group of KB columns of the values, for the rows of a
 * strip in its first `vectors` vectors (a constant where this is inlined),
 * over `keys` keys from the start of panel p0:
 *   ot[cc][r] = ot[cc][r] (times correction[r], if given) + sum_j p[j][r] v[j][cc]
 * the transpose of the scores block, with P^T's columns for the queries
 * and the values for the keys: both products are the same loop. */
static inline __attribute__((always_inline)) void MK_NAME(mk_pv_block)(
    MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld, const mk_values *values,
    ptrdiff_t group, ptrdiff_t p0, ptrdiff_t keys, const MK_REAL *correction, const int vectors)
{
    const MK_REAL *v_group = (const MK_REAL *)values->base + group * values->group_step;
    const ptrdiff_t slots = values->slots, key_step = values->key_step;
    MK_VEC acc[MK_KB_W][MK_RV];
#pragma GCC unroll 8
    for (int cc = 0; cc < MK_KB_W; cc++)
        for (int h = 0; h < vectors; h++) acc[cc][h] = *(const MK_VEC *)(ot + cc * ot_ld + h * MK_W);
    if (correction)
        for (int h = 0; h < vectors; h++) {
            MK_VEC factor = *(const MK_VEC *)(correction + h * MK_W);
#pragma GCC unroll 8
            for (int cc = 0; cc < MK_KB_W; cc++) acc[cc][h] *= factor;
        }
    ptrdiff_t slot = p0 % slots;
    for (ptrdiff_t k0 = 0; k0 < keys; k0 += MK_KB_W) {
        const MK_REAL *v_panel = v_group + slot * values->panel_step;
        const MK_REAL *p_panel = pt + k0 * pt_ld;
        ptrdiff_t panel_keys = keys - k0 < MK_KB_W ? keys - k0 : MK_KB_W;
        for (ptrdiff_t jj = 0; jj < panel_keys; jj++) {
            MK_VEC p_j[MK_RV];
            for (int h = 0; h < vectors; h++) p_j[h] = *(const MK_VEC *)(p_panel + jj * pt_ld + h * MK_W);
#pragma GCC unroll 8
            for (int cc = 0; cc < MK_KB_W; cc++) {
                MK_REAL v_jc = v_panel[jj * key_step + cc];
                for (int h = 0; h < vectors; h++) acc[cc][h] += p_j[h] * v_jc;
            }
        }
        if (++slot == slots) slot = 0;
    }
#pragma GCC unroll 8
    for (int cc = 0; cc < MK_KB_W; cc++)
        for (int h = 0; h < vectors; h++) *(MK_VEC *)(ot + cc * ot_ld + h * MK_W) = acc[cc][h];
}

/* Keys per slice of the tile: the slice of a strip's P^T (3 W rows, 24 KB
 * in float32 with AVX-512) stays in L1 while the value panels stream past. */
#define MK_KC 128

/* mk_add_pv for the strips from row r_begin to r_end, each in its first
 * `vectors` vectors of rows (a constant where this is inlined) */
static inline __attribute__((always_inline)) void MK_NAME(mk_add_pv_strips)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction, ptrdiff_t r_begin,
    ptrdiff_t r_end, const int vectors)
{
    const ptrdiff_t strip = MK_STRIP(MK_W), kb = MK_KB_W;
    for (ptrdiff_t k0 = 0; k0 < t->cols; k0 += MK_KC)
        for (ptrdiff_t r0 = r_begin; r0 < r_end; r0 += strip) {
            ptrdiff_t lo, hi;
            mk_strip_keys(t, r0, strip, kb, &lo, &hi);
            /* rescale in the first slice the strip has keys in */
            const MK_REAL *strip_correction = lo >= k0 ? correction + r0 : NULL;
            lo = lo > k0 ? lo : k0;
            hi = hi < k0 + MK_KC ? hi : k0 + MK_KC;
            /* the panel padding past the tile's keys has P = 0: skipped */
            hi = hi < t->cols ? hi : t->cols;
            if (hi <= lo) continue;
            for (ptrdiff_t g = 0; g < e; g += kb)
                MK_NAME(mk_pv_block)(ot + g * ot_ld + r0, ot_ld, pt + lo * pt_ld + r0, pt_ld,
                                     values, g / kb, (t->j0 + lo) / kb, hi - lo,
                                     strip_correction, vectors);
        }
}

/* The last strip in 1 or 2 vectors, out of line (see mk_scores_last_strip) */
static __attribute__((noinline)) void MK_NAME(mk_add_pv_last_strip)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction, ptrdiff_t r0)
{
    if (t->rows - r0 > MK_W)
        MK_NAME(mk_add_pv_strips)(t, ot, ot_ld, pt, pt_ld, values, e, correction, r0, t->rows, 2);
    else
        MK_NAME(mk_add_pv_strips)(t, ot, ot_ld, pt, pt_ld, values, e, correction, r0, t->rows, 1);
}

/* ot (e, ot_ld) += V^T P^T over the keys each strip computes
 * (mk_strip_keys) that the tile holds, the tile's P^T in pt (row stride
 * pt_ld). Each strip's columns of ot are first multiplied by its rows'
 * correction, the online softmax's rescaling. */
static inline void MK_TYPED(mk_add_pv_w16, mk_add_pv_d8, mk_add_pv_w8, mk_add_pv_d4,
                            mk_add_pv_n4, mk_add_pv_nd2)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction)
{
    ptrdiff_t full = MK_NAME(mk_full_strip_rows)(t->rows);
    MK_NAME(mk_add_pv_strips)(t, ot, ot_ld, pt, pt_ld, values, e, correction, 0, full, MK_RV);
    if (full < t->rows)
        MK_NAME(mk_add_pv_last_strip)(t, ot, ot_ld, pt, pt_ld, values, e, correction, full);
}
#undef MK_KC

#if MK_W == 16
/* 2^t for t <= 0 (and -inf, NaN) on AVX-512: t = n + f with n = floor(t)
 * and 0 <= f < 1 (vreduceps gives f in one instruction), 2^f by a degree-6
 * polynomial (relative error 1.9e-9, a fit on Chebyshev nodes of [0, 1)),
 * and scalef builds p 2^floor(t) from t itself. -inf gives f = 0, p = 1 and
 * 2^-inf = 0; NaN stays NaN. Results under the smallest normal (t < -126)
 * would cost a microcode assist each: the caller runs this with
 * flush-to-zero on (mk_softmax_strip_w16), and they are 0. */
static inline __attribute__((always_inline)) __m512 mk_exp2_w16(__m512 t)
{
    __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 p = _mm512_set1_ps(2.1690609157073274e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2443081511840524e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6784725541209631e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5483524724105671e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022979581422316f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314698705747602f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000001815494f));
    return _mm512_scalef_ps(p, t);
}

/* The online softmax of one strip over the keys [lo, hi) of the tile, on
 * AVX-512: see softmax_online_strip in softmax.c, which this computes in
 * registers, `vectors` (at most 3) vectors of rows at a time. Flush-to-zero
 * is on while it
 * runs (the thread's own setting is put back): a weight under 2^-126 is 0
 * at no cost (softmax_online_strip's are 0 under 2^-125). */
static inline void mk_softmax_strip_w16(float *st, ptrdiff_t st_ld, ptrdiff_t lo, ptrdiff_t hi,
                                        const float *tile_max, float *row_max, float *row_sum,
                                        float *correction, const int vectors)
{
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | _MM_FLUSH_ZERO_ON);
    __m512 sub[MK_RV], sum[MK_RV];
    for (int h = 0; h < vectors; h++) {
        __m512 old_max = _mm512_loadu_ps(row_max + h * 16);
        __m512 new_max = _mm512_max_ps(old_max, _mm512_loadu_ps(tile_max + h * 16));
        __mmask16 unseen = _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_EQ_OQ);
        /* out holds nothing to rescale while the max stays, or before the
         * row has seen a key (it is 0, and so is the sum) */
        __mmask16 same = _mm512_cmp_ps_mask(new_max, old_max, _CMP_EQ_OQ) |
                         _mm512_cmp_ps_mask(old_max, neg_inf, _CMP_EQ_OQ);
        sub[h] = _mm512_mask_blend_ps(unseen, new_max, _mm512_setzero_ps());
        __m512 corr = _mm512_mask_blend_ps(same, mk_exp2_w16(_mm512_sub_ps(old_max, sub[h])),
                                           _mm512_set1_ps(1.0f));
        _mm512_storeu_ps(correction + h * 16, corr);
        _mm512_storeu_ps(row_max + h * 16, new_max);
        sum[h] = _mm512_mul_ps(_mm512_loadu_ps(row_sum + h * 16), corr);
    }
    for (ptrdiff_t j = lo; j < hi; j++)
        for (int h = 0; h < vectors; h++) {
            float *s = st + j * st_ld + h * 16;
            __m512 p = mk_exp2_w16(_mm512_sub_ps(_mm512_loadu_ps(s), sub[h]));
            _mm512_storeu_ps(s, p);
            sum[h] = _mm512_add_ps(sum[h], p);
        }
    for (int h = 0; h < vectors; h++) _mm512_storeu_ps(row_sum + h * 16, sum[h]);
    _mm_setcsr(csr);
}

/* ------------------------------------------------------------------------
 * Kernelised attention, the chunk method (linear.c): one chunk of 16 query
 * rows against the state and the 16 keys of its diagonal block.
 *   phi, psi (16, r)  features of the chunk's queries and keys, rows r apart
 *   P        (16, 16) phi psi^T, the pairs a row cannot see zeroed
 *   S (r, e), z (r,)  the state, S contiguous
 */

/* The rows that the next chunk reads and writes, asked of the memory a
 * line at a time from inside the kernels' loops (mk_ahead_step), so that
 * they arrive while this chunk computes. Asked all at once before it, they
 * stall the core: each operand's chunk is a 4 KiB page of its own, where
 * the hardware's stream prefetch stops, and the memory takes a few dozen
 * lines at a time. */
#define MK_AHEAD_MAX 6
typedef struct {
    const char *next[MK_AHEAD_MAX];  /* the next line of each region */
    const char *end[MK_AHEAD_MAX];   /* past the last byte of its current row */
    ptrdiff_t stride[MK_AHEAD_MAX];  /* bytes between its rows */
    ptrdiff_t row_bytes[MK_AHEAD_MAX];
    ptrdiff_t rows_left[MK_AHEAD_MAX];  /* rows after the current one */
    int write[MK_AHEAD_MAX];         /* the chunk writes it */
    int regions, current;
} mk_ahead;

/* `rows` rows of `row_bytes` bytes from `first`, `stride` bytes apart */
static inline void mk_ahead_add(mk_ahead *ahead, const void *first, ptrdiff_t stride,
                                ptrdiff_t row_bytes, ptrdiff_t rows, int write)
{
    if (rows <= 0 || row_bytes <= 0 || ahead->regions == MK_AHEAD_MAX) return;
    int k = ahead->regions++;
    ahead->next[k] = (const char *)((uintptr_t)first & ~(uintptr_t)63);
    ahead->end[k] = (const char *)first + row_bytes;
    ahead->stride[k] = stride;
    ahead->row_bytes[k] = row_bytes;
    ahead->rows_left[k] = rows - 1;
    ahead->write[k] = write;
}

/* ask for the next line, if any is left */
static inline __attribute__((always_inline)) void mk_ahead_step(mk_ahead *ahead)
{
    if (!ahead || ahead->current == ahead->regions) return;
    int k = ahead->current;
    if (ahead->write[k]) __builtin_prefetch(ahead->next[k], 1);
    else __builtin_prefetch(ahead->next[k], 0);
    ahead->next[k] += 64;
    if (ahead->next[k] < ahead->end[k]) return;
    if (ahead->rows_left[k]-- > 0) {
        const char *row = ahead->end[k] - ahead->row_bytes[k] + ahead->stride[k];
        ahead->next[k] = (const char *)((uintptr_t)row & ~(uintptr_t)63);
        ahead->end[k] = row + ahead->row_bytes[k];
    } else {
        ahead->current++;
    }
}

/* acc[i][h] += sum_p A[i][p] B[p][16 h .. 16 h + 16) over p < k, for mr
 * rows of A (element (i, p) at a[i a_row + p a_col]) and nv vectors of
 * B's rows; mr and nv are constants after inlining. */
static inline __attribute__((always_inline)) void mk_rank_w16(__m512 acc[6][4], int mr, int nv,
                                                              const float *a, ptrdiff_t a_row,
                                                              ptrdiff_t a_col, const float *b,
                                                              ptrdiff_t b_row, ptrdiff_t k,
                                                              mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        mk_ahead_step(ahead);
        __m512 b_p[4];
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) b_p[h] = _mm512_loadu_ps(b + p * b_row + h * 16);
#pragma GCC unroll 6
        for (int i = 0; i < mr; i++) {
            __m512 a_ip = _mm512_set1_ps(a[i * a_row + p * a_col]);
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) acc[i][h] = _mm512_fmadd_ps(a_ip, b_p[h], acc[i][h]);
        }
    }
}

/* rows [0, mr) of the chunk's output, columns [0, 16 nv): phi S + P V,
 * S still without the chunk's keys */
static inline __attribute__((always_inline)) void mk_chunk_out_w16(
    int mr, int nv, const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p,
    const float *v, ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_setzero_ps();
    mk_rank_w16(acc, mr, nv, phi, r, 1, S, e, r, ahead);
    mk_rank_w16(acc, mr, nv, p, 16, 1, v, v_row, 16, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + i * out_row + h * 16, acc[i][h]);
}

/* rows [0, mr) of S, columns [0, 16 nv): S += psi^T V over `keys` keys */
static inline __attribute__((always_inline)) void mk_chunk_state_w16(
    int mr, int nv, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    ptrdiff_t keys, float *S, ptrdiff_t e, mk_ahead *ahead)
{
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_loadu_ps(S + i * e + h * 16);
    mk_rank_w16(acc, mr, nv, psi, 1, r, v, v_row, keys, ahead);
#pragma GCC unroll 6
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) _mm512_storeu_ps(S + i * e + h * 16, acc[i][h]);
}

/* one call per width of the column block, nv a constant in each */
#define MK_CHUNK_COLUMNS(e, CALL)                             \
    for (ptrdiff_t c0 = 0; c0 < (e); c0 += 64) {              \
        switch ((e) - c0 >= 64 ? 4 : ((e) - c0) / 16) {       \
        case 4: CALL(4); break;                               \
        case 3: CALL(3); break;                               \
        case 2: CALL(2); break;                               \
        default: CALL(1); break;                              \
        }                                                     \
    }

/* S (r, e) += psi^T V over `keys` keys (psi rows r apart), in key order,
 * 6 features at a time: r % 2 == 0 (r % 6 is then 0, 2 or 4), e % 16 == 0 */
static inline __attribute__((always_inline)) void mk_add_keys_body_w16(
    const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t keys, float *S,
    ptrdiff_t e, mk_ahead *ahead)
{
#define MK_STATE(nv)                                                                            \
    do {                                                                                        \
        ptrdiff_t f0 = 0;                                                                       \
        for (; f0 + 6 <= r; f0 += 6)                                                            \
            mk_chunk_state_w16(6, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
        if (r - f0 == 4)                                                                        \
            mk_chunk_state_w16(4, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
        if (r - f0 == 2)                                                                        \
            mk_chunk_state_w16(2, nv, psi + f0, r, v + c0, v_row, keys, S + f0 * e + c0, e, ahead); \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_STATE)
#undef MK_STATE
}

/* the same as a call of its own, for linear.c's held keys; the fused
 * kernels inline the body, so that their r = e = 64 variants (below)
 * reach it with constant sizes */
static inline void mk_add_keys_w16(const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
                                   ptrdiff_t keys, float *S, ptrdiff_t e, mk_ahead *ahead)
{
    mk_add_keys_body_w16(psi, r, v, v_row, keys, S, e, ahead);
}

/* z (r,) += sum_t w[t] x_t over 16 rows x_t (r apart), w NULL: all 1;
 * r % 8 == 0 */
static inline void mk_add_rows_w16(float *z, const float *x, ptrdiff_t r, const float *w)
{
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __mmask16 lanes = r - f0 >= 16 ? (__mmask16)0xffff : (__mmask16)0xff;
        __m512 sum = _mm512_maskz_loadu_ps(lanes, z + f0);
        for (int t = 0; t < 16; t++) {
            __m512 x_t = _mm512_maskz_loadu_ps(lanes, x + t * r + f0);
            sum = w ? _mm512_fmadd_ps(_mm512_set1_ps(w[t]), x_t, sum) : _mm512_add_ps(sum, x_t);
        }
        _mm512_mask_storeu_ps(z + f0, lanes, sum);
    }
}

/* out (16 rows out_row apart, e) = phi S + P V for a chunk's 16 rows:
 * phi (16, r), S (r, e), P (16, 16), V (16 rows v_row apart, e), in row
 * blocks of 6, 6 and 4 (mk_chunk_out_w16's registers) */
static inline __attribute__((always_inline)) void mk_chunk_rows_w16(
    const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *p, const float *v,
    ptrdiff_t v_row, float *out, ptrdiff_t out_row, mk_ahead *ahead)
{
#define MK_ROWS(nv)                                                                             \
    do {                                                                                        \
        mk_chunk_out_w16(6, nv, phi, r, S + c0, e, p, v + c0, v_row, out + c0, out_row, ahead); \
        mk_chunk_out_w16(6, nv, phi + 6 * r, r, S + c0, e, p + 6 * 16, v + c0, v_row,           \
                         out + 6 * out_row + c0, out_row, ahead);                               \
        mk_chunk_out_w16(4, nv, phi + 12 * r, r, S + c0, e, p + 12 * 16, v + c0, v_row,         \
                         out + 12 * out_row + c0, out_row, ahead);                              \
    } while (0)
    MK_CHUNK_COLUMNS(e, MK_ROWS)
#undef MK_ROWS
}

/* The chunk: out = phi S + P V and den[t] += sum_j P[t][j], with P =
 * phi psi^T where row t sees the keys j < visible[t] (others 0; negative
 * similarities, rounding in taylor's 1 + cos, clamped to 0 as in linear.c,
 * NaN kept); then S += psi^T V and z += sum_j psi_j. r % 8 == 0, e % 16
 * == 0, V finite (linear.c checks); psi_t (r, 16) and p (16, 16) scratch;
 * `ahead` (or NULL) the next chunk's rows, asked for along the way. */
static inline __attribute__((always_inline)) void mk_linear_chunk_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row, ptrdiff_t e,
    const ptrdiff_t *visible, float *S, float *z, float *out, ptrdiff_t out_row, float *den,
    float *psi_t, float *p, mk_ahead *ahead)
{
    /* pass 1: P, each row one vector over the 16 keys, from psi^T */
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 8)
        for (ptrdiff_t j0 = 0; j0 < 16; j0 += 8)
            mk_transpose8(psi_t + f0 * 16 + j0, 16, psi + j0 * r + f0, r);
    __m512 p_row[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) p_row[t] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 keys_f = _mm512_loadu_ps(psi_t + f * 16);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++)
            p_row[t] = _mm512_fmadd_ps(_mm512_set1_ps(phi[t * r + f]), keys_f, p_row[t]);
    }
    for (int t = 0; t < 16; t++) {
        __mmask16 seen = visible[t] >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << visible[t]) - 1);
        /* max(0, x) is x for NaN: the second operand wins when one is NaN */
        __m512 kept = _mm512_maskz_max_ps(seen, _mm512_setzero_ps(), p_row[t]);
        den[t] += _mm512_reduce_add_ps(kept);
        _mm512_storeu_ps(p + t * 16, kept);
    }
    /* pass 2: the output, from the state before the chunk's keys */
    mk_chunk_rows_w16(phi, r, S, e, p, v, v_row, out, out_row, ahead);
    /* pass 3: the chunk's keys into the state */
    mk_add_keys_body_w16(psi, r, v, v_row, 16, S, e, ahead);
    mk_add_rows_w16(z, psi, r, NULL);
}

/* with r = e = 64 and packed rows (the common head size) the body's
 * loops take constant bounds and strides */
static inline void mk_linear_chunk_w16(const float *phi, const float *psi, ptrdiff_t r,
                                       const float *v, ptrdiff_t v_row, ptrdiff_t e,
                                       const ptrdiff_t *visible, float *S, float *z, float *out,
                                       ptrdiff_t out_row, float *den, float *psi_t, float *p,
                                       mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64 && out_row == 64)
        mk_linear_chunk_body_w16(phi, psi, 64, v, 64, 64, visible, S, z, out, 64, den, psi_t, p,
                                 ahead);
    else
        mk_linear_chunk_body_w16(phi, psi, r, v, v_row, e, visible, S, z, out, out_row, den, psi_t,
                                 p, ahead);
}

/* ------------------------------------------------------------------------
 * One single-token decoding step of one head (linear.c, deferred_step).
 * The step's key (features psi (r), value v (e)) joins z at once and the
 * head's held keys: keys (capacity, r) and values (capacity, e), whose
 * first `held` rows are the keys since the head's last turn. At its turn
 * (adds) every held key goes into S in the same pass that reads the
 * query's row from S; otherwise S is only read, and the held keys add
 * their terms to the row:
 *   out = phi S + sum_t (phi . keys_t) values_t,  den = phi . z
 * A step is one pass over S, which streams from L2: the row is built in
 * registers, one accumulator per vector of columns, rows in order: the
 * loads set the pace, not the multiply-adds' latency (with two sets of
 * accumulators, even and odd rows, a loop of reads was slower:
 * docs/performance.md, the C code's choices). Four heads can also take their steps together
 * (mk_decode_group_w16, below), with the same numbers.
 * S (r, e) contiguous; r % 16 == 0, e % 16 == 0, held < MK_DECODE_HELD. */
#define MK_DECODE_HELD 16

/* the step's key joins z and the held keys (as key `held`); den = phi . z */
static inline void mk_decode_take_w16(const float *phi, const float *psi, ptrdiff_t r,
                                      const float *v, ptrdiff_t e, float *z, float *keys,
                                      float *values, ptrdiff_t held, float *den)
{
    __m512 dot = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __m512 psi_f = _mm512_loadu_ps(psi + f0), z_f = _mm512_loadu_ps(z + f0);
        _mm512_storeu_ps(keys + held * r + f0, psi_f);
        z_f = _mm512_add_ps(z_f, psi_f);
        _mm512_storeu_ps(z + f0, z_f);
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), z_f, dot);
    }
    *den = _mm512_reduce_add_ps(dot);
    for (ptrdiff_t c0 = 0; c0 < e; c0 += 16)
        _mm512_storeu_ps(values + held * e + c0, _mm512_loadu_ps(v + c0));
}

/* weights[t] = phi . keys_t over the `held` held keys */
static inline void mk_decode_weights_w16(const float *phi, ptrdiff_t r, const float *keys,
                                         ptrdiff_t held, float *weights)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        __m512 sum = _mm512_setzero_ps();
        for (ptrdiff_t f0 = 0; f0 < r; f0 += 16)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), _mm512_loadu_ps(keys + t * r + f0), sum);
        weights[t] = _mm512_reduce_add_ps(sum);
    }
}

/* row[0, nv) += sum_t weights[t] values_t (values positioned at the row's
 * first column, rows e apart) */
static inline __attribute__((always_inline)) void mk_decode_held_terms_w16(
    int nv, __m512 row[4], const float *weights, const float *values, ptrdiff_t e, ptrdiff_t held)
{
    for (ptrdiff_t t = 0; t < held; t++) {
        __m512 weight = _mm512_set1_ps(weights[t]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++)
            row[h] = _mm512_fmadd_ps(weight, _mm512_loadu_ps(values + t * e + h * 16), row[h]);
    }
}

/* out[0, 16 nv) = phi S + sum_t weights[t] values_t over S's columns
 * [0, 16 nv) (S and values positioned there, rows e apart) */
static inline __attribute__((always_inline)) void mk_decode_read_w16(
    int nv, const float *phi, ptrdiff_t r, const float *S, ptrdiff_t e, const float *weights,
    const float *values, ptrdiff_t held, float *out)
{
    __m512 row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 phi_f = _mm512_set1_ps(phi[f]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++)
            row[h] = _mm512_fmadd_ps(phi_f, _mm512_loadu_ps(S + f * e + h * 16), row[h]);
    }
    mk_decode_held_terms_w16(nv, row, weights, values, e, held);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
}

/* rows [f0, f0 + mr) of S[:, 0, 16 nv) += keys^T values over `count`
 * keys, in key order (what mk_add_keys_w16 computes), and row += phi S
 * over those rows, from the rows just written, still in registers */
static inline __attribute__((always_inline)) void mk_decode_turn_rows_w16(
    int mr, int nv, ptrdiff_t f0, const float *phi, const float *keys, ptrdiff_t r,
    const float *values, ptrdiff_t e, ptrdiff_t count, float *S, __m512 row[4])
{
    __m512 acc[6][4];
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++)
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) acc[i][h] = _mm512_loadu_ps(S + (f0 + i) * e + h * 16);
    mk_rank_w16(acc, mr, nv, keys + f0, 1, r, values, e, count, NULL);
#pragma GCC unroll 4
    for (int i = 0; i < mr; i++) {
        __m512 phi_f = _mm512_set1_ps(phi[f0 + i]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            _mm512_storeu_ps(S + (f0 + i) * e + h * 16, acc[i][h]);
            row[h] = _mm512_fmadd_ps(phi_f, acc[i][h], row[h]);
        }
    }
}

/* A head's turn: all of S's columns [0, 16 nv) take the held keys, 4 rows
 * at a time, and out[0, 16 nv) = phi S from the new S */
static inline __attribute__((always_inline)) void mk_decode_flush_w16(
    int nv, const float *phi, const float *keys, ptrdiff_t r, const float *values, ptrdiff_t e,
    ptrdiff_t count, float *S, float *out)
{
    __m512 row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 4)
        mk_decode_turn_rows_w16(4, nv, f0, phi, keys, r, values, e, count, S, row);
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
}

/* elu(x) + 1 on AVX-512, the algorithm of features.c's elu_row (vec_real.h's
 * exp): x + 1 above 0; below, e^x = 2^n e^r with n = round(x log2 e),
 * r = x - n ln2 (Cody-Waite), e^r by its Taylor series to r^7; 0 below
 * -87; NaN stays NaN. scalef puts 2^n on e^r in one instruction, with no
 * clamp of x and no exponent-bit arithmetic: 20 instructions a vector
 * against the compiled loop's 27. On AVX-512 every float32 elu feature
 * comes from here (attnx_features and the decoding kernel), so the paths
 * agree bit for bit. */
static inline __attribute__((always_inline)) __m512 mk_elu1_w16(__m512 x)
{
    const __m512 magic = _mm512_set1_ps(12582912.0f), one = _mm512_set1_ps(1.0f);
    __m512 nf = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896340736f), magic),
                              magic);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040.0f), r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, one);
    p = _mm512_fmadd_ps(p, r, one);
    __m512 below = _mm512_maskz_scalef_ps(~_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ),
                                          p, nf);
    return _mm512_mask_add_ps(below, _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GT_OQ), x, one);
}

/* f = elu(x) + 1 over a row of d numbers (features.c, attnx_features) */
static inline void mk_elu_row_w16(const float *x, ptrdiff_t d, float *f)
{
    ptrdiff_t c = 0;
    for (; c + 16 <= d; c += 16) _mm512_storeu_ps(f + c, mk_elu1_w16(_mm512_loadu_ps(x + c)));
    if (c < d) {
        __mmask16 tail = (__mmask16)((1u << (d - c)) - 1);
        _mm512_mask_storeu_ps(f + c, tail, mk_elu1_w16(_mm512_maskz_loadu_ps(tail, x + c)));
    }
}

/* phi = elu(q) + 1, psi = elu(k) + 1 for one query and one key row of d
 * features, d % 16 == 0: both rows' vectors interleaved, the exponentials'
 * chains of dependent operations overlapping (faster than two calls of
 * mk_elu_row_w16: docs/performance.md, the C code's choices) */
static inline void mk_elu_rows_w16(const float *q, const float *k, ptrdiff_t d, float *phi,
                                   float *psi)
{
    for (ptrdiff_t c = 0; c < d; c += 16) {
        _mm512_storeu_ps(phi + c, mk_elu1_w16(_mm512_loadu_ps(q + c)));
        _mm512_storeu_ps(psi + c, mk_elu1_w16(_mm512_loadu_ps(k + c)));
    }
}

/* The step */
static inline void mk_decode_step_w16(const float *phi, const float *psi, ptrdiff_t r,
                                      const float *v, ptrdiff_t e, float *S, float *z,
                                      float *keys, float *values, ptrdiff_t held, int adds,
                                      float *out, float *den)
{
    mk_decode_take_w16(phi, psi, r, v, e, z, keys, values, held, den);
    held++;
    if (adds) {
#define MK_FLUSH(nv) mk_decode_flush_w16(nv, phi, keys, r, values + c0, e, held, S + c0, out + c0)
        MK_CHUNK_COLUMNS(e, MK_FLUSH)
#undef MK_FLUSH
        return;
    }
    float weights[MK_DECODE_HELD];
    mk_decode_weights_w16(phi, r, keys, held, weights);
#define MK_READ(nv) mk_decode_read_w16(nv, phi, r, S + c0, e, weights, values + c0, held, out + c0)
    MK_CHUNK_COLUMNS(e, MK_READ)
#undef MK_READ
}

/* Four heads' steps in one pass over their states, one of them at its
 * turn. Alone, a read streams S from L2 with the multiply-add units half
 * idle, and a turn keeps them busy (a multiply-add per held key and S
 * element) while L2 waits; side by side, the turn's arithmetic runs under
 * the reads' loads. The turn's head goes through S two rows at a time
 * (mk_decode_turn_rows_w16, as mk_decode_flush_w16 four), and the others
 * read as mk_decode_read_w16 does: S, z and the rows are those of
 * four single steps, bit for bit. The rows leave divided by their
 * denominators, as linear.c's finish_rows divides them (1 / max(den, eps),
 * zeros where den == 0), in registers: faster than finish_rows after the
 * group (docs/performance.md, the C code's choices).
 * Each head's key must have joined its held keys (mk_decode_take_w16). */
typedef struct {
    const float *phi;              /* (r) */
    float *S;                      /* (r, e) contiguous */
    const float *keys, *values;    /* the held keys, the step's own among them */
    ptrdiff_t held;
    float den;                     /* phi . z */
    float *out;                    /* (e) */
} mk_decode_head;

/* out[0, 16 nv) = row / max(den, eps), or zeros where den == 0 */
static inline __attribute__((always_inline)) void mk_decode_store_w16(int nv, const __m512 row[4],
                                                                      float den, float eps,
                                                                      float *out)
{
    __m512 scale = _mm512_set1_ps(1 / (den < eps ? eps : den));
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++)
        _mm512_storeu_ps(out + h * 16,
                         den == 0 ? _mm512_setzero_ps() : _mm512_mul_ps(row[h], scale));
}

/* columns [c0, c0 + 16 nv) of the four heads' rows: turn the head at its
 * turn, readers the other three, weights their held keys' weights */
static inline __attribute__((always_inline)) void mk_decode_group_cols_w16(
    int nv, const mk_decode_head *turn, const mk_decode_head *const readers[3],
    const float (*weights)[MK_DECODE_HELD], ptrdiff_t r, ptrdiff_t e, float eps, ptrdiff_t c0)
{
    /* what the loop reads, in locals: its stores (may_alias) would make it
     * load the structs' fields again at every row */
    const float *S_a = readers[0]->S + c0, *S_b = readers[1]->S + c0, *S_c = readers[2]->S + c0;
    const float *phi_a = readers[0]->phi, *phi_b = readers[1]->phi, *phi_c = readers[2]->phi;
    const float *phi = turn->phi, *keys = turn->keys, *values = turn->values + c0;
    float *S = turn->S + c0;
    const ptrdiff_t held = turn->held;
    __m512 row_a[4], row_b[4], row_c[4], row[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) row_a[h] = row_b[h] = row_c[h] = row[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f += 2) {
#pragma GCC unroll 2
        for (int i = 0; i < 2; i++) {
            __m512 phi_af = _mm512_set1_ps(phi_a[f + i]), phi_bf = _mm512_set1_ps(phi_b[f + i]);
            __m512 phi_cf = _mm512_set1_ps(phi_c[f + i]);
            ptrdiff_t at = (f + i) * e;
#pragma GCC unroll 4
            for (int h = 0; h < nv; h++) {
                row_a[h] = _mm512_fmadd_ps(phi_af, _mm512_loadu_ps(S_a + at + h * 16), row_a[h]);
                row_b[h] = _mm512_fmadd_ps(phi_bf, _mm512_loadu_ps(S_b + at + h * 16), row_b[h]);
                row_c[h] = _mm512_fmadd_ps(phi_cf, _mm512_loadu_ps(S_c + at + h * 16), row_c[h]);
            }
        }
        mk_decode_turn_rows_w16(2, nv, f, phi, keys, r, values, e, held, S, row);
    }
    mk_decode_store_w16(nv, row, turn->den, eps, turn->out + c0);
    mk_decode_held_terms_w16(nv, row_a, weights[0], readers[0]->values + c0, e, readers[0]->held);
    mk_decode_store_w16(nv, row_a, readers[0]->den, eps, readers[0]->out + c0);
    mk_decode_held_terms_w16(nv, row_b, weights[1], readers[1]->values + c0, e, readers[1]->held);
    mk_decode_store_w16(nv, row_b, readers[1]->den, eps, readers[1]->out + c0);
    mk_decode_held_terms_w16(nv, row_c, weights[2], readers[2]->values + c0, e, readers[2]->held);
    mk_decode_store_w16(nv, row_c, readers[2]->den, eps, readers[2]->out + c0);
}

/* heads[turn] takes its turn; r % 2 == 0 */
static inline __attribute__((always_inline)) void mk_decode_group_body_w16(
    const mk_decode_head heads[4], int turn, ptrdiff_t r, ptrdiff_t e, float eps)
{
    const mk_decode_head *readers[3];
    float weights[3][MK_DECODE_HELD];
    for (int j = 0, i = 0; j < 4; j++) {
        if (j == turn) continue;
        readers[i] = &heads[j];
        mk_decode_weights_w16(heads[j].phi, r, heads[j].keys, heads[j].held, weights[i]);
        i++;
    }
#define MK_GROUP(nv) mk_decode_group_cols_w16(nv, &heads[turn], readers, weights, r, e, eps, c0)
    MK_CHUNK_COLUMNS(e, MK_GROUP)
#undef MK_GROUP
}

/* with r = e = 64 (the common head size) the loops take constant bounds
 * and strides, which leaves them their pointers in registers (a tenth
 * faster: docs/performance.md, the C code's choices) */
static inline void mk_decode_group_w16(const mk_decode_head heads[4], int turn, ptrdiff_t r,
                                       ptrdiff_t e, float eps)
{
    if (r == 64 && e == 64) mk_decode_group_body_w16(heads, turn, 64, 64, eps);
    else mk_decode_group_body_w16(heads, turn, r, e, eps);
}

/* ------------------------------------------------------------------------
 * One RNN step of one head from a given state (linear.c, fused_step: the
 * functional single-token call): S = S0 + psi v^T, z = z0 + psi, and the
 * query's row read from the state just written,
 *   out = phi S,  den = phi . z
 * in one pass over S0 and S: each row of S is written and multiplied into
 * the row in registers, one accumulator chain per vector of columns as in
 * mk_decode_read_w16 (two, even and odd rows, were slower:
 * docs/performance.md, the C code's choices). S's entries are the
 * general path's (state_pass) bit for bit: one fused multiply-add each.
 * S0 rows S0_row apart (0: one zero row serves all), S (r, e) contiguous
 * and may be S0 itself (each entry is read before it is written);
 * r % 16 == 0, e % 16 == 0. */

/* S[:, 0, 16 nv) and out[0, 16 nv) (S0, S, v positioned there) */
static inline __attribute__((always_inline)) void mk_step_rows_w16(
    int nv, const float *phi, const float *psi, ptrdiff_t r, const float *v, const float *S0,
    ptrdiff_t S0_row, ptrdiff_t e, float *S, float *out)
{
    __m512 row[4], value[4];
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) {
        value[h] = _mm512_loadu_ps(v + h * 16);
        row[h] = _mm512_setzero_ps();
    }
    for (ptrdiff_t f = 0; f < r; f++) {
        __m512 key_f = _mm512_set1_ps(psi[f]), phi_f = _mm512_set1_ps(phi[f]);
#pragma GCC unroll 4
        for (int h = 0; h < nv; h++) {
            __m512 s_f = _mm512_fmadd_ps(key_f, value[h], _mm512_loadu_ps(S0 + f * S0_row + h * 16));
            _mm512_storeu_ps(S + f * e + h * 16, s_f);
            row[h] = _mm512_fmadd_ps(phi_f, s_f, row[h]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nv; h++) _mm512_storeu_ps(out + h * 16, row[h]);
}

/* The step */
static inline void mk_rnn_step_w16(const float *phi, const float *psi, ptrdiff_t r, const float *v,
                                   const float *S0, ptrdiff_t S0_row, const float *z0, ptrdiff_t e,
                                   float *S, float *z, float *out, float *den)
{
    __m512 dot = _mm512_setzero_ps();
    for (ptrdiff_t f0 = 0; f0 < r; f0 += 16) {
        __m512 z_f = _mm512_add_ps(_mm512_loadu_ps(z0 + f0), _mm512_loadu_ps(psi + f0));
        _mm512_storeu_ps(z + f0, z_f);
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(phi + f0), z_f, dot);
    }
    *den = _mm512_reduce_add_ps(dot);
#define MK_STEP(nv) mk_step_rows_w16(nv, phi, psi, r, v + c0, S0 + c0, S0_row, e, S + c0, out + c0)
    MK_CHUNK_COLUMNS(e, MK_STEP)
#undef MK_STEP
}

/* ------------------------------------------------------------------------
 * The backward of one chunk (linear.c, bwd_scan_head), 16 query rows
 * against the 16 keys of their diagonal block. Most of its products read
 * the state with the chunk's rows across the vector lanes ("lanes" form:
 * X^T (cols, 16), column c of 16 rows in one vector), so that both
 * products with a transposed state, dout S^T and v dS^T, keep the state in
 * the (r, e) layout that the state updates (mk_add_keys_w16) and linear.c's
 * other paths use. Per row t, with a_t = dout_t / D_t (see linear.c):
 *   pass 1 (rows in order):  U = S dout^T,  b_t = -(dout_t . num_t) / (D_t den_t),
 *                            dphi = a S^T + b z^T + ds psi,  S += psi^T v
 *   pass 2 (reverse):        dv = psi dS + P^T a,  dpsi = v dS^T + dz + ds^T phi,
 *                            dS += phi^T a
 * with P = phi psi^T and ds_tj = a_t . v_j + b_t on the visible pairs. */

/* acc[i] += sum_p A[i][p] B[p] for mr rows of A (element (i, p) at
 * a[i a_row + p a_col]) and B (k, 16) in lanes form; mr a constant after
 * inlining */
static inline __attribute__((always_inline)) void mk_lanes_w16(__m512 acc[16], int mr,
                                                               const float *a, ptrdiff_t a_row,
                                                               ptrdiff_t a_col, const float *b,
                                                               ptrdiff_t k, mk_ahead *ahead)
{
    for (ptrdiff_t p = 0; p < k; p++) {
        mk_ahead_step(ahead);
        __m512 b_p = _mm512_loadu_ps(b + p * 16);
#pragma GCC unroll 16
        for (int i = 0; i < mr; i++)
            acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[i * a_row + p * a_col]), b_p, acc[i]);
    }
}

/* dst (cols, 16) = the 16 rows of src (rows src_row apart) transposed;
 * cols % 8 == 0 */
static inline void mk_to_lanes_w16(float *dst, const float *src, ptrdiff_t src_row, ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) mk_transpose16(dst + c0 * 16, 16, src + c0, src_row);
    if (c0 < cols) {
        mk_transpose8(dst + c0 * 16, 16, src + c0, src_row);
        mk_transpose8(dst + c0 * 16 + 8, 16, src + 8 * src_row + c0, src_row);
    }
}

/* dst (16 rows dst_row apart, cols) = src (cols, 16) in lanes form
 * transposed back; cols % 8 == 0 */
static inline void mk_from_lanes_w16(float *dst, ptrdiff_t dst_row, const float *src, ptrdiff_t cols)
{
    ptrdiff_t c0 = 0;
    for (; c0 + 16 <= cols; c0 += 16) mk_transpose16(dst + c0, dst_row, src + c0 * 16, 16);
    if (c0 < cols) {
        mk_transpose8(dst + c0, dst_row, src + c0 * 16, 16);
        mk_transpose8(dst + 8 * dst_row + c0, dst_row, src + c0 * 16 + 8, 16);
    }
}

/* The pairs that key j of the block shares with the 16 rows: row t sees
 * the keys j < visible[t] */
static inline __mmask16 mk_key_lanes_w16(__m512i visible, ptrdiff_t j)
{
    return _mm512_cmpgt_epi32_mask(visible, _mm512_set1_epi32((int)j));
}

/* Where both passes meet: with the rows' features phi_t (r, 16) and the
 * keys' psi, v and the rows' dout_t (e, 16) in lanes form, p_t (16, 16)
 * = P^T (invisible pairs 0, negative similarities kept at 0 as in the
 * forward) and dv_t (16, 16) = (dout v^T)^T; returns sum_j P_tj in lane t
 * and, in *num_dot, sum_j P_tj (dout_t . v_j). */
static inline __m512 mk_bwd_block_w16(const float *psi, ptrdiff_t r, const float *v,
                                      ptrdiff_t v_row, ptrdiff_t e, __m512i visible,
                                      const float *phi_t, const float *dout_t, float *p_t,
                                      float *dv_t, __m512 *num_dot, mk_ahead *ahead)
{
    __m512 acc[16], den = _mm512_setzero_ps(), dot = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) acc[j] = _mm512_setzero_ps();
    mk_lanes_w16(acc, 16, psi, r, 1, phi_t, r, ahead);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        /* max(0, x) is x for NaN: the second operand wins when one is NaN */
        __m512 kept = _mm512_maskz_max_ps(mk_key_lanes_w16(visible, j), _mm512_setzero_ps(), acc[j]);
        den = _mm512_add_ps(den, kept);
        _mm512_storeu_ps(p_t + j * 16, kept);
        acc[j] = _mm512_setzero_ps();
    }
    mk_lanes_w16(acc, 16, v, v_row, 1, dout_t, e, ahead);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
        dot = _mm512_fmadd_ps(_mm512_loadu_ps(p_t + j * 16), acc[j], dot);
        _mm512_storeu_ps(dv_t + j * 16, acc[j]);
    }
    *num_dot = dot;
    return den;
}

/* ds_t[j] = a_t . v_j + b_t on the visible pairs, 0 elsewhere, from dv_t */
static inline void mk_bwd_dscores_w16(float *ds_t, const float *dv_t, __m512i visible,
                                      __m512 inv_den, __m512 b)
{
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(ds_t + j * 16, _mm512_maskz_fmadd_ps(mk_key_lanes_w16(visible, j), inv_den,
                                                              _mm512_loadu_ps(dv_t + j * 16), b));
}

/* one call per block of 16 (or a last 8) rows of a lanes-form result */
#define MK_LANE_ROWS(rows, CALL)                          \
    for (ptrdiff_t f0 = 0; f0 < (rows); f0 += 16) {       \
        if ((rows) - f0 >= 16) CALL(16);                  \
        else CALL(8);                                     \
    }

/* Scratch of the two passes, in floats: phi_t, grad_t (r, 16), dout_t,
 * v_t (e, 16), p_t, dv_t, ds_t, ds (16, 16), a (16, e) */
#define MK_BWD_SCRATCH(r, e) (32 * (r) + 48 * (e) + 4 * 256)

/* Pass 1 over the chunk: dphi (16, r), 1 / D_t into inv_den[t] and b_t
 * into row_b[t] (from the clamp eps[t] per row), then the chunk's keys
 * into (S, z). r % 8 == 0, e % 16 == 0, every input finite (linear.c
 * checks); `ahead` (or NULL) the next chunk's rows, asked for along the
 * way. When `kept` is not NULL, the block's P^T and ds_t (what pass 2
 * would compute again) go into its 16 rows (kept_row apart) of 32
 * numbers: row t holds vector t of p_t, then vector t of ds_t. */
static inline __attribute__((always_inline)) void mk_linear_bwd_rows_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows, const float *eps,
    float *S, float *z, float *inv_den, float *row_b, float *dphi, float *kept, ptrdiff_t kept_row,
    float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r;
    float *p_t = dout_t + 32 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256;
    __m512i visible = _mm512_loadu_si512(visible_rows);
    mk_to_lanes_w16(phi_t, phi, r, r);
    mk_to_lanes_w16(dout_t, dout, dout_row, e);
    /* U = S dout^T into grad_t, with phi . z and phi . U = dout . (phi S),
     * each sum in 4 parts (r % 8 == 0): one chain of r dependent FMAs
     * would wait 4 r cycles */
    __m512 den_part[4], dot_part[4], block_dot;
    for (int h = 0; h < 4; h++) den_part[h] = dot_part[h] = _mm512_setzero_ps();
    for (ptrdiff_t f = 0; f < r; f += 4)
#pragma GCC unroll 4
        for (int h = 0; h < 4; h++)
            den_part[h] = _mm512_fmadd_ps(_mm512_set1_ps(z[f + h]), _mm512_loadu_ps(phi_t + (f + h) * 16),
                                          den_part[h]);
#define MK_U(mr)                                                                              \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_setzero_ps();   \
        mk_lanes_w16(acc, mr, S + f0 * e, e, 1, dout_t, e, ahead);                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) {                               \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
            dot_part[i % 4] = _mm512_fmadd_ps(_mm512_loadu_ps(phi_t + (f0 + i) * 16), acc[i], \
                                              dot_part[i % 4]);                               \
        }                                                                                     \
    } while (0)
    MK_LANE_ROWS(r, MK_U)
#undef MK_U
    __m512 den = _mm512_add_ps(_mm512_add_ps(den_part[0], den_part[1]),
                               _mm512_add_ps(den_part[2], den_part[3]));
    __m512 num_dot = _mm512_add_ps(_mm512_add_ps(dot_part[0], dot_part[1]),
                                   _mm512_add_ps(dot_part[2], dot_part[3]));
    den = _mm512_add_ps(den, mk_bwd_block_w16(psi, r, v, v_row, e, visible, phi_t, dout_t, p_t,
                                              dv_t, &block_dot, ahead));
    num_dot = _mm512_add_ps(num_dot, block_dot);
    /* D = max(den, eps); a row with den == 0 has no gradient, nor b one
     * where the clamp binds (as linear.c's bwd_row_factors) */
    __m512 eps_v = _mm512_loadu_ps(eps);
    __mmask16 empty = _mm512_cmp_ps_mask(den, _mm512_setzero_ps(), _CMP_EQ_OQ);
    __mmask16 clamped = _mm512_cmp_ps_mask(den, eps_v, _CMP_LT_OQ);
    __m512 inv = _mm512_maskz_div_ps((__mmask16)~empty, _mm512_set1_ps(1.0f),
                                     _mm512_mask_blend_ps(clamped, den, eps_v));
    __m512 b = _mm512_maskz_div_ps((__mmask16)~(empty | clamped),
                                   _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), num_dot), inv), den);
    _mm512_storeu_ps(inv_den, inv);
    _mm512_storeu_ps(row_b, b);
    mk_bwd_dscores_w16(ds_t, dv_t, visible, inv, b);
    if (kept)
        for (int t = 0; t < 16; t++) {
            _mm512_storeu_ps(kept + t * kept_row, _mm512_loadu_ps(p_t + t * 16));
            _mm512_storeu_ps(kept + t * kept_row + 16, _mm512_loadu_ps(ds_t + t * 16));
        }
    /* dphi = a S^T + b z^T + ds psi, in lanes form over U */
#define MK_DPHI(mr)                                                                           \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_fmadd_ps(       \
            _mm512_set1_ps(z[f0 + i]), b, _mm512_mul_ps(inv, _mm512_loadu_ps(grad_t + (f0 + i) * 16))); \
        mk_lanes_w16(acc, mr, psi + f0, 1, r, ds_t, 16, ahead);                               \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
    } while (0)
    MK_LANE_ROWS(r, MK_DPHI)
#undef MK_DPHI
    mk_from_lanes_w16(dphi, r, grad_t, r);
    mk_add_keys_body_w16(psi, r, v, v_row, 16, S, e, ahead);
    mk_add_rows_w16(z, psi, r, NULL);
}

/* Pass 2 over the chunk, (dS, dz) holding the gradient that the later
 * rows send to these keys: dv (16 rows dv_row apart), dpsi (16, r), then
 * (dS, dz) += what these rows send to the earlier keys. inv_den, row_b
 * from pass 1; the conditions of pass 1. `kept`: pass 1's P^T and ds_t
 * of the block, or NULL to compute them again. */
static inline __attribute__((always_inline)) void mk_linear_bwd_keys_body_w16(
    const float *phi, const float *psi, ptrdiff_t r, const float *v, ptrdiff_t v_row,
    const float *dout, ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
    const float *inv_den, const float *row_b, float *dS, float *dz, float *dv, ptrdiff_t dv_row,
    float *dpsi, const float *kept, ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    float *phi_t = scratch, *grad_t = phi_t + 16 * r, *dout_t = grad_t + 16 * r, *v_t = dout_t + 16 * e;
    float *p_t = v_t + 16 * e, *dv_t = p_t + 256, *ds_t = dv_t + 256, *ds = ds_t + 256;
    float *a = ds + 256;
    mk_to_lanes_w16(v_t, v, v_row, e);
    if (kept) {
        for (int t = 0; t < 16; t++)
            _mm512_storeu_ps(p_t + t * 16, _mm512_loadu_ps(kept + t * kept_row));
        mk_transpose16(ds, 16, kept + 16, kept_row);
    } else {
        __m512i visible = _mm512_loadu_si512(visible_rows);
        __m512 unused;
        mk_to_lanes_w16(phi_t, phi, r, r);
        mk_to_lanes_w16(dout_t, dout, dout_row, e);
        mk_bwd_block_w16(psi, r, v, v_row, e, visible, phi_t, dout_t, p_t, dv_t, &unused, ahead);
        mk_bwd_dscores_w16(ds_t, dv_t, visible, _mm512_loadu_ps(inv_den), _mm512_loadu_ps(row_b));
        mk_transpose16(ds, 16, ds_t, 16);
    }
    for (int t = 0; t < 16; t++) {
        __m512 inv_t = _mm512_set1_ps(inv_den[t]);
        for (ptrdiff_t c = 0; c < e; c += 16)
            _mm512_storeu_ps(a + t * e + c, _mm512_mul_ps(inv_t, _mm512_loadu_ps(dout + t * dout_row + c)));
    }
    /* dv = psi dS + P^T a: the forward's output kernel on other operands */
    mk_chunk_rows_w16(psi, r, dS, e, p_t, a, e, dv, dv_row, ahead);
    /* dpsi = v dS^T + dz + ds^T phi, in lanes form (the keys across the lanes) */
#define MK_DPSI(mr)                                                                           \
    do {                                                                                      \
        __m512 acc[16];                                                                       \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++) acc[i] = _mm512_set1_ps(dz[f0 + i]); \
        mk_lanes_w16(acc, mr, dS + f0 * e, e, 1, v_t, e, ahead);                              \
        mk_lanes_w16(acc, mr, phi + f0, 1, r, ds, 16, ahead);                                 \
        _Pragma("GCC unroll 16") for (int i = 0; i < mr; i++)                                 \
            _mm512_storeu_ps(grad_t + (f0 + i) * 16, acc[i]);                                 \
    } while (0)
    MK_LANE_ROWS(r, MK_DPSI)
#undef MK_DPSI
    mk_from_lanes_w16(dpsi, r, grad_t, r);
    mk_add_keys_body_w16(phi, r, a, e, 16, dS, e, ahead);
    mk_add_rows_w16(dz, phi, r, row_b);
}

/* The two passes, with r = e = 64 and values rows 64 apart (contiguous
 * heads of 64 features) as constants: the lanes loops then address their
 * 16 rows of the state from one register instead of spilling 16 pointers
 * (a tenth faster: docs/performance.md, the C code's choices). */
static inline void mk_linear_bwd_rows_w16(const float *phi, const float *psi, ptrdiff_t r,
                                          const float *v, ptrdiff_t v_row, const float *dout,
                                          ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
                                          const float *eps, float *S, float *z, float *inv_den,
                                          float *row_b, float *dphi, float *kept,
                                          ptrdiff_t kept_row, float *scratch, mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        mk_linear_bwd_rows_body_w16(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows, eps, S,
                                    z, inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_rows_body_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows, eps, S,
                                    z, inv_den, row_b, dphi, kept, kept_row, scratch, ahead);
}

static inline void mk_linear_bwd_keys_w16(const float *phi, const float *psi, ptrdiff_t r,
                                          const float *v, ptrdiff_t v_row, const float *dout,
                                          ptrdiff_t dout_row, ptrdiff_t e, const int *visible_rows,
                                          const float *inv_den, const float *row_b, float *dS,
                                          float *dz, float *dv, ptrdiff_t dv_row, float *dpsi,
                                          const float *kept, ptrdiff_t kept_row, float *scratch,
                                          mk_ahead *ahead)
{
    if (r == 64 && e == 64 && v_row == 64)
        mk_linear_bwd_keys_body_w16(phi, psi, 64, v, 64, dout, dout_row, 64, visible_rows, inv_den,
                                    row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
    else
        mk_linear_bwd_keys_body_w16(phi, psi, r, v, v_row, dout, dout_row, e, visible_rows, inv_den,
                                    row_b, dS, dz, dv, dv_row, dpsi, kept, kept_row, scratch, ahead);
}
#undef MK_LANE_ROWS
#undef MK_CHUNK_COLUMNS
#endif

#undef MK_CAT2
#undef MK_CAT
#undef MK_NAME
#undef MK_VEC
MK_TARGET_POP
/* the parameters of this instantiation */
#undef MK_REAL
#undef MK_W
#undef MK_SFX
#undef MK_TYPED
#undef MK_KB_W
#undef MK_VMAX
#undef MK_TARGET
#undef MK_TARGET_POP
#undef MK_PAIRS

#endif /* MK_W */
