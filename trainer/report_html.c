// The run report page (moe report) and the ablation comparison page: one
// self-contained HTML file each, inline SVG and CSS, no script, nothing
// fetched. Series come from trainer/report.c; charts from trainer/report_svg.c.
#include "moe/error.h"
#include "moe/report.h"
#include "trainer/report_out.h"
#include "trainer/report_svg.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *css =
    "body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}"
    "h1{font-size:22px;margin:0}h2{font-size:18px;border-bottom:1px solid #ddd;margin-top:28px}"
    "h3{font-size:15px;margin:12px 0 4px}.sub{color:#666;margin:2px 0 12px}"
    ".charts{display:flex;flex-wrap:wrap;gap:8px}figure{margin:0}"
    "figcaption{font-size:12px;color:#555;max-width:640px}"
    "svg{background:#fff;border:1px solid #eee}svg text{font:11px sans-serif;fill:#333}"
    "svg .title{font-size:13px;font-weight:600}svg .grid{stroke:#eee}svg .tickmark{stroke:#999}"
    "svg .frame{fill:none;stroke:#bbb}svg .line{fill:none;stroke-width:1.6}"
    "svg .cellv{font-size:10px}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;"
    "text-align:left}th{background:#f6f6f6}td.num{text-align:right;font-variant-numeric:"
    "tabular-nums}.warn{color:#a40}";

// title starts with "moe ": the page then begins with REPORT_HTML_MAGIC (and
// REPORT_HTML_RUN or REPORT_HTML_ABLATE for the two titles used).
static void page_open(FILE *f, const char *title, const char *sub) {
    fputs(REPORT_HTML_MAGIC, f);
    svg_esc(f, title + 4);
    fprintf(f, "</title><style>%s</style></head>\n<body><h1>", css);
    svg_esc(f, title);
    fputs("</h1><p class=\"sub\">", f);
    svg_esc(f, sub);
    fputs("</p>\n", f);
}

static void page_close(FILE *f) {
    fputs("</body></html>\n", f);
}

static svg_line line_of(const moe_series *s, int col, const char *label) {
    return (svg_line){label, s->n, s->step, s->v + col, s->ncol};
}

static double last_value(const moe_series *s, int col) {
    return s && s->n ? s->v[(s->n - 1) * s->ncol + col] : NAN;
}

static double mean_value(const moe_series *s) {
    double sum = 0;
    long n = 0;
    for (long i = 0; s && i < s->n; i++)
        if (isfinite(s->v[i * s->ncol])) sum += s->v[i * s->ncol], n++;
    return n ? sum / n : NAN;
}

// The summary is one table row: a heading and a value per figure.
typedef struct {
    char head[MOE_NAME_MAX + 16], val[32];
} cell;

static void cell_num(cell *c, const char *head, const char *fmt, double v) {
    snprintf(c->head, sizeof c->head, "%s", head);
    if (isfinite(v))
        snprintf(c->val, sizeof c->val, fmt, v);
    else
        snprintf(c->val, sizeof c->val, "n/a");
}

static int chart(FILE *f, const char *figure, int layer, const char *title, const char *ylabel,
                 double yscale, const svg_line *lines, int n, const char *caption) {
    svg_chart c = {figure, layer, title, "step", ylabel, yscale, n > 1, yscale == 100};
    return svg_line_chart(f, &c, lines, n, caption) < 0
               ? moe_fail(MOE_ENOMEM, "report: out of memory")
               : 0;
}

