"""The launcher's copy of the training state (elastic_hvd.state_replica): real
sockets, a stranger without the job's secret, a man in the middle, a flood, ordering
of states, and where the keeper listens."""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elastic_hvd import state_replica
from mpijob import run_job

WORKERS = Path(__file__).parent / "workers"
REFUSED = "refused a connection to the state replica"


@pytest.fixture
def keeper():
    kept = state_replica.Keeper(host="127.0.0.1")
    yield kept
    kept.close()


def address(env):
    host, _, port = env[state_replica.ADDRESS_ENV].rpartition(":")
    return host, int(port)


def test_the_jobs_processes_store_and_read_the_newest_state(keeper):
    env = keeper.environ()
    assert state_replica.get(env) == (None, None)
    state_replica.put([5], b"step five", env)
    state_replica.put([7], b"step seven", env)
    state_replica.put([6], b"late step six", env)  # a slow sender never goes back
    assert state_replica.get(env) == ([7], b"step seven")
    assert keeper.refused == 0


def test_a_state_of_many_megabytes_goes_and_comes_back_whole(keeper):
    env, blob = keeper.environ(), os.urandom(3 << 24)  # sent and read in pieces
    state_replica.put([2, 1], blob, env)
    assert state_replica.get(env) == ([2, 1], blob)


def test_a_stranger_is_refused_and_the_refusal_logged(keeper, capfd):
    env = keeper.environ()
    state_replica.put([3], b"secret weights", env)
    stranger = {**env, state_replica.SECRET_ENV: os.urandom(32).hex()}
    with pytest.raises((ConnectionError, OSError)):
        state_replica.get(stranger)
    with pytest.raises((ConnectionError, OSError)):
        state_replica.put([9], b"poison", stranger)
    # One that merely found the port and speaks garbage gets nothing either.
    with socket.create_connection(address(env), timeout=10) as sock:
        sock.recv(state_replica.CHALLENGE_BYTES)
        sock.sendall(b"\x00\x00\x00\x02{}")
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(100) == b""  # closed without an answer
    assert keeper.refused == 3
    assert state_replica.get(env) == ([3], b"secret weights")
    assert capfd.readouterr().err.count(REFUSED) == 3


