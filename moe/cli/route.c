// `moe route`: routes the logits [T, E] of a safetensors file with the router
// (README "Router semantics") and writes the dispatch plan as safetensors, with
// a summary on stdout. `--example` routes a built-in batch under position and
// priority slot order (V-MoE Batch Prioritized Routing) and dropless capacity.
#include "moe/cli/cli.h"
#include "moe/error.h"
#include "moe/router.h"
#include "moe/safetensors.h"

#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

_Static_assert(sizeof(int) == 4, "plan int arrays are written as I32");
_Static_assert(sizeof(float) == 4, "plan float arrays are written as F32");

static const char *const CMD = "route";

static const char *const route_help =
    "usage: moe route --logits IN.safetensors [--task-ids IN.safetensors]\n"
    "                 [--set KEY=VALUE]... [--train [--step N]] --out PLAN.safetensors\n"
    "       moe route --example [--set KEY=VALUE]... [--out PLAN.safetensors]\n"
    "\n"
    "Routes logits [T, E] with the router and writes the dispatch plan.\n"
    "\n"
    "  --logits FILE    safetensors with 'logits' F32 [T, E] (E <= 65536, the\n"
    "                   moe.num_experts limit) and optionally\n"
    "                   'task_ids' I32 [T] (task of each token, >= 0) and 'bias'\n"
    "                   F32 [E] (expert selection bias of auxiliary-loss-free\n"
    "                   balancing: added to the scores, in double, for the top-k\n"
    "                   choice only, the weights stay the unbiased scores; all\n"
    "                   zeros routes as none; refused under expert choice)\n"
    "  --task-ids FILE  take 'task_ids' I32 [T] from FILE instead\n"
    "  --set KEY=VALUE  router config, e.g. --set router.top_k=1\n"
    "                   --set router.slot_order=priority --set router.task_priority=[1,2]\n"
    "                   keys: router.{type (token_choice | expert_choice), top_k,\n"
    "                   capacity_factor (<= 0: dropless),\n"
    "                   min_capacity, slot_order, normalize_topk, score (softmax |\n"
    "                   sigmoid), route_scale, noise, noise_eps, aux_loss_coef,\n"
    "                   z_loss_coef, aux_counts_all_k, task_priority, seed,\n"
    "                   n_groups, topk_groups (n_groups 0: one group)};\n"
    "                   capacity.mode must stay static (one call has no load\n"
    "                   history for dynamic capacity)\n"
    "  --train          apply router.noise, seeded by (router.seed, --step). Here the\n"
    "                   logits are the router input: jitter multiplies the logits\n"
    "                   by U(1-eps, 1+eps) and everything (scores, choices, losses)\n"
    "                   uses the jittered logits; gumbel perturbs choices 2..k\n"
    "                   (README \"Router semantics\" gives the generator)\n"
    "  --step N         training step that keys the noise, 0..2^63-1 (default 0)\n"
    "  --out FILE       plan: expert, slot I32 [T, k] (-1 = dropped), weight F32\n"
    "                   [T, k], counts, kept, capacity I32 [E], aux_loss, z_loss F32\n"
    "                   [1] (both raw, not times router.aux_loss_coef or\n"
    "                   router.z_loss_coef); metadata holds the resolved config\n"
    "                   (route.bias: a non-zero 'bias' was used). Under expert choice\n"
    "                   k is E: a token's experts in descending score, then -1.\n"
    "                   Written atomically;\n"
    "                   on any error no file is created\n"
    "  --example        route a built-in batch (T=16, E=4, k=2, two tasks) with\n"
    "                   capacity_factor 1 under position and priority slot order and\n"
    "                   dropless, and show which tokens each drops; --out writes the\n"
    "                   position plan. Other --set keys apply; the five it fixes\n"
    "                   (router.top_k, task_priority, slot_order, capacity_factor,\n"
    "                   type) are refused\n"
    "\n"
    "An --out that exists must be a regular file other than every input (it is\n"
    "replaced). router.noise without --train, router.bias_update_rate (training\n"
    "updates the bias: give it as 'bias' in --logits) and router.ec_fallback\n"
    "(inference) do not change a route: once the input is accepted, one note on\n"
    "stderr names those set. Logits must be finite (NaN and +-inf are refused, so\n"
    "-inf cannot mask an expert).\n"
    "\n"
    "exit status: 0 ok, 1 runtime failure (e.g. cannot write), 2 bad usage or input\n";

