/* otel_rl.bridge._otlp: an OTLP trace request (protobuf wire format) straight to the bridge's spans.
 *
 * The bridge's decoder (otel_rl/bridge/decode.py) is the reference; this module does the same work for
 * the protobuf encoding without a Python object per protobuf field.  It reads the wire format of
 * ExportTraceServiceRequest (opentelemetry/proto/collector/trace/v1) once and makes:
 *
 * - for a span with nothing unusual (no events, no links, no dropped counts, no trace state, status not
 *   ERROR, every typed attribute of its type, not a span whose records need a further check): the
 *   `ReadableSpan` itself, with the attributes `ReadableSpan.__init__` would set (their names and order
 *   come from `configure`, read off a real instance);
 * - for any other span: a tuple of its decoded fields, handed to the Python `finish` callback, which
 *   builds it as the reference decoder does (or rejects it);
 * - resources and scopes: their serialized bytes, handed to Python callbacks (they repeat in every
 *   request of a run and are cached there).
 *
 * Protobuf semantics kept: fields in any order, the last value of a scalar wins, a message field that
 * occurs twice is merged, a known field with an unexpected wire type is an unknown field, unknown fields
 * (groups too) are skipped, strings must be UTF-8.  A body that is not valid wire format raises the
 * `DecodeError` given to `configure`.
 *
 * `node(span, attributes)` is the record builder's `_node` (otel_rl/records.py) for the spans made here: it
 * reads their instance attributes directly and fills a `SpanNode`'s slots; any other span goes to the
 * Python `_node` given to `configure_nodes`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 100 /* nested messages, as protobuf's own parsers allow */

/* ---------------------------------------------------------------------------------- configuration */

static PyObject *DecodeError;   /* the exception for a body that does not parse */
static PyObject *SpanType;      /* opentelemetry.sdk.trace.ReadableSpan */
static PyObject *SpanAttrNames; /* tuple: instance attribute names, in the order __init__ sets them */
static PyObject *SpanAttrArgs;  /* tuple: for each name, the index of the __init__ argument it holds */
static PyObject *ContextType;   /* opentelemetry.trace.SpanContext (a tuple) */
static PyObject *Flags;         /* list of 256 TraceFlags (index: the low 8 bits of the span's flags) */
static PyObject *EmptyState;    /* TraceState() */
static PyObject *StatusUnset, *StatusOk;
static PyObject *Kinds;         /* list of SpanKind, index: the OTLP kind (0..5) */
static PyObject *Typed;         /* dict: attribute key -> the one type its value must have */
static PyObject *CheckedNames;  /* set: span names whose records need a further check (rl.log, ...) */
static PyObject *Finish;        /* callable(fields, resource, scope) -> ReadableSpan | str */
static PyObject *ResourceCb;    /* callable(bytes, schema_url) -> (Resource, problem | None) */
static PyObject *ScopeCb;       /* callable(bytes, schema_url) -> InstrumentationScope | None */
static PyObject *EmptyTuple;

enum { A_NAME, A_CONTEXT, A_PARENT, A_RESOURCE, A_ATTRIBUTES, A_EVENTS, A_LINKS, A_KIND, A_INFO, A_STATUS,
       A_START, A_END, A_SCOPE, N_ARGS };

static int configured = 0;

/* ---------------------------------------------------------------------------------- wire format */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Buf;

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };

static int bad(void) {
    if (!PyErr_Occurred())
        PyErr_SetString(DecodeError, "not an OTLP protobuf request");
    return -1;
}

