/* kvspec_ring.c: a sliding-window ring KV cache in plain C, speaking kvproto/2.
 *
 * The reference ring adapter of docs/kvproto.md: kvspec starts this
 * program, sends one JSON request per line on stdin and reads one JSON
 * reply per line on stdout. The cache is the rotating cache of
 * docs/rotating.md (kind rotating, mode fp16; rows kept in the dtype they
 * are handed in: float16, bfloat16 or float32):
 *
 *   - a ring of at most max_size (W) slots whose first keep (K) slots hold
 *     the attention sinks, never evicted; the buffer grows by `step` slots
 *     up to W during warm-up;
 *   - a decode (one row) writes at the cursor idx, wrapping to K once the
 *     cursor reaches W; a multi-row append puts the valid rows in
 *     chronological order, keeps the sinks and the latest others (W - 1 old
 *     rows at most), appends every new row and returns the whole buffer;
 *   - the undo log of `undo` (U) rows: each append records the counters
 *     before it and the valid rows it overwrote or dropped, so a trim after
 *     a wrap takes back up to U rows exactly; beyond what it can take back a
 *     trim trims nothing (trim_to refuses, a state error);
 *   - snapshots and state snapshots (the valid slots only) by name, restore
 *     (no ownership marker, an empty undo log), copy, reload;
 *   - the warm-up in-place rule: a decode writes into the current buffer
 *     only while the window is not yet full, the ring is unwrapped, the
 *     switch is on and the cache's own last write produced this buffer and
 *     left the cursor here; every other write makes a new buffer;
 *   - make_mask for the rows about to be appended (the `masks` of an
 *     append request): query offset + i sees key p iff p <= offset + i and
 *     (p < K or offset + i - p < window - K).
 *
 * Rows come from the portable row function of docs/kvtrace.md ("Portable
 * rows"): element_bits() below is its C form. No library but the C
 * standard library (and POSIX getline).
 *
 * Build: cc -std=c99 -O2 -Wall -Wextra -o kvspec_ring kvspec_ring.c
 * Run:   kvspec replay --target exec:./kvspec_ring TRACE.json
 * Flags: --windows identities  report windows as token identities the
 *                              adapter decoded from its bytes
 * Planted bug (for the harness's own tests): built with
 * -DKVSPEC_RING_WRAP_BUG, the cursor wraps to K + 1 instead of K (the
 * first non-sink slot is never written again).
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

/* ---- the ring (docs/rotating.md; spec/rotating.py is its executable form) ---- */
typedef struct { long long pos; unsigned char *row; } Entry; /* row NULL: a slot nobody wrote (zero) */

typedef struct {
    int prefill;            /* 0: a decode, 1: a multi-row append */
    int rows;               /* rows of that append still in the ring */
    long long offset, idx;  /* the ring's counters before it */
    int capacity;           /* and its capacity */
    int slot;               /* where a decode wrote; -1 for a multi-row append */
    Entry *saved;           /* the valid rows it overwrote or dropped, oldest first */
    int nsaved;
    int whole;              /* 0: it went onto an oversized buffer (cannot be undone wholly) */
} Rec;

typedef struct {
    Entry *slots;
    int cap;
    long long offset, idx;  /* rows ever written; the physical write cursor */
    long long ident;        /* buffer identity, -1: no buffer */
    long long marker_buf, marker_idx; /* ownership marker (marker_buf -1: none) */
    Rec *log;
    int nlog;
} Ring;

typedef struct { char *name; size_t len; int state; Ring r; } Holder; /* state: a state snapshot */

static struct {
    int ready, W, K, step, undo, inplace, B, H, Dk, Dv, esize, dtype, wide;
    long long next_ident;
    Ring c;
    Entry *returned, *held;
    int nreturned, nheld, has_returned, has_held;
    Holder *holders;
    int nholders, capholders;
    int last_inplace;
} G;

static int windows_as_ids;

#ifdef KVSPEC_RING_WRAP_BUG
#define WRAP_TO (G.K + 1 < G.W ? G.K + 1 : G.K) /* the planted bug: the wrap index one slot too far */
#else
#define WRAP_TO G.K
#endif

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(3); }
    return p;
}

static Entry *ents_dup(const Entry *e, int n) {
    Entry *out = xcalloc((size_t)n, sizeof(Entry));
    if (n) memcpy(out, e, (size_t)n * sizeof(Entry));
    return out;
}

