/* py_linear_backward.c - the Python entry of the kernelised family's
 * backward: convert, validate the arrays, allocate the gradients, release
 * the GIL, call linear.c (attnx_linear_bwd).
 *
 * _C.linear_attention_backward takes every option positionally, already
 * resolved by attnx/_linear_grad.py (feature map and method as their
 * ATTNX_* numbers, cosFormer's M and the streaming offset as numbers); it
 * returns the gradients on the broadcast batch shape, which the Python
 * side reduces to each input's shape. */
#include "args.h"

#include <limits.h>
#include "bindings.h"

typedef int (*linear_bwd_kernel)(const attnx_linear_bwd_args *);
static const linear_bwd_kernel linear_bwd_kernels[2] = {attnx_linear_bwd_f32, attnx_linear_bwd_f64};

/* Chunk length of the backward's chunk method: causal, its blocks are GEMMs
 * of C rows against r and e columns plus C x C blocks, which cost as much
 * as the state's products at C = r = e = 64; measured (one thread, float32,
 * 8 heads, n = 4096, d = e = 64, CPU time of a loaded machine) 37.9, 39.4,
 * 45.1 ms at C = 16, 32, 64. Non-causal there is no C x C block, and longer
 * blocks run the GEMMs faster: 25.3, 21.3, 20.9 ms at C = 32, 128, 256. */
#define DEFAULT_BACKWARD_CHUNK 32
#define DEFAULT_NONCAUSAL_BACKWARD_CHUNK 128

/* The array arguments, in the order of ops[] below. */
enum { DOUT, Q, K, V, KEY_MASK, MASK, S0, Z0, DS_IN, DZ_IN, NOPS };

/* attnx_check_core with a formatted explanation (when the operand exists) */
static int check_size(const attnx_operand *op, int axis, npy_intp size, int broadcast_ok,
                      const char *format, npy_intp x, npy_intp y)
{
    if (!op->array) return 0;
    char what[200];
    PyOS_snprintf(what, sizeof what, format, (long)x, (long)y);
    return attnx_check_core(op, axis, size, broadcast_ok, what);
}

static int check_shapes(const attnx_operand *ops, npy_intp n, npy_intp m, npy_intp d, npy_intp e,
                        npy_intp r)
{
    npy_intp m_k = PyArray_DIM(ops[K].array, PyArray_NDIM(ops[K].array) - 2);
    const char *state = "expected (..., r, e) = (..., %ld, %ld): r features of this feature map, "
                        "e value features";
    const char *state_z = "expected (..., r) = (..., %ld): r features of this feature map";
    if (check_size(&ops[K], -1, d, 0, "expected (..., m, d) with d = %ld from q (..., n, d)", d, 0) < 0 ||
        check_size(&ops[V], -2, m_k, 0, "expected (..., m, e) with m = %ld keys from k (..., m, d)", m_k, 0) < 0 ||
        check_size(&ops[DOUT], -2, n, 0, "expected (..., n, e) = (..., %ld, %ld), the shape of the output", n, e) < 0 ||
        check_size(&ops[DOUT], -1, e, 0, "expected (..., n, e) = (..., %ld, %ld), the shape of the output", n, e) < 0 ||
        check_size(&ops[KEY_MASK], -1, m, 1, "expected a boolean (..., m) with m = %ld keys", m, 0) < 0 ||
        check_size(&ops[MASK], -1, m, 1, "expected to broadcast to (..., n, m) = (..., %ld, %ld)", n, m) < 0 ||
        check_size(&ops[MASK], -2, n, 1, "expected to broadcast to (..., n, m) = (..., %ld, %ld)", n, m) < 0 ||
        check_size(&ops[S0], -2, r, 0, state, r, e) < 0 || check_size(&ops[S0], -1, e, 0, state, r, e) < 0 ||
        check_size(&ops[Z0], -1, r, 0, state_z, r, 0) < 0 ||
        check_size(&ops[DS_IN], -2, r, 0, state, r, e) < 0 ||
        check_size(&ops[DS_IN], -1, e, 0, state, r, e) < 0 ||
        check_size(&ops[DZ_IN], -1, r, 0, state_z, r, 0) < 0)
        return -1;
    if (d > INT_MAX || e > INT_MAX || m > INT_MAX || r > INT_MAX || n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "q, k, v: sequence and feature sizes must be below 2**31");
        return -1;
    }
    return 0;
}

