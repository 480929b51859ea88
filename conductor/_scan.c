/* The cost-aware policies' scan over a prefill pool, in one pass (behind conductor.pricing.cheapest).
 *
 * Instances fall into a few classes: those without a prefix hit, and one class per distinct
 * leading run (with a system prompt on every instance, nearly all of them share one run). An
 * instance's options are its own prefix or a pull of the best run over the same-node or the
 * remote path, and within a class every term but the queue is the same: per class, the priced
 * transfer and prefill of the local option and of the two pull paths, and whether it never pulls,
 * pulls only when strictly faster, or always pulls (Mooncake). Python prices each class once
 * (conductor.pricing.Pricer); this pass adds each instance's queue (pricing a queue of tokens
 * without a priced time itself, conductor.pricing.queue_ms). The sums are the same double
 * operations, in the same order, as the one definition of the price
 * (conductor.pricing.predicted_ttft_ms: ``(transfer + q) + prefill``), so the totals agree to the
 * bit (tests/unit/test_scan.py); ties go to the first listed, like ``argmin``. Compiled without
 * -ffast-math: IEEE doubles, no reordering.
 *
 * The decode pool has its own pass (``cheapest_colocated``, behind
 * conductor.pricing.cheapest_colocated): a decode instance prefills with its own prefix only, and
 * its running batch's decode steps join its queue; ties go to the least loaded, the same key as
 * ``least_loaded`` (conductor.picking.decode_by_load).
 *
 * Two helpers keep the rest of a decision free of per-instance Python: ``pool_runs`` places the
 * index's holders (bits, grouped by run) at their pool positions, ``first_positions`` finds
 * each run's first holder (the one its terms are priced with).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { NEVER_PULL = 0, PULL_IF_FASTER = 1, ALWAYS_PULL = 2, NUM_TERMS = 6 };

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte items, got %zd", what, itemsize,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The buffers one call holds: each taken with ``take``, all released by ``release_all``, however
 * far the call got. */
enum { MAX_BUFFERS = 10 };
typedef struct {
    Py_buffer views[MAX_BUFFERS];
    int count;
} Buffers;

/* Takes obj's buffer of itemsize-byte items: its data, and its length in items in *len; NULL with
 * an error set on failure. None, where ``optional``, gives NULL without an error (*len -1). */
static const void *take(Buffers *held, PyObject *obj, Py_ssize_t itemsize, const char *what,
                        int optional, Py_ssize_t *len) {
    *len = -1;
    if (optional && obj == Py_None) return NULL;
    assert(held->count < MAX_BUFFERS);
    Py_buffer *view = &held->views[held->count];
    if (get_buffer(obj, view, itemsize, what) < 0) return NULL;
    held->count++;
    *len = view->len / itemsize;
    return view->buf;
}

static void release_all(Buffers *held) {
    while (held->count > 0) PyBuffer_Release(&held->views[--held->count]);
}

/* Whether a buffer that ``take`` gave NULL failed (an error is set), rather than was None. */
#define FAILED(p) ((p) == NULL && PyErr_Occurred())

/* A pool's queue terms and the prefill model that prices a queue of tokens without a priced time
 * (conductor.pricing.queue_ms). */
typedef struct {
    const double *q;
    const int64_t *tokens;
    double intercept, per_token, per_token_sq, per_token_cached;
} Queues;

/* Instance k's queue: its priced queue, or, when that is <= 0 and tokens are queued, one prefill
 * of them over no cached tokens: PrefillCostModel.t_prefill_ms's double operations in its order,
 * ``max(0.0, t)`` included. */
static double queue_at(const Queues *qs, Py_ssize_t k) {
    double q = qs->q[k];
    int64_t tokens = qs->tokens[k];
    if (!(q <= 0.0) || tokens <= 0) return q;
    double u = (double)tokens, c = 0.0;
    double t = (qs->intercept + qs->per_token * u) + (qs->per_token_sq * u) * u;
    t = t + (qs->per_token_cached * u) * c;
    return t > 0.0 ? t : 0.0;
}

/* Takes q (float64[n]) and tokens (int64[n]); -1 with an error set on failure. */
static int take_queues(Buffers *held, PyObject *q, PyObject *tokens, Queues *qs, Py_ssize_t *n) {
    Py_ssize_t n_tokens;
    if ((qs->q = take(held, q, 8, "q", 0, n)) == NULL) return -1;
    if ((qs->tokens = take(held, tokens, 8, "tokens", 0, &n_tokens)) == NULL) return -1;
    if (n_tokens != *n) {
        PyErr_SetString(PyExc_ValueError, "q and tokens differ in length");
        return -1;
    }
    return 0;
}

