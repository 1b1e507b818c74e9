/* copy.c: copies of many bytes into a segment, on as many cores as the process may use.
 *
 * Owns: how a copy into a segment is made (non-temporal stores where the CPU has them,
 * else memmove) and on how many threads (shm_copy_threads: the one place that decides);
 * the copy through a mapping (shm_copy) and the write into a new segment's pages (write()).
 * Calls: torch.get_num_threads, through Python, where the process's intra-op setting is
 * not known here.
 *
 * torch's intra-op setting is per thread (OpenMP's): torch.set_num_threads(1) in a
 * DataLoader worker's main thread leaves its queue's feeder thread, which shares the
 * batches, at the default of every core. So the setting a copy obeys is the process's,
 * as the thread that registered saw it and every torch.set_num_threads since
 * (``patches`` tells set_intra_op_threads); unregistered, the calling thread's.
 *
 * Threads: a copy of COPY_PARALLEL bytes and up is cut in page-aligned parts, one a
 * thread, as many threads as torch's intra-op setting and the CPU affinity mask allow
 * (never more: a DataLoader worker runs one intra-op thread and copies on one), and at
 * most one a COPY_PART bytes. The parts' threads are started for the copy and joined
 * before it returns: none outlives it, so a fork at any moment finds no thread of ours
 * to lose, and nothing is shared between copies. A thread that cannot be started
 * leaves its part to the calling thread. The caller has released the GIL: the threads
 * touch no Python object.
 *
 * New pages. One thread writes them through the descriptor (pwrite): the kernel copies
 * into each new page once, never zeroing it first, 0.36 s of CPU a GiB here. Several
 * threads cannot: a write to a tmpfs file holds its inode's lock throughout, so writes to
 * one segment run one after another however many threads make them. Each thread then
 * allocates and maps its part's pages itself (MADV_POPULATE_WRITE, no fault per page;
 * no inode lock) and copies through the mapping: 0.63-0.66 s of CPU a GiB a thread (the kernel
 * zeroes each page first), so two threads would take about one pwrite's time for 75%
 * more CPU, and MAPPED_THREADS and more take less. A kernel that cannot (older than 5.14:
 * EINVAL) has the part written through the descriptor. */
#include "native.h" /* Python.h first: it defines _GNU_SOURCE, which CPU_COUNT needs */

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_STREAMING 1
#endif

#define COPY_STREAMING (1 << 20)  /* copies from here up bypass the cache, where the CPU can */
#define COPY_PARALLEL  (4 << 20)  /* ... and from here up run on several threads */
#define COPY_PART      (2 << 20)  /* the least one thread is given */
#define MAX_THREADS    64
#define MAPPED_THREADS 3          /* a write of new pages on this many threads and up maps them */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* <linux/mman.h>, Linux 5.14 */
#endif

/* Non-temporal stores for large copies into a segment: the destination is written
 * once and read next by another process, so filling the cache with it (and reading
 * each line in first, as ordinary stores do) is wasted: 13.0-13.4 GB/s against
 * memcpy's 8.7-9.5 on one core for 64 MiB. Decided once per process (a runtime check
 * of the CPU, off by set_streaming(False)); a plain memmove where there is none. */

#ifdef HAVE_STREAMING
__attribute__((target("avx2"))) static void
copy_streaming(char *dest, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dest & 31)) & 31;
    if (head > n) {
        head = n;
    }
    memcpy(dest, src, head);
    dest += head, src += head, n -= head;
    for (; n >= 128; dest += 128, src += 128, n -= 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src),
                b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64)),
                d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dest, a);
        _mm256_stream_si256((__m256i *)(dest + 32), b);
        _mm256_stream_si256((__m256i *)(dest + 64), c);
        _mm256_stream_si256((__m256i *)(dest + 96), d);
    }
    /* ordered before anything this thread stores next (the storage's header counts) */
    _mm_sfence();
    memcpy(dest, src, n);
}
#endif

