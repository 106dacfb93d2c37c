// Every reader of a checkpoint (config, tensor set, eval's load, generate's
// inference load, export) holds it to the same rules: each file manifest.json
// lists has the listed size, and task_experts.json is read by one reader and
// checked against config.json and the weights, with one message for all.
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/export.h"
#include "moe/infer.h"
#include "moe/model.h"
#include "moe/task_experts.h"
#include "testutil.h"
#include "trainer/checkpoint_internal.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char root[600], ck[700];

// A 2-layer checkpoint whose layers both route by task (4 experts, top-2).
static void save_task_checkpoint(void) {
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    ck_assert_int_eq(moe_config_set(&c, NULL, "moe.task_layers=[0,1]"), 0);
    tu_save_checkpoint(&c, ck);
}

static const char *in_ck(const char *name) {
    static char buf[2][1024];
    static int k;
    char *p = buf[k++ % 2];
    snprintf(p, 1024, "%s/%s", ck, name);
    return p;
}

static void append(const char *name, const char *text) {
    FILE *f = fopen(in_ck(name), "a");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
}

static void write_json(const char *name, json_t *doc) {
    ck_assert_int_eq(json_dump_file(doc, in_ck(name), JSON_INDENT(1)), 0);
    json_decref(doc);
}

static void expect(const char *who, int rc, const char *want) {
    ck_assert_msg(rc == MOE_EFORMAT, "%s: rc %d (%s)", who, rc, rc ? moe_last_error() : "ok");
    ck_assert_msg(strstr(moe_last_error(), want), "%s: '%s' lacks '%s'", who, moe_last_error(),
                  want);
}

// Each reader on ck fails with MOE_EFORMAT and a message holding want; with
// files, the config and tensor-set readers too (they read no task experts).
static void every_reader_refuses(const char *want, bool files) {
    moe_config c;
    moe_st_set *s = NULL;
    int rc = moe_ckpt_config(ck, &c);
    if (files) expect("moe_ckpt_config", rc, want);
    rc = moe_st_set_open(ck, &s);
    if (rc == 0) moe_st_set_close(s);
    if (files) expect("moe_st_set_open", rc, want);
    moe_config t = tu_ckpt_config();
    ck_assert_int_eq(moe_config_set(&t, NULL, "moe.task_layers=[0,1]"), 0);
    moe_model m;
    ck_assert_int_eq(moe_model_init(&m, &t, 2, 16, 5), 0);
    rc = moe_ckpt_load(ck, &m, NULL, NULL);
    moe_model_free(&m);
    expect("moe_ckpt_load (eval)", rc, want);
    moe_infer inf;
    moe_infer_opts o = {.task = "copy"};
    rc = moe_infer_open(&inf, ck, &o);
    if (rc == 0) moe_infer_free(&inf);
    expect("moe_infer_open (generate)", rc, want);
    char out[800];
    snprintf(out, sizeof out, "%s/hf", root);
    expect("moe_export_hf_task", moe_export_hf_task(ck, out, "copy"), want);
}

// A file changed after the save (bytes appended: still valid JSON, or a
// safetensors file with trailing bytes) is refused by every reader, naming
// the file and both sizes.
START_TEST(test_every_reader_refuses_a_file_whose_size_differs_from_the_manifest) {
    static const char *const files[] = {"config.json", "task_experts.json", "model.safetensors"};
    save_task_checkpoint();
    for (int i = 0; i < 3; i++) {
        FILE *f = fopen(in_ck(files[i]), "rb");
        ck_assert_ptr_nonnull(f);
        fseek(f, 0, SEEK_END);
        const long before = ftell(f);
        fclose(f);
        append(files[i], "\n\n\n");
        char want[1400];
        snprintf(want, sizeof want, "%s: is %ld bytes, but %s lists %ld", in_ck(files[i]),
                 before + 3, in_ck("manifest.json"), before);
        every_reader_refuses(want, true);
        tu_refresh_manifest(ck); // the next file's check alone
    }
}
END_TEST

