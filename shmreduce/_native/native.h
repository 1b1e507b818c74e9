/* shmreduce._native: what its files share. One extension module, one file per job:
 *
 *   module.c    the module: its state and multi-phase init, its functions' tables
 *               gathered, constants exported, init(), the process-wide state
 *   lifetime.c  Gen (one generation of a mapped segment here), the DLPack contexts and
 *               their deleter, the dead stack: native lifetimes
 *   dlpack.c    storages and tensors over a mapping, through torch's DLPack importer
 *   segments.c  the table of mapped segments, by address, and the Gen each sends from
 *   header.c    a pooled segment's shared header: its atomics, and the broker's guard
 *   pickler.c   the pickling fast path: reduce() and rebuild(), and slab placement
 *   copy.c      copies of many bytes into a segment, on the threads the process may use
 *
 * Mechanism only: which storage goes where, what is an error, when the broker is
 * asked, is decided in Python (pool.py, transfer.py, reductions.py), which calls in.
 * Each file opens with what it owns and what it calls. Every symbol below is shared
 * inside the extension only (-fvisibility=hidden), under the shm_ prefix:
 * PyInit__native is its one export.
 *
 * Needs a GIL build of CPython: the lock-free stacks have one consumer, the GIL holder.
 */
#ifndef SHMREDUCE_NATIVE_H
#define SHMREDUCE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>

/* ---- DLPack 1.x, from the public spec: a versioned managed tensor is what this
 * extension hands torch; the legacy, unversioned one is read ("dltensor" capsules
 * torch's to_dlpack makes, for their dtype) and handed to a torch that takes no
 * other (2.8) ---- */

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

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags; /* 0: writable, not a copy */
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

enum { kDLCPU = 1, kDLUInt = 1 };

/* The DLPack C exchange API (a type's __dlpack_c_exchange_api__ capsule,
 * "dlpack_exchange_api", DLPack 1.x): only the functions called here are typed. */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out); /* may be NULL */
    void *current_work_stream;
} DLPackExchangeAPI;

/* ---- constants: defined here once; module.c exports those Python reads ---- */

#define ALIGN         64 /* a slab places each storage on a cache line, as torch's allocator does */
#define SLAB_ITEM_MAX 65536 /* larger storages get a segment of their own (pool.py) */
#define MAX_DIMS      8     /* rebuild()'s; more dimensions take the general path */

/* A pooled segment's shared header (header.c says what each word means). */
#define HEADER_BYTES 4096
#define HDR_GEN      0
#define HDR_SENT     1
#define HDR_LOADED   2
#define HDR_HOLDERS  3
#define HDR_ISSUED   4
#define HDR_FLAGS    5
#define HDR_EXTENT   6 /* a trailing header's (segments.trail): the bytes its storage spans */
#define HDR_BITS     8
#define TICKETS      ((uint64_t)(HEADER_BYTES / 8 - HDR_BITS) * 64)
#define RETIRED      1ULL
#define UNCOUNTED    2ULL
#define CLOSED                                                                                     \
    4ULL /* a retired generation's close was claimed (hdr_end answered END_RETIRED once) */
/* What hdr_end did (module.c exports them). */
enum { END_STALE = -1, END_WAIT = 0, END_FREED = 1, END_RETIRED = 2 };
#define NOT_A_TICKET (UINT64_MAX - 1) /* past every ticket: a load of it counts nothing */

/* ---- Gen and its DLPack context (lifetime.c) ---- */

typedef struct GenObject GenObject;
typedef struct shm_state shm_state;

/* One storage's DLPack context; recycled through a lock-free free list. */
typedef struct Ctx {
    DLManagedTensorVersioned managed;
    DLManagedTensor legacy; /* managed's tensor in the unversioned form, for a torch that reads no other */
    int64_t shape[MAX_DIMS];
    int64_t strides[MAX_DIMS];
    GenObject *gen;
    struct Ctx *next;
    _Atomic int importing; /* import_tensor() is inside torch's importer with it */
    _Atomic int deleted;   /* the deleter ran while importing: import_tensor() recycles it */
} Ctx;

struct GenObject {
    PyObject_HEAD
    _Atomic uint64_t state; /* live storages and holds | QUEUED (lifetime.c) */
    GenObject *next;        /* on the dead stack */
    shm_state *module;      /* its module's state (the type keeps the module alive) */
    PyObject *owner;        /* the Segment (keeps the mapping) */
    PyObject *info;         /* Python's bookkeeping, opaque here */
    PyObject *stored;       /* the identity map: offset -> a weak reference to its storage */
    PyObject *weakrefs;
    char *addr;
    Py_ssize_t size;
    Py_ssize_t low;     /* first byte a storage may use: past the header if pooled, else 0 */
    char *hdr;          /* its header (sent, loaded, tickets): addr if pooled, past size if it
                         * trails a storage torch moved (segments.trail), else NULL */
    PyObject *number;   /* the generation, an int (0: not pooled) */
    PyObject *key;      /* its key in the published dict, or NULL */
    PyObject *template; /* indexed: its refs' (kind, directory, segment, generation, tag) */
    Py_ssize_t cursor;  /* a slab's next free offset (shm_claim() alone moves it) */
    int ended;          /* dead() reported it: no storage is made from it any more */
};

