// The CPU op table: the reference backend every other backend is tested
// against (DESIGN "Backends"). GEMMs go to OpenBLAS, the rest are plain loops.
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/nn.h"
#include "kernels/ops.h"

const moe_ops moe_ops_cpu = {
    .name = "cpu",
    .alloc = moe_cpu_alloc,
    .free = moe_cpu_free,
    .alloc_size = moe_cpu_alloc_size,
    .zero = moe_cpu_zero,
    .matmul = moe_cpu_matmul,
    .matmul_grouped = moe_cpu_matmul_grouped,
    .matmul_grouped_wgrad = moe_cpu_matmul_grouped_wgrad,
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
    .add = moe_cpu_add,
    .rmsnorm_forward = moe_cpu_rmsnorm_forward,
    .rmsnorm_backward = moe_cpu_rmsnorm_backward,
    .rope_forward = moe_cpu_rope_forward,
    .rope_backward = moe_cpu_rope_backward,
    .attention_forward = moe_cpu_attention_forward,
    .attention_backward = moe_cpu_attention_backward,
    .attention_state_floats = moe_cpu_attention_state_floats,
    .attention_scratch_floats = moe_cpu_attention_scratch_floats,
    .embedding_forward = moe_cpu_embedding_forward,
    .embedding_backward = moe_cpu_embedding_backward,
    .crossentropy_forward = moe_cpu_crossentropy_forward,
    .crossentropy_backward = moe_cpu_crossentropy_backward,
    .adamw = moe_cpu_adamw,
    .sumsq = moe_cpu_sumsq,
    .scale = moe_cpu_scale,
};
