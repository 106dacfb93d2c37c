// Sharded checkpoints under real MPI processes (moe/checkpoint.h): each EP
// rank writes its own experts' shard, rank 0 the dense tensors, the indices
// and the manifest. Modes:
//   (none)      mpirun -np 4: the layout of an ep=4 save, and that saving
//               allocates nothing that grows with the model (no gather)
//   ref DIR     mpirun -np 4: the reference saves DIR/ref2 (step 2) and
//               DIR/ref4 (step 4), and the counted fs calls of ranks 0 and 2
//               (DIR/ops: one save, then the whole run) for the kill test
//   kill DIR N  mpirun -np 4 with MOE_FAULT=N:abort:R: the run DIR/kill
//               (saves at steps 2 and 4) dies when rank R aborts
//   check DIR   one process: the checkpoint DIR/kill resolves to is complete
//               and bitwise the step-2 or the step-4 save
// ref and kill take a last argument "async": the periodic saves are then
// asynchronous (train.async_checkpoint), so the kill lands in a save thread.
// tests/mpi_ckpt_kill.cmake drives ref, kill and check.
#include "moe/alloc.h"
#include "moe/checkpoint.h"
#include "moe/comm.h"
#include "moe/error.h"
#include "moe/fsio.h"
#include "moe/infer.h"
#include "moe/parallel.h"
#include "moe/safetensors.h"
#include "moe/train.h"
#include "mpi_testutil.h"
#include "testutil.h"

#include <jansson.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum { W = 4, E = 8 };
static int rank;
static bool async_saves; // train.async_checkpoint in every run

#define CHECK(cond, ...) TU_MPI_CHECK(rank, cond, __VA_ARGS__)

static moe_config base(void) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32",   "model.n_layers=2",   "model.d_ff=48",
                          "model.seq_len=16",   "moe.num_experts=8",  "train.batch_size=2",
                          "train.eval_every=0", "train.ckpt_every=2", "parallel.ep=4",
                          "comm.timeout_s=30"};
    for (size_t i = 0; i < sizeof sets / sizeof sets[0]; i++)
        moe_config_set(&c, NULL, sets[i]);
    c.train.steps = 4;
    c.train.async_checkpoint = async_saves;
    return c;
}

static int train(moe_comm *world, const char *out, long stop_after) {
    moe_train_opts o = {.out_dir = out, .stop_after = stop_after, .world = world};
    return mpi_train_with(rank, base(), o, NULL, out);
}

// Steps 1-4 with saves at 2 and 4 kept as checkpoint-2 and checkpoint-4, from
// resume (a checkpoint) when not NULL.
static void train_kept(moe_comm *world, const char *out, const char *resume, bool async) {
    moe_config c = base();
    c.train.keep_checkpoints = 2;
    c.train.async_checkpoint = async;
    mpi_train_with(rank, c, (moe_train_opts){.out_dir = out, .resume_dir = resume, .world = world},
                   NULL, out);
}