typedef struct {
    const char *logits_path, *task_path, *out_path;
    bool train, example, help, step_given;
    const char *fixed_set; // a --set of a key --example fixes (refused with it)
    const char *step_s;
    uint64_t step;
    moe_router_config cfg;
} route_args;

// Library failures while reading input are bad input (2), except running out of memory.
static int input_exit(int rc) {
    return rc == MOE_ENOMEM ? MOE_EXIT_RUNTIME : MOE_EXIT_USAGE;
}

static int fail_last(int exit_code) {
    return moe_cli_fail(CMD, exit_code, "%s", moe_last_error());
}

static int parse_args(int argc, char **argv, route_args *a) {
    memset(a, 0, sizeof *a);
    moe_config full; // --set goes through the run config's key table
    moe_config_default(&full);
    a->cfg = full.router;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v = NULL;
        int m;
        if (!strcmp(arg, "-h") || !strcmp(arg, "--help")) {
            a->help = true; // wins over whatever follows, as in every command
            return 0;
        } else if ((m = moe_cli_flag(arg, "--train", &a->train)) != 0 ||
                   (m = moe_cli_flag(arg, "--example", &a->example)) != 0) {
            if (m < 0) return fail_last(MOE_EXIT_USAGE);
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--logits", &a->logits_path)) != 0 ||
                   (m = moe_cli_opt_path(argc, argv, &i, "--task-ids", &a->task_path)) != 0 ||
                   (m = moe_cli_opt_path(argc, argv, &i, "--out", &a->out_path)) != 0) {
            if (m < 0) return fail_last(MOE_EXIT_USAGE);
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--step", &a->step_s)) != 0) {
            if (m < 0) return fail_last(MOE_EXIT_USAGE);
            v = a->step_s;
            long long s;
            if (moe_cli_parse_long_opt("--step", v, 0, INT64_MAX, &s) < 0)
                return fail_last(MOE_EXIT_USAGE);
            a->step = (uint64_t)s;
            a->step_given = true;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0) return fail_last(MOE_EXIT_USAGE);
            // The one --set parser of every command (the run config's key
            // table), limited to the keys a plan depends on.
            const char *eq = strchr(v, '=');
            if (!eq || eq == v)
                return moe_cli_fail(CMD, MOE_EXIT_USAGE, "--set '%s': expected KEY=VALUE", v);
            char key[128];
            snprintf(key, sizeof key, "%.*s", (int)(eq - v), v);
            if (strncmp(key, "router.", 7) && strncmp(key, "capacity.", 9) &&
                moe_config_set(&full, NULL, v) == 0)
                return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                                    "--set %s: moe route takes router.* and capacity.* keys "
                                    "only (moe train --help-config lists them)",
                                    key);
            full.router = a->cfg;
            if (moe_config_set(&full, NULL, v) < 0)
                return moe_cli_fail(CMD, MOE_EXIT_USAGE, "%s", moe_last_error());
            a->cfg = full.router;
            static const char *const fixed[] = {"router.top_k", "router.task_priority",
                                                "router.slot_order", "router.capacity_factor",
                                                "router.type"};
            for (size_t f = 0; f < sizeof fixed / sizeof *fixed; f++)
                if (!a->fixed_set && !strcmp(key, fixed[f])) a->fixed_set = v;
        } else {
            if (arg[0] != '-')
                return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                                    "unknown argument '%s' (see moe route --help)", arg);
            return moe_cli_unknown_option(CMD, arg, route_help);
        }
    }
    if (a->help) return 0;
    if (a->step_given && !a->train)
        return moe_cli_fail(CMD, MOE_EXIT_USAGE, "--step only makes sense with --train");
    if (a->cfg.capacity_mode == MOE_CAPACITY_DYNAMIC)
        return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                            "capacity.mode = dynamic adapts capacity over many steps from "
                            "measured load; moe route routes one batch: use static "
                            "(router.capacity_factor, or <= 0 for dropless)");
    if (a->example) {
        if (a->logits_path || a->task_path)
            return moe_cli_fail(CMD, MOE_EXIT_USAGE, "--example takes no --logits/--task-ids");
        // The example compares fixed settings; other --set keys apply to it.
        if (a->fixed_set)
            return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                                "--example fixes router.top_k, router.slot_order, "
                                "router.capacity_factor, router.task_priority and router.type "
                                "(token_choice); --set %s "
                                "cannot apply (route your own logits with --logits)",
                                a->fixed_set);
        return 0;
    }
    if (!a->logits_path)
        return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                            "--logits FILE is required (see moe route --help)");
    if (!a->out_path)
        return moe_cli_fail(CMD, MOE_EXIT_USAGE, "--out FILE is required (see moe route --help)");
    return 0;
}

