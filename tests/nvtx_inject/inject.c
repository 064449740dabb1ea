/*
 * A tiny NVTX tool for tests: implements the NVTX v2 injection entry point
 * (InitializeInjectionNvtx2), takes over the core and domain (CORE, CORE2)
 * callbacks and records every range, domain, registered string and category
 * as one tab-separated line in a text file.
 *
 *   cc -shared -fPIC -O2 -o libnvtx_inject.so inject.c -lpthread
 *   NVTX_INJECTION64_PATH=$PWD/libnvtx_inject.so LGH_NVTX_LOG=/tmp/nvtx.%p.log python train.py
 *
 * "%p" in LGH_NVTX_LOG becomes the process id, so every process (DDP ranks,
 * forked DataLoader workers) writes its own file. Without LGH_NVTX_LOG the
 * events are formatted and dropped, which still costs what a recording tool
 * costs (used to measure per-range overhead). Lines are buffered per process
 * and written when the outermost range of a named domain closes on a thread
 * (once per training step), when the buffer fills, at exit and before fork.
 * depth is the 0-based nesting level within the domain on that thread.
 *
 * Line formats (fields separated by one tab):
 *   D      ts tid domain                                        domain created
 *   S      ts tid domain text                                   string registered
 *   C      ts tid domain id name                                category named
 *   push   ts tid domain message msgtype category color payload depth
 *   pop    ts tid domain message depth                          (message "?" if unmatched)
 *   start  ts tid domain message msgtype category color payload id
 *   end    ts tid domain id
 *   mark   ts tid domain message msgtype category color payload
 * domain is "" for the global (unnamed) domain; msgtype is ascii, registered,
 * unicode or none; color is 0xAARRGGBB or "-"; payload is type:value or "-".
 *
 * The NVTX types are declared here rather than included, so the test needs
 * only a C compiler, not the CUDA toolkit. They mirror nvtx3/nvToolsExt.h and
 * nvtx3/nvtxDetail/nvtxTypes.h (NVTX v3, event attributes v2); the static
 * asserts pin the layout the header defines.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- ABI mirror of the NVTX headers ---- */
typedef void (*nvtx_fn_t)(void);
typedef nvtx_fn_t **nvtx_table_t;
typedef const void *(*nvtx_get_export_table_t)(uint32_t id);

typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, nvtx_table_t *out_table, unsigned int *out_size);
} nvtx_etbl_callbacks_t;

typedef struct {
    size_t struct_size;
    uint32_t version;
    uint32_t reserved0;
    void (*SetInjectionNvtxVersion)(uint32_t version);
} nvtx_etbl_version_t;

typedef struct {
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType;
    int32_t reserved0;
    union {
        uint64_t ullValue;
        int64_t llValue;
        double dValue;
        uint32_t uiValue;
        int32_t iValue;
        float fValue;
    } payload;
    int32_t messageType;
    union {
        const char *ascii;
        const wchar_t *unicode;
        const void *registered;
    } message;
} nvtx_event_attr_t;

_Static_assert(offsetof(nvtx_event_attr_t, payload) == 24, "nvtxEventAttributes_v2 layout");
_Static_assert(offsetof(nvtx_event_attr_t, messageType) == 32, "nvtxEventAttributes_v2 layout");
_Static_assert(offsetof(nvtx_event_attr_t, message) == 40, "nvtxEventAttributes_v2 layout");
_Static_assert(sizeof(nvtx_event_attr_t) == 48, "nvtxEventAttributes_v2 size");

