/* shmreduce._native: the per-storage hot path and exact native lifetimes.
 *
 * Owns these, and nothing else (policy stays in Python: pool.py, transfer.py,
 * reductions.py):
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
 * 4. A plain CPU tensor in one call each way: ``reduce()`` (the pickler's reducer
 *    for torch.Tensor: into this thread's slab, or from where it lies) and
 *    ``rebuild()`` (what pickles name: through a Gen this process holds). Each does
 *    the common case and hands every other one to the Python it stands in for
 *    (reductions.reduce_tensor / rebuild_tensor), which decides what is indexed,
 *    published and filled. Every mapped segment is in one table by address.
 * 5. A pooled segment's shared header, updated atomically (below).
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
#include <poll.h>
#include <sched.h>
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <time.h>

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
/* Copies this large release the GIL: only storages reduce() never moves (it takes
 * none above SLAB_ITEM_MAX, and takes no stripe lock), so no other thread can swap
 * the source away and free it under the copy (issue 28, item 4: at exactly 64 KiB). */
#define COPY_NOGIL (SLAB_ITEM_MAX + 1)
#define MAX_DIMS 8         /* rebuild()'s; more dimensions take the storage path */
#define SLAB_ITEM_MAX 65536 /* pool.SLAB_ITEM_MAX: larger storages take the general path */

static PyObject *from_dlpack; /* torch._C._from_dlpack */
static PyObject *sharing_error; /* shmreduce.errors.SharingError */
static PyObject *str_untyped_storage;
/* rebuild()'s: the general rebuild it hands every other case to (reductions.rebuild_tensor),
 * and from init(): torch dtype -> (code, bits, lanes, itemsize), the receiver's live Gens
 * by their refs' (kind, directory, segment, generation) */
static PyObject *slow_rebuild, *dtypes, *live;
/* reduce()'s, from init_send(): what it returns to rebuild with (rebuild), what it takes
 * (torch.Tensor, exactly; torch.strided), torch.multiprocessing's globals (the strategy),
 * torch's own UntypedStorage.is_shared; and the general reduce it hands the rest to */
static PyObject *rebuild_fn, *tensor_type, *strided, *strategy_globals, *torch_is_shared, *slow_reduce;
static int watched = -1;                 /* the post connection to this program's broker, or -1 */
static _Thread_local PyObject *outgoing; /* the sending() scope's header addresses, or NULL */
static _Thread_local int checked;        /* this message found its broker live */
static unsigned long long shares, shared_bytes, reuses;
enum { S_REQUIRES_GRAD, S_BACKWARD_HOOKS, S_LAYOUT, S_IS_CPU, S_IS_NESTED, S_NBYTES, S_DATA_PTR, S_SWAP, S_DTYPE,
       S_SIZE, S_STRIDE, S_STORAGE_OFFSET, S_SHARING_STRATEGY, S_FILE_SYSTEM, S_SLAB_FD, S_SLAB_FS, N_NAMES };
static const char *const name_text[N_NAMES] = {
    "requires_grad", "_backward_hooks", "layout", "is_cpu", "is_nested", "nbytes", "data_ptr", "_swap_data_ptr_", "dtype",
    "size", "stride", "storage_offset", "_sharing_strategy", "file_system", "shmreduce.slab.fd", "shmreduce.slab.fs"};
static PyObject *names[N_NAMES];
static unsigned long long loads, loaded_bytes; /* rebuild()'s own, GIL held */

typedef struct GenObject GenObject;

/* One storage's DLPack context; recycled through a lock-free free list. */
typedef struct Ctx {
    DLManagedTensor managed;
    int64_t shape[MAX_DIMS];
    int64_t strides[MAX_DIMS];
    GenObject *gen;
    struct Ctx *next;
    _Atomic int importing; /* import_tensor() is inside torch's importer with it */
    _Atomic int deleted;   /* the deleter ran while importing: import_tensor() recycles it */
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
    PyObject *key;       /* its key in live, or NULL */
    PyObject *ref;       /* indexed for reduce(): its refs' (kind, directory, segment, generation, tag), or NULL */
    Py_ssize_t cursor;   /* a slab's next free offset */
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
    if (atomic_load_explicit(&ctx->importing, memory_order_acquire)) {
        /* torch's importer failed after taking the tensor (issue 28, item 2): the count
         * goes now, once; import_tensor() recycles the context (no second deleter). */
        atomic_store_explicit(&ctx->deleted, 1, memory_order_release);
        drop_count(gen);
        return;
    }
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
    /* Any offset a storage can lie at (SPEC 2: torch.from_numpy(t.numpy()[1:]) of a shared
     * tensor lies 4 bytes into a cache line): the bounds are what a pointer needs. */
    if (nbytes <= 0 || offset < gen->low || offset > gen->size || nbytes > gen->size - offset) {
        PyErr_Format(sharing_error,
                     "handle out of bounds (%zd bytes at %zd of a %zd-byte segment): it does not match its segment "
                     "(forged or corrupted message)",
                     nbytes, offset, gen->size);
        return -1;
    }
    return 0;
}

/* A tensor over the mapping at offset: the caller checked the range (and, for a
 * typed tensor, that its extent lies within it). ctx's dtype, shape and strides set.
 * A failed import changes no count, whether torch's importer called the deleter
 * (then ctx->deleted says so, not the capsule's name) or never took the tensor. */
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
    atomic_store(&ctx->deleted, 0);
    atomic_store(&ctx->importing, 1);
    add_count(gen);
    PyObject *capsule = PyCapsule_New(&ctx->managed, "dltensor", NULL);
    if (capsule == NULL) {
        atomic_store(&ctx->importing, 0);
        give_back_ctx(ctx);
        drop_count(gen);
        return NULL;
    }
    PyObject *tensor = PyObject_CallOneArg(from_dlpack, capsule);
    int consumed = !PyCapsule_IsValid(capsule, "dltensor"); /* torch renames what it takes */
    Py_DECREF(capsule);
    int deleted = atomic_load(&ctx->deleted); /* read before importing goes: a later deleter recycles ctx itself */
    atomic_store(&ctx->importing, 0);
    if (tensor != NULL)
        return tensor; /* torch's storage owns ctx: its deleter recycles it */
    if (deleted) {
        give_back_ctx(ctx); /* the deleter ran inside the importer: the count went there */
    } else if (!consumed) {
        give_back_ctx(ctx); /* never taken */
        drop_count(gen);
    } /* else torch holds it still: its deleter lets go, later */
    return NULL;
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
        if (check_range(self, offset, nbytes) < 0) /* ended while the copy ran without the GIL */
            return NULL;
    } else if (source == NULL) {
        memset(dest, 0, (size_t)nbytes);
    } else {
        memmove(dest, source, (size_t)nbytes);
    }
    return make_storage(self, offset, nbytes);
}

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

