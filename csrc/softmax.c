/* softmax.c - exact softmax attention, FlashAttention-style: the driver
 * (work split, tile loop, masks, the online softmax) and the plain C +
 * BLAS backend.
 *
 * For each head and each tile of query rows, walk the key tiles that the
 * rows can see (the causal/window band skips the rest), and keep per row
 * an online softmax: the running max, the running sum of 2^(s - max), and
 * the unnormalised output (in the output rows themselves, or with the
 * micro-kernels and AMX in a transposed tile, copied out at the end).
 * Memory is one scores tile per thread, and the packed keys and values of
 * a head: nothing grows with n * m.
 *
 * Backends (softmax_internal.h), chosen once per call (softmax_choose_backend) by
 * what the CPU has: float32 on AMX (softmax_amx.c) where it can, else the
 * AVX-512 or AVX2 micro-kernels (softmax_mk.c) for float32 and float64,
 * else BLAS and plain loops (here). AMX walks a query tile block of 32
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

#include "attnx.h"
#include "blas.h"
#include "convert.h"
#include "philox.h"
#include "softmax_internal.h"

/* Below this many queries, packing every key costs more than the
 * micro-kernels save (measured at m = 4096, d = 64: BLAS wins up to n = 40,
 * the micro-kernels from 48): BLAS or plain loops instead. */
#define MK_MIN_ROWS 48

ptrdiff_t softmax_claim_item(item_range *shares, int threads, int self)
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
#include "softmax_internal.h"

#define LOG2E ((REAL)1.44269504088896340736)

/* bias[j] = coef * |x_j|^2 over rows x_j (gaussian attention's -|k_j|^2 /
 * (2 sigma^2), and the query's own term of its lse) */
ATTNX_HOT void SFX(softmax_sqnorm_terms)(REAL *bias, const REAL *rows_x, ptrdiff_t x_row,
                                         ptrdiff_t count, ptrdiff_t d, REAL coef)
{
    for (ptrdiff_t j = 0; j < count; j++) {
        const REAL *x_j = rows_x + j * x_row;
        REAL sq = 0;
        for (ptrdiff_t c = 0; c < d; c++) sq += x_j[c] * x_j[c];
        bias[j] = coef * sq;
    }
}

/* key_term[j] for the tile's keys [j0, j0 + cols), in log2 units: the
 * gaussian term, a per-key bias, -inf for a key its mask removes; 0 in the
 * panel padding up to `padded`. */
