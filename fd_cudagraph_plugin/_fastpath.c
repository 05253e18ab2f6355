/*
 * The replay hot path of CudaGraphBackend, in C.
 *
 * FastDeploy calls the backend with keyword arguments on every decode step. In Python the call
 * itself, the token-count read and the table lookups cost about 0.5 us on a CI core; this type
 * does the same few steps without the interpreter. It holds nothing but three tables indexed by
 * token count: the replay callable of the graph that serves that count (or None), the captured
 * result to return, and a hit counter. Everything else, including every decision about what to
 * capture, stays in Python: a step the tables cannot serve goes to ``self._dispatch(kwargs, meta)``.
 *
 * ``dispatch.py`` holds the pure-Python twin of this type; both must behave identically, and the
 * tests run against both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    PyObject *replays; /* list: token count -> zero-argument replay callable, or None */
    PyObject *results; /* list: token count -> the captured result */
    Py_ssize_t length;
    unsigned long long *hits;
    Py_ssize_t period; /* > 0: every period-th servable call goes to _dispatch (sampled checks) */
    Py_ssize_t ticks;
    unsigned long long generation; /* bumped by every _fast_init */
} FastDispatch;

static PyObject *str_forward_meta, *str_ids, *str_shape, *str_exist_prefill, *str_dispatch;

static int
fd_traverse(FastDispatch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->replays);
    Py_VISIT(self->results);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
fd_clear(FastDispatch *self)
{
    Py_CLEAR(self->replays);
    Py_CLEAR(self->results);
    self->length = 0;
    return 0;
}

static void
fd_dealloc(FastDispatch *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    fd_clear(self);
    PyMem_Free(self->hits);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *
new_none_list(Py_ssize_t length)
{
    PyObject *list = PyList_New(length);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(list, i, Py_None);
    }
    return list;
}

/* _fast_init(length): empty tables for token counts 0 .. length-1, counters at zero. */
static PyObject *
fd_fast_init(FastDispatch *self, PyObject *arg)
{
    Py_ssize_t length = PyLong_AsSsize_t(arg);
    if (length < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "length must be >= 0");
        }
        return NULL;
    }
    PyObject *replays = new_none_list(length);
    PyObject *results = new_none_list(length);
    unsigned long long *hits = PyMem_Calloc(length ? length : 1, sizeof(unsigned long long));
    if (replays == NULL || results == NULL || hits == NULL) {
        Py_XDECREF(replays);
        Py_XDECREF(results);
        PyMem_Free(hits);
        return PyErr_NoMemory();
    }
    Py_XSETREF(self->replays, replays);
    Py_XSETREF(self->results, results);
    PyMem_Free(self->hits);
    self->hits = hits;
    self->length = length;
    self->generation += 1;
    Py_RETURN_NONE;
}

/* _fast_set(tokens, replay, result): serve ``tokens`` by calling ``replay`` (None disables). */
static PyObject *
fd_fast_set(FastDispatch *self, PyObject *args)
{
    Py_ssize_t tokens;
    PyObject *replay, *result;
    if (!PyArg_ParseTuple(args, "nOO", &tokens, &replay, &result)) {
        return NULL;
    }
    if (self->replays == NULL || tokens < 0 || tokens >= self->length) {
        PyErr_SetString(PyExc_IndexError, "token count outside the fast table");
        return NULL;
    }
    Py_INCREF(replay);
    Py_INCREF(result);
    PyList_SetItem(self->replays, tokens, replay);
    PyList_SetItem(self->results, tokens, result);
    Py_RETURN_NONE;
}

/* _fast_period(n): send every n-th call that the tables could serve to _dispatch; 0 turns it off. */
static PyObject *
fd_fast_period(FastDispatch *self, PyObject *arg)
{
    Py_ssize_t period = PyLong_AsSsize_t(arg);
    if (period < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "period must be >= 0");
        }
        return NULL;
    }
    self->period = period;
    self->ticks = 0;
    Py_RETURN_NONE;
}

