/* header.c: a pooled segment's shared header, and the guard on memory another process can cut.
 *
 * Owns: every access to a header's words (atomics only: it is shared by every
 * process that maps the segment), the tickets that tell a first load from a
 * repeated one, and the SIGBUS guard every access to a segment's shared memory
 * runs under (a file another process truncated: an error, not the process's end).
 * Calls nothing of the others; lifetime.c and pickler.c call issue_ticket,
 * count_loaded, count_sent and the guard (shm_guard). The rules the words follow are written once, in broker/protocol.py
 * ("Lifetimes"); tests/test_lifetime_model.py checks them exhaustively.
 */
#include "native.h"

#include <errno.h>
#include <sched.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>
#include <time.h>

/* ---- a pooled segment's header: the generation and its counters, shared ----
 *
 * The first HEADER_BYTES of a pooled segment are shared by every process that maps
 * it (u64 words, every access atomic; the rules they follow are written once, in
 * broker/protocol.py, "Lifetimes"):
 *   [0] the generation        [1] refs sent (counted when their message is pickled whole)
 *   [2] refs loaded (first loads only)   [3] holders (processes holding the generation;
 *       FREEING while a caller of hdr_end decides)   [4] tickets issued   [5] flags
 *   [8..] one bit per ticket: set by the first load of the ref that carries it.
 * A ref carries a ticket, drawn from [4] when it is pickled: its first load sets the
 * ticket's bit and counts it loaded, a repeated load finds the bit set and counts
 * nothing, so sent == loaded means exactly "no message naming the generation waits
 * for its first load". A ticket past the bitmap cannot be told from a repeat: it
 * retires the generation (RETIRED | UNCOUNTED). A RETIRED generation is never reused
 * (hdr_end refuses it): set where a hold cannot be counted exactly (a fork, a
 * process dead in the middle of taking or letting go of a hold), its pages go back
 * to the system when the last mapping and descriptor go, as torch's do.
 */

#define FREEING (1ULL << 63)
/* hdr_hold's wait for an owner's check (a few instructions) */
#define FREEING_WAIT_NS 1000000000LL

/* ---- the guard on memory another process can cut ----
 *
 * A file_system segment is a file any process of the user can truncate (a memfd is
 * sealed): a read or write of its mapping past the file's new end is then a SIGBUS.
 * Every access this module makes to a header, and each copy into a segment
 * (lifetime.c), runs under shm_guard(): with a SIGBUS handler, installed by
 * guard_faults() in every process that maps a segment, that jumps back, and the
 * access fails instead of ending the process (a segment found cut is lost). Each
 * guarded function touches that memory and nothing else (no Python, no lock, no
 * allocation), so nothing is left half done by the jump. A fault anywhere else (a
 * user's tensor in a cut file) goes to the handler this one replaced, as with torch. */

/* Initial-exec TLS: its first touch in a thread allocates nothing (a dynamic TLS block
 * may be malloc'd on first use, which a signal handler must never do). */
static _Thread_local sigjmp_buf *fault_jump __attribute__((tls_model("initial-exec")));
/* The address the last guarded fault of this thread was at (a copy tells its
 * destination's from its source's by it). */
static _Thread_local void *fault_address __attribute__((tls_model("initial-exec")));
/* The process's SIGBUS disposition (process-wide: native.h says why). */
static struct {
    _Atomic int on; /* guard_faults() was called: set under the GIL, read by any thread without it */
    struct sigaction previous; /* the handler it replaced (faulthandler's, or the default) */
} sigbus_guard;

static void
on_sigbus(int sig, siginfo_t *info, void *context)
{
    (void)context;
    sigjmp_buf *jump = fault_jump;
    if (jump != NULL) {
        fault_jump = NULL;
        fault_address = info != NULL ? info->si_addr : NULL;
        siglongjmp(*jump, 1);
    }
    /* Not ours: the handler it replaced gets it. A fault is chained by returning: the
     * faulting access runs again and faults into that handler, with its own address
     * and siginfo. A signal sent (kill, raise) has no access to run again: sent anew. */
    sigaction(sig, &sigbus_guard.previous, NULL);
    if (info == NULL || info->si_code <= 0) {
        raise(sig);
    }
}

