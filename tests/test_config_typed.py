"""``Config`` is a literal, typed dataclass (issue 43, item 3): mypy checks every
``config.current().name``, and the dataclass stays in step with the settings table."""

import dataclasses
import subprocess
import sys
import typing

import pytest

from elastic_hvd.core import config
from mpijob import ROOT


def test_the_config_fields_are_the_settings_rows_in_order_with_their_types_and_defaults():
    fields = dataclasses.fields(config.Config)
    hints = typing.get_type_hints(config.Config)
    assert [f.name for f in fields] == [s.name for s in config.SETTINGS], \
        "config.Config and config.SETTINGS name different settings (or order them differently)"
    for field, setting in zip(fields, config.SETTINGS):
        expected = setting.kind if setting.default is not None else setting.kind | None
        assert hints[field.name] == expected, (field.name, hints[field.name], expected)
        assert field.default == setting.default and type(field.default) is type(setting.default)
    assert dataclasses.is_dataclass(config.Config) and config.Config.__dataclass_params__.frozen
    assert config.DEFAULTS == config.Config() == config.from_environ({})


def test_every_value_read_has_its_fields_type():
    environ = {s.env: {int: "7", float: "7.5", bool: "1", str: "x"}[s.kind]
               for s in config.SETTINGS}
    environ.update({"ELASTIC_HVD_SPARES_WAIT": "init", "ELASTIC_HVD_HEARTBEAT_TIMEOUT": "30",
                    "ELASTIC_HVD_REPLICA_BUDGET": "0.5"})
    settings = config.from_environ(environ)
    hints = typing.get_type_hints(config.Config)
    for setting in config.SETTINGS:
        assert isinstance(getattr(settings, setting.name), typing.get_args(hints[setting.name])
                          or hints[setting.name]), setting.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.min_np = 2  # type: ignore[misc]


def test_mypy_refuses_a_misspelt_setting(tmp_path):
    checked = tmp_path / "misspelt.py"
    checked.write_text("from elastic_hvd.core import config\n"
                       "timeout: float = config.current().spawn_timeout\n"
                       "typo = config.current().spawn_timout\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental",
                           "--ignore-missing-imports", str(checked)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert '"Config" has no attribute "spawn_timout"' in proc.stdout, proc.stdout
    assert proc.stdout.count("error:") == 1, proc.stdout  # the typo only


def test_the_growth_settings_reach_the_policy_and_the_discovery(tmp_path):
    from elastic_hvd.growth_policy import GrowthPolicy, discover_hosts

    default = GrowthPolicy(respawn=True)
    assert (default.retry_steps, default.max_failures, default.interval, default.check_every) \
        == (20, 3, 5.0, 10)  # the table's defaults
    policy = GrowthPolicy.from_env({"ELASTIC_HVD_RESPAWN": "1",
                                    "ELASTIC_HVD_GROWTH_RETRY_STEPS": "7",
                                    "ELASTIC_HVD_GROWTH_MAX_FAILURES": "2"})
    assert (policy.retry_steps, policy.max_failures) == (7, 2)
    slow = tmp_path / "discover.sh"
    slow.write_text("#!/bin/sh\nsleep 5\necho a:1\n")
    slow.chmod(0o755)
    with pytest.raises(subprocess.TimeoutExpired):
        discover_hosts(str(slow), 0.2)


def test_the_timing_settings_default_to_the_values_the_code_had():
    # issue 43: the numbers moved into the table unchanged
    assert (config.DEFAULTS.anomaly_timeout, config.DEFAULTS.connected_finalize_deadline,
            config.DEFAULTS.discovery_timeout, config.DEFAULTS.exit_grace,
            config.DEFAULTS.stopped_peer_patience) == (5.0, 3.0, 30.0, 10.0, 1.5)
