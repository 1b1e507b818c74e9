/* shmreduce._native: the per-storage hot path and exact native lifetimes.
 *
 * Owns three things, and nothing else (policy stays in Python: pool.py, transfer.py):
 *
 * 1. ``Gen``: one generation of one mapped segment in this process. It knows the
 *    segment's address and size and checks every (offset, nbytes) against them before
 *    a pointer is formed (bounds, alignment, overflow): a forged or stale handle is a
 *    SharingError, never a fault.
 * 2. Storages over the mapping, made through DLPack: a uint8 tensor over
 *    [addr + offset, addr + offset + nbytes) handed to torch's own DLPack importer,
 *    whose untyped storage is returned. DLPack's structs are written here from the
 *    public spec (a stable C ABI): no torch headers, one binary for every torch.
 * 3. Native lifetimes. A Gen counts its live storages (plus explicit holds, see
 *    acquire/release). The DLPack deleter, run by torch when a storage dies, on any
 *    thread and not necessarily holding the GIL, does atomic arithmetic and
 *    lock-free pushes only: its context goes back on a free list, and the Gen whose
 *    count reached zero is pushed on the "dead" stack. ``dead()`` (GIL held) takes
 *    the stack and returns the Gens that are really dead (none revived meanwhile).
 *
 * Reference ownership: while a Gen's count is above zero, or it sits on the dead
 * stack, it owns one reference to itself (its storages can outlive every Python
 * reference to it). ``dead()`` hands that reference to its caller.
 *
 * Consumers of both lock-free stacks (the free list, the dead stack) hold the GIL, so
 * there is one consumer at a time and it takes a whole stack with one exchange: no
 * ABA problem. This module needs a GIL build of CPython.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sched.h>

/* ---- DLPack (legacy, unversioned ABI: "dltensor" capsules), from the public spec ---- */

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

enum { kDLCPU = 1, kDLUInt = 1 };

/* ---- module state (one interpreter) ---- */

#define ALIGN 64            /* every storage starts on a cache line (pool.ALIGN) */
#define QUEUED (1ULL << 63) /* Gen.state: on the dead stack */
#define COUNT (QUEUED - 1)
#define COPY_NOGIL 65536 /* copies this large release the GIL */
#define MAX_DIMS 8         /* Gen.tensor's; more dimensions take the storage path */

static PyObject *from_dlpack; /* torch._C._from_dlpack */
static PyObject *sharing_error; /* shmreduce.errors.SharingError */
static PyObject *str_untyped_storage;

typedef struct GenObject GenObject;

/* One storage's DLPack context; recycled through a lock-free free list. */
typedef struct Ctx {
    DLManagedTensor managed;
    int64_t shape[MAX_DIMS];
    int64_t strides[MAX_DIMS];
    GenObject *gen;
    struct Ctx *next;
} Ctx;

struct GenObject {
    PyObject_HEAD
    _Atomic uint64_t state; /* live storages and holds | QUEUED */
    GenObject *next;        /* on the dead stack */
    PyObject *owner;        /* the Segment (keeps the mapping) */
    PyObject *info;         /* Python's bookkeeping, opaque here */
    PyObject *weakrefs;
    char *addr;
    Py_ssize_t size;
    Py_ssize_t low;      /* first byte a storage may use (the header is below) */
    PyObject *number;    /* the generation, an int (0: not pooled) */
    int ended;           /* dead() reported it: no storage is made from it any more */
};

static _Atomic(Ctx *) free_ctx;         /* pushed by deleters */
static Ctx *spare_ctx;                  /* taken by the GIL holder */
static _Atomic(GenObject *) dead_stack; /* pushed by deleters and release() */

static PyTypeObject GenType;

/* ---- the lock-free parts: no Python API below this line until marked ---- */

static void push_dead(GenObject *gen) {
    GenObject *head = atomic_load_explicit(&dead_stack, memory_order_relaxed);
    do {
        gen->next = head;
    } while (!atomic_compare_exchange_weak_explicit(&dead_stack, &head, gen, memory_order_release, memory_order_relaxed));
}

/* One count less; the Gen goes on the dead stack when it was the last (it keeps its
 * self-reference there, so it stays valid until dead() takes it). */
