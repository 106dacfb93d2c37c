// Shared helpers for the Check suites: seeded random fills, guarded buffers
// (catch out-of-bounds writes), temp directories, and a suite runner; and
// the CHECK of the mpi_* programs.
#ifndef MOE_TESTUTIL_H
#define MOE_TESTUTIL_H

#include "moe/config.h"

#include <check.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// Deterministic xorshift generator for test data.
typedef struct {
    uint64_t s;
} tu_rng;
void tu_seed(tu_rng *r, uint64_t seed);
float tu_uniform(tu_rng *r); // [0, 1)
float tu_normal(tu_rng *r);  // N(0, 1)
void tu_fill_normal(tu_rng *r, float *x, size_t n, float scale);

// n floats between two guard regions filled with a sentinel pattern.
float *tu_guarded_alloc(size_t n);
int tu_guards_intact(const float *p, size_t n); // 1 if neither guard changed
void tu_guarded_free(float *p, size_t n);

// mkdtemp under $TMPDIR (or /tmp); returns a static path buffer.
const char *tu_tmpdir(void);
// A checked fixture, tcase_add_checked_fixture(tc, tu_dir_setup,
// tu_dir_teardown): each test gets a fresh temp folder tu_dir, removed after
// it (the tests may create plain files there, not folders).
extern char tu_dir[512];
void tu_dir_setup(void);
void tu_dir_teardown(void);
// "tu_dir/name" in one of 8 static buffers used in turn (8 paths live at once).
const char *tu_in_dir(const char *name);
// How many entries dir holds besides . and ..; -1 when it cannot be opened.
int tu_count_entries(const char *dir);
// dir/a/b (dir/a when b is ""), in one of 4 rotating static buffers.
const char *tu_path(const char *dir, const char *a, const char *b);
// Writes text to the file dir/name (the test fails if it cannot).
void tu_write_text(const char *dir, const char *name, const char *text);
// moe_train of c into out (resume: NULL or a run to resume), quietly; losses
// (NULL: none) gets each step's loss; stop_after 0: every step. Asserts success
// and returns the number of checkpoints written.
long tu_train(const moe_config *c, const char *out, const char *resume, double *losses,
              int stop_after);

// A 2-layer d=32 model with 4 experts, batch 4 x 32 tokens, 60 steps at lr
// 1e-2 (5 warmup), no evaluation: trains in a fraction of a second.
moe_config tu_small_config(void);
// tu_small_config on 2 x 16 tokens: the model the checkpoint tests save.
moe_config tu_ckpt_config(void);
// Saves a freshly initialised model of c (2 x 16 tokens, 5 tasks) with its
// zero optimizer state to the checkpoint folder dir.
void tu_save_checkpoint(const moe_config *c, const char *dir);

// After a test edits files of checkpoint dir on purpose (to reach a check
// behind the manifest's): rewrites dir/manifest.json with the sizes the files
// it lists have now, dropping the ones that are gone.
void tu_refresh_manifest(const char *dir);

// Runs the moe binary ($MOE_BIN, set by ctest) with args (a shell word list),
// stdout to dir/out.txt and stderr to dir/err.txt; returns its exit status.
int tu_run_moe(const char *dir, const char *args);
// The same with dir as the working directory and args formatted printf-style.
int tu_run_moe_in(const char *dir, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// The text of dir/name (up to 64 KiB; "" when missing), in a static buffer.
const char *tu_file_text(const char *dir, const char *name);

// Runs one suite with CK_NORMAL output, returns the process exit status.
// 0 when the safetensors sets in folders a and b (one file or an indexed set
// of shards) hold the same tensors with the same bytes; else 1 and why says
// which (for MPI tests, whose ranks report through TU_MPI_CHECK).
int tu_st_dirs_differ(const char *a, const char *b, char *why, size_t cap);
// Asserts that files a and b hold the same bytes.
void tu_assert_same_file(const char *a, const char *b);
// Asserts that checkpoint folders a and b hold the same training state:
// model and optimizer bit for bit, trainer_state.json equal but for the
// wall-clock train_seconds (which must be > 0 in b).
void tu_assert_same_checkpoint(const char *a, const char *b);

int tu_run(Suite *s);
// The main of a GPU suite: 77 (ctest: skipped) with the reason printed when
// this build has no CUDA or the machine no device; else tu_run(s) in this
// process (the CUDA context is not fork-safe), then the CUDA context freed.
int tu_run_gpu(Suite *s, const char *what);

// CHECK for the mpi_* programs, which do without Check so that every rank
// reaches MPI_Finalize: counts the check in tu_checks and, when cond is false,
// counts a failure in tu_failures and prints the rank, the place and the
// message (printf-style arguments), then carries on.
extern int tu_checks, tu_failures;
#define TU_MPI_CHECK(rank, cond, ...)                                                              \
    do {                                                                                           \
        tu_checks++;                                                                               \
        if (!(cond)) {                                                                             \
            tu_failures++;                                                                         \
            fprintf(stderr, "rank %d: %s:%d: ", rank, __FILE__, __LINE__);                         \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

#endif