PyDoc_STRVAR(gen_acquire_doc, "acquire() -> bool\n\nHold the generation as a storage would (a slab's owner, "
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

PyDoc_STRVAR(gen_publish_doc, "publish(key)\n\nMake rebuild() load refs whose first four fields are key through this Gen, "
                              "until dead() reports it (a receiver's, held: Python checked the generation).");

static PyObject *gen_publish(GenObject *self, PyObject *key) {
    if (live == NULL || self->ended || self->key != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "publish() before init(), of an ended Gen, or twice");
        return NULL;
    }
    if (PyDict_SetItem(live, key, (PyObject *)self) < 0)
        return NULL;
    self->key = Py_NewRef(key);
    Py_RETURN_NONE;
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
    self->key = NULL;
    self->ref = NULL;
    self->cursor = low;
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
    Py_XDECREF(self->key);
    Py_XDECREF(self->ref);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A weak reference's referent (a new reference), or NULL (no error set) if it died. */
static PyObject *referent(PyObject *weak) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(weak, &obj) < 0)
        PyErr_Clear();
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(weak);
    return obj == Py_None || obj == NULL ? (PyErr_Clear(), NULL) : Py_NewRef(obj);
#endif
}

/* ---- mapped segments, by address ----
 *
 * Every segment Python maps (mapped() / unmapped(), the latter before it unmaps it),
 * with a weak reference to its Segment (segment_at()), and the Gen reduce() sends
 * storages lying in it from: one Python indexed (Gen.index) once it sent a ref from
 * it itself (its memfd deposited, its file's tag computed). A Gen leaves when dead()
 * reports it, all leave at unindex_all() (a new broker, a sealed file, a fork). A
 * storage in a segment with no indexed Gen takes the general path: it is never moved
 * again. Strong references. */

typedef struct {
    char *addr;
    Py_ssize_t size;
    PyObject *segment; /* a weak reference */
    GenObject *gen;    /* indexed, or NULL */
} Range;

static Range *ranges;
static Py_ssize_t n_ranges, cap_ranges;