/* Where the last guarded fault of this thread was. */
void *
shm_fault_address(void)
{
    return fault_address;
}

/* fn(arg), guarded: 0, or -1 if it faulted (no Python error set; needs no GIL). */
int
shm_guard(void (*fn)(void *), void *arg)
{
    if (!atomic_load_explicit(&sigbus_guard.on, memory_order_acquire)) {
        fn(arg);
        return 0;
    }
    sigjmp_buf jump;
    if (sigsetjmp(jump, 0)) {
        return -1; /* the handler cleared fault_jump */
    }
    fault_jump = &jump;
    fn(arg);
    fault_jump = NULL;
    return 0;
}

typedef void (*header_op)(_Atomic uint64_t *h, uint64_t arg, uint64_t *out);

typedef struct {
    header_op op;
    _Atomic uint64_t *h;
    uint64_t arg, *out;
} HeaderCall;

static void
run_header_call(void *arg)
{
    HeaderCall *call = arg;
    call->op(call->h, call->arg, call->out);
}

/* op on the header h, guarded: 0, or -1 (no error set) if the segment was cut. */
static int
shm_header(header_op op, _Atomic uint64_t *h, uint64_t arg, uint64_t *out)
{
    HeaderCall call = {op, h, arg, out};
    return shm_guard(run_header_call, &call);
}

/* The error a Python caller of a header function gets for a cut segment. */
static void
set_cut(void)
{
    errno = EFAULT;
    PyErr_SetFromErrno(PyExc_OSError);
}

/* op on the header h, guarded: 0, or -1 with OSError(EFAULT) raised. */
static int
guarded(header_op op, _Atomic uint64_t *h, uint64_t arg, uint64_t *out)
{
    if (shm_header(op, h, arg, out) < 0) {
        set_cut();
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(guard_faults_doc,
             "guard_faults($module, /)\n--\n\nFrom now on a SIGBUS in a header function, or in "
             "a copy into a segment, raises instead of ending the process (OSError(EFAULT) from "
             "the header functions): its segment was truncated by another process. Installed "
             "again if another handler replaced it since.");

static PyObject *
guard_faults(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    struct sigaction before;
    if (sigaction(SIGBUS, NULL, &before) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if ((before.sa_flags & SA_SIGINFO) && before.sa_sigaction == on_sigbus) {
        atomic_store_explicit(&sigbus_guard.on, 1, memory_order_release);
        Py_RETURN_NONE;
    }
    sigbus_guard.previous = before; /* known before this handler can run */
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    /* not blocked in the handler: a sigsetjmp(, 0) needs no mask back */
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, NULL) < 0) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    atomic_store_explicit(&sigbus_guard.on, 1, memory_order_release);
    Py_RETURN_NONE;
}

static _Atomic uint64_t *
header_of(PyObject *addr_obj)
{
    void *addr = PyLong_AsVoidPtr(addr_obj);
    if (addr == NULL) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_ValueError, "header at a null address");
        }
        return NULL;
    }
    if ((uintptr_t)addr % 8) {
        PyErr_SetString(PyExc_ValueError, "header at an unaligned address");
        return NULL;
    }
    return (_Atomic uint64_t *)addr;
}

static int
parse_header_gen(PyObject *const *args, Py_ssize_t nargs, const char *name, _Atomic uint64_t **h,
                 uint64_t *gen)
{
    if (shm_check_nargs(name, nargs, 2, 2) < 0) {
        return -1;
    }
    *h = header_of(args[0]);
    if (*h == NULL) {
        return -1;
    }
    *gen = PyLong_AsUnsignedLongLong(
        args[1]); /* a header holds 64 bits: a wider one is an error, never truncated */
    if (*gen == (uint64_t)-1 && PyErr_Occurred()) {
        return -1;
    }
    return 0;
}

static void
op_issue(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    out[0] = atomic_fetch_add(&h[HDR_ISSUED], 1);
    if (out[0] >= TICKETS) {
        atomic_fetch_or(&h[HDR_FLAGS], RETIRED | UNCOUNTED);
    }
}

