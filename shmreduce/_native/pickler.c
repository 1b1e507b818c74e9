/* pickler.c: a plain CPU tensor pickled and loaded in one call each way.
 *
 * Owns: reduce(), the pickler's reducer for torch.Tensor (into this thread's slab, or
 * from where its storage lies), which pickles a plain tensor in its compact form
 * (load(template, packed): the Gen's template tuple, once a message, and a few packed
 * bytes); load() and rebuild() (reductions.reduce_tensor's (ref, meta) form), what
 * pickles name, which make the tensor through a Gen this process published by one
 * routine (make_plain). Each does the common case and hands every other one, before
 * it changed anything, to the Python it stands in for (reductions.reduce_tensor /
 * rebuild_tensor / rebuild_packed), which decides what is indexed, published and filled. The
 * sending scope (message()) and the broker's post connection it checks once per message. Calls:
 * lifetime.c (shm_claim, shm_put_storage, shm_stored_at, shm_remember, shm_loaded_new), dlpack.c
 * (the typed import), segments.c (where a storage lies), header.c (tickets, loads).
 */
#include "native.h"

#include <poll.h>

/* This thread's sending scope (thread-local: native.h says why it is not module state). */
static _Thread_local PyObject *outgoing; /* the scope's held Gens (one per ref), or NULL */
static _Thread_local int broker_seen;    /* this message found its broker live */

/* reductions.<name>, imported on first use into *slot (importing shmreduce, in a
 * process whose first shmreduce object is a pickle's); borrowed, or NULL. */
static PyObject *
reductions_function(PyObject **slot, const char *name)
{
    if (*slot == NULL) {
        PyObject *module = PyImport_ImportModule("shmreduce.reductions");
        if (module == NULL) {
            return NULL;
        }
        *slot = PyObject_GetAttrString(module, name);
        Py_DECREF(module);
    }
    return *slot;
}

/* rebuild(ref, meta): the general one; rebuild(ref, meta, None), from it: None. */
static PyObject *
rebuild_general(shm_state *st, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs == 3) {
        Py_RETURN_NONE;
    }
    PyObject *fn = reductions_function(&st->general_rebuild, "rebuild_tensor");
    return fn == NULL ? NULL : PyObject_Vectorcall(fn, args, (size_t)nargs, NULL);
}

/* load(template, packed): the general one (reductions.rebuild_packed). */
static PyObject *
load_general(shm_state *st, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *fn = reductions_function(&st->general_load, "rebuild_packed");
    return fn == NULL ? NULL : PyObject_Vectorcall(fn, args, (size_t)nargs, NULL);
}

/* An exact int's value, or -1 for anything else (no error set). */
static Py_ssize_t
small_int(PyObject *obj)
{
    if (!PyLong_CheckExact(obj)) {
        return -1;
    }
    Py_ssize_t value = PyLong_AsSsize_t(obj);
    if (value == -1) {
        PyErr_Clear();
    }
    return value;
}

/* ---- the two pickled forms of a plain tensor, and the one routine that makes it ---- */

/* What either form says of a plain tensor: its storage's range and ticket, its dtype,
 * where it starts in its storage and its layout. */
typedef struct {
    Py_ssize_t offset, nbytes;
    uint64_t ticket;
    int64_t storage_offset;
    DLDataType dtype;
    Py_ssize_t itemsize;
    Layout layout;
} Plain;

/* The compact form, reduce()'s: load(template, packed). template is the Gen's own
 * (kind, directory, segment, generation, tag) tuple, one object for every ref of it,
 * so a message pickles it once and its receiver finds the Gen by it as it stands;
 * packed is these bytes (native order: a ref is valid on its host only), followed by
 * ndim sizes and then ndim strides, int64 each. */
typedef struct {
    uint64_t offset, nbytes, ticket;
    int64_t storage_offset;
    uint8_t code, bits;
    uint16_t lanes;
    uint32_t ndim;
} PackedHead;

/* packed's fields into *p (dtype's itemsize not looked up): 0, or -1 (SharingError). */
static int
parse_packed(shm_state *st, PyObject *packed, Plain *p)
{
    PackedHead head;
    Py_ssize_t length = PyBytes_CheckExact(packed) ? PyBytes_GET_SIZE(packed) : -1;
    if (length < (Py_ssize_t)sizeof head) {
        goto bad;
    }
    memcpy(&head, PyBytes_AS_STRING(packed), sizeof head);
    if (head.ndim > MAX_DIMS ||
        length != (Py_ssize_t)(sizeof head + 2 * head.ndim * sizeof(int64_t)) ||
        head.offset > (uint64_t)PY_SSIZE_T_MAX || head.nbytes == 0 ||
        head.nbytes > (uint64_t)PY_SSIZE_T_MAX || head.storage_offset < 0) {
        goto bad;
    }
    p->offset = (Py_ssize_t)head.offset;
    p->nbytes = (Py_ssize_t)head.nbytes;
    p->ticket = head.ticket;
    p->storage_offset = head.storage_offset;
    p->dtype = (DLDataType){.code = head.code, .bits = head.bits, .lanes = head.lanes};
    p->itemsize = 0;
    p->layout.ndim = (int32_t)head.ndim;
    const char *arrays = PyBytes_AS_STRING(packed) + sizeof head;
    memcpy(p->layout.shape, arrays, head.ndim * sizeof(int64_t));
    memcpy(p->layout.strides, arrays + head.ndim * sizeof(int64_t), head.ndim * sizeof(int64_t));
    return 0;
bad:
    PyErr_SetString(st->sharing_error, "not a shmreduce tensor handle: its packed fields are "
                                       "malformed (forged or corrupted message)");
    return -1;
}

