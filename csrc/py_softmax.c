/* py_softmax.c - Python front ends of softmax and gaussian attention:
 * parse, validate, allocate, release the GIL, call the kernel. */
#include "args.h"

#include <math.h>
#include "bindings.h"
#include "convert.h"

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
 * bandwidth sigma (scale 1/sigma^2 and key bias -|k|^2 / (2 sigma^2)).
 * Their keywords left out of their documented signatures, which
 * attnx.torch passes for half-precision tensors only: _bf16_products
 * (bfloat16), the bf16_products of attnx_softmax_args (attnx.h); _half_kv
 * (bfloat16 and float16), k and v given
 * in half precision (both float16, or both bfloat16 as bits), which the
 * decoding path reads as they are (kv_half) and any other widens first;
 * q float32. */
static PyObject *softmax_common(PyObject *q_obj, PyObject *k_obj, PyObject *v_obj,
                                PyObject *scale_obj, double sigma, PyObject *causal_obj,
                                PyObject *mask_obj, PyObject *bias_obj, PyObject *window_obj,
                                PyObject *dropout_obj, PyObject *seed_obj, PyObject *out_obj,
                                int return_lse, int bf16_products, int half_kv)
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

    if (half_kv && !(PyArray_Check(q_obj) && PyArray_TYPE((PyArrayObject *)q_obj) == NPY_FLOAT)) {
        PyErr_SetString(PyExc_TypeError, "_half_kv takes float32 queries (a numpy array)");
        return NULL;
    }
    attnx_call call;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    PyObject *ret = NULL, *k_wide = NULL, *v_wide = NULL;
    /* with _half_kv, k and v read as they are (kv_half) */
    attnx_param half_kv_params[NPARAMS];
    attnx_half_kv_params(half_kv_params, softmax_params, NPARAMS, K, V);
    const attnx_param *params = half_kv ? half_kv_params : softmax_params;
bind:
    attnx_call_init(&call, params, NPARAMS, ATTNX_SM_NOPS, "dem");
    PyObject *const objs[NPARAMS] = {
        [Q] = q_obj, [K] = k_obj, [V] = v_obj, [BIAS] = bias_obj, [MASK] = mask_obj,
        [OUT] = out_obj, [LSE] = return_lse ? Py_None : NULL,
    };
    if (attnx_bind(&call, objs) < 0) goto done;
    int kv_half = 0;
    if (params == half_kv_params &&
        (kv_half = attnx_half_kv_format(call.ops[K].array, call.ops[V].array)) < 0)
        goto done;

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
        .bf16_products = bf16_products,
        .kv_half = kv_half,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = softmax_kernels[call.dtypes.compute == NPY_DOUBLE](&args);
    Py_END_ALLOW_THREADS
    if (status == ATTNX_EINVAL && args.kv_half) {
        /* not a call the decoding path takes (its only refusal, before any
         * work): k and v widened, then as any call */
        if (!(k_wide = attnx_widened_half(call.ops[K].array, "k")) ||
            !(v_wide = attnx_widened_half(call.ops[V].array, "v")))
            goto done;
        attnx_call_release(&call);
        k_obj = k_wide;
        v_obj = v_wide;
        params = softmax_params;
        goto bind;
    }
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    if (return_lse)
        ret = PyTuple_Pack(2, (PyObject *)call.results[OUT], (PyObject *)call.results[LSE]);
    else {
        ret = (PyObject *)call.results[OUT];
        Py_INCREF(ret);
    }
done:
    attnx_call_release(&call);
    Py_XDECREF(k_wide);
    Py_XDECREF(v_wide);
    return ret;
}

PyObject *attnx_py_softmax_attention(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"q", "k", "v", "scale", "causal", "mask", "bias", "window",
                             "dropout_p", "seed", "out", "return_lse", "_bf16_products",
                             "_half_kv", NULL};
    PyObject *q, *k, *v, *scale = Py_None, *causal = Py_False, *mask = Py_None, *bias = Py_None,
             *window = Py_None, *dropout = Py_None, *seed = Py_None, *out = Py_None;
    int return_lse = 0, bf16_products = 0, half_kv = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$OOOOOOOOppp:softmax_attention", kwlist,
                                     &q, &k, &v, &scale, &causal, &mask, &bias, &window, &dropout,
                                     &seed, &out, &return_lse, &bf16_products, &half_kv))
        return NULL;
    return softmax_common(q, k, v, scale, 0, causal, mask, bias, window, dropout, seed, out,
                          return_lse, bf16_products, half_kv);
}