void SFX(softmax_fill_key_term)(const attnx_softmax_args *a, REAL *key_term, const REAL *k,
                                const REAL *bias, const unsigned char *mask, ptrdiff_t j0,
                                ptrdiff_t cols, ptrdiff_t padded)
{
    if (a->key_sqnorm_coef != 0)
        SFX(softmax_sqnorm_terms)(key_term, k + j0 * a->k_row, a->k_row, cols, a->d,
                          (REAL)a->key_sqnorm_coef);
    else
        for (ptrdiff_t j = 0; j < cols; j++) key_term[j] = 0;
    if (bias && softmax_bias_per_key(a))
        for (ptrdiff_t j = 0; j < cols; j++) key_term[j] += bias[(j0 + j) * a->bias_col];
    for (ptrdiff_t j = 0; j < cols; j++) key_term[j] *= LOG2E;
    if (mask && softmax_mask_per_key(a))
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

/* A bias or mask that depends on the query as well: added to (or hiding)
 * the visible scores of rows [r0, r1) over the keys [lo, hi) their strip
 * computes, then those rows' max taken anew. */
void TYPED(softmax_apply_bias_mask_f32, softmax_apply_bias_mask_f64)(
    const attnx_softmax_args *a, const mk_tile *t, SFX(tile_work) *w, const REAL *bias,
    const unsigned char *mask, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t lo, ptrdiff_t hi)
{
    const REAL neg_inf = -(REAL)INFINITY;
    int use_bias = bias && !softmax_bias_per_key(a), use_mask = mask && !softmax_mask_per_key(a);
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
ATTNX_HOT void SFX(softmax_online_strip)(SFX(tile_work) *w, ptrdiff_t r0, ptrdiff_t r1,
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

/* value `at` of v: a number of the call's type, or (float32, kv_half)
 * bfloat16 bits widened */
static inline REAL SFX(value_at)(const void *v, ptrdiff_t at, int kv_half)
{
#if !REAL_IS_DOUBLE
    if (kv_half == ATTNX_BF16) return attnx_bf16_widened(((const uint16_t *)v)[at]);
#endif
    (void)kv_half;
    return ((const REAL *)v)[at];
}

/* 1 when `count` rows of values from row `first` hold inf or NaN */
static int SFX(values_nonfinite)(const attnx_softmax_args *a, const void *v, ptrdiff_t first,
                                 ptrdiff_t count)
{
#if !REAL_IS_DOUBLE
    if (a->kv_half == ATTNX_BF16) {
        /* the exponent's bits all set */
        const uint16_t *bits = (const uint16_t *)v + first * a->v_row;
        uint16_t all_set = 0;
        for (ptrdiff_t j = 0; j < count; j++)
            for (ptrdiff_t c = 0; c < a->e; c++)
                all_set |= (bits[j * a->v_row + c] & 0x7f80u) == 0x7f80u;
        return all_set;
    }
#endif
    return SFX(has_nonfinite)((const REAL *)v + first * a->v_row, count, a->e, a->v_row);
}

/* 1 when the values of the keys [j0, j0 + cols) are all finite; each
 * block of V_BLOCK keys is checked once per head and thread */
int TYPED(softmax_values_finite_f32, softmax_values_finite_f64)(
    const attnx_softmax_args *a, SFX(tile_work) *w, const void *v, ptrdiff_t j0, ptrdiff_t cols)
{
    if (w->v_seen != v) {
        memset(w->v_state, 0, (size_t)((a->m + V_BLOCK - 1) / V_BLOCK));
        w->v_seen = v;
    }
    for (ptrdiff_t b = j0 / V_BLOCK; b * V_BLOCK < j0 + cols; b++) {
        if (!w->v_state[b]) {
            ptrdiff_t first = b * V_BLOCK, count = ATTNX_MIN(V_BLOCK, a->m - first);
            w->v_state[b] = SFX(values_nonfinite)(a, v, first, count) ? 2 : 1;
        }
        if (w->v_state[b] == 2) return 0;
    }
    return 1;
}

/* acc_r += sum_j p_rj v_j over the keys with p_rj != 0 only: the path for
 * value tiles holding inf or NaN, where the product's 0 * NaN would leak a
 * hidden key's NaN into rows that cannot see it. acc's element (r, c) is
 * at acc[r acc_row + c acc_col]; v_tile holds numbers of the call's type,
 * or half-precision bits (kv_half). */
void TYPED(softmax_add_visible_values_f32, softmax_add_visible_values_f64)(
    const mk_tile *t, REAL *acc, ptrdiff_t acc_row, ptrdiff_t acc_col, const REAL *pt,
    ptrdiff_t pt_ld, const void *v_tile, ptrdiff_t v_row, ptrdiff_t e, int kv_half)
{
    for (ptrdiff_t r = 0; r < t->rows; r++) {
        ptrdiff_t lo, hi;
        mk_block_keys(t, r, 1, &lo, &hi);
        for (ptrdiff_t j = lo; j < hi; j++) {
            REAL p_rj = pt[j * pt_ld + r];
            if (p_rj == 0) continue;
            for (ptrdiff_t c = 0; c < e; c++)
                acc[r * acc_row + c * acc_col] += p_rj * SFX(value_at)(v_tile, j * v_row + c,
                                                                        kv_half);
        }
    }
}

static ATTNX_HOT void SFX(scale_row)(REAL *row, ptrdiff_t count, REAL factor)
{
    for (ptrdiff_t j = 0; j < count; j++) row[j] *= factor;
}

/* ------------------------------------------------------------------------
 * The plain backend: scores and P V by BLAS (plain loops for small
 * products), the output accumulated in place in its rows. */

/* zero the tile's output rows */
static void SFX(plain_prepare_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                    SFX(tile_work) *w, const REAL *q, const REAL *k,
                                    const REAL *v, REAL *out, ptrdiff_t rows, REAL scale2)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t c = 0; c < a->e; c++) out[r * a->out_row + c] = 0;
}

/* all of the tile's keys for all its rows */
static void SFX(plain_scores)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                              const mk_tile *t, SFX(tile_work) *w, const REAL *q, const REAL *k,
                              const REAL *v, REAL scale2)
{
    SFX(gemm)(0, 1, t->cols, t->rows, a->d, scale2, k + t->j0 * a->k_row, a->k_row, q, a->q_row,
              0, w->st, w->st_ld);
    SFX(finish_scores)(t, w->st, w->st_ld, w->key_term, w->tile_max);
}

