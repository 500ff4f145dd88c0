/* The two inner loops of every routing decision, compiled: the candidate set's per-worker records
 * (Balancer.candidate_set) and cache_aware's cost loop (CacheAware.choose).
 *
 * Optional: router/routing/hotloop.py imports this module if it was built and falls back to the
 * Python loops otherwise (or with PREFIXLB_PURE_PYTHON=1). Both give the same decisions: every
 * float below is the same IEEE expression, in the same order, as the Python it replaces, and
 * tests/unit/test_hotloop.py compares the two on random fleets. Anything these loops were not
 * written for -- a field that is not an exact float or int, an int past 2**53, a zero rate or block
 * size (where Python raises) -- answers NotImplemented, and the caller runs the Python loop, so
 * an unusual value gets Python's own answer or error.
 *
 * The records are slotted dataclasses (Candidate, WorkerLoad): bind() reads each field's slot
 * offset from its member descriptor once, and the loops read and write the slots directly. A
 * _DepthLookup's depths (PrefixIndex.depth_of for a worker beyond the longest matches) are read
 * from the index's dicts here, without a Python call per worker (its ``get`` where they are not
 * plain dicts and floats). PrefixIndex._match_many (a prefix more workers hold than a decision
 * scores: a shared system prompt) reads the index's dicts the same way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>

/* Python rounds after every operation: no fused multiply-add (setup.py passes -ffp-contract=off;
 * clang also honours the standard pragma, GCC only the flag). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define LAYOUT_VERSION 8

enum { C_WORKER_ID, C_TOKENS_PER_S, C_CACHED, C_PENDING, C_IN_SYSTEM, C_OVER_LIMIT, C_RING_RANK,
       C_MATCHED, C_SERVICE, C_TRANSFER, C_ADAPTER, C_FIELDS };
static const char *const CANDIDATE_FIELDS[C_FIELDS] = {
    "worker_id", "tokens_per_s", "cached_tokens", "pending_s", "in_system", "over_limit", "ring_rank",
    "matched_chunks", "service_s", "transfer_s", "adapter_s"};

enum { W_BUSY_UNTIL, W_SLOT_WAIT, W_RATE_NOW, W_IN_SYSTEM, W_OVER_LIMIT_NOW, W_SERVICE, W_BLOCK, W_HEAP_VERSION,
       W_ROUTABLE, W_PREFILL_RATE, W_DECODE_STEP, W_BATCHED, W_MAX_SEQS, W_RUNNING, W_RUNNING_TOKENS, W_CAPACITY,
       W_MAX_INFLIGHT, W_CAP, W_TICKETS, W_WORKER_ID, W_FIELDS };
static const char *const LOAD_FIELDS[W_FIELDS] = {
    "busy_until", "slot_wait_s", "rate_now", "in_system", "over_limit_now", "service_s", "block_size",
    "heap_version", "routable", "prefill_tokens_per_s", "decode_step_s", "max_num_batched_tokens", "max_num_seqs",
    "reported_running", "reported_running_tokens", "capacity_tokens", "max_inflight", "cap", "tickets", "worker_id"};

static PyTypeObject *candidate_type = NULL;
static PyTypeObject *load_type = NULL;
static Py_ssize_t candidate_off[C_FIELDS];
static Py_ssize_t load_off[W_FIELDS];
static PyObject *not_on_ring = NULL;  /* NOT_ON_RING as a Python int */
static long long not_on_ring_value = 0;
static PyObject *zero_int = NULL, *zero_float = NULL, *str_get = NULL;
static PyObject *str_index = NULL, *str_hashes = NULL, *str_now = NULL, *str_map = NULL, *str_live = NULL;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))
#define EXACT_INT_LIMIT 9007199254740992LL  /* 2**53: every int below converts to a double exactly */

/* Fill offsets[] from the slot member descriptors ``names`` of ``type``; -1 with an exception set. */
static int
read_layout(PyTypeObject *type, const char *const *names, int count, Py_ssize_t *offsets)
{
    PyObject *dict = type->tp_dict;
    for (int i = 0; i < count; i++) {
        PyObject *descr = PyDict_GetItemString(dict, names[i]);  /* borrowed */
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, names[i]);
            return -1;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        /* the type's own slot (not a descriptor borrowed from another type's layout), inside its
         * instances */
        if (PyDescr_TYPE(descr) != type || member->type != T_OBJECT_EX || (member->flags & READONLY)
                || member->offset < (Py_ssize_t)sizeof(PyObject)
                || member->offset > type->tp_basicsize - (Py_ssize_t)sizeof(PyObject *)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot of its own", type->tp_name, names[i]);
            return -1;
        }
        offsets[i] = member->offset;
    }
    return 0;
}

/* bind(Candidate, WorkerLoad, NOT_ON_RING): learn the records' layouts. */
static PyObject *
hot_bind(PyObject *self, PyObject *args)
{
    PyObject *cand, *load, *ring;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyType_Type, &cand, &PyType_Type, &load, &PyLong_Type, &ring))
        return NULL;
    Py_ssize_t coff[C_FIELDS], woff[W_FIELDS];
    if (read_layout((PyTypeObject *)cand, CANDIDATE_FIELDS, C_FIELDS, coff) < 0
            || read_layout((PyTypeObject *)load, LOAD_FIELDS, W_FIELDS, woff) < 0)
        return NULL;
    long long ring_value = PyLong_AsLongLong(ring);
    if (ring_value == -1 && PyErr_Occurred())
        return NULL;
    /* Bound once for the process: the loops hold slot offsets while they call Python code (a
     * worker id's __eq__), which must not be able to swap the layout under them. */
    if (candidate_type != NULL) {
        if ((PyTypeObject *)cand == candidate_type && (PyTypeObject *)load == load_type
                && ring_value == not_on_ring_value)
            Py_RETURN_NONE;
        PyErr_SetString(PyExc_RuntimeError, "bind(): already bound to other types");
        return NULL;
    }
    memcpy(candidate_off, coff, sizeof coff);
    memcpy(load_off, woff, sizeof woff);
    Py_INCREF(cand);
    Py_XSETREF(candidate_type, (PyTypeObject *)cand);
    Py_INCREF(load);
    Py_XSETREF(load_type, (PyTypeObject *)load);
    Py_INCREF(ring);
    Py_XSETREF(not_on_ring, ring);
    not_on_ring_value = ring_value;
    Py_RETURN_NONE;
}

/* An exact int below 2**53 in magnitude into *out; 0 if it is anything else (no exception). */
static int
small_int(PyObject *v, long long *out)
{
    if (v == NULL || !PyLong_CheckExact(v))
        return 0;
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x >= EXACT_INT_LIMIT || x <= -EXACT_INT_LIMIT) {
        PyErr_Clear();
        return 0;
    }
    *out = x;
    return 1;
}

/* An exact float into *out; 0 if it is anything else. */
static int
exact_float(PyObject *v, double *out)
{
    if (v == NULL || !PyFloat_CheckExact(v))
        return 0;
    *out = PyFloat_AS_DOUBLE(v);
    return 1;
}

/* A float or an int below 2**53 as a double (for knobs a user may give as either); 0 otherwise. */
static int
number(PyObject *v, double *out)
{
    long long i;
    if (exact_float(v, out))
        return 1;
    if (small_int(v, &i)) {
        *out = (double)i;
        return 1;
    }
    return 0;
}

/* Python's float floor division x // y (CPython's float_floor_div): the same double. */
static double
float_floor_div(double vx, double wx)
{
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    double floordiv;
    if (mod) {
        if ((wx < 0) != (mod < 0))
            div -= 1.0;
    }
    if (div) {
        floordiv = floor(div);
        if (div - floordiv > 0.5)
            floordiv += 1.0;
    }
    else {
        floordiv = copysign(0.0, vx / wx);
    }
    return floordiv;
}