static void drop_count(GenObject *gen) {
    uint64_t s = atomic_load_explicit(&gen->state, memory_order_relaxed);
    uint64_t n;
    do {
        n = s - 1;
        if ((n & COUNT) == 0 && !(s & QUEUED))
            n |= QUEUED;
    } while (!atomic_compare_exchange_weak_explicit(&gen->state, &s, n, memory_order_acq_rel, memory_order_relaxed));
    if (n == QUEUED && !(s & QUEUED))
        push_dead(gen);
}

/* torch's deleter: any thread, maybe without the GIL. Atomics and pushes only. */
static void ctx_deleter(DLManagedTensor *managed) {
    Ctx *ctx = (Ctx *)managed->manager_ctx;
    GenObject *gen = ctx->gen;
    Ctx *head = atomic_load_explicit(&free_ctx, memory_order_relaxed);
    do {
        ctx->next = head;
    } while (!atomic_compare_exchange_weak_explicit(&free_ctx, &head, ctx, memory_order_release, memory_order_relaxed));
    drop_count(gen);
}

/* ---- GIL held from here on ---- */

static Ctx *take_ctx(void) {
    if (spare_ctx == NULL)
        spare_ctx = atomic_exchange_explicit(&free_ctx, NULL, memory_order_acquire);
    Ctx *ctx = spare_ctx;
    if (ctx != NULL) {
        spare_ctx = ctx->next;
        return ctx;
    }
    ctx = PyMem_RawMalloc(sizeof(Ctx));
    if (ctx == NULL)
        PyErr_NoMemory();
    return ctx;
}

static void give_back_ctx(Ctx *ctx) {
    ctx->next = spare_ctx;
    spare_ctx = ctx;
}

/* One count more (a storage, or a hold); the first takes the self-reference. */
static void add_count(GenObject *gen) {
    uint64_t s = atomic_fetch_add_explicit(&gen->state, 1, memory_order_acq_rel);
    if (s == 0)
        Py_INCREF(gen); /* a Gen on the dead stack (s == QUEUED) has it already */
}

/* The one check a handle meets before a pointer is formed. */
static int check_range(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes) {
    if (gen->ended) {
        PyErr_Format(sharing_error, "generation %S is over: stale handle", gen->number);
        return -1;
    }
    if (nbytes <= 0 || offset < gen->low || offset > gen->size || nbytes > gen->size - offset || offset % ALIGN != 0) {
        PyErr_Format(sharing_error,
                     "handle out of bounds (%zd bytes at %zd of a %zd-byte segment): it does not match its segment "
                     "(forged or corrupted message)",
                     nbytes, offset, gen->size);
        return -1;
    }
    return 0;
}

static void capsule_destructor(PyObject *capsule) {
    /* Not consumed by torch (an error before it took ownership): let go here. */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
        if (managed != NULL)
            managed->deleter(managed);
    }
}

/* A tensor over the mapping at offset: the caller checked the range (and, for a
 * typed tensor, that its extent lies within it). ctx's dtype, shape and strides set. */
static PyObject *import_tensor(GenObject *gen, Ctx *ctx, Py_ssize_t offset) {
    ctx->gen = gen;
    ctx->managed.dl_tensor.data = gen->addr + offset;
    ctx->managed.dl_tensor.device.device_type = kDLCPU;
    ctx->managed.dl_tensor.device.device_id = 0;
    ctx->managed.dl_tensor.shape = ctx->shape;
    ctx->managed.dl_tensor.strides = ctx->strides;
    ctx->managed.dl_tensor.byte_offset = 0;
    ctx->managed.manager_ctx = ctx;
    ctx->managed.deleter = ctx_deleter;
    add_count(gen); /* before the capsule exists: its destructor may drop it */
    PyObject *capsule = PyCapsule_New(&ctx->managed, "dltensor", capsule_destructor);
    if (capsule == NULL) {
        give_back_ctx(ctx);
        drop_count(gen);
        return NULL;
    }
    PyObject *tensor = PyObject_CallOneArg(from_dlpack, capsule);
    Py_DECREF(capsule); /* consumed: torch's storage owns ctx; else the destructor let go */
    return tensor;
}

static Ctx *new_ctx(void) {
    if (from_dlpack == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmreduce._native.init() was not called");
        return NULL;
    }
    return take_ctx();
}

