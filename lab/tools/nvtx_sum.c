/* Lab (issue #56): an NVTX injection library that sums the host time of every NVTX range by name, for
 * MLX's CUDA backend, which marks each primitive's encoding ("CustomKernel::eval_gpu", ...), its graph
 * commits ("CommandEncoder::commit") and its waits for the device ("cu::AtomicEvent::wait") with NVTX
 * ranges. With no Nsight tool on a machine, this says where the host's time goes, by MLX's own names.
 *
 *   gcc -O2 -shared -fPIC -o /tmp/libnvtx_sum.so lab/tools/nvtx_sum.c -lpthread
 *   NVTX_INJECTION64_PATH=/tmp/libnvtx_sum.so python3 lab/tools/host_ranges.py MODE MODEL
 *
 * NVTX (header-only in MLX) loads the library named by NVTX_INJECTION64_PATH at its first call and asks
 * it to fill its function tables (`InitializeInjectionNvtx2`); the range functions here keep a stack per
 * thread and add each range's inclusive time to its name's row. `nvtx_sum_reset` and `nvtx_sum_dump`
 * (called through ctypes) open a window and write it out: a line per name, "count<TAB>ns<TAB>name".
 * The types are NVTX v3's (nvToolsExt.h), declared here so that nothing but a C compiler is needed.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

typedef void (*fn_t)(void);
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, fn_t*** out_table, unsigned int* out_size);
} callbacks_t;
typedef struct {
    uint16_t version, size;
    uint32_t category;
    int32_t colorType;
    uint32_t color;
    int32_t payloadType, reserved0;
    uint64_t payload;
    int32_t messageType;
    union {
        const char* ascii;
        const void* other;
    } message;
} attributes_t;

enum { ETID_CALLBACKS = 1, MODULE_CORE = 1, MODULE_CORE2 = 5, MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3 };
enum { CORE_PUSH_EX = 8, CORE_PUSH_A = 9, CORE_POP = 11, CORE2_PUSH_EX = 4, CORE2_POP = 5 };
enum { CORE2_REGISTER_STRING_A = 10 };

#define NAMES 512
#define DEPTH 64
static struct {
    char name[96];
    uint64_t count, ns;
} rows[NAMES];
static int used;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread struct {
    const char* name;
    uint64_t start;
} stack[DEPTH];
static __thread int depth;

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int push(const char* name) {
    if (depth < DEPTH) {
        stack[depth].name = name ? name : "(unnamed)";
        stack[depth].start = now_ns();
    }
    return depth++;
}

static int pop(void) {
    if (depth <= 0) return -1;
    --depth;
    if (depth >= DEPTH) return depth;
    uint64_t took = now_ns() - stack[depth].start;
    const char* name = stack[depth].name;
    pthread_mutex_lock(&lock);
    int i = 0;
    while (i < used && strncmp(rows[i].name, name, sizeof rows[i].name - 1) != 0) ++i;
    if (i == used && used < NAMES) strncpy(rows[used++].name, name, sizeof rows[i].name - 1);
    if (i < NAMES) {
        rows[i].count += 1;
        rows[i].ns += took;
    }
    pthread_mutex_unlock(&lock);
    return depth;
}

static const char* message_of(const attributes_t* a) {
    if (!a) return NULL;
    if (a->messageType == MESSAGE_ASCII) return a->message.ascii;
    if (a->messageType == MESSAGE_REGISTERED) return (const char*)a->message.other;  // see register_string
    return "(non-ascii)";
}

static int push_ex(const attributes_t* a) { return push(message_of(a)); }
static int push_a(const char* m) { return push(m); }
static int pop_core(void) { return pop(); }
static int domain_push_ex(const void* domain, const attributes_t* a) { return push(message_of(a)); }
static int domain_pop(const void* domain) { return pop(); }
// A registered string's handle is the string itself, so that ranges named by one read as ASCII ones.
static const void* register_string(const void* domain, const char* s) { return s; }

static void fill(const callbacks_t* callbacks, int module, int slot, fn_t f) {
    fn_t** table = NULL;
    unsigned int size = 0;
    if (callbacks->GetModuleFunctionTable(module, &table, &size) && table && (unsigned)slot < size &&
        table[slot])
        *table[slot] = f;
}

int InitializeInjectionNvtx2(const void* (*get_export_table)(uint32_t)) {
    const callbacks_t* callbacks = (const callbacks_t*)get_export_table(ETID_CALLBACKS);
    if (!callbacks) return 0;
    fill(callbacks, MODULE_CORE, CORE_PUSH_EX, (fn_t)push_ex);
    fill(callbacks, MODULE_CORE, CORE_PUSH_A, (fn_t)push_a);
    fill(callbacks, MODULE_CORE, CORE_POP, (fn_t)pop_core);
    fill(callbacks, MODULE_CORE2, CORE2_PUSH_EX, (fn_t)domain_push_ex);
    fill(callbacks, MODULE_CORE2, CORE2_POP, (fn_t)domain_pop);
    fill(callbacks, MODULE_CORE2, CORE2_REGISTER_STRING_A, (fn_t)register_string);
    return 1;
}

void nvtx_sum_reset(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < used; ++i) rows[i].count = rows[i].ns = 0;
    pthread_mutex_unlock(&lock);
}

int nvtx_sum_dump(const char* path) {
    FILE* f = fopen(path, "w");
    if (!f) return -1;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < used; ++i)
        if (rows[i].count) fprintf(f, "%llu\t%llu\t%s\n", (unsigned long long)rows[i].count,
                                   (unsigned long long)rows[i].ns, rows[i].name);
    pthread_mutex_unlock(&lock);
    fclose(f);
    return 0;
}
