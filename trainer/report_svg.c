// SVG line charts and heatmaps of the run report: fixed-size charts with nice
// axis ticks (1, 2, 5 x 10^k), a legend, and native <title> tooltips instead
// of scripts. Long series are drawn as means of equal buckets of steps so a
// long run's page stays small.
#include "trainer/report_svg.h"
#include "moe/report.h"
#include "moe/shards.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

// Chart geometry: the plot area sits inside margins; the legend on the right.
enum { W = 640, H = 250, ML = 64, MR = 140, MT = 30, MB = 42 };
#define PW ((double)(W - ML - MR))
#define PH ((double)(H - MT - MB))

static const char *palette[10] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                  "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// Bytes that are not well-formed UTF-8 (a run folder named in another
// encoding) become U+FFFD, one for each maximal ill-formed part as Unicode
// recommends (a sequence cut short is one), so the page stays valid UTF-8.
void svg_esc(FILE *f, const char *s) {
    while (*s) {
        const unsigned char c = (unsigned char)*s;
        if (c >= 0x80) {
            const long len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
            const long bad = moe_utf8_bad((const unsigned char *)s, len); // stops at the NUL
            if (bad < 0)
                fwrite(s, 1, (size_t)len, f), s += len;
            else
                fputs("\xEF\xBF\xBD", f), s += bad > 0 ? bad : 1;
            continue;
        }
        switch (c) {
        case '&':
            fputs("&amp;", f);
            break;
        case '<':
            fputs("&lt;", f);
            break;
        case '>':
            fputs("&gt;", f);
            break;
        case '"':
            fputs("&quot;", f);
            break;
        case '\'':
            fputs("&#39;", f);
            break;
        default:
            // control characters are not allowed in XML 1.0 text
            fputc(c < 0x20 && c != '\t' && c != '\n' ? '?' : c, f);
        }
        s++;
    }
}

// Drops the '+' and leading zeros of a printf exponent: 1e+12 -> 1e12,
// -1e-07 -> -1e-7.
static void tidy_exponent(char *buf) {
    char *e = strchr(buf, 'e');
    if (!e) return;
    char *d = e + 1, *src = d;
    if (*src == '+')
        src++;
    else if (*src == '-')
        src++, d++;
    while (src[0] == '0' && src[1])
        src++;
    memmove(d, src, strlen(src) + 1);
}

// Scales by 10^3, 10^6 or 10^9 and names them k, M, G, choosing by the value
// as printed (999.96e6 prints "1G", not "1e+03M"); beyond the suffixes, and
// below 10^-4, an exponent alone (1e12, -1e-7), never a suffix on top of one.
void svg_fmt_num(char *buf, size_t cap, double v) {
    static const struct {
        double scale;
        const char *suffix;
    } si[] = {{1e9, "G"}, {1e6, "M"}, {1e3, "k"}};
    const double a = fabs(v);
    if (v == 0 || !isfinite(v)) {
        snprintf(buf, cap, "%g", v == 0 ? 0.0 : v); // -0 reads as 0
        return;
    }
    if (a < 1e4) {
        snprintf(buf, cap, "%.4g", v);
        if (!strchr(buf, 'e') || a < 1) { // plain, or small: the exponent form is the label
            tidy_exponent(buf);
            return;
        }
        // 9999.7 rounds to 1e+04 at 4 digits: it reads as 10k below
    }
    for (size_t i = 0; i < sizeof si / sizeof *si; i++) {
        char m[32];
        snprintf(m, sizeof m, "%.3g", v / si[i].scale);
        if (!strchr(m, 'e') && fabs(strtod(m, NULL)) >= 1) {
            snprintf(buf, cap, "%s%s", m, si[i].suffix);
            return;
        }
    }
    snprintf(buf, cap, "%.3g", v); // 1000G and up
    tidy_exponent(buf);
}

static double nice_step(double range, double target) {
    double raw = range / target, p = pow(10, floor(log10(raw))), r = raw / p;
    return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * p;
}

typedef struct {
    double lo, hi;
} range;

// Differences are taken of halves: hi - lo of finite values can overflow
// (1e308 and -1e308 in a diverged run's records), and an infinite span puts
// NaN into the coordinates.
static double half_span(double lo, double hi) {
    return hi / 2 - lo / 2;
}

// Widens an empty or degenerate range so the axis has room; the padded ends
// stay finite.
static range pad_range(double lo, double hi, bool zero_based) {
    if (!(lo <= hi)) return (range){0, 1};
    if (zero_based && lo > 0) lo = 0;
    double d = 0.08 * half_span(lo, hi);
    if (half_span(lo, hi) < 0.5e-12 * (fabs(hi) + fabs(lo)) || hi == lo)
        d = fabs(hi) > 0 ? 0.1 * fabs(hi) : 1;
    return (range){zero_based && lo == 0 ? 0 : fmax(lo - d, -DBL_MAX), fmin(hi + d, DBL_MAX)};
}

