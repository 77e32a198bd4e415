/*
 * memguard: the swap-in gate for every driver entry point the shim does not hook.
 *
 * While the agent holds this process swapped out, the driver blocks every CUDA
 * call of it, and only the shim can ask for it back (mg_swap_in). The hooks pass
 * mg_swap_gate before their first driver call; every other entry point goes
 * through a trampoline of this file, whatever its signature:
 *
 *   stub:  r11 = g_gate_flag            (this process's slot's `swapped`, or a zero word)
 *          if (*r11) goto slow
 *          jmp *slot                    (the driver's function)
 *   slow:  r11 = &slot; jmp mg_gate_slow
 *
 * So the fast path is one load of the flag's address, one load of the flag and a
 * jump through the slot: no call frame, no argument touched. mg_gate_slow saves
 * the argument registers (integer and vector, and %al of a variadic call), calls
 * mg_gate_enter (the swap-in gate, then the slot's target, found by name the
 * first time), restores them and jumps to the target, so the driver sees the
 * caller's own arguments and returns straight to it.
 *
 * Two sets of trampolines, each 32 bytes:
 *   - one per name the driver exports (mg_driver_names.h, generated from
 *     NVIDIA's headers), exported weak under that name: a program linked against
 *     libcuda.so.1 binds to it through LD_PRELOAD; where the shim hooks the name,
 *     the hook (a strong definition) is exported instead. Its slot starts at its
 *     own slow path and is bound to the driver's function of that name at its
 *     first call (CUDA_ERROR_NOT_FOUND if the driver lacks it);
 *   - a pool bound at run time to whatever address the driver hands out through
 *     cuGetProcAddress or dlsym for a function the shim does not hook (an internal
 *     entry, a variant no export names, a function newer than the list), one per
 *     address (mg_gate_wrap). A pool spent hands out the driver's own function,
 *     said once in the log.
 *
 * x86-64 only: the driver's checkpoint API, which swap rests on, is x86-64 only
 * (docs/cuda-facts.md 1b), so elsewhere nothing is ever swapped and mg_gate_wrap
 * hands out the driver's function.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

#include "mg_driver_names.h"
#include "mg_internal.h"

/* The flag the trampolines test: this process's slot's, or this zero word. */
static _Atomic uint32_t g_gate_off;
MG_HIDDEN _Atomic uint32_t *_Atomic g_gate_flag = &g_gate_off;

void mg_gate_follow(mg_proc_slot_t *s) {
    atomic_store_explicit(&g_gate_flag, s ? &s->swapped : &g_gate_off, memory_order_release);
}

#if defined(__x86_64__)

#define MG_DYN_STUBS 4096 /* cudart resolves ~800 (name, version, flags) at start-up, fewer addresses */
#define MG_STUB_BYTES 32

/* The stub shape, the slow path, the two sets. */
__asm__(".macro MG_GATE_STUB slot\n"
        "    .balign 32\n"
        "    movq g_gate_flag(%rip), %r11\n"
        "    cmpl $0, (%r11)\n"
        "    jne 1f\n"
        "    jmp *\\slot(%rip)\n"
        "1:  leaq \\slot(%rip), %r11\n"
        "    jmp mg_gate_slow\n" /* 31 bytes in all (jne short): mg_gate_laid_out checks */
        ".endm\n"
        /* A named stub: its slot (first bound to its own slow path) and its export. */
        ".macro MG_GATE_NAMED name\n"
        "    .pushsection .text.mg_gate_named, \"ax\", @progbits\n"
        "    .weak \\name\n"
        "    .type \\name, @function\n"
        "    .balign 32\n"
        "\\name:\n"
        "    MG_GATE_STUB mg_gs_\\name\n"
        "    .size \\name, . - \\name\n"
        "    .popsection\n"
        "    .pushsection .data.rel.mg_gate_named, \"aw\", @progbits\n"
        "    .balign 8\n"
        "mg_gs_\\name: .quad 1b\n"
        "    .popsection\n"
        ".endm\n"
        ".pushsection .text.mg_gate_named, \"ax\", @progbits\n"
        "    .balign 32\n"
        "    .globl mg_gate_named_stubs\n"
        "    .hidden mg_gate_named_stubs\n"
        "mg_gate_named_stubs:\n"
        ".popsection\n"
        ".pushsection .data.rel.mg_gate_named, \"aw\", @progbits\n"
        "    .balign 8\n"
        "    .globl mg_gate_named_slots\n"
        "    .hidden mg_gate_named_slots\n"
        "mg_gate_named_slots:\n"
        ".popsection\n");

#define MG_NAMED_ASM(name) "MG_GATE_NAMED " #name "\n"
__asm__(MG_DRIVER_NAMES(MG_NAMED_ASM));
#undef MG_NAMED_ASM

