/* The closed forms of a decode run (bench/sim/decode_run.py), compiled: a simulated replica
 * times, cuts and folds millions of decode runs in a fleet simulation, a few Python calls and a
 * few dozen float operations each.
 *
 * Optional: bench/sim/simloop.py imports this module if it was built and uses the Python
 * functions otherwise (or with PREFIXLB_PURE_PYTHON=1). Both give the same results: every float
 * below is the same IEEE expression, in the same order, as the Python it replaces (ints convert to
 * doubles exactly below 2**53), and tests/unit/test_simloop.py compares the two on random runs.
 * Anything these functions were not written for -- a step time term (overhead, c0, c1, m0, m1)
 * that is not an exact float (with ints, Python's sums and products are exact ints, not
 * doubles), another argument that is not an exact float or int, an int past 2**53, a NaN or
 * infinity where Python's math.ceil or int() would raise, a meter whose clipping could act -- is
 * handed to the Python function (bound with bind()), so an unusual value gets Python's own answer
 * or error.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* Python rounds after every operation: no fused multiply-add (setup.py passes -ffp-contract=off;
 * clang also honours the standard pragma, GCC only the flag). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define EXACT_INT_LIMIT 9007199254740992LL /* 2**53 */

/* The Python functions called where these cannot answer (bind()). */
static PyObject *py_run_time = NULL, *py_steps_done_by = NULL, *py_done_by = NULL, *py_run_cut = NULL,
                *py_observe = NULL;
static PyObject *str_decode_step_s = NULL, *str_decode_measured = NULL, *str_max_jump = NULL, *str_alpha = NULL;

/* A float argument: an exact float, or an exact int below 2**53 (converted exactly). 0 if not. */
static int
as_double(PyObject *obj, double *out)
{
    if (PyFloat_CheckExact(obj)) {
        *out = PyFloat_AS_DOUBLE(obj);
        return 1;
    }
    if (PyLong_CheckExact(obj)) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (overflow || v >= EXACT_INT_LIMIT || v <= -EXACT_INT_LIMIT) {
            PyErr_Clear();
            return 0;
        }
        *out = (double)v;
        return 1;
    }
    return 0;
}

/* A step time term: an exact float only. Python combines two int terms exactly (c0 - m0,
 * overhead * k, b * (k - 1) * k), where a double would round. 0 if not. */
static int
as_term(PyObject *obj, double *out)
{
    if (!PyFloat_CheckExact(obj))
        return 0;
    *out = PyFloat_AS_DOUBLE(obj);
    return 1;
}

/* An int argument: an exact int below 2**53 in magnitude. 0 if not. */
static int
as_count(PyObject *obj, long long *out)
{
    if (!PyLong_CheckExact(obj))
        return 0;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || v >= EXACT_INT_LIMIT || v <= -EXACT_INT_LIMIT) {
        PyErr_Clear();
        return 0;
    }
    *out = v;
    return 1;
}

/* min(k, max(0, math.ceil(x))) and min(k, max(0, math.floor(x) + 1)) for a finite x. */
static long long
clamp_ceil(double x, long long k)
{
    double c = ceil(x);
    if (c <= 0.0)
        return 0;
    return c >= (double)k ? k : (long long)c;
}

static long long
clamp_floor_plus_one(double x, long long k)
{
    double f = floor(x);
    if (f + 1.0 <= 0.0)
        return 0;
    return f >= (double)(k - 1) ? k : (long long)f + 1;
}

/* decode_run_time: 1 with *out set, 0 where Python must answer (a crossing that is not finite). */
static int
run_time(double overhead, double c0, double c1, double m0, double m1, long long k, double *out)
{
    double total = overhead * (double)k;
    double d0 = c0 - m0, d1 = c1 - m1;
    if (d1 == 0.0) {
        double a = d0 >= 0 ? c0 : m0, b = d0 >= 0 ? c1 : m1;
        *out = total + (k > 0 ? (double)k * a + b * (double)(k - 1) * (double)k / 2.0 : 0.0);
        return 1;
    }
    long long cross;
    double a0, b0, a1, b1;
    if (d1 > 0) {
        double x = -d0 / d1;
        if (!isfinite(x))
            return 0;
        cross = clamp_ceil(x, k);
        a0 = m0, b0 = m1, a1 = c0, b1 = c1;
    } else {
        if (d0 >= 0) {
            double x = d0 / -d1;
            if (!isfinite(x))
                return 0;
            cross = clamp_floor_plus_one(x, k);
        } else {
            cross = 0;
        }
        a0 = c0, b0 = c1, a1 = m0, b1 = m1;
    }
    double first = cross > 0 ? (double)cross * a0 + b0 * (double)(cross - 1) * (double)cross / 2.0 : 0.0;
    double second = k > cross ? (double)(k - cross) * a1 + b1 * (double)(cross + k - 1) * (double)(k - cross) / 2.0
                              : 0.0;
    *out = total + first + second;
    return 1;
}

