/* softmax_backward.c - the gradient of softmax attention, FlashAttention-2
 * style: the probabilities are recomputed tile by tile from the forward's
 * lse, so nothing of size n * m is ever held.
 *
 * Forward (per head, over the visible keys):
 *   s_ij = scale q_i.k_j + bias_ij + coef |k_j|^2    (coef: gaussian, else 0)
 *   p_ij = exp(s_ij - lse_i),   o_i = sum_j p_ij v_j
 * Backward, with D_i = sum_c dO_ic O_ic:
 *   dV_j = sum_i p_ij dO_i            (from o_i = sum_j p_ij v_j)
 *   dP_ij = dO_i . v_j
 *   dS_ij = p_ij (dP_ij - D_i)        (the softmax's Jacobian)
 *   dQ_i = scale sum_j dS_ij k_j
 *   dK_j = scale sum_i dS_ij q_i + 2 coef (sum_i dS_ij) k_j
 *   dbias_ij = dS_ij
 * With dropout, o_i = sum_j p_ij z_ij v_j where z_ij = keep_ij / (1 - p_drop)
 * (philox.h regenerates keep): dV_j = sum_i p_ij z_ij dO_i and
 * dS_ij = p_ij z_ij dP_ij - p_ij D_i.
 * Gaussian attention's lse includes the query's own term coef |q_i|^2; it
 * is taken off again here, and contributes no gradient: sum_j dS_ij =
 * D_i - D_i sum_j p_ij = 0.
 *
 * Work: each head's key blocks are split into `groups` (a number fixed by
 * the shape alone, never by the thread count) of interleaved blocks; a work
 * item is one (head, group). An item owns the dK, dV rows of its key blocks
 * and walks the query blocks that see them in order, so every sum has one
 * fixed order: the results do not depend on the threads or on scheduling.
 * dQ gets one partial per group, added in group order at the end (with one
 * group, the item adds into dq directly).
 *
 * float32 on AVX-512 with the bfloat16 dot products (the avx512_bf16 set,
 * dispatch.h; microkernel.h): the two products whose operands are both inputs, the
 * scores Q K^T and dP = dO V^T, run on pairs of bfloat16 values where a
 * block's operands all are bfloat16 values (as tensors widened from
 * bfloat16 are; the output gradient too, when it was bfloat16); the other
 * three take p or dS, which are not, and stay float32, unless the caller
 * asks for bfloat16 arithmetic (bf16_products, attnx.h: attnx.torch's
 * bfloat16 tensors): then p and dS are rounded to bfloat16
 * (mk_pair_rows_rounded; dS in the pass that computes it,
 * mk_score_grads_pairs_w16) and dV, dK, dQ run on the pairs too, where the
 * block's Q, dO and K are bfloat16 values. Each key block and (once per
 * work item) each query block is put in pair rows, which tells whether its
 * numbers all are bfloat16 values. The amx set runs the same products on
 * AMX tiles instead (amx.h's amx_gemm_pairs, reading those pair rows in
 * place: bwd_pairs_gemm), and float32's on FMAs.
 *
 * Legend: n queries, m keys, d features, e value features;
 *   pt  (BR, BC)  log2-unit scores, then p, of a query block x key block
 *   ptd (BR, BC)  p z, the dropped weights (pt itself without dropout)
 *   dpt (BR, BC)  dP, then dS
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "amx.h" /* ATTNX_HAVE_AMX */
#include "attnx.h"
#include "blas.h"
#include "convert.h"
#include "cpu_features.h"
#include "philox.h"
#include "softmax_internal.h"

/* Query and key blocks: the five products of a block pair are (side x
 * side) by d or e, and the pair's tiles are side x side. The side is 128,
 * or 64 on a CPU whose cores have less than 1 MiB of L2 (AMD's before Zen
 * 4, Intel's client cores before Alder Lake): a pair of 128 touches about
 * 450 KiB at d = e = 64 (its tiles, K^T and V^T, the blocks of Q, dO, K, V,
 * dQ, dK and dV), which does not stay in their L2 (docs/performance.md,
 * "The C code's choices"). (Measured on BLAS, one thread, n = 2048, d =
 * 64: 128 x 128, 128 x 256, 256 x 128, 192 x 192 and 256 x 256 all within
 * 4%.) */
#define SIDE 128
#define SMALL_L2_SIDE 64
#define SMALL_L2_BYTES (1L << 20)

static ptrdiff_t held_side = 0; /* attnx_softmax_bwd_set_block's; 0: by the cache */

ptrdiff_t attnx_softmax_bwd_block(void)
{
    if (held_side) return held_side;
    long l2 = attnx_cpu_l2_bytes();
    return l2 > 0 && l2 < SMALL_L2_BYTES ? SMALL_L2_SIDE : SIDE;
}

ptrdiff_t attnx_softmax_bwd_set_block(ptrdiff_t side)
{
    ptrdiff_t before = held_side;
    held_side = side;
    return before;
}

/* Work items per call to aim for when a call has few heads: enough to keep
 * a few threads busy (and to balance causal work), few enough that the
 * per-group dQ partials stay small. */
#define TARGET_ITEMS 8

/* bwd_work's block_pairs: a query block paired along its rows, its Q, its
 * dO exact; its rows paired (q_block_rows, dout_block_rows) */
enum { PAIRED = 1, Q_EXACT = 2, DOUT_EXACT = 4, ROWS_PAIRED = 8 };

#define ATTNX_FAMILY_FILE "softmax_backward.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */
#include "softmax_internal.h"

#define LOG2E ((REAL)1.44269504088896340736)

/* The five products without BLAS (whose kernels may be chosen for a
 * lesser CPU: OPENBLAS_CORETYPE) where the softmax backward's table chose a
 * set with register-blocked kernels (dispatch.h) and d, e are whole vectors
 * of it: mk_gemm (mk_backward.h) of the set's width (attnx_kernels_width),
 * c (rows, cols) = alpha a b or c += alpha a b, a's element (r, p) at
 * a[r a_row + p a_col], b's rows b_row apart, cols a whole number of
 * vectors. Direct calls, so that gcc specialises each kernel for the
 * constant arguments of the calls (a_col, b_row, accumulate). */
