// Messages for JSON files jansson could not parse (moe/json_error.h).
#include "moe/json_error.h"
#include "moe/error.h"

#include <string.h>

int moe_json_column(const json_error_t *e) {
    return e->column > 0 ? e->column : 1;
}

int moe_json_fail(int code, const char *path, const json_error_t *e) {
    // jansson's words when the text ends before its first token (its test
    // suite's invalid/empty): reported at column 0, but the fault is the file.
    if (strcmp(e->text, "'[' or '{' expected near end of file") == 0)
        return moe_fail(code, "%s: the file is empty", path);
    // No position: jansson could not open the file (json_load_file).
    if (e->line < 1) return moe_fail(code, "%s: %s", path, e->text);
    return moe_fail(code, "%s:%d:%d: %s", path, e->line, moe_json_column(e), e->text);
}