static long long
int_floor_div(long long a, long long b)
{
    long long q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0)))
        q -= 1;
    return q;
}

/* A _DepthLookup's index, read directly (PrefixIndex.depth_of without a Python call per worker). */
typedef struct {
    PyObject *map;     /* index._map: chain hash -> {holder: expiry} (an OrderedDict: dict's lookup) */
    PyObject *live;    /* index._live: worker id -> its current holder */
    PyObject *hashes;  /* the prompt's chain hashes (a list) */
    double now;
} depth_reader;

static void
depth_reader_clear(depth_reader *r)
{
    Py_CLEAR(r->map);
    Py_CLEAR(r->live);
    Py_CLEAR(r->hashes);
}

/* Fill ``r`` from ``matches`` (a _DepthLookup): 1; 0, holding nothing, where its parts are not
 * what this reads or one cannot be read (then matches.get answers, and raises where Python's
 * would: only for a worker it is asked about). Holds new references (depth_reader_clear). */
static int
depth_reader_init(depth_reader *r, PyObject *matches)
{
    r->map = r->live = r->hashes = NULL;
    PyObject *index = PyObject_GetAttr(matches, str_index), *now = NULL;
    if (index != NULL) {
        r->hashes = PyObject_GetAttr(matches, str_hashes);
        now = r->hashes == NULL ? NULL : PyObject_GetAttr(matches, str_now);
        r->map = now == NULL ? NULL : PyObject_GetAttr(index, str_map);
        r->live = r->map == NULL ? NULL : PyObject_GetAttr(index, str_live);
        Py_DECREF(index);
    }
    int ok = r->live != NULL && PyList_CheckExact(r->hashes) && PyFloat_CheckExact(now)
             && (PyODict_CheckExact(r->map) || PyDict_CheckExact(r->map)) && PyDict_CheckExact(r->live);
    if (ok)
        r->now = PyFloat_AS_DOUBLE(now);
    else
        depth_reader_clear(r);
    Py_XDECREF(now);
    PyErr_Clear();
    return ok;
}

/* PrefixIndex.depth_of(hashes, worker_id, now): how many leading hashes ``wid`` holds unexpired.
 * >= 0; -1 with an exception set; -2 where a chain hash is not an exact int or an expiry not an
 * exact float (matches.get answers). The worker id, hash or holder a lookup compares may run
 * Python code that changes the index: what is read is held meanwhile. */
static long long
read_depth(depth_reader *r, PyObject *wid)
{
    PyObject *holder = PyDict_GetItemWithError(r->live, wid);
    if (holder == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(holder);
    long long depth = 0;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(r->hashes); k++) {
        PyObject *h = PyList_GET_ITEM(r->hashes, k);
        if (!PyLong_CheckExact(h)) {
            depth = -2;  /* its __eq__ or __hash__ could be anything */
            break;
        }
        Py_INCREF(h);
        PyObject *entry = PyDict_GetItemWithError(r->map, h);
        Py_DECREF(h);
        if (entry == NULL) {
            if (PyErr_Occurred())
                depth = -1;
            break;
        }
        if (!PyDict_CheckExact(entry)) {
            depth = -2;
            break;
        }
        Py_INCREF(entry);
        PyObject *expiry = PyDict_GetItemWithError(entry, holder);
        double e = 0.0;  /* entry.get(holder, 0.0) */
        int usable = 1;
        if (expiry != NULL) {
            if (PyFloat_CheckExact(expiry))
                e = PyFloat_AS_DOUBLE(expiry);
            else
                usable = 0;
        }
        else if (PyErr_Occurred()) {
            usable = -1;
        }
        Py_DECREF(entry);
        if (usable <= 0) {
            depth = usable < 0 ? -1 : -2;
            break;
        }
        if (e <= r->now)
            break;
        depth++;
    }
    Py_DECREF(holder);
    return depth;
}

/* candidates(ids, successors, matches, deep, known, loads, chunk_tokens, cap, now)
 *
 * Balancer.candidate_set's loop for a request with no CPU KV tier in play and no adapter: one
 * Candidate per id, or NotImplemented (nothing built) where a value is not what it was written for.
 * ``deep``: ``matches`` is a _DepthLookup (its ``get`` answers workers beyond its longest matches).
 */
static PyObject *
build_records(PyObject *ids, PyObject *successors, PyObject *matches, int deep, PyObject *known, PyObject *loads,
              double chunk_tokens, long long cap, double now)
{
    Py_ssize_t n = PyList_GET_SIZE(ids);
    depth_reader depths = {NULL, NULL, NULL, 0.0};
    int direct = deep ? depth_reader_init(&depths, matches) : 0;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        depth_reader_clear(&depths);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *wid = PyList_GET_ITEM(ids, i);  /* ``ids`` is the caller's own list, not Python's */
        PyObject *w = PyDict_GetItemWithError(loads, wid);
        if (w == NULL || !Py_IS_TYPE(w, load_type)) {
            if (PyErr_Occurred())
                goto error;
            goto fallback;  /* Python raises its KeyError */
        }
        Py_INCREF(w);  /* held: a matches.get or a worker id's __eq__ below may drop it from ``loads`` */
        PyObject *matched = PyDict_GetItemWithError(matches, wid);  /* borrowed */
        if (matched != NULL) {
            Py_INCREF(matched);
        }
        else if (PyErr_Occurred()) {
            Py_DECREF(w);
            goto error;
        }
        else if (deep) {
            /* matches.get(wid, 0): its depth_of(...) or 0, read here where the index is plain dicts */
            long long depth = direct ? read_depth(&depths, wid) : -2;
            if (depth == -1) {
                Py_DECREF(w);
                goto error;
            }
            matched = depth >= 0 ? PyLong_FromLongLong(depth)
                                 : PyObject_CallMethodObjArgs(matches, str_get, wid, zero_int, NULL);
            if (matched == NULL) {
                Py_DECREF(w);
                goto error;
            }
        }
        else {
            matched = Py_NewRef(zero_int);
        }
        PyObject *cached = PyDict_GetItemWithError(known, wid);
        if (cached != NULL) {
            Py_INCREF(cached);
        }
        else if (PyErr_Occurred()) {
            Py_DECREF(matched);
            Py_DECREF(w);
            goto error;
        }
        else {
            long long m, block, value = 0;
            if (!small_int(matched, &m) || !small_int(SLOT(w, load_off[W_BLOCK]), &block) || block == 0) {
                Py_DECREF(matched);
                Py_DECREF(w);
                goto fallback;
            }
            if (m) {
                double tokens = (double)m * chunk_tokens;
                if ((double)cap < tokens) {
                    value = int_floor_div(cap, block) * block;
                }
                else {
                    double q = float_floor_div(tokens, (double)block);
                    if (!isfinite(q) || fabs(q * (double)block) >= (double)EXACT_INT_LIMIT) {
                        Py_DECREF(matched);
                        Py_DECREF(w);
                        goto fallback;
                    }
                    value = (long long)q * block;
                }
                if (value < 0)
                    value = 0;
            }
            cached = PyLong_FromLongLong(value);
            if (cached == NULL) {
                Py_DECREF(matched);
                Py_DECREF(w);
                goto error;
            }
        }
        double busy_until, slot_wait;
        /* the record's fields, taken now (owned): the rank's comparisons below may run Python code */
        PyObject *rate_now = SLOT(w, load_off[W_RATE_NOW]), *in_system = SLOT(w, load_off[W_IN_SYSTEM]);
        PyObject *over_now = SLOT(w, load_off[W_OVER_LIMIT_NOW]), *service = SLOT(w, load_off[W_SERVICE]);
        if (!exact_float(SLOT(w, load_off[W_BUSY_UNTIL]), &busy_until)
                || !exact_float(SLOT(w, load_off[W_SLOT_WAIT]), &slot_wait)
                || rate_now == NULL || in_system == NULL || over_now == NULL || service == NULL) {
            Py_DECREF(matched);
            Py_DECREF(cached);
            Py_DECREF(w);
            goto fallback;
        }
        Py_INCREF(rate_now);
        Py_INCREF(in_system);
        Py_INCREF(over_now);
        Py_INCREF(service);
        Py_DECREF(w);
        double backlog = busy_until - now;
        PyObject *pending = PyFloat_FromDouble((backlog > 0.0 ? backlog : 0.0) + slot_wait);
        PyObject *rank = NULL;
        /* ``successors`` is the caller's own list too */
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(successors) && pending != NULL; j++) {
            int eq = PyObject_RichCompareBool(PyList_GET_ITEM(successors, j), wid, Py_EQ);
            if (eq < 0) {
                Py_CLEAR(pending);
            }
            else if (eq) {
                rank = PyLong_FromSsize_t(j);
                if (rank == NULL)
                    Py_CLEAR(pending);
                break;
            }
        }
        PyObject *c = pending == NULL ? NULL : candidate_type->tp_alloc(candidate_type, 0);
        if (c == NULL) {
            Py_XDECREF(pending);
            Py_XDECREF(rank);
            Py_DECREF(matched);
            Py_DECREF(cached);
            Py_DECREF(rate_now);
            Py_DECREF(in_system);
            Py_DECREF(over_now);
            Py_DECREF(service);
            goto error;
        }
        SLOT(c, candidate_off[C_WORKER_ID]) = Py_NewRef(wid);
        SLOT(c, candidate_off[C_TOKENS_PER_S]) = rate_now;
        SLOT(c, candidate_off[C_CACHED]) = cached;
        SLOT(c, candidate_off[C_PENDING]) = pending;
        SLOT(c, candidate_off[C_IN_SYSTEM]) = in_system;
        SLOT(c, candidate_off[C_OVER_LIMIT]) = over_now;
        SLOT(c, candidate_off[C_RING_RANK]) = rank != NULL ? rank : Py_NewRef(not_on_ring);
        SLOT(c, candidate_off[C_MATCHED]) = matched;
        SLOT(c, candidate_off[C_SERVICE]) = service;
        SLOT(c, candidate_off[C_TRANSFER]) = Py_NewRef(zero_float);
        SLOT(c, candidate_off[C_ADAPTER]) = Py_NewRef(zero_float);
        PyList_SET_ITEM(out, i, c);
    }
    depth_reader_clear(&depths);
    return out;
