/* args.c - argument conversion and validation shared by every front end. */
#include "args.h"

#include <limits.h>
#include <math.h>

static int is_supported_kind(char kind) { return kind == 'f' || kind == 'i' || kind == 'u' || kind == 'b'; }

int attnx_resolve_dtypes(PyObject *const *objs, const char *const *names, int count,
                         attnx_dtypes *dtypes)
{
    /* arrays all float32 or all float64 (the common call) need no promotion */
    int common = 0, all_same = 1;
    for (int i = 0; i < count && all_same; i++) {
        if (!objs[i] || objs[i] == Py_None) continue;
        int type = PyArray_Check(objs[i]) ? PyArray_TYPE((PyArrayObject *)objs[i]) : -1;
        all_same = (type == NPY_FLOAT || type == NPY_DOUBLE) && (!common || type == common);
        common = type;
    }
    if (all_same && common) {
        dtypes->compute = dtypes->result = common;
        return 0;
    }
    PyArray_Descr *descrs[ATTNX_MAX_OPS];
    int used = 0;
    for (int i = 0; i < count; i++) {
        if (!objs[i] || objs[i] == Py_None) continue;
        PyArray_Descr *descr = NULL;
        if (PyArray_Check(objs[i])) {
            descr = PyArray_DESCR((PyArrayObject *)objs[i]);
            Py_INCREF(descr);
        } else {
            PyArrayObject *tmp = (PyArrayObject *)PyArray_FROM_O(objs[i]);
            if (!tmp) goto error;
            descr = PyArray_DESCR(tmp);
            Py_INCREF(descr);
            Py_DECREF(tmp);
        }
        if (!is_supported_kind(descr->kind)) {
            PyErr_Format(PyExc_TypeError,
                         "%s must hold real numbers (float, int or bool), got dtype %R",
                         names[i], (PyObject *)descr);
            Py_DECREF(descr);
            goto error;
        }
        descrs[used++] = descr;
    }
    int result = NPY_DOUBLE;
    if (used > 0) {
        PyArray_Descr *common = PyArray_ResultType(0, NULL, used, descrs);
        if (!common) goto error;
        result = common->type_num;
        Py_DECREF(common);
    }
    if (result == NPY_HALF) {
        dtypes->compute = NPY_FLOAT;
        dtypes->result = NPY_HALF;
    } else if (result == NPY_FLOAT) {
        dtypes->compute = dtypes->result = NPY_FLOAT;
    } else {
        /* float64, long double, and every integer or bool mix */
        dtypes->compute = dtypes->result = NPY_DOUBLE;
    }
    for (int i = 0; i < used; i++) Py_DECREF(descrs[i]);
    return 0;
error:
    for (int i = 0; i < used; i++) Py_DECREF(descrs[i]);
    return -1;
}

ptrdiff_t attnx_row_stride(PyArrayObject *array)
{
    int nd = PyArray_NDIM(array);
    npy_intp cols = nd >= 1 ? PyArray_DIM(array, nd - 1) : 1;
    if (nd < 2 || PyArray_DIM(array, nd - 2) <= 1) return cols > 0 ? cols : 1;
    return PyArray_STRIDE(array, nd - 2) / PyArray_ITEMSIZE(array);
}

/* Can BLAS read the core matrix in place? */
static int layout_ok(PyArrayObject *array, int core_ndim)
{
    int nd = PyArray_NDIM(array);
    npy_intp itemsize = PyArray_ITEMSIZE(array);
    /* float sizes are powers of two: a mask, not a division per axis
     * (five arrays of four axes took a tenth of a decoding step's binding) */
    for (int ax = 0; ax < nd; ax++)
        if (PyArray_STRIDE(array, ax) & (itemsize - 1)) return 0;
    if (core_ndim == 0 || nd == 0) return 1;
    npy_intp cols = PyArray_DIM(array, nd - 1);
    if (cols > 1 && PyArray_STRIDE(array, nd - 1) != itemsize) return 0;
    if (core_ndim >= 2 && nd >= 2 && PyArray_DIM(array, nd - 2) > 1) {
        npy_intp row = PyArray_STRIDE(array, nd - 2) / itemsize;
        if (row < cols || row < 1 || row > INT_MAX) return 0;
    }
    return 1;
}

