// Ablation grids: every combination runs with the same seed, a failing run
// is recorded in its row while the rest go on, results.md is sorted by loss.
#include "moe/ablate.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/fsio.h"
#include "testutil.h"
#include "trainer/ablate_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int count_lines(const char *path, const char *needle) {
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f))
        n += !needle || strstr(line, needle) != NULL;
    fclose(f);
    return n;
}

START_TEST(test_grid_runs_every_combination) {
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=2",  "model.d_ff=48",
                          "model.seq_len=32", "moe.num_experts=4", "train.batch_size=4",
                          "train.steps=6",    "train.eval_every=0"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    moe_grid_axis ax[2];
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], "router.slot_order=position,priority"), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "router.top_k=1,9"), 0); // 9 > 4 experts
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/grid", tu_tmpdir());
    // A combination the config check refuses stops the grid before any run.
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "--grid router.top_k: ") != NULL, "%s",
                  moe_last_error());
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "(grid run 3 of 4: "));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "exceeds"));
    ck_assert_int_eq(access(out, F_OK), -1);
    // A run that fails while training (lr 1e30 diverges) is a row of the
    // table, and the ablation as a whole fails (moe ablate exits 1).
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "train.lr=1e-2,1e30"), 0);
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_ENUMERIC);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "2 of 4 runs failed"));
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, NULL), 5); // header + 4 runs
    ck_assert_int_eq(count_lines(p, ",ok,"), 2);
    ck_assert_int_eq(count_lines(p, "step "), 2); // the divergence message names the step
    snprintf(p, sizeof p, "%s/results.md", out);
    ck_assert_int_eq(count_lines(p, "failed: "), 2);
    // sorted: the two finished runs first, ascending loss
    FILE *f = fopen(p, "r");
    char line[4096];
    double prev = -1;
    int rows = 0;
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "| ", 2) || strstr(line, "rank") || strstr(line, "failed")) continue;
        // | rank | slot_order | top_k | val loss | ...
        char *cell = line;
        for (int k = 0; k < 4; k++)
            cell = strchr(cell + 1, '|');
        double loss = strtod(cell + 1, NULL);
        ck_assert(loss >= prev);
        prev = loss;
        rows++;
    }
    fclose(f);
    ck_assert_int_eq(rows, 2);
    snprintf(p, sizeof p, "%s/run_000/config.json", out);
    ck_assert_int_gt(count_lines(p, NULL), 10);
}
END_TEST

START_TEST(test_grid_parse_and_bad_values) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=[4,8],8,[2,2]"), 0);
    ck_assert_int_eq(ax.n, 3);
    ck_assert_str_eq(ax.values[0], "[4,8]");
    ck_assert_str_eq(ax.values[2], "[2,2]");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k"), MOE_EINVAL);
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,,2"), MOE_EINVAL);
    ck_assert_str_eq(moe_last_error(), "--grid router.top_k: value 2 is empty"); // 1-based
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2,1"), MOE_EINVAL);
    ck_assert_str_eq(moe_last_error(), "--grid router.top_k: value 3 repeats value 1 (1)");
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "moe.num_experts=[4,8],[4,8]"), MOE_EINVAL);
    moe_config c;
    moe_config_default(&c);
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.slot_order=position,sideways"), 0);
    char out[700];
    snprintf(out, sizeof out, "%s/bad", tu_tmpdir());
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL); // before any training
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "sideways"));
}
END_TEST