static int rd_varint(Buf *b, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (b->p >= b->end)
            return bad();
        uint8_t c = *b->p++;
        v |= (uint64_t)(c & 0x7f) << shift;
        if (!(c & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return bad();
}

static int rd_tag(Buf *b, uint32_t *field, int *wt) {
    uint64_t t;
    if (rd_varint(b, &t) < 0)
        return -1;
    if (t > 0xFFFFFFFFu || (t >> 3) == 0)
        return bad();
    *field = (uint32_t)(t >> 3);
    *wt = (int)(t & 7);
    return 0;
}

static int rd_len(Buf *b, Buf *sub) {
    uint64_t n;
    if (rd_varint(b, &n) < 0)
        return -1;
    if (n > (uint64_t)(b->end - b->p))
        return bad();
    sub->p = b->p;
    sub->end = b->p + n;
    b->p += n;
    return 0;
}

static int rd_fixed64(Buf *b, uint64_t *out) {
    if (b->end - b->p < 8)
        return bad();
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | b->p[i];
    b->p += 8;
    *out = v;
    return 0;
}

static int rd_fixed32(Buf *b, uint32_t *out) {
    if (b->end - b->p < 4)
        return bad();
    *out = (uint32_t)b->p[0] | (uint32_t)b->p[1] << 8 | (uint32_t)b->p[2] << 16 | (uint32_t)b->p[3] << 24;
    b->p += 4;
    return 0;
}

static int skip_field(Buf *b, uint32_t field, int wt, int depth) {
    uint64_t v;
    Buf sub;
    switch (wt) {
    case WT_VARINT:
        return rd_varint(b, &v);
    case WT_I64:
        if (b->end - b->p < 8)
            return bad();
        b->p += 8;
        return 0;
    case WT_LEN:
        return rd_len(b, &sub);
    case WT_I32:
        if (b->end - b->p < 4)
            return bad();
        b->p += 4;
        return 0;
    case WT_SGROUP:
        if (depth >= MAX_DEPTH)
            return bad();
        while (1) {
            uint32_t f;
            int w;
            if (rd_tag(b, &f, &w) < 0)
                return -1;
            if (w == WT_EGROUP)
                return f == field ? 0 : bad();
            if (skip_field(b, f, w, depth + 1) < 0)
                return -1;
        }
    default:
        return bad();
    }
}

static PyObject *mk_str(Buf *s) {
    PyObject *o = PyUnicode_DecodeUTF8((const char *)s->p, s->end - s->p, NULL);
    if (o == NULL) {
        PyErr_Clear();
        bad();
    }
    return o;
}

/* Attribute keys, span names and short values repeat in every request: one str object each, kept in a
 * small direct-mapped cache (ASCII of at most 64 bytes), so that each is made and hashed once (not interned:
 * a sender's values must not outlive their spans). */
#define STR_CACHE 1024
#define STR_CACHE_MAX 64
static PyObject *str_cache[STR_CACHE];

static PyObject *mk_short_str(Buf *s) {
    Py_ssize_t n = s->end - s->p;
    if (n == 0 || n > STR_CACHE_MAX)
        return mk_str(s);
    uint32_t h = 2166136261u;
    for (const uint8_t *q = s->p; q < s->end; q++) {
        if (*q & 0x80)
            return mk_str(s); /* not ASCII */
        h = (h ^ *q) * 16777619u;
    }
    PyObject **slot = &str_cache[(h ^ (h >> 16)) & (STR_CACHE - 1)];
    PyObject *o = *slot;
    if (o != NULL && PyUnicode_GET_LENGTH(o) == n && memcmp(PyUnicode_DATA(o), s->p, n) == 0) {
        Py_INCREF(o);
        return o;
    }
    o = PyUnicode_FromKindAndData(PyUnicode_1BYTE_KIND, s->p, n);
    if (o == NULL)
        return NULL;
    Py_XSETREF(*slot, o);
    Py_INCREF(o);
    return o;
}

/* check a string field that is read but not kept */
static int check_utf8(Buf *s) {
    PyObject *o = mk_str(s);
    if (o == NULL)
        return -1;
    Py_DECREF(o);
    return 0;
}

static PyObject *bytes_of(Buf *s) {
    if (s->p == NULL)
        return PyBytes_FromStringAndSize("", 0);
    return PyBytes_FromStringAndSize((const char *)s->p, s->end - s->p);
}

/* The bytes of a message field that may occur more than once (merged: the occurrences joined). */
typedef struct {
    Buf first;
    PyObject *joined;
    int n;
} Msg;

static int msg_add(Msg *m, Buf *sub) {
    if (m->n == 0) {
        m->first = *sub;
    } else {
        PyObject *more = PyBytes_FromStringAndSize((const char *)sub->p, sub->end - sub->p);
        if (more == NULL)
            return -1;
        if (m->joined == NULL) {
            m->joined = bytes_of(&m->first);
            if (m->joined == NULL) {
                Py_DECREF(more);
                return -1;
            }
        }
        PyBytes_ConcatAndDel(&m->joined, more);
        if (m->joined == NULL)
            return -1;
    }
    m->n++;
    return 0;
}

static PyObject *msg_bytes(Msg *m) {
    if (m->joined != NULL) {
        Py_INCREF(m->joined);
        return m->joined;
    }
    if (m->n == 0)
        return PyBytes_FromStringAndSize("", 0);
    return bytes_of(&m->first);
}

/* ---------------------------------------------------------------------------------- values */

static PyObject *any_value(Buf *b, int depth);
static int kv_into(Buf *b, PyObject *dict, int depth, int *typed_ok);

/* ArrayValue (its values appended to `into`, a list) or KeyValueList (its pairs into `into`, a dict): both
 * hold their elements in field 1 */
static int values_into(Buf *b, PyObject *into, int depth) {
    if (depth >= MAX_DEPTH)
        return bad();
    int kv = PyDict_CheckExact(into);
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        if (rd_tag(b, &f, &wt) < 0)
            return -1;
        if (f != 1 || wt != WT_LEN) {
            if (skip_field(b, f, wt, depth) < 0)
                return -1;
            continue;
        }
        Buf sub;
        if (rd_len(b, &sub) < 0)
            return -1;
        if (kv) {
            if (kv_into(&sub, into, depth + 1, NULL) < 0)
                return -1;
            continue;
        }
        PyObject *v = any_value(&sub, depth + 1);
        if (v == NULL)
            return -1;
        int r = PyList_Append(into, v);
        Py_DECREF(v);
        if (r < 0)
            return -1;
    }
    return 0;
}

/* An AnyValue: str, bool, int, float, bytes, tuple (array), dict (kvlist), or None (no value, or a
 * value this decoder has no Python form for, as the reference decoder reads it). */
static PyObject *any_value(Buf *b, int depth) {
    if (depth >= MAX_DEPTH) {
        bad();
        return NULL;
    }
    PyObject *out = Py_None;
    Py_INCREF(out);
    int which = 0;        /* the oneof case last read */
    PyObject *list = NULL; /* array_value: its elements so far (a repeated array_value merges) */
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        uint64_t v;
        Buf sub;
        PyObject *x = NULL;
        if (rd_tag(b, &f, &wt) < 0)
            goto fail;
        if (f == 1 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0 || (x = mk_short_str(&sub)) == NULL)
                goto fail;
        } else if (f == 2 && wt == WT_VARINT) {
            if (rd_varint(b, &v) < 0)
                goto fail;
            x = PyBool_FromLong(v != 0);
        } else if (f == 3 && wt == WT_VARINT) {
            if (rd_varint(b, &v) < 0)
                goto fail;
            x = PyLong_FromLongLong((long long)(int64_t)v);
        } else if (f == 4 && wt == WT_I64) {
            double d;
            if (rd_fixed64(b, &v) < 0)
                goto fail;
            memcpy(&d, &v, 8);
            x = PyFloat_FromDouble(d);
        } else if (f == 5 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0)
                goto fail;
            if (which != 5 || list == NULL) {
                Py_CLEAR(list);
                if ((list = PyList_New(0)) == NULL)
                    goto fail;
            }
            if (values_into(&sub, list, depth + 1) < 0)
                goto fail;
            which = 5;
            Py_CLEAR(out);
            continue;
        } else if (f == 6 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0)
                goto fail;
            Py_CLEAR(list);
            if (which != 6 || out == NULL || !PyDict_CheckExact(out)) {
                Py_XDECREF(out);
                if ((out = PyDict_New()) == NULL)
                    goto fail;
            }
            if (values_into(&sub, out, depth + 1) < 0)
                goto fail;
            which = 6;
            continue;
        } else if (f == 7 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0)
                goto fail;
            x = PyBytes_FromStringAndSize((const char *)sub.p, sub.end - sub.p);
        } else if (f == 8 && wt == WT_VARINT) {
            if (rd_varint(b, &v) < 0)
                goto fail;
            x = Py_None; /* string_value_strindex: no Python form */
            Py_INCREF(x);
        } else {
            if (skip_field(b, f, wt, depth) < 0)
                goto fail;
            continue;
        }
        if (x == NULL)
            goto fail;
        Py_CLEAR(list);
        Py_XDECREF(out);
        out = x;
        which = (int)f;
    }
    if (which == 5) {
        Py_XDECREF(out);
        out = PyList_AsTuple(list);
        Py_DECREF(list);
    }
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(list);
    return NULL;
}

