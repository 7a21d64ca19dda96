/* amx.h - float32 matrix products on AMX tiles for the softmax kernel,
 * exact to float32 rounding through a three-way bfloat16 split.
 *
 * AMX multiplies bfloat16 (8 significant bits) and accumulates in float32.
 * A float32 x splits exactly into x = hi + mid + lo, three bfloat16 numbers
 * of 8 bits each (each conversion rounds to nearest; what it leaves has at
 * most 16, then 8 significant bits, so the subtractions are exact), and
 *   a b = ah bh + (ah bm + am bh) + (ah bl + al bh + am bm) + O(2^-24 |a b|)
 * so six bfloat16 products, accumulated in float32, give a b to float32
 * accuracy: at d = 128 the largest error measured against float64 was
 * 8.7e-6 where a float32 FMA loop made 2.7e-5 (|a . b| up to 53). The
 * tiles do 16 x 16 x 32 multiply-adds per instruction, so even six of them
 * beat AVX-512 float32 FMAs, about twice over (docs/performance.md, the C
 * code's choices).
 * Limits: AMX and the bfloat16 conversion treat subnormal numbers as 0, so
 * inputs under 2^-126 count as 0 and those under ~2^-110 keep fewer than 24
 * bits (their products are below 2^-220 relative to the normal ones).
 *
 * A number that is a bfloat16 value splits into hi alone: its mid and lo
 * are 0, and their products add nothing, so an operand all of whose
 * numbers are bfloat16 values (bfloat16 tensors widened, or float32 data
 * of that precision) needs its hi plane only, and a product of two such
 * operands one instruction per tile pair instead of six. The splits say
 * how many planes their operand needs; amx_product multiplies those only.
 *
 * Operands, three planes each (hi, mid, lo), `plane` numbers apart:
 *   rows   (rows, k) bfloat16, k a multiple of 32, rows `ld` numbers apart:
 *          the left operand (K for the scores, V^T for P V)
 *   pairs  (k / 2, 2 lanes) bfloat16: row p holds, for each lane (column
 *          of the product), elements 2p and 2p + 1 of that column's k
 *          vector side by side (AMX's "VNNI" layout), rows `ld` apart: the
 *          right operand (Q^T for the scores, P^T for P V)
 * A product block is 32 x 32 float32 (four 16 x 16 tiles). */
#ifndef ATTNX_AMX_H
#define ATTNX_AMX_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "microkernel.h"

/* hi, mid, lo */
#define AMX_PLANES 3

#if defined(MK_HAVE_X86) && defined(__linux__) && __GNUC__ >= 11
#define ATTNX_HAVE_AMX 1
#include <immintrin.h>
#include <math.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")

/* Every tile 16 rows of 64 bytes: the products' 16 x 16 float32 blocks and
 * 16 x 32 bfloat16 operands. Loaded by each thread before its products. */
static inline void amx_configure(void)
{
    /* byte 0 the palette, then 16 bytes-per-row (16 bits), 16 row counts */
    uint8_t config[64] __attribute__((aligned(64))) = {1};
    for (int t = 0; t < 8; t++) {
        config[16 + 2 * t] = 64;
        config[48 + t] = 16;
    }
    /* the builtin does not tell gcc that it reads the bytes */
    __asm__ volatile("" : : "r"(config) : "memory");
    _tile_loadconfig(config);
}

static inline void amx_release(void) { _tile_release(); }

/* bfloat16 bits of 16 floats (rounded to nearest), one per 32-bit lane */
static inline __m512i amx_bf16_bits(__m512 x)
{
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
}

static inline __m512 amx_bf16_value(__m512i bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }

/* the three planes of 16 floats, bits in the low half of each lane */
static inline void amx_split(__m512 x, __m512i part[AMX_PLANES])
{
    part[0] = amx_bf16_bits(x);
    __m512 rest = _mm512_sub_ps(x, amx_bf16_value(part[0]));
    part[1] = amx_bf16_bits(rest);
    part[2] = amx_bf16_bits(_mm512_sub_ps(rest, amx_bf16_value(part[1])));
}