// --grid config=A,B: each run loads its file over the base, the --set values
// win over the file (train.steps), and the other axes apply last. B starts
// with a UTF-8 byte order mark: --resume still notices its edit.
START_TEST(test_grid_over_config_files) {
    char dir[600], a[700], b[700], out[700], p[800];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(a, sizeof a, "%s/a.json", dir);
    snprintf(b, sizeof b, "%s/b.json", dir);
    FILE *f = fopen(a, "w");
    fputs("{\"router\": {\"score\": \"softmax\"}, \"train\": {\"steps\": 500}}", f);
    fclose(f);
    f = fopen(b, "w"); // with a byte order mark: loaded, and recorded, past it
    fputs("\xEF\xBB\xBF{\"router\": {\"score\": \"sigmoid\", \"bias_update_rate\": 0.001}}", f);
    fclose(f);
    moe_config c;
    moe_config_default(&c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=2",  "model.d_ff=48",
                          "model.seq_len=32", "moe.num_experts=4", "train.batch_size=4",
                          "train.steps=3",    "train.eval_every=0"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(&c, NULL, sets[i]), 0);
    moe_grid_axis ax[2];
    char spec[1500];
    snprintf(spec, sizeof spec, "config=%s,%s", a, b);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], spec), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "router.top_k=1,2"), 0);
    snprintf(out, sizeof out, "%s/grid", dir);
    ck_assert_msg(moe_ablate(&c, ax, 2, sets, 8, out, NULL) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, ",ok,"), 4);
    // run index = config + 2 * top_k: run_001 is b.json with top_k 1
    moe_config r;
    moe_config_default(&r);
    snprintf(p, sizeof p, "%s/run_001/config.json", out);
    ck_assert_msg(moe_config_load(&r, NULL, p) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.router.score, MOE_SCORE_SIGMOID);
    ck_assert_double_eq(r.router.bias_update_rate, 0.001);
    ck_assert_int_eq(r.router.top_k, 1);
    ck_assert_int_eq(r.model.d_model, 32);
    snprintf(p, sizeof p, "%s/run_002/config.json", out);
    ck_assert_msg(moe_config_load(&r, NULL, p) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.router.score, MOE_SCORE_SOFTMAX);
    ck_assert_int_eq(r.train.steps, 3); // --set over the file's 500
    ck_assert_int_eq(r.router.top_k, 2);
    // --resume with the files as they ran keeps every run; after an edit of
    // b.json it is refused naming the file (the kept runs trained the old one).
    moe_ablate_opts o = {.out = out, .sets = sets, .n_sets = 8, .resume = true};
    ck_assert_msg(moe_ablate_run(&c, ax, 2, &o) == 0, "%s", moe_last_error());
    f = fopen(b, "w");
    fputs("\xEF\xBB\xBF{\"router\": {\"score\": \"sigmoid\", \"bias_update_rate\": 0.01}}", f);
    fclose(f);
    ck_assert_int_eq(moe_ablate_run(&c, ax, 2, &o), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "b.json: the file differs") != NULL, "%s",
                  moe_last_error());
    // A file that does not load stops the grid before any run.
    snprintf(spec, sizeof spec, "config=%s,%s/none.json", a, dir);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], spec), 0);
    snprintf(out, sizeof out, "%s/grid2", dir);
    ck_assert_int_lt(moe_ablate(&c, ax, 2, sets, 8, out, NULL), 0);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "none.json"));
    ck_assert_int_eq(access(out, F_OK), -1);
}
END_TEST

static void small_config(moe_config *c) {
    moe_config_default(c);
    const char *sets[] = {"model.d_model=32", "model.n_layers=1",  "model.d_ff=32",
                          "model.seq_len=16", "moe.num_experts=4", "train.batch_size=2",
                          "train.steps=1",    "train.eval_every=0"};
    for (int i = 0; i < 8; i++)
        ck_assert_int_eq(moe_config_set(c, NULL, sets[i]), 0);
}

static const char *text_of(const char *path) {
    static char buf[16384];
    FILE *f = fopen(path, "r");
    ck_assert_msg(f != NULL, "%s missing", path);
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = 0;
    fclose(f);
    return buf;
}