/* cheapest(q, tokens, prefill, on_node, run_of, ready, terms, modes) -> (i, T_i, j, T_j): the
 * least T over the pool and the least T without a pull (j = -1 when none).
 * q: float64[n], each instance's priced queue, and tokens: int64[n], its queued tokens, priced
 * under prefill: (intercept, per token, per token squared, per token x cached token) where q <= 0
 * (queue_at); on_node: bool[n], whether it shares the pull source's
 * node, or None (none does); run_of: int64[n], each instance's run (-1: no hit), its class being
 * run + 1; ready: bool[n], or None when all are ready (one that is not costs infinitely much and
 * is never chosen while a ready one exists); terms: float64[m * 6], per class (local transfer,
 * local prefill, same-node pull transfer, same-node pull prefill, remote pull transfer, remote
 * pull prefill); modes: int8[m], per class NEVER_PULL, PULL_IF_FASTER or ALWAYS_PULL. */
static PyObject *cheapest(PyObject *self, PyObject *args) {
    PyObject *q_obj, *tokens_obj, *on_obj, *run_obj, *ready_obj, *terms_obj, *modes_obj;
    Buffers held = {.count = 0};
    Queues qs;
    if (!PyArg_ParseTuple(args, "OO(dddd)OOOOO", &q_obj, &tokens_obj, &qs.intercept, &qs.per_token,
                          &qs.per_token_sq, &qs.per_token_cached, &on_obj, &run_obj, &ready_obj,
                          &terms_obj, &modes_obj))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n, n_on, n_run, n_ready, n_terms, m;
    int queues = take_queues(&held, q_obj, tokens_obj, &qs, &n) == 0;
    const unsigned char *on_node = queues ? take(&held, on_obj, 1, "on_node", 1, &n_on) : NULL;
    const int64_t *run_of = queues && !FAILED(on_node) ? take(&held, run_obj, 8, "run_of", 0, &n_run) : NULL;
    const unsigned char *ready = run_of ? take(&held, ready_obj, 1, "ready", 1, &n_ready) : NULL;
    const double *terms = run_of && !FAILED(ready) ? take(&held, terms_obj, 8, "terms", 0, &n_terms) : NULL;
    const int8_t *modes = terms ? take(&held, modes_obj, 1, "modes", 0, &m) : NULL;
    if (modes == NULL) goto done;
    if ((on_node && n_on != n) || n_run != n || (ready && n_ready != n)) {
        PyErr_SetString(PyExc_ValueError, "q, on_node, run_of and ready differ in length");
        goto done;
    }
    if (n_terms != NUM_TERMS * m) {
        PyErr_SetString(PyExc_ValueError, "terms must hold 6 values per class in modes");
        goto done;
    }
    for (Py_ssize_t c = 0; c < m; c++)
        if (modes[c] < NEVER_PULL || modes[c] > ALWAYS_PULL) {
            PyErr_Format(PyExc_ValueError, "mode %d of class %zd is not 0, 1 or 2", modes[c], c);
            goto done;
        }
    Py_ssize_t best_i = -1, local_j = -1;
    double best_t = INFINITY, local_t = INFINITY;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t c = run_of[k] + 1;
        if (c < 0 || c >= m) {
            PyErr_Format(PyExc_ValueError, "run %lld of instance %zd has no class in terms",
                         (long long)run_of[k], k);
            goto done;
        }
        double t;
        int pulled;
        if (ready && !ready[k]) {
            t = INFINITY;
            pulled = 1;
        } else {
            const double *row = terms + NUM_TERMS * c;
            int mode = modes[c];
            double q = queue_at(&qs, k);
            double t_local = (row[0] + q) + row[1];
            if (mode == NEVER_PULL) {
                t = t_local;
                pulled = 0;
            } else {
                double t_pull = (on_node && on_node[k]) ? (row[2] + q) + row[3]
                                                        : (row[4] + q) + row[5];
                pulled = mode == ALWAYS_PULL || t_pull < t_local;
                t = pulled ? t_pull : t_local;
            }
        }
        if (best_i < 0 || t < best_t) { best_i = k; best_t = t; }
        if (!pulled && t < local_t) { local_j = k; local_t = t; }
    }
    result = Py_BuildValue("ndnd", best_i, best_t, local_j, local_t);
done:
    release_all(&held);
    return result;
}

/* A decode pool's load columns: the choice by load is the least (running + waiting, KV use,
 * active blocks), the first listed on ties (conductor.picking.decode_by_load). */
