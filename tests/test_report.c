// The run report: a short CLI training turned into an HTML page that is well
// formed, has one chart per promised figure with one point per logged step;
// CSVs with a row per step; malformed metrics refused with the line number, a
// truncated last line tolerated, input strings escaped, unknown fields kept.
#include "moe/ablate.h"
#include "moe/error.h"
#include "moe/fsio.h"
#include "moe/report.h"
#include "moe/shards.h"
#include "moe/tensorboard.h"
#include "testutil.h"
#include "trainer/report_svg.h"

#include <ctype.h>
#include <dirent.h>
#include <float.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[600];

static const char *in_dir(const char *name) {
    static char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return p;
}

static void write_file(const char *name, const char *text) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

// The whole file (the pages are larger than tu_file_text's buffer); free it.
static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    ck_assert_msg(f != NULL, "%s missing", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc(n + 1);
    ck_assert_int_eq((long)fread(s, 1, n, f), n);
    s[n] = 0;
    fclose(f);
    return s;
}

// An XML-ish walk of the page: every tag closed in order (or self-closed),
// attribute values quoted, '<' never in text, '&' only as an entity. Returns
// NULL or what is wrong.
static const char *well_formed(const char *s) {
    static char err[256];
    const char *stack[512];
    size_t len[512];
    int depth = 0, roots = 0;
    const char *p = s;
    while (*p) {
        if (*p == '&') {
            const char *ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&#39;"};
            int ok = 0;
            for (int i = 0; i < 5; i++)
                ok |= !strncmp(p, ents[i], strlen(ents[i]));
            if (!ok) return snprintf(err, sizeof err, "bare & at %ld", (long)(p - s)), err;
            p++;
            continue;
        }
        if (*p != '<') {
            p++;
            continue;
        }
        if (!strncmp(p, "<!DOCTYPE", 9)) {
            p = strchr(p, '>') + 1;
            continue;
        }
        bool closing = p[1] == '/';
        const char *n = p + 1 + closing, *e = n;
        while (isalnum((unsigned char)*e))
            e++;
        if (e == n) return snprintf(err, sizeof err, "'<' in text at %ld", (long)(p - s)), err;
        const char *q = e;
        while (*q && *q != '>' && !(q[0] == '/' && q[1] == '>')) { // attributes
            if (*q == '"') {
                const char *end = strchr(q + 1, '"');
                if (!end) return "unterminated attribute";
                if (memchr(q + 1, '<', end - q - 1)) return "'<' in an attribute";
                q = end + 1;
            } else if (*q == '=' && q[1] != '"') {
                return "unquoted attribute";
            } else {
                q++;
            }
        }
        if (!*q) return "unterminated tag";
        bool self = *q == '/';
        if (closing) {
            if (!depth || len[depth - 1] != (size_t)(e - n) || strncmp(stack[depth - 1], n, e - n))
                return snprintf(err, sizeof err, "</%.*s> at %ld closes <%.*s>", (int)(e - n), n,
                                (long)(p - s), depth ? (int)len[depth - 1] : 0,
                                depth ? stack[depth - 1] : ""),
                       err;
            depth--;
        } else if (!self) {
            if (depth == 512) return "too deep";
            if (!depth) roots++;
            stack[depth] = n, len[depth++] = e - n;
        }
        p = q + 1 + self;
    }
    if (depth) return snprintf(err, sizeof err, "<%.*s> never closed", (int)len[0], stack[0]), err;
    return roots == 1 ? NULL : "not one root element";
}

// The nth <svg> whose data-figure is fig (and data-layer layer, unless -1):
// a copy of its text up to </svg>, or NULL.
static char *figure(const char *html, const char *fig, int layer, int nth) {
    char key[128];
    snprintf(key, sizeof key, "data-figure=\"%s\"", fig);
    for (const char *p = html; (p = strstr(p, key)); p++) {
        char lk[32];
        snprintf(lk, sizeof lk, "data-layer=\"%d\"", layer);
        const char *end = strstr(p, "</svg>"), *tag_end = strchr(p, '>');
        if (layer >= 0 && !(strstr(p, lk) && strstr(p, lk) < tag_end)) continue;
        if (nth-- > 0) continue;
        return strndup(p, end - p);
    }
    return NULL;
}

static int count(const char *s, const char *needle) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

static int n_figures(const char *html, const char *fig) {
    char key[128];
    snprintf(key, sizeof key, "<svg xmlns=\"http://www.w3.org/2000/svg\" data-figure=\"%s\"", fig);
    return count(html, key);
}

// Points of the line data-series="series" in the figure's text; -1 if absent.
static int points(const char *svg, const char *series) {
    char key[128];
    snprintf(key, sizeof key, "data-series=\"%s\"", series);
    const char *p = svg ? strstr(svg, key) : NULL;
    if (!p) return -1;
    p = strstr(p, "points=\"") + 8;
    int n = 0;
    for (; *p != '"'; p++)
        n += *p == ',';
    return n;
}

static int lines_of(const char *path) {
    char *s = slurp(path);
    int n = count(s, "\n");
    free(s);
    return n;
}

// 12 steps, evaluations at 4 and 8 and the final one at 12; dynamic capacity.
static const char *cfg_json =
    "{\"model\": {\"d_model\": 32, \"n_layers\": 2, \"d_ff\": 48, \"seq_len\": 32},\n"
    " \"moe\": {\"num_experts\": 4}, \"capacity\": {\"mode\": \"dynamic\"},\n"
    " \"train\": {\"batch_size\": 4, \"steps\": 12, \"warmup_steps\": 2, \"eval_every\": 4}}\n";
static const char *tasks[5] = {"copy", "reverse", "sort", "add", "caesar"}; // the default