// A second grid into the folder of a first: refused before any training
// (its run_000 .. run_002 would be replaced in part and run_002 left over);
// with overwrite the first ablation's files go, other files stay.
START_TEST(test_ablate_refuses_an_out_holding_an_ablation) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/grid", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2,3"), 0);
    ck_assert_msg(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/notes.txt", out);
    FILE *f = fopen(p, "w");
    fputs("mine\n", f);
    fclose(f);
    snprintf(p, sizeof p, "%s/run_000/config.json", out);
    const long before = strlen(text_of(p));
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=2,1"), 0);
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "already holds an ablation"));
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--overwrite"));
    ck_assert_int_eq((long)strlen(text_of(p)), before); // untouched
    // Only the tables (no run folder yet) are an ablation too.
    char out2[700];
    snprintf(out2, sizeof out2, "%s/tables", tu_tmpdir());
    ck_assert_int_eq(mkdir(out2, 0755), 0);
    snprintf(p, sizeof p, "%s/results.csv", out2);
    fclose(fopen(p, "w"));
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out2, NULL), MOE_EINVAL);
    // overwrite: the two new runs, no run_002, the table has two rows
    ck_assert_msg(moe_ablate_overwrite(&c, &ax, 1, NULL, 0, out, NULL) == 0, "%s",
                  moe_last_error());
    snprintf(p, sizeof p, "%s/run_002", out);
    ck_assert_int_eq(access(p, F_OK), -1);
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, NULL), 3);
    snprintf(p, sizeof p, "%s/notes.txt", out);
    ck_assert_str_eq(text_of(p), "mine\n");
    moe_config r;
    moe_config_default(&r);
    snprintf(p, sizeof p, "%s/run_000/config.json", out);
    ck_assert_msg(moe_config_load(&r, NULL, p) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.router.top_k, 2);
}
END_TEST

// The failure summary names the run that failed first in grid order (the
// tables sort the rows; the summary must not follow them), and a run failing
// at run time makes the ablation a runtime failure.
START_TEST(test_ablate_summary_names_the_first_failed_run) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700];
    snprintf(out, sizeof out, "%s/fail", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "train.lr=1e-2,1e30,2e-2"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.steps=3"), 0);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.grad_clip=0"), 0);
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_ENUMERIC);
    ck_assert_msg(strstr(moe_last_error(), "1 of 3 runs failed (first: ") != NULL, "%s",
                  moe_last_error());
    ck_assert_msg(strstr(moe_last_error(), "/run_001: ") != NULL, "%s", moe_last_error());
}
END_TEST

// Every run that fails, whatever its error (here a corrupt token file:
// MOE_EFORMAT), makes the ablation a runtime failure; the folder holds the
// tables even though no run made its folder.
START_TEST(test_ablate_failed_runs_are_a_runtime_failure) {
    moe_config c;
    small_config(&c);
    char bad[700], out[700], p[800], spec[800];
    snprintf(bad, sizeof bad, "%s/bad.bin", tu_tmpdir());
    FILE *f = fopen(bad, "w");
    for (int i = 0; i < 300; i++)
        fputs("garbage", f);
    fclose(f);
    ck_assert_int_eq(moe_config_set(&c, NULL, "data.kind=llmc"), 0);
    snprintf(spec, sizeof spec, "data.path=%s", bad);
    ck_assert_int_eq(moe_config_set(&c, NULL, spec), 0);
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2"), 0);
    snprintf(out, sizeof out, "%s/corrupt", tu_tmpdir());
    const int rc = moe_ablate(&c, &ax, 1, NULL, 0, out, NULL);
    ck_assert_msg(rc == MOE_ENUMERIC, "%d: %s", rc, moe_last_error());
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "2 of 2 runs failed"));
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, ",failed,"), 2);
}
END_TEST

// A key given twice would label one cell with both values and train the last.
START_TEST(test_ablate_refuses_a_grid_key_given_twice) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax[2];
    char out[700];
    snprintf(out, sizeof out, "%s/twice", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], "train.lr=1e-3"), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "train.lr=2e-3"), 0);
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--grid train.lr given twice"));
    ck_assert_int_eq(moe_grid_axis_parse(&ax[0], "config=a.json"), 0);
    ck_assert_int_eq(moe_grid_axis_parse(&ax[1], "config=b.json"), 0);
    ck_assert_int_eq(moe_ablate(&c, ax, 2, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "--grid config given twice"));
    ck_assert_int_eq(access(out, F_OK), -1);
}
END_TEST

static moe_ablate_row row(int idx, int ok, double loss, int n_tasks, const char *const *tasks,
                          const double *acc) {
    moe_ablate_row r;
    memset(&r, 0, sizeof r);
    r.idx[0] = idx, r.ok = ok, r.val_loss = loss, r.n_tasks = n_tasks;
    for (int t = 0; t < n_tasks; t++) {
        snprintf(r.task[t], sizeof r.task[t], "%s", tasks[t]);
        r.accuracy[t] = acc[t];
    }
    if (!ok) snprintf(r.error, sizeof r.error, "boom");
    return r;
}