static double px(range r, double x) {
    return ML + half_span(r.lo, x) / half_span(r.lo, r.hi) * PW;
}
static double py(range r, double y) {
    return MT + PH - half_span(r.lo, y) / half_span(r.lo, r.hi) * PH;
}

static void open_svg(FILE *f, const svg_chart *c) {
    fprintf(f, "<figure class=\"chart\"><svg xmlns=\"http://www.w3.org/2000/svg\" data-figure=\"");
    svg_esc(f, c->figure);
    fputc('"', f);
    if (c->layer >= 0) fprintf(f, " data-layer=\"%d\"", c->layer);
    fprintf(f, " width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" role=\"img\">\n", W, H, W, H);
    fprintf(f, "<text class=\"title\" x=\"%d\" y=\"18\">", ML);
    svg_esc(f, c->title);
    fputs("</text>\n", f);
}

static void close_svg(FILE *f, const char *caption) {
    fputs("</svg>", f);
    if (caption && *caption) {
        fputs("<figcaption>", f);
        svg_esc(f, caption);
        fputs("</figcaption>", f);
    }
    fputs("</figure>\n", f);
}

// Axis labels, and the x axis ticks when xr is given (numeric steps).
static void axes(FILE *f, const svg_chart *c, const range *xr, const range *yr, double yscale) {
    char buf[32];
    fprintf(f, "<g class=\"axes\">");
    if (yr) {
        double st = nice_step(half_span(yr->lo, yr->hi), 2.5); // the span over 5
        for (double t = ceil(yr->lo / st) * st; t <= yr->hi + 1e-9 * st && isfinite(t); t += st) {
            double y = py(*yr, t);
            svg_fmt_num(buf, sizeof buf, fabs(t) < 1e-9 * st ? 0 : t * yscale);
            fprintf(f,
                    "<line class=\"grid\" x1=\"%d\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
                    "<text class=\"tick\" x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>",
                    ML, ML + PW, y, y, ML - 5, y + 4, buf);
        }
    }
    if (xr) {
        double st = nice_step(xr->hi - xr->lo, 6);
        if (st < 1) st = 1; // steps are integers
        for (double t = ceil(xr->lo / st) * st; t <= xr->hi + 1e-9 * st; t += st) {
            double x = px(*xr, t);
            svg_fmt_num(buf, sizeof buf, t);
            fprintf(f,
                    "<line class=\"tickmark\" x1=\"%.1f\" x2=\"%.1f\" y1=\"%.1f\" y2=\"%.1f\"/>"
                    "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>",
                    x, x, MT + PH, MT + PH + 4, x, MT + PH + 16, buf);
        }
    }
    fprintf(f, "<rect class=\"frame\" x=\"%d\" y=\"%d\" width=\"%.0f\" height=\"%.0f\"/>", ML, MT,
            PW, PH);
    fprintf(f, "<text class=\"label\" x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">", ML + PW / 2,
            H - 6);
    svg_esc(f, c->xlabel ? c->xlabel : "step");
    fprintf(f,
            "</text><text class=\"label\" transform=\"translate(14 %.1f) rotate(-90)\" "
            "text-anchor=\"middle\">",
            MT + PH / 2);
    svg_esc(f, c->ylabel ? c->ylabel : "");
    fputs("</text></g>\n", f);
}

static void legend_entry(FILE *f, int i, const char *label, const char *color, bool dashed) {
    double y = MT + 6 + 15 * i;
    fprintf(f,
            "<line x1=\"%d\" x2=\"%d\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>"
            "<text class=\"legend\" x=\"%d\" y=\"%.1f\">",
            W - MR + 10, W - MR + 26, y, y, color, dashed ? " stroke-dasharray=\"4 2\"" : "",
            W - MR + 30, y + 4);
    char s[24]; // long labels are cut in the legend; the line's tooltip has them whole
    snprintf(s, sizeof s, "%s", label);
    if (strlen(label) >= sizeof s) {
        // Cut before a whole UTF-8 character: a lead byte without its
        // continuation bytes would make the page invalid UTF-8.
        size_t k = sizeof s - 4;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80)
            k--;
        strcpy(s + k, "...");
    }
    svg_esc(f, s);
    fputs("</text>", f);
}