PyObject *attnx_py_gaussian_attention(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"q", "k", "v", "sigma", "causal", "mask", "bias", "window",
                             "dropout_p", "seed", "out", "return_lse", "_bf16_products", NULL};
    PyObject *q, *k, *v, *sigma_obj = NULL, *causal = Py_False, *mask = Py_None, *bias = Py_None,
             *window = Py_None, *dropout = Py_None, *seed = Py_None, *out = Py_None;
    int return_lse = 0, bf16_products = 0;
    double sigma = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|O$OOOOOOOpp:gaussian_attention", kwlist,
                                     &q, &k, &v, &sigma_obj, &causal, &mask, &bias, &window,
                                     &dropout, &seed, &out, &return_lse, &bf16_products))
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
                          return_lse, bf16_products, 0);
}

const char attnx_softmax_attention_doc[] = (
"softmax_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, window=None, dropout_p=0.0, seed=None, out=None, return_lse=False)\n"
"--\n"
"\n"
"Exact scaled dot product (softmax) attention.\n"
"\n"
"Computed FlashAttention-style, in tiles of queries against tiles of keys\n"
"with an online softmax, so no n x m matrix is ever held in memory. Key\n"
"tiles that no query of a tile can see (causal, window) are skipped.\n"
"\n"
"Parameters\n"
"----------\n"
"q : array_like, shape (..., n, d)\n"
"    Queries.\n"
"k : array_like, shape (..., m, d)\n"
"    Keys.\n"
"v : array_like, shape (..., m, e)\n"
"    Values. The leading axes of q, k and v (and of mask and bias)\n"
"    broadcast against each other by numpy's rules; an input whose last\n"
"    axis is contiguous is read in place, whatever its other strides.\n"
"scale : float, optional\n"
"    Multiplies the scores; positive and finite. Default ``1 / sqrt(d)``.\n"
"causal : bool or {\"lower_right\", \"upper_left\"}, default False\n"
"    True or \"lower_right\": query i sees the keys ``j <= i + m - n`` (the\n"
"    last query lines up with the last key, as in FlashAttention);\n"
"    \"upper_left\": ``j <= i`` (PyTorch's ``is_causal``).\n"
"mask : array_like of bool, optional\n"
"    Broadcastable to (..., n, m); True means \"may attend\" (PyTorch's\n"
"    convention). A key-padding mask has the shape (..., 1, m).\n"
"bias : array_like, optional\n"
"    Added to the scores, broadcastable to (..., n, m) (ALiBi, relative\n"
"    position biases); read through its strides.\n"
"window : int or (int or None, int or None), optional\n"
"    ``w`` or ``(left, right)`` with None for an open side: query i sees\n"
"    ``i + m - n - left <= j <= i + m - n + right``. Costs\n"
"    O(n (left + right + 1) d), not O(n m d).\n"
"dropout_p : float, default 0.0\n"
"    Each weight is dropped with this probability and the kept ones scaled\n"
"    by ``1 / (1 - dropout_p)``, by a Philox4x32-10 function of\n"
"    ``(seed, head, i, j)``, so the backward regenerates the mask.\n"
"seed : int, optional\n"
"    The dropout seed; required when ``dropout_p > 0``.\n"
"out : ndarray, optional\n"
"    Receives the result: shape (..., n, e) and the result's dtype, last\n"
"    axis contiguous, not overlapping an input.\n"
"return_lse : bool, default False\n"
"    Also return the log-sum-exp of each row's scores.\n"
"\n"
"Returns\n"
"-------\n"
"out : ndarray, shape (..., n, e)\n"
"    The attention output (``out`` itself when given).\n"
"lse : ndarray, shape (..., n)\n"
"    Only with ``return_lse=True``: ``log sum_j exp(scale q_i . k_j +\n"
"    bias_ij)`` over the visible keys; -inf for a row that sees no key.\n"
"    float32 for float16 and float32 inputs, else the result's dtype.\n"
"\n"
"Raises\n"
"------\n"
"ValueError\n"
"    Mismatched core sizes (d of q and k, m of k and v), leading axes that\n"
"    do not broadcast, a non-positive or non-finite scale, an unknown\n"
"    causal string, a bad window, dropout_p outside [0, 1) or without a\n"
"    seed, an ``out`` of the wrong shape or overlapping an input, sizes\n"
"    whose products overflow.\n"
"TypeError\n"
"    Complex, object or string inputs, a mask that is not boolean, an\n"
"    ``out`` of the wrong dtype.\n"
"MemoryError\n"
"    When the result or the working memory cannot be allocated.\n"
"\n"
"See Also\n"
"--------\n"
"gaussian_attention : Gaussian kernel attention through the same kernels.\n"
"softmax_attention_backward : The gradients of this function.\n"
"attention_weights : The (..., n, m) weights this function never forms.\n"
"attnx.torch.scaled_dot_product_attention : The PyTorch operator.\n"
"\n"
"Notes\n"
"-----\n"
"With the keys query i may see (causal, mask, window)::\n"
"\n"
"    o_i = sum_j w_ij v_j,   w_ij = exp(s_ij) / sum_j' exp(s_ij'),\n"
"    s_ij = scale * q_i . k_j + bias_ij.\n"
"\n"
"A row that sees no key returns zeros (and lse -inf), never NaN. NaN or\n"
"inf in the inputs reach only the rows they touch.\n"
"\n"
"dtypes: float32 in, float32 out; float64 in, float64 out; mixed float\n"
"inputs promote like numpy; integer and bool inputs compute in float64;\n"
"float16 computes in float32 and returns float16. Empty inputs: n == 0\n"
"gives an empty result, m == 0 zeros. The GIL is released while the kernel\n"
"runs. See docs/conventions.md and docs/softmax.md.\n"
"\n"
"Examples\n"
"--------\n"
">>> import numpy as np, attnx\n"
">>> rng = np.random.default_rng(0)\n"
">>> q, k, v = (rng.standard_normal((2, 5, 4)) for _ in range(3))\n"
">>> o = attnx.softmax_attention(q, k, v, causal=True)\n"
">>> o.shape\n"
"(2, 5, 4)\n"
"\n"
"The same from the formula in numpy:\n"
"\n"
">>> s = q @ k.swapaxes(-1, -2) / np.sqrt(4)\n"
">>> s = np.where(np.tri(5, dtype=bool), s, -np.inf)\n"
">>> w = np.exp(s - s.max(-1, keepdims=True))\n"
">>> np.allclose(o, w / w.sum(-1, keepdims=True) @ v)\n"
"True\n"
"\n"
"float32 stays float32; the lse comes with ``return_lse=True``:\n"
"\n"
">>> o, lse = attnx.softmax_attention(q.astype(np.float32), k, v, return_lse=True)\n"
">>> o.dtype, lse.shape\n"
"(dtype('float64'), (2, 5))\n"
">>> attnx.softmax_attention(*(x.astype(np.float32) for x in (q, k, v))).dtype\n"
"dtype('float32')");

