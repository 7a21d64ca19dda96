/* py_softmax.c - Python front ends of softmax and gaussian attention:
 * parse, validate, allocate, release the GIL, call the kernel. */
#include "args.h"

#include <math.h>
#include "bindings.h"

typedef int (*softmax_kernel)(const attnx_softmax_args *);
static const softmax_kernel softmax_kernels[2] = {attnx_softmax_fwd_f32, attnx_softmax_fwd_f64};

/* The array arguments of both front ends. */
enum { Q, K, V, BIAS, MASK, OUT, LSE, NPARAMS };
static const attnx_param softmax_params[NPARAMS] = {
    [Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_SM_Q},
    [K] = {"k", "m d", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_SM_K},
    [V] = {"v", "m e", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_SM_V},
    [BIAS] = {"bias", "n|1 m|1", ATTNX_ELEMENTWISE, ATTNX_SM_BIAS},
    [MASK] = {"mask", "n|1 m|1", ATTNX_BOOL, ATTNX_SM_MASK},
    [OUT] = {"out", "n e", ATTNX_OUTPUT | ATTNX_RESULT_DTYPE, ATTNX_SM_OUT},
    [LSE] = {"lse", "n", ATTNX_OUTPUT, ATTNX_SM_LSE},
};

/* Shared by both front ends. scale_obj NULL means gaussian attention with
 * bandwidth sigma (scale 1/sigma^2 and key bias -|k|^2 / (2 sigma^2)). */
static PyObject *softmax_common(PyObject *q_obj, PyObject *k_obj, PyObject *v_obj,
                                PyObject *scale_obj, double sigma, PyObject *causal_obj,
                                PyObject *mask_obj, PyObject *bias_obj, PyObject *window_obj,
                                PyObject *dropout_obj, PyObject *seed_obj, PyObject *out_obj,
                                int return_lse)
{
    int causal, has_left, has_right;
    npy_intp left, right;
    double scale = 0, dropout_p;
    uint64_t seed;

    if (attnx_parse_causal(causal_obj, &causal) < 0 ||
        attnx_parse_window(window_obj, &has_left, &left, &has_right, &right) < 0 ||
        attnx_parse_dropout(dropout_obj, seed_obj, &dropout_p, &seed) < 0)
        return NULL;
    if (scale_obj && scale_obj != Py_None && attnx_parse_positive(scale_obj, "scale", &scale) < 0)
        return NULL;

    attnx_call call;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    PyObject *ret = NULL;
    attnx_call_init(&call, softmax_params, NPARAMS, ATTNX_SM_NOPS, "dem");
    PyObject *const objs[NPARAMS] = {
        [Q] = q_obj, [K] = k_obj, [V] = v_obj, [BIAS] = bias_obj, [MASK] = mask_obj,
        [OUT] = out_obj, [LSE] = return_lse ? Py_None : NULL,
    };
    if (attnx_bind(&call, objs) < 0) goto done;

    npy_intp n = attnx_size(&call, 'n'), m = attnx_size(&call, 'm'), d = attnx_size(&call, 'd');
    if (!scale_obj) scale = 1 / (sigma * sigma);
    else if (scale_obj == Py_None) scale = d > 0 ? 1 / sqrt((double)d) : 1;
    npy_intp itemsize = call.dtypes.compute == NPY_FLOAT ? 4 : 8;
    attnx_softmax_args args = {
        .n = n, .m = m, .d = d, .e = attnx_size(&call, 'e'), .heads = call.batch.heads,
        .offsets = call.offsets,
        .q = attnx_data(&call, Q), .k = attnx_data(&call, K), .v = attnx_data(&call, V),
        .out = attnx_data(&call, OUT), .lse = attnx_data(&call, LSE),
        .bias = attnx_data(&call, BIAS), .mask = attnx_data(&call, MASK),
        .q_row = attnx_row_stride(call.ops[Q].array), .k_row = attnx_row_stride(call.ops[K].array),
        .v_row = attnx_row_stride(call.ops[V].array), .out_row = attnx_row_stride(call.ops[OUT].array),
        .bias_row = attnx_core_stride(&call, BIAS, -2) / itemsize,
        .bias_col = attnx_core_stride(&call, BIAS, -1) / itemsize,
        .mask_row = attnx_core_stride(&call, MASK, -2),
        .mask_col = attnx_core_stride(&call, MASK, -1),
        .scale = scale,
        .key_sqnorm_coef = scale_obj ? 0 : -1 / (2 * sigma * sigma),
        .band = attnx_make_band(n, m, causal, has_left, left, has_right, right),
        .num_threads = attnx_get_num_threads(),
        .dropout_p = dropout_p,
        .seed = seed,
        .interrupt = &interrupt,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = softmax_kernels[call.dtypes.compute == NPY_DOUBLE](&args);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    if (return_lse)
        ret = PyTuple_Pack(2, (PyObject *)call.results[OUT], (PyObject *)call.results[LSE]);
    else {
        ret = (PyObject *)call.results[OUT];
        Py_INCREF(ret);
    }
done:
    attnx_call_release(&call);
    return ret;
}

PyObject *attnx_py_softmax_attention(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"q", "k", "v", "scale", "causal", "mask", "bias", "window",
                             "dropout_p", "seed", "out", "return_lse", NULL};
    PyObject *q, *k, *v, *scale = Py_None, *causal = Py_False, *mask = Py_None, *bias = Py_None,
             *window = Py_None, *dropout = Py_None, *seed = Py_None, *out = Py_None;
    int return_lse = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$OOOOOOOOp:softmax_attention", kwlist,
                                     &q, &k, &v, &scale, &causal, &mask, &bias, &window, &dropout,
                                     &seed, &out, &return_lse))
        return NULL;
    return softmax_common(q, k, v, scale, 0, causal, mask, bias, window, dropout, seed, out,
                          return_lse);
}