// A series of ncol columns over steps as a heatmap (rows: columns of the
// series), buckets of steps averaged down to MOE_REPORT_MAX_COLUMNS columns;
// share: each step's row normalised to sum 1 first (load -> share of tokens).
static int series_heatmap(FILE *f, const char *figure, int layer, const char *title,
                          const moe_series *s, bool share) {
    long k = (s->n + MOE_REPORT_MAX_COLUMNS - 1) / MOE_REPORT_MAX_COLUMNS;
    if (k < 1) k = 1;
    // Rows (experts, columns of the series) likewise: kr consecutive ones per
    // drawn row, their shares summed (a range of experts' share) or their
    // values averaged.
    const int ncol = s->ncol, kr = (ncol + MOE_REPORT_MAX_ROWS - 1) / MOE_REPORT_MAX_ROWS;
    int cols = (int)((s->n + k - 1) / k), rows = (ncol + kr - 1) / kr;
    double *v = calloc((size_t)rows * cols + 1, sizeof(double)),
           *xs = calloc((size_t)cols + 1, sizeof(double)),
           *tot = calloc((size_t)k + 1, sizeof(double));
    const char **names = calloc((size_t)rows + 1, sizeof(char *));
    char(*range)[2 * MOE_NAME_MAX + 4] = kr > 1 ? calloc((size_t)rows, sizeof *range) : NULL;
    if (!v || !xs || !tot || !names || (kr > 1 && !range)) {
        free(v), free(xs), free(tot), free(names), free(range);
        return moe_fail(MOE_ENOMEM, "report: out of memory");
    }
    double vmin = INFINITY, vmax = -INFINITY;
    for (int c = 0; c < cols; c++) {
        long lo = c * k, hi = lo + k < s->n ? lo + k : s->n;
        xs[c] = s->step[hi - 1];
        for (long i = lo; i < hi && share; i++) { // each step's total, once
            tot[i - lo] = 0;
            for (int e = 0; e < ncol; e++)
                tot[i - lo] += s->v[i * ncol + e];
        }
        for (int r = 0; r < rows; r++) {
            const int e0 = r * kr, e1 = e0 + kr < ncol ? e0 + kr : ncol;
            double sum = 0;
            long n = 0;
            for (long i = lo; i < hi; i++) {
                const double *row = s->v + i * ncol;
                double x = 0;
                int nx = 0;
                for (int e = e0; e < e1; e++) {
                    double y = share ? (tot[i - lo] > 0 ? row[e] / tot[i - lo] : NAN) : row[e];
                    if (isfinite(y)) x += y, nx++;
                }
                if (nx) sum += share ? x : x / nx, n++;
            }
            v[(size_t)r * cols + c] = n ? sum / n : NAN;
            if (n) vmin = fmin(vmin, sum / n), vmax = fmax(vmax, sum / n);
        }
    }
    for (int r = 0; r < rows; r++) {
        const int e0 = r * kr, e1 = e0 + kr < ncol ? e0 + kr : ncol;
        if (kr > 1) snprintf(range[r], sizeof range[r], "%s-%s", s->col[e0], s->col[e1 - 1]);
        names[r] = kr > 1 ? range[r] : s->col[r];
    }
    if (share) vmin = 0;
    if (!(vmin <= vmax)) vmin = 0, vmax = 1; // every cell empty
    svg_grid g = {rows, cols, v, names, xs, NULL, vmin, vmax, false};
    svg_chart c = {figure,          layer, title, "step", share ? "expert" : "column",
                   share ? 100 : 1, false, false};
    char cap[400];
    int w = 0;
    cap[0] = 0;
    if (k > 1)
        w = snprintf(cap, sizeof cap, "%ld steps drawn as %d columns, each the mean of %ld steps.",
                     s->n, cols, k);
    if (kr > 1)
        snprintf(cap + w, sizeof cap - w, "%s%d %s drawn as %d rows, each the %s of %d.",
                 w ? " " : "", ncol, share ? "experts" : "columns", rows,
                 share ? "summed share" : "mean", kr);
    int rc = svg_heatmap(f, &c, &g, cap);
    free(v), free(xs), free(tot), free(names), free(range);
    return rc;
}