static void log_clear(Ring *r) {
    for (int i = 0; i < r->nlog; i++) free(r->log[i].saved);
    free(r->log); r->log = NULL; r->nlog = 0;
}

static void ring_free(Ring *r) { free(r->slots); r->slots = NULL; log_clear(r); }

static Ring ring_dup(const Ring *r) {
    Ring out = *r;
    out.slots = ents_dup(r->slots, r->cap);
    out.log = xcalloc((size_t)r->nlog, sizeof(Rec));
    for (int i = 0; i < r->nlog; i++) {
        out.log[i] = r->log[i];
        out.log[i].saved = ents_dup(r->log[i].saved, r->log[i].nsaved);
    }
    return out;
}

/* the ring adopts `slots` (cap of them) as a new buffer */
static void new_buffer(Ring *r, Entry *slots, int cap) {
    free(r->slots);
    r->slots = slots; r->cap = cap; r->ident = G.next_ident++;
}

static int wrapped(const Ring *r) { return r->offset != r->idx; }
static int valid_len(const Ring *r) { return wrapped(r) ? r->cap : (int)r->idx; }

/* slot indices of the valid rows in chronological order (n of them) */
static int *chron_order(int n_slots, long long idx, int keep, int wrap, int *n) {
    int *out = xcalloc((size_t)n_slots + 1, sizeof(int));
    int k = 0;
    if (!wrap) { for (int i = 0; i < idx; i++) out[k++] = i; }
    else {
        for (int i = 0; i < keep; i++) out[k++] = i;
        for (int i = (int)idx; i < n_slots; i++) out[k++] = i;
        for (int i = keep; i < idx; i++) out[k++] = i;
    }
    *n = k;
    return out;
}

/* which of n_old old rows (chronological) a multi-row append keeps: a flag per row */
static char *prefill_kept(int n_old, int *nkept) {
    char *kept = xcalloc((size_t)n_old + 1, 1);
    int budget = G.W - 1;
    if (n_old <= budget) { memset(kept, 1, (size_t)n_old); *nkept = n_old; return kept; }
    int sinks = G.K < n_old ? G.K : n_old;
    if (budget > sinks) {
        for (int i = 0; i < sinks; i++) kept[i] = 1;
        for (int i = n_old - (budget - sinks); i < n_old; i++) kept[i] = 1;
    } else {
        for (int i = 0; i < budget; i++) kept[i] = 1;
    }
    *nkept = budget;
    return kept;
}

/* ---- the undo log ---- */
static void log_push(Ring *r, Rec rec) {
    if (G.undo == 0) { free(rec.saved); log_clear(r); return; }
    if (!rec.whole) log_clear(r);
    r->log = realloc(r->log, (size_t)(r->nlog + 1) * sizeof(Rec));
    r->log[r->nlog++] = rec;
    for (;;) { /* records older than the latest U rows go */
        int later = 0;
        for (int i = 1; i < r->nlog; i++) later += r->log[i].rows;
        if (later < G.undo) break;
        free(r->log[0].saved);
        memmove(r->log, r->log + 1, (size_t)(r->nlog - 1) * sizeof(Rec));
        r->nlog--;
    }
}

static void log_pop(Ring *r) { free(r->log[r->nlog - 1].saved); r->nlog--; }

static long long log_rows(const Ring *r) {
    long long covered = 0;
    for (int i = 0; i < r->nlog; i++) covered += r->log[i].rows;
    return (r->nlog && !r->log[0].whole) ? covered - 1 : covered;
}

static int log_saved_rows(const Ring *r) {
    int n = 0;
    for (int i = 0; i < r->nlog; i++) n += r->log[i].nsaved;
    return n;
}

static void log_rewind(Ring *r, long long n) {
    while (n > 0 && r->nlog) {
        Rec *last = &r->log[r->nlog - 1];
        if (n >= last->rows) { n -= last->rows; log_pop(r); }
        else { last->rows -= (int)n; n = 0; }
    }
}

/* moving offset and idx back is an exact trim (unwrapped, not oversized) */
static int counters_rewind_exact(const Ring *r) {
    return r->idx == r->offset && r->offset <= G.W && r->cap <= G.W;
}

static long long trimmable_rows(const Ring *r) {
    if (counters_rewind_exact(r)) return r->offset;
    long long covered = log_rows(r);
    return covered < G.undo ? covered : G.undo;
}

