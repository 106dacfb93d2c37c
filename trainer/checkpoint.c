// Checkpoint folders: the crash-safe save protocol written down in
// moe/checkpoint.h (DIR.tmp written and marked complete by its manifest, then
// swapped in by renames; folders are renamed to DIR.trash before removal), and
// loading through the one resolver, with every tensor and every
// trainer_state.json field validated.
#include "moe/checkpoint.h"
#include "checkpoint_internal.h"
#include "moe/alloc.h"
#include "moe/error.h"
#include "moe/file.h"
#include "moe/fsio.h"
#include "moe/json_error.h"
#include "moe/log.h"
#include "moe/safetensors.h"
#include "moe/task_experts.h"
#include "moe/tokenizer.h"

#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

// Written into DIR.tmp in this order; manifest.json (their sizes) comes last.
static const char *const files[] = {"model.safetensors", "optimizer.safetensors", "config.json",
                                    "task_experts.json", "trainer_state.json"};
#define N_FILES 5

// out[PATH_MAX] = dir + suffix; MOE_EINVAL if it does not fit.
static int join(char *out, const char *dir, const char *suffix) {
    if (snprintf(out, PATH_MAX, "%s%s", dir, suffix) >= PATH_MAX)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    return 0;
}

// The longest path a save of dir writes: the temp name of the sharded
// layout's longest file in dir.tmp (dir.trash holds no temp names). It fits:
// all fit.
#define CKPT_LONGEST_FILE ".tmp/optimizer-00000-of-00000.safetensors.index.json.tmp.XXXXXX"

int moe_ckpt_path_check(const char *dir) {
    if (strlen(dir) + strlen(CKPT_LONGEST_FILE) < PATH_MAX) return 0;
    return moe_fail(MOE_EINVAL,
                    "%s: path too long for a checkpoint: a save writes paths up to %zu "
                    "characters longer inside it, and a path holds at most %d",
                    dir, strlen(CKPT_LONGEST_FILE), PATH_MAX - 1);
}

// The tensor file of shard k (0-based) of n: BASE.safetensors when n = 1
// (one process, or no expert parallelism: the single-file layout), else
// BASE-0000{k+1}-of-0000{n}.safetensors (the Hugging Face shard names).
static void shard_file(char out[64], const char *base, int k, int n) {
    if (n == 1)
        snprintf(out, 64, "%s.safetensors", base);
    else
        snprintf(out, 64, "%s-%05d-of-%05d.safetensors", base, k + 1, n);
}

static int join_shard(char *out, const char *dir, const char *base, int k, int n) {
    char f[64];
    shard_file(f, base, k, n);
    if (snprintf(out, PATH_MAX, "%s/%s", dir, f) >= PATH_MAX)
        return moe_fail(MOE_EINVAL, "%s: path too long", dir);
    return 0;
}

static int exists(const char *p) {
    struct stat st;
    return lstat(p, &st) == 0;
}

#define JSON_FLAGS (JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(17))

// Writes a JSON document (plus a newline) to path, fsynced.
static int write_json(const char *path, json_t *doc) {
    return moe_fs_write_json(path, doc, JSON_FLAGS);
}

// A small file of rank 0, rendered on the calling thread and written with the
// shards (by the save thread of an asynchronous save). bytes == NULL with
// len == 0: task_experts.json, written from the job's moe_task_experts.
typedef struct {
    char name[64];
    char *bytes;
    size_t len;
} blob;

// The bytes write_json would write (the document plus a newline); takes doc.
static int render_json(blob *b, const char *name, json_t *doc) {
    snprintf(b->name, sizeof b->name, "%s", name);
    char *text = doc ? json_dumps(doc, JSON_FLAGS) : NULL;
    json_decref(doc);
    size_t n = text ? strlen(text) : 0;
    char *line = text ? realloc(text, n + 2) : NULL;
    if (!line) {
        free(text);
        return moe_fail(MOE_ENOMEM, "checkpoint: %s: out of memory", name);
    }
    line[n] = '\n';
    b->bytes = line;
    b->len = n + 1;
    return 0;
}

static int render_config(blob *b, const moe_config *cfg) {
    char *buf = NULL;
    size_t n = 0;
    snprintf(b->name, sizeof b->name, "config.json");
    FILE *f = open_memstream(&buf, &n);
    if (!f) return moe_fail(MOE_ENOMEM, "checkpoint: config.json: out of memory");
    int rc = moe_config_write(cfg, f);
    if (fclose(f) != 0 && rc == 0)
        rc = moe_fail(MOE_ENOMEM, "checkpoint: config.json: out of memory");
    if (rc < 0) {
        free(buf);
        return rc;
    }
    b->bytes = buf;
    b->len = n;
    return 0;
}

static int render_state(blob *b, const moe_model *m, const moe_adamw *opt,
                        const moe_train_state *st, const moe_parallel *par) {
    json_t *doc = json_object(), *caps = json_array();
    json_object_set_new(doc, "step", json_integer(st->step));
    json_object_set_new(doc, "adam_step", json_integer(opt->step));
    json_t *cur = json_array();
    json_array_append_new(cur, json_integer((json_int_t)st->cursor[0]));
    json_array_append_new(cur, json_integer((json_int_t)st->cursor[1]));
    json_object_set_new(doc, "data_cursor", cur);
    json_object_set_new(doc, "tokens", json_real(st->tokens)); // whole-run summary figures
    json_object_set_new(doc, "train_seconds", json_real(st->seconds));
    json_object_set_new(doc, "drop_rate_sum", json_real(st->drop_sum));
    json_object_set_new(doc, "max_vio_sum", json_real(st->vio_sum));
    json_object_set_new(doc, "mfu_sum", json_real(st->mfu_sum));
    json_object_set_new(doc, "summed_steps", json_integer(st->summed));
    json_object_set_new(doc, "mfu_steps", json_integer(st->mfu_steps));
    for (int l = 0; l < m->L; l++) {
        const moe_capacity_ctl *c = &m->cap[l];
        if (!c->capacity) continue;
        json_t *o = json_object(), *ema = json_array(), *cap = json_array();
        for (int e = 0; e < c->E; e++) {
            json_array_append_new(ema, json_real(c->ema[e]));
            json_array_append_new(cap, json_integer(c->capacity[e]));
        }
        json_object_set_new(o, "layer", json_integer(l));
        json_object_set_new(o, "steps", json_integer(c->steps));
        json_object_set_new(o, "seeded", json_boolean(c->seeded));
        json_object_set_new(o, "ema", ema);
        json_object_set_new(o, "capacity", cap);
        json_array_append_new(caps, o);
    }
    json_object_set_new(doc, "capacity", caps);
    json_t *place; // placement.mode = replicate: its load EMA and tables
    int rc = moe_parallel_placement_state(par, m, &place);
    if (rc < 0) {
        json_decref(doc);
        return rc;
    }
    if (place) json_object_set_new(doc, "placement", place);
    return render_json(b, "trainer_state.json", doc);
}

// One file's tensors, in model order: this rank's tensors of buf, each
// view's name + suffix. dense: the tensors every rank holds (rank 0 writes
// them); experts: this rank's own experts (global names, as the views have).
typedef struct {
    moe_st_entry *e;
    char (*names)[MOE_PARAM_NAME_MAX + 16];
    int n;
} entry_list;

static int is_expert(const char *name) {
    return strstr(name, ".experts.") != NULL;
}