static void train_run(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    write_file("cfg.json", cfg_json);
    char args[2048];
    snprintf(args, sizeof args, "train '%s/cfg.json' --quiet --out '%s/run'", dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
}

START_TEST(test_report_has_one_chart_per_figure_with_a_point_per_step) {
    train_run();
    char args[2048], p[800];
    snprintf(args, sizeof args, "report '%s/run'", dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(p, sizeof p, "%s/run/report.html", dir);
    char *html = slurp(p);
    const char *bad = well_formed(html);
    ck_assert_msg(bad == NULL, "%s", bad);
    ck_assert_ptr_null(strstr(html, "<script"));
    // nothing fetched: the only address is the SVG namespace
    ck_assert_int_eq(count(html, "http"), count(html, "xmlns=\"http://www.w3.org/2000/svg\""));
    ck_assert_ptr_null(strstr(html, "src="));
    ck_assert_ptr_null(strstr(html, "href="));
    const char *once[] = {"loss",      "lr",        "grad_norm",    "tokens_per_s",
                          "drop_rate", "task_loss", "task_accuracy"};
    for (int i = 0; i < 7; i++)
        ck_assert_msg(n_figures(html, once[i]) == 1, "%s: %d", once[i], n_figures(html, once[i]));
    const char *per_layer[] = {"load", "capacity", "task_experts"};
    for (int i = 0; i < 3; i++)
        ck_assert_msg(n_figures(html, per_layer[i]) == 2, "%s", per_layer[i]);
    ck_assert_int_eq(n_figures(html, "a2a_bytes"), 0); // one process: no all-to-all
    char *svg = figure(html, "loss", -1, 0);
    ck_assert_int_eq(points(svg, "training"), 12);
    ck_assert_int_eq(points(svg, "validation"), 3);
    free(svg);
    svg = figure(html, "lr", -1, 0);
    ck_assert_int_eq(points(svg, "lr"), 12);
    free(svg);
    svg = figure(html, "drop_rate", -1, 0);
    ck_assert_int_eq(points(svg, "all layers"), 12);
    ck_assert_int_eq(points(svg, "layer 1"), 12);
    free(svg);
    for (int t = 0; t < 5; t++) {
        svg = figure(html, "task_loss", -1, 0);
        ck_assert_int_eq(points(svg, tasks[t]), 3);
        free(svg);
        svg = figure(html, "task_accuracy", -1, 0);
        ck_assert_int_eq(points(svg, tasks[t]), 3);
        free(svg);
    }
    for (int l = 0; l < 2; l++) {
        svg = figure(html, "capacity", l, 0);
        for (int e = 0; e < 4; e++) {
            char name[8];
            snprintf(name, sizeof name, "e%d", e);
            ck_assert_int_eq(points(svg, name), 12);
        }
        free(svg);
        svg = figure(html, "load", l, 0);
        ck_assert_int_eq(count(svg, "class=\"cell\""), 4 * 12); // experts x steps
        free(svg);
        svg = figure(html, "task_experts", l, 0);
        ck_assert_int_eq(count(svg, "class=\"cell\""), 5 * 4); // tasks x experts
        free(svg);
    }
    ck_assert_ptr_nonnull(strstr(html, "<td>capacity.mode</td><td>dynamic</td>"));
    free(html);
}
END_TEST

START_TEST(test_report_csv_has_a_row_per_step) {
    train_run();
    char args[2048], p[800];
    snprintf(args, sizeof args, "report '%s/run' --out '%s/r.html' --csv '%s/csv'", dir, dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(p, sizeof p, "%s/csv", dir);
    ck_assert_str_eq(strtok((char *)tu_file_text(p, "loss.csv"), "\n"), "step,loss");
    snprintf(p, sizeof p, "%s/csv/loss.csv", dir);
    ck_assert_int_eq(lines_of(p), 1 + 12);
    snprintf(p, sizeof p, "%s/csv", dir);
    const char *load = tu_file_text(p, "layer1_load.csv");
    ck_assert_msg(!strncmp(load, "step,e0,e1,e2,e3\n1,", 19), "%.40s", load);
    snprintf(p, sizeof p, "%s/csv/layer1_load.csv", dir);
    ck_assert_int_eq(lines_of(p), 1 + 12);
    snprintf(p, sizeof p, "%s/csv", dir);
    const char *tl = tu_file_text(p, "eval_task_loss.csv");
    ck_assert_msg(!strncmp(tl, "step,copy,reverse,sort,add,caesar\n4,", 36), "%.60s", tl);
    snprintf(p, sizeof p, "%s/csv/eval_task_loss.csv", dir);
    ck_assert_int_eq(lines_of(p), 1 + 3);
    snprintf(p, sizeof p, "%s/csv/layer0_task_experts.csv", dir);
    ck_assert_int_eq(lines_of(p), 1 + 5);
}
END_TEST

// A hand-written record of n experts per layer with a numbered loss.
static void record(FILE *f, int step, double loss, int n_layers) {
    fprintf(f, "{\"step\": %d, \"time\": %d.5, \"loss\": %g, \"lr\": 0.001, \"layers\": [", step,
            1000 + step, loss);
    for (int l = 0; l < n_layers; l++)
        fprintf(f,
                "%s{\"layer\": %d, \"drop_rate\": 0.1, \"max_vio\": %g, \"load\": [%d, 2, 3], "
                "\"capacity\": [4, 4, 4]}",
                l ? ", " : "", l, 0.5 * l + step, step);
    fprintf(f, "], \"comm\": {\"a2a_bytes\": 0, \"a2a_s\": 0}}\n");
}

static FILE *metrics_file(void) {
    char p[800];
    snprintf(p, sizeof p, "%s/metrics.jsonl", dir);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    return f;
}

START_TEST(test_report_downsamples_long_series) {
    FILE *f = metrics_file();
    for (int s = 1; s <= 2500; s++)
        record(f, s, 5.0 - s * 1e-3, 1);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(m.n_train, 2500);
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    ck_assert_ptr_null(well_formed(html));
    char *svg = figure(html, "loss", -1, 0);
    ck_assert_int_eq(points(svg, "training"), 834); // buckets of ceil(2500 / 1000) = 3 steps
    free(svg);
    ck_assert_ptr_nonnull(strstr(html, "2500 steps drawn as 834 points, each the mean of 3 steps"));
    svg = figure(html, "load", 0, 0);
    ck_assert_int_eq(count(svg, "class=\"cell\""), 3 * 120); // 120 columns of 21 steps
    free(svg);
    free(html);
}
END_TEST

// 1000 experts: drawn as 125 rows of 8 (at most MOE_REPORT_MAX_ROWS), a row
// the summed share of its experts: all load on experts 0..7 is one row at
// 100%. (65536 experts took 30 s and a 22 MB page before.) The task x expert
// matrix likewise: 125 columns, e0-e7 at 100%.
START_TEST(test_report_heatmap_draws_ranges_of_many_experts) {
    FILE *f = metrics_file();
    for (int st = 1; st <= 2; st++) {
        fprintf(f, "{\"step\": %d, \"loss\": 1, \"layers\": [{\"layer\": 0, \"load\": [", st);
        for (int e = 0; e < 1000; e++)
            fprintf(f, "%s%d", e ? "," : "", e < 8 ? 1 : 0);
        fputs("]}]}\n", f);
    }
    fputs("{\"eval_step\": 2, \"val_loss\": 1, \"tasks\": [{\"name\": \"copy\", \"loss\": 1, "
          "\"accuracy\": null}], \"usage\": [{\"layer\": 0, \"counts\": [[",
          f);
    for (int e = 0; e < 1000; e++)
        fprintf(f, "%s%d", e ? "," : "", e < 8 ? 3 : 0);
    fputs("]]}]}\n", f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    ck_assert_ptr_null(well_formed(html));
    char *svg = figure(html, "load", 0, 0);
    ck_assert_ptr_nonnull(svg);
    ck_assert_int_eq(count(svg, "class=\"cell\""), 125 * 2);
    ck_assert_ptr_nonnull(strstr(svg, "<title>e0-e7, step 1: 100</title>"));
    ck_assert_ptr_nonnull(strstr(svg, "<title>e8-e15, step 1: 0</title>"));
    ck_assert_ptr_nonnull(
        strstr(html, "1000 experts drawn as 125 rows, each the summed share of 8."));
    free(svg);
    svg = figure(html, "task_experts", 0, 0);
    ck_assert_ptr_nonnull(svg);
    ck_assert_int_eq(count(svg, "class=\"cell\""), 125);
    ck_assert_ptr_nonnull(strstr(svg, "<title>copy, e0-e7: 100</title>"));
    ck_assert_ptr_nonnull(strstr(svg, "<title>copy, e992-e999: 0</title>"));
    ck_assert_ptr_nonnull(
        strstr(html, "1000 experts drawn as 125 columns, each the summed share of 8."));
    free(svg), free(html);
}
END_TEST

// A list longer than a series takes is skipped, the warning naming the limit;
// a step above 2^53 (a double cannot tell it from its neighbours) is refused.
START_TEST(test_report_names_the_list_and_step_limits) {
    FILE *f = metrics_file();
    fputs("{\"step\": 1, \"loss\": 1, \"x\": [", f);
    for (int i = 0; i < 65537; i++)
        fprintf(f, "%s1", i ? "," : "");
    fputs("]}\n", f);
    fclose(f);
    char args[2048];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    ck_assert_msg(strstr(tu_file_text(dir, "err.txt"), "'x' is a list longer than 65536"), "%s",
                  tu_file_text(dir, "err.txt"));
    f = metrics_file();
    fputs("{\"step\": 9223372036854775807, \"loss\": 1}\n", f);
    fclose(f);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_msg(strstr(tu_file_text(dir, "err.txt"),
                         "metrics.jsonl:1: 'step' is 9223372036854775807, above 2^53"),
                  "%s", tu_file_text(dir, "err.txt"));
}
END_TEST

START_TEST(test_report_refuses_a_malformed_line_naming_it) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    record(f, 2, 5, 1);
    fputs("{\"step\": 3, \"loss\": 4.9,, }\n", f);
    record(f, 4, 5, 1);
    fclose(f);
    moe_run_metrics m;
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "metrics.jsonl:3:"), "%s", moe_last_error());
    char args[1024];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "metrics.jsonl:3:"));
    // a record whose step is not a count is refused the same way
    f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"step\": \"two\", \"loss\": 4.9}\n", f);
    fclose(f);
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "metrics.jsonl:2: 'step'"), "%s", moe_last_error());
    // a per-expert list that changes length midway
    f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"step\": 2, \"layers\": [{\"layer\": 0, \"load\": [1, 2]}]}\n", f);
    fclose(f);
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), ":2: 'layer0.load' has 2 values, earlier lines 3"), "%s",
                  moe_last_error());
}
END_TEST

