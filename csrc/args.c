/* args.c - argument conversion and validation shared by every front end. */
#include "args.h"

#include <limits.h>
#include <math.h>
#include <string.h>

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

/* Can the kernels read the core matrix in place? BLAS takes a row stride
 * of at least the row's length; a kernel that reads the rows itself also
 * takes 0, all rows one row (repeat_ok, ATTNX_BROADCAST_ROWS). */
static int layout_ok(PyArrayObject *array, int core_ndim, int repeat_ok)
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
        if (row == 0 && repeat_ok) return 1;
        if (row < cols || row < 1 || row > INT_MAX) return 0;
    }
    return 1;
}

/* Broadcast the leading axes of the operands (absent ones skipped). */
static int broadcast_batch(const attnx_operand *ops, int count, attnx_batch *batch)
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
    return attnx_new_result(batch->ndim + n_trailing, shape, typenum);
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
    PyArrayObject *block = attnx_new_result(1, &bytes, NPY_UINT8);
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

/* 1 if a (its extent [a_lo, a_hi) computed once by the caller) and b
 * share an element, 0 if not, -1 with an exception set. Empty or disjoint
 * extents answer at once; interleaved views go to numpy's exact
 * np.shares_memory (bounded work; too hard counts as overlapping). */
static int overlap(PyArrayObject *a, char *a_lo, char *a_hi, PyArrayObject *b)
{
    char *b_lo, *b_hi;
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

int attnx_check_status(int status)
{
    if (status == ATTNX_OK) return 0;
    if (status == ATTNX_ENOMEM)
        PyErr_NoMemory();
    else if (status == ATTNX_EINTR) {
        /* poll_signals ran the handlers, which set the exception */
        if (!PyErr_Occurred()) PyErr_SetNone(PyExc_KeyboardInterrupt);
    }
    else
        PyErr_Format(PyExc_RuntimeError, "attnx kernel failed with status %d", status);
    return -1;
}

/* ------------------------------------------------------------------------
 * The call description (args.h). */

/* A param's core axes, parsed from its description. */
typedef struct {
    int count;
    int any_broadcast;
    char symbol[ATTNX_MAX_CORE];
    char broadcast[ATTNX_MAX_CORE];  /* may be 1 or missing */
} core_axes;

static void parse_axes(const char *axes, core_axes *core)
{
    core->count = core->any_broadcast = 0;
    for (const char *c = axes; *c; c++) {
        if (*c >= 'a' && *c <= 'z' && core->count < ATTNX_MAX_CORE) {
            core->symbol[core->count] = *c;
            core->broadcast[core->count++] = 0;
        } else if (*c == '|' && core->count > 0) {
            core->broadcast[core->count - 1] = core->any_broadcast = 1;
        }
    }
}

void attnx_call_init(attnx_call *call, const attnx_param *params, int count, int nslots,
                     const char *int_sizes)
{
    call->params = params;
    call->count = count;
    call->nslots = nslots;
    call->int_sizes = int_sizes;
    call->legend = NULL;
    call->derived.symbol = 0;
    for (int s = 0; s < 26; s++) {
        call->size[s] = -1;
        call->bound_by[s] = -1;
    }
    /* a description longer than the tables is refused by attnx_bind */
    if (count > ATTNX_MAX_OPS) call->count = count = 0;
    for (int i = 0; i < count; i++) {
        call->ops[i] = (attnx_operand){params[i].name, NULL, 0, NULL};
        call->results[i] = NULL;
    }
    call->offsets = NULL;
}

static void bind_symbol(attnx_call *call, char symbol, npy_intp size, int by)
{
    call->size[symbol - 'a'] = size;
    call->bound_by[symbol - 'a'] = (signed char)by;
    char derived = call->derived.symbol;
    if (derived && call->derived.from == symbol && call->size[derived - 'a'] < 0) {
        npy_intp mul = call->derived.mul, add = call->derived.add;
        /* saturated: an overflowing size fails the int_sizes check */
        npy_intp value = mul > 0 && size > (NPY_MAX_INTP - add) / mul ? NPY_MAX_INTP : mul * size + add;
        bind_symbol(call, derived, value, -1);
    }
}

void attnx_call_set(attnx_call *call, char symbol, npy_intp size)
{
    bind_symbol(call, symbol, size, -1);
}

void attnx_call_derive(attnx_call *call, char symbol, char from, npy_intp mul, npy_intp add)
{
    call->derived.symbol = symbol;
    call->derived.from = from;
    call->derived.mul = mul;
    call->derived.add = add;
    if (call->size[from - 'a'] >= 0) bind_symbol(call, from, call->size[from - 'a'], call->bound_by[from - 'a']);
}

/* "(..., n, d)", or with values "(..., 7, 16)" */
static void axes_text(const attnx_call *call, const core_axes *core, int values, char *text,
                      size_t size)
{
    size_t used = (size_t)PyOS_snprintf(text, size, "(...");
    for (int a = 0; a < core->count && used < size; a++) {
        if (values)
            used += (size_t)PyOS_snprintf(text + used, size - used, ", %ld",
                                          (long)call->size[core->symbol[a] - 'a']);
        else
            used += (size_t)PyOS_snprintf(text + used, size - used, ", %c", core->symbol[a]);
    }
    if (used < size) PyOS_snprintf(text + used, size - used, ")");
}

/* The one message of a core shape that does not fit: "k has shape
 * (2, 7, 8), expected (..., m, d) = (..., 7, 16) (d from q)". `failed`: the
 * axis that does not fit, -1 for too few axes. */
static int shape_error(const attnx_call *call, int i, PyArrayObject *array, const core_axes *core,
                       int failed)
{
    char symbols[64], values[160] = "", origin[96] = "";
    int all_bound = 1, explained = 0;  /* the legend explains the front end's symbols */
    for (int a = 0; a < core->count; a++) {
        int symbol = core->symbol[a] - 'a';
        all_bound &= call->size[symbol] >= 0;
        explained |= call->size[symbol] >= 0 && call->bound_by[symbol] < 0;
    }
    const char *legend = explained && call->legend ? call->legend : NULL;
    axes_text(call, core, 0, symbols, sizeof symbols);
    if (all_bound) {
        PyOS_snprintf(values, sizeof values, " = ");
        axes_text(call, core, 1, values + 3, sizeof values - 3);
    }
    if (failed >= 0) {
        char symbol = core->symbol[failed];
        int by = call->bound_by[symbol - 'a'];
        if (by >= 0 && by != i)
            PyOS_snprintf(origin, sizeof origin, " (%c from %s)", symbol, call->params[by].name);
    }
    PyObject *shape = PyObject_GetAttrString((PyObject *)array, "shape");
    if (shape)
        PyErr_Format(PyExc_ValueError, "%s has shape %R, expected %s%s%s%s%s%s",
                     call->params[i].name, shape, core->any_broadcast ? "to broadcast to " : "",
                     symbols, values, origin, legend ? "; " : "", legend ? legend : "");
    Py_XDECREF(shape);
    return -1;
}

/* Input i as an array of any dtype (the caller's own when it is one), its
 * core axes bound and checked. */
static int view_input(attnx_call *call, int i, PyObject *obj)
{
    const attnx_param *param = &call->params[i];
    attnx_operand *op = &call->ops[i];
    PyArrayObject *array;
    if (PyArray_Check(obj)) {
        array = (PyArrayObject *)obj;
        Py_INCREF(array);
    } else if (!(array = (PyArrayObject *)PyArray_FROM_O(obj))) {
        return -1;
    }
    op->array = array;
    op->source = obj;
    if ((param->flags & ATTNX_BOOL) && PyArray_TYPE(array) != NPY_BOOL) {
        PyErr_Format(PyExc_TypeError, "%s must be a boolean array (True = may attend), got dtype %R",
                     param->name, (PyObject *)PyArray_DESCR(array));
        return -1;
    }
    core_axes core;
    parse_axes(param->axes, &core);
    int nd = PyArray_NDIM(array);
    if (!core.any_broadcast && nd < core.count) return shape_error(call, i, array, &core, -1);
    op->core_ndim = nd < core.count ? nd : core.count;
    npy_intp dims[ATTNX_MAX_CORE];
    for (int a = 0; a < core.count; a++) {
        int from_end = core.count - a;
        dims[a] = from_end <= op->core_ndim ? PyArray_DIM(array, nd - from_end) : 1;
        char symbol = core.symbol[a];
        if (call->size[symbol - 'a'] < 0 && (!core.broadcast[a] || dims[a] != 1))
            bind_symbol(call, symbol, dims[a], i);
    }
    for (int a = 0; a < core.count; a++) {
        npy_intp want = call->size[core.symbol[a] - 'a'];
        if (dims[a] != want && !(core.broadcast[a] && dims[a] == 1))
            return shape_error(call, i, array, &core, a);
    }
    return 0;
}

/* A view of `array` with `dims` and `strides` (its own data, read only) */
static PyArrayObject *view_with(PyArrayObject *array, const npy_intp *dims,
                                const npy_intp *strides)
{
    PyArray_Descr *descr = PyArray_DESCR(array);
    Py_INCREF(descr);
    PyArrayObject *view = (PyArrayObject *)PyArray_NewFromDescr(
        &PyArray_Type, descr, PyArray_NDIM(array), (npy_intp *)dims, (npy_intp *)strides,
        PyArray_DATA(array), 0, NULL);
    if (!view) return NULL;
    Py_INCREF(array);
    if (PyArray_SetBaseObject(view, (PyObject *)array) < 0) {  /* steals array */
        Py_DECREF(view);
        return NULL;
    }
    PyArray_UpdateFlags(view, NPY_ARRAY_UPDATE_ALL);
    return view;
}

/* `array` cast to typenum with `cast` flags, its broadcast axes (stride
 * 0, more than one element) cast once and broadcast again, not
 * materialised: keys broadcast from one float16 row stay one row. */
static PyArrayObject *cast_broadcast_once(PyArrayObject *array, int typenum, int cast)
{
    int nd = PyArray_NDIM(array), collapsed = 0;
    npy_intp dims[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    for (int ax = 0; ax < nd; ax++) {
        dims[ax] = PyArray_DIM(array, ax);
        strides[ax] = PyArray_STRIDE(array, ax);
        if (strides[ax] == 0 && dims[ax] > 1) {
            dims[ax] = 1;
            collapsed = 1;
        }
    }
    PyArrayObject *source = collapsed ? view_with(array, dims, strides) : array;
    if (!source) return NULL;
    if (!collapsed) Py_INCREF(source);
    PyArrayObject *converted = (PyArrayObject *)PyArray_FromAny(
        (PyObject *)source, PyArray_DescrFromType(typenum), 0, 0, cast, NULL);
    Py_DECREF(source);
    if (!converted || !collapsed) return converted;
    for (int ax = 0; ax < nd; ax++) {
        strides[ax] = dims[ax] == 1 && PyArray_DIM(array, ax) > 1 ? 0 : PyArray_STRIDE(converted, ax);
        dims[ax] = PyArray_DIM(array, ax);
    }
    PyArrayObject *broadcast = view_with(converted, dims, strides);
    Py_DECREF(converted);
    return broadcast;
}

/* Input op converted to typenum where its dtype or alignment differs,
 * and copied once where BLAS cannot read it in place (layout_ok). */
static int convert_input(attnx_operand *op, int typenum, int flags)
{
    if (flags & ATTNX_BOOL) return 0;
    if (flags & ATTNX_HALF) {
        PyArrayObject *array = op->array;
        if (!attnx_half_format_of(array)) {
            PyErr_Format(PyExc_TypeError, "%s must be float16 or hold bfloat16 bits (int16 or "
                         "uint16), got dtype %R", op->name, (PyObject *)PyArray_DESCR(array));
            return -1;
        }
        if (!PyArray_ISALIGNED(array) || !PyArray_ISNOTSWAPPED(array)) {
            PyErr_Format(PyExc_ValueError, "%s: half-precision numbers must be aligned and in "
                         "native byte order", op->name);
            return -1;
        }
        if (!layout_ok(array, op->core_ndim, flags & ATTNX_BROADCAST_ROWS)) {
            PyArrayObject *copy = (PyArrayObject *)PyArray_NewCopy(array, NPY_CORDER);
            if (!copy) return -1;
            Py_SETREF(op->array, copy);
        }
        return 0;
    }
    int elementwise = flags & ATTNX_ELEMENTWISE;
    PyArrayObject *array = op->array;
    if (PyArray_TYPE(array) != typenum || !PyArray_ISALIGNED(array) || !PyArray_ISNOTSWAPPED(array)) {
        /* promoted inputs cast safely; the others are cast to the compute dtype whatever theirs */
        int cast = NPY_ARRAY_ALIGNED | NPY_ARRAY_NOTSWAPPED |
                   (flags & ATTNX_COMPUTE ? 0 : NPY_ARRAY_FORCECAST);
        array = cast_broadcast_once(array, typenum, cast);
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
        Py_SETREF(op->array, array);
    }
    if (!layout_ok(array, elementwise ? 0 : op->core_ndim, flags & ATTNX_BROADCAST_ROWS)) {
        PyArrayObject *copy = (PyArrayObject *)PyArray_NewCopy(array, NPY_CORDER);
        if (!copy) return -1;
        Py_SETREF(op->array, copy);
    }
    return 0;
}

/* ValueError unless `written` shares no element with the arrays of the
 * call other than param skip's: the caller's arrays, not converted copies.
 * An output is checked against the inputs and the outputs made before it;
 * an in-place output, being its input's array, against the inputs only
 * (the outputs have been checked against that input). */
static int check_disjoint_but(PyArrayObject *written, const char *name, const attnx_call *call,
                              int skip, int inputs_only)
{
    char *low, *high;
    memory_extent(written, &low, &high);
    if (low == high) return 0;  /* empty */
    for (int j = 0; j < call->count; j++) {
        const attnx_operand *op = &call->ops[j];
        int flags = call->params[j].flags;
        if (j == skip || (flags & ATTNX_IN_PLACE) || (inputs_only && (flags & ATTNX_OUTPUT)))
            continue;
        PyArrayObject *other = op->source && PyArray_Check(op->source)
                                   ? (PyArrayObject *)op->source : op->array;
        if (!other) continue;
        int shared = overlap(written, low, high, other);
        if (shared < 0) return -1;
        if (shared) {
            PyErr_Format(PyExc_ValueError, "%s must not overlap %s%s", name,
                         flags & ATTNX_OUTPUT ? "the output " : "the input ", op->name);
            return -1;
        }
    }
    return 0;
}

/* (batch..., core...) as a tuple, for messages */
static PyObject *full_shape(const attnx_batch *batch, const npy_intp *core, int n_core)
{
    PyObject *shape = PyTuple_New(batch->ndim + n_core);
    for (int ax = 0; shape && ax < batch->ndim + n_core; ax++) {
        npy_intp size = ax < batch->ndim ? batch->shape[ax] : core[ax - batch->ndim];
        PyObject *item = PyLong_FromSsize_t(size);
        if (!item) {
            Py_CLEAR(shape);
            break;
        }
        PyTuple_SET_ITEM(shape, ax, item);
    }
    return shape;
}

/* The caller's out= for output i: dtype, shape batch + core, layout,
 * writeable, no overlap with the inputs and earlier outputs. */
static int check_out(attnx_call *call, int i, PyObject *obj, int typenum, const npy_intp *core,
                     int n_core)
{
    const char *name = call->params[i].name;
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array, got %s", name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject *out = (PyArrayObject *)obj;
    if (PyArray_TYPE(out) != typenum) {
        PyArray_Descr *want = PyArray_DescrFromType(typenum);
        PyErr_Format(PyExc_TypeError, "%s must have dtype %R, got %R", name, (PyObject *)want,
                     (PyObject *)PyArray_DESCR(out));
        Py_DECREF(want);
        return -1;
    }
    const attnx_batch *batch = &call->batch;
    int shape_ok = PyArray_NDIM(out) == batch->ndim + n_core;
    for (int ax = 0; shape_ok && ax < batch->ndim + n_core; ax++)
        shape_ok = PyArray_DIM(out, ax) == (ax < batch->ndim ? batch->shape[ax] : core[ax - batch->ndim]);
    if (!shape_ok) {
        PyObject *want = full_shape(batch, core, n_core);
        PyObject *got = PyObject_GetAttrString(obj, "shape");
        core_axes axes;
        char symbols[64];
        parse_axes(call->params[i].axes, &axes);
        axes_text(call, &axes, 0, symbols, sizeof symbols);
        if (want && got)
            PyErr_Format(PyExc_ValueError, "%s has shape %R, expected %R: %s over the batch shape",
                         name, got, want, symbols);
        Py_XDECREF(want);
        Py_XDECREF(got);
        return -1;
    }
    if (PyArray_FailUnlessWriteable(out, name) < 0) return -1;
    if (!PyArray_ISALIGNED(out) || PyArray_ISBYTESWAPPED(out) || !layout_ok(out, n_core, 0)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be aligned, native-endian, with a contiguous last axis and "
                     "non-overlapping rows", name);
        return -1;
    }
    return check_disjoint_but(out, name, call, i, 0);
}

/* An output written over input `of` (a decoding step's state). */
static int check_in_place(attnx_call *call, int i, int of)
{
    const char *name = call->params[i].name;
    PyArrayObject *array = call->ops[of].array;
    const attnx_batch *batch = &call->batch;
    if ((PyObject *)array != call->ops[of].source || !PyArray_IS_C_CONTIGUOUS(array) ||
        !PyArray_ISWRITEABLE(array)) {
        PyErr_Format(PyExc_ValueError,
                     "%s is updated in place: it must be a writeable, C-contiguous array of the "
                     "computing dtype (not one that needs a converted copy)", name);
        return -1;
    }
    int same = PyArray_NDIM(array) - call->ops[of].core_ndim == batch->ndim;
    for (int ax = 0; same && ax < batch->ndim; ax++) same = PyArray_DIM(array, ax) == batch->shape[ax];
    if (!same) {
        PyObject *shape = PyObject_GetAttrString((PyObject *)array, "shape");
        PyObject *want = full_shape(batch, NULL, 0);
        if (shape && want)
            PyErr_Format(PyExc_ValueError,
                         "%s is updated in place, so it keeps its batch shape: the inputs "
                         "broadcast to the batch shape %R, but %s has shape %R", name, want, name,
                         shape);
        Py_XDECREF(shape);
        Py_XDECREF(want);
        return -1;
    }
    return check_disjoint_but(array, name, call, of, 1);
}

/* Output i: allocated, or the caller's array checked; ops[i] the array
 * the kernel writes, results[i] the one the caller gets. */
static int make_output(attnx_call *call, int i, PyObject *obj)
{
    const attnx_param *param = &call->params[i];
    attnx_operand *op = &call->ops[i];
    core_axes axes;
    parse_axes(param->axes, &axes);
    npy_intp core[ATTNX_MAX_CORE];
    for (int a = 0; a < axes.count; a++) core[a] = call->size[axes.symbol[a] - 'a'];
    int typenum = param->flags & ATTNX_RESULT_DTYPE ? call->dtypes.result : call->dtypes.compute;
    PyArrayObject *result;
    if (param->flags & ATTNX_IN_PLACE) {
        int of = 0;
        while (of < call->count && (call->ops[of].source != obj || (call->params[of].flags & ATTNX_OUTPUT)))
            of++;
        if (of == call->count) {
            PyErr_Format(PyExc_SystemError, "%s: in-place output of no input", param->name);
            return -1;
        }
        if (check_in_place(call, i, of) < 0) return -1;
        result = call->ops[of].array;
        Py_INCREF(result);
    } else if (obj != Py_None) {
        if (check_out(call, i, obj, typenum, core, axes.count) < 0) return -1;
        result = (PyArrayObject *)obj;
        Py_INCREF(result);
    } else if (param->flags & ATTNX_ALIGNED) {
        result = attnx_new_aligned_array(&call->batch, core, axes.count, typenum);
    } else {
        result = attnx_new_array(&call->batch, core, axes.count, typenum);
    }
    if (!result) return -1;
    call->results[i] = result;
    PyArrayObject *written = result;
    if (typenum != call->dtypes.compute) {
        written = attnx_new_array(&call->batch, core, axes.count, call->dtypes.compute);
        if (!written) return -1;
    } else {
        Py_INCREF(written);
    }
    *op = (attnx_operand){param->name, written, axes.count, (PyObject *)result};
    if (!(param->flags & ATTNX_ZEROED) || PyArray_SIZE(written) == 0) return 0;
    if (PyArray_IS_C_CONTIGUOUS(written)) {
        memset(PyArray_DATA(written), 0, (size_t)PyArray_NBYTES(written));
        return 0;
    }
    PyObject *zero = PyLong_FromLong(0);
    int status = zero ? PyArray_FillWithScalar(written, zero) : -1;
    Py_XDECREF(zero);
    return status;
}

/* heads x the core sizes of output i, in bytes of the compute or result
 * dtype (at most 8), must fit an array: checked before anything is
 * copied or allocated */
static int check_output_size(const attnx_call *call, int i)
{
    core_axes axes;
    parse_axes(call->params[i].axes, &axes);
    npy_intp count = call->batch.heads;
    for (int a = 0; a < axes.count; a++) {
        npy_intp size = call->size[axes.symbol[a] - 'a'];
        if (size != 0 && count > NPY_MAX_INTP / 8 / size) {
            char symbols[64], values[160];
            axes_text(call, &axes, 0, symbols, sizeof symbols);
            axes_text(call, &axes, 1, values, sizeof values);
            PyErr_Format(PyExc_ValueError,
                         "%s %s = %s over %zd batch heads is too large: its size overflows",
                         call->params[i].name, symbols, values, (Py_ssize_t)call->batch.heads);
            return -1;
        }
        count *= size;
    }
    return 0;
}

/* The kernel's offset table: offsets[h * nslots + slot], the byte offset
 * of head h in the operand of that slot (0 for an absent one). */
static ptrdiff_t *build_offsets(const attnx_call *call)
{
    const attnx_batch *batch = &call->batch;
    int nslots = call->nslots;
    size_t heads = (size_t)(batch->heads ? batch->heads : 1);
    if (heads > SIZE_MAX / sizeof(ptrdiff_t) / (size_t)(nslots ? nslots : 1)) {
        PyErr_NoMemory();
        return NULL;
    }
    ptrdiff_t *offsets = PyMem_RawMalloc(sizeof(ptrdiff_t) * (size_t)nslots * heads);
    if (!offsets) {
        PyErr_NoMemory();
        return NULL;
    }
    if (batch->heads <= 1) {  /* no head to run, or one at offset 0 everywhere */
        for (int slot = 0; slot < nslots; slot++) offsets[slot] = 0;
        return offsets;
    }
    /* per batch axis, per slot: the byte stride (0 where broadcast or absent) */
    ptrdiff_t strides[NPY_MAXDIMS][ATTNX_MAX_OPS];
    for (int ax = 0; ax < batch->ndim; ax++)
        for (int slot = 0; slot < nslots; slot++) strides[ax][slot] = 0;
    for (int i = 0; i < call->count; i++) {
        const attnx_operand *op = &call->ops[i];
        int slot = call->params[i].slot;
        if (slot < 0 || !op->array) continue;
        int lead = PyArray_NDIM(op->array) - op->core_ndim, skip = batch->ndim - lead;
        for (int ax = 0; ax < lead; ax++)
            if (PyArray_DIM(op->array, ax) != 1) strides[skip + ax][slot] = PyArray_STRIDE(op->array, ax);
    }
    /* the last batch axis as a tight loop (a decoding step's 32 heads),
     * the others by an odometer over its runs */
    int last = batch->ndim - 1;
    npy_intp inner = last >= 0 ? batch->shape[last] : 1, index[NPY_MAXDIMS];
    ptrdiff_t base[ATTNX_MAX_OPS] = {0}, step[ATTNX_MAX_OPS] = {0};
    for (int slot = 0; last >= 0 && slot < nslots; slot++) step[slot] = strides[last][slot];
    for (int ax = 0; ax < last; ax++) index[ax] = 0;
    for (ptrdiff_t *row = offsets; row < offsets + heads * (size_t)nslots;) {
        for (npy_intp j = 0; j < inner; j++, row += nslots)
            for (int slot = 0; slot < nslots; slot++) row[slot] = base[slot] + j * step[slot];
        for (int ax = last - 1; ax >= 0; ax--) {
            if (++index[ax] < batch->shape[ax]) {
                for (int slot = 0; slot < nslots; slot++) base[slot] += strides[ax][slot];
                break;
            }
            index[ax] = 0;
            for (int slot = 0; slot < nslots; slot++)
                base[slot] -= strides[ax][slot] * (batch->shape[ax] - 1);
        }
    }
    return offsets;
}

int attnx_bind(attnx_call *call, PyObject *const *objs)
{
    const attnx_param *params = call->params;
    int count = call->count;
    if (count == 0) {
        PyErr_SetString(PyExc_SystemError, "attnx: a call description with more than "
                                           "ATTNX_MAX_OPS arrays (args.h)");
        return -1;
    }
    /* 1. the compute dtype, from the required inputs */
    PyObject *promoted[ATTNX_MAX_OPS] = {NULL};
    const char *promoted_names[ATTNX_MAX_OPS] = {NULL};
    int n_promoted = 0;
    for (int i = 0; i < count; i++) {
        if ((params[i].flags & (ATTNX_COMPUTE | ATTNX_REQUIRED)) && (!objs[i] || objs[i] == Py_None)) {
            PyErr_Format(PyExc_TypeError, "%s must be an array, got None", params[i].name);
            return -1;
        }
        if (!(params[i].flags & ATTNX_COMPUTE)) continue;
        promoted[n_promoted] = objs[i];
        promoted_names[n_promoted++] = params[i].name;
    }
    if (attnx_resolve_dtypes(promoted, promoted_names, n_promoted, &call->dtypes) < 0) return -1;
    /* 2. the inputs' shapes: core axes bound and checked */
    for (int i = 0; i < count; i++) {
        int flags = params[i].flags;
        PyObject *obj = objs[i];
        if ((flags & ATTNX_OUTPUT) || !obj || obj == Py_None) continue;
        if ((flags & ATTNX_EXACT_DTYPE) &&
            !(PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == call->dtypes.compute)) {
            PyArray_Descr *want = PyArray_DescrFromType(call->dtypes.compute);
            if (PyArray_Check(obj))
                PyErr_Format(PyExc_TypeError,
                             "%s must have dtype %R, the dtype this call computes in, got %R",
                             params[i].name, (PyObject *)want,
                             (PyObject *)PyArray_DESCR((PyArrayObject *)obj));
            else
                PyErr_Format(PyExc_TypeError,
                             "%s must be a numpy array of dtype %R, the dtype this call computes "
                             "in, got %s", params[i].name, (PyObject *)want, Py_TYPE(obj)->tp_name);
            Py_DECREF(want);
            return -1;
        }
        if (!(flags & (ATTNX_COMPUTE | ATTNX_BOOL)) &&
            !(PyArray_Check(obj) && PyArray_TYPE((PyArrayObject *)obj) == call->dtypes.compute)) {
            attnx_dtypes own;  /* only to refuse complex, object, string... */
            if (attnx_resolve_dtypes(&obj, &params[i].name, 1, &own) < 0) return -1;
        }
        if (view_input(call, i, obj) < 0) return -1;
    }
    /* 3. sizes: the kernels' int sizes, the batch, the outputs */
    for (const char *symbol = call->int_sizes; symbol && *symbol; symbol++) {
        npy_intp size = call->size[*symbol - 'a'];
        if (size <= INT_MAX) continue;
        int by = call->bound_by[*symbol - 'a'];
        char listed[64] = "";  /* "d, e, m" */
        for (const char *s = call->int_sizes; *s && strlen(listed) + 4 < sizeof listed; s++)
            PyOS_snprintf(listed + strlen(listed), sizeof listed - strlen(listed), "%s%c",
                          s == call->int_sizes ? "" : ", ", *s);
        PyErr_Format(PyExc_ValueError, "%s%s%c = %zd is too large: the kernels take %s below 2**31",
                     by >= 0 ? params[by].name : "", by >= 0 ? ": " : "", *symbol,
                     (Py_ssize_t)size, listed);
        return -1;
    }
    if (broadcast_batch(call->ops, count, &call->batch) < 0) return -1;
    for (int i = 0; i < count; i++)
        if ((params[i].flags & ATTNX_OUTPUT) && objs[i] && check_output_size(call, i) < 0) return -1;
    /* 4. the inputs converted */
    for (int i = 0; i < count; i++)
        if (call->ops[i].array && convert_input(&call->ops[i], call->dtypes.compute, params[i].flags) < 0)
            return -1;
    /* 5. the outputs */
    for (int i = 0; i < count; i++)
        if ((params[i].flags & ATTNX_OUTPUT) && objs[i] && make_output(call, i, objs[i]) < 0) return -1;
    /* 6. the kernel's offset table */
    call->offsets = build_offsets(call);
    return call->offsets ? 0 : -1;
}

ptrdiff_t attnx_core_stride(const attnx_call *call, int i, int axis)
{
    const attnx_operand *op = &call->ops[i];
    if (!op->array) return 0;
    int nd = PyArray_NDIM(op->array);
    if (-axis > op->core_ndim || nd + axis < 0 || PyArray_DIM(op->array, nd + axis) == 1) return 0;
    return PyArray_STRIDE(op->array, nd + axis);
}

int attnx_finish(attnx_call *call)
{
    for (int i = 0; i < call->count; i++)
        if (call->results[i] && call->results[i] != call->ops[i].array &&
            PyArray_CopyInto(call->results[i], call->ops[i].array) < 0)
            return -1;
    return 0;
}

void attnx_call_release(attnx_call *call)
{
    for (int i = 0; i < call->count; i++) {
        Py_CLEAR(call->ops[i].array);
        Py_CLEAR(call->results[i]);
    }
    PyMem_RawFree(call->offsets);
    call->offsets = NULL;
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

int attnx_parse_keywords(attnx_keywords *spec, PyObject *const *args, Py_ssize_t nargs,
                         PyObject *kwnames, PyObject **found)
{
    if (!spec->interned[0])
        for (int i = 0; i < spec->count; i++)
            if (!(spec->interned[i] = PyUnicode_InternFromString(spec->names[i]))) return -1;
    if (nargs > spec->positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     spec->function, spec->positional, nargs);
        return -1;
    }
    for (int i = 0; i < spec->count; i++) found[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t keywords = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int next = 0;
    for (Py_ssize_t j = 0; j < keywords; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        int i = -1;
        for (int tried = 0; tried < spec->count && i < 0; tried++) {
            int at = (next + tried) % spec->count;
            if (spec->interned[at] == name) i = at;
        }
        for (int at = 0; at < spec->count && i < 0; at++)
            if (PyUnicode_Compare(spec->interned[at], name) == 0) i = at;
        if (i < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R",
                             spec->function, name);
            return -1;
        }
        if (found[i]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'",
                         spec->function, spec->names[i]);
            return -1;
        }
        found[i] = args[nargs + j];
        next = i + 1;
    }
    for (int i = 0; i < spec->required; i++)
        if (!found[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", spec->function,
                         spec->names[i]);
            return -1;
        }
    return 0;
}

int attnx_required(const char *function, const char *name, PyObject *obj)
{
    if (obj) return 0;
    PyErr_Format(PyExc_TypeError, "%s() missing required keyword argument '%s'", function, name);
    return -1;
}

/* attnx_interrupt's poll: Python's signal handlers, run with the GIL taken
 * for the moment; a handler that raises (KeyboardInterrupt) stops the call
 * and leaves its exception for attnx_check_status. */
static int poll_signals(void *unused)
{
    PyGILState_STATE gil = PyGILState_Ensure();
    int stop = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return stop;
}

static unsigned long main_thread_id;

void attnx_interrupt_init(void) { main_thread_id = PyThread_get_thread_ident(); }

attnx_interrupt attnx_interrupt_for_call(void)
{
    attnx_interrupt interrupt = {NULL, NULL, 0, 0};
    /* only the main thread handles signals */
    if (PyThread_get_thread_ident() == main_thread_id) interrupt.poll = poll_signals;
    return interrupt;
}