/* _steps_done_by: 1 with *done and *seconds (NAN: None) set, 0 where Python must answer. */
static int
steps_done_by(double elapsed, double overhead, double c0, double c1, double m0, double m1, long long k,
              long long *done, double *seconds)
{
    double first = overhead + (m0 > c0 ? m0 : c0);
    if (c1 >= 0 && m1 >= 0 && first > 0) {
        double q = elapsed / first;
        if (!isfinite(q))
            return 0;  /* int() raises */
        double t = trunc(q);
        long long guess;
        if (t >= (double)(k - 1))
            guess = k;
        else if (t < -1e15)
            guess = -1000000000000000LL;  /* only its sign matters below */
        else
            guess = (long long)t + 1;
        int have_above = 0;
        double above = 0.0;
        for (int i = 0; i < 3; i++) {
            if (guess <= 0) {
                *done = guess > 0 ? guess : 0;
                *seconds = guess == 0 && have_above ? above : NAN;
                return 1;
            }
            double s;
            if (!run_time(overhead, c0, c1, m0, m1, guess, &s))
                return 0;
            if (s <= elapsed) {
                *done = guess;
                *seconds = have_above ? above : NAN;
                return 1;
            }
            above = s;
            have_above = 1;
            guess -= 1;
        }
    }
    long long lo = 0, hi = k;
    while (lo < hi) {
        long long mid = (lo + hi + 1) / 2;  /* lo, hi >= 0: floor division */
        double s;
        if (!run_time(overhead, c0, c1, m0, m1, mid, &s))
            return 0;
        if (s <= elapsed)
            lo = mid;
        else
            hi = mid - 1;
    }
    *done = lo;
    *seconds = NAN;
    return 1;
}

/* Read nfloats float arguments then one int (k); the last five floats are step time terms
 * (as_term), any before them a time (as_double). 0 if any is not what it should be. */
static int
read_run(PyObject *const *args, int nfloats, double *floats, long long *k)
{
    for (int i = 0; i < nfloats; i++) {
        if (!(i < nfloats - 5 ? as_double(args[i], &floats[i]) : as_term(args[i], &floats[i])))
            return 0;
    }
    return as_count(args[nfloats], k);
}

static PyObject *
fallback(PyObject *func, PyObject *const *args, Py_ssize_t nargs)
{
    if (func == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bench.sim._simloop is not bound (bind() first)");
        return NULL;
    }
    return PyObject_Vectorcall(func, args, nargs, NULL);
}

/* decode_run_time(overhead, c0, c1, m0, m1, k) -> float */
static PyObject *
sim_decode_run_time(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double f[5], out;
    long long k;
    if (nargs != 6 || !read_run(args, 5, f, &k) || !run_time(f[0], f[1], f[2], f[3], f[4], k, &out))
        return fallback(py_run_time, args, nargs);
    return PyFloat_FromDouble(out);
}

/* steps_done_by(elapsed, overhead, c0, c1, m0, m1, k) -> (done, seconds | None) */
static PyObject *
sim_steps_done_by(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double f[6], seconds;
    long long k, done;
    if (nargs != 7 || !read_run(args, 6, f, &k) || !steps_done_by(f[0], f[1], f[2], f[3], f[4], f[5], k, &done, &seconds))
        return fallback(py_steps_done_by, args, nargs);
    if (isnan(seconds))
        return Py_BuildValue("(LO)", done, Py_None);
    return Py_BuildValue("(Ld)", done, seconds);
}

/* decode_steps_done_by(elapsed, overhead, c0, c1, m0, m1, k) -> int */
static PyObject *
sim_decode_steps_done_by(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double f[6], seconds;
    long long k, done;
    if (nargs != 7 || !read_run(args, 6, f, &k) || !steps_done_by(f[0], f[1], f[2], f[3], f[4], f[5], k, &done, &seconds))
        return fallback(py_done_by, args, nargs);
    return PyLong_FromLongLong(done);
}

