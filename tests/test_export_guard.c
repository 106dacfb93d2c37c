// moe export never writes over a training checkpoint: a folder holding the
// sharded optimizer index (optimizer.safetensors.index.json), even beside a
// previous export's files, is refused with exit 2 naming that file, and
// nothing in it changes. An existing --hf folder is used only when empty or an
// earlier export: a user's files (a tokenizer.model, a lone model.safetensors)
// are refused by name and left as they were; a link loop or a dangling link
// as --hf is refused by name too.
#include "moe/error.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static long size_of(const char *dir, const char *name) {
    char p[1200];
    struct stat sb;
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return stat(p, &sb) == 0 ? (long)sb.st_size : -1;
}

START_TEST(test_export_refuses_a_folder_with_the_optimizer_index) {
    char root[600], ck[700], out[700], args[2100], p[800];
    snprintf(root, sizeof root, "%s", tu_tmpdir());
    snprintf(ck, sizeof ck, "%s/ck", root);
    snprintf(out, sizeof out, "%s/out", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
    snprintf(args, sizeof args, "export %s --hf %s", ck, out);
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    // a previous export is overwritten by a new one ...
    ck_assert_msg(tu_run_moe(root, args) == 0, "%s", tu_file_text(root, "err.txt"));
    // ... but not once a training checkpoint's optimizer index is there
    snprintf(p, sizeof p, "%s/optimizer.safetensors.index.json", out);
    FILE *f = fopen(p, "w");
    ck_assert_ptr_nonnull(f);
    fputs("{\"metadata\": {}, \"weight_map\": {}}\n", f);
    fclose(f);
    long model = size_of(out, "model.safetensors"), cfg = size_of(out, "config.json");
    ck_assert_int_gt(model, 0);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    const char *err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "optimizer.safetensors.index.json") && strstr(err, "checkpoint"),
                  "stderr: %s", err);
    ck_assert_int_eq(size_of(out, "model.safetensors"), model);
    ck_assert_int_eq(size_of(out, "config.json"), cfg);
}
END_TEST

// A checkpoint of the test config in root/ck, root a fresh folder.
static void saved_checkpoint(char *root, size_t root_cap, char *ck, size_t ck_cap) {
    snprintf(root, root_cap, "%s", tu_tmpdir());
    snprintf(ck, ck_cap, "%s/ck", root);
    moe_config c = tu_ckpt_config();
    tu_save_checkpoint(&c, ck);
}

static void export_to(const char *root, const char *ck, const char *out, int want) {
    char args[2100];
    snprintf(args, sizeof args, "export %s --hf %s", ck, out);
    int rc = tu_run_moe(root, args);
    ck_assert_msg(rc == want, "exit %d, want %d: %s", rc, want, tu_file_text(root, "err.txt"));
}

START_TEST(test_export_refuses_a_folder_of_user_files_and_leaves_them) {
    static const char *const tok[] = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json", "notes.txt"};
    char root[600], ck[700], out[700];
    saved_checkpoint(root, sizeof root, ck, sizeof ck);
    for (int i = 0; i < 5; i++) {
        snprintf(out, sizeof out, "%s/d%d", root, i);
        mkdir(out, 0755);
        tu_write_text(out, tok[i], "important\n");
        export_to(root, ck, out, 2);
        const char *err = tu_file_text(root, "err.txt");
        ck_assert_msg(strstr(err, tok[i]) && strstr(err, "no export wrote"), "%s", err);
        ck_assert_str_eq(tu_file_text(out, tok[i]), "important\n");
        ck_assert_int_eq(size_of(out, "config.json"), -1);
        ck_assert_int_eq(size_of(out, "model.safetensors"), -1);
    }
}
END_TEST

// The message names what the folder holds, not files it lacks.
START_TEST(test_export_refusal_names_the_files_that_are_there) {
    char root[600], ck[700], out[700];
    saved_checkpoint(root, sizeof root, ck, sizeof ck);
    snprintf(out, sizeof out, "%s/d", root);
    mkdir(out, 0755);
    tu_write_text(out, "model.safetensors", "weights");
    export_to(root, ck, out, 2);
    const char *err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "(model.safetensors)") && !strstr(err, "config.json"), "%s", err);
    ck_assert_str_eq(tu_file_text(out, "model.safetensors"), "weights");
}
END_TEST

// A --hf that is a link loop or a link to nothing is bad input (exit 2,
// saying so), as a file there is, and a reader given a link loop as the
// checkpoint says what is wrong instead of "no such folder".
START_TEST(test_export_and_eval_name_a_link_loop_or_a_dangling_link) {
    char root[600], ck[700], a[700], b[700], args[2200];
    saved_checkpoint(root, sizeof root, ck, sizeof ck);
    snprintf(a, sizeof a, "%s/a", root);
    snprintf(b, sizeof b, "%s/b", root);
    ck_assert_int_eq(symlink(b, a), 0);
    ck_assert_int_eq(symlink(a, b), 0);
    export_to(root, ck, a, 2);
    const char *err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "Too many levels of symbolic links"), "%s", err);
    snprintf(args, sizeof args, "eval %s", a);
    ck_assert_int_eq(tu_run_moe(root, args), 2);
    err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "Too many levels of symbolic links"), "%s", err);
    snprintf(a, sizeof a, "%s/dangling", root);
    ck_assert_int_eq(symlink("nowhere", a), 0);
    export_to(root, ck, a, 2);
    err = tu_file_text(root, "err.txt");
    ck_assert_msg(strstr(err, "a symbolic link to nothing"), "%s", err);
    ck_assert_int_eq(size_of(root, "nowhere"), -1);
}
END_TEST

// An empty folder is used; a folder an earlier SentencePiece export wrote is
// replaced by a byte model's export, its tokenizer files removed (they would
// make AutoTokenizer load a vocabulary the byte model does not have).
START_TEST(test_export_reuses_an_empty_folder_and_replaces_an_earlier_export) {
    static const char *const tok[] = {"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                                      "special_tokens_map.json"};
    char root[600], ck[700], out[700];
    saved_checkpoint(root, sizeof root, ck, sizeof ck);
    snprintf(out, sizeof out, "%s/d", root);
    mkdir(out, 0755);
    export_to(root, ck, out, 0);
    ck_assert_int_gt(size_of(out, "model.safetensors"), 0);
    // what an earlier export of a SentencePiece model leaves
    tu_write_text(out, "config.json",
                  "{\"model_type\": \"mixtral\", \"moe_tokenizer\": \"sentencepiece\"}\n");
    for (int i = 0; i < 4; i++)
        tu_write_text(out, tok[i], "earlier export\n");
    export_to(root, ck, out, 0);
    for (int i = 0; i < 4; i++)
        ck_assert_msg(size_of(out, tok[i]) == -1, "%s survived", tok[i]);
    ck_assert_ptr_nonnull(strstr(tu_file_text(out, "config.json"), "\"bytes\""));
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("export_guard");
    TCase *tc = tcase_create("guard");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_export_refuses_a_folder_with_the_optimizer_index);
    tcase_add_test(tc, test_export_refuses_a_folder_of_user_files_and_leaves_them);
    tcase_add_test(tc, test_export_refusal_names_the_files_that_are_there);
    tcase_add_test(tc, test_export_reuses_an_empty_folder_and_replaces_an_earlier_export);
    tcase_add_test(tc, test_export_and_eval_name_a_link_loop_or_a_dangling_link);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