/* The position of the last range whose address is <= addr, or -1. */
static Py_ssize_t range_find(uintptr_t addr) {
    Py_ssize_t lo = 0, hi = n_ranges;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if ((uintptr_t)ranges[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo - 1;
}

/* The range holding [ptr, ptr + nbytes), or NULL. */
static Range *range_at(uintptr_t ptr, Py_ssize_t nbytes) {
    Py_ssize_t i = range_find(ptr);
    if (i < 0)
        return NULL;
    uintptr_t at = ptr - (uintptr_t)ranges[i].addr;
    return nbytes >= 0 && at <= (uintptr_t)ranges[i].size && (uintptr_t)nbytes <= (uintptr_t)ranges[i].size - at ? &ranges[i] : NULL;
}

/* The range starting exactly at addr, or NULL. */
static Range *range_of(const char *addr) {
    Py_ssize_t i = range_find((uintptr_t)addr);
    return i >= 0 && ranges[i].addr == addr ? &ranges[i] : NULL;
}

static void unindex(GenObject *gen) {
    if (gen->ref == NULL)
        return;
    Py_CLEAR(gen->ref);
    Range *r = range_of(gen->addr);
    if (r != NULL && r->gen == gen) {
        r->gen = NULL;
        Py_DECREF(gen);
    }
}

PyDoc_STRVAR(gen_index_doc, "index(ref)\n\nSend storages in this Gen from reduce(), with refs (*ref[:4], offset, nbytes, ref[4]).");

static PyObject *gen_index(GenObject *self, PyObject *ref) {
    Range *r = range_of(self->addr);
    if (!PyTuple_CheckExact(ref) || PyTuple_GET_SIZE(ref) != 5 || self->ended || r == NULL || r->size != self->size) {
        PyErr_SetString(PyExc_ValueError, "index((kind, directory, segment, generation, tag)) of a live Gen of a mapped segment");
        return NULL;
    }
    if (r->gen != NULL)
        unindex(r->gen); /* an earlier Gen of the segment, not reported dead yet */
    Py_XSETREF(self->ref, Py_NewRef(ref));
    r->gen = (GenObject *)Py_NewRef(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mapped_doc, "mapped(addr, size, segment) / unmapped(addr)\n\nA segment mapped at addr (segment: a weak reference "
                         "to it) / no longer (before its munmap).");

static PyObject *native_mapped(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    char *addr = nargs == 3 ? PyLong_AsVoidPtr(args[0]) : NULL;
    Py_ssize_t size = addr != NULL ? PyLong_AsSsize_t(args[1]) : -1;
    if (addr == NULL || size <= 0 || !PyWeakref_Check(args[2])) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "mapped(addr, size, weakref)");
        return NULL;
    }
    if (range_of(addr) != NULL) {
        PyErr_SetString(PyExc_ValueError, "mapped() twice at one address");
        return NULL;
    }
    if (n_ranges == cap_ranges) {
        Py_ssize_t cap = cap_ranges ? 2 * cap_ranges : 64;
        Range *grown = PyMem_Realloc(ranges, (size_t)cap * sizeof(Range));
        if (grown == NULL)
            return PyErr_NoMemory();
        ranges = grown;
        cap_ranges = cap;
    }
    Py_ssize_t i = range_find((uintptr_t)addr) + 1;
    memmove(&ranges[i + 1], &ranges[i], (size_t)(n_ranges - i) * sizeof(Range));
    ranges[i] = (Range){addr, size, Py_NewRef(args[2]), NULL};
    n_ranges++;
    Py_RETURN_NONE;
}

static void drop_range(Range *r) {
    if (r->gen != NULL)
        unindex(r->gen);
    Py_XDECREF(r->segment);
    Py_ssize_t i = r - ranges;
    memmove(r, r + 1, (size_t)(n_ranges - i - 1) * sizeof(Range));
    n_ranges--;
}

static PyObject *native_unmapped(PyObject *Py_UNUSED(module), PyObject *addr) {
    char *at = PyLong_AsVoidPtr(addr);
    if (at == NULL && PyErr_Occurred())
        return NULL;
    Range *r = range_of(at);
    if (r != NULL)
        drop_range(r);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(forget_mapped_doc, "forget_mapped()\n\nForget every segment (a forked child that acts as a new process).");

static PyObject *native_forget_mapped(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    while (n_ranges > 0)
        drop_range(&ranges[n_ranges - 1]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(segment_at_doc, "segment_at(ptr, nbytes) -> Segment | None\n\nThe mapped segment holding nbytes at ptr.");

static PyObject *native_segment_at(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "segment_at(ptr, nbytes)");
        return NULL;
    }
    void *ptr = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred())
        return NULL;
    Range *r = range_at((uintptr_t)ptr, nbytes);
    PyObject *segment = r != NULL ? referent(r->segment) : NULL;
    return segment != NULL ? segment : Py_NewRef(Py_None);
}

PyDoc_STRVAR(unindex_all_doc, "unindex_all()\n\nreduce() sends from no Gen until Python indexes it again.");

static PyObject *native_unindex_all(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    for (Py_ssize_t i = 0; i < n_ranges; i++)
        if (ranges[i].gen != NULL)
            unindex(ranges[i].gen);
    Py_RETURN_NONE;
}

static PyMethodDef gen_methods[] = {
    {"storage", (PyCFunction)(void (*)(void))gen_storage, METH_FASTCALL, gen_storage_doc},
    {"place", (PyCFunction)(void (*)(void))gen_place, METH_FASTCALL, gen_place_doc},
    {"acquire", (PyCFunction)gen_acquire, METH_NOARGS, gen_acquire_doc},
    {"release", (PyCFunction)gen_release, METH_NOARGS, gen_release_doc},
    {"publish", (PyCFunction)gen_publish, METH_O, gen_publish_doc},
    {"index", (PyCFunction)gen_index, METH_O, gen_index_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef gen_members[] = {
    {"cursor", T_PYSSIZET, offsetof(GenObject, cursor), 0, "a slab's next free offset (reduce() and pool.Pool.place move it)"},
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

/* Out of live: rebuild() loads through it no more (never fails: dead() must not). */
static void unpublish(GenObject *gen) {
    if (gen->key == NULL)
        return;
    PyObject *found = PyDict_GetItemWithError(live, gen->key);
    if (found == (PyObject *)gen && PyDict_DelItem(live, gen->key) < 0)
        found = NULL;
    if (found == NULL)
        PyErr_Clear();
    Py_CLEAR(gen->key);
}

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
            unpublish(gen);
            unindex(gen);
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

PyDoc_STRVAR(init_doc, "init(from_dlpack, error, dtypes, live)\n\nBind torch's DLPack importer, the exception type handles raise, "
                       "and rebuild()'s dtype table and live Gens (dicts the caller fills).");

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
    Py_XSETREF(live, Py_NewRef(gens));
    Py_RETURN_NONE;
}

/* ---- a pooled segment's header: the generation and its counters, shared ----
 *
 * The first HEADER_BYTES of a pooled segment are shared by every process that maps
 * it (u64 words, every access atomic; the rules they follow are written once, in
 * broker/protocol.py, "Lifetimes"):
 *   [0] the generation        [1] refs sent (counted when their message is pickled whole)
 *   [2] refs loaded (first loads only)   [3] holders (processes holding the generation,
 *       FREEING while its owner checks it free)   [4] tickets issued   [5] flags
 *   [8..] one bit per ticket: set by the first load of the ref that carries it.
 * A ref carries a ticket, drawn from [4] when it is pickled: its first load sets the
 * ticket's bit and counts it loaded, a repeated load finds the bit set and counts
 * nothing, so sent == loaded means exactly "no message naming the generation waits
 * for its first load". A ticket past the bitmap cannot be told from a repeat: it
 * retires the generation (RETIRED | UNCOUNTED). A RETIRED generation is never reused
 * (hdr_free refuses it): set where a hold cannot be counted exactly (a fork, a
 * process dead in the middle of taking or letting go of a hold), its pages go back
 * to the system when the last mapping and descriptor go, as torch's do.
 */

#define HEADER_BYTES 4096
#define HDR_GEN 0
#define HDR_SENT 1
#define HDR_LOADED 2
#define HDR_HOLDERS 3
#define HDR_ISSUED 4
#define HDR_FLAGS 5
#define HDR_BITS 8
#define TICKETS ((uint64_t)(HEADER_BYTES / 8 - HDR_BITS) * 64)
#define RETIRED 1ULL
#define UNCOUNTED 2ULL
#define FREEING (1ULL << 63)
#define FREEING_WAIT_NS 1000000000LL /* hdr_hold's wait for an owner's check (a few instructions) */

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
    *gen = PyLong_AsUnsignedLongLong(args[1]); /* a header holds 64 bits: a wider one is an error, never truncated */
    if (*gen == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

/* A ref's ticket drawn from the header h (the generation is held: by its owner's
 * storage, or by the sender's own hold of a storage it forwards). */
static uint64_t issue_ticket(_Atomic uint64_t *h) {
    uint64_t ticket = atomic_fetch_add(&h[HDR_ISSUED], 1);
    if (ticket >= TICKETS)
        atomic_fetch_or(&h[HDR_FLAGS], RETIRED | UNCOUNTED);
    return ticket;
}

/* The ref of ticket t loaded (the generation held here): counted once, at its first
 * load. A ticket never issued (a forged ref) counts nothing. */
static void count_loaded(_Atomic uint64_t *h, uint64_t ticket) {
    if (ticket >= atomic_load(&h[HDR_ISSUED]))
        return;
    if (ticket >= TICKETS) {
        atomic_fetch_add(&h[HDR_LOADED], 1); /* UNCOUNTED: the generation is retired */
        return;
    }
    uint64_t bit = 1ULL << (ticket % 64);
    if (!(atomic_fetch_or(&h[HDR_BITS + ticket / 64], bit) & bit))
        atomic_fetch_add(&h[HDR_LOADED], 1);
}

static int parse_ticket(PyObject *obj, uint64_t *ticket) {
    *ticket = PyLong_AsUnsignedLongLong(obj);
    if (*ticket == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError))
            *ticket = UINT64_MAX - 1; /* past every ticket: counts nothing */
        else
            return -1;
        PyErr_Clear();
    }
    return 0;
}

PyDoc_STRVAR(hdr_issue_doc, "hdr_issue(addr) -> int\n\nA ticket for one ref to the generation of the header at addr.");

static PyObject *hdr_issue(PyObject *Py_UNUSED(module), PyObject *addr) {
    _Atomic uint64_t *h = header_of(addr);
    return h == NULL ? NULL : PyLong_FromUnsignedLongLong(issue_ticket(h));
}

PyDoc_STRVAR(hdr_loaded_doc, "hdr_loaded(addr, ticket)\n\nThe ref of ticket loaded in the generation of the header at addr: "
                             "counted loaded at its first load only (refs sent: count_sent).");

static PyObject *hdr_loaded(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hdr_loaded(addr, ticket)");
        return NULL;
    }
    _Atomic uint64_t *h = header_of(args[0]);
    uint64_t ticket;
    if (h == NULL || parse_ticket(args[1], &ticket) < 0)
        return NULL;
    count_loaded(h, ticket);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hdr_hold_doc, "hdr_hold(addr, gen) -> bool\n\nCount this process a holder of generation gen, then check that the "
                           "header holds gen: False (holding nothing) if it holds another, or is being freed for good.");

static PyObject *hdr_hold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *h;
    uint64_t gen;
    if (parse_header_gen(args, nargs, "hdr_hold", &h, &gen) < 0)
        return NULL;
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    for (;;) {
        if (n & FREEING) {
            /* Its owner is checking it free (a few instructions): wait, without the GIL
             * (nothing here may stall this process's other threads on another process),
             * at most FREEING_WAIT_NS. A bit still set then was left by an owner killed
             * mid-check: that generation was being ended (nobody held it, every ref was
             * loaded), so this load is of a ref loaded already: refused as stale. */
            int cleared = 0;
            Py_BEGIN_ALLOW_THREADS
            struct timespec start, now, pause = {0, 100000};
            clock_gettime(CLOCK_MONOTONIC, &start);
            for (long spins = 0;; spins++) {
                if (spins < 1000)
                    sched_yield();
                else
                    nanosleep(&pause, NULL);
                n = atomic_load(&h[HDR_HOLDERS]);
                if (!(n & FREEING)) {
                    cleared = 1;
                    break;
                }
                clock_gettime(CLOCK_MONOTONIC, &now);
                if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) > FREEING_WAIT_NS)
                    break;
            }
            Py_END_ALLOW_THREADS
            if (!cleared)
                Py_RETURN_FALSE;
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

/* ---- the header work the broker does, guarded ----
 *
 * The broker maps the header of every segment it keeps, and a file_system file can be
 * truncated by any process of the user (a memfd is sealed): a read of its header is
 * then a SIGBUS. Where guard_faults() was called (the broker), each of these runs
 * with a SIGBUS handler that jumps back and raises OSError(EFAULT) instead of ending
 * the process (issue 29, item 1). Each op touches the header and nothing else, so
 * nothing is left half done by the jump. */

static _Thread_local sigjmp_buf *fault_jump;
static int faults_guarded;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)info;
    (void)context;
    sigjmp_buf *jump = fault_jump;
    if (jump != NULL) {
        fault_jump = NULL;
        siglongjmp(*jump, 1);
    }
    signal(sig, SIG_DFL); /* not ours: as if no handler were there */
    raise(sig);
}

