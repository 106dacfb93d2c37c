// moe prepare: text -> shards -> the same bytes back, shard headers, a split
// by whole documents that does not depend on input order, bad UTF-8 named by
// file and offset with nothing written, and the CLI end to end (prepare,
// train on the shards by glob, generate without --task).
#include "moe/data.h"
#include "moe/error.h"
#include "moe/fsio.h"
#include "moe/prepare.h"
#include "moe/shards.h"
#include "testutil.h"

#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

// The tokens of every shard split_NNNNNN.bin in dir, as bytes, appended to buf.
static size_t read_split(const char *dir, const char *split, char *buf, size_t cap, int *shards) {
    size_t n = 0;
    *shards = 0;
    for (int i = 0;; i++) {
        char p[900];
        snprintf(p, sizeof p, "%s/%s_%06d.bin", dir, split, i);
        if (access(p, F_OK)) break;
        moe_token_file f;
        ck_assert_msg(moe_token_file_open(&f, p, MOE_TOKENS_LLMC, 256) == 0, "%s",
                      moe_last_error());
        ck_assert_int_eq(f.width, 2);
        for (long k = 0; k < f.n_tokens; k++) {
            ck_assert_uint_lt(n, cap);
            buf[n++] = (char)moe_token_at(&f, k);
        }
        moe_token_file_close(&f);
        ++*shards;
    }
    return n;
}

static int prepare(const char *out, const char *const *in, int n, double vf, moe_doc_unit doc,
                   long shard, moe_prepare_result *r) {
    moe_prepare_tokenizer tk;
    ck_assert_int_eq(moe_prepare_tokenizer_open(&tk, "bytes"), 0);
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = in,
                          .n_inputs = n,
                          .tokenizer = &tk,
                          .val_fraction = vf,
                          .seed = 7,
                          .doc = doc,
                          .shard_tokens = shard};
    return moe_prepare(&o, r);
}

static const char *A = "Première ligne\nsecond line\n\nnew paragraph\n";
static const char *B = "ünïcödé\n∑ x_i\nthird\nfourth\nfifth\n";

START_TEST(test_prepare_round_trip_and_shard_headers) {
    char dir[600], out[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(out, sizeof out, "%s/out", dir);
    char pa[700], pb[700];
    snprintf(pa, sizeof pa, "%s/b.txt", dir); // folder order: a.txt then b.txt
    write_text(pa, B);
    snprintf(pb, sizeof pb, "%s/a.txt", dir);
    write_text(pb, A);
    const char *in[] = {dir};
    moe_prepare_result r;
    ck_assert_msg(prepare(out, in, 1, 0, MOE_DOC_FILE, 16, &r) == 0, "%s", moe_last_error());
    size_t la = strlen(A), lb = strlen(B);
    ck_assert_int_eq(r.files, 2);
    ck_assert_int_eq(r.tokens[0], (long)(la + lb));
    ck_assert_int_eq(r.shards[0], (int)((la + lb + 15) / 16));
    ck_assert_int_eq(r.shards[1], 0);
    char buf[4096];
    int shards;
    size_t n = read_split(out, "train", buf, sizeof buf, &shards);
    ck_assert_int_eq(shards, r.shards[0]);
    ck_assert_int_eq(n, la + lb);
    ck_assert(memcmp(buf, A, la) == 0 && memcmp(buf + la, B, lb) == 0);
    // every shard but the last holds exactly 16 tokens (header count = size)
    char p[900];
    snprintf(p, sizeof p, "%s/train_000000.bin", out);
    struct stat st;
    ck_assert_int_eq(stat(p, &st), 0);
    ck_assert_int_eq(st.st_size, 1024 + 2 * 16);
    char want[64];
    snprintf(want, sizeof want, "\"tokens\": %zu", la + lb);
    ck_assert_ptr_nonnull(strstr(tu_file_text(out, "manifest.json"), want));
}
END_TEST

START_TEST(test_prepare_splits_whole_documents_order_free) {
    char dir[600], o1[700], o2[700], pa[700], pb[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(pa, sizeof pa, "%s/a.txt", dir);
    snprintf(pb, sizeof pb, "%s/b.txt", dir);
    write_text(pa, A);
    write_text(pb, B);
    snprintf(o1, sizeof o1, "%s/o1", dir);
    snprintf(o2, sizeof o2, "%s/o2", dir);
    const char *ab[] = {pa, pb}, *ba[] = {pb, pa};
    moe_prepare_result r1, r2;
    ck_assert_msg(prepare(o1, ab, 2, 0.5, MOE_DOC_LINE, 1000, &r1) == 0, "%s", moe_last_error());
    ck_assert_int_eq(prepare(o2, ba, 2, 0.5, MOE_DOC_LINE, 1000, &r2), 0);
    ck_assert_int_gt(r1.documents[1], 0);
    ck_assert_int_gt(r1.documents[0], 0);
    ck_assert_int_eq(r1.documents[0] + r1.documents[1], 9); // lines, the empty one included
    ck_assert_int_eq(r1.documents[1], r2.documents[1]);     // the same lines, whatever the order
    char t[4096], v[4096];
    int s;
    size_t nt = read_split(o1, "train", t, sizeof t, &s);
    size_t nv = read_split(o1, "val", v, sizeof v, &s);
    ck_assert_int_eq(nt + nv, strlen(A) + strlen(B));
    // each split is a sequence of whole lines of the input
    t[nt] = v[nv] = 0;
    for (char *x = strtok(v, "\n"); x; x = strtok(NULL, "\n"))
        ck_assert_msg(strstr(A, x) || strstr(B, x), "'%s' is not a line of the input", x);
    ck_assert(nt && t[nt - 1] == '\n' && nv && v[nv - 1] == 0); // strtok cut v
}
END_TEST

START_TEST(test_prepare_bad_utf8_names_file_and_offset) {
    char dir[600], out[700], p[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(p, sizeof p, "%s/bad.txt", dir);
    write_text(p, "good\nbad \xC3(\n");
    snprintf(out, sizeof out, "%s/out", dir);
    const char *in[] = {p};
    moe_prepare_result r;
    ck_assert_int_eq(prepare(out, in, 1, 0, MOE_DOC_FILE, 100, &r), MOE_EFORMAT);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "bad.txt: byte 10: invalid UTF-8"));
    ck_assert_int_ne(access(out, F_OK), 0); // nothing written
    moe_prepare_tokenizer tk;
    ck_assert_int_eq(moe_prepare_tokenizer_open(&tk, "no-such.model"), MOE_ENOTFOUND);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "no-such.model"));
}
END_TEST