/* A KeyValue into `dict` (a later value of a key wins).  With `typed_ok`, a value of a `Typed` key that
 * is not None and not of its type clears it (as the reference decoder checks each value it reads). */
static int kv_into(Buf *b, PyObject *dict, int depth, int *typed_ok) {
    if (depth >= MAX_DEPTH)
        return bad();
    Buf key = {NULL, NULL};
    Msg val = {{NULL, NULL}, NULL, 0}; /* a repeated value field merges */
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(b, &f, &wt) < 0)
            goto fail;
        if (f == 1 && wt == WT_LEN) {
            if (rd_len(b, &key) < 0)
                goto fail;
        } else if (f == 2 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0 || msg_add(&val, &sub) < 0)
                goto fail;
        } else if (skip_field(b, f, wt, depth) < 0)
            goto fail;
    }
    PyObject *k;
    if (key.p == NULL) {
        k = PyUnicode_FromStringAndSize("", 0);
    } else {
        k = mk_short_str(&key);
    }
    if (k == NULL)
        goto fail;
    PyObject *x;
    if (val.n) {
        Buf v = val.first;
        if (val.joined != NULL) {
            v.p = (const uint8_t *)PyBytes_AS_STRING(val.joined);
            v.end = v.p + PyBytes_GET_SIZE(val.joined);
        }
        x = any_value(&v, depth + 1);
    } else {
        x = Py_None;
        Py_INCREF(x);
    }
    if (x == NULL) {
        Py_DECREF(k);
        goto fail;
    }
    if (typed_ok != NULL && x != Py_None && *typed_ok) {
        PyObject *t = PyDict_GetItemWithError(Typed, k);
        if (t != NULL && (PyObject *)Py_TYPE(x) != t)
            *typed_ok = 0;
    }
    int r = PyDict_SetItem(dict, k, x);
    Py_DECREF(k);
    Py_DECREF(x);
    Py_XDECREF(val.joined);
    return r;
fail:
    Py_XDECREF(val.joined);
    return -1;
}

/* ---------------------------------------------------------------------------------- spans */

static uint64_t be64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static int all_zero(Buf *s) {
    for (const uint8_t *q = s->p; q < s->end; q++)
        if (*q)
            return 0;
    return 1;
}

static PyObject *new_context(PyObject *trace_id, uint64_t span_id, int remote, PyObject *flags) {
    PyObject *sid = PyLong_FromUnsignedLongLong(span_id);
    if (sid == NULL)
        return NULL;
    PyObject *ctx = ((PyTypeObject *)ContextType)->tp_alloc((PyTypeObject *)ContextType, 6);
    if (ctx == NULL) {
        Py_DECREF(sid);
        return NULL;
    }
    Py_INCREF(trace_id);
    PyTuple_SET_ITEM(ctx, 0, trace_id);
    PyTuple_SET_ITEM(ctx, 1, sid);
    PyObject *r = remote ? Py_True : Py_False;
    Py_INCREF(r);
    PyTuple_SET_ITEM(ctx, 2, r);
    Py_INCREF(flags);
    PyTuple_SET_ITEM(ctx, 3, flags);
    Py_INCREF(EmptyState);
    PyTuple_SET_ITEM(ctx, 4, EmptyState);
    Py_INCREF(Py_True);
    PyTuple_SET_ITEM(ctx, 5, Py_True); /* is_valid: the ids are checked */
    return ctx;
}

typedef struct {
    PyObject *resource;
    PyObject *scope;
    PyObject *spans;  /* list: the decoded spans */
    PyObject *roots;  /* list or NULL: where parentless spans other than record spans go instead */
    PyObject *reject; /* callable(reason) */
    PyObject *refuse; /* a reason every span of this scope is refused for (its resource cannot make records) */
    uint8_t last_tid[16];
    PyObject *trace_id; /* the int of last_tid */
    /* the spans of a trace come together, and siblings with them: their parent context is made once */
    PyObject *parent_ctx;
    uint64_t parent_id;
    uint32_t parent_flags;
} Ctx;

static int reject(Ctx *c, const char *reason) {
    PyObject *r = PyObject_CallFunction(c->reject, "s", reason);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *event_or_link(Buf *b, int link, int depth) {
    /* Event: (time_unix_nano, name, attributes, dropped_attributes_count)
     * Link: (trace_id, span_id, trace_state, attributes, dropped_attributes_count, flags) */
    uint64_t time = 0, v;
    uint32_t dropped = 0, flags = 0;
    Buf name = {NULL, NULL}, tid = {NULL, NULL}, sid = {NULL, NULL}, state = {NULL, NULL};
    PyObject *attrs = PyDict_New();
    if (attrs == NULL)
        return NULL;
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(b, &f, &wt) < 0)
            goto fail;
        if (!link && f == 1 && wt == WT_I64) {
            if (rd_fixed64(b, &time) < 0)
                goto fail;
        } else if (!link && f == 2 && wt == WT_LEN) {
            if (rd_len(b, &name) < 0 || check_utf8(&name) < 0)
                goto fail;
        } else if (((!link && f == 3) || (link && f == 4)) && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0 || kv_into(&sub, attrs, depth + 1, NULL) < 0)
                goto fail;
        } else if (((!link && f == 4) || (link && f == 5)) && wt == WT_VARINT) {
            if (rd_varint(b, &v) < 0)
                goto fail;
            dropped = (uint32_t)v;
        } else if (link && f == 1 && wt == WT_LEN) {
            if (rd_len(b, &tid) < 0)
                goto fail;
        } else if (link && f == 2 && wt == WT_LEN) {
            if (rd_len(b, &sid) < 0)
                goto fail;
        } else if (link && f == 3 && wt == WT_LEN) {
            if (rd_len(b, &state) < 0 || check_utf8(&state) < 0)
                goto fail;
        } else if (link && f == 6 && wt == WT_I32) {
            if (rd_fixed32(b, &flags) < 0)
                goto fail;
        } else if (skip_field(b, f, wt, depth) < 0)
            goto fail;
    }
    PyObject *out;
    if (!link) {
        PyObject *n = name.p ? mk_str(&name) : PyUnicode_FromStringAndSize("", 0);
        if (n == NULL)
            goto fail;
        out = Py_BuildValue("(KNOI)", (unsigned long long)time, n, attrs, (unsigned int)dropped);
    } else {
        PyObject *st = state.p ? mk_str(&state) : PyUnicode_FromStringAndSize("", 0);
        if (st == NULL)
            goto fail;
        out = Py_BuildValue("(NNNOII)", bytes_of(&tid), bytes_of(&sid), st, attrs, (unsigned int)dropped,
                            (unsigned int)flags);
    }
    Py_DECREF(attrs);
    return out;
