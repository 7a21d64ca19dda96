/* softmax.c - exact softmax attention, FlashAttention-style.
 *
 * For each head and each tile of Q_TILE query rows, walk the key tiles that
 * the rows can see (the causal/window band skips the rest), and keep per
 * row an online softmax: the running max, the running sum of exp(s - max),
 * and the unnormalised output in the output rows themselves. Memory is one
 * scores tile per thread: nothing grows with n * m.
 *
 * Legend: n queries, m keys, d features, e value features.
 *   scores (rows, KEY_TILE)  scale * Q_tile K_tile^T, then p = exp(s - max)
 *   out    (rows, e)         sum_j p_ij v_j, rescaled when the max grows
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "attnx.h"
#include "blas.h"
#include "microkernel.h"

/* Tile sizes: a scores tile of Q_TILE x KEY_TILE stays in L2, and tall
 * query tiles amortise BLAS's packing of each key and value tile over many
 * rows (measured on AVX-512: 256 x 256 beat 64 x 256 by ~15%; with the
 * micro-kernels, 128 x 256, 256 x 128 and 256 x 512 are within noise). */
#define Q_TILE 256
#define KEY_TILE 256

/* Below this many queries, packing every key costs more than the
 * micro-kernels save (measured at m = 4096, d = 64: BLAS wins up to n = 40,
 * the micro-kernels from 48): BLAS or plain loops instead. */
#define MK_MIN_ROWS 48

/* One thread's keys of one head, packed for the float32 micro-kernels; a
 * panel is packed the first time a query tile needs it, and reused by every
 * later tile of the head (and of heads that share the keys). */
typedef struct {
    int width;            /* floats per vector of the micro-kernels */
    float *kt;            /* (m rounded up to MK_NR(width), d) */
    unsigned char *ready; /* per panel: packed yet */
    ptrdiff_t panels;
    const void *k;        /* the keys whose panels are in kt */
} packed_keys;

#define ATTNX_FAMILY_FILE "softmax.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */

/* p_j = exp(s_j - max) in place over s[0, count); returns sum_j p_j and sets
 * *has_zero when some p_j is 0 (float32 on AVX-512: mk_exp_sum_w16). */
typedef REAL (*SFX(exp_sum_fn))(REAL *s, ptrdiff_t count, REAL max, int *has_zero);

static ATTNX_HOT REAL SFX(exp_sum)(REAL *s, ptrdiff_t count, REAL max, int *has_zero)
{
    REAL sum = 0;
    int zeros = 0;
#pragma omp simd reduction(+ : sum, zeros)
    for (ptrdiff_t j = 0; j < count; j++) {
        REAL p = SFX(vexp)(s[j] - max);
        s[j] = p;
        sum += p;
        zeros += p == 0;
    }
    if (zeros) *has_zero = 1;
    return sum;
}

/* Pass 2 for one row of a tile: add bias, mask, then fold the tile into the
 * online softmax. Invariant, per row: out = sum_j exp(s_j - row_max) v_j
 * and row_sum = sum_j exp(s_j - row_max) over the keys seen so far; a row
 * that has seen no visible key keeps row_max = -inf, row_sum = 0, out = 0.
 * Returns the factor by which `out` must be rescaled (1 when unchanged). */
static ATTNX_HOT REAL SFX(online_softmax_row)(REAL *scores, ptrdiff_t cols, ptrdiff_t vis_lo,
                                              ptrdiff_t vis_hi, const REAL *bias_row,
                                              ptrdiff_t bias_col, const unsigned char *mask_row,
                                              ptrdiff_t mask_col, const REAL *key_bias,
                                              SFX(exp_sum_fn) exp_sum, REAL *row_max,
                                              REAL *row_sum, int *has_zero)
{
    const REAL neg_inf = -(REAL)INFINITY;
    if (bias_row)
        for (ptrdiff_t j = vis_lo; j < vis_hi; j++) scores[j] += bias_row[j * bias_col];
    if (key_bias)
        for (ptrdiff_t j = vis_lo; j < vis_hi; j++) scores[j] += key_bias[j];
    if (mask_row)
        for (ptrdiff_t j = vis_lo; j < vis_hi; j++)
            scores[j] = mask_row[j * mask_col] ? scores[j] : neg_inf;

    REAL tile_max = neg_inf;
#pragma omp simd reduction(max : tile_max)
    for (ptrdiff_t j = vis_lo; j < vis_hi; j++) tile_max = scores[j] > tile_max ? scores[j] : tile_max;
    REAL new_max = tile_max > *row_max ? tile_max : *row_max;

    for (ptrdiff_t j = 0; j < vis_lo; j++) scores[j] = 0;
    for (ptrdiff_t j = vis_hi; j < cols; j++) scores[j] = 0;
    if (vis_lo > 0 || vis_hi < cols || new_max == neg_inf) *has_zero = 1;
    if (new_max == neg_inf) {
        /* Nothing visible yet (exp(-inf - -inf) would be NaN), unless the
         * max skipped NaN scores: then the row must come out NaN. */
        for (ptrdiff_t j = vis_lo; j < vis_hi; j++) {
            if (scores[j] != scores[j]) *row_sum = scores[j];
            scores[j] = 0;
        }
        return 1;
    }
    REAL tile_sum = exp_sum(scores + vis_lo, vis_hi - vis_lo, new_max, has_zero);
    REAL correction = *row_max == new_max ? 1 : SFX(vexp)(*row_max - new_max);
    *row_sum = *row_sum * correction + tile_sum;
    *row_max = new_max;
    return correction;
}

