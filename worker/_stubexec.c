/*
 * worker._stubexec - the stub backend's device as a thread outside Python.
 *
 * The stub's device is this host's CPU. Its queued chunks used to run on the worker's Python
 * device thread, which also did the launching: between two kernels the device idled for that
 * thread's own Python (the lease, the accounting, the next chunk's plan). Here a GEMM chunk is
 * *launched* by pushing a descriptor (its buffers, its shape) into a short ring; the executor
 * thread runs the ring's chunks back to back without the GIL, as a GPU runs a stream's queued
 * kernels, and stamps each one itself:
 *
 *     start   CLOCK_MONOTONIC at the kernel's call   (the work trace's launch row)
 *     end     CLOCK_MONOTONIC at its return
 *     cpu     CLOCK_THREAD_CPUTIME_ID across the call: the device time charged (the stub's
 *             measure, as time.thread_time_ns was on the Python device thread)
 *
 * The driver (the Python device thread) collects completions the way a CUDA stream's events are
 * read: wait() until every launched chunk is done (bounded by a deadline), then collect() the
 * stamps, oldest first. The executor wakes a waiting driver only once what it waits for holds (at
 * most `below` chunks left), not at every chunk's end: a wake-up is a syscall between two chunks. A
 * launched chunk holds its three buffers (Py_buffer exports: a bytearray cannot be resized under it,
 * and a freed StubBuffer's old bytes stay alive) until it is collected - or withdrawn: the launched
 * chunks that have not started can be taken back (withdraw), as a GPU's queued kernels not yet begun,
 * when the device passes to another worker at a boundary.
 *
 * The kernel is numpy's own BLAS (the sgemm numpy's matmul calls): its address is given by the
 * Python side (worker.backends.stub_executor), found in the library numpy loaded.
 *
 * A gated launch (sgemm_gated): the first chunk of a stretch, pushed before the driver waits for
 * the device's lease. The executor starts it the moment the board's owner word names its worker
 * idle (the grant): it takes the lease busy itself with a CAS on that word (idle -> busy, as the
 * driver's own acquire would) and runs the chunk - the driver's wake, its look at the board and its
 * launch are no longer between a handover and the device's next kernel. It runs the chunk only
 * under its worker's busy lease: its own CAS won, or the driver's (the word already busy and its
 * worker's). A lost CAS runs nothing; the driver that gives up its wait cancels the chunk under the
 * executor's lock (gate_resolve), so a chunk is either cancelled or started, never both; a killed
 * process's executor dies with it. The executor sleeps on a futex on the owner word's low half
 * with its worker's wake bit (shared.gpu_time's _wake_bit: a grant wakes its grantee's executor
 * only, never every armed one on the board), at most GATE_POLL_NS between looks.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* cblas enums (plain ints in every cblas.h) */
#define CBLAS_ROW_MAJOR 101
#define CBLAS_NO_TRANS 111

typedef void (*sgemm64_t)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                          const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_t)(int, int, int, int32_t, int32_t, int32_t, float, const float *, int32_t,
                          const float *, int32_t, float, float *, int32_t);

/* a gated slot's longest sleep between two looks at the owner word (a lost wake-up costs this) */
#define GATE_POLL_NS 2000000LL

enum { GATE_NONE = 0, GATE_ARMED = 1, GATE_TAKEN = 2 };

