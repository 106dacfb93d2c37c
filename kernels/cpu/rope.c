// Rotary position embedding (RoFormer, arXiv 2104.09864), Hugging Face
// rotate-half layout: (x_i, x_{i+hd/2}) is rotated by pos * theta^(-2i/hd).
// The backward is the rotation by the opposite angle.
#include "kernels/cpu/nn.h"
#include "moe/error.h"

#include <math.h>

// positions: pos_of[row], or row % T when pos_of is NULL (training layout,
// where the B rows of position t share its angles, computed once).
static int rope(float *out, const float *x, int B, int T, const int *pos_of, int H, int hd,
                float theta, float sign, int accumulate) {
    if (hd % 2) return moe_fail(MOE_EINVAL, "rope: head_dim %d is odd", hd);
    const int half = hd / 2, rows = pos_of ? B * T : T, reps = pos_of ? 1 : B;
    double inv_freq[half > 0 ? half : 1];
    for (int i = 0; i < half; i++)
        inv_freq[i] = pow(theta, -2.0 * i / hd);
    float c[half > 0 ? half : 1], sn[half > 0 ? half : 1];
    for (int r = 0; r < rows; r++) {
        const int pos = pos_of ? pos_of[r] : r;
        for (int i = 0; i < half; i++) {
            double ang = pos * inv_freq[i];
            c[i] = (float)cos(ang), sn[i] = sign * (float)sin(ang);
        }
        // a head's halves are contiguous: the inner loop runs over i (vectorised)
        for (int b = 0; b < reps; b++) {
            const size_t bt = pos_of ? (size_t)r : (size_t)b * T + r;
            for (int h = 0; h < H; h++) {
                const float *xa = x + (bt * H + h) * hd, *xb = xa + half;
                float *oa = out + (bt * H + h) * hd, *ob = oa + half;
                if (accumulate) {
                    for (int i = 0; i < half; i++) {
                        float a = xa[i], bb = xb[i];
                        float ra = a * c[i] - bb * sn[i], rb = bb * c[i] + a * sn[i];
                        oa[i] += ra;
                        ob[i] += rb;
                    }
                } else {
                    for (int i = 0; i < half; i++) {
                        float a = xa[i], bb = xb[i];
                        float ra = a * c[i] - bb * sn[i], rb = bb * c[i] + a * sn[i];
                        oa[i] = ra;
                        ob[i] = rb;
                    }
                }
            }
        }
    }
    return 0;
}

int moe_cpu_rope_forward(float *out, const float *x, int B, int T, int H, int hd, float theta) {
    return rope(out, x, B, T, NULL, H, hd, theta, 1.0f, 0);
}

int moe_cpu_rope_at(float *out, const float *x, const int *pos, int N, int H, int hd, float theta) {
    return rope(out, x, 1, N, pos, H, hd, theta, 1.0f, 0);
}

int moe_cpu_rope_backward(float *dx, const float *dout, int B, int T, int H, int hd, float theta) {
    return rope(dx, dout, B, T, NULL, H, hd, theta, -1.0f, 1);
}