/* 0 when every entry of the (rows, cols) block is finite. */
static ATTNX_HOT int SFX(has_nonfinite)(const REAL *block, ptrdiff_t rows, ptrdiff_t cols,
                                        ptrdiff_t row_stride)
{
    REAL probe = 0;
    for (ptrdiff_t r = 0; r < rows; r++)
#pragma omp simd reduction(+ : probe)
        for (ptrdiff_t c = 0; c < cols; c++) probe += block[r * row_stride + c] * 0;
    return probe != 0;
}

/* out_r += sum_j p_rj v_j over the keys with p_rj != 0 only: the slow path
 * for value tiles holding inf or NaN, where the GEMM's 0 * NaN would leak
 * a masked key's NaN into rows that cannot see it. */
static void SFX(add_visible_values)(REAL *out, ptrdiff_t out_row, const REAL *p, ptrdiff_t p_row,
                                    const REAL *v_tile, ptrdiff_t v_row, ptrdiff_t rows,
                                    ptrdiff_t cols, ptrdiff_t e)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        for (ptrdiff_t j = 0; j < cols; j++) {
            REAL p_rj = p[r * p_row + j];
            if (p_rj == 0) continue;
            for (ptrdiff_t c = 0; c < e; c++) out[r * out_row + c] += p_rj * v_tile[j * v_row + c];
        }
}

static ATTNX_HOT void SFX(scale_row)(REAL *row, ptrdiff_t count, REAL factor)
{
    for (ptrdiff_t j = 0; j < count; j++) row[j] *= factor;
}

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

/* scores (rows, cols) = scale * Q K_tile^T for the tile's keys [j0, j0 +
 * cols); pk: the micro-kernels' packed keys, NULL for BLAS (always for
 * float64), which computes the scores outside the band too. */
static void SFX(tile_scores)(const attnx_softmax_args *a, const mk_tile *t, packed_keys *pk,
                             REAL *scores, const REAL *q, const REAL *k)
{
    ptrdiff_t rows = t->rows, j0 = t->j0, cols = t->cols;
#if !REAL_IS_DOUBLE
    if (pk) {
        ptrdiff_t nr = MK_NR(pk->width), p0 = j0 / nr, p1 = (j0 + cols + nr - 1) / nr;
        for (ptrdiff_t p = p0; p < p1; p++)
            if (!pk->ready[p]) {
                attnx_mk_pack_keys(pk->kt + p * nr * a->d, k + p * nr * a->k_row, a->k_row,
                                   ATTNX_MIN(nr, a->m - p * nr), a->d, nr);
                pk->ready[p] = 1;
            }
        attnx_mk_scores(pk->width, t, scores, KEY_TILE, q, a->q_row, pk->kt + j0 * a->d, a->d,
                        (float)a->scale);
        return;
    }
#endif
    SFX(gemm)(0, 1, rows, cols, a->d, (REAL)a->scale, q, a->q_row, k + j0 * a->k_row, a->k_row,
              0, scores, KEY_TILE);
}

