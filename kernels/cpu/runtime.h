// The emulated GPU runtime: runs a kernel of the CUDA/HIP source on the CPU, one block at a time per
// OS thread, the threads of a block as cooperative fibers (a stack each) that switch only at
// `__syncthreads` and at the warp shuffles. Compiled into every emulated program, before the CPU
// portability header (`kernels/cpu/port.h`) and the kernel source; the program ends with one
// `EMU_KERNEL(name)` per kernel, which exports the launcher the host calls.
//
// A block runs in rounds: every ready fiber runs until it waits (at a barrier or a shuffle) or
// returns. Then a warp whose lanes all wait at a shuffle exchanges and goes on; failing that, a block
// whose threads all wait at the barrier goes on. Anything else is a kernel that would hang or read
// an undefined value on a GPU (a barrier some threads never reach, a shuffle a lane never joins):
// the launch fails with a message naming the block, the warp and the lanes, instead of hanging.
//
// The host passes every argument as an `EmuArg` (a buffer's address and element size, or a scalar
// of the prototype's exact type); the launcher checks them against the kernel's prototype before the
// first thread runs.

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <type_traits>
#include <utility>

// One kernel argument, as the host lays it out (`#[repr(C)]` on the Rust side).
enum EmuArgKind { EMU_ARG_PTR = 1, EMU_ARG_I32 = 2, EMU_ARG_I64 = 3, EMU_ARG_F32 = 4, EMU_ARG_F64 = 5, EMU_ARG_I64X8 = 6 };
struct EmuArg {
    int kind;
    // Bytes per element of a buffer; 0 for a null buffer (any pointer type) and for scalars.
    int element_size;
    unsigned long long payload[8];
};

struct EmuDim3 {
    unsigned int x, y, z;
};

// A fiber's saved execution context, and the switch between two. On x86-64 a switch saves the
// callee-saved registers (and the SSE and x87 control words) on the running stack and swaps stack
// pointers: a few nanoseconds. Elsewhere `ucontext` (glibc's `swapcontext` also saves and restores
// the signal mask: a system call per switch, several times slower on kernels with many barriers).
#if defined(__x86_64__)
struct EmuContext {
    void* sp;
};
extern "C" void emu_switch_x86_64(void** save, void* load);
asm(R"(
    .pushsection .text
    .globl emu_switch_x86_64
    .hidden emu_switch_x86_64
    .type emu_switch_x86_64, @function
emu_switch_x86_64:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch_x86_64, .-emu_switch_x86_64
    .popsection
)");
static inline void emu_switch(EmuContext* from, EmuContext* to) { emu_switch_x86_64(&from->sp, to->sp); }
// Prepares `c` to run `entry` on the stack [stack, stack + size) at its first switch: the frame
// `emu_switch_x86_64` pops (control words, six registers, the return address `entry`), placed so
// that `entry` starts as a called function does (the stack 8 bytes past a multiple of 16).
static inline void emu_start(EmuContext* c, char* stack, size_t size, void (*entry)()) {
    unsigned long long top = ((unsigned long long)(stack + size)) & ~15ull;
    unsigned long long* frame = (unsigned long long*)(top - 8) - 8;
    unsigned int control[2];
    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(control[0]), "=m"(control[1]));
    memcpy(&frame[0], control, 8);
    for (int i = 1; i <= 6; ++i) frame[i] = 0;
    frame[7] = (unsigned long long)entry;
    c->sp = frame;
}
#else
struct EmuContext {
    ucontext_t uc;
};
static inline void emu_switch(EmuContext* from, EmuContext* to) { swapcontext(&from->uc, &to->uc); }
static inline void emu_start(EmuContext* c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, entry, 0);
}
#endif

enum EmuState { EMU_READY, EMU_BARRIER, EMU_SHUFFLE, EMU_DONE };

struct EmuThread {
    EmuContext context;
    unsigned int index;
    EmuState state;
    // The shuffle this lane waits at: its value (bytes), their size, the xor mask, the width and the
    // lanes named by the mask.
    unsigned long long offer, result;
    int size, lane_mask, width;
    unsigned long long members;
};

