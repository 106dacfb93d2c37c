// Error codes and the thread-local last-error message of the moe library.
// Library functions return 0 or a negative MOE_E* code and leave a one-line
// message naming the thing at fault; only the CLI turns that into an exit.
#ifndef MOE_ERROR_H
#define MOE_ERROR_H

#ifdef __cplusplus // included by the CUDA sources (nvcc compiles .cu as C++)
extern "C" {
#endif

enum {
    MOE_OK = 0,
    MOE_EINVAL = -1,   // bad argument, shape or config value
    MOE_EIO = -2,      // open/read/write/rename failed
    MOE_EFORMAT = -3,  // file contents malformed, truncated or lying about sizes
    MOE_ENOMEM = -4,   // allocation failed
    MOE_ENUMERIC = -5, // NaN or Inf where finite numbers are required
    MOE_ENOTFOUND = -6, // a named tensor, key or file is missing
    MOE_EDEVICE = -7    // a CUDA, cuBLAS or NCCL call failed, or no usable device
};

// Records a printf-style message for the calling thread and returns code.
// moe_last_error() may be one of the arguments (to prefix context).
int moe_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// The last message recorded on this thread ("" if none).
const char *moe_last_error(void);
// Short name of a code ("invalid argument", ...).
const char *moe_strerror(int code);

// Propagates a failing call upward; in debug logs it adds where it passed.
int moe_trace(int code, const char *file, int line);
#define MOE_TRY(x)                                                                                 \
    do {                                                                                           \
        int moe_rc_ = (x);                                                                         \
        if (moe_rc_ < 0) return moe_trace(moe_rc_, __FILE__, __LINE__);                            \
    } while (0)
// For functions with a cleanup label: sets rc and jumps to `fail`.
#define MOE_TRY_GOTO(x, rc)                                                                        \
    do {                                                                                           \
        (rc) = (x);                                                                                \
        if ((rc) < 0) {                                                                            \
            moe_trace((rc), __FILE__, __LINE__);                                                   \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif
