/* softmax.c - exact softmax attention, FlashAttention-style.
 *
 * For each head and each tile of Q_TILE query rows, walk the key tiles that
 * the rows can see (the causal/window band skips the rest), and keep per
 * row an online softmax: the running max, the running sum of 2^(s - max),
 * and the unnormalised output (in the output rows themselves, or with the
 * micro-kernels and AMX in a transposed tile, copied out at the end).
 * Memory is one scores tile per thread, and the packed keys and values of
 * a head: nothing grows with n * m.
 *
 * Products, by what the CPU has: float32 on AMX (amx.h) where it can, else
 * the AVX-512 or AVX2 micro-kernels (microkernel.h) for float32 and
 * float64, else BLAS and plain loops. AMX walks a query tile block of 32
 * rows by block, each through its scores, softmax and P V in turn; the
 * micro-kernels and BLAS do each step for the whole tile.
 *
 * The scores tile is held transposed, one query row per column, so that
 * the softmax over keys runs down the columns in vector lanes (see
 * microkernel.h), and in log2 units, log2(e) times the natural scores, so
 * that each weight is one 2^x. The rounding of the row max cancels between
 * a row's weights, because every weight and every rescaling of the row is
 * 2^(x - max) for the same max.
 *
 * Legend: n queries, m keys, d features, e value features.
 *   st    (cols, st_ld)  log2(e) (scale Q_tile K_tile^T + bias), then p = 2^(st - max)
 *   out   (rows, e)      sum_j p_rj v_j, rescaled when the max grows
 *   ot    (e, st_ld)     the same, transposed (micro-kernels, AMX)
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "amx.h"
#include "attnx.h"
#include "blas.h"
#include "microkernel.h"

/* Tile sizes: a scores tile of Q_TILE x KEY_TILE stays in L2, and tall
 * query tiles amortise the packing of each key tile over many rows. Q_TILE
 * is a whole number of micro-kernel strips (MK_ROW_ALIGN); KEY_TILE a whole
 * number of panels. (Measured at n = 2048, d = 64: 240 x 512, 480 x 256,
 * 144 x 256 and 240 x 128 all within the noise of 240 x 256.) */
#define Q_TILE 240
#define KEY_TILE 256

/* Below this many queries, packing every key costs more than the
 * micro-kernels save (measured at m = 4096, d = 64: BLAS wins up to n = 40,
 * the micro-kernels from 48): BLAS or plain loops instead. */
#define MK_MIN_ROWS 48

/* Values are checked for inf and NaN (see add_visible_values) in blocks of
 * this many keys, once per head and thread. */
#define V_BLOCK 64

/* One thread's keys and values of one head, packed for the micro-kernels; a
 * panel is packed the first time a query tile needs it, and reused by every
 * later tile of the head (and of heads that share them). Panel p lives
 * in slot p % slots: every panel of the head when the query tiles may see
 * any key, or, under a window, a ring over the keys two neighbouring query
 * tiles see, so that memory (and its page faults) does not grow with m. */
typedef struct {
    int width;            /* the micro-kernels' instruction set (attnx_mk_width) */
    void *kt;             /* (slots, d, KB) numbers of the call's type, KB = MK_KB(width) */
    void *vt;             /* (slots, e / KB, KB, KB); NULL: the values are read in place */
    ptrdiff_t *owner;     /* per slot: 1 + the panel it holds, 0 for none */
    ptrdiff_t slots;
    const void *k, *v;    /* the keys and values whose panels are in kt and vt */
} packed_panels;

/* Query tiles on AMX (float32, amx.h) hold this many rows, 8 blocks of
 * 32: a block is the rows of one product block. */
#define AMX_Q_TILE 256

/* One thread's operands for the AMX products: the keys and V^T of one
 * head, split once, block by block of 32 keys as query tiles first need
 * them; the tile's scaled Q^T; one row block's P^T. Planes are AMX_PLANES
 * apart by the sizes given. A product's tiles each read 16 rows of 64
 * bytes: rows 64 bytes apart (not a row of the whole tile or head apart)
 * keep them out of each other's cache sets. */
typedef struct {
    uint16_t *k_op;          /* rows (m_pad, d_pad) */
    uint16_t *v_op;          /* rows (m_pad / 32, e_pad, 32): V^T by blocks of keys */
    uint16_t *q_op;          /* pairs (st_ld / 32, d_pad / 2, 64) by blocks of rows */
    uint16_t *p_op;          /* pairs (KEY_TILE / 2, 64) */
    float *v_t;              /* (e, 32) V^T of one block of keys, to split */
    unsigned char *packed;   /* per block of 32 keys: 1 when k_op, v_op hold it */
    const void *k, *v;       /* the keys and values they hold */
    ptrdiff_t d_pad, e_pad, m_pad;
} amx_operands;

/* The items [next, end) of one thread's share of the work. */
typedef struct {
    ptrdiff_t next, end;
} item_range;

/* The next work item for thread `self`: its own share's first one left, or,
 * when its share is done, another share's last one; -1 when none is left.
 * A thread slowed by other work on its core then does not hold up the
 * call, and a head's query tiles still mostly go to one thread, which packs
 * the head's keys and values once. */
static ptrdiff_t claim_item(item_range *shares, int threads, int self)
{
    ptrdiff_t item = -1;
#pragma omp critical(attnx_softmax_claim)
    {
        if (shares[self].next < shares[self].end) item = shares[self].next++;
        for (int i = 1; i < threads && item < 0; i++) {
            item_range *other = &shares[(self + i) % threads];
            if (other->next < other->end) item = --other->end;
        }
    }
    return item;
}

#define ATTNX_FAMILY_FILE "softmax.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */

#define LOG2E ((REAL)1.44269504088896340736)

/* One thread's working memory for a query tile (arrays of st_ld lanes are
 * indexed by the tile's query rows). */