// Symbolic links to folders are followed, but a folder already entered is
// not entered again: a self-link (`ln -s . a`) once gave 41 copies of every
// file, and two of them 2^40 paths (a hang).
START_TEST(test_prepare_walk_enters_each_folder_once) {
    char dir[600], L[700], p[900], out[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(L, sizeof L, "%s/L", dir);
    ck_assert_int_eq(mkdir(L, 0755), 0);
    snprintf(p, sizeof p, "%s/f.txt", L);
    write_text(p, "x y\n");
    snprintf(p, sizeof p, "%s/sub", L);
    ck_assert_int_eq(mkdir(p, 0755), 0);
    snprintf(p, sizeof p, "%s/sub/g.txt", L);
    write_text(p, "g\n");
    const char *links[][2] = {{".", "a"}, {".", "b"}, {"sub", "sub2"}, {"..", "sub/up"}};
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", L, links[i][1]);
        ck_assert_int_eq(symlink(links[i][0], p), 0);
    }
    const char *in[] = {L};
    moe_prepare_result r;
    snprintf(out, sizeof out, "%s/out", dir);
    ck_assert_msg(prepare(out, in, 1, 0, MOE_DOC_FILE, 100, &r) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.files, 2);
    ck_assert_int_eq(r.tokens[0], 6);
    char buf[64];
    int shards;
    ck_assert_int_eq(read_split(out, "train", buf, sizeof buf, &shards), 6);
    ck_assert(memcmp(buf, "x y\ng\n", 6) == 0); // f.txt, then sub/g.txt
    // a folder given through a link is walked as well
    snprintf(p, sizeof p, "%s/linked", dir);
    ck_assert_int_eq(symlink(L, p), 0);
    snprintf(out, sizeof out, "%s/out2", dir);
    const char *in2[] = {p};
    ck_assert_msg(prepare(out, in2, 1, 0, MOE_DOC_FILE, 100, &r) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.files, 2);
}
END_TEST