/* out (rows, e) times the rows' correction, then += P V_tile, P^T the
 * probabilities in st */
static void SFX(plain_add_pv)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                              const mk_tile *t, SFX(tile_work) *w, REAL *out, const REAL *v)
{
    const REAL *v_tile = v + t->j0 * a->v_row;
    int finite = SFX(softmax_values_finite)(a, w, v, t->j0, t->cols);
    for (ptrdiff_t r = 0; r < t->rows; r++)
        if (w->correction[r] != 1) SFX(scale_row)(out + r * a->out_row, a->e, w->correction[r]);
    if (!finite)
        SFX(softmax_add_visible_values)(t, out, a->out_row, 1, w->st, w->st_ld, v_tile, a->v_row,
                                        a->e, 0);
    else
        SFX(gemm)(1, 0, t->rows, a->e, t->cols, 1, w->st, w->st_ld, v_tile, a->v_row, 1, out,
                  a->out_row);
}

static void SFX(plain_finish_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                   SFX(tile_work) *w, REAL *out, ptrdiff_t rows,
                                   const REAL *inverse_sum)
{
    for (ptrdiff_t r = 0; r < rows; r++) SFX(scale_row)(out + r * a->out_row, a->e, inverse_sum[r]);
}

static const SFX(softmax_backend) SFX(softmax_plain) = {
    .width = 0,
    .mk = NULL,
    .q_tile = Q_TILE,
    .row_align = 1, /* just the rows (a decoding step: one) */
    .st_pad = 0,
    .kb = 1,
    .strip = 0,
    .setup = NULL,
    .prepare_tile = SFX(plain_prepare_tile),
    .key_tile = SFX(softmax_strips_key_tile),
    .scores = SFX(plain_scores),
    .softmax_strip = SFX(softmax_online_strip),
    .add_pv = SFX(plain_add_pv),
    .finish_tile = SFX(plain_finish_tile),
};

/* ------------------------------------------------------------------------
 * The driver */

/* Dropout: the weights of the tile's rows that the Philox decisions of
 * (seed, head, i, j) drop are set to 0 before P V; the rows' sums (and
 * so lse) keep them, and finish scales what is kept by 1 / (1 - p). */
static void SFX(softmax_drop)(const attnx_softmax_args *a, const mk_tile *t, SFX(tile_work) *w)
{
    unsigned char keep[KEY_TILE];
    uint32_t threshold = attnx_dropout_threshold(a->dropout_p);
    for (ptrdiff_t r = 0; r < t->rows; r++) {
        attnx_dropout_row(a->seed, (uint64_t)w->head, (uint64_t)(t->i0 + r), (uint64_t)t->j0,
                          t->cols, threshold, keep);
        for (ptrdiff_t j = 0; j < t->cols; j++)
            if (!keep[j]) w->st[j * w->st_ld + r] = 0;
    }
}

