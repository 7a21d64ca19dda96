/* microkernel.h - register-blocked kernels for the softmax tiles, float32
 * and float64, for AVX-512, AVX2+FMA and NEON, picked at import
 * (dispatch.h); for float32 (MK_F32) it also includes the linear family's
 * chunk kernels (mk_linear.h), and at every width the decoding steps'
 * (mk_decode.h).
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
 * where one width has it (mk_linear.h's, float32 only: _w16, _w8, _n4),
 * so that grep finds its body by the name it is called by. */
#ifndef MK_W
#ifndef ATTNX_MICROKERNEL_H
#define ATTNX_MICROKERNEL_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "attnx.h"
#include "convert.h"
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
/* Keys per slice of a P V tile (mk_add_pv): the slice of a strip's P^T (3 W
 * rows, 24 KB in float32 with AVX-512) stays in L1 while the value panels
 * stream past. */
#define MK_KC 128
/* query rows per call of the decoding scores kernel (mk_decode_scores):
 * one load of a key serves this many rows */
#define MK_DECODE_ROWS 4

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

/* The rows that the next chunk of the linear family's chunk kernels
 * (mk_linear.h) reads and writes, asked of the memory a line at a time
 * from inside the kernels' loops (mk_ahead_step), so that they arrive
 * while this chunk computes. Asked all at once before it, they stall the
 * core: each operand's chunk is a 4 KiB page of its own, where the
 * hardware's stream prefetch stops, and the memory takes a few dozen lines
 * at a time. Here, outside every instruction set's body: linear.c calls
 * mk_ahead_add whatever the CPU. */
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

/* dst[c][r] = src[r][c] for a 4 x 4 block of floats (SSE, in every x86-64):
 * an AVX2 key panel, 4 keys */
static inline void mk_transpose4(float *dst, ptrdiff_t dst_row, const float *src,
                                 ptrdiff_t src_row)
{
    __m128 row0 = _mm_loadu_ps(src), row1 = _mm_loadu_ps(src + src_row);
    __m128 row2 = _mm_loadu_ps(src + 2 * src_row), row3 = _mm_loadu_ps(src + 3 * src_row);
    _MM_TRANSPOSE4_PS(row0, row1, row2, row3);
    _mm_storeu_ps(dst, row0);
    _mm_storeu_ps(dst + dst_row, row1);
    _mm_storeu_ps(dst + 2 * dst_row, row2);
    _mm_storeu_ps(dst + 3 * dst_row, row3);
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

/* The pairs of numbers that are no bfloat16 values (the probabilities and
 * their gradients, where the caller asked for bfloat16 products: the
 * bf16_products of attnx_softmax_args) rounded to the nearest bfloat16,
 * ties to even, by VCVTNEPS2BF16 (avx512_bf16; asm as
 * mk_dot_pairs). A NaN stays a NaN; a number under 2^-126 becomes 0, as
 * the dot products would read it. */

/* the 16 numbers of x rounded, in 16-bit lanes */
__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) __m256i
mk_round_bf16(__m512 x)
{
    __m256i rounded;
    __asm__("vcvtneps2bf16 %1, %0" : "=v"(rounded) : "v"(x));
    return rounded;
}

/* mk_pair_rows, the numbers rounded: dst (ceil(depth / 2), lanes) from x
 * (depth, lanes), the second row of the last pair 0 past an odd depth */
__attribute__((target("avx512f"))) static inline void mk_pair_rows_rounded(
    float *dst, ptrdiff_t dst_row, const float *x, ptrdiff_t x_row, ptrdiff_t depth,
    ptrdiff_t lanes)
{
    for (ptrdiff_t c = 0; c < depth; c += 2) {
        const float *first = x + c * x_row, *second = x + (c + 1) * x_row;
        float *pair = dst + c / 2 * dst_row;
        for (ptrdiff_t l = 0; l < lanes; l += 16) {
            __mmask16 part = lanes - l >= 16 ? 0xffff : (__mmask16)((1u << (lanes - l)) - 1);
            __m512i low = _mm512_cvtepu16_epi32(
                mk_round_bf16(_mm512_maskz_loadu_ps(part, first + l)));
            __m512i high = _mm512_setzero_si512();
            if (c + 1 < depth)
                high = _mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(mk_round_bf16(_mm512_maskz_loadu_ps(part, second + l))),
                    16);
            _mm512_mask_storeu_epi32(pair + l, part, _mm512_or_si512(low, high));
        }
    }
}

/* The sum of a vector's lanes (the decoding scores' dot products) */
__attribute__((target("avx512f"))) static inline float mk_hsum_w16(__m512 x)
{
    return _mm512_reduce_add_ps(x);
}
__attribute__((target("avx512f"))) static inline double mk_hsum_d8(__m512d x)
{
    return _mm512_reduce_add_pd(x);
}
__attribute__((target("avx2"))) static inline float mk_hsum_w8(__m256 x)
{
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));
}
__attribute__((target("avx2"))) static inline double mk_hsum_d4(__m256d x)
{
    __m128d half = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(half, _mm_unpackhi_pd(half, half)));
}

/* AVX-512: both products accumulate in 24 of the 32 zmm registers */
#define MK_REAL float
#define MK_W 16
#define MK_SFX w16
#define MK_F32 1
#define MK_HSUM(x) mk_hsum_w16((__m512)(x))
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) w16
#define MK_KB_W 8
#define MK_VMAX(a, b) ((MK_VEC)_mm512_max_ps((__m512)(a), (__m512)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx512f,avx512dq")
#define MK_TARGET_POP ATTNX_TARGET_POP
#define MK_F16_VEC(bits) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bits)))
#define MK_PAIRS 1 /* with the bfloat16 dot products */
#include "microkernel.h"