START_TEST(test_report_skips_a_truncated_last_line) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    record(f, 2, 4, 1);
    fputs("{\"step\": 3, \"loss\": 4.", f); // killed mid-write: no newline
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(m.n_train, 2);
    ck_assert_int_eq(moe_metrics_find(&m, "loss")->n, 2);
    ck_assert_ptr_nonnull(strstr(m.warning, "metrics.jsonl:3: last line cut short"));
    moe_metrics_free(&m);
    char args[1024];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "warning: "));
}
END_TEST

START_TEST(test_report_refuses_missing_folder_and_empty_metrics) {
    moe_run_metrics m;
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    char p[800];
    snprintf(p, sizeof p, "%s/nope", dir);
    ck_assert_int_eq(moe_metrics_read(p, &m), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "nope: no such run folder"));
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_ENOTFOUND); // no metrics.jsonl
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "metrics.jsonl"));
    fclose(metrics_file());
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "metrics.jsonl: no training steps recorded"));
    char args[1024];
    snprintf(args, sizeof args, "report '%s/nope'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "no such run folder"));
}
END_TEST

START_TEST(test_report_escapes_strings_from_input) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"eval_step\": 1, \"val_loss\": 4.5, \"tasks\": [{\"name\": \"<b>&x\", \"loss\": 4.5, "
          "\"accuracy\": null}], \"usage\": [{\"layer\": 0, \"counts\": [[1, 2, 3]]}]}\n",
          f);
    fclose(f);
    write_file("config.json", "{\"data\": {\"kind\": \"<script>alert(1)</script>\"}}\n");
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_report_html(&m, "<run>", in_dir("r.html")), 0);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    const char *bad = well_formed(html);
    ck_assert_msg(bad == NULL, "%s", bad);
    ck_assert_ptr_null(strstr(html, "<script"));
    ck_assert_ptr_null(strstr(html, "<b>"));
    ck_assert_ptr_nonnull(strstr(html, "&lt;script&gt;alert(1)&lt;/script&gt;"));
    ck_assert_ptr_nonnull(strstr(html, "&lt;b&gt;&amp;x"));
    ck_assert_int_eq(n_figures(html, "task_accuracy"), 0); // every accuracy null: no chart
    free(html);
}
END_TEST

// A task name (of two) longer than the legend's width, its cut falling inside a
// two-byte character ('a' then 15 x U+03B1): the legend ends before that
// character, so the page stays valid UTF-8.
START_TEST(test_report_cuts_long_legend_labels_between_utf8_characters) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"eval_step\": 1, \"val_loss\": 4.5, \"tasks\": [{\"name\": \"a"
          "\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1"
          "\u03b1\", \"loss\": 4.5, \"accuracy\": 0.5}, {\"name\": \"b\", \"loss\": 4, "
          "\"accuracy\": 0.5}]}\n",
          f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    long bad = moe_utf8_bad((const unsigned char *)html, (long)strlen(html));
    ck_assert_msg(bad < 0, "invalid UTF-8 at byte %ld: ...%.40s", bad,
                  html + (bad > 30 ? bad - 30 : 0));
    // 'a' and 9 whole characters (19 bytes), then the ellipsis
    ck_assert_ptr_nonnull(
        strstr(html, ">a\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1\u03b1...</text>"));
    free(html);
}
END_TEST

// Metric keys and task names longer than a series name or task column takes
// are refused naming the line and the length: cut, two 300-byte keys sharing
// a 290-byte prefix became one series. The quoted start of the name is cut
// before a whole UTF-8 character.
START_TEST(test_report_refuses_overlong_names_instead_of_cutting_them) {
    char k1[301], k2[301], line[1024];
    memset(k1, 'a', 290), memset(k1 + 290, 'b', 10), k1[300] = 0;
    memcpy(k2, k1, 290), memset(k2 + 290, 'c', 10), k2[300] = 0;
    const char *shapes[] = {"{\"step\": 1, \"%s\": 1, \"%s\": 2}\n",
                            "{\"step\": 1, \"comm\": {\"%s\": 1, \"%s\": 2}}\n",
                            "{\"eval_step\": 1, \"%s\": 1, \"%s\": 2}\n"};
    for (int i = 0; i < 3; i++) {
        FILE *f = metrics_file();
        record(f, 1, 5, 1);
        fprintf(f, shapes[i], k1, k2);
        fclose(f);
        moe_run_metrics m;
        ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
        char full[320];
        snprintf(full, sizeof full, "%s%s", i == 1 ? "comm." : i == 2 ? "eval." : "", k1);
        snprintf(line, sizeof line,
                 "metrics.jsonl:2: field name '%.48s...' is %zu bytes, longer than the 95 a "
                 "field name takes",
                 full, strlen(full));
        ck_assert_msg(strstr(moe_last_error(), line) != NULL, "%s", moe_last_error());
    }
    // 47 bytes, then a two-byte character across the 48-byte cut
    FILE *f = metrics_file();
    fputs("{\"step\": 1, \"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\u03b1"
          "yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy\": 1}\n",
          f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' "
                                           "is 109 bytes") != NULL,
                  "%s", moe_last_error());
    f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"eval_step\": 1, \"val_loss\": 4, \"tasks\": [{\"name\": \"copy_copy_copy_copy_"
          "copy_copy_copy_one\", \"loss\": 4, \"accuracy\": 0}, {\"name\": \"copy_copy_copy_"
          "copy_copy_copy_copy_two\", \"loss\": 3, \"accuracy\": 1}]}\n",
          f);
    fclose(f);
    ck_assert_int_eq(moe_metrics_read(dir, &m), MOE_EFORMAT);
    ck_assert_msg(strstr(moe_last_error(), "metrics.jsonl:2: task name 'copy_copy_copy_copy_copy_"
                                           "copy_copy_one' is 38 bytes, longer than the 31 a "
                                           "task name takes") != NULL,
                  "%s", moe_last_error());
}
END_TEST

START_TEST(test_report_draws_unknown_per_layer_fields) {
    FILE *f = metrics_file();
    for (int s = 1; s <= 5; s++)
        record(f, s, 5, 2);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    moe_series *s = moe_metrics_find(&m, "layer1.max_vio");
    ck_assert_ptr_nonnull(s);
    ck_assert_int_eq(s->n, 5);
    ck_assert_double_eq(s->v[4], 5.5);
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    int n;
    char p[800];
    snprintf(p, sizeof p, "%s/csv", dir);
    ck_assert_int_eq(moe_report_csv(&m, p, &n, NULL, 0), 0);
    ck_assert_int_eq(n, m.n);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    char *svg = figure(html, "layer.max_vio", -1, 0);
    ck_assert_int_eq(points(svg, "layer 0"), 5);
    ck_assert_int_eq(points(svg, "layer 1"), 5);
    free(svg);
    free(html);
    ck_assert_str_eq(tu_file_text(p, "layer1_max_vio.csv"),
                     "step,layer1.max_vio\n1,1.5\n2,2.5\n3,3.5\n4,4.5\n5,5.5\n");
}
END_TEST

