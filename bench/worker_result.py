"""What a benchmark's worker reports: rank 0 prints one ``RESULT {json}`` line, and
the driver reads the last one from the job's output (one reader for every bench)."""

import json
import subprocess

PREFIX = "RESULT "


def parse(output):
    """The JSON of the last ``RESULT`` line of ``output``, or None."""
    lines = [line for line in output.splitlines() if line.startswith(PREFIX)]
    return json.loads(lines[-1][len(PREFIX):]) if lines else None


def run(cmd, timeout=900, cwd=None, env=None):
    """Run the job ``cmd`` and return its result; RuntimeError with the end of its
    output when it reported none."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                         env=env)
    result = parse(out.stdout)
    if result is None:
        raise RuntimeError(f"no result from {' '.join(map(str, cmd))}:\n{out.stdout[-2000:]}"
                           f"{out.stderr[-3000:]}")
    return result