// buf: float [n], or with bf16 the moments' uint16_t [n], written as F32.
static int build_entries(entry_list *out, const moe_model *m, const void *buf, bool bf16,
                         const char *suffix, bool dense, bool experts) {
    int n_max = m->table.count + m->L; // + the selection biases (add_bias_entries)
    out->e = calloc((size_t)n_max, sizeof *out->e);
    out->names = calloc((size_t)n_max, sizeof *out->names);
    out->n = 0;
    if (!out->e || !out->names) return moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        if (is_expert(v->name) ? !experts : !dense) continue;
        moe_st_entry *e = &out->e[out->n];
        snprintf(out->names[out->n], sizeof out->names[0], "%s%s", v->name, suffix);
        const void *data = bf16 ? (const void *)((const uint16_t *)buf + v->offset)
                                : (const void *)((const float *)buf + v->offset);
        *e = (moe_st_entry){out->names[out->n++], MOE_ST_F32, v->ndim, {0}, data};
        memcpy(e->shape, v->shape, sizeof(int64_t) * v->ndim);
    }
    return 0;
}

// The MoE layers' selection biases (moe/checkpoint.h), replicated on every
// rank; bias[l]: layer l's E values (the model's, or their snapshot).
static void add_bias_entries(entry_list *out, const moe_model *m, float *const *bias) {
    for (int l = 0; l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        snprintf(out->names[out->n], sizeof out->names[0], MOE_CKPT_BIAS_FMT, l);
        out->e[out->n] =
            (moe_st_entry){out->names[out->n], MOE_ST_F32, 1, {m->moe_cfg[l].E}, bias[l]};
        out->n++;
    }
}

static void free_entries(entry_list *l) {
    free(l->e);
    free(l->names);
    *l = (entry_list){0};
}

// What one save writes from: the model's and the optimizer's own buffers (a
// synchronous save: nothing is copied, so a rank holds no one else's experts
// while saving), or their snapshot (an asynchronous one), laid out alike.
typedef struct {
    float *params;
    void *m, *v; // float [n], or uint16_t [n] with bf16 (train.optimizer_state)
    bool bf16;
    float *bias[MOE_MAX_LAYERS];
} save_src;

// One save of one rank, prepared on the calling thread so that writing it
// (job_write) reads nothing the training loop changes: the tensor entries
// point into a save_src, rank 0's small files are rendered bytes. Pure file
// I/O from then on, so a background thread can do it (no MPI calls).
typedef struct {
    char dir[PATH_MAX], tmp[PATH_MAX], old[PATH_MAX], trash[PATH_MAX];
    char model_path[PATH_MAX], optim_path[PATH_MAX];
    bool rank0, writer, sharded, tok;
    int n; // shards
    long step;
    entry_list model, mom[2];
    moe_st_entry *optim; // both moments in one file, tensor by tensor
    int n_optim;
    bool optim_bf16; // the moments' data is bf16 (train.optimizer_state), written as F32
    moe_task_experts te;
    blob small[8]; // rank 0: indices, tokenizer, config, task experts, trainer state
    int n_small;
    int rc; // job_write's result, its message in msg
    char msg[512];
} save_job;

static void job_free(save_job *j) {
    free_entries(&j->model);
    free_entries(&j->mom[0]);
    free_entries(&j->mom[1]);
    free(j->optim);
    j->optim = NULL;
    for (int i = 0; i < j->n_small; i++)
        free(j->small[i].bytes);
    j->n_small = 0;
    moe_task_experts_free(&j->te);
    memset(&j->te, 0, sizeof j->te);
}

// The tensor files of this rank: shard k of n (n = 1: the single files).
static int build_tensor_entries(save_job *j, const moe_model *m, const save_src *src, int k) {
    bool dense = k == 0;
    MOE_TRY(build_entries(&j->model, m, src->params, false, "", dense, true));
    if (dense && m->bias_on) add_bias_entries(&j->model, m, src->bias);
    MOE_TRY(join_shard(j->model_path, j->tmp, "model", k, j->n));
    // Both moments in one file, tensor by tensor: ranks load them by name.
    MOE_TRY(build_entries(&j->mom[0], m, src->m, src->bf16, ".exp_avg", dense, true));
    MOE_TRY(build_entries(&j->mom[1], m, src->v, src->bf16, ".exp_avg_sq", dense, true));
    j->n_optim = j->mom[0].n + j->mom[1].n;
    j->optim_bf16 = src->bf16;
    if (!(j->optim = malloc(sizeof *j->optim * (size_t)(j->n_optim + 1))))
        return moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    memcpy(j->optim, j->mom[0].e, sizeof *j->optim * j->mom[0].n);
    memcpy(j->optim + j->mom[0].n, j->mom[1].e, sizeof *j->optim * j->mom[1].n);
    return join_shard(j->optim_path, j->tmp, "optimizer", k, j->n);
}

// BASE.safetensors.index.json of a sharded save, in the Hugging Face layout
// ({"metadata": {"total_size"}, "weight_map": {tensor: shard}}). Rank 0 knows
// every name without asking: expert x of a layer lives on its home EP rank
// (x / (E/n) unless placement.mode = move moved it),
// the rest in shard 0. suffixes: the names' endings, one pass each.
static int render_index(blob *out, const char *base, const moe_model *m, const moe_parallel *par,
                        int n, const char *const *suffixes, int n_suffixes) {
    char name[MOE_PARAM_NAME_MAX + 96], shard[64];
    json_t *doc = json_object(), *meta = json_object(), *map = json_object();
    json_int_t total = 0;
    for (int s = 0; s < n_suffixes; s++) {
        int last = -1;
        for (int i = 0; i < m->table.count; i++) {
            const moe_param_view *v = &m->table.views[i];
            if (!is_expert(v->name)) {
                snprintf(name, sizeof name, "%s%s", v->name, suffixes[s]);
                snprintf(shard, sizeof shard, "%s-%05d-of-%05d.safetensors", base, 1, n);
                json_object_set_new(map, name, json_string(shard));
                total += (json_int_t)v->numel * 4;
                continue;
            }
            int l = atoi(v->name + strlen("model.layers."));
            if (l == last) continue; // the layer's every expert went in with the first
            last = l;
            const moe_layer_config *c = &m->moe_cfg[l];
            static const char *const w[3] = {"w1", "w3", "w2"};
            for (int x = 0; x < c->E; x++)
                for (int j = 0; j < 3; j++) {
                    snprintf(name, sizeof name,
                             "model.layers.%d.block_sparse_moe.experts.%d.%s.weight%s", l, x, w[j],
                             suffixes[s]);
                    snprintf(shard, sizeof shard, "%s-%05d-of-%05d.safetensors", base,
                             moe_parallel_expert_home(par, m, l, x) + 1, n); // moved homes
                    json_object_set_new(map, name, json_string(shard));
                    total += (json_int_t)c->H * c->D * 4;
                }
        }
    }
    for (int l = 0; !strcmp(base, "model") && m->bias_on && l < m->L; l++) {
        if (!m->is_moe[l]) continue;
        snprintf(name, sizeof name, MOE_CKPT_BIAS_FMT, l);
        snprintf(shard, sizeof shard, "%s-%05d-of-%05d.safetensors", base, 1, n);
        json_object_set_new(map, name, json_string(shard));
        total += (json_int_t)m->moe_cfg[l].E * 4;
    }
    json_object_set_new(meta, "total_size", json_integer(total));
    json_object_set_new(doc, "metadata", meta);
    json_object_set_new(doc, "weight_map", map);
    snprintf(name, sizeof name, "%s.safetensors.index.json", base);
    return render_json(out, name, doc);
}