#define MK_REAL double
#define MK_W 8
#define MK_SFX d8
#define MK_HSUM(x) mk_hsum_d8((__m512d)(x))
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
#define MK_F32 1
#define MK_HSUM(x) mk_hsum_w8((__m256)(x))
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) w8
#define MK_KB_W 4
#define MK_VMAX(a, b) ((MK_VEC)_mm256_max_ps((__m256)(a), (__m256)(b)))
#define MK_F16_VEC(bits) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(bits)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx2,fma,f16c")
#define MK_TARGET_POP ATTNX_TARGET_POP
#include "microkernel.h"

#define MK_REAL double
#define MK_W 4
#define MK_SFX d4
#define MK_HSUM(x) mk_hsum_d4((__m256d)(x))
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) d4
#define MK_KB_W 4
#define MK_VMAX(a, b) ((MK_VEC)_mm256_max_pd((__m256d)(a), (__m256d)(b)))
#define MK_TARGET ATTNX_TARGET_PUSH("avx2,fma")
#define MK_TARGET_POP ATTNX_TARGET_POP
#include "microkernel.h"

#elif defined(ATTNX_NEON_KERNELS)
#define MK_HAVE_NEON 1
#include <arm_neon.h>

/* dst[c][r] = src[r][c] for a 4 x 4 block of floats (row strides in floats) */
static inline void mk_transpose4(float *dst, ptrdiff_t dst_row, const float *src,
                                 ptrdiff_t src_row)
{
    float32x4_t row[4];
    for (int r = 0; r < 4; r++) row[r] = vld1q_f32(src + r * src_row);
    /* pairs of rows interleaved, then their 64-bit halves */
    float32x4_t even01 = vtrn1q_f32(row[0], row[1]), odd01 = vtrn2q_f32(row[0], row[1]);
    float32x4_t even23 = vtrn1q_f32(row[2], row[3]), odd23 = vtrn2q_f32(row[2], row[3]);
    float64x2_t e01 = vreinterpretq_f64_f32(even01), o01 = vreinterpretq_f64_f32(odd01);
    float64x2_t e23 = vreinterpretq_f64_f32(even23), o23 = vreinterpretq_f64_f32(odd23);
    vst1q_f32(dst, vreinterpretq_f32_f64(vtrn1q_f64(e01, e23)));
    vst1q_f32(dst + dst_row, vreinterpretq_f32_f64(vtrn1q_f64(o01, o23)));
    vst1q_f32(dst + 2 * dst_row, vreinterpretq_f32_f64(vtrn2q_f64(e01, e23)));
    vst1q_f32(dst + 3 * dst_row, vreinterpretq_f32_f64(vtrn2q_f64(o01, o23)));
}

/* Advanced SIMD (NEON), part of every aarch64 core, so compiled without a
 * target of its own: 128-bit vectors, the softmax tiles' products in 12 of
 * the 32 registers. The row max keeps x86's rule (the second operand where
 * either is NaN), as the plain code's `a > b ? a : b` does. */
#define MK_REAL float
#define MK_W 4
#define MK_SFX n4
#define MK_F32 1
#define MK_HSUM(x) vaddvq_f32((float32x4_t)(x))
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) n4
#define MK_F16_VEC(bits) vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(bits)))
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
#define MK_HSUM(x) vaddvq_f64((float64x2_t)(x))
#define MK_TYPED(w16, d8, w8, d4, n4, nd2) nd2
#define MK_KB_W 4
#define MK_VMAX(a, b) \
    ((MK_VEC)vbslq_f64(vcgtq_f64((float64x2_t)(a), (float64x2_t)(b)), (float64x2_t)(a), \
                       (float64x2_t)(b)))
#define MK_TARGET
#define MK_TARGET_POP
#include "microkernel.h"
#endif

#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
/* mk_gemm (mk_backward.h) of a kernel set's width (attnx_kernels_width: 16
 * AVX-512, 8 AVX2, 4 NEON), float32 and float64: direct calls, so that gcc
 * specialises each kernel for the constant arguments of its callers. */
#define MK_GEMM_ARGS(type)                                                                      \
    int width, ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t depth, type alpha, const type *a,      \
        ptrdiff_t a_row, ptrdiff_t a_col, const type *b, ptrdiff_t b_row, int accumulate,       \
        type *c, ptrdiff_t c_row
#define MK_GEMM_PASS rows, cols, depth, alpha, a, a_row, a_col, b, b_row, accumulate, c, c_row
static inline __attribute__((always_inline)) void mk_gemm_f32(MK_GEMM_ARGS(float))
{
#if defined(MK_HAVE_X86)
    if (width == 16)
        mk_gemm_w16(MK_GEMM_PASS);
    else
        mk_gemm_w8(MK_GEMM_PASS);
#else
    (void)width;
    mk_gemm_n4(MK_GEMM_PASS);
#endif
}
static inline __attribute__((always_inline)) void mk_gemm_f64(MK_GEMM_ARGS(double))
{
#if defined(MK_HAVE_X86)
    if (width == 16)
        mk_gemm_d8(MK_GEMM_PASS);
    else
        mk_gemm_d4(MK_GEMM_PASS);
#else
    (void)width;
    mk_gemm_nd2(MK_GEMM_PASS);
#endif
}
#undef MK_GEMM_ARGS
#undef MK_GEMM_PASS
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

