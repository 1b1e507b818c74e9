/* lifetime.c: Gen, one generation of one mapped segment in this process, and what
 * keeps it alive.
 *
 * Owns: the Gen type; its count of live storages and holds; the DLPack contexts and
 * their deleter; the dead stack dead() empties; the one range check every handle
 * meets before a pointer is formed (shm_check_range); slab placement (claim: the cursor
 * moves here and nowhere else); the identity map of what was made or loaded at each
 * offset (shm_stored_at, shm_remember) and the one load routine both load paths use
 * (load_storage: the map first, else a new storage, counted loaded in the header).
 * Calls: dlpack.c to make storages, header.c to count loads, segments.c to unindex.
 *
 * The deleter, run by torch when a storage dies, on any thread and not necessarily
 * holding the GIL, does atomic arithmetic and lock-free pushes only: its context goes
 * back on a free list, and the Gen whose count reached zero is pushed on the dead
 * stack. dead() (GIL held) takes the stack and returns the Gens really dead (none
 * revived meanwhile).
 *
 * Reference ownership: while a Gen's count is above zero, or it sits on the dead
 * stack, it owns one reference to itself (its storages can outlive every Python
 * reference to it). dead() hands that reference to its caller.
 *
 * Consumers of both lock-free stacks hold the GIL, so there is one consumer at a time
 * and it takes a whole stack with one exchange: no ABA problem.
 */
#include "native.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>
#include <structmember.h>
#define QUEUED         (1ULL << 63) /* Gen.state: on the dead stack */
#define COUNT          (QUEUED - 1)
#define COPY_NOGIL     (SLAB_ITEM_MAX + 1) /* put_storage's copies from here up release the GIL */

/* ---- the lock-free parts: no Python API until marked ---- */

static void
push_dead(GenObject *gen)
{
    GenObject *head = atomic_load_explicit(&shm_process.dead_stack, memory_order_relaxed);
    do {
        gen->next = head;
    } while (!atomic_compare_exchange_weak_explicit(&shm_process.dead_stack, &head, gen,
                                                    memory_order_release, memory_order_relaxed));
}

/* One count less; the Gen goes on the dead stack when it was the last (it keeps its
 * self-reference there, so it stays valid until dead() takes it). */
void
shm_drop_count(GenObject *gen)
{
    uint64_t s = atomic_load_explicit(&gen->state, memory_order_relaxed);
    uint64_t n;
    do {
        assert((s & COUNT) != 0); /* a count to drop: every drop follows its add */
        n = s - 1;
        if ((n & COUNT) == 0 && !(s & QUEUED)) {
            n |= QUEUED;
        }
    } while (!atomic_compare_exchange_weak_explicit(&gen->state, &s, n, memory_order_acq_rel,
                                                    memory_order_relaxed));
    if (n == QUEUED && !(s & QUEUED)) {
        push_dead(gen);
    }
}

/* torch's deleter: any thread, maybe without the GIL. Atomics and pushes only. */
static void
ctx_deleted(Ctx *ctx)
{
    GenObject *gen = ctx->gen;
    if (atomic_load_explicit(&ctx->importing, memory_order_acquire)) {
        /* torch's importer took the tensor, then failed (an element count that overflows
         * does so) and called this deleter before returning: the count goes now, once;
         * shm_import_tensor() recycles the context (no second deleter). */
        atomic_store_explicit(&ctx->deleted, 1, memory_order_release);
        shm_drop_count(gen);
        return;
    }
    Ctx *head = atomic_load_explicit(&shm_process.free_ctx, memory_order_relaxed);
    do {
        ctx->next = head;
    } while (!atomic_compare_exchange_weak_explicit(&shm_process.free_ctx, &head, ctx,
                                                    memory_order_release, memory_order_relaxed));
    shm_drop_count(gen);
}

void
shm_ctx_deleter(DLManagedTensorVersioned *managed)
{
    ctx_deleted((Ctx *)managed->manager_ctx);
}

void
shm_ctx_deleter_legacy(DLManagedTensor *managed)
{
    ctx_deleted((Ctx *)managed->manager_ctx);
}

/* ---- GIL held from here on ---- */

