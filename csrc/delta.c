/* delta.c - the delta rule: DeltaNet, Gated DeltaNet (a scalar gate per
 * token) and Kimi Delta Attention (a gate per key channel), forward and
 * backward.
 *
 * Per head, a state S (K x V) and per token t (q_t, k_t normalised and
 * q_t scaled first, attnx.h):
 *   S <- D_t S,  D_t = diag(exp(g_t))                  (the gate; D_t = 1 without)
 *   S <- S + k_t u_t^T,  u_t = beta_t (v_t - (D_t S)^T k_t)
 *   o_t = S^T q_t
 *
 * Legend: n tokens, K key features (dk), V value features (dv), C the chunk
 * length, L <= C the rows of the chunk at hand, B = SUB the sub-blocks of a
 * chunk (per-channel gate).
 *   Q, Kn  (L, K)  the chunk's queries and keys, normalised and scaled
 *   G      (L, K)  per channel, or (L) scalar: cumulative log gates from the
 *                  chunk's start, G_t = g_0 + ... + g_t; Gend = G_{L-1}
 *   M      (L, L)  M_ts = sum_c k_tc k_sc e^{G_tc - G_sc}, s < t
 *   P      (L, L)  P_ts = sum_c q_tc k_sc e^{G_tc - G_sc}, s <= t
 *   U      (L, V)  the values u_t that enter the state
 *
 * The chunk form (the WY / UT representation: Yang et al. 2024, "Parallelizing
 * Linear Transformers with the Delta Rule over Sequence Length"): with S0 the
 * state before the chunk, unrolling the recurrence gives
 *   (I + diag(beta) M) U = diag(beta) (V - (Kn . e^G) S0)      a unit lower
 *                                                             triangular solve
 *   O  = (Q . e^G) S0 + P U
 *   S1 = e^{Gend} . S0 + (Kn . e^{Gend - G})^T U
 * where X . e^G scales row t of X by e^{G_t} (per channel, or one number).
 * Every factor e^{G_t - G_s} has t >= s, so it is <= 1 for gates <= 0: the
 * scalar gate forms M and P by a GEMM scaled entry by entry; the per-channel
 * gate cannot factor e^{G_tc - G_sc} into a row and a column factor that
 * both stay bounded across a whole chunk, so M and P are made in sub-blocks
 * of SUB rows: for s in an earlier sub-block than t, split at r, the first
 * row of t's sub-block (s < r <= t): e^{G_t - G_s} = e^{G_t - G_r} e^{G_r - G_s},
 * both factors <= 1, one GEMM per sub-block; within a sub-block, exact loops.
 *
 * The backward (attnx_delta_bwd) keeps the states at chunk borders: it runs
 * the chunks forward once, storing per chunk S0, M, P, U and V - (Kn . e^G) S0
 * (O(n (K V / C + 2 C + 2 V)) numbers per thread, never per head), then
 * runs them in reverse carrying dS, the gradient at the chunk's end state.
 * Recomputing the states instead would run the forward twice more (or keep
 * sqrt(n) checkpoints); keeping them costs K V / C = 256 numbers per token
 * at K = V = 128, C = 64, about as much as the token's q, k, v and out.
 *
 * Products: on the register-blocked kernels the delta_rule family's table
 * chose (mk_gemm, dispatch.c) where a product's width is whole vectors,
 * else BLAS (product); the triangular solve by blocks on the same kernels.
 *
 * Threads: OpenMP over heads, BLAS single-threaded inside; a decoding step
 * (one token) splits its heads over attnx's own team (team.c) instead.
 */
#ifndef REAL
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "blas.h"
#include "dispatch.h"
#include "microkernel.h"
#include "portable.h"

#if defined(MK_HAVE_X86) || defined(MK_HAVE_NEON)
/* the chunks' products on the register-blocked mk_gemm (mk_backward.h)
 * where the family's table chose a set with them (dispatch.c) */
#define DELTA_KERNELS 1
#endif

#define SUB 16
/* rows per block of the triangular solve and of the products with a
 * triangle of zeros, on the family's kernels */
#define TRI_ROWS 16
/* which triangle of a chunk's product is zero (triangle_product) */
enum { TRI_RESULT, TRI_LEFT, TRI_LEFT_T };
/* as linear.c: below this much work per call, one thread */
#define MIN_PARALLEL_FLOPS 1e6
#define MIN_PARALLEL_STATE_BYTES (256 * 1024)
#define L2NORM_EPS 1e-6
/* columns per block of a decoding step (token_step) and of a block's rows
 * in the triangular solve (solve_columns), 256 bytes: a step's two sums
 * are 2 x 4 vectors in AVX-512 registers, 2 x 8 in AVX2's 16 */
#define STEP_COLUMNS (256 / (ptrdiff_t)sizeof(REAL))
/* and its scratch per thread: k normalised, D, D q, D k */
#define TOKEN_SCRATCH(K) (4 * (K))

#define ATTNX_FAMILY_FILE "delta.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */
#include "softmax_internal.h"  /* mk_transpose */

#if REAL_IS_DOUBLE
#define TRSM ATTNX_CBLAS(cblas_dtrsm)
#else
#define TRSM ATTNX_CBLAS(cblas_strsm)
#endif
#define WS SFX(delta_ws)

/* Everything one thread needs for the heads it runs. */
typedef struct {
    const attnx_delta_args *a;
    ptrdiff_t C, K, V;
    int channel;               /* the gate is per channel: G is (L, K), else (L) */
    int width;                 /* the family's kernels (attnx_kernels_width); 0: BLAS */
    ptrdiff_t lanes;           /* their numbers per vector */
    /* the chunk's rows */
    REAL *Q, *Kn, *G, *beta, *inv_q, *inv_k;
    /* products */
    REAL *Kg, *Qg, *Kd, *M, *P, *Lm, *U, *E, *xs, *xs2, *ys;
    REAL *BT;                  /* a product's B transposed, for the family's kernels */
    REAL *S;                   /* the running state when the caller keeps none */
    /* backward */
    REAL *dQg, *dKg, *dKd, *R1, *R2, *C1, *dG, *dU, *dP, *dA, *dS, *dSn, *Vn, *dbeta;
    REAL *keep;                /* per chunk: S0, M, P, U, Vn */
} WS;

static ptrdiff_t SFX(chunk_keep_size)(ptrdiff_t C, ptrdiff_t K, ptrdiff_t V)
{
    return K * V + 2 * C * C + 2 * C * V;
}

/* numbers of scratch one thread needs (laid out by ws_carve) */
static size_t SFX(ws_size)(ptrdiff_t C, ptrdiff_t K, ptrdiff_t V, ptrdiff_t n, int backward)
{
    size_t CK = (size_t)(C * K), CC = (size_t)(C * C), CV = (size_t)(C * V), KV = (size_t)(K * V);
    size_t size = 7 * CK + 3 * (size_t)C + 4 * CC + CV + (CK > CV ? CK : CV) +
                  2 * (size_t)(SUB * K) + KV + (size_t)(ATTNX_MAX(K, C) * ATTNX_MAX(K, V));
    if (backward) {
        ptrdiff_t chunks = (n + C - 1) / C;
        size += 7 * CK + 2 * CV + 2 * CC + 2 * KV + (size_t)C +
                (size_t)chunks * (size_t)SFX(chunk_keep_size)(C, K, V);
    }
    return size;
}

static void SFX(ws_carve)(WS *w, REAL *mem, int backward)
{
    ptrdiff_t C = w->C, K = w->K, V = w->V;
    REAL *p = mem;
#define TAKE(ptr, count) (ptr = p, p += (count))
    TAKE(w->Q, C * K); TAKE(w->Kn, C * K); TAKE(w->G, C * K); TAKE(w->ys, C * K);
    TAKE(w->Kg, C * K); TAKE(w->Qg, C * K); TAKE(w->Kd, C * K);
    TAKE(w->BT, ATTNX_MAX(K, C) * ATTNX_MAX(K, V));
    TAKE(w->beta, C); TAKE(w->inv_q, C); TAKE(w->inv_k, C);
    TAKE(w->M, C * C); TAKE(w->P, C * C); TAKE(w->Lm, C * C); TAKE(w->E, C * C);
    TAKE(w->U, C * V); TAKE(w->Vn, C * K > C * V ? C * K : C * V);
    TAKE(w->xs, SUB * K); TAKE(w->xs2, SUB * K); TAKE(w->S, K * V);
    if (backward) {
        TAKE(w->dQg, C * K); TAKE(w->dKg, C * K); TAKE(w->dKd, C * K); TAKE(w->R1, C * K);
        TAKE(w->R2, C * K); TAKE(w->C1, C * K); TAKE(w->dG, C * K);
        TAKE(w->dU, C * V); TAKE(w->dP, C * C); TAKE(w->dA, C * C);
        TAKE(w->dS, K * V); TAKE(w->dSn, K * V); TAKE(w->dbeta, C);
        w->keep = p;
    }
#undef TAKE
}