typedef void (*header_op)(_Atomic uint64_t *h, uint64_t arg, uint64_t *out);

static int guarded(header_op op, _Atomic uint64_t *h, uint64_t arg, uint64_t *out) {
    if (!faults_guarded) {
        op(h, arg, out);
        return 0;
    }
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0)) {
        errno = EFAULT;
        PyErr_SetFromErrno(PyExc_OSError); /* the segment was truncated under its header */
        return -1;
    }
    fault_jump = &jump;
    op(h, arg, out);
    fault_jump = NULL;
    return 0;
}

PyDoc_STRVAR(guard_faults_doc, "guard_faults()\n\nFrom now on the header functions the broker calls raise OSError(EFAULT) "
                               "where a segment was truncated under its header, instead of a SIGBUS ending the process.");

static PyObject *guard_faults(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER; /* not blocked in the handler: a sigsetjmp(, 0) needs no mask back */
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, NULL) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    faults_guarded = 1;
    Py_RETURN_NONE;
}

static void op_unhold(_Atomic uint64_t *h, uint64_t gen, uint64_t *out) {
    out[0] = 0;
    if (atomic_load(&h[HDR_GEN]) != gen)
        return;
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    do {
        if ((n & ~FREEING) == 0)
            return;
    } while (!atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n - 1));
    out[0] = 1;
}

static void op_read(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out) {
    out[0] = atomic_load(&h[HDR_GEN]);
    out[1] = atomic_load(&h[HDR_SENT]);
    out[2] = atomic_load(&h[HDR_LOADED]);
    out[3] = atomic_load(&h[HDR_HOLDERS]);
}

static void op_retire(_Atomic uint64_t *h, uint64_t gen, uint64_t *out) {
    out[0] = 0;
    if (atomic_load(&h[HDR_GEN]) != gen)
        return;
    atomic_fetch_or(&h[HDR_FLAGS], RETIRED);
    out[0] = 1;
}

static void op_retire_any(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out) {
    atomic_fetch_or(&h[HDR_FLAGS], RETIRED);
    out[0] = 1;
}

static void op_flags(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out) {
    out[0] = atomic_load(&h[HDR_FLAGS]);
}

PyDoc_STRVAR(hdr_unhold_doc, "hdr_unhold(addr, gen) -> bool\n\nCount one holder of generation gen less; False (nothing done) if the "
                             "header holds another generation or no holder.");

/* name(addr, gen) -> bool: a guarded op of one generation. */
static PyObject *generation_op(header_op op, const char *name, PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *h;
    uint64_t gen, out[1];
    if (parse_header_gen(args, nargs, name, &h, &gen) < 0 || guarded(op, h, gen, out) < 0)
        return NULL;
    return PyBool_FromLong(out[0] != 0);
}

static PyObject *hdr_unhold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    return generation_op(op_unhold, "hdr_unhold", args, nargs);
}

PyDoc_STRVAR(hdr_free_doc, "hdr_free(addr, gen) -> bool\n\nThe owner, its own storages of gen all dead: if nobody holds gen, every "
                           "ref sent was loaded and gen is not retired, end it (generation 0, counters, tickets and flags "
                           "zeroed: a stale ref is refused) and return True.");

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
    int free = atomic_load(&h[HDR_GEN]) == gen && !(atomic_load(&h[HDR_FLAGS]) & RETIRED) &&
               atomic_load(&h[HDR_SENT]) == atomic_load(&h[HDR_LOADED]);
    if (free) {
        atomic_store(&h[HDR_GEN], 0);
        uint64_t issued = atomic_load(&h[HDR_ISSUED]);
        uint64_t words = (issued < TICKETS ? issued : TICKETS) / 64 + 1;
        for (uint64_t i = 0; i < words && i < TICKETS / 64; i++)
            atomic_store(&h[HDR_BITS + i], 0);
        atomic_store(&h[HDR_SENT], 0);
        atomic_store(&h[HDR_LOADED], 0);
        atomic_store(&h[HDR_ISSUED], 0);
        atomic_store(&h[HDR_FLAGS], 0);
    }
    atomic_store(&h[HDR_HOLDERS], 0);
    return PyBool_FromLong(free);
}