Ctx *
shm_take_ctx(shm_state *st)
{
    if (st->from_dlpack == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "shmreduce._native.init() was not called");
        return NULL;
    }
    if (shm_process.spare_ctx == NULL) {
        shm_process.spare_ctx =
            atomic_exchange_explicit(&shm_process.free_ctx, NULL, memory_order_acquire);
    }
    Ctx *ctx = shm_process.spare_ctx;
    if (ctx != NULL) {
        shm_process.spare_ctx = ctx->next;
        return ctx;
    }
    ctx = PyMem_RawMalloc(sizeof(Ctx));
    if (ctx == NULL) {
        PyErr_NoMemory();
    }
    return ctx;
}

void
shm_give_back_ctx(Ctx *ctx)
{
    assert(ctx != NULL && !atomic_load(&ctx->importing));
    ctx->next = shm_process.spare_ctx;
    shm_process.spare_ctx = ctx;
}

/* One count more (a storage, or a hold); the first takes the self-reference. */
void
shm_add_count(GenObject *gen)
{
    uint64_t s = atomic_fetch_add_explicit(&gen->state, 1, memory_order_acq_rel);
    assert((s & COUNT) != COUNT); /* the count never reaches QUEUED's bit */
    if (s == 0) {
        Py_INCREF(gen); /* a Gen on the dead stack (s == QUEUED) has it already */
    }
}

/* The one check a handle meets before a pointer is formed. */
int
shm_check_range(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes)
{
    if (gen->ended) {
        PyErr_Format(gen->module->sharing_error, "generation %S is over: stale handle",
                     gen->number);
        return -1;
    }
    /* Any offset a storage can lie at: a storage is shared where it lies, and one made
     * from a shared tensor's memory (torch.from_numpy(t.numpy()[1:])) lies 4 bytes into a
     * cache line. The bounds are what a pointer needs. */
    if (nbytes <= 0 || offset < gen->low || offset > gen->size || nbytes > gen->size - offset) {
        PyErr_Format(gen->module->sharing_error,
                     "handle out of bounds (%zd bytes at %zd of a %zd-byte segment): it does not "
                     "match its segment (forged or corrupted message)",
                     nbytes, offset, gen->size);
        return -1;
    }
    return 0;
}

/* The slab's next nbytes, claimed before anything else runs (a finalizer that sends
 * from inside torch's importer gets the next place, never this one), or -1 (no error
 * set) if they do not fit. The one place the cursor moves. */
Py_ssize_t
shm_claim(GenObject *gen, Py_ssize_t nbytes)
{
    Py_ssize_t at = gen->cursor;
    if (gen->ended || nbytes <= 0 || at < gen->low || at > gen->size || nbytes > gen->size - at) {
        return -1;
    }
    Py_ssize_t next = at + nbytes;
    gen->cursor =
        next > gen->size - (ALIGN - 1) ? gen->size : (next + ALIGN - 1) & ~(Py_ssize_t)(ALIGN - 1);
    assert(gen->cursor >= next && gen->cursor <= gen->size);
    return at;
}

/* The address of source's data (a CPU storage of at least nbytes), read now: the copy
 * that follows runs no Python code in between, so no other thread can move source and
 * free the memory it left under the copy (an address read earlier, in Python or before
 * a call into torch, may be freed memory by the time it is copied from). -1 on error. */
static int
source_address(shm_state *st, PyObject *source, Py_ssize_t nbytes, const char **ptr)
{
    PyObject *size = PyObject_CallMethodNoArgs(source, st->names[S_NBYTES]);
    if (size == NULL) {
        return -1;
    }
    Py_ssize_t have = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (have == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (have < nbytes) {
        PyErr_Format(PyExc_ValueError, "a copy of %zd bytes from a %zd-byte storage", nbytes, have);
        return -1;
    }
    PyObject *address = PyObject_CallMethodNoArgs(source, st->names[S_DATA_PTR]);
    if (address == NULL) {
        return -1;
    }
    *ptr = PyLong_AsVoidPtr(address);
    Py_DECREF(address);
    if (*ptr == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "a copy from a storage with no data");
        }
        return -1;
    }
    return 0;
}