typedef struct {
    const int64_t *load;
    const double *kv_usage;
    const int64_t *active;
} Loads;

/* Whether instance a is strictly less loaded than instance b (a listed after b: an equal key
 * keeps b, the first listed). */
static int less_loaded(const Loads *l, Py_ssize_t a, Py_ssize_t b) {
    if (l->load[a] != l->load[b]) return l->load[a] < l->load[b];
    if (l->kv_usage[a] != l->kv_usage[b]) return l->kv_usage[a] < l->kv_usage[b];
    return l->active[a] < l->active[b];
}

/* Takes the three load columns (int64, float64, int64), each of *n items, or of as many as load
 * holds when *n < 0 (then set); -1 with an error set on failure. */
static int take_loads(Buffers *held, PyObject *load, PyObject *kv_usage, PyObject *active, Loads *l,
                      Py_ssize_t *n) {
    Py_ssize_t lens[3];
    if ((l->load = take(held, load, 8, "load", 0, &lens[0])) == NULL) return -1;
    if ((l->kv_usage = take(held, kv_usage, 8, "kv_usage", 0, &lens[1])) == NULL) return -1;
    if ((l->active = take(held, active, 8, "active", 0, &lens[2])) == NULL) return -1;
    if (*n < 0) *n = lens[0];
    if (lens[0] != *n || lens[1] != *n || lens[2] != *n) {
        PyErr_SetString(PyExc_ValueError, "the load columns differ in length from the pool");
        return -1;
    }
    return 0;
}

/* least_loaded(load, kv_usage, active, ready) -> int: the position of the least loaded ready
 * instance (-1: none is ready); ready: bool[n], or None when all are. */
static PyObject *least_loaded(PyObject *self, PyObject *args) {
    PyObject *load_obj, *kv_obj, *active_obj, *ready_obj;
    if (!PyArg_ParseTuple(args, "OOOO", &load_obj, &kv_obj, &active_obj, &ready_obj)) return NULL;
    Buffers held = {.count = 0};
    Loads l;
    PyObject *result = NULL;
    Py_ssize_t n = -1, n_ready;
    if (take_loads(&held, load_obj, kv_obj, active_obj, &l, &n) < 0) goto done;
    const unsigned char *ready = take(&held, ready_obj, 1, "ready", 1, &n_ready);
    if (FAILED(ready)) goto done;
    if (ready && n_ready != n) {
        PyErr_SetString(PyExc_ValueError, "ready differs in length from the load columns");
        goto done;
    }
    Py_ssize_t least = -1;
    for (Py_ssize_t k = 0; k < n; k++)
        if ((!ready || ready[k]) && (least < 0 || less_loaded(&l, k, least))) least = k;
    result = PyLong_FromSsize_t(least);
done:
    release_all(&held);
    return result;
}

enum { NUM_COLOCATED_TERMS = 4 };

/* cheapest_colocated(q, tokens, prefill, run_of, ready, running, load, kv_usage, active, terms, step, slo,
 *                    stall_weight)
 *     -> (i, T_i, queue_i, batch_i): the least co-located price over a decode pool, ties to the
 * least loaded (less_loaded), with its queue and, of that, its batch's decode steps; (-1, inf,
 * 0, 0) when no instance is left. T_i is the priced TTFT plus stall_weight x load x the class's
 * prefill (the sequences there waiting for its steps; conductor.pricing.colocated_cost).
 * q, tokens, prefill: each instance's queue, as in cheapest; run_of: int64[n], its run (-1: no
 * hit; class run + 1);
 * ready: bool[n] or None (all ready); running: int64[n], sequences it runs; load, kv_usage,
 * active: its load columns (active: KV blocks of its running batch); terms: float64[m * 4], per
 * class (transfer, prefill, prefill chunks, the first chunk's prefill); step: (base ms, ms per
 * sequence, ms per context token, tokens per block), the decode-step model; slo: with a float,
 * an instance whose step plus the first chunk exceeds it is left out; None leaves none out.
 * An instance running sequences steps them once per chunk: its queue is q + chunks x step, step
 * = (base + per_seq x running) + per_kv x (active x block): conductor.pricing.colocated_price's
 * double operations in its order (no contraction into fused multiply-adds: -std=c11). */
