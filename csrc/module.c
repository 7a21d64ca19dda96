/* module.c - the attnx._C extension module: method table, thread control
 * and build information. The front ends live in py_<family>.c. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define PY_ARRAY_UNIQUE_SYMBOL attnx_ARRAY_API
#include <numpy/arrayobject.h>

#include "attnx.h"
#include "bindings.h"
#include "dispatch.h"

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

/* a list of the names of the features in `set` */
static PyObject *feature_list(attnx_cpu_set set)
{
    PyObject *list = PyList_New(0);
    for (int f = 0; list && f < ATTNX_CPU_FEATURES; f++) {
        if (!(set & ATTNX_CPU_BIT(f))) continue;
        PyObject *name = PyUnicode_FromString(attnx_cpu_feature_name(f));
        if (!name || PyList_Append(list, name) < 0) Py_CLEAR(list);
        Py_XDECREF(name);
    }
    return list;
}

/* {family: its kernel set} of the tables, or of the limits (families
 * without one left out) */
static PyObject *family_dict(int limits)
{
    PyObject *dict = PyDict_New();
    for (int f = 0; dict && f < ATTNX_FAMILIES; f++) {
        int set = limits ? attnx_dispatch_limit(f) : attnx_kernels(f);
        if (set < 0) continue;
        PyObject *name = PyUnicode_FromString(attnx_kernels_name(set));
        if (!name || PyDict_SetItemString(dict, attnx_family_name(f), name) < 0) Py_CLEAR(dict);
        Py_XDECREF(name);
    }
    return dict;
}

/* limits[family] from {family name: kernel set name} (None: no limits) */
static int parse_limits(PyObject *given, int *limits)
{
    for (int f = 0; f < ATTNX_FAMILIES; f++) limits[f] = -1;
    if (given == Py_None) return 0;
    if (!PyDict_Check(given)) {
        PyErr_Format(PyExc_TypeError, "limits must be a dict or None, got %s",
                     Py_TYPE(given)->tp_name);
        return -1;
    }
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(given, &pos, &key, &value)) {
        const char *family = PyUnicode_Check(key) ? PyUnicode_AsUTF8(key) : NULL;
        const char *set = PyUnicode_Check(value) ? PyUnicode_AsUTF8(value) : NULL;
        if (PyErr_Occurred()) return -1;
        int f = family ? attnx_family_from_name(family) : -1;
        if (f < 0) {
            PyErr_Format(PyExc_ValueError, "limits: unknown family %R", key);
            return -1;
        }
        limits[f] = set ? attnx_kernels_from_name(set) : -1;
        if (limits[f] < 0) {
            PyErr_Format(PyExc_ValueError, "limits: unknown kernel set %R for %s", value, family);
            return -1;
        }
    }
    return 0;
}

/* _set_dispatch(disabled, limits=None): fill every family's table again as
 * at import with ATTNX_DISABLE_CPU_FEATURES=disabled, each family in
 * limits held to that set or one after it in its table (for tests);
 * returns (disabled, limits) before */
static PyObject *set_dispatch(PyObject *self, PyObject *args)
{
    const char *disabled_names;
    PyObject *given = Py_None;
    if (!PyArg_ParseTuple(args, "s|O:_set_dispatch", &disabled_names, &given)) return NULL;
    char unknown[256], before_names[256];
    attnx_cpu_set disabled = attnx_cpu_parse(disabled_names, unknown, sizeof unknown);
    if (unknown[0]) {
        PyErr_Format(PyExc_ValueError, "_set_dispatch: unknown CPU features: %s", unknown);
        return NULL;
    }
    int limits[ATTNX_FAMILIES];
    if (parse_limits(given, limits) < 0) return NULL;
    attnx_cpu_format(attnx_dispatch_disabled(), before_names, sizeof before_names);
    PyObject *before_limits = family_dict(1);
    if (!before_limits) return NULL;
    int status = attnx_dispatch_fill(disabled, limits);
    if (status < 0) {
        int family = -1 - status, sets[ATTNX_KERNEL_SETS];
        int count = attnx_family_sets(family, sets);
        PyObject *names = PyList_New(count);
        for (int s = 0; names && s < count; s++)
            PyList_SET_ITEM(names, s, PyUnicode_FromString(attnx_kernels_name(sets[s])));
        if (names)
            PyErr_Format(PyExc_ValueError, "limits: %s has no kernel set %s here; it has %S",
                         attnx_family_name(family), attnx_kernels_name(limits[family]), names);
        Py_XDECREF(names);
        Py_DECREF(before_limits);
        return NULL;
    }
    return Py_BuildValue("(sN)", before_names, before_limits);
}

/* _softmax_backward_block(side): hold the softmax backward's block side at
 * 64 or 128, or (0) choose it by the L2 again; returns what was held
 * before (0: the L2 chose) */
static PyObject *softmax_backward_block(PyObject *self, PyObject *args)
{
    Py_ssize_t side;
    if (!PyArg_ParseTuple(args, "n:_softmax_backward_block", &side)) return NULL;
    if (side != 0 && side != 64 && side != 128) {
        PyErr_Format(PyExc_ValueError,
                     "_softmax_backward_block: side must be 0, 64 or 128, not %zd", side);
        return NULL;
    }
    return PyLong_FromSsize_t(attnx_softmax_bwd_set_block(side));
}

/* Fill the tables from ATTNX_DISABLE_CPU_FEATURES at import. As numpy
 * does with NPY_DISABLE_CPU_FEATURES, names it does not know give an
 * ImportWarning and are ignored. ATTNX_SOFTMAX_BACKEND and ATTNX_AMX, which
 * limited the softmax forward alone, are no longer read: a UserWarning
 * says what replaced them. */