static int is_trimmable(const Ring *r) { return counters_rewind_exact(r) || trimmable_rows(r) > 0; }

/* ---- appends ---- */
static int inplace_allowed(const Ring *r) {
    return G.inplace && r->offset < G.W && r->idx == r->offset && r->marker_buf >= 0 && r->ident >= 0
           && r->marker_buf == r->ident && r->marker_idx == r->idx;
}

/* a one-row append (returns whether it wrote in place) */
static int decode(Ring *r, Entry e) {
    int W = G.W, K = G.K;
    long long p_off = r->offset, p_idx = r->idx;
    int p_cap = r->cap, p_valid = valid_len(r), p_over = r->cap > W;
    if (r->cap > W) { /* 1. cut an oversized buffer to its sinks and latest W - K rows */
        Entry *s = xcalloc((size_t)W, sizeof(Entry));
        memcpy(s, r->slots, (size_t)K * sizeof(Entry));
        memcpy(s + K, r->slots + (r->cap - (W - K)), (size_t)(W - K) * sizeof(Entry));
        new_buffer(r, s, W);
        r->idx = W;
    }
    if (r->idx >= r->cap && r->cap < W) { /* 2. grow by at most step, never past W */
        int grow = G.step < W - r->cap ? G.step : W - r->cap;
        Entry *s = xcalloc((size_t)(r->cap + grow), sizeof(Entry));
        if (r->cap) memcpy(s, r->slots, (size_t)r->cap * sizeof(Entry));
        new_buffer(r, s, r->cap + grow);
    }
    if (r->idx >= W) r->idx = WRAP_TO; /* 3. wrap */
    int inplace = inplace_allowed(r);
    Rec rec = {0, 1, p_off, p_idx, p_cap, (int)r->idx, NULL, 0, !p_over};
    if (!p_over && r->idx < p_valid) { /* the valid row it overwrites */
        rec.saved = ents_dup(&r->slots[r->idx], 1);
        rec.nsaved = 1;
    }
    e.pos = r->offset;
    if (inplace) r->slots[r->idx] = e;
    else {
        Entry *s = ents_dup(r->slots, r->cap);
        s[r->idx] = e;
        new_buffer(r, s, r->cap);
    }
    r->offset++; r->idx++;
    r->marker_buf = r->ident; r->marker_idx = r->idx;
    log_push(r, rec);
    return inplace;
}

/* a multi-row append of n rows */
static void prefill(Ring *r, const Entry *rows, int n) {
    int nold, nkept;
    int *order = chron_order(r->cap, r->idx, G.K, wrapped(r), &nold);
    char *kept = prefill_kept(nold, &nkept);
    Rec rec = {1, n, r->offset, r->idx, r->cap, -1, NULL, 0, r->cap <= G.W};
    if (rec.whole) {
        rec.saved = xcalloc((size_t)nold, sizeof(Entry));
        for (int j = 0; j < nold; j++) if (!kept[j]) rec.saved[rec.nsaved++] = r->slots[order[j]];
    }
    Entry *s = xcalloc((size_t)(nkept + n), sizeof(Entry));
    int k = 0;
    for (int j = 0; j < nold; j++) if (kept[j]) s[k++] = r->slots[order[j]];
    for (int i = 0; i < n; i++) { s[k] = rows[i]; s[k].pos = r->offset + i; k++; }
    long long off = r->offset;
    new_buffer(r, s, k);
    r->offset = off + n; r->idx = k;
    r->marker_buf = r->ident; r->marker_idx = r->idx;
    log_push(r, rec);
    free(order); free(kept);
}

/* ---- rollback through the undo log ---- */
/* the slots before the multi-row append `rec` (its kept rows are the first of the buffer) */
static Entry *prior_layout(const Ring *r, const Rec *rec, int *len) {
    int norder, nkept;
    int *order = chron_order(rec->capacity, rec->idx, G.K, rec->offset != rec->idx, &norder);
    char *kept = prefill_kept(norder, &nkept);
    Entry *old = xcalloc((size_t)norder, sizeof(Entry));
    int i = 0, t = 0;
    for (int j = 0; j < norder; j++) {
        if (kept[j]) old[j] = r->slots[i++];
        else if (t < rec->nsaved) old[j] = rec->saved[t++];
    }
    *len = rec->capacity ? rec->capacity : (r->cap < G.W ? r->cap : G.W);
    Entry *slots = xcalloc((size_t)*len, sizeof(Entry));
    for (int j = 0; j < norder; j++) slots[order[j]] = old[j];
    free(order); free(kept); free(old);
    return slots;
}