/* A thread's WS before its memory: the sizes, the gate's kind, the
 * family's kernels */
static WS SFX(ws_for)(const attnx_delta_args *a, ptrdiff_t C)
{
    WS w = {.a = a, .C = C, .K = a->dk, .V = a->dv, .channel = a->gate == ATTNX_GATE_CHANNEL};
#ifdef DELTA_KERNELS
    w.width = attnx_kernels_width(attnx_kernels(ATTNX_FAMILY_DELTA));
#endif
    w.lanes = w.width ? MK_LANES(w.width, sizeof(REAL)) : 1;
    return w;
}

/* C (M, N) = alpha op(A) op(B) + beta C: on the family's register-blocked
 * mk_gemm where it applies (beta 0 or 1, N whole vectors, no operand
 * broadcast with row stride 0; a transposed B is transposed into w->BT
 * first, as mk_gemm reads B's rows), else SFX(gemm) (BLAS). These products
 * are small (a chunk of 64 rows against a 128 x 128 state), and OpenBLAS
 * spends a good part of such a call copying its operands into its own
 * layout, which mk_gemm does not need. */
static inline void SFX(product)(const WS *w, int trans_a, int trans_b, ptrdiff_t M, ptrdiff_t N,
                                ptrdiff_t depth, REAL alpha, const REAL *A, ptrdiff_t lda,
                                const REAL *B, ptrdiff_t ldb, REAL beta, REAL *C, ptrdiff_t ldc)
{
#ifdef DELTA_KERNELS
    if (w->width && (beta == 0 || beta == 1) && N % w->lanes == 0 && M > 0 && N > 0 &&
        depth > 0 && lda != 0 && ldb != 0) {
        if (trans_b) {
            SFX(mk_transpose)(w->BT, N, B, ldb, N, depth, w->width);
            B = w->BT, ldb = N;
        }
        TYPED(mk_gemm_f32, mk_gemm_f64)(w->width, M, N, depth, alpha, A, trans_a ? 1 : lda,
                                        trans_a ? lda : 1, B, ldb, beta == 1, C, ldc);
        return;
    }
#endif
    SFX(gemm)(trans_a, trans_b, M, N, depth, alpha, A, lda, B, ldb, beta, C, ldc);
}

/* The chunk's products with a triangle of zeros, by blocks of TRI_ROWS rows
 * of C, each block computing only up to the triangle: at L = 64 that is 5/8
 * of the full product's work. The shapes, A and C with row strides lda, ldc:
 *  TRI_RESULT  C (L, L) = alpha A B^T, B (L, depth), wanted on and below
 *              the diagonal: a block of rows [r0, r1) takes the columns up to
 *              r1 rounded up to whole vectors; its others are not written
 *              (the callers set what lies above the diagonal);
 *  TRI_LEFT    C (L, N) = alpha A B + beta C, A (L, L) zero above its
 *              diagonal, B (L, N): a block takes depth [0, r1);
 *  TRI_LEFT_T  C (L, N) = alpha A^T B + beta C, the same A and B: depth
 *              [r0, L).
 * Without the family's kernels, or for a chunk of L not whole vectors (the
 * last one), one product of the full shape. */
static void SFX(triangle_product)(const WS *w, int shape, ptrdiff_t L, ptrdiff_t N,
                                  ptrdiff_t depth, REAL alpha, const REAL *A, ptrdiff_t lda,
                                  const REAL *B, ptrdiff_t ldb, REAL beta, REAL *C,
                                  ptrdiff_t ldc)
{
    if (!w->width || L % w->lanes != 0) {
        if (shape == TRI_RESULT)
            SFX(product)(w, 0, 1, L, L, depth, alpha, A, lda, B, ldb, beta, C, ldc);
        else
            SFX(product)(w, shape == TRI_LEFT_T, 0, L, N, L, alpha, A, lda, B, ldb, beta, C,
                         ldc);
        return;
    }
    if (shape == TRI_RESULT) {  /* B^T once, for every block */
        SFX(mk_transpose)(w->BT, L, B, ldb, L, depth, w->width);
        B = w->BT, ldb = L;
    }
    for (ptrdiff_t r0 = 0; r0 < L; r0 += TRI_ROWS) {
        ptrdiff_t r1 = ATTNX_MIN(L, r0 + TRI_ROWS), rows = r1 - r0;
        REAL *C_block = C + r0 * ldc;
        if (shape == TRI_RESULT) {
            ptrdiff_t cols = ATTNX_MIN(L, (r1 + w->lanes - 1) / w->lanes * w->lanes);
            SFX(product)(w, 0, 0, rows, cols, depth, alpha, A + r0 * lda, lda, B, ldb, 0,
                         C_block, ldc);
        } else if (shape == TRI_LEFT) {
            SFX(product)(w, 0, 0, rows, N, r1, alpha, A + r0 * lda, lda, B, ldb, beta,
                         C_block, ldc);
        } else {
            SFX(product)(w, 1, 0, rows, N, L - r0, alpha, A + r0 * lda + r0, lda,
                         B + r0 * ldb, ldb, beta, C_block, ldc);
        }
    }
}

/* Rows [b0, b1) of X (L, V) solved among themselves on columns [j0, j0 +
 * width): x_i -= sum_j A_ij x_j over the block's rows j before i (trans:
 * A_ji over those after, last row first). A row's columns stay in
 * registers over its sum (unit_lower_solve calls this with width
 * STEP_COLUMNS, a constant once inlined), read and written once. */
static inline __attribute__((always_inline)) void SFX(solve_columns)(
    int trans, ptrdiff_t b0, ptrdiff_t b1, ptrdiff_t j0, ptrdiff_t width, const REAL *A,
    ptrdiff_t lda, REAL *X, ptrdiff_t V)
{
    /* the coefficients of row i: A_ij at A[i * a_row + j * a_col] */
    const ptrdiff_t a_row = trans ? 1 : lda, a_col = trans ? lda : 1;
    for (ptrdiff_t step = 1; step < b1 - b0; step++) {
        ptrdiff_t i = trans ? b1 - 1 - step : b0 + step;
        ptrdiff_t j_first = trans ? i + 1 : b0, count = step;
        REAL *row_i = X + i * V + j0, x_i[STEP_COLUMNS];
        const REAL *a_i = A + i * a_row + j_first * a_col, *rows_j = X + j_first * V + j0;
#pragma omp simd
        for (ptrdiff_t c = 0; c < width; c++) x_i[c] = row_i[c];
        for (ptrdiff_t j = 0; j < count; j++) {
            const REAL a_ij = a_i[j * a_col], *row_j = rows_j + j * V;
#pragma omp simd
            for (ptrdiff_t c = 0; c < width; c++) x_i[c] -= a_ij * row_j[c];
        }
#pragma omp simd
        for (ptrdiff_t c = 0; c < width; c++) row_i[c] = x_i[c];
    }
}

/* X (L, V) <- (I + A)^{-1} X (trans 0) or (I + A)^{-T} X (trans 1), A strictly
 * lower (L, L) with row stride lda, read below its diagonal only. On the
 * family's kernels by blocks of TRI_ROWS rows, first to last (trans: last
 * to first): what the rows solved before give a block is one product, the
 * block itself is solved row by row. Else BLAS's trsm. */