static inline __attribute__((always_inline)) void SFX(bwd_gemm)(
    int width, ptrdiff_t rows, ptrdiff_t cols, ptrdiff_t depth, REAL alpha, const REAL *a,
    ptrdiff_t a_row, ptrdiff_t a_col, const REAL *b, ptrdiff_t b_row, int accumulate, REAL *c,
    ptrdiff_t c_row)
{
#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
    TYPED(mk_gemm_f32, mk_gemm_f64)(width, rows, cols, depth, alpha, a, a_row, a_col, b, b_row,
                                    accumulate, c, c_row);
#endif
}

#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
/* float32 on AVX-512 with the bfloat16 dot products (mk_gemm_pairs_w16) */
#define BWD_PAIRS 1
#endif

/* One thread's working memory. */
typedef struct {
    REAL *pt, *dpt;        /* (side, side) */
    REAL *key_term;        /* (side) per-key addend of the scores, log2 units; -inf: hidden */
    REAL *col_sum;         /* (side) sum_i dS_ij (gaussian) */
    ptrdiff_t side;        /* the call's query and key block side (attnx_softmax_bwd_block) */
    int width;             /* bwd_gemm's kernels (float32 lanes); 0: the products run on BLAS */
    ptrdiff_t lanes;       /* their numbers per vector */
    REAL *kt, *vt;         /* (d, side), (e, side): the key block's K^T, V^T for bwd_gemm,
                            * keys past the block 0 */
    REAL *ptd;             /* (side, side) with dropout, else pt */
    unsigned char *keep;   /* (side) one row's dropout decisions */
    /* the bfloat16 dot products (float32 with bwd_gemm); kt_pairs NULL: none */
    float *kt_pairs, *vt_pairs;    /* (d / 2, side), (e / 2, side): kt, vt in pair rows */
    float *q_pairs, *dout_pairs;   /* (n, d / 2), (n, e / 2): the item's Q, dO paired along
                                    * their rows, by query block as needed */
    unsigned char *block_pairs;    /* per query block: 0 not paired yet, else PAIRED and
                                    * which of Q_EXACT, DOUT_EXACT hold */
    int k_exact, v_exact;          /* the key block's K, V are all bfloat16 values */
    int q_exact, dout_exact;       /* the same of the query block at hand */
    /* the caller's bfloat16 arithmetic (bf16_products): the products of p
     * and dS on pairs too; pd_pairs NULL: not asked for */
    float *pd_pairs, *ds_pairs;    /* (side / 2, side): ptd, dS rounded, query rows paired */
    float *ds_along;               /* (side, side / 2): dS rounded, paired along its rows */
    float *q_rows, *dout_rows;     /* (side / 2, d), (side / 2, e): the query rows' Q, dO paired,
                                    * where they start at an odd row of their block */
    float *q_block_rows, *dout_block_rows; /* (n + side) / 2 pair rows of d, e: the item's
                                            * query blocks' Q, dO paired across rows, by
                                            * block as needed */
    float *k_rows;                 /* (side / 2, d): the key block's K, keys paired */
    int k_rows_exact;              /* its keys are all bfloat16 values */
    /* the key block's K and V rows, k_row and v_row apart: in place, or
     * (kv_half) widened from their half-precision bits into k_block, v_block
     * ((side, d), (side, e)), once per block */
    const REAL *k_j, *v_j;
    ptrdiff_t k_row, v_row;
    REAL *k_block, *v_block;
    /* the products on pairs on AMX (the amx set) rather than VDPBF16PS:
     * a_pairs (side, side / 2) holds an operand read transposed (p, dS)
     * in AMX's rows, block (1024) a 32 x 32 product to scale; a_pairs
     * NULL: VDPBF16PS */
    float *a_pairs, *block;
} SFX(bwd_work);

#ifdef BWD_PAIRS
/* mk_gemm_pairs_w16's product, on AMX where the amx set runs the backward:
 * its whole tiles (16 rows by 16 pairs of depth) on the tiles, the rows
 * and depth left over on VDPBF16PS; an a read transposed (a_col not 1) is
 * laid out in rows first. */
static void SFX(bwd_pairs_gemm)(const SFX(bwd_work) *w, ptrdiff_t rows, ptrdiff_t cols,
                                ptrdiff_t depth_pairs, float alpha, const float *a,
                                ptrdiff_t a_row, ptrdiff_t a_col, const float *b, ptrdiff_t b_row,
                                int accumulate, float *c, ptrdiff_t c_row)
{
#ifdef ATTNX_HAVE_AMX
    if (w->a_pairs) {
        if (a_col != 1) {
            SFX(mk_transpose)(w->a_pairs, w->side / 2, a, a_col, depth_pairs, rows, 16);
            a = w->a_pairs;
            a_row = w->side / 2;
            a_col = 1;
        }
        ptrdiff_t tile_rows = rows / 16 * 16, tile_depth = depth_pairs / 16 * 16;
        if (tile_rows && tile_depth) {
            amx_gemm_pairs(tile_rows, cols, tile_depth, alpha, a, a_row, b, b_row, accumulate, c,
                           c_row, w->block);
            if (depth_pairs > tile_depth)
                mk_gemm_pairs_w16(tile_rows, cols, depth_pairs - tile_depth, alpha, a + tile_depth,
                                  a_row, 1, b + tile_depth * b_row, b_row, 1, c, c_row);
            rows -= tile_rows;
            a += tile_rows * a_row;
            c += tile_rows * c_row;
        }
        if (rows)
            mk_gemm_pairs_w16(rows, cols, depth_pairs, alpha, a, a_row, 1, b, b_row, accumulate, c,
                              c_row);
        return;
    }
#endif
    mk_gemm_pairs_w16(rows, cols, depth_pairs, alpha, a, a_row, a_col, b, b_row, accumulate, c,
                      c_row);
}
#endif

/* The operands of one head, positioned once. */
typedef struct {
    const REAL *q, *k, *v, *out, *lse, *dout, *bias;
    const unsigned char *mask;
    REAL *dq, *dk, *dv, *dbias;
    REAL *row_delta;       /* (n) D_i */
    REAL *row_offset;      /* (n) lse_i - coef |q_i|^2, log2 units; +inf: row sees nothing */
    unsigned char *q_bad;  /* per query block: Q or dO holds inf or NaN */
    ptrdiff_t index;       /* the head's flat index (the dropout counter's) */
} SFX(bwd_head);