fallback:
    depth_reader_clear(&depths);
    Py_DECREF(out);
    Py_RETURN_NOTIMPLEMENTED;
error:
    depth_reader_clear(&depths);
    Py_DECREF(out);
    return NULL;
}

static PyObject *
hot_candidates(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "candidates() takes 9 arguments");
        return NULL;
    }
    PyObject *ids = args[0], *successors = args[1], *matches = args[2], *known = args[4], *loads = args[5];
    int deep = PyObject_IsTrue(args[3]);
    double chunk_tokens, now;
    long long cap;
    if (deep < 0)
        return NULL;
    if (candidate_type == NULL || !PyList_CheckExact(ids) || !PyList_CheckExact(successors)
            || !PyDict_Check(matches) || !PyDict_CheckExact(known) || !PyDict_CheckExact(loads)
            || !exact_float(args[6], &chunk_tokens) || !small_int(args[7], &cap) || !exact_float(args[8], &now))
        Py_RETURN_NOTIMPLEMENTED;
    /* copies (a few ids each): Python code the loop calls (a worker id's __eq__, matches.get) may
     * change the lists it was given */
    PyObject *own_ids = PyList_GetSlice(ids, 0, PyList_GET_SIZE(ids));
    PyObject *own_successors = own_ids == NULL ? NULL : PyList_GetSlice(successors, 0, PyList_GET_SIZE(successors));
    PyObject *out = own_successors == NULL ? NULL
        : build_records(own_ids, own_successors, matches, deep, known, loads, chunk_tokens, cap, now);
    Py_XDECREF(own_ids);
    Py_XDECREF(own_successors);
    return out;
}

/* The fields of one candidate that choose() reads; 0 if one is not what it was written for. */
typedef struct {
    PyObject *obj;
    PyObject *worker_id;
    double rate, pending, adapter, service, transfer;
    long long cached, in_system, ring_rank;
} Scored;

static int
read_candidate(PyObject *c, Scored *s)
{
    if (!Py_IS_TYPE(c, candidate_type))
        return 0;
    s->obj = c;
    s->worker_id = SLOT(c, candidate_off[C_WORKER_ID]);
    return (s->worker_id != NULL
            && exact_float(SLOT(c, candidate_off[C_TOKENS_PER_S]), &s->rate) && s->rate != 0.0
            && exact_float(SLOT(c, candidate_off[C_PENDING]), &s->pending)
            && exact_float(SLOT(c, candidate_off[C_ADAPTER]), &s->adapter)
            && exact_float(SLOT(c, candidate_off[C_SERVICE]), &s->service)
            && exact_float(SLOT(c, candidate_off[C_TRANSFER]), &s->transfer)
            && small_int(SLOT(c, candidate_off[C_CACHED]), &s->cached)
            && small_int(SLOT(c, candidate_off[C_IN_SYSTEM]), &s->in_system)
            && small_int(SLOT(c, candidate_off[C_RING_RANK]), &s->ring_rank));
}

/* choose(candidates, spill_cap, prompt, bound, weight, shared_weight, knee, tie_floor, tie_tolerance)
 *
 * CacheAware.choose's scoring: the usable candidates (under their hard limit and, if spill_cap > 0,
 * below it; if none is, every one under its hard limit), each one's cost, and the winner among
 * the near-ties. Returns (chosen, its cost, ((worker_id, cost), ...), near-ties), None when no
 * candidate is under its hard limit (the caller raises NoCapacity), or NotImplemented.
 */
static PyObject *
choose_on(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* choose() on a copy of the candidates list: the scoring keeps borrowed pointers to the
 * candidates while a worker id's __eq__ / __lt__ may run Python code, which must not free them. */
static PyObject *
hot_choose(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9 || !PyList_CheckExact(args[0]))
        return choose_on(self, args, nargs);
    PyObject *copy[9];
    for (Py_ssize_t i = 1; i < 9; i++)
        copy[i] = args[i];
    copy[0] = PyList_GetSlice(args[0], 0, PY_SSIZE_T_MAX);
    if (copy[0] == NULL)
        return NULL;
    PyObject *result = choose_on(self, copy, nargs);
    Py_DECREF(copy[0]);
    return result;
}