typedef struct {
    REAL *st;           /* (KEY_TILE, st_ld) scores, then probabilities */
    ptrdiff_t st_ld;
    REAL *qt;           /* the micro-kernels' packed Q^T of the tile */
    REAL *key_term;     /* (KEY_TILE) per-key addend of the scores, log2 units */
    REAL *tile_max;     /* max of the row's scores in the current key tile */
    REAL *row_max, *row_sum;  /* the online softmax, log2 units */
    REAL *correction;   /* 2^(old max - new max), to rescale the output */
    REAL *shift, *tile_sum;   /* plain-loop softmax: the max subtracted, the running sum;
                               * at the tile's end, shift holds the rows' 1 / sum */
    packed_panels *pk;  /* the micro-kernels' panels; NULL: AMX, or BLAS and plain loops */
    amx_operands *amx;  /* NULL: no AMX */
    REAL *ot;           /* (e, st_ld) the output, transposed (micro-kernels, AMX);
                         * NULL: BLAS and plain loops, which add P V to out in place */
    unsigned char *v_state;   /* per block of V_BLOCK values: 0 unchecked, 1 finite, 2 not */
    const void *v_seen;       /* the values v_state describes */
} SFX(tile_work);

/* bias[j] = coef * |x_j|^2 over rows x_j (gaussian attention's -|k_j|^2 /
 * (2 sigma^2), and the query's own term of its lse) */
static ATTNX_HOT void SFX(sqnorm_terms)(REAL *bias, const REAL *rows_x, ptrdiff_t x_row,
                                        ptrdiff_t count, ptrdiff_t d, REAL coef)
{
    for (ptrdiff_t j = 0; j < count; j++) {
        const REAL *x_j = rows_x + j * x_row;
        REAL sq = 0;
        for (ptrdiff_t c = 0; c < d; c++) sq += x_j[c] * x_j[c];
        bias[j] = coef * sq;
    }
}

/* A bias or mask that depends on the key only (key padding: shape (..., 1,
 * m)) joins the per-key term; one that depends on the query too is
 * applied to the scores tile. */
static int SFX(bias_per_key)(const attnx_softmax_args *a) { return a->bias_row == 0 || a->n == 1; }
static int SFX(mask_per_key)(const attnx_softmax_args *a) { return a->mask_row == 0 || a->n == 1; }

/* key_term[j] for the tile's keys [j0, j0 + cols), in log2 units: the
 * gaussian term, a per-key bias, -inf for a key its mask removes; 0 in the
 * panel padding up to `padded`. */
static void SFX(fill_key_term)(const attnx_softmax_args *a, REAL *key_term, const REAL *k,
                               const REAL *bias, const unsigned char *mask, ptrdiff_t j0,
                               ptrdiff_t cols, ptrdiff_t padded)
{
    if (a->key_sqnorm_coef != 0)
        SFX(sqnorm_terms)(key_term, k + j0 * a->k_row, a->k_row, cols, a->d,
                          (REAL)a->key_sqnorm_coef);
    else
        for (ptrdiff_t j = 0; j < cols; j++) key_term[j] = 0;
    if (bias && SFX(bias_per_key)(a))
        for (ptrdiff_t j = 0; j < cols; j++) key_term[j] += bias[(j0 + j) * a->bias_col];
    for (ptrdiff_t j = 0; j < cols; j++) key_term[j] *= LOG2E;
    if (mask && SFX(mask_per_key)(a))
        for (ptrdiff_t j = 0; j < cols; j++)
            if (!mask[(j0 + j) * a->mask_col]) key_term[j] = -(REAL)INFINITY;
    for (ptrdiff_t j = cols; j < padded; j++) key_term[j] = 0;
}

/* Plain-loop epilogue of the BLAS scores: add the key term, hide what the
 * band or a masked key hides (-inf, whatever the score: a NaN there must
 * not reach the row), and take each row's max. */
static ATTNX_HOT void SFX(finish_scores)(const mk_tile *t, REAL *st, ptrdiff_t st_ld,
                                         const REAL *key_term, REAL *tile_max)
{
    const REAL neg_inf = -(REAL)INFINITY;
    for (ptrdiff_t j = 0; j < t->cols; j++) {
        ptrdiff_t lo, hi;
        mk_key_rows(t, j, &lo, &hi);
        if (key_term[j] == neg_inf) hi = lo;
        REAL *s_j = st + j * st_ld, term = key_term[j];
        for (ptrdiff_t r = 0; r < lo; r++) s_j[r] = neg_inf;
#pragma omp simd
        for (ptrdiff_t r = lo; r < hi; r++) {
            s_j[r] += term;
            tile_max[r] = s_j[r] > tile_max[r] ? s_j[r] : tile_max[r];
        }
        for (ptrdiff_t r = hi; r < t->rows; r++) s_j[r] = neg_inf;
    }
}

#ifdef MK_HAVE_X86
/* the micro-kernel `name` of this type for instruction set w (microkernel.h) */
#if REAL_IS_DOUBLE
#define MK_KERNEL(w, name) ((w) == 16 ? name##_d8 : name##_d4)
#else
#define MK_KERNEL(w, name) ((w) == 16 ? name##_w16 : name##_w8)
#endif

/* dst[c][r] = x[r][c] for r < count, c < d (row strides dst_row, x_row):
 * by square blocks of `side` numbers, what they leave by blocks half as
 * big, the rest one by one. The blocks: 16 x 16 floats on AVX-512, 8 x 8
 * floats, 4 x 4 doubles (only called where the micro-kernels run, so AVX2
 * is there). */
static void SFX(mk_transpose_by)(REAL *dst, ptrdiff_t dst_row, const REAL *x, ptrdiff_t x_row,
                                 ptrdiff_t count, ptrdiff_t d, ptrdiff_t side)
{
#if REAL_IS_DOUBLE
    if (side < 4) {
#else
    if (side < 8) {
#endif
        for (ptrdiff_t r = 0; r < count; r++)
            for (ptrdiff_t c = 0; c < d; c++) dst[c * dst_row + r] = x[r * x_row + c];
        return;
    }
    ptrdiff_t rows = count / side * side, cols = d / side * side;
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += side)
        for (ptrdiff_t c0 = 0; c0 < cols; c0 += side) {
            REAL *block = dst + c0 * dst_row + r0;
            const REAL *from = x + r0 * x_row + c0;
#if REAL_IS_DOUBLE
            mk_transpose4_f64(block, dst_row, from, x_row);
#else
            if (side == 16)
                mk_transpose16(block, dst_row, from, x_row);
            else
                mk_transpose8(block, dst_row, from, x_row);
#endif
        }
    /* the columns right of the blocks, then the rows below them */
    SFX(mk_transpose_by)(dst + cols * dst_row, dst_row, x + cols, x_row, rows, d - cols, side / 2);
    SFX(mk_transpose_by)(dst + rows, dst_row, x + rows * x_row, x_row, count - rows, d, side / 2);
}