struct EmuBlock {
    EmuContext scheduler;
    EmuThread* threads;
    unsigned int n_threads;
    EmuDim3 block_idx, block_dim, grid_dim;
    unsigned int warp;
    void (*call)(const EmuArg*);
    const EmuArg* args;
    char* error;
    size_t error_len;
    bool failed;
};

static thread_local EmuBlock* emu_block;
static thread_local EmuThread* emu_thread;

// Records why the block failed; the first reason stands.
static void emu_fail(const char* format, ...) {
    if (emu_block->failed) return;
    va_list list;
    va_start(list, format);
    vsnprintf(emu_block->error, emu_block->error_len, format, list);
    va_end(list);
    emu_block->failed = true;
}

// A misaligned access: every program is compiled with `-fsanitize=alignment`, whose check calls
// this handler (the layout of its data is the one GCC and Clang share) on a load or store through a
// pointer not aligned to its type, as a 16-byte vector load from an address not a multiple of 16.
// A GPU faults there (and x86 would forgive it, or fault on an aligned SSE load): the launch fails
// naming the thread and the type, and the thread stops before the access.
struct EmuSourceLocation {
    const char* file;
    unsigned int line, column;
};
struct EmuTypeDescriptor {
    unsigned short kind, info;
    char name[1];
};
struct EmuTypeMismatch {
    EmuSourceLocation location;
    const EmuTypeDescriptor* type;
    unsigned char log_alignment;
    unsigned char check_kind;
};
extern "C" void __ubsan_handle_type_mismatch_v1(EmuTypeMismatch* data, unsigned long pointer) {
    if (!emu_block || !emu_thread) return;
    unsigned long alignment = 1ul << data->log_alignment;
    if (pointer % alignment == 0) return;
    emu_fail("block %u, thread %u: misaligned access: %s needs %lu-byte alignment, at address %#lx (line %u of the "
             "program)",
             emu_block->block_idx.x, emu_thread ? emu_thread->index : 0u, data->type ? data->type->name : "a value",
             alignment, pointer, data->location.line);
    // Back to the scheduler, which sees the failure and never resumes this fiber.
    emu_thread->state = EMU_DONE;
    emu_switch(&emu_thread->context, &emu_block->scheduler);
}

// The built-ins. `threadIdx` is the running fiber's; the block's are shared by its fibers.
inline EmuDim3 emu_thread_idx() { return EmuDim3{emu_thread->index, 0, 0}; }
#define threadIdx (emu_thread_idx())
#define blockIdx (emu_block->block_idx)
#define blockDim (emu_block->block_dim)
#define gridDim (emu_block->grid_dim)
#define warpSize ((int)emu_block->warp)

static void emu_wait(EmuState state) {
    emu_thread->state = state;
    emu_switch(&emu_thread->context, &emu_block->scheduler);
}

inline void __syncthreads() { emu_wait(EMU_BARRIER); }

template <class T>
inline T emu_shuffle_xor(unsigned long long members, T value, int lane_mask, int width) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    EmuThread* self = emu_thread;
    self->offer = 0;
    memcpy(&self->offer, &value, sizeof(T));
    self->size = (int)sizeof(T);
    self->lane_mask = lane_mask;
    self->width = width;
    self->members = members;
    emu_wait(EMU_SHUFFLE);
    T result;
    memcpy(&result, &self->result, sizeof(T));
    return result;
}

// CUDA: the lanes named by `mask` take part. HIP: every lane of the wave does.
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = warpSize) {
    return emu_shuffle_xor<T>(mask, value, lane_mask, width);
}
template <class T>
inline T __shfl_xor(T value, int lane_mask, int width = warpSize) {
    unsigned long long all = emu_block->warp >= 64 ? ~0ull : (1ull << emu_block->warp) - 1;
    return emu_shuffle_xor<T>(all, value, lane_mask, width);
}

static void emu_fiber_main() {
    emu_block->call(emu_block->args);
    emu_thread->state = EMU_DONE;
    // Back to the scheduler, which never resumes a returned fiber.
    emu_switch(&emu_thread->context, &emu_block->scheduler);
    abort();
}