static PyObject *
choose_on(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "choose() takes 9 arguments");
        return NULL;
    }
    PyObject *candidates = args[0];
    long long spill_cap, prompt, bound;
    double weight, shared_weight, knee, tie_floor, tie_tolerance;
    if (candidate_type == NULL || !PyList_CheckExact(candidates) || !small_int(args[1], &spill_cap)
            || !small_int(args[2], &prompt) || !small_int(args[3], &bound) || !exact_float(args[4], &weight)
            || !exact_float(args[5], &shared_weight) || !number(args[6], &knee) || knee == 0.0
            || !number(args[7], &tie_floor) || !number(args[8], &tie_tolerance))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t total = PyList_GET_SIZE(candidates);
    Scored stack[32];
    Scored *usable = total <= 32 ? stack : PyMem_Malloc(sizeof(Scored) * (size_t)total);
    long long *matched = NULL;
    PyObject *costs = NULL, *result = NULL;
    if (usable == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = 0;
    for (int pass = spill_cap > 0 ? 0 : 1; pass < 2 && n == 0; pass++) {
        for (Py_ssize_t i = 0; i < total; i++) {
            PyObject *c = PyList_GET_ITEM(candidates, i);
            Scored s;
            if (!read_candidate(c, &s))
                goto fallback;
            PyObject *over = SLOT(c, candidate_off[C_OVER_LIMIT]);
            if (over != Py_True && over != Py_False)
                goto fallback;
            if (over == Py_False && (pass == 1 || s.in_system < spill_cap))
                usable[n++] = s;
        }
    }
    if (n == 0) {
        if (usable != stack)
            PyMem_Free(usable);
        Py_RETURN_NONE;
    }
    matched = PyMem_Malloc(sizeof(long long) * (size_t)n);
    costs = PyTuple_New(n);
    if (matched == NULL || costs == NULL) {
        if (matched == NULL)
            PyErr_NoMemory();
        goto done;
    }
    /* the exclusive part: only a unique longest match has one (see CacheAware.choose) */
    long long first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        matched[i] = usable[i].cached < prompt ? usable[i].cached : prompt - 1;
        if (i == 0 || matched[i] > first)
            first = matched[i];
    }
    Py_ssize_t owner = -1, holders = 0;
    long long second = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (matched[i] == first) {
            holders++;
            owner = i;
        }
    }
    if (first > 0 && holders == 1) {
        int any = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (i != owner && (!any || matched[i] > second)) {
                second = matched[i];
                any = 1;
            }
        }
    }
    else {
        owner = -1;
    }
    int follow_cache = weight == INFINITY && owner >= 0;
    double half_prompt = (double)prompt * 0.5;
    double best_cost = INFINITY, best_full = 0.0;
    double *cost_of = PyMem_Malloc(sizeof(double) * (size_t)n);
    if (cost_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Scored *c = &usable[i];
        double rate = c->rate;
        double full = (double)prompt / rate * (1.0 + half_prompt / knee);
        long long cached = matched[i];
        double actual;
        if (cached > 0) {
            long long fresh = prompt - cached;
            actual = (double)fresh / rate * (1.0 + ((double)cached + (double)fresh * 0.5) / knee) + c->transfer;
        }
        else {
            actual = full;
        }
        double cost = c->pending + c->adapter;
        long long ahead = c->in_system + 1 - bound;
        if (bound > 0 && ahead > 0)
            cost += (double)ahead * c->service / (double)bound;
        if (i != owner) {
            cost += full - shared_weight * (full - actual);
        }
        else if (follow_cache) {
            cost += actual;
        }
        else {
            double common;
            if (second > 0) {
                long long fresh = prompt - second;
                common = (double)fresh / rate * (1.0 + ((double)second + (double)fresh * 0.5) / knee);
            }
            else {
                common = full;
            }
            cost += full - shared_weight * (full - common) - weight * (common - actual);
        }
        cost_of[i] = cost;
        PyObject *value = PyFloat_FromDouble(cost);
        PyObject *pair = value == NULL ? NULL : PyTuple_Pack(2, c->worker_id, value);
        Py_XDECREF(value);
        if (pair == NULL) {
            PyMem_Free(cost_of);
            goto done;
        }
        PyTuple_SET_ITEM(costs, i, pair);
        if (follow_cache && i != owner)
            continue;  /* following the cache: only its one exclusive holder competes */
        if (cost < best_cost) {
            best_cost = cost;
            best_full = full;
        }
    }
    double spread = fabs(best_cost);
    if (best_full > spread)
        spread = best_full;
    double limit = best_cost + (tie_floor + tie_tolerance * spread);
    Py_ssize_t chosen = -1, near = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (follow_cache && i != owner)
            continue;
        double cost = cost_of[i];
        if (cost > limit)
            continue;
        near++;
        if (chosen < 0) {
            chosen = i;
            continue;
        }
        /* key = (transfer_s > 0, ring_rank, cost off the ring else 0.0, worker_id), lowest wins */
        Scored *a = &usable[i], *b = &usable[chosen];
        int a_tier = a->transfer > 0, b_tier = b->transfer > 0;
        int less;
        if (a_tier != b_tier) {
            less = a_tier < b_tier;
        }
        else if (a->ring_rank != b->ring_rank) {
            less = a->ring_rank < b->ring_rank;
        }
        else {
            double ka = a->ring_rank == not_on_ring_value ? cost : 0.0;
            double kb = b->ring_rank == not_on_ring_value ? cost_of[chosen] : 0.0;
            if (!(ka == kb)) {
                less = ka < kb;
            }
            else {
                int eq = PyObject_RichCompareBool(a->worker_id, b->worker_id, Py_EQ);
                less = eq < 0 ? -1 : eq ? 0 : PyObject_RichCompareBool(a->worker_id, b->worker_id, Py_LT);
                if (less < 0) {
                    PyMem_Free(cost_of);
                    goto done;
                }
            }
        }
        if (less)
            chosen = i;
    }
    if (chosen < 0) {
        PyMem_Free(cost_of);
        goto fallback;
    }
    PyObject *chosen_cost = PyTuple_GET_ITEM(PyTuple_GET_ITEM(costs, chosen), 1);
    result = Py_BuildValue("(OOOn)", usable[chosen].obj, chosen_cost, costs, near);
    PyMem_Free(cost_of);
done:
    Py_XDECREF(costs);
    PyMem_Free(matched);
    if (usable != stack)
        PyMem_Free(usable);
    return result;
fallback:
    Py_XDECREF(costs);
    PyMem_Free(matched);
    if (usable != stack)
        PyMem_Free(usable);
    Py_RETURN_NOTIMPLEMENTED;
}


/* ring_successors(points, owners, key, count)
 *
 * WorkerRing.successors' walk: ``points`` the ring's sorted positions as native uint64 (bytes),
 * ``owners`` the worker at each; the first ``count`` distinct workers clockwise from the first
 * point after ``key & (2**64 - 1)`` (bisect_right), the owner first. NotImplemented for a key that
 * is not an int, or a ring whose two halves disagree.
 */
static PyObject *
ring_walk(PyObject *points, PyObject *owners, PyObject *key_obj, Py_ssize_t count)
{
    if (!PyBytes_CheckExact(points) || !PyList_CheckExact(owners) || !(PyLong_CheckExact(key_obj) || PyBool_Check(key_obj)))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t n = PyList_GET_SIZE(owners);
    if (PyBytes_GET_SIZE(points) != n * (Py_ssize_t)sizeof(unsigned long long) || n == 0)
        Py_RETURN_NOTIMPLEMENTED;
    unsigned long long key = PyLong_AsUnsignedLongLongMask(key_obj);
    if (key == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    const unsigned long long *pos = (const unsigned long long *)PyBytes_AS_STRING(points);
    Py_ssize_t lo = 0, hi = n;  /* bisect_right: the first point > key */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (key < pos[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    Py_ssize_t i = lo == n ? 0 : lo;
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    if (count <= 0)
        return out;
    if (PyList_Append(out, PyList_GET_ITEM(owners, i)) < 0)
        goto error;
    /* at most one lap: a ring of fewer distinct workers than ``count`` ends there */
    for (Py_ssize_t steps = 1; steps < n && PyList_GET_SIZE(out) < count; steps++) {
        if (++i == n)
            i = 0;
        /* held while compared: an __eq__ may change ``owners`` (then this walk stops, as a Python
         * loop over a list would not: RuntimeError) */
        PyObject *worker_id = Py_NewRef(PyList_GET_ITEM(owners, i));
        int seen = 0;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(out) && !seen; j++)
            seen = PyObject_RichCompareBool(PyList_GET_ITEM(out, j), worker_id, Py_EQ);
        if (seen == 0 && PyList_Append(out, worker_id) < 0)
            seen = -1;
        Py_DECREF(worker_id);
        if (seen < 0)
            goto error;
        if (PyList_GET_SIZE(owners) != n) {
            PyErr_SetString(PyExc_RuntimeError, "the ring's owners changed during the walk");
            goto error;
        }
    }
    return out;
error:
    Py_DECREF(out);
    return NULL;
}

static PyObject *
hot_ring_successors(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "ring_successors() takes 4 arguments");
        return NULL;
    }
    if (!PyLong_CheckExact(args[3]))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t count = PyLong_AsSsize_t(args[3]);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    return ring_walk(args[0], args[1], args[2], count);
}