/* the transpose by the largest blocks this type has on instruction set `width` */
static void SFX(mk_transpose)(REAL *dst, ptrdiff_t dst_row, const REAL *x, ptrdiff_t x_row,
                              ptrdiff_t count, ptrdiff_t d, int width)
{
    SFX(mk_transpose_by)(dst, dst_row, x, x_row, count, d,
                         REAL_IS_DOUBLE ? 4 : width == 16 ? 16 : 8);
}

/* block (d, lanes) <- rows [0, count) of x transposed, lanes past `count`
 * 0: a panel of keys or a strip of queries */
static void SFX(mk_pack)(REAL *block, const REAL *x, ptrdiff_t x_row, ptrdiff_t count,
                         ptrdiff_t d, ptrdiff_t lanes, int width)
{
    if (count < lanes) memset(block, 0, (size_t)(d * lanes) * sizeof *block);
    SFX(mk_transpose)(block, lanes, x, x_row, count, d, width);
}

/* block (e / kb, kb, kb) <- rows [0, count) of v, by groups of kb columns,
 * keys past `count` 0: a panel of values. The copies are of kb numbers, a
 * constant in each branch. */
static void SFX(mk_pack_values)(REAL *block, const REAL *v, ptrdiff_t v_row, ptrdiff_t count,
                                ptrdiff_t e, ptrdiff_t kb)
{
#define MK_PACK(kb)                                                                 \
    for (ptrdiff_t j = 0; j < count; j++)                                           \
        for (ptrdiff_t g = 0; g < e; g += (kb))                                     \
            memcpy(block + (g + j) * (kb), v + j * v_row + g, (kb) * sizeof(REAL))
    if (count < kb) memset(block, 0, (size_t)(e * kb) * sizeof(REAL));
    if (kb == 8)
        MK_PACK(8);
    else
        MK_PACK(kb);
#undef MK_PACK
}

/* The panels of the keys [j0, j0 + cols) and of their values into their
 * slots, those not there already. */
static void SFX(mk_pack_panels)(const attnx_softmax_args *a, packed_panels *pk, const REAL *k,
                                const REAL *v, ptrdiff_t j0, ptrdiff_t cols)
{
    ptrdiff_t kb = MK_KB(pk->width), d = a->d, e = a->e;
    for (ptrdiff_t p = j0 / kb; p * kb < j0 + cols; p++) {
        ptrdiff_t slot = p % pk->slots, count = ATTNX_MIN(kb, a->m - p * kb);
        if (pk->owner[slot] == p + 1) continue;
        SFX(mk_pack)((REAL *)pk->kt + slot * kb * d, k + p * kb * a->k_row, a->k_row, count, d, kb,
                     pk->width);
        if (pk->vt)
            SFX(mk_pack_values)((REAL *)pk->vt + slot * kb * e, v + p * kb * a->v_row, a->v_row,
                                count, e, kb);
        pk->owner[slot] = p + 1;
    }
}

/* qt (strips, d, strip) <- rows [0, rows) of q, strip by strip */
static void SFX(mk_pack_queries)(REAL *qt, const REAL *q, ptrdiff_t q_row, ptrdiff_t rows,
                                 ptrdiff_t d, ptrdiff_t strip, int width)
{
    for (ptrdiff_t r0 = 0; r0 < rows; r0 += strip)
        SFX(mk_pack)(qt + r0 * d, q + r0 * q_row, q_row, ATTNX_MIN(strip, rows - r0), d, strip,
                     width);
}
#endif

/* st = scores of the tile, with hidden keys at -inf, and tile_max; the
 * keys each strip of rows computes are mk_strip_keys(.., kb) (BLAS: all of
 * the tile's keys for all its rows, kb = 1). */
static void SFX(tile_scores)(const attnx_softmax_args *a, const mk_tile *t, SFX(tile_work) *w,
                             const REAL *q, const REAL *k, REAL scale2)
{
    for (ptrdiff_t r = 0; r < w->st_ld; r++) w->tile_max[r] = -(REAL)INFINITY;
#ifdef MK_HAVE_X86
    packed_panels *pk = w->pk;
    if (pk) {
        MK_KERNEL(pk->width, mk_scores)(t, w->st, w->st_ld, w->qt, pk->kt, pk->slots, a->d, scale2,
                                        w->key_term, w->tile_max);
        return;
    }
#endif
    SFX(gemm)(0, 1, t->cols, t->rows, a->d, scale2, k + t->j0 * a->k_row, a->k_row, q, a->q_row,
              0, w->st, w->st_ld);
    SFX(finish_scores)(t, w->st, w->st_ld, w->key_term, w->tile_max);
}

/* A bias or mask that depends on the query as well: added to (or hiding)
 * the visible scores of rows [r0, r1) over the keys [lo, hi) their strip
 * computes, then those rows' max taken anew. */