static void undo_append(Ring *r) {
    Rec *rec = &r->log[r->nlog - 1];
    if (!rec->prefill) {
        Entry *s = ents_dup(r->slots, r->cap);
        if (rec->nsaved) s[rec->slot] = rec->saved[0];
        new_buffer(r, s, r->cap);
    } else {
        int len;
        Entry *s = prior_layout(r, rec, &len);
        new_buffer(r, s, len);
    }
    r->offset = rec->offset; r->idx = rec->idx; r->marker_buf = -1;
    log_pop(r);
}

static void undo_part(Ring *r, long long n) {
    Rec *rec = &r->log[r->nlog - 1];
    int remaining = rec->rows - (int)n;
    if (remaining >= 2) {
        new_buffer(r, ents_dup(r->slots, (int)(r->idx - n)), (int)(r->idx - n));
        r->offset -= n; r->idx -= n; r->marker_buf = -1;
        rec->rows = remaining;
        return;
    }
    /* one row remains: alone it would have been a decode onto the prior ring */
    Entry first = r->slots[r->idx - rec->rows];
    int len;
    Entry *s = prior_layout(r, rec, &len);
    long long off = rec->offset, idx = rec->idx;
    new_buffer(r, s, len);
    r->offset = off; r->idx = idx; r->marker_buf = -1;
    log_pop(r);
    decode(r, first);
}

static long long ring_trim(Ring *r, long long n) {
    if (n < 0) n = 0;
    if (n > r->offset) n = r->offset;
    if (n == 0 || n > trimmable_rows(r)) return 0; /* beyond what it can take back: nothing */
    if (counters_rewind_exact(r)) {
        r->offset -= n; r->idx -= n;
        log_rewind(r, n);
        return n;
    }
    for (long long left = n; left > 0;) {
        int rows = r->log[r->nlog - 1].rows;
        if (left >= rows) { undo_append(r); left -= rows; }
        else { undo_part(r, left); left = 0; }
    }
    return n;
}

/* ---- make_mask for the n rows about to be appended ---- */
/* the positions of the keys the append of n rows will return (*len of them) */
static long long *append_positions(int n, int *len) {
    Ring t = ring_dup(&G.c);
    long long saved_ident = G.next_ident;
    if (n == 1) decode(&t, (Entry){0, NULL});
    else {
        Entry *rows = xcalloc((size_t)n, sizeof(Entry));
        prefill(&t, rows, n);
        free(rows);
    }
    G.next_ident = saved_ident;
    *len = valid_len(&t);
    long long *pos = xcalloc((size_t)*len, sizeof(long long));
    for (int j = 0; j < *len; j++) pos[j] = t.slots[j].pos;
    ring_free(&t);
    return pos;
}

static int mask_visible(long long query, long long key, long long window) {
    return key <= query && (key < G.K || query - key < window - G.K);
}

/* ---- rows ---- */
static size_t kbytes(void) { return (size_t)G.B * G.H * G.Dk * G.esize; }
static size_t vbytes(void) { return (size_t)G.B * G.H * G.Dv * G.esize; }

static void put_elem(unsigned char *p, uint32_t bits) {
    for (int i = 0; i < G.esize; i++) p[i] = (unsigned char)(bits >> (8 * i)); /* little-endian */
}

static uint32_t get_elem(const unsigned char *p) {
    uint32_t bits = 0;
    for (int i = 0; i < G.esize; i++) bits |= (uint32_t)p[i] << (8 * i);
    return bits;
}

/* the K and V row of token t: [B, H, Dk] then [B, H, Dv], C order (rows are
 * immutable once written: a slot that changes gets another row) */
static unsigned char *make_row(uint32_t t) {
    unsigned char *row = xcalloc(kbytes() + vbytes(), 1);
    for (int s = 0; s < 2; s++) {
        int D = s ? G.Dv : G.Dk;
        unsigned char *base = s ? row + kbytes() : row;
        for (int b = 0; b < G.B; b++)
            for (int h = 0; h < G.H; h++)
                for (int c = 0; c < D; c++)
                    put_elem(base + (((size_t)b * G.H + h) * D + c) * G.esize,
                             element_bits(t, (uint32_t)s, (uint32_t)b, (uint32_t)h, (uint32_t)c, G.dtype, G.wide));
    }
    return row;
}