// The plan replaces --out by a rename: a device, FIFO or folder there would
// become a regular file, and an input there would be lost. Both are refused.
static int check_out(const route_args *a) {
    struct stat so, si;
    if (!a->out_path || stat(a->out_path, &so) != 0) return 0; // new file: fine
    if (!S_ISREG(so.st_mode))
        return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                            "--out %s exists and is not a regular file (a device, FIFO or "
                            "folder); the plan would replace it: name a file",
                            a->out_path);
    const char *const inputs[][2] = {{"--logits", a->logits_path}, {"--task-ids", a->task_path}};
    for (int i = 0; i < 2; i++)
        if (inputs[i][1] && stat(inputs[i][1], &si) == 0 && si.st_dev == so.st_dev &&
            si.st_ino == so.st_ino)
            return moe_cli_fail(CMD, MOE_EXIT_USAGE,
                                "--out %s is the same file as %s %s: the plan would replace its "
                                "input; name another file",
                                a->out_path, inputs[i][0], inputs[i][1]);
    return 0;
}

// One stderr line naming the keys set that cannot change a route (the plan's
// metadata still records them).
static void note_ignored(const route_args *a) {
    moe_config def;
    moe_config_default(&def);
    char keys[256] = "";
    size_t n = 0;
    if (a->cfg.noise != MOE_NOISE_NONE && !a->train)
        n += snprintf(keys + n, sizeof keys - n, "%srouter.noise (applies with --train)",
                      n ? ", " : "");
    if (a->cfg.bias_update_rate != def.router.bias_update_rate)
        n += snprintf(keys + n, sizeof keys - n,
                      "%srouter.bias_update_rate (training updates the bias; give it as 'bias' "
                      "in --logits)",
                      n ? ", " : "");
    if (a->cfg.ec_fallback != def.router.ec_fallback)
        n += snprintf(keys + n, sizeof keys - n, "%srouter.ec_fallback (inference only)",
                      n ? ", " : "");
    if (n) fprintf(stderr, "moe %s: note: ignored: %s\n", CMD, keys);
}

// The losses are F32 in the plan: logits near the F32 limit square past it.
// jittered: the logits routed are the file's times the jitter factors, which
// can reach past the limit when the file's do not.
static int check_losses(const moe_plan *p, const float *logits, size_t n, const char *path,
                        bool jittered) {
    if (isfinite(p->z_loss) && isfinite(p->aux_loss)) return 0;
    float mx = 0;
    for (size_t i = 0; i < n; i++)
        mx = fabsf(logits[i]) > mx ? fabsf(logits[i]) : mx;
    const float z = isfinite(p->z_loss) ? p->aux_loss : p->z_loss;
    if (jittered)
        return moe_fail(MOE_ENUMERIC,
                        "%s: the logits jittered by router.noise = jitter (--train) reach %g in "
                        "magnitude, which makes z_loss (the mean squared logsumexp) %g, beyond "
                        "F32: the router needs logits below about 1e19",
                        path, mx, z);
    return moe_fail(MOE_ENUMERIC,
                    "%s: logits up to %g in magnitude make z_loss (the mean squared "
                    "logsumexp) %g, beyond F32: the router needs logits below about 1e19",
                    path, mx, z);
}

// --- plan file ------------------------------------------------------------------------

// Shortest "%.*g" that reads back as the same double, so metadata stays legible.
static void fmt_double(char *buf, size_t n, double x) {
    for (int prec = 6; prec <= 17; prec++) {
        snprintf(buf, n, "%.*g", prec, x);
        if (strtod(buf, NULL) == x) return;
    }
}