/* An entry of the dtype table (torch dtype -> (code, bits, lanes, itemsize), filled
 * once by reductions.dlpack_table): 1 and its DLPack dtype and itemsize, or 0 (no
 * error set) for one that is no such tuple of ints in range. */
static int
table_entry(PyObject *value, DLDataType *t, Py_ssize_t *itemsize)
{
    if (!PyTuple_CheckExact(value) || PyTuple_GET_SIZE(value) != 4) {
        return 0;
    }
    Py_ssize_t code = small_int(PyTuple_GET_ITEM(value, 0));
    Py_ssize_t bits = small_int(PyTuple_GET_ITEM(value, 1));
    Py_ssize_t lanes = small_int(PyTuple_GET_ITEM(value, 2));
    Py_ssize_t size = small_int(PyTuple_GET_ITEM(value, 3));
    if (code < 0 || code > 255 || bits <= 0 || bits > 255 || lanes <= 0 || lanes > 65535 ||
        size <= 0) {
        return 0;
    }
    *t = (DLDataType){.code = (uint8_t)code, .bits = (uint8_t)bits, .lanes = (uint16_t)lanes};
    *itemsize = size;
    return 1;
}

/* The dtype table read the other way (native.h's DtypeEntry). */
static uint32_t
code_of(DLDataType t)
{
    return (uint32_t)t.code | (uint32_t)t.bits << 8 | (uint32_t)t.lanes << 16;
}

/* A DLPack dtype's torch dtype (borrowed) and itemsize, or NULL (no error) if the
 * table has none (yet). */
static PyObject *
torch_dtype(shm_state *st, DLDataType t, Py_ssize_t *itemsize)
{
    if (st->dtypes == NULL) {
        return NULL;
    }
    if (PyDict_GET_SIZE(st->dtypes) != st->by_code_from) {
        Py_ssize_t pos = 0, n = 0;
        PyObject *key, *value;
        while (n < BY_CODE_MAX && PyDict_Next(st->dtypes, &pos, &key, &value)) {
            DLDataType entry;
            if (!table_entry(value, &entry, &st->by_code[n].itemsize)) {
                continue;
            }
            st->by_code[n].code = code_of(entry);
            Py_XSETREF(st->by_code[n].dtype, Py_NewRef(key));
            n++;
        }
        st->by_code_count = n;
        st->by_code_from = PyDict_GET_SIZE(st->dtypes);
    }
    uint32_t want = code_of(t);
    for (Py_ssize_t i = 0; i < st->by_code_count; i++) {
        if (st->by_code[i].code == want) {
            *itemsize = st->by_code[i].itemsize;
            return st->by_code[i].dtype;
        }
    }
    return NULL;
}

/* The tensor *p describes, made over gen's mapping in one step: 1 (*out set), or 0
 * for the general path (it does not start its storage and span it exactly, has no
 * element, or its storage was loaded here already), or -1 on error. Counted loaded in
 * the header, remembered in the Gen's identity map. */
