"""The newest training state, kept in ``elastic-hvd-run``'s memory, for a relaunch.

Why there: when a node's Open MPI daemon dies, the runtime ends the whole job
(every rank, everywhere), so a copy held by any rank dies with it.  The
launcher is the one process a relaunch needs alive anyway.  Rank 0 sends the
committed state after a step while the previous send is not in flight (so the
copy lags by at most a step or two and never stalls training); a relaunched
job starts from it if it is newer than the checkpoint on disk.

Only the job's own processes get in: the launcher makes a random secret per
job and hands it to its ranks in their environment (never on a command line).
The keeper reads nothing of a connection but a fixed-size proof (the secret's
HMAC of a fresh random challenge) until that proof checks out, so a stranger
costs it 33 bytes and a thread for at most ``PROOF_TIMEOUT``.  Every header
after it (the position, the payload's size and SHA-256) carries an HMAC of the
same challenge, and a payload is kept only if it matches its digest: a state
changed on the way is refused, not stored.  Refusals are logged, one line each,
rate-limited.  The keeper listens only where the ranks can be (see
``listen_address``) and stores the state as opaque bytes: it never unpickles it.
"""

import argparse
import hashlib
import hmac
import ipaddress
import json
import os
import random
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from .core import config, timings
from .growth_policy import parse_hosts, read_hostfile
from .log import get_logger

_log = get_logger(__name__)

#: Environment of the ranks: the keeper's ``host:port``, and the job's secret (hex).
ADDRESS_ENV, SECRET_ENV = config.env("replica"), config.env("job_secret")
#: Set for the ranks by ``elastic-hvd-run``: 0 in the first launch, n in the n-th relaunch.
LAUNCH_ENV = config.env("launch")
CHALLENGE_BYTES = MAC_BYTES = 32
#: What a connection must send first: a verb (one byte) and the HMAC of challenge and verb.
PROOF_BYTES = 1 + MAC_BYTES
PUT, GET = b"p", b"g"
#: Seconds a connection has to send its proof (a rank needs milliseconds), and that any
#: later read or write may stall (core/timings.py).
PROOF_TIMEOUT, TIMEOUT = timings.REPLICA_PROOF_TIMEOUT, timings.REPLICA_TIMEOUT
#: Bytes of a header (a position, a size, a digest: under 200 in practice).
MAX_HEADER = 4096
#: Connections served at once, proved or not; more are closed at once (a rank retries
#: while the keeper is busy, e.g. when every rank of a big relaunch reads the state).
MAX_CONNECTIONS = 64
#: A refusal line may be said this many times in a row, then once per this many seconds.
LOG_BURST, LOG_INTERVAL = timings.REPLICA_LOG_BURST, timings.REPLICA_LOG_INTERVAL
LOOPBACK = "127.0.0.1"
#: Set where a scheduler gives mpirun its hosts when no -H or --hostfile names them.
ALLOCATION_ENV = ("SLURM_JOB_NODELIST", "SLURM_NODELIST", "PBS_NODEFILE", "LSB_MCPU_HOSTS",
                  "LSB_HOSTS", "PE_HOSTFILE", "FLUX_URI")
#: mpirun options by which --mpi-args can name hosts.
HOST_OPTIONS = ("-H", "--host", "-host", "--hostfile", "-hostfile", "--machinefile",
                "-machinefile", "--default-hostfile")


