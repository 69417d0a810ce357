/* kvspec_dense.c: a dense KV cache in plain C, speaking kvproto/1.
 *
 * The reference adapter of docs/targets.md ("The line protocol"): kvspec
 * starts this program, sends one JSON request per line on stdin and reads
 * one JSON reply per line on stdout. The cache is the dense cache of
 * docs/dense.md in storage mode fp16 (rows kept in the dtype they are
 * handed in: float16, bfloat16 or float32):
 *
 *   - buffers of B x H x capacity x D elements, grown by `step` rows
 *     (regrow: cut to the live rows, add ceil(n / step) * step);
 *   - logical trim (the offset moves back, the buffers and capacity stay);
 *   - O(1) snapshots and restore: a snapshot shares the cache's buffers
 *     (reference counted); the cache adopting a snapshot's buffers forgets
 *     its ownership marker, so its next write copies;
 *   - the ownership rule for in-place decode writes: a one-row append
 *     writes into the current buffers only when the switch is on and the
 *     cache's own last write produced these buffers and ended exactly at
 *     the live length (no trim, no restore since); every other write
 *     copies into fresh buffers.
 *
 * Rows come from the portable row function of docs/kvtrace.md ("Portable
 * rows"): element_bits() below is its C form. No Python, no library but
 * the C standard library (and POSIX getline).
 *
 * It is also the C skeleton: `kvspec adapter new --lang c DIR` writes this
 * file as DIR/adapter.c (named "my-dense-cache-c" in its hello). Put your
 * engine's cache behind the parts marked "YOUR CACHE": do_init (build it),
 * op_append (write the rows first .. first + n - 1 with its own append),
 * op_trim, the snapshot ops in do_op, and put_window / put_state (read its
 * windows back as bytes). Declare only what it does in hello(): an op left
 * out is never sent, an observable left out is not compared, a cache field
 * left out is never sent (your cache runs at its default). Keep the row
 * function and the JSON reader as they are. stdout carries protocol lines
 * only (log to stderr).
 *
 * Build: cc -std=c99 -O2 -Wall -Wextra -o kvspec_dense kvspec_dense.c
 * Run:   kvspec adapter check ./kvspec_dense     (the protocol)
 *        kvspec fuzz --target exec:./kvspec_dense  (the contract)
 *        kvspec replay --target exec:./kvspec_dense TRACE.json
 * Flags: --windows identities  report windows as token identities the
 *                              adapter decoded from its bytes (default:
 *                              raw bytes, which kvspec identifies)
 *        --rows DTYPE B H DK DV FIRST COUNT [wide]
 *                              print the portable rows of COUNT tokens from
 *                              FIRST, as `kvspec rows --format hex` does
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the portable row function (docs/kvtrace.md "Portable rows") ---- */
static uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x85EBCA6Bu;
    x ^= x >> 13; x *= 0xC2B2AE35u;
    x ^= x >> 16; return x;
}

enum { F16, BF16, F32 };

static uint32_t element_bits(uint32_t t, uint32_t kv, uint32_t b, uint32_t h, uint32_t c, int dtype, int wide) {
    uint32_t place = ((kv * 64 + b) * 64 + h) * 1024 + c;
    uint32_t z = (t * 0x9E3779B1u) & 0xFFFFFFu;
    z ^= z >> 12;
    uint32_t salt = mix32(place);
    uint32_t u = ((z >> (12 * ((kv + b + h + c) & 1))) & 0xFFFu) ^ (salt & 0xFFFu);
    uint32_t x = mix32(salt ^ t) >> 16;
    uint32_t sign = u >> 11, e = (u >> 7) & 15, m = u & 127;
    if (dtype == F16) return (sign << 15) | ((7 + e) << 10) | (m << 3) | (x >> 13);
    uint32_t exp = 119 + e + ((wide && t % 5 == 2) ? 24 : 0);
    if (dtype == BF16) return (sign << 15) | (exp << 7) | m;
    return (sign << 31) | (exp << 23) | (m << 16) | x;
}

/* the inverse of the scramble, for --windows identities: the code of an
 * element (sign, exponent, 7 mantissa bits), or -1 */