/* Per head: D_i = dO_i . O_i and the offset each row's scores lose,
 * lse_i (less the gaussian query term) in log2 units; which query blocks
 * hold a non-finite query or output gradient. */
static void SFX(bwd_rows)(const attnx_softmax_args *a, SFX(bwd_head) *h, ptrdiff_t dout_row,
                          ptrdiff_t side)
{
    for (ptrdiff_t i = 0; i < a->n; i++) {
        const REAL *o_i = h->out + i * a->out_row, *do_i = h->dout + i * dout_row;
        REAL delta = 0;
#pragma omp simd reduction(+ : delta)
        for (ptrdiff_t c = 0; c < a->e; c++) delta += do_i[c] * o_i[c];
        h->row_delta[i] = delta;
    }
    /* the gaussian query term coef |q_i|^2, into row_offset first */
    if (a->key_sqnorm_coef != 0)
        SFX(softmax_sqnorm_terms)(h->row_offset, h->q, a->q_row, a->n, a->d,
                                  (REAL)a->key_sqnorm_coef);
    for (ptrdiff_t i = 0; i < a->n; i++) {
        REAL lse = h->lse[i] - (a->key_sqnorm_coef != 0 ? h->row_offset[i] : 0);
        /* a row that saw nothing (lse -inf) gets p = 2^-inf = 0 */
        h->row_offset[i] = lse == -(REAL)INFINITY ? (REAL)INFINITY : lse * LOG2E;
    }
    for (ptrdiff_t b = 0; b * side < a->n; b++) {
        ptrdiff_t i0 = b * side, rows = ATTNX_MIN(side, a->n - i0);
        h->q_bad[b] = SFX(has_nonfinite)(h->q + i0 * a->q_row, rows, a->d, a->q_row) ||
                      SFX(has_nonfinite)(h->dout + i0 * dout_row, rows, a->e, dout_row);
    }
}

/* pt <- p of rows [i0, i0 + rows) x keys [j0, j0 + cols) from the scores
 * it holds: 0 where the band, a mask or the row's emptiness hides the key
 * (whatever the score: a hidden NaN must not reach the gradients); returns
 * whether any p is non-zero. */
static ATTNX_HOT int SFX(bwd_probabilities)(const attnx_softmax_args *a, const SFX(bwd_head) *h,
                                            SFX(bwd_work) *w, ptrdiff_t i0, ptrdiff_t rows,
                                            ptrdiff_t j0, ptrdiff_t cols)
{
    const ptrdiff_t side = w->side;
    REAL *pt = w->pt;
    const REAL *key_term = w->key_term;
    const REAL neg_inf = -(REAL)INFINITY;
    int per_query_bias = h->bias && !softmax_bias_per_key(a);
    int per_query_mask = h->mask && !softmax_mask_per_key(a);
    int any = 0;
    for (ptrdiff_t r = 0; r < rows; r++) {
        ptrdiff_t i = i0 + r;
        REAL *p_r = pt + r * side, offset = h->row_offset[i];
        ptrdiff_t lo = attnx_band_first(&a->band, i) - j0, hi = attnx_band_end(&a->band, i) - j0;
        lo = lo < 0 ? 0 : (lo > cols ? cols : lo);
        hi = hi < lo ? lo : (hi > cols ? cols : hi);
        for (ptrdiff_t c = 0; c < lo; c++) p_r[c] = 0;
        for (ptrdiff_t c = hi; c < cols; c++) p_r[c] = 0;
        if (per_query_bias) {
            const REAL *bias_i = h->bias + i * a->bias_row + j0 * a->bias_col;
            for (ptrdiff_t c = lo; c < hi; c++) p_r[c] += LOG2E * bias_i[c * a->bias_col];
        }
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
        if (w->width == 16)
            any |= mk_probabilities_w16(p_r + lo, key_term + lo, offset, hi - lo);
        else if (w->width == 8)
            any |= mk_probabilities_w8(p_r + lo, key_term + lo, offset, hi - lo);
        else
#endif
        {
#pragma omp simd reduction(| : any)
            for (ptrdiff_t c = lo; c < hi; c++) {
                REAL p = SFX(vexp2)(p_r[c] + key_term[c] - offset);
                p_r[c] = key_term[c] == neg_inf ? 0 : p;
                any |= p_r[c] != 0;
            }
        }
        if (per_query_mask) {
            const unsigned char *mask_i = h->mask + i * a->mask_row + j0 * a->mask_col;
            for (ptrdiff_t c = lo; c < hi; c++)
                if (!mask_i[c * a->mask_col]) p_r[c] = 0;
        }
        if (w->ptd != pt) {
            /* the forward's dropped weights p z, from the same decisions */
            REAL *pd_r = w->ptd + r * side, kept = (REAL)(1 / (1 - a->dropout_p));
            attnx_dropout_row(a->seed, (uint64_t)h->index, (uint64_t)i, (uint64_t)j0, cols,
                              attnx_dropout_threshold(a->dropout_p), w->keep);
            for (ptrdiff_t c = 0; c < cols; c++) pd_r[c] = w->keep[c] ? p_r[c] * kept : 0;
        }
    }
    return any;
}

/* dpt <- dS = pd dP - p D_i (pd = p z, or p without dropout), exactly 0
 * where p is (dP may be anything there, NaN included) */
static ATTNX_HOT void SFX(bwd_score_grads)(REAL *dpt, const REAL *pt, const REAL *ptd,
                                           const REAL *row_delta, ptrdiff_t rows, ptrdiff_t cols,
                                           ptrdiff_t side)
{
    for (ptrdiff_t r = 0; r < rows; r++) {
        REAL *ds_r = dpt + r * side, delta = row_delta[r];
        const REAL *p_r = pt + r * side, *pd_r = ptd + r * side;
#pragma omp simd
        for (ptrdiff_t c = 0; c < cols; c++)
            ds_r[c] = p_r[c] == 0 ? 0 : pd_r[c] * ds_r[c] - p_r[c] * delta;
    }
}