static void SFX(apply_bias_mask)(const attnx_softmax_args *a, const mk_tile *t, SFX(tile_work) *w,
                                 const REAL *bias, const unsigned char *mask, ptrdiff_t r0,
                                 ptrdiff_t r1, ptrdiff_t lo, ptrdiff_t hi)
{
    const REAL neg_inf = -(REAL)INFINITY;
    int use_bias = bias && !SFX(bias_per_key)(a), use_mask = mask && !SFX(mask_per_key)(a);
    for (ptrdiff_t r = r0; r < r1; r++) w->tile_max[r] = neg_inf;
    for (ptrdiff_t j = lo; j < hi; j++) {
        REAL *s_j = w->st + j * w->st_ld;
        ptrdiff_t key = t->j0 + j;
        for (ptrdiff_t r = r0; r < r1; r++) {
            ptrdiff_t i = t->i0 + r;
            /* hidden stays hidden, whatever the bias (-inf + inf is NaN) */
            if (s_j[r] == neg_inf) continue;
            if (use_bias) s_j[r] += LOG2E * bias[i * a->bias_row + key * a->bias_col];
            if (use_mask && !mask[i * a->mask_row + key * a->mask_col]) s_j[r] = neg_inf;
            w->tile_max[r] = s_j[r] > w->tile_max[r] ? s_j[r] : w->tile_max[r];
        }
    }
}

/* The online softmax of rows [r0, r1) over the keys [lo, hi) of the tile:
 * st <- 2^(st - max) with max the rows' new running max, the rows' running
 * sums brought up to date, and correction[r] = 2^(old max - new max), the
 * factor for what out holds already (1 when the max did not move).
 * Invariant, per row: out = sum_j 2^(s_j - row_max) v_j and row_sum = sum_j
 * 2^(s_j - row_max) over the keys seen so far; a row that has seen no
 * visible key keeps row_max = -inf, row_sum = 0, out = 0. */
static ATTNX_HOT void SFX(softmax_strip)(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1,
                                         ptrdiff_t lo, ptrdiff_t hi)
{
    const REAL neg_inf = -(REAL)INFINITY;
    REAL *st = w->st, *shift = w->shift, *tile_sum = w->tile_sum;
    const ptrdiff_t st_ld = w->st_ld;
#pragma omp simd
    for (ptrdiff_t r = r0; r < r1; r++) {
        REAL old_max = w->row_max[r], new_max = w->tile_max[r] > old_max ? w->tile_max[r] : old_max;
        /* a row with nothing visible yet subtracts 0: its scores are -inf */
        shift[r] = new_max == neg_inf ? 0 : new_max;
        /* out holds nothing to rescale while the max stays, or before the
         * row has seen a key (it is 0, and so is the sum) */
        REAL correction = new_max == old_max || old_max == neg_inf ? 1 : SFX(vexp2)(old_max - shift[r]);
        w->correction[r] = correction;
        tile_sum[r] = w->row_sum[r] * correction;
        w->row_max[r] = new_max;
    }
    if (r1 - r0 >= 8) {
        /* down the columns: each key's row of st is a vector of rows */
        for (ptrdiff_t j = lo; j < hi; j++)
#pragma omp simd
            for (ptrdiff_t r = r0; r < r1; r++) {
                REAL p = SFX(vexp2)(st[j * st_ld + r] - shift[r]);
                st[j * st_ld + r] = p;
                tile_sum[r] += p;
            }
    } else {
        /* few rows (decoding): along each row */
        for (ptrdiff_t r = r0; r < r1; r++) {
            REAL row_shift = shift[r], sum = tile_sum[r];
#pragma omp simd reduction(+ : sum)
            for (ptrdiff_t j = lo; j < hi; j++) {
                REAL p = SFX(vexp2)(st[j * st_ld + r] - row_shift);
                st[j * st_ld + r] = p;
                sum += p;
            }
            tile_sum[r] = sum;
        }
    }
    for (ptrdiff_t r = r0; r < r1; r++) w->row_sum[r] = tile_sum[r];
}

/* 1 when the values of the keys [j0, j0 + cols) are all finite; each
 * block of V_BLOCK keys is checked once per head and thread */
static int SFX(values_finite)(const attnx_softmax_args *a, SFX(tile_work) *w, const REAL *v,
                              ptrdiff_t j0, ptrdiff_t cols)
{
    if (w->v_seen != v) {
        memset(w->v_state, 0, (size_t)((a->m + V_BLOCK - 1) / V_BLOCK));
        w->v_seen = v;
    }
    for (ptrdiff_t b = j0 / V_BLOCK; b * V_BLOCK < j0 + cols; b++) {
        if (!w->v_state[b]) {
            ptrdiff_t first = b * V_BLOCK, count = ATTNX_MIN(V_BLOCK, a->m - first);
            w->v_state[b] = SFX(has_nonfinite)(v + first * a->v_row, count, a->e, a->v_row) ? 2 : 1;
        }
        if (w->v_state[b] == 2) return 0;
    }
    return 1;
}

/* acc_r += sum_j p_rj v_j over the keys with p_rj != 0 only: the path for
 * value tiles holding inf or NaN, where the product's 0 * NaN would leak a
 * hidden key's NaN into rows that cannot see it. acc's element (r, c) is
 * at acc[r acc_row + c acc_col]. */
static void SFX(add_visible_values)(const mk_tile *t, REAL *acc, ptrdiff_t acc_row,
                                    ptrdiff_t acc_col, const REAL *pt, ptrdiff_t pt_ld,
                                    const REAL *v_tile, ptrdiff_t v_row, ptrdiff_t e)
{
    for (ptrdiff_t r = 0; r < t->rows; r++) {
        ptrdiff_t lo, hi;
        mk_block_keys(t, r, 1, &lo, &hi);
        for (ptrdiff_t j = lo; j < hi; j++) {
            REAL p_rj = pt[j * pt_ld + r];
            if (p_rj == 0) continue;
            for (ptrdiff_t c = 0; c < e; c++)
                acc[r * acc_row + c * acc_col] += p_rj * v_tile[j * v_row + c];
        }
    }
}

static ATTNX_HOT void SFX(scale_row)(REAL *row, ptrdiff_t count, REAL factor)
{
    for (ptrdiff_t j = 0; j < count; j++) row[j] *= factor;
}

/* The tile's output times its rows' correction, out (rows, e) or ot */
static void SFX(rescale_output)(SFX(tile_work) *w, REAL *out, ptrdiff_t out_row, ptrdiff_t rows,
                                ptrdiff_t e)
{
    if (w->ot) {
        for (ptrdiff_t c = 0; c < e; c++)
            for (ptrdiff_t r = 0; r < rows; r++) w->ot[c * w->st_ld + r] *= w->correction[r];
        return;
    }
    for (ptrdiff_t r = 0; r < rows; r++)
        if (w->correction[r] != 1) SFX(scale_row)(out + r * out_row, e, w->correction[r]);
}

