/* features.c - the feature maps of kernelised attention: phi (queries) and
 * psi (keys), non-negative features of size r from rows of size d.
 *
 * Every map works on a block of rows at once (one GEMM for FAVOR+) into a
 * contiguous (rows, r) scratch, so the kernel calls it once per chunk.
 * Maps that exponentiate keep their exponents <= 0 (stabilisers) and report
 * what they removed, so nothing overflows and the kernel can put the
 * removed factors back where they matter (the eps clamp).
 *
 * NaN inputs give NaN features (comparisons are written so that NaN is
 * kept, not replaced by 0), so they reach the affected output rows only.
 */
#ifndef REAL
#include <math.h>

#include "attnx.h"
#include "blas.h"
#include "dispatch.h"
#include "microkernel.h" /* mk_elu_row_w16 */

#define ATTNX_FAMILY_FILE "features.c"
#include "real.h"

#else /* REAL: the body, compiled once per type */

/* max(x, 0) that keeps NaN */
static inline REAL SFX(relu)(REAL x) { return x < 0 ? 0 : x; }

/* max_c |x_c| over a row, NaN if any entry is NaN: the scale that keeps
 * the squares of the normalising maps (taylor, focused) finite. */
static ATTNX_HOT REAL SFX(max_abs)(const REAL *x, ptrdiff_t d)
{
    REAL top = 0;
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL a = fabs(x[c]);
        top = (a > top || a != a) ? a : top;
    }
    return top;
}

/* sum_c (x_c / scale)^2, divided so that the largest entry gives exactly 1 */
static ATTNX_HOT REAL SFX(sum_squares)(const REAL *x, ptrdiff_t d, REAL scale)
{
    REAL sum = 0;
#pragma omp simd reduction(+ : sum)
    for (ptrdiff_t c = 0; c < d; c++) sum += (x[c] / scale) * (x[c] / scale);
    return sum;
}

/* y += alpha x */
static ATTNX_HOT void SFX(axpy_row)(REAL *y, REAL alpha, const REAL *x, ptrdiff_t count)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < count; c++) y[c] += alpha * x[c];
}

/* elu(x) + 1: x + 1 above 0, exp(x) below (Katharopoulos et al. 2020).
 * The exponential is only kept where x <= 0, so it skips vexp's guard
 * against overflow: 27 AVX-512 instructions a vector against 37 (elu took
 * a fifth of a causal float32 chunk call). */
static ATTNX_HOT void SFX(elu_row)(const REAL *x, ptrdiff_t d, REAL *f)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) f[c] = x[c] > 0 ? x[c] + 1 : SFX(vexp_nonpositive)(x[c]);
}

static ATTNX_HOT void SFX(relu_row)(const REAL *x, ptrdiff_t d, REAL *f)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) f[c] = SFX(relu)(x[c]);
}

/* softmax over the features: exp(x - max) / sum, never overflows */
static ATTNX_HOT void SFX(softmax_row)(const REAL *x, ptrdiff_t d, REAL *f)
{
    REAL top = -(REAL)INFINITY;
    for (ptrdiff_t c = 0; c < d; c++) top = x[c] > top ? x[c] : top;
    SFX(exp_normalise)(x, d, top, f);
}

/* [1, x / |x|] (Su: 1 + cos(q, k) is the first-order Taylor expansion of
 * exp(cos)); a zero vector gives [1, 0...] */
static void SFX(taylor_row)(const REAL *x, ptrdiff_t d, REAL *f)
{
    REAL top = SFX(max_abs)(x, d);
    f[0] = 1;
    if (top == 0) {
        for (ptrdiff_t c = 0; c < d; c++) f[c + 1] = 0;
        return;
    }
    /* divided, not multiplied by 1 / norm: x / |x| is then exactly +-1 when
     * d == 1, so 1 + cos(q, k) is exactly 0 for opposite signs */
    REAL norm = top * sqrt(SFX(sum_squares)(x, d, top));
    for (ptrdiff_t c = 0; c < d; c++) f[c + 1] = x[c] / norm;
}