/* acc (rows, width) += alpha x (rows, cols) y (cols, width) over the
 * non-zero entries of x only: the products for blocks holding inf or NaN,
 * where 0 * NaN would carry a hidden key's NaN into other rows' gradients.
 * x_row, y_row, acc_row: row strides; x_col: x's column stride. */
static void SFX(add_products_skipping_zeros)(REAL *acc, ptrdiff_t acc_row, const REAL *x,
                                             ptrdiff_t x_row, ptrdiff_t x_col, const REAL *y,
                                             ptrdiff_t y_row, ptrdiff_t rows, ptrdiff_t cols,
                                             ptrdiff_t width, REAL alpha)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < cols; c++) {
            REAL x_rc = x[r * x_row + c * x_col];
            if (x_rc == 0) continue;
            for (ptrdiff_t w = 0; w < width; w++) acc[r * acc_row + w] += alpha * x_rc * y[c * y_row + w];
        }
}

#ifdef BWD_PAIRS
/* The query block from block_start (a multiple of the side) with its rows paired
 * (q_block_rows, dout_block_rows), the first time the item needs them;
 * returns whether its Q and dO all are bfloat16 values (bwd_pair_queries,
 * which paired the block along its rows, found out) */
static int SFX(bwd_pair_query_rows)(const attnx_softmax_args *a, const SFX(bwd_head) *h,
                                    SFX(bwd_work) *w, ptrdiff_t block_start, ptrdiff_t dout_row)
{
    unsigned char *state = &w->block_pairs[block_start / w->side];
    if (!(*state & Q_EXACT) || !(*state & DOUT_EXACT)) return 0;
    if (!(*state & ROWS_PAIRED)) {
        ptrdiff_t rows = ATTNX_MIN(w->side, a->n - block_start);
        mk_pair_rows(w->q_block_rows + block_start / 2 * a->d, a->d,
                     h->q + block_start * a->q_row, a->q_row, rows, a->d);
        mk_pair_rows(w->dout_block_rows + block_start / 2 * a->e, a->e,
                     h->dout + block_start * dout_row, dout_row, rows, a->e);
        *state |= ROWS_PAIRED;
    }
    return 1;
}
#endif

/* One query block x key block: the five products and the elementwise
 * passes between them. dq_i: the rows' dQ (item's partial or dq itself). */
