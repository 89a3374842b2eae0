/* The rich feature sets' term sum, compiled (issue 12: the predictor's p99).
 *
 *   table = compile_terms(keys, values, limbs)
 *   term_sum(table, words, pairs) -> bytes
 *
 * ``keys`` are the terms (a word as bytes, a word pair as a (bytes, bytes) tuple), ``values`` their
 * packed ints as ``limbs * 8`` little-endian two's-complement bytes. ``term_sum`` returns, in the
 * same form, exactly
 *
 *   sum(value[w] for w in set(words) if w in keys)
 *   + (if pairs) sum(value[(a, b)] for (a, b) in set(zip(words, words[1:])) if (a, b) in keys)
 *
 * which features._python_term_total computes with a frozenset, ``map(dict.get, ...)`` and
 * ``dict.keys() & zip(...)``; tests/test_features_reference.py compares the two and the frozen
 * reference extractor. The caller sizes ``limbs`` so no sum can overflow (features._compiled_table).
 *
 * Why C: in CPython the extraction's tail is one dict probe per distinct word and per word pair,
 * a frozenset and a tuple per pair, and a big-int addition per known term (docs/benchmarks.md
 * sections 15 and 20). Here a word is hashed once with a cheap hash of its bytes, a pair's hash is
 * mixed from its words' hashes, the probe compares bytes, each found term is added limb by limb
 * into a fixed-width sum, and "already added" is a per-call stamp on the table's entry: nothing
 * is allocated per word or per pair. The GIL is held throughout, so calls never overlap; no Python
 * code runs inside. Only public C API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CAPSULE_NAME "clairvoyant.prediction._term_sum.table"
#define MAX_LIMBS 64 /* 4096-bit sums; compile_terms refuses wider values */
#define STACK_WORDS 1024

#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch((address), 0, 3)
#else
#define PREFETCH(address) ((void)(address))
#endif

typedef struct {
    uint64_t hash;
    PyObject *first;  /* NULL: an empty slot */
    PyObject *second; /* NULL: a single word */
    uint32_t stamp;   /* the call that last added this term */
} Slot;

typedef struct {
    Slot *slots;
    uint64_t *values; /* limbs per slot, little-endian two's complement */
    size_t mask;      /* slots - 1 (a power of two) */
    Py_ssize_t limbs;
    uint32_t calls;
} Table;

static inline uint64_t
mix(uint64_t x)
{
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    x *= 0xd6e8feb86659fd93ULL;
    x ^= x >> 32;
    return x;
}

static uint64_t
hash_bytes(PyObject *word)
{
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(word);
    Py_ssize_t n = PyBytes_GET_SIZE(word);
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n;
    uint64_t chunk;
    while (n >= 8) {
        memcpy(&chunk, p, 8);
        h = (h ^ chunk) * 0xbf58476d1ce4e5b9ULL;
        h ^= h >> 29;
        p += 8;
        n -= 8;
    }
    if (n > 0) {
        chunk = 0;
        memcpy(&chunk, p, (size_t)n);
        h = (h ^ chunk) * 0xbf58476d1ce4e5b9ULL;
        h ^= h >> 29;
    }
    return mix(h);
}

static inline uint64_t
hash_pair(uint64_t first, uint64_t second)
{
    return mix(first * 0x9e3779b97f4a7c15ULL + second + 1);
}

static inline int
same_bytes(PyObject *x, PyObject *y)
{
    Py_ssize_t n = PyBytes_GET_SIZE(x);
    return x == y || (n == PyBytes_GET_SIZE(y) && memcmp(PyBytes_AS_STRING(x), PyBytes_AS_STRING(y), (size_t)n) == 0);
}

/* The slot of the term (first, second), or of the empty slot where it would go. */
static Slot *
probe(const Table *table, uint64_t hash, PyObject *first, PyObject *second)
{
    size_t i = (size_t)hash & table->mask;
    for (;;) {
        Slot *slot = &table->slots[i];
        if (slot->first == NULL) {
            return slot;
        }
        if (slot->hash == hash && same_bytes(slot->first, first) &&
            (second == NULL ? slot->second == NULL : slot->second != NULL && same_bytes(slot->second, second))) {
            return slot;
        }
        i = (i + 1) & table->mask;
    }
}