/* the 32-bit pairs of two rows' bfloat16 bits (one per 32-bit lane): the
 * even row's in the low halves */
static inline __m512i amx_pair_bits(__m512i even, __m512i odd)
{
    return _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
}

/* the planes an operand needs: 1 when the lower ones it was split into
 * (their bits OR-ed into `lower`) are all 0 */
static inline int amx_planes_needed(__m512i lower)
{
    return _mm512_test_epi32_mask(lower, lower) ? AMX_PLANES : 1;
}

/* rows operand: dst row r, numbers [0, k_pad) <- x[r][0 .. k), zero from
 * k on, for rows [0, count) (x's rows x_row apart); rows [count,
 * rows_pad) zero. Returns the planes it needs. */
static inline int amx_split_rows(uint16_t *dst, ptrdiff_t ld, ptrdiff_t plane, const float *x,
                                 ptrdiff_t x_row, ptrdiff_t count, ptrdiff_t rows_pad, ptrdiff_t k,
                                 ptrdiff_t k_pad)
{
    __m512i lower = _mm512_setzero_si512();
    for (int s = 0; s < AMX_PLANES; s++)
        for (ptrdiff_t r = count; r < rows_pad; r++)
            memset(dst + s * plane + r * ld, 0, (size_t)k_pad * sizeof *dst);
    for (ptrdiff_t r = 0; r < count; r++)
        for (ptrdiff_t c = 0; c < k_pad; c += 16) {
            __mmask16 valid = c + 16 <= k ? (__mmask16)0xffff
                              : c < k     ? (__mmask16)((1u << (k - c)) - 1)
                                          : 0;
            __m512i part[AMX_PLANES];
            amx_split(_mm512_maskz_loadu_ps(valid, x + r * x_row + c), part);
            lower = _mm512_or_si512(lower, _mm512_or_si512(part[1], part[2]));
            for (int s = 0; s < AMX_PLANES; s++)
                _mm256_storeu_si256((__m256i *)(dst + s * plane + r * ld + c),
                                    _mm512_cvtepi32_epi16(part[s]));
        }
    return amx_planes_needed(lower);
}

/* pairs operand of 16 lanes: dst rows [0, pairs) <- rows 2p and 2p + 1 of
 * x (16 floats each, x_row apart), interleaved lane by lane: rounded to
 * bfloat16 (the hi plane alone) with planes 1, else split into all planes,
 * and then, where `needed` is not NULL, the planes the operand needs there
 * (inlined with NULL, the check costs nothing: P's is not asked for, as the
 * probabilities are hardly ever bfloat16 values) */
static inline void amx_split_pairs(uint16_t *dst, ptrdiff_t ld, ptrdiff_t plane, const float *x,
                                   ptrdiff_t x_row, ptrdiff_t pairs, int planes, int *needed)
{
    if (planes == 1) {
        for (ptrdiff_t p = 0; p < pairs; p++) {
            __m512i even = amx_bf16_bits(_mm512_loadu_ps(x + 2 * p * x_row));
            __m512i odd = amx_bf16_bits(_mm512_loadu_ps(x + (2 * p + 1) * x_row));
            _mm512_storeu_si512(dst + p * ld, amx_pair_bits(even, odd));
        }
        if (needed) *needed = 1;
        return;
    }
    __m512i lower = _mm512_setzero_si512();
    for (ptrdiff_t p = 0; p < pairs; p++) {
        __m512i even[AMX_PLANES], odd[AMX_PLANES];
        amx_split(_mm512_loadu_ps(x + 2 * p * x_row), even);
        amx_split(_mm512_loadu_ps(x + (2 * p + 1) * x_row), odd);
        for (int s = 0; s < AMX_PLANES; s++)
            _mm512_storeu_si512(dst + s * plane + p * ld, amx_pair_bits(even[s], odd[s]));
        if (needed)
            lower = _mm512_or_si512(lower, _mm512_or_si512(_mm512_or_si512(even[1], even[2]),
                                                           _mm512_or_si512(odd[1], odd[2])));
    }
    if (needed) *needed = amx_planes_needed(lower);
}