static void
op_loaded(_Atomic uint64_t *h, uint64_t ticket, uint64_t *Py_UNUSED(out))
{
    if (ticket >= atomic_load(&h[HDR_ISSUED])) {
        return;
    }
    if (ticket >= TICKETS) {
        atomic_fetch_add(&h[HDR_LOADED], 1); /* UNCOUNTED: the generation is retired */
        return;
    }
    uint64_t bit = 1ULL << (ticket % 64);
    if (!(atomic_fetch_or(&h[HDR_BITS + ticket / 64], bit) & bit)) {
        atomic_fetch_add(&h[HDR_LOADED], 1);
    }
}

static void
op_sent(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *Py_UNUSED(out))
{
    atomic_fetch_add(&h[HDR_SENT], 1);
}

/* A ref's ticket drawn from the header h (the generation is held: by its owner's
 * storage, or by the sender's own hold of a storage it forwards): 0, or -1 (no error
 * set) if the segment was cut under h. */
int
shm_issue_ticket(_Atomic uint64_t *h, uint64_t *ticket)
{
    assert((uintptr_t)h % 8 == 0); /* a pooled Gen's address, checked when it was made */
    return shm_header(op_issue, h, 0, ticket);
}

/* The ref of ticket t loaded (the generation held here): counted once, at its first
 * load. A ticket never issued (a forged ref) counts nothing. 0, or -1 with
 * sharing_error raised if the segment was cut under h. */
int
shm_count_loaded(_Atomic uint64_t *h, uint64_t ticket, PyObject *sharing_error)
{
    assert((uintptr_t)h % 8 == 0);
    if (shm_header(op_loaded, h, ticket, NULL) < 0) {
        PyErr_SetString(sharing_error, SHM_CUT_MESSAGE);
        return -1;
    }
    return 0;
}

/* One ref of the generation at h counted sent; nothing where the segment was cut
 * (what was sent in it is lost: its loads fail). */
void
shm_count_sent(_Atomic uint64_t *h)
{
    (void)shm_header(op_sent, h, 0, NULL);
}

static int
parse_ticket(PyObject *obj, uint64_t *ticket)
{
    *ticket = PyLong_AsUnsignedLongLong(obj);
    if (*ticket == (uint64_t)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            *ticket = NOT_A_TICKET;
        }
        else {
            return -1;
        }
        PyErr_Clear();
    }
    return 0;
}

PyDoc_STRVAR(hdr_issue_doc, "hdr_issue($module, addr, /)\n--\n\n-> int\n\nA ticket for one ref to "
                            "the generation of the header at addr.");

