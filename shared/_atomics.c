/*
 * shared._atomics - lock-free quota counters on a shared-memory buffer.
 *
 * Why C: a quota check sits on every allocation of every tenant, from several
 * processes at once (the supervisor and each worker instance of a tenant). A
 * CAS loop must read the limit, check, and write in one atomic step, which
 * pure Python cannot do on shared memory; and the call must cost about as much
 * as calling any C function from Python, because a Python-level wrapper costs
 * as much again (measured: see docs/PERFORMANCE.md).
 *
 * A *counter line* is 64 bytes (one cache line) at an 8-aligned offset:
 *
 *     +0   used        bytes currently consumed
 *     +8   limit       refuse when used + n > limit (UINT64_MAX = no limit)
 *     +16  high_water  largest value `used` ever reached
 *     +24  refusals    consumes refused (over the limit or overflow)
 *     +32  underflows  releases larger than `used` (clamped to 0)
 *     +40  reserved
 *
 * The limit is read from the line inside the CAS loop, never passed in, so an
 * administrator can change it at run time from another process.
 *
 * Two shapes of the same operations:
 *   - module functions taking (buffer, offset, n): the general form, used by
 *     the supervisor for snapshots and limit changes;
 *   - the Counter type, bound once to (buffer, offset) with the callbacks that
 *     build typed errors: QuotaBlock exposes its bound methods directly, so
 *     the hot path is one C call with no Python frame. A Counter may also
 *     keep a *mirror*: one worker instance's share of the line (added on
 *     consume, subtracted saturating on release), which the supervisor
 *     reclaims when that instance dies while the others keep running
 *     (the device budget's slots). Its two steps leave a window on SIGKILL;
 *   - the ShareCounter type: a tenant's counter whose total is the sum of
 *     per-instance share words, so a dead instance's share is reclaimed
 *     exactly (QuotaBlock's CPU and GPU counters; see its comment below).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define F_USED 0
#define F_LIMIT 1
#define F_HIGH_WATER 2
#define F_REFUSALS 3
#define F_UNDERFLOWS 4
#define COUNTER_FIELDS 5
#define COUNTER_SPAN ((Py_ssize_t)(COUNTER_FIELDS * sizeof(uint64_t)))

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define CAS(p, expected, desired) \
    __atomic_compare_exchange_n((p), (expected), (desired), 1, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
#define FETCH_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)

/* ------------------------------------------------------------------ core */

/* Returns 1 when consumed; 0 when refused, with the observed used/limit. */
static inline int
core_consume(uint64_t *line, uint64_t n, uint64_t *seen_used, uint64_t *seen_limit)
{
    uint64_t cur = LOAD(&line[F_USED]);
    uint64_t next;
    for (;;) {
        uint64_t limit = LOAD(&line[F_LIMIT]);
        next = cur + n;
        if (next < cur || next > limit) {
            FETCH_ADD(&line[F_REFUSALS], 1);
            *seen_used = cur;
            *seen_limit = limit;
            return 0;
        }
        if (CAS(&line[F_USED], &cur, next)) {
            break;
        }
    }
    uint64_t hw = LOAD(&line[F_HIGH_WATER]);
    while (next > hw && !CAS(&line[F_HIGH_WATER], &hw, next)) {
    }
    return 1;
}

/* Saturating subtract. Returns 1 on an underflow (n > used; clamped to 0). */
static inline int
core_release(uint64_t *line, uint64_t n, uint64_t *seen_used)
{
    uint64_t cur = LOAD(&line[F_USED]);
    uint64_t next;
    do {
        next = n > cur ? 0 : cur - n;
    } while (!CAS(&line[F_USED], &cur, next));
    if (n > cur) {
        FETCH_ADD(&line[F_UNDERFLOWS], 1);
        *seen_used = cur;
        return 1;
    }
    return 0;
}

/* ------------------------------------------------------- argument checks */

/* Fast path: an exact int (never a bool) small enough for one internal
 * digit and not negative, read without a call into the runtime; 0 when the
 * general path must decide. Offsets and typical amounts take this path; it
 * saves a few of the ~20 ns an operation costs (see docs/PERFORMANCE.md). */
static inline int
small_nonneg(PyObject *obj, uint64_t *out)
{
    if (!PyLong_CheckExact(obj)) {
        return 0;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)obj)) {
        Py_ssize_t v = PyUnstable_Long_CompactValue((PyLongObject *)obj);
        if (v >= 0) {
            *out = (uint64_t)v;
            return 1;
        }
    }
#else
    Py_ssize_t size = Py_SIZE(obj);
    if (size == 0) {
        *out = 0;
        return 1;
    }
    if (size == 1) {
        *out = ((PyLongObject *)obj)->ob_digit[0];
        return 1;
    }
#endif
    return 0;
}

