/* kernel_check.c - the kernels called from C, without Python, against
 * plain double-precision loops written from the formulas (attnx.h):
 * softmax attention forward and backward, causal linear attention (elu + 1,
 * chunked: forward, and forward and backward through the fused chunk
 * kernels), the gated delta rule (chunked and token by token) and
 * Reformer's LSH attention (forward and hashing), each in
 * float32 and float64, on one and two threads, and the bfloat16
 * conversions bit for bit, at every kernel set the
 * dispatch table of this CPU and build can take (plain included).
 *
 * It is how a platform without a Python of its own here is tested: .ci/run
 * cross-compiles it for Windows with mingw-w64 and runs it under wine
 * (.ci/windows). Natively: .ci/windows --native. Exit status 0 when every
 * check passes; each failure is printed. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attnx.h"
#include "convert.h"
#include "cpu_features.h"
#include "dispatch.h"

static int failures = 0;

/* a fixed pseudo-random stream in [-1, 1): the same numbers on every platform */
static double next_uniform(unsigned long long *seed)
{
    *seed = *seed * 6364136223846793005ULL + 1442695040888963407ULL;
    return (double)(*seed >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static double *random_array(size_t count, unsigned long long seed)
{
    double *x = malloc(count * sizeof *x);
    for (size_t i = 0; i < count; i++) x[i] = next_uniform(&seed);
    return x;
}

/* a typed copy of x: float or double by is_double */
static void *typed(const double *x, size_t count, int is_double)
{
    void *out = malloc(count * (is_double ? sizeof(double) : sizeof(float)));
    for (size_t i = 0; i < count; i++) {
        if (is_double) ((double *)out)[i] = x[i];
        else ((float *)out)[i] = (float)x[i];
    }
    return out;
}

static double value_at(const void *x, size_t i, int is_double)
{
    return is_double ? ((const double *)x)[i] : (double)((const float *)x)[i];
}

/* max |got - want| / (1 + |want|) over count numbers, against tolerance */
static void compare(const char *what, const void *got, const double *want, size_t count,
                    int is_double, const char *context)
{
    double worst = 0, tolerance = is_double ? 1e-10 : 2e-4;
    for (size_t i = 0; i < count; i++) {
        double error = fabs(value_at(got, i, is_double) - want[i]) / (1 + fabs(want[i]));
        if (!(error <= worst)) worst = error;  /* NaN is the worst */
    }
    if (!(worst <= tolerance)) {
        printf("FAIL %s %s: relative error %.3g > %.3g\n", what, context, worst, tolerance);
        failures++;
    }
}

/* ------------------------------------------------------------------ softmax */

enum { SM_HEADS = 2, SM_N = 37, SM_M = 53, SM_D = 24, SM_E = 20 };

/* lower-right causal: query i sees keys j <= i + (m - n) */
static int sm_visible(ptrdiff_t i, ptrdiff_t j) { return j <= i + (SM_M - SM_N); }

/* P (n, m) and lse (n) of one head, from q, k */
static void sm_reference_weights(const double *q, const double *k, double scale, double *P,
                                 double *lse)
{
    for (int i = 0; i < SM_N; i++) {
        double row_max = -INFINITY, sum = 0;
        for (int j = 0; j < SM_M; j++) {
            double s = 0;
            for (int c = 0; c < SM_D; c++) s += q[i * SM_D + c] * k[j * SM_D + c];
            P[i * SM_M + j] = sm_visible(i, j) ? scale * s : -INFINITY;
            if (P[i * SM_M + j] > row_max) row_max = P[i * SM_M + j];
        }
        for (int j = 0; j < SM_M; j++) sum += exp(P[i * SM_M + j] - row_max);
        lse[i] = row_max + log(sum);
        for (int j = 0; j < SM_M; j++) P[i * SM_M + j] = exp(P[i * SM_M + j] - lse[i]);
    }
}

static void check_softmax(int is_double, int threads, const char *context)
{
    const size_t nq = SM_HEADS * SM_N * SM_D, nk = SM_HEADS * SM_M * SM_D;
    const size_t nv = SM_HEADS * SM_M * SM_E, no = SM_HEADS * SM_N * SM_E;
    const size_t size = is_double ? sizeof(double) : sizeof(float);
    const double scale = 1 / sqrt((double)SM_D);
    double *q = random_array(nq, 1), *k = random_array(nk, 2), *v = random_array(nv, 3);
    double *dout = random_array(no, 4);
    double *want_out = calloc(no, sizeof(double)), *want_lse = calloc(SM_HEADS * SM_N, sizeof(double));
    double *want_dq = calloc(nq, sizeof(double)), *want_dk = calloc(nk, sizeof(double));
    double *want_dv = calloc(nv, sizeof(double));
    double *P = malloc(SM_N * SM_M * sizeof(double)), *dS = malloc(SM_N * SM_M * sizeof(double));
    for (int h = 0; h < SM_HEADS; h++) {
        const double *qh = q + h * SM_N * SM_D, *kh = k + h * SM_M * SM_D, *vh = v + h * SM_M * SM_E;
        const double *doh = dout + h * SM_N * SM_E;
        double *oh = want_out + h * SM_N * SM_E;
        sm_reference_weights(qh, kh, scale, P, want_lse + h * SM_N);
        for (int i = 0; i < SM_N; i++)
            for (int j = 0; j < SM_M; j++)
                for (int c = 0; c < SM_E; c++) oh[i * SM_E + c] += P[i * SM_M + j] * vh[j * SM_E + c];
        /* dV = P^T dO, dP = dO V^T, dS = P (dP - D), D_i = dO_i . O_i */
        for (int i = 0; i < SM_N; i++) {
            double D = 0;
            for (int c = 0; c < SM_E; c++) D += doh[i * SM_E + c] * oh[i * SM_E + c];
            for (int j = 0; j < SM_M; j++) {
                double dP = 0;
                for (int c = 0; c < SM_E; c++) {
                    dP += doh[i * SM_E + c] * vh[j * SM_E + c];
                    want_dv[(h * SM_M + j) * SM_E + c] += P[i * SM_M + j] * doh[i * SM_E + c];
                }
                dS[i * SM_M + j] = P[i * SM_M + j] * (dP - D);
            }
        }
        for (int i = 0; i < SM_N; i++)
            for (int j = 0; j < SM_M; j++)
                for (int c = 0; c < SM_D; c++) {
                    want_dq[(h * SM_N + i) * SM_D + c] += scale * dS[i * SM_M + j] * kh[j * SM_D + c];
                    want_dk[(h * SM_M + j) * SM_D + c] += scale * dS[i * SM_M + j] * qh[i * SM_D + c];
                }
    }
    void *tq = typed(q, nq, is_double), *tk = typed(k, nk, is_double), *tv = typed(v, nv, is_double);
    void *tdout = typed(dout, no, is_double);
    void *out = calloc(no, size), *lse = calloc(SM_HEADS * SM_N, size);
    void *dq = calloc(nq, size), *dk = calloc(nk, size), *dv = calloc(nv, size);
    /* the forward's table has its own operands' columns, the backward's
     * those and the gradients' */
    ptrdiff_t offsets[SM_HEADS * ATTNX_SMB_NOPS] = {0}, fwd_offsets[SM_HEADS * ATTNX_SM_NOPS];
    for (int h = 0; h < SM_HEADS; h++) {
        ptrdiff_t *row = offsets + h * ATTNX_SMB_NOPS;
        row[ATTNX_SM_Q] = h * SM_N * SM_D * (ptrdiff_t)size;
        row[ATTNX_SM_K] = h * SM_M * SM_D * (ptrdiff_t)size;
        row[ATTNX_SM_V] = h * SM_M * SM_E * (ptrdiff_t)size;
        row[ATTNX_SM_OUT] = h * SM_N * SM_E * (ptrdiff_t)size;
        row[ATTNX_SM_LSE] = h * SM_N * (ptrdiff_t)size;
        row[ATTNX_SMB_DOUT] = row[ATTNX_SM_OUT];
        row[ATTNX_SMB_DQ] = row[ATTNX_SM_Q];
        row[ATTNX_SMB_DK] = row[ATTNX_SM_K];
        row[ATTNX_SMB_DV] = row[ATTNX_SM_V];
        memcpy(fwd_offsets + h * ATTNX_SM_NOPS, row, sizeof(ptrdiff_t) * ATTNX_SM_NOPS);
    }
    attnx_softmax_bwd_args b = {
        .fwd = {.n = SM_N, .m = SM_M, .d = SM_D, .e = SM_E, .heads = SM_HEADS,
                .offsets = fwd_offsets, .q = tq, .k = tk, .v = tv, .out = out, .lse = lse,
                .q_row = SM_D, .k_row = SM_D, .v_row = SM_E, .out_row = SM_E, .scale = scale,
                .band = {.n = SM_N, .m = SM_M, .has_hi = 1, .hi_shift = SM_M - SM_N},
                .num_threads = threads},
        .dout = tdout, .dq = dq, .dk = dk, .dv = dv,
        .dout_row = SM_E, .dq_row = SM_D, .dk_row = SM_D, .dv_row = SM_E,
    };
    int status = is_double ? attnx_softmax_fwd_f64(&b.fwd) : attnx_softmax_fwd_f32(&b.fwd);
    b.fwd.offsets = offsets;
    status = status ? status : is_double ? attnx_softmax_bwd_f64(&b) : attnx_softmax_bwd_f32(&b);
    if (status) {
        printf("FAIL softmax %s: status %d\n", context, status);
        failures++;
    } else {
        compare("softmax out", out, want_out, no, is_double, context);
        compare("softmax lse", lse, want_lse, SM_HEADS * SM_N, is_double, context);
        compare("softmax dq", dq, want_dq, nq, is_double, context);
        compare("softmax dk", dk, want_dk, nk, is_double, context);
        compare("softmax dv", dv, want_dv, nv, is_double, context);
    }
    void *blocks[] = {q, k, v, dout, want_out, want_lse, want_dq, want_dk, want_dv, P, dS,
                      tq, tk, tv, tdout, out, lse, dq, dk, dv};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

/* ----------------------------------------------------- causal linear attention */

/* e values a row; chunks of 16 with e % 16 == 0 take the fused chunk
 * kernels of the linear families' sets (csrc/mk_linear.h), chunks of 8 the
 * general steps */
enum { LIN_HEADS = 3, LIN_N = 45, LIN_D = 16 };

static double elu_plus_one(double x) { return x > 0 ? x + 1 : exp(x); }
static double elu_plus_one_slope(double x) { return x > 0 ? 1 : exp(x); }

/* row i of head h of features (LIN_N, LIN_D) */
static const double *lin_row(const double *x, int h, int i, int width)
{
    return x + ((size_t)h * LIN_N + (size_t)i) * (size_t)width;
}

static double lin_score(const double *q, const double *k, int h, int i, int j)
{
    double s = 0;
    for (int c = 0; c < LIN_D; c++)
        s += elu_plus_one(lin_row(q, h, i, LIN_D)[c]) * elu_plus_one(lin_row(k, h, j, LIN_D)[c]);
    return s;
}

/* the causal forward: want (heads, n, e) and each row's denominator */
static void lin_reference(const double *q, const double *k, const double *v, int e, double eps,
                          double *want, double *dens)
{
    for (int h = 0; h < LIN_HEADS; h++)
        for (int i = 0; i < LIN_N; i++) {
            double den = 0, *out = want + ((size_t)h * LIN_N + (size_t)i) * (size_t)e;
            for (int j = 0; j <= i; j++) {
                double s = lin_score(q, k, h, i, j);
                den += s;
                for (int c = 0; c < e; c++) out[c] += s * lin_row(v, h, j, e)[c];
            }
            for (int c = 0; c < e; c++) out[c] /= fmax(den, eps);
            dens[h * LIN_N + i] = den;
        }
}

static void lin_offsets(ptrdiff_t *offsets, int nops, int q_op, int k_op, int v_op,
                        const int *e_ops, int e_count, int e, size_t size)
{
    for (int h = 0; h < LIN_HEADS; h++) {
        ptrdiff_t *row = offsets + h * nops;
        row[q_op] = row[k_op] = h * LIN_N * LIN_D * (ptrdiff_t)size;
        row[v_op] = h * LIN_N * e * (ptrdiff_t)size;
        for (int o = 0; o < e_count; o++) row[e_ops[o]] = h * LIN_N * e * (ptrdiff_t)size;
    }
}

static void check_linear(int is_double, int threads, int e, int chunk, const char *context)
{
    const size_t nq = LIN_HEADS * LIN_N * LIN_D, nv = (size_t)LIN_HEADS * LIN_N * (size_t)e;
    const size_t size = is_double ? sizeof(double) : sizeof(float);
    const double eps = 1e-6;
    double *q = random_array(nq, 5), *k = random_array(nq, 6), *v = random_array(nv, 7);
    double *want = calloc(nv, sizeof(double)), *dens = calloc(LIN_HEADS * LIN_N, sizeof(double));
    lin_reference(q, k, v, e, eps, want, dens);
    void *tq = typed(q, nq, is_double), *tk = typed(k, nq, is_double), *tv = typed(v, nv, is_double);
    void *out = calloc(nv, size);
    ptrdiff_t offsets[LIN_HEADS * ATTNX_LIN_NOPS] = {0};
    const int out_op[] = {ATTNX_LIN_OUT};
    lin_offsets(offsets, ATTNX_LIN_NOPS, ATTNX_LIN_Q, ATTNX_LIN_K, ATTNX_LIN_V, out_op, 1, e, size);
    attnx_linear_args a = {
        .n = LIN_N, .m = LIN_N, .d = LIN_D, .e = e, .heads = LIN_HEADS, .offsets = offsets,
        .q = tq, .k = tk, .v = tv, .out = out,
        .q_row = LIN_D, .k_row = LIN_D, .v_row = e, .out_row = e,
        .features = {.kind = ATTNX_FM_ELU, .d = LIN_D, .r = LIN_D},
        .band = {.n = LIN_N, .m = LIN_N, .has_hi = 1, .hi_shift = 0},
        .method = ATTNX_METHOD_CHUNK, .chunk = chunk, .eps = eps, .normalise = 1,
        .num_threads = threads,
    };
    int status = is_double ? attnx_linear_fwd_f64(&a) : attnx_linear_fwd_f32(&a);
    if (status) {
        printf("FAIL linear %s: status %d\n", context, status);
        failures++;
    } else {
        compare(chunk == 16 ? "causal linear out, chunks of 16" : "causal linear out", out, want,
                nv, is_double, context);
    }
    void *blocks[] = {q, k, v, want, dens, tq, tk, tv, out};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

/* The causal backward (attnx.h): with D_i = max(den_i, eps), a_i = dout_i
 * / D_i, b_i = -(dout_i . out_i) / den_i and ds_ij = a_i . v_j + b_i,
 * dq_i = (sum_j ds_ij psi_j) * phi'(q_i), dk_j = (sum_i ds_ij phi_i) *
 * psi'(k_j), dv_j = sum_i s_ij a_i over the pairs j <= i (den_i > eps:
 * elu + 1 features are positive) */
static void check_linear_grad(int is_double, int threads, int e, int chunk, const char *context)
{
    const size_t nq = LIN_HEADS * LIN_N * LIN_D, nv = (size_t)LIN_HEADS * LIN_N * (size_t)e;
    const size_t size = is_double ? sizeof(double) : sizeof(float);
    const double eps = 1e-6;
    double *q = random_array(nq, 8), *k = random_array(nq, 9), *v = random_array(nv, 10);
    double *dout = random_array(nv, 11);
    double *out = calloc(nv, sizeof(double)), *dens = calloc(LIN_HEADS * LIN_N, sizeof(double));
    double *want_dq = calloc(nq, sizeof(double)), *want_dk = calloc(nq, sizeof(double));
    double *want_dv = calloc(nv, sizeof(double));
    lin_reference(q, k, v, e, eps, out, dens);
    for (int h = 0; h < LIN_HEADS; h++)
        for (int i = 0; i < LIN_N; i++) {
            const double *dout_i = lin_row(dout, h, i, e), *out_i = lin_row(out, h, i, e);
            double den = dens[h * LIN_N + i], D = fmax(den, eps), dot = 0;
            for (int c = 0; c < e; c++) dot += dout_i[c] * out_i[c];
            double b = -dot / den;
            for (int j = 0; j <= i; j++) {
                const double *v_j = lin_row(v, h, j, e);
                double ds = b, s = lin_score(q, k, h, i, j);
                for (int c = 0; c < e; c++) ds += dout_i[c] / D * v_j[c];
                for (int c = 0; c < e; c++)
                    want_dv[((size_t)h * LIN_N + (size_t)j) * (size_t)e + c] += s * dout_i[c] / D;
                for (int c = 0; c < LIN_D; c++) {
                    double qc = lin_row(q, h, i, LIN_D)[c], kc = lin_row(k, h, j, LIN_D)[c];
                    want_dq[((size_t)h * LIN_N + (size_t)i) * LIN_D + c] +=
                        ds * elu_plus_one(kc) * elu_plus_one_slope(qc);
                    want_dk[((size_t)h * LIN_N + (size_t)j) * LIN_D + c] +=
                        ds * elu_plus_one(qc) * elu_plus_one_slope(kc);
                }
            }
        }
    void *tq = typed(q, nq, is_double), *tk = typed(k, nq, is_double), *tv = typed(v, nv, is_double);
    void *tdout = typed(dout, nv, is_double);
    void *dq = calloc(nq, size), *dk = calloc(nq, size), *dv = calloc(nv, size);
    ptrdiff_t offsets[LIN_HEADS * ATTNX_LINB_NOPS] = {0};
    const int e_ops[] = {ATTNX_LINB_DOUT, ATTNX_LINB_DV};
    lin_offsets(offsets, ATTNX_LINB_NOPS, ATTNX_LINB_Q, ATTNX_LINB_K, ATTNX_LINB_V, e_ops, 2, e,
                size);
    for (int h = 0; h < LIN_HEADS; h++)
        offsets[h * ATTNX_LINB_NOPS + ATTNX_LINB_DQ] = offsets[h * ATTNX_LINB_NOPS + ATTNX_LINB_DK] =
            offsets[h * ATTNX_LINB_NOPS + ATTNX_LINB_Q];
    attnx_linear_bwd_args a = {
        .n = LIN_N, .m = LIN_N, .d = LIN_D, .e = e, .heads = LIN_HEADS, .offsets = offsets,
        .q = tq, .k = tk, .v = tv, .dout = tdout, .dq = dq, .dk = dk, .dv = dv,
        .q_row = LIN_D, .k_row = LIN_D, .v_row = e, .dout_row = e,
        .dq_row = LIN_D, .dk_row = LIN_D, .dv_row = e,
        .features = {.kind = ATTNX_FM_ELU, .d = LIN_D, .r = LIN_D},
        .band = {.n = LIN_N, .m = LIN_N, .has_hi = 1, .hi_shift = 0},
        .method = ATTNX_METHOD_CHUNK, .chunk = chunk, .eps = eps, .num_threads = threads,
    };
    int status = is_double ? attnx_linear_bwd_f64(&a) : attnx_linear_bwd_f32(&a);
    if (status) {
        printf("FAIL linear backward %s: status %d\n", context, status);
        failures++;
    } else {
        compare("causal linear dq", dq, want_dq, nq, is_double, context);
        compare("causal linear dk", dk, want_dk, nq, is_double, context);
        compare("causal linear dv", dv, want_dv, nv, is_double, context);
    }
    void *blocks[] = {q, k, v, dout, out, dens, want_dq, want_dk, want_dv, tq, tk, tv, tdout,
                      dq, dk, dv};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

/* ---------------------------------------------------------- gated delta rule */

enum { DR_HEADS = 2, DR_N = 50, DR_K = 16, DR_V = 12 };

static void check_delta(int is_double, int threads, int recurrent, const char *context)
{
    const size_t nk = DR_HEADS * DR_N * DR_K, nv = DR_HEADS * DR_N * DR_V;
    const size_t ns = DR_HEADS * DR_K * DR_V, nt = DR_HEADS * DR_N;
    const size_t size = is_double ? sizeof(double) : sizeof(float);
    const double scale = 1 / sqrt((double)DR_K);
    double *q = random_array(nk, 8), *k = random_array(nk, 9), *v = random_array(nv, 10);
    double *beta = random_array(nt, 11), *g = random_array(nt, 12);
    for (size_t t = 0; t < nt; t++) {
        beta[t] = 0.5 + 0.5 * fabs(beta[t]);
        g[t] = -0.2 * fabs(g[t]);
    }
    double *want = calloc(nv, sizeof(double)), *want_S = calloc(ns, sizeof(double));
    for (int h = 0; h < DR_HEADS; h++) {
        double *S = want_S + h * DR_K * DR_V;
        for (int t = 0; t < DR_N; t++) {
            const double *qt = q + (h * DR_N + t) * DR_K, *kt = k + (h * DR_N + t) * DR_K;
            const double *vt = v + (h * DR_N + t) * DR_V;
            double qn[DR_K], kn[DR_K], q_sq = 0, k_sq = 0, decay = exp(g[h * DR_N + t]);
            for (int c = 0; c < DR_K; c++) q_sq += qt[c] * qt[c], k_sq += kt[c] * kt[c];
            for (int c = 0; c < DR_K; c++) {
                qn[c] = qt[c] / sqrt(q_sq + 1e-6) * scale;
                kn[c] = kt[c] / sqrt(k_sq + 1e-6);
            }
            for (int i = 0; i < DR_K * DR_V; i++) S[i] *= decay;
            for (int j = 0; j < DR_V; j++) {
                double predicted = 0;
                for (int c = 0; c < DR_K; c++) predicted += S[c * DR_V + j] * kn[c];
                double u = beta[h * DR_N + t] * (vt[j] - predicted);
                for (int c = 0; c < DR_K; c++) S[c * DR_V + j] += kn[c] * u;
            }
            for (int j = 0; j < DR_V; j++)
                for (int c = 0; c < DR_K; c++) want[(h * DR_N + t) * DR_V + j] += S[c * DR_V + j] * qn[c];
        }
    }
    void *tq = typed(q, nk, is_double), *tk = typed(k, nk, is_double), *tv = typed(v, nv, is_double);
    void *tbeta = typed(beta, nt, is_double), *tg = typed(g, nt, is_double);
    void *out = calloc(nv, size), *S1 = calloc(ns, size);
    ptrdiff_t offsets[DR_HEADS * ATTNX_DR_NOPS] = {0};
    for (int h = 0; h < DR_HEADS; h++) {
        ptrdiff_t *row = offsets + h * ATTNX_DR_NOPS;
        row[ATTNX_DR_Q] = row[ATTNX_DR_K] = h * DR_N * DR_K * (ptrdiff_t)size;
        row[ATTNX_DR_V] = row[ATTNX_DR_OUT] = h * DR_N * DR_V * (ptrdiff_t)size;
        row[ATTNX_DR_BETA] = row[ATTNX_DR_G] = h * DR_N * (ptrdiff_t)size;
        row[ATTNX_DR_S1] = h * DR_K * DR_V * (ptrdiff_t)size;
    }
    attnx_delta_args a = {
        .n = DR_N, .dk = DR_K, .dv = DR_V, .heads = DR_HEADS, .offsets = offsets,
        .q = tq, .k = tk, .v = tv, .beta = tbeta, .g = tg, .out = out, .S1 = S1,
        .q_row = DR_K, .k_row = DR_K, .v_row = DR_V, .out_row = DR_V,
        .beta_step = (ptrdiff_t)size, .g_step = (ptrdiff_t)size, .gate = ATTNX_GATE_SCALAR,
        .l2norm = 1, .scale = scale, .recurrent = recurrent, .chunk = 16, .num_threads = threads,
    };
    int status = is_double ? attnx_delta_fwd_f64(&a) : attnx_delta_fwd_f32(&a);
    if (status) {
        printf("FAIL delta rule %s: status %d\n", context, status);
        failures++;
    } else {
        compare(recurrent ? "delta rule (recurrent) out" : "delta rule (chunk) out", out, want, nv,
                is_double, context);
        compare("delta rule final state", S1, want_S, ns, is_double, context);
    }
    void *blocks[] = {q, k, v, beta, g, want, want_S, tq, tk, tv, tbeta, tg, out, S1};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

/* ------------------------------------------------------ Reformer LSH attention */

enum { LSH_HEADS = 2, LSH_N = 200, LSH_D = 16, LSH_E = 12, LSH_H = 2, LSH_HALF = 9, LSH_C = 16 };

/* vis (n, n) |= round's pairs: same bucket, the key's chunk of the sorted
 * order (by bucket, then position) the query's or the one before */
static void lsh_round_pairs(const int32_t *bucket, unsigned char *vis)
{
    int place[LSH_N], next = 0;
    for (int b = 0; b < 2 * LSH_HALF; b++)
        for (int j = 0; j < LSH_N; j++)
            if (bucket[j] == b) place[j] = next++;
    for (int i = 0; i < LSH_N; i++)
        for (int j = 0; j < LSH_N; j++) {
            int behind = place[i] / LSH_C - place[j] / LSH_C;
            vis[i * LSH_N + j] |= bucket[i] == bucket[j] && (behind == 0 || behind == 1);
        }
}

/* the forward from its definition (attnx.h, lsh.c) in double, on the
 * kernel's buckets (each checked against the hashing in double where its
 * best score is clear of the second) */
static void check_lsh(int is_double, int threads, const char *context)
{
    const size_t nq = LSH_HEADS * LSH_N * LSH_D, nv = LSH_HEADS * LSH_N * LSH_E;
    const size_t nr = LSH_H * LSH_D * LSH_HALF, size = is_double ? sizeof(double) : sizeof(float);
    double *q = random_array(nq, 13), *v = random_array(nv, 14), *rot = random_array(nr, 15);
    double *want = calloc(nv, sizeof(double)), *want_lse = calloc(LSH_HEADS * LSH_N, sizeof(double));
    void *tq = typed(q, nq, is_double), *tv = typed(v, nv, is_double), *trot = typed(rot, nr, is_double);
    void *out = calloc(nv, size), *lse = calloc(LSH_HEADS * LSH_N, size);
    int32_t *buckets = malloc(LSH_HEADS * LSH_H * LSH_N * sizeof *buckets);
    unsigned char *vis = malloc(LSH_N * LSH_N);
    ptrdiff_t offsets[LSH_HEADS * ATTNX_LSH_NOPS] = {0};
    for (int h = 0; h < LSH_HEADS; h++) {
        ptrdiff_t *row = offsets + h * ATTNX_LSH_NOPS;
        row[ATTNX_LSH_Q] = h * LSH_N * LSH_D * (ptrdiff_t)size;
        row[ATTNX_LSH_V] = row[ATTNX_LSH_OUT] = h * LSH_N * LSH_E * (ptrdiff_t)size;
        row[ATTNX_LSH_LSE] = h * LSH_N * (ptrdiff_t)size;
    }
    const double scale = 1 / sqrt((double)LSH_D);
    attnx_lsh_args a = {
        .n = LSH_N, .d = LSH_D, .e = LSH_E, .heads = LSH_HEADS, .offsets = offsets,
        .q = tq, .v = tv, .rotations = trot, .rot_hash = LSH_D * LSH_HALF, .rot_row = LSH_HALF,
        .n_hashes = LSH_H, .half = LSH_HALF, .chunk = LSH_C, .scale = scale, .out = out,
        .lse = lse, .q_row = LSH_D, .v_row = LSH_E, .out_row = LSH_E, .num_threads = threads,
    };
    int status = is_double ? attnx_lsh_buckets_f64(&a, buckets) : attnx_lsh_buckets_f32(&a, buckets);
    if (!status) status = is_double ? attnx_lsh_fwd_f64(&a) : attnx_lsh_fwd_f32(&a);
    int wrong_buckets = 0;
    for (int h = 0; h < LSH_HEADS && !status; h++) {
        const double *qh = q + h * LSH_N * LSH_D;
        memset(vis, 0, LSH_N * LSH_N);
        for (int r = 0; r < LSH_H; r++) {
            const int32_t *bucket = buckets + (h * LSH_H + r) * LSH_N;
            for (int j = 0; j < LSH_N; j++) {
                double best = -INFINITY, second = -INFINITY;
                int arg = 0;
                for (int b = 0; b < 2 * LSH_HALF; b++) {
                    double x = 0;
                    for (int c = 0; c < LSH_D; c++)
                        x += qh[j * LSH_D + c] * rot[(r * LSH_D + c) * LSH_HALF + b % LSH_HALF];
                    x = b < LSH_HALF ? x : -x;
                    if (x > best) second = best, best = x, arg = b;
                    else if (x > second) second = x;
                }
                wrong_buckets += best - second > 1e-4 && bucket[j] != arg;
            }
            lsh_round_pairs(bucket, vis);
        }
        for (int i = 0; i < LSH_N; i++) {
            double top = -INFINITY, sum = 0, s[LSH_N];
            vis[i * LSH_N + i] = 0;
            int alone = 1;
            for (int j = 0; j < LSH_N; j++) alone &= !vis[i * LSH_N + j];
            if (alone) vis[i * LSH_N + i] = 1;
            for (int j = 0; j < LSH_N; j++) {
                double dot = 0, norm = 0;
                for (int c = 0; c < LSH_D; c++) {
                    dot += qh[i * LSH_D + c] * qh[j * LSH_D + c];
                    norm += qh[j * LSH_D + c] * qh[j * LSH_D + c];
                }
                s[j] = vis[i * LSH_N + j] ? scale * dot / sqrt(norm) : -INFINITY;
                top = fmax(top, s[j]);
            }
            for (int j = 0; j < LSH_N; j++) sum += s[j] == -INFINITY ? 0 : exp(s[j] - top);
            for (int j = 0; j < LSH_N; j++)
                for (int c = 0; c < LSH_E; c++)
                    want[(h * LSH_N + i) * LSH_E + c] +=
                        (s[j] == -INFINITY ? 0 : exp(s[j] - top) / sum) * v[(h * LSH_N + j) * LSH_E + c];
            want_lse[h * LSH_N + i] = top + log(sum);
        }
    }
    if (status || wrong_buckets) {
        printf("FAIL lsh %s: status %d, %d buckets not the hashing's\n", context, status,
               wrong_buckets);
        failures++;
    } else {
        compare("lsh out", out, want, nv, is_double, context);
        compare("lsh lse", lse, want_lse, LSH_HEADS * LSH_N, is_double, context);
    }
    void *blocks[] = {q, v, rot, want, want_lse, tq, tv, trot, out, lse, buckets, vis};
    for (size_t i = 0; i < sizeof blocks / sizeof *blocks; i++) free(blocks[i]);
}

/* --------------------------------- bfloat16 and float16 <-> float32 */

/* count elements of src converted into dst, as convert.c's callers do */
static void convert(void *dst, const void *src, int widen, attnx_half_format format,
                    ptrdiff_t count)
{
    ptrdiff_t shape[1] = {count}, stride[1] = {1};
    attnx_conversion job;
    attnx_conversion_prepare(&job, dst, src, widen, format, 1, shape, stride);
    attnx_conversion_run(&job, 1);
}

/* float32 -> bfloat16 bits, round to nearest, ties to even, from the
 * definition on the bit pattern: the dropped half decides (above half a
 * unit up, at half up to the even neighbour); NaN stays NaN */
static uint16_t bf16_reference(uint32_t bits)
{
    uint32_t kept = bits >> 16, dropped = bits & 0xffffu;
    if (dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u))) kept++;
    return (uint16_t)kept;
}

/* every bfloat16 pattern widened, and narrowed back with each low half
 * that decides a rounding, bit for bit (a source row long enough for the
 * vector loops and their tails) */
static void check_convert(const char *context)
{
    static const uint32_t lows[] = {0, 1, 0x7fff, 0x8000, 0x8001, 0xffff};
    enum { PATTERNS = 1 << 16, LOWS = sizeof lows / sizeof *lows };
    uint16_t *bits = malloc(PATTERNS * LOWS * sizeof *bits);
    float *x = malloc(PATTERNS * LOWS * sizeof *x);
    int bad = 0;
    for (uint32_t p = 0; p < PATTERNS; p++) bits[p] = (uint16_t)p;
    convert(x, bits, 1, ATTNX_BF16, PATTERNS);
    for (uint32_t p = 0; p < PATTERNS; p++) {
        uint32_t got;
        memcpy(&got, x + p, sizeof got);
        bad += got != p << 16;
    }
    for (uint32_t p = 0; p < PATTERNS; p++)
        for (int l = 0; l < (int)LOWS; l++) {
            uint32_t pattern = p << 16 | lows[l];
            memcpy(x + p * LOWS + l, &pattern, sizeof pattern);
        }
    convert(bits, x, 0, ATTNX_BF16, PATTERNS * LOWS);
    for (uint32_t i = 0; i < PATTERNS * LOWS; i++) {
        uint32_t pattern;
        memcpy(&pattern, x + i, sizeof pattern);
        if ((pattern & 0x7fffffffu) > 0x7f800000u)  /* NaN: quiet, its sign kept */
            bad += (bits[i] & 0x7fc0u) != 0x7fc0u || (bits[i] >> 15) != (pattern >> 31);
        else
            bad += bits[i] != bf16_reference(pattern);
    }
    if (bad) {
        printf("FAIL bfloat16 conversion %s: %d wrong results\n", context, bad);
        failures++;
    }
    free(bits);
    free(x);
}

/* a finite float16's value from its fields (subnormals at exponent 0) */
static double f16_reference(uint32_t bits)
{
    uint32_t exponent = (bits >> 10) & 0x1fu, fraction = bits & 0x3ffu;
    double value = exponent ? ldexp(1 + fraction / 1024.0, (int)exponent - 15)
                            : ldexp(fraction / 1024.0, -14);
    return bits & 0x8000u ? -value : value;
}

/* every float16 pattern widened exactly, and narrowed back; the midpoints
 * between neighbouring finite values (ties, exact in float32: to the even
 * one) and the floats either side of them, to the nearer */
static void check_convert_f16(const char *context)
{
    enum { PATTERNS = 1 << 16, FINITE = 0x7c00, MIDS = FINITE - 1 };
    uint16_t *bits = malloc(PATTERNS * sizeof *bits), *back = malloc(3 * MIDS * sizeof *back);
    float *x = malloc(PATTERNS * sizeof *x), *mids = malloc(3 * MIDS * sizeof *mids);
    int bad = 0;
    for (uint32_t p = 0; p < PATTERNS; p++) bits[p] = (uint16_t)p;
    convert(x, bits, 1, ATTNX_F16, PATTERNS);
    for (uint32_t p = 0; p < PATTERNS; p++) {
        int nan = (p & 0x7c00u) == 0x7c00u && (p & 0x3ffu);
        if (nan) bad += x[p] == x[p];
        else if ((p & 0x7fffu) == 0x7c00u) bad += x[p] != (p & 0x8000u ? -INFINITY : INFINITY);
        else bad += (double)x[p] != f16_reference(p) || !!signbit(x[p]) != (int)(p >> 15);
    }
    convert(bits, x, 0, ATTNX_F16, PATTERNS);
    for (uint32_t p = 0; p < PATTERNS; p++) {
        int nan = (p & 0x7c00u) == 0x7c00u && (p & 0x3ffu);
        bad += nan ? (bits[p] & 0x7e00u) != 0x7e00u || (bits[p] >> 15) != (p >> 15) : bits[p] != p;
    }
    for (uint32_t p = 0; p < MIDS; p++) {
        float mid = (float)((f16_reference(p) + f16_reference(p + 1)) / 2);
        mids[3 * p] = mid;
        mids[3 * p + 1] = nextafterf(mid, 0);
        mids[3 * p + 2] = nextafterf(mid, INFINITY);
    }
    convert(back, mids, 0, ATTNX_F16, 3 * MIDS);
    for (uint32_t p = 0; p < MIDS; p++) {
        uint32_t even = p & 1u ? p + 1 : p;
        bad += back[3 * p] != even || back[3 * p + 1] != p || back[3 * p + 2] != p + 1;
    }
    if (bad) {
        printf("FAIL float16 conversion %s: %d wrong results\n", context, bad);
        failures++;
    }
    free(bits);
    free(back);
    free(x);
    free(mids);
}

/* every family held to the table's `level`-th set from the end (0: plain) */
static int limit_families(int level, char *names, size_t names_size)
{
    int limits[ATTNX_FAMILIES], held = 0;
    names[0] = 0;
    for (int f = 0; f < ATTNX_FAMILIES; f++) {
        int sets[ATTNX_KERNEL_SETS], count = attnx_family_sets(f, sets);
        limits[f] = sets[count - 1 - (level < count ? level : count - 1)];
        held |= level < count;
    }
    if (attnx_dispatch_fill(0, limits) != 0) return 0;
    for (int f = 0; f < ATTNX_FAMILIES; f++) {
        size_t used = strlen(names);
        snprintf(names + used, names_size - used, "%s%s=%s", f ? " " : "", attnx_family_name(f),
                 attnx_kernels_name(attnx_kernels(f)));
    }
    return held;
}

int main(void)
{
    char detected[256], names[512], context[640];
    attnx_runtime_init();
    attnx_cpu_format(attnx_cpu_detected(), detected, sizeof detected);
    printf("CPU features: %s; BLAS: %s (%s)\n", detected, attnx_blas_name(), attnx_blas_core());
    int checks = 0;
    for (int level = 0; limit_families(level, names, sizeof names); level++) {
        printf("kernels: %s\n", names);
        snprintf(context, sizeof context, "(level %d)", level);
        check_convert(context);
        check_convert_f16(context);
        checks += 2;
        for (int threads = 1; threads <= 2; threads++)
            for (int is_double = 0; is_double <= 1; is_double++) {
                snprintf(context, sizeof context, "(%s, %d thread%s, level %d)",
                         is_double ? "float64" : "float32", threads, threads > 1 ? "s" : "", level);
                check_softmax(is_double, threads, context);
                check_linear(is_double, threads, 12, 8, context);
                check_linear(is_double, threads, 16, 16, context);
                check_linear_grad(is_double, threads, 16, 16, context);
                check_delta(is_double, threads, 0, context);
                check_delta(is_double, threads, 1, context);
                check_lsh(is_double, threads, context);
                checks += 7;
            }
    }
    printf("%d checks, %d failed\n", checks, failures);
    return failures != 0;
}