static PyObject *
hdr_issue(PyObject *Py_UNUSED(module), PyObject *addr)
{
    _Atomic uint64_t *h = header_of(addr);
    uint64_t ticket;
    if (h == NULL || guarded(op_issue, h, 0, &ticket) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(ticket);
}

PyDoc_STRVAR(
    hdr_loaded_doc,
    "hdr_loaded($module, addr, ticket, /)\n--\n\nThe ref of ticket loaded in the generation of the "
    "header at addr: counted loaded at its first load only (refs sent: count_sent).");

static PyObject *
hdr_loaded(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("hdr_loaded", nargs, 2, 2) < 0) {
        return NULL;
    }
    _Atomic uint64_t *h = header_of(args[0]);
    uint64_t ticket;
    if (h == NULL || parse_ticket(args[1], &ticket) < 0) {
        return NULL;
    }
    if (guarded(op_loaded, h, ticket, NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hdr_hold_doc, "hdr_hold($module, addr, gen, /)\n--\n\n-> bool\n\nCount this process a "
                           "holder of generation gen, then check that the header holds gen: False "
                           "(holding nothing) if it holds another, or is being freed for good.");

/* out[0]: HELD (counted a holder of gen, which the header holds), OTHER (it holds
 * another: nothing counted) or BUSY (FREEING set: nothing counted, ask again). */
enum { HOLD_OTHER, HOLD_HELD, HOLD_BUSY };

static void
op_hold(_Atomic uint64_t *h, uint64_t gen, uint64_t *out)
{
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    do {
        if (n & FREEING) {
            out[0] = HOLD_BUSY;
            return;
        }
    } while (!atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n + 1));
    if (atomic_load(&h[HDR_GEN]) != gen) {
        atomic_fetch_sub(&h[HDR_HOLDERS], 1);
        out[0] = HOLD_OTHER;
        return;
    }
    out[0] = HOLD_HELD;
}

static void
op_freeing(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    out[0] = (atomic_load(&h[HDR_HOLDERS]) & FREEING) != 0;
}

static PyObject *
hdr_hold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    _Atomic uint64_t *h;
    uint64_t gen, out[1];
    if (parse_header_gen(args, nargs, "hdr_hold", &h, &gen) < 0) {
        return NULL;
    }
    for (;;) {
        if (guarded(op_hold, h, gen, out) < 0) {
            return NULL;
        }
        if (out[0] != HOLD_BUSY) {
            return PyBool_FromLong(out[0] == HOLD_HELD);
        }
        /* Its owner is checking it free (a few instructions): wait, without the GIL
         * (nothing here may stall this process's other threads on another process),
         * at most FREEING_WAIT_NS. A bit still set then was left by an owner killed
         * mid-check: that generation was being ended (nobody held it, every ref was
         * loaded), so this load is of a ref loaded already: refused as stale. */
        int cleared = 0, cut = 0;
        Py_BEGIN_ALLOW_THREADS
        struct timespec start, now, pause = {0, 100000};
        clock_gettime(CLOCK_MONOTONIC, &start);
        for (long spins = 0;; spins++) {
            if (spins < 1000) {
                sched_yield();
            }
            else {
                nanosleep(&pause, NULL);
            }
            if (shm_header(op_freeing, h, 0, out) < 0) {
                cut = 1;
                break;
            }
            if (!out[0]) {
                cleared = 1;
                break;
            }
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) >
                FREEING_WAIT_NS) {
                break;
            }
        }
        Py_END_ALLOW_THREADS
        if (cut) {
            set_cut();
            return NULL;
        }
        if (!cleared) {
            Py_RETURN_FALSE;
        }
    }
}

static void
op_unhold(_Atomic uint64_t *h, uint64_t gen, uint64_t *out)
{
    out[0] = 0;
    if (atomic_load(&h[HDR_GEN]) != gen) {
        return;
    }
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    do {
        if ((n & ~FREEING) == 0) {
            return;
        }
    } while (!atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n - 1));
    out[0] = 1;
}

static void
op_read(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    out[0] = atomic_load(&h[HDR_GEN]);
    out[1] = atomic_load(&h[HDR_SENT]);
    out[2] = atomic_load(&h[HDR_LOADED]);
    out[3] = atomic_load(&h[HDR_HOLDERS]);
}

static void
op_retire(_Atomic uint64_t *h, uint64_t gen, uint64_t *out)
{
    out[0] = 0;
    if (atomic_load(&h[HDR_GEN]) != gen) {
        return;
    }
    atomic_fetch_or(&h[HDR_FLAGS], RETIRED);
    out[0] = 1;
}

static void
op_retire_any(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    atomic_fetch_or(&h[HDR_FLAGS], RETIRED);
    out[0] = 1;
}

static void
op_flags(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    out[0] = atomic_load(&h[HDR_FLAGS]);
}

PyDoc_STRVAR(hdr_unhold_doc,
             "hdr_unhold($module, addr, gen, /)\n--\n\n-> bool\n\nCount one holder of generation "
             "gen less; False (nothing done) if the header holds another generation or no holder.");

/* name(addr, gen) -> bool: a guarded op of one generation. */
static PyObject *
generation_op(header_op op, const char *name, PyObject *const *args, Py_ssize_t nargs)
{
    _Atomic uint64_t *h;
    uint64_t gen, out[1];
    if (parse_header_gen(args, nargs, name, &h, &gen) < 0 || guarded(op, h, gen, out) < 0) {
        return NULL;
    }
    return PyBool_FromLong(out[0] != 0);
}

static PyObject *
hdr_unhold(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return generation_op(op_unhold, "hdr_unhold", args, nargs);
}