void SFX(softmax_strips_key_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                                  const mk_tile *t, SFX(tile_work) *w, const REAL *q,
                                  const REAL *k, const REAL *v, REAL *out, const REAL *bias,
                                  const unsigned char *mask, REAL scale2, int per_query)
{
    ptrdiff_t strip = be->strip ? be->strip : t->rows, kb = be->kb;
    for (ptrdiff_t r = 0; r < w->st_ld; r++) w->tile_max[r] = -(REAL)INFINITY;
    be->scores(be, a, t, w, q, k, v, scale2);
    for (ptrdiff_t r0 = 0; r0 < t->rows; r0 += strip) {
        ptrdiff_t lo = 0, hi = t->cols, r1 = ATTNX_MIN(r0 + strip, t->rows);
        if (kb > 1) mk_strip_keys(t, r0, strip, kb, &lo, &hi);
        if (per_query) SFX(softmax_apply_bias_mask)(a, t, w, bias, mask, r0, r1, lo, hi);
        /* a strip of the micro-kernels runs over all its lanes */
        be->softmax_strip(w, r0, kb > 1 ? r0 + strip : r1, lo, hi);
    }
    if (a->dropout_p > 0) SFX(softmax_drop)(a, t, w);
    be->add_pv(be, a, t, w, out, v);
}

/* The backend of this call: the micro-kernels where the CPU has them, e is
 * whole groups of a panel's width (the P V kernel's columns) and the tiles
 * have rows enough to pay for packing the keys; AMX on top for float32,
 * where the keys' operands (all of the head's) need not be kept to a
 * window and no dropout (which its walk by blocks does not apply); each
 * only where the softmax forward's table chose it (dispatch.h). */
const SFX(softmax_backend) *SFX(softmax_choose_backend)(const attnx_softmax_args *a)
{
    int set = attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD);
    int cpu_width = attnx_kernels_width(set);
    if (!cpu_width || a->e % MK_KB(cpu_width) != 0 || a->n < MK_MIN_ROWS)
        return &SFX(softmax_plain);
#if !REAL_IS_DOUBLE && defined(ATTNX_HAVE_AMX)
    if (set == ATTNX_KERNELS_AMX && !(a->band.has_lo && a->band.has_hi) && a->dropout_p == 0)
        return &softmax_amx_f32;
#endif
#if defined(MK_HAVE_NEON)
    return &SFX(softmax_mk_neon);
#elif defined(MK_HAVE_X86)
    return cpu_width == 16 ? &SFX(softmax_mk_avx512) : &SFX(softmax_mk_avx2);
#else
    return &SFX(softmax_plain);
#endif
}

