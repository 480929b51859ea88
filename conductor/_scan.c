/* The cost-aware policies' scan over a prefill pool, in one pass (behind conductor.pricing.cheapest).
 *
 * Each instance's T is its queue plus one of a few constants: recompute everything, or pull the
 * best run over the same-node or the remote path (pulling only when strictly faster, or always
 * for Mooncake). Instances with a prefix hit are priced in Python and passed in as overrides.
 * The sums are the same double operations, in the same order, as the one definition of the
 * price (conductor.pricing.predicted_ttft_ms: ``(transfer + q) + prefill``, ``q + recompute``),
 * so the totals agree to the bit (tests/unit/test_scan.py); ties go to
 * the first listed, like ``argmin``. Compiled without -ffast-math: IEEE doubles, no reordering.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte items, got %zd", what, itemsize,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* cheapest(q, on_node, same_transfer, same_prefill, other_transfer, other_prefill,
 *          recompute_ms, always_pull, override_positions, override_totals, override_pulled)
 * -> (i, T_i, j, T_j): the least T and the least T without a pull (j = -1 when none).
 * q: float64 array; on_node: bool array of the same length, or None (no instance shares the
 * source's node); override_*: lists, positions ascending. */
static PyObject *cheapest(PyObject *self, PyObject *args) {
    PyObject *q_obj, *on_obj, *pos_list, *tot_list, *pul_list;
    double same_transfer, same_prefill, other_transfer, other_prefill, recompute_ms;
    int always_pull;
    if (!PyArg_ParseTuple(args, "OOdddddpO!O!O!", &q_obj, &on_obj, &same_transfer, &same_prefill,
                          &other_transfer, &other_prefill, &recompute_ms, &always_pull,
                          &PyList_Type, &pos_list, &PyList_Type, &tot_list, &PyList_Type, &pul_list))
        return NULL;
    Py_ssize_t num_overrides = PyList_GET_SIZE(pos_list);
    if (PyList_GET_SIZE(tot_list) != num_overrides || PyList_GET_SIZE(pul_list) != num_overrides) {
        PyErr_SetString(PyExc_ValueError, "override lists must have the same length");
        return NULL;
    }
    Py_buffer qv, ov;
    if (get_buffer(q_obj, &qv, 8, "q") < 0) return NULL;
    const double *q = (const double *)qv.buf;
    Py_ssize_t n = qv.len / 8;
    const unsigned char *on_node = NULL;
    int have_on = on_obj != Py_None;
    if (have_on) {
        if (get_buffer(on_obj, &ov, 1, "on_node") < 0) { PyBuffer_Release(&qv); return NULL; }
        if (ov.len != n) {
            PyErr_SetString(PyExc_ValueError, "on_node and q differ in length");
            PyBuffer_Release(&ov); PyBuffer_Release(&qv);
            return NULL;
        }
        on_node = (const unsigned char *)ov.buf;
    }
    Py_ssize_t next = 0, next_pos = -1;
    if (num_overrides) {
        next_pos = PyLong_AsSsize_t(PyList_GET_ITEM(pos_list, 0));
        if (next_pos == -1 && PyErr_Occurred()) goto fail;
    }
    Py_ssize_t best_i = -1, local_j = -1;
    double best_t = INFINITY, local_t = INFINITY;
    for (Py_ssize_t k = 0; k < n; k++) {
        double t;
        int pulled;
        if (k == next_pos) {
            t = PyFloat_AsDouble(PyList_GET_ITEM(tot_list, next));
            if (t == -1.0 && PyErr_Occurred()) goto fail;
            pulled = PyObject_IsTrue(PyList_GET_ITEM(pul_list, next));
            if (pulled < 0) goto fail;
            if (++next < num_overrides) {
                Py_ssize_t pos = PyLong_AsSsize_t(PyList_GET_ITEM(pos_list, next));
                if (pos == -1 && PyErr_Occurred()) goto fail;
                if (pos <= next_pos) {
                    PyErr_SetString(PyExc_ValueError, "override positions must ascend");
                    goto fail;
                }
                next_pos = pos;
            }
        } else {
            double t_pull = (on_node && on_node[k]) ? (same_transfer + q[k]) + same_prefill
                                                    : (other_transfer + q[k]) + other_prefill;
            if (always_pull) {
                t = t_pull;
                pulled = 1;
            } else {
                double t_local = q[k] + recompute_ms;
                pulled = t_pull < t_local;
                t = pulled ? t_pull : t_local;
            }
        }
        if (best_i < 0 || t < best_t) { best_i = k; best_t = t; }
        if (!pulled && t < local_t) { local_j = k; local_t = t; }
    }
    if (next < num_overrides) {
        PyErr_SetString(PyExc_ValueError, "an override position is past the pool");
        goto fail;
    }
    if (have_on) PyBuffer_Release(&ov);
    PyBuffer_Release(&qv);
    return Py_BuildValue("ndnd", best_i, best_t, local_j, local_t);
fail:
    if (have_on) PyBuffer_Release(&ov);
    PyBuffer_Release(&qv);
    return NULL;
}

static PyMethodDef methods[] = {
    {"cheapest", cheapest, METH_VARARGS,
     "cheapest(q, on_node, same_transfer, same_prefill, other_transfer, other_prefill, "
     "recompute_ms, always_pull, override_positions, override_totals, override_pulled) -> "
     "(i, T_i, j, T_j): the least T over the pool and the least without a pull (j = -1: none)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_scan",
                                    "The cost-aware policies' one-pass scan over a prefill pool.",
                                    -1, methods};

PyMODINIT_FUNC PyInit__scan(void) { return PyModule_Create(&module); }