fail:
    Py_DECREF(attrs);
    return NULL;
}

static int span(Ctx *c, Buf *b, int depth) {
    Buf tid = {NULL, NULL}, sid = {NULL, NULL}, psid = {NULL, NULL}, state = {NULL, NULL}, name = {NULL, NULL};
    Buf msg = {NULL, NULL};
    uint64_t start = 0, end = 0, v;
    uint32_t flags = 0, d_attrs = 0, d_events = 0, d_links = 0;
    int64_t kind = 0, code = 0;
    int typed_ok = 1;
    PyObject *attrs = NULL, *events = NULL, *links = NULL, *n = NULL, *out = NULL;
    int ret = -1;
    if ((attrs = PyDict_New()) == NULL)
        return -1;
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(b, &f, &wt) < 0)
            goto done;
        switch (f) {
        case 1:
        case 2:
        case 4:
        case 5: {
            if (wt != WT_LEN)
                goto unknown;
            Buf *dst = f == 1 ? &tid : f == 2 ? &sid : f == 4 ? &psid : &name;
            if (rd_len(b, dst) < 0)
                goto done;
            continue;
        }
        case 3:
            if (wt != WT_LEN)
                goto unknown;
            if (rd_len(b, &state) < 0 || check_utf8(&state) < 0)
                goto done;
            continue;
        case 6:
            if (wt != WT_VARINT)
                goto unknown;
            if (rd_varint(b, &v) < 0)
                goto done;
            kind = (int32_t)v;
            continue;
        case 7:
        case 8:
            if (wt != WT_I64)
                goto unknown;
            if (rd_fixed64(b, f == 7 ? &start : &end) < 0)
                goto done;
            continue;
        case 9:
            if (wt != WT_LEN)
                goto unknown;
            if (rd_len(b, &sub) < 0 || kv_into(&sub, attrs, depth + 1, &typed_ok) < 0)
                goto done;
            continue;
        case 10:
        case 12:
        case 14:
            if (wt != WT_VARINT)
                goto unknown;
            if (rd_varint(b, &v) < 0)
                goto done;
            if (f == 10)
                d_attrs = (uint32_t)v;
            else if (f == 12)
                d_events = (uint32_t)v;
            else
                d_links = (uint32_t)v;
            continue;
        case 11:
        case 13: {
            if (wt != WT_LEN)
                goto unknown;
            if (rd_len(b, &sub) < 0)
                goto done;
            PyObject **lst = f == 11 ? &events : &links;
            if (*lst == NULL && (*lst = PyList_New(0)) == NULL)
                goto done;
            PyObject *e = event_or_link(&sub, f == 13, depth + 1);
            if (e == NULL)
                goto done;
            int r = PyList_Append(*lst, e);
            Py_DECREF(e);
            if (r < 0)
                goto done;
            continue;
        }
        case 15: {
            if (wt != WT_LEN)
                goto unknown;
            if (rd_len(b, &sub) < 0)
                goto done;
            /* Status (merged over repeated occurrences): message = 2, code = 3 */
            while (sub.p < sub.end) {
                uint32_t g;
                int w;
                if (rd_tag(&sub, &g, &w) < 0)
                    goto done;
                if (g == 2 && w == WT_LEN) {
                    if (rd_len(&sub, &msg) < 0 || check_utf8(&msg) < 0)
                        goto done;
                } else if (g == 3 && w == WT_VARINT) {
                    if (rd_varint(&sub, &v) < 0)
                        goto done;
                    code = (int32_t)v;
                } else if (skip_field(&sub, g, w, depth + 1) < 0)
                    goto done;
            }
            continue;
        }
        case 16:
            if (wt != WT_I32)
                goto unknown;
            if (rd_fixed32(b, &flags) < 0)
                goto done;
            continue;
        default:
            break;
        }
    unknown:
        if (skip_field(b, f, wt, depth) < 0)
            goto done;
    }
    n = name.p ? mk_short_str(&name) : PyUnicode_FromStringAndSize("", 0);
    if (n == NULL)
        goto done;
    if (c->refuse != NULL) { /* read whole (what is not protobuf is an error all the same), then refused */
        PyObject *r = PyObject_CallOneArg(c->reject, c->refuse);
        if (r != NULL) {
            Py_DECREF(r);
            ret = 0;
        }
        goto done;
    }
    /* ids */
    Py_ssize_t tlen = tid.p ? tid.end - tid.p : 0;
    if (tlen != 16 || all_zero(&tid)) {
        ret = reject(c, "trace_id must be 16 bytes, not all zero");
        goto done;
    }
    Py_ssize_t slen = sid.p ? sid.end - sid.p : 0;
    if (slen != 8 || all_zero(&sid)) {
        ret = reject(c, "span_id must be 8 bytes, not all zero");
        goto done;
    }
    Py_ssize_t plen = psid.p ? psid.end - psid.p : 0;
    if (plen && (plen != 8 || all_zero(&psid))) {
        ret = reject(c, "parent_span_id must be empty or 8 bytes, not all zero");
        goto done;
    }
    int checked = 0;
    if (typed_ok) {
        int has = PySet_Contains(CheckedNames, n);
        if (has < 0)
            goto done;
        checked = has;
    }
    int plain = typed_ok && !checked && events == NULL && links == NULL && !d_attrs && !d_events && !d_links &&
                (state.p == NULL || state.end == state.p) && code != 2;
    if (!plain) {
        PyObject *st = state.p ? mk_str(&state) : PyUnicode_FromStringAndSize("", 0);
        PyObject *m = msg.p ? mk_str(&msg) : PyUnicode_FromStringAndSize("", 0);
        if (st == NULL || m == NULL) {
            Py_XDECREF(st);
            Py_XDECREF(m);
            goto done;
        }
        if (events == NULL && (events = PyList_New(0)) == NULL)
            goto done_sm;
        if (links == NULL && (links = PyList_New(0)) == NULL)
            goto done_sm;
        PyObject *fields = Py_BuildValue("(NNONIOLKKOIOIOILOO)", bytes_of(&tid), bytes_of(&sid), st, bytes_of(&psid),
                                         (unsigned int)flags, n, (long long)kind, (unsigned long long)start,
                                         (unsigned long long)end, attrs, (unsigned int)d_attrs, events,
                                         (unsigned int)d_events, links, (unsigned int)d_links, (long long)code, m,
                                         typed_ok ? Py_True : Py_False);
        Py_DECREF(st);
        Py_DECREF(m);
        if (fields == NULL)
            goto done;
        out = PyObject_CallFunctionObjArgs(Finish, fields, c->resource, c->scope, NULL);
        Py_DECREF(fields);
        if (out == NULL)
            goto done;
        if (PyUnicode_Check(out)) {
            PyObject *r = PyObject_CallOneArg(c->reject, out);
            if (r == NULL)
                goto done;
            Py_DECREF(r);
        } else {
            PyObject *to = c->spans;
            if (c->roots != NULL && !plen) {
                int rec = PySet_Contains(CheckedNames, n);
                if (rec < 0)
                    goto done;
                if (!rec)
                    to = c->roots;
            }
            if (PyList_Append(to, out) < 0)
                goto done;
        }
        ret = 0;
        goto done;
    done_sm:
        Py_DECREF(st);
        Py_DECREF(m);
        goto done;
    }
    /* the plain span */
    if (c->trace_id == NULL || memcmp(c->last_tid, tid.p, 16) != 0) {
        Py_CLEAR(c->trace_id);
        Py_CLEAR(c->parent_ctx);
        uint64_t hi = be64(tid.p), lo = be64(tid.p + 8);
        if (hi == 0) {
            c->trace_id = PyLong_FromUnsignedLongLong(lo);
        } else {
            PyObject *h = PyLong_FromUnsignedLongLong(hi), *l = PyLong_FromUnsignedLongLong(lo);
            PyObject *sh = PyLong_FromLong(64);
            PyObject *hs = (h && sh) ? PyNumber_Lshift(h, sh) : NULL;
            c->trace_id = (hs && l) ? PyNumber_Or(hs, l) : NULL;
            Py_XDECREF(h);
            Py_XDECREF(l);
            Py_XDECREF(sh);
            Py_XDECREF(hs);
        }
        if (c->trace_id == NULL)
            goto done;
        memcpy(c->last_tid, tid.p, 16);
    }
    PyObject *fl = PyList_GET_ITEM(Flags, flags & 0xFF);
    PyObject *args[N_ARGS];
    for (int i = 0; i < N_ARGS; i++)
        args[i] = Py_None;
    args[A_NAME] = n;
    PyObject *ctx = new_context(c->trace_id, be64(sid.p), 0, fl);
    if (ctx == NULL)
        goto done;
    PyObject *parent = NULL;
    if (plen && c->parent_ctx != NULL && c->parent_id == be64(psid.p) && c->parent_flags == (flags & 0x3FF)) {
        parent = c->parent_ctx;
        Py_INCREF(parent);
    } else if (plen) {
        parent = new_context(c->trace_id, be64(psid.p), (flags & 0x100) && (flags & 0x200), fl);
        if (parent != NULL) {
            Py_XSETREF(c->parent_ctx, parent);
            Py_INCREF(parent);
            c->parent_id = be64(psid.p);
            c->parent_flags = flags & 0x3FF;
        }
        if (parent == NULL) {
            Py_DECREF(ctx);
            goto done;
        }
    }
    PyObject *st_ = PyLong_FromUnsignedLongLong(start), *en_ = PyLong_FromUnsignedLongLong(end);
    if (st_ == NULL || en_ == NULL) {
        Py_XDECREF(st_);
        Py_XDECREF(en_);
        Py_DECREF(ctx);
        Py_XDECREF(parent);
        goto done;
    }
    args[A_CONTEXT] = ctx;
    args[A_PARENT] = parent ? parent : Py_None;
    args[A_RESOURCE] = c->resource;
    args[A_ATTRIBUTES] = attrs;
    args[A_EVENTS] = EmptyTuple;
    args[A_LINKS] = args[A_EVENTS];
    args[A_KIND] = PyList_GET_ITEM(Kinds, (kind >= 0 && kind < PyList_GET_SIZE(Kinds)) ? kind : 1);
    args[A_INFO] = Py_None;
    args[A_STATUS] = code == 1 ? StatusOk : StatusUnset;
    args[A_START] = st_;
    args[A_END] = en_;
    args[A_SCOPE] = c->scope;
    out = PyBaseObject_Type.tp_new((PyTypeObject *)SpanType, EmptyTuple, NULL);
    int ok = out != NULL;
    Py_ssize_t na = PyTuple_GET_SIZE(SpanAttrNames);
    for (Py_ssize_t i = 0; ok && i < na; i++) {
        long a = PyLong_AsLong(PyTuple_GET_ITEM(SpanAttrArgs, i));
        if (PyObject_GenericSetAttr(out, PyTuple_GET_ITEM(SpanAttrNames, i), args[a]) < 0)
            ok = 0;
    }
    Py_DECREF(ctx);
    Py_XDECREF(parent);
    Py_DECREF(st_);
    Py_DECREF(en_);
    /* (a plain span is no record span: those are checked further, in Python) */
    if (ok && PyList_Append(c->roots != NULL && !plen ? c->roots : c->spans, out) == 0)
        ret = 0;