// Entries of a folder that are no file or folder are passed over, counted
// and the first named (they were skipped without a word): here a broken link
// and a FIFO; a folder holding only such entries is refused naming them.
START_TEST(test_prepare_counts_and_names_skipped_entries) {
    char dir[600], L[700], p[900], out[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(L, sizeof L, "%s/L", dir);
    ck_assert_int_eq(mkdir(L, 0755), 0);
    snprintf(p, sizeof p, "%s/a_broken", L);
    ck_assert_int_eq(symlink("nowhere", p), 0);
    snprintf(p, sizeof p, "%s/b_fifo", L);
    ck_assert_int_eq(mkfifo(p, 0644), 0);
    const char *in[] = {L};
    moe_prepare_result r;
    snprintf(out, sizeof out, "%s/out", dir);
    ck_assert_int_eq(prepare(out, in, 1, 0, MOE_DOC_FILE, 100, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "2 entries skipped") &&
                      strstr(moe_last_error(), "a_broken: broken link"),
                  "%s", moe_last_error());
    snprintf(p, sizeof p, "%s/c.txt", L);
    write_text(p, "text\n");
    ck_assert_msg(prepare(out, in, 1, 0, MOE_DOC_FILE, 100, &r) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.files, 1);
    ck_assert_int_eq(r.skipped, 2);
    snprintf(p, sizeof p, "%s/a_broken: broken link", L);
    ck_assert_str_eq(r.skip, p);
}
END_TEST

// One file reached twice would be trained on twice (and could sit in both
// splits): refused whether given twice, inside a folder also given, or
// through a link; a link given alone is read as its file.
START_TEST(test_prepare_refuses_a_file_included_twice) {
    char dir[600], f[700], g[700], link[700], out[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(f, sizeof f, "%s/f.txt", dir);
    write_text(f, "some text\n");
    snprintf(g, sizeof g, "%s/g.txt", dir);
    write_text(g, "other text\n");
    snprintf(link, sizeof link, "%s/.hidden-link.txt", dir); // hidden: not in the walk
    ck_assert_int_eq(symlink(f, link), 0);
    snprintf(out, sizeof out, "%s/out", dir);
    moe_prepare_result r;
    const char *twice[] = {f, g, f};
    ck_assert_int_eq(prepare(out, twice, 3, 0, MOE_DOC_FILE, 100, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "f.txt: included twice"), "%s", moe_last_error());
    const char *inside[] = {dir, g};
    ck_assert_int_eq(prepare(out, inside, 2, 0, MOE_DOC_FILE, 100, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "g.txt: included twice"), "%s", moe_last_error());
    const char *linked[] = {link, f};
    ck_assert_int_eq(prepare(out, linked, 2, 0, MOE_DOC_FILE, 100, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "are the same file"), "%s", moe_last_error());
    ck_assert_int_ne(access(out, F_OK), 0); // nothing written
    const char *alone[] = {link, g};
    ck_assert_msg(prepare(out, alone, 2, 0, MOE_DOC_FILE, 100, &r) == 0, "%s", moe_last_error());
    ck_assert_int_eq(r.files, 2);
    ck_assert_int_eq(r.tokens[0], 21);
}
END_TEST

// Names in dir (sorted, joined by spaces), hidden ones included.
static void dir_names(const char *dir, char *out, size_t cap) {
    struct dirent **e;
    int n = scandir(dir, &e, NULL, alphasort);
    ck_assert_int_ge(n, 0);
    out[0] = 0;
    for (int i = 0; i < n; i++) {
        if (strcmp(e[i]->d_name, ".") && strcmp(e[i]->d_name, ".."))
            snprintf(out + strlen(out), cap - strlen(out), "%s ", e[i]->d_name);
        free(e[i]);
    }
    free(e);
}

// Old shards left in --out would be overwritten in part and the rest trained
// on by DIR/train_*.bin: a folder holding shard-like files is refused, and
// the user's other files there stay untouched.
START_TEST(test_prepare_refuses_an_out_folder_with_old_shards) {
    char dir[600], f[700], out[700], p[900], names[2000];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(f, sizeof f, "%s/f.txt", dir);
    write_text(f, "line one\nline two\n");
    snprintf(out, sizeof out, "%s/out", dir);
    ck_assert_int_eq(mkdir(out, 0755), 0);
    snprintf(p, sizeof p, "%s/notes.txt", out);
    write_text(p, "mine");
    const char *in[] = {f};
    moe_prepare_result r;
    const char *old[] = {"train_000007.bin", "val_000000.bin", "train_000000.bin.tmp",
                         "manifest.json"};
    for (int i = 0; i < 4; i++) {
        snprintf(p, sizeof p, "%s/%s", out, old[i]);
        write_text(p, "old");
        ck_assert_int_eq(prepare(out, in, 1, 0, MOE_DOC_LINE, 4, &r), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), old[i]) && strstr(moe_last_error(), "--out"), "%s",
                      moe_last_error());
        ck_assert_str_eq(tu_file_text(out, old[i]), "old");
        unlink(p);
    }
    ck_assert_msg(prepare(out, in, 1, 0, MOE_DOC_LINE, 4, &r) == 0, "%s", moe_last_error());
    ck_assert_str_eq(tu_file_text(out, "notes.txt"), "mine");
    dir_names(out, names, sizeof names); // no .tmp is left behind
    ck_assert_str_eq(names, "manifest.json notes.txt train_000000.bin train_000001.bin "
                            "train_000002.bin train_000003.bin train_000004.bin ");
}
END_TEST

