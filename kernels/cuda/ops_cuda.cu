// The CUDA op tables (kernels/ops.h): moe_ops_cuda is fp32 throughout (what the
// equivalence tests compare with the CPU at 1e-5), moe_ops_cuda_bf16 the same
// ops with bf16 tensor-core GEMMs and fp32 accumulation (1e-2).
#include "kernels/cuda/ops_cuda.h"
#include "kernels/ops.h"

#define MOE_CUDA_TABLE(NAME, MATMUL, GROUPED, WGRAD)                                               \
    {                                                                                              \
        .name = NAME, .alloc = moe_cuda_alloc, .free = moe_cuda_free,                              \
        .alloc_size = moe_cuda_alloc_size, .zero = moe_cuda_zero, .matmul = MATMUL,                \
        .matmul_grouped = GROUPED, .matmul_grouped_wgrad = WGRAD,                                  \
        .swiglu_forward = moe_cuda_swiglu_forward, .swiglu_backward = moe_cuda_swiglu_backward,    \
        .dispatch_rows = moe_cuda_dispatch_rows, .chunk_rows = moe_cuda_chunk_rows,                \
        .permute_forward = moe_cuda_permute_forward,                                               \
        .permute_backward = moe_cuda_permute_backward,                                             \
        .unpermute_forward = moe_cuda_unpermute_forward,                                           \
        .unpermute_backward = moe_cuda_unpermute_backward, .gather_rows = moe_cuda_gather_rows,    \
        .scatter_add_rows = moe_cuda_scatter_add_rows, .mul = moe_cuda_mul,                        \
        .mul_add = moe_cuda_mul_add, .add = moe_cuda_add,                                          \
        .rmsnorm_forward = moe_cuda_rmsnorm_forward,                                               \
        .rmsnorm_backward = moe_cuda_rmsnorm_backward, .rope_forward = moe_cuda_rope_forward,      \
        .rope_backward = moe_cuda_rope_backward, .attention_forward = moe_cuda_attention_forward,  \
        .attention_backward = moe_cuda_attention_backward,                                         \
        .attention_state_floats = moe_cuda_attention_state_floats,                                 \
        .attention_scratch_floats = moe_cuda_attention_scratch_floats,                             \
        .embedding_forward = moe_cuda_embedding_forward,                                           \
        .embedding_backward = moe_cuda_embedding_backward,                                         \
        .crossentropy_forward = moe_cuda_crossentropy_forward,                                     \
        .crossentropy_backward = moe_cuda_crossentropy_backward, .adamw = moe_cuda_adamw,          \
        .sumsq = moe_cuda_sumsq, .scale = moe_cuda_scale,                                          \
    }

extern "C" const moe_ops moe_ops_cuda =
    MOE_CUDA_TABLE("cuda", moe_cuda_matmul, moe_cuda_matmul_grouped, moe_cuda_matmul_grouped_wgrad);
extern "C" const moe_ops moe_ops_cuda_bf16 =
    MOE_CUDA_TABLE("cuda-bf16", moe_cuda_matmul_bf16, moe_cuda_matmul_grouped_bf16,
                   moe_cuda_matmul_grouped_wgrad_bf16);