// META_LEN holds every single value; router.task_priority lists up to
// MOE_MAX_TASKS numbers of up to 24 characters ("%.17g") and a comma each.
enum { META_KEYS = 28, META_LEN = 64, TP_LEN = MOE_MAX_TASKS * 25 + 1 };

// The resolved config as metadata strings, keyed as in config files;
// router.task_priority in tp [TP_LEN], whole.
static void config_metadata(const moe_router_config *c, bool training, uint64_t step, bool bias,
                            char vals[][META_LEN], char *tp, const char **kv) {
    static const char *const orders[] = {"position", "priority"};
    static const char *const noises[] = {"none", "jitter", "gumbel"};
    int n = 0, m = 0;
#define KV(key) (kv[m++] = (key), kv[m++] = vals[n], vals[n++])
    snprintf(KV("format"), META_LEN, "moe-plan");
    snprintf(KV("moe.version"), META_LEN, "%s", MOE_VERSION);
    snprintf(KV("router.type"), META_LEN, "%s",
             c->type == MOE_ROUTER_EXPERT_CHOICE ? "expert_choice" : "token_choice");
    snprintf(KV("router.top_k"), META_LEN, "%d", c->top_k);
    fmt_double(KV("router.capacity_factor"), META_LEN, c->capacity_factor);
    snprintf(KV("router.min_capacity"), META_LEN, "%d", c->min_capacity);
    snprintf(KV("router.slot_order"), META_LEN, "%s", orders[c->slot_order]);
    snprintf(KV("router.normalize_topk"), META_LEN, "%s", c->normalize_topk ? "true" : "false");
    snprintf(KV("router.score"), META_LEN, "%s",
             c->score == MOE_SCORE_SIGMOID ? "sigmoid" : "softmax");
    fmt_double(KV("router.route_scale"), META_LEN, c->route_scale);
    snprintf(KV("router.n_groups"), META_LEN, "%d", c->n_groups);
    snprintf(KV("router.topk_groups"), META_LEN, "%d", c->topk_groups);
    snprintf(KV("router.noise"), META_LEN, "%s", noises[c->noise]);
    fmt_double(KV("router.noise_eps"), META_LEN, c->noise_eps);
    fmt_double(KV("router.aux_loss_coef"), META_LEN, c->aux_loss_coef);
    fmt_double(KV("router.z_loss_coef"), META_LEN, c->z_loss_coef);
    snprintf(KV("router.aux_counts_all_k"), META_LEN, "%s", c->aux_counts_all_k ? "true" : "false");
    kv[m++] = "router.task_priority", kv[m++] = tp;
    tp[0] = '\0';
    for (int i = 0, len = 0; i < c->n_task_priority; i++) {
        char one[32];
        fmt_double(one, sizeof one, c->task_priority[i]);
        len += snprintf(tp + len, TP_LEN - (size_t)len, "%s%s", i ? "," : "", one);
        assert(len < TP_LEN);
    }
    snprintf(KV("router.seed"), META_LEN, "%llu", (unsigned long long)c->seed);
    snprintf(KV("capacity.mode"), META_LEN, "static");
    snprintf(KV("route.training"), META_LEN, "%s", training ? "true" : "false");
    snprintf(KV("route.step"), META_LEN, "%llu", (unsigned long long)step);
    snprintf(KV("route.bias"), META_LEN, "%s", bias ? "true" : "false");
#undef KV
    assert(n <= META_KEYS);
    kv[m] = NULL;
}

// A bias of zeros routes as none (README "Router semantics"): used only when
// some value is non-zero.
static bool bias_used(const moe_plan *p) {
    for (int e = 0; p->bias && e < p->E; e++)
        if (p->bias[e] != 0.0f) return true;
    return false;
}