const char attnx_gaussian_attention_doc[] = (
"gaussian_attention(q, k, v, sigma=1.0, *, causal=False, mask=None, bias=None, window=None, dropout_p=0.0, seed=None, out=None, return_lse=False)\n"
"--\n"
"\n"
"Gaussian kernel attention (Nadaraya-Watson kernel regression).\n"
"\n"
"Parameters\n"
"----------\n"
"q : array_like, shape (..., n, d)\n"
"    Queries.\n"
"k : array_like, shape (..., m, d)\n"
"    Keys.\n"
"v : array_like, shape (..., m, e)\n"
"    Values; leading axes broadcast as in `softmax_attention`.\n"
"sigma : float, default 1.0\n"
"    The kernel's width; positive and finite.\n"
"causal, mask, bias, window, dropout_p, seed, out, return_lse\n"
"    As in `softmax_attention`.\n"
"\n"
"Returns\n"
"-------\n"
"out : ndarray, shape (..., n, e)\n"
"    The attention output (``out`` itself when given).\n"
"lse : ndarray, shape (..., n)\n"
"    Only with ``return_lse=True``: the log-sum-exp of the rewritten scores\n"
"    ``(q_i . k_j - |k_j|^2 / 2) / sigma^2 + bias_ij``.\n"
"\n"
"Raises\n"
"------\n"
"ValueError\n"
"    A non-positive or non-finite sigma, and the errors of\n"
"    `softmax_attention`.\n"
"TypeError\n"
"    As in `softmax_attention`.\n"
"\n"
"See Also\n"
"--------\n"
"softmax_attention : The kernel this function runs.\n"
"gaussian_attention_backward : The gradients of this function.\n"
"attnx.plot.kernel_regression : A 1-d fit drawn with this function.\n"
"\n"
"Notes\n"
"-----\n"
"The weights are::\n"
"\n"
"    w_ij proportional to exp(-|q_i - k_j|^2 / (2 sigma^2) + bias_ij).\n"
"\n"
"The query's own norm cancels in the normalisation, so this is softmax\n"
"attention with ``scale = 1 / sigma^2`` and the per-key bias\n"
"``-|k_j|^2 / (2 sigma^2)`` (broadcast, never materialised). dtypes, masks\n"
"and empty inputs follow `softmax_attention`.\n"
"\n"
"Examples\n"
"--------\n"
">>> import numpy as np, attnx\n"
">>> x = np.linspace(0, 3, 7)[:, None]            # 7 points on a line\n"
">>> y = np.sin(x)\n"
">>> fit = attnx.gaussian_attention(x, x, y, sigma=0.5)\n"
">>> fit.shape\n"
"(7, 1)\n"
">>> w = np.exp(-(x - x.T) ** 2 / (2 * 0.5 ** 2))\n"
">>> np.allclose(fit, w / w.sum(1, keepdims=True) @ y)\n"
"True");