int attnx_operand_convert(attnx_operand *op, PyObject *obj, int typenum, int min_ndim,
                          int elementwise)
{
    int flags = NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED | (elementwise ? NPY_ARRAY_FORCECAST : 0);
    PyArrayObject *array;
    if (PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == typenum &&
        PyArray_ISALIGNED((PyArrayObject *)obj) && PyArray_ISNOTSWAPPED((PyArrayObject *)obj)) {
        /* what PyArray_FromAny would return, without its dtype discovery
         * (a fifth of a decoding step's binding) */
        array = (PyArrayObject *)obj;
        Py_INCREF(array);
    } else {
        array = (PyArrayObject *)PyArray_FromAny(obj, PyArray_DescrFromType(typenum), 0, 0, flags,
                                                 NULL);
    }
    if (!array) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyObject *type, *value, *tb;
            PyErr_Fetch(&type, &value, &tb);
            PyErr_Format(PyExc_TypeError, "%s: %S", op->name, value ? value : Py_None);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
        }
        return -1;
    }
    if (PyArray_NDIM(array) < min_ndim) {
        PyObject *shape = PyObject_GetAttrString((PyObject *)array, "shape");
        if (shape)
            PyErr_Format(PyExc_ValueError, "%s must have at least %d dimensions, got shape %R",
                         op->name, min_ndim, shape);
        Py_XDECREF(shape);
        Py_DECREF(array);
        return -1;
    }
    if (elementwise && PyArray_NDIM(array) < op->core_ndim) op->core_ndim = PyArray_NDIM(array);
    if (!layout_ok(array, elementwise ? 0 : op->core_ndim)) {
        PyArrayObject *copy = (PyArrayObject *)PyArray_NewCopy(array, NPY_CORDER);
        Py_DECREF(array);
        if (!copy) return -1;
        array = copy;
    }
    op->array = array;
    op->source = obj;
    return 0;
}

int attnx_mask_convert(attnx_operand *op, PyObject *obj)
{
    PyArrayObject *array = (PyArrayObject *)PyArray_FROM_O(obj);
    if (!array) return -1;
    if (PyArray_TYPE(array) != NPY_BOOL) {
        PyErr_Format(PyExc_TypeError, "%s must be a boolean array (True = may attend), got dtype %R",
                     op->name, (PyObject *)PyArray_DESCR(array));
        Py_DECREF(array);
        return -1;
    }
    op->core_ndim = PyArray_NDIM(array) < op->core_ndim ? PyArray_NDIM(array) : op->core_ndim;
    op->array = array;
    op->source = obj;
    return 0;
}

static npy_intp core_dim(const attnx_operand *op, int axis)
{
    int nd = PyArray_NDIM(op->array);
    return -axis <= op->core_ndim && nd + axis >= 0 ? PyArray_DIM(op->array, nd + axis) : 1;
}

ptrdiff_t attnx_core_stride(const attnx_operand *op, int axis)
{
    int nd = PyArray_NDIM(op->array);
    if (-axis > op->core_ndim || nd + axis < 0 || PyArray_DIM(op->array, nd + axis) == 1) return 0;
    return PyArray_STRIDE(op->array, nd + axis);
}

int attnx_check_core(const attnx_operand *op, int axis, npy_intp size, int broadcast_ok,
                     const char *what)
{
    npy_intp got = core_dim(op, axis);
    if (got == size || (broadcast_ok && got == 1)) return 0;
    PyObject *shape = PyObject_GetAttrString((PyObject *)op->array, "shape");
    if (shape)
        PyErr_Format(PyExc_ValueError, "%s of shape %R does not match: %s", op->name, shape, what);
    Py_XDECREF(shape);
    return -1;
}