/* The untyped storage over [offset, offset + nbytes) of the mapping; range checked. */
static PyObject *make_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes) {
    Ctx *ctx = new_ctx();
    if (ctx == NULL)
        return NULL;
    ctx->managed.dl_tensor.ndim = 1;
    ctx->managed.dl_tensor.dtype.code = kDLUInt;
    ctx->managed.dl_tensor.dtype.bits = 8;
    ctx->managed.dl_tensor.dtype.lanes = 1;
    ctx->shape[0] = nbytes;
    ctx->strides[0] = 1;
    PyObject *tensor = import_tensor(gen, ctx, offset);
    if (tensor == NULL)
        return NULL;
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, str_untyped_storage);
    Py_DECREF(tensor);
    return storage;
}

static int parse_range(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_ssize_t *offset, Py_ssize_t *nbytes) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    if (!PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(sharing_error, "handle offset and size must be ints (forged or corrupted message)");
        return -1;
    }
    *offset = PyLong_AsSsize_t(args[0]);
    *nbytes = PyLong_AsSsize_t(args[1]);
    if ((*offset == -1 || *nbytes == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(sharing_error, "handle offset or size out of range (forged or corrupted message)");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gen_storage_doc, "storage(offset, nbytes) -> UntypedStorage\n\n"
                              "The storage over nbytes at offset of the segment (checked first: SharingError).");

static PyObject *gen_storage(GenObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, nbytes;
    if (parse_range(args, nargs, 2, &offset, &nbytes) < 0 || check_range(self, offset, nbytes) < 0)
        return NULL;
    return make_storage(self, offset, nbytes);
}

PyDoc_STRVAR(gen_place_doc, "place(offset, nbytes, source) -> UntypedStorage\n\n"
                            "Copy nbytes from address source (0: zeros) to offset, then storage(offset, nbytes).\n"
                            "source is the data_ptr() of a live CPU storage of at least nbytes (the caller's).");

static PyObject *gen_place(GenObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, nbytes;
    if (parse_range(args, nargs, 3, &offset, &nbytes) < 0 || check_range(self, offset, nbytes) < 0)
        return NULL;
    void *source = PyLong_AsVoidPtr(args[2]);
    if (source == NULL && PyErr_Occurred())
        return NULL;
    char *dest = self->addr + offset;
    if (nbytes >= COPY_NOGIL) {
        Py_BEGIN_ALLOW_THREADS
        if (source == NULL)
            memset(dest, 0, (size_t)nbytes);
        else
            memmove(dest, source, (size_t)nbytes);
        Py_END_ALLOW_THREADS
    } else if (source == NULL) {
        memset(dest, 0, (size_t)nbytes);
    } else {
        memmove(dest, source, (size_t)nbytes);
    }
    return make_storage(self, offset, nbytes);
}

PyDoc_STRVAR(gen_tensor_doc,
             "tensor(offset, nbytes, dtype, itemsize, size, stride) -> Tensor\n\n"
             "A tensor of DLPack dtype (code, bits, lanes) over exactly the storage storage(offset, nbytes) "
             "would be, or None where its elements do not reach exactly the last of the nbytes (torch would "
             "make a storage of their extent), it has no element or more than 8 dimensions: then make it "
             "over storage(). Malformed size or stride (not ints, negative, overflowing): SharingError.");

/* Fills ctx's shape and strides from two tuples of ints and gives the byte extent
 * they reach: 0, or 1 for a layout DLPack cannot carry as this storage (no element,
 * too many dimensions), or -1 (SharingError) for a malformed one. */
static int parse_layout(PyObject *size, PyObject *stride, Py_ssize_t itemsize, Ctx *ctx, int32_t *ndim, int64_t *extent) {
    if (!PyTuple_CheckExact(size) || !PyTuple_CheckExact(stride) || PyTuple_GET_SIZE(size) != PyTuple_GET_SIZE(stride)) {
        PyErr_SetString(sharing_error, "tensor size and stride must be tuples of one length (forged or corrupted message)");
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(size);
    if (n > MAX_DIMS)
        return 1;
    int64_t last = 0; /* the highest element index */
    int empty = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyTuple_GET_ITEM(size, i), *st = PyTuple_GET_ITEM(stride, i);
        if (!PyLong_CheckExact(d) || !PyLong_CheckExact(st))
            goto bad;
        long long dim = PyLong_AsLongLong(d), step = PyLong_AsLongLong(st);
        if ((dim == -1 || step == -1) && PyErr_Occurred()) {
            PyErr_Clear();
            goto bad;
        }
        if (dim < 0 || step < 0)
            goto bad;
        if (dim == 0)
            empty = 1;
        else if (__builtin_mul_overflow((int64_t)(dim - 1), (int64_t)step, &ctx->shape[i]) ||
                 __builtin_add_overflow(last, ctx->shape[i], &last))
            goto bad;
        ctx->shape[i] = dim;
        ctx->strides[i] = step;
    }
    int64_t bytes;
    if (empty)
        return 1;
    if (__builtin_add_overflow(last, (int64_t)1, &last) || __builtin_mul_overflow(last, (int64_t)itemsize, &bytes))
        goto bad;
    *ndim = (int32_t)n;
    *extent = bytes;
    return 0;
bad:
    PyErr_SetString(sharing_error, "tensor metadata that does not fit its storage: forged or corrupted message");
    return -1;
}

static PyObject *gen_tensor(GenObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t offset, nbytes;
    if (parse_range(args, nargs, 6, &offset, &nbytes) < 0 || check_range(self, offset, nbytes) < 0)
        return NULL;
    unsigned int code, bits, lanes;
    Py_ssize_t itemsize = PyLong_AsSsize_t(args[3]);
    if (!PyArg_ParseTuple(args[2], "III", &code, &bits, &lanes) || (itemsize == -1 && PyErr_Occurred()))
        return NULL;
    if (itemsize <= 0 || code > 255 || bits > 255 || lanes > 65535) {
        PyErr_SetString(PyExc_ValueError, "not a DLPack dtype");
        return NULL;
    }
    Ctx *ctx = new_ctx();
    if (ctx == NULL)
        return NULL;
    int32_t ndim = 0;
    int64_t extent = 0;
    int parsed = parse_layout(args[4], args[5], itemsize, ctx, &ndim, &extent);
    if (parsed != 0 || extent != nbytes) { /* torch would make a storage of the extent: not this storage */
        give_back_ctx(ctx);
        if (parsed < 0)
            return NULL;
        Py_RETURN_NONE;
    }
    ctx->managed.dl_tensor.ndim = ndim;
    ctx->managed.dl_tensor.dtype.code = (uint8_t)code;
    ctx->managed.dl_tensor.dtype.bits = (uint8_t)bits;
    ctx->managed.dl_tensor.dtype.lanes = (uint16_t)lanes;
    return import_tensor(self, ctx, offset);
}

PyDoc_STRVAR(gen_acquire_doc, "acquire() -> bool\n\nHold the generation as a storage would (a slab's owner, a parked receiver, "
                              "a load in progress); False, holding nothing, once dead() has reported it.");

static PyObject *gen_acquire(GenObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->ended)
        Py_RETURN_FALSE;
    add_count(self);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(gen_release_doc, "release()\n\nLet go of one acquire() (or of the hold a Gen is made with).");

static PyObject *gen_release(GenObject *self, PyObject *Py_UNUSED(ignored)) {
    if ((atomic_load(&self->state) & COUNT) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "release() of a generation nobody holds");
        return NULL;
    }
    drop_count(self);
    Py_RETURN_NONE;
}