// Exchanges the values of a warp whose lanes all wait at a shuffle; false (after `emu_fail`) when
// the shuffle reads a lane that does not take part or exists not.
static bool emu_exchange(unsigned int first, unsigned int lanes, unsigned int warp_index) {
    EmuThread* t = emu_block->threads + first;
    for (unsigned int l = 0; l < lanes; ++l) {
        int width = t[l].width;
        if (width <= 0 || width > (int)emu_block->warp || (width & (width - 1)) != 0) {
            emu_fail("block %u, warp %u, lane %u: shuffle width %d is not a power of two up to the warp size %u",
                     emu_block->block_idx.x, warp_index, l, width, emu_block->warp);
            return false;
        }
        unsigned int source = l ^ (unsigned int)t[l].lane_mask;
        // A lane outside the caller's segment of `width` lanes gives the caller's own value.
        if (source / (unsigned int)width != l / (unsigned int)width) source = l;
        if (source >= lanes || !((t[l].members >> source) & 1ull) || t[source].size != t[l].size) {
            emu_fail("block %u, warp %u, lane %u: shuffle reads lane %u, which %s", emu_block->block_idx.x, warp_index,
                     l, source,
                     source >= lanes                     ? "does not exist"
                     : !((t[l].members >> source) & 1ull) ? "the mask leaves out"
                                                          : "shuffles a value of another size");
            return false;
        }
    }
    for (unsigned int l = 0; l < lanes; ++l) {
        unsigned int source = l ^ (unsigned int)t[l].lane_mask;
        if (source / (unsigned int)t[l].width != l / (unsigned int)t[l].width) source = l;
        t[l].result = t[source].offer;
    }
    for (unsigned int l = 0; l < lanes; ++l) t[l].state = EMU_READY;
    return true;
}

static const char* emu_state_name(EmuState s) {
    switch (s) {
        case EMU_READY: return "running";
        case EMU_BARRIER: return "at __syncthreads";
        case EMU_SHUFFLE: return "at a shuffle";
        default: return "returned";
    }
}

// One round's end: lets waiting warps and the block go on; false when nothing can (the block is
// done, or failed).
static bool emu_release() {
    EmuBlock* b = emu_block;
    unsigned int counts[4] = {0, 0, 0, 0};
    for (unsigned int i = 0; i < b->n_threads; ++i) counts[b->threads[i].state]++;
    if (counts[EMU_DONE] == b->n_threads) return false;
    bool released = false;
    for (unsigned int first = 0; first < b->n_threads; first += b->warp) {
        unsigned int lanes = b->n_threads - first < b->warp ? b->n_threads - first : b->warp;
        unsigned int waiting = 0;
        unsigned long long members = 0;
        for (unsigned int l = 0; l < lanes; ++l) {
            if (b->threads[first + l].state == EMU_SHUFFLE) {
                waiting++;
                members |= b->threads[first + l].members;
            }
        }
        if (waiting == 0) continue;
        // Every lane the waiting lanes name must wait at the shuffle too.
        bool all = true;
        for (unsigned int l = 0; l < lanes; ++l) {
            if (((members >> l) & 1ull) && b->threads[first + l].state != EMU_SHUFFLE) all = false;
        }
        if (!all) continue;
        if (!emu_exchange(first, lanes, first / b->warp)) return false;
        released = true;
    }
    if (released) return true;
    if (counts[EMU_BARRIER] == b->n_threads) {
        for (unsigned int i = 0; i < b->n_threads; ++i) b->threads[i].state = EMU_READY;
        return true;
    }
    // Stuck: describe the first warp that waits, and the thread that keeps it waiting.
    for (unsigned int i = 0; i < b->n_threads; ++i) {
        EmuThread& t = b->threads[i];
        if (t.state == EMU_SHUFFLE) {
            unsigned int first = i - i % b->warp;
            for (unsigned int l = 0; first + l < b->n_threads && l < b->warp; ++l) {
                EmuThread& other = b->threads[first + l];
                if (((t.members >> l) & 1ull) && other.state != EMU_SHUFFLE) {
                    emu_fail("block %u, warp %u: lane %u waits at a shuffle that lane %u never joins (%s); "
                             "%u threads at __syncthreads, %u returned",
                             b->block_idx.x, i / b->warp, i % b->warp, l, emu_state_name(other.state),
                             counts[EMU_BARRIER], counts[EMU_DONE]);
                    return false;
                }
            }
        }
    }
    emu_fail("block %u: __syncthreads not reached by every thread: %u of %u threads wait there, %u returned",
             b->block_idx.x, counts[EMU_BARRIER], b->n_threads, counts[EMU_DONE]);
    return false;
}

