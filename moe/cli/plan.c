// `moe plan CONFIG [--nodes N] [--ranks-per-node G] [--set k=v]... [--link-gbps a,b]
// [--latency-us a,b] [--skew F | --load w0,w1,...]`
#include "moe/plan.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: moe plan CONFIG.json [--nodes N] [--ranks-per-node G] [--set key=value]...\n"
    "                [--link-gbps INTRA,INTER] [--latency-us INTRA,INTER]\n"
    "                [--skew F | --load W0,W1,...]\n"
    "\n"
    "Prints, for a run of CONFIG on N nodes of G ranks (default: parallel.ep ranks, in\n"
    "nodes of comm.ranks_per_node when set, else on one node): the memory of one rank\n"
    "(parameters, gradients, optimizer, activations, MoE buffers, step buffers, data;\n"
    "the predicted peak of the library's allocations), and the all-to-all bytes,\n"
    "messages and alpha-beta time per step for\n"
    "flat and hierarchical exchange. Links default to 400,100 Gb/s and 2,5 us.\n"
    "With --skew F (expert 0 takes the share F of the assignments, the rest evenly),\n"
    "--load (one weight per expert), or placement.mode = replicate or move: the tokens each\n"
    "rank of the EP group computes with the static placement and with replicas of\n"
    "the hot experts in placement.slots_per_rank slots (move: homes swapped first),\n"
    "max/mean and bytes. A refused plan prints nothing (exit 2).\n";

// "A,B": two numbers in (0, 1e12].
static int pair(const char *v, double *out) {
    const char *comma = strchr(v, ',');
    if (!comma || (size_t)(comma - v) >= 64) return -1;
    char first[64];
    memcpy(first, v, (size_t)(comma - v));
    first[comma - v] = '\0';
    return moe_cli_parse_double(first, 0, 1e12, true, &out[0]) &&
                   moe_cli_parse_double(comma + 1, 0, 1e12, true, &out[1])
               ? 0
               : -1;
}

// A library failure as one line: its messages start "plan: ", which
// moe_cli_fail's "moe plan: " already says.
static int plan_fail(void) {
    const char *msg = moe_last_error();
    return moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", msg + (strncmp(msg, "plan: ", 6) ? 0 : 6));
}

int moe_cli_plan(int argc, char **argv) {
    const char *config = NULL, *nodes_s = NULL, *rpn_s = NULL, *gbps_s = NULL, *lat_s = NULL;
    const char *skew_s = NULL, *load_s = NULL;
    double skew = 0, load[1024];
    int n_load = 0;
    const char **sets = malloc(sizeof *sets * (size_t)argc); // one per argument at most
    int n_sets = 0, code = MOE_EXIT_OK;
    long long nodes = 0, rpn = 0;
    moe_machine mc = {0, 0, 0, {400, 100}, {2, 5}};
    if (!sets) return moe_cli_fail("plan", MOE_EXIT_RUNTIME, "out of memory");
    for (int i = 1; i < argc && code == MOE_EXIT_OK; i++) {
        const char *v;
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            free(sets);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--nodes", &nodes_s)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (!moe_cli_parse_long(nodes_s, 1, 1 << 20, &nodes))
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "--nodes needs an integer in [1, %d]",
                                    1 << 20);
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--ranks-per-node", &rpn_s)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (!moe_cli_parse_long(rpn_s, 1, 1 << 20, &rpn))
                code = moe_cli_fail("plan", MOE_EXIT_USAGE,
                                    "--ranks-per-node needs an integer in [1, %d]", 1 << 20);
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--link-gbps", &gbps_s)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (pair(gbps_s, mc.gbps))
                code = moe_cli_fail("plan", MOE_EXIT_USAGE,
                                    "--link-gbps needs INTRA,INTER, numbers in (0, 1e12]");
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--latency-us", &lat_s)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (pair(lat_s, mc.latency_us))
                code = moe_cli_fail("plan", MOE_EXIT_USAGE,
                                    "--latency-us needs INTRA,INTER, numbers in (0, 1e12]");
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--skew", &skew_s)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
            else if (!moe_cli_parse_double(skew_s, 0, 1, false, &skew) || skew >= 1)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE,
                                    "--skew needs a share of the assignments in [0, 1)");
        } else if ((m = moe_cli_opt_once(argc, argv, &i, "--load", &load_s)) != 0) {
            for (const char *q = m < 0 ? NULL : load_s; q && code == MOE_EXIT_OK;) {
                char item[64];
                size_t len = strcspn(q, ",");
                snprintf(item, sizeof item, "%.*s", (int)(len < 63 ? len : 63), q);
                if (n_load == 1024 || len == 0 || len > 63 ||
                    !moe_cli_parse_double(item, 0, 1e300, false, &load[n_load++]))
                    code = moe_cli_fail("plan", MOE_EXIT_USAGE,
                                        "--load needs up to 1024 weights >= 0 separated by commas "
                                        "('%s')",
                                        load_s);
                q = q[len] ? q + len + 1 : NULL;
            }
            if (m < 0) code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0)
                code = moe_cli_fail("plan", MOE_EXIT_USAGE, "--set needs key=value");
            else
                sets[n_sets++] = v;
        } else if (argv[i][0] == '-') {
            code = moe_cli_unknown_option("plan", argv[i], help);
        } else if (!config) {
            config = argv[i];
        } else {
            code = moe_cli_fail("plan", MOE_EXIT_USAGE, "more than one config file ('%s', '%s')",
                                config, argv[i]);
        }
    }
    if (code == MOE_EXIT_OK && !config)
        code = moe_cli_fail("plan", MOE_EXIT_USAGE, "no config file (see --help)");
    moe_config cfg;
    if (code == MOE_EXIT_OK && moe_cli_load_config(&cfg, config, sets, n_sets) < 0)
        code = moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
    free(sets);
    if (code != MOE_EXIT_OK) return code;
    if (moe_plan_machine(&cfg, nodes_s ? (int)nodes : 0, (int)rpn, &mc) < 0) return plan_fail();
    if (skew_s && load_s)
        return moe_cli_fail("plan", MOE_EXIT_USAGE, "--skew and --load: give one of them");
    int E = 0;
    for (int l = 0; l < cfg.model.n_layers && !E; l++)
        E = moe_config_experts(&cfg, l);
    if (load_s && n_load != E)
        return moe_cli_fail("plan", MOE_EXIT_USAGE, "--load has %d weights for %d experts", n_load,
                            E);
    double sum = 0;
    for (int e = 0; e < n_load; e++)
        sum += load[e];
    if (load_s && !(sum > 0)) // whatever parallel.ep: a load of nothing models nothing
        return moe_cli_fail("plan", MOE_EXIT_USAGE,
                            "--load: the weights sum to 0; give some expert a weight > 0");
    // Everything is checked before the first line: a refused plan prints nothing.
    const bool placement = (skew_s || load_s || strcmp(cfg.placement.mode, "static")) && E;
    moe_mem_plan mp;
    if (moe_plan_memory(&cfg, mc.world, 0, &mp) < 0) return plan_fail();
    if (placement && cfg.parallel.ep > 1) {
        moe_place_plan pp = {0};
        if (moe_plan_placement(&cfg, skew, load_s ? load : NULL, &pp) < 0) return plan_fail();
    }
    if (moe_plan_print(&cfg, &mc, stdout) < 0) return plan_fail();
    if (placement && moe_plan_placement_print(&cfg, skew, load_s ? load : NULL, stdout) < 0)
        return plan_fail();
    return MOE_EXIT_OK;
}
