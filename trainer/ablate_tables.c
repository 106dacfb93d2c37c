// The tables of an ablation: results.csv (every run in grid order, text cells
// quoted per RFC 4180) and results.md (ranked by final validation loss, '|'
// escaped), with one column per task of any run.
#include "moe/ablate.h"
#include "moe/error.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// results.md's order: finished runs with a finite loss, ascending; then
// finished runs whose loss is NaN or Inf (status "nan"); then failed runs,
// then a stopped one. Ties keep the run order (qsort is not stable: the index
// decides).
static int rank_class(const moe_ablate_row *r) {
    return r->stopped ? 3 : !r->ok ? 2 : isfinite(r->val_loss) ? 0 : 1;
}

static int by_loss(const void *a, const void *b) {
    const moe_ablate_row *x = *(const moe_ablate_row *const *)a,
                         *y = *(const moe_ablate_row *const *)b;
    const int cx = rank_class(x), cy = rank_class(y);
    if (cx != cy) return cx - cy;
    if (cx == 0 && x->val_loss != y->val_loss) return x->val_loss < y->val_loss ? -1 : 1;
    return (x > y) - (x < y);
}

static const char *status_of(const moe_ablate_row *r) {
    return r->stopped ? "stopped" : !r->ok ? "failed" : isfinite(r->val_loss) ? "ok" : "nan";
}

// A CSV field per RFC 4180: in double quotes, a quote inside doubled (a
// value or a message may hold commas, quotes and line breaks).
static void csv_quoted(FILE *f, const char *s) {
    fputc('"', f);
    for (; *s; s++) {
        if (*s == '"') fputc('"', f);
        fputc(*s, f);
    }
    fputc('"', f);
}

static void csv_text(FILE *f, const char *s) {
    if (!s[strcspn(s, "\",\r\n")]) { // a header name that needs no quotes keeps none
        fputs(s, f);
        return;
    }
    csv_quoted(f, s);
}

// Text in a Markdown table cell: '|' would end the cell and a line break the
// row, so '|' is escaped (\|) and line breaks become spaces.
static void md_text(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '|' || *s == '\\') fputc('\\', f);
        fputc(*s == '\n' || *s == '\r' ? ' ' : *s, f);
    }
}

// Column of task name in cols (the union over every run, first seen first).
static int task_col(char (*cols)[MOE_NAME_MAX], int n_cols, const char *name) {
    for (int c = 0; c < n_cols; c++)
        if (!strcmp(cols[c], name)) return c;
    return -1;
}

// Run r's accuracy in column c: -1 when r has no such task or no figure for it.
static double acc_in(const moe_ablate_row *r, char (*cols)[MOE_NAME_MAX], int c) {
    for (int t = 0; r->ok && t < r->n_tasks; t++)
        if (!strcmp(r->task[t], cols[c])) return r->accuracy[t];
    return -1;
}

// Closes f; true when a write or the close failed (full disk, I/O error).
static bool closed_bad(FILE *f) {
    bool bad = ferror(f) != 0;
    return fclose(f) != 0 || bad;
}