static int
streaming(void)
{
    if (shm_process.streaming < 0) {
#ifdef HAVE_STREAMING
        shm_process.streaming = __builtin_cpu_supports("avx2") != 0;
#else
        shm_process.streaming = 0;
#endif
    }
    return shm_process.streaming;
}

/* One thread's part: n bytes of src (NULL: zeros) to dest, never overlapping a
 * private source. */
static void
copy_part(char *dest, const char *src, size_t n, int stream)
{
    if (src == NULL) {
        memset(dest, 0, n);
        return;
    }
#ifdef HAVE_STREAMING
    if (stream && n >= COPY_STREAMING && (src + n <= dest || dest + n <= src)) {
        copy_streaming(dest, src, n);
        return;
    }
#endif
    (void)stream;
    memmove(dest, src, n);
}

/* What a part is: a copy through a mapping (fd < 0), a write through a descriptor (no
 * dest), or new pages of fd mapped at dest: allocated there, then copied into. */
typedef struct {
    char *dest;
    const char *src;
    size_t n;
    int fd;
    off_t offset;
    int stream;
    int error;      /* a write's errno, EFAULT for a copy that faulted; 0 if it did all */
    void *fault_at; /* where a copy faulted */
} Part;

static void
copy_guarded(void *arg)
{
    Part *part = arg;
    copy_part(part->dest, part->src, part->n, part->stream);
}

/* Allocates and maps the whole pages of a part's mapped range (new pages of a
 * segment): 0; or 1 if the kernel cannot (the part is written through the descriptor,
 * and so are the next ones); or -1, errno set, if it could not allocate them (a full
 * mount or memory limit: ENOSPC, never a SIGBUS in the copy). The part's last page, if
 * partial, is allocated by the copy (under the guard). */
static int
populate(Part *part)
{
    uintptr_t page = 4096, start = ((uintptr_t)part->dest + page - 1) / page * page;
    uintptr_t end = ((uintptr_t)part->dest + part->n) / page * page;
    if (__atomic_load_n(&shm_process.populating, __ATOMIC_RELAXED) == 0) {
        return 1;
    }
    if (end <= start || madvise((void *)start, end - start, MADV_POPULATE_WRITE) == 0) {
        return 0;
    }
    if (errno == EINVAL) {
        /* the kernel has no MADV_POPULATE_WRITE: not asked again (parts race to say so) */
        __atomic_store_n(&shm_process.populating, 0, __ATOMIC_RELAXED);
        return 1;
    }
    if (errno == EFAULT) {
        errno = ENOSPC; /* a page it could not allocate: what a write would have said */
    }
    return -1;
}

/* A part, on the calling thread. A copy runs under the SIGBUS guard (header.c): either
 * side may be memory another process truncated; the guard's jump is per thread, so
 * each part's thread sets its own. */
static void
run_part(Part *part)
{
    int mapped = part->fd < 0;
    if (part->fd >= 0 && part->dest != NULL) {
        int refused = populate(part);
        if (refused < 0) {
            part->error = errno;
            return;
        }
        mapped = !refused;
    }
    if (mapped) {
        if (shm_guard(copy_guarded, part) != 0) {
            part->error = EFAULT;
            part->fault_at = shm_fault_address();
        }
        return;
    }
    size_t done = 0;
    while (done < part->n) {
        ssize_t wrote = pwrite(part->fd, part->src + done, part->n - done, part->offset + (off_t)done);
        if (wrote < 0) {
            if (errno == EINTR) {
                continue;
            }
            part->error = errno;
            return;
        }
        done += (size_t)wrote;
    }
}

static void *
part_thread(void *arg)
{
    run_part((Part *)arg);
    return NULL;
}

/* torch's intra-op setting in this process (GIL held): 1 where torch is not imported
 * (the broker) or does not answer. */