static void SFX(bwd_block_pair)(const attnx_softmax_args *a, const SFX(bwd_head) *h,
                                SFX(bwd_work) *w, ptrdiff_t i0, ptrdiff_t rows, ptrdiff_t j0,
                                ptrdiff_t cols, int nonfinite, REAL *dq_i, ptrdiff_t dq_row,
                                ptrdiff_t dout_row, ptrdiff_t dk_row, ptrdiff_t dv_row,
                                ptrdiff_t dbias_row)
{
    const ptrdiff_t side = w->side;
    const ptrdiff_t d = a->d, e = a->e;
    const REAL scale = (REAL)a->scale;
    const REAL *q_i = h->q + i0 * a->q_row, *do_i = h->dout + i0 * dout_row;
    const REAL *k_j = w->k_j, *v_j = w->v_j;
    const ptrdiff_t k_row = w->k_row, v_row = w->v_row;
    REAL *dk_j = h->dk + j0 * dk_row, *dv_j = h->dv + j0 * dv_row;

    /* with bwd_gemm, the score and dP columns are whole vectors (K^T and
     * V^T are 0 past the block's keys); only the first `cols` are used */
    const int mk = w->width != 0 && !nonfinite;
    const ptrdiff_t cols_pad = mk ? (cols + w->lanes - 1) / w->lanes * w->lanes : cols;

    /* the products of two inputs by the bfloat16 dot products, where both
     * blocks hold bfloat16 values only (w's flags; pairs with bwd_gemm only) */
#ifdef BWD_PAIRS
    const int score_pairs = mk && w->kt_pairs && w->q_exact && w->k_exact;
    const int dp_pairs = mk && w->kt_pairs && w->dout_exact && w->v_exact;
#endif

    /* pass 1: scores in log2 units, then p */
#ifdef BWD_PAIRS
    if (score_pairs)
        SFX(bwd_pairs_gemm)(w, rows, cols_pad, d / 2, scale * LOG2E, w->q_pairs + i0 * (d / 2),
                            d / 2, 1, w->kt_pairs, side, 0, w->pt, side);
    else
#endif
    if (mk)
        SFX(bwd_gemm)(w->width, rows, cols_pad, d, scale * LOG2E, q_i, a->q_row, 1, w->kt, side, 0,
                      w->pt, side);
    else
        SFX(gemm)(0, 1, rows, cols, d, scale * LOG2E, q_i, a->q_row, k_j, k_row, 0, w->pt, side);
    if (!SFX(bwd_probabilities)(a, h, w, i0, rows, j0, cols)) {
        if (h->dbias)
            for (ptrdiff_t r = 0; r < rows; r++)
                memset(h->dbias + (i0 + r) * dbias_row + j0, 0, (size_t)cols * sizeof(REAL));
        return;
    }
    /* the caller's bfloat16 arithmetic (bf16_products): p and dS rounded to
     * bfloat16 and their three products on pairs too, where Q, dO and K
     * are bfloat16 values (so that pairing them is exact) */
#ifdef BWD_PAIRS
    int rounded = mk && w->pd_pairs && w->k_rows_exact;
    const float *q_rows = NULL, *dout_rows = NULL;
    if (rounded) {
        /* the block's paired rows from i0 on, where i0 starts a pair of
         * them; else the rows paired here */
        ptrdiff_t block_start = i0 - i0 % side;
        if ((i0 - block_start) % 2 == 0 && SFX(bwd_pair_query_rows)(a, h, w, block_start,
                                                                     dout_row)) {
            q_rows = w->q_block_rows + i0 / 2 * d;
            dout_rows = w->dout_block_rows + i0 / 2 * e;
        } else if ((i0 - block_start) % 2 != 0 &&
                   mk_pair_rows(w->q_rows, d, q_i, a->q_row, rows, d) &&
                   mk_pair_rows(w->dout_rows, e, do_i, dout_row, rows, e)) {
            q_rows = w->q_rows;
            dout_rows = w->dout_rows;
        } else {
            rounded = 0;
        }
    }
#endif
    if (mk) {
        /* dV_j += P^T dO_i;  dP = dO_i V_j^T */
#ifdef BWD_PAIRS
        if (rounded) {
            mk_pair_rows_rounded(w->pd_pairs, side, w->ptd, side, rows, cols);
            SFX(bwd_pairs_gemm)(w, cols, e, (rows + 1) / 2, 1, w->pd_pairs, 1, side, dout_rows, e,
                                1, dv_j, dv_row);
        } else
#endif
        SFX(bwd_gemm)(w->width, cols, e, rows, 1, w->ptd, 1, side, do_i, dout_row, 1, dv_j,
                      dv_row);
#ifdef BWD_PAIRS
        if (dp_pairs)
            SFX(bwd_pairs_gemm)(w, rows, cols_pad, e / 2, 1, w->dout_pairs + i0 * (e / 2), e / 2, 1,
                                w->vt_pairs, side, 0, w->dpt, side);
        else
#endif
        SFX(bwd_gemm)(w->width, rows, cols_pad, e, 1, do_i, dout_row, 1, w->vt, side, 0, w->dpt,
                      side);
    } else
    if (!nonfinite) {
        SFX(gemm)(1, 0, cols, e, rows, 1, w->ptd, side, do_i, dout_row, 1, dv_j, dv_row);
        SFX(gemm)(0, 1, rows, cols, e, 1, do_i, dout_row, v_j, v_row, 0, w->dpt, side);
    } else {
        SFX(add_products_skipping_zeros)(dv_j, dv_row, w->ptd, 1, side, do_i, dout_row, cols, rows,
                                         e, 1);
        for (ptrdiff_t r = 0; r < rows; r++)
            for (ptrdiff_t c = 0; c < cols; c++) {
                REAL dp = 0;
                if (w->pt[r * side + c] != 0)
                    for (ptrdiff_t x = 0; x < e; x++) dp += do_i[r * dout_row + x] * v_j[c * v_row + x];
                w->dpt[r * side + c] = dp;
            }
    }
    /* pass 2: dS, rounded and paired for its products on pairs */
#ifdef BWD_PAIRS
    if (rounded)
        mk_score_grads_pairs_w16(w->dpt, w->pt, w->ptd, h->row_delta + i0, rows, cols, side,
                                 w->ds_pairs, w->ds_along);
    else
#endif
    SFX(bwd_score_grads)(w->dpt, w->pt, w->ptd, h->row_delta + i0, rows, cols, side);
    if (h->dbias)
        for (ptrdiff_t r = 0; r < rows; r++)
            memcpy(h->dbias + (i0 + r) * dbias_row + j0, w->dpt + r * side,
                   (size_t)cols * sizeof(REAL));
    if (a->key_sqnorm_coef != 0)
        for (ptrdiff_t r = 0; r < rows; r++)
            for (ptrdiff_t c = 0; c < cols; c++) w->col_sum[c] += w->dpt[r * side + c];
    /* dK_j += scale dS^T Q_i;  dQ_i += scale dS K_j */
#ifdef BWD_PAIRS
    if (rounded) {
        SFX(bwd_pairs_gemm)(w, cols, d, (rows + 1) / 2, scale, w->ds_pairs, 1, side, q_rows, d, 1,
                            dk_j, dk_row);
        SFX(bwd_pairs_gemm)(w, rows, d, (cols + 1) / 2, scale, w->ds_along, side / 2, 1, w->k_rows,
                            d, 1, dq_i, dq_row);
    } else
#endif
    if (mk) {
        SFX(bwd_gemm)(w->width, cols, d, rows, scale, w->dpt, 1, side, q_i, a->q_row, 1, dk_j,
                      dk_row);
        SFX(bwd_gemm)(w->width, rows, d, cols, scale, w->dpt, side, 1, k_j, k_row, 1, dq_i,
                      dq_row);
    } else
    if (!nonfinite) {
        SFX(gemm)(1, 0, cols, d, rows, scale, w->dpt, side, q_i, a->q_row, 1, dk_j, dk_row);
        SFX(gemm)(0, 0, rows, d, cols, scale, w->dpt, side, k_j, k_row, 1, dq_i, dq_row);
    } else {
        SFX(add_products_skipping_zeros)(dk_j, dk_row, w->dpt, 1, side, q_i, a->q_row, cols, rows,
                                         d, scale);
        SFX(add_products_skipping_zeros)(dq_i, dq_row, w->dpt, side, 1, k_j, k_row, rows, cols,
                                         d, scale);
    }
}

/* dst (features, side) <- x (count, features) transposed, columns from count
 * to side 0, by the forward's blocked transpose for the kernels' width */
static void SFX(transpose_padded)(REAL *dst, const REAL *x, ptrdiff_t x_row, ptrdiff_t count,
                                  ptrdiff_t features, ptrdiff_t side, int width)
{
    SFX(mk_transpose)(dst, side, x, x_row, count, features, width);
    if (count < side)
        for (ptrdiff_t c = 0; c < features; c++)
            memset(dst + c * side + count, 0, (size_t)(side - count) * sizeof(REAL));
}

/* The rows [first, end) of queries that see some key of [j0, j0 + cols):
 * the band is monotone in i, so they are contiguous. */
static void SFX(bwd_query_range)(const attnx_band *band, ptrdiff_t n, ptrdiff_t j0,
                                 ptrdiff_t cols, ptrdiff_t *first, ptrdiff_t *end)
{
    ptrdiff_t lo = 0, hi = n;
    if (band->has_hi) {
        /* j0 <= i + hi_shift */
        ptrdiff_t i = j0 - band->hi_shift;
        lo = i < 0 ? 0 : (i > n ? n : i);
    }
    if (band->has_lo) {
        /* i + lo_shift <= j0 + cols - 1 */
        ptrdiff_t i = j0 + cols - 1 - band->lo_shift + 1;
        hi = i < 0 ? 0 : (i > n ? n : i);
    }
    *first = lo;
    *end = hi < lo ? lo : hi;
}