typedef struct {
    Py_buffer a, b, c;
    int64_t m, k, n;
    int64_t start_ns, end_ns, cpu_ns;
} Slot;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;   /* the executor waits for a launch */
    pthread_cond_t done_cv; /* the driver waits for completions */
    Slot *slots;
    uint64_t cap;
    uint64_t head;  /* collected */
    uint64_t done;  /* completed by the executor */
    uint64_t tail;  /* launched */
    int stop;
    int running;    /* the thread was started and not joined */
    int waiting;    /* drivers in wait() */
    int executing;  /* the slot at `done` is running (started: it can no longer be withdrawn) */
    int64_t signal_at; /* wake the drivers in wait() once at most this many launched chunks have not run
                          (the largest `below` of those waiting; -1: none): a wake-up is a syscall, and
                          across CPUs in a VM an interrupt - ~10 us of the device's time between two
                          chunks, paid at every chunk while the driver waited for any completion */
    pid_t tid;
    pthread_t thread;
    void *sgemm;
    int ilp64;
    uint64_t launched_total;
    uint64_t wakes;  /* drivers woken in wait() */
    /* the gated launch (at most one: the ring's only slot when armed; see the header) */
    int gate_state;
    uint64_t gate_slot;           /* its index (== done while armed) */
    Py_buffer gate_board;         /* the board's mapping, exported while armed or taken and not resolved */
    int gate_has_board;
    uint64_t *gate_owner;         /* the owner word */
    int64_t *gate_busy_since;     /* the lease line's "busy since": written after a won CAS */
    uint64_t gate_mine;           /* the owner word naming this worker, idle */
    int gate_won;                 /* this gate's lease was taken by the executor's own CAS */
    uint64_t gated_total;         /* gated launches */
    uint64_t gate_cas_won;        /* ... whose lease the executor took itself */
    uint64_t gate_cancelled;      /* ... cancelled by the driver (its wait refused) */
} Executor;