def max_payload() -> int:
    """The largest state kept: a quarter of this host's memory, since the kept copy and
    the one arriving coexist for a moment and the ranks on this host need the rest."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4


class Refused(ConnectionError):
    """A peer failed a check: the keeper refuses the connection, a rank gives up the request."""


def _mac(secret: bytes, challenge: bytes, label: bytes, data: bytes | bytearray) -> bytes:
    return hmac.new(secret, label + b"\0" + challenge + data, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, count: int, deadline: float | None = None) -> bytearray:
    """``count`` bytes, into one buffer; with a ``deadline`` (monotonic), a peer that
    trickles bytes is cut off then, however slowly it sends."""
    buf = bytearray(count)
    view, got = memoryview(buf), 0
    while got < count:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), timings.REPLICA_MIN_TIMEOUT))
        n = sock.recv_into(view[got:], min(count - got, 1 << 20))
        if not n:
            raise ConnectionError("connection closed")
        got += n
    return buf


def _send_payload(sock: socket.socket, payload: bytes | bytearray) -> None:
    """``sendall`` in pieces: its timeout bounds the whole call, and a state of gigabytes
    may take longer than ``TIMEOUT`` to cross a network that never stalls."""
    view = memoryview(payload)
    for start in range(0, len(view), 1 << 20):
        sock.sendall(view[start:start + (1 << 20)])


def _send_head(sock: socket.socket, secret: bytes, challenge: bytes, label: bytes,
               head: Mapping[str, Any], payload: bytes | bytearray = b"",
               digest: str | None = None) -> None:
    """Send ``head``, with the size and digest of ``payload`` (which the caller sends
    next) and the HMAC of the challenge over it all."""
    data = json.dumps({**head, "bytes": len(payload),
                       "sha256": digest or hashlib.sha256(payload).hexdigest()}).encode()
    sock.sendall(len(data).to_bytes(4, "big") + data + _mac(secret, challenge, label, data))


def _read_head(sock: socket.socket, secret: bytes, challenge: bytes, label: bytes,
               limit: int) -> dict[str, Any]:
    """A header checked against the secret and the challenge, announcing at most
    ``limit`` bytes of payload (nothing of which is read yet)."""
    size = int.from_bytes(_read_exact(sock, 4), "big")
    if size > MAX_HEADER:
        raise Refused(f"a header of {size} bytes (at most {MAX_HEADER})")
    data, mac = _read_exact(sock, size), _read_exact(sock, MAC_BYTES)
    if not hmac.compare_digest(mac, _mac(secret, challenge, label, data)):
        raise Refused("a header without the job's proof (changed on the way?)")
    try:
        head = json.loads(data)
        ok = isinstance(head, dict) and type(head["bytes"]) is int and isinstance(
            head["sha256"], str)
    except (ValueError, KeyError):
        ok = False
    if not ok:
        raise Refused("a malformed header")
    if not 0 <= head["bytes"] <= limit:
        raise Refused(f"a state of {head['bytes']} bytes (the launcher keeps at most {limit}, "
                      "a quarter of its host's memory)")
    return head


def _read_payload(sock: socket.socket, head: Mapping[str, Any]) -> bytearray:
    payload = _read_exact(sock, head["bytes"])
    if not hmac.compare_digest(hashlib.sha256(payload).hexdigest().encode(),
                               head["sha256"].encode()):
        raise Refused("a payload that does not match the digest of its header (changed on "
                      "the way?)")
    return payload


def _position(head: Mapping[str, Any]) -> list[int]:
    position = head.get("position")
    if not (isinstance(position, list) and 0 < len(position) <= 16
            and all(type(p) is int for p in position)):
        raise Refused("a malformed position")
    return position


class _Refusals:
    """Counts refusals and says each in one line on stderr, at most ``LOG_BURST`` in a
    row and then one per ``LOG_INTERVAL`` seconds: a flood must not fill the log."""

    def __init__(self) -> None:
        self.count, self._unsaid = 0, 0
        self._tokens, self._at = float(LOG_BURST), time.monotonic()
        self._lock = threading.Lock()

    def note(self, peer: tuple[Any, ...], why: str) -> None:
        with self._lock:
            self.count += 1
            now = time.monotonic()
            self._tokens = min(LOG_BURST, self._tokens + (now - self._at) / LOG_INTERVAL)
            self._at = now
            if self._tokens < 1:
                self._unsaid += 1
                return
            self._tokens -= 1
            unsaid, self._unsaid = self._unsaid, 0
        more = f" ({unsaid} more refused since the last such line)" if unsaid else ""
        _log.warning(f"elastic-hvd-run: refused a connection to the state replica from "
                     f"{peer[0]}:{peer[1]}: {why}{more}")


class Keeper:
    """The launcher's side: a TCP server holding the newest state (``position``,
    opaque bytes) on ``host`` (an address; None: ``listen_address(None)``).
    ``environ()`` is what the ranks need to reach it."""

    def __init__(self, host: str | None = None) -> None:
        self.secret = secrets.token_bytes(32)
        self.position: list[int] | None = None
        self.blob: bytearray | None = None
        self._digest: str | None = None
        self._lock = threading.Lock()
        self._open = 0  # connections being served
        self._refusals = _Refusals()
        self.limit = max_payload()
        bind = listen_address(None) if host is None else host
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._server = socket.create_server((bind, 0), family=family, backlog=MAX_CONNECTIONS)
        self.host = bind or socket.gethostname()  # on every interface: found by name
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._serve, name="elastic_hvd-replica", daemon=True).start()

    @property
    def refused(self) -> int:
        return self._refusals.count

    def environ(self) -> dict[str, str]:
        return {ADDRESS_ENV: f"{self.host}:{self.port}", SECRET_ENV: self.secret.hex()}

    def close(self) -> None:
        self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self._server.accept()
            except OSError:  # closed
                return
            with self._lock:
                busy = self._open >= MAX_CONNECTIONS
                if not busy:
                    self._open += 1
            if busy:  # said before the peer sees the connection closed
                self._refusals.note(peer, f"more than {MAX_CONNECTIONS} connections at once")
                conn.close()
                continue
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()

    def _handle(self, conn: socket.socket, peer: tuple[Any, ...]) -> None:
        try:
            with conn:
                why = self._answer(conn, peer)
                if why is not None:  # said before the peer sees the connection closed
                    self._refusals.note(peer, why)
        finally:
            with self._lock:
                self._open -= 1

    def _answer(self, conn: socket.socket, peer: tuple[Any, ...]) -> str | None:
        """Serve one request; return why it was refused (None: served, refused with a
        reply -- noted before the reply, which the peer may act on at once -- or a proved
        peer went away, as a rank killed mid-send does)."""
        challenge = secrets.token_bytes(CHALLENGE_BYTES)
        try:
            conn.sendall(challenge)
            proof = _read_exact(conn, PROOF_BYTES, time.monotonic() + PROOF_TIMEOUT)
        except OSError:
            proof = bytearray()
        verb = bytes(proof[:1])
        if verb not in (PUT, GET) or not hmac.compare_digest(
                proof[1:], _mac(self.secret, challenge, b"proof", verb)):
            return "it did not prove it holds this job's secret"
        conn.settimeout(TIMEOUT)
        try:
            if verb == GET:
                with self._lock:
                    position, blob, digest = self.position, self.blob, self._digest
                _send_head(conn, self.secret, challenge, b"reply", {"position": position},
                           blob or b"", digest)  # checked when the state came in
                _send_payload(conn, blob or b"")
                return None
            try:
                head = _read_head(conn, self.secret, challenge, b"put", self.limit)
                position = _position(head)
                _send_head(conn, self.secret, challenge, b"reply", {"ok": True})
                payload = _read_payload(conn, head)
            except Refused as exc:
                self._refusals.note(peer, f"{exc}, after a valid proof of the job's secret")
                _send_head(conn, self.secret, challenge, b"reply", {"ok": False, "why": str(exc)})
                return None
            with self._lock:
                kept = self.position is None or position >= self.position
                if kept:
                    self.position, self.blob, self._digest = position, payload, head["sha256"]
            _send_head(conn, self.secret, challenge, b"reply", {"ok": True, "kept": kept})
        except OSError:
            pass  # the rank went away: nothing was stored, or it does not read
        return None


def _local(host: str) -> bool:
    """Whether every address of ``host`` is this machine's."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        if ipaddress.ip_address(address[0]).is_loopback:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))  # only an address of this machine binds
            except OSError:
                return False
    return True