/* nbytes of storage source (NULL: zeros) copied to offset, then the storage there.
 * Copies this large release the GIL: only of storages reduce() never moves (it moves
 * none above SLAB_ITEM_MAX) and Python moves under the storage's lock, so no other
 * thread swaps the source away under the copy. The copy is guarded (header.c): into
 * a segment truncated by another process, it raises OSError(EFAULT) (the segment is
 * lost to its pool); from memory truncated so, SharingError. */
PyObject *
shm_put_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes, PyObject *source)
{
    const char *from = NULL;
    if (shm_check_range(gen, offset, nbytes) < 0 ||
        (source != NULL && source_address(gen->module, source, nbytes, &from) < 0)) {
        return NULL;
    }
    char *dest = gen->addr + offset;
    void *at = NULL;
    int error;
    if (nbytes >= COPY_NOGIL) {
        int threads = shm_copy_threads(nbytes);
        Py_BEGIN_ALLOW_THREADS
        error = shm_copy(dest, from, (size_t)nbytes, -1, 0, threads, &at);
        Py_END_ALLOW_THREADS
        if (!error && shm_check_range(gen, offset, nbytes) <
            0) { /* ended while the copy ran without the GIL */
            return NULL;
        }
    }
    else {
        error = shm_copy(dest, from, (size_t)nbytes, -1, 0, 1, &at);
    }
    if (error) {
        if ((char *)at >= dest && (char *)at < dest + nbytes) {
            errno = EFAULT; /* this segment was cut: its pool lets go of it */
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        /* the source's memory was cut (a storage in a lost segment): its bytes are gone */
        PyErr_SetString(gen->module->sharing_error, SHM_CUT_MESSAGE);
        return NULL;
    }
    return shm_make_storage(gen, offset, nbytes);
}

/* The identity map's key is the offset as an exact int: a load makes it once, and
 * its lookup and its shm_remember() share it. */

/* The live storage made or loaded at offset (key) here (a new reference), or NULL (no
 * error set when there is none). */
PyObject *
shm_stored_at(GenObject *gen, PyObject *key)
{
    PyObject *weak = PyDict_GetItemWithError(gen->stored, key);
    return weak != NULL ? referent(weak) : NULL;
}

/* storage lies at offset (key) here: what a ref to it loads from now on. The weak
 * reference has no callback, so it refers to nothing strongly and can be in no
 * cycle: it is taken out of the collector's lists, which every collection would
 * otherwise walk (one lives per storage sent or loaded, while its generation does). */
int
shm_remember(GenObject *gen, PyObject *key, PyObject *storage)
{
    PyObject *weak = PyWeakref_NewRef(storage, NULL);
    if (weak == NULL) {
        return -1;
    }
    if (PyObject_GC_IsTracked(weak)) {
        PyObject_GC_UnTrack(weak);
    }
    int done = PyDict_SetItem(gen->stored, key, weak);
    Py_DECREF(weak);
    return done;
}

/* storage, new here at offset (key), is what a ref of ticket loaded: remembered, then
 * counted loaded in the header (a pooled generation's, a first load only) and in this
 * process. The one tail of both load paths (load_storage, pickler.c's make_plain). A
 * ref whose storage cannot be remembered is not delivered, so it is not counted: its
 * message may be loaded again. */
int
shm_loaded_new(GenObject *gen, PyObject *key, PyObject *storage, Py_ssize_t nbytes, uint64_t ticket)
{
    if (shm_remember(gen, key, storage) < 0) {
        return -1;
    }
    if (gen->hdr &&
        shm_count_loaded((_Atomic uint64_t *)gen->hdr, ticket, gen->module->sharing_error) < 0) {
        return -1;
    }
    gen->module->loads++;
    gen->module->loaded_bytes += (unsigned long long)nbytes;
    return 0;
}

/* What a ref of ticket to nbytes at offset loads (the generation held by the caller):
 * the storage this process has there already, else a new one, remembered. Counted
 * loaded in the header (a first load only: header.c) once the storage exists: a ref
 * refused here was not loaded, and its message may be in flight. */
static PyObject *
load_storage(GenObject *gen, Py_ssize_t offset, Py_ssize_t nbytes, uint64_t ticket)
{
    PyObject *key = PyLong_FromSsize_t(offset);
    if (key == NULL) {
        return NULL;
    }
    PyObject *storage = shm_stored_at(gen, key);
    if (storage == NULL && PyErr_Occurred()) {
        goto error;
    }
    if (storage != NULL) {
        PyObject *size = PyObject_CallMethodNoArgs(storage, gen->module->names[S_NBYTES]);
        if (size == NULL) {
            goto error;
        }
        Py_ssize_t have = PyLong_AsSsize_t(size);
        Py_DECREF(size);
        if (have == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (have == nbytes) {
            if (gen->hdr && shm_count_loaded((_Atomic uint64_t *)gen->hdr, ticket,
                                             gen->module->sharing_error) < 0) {
                goto error;
            }
            gen->module->loaded_again++;
            Py_DECREF(key);
            return storage;
        }
        /* another storage at that offset (one made over part of a storage loaded here
         * starts where it does): this ref's is made */
        Py_CLEAR(storage);
    }
    if (shm_check_range(gen, offset, nbytes) < 0) {
        goto error;
    }
    storage = shm_make_storage(gen, offset, nbytes);
    if (storage == NULL || shm_loaded_new(gen, key, storage, nbytes, ticket) < 0) {
        goto error;
    }
    Py_DECREF(key);
    return storage;

error:
    Py_DECREF(key);
    Py_XDECREF(storage);
    return NULL;
}

/* ---- the Gen type ---- */

static int
parse_range(shm_state *st, const char *name, PyObject *const *args, Py_ssize_t nargs,
            Py_ssize_t want, Py_ssize_t *offset, Py_ssize_t *nbytes)
{
    if (shm_check_nargs(name, nargs, want, want) < 0) {
        return -1;
    }
    if (!PyLong_CheckExact(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(st->sharing_error,
                        "handle offset and size must be ints (forged or corrupted message)");
        return -1;
    }
    *offset = PyLong_AsSsize_t(args[0]);
    *nbytes = PyLong_AsSsize_t(args[1]);
    if ((*offset == -1 || *nbytes == -1) && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(st->sharing_error,
                        "handle offset or size out of range (forged or corrupted message)");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(gen_storage_doc,
             "storage($self, offset, nbytes, /)\n--\n\n-> UntypedStorage\n\nThe storage over "
             "nbytes at offset of the segment (checked first: SharingError).");

static PyObject *
gen_storage(GenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t offset, nbytes;
    if (parse_range(self->module, "storage", args, nargs, 2, &offset, &nbytes) < 0 ||
        shm_check_range(self, offset, nbytes) < 0) {
        return NULL;
    }
    return shm_make_storage(self, offset, nbytes);
}

PyDoc_STRVAR(gen_place_doc,
             "place($self, offset, nbytes, source, /)\n--\n\n-> UntypedStorage\n\nCopy nbytes of "
             "the CPU storage source (None: zeros) to offset, then storage(offset, nbytes).\nIts "
             "address is read at the copy, never before.");

static PyObject *
gen_place(GenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t offset, nbytes;
    if (parse_range(self->module, "place", args, nargs, 3, &offset, &nbytes) < 0) {
        return NULL;
    }
    return shm_put_storage(self, offset, nbytes, args[2] == Py_None ? NULL : args[2]);
}

PyDoc_STRVAR(
    gen_put_doc,
    "put($self, nbytes, source, zero=True, /)\n--\n\n-> (offset, UntypedStorage) | None\n\nplace() "
    "of source (a storage, or None: zeros, or if not zero the bytes there as they are) at this "
    "slab's next free offset (claimed first); None if nbytes do not fit.");

static PyObject *
gen_put(GenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("put", nargs, 2, 3) < 0) {
        return NULL;
    }
    if (!PyLong_CheckExact(args[0])) {
        PyErr_Format(PyExc_TypeError, "put() argument 1 must be int, not %.200s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[0]);
    int zero = nargs < 3 ? 1 : PyObject_IsTrue(args[2]);
    if ((nbytes == -1 && PyErr_Occurred()) || zero < 0) {
        return NULL;
    }
    Py_ssize_t offset = shm_claim(self, nbytes);
    if (offset < 0) {
        Py_RETURN_NONE;
    }
    PyObject *storage;
    if (args[1] == Py_None && !zero) {
        storage = shm_make_storage(self, offset, nbytes); /* shm_claim() checked the range */
    }
    else {
        storage = shm_put_storage(self, offset, nbytes, args[1] == Py_None ? NULL : args[1]);
    }
    if (storage == NULL) {
        return NULL;
    }
    return Py_BuildValue("(nN)", offset, storage);
}

PyDoc_STRVAR(gen_seal_doc,
             "seal($self, /)\n--\n\nPlace nothing more in this slab (its segment is sealed).");

static PyObject *
gen_seal(GenObject *self, PyObject *Py_UNUSED(ignored))
{
    self->cursor = self->size;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gen_load_doc,
             "load($self, offset, nbytes, ticket, /)\n--\n\n-> UntypedStorage\n\nWhat a ref of "
             "ticket to nbytes at offset loads, the generation held: the storage made or loaded "
             "there already, else a new one; counted loaded in the header (first loads only).");

static PyObject *
gen_load(GenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t offset, nbytes;
    if (parse_range(self->module, "load", args, nargs, 3, &offset, &nbytes) < 0) {
        return NULL;
    }
    uint64_t ticket = PyLong_AsUnsignedLongLong(args[2]);
    if (ticket == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError) &&
            !PyErr_ExceptionMatches(PyExc_TypeError)) {
            return NULL;
        }
        PyErr_Clear();
        ticket = NOT_A_TICKET;
    }
    return load_storage(self, offset, nbytes, ticket);
}

PyDoc_STRVAR(gen_stored_doc, "stored($self, offset, /)\n--\n\n-> UntypedStorage | None\n\nThe live "
                             "storage made or loaded at offset here.");

/* An offset argument as the identity map's key (an exact int, whatever int-like
 * Python passed), or NULL. */
static PyObject *
offset_key(PyObject *obj)
{
    Py_ssize_t offset = PyLong_AsSsize_t(obj);
    if (offset == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromSsize_t(offset);
}

static PyObject *
gen_stored(GenObject *self, PyObject *offset_obj)
{
    PyObject *key = offset_key(offset_obj);
    if (key == NULL) {
        return NULL;
    }
    PyObject *storage = shm_stored_at(self, key);
    Py_DECREF(key);
    if (storage == NULL && !PyErr_Occurred()) {
        Py_RETURN_NONE;
    }
    return storage;
}

PyDoc_STRVAR(gen_remember_doc, "remember($self, offset, storage, /)\n--\n\nstorage lies at offset "
                               "here: what a ref to offset loads.");

static PyObject *
gen_remember(GenObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("remember", nargs, 2, 2) < 0) {
        return NULL;
    }
    PyObject *key = offset_key(args[0]);
    if (key == NULL) {
        return NULL;
    }
    int done = shm_remember(self, key, args[1]);
    Py_DECREF(key);
    if (done < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gen_acquire_doc,
             "acquire($self, /)\n--\n\n-> bool\n\nHold the generation as a storage would (a slab's "
             "owner, a load in progress); False, holding nothing, once dead() has reported it.");

static PyObject *
gen_acquire(GenObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->ended) {
        Py_RETURN_FALSE;
    }
    shm_add_count(self);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(
    gen_release_doc,
    "release($self, /)\n--\n\nLet go of one acquire() (or of the hold a Gen is made with).");

static PyObject *
gen_release(GenObject *self, PyObject *Py_UNUSED(ignored))
{
    if ((atomic_load(&self->state) & COUNT) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "release() of a generation nobody holds");
        return NULL;
    }
    shm_drop_count(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gen_publish_doc,
             "publish($self, key, /)\n--\n\nMake load() and rebuild() load refs whose template "
             "(kind, directory, segment, generation, tag) is key through this Gen, until dead() "
             "reports it (a receiver's, held: Python checked the generation).");

static PyObject *
gen_publish(GenObject *self, PyObject *key)
{
    PyObject *published = self->module->published;
    if (published == NULL || self->ended || self->key != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "publish() before init(), of an ended Gen, or twice");
        return NULL;
    }
    if (PyDict_SetItem(published, key, (PyObject *)self) < 0) {
        return NULL;
    }
    self->key = Py_NewRef(key);
    Py_RETURN_NONE;
}

static PyObject *
gen_get_live(GenObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(atomic_load(&self->state) & COUNT);
}

static PyObject *
gen_get_ended(GenObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->ended);
}

static PyObject *
gen_get_info(GenObject *self, void *Py_UNUSED(closure))
{
    if (self->info == NULL) { /* the collector cleared it */
        Py_RETURN_NONE;
    }
    return Py_NewRef(self->info);
}

static int
gen_set_info(GenObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL) {
        PyErr_SetString(PyExc_AttributeError, "info cannot be deleted");
        return -1;
    }
    Py_SETREF(self->info, Py_NewRef(value));
    return 0;
}

static PyObject *
gen_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"owner", "addr", "size", "number", "low", "header", NULL};
    PyObject *owner, *addr_obj, *number;
    Py_ssize_t size, low, header = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnO!n|n:Gen", kwlist, &owner, &addr_obj, &size,
                                     &PyLong_Type, &number, &low, &header)) {
        return NULL;
    }
    void *addr = PyLong_AsVoidPtr(addr_obj);
    if (addr == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "Gen over a null address");
        }
        return NULL;
    }
    /* A pooled generation (low > 0) writes its header's words and ticket bits: its
     * storages start past the whole header, which lies aligned at addr. One that is not
     * pooled (a storage torch shared) may be as small as its storage: a byte; where
     * torch moved it for shmreduce, a header trails it (header: its offset, at or past
     * size, the mapping holding its HEADER_BYTES). */
    if (size <= 0 || low < 0 || low > size ||
        (low > 0 && (low < HEADER_BYTES || (uintptr_t)addr % 8 || header >= 0)) ||
        (header >= 0 && (header < size || ((uintptr_t)addr + (uintptr_t)header) % 8))) {
        PyErr_Format(
            PyExc_ValueError,
            "Gen of a %zd-byte segment from byte %zd, header at %zd (a pooled one starts past its "
            "%d-byte header; a trailing one lies past the storage, aligned)",
            size, low, header, HEADER_BYTES);
        return NULL;
    }
    PyObject *stored = PyDict_New();
    if (stored == NULL) {
        return NULL;
    }
    GenObject *self = (GenObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(stored);
        return NULL;
    }
    atomic_init(&self->state, 1); /* the maker's hold: release() it */
    Py_INCREF(self);              /* ... which owns the self-reference */
    self->next = NULL;
    self->module = PyType_GetModuleState(type);
    assert(self->module != NULL); /* Gen is not a base type: type is the module's own */
    self->owner = Py_NewRef(owner);
    self->info = Py_NewRef(Py_None);
    self->stored = stored;
    self->weakrefs = NULL;
    self->addr = addr;
    self->size = size;
    self->low = low;
    self->hdr = low > 0 ? (char *)addr : header >= 0 ? (char *)addr + header : NULL;
    self->number = Py_NewRef(number);
    self->key = NULL;
    self->template = NULL;
    self->cursor = low;
    self->ended = 0;
    return (PyObject *)self;
}

