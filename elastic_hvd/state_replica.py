"""The newest training state, kept in ``elastic-hvd-run``'s memory, for a relaunch.

Why there: when a node's Open MPI daemon dies, the runtime ends the whole job
(every rank, everywhere), so a copy held by any rank dies with it.  The
launcher is the one process a relaunch needs alive anyway.  Rank 0 sends the
committed state after a step while the previous send is not in flight (so the
copy lags by at most a step or two and never stalls training); a relaunched
job starts from it if it is newer than the checkpoint on disk.

Only the job's own processes get in: the launcher makes a random secret per
job and hands it to its ranks in their environment (never on a command line).
A connection must answer a fresh random challenge with the secret's HMAC before
it can store or read anything; any other is refused, and the refusal is logged.
The keeper stores the state as opaque bytes: it never unpickles what it gets.
"""

import hashlib
import hmac
import json
import os
import secrets
import socket
import sys
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .core import config

#: Environment of the ranks: the keeper's ``host:port``, and the job's secret (hex).
ADDRESS_ENV, SECRET_ENV = config.env("replica"), config.env("job_secret")
#: Set for the ranks by ``elastic-hvd-run``: 0 in the first launch, n in the n-th relaunch.
LAUNCH_ENV = config.env("launch")
CHALLENGE_BYTES = 32
TIMEOUT = 30.0


def _proof(secret: bytes, challenge: bytes, verb: str) -> bytes:
    return hmac.new(secret, challenge + verb.encode(), hashlib.sha256).digest()


def _read_exact(sock: socket.socket, count: int) -> bytes:
    chunks: list[bytes]
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _send_frame(sock: socket.socket, header: Mapping[str, Any], payload: bytes = b"") -> None:
    head = json.dumps({**header, "bytes": len(payload)}).encode()
    sock.sendall(len(head).to_bytes(4, "big") + head + payload)


def _read_frame(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    head = json.loads(_read_exact(sock, int.from_bytes(_read_exact(sock, 4), "big")))
    return head, _read_exact(sock, head["bytes"])


class Keeper:
    """The launcher's side: a TCP server holding the newest state (``position``,
    opaque bytes).  ``environ()`` is what the ranks need to reach it."""

    def __init__(self, host: str | None = None) -> None:
        self.secret = secrets.token_bytes(32)
        self.position: list[Any] | None
        self.blob: bytes | None
        self.position, self.blob = None, None
        self.refused = 0
        self._lock = threading.Lock()
        self._server = socket.create_server(("", 0))
        self.host = host or socket.gethostname()
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._serve, name="elastic_hvd-replica", daemon=True).start()

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
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()

    def _handle(self, conn: socket.socket, peer: tuple[Any, ...]) -> None:
        with conn:
            conn.settimeout(TIMEOUT)
            challenge = secrets.token_bytes(CHALLENGE_BYTES)
            try:
                conn.sendall(challenge)
                head, payload = _read_frame(conn)
                verb = head["verb"]
                proof = _proof(self.secret, challenge, verb) if verb in ("put", "get") else b""
                trusted = proof and hmac.compare_digest(bytes.fromhex(head["proof"]), proof)
            except (OSError, ValueError, KeyError, TypeError, ConnectionError):
                trusted = False
            if not trusted:
                self.refused += 1
                print(f"elastic-hvd-run: refused a connection to the state replica from "
                      f"{peer[0]}:{peer[1]}: it did not prove it holds this job's secret",
                      file=sys.stderr, flush=True)
                return
            try:
                if verb == "put":
                    with self._lock:
                        if self.position is None or head["position"] >= self.position:
                            self.position, self.blob = head["position"], payload
                    _send_frame(conn, {"ok": True})
                else:
                    with self._lock:
                        position, blob = self.position, self.blob
                    _send_frame(conn, {"position": position}, blob or b"")
            except OSError:
                pass  # the sender went away: nothing was stored, or it does not read


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process can reach a keeper (it runs under ``elastic-hvd-run``)."""
    return bool(config.read("replica", environ) and config.read("job_secret", environ))


def relaunched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this job is a relaunch (after a node loss) by ``elastic-hvd-run``."""
    return config.read("launch", environ) > 0


def _request(verb: str, header: Mapping[str, Any] | None = None, payload: bytes = b"",
             environ: Mapping[str, str] = os.environ) -> tuple[dict[str, Any], bytes]:
    host, _, port = config.read("replica", environ).rpartition(":")
    secret = bytes.fromhex(config.read("job_secret", environ))
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        challenge = _read_exact(sock, CHALLENGE_BYTES)
        _send_frame(sock, {**(header or {}), "verb": verb,
                           "proof": _proof(secret, challenge, verb).hex()}, payload)
        return _read_frame(sock)


def put(position: Iterable[Any], blob: bytes, environ: Mapping[str, str] = os.environ) -> None:
    """Store ``blob`` as the state at ``position`` (a list that orders states: a
    lower one never replaces a higher one)."""
    _request("put", {"position": list(position)}, blob, environ)


def get(environ: Mapping[str, str] = os.environ) -> tuple[list[Any] | None, bytes | None]:
    """``(position, blob)`` of the newest state kept, or ``(None, None)``."""
    head, blob = _request("get", environ=environ)
    return (head["position"], blob) if head["position"] is not None else (None, None)