done:
    Py_XDECREF(out);
    Py_XDECREF(n);
    Py_XDECREF(attrs);
    Py_XDECREF(events);
    Py_XDECREF(links);
    return ret;
}

/* ---------------------------------------------------------------------------------- the request */

/* ResourceSpans and ScopeSpans begin alike: a message (field 1: the resource, the scope; merged if repeated)
 * and a schema URL (field 3), in any order among the spans.  Their bytes and URL go to `cb`, whose result
 * this returns (a new reference, or NULL with an exception). */
static PyObject *head(Buf b, PyObject *cb, int depth) {
    Msg m = {{NULL, NULL}, NULL, 0};
    Buf url = {NULL, NULL};
    PyObject *got = NULL;
    while (b.p < b.end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(&b, &f, &wt) < 0)
            goto out;
        if (f == 1 && wt == WT_LEN) {
            if (rd_len(&b, &sub) < 0 || msg_add(&m, &sub) < 0)
                goto out;
        } else if (f == 3 && wt == WT_LEN) {
            if (rd_len(&b, &url) < 0 || check_utf8(&url) < 0)
                goto out;
        } else if (skip_field(&b, f, wt, depth) < 0)
            goto out;
    }
    PyObject *raw = msg_bytes(&m);
    PyObject *u = url.p ? mk_str(&url) : PyUnicode_FromStringAndSize("", 0);
    if (raw != NULL && u != NULL)
        got = PyObject_CallFunctionObjArgs(cb, raw, u, NULL);
    Py_XDECREF(raw);
    Py_XDECREF(u);