static ATTNX_HOT void SFX(unit_lower_solve)(const WS *w, int trans, ptrdiff_t L, ptrdiff_t V,
                                            const REAL *A, ptrdiff_t lda, REAL *X)
{
    if (L <= 1 || V == 0) return;
    if (!w->width || V % w->lanes != 0) {
        TRSM(CblasRowMajor, CblasLeft, CblasLower, trans ? CblasTrans : CblasNoTrans, CblasUnit,
             (int)L, (int)V, 1, A, (int)lda, X, (int)V);
        return;
    }
    for (ptrdiff_t block = 0; block < L; block += TRI_ROWS) {
        ptrdiff_t b0 = trans ? (L - 1 - block) / TRI_ROWS * TRI_ROWS : block;
        ptrdiff_t b1 = ATTNX_MIN(L, b0 + TRI_ROWS);
        /* X_i -= sum_{j < i} A_ij X_j (trans: sum_{j > i} A_ji X_j, A^T's rows
         * are A's columns) for the rows j solved before the block */
        if (!trans && b0 > 0)
            SFX(product)(w, 0, 0, b1 - b0, V, b0, -1, A + b0 * lda, lda, X, V, 1, X + b0 * V, V);
        if (trans && b1 < L)
            SFX(product)(w, 1, 0, b1 - b0, V, L - b1, -1, A + b1 * lda + b0, lda, X + b1 * V, V,
                         1, X + b0 * V, V);
        ptrdiff_t j0 = 0;
        for (; j0 + STEP_COLUMNS <= V; j0 += STEP_COLUMNS)
            SFX(solve_columns)(trans, b0, b1, j0, STEP_COLUMNS, A, lda, X, V);
        if (j0 < V) SFX(solve_columns)(trans, b0, b1, j0, V - j0, A, lda, X, V);
    }
}

/* Head h's operand at `slot`: its base plus the head's byte offset. */
static inline const char *SFX(head)(const attnx_delta_args *a, const void *base, ptrdiff_t h,
                                     int slot)
{
    return base ? (const char *)base + a->offsets[h * ATTNX_DR_NOPS + slot] : NULL;
}

/* 1 / sqrt(|x|^2 + eps): transformers' l2norm (x * rsqrt(sum x^2 + 1e-6)) */
static inline __attribute__((always_inline)) REAL SFX(inv_norm)(const REAL *x, ptrdiff_t K)
{
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t c = 0; c < K; c++) sum += x[c] * x[c];
    return (REAL)(1 / sqrt((double)sum + L2NORM_EPS));
}

/* The chunk's rows [t0, t0 + L) of head h: Q, Kn, beta, G, inv norms. */
static ATTNX_HOT void SFX(load_rows)(WS *w, ptrdiff_t h, ptrdiff_t t0, ptrdiff_t L)
{
    const attnx_delta_args *a = w->a;
    const ptrdiff_t K = w->K;
    const char *q = SFX(head)(a, a->q, h, ATTNX_DR_Q), *k = SFX(head)(a, a->k, h, ATTNX_DR_K);
    const char *beta = SFX(head)(a, a->beta, h, ATTNX_DR_BETA);
    const char *g = SFX(head)(a, a->g, h, ATTNX_DR_G);
    const REAL scale = (REAL)a->scale;
    for (ptrdiff_t t = 0; t < L; t++) {
        const REAL *q_t = (const REAL *)q + (t0 + t) * a->q_row;
        const REAL *k_t = (const REAL *)k + (t0 + t) * a->k_row;
        REAL iq = a->l2norm ? SFX(inv_norm)(q_t, K) : 1, ik = a->l2norm ? SFX(inv_norm)(k_t, K) : 1;
        w->inv_q[t] = iq;
        w->inv_k[t] = ik;
        REAL fq = iq * scale, *Q_t = w->Q + t * K, *K_t = w->Kn + t * K;
#pragma omp simd
        for (ptrdiff_t c = 0; c < K; c++) {
            Q_t[c] = q_t[c] * fq;
            K_t[c] = k_t[c] * ik;
        }
        w->beta[t] = *(const REAL *)(beta + (t0 + t) * a->beta_step);
        if (a->gate == ATTNX_GATE_CHANNEL) {
            const REAL *g_t = (const REAL *)g + (t0 + t) * a->g_row;
            REAL *G_t = w->G + t * K;
            if (t == 0)
                for (ptrdiff_t c = 0; c < K; c++) G_t[c] = g_t[c];
            else
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) G_t[c] = G_t[c - K] + g_t[c];
        } else {
            REAL g_t = a->gate == ATTNX_GATE_SCALAR ? *(const REAL *)(g + (t0 + t) * a->g_step) : 0;
            w->G[t] = (t ? w->G[t - 1] : 0) + g_t;
        }
    }
}

/* dst (L, K) = X . e^{sign (G_t - ref)}: row t of X scaled by e^{G_t - ref}
 * (sign 1) or e^{ref - G_t} (sign -1), ref a row of G (NULL: zeros); and
 * dst2 = X2 . the same factors when X2 is not NULL (each exponential once
 * for both: per channel they are most of a chunk's own arithmetic). */
static ATTNX_HOT void SFX(decay_rows)(const WS *w, ptrdiff_t L, const REAL *X, const REAL *X2,
                                      const REAL *G, const REAL *ref, REAL sign, REAL *dst,
                                      REAL *dst2)
{
    const ptrdiff_t K = w->K;
    for (ptrdiff_t t = 0; t < L; t++) {
        const REAL *x_t = X + t * K, *x2_t = X2 ? X2 + t * K : NULL;
        REAL *d_t = dst + t * K, *d2_t = X2 ? dst2 + t * K : NULL;
        if (w->channel) {
            const REAL *G_t = G + t * K;
            if (x2_t) {
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) {
                    REAL f = SFX(vexp)(sign * (G_t[c] - (ref ? ref[c] : 0)));
                    d_t[c] = x_t[c] * f;
                    d2_t[c] = x2_t[c] * f;
                }
            } else {
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++)
                    d_t[c] = x_t[c] * SFX(vexp)(sign * (G_t[c] - (ref ? ref[c] : 0)));
            }
        } else {
            REAL f = SFX(vexp)(sign * (G[t] - (ref ? ref[0] : 0)));
#pragma omp simd
            for (ptrdiff_t c = 0; c < K; c++) d_t[c] = x_t[c] * f;
            if (x2_t)
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) d2_t[c] = x2_t[c] * f;
        }
    }
}

/* x *= factor, entry by entry (count entries) */
static inline void SFX(scale_by)(REAL *x, const REAL *factor, ptrdiff_t count)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < count; c++) x[c] *= factor[c];
}

/* decay (rows - 1, K): e^{G_t - G_{t-1}} per channel for the rows t of
 * (tb, tb + rows), each <= 1 for gates <= 0: within a sub-block,
 * e^{G_t - G_s} = e^{G_{s+1} - G_s} ... e^{G_t - G_{t-1}} for s < t, a
 * running product of these factors, one exponential per row and channel
 * instead of one per pair of rows and channel. */
static ATTNX_HOT void SFX(row_decays)(const WS *w, ptrdiff_t tb, ptrdiff_t rows, REAL *decay)
{
    const ptrdiff_t K = w->K;
    for (ptrdiff_t t = tb + 1; t < tb + rows; t++) {
        const REAL *G_t = w->G + t * K, *G_prev = G_t - K;
        REAL *d = decay + (t - tb - 1) * K;
#pragma omp simd
        for (ptrdiff_t c = 0; c < K; c++) d[c] = SFX(vexp)(G_t[c] - G_prev[c]);
    }
}

/* the row of G that holds token t's cumulative gate */
static inline const REAL *SFX(G_row)(const WS *w, ptrdiff_t t)
{
    return w->G + (w->channel ? t * w->K : t);
}

/* Ask the memory for the rows of head h's chunk at t0, if there is one,
 * while the chunk before it computes: q, k, v, and out (forward) or dout
 * (backward). Inputs in [B, n, H, d] (transformers' layout) have each
 * head's rows a page or more apart, and the processor's own prefetcher
 * does not cross pages: each row would wait for the memory. */