/* CALL(nv) once per block of up to 4 vectors of the columns [0, e), c0 the
 * block's first column, nv a constant in each call (e whole vectors) */
#define MK_COLUMNS_BY4(e, CALL)                                   \
    for (ptrdiff_t c0 = 0; c0 < (e); c0 += 4 * MK_W) {            \
        switch ((e) - c0 >= 4 * MK_W ? 4 : ((e) - c0) / MK_W) {   \
        case 4: CALL(4); break;                                   \
        case 3: CALL(3); break;                                   \
        case 2: CALL(2); break;                                   \
        default: CALL(1); break;                                  \
        }                                                         \
    }

/* CALL(vectors, pairs) for a tile's last strip, rows r0 to t->rows in 1
 * or 2 vectors, with `pairs` (MK_PAIRS only) 0 or 1: constants in each
 * call, so that each combination is compiled for itself */
#ifdef MK_PAIRS
#define MK_LAST_STRIP(t, r0, pairs, CALL)                          \
    do {                                                            \
        int two_vectors = (t)->rows - (r0) > MK_W;                  \
        if (pairs) {                                                \
            if (two_vectors) CALL(2, 1); else CALL(1, 1);           \
        } else if (two_vectors) CALL(2, 0); else CALL(1, 0);        \
    } while (0)
#else
#define MK_LAST_STRIP(t, r0, pairs, CALL)                          \
    do {                                                            \
        (void)(pairs);                                              \
        if ((t)->rows - (r0) > MK_W) CALL(2, 0); else CALL(1, 0);   \
    } while (0)
#endif

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
    /* the terms read before the first store to st (which may alias them, as
     * far as the compiler knows: else it reloads each per vector) */
    MK_REAL term[MK_KB_W];
#pragma GCC unroll 8
    for (int jj = 0; jj < MK_KB_W; jj++) term[jj] = key_term[jj];
    const MK_VEC scale_v = (MK_VEC){0} + scale;
#pragma GCC unroll 8
    for (int jj = 0; jj < MK_KB_W; jj++) {
        /* a masked key (term -inf) must not turn a NaN score into a NaN
         * weight: it is -inf outright (one predictable test per key) */
        const int masked = term[jj] == -INFINITY;
        const MK_VEC term_v = (MK_VEC){0} + term[jj];
        for (int h = 0; h < vectors; h++) {
            MK_VEC s = masked ? (MK_VEC){0} - INFINITY : acc[jj][h] * scale_v + term_v;
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
        /* the panels' slots counted on, not divided for per block: the
         * division's latency held up each block's first loads */
        ptrdiff_t slot = (t->j0 + lo) / kb % slots;
        for (ptrdiff_t c0 = lo; c0 < hi; c0 += kb, slot = slot + 1 == slots ? 0 : slot + 1) {
            int whole = all_lo <= c0 && c0 + kb <= all_hi && c0 + kb <= t->cols;
            const MK_REAL *panel = kt + slot * kb * d;
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
    MK_LAST_STRIP(t, r0, pairs, MK_LAST);
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
 * over `keys` keys from the start of the panel in slot `slot`:
 *   ot[cc][r] = ot[cc][r] (times correction[r], if given) + sum_j p[j][r] v[j][cc]
 * the transpose of the scores block, with P^T's columns for the queries
 * and the values for the keys: both products are the same loop. With
 * `pairs` (a constant; MK_PAIRS only), pt holds pair rows of keys
 * (mk_pair_rows_rounded) and the values pairs of keys, key_step apart
 * (mk_values): the bfloat16 dot products, one pair of keys a step. */
static inline __attribute__((always_inline)) void MK_NAME(mk_pv_block)(
    MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld, const mk_values *values,
    ptrdiff_t group, ptrdiff_t slot, ptrdiff_t keys, const MK_REAL *correction, const int vectors,
    const int pairs)
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
#ifdef MK_PAIRS
    if (pairs)
        for (ptrdiff_t k0 = 0; k0 < keys; k0 += MK_KB_W) {
            const MK_REAL *v_panel = v_group + slot * values->panel_step;
            const MK_REAL *p_panel = pt + k0 / 2 * pt_ld;
            ptrdiff_t panel_keys = keys - k0 < MK_KB_W ? keys - k0 : MK_KB_W;
            for (ptrdiff_t jj = 0; jj < (panel_keys + 1) / 2; jj++) {
                MK_VEC p_j[MK_RV];
                for (int h = 0; h < vectors; h++) p_j[h] = *(const MK_VEC *)(p_panel + jj * pt_ld + h * MK_W);
#pragma GCC unroll 8
                for (int cc = 0; cc < MK_KB_W; cc++) {
                    /* a broadcast, no arithmetic: the bits stay as they are */
                    __m512 v_jc = _mm512_set1_ps(v_panel[jj * key_step + cc]);
                    for (int h = 0; h < vectors; h++)
                        acc[cc][h] = (MK_VEC)mk_dot_pairs((__m512)acc[cc][h], (__m512)p_j[h], v_jc);
                }
            }
            if (++slot == slots) slot = 0;
        }
    else
#endif
    {
        const MK_REAL *p_j = pt;
        for (ptrdiff_t k0 = 0; k0 < keys; k0 += MK_KB_W) {
            const MK_REAL *v_j = v_group + slot * values->panel_step;
            const MK_REAL *p_end = p_j + (keys - k0 < MK_KB_W ? keys - k0 : MK_KB_W) * pt_ld;
            /* pointers stepped key by key: gcc multiplied jj by key_step and
             * reloaded spilled indices in the loop */
            for (; p_j < p_end; p_j += pt_ld, v_j += key_step) {
                MK_VEC p_jh[MK_RV];
                for (int h = 0; h < vectors; h++) p_jh[h] = *(const MK_VEC *)(p_j + h * MK_W);
#pragma GCC unroll 8
                for (int cc = 0; cc < MK_KB_W; cc++)
                    for (int h = 0; h < vectors; h++) acc[cc][h] += p_jh[h] * v_j[cc];
            }
            if (++slot == slots) slot = 0;
        }
    }
#pragma GCC unroll 8
    for (int cc = 0; cc < MK_KB_W; cc++)
        for (int h = 0; h < vectors; h++) *(MK_VEC *)(ot + cc * ot_ld + h * MK_W) = acc[cc][h];
}

/* mk_add_pv for the strips from row r_begin to r_end, each in its first
 * `vectors` vectors of rows (constants where this is inlined, as `pairs`:
 * then each strip's slice of P^T is rounded into p_pairs first, pair rows
 * MK_STRIP(MK_W) numbers apart) */
static inline __attribute__((always_inline)) void MK_NAME(mk_add_pv_strips)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction, MK_REAL *p_pairs,
    ptrdiff_t r_begin, ptrdiff_t r_end, const int vectors, const int pairs)
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
            const MK_REAL *p_slice = pt + lo * pt_ld + r0;
            ptrdiff_t p_ld = pt_ld;
#ifdef MK_PAIRS
            /* lo is a multiple of kb: the pairs are those of the panels */
            if (pairs) {
                mk_pair_rows_rounded(p_pairs, strip, p_slice, pt_ld, hi - lo, vectors * MK_W);
                p_slice = p_pairs;
                p_ld = strip;
            }
#endif
            ptrdiff_t slot = (t->j0 + lo) / kb % values->slots;
            for (ptrdiff_t g = 0; g < e; g += kb)
                MK_NAME(mk_pv_block)(ot + g * ot_ld + r0, ot_ld, p_slice, p_ld, values, g / kb,
                                     slot, hi - lo, strip_correction, vectors, pairs);
        }
}

