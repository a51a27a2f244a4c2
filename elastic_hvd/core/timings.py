"""Every internal timing and threshold of elastic_hvd, named in one place.

These pace loops and bound waits that no user needs to tune: polling periods, the
grace of a thread's stop, back-offs.  Those a user could need to change (how long a
job waits, when it gives up) are settings instead (:data:`.config.SETTINGS`).
Seconds unless said otherwise.  This module imports nothing.
"""

# -- the communicator (comm.py) -------------------------------------------------------------
#: How long a leaving rank waits for the others before it interrupts whatever they run.
LEAVE_TIMEOUT = 1.0
#: The first and the longest pause between two tests of a request (``comm._wait``): doubled
#: after each test, so that a short wait costs microseconds and a long one little CPU.
WAIT_PAUSE_FIRST, WAIT_PAUSE_MAX = 1e-5, 1e-3

# -- the heartbeat (heartbeat.py) -----------------------------------------------------------
#: Progress-loop wake-ups per heartbeat period (as Open MPI's own detector thread wakes up),
#: and the shortest interval between two.
PROGRESS_WAKEUPS_PER_PERIOD = 10
PROGRESS_MIN_INTERVAL = 0.005
#: How long ``stop()`` waits for the progress loop to leave.
PROGRESS_STOP_WAIT = 5.0
#: The stall watchdog looks every ``min(STALL_POLL, stall timeout / STALL_POLLS)``; a rank
#: in a collective for ``min(STALL_SAY_AFTER, timeout / 2)`` tells the board it waits, again
#: every ``min(STALL_SAY_AFTER, timeout / 3)``; a peer counts as waiting if it said so within
#: ``STALL_BOARD_POLLS`` polls + ``STALL_BOARD_SLACK``.
STALL_POLL, STALL_POLLS = 0.5, 4
STALL_SAY_AFTER = 1.0
STALL_BOARD_POLLS, STALL_BOARD_SLACK = 3, 1.0
#: Time for the launcher to forward the watchdog's last line before the rank kills itself.
LAST_LINE_DELAY = 0.3

# -- growth (growth.py, spawn.py, spares.py) ------------------------------------------------
#: Between two looks of a merged, not yet joined process at its communicator (revoked: the
#: job gave it up), and how long ``close()`` waits for that watch to stop.
JOIN_WATCH_PERIOD = 0.05
JOIN_WATCH_STOP = 1.0
#: Between two looks of a rank at a running spawn or merge (a failed member ends it).
SPAWN_WATCH_PERIOD = 0.05
#: How long a given-up call has to end once revoked before this process counts as broken
#: by it (a sound one ends within milliseconds).
BROKEN_GRACE = 1.0
#: A given-up call's thread that uses at least SPIN_SHARE of a core over SPIN_SAMPLE seconds
#: spins in Open MPI's endless retry (see spawn.MergeCall._end_if_broken); low, because a
#: loop gets only its part of a loaded host (docs/measurements.md, "spin share").
SPIN_SAMPLE, SPIN_SHARE = 0.5, 0.05
#: Between two ``MPI_Iprobe`` of a waiting hot spare (and of the ranks' looks at a spare).
SPARE_POLL = 0.05
#: How long the ranks wait for the spares they release to receive it, and the pause
#: between two tests.
SPARE_RELEASE_WAIT, SPARE_RELEASE_PAUSE = 1.0, 0.01

# -- the copy of the training state at elastic-hvd-run (state_replica.py) -------------------
#: A transfer that stalls this long is given up (the launcher and rank 0 both use it, so it
#: is no setting: a -x value would reach only the ranks).
REPLICA_TIMEOUT = 30.0
#: How long a new connection may take to prove it comes from the job.
REPLICA_PROOF_TIMEOUT = 5.0
#: Refusals said in a row, then one per LOG_INTERVAL seconds.
REPLICA_LOG_BURST, REPLICA_LOG_INTERVAL = 5, 10.0
#: The first and longest pause between two tries to connect (with a jitter of x0.5-1.5),
#: and the shortest socket timeout left before a deadline.
REPLICA_CONNECT_PAUSE_FIRST, REPLICA_CONNECT_PAUSE_MAX = 0.02, 1.0
REPLICA_JITTER = (0.5, 1.5)
REPLICA_MIN_TIMEOUT = 0.001

# -- the TF layer (tensorflow/keras/replacement.py) -----------------------------------------
#: Looks for a spare's readiness at one epoch start (agreed; a spare is ready within
#: milliseconds of its adoption), and the pause between two.
REPLACEMENT_POLLS, REPLACEMENT_PAUSE = 100, 0.02

# -- the fault plan of tests (faults.py) ------------------------------------------------------
#: How long a "hang" fault sleeps (for ever, as far as a test sees).
HANG = 3600.0