/* The tile's output += P V_tile, P^T the probabilities in st, after the
 * output is rescaled by the rows' correction: out (rows, e) in place for
 * BLAS and plain loops, ot (e, st_ld) for the micro-kernels, which fold the
 * rescaling into the product. */
static void SFX(tile_add_pv)(const attnx_softmax_args *a, const mk_tile *t, SFX(tile_work) *w,
                             REAL *out, const REAL *v)
{
    const REAL *v_tile = v + t->j0 * a->v_row;
    REAL *acc = w->ot ? w->ot : out;
    ptrdiff_t acc_row = w->ot ? 1 : a->out_row, acc_col = w->ot ? w->st_ld : 1;
    int finite = SFX(values_finite)(a, w, v, t->j0, t->cols);
#ifdef MK_HAVE_X86
    if (w->pk && finite) {
        const packed_panels *pk = w->pk;
        ptrdiff_t kb = MK_KB(pk->width);
        mk_values values = {pk->vt, pk->slots, kb * a->e, kb, kb * kb};
        if (!pk->vt)
            values = (mk_values){v, PTRDIFF_MAX, kb * a->v_row, a->v_row, kb};
        MK_KERNEL(pk->width, mk_add_pv)(t, w->ot, w->st_ld, w->st, w->st_ld, &values, a->e,
                                        w->correction);
        return;
    }
#endif
    SFX(rescale_output)(w, out, a->out_row, t->rows, a->e);
    if (!finite)
        SFX(add_visible_values)(t, acc, acc_row, acc_col, w->st, w->st_ld, v_tile, a->v_row, a->e);
    else
        SFX(gemm)(1, 0, t->rows, a->e, t->cols, 1, w->st, w->st_ld, v_tile, a->v_row, 1, out,
                  a->out_row);
}

#if !REAL_IS_DOUBLE && defined(ATTNX_HAVE_AMX)
/* The blocks of 32 keys in [j0, j1) (multiples of 32) that x does not hold
 * yet into its keys' and V^T's operands; keys past m are 0. */
static void amx_pack_keys(const attnx_softmax_args *a, amx_operands *x, const float *k,
                          const float *v, ptrdiff_t j0, ptrdiff_t j1)
{
    const ptrdiff_t d_pad = x->d_pad, m_pad = x->m_pad;
    for (ptrdiff_t b = j0 / 32; b < j1 / 32; b++) {
        if (x->packed[b]) continue;
        ptrdiff_t first = b * 32, count = ATTNX_MIN(32, a->m - first);
        amx_split_rows(x->k_op + first * d_pad, d_pad, m_pad * d_pad, k + first * a->k_row,
                       a->k_row, count, 32, a->d, d_pad);
        mk_pack_f32(x->v_t, v + first * a->v_row, a->v_row, count, a->e, 32, 16);
        amx_split_rows(x->v_op + first * x->e_pad, 32, x->e_pad * m_pad, x->v_t, 32, a->e,
                       x->e_pad, 32, 32);
        x->packed[b] = 1;
    }
}

/* The key tiles [key_first, key_end) of query tile [i0, i0 + rows) on AMX
 * (key_first a multiple of 32), block of 32 rows by block: its scores,
 * their online softmax, then its output += P V into ot. */
static void amx_key_tiles(const attnx_softmax_args *a, tile_work_f32 *w, const float *q,
                          const float *k, const float *v, const float *bias,
                          const unsigned char *mask, ptrdiff_t i0, ptrdiff_t rows,
                          ptrdiff_t key_first, ptrdiff_t key_end, float scale2, int per_query)
{
    amx_operands *x = w->amx;
    const ptrdiff_t st_ld = w->st_ld, d_pad = x->d_pad, e_pad = x->e_pad, m_pad = x->m_pad;
    const ptrdiff_t k_plane = m_pad * d_pad, v_plane = e_pad * m_pad, q_plane = d_pad * st_ld;
    const ptrdiff_t p_plane = KEY_TILE * 32;
    float *st = w->st, *ot = w->ot;
    if (x->k != k || x->v != v) {
        memset(x->packed, 0, (size_t)(m_pad / 32));
        x->k = k;
        x->v = v;
    }
    amx_configure();
    /* Q^T (rows d to d_pad stay 0), then its pairs, in log2 units: the
     * product gives the scores but for the key term */
    mk_pack_f32(w->qt, q, a->q_row, rows, a->d, st_ld, 16);
    for (ptrdiff_t g = 0; g + 32 <= st_ld; g += 16)
        amx_split_pairs(x->q_op + g / 32 * d_pad * 32 + g % 32 * 2, 64, q_plane, w->qt + g, st_ld,
                        d_pad / 2, scale2);
    for (ptrdiff_t j0 = key_first; j0 < key_end; j0 += KEY_TILE) {
        ptrdiff_t cols = ATTNX_MIN(KEY_TILE, key_end - j0), padded = (cols + 31) / 32 * 32;
        const mk_tile tile = {&a->band, i0, rows, j0, cols};
        fill_key_term_f32(a, w->key_term, k, bias, mask, j0, cols, padded);
        amx_pack_keys(a, x, k, v, j0, j0 + padded);
        /* every value the products read, the padding up to 32 keys too:
         * their weights are 0, but 0 times inf is NaN */
        int finite = values_finite_f32(a, w, v, j0, ATTNX_MIN(padded, a->m - j0));
        for (ptrdiff_t r0 = 0; r0 < rows; r0 += 32) {
            ptrdiff_t lo, hi, r1 = ATTNX_MIN(r0 + 32, rows);
            mk_strip_keys(&tile, r0, 32, 32, &lo, &hi);
            if (hi <= lo) continue; /* nothing to see: the rows' state stays */
            for (ptrdiff_t r = r0; r < r0 + 32; r++) w->tile_max[r] = -INFINITY;
            for (ptrdiff_t c0 = lo; c0 < hi; c0 += 32) {
                amx_product(st + c0 * st_ld + r0, st_ld, x->k_op + (j0 + c0) * d_pad, d_pad, 32,
                            k_plane, x->q_op + r0 * d_pad, 64, q_plane, d_pad / 32, 0);
                amx_finish_scores(&tile, st, st_ld, r0, c0, w->key_term, w->tile_max);
            }
            if (per_query) apply_bias_mask_f32(a, &tile, w, bias, mask, r0, r1, lo, hi);
            mk_softmax_strip_w16(st + r0, st_ld, lo, hi, w->tile_max + r0, w->row_max + r0,
                                 w->row_sum + r0, w->correction + r0, 2);
            amx_rescale(ot + r0, st_ld, a->e, w->correction + r0);
            if (!finite) {
                const mk_tile block = {&a->band, i0 + r0, r1 - r0, j0, cols};
                add_visible_values_f32(&block, ot + r0, 1, st_ld, st + r0, st_ld, v + j0 * a->v_row,
                                       a->v_row, a->e);
                continue;
            }
            for (ptrdiff_t g = 0; g < 32; g += 16)
                amx_split_pairs(x->p_op + 2 * g, 64, p_plane, st + lo * st_ld + r0 + g, st_ld,
                                (hi - lo) / 2, 1.0f);
            for (ptrdiff_t c0 = 0; c0 < e_pad; c0 += 32)
                amx_product(ot + c0 * st_ld + r0, st_ld, x->v_op + (j0 + lo) * e_pad + c0 * 32, 32,
                            e_pad * 32, v_plane, x->p_op, 64, p_plane, (hi - lo) / 32, 1);
        }
    }
    amx_release();
}
#endif

