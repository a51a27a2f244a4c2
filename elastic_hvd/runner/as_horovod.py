"""``python -m elastic_hvd.runner.as_horovod script.py [args]``: run a Horovod script unchanged.

Used by ``elastic-hvd-run --as-horovod``; ``-m module`` works in place of a script.
"""

import sys

from ..horovod_alias import install
from .program import run


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(
            "usage: python -m elastic_hvd.runner.as_horovod script.py|-m module [args]")
    install(quiet=False)
    run(sys.argv[1:])


if __name__ == "__main__":
    main()