/* decode_run_cut(elapsed, overhead, c0, c1, m0, m1, k) -> (m, seconds) | None */
static PyObject *
sim_decode_run_cut(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double f[6], seconds;
    long long k, done;
    if (nargs != 7 || !read_run(args, 6, f, &k) || !steps_done_by(f[0], f[1], f[2], f[3], f[4], f[5], k, &done, &seconds))
        return fallback(py_run_cut, args, nargs);
    long long m = done + 1;
    if (m >= k)
        Py_RETURN_NONE;
    if (isnan(seconds) && !run_time(f[1], f[2], f[3], f[4], f[5], m, &seconds))
        return fallback(py_run_cut, args, nargs);
    return Py_BuildValue("(Ld)", m, seconds);
}

/* An attribute of the meter as a double; 0 if absent or not an exact float / small int. */
static int
attr_double(PyObject *obj, PyObject *name, double *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    int ok = as_double(v, out);
    Py_DECREF(v);
    return ok;
}

/* observe_decode_run(speed, overhead, c0, c1, m0, m1, k, batch) -> None */
static PyObject *
sim_observe_decode_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    double f[5];
    long long k, batch;
    if (nargs != 8 || !read_run(args + 1, 5, f, &k) || !as_count(args[7], &batch))
        return fallback(py_observe, args, nargs);
    if (k <= 0)
        Py_RETURN_NONE;
    PyObject *speed = args[0];
    double overhead = f[0], c0 = f[1], c1 = f[2], m0 = f[3], m1 = f[4];
    double first = overhead + (m0 > c0 ? m0 : c0);
    double c_last = c0 + c1 * (double)(k - 1), m_last = m0 + m1 * (double)(k - 1);
    double last = overhead + (m_last > c_last ? m_last : c_last);
    PyObject *measured_obj = PyObject_GetAttr(speed, str_decode_measured);
    if (measured_obj == NULL) {
        PyErr_Clear();
        return fallback(py_observe, args, nargs);
    }
    int measured = PyBool_Check(measured_obj) ? measured_obj == Py_True : -1;
    Py_DECREF(measured_obj);
    double est = 0.0, max_jump, alpha;
    if (measured < 0 || (measured && !attr_double(speed, str_decode_step_s, &est))
            || !attr_double(speed, str_max_jump, &max_jump) || !attr_double(speed, str_alpha, &alpha)
            || !(alpha > 0.0 && alpha <= 1.0))
        return fallback(py_observe, args, nargs);
    if (!measured)
        est = first;
    double jump = max_jump * (1.0 - 1e-9);
    if (batch <= 0 || c1 < 0 || m1 < 0 || first <= 0 || (last > est ? last : est) > jump * first
            || last > jump * (first < est ? first : est))
        return fallback(py_observe, args, nargs);  /* clipping may act: step by step, in Python */
    double keep = 1.0 - alpha;
    long long start = measured ? 0 : 1;
    /* _pieces(c0, c1, m0, m1, k) */
    double pa[2], pb[2];
    long long p0[2], p1[2];
    int npieces;
    double d0 = c0 - m0, d1 = c1 - m1;
    if (d1 == 0.0) {
        npieces = 1;
        pa[0] = d0 >= 0 ? c0 : m0, pb[0] = d0 >= 0 ? c1 : m1, p0[0] = 0, p1[0] = k;
    } else {
        long long cross;
        npieces = 2;
        if (d1 > 0) {
            double x = -d0 / d1;
            if (!isfinite(x))
                return fallback(py_observe, args, nargs);
            cross = clamp_ceil(x, k);
            pa[0] = m0, pb[0] = m1, pa[1] = c0, pb[1] = c1;
        } else {
            if (d0 >= 0) {
                double x = d0 / -d1;
                if (!isfinite(x))
                    return fallback(py_observe, args, nargs);
                cross = clamp_floor_plus_one(x, k);
            } else {
                cross = 0;
            }
            pa[0] = c0, pb[0] = c1, pa[1] = m0, pb[1] = m1;
        }
        p0[0] = 0, p1[0] = cross, p0[1] = cross, p1[1] = k;
    }
    for (int p = 0; p < npieces; p++) {
        long long i0 = p0[p] < start ? start : p0[p], i1 = p1[p];
        if (i1 <= i0)
            continue;
        double a = pa[p], b = pb[p];
        double base = overhead + a;
        est = base + b * ((double)i1 - 1.0 / alpha)
              + pow(keep, (double)(i1 - i0)) * (est - base - b * ((double)i0 - 1.0 / alpha));
    }
    PyObject *est_obj = PyFloat_FromDouble(est);
    if (est_obj == NULL)
        return NULL;
    int rc = PyObject_SetAttr(speed, str_decode_step_s, est_obj);
    Py_DECREF(est_obj);
    if (rc < 0 || PyObject_SetAttr(speed, str_decode_measured, Py_True) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the fleet's event loop */

static PyObject *heappush_fn = NULL, *heappop_fn = NULL;
static PyObject *str_version = NULL, *str_on_event = NULL, *str_first_tokens = NULL, *str_finished = NULL,
                *str_pool = NULL, *str_events = NULL, *str_take_kv_events = NULL, *str_worker_id = NULL;

/* heapq.heappush(heap, (a, seq, c, d)); steals nothing. -1 on error. */
static int
push4(PyObject *heap, PyObject *a, long long seq, PyObject *c, PyObject *d)
{
    PyObject *seq_obj = PyLong_FromLongLong(seq);
    if (seq_obj == NULL)
        return -1;
    PyObject *item = PyTuple_Pack(4, a, seq_obj, c, d);
    Py_DECREF(seq_obj);
    if (item == NULL)
        return -1;
    PyObject *args[2] = {heap, item};
    PyObject *r = PyObject_Vectorcall(heappush_fn, args, 2, NULL);
    Py_DECREF(item);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* heapq.heappop(heap), checked to be a tuple of ``size``; NULL on error. */
static PyObject *
pop_tuple(PyObject *heap, Py_ssize_t size)
{
    PyObject *item = PyObject_Vectorcall(heappop_fn, &heap, 1, NULL);
    if (item != NULL && (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != size)) {
        PyErr_SetString(PyExc_TypeError, "an event heap holds an entry of another shape");
        Py_CLEAR(item);
    }
    return item;
}

/* A heap's first time: 1 where its first entry is a (time, seq, x, y) tuple with an exact float
 * time, else 0 (the Python loop handles it). Runs no Python code, so the entry it read is still
 * the heap's first when the caller looks at it again. */
static int
head_time(PyObject *heap, double *out)
{
    PyObject *item = PyList_GET_ITEM(heap, 0);
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4 || !PyFloat_CheckExact(PyTuple_GET_ITEM(item, 0)))
        return 0;
    *out = PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(item, 0));
    return 1;
}