/* ---- replies ---- */
static const char *err_cat, *err_msg;
static char err_buf[512];

static int refuse(const char *category, const char *msg) { err_cat = category; err_msg = msg; return 0; }

static void put_window(const Entry *w, int rows) {
    if (windows_as_ids) {
        putchar('[');
        for (int r = 0; r < rows; r++) {
            if (r) putchar(',');
            const unsigned char *row = w[r].row;
            if (!row) { printf("\"zero\""); continue; }
            const unsigned char *vrow = row + kbytes();
            int32_t lo = code_of(get_elem(row), G.dtype), hi = code_of(get_elem(vrow), G.dtype);
            long long t = -1;
            if (lo >= 0 && hi >= 0) {
                lo ^= (int32_t)(mix32(0) & 0xFFFu);
                hi ^= (int32_t)(mix32((uint32_t)1 << 22) & 0xFFFu); /* place(1, 0, 0, 0) = 64 * 64 * 1024 */
                t = unscramble(((uint32_t)hi << 12) | (uint32_t)lo);
            }
            int all_match = t >= 0, all_zero = 1;
            for (int s = 0; s < 2; s++) {
                int D = s ? G.Dv : G.Dk;
                const unsigned char *base = s ? vrow : row;
                for (int b = 0; b < G.B; b++)
                    for (int h = 0; h < G.H; h++)
                        for (int c = 0; c < D; c++) {
                            uint32_t got = get_elem(base + (((size_t)b * G.H + h) * D + c) * G.esize);
                            if (got) all_zero = 0;
                            if (t >= 0 && got != element_bits((uint32_t)t, (uint32_t)s, (uint32_t)b, (uint32_t)h, (uint32_t)c, G.dtype, G.wide)) all_match = 0;
                        }
            }
            if (all_match) printf("%lld", t); else printf(all_zero ? "\"zero\"" : "\"?\"");
        }
        putchar(']');
        return;
    }
    /* [B, H, rows, D] in C order, each element little-endian, in hex */
    printf("{\"rows\":%d", rows);
    for (int s = 0; s < 2; s++) {
        int D = s ? G.Dv : G.Dk;
        printf(s ? ",\"v\":\"" : ",\"k\":\"");
        for (int bh = 0; bh < G.B * G.H; bh++)
            for (int r = 0; r < rows; r++) {
                const unsigned char *row = w[r].row;
                for (size_t i = 0; i < (size_t)D * G.esize; i++)
                    printf("%02x", row ? (s ? row + kbytes() : row)[(size_t)bh * D * G.esize + i] : 0);
            }
        putchar('"');
    }
    putchar('}');
}

static void put_state(void) {
    const Ring *r = &G.c;
    printf(",\"state\":{\"offset\":%lld,\"idx\":%lld,\"capacity\":%d,\"trimmable\":%s,\"trimmable_rows\":%lld,"
           "\"log_saved_rows\":%d,\"cache\":", r->offset, r->idx, r->cap, is_trimmable(r) ? "true" : "false",
           trimmable_rows(r), log_saved_rows(r));
    put_window(r->slots, valid_len(r));
    printf(",\"held\":");
    if (G.has_held) put_window(G.held, G.nheld); else printf("null");
    printf(",\"holders\":{");
    for (int i = 0; i < G.nholders; i++) {
        if (i) putchar(',');
        put_strn(G.holders[i].name, G.holders[i].len); putchar(':');
        put_window(G.holders[i].r.slots, valid_len(&G.holders[i].r));
    }
    printf("}}");
}

/* the masks make_mask(n, window) gives before an append of n rows, one per
 * window asked (null: the ring's own, max_size): n strings of 0/1, one
 * character per key of the window the append will return */
static void put_masks(const J *windows, int n) {
    int len;
    long long *pos = append_positions(n, &len);
    printf(",\"masks\":[");
    for (int w = 0; w < windows->n; w++) {
        const J *wj = windows->items[w];
        long long window = wj->t == J_NUM ? wj->num : G.W;
        printf("%s[", w ? "," : "");
        for (int i = 0; i < n; i++) {
            printf("%s\"", i ? "," : "");
            for (int j = 0; j < len; j++) putchar(mask_visible(G.c.offset + i, pos[j], window) ? '1' : '0');
            putchar('"');
        }
        putchar(']');
    }
    putchar(']');
    free(pos);
}