// An --out too long for its shards' names is refused before anything is
// read or made, not at the first shard with the name cut short.
START_TEST(test_prepare_refuses_an_out_too_long_for_its_shards) {
    char dir[600], f[700], out[4096];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(f, sizeof f, "%s/f.txt", dir);
    write_text(f, "line one\nline two\n");
    int n = snprintf(out, sizeof out, "%s", dir);
    while (n < 4080) { // folders of at most 200 characters, 4080 in all
        int k = 4080 - n - 1 < 200 ? 4080 - n - 1 : 200;
        out[n++] = '/';
        memset(out + n, 'o', (size_t)k);
        n += k;
    }
    out[n] = 0;
    const char *in[] = {f};
    moe_prepare_result r;
    ck_assert_int_eq(prepare(out, in, 1, 0, MOE_DOC_LINE, 4, &r), MOE_EINVAL);
    const char *e = moe_last_error(), *end = "choose a shorter --out";
    ck_assert_msg(strstr(e, "path too long"), "%s", e);
    ck_assert_str_eq(e + strlen(e) - strlen(end), end);
    ck_assert_int_eq(tu_count_entries(dir), 1); // f.txt alone
    ck_assert_int_eq(moe_fs_remove_tree(dir), 0);
}
END_TEST

static volatile sig_atomic_t stop_flag;
static void stop_after_first_file(void *ctx, const moe_prepare_progress *p) {
    (void)ctx;
    if (p->files_done >= 1) stop_flag = 1;
}

// A stop request (the CLI's SIGINT/SIGTERM) between documents removes every
// shard written so far, complete or not, and the user's files stay.
START_TEST(test_prepare_stopped_leaves_no_shard) {
    char dir[600], in_dir[700], out[700], p[900], names[2000];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(in_dir, sizeof in_dir, "%s/in", dir);
    ck_assert_int_eq(mkdir(in_dir, 0755), 0);
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%d.txt", in_dir, i);
        write_text(p, "some words on a line\nand more\n");
    }
    snprintf(out, sizeof out, "%s/out", dir);
    ck_assert_int_eq(mkdir(out, 0755), 0);
    snprintf(p, sizeof p, "%s/keep.txt", out);
    write_text(p, "mine");
    moe_prepare_tokenizer tk;
    ck_assert_int_eq(moe_prepare_tokenizer_open(&tk, "bytes"), 0);
    const char *in[] = {in_dir};
    stop_flag = 0;
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = in,
                          .n_inputs = 1,
                          .tokenizer = &tk,
                          .doc = MOE_DOC_LINE,
                          .shard_tokens = 8,
                          .progress = stop_after_first_file,
                          .stop = &stop_flag};
    moe_prepare_result r;
    ck_assert_int_eq(moe_prepare(&o, &r), MOE_EIO);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "interrupted"));
    ck_assert_int_eq(stop_flag, 1);
    dir_names(out, names, sizeof names);
    ck_assert_str_eq(names, "keep.txt ");
    // An empty folder the user made stays; one prepare made goes.
    for (int made = 0; made < 2; made++) {
        snprintf(out, sizeof out, "%s/out%d", dir, made);
        if (!made) ck_assert_int_eq(mkdir(out, 0755), 0);
        stop_flag = 0;
        o.out_dir = out;
        ck_assert_int_eq(moe_prepare(&o, &r), MOE_EIO);
        struct stat st;
        ck_assert_msg((stat(out, &st) == 0) == !made, "%s %s", out, made ? "kept" : "removed");
    }
}
END_TEST