static inline __attribute__((always_inline)) void SFX(prefetch_chunk)(const WS *w, ptrdiff_t h,
                                                                      ptrdiff_t t0)
{
    const attnx_delta_args *a = w->a;
    if (t0 < 0 || t0 >= a->n) return;
    ptrdiff_t rows = ATTNX_MIN(w->C, a->n - t0);
    const REAL *q = (const REAL *)SFX(head)(a, a->q, h, ATTNX_DR_Q);
    const REAL *k = (const REAL *)SFX(head)(a, a->k, h, ATTNX_DR_K);
    const REAL *v = (const REAL *)SFX(head)(a, a->v, h, ATTNX_DR_V);
    SFX(prefetch_rows)(q + t0 * a->q_row, a->q_row, rows, w->K);
    SFX(prefetch_rows)(k + t0 * a->k_row, a->k_row, rows, w->K);
    SFX(prefetch_rows)(v + t0 * a->v_row, a->v_row, rows, w->V);
    if (a->dout) {
        const REAL *dout = (const REAL *)SFX(head)(a, a->dout, h, ATTNX_DR_DOUT);
        SFX(prefetch_rows)(dout + t0 * a->dout_row, a->dout_row, rows, w->V);
    }
    if (a->out) {
        const REAL *out = (const REAL *)SFX(head)(a, a->out, h, ATTNX_DR_OUT);
        SFX(prefetch_rows)(out + t0 * a->out_row, a->out_row, rows, w->V);
    }
}

/* E_ts = e^{G_t - G_s} for s <= t (scalar gate), 0 above */
static ATTNX_HOT void SFX(scalar_decays)(WS *w, ptrdiff_t L)
{
    const ptrdiff_t C = w->C;
    for (ptrdiff_t t = 0; t < L; t++) {
        REAL *E_t = w->E + t * C, G_t = w->G[t];
        for (ptrdiff_t s = 0; s <= t; s++) E_t[s] = SFX(vexp)(G_t - w->G[s]);
        for (ptrdiff_t s = t + 1; s < L; s++) E_t[s] = 0;
    }
}

/* M (strictly lower) and, with want_P, P (lower) of the chunk's L rows. */
static ATTNX_HOT void SFX(gated_products)(WS *w, ptrdiff_t L, int want_P)
{
    const ptrdiff_t C = w->C, K = w->K;
    REAL *M = w->M, *P = w->P;
    if (!w->channel) {
        SFX(triangle_product)(w, TRI_RESULT, L, L, K, 1, w->Kn, K, w->Kn, K, 0, M, C);
        if (want_P)
            SFX(triangle_product)(w, TRI_RESULT, L, L, K, 1, w->Q, K, w->Kn, K, 0, P, C);
        SFX(scalar_decays)(w, L);
        for (ptrdiff_t t = 0; t < L; t++) {
            const REAL *E_t = w->E + t * C;
            REAL *M_t = M + t * C, *P_t = P + t * C;
            for (ptrdiff_t s = 0; s < L; s++) {
                M_t[s] = s < t ? M_t[s] * E_t[s] : 0;
                if (want_P) P_t[s] = s <= t ? P_t[s] * E_t[s] : 0;
            }
        }
        return;
    }
    for (ptrdiff_t tb = 0; tb < L; tb += SUB) {
        ptrdiff_t te = ATTNX_MIN(tb + SUB, L), rows = te - tb;
        const REAL *G_r = w->G + tb * K;
        if (tb > 0) {  /* columns of earlier sub-blocks, split at r = tb */
            SFX(decay_rows)(w, tb, w->Kn, NULL, w->G, G_r, -1, w->ys, NULL);
            SFX(decay_rows)(w, rows, w->Kn + tb * K, want_P ? w->Q + tb * K : NULL,
                            w->G + tb * K, G_r, 1, w->xs, w->xs2);
            SFX(product)(w, 0, 1, rows, tb, K, 1, w->xs, K, w->ys, K, 0, M + tb * C, C);
            if (want_P)
                SFX(product)(w, 0, 1, rows, tb, K, 1, w->xs2, K, w->ys, K, 0, P + tb * C, C);
        }
        /* the sub-block itself, exactly: for each column s, run = e^{G_t - G_s} . k_s
         * down the rows t >= s (row_decays) */
        REAL *decay = w->xs, *run = w->xs2;
        SFX(row_decays)(w, tb, rows, decay);
        for (ptrdiff_t s = tb; s < te; s++) {
            memcpy(run, w->Kn + s * K, (size_t)K * sizeof(REAL));
            for (ptrdiff_t t = s; t < te; t++) {
                const REAL *k_t = w->Kn + t * K, *q_t = w->Q + t * K;
                if (t > s) SFX(scale_by)(run, decay + (t - tb - 1) * K, K);
                REAL mk = 0, mq = 0;
#pragma omp simd reduction(+ : mk, mq)
                for (ptrdiff_t c = 0; c < K; c++) {
                    mk += k_t[c] * run[c];
                    mq += q_t[c] * run[c];
                }
                M[t * C + s] = s < t ? mk : 0;
                if (want_P) P[t * C + s] = mq;
            }
        }
        for (ptrdiff_t t = tb; t < te; t++) {
            for (ptrdiff_t s = t + 1; s < L; s++) {
                M[t * C + s] = 0;
                if (want_P) P[t * C + s] = 0;
            }
        }
    }
}

/* One chunk forward from the state S (K, V), updated in place; out rows (ld
 * out_row) unless NULL; with keep, the chunk's S0, M, P, U, Vn stored there. */
static ATTNX_HOT void SFX(chunk_fwd)(WS *w, ptrdiff_t L, REAL *S, const REAL *v, ptrdiff_t v_row,
                           REAL *out, ptrdiff_t out_row, REAL *keep)
{
    const ptrdiff_t C = w->C, K = w->K, V = w->V;
    const int want_P = out || keep;
    const REAL *Gend = SFX(G_row)(w, L - 1);
    if (keep) memcpy(keep, S, (size_t)(K * V) * sizeof(REAL));
    /* R = diag(beta) (V - (Kn . e^G) S0), solved in place into U */
    SFX(decay_rows)(w, L, w->Kn, out ? w->Q : NULL, w->G, NULL, 1, w->Kg, w->Qg);
    for (ptrdiff_t t = 0; t < L; t++) memcpy(w->U + t * V, v + t * v_row, (size_t)V * sizeof(REAL));
    SFX(product)(w, 0, 0, L, V, K, -1, w->Kg, K, S, V, 1, w->U, V);
    if (keep) memcpy(keep + K * V + 2 * C * C + C * V, w->U, (size_t)(L * V) * sizeof(REAL));
    for (ptrdiff_t t = 0; t < L; t++) {
        REAL b = w->beta[t], *U_t = w->U + t * V;
#pragma omp simd
        for (ptrdiff_t j = 0; j < V; j++) U_t[j] *= b;
    }
    SFX(gated_products)(w, L, want_P);
    for (ptrdiff_t t = 0; t < L; t++)
        for (ptrdiff_t s = 0; s < t; s++) w->Lm[t * C + s] = w->beta[t] * w->M[t * C + s];
    SFX(unit_lower_solve)(w, 0, L, V, w->Lm, C, w->U);
    if (keep) {
        memcpy(keep + K * V, w->M, (size_t)(L * C) * sizeof(REAL));
        memcpy(keep + K * V + C * C, w->P, (size_t)(L * C) * sizeof(REAL));
        memcpy(keep + K * V + 2 * C * C, w->U, (size_t)(L * V) * sizeof(REAL));
    }
    if (out) {  /* O = (Q . e^G) S0 + P U, Qg made with Kg */
        SFX(product)(w, 0, 0, L, V, K, 1, w->Qg, K, S, V, 0, out, out_row);
        SFX(triangle_product)(w, TRI_LEFT, L, V, L, 1, w->P, C, w->U, V, 1, out, out_row);
    }
    /* S1 = e^{Gend} . S0 + (Kn . e^{Gend - G})^T U */
    SFX(decay_rows)(w, L, w->Kn, NULL, w->G, Gend, -1, w->Kd, NULL);
    for (ptrdiff_t c = 0; c < K; c++) {
        REAL f = SFX(vexp)(w->channel ? Gend[c] : Gend[0]), *S_c = S + c * V;
#pragma omp simd
        for (ptrdiff_t j = 0; j < V; j++) S_c[j] *= f;
    }
    SFX(product)(w, 1, 0, K, V, L, 1, w->Kd, K, w->U, V, 1, S, V);
}

/* Columns [j0, j0 + width) of one token's step (token_step): their sums
 * (D S0)^T k and (D S0)^T q over every row, then u, o and S1 on them. Every
 * column is independent of the others, so a block's sums stay in registers
 * (token_step calls this with width STEP_COLUMNS, a constant once inlined)
 * and its rows are still in the cache when S1 is written; the update runs
 * the rows backwards, through the ones the sums read last. kd = D k. */