/* Take ``w.<name>`` (a list) if it is non-empty, leaving a new empty list there: a new reference
 * to it, Py_None (borrowed, not to be released) when empty, NULL on error. */
static PyObject *
take_list(PyObject *w, PyObject *name)
{
    PyObject *items = PyObject_GetAttr(w, name);
    if (items == NULL)
        return NULL;
    int truth = PyObject_IsTrue(items);
    if (truth <= 0) {
        Py_DECREF(items);
        return truth < 0 ? NULL : Py_None;
    }
    PyObject *fresh = PyList_New(0);
    if (fresh == NULL || PyObject_SetAttr(w, name, fresh) < 0) {
        Py_XDECREF(fresh);
        Py_DECREF(items);
        return NULL;
    }
    Py_DECREF(fresh);
    return items;
}

/* Each request of ``reqs`` to ``handler``: at ``when + delay`` through ``delayed`` (``(time, seq,
 * handler, (req, time))``) when ``delay`` is true, else now as ``handler(req, when)``. */
static int
hand_over(PyObject *reqs, PyObject *handler, PyObject *when, PyObject *delay, int delayed_on, PyObject *delayed,
          long long *seq)
{
    PyObject *fast = PySequence_Fast(reqs, "not a list");
    if (fast == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast) && rc == 0; i++) {
        PyObject *req = PySequence_Fast_GET_ITEM(fast, i);
        if (delayed_on) {
            PyObject *at = PyNumber_Add(when, delay);
            PyObject *args = at == NULL ? NULL : PyTuple_Pack(2, req, at);
            *seq += 1;
            rc = args == NULL ? -1 : push4(delayed, at, *seq, handler, args);
            Py_XDECREF(args);
            Py_XDECREF(at);
        } else {
            PyObject *args[2] = {req, when};
            PyObject *r = PyObject_Vectorcall(handler, args, 2, NULL);
            if (r == NULL)
                rc = -1;
            Py_XDECREF(r);
        }
    }
    Py_DECREF(fast);
    return rc;
}

/* A replica's KV events (``w.take_kv_events()``, taken only when its pool has some) to ``on_kv``,
 * as the Python loop hands them over. */