/* The last strip in 1 or 2 vectors, out of line (see mk_scores_last_strip) */
static __attribute__((noinline)) void MK_NAME(mk_add_pv_last_strip)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction, MK_REAL *p_pairs,
    ptrdiff_t r0, int pairs)
{
#define MK_LAST(vectors, pairs)                                                              \
    MK_NAME(mk_add_pv_strips)(t, ot, ot_ld, pt, pt_ld, values, e, correction, p_pairs, r0, \
                              t->rows, vectors, pairs)
    MK_LAST_STRIP(t, r0, pairs, MK_LAST);
#undef MK_LAST
}

/* ot (e, ot_ld) += V^T P^T over the keys each strip computes
 * (mk_strip_keys) that the tile holds, the tile's P^T in pt (row stride
 * pt_ld). Each strip's columns of ot are first multiplied by its rows'
 * correction, the online softmax's rescaling. With `pairs` (a constant),
 * by the bfloat16 dot products (mk_add_pv_pairs_w16). */
static inline __attribute__((always_inline)) void MK_NAME(mk_add_pv_by)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction, MK_REAL *p_pairs,
    const int pairs)
{
    ptrdiff_t full = MK_NAME(mk_full_strip_rows)(t->rows);
    MK_NAME(mk_add_pv_strips)(t, ot, ot_ld, pt, pt_ld, values, e, correction, p_pairs, 0, full,
                              MK_RV, pairs);
    if (full < t->rows)
        MK_NAME(mk_add_pv_last_strip)(t, ot, ot_ld, pt, pt_ld, values, e, correction, p_pairs,
                                      full, pairs);
}

static inline void MK_TYPED(mk_add_pv_w16, mk_add_pv_d8, mk_add_pv_w8, mk_add_pv_d4,
                            mk_add_pv_n4, mk_add_pv_nd2)(
    const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld, const MK_REAL *pt, ptrdiff_t pt_ld,
    const mk_values *values, ptrdiff_t e, const MK_REAL *correction)
{
    MK_NAME(mk_add_pv_by)(t, ot, ot_ld, pt, pt_ld, values, e, correction, NULL, 0);
}

#ifdef MK_PAIRS
/* mk_add_pv by the bfloat16 dot products, P rounded to bfloat16 (the
 * caller's bfloat16 arithmetic: bf16_products of attnx_softmax_args):
 * values holds pairs of bfloat16 values, the keys 2c and 2c + 1 of a panel
 * in pair c (mk_pair_rows), key_step from one pair to the next; p_pairs
 * (MK_KC / 2, 3 W) is the space for a strip's slice of P, rounded */
static inline void mk_add_pv_pairs_w16(const mk_tile *t, MK_REAL *ot, ptrdiff_t ot_ld,
                                       const MK_REAL *pt, ptrdiff_t pt_ld,
                                       const mk_values *values, ptrdiff_t e,
                                       const MK_REAL *correction, MK_REAL *p_pairs)
{
    MK_NAME(mk_add_pv_by)(t, ot, ot_ld, pt, pt_ld, values, e, correction, p_pairs, 1);
}
#endif

