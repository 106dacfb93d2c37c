// SVG charts for the run report (trainer/report_html.c): line charts and
// heatmaps with axes, ticks, labels and legends, written as inline SVG that
// is also well-formed XML. Every string from input goes through svg_esc.
#ifndef MOE_REPORT_SVG_H
#define MOE_REPORT_SVG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

// Writes s with & < > " ' escaped (text and attribute values alike), control
// characters as '?' and bytes that are not well-formed UTF-8 as U+FFFD.
void svg_esc(FILE *f, const char *s);

// A short axis label for v into buf [cap]: 0, 0.0012, 1500, 12.3k, 2.5M, 1G,
// and exponents beyond those (1e12, 1e299, -1e-7), never a suffix on one.
void svg_fmt_num(char *buf, size_t cap, double v);

// One line: n points (x[i], y[i * stride]); non-finite y are left out.
typedef struct {
    const char *label;
    long n;
    const double *x, *y;
    int stride;
} svg_line;

typedef struct {
    const char *figure; // data-figure: what the test and a reader look for
    int layer;          // data-layer, -1 for none
    const char *title, *xlabel, *ylabel;
    double yscale; // values are drawn multiplied by it (100 for percentages); 0 means 1
    bool legend;
    bool zero; // the y axis starts at 0 (shares, rates); all zero draws 0..1
} svg_chart;

// A line chart; lines longer than MOE_REPORT_MAX_POINTS are drawn as bucket
// means and the caption says so. Returns 0, or -1 when out of memory.
int svg_line_chart(FILE *f, const svg_chart *c, const svg_line *lines, int n_lines,
                   const char *caption);

// A heatmap of rows x cols cells (NAN cells blank) on a white-to-blue scale
// from vmin to vmax. Columns are steps when xs is given (the x axis is
// numeric), else named by col_names. cell_text prints each value (as
// yscale * v) inside its cell when the cells are large enough.
typedef struct {
    int rows, cols;
    const double *v; // [rows, cols]
    const char *const *row_names;
    const double *xs;             // [cols] step of each column, or NULL
    const char *const *col_names; // [cols] when xs is NULL
    double vmin, vmax;
    bool cell_text;
} svg_grid;
int svg_heatmap(FILE *f, const svg_chart *c, const svg_grid *g, const char *caption);

#endif