enum { ETID_CALLBACKS = 1, ETID_VERSIONINFO = 3 };
enum { MODULE_CORE = 1, MODULE_CORE2 = 5 };
enum {
    CORE_MarkEx = 1, CORE_MarkA = 2, CORE_RangeStartEx = 4, CORE_RangeStartA = 5, CORE_RangeEnd = 7,
    CORE_RangePushEx = 8, CORE_RangePushA = 9, CORE_RangePop = 11, CORE_NameCategoryA = 12
};
enum {
    CORE2_DomainMarkEx = 1, CORE2_DomainRangeStartEx = 2, CORE2_DomainRangeEnd = 3, CORE2_DomainRangePushEx = 4,
    CORE2_DomainRangePop = 5, CORE2_DomainNameCategoryA = 8, CORE2_DomainRegisterStringA = 10,
    CORE2_DomainCreateA = 12, CORE2_DomainDestroy = 14, CORE2_Initialize = 15
};
enum { MSG_ASCII = 1, MSG_UNICODE = 2, MSG_REGISTERED = 3 };
enum { COLOR_ARGB = 1 };
enum { PL_U64 = 1, PL_I64 = 2, PL_F64 = 3, PL_U32 = 4, PL_I32 = 5, PL_F32 = 6 };

/* ---- Our handles: a domain handle points at its name, a string handle at its text ---- */
typedef struct { char *name; } tool_domain_t;
typedef struct { const tool_domain_t *domain; char *text; } tool_string_t;

static const char *domain_name(const void *d) { return d ? ((const tool_domain_t *)d)->name : ""; }

/* gettid() is a system call; remember it per thread (a forked child is a new thread, see atfork_child). */
static __thread long t_tid;
static long thread_id(void) {
    if (!t_tid) t_tid = (long)syscall(SYS_gettid);
    return t_tid;
}

/* ---- Output: one buffer for the process, flushed with write(2) ---- */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_fd = -1;
static char g_template[4096];
static char g_buf[1 << 16];
static size_t g_len;
static uint64_t g_next_range_id = 1;
static long long g_last_flush_ns;

static void flush_locked(void) {
    size_t off = 0;
    while (g_fd >= 0 && off < g_len) {
        ssize_t n = write(g_fd, g_buf + off, g_len - off);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        off += (size_t)n;
    }
    g_len = 0;
}