static int
hand_over_kv(PyObject *w, PyObject *on_kv, PyObject *when, PyObject *kv_delay, int delayed_on, PyObject *delayed,
             long long *seq)
{
    PyObject *pool = PyObject_GetAttr(w, str_pool);
    if (pool == NULL)
        return -1;
    PyObject *pending = PyObject_GetAttr(pool, str_events);
    Py_DECREF(pool);
    if (pending == NULL)
        return -1;
    int truth = PyObject_IsTrue(pending);
    Py_DECREF(pending);
    if (truth <= 0)
        return truth;
    PyObject *events = PyObject_CallMethodNoArgs(w, str_take_kv_events);
    if (events == NULL)
        return -1;
    PyObject *fast = PySequence_Fast(events, "take_kv_events() did not answer a sequence");
    Py_DECREF(events);
    if (fast == NULL)
        return -1;
    PyObject *worker_id = PyObject_GetAttr(w, str_worker_id);
    int rc = worker_id == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast) && rc == 0; i++) {
        PyObject *ev = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 3) {
            PyErr_SetString(PyExc_TypeError, "a KV event is not a (kind, hashes, medium) tuple");
            rc = -1;
            break;
        }
        PyObject *kind = PyTuple_GET_ITEM(ev, 0), *hashes = PyTuple_GET_ITEM(ev, 1), *medium = PyTuple_GET_ITEM(ev, 2);
        if (delayed_on) {
            PyObject *at = PyNumber_Add(when, kv_delay);
            PyObject *args = at == NULL ? NULL : PyTuple_Pack(5, worker_id, kind, hashes, at, medium);
            *seq += 1;
            rc = args == NULL ? -1 : push4(delayed, at, *seq, on_kv, args);
            Py_XDECREF(args);
            Py_XDECREF(at);
        } else {
            PyObject *args[5] = {worker_id, kind, hashes, when, medium};
            PyObject *r = PyObject_Vectorcall(on_kv, args, 5, NULL);
            if (r == NULL)
                rc = -1;
            Py_XDECREF(r);
        }
    }
    Py_XDECREF(worker_id);
    Py_DECREF(fast);
    return rc;
}

/* drain_events(heap, delayed, workers, t, stop, seq, hop, kv_delay, on_first_token, on_kv, on_finish)
 *     -> seq | None
 *
 * The fleet's event loop (bench/sim/fleet.py, run_until) between two of its heartbeats or report
 * reads: handles events in time order, exactly as the Python loop's body does, while the next is
 * at or before ``t``, before ``stop`` and not a delayed call of another handler than the three
 * given (an adapter's arrival takes sequence numbers of its own: the Python loop calls it), and
 * stops before an entry it was not written for (a time that is not an exact float, an entry that
 * is not an exact tuple, a worker index that is not 0 <= wi < len(workers), a call's arguments
 * that are not a tuple): the Python loop handles that one, with its own answer or error.
 * Returns the last sequence number it gave out, or None if it handled no event. */
