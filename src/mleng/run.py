"""`python -m mleng.run SCRIPT [ARGS...]` (or `-m MODULE`): run a training script with the crash hook installed.

For scripts one cannot edit, and as torchrun's entry point: `torchrun --nproc_per_node 8 -m mleng.run
train.py --lr 3e-4`. The script runs as `python SCRIPT ARGS` would run it (sys.argv, sys.path[0],
__main__); an uncaught exception prints the same traceback (the wrapper's own frames left out) and
exits with the same code, followed by the handbook's note when it knows the error (mleng.crashhook).
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m mleng.run SCRIPT [ARGS...]  |  python -m mleng.run -m MODULE [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        sys.exit(2 if not argv else 0)
    from mleng.crashhook import install_crash_hook

    install_crash_hook()
    if argv[0] == "-m":
        if len(argv) < 2:
            print(USAGE, file=sys.stderr)
            sys.exit(2)
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())  # as `python -m` does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = argv[0]
    if not os.path.exists(script):
        print(f"mleng.run: error: {script}: no such file", file=sys.stderr)
        sys.exit(2)
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` does
    runpy.run_path(os.path.abspath(script), run_name="__main__")  # absolute in tracebacks, as python does


if __name__ == "__main__":
    main()