PyDoc_STRVAR(hdr_read_doc, "hdr_read(addr) -> (gen, sent, loaded, holders)\n\nThe header at addr, each field read atomically.");

static PyObject *hdr_read(PyObject *Py_UNUSED(module), PyObject *addr) {
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[4];
    if (h == NULL || guarded(op_read, h, 0, out) < 0)
        return NULL;
    return Py_BuildValue("KKKK", (unsigned long long)out[0], (unsigned long long)out[1], (unsigned long long)out[2],
                         (unsigned long long)out[3]);
}

PyDoc_STRVAR(hdr_retire_doc, "hdr_retire(addr, gen) -> bool\n\nNever reuse generation gen (if the header still holds it): "
                             "its memory goes back to the system once nothing maps it.");

static PyObject *hdr_retire(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    return generation_op(op_retire, "hdr_retire", args, nargs);
}

PyDoc_STRVAR(hdr_retire_any_doc, "hdr_retire_any(addr)\n\nRetire whatever generation the header holds now, a free segment's "
                                 "next one included: a process killed inside a stale load's hdr_hold may have counted itself "
                                 "there, and nobody can count it out.");

static PyObject *hdr_retire_any(PyObject *Py_UNUSED(module), PyObject *addr) {
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[1];
    if (h == NULL || guarded(op_retire_any, h, 0, out) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hdr_flags_doc, "hdr_flags(addr) -> int\n\nThe header's flags: RETIRED (never reused), UNCOUNTED (a ticket past "
                            "the bitmap: its loads were not told from repeats).");

static PyObject *hdr_flags(PyObject *Py_UNUSED(module), PyObject *addr) {
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[1];
    if (h == NULL || guarded(op_flags, h, 0, out) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(out[0]);
}

/* reductions.<name>, imported on first use into *slot (importing shmreduce, in a
 * process whose first shmreduce object is a pickle's); borrowed, or NULL. */
static PyObject *reductions_function(PyObject **slot, const char *name) {
    if (*slot == NULL) {
        PyObject *module = PyImport_ImportModule("shmreduce.reductions");
        if (module == NULL)
            return NULL;
        *slot = PyObject_GetAttrString(module, name);
        Py_DECREF(module);
    }
    return *slot;
}

/* rebuild(ref, meta): the general one; rebuild(ref, meta, None), from it: None. */
static PyObject *general(PyObject *const *args, Py_ssize_t nargs) {
    if (nargs == 3)
        Py_RETURN_NONE;
    PyObject *fn = reductions_function(&slow_rebuild, "rebuild_tensor");
    return fn == NULL ? NULL : PyObject_Vectorcall(fn, args, (size_t)nargs, NULL);
}

/* An exact int's value, or -1 for anything else (no error set). */
static Py_ssize_t small_int(PyObject *obj) {
    if (!PyLong_CheckExact(obj))
        return -1;
    Py_ssize_t value = PyLong_AsSsize_t(obj);
    if (value == -1)
        PyErr_Clear();
    return value;
}

PyDoc_STRVAR(rebuild_doc,
             "rebuild(ref, meta) -> Tensor\n\n"
             "A tensor pickled by reductions.reduce_tensor. Made here, in one call, where the ref's generation has a "
             "published Gen and the tensor is plain (no subclass, no grad), starts its storage and spans it exactly, "
             "in a dtype of the table, and its storage was not loaded here already: counted loaded in the header, "
             "remembered in the Gen's identity map (a weak reference), dtype's layout checked first. Every other "
             "case, malformed ones included, goes to the general one, shmreduce.reductions.rebuild_tensor, which "
             "calls rebuild(ref, meta, None) once it published the Gen: None there instead of the general one.");

static PyObject *native_rebuild(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3 || live == NULL || from_dlpack == NULL)
        return general(args, nargs);
    PyObject *ref = args[0], *meta = args[1];
    if (!PyTuple_CheckExact(ref) || PyTuple_GET_SIZE(ref) != 8 || !PyTuple_CheckExact(meta) || PyTuple_GET_SIZE(meta) != 5 ||
        PyTuple_GET_ITEM(meta, 4) != Py_None || small_int(PyTuple_GET_ITEM(meta, 3)) != 0)
        return general(args, nargs);
    PyObject *dtype = PyDict_GetItemWithError(dtypes, PyTuple_GET_ITEM(meta, 0));
    if (dtype == NULL && PyErr_Occurred()) { /* an unhashable dtype: no call is made with the error pending */
        PyErr_Clear();
        PyErr_SetString(sharing_error, "not a tensor's metadata: its dtype is not a torch dtype (forged or corrupted message)");
        return NULL;
    }
    PyObject *key = PyTuple_GetSlice(ref, 0, 4);
    if (key == NULL || PyErr_Occurred()) {
        Py_XDECREF(key);
        return NULL;
    }
    GenObject *gen = (GenObject *)PyDict_GetItemWithError(live, key);
    Py_DECREF(key);
    Py_ssize_t offset = small_int(PyTuple_GET_ITEM(ref, 4)), nbytes = small_int(PyTuple_GET_ITEM(ref, 5));
    Py_ssize_t ticket_value = small_int(PyTuple_GET_ITEM(ref, 7));
    uint64_t ticket = ticket_value < 0 ? UINT64_MAX - 1 : (uint64_t)ticket_value; /* not a ticket: counts nothing */
    if (gen == NULL || dtype == NULL || gen->ended || offset < 0 || nbytes <= 0 || !PyTuple_CheckExact(gen->info) ||
        PyTuple_GET_SIZE(gen->info) != 3 || !PyDict_CheckExact(PyTuple_GET_ITEM(gen->info, 2)) || !PyTuple_CheckExact(dtype) ||
        PyTuple_GET_SIZE(dtype) != 4)
        return PyErr_Occurred() ? NULL : general(args, nargs);
    PyObject *received = PyTuple_GET_ITEM(gen->info, 2);
    PyObject *weak = PyDict_GetItemWithError(received, PyTuple_GET_ITEM(ref, 4));
    PyObject *loaded = weak != NULL && PyWeakref_Check(weak) ? referent(weak) : NULL;
    if (loaded != NULL) {
        Py_DECREF(loaded);
        return general(args, nargs); /* loaded here already: the general case returns the same storage */
    }
    if (PyErr_Occurred() || check_range(gen, offset, nbytes) < 0)
        return NULL;
    Py_ssize_t code = small_int(PyTuple_GET_ITEM(dtype, 0)), bits = small_int(PyTuple_GET_ITEM(dtype, 1));
    Py_ssize_t lanes = small_int(PyTuple_GET_ITEM(dtype, 2)), itemsize = small_int(PyTuple_GET_ITEM(dtype, 3));
    if (code < 0 || code > 255 || bits <= 0 || bits > 255 || lanes <= 0 || lanes > 65535 || itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "init(): not a DLPack dtype table");
        return NULL;
    }
    Ctx *ctx = new_ctx();
    if (ctx == NULL)
        return NULL;
    int32_t ndim = 0;
    int64_t extent = 0;
    int parsed = parse_layout(PyTuple_GET_ITEM(meta, 1), PyTuple_GET_ITEM(meta, 2), itemsize, ctx, &ndim, &extent);
    if (parsed != 0 || extent != nbytes) {
        give_back_ctx(ctx);
        if (parsed < 0)
            return NULL;
        return general(args, nargs); /* a storage larger than the tensor's elements, or no element */
    }
    ctx->managed.dl_tensor.ndim = ndim;
    ctx->managed.dl_tensor.dtype.code = (uint8_t)code;
    ctx->managed.dl_tensor.dtype.bits = (uint8_t)bits;
    ctx->managed.dl_tensor.dtype.lanes = (uint16_t)lanes;
    PyObject *tensor = import_tensor(gen, ctx, offset);
    if (tensor == NULL)
        return NULL;
    if (gen->low) /* pooled: counted loaded (a first load only) once its storage exists */
        count_loaded((_Atomic uint64_t *)gen->addr, ticket);
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, str_untyped_storage);
    weak = storage != NULL ? PyWeakref_NewRef(storage, NULL) : NULL;
    Py_XDECREF(storage);
    /* The importer ran torch code (a collection, finalizers): gen->info, which Python
     * may set, is read again rather than trusted from before it (issue 28, item 6). */
    received = PyTuple_CheckExact(gen->info) && PyTuple_GET_SIZE(gen->info) == 3 ? PyTuple_GET_ITEM(gen->info, 2) : NULL;
    if (weak != NULL && (received == NULL || !PyDict_CheckExact(received))) {
        Py_CLEAR(weak);
        PyErr_SetString(PyExc_RuntimeError, "a Gen's info changed under a load");
    }
    if (weak == NULL || PyDict_SetItem(received, PyTuple_GET_ITEM(ref, 4), weak) < 0) {
        Py_XDECREF(weak);
        Py_DECREF(tensor);
        return NULL;
    }
    Py_DECREF(weak);
    loads++;
    loaded_bytes += (unsigned long long)nbytes;
    return tensor;
}

