/* py_lsh.c - Python entry of Reformer's LSH attention (lsh.c): parse,
 * validate, allocate, release the GIL, call the kernel. The rotations are
 * drawn from the seed by the public functions (attnx/_lsh.py), which also
 * reduce the per-head gradients to the inputs' shapes. */
#include "args.h"

#include <math.h>
#include "bindings.h"

typedef int (*lsh_kernel)(const attnx_lsh_args *);
static const lsh_kernel lsh_fwd_kernels[2] = {attnx_lsh_fwd_f32, attnx_lsh_fwd_f64};
static const lsh_kernel lsh_bwd_kernels[2] = {attnx_lsh_bwd_f32, attnx_lsh_bwd_f64};
typedef int (*lsh_buckets_kernel)(const attnx_lsh_args *, int32_t *);
static const lsh_buckets_kernel lsh_buckets_kernels[2] = {attnx_lsh_buckets_f32,
                                                          attnx_lsh_buckets_f64};

/* Symbols: n tokens, d, e features, h rounds, b buckets / 2. */
static const char lsh_legend[] = "h is n_hashes, b is n_buckets / 2";

/* The array arguments of the three entries, one index space (make_args
 * reads whichever a call has); an entry a call does not take stays empty,
 * which attnx_bind skips. */
enum { Q, V, ROT, OUT, LSE, DOUT, OUT_IN, LSE_IN, DQ, DV, NPARAMS };
#define LSH_Q [Q] = {"q", "n d", ATTNX_COMPUTE, ATTNX_LSH_Q}
#define LSH_V [V] = {"v", "n e", ATTNX_COMPUTE, ATTNX_LSH_V}
/* the rotations have no batch axes: every head hashes with the same */
#define LSH_ROT [ROT] = {"rotations", "h d b", 0, -1}
static const attnx_param forward_params[NPARAMS] = {
    LSH_Q, LSH_V, LSH_ROT,
    [OUT] = {"out", "n e", ATTNX_OUTPUT | ATTNX_RESULT_DTYPE, ATTNX_LSH_OUT},
    [LSE] = {"lse", "n", ATTNX_OUTPUT, ATTNX_LSH_LSE},
};
static const attnx_param backward_params[NPARAMS] = {
    LSH_Q, LSH_V, LSH_ROT,
    [DOUT] = {"dout", "n e", ATTNX_REQUIRED, ATTNX_LSH_DOUT},
    [OUT_IN] = {"out", "n e", ATTNX_REQUIRED, ATTNX_LSH_OUT},
    [LSE_IN] = {"lse", "n", ATTNX_REQUIRED, ATTNX_LSH_LSE},
    [DQ] = {"dq", "n d", ATTNX_OUTPUT, ATTNX_LSH_DQ},
    [DV] = {"dv", "n e", ATTNX_OUTPUT, ATTNX_LSH_DV},
};
static const attnx_param buckets_params[NPARAMS] = {LSH_Q, LSH_ROT};

/* chunk (an int >= 1) and causal; -1 with an exception */
static int parse_options(PyObject *chunk_obj, PyObject *causal_obj, Py_ssize_t *chunk, int *causal)
{
    if (PyBool_Check(chunk_obj) || !PyLong_Check(chunk_obj)) {
        PyErr_Format(PyExc_TypeError, "chunk must be an integer, got %R", chunk_obj);
        return -1;
    }
    *chunk = PyLong_AsSsize_t(chunk_obj);
    if (*chunk == -1 && PyErr_Occurred()) return -1;
    if (*chunk < 1) {
        PyErr_Format(PyExc_ValueError, "chunk must be at least 1, got %zd", *chunk);
        return -1;
    }
    return attnx_parse_causal(causal_obj, causal);
}

/* The operands of a bound call (which of the params it has), the sizes
 * and options in place. */