/* A byte count: an int (not bool) in [0, 2**63). Returns -1 with an error set. */
static int
parse_amount(PyObject *obj, const char *what, uint64_t *out)
{
    if (small_nonneg(obj, out)) {
        return 0;
    }
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow > 0) {
        PyErr_Format(PyExc_ValueError, "%s must be below 2**63", what);
        return -1;
    }
    if (overflow < 0 || v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", what);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
parse_offset(PyObject *off_obj, Py_ssize_t *off)
{
    uint64_t small;
    if (small_nonneg(off_obj, &small)) {
        *off = (Py_ssize_t)small; /* one internal digit: < 2**30 */
        return 0;
    }
    if (!PyLong_Check(off_obj) || PyBool_Check(off_obj)) {
        PyErr_Format(PyExc_TypeError, "offset must be an int, not %.100s", Py_TYPE(off_obj)->tp_name);
        return -1;
    }
    *off = PyLong_AsSsize_t(off_obj);
    if (*off == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            /* Same error type as any other out-of-bounds offset. */
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "offset out of bounds");
        }
        return -1;
    }
    return 0;
}

/* The aligned, in-bounds region of `span` bytes at `off` in `view`, or NULL
 * with an error set. */
static uint64_t *
region_in(const Py_buffer *view, Py_ssize_t off, Py_ssize_t span)
{
    if (off < 0 || off % 8 != 0 || off > view->len - span) {
        PyErr_Format(PyExc_ValueError,
                     "offset %zd out of bounds or not 8-aligned (buffer of %zd bytes, %zd needed)",
                     off, view->len, span);
        return NULL;
    }
    char *p = (char *)view->buf + off;
    if (((uintptr_t)p) % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "buffer address is not 8-aligned");
        return NULL;
    }
    return (uint64_t *)p;
}

/* Acquire `obj` as a buffer (an export held until the caller releases
 * `view`) and return the region of `span` bytes at `off_obj`. For the
 * Counter, which keeps its line for its whole life. */
