/* module.c - the attnx._C extension module: method table, thread control
 * and build information. The front ends live in py_<family>.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "amx.h"
#include "attnx.h"
#include "bindings.h"
#include "convert.h"

static PyObject *get_num_threads(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(attnx_get_num_threads());
}

static PyObject *set_num_threads(PyObject *self, PyObject *arg)
{
    if (PyBool_Check(arg) || !PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "num_threads must be an int, got %s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    if (threads < 1 || threads > 4096) {
        PyErr_Format(PyExc_ValueError, "num_threads must be between 1 and 4096, got %ld", threads);
        return NULL;
    }
    attnx_set_num_threads((int)threads);
    Py_RETURN_NONE;
}

/* _set_softmax_backend(name): the most capable softmax backend calls may
 * use (attnx.h); returns the name of the one before */
static PyObject *set_softmax_backend(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (PyUnicode_Check(arg) && !name) return NULL;
    int limit = name ? attnx_softmax_backend_from_name(name) : -1;
    if (limit < 0) {
        PyErr_Format(PyExc_ValueError, "backend must be 'plain', 'mk' or 'amx', got %R", arg);
        return NULL;
    }
    return PyUnicode_FromString(attnx_softmax_backend_name(attnx_set_softmax_backend_limit(limit)));
}

/* a switch of attnx.h from Python's truth of arg; returns the setting before */
static PyObject *set_switch(PyObject *arg, int (*set)(int))
{
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    return PyBool_FromLong(set(enabled));
}

/* _set_decode_kernel(flag): whether single-token decoding steps may use
 * the float32 AVX-512 kernel; _set_decode_group(flag): whether it may
 * take four heads at once */
static PyObject *set_decode_kernel(PyObject *self, PyObject *arg)
{
    return set_switch(arg, attnx_set_decode_kernel);
}

static PyObject *set_decode_group(PyObject *self, PyObject *arg)
{
    return set_switch(arg, attnx_set_decode_group);
}

/* 1 when this CPU (and build) can run the softmax backend */
static int softmax_backend_available(int backend)
{
    switch (backend) {
    case ATTNX_BACKEND_MK:
        return attnx_mk_width() != 0;
    case ATTNX_BACKEND_AMX:
#ifdef ATTNX_HAVE_AMX
        return attnx_mk_width() == 16 && attnx_amx_usable();
#else
        return 0;
#endif
    default:
        return 1;
    }
}

/* _set_bf16_conversion(name): the bfloat16 narrowing path, 'avx512_bf16'
 * (VCVTNEPS2BF16) or 'portable' (for tests: both give the same bits);
 * returns the name of the one before */
static PyObject *set_bf16_conversion(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (PyUnicode_Check(arg) && !name) return NULL;
    int path = -1;
    if (name && strcmp(name, "portable") == 0) path = ATTNX_BF16_PORTABLE;
    if (name && strcmp(name, "avx512_bf16") == 0) path = ATTNX_BF16_AVX512;
    if (path < 0) {
        PyErr_Format(PyExc_ValueError, "bf16 conversion must be 'avx512_bf16' or 'portable', got %R",
                     arg);
        return NULL;
    }
    int before = attnx_set_bf16_path(path);
    if (before < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "bf16 conversion 'avx512_bf16' needs a CPU with avx512_bf16 (this one has none)");
        return NULL;
    }
    return PyUnicode_FromString(attnx_bf16_path_name(before));
}

/* _set_bf16_dot(name): the bfloat16 dot products of float32 softmax
 * attention (attnx.h), 'avx512_bf16' (VDPBF16PS) or 'off' (for tests:
 * both compute in float32); returns the name of the setting before */
static const char *bf16_dot_name(int on) { return on ? "avx512_bf16" : "off"; }

static PyObject *set_bf16_dot(PyObject *self, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (PyUnicode_Check(arg) && !name) return NULL;
    int on = -1;
    if (name && strcmp(name, "off") == 0) on = 0;
    if (name && strcmp(name, "avx512_bf16") == 0) on = 1;
    if (on < 0) {
        PyErr_Format(PyExc_ValueError, "bf16 dot must be 'avx512_bf16' or 'off', got %R", arg);
        return NULL;
    }
    int before = attnx_set_bf16_dot(on);
    if (before < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "bf16 dot 'avx512_bf16' needs a CPU with avx512_bf16 and AVX-512 "
                        "micro-kernels (this one has none)");
        return NULL;
    }
    return PyUnicode_FromString(bf16_dot_name(before));
}

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