/* out (rows, e) += P V_tile, P the (rows, cols) probabilities in scores */
static void SFX(tile_add_pv)(const attnx_softmax_args *a, const mk_tile *t, const packed_keys *pk,
                             REAL *out, const REAL *scores, const REAL *v_tile)
{
#if !REAL_IS_DOUBLE
    if (pk) {
        attnx_mk_add_pv(pk->width, t, out, a->out_row, scores, KEY_TILE, v_tile, a->v_row, a->e);
        return;
    }
#endif
    SFX(gemm)(0, 0, t->rows, a->e, t->cols, 1, scores, KEY_TILE, v_tile, a->v_row, 1, out,
              a->out_row);
}

/* One query tile [i0, i0 + rows) of one head. */
static void SFX(softmax_tile)(const attnx_softmax_args *a, ptrdiff_t head, ptrdiff_t i0,
                              ptrdiff_t rows, packed_keys *pk, SFX(exp_sum_fn) exp_sum,
                              REAL *scores, REAL *key_bias, REAL *row_max, REAL *row_sum)
{
    const ptrdiff_t *off = a->offsets + head * ATTNX_SM_NOPS;
    const REAL *q = (const REAL *)((const char *)a->q + off[ATTNX_SM_Q]) + i0 * a->q_row;
    const REAL *k = (const REAL *)((const char *)a->k + off[ATTNX_SM_K]);
    const REAL *v = (const REAL *)((const char *)a->v + off[ATTNX_SM_V]);
    REAL *out = (REAL *)((char *)a->out + off[ATTNX_SM_OUT]) + i0 * a->out_row;
    const REAL *bias = a->bias ? (const REAL *)((const char *)a->bias + off[ATTNX_SM_BIAS]) : NULL;
    const unsigned char *mask = a->mask ? a->mask + off[ATTNX_SM_MASK] : NULL;
    const ptrdiff_t e = a->e;

    for (ptrdiff_t r = 0; r < rows; r++) {
        row_max[r] = -(REAL)INFINITY;
        row_sum[r] = 0;
        for (ptrdiff_t c = 0; c < e; c++) out[r * a->out_row + c] = 0;
    }

    /* pass 1 range: the keys any row of the tile can see */
    ptrdiff_t key_first = attnx_band_first(&a->band, i0);
    ptrdiff_t key_end = attnx_band_end(&a->band, i0 + rows - 1);
    if (pk) {
        /* tiles start on a packed panel; the keys before the band are
         * masked out in pass 2 like any invisible key */
        key_first -= key_first % MK_NR(pk->width);
        if (pk->k != k) {
            memset(pk->ready, 0, (size_t)pk->panels);
            pk->k = k;
        }
    }
    for (ptrdiff_t j0 = key_first; j0 < key_end; j0 += KEY_TILE) {
        ptrdiff_t cols = ATTNX_MIN(KEY_TILE, key_end - j0);
        const mk_tile tile = {&a->band, i0, rows, j0, cols};
        /* pass 1: scores = scale * Q_tile K_tile^T */
        SFX(tile_scores)(a, &tile, pk, scores, q, k);
        if (a->key_sqnorm_coef != 0)
            SFX(sqnorm_terms)(key_bias, k + j0 * a->k_row, a->k_row, cols, a->d,
                                 (REAL)a->key_sqnorm_coef);
        /* pass 2: bias, mask, online softmax, rescale what is accumulated */
        int has_zero = 0;
        for (ptrdiff_t r = 0; r < rows; r++) {
            ptrdiff_t i = i0 + r;
            ptrdiff_t vis_lo = ATTNX_MAX(attnx_band_first(&a->band, i), j0) - j0;
            ptrdiff_t vis_hi = ATTNX_MIN(attnx_band_end(&a->band, i), j0 + cols) - j0;
            if (vis_hi < vis_lo) vis_hi = vis_lo;
            REAL correction = SFX(online_softmax_row)(
                scores + r * KEY_TILE, cols, vis_lo, vis_hi,
                bias ? bias + i * a->bias_row + j0 * a->bias_col : NULL, a->bias_col,
                mask ? mask + i * a->mask_row + j0 * a->mask_col : NULL, a->mask_col,
                a->key_sqnorm_coef != 0 ? key_bias : NULL, exp_sum, &row_max[r], &row_sum[r],
                &has_zero);
            if (correction != 1) SFX(scale_row)(out + r * a->out_row, e, correction);
        }
        /* pass 3: out += P V_tile; where P has zeros (masked keys) a NaN
         * value must not reach the rows that cannot see it */
        const REAL *v_tile = v + j0 * a->v_row;
        if (has_zero && SFX(has_nonfinite)(v_tile, cols, e, a->v_row))
            SFX(add_visible_values)(out, a->out_row, scores, KEY_TILE, v_tile, a->v_row, rows, cols, e);
        else
            SFX(tile_add_pv)(a, &tile, pk, out, scores, v_tile);
    }

    /* pass 4: normalise; a row that saw nothing has row_sum 0 and gives 0 */
    REAL *lse = a->lse ? (REAL *)((char *)a->lse + off[ATTNX_SM_LSE]) + i0 : NULL;
    if (lse && a->key_sqnorm_coef != 0)
        /* gaussian: lse of the true scores, -|q_i - k_j|^2 / (2 sigma^2) */
        SFX(sqnorm_terms)(lse, q, a->q_row, rows, a->d, (REAL)a->key_sqnorm_coef);
    for (ptrdiff_t r = 0; r < rows; r++) {
        REAL inv_sum = row_sum[r] == 0 ? 0 : 1 / row_sum[r];
        SFX(scale_row)(out + r * a->out_row, e, inv_sum);
        if (lse) {
            REAL query_term = a->key_sqnorm_coef != 0 ? lse[r] : 0;
            lse[r] = row_sum[r] == 0 ? -(REAL)INFINITY : row_max[r] + log(row_sum[r]) + query_term;
        }
    }
}