def _route_from(host: str) -> str | None:
    """This machine's address on the interface that reaches ``host`` (None: unknown)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # sends nothing: the kernel picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return None


def listen_address(hosts: Iterable[str] | None) -> str:
    """Where the keeper listens, for a job on ``hosts`` (None: unknown, e.g. a scheduler's
    allocation or hosts a discovery may add): loopback when every host is this one; else
    this machine's address on the one interface that reaches every named host; else the
    address its host name resolves to; else (that name is loopback here, or the hosts
    sit behind several interfaces) every interface, ``""``, where the proof still comes
    first."""
    if hosts is not None:
        remote = [host for host in hosts if not _local(host)]
        if not remote:
            return LOOPBACK
        routes = {_route_from(host) for host in remote}
        if None not in routes:
            if len(routes) > 1:
                return ""
            route = str(routes.pop())
            if not ipaddress.ip_address(route).is_loopback:
                return route
    try:
        own = socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""
    return "" if ipaddress.ip_address(own).is_loopback else own


def job_hosts(args: argparse.Namespace,
              environ: Mapping[str, str] = os.environ) -> list[str] | None:
    """The hosts an ``elastic-hvd-run`` job (its parsed ``args``) can ever have ranks on,
    relaunches and growth included: ``[]`` for this host only, None when they are not
    known in advance."""
    if args.host_discovery_script or (args.hostfile and args.max_np):
        return None  # hosts join while the job runs
    if any(word.split("=")[0] in HOST_OPTIONS for word in shlex.split(args.mpi_args or "")):
        return None
    hosts: list[str] = []
    try:
        if args.hosts:
            hosts += parse_hosts(args.hosts.replace(",", "\n"))
        if args.hostfile:
            hosts += read_hostfile(args.hostfile)
    except (OSError, ValueError):
        return None  # mpirun will say what is wrong with them
    if not hosts and any(name in environ for name in ALLOCATION_ENV):
        return None  # mpirun takes the scheduler's allocation
    if not hosts and any(name.lower().endswith("default_hostfile") for name in environ):
        return None
    return hosts


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process can reach a keeper (it runs under ``elastic-hvd-run``)."""
    return bool(config.read("replica", environ) and config.read("job_secret", environ))