// A task_experts.json that is not JSON is refused by every reader (generate
// did, eval and export --task read past it).
START_TEST(test_every_reader_refuses_a_task_experts_json_that_is_not_json) {
    save_task_checkpoint();
    FILE *f = fopen(in_ck("task_experts.json"), "w");
    fputs("{", f);
    fclose(f);
    tu_refresh_manifest(ck);
    every_reader_refuses("task_experts.json:", false);
}
END_TEST

// An empty task_experts.json or trainer_state.json, or one holding only white
// space, is named as empty by its reader; it was jansson's end of input at
// column 0 ("trainer_state.json:1:0: '[' or '{' expected near end of file").
static void expect_named_empty(const char *who, int rc, const char *name) {
    char want[800];
    snprintf(want, sizeof want, "%s: the file is empty", in_ck(name));
    expect(who, rc, want);
    ck_assert_msg(!strstr(moe_last_error(), ":0:") && !strstr(moe_last_error(), "column 0"),
                  "%s: %s", who, moe_last_error());
}

START_TEST(test_an_empty_json_file_is_named_as_empty) {
    static const char *const blank[] = {"", " \n\t\r\n"};
    for (int i = 0; i < 2; i++) {
        save_task_checkpoint();
        FILE *f = fopen(in_ck("task_experts.json"), "w");
        fputs(blank[i], f);
        fclose(f);
        tu_refresh_manifest(ck);
        moe_task_experts te;
        expect_named_empty("moe_task_experts_read",
                           moe_task_experts_read(in_ck("task_experts.json"), &te),
                           "task_experts.json");
        moe_task_experts_free(&te);
        moe_infer inf;
        moe_infer_opts o = {.task = "copy"};
        int rc = moe_infer_open(&inf, ck, &o);
        if (rc == 0) moe_infer_free(&inf);
        expect_named_empty("moe_infer_open (generate)", rc, "task_experts.json");

        save_task_checkpoint();
        f = fopen(in_ck("trainer_state.json"), "w");
        fputs(blank[i], f);
        fclose(f);
        tu_refresh_manifest(ck);
        moe_config t = tu_ckpt_config();
        ck_assert_int_eq(moe_config_set(&t, NULL, "moe.task_layers=[0,1]"), 0);
        moe_model m;
        moe_adamw opt;
        moe_train_state st = {0};
        ck_assert_int_eq(moe_model_init(&m, &t, 2, 16, 5), 0);
        ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
        rc = moe_ckpt_load(ck, &m, &opt, &st);
        moe_adamw_free(&opt);
        moe_model_free(&m);
        expect_named_empty("moe_ckpt_load (resume)", rc, "trainer_state.json");
    }
}
END_TEST

// A layer the model lacks (layer 4 of a 2-layer model) is refused by every
// reader.
START_TEST(test_every_reader_refuses_task_experts_of_a_layer_the_model_lacks) {
    save_task_checkpoint();
    json_error_t err;
    json_t *doc = json_load_file(in_ck("task_experts.json"), 0, &err);
    ck_assert_ptr_nonnull(doc);
    json_t *layers = json_object_get(doc, "layers");
    json_t *extra = json_deep_copy(json_array_get(layers, 1));
    json_object_set_new(extra, "layer", json_integer(4));
    json_array_append_new(layers, extra);
    write_json("task_experts.json", doc);
    tu_refresh_manifest(ck);
    every_reader_refuses("lists layer 4, but config.json has 2 layers", false);
}
END_TEST

