/* lsh.c - Reformer's LSH attention with shared query-keys (Kitaev, Kaiser
 * and Levskaya, "Reformer: the efficient Transformer", 2020), forward and
 * backward.
 *
 * Per head, queries and keys are the same vectors q_j (n, d); the key of
 * token j is its direction khat_j = q_j / |q_j| (0 when q_j = 0), and
 *   s_ij = scale q_i . khat_j,   scale = 1 / sqrt(d).
 * Round r of H hashes every token with a random rotation R_r (d, B/2):
 *   bucket_r(j) = argmax [q_j R_r, -q_j R_r]   (the first maximum; the
 *                 argmax is unchanged by the factor 1/|q_j|, so q_j itself
 *                 is hashed),
 * sorts the tokens by (bucket, position) (a counting sort: stable, O(n + B))
 * and cuts the sorted order into chunks of C places. Query i sees key j in
 * round r when
 *   bucket_r(j) == bucket_r(i),  chunk_r(j) is chunk_r(i) or the one before,
 *   j != i,  and j < i when causal.
 * V_i is the union of what the rounds show. A pair is counted in the first
 * round that brings it together (a later round skips j when an earlier one
 * passed the same test), so each round gives (lse_r, out_r) over keys no
 * other round counts, and their log-sum-exp merge is exact softmax over V_i:
 *   lse_i = log sum_{j in V_i} exp(s_ij),  out_i = sum_{j in V_i} exp(s_ij - lse_i) v_j.
 * A token with V_i empty attends to itself: out_i = v_i, lse_i = s_ii = scale |q_i|.
 *
 * Backward (D_i = dout_i . out_i, p_ij = exp(s_ij - lse_i) over V_i, each
 * pair again in its first round only):
 *   dv_j += p_ij dout_i,   ds_ij = p_ij (dout_i . v_j - D_i)
 *   dq_i += scale sum_j ds_ij khat_j                    (query role)
 *   g_j   = scale sum_i ds_ij q_i                        (d loss / d khat_j)
 *   dq_j += (g_j - khat_j (khat_j . g_j)) / |q_j|       (key role, through the
 *                                                        normalisation; 0 at q_j = 0)
 * and dv_i += dout_i for a token that attended to itself (its single weight
 * is 1 whatever the logit: no gradient reaches q).
 *
 * Work: the scores of a chunk are products of gathered rows: its queries
 * against the keys of its own and the previous chunk (at most 2C), in
 * tiles of TILE queries, restricted to the places whose bucket can match
 * (the sorted order keeps a bucket's tokens together). Heads run in
 * parallel when there are enough of them; otherwise a head's rounds (and,
 * in the forward, its chunks) do. Every sum has one order fixed by the
 * shape: per-round results are merged in round order after the rounds, a
 * round's chunks add into its key gradients in chunk order. The results do
 * not depend on the thread count.
 *
 * Legend: n tokens, d features of q, e of v, H rounds (n_hashes),
 *   B buckets (2 * half), C chunk (at most n);
 *   x   (2C, d)    the gathered rows of q of a chunk's key block
 *   vb  (2C, e)    their values
 *   s   (TILE, 2C) scores, then weights p; dp (TILE, 2C) dP, then ds
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h"
#include "dispatch.h"
#include "microkernel.h"

#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
/* the products on the register-blocked mk_gemm (mk_backward.h) where the
 * family's table chose a set with them (dispatch.c) */
#define LSH_KERNELS 1
#endif

/* Queries per score tile: the scores held are TILE x 2C whatever C is
 * (a chunk as long as the sequence must not need an n x 2n block). */
#define TILE 64
/* Tokens per hashing product (HASH_ROWS x d by d x half), on BLAS at every
 * kernel set: OpenBLAS's small-matrix kernels beat mk_gemm's on it (by
 * 3-20% at benchmarks/lsh.py's shapes). */
#define HASH_ROWS 64
/* Below this many multiply-adds in a call, threads cost more than they give. */
#define LSH_PARALLEL_WORK 1e6

/* The hashing of one head, every round: bucket, rank (place in the sorted
 * order) and order (token at a place), each (H, n). */
typedef struct {
    int32_t *bucket, *rank, *order;
} lsh_sorted;

/* Stable counting sort of the tokens by bucket: order[p] is the token at
 * place p, rank[j] the place of token j. count: n_buckets scratch. */
static void lsh_sort(const int32_t *bucket, ptrdiff_t n, ptrdiff_t n_buckets, int32_t *count,
                     int32_t *order, int32_t *rank)
{
    memset(count, 0, (size_t)n_buckets * sizeof *count);
    for (ptrdiff_t j = 0; j < n; j++) count[bucket[j]]++;
    int32_t start = 0;
    for (ptrdiff_t b = 0; b < n_buckets; b++) {
        int32_t size = count[b];
        count[b] = start;
        start += size;
    }
    for (ptrdiff_t j = 0; j < n; j++) {
        int32_t place = count[bucket[j]]++;
        order[place] = (int32_t)j;
        rank[j] = place;
    }
}

/* A tile's key columns (places [lo, hi) of a round), gathered once per
 * tile so that each query row tests them with contiguous loops: the token,
 * its bucket in each round up to this one and its chunk in the earlier
 * ones; keep, a row's verdicts. */
typedef struct {
    int32_t *tok, *bucket, *chunk, *keep;  /* (cols), (rounds, cols) twice, (cols) */
} lsh_columns;

static void lsh_gather_columns(const lsh_sorted *h, ptrdiff_t n, ptrdiff_t chunk, int round,
                               ptrdiff_t lo, ptrdiff_t cols, lsh_columns *k)
{
    const int32_t *order = h->order + round * n;
    for (ptrdiff_t c = 0; c < cols; c++) k->tok[c] = order[lo + c];
    for (int r = 0; r <= round; r++)
        for (ptrdiff_t c = 0; c < cols; c++) {
            int32_t j = k->tok[c];
            k->bucket[r * cols + c] = h->bucket[r * n + j];
            /* this round's chunks are those of the block: not needed */
            if (r < round) k->chunk[r * cols + c] = (int32_t)(h->rank[r * n + j] / chunk);
        }
}

