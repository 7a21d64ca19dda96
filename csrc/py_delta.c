/* py_delta.c - the binding of the delta rule (delta.c): _C.delta_rule and
 * _C.delta_rule_backward take their options resolved by attnx/_delta.py
 * (grouped heads already folded into broadcasting, the gate as g_scalar or
 * g_channel) and return arrays on the broadcast batch shape. */
#include "args.h"
#include "bindings.h"

/* A call below this many flops does not poll for Ctrl-C (as py_linear.c). */
#define INTERRUPTIBLE_FLOPS 1e8

typedef int (*delta_kernel)(const attnx_delta_args *);
static const delta_kernel delta_fwd_kernels[2] = {attnx_delta_fwd_f32, attnx_delta_fwd_f64};
static const delta_kernel delta_bwd_kernels[2] = {attnx_delta_bwd_f32, attnx_delta_bwd_f64};

enum { F_Q, F_K, F_V, F_BETA, F_GS, F_GC, F_S0, F_OUT, F_S1, F_NPARAMS };
#define FORWARD_PARAMS(state_flags, s0_flags)                                                \
    {                                                                                        \
        [F_Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_DR_Q},                                     \
        [F_K] = {"k", "n d", ATTNX_COMPUTE, ATTNX_DR_K},                                     \
        [F_V] = {"v", "n e", ATTNX_COMPUTE, ATTNX_DR_V},                                     \
        [F_BETA] = {"beta", "n", ATTNX_ELEMENTWISE | ATTNX_REQUIRED, ATTNX_DR_BETA},         \
        [F_GS] = {"g", "n", ATTNX_ELEMENTWISE, ATTNX_DR_G},                                  \
        [F_GC] = {"g", "n d", 0, ATTNX_DR_G},                                                \
        [F_S0] = {"initial_state", "d e", s0_flags, ATTNX_DR_S0},                            \
        [F_OUT] = {"out", "n e", ATTNX_OUTPUT | ATTNX_RESULT_DTYPE, ATTNX_DR_OUT},           \
        [F_S1] = {"state", "d e", ATTNX_OUTPUT | (state_flags), ATTNX_DR_S1},                \
    }
static const attnx_param forward_params[F_NPARAMS] = FORWARD_PARAMS(ATTNX_ALIGNED, 0);
/* a decoding step: the state's own array is read and overwritten */
static const attnx_param step_params[F_NPARAMS] =
    FORWARD_PARAMS(ATTNX_IN_PLACE, ATTNX_EXACT_DTYPE | ATTNX_REQUIRED);

static int check_options(double scale, Py_ssize_t chunk)
{
    if (!(scale > 0) || !isfinite(scale)) {
        PyErr_SetString(PyExc_ValueError, "scale must be a positive finite number");
        return -1;
    }
    if (chunk < 1) {
        PyErr_Format(PyExc_ValueError, "chunk must be a positive integer, got %zd", chunk);
        return -1;
    }
    return 0;
}

/* scale and chunk, keyword-only without a default: "O" converted as "d" and "n" */
static int scale_and_chunk(const char *function, PyObject *scale_obj, PyObject *chunk_obj,
                           double *scale, Py_ssize_t *chunk)
{
    if (attnx_required(function, "scale", scale_obj) < 0 ||
        attnx_required(function, "chunk", chunk_obj) < 0 || !PyArg_Parse(scale_obj, "d", scale) ||
        !PyArg_Parse(chunk_obj, "n", chunk))
        return -1;
    return 0;
}

