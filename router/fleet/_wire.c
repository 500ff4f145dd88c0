/* The two header loops of every proxied request, compiled (loaded by router/fleet/upstream.py).
 *
 * header_pairs(block): the (name, value) pairs of a worker's answer's header lines, when each is
 *   "token:value\r\n" in ASCII with no value ending in a blank: what upstream.py's two regexes
 *   (_HEADER_BLOCK's check, then _HEADER.findall) give. None for anything else (non-ASCII, an
 *   invalid or unusual line), and then the Python code runs and gives its answer or error.
 * header_lines(headers): "name: value\r\n" of each item, when all are ASCII str without CR or
 *   LF: what upstream.header_lines gives. NotImplemented for anything else (a value that is not
 *   a str, a newline to refuse, non-ASCII, an item that is not an exact 2-tuple, a mapping whose
 *   truth or len() is not what its items say), and then the Python function runs.
 *
 * chunks(data, pos): the data of the plain complete chunks of a chunked body from ``pos`` on,
 *   joined, and where they end (see the function).
 *
 * All only ever answer what the Python code would answer, or decline (leave the rest to it); tests/unit/test_wire.py
 * compares them on random inputs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static unsigned char is_token[256];

static void init_tokens(void) {
    const char *extra = "!#$%&'*+-.^_`|~";
    for (int c = '0'; c <= '9'; c++) is_token[c] = 1;
    for (int c = 'a'; c <= 'z'; c++) is_token[c] = 1;
    for (int c = 'A'; c <= 'Z'; c++) is_token[c] = 1;
    for (const char *p = extra; *p; p++) is_token[(unsigned char)*p] = 1;
}

static PyObject *ascii_str(const char *data, Py_ssize_t n) {
    PyObject *s = PyUnicode_New(n, 127);
    if (s != NULL) memcpy(PyUnicode_1BYTE_DATA(s), data, (size_t)n);
    return s;
}

static PyObject *wire_header_pairs(PyObject *self, PyObject *block) {
    if (!PyUnicode_Check(block) || PyUnicode_READY(block) < 0 || !PyUnicode_IS_ASCII(block))
        Py_RETURN_NONE;
    const char *s = (const char *)PyUnicode_1BYTE_DATA(block);
    Py_ssize_t n = PyUnicode_GET_LENGTH(block), pos = 0;
    PyObject *pairs = PyList_New(0);
    if (pairs == NULL) return NULL;
    while (pos < n) {
        Py_ssize_t name = pos;
        while (pos < n && is_token[(unsigned char)s[pos]]) pos++;
        if (pos == name || pos >= n || s[pos] != ':') goto decline;
        Py_ssize_t name_end = pos++;
        Py_ssize_t value = pos;
        while (pos < n && s[pos] != '\r' && s[pos] != '\n') pos++;
        if (pos + 1 >= n || s[pos] != '\r' || s[pos + 1] != '\n') goto decline;
        if (s[pos - 1] == ' ' || s[pos - 1] == '\t') goto decline;  /* a trailing blank (or a blank value) */
        Py_ssize_t value_end = pos;
        while (value < value_end && (s[value] == ' ' || s[value] == '\t')) value++;
        pos += 2;
        PyObject *k = ascii_str(s + name, name_end - name);
        PyObject *v = k == NULL ? NULL : ascii_str(s + value, value_end - value);
        PyObject *pair = v == NULL ? NULL : PyTuple_Pack(2, k, v);
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (pair == NULL || PyList_Append(pairs, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(pairs);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return pairs;
decline:
    Py_DECREF(pairs);
    Py_RETURN_NONE;
}

/* 1: appended; 0: decline (not an ASCII str, or a CR or LF in it); -1: error */
static int usable(PyObject *s) {
    if (!PyUnicode_Check(s) || PyUnicode_READY(s) < 0 || !PyUnicode_IS_ASCII(s)) return 0;
    const char *d = (const char *)PyUnicode_1BYTE_DATA(s);
    Py_ssize_t n = PyUnicode_GET_LENGTH(s);
    return memchr(d, '\r', (size_t)n) == NULL && memchr(d, '\n', (size_t)n) == NULL;
}

static PyObject *wire_header_lines(PyObject *self, PyObject *headers) {
    PyObject *items;
    int exact = PyDict_CheckExact(headers);
    if (exact) {
        items = PyDict_Items(headers);
    } else {
        /* The Python code tests ``headers`` for truth before it calls items() (an empty one is "",
         * even one without items(), such as []): the same test first, its error raised as there */
        int truth = PyObject_IsTrue(headers);
        if (truth < 0) return NULL;
        if (!truth) {  /* "" where len() is 0 as it then checks; anything else left to it */
            Py_ssize_t size = PyObject_Size(headers);
            if (size == 0) return PyUnicode_New(0, 127);
            PyErr_Clear();
            Py_RETURN_NOTIMPLEMENTED;
        }
        PyObject *view = PyObject_CallMethod(headers, "items", NULL);
        if (view == NULL) return NULL;
        items = PySequence_List(view);
        Py_DECREF(view);
    }
    if (items == NULL) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(items), total = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        /* exact: str.join iterates a tuple subclass by its own __iter__, which this does not call */
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 2) goto decline;
        PyObject *k = PyTuple_GET_ITEM(item, 0), *v = PyTuple_GET_ITEM(item, 1);
        if (usable(k) <= 0 || usable(v) <= 0) goto decline;
        Py_ssize_t line = PyUnicode_GET_LENGTH(k) + PyUnicode_GET_LENGTH(v) + 4;
        if (total > PY_SSIZE_T_MAX - line) goto decline;  /* the same strings many times over: Python's error */
        total += line;
    }
    if (!exact) {
        /* The Python code then compares its newline count with len(headers): a mapping whose len()
         * is not its items' count (or raises) is left to it */
        Py_ssize_t size = PyObject_Size(headers);
        if (size < 0) {
            Py_DECREF(items);
            return NULL;
        }
        if (size != count) goto decline;
    }
    PyObject *out = PyUnicode_New(total, 127);
    if (out == NULL) {
        Py_DECREF(items);
        return NULL;
    }
    char *p = (char *)PyUnicode_1BYTE_DATA(out);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *k = PyTuple_GET_ITEM(item, 0), *v = PyTuple_GET_ITEM(item, 1);
        Py_ssize_t kn = PyUnicode_GET_LENGTH(k), vn = PyUnicode_GET_LENGTH(v);
        memcpy(p, PyUnicode_1BYTE_DATA(k), (size_t)kn);
        p += kn;
        *p++ = ':';
        *p++ = ' ';
        memcpy(p, PyUnicode_1BYTE_DATA(v), (size_t)vn);
        p += vn;
        *p++ = '\r';
        *p++ = '\n';
    }
    Py_DECREF(items);
    return out;