int attnx_broadcast(attnx_operand *ops, int count, attnx_batch *batch)
{
    batch->ndim = 0;
    for (int i = 0; i < count; i++) {
        if (!ops[i].array) continue;
        int lead = PyArray_NDIM(ops[i].array) - ops[i].core_ndim;
        if (lead > batch->ndim) {
            /* right-align: existing axes move to the end */
            int shift = lead - batch->ndim;
            for (int ax = batch->ndim - 1; ax >= 0; ax--) batch->shape[ax + shift] = batch->shape[ax];
            for (int ax = 0; ax < shift; ax++) batch->shape[ax] = 1;
            batch->ndim = lead;
        }
    }
    for (int i = 0; i < count; i++) {
        if (!ops[i].array) continue;
        int lead = PyArray_NDIM(ops[i].array) - ops[i].core_ndim;
        for (int ax = 0; ax < lead; ax++) {
            npy_intp size = PyArray_DIM(ops[i].array, ax);
            npy_intp *target = &batch->shape[batch->ndim - lead + ax];
            if (size == *target || size == 1) continue;
            if (*target == 1) {
                *target = size;
                continue;
            }
            PyObject *shape = PyObject_GetAttrString((PyObject *)ops[i].array, "shape");
            if (shape)
                PyErr_Format(PyExc_ValueError,
                             "the leading (batch) axes of %s, shape %R, do not broadcast against "
                             "those of the other arguments", ops[i].name, shape);
            Py_XDECREF(shape);
            return -1;
        }
    }
    batch->heads = 1;
    for (int ax = 0; ax < batch->ndim; ax++) {
        if (batch->shape[ax] != 0 && batch->heads > PTRDIFF_MAX / batch->shape[ax]) {
            PyErr_SetString(PyExc_ValueError, "the broadcast batch shape is too large");
            return -1;
        }
        batch->heads *= batch->shape[ax];
    }
    return 0;
}

ptrdiff_t *attnx_offsets(const attnx_operand *ops, int count, const attnx_batch *batch)
{
    if ((size_t)batch->heads > SIZE_MAX / sizeof(ptrdiff_t) / (size_t)(count ? count : 1)) {
        PyErr_NoMemory();
        return NULL;
    }
    ptrdiff_t *offsets = PyMem_RawMalloc(sizeof(ptrdiff_t) * (size_t)count * (size_t)(batch->heads ? batch->heads : 1));
    if (!offsets) {
        PyErr_NoMemory();
        return NULL;
    }
    /* per operand, per batch axis: the byte stride (0 where broadcast) */
    ptrdiff_t strides[ATTNX_MAX_OPS][NPY_MAXDIMS];
    for (int i = 0; i < count; i++) {
        for (int ax = 0; ax < batch->ndim; ax++) strides[i][ax] = 0;
        if (!ops[i].array) continue;
        int lead = PyArray_NDIM(ops[i].array) - ops[i].core_ndim;
        for (int ax = 0; ax < lead; ax++)
            if (PyArray_DIM(ops[i].array, ax) != 1)
                strides[i][batch->ndim - lead + ax] = PyArray_STRIDE(ops[i].array, ax);
    }
    npy_intp index[NPY_MAXDIMS] = {0};
    ptrdiff_t current[ATTNX_MAX_OPS] = {0};
    for (ptrdiff_t h = 0; h < batch->heads; h++) {
        for (int i = 0; i < count; i++) offsets[h * count + i] = current[i];
        /* odometer step over the batch axes, last axis fastest */
        for (int ax = batch->ndim - 1; ax >= 0; ax--) {
            if (++index[ax] < batch->shape[ax]) {
                for (int i = 0; i < count; i++) current[i] += strides[i][ax];
                break;
            }
            index[ax] = 0;
            for (int i = 0; i < count; i++) current[i] -= strides[i][ax] * (batch->shape[ax] - 1);
        }
    }
    return offsets;
}

PyArrayObject *attnx_new_array(const attnx_batch *batch, const npy_intp *trailing, int n_trailing,
                               int typenum)
{
    npy_intp shape[NPY_MAXDIMS];
    if (batch->ndim + n_trailing > NPY_MAXDIMS) {
        PyErr_SetString(PyExc_ValueError, "too many dimensions");
        return NULL;
    }
    for (int ax = 0; ax < batch->ndim; ax++) shape[ax] = batch->shape[ax];
    for (int ax = 0; ax < n_trailing; ax++) shape[batch->ndim + ax] = trailing[ax];
    return (PyArrayObject *)PyArray_SimpleNew(batch->ndim + n_trailing, shape, typenum);
}