// The fibers' stacks, kept per OS thread: `EMU_STACK` bytes each, a guard page below each one.
static const size_t EMU_STACK = 128 * 1024;
struct EmuStacks {
    char* base = nullptr;
    size_t count = 0, stride = 0;
    ~EmuStacks() {
        if (base) munmap(base, count * stride);
    }
    char* get(unsigned int n) {
        if (n > count) {
            if (base) munmap(base, count * stride);
            size_t page = (size_t)sysconf(_SC_PAGESIZE);
            stride = EMU_STACK + page;
            void* m = mmap(nullptr, n * stride, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED) {
                base = nullptr;
                count = 0;
                return nullptr;
            }
            base = (char*)m;
            count = n;
            for (size_t i = 0; i < n; ++i) mprotect(base + i * stride, page, PROT_NONE);
        }
        return base;
    }
};
// What a worker thread of the host keeps from launch to launch, whichever program it runs: the
// fibers' stacks and thread records. The host holds one pointer per worker and passes it to every
// `emu_run`; the first program to run there allocates it. (Kept per program instead, every program
// would map its own stacks in every worker: thousands of mappings with guard pages.) Every program
// of a process is built from this one runtime, so they agree on its layout.
struct EmuWorker {
    EmuStacks stacks;
    EmuThread* threads = nullptr;
    unsigned int threads_count = 0;
};