/* The key tiles [key_first, key_end) of query tile [i0, i0 + rows): BLAS
 * and plain loops, or the micro-kernels (w->pk) */
static void SFX(mk_key_tiles)(const attnx_softmax_args *a, SFX(tile_work) *w, const REAL *q,
                              const REAL *k, const REAL *v, REAL *out, const REAL *bias,
                              const unsigned char *mask, ptrdiff_t i0, ptrdiff_t rows,
                              ptrdiff_t key_first, ptrdiff_t key_end, REAL scale2, int per_query)
{
    ptrdiff_t strip = rows, kb = 1;
#ifdef MK_HAVE_X86
    if (w->pk) {
        strip = MK_STRIP(MK_LANES(w->pk->width, sizeof(REAL)));
        kb = MK_KB(w->pk->width);
        key_first -= key_first % kb;
        if (w->pk->k != k || (w->pk->vt && w->pk->v != v)) {
            memset(w->pk->owner, 0, (size_t)w->pk->slots * sizeof *w->pk->owner);
            w->pk->k = k;
            w->pk->v = v;
        }
        SFX(mk_pack_queries)(w->qt, q, a->q_row, rows, a->d, strip, w->pk->width);
    }
#endif
    for (ptrdiff_t j0 = key_first; j0 < key_end; j0 += KEY_TILE) {
        ptrdiff_t cols = ATTNX_MIN(KEY_TILE, key_end - j0);
        const mk_tile tile = {&a->band, i0, rows, j0, cols};
        SFX(fill_key_term)(a, w->key_term, k, bias, mask, j0, cols, (cols + kb - 1) / kb * kb);
#ifdef MK_HAVE_X86
        if (w->pk) SFX(mk_pack_panels)(a, w->pk, k, v, j0, cols);
#endif
        SFX(tile_scores)(a, &tile, w, q, k, scale2);
        for (ptrdiff_t r0 = 0; r0 < rows; r0 += strip) {
            ptrdiff_t lo = 0, hi = cols, r1 = ATTNX_MIN(r0 + strip, rows);
            if (kb > 1) mk_strip_keys(&tile, r0, strip, kb, &lo, &hi);
            if (per_query) SFX(apply_bias_mask)(a, &tile, w, bias, mask, r0, r1, lo, hi);
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
            if (w->pk && w->pk->width == 16) {
                mk_softmax_strip_w16(w->st + r0, w->st_ld, lo, hi, w->tile_max + r0, w->row_max + r0,
                                     w->row_sum + r0, w->correction + r0, MK_RV);
                continue;
            }
#endif
            SFX(softmax_strip)(w, r0, kb > 1 ? r0 + strip : r1, lo, hi);
        }
        SFX(tile_add_pv)(a, &tile, w, out, v);
    }
}