static PyObject *gen_get_live(GenObject *self, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(atomic_load(&self->state) & COUNT);
}

static PyObject *gen_get_ended(GenObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->ended);
}

static PyObject *gen_get_info(GenObject *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(self->info);
}

static int gen_set_info(GenObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "info cannot be deleted");
        return -1;
    }
    Py_SETREF(self->info, Py_NewRef(value));
    return 0;
}

static PyObject *gen_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"owner", "addr", "size", "number", "low", NULL};
    PyObject *owner, *addr_obj, *number;
    Py_ssize_t size, low;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnO!n", kwlist, &owner, &addr_obj, &size, &PyLong_Type, &number, &low))
        return NULL;
    void *addr = PyLong_AsVoidPtr(addr_obj);
    if (addr == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Gen over a null address");
        return NULL;
    }
    if (size < 8 || low < 0 || low > size) {
        PyErr_Format(PyExc_ValueError, "Gen of a %zd-byte segment from byte %zd", size, low);
        return NULL;
    }
    GenObject *self = (GenObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    atomic_init(&self->state, 1); /* the maker's hold: release() it */
    Py_INCREF(self);              /* ... which owns the self-reference */
    self->next = NULL;
    self->owner = Py_NewRef(owner);
    self->info = Py_NewRef(Py_None);
    self->weakrefs = NULL;
    self->addr = addr;
    self->size = size;
    self->low = low;
    self->number = Py_NewRef(number);
    self->ended = 0;
    return (PyObject *)self;
}