/* ---- reduce(): a plain CPU tensor shared in one call ---- */

static PyObject *general_reduce(PyObject *tensor) {
    PyObject *fn = reductions_function(&slow_reduce, "reduce_tensor");
    return fn == NULL ? NULL : PyObject_CallOneArg(fn, tensor);
}

/* 1 if obj.<name> is want (a singleton), 0 if not, -1 on error. */
static int attr_is(PyObject *obj, int name, PyObject *want) {
    PyObject *value = PyObject_GetAttr(obj, names[name]);
    if (value == NULL)
        return -1;
    Py_DECREF(value);
    return value == want;
}

/* obj.<name>() as an address or size; -1 (error set) on failure. */
static Py_ssize_t call_int(PyObject *obj, int name) {
    PyObject *value = PyObject_CallMethodNoArgs(obj, names[name]);
    if (value == NULL)
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return n;
}

/* Swap fresh's memory into storage if storage's data is still at ptr (no other thread
 * moved it meanwhile): 1; 0 if moved; -1 on error. No Python code runs in between. */
static int move_into(PyObject *storage, Py_ssize_t ptr, PyObject *fresh) {
    Py_ssize_t now = call_int(storage, S_DATA_PTR);
    if (now == -1 && PyErr_Occurred())
        return -1;
    if (now != ptr)
        return 0;
    PyObject *done = PyObject_CallMethodOneArg(storage, names[S_SWAP], fresh);
    Py_XDECREF(done);
    return done == NULL ? -1 : 1;
}

PyDoc_STRVAR(move_doc, "move(storage, ptr, fresh) -> bool\n\nSwap fresh's memory into storage if its data is still at ptr.");

static PyObject *native_move(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "move(storage, ptr, fresh)");
        return NULL;
    }
    Py_ssize_t ptr = PyLong_AsSsize_t(args[1]);
    int moved = (ptr == -1 && PyErr_Occurred()) ? -1 : move_into(args[0], ptr, args[2]);
    return moved < 0 ? NULL : PyBool_FromLong(moved);
}

/* The current slab of this thread for the current strategy, if reduce() may fill it. */
static GenObject *current_slab(void) {
    PyObject *strategy = PyDict_GetItemWithError(strategy_globals, names[S_SHARING_STRATEGY]);
    PyObject *thread = PyThreadState_GetDict();
    if (strategy == NULL || thread == NULL)
        return NULL;
    int fs = PyUnicode_Check(strategy) && PyUnicode_Compare(strategy, names[S_FILE_SYSTEM]) == 0;
    PyObject *slab = PyDict_GetItemWithError(thread, names[fs ? S_SLAB_FS : S_SLAB_FD]);
    if (slab == NULL || Py_TYPE(slab) != &GenType || ((GenObject *)slab)->ended || ((GenObject *)slab)->ref == NULL)
        return NULL;
    return (GenObject *)slab;
}

/* Where storage (nbytes at ptr) lies: a Gen reduce() sends from and the offset, moved
 * into this thread's slab first if it lies in none; NULL (no error) for the general path. */
