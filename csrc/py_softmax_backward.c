/* py_softmax_backward.c - Python entry of the softmax and gaussian
 * attention gradients: parse, validate, allocate, release the GIL, call
 * softmax_backward.c. The public functions (attnx/_softmax.py) reduce the
 * per-head gradients returned here to the inputs' own shapes and dtypes. */
#include "args.h"

#include <math.h>
#include "bindings.h"

typedef int (*softmax_bwd_kernel)(const attnx_softmax_bwd_args *);
static const softmax_bwd_kernel softmax_bwd_kernels[2] = {attnx_softmax_bwd_f32,
                                                          attnx_softmax_bwd_f64};

/* The array arguments: the forward's, its result, and the gradients. */
enum { DOUT, Q, K, V, OUT, LSE, BIAS, MASK, DQ, DK, DV, DBIAS, NPARAMS };
static const attnx_param backward_params[NPARAMS] = {
    [DOUT] = {"dout", "n e", ATTNX_REQUIRED, ATTNX_SMB_DOUT},
    [Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_SM_Q},
    [K] = {"k", "m d", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_SM_K},
    [V] = {"v", "m e", ATTNX_COMPUTE | ATTNX_BROADCAST_ROWS, ATTNX_SM_V},
    [OUT] = {"out", "n e", ATTNX_REQUIRED, ATTNX_SM_OUT},
    [LSE] = {"lse", "n", ATTNX_REQUIRED, ATTNX_SM_LSE},
    [BIAS] = {"bias", "n|1 m|1", ATTNX_ELEMENTWISE, ATTNX_SM_BIAS},
    [MASK] = {"mask", "n|1 m|1", ATTNX_BOOL, ATTNX_SM_MASK},
    [DQ] = {"dq", "n d", ATTNX_OUTPUT, ATTNX_SMB_DQ},
    [DK] = {"dk", "m d", ATTNX_OUTPUT, ATTNX_SMB_DK},
    [DV] = {"dv", "m e", ATTNX_OUTPUT, ATTNX_SMB_DV},
    [DBIAS] = {"dbias", "n m", ATTNX_OUTPUT, ATTNX_SMB_DBIAS},
};

/* _C.softmax_backward(dout, q, k, v, out, lse, *, scale, sigma, causal, mask,
 * bias, window, dropout_p, seed, bias_grad, dq, dk, dv) -> (dq, dk, dv,
 * dbias or None), each of the broadcast batch shape in the compute dtype,
 * written into the dq, dk, dv given (None: allocated). sigma None:
 * softmax (scale None: 1/sqrt(d)); sigma given: gaussian attention.
 * _bf16_products (attnx.torch, for bfloat16 tensors only): the
 * bf16_products of attnx_softmax_args (attnx.h). _half_kv (attnx.torch,
 * for bfloat16 and float16 tensors): k and v in half precision (both
 * float16, or both bfloat16 as bits), widened by the kernel a key block at
 * a time (kv_half), or first, whole, where it refuses them; q float32. */
PyObject *attnx_py_softmax_backward(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dout", "q", "k", "v", "out", "lse", "scale", "sigma", "causal",
                               "mask", "bias", "window", "dropout_p", "seed", "bias_grad", "dq",
                               "dk", "dv", "_bf16_products", "_half_kv", NULL};
    PyObject *objs[NPARAMS] = {NULL}, *scale_obj = Py_None, *sigma_obj = Py_None,
             *causal_obj = Py_False, *window_obj = Py_None, *dropout_obj = Py_None,
             *seed_obj = Py_None, *ret = NULL;
    int bias_grad = 0, bf16_products = 0, half_kv = 0, causal, has_left, has_right;
    npy_intp left, right;
    double scale = 0, sigma = 0, dropout_p;
    uint64_t seed;
    objs[MASK] = objs[BIAS] = objs[DQ] = objs[DK] = objs[DV] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO|$OOOOOOOOpOOOpp:softmax_backward",
                                     keywords, &objs[DOUT], &objs[Q], &objs[K], &objs[V],
                                     &objs[OUT], &objs[LSE], &scale_obj, &sigma_obj, &causal_obj,
                                     &objs[MASK], &objs[BIAS], &window_obj, &dropout_obj,
                                     &seed_obj, &bias_grad, &objs[DQ], &objs[DK], &objs[DV],
                                     &bf16_products, &half_kv))
        return NULL;
    if (attnx_parse_causal(causal_obj, &causal) < 0 ||
        attnx_parse_window(window_obj, &has_left, &left, &has_right, &right) < 0 ||
        attnx_parse_dropout(dropout_obj, seed_obj, &dropout_p, &seed) < 0)
        return NULL;
    if (scale_obj != Py_None && attnx_parse_positive(scale_obj, "scale", &scale) < 0) return NULL;
    if (sigma_obj != Py_None && attnx_parse_positive(sigma_obj, "sigma", &sigma) < 0) return NULL;
    if (bias_grad && objs[BIAS] == Py_None) {
        PyErr_SetString(PyExc_ValueError, "bias_grad=True needs a bias");
        return NULL;
    }

    if (half_kv &&
        !(PyArray_Check(objs[Q]) && PyArray_TYPE((PyArrayObject *)objs[Q]) == NPY_FLOAT)) {
        PyErr_SetString(PyExc_TypeError, "_half_kv takes float32 queries (a numpy array)");
        return NULL;
    }
    attnx_call call;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    PyObject *k_wide = NULL, *v_wide = NULL;
    /* with _half_kv, k and v read as they are (kv_half) */
    attnx_param half_kv_params[NPARAMS];
    attnx_half_kv_params(half_kv_params, backward_params, NPARAMS, K, V);
    const attnx_param *params = half_kv ? half_kv_params : backward_params;