static int write_plan(const char *path, const moe_plan *p, const moe_router_config *cfg,
                      bool training, uint64_t step) {
    int64_t T = p->T, E = p->E, k = p->k;
    const moe_st_entry e[] = {
        {"expert", MOE_ST_I32, 2, {T, k}, p->expert},
        {"slot", MOE_ST_I32, 2, {T, k}, p->slot},
        {"weight", MOE_ST_F32, 2, {T, k}, p->weight},
        {"counts", MOE_ST_I32, 1, {E}, p->counts},
        {"kept", MOE_ST_I32, 1, {E}, p->kept},
        {"capacity", MOE_ST_I32, 1, {E}, p->capacity},
        {"aux_loss", MOE_ST_F32, 1, {1}, &p->aux_loss},
        {"z_loss", MOE_ST_F32, 1, {1}, &p->z_loss},
    };
    char vals[META_KEYS][META_LEN], tp[TP_LEN];
    const char *kv[2 * META_KEYS + 1];
    config_metadata(cfg, training, step, bias_used(p), vals, tp, kv);
    return moe_st_write(path, e, (int)(sizeof e / sizeof *e), kv);
}

// --- summary --------------------------------------------------------------------------

static void print_summary(const moe_plan *p, const moe_router_config *cfg) {
    moe_load_stats st;
    moe_plan_stats(p, &st);
    if (p->expert_choice) { // README "Expert-choice routing"
        printf("plan: T=%d tokens, E=%d experts, expert choice (top_k %d, factor %g: every "
               "expert takes C = %d tokens)\n",
               p->T, p->E, cfg->top_k, cfg->capacity_factor, p->E ? p->capacity[0] : 0);
        printf("  expert  tokens\n");
        for (int e = 0; e < p->E; e++)
            printf("  %6d  %6d\n", e, p->kept[e]);
        printf("  %ld of %d tokens got no expert (drop rate %.2f%%)\n", st.dropped, p->T,
               100.0 * st.drop_rate);
        printf("  aux_loss %.6f (none under expert choice)  z_loss %.6f\n", p->aux_loss, p->z_loss);
        return;
    }
    printf("plan: T=%d tokens, E=%d experts, k=%d, slot order %s, ", p->T, p->E, p->k,
           cfg->slot_order == MOE_SLOT_PRIORITY ? "priority" : "position");
    if (cfg->capacity_factor <= 0)
        printf("capacity dropless (C = max count = %d)\n", st.max_count);
    else
        printf("capacity static (factor %g, min %d: C = %d)\n", cfg->capacity_factor,
               cfg->min_capacity, moe_capacity_static(cfg, p->T, p->E));
    if (moe_router_groups_active(cfg)) // group-limited routing (DeepSeek-V3)
        printf("  group-limited: router.topk_groups = %d of router.n_groups = %d groups of %d "
               "experts\n",
               cfg->topk_groups, cfg->n_groups, p->E / cfg->n_groups);
    printf("  expert  counts    kept  capacity\n");
    for (int e = 0; e < p->E; e++)
        printf("  %6d  %6d  %6d  %8d\n", e, p->counts[e], p->kept[e], p->capacity[e]);
    printf("  dropped %ld of %ld assignments (drop rate %.2f%%), padding %.2f%% of %ld slots\n",
           st.dropped, st.assigned, 100.0 * st.drop_rate, 100.0 * st.padding, st.capacity);
    printf("  aux_loss %.6f  z_loss %.6f\n", p->aux_loss, p->z_loss);
}

// --- moe route --logits ---------------------------------------------------------------

// Loads task_ids I32 [T] from f and checks every id is >= 0.
static int load_task_ids(moe_st_file *f, int64_t T, int **out) {
    int64_t shape[1];
    MOE_TRY(moe_st_load(f, "task_ids", MOE_ST_I32, 1, shape, (void **)out));
    if (shape[0] != T) {
        free(*out);
        *out = NULL;
        return moe_fail(MOE_EFORMAT,
                        "%s: tensor 'task_ids' has %lld entries, logits have %lld tokens", f->path,
                        (long long)shape[0], (long long)T);
    }
    for (int64_t t = 0; t < T; t++)
        if ((*out)[t] < 0) {
            int bad = (*out)[t];
            free(*out);
            *out = NULL;
            return moe_fail(MOE_EFORMAT, "%s: task_ids[%lld] = %d, expected a task id >= 0",
                            f->path, (long long)t, bad);
        }
    return 0;
}