// Task x expert shares of one layer's first choices (each task's row sums to
// 100%). Past MOE_REPORT_MAX_ROWS experts, ke consecutive ones share a
// column, their shares summed (a range of experts' share), as the rows of the
// heatmaps over steps.
static int usage_heatmap(FILE *f, const moe_run_metrics *m, const moe_usage *u) {
    const int ke = (u->E + MOE_REPORT_MAX_ROWS - 1) / MOE_REPORT_MAX_ROWS,
              nc = (u->E + ke - 1) / ke;
    double *v = calloc((size_t)m->n_tasks * nc + 1, sizeof(double));
    const char **rows = calloc((size_t)m->n_tasks + 1, sizeof(char *)),
               **cols = calloc((size_t)nc + 1, sizeof(char *));
    char(*cn)[32] = calloc((size_t)nc + 1, sizeof *cn);
    int rc = 0;
    if (!v || !rows || !cols || !cn) {
        rc = moe_fail(MOE_ENOMEM, "report: out of memory");
        goto done;
    }
    for (int t = 0; t < m->n_tasks; t++) {
        double tot = 0;
        for (int e = 0; e < u->E; e++)
            tot += u->counts[t * u->E + e];
        for (int e = 0; e < u->E; e++)
            v[t * nc + e / ke] += tot > 0 ? u->counts[t * u->E + e] / tot : NAN;
        rows[t] = m->task[t];
    }
    for (int c = 0; c < nc; c++) {
        const int e1 = (c + 1) * ke < u->E ? (c + 1) * ke : u->E;
        if (ke > 1)
            snprintf(cn[c], sizeof cn[c], "e%d-e%d", c * ke, e1 - 1);
        else
            snprintf(cn[c], sizeof cn[c], "e%d", c);
        cols[c] = cn[c];
    }
    svg_grid g = {m->n_tasks, nc, v, rows, NULL, cols, 0, 1, true};
    char title[96], cap[240];
    snprintf(title, sizeof title, "Layer %d: share of each task's tokens per expert (%%)",
             u->layer);
    int w = snprintf(cap, sizeof cap, "First choices on the validation batches at step %ld.",
                     m->usage_step);
    if (ke > 1)
        snprintf(cap + w, sizeof cap - w,
                 " %d experts drawn as %d columns, each the summed share of %d.", u->E, nc, ke);
    svg_chart c = {"task_experts", u->layer, title, "expert", "task", 100, false, false};
    rc = svg_heatmap(f, &c, &g, cap);
done:
    free(v), free(rows), free(cols), free(cn);
    return rc;
}

// layerL.field -> L, or -1 when name is not a per-layer series of field.
static int layer_of(const char *name, const char *field) {
    int l, n = 0;
    if (sscanf(name, "layer%d.%n", &l, &n) != 1 || n == 0) return -1;
    return field && strcmp(name + n, field) ? -1 : l;
}

static void summary(FILE *f, moe_run_metrics *m) {
    const moe_series *loss = moe_metrics_find(m, "loss"),
                     *val = moe_metrics_find(m, "eval.val_loss"), *tm = moe_metrics_find(m, "time"),
                     *acc = moe_metrics_find(m, "eval.accuracy");
    cell c[6 + MOE_MAX_TASKS];
    int n = 0;
    cell_num(&c[n++], "steps", "%.0f", loss && loss->n ? loss->step[loss->n - 1] : NAN);
    cell_num(&c[n++], "final loss", "%.4f", last_value(loss, 0));
    cell_num(&c[n++], "final val loss", "%.4f", last_value(val, 0));
    cell_num(&c[n++], "mean tokens/s", "%.0f", mean_value(moe_metrics_find(m, "tokens_per_s")));
    cell_num(&c[n++], "mean drop rate", "%.2f%%",
             100 * mean_value(moe_metrics_find(m, "drop_rate")));
    cell_num(&c[n++], "wall time", "%.1f s", tm && tm->n > 1 ? tm->v[tm->n - 1] - tm->v[0] : NAN);
    for (int t = 0; acc && t < acc->ncol && t < MOE_MAX_TASKS; t++) {
        char head[MOE_NAME_MAX + 16];
        snprintf(head, sizeof head, "acc %s", acc->col[t]);
        cell_num(&c[n++], head, "%.1f%%", 100 * last_value(acc, t));
    }
    fputs("<h2>Summary</h2><table><tr>", f);
    for (int i = 0; i < n; i++) {
        fputs("<th>", f);
        svg_esc(f, c[i].head);
        fputs("</th>", f);
    }
    fputs("</tr>\n<tr>", f);
    for (int i = 0; i < n; i++)
        fprintf(f, "<td class=\"num\">%s</td>", c[i].val);
    fputs("</tr></table>\n", f);
    const char *warn[3] = {m->warning, m->bad_values, m->no_step};
    for (int i = 0; i < 3; i++)
        if (warn[i][0]) {
            fputs("<p class=\"warn\">", f);
            svg_esc(f, warn[i]);
            fputs("</p>\n", f);
        }
}

