/*
 * The replay hot path of CudaGraphBackend, in C.
 *
 * FastDeploy calls the backend with keyword arguments on every decode step. In Python the call
 * itself, the token-count read and the table lookups cost about 0.5 us on a CI core; this type
 * does the same few steps without the interpreter. It holds two tables and their counters:
 *
 *   token table  (plain decode): token count -> replay callable, captured result;
 *   running table (speculative decode): forward_meta.real_bsz -> replay, result, graph size.
 *
 * Everything else, including every decision about what to capture, stays in Python: a step the
 * tables cannot serve goes to ``self._dispatch(kwargs, meta)``.
 *
 * ``dispatch.py`` holds the pure-Python twin of this type; both must behave identically, and the
 * tests run against both.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyObject_HEAD
    /* token table */
    PyObject *replays; /* list: token count -> zero-argument replay callable, or None */
    PyObject *results; /* list: token count -> the captured result */
    Py_ssize_t length;
    unsigned long long *hits; /* per token count */
    /* running table */
    PyObject *spec_replays; /* list: running requests -> replay callable, or None */
    PyObject *spec_results;
    Py_ssize_t *spec_sizes; /* graph size (tokens) per running-request count */
    Py_ssize_t spec_length;
    unsigned long long *spec_hits;   /* per running-request count */
    unsigned long long *spec_tokens; /* per running-request count: tokens served */
    unsigned long long *spec_token_hits; /* per token count (length entries) */
    /* sampling and resets */
    Py_ssize_t period; /* > 0: every period-th servable call goes to _dispatch (sampled checks) */
    Py_ssize_t ticks;
    unsigned long long generation; /* bumped by every _fast_init */
} FastDispatch;

static PyObject *str_forward_meta, *str_ids, *str_shape, *str_exist_prefill, *str_dispatch,
    *str_real_bsz;

static int
fd_traverse(FastDispatch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->replays);
    Py_VISIT(self->results);
    Py_VISIT(self->spec_replays);
    Py_VISIT(self->spec_results);
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int
fd_clear(FastDispatch *self)
{
    Py_CLEAR(self->replays);
    Py_CLEAR(self->results);
    Py_CLEAR(self->spec_replays);
    Py_CLEAR(self->spec_results);
    self->length = 0;
    self->spec_length = 0;
    return 0;
}

static void
free_counters(FastDispatch *self)
{
    PyMem_Free(self->hits);
    PyMem_Free(self->spec_sizes);
    PyMem_Free(self->spec_hits);
    PyMem_Free(self->spec_tokens);
    PyMem_Free(self->spec_token_hits);
    self->hits = NULL;
    self->spec_sizes = NULL;
    self->spec_hits = self->spec_tokens = self->spec_token_hits = NULL;
}