def relaunched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this job is a relaunch (after a node loss) by ``elastic-hvd-run``."""
    return config.read("launch", environ) > 0


def _connect(host: str, port: int, deadline: float) -> tuple[socket.socket, bytes]:
    """A connection and its challenge, retried while the keeper is busy (it closes a
    connection over ``MAX_CONNECTIONS`` before the challenge)."""
    pause = timings.REPLICA_CONNECT_PAUSE_FIRST
    while True:
        sock = socket.create_connection((host, port), timeout=TIMEOUT)
        try:
            return sock, bytes(_read_exact(sock, CHALLENGE_BYTES))
        except ConnectionError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise ConnectionError("the launcher's state keeper stayed busy") from None
        except BaseException:
            sock.close()
            raise
        time.sleep(pause * random.uniform(*timings.REPLICA_JITTER))
        pause = min(pause * 2, timings.REPLICA_CONNECT_PAUSE_MAX)


def _request(verb: bytes, environ: Mapping[str, str], head: Mapping[str, Any] | None = None,
             payload: bytes = b"") -> tuple[dict[str, Any], bytes]:
    host, _, port = config.read("replica", environ).rpartition(":")
    secret = bytes.fromhex(config.read("job_secret", environ))
    sock, challenge = _connect(host, int(port), time.monotonic() + TIMEOUT)
    with sock:
        sock.sendall(verb + _mac(secret, challenge, b"proof", verb))
        if verb == GET:
            reply = _read_head(sock, secret, challenge, b"reply", 1 << 62)
            return reply, bytes(_read_payload(sock, reply))

        def answer() -> dict[str, Any]:
            reply = _read_head(sock, secret, challenge, b"reply", 0)
            if not reply.get("ok"):
                raise Refused(f"the launcher refused the state: {reply.get('why')}")
            return reply
        _send_head(sock, secret, challenge, b"put", head or {}, payload)
        answer()  # the header is taken: only then the payload goes
        _send_payload(sock, payload)
        return answer(), b""


def put(position: Iterable[int], blob: bytes, environ: Mapping[str, str] = os.environ) -> None:
    """Store ``blob`` as the state at ``position`` (a list of ints that orders states: a
    lower one never replaces a higher one)."""
    _request(PUT, environ, {"position": list(position)}, blob)


def get(environ: Mapping[str, str] = os.environ) -> tuple[list[int] | None, bytes | None]:
    """``(position, blob)`` of the newest state kept, or ``(None, None)``."""
    head, blob = _request(GET, environ)
    return (head["position"], blob) if head["position"] is not None else (None, None)