static PyObject *
sim_drain_events(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "drain_events() takes 11 arguments");
        return NULL;
    }
    PyObject *heap = args[0], *delayed = args[1], *workers = args[2];
    PyObject *hop = args[6], *kv_delay = args[7];
    PyObject *on_first_token = args[8], *on_kv = args[9], *on_finish = args[10];
    double t, stop;
    long long seq;
    /* t, stop: exact floats, or ints a double holds exactly (compared as Python compares them) */
    if (!PyList_CheckExact(heap) || !PyList_CheckExact(delayed) || !PyList_CheckExact(workers)
            || !as_double(args[3], &t) || !as_double(args[4], &stop) || !as_count(args[5], &seq))
        Py_RETURN_NONE;  /* no event handled: the Python loop runs */
    int hop_on = PyObject_IsTrue(hop), kv_on = PyObject_IsTrue(kv_delay);
    if (hop_on < 0 || kv_on < 0)
        return NULL;
    long long handled = 0;
    while (PyList_GET_SIZE(heap) || PyList_GET_SIZE(delayed)) {
        /* Each step below up to the heappop runs no Python code: what it checked is what it pops.
         * Anything unusual stops here and the Python loop handles it (with its own answer or error). */
        double head = INFINITY, first_delayed = 0.0;
        if (PyList_GET_SIZE(heap) && !head_time(heap, &head))
            break;
        int have_delayed = PyList_GET_SIZE(delayed) > 0;
        if (have_delayed) {
            if (!head_time(delayed, &first_delayed))
                break;
            if (first_delayed < head)
                head = first_delayed;
        }
        if (head > t || !(head < stop))
            break;
        if (have_delayed && first_delayed == head) {
            PyObject *next = PyList_GET_ITEM(delayed, 0);  /* (time, seq, handler, args): head_time checked */
            PyObject *handler = PyTuple_GET_ITEM(next, 2);
            if (handler != on_first_token && handler != on_kv && handler != on_finish)
                break;  /* another handler (an adapter's arrival) may take sequence numbers: Python calls it */
            if (!PyTuple_CheckExact(PyTuple_GET_ITEM(next, 3)))
                break;  /* handler(*args) of another iterable */
            PyObject *item = pop_tuple(delayed, 4);
            if (item == NULL)
                return NULL;
            if (!PyTuple_CheckExact(PyTuple_GET_ITEM(item, 3))) {  /* (what was checked above) */
                Py_DECREF(item);
                PyErr_SetString(PyExc_RuntimeError, "the delayed calls' heap changed under drain_events");
                return NULL;
            }
            PyObject *r = PyObject_Call(PyTuple_GET_ITEM(item, 2), PyTuple_GET_ITEM(item, 3), NULL);
            Py_DECREF(item);
            if (r == NULL)
                return NULL;
            Py_DECREF(r);
            handled++;
            continue;
        }
        /* workers[wi]: an index past either end (Python's IndexError, or a negative index)
         * is the Python loop's */
        if (!PyList_GET_SIZE(heap))
            break;
        PyObject *wi = PyTuple_GET_ITEM(PyList_GET_ITEM(heap, 0), 2);
        if (!PyLong_CheckExact(wi))
            break;
        Py_ssize_t index = PyLong_AsSsize_t(wi);
        if (index == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            break;
        }
        if (index < 0 || index >= PyList_GET_SIZE(workers))
            break;
        PyObject *item = pop_tuple(heap, 4);
        if (item == NULL)
            return NULL;
        PyObject *when = PyTuple_GET_ITEM(item, 0);
        PyObject *w = NULL, *version = NULL, *nxt = NULL, *reqs = NULL;
        int ok = 0;
        if (PyTuple_GET_ITEM(item, 2) != wi || index >= PyList_GET_SIZE(workers)) {  /* (what was checked above) */
            PyErr_SetString(PyExc_RuntimeError, "the event heap changed under drain_events");
            goto event_done;
        }
        w = Py_NewRef(PyList_GET_ITEM(workers, index));
        version = PyObject_GetAttr(w, str_version);
        if (version == NULL)
            goto event_done;
        /* version != w.version (RichCompareBool's identity shortcut only where it is Python's answer) */
        PyObject *old_version = PyTuple_GET_ITEM(item, 3);
        int stale;
        if (PyLong_CheckExact(old_version) && PyLong_CheckExact(version)) {
            stale = PyObject_RichCompareBool(old_version, version, Py_NE);
        }
        else {
            PyObject *ne = PyObject_RichCompare(old_version, version, Py_NE);
            stale = ne == NULL ? -1 : PyObject_IsTrue(ne);
            Py_XDECREF(ne);
        }
        Py_CLEAR(version);
        if (stale < 0)
            goto event_done;
        if (stale) {
            ok = 1;
            goto event_done;
        }
        nxt = PyObject_CallMethodOneArg(w, str_on_event, when);
        if (nxt == NULL)
            goto event_done;
        reqs = take_list(w, str_first_tokens);  /* (w.take_first_tokens(), without the call on every event) */
        if (reqs == NULL)
            goto event_done;
        if (reqs != Py_None) {
            int rc = hand_over(reqs, on_first_token, when, hop, hop_on, delayed, &seq);
            Py_CLEAR(reqs);
            if (rc < 0)
                goto event_done;
        }
        reqs = NULL;
        if (hand_over_kv(w, on_kv, when, kv_delay, kv_on, delayed, &seq) < 0)
            goto event_done;
        reqs = take_list(w, str_finished);
        if (reqs == NULL)
            goto event_done;
        if (reqs != Py_None) {
            int rc = hand_over(reqs, on_finish, when, hop, hop_on, delayed, &seq);
            Py_CLEAR(reqs);
            if (rc < 0)
                goto event_done;
        }
        reqs = NULL;
        if (nxt != Py_None) {
            version = PyObject_GetAttr(w, str_version);
            if (version == NULL)
                goto event_done;
            seq += 1;
            if (push4(heap, nxt, seq, wi, version) < 0)
                goto event_done;
        }
        ok = 1;
    event_done:
        Py_XDECREF(version);
        Py_XDECREF(nxt);
        Py_XDECREF(w);
        Py_DECREF(item);
        if (!ok)
            return NULL;
        handled++;
    }
    if (!handled)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(seq);
}

/* ------------------------------------------------------------------ the decoding requests' heaps */

static PyObject *str_dseq = NULL, *str_blocks = NULL;

/* Whether a heap entry is live: its request's dseq is the entry's (and, with ``nblocks``, the
 * request holds that many blocks). 1, 0, or -1 with an exception set. */