out:
    Py_XDECREF(m.joined);
    return got;
}

static int scope_spans(Ctx *c, Buf *b, PyObject *problem, int depth) {
    int ret = -1;
    PyObject *sc = head(*b, ScopeCb, depth);
    if (sc == NULL)
        return -1;
    c->scope = sc;
    c->refuse = problem == Py_None ? NULL : problem;
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(b, &f, &wt) < 0)
            goto out_sc;
        if (f == 2 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0)
                goto out_sc;
            if (span(c, &sub, depth + 1) < 0)
                goto out_sc;
        } else if (skip_field(b, f, wt, depth) < 0)
            goto out_sc;
    }
    ret = 0;
out_sc:
    Py_XDECREF(sc);
    c->scope = NULL;
    c->refuse = NULL;
    return ret;
}

static int resource_spans(Ctx *c, Buf *b, PyObject *resources, int depth) {
    int ret = -1;
    PyObject *got = head(*b, ResourceCb, depth);
    if (got == NULL)
        goto out;
    if (!PyTuple_Check(got) || PyTuple_GET_SIZE(got) != 2) {
        PyErr_SetString(PyExc_TypeError, "the resource callback must return (resource, problem)");
        goto out;
    }
    c->resource = PyTuple_GET_ITEM(got, 0);
    if (PyList_Append(resources, c->resource) < 0)
        goto out;
    while (b->p < b->end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(b, &f, &wt) < 0)
            goto out;
        if (f == 2 && wt == WT_LEN) {
            if (rd_len(b, &sub) < 0 || scope_spans(c, &sub, PyTuple_GET_ITEM(got, 1), depth + 1) < 0)
                goto out;
        } else if (skip_field(b, f, wt, depth) < 0)
            goto out;
    }
    ret = 0;
out:
    c->resource = NULL;
    Py_XDECREF(got);
    return ret;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer body;
    PyObject *spans, *resources, *rej, *roots = Py_None;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "otel_rl.bridge._otlp is not configured");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "y*O!O!O|O:decode", &body, &PyList_Type, &spans, &PyList_Type, &resources, &rej,
                          &roots))
        return NULL;
    if (roots != Py_None && !PyList_Check(roots)) {
        PyBuffer_Release(&body);
        PyErr_SetString(PyExc_TypeError, "roots must be a list or None");
        return NULL;
    }
    Ctx c;
    memset(&c, 0, sizeof c);
    c.spans = spans;
    c.roots = roots == Py_None ? NULL : roots;
    c.reject = rej;
    Buf b = {(const uint8_t *)body.buf, (const uint8_t *)body.buf + body.len};
    int ret = 0;
    while (b.p < b.end) {
        uint32_t f;
        int wt;
        Buf sub;
        if (rd_tag(&b, &f, &wt) < 0) {
            ret = -1;
            break;
        }
        if (f == 1 && wt == WT_LEN) {
            if (rd_len(&b, &sub) < 0 || resource_spans(&c, &sub, resources, 1) < 0) {
                ret = -1;
                break;
            }
        } else if (skip_field(&b, f, wt, 0) < 0) {
            ret = -1;
            break;
        }
    }
    Py_XDECREF(c.trace_id);
    Py_XDECREF(c.parent_ctx);
    PyBuffer_Release(&body);
    if (ret < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define SET(var, obj)            \
    do {                         \
        Py_XSETREF(var, (obj));  \
        Py_INCREF(var);          \
    } while (0)

static PyObject *configure(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"decode_error", "span_type", "attr_names", "attr_args", "context_type", "flags",
                            "empty_state", "status_unset", "status_ok", "kinds", "typed", "checked_names",
                            "finish", "resource", "scope", NULL};
    PyObject *a[15];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO!O!OO!OOOO!O!O!OOO:configure", names, &a[0], &a[1], &PyTuple_Type,
                                     &a[2], &PyTuple_Type, &a[3], &a[4], &PyList_Type, &a[5], &a[6], &a[7], &a[8],
                                     &PyList_Type, &a[9], &PyDict_Type, &a[10], &PySet_Type, &a[11], &a[12], &a[13],
                                     &a[14]))
        return NULL;
    if (!PyType_Check(a[1]) || !PyType_Check(a[4]) || !PyType_IsSubtype((PyTypeObject *)a[4], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "span_type and context_type must be types, context_type a tuple type");
        return NULL;
    }
    if (PyList_GET_SIZE(a[5]) != 256 || PyList_GET_SIZE(a[9]) < 2 ||
        PyTuple_GET_SIZE(a[2]) != PyTuple_GET_SIZE(a[3])) {
        PyErr_SetString(PyExc_ValueError, "flags needs 256 entries, kinds 2 or more, attr_args one per name");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(a[3]); i++) {
        long v = PyLong_AsLong(PyTuple_GET_ITEM(a[3], i));
        if (v < 0 || v >= N_ARGS || !PyUnicode_Check(PyTuple_GET_ITEM(a[2], i))) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "attr_args must index ReadableSpan's arguments");
            return NULL;
        }
    }
    SET(DecodeError, a[0]);
    SET(SpanType, a[1]);
    SET(SpanAttrNames, a[2]);
    SET(SpanAttrArgs, a[3]);
    SET(ContextType, a[4]);
    SET(Flags, a[5]);
    SET(EmptyState, a[6]);
    SET(StatusUnset, a[7]);
    SET(StatusOk, a[8]);
    SET(Kinds, a[9]);
    SET(Typed, a[10]);
    SET(CheckedNames, a[11]);
    SET(Finish, a[12]);
    SET(ResourceCb, a[13]);
    SET(ScopeCb, a[14]);
    configured = 1;
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------------------------- record nodes */