/* Places [lo, hi) of the key block [k0, end) that a tile of queries at
 * places [t0, t1) can see: their buckets lie between the tile's first and
 * last (the order is sorted by bucket) and, causal, before the tile's last
 * query (within a bucket, places follow positions). */
static void lsh_key_range(const int32_t *bucket, const int32_t *order, ptrdiff_t k0,
                          ptrdiff_t end, ptrdiff_t t0, ptrdiff_t t1, int causal, ptrdiff_t *lo,
                          ptrdiff_t *hi)
{
    int32_t first = bucket[order[t0]], last = bucket[order[t1 - 1]];
    ptrdiff_t a = k0, b = causal ? t1 - 1 : end;
    while (a < b && bucket[order[a]] < first) a++;
    while (b > a && bucket[order[b - 1]] > last) b--;
    *lo = a;
    *hi = b;
}

#define ATTNX_FAMILY_FILE "lsh.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */
#include "softmax_internal.h"  /* mk_transpose */

/* One head's operands and its scratch (a set per head in flight). */
typedef struct {
    const REAL *q, *v, *dout, *out, *lse;
    REAL *out_w, *lse_w, *dq_w, *dv_w;  /* the results of the head */
    lsh_sorted sorted;
    int32_t *count;                     /* (H, B) counting-sort scratch */
    REAL *norm, *inv_norm;              /* (n,) |q_j| and 1 / |q_j| (0 at 0) */
    REAL *round_out, *round_lse;        /* forward: (H, n, e), (H, n) */
    REAL *delta;                        /* backward: (n,) D_i */
    REAL *round_grads;                  /* backward: rounds x (n, 2d + e): dq, g, dv */
    REAL *g_total;                      /* backward: (n, d) g_j / |q_j| (the key blocks'
                                           ds' = ds scale / |q_j| carries the factor) */
    unsigned char *has_key;             /* backward: (H, n) round r counted a key for i */
} SFX(lsh_head);

/* A thread's tiles. With a kernel set's products (width > 0: its float32
 * lanes, attnx_kernels_width) the rows of x, vb and the tiles are padded
 * with zeros to whole vectors (d_ld, e_ld), and the key block is also held
 * transposed (xt, vt: the row operand of the scores and of dP), its columns
 * zero past the block's end for a vector, so that every product's columns
 * are whole vectors; without, d_ld = d, e_ld = e and BLAS runs them. */
typedef struct {
    REAL *x, *vb, *s, *tile_out, *dp, *dout_tile, *dq_tile, *g_block, *dv_block, *xr;
    REAL *xt, *vt;          /* (d, key_ld), (e, key_ld); NULL without a kernel set */
    REAL *key_scale;        /* (2C) scale / |q_j| of a tile's key columns */
    lsh_columns columns;
    int width;
    ptrdiff_t lanes;        /* numbers per vector (1 without a kernel set) */
    ptrdiff_t d_ld, e_ld;   /* row strides of x, vb and the tiles */
    ptrdiff_t key_ld;       /* row stride of xt, vt: 2C and a vector */
} SFX(lsh_work);

/* x rounded up to whole vectors of the work's kernel set */
static inline ptrdiff_t SFX(lsh_whole)(const SFX(lsh_work) *w, ptrdiff_t x)
{
    return (x + w->lanes - 1) / w->lanes * w->lanes;
}

/* c (rows, cols) = a b, a's element (r, p) at a[r a_row + p a_col], b's rows
 * b_row apart, on the kernel set's mk_gemm (cols whole vectors) */
static inline void SFX(lsh_mk_gemm)(const SFX(lsh_work) *w, ptrdiff_t rows, ptrdiff_t cols,
                                    ptrdiff_t depth, const REAL *a, ptrdiff_t a_row,
                                    ptrdiff_t a_col, const REAL *b, ptrdiff_t b_row, REAL *c,
                                    ptrdiff_t c_row)
{
#ifdef LSH_KERNELS
    TYPED(mk_gemm_f32, mk_gemm_f64)(w->width, rows, cols, depth, 1, a, a_row, a_col, b, b_row, 0,
                                    c, c_row);
#else
    (void)w, (void)rows, (void)cols, (void)depth, (void)a, (void)a_row, (void)a_col, (void)b;
    (void)b_row, (void)c, (void)c_row;
#endif
}

static SFX(lsh_head) SFX(lsh_position)(const attnx_lsh_args *a, ptrdiff_t head,
                                       SFX(lsh_head) head_set)
{
    const ptrdiff_t *off = a->offsets + head * ATTNX_LSH_NOPS;
    SFX(lsh_head) h = head_set;
    h.q = (const REAL *)((const char *)a->q + off[ATTNX_LSH_Q]);
    h.v = a->v ? (const REAL *)((const char *)a->v + off[ATTNX_LSH_V]) : NULL;
    if (a->out) h.out_w = (REAL *)((char *)a->out + off[ATTNX_LSH_OUT]);
    if (a->lse) h.lse_w = (REAL *)((char *)a->lse + off[ATTNX_LSH_LSE]);
    if (a->dout) {
        h.dout = (const REAL *)((const char *)a->dout + off[ATTNX_LSH_DOUT]);
        h.out = (const REAL *)((const char *)a->out_in + off[ATTNX_LSH_OUT]);
        h.lse = (const REAL *)((const char *)a->lse_in + off[ATTNX_LSH_LSE]);
        h.dq_w = (REAL *)((char *)a->dq + off[ATTNX_LSH_DQ]);
        h.dv_w = (REAL *)((char *)a->dv + off[ATTNX_LSH_DV]);
    }
    return h;
}