decline:
    Py_DECREF(items);
    Py_RETURN_NOTIMPLEMENTED;
}


/* chunks(data, pos) -> (payload, end): the data of the plain, complete chunks of a chunked body
 * that start at ``pos`` of ``data`` (bytes), joined, and where the first chunk it does not take
 * starts. A plain chunk is a size line of hex digits only (no extension, blank, sign or ``0x``:
 * what upstream.py's parser reads as int(line, 16) whatever it strips), CRLF, then that many
 * bytes and CRLF, all in ``data``. It stops at the last chunk (size 0), at anything else (an
 * extension, a malformed line: upstream.py's parser answers or raises for it), and at a chunk not
 * all in yet; upstream.py parses from ``end`` on. The bytes pushed are those the parser would
 * push chunk by chunk, joined. */
static PyObject *wire_chunks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_CheckExact(args[0]) || !PyLong_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "chunks(data: bytes, pos: int)");
        return NULL;
    }
    const char *s = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    if (pos < 0 || pos > n) {
        PyErr_SetString(PyExc_ValueError, "pos out of range");
        return NULL;
    }
    Py_ssize_t start = pos, total = 0, first_at = -1, first_len = 0, count = 0;
    /* first pass: where the plain chunks end, and their data's total length */
    while (pos < n) {
        Py_ssize_t p = pos;
        unsigned long long size = 0;
        int digits = 0;
        while (p < n && digits <= 15) {
            unsigned char c = (unsigned char)s[p];
            int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
            if (v < 0) break;
            size = size * 16 + (unsigned long long)v;
            digits++;
            p++;
        }
        if (digits == 0 || digits > 15 || size == 0) break;
        if (p + 1 >= n || s[p] != '\r' || s[p + 1] != '\n') break;
        p += 2;
        if ((unsigned long long)(n - p) < size + 2) break;  /* not all in yet */
        if (s[p + size] != '\r' || s[p + size + 1] != '\n') break;
        if (count++ == 0) {
            first_at = p;
            first_len = (Py_ssize_t)size;
        }
        total += (Py_ssize_t)size;
        pos = p + (Py_ssize_t)size + 2;
    }
    PyObject *payload;
    if (count == 0) {
        payload = PyBytes_FromStringAndSize(NULL, 0);
    } else if (count == 1) {
        payload = PyBytes_FromStringAndSize(s + first_at, first_len);
    } else {
        payload = PyBytes_FromStringAndSize(NULL, total);
        if (payload != NULL) {
            char *out = PyBytes_AS_STRING(payload);
            Py_ssize_t p = start;
            while (p < pos) {  /* the same chunks again, known good */
                unsigned long long size = 0;
                while (s[p] != '\r') {
                    unsigned char c = (unsigned char)s[p++];
                    size = size * 16 + (unsigned long long)(c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
                }
                p += 2;
                memcpy(out, s + p, (size_t)size);
                out += size;
                p += (Py_ssize_t)size + 2;
            }
        }
    }
    if (payload == NULL) return NULL;
    PyObject *result = Py_BuildValue("(Nn)", payload, pos);
    return result;
}

static PyMethodDef wire_methods[] = {
    {"header_pairs", wire_header_pairs, METH_O,
     "header_pairs(block): the (name, value) pairs of plain ASCII header lines, or None (see the source)."},
    {"chunks", (PyCFunction)(void (*)(void))wire_chunks, METH_FASTCALL,
     "chunks(data, pos): (the plain complete chunks' data from pos on, joined; where they end) (see the source)."},
    {"header_lines", wire_header_lines, METH_O,
     "header_lines(headers): 'name: value\\r\\n' of each item, or NotImplemented (see the source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef wire_module = {
    PyModuleDef_HEAD_INIT, "_wire", "The header loops of every proxied request, compiled (see upstream.py).", -1,
    wire_methods,
};

PyMODINIT_FUNC PyInit__wire(void) {
    init_tokens();
    return PyModule_Create(&wire_module);
}
