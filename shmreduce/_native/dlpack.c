/* dlpack.c: storages and tensors over a mapping, made by torch's own DLPack importer.
 *
 * Owns: filling a DLPack context for [addr + offset, ...) of a Gen and handing it to
 * torch (shm_import_tensor), the untyped storage over a byte range (shm_make_storage), the
 * check that a pickle's sizes and strides describe elements inside their storage
 * (shm_layout_from_tuples, shm_check_layout). DLPack's structs are written from the public spec
 * (native.h): no torch headers, one binary for every torch. Calls: lifetime.c for contexts and
 * counts. The caller checked the range (lifetime.c, shm_check_range) before any of these runs.
 */
#include "native.h"

/* A tensor over the mapping at offset: ctx's dtype, shape and strides set. Handed to
 * torch in one C call through its DLPack exchange API where it has one, else as a
 * "dltensor_versioned" capsule through torch._C._from_dlpack (a "dltensor" one where
 * torch reads no versioned capsule: init()'s versioned). A failed import
 * changes no count, whether torch's importer called the deleter (then ctx->deleted
 * says so) or never took the tensor (the capsule keeps its name; the exchange API
 * calls the deleter of one it took). */
PyObject *
shm_import_tensor(GenObject *gen, Ctx *ctx, Py_ssize_t offset)
{
    assert(offset >= 0 && offset <= gen->size); /* the caller checked the range */
    assert(gen->module->from_dlpack != NULL);   /* shm_take_ctx() checked init() was called */
    ctx->gen = gen;
    ctx->managed.version = (DLPackVersion){.major = 1, .minor = 0};
    ctx->managed.flags = 0;
    ctx->managed.dl_tensor.data = gen->addr + offset;
    ctx->managed.dl_tensor.device.device_type = kDLCPU;
    ctx->managed.dl_tensor.device.device_id = 0;
    ctx->managed.dl_tensor.shape = ctx->shape;
    ctx->managed.dl_tensor.strides = ctx->strides;
    ctx->managed.dl_tensor.byte_offset = 0;
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = shm_ctx_deleter;
    atomic_store(&ctx->deleted, 0);
    atomic_store(&ctx->importing, 1);
    shm_add_count(gen);
    shm_state *st = gen->module;
    PyObject *tensor = NULL;
    int consumed = 0;
    if (st->exchange != NULL) {
        void *made = NULL;
        if (st->exchange->managed_tensor_to_py_object_no_sync(&ctx->managed, &made) == 0 &&
            made != NULL) {
            tensor = made;
        }
        else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_RuntimeError, "torch's DLPack exchange API made no tensor");
        }
    }
    else {
        const char *name = st->versioned ? "dltensor_versioned" : "dltensor";
        void *managed = &ctx->managed;
        if (!st->versioned) {
            ctx->legacy.dl_tensor = ctx->managed.dl_tensor;
            ctx->legacy.manager_ctx = ctx;
            ctx->legacy.deleter = shm_ctx_deleter_legacy;
            managed = &ctx->legacy;
        }
        PyObject *capsule = PyCapsule_New(managed, name, NULL);
        if (capsule != NULL) {
            tensor = PyObject_CallOneArg(st->from_dlpack, capsule);
            /* torch renames what it takes */
            consumed = !PyCapsule_IsValid(capsule, name);
            Py_DECREF(capsule);
        }
    }
    /* read before importing goes: a later deleter recycles ctx itself */
    int deleted = atomic_load(&ctx->deleted);
    atomic_store(&ctx->importing, 0);
    if (tensor != NULL) {
        return tensor; /* torch's storage owns ctx: its deleter recycles it */
    }
    if (deleted) {
        shm_give_back_ctx(ctx); /* the deleter ran inside the importer: the count went there */
    }
    else if (!consumed) {
        shm_give_back_ctx(ctx); /* never taken */
        shm_drop_count(gen);
    } /* else torch holds it still: its deleter lets go, later */
    return NULL;
}