START_TEST(test_report_resumed_steps_replace_earlier_rows) {
    FILE *f = metrics_file();
    for (int s = 1; s <= 5; s++)
        record(f, s, 10 + s, 1);
    for (int s = 3; s <= 6; s++) // resumed from the checkpoint of step 2
        record(f, s, 20 + s, 1);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    moe_series *s = moe_metrics_find(&m, "loss");
    ck_assert_int_eq(s->n, 6);
    const double want[6] = {11, 12, 23, 24, 25, 26};
    for (int i = 0; i < 6; i++) {
        ck_assert_double_eq(s->step[i], i + 1);
        ck_assert_double_eq(s->v[i], want[i]);
    }
    moe_metrics_free(&m);
}
END_TEST

// ---- outputs: never over an input, all or nothing ------------------------------------

static int files_named(const char *d, const char *part) {
    DIR *dp = opendir(d);
    ck_assert_ptr_nonnull(dp);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(dp)))
        n += strstr(e->d_name, part) != NULL;
    closedir(dp);
    return n;
}

static void metrics_of(int steps) {
    FILE *f = metrics_file();
    for (int s = 1; s <= steps; s++)
        record(f, s, 5.0 - 0.01 * s, 1);
    fclose(f);
}

START_TEST(test_report_refuses_to_overwrite_the_runs_inputs) {
    metrics_of(3);
    write_file("config.json", "{\"train\": {\"steps\": 3}}\n");
    write_file("notes.txt", "my notes\n");
    char *metrics = slurp(in_dir("metrics.jsonl"));
    char target[800];
    snprintf(target, sizeof target, "%s", in_dir("metrics.jsonl"));
    ck_assert_int_eq(link(target, in_dir("hard.html")), 0);
    const char *bad[] = {"metrics.jsonl", "config.json", "notes.txt", "hard.html", "."};
    const char *why[] = {"is the run's metrics.jsonl", "is the run's config.json",
                         "not a run report page written by moe report",
                         "is the run's metrics.jsonl", "is a folder"};
    char args[2048];
    for (int i = 0; i < 5; i++) {
        snprintf(args, sizeof args, "report '%s' --out '%s/%s'", dir, dir, bad[i]);
        ck_assert_msg(tu_run_moe(dir, args) == 2, "--out %s", bad[i]);
        ck_assert_msg(strstr(tu_file_text(dir, "err.txt"), why[i]), "%s: %s", bad[i],
                      tu_file_text(dir, "err.txt"));
    }
    char *now = slurp(in_dir("metrics.jsonl"));
    ck_assert_str_eq(now, metrics);
    free(now);
    ck_assert_str_eq(tu_file_text(dir, "notes.txt"), "my notes\n");
    ck_assert_str_eq(tu_file_text(dir, "config.json"), "{\"train\": {\"steps\": 3}}\n");
    // a CSV of someone else's in the CSV folder stays too
    write_file("loss.csv", "my,own\n");
    snprintf(args, sizeof args, "report '%s' --out '%s/r.html' --csv '%s'", dir, dir, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_ptr_nonnull(
        strstr(tu_file_text(dir, "err.txt"), "loss.csv: exists and is not a CSV"));
    ck_assert_str_eq(tu_file_text(dir, "loss.csv"), "my,own\n");
    struct stat st; // refused before anything is written: not even the page
    ck_assert_msg(stat(in_dir("r.html"), &st) != 0, "the page was written");
    snprintf(args, sizeof args, "report '%s' --csv '%s/metrics.jsonl'", dir, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    now = slurp(in_dir("metrics.jsonl"));
    ck_assert_str_eq(now, metrics);
    free(now);
    free(metrics);
    // our own outputs, and empty files, are replaced
    remove(in_dir("loss.csv"));
    write_file("empty.html", "");
    snprintf(args, sizeof args, "report '%s' --out '%s/empty.html' --csv '%s/csv'", dir, dir, dir);
    for (int i = 0; i < 2; i++)
        ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    char *html = slurp(in_dir("empty.html"));
    ck_assert_ptr_null(well_formed(html));
    free(html);
}
END_TEST

// moe ablate's page (ABL/report.html) is not an earlier output of moe report:
// --out naming it is refused and the page stays; moe ablate still replaces
// its own page, and not a run's.
START_TEST(test_report_refuses_to_overwrite_an_ablation_page) {
    metrics_of(3);
    moe_report_run run = {dir, "run_000", "router.top_k=1", NULL, 0};
    ck_assert_msg(moe_report_compare_html(in_dir("abl.html"), "grid", &run, 1) == 0, "%s",
                  moe_last_error());
    char *page = slurp(in_dir("abl.html"));
    ck_assert_ptr_nonnull(strstr(page, "ablation report"));
    char args[2048];
    snprintf(args, sizeof args, "report '%s' --out '%s/abl.html'", dir, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_msg(strstr(tu_file_text(dir, "err.txt"), "is not a run report page"), "%s",
                  tu_file_text(dir, "err.txt"));
    char *now = slurp(in_dir("abl.html"));
    ck_assert_str_eq(now, page);
    free(now), free(page);
    ck_assert_int_eq(moe_report_compare_html(in_dir("abl.html"), "grid", &run, 1), 0);
    snprintf(args, sizeof args, "report '%s' --out '%s/run.html'", dir, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    ck_assert_int_eq(moe_report_compare_html(in_dir("run.html"), "grid", &run, 1), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "is not an ablation page"));
}
END_TEST

// --out naming one of the CSVs --csv writes (loss.csv), by any spelling:
// refused before anything is written, naming both flags.
START_TEST(test_report_refuses_an_out_that_is_one_of_its_csvs) {
    metrics_of(3);
    mkdir(in_dir("csv"), 0755);
    const char *outs[] = {"csv/loss.csv", "csv/./loss.csv", "new/loss.csv"};
    const char *csvs[] = {"csv", "csv/", "new"};
    char args[2048];
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "report '%s' --out '%s/%s' --csv '%s/%s'", dir, dir, outs[i],
                 dir, csvs[i]);
        ck_assert_msg(tu_run_moe(dir, args) == 2, "--out %s --csv %s", outs[i], csvs[i]);
        const char *err = tu_file_text(dir, "err.txt");
        ck_assert_msg(strstr(err, "--out") && strstr(err, "--csv") && strstr(err, "loss.csv"), "%s",
                      err);
        ck_assert_int_eq(tu_count_entries(in_dir("csv")), 0);
    }
    struct stat st;
    ck_assert_msg(stat(in_dir("new"), &st) != 0, "the CSV folder was created");
}
END_TEST

START_TEST(test_report_refuses_an_empty_out_or_csv_path) {
    metrics_of(3);
    const char *flags[] = {"--out", "--csv"};
    char args[2048];
    for (int i = 0; i < 2; i++) {
        snprintf(args, sizeof args, "report '%s' %s ''", dir, flags[i]);
        ck_assert_int_eq(tu_run_moe(dir, args), 2);
        char want[64];
        snprintf(want, sizeof want, "%s needs a path", flags[i]);
        ck_assert_msg(strstr(tu_file_text(dir, "err.txt"), want), "%s",
                      tu_file_text(dir, "err.txt"));
    }
}
END_TEST

// A full disk (here the file size limit: EFBIG) while the page is written:
// exit 1, and the report of the earlier call is still whole.
START_TEST(test_report_failed_write_keeps_the_earlier_report) {
    metrics_of(3);
    char args[2048];
    snprintf(args, sizeof args, "report '%s' --csv '%s/csv'", dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    char *old = slurp(in_dir("report.html"));
    char p[800];
    snprintf(p, sizeof p, "%s/csv", dir);
    char *old_loss = strdup(tu_file_text(p, "loss.csv"));
    metrics_of(400); // a page far larger than the limit below

    struct rlimit was;
    ck_assert_int_eq(getrlimit(RLIMIT_FSIZE, &was), 0);
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN); // inherited by the moe process
    struct rlimit lim = {strlen(old) + 100, was.rlim_max};
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &lim), 0);
    int code = tu_run_moe(dir, args);
    ck_assert_int_eq(setrlimit(RLIMIT_FSIZE, &was), 0);
    signal(SIGXFSZ, prev);

    ck_assert_int_eq(code, 1);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"), "report.html: write failed"));
    char *now = slurp(in_dir("report.html"));
    ck_assert_str_eq(now, old);
    ck_assert_int_eq(files_named(dir, ".tmp."), 0);
    // the CSVs, written after the page, were not touched
    ck_assert_str_eq(tu_file_text(p, "loss.csv"), old_loss);
    free(now), free(old), free(old_loss);
}
END_TEST