/* ---- ops (docs/rotating.md; each refusal changes nothing) ---- */
static int find_holder(const char *name, size_t len) {
    for (int i = 0; i < G.nholders; i++)
        if (G.holders[i].len == len && !memcmp(G.holders[i].name, name, len)) return i;
    return -1;
}

static void add_holder(const char *name, size_t len, int state) {
    if (G.nholders == G.capholders) {
        G.capholders = G.capholders ? 2 * G.capholders : 4;
        G.holders = realloc(G.holders, (size_t)G.capholders * sizeof(Holder));
    }
    Holder *h = &G.holders[G.nholders++];
    h->name = xcalloc(len + 1, 1);
    memcpy(h->name, name, len);
    h->len = len; h->state = state;
    h->r = ring_dup(&G.c);
    if (state) h->r.cap = valid_len(&G.c); /* a state is the valid slots only */
}

static int op_append(long long n, long long first) {
    if (n < 1) return refuse("invalid_argument", "append: n must be >= 1");
    if (n == 1) G.last_inplace = decode(&G.c, (Entry){0, make_row((uint32_t)first)});
    else {
        Entry *rows = xcalloc((size_t)n, sizeof(Entry));
        for (int i = 0; i < n; i++) rows[i].row = make_row((uint32_t)(first + i));
        prefill(&G.c, rows, (int)n);
        free(rows);
        G.last_inplace = 0;
    }
    free(G.returned);
    G.nreturned = valid_len(&G.c);
    G.returned = ents_dup(G.c.slots, G.nreturned);
    G.has_returned = 1;
    return 1;
}

static int do_op(const J *op, long long first, long long *result, int *has_result, int *is_append) {
    const char *name = jstr(op, "op");
    *has_result = 0; *is_append = 0;
    if (!name) return refuse("invalid_argument", "op: missing");
    if (!strcmp(name, "append")) { *is_append = 1; return op_append(jint(op, "n", 0), first); }
    if (!strcmp(name, "fetch")) return 1;
    if (!strcmp(name, "trim")) { *has_result = 1; *result = ring_trim(&G.c, jint(op, "n", 0)); return 1; }
    if (!strcmp(name, "trim_to")) {
        long long len = jint(op, "len", -1);
        if (len < 0 || len > G.c.offset) {
            snprintf(err_buf, sizeof err_buf, "trim_to: len must satisfy 0 <= len <= offset (%lld), got %lld", G.c.offset, len);
            return refuse("invalid_argument", err_buf);
        }
        if (G.c.offset - len > trimmable_rows(&G.c)) {
            snprintf(err_buf, sizeof err_buf, "trim_to: cannot take back %lld rows exactly (it can take back %lld)",
                     G.c.offset - len, trimmable_rows(&G.c));
            return refuse("state", err_buf);
        }
        *has_result = 1; *result = ring_trim(&G.c, G.c.offset - len);
        return 1;
    }
    if (!strcmp(name, "hold")) {
        if (!G.has_returned) return refuse("state", "hold: no append has returned a window yet");
        free(G.held);
        G.held = ents_dup(G.returned, G.nreturned); G.nheld = G.nreturned; G.has_held = 1;
        return 1;
    }
    if (!strcmp(name, "release_hold")) { free(G.held); G.held = NULL; G.has_held = 0; return 1; }
    if (!strcmp(name, "reload")) {
        const char *via = jstr(op, "via");
        if (via && strcmp(via, "file") && strcmp(via, "state")) return refuse("invalid_argument", "reload: via must be 'file' or 'state'");
        int n = valid_len(&G.c);
        if (n) new_buffer(&G.c, ents_dup(G.c.slots, n), n);
        else { free(G.c.slots); G.c.slots = NULL; G.c.cap = 0; G.c.ident = -1; }
        G.c.marker_buf = -1;
        log_clear(&G.c);
        return 1;
    }
    if (strcmp(name, "snapshot") && strcmp(name, "restore") && strcmp(name, "drop") && strcmp(name, "copy")
        && strcmp(name, "state_snapshot") && strcmp(name, "state_restore")) {
        snprintf(err_buf, sizeof err_buf, "%s: not an operation of the rotating cache", name);
        return refuse("unsupported", err_buf);
    }
    J *hj = jget(op, "name");
    if (!hj || hj->t != J_STR) return refuse("invalid_argument", "name: missing");
    size_t hlen = (size_t)hj->num;
    int i = find_holder(hj->str, hlen);
    if (!strcmp(name, "copy")) {
        const char *live = jstr(op, "live");
        if (live && strcmp(live, "copy") && strcmp(live, "original")) return refuse("invalid_argument", "copy: live must be 'copy' or 'original'");
        if (i >= 0) return refuse("state", "copy: name is already in use");
        add_holder(hj->str, hlen, 0);
        if (live && !strcmp(live, "copy")) G.c.marker_buf = -1; /* the trace goes on with the copy: no marker */
        return 1;
    }
    if (!strcmp(name, "snapshot") || !strcmp(name, "state_snapshot")) {
        if (i >= 0) return refuse("state", "snapshot: name is already in use");
        add_holder(hj->str, hlen, name[0] == 's' && name[1] == 't');
        return 1;
    }
    if (i < 0) return refuse("state", "no snapshot named so");
    if (!strcmp(name, "drop")) {
        free(G.holders[i].name); ring_free(&G.holders[i].r);
        G.holders[i] = G.holders[--G.nholders];
        return 1;
    }
    /* restore / state_restore: adopt the snapshot's buffer and counters, no marker, an empty log */
    int want_state = !strcmp(name, "state_restore");
    if (G.holders[i].state != want_state) return refuse("state", "restore and state_restore take their own kind of snapshot");
    const Ring *s = &G.holders[i].r;
    free(G.c.slots);
    G.c.slots = ents_dup(s->slots, s->cap); G.c.cap = s->cap;
    G.c.offset = s->offset; G.c.idx = s->idx; G.c.ident = s->ident;
    G.c.marker_buf = -1;
    log_clear(&G.c);
    return 1;
}