static int
make_plain(GenObject *gen, const Plain *p, PyObject **out)
{
    int64_t extent = 0;
    int checked = shm_check_layout(gen->module, &p->layout, p->itemsize, &extent);
    if (checked != 0) {
        return checked < 0 ? -1 : 0;
    }
    if (p->storage_offset != 0 || extent != p->nbytes) {
        return 0; /* a storage larger than the tensor's elements */
    }
    PyObject *tensor = NULL, *storage = NULL;
    PyObject *key = PyLong_FromSsize_t(p->offset); /* the identity map's key */
    if (key == NULL) {
        goto error;
    }
    PyObject *loaded = shm_stored_at(gen, key);
    if (loaded != NULL) {
        /* loaded here already: the general case makes a tensor of that storage */
        Py_DECREF(loaded);
        Py_DECREF(key);
        return 0;
    }
    if (PyErr_Occurred() || shm_check_range(gen, p->offset, p->nbytes) < 0) {
        goto error;
    }
    Ctx *ctx = shm_take_ctx(gen->module);
    if (ctx == NULL) {
        goto error;
    }
    assert(p->layout.ndim >= 0 && p->layout.ndim <= MAX_DIMS); /* shm_check_layout() said so */
    ctx->managed.dl_tensor.ndim = p->layout.ndim;
    ctx->managed.dl_tensor.dtype = p->dtype;
    memcpy(ctx->shape, p->layout.shape, (size_t)p->layout.ndim * sizeof(int64_t));
    memcpy(ctx->strides, p->layout.strides, (size_t)p->layout.ndim * sizeof(int64_t));
    tensor = shm_import_tensor(gen, ctx, p->offset);
    if (tensor == NULL) {
        goto error;
    }
    storage = PyObject_CallMethodNoArgs(tensor, gen->module->names[S_UNTYPED_STORAGE]);
    if (storage == NULL || shm_loaded_new(gen, key, storage, p->nbytes, p->ticket) < 0) {
        goto error;
    }
    Py_DECREF(storage);
    Py_DECREF(key);
    *out = tensor;
    return 1;

error:
    Py_XDECREF(storage);
    Py_XDECREF(tensor);
    Py_XDECREF(key);
    return -1;
}

/* make_plain()'s tensor, or what general makes of args where it hands the case on. */
static PyObject *
plain_or(GenObject *gen, const Plain *p,
         PyObject *(*general)(shm_state *, PyObject *const *, Py_ssize_t), PyObject *const *args,
         Py_ssize_t nargs)
{
    PyObject *tensor = NULL;
    int made = make_plain(gen, p, &tensor);
    if (made < 0) {
        return NULL;
    }
    if (made == 0) {
        return general(gen->module, args, nargs);
    }
    return tensor;
}

/* gen published under key, borrowed; NULL with no error if none. */
static GenObject *
published_gen(shm_state *st, PyObject *key)
{
    GenObject *gen = (GenObject *)PyDict_GetItemWithError(st->published, key);
    if (gen == NULL && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(
            st->sharing_error,
            "not a shmreduce ref: its fields are not hashable (forged or corrupted message)");
    }
    return gen;
}

PyDoc_STRVAR(rebuild_doc,
             "rebuild($module, ref, meta, general=None, /)\n--\n\n-> Tensor\n\nA tensor pickled by "
             "reductions.reduce_tensor. Made here, in one call (the routine load() uses), where "
             "the ref's generation has a published Gen and the tensor is plain (no subclass, no "
             "grad), starts its storage and spans it exactly, in a dtype of the table, and its "
             "storage was not loaded here already. Every other case, malformed ones included, goes "
             "to the general one, shmreduce.reductions.rebuild_tensor, which calls rebuild(ref, "
             "meta, None) once it published the Gen: None there instead of the general one.");

/* A pickle that calls load() or rebuild() with other arguments than they take is not
 * one shmreduce made: refused as such, never a TypeError from the general path. */
static PyObject *
malformed_call(shm_state *st, const char *name)
{
    PyErr_Format(st->sharing_error,
                 "not a shmreduce tensor handle: %s() called with the wrong number of arguments "
                 "(forged or corrupted message)",
                 name);
    return NULL;
}