static GenObject *place(PyObject *storage, Py_ssize_t ptr, Py_ssize_t nbytes, Py_ssize_t *offset) {
    Range *r = range_at((uintptr_t)ptr, nbytes);
    if (r != NULL) { /* in shared memory already: sent from where it lies, by an indexed Gen only */
        GenObject *gen = r->gen;
        Py_ssize_t at = ptr - (Py_ssize_t)r->addr;
        if (gen == NULL || gen->ended || at < gen->low)
            return NULL;
        *offset = at;
        reuses++;
        return gen;
    }
    if (nbytes > SLAB_ITEM_MAX)
        return NULL;
    PyObject *shared = PyObject_CallOneArg(torch_is_shared, storage); /* torch's own: a storage it shared is adopted */
    Py_XDECREF(shared);
    GenObject *slab = shared == Py_False ? current_slab() : NULL;
    Py_ssize_t at = slab != NULL ? slab->cursor : 0;
    if (slab == NULL || at < slab->low || at > slab->size || nbytes > slab->size - at || at % ALIGN ||
        !PyTuple_CheckExact(slab->info) || PyTuple_GET_SIZE(slab->info) != 3 || !PyDict_CheckExact(PyTuple_GET_ITEM(slab->info, 2)))
        return NULL; /* full, or none yet: the general path makes the next */
    memmove(slab->addr + at, (const void *)ptr, (size_t)nbytes);
    PyObject *fresh = make_storage(slab, at, nbytes);
    if (fresh == NULL)
        return NULL;
    int moved = move_into(storage, ptr, fresh);
    Py_DECREF(fresh);
    if (moved <= 0)
        return NULL; /* moved by another thread meanwhile: the general path finds where */
    slab->cursor = (at + nbytes + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1);
    PyObject *weak = PyWeakref_NewRef(storage, NULL), *key = PyLong_FromSsize_t(at);
    int kept = weak != NULL && key != NULL ? PyDict_SetItem(PyTuple_GET_ITEM(slab->info, 2), key, weak) : -1;
    Py_XDECREF(weak);
    Py_XDECREF(key);
    if (kept < 0)
        return NULL;
    shares++;
    shared_bytes += (unsigned long long)nbytes;
    *offset = at;
    return slab;
}