// Bucket means: n points become ceil(n / k) with k = ceil(n / MAX_POINTS).
static long downsample(const svg_line *l, double *x, double *y, long *k_out) {
    long k = (l->n + MOE_REPORT_MAX_POINTS - 1) / MOE_REPORT_MAX_POINTS, m = 0;
    if (k < 1) k = 1;
    for (long i = 0; i < l->n; i += k) {
        double sx = 0, sy = 0;
        long c = 0, cx = 0;
        for (long j = i; j < i + k && j < l->n; j++) {
            sx += l->x[j], cx++;
            double v = l->y[j * l->stride];
            if (isfinite(v)) sy += v / k, c++; // (a sum of k values near DBL_MAX overflows)
        }
        if (!c) continue; // no value in the bucket (null accuracy): a gap, not a point
        x[m] = sx / cx, y[m] = sy / c * k;
        m++;
    }
    *k_out = k;
    return m;
}

int svg_line_chart(FILE *f, const svg_chart *c, const svg_line *lines, int n_lines,
                   const char *caption) {
    double **xs = calloc(n_lines ? n_lines : 1, sizeof *xs),
           **ys = calloc(n_lines ? n_lines : 1, sizeof *ys);
    long *np = calloc(n_lines ? n_lines : 1, sizeof *np), kmax = 1, nmax = 0;
    int rc = xs && ys && np ? 0 : -1;
    double xlo = INFINITY, xhi = -INFINITY, ylo = INFINITY, yhi = -INFINITY;
    for (int i = 0; i < n_lines && rc == 0; i++) {
        long m = lines[i].n ? lines[i].n : 1, k;
        xs[i] = malloc(sizeof(double) * m), ys[i] = malloc(sizeof(double) * m);
        if (!xs[i] || !ys[i]) {
            rc = -1;
            break;
        }
        np[i] = downsample(&lines[i], xs[i], ys[i], &k);
        if (k > kmax) kmax = k, nmax = lines[i].n;
        for (long j = 0; j < np[i]; j++) {
            xlo = fmin(xlo, xs[i][j]), xhi = fmax(xhi, xs[i][j]);
            ylo = fmin(ylo, ys[i][j]), yhi = fmax(yhi, ys[i][j]);
        }
    }
    if (rc < 0) goto done;
    const double yscale = c->yscale ? c->yscale : 1;
    if (c->zero && ylo <= yhi && yhi <= 0) yhi = 1;
    range xr = pad_range(xlo, xhi, false), yr = pad_range(ylo, yhi, c->zero);
    if (xlo <= xhi && xhi > xlo) xr = (range){xlo, xhi}; // steps span the axis exactly
    open_svg(f, c);
    axes(f, c, &xr, &yr, yscale);
    char buf[32], buf2[32];
    for (int i = 0; i < n_lines; i++) {
        const char *color = palette[i % 10];
        bool dashed = (i / 10) % 2 == 1;
        fprintf(f, "<polyline class=\"line\" data-series=\"");
        svg_esc(f, lines[i].label);
        fprintf(f, "\" stroke=\"%s\"%s points=\"", color,
                dashed ? " stroke-dasharray=\"4 2\"" : "");
        for (long j = 0; j < np[i]; j++)
            fprintf(f, "%s%.1f,%.1f", j ? " " : "", px(xr, xs[i][j]), py(yr, ys[i][j]));
        fputs("\"><title>", f);
        svg_esc(f, lines[i].label);
        fputs("</title></polyline>\n", f);
        if (np[i] <= 25) // few points (evaluations): markers with the value as tooltip
            for (long j = 0; j < np[i]; j++) {
                svg_fmt_num(buf, sizeof buf, xs[i][j]);
                snprintf(buf2, sizeof buf2, "%.4g", ys[i][j] * yscale);
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"2.5\" fill=\"%s\"><title>",
                        px(xr, xs[i][j]), py(yr, ys[i][j]), color);
                svg_esc(f, lines[i].label);
                fprintf(f, ", step %s: %s</title></circle>", buf, buf2);
            }
    }
    if (c->legend) {
        fputs("<g class=\"legend\">", f);
        for (int i = 0; i < n_lines && i < 12; i++)
            legend_entry(f, i, lines[i].label, palette[i % 10], (i / 10) % 2 == 1);
        fputs("</g>\n", f);
    }
    char cap[512];
    if (kmax > 1)
        snprintf(cap, sizeof cap, "%s%s%ld steps drawn as %ld points, each the mean of %ld steps.",
                 caption ? caption : "", caption && *caption ? " " : "", nmax,
                 (nmax + kmax - 1) / kmax, kmax);
    else
        snprintf(cap, sizeof cap, "%s", caption ? caption : "");
    close_svg(f, cap);
done:
    for (int i = 0; xs && ys && i < n_lines; i++)
        free(xs[i]), free(ys[i]);
    free(xs);
    free(ys);
    free(np);
    return rc;
}