__asm__(".pushsection .text.mg_gate_named, \"ax\", @progbits\n"
        "    .balign 32\n"
        "    .globl mg_gate_named_end\n"
        "    .hidden mg_gate_named_end\n"
        "mg_gate_named_end:\n"
        ".popsection\n"
        /* The pool: MG_DYN_STUBS stubs over an array of slots, bound before use. */
        ".pushsection .bss.mg_gate_dyn, \"aw\", @nobits\n"
        "    .balign 8\n"
        "    .globl mg_gate_dyn_slots\n"
        "    .hidden mg_gate_dyn_slots\n"
        "mg_gate_dyn_slots: .zero 8 * 4096\n"
        ".popsection\n"
        ".pushsection .text.mg_gate_dyn, \"ax\", @progbits\n"
        "    .balign 32\n"
        "    .globl mg_gate_dyn_stubs\n"
        "    .hidden mg_gate_dyn_stubs\n"
        "mg_gate_dyn_stubs:\n"
        /* %i under .altmacro: each stub gets its own slot's offset as a number. */
        "    .altmacro\n"
        "    .macro MG_GATE_DYN n\n"
        "    MG_GATE_STUB mg_gate_dyn_slots+8*\\n\n"
        "    .endm\n"
        "    .set mg_gate_i, 0\n"
        "    .rept 4096\n"
        "    MG_GATE_DYN %mg_gate_i\n"
        "    .set mg_gate_i, mg_gate_i+1\n"
        "    .endr\n"
        "    .noaltmacro\n"
        "    .balign 32\n"
        "    .globl mg_gate_dyn_end\n"
        "    .hidden mg_gate_dyn_end\n"
        "mg_gate_dyn_end:\n"
        ".popsection\n"
        /* The slow path: r11 = the slot; every argument register kept across the gate. */
        ".pushsection .text.mg_gate_slow, \"ax\", @progbits\n"
        "    .balign 16\n"
        "    .globl mg_gate_slow\n"
        "    .hidden mg_gate_slow\n"
        "    .type mg_gate_slow, @function\n"
        "mg_gate_slow:\n"
        "    .cfi_startproc\n"
        "    pushq %rbp\n"
        "    .cfi_def_cfa_offset 16\n"
        "    .cfi_offset %rbp, -16\n"
        "    movq %rsp, %rbp\n"
        "    .cfi_def_cfa_register %rbp\n"
        "    pushq %rdi\n"
        "    pushq %rsi\n"
        "    pushq %rdx\n"
        "    pushq %rcx\n"
        "    pushq %r8\n"
        "    pushq %r9\n"
        "    pushq %rax\n"
        "    pushq %r11\n"
        "    subq $128, %rsp\n" /* 16-aligned here: the call's return address, %rbp, 8 registers */
        "    movaps %xmm0, 0(%rsp)\n"
        "    movaps %xmm1, 16(%rsp)\n"
        "    movaps %xmm2, 32(%rsp)\n"
        "    movaps %xmm3, 48(%rsp)\n"
        "    movaps %xmm4, 64(%rsp)\n"
        "    movaps %xmm5, 80(%rsp)\n"
        "    movaps %xmm6, 96(%rsp)\n"
        "    movaps %xmm7, 112(%rsp)\n"
        "    movq %r11, %rdi\n"
        "    call mg_gate_enter\n"
        "    movq %rax, %r11\n"
        "    movaps 0(%rsp), %xmm0\n"
        "    movaps 16(%rsp), %xmm1\n"
        "    movaps 32(%rsp), %xmm2\n"
        "    movaps 48(%rsp), %xmm3\n"
        "    movaps 64(%rsp), %xmm4\n"
        "    movaps 80(%rsp), %xmm5\n"
        "    movaps 96(%rsp), %xmm6\n"
        "    movaps 112(%rsp), %xmm7\n"
        "    addq $136, %rsp\n" /* the vectors and the saved slot */
        "    popq %rax\n"
        "    popq %r9\n"
        "    popq %r8\n"
        "    popq %rcx\n"
        "    popq %rdx\n"
        "    popq %rsi\n"
        "    popq %rdi\n"
        "    popq %rbp\n"
        "    .cfi_def_cfa %rsp, 8\n"
        "    jmp *%r11\n"
        "    .cfi_endproc\n"
        "    .size mg_gate_slow, . - mg_gate_slow\n"
        ".popsection\n");

extern MG_HIDDEN char mg_gate_named_stubs[], mg_gate_named_end[], mg_gate_dyn_stubs[], mg_gate_dyn_end[];
extern MG_HIDDEN void *_Atomic mg_gate_named_slots[MG_DRIVER_NAME_COUNT];
extern MG_HIDDEN void *_Atomic mg_gate_dyn_slots[MG_DYN_STUBS];

#define MG_NAME_STR(name) #name,
static const char *const g_names[MG_DRIVER_NAME_COUNT] = {MG_DRIVER_NAMES(MG_NAME_STR)};
#undef MG_NAME_STR

/* What a trampoline of a name the driver lacks answers (every driver function returns a CUresult). */
static CUresult mg_gate_missing(void) { return CUDA_ERROR_NOT_FOUND; }