// manifest.json: each file of the folder and its size. Written last and
// fsynced, it tells a reader that the folder is complete (moe_ckpt_complete);
// with shards it lists every shard, so a folder missing one is never complete.
static int write_manifest(const char *tmp, long step, const char *const *names, int n) {
    char p[PATH_MAX];
    json_t *doc = json_object(), *sizes = json_object();
    int rc = 0;
    json_object_set_new(doc, "format", json_string("moe-checkpoint"));
    json_object_set_new(doc, "version", json_integer(1));
    json_object_set_new(doc, "step", json_integer(step));
    json_object_set_new(doc, "files", sizes);
    for (int i = 0; i < n && rc == 0; i++) {
        struct stat st;
        if (snprintf(p, sizeof p, "%s/%s", tmp, names[i]) >= (int)sizeof p)
            rc = moe_fail(MOE_EINVAL, "%s: path too long", tmp);
        if (rc == 0 && stat(p, &st) != 0)
            rc = moe_fail(MOE_EIO, "%s: missing after writing: %s", p, strerror(errno));
        if (rc == 0) json_object_set_new(sizes, names[i], json_integer((json_int_t)st.st_size));
    }
    if (rc == 0) rc = join(p, tmp, "/manifest.json");
    if (rc == 0) rc = write_json(p, doc);
    json_decref(doc);
    return rc;
}

static int sync_parent(const char *dir) {
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (slash == parent)
        slash[1] = 0; // "/x": the parent is "/"
    else if (slash)
        *slash = 0;
    if (moe_fs_fsync_dir(slash ? parent : ".") != 0)
        return moe_fail(MOE_EIO, "%s: fsync failed: %s", slash ? parent : ".", strerror(errno));
    return 0;
}

static int move(const char *from, const char *to) {
    if (moe_fs_rename(from, to) != 0)
        return moe_fail(MOE_EIO, "%s: cannot rename to %s: %s", from, to, strerror(errno));
    return 0;
}

// Removes folder p the crash-safe way: renamed to trash (atomic, so no reader
// ever sees it half removed), then emptied by listing and removed.
static int discard(const char *p, const char *trash) {
    MOE_TRY(moe_fs_remove_tree(trash)); // left by an earlier failure: rename needs it gone
    MOE_TRY(move(p, trash));
    return moe_fs_remove_tree(trash);
}

// Step 1 of the protocol: after it, only dir exists (or nothing at all).
static int recover(const char *dir, const char *tmp, const char *old, const char *trash) {
    MOE_TRY(moe_fs_remove_tree(trash));
    if (exists(tmp)) {
        if (!exists(dir) && moe_ckpt_complete(tmp)) {
            MOE_TRY(move(tmp, dir));
            MOE_TRY(sync_parent(dir));
        } else {
            MOE_TRY(discard(tmp, trash));
        }
    }
    if (exists(old)) {
        if (!exists(dir))
            MOE_TRY(move(old, dir));
        else
            MOE_TRY(discard(old, trash));
        MOE_TRY(sync_parent(dir));
    }
    return 0;
}

// Rank 0's small files, in the order they are written: the indices (sharded),
// the tokenizer's copy before config.json (which names it), the task experts
// and the trainer state.
static int render_small(save_job *j, const moe_model *m, const moe_adamw *opt,
                        const moe_train_state *st, const moe_tokenizer *tok,
                        const moe_parallel *par) {
    if (j->sharded) {
        static const char *const msuf[] = {""}, *const osuf[] = {".exp_avg", ".exp_avg_sq"};
        MOE_TRY(render_index(&j->small[j->n_small++], "model", m, par, j->n, msuf, 1));
        MOE_TRY(render_index(&j->small[j->n_small++], "optimizer", m, par, j->n, osuf, 2));
    }
    moe_config cfg = m->cfg;
    size_t tok_len = 0;
    const void *tok_bytes = tok ? moe_tok_model_bytes(tok, &tok_len) : NULL;
    if (tok_bytes) {
        blob *b = &j->small[j->n_small++];
        snprintf(b->name, sizeof b->name, "%s", MOE_CKPT_TOKENIZER);
        if (!(b->bytes = malloc(tok_len ? tok_len : 1)))
            return moe_fail(MOE_ENOMEM, "checkpoint: %s: out of memory", MOE_CKPT_TOKENIZER);
        memcpy(b->bytes, tok_bytes, tok_len);
        b->len = tok_len;
        j->tok = true;
        snprintf(cfg.model.tokenizer, sizeof cfg.model.tokenizer, "%s", MOE_CKPT_TOKENIZER);
    }
    MOE_TRY(render_config(&j->small[j->n_small++], &cfg));
    MOE_TRY(moe_task_experts_from_model(&j->te, m));
    snprintf(j->small[j->n_small++].name, sizeof j->small[0].name, "task_experts.json");
    return render_state(&j->small[j->n_small++], m, opt, st, par);
}

// Steps 1 and the preparation of 2: rank 0 recovers and makes DIR.tmp, then
// each rank prepares what it writes from src. Sharded, every rank must know
// DIR.tmp exists before it writes: agree makes this collective (a synchronous
// save); without it the caller agrees before any write (the asynchronous
// one: a collective fewer on the step that triggers it). The status is this
// rank's (job_commit agrees).
static int job_start(save_job *j, const char *dir, const moe_model *m, const moe_adamw *opt,
                     const moe_train_state *st, moe_parallel *par, const save_src *src,
                     bool agree) {
    MOE_TRY(moe_ckpt_path_check(dir));
    MOE_TRY(join(j->dir, dir, ""));
    MOE_TRY(join(j->tmp, dir, ".tmp"));
    MOE_TRY(join(j->old, dir, ".old"));
    MOE_TRY(join(j->trash, dir, ".trash"));
    if (par && par->ep_size > 99999)
        return moe_fail(MOE_EINVAL, "checkpoint: %d shards: at most 99999", par->ep_size);
    j->sharded = par && par->ep_size > 1;
    j->n = j->sharded ? par->ep_size : 1;
    j->rank0 = !par || par->rank == 0;
    j->writer = moe_ckpt_writes_tensors(par ? par->rank : 0, par ? par->ep_size : 1);
    j->step = st->step;
    int rc = 0;
    // The run's tokenizer, read when it started (m->tokenizer); else read
    // here, before recover() may move the folder it lives in.
    moe_tokenizer *tok = NULL;
    if (j->rank0 && !m->tokenizer && strcmp(m->cfg.model.tokenizer, "bytes"))
        rc = moe_tok_open(m->cfg.model.tokenizer, &tok);
    if (j->rank0 && rc == 0) {
        rc = recover(j->dir, j->tmp, j->old, j->trash);
        if (rc == 0 && moe_fs_mkdir(j->tmp, 0755) != 0)
            rc = moe_fail(MOE_EIO, "%s: cannot create: %s", j->tmp, strerror(errno));
    }
    // Sharded: every writer needs dir.tmp made before it writes into it.
    if (j->sharded && agree) rc = moe_comm_agree(par->world, rc);
    if (rc == 0 && j->writer) rc = build_tensor_entries(j, m, src, j->sharded ? par->ep_rank : 0);
    if (rc == 0 && j->rank0)
        rc = render_small(j, m, opt, st, m->tokenizer ? m->tokenizer : tok, par);
    moe_tok_free(tok);
    return rc;
}

// Step 2's writes of this rank, each file fsynced: its tensor files, then
// (rank 0) the small ones. Pure file I/O (no MPI, nothing the training loop
// touches): the save thread of an asynchronous save runs it. The status and
// its message (naming the file) are kept in the job.
static int job_write(save_job *j) {
    static const char *const meta[] = {"format", "pt", "producer", "moe", NULL};
    char p[PATH_MAX];
    int rc = 0;
    if (j->writer) {
        rc = moe_st_write(j->model_path, j->model.e, j->model.n, meta);
        if (rc == 0)
            rc = j->optim_bf16 ? moe_st_write_from_bf16(j->optim_path, j->optim, j->n_optim, NULL)
                               : moe_st_write(j->optim_path, j->optim, j->n_optim, NULL);
    }
    for (int i = 0; rc == 0 && i < j->n_small; i++) {
        const blob *b = &j->small[i];
        if (snprintf(p, sizeof p, "%s/%s", j->tmp, b->name) >= (int)sizeof p)
            rc = moe_fail(MOE_EINVAL, "%s: path too long", j->tmp);
        else if (b->bytes)
            rc = moe_fs_write_file(p, b->bytes, b->len);
        else
            rc = moe_task_experts_write(p, &j->te);
    }
    j->rc = rc;
    snprintf(j->msg, sizeof j->msg, "%s", rc < 0 ? moe_last_error() : "");
    return rc;
}

