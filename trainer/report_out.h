// Output files of moe report (the HTML pages and the CSVs): built in memory,
// then put in place all or nothing, and never over a file that is not one of
// ours (the run's own metrics.jsonl, config.json or checkpoints above all).
#ifndef MOE_REPORT_OUT_H
#define MOE_REPORT_OUT_H

#include <stdio.h>

// The run page of moe report, the comparison page of moe ablate, a CSV. Each
// kind replaces only an earlier file of its own kind: moe report --out
// ABL/report.html must not destroy an ablation's page.
typedef enum { REPORT_OUT_HTML, REPORT_OUT_ABLATE_HTML, REPORT_OUT_CSV } report_out_kind;

// The first bytes of every page moe report and moe ablate write, then the
// rest of the <title>: REPORT_HTML_RUN or REPORT_HTML_ABLATE. What tells an
// earlier page of the same kind (replaced) from any other file (refused).
#define REPORT_HTML_MAGIC                                                                          \
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/><title>moe "
#define REPORT_HTML_RUN "run report</title>"
#define REPORT_HTML_ABLATE "ablation report</title>"

// An in-memory stream for one output file.
typedef struct {
    FILE *f;
    char *buf;
    size_t len;
} report_out;

int report_out_open(report_out *o, const char *path);
// 0 when path may receive an output of this kind; MOE_EINVAL naming path when
// it exists and is not a regular file, is one of run_dir's inputs
// (metrics.jsonl, config.json; run_dir may be NULL) or holds something other
// than a report of this kind (an empty file may be replaced). For callers
// that check every target before writing the first.
int report_out_check(const char *path, report_out_kind kind, const char *run_dir);
// report_out_check, then closes the stream and replaces path with its bytes
// (moe_fs_replace_file). The stream is freed either way.
int report_out_commit(report_out *o, const char *path, report_out_kind kind, const char *run_dir);
// Frees the stream without writing (an error came first).
void report_out_discard(report_out *o);

#endif