enum { N_NAME, N_KIND, N_SPAN_ID, N_PARENT_ID, N_START, N_END, N_ATTRIBUTES, N_INPUTS, N_OUTPUT, N_STATUS,
       N_STATUS_MESSAGE, N_EVENTS, N_CHILDREN, N_FIELDS };

static PyTypeObject *NodeType;        /* otel_rl.records.SpanNode (slots) */
static Py_ssize_t NodeOffsets[N_FIELDS]; /* where each field's slot lies in a SpanNode */
static PyObject *NodeFallback;        /* the Python `_node(span, attributes)` */
static PyObject *KeyKind, *KeyInputs, *KeyOutput, *KindDefault, *TextOk, *TextUnset, *StatusOkText, *StatusUnsetText;
static PyObject *SpanAttr[N_ARGS];    /* the instance attribute holding each of ReadableSpan's arguments */
static int nodes_configured = 0;

/* A span's instance attribute `name` (borrowed; NULL when absent, without an exception). */
static PyObject *field_of(PyObject *dict, int arg) {
    PyObject *v = PyDict_GetItemWithError(dict, SpanAttr[arg]);
    if (v == NULL && PyErr_Occurred())
        PyErr_Clear();
    return v;
}

/* `dict.pop(key, None)` into *out (a new reference, NULL when absent); -1 on an error. */
static int pop_key(PyObject *dict, PyObject *key, PyObject **out) {
    PyObject *v = PyDict_GetItemWithError(dict, key);
    *out = NULL;
    if (v == NULL)
        return PyErr_Occurred() ? -1 : 0;
    Py_INCREF(v);
    if (PyDict_DelItem(dict, key) < 0) {
        Py_DECREF(v);
        return -1;
    }
    *out = v;
    return 0;
}

/* The node of a span made by `decode` (a dict of attributes, status OK or UNSET, no events), or NULL without an
 * exception when `span` is any other span.  NULL with an exception on an error. */
static PyObject *fast_node(PyObject *span) {
    if (Py_TYPE(span) != (PyTypeObject *)SpanType)
        return NULL;
    PyObject *d = PyObject_GenericGetDict(span, NULL);
    if (d == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *node = NULL, *attrs = NULL, *inputs = NULL, *output = NULL, *children = NULL, *events = NULL;
    PyObject *name = field_of(d, A_NAME), *ctx = field_of(d, A_CONTEXT), *parent = field_of(d, A_PARENT);
    PyObject *src = field_of(d, A_ATTRIBUTES), *st = field_of(d, A_STATUS), *ev = field_of(d, A_EVENTS);
    PyObject *start = field_of(d, A_START), *end = field_of(d, A_END);
    if (name == NULL || ctx == NULL || parent == NULL || src == NULL || st == NULL || ev == NULL || start == NULL ||
        end == NULL || (start != Py_None && !PyLong_CheckExact(start)) || (end != Py_None && !PyLong_CheckExact(end)) ||
        !PyDict_CheckExact(src) || !PyObject_TypeCheck(ctx, (PyTypeObject *)ContextType) ||
        PyTuple_GET_SIZE(ctx) < 2 || (st != StatusOk && st != StatusUnset) || !PyTuple_Check(ev) ||
        PyTuple_GET_SIZE(ev) != 0 || (parent != Py_None && (!PyObject_TypeCheck(parent, (PyTypeObject *)ContextType) ||
                                                           PyTuple_GET_SIZE(parent) < 2)))
        goto other;
    attrs = PyDict_Copy(src);
    if (attrs == NULL)
        goto error;
    PyObject *kind = PyDict_GetItemWithError(attrs, KeyKind); /* borrowed */
    if (kind == NULL && PyErr_Occurred())
        goto error;
    kind = kind == NULL ? (Py_INCREF(KindDefault), KindDefault) : PyUnicode_CheckExact(kind) ? (Py_INCREF(kind), kind)
                                                                                          : PyObject_Str(kind);
    if (kind == NULL)
        goto error;
    if (pop_key(attrs, KeyInputs, &inputs) < 0 || pop_key(attrs, KeyOutput, &output) < 0) {
        Py_DECREF(kind);
        goto error;
    }
    PyObject **texts[2] = {&inputs, &output};
    for (int i = 0; i < 2; i++) {
        PyObject *t = *texts[i];
        if (t == NULL) {
            *texts[i] = Py_NewRef(Py_None);
        } else if (t != Py_None && !PyUnicode_CheckExact(t)) {
            *texts[i] = PyObject_Str(t);
            Py_DECREF(t);
            if (*texts[i] == NULL) {
                Py_DECREF(kind);
                goto error;
            }
        }
    }
    children = PyList_New(0);
    events = PyList_New(0);
    node = children && events ? NodeType->tp_alloc(NodeType, 0) : NULL;
    if (node == NULL) {
        Py_DECREF(kind);
        goto error;
    }
    PyObject *zero = NULL;
    PyObject *vals[N_FIELDS];
    vals[N_NAME] = name;
    vals[N_KIND] = kind;
    vals[N_SPAN_ID] = PyTuple_GET_ITEM(ctx, 1);
    vals[N_PARENT_ID] = parent == Py_None ? Py_None : PyTuple_GET_ITEM(parent, 1);
    if ((start == Py_None || end == Py_None) && (zero = PyLong_FromLong(0)) == NULL) {
        Py_DECREF(kind);
        goto error;
    }
    vals[N_START] = start == Py_None ? zero : start;
    vals[N_END] = end == Py_None ? zero : end;
    vals[N_ATTRIBUTES] = attrs;
    vals[N_INPUTS] = inputs;
    vals[N_OUTPUT] = output;
    vals[N_STATUS] = st == StatusOk ? TextOk : TextUnset;
    vals[N_STATUS_MESSAGE] = st == StatusOk ? StatusOkText : StatusUnsetText;
    vals[N_EVENTS] = events;
    vals[N_CHILDREN] = children;
    for (int i = 0; i < N_FIELDS; i++)
        *(PyObject **)((char *)node + NodeOffsets[i]) = Py_NewRef(vals[i]);
    Py_DECREF(kind);
    Py_XDECREF(zero);
    goto done;
error:
    Py_CLEAR(node);
    goto done;
other:
    Py_DECREF(d);
    return NULL;
done:
    Py_DECREF(d);
    Py_XDECREF(attrs);
    Py_XDECREF(inputs);
    Py_XDECREF(output);
    Py_XDECREF(children);
    Py_XDECREF(events);
    return node;
}

static PyObject *node(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!nodes_configured || !configured) {
        PyErr_SetString(PyExc_RuntimeError, "otel_rl.bridge._otlp: nodes are not configured");
        return NULL;
    }
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "node(span, attributes=None)");
        return NULL;
    }
    PyObject *out = fast_node(args[0]);
    if (out != NULL || PyErr_Occurred())
        return out;
    return PyObject_Vectorcall(NodeFallback, args, nargs, NULL);
}