/* The place of the first maximum of [proj, -proj] (2 half numbers). Without
 * NaN it is the first place that holds the largest |proj[b]|, found by two
 * reductions that vectorise (the scan's branches took a third of the
 * hashing's time); with a NaN the scan itself. */
static ATTNX_HOT int32_t SFX(lsh_argmax)(const REAL *proj, ptrdiff_t half)
{
    REAL top = 0;
    int nan = 0;
#pragma omp simd reduction(max : top) reduction(| : nan)
    for (ptrdiff_t b = 0; b < half; b++) {
        REAL size = proj[b] < 0 ? -proj[b] : proj[b];
        top = size > top ? size : top;
        nan |= proj[b] != proj[b];
    }
    if (!nan) {
        int32_t first = (int32_t)(2 * half);
#pragma omp simd reduction(min : first)
        for (ptrdiff_t b = 0; b < half; b++) {
            int32_t at = proj[b] == top ? (int32_t)b
                         : -proj[b] == top ? (int32_t)(half + b)
                                           : (int32_t)(2 * half);
            first = at < first ? at : first;
        }
        return first;
    }
    REAL best = proj[0];
    int32_t arg = 0;
    for (ptrdiff_t b = 1; b < half; b++)
        if (proj[b] > best) {
            best = proj[b];
            arg = (int32_t)b;
        }
    for (ptrdiff_t b = 0; b < half; b++)
        if (-proj[b] > best) {
            best = -proj[b];
            arg = (int32_t)(half + b);
        }
    return arg;
}

/* bucket (n,) of round `round`: argmax over [q R, -q R], the first maximum
 * (ties to the lowest index, as numpy's argmax; a token with NaN, whose
 * projections are all NaN, goes to bucket 0). */
static void SFX(lsh_hash_round)(const attnx_lsh_args *a, const REAL *q, int round,
                                int32_t *bucket, REAL *xr)
{
    const REAL *rot = (const REAL *)a->rotations + round * a->rot_hash;
    ptrdiff_t half = a->half;
    for (ptrdiff_t t0 = 0; t0 < a->n; t0 += HASH_ROWS) {
        ptrdiff_t rows = ATTNX_MIN(HASH_ROWS, a->n - t0);
        SFX(gemm)(0, 0, rows, half, a->d, 1, q + t0 * a->q_row, a->q_row, rot, a->rot_row, 0,
                  xr, half);
        for (ptrdiff_t t = 0; t < rows; t++) bucket[t0 + t] = SFX(lsh_argmax)(xr + t * half, half);
    }
}

/* a row of `count` numbers, then zeros up to `padded` */
static inline void SFX(lsh_put_row)(REAL *dst, const REAL *src, ptrdiff_t count, ptrdiff_t padded)
{
    memcpy(dst, src, (size_t)count * sizeof(REAL));
    memset(dst + count, 0, (size_t)(padded - count) * sizeof(REAL));
}

/* columns [0, cols) of xt (rows, key_ld) from the rows of x (cols, rows)
 * x_ld apart (mk_transpose, softmax_mk.c), then zeros for a vector */
static void SFX(lsh_transpose)(const SFX(lsh_work) *w, REAL *xt, const REAL *x, ptrdiff_t x_ld,
                               ptrdiff_t cols, ptrdiff_t rows)
{
#ifdef LSH_KERNELS
    SFX(mk_transpose)(xt, w->key_ld, x, x_ld, cols, rows, w->width);
#endif
    for (ptrdiff_t r = 0; r < rows; r++)
        memset(xt + r * w->key_ld + cols, 0, (size_t)w->lanes * sizeof(REAL));
}

/* Gather the key block at places [k0, end) of a round: rows of q and v,
 * and with a kernel set q transposed (and v, for the backward: vt). */
static void SFX(lsh_gather)(const attnx_lsh_args *a, const SFX(lsh_head) *h,
                            const int32_t *order, ptrdiff_t k0, ptrdiff_t end, SFX(lsh_work) *w)
{
    for (ptrdiff_t p = k0; p < end; p++) {
        int32_t j = order[p];
        SFX(lsh_put_row)(w->x + (p - k0) * w->d_ld, h->q + j * a->q_row, a->d, w->d_ld);
        SFX(lsh_put_row)(w->vb + (p - k0) * w->e_ld, h->v + j * a->v_row, a->e, w->e_ld);
    }
    if (w->xt) SFX(lsh_transpose)(w, w->xt, w->x, w->d_ld, end - k0, a->d);
    if (w->vt) SFX(lsh_transpose)(w, w->vt, w->vb, w->e_ld, end - k0, a->e);
}

/* s (rows, cols) = A B^T with A (rows, depth) and B (cols, depth) rows lda
 * and ldb apart, or on a kernel set Bt = B^T (depth, cols) rows ldbt apart,
 * columns up to whole vectors (s's rows ldc apart hold them) */
static void SFX(lsh_dots)(const SFX(lsh_work) *w, ptrdiff_t rows, ptrdiff_t cols,
                          ptrdiff_t depth, const REAL *A, ptrdiff_t lda, const REAL *B,
                          ptrdiff_t ldb, const REAL *Bt, ptrdiff_t ldbt, REAL *s, ptrdiff_t ldc)
{
    if (w->width)
        SFX(lsh_mk_gemm)(w, rows, SFX(lsh_whole)(w, cols), depth, A, lda, 1, Bt, ldbt, s, ldc);
    else
        SFX(gemm)(0, 1, rows, cols, depth, 1, A, lda, B, ldb, 0, s, ldc);
}

/* C (M, N) = op(A) B, op(A) = A (M, K) or, trans_a, A^T (A stored (K, M)).
 * With `sparse` the terms whose coefficient in A is 0 are left out: a block
 * that holds inf or NaN (in B, or in the row a product pairs with) must not
 * spread NaN through 0 * inf into queries that do not see that token. */
