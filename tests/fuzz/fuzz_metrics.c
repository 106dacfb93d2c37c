// libFuzzer target: a run folder's metrics.jsonl (moe report). The input
// replaces the file; a file that reads must give a page and CSVs that write,
// with every series' steps ascending (resumed steps replace earlier rows).
#include "fuzz_util.h"
#include "moe/report.h"

#include <stdbool.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fuzz_write(fuzz_path("metrics.jsonl"), data, size);
    moe_run_metrics m;
    if (moe_metrics_read(fuzz_dir(), &m) < 0) return 0;
    for (int i = 0; i < m.n; i++)
        for (long r = 1; r < m.s[i].n; r++)
            if (!(m.s[i].step[r - 1] < m.s[i].step[r])) abort();
    int n;
    if (moe_report_html(&m, fuzz_dir(), fuzz_path("report.html")) < 0 ||
        moe_report_csv(&m, fuzz_path("csv"), &n, NULL, 0) < 0)
        abort();
    moe_metrics_free(&m);
    return 0;
}
