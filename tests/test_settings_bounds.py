"""Every setting refuses what would break the job later (issue 41, finding 8).

``nan < minimum`` is False, so a lower bound alone let ``nan`` through every float
setting, and ``inf`` through every timeout: ``ELASTIC_HVD_FINALIZE_DEADLINE=inf``
killed the launcher's watchdog thread (``OverflowError``), and
``ELASTIC_HVD_HEARTBEAT_PERIOD=nan`` had Open MPI's detector report every rank dead
(the job exited 0).  One test per kind of setting, then both launchers end to end.
"""

import subprocess
import sys

import pytest

from elastic_hvd.core import config
from mpijob import WORKERS, run_plain_mpirun

BY_KIND = {kind: [s for s in config.SETTINGS if s.kind is kind and not s.internal]
           for kind in (float, int, bool, str)}


@pytest.mark.parametrize("setting", BY_KIND[float], ids=lambda s: s.env)
@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e999", "86401"])
def test_a_float_setting_is_finite_and_at_most_its_bound(setting, text):
    with pytest.raises(ValueError, match=f"^{setting.env}='{text}': must be "):
        config.from_environ({setting.env: text})


@pytest.mark.parametrize("setting", BY_KIND[float], ids=lambda s: s.env)
def test_a_float_setting_takes_its_default_and_a_bound_value(setting):
    upper = config._upper(setting)
    # (the heartbeat pair must also keep timeout > 3 x period: give the other its largest)
    pair = {"ELASTIC_HVD_HEARTBEAT_PERIOD": "0.001", "ELASTIC_HVD_HEARTBEAT_TIMEOUT": "86400"}
    pair.pop(setting.env, None)
    top = {setting.env: repr(upper), **pair}
    if setting.env == "ELASTIC_HVD_HEARTBEAT_PERIOD":
        top[setting.env] = "1000"  # the largest period whose 3 x stays below the timeout
    assert getattr(config.from_environ(top), setting.name) == float(top[setting.env])
    assert getattr(config.from_environ({}), setting.name) == setting.default


def test_a_share_is_at_most_one():
    with pytest.raises(ValueError, match="ELASTIC_HVD_REPLICA_BUDGET='1.5': must be at most 1"):
        config.from_environ({"ELASTIC_HVD_REPLICA_BUDGET": "1.5"})
    assert config.from_environ({"ELASTIC_HVD_REPLICA_BUDGET": "1"}).replica_budget == 1.0


@pytest.mark.parametrize("setting", BY_KIND[int], ids=lambda s: s.env)
@pytest.mark.parametrize("text", ["nan", "inf", "1.5", "", "ten"])
def test_an_int_setting_is_a_whole_number(setting, text):
    with pytest.raises(ValueError, match=f"^{setting.env}='{text}': "):
        config.from_environ({setting.env: text})


@pytest.mark.parametrize("setting", BY_KIND[int], ids=lambda s: s.env)
def test_an_int_setting_is_at_least_its_minimum(setting):
    below = str(int(setting.minimum) - 1)
    with pytest.raises(ValueError, match=f"^{setting.env}='{below}': must be at least"):
        config.from_environ({setting.env: below})


@pytest.mark.parametrize("setting", BY_KIND[bool], ids=lambda s: s.env)
@pytest.mark.parametrize("text", ["nan", "2", "enabled"])
def test_a_bool_setting_is_a_yes_or_a_no(setting, text):
    with pytest.raises(ValueError, match=f"^{setting.env}='{text}': expected 1/0"):
        config.from_environ({setting.env: text})


def test_every_number_setting_has_a_finite_upper_bound_or_is_an_int():
    for setting in BY_KIND[float]:
        assert 0 < config._upper(setting) <= config.DAY, setting.env


def test_the_launcher_refuses_an_infinite_deadline_before_anything_starts(tmp_path):
    # Before: accepted; the launcher's watchdog thread then died of OverflowError, and a
    # stuck mpirun would no longer be ended.
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_hvd.runner.launch", "-np", "2", "-x",
         "ELASTIC_HVD_FINALIZE_DEADLINE=inf", "python", "-c", "pass"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "elastic-hvd-run: ELASTIC_HVD_FINALIZE_DEADLINE='inf': must be a finite number "
        f"({config._BY_NAME['finalize_deadline'].doc})"]


@pytest.mark.multirank
def test_a_nan_heartbeat_stops_every_rank_at_init_under_plain_mpirun():
    # Before: every rank aborted inside init() ("I have been reported dead by someone
    # else") and mpirun exited 0.
    returncode, said = run_plain_mpirun(2, {"ELASTIC_HVD_HEARTBEAT_PERIOD": "nan"},
                                        [sys.executable, WORKERS / "exit_status.py", "ok"])
    assert returncode != 0, said
    assert said.count("ELASTIC_HVD_HEARTBEAT_PERIOD='nan': must be a finite number") == 2, said