static void SFX(lsh_product)(const SFX(lsh_work) *w, int trans_a, ptrdiff_t M, ptrdiff_t N,
                             ptrdiff_t K, const REAL *A, ptrdiff_t lda, const REAL *B,
                             ptrdiff_t ldb, REAL *C, ptrdiff_t ldc, int sparse)
{
    if (!sparse) {
        /* N is d_ld or e_ld: whole vectors on a kernel set */
        if (w->width)
            SFX(lsh_mk_gemm)(w, M, N, K, A, trans_a ? 1 : lda, trans_a ? lda : 1, B, ldb, C, ldc);
        else
            SFX(gemm)(trans_a, 0, M, N, K, 1, A, lda, B, ldb, 0, C, ldc);
        return;
    }
    for (ptrdiff_t i = 0; i < M; i++) {
        REAL *c_row = C + i * ldc;
        memset(c_row, 0, (size_t)N * sizeof(REAL));
        for (ptrdiff_t p = 0; p < K; p++) {
            REAL coef = trans_a ? A[p * lda + i] : A[i * lda + p];
            if (coef == 0) continue;
            for (ptrdiff_t j = 0; j < N; j++) c_row[j] += coef * B[p * ldb + j];
        }
    }
}

/* keep[c] = 1 when round `round` counts key column c for query i: same
 * bucket, not i, before i when causal (the chunk condition holds for every
 * column of the block), and no earlier round counted the pair (same bucket
 * there, and the key's chunk the query's or the one before). Type-free,
 * instantiated with the family only to be compiled for the wide vectors. */
static ATTNX_HOT void SFX(lsh_keep_row)(const lsh_sorted *h, ptrdiff_t n, ptrdiff_t chunk,
                                         int round, int causal, int32_t i,
                                         const lsh_columns *k, ptrdiff_t cols)
{
    int32_t *keep = k->keep;
    const int32_t *tok = k->tok, *key_bucket = k->bucket + round * cols;
    int32_t bucket = h->bucket[round * n + i];
#pragma omp simd
    for (ptrdiff_t c = 0; c < cols; c++)
        keep[c] = (key_bucket[c] == bucket) & (tok[c] != i) & (!causal | (tok[c] < i));
    for (int r = 0; r < round; r++) {
        int32_t earlier_bucket = h->bucket[r * n + i];
        int32_t earlier_chunk = (int32_t)(h->rank[r * n + i] / chunk);
        const int32_t *col_bucket = k->bucket + r * cols, *col_chunk = k->chunk + r * cols;
#pragma omp simd
        for (ptrdiff_t c = 0; c < cols; c++) {
            int32_t behind = earlier_chunk - col_chunk[c];
            keep[c] &= !((col_bucket[c] == earlier_bucket) & ((behind == 0) | (behind == 1)));
        }
    }
}

/* Scores of queries at places [t0, t1) against keys at places [lo, hi):
 * s (rows, cols), rows s_ld apart, holds q_i . q_j and becomes scale
 * q_i . khat_j where the round counts (i, j), -inf elsewhere. */
static ATTNX_HOT void SFX(lsh_scores)(const attnx_lsh_args *a, const SFX(lsh_head) *h, int round,
                            ptrdiff_t t0, ptrdiff_t t1, ptrdiff_t lo, ptrdiff_t hi, REAL *s,
                            ptrdiff_t s_ld, SFX(lsh_work) *w)
{
    const ptrdiff_t n = a->n, rows = t1 - t0, cols = hi - lo;
    const int32_t *order = h->sorted.order + round * n;
    lsh_gather_columns(&h->sorted, n, a->chunk, round, lo, cols, &w->columns);
    const int32_t *keep = w->columns.keep;
    for (ptrdiff_t c = 0; c < cols; c++)
        w->key_scale[c] = (REAL)a->scale * h->inv_norm[w->columns.tok[c]];
    for (ptrdiff_t r = 0; r < rows; r++) {
        REAL *s_row = s + r * s_ld;
        SFX(lsh_keep_row)(&h->sorted, n, a->chunk, round, a->causal, order[t0 + r], &w->columns, cols);
#pragma omp simd
        for (ptrdiff_t c = 0; c < cols; c++)
            s_row[c] = keep[c] ? s_row[c] * w->key_scale[c] : -(REAL)INFINITY;
    }
}

/* A row of scores becomes its softmax weights; returns its lse. A row with
 * nothing counted (all -inf) becomes 0 with lse -inf, unless a NaN (a
 * query of NaN) hides there: then NaN. */
static ATTNX_HOT REAL SFX(lsh_row_softmax)(REAL *s_row, ptrdiff_t cols)
{
    REAL top = -(REAL)INFINITY;
#pragma omp simd reduction(max : top)
    for (ptrdiff_t c = 0; c < cols; c++) top = s_row[c] > top ? s_row[c] : top;
    if (top == -(REAL)INFINITY) {
        int nan = 0;
        for (ptrdiff_t c = 0; c < cols; c++) nan |= s_row[c] != s_row[c];
        if (!nan) {
            memset(s_row, 0, (size_t)cols * sizeof(REAL));
            return -(REAL)INFINITY;
        }
        top = (REAL)NAN;
    }
    REAL sum = SFX(exp_normalise)(s_row, cols, top, s_row);
    return top + (REAL)log((double)sum);
}

/* The forward of one chunk of one round: (lse_r, out_r) of its queries over
 * the keys the round counts for them. */
