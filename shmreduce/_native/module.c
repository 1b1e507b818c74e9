/* module.c: the module shmreduce._native, gathered from its files' function tables.
 *
 * Owns: the module object, the constants Python reads (defined once, in native.h),
 * the bindings init() makes (torch's DLPack importer, SharingError, the dtype table,
 * the published Gens), the interned names. Calls each file's table and pickler_init.
 */
#include "native.h"

PyObject *from_dlpack, *sharing_error, *dtypes, *published, *str_untyped_storage, *str_nbytes, *str_data_ptr;

PyDoc_STRVAR(init_doc, "init(from_dlpack, error, dtypes, published)\n\nBind torch's DLPack importer, the exception type "
                       "handles raise, and rebuild()'s dtype table and published Gens (dicts the caller fills).");

static PyObject *native_init(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *importer, *error, *table, *gens;
    if (!PyArg_ParseTuple(args, "OOO!O!", &importer, &error, &PyDict_Type, &table, &PyDict_Type, &gens))
        return NULL;
    if (!PyCallable_Check(importer) || !PyType_Check(error) || !PyType_IsSubtype((PyTypeObject *)error, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "init(callable, exception type, dict, dict)");
        return NULL;
    }
    Py_XSETREF(from_dlpack, Py_NewRef(importer));
    Py_XSETREF(sharing_error, Py_NewRef(error));
    Py_XSETREF(dtypes, Py_NewRef(table));
    Py_XSETREF(published, Py_NewRef(gens));
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"init", native_init, METH_VARARGS, init_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmreduce._native",
    .m_doc = PyDoc_STR("shmreduce's per-storage hot path: checked storages over shared memory, native lifetimes."),
    .m_size = -1,
    .m_methods = module_methods,
};

static int add_constants(PyObject *module) {
    const struct {
        const char *name;
        long long value;
    } constants[] = {
        {"ALIGN", ALIGN}, {"HEADER_BYTES", HEADER_BYTES}, {"SLAB_ITEM_MAX", SLAB_ITEM_MAX},
        {"TICKETS", (long long)TICKETS}, {"RETIRED", (long long)RETIRED}, {"UNCOUNTED", (long long)UNCOUNTED},
        {"CLOSED", (long long)CLOSED}, {"END_STALE", END_STALE}, {"END_WAIT", END_WAIT}, {"END_FREED", END_FREED},
        {"END_RETIRED", END_RETIRED},
    };
    for (size_t i = 0; i < sizeof(constants) / sizeof(constants[0]); i++) {
        PyObject *value = PyLong_FromLongLong(constants[i].value);
        int added = value != NULL ? PyModule_AddObjectRef(module, constants[i].name, value) : -1;
        Py_XDECREF(value);
        if (added < 0)
            return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&GenType) < 0 || pickler_init() < 0)
        return NULL;
    if ((str_untyped_storage = PyUnicode_InternFromString("untyped_storage")) == NULL ||
        (str_nbytes = PyUnicode_InternFromString("nbytes")) == NULL ||
        (str_data_ptr = PyUnicode_InternFromString("data_ptr")) == NULL)
        return NULL;
    if (sharing_error == NULL)
        sharing_error = Py_NewRef(PyExc_RuntimeError); /* until init() */
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    PyMethodDef *tables[] = {lifetime_methods, dlpack_methods, segments_methods, header_methods, pickler_methods};
    for (size_t i = 0; i < sizeof(tables) / sizeof(tables[0]); i++)
        if (PyModule_AddFunctions(module, tables[i]) < 0)
            goto error;
    if (PyModule_AddObjectRef(module, "Gen", (PyObject *)&GenType) < 0 || add_constants(module) < 0)
        goto error;
    return module;
error:
    Py_DECREF(module);
    return NULL;
}