static PyObject *
native_rebuild(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (nargs < 2 || nargs > 3) {
        return malformed_call(st, "rebuild");
    }
    if (st->published == NULL || st->from_dlpack == NULL) {
        return rebuild_general(st, args, nargs);
    }
    PyObject *ref = args[0], *meta = args[1];
    if (!PyTuple_CheckExact(ref) || PyTuple_GET_SIZE(ref) != 8 || !PyTuple_CheckExact(meta) ||
        PyTuple_GET_SIZE(meta) != 5 || PyTuple_GET_ITEM(meta, 4) != Py_None ||
        small_int(PyTuple_GET_ITEM(meta, 3)) != 0) {
        return rebuild_general(st, args, nargs);
    }
    PyObject *entry = PyDict_GetItemWithError(st->dtypes, PyTuple_GET_ITEM(meta, 0));
    if (entry == NULL &&
        PyErr_Occurred()) { /* an unhashable dtype: no call is made with the error pending */
        PyErr_Clear();
        PyErr_SetString(st->sharing_error, "not a tensor's metadata: its dtype is not a torch "
                                           "dtype (forged or corrupted message)");
        return NULL;
    }
    /* the template the Gen is published by */
    PyObject *key =
        PyTuple_Pack(5, PyTuple_GET_ITEM(ref, 0), PyTuple_GET_ITEM(ref, 1),
                     PyTuple_GET_ITEM(ref, 2), PyTuple_GET_ITEM(ref, 3), PyTuple_GET_ITEM(ref, 6));
    if (key == NULL) {
        return NULL;
    }
    GenObject *gen = published_gen(st, key);
    Py_DECREF(key);
    if (gen == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Plain p = {.offset = small_int(PyTuple_GET_ITEM(ref, 4)),
               .nbytes = small_int(PyTuple_GET_ITEM(ref, 5))};
    Py_ssize_t ticket = small_int(PyTuple_GET_ITEM(ref, 7));
    p.ticket = ticket < 0 ? NOT_A_TICKET : (uint64_t)ticket;
    if (gen == NULL || entry == NULL || gen->ended || p.offset < 0 || p.nbytes <= 0 ||
        !PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) {
        return rebuild_general(st, args, nargs);
    }
    if (!table_entry(entry, &p.dtype, &p.itemsize)) {
        PyErr_SetString(PyExc_ValueError, "init(): not a DLPack dtype table");
        return NULL;
    }
    int parsed =
        shm_layout_from_tuples(st, PyTuple_GET_ITEM(meta, 1), PyTuple_GET_ITEM(meta, 2), &p.layout);
    if (parsed != 0) {
        return parsed < 0 ? NULL : rebuild_general(st, args, nargs);
    }
    return plain_or(gen, &p, rebuild_general, args, nargs);
}

PyDoc_STRVAR(load_doc,
             "load($module, template, packed, /)\n--\n\n-> Tensor\n\nA plain tensor pickled by "
             "reduce() (its compact form: the Gen's template tuple and the packed bytes). Made "
             "here in one call as rebuild() makes one; every other case, malformed ones included, "
             "goes to the general one, shmreduce.reductions.rebuild_packed.");

static PyObject *
native_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (nargs != 2) {
        return malformed_call(st, "load");
    }
    if (st->published == NULL || st->from_dlpack == NULL || !PyTuple_CheckExact(args[0]) ||
        PyTuple_GET_SIZE(args[0]) != 5) {
        return load_general(st, args, nargs);
    }
    Plain p;
    if (parse_packed(st, args[1], &p) < 0) {
        return NULL;
    }
    GenObject *gen = published_gen(st, args[0]);
    if (gen == NULL && PyErr_Occurred()) {
        return NULL;
    }
    if (gen == NULL || gen->ended || torch_dtype(st, p.dtype, &p.itemsize) == NULL) {
        return load_general(st, args, nargs);
    }
    return plain_or(gen, &p, load_general, args, nargs);
}

PyDoc_STRVAR(unpack_doc,
             "unpack($module, template, packed, /)\n--\n\n-> (ref, meta)\n\nload()'s arguments as "
             "rebuild()'s: the ref (the plain tuple transfer.share returns) and the meta of a plain tensor; "
             "SharingError if malformed, or of a dtype the table (filled first) does not have.");

static PyObject *
native_unpack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (shm_check_nargs("unpack", nargs, 2, 2) < 0) {
        return NULL;
    }
    PyObject *t = args[0];
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != 5) {
        PyErr_SetString(st->sharing_error, "not a shmreduce tensor handle: its template is not a "
                                           "5-tuple (forged or corrupted message)");
        return NULL;
    }
    Plain p;
    if (parse_packed(st, args[1], &p) < 0) {
        return NULL;
    }
    PyObject *dtype = torch_dtype(st, p.dtype, &p.itemsize);
    if (dtype == NULL) {
        PyErr_SetString(st->sharing_error, "not a tensor's metadata: its dtype is not one "
                                           "shmreduce sends (forged or corrupted message)");
        return NULL;
    }
    PyObject *size = PyTuple_New(p.layout.ndim), *stride = PyTuple_New(p.layout.ndim),
             *result = NULL;
    if (size == NULL || stride == NULL) {
        goto done;
    }
    for (int32_t i = 0; i < p.layout.ndim; i++) {
        PyObject *d = PyLong_FromLongLong(p.layout.shape[i]),
                 *st = PyLong_FromLongLong(p.layout.strides[i]);
        if (d == NULL || st == NULL) {
            Py_XDECREF(d);
            Py_XDECREF(st);
            goto done;
        }
        PyTuple_SET_ITEM(size, i, d);
        PyTuple_SET_ITEM(stride, i, st);
    }
    result = Py_BuildValue("((OOOOnnOK)(OOOLO))", PyTuple_GET_ITEM(t, 0), PyTuple_GET_ITEM(t, 1),
                           PyTuple_GET_ITEM(t, 2), PyTuple_GET_ITEM(t, 3), p.offset, p.nbytes,
                           PyTuple_GET_ITEM(t, 4), (unsigned long long)p.ticket, dtype, size,
                           stride, (long long)p.storage_offset, Py_None);
done:
    Py_XDECREF(size);
    Py_XDECREF(stride);
    return result;
}

/* ---- reduce(): a plain CPU tensor shared in one call ---- */

static PyObject *
reduce_general(shm_state *st, PyObject *tensor)
{
    PyObject *fn = reductions_function(&st->general_reduce, "reduce_tensor");
    return fn == NULL ? NULL : PyObject_CallOneArg(fn, tensor);
}