static void
table_free(Table *table)
{
    if (table->slots != NULL) {
        for (size_t i = 0; i <= table->mask; i++) {
            Py_XDECREF(table->slots[i].first);
            Py_XDECREF(table->slots[i].second);
        }
    }
    PyMem_Free(table->slots);
    PyMem_Free(table->values);
    PyMem_Free(table);
}

static void
capsule_free(PyObject *capsule)
{
    Table *table = PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (table != NULL) {
        table_free(table);
    }
}

static PyObject *
compile_terms(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "compile_terms(keys: list, values: list[bytes], limbs: int)");
        return NULL;
    }
    PyObject *keys = args[0];
    PyObject *values = args[1];
    Py_ssize_t limbs = PyLong_AsSsize_t(args[2]);
    if (limbs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (limbs < 1 || limbs > MAX_LIMBS || PyList_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "compile_terms: limbs must be 1..%d and one value per key", MAX_LIMBS);
        return NULL;
    }
    size_t size = 16;
    while (size < 2 * (size_t)n) {
        size <<= 1;
    }
    Table *table = PyMem_Calloc(1, sizeof(Table));
    if (table == NULL) {
        return PyErr_NoMemory();
    }
    table->slots = PyMem_Calloc(size, sizeof(Slot));
    table->values = PyMem_Calloc(size * (size_t)limbs, sizeof(uint64_t));
    table->mask = size - 1;
    table->limbs = limbs;
    if (table->slots == NULL || table->values == NULL) {
        table_free(table);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *key = PyList_GET_ITEM(keys, k);
        PyObject *value = PyList_GET_ITEM(values, k);
        PyObject *first = key;
        PyObject *second = NULL;
        if (PyTuple_CheckExact(key) && PyTuple_GET_SIZE(key) == 2) {
            first = PyTuple_GET_ITEM(key, 0);
            second = PyTuple_GET_ITEM(key, 1);
        }
        if (!PyBytes_CheckExact(first) || (second != NULL && !PyBytes_CheckExact(second)) ||
            !PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) != 8 * limbs) {
            table_free(table);
            PyErr_SetString(PyExc_TypeError,
                            "compile_terms: a key is bytes or a (bytes, bytes) tuple, a value limbs * 8 bytes");
            return NULL;
        }
        uint64_t hash = hash_bytes(first);
        if (second != NULL) {
            hash = hash_pair(hash, hash_bytes(second));
        }
        Slot *slot = probe(table, hash, first, second);
        if (slot->first != NULL) {
            table_free(table);
            PyErr_SetString(PyExc_ValueError, "compile_terms: a key is given twice");
            return NULL;
        }
        slot->hash = hash;
        slot->first = Py_NewRef(first);
        slot->second = Py_XNewRef(second);
        uint64_t *limb = &table->values[(size_t)(slot - table->slots) * (size_t)limbs];
        const unsigned char *bytes = (const unsigned char *)PyBytes_AS_STRING(value);
        for (Py_ssize_t j = 0; j < limbs; j++) {
            uint64_t word = 0;
            for (int b = 7; b >= 0; b--) {
                word = (word << 8) | bytes[8 * j + b];
            }
            limb[j] = word;
        }
    }
    PyObject *capsule = PyCapsule_New(table, CAPSULE_NAME, capsule_free);
    if (capsule == NULL) {
        table_free(table);
    }
    return capsule;
}

/* Adds the term's value to the sum unless this call already did. */
static inline void
add_once(Table *table, Slot *slot, uint32_t stamp, uint64_t *sum)
{
    if (slot->first == NULL || slot->stamp == stamp) {
        return;
    }
    slot->stamp = stamp;
    const uint64_t *value = &table->values[(size_t)(slot - table->slots) * (size_t)table->limbs];
    unsigned __int128 carry = 0;
    for (Py_ssize_t j = 0; j < table->limbs; j++) {
        carry += (unsigned __int128)sum[j] + value[j];
        sum[j] = (uint64_t)carry;
        carry >>= 64;
    }
}