static void SFX(lsh_fwd_chunk)(const attnx_lsh_args *a, const SFX(lsh_head) *h, int round,
                               ptrdiff_t chunk_index, SFX(lsh_work) *w)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e, C = a->chunk;
    const int32_t *order = h->sorted.order + round * n, *bucket = h->sorted.bucket + round * n;
    REAL *round_out = h->round_out + round * n * e, *round_lse = h->round_lse + round * n;
    ptrdiff_t p0 = chunk_index * C, p1 = ATTNX_MIN(p0 + C, n), k0 = ATTNX_MAX(p0 - C, 0);
    const ptrdiff_t d_ld = w->d_ld, e_ld = w->e_ld;
    SFX(lsh_gather)(a, h, order, k0, p1, w);
    int v_bad = SFX(has_nonfinite)(w->vb, p1 - k0, e, e_ld);
    for (ptrdiff_t t0 = p0; t0 < p1; t0 += TILE) {
        ptrdiff_t t1 = ATTNX_MIN(t0 + TILE, p1), rows = t1 - t0, lo, hi;
        lsh_key_range(bucket, order, k0, p1, t0, t1, a->causal, &lo, &hi);
        ptrdiff_t cols = hi - lo, s_ld = SFX(lsh_whole)(w, cols);
        /* pass 1: q_i . q_j, then scaled by 1/|q_j| and masked */
        SFX(lsh_dots)(w, rows, cols, d, w->x + (t0 - k0) * d_ld, d_ld, w->x + (lo - k0) * d_ld,
                      d_ld, w->xt ? w->xt + (lo - k0) : NULL, w->key_ld, w->s, s_ld);
        SFX(lsh_scores)(a, h, round, t0, t1, lo, hi, w->s, s_ld, w);
        /* pass 2: row softmax; a row this round counts nothing for is 0, lse -inf */
        for (ptrdiff_t r = 0; r < rows; r++)
            round_lse[order[t0 + r]] = SFX(lsh_row_softmax)(w->s + r * s_ld, cols);
        /* pass 3: out_r = p v */
        SFX(lsh_product)(w, 0, rows, e_ld, cols, w->s, s_ld, w->vb + (lo - k0) * e_ld, e_ld,
                         w->tile_out, e_ld, v_bad);
        for (ptrdiff_t r = 0; r < rows; r++)
            memcpy(round_out + order[t0 + r] * e, w->tile_out + r * e_ld, (size_t)e * sizeof(REAL));
    }
}

/* The backward of one chunk of one round, added into that round's
 * gradients (dq (n, d), g (n, d), dv (n, e)); has_key marks the queries it
 * counted a key for. */
static void SFX(lsh_bwd_chunk)(const attnx_lsh_args *a, const SFX(lsh_head) *h, int round,
                               ptrdiff_t chunk_index, SFX(lsh_work) *w, REAL *dq_r, REAL *g_r,
                               REAL *dv_r, unsigned char *has_key)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e, C = a->chunk;
    const int32_t *order = h->sorted.order + round * n, *bucket = h->sorted.bucket + round * n;
    ptrdiff_t p0 = chunk_index * C, p1 = ATTNX_MIN(p0 + C, n), k0 = ATTNX_MAX(p0 - C, 0);
    const ptrdiff_t d_ld = w->d_ld, e_ld = w->e_ld;
    SFX(lsh_gather)(a, h, order, k0, p1, w);
    int x_bad = SFX(has_nonfinite)(w->x, p1 - k0, d, d_ld);
    for (ptrdiff_t t0 = p0; t0 < p1; t0 += TILE) {
        ptrdiff_t t1 = ATTNX_MIN(t0 + TILE, p1), rows = t1 - t0, lo, hi;
        lsh_key_range(bucket, order, k0, p1, t0, t1, a->causal, &lo, &hi);
        ptrdiff_t cols = hi - lo, s_ld = SFX(lsh_whole)(w, cols);
        if (cols == 0) continue;
        const REAL *x_q = w->x + (t0 - k0) * d_ld, *x_k = w->x + (lo - k0) * d_ld;
        const REAL *v_k = w->vb + (lo - k0) * e_ld;
        /* p_ij = exp(s_ij - lse_i) over the pairs this round counts */
        SFX(lsh_dots)(w, rows, cols, d, x_q, d_ld, x_k, d_ld, w->xt ? w->xt + (lo - k0) : NULL,
                      w->key_ld, w->s, s_ld);
        SFX(lsh_scores)(a, h, round, t0, t1, lo, hi, w->s, s_ld, w);
        for (ptrdiff_t r = 0; r < rows; r++) {
            int32_t i = order[t0 + r];
            REAL *s_row = w->s + r * s_ld, lse_i = h->lse[i];
            int any = 0;
            for (ptrdiff_t c = 0; c < cols; c++) any |= s_row[c] != -(REAL)INFINITY;
            if (any) has_key[i] = 1;
#pragma omp simd
            for (ptrdiff_t c = 0; c < cols; c++) s_row[c] = SFX(vexp)(s_row[c] - lse_i);
            SFX(lsh_put_row)(w->dout_tile + r * e_ld, h->dout + i * a->dout_row, e, e_ld);
        }
        /* dV_j += sum_i p_ij dO_i */
        SFX(lsh_product)(w, 1, cols, e_ld, rows, w->s, s_ld, w->dout_tile, e_ld, w->dv_block, e_ld,
                         SFX(has_nonfinite)(w->dout_tile, rows, e, e_ld));
        for (ptrdiff_t c = 0; c < cols; c++) {
            REAL *dv_j = dv_r + order[lo + c] * e;
            const REAL *part = w->dv_block + c * e_ld;
            for (ptrdiff_t x = 0; x < e; x++) dv_j[x] += part[x];
        }
        /* dP = dO V^T, then ds' = p (dP - D_i) scale / |q_j| */
        SFX(lsh_dots)(w, rows, cols, e, w->dout_tile, e_ld, v_k, e_ld,
                      w->vt ? w->vt + (lo - k0) : NULL, w->key_ld, w->dp, s_ld);
        REAL scale = (REAL)a->scale;
        for (ptrdiff_t r = 0; r < rows; r++) {
            REAL *dp_row = w->dp + r * s_ld, delta_i = h->delta[order[t0 + r]];
            const REAL *p_row = w->s + r * s_ld;
            for (ptrdiff_t c = 0; c < cols; c++)
                dp_row[c] = p_row[c] == 0 ? 0
                            : p_row[c] * (dp_row[c] - delta_i) * scale * h->inv_norm[order[lo + c]];
        }
        /* query role: dq_i += sum_j ds'_ij q_j;  key role: g_j += sum_i ds'_ij q_i */
        SFX(lsh_product)(w, 0, rows, d_ld, cols, w->dp, s_ld, x_k, d_ld, w->dq_tile, d_ld, x_bad);
        for (ptrdiff_t r = 0; r < rows; r++) {
            REAL *dq_i = dq_r + order[t0 + r] * d;
            const REAL *part = w->dq_tile + r * d_ld;
            for (ptrdiff_t x = 0; x < d; x++) dq_i[x] += part[x];
        }
        SFX(lsh_product)(w, 1, cols, d_ld, rows, w->dp, s_ld, x_q, d_ld, w->g_block, d_ld, x_bad);
        for (ptrdiff_t c = 0; c < cols; c++) {
            REAL *g_j = g_r + order[lo + c] * d;
            const REAL *part = w->g_block + c * d_ld;
            for (ptrdiff_t x = 0; x < d; x++) g_j[x] += part[x];
        }
    }
}