static int32_t code_of(uint32_t bits, int dtype) {
    int32_t sign, e, m;
    if (dtype == F16) { sign = bits >> 15; e = (int32_t)((bits >> 10) & 31) - 7; m = (bits >> 3) & 127; }
    else if (dtype == BF16) { sign = bits >> 15; e = (int32_t)((bits >> 7) & 255) - 119; m = bits & 127; }
    else { sign = bits >> 31; e = (int32_t)((bits >> 23) & 255) - 119; m = (bits >> 16) & 127; }
    if (dtype != F16 && e >= 24) e -= 24;
    if (e < 0 || e > 15) return -1;
    return (sign << 11) | (e << 7) | m;
}

static uint32_t unscramble(uint32_t z) {
    z ^= z >> 12;
    uint32_t inv = 1; /* inverse of the multiplier mod 2^24 by Newton's iteration */
    for (int i = 0; i < 5; i++) inv *= 2 - 0x9E3779B1u * inv;
    return (z * inv) & 0xFFFFFFu;
}

/* ---- a minimal JSON reader (requests are small objects) ---- */
typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } JType;
typedef struct J {
    JType t;
    long long num;
    int is_int;
    char *str;
    struct J **items;
    char **keys;
    int n;
} J;

static const char *jp;
static int jerr;

static void jws(void) { while (*jp == ' ' || *jp == '\t' || *jp == '\r' || *jp == '\n') jp++; }

static J *jnew(JType t) {
    J *j = calloc(1, sizeof(J));
    if (!j) { fprintf(stderr, "out of memory\n"); exit(3); }
    j->t = t;
    return j;
}

static void jput_utf8(char **out, size_t *len, size_t *cap, uint32_t cp) {
    char tmp[4]; int k = 0;
    if (cp < 0x80) tmp[k++] = (char)cp;
    else if (cp < 0x800) { tmp[k++] = (char)(0xC0 | (cp >> 6)); tmp[k++] = (char)(0x80 | (cp & 63)); }
    else if (cp < 0x10000) { tmp[k++] = (char)(0xE0 | (cp >> 12)); tmp[k++] = (char)(0x80 | ((cp >> 6) & 63)); tmp[k++] = (char)(0x80 | (cp & 63)); }
    else { tmp[k++] = (char)(0xF0 | (cp >> 18)); tmp[k++] = (char)(0x80 | ((cp >> 12) & 63)); tmp[k++] = (char)(0x80 | ((cp >> 6) & 63)); tmp[k++] = (char)(0x80 | (cp & 63)); }
    for (int i = 0; i < k; i++) {
        if (*len + 1 >= *cap) { *cap *= 2; *out = realloc(*out, *cap); }
        (*out)[(*len)++] = tmp[i];
    }
}

static int hex4(uint32_t *v) {
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char ch = *jp++;
        *v <<= 4;
        if (ch >= '0' && ch <= '9') *v |= (uint32_t)(ch - '0');
        else if (ch >= 'a' && ch <= 'f') *v |= (uint32_t)(ch - 'a' + 10);
        else if (ch >= 'A' && ch <= 'F') *v |= (uint32_t)(ch - 'A' + 10);
        else return 0;
    }
    return 1;
}

static size_t jlen; /* the length of the last string read (a name may hold NUL) */

static char *jstring(void) {
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    jp++; /* the opening quote */
    while (*jp && *jp != '"') {
        uint32_t cp = (unsigned char)*jp++;
        if (cp == '\\') {
            char e = *jp++;
            switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (!hex4(&cp)) { jerr = 1; return out; }
                if (cp >= 0xD800 && cp < 0xDC00 && jp[0] == '\\' && jp[1] == 'u') {
                    uint32_t lo; jp += 2;
                    if (!hex4(&lo)) { jerr = 1; return out; }
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                jput_utf8(&out, &len, &cap, cp);
                continue;
            default: jerr = 1; return out;
            }
        }
        if (len + 1 >= cap) { cap *= 2; out = realloc(out, cap); }
        out[len++] = (char)cp;
    }
    if (*jp != '"') jerr = 1; else jp++;
    out[len] = 0;
    jlen = len;
    return out;
}

