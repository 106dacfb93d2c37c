// The `moe` executable: everything lives in moe_cli so tests can call the
// same entry point in-process; only this file may exit.
#include "moe/cli/cli.h"

int main(int argc, char **argv) {
    return moe_cli_main(argc, argv);
}