/* [low, high) byte range an array can touch */
static void memory_extent(PyArrayObject *array, char **low, char **high)
{
    char *lo = PyArray_BYTES(array), *hi = lo;
    for (int ax = 0; ax < PyArray_NDIM(array); ax++) {
        npy_intp span = (PyArray_DIM(array, ax) - 1) * PyArray_STRIDE(array, ax);
        if (PyArray_DIM(array, ax) == 0) {
            *low = *high = lo;
            return;
        }
        if (span < 0) lo += span; else hi += span;
    }
    *low = lo;
    *high = hi + PyArray_ITEMSIZE(array);
}

PyArrayObject *attnx_new_aligned_array(const attnx_batch *batch, const npy_intp *trailing,
                                       int n_trailing, int typenum)
{
    npy_intp shape[NPY_MAXDIMS], count = 1;
    if (batch->ndim + n_trailing > NPY_MAXDIMS) {
        PyErr_SetString(PyExc_ValueError, "too many dimensions");
        return NULL;
    }
    for (int ax = 0; ax < batch->ndim; ax++) count *= shape[ax] = batch->shape[ax];
    for (int ax = 0; ax < n_trailing; ax++) count *= shape[batch->ndim + ax] = trailing[ax];
    PyArray_Descr *descr = PyArray_DescrFromType(typenum);
    npy_intp bytes = count * (npy_intp)PyDataType_ELSIZE(descr) + ATTNX_ALIGN - 1;
    PyArrayObject *block = (PyArrayObject *)PyArray_SimpleNew(1, &bytes, NPY_UINT8);
    if (!block) {
        Py_DECREF(descr);
        return NULL;
    }
    char *data = PyArray_BYTES(block);
    data += (ATTNX_ALIGN - (uintptr_t)data % ATTNX_ALIGN) % ATTNX_ALIGN;
    PyArrayObject *array = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, descr, batch->ndim + n_trailing, shape, NULL, data, NPY_ARRAY_CARRAY, NULL);
    if (!array || PyArray_SetBaseObject(array, (PyObject *)block) < 0) {
        Py_XDECREF(array);
        Py_DECREF(block);  /* SetBaseObject steals it even when it fails */
        return NULL;
    }
    return array;
}

/* 1 if a and b share an element, 0 if not, -1 with an exception set.
 * Empty or disjoint extents answer at once; interleaved views go to numpy's exact
 * np.shares_memory (bounded work; too hard counts as overlapping). */
static int overlap(PyArrayObject *a, PyArrayObject *b)
{
    char *a_lo, *a_hi, *b_lo, *b_hi;
    memory_extent(a, &a_lo, &a_hi);
    memory_extent(b, &b_lo, &b_hi);
    if (a_lo == a_hi || b_lo == b_hi || !(a_lo < b_hi && b_lo < a_hi)) return 0;
    PyObject *numpy = PyImport_ImportModule("numpy");
    PyObject *shares = numpy ? PyObject_CallMethod(numpy, "shares_memory", "OOi", (PyObject *)a,
                                                   (PyObject *)b, 100000) : NULL;
    Py_XDECREF(numpy);
    if (!shares) {
        if (!PyErr_Occurred()) return -1;
        PyErr_Clear(); /* numpy.exceptions.TooHardError */
        return 1;
    }
    int result = PyObject_IsTrue(shares);
    Py_DECREF(shares);
    return result;
}

int attnx_check_disjoint(PyArrayObject *written, const char *name, const attnx_operand *inputs,
                         int n_inputs)
{
    for (int i = 0; i < n_inputs; i++) {
        /* the caller's array, not a converted copy of it */
        PyArrayObject *input = inputs[i].source && PyArray_Check(inputs[i].source)
                                   ? (PyArrayObject *)inputs[i].source : inputs[i].array;
        if (!input) continue;
        int shared = overlap(written, input);
        if (shared < 0) return -1;
        if (shared) {
            PyErr_Format(PyExc_ValueError, "%s must not overlap the input %s", name, inputs[i].name);
            return -1;
        }
    }
    return 0;
}