/* ---- the module's state (PEP 489: one per module object, found from the module or a Gen) ---- */

/* The attribute and method names the C calls, interned once per module. */
enum {
    S_UNTYPED_STORAGE,
    S_NBYTES,
    S_DATA_PTR,
    S_REQUIRES_GRAD,
    S_BACKWARD_HOOKS,
    S_LAYOUT,
    S_IS_CPU,
    S_IS_NESTED,
    S_IS_QUANTIZED,
    S_IS_CONJ,
    S_IS_NEG,
    S_SHARING_STRATEGY,
    S_FILE_SYSTEM,
    S_SLAB_FD,
    S_SLAB_FS,
    S_DLPACK_EXCHANGE_API,
    N_NAMES
};

/* The dtype table read the other way (pickler.c's torch_dtype): a DLPack dtype's torch
 * dtype and itemsize, rebuilt when the table's size changes. */
#define BY_CODE_MAX 64
typedef struct {
    uint32_t code; /* code, bits and lanes in one word */
    Py_ssize_t itemsize;
    PyObject *dtype;
} DtypeEntry;

struct shm_state {
    PyTypeObject *gen_type;
    PyObject *names[N_NAMES];
    /* bound by init() */
    PyObject *from_dlpack;   /* torch._C._from_dlpack, or NULL before init() */
    PyObject *swap; /* UntypedStorage._swap_data_ptr_, or NULL: torch has none (before 2.12) */
    int versioned;  /* from_dlpack takes "dltensor_versioned" capsules (torch 2.9 on), else "dltensor" */
    PyObject *sharing_error; /* shmreduce.errors.SharingError (RuntimeError until init()) */
    PyObject *dtypes;        /* torch dtype -> (code, bits, lanes, itemsize) */
    PyObject *published;     /* a receiver's Gens by their refs' template */
    /* bound by init_send(): what reduce() returns to load with, what it takes (torch.Tensor
     * exactly, torch.strided), torch.multiprocessing's globals (the strategy), torch's own
     * UntypedStorage.is_shared, and the type's DLPack exchange API with its capsule */
    PyObject *load_fn, *tensor_type, *strided, *strategy_globals, *torch_is_shared;
    PyObject *exchange_capsule;
    /* NULL: reduce() hands every tensor on, and import_tensor() goes through a capsule */
    const DLPackExchangeAPI *exchange;
    /* the general paths, imported on first use: reductions.rebuild_tensor,
     * rebuild_packed, reduce_tensor */
    PyObject *general_rebuild, *general_load, *general_reduce;
    DtypeEntry by_code[BY_CODE_MAX];
    Py_ssize_t by_code_count, by_code_from;
    int post_fd; /* the post connection to this program's broker, or -1 */
    /* counters, the GIL held: loaded() and shared() report them */
    unsigned long long loads, loaded_bytes, loaded_again, shares, shared_bytes, reuses;
};

/* ---- process-wide state ----
 *
 * What is not module state, and why: it belongs to the process, not to a module
 * object or an interpreter. torch runs a storage's deleter on any thread, without the
 * GIL and with no module at hand, so the context free list and the dead stack it
 * pushes to are the process's; the segment table describes this process's address
 * space; a signal's handler (header.c's SIGBUS guard) is installed for the whole
 * process; whether the CPU has streaming stores is a fact of the machine. Thread-local
 * data (pickler.c's sending scope, header.c's fault jump) is per thread by nature.
 * Hence the module declares it does not support sub-interpreters: two interpreters
 * would share these and see each other's Gens. The header's SIGBUS guard keeps its own
 * named struct beside its handler (header.c), for the same reason. */
typedef struct {
    char *addr;
    Py_ssize_t size;
    PyObject *segment; /* a weak reference */
    GenObject *gen;    /* indexed, or NULL */
} Range;

