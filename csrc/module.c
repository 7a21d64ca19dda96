/* module.c - the attnx._C extension module: method table, thread control
 * and build information. The front ends live in py_<family>.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "amx.h"
#include "attnx.h"
#include "bindings.h"

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
    return Py_BuildValue("{s:s,s:s,s:N,s:s,s:N,s:i,s:s}", "blas", attnx_blas_name(), "simd",
                         attnx_simd_level(), "amx", PyBool_FromLong(amx), "softmax_backend",
                         attnx_softmax_backend_name(limit), "softmax_backends", backends,
                         "num_threads", attnx_get_num_threads(), "compiler",
#ifdef __VERSION__
                         "gcc " __VERSION__
#else
                         "unknown"
#endif
    );
}

#define KW_METHOD(name, fn, doc) {name, (PyCFunction)(void (*)(void))fn, METH_VARARGS | METH_KEYWORDS, doc}

static PyMethodDef methods[] = {
    KW_METHOD("softmax_attention", attnx_py_softmax_attention, attnx_softmax_attention_doc),
    KW_METHOD("gaussian_attention", attnx_py_gaussian_attention, attnx_gaussian_attention_doc),
    {"softmax_backward", attnx_py_softmax_backward, METH_VARARGS, attnx_softmax_backward_doc},
    {"linear_attention", (PyCFunction)(void (*)(void))attnx_py_linear_attention, METH_FASTCALL,
     attnx_linear_attention_doc},
    {"linear_step", (PyCFunction)(void (*)(void))attnx_py_linear_step, METH_FASTCALL,
     attnx_linear_step_doc},
    {"linear_flush", attnx_py_linear_flush, METH_O, attnx_linear_flush_doc},
    {"linear_attention_backward", attnx_py_linear_attention_backward, METH_VARARGS,
     attnx_linear_attention_backward_doc},
    {"get_num_threads", get_num_threads, METH_NOARGS, "Threads attnx kernels use."},
    {"set_num_threads", set_num_threads, METH_O, "Set the threads attnx kernels use."},
    {"_set_softmax_backend", set_softmax_backend, METH_O,
     "The most capable softmax backend calls may use, 'plain', 'mk' or 'amx' (for tests); "
     "returns the previous one."},
    {"build_info", build_info, METH_NOARGS,
     "BLAS, SIMD level, AMX in use, softmax backend limit and the backends this CPU has, "
     "threads, compiler."},
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
    if (attnx_linear_names_init() < 0) return NULL;
    attnx_interrupt_init();
    return PyModule_Create(&module);
}