static PyObject *
term_sum(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyList_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "term_sum(table, words: list[bytes], pairs: bool)");
        return NULL;
    }
    Table *table = PyCapsule_GetPointer(args[0], CAPSULE_NAME);
    if (table == NULL) {
        return NULL;
    }
    int pairs = PyObject_IsTrue(args[2]);
    if (pairs < 0) {
        return NULL;
    }
    PyObject *words = args[1];
    Py_ssize_t n = PyList_GET_SIZE(words);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyBytes_CheckExact(PyList_GET_ITEM(words, i))) {
            PyErr_SetString(PyExc_TypeError, "term_sum: words must be a list of bytes");
            return NULL;
        }
    }
    /* Every probe's hash first (the words' first, then the pairs'), then the probes in two passes.
     * The table is large (2.25 MiB of slots and values with the lexicon) and partly out of cache
     * between requests, so its lines are fetched for all probes at once rather than one miss after
     * another (prefetch stage 1: each probe's first slot; stage 2: each candidate term's key bytes
     * and value). The sum itself is the same loop as before, in the same order: prefetches change
     * no result (benchmarks/bench_term_sum_cache.py). */
    Py_ssize_t probes = pairs && n > 1 ? 2 * n - 1 : n;
    uint64_t stack_hashes[2 * STACK_WORDS];
    uint64_t *hashes = stack_hashes;
    if (n > STACK_WORDS) {
        hashes = PyMem_Malloc((size_t)probes * sizeof(uint64_t));
        if (hashes == NULL) {
            return PyErr_NoMemory();
        }
    }
    if (++table->calls == 0) { /* the stamp wrapped: forget every old one */
        for (size_t i = 0; i <= table->mask; i++) {
            table->slots[i].stamp = 0;
        }
        table->calls = 1;
    }
    uint32_t stamp = table->calls;
    uint64_t sum[MAX_LIMBS] = {0};
    for (Py_ssize_t i = 0; i < n; i++) {
        hashes[i] = hash_bytes(PyList_GET_ITEM(words, i));
        PREFETCH(&table->slots[(size_t)hashes[i] & table->mask]);
    }
    for (Py_ssize_t i = n; i < probes; i++) {
        hashes[i] = hash_pair(hashes[i - n], hashes[i - n + 1]);
        PREFETCH(&table->slots[(size_t)hashes[i] & table->mask]);
    }
    for (Py_ssize_t k = 0; k < probes; k++) {
        size_t i = (size_t)hashes[k] & table->mask;
        const Slot *slot = &table->slots[i];
        while (slot->first != NULL && slot->hash != hashes[k]) {
            i = (i + 1) & table->mask;
            slot = &table->slots[i];
        }
        if (slot->first != NULL) { /* a candidate: its key bytes and its value, for the next pass */
            PREFETCH(PyBytes_AS_STRING(slot->first));
            if (slot->second != NULL) {
                PREFETCH(PyBytes_AS_STRING(slot->second));
            }
            PREFETCH(&table->values[i * (size_t)table->limbs]);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        add_once(table, probe(table, hashes[i], PyList_GET_ITEM(words, i), NULL), stamp, sum);
    }
    for (Py_ssize_t i = n; i < probes; i++) {
        PyObject *first = PyList_GET_ITEM(words, i - n);
        PyObject *second = PyList_GET_ITEM(words, i - n + 1);
        add_once(table, probe(table, hashes[i], first, second), stamp, sum);
    }
    if (hashes != stack_hashes) {
        PyMem_Free(hashes);
    }
    unsigned char out[8 * MAX_LIMBS];
    for (Py_ssize_t j = 0; j < table->limbs; j++) {
        for (int b = 0; b < 8; b++) {
            out[8 * j + b] = (unsigned char)(sum[j] >> (8 * b));
        }
    }
    return PyBytes_FromStringAndSize((const char *)out, 8 * table->limbs);
}

static PyMethodDef methods[] = {
    {"compile_terms", (PyCFunction)(void (*)(void))compile_terms, METH_FASTCALL,
     "compile_terms(keys, values, limbs) -> table: terms (bytes or (bytes, bytes)) and their values as "
     "limbs * 8 little-endian two's-complement bytes."},
    {"term_sum", (PyCFunction)(void (*)(void))term_sum, METH_FASTCALL,
     "term_sum(table, words, pairs) -> bytes: the sum of the values of the distinct terms among words "
     "and, if pairs, among its adjacent word pairs, as limbs * 8 little-endian two's-complement bytes."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_term_sum", "The rich feature sets' term sum, compiled.", 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__term_sum(void)
{
    return PyModule_Create(&module);
}
