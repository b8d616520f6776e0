// The C entry points each kernel module exports to the Python side (cupy_attn/emulator/_module.py);
// emu_kernel_table is generated per module (_build.py: registration).
#pragma once
#include "emu_runtime.h"

extern const emu::KernelInfo emu_kernel_table[];
extern const int emu_kernel_count;

extern "C" __attribute__((visibility("default"))) int emu_kernel_count_get() { return emu_kernel_count; }

extern "C" __attribute__((visibility("default"))) const char* emu_kernel_name(int k) { return emu_kernel_table[k].name; }

// The most parameters emu_kernel_params may report: the size of the arrays it fills.
extern "C" __attribute__((visibility("default"))) int emu_max_kernel_params() { return emu::kMaxKernelParams; }

extern "C" __attribute__((visibility("default"))) int emu_kernel_params(int k, int* sizes, char* kinds, int* pointee_sizes) {
    const emu::KernelInfo& info = emu_kernel_table[k];
    for (int i = 0; i < info.param_count; ++i) {
        sizes[i] = info.params[i].size;
        kinds[i] = info.params[i].kind;
        pointee_sizes[i] = info.params[i].pointee_size;
    }
    return info.param_count;
}

extern "C" __attribute__((visibility("default"))) int emu_launch(int k, const unsigned* grid, const unsigned* block,
                                                                 size_t shared_bytes, void** args, int schedule,
                                                                 unsigned long long seed, int workers,
                                                                 size_t stack_bytes, char* error, size_t error_size,
                                                                 int counting, const unsigned long long* array_bases,
                                                                 const unsigned long long* array_bytes, int array_count,
                                                                 char* counters, size_t counters_size) {
    return emu::launch(emu_kernel_table[k].invoke, grid, block, shared_bytes, args, schedule, seed, workers, stack_bytes,
                       error, error_size, counting, array_bases, array_bytes, array_count, counters, counters_size);
}
