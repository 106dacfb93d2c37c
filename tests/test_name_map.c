// Name look-ups at scale: the hashed index finds every one of 10^6 names and
// refuses duplicates; a parameter table and a safetensors header of 10^5
// names and a sharded index of 6x10^4 resolve every name. A linear scan per
// name (the old code) does not finish these within the test timeout; speed
// itself is measured by bench/name_lookup.c, not here.
#include "moe/error.h"
#include "moe/name_map.h"
#include "moe/params.h"
#include "moe/safetensors.h"
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { NAME_LEN = 80 };

static char (*make_names(size_t n))[NAME_LEN] {
    char(*names)[NAME_LEN] = malloc(n * sizeof *names);
    ck_assert_ptr_nonnull(names);
    for (size_t i = 0; i < n; i++) // Mixtral-like names, differing in the middle
        snprintf(names[i], NAME_LEN, "model.layers.%zu.block_sparse_moe.experts.%zu.w%zu.weight",
                 i / 3000, i / 3 % 1000, i % 3 + 1);
    return names;
}

static const char *name_at(const void *names, uint32_t i) {
    return ((const char(*)[NAME_LEN])names)[i];
}

START_TEST(test_million_names_are_all_found_and_duplicates_refused) {
    const size_t n = 1000000;
    char(*names)[NAME_LEN] = make_names(n);
    moe_name_map m = {0};
    for (size_t i = 0; i < n; i++) {
        long dup;
        ck_assert_int_eq(moe_name_map_add(&m, names, name_at, i, &dup), 0);
        if (dup != -1) ck_abort_msg("%s reported as a duplicate of %ld", names[i], dup);
    }
    ck_assert_uint_eq(m.count, n);
    for (size_t i = 0; i < n; i++)
        if (moe_name_map_find(&m, names, name_at, names[i]) != (long)i)
            ck_abort_msg("%s not found at %zu", names[i], i);
    ck_assert_int_eq(moe_name_map_find(&m, names, name_at, "model.layers.0.nothing"), -1);
    ck_assert_int_eq(moe_name_map_find(&m, names, name_at, ""), -1);
    // a name added again is reported with its first number and not added
    char(*again)[NAME_LEN] = realloc(names, (n + 1) * sizeof *names);
    ck_assert_ptr_nonnull(again);
    names = again; // moved: the map holds numbers, not pointers
    memcpy(names[n], names[123457], NAME_LEN);
    long dup;
    ck_assert_int_eq(moe_name_map_add(&m, names, name_at, n, &dup), 0);
    ck_assert_int_eq(dup, 123457);
    ck_assert_uint_eq(m.count, n);
    ck_assert_int_eq(moe_name_map_find(&m, names, name_at, names[n]), 123457);
    moe_name_map_free(&m);
    ck_assert_int_eq(moe_name_map_find(&m, names, name_at, names[0]), -1); // freed: empty
    free(names);
}
END_TEST

START_TEST(test_param_table_of_many_views_finds_each_and_refuses_a_duplicate) {
    const int n = 100000;
    char(*names)[NAME_LEN] = make_names((size_t)n);
    moe_param_table t;
    moe_param_table_init(&t);
    int64_t shape[1] = {2};
    for (int i = 0; i < n; i++)
        ck_assert_int_eq(moe_param_table_add(&t, NULL, names[i], 1, shape), 0);
    for (int i = 0; i < n; i++) {
        const moe_param_view *v = moe_param_table_find(&t, names[i]);
        if (!v || v != &t.views[i] || v->offset != 2 * (size_t)i) ck_abort_msg("%s", names[i]);
    }
    ck_assert_ptr_null(moe_param_table_find(&t, "lm_head.weight"));
    ck_assert_int_eq(moe_param_table_add(&t, NULL, names[777], 1, shape), MOE_EINVAL);
    ck_assert_ptr_nonnull(strstr(moe_last_error(), "already in the table"));
    ck_assert_int_eq(t.count, n);
    ck_assert_uint_eq(t.numel, 2 * (size_t)n);
    moe_param_table_free(&t);
    free(names);
}
END_TEST

// n one-float tensors named names[0..n) written with moe_st_write.
static void write_many(const char *path, char (*names)[NAME_LEN], int from, int n, float *vals) {
    moe_st_entry *e = calloc((size_t)n, sizeof *e);
    for (int i = 0; i < n; i++)
        e[i] = (moe_st_entry){names[from + i], MOE_ST_F32, 1, {1}, &vals[from + i]};
    ck_assert_int_eq(moe_st_write(path, e, n, NULL), 0);
    free(e);
}