/* tiles 0-3 <- the 32 x 32 float32 block at c (rows c_ld floats apart),
 * or 0 */
static inline void amx_block_load(const float *c, ptrdiff_t c_ld, int load)
{
    const ptrdiff_t c_stride = c_ld * 4;
    if (load) {
        _tile_loadd(0, c, c_stride);
        _tile_loadd(1, c + 16, c_stride);
        _tile_loadd(2, c + 16 * c_ld, c_stride);
        _tile_loadd(3, c + 16 * c_ld + 16, c_stride);
    } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    }
}

/* the 32 x 32 float32 block at c (rows c_ld floats apart) <- tiles 0-3 */
static inline void amx_block_store(float *c, ptrdiff_t c_ld)
{
    const ptrdiff_t c_stride = c_ld * 4;
    _tile_stored(0, c, c_stride);
    _tile_stored(1, c + 16, c_stride);
    _tile_stored(2, c + 16 * c_ld, c_stride);
    _tile_stored(3, c + 16 * c_ld + 16, c_stride);
}

/* c (32 x 32, rows c_ld floats apart) = (c if accumulate, else 0) +
 * a (rows operand, rows 0-31) times b (pairs operand, lanes 0-31), over
 * `steps` x 32 of k, the next 32 of k a_step numbers on in a. The plane
 * products, each operand tile loaded once per plane pairing it serves: hi
 * with hi, mid, lo; mid with hi, mid; lo with hi; of those the first
 * a_planes of a and b_planes of b (1 or AMX_PLANES) hold. */