/* _fast_hits(): the per-token-count hit counters as a list of ints. */
static PyObject *
fd_fast_hits(FastDispatch *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(self->length);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->length; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(self->hits[i]);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

static PyObject *
slow_path(PyObject *self, PyObject *kwargs, PyObject *meta)
{
    PyObject *owned_kwargs = NULL;
    if (kwargs == NULL) {
        kwargs = owned_kwargs = PyDict_New();
        if (kwargs == NULL) {
            return NULL;
        }
    }
    PyObject *out = PyObject_CallMethodObjArgs(self, str_dispatch, kwargs, meta, NULL);
    Py_XDECREF(owned_kwargs);
    return out;
}

static PyObject *
fd_call(PyObject *op, PyObject *args, PyObject *kwargs)
{
    FastDispatch *self = (FastDispatch *)op;
    if (args != NULL && PyTuple_GET_SIZE(args) != 0) {
        PyErr_SetString(PyExc_TypeError,
                        "the CUDA-graph backend takes keyword arguments only, as FastDeploy passes them");
        return NULL;
    }
    PyObject *meta = kwargs ? PyDict_GetItemWithError(kwargs, str_forward_meta) : NULL;
    if (meta == NULL) {
        if (PyErr_Occurred()) {
            return NULL;
        }
        PyErr_SetString(PyExc_KeyError, "forward_meta");
        return NULL;
    }
    Py_INCREF(meta);
    PyObject *result = NULL;
    PyObject *ids = PyObject_GetAttr(meta, str_ids);
    if (ids == NULL) {
        goto done;
    }
    PyObject *shape = PyObject_GetAttr(ids, str_shape);
    Py_DECREF(ids);
    if (shape == NULL) {
        goto done;
    }
    Py_ssize_t tokens = -1;
    PyObject *first = NULL;
    if (PyList_Check(shape) && PyList_GET_SIZE(shape) > 0) {
        first = PyList_GET_ITEM(shape, 0);
    }
    else if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0) {
        first = PyTuple_GET_ITEM(shape, 0);
    }
    if (first != NULL) {
        tokens = PyLong_AsSsize_t(first);
        if (tokens == -1 && PyErr_Occurred()) {
            PyErr_Clear();
        }
    }
    Py_DECREF(shape);
    if (tokens >= 0 && tokens < self->length && PyList_GET_ITEM(self->replays, tokens) != Py_None) {
        PyObject *prefill = PyObject_GetAttr(meta, str_exist_prefill);
        if (prefill == NULL) {
            goto done;
        }
        int is_prefill = PyObject_IsTrue(prefill);
        Py_DECREF(prefill);
        if (is_prefill < 0) {
            goto done;
        }
        int sampled = !is_prefill && self->period > 0 && ++self->ticks >= self->period;
        if (sampled) {
            self->ticks = 0; /* this call goes to _dispatch, which runs the sampled checks */
        }
        /* Reading exist_prefill may have run Python code: look the tables up again. */
        if (!is_prefill && !sampled && tokens < self->length
            && PyList_GET_ITEM(self->replays, tokens) != Py_None) {
            PyObject *replay = PyList_GET_ITEM(self->replays, tokens);
            PyObject *captured = PyList_GET_ITEM(self->results, tokens);
            unsigned long long generation = self->generation;
            Py_INCREF(replay);
            Py_INCREF(captured);
            PyObject *ignored = PyObject_CallNoArgs(replay);
            Py_DECREF(replay);
            if (ignored == NULL) {
                Py_DECREF(captured);
                goto done;
            }
            Py_DECREF(ignored);
            if (self->generation == generation) { /* unless the replay reset the tables */
                self->hits[tokens] += 1;
            }
            result = captured;
            goto done;
        }
    }
    result = slow_path(op, kwargs, meta);
done:
    Py_DECREF(meta);
    return result;
}

static PyMethodDef fd_methods[] = {
    {"_fast_init", (PyCFunction)fd_fast_init, METH_O, "Reset the tables to a length."},
    {"_fast_set", (PyCFunction)fd_fast_set, METH_VARARGS, "Serve a token count by a replay."},
    {"_fast_hits", (PyCFunction)fd_fast_hits, METH_NOARGS, "Per-token-count hit counters."},
    {"_fast_period", (PyCFunction)fd_fast_period, METH_O, "Divert every n-th call to _dispatch."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot fd_slots[] = {
    {Py_tp_dealloc, fd_dealloc},
    {Py_tp_traverse, fd_traverse},
    {Py_tp_clear, fd_clear},
    {Py_tp_call, fd_call},
    {Py_tp_methods, fd_methods},
    {Py_tp_doc, "C replay dispatch for CudaGraphBackend (see dispatch.py for its Python twin)."},
    {0, NULL},
};

static PyType_Spec fd_spec = {
    .name = "fd_cudagraph_plugin._fastpath.FastDispatch",
    .basicsize = sizeof(FastDispatch),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = fd_slots,
};

static int
fastpath_exec(PyObject *module)
{
    str_forward_meta = PyUnicode_InternFromString("forward_meta");
    str_ids = PyUnicode_InternFromString("ids_remove_padding");
    str_shape = PyUnicode_InternFromString("shape");
    str_exist_prefill = PyUnicode_InternFromString("exist_prefill");
    str_dispatch = PyUnicode_InternFromString("_dispatch");
    if (!str_forward_meta || !str_ids || !str_shape || !str_exist_prefill || !str_dispatch) {
        return -1;
    }
    PyObject *type = PyType_FromSpec(&fd_spec);
    if (type == NULL) {
        return -1;
    }
    if (PyModule_AddObject(module, "FastDispatch", type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyModuleDef_Slot fastpath_slots[] = {
    {Py_mod_exec, fastpath_exec},
    {0, NULL},
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "fd_cudagraph_plugin._fastpath",
    .m_doc = "C replay dispatch for fd-cudagraph-plugin.",
    .m_size = 0,
    .m_slots = fastpath_slots,
};

PyMODINIT_FUNC
PyInit__fastpath(void)
{
    return PyModuleDef_Init(&fastpath_module);
}