// Three inputs of one line each, a --out holding the user's keep.txt, and
// the options of a line-per-document prepare into 8-token shards.
static moe_prepare_tokenizer race_tk;
static const char *race_in[1];
static char race_out[700];
static moe_prepare_opts race_opts(void) {
    static char in_dir[700];
    char dir[600], p[900];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(in_dir, sizeof in_dir, "%s/in", dir);
    ck_assert_int_eq(mkdir(in_dir, 0755), 0);
    for (int i = 0; i < 3; i++) {
        snprintf(p, sizeof p, "%s/%d.txt", in_dir, i);
        write_text(p, "some words on a line\nand more\n");
    }
    snprintf(race_out, sizeof race_out, "%s/out", dir);
    ck_assert_int_eq(mkdir(race_out, 0755), 0);
    snprintf(p, sizeof p, "%s/keep.txt", race_out);
    write_text(p, "mine");
    ck_assert_int_eq(moe_prepare_tokenizer_open(&race_tk, "bytes"), 0);
    race_in[0] = in_dir;
    return (moe_prepare_opts){.out_dir = race_out,
                              .inputs = race_in,
                              .n_inputs = 1,
                              .tokenizer = &race_tk,
                              .doc = MOE_DOC_LINE,
                              .shard_tokens = 8};
}

// What another prepare into the same folder writes after this one checked it:
// after the first input, the file named by ctx appears holding "theirs".
static void plant_after_first_file(void *ctx, const moe_prepare_progress *p) {
    char path[900];
    snprintf(path, sizeof path, "%s/%s", race_out, (const char *)ctx);
    if (p->files_done == 1) write_text(path, "theirs");
}

// Two prepares into one --out: a shard's NAME.tmp that another run created is
// never opened (it was truncated and shared) and never removed.
// Documents of one part (lines) and of several (whole files in 4-byte parts):
// the refusal is not lost between parts.
START_TEST(test_prepare_refuses_a_tmp_another_run_is_writing) {
    moe_prepare_opts o = race_opts();
    o.progress = plant_after_first_file;
    o.progress_ctx = "train_000006.bin.tmp";
    for (int parts = 0; parts < 2; parts++) {
        if (parts) o.doc = MOE_DOC_FILE, o.part_bytes = 4;
        unlink(tu_path(race_out, "train_000006.bin.tmp", "")); // planted again after file 1
        moe_prepare_result r;
        ck_assert_int_eq(moe_prepare(&o, &r), MOE_EINVAL);
        ck_assert_msg(strstr(moe_last_error(), "train_000006.bin.tmp exists: another moe prepare"),
                      "%s", moe_last_error());
        char names[2000];
        dir_names(race_out, names, sizeof names);
        ck_assert_str_eq(names, "keep.txt train_000006.bin.tmp ");
        ck_assert_str_eq(tu_file_text(race_out, "train_000006.bin.tmp"), "theirs");
    }
}
END_TEST

// A shard name that another run renamed into place meanwhile is neither
// replaced by this run's rename nor removed by its cleanup.
START_TEST(test_prepare_never_replaces_or_removes_another_runs_shard) {
    moe_prepare_opts o = race_opts();
    o.progress = plant_after_first_file;
    o.progress_ctx = "train_000002.bin"; // its .tmp was created before, by this run
    moe_prepare_result r;
    ck_assert_int_eq(moe_prepare(&o, &r), MOE_EINVAL);
    ck_assert_msg(strstr(moe_last_error(), "train_000002.bin exists"), "%s", moe_last_error());
    char names[2000];
    dir_names(race_out, names, sizeof names);
    ck_assert_str_eq(names, "keep.txt train_000002.bin ");
    ck_assert_str_eq(tu_file_text(race_out, "train_000002.bin"), "theirs");
    o.progress_ctx = "manifest.json"; // the same for the manifest
    unlink(tu_path(race_out, "train_000002.bin", ""));
    ck_assert_int_eq(moe_prepare(&o, &r), MOE_EINVAL);
    dir_names(race_out, names, sizeof names);
    ck_assert_str_eq(names, "keep.txt manifest.json ");
    ck_assert_str_eq(tu_file_text(race_out, "manifest.json"), "theirs");
}
END_TEST

