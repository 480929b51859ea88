/* The KV index's hot loops in C: a hash table keyed by 16-byte block keys, the prefix walk of
 * ``KvIndex.prefix_hits`` over it, and engine-event translation (msgpack token ids -> BLAKE2b
 * chain keys).
 *
 * Why C: a million-key Python dict of 16-byte ``bytes`` keys costs three dependent cache misses
 * per lookup (index slot, entry, key object) and the per-block Python work of decoding tokens
 * into ints and hashing them through hashlib dominated ingestion. Here a key lives inline in its
 * slot (one miss, and the walk prefetches a chunk's slots first so the misses overlap), holder
 * masks are ANDed as 64-bit words, and tokens go from the raw msgpack bytes straight into BLAKE2b.
 *
 * KeyTable: open addressing with linear probing and backward-shift deletion (no tombstones), a
 * power-of-two capacity kept at most 70% full. A slot holds the key's two 64-bit halves and a
 * strong reference to its value, always a Python int (a holder bitmask); NULL marks an empty
 * slot. Values are interned through a dict the caller passes, so a million entries share a few
 * thousand int objects. Ints cannot form reference cycles, so the type does not take part in GC.
 *
 * BLAKE2b follows RFC 7693 (unkeyed, 16-byte digest, 16-byte personalisation in the parameter
 * block), equal bit for bit to hashlib.blake2b(digest_size=16, person=...): the tests check it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_BYTES 16
#define DIGEST_BYTES 16
#define PERSON_BYTES 16
#define BLOCK_PERSON "baton.block.v1"
#define LOOKAHEAD 16 /* slots prefetched ahead of a batch of lookups */

/* ------------------------------------------------------------------ BLAKE2b (RFC 7693) */

static const uint64_t B2B_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

static const uint8_t B2B_SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
};

typedef struct {
    uint64_t h[8];
    uint64_t num_bytes; /* message bytes compressed so far (messages here are far below 2^64) */
    uint8_t buf[128];
    size_t buf_len;
} B2b;

static inline uint64_t load64_le(const uint8_t *p)
{
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24 |
           (uint64_t)p[4] << 32 | (uint64_t)p[5] << 40 | (uint64_t)p[6] << 48 | (uint64_t)p[7] << 56;
}