static void open_log_locked(void) {
    char path[4200];
    size_t j = 0;
    if (g_fd >= 0) close(g_fd);
    g_fd = -1;
    if (!g_template[0]) return;
    for (size_t i = 0; g_template[i] && j < sizeof(path) - 32; i++) {
        if (g_template[i] == '%' && g_template[i + 1] == 'p') {
            j += (size_t)snprintf(path + j, sizeof(path) - j, "%ld", (long)getpid());
            i++;
        } else {
            path[j++] = g_template[i];
        }
    }
    path[j] = 0;
    g_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

/* A forked child must not write the parent's buffered lines a second time. */
static void atfork_prepare(void) { pthread_mutex_lock(&g_lock); flush_locked(); }
static void atfork_parent(void) { pthread_mutex_unlock(&g_lock); }
static void atfork_child(void) {
    t_tid = 0;
    g_len = 0;
    if (strstr(g_template, "%p")) {
        open_log_locked();
    } else {
        if (g_fd >= 0) close(g_fd);
        g_fd = -1;
    }
    pthread_mutex_unlock(&g_lock);
}

static void setup_once(void) {
    const char *t = getenv("LGH_NVTX_LOG");
    if (t) {
        strncpy(g_template, t, sizeof(g_template) - 1);
        open_log_locked();
    }
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
}

EXPORT void lgh_nvtx_flush(void) {
    pthread_mutex_lock(&g_lock);
    flush_locked();
    pthread_mutex_unlock(&g_lock);
}

__attribute__((destructor)) static void flush_at_exit(void) { lgh_nvtx_flush(); }

enum { FLUSH_NO = 0, FLUSH_NOW = 1, FLUSH_IF_STALE = 2 };
#define EMIT(flush, kind, fmt, ...) emit_kind((flush), (kind), fmt, __VA_ARGS__)
static void emit_kind(int flush, const char *kind, const char *fmt, ...) {
    char rest[1800];
    char line[2048];
    struct timespec ts;
    va_list ap;
    int n;
    va_start(ap, fmt);
    vsnprintf(rest, sizeof(rest), fmt, ap);
    va_end(ap);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    long long now = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    n = snprintf(line, sizeof(line), "%s\t%lld\t%ld\t%s\n", kind, now, thread_id(), rest);
    if (n < 0) return;
    if (n >= (int)sizeof(line)) { n = (int)sizeof(line) - 1; line[n - 1] = '\n'; }
    pthread_mutex_lock(&g_lock);
    if (g_len + (size_t)n > sizeof(g_buf)) flush_locked();
    memcpy(g_buf + g_len, line, (size_t)n);
    g_len += (size_t)n;
    if (flush == FLUSH_NOW || (flush == FLUSH_IF_STALE && now - g_last_flush_ns > 50000000LL)) {
        flush_locked();
        g_last_flush_ns = now;
    }
    pthread_mutex_unlock(&g_lock);
}

/* ---- Formatting of event attributes ---- */
static const char *msg_text(const nvtx_event_attr_t *a, const char **type, char *scratch, size_t n) {
    if (!a) { *type = "none"; return ""; }
    switch (a->messageType) {
    case MSG_ASCII: *type = "ascii"; return a->message.ascii ? a->message.ascii : "";
    case MSG_REGISTERED:
        *type = "registered";
        return a->message.registered ? ((const tool_string_t *)a->message.registered)->text : "";
    case MSG_UNICODE:
        *type = "unicode";
        if (a->message.unicode && wcstombs(scratch, a->message.unicode, n - 1) != (size_t)-1) {
            scratch[n - 1] = 0;
            return scratch;
        }
        return "?";
    default: *type = "none"; return "";
    }
}

static void payload_text(const nvtx_event_attr_t *a, char *out, size_t n) {
    if (!a) { snprintf(out, n, "-"); return; }
    switch (a->payloadType) {
    case PL_U64: snprintf(out, n, "u64:%llu", (unsigned long long)a->payload.ullValue); break;
    case PL_I64: snprintf(out, n, "i64:%lld", (long long)a->payload.llValue); break;
    case PL_F64: snprintf(out, n, "f64:%.17g", a->payload.dValue); break;
    case PL_U32: snprintf(out, n, "u32:%u", a->payload.uiValue); break;
    case PL_I32: snprintf(out, n, "i32:%d", a->payload.iValue); break;
    case PL_F32: snprintf(out, n, "f32:%.9g", (double)a->payload.fValue); break;
    case 0: snprintf(out, n, "-"); break;
    default: snprintf(out, n, "ext:%d", a->payloadType); break;
    }
}

static void color_text(const nvtx_event_attr_t *a, char *out, size_t n) {
    if (a && a->colorType == COLOR_ARGB) snprintf(out, n, "0x%08x", a->color);
    else snprintf(out, n, "-");
}

/* ---- Per-thread push/pop stack (NVTX push/pop ranges are per thread, per domain) ---- */
#define MAX_DEPTH 512
static __thread const void *t_dom[MAX_DEPTH];
static __thread const char *t_msg[MAX_DEPTH];
static __thread int t_depth;

static int depth_in(const void *domain) {
    int d = 0;
    for (int i = 0; i < t_depth; i++) d += (t_dom[i] == domain);
    return d;
}

static int do_push(const void *domain, const nvtx_event_attr_t *a, const char *ascii) {
    char scratch[512], color[16], payload[64];
    const char *type = "ascii";
    const char *msg = ascii ? ascii : msg_text(a, &type, scratch, sizeof(scratch));
    int level = depth_in(domain);
    color_text(a, color, sizeof(color));
    payload_text(a, payload, sizeof(payload));
    EMIT(FLUSH_NO, "push", "%s\t%s\t%s\t%u\t%s\t%s\t%d", domain_name(domain), msg, type, a ? a->category : 0u, color,
         payload, level);
    if (t_depth < MAX_DEPTH) {
        t_dom[t_depth] = domain;
        /* registered strings and our domain names live forever; ASCII messages may not */
        t_msg[t_depth] = (a && a->messageType == MSG_REGISTERED && a->message.registered)
                             ? ((const tool_string_t *)a->message.registered)->text
                             : NULL;
        t_depth++;
    }
    return level;
}

static int do_pop(const void *domain) {
    for (int i = t_depth - 1; i >= 0; i--) {
        if (t_dom[i] != domain) continue;
        const char *msg = t_msg[i] ? t_msg[i] : "";
        memmove(&t_dom[i], &t_dom[i + 1], sizeof(t_dom[0]) * (size_t)(t_depth - i - 1));
        memmove(&t_msg[i], &t_msg[i + 1], sizeof(t_msg[0]) * (size_t)(t_depth - i - 1));
        t_depth--;
        int level = depth_in(domain);
        /* Flush when the outermost range of a named domain closes (once per training step), so nothing
           is lost if the process leaves through os._exit (forked DDP workers do); in the global domain,
           where emit_nvtx pushes one range per operator, at most every 50 ms. */
        EMIT(level == 0 ? (domain ? FLUSH_NOW : FLUSH_IF_STALE) : FLUSH_NO, "pop", "%s\t%s\t%d",
             domain_name(domain), msg, level);
        return level;
    }
    EMIT(FLUSH_NOW, "pop", "%s\t?\t-1", domain_name(domain));
    return -1;
}

static uint64_t do_start(const void *domain, const nvtx_event_attr_t *a, const char *ascii) {
    char scratch[512], color[16], payload[64];
    const char *type = "ascii";
    const char *msg = ascii ? ascii : msg_text(a, &type, scratch, sizeof(scratch));
    uint64_t id = __atomic_fetch_add(&g_next_range_id, 1, __ATOMIC_RELAXED);
    color_text(a, color, sizeof(color));
    payload_text(a, payload, sizeof(payload));
    EMIT(FLUSH_NO, "start", "%s\t%s\t%s\t%u\t%s\t%s\t%llu", domain_name(domain), msg, type, a ? a->category : 0u, color,
         payload, (unsigned long long)id);
    return id;
}

static void do_end(const void *domain, uint64_t id) {
    EMIT(FLUSH_NO, "end", "%s\t%llu", domain_name(domain), (unsigned long long)id);
}

static void do_mark(const void *domain, const nvtx_event_attr_t *a, const char *ascii) {
    char scratch[512], color[16], payload[64];
    const char *type = "ascii";
    const char *msg = ascii ? ascii : msg_text(a, &type, scratch, sizeof(scratch));
    color_text(a, color, sizeof(color));
    payload_text(a, payload, sizeof(payload));
    EMIT(FLUSH_NO, "mark", "%s\t%s\t%s\t%u\t%s\t%s", domain_name(domain), msg, type, a ? a->category : 0u, color, payload);
}

/* ---- CORE module (global domain) ---- */
static void c_MarkEx(const nvtx_event_attr_t *a) { do_mark(NULL, a, NULL); }
static void c_MarkA(const char *m) { do_mark(NULL, NULL, m); }
static uint64_t c_RangeStartEx(const nvtx_event_attr_t *a) { return do_start(NULL, a, NULL); }
static uint64_t c_RangeStartA(const char *m) { return do_start(NULL, NULL, m); }
static void c_RangeEnd(uint64_t id) { do_end(NULL, id); }
static int c_RangePushEx(const nvtx_event_attr_t *a) { return do_push(NULL, a, NULL); }
static int c_RangePushA(const char *m) { return do_push(NULL, NULL, m); }
static int c_RangePop(void) { return do_pop(NULL); }
static void c_NameCategoryA(uint32_t id, const char *name) { EMIT(FLUSH_NO, "C", "\t%u\t%s", id, name ? name : ""); }

/* ---- CORE2 module (domains) ---- */
static void d_MarkEx(const void *d, const nvtx_event_attr_t *a) { do_mark(d, a, NULL); }
static uint64_t d_RangeStartEx(const void *d, const nvtx_event_attr_t *a) { return do_start(d, a, NULL); }
static void d_RangeEnd(const void *d, uint64_t id) { do_end(d, id); }
static int d_RangePushEx(const void *d, const nvtx_event_attr_t *a) { return do_push(d, a, NULL); }
static int d_RangePop(const void *d) { return do_pop(d); }
static void d_NameCategoryA(const void *d, uint32_t id, const char *name) {
    EMIT(FLUSH_NO, "C", "%s\t%u\t%s", domain_name(d), id, name ? name : "");
}
static const void *d_RegisterStringA(const void *d, const char *s) {
    tool_string_t *h = calloc(1, sizeof(*h));
    if (!h) return NULL;
    h->domain = d;
    h->text = strdup(s ? s : "");
    EMIT(FLUSH_NO, "S", "%s\t%s", domain_name(d), h->text);
    return h;
}
static const void *d_CreateA(const char *name) {
    tool_domain_t *h = calloc(1, sizeof(*h));
    if (!h) return NULL;
    h->name = strdup(name ? name : "");
    EMIT(FLUSH_NOW, "D", "%s", h->name);
    return h;
}
/* Handles are never freed: a late pop or end on a destroyed domain must still print its name. */
static void d_Destroy(const void *d) { (void)d; }
static void d_Initialize(const void *reserved) { (void)reserved; }

static void install(nvtx_table_t table, unsigned int size, unsigned int id, nvtx_fn_t fn) {
    if (table && id < size && table[id]) *table[id] = fn;
}

EXPORT int InitializeInjectionNvtx2(nvtx_get_export_table_t get_export_table) {
    const nvtx_etbl_callbacks_t *cb;
    const nvtx_etbl_version_t *ver;
    nvtx_table_t t = NULL;
    unsigned int n = 0;

    pthread_once(&g_once, setup_once);
    if (!get_export_table) return 0;
    cb = (const nvtx_etbl_callbacks_t *)get_export_table(ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof(*cb) || !cb->GetModuleFunctionTable) return 0;
    ver = (const nvtx_etbl_version_t *)get_export_table(ETID_VERSIONINFO);
    if (ver && ver->struct_size >= sizeof(*ver) && ver->SetInjectionNvtxVersion) ver->SetInjectionNvtxVersion(2);

    if (cb->GetModuleFunctionTable(MODULE_CORE, &t, &n)) {
        install(t, n, CORE_MarkEx, (nvtx_fn_t)c_MarkEx);
        install(t, n, CORE_MarkA, (nvtx_fn_t)c_MarkA);
        install(t, n, CORE_RangeStartEx, (nvtx_fn_t)c_RangeStartEx);
        install(t, n, CORE_RangeStartA, (nvtx_fn_t)c_RangeStartA);
        install(t, n, CORE_RangeEnd, (nvtx_fn_t)c_RangeEnd);
        install(t, n, CORE_RangePushEx, (nvtx_fn_t)c_RangePushEx);
        install(t, n, CORE_RangePushA, (nvtx_fn_t)c_RangePushA);
        install(t, n, CORE_RangePop, (nvtx_fn_t)c_RangePop);
        install(t, n, CORE_NameCategoryA, (nvtx_fn_t)c_NameCategoryA);
    }
    t = NULL;
    n = 0;
    if (cb->GetModuleFunctionTable(MODULE_CORE2, &t, &n)) {
        install(t, n, CORE2_DomainMarkEx, (nvtx_fn_t)d_MarkEx);
        install(t, n, CORE2_DomainRangeStartEx, (nvtx_fn_t)d_RangeStartEx);
        install(t, n, CORE2_DomainRangeEnd, (nvtx_fn_t)d_RangeEnd);
        install(t, n, CORE2_DomainRangePushEx, (nvtx_fn_t)d_RangePushEx);
        install(t, n, CORE2_DomainRangePop, (nvtx_fn_t)d_RangePop);
        install(t, n, CORE2_DomainNameCategoryA, (nvtx_fn_t)d_NameCategoryA);
        install(t, n, CORE2_DomainRegisterStringA, (nvtx_fn_t)d_RegisterStringA);
        install(t, n, CORE2_DomainCreateA, (nvtx_fn_t)d_CreateA);
        install(t, n, CORE2_DomainDestroy, (nvtx_fn_t)d_Destroy);
        install(t, n, CORE2_Initialize, (nvtx_fn_t)d_Initialize);
    }
    return 1;
}