// Loads bias F32 [E] from f: one finite number per expert.
static int load_bias(moe_st_file *f, int E, float **out) {
    int64_t shape[1];
    MOE_TRY(moe_st_load(f, "bias", MOE_ST_F32, 1, shape, (void **)out));
    int bad = -1;
    for (int e = 0; shape[0] == E && e < E && bad < 0; e++)
        if (!isfinite((*out)[e])) bad = e;
    int rc = 0;
    if (shape[0] != E)
        rc = moe_fail(MOE_EFORMAT,
                      "%s: tensor 'bias' has %lld entries, logits have %d experts (one bias "
                      "per expert)",
                      f->path, (long long)shape[0], E);
    else if (bad >= 0)
        rc = moe_fail(MOE_EFORMAT, "%s: bias[%d] is %g, expected a finite number", f->path, bad,
                      (*out)[bad]);
    if (rc < 0) {
        free(*out);
        *out = NULL;
    }
    return rc;
}

static int route_file(const route_args *a) {
    int ex = MOE_EXIT_USAGE, rc;
    moe_st_file *lf = NULL, *tf = NULL;
    float *logits = NULL, *bias = NULL;
    int *task = NULL;
    moe_plan plan = {0};
    moe_router_config cfg = a->cfg;
    int64_t shape[2];

    if ((rc = moe_st_open(a->logits_path, &lf)) < 0) goto fail;
    if ((rc = moe_st_load(lf, "logits", MOE_ST_F32, 2, shape, (void **)&logits)) < 0) goto fail;
    if (shape[0] < 1 || shape[1] < 1 || shape[0] > INT32_MAX || shape[1] > INT32_MAX) {
        rc = moe_fail(MOE_EFORMAT,
                      "%s: logits are [%lld, %lld], expected T >= 1 tokens and E >= 1 experts",
                      a->logits_path, (long long)shape[0], (long long)shape[1]);
        goto fail;
    }
    if (shape[1] > MOE_MAX_EXPERTS) {
        rc = moe_fail(MOE_EFORMAT,
                      "%s: tensor 'logits' is [%lld, %lld]: %lld experts exceed the limit of %d "
                      "(moe.num_experts <= %d)",
                      a->logits_path, (long long)shape[0], (long long)shape[1], (long long)shape[1],
                      MOE_MAX_EXPERTS, MOE_MAX_EXPERTS);
        goto fail;
    }
    int T = (int)shape[0], E = (int)shape[1];
    if ((rc = moe_router_config_check(&cfg, E)) < 0) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", moe_last_error());
        rc = moe_fail(rc, "%s (logits in %s are [%d, %d])", msg, a->logits_path, T, E);
        goto fail;
    }
    if (a->task_path) {
        if ((rc = moe_st_open(a->task_path, &tf)) < 0) goto fail;
        if ((rc = load_task_ids(tf, T, &task)) < 0) goto fail;
    } else if (moe_st_find(lf, "task_ids")) {
        if ((rc = load_task_ids(lf, T, &task)) < 0) goto fail;
    }
    if (moe_st_find(lf, "bias") && (rc = load_bias(lf, E, &bias)) < 0) goto fail;
    if (bias && cfg.type == MOE_ROUTER_EXPERT_CHOICE) {
        rc = moe_fail(MOE_EFORMAT,
                      "%s: tensor 'bias' is a token-choice selection bias; under "
                      "router.type = expert_choice experts pick tokens by the unbiased scores, "
                      "so it would change nothing (remove it, or route token_choice)",
                      a->logits_path);
        goto fail;
    }
    // Task priorities take effect only under priority order; there every
    // token needs a task id with an entry.
    if (cfg.slot_order == MOE_SLOT_PRIORITY && cfg.n_task_priority > 0) {
        const char *src = a->task_path ? a->task_path : a->logits_path;
        if (!task) {
            rc = moe_fail(MOE_EFORMAT,
                          "router.task_priority is set but %s has no 'task_ids' I32 [T] "
                          "(add it, or pass --task-ids FILE)",
                          a->logits_path);
            goto fail;
        }
        for (int t = 0; t < T; t++)
            if (task[t] >= cfg.n_task_priority) {
                rc = moe_fail(MOE_EFORMAT,
                              "%s: task_ids[%d] = %d but router.task_priority lists %d tasks", src,
                              t, task[t], cfg.n_task_priority);
                goto fail;
            }
    }
    for (int t = 0; t < T; t++)
        for (int e = 0; e < E; e++)
            if (!isfinite(logits[(size_t)t * E + e])) {
                rc = moe_fail(MOE_ENUMERIC,
                              "%s: logits[%d, %d] (token %d, expert %d) is %g: the router needs "
                              "finite logits",
                              a->logits_path, t, e, t, e, logits[(size_t)t * E + e]);
                goto fail;
            }
    // Here the logits are the router input, so jitter (Switch: x * U(1-eps, 1+eps)
    // on the router input) applies to them; the loaded buffer is our own copy.
    if (a->train && cfg.noise == MOE_NOISE_JITTER)
        moe_router_jitter(logits, (size_t)T * E, cfg.noise_eps, cfg.seed, a->step);

    if ((rc = moe_plan_alloc(&plan, T, E, moe_router_plan_k(&cfg, E))) < 0) goto fail;
    plan.bias = bias;
    if ((rc = moe_router_forward(&plan, logits, task, NULL, T, E, &cfg, a->train, a->step)) < 0)
        goto fail;
    if ((rc = check_losses(&plan, logits, (size_t)T * E, a->logits_path,
                           a->train && cfg.noise == MOE_NOISE_JITTER)) < 0)
        goto fail;
    note_ignored(a);       // the input is accepted: the route goes on
    ex = MOE_EXIT_RUNTIME; // from here on, failures are not the input's fault
    if ((rc = write_plan(a->out_path, &plan, &cfg, a->train, a->step)) < 0) goto fail;
    if (bias_used(&plan))
        printf("selection bias: 'bias' of %s added to the scores for the choice\n", a->logits_path);
    else if (bias)
        printf("selection bias: 'bias' of %s is all zeros, which routes as no bias\n",
               a->logits_path);
    print_summary(&plan, &cfg);
    printf("wrote %s\n", a->out_path);
    ex = MOE_EXIT_OK;