PyDoc_STRVAR(hdr_end_doc,
             "hdr_end($module, addr, gen, /)\n--\n\n-> int\n\nThe owner, its own storages of gen "
             "all dead, ends gen: END_FREED if nobody holds it, every ref sent was loaded and it "
             "is not retired (generation 0, counters, tickets and flags zeroed: a stale ref is "
             "refused; the segment is free for the next); END_RETIRED to the one caller that "
             "claims a retired generation's close; END_WAIT if it must wait (held, a ref in "
             "flight, or another thread inside this check); END_STALE if the header holds another "
             "generation, or another caller claimed the close: nothing to do.");

/* One transition of one generation, decided under the header's FREEING bit (which
 * hdr_hold waits for, so no holder is added meanwhile, and no other hdr_end runs): the
 * generation cannot change under the check, so a caller holding a stale (segment,
 * generation) pair ends nothing of the next one, and exactly one caller frees it or
 * claims its close. */
static void
op_end(_Atomic uint64_t *h, uint64_t gen, uint64_t *out)
{
    if (atomic_load(&h[HDR_GEN]) != gen) {
        out[0] = END_STALE;
        return;
    }
    uint64_t n = atomic_load(&h[HDR_HOLDERS]);
    do {
        if (n & FREEING) {
            /* another thread or process is deciding: ask again later */
            out[0] = END_WAIT;
            return;
        }
    } while (!atomic_compare_exchange_weak(&h[HDR_HOLDERS], &n, n | FREEING));
    uint64_t result = END_WAIT;
    if (atomic_load(&h[HDR_GEN]) != gen) {
        result = END_STALE;
    }
    else if (atomic_load(&h[HDR_FLAGS]) & RETIRED) {
        result = atomic_fetch_or(&h[HDR_FLAGS], CLOSED) & CLOSED ? END_STALE : END_RETIRED;
    }
    else if ((atomic_load(&h[HDR_HOLDERS]) & ~FREEING) == 0 &&
             atomic_load(&h[HDR_SENT]) == atomic_load(&h[HDR_LOADED])) {
        /* Holders can only fall while FREEING is set: sent == loaded now means every
         * ref sent was loaded by a holder that has let go since. */
        atomic_store(&h[HDR_GEN], 0);
        uint64_t issued = atomic_load(&h[HDR_ISSUED]);
        uint64_t words = (issued < TICKETS ? issued : TICKETS) / 64 + 1;
        for (uint64_t i = 0; i < words && i < TICKETS / 64; i++) {
            atomic_store(&h[HDR_BITS + i], 0);
        }
        atomic_store(&h[HDR_SENT], 0);
        atomic_store(&h[HDR_LOADED], 0);
        atomic_store(&h[HDR_ISSUED], 0);
        atomic_store(&h[HDR_FLAGS], 0);
        result = END_FREED;
    }
    atomic_fetch_and(&h[HDR_HOLDERS], ~FREEING);
    out[0] = result;
}

static PyObject *
hdr_end(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    _Atomic uint64_t *h;
    uint64_t gen, out[1];
    if (parse_header_gen(args, nargs, "hdr_end", &h, &gen) < 0 ||
        guarded(op_end, h, gen, out) < 0) {
        return NULL;
    }
    return PyLong_FromLong((long)(int64_t)out[0]);
}

PyDoc_STRVAR(hdr_read_doc, "hdr_read($module, addr, /)\n--\n\n-> (gen, sent, loaded, "
                           "holders)\n\nThe header at addr, each field read atomically.");

static PyObject *
hdr_read(PyObject *Py_UNUSED(module), PyObject *addr)
{
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[4];
    if (h == NULL || guarded(op_read, h, 0, out) < 0) {
        return NULL;
    }
    return Py_BuildValue("KKKK", (unsigned long long)out[0], (unsigned long long)out[1],
                         (unsigned long long)out[2], (unsigned long long)out[3]);
}

PyDoc_STRVAR(
    hdr_retire_doc,
    "hdr_retire($module, addr, gen, /)\n--\n\n-> bool\n\nNever reuse generation gen (if the header "
    "still holds it): its memory goes back to the system once nothing maps it.");