static uint64_t *
get_region(PyObject *obj, PyObject *off_obj, Py_ssize_t span, int writable, Py_buffer *view)
{
    Py_ssize_t off;
    if (parse_offset(off_obj, &off) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    uint64_t *p = region_in(view, off, span);
    if (p == NULL) {
        PyBuffer_Release(view);
    }
    return p;
}

/* A region for the duration of one module-function call. */
typedef struct {
    Py_buffer view;
    int held; /* an export was taken: release it */
} Region;

static inline void
region_release(Region *r)
{
    if (r->held) {
        PyBuffer_Release(&r->view);
    }
}

/* Like get_region, for one call. A memoryview (what every caller passes:
 * SharedMemory.buf) is read in place instead of taking and releasing an
 * export, which is a third of the cost of a call. That is safe because the
 * GIL is held for the whole operation and no Python code runs before the
 * pointer's last use, so nothing can release the view meanwhile. The checks
 * are the ones PyObject_GetBuffer would make, with the same errors. */
static uint64_t *
peek_region(PyObject *obj, PyObject *off_obj, Py_ssize_t span, int writable, Region *r)
{
    Py_ssize_t off;
    r->held = 0;
    if (parse_offset(off_obj, &off) < 0) {
        return NULL;
    }
#if defined(_Py_MEMORYVIEW_RELEASED) && defined(_Py_MEMORYVIEW_C)
    if (Py_IS_TYPE(obj, &PyMemoryView_Type)) {
        PyMemoryViewObject *mv = (PyMemoryViewObject *)obj;
        if (mv->flags & _Py_MEMORYVIEW_RELEASED) {
            PyErr_SetString(PyExc_ValueError, "operation forbidden on released memoryview object");
            return NULL;
        }
        if (writable && mv->view.readonly) {
            PyErr_SetString(PyExc_BufferError, "memoryview: underlying buffer is not writable");
            return NULL;
        }
        if (!(mv->flags & _Py_MEMORYVIEW_C)) {
            PyErr_SetString(PyExc_BufferError, "memoryview: underlying buffer is not C-contiguous");
            return NULL;
        }
        return region_in(&mv->view, off, span);
    }
#endif /* else: a CPython without these flags always takes an export */
    if (PyObject_GetBuffer(obj, &r->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    r->held = 1;
    uint64_t *p = region_in(&r->view, off, span);
    if (p == NULL) {
        region_release(r);
    }
    return p;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------ module functions */

/* consume/release's (buffer, offset, n): the counter line and n, or NULL with
 * an error set. Inline: the raw call is what `twt bench quota` measures. */
static inline uint64_t *
line_args(const char *name, PyObject *const *args, Py_ssize_t nargs, uint64_t *n, Region *view)
{
    if (check_nargs(name, nargs, 3) < 0 || parse_amount(args[2], "n", n) < 0) {
        return NULL;
    }
    return peek_region(args[0], args[1], COUNTER_SPAN, 1, view);
}

PyDoc_STRVAR(consume_doc,
"consume(buffer, offset, n) -> None | tuple[int, int]\n\n"
"Add n to the counter line at offset unless used + n would exceed its limit\n"
"(or overflow). Returns None on success; on refusal nothing is added, the\n"
"refusal is counted and (used, limit) as observed is returned.");

static PyObject *
mod_consume(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    uint64_t n, used, limit;
    Region view;
    uint64_t *line = line_args("consume", args, nargs, &n, &view);
    if (line == NULL) {
        return NULL;
    }
    int ok = core_consume(line, n, &used, &limit);
    region_release(&view);
    if (ok) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(KK)", (unsigned long long)used, (unsigned long long)limit);
}

PyDoc_STRVAR(release_doc,
"release(buffer, offset, n) -> None | int\n\n"
"Subtract n from the counter line at offset, saturating at 0. Returns None,\n"
"or on an underflow (n > used) the used value found; the underflow is counted.");

static PyObject *
mod_release(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    uint64_t n, used;
    Region view;
    uint64_t *line = line_args("release", args, nargs, &n, &view);
    if (line == NULL) {
        return NULL;
    }
    int under = core_release(line, n, &used);
    region_release(&view);
    if (!under) {
        Py_RETURN_NONE;
    }
    return PyLong_FromUnsignedLongLong(used);
}

PyDoc_STRVAR(load_doc, "load(buffer, offset) -> int\n\nAtomic load of the uint64 at offset.");

static PyObject *
mod_load(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    if (check_nargs("load", nargs, 2) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 0, &view);
    if (p == NULL) {
        return NULL;
    }
    uint64_t v = LOAD(p);
    region_release(&view);
    return PyLong_FromUnsignedLongLong(v);
}

/* A uint64 value for store(): any int in [0, 2**64). */
static int
parse_u64(PyObject *obj, uint64_t *out)
{
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "value must be an int, not %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "value must be in [0, 2**64)");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* store/fetch_add/exchange's (buffer, offset, value): the writable word and
 * the value, or NULL with an error set. */
static uint64_t *
word_args(const char *name, PyObject *const *args, Py_ssize_t nargs, uint64_t *v, Region *view)
{
    if (check_nargs(name, nargs, 3) < 0 || parse_u64(args[2], v) < 0) {
        return NULL;
    }
    return peek_region(args[0], args[1], 8, 1, view);
}

PyDoc_STRVAR(store_doc, "store(buffer, offset, value) -> None\n\nAtomic store of a uint64 at offset.");

static PyObject *
mod_store(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    uint64_t v, *p = word_args("store", args, nargs, &v, &view);
    if (p == NULL) {
        return NULL;
    }
    STORE(p, v);
    region_release(&view);
    Py_RETURN_NONE;
}

/* fetch_add and exchange: one read-modify-write of the word; the old value. */
static PyObject *
word_swap(const char *name, int exchange, PyObject *const *args, Py_ssize_t nargs)
{
    Region view;
    uint64_t v, *p = word_args(name, args, nargs, &v, &view);
    if (p == NULL) {
        return NULL;
    }
    uint64_t old = exchange ? __atomic_exchange_n(p, v, __ATOMIC_ACQ_REL) : FETCH_ADD(p, v);
    region_release(&view);
    return PyLong_FromUnsignedLongLong(old);
}

PyDoc_STRVAR(fetch_add_doc,
"fetch_add(buffer, offset, n) -> int\n\nAtomically add n (wrapping) to the uint64 at offset; return the old value.");

static PyObject *
mod_fetch_add(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    return word_swap("fetch_add", 0, args, nargs);
}

PyDoc_STRVAR(exchange_doc,
"exchange(buffer, offset, value) -> int\n\nAtomically replace the uint64 at offset; return the old value.");

static PyObject *
mod_exchange(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    return word_swap("exchange", 1, args, nargs);
}

PyDoc_STRVAR(noop_doc,
"noop(buffer, offset, n) -> None\n\nDoes nothing: the floor an extension call costs, for benchmarks.");

static PyObject *
mod_noop(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    (void)args;
    (void)nargs;
    Py_RETURN_NONE;
}

/* ------------------------------------------------- the bound counter types */

/*
 * Counter and ShareCounter (below) are one kind of object with two layouts:
 * both hold a buffer export for their whole life, a counter line in it, and
 * the callbacks that build typed errors. That part is CounterHead, the first
 * member of both, and everything that only touches it is written once here:
 * GC support, close/closed, the closed check, argument parsing and raising
 * the callbacks' errors. Each type adds its layout, its init, and its
 * consume/release/load. The helpers on the hot path are `static inline`: a
 * consume compiles to the same code as when each type had its own copy
 * (the head's fields sit at fixed offsets; there is no extra pointer).
 */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    uint64_t *line;         /* the counter line (ShareCounter: its used field is not used) */
    PyObject *on_refuse;    /* (n, used, limit) -> BaseException instance */
    PyObject *on_underflow; /* (n, used) -> object (ignored) */
    PyObject *on_closed;    /* () -> BaseException instance */
} CounterHead;

/* The checks every init makes before touching the buffer. */
static int
head_check_init(CounterHead *self, const char *type_name, PyObject *refuse, PyObject *under, PyObject *closed)
{
    if (!PyCallable_Check(refuse) || !PyCallable_Check(under) || !PyCallable_Check(closed)) {
        PyErr_SetString(PyExc_TypeError, "on_refuse, on_underflow and on_closed must be callable");
        return -1;
    }
    if (self->has_view) {
        PyErr_Format(PyExc_RuntimeError, "%s is already initialised", type_name);
        return -1;
    }
    return 0;
}

/* The end of a successful init: self->view holds the export, `line` is in it. */
static void
head_bind(CounterHead *self, uint64_t *line, PyObject *refuse, PyObject *under, PyObject *closed)
{
    self->line = line;
    self->has_view = 1;
    Py_INCREF(refuse);
    Py_XSETREF(self->on_refuse, refuse);
    Py_INCREF(under);
    Py_XSETREF(self->on_underflow, under);
    Py_INCREF(closed);
    Py_XSETREF(self->on_closed, closed);
}

/* Release the export; every pointer into it is cleared, the type's own ones
 * too (both types are final, so tp_basicsize is exactly their struct). */
static void
head_release_view(CounterHead *self)
{
    if (self->has_view) {
        self->has_view = 0;
        self->line = NULL;
        memset((char *)self + sizeof(CounterHead), 0, (size_t)Py_TYPE(self)->tp_basicsize - sizeof(CounterHead));
        PyBuffer_Release(&self->view);
    }
}

static int
head_traverse(CounterHead *self, visitproc visit, void *arg)
{
    Py_VISIT(self->on_refuse);
    Py_VISIT(self->on_underflow);
    Py_VISIT(self->on_closed);
    if (self->has_view) {
        Py_VISIT(self->view.obj);
    }
    return 0;
}

static int
head_clear(CounterHead *self)
{
    Py_CLEAR(self->on_refuse);
    Py_CLEAR(self->on_underflow);
    Py_CLEAR(self->on_closed);
    head_release_view(self);
    return 0;
}

static void
head_dealloc(CounterHead *self)
{
    PyObject_GC_UnTrack(self);
    head_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Raise the exception instance a callback returned. */
static PyObject *
raise_from_callback(PyObject *exc)
{
    if (exc == NULL) {
        return NULL;
    }
    if (!PyExceptionInstance_Check(exc)) {
        PyErr_Format(PyExc_TypeError, "error callback returned %.100s, not an exception",
                     Py_TYPE(exc)->tp_name);
        Py_DECREF(exc);
        return NULL;
    }
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *
head_closed_error(CounterHead *self)
{
    if (self->on_closed == NULL) {
        PyErr_SetString(PyExc_ValueError, "counter is closed");
        return NULL;
    }
    return raise_from_callback(PyObject_CallNoArgs(self->on_closed));
}

/* consume/release's one argument, on an open counter: 0, or -1 with an error set. */
static inline int
head_amount(CounterHead *self, const char *name, PyObject *const *args, Py_ssize_t nargs, uint64_t *n)
{
    if (check_nargs(name, nargs, 1) < 0 || parse_amount(args[0], "n", n) < 0) {
        return -1;
    }
    if (!self->has_view) {
        head_closed_error(self);
        return -1;
    }
    return 0;
}

/* load() takes no argument, on an open counter: 0, or -1 with an error set. */
static int
head_no_args(CounterHead *self, Py_ssize_t nargs)
{
    if (check_nargs("load", nargs, 0) < 0) {
        return -1;
    }
    if (!self->has_view) {
        head_closed_error(self);
        return -1;
    }
    return 0;
}

/* A refused consume: raise on_refuse(n, used, limit). */
static PyObject *
head_refuse(CounterHead *self, PyObject *n_obj, uint64_t used, uint64_t limit)
{
    PyObject *exc = PyObject_CallFunction(self->on_refuse, "OKK", n_obj, (unsigned long long)used,
                                          (unsigned long long)limit);
    return raise_from_callback(exc);
}

/* A release of more than was held: tell on_underflow(n, used), return None. */
static PyObject *
head_underflow(CounterHead *self, PyObject *n_obj, uint64_t used)
{
    PyObject *r = PyObject_CallFunction(self->on_underflow, "OK", n_obj, (unsigned long long)used);
    if (r == NULL) {
        return NULL;
    }
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static PyObject *
head_close(CounterHead *self, PyObject *Py_UNUSED(ignored))
{
    head_release_view(self);
    Py_RETURN_NONE;
}

static PyObject *
head_get_closed(CounterHead *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(!self->has_view);
}

static PyGetSetDef head_getset[] = {
    {"closed", (getter)head_get_closed, NULL, "True once close() was called.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* A counter type's method table: its consume/release/load, and the shared close. */
#define COUNTER_METHODS(prefix, consume_doc, release_doc, load_doc)                                \
    {                                                                                              \
        {"consume", (PyCFunction)(void (*)(void))prefix##_consume, METH_FASTCALL, consume_doc},   \
        {"release", (PyCFunction)(void (*)(void))prefix##_release, METH_FASTCALL, release_doc},   \
        {"load", (PyCFunction)(void (*)(void))prefix##_load, METH_FASTCALL, load_doc},            \
        {"close", (PyCFunction)head_close, METH_NOARGS, "Release the buffer; later calls raise on_closed()."}, \
        {NULL, NULL, 0, NULL},                                                                     \
    }

/* A counter type: its name, doc, struct, init and methods; the head's GC and getset. */
#define COUNTER_TYPE(name, doc, object, init, methods)                                             \
    {                                                                                              \
        PyVarObject_HEAD_INIT(NULL, 0)                                                             \
        .tp_name = "shared._atomics." name,                                                        \
        .tp_doc = PyDoc_STR(doc),                                                                  \
        .tp_basicsize = sizeof(object),                                                            \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,                                       \
        .tp_new = PyType_GenericNew,                                                               \
        .tp_init = (initproc)(init),                                                               \
        .tp_dealloc = (destructor)head_dealloc,                                                    \
        .tp_traverse = (traverseproc)head_traverse,                                                \
        .tp_clear = (inquiry)head_clear,                                                           \
        .tp_methods = (methods),                                                                   \
        .tp_getset = head_getset,                                                                  \
    }

/* ---------------------------------------------------------- Counter type */

typedef struct {
    CounterHead head;
    uint64_t *mirror; /* optional per-instance share, or NULL */
} CounterObject;

static int
counter_init(CounterObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "offset", "on_refuse", "on_underflow", "on_closed",
                             "mirror_offset", NULL};
    PyObject *buf, *off, *refuse, *under, *closed, *mirror_off = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|O:Counter", kwlist, &buf, &off, &refuse,
                                     &under, &closed, &mirror_off)) {
        return -1;
    }
    if (head_check_init(&self->head, "Counter", refuse, under, closed) < 0) {
        return -1;
    }
    uint64_t *line = get_region(buf, off, COUNTER_SPAN, 1, &self->head.view);
    if (line == NULL) {
        return -1;
    }
    self->mirror = NULL;
    if (mirror_off != Py_None) {
        Py_buffer probe;
        uint64_t *m = get_region(buf, mirror_off, 8, 1, &probe);
        if (m == NULL) {
            PyBuffer_Release(&self->head.view);
            return -1;
        }
        /* Same exporter, same mapping: the pointer stays valid while self->head.view is held. */
        PyBuffer_Release(&probe);
        self->mirror = m;
    }
    head_bind(&self->head, line, refuse, under, closed);
    return 0;
}

static PyObject *
counter_consume(CounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n, used, limit;
    if (head_amount(&self->head, "consume", args, nargs, &n) < 0) {
        return NULL;
    }
    if (core_consume(self->head.line, n, &used, &limit)) {
        if (self->mirror != NULL) {
            FETCH_ADD(self->mirror, n);
        }
        Py_RETURN_NONE;
    }
    return head_refuse(&self->head, args[0], used, limit);
}

static PyObject *
counter_release(CounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n, used;
    if (head_amount(&self->head, "release", args, nargs, &n) < 0) {
        return NULL;
    }
    int under = core_release(self->head.line, n, &used);
    if (self->mirror != NULL) {
        /* The instance's share shrinks by what was really released, saturating. */
        uint64_t released = under ? used : n;
        uint64_t cur = LOAD(self->mirror), next;
        do {
            next = released > cur ? 0 : cur - released;
        } while (!CAS(self->mirror, &cur, next));
    }
    if (!under) {
        Py_RETURN_NONE;
    }
    return head_underflow(&self->head, args[0], used);
}

static PyObject *
counter_load(CounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (head_no_args(&self->head, nargs) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(LOAD(&self->head.line[F_USED]));
}

static PyMethodDef counter_methods[] = COUNTER_METHODS(
    counter, "consume(n) -> None; raises on_refuse(n, used, limit) when over the limit.",
    "release(n) -> None; calls on_underflow(n, used) when n > used (clamped to 0).", "load() -> int: bytes in use.");

static PyTypeObject CounterType = COUNTER_TYPE(
    "Counter",
    "Counter(buffer, offset, on_refuse, on_underflow, on_closed, mirror_offset=None)\n\n"
    "A counter line bound to a writable buffer; the fast path of QuotaBlock.",
    CounterObject, counter_init, counter_methods);

/* ------------------------------------------------------ ShareCounter type */

/*
 * A tenant's counter whose total is *derived*: every holder (a worker
 * instance, or the block's unattributed slot) owns one share word, and the
 * tenant's use is the sum of the share words. Reclaiming a dead instance is
 * then one exchange of its share to 0, exact whatever instruction the
 * SIGKILL hit: there is no second word that may or may not have been
 * updated (the two-step tenant-counter-then-mirror scheme lost or doubled one
 * allocation when killed between its steps).
 *
 * consume(n), Dekker style (every step sequentially consistent):
 *     publish:  share += n                (a CAS loop: refused without a write on overflow)
 *     check:    total = sum(all shares)   (includes ours and every other published share)
 *               total <= limit ? granted  (high water raised to total)
 *     else:     share -= n                (withdraw), others = sum(all shares)
 *               others + n > limit ? refused : retry (a concurrent publish was in the way)
 * Two consumes cannot both be granted past the limit: whichever sums second
 * sees the other's published share. A consume can be refused because of
 * another's *tentative* share only after SHARE_RETRIES withdrawals in a row.
 * The share slots in use are [0, nslots) plus the extra slot; an instance
 * raises nslots to cover its slot before its first publish.
 * Checked by tests/helpers/quota_share_model.py (every interleaving, with a
 * kill at every step and the supervisor's reclaim).
 */

#define SHARE_RETRIES 16
#define LOAD_SC(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define CAS_SC(p, expected, desired) \
    __atomic_compare_exchange_n((p), (expected), (desired), 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)

typedef struct {
    CounterHead head;  /* head.line: limit, high water, refusals, underflows */
    uint64_t *shares;  /* share word of slot 0; slot i at shares[i * stride] */
    Py_ssize_t stride; /* in uint64 words */
    uint64_t *nslots;  /* slots [0, *nslots) may hold bytes */
    Py_ssize_t extra;  /* a slot always summed (the unattributed one) */
    uint64_t *mine;    /* this holder's share word */
} ShareCounterObject;

/* Sum of every share; 0 on overflow (then *total is meaningless). */
static inline int
share_sum(ShareCounterObject *self, uint64_t *total)
{
    uint64_t n = LOAD_SC(self->nslots);
    uint64_t sum = 0;
    Py_ssize_t extra = self->extra;
    int extra_done = 0;
    for (uint64_t i = 0; i < n; i++) {
        uint64_t v = LOAD_SC(&self->shares[(Py_ssize_t)i * self->stride]);
        if ((Py_ssize_t)i == extra) {
            extra_done = 1;
        }
        if (sum + v < sum) {
            return 0;
        }
        sum += v;
    }
    if (!extra_done) {
        uint64_t v = LOAD_SC(&self->shares[extra * self->stride]);
        if (sum + v < sum) {
            return 0;
        }
        sum += v;
    }
    *total = sum;
    return 1;
}

/* Saturating subtract from a share word; returns the value found before. */
static inline uint64_t
share_sub(uint64_t *p, uint64_t n)
{
    uint64_t cur = LOAD_SC(p), next;
    do {
        next = n > cur ? 0 : cur - n;
    } while (!CAS_SC(p, &cur, next));
    return cur;
}

/* 1 granted; 0 refused with what was seen. */
static int
share_consume(ShareCounterObject *self, uint64_t n, uint64_t *seen_used, uint64_t *seen_limit)
{
    uint64_t *line = self->head.line;
    for (int attempt = 0;; attempt++) {
        uint64_t cur = LOAD_SC(self->mine);
        for (;;) {
            if (cur + n < cur) { /* our own share would wrap: never publish that */
                FETCH_ADD(&line[F_REFUSALS], 1);
                *seen_used = cur;
                *seen_limit = LOAD(&line[F_LIMIT]);
                return 0;
            }
            if (CAS_SC(self->mine, &cur, cur + n)) {
                break;
            }
        }
        uint64_t total, limit = 0;
        int fits = share_sum(self, &total);
        if (fits) {
            limit = LOAD_SC(&line[F_LIMIT]);
            fits = total <= limit;
        }
        if (fits) {
            uint64_t hw = LOAD(&line[F_HIGH_WATER]);
            while (total > hw && !CAS(&line[F_HIGH_WATER], &hw, total)) {
            }
            return 1;
        }
        share_sub(self->mine, n); /* withdraw */
        uint64_t others;
        int others_ok = share_sum(self, &others);
        limit = LOAD_SC(&line[F_LIMIT]);
        if (!others_ok || others + n < others || others + n > limit || attempt + 1 >= SHARE_RETRIES) {
            FETCH_ADD(&line[F_REFUSALS], 1);
            *seen_used = others_ok ? others : UINT64_MAX;
            *seen_limit = limit;
            return 0;
        }
        /* another holder's tentative share was in the way: try again */
    }
}

static int
share_counter_init(ShareCounterObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "line_offset", "shares_offset", "stride", "nslots_offset", "slot",
                             "extra_slot", "on_refuse", "on_underflow", "on_closed", NULL};
    PyObject *buf, *line_off, *refuse, *under, *closed;
    Py_ssize_t shares_off, stride, nslots_off, slot, extra;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOnnnnnOOO:ShareCounter", kwlist, &buf, &line_off,
                                     &shares_off, &stride, &nslots_off, &slot, &extra, &refuse, &under,
                                     &closed)) {
        return -1;
    }
    if (head_check_init(&self->head, "ShareCounter", refuse, under, closed) < 0) {
        return -1;
    }
    if (stride <= 0 || stride % 8 != 0 || slot < 0 || extra < 0 || shares_off < 0 || nslots_off < 0) {
        PyErr_SetString(PyExc_ValueError, "bad share layout");
        return -1;
    }
    Py_buffer *view = &self->head.view;
    uint64_t *line = get_region(buf, line_off, COUNTER_SPAN, 1, view);
    if (line == NULL) {
        return -1;
    }
    Py_ssize_t last = (slot > extra ? slot : extra);
    char *base = (char *)view->buf;
    if (shares_off % 8 != 0 || nslots_off % 8 != 0 || nslots_off > view->len - 8 ||
        last > (view->len - 8 - shares_off) / stride || shares_off > view->len - 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "share layout out of bounds");
        return -1;
    }
    self->shares = (uint64_t *)(base + shares_off);
    self->stride = stride / 8;
    self->nslots = (uint64_t *)(base + nslots_off);
    self->extra = extra;
    self->mine = (uint64_t *)(base + shares_off + slot * stride);
    head_bind(&self->head, line, refuse, under, closed);
    if (slot != extra) { /* an instance: make sure every summer covers our slot before we publish */
        uint64_t want = (uint64_t)slot + 1, cur = LOAD_SC(self->nslots);
        while (cur < want && !CAS_SC(self->nslots, &cur, want)) {
        }
    }
    return 0;
}

static PyObject *
share_counter_consume(ShareCounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n, used, limit;
    if (head_amount(&self->head, "consume", args, nargs, &n) < 0) {
        return NULL;
    }
    if (share_consume(self, n, &used, &limit)) {
        Py_RETURN_NONE;
    }
    return head_refuse(&self->head, args[0], used, limit);
}

static PyObject *
share_counter_release(ShareCounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint64_t n;
    if (head_amount(&self->head, "release", args, nargs, &n) < 0) {
        return NULL;
    }
    uint64_t had = share_sub(self->mine, n);
    if (n <= had) {
        Py_RETURN_NONE;
    }
    FETCH_ADD(&self->head.line[F_UNDERFLOWS], 1);
    return head_underflow(&self->head, args[0], had);
}

static PyObject *
share_counter_load(ShareCounterObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    if (head_no_args(&self->head, nargs) < 0) {
        return NULL;
    }
    uint64_t total;
    if (!share_sum(self, &total)) {
        total = UINT64_MAX;
    }
    return PyLong_FromUnsignedLongLong(total);
}

static PyMethodDef share_counter_methods[] = COUNTER_METHODS(
    share_counter,
    "consume(n) -> None; raises on_refuse(n, used, limit) when the sum of shares would exceed the limit.",
    "release(n) -> None; calls on_underflow(n, share) when n > this holder's share (clamped to 0).",
    "load() -> int: the sum of shares.");

static PyTypeObject ShareCounterType = COUNTER_TYPE(
    "ShareCounter",
    "ShareCounter(buffer, line_offset, shares_offset, stride, nslots_offset, slot, extra_slot,\n"
    "             on_refuse, on_underflow, on_closed)\n\n"
    "A counter whose total is the sum of per-holder shares; this holder owns `slot`.",
    ShareCounterObject, share_counter_init, share_counter_methods);

/* ------------------------------------------- GPU-time leases (shared.gpu_time) */

PyDoc_STRVAR(compare_exchange_doc,
"compare_exchange(buffer, offset, expected, desired) -> bool\n\n"
"Atomically replace the uint64 at offset with desired if it equals expected;\n"
"True when replaced (the device lease word of shared.gpu_time).");

static PyObject *
mod_compare_exchange(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    uint64_t expected, desired;
    if (check_nargs("compare_exchange", nargs, 4) < 0 || parse_u64(args[2], &expected) < 0 ||
        parse_u64(args[3], &desired) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    int ok = __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    region_release(&view);
    return PyBool_FromLong(ok);
}

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

PyDoc_STRVAR(futex_wait_doc,
"futex_wait(buffer, offset, expected, timeout_ns) -> None\n\n"
"Sleep (GIL released) while the low 32 bits of the uint64 at offset equal\n"
"expected, at most timeout_ns; returns early on a futex_wake of that word, a\n"
"change of value or a signal. Without futexes (not Linux) it sleeps the timeout\n"
"(capped at 1 ms). Waiters re-check their condition after it returns.");

/* Sleep on the low half of the word at p (a little-endian word: what a waker changes together
   with the word) while it holds `expected`, at most timeout_ns; woken by a wake whose bits share
   one with `bits` (all ones: every wake, as a plain FUTEX_WAIT). Without futexes: a sleep of at most 1 ms. */
static void
futex_sleep(uint64_t *p, uint64_t expected, uint64_t timeout_ns, uint32_t bits)
{
#ifdef __linux__
    uint32_t *word = (uint32_t *)(void *)p;
    Py_BEGIN_ALLOW_THREADS
    /* FUTEX_WAIT_BITSET's timeout is absolute, on CLOCK_MONOTONIC */
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + timeout_ns % 1000000000u;
    ts.tv_sec += (time_t)(timeout_ns / 1000000000u + ns / 1000000000u);
    ts.tv_nsec = (long)(ns % 1000000000u);
    syscall(SYS_futex, word, FUTEX_WAIT_BITSET, (uint32_t)expected, &ts, NULL, bits);
    Py_END_ALLOW_THREADS
#else
    (void)p;
    (void)expected;
    (void)bits;
    if (timeout_ns > 1000000u) {
        timeout_ns = 1000000u;
    }
    Py_BEGIN_ALLOW_THREADS
    usleep((useconds_t)(timeout_ns / 1000u));
    Py_END_ALLOW_THREADS
#endif
}

static PyObject *
mod_futex_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    uint64_t expected, timeout_ns;
    if (check_nargs("futex_wait", nargs, 4) < 0 || parse_u64(args[2], &expected) < 0 ||
        parse_u64(args[3], &timeout_ns) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    futex_sleep(p, expected, timeout_ns, 0xFFFFFFFFu);  /* every wake */
    region_release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(futex_wake_doc,
"futex_wake(buffer, offset) -> None\n\nWake every futex_wait on the word at offset (any process).");

static PyObject *
mod_futex_wake(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    if (check_nargs("futex_wake", nargs, 2) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
#ifdef __linux__
    syscall(SYS_futex, (uint32_t *)(void *)p, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
#endif
    region_release(&view);
    Py_RETURN_NONE;
}

/* A futex wake mask (futex_wait_bits / futex_wake_bits): a non-zero uint32. */
static int
parse_bits(PyObject *o, uint64_t *bits)
{
    if (parse_u64(o, bits) < 0) {
        return -1;
    }
    if (*bits == 0 || *bits > 0xFFFFFFFFu) {
        PyErr_SetString(PyExc_ValueError, "bits: a non-zero uint32 mask");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(futex_wait_bits_doc,
"futex_wait_bits(buffer, offset, expected, timeout_ns, bits) -> None\n\n"
"As futex_wait, woken only by a futex_wake_bits whose bits share one with `bits` (a uint32\n"
"mask, non-zero) or by a futex_wake: a waker names whom it wakes, the others sleep on.");

static PyObject *
mod_futex_wait_bits(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    uint64_t expected, timeout_ns, bits;
    if (check_nargs("futex_wait_bits", nargs, 5) < 0 || parse_u64(args[2], &expected) < 0 ||
        parse_u64(args[3], &timeout_ns) < 0 || parse_bits(args[4], &bits) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    futex_sleep(p, expected, timeout_ns, (uint32_t)bits);
    region_release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(futex_wake_bits_doc,
"futex_wake_bits(buffer, offset, bits) -> int\n\n"
"Wake the futex_wait_bits on the word at offset whose bits share one with `bits` (a non-zero uint32\n"
"mask), and every plain futex_wait on it (any process); how many were woken (0 without futexes).");

static PyObject *
mod_futex_wake_bits(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    (void)m;
    Region view;
    uint64_t bits;
    if (check_nargs("futex_wake_bits", nargs, 3) < 0 || parse_bits(args[2], &bits) < 0) {
        return NULL;
    }
    uint64_t *p = peek_region(args[0], args[1], 8, 1, &view);
    if (p == NULL) {
        return NULL;
    }
    long woken = 0;
#ifdef __linux__
    woken = syscall(SYS_futex, (uint32_t *)(void *)p, FUTEX_WAKE_BITSET, INT32_MAX, NULL, NULL, (uint32_t)bits);
    if (woken < 0) {
        woken = 0;
    }
#else
    (void)bits;
#endif
    region_release(&view);
    return PyLong_FromLong(woken);
}

/* ---------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"consume", (PyCFunction)(void (*)(void))mod_consume, METH_FASTCALL, consume_doc},
    {"release", (PyCFunction)(void (*)(void))mod_release, METH_FASTCALL, release_doc},
    {"load", (PyCFunction)(void (*)(void))mod_load, METH_FASTCALL, load_doc},
    {"store", (PyCFunction)(void (*)(void))mod_store, METH_FASTCALL, store_doc},
    {"fetch_add", (PyCFunction)(void (*)(void))mod_fetch_add, METH_FASTCALL, fetch_add_doc},
    {"exchange", (PyCFunction)(void (*)(void))mod_exchange, METH_FASTCALL, exchange_doc},
    {"noop", (PyCFunction)(void (*)(void))mod_noop, METH_FASTCALL, noop_doc},
    {"compare_exchange", (PyCFunction)(void (*)(void))mod_compare_exchange, METH_FASTCALL, compare_exchange_doc},
    {"futex_wait", (PyCFunction)(void (*)(void))mod_futex_wait, METH_FASTCALL, futex_wait_doc},
    {"futex_wake", (PyCFunction)(void (*)(void))mod_futex_wake, METH_FASTCALL, futex_wake_doc},
    {"futex_wait_bits", (PyCFunction)(void (*)(void))mod_futex_wait_bits, METH_FASTCALL, futex_wait_bits_doc},
    {"futex_wake_bits", (PyCFunction)(void (*)(void))mod_futex_wake_bits, METH_FASTCALL, futex_wake_bits_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "shared._atomics",
    .m_doc = "Lock-free quota counters (GCC/C11 atomics) on a shared-memory buffer.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&ShareCounterType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&atomics_module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&CounterType);
    Py_INCREF(&ShareCounterType);
    if (PyModule_AddObject(m, "Counter", (PyObject *)&CounterType) < 0 ||
        PyModule_AddObject(m, "ShareCounter", (PyObject *)&ShareCounterType) < 0 ||
        PyModule_AddIntConstant(m, "SHARE_RETRIES", SHARE_RETRIES) < 0 ||
        PyModule_AddIntConstant(m, "COUNTER_SPAN", COUNTER_SPAN) < 0 ||
        PyModule_AddIntConstant(m, "F_USED", F_USED * 8) < 0 ||
        PyModule_AddIntConstant(m, "F_LIMIT", F_LIMIT * 8) < 0 ||
        PyModule_AddIntConstant(m, "F_HIGH_WATER", F_HIGH_WATER * 8) < 0 ||
        PyModule_AddIntConstant(m, "F_REFUSALS", F_REFUSALS * 8) < 0 ||
        PyModule_AddIntConstant(m, "F_UNDERFLOWS", F_UNDERFLOWS * 8) < 0) {
        Py_DECREF(&CounterType);
        Py_DECREF(&ShareCounterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
