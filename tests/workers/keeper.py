"""The launcher's state keeper alone in a process, so that a test can measure what a
connection costs it: prints the ranks' environment as one JSON line, serves until its
stdin closes.

    python keeper.py
"""

import json
import sys

from elastic_hvd import state_replica

keeper = state_replica.Keeper(state_replica.LOOPBACK)
print(json.dumps(keeper.environ()), flush=True)
sys.stdin.read()
keeper.close()