/* 1 if obj.<name> is want (a singleton), 0 if not, -1 on error. */
static int
attr_is(shm_state *st, PyObject *obj, int name, PyObject *want)
{
    PyObject *value = PyObject_GetAttr(obj, st->names[name]);
    if (value == NULL) {
        return -1;
    }
    Py_DECREF(value);
    return value == want;
}

/* 1 if obj.<name>() is False, 0 if not, -1 on error. */
static int
call_false(shm_state *st, PyObject *obj, int name)
{
    PyObject *value = PyObject_CallMethodNoArgs(obj, st->names[name]);
    if (value == NULL) {
        return -1;
    }
    Py_DECREF(value);
    return value == Py_False;
}

/* obj.<name>() as an address or size; -1 (error set) on failure. */
static Py_ssize_t
call_int(shm_state *st, PyObject *obj, int name)
{
    PyObject *value = PyObject_CallMethodNoArgs(obj, st->names[name]);
    if (value == NULL) {
        return -1;
    }
    Py_ssize_t n = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    return n;
}

/* 1 if tensor is plain (no grad, no hooks, strided, on the CPU, neither nested nor
 * quantized, no conjugate or negative bit), 0 if not, -1 on error. */
static int
is_plain(shm_state *st, PyObject *tensor)
{
    const struct {
        int name;
        PyObject *want;
    } attributes[] = {
        {S_REQUIRES_GRAD, Py_False}, {S_BACKWARD_HOOKS, Py_None}, {S_LAYOUT, st->strided},
        {S_IS_CPU, Py_True},         {S_IS_NESTED, Py_False},     {S_IS_QUANTIZED, Py_False},
    };
    for (size_t i = 0; i < Py_ARRAY_LENGTH(attributes); i++) {
        int is = attr_is(st, tensor, attributes[i].name, attributes[i].want);
        if (is <= 0) {
            return is;
        }
    }
    int is = call_false(st, tensor, S_IS_CONJ);
    if (is <= 0) {
        return is;
    }
    return call_false(st, tensor, S_IS_NEG);
}

/* Swap fresh's memory into storage if storage's data is still at ptr (no other thread
 * moved it meanwhile): 1; 0 if moved; -1 on error. No Python code runs in between. */
static int
move_into(shm_state *st, PyObject *storage, Py_ssize_t ptr, PyObject *fresh)
{
    if (st->swap == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "move() on a torch without _swap_data_ptr_");
        return -1;
    }
    Py_ssize_t now = call_int(st, storage, S_DATA_PTR);
    if (now == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (now != ptr) {
        return 0;
    }
    PyObject *pair[2] = {storage, fresh};
    PyObject *done = PyObject_Vectorcall(st->swap, pair, 2, NULL);
    Py_XDECREF(done);
    return done == NULL ? -1 : 1;
}

PyDoc_STRVAR(move_doc, "move($module, storage, ptr, fresh, /)\n--\n\n-> bool\n\nSwap fresh's "
                       "memory into storage if its data is still at ptr.");

static PyObject *
native_move(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("move", nargs, 3, 3) < 0) {
        return NULL;
    }
    if (!PyLong_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "move() argument 2 must be int, not %.200s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t ptr = PyLong_AsSsize_t(args[1]);
    if (ptr == -1 && PyErr_Occurred()) {
        return NULL;
    }
    int moved = move_into(shm_get_state(module), args[0], ptr, args[2]);
    if (moved < 0) {
        return NULL;
    }
    return PyBool_FromLong(moved);
}

/* The current slab of this thread for the current strategy, if reduce() may fill it
 * (indexed: Python sent from it itself). */
static GenObject *
current_slab(shm_state *st)
{
    PyObject *strategy =
        PyDict_GetItemWithError(st->strategy_globals, st->names[S_SHARING_STRATEGY]);
    PyObject *thread = PyThreadState_GetDict();
    if (strategy == NULL || thread == NULL) {
        return NULL;
    }
    int fs =
        PyUnicode_Check(strategy) && PyUnicode_Compare(strategy, st->names[S_FILE_SYSTEM]) == 0;
    PyObject *slab = PyDict_GetItemWithError(thread, st->names[fs ? S_SLAB_FS : S_SLAB_FD]);
    if (slab == NULL || Py_TYPE(slab) != st->gen_type || ((GenObject *)slab)->ended ||
        ((GenObject *)slab)->template == NULL) {
        return NULL;
    }
    return (GenObject *)slab;
}

/* Where storage (nbytes at ptr) is sent from: a Gen reduce() sends from and the
 * offset, moved into this thread's slab first if it lies in none; NULL (no error)
 * for the general path. */
