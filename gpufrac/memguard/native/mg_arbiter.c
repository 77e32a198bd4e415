/*
 * memguard: the slow path, the arbiter client (docs/arbiter-protocol.md):
 * bursts past request + grant, reclaims of the guarantee, grants flowing back
 * (RELEASE), swap-in and the process's own host pid (IDENTIFY). Never on the fast path.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "mg_internal.h"

static uint64_t mg_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Milliseconds left until `deadline` (mg_now_ms() clock), 0 once it passed; at most INT_MAX
 * (a wait longer than that, up to the u32 fields' 49.7 days, is taken in parts). */
static int mg_left_ms(uint64_t deadline) {
    uint64_t now = mg_now_ms();
    if (now >= deadline) return 0;
    return deadline - now > (uint64_t)INT_MAX ? INT_MAX : (int)(deadline - now);
}

/* Wait until `deadline` for `events` on fd: 0 once they came, -1 when the deadline passed or
 * the socket failed or hung up without them. */
static int mg_wait_by(int fd, short events, uint64_t deadline) {
    for (;;) {
        int left = mg_left_ms(deadline);
        if (left <= 0) return -1;
        struct pollfd p = {.fd = fd, .events = events};
        int r = poll(&p, 1, left);
        if (r == 0 || (r < 0 && errno == EINTR)) continue; /* the deadline decides */
        return r == 1 && (p.revents & events) ? 0 : -1;
    }
}

/* Connect the (blocking) socket fd by `deadline`. On a unix socket a full listen
 * backlog is EAGAIN, never EINPROGRESS, so a non-blocking connect cannot wait
 * for room; a blocking one waits up to SO_SNDTIMEO and is woken as soon as the
 * agent accepts. Should the kernel still answer EAGAIN early (or a signal
 * interrupt the wait), retry after a short sleep, until the deadline. */