// The manifest (every shard, index and file with its size), then DIR.tmp
// fsynced: rank 0, once every rank's files are durable.
static int job_manifest(const save_job *j) {
    const int n = j->n;
    char(*names)[64] = malloc(sizeof *names * (2 * (size_t)n + 6));
    const char **list = malloc(sizeof *list * (2 * (size_t)n + 6));
    int n_names = 0;
    if (!names || !list) {
        free(names), free(list);
        return moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    }
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < n; i++)
            shard_file(names[n_names++], b ? "optimizer" : "model", i, n);
    if (j->sharded) {
        snprintf(names[n_names++], sizeof names[0], "model.safetensors.index.json");
        snprintf(names[n_names++], sizeof names[0], "optimizer.safetensors.index.json");
    }
    for (int i = 2; i < N_FILES; i++)
        snprintf(names[n_names++], sizeof names[0], "%s", files[i]);
    if (j->tok) snprintf(names[n_names++], sizeof names[0], "%s", MOE_CKPT_TOKENIZER);
    for (int i = 0; i < n_names; i++)
        list[i] = names[i];
    int rc = write_manifest(j->tmp, j->step, list, n_names);
    free(names);
    free(list);
    MOE_TRY(rc);
    if (moe_fs_fsync_dir(j->tmp) != 0)
        return moe_fail(MOE_EIO, "%s: fsync failed: %s", j->tmp, strerror(errno));
    return 0;
}

// The rest of step 2 and steps 3-4, collective: every rank's status is
// agreed (every shard durable, or the first failure everywhere), rank 0
// writes the manifest, the result is agreed again, and rank 0 swaps. later
// NULL: the previous checkpoint is removed now; else it is only renamed to
// DIR.trash (which no reader resolves) and left in later for the caller.
static int job_commit(const save_job *j, moe_parallel *par, int rc, moe_ckpt_trash *later) {
    if (par) rc = moe_comm_agree(par->world, rc);
    if (rc == 0 && j->rank0) rc = job_manifest(j);
    if (par) rc = moe_comm_agree(par->world, rc);
    if (!j->rank0) return rc;
    const char *dir = j->dir, *tmp = j->tmp, *old = j->old, *trash = j->trash;
    if (rc < 0) goto fail;
    // The swap. Between the renames only the complete dir.tmp holds the newest
    // checkpoint; moe_ckpt_resolve reads it there.
    if (exists(dir)) {
        MOE_TRY_GOTO(move(dir, old), rc);
        if ((rc = sync_parent(dir)) < 0) return rc; // dir.tmp is complete: keep it
    }
    if ((rc = move(tmp, dir)) < 0) return rc; // likewise: the next save promotes it
    if ((rc = sync_parent(dir)) < 0) return rc;
    // Cleaning: the new checkpoint is in place whatever happens here.
    if (exists(old) && later) {
        // The rename is atomic and fsynced; the slow part (unlinking the
        // files) is the caller's, off the training thread.
        if (moe_fs_remove_tree(trash) < 0 || move(old, trash) < 0 || sync_parent(dir) < 0 ||
            (moe_ckpt_trash_add(later, trash) < 0 && moe_fs_remove_tree(trash) < 0))
            moe_log(MOE_LOG_WARN, "checkpoint saved, but removing the previous one failed: %s",
                    moe_last_error());
    } else if (exists(old) && (discard(old, trash) < 0 || sync_parent(dir) < 0))
        moe_log(MOE_LOG_WARN, "checkpoint saved, but removing the previous one failed: %s",
                moe_last_error());
    return 0;
fail:
    // dir.tmp never became complete or is not needed (dir still exists):
    // the message of the first failure is kept.
    {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", moe_last_error());
        if (exists(tmp) && (exists(dir) || !moe_ckpt_complete(tmp))) discard(tmp, trash);
        moe_fail(rc, "%s", msg);
    }
    return rc;
}

int moe_ckpt_writes_tensors(int rank, int ep) {
    return ep > 1 ? rank < ep : rank == 0; // the first EP group (dp_rank 0), else rank 0
}

static save_src model_src(const moe_model *m, const moe_adamw *opt) {
    save_src s = {m->params,
                  moe_adamw_moment(opt, 0),
                  moe_adamw_moment(opt, 1),
                  opt->state == MOE_ADAMW_BF16,
                  {0}};
    for (int l = 0; l < m->L; l++)
        s.bias[l] = m->is_moe[l] ? moe_model_bias(m, l) : NULL;
    return s;
}

int moe_ckpt_save(const char *dir, const moe_model *m, const moe_adamw *opt,
                  const moe_train_state *st, moe_parallel *par) {
    save_job *j = calloc(1, sizeof *j); // every rank: a failure here is agreed below
    save_src src = model_src(m, opt);
    int rc = j ? job_start(j, dir, m, opt, st, par, &src, true)
               : moe_fail(MOE_ENOMEM, "checkpoint: out of memory");
    if (rc == 0) rc = job_write(j);
    if (j) {
        rc = job_commit(j, par, rc, NULL);
        job_free(j);
        free(j);
    } else if (par) {
        rc = moe_comm_agree(par->world, rc);
        rc = moe_comm_agree(par->world, rc);
    }
    return rc;
}

// --- the asynchronous save (train.async_checkpoint) ------------------------------

struct moe_ckpt_async {
    // params, m, v of this rank (n floats, then the moments as stored: 2 n
    // floats, or 2 n bf16 with train.optimizer_state = bf16), tracked: moe plan
    unsigned char *snap;
    size_t mom_size;             // bytes per moment element in the snapshot
    float *bias[MOE_MAX_LAYERS]; // the selection biases' copies (E floats each, untracked)
    size_t n;
    save_job *job; // the save in flight (prepared by begin, written by the thread)
    bool pending, thread_live;
    pthread_t thread;
    atomic_int done; // the thread finished job_write
    // The thread's first task is copying the live buffers into the snapshot;
    // `copied` (under mu, signalled on cv) says it is done, so the training
    // thread may change them again (moe_ckpt_async_wait_snapshot).
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool copied, sync_ok, awaited; // awaited: this save's copy was waited for once
    const void *live[3];           // the model's params, m, v the copy reads
    double copy_s;                 // the copy's seconds (debug log)
    int rank;
    char run[PATH_MAX];
    int keep;
    // The previous checkpoint(s) a commit renamed to trash, removed by the
    // cleaner thread while training goes on; joined before the next save.
    moe_ckpt_trash trash;
    pthread_t cleaner;
    bool cleaner_live;
    int clean_rc;
    char clean_msg[512];
};