fail:
    if (ex != MOE_EXIT_OK) {
        if (ex == MOE_EXIT_USAGE) ex = input_exit(rc);
        fail_last(ex);
    }
    moe_plan_free(&plan);
    free(task);
    free(bias);
    free(logits);
    moe_st_close(tf);
    moe_st_close(lf);
    return ex;
}

// --- moe route --example ---------------------------------------------------------------

enum { EX_T = 16, EX_E = 4, EX_K = 2 };

// Deterministic example logits: a per-expert bias that overloads expert 0,
// plus hashed integer noise in [-1, 1) (no libm, so every machine prints the
// same plan). Tokens 0..7 belong to task 0, tokens 8..15 to task 1.
static void example_batch(float *logits, int *task) {
    static const float bias[EX_E] = {1.0f, 0.2f, 0.0f, -0.2f};
    uint32_t h = 2024;
    for (int t = 0; t < EX_T; t++) {
        task[t] = t < EX_T / 2 ? 0 : 1;
        for (int e = 0; e < EX_E; e++) {
            h = h * 1664525u + 1013904223u; // Numerical Recipes LCG
            float u = (float)(h >> 8) / 16777216.0f;
            logits[t * EX_E + e] = bias[e] + 2.0f * u - 1.0f;
        }
    }
}

// Per token whose assignments differ in any run: its choices and, per order,
// which of them were kept.
static void print_drop_table(const int *choice, const int *const *expert, const int *task) {
    printf("\nassignments dropped under position vs priority order (capacity_factor 1):\n");
    printf("  token  task  choices    position      priority\n");
    for (int t = 0; t < EX_T; t++) {
        const int *c = choice + t * EX_K;
        bool any = false;
        for (int r = 0; r < 2; r++)
            for (int j = 0; j < EX_K; j++)
                any |= expert[r][t * EX_K + j] < 0;
        if (!any) continue;
        printf("  %5d  %4d  e%d e%d  ", t, task[t], c[0], c[1]);
        for (int r = 0; r < 2; r++)
            for (int j = 0; j < EX_K; j++)
                printf("%s%s", j ? "  " : "    ", expert[r][t * EX_K + j] < 0 ? "DROP" : "kept");
        printf("\n");
    }
}