#ifdef BWD_PAIRS
/* The query block from i0 (a multiple of the side) in pair rows, the first time
 * the item needs it, and w's flags for it */
static void SFX(bwd_pair_queries)(const attnx_softmax_args *a, const SFX(bwd_head) *h,
                                  SFX(bwd_work) *w, ptrdiff_t i0, ptrdiff_t dout_row)
{
    unsigned char *state = &w->block_pairs[i0 / w->side];
    if (!*state) {
        int q_exact = 1, dout_exact = 1;
        for (ptrdiff_t i = i0; i < ATTNX_MIN(i0 + w->side, a->n); i++) {
            q_exact &= mk_pair_along(w->q_pairs + i * (a->d / 2), h->q + i * a->q_row, a->d);
            dout_exact &= mk_pair_along(w->dout_pairs + i * (a->e / 2), h->dout + i * dout_row,
                                        a->e);
        }
        *state = PAIRED | (q_exact ? Q_EXACT : 0) | (dout_exact ? DOUT_EXACT : 0);
    }
    w->q_exact = (*state & Q_EXACT) != 0;
    w->dout_exact = (*state & DOUT_EXACT) != 0;
}
#endif

/* w's k_j, v_j: the rows of the key block [j0, j0 + cols), in place or
 * widened from their half-precision bits into the thread's k_block,
 * v_block (in L1, where a widened copy of the whole of k and v went
 * through memory) */
static void SFX(bwd_key_block)(const attnx_softmax_args *a, const SFX(bwd_head) *h,
                               SFX(bwd_work) *w, ptrdiff_t j0, ptrdiff_t cols)
{
#if !REAL_IS_DOUBLE
    if (a->kv_half) {
        attnx_widen_rows(w->k_block, a->d, (const uint16_t *)h->k + j0 * a->k_row, a->k_row, cols,
                         a->d, (attnx_half_format)a->kv_half);
        attnx_widen_rows(w->v_block, a->e, (const uint16_t *)h->v + j0 * a->v_row, a->v_row, cols,
                         a->e, (attnx_half_format)a->kv_half);
        w->k_j = w->k_block;
        w->v_j = w->v_block;
        w->k_row = a->d;
        w->v_row = a->e;
        return;
    }
#endif
    w->k_j = h->k + j0 * a->k_row;
    w->v_j = h->v + j0 * a->v_row;
    w->k_row = a->k_row;
    w->v_row = a->v_row;
}

/* Work item: key blocks group, group + groups, ... of one head; it stops
 * between key blocks when the call is interrupted (calling_thread: this
 * thread polls for it). */
static void SFX(bwd_item)(const attnx_softmax_bwd_args *b, const SFX(bwd_head) *h,
                          SFX(bwd_work) *w, ptrdiff_t group, ptrdiff_t groups, REAL *dq,
                          ptrdiff_t dq_row, int calling_thread)
{
    const attnx_softmax_args *a = &b->fwd;
    const ptrdiff_t side = w->side, key_blocks = (a->m + side - 1) / side;
    if (w->block_pairs) memset(w->block_pairs, 0, (size_t)((a->n + side - 1) / side));
    for (ptrdiff_t kb = group; kb < key_blocks; kb += groups) {
        if (attnx_interrupted(a->interrupt, calling_thread)) return;
        ptrdiff_t j0 = kb * side, cols = ATTNX_MIN(side, a->m - j0);
        for (ptrdiff_t c = 0; c < cols; c++) {
            memset(h->dk + (j0 + c) * b->dk_row, 0, (size_t)a->d * sizeof(REAL));
            memset(h->dv + (j0 + c) * b->dv_row, 0, (size_t)a->e * sizeof(REAL));
            w->col_sum[c] = 0;
        }
        SFX(softmax_fill_key_term)(a, w->key_term, h->k, h->bias, h->mask, j0, cols, cols);
        SFX(bwd_key_block)(a, h, w, j0, cols);
        if (w->width) {
            SFX(transpose_padded)(w->kt, w->k_j, w->k_row, cols, a->d, side, w->width);
            SFX(transpose_padded)(w->vt, w->v_j, w->v_row, cols, a->e, side, w->width);
        }
#ifdef BWD_PAIRS
        if (w->kt_pairs) {
            w->k_exact = mk_pair_rows(w->kt_pairs, side, w->kt, side, a->d, side);
            w->v_exact = mk_pair_rows(w->vt_pairs, side, w->vt, side, a->e, side);
        }
        if (w->k_rows)
            w->k_rows_exact = mk_pair_rows(w->k_rows, a->d, w->k_j, w->k_row, cols, a->d);
#endif
        int k_bad = SFX(has_nonfinite)(w->k_j, cols, a->d, w->k_row) ||
                    SFX(has_nonfinite)(w->v_j, cols, a->e, w->v_row);
        ptrdiff_t first, end;
        SFX(bwd_query_range)(&a->band, a->n, j0, cols, &first, &end);
        if (h->dbias) {
            /* rows outside the band's reach see none of these keys */
            for (ptrdiff_t i = 0; i < a->n; i++)
                if (i < first || i >= end)
                    memset(h->dbias + i * b->dbias_row + j0, 0, (size_t)cols * sizeof(REAL));
        }
        /* query blocks aligned to the side, so q_bad's blocks apply */
        for (ptrdiff_t i0 = first - first % side; i0 < end; i0 += side) {
            ptrdiff_t lo = ATTNX_MAX(i0, first), rows = ATTNX_MIN(i0 + side, end) - lo;
#ifdef BWD_PAIRS
            if (w->kt_pairs) SFX(bwd_pair_queries)(a, h, w, i0, b->dout_row);
#endif
            SFX(bwd_block_pair)(a, h, w, lo, rows, j0, cols, k_bad || h->q_bad[i0 / side],
                                dq + lo * dq_row, dq_row, b->dout_row, b->dk_row, b->dv_row,
                                b->dbias_row);
        }
        if (a->key_sqnorm_coef != 0) {
            /* the gaussian key term: d(coef |k_j|^2)/dk_j = 2 coef k_j */
            REAL two_coef = (REAL)(2 * a->key_sqnorm_coef);
            for (ptrdiff_t c = 0; c < cols; c++) {
                const REAL *k_c = h->k + (j0 + c) * a->k_row;
                REAL *dk_c = h->dk + (j0 + c) * b->dk_row, factor = two_coef * w->col_sum[c];
                if (factor == 0) continue;
                for (ptrdiff_t x = 0; x < a->d; x++) dk_c[x] += factor * k_c[x];
            }
        }
    }
}

