/*
 * clockshift: an LD_PRELOAD shim that shifts one process's wall clock by an offset read
 * from a file, so that a test can move a server's clock forward and back without touching
 * the machine's clock.
 *
 * CLOCKSHIFT_FILE names a file of 8 bytes: a signed 64-bit offset in milliseconds, native
 * byte order. The file is mapped once (shared, read-only) on first use and read on every
 * call, so a writer that rewrites the 8 bytes in place (pwrite, never truncate) shifts the
 * clock at once. Without the variable, or if the file cannot be mapped, the offset is 0.
 *
 * Shifted: clock_gettime(CLOCK_REALTIME, CLOCK_REALTIME_COARSE), gettimeofday, time.
 * Not shifted: CLOCK_MONOTONIC and every other clock (timers, Redis's monotonic clock).
 *
 * The real clock_gettime is found with dlsym(RTLD_NEXT) on first use. dlsym may allocate,
 * and an allocator (jemalloc) may read the clock while it initialises: a call that arrives
 * while the lookup is under way (on this thread or another) goes to the raw system call, so
 * the lookup never recurses into itself. gettimeofday and time are computed from the real
 * clock_gettime(CLOCK_REALTIME), so one symbol is looked up.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

typedef int (*clock_gettime_fn)(clockid_t, struct timespec *);

static clock_gettime_fn real_clock_gettime; /* set once, read atomically */
static int looking_up;                      /* 1 while one thread runs dlsym */
static const volatile int64_t *offset_ms;   /* the mapped file, or NULL */
static int mapping;                         /* 0 not yet, 1 under way, 2 done */

static int raw_clock_gettime(clockid_t clk, struct timespec *ts) {
    return (int)syscall(SYS_clock_gettime, clk, ts);
}

static int base_clock_gettime(clockid_t clk, struct timespec *ts) {
    clock_gettime_fn f = __atomic_load_n(&real_clock_gettime, __ATOMIC_ACQUIRE);
    if (f == NULL) {
        if (__atomic_exchange_n(&looking_up, 1, __ATOMIC_ACQ_REL) != 0)
            return raw_clock_gettime(clk, ts);
        f = (clock_gettime_fn)dlsym(RTLD_NEXT, "clock_gettime");
        if (f == NULL)
            f = raw_clock_gettime;
        __atomic_store_n(&real_clock_gettime, f, __ATOMIC_RELEASE);
    }
    return f(clk, ts);
}

/* The offset now, in ms. Two equal reads in a row: a rewrite of the 8 bytes is not atomic
 * for the reader, so a torn value is read again. */
static int64_t current_offset(void) {
    int state = __atomic_load_n(&mapping, __ATOMIC_ACQUIRE);
    if (state != 2) {
        int expected = 0;
        if (state != 0 ||
            !__atomic_compare_exchange_n(&mapping, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 0; /* another thread is mapping it: unshifted for this one call */
        const char *path = getenv("CLOCKSHIFT_FILE");
        if (path != NULL && path[0] != '\0') {
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd >= 0) {
                void *p = mmap(NULL, sizeof(int64_t), PROT_READ, MAP_SHARED, fd, 0);
                close(fd);
                if (p != MAP_FAILED)
                    offset_ms = (const volatile int64_t *)p;
            }
        }
        __atomic_store_n(&mapping, 2, __ATOMIC_RELEASE);
    }
    if (offset_ms == NULL)
        return 0;
    int64_t a = *offset_ms, b = *offset_ms;
    while (a != b) {
        a = b;
        b = *offset_ms;
    }
    return a;
}

static void shift(struct timespec *ts, int64_t ms) {
    int64_t ns = (int64_t)ts->tv_nsec + (ms % 1000) * 1000000;
    ts->tv_sec += (time_t)(ms / 1000);
    if (ns < 0) {
        ns += 1000000000;
        ts->tv_sec -= 1;
    } else if (ns >= 1000000000) {
        ns -= 1000000000;
        ts->tv_sec += 1;
    }
    ts->tv_nsec = (long)ns;
}

int clock_gettime(clockid_t clk, struct timespec *ts) {
    int r = base_clock_gettime(clk, ts);
    if (r == 0 && (clk == CLOCK_REALTIME || clk == CLOCK_REALTIME_COARSE)) {
        int64_t ms = current_offset();
        if (ms != 0)
            shift(ts, ms);
    }
    return r;
}

/* glibc declares tv non-null; a NULL is still answered as the kernel does. */
#pragma GCC diagnostic ignored "-Wnonnull-compare"
int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    int r = clock_gettime(CLOCK_REALTIME, &ts);
    if (r != 0)
        return r;
    if (tv != NULL) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    if (tz != NULL) {
        struct timezone *z = tz;
        z->tz_minuteswest = 0;
        z->tz_dsttime = 0;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME_COARSE, &ts) != 0)
        return (time_t)-1;
    if (out != NULL)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