static inline __attribute__((always_inline)) void SFX(step_columns)(
    ptrdiff_t K, ptrdiff_t j0, ptrdiff_t width, const REAL *S0, ptrdiff_t S0_row, REAL *S1,
    ptrdiff_t S1_row, const REAL *kn, const REAL *dec, const REAL *kd, const REAL *qd,
    const REAL *v, REAL beta, REAL kq, REAL *o)
{
    REAL kv[STEP_COLUMNS] = {0}, qs[STEP_COLUMNS] = {0}, u[STEP_COLUMNS];
    for (ptrdiff_t c = 0; c < K; c++) {
        const REAL *row = S0 + c * S0_row + j0;
        REAL kc = kd[c], qc = qd[c];
#pragma omp simd
        for (ptrdiff_t j = 0; j < width; j++) {
            kv[j] += kc * row[j];
            qs[j] += qc * row[j];
        }
    }
#pragma omp simd
    for (ptrdiff_t j = 0; j < width; j++) {
        u[j] = beta * (v[j0 + j] - kv[j]);
        o[j0 + j] = qs[j] + kq * u[j];
    }
    for (ptrdiff_t c = K - 1; c >= 0; c--) {
        const REAL *row = S0 + c * S0_row + j0;
        REAL *updated = S1 + c * S1_row + j0;
        REAL e = dec[c], kc = kn[c];
#pragma omp simd
        for (ptrdiff_t j = 0; j < width; j++) updated[j] = e * row[j] + kc * u[j];
    }
}

/* One token of one head: S1 = D S0 + k u^T, u = beta (v - (D S0)^T k),
 * o = S1^T q = (D S0)^T q + u (k . q), with q, k normalised and scaled and
 * D = diag(exp(g)). S0 (row stride S0_row) is read once for both products,
 * then once more (from the cache) as S1 is written, block of columns by
 * block (step_columns); S1 may be S0 itself. A decoding step is
 * memory-bound on the state: this reads it once from memory and writes it
 * once, where a step as the recurrence reads (decay, S^T k, then the
 * update and S^T q) makes two passes over it. scratch: TOKEN_SCRATCH(K)
 * numbers. */
static ATTNX_HOT void SFX(token_step)(const attnx_delta_args *a, ptrdiff_t h, ptrdiff_t t,
                                      const REAL *S0, ptrdiff_t S0_row, REAL *S1, REAL *scratch)
{
    const ptrdiff_t K = a->dk, V = a->dv;
    const REAL *q = (const REAL *)SFX(head)(a, a->q, h, ATTNX_DR_Q) + t * a->q_row;
    const REAL *k = (const REAL *)SFX(head)(a, a->k, h, ATTNX_DR_K) + t * a->k_row;
    const REAL *v = (const REAL *)SFX(head)(a, a->v, h, ATTNX_DR_V) + t * a->v_row;
    REAL *o = (REAL *)SFX(head)(a, a->out, h, ATTNX_DR_OUT) + t * a->out_row;
    const char *g = SFX(head)(a, a->g, h, ATTNX_DR_G);
    const REAL beta = *(const REAL *)(SFX(head)(a, a->beta, h, ATTNX_DR_BETA) + t * a->beta_step);
    REAL *kn = scratch, *dec = kn + K, *qd = dec + K, *kd = qd + K;
    REAL iq = a->l2norm ? SFX(inv_norm)(q, K) : 1, ik = a->l2norm ? SFX(inv_norm)(k, K) : 1;
    REAL fq = iq * (REAL)a->scale, kq = 0;
    if (a->gate == ATTNX_GATE_CHANNEL) {
        const REAL *g_t = (const REAL *)g + t * a->g_row;
#pragma omp simd
        for (ptrdiff_t c = 0; c < K; c++) dec[c] = SFX(vexp)(g_t[c]);
    } else {
        REAL e = a->gate == ATTNX_GATE_SCALAR ? SFX(vexp)(*(const REAL *)(g + t * a->g_step)) : 1;
        for (ptrdiff_t c = 0; c < K; c++) dec[c] = e;
    }
    /* kn = k normalised, kd = D kn, qd = D q (normalised, scaled), kq = k . q */
#pragma omp simd reduction(+ : kq)
    for (ptrdiff_t c = 0; c < K; c++) {
        REAL kc = k[c] * ik, qc = q[c] * fq;
        kq += kc * qc;
        kn[c] = kc;
        kd[c] = kc * dec[c];
        qd[c] = qc * dec[c];
    }
    ptrdiff_t j0 = 0;
    for (; j0 + STEP_COLUMNS <= V; j0 += STEP_COLUMNS)
        SFX(step_columns)(K, j0, STEP_COLUMNS, S0, S0_row, S1, V, kn, dec, kd, qd, v, beta, kq,
                          o);
    if (j0 < V)
        SFX(step_columns)(K, j0, V - j0, S0, S0_row, S1, V, kn, dec, kd, qd, v, beta, kq, o);
}

/* The token loop on head h: from S0 (or zeros) into S1 (C order) */
static void SFX(recurrent_head)(const attnx_delta_args *a, ptrdiff_t h, REAL *S1, REAL *scratch)
{
    const REAL *S0 = (const REAL *)SFX(head)(a, a->S0, h, ATTNX_DR_S0);
    ptrdiff_t S0_row = a->S0_row;
    if (!S0) {
        memset(S1, 0, (size_t)(a->dk * a->dv) * sizeof(REAL));
        S0 = S1, S0_row = a->dv;
    } else if (a->n == 0 && S0 != S1) {
        for (ptrdiff_t c = 0; c < a->dk; c++)
            memmove(S1 + c * a->dv, S0 + c * S0_row, (size_t)a->dv * sizeof(REAL));
    }
    for (ptrdiff_t t = 0; t < a->n; t++) {
        SFX(token_step)(a, h, t, S0, S0_row, S1, scratch);
        S0 = S1, S0_row = a->dv;
    }
}

/* the head's running state: S1 itself (C order) when wanted, else scratch;
 * started from S0 or zeros */
static REAL *SFX(start_state)(WS *w, ptrdiff_t h)
{
    const attnx_delta_args *a = w->a;
    const ptrdiff_t K = w->K, V = w->V;
    REAL *S = a->S1 ? (REAL *)SFX(head)(a, a->S1, h, ATTNX_DR_S1) : w->S;
    const REAL *S0 = (const REAL *)SFX(head)(a, a->S0, h, ATTNX_DR_S0);
    if (!S0) {
        memset(S, 0, (size_t)(K * V) * sizeof(REAL));
    } else if (S0 != S) {
        for (ptrdiff_t c = 0; c < K; c++)
            memmove(S + c * V, S0 + c * a->S0_row, (size_t)V * sizeof(REAL));
    }
    return S;
}

static int SFX(stopped)(const attnx_delta_args *a)
{
    return a->interrupt && attnx_interrupted(a->interrupt, omp_get_thread_num() == 0);
}

static int SFX(plan_threads)(const attnx_delta_args *a)
{
    double flops = 4.0 * (double)a->heads * (double)a->n * (double)(a->dk * a->dv);
    double state_bytes = (double)a->heads * (double)(a->dk * a->dv) * sizeof(REAL);
    int threads = a->num_threads > 1 ? a->num_threads : 1;
    if (flops < MIN_PARALLEL_FLOPS && state_bytes < MIN_PARALLEL_STATE_BYTES) threads = 1;
    if ((ptrdiff_t)threads > a->heads) threads = (int)ATTNX_MAX(a->heads, 1);
    return threads;
}

/* the token loop's heads split into fixed runs, one per thread: from one
 * decoding step to the next a head's state stays in the same core's cache */
typedef struct {
    const attnx_delta_args *a;
    REAL *scratch;
    size_t per_thread;
} SFX(recurrent_task);

static void SFX(recurrent_share)(void *context, int me, int range, int ranges)
{
    const SFX(recurrent_task) *task = context;
    const attnx_delta_args *a = task->a;
    const ptrdiff_t K = a->dk;
    REAL *scratch = task->scratch + task->per_thread * (size_t)me;
    for (ptrdiff_t h = a->heads * range / ranges, end = a->heads * (range + 1) / ranges; h < end;
         h++) {
        if (a->interrupt && attnx_interrupted(a->interrupt, me == 0)) break;
        REAL *S1 = a->S1 ? (REAL *)SFX(head)(a, a->S1, h, ATTNX_DR_S1) : scratch + TOKEN_SCRATCH(K);
        SFX(recurrent_head)(a, h, S1, scratch);
    }
}