static PyObject *cheapest_colocated(PyObject *self, PyObject *args) {
    PyObject *q_obj, *tokens_obj, *run_obj, *ready_obj, *running_obj, *load_obj, *kv_obj, *active_obj,
        *terms_obj, *slo_obj;
    double base, per_seq, per_kv, stall_weight = 0.0;
    long long block_tokens;
    Queues qs;
    if (!PyArg_ParseTuple(args, "OO(dddd)OOOOOOO(dddL)O|d", &q_obj, &tokens_obj, &qs.intercept,
                          &qs.per_token, &qs.per_token_sq, &qs.per_token_cached, &run_obj, &ready_obj,
                          &running_obj, &load_obj, &kv_obj, &active_obj, &terms_obj, &base, &per_seq,
                          &per_kv, &block_tokens, &slo_obj, &stall_weight))
        return NULL;
    int have_slo = slo_obj != Py_None;
    double slo = have_slo ? PyFloat_AsDouble(slo_obj) : 0.0;
    if (have_slo && slo == -1.0 && PyErr_Occurred()) return NULL;
    Buffers held = {.count = 0};
    Loads l;
    PyObject *result = NULL;
    Py_ssize_t n, n_run, n_ready, n_running, n_terms;
    int queues = take_queues(&held, q_obj, tokens_obj, &qs, &n) == 0;
    const int64_t *run_of = queues ? take(&held, run_obj, 8, "run_of", 0, &n_run) : NULL;
    const unsigned char *ready = run_of ? take(&held, ready_obj, 1, "ready", 1, &n_ready) : NULL;
    const int64_t *running = run_of && !FAILED(ready) ? take(&held, running_obj, 8, "running", 0, &n_running) : NULL;
    const double *terms = running ? take(&held, terms_obj, 8, "terms", 0, &n_terms) : NULL;
    if (terms == NULL || take_loads(&held, load_obj, kv_obj, active_obj, &l, &n) < 0) goto done;
    if (n_run != n || (ready && n_ready != n) || n_running != n) {
        PyErr_SetString(PyExc_ValueError, "q, run_of, ready and running differ in length");
        goto done;
    }
    if (n_terms % NUM_COLOCATED_TERMS) {
        PyErr_SetString(PyExc_ValueError, "terms must hold 4 values per class");
        goto done;
    }
    Py_ssize_t m = n_terms / NUM_COLOCATED_TERMS, best_i = -1;
    double best_t = INFINITY, best_queue = 0.0, best_batch = 0.0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (ready && !ready[k]) continue;
        int64_t c = run_of[k] + 1;
        if (c < 0 || c >= m) {
            PyErr_Format(PyExc_ValueError, "run %lld of instance %zd has no class in terms",
                         (long long)run_of[k], k);
            goto done;
        }
        const double *row = terms + NUM_COLOCATED_TERMS * c;
        double batch = 0.0;
        if (running[k] > 0) {
            double step = (base + per_seq * (double)running[k]) + per_kv * (double)(l.active[k] * block_tokens);
            if (have_slo && step + row[3] > slo) continue;
            batch = row[2] * step;
        }
        double queue = queue_at(&qs, k) + batch;
        double t = (row[0] + queue) + row[1];
        if (stall_weight > 0.0) t = t + (stall_weight * (double)l.load[k]) * row[1];
        if (best_i < 0 || t < best_t || (t == best_t && less_loaded(&l, k, best_i))) {
            best_i = k;
            best_t = t;
            best_queue = queue;
            best_batch = batch;
        }
    }
    result = Py_BuildValue("nddd", best_i, best_t, best_queue, best_batch);
done:
    release_all(&held);
    return result;
}

/* pool_runs(bits, run_of, pool_of, position_of, num_prefill, num_decode)
 *     -> (bytearray, bytearray): per position of the prefill and of the decode pool, the run of
 * the instance there (int64, -1: no hit). bits, run_of: int64[h], holders' index bits and their
 * runs; pool_of, position_of: int64[b], per bit its pool (0 prefill, 1 decode, -1 none) and
 * position. Bits past pool_of or in no pool are skipped. */