static int training_charts(FILE *f, moe_run_metrics *m) {
    moe_series *s;
    fputs("<h2>Training</h2><div class=\"charts\">\n", f);
    svg_line l[2];
    int n = 0;
    if ((s = moe_metrics_find(m, "loss"))) l[n++] = line_of(s, 0, "training"), s->used = true;
    if ((s = moe_metrics_find(m, "eval.val_loss")))
        l[n++] = line_of(s, 0, "validation"), s->used = true;
    MOE_TRY(chart(f, "loss", -1, "Loss", "nats/token", 1, l, n, NULL));
    static const char *one[][3] = {{"lr", "Learning rate", "lr"},
                                   {"grad_norm", "Gradient norm (before clipping)", "L2 norm"},
                                   {"tokens_per_s", "Throughput", "tokens/s"}};
    for (int i = 0; i < 3; i++)
        if ((s = moe_metrics_find(m, one[i][0]))) {
            l[0] = line_of(s, 0, one[i][0]);
            s->used = true;
            MOE_TRY(chart(f, one[i][0], -1, one[i][1], one[i][2], 1, l, 1, NULL));
        }
    fputs("</div>\n", f);
    return 0;
}

static int expert_charts(FILE *f, moe_run_metrics *m) {
    svg_line *l = calloc((size_t)m->n + 13, sizeof *l); // + capacity lines
    char(*names)[24] = calloc((size_t)m->n + 13, sizeof *names);
    int n = 0, rc = 0;
    if (!l || !names) {
        free(l), free(names);
        return moe_fail(MOE_ENOMEM, "report: out of memory");
    }
    fputs("<h2>Experts</h2><div class=\"charts\">\n", f);
    moe_series *s = moe_metrics_find(m, "drop_rate");
    if (s) l[n++] = line_of(s, 0, "all layers"), s->used = true;
    for (int i = 0; i < m->n; i++) {
        int layer = layer_of(m->s[i].name, "drop_rate");
        if (layer < 0 || m->s[i].ncol != 1) continue;
        snprintf(names[n], sizeof names[n], "layer %d", layer);
        l[n] = line_of(&m->s[i], 0, names[n]);
        n++;
        m->s[i].used = true;
    }
    if (n) rc = chart(f, "drop_rate", -1, "Dropped assignments", "%", 100, l, n, NULL);
    fputs("</div>\n", f);
    for (int i = 0; i < m->n && rc == 0; i++) {
        int layer = layer_of(m->s[i].name, "load");
        if (layer < 0) continue;
        char title[96], cname[32];
        fprintf(f, "<h3>Layer %d</h3><div class=\"charts\">\n", layer);
        snprintf(title, sizeof title, "Layer %d: share of routed tokens per expert (%%)", layer);
        m->s[i].used = true;
        rc = series_heatmap(f, "load", layer, title, &m->s[i], true);
        snprintf(cname, sizeof cname, "layer%d.capacity", layer);
        moe_series *cap = moe_metrics_find(m, cname);
        if (cap && rc == 0) {
            cap->used = true;
            snprintf(title, sizeof title, "Layer %d: capacity per expert (slots)", layer);
            if (cap->ncol <= 12) {
                for (int e = 0; e < cap->ncol; e++)
                    l[e] = line_of(cap, e, cap->col[e]);
                rc = chart(f, "capacity", layer, title, "slots", 1, l, cap->ncol, NULL);
            } else {
                rc = series_heatmap(f, "capacity", layer, title, cap, false);
            }
        }
        fputs("</div>\n", f);
    }
    free(l), free(names);
    return rc;
}

