/* A fault for tests: torch's first-use initializations, made slow on every thread but
 * a process's main one, written down, and met by a fork.
 *
 * A C++ function-local static is initialized by the first thread to reach it, between
 * __cxa_guard_acquire (which returns 1 to that thread) and __cxa_guard_release; every
 * other thread waits on the guard meanwhile, and so does, for ever, a child forked
 * meanwhile. Preloaded (LD_PRELOAD), this library stands in for libstdc++'s
 * __cxa_guard_acquire: where it returns 1 on a thread that is not its process's main
 * one, it writes a line (and the thread's C and Python stacks) to the file named by
 * $SLOW_FIRST_USE_LOG and sleeps $SLOW_FIRST_USE_MS (default 100) before the
 * initialization goes on, as on a slow machine. slow_first_use_wait(ms), called from
 * a fork's before-hook (through ctypes, which lets go of the GIL: torch lets go of it
 * too inside an op, where its op-level statics are initialized), waits until such a
 * thread is inside one, or ms: the fork then lands inside it. The log says which
 * initializations such threads made at all. Without $SLOW_FIRST_USE_LOG it changes
 * nothing.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <execinfo.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*guard_fn)(void *);

static atomic_int inside; /* threads sleeping inside a first-use initialization, GIL let go of */

static guard_fn
real_acquire(void)
{
    static guard_fn real; /* a plain pointer: a static with an initializer would take a guard */
    if (real == NULL) {
        void *lib = dlopen("libstdc++.so.6", RTLD_LAZY | RTLD_NOLOAD);
        real = (guard_fn)dlsym(lib != NULL ? lib : RTLD_NEXT, "__cxa_guard_acquire");
        if (real == NULL) {
            abort();
        }
    }
    return real;
}

static void
report(const char *path)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (fd < 0) {
        return;
    }
    char line[96];
    int n = snprintf(line, sizeof line, "torch first use on thread %ld of process %d\n",
                     (long)syscall(SYS_gettid), (int)getpid());
    if (n > 0 && write(fd, line, (size_t)n) < 0) {
        n = 0;
    }
    void *frames[6];
    int depth = backtrace(frames, 6);
    backtrace_symbols_fd(frames + 1, depth - 1, fd);
    /* The Python stack, as faulthandler writes it (CPython's own function, found at run
     * time: absent, only the C frames are written). */
    void *(*this_thread)(void) = (void *(*)(void))dlsym(RTLD_DEFAULT, "PyGILState_GetThisThreadState");
    void (*dump)(int, void *) = (void (*)(int, void *))dlsym(RTLD_DEFAULT, "_Py_DumpTraceback");
    void *tstate = this_thread != NULL ? this_thread() : NULL;
    if (dump != NULL && tstate != NULL) {
        dump(fd, tstate);
    }
    close(fd);
}

int
__cxa_guard_acquire(void *guard)
{
    int first = real_acquire()(guard);
    const char *path = getenv("SLOW_FIRST_USE_LOG");
    if (first && path != NULL && syscall(SYS_gettid) != getpid()) {
        report(path);
        const char *ms = getenv("SLOW_FIRST_USE_MS");
        long wait = ms != NULL ? atol(ms) : 100;
        struct timespec pause = {.tv_sec = wait / 1000, .tv_nsec = (wait % 1000) * 1000000L};
        /* Only where this thread let go of the GIL can another one fork meanwhile. */
        int (*holds_gil)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "PyGILState_Check");
        int counted = holds_gil == NULL || !holds_gil();
        if (counted) {
            atomic_fetch_add(&inside, 1);
        }
        nanosleep(&pause, NULL);
        if (counted) {
            atomic_fetch_sub(&inside, 1);
        }
    }
    return first;
}

/* Wait until a thread is inside a slowed initialization without the GIL, or ms: 1 if
 * one is. */
int
slow_first_use_wait(int ms)
{
    struct timespec tick = {.tv_sec = 0, .tv_nsec = 1000000L};
    for (int i = 0; i < ms; i++) {
        if (atomic_load(&inside) > 0) {
            return 1;
        }
        nanosleep(&tick, NULL);
    }
    return atomic_load(&inside) > 0;
}