static PyObject *pool_runs(PyObject *self, PyObject *args) {
    PyObject *objs[4];
    Py_ssize_t sizes[2];
    if (!PyArg_ParseTuple(args, "OOOOnn", &objs[0], &objs[1], &objs[2], &objs[3], &sizes[0], &sizes[1]))
        return NULL;
    if (sizes[0] < 0 || sizes[1] < 0) {
        PyErr_SetString(PyExc_ValueError, "pool sizes must be >= 0");
        return NULL;
    }
    Py_buffer views[4];
    int got = 0;
    PyObject *pools[2] = {NULL, NULL}, *result = NULL;
    static const char *names[4] = {"bits", "run_of", "pool_of", "position_of"};
    for (; got < 4; got++)
        if (get_buffer(objs[got], &views[got], 8, names[got]) < 0) goto done;
    const int64_t *bits = views[0].buf, *runs = views[1].buf, *pool_of = views[2].buf,
                  *position_of = views[3].buf;
    Py_ssize_t h = views[0].len / 8, b = views[2].len / 8;
    if (views[1].len / 8 != h || views[3].len / 8 != b) {
        PyErr_SetString(PyExc_ValueError, "bits and run_of, or pool_of and position_of, differ in length");
        goto done;
    }
    int64_t *out[2];
    for (int p = 0; p < 2; p++) {
        if ((pools[p] = PyByteArray_FromStringAndSize(NULL, sizes[p] * 8)) == NULL) goto done;
        out[p] = (int64_t *)PyByteArray_AS_STRING(pools[p]);
        memset(out[p], 0xff, (size_t)sizes[p] * 8); /* all -1 */
    }
    for (Py_ssize_t k = 0; k < h; k++) {
        int64_t bit = bits[k];
        if (bit < 0 || bit >= b) continue;
        int64_t p = pool_of[bit], pos = position_of[bit];
        if (p < 0 || p > 1) continue;
        if (pos < 0 || pos >= sizes[p]) {
            PyErr_Format(PyExc_ValueError, "position %lld is past pool %lld", (long long)pos, (long long)p);
            goto done;
        }
        out[p][pos] = runs[k];
    }
    result = PyTuple_Pack(2, pools[0], pools[1]);
done:
    while (got-- > 0) PyBuffer_Release(&views[got]);
    Py_XDECREF(pools[0]);
    Py_XDECREF(pools[1]);
    return result;
}

/* first_positions(values, m) -> list[int]: for each v in range(m), the first position of v in
 * ``values`` (int64[n]), or -1; values outside [0, m) are skipped. */
static PyObject *first_positions(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_ssize_t m;
    if (!PyArg_ParseTuple(args, "On", &obj, &m)) return NULL;
    if (m < 0) {
        PyErr_SetString(PyExc_ValueError, "m must be >= 0");
        return NULL;
    }
    Py_buffer v;
    if (get_buffer(obj, &v, 8, "values") < 0) return NULL;
    const int64_t *values = (const int64_t *)v.buf;
    Py_ssize_t n = v.len / 8, found = 0;
    Py_ssize_t *first = PyMem_Malloc((m ? m : 1) * sizeof(Py_ssize_t));
    PyObject *out = NULL;
    if (first == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < m; c++) first[c] = -1;
    for (Py_ssize_t k = 0; k < n && found < m; k++) {
        int64_t c = values[k];
        if (c >= 0 && c < m && first[c] < 0) { first[c] = k; found++; }
    }
    if ((out = PyList_New(m)) == NULL) goto done;
    for (Py_ssize_t c = 0; c < m; c++) {
        PyObject *p = PyLong_FromSsize_t(first[c]);
        if (p == NULL) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, c, p);
    }
done:
    PyMem_Free(first);
    PyBuffer_Release(&v);
    return out;
}

static PyMethodDef methods[] = {
    {"cheapest", cheapest, METH_VARARGS,
     "cheapest(q, tokens, prefill, on_node, run_of, ready, terms, modes) -> (i, T_i, j, T_j): the "
     "least T over the pool and the least without a pull (j = -1: none); q <= 0 with tokens is "
     "priced under prefill (4 coefficients); run + 1 indexes rows of terms (6 per class) and modes "
     "(0 never pull, 1 pull when strictly faster, 2 always pull)."},
    {"least_loaded", least_loaded, METH_VARARGS,
     "least_loaded(load, kv_usage, active, ready) -> int: the first ready instance of least (load, "
     "KV use, active blocks); -1 when none is ready."},
    {"cheapest_colocated", cheapest_colocated, METH_VARARGS,
     "cheapest_colocated(q, tokens, prefill, run_of, ready, running, load, kv_usage, active, terms, "
     "step, slo) -> "
     "(i, T_i, queue_i, batch_i): the least co-located price over a decode pool, ties to the least "
     "loaded; terms: 4 per class (transfer, prefill, chunks, first chunk); step: (base, per seq, "
     "per context token, block tokens); slo: None or the TBT bound (i = -1: none left)."},
    {"pool_runs", pool_runs, METH_VARARGS,
     "pool_runs(bits, run_of, pool_of, position_of, num_prefill, num_decode) -> (bytearray, "
     "bytearray): each pool's int64 run per position (-1: no hit)."},
    {"first_positions", first_positions, METH_VARARGS,
     "first_positions(values, m) -> list: the first position of each of 0..m-1 in values (-1: absent)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan",
                                    "The cost-aware policies' one-pass scans over a pool.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
