// LD_PRELOAD shim (review 31, F5): the Nth io_uring_enter that only submits (to_submit > 0,
// min_complete 0: ReadRing::submit and wake) made while the file $FAIL_SUBMIT_FILE exists
// fails with EAGAIN, once (the file is removed).
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

static atomic_long calls;

long syscall(long n, ...) {
    va_list ap;
    va_start(ap, n);
    long a1 = va_arg(ap, long), a2 = va_arg(ap, long), a3 = va_arg(ap, long);
    long a4 = va_arg(ap, long), a5 = va_arg(ap, long), a6 = va_arg(ap, long);
    va_end(ap);
    static long (*real)(long, ...);
    if (!real) real = (long (*)(long, ...))dlsym(RTLD_NEXT, "syscall");
    if (n == SYS_io_uring_enter && a2 > 0 && a3 == 0) {
        const char *f = getenv("FAIL_SUBMIT_FILE");
        atomic_fetch_add(&calls, 1);
        if (f && unlink(f) == 0) {
            fprintf(stderr, "fail_submit: io_uring_enter(to_submit=%ld) -> EAGAIN\n", a2);
            errno = EAGAIN;
            return -1;
        }
    }
    return real(n, a1, a2, a3, a4, a5, a6);
}