// Each file-system call of a prepare failing in turn (create, write, rename):
// the run fails and leaves only what was there before.
START_TEST(test_prepare_failing_call_leaves_only_the_users_files) {
    moe_prepare_opts o = race_opts();
    moe_prepare_result r;
    char names[2000], p[900];
    moe_fs_fault_arm(0, MOE_FAULT_OFF);
    ck_assert_int_eq(moe_prepare(&o, &r), 0);
    long calls = moe_fs_op_count();
    ck_assert_int_ge(calls, 2 * 12 + 2); // 12 shards created and renamed, the manifest's
    for (long k = 1; k <= calls; k++) {
        dir_names(race_out, names, sizeof names);
        for (char *t = strtok(names, " "); t; t = strtok(NULL, " "))
            if (strcmp(t, "keep.txt")) {
                snprintf(p, sizeof p, "%s/%s", race_out, t);
                unlink(p);
            }
        moe_fs_fault_arm(k, MOE_FAULT_FAIL);
        ck_assert_int_eq(moe_prepare(&o, &r), MOE_EIO);
        moe_fs_fault_arm(0, MOE_FAULT_OFF);
        dir_names(race_out, names, sizeof names);
        ck_assert_msg(!strcmp(names, "keep.txt "), "call %ld (%s) failing left: %s", k,
                      moe_fs_fault_op(), names);
    }
}
END_TEST

// A bytes tokenizer that raises the stop flag on its stop_at-th call (0:
// never) and counts its calls: a Ctrl-C arriving in the middle of a document.
static int encode_calls, stop_at;
static int encode_and_stop(void *ctx, const char *text, size_t len, int first, moe_tokens *out) {
    (void)ctx, (void)first;
    if (++encode_calls == stop_at) stop_flag = 1;
    MOE_TRY(moe_tokens_reserve(out, len));
    for (size_t i = 0; i < len; i++)
        out->tok[out->n++] = (unsigned char)text[i];
    return 0;
}

// One document (the whole input, as a book is) stopped in its first or its
// last part: the stop is not swallowed and nothing is left behind.
START_TEST(test_prepare_stopped_inside_the_only_document) {
    char dir[600], f[700], out[700], text[4096] = "";
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(f, sizeof f, "%s/book.txt", dir);
    for (int i = 0; i < 100; i++)
        strcat(text, "word and ");
    write_text(f, text);
    moe_prepare_tokenizer tk = {.name = "bytes", .vocab_size = 256, .encode = encode_and_stop};
    const char *in[] = {f};
    snprintf(out, sizeof out, "%s/out", dir);
    moe_prepare_opts o = {.out_dir = out,
                          .inputs = in,
                          .n_inputs = 1,
                          .tokenizer = &tk,
                          .doc = MOE_DOC_FILE,
                          .shard_tokens = 100,
                          .part_bytes = 64,
                          .stop = &stop_flag};
    moe_prepare_result r;
    stop_flag = 0, encode_calls = 0, stop_at = 0;
    ck_assert_int_eq(moe_prepare(&o, &r), 0);
    int parts = encode_calls;
    ck_assert_int_ge(parts, 10);
    ck_assert_int_eq(moe_fs_remove_tree(out), 0);
    const int at[] = {1, parts};
    for (int k = 0; k < 2; k++) {
        stop_flag = 0, encode_calls = 0, stop_at = at[k];
        ck_assert_int_eq(moe_prepare(&o, &r), MOE_EIO);
        ck_assert_ptr_nonnull(strstr(moe_last_error(), "interrupted"));
        ck_assert_int_le(encode_calls, at[k]); // no part encoded after the stop
        struct stat st;
        ck_assert_msg(stat(out, &st) != 0, "stop at part %d: %s kept", at[k], out);
    }
}
END_TEST

// A file name that is not UTF-8 (names are bytes) keeps its "path" in the
// manifest, each byte of a bad sequence written as the text \xHH.
START_TEST(test_prepare_manifest_keeps_a_non_utf8_file_name) {
    char dir[600], in_dir[700], p[900], out[700];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    snprintf(in_dir, sizeof in_dir, "%s/in", dir);
    ck_assert_int_eq(mkdir(in_dir, 0755), 0);
    snprintf(p, sizeof p, "%s/caf\xC3\xA9-\xFF.txt", in_dir);
    write_text(p, "some text\n");
    snprintf(out, sizeof out, "%s/out", dir);
    const char *in[] = {in_dir};
    moe_prepare_result r;
    ck_assert_msg(prepare(out, in, 1, 0, MOE_DOC_FILE, 100, &r) == 0, "%s", moe_last_error());
    char want[900];
    snprintf(want, sizeof want, "\"path\": \"%s/caf\xC3\xA9-\\\\xFF.txt\"", in_dir);
    ck_assert_msg(strstr(tu_file_text(out, "manifest.json"), want), "%s lacks %s",
                  tu_file_text(out, "manifest.json"), want);
}
END_TEST

