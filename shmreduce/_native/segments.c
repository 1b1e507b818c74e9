/* segments.c: every segment this process maps, by address.
 *
 * Owns: the table Python fills (mapped() / unmapped(), the latter before its munmap),
 * each entry with a weak reference to its Segment (segment_at()) and the Gen reduce()
 * sends storages lying in it from: one Python indexed (Gen.index) once it sent a ref
 * from it itself (its memfd deposited, its file's tag computed). A Gen leaves when
 * dead() reports it, or its segment's deposit is let go of (unindex()); all leave at
 * unindex_all() (a new broker, a sealed file, a fork).
 * A storage in a segment with no indexed Gen takes the general path: it is never
 * moved again. Strong references to the indexed Gens. Calls nothing of the others.
 */
#include "native.h"

#include <string.h>

/* The position of the last range whose address is <= addr, or -1. */
static Py_ssize_t
range_find(uintptr_t addr)
{
    Py_ssize_t lo = 0, hi = shm_process.n_ranges;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if ((uintptr_t)shm_process.ranges[mid].addr <= addr) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return lo - 1;
}

/* The range holding [ptr, ptr + nbytes), or NULL. */
Range *
shm_range_at(uintptr_t ptr, Py_ssize_t nbytes)
{
    Py_ssize_t i = range_find(ptr);
    if (i < 0) {
        return NULL;
    }
    Range *r = &shm_process.ranges[i];
    uintptr_t at = ptr - (uintptr_t)r->addr;
    if (nbytes < 0 || at > (uintptr_t)r->size || (uintptr_t)nbytes > (uintptr_t)r->size - at) {
        return NULL;
    }
    return r;
}

/* The range starting exactly at addr, or NULL. */
static Range *
range_of(const char *addr)
{
    Py_ssize_t i = range_find((uintptr_t)addr);
    return i >= 0 && shm_process.ranges[i].addr == addr ? &shm_process.ranges[i] : NULL;
}

void
shm_unindex(GenObject *gen)
{
    if (gen->template == NULL) {
        return;
    }
    Py_CLEAR(gen->template);
    Range *r = range_of(gen->addr);
    if (r != NULL && r->gen == gen) {
        r->gen = NULL;
        Py_DECREF(gen);
    }
}

/* Gen.index(template) (its doc is in lifetime.c, with the type's). */
PyObject *
shm_gen_index(GenObject *self, PyObject *template)
{
    Range *r = range_of(self->addr);
    if (!PyTuple_CheckExact(template) || PyTuple_GET_SIZE(template) != 5 || self->ended ||
        r == NULL || r->size != self->size) {
        PyErr_SetString(
            PyExc_ValueError,
            "index((kind, directory, segment, generation, tag)) of a live Gen of a mapped segment");
        return NULL;
    }
    if (r->gen != NULL) {
        shm_unindex(r->gen); /* an earlier Gen of the segment, not reported dead yet */
    }
    Py_XSETREF(self->template, Py_NewRef(template));
    r->gen = (GenObject *)Py_NewRef(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mapped_doc, "mapped($module, addr, size, segment, /)\n--\n\nA segment mapped at addr "
                         "(segment: a weak reference to it).");

static PyObject *
native_mapped(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("mapped", nargs, 3, 3) < 0) {
        return NULL;
    }
    char *addr = PyLong_AsVoidPtr(args[0]);
    Py_ssize_t size = addr != NULL ? PyLong_AsSsize_t(args[1]) : -1;
    if (addr == NULL || size <= 0 || !PyWeakref_Check(args[2])) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "mapped(addr, size, weakref)");
        }
        return NULL;
    }
    if (range_of(addr) != NULL) {
        PyErr_SetString(PyExc_ValueError, "mapped() twice at one address");
        return NULL;
    }
    if (shm_process.n_ranges == shm_process.cap_ranges) {
        Py_ssize_t cap = shm_process.cap_ranges ? 2 * shm_process.cap_ranges : 64;
        Range *grown = PyMem_Realloc(shm_process.ranges, (size_t)cap * sizeof(Range));
        if (grown == NULL) {
            return PyErr_NoMemory();
        }
        shm_process.ranges = grown;
        shm_process.cap_ranges = cap;
    }
    Py_ssize_t i = range_find((uintptr_t)addr) + 1;
    memmove(&shm_process.ranges[i + 1], &shm_process.ranges[i],
            (size_t)(shm_process.n_ranges - i) * sizeof(Range));
    assert(i == 0 || shm_process.ranges[i - 1].addr < addr); /* kept sorted, no address twice */
    shm_process.ranges[i] = (Range){addr, size, Py_NewRef(args[2]), NULL};
    shm_process.n_ranges++;
    Py_RETURN_NONE;
}

