"""What a test worker rank reports: one JSON file per original id."""

import json
import os


def write(original_id, **data):
    path = os.path.join(os.environ["TEST_OUT_DIR"], f"rank{original_id}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)