/* One query tile [i0, i0 + rows) of one head. */
static void SFX(softmax_tile)(const attnx_softmax_args *a, ptrdiff_t head, ptrdiff_t i0,
                              ptrdiff_t rows, SFX(tile_work) *w)
{
    const ptrdiff_t *off = a->offsets + head * ATTNX_SM_NOPS;
    const REAL *q = (const REAL *)((const char *)a->q + off[ATTNX_SM_Q]) + i0 * a->q_row;
    const REAL *k = (const REAL *)((const char *)a->k + off[ATTNX_SM_K]);
    const REAL *v = (const REAL *)((const char *)a->v + off[ATTNX_SM_V]);
    REAL *out = (REAL *)((char *)a->out + off[ATTNX_SM_OUT]) + i0 * a->out_row;
    const REAL *bias = a->bias ? (const REAL *)((const char *)a->bias + off[ATTNX_SM_BIAS]) : NULL;
    const unsigned char *mask = a->mask ? a->mask + off[ATTNX_SM_MASK] : NULL;
    const ptrdiff_t e = a->e;
    const REAL scale2 = (REAL)(a->scale * 1.44269504088896340736);
    int per_query = (bias && !SFX(bias_per_key)(a)) || (mask && !SFX(mask_per_key)(a));

    for (ptrdiff_t r = 0; r < w->st_ld; r++) {
        w->row_max[r] = -(REAL)INFINITY;
        w->row_sum[r] = 0;
    }
    if (w->ot)
        memset(w->ot, 0, (size_t)((w->amx ? w->amx->e_pad : e) * w->st_ld) * sizeof(REAL));
    else
        for (ptrdiff_t r = 0; r < rows; r++)
            for (ptrdiff_t c = 0; c < e; c++) out[r * a->out_row + c] = 0;

    /* the keys any row of the tile can see; with the micro-kernels, from a
     * panel's start (the keys before the band are hidden like any other) */
    ptrdiff_t key_first = attnx_band_first(&a->band, i0);
    ptrdiff_t key_end = attnx_band_end(&a->band, i0 + rows - 1);
    if (mask && SFX(mask_per_key)(a)) {
        /* key padding: the keys past the last kept one (and before the
         * first) are not computed at all */
        while (key_end > key_first && !mask[(key_end - 1) * a->mask_col]) key_end--;
        while (key_first < key_end && !mask[key_first * a->mask_col]) key_first++;
    }
#if !REAL_IS_DOUBLE && defined(ATTNX_HAVE_AMX)
    if (w->amx)
        amx_key_tiles(a, w, q, k, v, bias, mask, i0, rows, key_first - key_first % 32, key_end,
                      scale2, per_query);
    else
#endif
        SFX(mk_key_tiles)(a, w, q, k, v, out, bias, mask, i0, rows, key_first, key_end, scale2,
                          per_query);

    /* normalise; a row that saw nothing has row_sum 0 and gives 0. The
     * transposed tile (micro-kernels, AMX) is normalised down its columns,
     * then copied out: the output rows are written once. */
    REAL *inverse_sum = w->shift;
    for (ptrdiff_t r = 0; r < rows; r++) inverse_sum[r] = w->row_sum[r] == 0 ? 0 : 1 / w->row_sum[r];
#ifdef MK_HAVE_X86
    if (w->ot) {
        for (ptrdiff_t c = 0; c < e; c++)
            for (ptrdiff_t r = 0; r < rows; r++) w->ot[c * w->st_ld + r] *= inverse_sum[r];
        SFX(mk_transpose)(out, a->out_row, w->ot, w->st_ld, e, rows, w->pk ? w->pk->width : 16);
    }
#endif
    if (!w->ot)
        for (ptrdiff_t r = 0; r < rows; r++) SFX(scale_row)(out + r * a->out_row, e, inverse_sum[r]);

    if (!a->lse) return;
    REAL *lse = (REAL *)((char *)a->lse + off[ATTNX_SM_LSE]) + i0;
    if (a->key_sqnorm_coef != 0)
        /* gaussian: lse of the true scores, -|q_i - k_j|^2 / (2 sigma^2) */
        SFX(sqnorm_terms)(lse, q, a->q_row, rows, a->d, (REAL)a->key_sqnorm_coef);
    for (ptrdiff_t r = 0; r < rows; r++) {
        REAL row_sum = w->row_sum[r], query_term = a->key_sqnorm_coef != 0 ? lse[r] : 0;
        lse[r] = row_sum == 0 ? -(REAL)INFINITY
                              : (REAL)(((double)w->row_max[r] + log2((double)row_sum)) *
                                       0.69314718055994530942) + query_term;
    }
}

/* work item `item`: query tile item % q_tiles, of q_tile rows, of head
 * item / q_tiles */
static void SFX(item_tile)(const attnx_softmax_args *a, ptrdiff_t item, ptrdiff_t q_tiles,
                           ptrdiff_t q_tile, SFX(tile_work) *w)
{
    ptrdiff_t i0 = item % q_tiles * q_tile;
    SFX(softmax_tile)(a, item / q_tiles, i0, ATTNX_MIN(q_tile, a->n - i0), w);
}