// One batch, three runs: position and priority with capacity factor 1 (tight:
// some assignments drop), then dropless. The user's --set keys apply first;
// each run then fixes k, task priorities, order and factor.
static const struct {
    const char *title, *order, *factor;
} example_runs[] = {
    {"position order, capacity_factor 1", "position", "1"},
    {"priority order (Batch Prioritized Routing), capacity_factor 1", "priority", "1"},
    {"dropless (capacity_factor 0), position order", "position", "0"},
};

static int example_cfg(const route_args *a, int r, moe_router_config *cfg) {
    *cfg = a->cfg;
    char k[16];
    snprintf(k, sizeof k, "%d", EX_K);
    MOE_TRY(moe_router_config_set(cfg, "router.top_k", k));
    // Task priorities only under priority order: position order never reads
    // them, and the router's check refuses them there.
    const bool priority = !strcmp(example_runs[r].order, "priority");
    MOE_TRY(moe_router_config_set(cfg, "router.task_priority", priority ? "1,2" : "[]"));
    MOE_TRY(moe_router_config_set(cfg, "router.slot_order", example_runs[r].order));
    MOE_TRY(moe_router_config_set(cfg, "router.capacity_factor", example_runs[r].factor));
    return moe_router_config_check(cfg, EX_E);
}

static int route_example(const route_args *a) {
    float logits[EX_T * EX_E];
    int task[EX_T], choice[EX_T * EX_K], kept[2][EX_T * EX_K];
    example_batch(logits, task);
    moe_plan plan = {0};
    int ex = MOE_EXIT_OK;
    moe_router_config cfg;
    // Every run's config is checked before anything is printed: a refused
    // key is the only line, with no note before it.
    for (int r = 0; r < 3; r++) {
        int rc = example_cfg(a, r, &cfg);
        if (rc < 0) return fail_last(input_exit(rc));
    }
    note_ignored(a);

    printf("example: T=%d tokens, E=%d experts, k=%d; tokens 0-%d are task 0, %d-%d task 1;\n"
           "router.task_priority = 1,2 (priority order serves task 1 first)\n",
           EX_T, EX_E, EX_K, EX_T / 2 - 1, EX_T / 2, EX_T - 1);
    printf("  token  task  logits of experts 0..%d\n", EX_E - 1);
    for (int t = 0; t < EX_T; t++) {
        printf("  %5d  %4d ", t, task[t]);
        for (int e = 0; e < EX_E; e++)
            printf(" %6.3f", logits[t * EX_E + e]);
        printf("\n");
    }

    for (int r = 0; r < 3; r++) {
        int rc = example_cfg(a, r, &cfg);
        if (rc == 0) rc = moe_plan_alloc(&plan, EX_T, EX_E, EX_K);
        if (rc == 0)
            rc = moe_router_forward(&plan, logits, task, NULL, EX_T, EX_E, &cfg, a->train, a->step);
        if (rc < 0) {
            ex = fail_last(input_exit(rc));
            goto done;
        }
        printf("\n== %s\n", example_runs[r].title);
        print_summary(&plan, &cfg);
        if (r < 2) memcpy(kept[r], plan.expert, sizeof kept[r]);
        if (r == 0) memcpy(choice, plan.choice, sizeof choice);
        if (r == 0 && a->out_path) {
            if (write_plan(a->out_path, &plan, &cfg, a->train, a->step) < 0) {
                ex = fail_last(MOE_EXIT_RUNTIME);
                goto done;
            }
            printf("  wrote %s\n", a->out_path);
        }
        moe_plan_free(&plan);
    }
    const int *experts[2] = {kept[0], kept[1]};
    print_drop_table(choice, experts, task);
    printf("\nPosition order hands out slots in token order, so the last tokens (task 1)\n"
           "lose even their first choice. Priority order serves task 1 first, then the\n"
           "most confident tokens, so task 0 loses first choices instead. Dropless sizes\n"
           "every expert to its load: nothing drops, at the cost of padding.\n");
done:
    moe_plan_free(&plan);
    return ex;
}

int moe_cli_route(int argc, char **argv) {
    route_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc != 0) return rc;
    if (a.help) {
        fputs(route_help, stdout);
        return MOE_EXIT_OK;
    }
    if ((rc = check_out(&a)) != 0) return rc;
    return a.example ? route_example(&a) : route_file(&a);
}