static int dtype_of(const char *s) {
    if (!s || !strcmp(s, "float16")) return F16;
    if (!strcmp(s, "bfloat16")) return BF16;
    if (!strcmp(s, "float32")) return F32;
    return -1;
}

static const char *FIELDS[] = {"kind", "mode", "step", "batch", "kv_heads", "head_dim", "k_head_dim",
                               "v_head_dim", "dtype", "inplace", "inplace_env", "rows", "max_size", "keep", "undo", NULL};

static void clear_all(void) {
    ring_free(&G.c);
    free(G.returned); free(G.held);
    for (int i = 0; i < G.nholders; i++) { free(G.holders[i].name); ring_free(&G.holders[i].r); }
    free(G.holders);
    memset(&G, 0, sizeof(G));
}

static int do_init(const J *cache, int wide) {
    for (int i = 0; cache && cache->t == J_OBJ && i < cache->n; i++) {
        int known = 0;
        for (int f = 0; FIELDS[f]; f++) known |= !strcmp(cache->keys[i], FIELDS[f]);
        if (!known) { snprintf(err_buf, sizeof err_buf, "cache field %s is not supported", cache->keys[i]); return refuse("unsupported", err_buf); }
    }
    const char *kind = jstr(cache, "kind"), *mode = jstr(cache, "mode"), *rows = jstr(cache, "rows");
    if (!kind || strcmp(kind, "rotating")) return refuse("unsupported", "only kind rotating");
    if (mode && strcmp(mode, "fp16")) return refuse("unsupported", "only mode fp16");
    if (!rows || strcmp(rows, "portable")) return refuse("unsupported", "only portable rows");
    int dtype = dtype_of(jstr(cache, "dtype"));
    if (dtype < 0) return refuse("unsupported", "dtype");
    long long step = jint(cache, "step", 256), B = jint(cache, "batch", 1), H = jint(cache, "kv_heads", 2);
    long long D = jint(cache, "head_dim", 8);
    long long Dk = jint(cache, "k_head_dim", D), Dv = jint(cache, "v_head_dim", D);
    long long W = jint(cache, "max_size", -1), K = jint(cache, "keep", 0), U = jint(cache, "undo", 0);
    if (W < 1 || W > (1 << 20)) return refuse("invalid_argument", "max_size: must be >= 1");
    if (K < 0 || K >= W) return refuse("invalid_argument", "keep: must satisfy 0 <= keep < max_size");
    if (U < 0 || U > (1 << 20)) return refuse("invalid_argument", "undo: must be >= 0");
    if (step < 1 || step > (1 << 20) || B < 1 || B > 64 || H < 1 || H > 64 || Dk < 1 || Dk > 1024 || Dv < 1 || Dv > 1024)
        return refuse("invalid_argument", "cache sizes out of range");
    J *inp = jget(cache, "inplace");
    clear_all();
    G.ready = 1; G.step = (int)step; G.B = (int)B; G.H = (int)H; G.Dk = (int)Dk; G.Dv = (int)Dv;
    G.W = (int)W; G.K = (int)K; G.undo = (int)U;
    G.dtype = dtype; G.esize = dtype == F32 ? 4 : 2; G.wide = wide;
    G.inplace = !(inp && inp->t == J_BOOL && !inp->num);
    const char *env = jstr(cache, "inplace_env"); /* a KV_INPLACE_WRITE spelling: off for 0, false, off, no */
    if (env) {
        char word[8] = {0};
        size_t a = 0, b = strlen(env), k = 0;
        while (a < b && (env[a] == ' ' || env[a] == '\t' || env[a] == '\n' || env[a] == '\r')) a++;
        while (b > a && (env[b - 1] == ' ' || env[b - 1] == '\t' || env[b - 1] == '\n' || env[b - 1] == '\r')) b--;
        for (; a < b && k < sizeof word - 1; a++) word[k++] = (char)(env[a] >= 'A' && env[a] <= 'Z' ? env[a] + 32 : env[a]);
        G.inplace = !(b - a == 0 && (!strcmp(word, "0") || !strcmp(word, "false") || !strcmp(word, "off") || !strcmp(word, "no")));
    }
    G.c.ident = -1; G.c.marker_buf = -1;
    return 1;
}