/* a < b for two entries of the load heap, as Python compares them: (busy_until, version, worker_id)
 * tuples, compared as floats and ints where they are exact (and no NaN), else by Python itself.
 * 1, 0, or -1 with an exception set. */
static int
heap_less(PyObject *a, PyObject *b)
{
    if (PyTuple_CheckExact(a) && PyTuple_CheckExact(b) && PyTuple_GET_SIZE(a) == 3 && PyTuple_GET_SIZE(b) == 3) {
        PyObject *fa = PyTuple_GET_ITEM(a, 0), *fb = PyTuple_GET_ITEM(b, 0);
        if (PyFloat_CheckExact(fa) && PyFloat_CheckExact(fb)) {
            double x = PyFloat_AS_DOUBLE(fa), y = PyFloat_AS_DOUBLE(fb);
            if (!isnan(x) && !isnan(y)) {
                if (x != y)
                    return x < y;
                long long va, vb;
                if (small_int(PyTuple_GET_ITEM(a, 1), &va) && small_int(PyTuple_GET_ITEM(b, 1), &vb) && va != vb)
                    return va < vb;
            }
        }
    }
    /* held across the comparison, as heapq does: a __lt__ may change the heap */
    Py_INCREF(a);
    Py_INCREF(b);
    int less = PyObject_RichCompareBool(a, b, Py_LT);
    Py_DECREF(a);
    Py_DECREF(b);
    return less;
}

/* heapq's sift-down (toward the root) of the entry at ``pos``; 0, or -1 with an exception set */
static int
heap_sift_down(PyObject *heap, Py_ssize_t start, Py_ssize_t pos)
{
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > start) {
        Py_ssize_t parent = (pos - 1) >> 1;
        int less = heap_less(PyList_GET_ITEM(heap, pos), PyList_GET_ITEM(heap, parent));
        if (less < 0)
            return -1;
        if (size != PyList_GET_SIZE(heap)) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
            return -1;
        }
        if (!less)
            break;
        PyObject *item = PyList_GET_ITEM(heap, pos);
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, parent));
        PyList_SET_ITEM(heap, parent, item);
        pos = parent;
    }
    return 0;
}

/* heapq's sift-up from ``pos``: the smaller child rises until a leaf, then sift-down */
static int
heap_sift_up(PyObject *heap, Py_ssize_t pos)
{
    Py_ssize_t end = PyList_GET_SIZE(heap), start = pos, limit = end >> 1;
    while (pos < limit) {
        Py_ssize_t child = 2 * pos + 1;
        if (child + 1 < end) {
            int less = heap_less(PyList_GET_ITEM(heap, child), PyList_GET_ITEM(heap, child + 1));
            if (less < 0)
                return -1;
            if (end != PyList_GET_SIZE(heap)) {
                PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
                return -1;
            }
            if (!less)
                child += 1;
        }
        PyObject *item = PyList_GET_ITEM(heap, pos);
        PyList_SET_ITEM(heap, pos, PyList_GET_ITEM(heap, child));
        PyList_SET_ITEM(heap, child, item);
        pos = child;
    }
    return heap_sift_down(heap, start, pos);
}

/* heapq.heappop: a new reference, or NULL with an exception set */
static PyObject *
heap_pop(PyObject *heap)
{
    Py_ssize_t n = PyList_GET_SIZE(heap);
    PyObject *last = PyList_GET_ITEM(heap, n - 1);
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    if (n == 1)
        return last;
    PyObject *top = PyList_GET_ITEM(heap, 0);  /* the list's reference becomes ours */
    PyList_SET_ITEM(heap, 0, last);
    if (heap_sift_up(heap, 0) < 0) {
        Py_DECREF(top);
        return NULL;
    }
    return top;
}

/* A worker record's field, a new reference (NULL with an exception set): read from its slot if it
 * is a WorkerLoad, else looked up as Python would. */
static PyObject *
load_field(PyObject *w, int field)
{
    if (!Py_IS_TYPE(w, load_type))
        return PyObject_GetAttrString(w, LOAD_FIELDS[field]);
    PyObject *v = SLOT(w, load_off[field]);
    if (v == NULL)
        PyErr_SetString(PyExc_AttributeError, LOAD_FIELDS[field]);
    return Py_XNewRef(v);
}

/* least_loaded(heap, workers, k, skip)
 *
 * LoadBoard.least_loaded: pop the heap of (busy_until, version, worker_id) until ``k`` routable
 * workers under their hard limit and not in ``skip`` are found; stale entries (an old version, a
 * worker gone or not routable) are dropped for good, the others pushed back. The same pops and
 * pushes as heapq's, so the heap ends as the Python loop leaves it. NotImplemented, touching
 * nothing, for arguments of other types than the board's (a list, a dict, a set).
 */
