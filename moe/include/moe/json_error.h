// One wording for a JSON file that jansson could not parse, for every reader:
// "PATH: the file is empty" when it holds no value at all, else
// "PATH:LINE:COLUMN: what jansson says", with lines and columns from 1.
#ifndef MOE_JSON_ERROR_H
#define MOE_JSON_ERROR_H

#include <jansson.h>

// Records the message for path, whose text jansson refused with e (read
// without JSON_DECODE_ANY), and returns code. Nothing but white space is
// empty; so is a NUL byte after it, where jansson stops reading.
int moe_json_fail(int code, const char *path, const json_error_t *e);
// e's column counted from 1: jansson says 0 at the start of a line (an end
// of input after a newline), where an editor shows column 1.
int moe_json_column(const json_error_t *e);

#endif