// Every counted file-system call of a page and of the CSVs made to fail in
// turn (moe/fsio.h): each output is then either the earlier one or the new
// one, whole, and no temp file is left.
START_TEST(test_report_every_failed_call_leaves_old_or_new_files) {
    metrics_of(3);
    char csv[800];
    snprintf(csv, sizeof csv, "%s/csv", dir);
    moe_run_metrics m;
    int n;
    ck_assert_int_eq(moe_metrics_read(dir, &m), 0);
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("report.html")), 0);
    ck_assert_int_eq(moe_report_csv(&m, csv, &n, NULL, 0), 0);
    moe_metrics_free(&m);
    char *old = slurp(in_dir("report.html")), *old_loss = strdup(tu_file_text(csv, "loss.csv"));
    metrics_of(5);
    ck_assert_int_eq(moe_metrics_read(dir, &m), 0);
    moe_fs_fault_arm(0, MOE_FAULT_OFF); // a dry run counts the calls
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("new.html")), 0);
    long calls = moe_fs_op_count();
    ck_assert_int_ge(calls, 4); // create, write, fsync, rename (+ the folder's fsync)
    char *fresh = slurp(in_dir("new.html"));
    int failed = 0;
    for (long k = 1; k <= calls; k++) {
        moe_fs_fault_arm(k, MOE_FAULT_FAIL);
        int rc = moe_report_html(&m, dir, in_dir("report.html"));
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        char *now = slurp(in_dir("report.html"));
        ck_assert_msg(!strcmp(now, rc == 0 ? fresh : old), "call %ld (%s), rc %d", k,
                      moe_fs_fault_op(), rc);
        free(now);
        ck_assert_int_eq(files_named(dir, ".tmp."), 0);
        failed += rc < 0;
    }
    ck_assert_int_ge(failed, 4);
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(moe_report_csv(&m, in_dir("csv2"), &n, NULL, 0), 0);
    calls = moe_fs_op_count();
    char *new_loss = strdup(tu_file_text(in_dir("csv2"), "loss.csv"));
    for (long k = 1; k <= calls; k++) {
        moe_fs_fault_arm(k, MOE_FAULT_FAIL);
        moe_report_csv(&m, csv, &n, NULL, 0);
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        const char *now = tu_file_text(csv, "loss.csv");
        ck_assert_msg(!strcmp(now, old_loss) || !strcmp(now, new_loss), "call %ld: %s", k, now);
        ck_assert_int_eq(files_named(csv, ".tmp."), 0);
    }
    moe_metrics_free(&m);
    free(old), free(fresh), free(old_loss), free(new_loss);
}
END_TEST

// ---- CSV contents and names ---------------------------------------------------------

START_TEST(test_report_csv_numbers_read_back_exactly) {
    FILE *f = metrics_file();
    fputs("{\"step\": 1, \"time\": 1795510912.345, \"loss\": 0.1, \"tiny\": 1e-300, "
          "\"big\": 123456789.12345678}\n"
          "{\"step\": 2, \"time\": 1795510922.001, \"loss\": 2.5, \"tiny\": 3, \"big\": 1}\n"
          "{\"eval_step\": 2, \"time\": 1795510923.999, \"val_loss\": 0.30000000000000004}\n",
          f);
    fclose(f);
    moe_run_metrics m;
    int n;
    ck_assert_int_eq(moe_metrics_read(dir, &m), 0);
    ck_assert_int_eq(moe_report_csv(&m, dir, &n, NULL, 0), 0);
    moe_metrics_free(&m);
    ck_assert_str_eq(tu_file_text(dir, "time.csv"),
                     "step,time\n1,1795510912.345\n2,1795510922.001\n");
    ck_assert_str_eq(tu_file_text(dir, "eval_time.csv"), "step,eval.time\n2,1795510923.999\n");
    ck_assert_str_eq(tu_file_text(dir, "loss.csv"), "step,loss\n1,0.1\n2,2.5\n");
    ck_assert_str_eq(tu_file_text(dir, "tiny.csv"), "step,tiny\n1,1e-300\n2,3\n");
    ck_assert_str_eq(tu_file_text(dir, "big.csv"), "step,big\n1,123456789.12345678\n2,1\n");
    ck_assert_str_eq(tu_file_text(dir, "eval_val_loss.csv"),
                     "step,eval.val_loss\n2,0.30000000000000004\n");
}
END_TEST

START_TEST(test_report_csv_names_never_collide) {
    FILE *f = metrics_file();
    for (int s = 1; s <= 2; s++)
        fprintf(f,
                "{\"step\": %d, \"a/b\": 1, \"a_b\": 2, \"layer0_load\": 7, \"layers\": "
                "[{\"layer\": 0, \"load\": [%d, 2, 3]}]}\n",
                s, s);
    fclose(f);
    char args[2048], csv[800];
    snprintf(csv, sizeof csv, "%s/csv", dir);
    snprintf(args, sizeof args, "report '%s' --csv '%s'", dir, csv);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "csv: 4 files in"));
    ck_assert_int_eq(tu_count_entries(csv), 4);
    ck_assert_str_eq(tu_file_text(csv, "a_b.csv"), "step,a/b\n1,1\n2,1\n");
    ck_assert_str_eq(tu_file_text(csv, "a_b_2.csv"), "step,a_b\n1,2\n2,2\n");
    ck_assert_str_eq(tu_file_text(csv, "layer0_load.csv"), "step,layer0_load\n1,7\n2,7\n");
    ck_assert_str_eq(tu_file_text(csv, "layer0_load_2.csv"), "step,e0,e1,e2\n1,1,2,3\n2,2,2,3\n");
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"),
                                 "'a_b' -> a_b_2.csv, 'layer0.load' -> layer0_load_2.csv"));
}
END_TEST

// ---- what the reader skips, it says -------------------------------------------------

START_TEST(test_report_suggests_the_nearest_option) {
    metrics_of(2);
    char args[2048];
    snprintf(args, sizeof args, "report '%s' --cvs x", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "err.txt"),
                                 "unknown option '--cvs' (did you mean --csv? see moe report"));
}
END_TEST

START_TEST(test_report_warns_once_about_values_that_are_not_numbers) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"step\": 2, \"loss\": \"abc\", \"lr\": 0.5}\n", f);
    record(f, 3, 4, 1);
    fputs("{\"step\": 4, \"loss\": true, \"lr\": 0.5}\n", f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_int_eq(moe_metrics_read(dir, &m), 0);
    ck_assert_int_eq(m.n_bad_values, 2);
    ck_assert_int_eq(moe_metrics_find(&m, "loss")->n, 2);
    ck_assert_int_eq(moe_metrics_find(&m, "lr")->n, 4);
    moe_metrics_free(&m);
    char args[2048];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    const char *err = tu_file_text(dir, "err.txt");
    ck_assert_int_eq(count(err, "warning:"), 1);
    ck_assert_msg(strstr(err, "metrics.jsonl:2: 'loss' is a string, not a number: skipped (2 such "
                              "values in all)"),
                  "%s", err);
}
END_TEST