static PyObject *
least_loaded(PyObject *heap, PyObject *workers, Py_ssize_t k, PyObject *skip)
{
    /* exact types: a subclass's own __contains__ or get would be Python's to call */
    if (load_type == NULL || !PyList_CheckExact(heap) || !PyDict_CheckExact(workers)
            || !(PySet_CheckExact(skip) || PyFrozenSet_CheckExact(skip)))
        Py_RETURN_NOTIMPLEMENTED;
    Py_ssize_t pushed = 0;  /* of ``popped``, how many are back on the heap */
    PyObject *out = PyList_New(0), *popped = PyList_New(0);
    if (out == NULL || popped == NULL)
        goto error;
    while (PyList_GET_SIZE(heap) > 0 && PyList_GET_SIZE(out) < k) {
        PyObject *item = heap_pop(heap);
        if (item == NULL)
            goto error;
        PyObject *version = PySequence_GetItem(item, 1), *worker_id = PySequence_GetItem(item, 2);
        if (version == NULL || worker_id == NULL) {
            Py_XDECREF(version);
            Py_XDECREF(worker_id);
            Py_DECREF(item);
            goto error;
        }
        PyObject *w = PyDict_GetItemWithError(workers, worker_id);  /* borrowed */
        int keep = 0, pick = 0;
        if (w == NULL && PyErr_Occurred()) {
            keep = -1;
        }
        else if (w != NULL && w != Py_None) {  /* None: stale, as Python's ``workers.get`` reads it */
            Py_INCREF(w);
            PyObject *current = load_field(w, W_HEAP_VERSION);
            int stale = current == NULL ? -1 : PyObject_RichCompareBool(current, version, Py_NE);
            Py_XDECREF(current);
            int listed = 0;
            if (stale == 0) {
                PyObject *routable = load_field(w, W_ROUTABLE);
                listed = routable == NULL ? -1 : PyObject_IsTrue(routable);
                Py_XDECREF(routable);
            }
            keep = stale < 0 || listed < 0 ? -1 : (!stale && listed);
            if (keep == 1) {
                int skipped = PySet_Contains(skip, worker_id), over = -1;
                if (skipped == 0) {
                    PyObject *over_obj = load_field(w, W_OVER_LIMIT_NOW);
                    over = over_obj == NULL ? -1 : PyObject_IsTrue(over_obj);
                    Py_XDECREF(over_obj);
                }
                pick = skipped < 0 || (skipped == 0 && over < 0) ? -1 : (!skipped && !over);
            }
            Py_DECREF(w);
        }
        if (keep == 1 && PyList_Append(popped, item) < 0)
            keep = -1;
        if (pick == 1 && PyList_Append(out, worker_id) < 0)
            pick = -1;
        Py_DECREF(version);
        Py_DECREF(worker_id);
        Py_DECREF(item);
        if (keep < 0 || pick < 0)
            goto error;
    }
    while (pushed < PyList_GET_SIZE(popped)) {  /* heapq.heappush: append, then sift */
        if (PyList_Append(heap, PyList_GET_ITEM(popped, pushed)) < 0)
            goto error;
        pushed++;
        if (heap_sift_down(heap, 0, PyList_GET_SIZE(heap) - 1) < 0)
            goto error;
    }
    Py_DECREF(popped);
    return out;
error:
    /* what was popped and kept goes back, each entry once, so the heap loses no live entry */
    if (popped != NULL) {
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        while (pushed < PyList_GET_SIZE(popped)) {
            if (PyList_Append(heap, PyList_GET_ITEM(popped, pushed++)) < 0
                    || heap_sift_down(heap, 0, PyList_GET_SIZE(heap) - 1) < 0)
                PyErr_Clear();
        }
        PyErr_Restore(exc_type, exc_value, exc_tb);
    }
    Py_XDECREF(out);
    Py_XDECREF(popped);
    return NULL;
}

static PyObject *
hot_least_loaded(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "least_loaded() takes 4 arguments");
        return NULL;
    }
    if (!PyLong_CheckExact(args[2]))
        Py_RETURN_NOTIMPLEMENTED;  /* Python's loop compares len(out) < k for any k */
    Py_ssize_t k = PyLong_AsSsize_t(args[2]);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    return least_loaded(args[0], args[1], k, args[3]);
}

/* Append ``worker_id`` to ``ids`` unless it is there already (== as a dict's keys compare str); 0 or -1. */
static int
append_new(PyObject *ids, PyObject *worker_id)
{
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(ids); j++) {
        int eq = PyObject_RichCompareBool(PyList_GET_ITEM(ids, j), worker_id, Py_EQ);
        if (eq)
            return eq < 0 ? -1 : 0;
    }
    return PyList_Append(ids, worker_id);
}

/* candidate_set(matches, deep, routable, points, owners, ring_key, ring_count, heap, workers,
 *               load_count, chunk_tokens, cap, now)
 *
 * Balancer.candidate_set whole, for the common request (nothing excluded, no CPU KV tier, no
 * precise backend's exact answer, no adapter): the ring walk, the ids -- the routable longest
 * matches, the ring successors, the least-loaded workers, in that order without repeats -- and
 * their records. NotImplemented if any part is (the least-loaded pops may have run: they leave the
 * same live entries, and Python's candidate_ids pops them again).
 */
static PyObject *
hot_candidate_set(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "candidate_set() takes 13 arguments");
        return NULL;
    }
    PyObject *matches = args[0], *routable = args[2], *heap = args[7], *workers = args[8];
    if (!PyLong_CheckExact(args[6]) || !PyLong_CheckExact(args[9])
            || !(PySet_CheckExact(routable) || PyFrozenSet_CheckExact(routable)))
        Py_RETURN_NOTIMPLEMENTED;
    int deep = PyObject_IsTrue(args[1]);
    Py_ssize_t ring_count = PyLong_AsSsize_t(args[6]), load_count;
    double chunk_tokens, now;
    long long cap;
    if (deep < 0 || (ring_count == -1 && PyErr_Occurred()))
        return NULL;
    load_count = PyLong_AsSsize_t(args[9]);
    if (load_count == -1 && PyErr_Occurred())
        return NULL;
    if (candidate_type == NULL || !PyDict_Check(matches)
            || !exact_float(args[10], &chunk_tokens) || !small_int(args[11], &cap) || !exact_float(args[12], &now))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *successors = NULL, *least = NULL, *ids = NULL, *known = NULL, *result = NULL;
    if (ring_count <= 0) {  /* an empty ring */
        successors = PyList_New(0);
    }
    else {
        successors = ring_walk(args[3], args[4], args[5], ring_count);
    }
    if (successors == NULL || successors == Py_NotImplemented)
        goto done;
    ids = PyList_New(0);
    if (ids == NULL)
        goto done;
    {
        Py_ssize_t pos = 0;
        PyObject *worker_id, *value;
        while (PyDict_Next(matches, &pos, &worker_id, &value)) {  /* matches.keys(), in order */
            Py_INCREF(worker_id);  /* held: its __hash__/__eq__ may change ``matches`` */
            int listed = PySet_Contains(routable, worker_id);
            if (listed > 0)
                listed = append_new(ids, worker_id);
            Py_DECREF(worker_id);
            if (listed < 0)
                goto done;
        }
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(successors); i++) {
        if (append_new(ids, PyList_GET_ITEM(successors, i)) < 0)
            goto done;
    }
    known = PyDict_New();
    PyObject *no_skip = known == NULL ? NULL : PyFrozenSet_New(NULL);
    if (no_skip == NULL)
        goto done;
    least = least_loaded(heap, workers, load_count, no_skip);
    Py_DECREF(no_skip);
    if (least == NULL || least == Py_NotImplemented)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(least); i++) {
        if (append_new(ids, PyList_GET_ITEM(least, i)) < 0)
            goto done;
    }
    result = build_records(ids, successors, matches, deep, known, workers, chunk_tokens, cap, now);
done:
    if (result == NULL && !PyErr_Occurred() && (successors == Py_NotImplemented || least == Py_NotImplemented))
        result = Py_NewRef(Py_NotImplemented);
    Py_XDECREF(successors);
    Py_XDECREF(least);
    Py_XDECREF(ids);
    Py_XDECREF(known);
    return result;
}

/* ------------------------------------------------------------------ the index's many-holder match */

static PyTypeObject *holder_type = NULL;  /* index._Holder, as last passed to match_many */
static Py_ssize_t holder_worker_id_off = 0;
static PyObject *str_move_to_end = NULL;
static const char *const HOLDER_FIELDS[1] = {"worker_id"};

/* A new reference to hashes[i] where it is an exact int (its lookups run no Python code of its
 * own); NULL, no exception, where it is not or ``i`` is past the sequence's end (a list may have
 * been changed by a map key's __eq__ meanwhile). */
static PyObject *
chain_hash(PyObject *hashes, Py_ssize_t i)
{
    PyObject *h;
    if (PyList_CheckExact(hashes)) {
        if (i >= PyList_GET_SIZE(hashes))
            return NULL;
        h = PyList_GET_ITEM(hashes, i);
    }
    else {
        h = PyTuple_GET_ITEM(hashes, i);
    }
    return PyLong_CheckExact(h) ? Py_NewRef(h) : NULL;
}

/* map.get(hashes[i]) as a new reference: 1 with *entry set (NULL where absent); 0 where the hash
 * or the entry is not what this was written for (the caller declines); -1 with an exception set. */