/* the softmax backward's products, at every width */
#include "mk_backward.h"
/* Decoding (softmax_decode.c): a few query rows against many keys, where
 * reading the keys and values once is the cost, not the arithmetic. The
 * rows are not packed: each key is loaded once per block of up to
 * MK_DECODE_ROWS rows and multiplied along d, its dot products summed
 * across the lanes at the end. Keys and values are MK_REAL numbers, or in
 * the float32 bodies half-precision bits (kv_half, ATTNX_BF16 or ATTNX_F16,
 * a constant where inlined: attnx_softmax_args), widened as they are
 * loaded (MK_F16_VEC: each width's float16 conversion): half the bytes
 * read. */

#ifdef MK_F32
typedef uint16_t MK_NAME(mk_bf16_bits) __attribute__((vector_size(MK_W * 2), aligned(2),
                                                       may_alias));
typedef uint32_t MK_NAME(mk_f32_bits) __attribute__((vector_size(MK_W * 4)));
#endif

/* the vector of x's numbers from index `at` (of MK_REAL, or of
 * half-precision bits widened: exact) */
static inline __attribute__((always_inline)) MK_VEC MK_NAME(mk_kv_vec)(const void *x,
                                                                         ptrdiff_t at,
                                                                         const int kv_half)
{
#ifdef MK_F32
    if (kv_half == ATTNX_BF16) {
        MK_NAME(mk_bf16_bits) bits = *(const MK_NAME(mk_bf16_bits) *)((const uint16_t *)x + at);
        return (MK_VEC)(__builtin_convertvector(bits, MK_NAME(mk_f32_bits)) << 16);
    }
    if (kv_half == ATTNX_F16) return (MK_VEC)MK_F16_VEC((const uint16_t *)x + at);
#endif
    (void)kv_half;
    return *(const MK_VEC *)((const MK_REAL *)x + at);
}

/* the same for one number */
static inline __attribute__((always_inline)) MK_REAL MK_NAME(mk_kv_one)(const void *x,
                                                                          ptrdiff_t at,
                                                                          const int kv_half)
{
#ifdef MK_F32
    if (kv_half == ATTNX_BF16) return attnx_bf16_widened(((const uint16_t *)x)[at]);
    if (kv_half == ATTNX_F16) return attnx_f16_widened(((const uint16_t *)x)[at]);
#endif
    (void)kv_half;
    return ((const MK_REAL *)x)[at];
}

/* a b + c rounded once, in the scalar columns past the vectors: spelled
 * out, since whether the compiler fuses a multiply and an add there
 * depends on how the number was loaded (the bits of a bfloat16 widened or
 * a float read), and the two must give the same result */
static inline __attribute__((always_inline)) MK_REAL MK_NAME(mk_fma_one)(MK_REAL a, MK_REAL b,
                                                                           MK_REAL c)
{
    if (sizeof(MK_REAL) == sizeof(float))
        return (MK_REAL)__builtin_fmaf((float)a, (float)b, (float)c);
    return (MK_REAL)__builtin_fma((double)a, (double)b, (double)c);
}

/* s[r s_ld + j] = scale q_r . k_j for the `rows` rows q[r] (a constant
 * where this is inlined) and the keys j < keys, rows k_row apart. Two
 * accumulators per row, the even and the odd vectors of d, halve the chain
 * of dependent multiply-adds of each key. */
static inline __attribute__((always_inline)) void MK_NAME(mk_decode_scores_rows)(
    MK_REAL *s, ptrdiff_t s_ld, const MK_REAL *const *q, const void *k, ptrdiff_t k_row,
    ptrdiff_t keys, ptrdiff_t d, MK_REAL scale, const int rows, const int kv_half)
{
    const ptrdiff_t pairs = d / (2 * MK_W) * (2 * MK_W), whole = d / MK_W * MK_W;
    for (ptrdiff_t j = 0; j < keys; j++) {
        const ptrdiff_t k_j = j * k_row;
        MK_VEC even[MK_DECODE_ROWS], odd[MK_DECODE_ROWS];
        for (int r = 0; r < rows; r++) even[r] = odd[r] = (MK_VEC){0};
        for (ptrdiff_t c = 0; c < pairs; c += 2 * MK_W) {
            MK_VEC k_even = MK_NAME(mk_kv_vec)(k, k_j + c, kv_half);
            MK_VEC k_odd = MK_NAME(mk_kv_vec)(k, k_j + c + MK_W, kv_half);
            for (int r = 0; r < rows; r++) {
                even[r] += *(const MK_VEC *)(q[r] + c) * k_even;
                odd[r] += *(const MK_VEC *)(q[r] + c + MK_W) * k_odd;
            }
        }
        if (whole > pairs) {
            MK_VEC k_last = MK_NAME(mk_kv_vec)(k, k_j + pairs, kv_half);
            for (int r = 0; r < rows; r++) even[r] += *(const MK_VEC *)(q[r] + pairs) * k_last;
        }
        for (int r = 0; r < rows; r++) {
            MK_REAL dot = MK_HSUM(even[r] + odd[r]);
            for (ptrdiff_t c = whole; c < d; c++)
                dot = MK_NAME(mk_fma_one)(q[r][c], MK_NAME(mk_kv_one)(k, k_j + c, kv_half), dot);
            s[r * s_ld + j] = dot * scale;
        }
    }
}

