/* py_softmax_backward.c - Python entry of the softmax and gaussian
 * attention gradients: parse, validate, allocate, release the GIL, call
 * softmax_backward.c. The public functions (attnx/_softmax.py) reduce the
 * per-head gradients returned here to the inputs' own shapes and dtypes. */
#include "args.h"

#include <limits.h>
#include <math.h>
#include "bindings.h"

typedef int (*softmax_bwd_kernel)(const attnx_softmax_bwd_args *);
static const softmax_bwd_kernel softmax_bwd_kernels[2] = {attnx_softmax_bwd_f32,
                                                          attnx_softmax_bwd_f64};

/* _C.softmax_backward(dout, q, k, v, out, lse, scale, sigma, causal, mask,
 * bias, window, bias_grad) -> (dq, dk, dv, dbias or None), each of the
 * broadcast batch shape in the compute dtype. scale None and sigma None:
 * softmax with the default scale; sigma given: gaussian attention. */
PyObject *attnx_py_softmax_backward(PyObject *self, PyObject *args)
{
    enum { DOUT, Q, K, V, OUT, LSE, BIAS, MASK, NOPS };
    attnx_operand ops[NOPS] = {
        [DOUT] = {"dout", NULL, 2}, [Q] = {"q", NULL, 2}, [K] = {"k", NULL, 2},
        [V] = {"v", NULL, 2}, [OUT] = {"out", NULL, 2}, [LSE] = {"lse", NULL, 1},
        [BIAS] = {"bias", NULL, 2}, [MASK] = {"mask", NULL, 2},
    };
    enum { DQ, DK, DV, DBIAS, NGRADS };
    attnx_operand grads[NGRADS] = {
        [DQ] = {"dq", NULL, 2}, [DK] = {"dk", NULL, 2}, [DV] = {"dv", NULL, 2},
        [DBIAS] = {"dbias", NULL, 2},
    };
    PyObject *objs[NOPS], *scale_obj, *sigma_obj, *causal_obj, *window_obj, *dropout_obj,
             *seed_obj, *ret = NULL;
    ptrdiff_t *offsets = NULL, *grad_offsets = NULL;
    int bias_grad, causal, has_left, has_right;
    npy_intp left, right;
    double scale = 0, sigma = 0, dropout_p;
    uint64_t seed;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOOOOOp:softmax_backward", &objs[DOUT], &objs[Q],
                          &objs[K], &objs[V], &objs[OUT], &objs[LSE], &scale_obj, &sigma_obj,
                          &causal_obj, &objs[MASK], &objs[BIAS], &window_obj, &dropout_obj,
                          &seed_obj, &bias_grad))
        return NULL;
    if (attnx_parse_dropout(dropout_obj, seed_obj, &dropout_p, &seed) < 0) return NULL;
    if (attnx_parse_causal(causal_obj, &causal) < 0 ||
        attnx_parse_window(window_obj, &has_left, &left, &has_right, &right) < 0)
        return NULL;
    if (scale_obj != Py_None && attnx_parse_positive(scale_obj, "scale", &scale) < 0) return NULL;
    if (sigma_obj != Py_None && attnx_parse_positive(sigma_obj, "sigma", &sigma) < 0) return NULL;
    if (bias_grad && objs[BIAS] == Py_None) {
        PyErr_SetString(PyExc_ValueError, "bias_grad=True needs a bias");
        return NULL;
    }

    PyObject *const dtype_objs[] = {objs[Q], objs[K], objs[V]};
    const char *const dtype_names[] = {"q", "k", "v"};
    attnx_dtypes dtypes;
    if (attnx_resolve_dtypes(dtype_objs, dtype_names, 3, &dtypes) < 0) return NULL;
    for (int i = DOUT; i <= LSE; i++)
        if (attnx_operand_convert(&ops[i], objs[i], dtypes.compute, ops[i].core_ndim, 0) < 0)
            goto done;
    if (objs[BIAS] != Py_None) {
        PyObject *const bias_objs[] = {objs[BIAS]};
        const char *const bias_names[] = {"bias"};
        attnx_dtypes bias_dtypes;
        if (attnx_resolve_dtypes(bias_objs, bias_names, 1, &bias_dtypes) < 0 ||
            attnx_operand_convert(&ops[BIAS], objs[BIAS], dtypes.compute, 0, 1) < 0)
            goto done;
    }
    if (objs[MASK] != Py_None && attnx_mask_convert(&ops[MASK], objs[MASK]) < 0) goto done;

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
    PyOS_snprintf(what, sizeof what, "expected (..., n, e) = (..., %ld, %ld) from q and v", (long)n, (long)e);
    for (int i = DOUT; i <= OUT; i += OUT - DOUT)
        if (attnx_check_core(&ops[i], -2, n, 0, what) < 0 || attnx_check_core(&ops[i], -1, e, 0, what) < 0)
            goto done;
    PyOS_snprintf(what, sizeof what, "expected (..., n) = (..., %ld) from q", (long)n);
    if (attnx_check_core(&ops[LSE], -1, n, 0, what) < 0) goto done;
    PyOS_snprintf(what, sizeof what, "expected to broadcast to (..., n, m) = (..., %ld, %ld)", (long)n, (long)m);
    for (int i = BIAS; i <= MASK; i++)
        if (ops[i].array && (attnx_check_core(&ops[i], -1, m, 1, what) < 0 ||
                             attnx_check_core(&ops[i], -2, n, 1, what) < 0))
            goto done;
    if (d > INT_MAX || e > INT_MAX || m > INT_MAX || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "q, k, v: feature sizes, n and m must be below 2**31");
        goto done;
    }

    attnx_batch batch;
    if (attnx_broadcast(ops, NOPS, &batch) < 0) goto done;
    const npy_intp core[NGRADS][2] = {{n, d}, {m, d}, {m, e}, {n, m}};
    for (int i = DQ; i <= (bias_grad ? DBIAS : DV); i++)
        if (!(grads[i].array = attnx_new_array(&batch, core[i], 2, dtypes.compute))) goto done;

    attnx_operand fwd_table[ATTNX_SM_NOPS] = {
        [ATTNX_SM_Q] = ops[Q], [ATTNX_SM_K] = ops[K], [ATTNX_SM_V] = ops[V],
        [ATTNX_SM_OUT] = ops[OUT], [ATTNX_SM_LSE] = ops[LSE],
        [ATTNX_SM_BIAS] = ops[BIAS], [ATTNX_SM_MASK] = ops[MASK],
    };
    attnx_operand grad_table[ATTNX_SMB_NOPS] = {
        [ATTNX_SMB_DOUT] = ops[DOUT], [ATTNX_SMB_DQ] = grads[DQ], [ATTNX_SMB_DK] = grads[DK],
        [ATTNX_SMB_DV] = grads[DV], [ATTNX_SMB_DBIAS] = grads[DBIAS],
    };
    if (!(offsets = attnx_offsets(fwd_table, ATTNX_SM_NOPS, &batch)) ||
        !(grad_offsets = attnx_offsets(grad_table, ATTNX_SMB_NOPS, &batch)))
        goto done;

    int gaussian = sigma_obj != Py_None;
    if (gaussian) scale = 1 / (sigma * sigma);
    else if (scale_obj == Py_None) scale = d > 0 ? 1 / sqrt((double)d) : 1;
    npy_intp itemsize = dtypes.compute == NPY_FLOAT ? 4 : 8;
    attnx_softmax_bwd_args kargs = {
        .fwd = {
            .n = n, .m = m, .d = d, .e = e, .heads = batch.heads, .offsets = offsets,
            .q = PyArray_DATA(ops[Q].array), .k = PyArray_DATA(ops[K].array),
            .v = PyArray_DATA(ops[V].array), .out = PyArray_DATA(ops[OUT].array),
            .lse = PyArray_DATA(ops[LSE].array),
            .bias = ops[BIAS].array ? PyArray_DATA(ops[BIAS].array) : NULL,
            .mask = ops[MASK].array ? PyArray_DATA(ops[MASK].array) : NULL,
            .q_row = attnx_row_stride(ops[Q].array), .k_row = attnx_row_stride(ops[K].array),
            .v_row = attnx_row_stride(ops[V].array), .out_row = attnx_row_stride(ops[OUT].array),
            .bias_row = ops[BIAS].array ? attnx_core_stride(&ops[BIAS], -2) / itemsize : 0,
            .bias_col = ops[BIAS].array ? attnx_core_stride(&ops[BIAS], -1) / itemsize : 0,
            .mask_row = ops[MASK].array ? attnx_core_stride(&ops[MASK], -2) : 0,
            .mask_col = ops[MASK].array ? attnx_core_stride(&ops[MASK], -1) : 0,
            .scale = scale,
            .key_sqnorm_coef = gaussian ? -1 / (2 * sigma * sigma) : 0,
            .band = attnx_make_band(n, m, causal, has_left, left, has_right, right),
            .num_threads = attnx_get_num_threads(),
            .dropout_p = dropout_p,
            .seed = seed,
        },
        .grad_offsets = grad_offsets,
        .dout = PyArray_DATA(ops[DOUT].array),
        .dq = PyArray_DATA(grads[DQ].array), .dk = PyArray_DATA(grads[DK].array),
        .dv = PyArray_DATA(grads[DV].array),
        .dbias = grads[DBIAS].array ? PyArray_DATA(grads[DBIAS].array) : NULL,
        .dout_row = attnx_row_stride(ops[DOUT].array), .dq_row = d, .dk_row = d, .dv_row = e,
        .dbias_row = m,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = softmax_bwd_kernels[dtypes.compute == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    ret = PyTuple_Pack(4, (PyObject *)grads[DQ].array, (PyObject *)grads[DK].array,
                       (PyObject *)grads[DV].array,
                       grads[DBIAS].array ? (PyObject *)grads[DBIAS].array : Py_None);
done:
    PyMem_RawFree(offsets);
    PyMem_RawFree(grad_offsets);
    attnx_release(grads, NGRADS);
    attnx_release(ops, NOPS);
    return ret;
}

const char attnx_softmax_backward_doc[] = (
"softmax_backward(dout, q, k, v, out, lse, scale, sigma, causal, mask, bias, window, dropout_p, seed, bias_grad)\n"
"--\n\n"
"Private: per-head gradients (dq, dk, dv, dbias or None) of softmax or gaussian\n"
"attention over the broadcast batch; see attnx.softmax_attention_backward.");