static int64_t
clock_ns(clockid_t clk)
{
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* The wake bit of the worker the owner word `mine` names (shared.gpu_time's _wake_bit: worker slot
   mod 32): a grant to that worker wakes the executors asleep with it, not every one on the board. */
static uint32_t
gate_bit(uint64_t mine)
{
    return 1u << ((((mine >> 1) - 1)) & 31u);
}

static void
run_slot(Executor *ex, Slot *s)
{
    const float *a = (const float *)s->a.buf, *b = (const float *)s->b.buf;
    float *c = (float *)s->c.buf;
    if (ex->ilp64)
        ((sgemm64_t)ex->sgemm)(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, s->m, s->n, s->k, 1.0f, a, s->k,
                               b, s->n, 0.0f, c, s->n);
    else
        ((sgemm32_t)ex->sgemm)(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, (int32_t)s->m, (int32_t)s->n,
                               (int32_t)s->k, 1.0f, a, (int32_t)s->k, b, (int32_t)s->n, 0.0f, c, (int32_t)s->n);
}

static void *
executor_main(void *arg)
{
    Executor *ex = (Executor *)arg;
    pthread_mutex_lock(&ex->mu);
    ex->tid = (pid_t)syscall(SYS_gettid);
    pthread_cond_broadcast(&ex->done_cv);  /* the constructor waits for the tid */
    for (;;) {
        while (ex->done == ex->tail && !ex->stop)
            pthread_cond_wait(&ex->work, &ex->mu);
        if (ex->done == ex->tail)
            break;  /* stopped, and every launched chunk ran */
        if (ex->gate_state == GATE_ARMED && ex->gate_slot == ex->done) {
            if (ex->stop) {
                /* closing with the driver's wait unresolved: never run without the lease */
                Slot *g = &ex->slots[ex->done % ex->cap];
                g->start_ns = g->end_ns = g->cpu_ns = 0;
                ex->gate_state = GATE_NONE;
                ex->done++;
                continue;
            }
            uint64_t mine = ex->gate_mine;
            uint64_t o = __atomic_load_n(ex->gate_owner, __ATOMIC_SEQ_CST);
            if (o == mine && __atomic_compare_exchange_n(ex->gate_owner, &o, mine | 1, 0, __ATOMIC_SEQ_CST,
                                                         __ATOMIC_SEQ_CST)) {
                __atomic_store_n(ex->gate_busy_since, clock_ns(CLOCK_MONOTONIC), __ATOMIC_SEQ_CST);
                ex->gate_won = 1;
                ex->gate_cas_won++;
                ex->gate_state = GATE_TAKEN;
            } else if (o == (mine | 1)) {
                ex->gate_state = GATE_TAKEN;  /* the driver's own CAS won: the lease is its worker's, busy */
            } else {
                /* not ours (yet): asleep until the word changes hands (or a poll's end), the lock
                   released - the driver may cancel meanwhile */
                uint32_t *word = (uint32_t *)(void *)ex->gate_owner;
                uint32_t bit = gate_bit(mine);
                pthread_mutex_unlock(&ex->mu);
                struct timespec ts;  /* FUTEX_WAIT_BITSET's timeout: absolute, CLOCK_MONOTONIC */
                int64_t until = clock_ns(CLOCK_MONOTONIC) + GATE_POLL_NS;
                ts.tv_sec = (time_t)(until / 1000000000LL);
                ts.tv_nsec = (long)(until % 1000000000LL);
                syscall(SYS_futex, word, FUTEX_WAIT_BITSET, (uint32_t)o, &ts, NULL, bit);
                pthread_mutex_lock(&ex->mu);
                continue;
            }
        }
        Slot *s = &ex->slots[ex->done % ex->cap];
        ex->executing = 1;
        pthread_mutex_unlock(&ex->mu);
        int64_t start = clock_ns(CLOCK_MONOTONIC);
        int64_t c0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        run_slot(ex, s);
        int64_t c1 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
        s->end_ns = clock_ns(CLOCK_MONOTONIC);
        s->start_ns = start;
        s->cpu_ns = c1 - c0;
        pthread_mutex_lock(&ex->mu);
        ex->executing = 0;
        ex->done++;
        if (ex->waiting && (int64_t)(ex->tail - ex->done) <= ex->signal_at) {
            ex->signal_at = -1;  /* (every waiter woken: each one still waiting registers again) */
            ex->wakes++;
            pthread_cond_broadcast(&ex->done_cv);
        }
    }
    pthread_mutex_unlock(&ex->mu);
    return NULL;
}

static void
release_slot(Slot *s)
{
    PyBuffer_Release(&s->a);
    PyBuffer_Release(&s->b);
    PyBuffer_Release(&s->c);
}

/* The board's export, once the gate is resolved (the GIL held). */
static void
gate_release_board(Executor *ex)
{
    if (ex->gate_has_board) {
        PyBuffer_Release(&ex->gate_board);
        ex->gate_has_board = 0;
    }
}

/* Stops the thread once every launched chunk ran (GIL released while joining). */
static void
executor_stop(Executor *ex)
{
    if (!ex->running)
        return;
    pthread_mutex_lock(&ex->mu);
    ex->stop = 1;
    pthread_cond_broadcast(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(ex->thread, NULL);  /* (a gated slot's sleep ends within GATE_POLL_NS) */
    Py_END_ALLOW_THREADS
    ex->running = 0;
    while (ex->head < ex->done) {
        release_slot(&ex->slots[ex->head % ex->cap]);
        ex->head++;
    }
    gate_release_board(ex);
}

static int
Executor_init(Executor *ex, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"sgemm", "ilp64", "ring", NULL};
    unsigned long long addr = 0;
    int ilp64 = 1;
    Py_ssize_t ring = 16;
    if (ex->running || ex->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an executor is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "K|pn", kwlist, &addr, &ilp64, &ring))
        return -1;
    if (addr == 0 || ring < 1 || ring > 4096) {
        PyErr_SetString(PyExc_ValueError, "an sgemm address and a ring of 1-4096 slots");
        return -1;
    }
    ex->slots = PyMem_Calloc((size_t)ring, sizeof(Slot));
    if (ex->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ex->cap = (uint64_t)ring;
    ex->signal_at = -1;
    ex->sgemm = (void *)(uintptr_t)addr;
    ex->ilp64 = ilp64;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_mutex_init(&ex->mu, NULL);
    pthread_cond_init(&ex->work, &attr);
    pthread_cond_init(&ex->done_cv, &attr);
    pthread_condattr_destroy(&attr);
    int err = pthread_create(&ex->thread, NULL, executor_main, ex);
    if (err) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    ex->running = 1;
    pthread_setname_np(ex->thread, "twt-stubexec");
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&ex->mu);
    while (ex->tid == 0)
        pthread_cond_wait(&ex->done_cv, &ex->mu);
    pthread_mutex_unlock(&ex->mu);
    Py_END_ALLOW_THREADS
    return 0;
}

static void
Executor_dealloc(Executor *ex)
{
    executor_stop(ex);
    if (ex->slots != NULL) {
        pthread_mutex_destroy(&ex->mu);
        pthread_cond_destroy(&ex->work);
        pthread_cond_destroy(&ex->done_cv);
        PyMem_Free(ex->slots);
        ex->slots = NULL;
    }
    Py_TYPE(ex)->tp_free((PyObject *)ex);
}

