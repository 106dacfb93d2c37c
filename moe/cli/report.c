// `moe report RUN_DIR [--out FILE] [--csv DIR]`: the run's metrics.jsonl as one
// self-contained HTML page of charts, and optionally one CSV per series.
#include "moe/report.h"
#include "moe/cli/cli.h"
#include "moe/error.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

static const char *help =
    "usage: moe report RUN_DIR [--out FILE] [--csv DIR]\n"
    "\n"
    "Writes one self-contained HTML page (inline SVG, nothing fetched) from the run\n"
    "folder's metrics.jsonl and config.json: loss, validation loss, lr, gradient norm,\n"
    "tokens/s; per MoE layer the share of tokens per expert over steps, the capacity\n"
    "per expert and the drop rate; per-task validation loss and accuracy; the task x\n"
    "expert usage of each layer; all-to-all bytes and time (distributed runs); the\n"
    "resolved config.\n"
    "\n"
    "  --out FILE   the page (default RUN_DIR/report.html)\n"
    "  --csv DIR    also one CSV per series (first column: step)\n"
    "\n"
    "Each file is written to a temp name and renamed into place (a failed write\n"
    "keeps the earlier one); an existing file that moe report did not write (the\n"
    "run's metrics.jsonl, a checkpoint, a folder) is refused, never overwritten.\n";

int moe_cli_report(int argc, char **argv) {
    const char *run = NULL, *out = NULL, *csv = NULL;
    for (int i = 1; i < argc; i++) {
        int m;
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(help, stdout);
            return MOE_EXIT_OK;
        } else if ((m = moe_cli_opt_path(argc, argv, &i, "--out", &out)) != 0 ||
                   (m = moe_cli_opt_path(argc, argv, &i, "--csv", &csv)) != 0) {
            if (m < 0) return moe_cli_fail("report", MOE_EXIT_USAGE, "%s", moe_last_error());
        } else if (argv[i][0] == '-') {
            return moe_cli_unknown_option("report", argv[i], help);
        } else if (!run) {
            run = argv[i];
        } else {
            return moe_cli_fail("report", MOE_EXIT_USAGE, "more than one run folder ('%s', '%s')",
                                run, argv[i]);
        }
    }
    if (!run) return moe_cli_fail("report", MOE_EXIT_USAGE, "no run folder (see --help)");
    char def[PATH_MAX];
    if (!out) {
        snprintf(def, sizeof def, "%s/report.html", run);
        out = def;
    }
    moe_run_metrics m;
    int rc = moe_metrics_read(run, &m);
    if (rc < 0) return moe_cli_fail("report", moe_cli_input_exit_code(rc), "%s", moe_last_error());
    const char *warn[3] = {m.warning, m.bad_values, m.no_step};
    for (int i = 0; i < 3; i++)
        if (warn[i][0]) fprintf(stderr, "moe report: warning: %s\n", warn[i]);
    if (m.superseded[0]) fprintf(stderr, "moe report: note: %s\n", m.superseded);
    char clash[128] = "";
    rc = csv ? moe_report_csv_collision(&m, csv, out, clash, sizeof clash) : 0;
    if (rc > 0) {
        moe_metrics_free(&m);
        return moe_cli_fail("report", MOE_EXIT_USAGE,
                            "--out %s is also the CSV %s.csv that --csv %s would write: choose "
                            "another --out or --csv",
                            out, clash, csv);
    }
    if (rc == 0) rc = csv ? moe_report_csv_check(&m, csv) : 0; // a refusal writes no page either
    if (rc == 0) rc = moe_report_html(&m, run, out);
    int n_csv = 0;
    char renamed[1024] = "";
    if (rc == 0 && csv) rc = moe_report_csv(&m, csv, &n_csv, renamed, sizeof renamed);
    moe_metrics_free(&m);
    if (renamed[0])
        fprintf(stderr, "moe report: note: CSV names taken by an earlier series: %s\n", renamed);
    if (rc < 0) return moe_cli_fail("report", moe_cli_exit_code(rc), "%s", moe_last_error());
    printf("report: %s\n", out);
    if (csv) printf("csv: %d files in %s\n", n_csv, csv);
    return MOE_EXIT_OK;
}