// The line of results.md whose first axis cell is value (" | v |").
static const char *md_line(const char *md, const char *value, char *line, size_t n) {
    char needle[64];
    snprintf(needle, sizeof needle, "| %s |", value);
    for (const char *p = md; *p;) {
        const char *e = strchr(p, '\n');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        snprintf(line, n, "%.*s", (int)len, p);
        const char *c = strchr(line + 1, '|'); // after the rank cell
        if (c && !strncmp(c, needle, strlen(needle))) return line;
        p += len + (e != NULL);
    }
    return NULL;
}

// A run whose loss is NaN or Inf ranks after every finite loss, marked
// "nan", before the failed runs; the CSV leaves missing figures empty where
// the table says n/a.
START_TEST(test_ablate_tables_rank_non_finite_losses_last) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "model.seq_len=a,b,c,d,e"), 0);
    const char *tasks[] = {"copy"};
    const double acc[] = {0.5}, none[] = {-1};
    moe_ablate_row rows[5] = {row(0, 1, 2.0, 1, tasks, acc), row(1, 1, NAN, 1, tasks, none),
                              row(2, 0, 0, 0, NULL, NULL), row(3, 1, INFINITY, 1, tasks, acc),
                              row(4, 1, 1.0, 1, tasks, acc)};
    char out[700], p[800], line[512];
    snprintf(out, sizeof out, "%s", tu_tmpdir());
    ck_assert_int_eq(moe_ablate_write_results(out, &ax, 1, rows, 5), 0);
    snprintf(p, sizeof p, "%s/results.md", out);
    const char *md = text_of(p);
    static const char *const want[] = {"| 1 | e |", "| 2 | a |", "| 3 | b |", "| 4 | d |",
                                       "| 5 | c |"};
    for (int i = 0; i < 5; i++)
        ck_assert_msg(strstr(md, want[i]) != NULL, "no '%s' in\n%s", want[i], md);
    ck_assert_ptr_nonnull(md_line(md, "b", line, sizeof line));
    ck_assert_ptr_nonnull(strstr(line, "nan (not finite)"));
    ck_assert_ptr_nonnull(strstr(line, "n/a"));
    ck_assert_ptr_nonnull(md_line(md, "d", line, sizeof line));
    ck_assert_ptr_nonnull(strstr(line, "inf (not finite)"));
    snprintf(p, sizeof p, "%s/results.csv", out);
    ck_assert_int_eq(count_lines(p, ",nan,"), 2); // status of b and d
    ck_assert_int_eq(count_lines(p, "-1.0000"), 0);
    const char *csv = text_of(p);
    ck_assert_ptr_nonnull(strstr(csv, "\n1,\"b\",nan,nan,"));
    ck_assert_ptr_nonnull(strstr(csv, ",0.0,,\"\"\n")); // b: seconds, then an empty acc_copy
    ck_assert_ptr_nonnull(strstr(csv, "\n2,\"c\",failed,,"));
}
END_TEST

// Runs with different task sets: one column per task of any run, each
// figure under its own task, empty (n/a) where a run lacks the task.
START_TEST(test_ablate_tables_use_the_union_of_tasks) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "data.tasks=[copy,sort],[add]"), 0);
    const char *t0[] = {"copy", "sort"}, *t1[] = {"add"};
    const double a0[] = {0.25, 0.5}, a1[] = {0.75};
    moe_ablate_row rows[2] = {row(0, 1, 2.0, 2, t0, a0), row(1, 1, 1.0, 1, t1, a1)};
    char out[700], p[800], line[512];
    snprintf(out, sizeof out, "%s", tu_tmpdir());
    ck_assert_int_eq(moe_ablate_write_results(out, &ax, 1, rows, 2), 0);
    snprintf(p, sizeof p, "%s/results.csv", out);
    const char *csv = text_of(p);
    ck_assert_ptr_nonnull(strstr(csv, ",seconds,acc_copy,acc_sort,acc_add,error\n"));
    ck_assert_ptr_nonnull(strstr(csv, ",0.2500,0.5000,,\"\"\n"));
    ck_assert_ptr_nonnull(strstr(csv, ",,,0.7500,\"\"\n"));
    snprintf(p, sizeof p, "%s/results.md", out);
    const char *md = text_of(p);
    ck_assert_ptr_nonnull(strstr(md, "| acc copy | acc sort | acc add | tokens/s |"));
    ck_assert_ptr_nonnull(md_line(md, "[add]", line, sizeof line));
    ck_assert_msg(strstr(line, "| n/a | n/a | 75.0% |") != NULL, "%s", line);
    ck_assert_ptr_nonnull(md_line(md, "[copy,sort]", line, sizeof line));
    ck_assert_msg(strstr(line, "| 25.0% | 50.0% | n/a |") != NULL, "%s", line);
    // every row has as many cells as the header
    int cells_header = -1;
    for (const char *q = md; *q;) {
        int cells = 0;
        for (; *q && *q != '\n'; q++)
            cells += *q == '|';
        if (*q) q++;
        if (cells_header < 0) cells_header = cells;
        ck_assert_int_eq(cells, cells_header);
    }
}
END_TEST