PyObject *attnx_py_gaussian_attention(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"q", "k", "v", "sigma", "causal", "mask", "bias", "window",
                             "dropout_p", "seed", "out", "return_lse", NULL};
    PyObject *q, *k, *v, *sigma_obj = NULL, *causal = Py_False, *mask = Py_None, *bias = Py_None,
             *window = Py_None, *dropout = Py_None, *seed = Py_None, *out = Py_None;
    int return_lse = 0;
    double sigma = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O$OOOOOOOp:gaussian_attention", kwlist,
                                     &q, &k, &v, &sigma_obj, &causal, &mask, &bias, &window,
                                     &dropout, &seed, &out, &return_lse))
        return NULL;
    if (sigma_obj && attnx_parse_positive(sigma_obj, "sigma", &sigma) < 0) return NULL;
    if (1 / (sigma * sigma) == 0 || !isfinite(1 / (sigma * sigma))) {
        char message[120];  /* PyErr_Format has no %g */
        PyOS_snprintf(message, sizeof message,
                      "sigma=%g is out of range: 1/sigma**2 must be finite and non-zero", sigma);
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    return softmax_common(q, k, v, NULL, sigma, causal, mask, bias, window, dropout, seed, out,
                          return_lse);
}

const char attnx_softmax_attention_doc[] = (
"softmax_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, window=None, dropout_p=0.0, seed=None, out=None, return_lse=False)\n"
"--\n\n"
"Exact scaled dot product attention, computed in tiles with an online softmax.\n\n"
"o_i = sum_j w_ij v_j with w_ij proportional to exp(scale * q_i . k_j + bias_ij)\n"
"over the keys query i may see.\n\n"
"q (..., n, d), k (..., m, d), v (..., m, e) -> (..., n, e); leading axes broadcast.\n"
"scale: default 1/sqrt(d). causal: False, True or 'lower_right' (j <= i + m - n),\n"
"'upper_left' (j <= i). mask: bool, broadcastable to (..., n, m), True = may attend.\n"
"bias: added to the scores, broadcastable to (..., n, m). window: w or (left, right)\n"
"(None = open side): i + m - n - left <= j <= i + m - n + right.\n"
"dropout_p, seed: each weight dropped with probability dropout_p and the kept ones\n"
"scaled by 1/(1 - dropout_p), by a Philox4x32-10 function of (seed, head, i, j), so\n"
"the backward regenerates the mask (seed required when dropout_p > 0).\n"
"out: array receiving the result. return_lse: also return log sum_j exp(score_ij),\n"
"shape (..., n) (-inf for a row that sees no key; such rows output zeros).");

const char attnx_gaussian_attention_doc[] = (
"gaussian_attention(q, k, v, sigma=1.0, *, causal=False, mask=None, bias=None, window=None, dropout_p=0.0, seed=None, out=None, return_lse=False)\n"
"--\n\n"
"Gaussian kernel attention (Nadaraya-Watson regression):\n"
"w_ij proportional to exp(-|q_i - k_j|^2 / (2 sigma^2) + bias_ij).\n\n"
"Computed as softmax attention with scale 1/sigma^2 and the per-key bias\n"
"-|k_j|^2 / (2 sigma^2) (the query's own norm cancels). Options as softmax_attention;\n"
"lse is that of the rewritten scores.");