static int SFX(recurrent_fwd)(const attnx_delta_args *a)
{
    const ptrdiff_t K = a->dk, V = a->dv;
    const int threads = SFX(plan_threads)(a);
    /* per thread: the token's vectors, the state when the caller keeps
     * none; whole cache lines, so threads never share one */
    const size_t line = ATTNX_CACHE_LINE / sizeof(REAL);
    size_t per_thread = (size_t)(TOKEN_SCRATCH(K) + (a->S1 ? 0 : K * V));
    per_thread = (per_thread + line - 1) / line * line;
    REAL *scratch =
        attnx_aligned_alloc(ATTNX_CACHE_LINE, per_thread * (size_t)threads * sizeof(REAL));
    if (!scratch) return ATTNX_ENOMEM;
    SFX(recurrent_task) task = {a, scratch, per_thread};
    /* a decoding step splits over attnx's own team (team.c), which starts
     * and joins far sooner than a parallel region, when the team is free */
    int decoding = a->n <= 1;
    if (threads == 1) {
        SFX(recurrent_share)(&task, 0, 0, 1);
    } else if (!decoding || !attnx_team_run(threads, SFX(recurrent_share), &task)) {
#pragma omp parallel num_threads(decoding ? threads : attnx_omp_threads(threads))
        SFX(recurrent_share)(&task, omp_get_thread_num(), omp_get_thread_num(),
                             omp_get_num_threads());
    }
    attnx_aligned_free(scratch);
    return a->interrupt && a->interrupt->stopped ? ATTNX_EINTR : ATTNX_OK;
}

int TYPED(attnx_delta_fwd_f32, attnx_delta_fwd_f64)(const attnx_delta_args *a)
{
    if (a->heads == 0) return ATTNX_OK;
    if (a->recurrent) return SFX(recurrent_fwd)(a);
    const ptrdiff_t K = a->dk, V = a->dv;
    const ptrdiff_t C = ATTNX_MAX(1, ATTNX_MIN(a->chunk, ATTNX_MAX(a->n, 1)));
    const int threads = SFX(plan_threads)(a);
    const size_t per_thread = SFX(ws_size)(C, K, V, a->n, 0) + 1;
    int status = ATTNX_OK;
#pragma omp parallel num_threads(attnx_omp_threads(threads))
    {
        REAL *mem = malloc(per_thread * sizeof(REAL));
        WS w = SFX(ws_for)(a, C);
        if (!mem) {
#pragma omp atomic write
            status = ATTNX_ENOMEM;
        } else {
            SFX(ws_carve)(&w, mem, 0);
        }
#pragma omp for schedule(dynamic, 1)
        for (ptrdiff_t h = 0; h < a->heads; h++) {
            int current;
#pragma omp atomic read
            current = status;
            if (current != ATTNX_OK || !mem) continue;
            REAL *S = SFX(start_state)(&w, h);
            const REAL *v = (const REAL *)SFX(head)(a, a->v, h, ATTNX_DR_V);
            REAL *out = (REAL *)SFX(head)(a, a->out, h, ATTNX_DR_OUT);
            for (ptrdiff_t t0 = 0; t0 < a->n; t0 += C) {
                ptrdiff_t L = ATTNX_MIN(C, a->n - t0);
                SFX(load_rows)(&w, h, t0, L);
                SFX(prefetch_chunk)(&w, h, t0 + C);
                SFX(chunk_fwd)(&w, L, S, v + t0 * a->v_row, a->v_row, out + t0 * a->out_row,
                               a->out_row, NULL);
            }
            if (SFX(stopped)(a)) {
#pragma omp atomic write
                status = ATTNX_EINTR;
            }
        }
        free(mem);
    }
    return status;
}

/* ================================================================ backward */

/* R1 += W1 (Kn . e^{G_t - G_s}) rows t, R2 += W2 (same), C1 += W1^T (Kn . e^{..})
 * + W2^T (Q . e^{..}) columns s: the gradients through M (weights W1 = dM,
 * strictly lower) and P (W2 = dP, lower) to the rows and columns' vectors. */
static ATTNX_HOT void SFX(gated_products_bwd)(WS *w, ptrdiff_t L, REAL *W1, REAL *W2)
{
    const ptrdiff_t C = w->C, K = w->K;
    memset(w->R1, 0, (size_t)(L * K) * sizeof(REAL));
    memset(w->R2, 0, (size_t)(L * K) * sizeof(REAL));
    memset(w->C1, 0, (size_t)(L * K) * sizeof(REAL));
    if (!w->channel) {
        SFX(scalar_decays)(w, L);
        for (ptrdiff_t t = 0; t < L; t++)
            for (ptrdiff_t s = 0; s < L; s++) {
                W1[t * C + s] *= w->E[t * C + s];
                W2[t * C + s] *= w->E[t * C + s];
            }
        SFX(triangle_product)(w, TRI_LEFT, L, K, L, 1, W1, C, w->Kn, K, 0, w->R1, K);
        SFX(triangle_product)(w, TRI_LEFT, L, K, L, 1, W2, C, w->Kn, K, 0, w->R2, K);
        SFX(triangle_product)(w, TRI_LEFT_T, L, K, L, 1, W1, C, w->Kn, K, 0, w->C1, K);
        SFX(triangle_product)(w, TRI_LEFT_T, L, K, L, 1, W2, C, w->Q, K, 1, w->C1, K);
        return;
    }
    for (ptrdiff_t tb = 0; tb < L; tb += SUB) {
        ptrdiff_t te = ATTNX_MIN(tb + SUB, L), rows = te - tb;
        if (tb > 0) {  /* rows of this sub-block, columns before it: split at r = tb */
            const REAL *G_r = w->G + tb * K;
            SFX(decay_rows)(w, tb, w->Kn, NULL, w->G, G_r, -1, w->ys, NULL);
            SFX(product)(w, 0, 0, rows, K, tb, 1, W1 + tb * C, C, w->ys, K, 0, w->xs, K);
            SFX(product)(w, 0, 0, rows, K, tb, 1, W2 + tb * C, C, w->ys, K, 0, w->xs2, K);
            for (ptrdiff_t t = tb; t < te; t++) {
                const REAL *G_t = w->G + t * K, *x1 = w->xs + (t - tb) * K, *x2 = w->xs2 + (t - tb) * K;
                REAL *r1 = w->R1 + t * K, *r2 = w->R2 + t * K;
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) {
                    REAL e = SFX(vexp)(G_t[c] - G_r[c]);
                    r1[c] += x1[c] * e;
                    r2[c] += x2[c] * e;
                }
            }
        }
        if (te < L) {  /* columns of this sub-block, rows after it: split at r = te - 1 */
            const REAL *G_r = w->G + (te - 1) * K;
            ptrdiff_t later = L - te;
            SFX(decay_rows)(w, later, w->Kn + te * K, NULL, w->G + te * K, G_r, 1, w->ys, NULL);
            SFX(product)(w, 1, 0, rows, K, later, 1, W1 + te * C + tb, C, w->ys, K, 0, w->xs, K);
            SFX(decay_rows)(w, later, w->Q + te * K, NULL, w->G + te * K, G_r, 1, w->ys, NULL);
            SFX(product)(w, 1, 0, rows, K, later, 1, W2 + te * C + tb, C, w->ys, K, 1, w->xs, K);
            for (ptrdiff_t s = tb; s < te; s++) {
                const REAL *G_s = w->G + s * K, *x = w->xs + (s - tb) * K;
                REAL *c1 = w->C1 + s * K;
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) c1[c] += x[c] * SFX(vexp)(G_r[c] - G_s[c]);
            }
        }
        /* the sub-block itself, exactly: for each column s, run = e^{G_t - G_s}
         * down the rows t >= s (row_decays) */
        REAL *decay = w->xs, *run = w->xs2;
        SFX(row_decays)(w, tb, rows, decay);
        for (ptrdiff_t s = tb; s < te; s++) {
            const REAL *k_s = w->Kn + s * K;
            REAL *c1 = w->C1 + s * K;
            for (ptrdiff_t c = 0; c < K; c++) run[c] = 1;
            for (ptrdiff_t t = s; t < te; t++) {
                const REAL *k_t = w->Kn + t * K, *q_t = w->Q + t * K;
                REAL *r1 = w->R1 + t * K, *r2 = w->R2 + t * K;
                REAL w1 = s < t ? W1[t * C + s] : 0, w2 = W2[t * C + s];
                if (t > s) SFX(scale_by)(run, decay + (t - tb - 1) * K, K);
#pragma omp simd
                for (ptrdiff_t c = 0; c < K; c++) {
                    r1[c] += w1 * run[c] * k_s[c];
                    r2[c] += w2 * run[c] * k_s[c];
                    c1[c] += run[c] * (w1 * k_t[c] + w2 * q_t[c]);
                }
            }
        }
    }
}