static long
intra_op_threads(void)
{
    if (shm_process.intra_op > 0) {
        return shm_process.intra_op;
    }
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch = name != NULL ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    PyObject *got = torch != NULL ? PyObject_CallMethod(torch, "get_num_threads", NULL) : NULL;
    Py_XDECREF(torch);
    long threads = got != NULL ? PyLong_AsLong(got) : -1;
    Py_XDECREF(got);
    if (threads < 1) {
        PyErr_Clear();
        return 1;
    }
    return threads;
}

/* How many threads a copy of nbytes takes here (GIL held): the least of torch's
 * intra-op setting, the CPUs this process may run on and one a COPY_PART. Decides
 * streaming stores too, so that copies read it without the GIL. */
int
shm_copy_threads(Py_ssize_t nbytes)
{
    (void)streaming();
    if (nbytes < COPY_PARALLEL) {
        return 1;
    }
    long limit = (long)(nbytes / COPY_PART);
    cpu_set_t mask;
    if (sched_getaffinity(0, sizeof mask, &mask) == 0 && CPU_COUNT(&mask) < limit) {
        limit = CPU_COUNT(&mask);
    }
    long intra = intra_op_threads();
    if (intra < limit) {
        limit = intra;
    }
    return (int)(limit < 1 ? 1 : limit > MAX_THREADS ? MAX_THREADS : limit);
}

/* n bytes of src (NULL: zeros) to dest, or, with fd >= 0, written to fd at offset (dest
 * NULL) or into fd's new pages mapped at dest (dest: where fd's byte `offset` is mapped
 * here), in `threads` page-aligned parts run at once (shm_copy_threads says how many;
 * the GIL held or not). 0; or the errno of a write (or an allocation) that failed; or
 * EFAULT for a copy that faulted (a side cut by another process), *fault_at where. */
int
shm_copy(char *dest, const char *src, size_t n, int fd, off_t offset, int threads, void **fault_at)
{
    Part parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    if (threads < 1 || n < (size_t)COPY_PARALLEL) {
        threads = 1;
    }
    if (threads > MAX_THREADS) {
        threads = MAX_THREADS;
    }
    size_t page = 4096, share = (n + (size_t)threads - 1) / (size_t)threads;
    size_t each = (share + page - 1) / page * page; /* the parts cover n: the last may be shorter */
    int used = 0;
    for (size_t at = 0; used < threads && (at < n || used == 0); at += each, used++) {
        size_t len = n - at < each ? n - at : each;
        parts[used] = (Part){dest != NULL ? dest + at : NULL, src != NULL ? src + at : NULL, len,
                             fd, offset + (off_t)at, shm_process.streaming > 0, 0, NULL};
    }
    for (int i = 1; i < used; i++) {
        started[i] = pthread_create(&ids[i], NULL, part_thread, &parts[i]) == 0;
    }
    run_part(&parts[0]);
    for (int i = 1; i < used; i++) {
        if (started[i]) {
            pthread_join(ids[i], NULL);
        }
        else {
            run_part(&parts[i]);
        }
    }
    for (int i = 0; i < used; i++) {
        if (parts[i].error != 0) {
            if (fault_at != NULL) {
                *fault_at = parts[i].fault_at;
            }
            return parts[i].error;
        }
    }
    return 0;
}

PyDoc_STRVAR(copy_threads_doc,
             "copy_threads($module, nbytes, /)\n--\n\n-> int\n\nHow many threads a copy of nbytes "
             "into a segment takes in this process now: torch's intra-op setting, the CPU "
             "affinity mask and the copy's size bound it.");