/* mk_decode_scores_rows for 1 to MK_DECODE_ROWS rows */
static inline void MK_TYPED(mk_decode_scores_w16, mk_decode_scores_d8, mk_decode_scores_w8,
                            mk_decode_scores_d4, mk_decode_scores_n4, mk_decode_scores_nd2)(
    MK_REAL *s, ptrdiff_t s_ld, const MK_REAL *const *q, ptrdiff_t rows, const void *k,
    ptrdiff_t k_row, ptrdiff_t keys, ptrdiff_t d, MK_REAL scale, int kv_half)
{
#define MK_ROWS(count, half) \
    MK_NAME(mk_decode_scores_rows)(s, s_ld, q, k, k_row, keys, d, scale, count, half)
#define MK_ROWS_OF(half)                   \
    switch (rows) {                        \
    case 1: MK_ROWS(1, half); break;       \
    case 2: MK_ROWS(2, half); break;       \
    case 3: MK_ROWS(3, half); break;       \
    default: MK_ROWS(MK_DECODE_ROWS, half); break; \
    }
#ifdef MK_F32
    if (kv_half == ATTNX_BF16) {
        MK_ROWS_OF(ATTNX_BF16)
        return;
    }
    if (kv_half == ATTNX_F16) {
        MK_ROWS_OF(ATTNX_F16)
        return;
    }
#endif
    (void)kv_half;
    MK_ROWS_OF(0)
#undef MK_ROWS_OF
#undef MK_ROWS
}

/* acc (vectors W numbers) += sum_j p[j] v_j over the keys j < keys with
 * p[j] != 0, for `vectors` (a constant: 8, 4, 2 or 1) vectors of columns:
 * 8 / vectors sets of accumulators take the keys in turn, so that 8
 * independent chains of multiply-adds hide their latency whatever the
 * width of the group. */
static inline __attribute__((always_inline)) void MK_NAME(mk_decode_pv_group)(
    MK_REAL *acc, const MK_REAL *p, const void *v, ptrdiff_t v_col, ptrdiff_t v_row,
    ptrdiff_t keys, const int vectors, const int kv_half)
{
    const int sets = 8 / vectors;
    MK_VEC sum[8];
    for (int g = 0; g < 8; g++) sum[g] = g < vectors ? *(const MK_VEC *)(acc + g * MK_W) : (MK_VEC){0};
    ptrdiff_t j = 0;
    for (; j + sets <= keys; j += sets)
        for (int set = 0; set < sets; set++) {
            MK_REAL p_j = p[j + set];
            if (p_j == 0) continue;
            const ptrdiff_t v_j = (j + set) * v_row + v_col;
            for (int g = 0; g < vectors; g++)
                sum[set * vectors + g] += p_j * MK_NAME(mk_kv_vec)(v, v_j + g * MK_W, kv_half);
        }
    for (; j < keys; j++)
        if (p[j] != 0)
            for (int g = 0; g < vectors; g++)
                sum[g] += p[j] * MK_NAME(mk_kv_vec)(v, j * v_row + v_col + g * MK_W, kv_half);
    for (int set = 1; set < sets; set++)
        for (int g = 0; g < vectors; g++) sum[g] += sum[set * vectors + g];
    for (int g = 0; g < vectors; g++) *(MK_VEC *)(acc + g * MK_W) = sum[g];
}

/* the columns of mk_decode_pv below */
static inline __attribute__((always_inline)) void MK_NAME(mk_decode_pv_columns)(
    MK_REAL *acc, const MK_REAL *p, const void *v, ptrdiff_t v_row, ptrdiff_t keys, ptrdiff_t e,
    const int kv_half)
{
    ptrdiff_t c0 = 0;
    for (; c0 + 8 * MK_W <= e; c0 += 8 * MK_W)
        MK_NAME(mk_decode_pv_group)(acc + c0, p, v, c0, v_row, keys, 8, kv_half);
    if (c0 + 4 * MK_W <= e) {
        MK_NAME(mk_decode_pv_group)(acc + c0, p, v, c0, v_row, keys, 4, kv_half);
        c0 += 4 * MK_W;
    }
    if (c0 + 2 * MK_W <= e) {
        MK_NAME(mk_decode_pv_group)(acc + c0, p, v, c0, v_row, keys, 2, kv_half);
        c0 += 2 * MK_W;
    }
    if (c0 + MK_W <= e) {
        MK_NAME(mk_decode_pv_group)(acc + c0, p, v, c0, v_row, keys, 1, kv_half);
        c0 += MK_W;
    }
    for (; c0 < e; c0++)
        for (ptrdiff_t j = 0; j < keys; j++)
            if (p[j] != 0)
                acc[c0] = MK_NAME(mk_fma_one)(p[j], MK_NAME(mk_kv_one)(v, j * v_row + c0, kv_half),
                                              acc[c0]);
}

/* acc (e) += sum_j p[j] v_j over the keys j < keys with p[j] != 0, rows of
 * v v_row apart: a key a row does not see (p = 0) adds nothing, not even
 * the NaN of 0 times an inf or NaN value. Columns by groups of 8 vectors
 * held in registers, then of 4, 2, 1, then one by one. */
static inline void MK_TYPED(mk_decode_pv_w16, mk_decode_pv_d8, mk_decode_pv_w8, mk_decode_pv_d4,
                            mk_decode_pv_n4, mk_decode_pv_nd2)(
    MK_REAL *acc, const MK_REAL *p, const void *v, ptrdiff_t v_row, ptrdiff_t keys,
    ptrdiff_t e, int kv_half)
{
#ifdef MK_F32
    if (kv_half == ATTNX_BF16) {
        MK_NAME(mk_decode_pv_columns)(acc, p, v, v_row, keys, e, ATTNX_BF16);
        return;
    }
    if (kv_half == ATTNX_F16) {
        MK_NAME(mk_decode_pv_columns)(acc, p, v, v_row, keys, e, ATTNX_F16);
        return;
    }
#endif
    (void)kv_half;
    MK_NAME(mk_decode_pv_columns)(acc, p, v, v_row, keys, e, 0);
}

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