// 1 when files a and b hold the same bytes.
static int same_bytes(const char *a, const char *b) {
    FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
    int same = fa && fb;
    for (int ca = 0, cb = 0; same && ca != EOF;) {
        ca = fgetc(fa), cb = fgetc(fb);
        same = ca == cb;
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    return same;
}

// Checkpoint folders a and b hold the same shards, indices and task experts
// byte for byte, and the same trainer state but for the wall-clock seconds
// (config.json differs by train.async_checkpoint itself).
static void check_same_sharded(const char *a, const char *b) {
    char pa[1200], pb[1200], name[64];
    for (int k = 1; k <= W; k++)
        for (int i = 0; i < 2; i++) {
            snprintf(name, sizeof name, "%s-%05d-of-%05d.safetensors", i ? "optimizer" : "model", k,
                     W);
            snprintf(pa, sizeof pa, "%s/%s", a, name);
            snprintf(pb, sizeof pb, "%s/%s", b, name);
            CHECK(same_bytes(pa, pb), "%s and %s differ", pa, pb);
        }
    static const char *const names[] = {"model.safetensors.index.json",
                                        "optimizer.safetensors.index.json", "task_experts.json"};
    for (int i = 0; i < 3; i++) {
        snprintf(pa, sizeof pa, "%s/%s", a, names[i]);
        snprintf(pb, sizeof pb, "%s/%s", b, names[i]);
        CHECK(same_bytes(pa, pb), "%s and %s differ", pa, pb);
    }
    snprintf(pa, sizeof pa, "%s/trainer_state.json", a);
    snprintf(pb, sizeof pb, "%s/trainer_state.json", b);
    json_t *ja = json_load_file(pa, 0, NULL), *jb = json_load_file(pb, 0, NULL);
    CHECK(ja && jb, "cannot read %s or %s", pa, pb);
    if (ja && jb) {
        for (int i = 0; i < 2; i++) { // timings: the MFU sum is one too
            const char *k = i ? "mfu_sum" : "train_seconds";
            json_object_del(ja, k);
            json_object_del(jb, k);
        }
        CHECK(json_equal(ja, jb), "%s and %s differ", pa, pb);
    }
    json_decref(ja);
    json_decref(jb);
}

// Async saves on 4 ranks (each EP rank's thread writes its shards) hold the
// bytes of synchronous ones, and training resumed from one (checkpoint-2)
// ends with the bytes of the straight run's checkpoint-4.
static void test_async_sharded_saves_equal_sync_and_resume(moe_comm *world, const char *dir) {
    char s[800], a[800], r[800], ck[900], cs[900], cr[900];
    snprintf(s, sizeof s, "%s/sync", dir);
    snprintf(a, sizeof a, "%s/async", dir);
    snprintf(r, sizeof r, "%s/resumed", dir);
    train_kept(world, s, NULL, false);
    train_kept(world, a, NULL, true);
    snprintf(ck, sizeof ck, "%s/checkpoint-2", a);
    train_kept(world, r, ck, true);
    if (rank != 0) return;
    for (int step = 2; step <= 4; step += 2) {
        snprintf(ck, sizeof ck, "%s/checkpoint-%d", a, step);
        snprintf(cs, sizeof cs, "%s/checkpoint-%d", s, step);
        CHECK(moe_ckpt_complete(ck), "%s is not complete", ck);
        check_same_sharded(cs, ck);
    }
    snprintf(ck, sizeof ck, "%s/checkpoint-4", a);
    snprintf(cr, sizeof cr, "%s/checkpoint-4", r);
    check_same_sharded(ck, cr);
}

static int exists(const char *dir, const char *name);

// A task-routed load of a sharded checkpoint the trainer wrote (ep = 4, layer
// 1 routed by task) reads fewer bytes than the full load: exactly the bytes of
// the task layer's experts it skips, (E - top_k) x 3 tensors of H x D floats.
static void test_task_load_reads_less_of_a_sharded_checkpoint(moe_comm *world, const char *dir) {
    moe_config c = base();
    moe_config_set(&c, NULL, "moe.task_layers=[1]");
    char out[800], ck[900];
    snprintf(out, sizeof out, "%s/task", dir);
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    if (mpi_train(rank, world, c, out, NULL, NULL) || rank != 0) return;
    CHECK(exists(ck, "model.safetensors.index.json"), "%s is not sharded", ck);
    moe_infer part, full;
    moe_infer_opts po = {.task = c.data.tasks[0]},
                   fo = {.task = c.data.tasks[0], .full_load = true};
    CHECK(moe_infer_open(&part, ck, &po) == 0, "partial load: %s", moe_last_error());
    CHECK(moe_infer_open(&full, ck, &fo) == 0, "full load: %s", moe_last_error());
    const uint64_t skipped =
        (uint64_t)(E - c.router.top_k) * 3 * c.model.d_ff * c.model.d_model * sizeof(float);
    CHECK(full.stats.bytes_read == full.stats.ckpt_bytes, "the full load read %llu of %llu bytes",
          (unsigned long long)full.stats.bytes_read, (unsigned long long)full.stats.ckpt_bytes);
    CHECK(part.stats.bytes_read + skipped == full.stats.bytes_read,
          "the task load read %llu bytes, the full load %llu: expected %llu fewer",
          (unsigned long long)part.stats.bytes_read, (unsigned long long)full.stats.bytes_read,
          (unsigned long long)skipped);
    CHECK(part.stats.loaded[1] == c.router.top_k, "layer 1: %d experts loaded",
          part.stats.loaded[1]);
    moe_infer_free(&part);
    moe_infer_free(&full);
}

static int exists(const char *dir, const char *name) {
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

// An ep=4 save: four model and four optimizer shards, both indices, no single
// file; shard k holds exactly rank k-1's experts (and shard 1 the dense
// tensors), and the index maps each tensor to the shard holding it.
static void test_sharded_save_writes_every_shard_and_index(moe_comm *world, const char *dir) {
    char out[800], ck[900];
    snprintf(out, sizeof out, "%s/layout", dir);
    snprintf(ck, sizeof ck, "%s/checkpoint", out);
    train(world, out, 0);
    if (rank != 0) return;
    CHECK(!exists(ck, "model.safetensors") && !exists(ck, "optimizer.safetensors"),
          "a sharded save also wrote the single files");
    CHECK(exists(ck, "model.safetensors.index.json") &&
              exists(ck, "optimizer.safetensors.index.json"),
          "an index is missing");
    CHECK(moe_ckpt_complete(ck), "%s: the manifest does not list every file", ck);
    for (int k = 1; k <= W; k++) {
        char name[64], p[1000];
        for (int b = 0; b < 2; b++) {
            snprintf(name, sizeof name, "%s-%05d-of-%05d.safetensors", b ? "optimizer" : "model", k,
                     W);
            CHECK(exists(ck, name), "%s missing", name);
        }
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", k, W);
        snprintf(p, sizeof p, "%s/%s", ck, name);
        moe_st_file *f;
        if (moe_st_open(p, &f) != 0) {
            CHECK(0, "%s", moe_last_error());
            continue;
        }
        int experts = 0, dense = 0;
        for (int i = 0; i < f->n_tensors; i++) {
            const char *x = strstr(f->tensors[i].name, ".experts.");
            if (!x) {
                dense++;
                continue;
            }
            int e = atoi(x + strlen(".experts."));
            CHECK(e / (E / W) == k - 1, "%s holds expert %d of rank %d", name, e, e / (E / W));
            experts++;
        }
        CHECK(experts == 2 * (E / W) * 3, "%s: %d expert tensors, expected %d", name, experts,
              2 * (E / W) * 3);
        CHECK(k == 1 ? dense > 0 : dense == 0, "%s: %d dense tensors", name, dense);
        moe_st_close(f);
    }
    // The index agrees with the shards (the set reader checks every mapping).
    moe_st_set *s;
    CHECK(moe_st_set_open(ck, &s) == 0, "%s", moe_last_error());
    if (s) CHECK(s->n_files == W, "the model set opened %d shards", s->n_files);
    moe_st_set_close(s);
    CHECK(moe_st_set_open_index(ck, "optimizer.safetensors.index.json", &s) == 0, "%s",
          moe_last_error());
    if (s) CHECK(s->n_files == W, "the optimizer set opened %d shards", s->n_files);
    moe_st_set_close(s);
}

// A rank's tracked memory does not grow while it saves: the shards are written
// from the model's own buffers, with no copy of any expert (the old save
// allgathered every expert and both moments: 3 x E x 3HD floats per layer).
static void test_save_holds_no_other_ranks_experts(moe_comm *world, const char *dir) {
    moe_config c = base();
    moe_parallel par;
    moe_model m;
    moe_adamw opt;
    memset(&m, 0, sizeof m);
    memset(&opt, 0, sizeof opt);
    int rc = moe_parallel_init(&par, world, &c);
    if (rc == 0) rc = moe_model_init_ep(&m, &c, 2, 16, 0, &par.group);
    if (rc == 0) rc = moe_adamw_init(&opt, &m.table, c.train.decay_all);
    CHECK(rc == 0, "setup: %s", moe_last_error());
    if (rc) return;
    char ck[900];
    snprintf(ck, sizeof ck, "%s/nogather/checkpoint", dir);
    if (rank == 0) {
        char p[1000];
        snprintf(p, sizeof p, "%s/nogather", dir);
        mkdir(p, 0755);
    }
    moe_comm_barrier(world);
    moe_train_state st = {0};
    size_t before = moe_mem_in_use();
    moe_mem_reset_peak();
    rc = moe_ckpt_save(ck, &m, &opt, &st, &par);
    CHECK(rc == 0, "save: %s", moe_last_error());
    size_t extra = moe_mem_peak() - before;
    CHECK(extra == 0, "saving allocated %zu tracked bytes", extra);
    moe_model_free(&m);
    moe_adamw_free(&opt);
    moe_parallel_free(&par);
}

// --- the kill test ---------------------------------------------------------------

static void ref_mode(moe_comm *world, const char *dir) {
    char out[800];
    long ops[2];
    moe_fs_fault_arm(0, MOE_FAULT_OFF); // counts from here
    snprintf(out, sizeof out, "%s/ref2", dir);
    train(world, out, 2);
    ops[0] = moe_fs_op_count();
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    snprintf(out, sizeof out, "%s/ref4", dir);
    train(world, out, 0);
    ops[1] = moe_fs_op_count();
    long all[2 * W];
    MPI_Gather(ops, 2, MPI_LONG, all, 2, MPI_LONG, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        // "R0_ONE;R0_RUN;R2_ONE;R2_RUN": the calls of one save, and of the run
        snprintf(out, sizeof out, "%s/ops", dir);
        FILE *f = fopen(out, "w");
        if (f) fprintf(f, "%ld;%ld;%ld;%ld", all[0], all[1], all[4], all[5]);
        CHECK(f && fclose(f) == 0, "%s: cannot write", out);
    }
}

// Every tensor of set a equals the same-named tensor of set b, bit for bit.
static int same_set(moe_st_set *a, moe_st_set *b) {
    size_t na = 0, nb = 0;
    for (int k = 0; k < a->n_files; k++)
        na += (size_t)a->files[k]->n_tensors;
    for (int k = 0; k < b->n_files; k++)
        nb += (size_t)b->files[k]->n_tensors;
    int same = na == nb;
    for (int k = 0; same && k < a->n_files; k++)
        for (int i = 0; same && i < a->files[k]->n_tensors; i++) {
            moe_st_file *fb = NULL;
            const moe_st_tensor *ta = &a->files[k]->tensors[i],
                                *tb = moe_st_set_find(b, ta->name, &fb);
            same = tb && tb->nbytes == ta->nbytes;
            if (!same) break;
            char *x = malloc(ta->nbytes), *y = malloc(tb->nbytes);
            same = moe_st_read(a->files[k], ta, x, ta->nbytes) == 0 &&
                   moe_st_read(fb, tb, y, tb->nbytes) == 0 && !memcmp(x, y, ta->nbytes);
            free(x);
            free(y);
        }
    return same;
}

static int open_sets(const char *ck, moe_st_set **model, moe_st_set **optim) {
    char rdir[1200];
    *model = *optim = NULL;
    MOE_TRY(moe_ckpt_resolve(ck, rdir, sizeof rdir, NULL));
    MOE_TRY(moe_st_set_open(ck, model));
    return moe_st_set_open_index(rdir, "optimizer.safetensors.index.json", optim);
}

static void check_mode(const char *dir) {
    char ck[900], ref[900];
    snprintf(ck, sizeof ck, "%s/kill/checkpoint", dir);
    char rdir[1200];
    CHECK(moe_ckpt_resolve(ck, rdir, sizeof rdir, NULL) == 0, "no checkpoint resolves: %s",
          moe_last_error());
    CHECK(moe_ckpt_complete(rdir), "%s: resolved, but its manifest is missing or wrong", rdir);
    moe_st_set *m, *o;
    CHECK(open_sets(ck, &m, &o) == 0, "%s", moe_last_error());
    int match = 0;
    for (int step = 2; m && o && step <= 4; step += 2) {
        moe_st_set *rm, *ro;
        snprintf(ref, sizeof ref, "%s/ref%d/checkpoint", dir, step);
        CHECK(open_sets(ref, &rm, &ro) == 0, "%s", moe_last_error());
        if (rm && ro && same_set(m, rm) && same_set(o, ro)) match = step;
        moe_st_set_close(rm);
        moe_st_set_close(ro);
    }
    CHECK(match, "%s: matches neither completed save", rdir);
    printf("mpi_ckpt_shard check: %s holds the step-%d save bit for bit\n", rdir, match);
    moe_st_set_close(m);
    moe_st_set_close(o);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *mode = argc > 1 ? argv[1] : "";
    if (argc == 4 && !strcmp(argv[3], "async")) async_saves = true, argc = 3;
    if (!strcmp(mode, "check") && argc == 3) {
        check_mode(argv[2]);
    } else if (size != W) {
        if (rank == 0) fprintf(stderr, "mpi_ckpt_shard: run with mpirun -np %d\n", W);
        MPI_Finalize();
        return 2;
    } else {
        moe_comm *world;
        if (moe_comm_mpi_world(&world, 0)) {
            fprintf(stderr, "world: %s\n", moe_last_error());
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        if (!strcmp(mode, "ref") && argc == 3) {
            ref_mode(world, argv[2]);
        } else if (!strcmp(mode, "kill") && argc == 3) {
            char out[800];
            snprintf(out, sizeof out, "%s/kill", argv[2]);
            train(world, out, 0); // the armed rank aborts inside a save
        } else {
            char dir[512] = "";
            if (rank == 0) snprintf(dir, sizeof dir, "%s", tu_tmpdir());
            MPI_Bcast(dir, sizeof dir, MPI_CHAR, 0, MPI_COMM_WORLD);
            test_sharded_save_writes_every_shard_and_index(world, dir);
            test_save_holds_no_other_ranks_experts(world, dir);
            test_async_sharded_saves_equal_sync_and_resume(world, dir);
            test_task_load_reads_less_of_a_sharded_checkpoint(world, dir);
        }
        moe_comm_free(world);
    }
    int total[2] = {tu_failures, tu_checks};
    MPI_Allreduce(MPI_IN_PLACE, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0)
        printf("mpi_ckpt_shard %s: %d passed, %d failed\n", mode, total[1] - total[0], total[0]);
    MPI_Finalize();
    return total[0] ? 1 : 0;
}
