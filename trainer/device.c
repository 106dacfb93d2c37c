// train.device: which backend runs the model. cpu is the reference backend;
// cuda needs a build with the CUDA backend (MOE_HAVE_CUDA) and a visible GPU,
// and is refused with the reason otherwise, before any work starts.
// (What a GPU run supports is checked by moe_model_gpu_init.)
#include "moe/error.h"
#include "moe/train.h"

#include <string.h>

#ifdef MOE_HAVE_CUDA
#include "kernels/cuda/cuda.h"
#endif

int moe_device_check(const char *device) {
    if (!strcmp(device, "cpu")) return 0;
    if (strcmp(device, "cuda"))
        return moe_fail(MOE_EINVAL, "train.device = '%s': expected cpu or cuda", device);
#ifndef MOE_HAVE_CUDA
    return moe_fail(MOE_EINVAL,
                    "train.device = cuda: this moe was built without CUDA "
                    "(configure with -DMOE_CUDA=ON on a machine with the CUDA toolkit)");
#else
    char why[256] = "";
    if (moe_cuda_device_count(why, sizeof why) == 0)
        return moe_fail(MOE_EDEVICE, "train.device = cuda: no CUDA device (%s)", why);
    return 0;
#endif
}