/* The backward's probabilities of one row (softmax_backward.c,
 * bwd_probabilities): p[c] <- 2^(p[c] + key_term[c] - offset) for
 * c < count, as vexp2 (vec_real.h) computes it, to its error (mk_exp2_w16
 * is the same fit, on [0, 1)): 1 where the exponent is above 0, 0 where it
 * is under -125 (vexp2's EXP2_LO) or key_term[c] is -inf (a hidden key,
 * whatever its score).
 * Returns whether any is non-zero. */
static inline int mk_probabilities_w16(float *p, const float *key_term, float offset,
                                       ptrdiff_t count)
{
    const __m512 zero = _mm512_setzero_ps(), lowest = _mm512_set1_ps(-125.0f);
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY), row_offset = _mm512_set1_ps(offset);
    __mmask16 nonzero = 0;
    for (ptrdiff_t c = 0; c < count; c += 16) {
        __mmask16 part = count - c >= 16 ? 0xffff : (__mmask16)((1u << (count - c)) - 1);
        __m512 term = _mm512_maskz_loadu_ps(part, key_term + c);
        __m512 x = _mm512_sub_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(part, p + c), term),
                                 row_offset);
        /* x < -125 gives 0; NaN passes (unordered) and stays NaN */
        __mmask16 kept = _mm512_cmp_ps_mask(term, neg_inf, _CMP_NEQ_OQ) &
                         _mm512_cmp_ps_mask(x, lowest, _CMP_NLT_UQ);
        /* min(0, x): p <= 1 where rounding put a score above the lse */
        __m512 y = _mm512_maskz_mov_ps(kept, mk_exp2_w16(_mm512_min_ps(zero, x)));
        nonzero |= _mm512_mask_cmp_ps_mask(part, y, zero, _CMP_NEQ_UQ);
        _mm512_mask_storeu_ps(p + c, part, y);
    }
    return nonzero != 0;
}

/* The backward's dS of a query block x key block (softmax_backward.c,
 * bwd_score_grads) where it is rounded for the bfloat16 products: ds
 * (rows, cols; rows `ld` apart) <- pd dP - p D_i from dP in ds, exactly 0
 * where p is; and rounded to bfloat16, its rows paired (ds_pairs: pair row
 * r / 2 from rows r, r + 1, `ld` numbers apart, the second 0 past an odd
 * rows) and each row paired along itself (ds_along: row r at r ld / 2),
 * in the pass that computes dS. */
static inline void mk_score_grads_pairs_w16(float *ds, const float *p, const float *pd,
                                            const float *row_delta, ptrdiff_t rows,
                                            ptrdiff_t cols, ptrdiff_t ld, float *ds_pairs,
                                            float *ds_along)
{
    const __m512 zero = _mm512_setzero_ps();
    for (ptrdiff_t r = 0; r < rows; r += 2) {
        const int both = r + 1 < rows;
        for (ptrdiff_t c = 0; c < cols; c += 16) {
            ptrdiff_t left = cols - c;
            __mmask16 part = left >= 16 ? 0xffff : (__mmask16)((1u << left) - 1);
            __mmask16 pairs = left >= 16 ? 0xff : (__mmask16)((1u << ((left + 1) / 2)) - 1);
            __m256i rounded[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int h = 0; h <= both; h++) {
                ptrdiff_t at = (r + h) * ld + c;
                __m512 p_h = _mm512_maskz_loadu_ps(part, p + at);
                __m512 value = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(part, pd + at),
                                               _mm512_maskz_loadu_ps(part, ds + at),
                                               _mm512_mul_ps(p_h, _mm512_set1_ps(row_delta[r + h])));
                value = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(p_h, zero, _CMP_NEQ_UQ), value);
                _mm512_mask_storeu_ps(ds + at, part, value);
                rounded[h] = mk_round_bf16(value);
                /* 16 numbers rounded are 8 pairs along the row */
                _mm512_mask_storeu_epi32(ds_along + (r + h) * (ld / 2) + c / 2, pairs,
                                         _mm512_castsi256_si512(rounded[h]));
            }
            __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(rounded[0]),
                                           _mm512_slli_epi32(_mm512_cvtepu16_epi32(rounded[1]), 16));
            _mm512_mask_storeu_epi32(ds_pairs + r / 2 * ld + c, part, pair);
        }
    }
}

#elif MK_W == 8 && defined(MK_F32)
/* 2^t for t <= 0 (and -inf, NaN) on AVX2, the same numbers as mk_exp2_w16
 * gives with flush-to-zero: t = n + f with n = floor(t), 2^f by the same
 * polynomial, 2^n built in the exponent bits. t is first raised to -127,
 * whose n has exponent field 0: 2^n = 0, so every result under 2^-126
 * (-inf's too) is 0 and none is subnormal. n's field comes from the float
 * n + 127 + 1.5 2^23, whose low mantissa bits hold the integer n + 127.
 * NaN stays NaN (the max keeps its second operand's NaN). */