static int
index_entry(PyObject *map, PyObject *hashes, Py_ssize_t i, PyObject **entry)
{
    PyObject *h = chain_hash(hashes, i);
    if (h == NULL)
        return 0;
    PyObject *e = PyDict_GetItemWithError(map, h);
    Py_DECREF(h);
    if (e == NULL)
        return PyErr_Occurred() ? -1 : (*entry = NULL, 1);
    if (!PyDict_CheckExact(e))
        return 0;
    *entry = Py_NewRef(e);
    return 1;
}

/* One (holder, expiry) of an entry: its worker id (borrowed: the holder is held by the entry,
 * which the caller holds, and nothing below runs Python code) and expiry; 0 where the holder is
 * not a plain _Holder with a str id or the expiry not an exact float. */
static int
read_holder(PyObject *holder, PyObject *exp, PyObject **wid, double *e)
{
    if (!Py_IS_TYPE(holder, holder_type) || !PyFloat_CheckExact(exp))
        return 0;
    *wid = SLOT(holder, holder_worker_id_off);
    if (*wid == NULL || !PyUnicode_CheckExact(*wid))
        return 0;
    *e = PyFloat_AS_DOUBLE(exp);
    return 1;
}

/* PrefixIndex._live_in(entry, now): 1 / 0; -1 (decline) where a holder or expiry is not plain. An
 * exact str's lookup in an exact dict runs no Python code, so the iteration is not disturbed. */
static int
live_in(PyObject *entry, PyObject *live, double now)
{
    Py_ssize_t pos = 0;
    PyObject *holder, *exp, *wid;
    double e;
    while (PyDict_Next(entry, &pos, &holder, &exp)) {
        if (!read_holder(holder, exp, &wid, &e))
            return -1;
        if (!(e > now))
            continue;
        /* held: a non-str key of ``live`` with the same hash would run its __eq__ */
        Py_INCREF(holder);
        Py_INCREF(wid);
        int found = PyDict_GetItem(live, wid) == holder;
        Py_DECREF(wid);
        Py_DECREF(holder);
        if (found)
            return 1;
    }
    return 0;
}

/* Whether some live worker holds chunk ``i`` of ``hashes`` (PrefixIndex._live_in of its entry):
 * 1 with *held set; 0 where a value is not plain (the caller declines); -1 with an exception. */
static int
chunk_held(PyObject *map, PyObject *live, PyObject *hashes, Py_ssize_t i, double now, int *held)
{
    PyObject *entry;
    int status = index_entry(map, hashes, i, &entry);
    if (status <= 0)
        return status;
    int found = 0;
    if (entry != NULL && PyDict_GET_SIZE(entry) > 0)
        found = live_in(entry, live, now);
    Py_XDECREF(entry);
    if (found < 0)
        return 0;
    *held = found;
    return 1;
}

/* match_many(map, live, hashes, now, limit, holder_type)
 *
 * PrefixIndex._match_many (see _match_many_python in index.py, the same steps in the same order):
 * the deepest chunk some live worker holds by binary search, the walk that verifies the prefix up
 * to it (and makes it most recently used), then the first ``limit`` workers met walking back from
 * it with their deepest chunk. NotImplemented where a value is not what this was written for (then
 * the Python method runs from the start; the most-recently-used moves already made are made again
 * in the same order, which leaves the index exactly as the Python method alone would).
 */