static bool emu_run_block(EmuBlock* b, EmuStacks& emu_stacks) {
    char* stacks = emu_stacks.get(b->n_threads);
    if (!stacks) {
        emu_fail("cannot map %u fiber stacks", b->n_threads);
        return false;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (unsigned int i = 0; i < b->n_threads; ++i) {
        EmuThread& t = b->threads[i];
        t.index = i;
        t.state = EMU_READY;
        emu_start(&t.context, stacks + i * emu_stacks.stride + page, EMU_STACK, emu_fiber_main);
    }
    for (;;) {
        for (unsigned int i = 0; i < b->n_threads; ++i) {
            if (b->threads[i].state != EMU_READY) continue;
            emu_thread = &b->threads[i];
            emu_switch(&b->scheduler, &b->threads[i].context);
            if (b->failed) return false;
        }
        if (!emu_release()) return !b->failed;
    }
}

// Runs blocks [first_block, end_block) of a grid of `grid` blocks of `block` threads, warps of
// `warp` lanes, on the calling worker, whose state `*worker` holds (allocated here when null). 0 on
// success; else 1 and the message in `error`.
#define EMU_EXPORT __attribute__((visibility("default")))

extern "C" EMU_EXPORT int emu_run(void (*call)(const EmuArg*), const EmuArg* args, unsigned int grid,
                                  unsigned int first_block, unsigned int end_block, unsigned int block,
                                  unsigned int warp, void** worker, char* error, size_t error_len) {
    if (block == 0 || warp == 0 || warp > 64 || (warp & (warp - 1)) != 0) {
        snprintf(error, error_len, "cannot run blocks of %u threads in warps of %u", block, warp);
        return 1;
    }
    if (!*worker) *worker = new EmuWorker();
    EmuWorker* w = (EmuWorker*)*worker;
    if (w->threads_count < block) {
        delete[] w->threads;
        w->threads = new EmuThread[block];
        w->threads_count = block;
    }
    EmuBlock b;
    b.threads = w->threads;
    b.n_threads = block;
    b.block_dim = EmuDim3{block, 1, 1};
    b.grid_dim = EmuDim3{grid, 1, 1};
    b.warp = warp;
    b.call = call;
    b.args = args;
    b.error = error;
    b.error_len = error_len;
    b.failed = false;
    EmuBlock* outer = emu_block;
    emu_block = &b;
    for (unsigned int id = first_block; id < end_block; ++id) {
        b.block_idx = EmuDim3{id, 0, 0};
        if (!emu_run_block(&b, w->stacks)) break;
    }
    emu_block = outer;
    return b.failed ? 1 : 0;
}

// The launcher: the arguments checked against the kernel's prototype, then unpacked into it.
template <class T> constexpr int emu_kind() {
    if constexpr (std::is_pointer_v<T>) return EMU_ARG_PTR;
    else if constexpr (std::is_same_v<T, int>) return EMU_ARG_I32;
    else if constexpr (std::is_same_v<T, long long>) return EMU_ARG_I64;
    else if constexpr (std::is_same_v<T, float>) return EMU_ARG_F32;
    else if constexpr (std::is_same_v<T, double>) return EMU_ARG_F64;
    else if constexpr (std::is_class_v<T> && sizeof(T) == 64) return EMU_ARG_I64X8;
    else return 0;
}

template <class T> constexpr int emu_element_size() {
    if constexpr (std::is_pointer_v<T>) return (int)sizeof(std::remove_pointer_t<T>);
    else return 0;
}

static const char* emu_kind_name(int kind) {
    switch (kind) {
        case EMU_ARG_PTR: return "a buffer";
        case EMU_ARG_I32: return "an int";
        case EMU_ARG_I64: return "a long long";
        case EMU_ARG_F32: return "a float";
        case EMU_ARG_F64: return "a double";
        case EMU_ARG_I64X8: return "eight long longs";
        default: return "an argument of no known kind";
    }
}

template <class T>
bool emu_check_one(const EmuArg& a, int i, char* error, size_t len) {
    static_assert(emu_kind<T>() != 0, "a kernel parameter of a type the emulator cannot pass");
    if (a.kind != emu_kind<T>()) {
        snprintf(error, len, "argument %d: the kernel takes %s, the launch passed %s", i, emu_kind_name(emu_kind<T>()),
                 emu_kind_name(a.kind));
        return false;
    }
    if (a.kind == EMU_ARG_PTR && a.element_size != 0 && a.element_size != emu_element_size<T>()) {
        snprintf(error, len, "argument %d: the kernel reads %d-byte elements, the launch passed a buffer of %d-byte ones",
                 i, emu_element_size<T>(), a.element_size);
        return false;
    }
    return true;
}

template <class... A>
int emu_check(void (*)(A...), const EmuArg* args, int n, char* error, size_t len) {
    if (n != (int)sizeof...(A)) {
        snprintf(error, len, "the kernel takes %d arguments, the launch passed %d", (int)sizeof...(A), n);
        return 1;
    }
    int i = 0;
    bool ok = true;
    ((ok = ok && emu_check_one<A>(args[i], i, error, len), ++i), ...);
    return ok ? 0 : 1;
}

template <class T> T emu_get(const EmuArg& a) {
    T value;
    if constexpr (std::is_pointer_v<T>) {
        void* p;
        memcpy(&p, a.payload, sizeof(p));
        value = (T)p;
    } else {
        memcpy((void*)&value, a.payload, sizeof(T));
    }
    return value;
}

template <class... A, size_t... I>
void emu_invoke_with(void (*kernel)(A...), const EmuArg* args, std::index_sequence<I...>) {
    kernel(emu_get<A>(args[I])...);
}
template <class... A> void emu_invoke(void (*kernel)(A...), const EmuArg* args) {
    emu_invoke_with(kernel, args, std::index_sequence_for<A...>{});
}

#define EMU_KERNEL(name)                                                                      \
    extern "C" EMU_EXPORT int emu_check_##name(const EmuArg* args, int n, char* error, size_t len) {     \
        return emu_check(name, args, n, error, len);                                           \
    }                                                                                         \
    extern "C" EMU_EXPORT void emu_call_##name(const EmuArg* args) { emu_invoke(name, args); }