START_TEST(test_report_warns_once_about_records_without_a_step) {
    FILE *f = metrics_file();
    record(f, 1, 5, 1);
    fputs("{\"loss\": 3}\n{\"kind\": \"new\"}\n", f);
    record(f, 2, 4, 1);
    fclose(f);
    char args[2048];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    const char *err = tu_file_text(dir, "err.txt");
    ck_assert_int_eq(count(err, "warning:"), 1);
    ck_assert_msg(strstr(err, "metrics.jsonl:2: a record with neither 'step' nor 'eval_step': "
                              "skipped (2 such records in all)"),
                  "%s", err);
    char *html = slurp(in_dir("report.html"));
    ck_assert_ptr_nonnull(strstr(html, "a record with neither"));
    free(html);
}
END_TEST

START_TEST(test_report_says_how_many_records_a_resume_replaced) {
    FILE *f = metrics_file();
    for (int s = 1; s <= 5; s++)
        record(f, s, 10 + s, 1);
    fputs("{\"eval_step\": 4, \"val_loss\": 3}\n", f);
    for (int s = 3; s <= 6; s++) // resumed from the checkpoint of step 2
        record(f, s, 20 + s, 1);
    fputs("{\"eval_step\": 4, \"val_loss\": 2}\n", f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_int_eq(moe_metrics_read(dir, &m), 0);
    ck_assert_int_eq(m.n_superseded, 4); // steps 3, 4, 5 and the evaluation at 4
    moe_metrics_free(&m);
    char args[2048];
    snprintf(args, sizeof args, "report '%s'", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    const char *err = tu_file_text(dir, "err.txt");
    ck_assert_msg(strstr(err, "note: 4 earlier records replaced by steps logged again (a resumed "
                              "run), first at "),
                  "%s", err);
    ck_assert_ptr_nonnull(strstr(err, "metrics.jsonl:7\n"));
    ck_assert_ptr_null(strstr(err, "warning"));
}
END_TEST

// null is how metrics.jsonl writes a non-finite value: a missing value.
START_TEST(test_report_reads_null_as_a_missing_value) {
    FILE *f = metrics_file();
    fputs("{\"step\": 1, \"loss\": 5, \"layers\": [{\"layer\": 0, \"load\": [1, 2, 3]}]}\n"
          "{\"step\": 2, \"loss\": null, \"layers\": [{\"layer\": 0, \"load\": [1, null, 3]}]}\n"
          "{\"step\": 3, \"loss\": 4, \"layers\": [{\"layer\": 0, \"load\": null}]}\n",
          f);
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(m.n_bad_values, 0);
    moe_series *loss = moe_metrics_find(&m, "loss"), *load = moe_metrics_find(&m, "layer0.load");
    ck_assert_int_eq(loss->n, 3);
    ck_assert(isnan(loss->v[1]));
    ck_assert_int_eq(load->n, 3);
    ck_assert(isnan(load->v[4]) && load->v[5] == 3 && isnan(load->v[6]));
    int n;
    ck_assert_int_eq(moe_report_csv(&m, dir, &n, NULL, 0), 0);
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    moe_metrics_free(&m);
    ck_assert_str_eq(tu_file_text(dir, "loss.csv"), "step,loss\n1,5\n2,\n3,4\n");
    ck_assert_str_eq(tu_file_text(dir, "layer0_load.csv"),
                     "step,e0,e1,e2\n1,1,2,3\n2,1,,3\n3,,,\n");
    char *html = slurp(in_dir("r.html"));
    char *svg = figure(html, "loss", -1, 0);
    ck_assert_int_eq(points(svg, "training"), 2);
    free(svg), free(html);
}
END_TEST

// Finite values whose difference overflows (a diverged run logging 1e308 and
// -1e308) and a bucket whose sum overflows: every coordinate stays a number
// (they were "-nan", which no browser draws), the y axis keeps its ticks.
START_TEST(test_report_huge_values_keep_coordinates_finite) {
    FILE *f = metrics_file();
    fputs("{\"step\": 1, \"loss\": 1e308}\n{\"step\": 2, \"loss\": -1e308}\n"
          "{\"step\": 3, \"loss\": 5}\n{\"eval_step\": 3, \"val_loss\": 1.7e308}\n"
          "{\"eval_step\": 4, \"val_loss\": -1.7e308}\n",
          f);
    for (int st = 5; st <= 2004; st++) // buckets of 3 steps holding 1.7e308 twice
        fprintf(f, "{\"step\": %d, \"loss\": %s}\n", st, st % 3 == 2 ? "1" : "1.7e308");
    fclose(f);
    moe_run_metrics m;
    ck_assert_msg(moe_metrics_read(dir, &m) == 0, "%s", moe_last_error());
    ck_assert_int_eq(moe_report_html(&m, dir, in_dir("r.html")), 0);
    moe_metrics_free(&m);
    char *html = slurp(in_dir("r.html"));
    for (char *a = strstr(html, "=\""); a; a = strstr(a + 2, "=\"")) {
        char *end = strchr(a + 2, '"');
        ck_assert_ptr_nonnull(end);
        for (char *q = a + 2; q + 2 < end; q++)
            ck_assert_msg(strncasecmp(q, "nan", 3) && strncasecmp(q, "inf", 3), "%.60s", a);
    }
    char *svg = figure(html, "loss", -1, 0);
    ck_assert_int_eq(points(svg, "training"), 668);
    ck_assert_int_ge(count(svg, "text-anchor=\"end\""), 2); // y ticks
    free(svg), free(html);
}
END_TEST

START_TEST(test_ablate_writes_a_comparison_report) {
    moe_config c = tu_small_config();
    c.train.steps = 4;
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "train.lr=1e-2,1e30"), 0); // the second diverges
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/grid", tu_tmpdir());
    ck_assert_int_lt(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), 0); // a run failed
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "1 of 2 runs failed"));
    snprintf(p, sizeof p, "%s/report.html", out);
    char *html = slurp(p);
    const char *bad = well_formed(html);
    ck_assert_msg(bad == NULL, "%s", bad);
    char *svg = figure(html, "loss", -1, 0);
    ck_assert_int_eq(points(svg, "run_000"), 4);
    ck_assert_int_eq(points(svg, "run_001"), 1); // step 1 is finite, step 2 diverges
    free(svg);
    ck_assert_ptr_nonnull(strstr(html, "<td>train.lr=1e-2</td>"));
    ck_assert_ptr_nonnull(strstr(html, "<td>step 2: ")); // the failure, in its row
    free(html);
}
END_TEST

START_TEST(test_crc32c_matches_the_check_value) {
    ck_assert_uint_eq(moe_crc32c("123456789", 9), 0xE3069283u); // the CRC-32C check value
    ck_assert_uint_eq(moe_crc32c("", 0), 0);
}
END_TEST

static uint64_t rd_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint64_t rd_varint(const unsigned char **p, const unsigned char *end) {
    uint64_t v = 0;
    for (int s = 0; *p < end; s += 7) {
        unsigned char b = *(*p)++;
        v |= (uint64_t)(b & 0x7F) << s;
        if (!(b & 0x80)) break;
    }
    return v;
}

// What a test needs of one decoded Event: step, file_version, scalars.
typedef struct {
    long step;
    int session_status; // SessionLog.status (1: START), 0 when absent
    char version[32];
    int n;
    char tag[64][64];
    float value[64];
} tb_event;