static PyObject *
hot_match_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "match_many() takes 6 arguments");
        return NULL;
    }
    PyObject *map = args[0], *live = args[1], *hashes = args[2], *type = args[5];
    if (!PyODict_CheckExact(map) || !PyDict_CheckExact(live) || !PyFloat_CheckExact(args[3])
            || !PyLong_CheckExact(args[4]) || !(PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes))
            || !PyType_Check(type))
        Py_RETURN_NOTIMPLEMENTED;
    int overflow = 0;
    long long limit = PyLong_AsLongLongAndOverflow(args[4], &overflow);
    if (overflow || (limit == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    if ((PyTypeObject *)type != holder_type) {
        Py_ssize_t off;
        if (read_layout((PyTypeObject *)type, HOLDER_FIELDS, 1, &off) < 0) {
            PyErr_Clear();
            Py_RETURN_NOTIMPLEMENTED;
        }
        Py_XSETREF(holder_type, (PyTypeObject *)Py_NewRef(type));
        holder_worker_id_off = off;
    }
    double now = PyFloat_AS_DOUBLE(args[3]);
    /* Held: a map key's __eq__ (a key that is not an int) could drop the caller's references. */
    Py_INCREF(map);
    Py_INCREF(live);
    Py_INCREF(hashes);
    PyObject *result = NULL, *touch = NULL, *entry = NULL, *out;
    int status = 0;
    Py_ssize_t lo = 0, hi = PyList_CheckExact(hashes) ? PyList_GET_SIZE(hashes) : PyTuple_GET_SIZE(hashes);
    while (lo < hi) {  /* hashes[:lo] have a live holder; the largest such lo */
        Py_ssize_t mid = lo + (hi - lo + 1) / 2;
        int held;
        if ((status = chunk_held(map, live, hashes, mid - 1, now, &held)) <= 0)
            goto decline_or_fail;
        if (held)
            lo = mid;
        else
            hi = mid - 1;
    }
    touch = PyObject_GetAttr(map, str_move_to_end);
    if (touch == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < lo; i++) {  /* the verifying walk, making the prefix most recently used */
        int held;
        if ((status = chunk_held(map, live, hashes, i, now, &held)) <= 0)
            goto decline_or_fail;
        if (!held) {
            lo = i;
            break;
        }
        PyObject *h = chain_hash(hashes, i);
        if (h == NULL)
            goto decline;
        PyObject *moved = PyObject_CallOneArg(touch, h);
        Py_DECREF(h);
        if (moved == NULL)
            goto fail;
        Py_DECREF(moved);
    }
    result = PyDict_New();
    if (result == NULL)
        goto fail;
    if (lo == 0) {
        out = PyTuple_Pack(2, result, Py_True);
        goto done;
    }
    for (Py_ssize_t level = lo; level > 0 && PyDict_GET_SIZE(result) < limit; level--) {
        if ((status = index_entry(map, hashes, level - 1, &entry)) <= 0)
            goto decline_or_fail;
        if (entry == NULL)
            continue;
        Py_ssize_t pos = 0;
        PyObject *holder, *exp, *wid;
        double e;
        while (PyDict_Next(entry, &pos, &holder, &exp)) {
            if (!read_holder(holder, exp, &wid, &e))
                goto decline;
            /* worker_id not in result and exp > now and live.get(worker_id) is holder */
            Py_INCREF(holder);
            Py_INCREF(wid);
            int seen = PyDict_Contains(result, wid), set = 0;
            if (seen == 0 && e > now && PyDict_GetItem(live, wid) == holder) {
                PyObject *depth = PyLong_FromSsize_t(level);
                set = depth == NULL ? -1 : PyDict_SetItem(result, wid, depth);
                Py_XDECREF(depth);
            }
            Py_DECREF(wid);
            Py_DECREF(holder);
            if (seen < 0 || set < 0)
                goto fail;
            if (PyDict_GET_SIZE(result) >= limit)
                break;
        }
        Py_CLEAR(entry);
    }
    out = PyTuple_Pack(2, result, Py_False);
    goto done;
decline_or_fail:
    if (status < 0)
        goto fail;
decline:
    out = Py_NewRef(Py_NotImplemented);
    goto done;
fail:
    out = NULL;
done:
    Py_XDECREF(entry);
    Py_XDECREF(result);
    Py_XDECREF(touch);
    Py_DECREF(map);
    Py_DECREF(live);
    Py_DECREF(hashes);
    return out;
}

/* ------------------------------------------------------------------ the LoadBoard's cached figures */

static PyObject *py_refresh = NULL;  /* router.routing.load's Python _refresh (bind_refresh) */

/* Replace a WorkerLoad slot's value with ``value`` (a new reference, stolen). */
static void
set_slot(PyObject *w, int field, PyObject *value)
{
    PyObject **slot = &SLOT(w, load_off[field]);
    PyObject *old = *slot;
    *slot = value;
    Py_XDECREF(old);
}

/* refresh(w): router.routing.load._refresh -- a worker's rate_now, slot_wait_s and over_limit_now
 * from its fields -- with the same expressions in the same order; the Python function where a
 * field is not what this was written for (or where Python divides by zero). */
static PyObject *
hot_refresh(PyObject *self, PyObject *w)
{
    if (load_type == NULL || py_refresh == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_hotloop.refresh: bind() and bind_refresh() first");
        return NULL;
    }
    double prefill_rate, decode_step, service;
    long long in_system, running, batched, max_seqs, tokens, capacity, max_inflight, cap;
    if (!Py_IS_TYPE(w, load_type)
            || !number(SLOT(w, load_off[W_PREFILL_RATE]), &prefill_rate) || prefill_rate == 0.0
            || !number(SLOT(w, load_off[W_DECODE_STEP]), &decode_step)
            || !number(SLOT(w, load_off[W_SERVICE]), &service)
            || !small_int(SLOT(w, load_off[W_IN_SYSTEM]), &in_system)
            || !small_int(SLOT(w, load_off[W_RUNNING]), &running)
            || !small_int(SLOT(w, load_off[W_BATCHED]), &batched)
            || !small_int(SLOT(w, load_off[W_MAX_SEQS]), &max_seqs)
            || !small_int(SLOT(w, load_off[W_RUNNING_TOKENS]), &tokens)
            || !small_int(SLOT(w, load_off[W_CAPACITY]), &capacity)
            || !small_int(SLOT(w, load_off[W_MAX_INFLIGHT]), &max_inflight)
            || !small_int(SLOT(w, load_off[W_CAP]), &cap)
            || SLOT(w, load_off[W_TICKETS]) == NULL || !PyAnySet_CheckExact(SLOT(w, load_off[W_TICKETS])))
        return PyObject_CallOneArg(py_refresh, w);
    double base = 1.0 / prefill_rate;
    if (in_system > 0 || running > 0)
        base += decode_step / (double)(batched > 1 ? batched : 1);
    if (base == 0.0)
        return PyObject_CallOneArg(py_refresh, w);  /* Python raises ZeroDivisionError */
    double slots = (double)max_seqs;
    if (slots == 0.0)
        return PyObject_CallOneArg(py_refresh, w);  /* Python divides by it, or raises ZeroDivisionError */
    if (capacity > 0 && running > 0 && tokens > 0) {
        /* running * capacity_tokens / tokens: Python's exact int product, then its correctly
         * rounded int division -- the same double while the product is exact as a double */
        if (capacity >= EXACT_INT_LIMIT / running)
            return PyObject_CallOneArg(py_refresh, w);
        double kv = (double)(running * capacity) / (double)tokens;
        if (kv < (double)max_seqs)
            slots = kv > 1.0 ? kv : 1.0;
    }
    double ahead = (double)(in_system + 1) - slots;
    double wait = ahead > 0 ? ahead * service / slots : 0.0;
    int over = in_system >= max_inflight || (cap > 0 && PySet_GET_SIZE(SLOT(w, load_off[W_TICKETS])) >= cap);
    PyObject *rate_obj = PyFloat_FromDouble(1.0 / base);
    if (rate_obj == NULL)
        return NULL;
    PyObject *wait_obj = PyFloat_FromDouble(wait);
    if (wait_obj == NULL) {
        Py_DECREF(rate_obj);
        return NULL;
    }
    set_slot(w, W_RATE_NOW, rate_obj);
    set_slot(w, W_SLOT_WAIT, wait_obj);
    set_slot(w, W_OVER_LIMIT_NOW, Py_NewRef(over ? Py_True : Py_False));
    Py_RETURN_NONE;
}

/* bind_refresh(refresh_python): the Python function refresh() hands what it was not written for to. */
static PyObject *
hot_bind_refresh(PyObject *self, PyObject *refresh)
{
    if (!PyCallable_Check(refresh)) {
        PyErr_SetString(PyExc_TypeError, "bind_refresh() takes a callable");
        return NULL;
    }
    Py_XSETREF(py_refresh, Py_NewRef(refresh));
    Py_RETURN_NONE;
}

static PyMethodDef hot_methods[] = {
    {"bind", hot_bind, METH_VARARGS, "bind(Candidate, WorkerLoad, NOT_ON_RING): learn the records' slot layouts."},
    {"bind_refresh", hot_bind_refresh, METH_O,
     "bind_refresh(refresh_python): the Python function for what refresh() cannot do."},
    {"refresh", hot_refresh, METH_O, "refresh(w): a WorkerLoad's rate_now, slot_wait_s and over_limit_now brought up to date."},
    {"candidates", (PyCFunction)(void (*)(void))hot_candidates, METH_FASTCALL,
     "candidates(ids, successors, matches, deep, known, loads, chunk_tokens, cap, now) -> list | NotImplemented"},
    {"choose", (PyCFunction)(void (*)(void))hot_choose, METH_FASTCALL,
     "choose(candidates, spill_cap, prompt, bound, weight, shared_weight, knee, tie_floor, tie_tolerance)"
     " -> (chosen, cost, costs, near) | None | NotImplemented"},
    {"ring_successors", (PyCFunction)(void (*)(void))hot_ring_successors, METH_FASTCALL,
     "ring_successors(points, owners, key, count) -> list | NotImplemented"},
    {"candidate_set", (PyCFunction)(void (*)(void))hot_candidate_set, METH_FASTCALL,
     "candidate_set(matches, deep, routable, points, owners, ring_key, ring_count, heap, workers, load_count,"
     " chunk_tokens, cap, now) -> list | NotImplemented"},
    {"least_loaded", (PyCFunction)(void (*)(void))hot_least_loaded, METH_FASTCALL,
     "least_loaded(heap, workers, k, skip) -> list | NotImplemented"},
    {"match_many", (PyCFunction)(void (*)(void))hot_match_many, METH_FASTCALL,
     "match_many(map, live, hashes, now, limit, holder_type) -> (matches, complete) | NotImplemented"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hot_module = {
    PyModuleDef_HEAD_INIT, "_hotloop", "The compiled inner loops of a routing decision (see hotloop.py).", -1,
    hot_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__hotloop(void)
{
    PyObject *m = PyModule_Create(&hot_module);
    if (m == NULL)
        return NULL;
    zero_int = PyLong_FromLong(0);
    zero_float = PyFloat_FromDouble(0.0);
    str_get = PyUnicode_InternFromString("get");
    str_index = PyUnicode_InternFromString("_index");
    str_hashes = PyUnicode_InternFromString("_hashes");
    str_now = PyUnicode_InternFromString("_now");
    str_map = PyUnicode_InternFromString("_map");
    str_live = PyUnicode_InternFromString("_live");
    str_move_to_end = PyUnicode_InternFromString("move_to_end");
    if (str_move_to_end == NULL || zero_int == NULL || zero_float == NULL || str_get == NULL || str_index == NULL || str_hashes == NULL
            || str_now == NULL || str_map == NULL || str_live == NULL
            || PyModule_AddIntConstant(m, "LAYOUT_VERSION", LAYOUT_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
