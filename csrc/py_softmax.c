/* py_softmax.c - Python front ends of softmax and gaussian attention:
 * parse, validate, allocate, release the GIL, call the kernel. */
#include "args.h"

#include <limits.h>
#include <math.h>
#include "bindings.h"

typedef int (*softmax_kernel)(const attnx_softmax_args *);
static const softmax_kernel softmax_kernels[2] = {attnx_softmax_fwd_f32, attnx_softmax_fwd_f64};

/* Shared by both front ends. scale_obj NULL means gaussian attention with
 * bandwidth sigma (scale 1/sigma^2 and key bias -|k|^2 / (2 sigma^2)). */
static PyObject *softmax_common(PyObject *q_obj, PyObject *k_obj, PyObject *v_obj,
                                PyObject *scale_obj, double sigma, PyObject *causal_obj,
                                PyObject *mask_obj, PyObject *bias_obj, PyObject *window_obj,
                                PyObject *dropout_obj, PyObject *seed_obj, PyObject *out_obj,
                                int return_lse)
{
    enum { Q, K, V, BIAS, MASK, NOPS };
    attnx_operand ops[NOPS] = {
        [Q] = {"q", NULL, 2}, [K] = {"k", NULL, 2}, [V] = {"v", NULL, 2},
        [BIAS] = {"bias", NULL, 2}, [MASK] = {"mask", NULL, 2},
    };
    /* out and lse join the broadcast only to get their offsets */
    attnx_operand outs[2] = {{"out", NULL, 2}, {"lse", NULL, 1}};
    PyArrayObject *result = NULL;
    ptrdiff_t *offsets = NULL;
    PyObject *ret = NULL;
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

    PyObject *const dtype_objs[] = {q_obj, k_obj, v_obj};
    const char *const dtype_names[] = {"q", "k", "v"};
    attnx_dtypes dtypes;
    if (attnx_resolve_dtypes(dtype_objs, dtype_names, 3, &dtypes) < 0) return NULL;
    if (attnx_operand_convert(&ops[Q], q_obj, dtypes.compute, 2, 0) < 0 ||
        attnx_operand_convert(&ops[K], k_obj, dtypes.compute, 2, 0) < 0 ||
        attnx_operand_convert(&ops[V], v_obj, dtypes.compute, 2, 0) < 0)
        goto done;
    if (bias_obj && bias_obj != Py_None) {
        PyObject *const bias_objs[] = {bias_obj};
        const char *const bias_names[] = {"bias"};
        attnx_dtypes bias_dtypes;
        if (attnx_resolve_dtypes(bias_objs, bias_names, 1, &bias_dtypes) < 0 ||
            attnx_operand_convert(&ops[BIAS], bias_obj, dtypes.compute, 0, 1) < 0)
            goto done;
    }
    if (mask_obj && mask_obj != Py_None && attnx_mask_convert(&ops[MASK], mask_obj) < 0) goto done;

    int nd_q = PyArray_NDIM(ops[Q].array);
    npy_intp n = PyArray_DIM(ops[Q].array, nd_q - 2), d = PyArray_DIM(ops[Q].array, nd_q - 1);
    int nd_v = PyArray_NDIM(ops[V].array);
    npy_intp m = PyArray_DIM(ops[V].array, nd_v - 2), e = PyArray_DIM(ops[V].array, nd_v - 1);
    char what[160];
    PyOS_snprintf(what, sizeof what, "expected (..., m, d) with d = %ld from q (..., n, d)", (long)d);
    if (attnx_check_core(&ops[K], -1, d, 0, what) < 0) goto done;
    npy_intp m_k = PyArray_DIM(ops[K].array, PyArray_NDIM(ops[K].array) - 2);
    PyOS_snprintf(what, sizeof what, "expected (..., m, e) with m = %ld keys from k (..., m, d)", (long)m_k);
    if (attnx_check_core(&ops[V], -2, m_k, 0, what) < 0) goto done;
    PyOS_snprintf(what, sizeof what, "expected to broadcast to (..., n, m) = (..., %ld, %ld)", (long)n, (long)m);
    for (int i = BIAS; i <= MASK; i++)
        if (ops[i].array && (attnx_check_core(&ops[i], -1, m, 1, what) < 0 ||
                             attnx_check_core(&ops[i], -2, n, 1, what) < 0))
            goto done;
    if (d > INT_MAX || e > INT_MAX || m > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "q, k, v: feature sizes and m must be below 2**31");
        goto done;
    }

    attnx_batch batch;
    if (attnx_broadcast(ops, NOPS, &batch) < 0) goto done;
    PyArrayObject *compute_out;
    if (attnx_output(out_obj, &dtypes, &batch, n, e, ops, NOPS, &result, &compute_out) < 0) goto done;
    outs[0].array = compute_out;
    if (return_lse && !(outs[1].array = attnx_new_array(&batch, &n, 1, dtypes.compute))) goto done;

    /* operand order of the kernel's offset table */
    attnx_operand table[ATTNX_SM_NOPS] = {
        [ATTNX_SM_Q] = ops[Q], [ATTNX_SM_K] = ops[K], [ATTNX_SM_V] = ops[V],
        [ATTNX_SM_OUT] = outs[0], [ATTNX_SM_LSE] = outs[1],
        [ATTNX_SM_BIAS] = ops[BIAS], [ATTNX_SM_MASK] = ops[MASK],
    };
    if (!(offsets = attnx_offsets(table, ATTNX_SM_NOPS, &batch))) goto done;

    if (!scale_obj) scale = 1 / (sigma * sigma);
    else if (scale_obj == Py_None) scale = d > 0 ? 1 / sqrt((double)d) : 1;
    npy_intp itemsize = dtypes.compute == NPY_FLOAT ? 4 : 8;
    attnx_softmax_args args = {
        .n = n, .m = m, .d = d, .e = e, .heads = batch.heads, .offsets = offsets,
        .q = PyArray_DATA(ops[Q].array), .k = PyArray_DATA(ops[K].array),
        .v = PyArray_DATA(ops[V].array), .out = PyArray_DATA(compute_out),
        .lse = outs[1].array ? PyArray_DATA(outs[1].array) : NULL,
        .bias = ops[BIAS].array ? PyArray_DATA(ops[BIAS].array) : NULL,
        .mask = ops[MASK].array ? PyArray_DATA(ops[MASK].array) : NULL,
        .q_row = attnx_row_stride(ops[Q].array), .k_row = attnx_row_stride(ops[K].array),
        .v_row = attnx_row_stride(ops[V].array), .out_row = attnx_row_stride(compute_out),
        .bias_row = ops[BIAS].array ? attnx_core_stride(&ops[BIAS], -2) / itemsize : 0,
        .bias_col = ops[BIAS].array ? attnx_core_stride(&ops[BIAS], -1) / itemsize : 0,
        .mask_row = ops[MASK].array ? attnx_core_stride(&ops[MASK], -2) : 0,
        .mask_col = ops[MASK].array ? attnx_core_stride(&ops[MASK], -1) : 0,
        .scale = scale,
        .key_sqnorm_coef = scale_obj ? 0 : -1 / (2 * sigma * sigma),
        .band = attnx_make_band(n, m, causal, has_left, left, has_right, right),
        .num_threads = attnx_get_num_threads(),
        .dropout_p = dropout_p,
        .seed = seed,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = softmax_kernels[dtypes.compute == NPY_DOUBLE](&args);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    if (attnx_output_finish(result, compute_out) < 0) goto done;
    if (return_lse)
        ret = PyTuple_Pack(2, (PyObject *)result, (PyObject *)outs[1].array);
    else {
        ret = (PyObject *)result;
        Py_INCREF(ret);
    }
done:
    PyMem_RawFree(offsets);
    Py_XDECREF(result);
    attnx_release(outs, 2);
    attnx_release(ops, NOPS);
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
        PyErr_Format(PyExc_ValueError, "sigma=%g is out of range: 1/sigma**2 must be finite and non-zero", sigma);
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