START_TEST(test_safetensors_header_of_many_tensors_resolves_every_name) {
    const int n = 100000;
    char(*names)[NAME_LEN] = make_names((size_t)n);
    float *vals = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++)
        vals[i] = (float)i;
    const char *p = tu_in_dir("many.safetensors");
    write_many(p, names, 0, n, vals);
    moe_st_file *f;
    ck_assert_msg(moe_st_open(p, &f) == 0, "%s", moe_last_error());
    ck_assert_int_eq(f->n_tensors, n);
    for (int i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_find(f, names[i]);
        if (!t || t != &f->tensors[i]) ck_abort_msg("%s", names[i]);
    }
    float x;
    ck_assert_int_eq(moe_st_read(f, moe_st_find(f, names[n - 1]), &x, sizeof x), 0);
    ck_assert(x == (float)(n - 1));
    ck_assert_ptr_null(moe_st_find(f, "model.norm.weight"));
    moe_st_close(f);
    free(vals);
    free(names);
}
END_TEST

// An index mapping names[0..n) to two shards split at half.
static void write_index(const char *dir, char (*names)[NAME_LEN], int n, int half) {
    char p[1024];
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *ix = fopen(p, "w");
    ck_assert_ptr_nonnull(ix);
    fprintf(ix, "{\"weight_map\": {");
    for (int i = 0; i < n; i++)
        fprintf(ix, "%s\"%s\": \"s%d.safetensors\"", i ? ", " : "", names[i], i < half ? 1 : 2);
    fprintf(ix, "}}\n");
    ck_assert_int_eq(fclose(ix), 0);
}

START_TEST(test_sharded_index_of_many_tensors_resolves_names_and_refuses_duplicates) {
    const int n = 60000, half = n / 2;
    char(*names)[NAME_LEN] = make_names((size_t)n);
    float *vals = malloc(sizeof(float) * n);
    for (int i = 0; i < n; i++)
        vals[i] = (float)i;
    write_many(tu_in_dir("s1.safetensors"), names, 0, half, vals);
    write_many(tu_in_dir("s2.safetensors"), names, half, n - half, vals);
    write_index(tu_dir, names, n, half);
    moe_st_set *s;
    ck_assert_msg(moe_st_set_open(tu_dir, &s) == 0, "%s", moe_last_error());
    ck_assert_int_eq(s->n_files, 2);
    for (int i = 0; i < n; i++) {
        moe_st_file *f = NULL;
        const moe_st_tensor *t = moe_st_set_find(s, names[i], &f);
        if (!t || strcmp(t->name, names[i]) || f != s->files[i < half ? 0 : 1])
            ck_abort_msg("%s", names[i]);
    }
    ck_assert_ptr_null(moe_st_set_find(s, "model.norm.weight", NULL));
    moe_st_set_close(s);
    // the second shard also holds one of the first shard's tensors (the index names it once)
    memcpy(names[n - 1], names[10], NAME_LEN);
    write_many(tu_in_dir("s2.safetensors"), names, half, n - half, vals);
    write_index(tu_dir, names, n - 1, half);
    ck_assert_int_eq(moe_st_set_open(tu_dir, &s), MOE_EFORMAT);
    ck_assert_ptr_null(s);
    ck_assert_msg(strstr(moe_last_error(), "is stored in 2 shards"), "%s", moe_last_error());
    ck_assert_ptr_nonnull(strstr(moe_last_error(), names[10]));
    free(vals);
    free(names);
}
END_TEST

static Suite *name_map_suite(void) {
    Suite *s = suite_create("name_map");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 300);
    tcase_add_checked_fixture(tc, tu_dir_setup, tu_dir_teardown);
    tcase_add_test(tc, test_million_names_are_all_found_and_duplicates_refused);
    tcase_add_test(tc, test_param_table_of_many_views_finds_each_and_refuses_a_duplicate);
    tcase_add_test(tc, test_safetensors_header_of_many_tensors_resolves_every_name);
    tcase_add_test(tc, test_sharded_index_of_many_tensors_resolves_names_and_refuses_duplicates);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return tu_run(name_map_suite());
}