static int eval_charts(FILE *f, moe_run_metrics *m) {
    moe_series *loss = moe_metrics_find(m, "eval.task_loss"),
               *acc = moe_metrics_find(m, "eval.accuracy");
    if (!loss && !m->n_usage) return 0;
    fputs("<h2>Evaluation</h2><div class=\"charts\">\n", f);
    svg_line l[MOE_MAX_TASKS];
    if (loss) {
        loss->used = true;
        for (int t = 0; t < loss->ncol && t < MOE_MAX_TASKS; t++)
            l[t] = line_of(loss, t, loss->col[t]);
        MOE_TRY(chart(f, "task_loss", -1, "Validation loss per task", "nats/token", 1, l,
                      loss->ncol, NULL));
    }
    bool any = false; // accuracy is scored on the synthetic tasks only
    for (long i = 0; acc && i < acc->n * acc->ncol; i++)
        any |= isfinite(acc->v[i]);
    if (acc) acc->used = true;
    if (any) {
        for (int t = 0; t < acc->ncol && t < MOE_MAX_TASKS; t++)
            l[t] = line_of(acc, t, acc->col[t]);
        MOE_TRY(chart(f, "task_accuracy", -1, "Exact-match accuracy per task", "%", 100, l,
                      acc->ncol, "Greedy answers to validation prompts."));
    }
    for (int i = 0; i < m->n_usage; i++)
        MOE_TRY(usage_heatmap(f, m, &m->usage[i]));
    fputs("</div>\n", f);
    return 0;
}

static bool any_nonzero(const moe_series *s) {
    for (long i = 0; s && i < s->n * s->ncol; i++)
        if (s->v[i] != 0 && isfinite(s->v[i])) return true;
    return false;
}

static int comm_charts(FILE *f, moe_run_metrics *m) {
    moe_series *b = moe_metrics_find(m, "comm.a2a_bytes"), *t = moe_metrics_find(m, "comm.a2a_s");
    if (!any_nonzero(b)) return 0; // no expert parallelism: nothing was exchanged
    fputs("<h2>Communication</h2><div class=\"charts\">\n", f);
    svg_line l;
    if (b) {
        l = line_of(b, 0, "all-to-all bytes"), b->used = true;
        MOE_TRY(chart(f, "a2a_bytes", -1, "All-to-all bytes sent per step (this rank)", "bytes", 1,
                      &l, 1, NULL));
    }
    if (t) {
        l = line_of(t, 0, "all-to-all time"), t->used = true;
        MOE_TRY(chart(f, "a2a_time", -1, "All-to-all time per step (this rank)", "ms", 1000, &l, 1,
                      NULL));
    }
    fputs("</div>\n", f);
    return 0;
}

// Every series not drawn above: scalars one chart each, per-layer fields one
// chart per field with a line per layer (a statistic added to the records
// later appears here without a change to this file).
static int other_charts(FILE *f, moe_run_metrics *m, bool comm) {
    svg_line *l = calloc((size_t)m->n + 1, sizeof *l);
    char(*names)[24] = calloc((size_t)m->n + 1, sizeof *names);
    int rc = l && names ? 0 : moe_fail(MOE_ENOMEM, "report: out of memory");
    bool header = false;
    for (int i = 0; i < m->n && rc == 0; i++) {
        moe_series *s = &m->s[i];
        if (s->used || !strcmp(s->name, "time") || !strcmp(s->name, "eval.time")) continue;
        if (!strncmp(s->name, "comm.", 5) && !comm) continue; // one process: timer noise
        if (!header) fputs("<h2>Other series</h2><div class=\"charts\">\n", f), header = true;
        int layer = layer_of(s->name, NULL);
        char fig[128];
        if (layer >= 0 && s->ncol == 1) { // a per-layer scalar: gather its layers
            const char *field = strchr(s->name, '.') + 1;
            snprintf(fig, sizeof fig, "layer.%s", field);
            int n = 0;
            for (int j = i; j < m->n; j++) {
                int lj = layer_of(m->s[j].name, field);
                if (lj < 0 || m->s[j].ncol != 1) continue;
                snprintf(names[n], sizeof names[n], "layer %d", lj);
                l[n] = line_of(&m->s[j], 0, names[n]);
                n++;
                m->s[j].used = true;
            }
            rc = chart(f, fig, -1, fig, field, 1, l, n, NULL);
        } else if (s->ncol == 1) {
            l[0] = line_of(s, 0, s->name);
            rc = chart(f, s->name, -1, s->name, s->name, 1, l, 1, NULL);
        } else {
            rc = series_heatmap(f, s->name, layer, s->name, s, false);
        }
        s->used = true;
    }
    if (header) fputs("</div>\n", f);
    free(l), free(names);
    return rc;
}