// A value with a double quote and a message with quotes and '|': CSV cells
// are quoted with the quotes doubled (RFC 4180), Markdown cells escape '|'.
START_TEST(test_ablate_tables_escape_quotes_and_pipes) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "config=a\"b.json,x|y.json"), 0);
    moe_ablate_row rows[2] = {row(0, 1, 2.0, 0, NULL, NULL), row(1, 0, 0, 0, NULL, NULL)};
    snprintf(rows[1].error, sizeof rows[1].error, "say \"hi\" | there");
    char out[700], p[800];
    snprintf(out, sizeof out, "%s", tu_tmpdir());
    ck_assert_int_eq(moe_ablate_write_results(out, &ax, 1, rows, 2), 0);
    snprintf(p, sizeof p, "%s/results.csv", out);
    const char *csv = text_of(p);
    ck_assert_msg(strstr(csv, "\n0,\"a\"\"b.json\",ok,") != NULL, "%s", csv);
    ck_assert_msg(strstr(csv, ",\"say \"\"hi\"\" | there\"\n") != NULL, "%s", csv);
    snprintf(p, sizeof p, "%s/results.md", out);
    const char *md = text_of(p);
    ck_assert_msg(strstr(md, "| x\\|y.json | failed: say \"hi\" \\| there |") != NULL, "%s", md);
    // every row has as many unescaped '|' as the header
    int want = -1;
    for (const char *l = md; *l;) {
        int bars = 0;
        for (; *l && *l != '\n'; l++)
            bars += *l == '|' && l[-1] != '\\';
        if (want < 0) want = bars;
        ck_assert_int_eq(bars, want);
        l += *l == '\n';
    }
}
END_TEST

// A failed run has no throughput nor drop rate: empty cells, as README says
// of every missing figure (it printed 0.0 and 0.000000).
START_TEST(test_ablate_failed_row_leaves_its_figures_empty) {
    moe_grid_axis ax;
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "train.lr=1,2"), 0);
    moe_ablate_row rows[2] = {row(0, 1, 2.0, 0, NULL, NULL), row(1, 0, 0, 0, NULL, NULL)};
    rows[1].seconds = 1.5;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s", tu_tmpdir());
    ck_assert_int_eq(moe_ablate_write_results(out, &ax, 1, rows, 2), 0);
    snprintf(p, sizeof p, "%s/results.csv", out);
    const char *csv = text_of(p);
    ck_assert_msg(strstr(csv, "\n1,\"2\",failed,,,,,1.5,\"boom\"\n") != NULL, "%s", csv);
}
END_TEST

// Grid values that clash with the base are named by their --grid key (the
// message said "default"), whichever key of the pair the grid set.
START_TEST(test_ablate_cell_errors_name_the_grid_key) {
    moe_config c;
    small_config(&c);
    char out[700];
    snprintf(out, sizeof out, "%s/named", tu_tmpdir());
    static const char *const grids[][2] = {
        {"router.top_k=1,8", "--grid router.top_k: router.top_k = 8 exceeds"},
        {"moe.num_experts=1,4", "--grid moe.num_experts: router.top_k = 2 exceeds"},
        {"model.d_model=30,32", "--grid model.d_model: model.d_model = 30"}};
    for (int g = 0; g < 3; g++) {
        moe_grid_axis ax;
        ck_assert_int_eq(moe_grid_axis_parse(&ax, grids[g][0]), 0);
        ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), grids[g][1]) != NULL, "%s", moe_last_error());
        ck_assert_ptr_null(strstr(moe_last_error(), "default"));
        ck_assert_int_eq(access(out, F_OK), -1);
    }
}
END_TEST

