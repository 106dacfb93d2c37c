// The CPU op table: the reference backend every other backend is tested
// against (DESIGN "Backends"). GEMMs go to OpenBLAS, the rest are plain loops.
#include "kernels/cpu/cpu.h"
#include "kernels/ops.h"

const moe_ops moe_ops_cpu = {
    .name = "cpu",
    .alloc = moe_cpu_alloc,
    .free = moe_cpu_free,
    .alloc_size = moe_cpu_alloc_size,
    .zero = moe_cpu_zero,
    .matmul = moe_cpu_matmul,
    .swiglu_forward = moe_cpu_swiglu_forward,
    .swiglu_backward = moe_cpu_swiglu_backward,
    .dispatch_rows = moe_cpu_dispatch_rows,
    .permute_forward = moe_cpu_permute_forward,
    .permute_backward = moe_cpu_permute_backward,
    .unpermute_forward = moe_cpu_unpermute_forward,
    .unpermute_backward = moe_cpu_unpermute_backward,
    .gather_rows = moe_cpu_gather_rows,
    .scatter_add_rows = moe_cpu_scatter_add_rows,
    .mul = moe_cpu_mul,
    .mul_add = moe_cpu_mul_add,
};