static void gen_dealloc(GenObject *self) {
    /* Only reached with no count and off the dead stack: the self-reference is gone. */
    if (self->weakrefs != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Py_XDECREF(self->owner);
    Py_XDECREF(self->info);
    Py_XDECREF(self->number);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef gen_methods[] = {
    {"storage", (PyCFunction)(void (*)(void))gen_storage, METH_FASTCALL, gen_storage_doc},
    {"place", (PyCFunction)(void (*)(void))gen_place, METH_FASTCALL, gen_place_doc},
    {"tensor", (PyCFunction)(void (*)(void))gen_tensor, METH_FASTCALL, gen_tensor_doc},
    {"acquire", (PyCFunction)gen_acquire, METH_NOARGS, gen_acquire_doc},
    {"release", (PyCFunction)gen_release, METH_NOARGS, gen_release_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef gen_members[] = {
    {"owner", T_OBJECT, offsetof(GenObject, owner), READONLY, "the segment"},
    {"number", T_OBJECT, offsetof(GenObject, number), READONLY, "the generation"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef gen_getset[] = {
    {"live", (getter)gen_get_live, NULL, "storages and holds alive now", NULL},
    {"ended", (getter)gen_get_ended, NULL, "dead() reported it", NULL},
    {"info", (getter)gen_get_info, (setter)gen_set_info, "the pool's bookkeeping", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GenType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shmreduce._native.Gen",
    .tp_basicsize = sizeof(GenObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Gen(owner, addr, size, number, low)\n\nA generation of a mapped segment in this process; "
                        "made held once (release() it)."),
    .tp_new = gen_new,
    .tp_dealloc = (destructor)gen_dealloc,
    .tp_weaklistoffset = offsetof(GenObject, weakrefs),
    .tp_methods = gen_methods,
    .tp_members = gen_members,
    .tp_getset = gen_getset,
};

/* ---- module functions ---- */

PyDoc_STRVAR(dead_doc, "dead() -> list[Gen]\n\nThe generations whose last storage and hold died since the last call, "
                       "each once; each is ended.");

static PyObject *native_dead(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    PyObject *result = PyList_New(0);
    if (result == NULL)
        return NULL;
    GenObject *gen = atomic_exchange_explicit(&dead_stack, NULL, memory_order_acquire);
    while (gen != NULL) {
        GenObject *next = gen->next;
        uint64_t s = atomic_load_explicit(&gen->state, memory_order_acquire);
        int dead;
        for (;;) {
            /* QUEUED with no count: dead (its self-reference is ours now). Else it was
             * revived while queued: off the stack, its storages keep the reference. */
            uint64_t n = (s == QUEUED) ? 0 : (s & ~QUEUED);
            if (atomic_compare_exchange_weak_explicit(&gen->state, &s, n, memory_order_acq_rel, memory_order_acquire)) {
                dead = n == 0;
                break;
            }
        }
        if (dead) {
            gen->ended = 1;
            if (PyList_Append(result, (PyObject *)gen) < 0) {
                /* Out of memory: this one and the rest go back on the stack for the
                 * next call; what the list holds is reported now. */
                PyErr_Clear();
                gen->ended = 0;
                atomic_store(&gen->state, QUEUED);
                gen->next = next;
                GenObject *tail = gen;
                while (tail->next != NULL)
                    tail = tail->next;
                GenObject *head = atomic_load(&dead_stack);
                do {
                    tail->next = head;
                } while (!atomic_compare_exchange_weak(&dead_stack, &head, gen));
                return result;
            }
            Py_DECREF(gen); /* the list holds it now */
        }
        gen = next;
    }
    return result;
}

PyDoc_STRVAR(pending_doc, "pending() -> bool\n\nWhether dead() has something to report (one atomic load).");

static PyObject *native_pending(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return PyBool_FromLong(atomic_load_explicit(&dead_stack, memory_order_relaxed) != NULL);
}

PyDoc_STRVAR(dltype_doc, "dltype(capsule) -> (code, bits, lanes)\n\nThe dtype of a 'dltensor' capsule (torch's to_dlpack), not consumed.");

static PyObject *native_dltype(PyObject *Py_UNUSED(module), PyObject *capsule) {
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    if (managed == NULL)
        return NULL;
    DLDataType t = managed->dl_tensor.dtype;
    return Py_BuildValue("(III)", (unsigned int)t.code, (unsigned int)t.bits, (unsigned int)t.lanes);
}

PyDoc_STRVAR(init_doc, "init(from_dlpack, error)\n\nBind torch's DLPack importer and the exception type handles raise.");

static PyObject *native_init(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *importer, *error;
    if (!PyArg_ParseTuple(args, "OO", &importer, &error))
        return NULL;
    if (!PyCallable_Check(importer) || !PyType_Check(error) || !PyType_IsSubtype((PyTypeObject *)error, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "init(callable, exception type)");
        return NULL;
    }
    Py_XSETREF(from_dlpack, Py_NewRef(importer));
    Py_XSETREF(sharing_error, Py_NewRef(error));
    Py_RETURN_NONE;
}

/* ---- a pooled segment's header: the generation and its counters, shared ----
 *
 * The first HEADER bytes of a pooled segment are shared by every process that maps
 * it: [0] the generation (u64), [8] refs sent (u64), [16] refs loaded (u64), [24]
 * holders (u64: processes holding the generation, FREEING while its owner checks it
 * free). Every access is atomic. A receiver counts itself a holder before it trusts
 * the generation (hdr_hold), so its owner, which frees a generation only with no
 * holder and every ref sent loaded (hdr_free), never frees one under a load.
 */

#define HDR_GEN 0
#define HDR_SENT 1
#define HDR_LOADED 2
#define HDR_HOLDERS 3
#define FREEING (1ULL << 63)
#define SPIN_LIMIT 1000000

static _Atomic uint64_t *header_of(PyObject *addr_obj) {
    void *addr = PyLong_AsVoidPtr(addr_obj);
    if (addr == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "header at a null address");
        return NULL;
    }
    if ((uintptr_t)addr % 8) {
        PyErr_SetString(PyExc_ValueError, "header at an unaligned address");
        return NULL;
    }
    return (_Atomic uint64_t *)addr;
}

static int parse_header_gen(PyObject *const *args, Py_ssize_t nargs, const char *name, _Atomic uint64_t **h, uint64_t *gen) {
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s(addr, gen)", name);
        return -1;
    }
    *h = header_of(args[0]);
    if (*h == NULL)
        return -1;
    *gen = PyLong_AsUnsignedLongLongMask(args[1]);
    if (*gen == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

PyDoc_STRVAR(hdr_count_doc, "hdr_sent(addr) / hdr_loaded(addr)\n\nCount one ref sent / loaded in the generation of the header at addr.");

static PyObject *count_ref(PyObject *addr, int field) {
    _Atomic uint64_t *h = header_of(addr);
    if (h == NULL)
        return NULL;
    atomic_fetch_add(&h[field], 1);
    Py_RETURN_NONE;
}

static PyObject *hdr_sent(PyObject *Py_UNUSED(module), PyObject *addr) {
    return count_ref(addr, HDR_SENT);
}

static PyObject *hdr_loaded(PyObject *Py_UNUSED(module), PyObject *addr) {
    return count_ref(addr, HDR_LOADED);
}

PyDoc_STRVAR(hdr_hold_doc, "hdr_hold(addr, gen) -> bool\n\nCount this process a holder of generation gen, then check that the "
                           "header holds gen: False (holding nothing) if it holds another, or is being freed for good.");

static PyObject *hdr_hold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *h;
    uint64_t gen;
    if (parse_header_gen(args, nargs, "hdr_hold", &h, &gen) < 0)
        return NULL;
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    for (long spins = 0;; spins++) {
        if (n & FREEING) {
            /* its owner is checking it free (a few instructions): wait, briefly */
            if (spins >= SPIN_LIMIT)
                Py_RETURN_FALSE;
            sched_yield();
            n = atomic_load(&h[HDR_HOLDERS]);
            continue;
        }
        if (atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n + 1))
            break;
    }
    if (atomic_load(&h[HDR_GEN]) != gen) {
        atomic_fetch_sub(&h[HDR_HOLDERS], 1);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(hdr_unhold_doc, "hdr_unhold(addr, gen) -> bool\n\nCount one holder of generation gen less; False (nothing done) if the "
                             "header holds another generation or no holder.");

static PyObject *hdr_unhold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *h;
    uint64_t gen;
    if (parse_header_gen(args, nargs, "hdr_unhold", &h, &gen) < 0)
        return NULL;
    if (atomic_load(&h[HDR_GEN]) != gen)
        Py_RETURN_FALSE;
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    do {
        if ((n & ~FREEING) == 0)
            Py_RETURN_FALSE;
    } while (!atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n - 1));
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(hdr_free_doc, "hdr_free(addr, gen) -> bool\n\nThe owner, its own storages of gen all dead: if nobody holds gen and every "
                           "ref sent was loaded, end it (generation 0, counters zeroed: a stale ref is refused) and return True.");

static PyObject *hdr_free(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *h;
    uint64_t gen;
    if (parse_header_gen(args, nargs, "hdr_free", &h, &gen) < 0)
        return NULL;
    uint64_t zero = 0;
    if (!atomic_compare_exchange_strong(&h[HDR_HOLDERS], &zero, FREEING))
        Py_RETURN_FALSE; /* held (or being freed by another thread) */
    /* From here no new holder until FREEING goes: sent == loaded now means every ref
     * sent was loaded by a holder that has let go since. */
    int free = atomic_load(&h[HDR_GEN]) == gen && atomic_load(&h[HDR_SENT]) == atomic_load(&h[HDR_LOADED]);
    if (free) {
        atomic_store(&h[HDR_GEN], 0);
        atomic_store(&h[HDR_SENT], 0);
        atomic_store(&h[HDR_LOADED], 0);
    }
    atomic_store(&h[HDR_HOLDERS], 0);
    return PyBool_FromLong(free);
}

PyDoc_STRVAR(hdr_read_doc, "hdr_read(addr) -> (gen, sent, loaded, holders)\n\nThe header at addr, each field read atomically.");

static PyObject *hdr_read(PyObject *Py_UNUSED(module), PyObject *addr) {
    _Atomic uint64_t *h = header_of(addr);
    if (h == NULL)
        return NULL;
    return Py_BuildValue("KKKK", (unsigned long long)atomic_load(&h[HDR_GEN]), (unsigned long long)atomic_load(&h[HDR_SENT]),
                         (unsigned long long)atomic_load(&h[HDR_LOADED]), (unsigned long long)atomic_load(&h[HDR_HOLDERS]));
}

static PyMethodDef native_methods[] = {
    {"hdr_sent", hdr_sent, METH_O, hdr_count_doc},
    {"hdr_loaded", hdr_loaded, METH_O, hdr_count_doc},
    {"hdr_hold", (PyCFunction)(void (*)(void))hdr_hold, METH_FASTCALL, hdr_hold_doc},
    {"hdr_unhold", (PyCFunction)(void (*)(void))hdr_unhold, METH_FASTCALL, hdr_unhold_doc},
    {"hdr_free", (PyCFunction)(void (*)(void))hdr_free, METH_FASTCALL, hdr_free_doc},
    {"hdr_read", hdr_read, METH_O, hdr_read_doc},

    {"dead", native_dead, METH_NOARGS, dead_doc},
    {"pending", native_pending, METH_NOARGS, pending_doc},
    {"dltype", native_dltype, METH_O, dltype_doc},
    {"init", native_init, METH_VARARGS, init_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shmreduce._native",
    .m_doc = PyDoc_STR("shmreduce's per-storage hot path: checked storages over shared memory, native lifetimes."),
    .m_size = -1,
    .m_methods = native_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&GenType) < 0)
        return NULL;
    str_untyped_storage = PyUnicode_InternFromString("untyped_storage");
    if (str_untyped_storage == NULL)
        return NULL;
    sharing_error = Py_NewRef(PyExc_RuntimeError); /* until init() */
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Gen", (PyObject *)&GenType) < 0 || PyModule_AddIntConstant(module, "ALIGN", ALIGN) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