/* head `head`'s operands; its scratch rows (D, offsets: 2 n numbers) and
 * query block flags, where the caller needs them */
static SFX(bwd_head) SFX(bwd_position)(const attnx_softmax_bwd_args *b, ptrdiff_t head,
                                       REAL *rows_scratch, unsigned char *bad_scratch)
{
    const attnx_softmax_args *a = &b->fwd;
    const ptrdiff_t *off = a->offsets + head * ATTNX_SMB_NOPS;
    SFX(bwd_head) h = {
        .q = (const REAL *)((const char *)a->q + off[ATTNX_SM_Q]),
        .k = (const REAL *)((const char *)a->k + off[ATTNX_SM_K]),
        .v = (const REAL *)((const char *)a->v + off[ATTNX_SM_V]),
        .out = (const REAL *)((const char *)a->out + off[ATTNX_SM_OUT]),
        .lse = (const REAL *)((const char *)a->lse + off[ATTNX_SM_LSE]),
        .bias = a->bias ? (const REAL *)((const char *)a->bias + off[ATTNX_SM_BIAS]) : NULL,
        .mask = a->mask ? a->mask + off[ATTNX_SM_MASK] : NULL,
        .dout = (const REAL *)((const char *)b->dout + off[ATTNX_SMB_DOUT]),
        .dq = (REAL *)((char *)b->dq + off[ATTNX_SMB_DQ]),
        .dk = (REAL *)((char *)b->dk + off[ATTNX_SMB_DK]),
        .dv = (REAL *)((char *)b->dv + off[ATTNX_SMB_DV]),
        .dbias = b->dbias ? (REAL *)((char *)b->dbias + off[ATTNX_SMB_DBIAS]) : NULL,
        .row_delta = rows_scratch,
        .q_bad = bad_scratch,
        .index = head,
    };
    if (rows_scratch) h.row_offset = rows_scratch + a->n;
    return h;
}

int TYPED(attnx_softmax_bwd_f32, attnx_softmax_bwd_f64)(const attnx_softmax_bwd_args *b)
{
    const attnx_softmax_args *a = &b->fwd;
    const ptrdiff_t n = a->n, m = a->m, d = a->d, heads = a->heads;
    /* half-precision keys and values are widened block by block: float32
     * softmax only (the gaussian key term reads k whole) */
    if (a->kv_half && (REAL_IS_DOUBLE || a->key_sqnorm_coef != 0)) return ATTNX_EINVAL;
    if (heads == 0 || n == 0) {
        /* no query: every gradient is 0 (dk, dv included) */
        for (ptrdiff_t head = 0; head < heads; head++) {
            SFX(bwd_head) h = SFX(bwd_position)(b, head, NULL, NULL);
            for (ptrdiff_t j = 0; j < m; j++) {
                memset(h.dk + j * b->dk_row, 0, (size_t)d * sizeof(REAL));
                memset(h.dv + j * b->dv_row, 0, (size_t)a->e * sizeof(REAL));
            }
        }
        return ATTNX_OK;
    }
    const ptrdiff_t side = attnx_softmax_bwd_block();
    ptrdiff_t key_blocks = (m + side - 1) / side, query_blocks = (n + side - 1) / side;
    ptrdiff_t groups = (TARGET_ITEMS + heads - 1) / heads;
    groups = ATTNX_MAX(1, ATTNX_MIN(groups, key_blocks));
    ptrdiff_t items = heads * groups;
    int threads = a->num_threads;
    if (threads > items) threads = (int)items;
    if ((double)heads * n * m * (d + a->e) < 1e6) threads = 1;
    if (threads < 1) threads = 1;

    /* per head: D and the row offsets, the query blocks' finiteness; per
     * thread: the block pair's tiles; per item when groups > 1: dQ */
    ptrdiff_t line = 64 / (ptrdiff_t)sizeof(REAL);
#define LINES(count) (((ptrdiff_t)(count) + line - 1) / line * line)
    /* the set's products where this build has its kernels and d, e are
     * whole vectors of them */
    int width = 0;
#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
    int set = attnx_kernels(ATTNX_FAMILY_SOFTMAX_BWD);
    width = attnx_kernels_width(set);
#endif
    ptrdiff_t lanes = width * 4 / (ptrdiff_t)sizeof(REAL);
    if (width && (d % lanes != 0 || a->e % lanes != 0)) width = 0;
    ptrdiff_t transposed = width ? LINES(d * side) + LINES(a->e * side) : 0;
    /* the bfloat16 dot products: the key block's and the item's query
     * blocks' pair rows (float32, so the numbers are the pairs' size) */
    int pairs = 0, amx = 0;
#ifdef BWD_PAIRS
#ifdef ATTNX_HAVE_AMX
    amx = width && set == ATTNX_KERNELS_AMX;
#endif
    pairs = width && (attnx_kernels_bf16_dot(set) || amx);
#endif
    ptrdiff_t paired = pairs ? LINES((d + a->e) / 2 * (side + n)) : 0;
    /* and with the caller's bfloat16 arithmetic, the pairs of p, dS and
     * the query and key rows (rounded) */
    int rounded = pairs && a->bf16_products;
    ptrdiff_t block_rows = query_blocks * (side / 2);
    ptrdiff_t rounded_pairs = rounded ? 3 * LINES(side / 2 * side) + LINES(side / 2 * (d + a->e)) +
                                            LINES(side / 2 * d) + LINES(block_rows * (d + a->e))
                                      : 0;
    /* on AMX, p or dS transposed into rows, and one product block */
    ptrdiff_t amx_pairs = amx ? LINES(side * (side / 2)) + LINES(1024) : 0;
    int dropout = a->dropout_p > 0;
    ptrdiff_t per_head = LINES(2 * n);
    ptrdiff_t widened_keys = a->kv_half ? LINES(side * d) : 0;
    ptrdiff_t widened = a->kv_half ? widened_keys + LINES(side * a->e) : 0;
    ptrdiff_t dropped = dropout * LINES(side * side);
    ptrdiff_t per_thread = (2 + dropout) * LINES(side * side) + 2 * LINES(side) + transposed +
                           paired + rounded_pairs + widened + amx_pairs;
    ptrdiff_t partial = groups > 1 ? LINES(n * d) : 0;
#undef LINES
    REAL *head_rows = NULL, *tiles = NULL, *partials = NULL;
    unsigned char *bad = malloc((size_t)(heads * query_blocks) + 1);
    /* per thread: a row's dropout decisions, the query blocks' block_pairs */
    ptrdiff_t bytes = side + (pairs ? query_blocks : 0);
    unsigned char *keeps = malloc((size_t)(threads * bytes));
    SFX(bwd_work) *works = calloc((size_t)threads, sizeof *works);
    int status = ATTNX_ENOMEM;
    head_rows = attnx_aligned_alloc(64, (size_t)(per_head * heads) * sizeof(REAL));
    tiles = attnx_aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(REAL));
    partials = partial ? attnx_aligned_alloc(64, (size_t)(partial * items) * sizeof(REAL)) : NULL;
    if (!bad || !keeps || !works || !head_rows || !tiles || (partial && !partials)) goto done;
    for (int t = 0; t < threads; t++) {
        REAL *base = tiles + per_thread * t;
        REAL *kt = base + 2 * side * side + 2 * side;
        works[t] = (SFX(bwd_work)){.pt = base, .dpt = base + side * side,
                                   .key_term = base + 2 * side * side,
                                   .col_sum = base + 2 * side * side + side, .side = side,
                                   .width = width,
                                   .lanes = lanes, .kt = width ? kt : NULL,
                                   .vt = width ? kt + d * side : NULL, .ptd = base,
                                   .keep = keeps + t * bytes};
        if (dropout) works[t].ptd = kt + transposed + paired + rounded_pairs;
        if (widened) {
            works[t].k_block = kt + transposed + paired + rounded_pairs + dropped;
            works[t].v_block = works[t].k_block + widened_keys;
        }
#ifdef BWD_PAIRS
        if (amx) {
            works[t].a_pairs = kt + transposed + paired + rounded_pairs + dropped + widened;
            works[t].block = works[t].a_pairs + side * (side / 2);
        }
#endif
#ifdef BWD_PAIRS
        if (pairs) {
            float *pair_base = kt + transposed;
            works[t].kt_pairs = pair_base;
            works[t].vt_pairs = pair_base + d / 2 * side;
            works[t].q_pairs = works[t].vt_pairs + a->e / 2 * side;
            works[t].dout_pairs = works[t].q_pairs + n * d / 2;
            works[t].block_pairs = keeps + t * bytes + side;
            if (rounded) {
                float *rounded_base = kt + transposed + paired;
                works[t].pd_pairs = rounded_base;
                works[t].ds_pairs = rounded_base + side / 2 * side;
                works[t].ds_along = rounded_base + 2 * (side / 2 * side);
                works[t].q_rows = rounded_base + 3 * (side / 2 * side);
                works[t].dout_rows = works[t].q_rows + side / 2 * d;
                works[t].k_rows = works[t].dout_rows + side / 2 * a->e;
                works[t].q_block_rows = works[t].k_rows + side / 2 * d;
                works[t].dout_block_rows = works[t].q_block_rows + block_rows * d;
            }
        }
#endif
    }