/* FLatten's focusing function f_p(y) = |y| * y**p / |y**p| of y = relu(x):
 * the direction sharpened by the power, the norm kept. The ratio is
 * invariant to scaling y, so y is divided by its max first: the power
 * cannot overflow and |y**p| >= 1. A zero vector gives 0. */
static void SFX(focused_row)(const REAL *x, ptrdiff_t d, double power, REAL *f)
{
    SFX(relu_row)(x, d, f);
    REAL top = SFX(max_abs)(f, d);
    if (top == 0) return;  /* f is already the zero vector */
    REAL norm_y = top * sqrt(SFX(sum_squares)(f, d, top));
    int cube = power == 3;  /* the default, without pow() */
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL u = f[c] / top;
        f[c] = cube ? u * u * u : (REAL)pow(u, power);
    }
    REAL scale = norm_y / sqrt(SFX(sum_squares)(f, d, 1));
    for (ptrdiff_t c = 0; c < d; c++) f[c] *= scale;
}

/* cosFormer: relu(x) re-weighted by sin and cos of theta_t = pi/2 * t / M,
 * t the 1-based position, so that phi(q_i).psi(k_j) =
 * relu(q_i).relu(k_j) cos(theta_i - theta_j) */
static void SFX(cosformer_row)(const REAL *x, ptrdiff_t d, ptrdiff_t position, double period,
                               REAL *f)
{
    double theta = M_PI / 2 * (double)(position + 1) / period;
    REAL s = (REAL)sin(theta), co = (REAL)cos(theta);
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL y = SFX(relu)(x[c]);
        f[c] = y * s;
        f[d + c] = y * co;
    }
}

/* efficient attention keys: exp(x - col_shift), col_shift the column max
 * over the visible keys; normalised over the keys by the kernel */
static ATTNX_HOT void SFX(column_exp_row)(const REAL *x, ptrdiff_t d, const REAL *col_shift,
                                          REAL *f)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) f[c] = SFX(vexp)(x[c] - col_shift[c]);
}

/* FAVOR+ (Choromanski et al. 2021), for a block of rows:
 *   u_f = w_f . x~ - |x~|^2 / 2,  x~ = d**-0.25 x,  phi_f = r**-0.5 exp(u_f - shift)
 * with shift the row's max for queries (returned in log_scale) and the
 * data-independent bound key_log_scale for keys, so exp never overflows
 * and a key's features do not depend on the other keys. */
static ATTNX_HOT void SFX(favor_exp_row)(REAL *u, ptrdiff_t r, REAL half_sq, REAL shift, REAL scale)
{
#pragma omp simd
    for (ptrdiff_t f = 0; f < r; f++) u[f] = scale * SFX(vexp)(u[f] - half_sq - shift);
}

static void SFX(favor_block)(const attnx_feature_map *fm, int is_key, const REAL *x,
                             ptrdiff_t x_row, ptrdiff_t rows, double key_log_scale, REAL *feat,
                             REAL *log_scale)
{
    const ptrdiff_t d = fm->d, r = fm->r;
    const REAL x_scale = (REAL)pow((double)d, -0.25), feat_scale = (REAL)(1 / sqrt((double)r));
    /* feat = x~ W^T, (rows, r) */
    SFX(gemm)(0, 1, rows, r, d, x_scale, x, x_row, (const REAL *)fm->projection, d, 0, feat, r);
    for (ptrdiff_t t = 0; t < rows; t++) {
        REAL *u = feat + t * r;
        REAL half_sq = SFX(sum_squares)(x + t * x_row, d, 1 / x_scale) / 2;
        REAL shift = (REAL)key_log_scale;
        if (!is_key) {
            shift = -(REAL)INFINITY;
            for (ptrdiff_t f = 0; f < r; f++) shift = u[f] > shift ? u[f] : shift;
            shift -= half_sq;
            /* |x~|^2 overflowed (every u_f is -inf): zero features, not NaN */
            if (shift == -(REAL)INFINITY) shift = 0;
            log_scale[t] = shift;
        }
        SFX(favor_exp_row)(u, r, half_sq, shift, feat_scale);
    }
}