static void
fd_dealloc(FastDispatch *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    fd_clear(self);
    free_counters(self);
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

static void *
zeroed(Py_ssize_t count, size_t size)
{
    return PyMem_Calloc(count ? count : 1, size);
}

/* _fast_init(length, spec_length=0): empty tables (token counts 0 .. length-1, running-request
 * counts 0 .. spec_length-1), counters at zero. */
static PyObject *
fd_fast_init(FastDispatch *self, PyObject *args)
{
    Py_ssize_t length, spec_length = 0;
    if (!PyArg_ParseTuple(args, "n|n", &length, &spec_length)) {
        return NULL;
    }
    if (length < 0 || spec_length < 0) {
        PyErr_SetString(PyExc_ValueError, "table lengths must be >= 0");
        return NULL;
    }
    PyObject *replays = new_none_list(length);
    PyObject *results = new_none_list(length);
    PyObject *spec_replays = new_none_list(spec_length);
    PyObject *spec_results = new_none_list(spec_length);
    unsigned long long *hits = zeroed(length, sizeof(unsigned long long));
    unsigned long long *spec_token_hits = zeroed(length, sizeof(unsigned long long));
    Py_ssize_t *spec_sizes = zeroed(spec_length, sizeof(Py_ssize_t));
    unsigned long long *spec_hits = zeroed(spec_length, sizeof(unsigned long long));
    unsigned long long *spec_tokens = zeroed(spec_length, sizeof(unsigned long long));
    if (!replays || !results || !spec_replays || !spec_results || !hits || !spec_token_hits
        || !spec_sizes || !spec_hits || !spec_tokens) {
        Py_XDECREF(replays);
        Py_XDECREF(results);
        Py_XDECREF(spec_replays);
        Py_XDECREF(spec_results);
        PyMem_Free(hits);
        PyMem_Free(spec_token_hits);
        PyMem_Free(spec_sizes);
        PyMem_Free(spec_hits);
        PyMem_Free(spec_tokens);
        return PyErr_NoMemory();
    }
    Py_XSETREF(self->replays, replays);
    Py_XSETREF(self->results, results);
    Py_XSETREF(self->spec_replays, spec_replays);
    Py_XSETREF(self->spec_results, spec_results);
    free_counters(self);
    self->hits = hits;
    self->spec_token_hits = spec_token_hits;
    self->spec_sizes = spec_sizes;
    self->spec_hits = spec_hits;
    self->spec_tokens = spec_tokens;
    self->length = length;
    self->spec_length = spec_length;
    self->generation += 1;
    Py_RETURN_NONE;
}

static int
set_slot(PyObject *replays, PyObject *results, Py_ssize_t index, PyObject *replay, PyObject *result)
{
    Py_INCREF(replay);
    Py_INCREF(result);
    PyList_SetItem(replays, index, replay);
    PyList_SetItem(results, index, result);
    return 0;
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
    set_slot(self->replays, self->results, tokens, replay, result);
    Py_RETURN_NONE;
}

/* _spec_set(running, replay, result, size): serve steps of ``running`` requests and at most
 * ``size`` tokens by calling ``replay`` (None disables). */
static PyObject *
fd_spec_set(FastDispatch *self, PyObject *args)
{
    Py_ssize_t running, size;
    PyObject *replay, *result;
    if (!PyArg_ParseTuple(args, "nOOn", &running, &replay, &result, &size)) {
        return NULL;
    }
    if (self->spec_replays == NULL || running < 0 || running >= self->spec_length) {
        PyErr_SetString(PyExc_IndexError, "running-request count outside the fast table");
        return NULL;
    }
    set_slot(self->spec_replays, self->spec_results, running, replay, result);
    self->spec_sizes[running] = size;
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

static PyObject *
counter_list(const unsigned long long *values, Py_ssize_t length)
{
    PyObject *list = PyList_New(length);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < length; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(values ? values[i] : 0);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, value);
    }
    return list;
}

/* _fast_hits(): the token table's hit counters, per token count. */
static PyObject *
fd_fast_hits(FastDispatch *self, PyObject *Py_UNUSED(ignored))
{
    return counter_list(self->hits, self->length);
}

/* _spec_counts(): (hits per running-request count, tokens served per running-request count,
 * hits per token count) of the running table. */