// The CLI end to end: prepare, train on the shards by glob with val_path,
// generate without --task (one corpus), then two file tasks and --task.
START_TEST(test_prepare_train_generate_cli) {
    char dir[600], args[4000];
    snprintf(dir, sizeof dir, "%s", tu_tmpdir());
    char text[20000];
    size_t n = 0;
    for (int i = 0; n < sizeof text - 100; i++)
        n += (size_t)snprintf(text + n, sizeof text - n, "line %d of a small corpus\n", i);
    char p[800];
    snprintf(p, sizeof p, "%s/corpus.txt", dir);
    write_text(p, text);
    snprintf(args, sizeof args, "prepare '%s' --out '%s/sh' --doc line --quiet", p, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 0);
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "prepared 1 files"));
    snprintf(args, sizeof args, "prepare '%s' --out '%s/sh' --quiet", p, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2); // the manifest exists
    snprintf(args, sizeof args, "prepare '%s' --out '%s/x' --tokenizer sp.model", p, dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2);
    const char *common = "--set model.d_model=32 --set model.n_layers=2 --set model.d_ff=32 "
                         "--set moe.num_experts=4 --set train.batch_size=2 --set "
                         "model.seq_len=16 --set train.steps=3 --set train.eval_every=0 --quiet";
    snprintf(args, sizeof args,
             "train %s/configs/tiny.json %s --set data.kind=llmc --set "
             "'data.path=%s/sh/train_*.bin' --set 'data.val_path=%s/sh/val_*.bin' --out %s/run1",
             MOE_SOURCE_DIR, common, dir, dir, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args, "generate %s/run1/checkpoint --prompt 'line ' --max-new 4", dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args,
             "train %s/configs/tiny.json %s --set data.kind=text --set "
             "'data.tasks=en=%s,fr=%s' --out %s/run2",
             MOE_SOURCE_DIR, common, p, p, dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "fr "));
    snprintf(args, sizeof args,
             "generate %s/run2/checkpoint --task fr --prompt 'line ' "
             "--max-new 4",
             dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    snprintf(args, sizeof args, "generate %s/run2/checkpoint --prompt 'line '", dir);
    ck_assert_int_eq(tu_run_moe(dir, args), 2); // two tasks: --task is needed
    snprintf(args, sizeof args, "eval %s/run2/checkpoint", dir);
    ck_assert_msg(tu_run_moe(dir, args) == 0, "%s", tu_file_text(dir, "err.txt"));
    ck_assert_ptr_nonnull(strstr(tu_file_text(dir, "out.txt"), "en "));
}
END_TEST

static Suite *prepare_suite(void) {
    Suite *s = suite_create("prepare");
    TCase *tc = tcase_create("prepare");
    tcase_set_timeout(tc, 300);
    tcase_add_test(tc, test_prepare_round_trip_and_shard_headers);
    tcase_add_test(tc, test_prepare_splits_whole_documents_order_free);
    tcase_add_test(tc, test_prepare_bad_utf8_names_file_and_offset);
    tcase_add_test(tc, test_prepare_train_generate_cli);
    tcase_add_test(tc, test_prepare_walk_enters_each_folder_once);
    tcase_add_test(tc, test_prepare_counts_and_names_skipped_entries);
    tcase_add_test(tc, test_prepare_refuses_a_file_included_twice);
    tcase_add_test(tc, test_prepare_refuses_an_out_folder_with_old_shards);
    tcase_add_test(tc, test_prepare_refuses_an_out_too_long_for_its_shards);
    tcase_add_test(tc, test_prepare_stopped_leaves_no_shard);
    tcase_add_test(tc, test_prepare_refuses_a_tmp_another_run_is_writing);
    tcase_add_test(tc, test_prepare_never_replaces_or_removes_another_runs_shard);
    tcase_add_test(tc, test_prepare_failing_call_leaves_only_the_users_files);
    tcase_add_test(tc, test_prepare_stopped_inside_the_only_document);
    tcase_add_test(tc, test_prepare_manifest_keeps_a_non_utf8_file_name);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(prepare_suite());
}