int SFX(attnx_softmax_fwd)(const attnx_softmax_args *a)
{
    /* the micro-kernels where the CPU has them, e is whole groups of a
     * panel's width (the P V kernel's columns) and the tiles have rows
     * enough to pay for packing the keys; AMX on top for float32, where
     * the keys' operands (all of the head's) need not be kept to a window */
    int cpu_width = attnx_mk_width();
    int width = cpu_width && a->e % MK_KB(cpu_width) == 0 && a->n >= MK_MIN_ROWS ? cpu_width : 0;
    int use_amx = 0;
#if !REAL_IS_DOUBLE && defined(ATTNX_HAVE_AMX)
    use_amx = width == 16 && attnx_amx_enabled() && attnx_amx_usable() &&
              !(a->band.has_lo && a->band.has_hi);
#endif
    ptrdiff_t q_tile = use_amx ? AMX_Q_TILE : Q_TILE;
    ptrdiff_t q_tiles = (a->n + q_tile - 1) / q_tile;
    ptrdiff_t work = a->heads * q_tiles;
    if (work == 0) return ATTNX_OK;
    int threads = a->num_threads;
    if (threads > work) threads = (int)work;
    /* waking a second thread costs more than ~a million flops take */
    if ((double)a->heads * a->n * a->m * (a->d + a->e) < 1e6) threads = 1;
    if (threads < 1) threads = 1;

    ptrdiff_t kb = width && !use_amx ? MK_KB(width) : 1;
    /* slots of packed keys: every panel, or under a window the keys of two
     * neighbouring query tiles, and at least one key tile's panels (the
     * band may be empty: hi_shift < lo_shift) */
    ptrdiff_t slots = width && !use_amx ? (a->m + kb - 1) / kb : 0;
    if (a->band.has_lo && a->band.has_hi) {
        ptrdiff_t span = ATTNX_MAX(2 * Q_TILE + (a->band.hi_shift - a->band.lo_shift) + 1, KEY_TILE);
        slots = ATTNX_MIN(slots, (span + kb - 1) / kb + 2);
    }
    /* the micro-kernels fill whole strips of lanes, AMX whole blocks; the
     * plain loops use just the rows (a decoding step: one) */
    ptrdiff_t row_align = use_amx ? 32 : MK_ROW_ALIGN;
    ptrdiff_t st_ld = width ? ATTNX_MIN(q_tile, (a->n + row_align - 1) / row_align * row_align)
                            : ATTNX_MIN(q_tile, a->n);
    /* AMX reads and writes 16 rows of st and ot at a time: rows 1 KiB apart
     * would share 4 of L1's 64 sets */
    if (use_amx) st_ld += 16;
    /* AMX operands pad d, e and m to whole steps of 32 */
    ptrdiff_t d_pad = (a->d + 31) / 32 * 32, e_pad = (a->e + 31) / 32 * 32;
    ptrdiff_t m_pad = (a->m + 31) / 32 * 32;
    ptrdiff_t d_rows = use_amx ? d_pad : a->d, e_rows = use_amx ? e_pad : a->e;

    /* per-thread scratch, each part a whole number of cache lines: packed
     * keys and values, packed queries, the transposed output, scores tile,
     * key term, the lane arrays; for AMX, the operands (in numbers of
     * REAL's size: two bfloat16 per float) */
    ptrdiff_t line = 64 / (ptrdiff_t)sizeof(REAL);
#define LINES(count) (((ptrdiff_t)(count) + line - 1) / line * line)
    /* values are packed when more than one query tile reads them */
    int pack_values = width && !use_amx && q_tiles > 1;
    ptrdiff_t packed = LINES(slots * kb * a->d), packed_v = pack_values ? LINES(slots * kb * a->e) : 0;
    ptrdiff_t queries = width ? LINES(st_ld * d_rows) : 0, outputs = width ? LINES(st_ld * e_rows) : 0;
    ptrdiff_t tile = LINES(KEY_TILE * st_ld), key_terms = LINES(KEY_TILE), lanes = LINES(st_ld);
    ptrdiff_t k_op = 0, v_op = 0, q_op = 0, p_op = 0, v_t = 0;
    if (use_amx) {
        k_op = LINES(AMX_PLANES * m_pad * d_pad / 2);
        v_op = LINES(AMX_PLANES * e_pad * m_pad / 2);
        q_op = LINES(AMX_PLANES * d_pad * st_ld / 2);
        p_op = LINES(AMX_PLANES * KEY_TILE * 32 / 2);
        v_t = LINES(a->e * 32);
    }
    ptrdiff_t per_thread = packed + packed_v + queries + outputs + tile + key_terms + 6 * lanes +
                           k_op + v_op + q_op + p_op + v_t;
#undef LINES
    REAL *scratch = NULL;
    ptrdiff_t v_blocks = (a->m + V_BLOCK - 1) / V_BLOCK;
    unsigned char *v_states = malloc((size_t)(v_blocks * threads) + 1);
    ptrdiff_t *owners = malloc((size_t)(slots * threads + 1) * sizeof *owners);
    packed_panels *pks = calloc((size_t)threads, sizeof *pks);
    amx_operands *amxs = calloc((size_t)threads, sizeof *amxs);
    unsigned char *amx_packed = malloc((size_t)(threads * (m_pad / 32)) + 1);
    SFX(tile_work) *works = calloc((size_t)threads, sizeof *works);
    item_range *shares = malloc((size_t)threads * sizeof *shares);
    int status = ATTNX_ENOMEM;
    if (!v_states || !owners || !pks || !amxs || !amx_packed || !works || !shares ||
        posix_memalign((void **)&scratch, 64, (size_t)(per_thread * threads) * sizeof(REAL)))
        goto done;
    for (int t = 0; t < threads; t++) {
        SFX(tile_work) *w = &works[t];
        REAL *base = scratch + per_thread * t, *qt = base + packed + packed_v;
        REAL *st = qt + queries + outputs, *lane = st + tile + key_terms;
        *w = (SFX(tile_work)){
            .st = st,
            .st_ld = st_ld,
            .qt = qt,
            .key_term = st + tile,
            .tile_max = lane,
            .row_max = lane + lanes,
            .row_sum = lane + 2 * lanes,
            .correction = lane + 3 * lanes,
            .shift = lane + 4 * lanes,
            .tile_sum = lane + 5 * lanes,
            .v_state = v_states + v_blocks * t,
        };
        if (width) w->ot = qt + queries;
        if (width && !use_amx) {
            pks[t] = (packed_panels){width, base, pack_values ? base + packed : NULL,
                                     owners + slots * t, slots, NULL, NULL};
            w->pk = &pks[t];
        }
        if (use_amx) {
            REAL *ops = lane + 6 * lanes;
            amxs[t] = (amx_operands){
                .k_op = (uint16_t *)ops,
                .v_op = (uint16_t *)(ops + k_op),
                .q_op = (uint16_t *)(ops + k_op + v_op),
                .p_op = (uint16_t *)(ops + k_op + v_op + q_op),
                .v_t = (float *)(ops + k_op + v_op + q_op + p_op),
                .packed = amx_packed + t * (m_pad / 32),
                .d_pad = d_pad,
                .e_pad = e_pad,
                .m_pad = m_pad,
            };
            w->amx = &amxs[t];
            /* Q^T's padding rows past d, which no pass writes */
            memset(qt + a->d * st_ld, 0, (size_t)((d_pad - a->d) * st_ld) * sizeof(REAL));
        }
    }

    /* each thread a share of consecutive items, whole heads when they split
     * evenly, then what is left of the others' (claim_item). One thread
     * runs on the caller: a parallel region of one costs about 0.2 us, a
     * tenth of a tiny call. */
    if (threads == 1) {
        for (ptrdiff_t item = 0; item < work; item++) SFX(item_tile)(a, item, q_tiles, q_tile, works);
    } else {
        for (int t = 0; t < threads; t++)
            shares[t] = (item_range){work * t / threads, work * (t + 1) / threads};
#pragma omp parallel num_threads(threads)
        {
            int self = omp_get_thread_num();
            for (ptrdiff_t item; (item = claim_item(shares, threads, self)) >= 0;)
                SFX(item_tile)(a, item, q_tiles, q_tile, &works[self]);
        }
    }
    status = ATTNX_OK;
done:
    free(scratch);
    free(v_states);
    free(owners);
    free(pks);
    free(amxs);
    free(amx_packed);
    free(works);
    free(shares);
    return status;
}

#undef LOG2E
#ifdef MK_HAVE_X86
#undef MK_KERNEL
#endif
#endif /* REAL */