static int mg_in(const void *p, const char *lo, const char *hi) {
    return (const char *)p >= lo && (const char *)p < hi;
}

/* A named slot still at its stub's slow path: bind it to the driver's function of its name. */
static MG_COLD void *mg_gate_bind(void *_Atomic *slot, void *seen) {
    size_t i = (size_t)(slot - mg_gate_named_slots);
    void *p = i < MG_DRIVER_NAME_COUNT ? mg_driver_fn(LIB_CUDA, g_names[i]) : NULL;
    void *want = (void *)mg_gate_missing;
    if (p && !mg_in(p, mg_gate_named_stubs, mg_gate_dyn_end)) want = p;
    atomic_compare_exchange_strong_explicit(slot, &seen, want, memory_order_acq_rel, memory_order_acquire);
    return atomic_load_explicit(slot, memory_order_acquire);
}

/* Called by mg_gate_slow with the stub's slot: the gate, then where to go. */
MG_HIDDEN void *mg_gate_enter(void *_Atomic *slot);
void *mg_gate_enter(void *_Atomic *slot) {
    mg_swap_gate();
    void *t = atomic_load_explicit(slot, memory_order_acquire);
    if (MG_UNLIKELY(mg_in(t, mg_gate_named_stubs, mg_gate_named_end))) t = mg_gate_bind(slot, t);
    return t;
}

/* The named stub of `name`, or -1 (the list is sorted). */
static int mg_gate_index(const char *name) {
    int lo = 0, hi = MG_DRIVER_NAME_COUNT;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(g_names[mid], name);
        if (c == 0) return mid;
        if (c < 0) lo = mid + 1;
        else hi = mid;
    }
    return -1;
}

static void *mg_gate_named_stub(int i) { return mg_gate_named_stubs + (size_t)i * MG_STUB_BYTES; }

/* Every stub in its 32-byte cell (the assembler sizes the branches): else none is handed out. */
static int mg_gate_laid_out(void) {
    return mg_gate_named_end - mg_gate_named_stubs == (ptrdiff_t)MG_DRIVER_NAME_COUNT * MG_STUB_BYTES &&
           mg_gate_dyn_end - mg_gate_dyn_stubs == (ptrdiff_t)MG_DYN_STUBS * MG_STUB_BYTES;
}

/* Is `p` one of this file's trampolines? */
int mg_gate_is_stub(const void *p) { return mg_in(p, mg_gate_named_stubs, mg_gate_dyn_end); }

static pthread_mutex_t g_dyn_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned g_dyn_n; /* pool stubs bound (under g_dyn_mu) */
static _Atomic int g_warned_pool;

/* A gated trampoline for the driver's function `p`, which a lookup of `name` answered
 * (cuGetProcAddress's symbol, or dlsym's name): the named stub when it is bound (or binds)
 * to `p`, else the pool's stub of `p`. Not the fast path: once per lookup. */
void *mg_gate_wrap(const char *name, void *p) {
    if (!p || mg_gate_is_stub(p) || !mg_gate_laid_out()) return p;
    int i = name ? mg_gate_index(name) : -1;
    if (i >= 0) {
        void *_Atomic *slot = &mg_gate_named_slots[i];
        void *t = atomic_load_explicit(slot, memory_order_acquire);
        if (mg_in(t, mg_gate_named_stubs, mg_gate_named_end)) t = mg_gate_bind(slot, t);
        if (t == p) return mg_gate_named_stub(i);
    }
    pthread_mutex_lock(&g_dyn_mu);
    void *out = NULL;
    for (unsigned k = 0; k < g_dyn_n && !out; k++)
        if (atomic_load_explicit(&mg_gate_dyn_slots[k], memory_order_relaxed) == p)
            out = mg_gate_dyn_stubs + (size_t)k * MG_STUB_BYTES;
    if (!out && g_dyn_n < MG_DYN_STUBS) {
        atomic_store_explicit(&mg_gate_dyn_slots[g_dyn_n], p, memory_order_release);
        out = mg_gate_dyn_stubs + (size_t)g_dyn_n++ * MG_STUB_BYTES;
    }
    pthread_mutex_unlock(&g_dyn_mu);
    if (!out) {
        MG_WARN_ONCE(g_warned_pool, "more than %d driver functions looked up: %s and later ones are not gated "
                                    "(a swapped-out process calling them first waits in the driver)",
                     MG_DYN_STUBS, name ? name : "?");
        return p;
    }
    return out;
}

/* A forked child has its own mutex (a parent's thread may have held it at the fork). */
void mg_gate_atfork_child(void) {
    pthread_mutex_init(&g_dyn_mu, NULL);
    mg_gate_follow(NULL);
}

#else /* not x86-64: no swap there (see the top), nothing to gate */

void *mg_gate_wrap(const char *name, void *p) {
    (void)name;
    return p;
}
int mg_gate_is_stub(const void *p) {
    (void)p;
    return 0;
}
void mg_gate_atfork_child(void) { mg_gate_follow(NULL); }

#endif