static int
ready(Executor *ex)
{
    if (!ex->running) {
        PyErr_SetString(PyExc_RuntimeError, "the executor is closed");
        return 0;
    }
    return 1;
}

/* whether [p, p + n) and [q, q + m) share a byte */
static int
overlaps(const Py_buffer *x, const Py_buffer *y)
{
    uintptr_t p = (uintptr_t)x->buf, q = (uintptr_t)y->buf;
    return p < q + (uintptr_t)y->len && q < p + (uintptr_t)x->len;
}

/* Fills the next slot with a GEMM's buffers: 1 when it fits the kernel, 0 when not (nothing kept),
   -1 on an error (raised). */
static int
fill_slot(Executor *ex, PyObject *oa, PyObject *ob, PyObject *oc, long long m, long long k, long long n)
{
    if (!ready(ex))
        return -1;
    if (ex->tail - ex->head >= ex->cap) {
        PyErr_SetString(PyExc_RuntimeError, "the executor's ring is full: collect before launching");
        return -1;
    }
    int64_t lim = ex->ilp64 ? (INT64_MAX / 8) : INT32_MAX;
    /* m or n of 1: numpy calls gemv or dot, not sgemm (results differ in rounding) */
    if (m <= 1 || k <= 0 || n <= 1 || m > lim || k > lim || n > lim)
        return 0;
    if ((m > INT64_MAX / 4 / k) || (k > INT64_MAX / 4 / n) || (m > INT64_MAX / 4 / n))
        return 0;
    Slot *s = &ex->slots[ex->tail % ex->cap];
    if (PyObject_GetBuffer(oa, &s->a, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(ob, &s->b, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&s->a);
        return -1;
    }
    if (PyObject_GetBuffer(oc, &s->c, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&s->a);
        PyBuffer_Release(&s->b);
        return -1;
    }
    int fits = s->a.len >= 4 * m * k && s->b.len >= 4 * k * n && s->c.len >= 4 * m * n
        && ((uintptr_t)s->a.buf % 4) == 0 && ((uintptr_t)s->b.buf % 4) == 0 && ((uintptr_t)s->c.buf % 4) == 0;
    if (fits) {
        Py_buffer ca = s->c;
        ca.len = 4 * m * n;
        Py_buffer aa = s->a, bb = s->b;
        aa.len = 4 * m * k;
        bb.len = 4 * k * n;
        fits = !overlaps(&ca, &aa) && !overlaps(&ca, &bb);
    }
    if (!fits) {
        release_slot(s);
        return 0;
    }
    s->m = m;
    s->k = k;
    s->n = n;
    s->start_ns = s->end_ns = s->cpu_ns = 0;
    return 1;
}

PyDoc_STRVAR(sgemm_doc,
"sgemm(a, b, c, m, k, n) -> bool\n\n"
"Launch c[:m*n] = a[:m*k] @ b[:k*n] (row-major float32, numpy's BLAS) and return at once: True when\n"
"launched, False when the arguments do not fit the kernel (misaligned, too short, c overlapping a\n"
"or b, a dimension out of range): the caller runs the op itself. RuntimeError when the ring is full\n"
"(collect first).");

static PyObject *
Executor_sgemm(Executor *ex, PyObject *args)
{
    PyObject *oa, *ob, *oc;
    long long m, k, n;
    if (!PyArg_ParseTuple(args, "OOOLLL", &oa, &ob, &oc, &m, &k, &n))
        return NULL;
    if (ex->gate_state != GATE_NONE && ex->gate_slot >= ex->done) {
        PyErr_SetString(PyExc_RuntimeError, "a gated launch is not resolved: resolve it first");
        return NULL;
    }
    int got = fill_slot(ex, oa, ob, oc, m, k, n);
    if (got < 0)
        return NULL;
    if (!got)
        Py_RETURN_FALSE;
    pthread_mutex_lock(&ex->mu);
    ex->tail++;
    ex->launched_total++;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(sgemm_gated_doc,
"sgemm_gated(a, b, c, m, k, n, board, owner_off, busy_off, mine) -> bool\n\n"
"Launch a GEMM as sgemm does, gated on the device's lease: the executor starts it only once the\n"
"uint64 owner word at board[owner_off] is `mine | 1` (its worker's, busy): when it reads `mine` (its\n"
"worker's, idle: a grant) it takes it with a CAS to `mine | 1` and stores CLOCK_MONOTONIC ns at\n"
"board[busy_off]; a lost CAS runs nothing. Only into an empty ring (every launched chunk ran and was\n"
"collected), one at a time; gate_resolve() must follow before the next launch. False when the\n"
"arguments do not fit the kernel (nothing launched).");

static PyObject *
Executor_sgemm_gated(Executor *ex, PyObject *args)
{
    PyObject *oa, *ob, *oc, *board;
    long long m, k, n, owner_off, busy_off;
    unsigned long long mine;
    if (!PyArg_ParseTuple(args, "OOOLLLOLLK", &oa, &ob, &oc, &m, &k, &n, &board, &owner_off, &busy_off, &mine))
        return NULL;
    if (!ready(ex))
        return NULL;
    if (ex->gate_state != GATE_NONE || ex->tail != ex->head) {
        PyErr_SetString(PyExc_RuntimeError, "a gated launch goes into an empty, collected ring, one at a time");
        return NULL;
    }
    if (mine == 0 || (mine & 1)) {
        PyErr_SetString(PyExc_ValueError, "mine: an owner word naming a worker, idle (non-zero, even)");
        return NULL;
    }
    Py_buffer bb;
    if (PyObject_GetBuffer(board, &bb, PyBUF_WRITABLE) < 0)
        return NULL;
    if (owner_off < 0 || busy_off < 0 || owner_off % 8 || busy_off % 8 || owner_off + 8 > bb.len
        || busy_off + 8 > bb.len || ((uintptr_t)bb.buf % 8)) {
        PyBuffer_Release(&bb);
        PyErr_SetString(PyExc_ValueError, "the owner and busy words: aligned uint64 inside the board");
        return NULL;
    }
    int got = fill_slot(ex, oa, ob, oc, m, k, n);
    if (got <= 0) {
        PyBuffer_Release(&bb);
        if (got < 0)
            return NULL;
        Py_RETURN_FALSE;
    }
    gate_release_board(ex);
    ex->gate_board = bb;
    ex->gate_has_board = 1;
    pthread_mutex_lock(&ex->mu);
    ex->gate_owner = (uint64_t *)(void *)((char *)bb.buf + owner_off);
    ex->gate_busy_since = (int64_t *)(void *)((char *)bb.buf + busy_off);
    ex->gate_mine = (uint64_t)mine;
    ex->gate_won = 0;
    ex->gate_slot = ex->tail;
    ex->gate_state = GATE_ARMED;
    ex->tail++;
    ex->launched_total++;
    ex->gated_total++;
    pthread_cond_signal(&ex->work);
    pthread_mutex_unlock(&ex->mu);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(gate_resolve_doc,
"gate_resolve(cancel) -> int\n\n"
"The driver's wait for the lease is over. cancel=False: it holds the lease busy (its own CAS, or the\n"
"executor's) - the gated chunk runs, the executor woken if it sleeps; returns 2 when the executor took\n"
"the lease itself, 1 when the driver did. cancel=True: the wait was refused - the chunk is taken out\n"
"unless the executor already took the lease for it; returns 0 when cancelled, 2 when taken (the\n"
"driver then holds the lease busy). -1 when no gated launch is pending.");

static PyObject *
Executor_gate_resolve(Executor *ex, PyObject *args)
{
    int cancel = 0;
    if (!PyArg_ParseTuple(args, "p", &cancel))
        return NULL;
    if (!ready(ex))
        return NULL;
    long out;
    uint32_t *word = NULL;
    uint32_t bit = 0;
    pthread_mutex_lock(&ex->mu);
    if (ex->gate_state == GATE_NONE) {
        out = -1;
    } else if (ex->gate_state == GATE_TAKEN) {
        out = ex->gate_won ? 2 : 1;
        ex->gate_state = GATE_NONE;
    } else if (cancel) {
        /* armed and not started: out of the ring (it is the only slot launched and not collected) */
        ex->tail--;
        ex->launched_total--;
        ex->gate_cancelled++;
        release_slot(&ex->slots[ex->tail % ex->cap]);
        ex->gate_state = GATE_NONE;
        word = (uint32_t *)(void *)ex->gate_owner;
        bit = gate_bit(ex->gate_mine);
        out = 0;
    } else {
        /* the driver's CAS won: the slot runs as a plain one now (the executor checks no word),
           the executor woken if it sleeps on the word */
        ex->gate_state = GATE_NONE;
        word = (uint32_t *)(void *)ex->gate_owner;
        bit = gate_bit(ex->gate_mine);
        out = 1;
    }
    pthread_mutex_unlock(&ex->mu);
    if (word != NULL)  /* (its own executor: the bit it sleeps with) */
        syscall(SYS_futex, word, FUTEX_WAKE_BITSET, INT32_MAX, NULL, NULL, bit);
    gate_release_board(ex);
    return PyLong_FromLong(out);
}

PyDoc_STRVAR(withdraw_doc,
"withdraw(most) -> int\n\n"
"Take back up to `most` of the newest launched chunks that have not started (a chunk already running\n"
"is never touched): a GPU's queued kernels not yet begun, withdrawn when the device passes to another\n"
"worker at a boundary, so that the handover waits for the running chunk only. Returns how many were\n"
"taken back (their buffers released; never run, never collected); 0 while a gated launch is pending.");

static PyObject *
Executor_withdraw(Executor *ex, PyObject *args)
{
    long long most = 0;
    if (!PyArg_ParseTuple(args, "L", &most))
        return NULL;
    if (!ready(ex))
        return NULL;
    uint64_t first, n = 0;
    pthread_mutex_lock(&ex->mu);
    if (ex->gate_state == GATE_NONE && most > 0) {
        uint64_t idle = ex->tail - ex->done - (uint64_t)(ex->executing && ex->tail > ex->done);
        n = idle < (uint64_t)most ? idle : (uint64_t)most;
        ex->tail -= n;
        ex->launched_total -= n;
        if (n && ex->waiting)
            pthread_cond_broadcast(&ex->done_cv);  /* (what a waiter waits for may hold now) */
    }
    first = ex->tail;
    pthread_mutex_unlock(&ex->mu);
    for (uint64_t i = 0; i < n; i++)  /* (past the tail: the executor never reads them) */
        release_slot(&ex->slots[(first + i) % ex->cap]);
    return PyLong_FromUnsignedLongLong(n);
}

PyDoc_STRVAR(wait_doc,
"wait(until_ns=-1, below=0) -> bool\n\n"
"Wait (the GIL released) until at most `below` launched chunks have not run yet (0: every one ran);\n"
"until_ns: a CLOCK_MONOTONIC bound (-1: none). False when the bound passed first.");

static PyObject *
Executor_wait(Executor *ex, PyObject *args)
{
    long long until = -1, below = 0;
    if (!PyArg_ParseTuple(args, "|LL", &until, &below))
        return NULL;
    uint64_t left = below > 0 ? (uint64_t)below : 0;
    if (!ready(ex))
        return NULL;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS  /* (before the lock: a thread holding it never waits for the GIL) */
    pthread_mutex_lock(&ex->mu);
    ex->waiting++;
    while (ex->tail - ex->done > left) {
        if ((int64_t)left > ex->signal_at)
            ex->signal_at = (int64_t)left;
        if (until < 0) {
            pthread_cond_wait(&ex->done_cv, &ex->mu);
        } else {
            struct timespec ts = {.tv_sec = until / 1000000000LL, .tv_nsec = until % 1000000000LL};
            if (pthread_cond_timedwait(&ex->done_cv, &ex->mu, &ts) == ETIMEDOUT && ex->tail - ex->done > left) {
                ok = 0;
                break;
            }
        }
    }
    ex->waiting--;
    pthread_mutex_unlock(&ex->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(collect_doc,
"collect() -> list[tuple[int, int, int]]\n\n"
"The chunks that ran since the last collect, oldest first: (cpu_ns, start_ns, end_ns) each; their\n"
"buffers are released.");

static PyObject *
Executor_collect(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&ex->mu);
    uint64_t done = ex->done;
    pthread_mutex_unlock(&ex->mu);
    PyObject *out = PyList_New((Py_ssize_t)(done - ex->head));
    if (out == NULL)
        return NULL;
    Py_ssize_t i = 0;
    while (ex->head < done) {
        Slot *s = &ex->slots[ex->head % ex->cap];
        PyObject *t = Py_BuildValue("(LLL)", (long long)s->cpu_ns, (long long)s->start_ns, (long long)s->end_ns);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i++, t);
        release_slot(s);
        ex->head++;
    }
    return out;
}

static PyObject *
Executor_close(Executor *ex, PyObject *Py_UNUSED(ignored))
{
    executor_stop(ex);
    Py_RETURN_NONE;
}

static PyObject *
Executor_get_pending(Executor *ex, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(ex->tail - ex->head);
}

static PyObject *
Executor_get_running(Executor *ex, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&ex->mu);
    uint64_t n = ex->tail - ex->done;
    pthread_mutex_unlock(&ex->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyObject *
Executor_get_tid(Executor *ex, void *Py_UNUSED(closure))
{
    if (!ex->running)
        Py_RETURN_NONE;
    return PyLong_FromLong((long)ex->tid);
}

static PyObject *
Executor_get_ring(Executor *ex, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(ex->cap);
}

static PyObject *
Executor_get_launched(Executor *ex, void *Py_UNUSED(closure))
{
    return PyLong_FromUnsignedLongLong(ex->launched_total);
}

static PyObject *
Executor_get_wakes(Executor *ex, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&ex->mu);
    uint64_t n = ex->wakes;
    pthread_mutex_unlock(&ex->mu);
    return PyLong_FromUnsignedLongLong(n);
}

static PyMethodDef Executor_methods[] = {
    {"sgemm", (PyCFunction)Executor_sgemm, METH_VARARGS, sgemm_doc},
    {"sgemm_gated", (PyCFunction)Executor_sgemm_gated, METH_VARARGS, sgemm_gated_doc},
    {"gate_resolve", (PyCFunction)Executor_gate_resolve, METH_VARARGS, gate_resolve_doc},
    {"withdraw", (PyCFunction)Executor_withdraw, METH_VARARGS, withdraw_doc},
    {"wait", (PyCFunction)Executor_wait, METH_VARARGS, wait_doc},
    {"collect", (PyCFunction)Executor_collect, METH_NOARGS, collect_doc},
    {"close", (PyCFunction)Executor_close, METH_NOARGS,
     "close() -> None\n\nStop the thread once every launched chunk ran (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyObject *
Executor_get_gated(Executor *ex, void *Py_UNUSED(closure))
{
    pthread_mutex_lock(&ex->mu);
    PyObject *t = Py_BuildValue("(KKK)", (unsigned long long)ex->gated_total, (unsigned long long)ex->gate_cas_won,
                                (unsigned long long)ex->gate_cancelled);
    pthread_mutex_unlock(&ex->mu);
    return t;
}

static PyGetSetDef Executor_getset[] = {
    {"gated", (getter)Executor_get_gated, NULL,
     "(gated launches, those whose lease the executor took with its own CAS, those cancelled)", NULL},
    {"pending", (getter)Executor_get_pending, NULL, "chunks launched and not collected", NULL},
    {"running", (getter)Executor_get_running, NULL, "chunks launched and not yet run", NULL},
    {"tid", (getter)Executor_get_tid, NULL, "the executor thread's native id (None: closed)", NULL},
    {"ring", (getter)Executor_get_ring, NULL, "the most chunks launched and not collected", NULL},
    {"launched", (getter)Executor_get_launched, NULL, "chunks launched, all told", NULL},
    {"wakes", (getter)Executor_get_wakes, NULL, "times the executor woke the drivers waiting in wait()", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ExecutorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "worker._stubexec.Executor",
    .tp_basicsize = sizeof(Executor),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Executor(sgemm, ilp64=True, ring=16): a thread running launched GEMM chunks in order"),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Executor_init,
    .tp_dealloc = (destructor)Executor_dealloc,
    .tp_methods = Executor_methods,
    .tp_getset = Executor_getset,
};

static struct PyModuleDef stubexec_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "worker._stubexec",
    .m_doc = "The stub backend's device: a thread outside Python running launched GEMM chunks back to back.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__stubexec(void)
{
    if (PyType_Ready(&ExecutorType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&stubexec_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&ExecutorType);
    if (PyModule_AddObject(m, "Executor", (PyObject *)&ExecutorType) < 0) {
        Py_DECREF(&ExecutorType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
