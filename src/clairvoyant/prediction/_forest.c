/* The shipped model's trees, walked in C (issue 12: the predictor's p50).
 *
 *   forest = Forest(nodes, roots, base, row, out)
 *   forest.run()      # out[0] = base + sum over trees of the leaf row reaches
 *
 * ``nodes`` is a packed array of 16-byte records {int32 feature; float32 threshold_or_leaf;
 * int32 true_next; int32 false_next} (native byte order), ``roots`` the int32 index of each tree's
 * first node, in the order the model lists its trees. A record whose feature is -1 is a leaf and
 * holds its weight; otherwise the walk goes to ``true_next`` when row[feature] < threshold
 * (ONNX's BRANCH_LT) and to ``false_next`` otherwise, NaN included (missing values do not track
 * true). The leaf weights are summed in float32 in tree order, then ``base`` is added, as ONNX
 * Runtime's TreeEnsembleRegressor does for one target with SUM and no post transform;
 * onnx_forest.py builds the arrays from the ONNX file and predictor.py checks the two agree on
 * start-up before using this.
 *
 * ``row`` and ``out`` are the predictor's bound float32 buffers (the same ones ONNX Runtime's
 * IOBinding reads and writes): held for the Forest's life, so ``run`` takes no argument and
 * allocates nothing. Every index was checked in the constructor, so the walk cannot leave the
 * arrays, and a cycle is refused there too (each next index is greater than its node's).
 *
 * Why C: ONNX Runtime costs 3-5 us a call here before the model does anything (the bare call of an
 * Identity graph, bench_predictor.py's floor); 150 trees of depth ~4 take well under 1 us to walk.
 * Only public C API; the GIL is held throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int32_t feature; /* -1: a leaf */
    float value;     /* the threshold, or the leaf's weight */
    int32_t true_next;
    int32_t false_next;
} Node;

typedef struct {
    PyObject_HEAD
    Node *nodes;
    int32_t *roots;
    Py_ssize_t n_trees;
    float base;
    Py_buffer row; /* float32[n_features] */
    Py_buffer out; /* float32[>= 1], writable */
} Forest;

static void
forest_dealloc(Forest *self)
{
    PyMem_Free(self->nodes);
    PyMem_Free(self->roots);
    if (self->row.obj != NULL) {
        PyBuffer_Release(&self->row);
    }
    if (self->out.obj != NULL) {
        PyBuffer_Release(&self->out);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
check_float32(Py_buffer *view, const char *what)
{
    if (view->itemsize != 4 || (view->format != NULL && strcmp(view->format, "f") != 0) ||
        !PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "Forest: %s must be a contiguous float32 buffer", what);
        return -1;
    }
    return 0;
}

static int
forest_init(Forest *self, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"nodes", "roots", "base", "row", "out", NULL};
    Py_buffer nodes_view = {0}, roots_view = {0};
    PyObject *row, *out;
    float base;
    if (self->nodes != NULL || self->row.obj != NULL) {
        PyErr_SetString(PyExc_TypeError, "Forest: already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*y*fOO", keywords, &nodes_view, &roots_view, &base, &row,
                                     &out)) {
        return -1;
    }
    int status = -1;
    Py_ssize_t n_nodes = nodes_view.len / (Py_ssize_t)sizeof(Node);
    Py_ssize_t n_trees = roots_view.len / (Py_ssize_t)sizeof(int32_t);
    Py_ssize_t n_features;
    if (PyObject_GetBuffer(row, &self->row, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        goto done;
    }
    if (PyObject_GetBuffer(out, &self->out, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        goto done;
    }
    if (check_float32(&self->row, "row") < 0 || check_float32(&self->out, "out") < 0) {
        goto done;
    }
    n_features = self->row.len / 4;
    if (self->out.len < 4 || n_features < 1) {
        PyErr_SetString(PyExc_ValueError, "Forest: row and out must hold at least one float32");
        goto done;
    }
    if (nodes_view.len % (Py_ssize_t)sizeof(Node) != 0 || roots_view.len % (Py_ssize_t)sizeof(int32_t) != 0 ||
        n_nodes < 1 || n_trees < 1 || n_nodes > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "Forest: nodes must be 16-byte records and roots int32, neither empty");
        goto done;
    }
    self->nodes = PyMem_Malloc((size_t)nodes_view.len);
    self->roots = PyMem_Malloc((size_t)roots_view.len);
    if (self->nodes == NULL || self->roots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(self->nodes, nodes_view.buf, (size_t)nodes_view.len);
    memcpy(self->roots, roots_view.buf, (size_t)roots_view.len);
    for (Py_ssize_t i = 0; i < n_nodes; i++) {
        Node *node = &self->nodes[i];
        if (node->feature == -1) {
            continue;
        }
        if (node->feature < 0 || node->feature >= n_features || node->true_next <= i || node->false_next <= i ||
            node->true_next >= n_nodes || node->false_next >= n_nodes) {
            PyErr_Format(PyExc_ValueError, "Forest: node %zd has a feature or a next node out of range", i);
            goto done;
        }
    }
    for (Py_ssize_t t = 0; t < n_trees; t++) {
        if (self->roots[t] < 0 || self->roots[t] >= n_nodes) {
            PyErr_Format(PyExc_ValueError, "Forest: tree %zd's root is out of range", t);
            goto done;
        }
    }
    self->n_trees = n_trees;
    self->base = base;
    status = 0;
done:
    PyBuffer_Release(&nodes_view);
    PyBuffer_Release(&roots_view);
    if (status < 0) {
        PyMem_Free(self->nodes);
        PyMem_Free(self->roots);
        self->nodes = NULL;
        self->roots = NULL;
        if (self->row.obj != NULL) {
            PyBuffer_Release(&self->row);
        }
        if (self->out.obj != NULL) {
            PyBuffer_Release(&self->out);
        }
    }
    return status;
}

static PyObject *
forest_run(Forest *self, PyObject *Py_UNUSED(ignored))
{
    if (self->nodes == NULL) {
        PyErr_SetString(PyExc_ValueError, "Forest: not initialised");
        return NULL;
    }
    const Node *nodes = self->nodes;
    const float *row = (const float *)self->row.buf;
    float sum = 0.0f;
    for (Py_ssize_t t = 0; t < self->n_trees; t++) {
        const Node *node = &nodes[self->roots[t]];
        while (node->feature >= 0) {
            node = &nodes[row[node->feature] < node->value ? node->true_next : node->false_next];
        }
        sum += node->value;
    }
    ((float *)self->out.buf)[0] = sum + self->base;
    Py_RETURN_NONE;
}

static PyMethodDef forest_methods[] = {
    {"run", (PyCFunction)forest_run, METH_NOARGS,
     "run() -> None: out[0] = base + the leaf weights the row reaches, summed in float32 in tree order."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ForestType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "clairvoyant.prediction._forest.Forest",
    .tp_basicsize = sizeof(Forest),
    .tp_dealloc = (destructor)forest_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Forest(nodes, roots, base, row, out): a tree ensemble regressor over bound float32 buffers.",
    .tp_methods = forest_methods,
    .tp_init = (initproc)forest_init,
    .tp_new = PyType_GenericNew,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_forest", "The shipped model's trees, walked in C.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__forest(void)
{
    if (PyType_Ready(&ForestType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&ForestType);
    if (PyModule_AddObject(m, "Forest", (PyObject *)&ForestType) < 0) {
        Py_DECREF(&ForestType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