/* dx of x (normalised by inv, times f) from dy, the gradient of y = f inv x:
 * dx = f (inv dy - inv^3 (x . dy) x); without the norm dx = f dy. */
static inline __attribute__((always_inline)) void SFX(norm_bwd)(const WS *w, const REAL *x, REAL inv, REAL f, const REAL *dy,
                          REAL *dx)
{
    const ptrdiff_t K = w->K;
    if (!w->a->l2norm) {
#pragma omp simd
        for (ptrdiff_t c = 0; c < K; c++) dx[c] = f * dy[c];
        return;
    }
    REAL dot = 0;
#pragma omp simd reduction(+ : dot)
    for (ptrdiff_t c = 0; c < K; c++) dot += x[c] * dy[c];
    REAL cross = inv * inv * inv * dot;
#pragma omp simd
    for (ptrdiff_t c = 0; c < K; c++) dx[c] = f * (inv * dy[c] - cross * x[c]);
}

/* One chunk backward: dS (K, V) holds the gradient at the chunk's end state
 * and leaves with the one at its start state. */
static ATTNX_HOT void SFX(chunk_bwd)(WS *w, ptrdiff_t h, ptrdiff_t t0, ptrdiff_t L, const REAL *keep)
{
    const attnx_delta_args *a = w->a;
    const ptrdiff_t C = w->C, K = w->K, V = w->V;
    const REAL *S0 = keep, *M = keep + K * V, *P = keep + K * V + C * C;
    const REAL *U = keep + K * V + 2 * C * C, *Vn = U + C * V;
    const REAL *dO = (const REAL *)SFX(head)(a, a->dout, h, ATTNX_DR_DOUT) + t0 * a->dout_row;
    const ptrdiff_t ldo = a->dout_row;
    const REAL *Gend = SFX(G_row)(w, L - 1);
    REAL *dS = w->dS, *dSn = w->dSn;
    SFX(decay_rows)(w, L, w->Kn, w->Q, w->G, NULL, 1, w->Kg, w->Qg);
    SFX(decay_rows)(w, L, w->Kn, NULL, w->G, Gend, -1, w->Kd, NULL);
    for (ptrdiff_t t = 0; t < L; t++)
        for (ptrdiff_t s = 0; s < t; s++) w->Lm[t * C + s] = w->beta[t] * M[t * C + s];
    memset(w->dG, 0, (size_t)(L * K) * sizeof(REAL));

    /* O = Qg S0 + P U:  dQg = dO S0^T,  dP = dO U^T (lower),  dU = P^T dO */
    SFX(product)(w, 0, 1, L, K, V, 1, dO, ldo, S0, V, 0, w->dQg, K);
    SFX(triangle_product)(w, TRI_RESULT, L, L, V, 1, dO, ldo, U, V, 0, w->dP, C);
    for (ptrdiff_t t = 0; t < L; t++)
        for (ptrdiff_t s = t + 1; s < L; s++) w->dP[t * C + s] = 0;
    SFX(triangle_product)(w, TRI_LEFT_T, L, V, L, 1, P, C, dO, ldo, 0, w->dU, V);
    /* S1 = e^{Gend} . S0 + Kd^T U:  dU += Kd dS,  dKd = U dS^T,
     * dGend += e^{Gend} . rowsums(dS . S0),  dS0 = e^{Gend} . dS + Qg^T dO */
    SFX(product)(w, 0, 0, L, V, K, 1, w->Kd, K, dS, V, 1, w->dU, V);
    SFX(product)(w, 0, 1, L, K, V, 1, U, V, dS, V, 0, w->dKd, K);
    REAL *dG_end = w->dG + (L - 1) * K;
    for (ptrdiff_t c = 0; c < K; c++) {
        REAL f = SFX(vexp)(w->channel ? Gend[c] : Gend[0]), dot = 0;
        const REAL *dS_c = dS + c * V, *S0_c = S0 + c * V;
        REAL *dSn_c = dSn + c * V;
#pragma omp simd reduction(+ : dot)
        for (ptrdiff_t j = 0; j < V; j++) {
            dot += dS_c[j] * S0_c[j];
            dSn_c[j] = f * dS_c[j];
        }
        dG_end[c] += f * dot;
    }
    SFX(product)(w, 1, 0, K, V, L, 1, w->Qg, K, dO, ldo, 1, dSn, V);
    /* (I + diag(beta) M) U = R:  dR = (I + ..)^{-T} dU,  dA = -dR U^T (strictly lower);
     * R = diag(beta) Vn, Vn = V - Kg S0 */
    SFX(unit_lower_solve)(w, 1, L, V, w->Lm, C, w->dU);
    REAL *dR = w->dU;
    SFX(triangle_product)(w, TRI_RESULT, L, L, V, -1, dR, V, U, V, 0, w->dA, C);
    char *dbeta = (char *)SFX(head)(a, a->dbeta, h, ATTNX_DR_DBETA);
    REAL *dv = (REAL *)SFX(head)(a, a->dv_, h, ATTNX_DR_DV) + t0 * V;
    for (ptrdiff_t t = 0; t < L; t++) {
        REAL db = 0, b = w->beta[t], *dA_t = w->dA + t * C;
        const REAL *M_t = M + t * C, *dR_t = dR + t * V, *Vn_t = Vn + t * V;
        for (ptrdiff_t s = 0; s < t; s++) {
            db += dA_t[s] * M_t[s];
            dA_t[s] *= b;  /* now dM */
        }
        for (ptrdiff_t s = t; s < L; s++) dA_t[s] = 0;
        REAL *dv_t = dv + t * V, *dVn_t = w->Vn + t * V;  /* dVn = beta dR, in the Vn scratch */
#pragma omp simd reduction(+ : db)
        for (ptrdiff_t j = 0; j < V; j++) db += dR_t[j] * Vn_t[j];
#pragma omp simd
        for (ptrdiff_t j = 0; j < V; j++) {
            dv_t[j] = b * dR_t[j];
            dVn_t[j] = b * dR_t[j];
        }
        ((REAL *)dbeta)[t0 + t] = db;
    }
    /* Vn = V - Kg S0:  dKg = -dVn S0^T,  dS0 -= Kg^T dVn */
    SFX(product)(w, 0, 1, L, K, V, -1, w->Vn, V, S0, V, 0, w->dKg, K);
    SFX(product)(w, 1, 0, K, V, L, -1, w->Kg, K, w->Vn, V, 1, dSn, V);
    /* through M and P to Kn, Q and G */
    SFX(gated_products_bwd)(w, L, w->dA, w->dP);

    /* assemble per row: dQ, dKn and dG (per channel) */
    REAL *dq = (REAL *)SFX(head)(a, a->dq, h, ATTNX_DR_DQ) + t0 * K;
    REAL *dk = (REAL *)SFX(head)(a, a->dk_, h, ATTNX_DR_DK) + t0 * K;
    const char *q = SFX(head)(a, a->q, h, ATTNX_DR_Q), *k = SFX(head)(a, a->k, h, ATTNX_DR_K);
    for (ptrdiff_t t = 0; t < L; t++) {
        const REAL *Kn_t = w->Kn + t * K, *Q_t = w->Q + t * K, *Kg_t = w->Kg + t * K;
        const REAL *Qg_t = w->Qg + t * K, *Kd_t = w->Kd + t * K;
        REAL *R1_t = w->R1 + t * K, *R2_t = w->R2 + t * K, *C1_t = w->C1 + t * K;
        const REAL *dQg_t = w->dQg + t * K, *dKg_t = w->dKg + t * K, *dKd_t = w->dKd + t * K;
        REAL *dG_t = w->dG + t * K;
        const REAL *G_t = SFX(G_row)(w, t);
        /* the row's decays: per channel, or one number (then no exp per channel) */
        REAL *eg = w->xs, *ed = w->xs2;
        if (w->channel) {
#pragma omp simd
            for (ptrdiff_t c = 0; c < K; c++) {
                eg[c] = SFX(vexp)(G_t[c]);
                ed[c] = SFX(vexp)(Gend[c] - G_t[c]);
            }
        } else {
            REAL eg0 = SFX(vexp)(G_t[0]), ed0 = SFX(vexp)(Gend[0] - G_t[0]);
            for (ptrdiff_t c = 0; c < K; c++) eg[c] = eg0, ed[c] = ed0;
        }
#pragma omp simd
        for (ptrdiff_t c = 0; c < K; c++) {
            REAL kd = dKd_t[c] * Kd_t[c];
            dG_t[c] += Kn_t[c] * (R1_t[c] - C1_t[c]) + Q_t[c] * R2_t[c] + dKg_t[c] * Kg_t[c] +
                       dQg_t[c] * Qg_t[c] - kd;
            dG_end[c] += kd;
            R2_t[c] += dQg_t[c] * eg[c];                               /* dQ */
            R1_t[c] += C1_t[c] + dKg_t[c] * eg[c] + dKd_t[c] * ed[c];  /* dKn */
        }
        SFX(norm_bwd)(w, (const REAL *)q + (t0 + t) * a->q_row, w->inv_q[t],
                      (REAL)a->scale, R2_t, dq + t * K);
        SFX(norm_bwd)(w, (const REAL *)k + (t0 + t) * a->k_row, w->inv_k[t], 1, R1_t,
                      dk + t * K);
    }
    /* g_t enters G_t, ..., G_{L-1}: dg_t = sum over t' >= t of dG_t' */
    if (a->gate != ATTNX_GATE_NONE) {
        REAL *dg = (REAL *)SFX(head)(a, a->dg, h, ATTNX_DR_DG);
        if (w->channel) {
            REAL *dg_rows = dg + t0 * K;
            for (ptrdiff_t c = 0; c < K; c++) dg_rows[(L - 1) * K + c] = w->dG[(L - 1) * K + c];
            for (ptrdiff_t t = L - 2; t >= 0; t--)
                for (ptrdiff_t c = 0; c < K; c++)
                    dg_rows[t * K + c] = dg_rows[(t + 1) * K + c] + w->dG[t * K + c];
        } else {
            REAL run = 0;
            for (ptrdiff_t t = L - 1; t >= 0; t--) {
                for (ptrdiff_t c = 0; c < K; c++) run += w->dG[t * K + c];
                dg[t0 + t] = run;
            }
        }
    }
    memcpy(dS, dSn, (size_t)(K * V) * sizeof(REAL));
}