static PyObject *
fd_spec_counts(FastDispatch *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *hits = counter_list(self->spec_hits, self->spec_length);
    PyObject *tokens = counter_list(self->spec_tokens, self->spec_length);
    PyObject *token_hits = counter_list(self->spec_token_hits, self->length);
    if (!hits || !tokens || !token_hits) {
        Py_XDECREF(hits);
        Py_XDECREF(tokens);
        Py_XDECREF(token_hits);
        return NULL;
    }
    return Py_BuildValue("(NNN)", hits, tokens, token_hits);
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

/* A non-negative int attribute or item, else -1 (and no error). */
static Py_ssize_t
as_count(PyObject *value)
{
    if (value == NULL || !PyLong_CheckExact(value)) {
        return -1;
    }
    Py_ssize_t count = PyLong_AsSsize_t(value);
    if (count == -1 && PyErr_Occurred()) {
        PyErr_Clear();
    }
    return count;
}

/* 1: decode step, 0: prefill or mixed, -1: error set. */
static int
is_decode(PyObject *meta)
{
    PyObject *prefill = PyObject_GetAttr(meta, str_exist_prefill);
    if (prefill == NULL) {
        return -1;
    }
    int truth = PyObject_IsTrue(prefill);
    Py_DECREF(prefill);
    return truth < 0 ? -1 : !truth;
}

/* The sampled address checks want every period-th servable call in _dispatch. */
static int
sampled(FastDispatch *self)
{
    if (self->period > 0 && ++self->ticks >= self->period) {
        self->ticks = 0;
        return 1;
    }
    return 0;
}

/* Call ``replay`` and return ``captured`` (new reference), or NULL on error. Both are borrowed
 * from the tables; they are held across the call, which can run Python that resets the tables. */
static PyObject *
replay_and_return(PyObject *replay, PyObject *captured)
{
    Py_INCREF(replay);
    Py_INCREF(captured);
    PyObject *ignored = PyObject_CallNoArgs(replay);
    Py_DECREF(replay);
    if (ignored == NULL) {
        Py_DECREF(captured);
        return NULL;
    }
    Py_DECREF(ignored);
    return captured;
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
    if (PyList_Check(shape) && PyList_GET_SIZE(shape) > 0) {
        tokens = as_count(PyList_GET_ITEM(shape, 0));
    }
    else if (PyTuple_Check(shape) && PyTuple_GET_SIZE(shape) > 0) {
        tokens = as_count(PyTuple_GET_ITEM(shape, 0));
    }
    Py_DECREF(shape);

    if (tokens >= 0 && tokens < self->length && PyList_GET_ITEM(self->replays, tokens) != Py_None) {
        int decode = is_decode(meta);
        if (decode < 0) {
            goto done;
        }
        /* Reading exist_prefill may have run Python code: look the table up again. */
        if (decode && !sampled(self) && tokens < self->length
            && PyList_GET_ITEM(self->replays, tokens) != Py_None) {
            unsigned long long generation = self->generation;
            result = replay_and_return(PyList_GET_ITEM(self->replays, tokens),
                                       PyList_GET_ITEM(self->results, tokens));
            if (result != NULL && self->generation == generation) {
                self->hits[tokens] += 1;
            }
            goto done;
        }
    }
    else if (self->spec_length > 0 && tokens >= 0 && tokens < self->length) {
        PyObject *value = PyObject_GetAttr(meta, str_real_bsz);
        if (value == NULL) {
            goto done;
        }
        Py_ssize_t running = as_count(value);
        Py_DECREF(value);
        if (running > 0 && running < self->spec_length
            && PyList_GET_ITEM(self->spec_replays, running) != Py_None
            && tokens <= self->spec_sizes[running]) {
            int decode = is_decode(meta);
            if (decode < 0) {
                goto done;
            }
            if (decode && !sampled(self) && running < self->spec_length
                && PyList_GET_ITEM(self->spec_replays, running) != Py_None
                && tokens <= self->spec_sizes[running]) {
                unsigned long long generation = self->generation;
                result = replay_and_return(PyList_GET_ITEM(self->spec_replays, running),
                                           PyList_GET_ITEM(self->spec_results, running));
                if (result != NULL && self->generation == generation) {
                    self->spec_hits[running] += 1;
                    self->spec_tokens[running] += (unsigned long long)tokens;
                    self->spec_token_hits[tokens] += 1;
                }
                goto done;
            }
        }
    }
    result = slow_path(op, kwargs, meta);
done:
    Py_DECREF(meta);
    return result;
}

static PyMethodDef fd_methods[] = {
    {"_fast_init", (PyCFunction)fd_fast_init, METH_VARARGS, "Reset the tables."},
    {"_fast_set", (PyCFunction)fd_fast_set, METH_VARARGS, "Serve a token count by a replay."},
    {"_spec_set", (PyCFunction)fd_spec_set, METH_VARARGS, "Serve a running-request count."},
    {"_fast_hits", (PyCFunction)fd_fast_hits, METH_NOARGS, "Token-table hit counters."},
    {"_spec_counts", (PyCFunction)fd_spec_counts, METH_NOARGS, "Running-table counters."},
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
    str_real_bsz = PyUnicode_InternFromString("real_bsz");
    if (!str_forward_meta || !str_ids || !str_shape || !str_exist_prefill || !str_dispatch
        || !str_real_bsz) {
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