static J *jvalue(int depth) {
    jws();
    if (depth > 32) { jerr = 1; return jnew(J_NULL); }
    if (*jp == '{' || *jp == '[') {
        int obj = *jp == '{';
        J *j = jnew(obj ? J_OBJ : J_ARR);
        int cap = 4;
        j->items = malloc(cap * sizeof(J *));
        j->keys = malloc(cap * sizeof(char *));
        jp++; jws();
        if (*jp == (obj ? '}' : ']')) { jp++; return j; }
        for (;;) {
            if (j->n == cap) { cap *= 2; j->items = realloc(j->items, cap * sizeof(J *)); j->keys = realloc(j->keys, cap * sizeof(char *)); }
            j->keys[j->n] = NULL;
            if (obj) {
                jws();
                if (*jp != '"') { jerr = 1; return j; }
                j->keys[j->n] = jstring();
                jws();
                if (*jp++ != ':') { jerr = 1; return j; }
            }
            j->items[j->n++] = jvalue(depth + 1);
            if (jerr) return j;
            jws();
            if (*jp == ',') { jp++; continue; }
            if (*jp == (obj ? '}' : ']')) { jp++; return j; }
            jerr = 1; return j;
        }
    }
    if (*jp == '"') { J *j = jnew(J_STR); j->str = jstring(); j->num = (long long)jlen; return j; }
    if (!strncmp(jp, "true", 4)) { jp += 4; J *j = jnew(J_BOOL); j->num = 1; return j; }
    if (!strncmp(jp, "false", 5)) { jp += 5; return jnew(J_BOOL); }
    if (!strncmp(jp, "null", 4)) { jp += 4; return jnew(J_NULL); }
    if (*jp == '-' || (*jp >= '0' && *jp <= '9')) {
        J *j = jnew(J_NUM);
        char *end;
        j->num = strtoll(jp, &end, 10);
        j->is_int = 1;
        jp = end;
        if (*jp == '.' || *jp == 'e' || *jp == 'E') { /* not an integer: skip it */
            strtod(jp, &end); jp = end; j->is_int = 0;
        }
        return j;
    }
    jerr = 1;
    return jnew(J_NULL);
}

static void jfree(J *j) {
    if (!j) return;
    for (int i = 0; i < j->n; i++) { jfree(j->items[i]); free(j->keys ? j->keys[i] : NULL); }
    free(j->items); free(j->keys); free(j->str); free(j);
}

static J *jget(const J *o, const char *key) {
    if (!o || o->t != J_OBJ) return NULL;
    for (int i = 0; i < o->n; i++) if (!strcmp(o->keys[i], key)) return o->items[i];
    return NULL;
}

static long long jint(const J *o, const char *key, long long dflt) {
    J *v = jget(o, key);
    return (v && v->t == J_NUM) ? v->num : dflt;
}

static const char *jstr(const J *o, const char *key) {
    J *v = jget(o, key);
    return (v && v->t == J_STR) ? v->str : NULL;
}