static attnx_lsh_args make_args(const attnx_call *call, Py_ssize_t chunk, int causal,
                                attnx_interrupt *interrupt)
{
    npy_intp n = attnx_size(call, 'n'), d = attnx_size(call, 'd');
    PyArrayObject *rot = call->ops[ROT].array;
    npy_intp itemsize = call->dtypes.compute == NPY_FLOAT ? 4 : 8;
    attnx_lsh_args a = {
        .n = n, .d = d, .e = call->ops[V].array || call->ops[DOUT].array ? attnx_size(call, 'e') : 0,
        .heads = call->batch.heads,
        .offsets = call->offsets,
        .q = attnx_data(call, Q), .v = attnx_data(call, V),
        .rotations = PyArray_DATA(rot),
        .rot_hash = attnx_core_stride(call, ROT, -3) / itemsize,
        .rot_row = attnx_row_stride(rot),
        .n_hashes = attnx_size(call, 'h'), .half = attnx_size(call, 'b'),
        .chunk = chunk < n ? chunk : (n > 0 ? n : 1),
        .causal = causal != 0,
        .scale = d > 0 ? 1 / sqrt((double)d) : 1,
        .out = attnx_data(call, OUT), .lse = attnx_data(call, LSE),
        .dout = attnx_data(call, DOUT), .out_in = attnx_data(call, OUT_IN),
        .lse_in = attnx_data(call, LSE_IN),
        .dq = attnx_data(call, DQ), .dv = attnx_data(call, DV),
        .num_threads = attnx_get_num_threads(),
        .interrupt = interrupt,
    };
    a.q_row = attnx_row_stride(call->ops[Q].array);
    if (call->ops[V].array) a.v_row = attnx_row_stride(call->ops[V].array);
    if (call->ops[OUT].array) a.out_row = attnx_row_stride(call->ops[OUT].array);
    if (call->ops[OUT_IN].array) a.out_row = attnx_row_stride(call->ops[OUT_IN].array);
    if (call->ops[DOUT].array) a.dout_row = attnx_row_stride(call->ops[DOUT].array);
    if (call->ops[DQ].array) a.dq_row = attnx_row_stride(call->ops[DQ].array);
    if (call->ops[DV].array) a.dv_row = attnx_row_stride(call->ops[DV].array);
    return a;
}

/* the hashing's sizes the kernels index with int32: rounds x buckets */
static int check_hash_sizes(const attnx_call *call)
{
    npy_intp H = attnx_size(call, 'h'), half = attnx_size(call, 'b');
    if (H < 1 || half < 1) {
        PyErr_Format(PyExc_ValueError, "rotations must have shape (n_hashes, d, n_buckets / 2) "
                     "with n_hashes >= 1 and n_buckets >= 2, got n_hashes = %zd, n_buckets = %zd",
                     (Py_ssize_t)H, (Py_ssize_t)(2 * half));
        return -1;
    }
    if (half > INT32_MAX / 2 || H > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "n_buckets and n_hashes must be below 2**31");
        return -1;
    }
    return 0;
}

/* _C.lsh_attention(q, v, rotations, *, chunk, causal, out) -> (out, lse) */
PyObject *attnx_py_lsh_attention(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"q", "v", "rotations", "chunk", "causal", "out", NULL};
    PyObject *objs[NPARAMS] = {NULL}, *chunk_obj = NULL, *causal_obj = Py_False, *ret = NULL;
    Py_ssize_t chunk;
    int causal;
    objs[OUT] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$OOO:lsh_attention", keywords,
                                     &objs[Q], &objs[V], &objs[ROT], &chunk_obj, &causal_obj,
                                     &objs[OUT]) ||
        attnx_required("lsh_attention", "chunk", chunk_obj) < 0)
        return NULL;
    if (parse_options(chunk_obj, causal_obj, &chunk, &causal) < 0) return NULL;
    attnx_call call;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    attnx_call_init(&call, forward_params, NPARAMS, ATTNX_LSH_NOPS, "ndehb");
    call.legend = lsh_legend;
    objs[LSE] = Py_None;
    if (attnx_bind(&call, objs) < 0 || check_hash_sizes(&call) < 0) goto done;
    attnx_lsh_args a = make_args(&call, chunk, causal, &interrupt);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = lsh_fwd_kernels[call.dtypes.compute == NPY_DOUBLE](&a);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    ret = PyTuple_Pack(2, (PyObject *)call.results[OUT], (PyObject *)call.results[LSE]);