/* Norms and the hashing and sorting of every round of one head (rounds in
 * parallel when inner > 1). */
static void SFX(lsh_prepare)(const attnx_lsh_args *a, SFX(lsh_head) *h, SFX(lsh_work) *works,
                             int inner)
{
    const ptrdiff_t n = a->n, d = a->d, n_buckets = 2 * a->half;
    for (ptrdiff_t j = 0; j < n; j++) {
        const REAL *q_j = h->q + j * a->q_row;
        double sq = 0;
        for (ptrdiff_t x = 0; x < d; x++) sq += (double)q_j[x] * q_j[x];
        h->norm[j] = (REAL)sqrt(sq);
        h->inv_norm[j] = h->norm[j] > 0 ? 1 / h->norm[j] : 0;
    }
#pragma omp parallel for num_threads(attnx_omp_threads(inner)) schedule(static) if (inner > 1)
    for (int r = 0; r < (int)a->n_hashes; r++) {
        int32_t *bucket = h->sorted.bucket + r * n;
        SFX(lsh_hash_round)(a, h->q, r, bucket, works[omp_get_thread_num()].xr);
        lsh_sort(bucket, n, n_buckets, h->count + r * n_buckets, h->sorted.order + r * n,
                 h->sorted.rank + r * n);
    }
}

static void SFX(lsh_fwd_head)(const attnx_lsh_args *a, SFX(lsh_head) *h, SFX(lsh_work) *works,
                              int inner, int polls)
{
    const ptrdiff_t n = a->n, e = a->e, H = a->n_hashes;
    const ptrdiff_t chunks = (n + a->chunk - 1) / a->chunk;
    SFX(lsh_prepare)(a, h, works, inner);
#pragma omp parallel for num_threads(attnx_omp_threads(inner)) schedule(dynamic, 1) if (inner > 1)
    for (ptrdiff_t item = 0; item < H * chunks; item++) {
        if (attnx_interrupted(a->interrupt, polls && omp_get_thread_num() == 0)) continue;
        SFX(lsh_fwd_chunk)(a, h, (int)(item / chunks), item % chunks,
                           &works[omp_get_thread_num()]);
    }
    if (a->interrupt && a->interrupt->stopped) return;
    /* merge the rounds by log-sum-exp, in round order */
    REAL scale = (REAL)a->scale;
#pragma omp parallel for num_threads(attnx_omp_threads(inner)) schedule(static) if (inner > 1)
    for (ptrdiff_t i = 0; i < n; i++) {
        REAL *out_i = h->out_w + i * a->out_row, top = -(REAL)INFINITY;
        for (ptrdiff_t r = 0; r < H; r++) {
            REAL l = h->round_lse[r * n + i];
            if (l > top || l != l) top = l;
        }
        if (top == -(REAL)INFINITY) {
            /* no key in any round: the token attends to itself */
            memcpy(out_i, h->v + i * a->v_row, (size_t)e * sizeof(REAL));
            h->lse_w[i] = scale * h->norm[i];
            continue;
        }
        REAL sum = 0;
        for (ptrdiff_t r = 0; r < H; r++) sum += SFX(vexp)(h->round_lse[r * n + i] - top);
        REAL lse = top + (REAL)log((double)sum);
        h->lse_w[i] = lse;
        memset(out_i, 0, (size_t)e * sizeof(REAL));
        for (ptrdiff_t r = 0; r < H; r++) {
            REAL weight = SFX(vexp)(h->round_lse[r * n + i] - lse);
            if (weight == 0) continue;
            const REAL *part = h->round_out + (r * n + i) * e;
            for (ptrdiff_t x = 0; x < e; x++) out_i[x] += weight * part[x];
        }
    }
}

/* One round's gradients into dq_r, g_r, dv_r (zeroed first), chunk after chunk. */
static void SFX(lsh_bwd_round)(const attnx_lsh_args *a, const SFX(lsh_head) *h, int round,
                               SFX(lsh_work) *w, REAL *grads, int polls)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e;
    const ptrdiff_t chunks = (n + a->chunk - 1) / a->chunk;
    memset(grads, 0, (size_t)(n * (2 * d + e)) * sizeof(REAL));
    unsigned char *has_key = h->has_key + round * n;
    memset(has_key, 0, (size_t)n);
    for (ptrdiff_t c = 0; c < chunks; c++) {
        if (attnx_interrupted(a->interrupt, polls)) return;
        SFX(lsh_bwd_chunk)(a, h, round, c, w, grads, grads + n * d, grads + 2 * n * d, has_key);
    }
}

