/* The cost-aware policies' scan over a prefill pool, in one pass (behind conductor.pricing.cheapest).
 *
 * Instances fall into a few classes: those without a prefix hit, and one class per distinct
 * leading run (with a system prompt on every instance, nearly all of them share one run). An
 * instance's options are its own prefix or a pull of the best run over the same-node or the
 * remote path, and within a class every term but the queue is the same: per class, the priced
 * transfer and prefill of the local option and of the two pull paths, and whether it never pulls,
 * pulls only when strictly faster, or always pulls (Mooncake). Python prices each class once
 * (conductor.pricing.Pricer); this pass adds each instance's queue. The sums are the same double
 * operations, in the same order, as the one definition of the price
 * (conductor.pricing.predicted_ttft_ms: ``(transfer + q) + prefill``), so the totals agree to the
 * bit (tests/unit/test_scan.py); ties go to the first listed, like ``argmin``. Compiled without
 * -ffast-math: IEEE doubles, no reordering.
 *
 * Two helpers keep the rest of a decision free of per-instance Python: ``pool_runs`` places the
 * index's holders (bits, grouped by run) at their pool positions, ``first_positions`` finds
 * each run's first holder (the one its terms are priced with).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* cheapest(q, on_node, run_of, ready, terms, modes) -> (i, T_i, j, T_j): the least T over the
 * pool and the least T without a pull (j = -1 when none).
 * q: float64[n], each instance's queue; on_node: bool[n], whether it shares the pull source's
 * node, or None (none does); run_of: int64[n], each instance's run (-1: no hit), its class being
 * run + 1; ready: bool[n], or None when all are ready (one that is not costs infinitely much and
 * is never chosen while a ready one exists); terms: float64[m * 6], per class (local transfer,
 * local prefill, same-node pull transfer, same-node pull prefill, remote pull transfer, remote
 * pull prefill); modes: int8[m], per class NEVER_PULL, PULL_IF_FASTER or ALWAYS_PULL. */
static PyObject *cheapest(PyObject *self, PyObject *args) {
    PyObject *q_obj, *on_obj, *run_obj, *ready_obj, *terms_obj, *modes_obj;
    if (!PyArg_ParseTuple(args, "OOOOOO", &q_obj, &on_obj, &run_obj, &ready_obj, &terms_obj, &modes_obj))
        return NULL;
    Py_buffer qv, ov, rv, yv, tv, mv;
    int have_on = on_obj != Py_None, have_ready = ready_obj != Py_None, got = 0;
    PyObject *result = NULL;
    if (get_buffer(q_obj, &qv, 8, "q") < 0) return NULL;
    got = 1;
    if (have_on && get_buffer(on_obj, &ov, 1, "on_node") < 0) goto done;
    got = 2;
    if (get_buffer(run_obj, &rv, 8, "run_of") < 0) goto done;
    got = 3;
    if (have_ready && get_buffer(ready_obj, &yv, 1, "ready") < 0) goto done;
    got = 4;
    if (get_buffer(terms_obj, &tv, 8, "terms") < 0) goto done;
    got = 5;
    if (get_buffer(modes_obj, &mv, 1, "modes") < 0) goto done;
    got = 6;
    const double *q = (const double *)qv.buf, *terms = (const double *)tv.buf;
    const int64_t *run_of = (const int64_t *)rv.buf;
    const int8_t *modes = (const int8_t *)mv.buf;
    const unsigned char *on_node = have_on ? (const unsigned char *)ov.buf : NULL;
    const unsigned char *ready = have_ready ? (const unsigned char *)yv.buf : NULL;
    Py_ssize_t n = qv.len / 8, m = mv.len;
    if ((have_on && ov.len != n) || rv.len / 8 != n || (have_ready && yv.len != n)) {
        PyErr_SetString(PyExc_ValueError, "q, on_node, run_of and ready differ in length");
        goto done;
    }
    if (tv.len / 8 != NUM_TERMS * m) {
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
            double t_local = (row[0] + q[k]) + row[1];
            if (mode == NEVER_PULL) {
                t = t_local;
                pulled = 0;
            } else {
                double t_pull = (on_node && on_node[k]) ? (row[2] + q[k]) + row[3]
                                                        : (row[4] + q[k]) + row[5];
                pulled = mode == ALWAYS_PULL || t_pull < t_local;
                t = pulled ? t_pull : t_local;
            }
        }
        if (best_i < 0 || t < best_t) { best_i = k; best_t = t; }
        if (!pulled && t < local_t) { local_j = k; local_t = t; }
    }
    result = Py_BuildValue("ndnd", best_i, best_t, local_j, local_t);
done:
    if (got >= 6) PyBuffer_Release(&mv);
    if (got >= 5) PyBuffer_Release(&tv);
    if (got >= 4 && have_ready) PyBuffer_Release(&yv);
    if (got >= 3) PyBuffer_Release(&rv);
    if (got >= 2 && have_on) PyBuffer_Release(&ov);
    PyBuffer_Release(&qv);
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
     "cheapest(q, on_node, run_of, ready, terms, modes) -> (i, T_i, j, T_j): the least T over the "
     "pool and the least without a pull (j = -1: none); run + 1 indexes rows of terms (6 per "
     "class) and modes (0 never pull, 1 pull when strictly faster, 2 always pull)."},
    {"pool_runs", pool_runs, METH_VARARGS,
     "pool_runs(bits, run_of, pool_of, position_of, num_prefill, num_decode) -> (bytearray, "
     "bytearray): each pool's int64 run per position (-1: no hit)."},
    {"first_positions", first_positions, METH_VARARGS,
     "first_positions(values, m) -> list: the first position of each of 0..m-1 in values (-1: absent)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan",
                                    "The cost-aware policies' one-pass scan over a prefill pool.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