int moe_ckpt_async_init(moe_ckpt_async **out, const moe_model *m, const moe_parallel *par) {
    *out = NULL;
    moe_ckpt_async *a = calloc(1, sizeof *a);
    if (!a || !(a->job = calloc(1, sizeof *a->job))) {
        free(a);
        return moe_fail(MOE_ENOMEM, "checkpoint: out of memory for the asynchronous save");
    }
    a->n = moe_model_numel(m);
    a->mom_size = strcmp(m->cfg.train.optimizer_state, "bf16") ? sizeof(float) : sizeof(uint16_t);
    const size_t bytes = a->n * (sizeof(float) + 2 * a->mom_size);
    a->copied = a->awaited = true;
    if (pthread_mutex_init(&a->mu, NULL) != 0) {
        free(a->job), free(a);
        return moe_fail(MOE_ENOMEM, "checkpoint: cannot make the asynchronous save's mutex");
    }
    if (pthread_cond_init(&a->cv, NULL) != 0) {
        pthread_mutex_destroy(&a->mu);
        free(a->job), free(a);
        return moe_fail(MOE_ENOMEM, "checkpoint: cannot make the asynchronous save's condition");
    }
    a->sync_ok = true;
    if (moe_ckpt_writes_tensors(par ? par->rank : 0, par ? par->ep_size : 1)) {
        int rc = (a->snap = moe_malloc(bytes)) ? 0 : MOE_ENOMEM;
        // Touched now, so the first save's copy does not also pay the page faults.
        if (rc == 0) memset(a->snap, 0, bytes);
        for (int l = 0; rc == 0 && l < m->L; l++)
            if (m->is_moe[l] && !(a->bias[l] = malloc(sizeof(float) * m->moe_cfg[l].E)))
                rc = MOE_ENOMEM;
        if (rc < 0) {
            moe_ckpt_async_free(a);
            return moe_fail(MOE_ENOMEM,
                            "checkpoint: out of memory for the asynchronous save's snapshot "
                            "(%zu bytes; train.async_checkpoint = false needs none)",
                            bytes);
        }
    }
    *out = a;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// Copies into the snapshot the tensors this rank writes, and only them (the
// entries already point into the snapshot, laid out as the model's buffers).
static void copy_written(moe_ckpt_async *a, const entry_list *l) {
    const size_t es[3] = {sizeof(float), a->mom_size, a->mom_size};
    const unsigned char *start[3] = {a->snap, a->snap + sizeof(float) * a->n,
                                     a->snap + (sizeof(float) + a->mom_size) * a->n};
    for (int i = 0; i < l->n; i++) {
        const unsigned char *d = l->e[i].data;
        int w = 2;
        while (w >= 0 && (!d || d < start[w]))
            w--;
        if (w < 0 || d >= start[w] + es[w] * a->n) continue; // a bias: copied at begin
        size_t numel = 1;
        for (int k = 0; k < l->e[i].ndim; k++)
            numel *= (size_t)l->e[i].shape[k];
        memcpy((void *)d, (const unsigned char *)a->live[w] + (size_t)(d - start[w]),
               es[w] * numel);
    }
}

// The copy first (the training thread's forward and backward of the next step
// only read the parameters meanwhile; it waits for `copied` before the update
// changes them), then the writes.
static void *save_thread(void *arg) {
    moe_ckpt_async *a = arg;
    const double t0 = now_s();
    if (a->snap && a->job->writer) {
        copy_written(a, &a->job->model);
        copy_written(a, &a->job->mom[0]);
        copy_written(a, &a->job->mom[1]);
    }
    pthread_mutex_lock(&a->mu);
    a->copy_s = now_s() - t0;
    a->copied = true;
    pthread_cond_broadcast(&a->cv);
    pthread_mutex_unlock(&a->mu);
    job_write(a->job);
    atomic_store(&a->done, 1);
    return NULL;
}

// Joins the thread, if one runs; nothing else.
static void join_thread(moe_ckpt_async *a) {
    if (!a->thread_live) return;
    pthread_join(a->thread, NULL);
    a->thread_live = false;
}

static void *clean_thread(void *arg) {
    moe_ckpt_async *a = arg;
    a->clean_rc = moe_ckpt_trash_empty(&a->trash);
    snprintf(a->clean_msg, sizeof a->clean_msg, "%s", a->clean_rc < 0 ? moe_last_error() : "");
    return NULL;
}

// Joins the cleaner, if one runs. A failure only leaves a trash folder, which
// no reader resolves and the next save's recovery or pruning removes: a warning.
static void join_cleaner(moe_ckpt_async *a) {
    if (!a->cleaner_live) return;
    pthread_join(a->cleaner, NULL);
    a->cleaner_live = false;
    if (a->clean_rc < 0)
        moe_log(MOE_LOG_WARN, "checkpoint saved, but removing the previous one failed: %s",
                a->clean_msg);
}

int moe_ckpt_async_begin(moe_ckpt_async *a, const char *run, int keep, const moe_model *m,
                         const moe_adamw *opt, const moe_train_state *st, moe_parallel *par,
                         char *saved, size_t cap) {
    const double t_begin = now_s();
    if (a->snap && (opt->state == MOE_ADAMW_BF16) != (a->mom_size == sizeof(uint16_t)))
        return moe_fail(MOE_EINVAL,
                        "checkpoint: the asynchronous save's snapshot was sized for "
                        "train.optimizer_state = %s, the optimizer stores %s",
                        a->mom_size == sizeof(float) ? "fp32" : "bf16",
                        opt->state == MOE_ADAMW_BF16 ? "bf16" : "fp32");
    MOE_TRY(moe_ckpt_async_wait(a, par)); // at most one save in flight
    MOE_TRY(moe_ckpt_run_folder(run, keep, st->step, saved, cap));
    snprintf(a->run, sizeof a->run, "%s", run);
    a->keep = keep;
    save_src src = model_src(m, opt);
    if (a->snap) { // the snapshot: training changes the model's buffers from the next step
        src.params = (float *)a->snap;
        src.m = a->snap + sizeof(float) * a->n;
        src.v = a->snap + (sizeof(float) + a->mom_size) * a->n;
        for (int l = 0; l < m->L; l++) {
            const float *b = m->is_moe[l] ? moe_model_bias(m, l) : NULL;
            src.bias[l] = b ? a->bias[l] : NULL;
            if (b) memcpy(a->bias[l], b, sizeof(float) * m->moe_cfg[l].E);
        }
    }
    memset(a->job, 0, sizeof *a->job);
    const double t0 = moe_log_enabled(MOE_LOG_DEBUG) ? now_s() : 0;
    int rc = job_start(a->job, saved, m, opt, st, par, &src, false);
    // The big copy (params and both moments of the tensors this rank writes,
    // not the dense ones on ranks other than 0) is the thread's first task.
    a->live[0] = m->params, a->live[1] = moe_adamw_moment(opt, 0);
    a->live[2] = moe_adamw_moment(opt, 1);
    a->rank = par ? par->rank : 0;
    const double t2 = t0 ? now_s() : 0;
    // A failure to start is agreed now, so every rank leaves the same way (and,
    // sharded, no rank writes before rank 0 has made DIR.tmp).
    if (par) rc = moe_comm_agree(par->world, rc);
    if (t0)
        moe_log(MOE_LOG_DEBUG,
                "checkpoint of step %ld (%s): begin %.3f s (start %.3f s, agreeing %.3f s) "
                "(rank %d)",
                st->step, saved, now_s() - t_begin, t2 - t0, now_s() - t2, a->rank);
    if (rc < 0) {
        rc = job_commit(a->job, par, rc, NULL); // rank 0 removes dir.tmp
        job_free(a->job);
        return rc;
    }
    a->pending = true;
    atomic_store(&a->done, 0);
    a->copied = a->awaited = false; // (no thread runs: begin waited for it)
    a->copy_s = 0;
    if (pthread_create(&a->thread, NULL, save_thread, a) == 0) {
        a->thread_live = true;
    } else { // reported at the commit, like a failed write; nothing to copy for it
        a->job->rc = moe_fail(MOE_EIO, "%s: cannot start the save thread", a->job->tmp);
        snprintf(a->job->msg, sizeof a->job->msg, "%s", moe_last_error());
        a->copied = true;
        atomic_store(&a->done, 1);
    }
    return 0;
}

int moe_ckpt_async_wait_snapshot(moe_ckpt_async *a) {
    if (!a || a->awaited) return 0;
    const double t0 = now_s();
    pthread_mutex_lock(&a->mu);
    while (!a->copied)
        pthread_cond_wait(&a->cv, &a->mu);
    const double copy_s = a->copy_s;
    pthread_mutex_unlock(&a->mu);
    a->awaited = true;
    if (a->pending)
        moe_log(MOE_LOG_DEBUG,
                "checkpoint of step %ld: snapshot copied in %.3f s on the save thread; "
                "waited %.3f s for it (rank %d)",
                a->job->step, copy_s, now_s() - t0, a->rank);
    return 1;
}

int moe_ckpt_async_poll(moe_ckpt_async *a, moe_parallel *par, bool wait) {
    if (a && wait) join_cleaner(a);
    if (!a || !a->pending) return 0;
    if (wait) {
        moe_ckpt_async_wait_snapshot(a);
        join_thread(a);
    }
    int64_t done = atomic_load(&a->done);
    int size = par ? moe_comm_size(par->world) : 1;
    if (size > 1) MOE_TRY(moe_comm_allreduce_i64(par->world, &done, 1));
    if (done < size) return 0;       // a rank still writes: ask again at the next step
    moe_ckpt_async_wait_snapshot(a); // done: copied long ago (this marks it seen)
    join_thread(a);
    int rc = a->job->rc;
    if (rc < 0) moe_fail(rc, "%s", a->job->msg); // the thread's message, naming the file
    a->pending = false;
    join_cleaner(a); // (begin joined it: the trash names are free)
    rc = job_commit(a->job, par, rc, &a->trash);
    if (rc == 0 && a->job->rank0)
        rc = moe_ckpt_run_finish(a->run, a->keep, a->job->step, &a->trash);
    job_free(a->job);
    if (a->trash.n) {
        // Removed by the cleaner thread; if none can start, here.
        if (pthread_create(&a->cleaner, NULL, clean_thread, a) == 0)
            a->cleaner_live = true;
        else if (moe_ckpt_trash_empty(&a->trash) < 0)
            moe_log(MOE_LOG_WARN, "checkpoint saved, but removing the previous one failed: %s",
                    moe_last_error());
    }
    return rc < 0 ? rc : 1;
}

int moe_ckpt_async_wait(moe_ckpt_async *a, moe_parallel *par) {
    int rc = moe_ckpt_async_poll(a, par, true);
    return rc < 0 ? rc : 0;
}

long moe_ckpt_async_pending(const moe_ckpt_async *a) {
    return a && a->pending ? a->job->step : -1;
}

void moe_ckpt_async_free(moe_ckpt_async *a) {
    if (!a) return;
    join_thread(a);
    join_cleaner(a);
    moe_ckpt_trash_free(&a->trash);
    if (a->job) job_free(a->job);
    free(a->job);
    if (a->sync_ok) {
        pthread_cond_destroy(&a->cv);
        pthread_mutex_destroy(&a->mu);
    }
    moe_mfree(a->snap);
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        free(a->bias[l]);
    free(a);
}

void (*moe_ckpt_resolved_hook)(const char *folder);

// How often a reader resolves again when the folder it read was replaced.
#define READ_TRIES 4

int moe_ckpt_read_retry(const char *dir, int (*read)(const char *folder, void *ctx), void *ctx) {
    int rc = 0;
    for (int i = 0; i < READ_TRIES; i++) {
        char rdir[PATH_MAX];
        struct stat a, b;
        MOE_TRY(moe_ckpt_resolve(dir, rdir, sizeof rdir, NULL));
        const bool known = stat(rdir, &a) == 0;
        if (moe_ckpt_resolved_hook) moe_ckpt_resolved_hook(rdir);
        if ((rc = read(rdir, ctx)) == 0) return 0;
        // The folder read is still the one resolved: the failure is its own.
        if (known && stat(rdir, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return rc;
        moe_log(MOE_LOG_DEBUG, "%s: replaced while read (%s): resolving %s again", rdir,
                moe_last_error(), dir);
    }
    return rc;
}

static int config_read(const char *rdir, void *cfg);

int moe_ckpt_config(const char *dir, moe_config *cfg) {
    return moe_ckpt_read_retry(dir, config_read, cfg);
}

// moe_ckpt_config of the resolved folder rdir.
static int config_read(const char *rdir, void *out) {
    moe_config *cfg = out;
    char p[PATH_MAX];
    MOE_TRY(moe_ckpt_check_sizes(rdir));
    MOE_TRY(join(p, rdir, "/config.json"));
    moe_config_default(cfg);
    moe_config_src *src = moe_config_src_new(); // messages point into the file
    if (!src) return moe_fail(MOE_ENOMEM, "%s: out of memory", p);
    int rc = moe_config_load(cfg, src, p);
    if (rc == 0) rc = moe_config_check(cfg, src); // readers size arrays by it: check before use
    moe_config_src_free(src);
    if (rc < 0) {
        // A key the file does not set is located as "default": name the file.
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", moe_last_error());
        if (!strncmp(msg, p, strlen(p))) return rc;
        const char *m = strncmp(msg, "default: ", 9) ? msg : msg + 9;
        return moe_fail(rc, "%s: %s", p, m);
    }
    // A tokenizer named by a relative path is the folder's own copy.
    char *tok = cfg->model.tokenizer;
    if (strcmp(tok, "bytes") && tok[0] != '/') {
        char full[PATH_MAX];
        int n = snprintf(full, sizeof full, "%s/%s", rdir, tok);
        if (n < 0 || (size_t)n >= sizeof cfg->model.tokenizer)
            return moe_fail(MOE_EINVAL, "%s: model.tokenizer: path %s/%s too long", p, rdir, tok);
        memcpy(tok, full, (size_t)n + 1);
    }
    return 0;
}

int moe_ckpt_tokenizer(const char *dir, const moe_config *cfg, moe_tokenizer **out) {
    *out = NULL;
    if (!strcmp(cfg->model.tokenizer, "bytes")) return 0;
    moe_tokenizer *t;
    MOE_TRY(moe_tok_open(cfg->model.tokenizer, &t));
    const int V = moe_tok_vocab_size(t);
    if (V > cfg->model.vocab_size) {
        moe_tok_free(t);
        return moe_fail(MOE_EFORMAT,
                        "%s: its tokenizer (%s) has %d pieces, the model %d (model.vocab_size): "
                        "ids past the model's vocabulary have no embedding",
                        dir, cfg->model.tokenizer, V, cfg->model.vocab_size);
    }
    *out = t;
    return 0;
}

static int is_bias_of(const moe_model *m, const char *name) {
    int l = moe_ckpt_bias_layer(name);
    return l >= 0 && l < m->L && m->is_moe[l];
}

// Reads this model's tensors (each view's name + suffix) from the set s into
// buf; what names the set in messages. With extras_allowed == 0 a tensor the
// model lacks is an error, except another shard's experts on an
// expert-parallel rank.
// Into buf, or with opt into its moment `which` (rounded to bf16 when it
// stores bf16: through a scratch buffer as large as the largest tensor).
static int load_tensors(const moe_st_set *s, const char *what, moe_model *m, float *buf,
                        moe_adamw *opt, int which, const char *suffix, int extras_allowed) {
    char name[MOE_PARAM_NAME_MAX + 16];
    float *scratch = NULL;
    if (opt && opt->state == MOE_ADAMW_BF16) {
        size_t most = 1;
        for (int i = 0; i < m->table.count; i++)
            most = m->table.views[i].numel > most ? m->table.views[i].numel : most;
        if (!(scratch = malloc(most * sizeof(float))))
            return moe_fail(MOE_ENOMEM, "%s: out of memory", what);
    } else if (opt) {
        buf = moe_adamw_moment(opt, which);
    }
    for (int i = 0; i < m->table.count; i++) {
        const moe_param_view *v = &m->table.views[i];
        snprintf(name, sizeof name, "%s%s", v->name, suffix);
        moe_st_file *f = NULL;
        const moe_st_tensor *t = moe_st_set_find(s, name, &f);
        int rc = 0;
        if (!t) rc = moe_fail(MOE_EFORMAT, "%s: missing tensor '%s'", what, name);
        int same = t && t->dtype == MOE_ST_F32 && t->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++)
            same = t->shape[d] == v->shape[d];
        if (rc == 0 && !same) {
            char has[160], want[160];
            moe_st_describe(has, sizeof has, t->dtype, t->ndim, t->shape);
            moe_st_describe(want, sizeof want, MOE_ST_F32, v->ndim, v->shape);
            rc = moe_fail(MOE_EFORMAT, "%s: tensor '%s' is %s, the config expects %s", f->path,
                          name, has, want);
        }
        float *x = scratch ? scratch : buf + v->offset;
        if (rc == 0) rc = moe_st_read(f, t, x, v->numel * sizeof(float));
        // A second moment is a mean of squares: a negative one would make the
        // update's square root NaN on the first step after the resume.
        for (size_t j = 0; rc == 0 && opt && which == 1 && j < v->numel; j++)
            if (x[j] < 0)
                rc = moe_fail(MOE_EFORMAT,
                              "%s: tensor '%s' has %g at element %zu; second moments "
                              "are never negative",
                              f->path, name, x[j], j);
        if (rc == 0 && scratch) moe_adamw_moment_set(opt, which, v->offset, v->numel, scratch);
        if (rc < 0) {
            free(scratch);
            return rc;
        }
    }
    free(scratch);
    if (extras_allowed) return 0;
    for (int k = 0; k < s->n_files; k++) {
        const moe_st_file *f = s->files[k];
        for (int i = 0; i < f->n_tensors; i++)
            if (!moe_param_table_find(&m->table, f->tensors[i].name) &&
                !(m->ep && is_expert(f->tensors[i].name)) && !is_bias_of(m, f->tensors[i].name))
                return moe_fail(MOE_EFORMAT, "%s: tensor '%s' does not belong to this config",
                                f->path, f->tensors[i].name);
    }
    return 0;
}

// --- trainer_state.json: every field checked before any is used --------------------

static int bad_field(const char *path, const char *field, const char *expected) {
    return moe_fail(MOE_EFORMAT, "%s: '%s' must be %s", path, field, expected);
}

static int state_int(json_t *o, const char *key, const char *path, json_int_t max,
                     json_int_t *out) {
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > max)
        return moe_fail(MOE_EFORMAT, "%s: '%s' must be an integer in [0, %lld]", path, key,
                        (long long)max);
    *out = json_integer_value(v);
    return 0;
}

// The dynamic-capacity state of layer l (object o) checked against what the
// controller can produce: C_e in [min_capacity, max(static C, ceil(k*T/E *
// cf_max))], m_e a finite mean load in [0, k*T]. Values go to ema/cap only
// when all are valid.
static int check_layer_state(const char *path, json_t *o, int l, const moe_model *m,
                             const moe_capacity_ctl *c, double *ema, int *cap, long *steps,
                             bool *seeded) {
    char f[96];
    const moe_router_config *r = &m->cfg.router;
    const double T = (double)m->B * m->T;
    if (!json_is_object(o))
        return moe_fail(MOE_EFORMAT, "%s: capacity state of layer %d must be an object", path, l);
    json_t *jl = json_object_get(o, "layer"), *js = json_object_get(o, "steps"),
           *jseed = json_object_get(o, "seeded"), *je = json_object_get(o, "ema"),
           *jc = json_object_get(o, "capacity");
    snprintf(f, sizeof f, "capacity[layer %d].layer", l);
    if (!json_is_integer(jl) || json_integer_value(jl) != l) {
        char want[48];
        snprintf(want, sizeof want, "%d (the next dynamic-capacity layer)", l);
        return bad_field(path, f, want);
    }
    snprintf(f, sizeof f, "capacity[layer %d].steps", l);
    if (!json_is_integer(js) || json_integer_value(js) < 0 || json_integer_value(js) > LONG_MAX)
        return bad_field(path, f, "a non-negative integer");
    snprintf(f, sizeof f, "capacity[layer %d].seeded", l);
    if (!json_is_boolean(jseed)) return bad_field(path, f, "true or false");
    snprintf(f, sizeof f, "capacity[layer %d].ema", l);
    if (!json_is_array(je) || json_array_size(je) != (size_t)c->E) {
        char want[48];
        snprintf(want, sizeof want, "an array of %d numbers", c->E);
        return bad_field(path, f, want);
    }
    snprintf(f, sizeof f, "capacity[layer %d].capacity", l);
    if (!json_is_array(jc) || json_array_size(jc) != (size_t)c->E) {
        char want[48];
        snprintf(want, sizeof want, "an array of %d integers", c->E);
        return bad_field(path, f, want);
    }
    int c0 = moe_capacity_static(r, m->B * m->T, c->E);
    double hi_d = ceil((double)r->top_k * T * r->capacity_factor_max / c->E);
    long long lo = r->min_capacity, hi = hi_d > INT_MAX ? INT_MAX : (long long)hi_d;
    if (hi < lo) hi = lo;
    if (c0 > hi) hi = c0;
    for (int e = 0; e < c->E; e++) {
        json_t *v = json_array_get(je, e);
        double x = json_number_value(v);
        if (!json_is_number(v) || !isfinite(x) || x < 0 || x > r->top_k * T)
            return moe_fail(MOE_EFORMAT,
                            "%s: 'capacity[layer %d].ema[%d]' must be a finite number in [0, %g] "
                            "(a mean load of top_k * %g tokens at most)",
                            path, l, e, r->top_k * T, T);
        v = json_array_get(jc, e);
        if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
            return moe_fail(MOE_EFORMAT,
                            "%s: 'capacity[layer %d].capacity[%d]' must be an integer in [%lld, "
                            "%lld] (router.min_capacity up to the largest capacity this config "
                            "allows)",
                            path, l, e, lo, hi);
        ema[e] = x;
        cap[e] = (int)json_integer_value(v);
    }
    *steps = (long)json_integer_value(js);
    *seeded = json_is_true(jseed);
    return 0;
}

static int load_state(const char *path, moe_model *m, moe_adamw *opt, moe_train_state *st) {
    FILE *f; // a FIFO would block the read: refused
    MOE_TRY(moe_fopen_regular(path, &f));
    json_error_t jerr;
    json_t *doc = json_loadf(f, JSON_REJECT_DUPLICATES, &jerr);
    fclose(f);
    if (!doc) return moe_json_fail(MOE_EFORMAT, path, &jerr);
    int rc = 0, n_dyn = 0;
    json_int_t step = 0, adam_step = 0;
    uint64_t cur[2];
    double *ema[MOE_MAX_LAYERS] = {0};
    int *cap[MOE_MAX_LAYERS] = {0};
    long steps[MOE_MAX_LAYERS] = {0};
    bool seeded[MOE_MAX_LAYERS] = {0};
    if (!json_is_object(doc)) MOE_TRY_GOTO(bad_field(path, "(top level)", "an object"), rc);
    // at most train.steps' largest value: a later step could never resume
    MOE_TRY_GOTO(state_int(doc, "step", path, 1000000000, &step), rc);
    MOE_TRY_GOTO(state_int(doc, "adam_step", path, 1000000000, &adam_step), rc);
    // one optimizer update a training step at most: a larger count would give
    // the resumed updates another bias correction than the run's own
    if (adam_step > step)
        MOE_TRY_GOTO(bad_field(path, "adam_step", "at most \"step\" (one update a step)"), rc);
    json_t *jcur = json_object_get(doc, "data_cursor");
    if (!json_is_array(jcur) || json_array_size(jcur) != 2)
        MOE_TRY_GOTO(bad_field(path, "data_cursor", "two non-negative integers (train, val)"), rc);
    for (int k = 0; k < 2; k++) {
        json_t *v = json_array_get(jcur, k);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            MOE_TRY_GOTO(bad_field(path, k ? "data_cursor[1]" : "data_cursor[0]",
                                   "a non-negative integer (batches drawn)"),
                         rc);
        cur[k] = (uint64_t)json_integer_value(v);
    }
    // Summary figures (absent in older checkpoints: 0). Non-negative numbers.
    double sums[5] = {0, 0, 0, 0, 0};
    static const char *const sum_keys[5] = {"tokens", "train_seconds", "drop_rate_sum",
                                            "max_vio_sum", "mfu_sum"};
    for (int k = 0; k < 5; k++) {
        json_t *v = json_object_get(doc, sum_keys[k]);
        if (v &&
            (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0))
            MOE_TRY_GOTO(bad_field(path, sum_keys[k], "a finite number >= 0"), rc);
        sums[k] = v ? json_number_value(v) : 0;
    }
    // the steps those sums cover: at most the checkpoint's
    json_int_t summed[2] = {0, 0};
    static const char *const summed_keys[2] = {"summed_steps", "mfu_steps"};
    for (int k = 0; k < 2; k++)
        if (json_object_get(doc, summed_keys[k]))
            MOE_TRY_GOTO(state_int(doc, summed_keys[k], path, step, &summed[k]), rc);
    json_t *caps = json_object_get(doc, "capacity");
    for (int l = 0; l < m->L; l++)
        n_dyn += m->cap[l].capacity != NULL;
    if (json_is_array(caps) && json_array_size(caps) != (size_t)n_dyn)
        MOE_TRY_GOTO(moe_fail(MOE_EFORMAT,
                              "%s: 'capacity' holds the state of %zu dynamic-capacity layers, this "
                              "config has %d: capacity.mode (or the MoE layers) changed since the "
                              "checkpoint was written",
                              path, json_array_size(caps), n_dyn),
                     rc);
    if (!json_is_array(caps)) {
        char want[96];
        snprintf(want, sizeof want, "an array with the state of the %d dynamic-capacity layers",
                 n_dyn);
        MOE_TRY_GOTO(bad_field(path, "capacity", want), rc);
    }
    size_t i = 0;
    for (int l = 0; l < m->L; l++) {
        const moe_capacity_ctl *c = &m->cap[l];
        if (!c->capacity) continue;
        ema[l] = malloc(sizeof(double) * (size_t)c->E);
        cap[l] = malloc(sizeof(int) * (size_t)c->E);
        if (!ema[l] || !cap[l]) MOE_TRY_GOTO(moe_fail(MOE_ENOMEM, "%s: out of memory", path), rc);
        MOE_TRY_GOTO(check_layer_state(path, json_array_get(caps, i++), l, m, c, ema[l], cap[l],
                                       &steps[l], &seeded[l]),
                     rc);
    }
    // All valid: only now does the model change.
    for (int l = 0; l < m->L; l++) {
        moe_capacity_ctl *c = &m->cap[l];
        if (!c->capacity) continue;
        memcpy(c->ema, ema[l], sizeof(double) * (size_t)c->E);
        memcpy(c->capacity, cap[l], sizeof(int) * (size_t)c->E);
        c->steps = steps[l];
        c->seeded = seeded[l];
    }
    if (st) {
        st->step = (long)step;
        st->cursor[0] = cur[0];
        st->cursor[1] = cur[1];
        st->tokens = sums[0];
        st->seconds = sums[1];
        st->drop_sum = sums[2], st->vio_sum = sums[3], st->mfu_sum = sums[4];
        st->summed = (long)summed[0], st->mfu_steps = (long)summed[1];
    }
    if (opt) opt->step = (long)adam_step;
fail:
    for (int l = 0; l < MOE_MAX_LAYERS; l++)
        free(ema[l]), free(cap[l]);
    json_decref(doc);
    return rc;
}

// task_experts.json checked against the folder's own config.json and
// weights, as generate and export check it: one reader for every command.
static int check_task_experts(const char *rdir, const moe_st_set *s) {
    moe_config cc;
    MOE_TRY(moe_ckpt_config(rdir, &cc));
    moe_task_experts te;
    int rc = moe_ckpt_task_experts(rdir, &cc, s, &te);
    if (rc == 0) moe_task_experts_free(&te);
    return rc == MOE_ENOTFOUND ? 0 : rc; // an older checkpoint has none
}

typedef struct {
    moe_model *m;
    moe_adamw *opt;
    moe_train_state *st;
} load_args;

static int load_read(const char *rdir, void *ctx);

int moe_ckpt_load(const char *dir, moe_model *m, moe_adamw *opt, moe_train_state *st) {
    load_args a = {m, opt, st};
    return moe_ckpt_read_retry(dir, load_read, &a);
}

// moe_ckpt_load of the resolved folder rdir.
static int load_read(const char *rdir, void *ctx) {
    const load_args *a = ctx;
    moe_model *m = a->m;
    moe_adamw *opt = a->opt;
    moe_train_state *st = a->st;
    char p[PATH_MAX], again[PATH_MAX];
    moe_ckpt_layout layout;
    MOE_TRY(moe_ckpt_resolve(rdir, again, sizeof again, &layout));
    moe_st_set *s;
    MOE_TRY(moe_st_set_open(rdir, &s)); // the same resolver picks the same layout
    MOE_TRY(
        join(p, rdir,
             layout == MOE_CKPT_SHARDED ? "/model.safetensors.index.json" : "/model.safetensors"));
    int rc = load_tensors(s, p, m, m->params, NULL, 0, "", 0);
    bool any = false; // a bias that routes: attached even where it would not move
    for (int l = 0; rc == 0 && l < m->L; l++) {
        float *b = moe_model_bias(m, l);
        bool found = false;
        if (b) rc = moe_ckpt_bias_read(s, p, l, m->moe_cfg[l].E, b, &found);
        for (int e = 0; found && e < m->moe_cfg[l].E; e++)
            any |= b[e] != 0.0f;
    }
    if (rc == 0 && any) moe_model_bias_attach(m);
    if (rc == 0) rc = check_task_experts(rdir, s);
    moe_st_set_close(s);
    if (rc < 0) return rc;
    if (opt) {
        moe_st_set *os = NULL;
        moe_st_file *f = NULL;
        MOE_TRY(join(p, rdir, "/optimizer.safetensors.index.json"));
        if (exists(p)) { // a sharded save: each rank reads its own experts' moments
            MOE_TRY(moe_st_set_open_index(rdir, "optimizer.safetensors.index.json", &os));
        } else {
            MOE_TRY(join(p, rdir, "/optimizer.safetensors"));
            MOE_TRY(moe_st_open(p, &f));
        }
        moe_st_set one = {.n_files = 1, .files = &f, .total_bytes = f ? f->file_size : 0};
        const moe_st_set *set = os ? os : &one;
        rc = load_tensors(set, p, m, NULL, opt, 0, ".exp_avg", 1);
        if (rc == 0) rc = load_tensors(set, p, m, NULL, opt, 1, ".exp_avg_sq", 1);
        moe_st_close(f);
        moe_st_set_close(os);
        if (rc < 0) return rc;
    }
    MOE_TRY(join(p, rdir, "/trainer_state.json"));
    return load_state(p, m, opt, st); // dynamic capacity is part of the model's state
}
