/* py_convert.c - half precision <-> float32 for Python (csrc/convert.c's
 * conversions): attnx._C._convert_half, which attnx.torch calls for its
 * bfloat16 and float16 tensors, and the checks and widening the other
 * bindings share (args.h). */
#include "args.h"
#include "bindings.h"
#include "convert.h"

/* the lowest and one past the highest byte `array` can touch */
static void byte_extent(PyArrayObject *array, char **low, char **high)
{
    char *start = PyArray_BYTES(array), *end = start;
    for (int a = 0; a < PyArray_NDIM(array); a++) {
        npy_intp span = (PyArray_DIM(array, a) - 1) * PyArray_STRIDE(array, a);
        if (PyArray_DIM(array, a) == 0) {
            *low = *high = start;
            return;
        }
        if (span < 0) start += span;
        else end += span;
    }
    *low = start;
    *high = end + PyArray_ITEMSIZE(array);
}

/* the half-precision format of an array's elements: float16, or bfloat16
 * as its bits (int16 or uint16); 0 for any other dtype */
int attnx_half_format_of(PyArrayObject *array)
{
    switch (PyArray_TYPE(array)) {
    case NPY_HALF: return ATTNX_F16;
    case NPY_INT16:
    case NPY_UINT16: return ATTNX_BF16;
    default: return 0;
    }
}

/* job = the conversion of src into dst: half-precision src (float16, or
 * bfloat16 bits as int16 or uint16) widened into float32 dst, or float32
 * src narrowed into half-precision dst, to nearest, ties to even. src: any
 * strides; dst: C-contiguous, writable, the shape of src, not overlapping
 * it. `name` starts the messages of the exceptions raised for anything
 * else (returning -1). */
int attnx_prepare_half_conversion(PyArrayObject *src, PyArrayObject *dst, attnx_conversion *job,
                                  const char *name)
{
    int widen = attnx_half_format_of(src) && PyArray_TYPE(dst) == NPY_FLOAT32;
    int narrow = PyArray_TYPE(src) == NPY_FLOAT32 && attnx_half_format_of(dst);
    if (!widen && !narrow) {
        PyErr_Format(PyExc_TypeError, "%s takes float32 and a half-precision array (float16, "
                     "or bfloat16 bits as int16 or uint16), one each; got src %S and dst %S",
                     name, PyArray_DESCR(src), PyArray_DESCR(dst));
        return -1;
    }
    attnx_half_format format = attnx_half_format_of(widen ? src : dst);
    int ndim = PyArray_NDIM(src);
    if (PyArray_NDIM(dst) != ndim ||
        !PyArray_CompareLists(PyArray_DIMS(src), PyArray_DIMS(dst), ndim)) {
        PyObject *src_shape = PyArray_IntTupleFromIntp(ndim, PyArray_DIMS(src));
        PyObject *dst_shape = PyArray_IntTupleFromIntp(PyArray_NDIM(dst), PyArray_DIMS(dst));
        if (src_shape && dst_shape)
            PyErr_Format(PyExc_ValueError, "%s: dst must have the shape of src %S, got %S", name,
                         src_shape, dst_shape);
        Py_XDECREF(src_shape);
        Py_XDECREF(dst_shape);
        return -1;
    }
    if (!PyArray_IS_C_CONTIGUOUS(dst) || !PyArray_ISWRITEABLE(dst) || !PyArray_ISBEHAVED(dst)) {
        PyErr_Format(PyExc_ValueError,
                     "%s: dst must be a C-contiguous, writable, aligned array in native byte order",
                     name);
        return -1;
    }
    if (!PyArray_ISALIGNED(src) || !PyArray_ISNOTSWAPPED(src)) {
        PyErr_Format(PyExc_ValueError, "%s: src must be aligned and in native byte order", name);
        return -1;
    }
    char *src_low, *src_high, *dst_low, *dst_high;
    byte_extent(src, &src_low, &src_high);
    byte_extent(dst, &dst_low, &dst_high);
    if (src_low < dst_high && dst_low < src_high) {
        PyErr_Format(PyExc_ValueError, "%s: dst must not overlap src", name);
        return -1;
    }
    ptrdiff_t shape[NPY_MAXDIMS], strides[NPY_MAXDIMS];
    for (int a = 0; a < ndim; a++) {
        shape[a] = PyArray_DIM(src, a);
        strides[a] = PyArray_STRIDE(src, a) / PyArray_ITEMSIZE(src);
    }
    if (ndim == 0) {
        /* a 0-d array is one element */
        shape[0] = 1;
        strides[0] = 0;
        ndim = 1;
    }
    if (attnx_conversion_prepare(job, PyArray_DATA(dst), PyArray_DATA(src), widen, format, ndim,
                                 shape, strides) < 0) {
        PyErr_Format(PyExc_ValueError, "%s takes at most 64 dimensions, got %d", name, ndim);
        return -1;
    }
    return 0;
}