# -- what a stranger costs the launcher -----------------------------------------------
@pytest.fixture
def keeper_process():
    """A keeper in a process of its own (tests/workers/keeper.py), whose memory is its own."""
    proc = subprocess.Popen([sys.executable, str(WORKERS / "keeper.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.env = json.loads(proc.stdout.readline())
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def peak_rss_mb(pid):
    """The highest resident memory of ``pid`` so far (VmHWM): what a burst cost, even if
    it was given back since."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:"))
               .split()[1]) / 1024


def flood(addr, prefix, megabytes=300):
    """Connect, read the challenge, send ``prefix(challenge)`` then junk for as long as
    the keeper reads it (up to ``megabytes``); once the keeper has closed the
    connection, return what it sent after the challenge."""
    with socket.create_connection(addr, timeout=20) as sock:
        challenge = sock.recv(state_replica.CHALLENGE_BYTES, socket.MSG_WAITALL)
        junk, answer = b"\xff" * (1 << 20), b""
        try:
            sock.sendall(prefix(challenge))
            for _ in range(megabytes):
                sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # reset by the keeper: what it should do
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
        except OSError:
            pass
        return answer


def proof_shaped(verb=state_replica.PUT):
    """A proof frame of the right size and verb, with a made-up HMAC."""
    return verb + os.urandom(state_replica.MAC_BYTES)


def claiming(size):
    """A well-formed proof frame and header, announcing ``size`` bytes of payload."""
    head = json.dumps({"position": [1], "bytes": size, "sha256": "0" * 64}).encode()
    return proof_shaped() + len(head).to_bytes(4, "big") + head + proof_shaped()[1:]


@pytest.mark.parametrize("prefix", [
    pytest.param(lambda challenge: b"\xff\xff\xff\xff", id="huge-header"),
    pytest.param(lambda challenge: claiming(1 << 40), id="huge-payload"),
])
def test_a_wrong_proof_costs_the_launcher_no_memory_and_one_line(keeper_process, prefix):
    before = peak_rss_mb(keeper_process.pid)
    flood(address(keeper_process.env), prefix)
    grown = peak_rss_mb(keeper_process.pid) - before
    keeper_process.stdin.close()
    err = keeper_process.stderr.read()
    assert grown < 10, f"the keeper grew by {grown:.0f} MB"
    assert err.count(REFUSED) == 1 and len(err.splitlines()) == 1, err
    assert "it did not prove it holds this job's secret" in err


def test_a_state_over_the_cap_is_refused_before_it_is_read(keeper_process):
    """Even from a process with the job's secret: the keeper says no before the payload,
    whatever follows."""
    secret, put = bytes.fromhex(keeper_process.env[state_replica.SECRET_ENV]), state_replica.PUT
    head = json.dumps({"position": [1], "bytes": 1 << 40, "sha256": "0" * 64}).encode()
    before = peak_rss_mb(keeper_process.pid)
    answer = flood(address(keeper_process.env), lambda challenge: (
        put + state_replica._mac(secret, challenge, b"proof", put) +
        len(head).to_bytes(4, "big") + head + state_replica._mac(secret, challenge, b"put", head)))
    grown = peak_rss_mb(keeper_process.pid) - before
    keeper_process.stdin.close()
    err = keeper_process.stderr.read()
    assert b"a state of 1099511627776 bytes (the launcher keeps at most" in answer
    assert grown < 10, f"the keeper grew by {grown:.0f} MB"
    assert "a state of 1099511627776 bytes" in err and len(err.splitlines()) == 1, err


# -- a man in the middle --------------------------------------------------------------
def tampering_proxy(target, change):
    """A TCP proxy to ``target`` for one connection that applies ``change`` to every
    chunk from the client (as a host on the path could); returns its address."""
    server = socket.create_server(("127.0.0.1", 0))

    def pump(src, dst, edit):
        try:
            while chunk := src.recv(1 << 16):
                dst.sendall(edit(chunk))
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve():
        client, _ = server.accept()
        server.close()
        upstream = socket.create_connection(target)
        threading.Thread(target=pump, args=(upstream, client, lambda b: b), daemon=True).start()
        pump(client, upstream, change)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()


@pytest.mark.parametrize("change", [
    pytest.param(lambda chunk: chunk.replace(b"[4]", b"[9]"), id="position"),
    pytest.param(lambda chunk: chunk.replace(b"step four", b"poisoned!"), id="payload"),
])
def test_a_state_changed_on_the_way_is_refused_and_the_kept_copy_stays(keeper, capfd, change):
    env = keeper.environ()
    state_replica.put([3], b"step three", env)
    host, port = tampering_proxy(address(env), change)
    with pytest.raises(ConnectionError, match="the launcher refused the state"):
        state_replica.put([4], b"step four", {**env, state_replica.ADDRESS_ENV: f"{host}:{port}"})
    assert state_replica.get(env) == ([3], b"step three")
    err = capfd.readouterr().err
    assert keeper.refused == 1 and err.count(REFUSED) == 1, err
    assert "changed on the way?" in err


# -- floods ---------------------------------------------------------------------------
def test_too_many_connections_at_once_are_refused_and_a_rank_waits_its_turn(keeper, capfd):
    env = keeper.environ()
    state_replica.put([1], b"step one", env)
    idle = [socket.create_connection(address(env), timeout=10)
            for _ in range(state_replica.MAX_CONNECTIONS)]
    try:
        for sock in idle:
            assert len(sock.recv(state_replica.CHALLENGE_BYTES)) == state_replica.CHALLENGE_BYTES
        with socket.create_connection(address(env), timeout=5) as extra:
            assert extra.recv(100) == b""  # closed, no challenge
        assert f"more than {state_replica.MAX_CONNECTIONS} connections at once" in \
            capfd.readouterr().err
        got = []
        reader = threading.Thread(target=lambda: got.append(state_replica.get(env)))
        reader.start()
        time.sleep(0.5)
    finally:
        for sock in idle:
            sock.close()
    reader.join(state_replica.TIMEOUT)
    assert got == [([1], b"step one")]  # it retried until the keeper had room


def test_a_connection_that_trickles_its_proof_is_cut_off(keeper, capfd):
    """A byte every half second never ends a read's timeout; the proof's deadline does."""
    with socket.create_connection(address(keeper.environ()), timeout=20) as sock:
        sock.recv(state_replica.CHALLENGE_BYTES, socket.MSG_WAITALL)
        started = time.monotonic()
        try:
            for _ in range(state_replica.PROOF_BYTES - 1):
                sock.sendall(b"p")
                time.sleep(0.5)
        except OSError:
            pass
        cut = time.monotonic() - started
    assert cut < state_replica.PROOF_TIMEOUT + 2, f"still connected after {cut:.1f} s"
    assert "it did not prove it holds this job's secret" in capfd.readouterr().err


def test_a_flood_of_refusals_says_a_few_lines_not_one_each(keeper, capfd):
    for _ in range(50):
        with socket.create_connection(address(keeper.environ()), timeout=10) as sock:
            sock.recv(state_replica.CHALLENGE_BYTES)
            sock.sendall(proof_shaped(state_replica.GET))
            sock.recv(100)
    assert keeper.refused == 50
    assert capfd.readouterr().err.count(REFUSED) == state_replica.LOG_BURST


# -- where it listens -----------------------------------------------------------------
def job_hosts(*argv, environ=None):
    from elastic_hvd.runner.launch import parser
    return state_replica.job_hosts(parser().parse_args([*argv, "python", "train.py"]),
                                   environ or {})


def test_a_job_on_this_host_only_is_served_on_loopback_only():
    assert job_hosts("-np", "2") == []
    local = job_hosts("-H", f"localhost:1,{socket.gethostname()}:1,127.0.0.1:2")
    assert local and state_replica.listen_address(local) == state_replica.LOOPBACK
    assert state_replica.listen_address([]) == state_replica.LOOPBACK
    # Where the hosts are not known in advance, they are not taken for this one.
    assert job_hosts("-np", "2", environ={"SLURM_JOB_NODELIST": "node[1-4]"}) is None
    assert job_hosts("-np", "2", "--host-discovery-script", "./hosts.sh") is None
    assert job_hosts("-np", "2", "--mpi-args", "--hostfile /tmp/hosts") is None


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")),
                    reason="a private network namespace needs root, unshare and ip")
def test_a_job_on_other_hosts_is_served_on_the_interface_that_reaches_them():
    # tests/hosts/netns.sh: this host is 10.77.0.1 on simhost0, its peers 10.77.0.0/24.
    code = ("from elastic_hvd import state_replica as s; "
            "print(s.listen_address(['10.77.0.2']), s.listen_address(['localhost', '10.77.0.9']))")
    out = subprocess.run([str(Path(__file__).parent / "hosts" / "netns.sh"), sys.executable,
                          "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["10.77.0.1", "10.77.0.1"], out.stderr


@pytest.mark.multirank
def test_the_launcher_of_a_job_on_this_host_listens_on_loopback_only(tmp_path):
    job = run_job("keeper_address.py", np=1, tmp_path=tmp_path, timeout=60)
    assert job.results[0]["listening"] == [state_replica.LOOPBACK], job.results[0]


def test_the_secret_is_not_on_the_launchers_command_line():
    from elastic_hvd.runner.command import build_command
    from elastic_hvd.runner.launch import parser
    cmd = build_command(parser().parse_args(["-np", "2", "python", "train.py"]), mpirun="mpirun")
    assert not any(state_replica.SECRET_ENV in part and "=" in part for part in cmd)