static void config_table(FILE *f, const moe_run_metrics *m) {
    fputs("<h2>Configuration</h2>\n", f);
    if (!m->n_cfg) {
        fputs("<p>config.json is missing from the run folder.</p>\n", f);
        return;
    }
    fputs("<table><tr><th>key</th><th>value</th></tr>\n", f);
    for (int i = 0; i < m->n_cfg; i++) {
        fputs("<tr><td>", f);
        svg_esc(f, m->cfg_key[i]);
        fputs("</td><td>", f);
        svg_esc(f, m->cfg_val[i]);
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n", f);
}

int moe_report_html(moe_run_metrics *m, const char *run_dir, const char *path) {
    report_out o;
    MOE_TRY(report_out_open(&o, path));
    FILE *f = o.f;
    for (int i = 0; i < m->n; i++)
        m->s[i].used = false;
    page_open(f, "moe run report", run_dir);
    summary(f, m);
    int rc = training_charts(f, m);
    if (rc == 0) rc = expert_charts(f, m);
    if (rc == 0) rc = eval_charts(f, m);
    const bool comm = any_nonzero(moe_metrics_find(m, "comm.a2a_bytes")) ||
                      any_nonzero(moe_metrics_find(m, "comm.allreduce_bytes"));
    if (rc == 0) rc = comm_charts(f, m);
    if (rc == 0) rc = other_charts(f, m, comm);
    if (rc == 0) config_table(f, m);
    page_close(f);
    if (rc < 0) {
        report_out_discard(&o);
        return rc;
    }
    return report_out_commit(&o, path, REPORT_OUT_HTML, run_dir);
}

// ---- the comparison page of an ablation grid ------------------------------------------

static int overlay(FILE *f, const moe_report_run *runs, moe_run_metrics *ms, int n,
                   const char *series, const char *figure, const char *title, const char *ylabel,
                   double yscale) {
    svg_line *l = calloc((size_t)n + 1, sizeof *l);
    if (!l) return moe_fail(MOE_ENOMEM, "report: out of memory");
    int k = 0;
    for (int i = 0; i < n; i++) {
        const moe_series *s = ms[i].n_train ? moe_metrics_find(&ms[i], series) : NULL;
        if (s) l[k++] = line_of(s, 0, runs[i].name);
    }
    int rc = k ? chart(f, figure, -1, title, ylabel, yscale, l, k, NULL) : 0;
    free(l);
    return rc;
}

// Mean of a per-layer field over every MoE layer and step (NAN when absent).
static double mean_over_layers(const moe_run_metrics *m, const char *field) {
    double sum = 0;
    int n = 0;
    for (int i = 0; i < m->n; i++) {
        double v = layer_of(m->s[i].name, field) >= 0 ? mean_value(&m->s[i]) : NAN;
        if (isfinite(v)) sum += v, n++;
    }
    return n ? sum / n : NAN;
}

static void run_row(FILE *f, const moe_report_run *r, const moe_run_metrics *m,
                    const moe_series *acc0) {
    const moe_series *loss = moe_metrics_find(m, "loss"),
                     *acc = moe_metrics_find(m, "eval.accuracy");
    fputs("<tr><td>", f);
    svg_esc(f, r->name);
    fputs("</td><td>", f);
    svg_esc(f, r->label);
    fputs("</td>", f);
    double v[6] = {loss && loss->n ? loss->step[loss->n - 1] : NAN,
                   last_value(loss, 0),
                   last_value(moe_metrics_find(m, "eval.val_loss"), 0),
                   r->tokens_per_s > 0 ? r->tokens_per_s
                                       : mean_value(moe_metrics_find(m, "tokens_per_s")),
                   100 * mean_value(moe_metrics_find(m, "drop_rate")),
                   mean_over_layers(m, "max_vio")};
    static const char *fmt[6] = {"%.0f", "%.4f", "%.4f", "%.0f", "%.2f%%", "%.3f"};
    for (int k = 0; k < 6; k++) {
        fputs("<td class=\"num\">", f);
        if (isfinite(v[k]))
            fprintf(f, fmt[k], v[k]);
        else
            fputs("n/a", f);
        fputs("</td>", f);
    }
    for (int t = 0; acc0 && t < acc0->ncol; t++) {
        double a = acc && t < acc->ncol ? last_value(acc, t) : NAN;
        if (isfinite(a))
            fprintf(f, "<td class=\"num\">%.1f%%</td>", 100 * a);
        else
            fputs("<td class=\"num\">n/a</td>", f);
    }
    fputs("<td>", f);
    svg_esc(f, r->error && *r->error ? r->error : "ok");
    fputs("</td></tr>\n", f);
}

int moe_report_compare_html(const char *path, const char *title, const moe_report_run *runs,
                            int n) {
    moe_run_metrics *ms = calloc((size_t)n + 1, sizeof *ms);
    if (!ms) return moe_fail(MOE_ENOMEM, "report: out of memory");
    for (int i = 0; i < n; i++) // a run with no readable metrics keeps an empty (zeroed) one
        if (moe_metrics_read(runs[i].dir, &ms[i]) < 0) memset(&ms[i], 0, sizeof ms[i]);
    report_out o;
    int rc = report_out_open(&o, path);
    if (rc < 0) goto done;
    FILE *f = o.f;
    page_open(f, "moe ablation report", title);
    fputs("<h2>Runs</h2><table><tr><th>run</th><th>settings</th><th>steps</th>"
          "<th>final loss</th><th>final val loss</th><th>tokens/s</th><th>drop rate</th>"
          "<th>MaxVio</th>",
          f);
    const moe_series *acc0 = NULL; // the task columns: from the first run that has them
    for (int i = 0; i < n && !acc0; i++)
        acc0 = moe_metrics_find(&ms[i], "eval.accuracy");
    for (int t = 0; acc0 && t < acc0->ncol; t++) {
        fputs("<th>acc ", f);
        svg_esc(f, acc0->col[t]);
        fputs("</th>", f);
    }
    fputs("<th>status</th></tr>\n", f);
    for (int i = 0; i < n; i++)
        run_row(f, &runs[i], &ms[i], acc0);
    fputs("</table>\n<h2>Curves</h2><div class=\"charts\">\n", f);
    rc = overlay(f, runs, ms, n, "loss", "loss", "Training loss", "nats/token", 1);
    if (rc == 0)
        rc = overlay(f, runs, ms, n, "eval.val_loss", "val_loss", "Validation loss", "nats/token",
                     1);
    if (rc == 0)
        rc = overlay(f, runs, ms, n, "drop_rate", "drop_rate", "Dropped assignments (all layers)",
                     "%", 100);
    fputs("</div>\n", f);
    page_close(f);
    if (rc == 0)
        rc = report_out_commit(&o, path, REPORT_OUT_ABLATE_HTML, NULL);
    else
        report_out_discard(&o);
done:
    for (int i = 0; i < n; i++)
        moe_metrics_free(&ms[i]);
    free(ms);
    return rc;
}