#pragma omp parallel num_threads(attnx_omp_threads(threads)) if (threads > 1)
    {
        /* pass 1, per head: D, row offsets; dQ cleared */
#pragma omp for schedule(static)
        for (ptrdiff_t head = 0; head < heads; head++) {
            SFX(bwd_head) h = SFX(bwd_position)(b, head, head_rows + per_head * head,
                                                bad + head * query_blocks);
            SFX(bwd_rows)(a, &h, b->dout_row, side);
            if (groups == 1)
                for (ptrdiff_t i = 0; i < n; i++) memset(h.dq + i * b->dq_row, 0, (size_t)d * sizeof(REAL));
        }
        /* pass 2: the items, each into its own rows of dK, dV and its dQ */
        SFX(bwd_work) *w = &works[omp_get_thread_num()];
#pragma omp for schedule(dynamic, 1)
        for (ptrdiff_t item = 0; item < items; item++) {
            ptrdiff_t head = item / groups, group = item % groups;
            SFX(bwd_head) h = SFX(bwd_position)(b, head, head_rows + per_head * head,
                                                bad + head * query_blocks);
            REAL *dq = h.dq;
            ptrdiff_t dq_row = b->dq_row;
            if (groups > 1) {
                dq = partials + partial * item;
                dq_row = d;
                memset(dq, 0, (size_t)(n * d) * sizeof(REAL));
            }
            SFX(bwd_item)(b, &h, w, group, groups, dq, dq_row, omp_get_thread_num() == 0);
        }
        /* pass 3: the groups' dQ partials, added in group order (after the
         * barrier every thread sees the same `stopped`) */
        if (groups > 1 && !(a->interrupt && a->interrupt->stopped)) {
#pragma omp for schedule(static)
            for (ptrdiff_t head = 0; head < heads; head++) {
                SFX(bwd_head) h = SFX(bwd_position)(b, head, NULL, NULL);
                for (ptrdiff_t i = 0; i < n; i++) {
                    REAL *dq_i = h.dq + i * b->dq_row;
                    const REAL *part = partials + partial * head * groups + i * d;
                    for (ptrdiff_t x = 0; x < d; x++) dq_i[x] = part[x];
                    for (ptrdiff_t g = 1; g < groups; g++)
                        for (ptrdiff_t x = 0; x < d; x++) dq_i[x] += part[g * partial + x];
                }
            }
        }
    }
    status = a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
done:
    free(bad);
    free(keeps);
    free(works);
    attnx_aligned_free(head_rows);
    attnx_aligned_free(tiles);
    attnx_aligned_free(partials);
    return status;
}

#undef LOG2E
#undef BWD_PAIRS
#endif /* REAL */