int SFX(attnx_softmax_fwd)(const attnx_softmax_args *a)
{
    ptrdiff_t q_tiles = (a->n + Q_TILE - 1) / Q_TILE;
    ptrdiff_t work = a->heads * q_tiles;
    if (work == 0) return ATTNX_OK;
    int threads = a->num_threads;
    if (threads > work) threads = (int)work;
    /* waking a second thread costs more than ~a million flops take */
    if ((double)a->heads * a->n * a->m * (a->d + a->e) < 1e6) threads = 1;
    if (threads < 1) threads = 1;

    /* float32 takes the micro-kernels where the CPU has them and the tiles
     * have rows enough to pay for packing the keys */
    int cpu_width = REAL_IS_DOUBLE ? 0 : attnx_mk_width();
    int width = a->e % ATTNX_MAX(cpu_width, 1) == 0 && a->n >= MK_MIN_ROWS ? cpu_width : 0;
    ptrdiff_t panels = width ? (a->m + MK_NR(width) - 1) / MK_NR(width) : 0;
    SFX(exp_sum_fn) exp_sum = SFX(exp_sum);
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    if (cpu_width == 16) exp_sum = mk_exp_sum_w16;
#endif

    /* per-thread scratch: packed keys (first, so that their panels are
     * cache-line aligned), scores tile, key bias, row max, row sum (small
     * problems take small buffers: a decoding step has one query row);
     * each thread's share is a whole number of cache lines */
    size_t packed = (size_t)(panels * MK_NR(width) * a->d);
    size_t per_thread = packed + (size_t)ATTNX_MIN(Q_TILE, a->n) * KEY_TILE + KEY_TILE + 2 * Q_TILE;
    per_thread = (per_thread + 63) / 64 * 64;
    REAL *scratch = NULL;
    unsigned char *ready = malloc((size_t)(panels * threads) + 1);
    packed_keys *pks = calloc((size_t)threads, sizeof *pks);
    int status = ATTNX_ENOMEM;
    if (!ready || !pks || posix_memalign((void **)&scratch, 64, per_thread * threads * sizeof(REAL)))
        goto done;
#if !REAL_IS_DOUBLE
    for (int t = 0; t < threads && width; t++)
        pks[t] = (packed_keys){width, scratch + per_thread * t, ready + panels * t, panels, NULL};
#endif

#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (ptrdiff_t item = 0; item < work; item++) {
        int thread = omp_get_thread_num();
        REAL *scores = scratch + per_thread * thread + packed;
        REAL *key_bias = scores + ATTNX_MIN(Q_TILE, a->n) * KEY_TILE;
        REAL *row_max = key_bias + KEY_TILE;
        REAL *row_sum = row_max + Q_TILE;
        packed_keys *pk = width ? &pks[thread] : NULL;
        ptrdiff_t head = item / q_tiles;
        ptrdiff_t i0 = (item % q_tiles) * Q_TILE;
        SFX(softmax_tile)(a, head, i0, ATTNX_MIN(Q_TILE, a->n - i0), pk, exp_sum, scores, key_bias,
                          row_max, row_sum);
    }
    status = ATTNX_OK;
done:
    free(scratch);
    free(ready);
    free(pks);
    return status;
}

#endif /* REAL */
