// Opening files for reading without hanging: a FIFO, a device or a folder
// where a checkpoint, config or data file should be is refused at open
// ("PATH: not a regular file") instead of blocking the process forever.
#ifndef MOE_FILE_H
#define MOE_FILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

// The code of an errno from opening, stat-ing or listing an input: a path
// that is missing (MOE_ENOTFOUND), not permitted, a link loop or too long
// (MOE_EINVAL) is bad input, exit 2 in every command; anything else, such as
// EIO, is an I/O failure (MOE_EIO, exit 1).
int moe_input_errno_code(int err);
// Opens path read-only (close-on-exec) after checking it is a regular file.
// The open itself never blocks (O_NONBLOCK, cleared once the type is known).
// Errors: MOE_ENOTFOUND (no such file), MOE_EFORMAT (not a regular file),
// those of moe_input_errno_code (cannot open otherwise), with a message
// naming path. On error *fd is -1.
int moe_open_regular(const char *path, int *fd);
// The same as a stdio stream ("rb"); on error *f is NULL.
int moe_fopen_regular(const char *path, FILE **f);
// 0 if path is a regular file that can be opened for reading, else the error
// of moe_open_regular. For readers that hand the path to another library.
int moe_check_regular_file(const char *path);
// Maps the regular file path read-only: *data, *len (NULL, 0 for an empty
// file). Errors as moe_open_regular, or MOE_EIO naming path. The mapping
// outlives the descriptor; release it with moe_unmap.
int moe_map_regular(const char *path, const void **data, size_t *len);
void moe_unmap(const void *data, size_t len);
// A mapped file that another program truncates raises SIGBUS at the next read
// past its new end. After this call (the CLI makes it at start) such a fault
// prints "moe: PATH: the file shrank ..." and exits 1 instead of dumping
// core; a SIGBUS outside every moe_map_regular mapping keeps the default.
int moe_map_guard_install(void);
// mkdir -p: creates dir and its missing parents (0755). MOE_EINVAL when a
// file stands where a folder goes, MOE_EIO otherwise, naming the path.
int moe_make_dirs(const char *dir);
// Where path is, or would be once created: the real path of its nearest
// existing ancestor followed by the names still to be created, into out (cap
// bytes). false when no ancestor resolves or out is too small.
bool moe_path_where(const char *path, char *out, size_t cap);
// 1 when path (existing or to be created) is folder dir itself, 2 when it
// lies inside dir, 0 when outside it or either cannot be resolved: an output
// must not land in the input it is made from, whatever the path's spelling.
int moe_path_within(const char *path, const char *dir);

#endif