PyObject *attnx_py_delta_rule(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"q", "k", "v", "beta", "g_scalar", "g_channel", "initial_state",
                               "out", "want_state", "in_place", "scale", "l2norm", "recurrent",
                               "chunk", NULL};
    PyObject *objs[F_NPARAMS] = {NULL}, *scale_obj = NULL, *recurrent_obj = NULL,
             *chunk_obj = NULL, *ret = NULL;
    int want_state = 0, in_place = 0, l2norm = 0, recurrent;
    double scale;
    Py_ssize_t chunk;
    objs[F_GS] = objs[F_GC] = objs[F_S0] = objs[F_OUT] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|$OOOOppOpOO:delta_rule", keywords,
                                     &objs[F_Q], &objs[F_K], &objs[F_V], &objs[F_BETA],
                                     &objs[F_GS], &objs[F_GC], &objs[F_S0], &objs[F_OUT],
                                     &want_state, &in_place, &scale_obj, &l2norm, &recurrent_obj,
                                     &chunk_obj) ||
        attnx_required("delta_rule", "recurrent", recurrent_obj) < 0 ||
        (recurrent = PyObject_IsTrue(recurrent_obj)) < 0 ||
        scale_and_chunk("delta_rule", scale_obj, chunk_obj, &scale, &chunk) < 0)
        return NULL;
    if (check_options(scale, chunk) < 0) return NULL;
    if (objs[F_GS] != Py_None && objs[F_GC] != Py_None) {
        PyErr_SetString(PyExc_ValueError, "give g as g_scalar or g_channel, not both");
        return NULL;
    }
    attnx_call call;
    attnx_call_init(&call, in_place ? step_params : forward_params, F_NPARAMS, ATTNX_DR_NOPS,
                    "nde");
    objs[F_S1] = in_place ? objs[F_S0] : (want_state ? Py_None : NULL);
    if (attnx_bind(&call, objs) < 0) goto done;
    npy_intp n = attnx_size(&call, 'n'), d = attnx_size(&call, 'd'), e = attnx_size(&call, 'e');
    int gate = call.ops[F_GC].array ? ATTNX_GATE_CHANNEL
                                    : call.ops[F_GS].array ? ATTNX_GATE_SCALAR : ATTNX_GATE_NONE;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    double flops = 4.0 * (double)call.batch.heads * (double)n * (double)(d * e + chunk * (d + e));
    PyArrayObject *S0_array = call.ops[F_S0].array;
    attnx_delta_args kargs = {
        .n = n, .dk = d, .dv = e, .heads = call.batch.heads, .offsets = call.offsets,
        .q = attnx_data(&call, F_Q), .k = attnx_data(&call, F_K), .v = attnx_data(&call, F_V),
        .beta = attnx_data(&call, F_BETA),
        .g = gate == ATTNX_GATE_CHANNEL ? attnx_data(&call, F_GC) : attnx_data(&call, F_GS),
        .S0 = attnx_data(&call, F_S0), .out = attnx_data(&call, F_OUT),
        .S1 = attnx_data(&call, F_S1),
        .q_row = attnx_row_stride(call.ops[F_Q].array),
        .k_row = attnx_row_stride(call.ops[F_K].array),
        .v_row = attnx_row_stride(call.ops[F_V].array),
        .out_row = attnx_row_stride(call.ops[F_OUT].array),
        .g_row = gate == ATTNX_GATE_CHANNEL ? attnx_row_stride(call.ops[F_GC].array) : 0,
        .S0_row = S0_array ? attnx_row_stride(S0_array) : e,
        .beta_step = attnx_core_stride(&call, F_BETA, -1),
        .g_step = attnx_core_stride(&call, F_GS, -1),
        .gate = gate, .l2norm = l2norm, .scale = scale, .recurrent = recurrent, .chunk = chunk,
        .num_threads = attnx_get_num_threads(),
        .interrupt = flops >= INTERRUPTIBLE_FLOPS ? &interrupt : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = delta_fwd_kernels[call.dtypes.compute == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    if (want_state)
        ret = Py_BuildValue("OO", call.results[F_OUT], call.results[F_S1]);
    else
        ret = Py_NewRef((PyObject *)call.results[F_OUT]);
done:
    attnx_call_release(&call);
    return ret;
}

enum { B_DOUT, B_Q, B_K, B_V, B_BETA, B_GS, B_GC, B_S0, B_DS1, B_DQ, B_DK, B_DV, B_DBETA,
       B_DGS, B_DGC, B_DS0, B_NPARAMS };
static const attnx_param backward_params[B_NPARAMS] = {
    [B_DOUT] = {"dout", "n e", ATTNX_REQUIRED, ATTNX_DR_DOUT},
    [B_Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_DR_Q},
    [B_K] = {"k", "n d", ATTNX_COMPUTE, ATTNX_DR_K},
    [B_V] = {"v", "n e", ATTNX_COMPUTE, ATTNX_DR_V},
    [B_BETA] = {"beta", "n", ATTNX_ELEMENTWISE | ATTNX_REQUIRED, ATTNX_DR_BETA},
    [B_GS] = {"g", "n", ATTNX_ELEMENTWISE, ATTNX_DR_G},
    [B_GC] = {"g", "n d", 0, ATTNX_DR_G},
    [B_S0] = {"initial_state", "d e", 0, ATTNX_DR_S0},
    [B_DS1] = {"grad_state", "d e", 0, ATTNX_DR_DS1},
    [B_DQ] = {"dq", "n d", ATTNX_OUTPUT, ATTNX_DR_DQ},
    [B_DK] = {"dk", "n d", ATTNX_OUTPUT, ATTNX_DR_DK},
    [B_DV] = {"dv", "n e", ATTNX_OUTPUT, ATTNX_DR_DV},
    [B_DBETA] = {"dbeta", "n", ATTNX_OUTPUT, ATTNX_DR_DBETA},
    [B_DGS] = {"dg", "n", ATTNX_OUTPUT, ATTNX_DR_DG},
    [B_DGC] = {"dg", "n d", ATTNX_OUTPUT, ATTNX_DR_DG},
    [B_DS0] = {"dstate", "d e", ATTNX_OUTPUT, ATTNX_DR_DS0},
};

PyObject *attnx_py_delta_rule_backward(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dout", "q", "k", "v", "beta", "g_scalar", "g_channel",
                               "initial_state", "grad_state", "scale", "l2norm", "chunk", NULL};
    PyObject *objs[B_NPARAMS] = {NULL}, *scale_obj = NULL, *chunk_obj = NULL, *ret = NULL;
    int l2norm = 0;
    double scale;
    Py_ssize_t chunk;
    objs[B_GS] = objs[B_GC] = objs[B_S0] = objs[B_DS1] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|$OOOOOpO:delta_rule_backward",
                                     keywords, &objs[B_DOUT], &objs[B_Q], &objs[B_K], &objs[B_V],
                                     &objs[B_BETA], &objs[B_GS], &objs[B_GC], &objs[B_S0],
                                     &objs[B_DS1], &scale_obj, &l2norm, &chunk_obj) ||
        scale_and_chunk("delta_rule_backward", scale_obj, chunk_obj, &scale, &chunk) < 0)
        return NULL;
    if (check_options(scale, chunk) < 0) return NULL;
    if (objs[B_GS] != Py_None && objs[B_GC] != Py_None) {
        PyErr_SetString(PyExc_ValueError, "give g as g_scalar or g_channel, not both");
        return NULL;
    }
    objs[B_DQ] = objs[B_DK] = objs[B_DV] = objs[B_DBETA] = objs[B_DS0] = Py_None;
    objs[B_DGS] = objs[B_GS] != Py_None ? Py_None : NULL;
    objs[B_DGC] = objs[B_GC] != Py_None ? Py_None : NULL;
    attnx_call call;
    attnx_call_init(&call, backward_params, B_NPARAMS, ATTNX_DR_NOPS, "nde");
    if (attnx_bind(&call, objs) < 0) goto done;
    npy_intp n = attnx_size(&call, 'n'), d = attnx_size(&call, 'd'), e = attnx_size(&call, 'e');
    int gate = call.ops[B_GC].array ? ATTNX_GATE_CHANNEL
                                    : call.ops[B_GS].array ? ATTNX_GATE_SCALAR : ATTNX_GATE_NONE;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    double flops = 12.0 * (double)call.batch.heads * (double)n * (double)(d * e + chunk * (d + e));
    PyArrayObject *S0_array = call.ops[B_S0].array, *dS1_array = call.ops[B_DS1].array;
    attnx_delta_args kargs = {
        .n = n, .dk = d, .dv = e, .heads = call.batch.heads, .offsets = call.offsets,
        .q = attnx_data(&call, B_Q), .k = attnx_data(&call, B_K), .v = attnx_data(&call, B_V),
        .beta = attnx_data(&call, B_BETA),
        .g = gate == ATTNX_GATE_CHANNEL ? attnx_data(&call, B_GC) : attnx_data(&call, B_GS),
        .S0 = attnx_data(&call, B_S0),
        .dout = attnx_data(&call, B_DOUT), .dS1 = attnx_data(&call, B_DS1),
        .dq = attnx_data(&call, B_DQ), .dk_ = attnx_data(&call, B_DK),
        .dv_ = attnx_data(&call, B_DV), .dbeta = attnx_data(&call, B_DBETA),
        .dg = gate == ATTNX_GATE_CHANNEL ? attnx_data(&call, B_DGC) : attnx_data(&call, B_DGS),
        .dS0 = attnx_data(&call, B_DS0),
        .q_row = attnx_row_stride(call.ops[B_Q].array),
        .k_row = attnx_row_stride(call.ops[B_K].array),
        .v_row = attnx_row_stride(call.ops[B_V].array),
        .dout_row = attnx_row_stride(call.ops[B_DOUT].array),
        .g_row = gate == ATTNX_GATE_CHANNEL ? attnx_row_stride(call.ops[B_GC].array) : 0,
        .S0_row = S0_array ? attnx_row_stride(S0_array) : e,
        .dS1_row = dS1_array ? attnx_row_stride(dS1_array) : e,
        .beta_step = attnx_core_stride(&call, B_BETA, -1),
        .g_step = attnx_core_stride(&call, B_GS, -1),
        .gate = gate, .l2norm = l2norm, .scale = scale, .recurrent = 0, .chunk = chunk,
        .num_threads = attnx_get_num_threads(),
        .interrupt = flops >= INTERRUPTIBLE_FLOPS ? &interrupt : NULL,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = delta_bwd_kernels[call.dtypes.compute == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    PyObject *dg = gate == ATTNX_GATE_CHANNEL ? (PyObject *)call.results[B_DGC]
                   : gate == ATTNX_GATE_SCALAR ? (PyObject *)call.results[B_DGS] : Py_None;
    ret = Py_BuildValue("OOOOOO", call.results[B_DQ], call.results[B_DK], call.results[B_DV],
                        call.results[B_DBETA], dg, call.results[B_DS0]);
done:
    attnx_call_release(&call);
    return ret;
}

const char attnx_delta_rule_doc[] = (
"delta_rule(q, k, v, beta, *, g_scalar=None, g_channel=None, initial_state=None, out=None, want_state=False, in_place=False, scale, l2norm=False, recurrent, chunk)\n"
"--\n\n"
"The kernel behind attnx.delta_rule_attention (options by keyword; use the\n"
"front end). Returns out, or (out, state) with want_state; with\n"
"in_place, initial_state is the state, updated where it lies.");

const char attnx_delta_rule_backward_doc[] = (
"delta_rule_backward(dout, q, k, v, beta, *, g_scalar=None, g_channel=None, initial_state=None, grad_state=None, scale, l2norm=False, chunk)\n"
"--\n\n"
"The kernel behind attnx.delta_rule_attention_backward. Returns\n"
"(dq, dk, dv, dbeta, dg or None, dstate) on the broadcast batch shape.");

/* _C.causal_conv1d_update(x, state, weight, bias, *, silu): the private kernel
 * behind attnx.torch's causal_conv1d_update (attnx/_torch_delta.py, which
 * checks devices and dtypes first): x (B, D, L) any strides, state (B, D, W)
 * C order updated in place, weight (D, W) C order, bias (D,) or None, one
 * float dtype. Returns out (B, D, L). */
PyObject *attnx_py_causal_conv1d_update(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"x", "state", "weight", "bias", "silu", NULL};
    PyArrayObject *x, *state, *weight;
    PyObject *bias_obj = Py_None;
    int silu = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!|O$p:causal_conv1d_update", keywords,
                                     &PyArray_Type, &x, &PyArray_Type, &state, &PyArray_Type,
                                     &weight, &bias_obj, &silu))
        return NULL;
    PyArrayObject *bias = NULL;
    if (bias_obj != Py_None) {
        if (!PyArray_Check(bias_obj)) {
            PyErr_SetString(PyExc_TypeError, "bias must be an array or None");
            return NULL;
        }
        bias = (PyArrayObject *)bias_obj;
    }
    int type = PyArray_TYPE(x);
    if ((type != NPY_FLOAT32 && type != NPY_FLOAT64) || PyArray_TYPE(state) != type ||
        PyArray_TYPE(weight) != type || (bias && PyArray_TYPE(bias) != type)) {
        PyErr_SetString(PyExc_TypeError, "x, state, weight and bias must share one dtype, "
                                         "float32 or float64");
        return NULL;
    }
    if (PyArray_NDIM(x) != 3 || PyArray_NDIM(state) != 3 || PyArray_NDIM(weight) != 2 ||
        (bias && PyArray_NDIM(bias) != 1)) {
        PyErr_SetString(PyExc_ValueError, "x must be (B, D, L), state (B, D, W), weight (D, W), "
                                          "bias (D,)");
        return NULL;
    }
    npy_intp B = PyArray_DIM(x, 0), D = PyArray_DIM(x, 1), L = PyArray_DIM(x, 2);
    npy_intp W = PyArray_DIM(state, 2);
    if (PyArray_DIM(state, 0) != B || PyArray_DIM(state, 1) != D || PyArray_DIM(weight, 0) != D ||
        PyArray_DIM(weight, 1) != W || (bias && PyArray_DIM(bias, 0) != D)) {
        PyErr_SetString(PyExc_ValueError, "x (B, D, L), state (B, D, W), weight (D, W) and bias "
                                          "(D,) do not match");
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(state) || !PyArray_ISWRITEABLE(state) ||
        !PyArray_IS_C_CONTIGUOUS(weight) || (bias && !PyArray_IS_C_CONTIGUOUS(bias)) ||
        !PyArray_ISALIGNED(x) || !PyArray_ISNOTSWAPPED(x)) {
        PyErr_SetString(PyExc_ValueError, "state must be a writeable C-contiguous array, weight "
                                          "and bias C-contiguous, x aligned");
        return NULL;
    }
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(3, PyArray_DIMS(x), type);
    if (!out) return NULL;
    npy_intp item = PyArray_ITEMSIZE(x);
    ptrdiff_t x_stride[3] = {PyArray_STRIDE(x, 0) / item, PyArray_STRIDE(x, 1) / item,
                             PyArray_STRIDE(x, 2) / item};
    const void *bias_data = bias ? PyArray_DATA(bias) : NULL;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT32)
        attnx_conv1d_update_f32(B, D, L, W, PyArray_DATA(x), x_stride, PyArray_DATA(state),
                                PyArray_DATA(weight), bias_data, silu, PyArray_DATA(out));
    else
        attnx_conv1d_update_f64(B, D, L, W, PyArray_DATA(x), x_stride, PyArray_DATA(state),
                                PyArray_DATA(weight), bias_data, silu, PyArray_DATA(out));
    Py_END_ALLOW_THREADS
    return (PyObject *)out;
}

const char attnx_causal_conv1d_update_doc[] = (
"causal_conv1d_update(x, state, weight, bias=None, *, silu=False)\n"
"--\n\n"
"The kernel behind attnx.torch.causal_conv1d_update: the depthwise causal\n"
"conv1d's decoding step, state updated in place. Returns out (B, D, L).");
