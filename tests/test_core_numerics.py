"""Every core collective, op and dtype against numpy on 2 and 4 ranks (no failures)."""

import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("np_", [2, 4])
def test_collectives_match_numpy(tmp_path, np_):
    job = run_job("core_numerics.py", np=np_, tmp_path=tmp_path)
    assert sorted(job.results) == list(range(np_)), job.output[-3000:]
    for rank, result in job.results.items():
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