static void
drop_range(Range *r)
{
    if (r->gen != NULL) {
        shm_unindex(r->gen);
    }
    Py_XDECREF(r->segment);
    Py_ssize_t i = r - shm_process.ranges;
    memmove(r, r + 1, (size_t)(shm_process.n_ranges - i - 1) * sizeof(Range));
    shm_process.n_ranges--;
}

PyDoc_STRVAR(unmapped_doc, "unmapped($module, addr, /)\n--\n\nThe segment mapped at addr is no "
                           "longer (before its munmap).");

/* The range mapped at the address Python passed in addr (*r NULL if none); -1 if addr is
 * not an address. */
static int
range_arg(PyObject *addr, Range **r)
{
    char *at = PyLong_AsVoidPtr(addr);
    if (at == NULL && PyErr_Occurred()) {
        return -1;
    }
    *r = range_of(at);
    return 0;
}

static PyObject *
native_unmapped(PyObject *Py_UNUSED(module), PyObject *addr)
{
    Range *r;
    if (range_arg(addr, &r) < 0) {
        return NULL;
    }
    if (r != NULL) {
        drop_range(r);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(forget_mapped_doc, "forget_mapped($module, /)\n--\n\nForget every segment (a forked "
                                "child that acts as a new process).");

static PyObject *
native_forget_mapped(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    while (shm_process.n_ranges > 0) {
        drop_range(&shm_process.ranges[shm_process.n_ranges - 1]);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(segment_at_doc, "segment_at($module, ptr, nbytes, /)\n--\n\n-> Segment | None\n\nThe "
                             "mapped segment holding nbytes at ptr.");

static PyObject *
native_segment_at(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("segment_at", nargs, 2, 2) < 0) {
        return NULL;
    }
    void *ptr = PyLong_AsVoidPtr(args[0]);
    if (ptr == NULL && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (nbytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Range *r = shm_range_at((uintptr_t)ptr, nbytes);
    PyObject *segment = r != NULL ? referent(r->segment) : NULL;
    return segment != NULL ? segment : Py_NewRef(Py_None);
}

PyDoc_STRVAR(
    unindex_all_doc,
    "unindex_all($module, /)\n--\n\nreduce() sends from no Gen until Python indexes it again.");

static PyObject *
native_unindex_all(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    for (Py_ssize_t i = 0; i < shm_process.n_ranges; i++) {
        if (shm_process.ranges[i].gen != NULL) {
            shm_unindex(shm_process.ranges[i].gen);
        }
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unindex_doc, "unindex($module, addr, /)\n--\n\nreduce() sends from no Gen of the "
                          "segment mapped at addr until Python indexes one again (its deposit "
                          "let go of).");

static PyObject *
native_unindex(PyObject *Py_UNUSED(module), PyObject *addr)
{
    Range *r;
    if (range_arg(addr, &r) < 0) {
        return NULL;
    }
    if (r != NULL && r->gen != NULL) {
        shm_unindex(r->gen);
    }
    Py_RETURN_NONE;
}

PyMethodDef shm_segments_methods[] = {
    {"mapped", (PyCFunction)(void (*)(void))native_mapped, METH_FASTCALL, mapped_doc},
    {"unmapped", native_unmapped, METH_O, unmapped_doc},
    {"forget_mapped", native_forget_mapped, METH_NOARGS, forget_mapped_doc},
    {"segment_at", (PyCFunction)(void (*)(void))native_segment_at, METH_FASTCALL, segment_at_doc},
    {"unindex_all", native_unindex_all, METH_NOARGS, unindex_all_doc},
    {"unindex", native_unindex, METH_O, unindex_doc},
    {NULL, NULL, 0, NULL},
};
