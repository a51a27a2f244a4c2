"""Every core collective, op and dtype against numpy on 2 and 4 ranks (no failures)."""

import pytest

from mpijob import run_job

pytestmark = pytest.mark.multirank


# pieces=8: every allreduce goes through MPI in 8-byte pieces (1 to 8 elements),
# each piece scaled on its own, as 64 MiB goes in 1 MiB pieces by default.
@pytest.mark.parametrize("np_,pieces", [(2, None), (4, None), (4, 8)])
def test_collectives_match_numpy(tmp_path, np_, pieces):
    env = {"ELASTIC_HVD_ALLREDUCE_PIECE_BYTES": pieces} if pieces else None
    job = run_job("core_numerics.py", np=np_, tmp_path=tmp_path, env=env)
    assert sorted(job.results) == list(range(np_)), job.output[-3000:]
    for rank, result in job.results.items():
        assert result["failures"] == [], f"rank {rank}: {result['failures']}"