int attnx_output(PyObject *out_obj, const attnx_dtypes *dtypes, const attnx_batch *batch,
                 npy_intp rows, npy_intp cols, const attnx_operand *inputs, int n_inputs,
                 PyArrayObject **result, PyArrayObject **compute_out)
{
    npy_intp core[2] = {rows, cols};
    *result = *compute_out = NULL;
    if (out_obj && out_obj != Py_None) {
        if (!PyArray_Check(out_obj)) {
            PyErr_Format(PyExc_TypeError, "out must be a numpy array, got %s", Py_TYPE(out_obj)->tp_name);
            return -1;
        }
        PyArrayObject *out = (PyArrayObject *)out_obj;
        if (PyArray_TYPE(out) != dtypes->result) {
            PyArray_Descr *want = PyArray_DescrFromType(dtypes->result);
            PyErr_Format(PyExc_TypeError, "out must have dtype %R, got %R", (PyObject *)want,
                         (PyObject *)PyArray_DESCR(out));
            Py_DECREF(want);
            return -1;
        }
        int shape_ok = PyArray_NDIM(out) == batch->ndim + 2;
        for (int ax = 0; shape_ok && ax < batch->ndim; ax++) shape_ok = PyArray_DIM(out, ax) == batch->shape[ax];
        shape_ok = shape_ok && PyArray_DIM(out, batch->ndim) == rows && PyArray_DIM(out, batch->ndim + 1) == cols;
        if (!shape_ok) {
            PyArrayObject *want = attnx_new_array(batch, core, 2, NPY_BOOL);
            PyObject *want_shape = want ? PyObject_GetAttrString((PyObject *)want, "shape") : NULL;
            PyObject *got_shape = PyObject_GetAttrString(out_obj, "shape");
            if (want_shape && got_shape)
                PyErr_Format(PyExc_ValueError, "out must have shape %R, got %R", want_shape, got_shape);
            Py_XDECREF(want);
            Py_XDECREF(want_shape);
            Py_XDECREF(got_shape);
            return -1;
        }
        if (PyArray_FailUnlessWriteable(out, "out") < 0) return -1;
        if (!PyArray_ISALIGNED(out) || PyArray_ISBYTESWAPPED(out) || !layout_ok(out, 2)) {
            PyErr_SetString(PyExc_ValueError,
                            "out must be aligned, native-endian, with a contiguous last axis and "
                            "non-overlapping rows");
            return -1;
        }
        if (attnx_check_disjoint(out, "out", inputs, n_inputs) < 0) return -1;
        Py_INCREF(out);
        *result = out;
    } else {
        *result = attnx_new_array(batch, core, 2, dtypes->result);
        if (!*result) return -1;
    }
    if (dtypes->result == dtypes->compute) {
        Py_INCREF(*result);
        *compute_out = *result;
    } else {
        *compute_out = attnx_new_array(batch, core, 2, dtypes->compute);
        if (!*compute_out) {
            Py_CLEAR(*result);
            return -1;
        }
    }
    return 0;
}

int attnx_output_finish(PyArrayObject *result, PyArrayObject *compute_out)
{
    if (result == compute_out) return 0;
    return PyArray_CopyInto(result, compute_out);
}

int attnx_parse_causal(PyObject *obj, int *causal)
{
    *causal = 0;
    if (!obj || obj == Py_None || obj == Py_False) return 0;
    if (obj == Py_True) {
        *causal = 1;
        return 0;
    }
    if (PyArray_IsScalar(obj, Bool)) {
        *causal = PyObject_IsTrue(obj);
        return *causal < 0 ? -1 : 0;
    }
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "lower_right") == 0) {
            *causal = 1;
            return 0;
        }
        if (PyUnicode_CompareWithASCIIString(obj, "upper_left") == 0) {
            *causal = 2;
            return 0;
        }
        PyErr_Format(PyExc_ValueError,
                     "causal must be False, True, 'lower_right' or 'upper_left', got %R", obj);
        return -1;
    }
    PyErr_Format(PyExc_TypeError,
                 "causal must be a bool, 'lower_right' or 'upper_left', got %s", Py_TYPE(obj)->tp_name);
    return -1;
}