static int dispatch_init(void)
{
    const char *names = getenv("ATTNX_DISABLE_CPU_FEATURES");
    char unknown[256];
    attnx_cpu_set disabled = attnx_cpu_parse(names, unknown, sizeof unknown);
    if (unknown[0] &&
        PyErr_WarnFormat(PyExc_ImportWarning, 1,
                         "ATTNX_DISABLE_CPU_FEATURES: unknown CPU features ignored: %s (known: "
                         "AVX2, FMA3, AVX512F, AVX512DQ, AVX512BW, AVX512VL, AVX512_BF16, "
                         "AMX_TILE, AMX_BF16, AMX, ASIMD, SVE)", unknown) < 0)
        return -1;
    static const char *const retired[] = {"ATTNX_SOFTMAX_BACKEND", "ATTNX_AMX"};
    for (int r = 0; r < 2; r++)
        if (getenv(retired[r]) &&
            PyErr_WarnFormat(PyExc_UserWarning, 1,
                             "%s is no longer read: ATTNX_DISABLE_CPU_FEATURES leaves CPU "
                             "features out for every family (AMX for the old ATTNX_AMX=0)",
                             retired[r]) < 0)
            return -1;
    (void)attnx_dispatch_fill(disabled, NULL);
    return 0;
}

static PyObject *build_info(PyObject *self, PyObject *unused)
{
    /* optimized: built with optimisation, which contracts the C loops'
     * multiply-adds into fused ones as the intrinsic kernels are (an -O0
     * build, ATTNX_DEBUG, rounds each product apart) */
#ifdef __OPTIMIZE__
    const int optimized = 1;
#else
    const int optimized = 0;
#endif
    int amx = attnx_kernels(ATTNX_FAMILY_SOFTMAX_FWD) == ATTNX_KERNELS_AMX;
    return Py_BuildValue("{s:s,s:s,s:s,s:N,s:N,s:N,s:s,s:N,s:i,s:l,s:n,s:s,s:N}", "blas",
                         attnx_blas_name(),
                         "blas_core", attnx_blas_core(), "simd", attnx_simd_level(), "amx",
                         PyBool_FromLong(amx), "dispatch",
                         family_dict(0), "cpu_features", feature_list(attnx_cpu_detected()),
                         "cpu_vendor", attnx_cpu_vendor_name(attnx_cpu_vendor()),
                         "disabled_cpu_features", feature_list(attnx_dispatch_disabled()),
                         "num_threads", attnx_get_num_threads(), "l2_cache_bytes",
                         attnx_cpu_l2_bytes(), "softmax_backward_block", attnx_softmax_bwd_block(),
                         "compiler",
#if defined(__clang__)
                         "clang " __clang_version__,
#elif defined(__VERSION__)
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
    KW_METHOD("softmax_backward", attnx_py_softmax_backward, attnx_softmax_backward_doc),
    {"linear_attention", (PyCFunction)(void (*)(void))attnx_py_linear_attention,
     METH_FASTCALL | METH_KEYWORDS, attnx_linear_attention_doc},
    {"linear_attention_backward", (PyCFunction)(void (*)(void))attnx_py_linear_attention_backward,
     METH_VARARGS | METH_KEYWORDS, attnx_linear_attention_backward_doc},
    {"linear_variants", attnx_py_linear_variants, METH_NOARGS, attnx_linear_variants_doc},
    {"linear_resolve", (PyCFunction)(void (*)(void))attnx_py_linear_resolve,
     METH_VARARGS | METH_KEYWORDS, attnx_linear_resolve_doc},
    KW_METHOD("lsh_attention", attnx_py_lsh_attention, attnx_lsh_attention_doc),
    KW_METHOD("delta_rule", attnx_py_delta_rule, attnx_delta_rule_doc),
    KW_METHOD("delta_rule_backward", attnx_py_delta_rule_backward, attnx_delta_rule_backward_doc),
    KW_METHOD("causal_conv1d_update", attnx_py_causal_conv1d_update,
              attnx_causal_conv1d_update_doc),
    KW_METHOD("lsh_backward", attnx_py_lsh_backward, attnx_lsh_backward_doc),
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
    {"_set_dispatch", set_dispatch, METH_VARARGS,
     "_set_dispatch(disabled, limits=None): every family's kernels chosen again as at import "
     "with ATTNX_DISABLE_CPU_FEATURES=disabled, families in limits ({family: kernel set}) held "
     "to that set or a lesser one (for tests); returns (disabled, limits) before."},
    {"_softmax_backward_block", softmax_backward_block, METH_VARARGS,
     "_softmax_backward_block(side): the softmax backward's query and key blocks held at side x "
     "side (64 or 128), or chosen by the L2 again (0); returns what was held before (for tests)."},
    {"_convert_half", attnx_py_convert_half, METH_VARARGS,
     "_convert_half(src, dst): float16 or bfloat16 bits (int16/uint16) <-> float32, rounding to "
     "nearest even; src and dst may be tuples or lists of as many arrays (at most 8), converted "
     "together; returns dst."},
    {"build_info", build_info, METH_NOARGS,
     "BLAS, its core (the kernels it chose for this CPU), SIMD level of the compiler's clones, "
     "AMX in use, each family's kernel set "
     "(dispatch), the CPU's features and those left out, threads, compiler, optimized build."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnx._C", NULL, -1, methods};

PyMODINIT_FUNC PyInit__C(void)
{
    import_array();
    attnx_runtime_init();
    if (dispatch_init() < 0) return NULL;
    if (attnx_output_cache_init() < 0) return NULL;
    attnx_interrupt_init();
    PyObject *m = PyModule_Create(&module);
    if (m && attnx_linear_init(m) < 0) Py_CLEAR(m);
    return m;
}