static void decode_value(const unsigned char *p, const unsigned char *end, tb_event *ev) {
    while (p < end) {
        uint64_t key = rd_varint(&p, end);
        if ((key & 7) == 2) {
            uint64_t n = rd_varint(&p, end);
            snprintf(ev->tag[ev->n], 64, "%.*s", (int)n, p);
            p += n;
        } else if ((key & 7) == 5) {
            uint32_t bits = (uint32_t)rd_le(p, 4);
            memcpy(&ev->value[ev->n], &bits, 4);
            p += 4;
        } else {
            ck_abort_msg("unexpected wire type %d in Value", (int)(key & 7));
        }
    }
    ev->n++;
}

static void decode_event(const unsigned char *p, const unsigned char *end, tb_event *ev) {
    memset(ev, 0, sizeof *ev);
    while (p < end) {
        uint64_t key = rd_varint(&p, end);
        int field = (int)(key >> 3), wt = (int)(key & 7);
        if (wt == 1)
            p += 8; // wall_time
        else if (wt == 0)
            ev->step = (long)rd_varint(&p, end);
        else if (wt == 2) {
            uint64_t n = rd_varint(&p, end);
            if (field == 3) snprintf(ev->version, sizeof ev->version, "%.*s", (int)n, p);
            if (field == 7) { // SessionLog: status (field 1, varint)
                const unsigned char *q = p;
                ck_assert_int_eq((int)rd_varint(&q, p + n), 1 << 3 | 0);
                ev->session_status = (int)rd_varint(&q, p + n);
            }
            if (field == 5) { // Summary: repeated Value (field 1)
                const unsigned char *q = p, *qe = p + n;
                while (q < qe) {
                    ck_assert_int_eq((int)rd_varint(&q, qe), 1 << 3 | 2);
                    uint64_t vn = rd_varint(&q, qe);
                    ck_assert_int_lt(ev->n, 64);
                    decode_value(q, q + vn, ev);
                    q += vn;
                }
            }
            p += n;
        } else {
            ck_abort_msg("unexpected wire type %d in Event", wt);
        }
    }
}

static float tag_value(const tb_event *ev, const char *tag) {
    for (int i = 0; i < ev->n; i++)
        if (!strcmp(ev->tag[i], tag)) return ev->value[i];
    return NAN;
}

START_TEST(test_tensorboard_events_verify_and_match_the_metrics) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    write_file("cfg.json", cfg_json);
    char args[2048], p[1200];
    snprintf(args, sizeof args,
             "train '%s/cfg.json' --quiet --out '%s/run' --set train.tensorboard=true", dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(p, sizeof p, "%s/run", dir);
    DIR *d = opendir(p);
    struct dirent *de;
    char events[300] = "";
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, "events.out.tfevents.", 20))
            snprintf(events, sizeof events, "%s", de->d_name);
    closedir(d);
    ck_assert_msg(events[0], "no event file in %s", p);
    snprintf(p, sizeof p, "%s/run/%s", dir, events);
    FILE *f = fopen(p, "rb");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(size);
    ck_assert_int_eq((long)fread(buf, 1, size, f), size);
    fclose(f);
    moe_run_metrics m;
    snprintf(p, sizeof p, "%s/run", dir);
    ck_assert_int_eq(moe_metrics_read(p, &m), 0);
    const moe_series *loss = moe_metrics_find(&m, "loss"),
                     *val = moe_metrics_find(&m, "eval.val_loss");
    int n_events = 0, n_train = 0, n_eval = 0;
    for (long off = 0; off < size; n_events++) {
        ck_assert_int_le(off + 12, size);
        uint64_t len = rd_le(buf + off, 8);
        ck_assert_uint_eq(rd_le(buf + off + 8, 4), moe_tb_masked_crc(buf + off, 8));
        ck_assert_int_le(off + 16 + (long)len, size);
        ck_assert_uint_eq(rd_le(buf + off + 12 + len, 4), moe_tb_masked_crc(buf + off + 12, len));
        tb_event ev;
        decode_event(buf + off + 12, buf + off + 12 + len, &ev);
        if (n_events == 0) {
            ck_assert_str_eq(ev.version, "brain.Event:2");
        } else if (isfinite(tag_value(&ev, "train/loss"))) {
            ck_assert_int_eq(ev.step, (long)loss->step[n_train]);
            ck_assert_float_eq_tol(tag_value(&ev, "train/loss"), loss->v[n_train], 1e-5);
            ck_assert(isfinite(tag_value(&ev, "train/lr")));
            n_train++;
        } else {
            ck_assert_int_eq(ev.step, (long)val->step[n_eval]);
            ck_assert_float_eq_tol(tag_value(&ev, "eval/val_loss"), val->v[n_eval], 1e-5);
            ck_assert(isfinite(tag_value(&ev, "eval/loss/sort")));
            ck_assert(isfinite(tag_value(&ev, "eval/accuracy/add")));
            n_eval++;
        }
        off += 16 + len;
    }
    ck_assert_int_eq(n_train, 12);
    ck_assert_int_eq(n_eval, 3);
    moe_metrics_free(&m);
    free(buf);
}
END_TEST

// The event files of folder p, in name order (as TensorBoard reads them).
static int event_files(const char *p, char names[][300], int max) {
    DIR *d = opendir(p);
    ck_assert_ptr_nonnull(d);
    struct dirent *de;
    int n = 0;
    while ((de = readdir(d)))
        if (!strncmp(de->d_name, "events.out.tfevents.", 20) && n < max)
            snprintf(names[n++], 300, "%s", de->d_name);
    closedir(d);
    qsort(names, n, 300, (int (*)(const void *, const void *))strcmp);
    return n;
}

// Every event of one file, CRCs verified; *n gets the count.
static tb_event *read_events(const char *path, int *n) {
    FILE *f = fopen(path, "rb");
    ck_assert_ptr_nonnull(f);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(size + 1);
    ck_assert_int_eq((long)fread(buf, 1, size, f), size);
    fclose(f);
    tb_event *ev = NULL;
    *n = 0;
    for (long off = 0; off < size; ++*n) {
        ck_assert_int_le(off + 12, size);
        uint64_t len = rd_le(buf + off, 8);
        ck_assert_uint_eq(rd_le(buf + off + 8, 4), moe_tb_masked_crc(buf + off, 8));
        ck_assert_int_le(off + 16 + (long)len, size);
        ck_assert_uint_eq(rd_le(buf + off + 12 + len, 4), moe_tb_masked_crc(buf + off + 12, len));
        ev = realloc(ev, (*n + 1) * sizeof *ev);
        decode_event(buf + off + 12, buf + off + 12 + len, &ev[*n]);
        off += 16 + len;
    }
    free(buf);
    return ev;
}