/* favor's projection W (r, d) in the compute dtype; r of the other maps */
static int feature_size(int kind, PyObject *projection_obj, npy_intp d, int typenum,
                        PyArrayObject **projection, npy_intp *r)
{
    *projection = NULL;
    if (kind != ATTNX_FM_FAVOR) {
        *r = kind == ATTNX_FM_TAYLOR ? d + 1 : kind == ATTNX_FM_COSFORMER ? 2 * d : d;
        return 0;
    }
    if (projection_obj == Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "feature_map='favor' needs projection=, the (r, d) array of the forward call");
        return -1;
    }
    const char *const name[] = {"projection"};
    attnx_dtypes real;  /* only to refuse complex and object projections */
    if (attnx_resolve_dtypes(&projection_obj, name, 1, &real) < 0) return -1;
    *projection = (PyArrayObject *)PyArray_FROM_OTF(projection_obj, typenum,
                                                    NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED |
                                                    NPY_ARRAY_FORCECAST);
    if (!*projection) return -1;
    if (PyArray_NDIM(*projection) != 2 || PyArray_DIM(*projection, 1) != d) {
        PyObject *shape = PyObject_GetAttrString((PyObject *)*projection, "shape");
        if (shape)
            PyErr_Format(PyExc_ValueError, "projection must have shape (r, d) = (r, %ld), got %R",
                         (long)d, shape);
        Py_XDECREF(shape);
        Py_CLEAR(*projection);
        return -1;
    }
    *r = PyArray_DIM(*projection, 0);
    return 0;
}

/* The gradient array batch + shape: `given` itself when it is exactly that
 * (a C-ordered, writeable array of the compute dtype and the broadcast
 * shape, sharing no memory with the inputs), else a new one, which the
 * caller reduces and copies into `given`. */
static PyArrayObject *gradient_array(PyObject *given, const attnx_batch *batch,
                                     const npy_intp *shape, int typenum, const char *name,
                                     const attnx_operand *inputs, int n_inputs)
{
    if (given != Py_None && PyArray_Check(given)) {
        PyArrayObject *array = (PyArrayObject *)given;
        int fits = PyArray_TYPE(array) == typenum && PyArray_IS_C_CONTIGUOUS(array) &&
                   PyArray_ISWRITEABLE(array) && PyArray_ISALIGNED(array) &&
                   PyArray_NDIM(array) == batch->ndim + 2;
        for (int ax = 0; fits && ax < batch->ndim; ax++) fits = PyArray_DIM(array, ax) == batch->shape[ax];
        for (int ax = 0; fits && ax < 2; ax++) fits = PyArray_DIM(array, batch->ndim + ax) == shape[ax];
        if (fits) {
            if (attnx_check_disjoint(array, name, inputs, n_inputs) < 0) return NULL;
            Py_INCREF(array);
            return array;
        }
    }
    return attnx_new_array(batch, shape, 2, typenum);
}

static int convert_optional(attnx_operand *op, PyObject *obj, int typenum, int min_ndim)
{
    return obj == Py_None ? 0 : attnx_operand_convert(op, obj, typenum, min_ndim, 0);
}