static PyObject *configure_nodes(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"node_type", "fields", "fallback", "kind_key", "inputs_key", "output_key",
                            "kind_default", NULL};
    PyObject *type, *fields, *fallback, *kk, *ik, *ok, *kd;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!O!OUUUU:configure_nodes", names, &PyType_Type, &type, &PyTuple_Type,
                                     &fields, &fallback, &kk, &ik, &ok, &kd))
        return NULL;
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "configure() first");
        return NULL;
    }
    if (PyTuple_GET_SIZE(fields) != N_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "fields: the 13 fields of SpanNode, in order");
        return NULL;
    }
    Py_ssize_t offsets[N_FIELDS];
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *descr = PyObject_GetAttr(type, PyTuple_GET_ITEM(fields, i));
        if (descr == NULL)
            return NULL;
        int slot = Py_IS_TYPE(descr, &PyMemberDescr_Type) &&
                   ((PyMemberDescrObject *)descr)->d_member->type == T_OBJECT_EX &&
                   !(((PyMemberDescrObject *)descr)->d_member->flags & READONLY);
        if (slot)
            offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
        Py_DECREF(descr);
        if (!slot) {
            PyErr_SetString(PyExc_TypeError, "node_type's fields must be slots");
            return NULL;
        }
    }
    PyObject *attr_of[N_ARGS] = {NULL};
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(SpanAttrNames); i++)
        attr_of[PyLong_AsLong(PyTuple_GET_ITEM(SpanAttrArgs, i))] = PyTuple_GET_ITEM(SpanAttrNames, i);
    int need[] = {A_NAME, A_CONTEXT, A_PARENT, A_ATTRIBUTES, A_STATUS, A_EVENTS, A_START, A_END};
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        if (attr_of[need[i]] == NULL) {
            PyErr_SetString(PyExc_ValueError, "ReadableSpan keeps a field nodes need under no attribute");
            return NULL;
        }
    }
    PyObject *ok_text = PyObject_GetAttrString(StatusOk, "description");
    PyObject *unset_text = ok_text ? PyObject_GetAttrString(StatusUnset, "description") : NULL;
    PyObject *t_ok = unset_text ? PyUnicode_InternFromString("OK") : NULL;
    PyObject *t_unset = t_ok ? PyUnicode_InternFromString("UNSET") : NULL;
    if (t_unset == NULL) {
        Py_XDECREF(ok_text);
        Py_XDECREF(unset_text);
        Py_XDECREF(t_ok);
        return NULL;
    }
    for (int i = 0; i < N_ARGS; i++)
        Py_XSETREF(SpanAttr[i], Py_XNewRef(attr_of[i]));
    for (int i = 0; i < N_FIELDS; i++)
        NodeOffsets[i] = offsets[i];
    Py_XSETREF(StatusOkText, ok_text);
    Py_XSETREF(StatusUnsetText, unset_text);
    Py_XSETREF(TextOk, t_ok);
    Py_XSETREF(TextUnset, t_unset);
    Py_XSETREF(NodeType, (PyTypeObject *)Py_NewRef(type));
    Py_XSETREF(NodeFallback, Py_NewRef(fallback));
    Py_XSETREF(KeyKind, Py_NewRef(kk));
    Py_XSETREF(KeyInputs, Py_NewRef(ik));
    Py_XSETREF(KeyOutput, Py_NewRef(ok));
    Py_XSETREF(KindDefault, Py_NewRef(kd));
    nodes_configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Set the types and callbacks `decode` uses (otel_rl.bridge.decode does)."},
    {"decode", decode, METH_VARARGS,
     "decode(body, spans, resources, reject, roots=None): an ExportTraceServiceRequest's spans appended to "
     "`spans`, its resources to `resources`; `reject(reason)` for each span refused.  With a `roots` list, "
     "the parentless spans other than record spans (configure's checked_names) go there instead."},
    {"configure_nodes", (PyCFunction)(void (*)(void))configure_nodes, METH_VARARGS | METH_KEYWORDS,
     "Set the node type, its fields and the Python `_node` that `node` uses."},
    {"node", (PyCFunction)(void (*)(void))node, METH_FASTCALL,
     "node(span, attributes=None): the record builder's SpanNode of `span` (records._node)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp", "OTLP trace requests to spans (C).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__otlp(void) {
    EmptyTuple = PyTuple_New(0);
    if (EmptyTuple == NULL)
        return NULL;
    return PyModule_Create(&module);
}