static PyObject *
native_copy_threads(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_ssize_t nbytes = PyLong_AsSsize_t(arg);
    if (nbytes == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return PyLong_FromLong(shm_copy_threads(nbytes));
}

PyDoc_STRVAR(write_doc,
             "write($module, fd, address, nbytes, offset, mapping=0, threads=0, /)\n--\n\nWrite "
             "nbytes at address into the pages of fd from offset on, pages nothing lies in yet, "
             "the GIL released: through fd (pwrite) on one thread; where fd is mapped read-write "
             "and shared at mapping (its byte 0) and the write runs on 3 threads or more "
             "(threads; 0: copy_threads(nbytes)), each thread allocates its part's pages and "
             "copies through the mapping. OSError if a part fails.");

static PyObject *
native_write(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (shm_check_nargs("write", nargs, 4, 6) < 0) {
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    void *address = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
    long long offset = PyLong_AsLongLong(args[3]);
    char *mapping = nargs > 4 ? PyLong_AsVoidPtr(args[4]) : NULL;
    long threads = nargs > 5 ? PyLong_AsLong(args[5]) : 0;
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT_MAX || address == NULL || nbytes < 0 || offset < 0 || threads < 0) {
        PyErr_SetString(PyExc_ValueError, "write() takes a descriptor, an address, a size and an offset");
        return NULL;
    }
    if (threads == 0 || threads > MAX_THREADS) {
        threads = threads == 0 ? shm_copy_threads(nbytes) : MAX_THREADS;
    }
    if (mapping == NULL || threads < MAPPED_THREADS) {
        threads = 1; /* writes to one file run one at a time (its inode's lock) */
    }
    char *dest = threads > 1 ? mapping + offset : NULL;
    int error;
    Py_BEGIN_ALLOW_THREADS
    error = shm_copy(dest, address, (size_t)nbytes, (int)fd, (off_t)offset, (int)threads, NULL);
    Py_END_ALLOW_THREADS
    if (error != 0) {
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_streaming_doc,
             "set_streaming($module, on, /)\n--\n\n-> bool\n\nWhether copies of 1 MiB and up into "
             "a segment use non-temporal stores (where the CPU has them: AVX2); returns whether "
             "they did. For tests and measurements.");

static PyObject *
native_set_streaming(PyObject *Py_UNUSED(module), PyObject *on)
{
    int want = PyObject_IsTrue(on);
    if (want < 0) {
        return NULL;
    }
    int was = streaming();
#ifdef HAVE_STREAMING
    shm_process.streaming = want && __builtin_cpu_supports("avx2");
#else
    (void)want;
    shm_process.streaming = 0;
#endif
    return PyBool_FromLong(was);
}

PyDoc_STRVAR(set_intra_op_threads_doc,
             "set_intra_op_threads($module, n, /)\n--\n\nThe process's intra-op setting that large "
             "copies obey, from any thread (0: the calling thread's torch.get_num_threads()).");

static PyObject *
native_set_intra_op_threads(PyObject *Py_UNUSED(module), PyObject *arg)
{
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    shm_process.intra_op = n < 0 ? 0 : n > INT_MAX ? INT_MAX : (int)n;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_populating_doc,
             "set_populating($module, on, /)\n--\n\n-> bool\n\nWhether a write on several threads "
             "allocates its pages with MADV_POPULATE_WRITE (else through the descriptor, as where "
             "the kernel refuses it); returns whether it did. For tests and measurements.");

static PyObject *
native_set_populating(PyObject *Py_UNUSED(module), PyObject *on)
{
    int want = PyObject_IsTrue(on);
    return want < 0 ? NULL
                    : PyBool_FromLong(__atomic_exchange_n(&shm_process.populating, want ? -1 : 0, __ATOMIC_RELAXED) != 0);
}

PyMethodDef shm_copy_methods[] = {
    {"set_intra_op_threads", native_set_intra_op_threads, METH_O, set_intra_op_threads_doc},
    {"copy_threads", native_copy_threads, METH_O, copy_threads_doc},
    {"write", (PyCFunction)(void (*)(void))native_write, METH_FASTCALL, write_doc},
    {"set_streaming", native_set_streaming, METH_O, set_streaming_doc},
    {"set_populating", native_set_populating, METH_O, set_populating_doc},
    {NULL, NULL, 0, NULL},
};