// Recorded experts the weights do not route to: the message shows both full
// sets (it showed the first expert of each).
START_TEST(test_task_expert_mismatch_names_both_full_sets) {
    save_task_checkpoint();
    json_error_t err;
    json_t *doc = json_load_file(in_ck("task_experts.json"), 0, &err);
    ck_assert_ptr_nonnull(doc);
    json_t *row = json_array_get(
        json_object_get(json_array_get(json_object_get(doc, "layers"), 1), "experts"), 0);
    int a = (int)json_integer_value(json_array_get(row, 0)),
        b = (int)json_integer_value(json_array_get(row, 1));
    int other[2], n = 0; // the two experts copy does not use, keeping the first
    for (int e = 0; e < 4; e++)
        if (e != a && e != b) other[n++] = e;
    // {a, other[1]}: same first expert, other second (sorted ascending)
    int x = a < other[1] ? a : other[1], y = a < other[1] ? other[1] : a;
    json_array_set_new(row, 0, json_integer(x));
    json_array_set_new(row, 1, json_integer(y));
    write_json("task_experts.json", doc);
    tu_refresh_manifest(ck);
    char want[200];
    snprintf(want, sizeof want,
             "layer 1 task 'copy' is recorded with experts {%d, %d}, but the weights route it "
             "to {%d, %d}",
             x, y, a, b);
    every_reader_refuses(want, false);
    // the CLI: generate and export say the same
    char args[2000];
    snprintf(args, sizeof args, "generate '%s' --task copy --prompt ab --quiet", ck);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_msg(strstr(tu_file_text(root, "err.txt"), want), "%s", tu_file_text(root, "err.txt"));
    snprintf(args, sizeof args, "export '%s' --hf '%s/hf' --task copy", ck, root);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    ck_assert_msg(strstr(tu_file_text(root, "err.txt"), want), "%s", tu_file_text(root, "err.txt"));
    // the routed set in another order is no other set: refused as unordered
    doc = json_load_file(in_ck("task_experts.json"), 0, &err);
    ck_assert_ptr_nonnull(doc);
    row = json_array_get(
        json_object_get(json_array_get(json_object_get(doc, "layers"), 1), "experts"), 0);
    json_array_set_new(row, 0, json_integer(a > b ? a : b));
    json_array_set_new(row, 1, json_integer(a > b ? b : a));
    write_json("task_experts.json", doc);
    tu_refresh_manifest(ck);
    every_reader_refuses("layer 1 task 'copy': expert indices must be distinct and ascending",
                         false);
}
END_TEST

// A bad combination in a checkpoint's config.json is located in the file
// (path:line:col), not as "default".
START_TEST(test_checkpoint_config_errors_point_into_the_file) {
    save_task_checkpoint();
    json_error_t err;
    json_t *doc = json_load_file(in_ck("config.json"), 0, &err);
    ck_assert_ptr_nonnull(doc);
    json_object_set_new(json_object_get(doc, "model"), "n_layers", json_integer(1));
    write_json("config.json", doc);
    tu_refresh_manifest(ck);
    moe_config c;
    ck_assert_int_eq(moe_ckpt_config(ck, &c), MOE_EINVAL);
    const char *msg = moe_last_error();
    char want[900];
    snprintf(want, sizeof want, "%s:", in_ck("config.json"));
    ck_assert_msg(!strncmp(msg, want, strlen(want)) && strstr(msg, "moe.task_layers entry 1") &&
                      !strstr(msg, "default"),
                  "%s", msg);
}
END_TEST

// A save replacing the folder a reader resolved (eval's and the config's
// load, generate's, export's), between the resolve and the read: run/checkpoint moves away (train.keep_checkpoints = 0's swap
// renames it) and the new checkpoint is a complete run/checkpoint.tmp.
static char race_run[700], race_next[700];
static int race_calls, race_gone;

static void race_save(const char *folder) {
    char p[800], gone[800];
    if (race_calls++) return;
    snprintf(p, sizeof p, "%s/checkpoint", race_run);
    ck_assert_str_eq(folder, p);
    snprintf(gone, sizeof gone, "%s/gone-%d", root, race_gone++);
    ck_assert_int_eq(rename(p, gone), 0);
    snprintf(p, sizeof p, "%s/checkpoint.tmp", race_run);
    ck_assert_int_eq(rename(race_next, p), 0);
}

// The other half of the swap: the reader resolved run/checkpoint.tmp (the
// newest while the old folder is moved away) and the save renames it to
// run/checkpoint before the read.
static void race_finish(const char *folder) {
    char p[800];
    if (race_calls++) return;
    snprintf(p, sizeof p, "%s/checkpoint.tmp", race_run);
    ck_assert_str_eq(folder, p);
    snprintf(p, sizeof p, "%s/checkpoint", race_run);
    ck_assert_int_eq(rename(folder, p), 0);
}