static int
entry_live(PyObject *entry, int with_blocks)
{
    Py_ssize_t size = with_blocks ? 4 : 3;
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != size) {
        PyErr_SetString(PyExc_TypeError, "a decode heap holds an entry of another shape");
        return -1;
    }
    PyObject *req = PyTuple_GET_ITEM(entry, size - 1);
    PyObject *dseq = PyObject_GetAttr(req, str_dseq);
    if (dseq == NULL)
        return -1;
    int live = PyObject_RichCompareBool(dseq, PyTuple_GET_ITEM(entry, 1), Py_EQ);
    Py_DECREF(dseq);
    if (live <= 0 || !with_blocks)
        return live;
    PyObject *blocks = PyObject_GetAttr(req, str_blocks);
    if (blocks == NULL)
        return -1;
    Py_ssize_t n = PyObject_Length(blocks);
    Py_DECREF(blocks);
    if (n < 0)
        return -1;
    PyObject *held = PyLong_FromSsize_t(n);
    if (held == NULL)
        return -1;
    live = PyObject_RichCompareBool(held, PyTuple_GET_ITEM(entry, 2), Py_EQ);
    Py_DECREF(held);
    return live;
}

static int
drop_top(PyObject *heap)
{
    PyObject *item = PyObject_Vectorcall(heappop_fn, &heap, 1, NULL);
    if (item == NULL)
        return -1;
    Py_DECREF(item);
    return 0;
}

/* The first live entry's tick (stale ones dropped); IndexError on an empty heap, as Python's heap[0]. */
static PyObject *
next_live(PyObject *heap, int with_blocks)
{
    if (!PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "a decode heap is a list");
        return NULL;
    }
    for (;;) {
        if (PyList_GET_SIZE(heap) == 0) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return NULL;
        }
        PyObject *entry = PyList_GET_ITEM(heap, 0);
        Py_INCREF(entry);
        int live = entry_live(entry, with_blocks);
        if (live > 0) {
            PyObject *tick = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
            Py_DECREF(entry);
            return tick;
        }
        Py_DECREF(entry);
        if (live < 0 || drop_top(heap) < 0)
            return NULL;
    }
}

/* The live entries' requests due at ``tick`` (every due entry popped), in heap order. */
static PyObject *
pop_due(PyObject *heap, PyObject *tick, int with_blocks)
{
    if (!PyList_CheckExact(heap)) {
        PyErr_SetString(PyExc_TypeError, "a decode heap is a list");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    while (PyList_GET_SIZE(heap)) {
        PyObject *top = PyList_GET_ITEM(heap, 0);
        if (!PyTuple_CheckExact(top) || PyTuple_GET_SIZE(top) < 1) {
            PyErr_SetString(PyExc_TypeError, "a decode heap holds an entry of another shape");
            goto fail;
        }
        Py_INCREF(top);  /* held while its tick is compared (by Python code, were it not an int) */
        int due = PyObject_RichCompareBool(PyTuple_GET_ITEM(top, 0), tick, Py_LE);
        Py_DECREF(top);
        if (due < 0)
            goto fail;
        if (!due)
            break;
        PyObject *entry = PyObject_Vectorcall(heappop_fn, &heap, 1, NULL);
        if (entry == NULL)
            goto fail;
        int live = entry_live(entry, with_blocks);
        if (live > 0 && PyList_Append(out, PyTuple_GET_ITEM(entry, with_blocks ? 3 : 2)) < 0)
            live = -1;
        Py_DECREF(entry);
        if (live < 0)
            goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *
sim_next_finish(PyObject *self, PyObject *heap)
{
    return next_live(heap, 0);
}

static PyObject *
sim_next_block_need(PyObject *self, PyObject *heap)
{
    return next_live(heap, 1);
}

static PyObject *
sim_pop_finished(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop_finished(heap, tick)");
        return NULL;
    }
    return pop_due(args[0], args[1], 0);
}

static PyObject *
sim_pop_block_needs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pop_block_needs(heap, tick)");
        return NULL;
    }
    return pop_due(args[0], args[1], 1);
}

/* bind(decode_run_time, _steps_done_by, decode_steps_done_by, decode_run_cut, observe_decode_run): the
 * Python functions to hand over to. */
static PyObject *
sim_bind(PyObject *self, PyObject *args)
{
    PyObject *f[5];
    if (!PyArg_ParseTuple(args, "OOOOO", &f[0], &f[1], &f[2], &f[3], &f[4]))
        return NULL;
    for (int i = 0; i < 5; i++) {
        if (!PyCallable_Check(f[i])) {
            PyErr_SetString(PyExc_TypeError, "bind() takes five callables");
            return NULL;
        }
    }
    Py_XSETREF(py_run_time, Py_NewRef(f[0]));
    Py_XSETREF(py_steps_done_by, Py_NewRef(f[1]));
    Py_XSETREF(py_done_by, Py_NewRef(f[2]));
    Py_XSETREF(py_run_cut, Py_NewRef(f[3]));
    Py_XSETREF(py_observe, Py_NewRef(f[4]));
    Py_RETURN_NONE;
}