void TYPED(attnx_features_f32, attnx_features_f64)(
    const attnx_feature_map *fm, int is_key, const REAL *x, ptrdiff_t x_row, ptrdiff_t rows,
    ptrdiff_t pos0, double key_log_scale, const REAL *col_shift, REAL *feat, REAL *log_scale)
{
    const ptrdiff_t d = fm->d, r = fm->r;
    if (!is_key)
        for (ptrdiff_t t = 0; t < rows; t++) log_scale[t] = 0;
    if (fm->kind == ATTNX_FM_FAVOR) {
        SFX(favor_block)(fm, is_key, x, x_row, rows, key_log_scale, feat, log_scale);
        return;
    }
#if !REAL_IS_DOUBLE && defined(MK_HAVE_X86)
    /* fewer instructions (mk_decode.h; elu took a tenth of a causal
     * forward + backward: docs/performance.md, the C code's choices) */
    if (fm->kind == ATTNX_FM_ELU && attnx_kernels(ATTNX_FAMILY_LINEAR_FWD) == ATTNX_KERNELS_AVX512) {
        for (ptrdiff_t t = 0; t < rows; t++) mk_elu_row_w16(x + t * x_row, d, feat + t * r);
        return;
    }
#endif
    for (ptrdiff_t t = 0; t < rows; t++) {
        const REAL *x_t = x + t * x_row;
        REAL *f_t = feat + t * r;
        switch (fm->kind) {
        case ATTNX_FM_ELU: SFX(elu_row)(x_t, d, f_t); break;
        case ATTNX_FM_RELU: SFX(relu_row)(x_t, d, f_t); break;
        case ATTNX_FM_TAYLOR: SFX(taylor_row)(x_t, d, f_t); break;
        case ATTNX_FM_FOCUSED: SFX(focused_row)(x_t, d, fm->power, f_t); break;
        case ATTNX_FM_IDENTITY: memcpy(f_t, x_t, (size_t)d * sizeof(REAL)); break;
        case ATTNX_FM_COSFORMER:
            SFX(cosformer_row)(x_t, d, fm->first_position + pos0 + t, fm->period, f_t);
            break;
        case ATTNX_FM_EFFICIENT:
            if (is_key) SFX(column_exp_row)(x_t, d, col_shift, f_t);
            else SFX(softmax_row)(x_t, d, f_t);
            break;
        case ATTNX_FM_SOFTMAX: SFX(softmax_row)(x_t, d, f_t); break;
        }
    }
}

/* ---------------------------------------------------------------- derivatives
 *
 * Each map's backward: given the rows x, the features feat the forward
 * computed from them (stabilised, as attnx_features leaves them) and the
 * gradient dfeat of a loss with respect to those features, the gradient
 * dx. A forward line is quoted above the derivative that inverts it. */

/* elu(x) + 1: d/dx = 1 above 0, exp(x) = the feature itself below */
static ATTNX_HOT void SFX(elu_row_bwd)(const REAL *x, const REAL *f, const REAL *df, ptrdiff_t d,
                                       REAL *dx)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) dx[c] = df[c] * (x[c] > 0 ? 1 : f[c]);
}

static ATTNX_HOT void SFX(relu_row_bwd)(const REAL *x, const REAL *df, ptrdiff_t d, REAL *dx)
{
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) dx[c] = x[c] > 0 ? df[c] : 0;
}

/* f = softmax(x): dx = f * (df - f . df) */
static ATTNX_HOT void SFX(softmax_row_bwd)(const REAL *f, const REAL *df, ptrdiff_t d, REAL *dx)
{
    REAL mean = 0;
#pragma omp simd reduction(+ : mean)
    for (ptrdiff_t c = 0; c < d; c++) mean += f[c] * df[c];
#pragma omp simd
    for (ptrdiff_t c = 0; c < d; c++) dx[c] = f[c] * (df[c] - mean);
}

/* f = [1, u], u = x / |x|: dx = (du - (u . du) u) / |x|; the zero vector
 * (f = [1, 0...]) has no direction to turn and gets 0 */