static inline __attribute__((always_inline)) __m256 mk_exp2_w8(__m256 t)
{
    t = _mm256_max_ps(_mm256_set1_ps(-127.0f), t);
    __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(t, n);
    __m256 p = _mm256_set1_ps(2.1690609157073274e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.2443081511840524e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6784725541209631e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5483524724105671e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.24022979581422316f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.69314698705747602f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.000000001815494f));
    __m256i biased = _mm256_castps_si256(_mm256_add_ps(n, _mm256_set1_ps(12583039.0f)));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

/* mk_softmax_strip_w16 on AVX2, 8 rows per vector; its weights are never
 * subnormal (mk_exp2_w8), so it needs no flush-to-zero */
static inline void mk_softmax_strip_w8(float *st, ptrdiff_t st_ld, ptrdiff_t lo, ptrdiff_t hi,
                                       const float *tile_max, float *row_max, float *row_sum,
                                       float *correction, const int vectors)
{
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    __m256 sub[MK_RV], sum[MK_RV];
    for (int h = 0; h < vectors; h++) {
        __m256 old_max = _mm256_loadu_ps(row_max + h * 8);
        __m256 new_max = _mm256_max_ps(old_max, _mm256_loadu_ps(tile_max + h * 8));
        __m256 unseen = _mm256_cmp_ps(new_max, neg_inf, _CMP_EQ_OQ);
        __m256 same = _mm256_or_ps(_mm256_cmp_ps(new_max, old_max, _CMP_EQ_OQ),
                                   _mm256_cmp_ps(old_max, neg_inf, _CMP_EQ_OQ));
        sub[h] = _mm256_andnot_ps(unseen, new_max);
        __m256 corr = _mm256_blendv_ps(mk_exp2_w8(_mm256_sub_ps(old_max, sub[h])),
                                       _mm256_set1_ps(1.0f), same);
        _mm256_storeu_ps(correction + h * 8, corr);
        _mm256_storeu_ps(row_max + h * 8, new_max);
        sum[h] = _mm256_mul_ps(_mm256_loadu_ps(row_sum + h * 8), corr);
    }
    for (ptrdiff_t j = lo; j < hi; j++)
        for (int h = 0; h < vectors; h++) {
            float *s = st + j * st_ld + h * 8;
            __m256 p = mk_exp2_w8(_mm256_sub_ps(_mm256_loadu_ps(s), sub[h]));
            _mm256_storeu_ps(s, p);
            sum[h] = _mm256_add_ps(sum[h], p);
        }
    for (int h = 0; h < vectors; h++) _mm256_storeu_ps(row_sum + h * 8, sum[h]);
}

/* one vector of mk_probabilities_w8: 2^(p + term - offset), 0 where term
 * is -inf or the exponent under -125 (NaN passes: the comparison is
 * unordered), min(0, x) as on AVX-512 */
static inline __attribute__((always_inline)) __m256 mk_probability_w8(__m256 score, __m256 term,
                                                                       __m256 row_offset)
{
    const __m256 zero = _mm256_setzero_ps();
    __m256 x = _mm256_sub_ps(_mm256_add_ps(score, term), row_offset);
    __m256 kept = _mm256_and_ps(_mm256_cmp_ps(term, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ),
                                _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_NLT_UQ));
    return _mm256_and_ps(kept, mk_exp2_w8(_mm256_min_ps(zero, x)));
}

/* mk_probabilities_w16 on AVX2, the same numbers (mk_exp2_w8 is
 * mk_exp2_w16's, and no result here is subnormal). The last count % 8
 * go through a vector of their own, padded with hidden keys: AMD's masked
 * stores are slow. */
static inline int mk_probabilities_w8(float *p, const float *key_term, float offset,
                                      ptrdiff_t count)
{
    const __m256 zero = _mm256_setzero_ps(), row_offset = _mm256_set1_ps(offset);
    __m256 nonzero = zero;
    ptrdiff_t c = 0;
    for (; c + 8 <= count; c += 8) {
        __m256 y = mk_probability_w8(_mm256_loadu_ps(p + c), _mm256_loadu_ps(key_term + c),
                                     row_offset);
        nonzero = _mm256_or_ps(nonzero, _mm256_cmp_ps(y, zero, _CMP_NEQ_UQ));
        _mm256_storeu_ps(p + c, y);
    }
    if (c < count) {
        float score[8] = {0}, term[8], y[8];
        for (int lane = 0; lane < 8; lane++) term[lane] = -INFINITY;
        memcpy(score, p + c, (size_t)(count - c) * sizeof *p);
        memcpy(term, key_term + c, (size_t)(count - c) * sizeof *key_term);
        __m256 last = mk_probability_w8(_mm256_loadu_ps(score), _mm256_loadu_ps(term), row_offset);
        nonzero = _mm256_or_ps(nonzero, _mm256_cmp_ps(last, zero, _CMP_NEQ_UQ));
        _mm256_storeu_ps(y, last);
        memcpy(p + c, y, (size_t)(count - c) * sizeof *p);
    }
    return _mm256_movemask_ps(nonzero) != 0;
}

#endif

#ifdef MK_F32
/* the linear family's chunk kernels (the AVX-512 decoding steps' turns use
 * them) */
#include "mk_linear.h"
#endif
/* the linear family's single-token decoding steps, at every width */
#include "mk_decode.h"
#ifdef MK_F32
#undef MK_CHUNK_COLUMNS
#undef MK_LIN_NV
#endif

#undef MK_COLUMNS_BY4
#undef MK_LAST_STRIP
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
#undef MK_HSUM
#undef MK_TARGET
#undef MK_TARGET_POP
#undef MK_PAIRS
#undef MK_F32
#undef MK_F16_VEC

#endif /* MK_W */