/* What the collector must see: info can hold anything (the pool's bookkeeping), owner
 * is the Segment, which can refer back to its Gens. A Gen with a count owns a reference
 * to itself, which no traversal reports: the collector never frees one whose storages
 * live. */
static int
gen_traverse(GenObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->owner);
    Py_VISIT(self->info);
    Py_VISIT(self->stored);
    Py_VISIT(self->number);
    Py_VISIT(self->key);
    Py_VISIT(self->template);
    return 0;
}

/* Breaks the cycles info and owner can close. Only a Gen with no count reaches here,
 * ended (dead() reported it): no storage is made over its mapping any more. */
static int
gen_clear(GenObject *self)
{
    Py_CLEAR(self->info);
    Py_CLEAR(self->owner);
    return 0;
}

static void
gen_dealloc(GenObject *self)
{
    /* Only reached with no count and off the dead stack: the self-reference is gone. */
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakrefs != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    (void)gen_clear(self);
    Py_XDECREF(self->stored);
    Py_XDECREF(self->number);
    Py_XDECREF(self->key);
    Py_XDECREF(self->template);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

PyDoc_STRVAR(gen_index_doc,
             "index($self, template, /)\n--\n\nSend storages in this Gen from reduce(), with refs "
             "(*template[:4], offset, nbytes, template[4], ticket).");

static PyMethodDef gen_methods[] = {
    {"storage", (PyCFunction)(void (*)(void))gen_storage, METH_FASTCALL, gen_storage_doc},
    {"place", (PyCFunction)(void (*)(void))gen_place, METH_FASTCALL, gen_place_doc},
    {"put", (PyCFunction)(void (*)(void))gen_put, METH_FASTCALL, gen_put_doc},
    {"seal", (PyCFunction)gen_seal, METH_NOARGS, gen_seal_doc},
    {"load", (PyCFunction)(void (*)(void))gen_load, METH_FASTCALL, gen_load_doc},
    {"stored", (PyCFunction)gen_stored, METH_O, gen_stored_doc},
    {"remember", (PyCFunction)(void (*)(void))gen_remember, METH_FASTCALL, gen_remember_doc},
    {"acquire", (PyCFunction)gen_acquire, METH_NOARGS, gen_acquire_doc},
    {"release", (PyCFunction)gen_release, METH_NOARGS, gen_release_doc},
    {"publish", (PyCFunction)gen_publish, METH_O, gen_publish_doc},
    {"index", (PyCFunction)shm_gen_index, METH_O, gen_index_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef gen_members[] = {
    {"cursor", T_PYSSIZET, offsetof(GenObject, cursor), READONLY,
     "a slab's next free offset (put() and reduce() move it)"},
    {"owner", T_OBJECT, offsetof(GenObject, owner), READONLY, "the segment"},
    {"number", T_OBJECT, offsetof(GenObject, number), READONLY, "the generation"},
    {"__weaklistoffset__", T_PYSSIZET, offsetof(GenObject, weakrefs), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef gen_getset[] = {
    {"live", (getter)gen_get_live, NULL, "storages and holds alive now", NULL},
    {"ended", (getter)gen_get_ended, NULL, "dead() reported it", NULL},
    {"info", (getter)gen_get_info, (setter)gen_set_info, "the pool's bookkeeping", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(gen_doc, "Gen(owner, addr, size, number, low)\n--\n\nA generation of a mapped segment "
                      "in this process; made held once (release() it).");

static PyType_Slot gen_slots[] = {
    {Py_tp_doc, (void *)gen_doc},   {Py_tp_new, gen_new},       {Py_tp_dealloc, gen_dealloc},
    {Py_tp_traverse, gen_traverse}, {Py_tp_clear, gen_clear},   {Py_tp_methods, gen_methods},
    {Py_tp_members, gen_members},   {Py_tp_getset, gen_getset}, {0, NULL},
};

PyType_Spec shm_gen_spec = {
    .name = "shmreduce._native.Gen",
    .basicsize = sizeof(GenObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = gen_slots,
};

/* ---- dead() ---- */

/* Out of the published dict: rebuild() loads through it no more (never fails: dead() must not). */
static void
unpublish(GenObject *gen)
{
    PyObject *published = gen->module->published;
    if (gen->key == NULL) {
        return;
    }
    if (published == NULL) { /* the module was cleared (the interpreter is ending) */
        Py_CLEAR(gen->key);
        return;
    }
    PyObject *found = PyDict_GetItemWithError(published, gen->key);
    if (found == (PyObject *)gen && PyDict_DelItem(published, gen->key) < 0) {
        found = NULL;
    }
    if (found == NULL) {
        PyErr_Clear();
    }
    Py_CLEAR(gen->key);
}

PyDoc_STRVAR(dead_doc, "dead($module, /)\n--\n\n-> list[Gen]\n\nThe generations whose last storage "
                       "and hold died since the last call, each once; each is ended.");

static PyObject *
native_dead(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    PyObject *result = PyList_New(0);
    if (result == NULL) {
        return NULL;
    }
    GenObject *gen = atomic_exchange_explicit(&shm_process.dead_stack, NULL, memory_order_acquire);
    while (gen != NULL) {
        GenObject *next = gen->next;
        uint64_t s = atomic_load_explicit(&gen->state, memory_order_acquire);
        assert(s & QUEUED); /* set by the push, cleared only here */
        int dead;
        for (;;) {
            /* QUEUED with no count: dead (its self-reference is ours now). Else it was
             * revived while queued: off the stack, its storages keep the reference. */
            uint64_t n = (s == QUEUED) ? 0 : (s & ~QUEUED);
            if (atomic_compare_exchange_weak_explicit(&gen->state, &s, n, memory_order_acq_rel,
                                                      memory_order_acquire)) {
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
                while (tail->next != NULL) {
                    tail = tail->next;
                }
                GenObject *head = atomic_load(&shm_process.dead_stack);
                do {
                    tail->next = head;
                } while (!atomic_compare_exchange_weak(&shm_process.dead_stack, &head, gen));
                return result;
            }
            Py_DECREF(gen); /* the list holds it now */
            unpublish(gen);
            shm_unindex(gen);
        }
        gen = next;
    }
    return result;
}

PyDoc_STRVAR(pending_doc, "pending($module, /)\n--\n\n-> bool\n\nWhether dead() has something to "
                          "report (one atomic load).");

static PyObject *
native_pending(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(atomic_load_explicit(&shm_process.dead_stack, memory_order_relaxed) !=
                           NULL);
}

PyDoc_STRVAR(
    loaded_doc,
    "loaded($module, /)\n--\n\n-> (storages, bytes, again)\n\nThe storages this process loaded "
    "(made for a ref), their bytes, and the refs loaded as a storage it had already.");

static PyObject *
native_loaded(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    shm_state *st = shm_get_state(module);
    return Py_BuildValue("KKK", st->loads, st->loaded_bytes, st->loaded_again);
}

PyDoc_STRVAR(count_sent_doc, "count_sent($module, gens, sent, /)\n--\n\nA sending scope closes: "
                             "each entry of gens (a Gen, acquired once per ref the scope pickled "
                             "from it) counted one ref sent in its header if sent, then released.");

/* The sending scope holds each generation it pickled a ref of (an acquire() per ref)
 * until its refs are counted: a storage made while pickling (alive only in the
 * pickler's memo) cannot die, its generation end and its segment be freed or closed,
 * before the ref that names it is counted sent. */
static PyObject *
native_count_sent(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("count_sent", nargs, 2, 2) < 0) {
        return NULL;
    }
    if (!PyList_CheckExact(args[0])) {
        PyErr_Format(PyExc_TypeError, "count_sent() argument 1 must be list, not %.200s",
                     Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    PyTypeObject *gen_type = shm_get_state(module)->gen_type;
    PyObject *gens = args[0];
    int sent = PyObject_IsTrue(args[1]);
    if (sent < 0) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gens); i++) {
        PyObject *item = PyList_GET_ITEM(gens, i);
        if (Py_TYPE(item) != gen_type || (atomic_load(&((GenObject *)item)->state) & COUNT) == 0) {
            PyErr_SetString(PyExc_TypeError,
                            "count_sent() of something not a held Gen: nothing counted");
            return NULL;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(gens); i++) {
        GenObject *gen = (GenObject *)PyList_GET_ITEM(gens, i);
        if (sent && gen->hdr) {
            shm_count_sent((_Atomic uint64_t *)gen->hdr);
        }
        shm_drop_count(gen);
    }
    Py_RETURN_NONE;
}

PyMethodDef shm_lifetime_methods[] = {
    {"count_sent", (PyCFunction)(void (*)(void))native_count_sent, METH_FASTCALL, count_sent_doc},
    {"dead", native_dead, METH_NOARGS, dead_doc},
    {"pending", native_pending, METH_NOARGS, pending_doc},
    {"loaded", native_loaded, METH_NOARGS, loaded_doc},
    {NULL, NULL, 0, NULL},
};
