/*
 * memguard: copies, memsets, stream and event queries and waits: entry points
 * that count nothing and need the swap-in gate alone (mg_swap_gate). A process
 * swapped out whose next call is one of these (a tensor copied to the host, a
 * stream polled) would otherwise block in the driver with nobody to ask for its
 * memory back. Sync and async, _v2, and the per-thread default stream twins
 * (_ptds / _ptsz) the driver hands out through cuGetProcAddress; the list and
 * the hooks' prototypes are MG_GATES in mg_symbols.h.
 */
#include "mg_internal.h"

#define MG_GATE_HOOK(X, sym, base, ver, ptds, params, args) \
    HOOK CUresult mg_h_##sym params {                        \
        mg_swap_gate();                                      \
        __typeof__(&mg_h_##sym) f_ = REAL(sym);              \
        return f_ ? f_ args : CUDA_ERROR_NOT_FOUND;          \
    }
MG_GATES(MG_GATE_HOOK, _)
#undef MG_GATE_HOOK

MG_SYMBOLS_COPY(MG_XALIAS)