// parallel.ep = 2 cannot run in ablate's one process: refused before run 1
// trains (it trained run 1, then failed run 2 at run time).
START_TEST(test_ablate_refuses_expert_parallel_cells_before_training) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700];
    snprintf(out, sizeof out, "%s/ep", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "parallel.ep=1,2"), 0);
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "--grid parallel.ep: parallel.ep = 2") != NULL, "%s",
                  moe_last_error());
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "grid run 2 of 2"));
    ck_assert_int_eq(access(out, F_OK), -1);
}
END_TEST

// Synthetic data reads no data.path: a grid over it would train one run
// several times.
START_TEST(test_ablate_refuses_a_data_path_grid_on_synthetic_data) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700];
    snprintf(out, sizeof out, "%s/paths", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "data.path=/x,/y"), 0);
    ck_assert_int_eq(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "--grid data.path: every run uses data.kind = "
                                           "synthetic") != NULL,
                  "%s", moe_last_error());
    ck_assert_int_eq(access(out, F_OK), -1);
}
END_TEST

// --resume continues only the grid the folder holds: another grid or another
// base config is refused naming the difference; the same grid, finished,
// keeps every run and rewrites the tables.
START_TEST(test_ablate_resume_refuses_another_grid_or_config) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/res", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2"), 0);
    moe_ablate_opts o = {.out = out};
    o.resume = true;
    ck_assert_int_eq(moe_ablate_run(&c, &ax, 1, &o), MOE_EINVAL); // nothing to resume
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "holds no ablation to continue"));
    o.resume = false;
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/results.csv", out);
    char before[16384];
    snprintf(before, sizeof before, "%s", text_of(p));
    o.resume = true;
    moe_grid_axis other;
    ck_assert_int_eq(moe_grid_axis_parse(&other, "router.top_k=1,2,3"), 0);
    ck_assert_int_eq(moe_ablate_run(&c, &other, 1, &o), MOE_EINVAL);
    ck_assert_msg(
        strstr(moe_last_error(), "router.top_k=1,2, this command's is router.top_k=1,2,3") != NULL,
        "%s", moe_last_error());
    moe_config c2 = c;
    ck_assert_int_eq(moe_config_set(&c2, NULL, "train.lr=0.5"), 0);
    ck_assert_int_eq(moe_ablate_run(&c2, &ax, 1, &o), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "train.lr = ") != NULL, "%s", moe_last_error());
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    ck_assert(!o.interrupted);
    // kept, not retrained: the same figures, the same seconds
    ck_assert_str_eq(text_of(p), before);
}
END_TEST

// One definition of tokens/s: report.html shows the run's tokens / train
// seconds as results.csv does (it showed the mean of the steps' figures).
START_TEST(test_ablate_report_tokens_per_s_is_the_tables_figure) {
    moe_config c;
    small_config(&c);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.steps=4"), 0);
    moe_grid_axis ax;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/tps", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=2"), 0);
    ck_assert_msg(moe_ablate(&c, &ax, 1, NULL, 0, out, NULL) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/results.csv", out);
    const char *csv = text_of(p);
    const char *row0 = strstr(csv, "\n0,");
    ck_assert_ptr_nonnull(row0);
    double loss, tps;
    ck_assert_int_eq(sscanf(row0, "\n0,\"2\",ok,%lf,%lf,", &loss, &tps), 2);
    // results.csv rounds to 0.1: the page's whole number is one of the two
    // around it
    char lo[64], hi[64];
    snprintf(lo, sizeof lo, "<td class=\"num\">%.0f</td>", floor(tps));
    snprintf(hi, sizeof hi, "<td class=\"num\">%.0f</td>", ceil(tps));
    snprintf(p, sizeof p, "%s/report.html", out);
    FILE *f = fopen(p, "r");
    ck_assert_ptr_nonnull(f);
    static char html[1 << 20];
    html[fread(html, 1, sizeof html - 1, f)] = 0;
    fclose(f);
    ck_assert_msg(strstr(html, lo) || strstr(html, hi), "neither %s nor %s in report.html", lo, hi);
}
END_TEST