static void SFX(taylor_row_bwd)(const REAL *x, const REAL *f, const REAL *df, ptrdiff_t d, REAL *dx)
{
    const REAL *u = f + 1, *du = df + 1;
    REAL top = SFX(max_abs)(x, d);
    if (top == 0) {
        for (ptrdiff_t c = 0; c < d; c++) dx[c] = 0;
        return;
    }
    REAL norm = top * sqrt(SFX(sum_squares)(x, d, top)), along = 0;
    for (ptrdiff_t c = 0; c < d; c++) along += u[c] * du[c];
    for (ptrdiff_t c = 0; c < d; c++) dx[c] = (du[c] - along * u[c]) / norm;
}

/* f = |y| w / |w|, w = y**p, y = relu(x). With s = w / |w| and g = df:
 *   dy = (y / |y|) (g . s) + p y**(p-1) |y| / |w| (g - (g . s) s),
 * invariant to scaling y, so computed on u = y / max(y) like the forward
 * (and from x alone: feat may be a masked key's zero row). Entries with
 * y = 0 get 0 (relu's derivative; y**(p-1) may be inf). */
static void SFX(focused_row_bwd)(const REAL *x, const REAL *df, ptrdiff_t d, double power, REAL *dx)
{
    REAL top = 0;
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL y = SFX(relu)(x[c]);
        top = (y > top || y != y) ? y : top;
    }
    if (top == 0) {
        for (ptrdiff_t c = 0; c < d; c++) dx[c] = 0;
        return;
    }
    /* |u|, |u**p|, and g . s */
    REAL norm_u = 0, norm_w = 0, along = 0;
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL u = SFX(relu)(x[c]) / top, w = (REAL)pow(u, power);
        norm_u += u * u;
        norm_w += w * w;
        along += df[c] * w;
    }
    norm_u = sqrt(norm_u), norm_w = sqrt(norm_w);
    along /= norm_w;
    for (ptrdiff_t c = 0; c < d; c++) {
        REAL u = SFX(relu)(x[c]) / top;
        if (!(x[c] > 0)) {
            dx[c] = x[c] != x[c] ? x[c] : 0;
            continue;
        }
        REAL s = (REAL)pow(u, power) / norm_w;
        dx[c] = u / norm_u * along +
                (REAL)(power * pow(u, power - 1)) * norm_u / norm_w * (df[c] - along * s);
    }
}

/* f = [y sin(theta_t), y cos(theta_t)], y = relu(x) */
static void SFX(cosformer_row_bwd)(const REAL *x, const REAL *df, ptrdiff_t d, ptrdiff_t position,
                                   double period, REAL *dx)
{
    double theta = M_PI / 2 * (double)(position + 1) / period;
    REAL s = (REAL)sin(theta), co = (REAL)cos(theta);
    for (ptrdiff_t c = 0; c < d; c++) dx[c] = x[c] > 0 ? df[c] * s + df[d + c] * co : 0;
}

/* FAVOR+: phi_f = r**-0.5 exp(w_f . x~ - |x~|^2 / 2 - shift), x~ = d**-0.25 x.
 * The stabiliser shift cancels in the attention (the kernel scales the
 * clamp with it), so it is a constant here, and with G_f = df_f phi_f:
 *   dx = d**-0.25 (G W - (sum_f G_f) x~),  dW += G^T x~.
 * dfeat is overwritten with G. */
static void SFX(favor_block_bwd)(const attnx_feature_map *fm, const REAL *x, ptrdiff_t x_row,
                                 ptrdiff_t rows, const REAL *feat, REAL *dfeat, REAL *dx,
                                 ptrdiff_t dx_row, REAL *dW)
{
    const ptrdiff_t d = fm->d, r = fm->r;
    const REAL x_scale = (REAL)pow((double)d, -0.25);
    const REAL *W = (const REAL *)fm->projection;
    for (ptrdiff_t t = 0; t < rows * r; t++) dfeat[t] *= feat[t];
    SFX(gemm)(0, 0, rows, d, r, x_scale, dfeat, r, W, d, 0, dx, dx_row);
    for (ptrdiff_t t = 0; t < rows; t++) {
        REAL total = 0;
        for (ptrdiff_t f = 0; f < r; f++) total += dfeat[t * r + f];
        SFX(axpy_row)(dx + t * dx_row, -x_scale * x_scale * total, x + t * x_row, d);
    }
    if (dW) SFX(gemm)(1, 0, r, d, rows, x_scale, dfeat, r, x, x_row, 1, dW, d);
}

