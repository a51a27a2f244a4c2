"""``python -m elastic_hvd.runner.as_horovod script.py [args]``: run a Horovod script unchanged.

Used by ``elastic-hvd-run --as-horovod``; ``-m module`` works in place of a script.
"""

import runpy
import sys

from ..horovod_alias import install


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m elastic_hvd.runner.as_horovod script.py|-m module [args]")
    install(quiet=False)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