/* totals (dq, g, dv) += one round's */
static void SFX(lsh_add_round)(const attnx_lsh_args *a, const SFX(lsh_head) *h,
                               const REAL *grads)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e;
    for (ptrdiff_t i = 0; i < n; i++) {
        REAL *dq_i = h->dq_w + i * a->dq_row, *g_i = h->g_total + i * d, *dv_i = h->dv_w + i * a->dv_row;
        const REAL *dq_r = grads + i * d, *g_r = grads + n * d + i * d, *dv_r = grads + 2 * n * d + i * e;
        for (ptrdiff_t x = 0; x < d; x++) dq_i[x] += dq_r[x];
        for (ptrdiff_t x = 0; x < d; x++) g_i[x] += g_r[x];
        for (ptrdiff_t x = 0; x < e; x++) dv_i[x] += dv_r[x];
    }
}

static void SFX(lsh_bwd_head)(const attnx_lsh_args *a, SFX(lsh_head) *h, SFX(lsh_work) *works,
                              int inner, int polls)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e, H = a->n_hashes;
    SFX(lsh_prepare)(a, h, works, inner);
    for (ptrdiff_t i = 0; i < n; i++) {
        const REAL *dout_i = h->dout + i * a->dout_row, *out_i = h->out + i * a->out_row;
        REAL delta = 0;
        for (ptrdiff_t x = 0; x < e; x++) delta += dout_i[x] * out_i[x];
        h->delta[i] = delta;
        memset(h->dq_w + i * a->dq_row, 0, (size_t)d * sizeof(REAL));
        memset(h->dv_w + i * a->dv_row, 0, (size_t)e * sizeof(REAL));
    }
    memset(h->g_total, 0, (size_t)(n * d) * sizeof(REAL));
    ptrdiff_t round_size = n * (2 * d + e);
    if (inner > 1) {
        /* rounds in parallel, each into its own gradients, added in round order */
#pragma omp parallel for num_threads(attnx_omp_threads(inner)) schedule(dynamic, 1)
        for (int r = 0; r < (int)H; r++)
            SFX(lsh_bwd_round)(a, h, r, &works[omp_get_thread_num()], h->round_grads + r * round_size,
                               polls && omp_get_thread_num() == 0);
        if (a->interrupt && a->interrupt->stopped) return;
        for (int r = 0; r < (int)H; r++) SFX(lsh_add_round)(a, h, h->round_grads + r * round_size);
    } else {
        /* the same sums in the same order, one round's gradients at a time */
        for (int r = 0; r < (int)H; r++) {
            SFX(lsh_bwd_round)(a, h, r, works, h->round_grads, polls);
            if (a->interrupt && a->interrupt->stopped) return;
            SFX(lsh_add_round)(a, h, h->round_grads);
        }
    }
    /* the key role through khat = q / |q|, and the tokens that saw themselves */
    for (ptrdiff_t i = 0; i < n; i++) {
        const REAL *q_i = h->q + i * a->q_row, *g_i = h->g_total + i * d;
        REAL *dq_i = h->dq_w + i * a->dq_row, inv = h->inv_norm[i], along = 0;
        for (ptrdiff_t x = 0; x < d; x++) along += q_i[x] * g_i[x];
        along *= inv * inv;
        for (ptrdiff_t x = 0; x < d; x++) dq_i[x] += g_i[x] - along * q_i[x];
        int seen = 0;
        for (ptrdiff_t r = 0; r < H; r++) seen |= h->has_key[r * n + i];
        if (!seen) {
            REAL *dv_i = h->dv_w + i * a->dv_row;
            const REAL *dout_i = h->dout + i * a->dout_row;
            for (ptrdiff_t x = 0; x < e; x++) dv_i[x] += dout_i[x];
        }
    }
}

/* A work's kernel set (attnx_kernels(ATTNX_FAMILY_LSH)) and strides, no memory yet */
static SFX(lsh_work) SFX(lsh_layout)(const attnx_lsh_args *a)
{
    SFX(lsh_work) w = {0};
#ifdef LSH_KERNELS
    w.width = attnx_kernels_width(attnx_kernels(ATTNX_FAMILY_LSH));
#endif
    w.lanes = w.width ? MK_LANES(w.width, sizeof(REAL)) : 1;
    w.d_ld = SFX(lsh_whole)(&w, a->d);
    w.e_ld = SFX(lsh_whole)(&w, a->e);
    w.key_ld = 2 * a->chunk + w.lanes;
    return w;
}