/* A tuple of n new references, taken over; NULL (each released) if any is NULL. */
static PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
    PyObject *tuple = NULL;
    for (Py_ssize_t i = 0; i < n; i++)
        if (items[i] == NULL)
            goto fail;
    tuple = PyTuple_New(n);
    if (tuple == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        PyTuple_SET_ITEM(tuple, i, items[i]);
    return tuple;
fail:
    for (Py_ssize_t i = 0; i < n; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

static PyObject *share_plain(PyObject *tensor, PyObject *storage) {
    Py_ssize_t nbytes = call_int(storage, S_NBYTES), ptr = nbytes > 0 ? call_int(storage, S_DATA_PTR) : -1;
    if (nbytes <= 0 || ptr == -1)
        return NULL;
    if (!checked) {
        struct pollfd post = {.fd = watched, .events = POLLRDHUP};
        if (watched < 0 || poll(&post, 1, 0) != 0)
            return NULL; /* the broker may be gone: the general path connects anew */
        checked = 1;
    }
    Py_ssize_t offset;
    GenObject *gen = place(storage, ptr, nbytes, &offset);
    if (gen == NULL)
        return NULL;
    /* place() ran torch code (the importer, the swap): a collection there may have run
     * finalizers that unindexed gen (unindex_all(), a broker reconnect), so gen->ref is
     * read only now, and held while this builds (issue 28, item 3). Without it, the
     * general path sends the storage from where it lies now. */
    PyObject *r = gen->ref;
    if (r == NULL || gen->ended)
        return NULL;
    Py_INCREF(r);
    uint64_t ticket = gen->low ? issue_ticket((_Atomic uint64_t *)gen->addr) : 0;
    PyObject *ref = tuple_of(8, (PyObject *[]){Py_NewRef(PyTuple_GET_ITEM(r, 0)), Py_NewRef(PyTuple_GET_ITEM(r, 1)),
                                                Py_NewRef(PyTuple_GET_ITEM(r, 2)), Py_NewRef(PyTuple_GET_ITEM(r, 3)),
                                                PyLong_FromSsize_t(offset), PyLong_FromSsize_t(nbytes), Py_NewRef(PyTuple_GET_ITEM(r, 4)),
                                                PyLong_FromUnsignedLongLong(ticket)});
    Py_DECREF(r);
    PyObject *header = gen->low ? PyLong_FromVoidPtr(gen->addr) : NULL;
    if (ref == NULL || (gen->low && (header == NULL || PyList_Append(outgoing, header) < 0))) {
        Py_XDECREF(ref);
        Py_XDECREF(header);
        return NULL;
    }
    Py_XDECREF(header);
    /* One call at a time: none is made with an error set. */
    PyObject *meta[5] = {PyObject_GetAttr(tensor, names[S_DTYPE]), NULL, NULL, NULL, Py_NewRef(Py_None)};
    PyObject *size = meta[0] != NULL ? PyObject_CallMethodNoArgs(tensor, names[S_SIZE]) : NULL;
    if (size != NULL) /* a torch.Size: its items as a plain tuple, which pickles and loads in C */
        meta[1] = PyTuple_Check(size) ? PyTuple_GetSlice(size, 0, PY_SSIZE_T_MAX) : PySequence_Tuple(size);
    Py_XDECREF(size);
    if (meta[1] != NULL)
        meta[2] = PyObject_CallMethodNoArgs(tensor, names[S_STRIDE]);
    if (meta[2] != NULL)
        meta[3] = PyObject_CallMethodNoArgs(tensor, names[S_STORAGE_OFFSET]);
    PyObject *args = tuple_of(2, (PyObject *[]){ref, tuple_of(5, meta)});
    return args == NULL ? NULL : tuple_of(2, (PyObject *[]){Py_NewRef(rebuild_fn), args});
}

PyDoc_STRVAR(reduce_doc,
             "reduce(tensor) -> (rebuild, (ref, meta))\n\n"
             "reductions.reduce_tensor's result, made here in one call for a plain CPU tensor (torch.Tensor "
             "exactly, no grad, no hooks, strided) inside a sending scope (message()) whose broker lives, whose "
             "storage lies in an indexed Gen or fits this thread's slab (copied there and swapped in); counted "
             "sent when the scope ends (its header's address appended to the scope's list). Every other case "
             "goes to reductions.reduce_tensor.");

static PyObject *native_reduce(PyObject *Py_UNUSED(module), PyObject *tensor) {
    if (outgoing == NULL || rebuild_fn == NULL || Py_TYPE(tensor) != (PyTypeObject *)tensor_type)
        return general_reduce(tensor);
    int plain;
    if ((plain = attr_is(tensor, S_REQUIRES_GRAD, Py_False)) <= 0 || (plain = attr_is(tensor, S_BACKWARD_HOOKS, Py_None)) <= 0 ||
        (plain = attr_is(tensor, S_LAYOUT, strided)) <= 0 || (plain = attr_is(tensor, S_IS_CPU, Py_True)) <= 0 ||
        (plain = attr_is(tensor, S_IS_NESTED, Py_False)) <= 0)
        return plain < 0 ? NULL : general_reduce(tensor);
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, str_untyped_storage);
    if (storage == NULL)
        return NULL;
    PyObject *reduced = share_plain(tensor, storage);
    Py_DECREF(storage);
    if (reduced == NULL && !PyErr_Occurred())
        return general_reduce(tensor);
    return reduced;
}

PyDoc_STRVAR(message_doc, "message(addresses)\n\nreduce()'s sending scope on this thread: the list it appends the header "
                          "address of each ref to, or None (outside any scope). The broker is checked again.");

static PyObject *native_message(PyObject *Py_UNUSED(module), PyObject *list) {
    if (list != Py_None && !PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "message(list | None)");
        return NULL;
    }
    Py_XSETREF(outgoing, list == Py_None ? NULL : Py_NewRef(list));
    checked = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(count_sent_doc, "count_sent(addresses)\n\nCount one ref sent in the header at each address.");

static PyObject *native_count_sent(PyObject *Py_UNUSED(module), PyObject *list) {
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "count_sent(list)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        _Atomic uint64_t *h = header_of(PyList_GET_ITEM(list, i));
        if (h == NULL)
            return NULL;
        atomic_fetch_add(&h[HDR_SENT], 1);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(watch_doc, "watch(fd)\n\nreduce() checks the post connection fd (-1: none) for a hang-up once per message.");

static PyObject *native_watch(PyObject *Py_UNUSED(module), PyObject *fd) {
    long value = PyLong_AsLong(fd);
    if (value == -1 && PyErr_Occurred())
        return NULL;
    watched = value < 0 || value > INT32_MAX ? -1 : (int)value;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_slab_doc, "set_slab(file_system, gen)\n\nThis thread's current slab of a strategy for reduce() (None: none).");

static PyObject *native_set_slab(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    PyObject *thread = PyThreadState_GetDict();
    if (nargs != 2 || thread == NULL || (args[1] != Py_None && Py_TYPE(args[1]) != &GenType)) {
        PyErr_SetString(PyExc_TypeError, "set_slab(bool, Gen | None)");
        return NULL;
    }
    int fs = PyObject_IsTrue(args[0]);
    if (fs < 0)
        return NULL;
    PyObject *key = names[fs ? S_SLAB_FS : S_SLAB_FD];
    if (args[1] != Py_None)
        return PyDict_SetItem(thread, key, args[1]) < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *found = PyDict_GetItemWithError(thread, key);
    if ((found == NULL && PyErr_Occurred()) || (found != NULL && PyDict_DelItem(thread, key) < 0))
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(shared_doc, "shared() -> (storages, bytes, reused)\n\nWhat reduce() moved into slabs, and sent from where it lay.");

static PyObject *native_shared(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("KKK", shares, shared_bytes, reuses);
}

PyDoc_STRVAR(init_send_doc, "init_send(rebuild, tensor_type, strided, strategy_globals, is_shared)\n\nBind what reduce() needs.");

static PyObject *native_init_send(PyObject *Py_UNUSED(module), PyObject *args) {
    PyObject *fn, *type, *layout, *globals, *is_shared;
    if (!PyArg_ParseTuple(args, "OO!OO!O", &fn, &PyType_Type, &type, &layout, &PyDict_Type, &globals, &is_shared))
        return NULL;
    Py_XSETREF(rebuild_fn, Py_NewRef(fn));
    Py_XSETREF(tensor_type, Py_NewRef(type));
    Py_XSETREF(strided, Py_NewRef(layout));
    Py_XSETREF(strategy_globals, Py_NewRef(globals));
    Py_XSETREF(torch_is_shared, Py_NewRef(is_shared));
    Py_RETURN_NONE;
}

PyDoc_STRVAR(loaded_doc, "loaded() -> (storages, bytes)\n\nWhat rebuild() loaded itself in this process.");

static PyObject *native_loaded(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("KK", loads, loaded_bytes);
}

static PyMethodDef native_methods[] = {
    {"rebuild", (PyCFunction)(void (*)(void))native_rebuild, METH_FASTCALL, rebuild_doc},
    {"loaded", native_loaded, METH_NOARGS, loaded_doc},
    {"reduce", native_reduce, METH_O, reduce_doc},
    {"move", (PyCFunction)(void (*)(void))native_move, METH_FASTCALL, move_doc},
    {"message", native_message, METH_O, message_doc},
    {"count_sent", native_count_sent, METH_O, count_sent_doc},
    {"watch", native_watch, METH_O, watch_doc},
    {"set_slab", (PyCFunction)(void (*)(void))native_set_slab, METH_FASTCALL, set_slab_doc},
    {"shared", native_shared, METH_NOARGS, shared_doc},
    {"init_send", native_init_send, METH_VARARGS, init_send_doc},
    {"unindex_all", native_unindex_all, METH_NOARGS, unindex_all_doc},
    {"mapped", (PyCFunction)(void (*)(void))native_mapped, METH_FASTCALL, mapped_doc},
    {"unmapped", native_unmapped, METH_O, mapped_doc},
    {"forget_mapped", native_forget_mapped, METH_NOARGS, forget_mapped_doc},
    {"segment_at", (PyCFunction)(void (*)(void))native_segment_at, METH_FASTCALL, segment_at_doc},
    {"hdr_issue", hdr_issue, METH_O, hdr_issue_doc},
    {"hdr_loaded", (PyCFunction)(void (*)(void))hdr_loaded, METH_FASTCALL, hdr_loaded_doc},
    {"hdr_retire", (PyCFunction)(void (*)(void))hdr_retire, METH_FASTCALL, hdr_retire_doc},
    {"hdr_retire_any", hdr_retire_any, METH_O, hdr_retire_any_doc},
    {"hdr_flags", hdr_flags, METH_O, hdr_flags_doc},
    {"guard_faults", guard_faults, METH_NOARGS, guard_faults_doc},
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
    for (int i = 0; i < N_NAMES; i++)
        if ((names[i] = PyUnicode_InternFromString(name_text[i])) == NULL)
            return NULL;
    sharing_error = Py_NewRef(PyExc_RuntimeError); /* until init() */
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddObjectRef(module, "Gen", (PyObject *)&GenType) < 0 || PyModule_AddIntConstant(module, "ALIGN", ALIGN) < 0 ||
        PyModule_AddIntConstant(module, "HEADER_BYTES", HEADER_BYTES) < 0 || PyModule_AddIntConstant(module, "SLAB_ITEM_MAX", SLAB_ITEM_MAX) < 0 ||
        PyModule_AddIntConstant(module, "TICKETS", (long)TICKETS) < 0 || PyModule_AddIntConstant(module, "RETIRED", (long)RETIRED) < 0 ||
        PyModule_AddIntConstant(module, "UNCOUNTED", (long)UNCOUNTED) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