/* ---- JSON output ---- */
static void put_strn(const char *s, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (ch == '"' || ch == '\\') { putchar('\\'); putchar(ch); }
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

static void put_str(const char *s) { put_strn(s, strlen(s)); }

/* ---- YOUR CACHE: the cache's state (replace by your engine's cache object) ---- */
typedef struct {
    int refs, id, cap;
    unsigned char *k, *v;
} Buf;

typedef struct { Buf *buf; int len; } View; /* rows [0, len) of buf; buf NULL: empty */

typedef struct { char *name; size_t len; View view; } Holder; /* names are byte strings of len bytes */

static struct {
    int ready, step, B, H, Dk, Dv, esize, dtype, inplace, wide;
    int offset;          /* live_len too: this cache has no front trim, live_start is 0 */
    Buf *buf;
    int marker_buf, marker_len; /* ownership marker: the buffers of the own last write, and where it ended */
    int next_id;
    View returned, held;
    int has_returned, has_held;
    Holder *holders;
    int nholders, capholders;
    int last_inplace;
} C;

static int windows_as_ids;

static Buf *buf_new(int cap) {
    Buf *b = calloc(1, sizeof(Buf));
    b->refs = 1; b->id = C.next_id++; b->cap = cap;
    b->k = calloc((size_t)C.B * C.H * cap * C.Dk, C.esize);
    b->v = calloc((size_t)C.B * C.H * cap * C.Dv, C.esize);
    if (!b->k || !b->v) { fprintf(stderr, "out of memory\n"); exit(3); }
    return b;
}

static Buf *buf_ref(Buf *b) { if (b) b->refs++; return b; }

static void buf_release(Buf *b) {
    if (b && --b->refs == 0) { free(b->k); free(b->v); free(b); }
}

static void view_set(View *dst, Buf *b, int len) { Buf *old = dst->buf; dst->buf = buf_ref(b); dst->len = len; buf_release(old); }

/* copy rows [0, rows) of src into dst (same B, H, D) */
static void copy_rows(Buf *dst, const Buf *src, int rows) {
    for (int s = 0; s < 2; s++) {
        int D = s ? C.Dv : C.Dk;
        unsigned char *d = s ? dst->v : dst->k, *from = s ? src->v : src->k;
        for (int bh = 0; bh < C.B * C.H; bh++)
            memcpy(d + (size_t)bh * dst->cap * D * C.esize, from + (size_t)bh * src->cap * D * C.esize, (size_t)rows * D * C.esize);
    }
}

static void put_elem(unsigned char *p, uint32_t bits) {
    for (int i = 0; i < C.esize; i++) p[i] = (unsigned char)(bits >> (8 * i)); /* little-endian */
}

static uint32_t get_elem(const unsigned char *p) {
    uint32_t bits = 0;
    for (int i = 0; i < C.esize; i++) bits |= (uint32_t)p[i] << (8 * i);
    return bits;
}

static void write_row(Buf *b, int row, uint32_t t) {
    for (int s = 0; s < 2; s++) {
        int D = s ? C.Dv : C.Dk;
        unsigned char *base = s ? b->v : b->k;
        for (int bb = 0; bb < C.B; bb++)
            for (int h = 0; h < C.H; h++)
                for (int c = 0; c < D; c++)
                    put_elem(base + ((((size_t)bb * C.H + h) * b->cap + row) * D + c) * C.esize,
                             element_bits(t, (uint32_t)s, (uint32_t)bb, (uint32_t)h, (uint32_t)c, C.dtype, C.wide));
    }
}

static void clear_all(void) {
    buf_release(C.buf); C.buf = NULL;
    buf_release(C.returned.buf); buf_release(C.held.buf);
    for (int i = 0; i < C.nholders; i++) { free(C.holders[i].name); buf_release(C.holders[i].view.buf); }
    free(C.holders);
    memset(&C, 0, sizeof(C));
}

static int find_holder(const char *name, size_t len) {
    for (int i = 0; i < C.nholders; i++)
        if (C.holders[i].len == len && !memcmp(C.holders[i].name, name, len)) return i;
    return -1;
}

/* ---- replies ---- */
static const char *err_cat, *err_msg;
static char err_buf[512];

static int refuse(const char *category, const char *msg) { err_cat = category; err_msg = msg; return 0; }

/* YOUR CACHE: a window as [B, H, n, D] in C order, little-endian element bytes, lowercase hex */
static void put_window(View w) {
    int rows = w.buf ? w.len : 0;
    if (windows_as_ids) {
        putchar('[');
        for (int r = 0; r < rows; r++) {
            if (r) putchar(',');
            const Buf *b = w.buf;
            uint32_t k0 = get_elem(b->k + (size_t)r * C.Dk * C.esize), v0 = get_elem(b->v + (size_t)r * C.Dv * C.esize);
            int32_t lo = code_of(k0, C.dtype), hi = code_of(v0, C.dtype);
            long long t = -1;
            if (lo >= 0 && hi >= 0) {
                lo ^= (int32_t)(mix32(0) & 0xFFFu);
                hi ^= (int32_t)(mix32((uint32_t)1 << 22) & 0xFFFu); /* place(1, 0, 0, 0) = 64 * 64 * 1024 */
                t = unscramble(((uint32_t)hi << 12) | (uint32_t)lo);
            }
            int all_match = t >= 0, all_zero = 1;
            for (int s = 0; s < 2; s++) {
                int D = s ? C.Dv : C.Dk;
                const unsigned char *base = s ? b->v : b->k;
                for (int bb = 0; bb < C.B; bb++)
                    for (int h = 0; h < C.H; h++)
                        for (int c = 0; c < D; c++) {
                            uint32_t got = get_elem(base + ((((size_t)bb * C.H + h) * b->cap + r) * D + c) * C.esize);
                            if (got) all_zero = 0;
                            if (t >= 0 && got != element_bits((uint32_t)t, (uint32_t)s, (uint32_t)bb, (uint32_t)h, (uint32_t)c, C.dtype, C.wide)) all_match = 0;
                        }
            }
            if (all_match) printf("%lld", t); else printf(all_zero ? "\"zero\"" : "\"?\"");
        }
        putchar(']');
        return;
    }
    printf("{\"rows\":%d", rows);
    for (int s = 0; s < 2; s++) {
        int D = s ? C.Dv : C.Dk;
        printf(s ? ",\"v\":\"" : ",\"k\":\"");
        for (int bh = 0; bh < C.B * C.H && rows; bh++) {
            const unsigned char *base = (s ? w.buf->v : w.buf->k) + (size_t)bh * w.buf->cap * D * C.esize;
            for (size_t i = 0; i < (size_t)rows * D * C.esize; i++) printf("%02x", base[i]);
        }
        putchar('"');
    }
    putchar('}');
}

static void put_state(void) {
    printf(",\"state\":{\"offset\":%d,\"live_start\":0,\"live_len\":%d,\"capacity\":%d,\"cache\":",
           C.offset, C.offset, C.buf ? C.buf->cap : 0);
    View live = {C.buf, C.offset};
    put_window(live);
    printf(",\"held\":");
    if (C.has_held) put_window(C.held); else printf("null");
    printf(",\"holders\":{");
    for (int i = 0; i < C.nholders; i++) {
        if (i) putchar(',');
        put_strn(C.holders[i].name, C.holders[i].len); putchar(':');
        put_window(C.holders[i].view);
    }
    printf("}}");
}

/* ---- YOUR CACHE: the ops (docs/dense.md; each refusal changes nothing): call your engine here ---- */
static int op_trim(long long n, long long *out) {
    if (n < 0) n = 0;
    if (n > C.offset) n = C.offset;
    C.offset -= (int)n;
    if (C.offset == 0) { buf_release(C.buf); C.buf = NULL; C.marker_buf = -1; }
    *out = n;
    return 1;
}

static int op_append(long long n, long long first) {
    if (n < 1) return refuse("invalid_argument", "append: n must be >= 1");
    int prev = C.offset, regrew = !C.buf || prev + n > C.buf->cap;
    if (regrew) {
        Buf *nb = buf_new(prev + (int)((n + C.step - 1) / C.step) * C.step);
        if (C.buf) copy_rows(nb, C.buf, prev);
        buf_release(C.buf); C.buf = nb;
    }
    int inplace = C.inplace && n == 1 && C.marker_buf == C.buf->id && prev == C.marker_len;
    if (!inplace && !regrew) { /* a copying write: fresh private buffers */
        Buf *nb = buf_new(C.buf->cap);
        copy_rows(nb, C.buf, prev);
        buf_release(C.buf); C.buf = nb;
    }
    for (int i = 0; i < n; i++) write_row(C.buf, prev + i, (uint32_t)(first + i));
    C.offset = prev + (int)n;
    C.marker_buf = C.buf->id; C.marker_len = C.offset;
    view_set(&C.returned, C.buf, C.offset);
    C.has_returned = 1;
    C.last_inplace = inplace;
    return 1;
}

static int do_op(const J *op, long long first, long long *result, int *has_result, int *is_append) {
    const char *name = jstr(op, "op");
    *has_result = 0; *is_append = 0;
    if (!name) return refuse("invalid_argument", "op: missing");
    if (!strcmp(name, "append")) { *is_append = 1; return op_append(jint(op, "n", 0), first); }
    if (!strcmp(name, "fetch")) return 1;
    if (!strcmp(name, "trim")) { *has_result = 1; return op_trim(jint(op, "n", 0), result); }
    if (!strcmp(name, "trim_to")) {
        long long len = jint(op, "len", -1);
        if (len < 0 || len > C.offset) {
            snprintf(err_buf, sizeof err_buf, "trim_to: len must satisfy 0 <= len <= offset (%d), got %lld", C.offset, len);
            return refuse("invalid_argument", err_buf);
        }
        *has_result = 1;
        return op_trim(C.offset - len, result);
    }
    if (!strcmp(name, "hold")) {
        if (!C.has_returned) return refuse("state", "hold: no append has returned a window yet");
        view_set(&C.held, C.returned.buf, C.returned.len); C.has_held = 1;
        return 1;
    }
    if (!strcmp(name, "release_hold")) { buf_release(C.held.buf); C.held.buf = NULL; C.has_held = 0; return 1; }
    J *hj = jget(op, "name");
    if (!strcmp(name, "snapshot") || !strcmp(name, "restore") || !strcmp(name, "drop")) {
        if (!hj || hj->t != J_STR) return refuse("invalid_argument", "name: missing");
        const char *hn = hj->str;
        size_t hlen = (size_t)hj->num;
        int i = find_holder(hn, hlen);
        if (!strcmp(name, "snapshot")) {
            if (i >= 0) return refuse("state", "snapshot: name is already in use");
            if (C.nholders == C.capholders) {
                C.capholders = C.capholders ? 2 * C.capholders : 4;
                C.holders = realloc(C.holders, C.capholders * sizeof(Holder));
            }
            Holder *h = &C.holders[C.nholders++];
            h->name = malloc(hlen + 1);
            memcpy(h->name, hn, hlen + 1);
            h->len = hlen; h->view.buf = buf_ref(C.buf); h->view.len = C.offset;
            return 1;
        }
        if (i < 0) return refuse("state", "no snapshot named so");
        if (!strcmp(name, "restore")) { /* adopt the snapshot's buffers; no marker: the next write copies */
            Buf *old = C.buf;
            C.buf = buf_ref(C.holders[i].view.buf);
            buf_release(old);
            C.offset = C.holders[i].view.len;
            C.marker_buf = -1;
            return 1;
        }
        free(C.holders[i].name); buf_release(C.holders[i].view.buf);
        C.holders[i] = C.holders[--C.nholders];
        return 1;
    }
    snprintf(err_buf, sizeof err_buf, "%s: not an operation of this adapter", name);
    return refuse("unsupported", err_buf);
}

static int dtype_of(const char *s) {
    if (!s || !strcmp(s, "float16")) return F16;
    if (!strcmp(s, "bfloat16")) return BF16;
    if (!strcmp(s, "float32")) return F32;
    return -1;
}

static const char *FIELDS[] = {"kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim",
                               "v_head_dim", "dtype", "inplace", "rows", NULL};

/* YOUR CACHE: build a fresh, empty cache from the trace's cache fields */
static int do_init(const J *cache, int wide) {
    for (int i = 0; cache && cache->t == J_OBJ && i < cache->n; i++) {
        int known = 0;
        for (int f = 0; FIELDS[f]; f++) known |= !strcmp(cache->keys[i], FIELDS[f]);
        if (!known) { snprintf(err_buf, sizeof err_buf, "cache field %s is not supported", cache->keys[i]); return refuse("unsupported", err_buf); }
    }
    const char *kind = jstr(cache, "kind"), *mode = jstr(cache, "mode"), *rows = jstr(cache, "rows");
    if (!kind || strcmp(kind, "dense")) return refuse("unsupported", "only kind dense");
    if (mode && strcmp(mode, "fp16")) return refuse("unsupported", "only mode fp16");
    if (!rows || strcmp(rows, "portable")) return refuse("unsupported", "only portable rows");
    int dtype = dtype_of(jstr(cache, "dtype"));
    if (dtype < 0) return refuse("unsupported", "dtype");
    long long step = jint(cache, "step", 256), B = jint(cache, "batch", 1), H = jint(cache, "kv_heads", 2);
    long long D = jint(cache, "head_dim", 8);
    long long Dk = jint(cache, "k_head_dim", D), Dv = jint(cache, "v_head_dim", D);
    if (step < 1 || step > (1 << 20) || B < 1 || B > 64 || H < 1 || H > 64 || Dk < 1 || Dk > 1024 || Dv < 1 || Dv > 1024)
        return refuse("invalid_argument", "cache sizes out of range");
    J *inp = jget(cache, "inplace");
    clear_all();
    C.ready = 1; C.step = (int)step; C.B = (int)B; C.H = (int)H; C.Dk = (int)Dk; C.Dv = (int)Dv;
    C.dtype = dtype; C.esize = dtype == F32 ? 4 : 2; C.wide = wide;
    C.inplace = !(inp && inp->t == J_BOOL && !inp->num);
    C.marker_buf = -1;
    return 1;
}

static void hello(long long id) {
    printf("{\"id\":%lld,\"kvproto\":1,\"adapter\":\"kvspec-dense-c\",\"version\":\"1.0\",\"windows\":\"%s\","
           "\"kinds\":{\"dense\":{\"modes\":[\"fp16\"],\"dtypes\":[\"float16\",\"bfloat16\",\"float32\"],\"fields\":[",
           id, windows_as_ids ? "identities" : "bytes");
    for (int f = 0; FIELDS[f]; f++) printf("%s\"%s\"", f ? "," : "", FIELDS[f]);
    printf("],\"ops\":[\"append\",\"fetch\",\"hold\",\"release_hold\",\"trim\",\"trim_to\",\"snapshot\",\"restore\",\"drop\"],"
           "\"observables\":[\"offset\",\"live_start\",\"live_len\",\"capacity\",\"inplace\"]}}}\n");
}

static int print_rows(char **argv) {
    int dtype = dtype_of(argv[0]);
    long long B = atoll(argv[1]), H = atoll(argv[2]), Dk = atoll(argv[3]), Dv = atoll(argv[4]);
    long long first = atoll(argv[5]), count = atoll(argv[6]);
    int wide = argv[7] && !strcmp(argv[7], "wide");
    if (dtype < 0) { fprintf(stderr, "--rows: unknown dtype %s\n", argv[0]); return 2; }
    for (long long t = first; t < first + count; t++)
        for (int s = 0; s < 2; s++) {
            long long D = s ? Dv : Dk;
            printf("%lld %s", t, s ? "v" : "k");
            for (long long bb = 0; bb < B; bb++)
                for (long long h = 0; h < H; h++)
                    for (long long c = 0; c < D; c++)
                        printf(dtype == F32 ? " %08x" : " %04x",
                               element_bits((uint32_t)t, (uint32_t)s, (uint32_t)bb, (uint32_t)h, (uint32_t)c, dtype, wide));
            putchar('\n');
        }
    return 0;
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--windows") && i + 1 < argc) windows_as_ids = !strcmp(argv[++i], "identities");
        else if (!strcmp(argv[i], "--rows") && i + 7 < argc) return print_rows(argv + i + 1);
        else { fprintf(stderr, "usage: %s [--windows bytes|identities] | --rows DTYPE B H DK DV FIRST COUNT [wide]\n", argv[0]); return 2; }
    }
    char *line = NULL;
    size_t cap = 0;
    while (getline(&line, &cap, stdin) > 0) {
        jp = line; jerr = 0;
        J *req = jvalue(0);
        long long id = jint(req, "id", -1);
        const char *what = jstr(req, "request");
        if (jerr || !what) {
            printf("{\"id\":%lld,\"ok\":false,\"error\":{\"category\":\"invalid_argument\",\"message\":\"malformed request\"}}\n", id);
        } else if (!strcmp(what, "hello")) {
            hello(id);
        } else if (!strcmp(what, "bye")) {
            jfree(req);
            break;
        } else {
            int ok;
            long long result = 0;
            int has_result = 0, is_append = 0;
            err_cat = err_msg = NULL;
            if (!strcmp(what, "init")) {
                J *wide = jget(req, "wide");
                ok = do_init(jget(req, "cache"), wide && wide->t == J_BOOL && wide->num);
            } else if (!strcmp(what, "op") && C.ready) {
                ok = do_op(jget(req, "op"), jint(req, "first", 0), &result, &has_result, &is_append);
            } else {
                ok = refuse("state", "no cache: send init first");
            }
            printf("{\"id\":%lld,\"ok\":%s", id, ok ? "true" : "false");
            if (!ok) { printf(",\"error\":{\"category\":\"%s\",\"message\":", err_cat); put_str(err_msg); putchar('}'); }
            else if (is_append) { printf(",\"result\":"); put_window(C.returned); printf(",\"inplace\":%s", C.last_inplace ? "true" : "false"); }
            else if (has_result) printf(",\"result\":%lld", result);
            if (C.ready) put_state();
            printf("}\n");
        }
        fflush(stdout);
        jfree(req);
    }
    free(line);
    clear_all();
    return 0;
}