PyObject *attnx_widened_half(PyArrayObject *half, const char *name)
{
    PyArrayObject *wide = (PyArrayObject *)PyArray_SimpleNew(PyArray_NDIM(half),
                                                             PyArray_DIMS(half), NPY_FLOAT32);
    attnx_conversion job;
    if (!wide || attnx_prepare_half_conversion(half, wide, &job, name) < 0) {
        Py_XDECREF(wide);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    attnx_conversion_run(&job, 1);
    Py_END_ALLOW_THREADS
    return (PyObject *)wide;
}

void attnx_half_kv_params(attnx_param *to, const attnx_param *from, int count, int k, int v)
{
    memcpy(to, from, (size_t)count * sizeof *to);
    to[k].flags = (from[k].flags & ~ATTNX_COMPUTE) | ATTNX_HALF | ATTNX_REQUIRED;
    to[v].flags = (from[v].flags & ~ATTNX_COMPUTE) | ATTNX_HALF | ATTNX_REQUIRED;
}

int attnx_half_kv_format(PyArrayObject *k, PyArrayObject *v)
{
    int format = attnx_half_format_of(k);
    if (attnx_half_format_of(v) != format) {
        PyErr_Format(PyExc_TypeError, "_half_kv takes k and v of one format (both float16, "
                     "or both bfloat16 bits), got %R and %R", (PyObject *)PyArray_DESCR(k),
                     (PyObject *)PyArray_DESCR(v));
        return -1;
    }
    return format;
}

/* conversions run together: enough for a training step's gradients */
#define MAX_CONVERSIONS 8

/* whether the bytes `a` can touch meet those `b` can */
static int arrays_overlap(PyArrayObject *a, PyArrayObject *b)
{
    char *a_low, *a_high, *b_low, *b_high;
    byte_extent(a, &a_low, &a_high);
    byte_extent(b, &b_low, &b_high);
    return a_low < b_high && b_low < a_high;
}

/* _convert_half(src, dst): dst = src converted (attnx_prepare_half_conversion),
 * or, src and dst tuples or lists of as many arrays (at most
 * MAX_CONVERSIONS), each dst[i] = src[i] converted, all in one parallel
 * region (no dst may overlap another's src or dst). Returns dst. */
PyObject *attnx_py_convert_half(PyObject *self, PyObject *args)
{
    PyObject *src_obj, *dst_obj;
    if (!PyArg_ParseTuple(args, "OO:_convert_half", &src_obj, &dst_obj)) return NULL;
    PyArrayObject *sources[MAX_CONVERSIONS], *destinations[MAX_CONVERSIONS];
    Py_ssize_t count = 1;
    if (PyArray_Check(src_obj) && PyArray_Check(dst_obj)) {
        sources[0] = (PyArrayObject *)src_obj;
        destinations[0] = (PyArrayObject *)dst_obj;
    } else if ((PyTuple_Check(src_obj) || PyList_Check(src_obj)) &&
               (PyTuple_Check(dst_obj) || PyList_Check(dst_obj))) {
        count = PySequence_Fast_GET_SIZE(src_obj);
        if (count != PySequence_Fast_GET_SIZE(dst_obj) || count > MAX_CONVERSIONS) {
            PyErr_Format(PyExc_ValueError, "_convert_half takes as many sources as destinations, "
                         "at most %d, got %zd and %zd", MAX_CONVERSIONS, count,
                         PySequence_Fast_GET_SIZE(dst_obj));
            return NULL;
        }
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *src = PySequence_Fast_GET_ITEM(src_obj, i);
            PyObject *dst = PySequence_Fast_GET_ITEM(dst_obj, i);
            if (!PyArray_Check(src) || !PyArray_Check(dst)) {
                PyErr_SetString(PyExc_TypeError, "_convert_half takes numpy arrays");
                return NULL;
            }
            sources[i] = (PyArrayObject *)src;
            destinations[i] = (PyArrayObject *)dst;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "_convert_half takes two numpy arrays, or two tuples or "
                        "lists of them");
        return NULL;
    }
    attnx_conversion jobs[MAX_CONVERSIONS];
    for (Py_ssize_t i = 0; i < count; i++) {
        if (attnx_prepare_half_conversion(sources[i], destinations[i], &jobs[i],
                                          "_convert_half") < 0)
            return NULL;
        for (Py_ssize_t other = 0; other < i; other++)
            if (arrays_overlap(destinations[i], sources[other]) ||
                arrays_overlap(destinations[i], destinations[other]) ||
                arrays_overlap(destinations[other], sources[i])) {
                PyErr_SetString(PyExc_ValueError,
                                "_convert_half: a dst must not overlap another conversion's "
                                "src or dst");
                return NULL;
            }
    }
    Py_BEGIN_ALLOW_THREADS
    attnx_conversion_run(jobs, (int)count);
    Py_END_ALLOW_THREADS
    Py_INCREF(dst_obj);
    return dst_obj;
}