done:
    attnx_call_release(&call);
    return ret;
}

/* _C.lsh_backward(dout, q, v, out, lse, rotations, *, chunk, causal) ->
 * (dq, dv), per head of the broadcast batch, in the compute dtype */
PyObject *attnx_py_lsh_backward(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"dout", "q", "v", "out", "lse", "rotations", "chunk", "causal",
                               NULL};
    PyObject *objs[NPARAMS] = {NULL}, *chunk_obj = NULL, *causal_obj = Py_False, *ret = NULL;
    Py_ssize_t chunk;
    int causal;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOO|$OO:lsh_backward", keywords,
                                     &objs[DOUT], &objs[Q], &objs[V], &objs[OUT_IN],
                                     &objs[LSE_IN], &objs[ROT], &chunk_obj, &causal_obj) ||
        attnx_required("lsh_backward", "chunk", chunk_obj) < 0)
        return NULL;
    if (parse_options(chunk_obj, causal_obj, &chunk, &causal) < 0) return NULL;
    attnx_call call;
    attnx_interrupt interrupt = attnx_interrupt_for_call();
    attnx_call_init(&call, backward_params, NPARAMS, ATTNX_LSH_NOPS, "ndehb");
    call.legend = lsh_legend;
    objs[DQ] = objs[DV] = Py_None;
    if (attnx_bind(&call, objs) < 0 || check_hash_sizes(&call) < 0) goto done;
    attnx_lsh_args a = make_args(&call, chunk, causal, &interrupt);
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = lsh_bwd_kernels[call.dtypes.compute == NPY_DOUBLE](&a);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0 || attnx_finish(&call) < 0) goto done;
    ret = PyTuple_Pack(2, (PyObject *)call.results[DQ], (PyObject *)call.results[DV]);
done:
    attnx_call_release(&call);
    return ret;
}

/* _C.lsh_buckets(q, rotations) -> int32 (..., n_hashes, n) */
PyObject *attnx_py_lsh_buckets(PyObject *self, PyObject *args)
{
    PyObject *objs[NPARAMS] = {NULL}, *ret = NULL;
    PyArrayObject *buckets = NULL;
    if (!PyArg_ParseTuple(args, "OO:lsh_buckets", &objs[Q], &objs[ROT])) return NULL;
    attnx_call call;
    attnx_call_init(&call, buckets_params, NPARAMS, ATTNX_LSH_NOPS, "ndhb");
    call.legend = lsh_legend;
    if (attnx_bind(&call, objs) < 0 || check_hash_sizes(&call) < 0) goto done;
    attnx_lsh_args a = make_args(&call, 1, 0, NULL);
    npy_intp trailing[2] = {a.n_hashes, a.n};
    buckets = attnx_new_array(&call.batch, trailing, 2, NPY_INT32);
    if (!buckets) goto done;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = lsh_buckets_kernels[call.dtypes.compute == NPY_DOUBLE](&a, PyArray_DATA(buckets));
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    ret = (PyObject *)buckets;
    buckets = NULL;
done:
    Py_XDECREF(buckets);
    attnx_call_release(&call);
    return ret;
}

const char attnx_lsh_attention_doc[] = (
"lsh_attention(q, v, rotations, *, chunk, causal=False, out=None)\n"
"--\n\n"
"Private: (out, lse) of Reformer's LSH attention with the given rotations\n"
"(n_hashes, d, n_buckets / 2); see attnx.lsh_attention.");

const char attnx_lsh_backward_doc[] = (
"lsh_backward(dout, q, v, out, lse, rotations, *, chunk, causal=False)\n"
"--\n\n"
"Private: per-head gradients (dq, dv) of LSH attention; see attnx.lsh_attention_backward.");

const char attnx_lsh_buckets_doc[] = (
"lsh_buckets(q, rotations)\n"
"--\n\n"
"Private: the int32 buckets (..., n_hashes, n) of q; see attnx.lsh_buckets.");