static PyObject *
hdr_retire(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    return generation_op(op_retire, "hdr_retire", args, nargs);
}

PyDoc_STRVAR(hdr_retire_any_doc,
             "hdr_retire_any($module, addr, /)\n--\n\nRetire whatever generation the header holds "
             "now, a free segment's next one included: a process killed inside a stale load's "
             "hdr_hold may have counted itself there, and nobody can count it out.");

static PyObject *
hdr_retire_any(PyObject *Py_UNUSED(module), PyObject *addr)
{
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[1];
    if (h == NULL || guarded(op_retire_any, h, 0, out) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(
    hdr_flags_doc,
    "hdr_flags($module, addr, /)\n--\n\n-> int\n\nThe header's flags: RETIRED (never reused), "
    "UNCOUNTED (a ticket past the bitmap: its loads were not told from repeats).");

/* The one word op reads of the header at addr, as an int. */
static PyObject *
read_word(PyObject *addr, header_op op)
{
    _Atomic uint64_t *h = header_of(addr);
    uint64_t out[1];
    if (h == NULL || guarded(op, h, 0, out) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(out[0]);
}

static PyObject *
hdr_flags(PyObject *Py_UNUSED(module), PyObject *addr)
{
    return read_word(addr, op_flags);
}

static void
op_trail(_Atomic uint64_t *h, uint64_t extent, uint64_t *Py_UNUSED(out))
{
    uint64_t none = 0;
    atomic_store(&h[HDR_EXTENT], extent);
    atomic_compare_exchange_strong(&h[HDR_ISSUED], &none, 1); /* ticket 0 never drawn */
}

PyDoc_STRVAR(hdr_trail_doc,
             "hdr_trail($module, addr, extent, /)\n--\n\nThe header at addr trails a storage "
             "of extent bytes that torch moved (segments.trail): its extent written, and ticket 0 "
             "never drawn (a ref of generation 0 with a ticket names such a header).");

static PyObject *
hdr_trail(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    _Atomic uint64_t *h;
    uint64_t extent;
    if (parse_header_gen(args, nargs, "hdr_trail", &h, &extent) < 0 ||
        guarded(op_trail, h, extent, NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static void
op_extent(_Atomic uint64_t *h, uint64_t Py_UNUSED(arg), uint64_t *out)
{
    out[0] = atomic_load(&h[HDR_EXTENT]);
}

PyDoc_STRVAR(hdr_extent_doc, "hdr_extent($module, addr, /)\n--\n\n-> int\n\nThe extent a "
                             "trailing header at addr says its storage spans (hdr_trail).");

static PyObject *
hdr_extent(PyObject *Py_UNUSED(module), PyObject *addr)
{
    return read_word(addr, op_extent);
}

PyMethodDef shm_header_methods[] = {
    {"hdr_trail", (PyCFunction)(void (*)(void))hdr_trail, METH_FASTCALL, hdr_trail_doc},
    {"hdr_extent", hdr_extent, METH_O, hdr_extent_doc},
    {"hdr_issue", hdr_issue, METH_O, hdr_issue_doc},
    {"hdr_loaded", (PyCFunction)(void (*)(void))hdr_loaded, METH_FASTCALL, hdr_loaded_doc},
    {"hdr_retire", (PyCFunction)(void (*)(void))hdr_retire, METH_FASTCALL, hdr_retire_doc},
    {"hdr_retire_any", hdr_retire_any, METH_O, hdr_retire_any_doc},
    {"hdr_flags", hdr_flags, METH_O, hdr_flags_doc},
    {"guard_faults", guard_faults, METH_NOARGS, guard_faults_doc},
    {"hdr_hold", (PyCFunction)(void (*)(void))hdr_hold, METH_FASTCALL, hdr_hold_doc},
    {"hdr_unhold", (PyCFunction)(void (*)(void))hdr_unhold, METH_FASTCALL, hdr_unhold_doc},
    {"hdr_end", (PyCFunction)(void (*)(void))hdr_end, METH_FASTCALL, hdr_end_doc},
    {"hdr_read", hdr_read, METH_O, hdr_read_doc},
    {NULL, NULL, 0, NULL},
};