// White to dark blue (ColorBrewer Blues), t in [0, 1].
static void blue(double t, char *buf) {
    static const int stops[5][3] = {
        {247, 251, 255}, {198, 219, 239}, {107, 174, 214}, {33, 113, 181}, {8, 48, 107}};
    t = t < 0 ? 0 : t > 1 ? 1 : t;
    double s = t * 4;
    int i = s >= 4 ? 3 : (int)s;
    double u = s - i;
    int rgb[3];
    for (int k = 0; k < 3; k++)
        rgb[k] = (int)lround(stops[i][k] + u * (stops[i + 1][k] - stops[i][k]));
    snprintf(buf, 8, "#%02x%02x%02x", rgb[0], rgb[1], rgb[2]);
}

int svg_heatmap(FILE *f, const svg_chart *c, const svg_grid *g, const char *caption) {
    const double yscale = c->yscale ? c->yscale : 1, cw = PW / g->cols, ch = PH / g->rows;
    const double span = g->vmax > g->vmin ? g->vmax - g->vmin : 1;
    const bool tips = (long)g->rows * g->cols <= 640; // tooltips cost ~40 bytes a cell
    char color[8], buf[32];
    open_svg(f, c);
    range xr = {0, 1};
    if (g->xs && g->cols > 0) { // column i spans [xs[i-1], xs[i]] in steps
        double first = g->cols > 1 ? g->xs[0] - (g->xs[1] - g->xs[0]) : g->xs[0] - 1;
        xr = (range){first, g->xs[g->cols - 1]};
    }
    axes(f, c, g->xs ? &xr : NULL, NULL, 1);
    fputs("<g class=\"cells\">", f);
    for (int r = 0; r < g->rows; r++)
        for (int k = 0; k < g->cols; k++) {
            double v = g->v[(size_t)r * g->cols + k];
            if (!isfinite(v)) continue;
            blue((v - g->vmin) / span, color);
            fprintf(f,
                    "<rect class=\"cell\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                    "fill=\"%s\">",
                    ML + k * cw, MT + r * ch, cw + 0.1, ch + 0.1, color);
            if (tips) {
                fputs("<title>", f);
                svg_esc(f, g->row_names[r]);
                if (g->xs)
                    svg_fmt_num(buf, sizeof buf, g->xs[k]), fprintf(f, ", step %s", buf);
                else
                    fputs(", ", f), svg_esc(f, g->col_names[k]);
                fprintf(f, ": %.4g</title>", v * yscale);
            }
            fputs("</rect>", f);
            if (g->cell_text && cw >= 26 && ch >= 13)
                fprintf(f,
                        "<text class=\"cellv\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
                        "fill=\"%s\">%.0f</text>",
                        ML + (k + 0.5) * cw, MT + (r + 0.5) * ch + 4,
                        (v - g->vmin) / span > 0.55 ? "#fff" : "#000", v * yscale);
        }
    fputs("</g>\n<g class=\"axes\">", f);
    int every = g->rows > 16 ? (g->rows + 15) / 16 : 1;
    for (int r = 0; r < g->rows; r += every) {
        fprintf(f, "<text class=\"tick\" x=\"%d\" y=\"%.1f\" text-anchor=\"end\">", ML - 5,
                MT + (r + 0.5) * ch + 4);
        svg_esc(f, g->row_names[r]);
        fputs("</text>", f);
    }
    if (!g->xs) {
        int ev = g->cols > 16 ? (g->cols + 15) / 16 : 1;
        for (int k = 0; k < g->cols; k += ev) {
            fprintf(f, "<text class=\"tick\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">",
                    ML + (k + 0.5) * cw, MT + PH + 16);
            svg_esc(f, g->col_names[k]);
            fputs("</text>", f);
        }
    }
    // the colour scale: ten steps from vmin to vmax
    for (int i = 0; i < 10; i++) {
        blue((9 - i) / 9.0, color);
        fprintf(f, "<rect x=\"%d\" y=\"%.1f\" width=\"12\" height=\"%.1f\" fill=\"%s\"/>",
                W - MR + 14, MT + i * PH / 10, PH / 10 + 0.05, color);
    }
    svg_fmt_num(buf, sizeof buf, g->vmax * yscale);
    fprintf(f, "<text class=\"tick\" x=\"%d\" y=\"%d\">%s</text>", W - MR + 30, MT + 8, buf);
    svg_fmt_num(buf, sizeof buf, g->vmin * yscale);
    fprintf(f, "<text class=\"tick\" x=\"%d\" y=\"%.1f\">%s</text></g>\n", W - MR + 30, MT + PH,
            buf);
    close_svg(f, caption);
    return 0;
}
