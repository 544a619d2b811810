/* Engram n-gram hashing in one C call per batch: the data-loader hot path of engram/hashing/ngram.py.
 *
 * ids [B, T] -> out [B, T, G, H] with out = mix_g % prime_{g,j} + offset_{g,j}, where the mix
 * of group g = (layer l, order n) is XOR_{k<n} x[t-k] * m_{l,k} (wrapping 64-bit) over the
 * compressed ids x, left-padded with the compressed pad id (and, with segment ids, the pad id
 * for a token of another segment). The modulo is the exact float64 computation of
 * engram/hashing/kernels.py (steps 1a, 2a, 3 and 4 of its docstring, whose proof holds for any
 * summation order, fused or not): the 16-bit parts a_i of mix, y = sum_i a_i * w_{g,i,j},
 * f = y - floor(y), z = f * prime + (2**52 + offset), out = bits(z) - bits(2**52).
 * Python checks the preconditions (plan_exact_mod with 16-bit parts, 0 <= x * m < 2**63) and
 * keeps the numpy/torch kernel as the fallback when this module is not built.
 *
 * Built by `pip install` (setup.py, optional: a failed build falls back to the Python kernel).
 * -fno-trapping-math lets GCC vectorise floor(); on x86-64 Linux GCC also emits AVX-512 and
 * AVX2 clones of the loops, chosen at load time. Tokens go in blocks of BLOCK: gather, then
 * the mixes vectorised over tokens, then the heads' modulo vectorised over heads. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_NGRAM 16

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

typedef struct {
    const int64_t *ids;       /* [B, T] */
    const int64_t *seg;       /* [B, T] or NULL */
    const int32_t *lookup;    /* [n_ids] or NULL (ids are already compressed); int32 halves
                                 its cache footprint, and its random reads are the cost */
    const uint64_t *mult;     /* [L, N] */
    const double *weight;     /* [G, 4, H] */
    const double *prime;      /* [G, H] */
    const double *magic_off;  /* [G, H]: 2**52 + offset */
    int64_t *out;             /* [B, T, G, H] */
    double *parts;            /* scratch [G][4][BLOCK]: the mixes' 16-bit parts */
    uint64_t *scratch_tok;    /* scratch [N][BLOCK]: the token k steps back */
    uint64_t *scratch_mix;    /* scratch [BLOCK] */
    int64_t B, T, L, N, H, n_ids, pad;
} hash_args;

/* Tokens per block: phase 1 gathers their compressed ids (independent loads, many in flight)
 * and turns their mixes into float parts; phase 2 is then a pure stream of vector work. */
#define BLOCK 128

/* Returns -1, or the flat index of the first id outside [0, n_ids). H_ is H as a constant in
 * the specialised copies (the head loop then vectorises without a remainder loop). */
static inline __attribute__((always_inline)) int64_t hash_body(const hash_args *a, const int64_t H_) {
    const int64_t T = a->T, L = a->L, N = a->N, K = N - 1, G = L * K;
    const uint64_t magic_bits = 0x4330000000000000ULL; /* bits of 2**52 */
    const uint64_t pad = (uint64_t)a->pad;
    uint64_t comp[MAX_NGRAM - 1 + BLOCK]; /* compressed ids of positions t0 - K .. t0 + nb - 1 */
    for (int64_t b = 0; b < a->B; b++) {
        const int64_t *row = a->ids + b * T;
        const int64_t *srow = a->seg ? a->seg + b * T : NULL;
        for (int64_t k = 0; k < K; k++) comp[k] = pad; /* left padding of the row */
        for (int64_t t0 = 0; t0 < T; t0 += BLOCK) {
            const int64_t nb = T - t0 < BLOCK ? T - t0 : BLOCK;
            if (t0 > 0) /* the last K ids of the previous block */
                for (int64_t k = 0; k < K; k++) comp[k] = comp[BLOCK + k];
            /* phase 1a: compressed ids */
            for (int64_t i = 0; i < nb; i++) {
                const int64_t id = row[t0 + i];
                if (id < 0 || id >= a->n_ids) return b * T + t0 + i;
                comp[K + i] = (uint64_t)(a->lookup ? a->lookup[id] : id);
            }
            /* phase 1b, vectorised over the block's tokens: the token k steps back (the pad
             * before the row start and across segment changes), the mixes, their parts */
            uint64_t *tk = a->scratch_tok; /* [N][BLOCK] */
            for (int64_t k = 0; k < N; k++)
                for (int64_t i = 0; i < nb; i++) {
                    const int64_t t = t0 + i;
                    const int other = k > t || (srow && srow[t - k] != srow[t]);
                    tk[k * BLOCK + i] = other ? pad : comp[K + i - k];
                }
            for (int64_t l = 0; l < L; l++) {
                const uint64_t *m = a->mult + l * N;
                uint64_t *acc = a->scratch_mix; /* [BLOCK] */
                for (int64_t i = 0; i < nb; i++) acc[i] = tk[i] * m[0];
                for (int64_t n = 1; n < N; n++) {
                    double *pg = a->parts + (l * K + n - 1) * 4 * BLOCK; /* [4][BLOCK] */
                    for (int64_t i = 0; i < nb; i++) {
                        const uint64_t mix = acc[i] ^ tk[n * BLOCK + i] * m[n];
                        acc[i] = mix;
                        /* mix < 2**63: every part fits an int32, whose conversion is cheap */
                        pg[i] = (double)(int32_t)(mix & 0xFFFF);
                        pg[BLOCK + i] = (double)(int32_t)((mix >> 16) & 0xFFFF);
                        pg[2 * BLOCK + i] = (double)(int32_t)((mix >> 32) & 0xFFFF);
                        pg[3 * BLOCK + i] = (double)(int32_t)(mix >> 48);
                    }
                }
            }
            /* phase 2: per token and group, the heads' exact modulo (steps 2a, 3, 4) */
            int64_t *restrict o = a->out + (b * T + t0) * G * H_;
            for (int64_t i = 0; i < nb; i++) {
                for (int64_t g = 0; g < G; g++, o += H_) {
                    const double *pg = a->parts + g * 4 * BLOCK + i;
                    const double a0 = pg[0], a1 = pg[BLOCK], a2 = pg[2 * BLOCK], a3 = pg[3 * BLOCK];
                    const double *restrict w0 = a->weight + g * 4 * H_;
                    const double *restrict w1 = w0 + H_, *restrict w2 = w1 + H_, *restrict w3 = w2 + H_;
                    const double *restrict p = a->prime + g * H_, *restrict mo = a->magic_off + g * H_;
                    for (int64_t j = 0; j < H_; j++) {
                        const double y = a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
                        const double z = (y - floor(y)) * p[j] + mo[j];
                        uint64_t bits;
                        memcpy(&bits, &z, sizeof bits);
                        o[j] = (int64_t)(bits - magic_bits);
                    }
                }
            }
        }
    }
    return -1;
}

