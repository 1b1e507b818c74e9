/* module.c: the module shmreduce._native, gathered from its files' function tables.
 *
 * Owns: the module object and its state (native.h's shm_state: the Gen type, the
 * bindings init() makes, the interned names), its multi-phase initialization (PEP 489),
 * the constants Python reads (defined once, in native.h), and the process-wide state
 * (shm_process: native.h says why it is not the module's). Calls each file's table.
 */
#include "native.h"

shm_process_state shm_process = {.streaming = -1, .populating = -1};

PyDoc_STRVAR(init_doc, "init($module, from_dlpack, error, dtypes, published, swap, versioned, "
                       "/)\n--\n\nBind "
                       "torch's DLPack importer, the exception type handles raise, rebuild()'s "
                       "dtype table and published Gens (dicts the caller fills), and torch's "
                       "UntypedStorage._swap_data_ptr_ (None where torch has none: nothing is "
                       "moved here then); versioned: whether from_dlpack takes DLPack 1.x "
                       "capsules (else it gets legacy ones).");

static PyObject *
native_init(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (shm_check_nargs("init", nargs, 6, 6) < 0) {
        return NULL;
    }
    PyObject *importer = args[0], *error = args[1], *table = args[2], *gens = args[3],
             *swap = args[4];
    int versioned = PyObject_IsTrue(args[5]);
    if (versioned < 0) {
        return NULL;
    }
    if (!PyDict_Check(table) || !PyDict_Check(gens) || !PyCallable_Check(importer) ||
        !PyType_Check(error) ||
        !PyType_IsSubtype((PyTypeObject *)error, (PyTypeObject *)PyExc_Exception) ||
        (swap != Py_None && !PyCallable_Check(swap))) {
        PyErr_SetString(PyExc_TypeError,
                        "init(callable, exception type, dict, dict, callable or None, bool)");
        return NULL;
    }
    Py_XSETREF(st->swap, swap == Py_None ? NULL : Py_NewRef(swap));
    st->versioned = versioned;
    Py_XSETREF(st->from_dlpack, Py_NewRef(importer));
    Py_XSETREF(st->sharing_error, Py_NewRef(error));
    Py_XSETREF(st->dtypes, Py_NewRef(table));
    Py_XSETREF(st->published, Py_NewRef(gens));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"init", (PyCFunction)(void (*)(void))native_init, METH_FASTCALL, init_doc},
    {NULL, NULL, 0, NULL},
};

static int
add_constants(PyObject *module)
{
    const struct {
        const char *name;
        long long value;
    } constants[] = {
        {"ALIGN", ALIGN},
        {"HEADER_BYTES", HEADER_BYTES},
        {"SLAB_ITEM_MAX", SLAB_ITEM_MAX},
        {"TICKETS", (long long)TICKETS},
        {"RETIRED", (long long)RETIRED},
        {"UNCOUNTED", (long long)UNCOUNTED},
        {"CLOSED", (long long)CLOSED},
        {"END_STALE", END_STALE},
        {"END_WAIT", END_WAIT},
        {"END_FREED", END_FREED},
        {"END_RETIRED", END_RETIRED},
    };
    for (size_t i = 0; i < Py_ARRAY_LENGTH(constants); i++) {
        PyObject *value = PyLong_FromLongLong(constants[i].value);
        if (value == NULL) {
            return -1;
        }
        int added = PyModule_AddObjectRef(module, constants[i].name, value);
        Py_DECREF(value);
        if (added < 0) {
            return -1;
        }
    }
    return PyModule_AddStringConstant(module, "CUT_MESSAGE", SHM_CUT_MESSAGE);
}

/* The names the C looks up, in the order of native.h's S_* enum. */
static const char *const name_text[N_NAMES] = {
    [S_UNTYPED_STORAGE] = "untyped_storage",
    [S_NBYTES] = "nbytes",
    [S_DATA_PTR] = "data_ptr",
    [S_REQUIRES_GRAD] = "requires_grad",
    [S_BACKWARD_HOOKS] = "_backward_hooks",
    [S_LAYOUT] = "layout",
    [S_IS_CPU] = "is_cpu",
    [S_IS_NESTED] = "is_nested",
    [S_IS_QUANTIZED] = "is_quantized",
    [S_IS_CONJ] = "is_conj",
    [S_IS_NEG] = "is_neg",
    [S_SHARING_STRATEGY] = "_sharing_strategy",
    [S_FILE_SYSTEM] = "file_system",
    [S_SLAB_FD] = "shmreduce.slab.fd",
    [S_SLAB_FS] = "shmreduce.slab.fs",
    [S_DLPACK_EXCHANGE_API] = "__dlpack_c_exchange_api__",
};