// results.csv in run order, results.md in rank order. Task columns are the
// union of every run's tasks (grids over data.tasks give runs different
// sets); a run without a figure leaves its cell empty in both files.
int moe_ablate_write_results(const char *out, const moe_grid_axis *axes, int n_axes,
                             const moe_ablate_row *rows, int n) {
    char(*cols)[MOE_NAME_MAX] = calloc((size_t)n * MOE_MAX_TASKS + 1, sizeof *cols);
    const moe_ablate_row **order = calloc((size_t)n, sizeof *order);
    if (!cols || !order) {
        free(cols);
        free(order);
        return moe_fail(MOE_ENOMEM, "out of memory (ablation grid)");
    }
    int n_cols = 0;
    for (int i = 0; i < n; i++) {
        order[i] = &rows[i];
        for (int t = 0; t < rows[i].n_tasks; t++)
            if (task_col(cols, n_cols, rows[i].task[t]) < 0)
                snprintf(cols[n_cols++], MOE_NAME_MAX, "%s", rows[i].task[t]);
    }
    int rc = 0;
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/results.csv", out);
    FILE *f = fopen(path, "w");
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    fprintf(f, "run");
    for (int a = 0; a < n_axes; a++)
        fprintf(f, ",%s", axes[a].key);
    fprintf(f, ",status,val_loss,tokens_per_s,drop_rate,max_vio,seconds");
    for (int c = 0; c < n_cols; c++) {
        char name[MOE_NAME_MAX + 8];
        snprintf(name, sizeof name, "acc_%s", cols[c]);
        fputc(',', f);
        csv_text(f, name);
    }
    fprintf(f, ",error\n");
    for (int i = 0; i < n; i++) {
        const moe_ablate_row *r = &rows[i];
        fprintf(f, "%d", i);
        for (int a = 0; a < n_axes; a++) {
            fputc(',', f);
            csv_quoted(f, axes[a].values[r->idx[a]]);
        }
        // A run that failed or was stopped has no final figures: empty cells
        // (its seconds are still the time it took).
        fprintf(f, ",%s,", status_of(r));
        if (r->ok)
            fprintf(f, "%.6f,%.1f,%.6f,%.4f", r->val_loss, r->tokens_per_s, r->drop_rate,
                    r->max_vio);
        else
            fprintf(f, ",,,");
        fprintf(f, ",%.1f", r->seconds);
        for (int c = 0; c < n_cols; c++) {
            const double acc = acc_in(r, cols, c);
            if (acc >= 0)
                fprintf(f, ",%.4f", acc);
            else
                fputc(',', f);
        }
        fputc(',', f);
        csv_quoted(f, r->error);
        fputc('\n', f);
    }
    if (closed_bad(f)) {
        rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
        goto done;
    }
    qsort(order, n, sizeof *order, by_loss);
    snprintf(path, sizeof path, "%s/results.md", out);
    f = fopen(path, "w");
    if (!f) {
        rc = moe_fail(MOE_EIO, "%s: cannot create: %s", path, strerror(errno));
        goto done;
    }
    fprintf(f, "| rank |");
    for (int a = 0; a < n_axes; a++) {
        fputc(' ', f);
        md_text(f, axes[a].key);
        fprintf(f, " |");
    }
    fprintf(f, " val loss |");
    for (int c = 0; c < n_cols; c++) {
        fprintf(f, " acc ");
        md_text(f, cols[c]);
        fprintf(f, " |");
    }
    fprintf(f, " tokens/s | drop rate | MaxVio |\n|---|");
    for (int a = 0; a < n_axes + 4 + n_cols; a++)
        fprintf(f, "---|");
    fputc('\n', f);
    for (int i = 0; i < n; i++) {
        const moe_ablate_row *r = order[i];
        fprintf(f, "| %d |", i + 1);
        for (int a = 0; a < n_axes; a++) {
            fputc(' ', f);
            md_text(f, axes[a].values[r->idx[a]]);
            fprintf(f, " |");
        }
        if (!r->ok) {
            if (!r->stopped) fprintf(f, " failed:");
            fputc(' ', f);
            md_text(f, r->error);
            fprintf(f, " |");
            for (int t = 0; t < n_cols + 3; t++)
                fprintf(f, " |");
            fputc('\n', f);
            continue;
        }
        if (isfinite(r->val_loss))
            fprintf(f, " %.4f |", r->val_loss);
        else // ranked after every finite loss
            fprintf(f, " %s (not finite) |",
                    isnan(r->val_loss) ? "nan"
                    : r->val_loss > 0  ? "inf"
                                       : "-inf");
        for (int c = 0; c < n_cols; c++) {
            const double acc = acc_in(r, cols, c);
            if (acc < 0)
                fprintf(f, " n/a |");
            else
                fprintf(f, " %.1f%% |", 100 * acc);
        }
        fprintf(f, " %.0f | %.2f%% | %.3f |\n", r->tokens_per_s, 100 * r->drop_rate, r->max_vio);
    }
    if (closed_bad(f)) rc = moe_fail(MOE_EIO, "%s: write failed: %s", path, strerror(errno));
done:
    free(cols);
    free(order);
    return rc;
}