CLONES static int64_t hash_dispatch(const hash_args *a) {
    switch (a->H) {
        case 4: return hash_body(a, 4);
        case 8: return hash_body(a, 8);
        case 16: return hash_body(a, 16);
        default: return hash_body(a, a->H);
    }
}

/* Buffer of obj (C-contiguous, writable if asked) that must hold exactly `count` items of
 * `itemsize` bytes; obj may be None when optional. Returns 0 and fills view (view->obj NULL for
 * None), or -1. */
static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t count, Py_ssize_t itemsize,
                      int writable, int optional, const char *name) {
    view->obj = NULL;
    if (obj == Py_None && optional) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (view->len != count * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd %zd-byte items, got %zd bytes", name,
                     count, itemsize, view->len);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static PyObject *hash_ngrams(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[8]; /* ids, seg, lookup, mult, weight, prime, magic_off, out */
    hash_args a;
    long long n_ids, pad;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnnnnLL", &objs[0], &objs[1], &objs[2], &objs[3],
                          &objs[4], &objs[5], &objs[6], &objs[7], &a.B, &a.T, &a.L, &a.N, &a.H,
                          &n_ids, &pad))
        return NULL;
    a.n_ids = n_ids;
    a.pad = pad;
    if (a.B < 0 || a.T < 0 || a.L < 1 || a.N < 2 || a.N > MAX_NGRAM || a.H < 1 || n_ids < 1) {
        PyErr_SetString(PyExc_ValueError, "hash_ngrams: shape arguments out of range");
        return NULL;
    }
    const Py_ssize_t G = a.L * (a.N - 1);
    const Py_ssize_t counts[8] = {a.B * a.T, a.B * a.T, n_ids, a.L * a.N, G * 4 * a.H,
                                  G * a.H, G * a.H, a.B * a.T * G * a.H};
    static const char *names[8] = {"ids", "seg", "lookup", "mult", "weight", "prime", "magic_off", "out"};
    Py_buffer views[8];
    int held = 0; /* views[0 .. held) are acquired */
    while (held < 8 && get_buffer(objs[held], &views[held], counts[held], held == 2 ? 4 : 8,
                                  held == 7, held == 1 || held == 2, names[held]) == 0)
        held++;
    int failed = held < 8;
    int64_t bad = -1;
    if (!failed) {
        a.ids = views[0].buf;
        a.seg = views[1].obj ? views[1].buf : NULL;
        a.lookup = views[2].obj ? views[2].buf : NULL;
        a.mult = views[3].buf;
        a.weight = views[4].buf;
        a.prime = views[5].buf;
        a.magic_off = views[6].buf;
        a.out = views[7].buf;
        /* one scratch block: parts, then the shifted tokens, then the running mixes */
        void *scratch = PyMem_RawMalloc((size_t)BLOCK * (G * 4 + a.N + 1) * 8);
        if (scratch == NULL) {
            PyErr_NoMemory();
            failed = 1;
        } else {
            a.parts = scratch;
            a.scratch_tok = (uint64_t *)(a.parts + (size_t)BLOCK * G * 4);
            a.scratch_mix = a.scratch_tok + (size_t)BLOCK * a.N;
            Py_BEGIN_ALLOW_THREADS
            bad = hash_dispatch(&a);
            Py_END_ALLOW_THREADS
            PyMem_RawFree(scratch);
        }
    }
    for (int i = 0; i < held; i++)
        if (views[i].obj) PyBuffer_Release(&views[i]);
    if (failed) return NULL;
    return PyLong_FromLongLong((long long)bad);
}

static PyMethodDef methods[] = {
    {"hash_ngrams", hash_ngrams, METH_VARARGS,
     "hash_ngrams(ids, seg, lookup, mult, weight, prime, magic_off, out, B, T, L, N, H, n_ids, "
     "pad) -> -1, or the flat index of the first id outside [0, n_ids) (out is then incomplete): "
     "Engram row ids into out (see engram/hashing/native.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ngram_hash", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ngram_hash(void) { return PyModule_Create(&module); }