PyObject *attnx_py_linear_attention_backward(PyObject *self, PyObject *args)
{
    PyObject *dout_obj, *q_obj, *k_obj, *v_obj, *causal_obj, *key_mask, *mask, *window_obj,
        *projection_obj, *S0_obj, *z0_obj, *dS_obj, *dz_obj, *dq_obj, *dk_obj, *dv_obj;
    int kind, method, projection_grad;
    Py_ssize_t chunk, offset;
    double eps, power, period;
    if (!PyArg_ParseTuple(args, "OOOOiOOOOindddOOOOOnpOOO:linear_attention_backward", &dout_obj,
                          &q_obj, &k_obj, &v_obj, &kind, &causal_obj, &key_mask, &mask,
                          &window_obj, &method, &chunk, &eps, &power, &period, &projection_obj,
                          &S0_obj, &z0_obj, &dS_obj, &dz_obj, &offset, &projection_grad, &dq_obj,
                          &dk_obj, &dv_obj))
        return NULL;
    if (kind < ATTNX_FM_ELU || kind > ATTNX_FM_EFFICIENT || method < ATTNX_METHOD_CHUNK ||
        method > ATTNX_METHOD_QUADRATIC || chunk < 0 || offset < 0 || !(eps >= 0)) {
        PyErr_SetString(PyExc_ValueError, "linear_attention_backward: option out of range");
        return NULL;
    }
    attnx_operand ops[NOPS] = {
        [DOUT] = {"dout", NULL, 2}, [Q] = {"q", NULL, 2}, [K] = {"k", NULL, 2},
        [V] = {"v", NULL, 2}, [KEY_MASK] = {"key_mask", NULL, 1}, [MASK] = {"mask", NULL, 2},
        [S0] = {"initial_state.S", NULL, 2}, [Z0] = {"initial_state.z", NULL, 1},
        [DS_IN] = {"grad_state S", NULL, 2}, [DZ_IN] = {"grad_state z", NULL, 1},
    };
    enum { DQ, DK, DV, DS0, DZ0, NOUTS };
    attnx_operand outs[NOUTS] = {{"dq", NULL, 2}, {"dk", NULL, 2}, {"dv", NULL, 2},
                                 {"dS", NULL, 2}, {"dz", NULL, 1}};
    PyArrayObject *projection = NULL, *dW = NULL;
    ptrdiff_t *offsets = NULL;
    PyObject *ret = NULL;
    int causal, has_left, has_right;
    npy_intp left, right;
    if (attnx_parse_causal(causal_obj, &causal) < 0 ||
        attnx_parse_window(window_obj, &has_left, &left, &has_right, &right) < 0)
        return NULL;

    PyObject *const dtype_objs[] = {q_obj, k_obj, v_obj};
    const char *const dtype_names[] = {"q", "k", "v"};
    attnx_dtypes dtypes;
    if (attnx_resolve_dtypes(dtype_objs, dtype_names, 3, &dtypes) < 0) return NULL;
    int typenum = dtypes.compute;
    if (attnx_operand_convert(&ops[Q], q_obj, typenum, 2, 0) < 0 ||
        attnx_operand_convert(&ops[K], k_obj, typenum, 2, 0) < 0 ||
        attnx_operand_convert(&ops[V], v_obj, typenum, 2, 0) < 0 ||
        attnx_operand_convert(&ops[DOUT], dout_obj, typenum, 2, 0) < 0 ||
        (key_mask != Py_None && attnx_mask_convert(&ops[KEY_MASK], key_mask) < 0) ||
        (mask != Py_None && attnx_mask_convert(&ops[MASK], mask) < 0) ||
        convert_optional(&ops[S0], S0_obj, typenum, 2) < 0 ||
        convert_optional(&ops[Z0], z0_obj, typenum, 1) < 0 ||
        convert_optional(&ops[DS_IN], dS_obj, typenum, 2) < 0 ||
        convert_optional(&ops[DZ_IN], dz_obj, typenum, 1) < 0)
        goto done;
    if (!ops[S0].array != !ops[Z0].array || !ops[DS_IN].array != !ops[DZ_IN].array) {
        PyErr_SetString(PyExc_ValueError, "a state needs both S and z");
        goto done;
    }

    int nd_q = PyArray_NDIM(ops[Q].array), nd_v = PyArray_NDIM(ops[V].array);
    npy_intp n = PyArray_DIM(ops[Q].array, nd_q - 2), d = PyArray_DIM(ops[Q].array, nd_q - 1);
    npy_intp m = PyArray_DIM(ops[V].array, nd_v - 2), e = PyArray_DIM(ops[V].array, nd_v - 1), r;
    if (feature_size(kind, projection_obj, d, typenum, &projection, &r) < 0 ||
        check_shapes(ops, n, m, d, e, r) < 0)
        goto done;

    if (method == ATTNX_METHOD_CUMSUM) {
        double bytes = ((double)m + 1) * (double)r * ((double)e + 1) * (typenum == NPY_FLOAT ? 4 : 8);
        if (bytes > (double)ATTNX_CUMSUM_LIMIT) {
            char message[240];  /* PyErr_Format has no %f */
            PyOS_snprintf(message, sizeof message,
                          "method='cumsum' materialises m + 1 = %ld prefix states of r x (e + 1) = "
                          "%ld x %ld numbers: %.2f GiB per head, above its %.0f GiB limit; use "
                          "method='chunk'", (long)(m + 1), (long)r, (long)(e + 1),
                          bytes / (1 << 30), (double)ATTNX_CUMSUM_LIMIT / (1 << 30));
            PyErr_SetString(PyExc_ValueError, message);
            goto done;
        }
    }

    attnx_batch batch;
    if (attnx_broadcast(ops, NOPS, &batch) < 0) goto done;
    npy_intp q_shape[2] = {n, d}, k_shape[2] = {m, d}, v_shape[2] = {m, e}, S_shape[2] = {r, e};
    if (!(outs[DQ].array = gradient_array(dq_obj, &batch, q_shape, typenum, "dq", ops, NOPS)) ||
        !(outs[DK].array = gradient_array(dk_obj, &batch, k_shape, typenum, "dk", ops, NOPS)) ||
        !(outs[DV].array = gradient_array(dv_obj, &batch, v_shape, typenum, "dv", ops, NOPS)))
        goto done;
    if (ops[S0].array && (!(outs[DS0].array = attnx_new_array(&batch, S_shape, 2, typenum)) ||
                          !(outs[DZ0].array = attnx_new_array(&batch, S_shape, 1, typenum))))
        goto done;
    if (projection_grad) {
        if (kind != ATTNX_FM_FAVOR) {
            PyErr_SetString(PyExc_ValueError, "projection_grad=True needs feature_map='favor'");
            goto done;
        }
        npy_intp W_shape[2] = {r, d};
        if (!(dW = (PyArrayObject *)PyArray_ZEROS(2, W_shape, typenum, 0))) goto done;
    }

    /* operand order of the kernel's offset table */
    attnx_operand table[ATTNX_LINB_NOPS] = {
        [ATTNX_LINB_Q] = ops[Q], [ATTNX_LINB_K] = ops[K], [ATTNX_LINB_V] = ops[V],
        [ATTNX_LINB_DOUT] = ops[DOUT], [ATTNX_LINB_KEY_MASK] = ops[KEY_MASK],
        [ATTNX_LINB_MASK] = ops[MASK], [ATTNX_LINB_S0] = ops[S0], [ATTNX_LINB_Z0] = ops[Z0],
        [ATTNX_LINB_DS_IN] = ops[DS_IN], [ATTNX_LINB_DZ_IN] = ops[DZ_IN],
        [ATTNX_LINB_DQ] = outs[DQ], [ATTNX_LINB_DK] = outs[DK], [ATTNX_LINB_DV] = outs[DV],
        [ATTNX_LINB_DS0] = outs[DS0], [ATTNX_LINB_DZ0] = outs[DZ0],
    };
    /* attnx_offsets takes at most ATTNX_MAX_OPS operands: the inputs' and
     * the gradients' tables are made apart and interleaved */
    enum { IN_OPS = ATTNX_LINB_DQ, OUT_OPS = ATTNX_LINB_NOPS - ATTNX_LINB_DQ };
    ptrdiff_t *in_offsets = attnx_offsets(table, IN_OPS, &batch);
    ptrdiff_t *out_offsets = in_offsets ? attnx_offsets(table + IN_OPS, OUT_OPS, &batch) : NULL;
    offsets = out_offsets ? PyMem_RawMalloc(sizeof(ptrdiff_t) * ATTNX_LINB_NOPS *
                                            (size_t)(batch.heads ? batch.heads : 1))
                          : NULL;
    if (offsets)
        for (ptrdiff_t h = 0; h < batch.heads; h++) {
            memcpy(offsets + h * ATTNX_LINB_NOPS, in_offsets + h * IN_OPS, sizeof(ptrdiff_t) * IN_OPS);
            memcpy(offsets + h * ATTNX_LINB_NOPS + IN_OPS, out_offsets + h * OUT_OPS,
                   sizeof(ptrdiff_t) * OUT_OPS);
        }
    else if (out_offsets)
        PyErr_NoMemory();
    PyMem_RawFree(in_offsets);
    PyMem_RawFree(out_offsets);
    if (!offsets) goto done;

    npy_intp longest = n > m ? n : m;
    if (chunk == 0)
        chunk = method == ATTNX_METHOD_CHUNK && !causal ? DEFAULT_NONCAUSAL_BACKWARD_CHUNK
                                                        : DEFAULT_BACKWARD_CHUNK;
    if (chunk > longest) chunk = longest > 0 ? longest : 1;
#define DATA(op) ((op).array ? PyArray_DATA((op).array) : NULL)
    attnx_linear_bwd_args kargs = {
        .n = n, .m = m, .d = d, .e = e, .heads = batch.heads, .offsets = offsets,
        .q = DATA(ops[Q]), .k = DATA(ops[K]), .v = DATA(ops[V]), .dout = DATA(ops[DOUT]),
        .key_mask = DATA(ops[KEY_MASK]), .mask = DATA(ops[MASK]),
        .S0 = DATA(ops[S0]), .z0 = DATA(ops[Z0]), .dS_in = DATA(ops[DS_IN]), .dz_in = DATA(ops[DZ_IN]),
        .dq = DATA(outs[DQ]), .dk = DATA(outs[DK]), .dv = DATA(outs[DV]),
        .dS0 = DATA(outs[DS0]), .dz0 = DATA(outs[DZ0]), .dW = dW ? PyArray_DATA(dW) : NULL,
        .q_row = attnx_row_stride(ops[Q].array), .k_row = attnx_row_stride(ops[K].array),
        .v_row = attnx_row_stride(ops[V].array), .dout_row = attnx_row_stride(ops[DOUT].array),
        .S0_row = ops[S0].array ? attnx_row_stride(ops[S0].array) : e,
        .dS_in_row = ops[DS_IN].array ? attnx_row_stride(ops[DS_IN].array) : e,
        .key_mask_col = ops[KEY_MASK].array ? attnx_operand_core_stride(&ops[KEY_MASK], -1) : 0,
        .mask_row = ops[MASK].array ? attnx_operand_core_stride(&ops[MASK], -2) : 0,
        .mask_col = ops[MASK].array ? attnx_operand_core_stride(&ops[MASK], -1) : 0,
        .features = {.kind = kind, .d = d, .r = r, .power = power,
                     .projection = projection ? PyArray_DATA(projection) : NULL,
                     .period = period, .first_position = offset},
        .band = method == ATTNX_METHOD_QUADRATIC
                    ? attnx_make_band(n, m, causal, has_left, left, has_right, right)
                    : attnx_make_band(n, m, causal, 0, 0, 0, 0),
        .method = method,
        .chunk = chunk,
        .eps = eps,
        .num_threads = attnx_get_num_threads(),
    };
#undef DATA
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = linear_bwd_kernels[typenum == NPY_DOUBLE](&kargs);
    Py_END_ALLOW_THREADS
    if (attnx_check_status(status) < 0) goto done;
    ret = Py_BuildValue("OOOOOO", outs[DQ].array, outs[DK].array, outs[DV].array,
                        dW ? (PyObject *)dW : Py_None,
                        outs[DS0].array ? (PyObject *)outs[DS0].array : Py_None,
                        outs[DZ0].array ? (PyObject *)outs[DZ0].array : Py_None);
done:
    PyMem_RawFree(offsets);
    Py_XDECREF(projection);
    Py_XDECREF(dW);
    attnx_release(outs, NOUTS);
    attnx_release(ops, NOPS);
    return ret;
}

const char attnx_linear_attention_backward_doc[] = (
"linear_attention_backward(dout, q, k, v, kind, causal, key_mask, mask, window, method, chunk, eps, power, period, projection, S0, z0, dS, dz, offset, projection_grad, dq, dk, dv)\n"
"--\n\n"
"The kernel behind attnx.linear_attention_backward and the other kernelised\n"
"backward functions (options already resolved; use those). Returns\n"
"(dq, dk, dv, dW, dS0, dz0) on the broadcast batch shape; dq, dk, dv are\n"
"written in place when they have exactly that shape (else None or ignored).");
