"""The launcher's copy of the training state (elastic_hvd.state_replica): real
sockets, a stranger without the job's secret, ordering of states."""

import os
import socket

import pytest

from elastic_hvd import state_replica


@pytest.fixture
def keeper():
    kept = state_replica.Keeper(host="127.0.0.1")
    yield kept
    kept.close()


def test_the_jobs_processes_store_and_read_the_newest_state(keeper):
    env = keeper.environ()
    assert state_replica.get(env) == (None, None)
    state_replica.put([5], b"step five", env)
    state_replica.put([7], b"step seven", env)
    state_replica.put([6], b"late step six", env)  # a slow sender never goes back
    assert state_replica.get(env) == ([7], b"step seven")
    assert keeper.refused == 0


def test_a_stranger_is_refused_and_the_refusal_logged(keeper, capfd):
    env = keeper.environ()
    state_replica.put([3], b"secret weights", env)
    stranger = {**env, state_replica.SECRET_ENV: os.urandom(32).hex()}
    with pytest.raises((ConnectionError, OSError)):
        state_replica.get(stranger)
    with pytest.raises((ConnectionError, OSError)):
        state_replica.put([9], b"poison", stranger)
    # One that merely found the port and speaks garbage gets nothing either.
    host, port = env[state_replica.ADDRESS_ENV].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.recv(state_replica.CHALLENGE_BYTES)
        sock.sendall(b"\x00\x00\x00\x02{}")
        assert sock.recv(100) == b""  # closed without an answer
    assert keeper.refused == 3
    assert state_replica.get(env) == ([3], b"secret weights")
    assert capfd.readouterr().err.count("refused a connection to the state replica") == 3


def test_the_secret_is_not_on_the_launchers_command_line():
    from elastic_hvd.runner.launch import build_command, parser
    cmd = build_command(parser().parse_args(["-np", "2", "python", "train.py"]), mpirun="mpirun")
    assert not any(state_replica.SECRET_ENV in part and "=" in part for part in cmd)