typedef struct {
    _Atomic(Ctx *) free_ctx;         /* pushed by deleters */
    Ctx *spare_ctx;                  /* taken by the GIL holder */
    _Atomic(GenObject *) dead_stack; /* pushed by deleters and release() */
    int streaming;                   /* non-temporal copies: -1 until decided (copy.c) */
    int intra_op;                    /* torch's intra-op setting, as registered (copy.c); 0: unknown */
    int populating;                  /* MADV_POPULATE_WRITE in parallel writes: 0 once refused (copy.c) */
    Range *ranges;                   /* the mapped segments, by address (segments.c) */
    Py_ssize_t n_ranges, cap_ranges;
} shm_process_state;

extern shm_process_state shm_process;

/* The one check of a METH_FASTCALL function's argument count, raising the TypeError
 * CPython raises for its own functions: "name() takes exactly 2 arguments (3 given)". */
static inline int
shm_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t min, Py_ssize_t max)
{
    if (nargs >= min && nargs <= max) {
        return 0;
    }
    Py_ssize_t want = max;
    const char *how = "at most";
    if (min == max) {
        how = "exactly";
    }
    else if (nargs < min) {
        want = min;
        how = "at least";
    }
    PyErr_Format(PyExc_TypeError, "%s() takes %s %zd argument%s (%zd given)", name, how, want,
                 want == 1 ? "" : "s", nargs);
    return -1;
}

/* The state of the module a function is called through. */
static inline shm_state *
shm_get_state(PyObject *module)
{
    void *state = PyModule_GetState(module);
    assert(state != NULL);
    return (shm_state *)state;
}

/* ---- what the files call of each other ---- */

/* lifetime.c */
extern PyType_Spec shm_gen_spec;
void shm_add_count(GenObject *gen);
void shm_drop_count(GenObject *gen);
Ctx *shm_take_ctx(shm_state *st);
void shm_give_back_ctx(Ctx *ctx);
void shm_ctx_deleter(DLManagedTensorVersioned *managed);
void shm_ctx_deleter_legacy(DLManagedTensor *managed);
int shm_check_range(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes);
Py_ssize_t shm_claim(GenObject *gen, Py_ssize_t nbytes);
PyObject *shm_stored_at(GenObject *gen, PyObject *key);
int shm_remember(GenObject *gen, PyObject *key, PyObject *storage);
int shm_loaded_new(GenObject *gen, PyObject *key, PyObject *storage, Py_ssize_t nbytes,
                   uint64_t ticket);
PyObject *shm_put_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes, PyObject *source);
extern PyMethodDef shm_lifetime_methods[];

/* dlpack.c */
PyObject *shm_import_tensor(GenObject *gen, Ctx *ctx, Py_ssize_t offset);
PyObject *shm_make_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes);
/* A strided tensor's sizes and strides, as either pickled form carries them. */
typedef struct {
    int32_t ndim;
    int64_t shape[MAX_DIMS];
    int64_t strides[MAX_DIMS];
} Layout;
int shm_layout_from_tuples(shm_state *st, PyObject *size, PyObject *stride, Layout *out);
int shm_check_layout(shm_state *st, const Layout *layout, Py_ssize_t itemsize, int64_t *extent);
extern PyMethodDef shm_dlpack_methods[];

/* segments.c */
Range *shm_range_at(uintptr_t ptr, Py_ssize_t nbytes);
void shm_unindex(GenObject *gen);
PyObject *shm_gen_index(GenObject *self, PyObject *template);
extern PyMethodDef shm_segments_methods[];

/* header.c */
/* What a load or send of a segment truncated by another process raises. */
#define SHM_CUT_MESSAGE                                                                    \
    "a shared segment was truncated by another process of this user (its file cut short): " \
    "what was sent in it is lost; send it again from its source"
int shm_guard(void (*fn)(void *), void *arg);
void *shm_fault_address(void);
int shm_issue_ticket(_Atomic uint64_t *h, uint64_t *ticket);
int shm_count_loaded(_Atomic uint64_t *h, uint64_t ticket, PyObject *sharing_error);
void shm_count_sent(_Atomic uint64_t *h);
extern PyMethodDef shm_header_methods[];

/* pickler.c */
extern PyMethodDef shm_pickler_methods[];

/* copy.c */
int shm_copy_threads(Py_ssize_t nbytes);
int shm_copy(char *dest, const char *src, size_t n, int fd, off_t offset, int threads,
             void **fault_at);
extern PyMethodDef shm_copy_methods[];

/* A weak reference's referent (a new reference), or NULL (no error set) if it died. */
static inline PyObject *
referent(PyObject *weak)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *obj = NULL;
    if (PyWeakref_GetRef(weak, &obj) < 0) {
        PyErr_Clear();
    }
    return obj;
#else
    PyObject *obj = PyWeakref_GetObject(weak);
    return obj == Py_None || obj == NULL ? (PyErr_Clear(), NULL) : Py_NewRef(obj);
#endif
}

#endif