static int is_bf16_bits(PyArrayObject *array)
{
    return PyArray_TYPE(array) == NPY_INT16 || PyArray_TYPE(array) == NPY_UINT16;
}

/* _convert_bf16(src, dst): dst = src widened (src bfloat16 bits as int16
 * or uint16, dst float32) or narrowed (src float32, dst int16 or uint16)
 * to nearest, ties to even. src: any strides; dst: C-contiguous, writable,
 * the shape of src, not overlapping it. Returns dst. */
static PyObject *convert_bf16(PyObject *self, PyObject *args)
{
    PyArrayObject *src, *dst;
    if (!PyArg_ParseTuple(args, "O!O!:_convert_bf16", &PyArray_Type, &src, &PyArray_Type, &dst))
        return NULL;
    int widen = is_bf16_bits(src) && PyArray_TYPE(dst) == NPY_FLOAT32;
    int narrow = PyArray_TYPE(src) == NPY_FLOAT32 && is_bf16_bits(dst);
    if (!widen && !narrow) {
        PyErr_Format(PyExc_TypeError, "_convert_bf16 takes bfloat16 bits (int16 or uint16) and "
                     "float32, one each; got src %S and dst %S", PyArray_DESCR(src),
                     PyArray_DESCR(dst));
        return NULL;
    }
    int ndim = PyArray_NDIM(src);
    if (PyArray_NDIM(dst) != ndim ||
        !PyArray_CompareLists(PyArray_DIMS(src), PyArray_DIMS(dst), ndim)) {
        PyObject *src_shape = PyArray_IntTupleFromIntp(ndim, PyArray_DIMS(src));
        PyObject *dst_shape = PyArray_IntTupleFromIntp(PyArray_NDIM(dst), PyArray_DIMS(dst));
        if (src_shape && dst_shape)
            PyErr_Format(PyExc_ValueError, "dst must have the shape of src %S, got %S", src_shape,
                         dst_shape);
        Py_XDECREF(src_shape);
        Py_XDECREF(dst_shape);
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(dst) || !PyArray_ISWRITEABLE(dst) || !PyArray_ISBEHAVED(dst)) {
        PyErr_SetString(PyExc_ValueError,
                        "dst must be a C-contiguous, writable, aligned array in native byte order");
        return NULL;
    }
    if (!PyArray_ISALIGNED(src) || !PyArray_ISNOTSWAPPED(src)) {
        PyErr_SetString(PyExc_ValueError, "src must be aligned and in native byte order");
        return NULL;
    }
    char *src_low, *src_high, *dst_low, *dst_high;
    byte_extent(src, &src_low, &src_high);
    byte_extent(dst, &dst_low, &dst_high);
    if (src_low < dst_high && dst_low < src_high) {
        PyErr_SetString(PyExc_ValueError, "dst must not overlap src");
        return NULL;
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
    int status;
    Py_BEGIN_ALLOW_THREADS
    if (widen)
        status = attnx_bf16_to_float((float *)PyArray_DATA(dst), (const uint16_t *)PyArray_DATA(src),
                                     ndim, shape, strides);
    else
        status = attnx_float_to_bf16((uint16_t *)PyArray_DATA(dst), (const float *)PyArray_DATA(src),
                                     ndim, shape, strides);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_Format(PyExc_ValueError, "_convert_bf16 takes at most 64 dimensions, got %d", ndim);
        return NULL;
    }
    Py_INCREF(dst);
    return (PyObject *)dst;
}