// Axis labels: SI suffixes k, M, G within their range, chosen by the value as
// printed; beyond them (and below 1e-4) an exponent alone, never "1e+03G".
START_TEST(test_tick_labels_never_put_a_suffix_on_an_exponent) {
    const struct {
        double v;
        const char *want;
    } cases[] = {{0, "0"},           {-0.0, "0"},        {1, "1"},
                 {0.5, "0.5"},       {0.0012, "0.0012"}, {-1e-7, "-1e-7"},
                 {1.5e-5, "1.5e-5"}, {1500, "1500"},     {-2500, "-2500"},
                 {9999.7, "10k"},                    // 4 digits round it to 1e+04
                 {12345, "12.3k"},   {999960, "1M"}, // not 1e+03k
                 {2.5e6, "2.5M"},    {-2.5e6, "-2.5M"},  {999.96e6, "1G"}, // not 1e+03M
                 {1e9, "1G"},        {1.5e11, "150G"},   {999e9, "999G"},
                 {999.96e9, "1e12"}, {1e12, "1e12"},     {2.5e13, "2.5e13"},
                 {-4e20, "-4e20"},   {1e299, "1e299"},   {DBL_MAX, "1.8e308"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char buf[32];
        svg_fmt_num(buf, sizeof buf, cases[i].v);
        ck_assert_msg(!strcmp(buf, cases[i].want), "%.17g: '%s', expected '%s'", cases[i].v, buf,
                      cases[i].want);
    }
}
END_TEST

// A run folder named in another encoding: its bytes reached the page as they
// were, and the page says it is UTF-8. Each maximal ill-formed part is one
// U+FFFD (a cut sequence is one), well-formed characters pass, markup and
// control characters are escaped as before.
START_TEST(test_svg_esc_writes_valid_utf8) {
    const struct {
        const char *in, *want;
    } cases[] = {
        {"run\xff", "run\xEF\xBF\xBD"},
        {"a\xe2\x82\xac<b>", "a\xe2\x82\xac&lt;b&gt;"},             // a euro sign kept
        {"cut\xe2\x82", "cut\xEF\xBF\xBD"},                          // one for the cut sequence
        {"\xe2\x82x", "\xEF\xBF\xBDx"},                              // cut before an ASCII byte
        {"\xc0\xaf", "\xEF\xBF\xBD\xEF\xBF\xBD"},                  // overlong: two
        {"\xed\xa0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"}, // a surrogate
        {"\xf0\x9f\x98\x80 & '\x01'", "\xf0\x9f\x98\x80 &amp; &#39;?&#39;"},
        {"\x80\xbf", "\xEF\xBF\xBD\xEF\xBF\xBD"}, // lone continuation bytes
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *out = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&out, &len);
        ck_assert_ptr_nonnull(f);
        svg_esc(f, cases[i].in);
        fclose(f);
        ck_assert_msg(!strcmp(out, cases[i].want), "case %zu: got '%s'", i, out);
        ck_assert_int_eq(moe_utf8_bad((const unsigned char *)out, (long)len), -1);
        free(out);
    }
}
END_TEST

// A run resumed from its step-8 checkpoint after reaching step 12: the new
// event file opens with a session_log START at step 9, and TensorBoard's
// purge (every earlier point at that step or later dropped when the START
// is read, files in name order) leaves one train/loss point per step, steps
// rising, equal to metrics.jsonl's. Without the START it would keep 16.
START_TEST(test_tensorboard_resume_purges_the_redone_steps) {
    write_file("cfg.json", cfg_json);
    char args[2048], p[2000];
    snprintf(args, sizeof args,
             "train '%s/cfg.json' --quiet --out '%s/run' --set train.tensorboard=true --set "
             "train.ckpt_every=4 --set train.keep_checkpoints=5",
             dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args,
             "train '%s/run/config.json' --quiet --resume '%s/run/checkpoint-8' --out '%s/run'",
             dir, dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(p, sizeof p, "%s/run", dir);
    char names[4][300];
    ck_assert_int_eq(event_files(p, names, 4), 2);
    long step[64];
    float loss[64];
    int kept = 0;
    for (int fi = 0; fi < 2; fi++) {
        snprintf(p, sizeof p, "%s/run/%s", dir, names[fi]);
        int n;
        tb_event *ev = read_events(p, &n);
        ck_assert_int_ge(n, 2);
        ck_assert_str_eq(ev[0].version, "brain.Event:2");
        if (fi == 1) { // the resumed run's file: START at its first step
            ck_assert_int_eq(ev[1].session_status, 1);
            ck_assert_int_eq(ev[1].step, 9);
        }
        for (int i = 1; i < n; i++) {
            if (ev[i].session_status == 1) { // TensorBoard's purge
                int k = 0;
                for (int j = 0; j < kept; j++)
                    if (step[j] < ev[i].step) step[k] = step[j], loss[k] = loss[j], k++;
                kept = k;
            }
            float v = tag_value(&ev[i], "train/loss");
            if (isfinite(v)) {
                ck_assert_int_lt(kept, 64);
                step[kept] = ev[i].step, loss[kept++] = v;
            }
        }
        free(ev);
    }
    moe_run_metrics m;
    snprintf(p, sizeof p, "%s/run", dir);
    ck_assert_int_eq(moe_metrics_read(p, &m), 0);
    const moe_series *ls = moe_metrics_find(&m, "loss");
    ck_assert_int_eq(ls->n, 12);
    ck_assert_int_eq(kept, 12);
    for (int i = 0; i < kept; i++) {
        ck_assert_int_eq(step[i], i + 1);
        ck_assert_float_eq_tol(loss[i], ls->v[i], 1e-5);
    }
    moe_metrics_free(&m);
}
END_TEST

static void fresh_dir(void) {
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
}

int main(void) {
    Suite *s = suite_create("report");
    TCase *tc = tcase_create("report");
    tcase_set_timeout(tc, 300);
    tcase_add_checked_fixture(tc, fresh_dir, NULL);
    tcase_add_test(tc, test_report_has_one_chart_per_figure_with_a_point_per_step);
    tcase_add_test(tc, test_report_csv_has_a_row_per_step);
    tcase_add_test(tc, test_report_downsamples_long_series);
    tcase_add_test(tc, test_report_heatmap_draws_ranges_of_many_experts);
    tcase_add_test(tc, test_report_names_the_list_and_step_limits);
    tcase_add_test(tc, test_report_refuses_a_malformed_line_naming_it);
    tcase_add_test(tc, test_report_skips_a_truncated_last_line);
    tcase_add_test(tc, test_report_refuses_missing_folder_and_empty_metrics);
    tcase_add_test(tc, test_report_escapes_strings_from_input);
    tcase_add_test(tc, test_report_cuts_long_legend_labels_between_utf8_characters);
    tcase_add_test(tc, test_report_draws_unknown_per_layer_fields);
    tcase_add_test(tc, test_report_resumed_steps_replace_earlier_rows);
    tcase_add_test(tc, test_report_refuses_to_overwrite_the_runs_inputs);
    tcase_add_test(tc, test_report_refuses_to_overwrite_an_ablation_page);
    tcase_add_test(tc, test_report_refuses_an_out_that_is_one_of_its_csvs);
    tcase_add_test(tc, test_report_refuses_an_empty_out_or_csv_path);
    tcase_add_test(tc, test_report_failed_write_keeps_the_earlier_report);
    tcase_add_test(tc, test_report_every_failed_call_leaves_old_or_new_files);
    tcase_add_test(tc, test_report_csv_numbers_read_back_exactly);
    tcase_add_test(tc, test_report_csv_names_never_collide);
    tcase_add_test(tc, test_report_suggests_the_nearest_option);
    tcase_add_test(tc, test_report_warns_once_about_values_that_are_not_numbers);
    tcase_add_test(tc, test_report_warns_once_about_records_without_a_step);
    tcase_add_test(tc, test_report_says_how_many_records_a_resume_replaced);
    tcase_add_test(tc, test_report_reads_null_as_a_missing_value);
    tcase_add_test(tc, test_report_refuses_overlong_names_instead_of_cutting_them);
    tcase_add_test(tc, test_report_huge_values_keep_coordinates_finite);
    tcase_add_test(tc, test_ablate_writes_a_comparison_report);
    tcase_add_test(tc, test_crc32c_matches_the_check_value);
    tcase_add_test(tc, test_tensorboard_events_verify_and_match_the_metrics);
    tcase_add_test(tc, test_tensorboard_resume_purges_the_redone_steps);
    tcase_add_test(tc, test_tick_labels_never_put_a_suffix_on_an_exponent);
    tcase_add_test(tc, test_svg_esc_writes_valid_utf8);
    suite_add_tcase(s, tc);
    return tu_run(s);
}