static GenObject *
send_from(shm_state *st, PyObject *storage, Py_ssize_t ptr, Py_ssize_t nbytes, Py_ssize_t *offset)
{
    Range *r = shm_range_at((uintptr_t)ptr, nbytes);
    if (r != NULL) { /* in shared memory already: sent from where it lies, by an indexed Gen only */
        GenObject *gen = r->gen;
        Py_ssize_t at = ptr - (Py_ssize_t)r->addr;
        if (gen == NULL || gen->ended || at < gen->low) {
            return NULL;
        }
        *offset = at;
        st->reuses++;
        return gen;
    }
    if (nbytes > SLAB_ITEM_MAX || st->swap == NULL) {
        return NULL; /* without the swap, torch moves it and Python adopts it */
    }
    /* torch's own: a storage it shared is adopted */
    PyObject *shared = PyObject_CallOneArg(st->torch_is_shared, storage);
    if (shared == NULL) {
        return NULL;
    }
    int adopted = shared != Py_False;
    Py_DECREF(shared);
    GenObject *slab = adopted ? NULL : current_slab(st);
    Py_ssize_t at = slab != NULL ? shm_claim(slab, nbytes) : -1;
    if (at < 0) {
        return NULL; /* full, or none yet: the general path makes the next */
    }
    PyObject *key = NULL;
    Py_INCREF(slab); /* torch code runs below: a finalizer may drop the thread's slab */
    /* its address read at the copy, not ptr */
    PyObject *fresh = shm_put_storage(slab, at, nbytes, storage);
    if (fresh == NULL) {
        if (PyErr_ExceptionMatches(PyExc_OSError)) {
            PyErr_Clear(); /* the slab was cut: the general path drops it and takes another */
        }
        goto error;
    }
    int moved = move_into(st, storage, ptr, fresh);
    Py_DECREF(fresh);
    if (moved < 0) {
        goto error;
    }
    if (moved == 0) {
        Py_DECREF(slab);
        return NULL; /* moved by another thread meanwhile: the general path finds where */
    }
    key = PyLong_FromSsize_t(at);
    if (key == NULL || shm_remember(slab, key, storage) < 0) {
        goto error;
    }
    Py_DECREF(key);
    Py_DECREF(slab); /* its storage holds it now */
    st->shares++;
    st->shared_bytes += (unsigned long long)nbytes;
    *offset = at;
    return slab;

error:
    Py_XDECREF(key);
    Py_DECREF(slab);
    return NULL;
}

/* The packed head and layout of a plain tensor whose storage's data is at ptr, as
 * load() reads them (its storage's range and ticket filled in later), read in one
 * call through torch's DLPack exchange API: 0, or 1 for the general path (a device,
 * dtype or layout the compact form does not carry, or the API missing). */
static int
describe(shm_state *st, PyObject *tensor, Py_ssize_t ptr, PackedHead *head, Layout *layout)
{
    DLTensor dl;
    const DLPackExchangeAPI *exchange = st->exchange;
    if (exchange == NULL || exchange->dltensor_from_py_object_no_sync == NULL) {
        return 1;
    }
    if (exchange->dltensor_from_py_object_no_sync(tensor, &dl) != 0) {
        /* what torch cannot describe: the general path says why, if it is an error */
        PyErr_Clear();
        return 1;
    }
    Py_ssize_t itemsize = 0;
    if (dl.device.device_type != kDLCPU || dl.ndim < 0 || dl.ndim > MAX_DIMS ||
        (dl.ndim > 0 && dl.strides == NULL) || torch_dtype(st, dl.dtype, &itemsize) == NULL) {
        return 1;
    }
    assert(itemsize > 0); /* the table's entries are checked as they are read */
    intptr_t start = (intptr_t)dl.data + (intptr_t)dl.byte_offset - (intptr_t)ptr;
    if (start < 0 || start % itemsize != 0) {
        return 1;
    }
    head->code = dl.dtype.code;
    head->bits = dl.dtype.bits;
    head->lanes = dl.dtype.lanes;
    head->ndim = (uint32_t)dl.ndim;
    head->storage_offset = (int64_t)(start / itemsize);
    layout->ndim = dl.ndim;
    memcpy(layout->shape, dl.shape, (size_t)dl.ndim * sizeof(int64_t));
    memcpy(layout->strides, dl.strides, (size_t)dl.ndim * sizeof(int64_t));
    return 0;
}

