"""Reading ``/proc/.../stat``, in one place: a process's state letter, start time and
CPU time are what the stopped-member watch, the spinning check, the launcher's look at
a frozen job and the identity of a process to signal (:mod:`.signals`) go by."""

#: Index in :func:`stat_fields` of the start time (field 22 of proc(5): clock ticks
#: after boot), which with the pid names one process for good: a later one that gets
#: the same pid starts later.
START = 19


def stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc`` stat file after the command's name (``fields[0]`` is
    field 3 of proc(5), the state), None if the process or thread is gone.  Split
    after the last ``)``: the name may hold spaces and parentheses."""
    try:
        with open(path) as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None