// A damaged ablate.json is refused by --resume with a message naming the
// file (and the run), never a crash nor a silently shorter grid.
START_TEST(test_ablate_resume_refuses_a_damaged_state_file) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/damaged", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2"), 0);
    moe_ablate_opts o = {.out = out};
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/ablate.json", out);
    static char good[1 << 16];
    snprintf(good, sizeof good, "%s", text_of(p));
    const char *runs = strstr(good, "\"runs\"");
    ck_assert_ptr_nonnull(runs);
    const int head = (int)(runs - good);
    static const char *const tails[][2] = {
        {"\"runs\": [null]}", "one entry per run"},
        {"\"runs\": [null, 3]}", "runs[1]: expected an object or null"},
        {"\"runs\": [null, {\"status\": \"ok\"}]}", "runs[1]: expected status"},
        {"\"runs\": [null, {", ""}, // cut short
    };
    o.resume = true;
    for (int i = 0; i < 4; i++) {
        FILE *f = fopen(p, "w");
        fprintf(f, "%.*s%s", head, good, tails[i][0]);
        fclose(f);
        ck_assert_int_eq(moe_ablate_run(&c, &ax, 1, &o), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), "ablate.json") != NULL, "%s", moe_last_error());
        ck_assert_msg(strstr(moe_last_error(), tails[i][1]) != NULL, "%s", moe_last_error());
    }
    // a bad status value in an otherwise whole file
    char *st = strstr(good, "\"status\": \"ok\"");
    ck_assert_ptr_nonnull(st);
    memcpy(st + 11, "no", 2);
    FILE *f = fopen(p, "w");
    fputs(good, f);
    fclose(f);
    ck_assert_int_eq(moe_ablate_run(&c, &ax, 1, &o), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "status must be ok, failed or stopped") != NULL, "%s",
                  moe_last_error());
}
END_TEST

// ablate.json is replaced whole: a write that fails (a full disk) or a kill
// in the middle of it leaves the previous state, which --resume reads. It
// was truncated in place, and a failed write even removed it, so the grid's
// finished runs were lost to --resume.
START_TEST(test_ablate_state_file_survives_a_failed_rewrite) {
    moe_config c;
    small_config(&c);
    moe_grid_axis ax;
    char out[700], p[800];
    snprintf(out, sizeof out, "%s/state_fault", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2"), 0);
    moe_ablate_opts o = {.out = out};
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/ablate.json", out);
    static char before[16384];
    snprintf(before, sizeof before, "%s", text_of(p));
    moe_ablate_row rows[2];
    bool done[2];
    memset(rows, 0, sizeof rows);
    ck_assert_int_eq(moe_ablate_state_read(out, &c, &ax, 1, rows, done, 2), 0);
    ck_assert(done[0] && done[1]);
    done[1] = false;
    moe_fs_fault_arm(2, MOE_FAULT_FAIL); // the write of the new text
    const int rc = moe_ablate_state_write(out, &c, &ax, 1, rows, done, 2);
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(rc, MOE_EIO);
    ck_assert_msg(strstr(moe_last_error(), "ablate.json: write failed") != NULL, "%s",
                  moe_last_error());
    ck_assert_str_eq(text_of(p), before);
    o.resume = true; // both runs kept: nothing trains again
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    ck_assert_str_eq(text_of(p), before);
    // no temp file is left beside it
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "ls '%s' | grep -q tmp", out);
    ck_assert_int_ne(system(cmd), 0);
}
END_TEST

