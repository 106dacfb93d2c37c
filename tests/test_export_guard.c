// moe export never writes over a training checkpoint: a folder holding the
// sharded optimizer index (optimizer.safetensors.index.json), even beside a
// previous export's files, is refused with exit 2 naming that file, and
// nothing in it changes.
#include "moe/error.h"
#include "testutil.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

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

static Suite *suite(void) {
    Suite *s = suite_create("export_guard");
    TCase *tc = tcase_create("guard");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_export_refuses_a_folder_with_the_optimizer_index);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(suite());
}
