// Fibers: one per CUDA thread, switched cooperatively on one OS thread per block.
// On x86-64 a hand-written switch saves only the callee-saved registers and the FP control
// words (~20x faster than swapcontext, which makes a signal-mask system call on every switch);
// other CPUs, and AddressSanitizer builds (whose runtime intercepts swapcontext), use ucontext.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <vector>

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define EMU_ASM_SWITCH 1
extern "C" __attribute__((visibility("hidden"))) void emu_switch_stack(void** save_sp, void* new_sp);
asm(R"(
    .text
    .p2align 4
    .hidden emu_switch_stack
    .type emu_switch_stack, @function
emu_switch_stack:
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
    .size emu_switch_stack, .-emu_switch_stack
)");
#else
#include <ucontext.h>
#endif

namespace emu {

struct Context {
#ifdef EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t uc;
#endif
};

// A stack with a PROT_NONE guard page below it, so an overflow faults instead of corrupting.
struct Stack {
    char* base = nullptr;  // start of the mapping (the guard page)
    size_t size = 0;       // usable bytes above the guard
};

inline size_t page_size() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

inline Stack make_stack(size_t bytes) {
    size_t page = page_size();
    bytes = (bytes + page - 1) / page * page;
    void* p = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) std::abort();
    mprotect(p, page, PROT_NONE);
    return Stack{static_cast<char*>(p), bytes};
}

inline void free_stack(Stack& s) {
    if (s.base) munmap(s.base, s.size + page_size());
    s.base = nullptr;
}

// Prepare `ctx` to start `entry` (which must never return) on `stack`.
inline void make_context(Context& ctx, Stack& stack, void (*entry)()) {
#ifdef EMU_ASM_SWITCH
    char* top = stack.base + page_size() + stack.size;  // page aligned, so 16-byte aligned
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                                   // fake return address of `entry`
    *--sp = reinterpret_cast<void*>(entry);            // popped by `ret`; entry sees rsp = 8 mod 16
    for (int i = 0; i < 6; ++i) *--sp = nullptr;       // rbp rbx r12 r13 r14 r15
    *--sp = nullptr;
    unsigned int* control = reinterpret_cast<unsigned int*>(sp);
    control[0] = 0x1f80u;                              // default MXCSR
    control[1] = 0x037fu;                              // default x87 control word
    ctx.sp = sp;
#else
    getcontext(&ctx.uc);
    ctx.uc.uc_stack.ss_sp = stack.base + page_size();
    ctx.uc.uc_stack.ss_size = stack.size;
    ctx.uc.uc_link = nullptr;
    makecontext(&ctx.uc, entry, 0);
#endif
}

inline void switch_context(Context& from, Context& to) {
#ifdef EMU_ASM_SWITCH
    emu_switch_stack(&from.sp, to.sp);
#else
    swapcontext(&from.uc, &to.uc);
#endif
}

}  // namespace emu