static PyObject *
share_plain(shm_state *st, PyObject *tensor, PyObject *storage)
{
    Py_ssize_t nbytes = call_int(st, storage, S_NBYTES);
    if (nbytes <= 0) {
        return NULL; /* an error, or nothing to share: the general path */
    }
    Py_ssize_t ptr = call_int(st, storage, S_DATA_PTR);
    if (ptr == -1) {
        return NULL;
    }
    if (!broker_seen) {
        struct pollfd post = {.fd = st->post_fd, .events = POLLRDHUP};
        if (st->post_fd < 0 || poll(&post, 1, 0) != 0) {
            return NULL; /* the broker may be gone: the general path connects anew */
        }
        broker_seen = 1;
    }
    PackedHead head = {0};
    Layout layout;
    if (describe(st, tensor, ptr, &head, &layout) != 0) {
        return NULL; /* the general path */
    }
    Py_ssize_t offset;
    GenObject *gen = send_from(st, storage, ptr, nbytes, &offset);
    if (gen == NULL) {
        return NULL;
    }
    /* send_from() ran torch code (the importer, the swap): a collection there may have
     * run finalizers that unindexed gen (unindex_all(), a broker reconnect), so its
     * template is read only now, and held while this builds: read before, it could be
     * freed under the tuple built from it.
     * Without it, the general path sends the storage from where it lies now. */
    if (gen->template == NULL || gen->ended) {
        return NULL;
    }
    head.ticket = 0;
    if (gen->hdr && shm_issue_ticket((_Atomic uint64_t *)gen->hdr, &head.ticket) < 0) {
        return NULL; /* cut under its header: the general path says so */
    }
    PyObject *packed = NULL, *args = NULL;
    PyObject *template = Py_NewRef(gen->template);
    head.offset = (uint64_t)offset;
    head.nbytes = (uint64_t)nbytes;
    if (gen->hdr) {
        if (PyList_Append(outgoing, (PyObject *)gen) < 0) {
            goto error;
        }
        shm_add_count(gen); /* held until the scope counts the ref sent (count_sent) */
    }
    size_t arrays = (size_t)layout.ndim * sizeof(int64_t);
    packed = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(sizeof head + 2 * arrays));
    if (packed == NULL) {
        goto error;
    }
    char *out = PyBytes_AS_STRING(packed);
    memcpy(out, &head, sizeof head);
    memcpy(out + sizeof head, layout.shape, arrays);
    memcpy(out + sizeof head + arrays, layout.strides, arrays);
    args = PyTuple_Pack(2, template, packed);
    if (args == NULL) {
        goto error;
    }
    PyObject *result = PyTuple_Pack(2, st->load_fn, args);
    if (result == NULL) {
        goto error;
    }
    Py_DECREF(args);
    Py_DECREF(packed);
    Py_DECREF(template);
    return result;

error:
    Py_XDECREF(args);
    Py_XDECREF(packed);
    Py_DECREF(template);
    return NULL;
}

PyDoc_STRVAR(
    reduce_doc,
    "reduce($module, tensor, /)\n--\n\n-> (load, (template, packed))\n\nWhat "
    "reductions.reduce_tensor does, made here in one call, in the compact form (load()), for a "
    "plain CPU tensor (torch.Tensor exactly, no grad, no hooks, strided, not nested nor quantized, "
    "no conjugate or negative bit; its dtype, sizes, strides and start read in one call through "
    "torch's DLPack exchange API) inside a sending scope (message()) whose broker lives, whose "
    "storage lies in an indexed Gen or fits this thread's slab (copied there and swapped in); "
    "counted sent when the scope ends (its Gen appended to the scope's list, held until then). "
    "Every other case goes to reductions.reduce_tensor.");

static PyObject *
native_reduce(PyObject *module, PyObject *tensor)
{
    shm_state *st = shm_get_state(module);
    if (outgoing == NULL || st->load_fn == NULL ||
        Py_TYPE(tensor) != (PyTypeObject *)st->tensor_type) {
        return reduce_general(st, tensor);
    }
    int plain = is_plain(st, tensor);
    if (plain < 0) {
        return NULL;
    }
    if (plain == 0) {
        return reduce_general(st, tensor);
    }
    PyObject *storage = PyObject_CallMethodNoArgs(tensor, st->names[S_UNTYPED_STORAGE]);
    if (storage == NULL) {
        return NULL;
    }
    PyObject *reduced = share_plain(st, tensor, storage);
    Py_DECREF(storage);
    if (reduced == NULL && !PyErr_Occurred()) {
        return reduce_general(st, tensor);
    }
    return reduced;
}

PyDoc_STRVAR(message_doc,
             "message($module, gens, /)\n--\n\nreduce()'s sending scope on this thread: the list "
             "it appends the Gen of each ref to (acquired once per ref: count_sent), or None "
             "(outside any scope). The broker is checked again.");