/* One query tile [i0, i0 + rows) of one head. */
static void SFX(softmax_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                              ptrdiff_t head, ptrdiff_t i0, ptrdiff_t rows, SFX(tile_work) *w)
{
    const ptrdiff_t *off = a->offsets + head * ATTNX_SM_NOPS;
    const REAL *q = (const REAL *)((const char *)a->q + off[ATTNX_SM_Q]) + i0 * a->q_row;
    const REAL *k = (const REAL *)((const char *)a->k + off[ATTNX_SM_K]);
    const REAL *v = (const REAL *)((const char *)a->v + off[ATTNX_SM_V]);
    REAL *out = (REAL *)((char *)a->out + off[ATTNX_SM_OUT]) + i0 * a->out_row;
    const REAL *bias = a->bias ? (const REAL *)((const char *)a->bias + off[ATTNX_SM_BIAS]) : NULL;
    const unsigned char *mask = a->mask ? a->mask + off[ATTNX_SM_MASK] : NULL;
    const REAL scale2 = (REAL)(a->scale * 1.44269504088896340736);
    int per_query = (bias && !softmax_bias_per_key(a)) || (mask && !softmax_mask_per_key(a));

    for (ptrdiff_t r = 0; r < w->st_ld; r++) {
        w->row_max[r] = -(REAL)INFINITY;
        w->row_sum[r] = 0;
    }
    w->head = head;

    /* the keys any row of the tile can see; from a panel's start (the keys
     * before the band are hidden like any other) */
    ptrdiff_t key_first = attnx_band_first(&a->band, i0);
    ptrdiff_t key_end = attnx_band_end(&a->band, i0 + rows - 1);
    if (mask && softmax_mask_per_key(a)) {
        /* key padding: the keys past the last kept one (and before the
         * first) are not computed at all */
        while (key_end > key_first && !mask[(key_end - 1) * a->mask_col]) key_end--;
        while (key_first < key_end && !mask[key_first * a->mask_col]) key_first++;
    }
    key_first -= key_first % be->kb;

    be->prepare_tile(be, a, w, q, k, v, out, rows, scale2);
    for (ptrdiff_t j0 = key_first; j0 < key_end; j0 += KEY_TILE) {
        /* an interrupted call stops here too: a tile over many keys takes long */
        if (attnx_interrupted(a->interrupt, w->calling_thread)) return;
        ptrdiff_t cols = ATTNX_MIN(KEY_TILE, key_end - j0);
        const mk_tile tile = {&a->band, i0, rows, j0, cols};
        SFX(softmax_fill_key_term)(a, w->key_term, k, bias, mask, j0, cols,
                                   (cols + be->kb - 1) / be->kb * be->kb);
        be->key_tile(be, a, &tile, w, q, k, v, out, bias, mask, scale2, per_query);
    }

    /* normalise (and scale up what dropout kept); a row that saw nothing
     * has row_sum 0 and gives 0 */
    REAL *inverse_sum = w->shift, kept = (REAL)(1 / (1 - a->dropout_p));
    for (ptrdiff_t r = 0; r < rows; r++)
        inverse_sum[r] = w->row_sum[r] == 0 ? 0 : kept / w->row_sum[r];
    be->finish_tile(be, a, w, out, rows, inverse_sum);

    if (!a->lse) return;
    REAL *lse = (REAL *)((char *)a->lse + off[ATTNX_SM_LSE]) + i0;
    if (a->key_sqnorm_coef != 0)
        /* gaussian: lse of the true scores, -|q_i - k_j|^2 / (2 sigma^2) */
        SFX(softmax_sqnorm_terms)(lse, q, a->q_row, rows, a->d, (REAL)a->key_sqnorm_coef);
    for (ptrdiff_t r = 0; r < rows; r++) {
        REAL row_sum = w->row_sum[r], query_term = a->key_sqnorm_coef != 0 ? lse[r] : 0;
        lse[r] = row_sum == 0 ? -(REAL)INFINITY
                              : (REAL)(((double)w->row_max[r] + log2((double)row_sum)) *
                                       0.69314718055994530942) + query_term;
    }
}

/* work item `item`: query tile item % q_tiles, of q_tile rows, of head
 * item / q_tiles */
static void SFX(item_tile)(const SFX(softmax_backend) *be, const attnx_softmax_args *a,
                           ptrdiff_t item, const softmax_plan *plan, SFX(tile_work) *w)
{
    ptrdiff_t i0 = item % plan->q_tiles * plan->q_tile;
    SFX(softmax_tile)(be, a, item / plan->q_tiles, i0, ATTNX_MIN(plan->q_tile, a->n - i0), w);
}