/* one side of a window: None (open) or an integer >= 0 */
static int parse_window_side(PyObject *obj, int *has, npy_intp *size)
{
    *has = 0;
    *size = 0;
    if (obj == Py_None) return 0;
    if (PyBool_Check(obj) || PyArray_IsScalar(obj, Bool) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "window must be an int w, or a (left, right) pair of ints or None, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *index = PyNumber_Index(obj);
    if (!index) return -1;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (overflow < 0 || value < 0) {
        PyErr_Format(PyExc_ValueError, "window sizes must be >= 0, got %R", obj);
        return -1;
    }
    *has = overflow == 0 && value < ((npy_intp)1 << 52);
    *size = *has ? (npy_intp)value : 0;  /* beyond any sequence: open */
    return 0;
}

int attnx_parse_window(PyObject *obj, int *has_left, npy_intp *left, int *has_right,
                       npy_intp *right)
{
    *has_left = *has_right = 0;
    *left = *right = 0;
    if (!obj || obj == Py_None) return 0;
    if (PyTuple_Check(obj) || PyList_Check(obj)) {
        if (PySequence_Size(obj) != 2) {
            PyErr_Format(PyExc_ValueError, "window must be an int or a (left, right) pair, got %R", obj);
            return -1;
        }
        PyObject *left_obj = PySequence_GetItem(obj, 0), *right_obj = PySequence_GetItem(obj, 1);
        int status = (left_obj && right_obj && parse_window_side(left_obj, has_left, left) == 0 &&
                      parse_window_side(right_obj, has_right, right) == 0)
                         ? 0 : -1;
        Py_XDECREF(left_obj);
        Py_XDECREF(right_obj);
        return status;
    }
    if (parse_window_side(obj, has_left, left) < 0) return -1;
    *has_right = *has_left;
    *right = *left;
    return 0;
}

int attnx_parse_positive(PyObject *obj, const char *name, double *value)
{
    if (PyBool_Check(obj) || !PyNumber_Check(obj) || PyComplex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a positive finite number, got %s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *value = PyFloat_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) return -1;
    if (!isfinite(*value) || *value <= 0) {
        PyErr_Format(PyExc_ValueError, "%s must be a positive finite number, got %R", name, obj);
        return -1;
    }
    return 0;
}

attnx_band attnx_make_band(npy_intp n, npy_intp m, int causal, int has_left, npy_intp left,
                           int has_right, npy_intp right)
{
    attnx_band band = {.n = n, .m = m};
    ptrdiff_t align = (ptrdiff_t)m - (ptrdiff_t)n;  /* i' = i + (m - n) */
    /* a side wider than both sequences hides nothing more: clamped, so
     * that the shifts (and their differences) cannot overflow */
    if (has_left) {
        band.has_lo = 1;
        band.lo_shift = align - (left < n + m ? left : n + m);
    }
    if (has_right) {
        band.has_hi = 1;
        band.hi_shift = align + (right < n + m ? right : n + m);
    }
    if (causal) {
        ptrdiff_t causal_shift = causal == 2 ? 0 : align;
        if (!band.has_hi || causal_shift < band.hi_shift) band.hi_shift = causal_shift;
        band.has_hi = 1;
    }
    return band;
}

void attnx_release(attnx_operand *ops, int count)
{
    for (int i = 0; i < count; i++) Py_CLEAR(ops[i].array);
}

int attnx_check_status(int status)
{
    if (status == ATTNX_OK) return 0;
    if (status == ATTNX_ENOMEM)
        PyErr_NoMemory();
    else
        PyErr_Format(PyExc_RuntimeError, "attnx kernel failed with status %d", status);
    return -1;
}

int attnx_parse_dropout(PyObject *p_obj, PyObject *seed_obj, double *p, uint64_t *seed)
{
    *p = 0;
    *seed = 0;
    if (p_obj && p_obj != Py_None) {
        *p = PyFloat_AsDouble(p_obj);
        if (*p == -1 && PyErr_Occurred()) return -1;
        if (!(*p >= 0 && *p < 1)) {
            PyObject *shown = PyObject_Repr(p_obj);
            PyErr_Format(PyExc_ValueError, "dropout_p must be in [0, 1), got %S", shown);
            Py_XDECREF(shown);
            return -1;
        }
    }
    if (!seed_obj || seed_obj == Py_None) {
        if (*p > 0) {
            PyErr_SetString(PyExc_ValueError,
                            "dropout_p > 0 needs seed= (an int): the backward regenerates the "
                            "dropout mask from it");
            return -1;
        }
        return 0;
    }
    if (PyBool_Check(seed_obj) || !PyLong_Check(seed_obj)) {
        PyErr_Format(PyExc_TypeError, "seed must be an int, got %s", Py_TYPE(seed_obj)->tp_name);
        return -1;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(seed_obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "seed must be in [0, 2**64)");
        return -1;
    }
    *seed = (uint64_t)value;
    return 0;
}