static int
native_exec(PyObject *module)
{
    shm_state *st = shm_get_state(module);
    /* The process-wide state (native.h) is one per process: a second interpreter would
     * share it. Refused here too, where Python has no slot to say so (before 3.12). */
    if (PyInterpreterState_Get() != PyInterpreterState_Main()) {
        PyErr_SetString(PyExc_ImportError,
                        "shmreduce._native does not support sub-interpreters: its segment table, "
                        "dead stack and SIGBUS handler are the process's");
        return -1;
    }
    for (int i = 0; i < N_NAMES; i++) {
        assert(name_text[i] != NULL); /* every S_* has its text */
        st->names[i] = PyUnicode_InternFromString(name_text[i]);
        if (st->names[i] == NULL) {
            return -1;
        }
    }
    st->sharing_error = Py_NewRef(PyExc_RuntimeError); /* until init() */
    st->by_code_from = -1;
    st->post_fd = -1;
    st->gen_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &shm_gen_spec, NULL);
    if (st->gen_type == NULL) {
        return -1;
    }
    PyMethodDef *tables[] = {shm_lifetime_methods, shm_dlpack_methods, shm_segments_methods,
                             shm_header_methods, shm_pickler_methods, shm_copy_methods};
    for (size_t i = 0; i < Py_ARRAY_LENGTH(tables); i++) {
        if (PyModule_AddFunctions(module, tables[i]) < 0) {
            return -1;
        }
    }
    if (PyModule_AddObjectRef(module, "Gen", (PyObject *)st->gen_type) < 0 ||
        add_constants(module) < 0) {
        return -1;
    }
    return 0;
}

static int
native_traverse(PyObject *module, visitproc visit, void *arg)
{
    shm_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
    Py_VISIT(st->gen_type);
    Py_VISIT(st->from_dlpack);
    Py_VISIT(st->swap);
    Py_VISIT(st->sharing_error);
    Py_VISIT(st->dtypes);
    Py_VISIT(st->published);
    Py_VISIT(st->load_fn);
    Py_VISIT(st->tensor_type);
    Py_VISIT(st->strided);
    Py_VISIT(st->strategy_globals);
    Py_VISIT(st->torch_is_shared);
    Py_VISIT(st->exchange_capsule);
    Py_VISIT(st->general_rebuild);
    Py_VISIT(st->general_load);
    Py_VISIT(st->general_reduce);
    for (int i = 0; i < BY_CODE_MAX; i++) {
        Py_VISIT(st->by_code[i].dtype);
    }
    return 0;
}

static int
native_clear(PyObject *module)
{
    shm_state *st = PyModule_GetState(module);
    if (st == NULL) {
        return 0;
    }
    Py_CLEAR(st->gen_type);
    for (int i = 0; i < N_NAMES; i++) {
        Py_CLEAR(st->names[i]);
    }
    Py_CLEAR(st->from_dlpack);
    Py_CLEAR(st->swap);
    Py_CLEAR(st->sharing_error);
    Py_CLEAR(st->dtypes);
    Py_CLEAR(st->published);
    Py_CLEAR(st->load_fn);
    Py_CLEAR(st->tensor_type);
    Py_CLEAR(st->strided);
    Py_CLEAR(st->strategy_globals);
    Py_CLEAR(st->torch_is_shared);
    st->exchange = NULL;
    Py_CLEAR(st->exchange_capsule);
    Py_CLEAR(st->general_rebuild);
    Py_CLEAR(st->general_load);
    Py_CLEAR(st->general_reduce);
    for (int i = 0; i < BY_CODE_MAX; i++) {
        Py_CLEAR(st->by_code[i].dtype);
    }
    st->by_code_count = 0;
    st->by_code_from = -1;
    return 0;
}

static void
native_free(void *module)
{
    (void)native_clear((PyObject *)module);
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
#ifdef Py_mod_gil
    /* The lock-free stacks have one consumer, the GIL holder: not tried without it yet. */
    {Py_mod_gil, Py_MOD_GIL_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmreduce._native",
    .m_doc = PyDoc_STR(
        "shmreduce's per-storage hot path: checked storages over shared memory, native lifetimes."),
    .m_size = sizeof(shm_state),
    .m_methods = module_methods,
    .m_slots = native_slots,
    .m_traverse = native_traverse,
    .m_clear = native_clear,
    .m_free = native_free,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