/* The untyped storage over [offset, offset + nbytes) of the mapping; range checked. */
PyObject *
shm_make_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes)
{
    assert(nbytes > 0 && nbytes <= gen->size - offset); /* the caller checked the range */
    Ctx *ctx = shm_take_ctx(gen->module);
    if (ctx == NULL) {
        return NULL;
    }
    ctx->managed.dl_tensor.ndim = 1;
    ctx->managed.dl_tensor.dtype.code = kDLUInt;
    ctx->managed.dl_tensor.dtype.bits = 8;
    ctx->managed.dl_tensor.dtype.lanes = 1;
    ctx->shape[0] = nbytes;
    ctx->strides[0] = 1;
    PyObject *tensor = shm_import_tensor(gen, ctx, offset);
    if (tensor == NULL) {
        return NULL;
    }
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, gen->module->names[S_UNTYPED_STORAGE]);
    Py_DECREF(tensor);
    return storage;
}

/* A layout from a pickle's two tuples of ints: 0, or 1 for one DLPack cannot carry
 * here (too many dimensions), or -1 (SharingError) for a malformed one. */
int
shm_layout_from_tuples(shm_state *st, PyObject *size, PyObject *stride, Layout *out)
{
    if (!PyTuple_CheckExact(size) || !PyTuple_CheckExact(stride) ||
        PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride)) {
        PyErr_SetString(
            st->sharing_error,
            "tensor size and stride must be tuples of one length (forged or corrupted message)");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(size);
    if (n > MAX_DIMS) {
        return 1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(size, i), *st = PyTuple_GET_ITEM(stride, i);
        if (!PyLong_CheckExact(d) || !PyLong_CheckExact(st)) {
            goto bad;
        }
        long long dim = PyLong_AsLongLong(d), step = PyLong_AsLongLong(st);
        if ((dim == -1 || step == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            goto bad;
        }
        out->shape[i] = dim;
        out->strides[i] = step;
    }
    out->ndim = (int32_t)n;
    return 0;
bad:
    PyErr_SetString(st->sharing_error,
                    "tensor metadata that does not fit its storage: forged or corrupted message");
    return -1;
}

/* The byte extent a layout reaches with elements of itemsize (the highest element's
 * end): 0, or 1 for one that has no element, or -1 (SharingError) for a malformed one
 * (a negative size or stride, or a forged count: sizes whose product overflows,
 * whatever the strides: torch's importer would fail on it after taking the tensor). */
int
shm_check_layout(shm_state *st, const Layout *layout, Py_ssize_t itemsize, int64_t *extent)
{
    int64_t last = 0;  /* the highest element index */
    int64_t count = 1; /* elements */
    int empty = 0;
    if (layout->ndim < 0 || layout->ndim > MAX_DIMS) {
        goto bad;
    }
    for (int32_t i = 0; i < layout->ndim; i++) {
        int64_t dim = layout->shape[i], step = layout->strides[i], reach;
        if (dim < 0 || step < 0) {
            goto bad;
        }
        if (dim == 0) {
            empty = 1;
        }
        else if (__builtin_mul_overflow(dim - 1, step, &reach) ||
                 __builtin_add_overflow(last, reach, &last) ||
                 __builtin_mul_overflow(count, dim, &count)) {
            goto bad;
        }
    }
    int64_t bytes;
    if (empty) {
        return 1;
    }
    if (__builtin_add_overflow(last, (int64_t)1, &last) ||
        __builtin_mul_overflow(last, (int64_t)itemsize, &bytes) ||
        __builtin_mul_overflow(count, (int64_t)itemsize, &count)) {
        goto bad;
    }
    *extent = bytes;
    return 0;
bad:
    PyErr_SetString(st->sharing_error,
                    "tensor metadata that does not fit its storage: forged or corrupted message");
    return -1;
}

PyDoc_STRVAR(dltype_doc, "dltype($module, capsule, /)\n--\n\n-> (code, bits, lanes)\n\nThe dtype "
                         "of a 'dltensor' capsule (torch's to_dlpack), not consumed.");

static PyObject *
native_dltype(PyObject *Py_UNUSED(module), PyObject *capsule)
{
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    if (managed == NULL) {
        return NULL;
    }
    DLDataType t = managed->dl_tensor.dtype;
    return Py_BuildValue("(III)", (unsigned int)t.code, (unsigned int)t.bits,
                         (unsigned int)t.lanes);
}

PyMethodDef shm_dlpack_methods[] = {
    {"dltype", native_dltype, METH_O, dltype_doc},
    {NULL, NULL, 0, NULL},
};