static inline void store64_le(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t rotr64(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

#define B2B_G(a, b, c, d, x, y)          \
    do {                                 \
        v[a] = v[a] + v[b] + (x);        \
        v[d] = rotr64(v[d] ^ v[a], 32);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 24);  \
        v[a] = v[a] + v[b] + (y);        \
        v[d] = rotr64(v[d] ^ v[a], 16);  \
        v[c] = v[c] + v[d];              \
        v[b] = rotr64(v[b] ^ v[c], 63);  \
    } while (0)

static void b2b_compress(B2b *s, const uint8_t block[128], int last)
{
    uint64_t v[16], m[16];
    for (int i = 0; i < 16; i++)
        m[i] = load64_le(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = B2B_IV[i];
    }
    v[12] ^= s->num_bytes; /* the counter's high word stays 0 */
    if (last)
        v[14] = ~v[14];
    for (int r = 0; r < 12; r++) {
        const uint8_t *sg = B2B_SIGMA[r];
        B2B_G(0, 4, 8, 12, m[sg[0]], m[sg[1]]);
        B2B_G(1, 5, 9, 13, m[sg[2]], m[sg[3]]);
        B2B_G(2, 6, 10, 14, m[sg[4]], m[sg[5]]);
        B2B_G(3, 7, 11, 15, m[sg[6]], m[sg[7]]);
        B2B_G(0, 5, 10, 15, m[sg[8]], m[sg[9]]);
        B2B_G(1, 6, 11, 12, m[sg[10]], m[sg[11]]);
        B2B_G(2, 7, 8, 13, m[sg[12]], m[sg[13]]);
        B2B_G(3, 4, 9, 14, m[sg[14]], m[sg[15]]);
    }
    for (int i = 0; i < 8; i++)
        s->h[i] ^= v[i] ^ v[i + 8];
}

/* The state after the parameter block of an unkeyed 16-byte digest with ``person`` (zero-padded
 * to 16 bytes), before any message byte: computed once per personalisation. */
static void b2b_param_state(uint64_t h[8], const uint8_t *person, size_t person_len)
{
    uint8_t padded[PERSON_BYTES] = {0};
    memcpy(padded, person, person_len);
    for (int i = 0; i < 8; i++)
        h[i] = B2B_IV[i];
    h[0] ^= 0x01010000ULL ^ DIGEST_BYTES; /* depth 1, fanout 1, no key, digest length */
    h[6] ^= load64_le(padded);
    h[7] ^= load64_le(padded + 8);
}

static inline void b2b_init(B2b *s, const uint64_t param_state[8])
{
    memcpy(s->h, param_state, sizeof s->h);
    s->num_bytes = 0;
    s->buf_len = 0;
}

static void b2b_update(B2b *s, const uint8_t *data, size_t len)
{
    while (len) {
        if (s->buf_len == 128) { /* full, and more follows: not the last block */
            s->num_bytes += 128;
            b2b_compress(s, s->buf, 0);
            s->buf_len = 0;
        }
        size_t take = 128 - s->buf_len;
        if (take > len)
            take = len;
        memcpy(s->buf + s->buf_len, data, take);
        s->buf_len += take;
        data += take;
        len -= take;
    }
}

static void b2b_final(B2b *s, uint8_t out[DIGEST_BYTES])
{
    s->num_bytes += s->buf_len;
    memset(s->buf + s->buf_len, 0, 128 - s->buf_len);
    b2b_compress(s, s->buf, 1);
    store64_le(out, s->h[0]);
    store64_le(out + 8, s->h[1]);
}

static uint64_t block_param_state[8]; /* for BLOCK_PERSON, set at module init */

/* ------------------------------------------------------------------ msgpack token ids */

static inline uint64_t load_be(const uint8_t *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Parse a msgpack array of token ids (ints in [0, 2^32-1]) into little-endian uint32 bytes.
 * Returns a new PyMem buffer of ``*num_tokens * 4`` bytes, or NULL with ValueError (or
 * MemoryError) set. Anything but a well-formed array of such ints is refused: the caller counts
 * the event as untranslatable rather than hashing tokens it did not understand. */
static uint8_t *parse_token_ids(const uint8_t *p, Py_ssize_t len, Py_ssize_t *num_tokens)
{
    const uint8_t *end = p + len;
    uint64_t count;
    if (len >= 1 && (p[0] & 0xf0) == 0x90) {
        count = p[0] & 0x0f;
        p += 1;
    } else if (len >= 3 && p[0] == 0xdc) {
        count = load_be(p + 1, 2);
        p += 3;
    } else if (len >= 5 && p[0] == 0xdd) {
        count = load_be(p + 1, 4);
        p += 5;
    } else {
        PyErr_SetString(PyExc_ValueError, "token_ids is not a msgpack array");
        return NULL;
    }
    if (count > (uint64_t)(end - p)) { /* every element takes at least one byte */
        PyErr_SetString(PyExc_ValueError, "token_ids: msgpack array is truncated");
        return NULL;
    }
    uint8_t *out = PyMem_Malloc(count ? count * 4 : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (uint64_t i = 0; i < count; i++) {
        if (p >= end)
            goto truncated;
        uint8_t tag = *p++;
        uint64_t value;
        int width = 0, is_signed = 0;
        if (tag <= 0x7f) {
            value = tag;
        } else {
            switch (tag) {
            case 0xcc: width = 1; break;
            case 0xcd: width = 2; break;
            case 0xce: width = 4; break;
            case 0xcf: width = 8; break;
            /* signed widths: other encoders may use them for non-negative values */
            case 0xd0: width = 1; is_signed = 1; break;
            case 0xd1: width = 2; is_signed = 1; break;
            case 0xd2: width = 4; is_signed = 1; break;
            case 0xd3: width = 8; is_signed = 1; break;
            default:
                PyMem_Free(out);
                PyErr_Format(PyExc_ValueError,
                             "token_ids[%llu] is not a non-negative msgpack int (type byte 0x%02x)",
                             (unsigned long long)i, tag);
                return NULL;
            }
            if (end - p < width)
                goto truncated;
            value = load_be(p, width);
            p += width;
            if (is_signed && value >> (8 * width - 1)) {
                PyMem_Free(out);
                PyErr_Format(PyExc_ValueError, "token_ids[%llu] is negative", (unsigned long long)i);
                return NULL;
            }
        }
        if (value > 0xffffffffULL) {
            PyMem_Free(out);
            PyErr_Format(PyExc_ValueError, "token_ids[%llu] = %llu does not fit in uint32",
                         (unsigned long long)i, (unsigned long long)value);
            return NULL;
        }
        out[4 * i] = (uint8_t)value;
        out[4 * i + 1] = (uint8_t)(value >> 8);
        out[4 * i + 2] = (uint8_t)(value >> 16);
        out[4 * i + 3] = (uint8_t)(value >> 24);
    }
    if (p != end) {
        PyMem_Free(out);
        PyErr_SetString(PyExc_ValueError, "token_ids: bytes left after the msgpack array");
        return NULL;
    }
    *num_tokens = (Py_ssize_t)count;
    return out;
truncated:
    PyMem_Free(out);
    PyErr_SetString(PyExc_ValueError, "token_ids: msgpack array is truncated");
    return NULL;
}

/* ------------------------------------------------------------------ KeyTable */

typedef struct {
    uint64_t k0, k1;  /* the key's bytes 0-7 and 8-15, in host order */
    PyObject *value;  /* strong reference to an int; NULL: empty slot */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t mask;       /* capacity - 1; capacity is a power of two */
    int shift;         /* 64 - log2(capacity) */
    Py_ssize_t used;
} KeyTable;

#define MIN_CAPACITY 64

static inline int key_of(PyObject *key, uint64_t *k0, uint64_t *k1)
{
    if (!PyBytes_Check(key) || PyBytes_GET_SIZE(key) != KEY_BYTES)
        return 0;
    const char *raw = PyBytes_AS_STRING(key);
    memcpy(k0, raw, 8);
    memcpy(k1, raw + 8, 8);
    return 1;
}

/* Keys are BLAKE2b digests, already uniform; the multiplications only keep structured keys (in
 * tests) from clustering. */
static inline size_t home_of(const KeyTable *t, uint64_t k0, uint64_t k1)
{
    uint64_t x = k0 ^ (k1 * 0xff51afd7ed558ccdULL);
    return (size_t)((x * 0x9e3779b97f4a7c15ULL) >> t->shift);
}

/* The slot holding the key, or the empty slot where it would go. */
static inline size_t probe(const KeyTable *t, uint64_t k0, uint64_t k1)
{
    size_t i = home_of(t, k0, k1);
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->value == NULL || (s->k0 == k0 && s->k1 == k1))
            return i;
        i = (i + 1) & t->mask;
    }
}

static inline void prefetch_home(const KeyTable *t, uint64_t k0, uint64_t k1)
{
    const Slot *s = &t->slots[home_of(t, k0, k1)];
    __builtin_prefetch(s);
    __builtin_prefetch((const char *)(s + 1) - 1); /* a slot may straddle two cache lines */
}

static int table_resize(KeyTable *t, size_t capacity)
{
    Slot *old = t->slots;
    size_t old_capacity = old ? t->mask + 1 : 0;
    Slot *slots = PyMem_Calloc(capacity, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int bits = 0;
    while (((size_t)1 << bits) < capacity)
        bits++;
    t->slots = slots;
    t->mask = capacity - 1;
    t->shift = 64 - bits;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].value != NULL)
            slots[probe(t, old[i].k0, old[i].k1)] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* Make room for one more key: at most 70% full after it. */
static inline int table_reserve_one(KeyTable *t)
{
    if ((size_t)(t->used + 1) * 10 <= (t->mask + 1) * 7)
        return 0;
    return table_resize(t, (t->mask + 1) * 2);
}

/* Empty slot ``i`` by shifting later entries of its probe run back (no tombstones). */
static void table_delete_at(KeyTable *t, size_t i)
{
    PyObject *value = t->slots[i].value;
    size_t j = i;
    for (;;) {
        j = (j + 1) & t->mask;
        Slot *s = &t->slots[j];
        if (s->value == NULL)
            break;
        size_t home = home_of(t, s->k0, s->k1);
        /* the entry at j may fill the hole at i only if i lies on its probe path (home .. j) */
        if (((j - home) & t->mask) >= ((j - i) & t->mask)) {
            t->slots[i] = *s;
            i = j;
        }
    }
    t->slots[i].value = NULL;
    t->used--;
    Py_DECREF(value);
}

static PyObject *KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "KeyTable() takes no arguments");
        return NULL;
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (table_resize(t, MIN_CAPACITY) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void KeyTable_dealloc(KeyTable *t)
{
    if (t->slots != NULL) {
        for (size_t i = 0; i <= t->mask; i++)
            Py_XDECREF(t->slots[i].value);
        PyMem_Free(t->slots);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t KeyTable_len(KeyTable *t) { return t->used; }

static PyObject *table_lookup(KeyTable *t, PyObject *key) /* borrowed, or NULL if absent */
{
    uint64_t k0, k1;
    if (!key_of(key, &k0, &k1))
        return NULL;
    return t->slots[probe(t, k0, k1)].value;
}

static int KeyTable_contains(KeyTable *t, PyObject *key) { return table_lookup(t, key) != NULL; }

static PyObject *KeyTable_subscript(KeyTable *t, PyObject *key)
{
    PyObject *value = table_lookup(t, key);
    if (value == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(value);
}

static PyObject *KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "get(key, default=None)");
        return NULL;
    }
    PyObject *value = table_lookup(t, args[0]);
    if (value == NULL)
        value = nargs == 2 ? args[1] : Py_None;
    return Py_NewRef(value);
}

/* The interned object equal to ``value`` (new reference): the one already in ``masks`` or
 * ``value`` itself, now in ``masks``. Steals ``value``. */
static PyObject *intern_mask(PyObject *masks, PyObject *value)
{
    PyObject *shared = PyDict_SetDefault(masks, value, value);
    Py_XINCREF(shared);
    Py_DECREF(value);
    return shared;
}

/* The interned result of ``op(seen, operand)`` for a run of keys: recomputed only when ``seen``
 * differs from the previous key's (consecutive keys mostly share their holders). Keeps the
 * memo in ``*last_old`` / ``*last_new`` (owned references); -1 on error. */
static int memo_mask(PyObject *seen, PyObject *operand, binaryfunc op, PyObject *masks,
                     PyObject **last_old, PyObject **last_new)
{
    if (seen == *last_old)
        return 0;
    PyObject *value = op(seen, operand);
    if (value == NULL || (value = intern_mask(masks, value)) == NULL)
        return -1;
    Py_XSETREF(*last_new, value);
    Py_XSETREF(*last_old, Py_NewRef(seen));
    return 0;
}

/* or_bit(keys, bit, masks): OR ``bit`` into each key's value (absent keys start at 0), each
 * result interned in the dict ``masks``. Raises TypeError for a key that is not 16 bytes. */
static PyObject *KeyTable_or_bit(KeyTable *t, PyObject *args)
{
    PyObject *keys, *bit, *masks;
    if (!PyArg_ParseTuple(args, "OO!O!:or_bit", &keys, &PyLong_Type, &bit, &PyDict_Type, &masks))
        return NULL;
    PyObject *seq = PySequence_Fast(keys, "or_bit: keys must be iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *last_old = NULL, *last_new = NULL; /* memo_mask's */
    uint64_t k0[LOOKAHEAD], k1[LOOKAHEAD];
    PyObject *result = NULL;
    for (Py_ssize_t base = 0; base < n; base += LOOKAHEAD) {
        Py_ssize_t batch = n - base < LOOKAHEAD ? n - base : LOOKAHEAD;
        for (Py_ssize_t b = 0; b < batch; b++) {
            if (!key_of(items[base + b], &k0[b], &k1[b])) {
                PyErr_Format(PyExc_TypeError, "a block key is %d bytes, got %R", KEY_BYTES,
                             items[base + b]);
                goto done;
            }
            prefetch_home(t, k0[b], k1[b]);
        }
        for (Py_ssize_t b = 0; b < batch; b++) {
            size_t i = probe(t, k0[b], k1[b]);
            PyObject *old = t->slots[i].value;
            if (memo_mask(old ? old : zero, bit, PyNumber_Or, masks, &last_old, &last_new) < 0)
                goto done;
            if (old == last_new)
                continue;
            if (old == NULL) {
                if (table_reserve_one(t) < 0)
                    goto done;
                i = probe(t, k0[b], k1[b]);
                t->slots[i].k0 = k0[b];
                t->slots[i].k1 = k1[b];
                t->used++;
            }
            t->slots[i].value = Py_NewRef(last_new);
            Py_XDECREF(old);
        }
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(last_old);
    Py_XDECREF(last_new);
    Py_DECREF(zero);
    Py_DECREF(seq);
    return result;
}

/* and_keep(keys, keep, masks): AND each present key's value with ``keep`` (interned in
 * ``masks``); a key left with 0 is removed. Keys that are absent (or not keys) are skipped. */
static PyObject *KeyTable_and_keep(KeyTable *t, PyObject *args)
{
    PyObject *keys, *keep, *masks;
    if (!PyArg_ParseTuple(args, "OO!O!:and_keep", &keys, &PyLong_Type, &keep, &PyDict_Type, &masks))
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    if (it == NULL)
        return NULL;
    PyObject *last_old = NULL, *last_new = NULL, *key, *result = NULL;
    while ((key = PyIter_Next(it)) != NULL) {
        uint64_t k0, k1;
        int ok = key_of(key, &k0, &k1);
        Py_DECREF(key);
        if (!ok)
            continue;
        size_t i = probe(t, k0, k1);
        PyObject *old = t->slots[i].value;
        if (old == NULL)
            continue;
        if (memo_mask(old, keep, PyNumber_And, masks, &last_old, &last_new) < 0)
            goto done;
        if (PyObject_Not(last_new)) {
            table_delete_at(t, i);
        } else if (old != last_new) {
            t->slots[i].value = Py_NewRef(last_new);
            Py_DECREF(old);
        }
    }
    if (!PyErr_Occurred())
        result = Py_NewRef(Py_None);
done:
    Py_XDECREF(last_old);
    Py_XDECREF(last_new);
    Py_DECREF(it);
    return result;
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL,
     "get(key, default=None): the key's value, or default."},
    {"or_bit", (PyCFunction)KeyTable_or_bit, METH_VARARGS,
     "or_bit(keys, bit, masks): OR bit into each key's value, interning results in masks."},
    {"and_keep", (PyCFunction)KeyTable_and_keep, METH_VARARGS,
     "and_keep(keys, keep, masks): AND each present key's value with keep; drop it at 0."},
    {NULL},
};

static PyMappingMethods KeyTable_as_mapping = {
    .mp_length = (lenfunc)KeyTable_len,
    .mp_subscript = (binaryfunc)KeyTable_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_length = (lenfunc)KeyTable_len,
    .sq_contains = (objobjproc)KeyTable_contains,
};

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "conductor._kvtable.KeyTable",
    .tp_doc = "Map from 16-byte block keys to int holder masks (open addressing, keys inline).",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyTable_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_methods = KeyTable_methods,
};

/* ------------------------------------------------------------------ prefix walk */

#define STACK_BYTES 1024

/* The low ``num_words`` 64-bit words of the non-negative int ``v`` (bits above are cut: they
 * cannot be alive). 0 on success, -1 with an exception set. */
static int words_of(PyObject *v, uint64_t *out, Py_ssize_t num_words)
{
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "a holder mask is an int, got %R", v);
        return -1;
    }
    size_t num_bytes = _PyLong_NumBits(v) / 8 + 1;
    uint8_t stack[STACK_BYTES], *bytes = stack;
    if (num_bytes > STACK_BYTES && (bytes = PyMem_Malloc(num_bytes)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    /* Fails (OverflowError) if v < 0; 3.13 added the with_exceptions argument. */
#if PY_VERSION_HEX >= 0x030D0000
    int rc = _PyLong_AsByteArray((PyLongObject *)v, bytes, num_bytes, 1, 0, 1);
#else
    int rc = _PyLong_AsByteArray((PyLongObject *)v, bytes, num_bytes, 1, 0);
#endif
    if (rc == 0) {
        for (Py_ssize_t w = 0; w < num_words; w++) {
            uint8_t word[8] = {0};
            size_t at = 8 * (size_t)w;
            if (at < num_bytes)
                memcpy(word, bytes + at, num_bytes - at < 8 ? num_bytes - at : 8);
            out[w] = load64_le(word);
        }
    }
    if (bytes != stack)
        PyMem_Free(bytes);
    return rc;
}

/* One tier as the walk sees it: its table, how a value becomes reachability (store tiers hold
 * node masks, mapped to the instances on those nodes), and the last value converted to words
 * (consecutive keys mostly share one interned mask). */
typedef struct {
    KeyTable *table;      /* NULL: the tier is empty, skip it */
    PyObject *members;    /* node mask -> instance mask memo (dict), NULL for the device tier */
    PyObject *fill;       /* called with a node mask missing from ``members``: its instance mask */
    PyObject *last;       /* borrowed: the value ``words`` holds; only compared by identity */
    uint64_t *words;
} Tier;

/* The tier's value for ``key`` (borrowed; ``zero`` when absent). */
static inline PyObject *tier_value(const Tier *tier, PyObject *key, PyObject *zero)
{
    uint64_t k0, k1;
    PyObject *value = NULL;
    if (tier->table != NULL && key_of(key, &k0, &k1))
        value = tier->table->slots[probe(tier->table, k0, k1)].value;
    return value != NULL ? value : zero;
}

/* Make ``tier->words`` the reachability of ``value``. */
static int tier_load(Tier *tier, PyObject *value, Py_ssize_t num_words, PyObject *zero)
{
    if (value == tier->last)
        return 0;
    tier->last = value; /* table values outlive the call: nothing else runs on the table */
    if (value == zero) {
        memset(tier->words, 0, 8 * (size_t)num_words);
        return 0;
    }
    if (tier->members == NULL)
        return words_of(value, tier->words, num_words);
    PyObject *members = PyDict_GetItemWithError(tier->members, value);
    if (members != NULL)
        return words_of(members, tier->words, num_words);
    if (PyErr_Occurred() || (members = PyObject_CallOneArg(tier->fill, value)) == NULL)
        return -1;
    int rc = words_of(members, tier->words, num_words);
    Py_DECREF(members);
    return rc;
}

/* Add ``times`` keys' blocks to each live bit's count, in the fastest tier reaching it. */
static void add_counts(Py_ssize_t *counts, const uint64_t *alive, const Tier *tiers,
                       Py_ssize_t num_words, Py_ssize_t times)
{
    const uint64_t *dev = tiers[0].words, *hst = tiers[1].words;
    for (Py_ssize_t wd = 0; wd < num_words; wd++) {
        uint64_t now = alive[wd];
        Py_ssize_t *c = counts + 3 * 64 * wd;
        for (uint64_t m = now & dev[wd]; m; m &= m - 1)
            c[3 * __builtin_ctzll(m)] += times;
        for (uint64_t m = now & ~dev[wd] & hst[wd]; m; m &= m - 1)
            c[3 * __builtin_ctzll(m) + 1] += times;
        for (uint64_t m = now & ~dev[wd] & ~hst[wd]; m; m &= m - 1)
            c[3 * __builtin_ctzll(m) + 2] += times;
    }
}

static int tier_init(Tier *tier, PyObject *table, PyObject *members, PyObject *fill)
{
    if (!PyObject_TypeCheck(table, &KeyTableType)) {
        PyErr_Format(PyExc_TypeError, "expected a KeyTable, got %R", table);
        return -1;
    }
    tier->table = ((KeyTable *)table)->used ? (KeyTable *)table : NULL;
    tier->members = members;
    tier->fill = fill;
    tier->last = NULL;
    return 0;
}

/* Append (bit, num_device, num_host, num_disk) for every bit of ``first`` to ``out``. */
static int emit_runs(PyObject *out, const uint64_t *first, Py_ssize_t num_words,
                     const Py_ssize_t *counts)
{
    for (Py_ssize_t w = 0; w < num_words; w++) {
        for (uint64_t m = first[w]; m; m &= m - 1) {
            Py_ssize_t b = 64 * w + __builtin_ctzll(m);
            PyObject *run = Py_BuildValue("(nnnn)", b, counts[3 * b], counts[3 * b + 1],
                                          counts[3 * b + 2]);
            if (run == NULL || PyList_Append(out, run) < 0) {
                Py_XDECREF(run);
                return -1;
            }
            Py_DECREF(run);
        }
    }
    return 0;
}

/* The prefix walk's result: the bits reachable at the first key (``first``, ``num_words``
 * words) and, per bit, its run's (device, host, disk) blocks (``counts``, 3 per bit). */
typedef struct {
    uint64_t *buf;      /* alive, first, then one word row per tier */
    Py_ssize_t *counts;
    Py_ssize_t num_words;
} Walk;

static void walk_free(Walk *w)
{
    PyMem_Free(w->buf);
    PyMem_Free(w->counts);
}

/* The walk of prefix_runs and prefix_groups (same arguments). 1: ``w`` holds the runs (free it
 * with walk_free); 0: no instance holds the first key; -1: an exception is set. */
static int prefix_walk(PyObject *args, const char *fmt, Walk *w)
{
    PyObject *keys, *device, *host, *disk, *members, *fill;
    w->buf = NULL;
    w->counts = NULL;
    w->num_words = 0;
    if (!PyArg_ParseTuple(args, fmt, &keys, &device, &host, &disk, &PyDict_Type, &members, &fill))
        return -1;
    Tier tiers[3];
    if (tier_init(&tiers[0], device, NULL, NULL) < 0 || tier_init(&tiers[1], host, members, fill) < 0 ||
        tier_init(&tiers[2], disk, members, fill) < 0)
        return -1;
    PyObject *seq = PySequence_Fast(keys, "prefix_runs: keys must be a sequence");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *zero = PyLong_FromLong(0), *first = NULL;
    int rc = 0;
    if (zero == NULL) {
        rc = -1;
        goto done;
    }
    if (n == 0)
        goto done;
    /* the first key decides the width: reach_0 = device | host members | disk members */
    first = Py_NewRef(zero);
    for (int t = 0; t < 3; t++) {
        PyObject *value = NULL;
        uint64_t k0, k1;
        if (tiers[t].table != NULL && key_of(items[0], &k0, &k1))
            value = tiers[t].table->slots[probe(tiers[t].table, k0, k1)].value;
        if (value == NULL)
            continue;
        PyObject *reach = value;
        if (tiers[t].members != NULL) {
            if ((reach = PyDict_GetItemWithError(members, value)) != NULL)
                Py_INCREF(reach);
            else if (PyErr_Occurred() || (reach = PyObject_CallOneArg(fill, value)) == NULL)
                goto fail;
        } else {
            Py_INCREF(reach);
        }
        Py_SETREF(first, PyNumber_Or(first, reach));
        Py_DECREF(reach);
        if (first == NULL)
            goto fail;
    }
    if (PyObject_Not(first))
        goto done;
    Py_ssize_t num_words = (Py_ssize_t)((_PyLong_NumBits(first) + 63) / 64);
    w->num_words = num_words;
    /* words: alive, first, device, host, disk; counts: 3 per bit */
    w->buf = PyMem_Calloc(5 * num_words, sizeof(uint64_t));
    w->counts = PyMem_Calloc(3 * 64 * num_words, sizeof(Py_ssize_t));
    if (w->buf == NULL || w->counts == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint64_t *alive = w->buf, *first_words = w->buf + num_words;
    Py_ssize_t *counts = w->counts;
    for (int t = 0; t < 3; t++)
        tiers[t].words = w->buf + (2 + t) * num_words;
    if (words_of(first, first_words, num_words) < 0)
        goto fail;
    memcpy(alive, first_words, 8 * num_words);
    Py_ssize_t pending = 0;
    uint64_t any_alive = 1;
    for (Py_ssize_t start = 0, stop = 1; start < n; start = stop, stop = start + 8 > n ? n : start + 8) {
        for (Py_ssize_t i = start; i < stop; i++) {
            uint64_t k0, k1;
            if (key_of(items[i], &k0, &k1))
                for (int t = 0; t < 3; t++)
                    if (tiers[t].table != NULL)
                        prefetch_home(tiers[t].table, k0, k1);
        }
        for (Py_ssize_t i = start; i < stop; i++) {
            PyObject *values[3];
            for (int t = 0; t < 3; t++)
                values[t] = tier_value(&tiers[t], items[i], zero);
            /* The same holder masks as the previous key (interned: the same objects, the common
             * case along a shared prefix): the live bits and their counts repeat, so the count
             * is deferred instead of walking every holder's bit again. */
            if (values[0] == tiers[0].last && values[1] == tiers[1].last && values[2] == tiers[2].last) {
                pending++;
                continue;
            }
            if (pending) {
                add_counts(counts, alive, tiers, num_words, pending);
                pending = 0;
            }
            for (int t = 0; t < 3; t++)
                if (tier_load(&tiers[t], values[t], num_words, zero) < 0)
                    goto fail;
            const uint64_t *dev = tiers[0].words, *hst = tiers[1].words, *dsk = tiers[2].words;
            any_alive = 0;
            for (Py_ssize_t wd = 0; wd < num_words; wd++) {
                alive[wd] &= dev[wd] | hst[wd] | dsk[wd];
                any_alive |= alive[wd];
            }
            if (!any_alive)
                break;
            add_counts(counts, alive, tiers, num_words, 1);
        }
        if (!any_alive)
            break;
    }
    if (pending)
        add_counts(counts, alive, tiers, num_words, pending);
    rc = 1;
    goto done;
fail:
    walk_free(w);
    w->buf = NULL;
    w->counts = NULL;
    rc = -1;
done:
    Py_XDECREF(first);
    Py_XDECREF(zero);
    Py_DECREF(seq);
    return rc;
}

/* prefix_runs(keys, device, host, disk, members_of_mask, instances_on)
 *     -> list[tuple[bit, num_device, num_host, num_disk]]
 *
 * Per instance bit with a non-empty leading run of ``keys``: the run's blocks by fastest tier.
 * A key is reachable by an instance if its bit is in the key's device mask, or its node's bit in
 * the key's host or disk (node) mask; ``members_of_mask`` maps node masks to instance masks and
 * ``instances_on(node_mask)`` fills it. Keys are walked in chunks (the first alone, then 8 at a
 * time, each chunk's slots prefetched) and the walk stops with the chunk where the last run ends.
 * Only the bits reachable at the first key can have a run, so masks are cut to its width. */
static PyObject *mod_prefix_runs(PyObject *self, PyObject *args)
{
    Walk w;
    int rc = prefix_walk(args, "OOOOO!O:prefix_runs", &w);
    if (rc < 0)
        return NULL;
    PyObject *out = PyList_New(0);
    if (out != NULL && rc == 1 && emit_runs(out, w.buf + w.num_words, w.num_words, w.counts) < 0)
        Py_CLEAR(out);
    walk_free(&w);
    return out;
}

/* prefix_groups(keys, device, host, disk, members_of_mask, instances_on)
 *     -> (list[tuple[num_device, num_host, num_disk]], bits: bytes, runs: bytes)
 *
 * prefix_runs grouped by run: the distinct runs in the order of their first holder bit, and, as
 * native int64 arrays (bytes), every holder's bit in ascending order and the index of its run in
 * that list. With a system prompt on every instance nearly all holders share one run, and the
 * caller handles each run once instead of each holder. */
static PyObject *mod_prefix_groups(PyObject *self, PyObject *args)
{
    Walk w;
    int rc = prefix_walk(args, "OOOOO!O:prefix_groups", &w);
    if (rc < 0)
        return NULL;
    PyObject *runs = PyList_New(0), *bits = NULL, *run_of = NULL, *out = NULL;
    int64_t *slots = NULL, *bit_buf = NULL, *run_buf = NULL;
    if (runs == NULL)
        goto done;
    Py_ssize_t num_holders = 0;
    const uint64_t *first = rc == 1 ? w.buf + w.num_words : NULL;
    for (Py_ssize_t i = 0; first != NULL && i < w.num_words; i++)
        num_holders += __builtin_popcountll(first[i]);
    /* open addressing over the runs seen: slot -> run index + 1 (0 empty) */
    size_t capacity = 8;
    while (capacity < 2 * (size_t)num_holders)
        capacity <<= 1;
    slots = PyMem_Calloc(capacity, sizeof(int64_t));
    bit_buf = PyMem_Malloc((num_holders ? num_holders : 1) * sizeof(int64_t));
    run_buf = PyMem_Malloc((num_holders ? num_holders : 1) * sizeof(int64_t));
    Py_ssize_t *run_counts = PyMem_Malloc((num_holders ? num_holders : 1) * 3 * sizeof(Py_ssize_t));
    if (slots == NULL || bit_buf == NULL || run_buf == NULL || run_counts == NULL) {
        PyMem_Free(run_counts);
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t h = 0, num_runs = 0;
    for (Py_ssize_t wd = 0; first != NULL && wd < w.num_words; wd++) {
        for (uint64_t m = first[wd]; m; m &= m - 1, h++) {
            Py_ssize_t b = 64 * wd + __builtin_ctzll(m);
            const Py_ssize_t *c = w.counts + 3 * b;
            uint64_t hash = ((uint64_t)c[0] * 0x9E3779B97F4A7C15ull) ^ ((uint64_t)c[1] * 0xC2B2AE3D27D4EB4Full)
                            ^ ((uint64_t)c[2] * 0x165667B19E3779F9ull);
            size_t s = (size_t)(hash ^ (hash >> 29)) & (capacity - 1);
            for (;; s = (s + 1) & (capacity - 1)) {
                int64_t r = slots[s] - 1;
                if (r < 0) {
                    r = num_runs++;
                    slots[s] = r + 1;
                    memcpy(run_counts + 3 * r, c, 3 * sizeof(Py_ssize_t));
                    PyObject *run = Py_BuildValue("(nnn)", c[0], c[1], c[2]);
                    if (run == NULL || PyList_Append(runs, run) < 0) {
                        Py_XDECREF(run);
                        PyMem_Free(run_counts);
                        goto done;
                    }
                    Py_DECREF(run);
                }
                const Py_ssize_t *rc3 = run_counts + 3 * r;
                if (rc3[0] == c[0] && rc3[1] == c[1] && rc3[2] == c[2]) {
                    bit_buf[h] = b;
                    run_buf[h] = r;
                    break;
                }
            }
        }
    }
    PyMem_Free(run_counts);
    bits = PyBytes_FromStringAndSize((const char *)bit_buf, num_holders * (Py_ssize_t)sizeof(int64_t));
    run_of = PyBytes_FromStringAndSize((const char *)run_buf, num_holders * (Py_ssize_t)sizeof(int64_t));
    if (bits != NULL && run_of != NULL)
        out = PyTuple_Pack(3, runs, bits, run_of);
done:
    PyMem_Free(slots);
    PyMem_Free(bit_buf);
    PyMem_Free(run_buf);
    Py_XDECREF(runs);
    Py_XDECREF(bits);
    Py_XDECREF(run_of);
    walk_free(&w);
    return out;
}

/* ------------------------------------------------------------------ module functions */

static PyObject *mod_blake2b_128(PyObject *self, PyObject *args)
{
    Py_buffer data, person;
    if (!PyArg_ParseTuple(args, "y*y*:blake2b_128", &data, &person))
        return NULL;
    PyObject *out = NULL;
    if (person.len > PERSON_BYTES) {
        PyErr_Format(PyExc_ValueError, "person is at most %d bytes", PERSON_BYTES);
    } else {
        uint64_t param_state[8];
        uint8_t digest[DIGEST_BYTES];
        B2b s;
        b2b_param_state(param_state, person.buf, (size_t)person.len);
        b2b_init(&s, param_state);
        b2b_update(&s, data.buf, (size_t)data.len);
        b2b_final(&s, digest);
        out = PyBytes_FromStringAndSize((const char *)digest, DIGEST_BYTES);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&person);
    return out;
}

static PyObject *mod_msgpack_token_ids(PyObject *self, PyObject *arg)
{
    Py_buffer raw;
    if (PyObject_GetBuffer(arg, &raw, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t num_tokens;
    uint8_t *packed = parse_token_ids(raw.buf, raw.len, &num_tokens);
    PyBuffer_Release(&raw);
    if (packed == NULL)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize((const char *)packed, num_tokens * 4);
    PyMem_Free(packed);
    return out;
}

static PyObject *mod_chain_keys_msgpack(PyObject *self, PyObject *args)
{
    Py_buffer parent, raw;
    Py_ssize_t block_size;
    if (!PyArg_ParseTuple(args, "y*y*n:chain_keys_msgpack", &parent, &raw, &block_size))
        return NULL;
    PyObject *keys = NULL;
    uint8_t *packed = NULL;
    Py_ssize_t num_tokens = 0;
    if (parent.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "parent key must be %d bytes", KEY_BYTES);
        goto done;
    }
    if (block_size < 1) {
        PyErr_Format(PyExc_ValueError, "block_size must be a positive number of tokens, got %zd",
                     block_size);
        goto done;
    }
    if ((packed = parse_token_ids(raw.buf, raw.len, &num_tokens)) == NULL)
        goto done;
    Py_ssize_t num_blocks = num_tokens / block_size;
    if ((keys = PyList_New(num_blocks)) == NULL)
        goto done;
    uint8_t key[KEY_BYTES];
    memcpy(key, parent.buf, KEY_BYTES);
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        B2b s;
        b2b_init(&s, block_param_state);
        b2b_update(&s, key, KEY_BYTES);
        b2b_update(&s, packed + 4 * b * block_size, 4 * (size_t)block_size);
        b2b_final(&s, key);
        PyObject *k = PyBytes_FromStringAndSize((const char *)key, KEY_BYTES);
        if (k == NULL) {
            Py_CLEAR(keys);
            goto done;
        }
        PyList_SET_ITEM(keys, b, k);
    }
done:
    PyMem_Free(packed);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&raw);
    return keys;
}

static PyMethodDef module_methods[] = {
    {"prefix_runs", mod_prefix_runs, METH_VARARGS,
     "prefix_runs(keys, device, host, disk, members_of_mask, instances_on) -> list of (bit, "
     "num_device, num_host, num_disk): every leading run of keys, by fastest tier."},
    {"prefix_groups", mod_prefix_groups, METH_VARARGS,
     "prefix_groups(keys, device, host, disk, members_of_mask, instances_on) -> (runs, bits, "
     "run_of): prefix_runs grouped by run: the distinct (num_device, num_host, num_disk) runs, and "
     "as int64 bytes each holder's bit (ascending) and its run's index."},
    {"blake2b_128", mod_blake2b_128, METH_VARARGS,
     "blake2b_128(data, person) -> bytes: hashlib.blake2b(data, digest_size=16, person=person)."},
    {"msgpack_token_ids", mod_msgpack_token_ids, METH_O,
     "msgpack_token_ids(raw) -> bytes: a msgpack array of uint32 token ids as little-endian "
     "uint32 bytes; ValueError for anything else."},
    {"chain_keys_msgpack", mod_chain_keys_msgpack, METH_VARARGS,
     "chain_keys_msgpack(parent, raw, block_size) -> list[bytes]: kvstore.keys.chain_keys of the "
     "token ids in the msgpack array raw; ValueError if raw is not such an array."},
    {NULL},
};

static struct PyModuleDef kvtable_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "conductor._kvtable",
    .m_doc = "The KV index's key table and engine-event key translation, in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__kvtable(void)
{
    b2b_param_state(block_param_state, (const uint8_t *)BLOCK_PERSON, sizeof(BLOCK_PERSON) - 1);
    if (PyType_Ready(&KeyTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&kvtable_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "KeyTable", (PyObject *)&KeyTableType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