static void hello(long long id) {
    printf("{\"id\":%lld,\"kvproto\":2,\"adapter\":\"kvspec-ring-c\",\"version\":\"1.0\",\"windows\":\"%s\","
           "\"kinds\":{\"rotating\":{\"modes\":[\"fp16\"],\"dtypes\":[\"float16\",\"bfloat16\",\"float32\"],\"fields\":[",
           id, windows_as_ids ? "identities" : "bytes");
    for (int f = 0; FIELDS[f]; f++) printf("%s\"%s\"", f ? "," : "", FIELDS[f]);
    printf("],\"ops\":[\"append\",\"fetch\",\"hold\",\"release_hold\",\"trim\",\"trim_to\",\"snapshot\",\"restore\","
           "\"drop\",\"state_snapshot\",\"state_restore\",\"copy\",\"reload\"],"
           "\"observables\":[\"offset\",\"idx\",\"capacity\",\"trimmable\",\"trimmable_rows\",\"log_saved_rows\","
           "\"inplace\",\"masks\"]}}}\n");
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--windows") && i + 1 < argc) windows_as_ids = !strcmp(argv[++i], "identities");
        else { fprintf(stderr, "usage: %s [--windows bytes|identities]\n", argv[0]); return 2; }
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
            printf("{\"id\":%lld", id);
            if (!strcmp(what, "init")) {
                J *wide = jget(req, "wide");
                ok = do_init(jget(req, "cache"), wide && wide->t == J_BOOL && wide->num);
            } else if (!strcmp(what, "op") && G.ready) {
                J *op = jget(req, "op");
                J *masks = jget(req, "masks");
                const char *name = jstr(op, "op");
                long long n = jint(op, "n", 0);
                /* the masks are the ring's before the append, as a model asks for them */
                if (masks && masks->t == J_ARR && name && !strcmp(name, "append") && n >= 1) put_masks(masks, (int)n);
                ok = do_op(op, jint(req, "first", 0), &result, &has_result, &is_append);
            } else {
                ok = refuse("state", "no cache: send init first");
            }
            printf(",\"ok\":%s", ok ? "true" : "false");
            if (!ok) { printf(",\"error\":{\"category\":\"%s\",\"message\":", err_cat); put_str(err_msg); putchar('}'); }
            else if (is_append) { printf(",\"result\":"); put_window(G.returned, G.nreturned); printf(",\"inplace\":%s", G.last_inplace ? "true" : "false"); }
            else if (has_result) printf(",\"result\":%lld", result);
            if (G.ready) put_state();
            printf("}\n");
        }
        fflush(stdout);
        jfree(req);
    }
    free(line);
    clear_all();
    return 0;
}
