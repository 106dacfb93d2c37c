// `moe plan CONFIG [--nodes N] [--ranks-per-node G] [--set k=v]... [--link-gbps a,b]
// [--latency-us a,b]`
#include "moe/plan.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: moe plan CONFIG.json [--nodes N] [--ranks-per-node G] [--set key=value]...\n"
    "                [--link-gbps INTRA,INTER] [--latency-us INTRA,INTER]\n"
    "\n"
    "Prints, for a run of CONFIG on N nodes of G ranks (default 1 node of parallel.ep\n"
    "ranks): the memory of one rank (parameters, gradients, optimizer, activations,\n"
    "MoE buffers, step buffers, data; the predicted peak of the library's\n"
    "allocations), and the all-to-all bytes, messages and alpha-beta time per step for\n"
    "flat and hierarchical exchange. Links default to 400,100 Gb/s and 2,5 us.\n";

static int pair(const char *v, double *out) {
    char *end;
    out[0] = strtod(v, &end);
    if (*end != ',') return -1;
    out[1] = strtod(end + 1, &end);
    return *end || out[0] <= 0 || out[1] <= 0 ? -1 : 0;
}

int moe_cli_plan(int argc, char **argv) {
    const char *config = NULL, *sets[64];
    int n_sets = 0;
    long long nodes = 1, rpn = 0;
    moe_machine mc = {0, 0, 0, {400, 100}, {2, 5}};
    for (int i = 1; i < argc; i++) {
        const char *v;
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--nodes", &v)) != 0) {
            if (m < 0 || !moe_cli_parse_long(v, 1, 1 << 20, &nodes))
                return moe_cli_fail("plan", MOE_EXIT_USAGE, "--nodes needs a positive integer");
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--ranks-per-node", &v)) != 0) {
            if (m < 0 || !moe_cli_parse_long(v, 1, 1 << 20, &rpn))
                return moe_cli_fail("plan", MOE_EXIT_USAGE,
                                    "--ranks-per-node needs a positive integer");
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--link-gbps", &v)) != 0) {
            if (m < 0 || pair(v, mc.gbps))
                return moe_cli_fail("plan", MOE_EXIT_USAGE, "--link-gbps needs INTRA,INTER > 0");
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--latency-us", &v)) != 0) {
            if (m < 0 || pair(v, mc.latency_us))
                return moe_cli_fail("plan", MOE_EXIT_USAGE, "--latency-us needs INTRA,INTER > 0");
        } else if ((m = moe_cli_opt_value(argc, argv, &i, "--set", &v)) != 0) {
            if (m < 0 || n_sets == 64)
                return moe_cli_fail("plan", MOE_EXIT_USAGE, "--set needs key=value");
            sets[n_sets++] = v;
        } else if (argv[i][0] == '-') {
            return moe_cli_fail("plan", MOE_EXIT_USAGE, "unknown option '%s'", argv[i]);
        } else {
            config = argv[i];
        }
    }
    if (!config) return moe_cli_fail("plan", MOE_EXIT_USAGE, "no config file (see --help)");
    moe_config cfg;
    int rc = moe_cli_load_config(&cfg, config, sets, n_sets);
    if (rc < 0) return moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
    mc.nodes = (int)nodes;
    mc.ranks_per_node = rpn ? (int)rpn : cfg.parallel.ep;
    mc.world = mc.nodes * mc.ranks_per_node;
    if ((rc = moe_plan_print(&cfg, &mc, stdout)) < 0)
        return moe_cli_fail("plan", MOE_EXIT_USAGE, "%s", moe_last_error());
    return MOE_EXIT_OK;
}