// kill -9 once a run's final checkpoint is written but before the grid
// recorded the run: --resume continues it from that checkpoint with no step
// left, and its row holds the whole run's figures, steps_run all its steps
// (it said 0) and seconds counting the training before the kill (the
// checkpoint's train_seconds, set here to a figure no rerun reaches; it said
// the resumed call's own fraction of a second).
START_TEST(test_ablate_resume_after_a_kill_records_the_whole_run) {
    moe_config c;
    small_config(&c);
    ck_assert_int_eq(moe_config_set(&c, NULL, "train.steps=4"), 0);
    moe_grid_axis ax;
    char out[700], p[1000], ck[800];
    snprintf(out, sizeof out, "%s/state_kill", tu_tmpdir());
    ck_assert_int_eq(moe_grid_axis_parse(&ax, "router.top_k=1,2"), 0);
    moe_ablate_opts o = {.out = out};
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    moe_ablate_row rows[2];
    bool done[2];
    memset(rows, 0, sizeof rows);
    ck_assert_int_eq(moe_ablate_state_read(out, &c, &ax, 1, rows, done, 2), 0);
    ck_assert_int_eq(rows[0].steps_run, 4);
    done[0] = false; // the record a kill -9 before it leaves
    ck_assert_int_eq(moe_ablate_state_write(out, &c, &ax, 1, rows, done, 2), 0);
    // train_seconds 1000, the file's size kept (the manifest records it)
    snprintf(p, sizeof p, "%s/run_000", out);
    ck_assert_int_eq(moe_ckpt_resolve(p, ck, sizeof ck, NULL), 0);
    snprintf(p, sizeof p, "%s/trainer_state.json", ck);
    static char state[16384];
    snprintf(state, sizeof state, "%s", text_of(p));
    char *v = strstr(state, "\"train_seconds\": ");
    ck_assert_ptr_nonnull(v);
    v += strlen("\"train_seconds\": ");
    const size_t len = strcspn(v, ",\n");
    ck_assert_uint_ge(len, 4);
    memset(v, ' ', len);
    memcpy(v, "1000", 4);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs(state, f);
    fclose(f);
    o.resume = true;
    ck_assert_msg(moe_ablate_run(&c, &ax, 1, &o) == 0, "%s", moe_last_error());
    memset(rows, 0, sizeof rows);
    ck_assert_int_eq(moe_ablate_state_read(out, &c, &ax, 1, rows, done, 2), 0);
    ck_assert(done[0] && rows[0].ok);
    ck_assert_int_eq(rows[0].steps, 4);
    ck_assert_int_eq(rows[0].steps_run, 4);
    ck_assert_msg(rows[0].seconds >= 1000 && rows[0].seconds < 1100, "%g", rows[0].seconds);
    ck_assert_msg(rows[0].tokens_per_s < 1, "%g", rows[0].tokens_per_s); // 128 tokens / 1000 s
    // run_001 is kept as recorded
    ck_assert_int_eq(rows[1].steps_run, 4);
    ck_assert_msg(rows[1].seconds < 1000, "%g", rows[1].seconds);
}
END_TEST

static Suite *ablate_suite(void) {
    Suite *s = suite_create("ablate");
    TCase *tc = tcase_create("ablate");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_grid_runs_every_combination);
    tcase_add_test(tc, test_grid_parse_and_bad_values);
    tcase_add_test(tc, test_grid_over_config_files);
    tcase_add_test(tc, test_ablate_refuses_an_out_holding_an_ablation);
    tcase_add_test(tc, test_ablate_summary_names_the_first_failed_run);
    tcase_add_test(tc, test_ablate_failed_runs_are_a_runtime_failure);
    tcase_add_test(tc, test_ablate_refuses_a_grid_key_given_twice);
    tcase_add_test(tc, test_ablate_tables_rank_non_finite_losses_last);
    tcase_add_test(tc, test_ablate_tables_use_the_union_of_tasks);
    tcase_add_test(tc, test_ablate_tables_escape_quotes_and_pipes);
    tcase_add_test(tc, test_ablate_failed_row_leaves_its_figures_empty);
    tcase_add_test(tc, test_ablate_cell_errors_name_the_grid_key);
    tcase_add_test(tc, test_ablate_refuses_expert_parallel_cells_before_training);
    tcase_add_test(tc, test_ablate_refuses_a_data_path_grid_on_synthetic_data);
    tcase_add_test(tc, test_ablate_resume_refuses_another_grid_or_config);
    tcase_add_test(tc, test_ablate_report_tokens_per_s_is_the_tables_figure);
    tcase_add_test(tc, test_ablate_resume_refuses_a_damaged_state_file);
    tcase_add_test(tc, test_ablate_state_file_survives_a_failed_rewrite);
    tcase_add_test(tc, test_ablate_resume_after_a_kill_records_the_whole_run);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(ablate_suite());
}