/* The forward (backward 0) or backward (1) over every head. */
static int SFX(lsh_run)(const attnx_lsh_args *a, int backward)
{
    const ptrdiff_t n = a->n, d = a->d, e = a->e, H = a->n_hashes, heads = a->heads;
    const ptrdiff_t C = a->chunk, n_buckets = 2 * a->half;
    if (heads == 0 || n == 0) return ATTNX_OK;
    int threads = a->num_threads < 1 ? 1 : a->num_threads;
    if ((double)heads * H * n * 2 * C * (d + e) < LSH_PARALLEL_WORK) threads = 1;
    /* enough heads: one per thread; else one head at a time, its rounds
     * (and forward chunks) over the threads */
    int outer = heads >= threads;
    int sets = outer ? threads : 1;
    /* the sizes below in ptrdiff_t: refuse (as memory) what would overflow */
    double words = (double)sets * (3.0 * H * n + H * (double)n_buckets +
                                   (double)n * (H + 2) * (2.0 * d + e + 4)) +
                   (double)threads * (2.0 * C * (2 * H + 6) * (d + e + 40) +
                                      (double)TILE * 4 * (C + 16) + (double)HASH_ROWS * a->half);
    if (words > (double)PTRDIFF_MAX / 16) return ATTNX_ENOMEM;
    ptrdiff_t grad_rounds = outer ? 1 : H;
    ptrdiff_t per_set_real = 2 * n + (backward ? n + grad_rounds * n * (2 * d + e) + n * d
                                               : H * n * (e + 1));
    ptrdiff_t per_set_int = 3 * H * n + H * n_buckets;
    ptrdiff_t per_work_int = 2 * C * (2 * H + 2);
    /* the kernel set's products (dispatch.h) and the strides they need */
    SFX(lsh_work) layout = SFX(lsh_layout)(a);
    const ptrdiff_t D = layout.d_ld, E = layout.e_ld, key_ld = layout.key_ld;
    const ptrdiff_t transposed = layout.width ? key_ld * (d + (backward ? e : 0)) : 0;
    ptrdiff_t per_work = 2 * C * (D + E) + key_ld + TILE * key_ld + TILE * E +
                         HASH_ROWS * a->half + transposed +
                         (backward ? TILE * key_ld + TILE * D + 2 * C * (D + E) : 0);
    REAL *reals = malloc((size_t)(per_set_real * sets + per_work * threads) * sizeof(REAL));
    int32_t *ints = malloc((size_t)(per_set_int * sets + per_work_int * threads) * sizeof(int32_t));
    unsigned char *flags = backward ? malloc((size_t)(H * n * sets)) : NULL;
    SFX(lsh_work) *works = malloc((size_t)threads * sizeof *works);
    SFX(lsh_head) *head_sets = malloc((size_t)sets * sizeof *head_sets);
    int status = ATTNX_ENOMEM;
    if (!reals || !ints || (backward && !flags) || !works || !head_sets) goto done;
    for (int s = 0; s < sets; s++) {
        REAL *base = reals + per_set_real * s;
        int32_t *ibase = ints + per_set_int * s;
        SFX(lsh_head) h = {0};
        h.norm = base;
        h.inv_norm = base + n;
        if (backward) {
            h.delta = base + 2 * n;
            h.g_total = base + 3 * n;
            h.round_grads = base + 3 * n + n * d;
            h.has_key = flags + H * n * s;
        } else {
            h.round_lse = base + 2 * n;
            h.round_out = base + 2 * n + H * n;
        }
        h.sorted = (lsh_sorted){ibase, ibase + H * n, ibase + 2 * H * n};
        h.count = ibase + 3 * H * n;
        head_sets[s] = h;
    }
    for (int t = 0; t < threads; t++) {
        REAL *base = reals + per_set_real * sets + per_work * t;
        SFX(lsh_work) w = layout;
        w.x = base;
        w.vb = w.x + 2 * C * D;
        w.s = w.vb + 2 * C * E;
        w.tile_out = w.s + TILE * key_ld;
        w.xr = w.tile_out + TILE * E;
        w.key_scale = w.xr + HASH_ROWS * a->half;
        if (layout.width) {
            w.xt = w.key_scale + key_ld;
            if (backward) w.vt = w.xt + key_ld * d;
        }
        int32_t *ibase = ints + per_set_int * sets + per_work_int * t;
        w.columns = (lsh_columns){ibase, ibase + 2 * C, ibase + 2 * C + 2 * C * H,
                                  ibase + 2 * C + 4 * C * H};
        if (backward) {
            w.dp = w.key_scale + key_ld + transposed;
            w.dout_tile = w.tile_out;
            w.dq_tile = w.dp + TILE * key_ld;
            w.g_block = w.dq_tile + TILE * D;
            w.dv_block = w.g_block + 2 * C * D;
        }
        works[t] = w;
    }
    if (outer) {
#pragma omp parallel for num_threads(attnx_omp_threads(threads)) schedule(dynamic, 1) if (threads > 1)
        for (ptrdiff_t head = 0; head < heads; head++) {
            int t = omp_get_thread_num();
            if (a->interrupt && a->interrupt->stopped) continue;
            SFX(lsh_head) h = SFX(lsh_position)(a, head, head_sets[t]);
            if (backward) SFX(lsh_bwd_head)(a, &h, &works[t], 1, t == 0);
            else SFX(lsh_fwd_head)(a, &h, &works[t], 1, t == 0);
        }
    } else {
        for (ptrdiff_t head = 0; head < heads; head++) {
            if (a->interrupt && a->interrupt->stopped) break;
            SFX(lsh_head) h = SFX(lsh_position)(a, head, head_sets[0]);
            if (backward) SFX(lsh_bwd_head)(a, &h, works, threads, 1);
            else SFX(lsh_fwd_head)(a, &h, works, threads, 1);
        }
    }
    status = a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
done:
    free(reals);
    free(ints);
    free(flags);
    free(works);
    free(head_sets);
    return status;
}

int TYPED(attnx_lsh_fwd_f32, attnx_lsh_fwd_f64)(const attnx_lsh_args *a)
{
    return SFX(lsh_run)(a, 0);
}

int TYPED(attnx_lsh_bwd_f32, attnx_lsh_bwd_f64)(const attnx_lsh_args *a)
{
    return SFX(lsh_run)(a, 1);
}

int TYPED(attnx_lsh_buckets_f32, attnx_lsh_buckets_f64)(const attnx_lsh_args *a, int32_t *buckets)
{
    const ptrdiff_t n = a->n, H = a->n_hashes, items = a->heads * H;
    if (items == 0 || n == 0) return ATTNX_OK;
    int threads = a->num_threads < 1 ? 1 : a->num_threads;
    if ((double)items * n * a->d * a->half < LSH_PARALLEL_WORK) threads = 1;
    REAL *xr = malloc((size_t)(threads * HASH_ROWS * a->half) * sizeof(REAL));
    if (!xr) return ATTNX_ENOMEM;
#pragma omp parallel for num_threads(attnx_omp_threads(threads)) schedule(static) if (threads > 1)
    for (ptrdiff_t item = 0; item < items; item++) {
        ptrdiff_t head = item / H;
        const REAL *q = (const REAL *)((const char *)a->q + a->offsets[head * ATTNX_LSH_NOPS + ATTNX_LSH_Q]);
        SFX(lsh_hash_round)(a, q, (int)(item % H), buckets + item * n,
                            xr + omp_get_thread_num() * HASH_ROWS * a->half);
    }
    free(xr);
    return ATTNX_OK;
}

#endif /* REAL */