static PyObject *build_info(PyObject *self, PyObject *unused)
{
    int limit = attnx_softmax_backend_limit();
    int amx = limit >= ATTNX_BACKEND_AMX && softmax_backend_available(ATTNX_BACKEND_AMX);
    PyObject *backends = PyList_New(0);
    if (!backends) return NULL;
    for (int b = 0; b < ATTNX_BACKENDS; b++) {
        if (!softmax_backend_available(b)) continue;
        PyObject *name = PyUnicode_FromString(attnx_softmax_backend_name(b));
        if (!name || PyList_Append(backends, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(backends);
            return NULL;
        }
        Py_DECREF(name);
    }
    /* optimized: built with optimisation, which contracts the C loops'
     * multiply-adds into fused ones as the intrinsic kernels are (an -O0
     * build, ATTNX_DEBUG, rounds each product apart) */
#ifdef __OPTIMIZE__
    const int optimized = 1;
#else
    const int optimized = 0;
#endif
    return Py_BuildValue("{s:s,s:s,s:N,s:s,s:N,s:s,s:s,s:i,s:s,s:N}", "blas", attnx_blas_name(),
                         "simd", attnx_simd_level(), "amx", PyBool_FromLong(amx), "softmax_backend",
                         attnx_softmax_backend_name(limit), "softmax_backends", backends,
                         "bf16_conversion", attnx_bf16_path_name(attnx_bf16_path()),
                         "bf16_dot", bf16_dot_name(attnx_bf16_dot()),
                         "num_threads", attnx_get_num_threads(), "compiler",
#ifdef __VERSION__
                         "gcc " __VERSION__,
#else
                         "unknown",
#endif
                         "optimized", PyBool_FromLong(optimized));
}

#define KW_METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_VARARGS | METH_KEYWORDS, doc}

static PyMethodDef methods[] = {
    KW_METHOD("softmax_attention", attnx_py_softmax_attention, attnx_softmax_attention_doc),
    KW_METHOD("gaussian_attention", attnx_py_gaussian_attention, attnx_gaussian_attention_doc),
    {"softmax_backward", attnx_py_softmax_backward, METH_VARARGS, attnx_softmax_backward_doc},
    {"linear_attention", (PyCFunction)(void (*)(void))attnx_py_linear_attention, METH_FASTCALL,
     attnx_linear_attention_doc},
    {"state_class", attnx_py_state_class, METH_VARARGS, attnx_state_class_doc},
    {"linear_flush", attnx_py_linear_flush, METH_O, attnx_linear_flush_doc},
    {"linear_attention_backward", attnx_py_linear_attention_backward, METH_VARARGS,
     attnx_linear_attention_backward_doc},
    {"lsh_attention", attnx_py_lsh_attention, METH_VARARGS, attnx_lsh_attention_doc},
    {"delta_rule", attnx_py_delta_rule, METH_VARARGS, attnx_delta_rule_doc},
    {"delta_rule_backward", attnx_py_delta_rule_backward, METH_VARARGS,
     attnx_delta_rule_backward_doc},
    {"causal_conv1d_update", attnx_py_causal_conv1d_update, METH_VARARGS,
     attnx_causal_conv1d_update_doc},
    {"lsh_backward", attnx_py_lsh_backward, METH_VARARGS, attnx_lsh_backward_doc},
    {"lsh_buckets", attnx_py_lsh_buckets, METH_VARARGS, attnx_lsh_buckets_doc},
    {"set_output_cache", attnx_py_set_output_cache, METH_O,
     "set_output_cache(limit, /)\n"
     "--\n"
     "\n"
     "Set how many bytes of attnx's freed results are kept for reuse.\n"
     "\n"
     "Results of 1 MiB or more that attnx allocates reuse the memory of its\n"
     "earlier results of the same size once they are freed, which saves the page\n"
     "faults of fresh memory on repeated calls.\n"
     "\n"
     "Parameters\n"
     "----------\n"
     "limit : int\n"
     "    The most bytes kept (default 256 MiB); 0 turns the reuse off and frees\n"
     "    what is held.\n"
     "\n"
     "Returns\n"
     "-------\n"
     "int\n"
     "    The previous limit.\n"
     "\n"
     "Raises\n"
     "------\n"
     "ValueError\n"
     "    When limit is negative.\n"
     "TypeError\n"
     "    When limit is not an integer.\n"
     "\n"
     "See Also\n"
     "--------\n"
     "show_config : Prints the limit in force.\n"
     "\n"
     "Notes\n"
     "-----\n"
     "Only memory attnx itself allocated and numpy has released is kept; a\n"
     "result that is still referenced is never reused (docs/conventions.md).\n"
     "\n"
     "Examples\n"
     "--------\n"
     ">>> import attnx\n"
     ">>> previous = attnx.set_output_cache(0)      # off\n"
     ">>> attnx.set_output_cache(previous)          # back on; returns the 0 just set\n"
     "0"},
    {"_output_cache_held", attnx_py_output_cache_held, METH_NOARGS,
     "(bytes, blocks) the output cache holds (for tests)."},
    {"get_num_threads", get_num_threads, METH_NOARGS,
     "get_num_threads()\n"
     "--\n"
     "\n"
     "The number of threads attnx's kernels use.\n"
     "\n"
     "Returns\n"
     "-------\n"
     "int\n"
     "    The OpenMP thread count of attnx's calls: ``OMP_NUM_THREADS`` when set,\n"
     "    else every core, unless `set_num_threads` changed it. A process created\n"
     "    by fork runs attnx on one thread.\n"
     "\n"
     "Raises\n"
     "------\n"
     "None\n"
     "    This function does not raise.\n"
     "\n"
     "See Also\n"
     "--------\n"
     "set_num_threads : Change the count.\n"
     "show_config : The count beside the BLAS, SIMD level and numpy version.\n"
     "\n"
     "Notes\n"
     "-----\n"
     "BLAS runs single-threaded inside attnx's threads, so the two never\n"
     "oversubscribe the cores; heads and query tiles are split over the threads.\n"
     "\n"
     "Examples\n"
     "--------\n"
     ">>> import attnx\n"
     ">>> attnx.get_num_threads() >= 1\n"
     "True"},
    {"set_num_threads", set_num_threads, METH_O,
     "set_num_threads(num_threads, /)\n"
     "--\n"
     "\n"
     "Set the number of threads attnx's kernels use.\n"
     "\n"
     "Parameters\n"
     "----------\n"
     "num_threads : int\n"
     "    The thread count, at least 1; it applies to the calls that follow, in\n"
     "    every Python thread.\n"
     "\n"
     "Returns\n"
     "-------\n"
     "None\n"
     "\n"
     "Raises\n"
     "------\n"
     "ValueError\n"
     "    When num_threads is less than 1 or more than 4096.\n"
     "TypeError\n"
     "    When num_threads is not an integer.\n"
     "\n"
     "See Also\n"
     "--------\n"
     "get_num_threads : The current count.\n"
     "\n"
     "Notes\n"
     "-----\n"
     "The default is ``OMP_NUM_THREADS`` or every core. Results do not depend on\n"
     "the count. Under dask, ``client.run(attnx.set_num_threads, 1)`` gives each\n"
     "worker thread one kernel thread (docs/dask.md).\n"
     "\n"
     "Examples\n"
     "--------\n"
     ">>> import attnx\n"
     ">>> before = attnx.get_num_threads()\n"
     ">>> attnx.set_num_threads(1)\n"
     ">>> attnx.get_num_threads()\n"
     "1\n"
     ">>> attnx.set_num_threads(before)"},
    {"_set_softmax_backend", set_softmax_backend, METH_O,
     "The most capable softmax backend calls may use, 'plain', 'mk' or 'amx' (for tests); "
     "returns the previous one."},
    {"_set_decode_kernel", set_decode_kernel, METH_O,
     "Whether single-token decoding steps may use the float32 AVX-512 kernel (for tests); "
     "returns the previous setting."},
    {"_set_decode_group", set_decode_group, METH_O,
     "Whether that kernel may take the steps of four heads at once (for tests); returns the "
     "previous setting."},
    {"_set_bf16_conversion", set_bf16_conversion, METH_O,
     "The bfloat16 narrowing, 'avx512_bf16' or 'portable' (for tests); returns the previous one."},
    {"_set_bf16_dot", set_bf16_dot, METH_O,
     "The bfloat16 dot products of float32 softmax attention on bfloat16 values, "
     "'avx512_bf16' or 'off' (for tests); returns the previous setting."},
    {"_convert_bf16", convert_bf16, METH_VARARGS,
     "_convert_bf16(src, dst): bfloat16 bits (int16/uint16) <-> float32, rounding to nearest even; "
     "returns dst."},
    {"build_info", build_info, METH_NOARGS,
     "BLAS, SIMD level, AMX in use, softmax backend limit and the backends this CPU has, "
     "bfloat16 conversion, bfloat16 dot products, threads, compiler, optimized build."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnx._C", NULL, -1, methods};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    if (attnx_runtime_init() < 0) {
        PyErr_Format(PyExc_ValueError, "ATTNX_SOFTMAX_BACKEND must be plain, mk or amx, got '%s'",
                     getenv("ATTNX_SOFTMAX_BACKEND"));
        return NULL;
    }
    if (attnx_linear_names_init() < 0 || attnx_output_cache_init() < 0) return NULL;
    attnx_interrupt_init();
    /* the fastest bfloat16 narrowing this CPU has (kept portable without) */
    (void)attnx_set_bf16_path(ATTNX_BF16_AVX512);
    return PyModule_Create(&module);
}