bind:
    attnx_call_init(&call, params, NPARAMS, ATTNX_SMB_NOPS, "dem");
    objs[DBIAS] = bias_grad ? Py_None : NULL;
    if (attnx_bind(&call, objs) < 0) goto done;
    int kv_half = 0;
    if (params == half_kv_params &&
        (kv_half = attnx_half_kv_format(call.ops[K].array, call.ops[V].array)) < 0)
        goto done;

    npy_intp n = attnx_size(&call, 'n'), m = attnx_size(&call, 'm'), d = attnx_size(&call, 'd');
    int gaussian = sigma_obj != Py_None;
    if (gaussian) scale = 1 / (sigma * sigma);
    else if (scale_obj == Py_None) scale = d > 0 ? 1 / sqrt((double)d) : 1;
    npy_intp itemsize = call.dtypes.compute == NPY_FLOAT ? 4 : 8;
    attnx_softmax_bwd_args kargs = {
        .fwd = {
            .n = n, .m = m, .d = d, .e = attnx_size(&call, 'e'), .heads = call.batch.heads,
            .offsets = call.offsets,
            .q = attnx_data(&call, Q), .k = attnx_data(&call, K), .v = attnx_data(&call, V),
            .out = attnx_data(&call, OUT), .lse = attnx_data(&call, LSE),
            .bias = attnx_data(&call, BIAS), .mask = attnx_data(&call, MASK),
            .q_row = attnx_row_stride(call.ops[Q].array),
            .k_row = attnx_row_stride(call.ops[K].array),
            .v_row = attnx_row_stride(call.ops[V].array),
            .out_row = attnx_row_stride(call.ops[OUT].array),
            .bias_row = attnx_core_stride(&call, BIAS, -2) / itemsize,
            .bias_col = attnx_core_stride(&call, BIAS, -1) / itemsize,
            .mask_row = attnx_core_stride(&call, MASK, -2),
            .mask_col = attnx_core_stride(&call, MASK, -1),
            .scale = scale,
            .key_sqnorm_coef = gaussian ? -1 / (2 * sigma * sigma) : 0,
            .band = attnx_make_band(n, m, causal, has_left, left, has_right, right),
            .num_threads = attnx_get_num_threads(),
            .dropout_p = dropout_p,
            .seed = seed,
            .interrupt = &interrupt,
            .bf16_products = bf16_products,
            .kv_half = kv_half,
        },
        .dout = attnx_data(&call, DOUT),
        .dq = attnx_data(&call, DQ), .dk = attnx_data(&call, DK), .dv = attnx_data(&call, DV),
        .dbias = attnx_data(&call, DBIAS),
        .dout_row = attnx_row_stride(call.ops[DOUT].array),
        .dq_row = attnx_row_stride(call.ops[DQ].array),
        .dk_row = attnx_row_stride(call.ops[DK].array),
        .dv_row = attnx_row_stride(call.ops[DV].array),
        .dbias_row = m,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = softmax_bwd_kernels[call.dtypes.compute == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (status == ATTNX_EINVAL && kv_half) {
        /* a call the kernel does not widen itself (its only refusal,
         * before any work): k and v widened first */
        if (!(k_wide = attnx_widened_half(call.ops[K].array, "k")) ||
            !(v_wide = attnx_widened_half(call.ops[V].array, "v")))
            goto done;
        attnx_call_release(&call);
        objs[K] = k_wide;
        objs[V] = v_wide;
        params = backward_params;
        goto bind;
    }
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    ret = PyTuple_Pack(4, (PyObject *)call.results[DQ], (PyObject *)call.results[DK],
                       (PyObject *)call.results[DV],
                       bias_grad ? (PyObject *)call.results[DBIAS] : Py_None);
done:
    attnx_call_release(&call);
    Py_XDECREF(k_wide);
    Py_XDECREF(v_wide);
    return ret;
}

const char attnx_softmax_backward_doc[] = (
"softmax_backward(dout, q, k, v, out, lse, *, scale=None, sigma=None, causal=False, mask=None, bias=None, window=None, dropout_p=None, seed=None, bias_grad=False, dq=None, dk=None, dv=None)\n"
"--\n\n"
"Private: per-head gradients (dq, dk, dv, dbias or None) of softmax or gaussian\n"
"attention over the broadcast batch; see attnx.softmax_attention_backward.");
