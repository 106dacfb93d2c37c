// Counted file-system calls for everything a checkpoint save does (create,
// write, fsync, rename, unlink, mkdir, rmdir), with a test-only fault hook in
// the manner of SQLite's I/O error tests: the Nth counted call fails or aborts
// the process, so a test can walk every point of a save where a crash can land.
#ifndef MOE_FSIO_H
#define MOE_FSIO_H

#include <stddef.h>
#include <sys/types.h>

typedef enum {
    MOE_FAULT_OFF = 0,
    MOE_FAULT_FAIL,  // the call is not made; it returns -1 with errno = EIO
    MOE_FAULT_ABORT, // abort(): a crash at that instant (kill -9 with no cleanup)
} moe_fault_mode;

// Arms the hook: the n-th counted call from now (n >= 1) faults once; n = 0
// disarms. Either way the counter restarts at 0. Without a call, the
// environment variable MOE_FAULT="N:fail" or "N:abort" arms it at the first
// counted call of the process; "N:abort:R" (or "N:fail:R") arms it on MPI
// rank R only (read from the launcher's OMPI_COMM_WORLD_RANK or PMI_RANK), so
// a test can crash one rank in the middle of a sharded save. Off by default;
// the cost is one increment and one comparison per call. Not thread-safe: a
// save's calls come from one thread at a time (an asynchronous save's thread
// starts after the caller's calls of the save and is joined before the
// commit's).
void moe_fs_fault_arm(long n, moe_fault_mode mode);
// Counted calls since the last arm (a dry run of a save gives its points).
long moe_fs_op_count(void);
// Kind of the call that last faulted ("write", "rename", ...), for messages.
const char *moe_fs_fault_op(void);

// The POSIX calls, counted. They return what the call returns (-1 and errno
// on failure); moe_fs_write writes the whole buffer (retrying short writes).
int moe_fs_create(const char *path); // O_WRONLY | O_CREAT | O_TRUNC, mode 0644
// O_WRONLY | O_CREAT | O_EXCL, mode 0644: fails with EEXIST when path exists
// (another writer's file, or one a killed writer left), never truncating it.
int moe_fs_create_excl(const char *path);
int moe_fs_mkstemp(char *tmpl);
int moe_fs_write(int fd, const void *buf, size_t len);
int moe_fs_fsync(int fd);
int moe_fs_rename(const char *from, const char *to);
// rename that fails with EEXIST instead of replacing an existing `to`.
int moe_fs_rename_noreplace(const char *from, const char *to);
int moe_fs_unlink(const char *path);
int moe_fs_mkdir(const char *path, mode_t mode);
int moe_fs_rmdir(const char *path);
// fsync of a directory (makes renames and creations in it durable). A
// filesystem that cannot sync directories (EINVAL) counts as success.
int moe_fs_fsync_dir(const char *dir);

// Library-style helpers (0 or MOE_EIO with a message naming path and step):
// path gets exactly len bytes of buf, fsynced; on failure path is removed.
int moe_fs_write_file(const char *path, const void *buf, size_t len);
// path replaced by exactly len bytes of buf, all or nothing: written to a temp
// file beside it (PATH.tmp.XXXXXX, mode 0644), fsynced, renamed over path,
// then the folder fsynced (best effort: the new file is in place by then). On
// failure the temp file is removed and path keeps what it held before.
int moe_fs_replace_file(const char *path, const void *buf, size_t len);
// A JSON document dumped with jansson's flags (plus a newline) the same way.
struct json_t;
int moe_fs_write_json(const char *path, const struct json_t *doc, size_t flags);
// Removes dir and everything under it, whatever the names (found by listing,
// symbolic links removed, not followed). A missing dir is success.
int moe_fs_remove_tree(const char *dir);

#endif
