"""What a test worker rank reports: one JSON file per original id."""

import json
import os


def write(original_id, **data):
    path = os.path.join(os.environ["TEST_OUT_DIR"], f"rank{original_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def upstream(entry, out_dir=None, **evidence):
    """Record that the Open MPI bug ``entry`` (a workarounds.TABLE name) struck this job:
    a line of ``upstream.jsonl`` in the output directory (tests/known_failures.py)."""
    path = os.path.join(out_dir or os.environ["TEST_OUT_DIR"], "upstream.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"entry": entry, **evidence}) + "\n")