static inline __attribute__((always_inline)) void amx_product_planes(
    float *c, ptrdiff_t c_ld, const uint16_t *a, ptrdiff_t a_ld, ptrdiff_t a_step,
    ptrdiff_t a_plane, const int a_planes, const uint16_t *b, ptrdiff_t b_ld, ptrdiff_t b_plane,
    const int b_planes, ptrdiff_t steps, int accumulate)
{
    const ptrdiff_t a_stride = a_ld * 2, b_stride = b_ld * 2;
    amx_block_load(c, c_ld, accumulate);
    for (ptrdiff_t step = 0; step < steps; step++) {
        const uint16_t *a_at = a + step * a_step, *b_at = b + step * 16 * b_ld;
        for (int sa = 0; sa < a_planes; sa++) {
            const uint16_t *a_plane_at = a_at + sa * a_plane;
            _tile_loadd(4, a_plane_at, a_stride);
            _tile_loadd(5, a_plane_at + 16 * a_ld, a_stride);
            for (int sb = 0; sb < b_planes && sa + sb < AMX_PLANES; sb++) {
                const uint16_t *b_plane_at = b_at + sb * b_plane;
                _tile_loadd(6, b_plane_at, b_stride);
                _tile_loadd(7, b_plane_at + 32, b_stride);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
    amx_block_store(c, c_ld);
}

/* amx_product_planes with the planes as constants, so that each pairing's
 * tile loads and products are laid out in a line */
static inline void amx_product(float *c, ptrdiff_t c_ld, const uint16_t *a, ptrdiff_t a_ld,
                               ptrdiff_t a_step, ptrdiff_t a_plane, int a_planes,
                               const uint16_t *b, ptrdiff_t b_ld, ptrdiff_t b_plane, int b_planes,
                               ptrdiff_t steps, int accumulate)
{
#define AMX_PRODUCT(a_count, b_count)                                                         \
    amx_product_planes(c, c_ld, a, a_ld, a_step, a_plane, a_count, b, b_ld, b_plane, b_count, \
                       steps, accumulate)
    if (a_planes == 1 && b_planes == 1)
        AMX_PRODUCT(1, 1);
    else if (a_planes == 1)
        AMX_PRODUCT(1, AMX_PLANES);
    else if (b_planes == 1)
        AMX_PRODUCT(AMX_PLANES, 1);
    else
        AMX_PRODUCT(AMX_PLANES, AMX_PLANES);
#undef AMX_PRODUCT
}

/* c's block of `rows` rows by `vectors` x 16 columns at c_at (rows c_row
 * apart) = alpha times the product's block (rows block_ld floats apart),
 * or += where accumulate */
static inline void amx_scaled_block(float *c_at, ptrdiff_t c_row, const float *block,
                                    ptrdiff_t block_ld, int rows, int vectors, float alpha,
                                    int accumulate)
{
    const __m512 factor = _mm512_set1_ps(alpha);
    for (int r = 0; r < rows; r++)
        for (int x = 0; x < vectors; x++) {
            __m512 product = _mm512_mul_ps(_mm512_loadu_ps(block + r * block_ld + 16 * x), factor);
            float *c_rx = c_at + r * c_row + 16 * x;
            _mm512_storeu_ps(c_rx, accumulate ? _mm512_add_ps(_mm512_loadu_ps(c_rx), product)
                                              : product);
        }
}

/* c (rows, cols) = alpha a b, or c += alpha a b where accumulate, for
 * rows, cols and depth_pairs multiples of 16: a (rows, depth_pairs) and b
 * (depth_pairs, cols) bfloat16 pairs along the depth, rows a_row and
 * b_row floats apart (the layouts of the softmax backward's bfloat16 dot
 * products, mk_gemm_pairs_w16 with a_col 1: a's rows are AMX's rows
 * operand, b's pair rows its pairs operand, read in place). Blocks of 32 x
 * 32 (four tiles, each operand tile loaded once for two products), 16 x 16
 * at the edges. Where alpha is not 1 the product's blocks go through
 * `block` (1024 floats) to be scaled. Configures the tiles and releases
 * them. */
static inline void amx_gemm_pairs(ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t depth_pairs,
                                  float alpha, const float *a, ptrdiff_t a_row, const float *b,
                                  ptrdiff_t b_row, int accumulate, float *c, ptrdiff_t c_row,
                                  float *block)
{
    const ptrdiff_t a_stride = a_row * 4, b_stride = b_row * 4, c_stride = c_row * 4;
    const int in_place = alpha == 1.0f;
    amx_configure();
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += 32) {
        ptrdiff_t c0 = 0;
        if (r0 + 32 <= rows)
            for (; c0 + 32 <= cols; c0 += 32) {
                float *c_at = c + r0 * c_row + c0;
                amx_block_load(c_at, c_row, in_place && accumulate);
                for (ptrdiff_t p0 = 0; p0 < depth_pairs; p0 += 16) {
                    _tile_loadd(4, a + r0 * a_row + p0, a_stride);
                    _tile_loadd(5, a + (r0 + 16) * a_row + p0, a_stride);
                    _tile_loadd(6, b + p0 * b_row + c0, b_stride);
                    _tile_loadd(7, b + p0 * b_row + c0 + 16, b_stride);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                if (in_place) {
                    amx_block_store(c_at, c_row);
                } else {
                    amx_block_store(block, 32);
                    amx_scaled_block(c_at, c_row, block, 32, 32, 2, alpha, accumulate);
                }
            }
        /* the edges: the columns left in these 32 rows, or the last 16 rows */
        for (ptrdiff_t r = r0; r < rows && r < r0 + 32; r += 16)
            for (ptrdiff_t col = c0; col < cols; col += 16) {
                float *c_at = c + r * c_row + col;
                if (in_place && accumulate)
                    _tile_loadd(0, c_at, c_stride);
                else
                    _tile_zero(0);
                for (ptrdiff_t p0 = 0; p0 < depth_pairs; p0 += 16) {
                    _tile_loadd(4, a + r * a_row + p0, a_stride);
                    _tile_loadd(6, b + p0 * b_row + col, b_stride);
                    _tile_dpbf16ps(0, 4, 6);
                }
                if (in_place) {
                    _tile_stored(0, c_at, c_stride);
                } else {
                    _tile_stored(0, block, 64);
                    amx_scaled_block(c_at, c_row, block, 16, 16, 1, alpha, accumulate);
                }
            }
    }
    amx_release();
}

/* The scores block st[j][r] for keys [c0, c0 + 32), rows [r0, r0 + 32)
 * of the tile, as the product left it (q . k): times `scale`, plus each
 * key's term (a key whose term is -inf scores -inf, whatever q . k is),
 * hide what the band hides and raise the rows' tile_max. The scale is
 * applied here, not to Q, so that queries that are bfloat16 values stay
 * one plane. */
static inline void amx_finish_scores(const mk_tile *t, float *st, ptrdiff_t st_ld, ptrdiff_t r0,
                                     ptrdiff_t c0, float scale, const float *key_term,
                                     float *tile_max)
{
    const __m512 factor = _mm512_set1_ps(scale);
    ptrdiff_t all_lo, all_hi;
    mk_block_all_keys(t, r0, 32, &all_lo, &all_hi);
    int whole = all_lo <= c0 && c0 + 32 <= all_hi && c0 + 32 <= t->cols;
    __m512 max_lo = _mm512_loadu_ps(tile_max + r0), max_hi = _mm512_loadu_ps(tile_max + r0 + 16);
    for (ptrdiff_t j = c0; j < c0 + 32; j++) {
        float *s_j = st + j * st_ld + r0;
        __m512 term = _mm512_set1_ps(key_term[j]);
        __m512 lo = key_term[j] == -INFINITY ? term
                                             : _mm512_fmadd_ps(_mm512_loadu_ps(s_j), factor, term);
        __m512 hi = key_term[j] == -INFINITY
                        ? term
                        : _mm512_fmadd_ps(_mm512_loadu_ps(s_j + 16), factor, term);
        _mm512_storeu_ps(s_j, lo);
        _mm512_storeu_ps(s_j + 16, hi);
        max_lo = _mm512_max_ps(max_lo, lo);
        max_hi = _mm512_max_ps(max_hi, hi);
    }
    if (whole) {
        _mm512_storeu_ps(tile_max + r0, max_lo);
        _mm512_storeu_ps(tile_max + r0 + 16, max_hi);
    } else {
        mk_hide_and_max_w16(t, st, st_ld, r0, 32, c0, 32, tile_max);
    }
}

/* ot's columns [r0, r0 + 32), rows [0, e), times the rows' correction,
 * unless it is 1 for all of them */
static inline void amx_rescale(float *ot, ptrdiff_t ot_ld, ptrdiff_t e, const float *correction)
{
    __m512 lo = _mm512_loadu_ps(correction), hi = _mm512_loadu_ps(correction + 16);
    __mmask16 ones = _mm512_cmp_ps_mask(lo, _mm512_set1_ps(1.0f), _CMP_EQ_OQ) &
                     _mm512_cmp_ps_mask(hi, _mm512_set1_ps(1.0f), _CMP_EQ_OQ);
    if (ones == 0xffff) return;
    for (ptrdiff_t c = 0; c < e; c++) {
        _mm512_storeu_ps(ot + c * ot_ld, _mm512_mul_ps(_mm512_loadu_ps(ot + c * ot_ld), lo));
        _mm512_storeu_ps(ot + c * ot_ld + 16, _mm512_mul_ps(_mm512_loadu_ps(ot + c * ot_ld + 16), hi));
    }
}

#pragma GCC pop_options
#endif /* AMX */
#endif /* ATTNX_AMX_H */