static void save_step(const moe_config *c, const char *dir, long step) {
    moe_model m;
    moe_adamw opt;
    ck_assert_int_eq(moe_model_init(&m, c, 2, 16, 5), 0);
    ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
    moe_train_state st = {.step = step};
    ck_assert_msg(moe_ckpt_save(dir, &m, &opt, &st, NULL) == 0, "%s", moe_last_error());
    moe_adamw_free(&opt);
    moe_model_free(&m);
}

START_TEST(test_readers_resolve_again_when_a_save_replaces_the_folder) {
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(race_run, sizeof race_run, "%s/run", root);
    moe_config c = tu_ckpt_config();
    char p[2600];
    for (int run = 0; run < 8; run++) {
        const int reader = run % 4, finish = run / 4;
        snprintf(p, sizeof p, "rm -rf '%s' '%s/hf' && mkdir '%s'", race_run, root, race_run);
        ck_assert_int_eq(system(p), 0);
        snprintf(p, sizeof p, "%s/checkpoint", race_run);
        save_step(&c, p, 1);
        snprintf(race_next, sizeof race_next, "%s/next", root);
        save_step(&c, race_next, 2);
        if (finish) { // the old folder moved away, the new one not yet renamed
            snprintf(p, sizeof p, "%s/checkpoint", race_run);
            char gone[800];
            snprintf(gone, sizeof gone, "%s/gone-%d", root, race_gone++);
            ck_assert_int_eq(rename(p, gone), 0);
            snprintf(p, sizeof p, "%s/checkpoint.tmp", race_run);
            ck_assert_int_eq(rename(race_next, p), 0);
        }
        race_calls = 0;
        moe_ckpt_resolved_hook = finish ? race_finish : race_save;
        int rc;
        moe_train_state st = {0};
        if (reader == 0) {
            moe_model m;
            moe_adamw opt;
            ck_assert_int_eq(moe_model_init(&m, &c, 2, 16, 5), 0);
            ck_assert_int_eq(moe_adamw_init(&opt, &m.table, false), 0);
            rc = moe_ckpt_load(race_run, &m, &opt, &st);
            moe_adamw_free(&opt);
            moe_model_free(&m);
        } else if (reader == 1) {
            moe_config got;
            rc = moe_ckpt_config(race_run, &got);
        } else if (reader == 2) { // moe generate's load
            moe_infer inf;
            moe_infer_opts o = {.task = "copy"};
            rc = moe_infer_open(&inf, race_run, &o);
            if (rc == 0) moe_infer_free(&inf);
        } else { // moe export
            snprintf(p, sizeof p, "%s/hf", root);
            rc = moe_export_hf(race_run, p);
            snprintf(p, sizeof p, "%s/hf/model.safetensors", root);
            if (rc == 0) ck_assert_int_eq(access(p, F_OK), 0);
        }
        moe_ckpt_resolved_hook = NULL;
        ck_assert_msg(rc == 0, "reader %d%s: %s", reader, finish ? " (finish)" : "",
                      moe_last_error());
        ck_assert_int_gt(race_calls, 1);               // read once, failed, resolved again
        if (reader == 0) ck_assert_int_eq(st.step, 2); // the new checkpoint
    }
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("ckpt_readers");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_every_reader_refuses_a_file_whose_size_differs_from_the_manifest);
    tcase_add_test(tc, test_every_reader_refuses_a_task_experts_json_that_is_not_json);
    tcase_add_test(tc, test_an_empty_json_file_is_named_as_empty);
    tcase_add_test(tc, test_every_reader_refuses_task_experts_of_a_layer_the_model_lacks);
    tcase_add_test(tc, test_task_expert_mismatch_names_both_full_sets);
    tcase_add_test(tc, test_checkpoint_config_errors_point_into_the_file);
    tcase_add_test(tc, test_readers_resolve_again_when_a_save_replaces_the_folder);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
