/* Shared-memory exchange between CPU ranks (raymoe/platform/cpu/shm.py): sequence flags with futex sleeps, and whole
 * post / receive calls of equal-chunk collectives (all-gather, equal all-to-all) in one C call each.
 *
 * A decode step of an expert-parallel rank makes two such collectives per MoE layer; in Python each post or
 * receive cost tens of microseconds of interpreter work (loops over peers, numpy flag reads, ctypes memmoves, a
 * futex_wake system call per flag store) around a copy of a few kilobytes.
 *
 * Control words. Each flag is the first int64 of its own 64-byte line; the second int64 of the line is its
 * waiter word: 1 while the flag's one waiting process may be asleep on it (every flag has a single reader: the
 * receiver of a mailbox for its ready flag, the sender for its slot's done flag). Wake-up protocol (Dekker):
 *   waiter: store waiter = 1 (seq_cst); re-read the flag (seq_cst); if still below target, FUTEX_WAIT on the
 *           flag's low 32 bits with the value read; store waiter = 0 after it returns.
 *   writer: store the flag (seq_cst); read waiter (seq_cst); FUTEX_WAKE only if it is 1.
 * Sequential consistency forbids both reads missing the other's store, so a writer that skips the system call
 * never leaves a waiter asleep; a wake that lands before the waiter's FUTEX_WAIT makes that call return at once
 * (the word no longer holds the value read). Waits sleep in slices of at most 50 ms and re-read the flag, as the
 * Python protocol does; a writer that skips the wake therefore saves about a microsecond of kernel time per
 * flag whenever the peer is still running. All ranks of a group use this file or none does (the Python
 * protocol always wakes and never sets waiter words): raymoe/platform/cpu/shm.py agrees on it when the group maps.
 */
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#include "cpu_ops.h"

#define LINE 8 /* int64 per control line */

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

/* Sleep while the 32-bit word at `word` holds `expected`, at most `seconds` (a wake, a changed word or a signal
 * ends it sooner). Without futex(2) (not Linux) a 20 us nap stands in: callers re-check either way. */
static void word_wait(int64_t *word, uint32_t expected, double seconds) {
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, expected, &ts, NULL, 0);
#else
    (void)word, (void)expected;
    if (seconds > 20e-6) ts.tv_sec = 0, ts.tv_nsec = 20000;
    nanosleep(&ts, NULL);
#endif
}

static void word_wake(int64_t *word) {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)word;
#endif
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Store `value` into the flag of control line `line`, then wake its waiter if it may be asleep. */
void raymoe_flag_store_wake(int64_t *line, int64_t value) {
    __atomic_store_n(line, value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(line + 1, __ATOMIC_SEQ_CST)) word_wake(line);
}

/* Wait until the flag of control line `line` is >= target: spin about `spin_ns` nanoseconds, then sleep on its
 * futex in slices of at most 50 ms. Returns 0, or -1 when the flag stayed below target for `timeout_s`. */
int raymoe_flag_wait_ge(int64_t *line, int64_t target, double timeout_s, int64_t spin_ns) {
    if (__atomic_load_n(line, __ATOMIC_ACQUIRE) >= target) return 0;
    double start = now_s(), spin_end = start + 1e-9 * (double)spin_ns, deadline = start + timeout_s;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (__atomic_load_n(line, __ATOMIC_ACQUIRE) >= target) return 0;
            CPU_RELAX();
        }
        if (now_s() >= spin_end) break;
    }
    for (;;) {
        __atomic_store_n(line + 1, 1, __ATOMIC_SEQ_CST);
        int64_t cur = __atomic_load_n(line, __ATOMIC_SEQ_CST);
        if (cur >= target) {
            __atomic_store_n(line + 1, 0, __ATOMIC_RELAXED);
            return 0;
        }
        double left = deadline - now_s();
        if (left <= 0) {
            __atomic_store_n(line + 1, 0, __ATOMIC_RELAXED);
            return -1;
        }
        word_wait(line, (uint32_t)cur, left > 0.05 ? 0.05 : left);
        __atomic_store_n(line + 1, 0, __ATOMIC_RELAXED);
        if (__atomic_load_n(line, __ATOMIC_ACQUIRE) >= target) return 0;
    }
}

/* The mapping of raymoe/platform/cpu/shm.py (ShmLayout): P ranks, K slots of C bytes per ordered pair, control lines
 * ready[src, dst] then done[src, dst, slot], mailboxes from byte `control_bytes` on. */
static int64_t *ready_line(uint8_t *base, int64_t p, int64_t src, int64_t dst) {
    return (int64_t *)base + (src * p + dst) * LINE;
}
static int64_t *done_line(uint8_t *base, int64_t p, int64_t k, int64_t src, int64_t dst, int64_t slot) {
    return (int64_t *)base + (p * p + (src * p + dst) * k + slot) * LINE;
}
static uint8_t *slot_ptr(uint8_t *base, int64_t control_bytes, int64_t p, int64_t k, int64_t slot_bytes,
                         int64_t src, int64_t dst, int64_t slot) {
    return base + control_bytes + ((src * p + dst) * k + slot) * slot_bytes;
}

/* Post call `seq` of rank `me`: peer d receives `len` bytes from src + d * src_stride (src_stride 0: an
 * all-gather, one message for all), once the peer has consumed call seq - K from that slot; this rank's own
 * chunk is copied to out + me * len. Returns 0, or -(peer + 1) when a peer kept its slot for `timeout_s`.
 * The caller has checked len <= slot_bytes and the in-flight bound. */
int raymoe_shm_post_equal(uint8_t *base, int64_t control_bytes, int64_t p, int64_t k, int64_t slot_bytes,
                          int64_t me, int64_t seq, const uint8_t *src, int64_t src_stride, int64_t len,
                          uint8_t *out, double timeout_s, int64_t spin_ns) {
    int64_t slot = seq % k;
    for (int64_t step = 1; step < p; step++) {
        int64_t dst = (me + step) % p;
        if (raymoe_flag_wait_ge(done_line(base, p, k, me, dst, slot), seq - k, timeout_s, spin_ns))
            return (int)-(dst + 1);
        memcpy(slot_ptr(base, control_bytes, p, k, slot_bytes, me, dst, slot), src + dst * src_stride,
               (size_t)len);
        raymoe_flag_store_wake(ready_line(base, p, me, dst), seq);
    }
    memmove(out + me * len, src + me * src_stride, (size_t)len);
    return 0;
}

/* Receive call `seq` into `out`: peer s's `len` bytes go to out + s * len (this rank's own chunk was placed by
 * the post). Returns 0, or -(peer + 1) when a peer did not post within `timeout_s`. */
int raymoe_shm_receive_equal(uint8_t *base, int64_t control_bytes, int64_t p, int64_t k, int64_t slot_bytes,
                             int64_t me, int64_t seq, uint8_t *out, int64_t len, double timeout_s, int64_t spin_ns) {
    int64_t slot = seq % k;
    for (int64_t step = 1; step < p; step++) {
        int64_t src = (me - step + p) % p;
        if (raymoe_flag_wait_ge(ready_line(base, p, src, me), seq, timeout_s, spin_ns)) return (int)-(src + 1);
        memcpy(out + src * len, slot_ptr(base, control_bytes, p, k, slot_bytes, src, me, slot), (size_t)len);
        raymoe_flag_store_wake(done_line(base, p, k, src, me, slot), seq);
    }
    return 0;
}