int TYPED(attnx_softmax_fwd_f32, attnx_softmax_fwd_f64)(const attnx_softmax_args *a)
{
    /* a few queries against many keys: the keys split across threads */
    if (SFX(softmax_decode_applies)(a)) return SFX(softmax_decode)(a);
    const SFX(softmax_backend) *be = SFX(softmax_choose_backend)(a);
    if (a->kv_half && !SFX(softmax_mk_reads_half_kv)(a, be)) return ATTNX_EINVAL;
    softmax_plan plan = {.q_tile = be->q_tile};
    plan.q_tiles = (a->n + plan.q_tile - 1) / plan.q_tile;
    ptrdiff_t work = a->heads * plan.q_tiles;
    if (work == 0) return ATTNX_OK;
    int threads = a->num_threads;
    if (threads > work) threads = (int)work;
    /* waking a second thread costs more than ~a million flops take */
    if ((double)a->heads * a->n * a->m * (a->d + a->e) < 1e6) threads = 1;
    if (threads < 1) threads = 1;
    plan.threads = threads;
    /* the micro-kernels fill whole strips of lanes, AMX whole blocks */
    plan.st_ld = ATTNX_MIN(plan.q_tile, (a->n + be->row_align - 1) / be->row_align * be->row_align) +
                 be->st_pad;

    /* per-thread scratch, each part a whole number of cache lines: scores
     * tile, key term, the lane arrays; the backend's operands beside */
    const ptrdiff_t size = (ptrdiff_t)sizeof(REAL);
    ptrdiff_t tile = softmax_lines(KEY_TILE * plan.st_ld, size);
    ptrdiff_t key_terms = softmax_lines(KEY_TILE, size), lanes = softmax_lines(plan.st_ld, size);
    ptrdiff_t per_thread = tile + key_terms + 6 * lanes;
    REAL *scratch = NULL;
    ptrdiff_t v_blocks = (a->m + V_BLOCK - 1) / V_BLOCK;
    unsigned char *v_states = malloc((size_t)(v_blocks * threads) + 1);
    SFX(tile_work) *works = calloc((size_t)threads, sizeof *works);
    item_range *shares = malloc((size_t)threads * sizeof *shares);
    softmax_memory memory = {{NULL}};
    int status = ATTNX_ENOMEM;
    scratch = attnx_aligned_alloc(64, (size_t)(per_thread * threads) * sizeof(REAL));
    if (!v_states || !works || !shares || !scratch) goto done;
    for (int t = 0; t < threads; t++) {
        REAL *st = scratch + per_thread * t, *lane = st + tile + key_terms;
        works[t] = (SFX(tile_work)){
            .st = st,
            .st_ld = plan.st_ld,
            .key_term = st + tile,
            .tile_max = lane,
            .row_max = lane + lanes,
            .row_sum = lane + 2 * lanes,
            .correction = lane + 3 * lanes,
            .shift = lane + 4 * lanes,
            .tile_sum = lane + 5 * lanes,
            .v_state = v_states + v_blocks * t,
            .calling_thread = t == 0,
        };
    }
    if (be->setup && (status = be->setup(be, a, &plan, works, &memory)) != ATTNX_OK) goto done;

    /* each thread a share of consecutive items, whole heads when they split
     * evenly, then what is left of the others' (softmax_claim_item). One thread
     * runs on the caller: a parallel region of one costs a tenth of a tiny
     * call. */
    if (threads == 1) {
        for (ptrdiff_t item = 0; item < work && !attnx_interrupted(a->interrupt, 1); item++)
            SFX(item_tile)(be, a, item, &plan, works);
    } else {
        for (int t = 0; t < threads; t++)
            shares[t] = (item_range){work * t / threads, work * (t + 1) / threads};
#pragma omp parallel num_threads(attnx_omp_threads(threads))
        {
            int self = omp_get_thread_num();
            for (ptrdiff_t item; !attnx_interrupted(a->interrupt, self == 0) &&
                                 (item = softmax_claim_item(shares, threads, self)) >= 0;)
                SFX(item_tile)(be, a, item, &plan, &works[self]);
        }
    }
    status = a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
done:
    attnx_aligned_free(memory.blocks[0]);
    for (int b = 1; b < SOFTMAX_BLOCKS; b++) free(memory.blocks[b]);
    attnx_aligned_free(scratch);
    free(v_states);
    free(works);
    free(shares);
    return status;
}

#undef LOG2E
#endif /* REAL */