static MG_COLD int mg_connect_by(int fd, const struct sockaddr_un *addr, uint64_t deadline) {
    for (long nap_ms = 1;; nap_ms = nap_ms < 5 ? nap_ms + 1 : 5) {
        int left = mg_left_ms(deadline);
        if (left <= 0) return -1;
        struct timeval tv = {.tv_sec = left / 1000, .tv_usec = (left % 1000) * 1000};
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0 || errno == EISCONN) return 0;
        if (errno != EAGAIN && errno != EINTR) return -1; /* no socket, nobody listening: no at once */
        left = mg_left_ms(deadline);
        if (left <= 0) return -1;
        struct timespec ts = {0, (nap_ms < left ? nap_ms : left) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/*
 * THE single place the shim asks the agent for burst memory.
 *
 * Called when an allocation of `bytes` would take the container to
 * `total_after`, past request + grant but within the limit. Returns 1 when the
 * agent granted: it has already raised config.grant_bytes (new generation)
 * before replying, so the caller re-reads the config and retries. Returns 0 to
 * refuse: no socket, no agent, timeout, denial, garbage. Never grants blindly.
 *
 * Protocol (mg_burst_req_t / mg_burst_rep_t in memguard_abi.h): one request
 * per connection on the socket mg_sock() names; the agent identifies
 * the caller by SO_PEERCRED, not by the message. Connect and send are bounded
 * by arbiter_timeout_ms (a full backlog is waited out within it); the reply by
 * arbiter_timeout_ms + wait_timeout_ms, since the agent's wait resolver may
 * hold the request that long. Without await_reply (RELEASE): one non-blocking
 * connect and send, failing at once.
 */
static MG_COLD int mg_is_sock(const char *path) {
    struct stat st;
    return path[0] && stat(path, &st) == 0 && S_ISSOCK(st.st_mode);
}

/* The agent's socket, asked anew on each request: $GPUFRAC_CONTAINER_DIR/arbiter/arbiter.sock,
 * in the directory mount that shows a restarted agent's new socket; else the socket file an
 * older agent mounted at $GPUFRAC_CONTAINER_DIR/arbiter.sock. NULL when neither is a socket
 * (the agent is away). Which path it is says nothing of who calls: that is SO_PEERCRED's. */
static MG_COLD const char *mg_sock(void) {
    if (mg_is_sock(g_sock_path)) return g_sock_path;
    if (mg_is_sock(g_sock_legacy)) return g_sock_legacy;
    return NULL;
}

static MG_COLD int mg_arbiter_io(uint16_t op, uint64_t bytes, uint64_t total_after, const mg_limits_t *l,
                                 int await_reply, uint64_t *reply_generation) {
    const char *path = mg_sock();
    if (!path) return 0;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (await_reply ? 0 : SOCK_NONBLOCK), 0);
    if (fd < 0) return 0;
    int granted = 0;
    /* Read as the agent reads them (memguard_abi.h MG_MIN_ARBITER_TIMEOUT_MS): the agent never
     * writes less than the least, and both as written, whatever their size. */
    uint64_t timeout = l->arbiter_timeout_ms < MG_MIN_ARBITER_TIMEOUT_MS ? MG_MIN_ARBITER_TIMEOUT_MS
                                                                         : l->arbiter_timeout_ms;
    uint64_t deadline = mg_now_ms() + timeout;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    memcpy(addr.sun_path, path, strlen(path) + 1);
    if (!await_reply) {
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) goto out; /* full backlog: EAGAIN, at once */
    } else if (mg_connect_by(fd, &addr, deadline) != 0 || fcntl(fd, F_SETFL, O_NONBLOCK) != 0) {
        goto out;
    }
    mg_burst_req_t req = {.magic = MG_BURST_MAGIC, .version = MG_ABI_VERSION, .op = op,
                          .pid = g_pid, .bytes = bytes, .total_after = total_after, .generation = l->generation};
    if (mg_wait_by(fd, POLLOUT, deadline) != 0 || send(fd, &req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req)
        goto out;
    if (!await_reply) {
        granted = 1; /* sent: the agent reads it after we close (a unix socket keeps queued bytes) */
        goto out;
    }
    uint64_t reply_by = mg_now_ms() + timeout + l->wait_timeout_ms;
    mg_burst_rep_t rep;
    size_t got = 0;
    while (got < sizeof rep) {
        if (mg_wait_by(fd, POLLIN, reply_by) != 0) goto out;
        ssize_t n = recv(fd, (char *)&rep + got, sizeof rep - got, 0);
        if (n <= 0) {
            if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
            goto out;
        }
        got += (size_t)n;
    }
    granted = rep.magic == MG_BURST_MAGIC && rep.status == MG_BURST_GRANTED;
    if (granted && reply_generation) *reply_generation = rep.generation;
out:
    close(fd);
    return granted;
}

/* A request that waits for the agent's answer: 1 if granted. */
MG_COLD int mg_ask_arbiter(uint16_t op, uint64_t bytes, uint64_t total_after, const mg_limits_t *l) {
    return mg_arbiter_io(op, bytes, total_after, l, 1, NULL);
}

/* This process's pid as the agent sees it (op IDENTIFY): the kernel's SO_PEERCRED, in the
 * host's pid namespace, where NVML names processes. Nothing this process can write names
 * another's: the agent reads who connected. 0 when the agent cannot tell (away, an older one). */
MG_COLD uint32_t mg_ask_host_pid(void) {
    mg_limits_t l;
    if (mg_read_limits(&l) != 0) memset(&l, 0, sizeof l);
    uint64_t pid = 0;
    if (!mg_arbiter_io(MG_BURST_OP_IDENTIFY, 0, 0, &l, 1, &pid)) return 0;
    return pid > 0 && pid <= INT32_MAX ? (uint32_t)pid : 0;
}

/* Grants flow back (docs/arbiter-protocol.md, RELEASE). When a free leaves the
 * container using less than request + grant by more than max(64 MiB, grant/8),
 * the agent is told at once, so a burst waiting elsewhere on the GPU gets the
 * memory within milliseconds instead of after the agent's 10 s stale-grant sweep.
 *
 * Why op RELEASE, sent without waiting for the reply, rather than only the
 * grant_returned counter: the agent reads the counter in its once-a-second sweep,
 * too slow for a waiter; the op wakes it now. Not awaiting the reply keeps the
 * free's cost at one non-blocking connect and one 40-byte send on a unix socket
 * (tens of microseconds; a full backlog fails at once with EAGAIN), never a wait
 * on a busy agent. Nothing is held meanwhile. If the send fails (agent away), the
 * counter is bumped instead, and the agent's sweep (or, after a restart, its
 * reconcile) takes the grant back. Identity is SO_PEERCRED as for a burst.
 *
 * At most one RELEASE per process and config generation: the agent's lowered
 * grant comes with a new generation; until then further frees do not resend. */
#define MG_RETURN_MIN (64ull << 20)
static _Atomic uint64_t g_returned_gen = UINT64_MAX;

/* Grant the container holds but does not use (never the guarantee); 0 if none. */
static uint64_t mg_unused_grant(mg_limits_t *l, uint64_t *used) {
    /* No grant (the common case): one load decides, without the seqlock. A
     * grant being raised at this instant is seen by the next free. */
    if (!g_usage || !g_cfg || LOAD_CFG(grant_bytes) == 0) return 0;
    if (mg_read_limits(l) != 0 || l->grant == 0 || (l->flags & MG_FLAG_WHOLE_GPU)) return 0;
    uint64_t held = l->request + l->grant;
    if (held < l->request || held > l->limit) held = l->limit;
    *used = atomic_load_explicit(&g_usage->total_used, memory_order_relaxed);
    uint64_t unused = *used >= held ? 0 : held - *used;
    return unused > l->grant ? l->grant : unused;
}

void mg_maybe_return_grant(void) {
    mg_limits_t l;
    uint64_t used = 0, unused = mg_unused_grant(&l, &used);
    if (MG_LIKELY(unused == 0)) return;
    uint64_t slack = l.grant / 8 > MG_RETURN_MIN ? l.grant / 8 : MG_RETURN_MIN;
    if (unused <= slack) return;
    uint64_t gen = atomic_load_explicit(&g_returned_gen, memory_order_relaxed);
    if (gen == l.generation ||
        !atomic_compare_exchange_strong_explicit(&g_returned_gen, &gen, l.generation, memory_order_relaxed,
                                                 memory_order_relaxed))
        return; /* sent for this generation already, or another thread is sending now */
    if (!mg_arbiter_io(MG_BURST_OP_RELEASE, unused, used, &l, 0, NULL))
        atomic_fetch_add_explicit(&g_usage->grant_returned, unused, memory_order_relaxed);
}

/* At exit the op would reach the agent after this process is gone (it could not be
 * identified), so the exit only adds what it leaves unused to the counter: the
 * agent's sweep takes the grant back within a second. */
void mg_exit_return_grant(void) {
    mg_limits_t l;
    uint64_t used = 0, unused = mg_unused_grant(&l, &used);
    if (unused) atomic_fetch_add_explicit(&g_usage->grant_returned, unused, memory_order_relaxed);
}

/* Swap-in (gpufrac/agent/arbiter/swap/resolver.py): the agent moved this process's GPU
 * memory to host RAM (slot->swapped) and its CUDA calls block in the driver
 * until it is restored. So before the next launch or allocation, ask the agent
 * to bring it back (op SWAP_IN, arbitrated like a burst); the agent restores,
 * clears the flag, then replies. Denied, timed out or agent away: ask again,
 * backing off up to a second (the process cannot do GPU work meanwhile anyway). */
MG_COLD void mg_swap_in(mg_proc_slot_t *s) {
    long delay_ms = 5;
    while (atomic_load_explicit(&s->swapped, memory_order_acquire)) {
        mg_limits_t l;
        if (mg_read_limits(&l) != 0) memset(&l, 0, sizeof l);
        if (mg_ask_arbiter(MG_BURST_OP_SWAP_IN, 0, 0, &l) && !atomic_load_explicit(&s->swapped, memory_order_acquire))
            return;
        struct timespec ts = {delay_ms / 1000, (delay_ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
        }
        if (delay_ms < 1000) delay_ms *= 2;
    }
}
