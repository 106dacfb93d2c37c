// The `moe` executable: everything lives in moe_cli so tests can call the
// same entry point in-process; only this file may exit.
#include "moe/cli/cli.h"

#include <signal.h>

int main(int argc, char **argv) {
    // A file-size limit (ulimit -f) would kill the process with SIGXFSZ and no
    // message; ignored, the write fails with EFBIG and its error path names the
    // file (exit 1), as for a full disk.
    signal(SIGXFSZ, SIG_IGN);
    return moe_cli_main(argc, argv);
}