static PyMethodDef sim_methods[] = {
    {"bind", sim_bind, METH_VARARGS,
     "bind(decode_run_time, _steps_done_by, decode_steps_done_by, decode_run_cut, observe_decode_run): the Python "
     "functions for what these cannot answer."},
    {"decode_run_time", (PyCFunction)(void (*)(void))sim_decode_run_time, METH_FASTCALL,
     "decode_run_time(overhead, c0, c1, m0, m1, k) -> float"},
    {"steps_done_by", (PyCFunction)(void (*)(void))sim_steps_done_by, METH_FASTCALL,
     "steps_done_by(elapsed, overhead, c0, c1, m0, m1, k) -> (done, seconds | None)"},
    {"decode_steps_done_by", (PyCFunction)(void (*)(void))sim_decode_steps_done_by, METH_FASTCALL,
     "decode_steps_done_by(elapsed, overhead, c0, c1, m0, m1, k) -> int"},
    {"decode_run_cut", (PyCFunction)(void (*)(void))sim_decode_run_cut, METH_FASTCALL,
     "decode_run_cut(elapsed, overhead, c0, c1, m0, m1, k) -> (m, seconds) | None"},
    {"observe_decode_run", (PyCFunction)(void (*)(void))sim_observe_decode_run, METH_FASTCALL,
     "observe_decode_run(speed, overhead, c0, c1, m0, m1, k, batch) -> None"},
    {"next_finish", sim_next_finish, METH_O, "next_finish(heap) -> tick (bench/sim/decode_heaps.py)"},
    {"next_block_need", sim_next_block_need, METH_O, "next_block_need(heap) -> tick (bench/sim/decode_heaps.py)"},
    {"pop_finished", (PyCFunction)(void (*)(void))sim_pop_finished, METH_FASTCALL,
     "pop_finished(heap, tick) -> list (bench/sim/decode_heaps.py)"},
    {"pop_block_needs", (PyCFunction)(void (*)(void))sim_pop_block_needs, METH_FASTCALL,
     "pop_block_needs(heap, tick) -> list (bench/sim/decode_heaps.py)"},
    {"drain_events", (PyCFunction)(void (*)(void))sim_drain_events, METH_FASTCALL,
     "drain_events(heap, delayed, workers, t, stop, seq, hop, kv_delay, on_first_token, on_kv, on_finish)"
     " -> seq | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef sim_module = {
    PyModuleDef_HEAD_INIT, "_simloop", "The closed forms of a simulated decode run, compiled (see simloop.py).", -1,
    sim_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__simloop(void)
{
    PyObject *m = PyModule_Create(&sim_module);
    if (m == NULL)
        return NULL;
    str_decode_step_s = PyUnicode_InternFromString("decode_step_s");
    str_decode_measured = PyUnicode_InternFromString("decode_measured");
    str_max_jump = PyUnicode_InternFromString("max_jump");
    str_alpha = PyUnicode_InternFromString("alpha");
    str_version = PyUnicode_InternFromString("version");
    str_on_event = PyUnicode_InternFromString("on_event");
    str_first_tokens = PyUnicode_InternFromString("first_tokens");
    str_finished = PyUnicode_InternFromString("finished");
    str_pool = PyUnicode_InternFromString("pool");
    str_events = PyUnicode_InternFromString("_events");
    str_take_kv_events = PyUnicode_InternFromString("take_kv_events");
    str_worker_id = PyUnicode_InternFromString("worker_id");
    str_dseq = PyUnicode_InternFromString("dseq");
    str_blocks = PyUnicode_InternFromString("blocks");
    PyObject *heapq = PyImport_ImportModule("_heapq");
    if (heapq != NULL) {
        heappush_fn = PyObject_GetAttrString(heapq, "heappush");
        heappop_fn = PyObject_GetAttrString(heapq, "heappop");
        Py_DECREF(heapq);
    }
    if (str_decode_step_s == NULL || str_decode_measured == NULL || str_max_jump == NULL || str_alpha == NULL
            || str_version == NULL || str_on_event == NULL || str_first_tokens == NULL || str_finished == NULL
            || str_pool == NULL || str_events == NULL || str_take_kv_events == NULL || str_worker_id == NULL
            || str_dseq == NULL || str_blocks == NULL
            || heappush_fn == NULL || heappop_fn == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