int TYPED(attnx_delta_bwd_f32, attnx_delta_bwd_f64)(const attnx_delta_args *a)
{
    if (a->heads == 0) return ATTNX_OK;
    const ptrdiff_t K = a->dk, V = a->dv;
    const ptrdiff_t C = ATTNX_MAX(1, ATTNX_MIN(a->chunk, ATTNX_MAX(a->n, 1)));
    const int threads = SFX(plan_threads)(a);
    const size_t per_thread = SFX(ws_size)(C, K, V, a->n, 1);
    const ptrdiff_t keep_size = SFX(chunk_keep_size)(C, K, V);
    int status = ATTNX_OK;
#pragma omp parallel num_threads(attnx_omp_threads(threads))
    {
        REAL *mem = malloc((per_thread + 1) * sizeof(REAL));
        WS w = SFX(ws_for)(a, C);
        if (!mem) {
#pragma omp atomic write
            status = ATTNX_ENOMEM;
        } else {
            SFX(ws_carve)(&w, mem, 1);
        }
#pragma omp for schedule(dynamic, 1)
        for (ptrdiff_t h = 0; h < a->heads; h++) {
            int current;
#pragma omp atomic read
            current = status;
            if (current != ATTNX_OK || !mem) continue;
            /* pass 1: the chunks forward, each one's S0, M, P, U, Vn kept */
            REAL *S = w.S;
            const REAL *S0 = (const REAL *)SFX(head)(a, a->S0, h, ATTNX_DR_S0);
            for (ptrdiff_t c = 0; c < K; c++) {
                if (S0)
                    memcpy(S + c * V, S0 + c * a->S0_row, (size_t)V * sizeof(REAL));
                else
                    memset(S + c * V, 0, (size_t)V * sizeof(REAL));
            }
            const REAL *v = (const REAL *)SFX(head)(a, a->v, h, ATTNX_DR_V);
            for (ptrdiff_t t0 = 0, i = 0; t0 < a->n; t0 += C, i++) {
                ptrdiff_t L = ATTNX_MIN(C, a->n - t0);
                SFX(load_rows)(&w, h, t0, L);
                SFX(prefetch_chunk)(&w, h, t0 + C);
                SFX(chunk_fwd)(&w, L, S, v + t0 * a->v_row, a->v_row, NULL, 0, w.keep + i * keep_size);
            }
            /* pass 2: the chunks in reverse, dS carried */
            const REAL *dS1 = (const REAL *)SFX(head)(a, a->dS1, h, ATTNX_DR_DS1);
            for (ptrdiff_t c = 0; c < K; c++) {
                if (dS1)
                    memcpy(w.dS + c * V, dS1 + c * a->dS1_row, (size_t)V * sizeof(REAL));
                else
                    memset(w.dS + c * V, 0, (size_t)V * sizeof(REAL));
            }
            ptrdiff_t chunks = (a->n + C - 1) / C;
            for (ptrdiff_t i = chunks - 1; i >= 0; i--) {
                ptrdiff_t t0 = i * C, L = ATTNX_MIN(C, a->n - t0);
                SFX(load_rows)(&w, h, t0, L);
                SFX(prefetch_chunk)(&w, h, t0 - C);
                SFX(chunk_bwd)(&w, h, t0, L, w.keep + i * keep_size);
            }
            REAL *dS0 = (REAL *)SFX(head)(a, a->dS0, h, ATTNX_DR_DS0);
            if (dS0) memcpy(dS0, w.dS, (size_t)(K * V) * sizeof(REAL));
            if (SFX(stopped)(a)) {
#pragma omp atomic write
                status = ATTNX_EINTR;
            }
        }
        free(mem);
    }
    return status;
}

/* ============================================== the layers' causal conv1d */

/* One channel after another: a decoding step reads each channel's W state
 * values and weights once (a few hundred KiB for a whole layer), far less
 * than the overhead of a general convolution call around the same
 * arithmetic (docs/performance.md); then the activation over the whole
 * output, vectorised. */
ATTNX_HOT void TYPED(attnx_conv1d_update_f32, attnx_conv1d_update_f64)(
    ptrdiff_t B, ptrdiff_t D, ptrdiff_t L, ptrdiff_t W, const REAL *x, const ptrdiff_t x_stride[3],
    REAL *state, const REAL *weight, const REAL *bias, int silu, REAL *out)
{
    for (ptrdiff_t b = 0; b < B; b++)
        for (ptrdiff_t c = 0; c < D; c++) {
            REAL *window = state + (b * D + c) * W;
            const REAL *w = weight + c * W, *x_c = x + b * x_stride[0] + c * x_stride[1];
            REAL *o = out + (b * D + c) * L;
            for (ptrdiff_t t = 0; t < L; t++) {
                REAL sum = bias ? bias[c] : 0;
                for (ptrdiff_t j = 0; j + 1 < W; j++) {
                    window[j] = window[j + 1];
                    sum += w[j] * window[j];
                }
                if (W > 0) {
                    window[W - 1] = x_c[t * x_stride[2]];
                    sum += w[W - 1] * window[W - 1];
                }
                o[t] = sum;
            }
        }
    if (!silu) return;
    const ptrdiff_t size = B * D * L;
#pragma omp simd
    for (ptrdiff_t i = 0; i < size; i++) out[i] = out[i] / (1 + SFX(vexp)(-out[i]));
}

#undef TRSM
#undef WS
#endif /* REAL */