void TYPED(attnx_features_bwd_f32, attnx_features_bwd_f64)(
    const attnx_feature_map *fm, int is_key, const REAL *x, ptrdiff_t x_row, ptrdiff_t rows,
    ptrdiff_t pos0, const REAL *feat, REAL *dfeat, const REAL *col_dot, REAL *dx, ptrdiff_t dx_row,
    REAL *dW)
{
    const ptrdiff_t d = fm->d, r = fm->r;
    if (fm->kind == ATTNX_FM_FAVOR) {
        SFX(favor_block_bwd)(fm, x, x_row, rows, feat, dfeat, dx, dx_row, dW);
        return;
    }
    for (ptrdiff_t t = 0; t < rows; t++) {
        const REAL *x_t = x + t * x_row, *f_t = feat + t * r, *df_t = dfeat + t * r;
        REAL *dx_t = dx + t * dx_row;
        switch (fm->kind) {
        case ATTNX_FM_ELU: SFX(elu_row_bwd)(x_t, f_t, df_t, d, dx_t); break;
        case ATTNX_FM_RELU: SFX(relu_row_bwd)(x_t, df_t, d, dx_t); break;
        case ATTNX_FM_TAYLOR: SFX(taylor_row_bwd)(x_t, f_t, df_t, d, dx_t); break;
        case ATTNX_FM_FOCUSED: SFX(focused_row_bwd)(x_t, df_t, d, fm->power, dx_t); break;
        case ATTNX_FM_IDENTITY: memcpy(dx_t, df_t, (size_t)d * sizeof(REAL)); break;
        case ATTNX_FM_COSFORMER:
            SFX(cosformer_row_bwd)(x_t, df_t, d, fm->first_position + pos0 + t, fm->period, dx_t);
            break;
        case ATTNX_FM_EFFICIENT:
            /* keys: psi_jf = exp(x_jf) / sum_j' exp(x_j'f), a softmax down
             * each column, dx_jf = psi_jf (df_jf - sum_j' psi_j'f df_j'f);
             * the column sums come in col_dot */
            if (is_key)
                for (ptrdiff_t c = 0; c < d; c++) dx_t[c] = f_t[c] * (df_t[c] - col_dot[c]);
            else SFX(softmax_row_bwd)(f_t, df_t, d, dx_t);
            break;
        case ATTNX_FM_SOFTMAX: SFX(softmax_row_bwd)(f_t, df_t, d, dx_t); break;
        }
    }
}

double TYPED(attnx_key_log_scale_f32, attnx_key_log_scale_f64)(const attnx_feature_map *fm)
{
    if (fm->kind != ATTNX_FM_FAVOR) return 0;
    const REAL *W = (const REAL *)fm->projection;
    double top = 0;
    for (ptrdiff_t f = 0; f < fm->r; f++) {
        double sq = SFX(sum_squares)(W + f * fm->d, fm->d, 1);
        top = sq > top ? sq : top;
    }
    return top / 2;
}

void TYPED(attnx_key_column_max_f32, attnx_key_column_max_f64)(
    const REAL *x, ptrdiff_t x_row, ptrdiff_t rows, ptrdiff_t d, const unsigned char *key_mask,
    ptrdiff_t key_mask_col, REAL *col_max)
{
    for (ptrdiff_t c = 0; c < d; c++) col_max[c] = -(REAL)INFINITY;
    for (ptrdiff_t j = 0; j < rows; j++) {
        if (key_mask && !key_mask[j * key_mask_col]) continue;
        const REAL *x_j = x + j * x_row;
        for (ptrdiff_t c = 0; c < d; c++)
            col_max[c] = (x_j[c] > col_max[c] || x_j[c] != x_j[c]) ? x_j[c] : col_max[c];
    }
    /* no visible key: any finite shift will do, the column is masked out */
    for (ptrdiff_t c = 0; c < d; c++)
        if (col_max[c] == -(REAL)INFINITY) col_max[c] = 0;
}

#endif /* REAL */