static PyObject *
native_message(PyObject *Py_UNUSED(module), PyObject *list)
{
    if (list != Py_None && !PyList_CheckExact(list)) {
        PyErr_Format(PyExc_TypeError, "message() argument must be list or None, not %.200s",
                     Py_TYPE(list)->tp_name);
        return NULL;
    }
    Py_XSETREF(outgoing, list == Py_None ? NULL : Py_NewRef(list));
    broker_seen = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(watch_doc, "watch($module, fd, /)\n--\n\nreduce() checks the post connection fd (-1: "
                        "none) for a hang-up once per message.");

static PyObject *
native_watch(PyObject *module, PyObject *fd)
{
    long value = PyLong_AsLong(fd);
    if (value == -1 && PyErr_Occurred()) {
        return NULL;
    }
    shm_get_state(module)->post_fd = value < 0 || value > INT32_MAX ? -1 : (int)value;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_slab_doc, "set_slab($module, file_system, gen, /)\n--\n\nThis thread's current "
                           "slab of a strategy for reduce() (None: none).");

static PyObject *
native_set_slab(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (shm_check_nargs("set_slab", nargs, 2, 2) < 0) {
        return NULL;
    }
    if (args[1] != Py_None && Py_TYPE(args[1]) != st->gen_type) {
        PyErr_Format(PyExc_TypeError, "set_slab() argument 2 must be Gen or None, not %.200s",
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    PyObject *thread = PyThreadState_GetDict();
    if (thread == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_slab() with no thread state dict");
        return NULL;
    }
    int fs = PyObject_IsTrue(args[0]);
    if (fs < 0) {
        return NULL;
    }
    PyObject *key = st->names[fs ? S_SLAB_FS : S_SLAB_FD];
    if (args[1] != Py_None) {
        return PyDict_SetItem(thread, key, args[1]) < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *found = PyDict_GetItemWithError(thread, key);
    if ((found == NULL && PyErr_Occurred()) || (found != NULL && PyDict_DelItem(thread, key) < 0)) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(shared_doc, "shared($module, /)\n--\n\n-> (storages, bytes, reused)\n\nWhat reduce() "
                         "moved into slabs, and sent from where it lay.");

static PyObject *
native_shared(PyObject *module, PyObject *Py_UNUSED(ignored))
{
    shm_state *st = shm_get_state(module);
    return Py_BuildValue("KKK", st->shares, st->shared_bytes, st->reuses);
}

PyDoc_STRVAR(init_send_doc, "init_send($module, load, tensor_type, strided, strategy_globals, "
                            "is_shared, /)\n--\n\nBind what reduce() needs.");

static PyObject *
native_init_send(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    shm_state *st = shm_get_state(module);
    if (shm_check_nargs("init_send", nargs, 5, 5) < 0) {
        return NULL;
    }
    PyObject *fn = args[0], *type = args[1], *layout = args[2], *globals = args[3],
             *is_shared = args[4];
    if (!PyType_Check(type) || !PyDict_Check(globals)) {
        PyErr_Format(PyExc_TypeError,
                     "init_send() arguments 2 and 4 must be type and dict, not %.200s and %.200s",
                     Py_TYPE(type)->tp_name, Py_TYPE(globals)->tp_name);
        return NULL;
    }
    Py_XSETREF(st->load_fn, Py_NewRef(fn));
    Py_XSETREF(st->tensor_type, Py_NewRef(type));
    Py_XSETREF(st->strided, Py_NewRef(layout));
    Py_XSETREF(st->strategy_globals, Py_NewRef(globals));
    Py_XSETREF(st->torch_is_shared, Py_NewRef(is_shared));
    /* The exchange API the type offers (torch 2.10 on), kept with its capsule (its
     * table lives as long as the process): a DLPack 1.x one, or none. */
    st->exchange = NULL;
    Py_CLEAR(st->exchange_capsule);
    PyObject *capsule = PyObject_GetAttr(type, st->names[S_DLPACK_EXCHANGE_API]);
    const DLPackExchangeAPI *api =
        capsule != NULL ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api") : NULL;
    if (api == NULL) {
        PyErr_Clear();
        Py_XDECREF(capsule);
    }
    else {
        st->exchange_capsule = capsule;
        if (api->header.version.major == 1 && api->managed_tensor_to_py_object_no_sync != NULL) {
            st->exchange = api;
        }
    }
    Py_RETURN_NONE;
}

PyMethodDef shm_pickler_methods[] = {
    {"rebuild", (PyCFunction)(void (*)(void))native_rebuild, METH_FASTCALL, rebuild_doc},
    {"load", (PyCFunction)(void (*)(void))native_load, METH_FASTCALL, load_doc},
    {"unpack", (PyCFunction)(void (*)(void))native_unpack, METH_FASTCALL, unpack_doc},
    {"reduce", native_reduce, METH_O, reduce_doc},
    {"move", (PyCFunction)(void (*)(void))native_move, METH_FASTCALL, move_doc},
    {"message", native_message, METH_O, message_doc},
    {"watch", native_watch, METH_O, watch_doc},
    {"set_slab", (PyCFunction)(void (*)(void))native_set_slab, METH_FASTCALL, set_slab_doc},
    {"shared", native_shared, METH_NOARGS, shared_doc},
    {"init_send", (PyCFunction)(void (*)(void))native_init_send, METH_FASTCALL, init_send_doc},
    {NULL, NULL, 0, NULL},
};
