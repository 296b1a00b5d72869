"""The TCE daemons' wire: length-prefixed JSON messages and raw byte streams over TCP.

Every connection opens with the daemon's greeting ``{"transom": "ckpt/1", "auth": ..., "nonce":
NS}``. With a shared secret (``TRANSOM_CKPT_SECRET`` / ``_FILE``, :func:`transom.security.ckpt_secret`)
``auth`` is ``"hmac-sha256"`` and the client must answer first with ``{"op": "auth", "nonce": NC,
"mac": HMAC(secret, client|NS|NC)}``; the daemon answers ``{"ok": true, "mac": HMAC(secret,
server|NS|NC)}``, which the client checks in turn (a daemon that cannot prove the secret gets no
checkpoint bytes). Anything else first is refused, logged by the daemon with the peer's address,
and the connection is closed. Without a secret ``auth`` is null; a client that has a secret
refuses such a daemon.

A message is a 4-byte big-endian length and a JSON object. Bulk bytes (a shard) follow a
message that announces their size and are sent as they are, out of the sender's mapping of
the shared-memory segment (:func:`send_view`); a receiver that gets no byte for :data:`STALL_S`
seconds fails, and a sender that fails after the announcement hangs up, so a broken stream is
never waited for nor read as a reply. :class:`Conn` is one client connection with a lock, so a
rank's training thread and its background thread can share it.
"""

from __future__ import annotations

import hmac
import json
import os
import secrets
import socket
import struct
import threading
from typing import Any

from transom.config import ConfigError

from .errors import CheckpointError

__all__ = ["encode_msg", "send_msg", "recv_msg", "recv_exact_into", "send_view", "Conn", "DaemonError",
           "greet", "client_key", "handshake_client"]

_LEN = struct.Struct(">I")
_CHUNK = 8 << 20
#: seconds a bulk receive may go without a byte before it fails (the sender died or hangs mid-stream):
#: the restore goes on with the next copy, the daemon frees the replica segment
STALL_S = 30.0


class DaemonError(CheckpointError):
    """A TCE daemon refused a request or could not be reached; the message says which and why."""


def encode_msg(msg: dict[str, Any]) -> bytes:
    raw = json.dumps(msg, separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode_msg(msg))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def recv_exact_into(sock: socket.socket, mv: memoryview, on_chunk=None) -> None:
    """Fill ``mv`` from ``sock``; ``on_chunk(view)`` gets each filled piece in order (for hashing)."""
    got, n, fed = 0, len(mv), 0
    while got < n:
        k = sock.recv_into(mv[got:got + _CHUNK])
        if k == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {n} bytes")
        got += k
        if on_chunk is not None and (got - fed >= _CHUNK or got == n):
            on_chunk(mv[fed:got])
            fed = got


def recv_msg(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection cleanly before one."""
    head = bytearray(4)
    k = sock.recv_into(head)
    if k == 0:
        return None
    if k < 4:
        recv_exact_into(sock, memoryview(head)[k:])
    (n,) = _LEN.unpack(head)
    return json.loads(_recv_exact(sock, n))


def send_view(sock: socket.socket, view: memoryview, piece: int = _CHUNK) -> None:
    """Send ``view`` (a daemon's mapping of a segment: its memory, whatever became of the file's
    path) in ``piece``-byte ``sendall`` calls. Measured here against ``sendfile`` of the segment's
    file over loopback, 1 GiB, 8 alternating runs: median 1.03-1.13 s against 1.54-1.61 s
    (``sendfile`` moves a file through a 16-page pipe, 64 KiB per step)."""
    mv = view.cast("B") if view.format != "B" else view
    for lo in range(0, len(mv), piece):
        sock.sendall(mv[lo:lo + piece])


GREETING = "ckpt/1"
_HANDSHAKE_S = 10.0


def client_key() -> bytes | None:
    """This process's checkpoint secret (read from the environment each time: a rotated file is seen)."""
    from transom.security import ckpt_secret

    return ckpt_secret()


def greet(sock: socket.socket, key: bytes | None) -> str | None:
    """Daemon side: send the greeting and check the client's proof; None when the client may go on,
    else why not (the caller logs it and closes the connection)."""
    from transom.security import ckpt_proof

    nonce = secrets.token_hex(16)
    send_msg(sock, {"transom": GREETING, "auth": "hmac-sha256" if key else None, "nonce": nonce})
    if key is None:
        return None
    sock.settimeout(_HANDSHAKE_S)
    try:
        msg = recv_msg(sock)
    except (OSError, ValueError) as exc:
        return f"no authentication within {_HANDSHAKE_S:.0f} s ({type(exc).__name__})"
    finally:
        sock.settimeout(None)
    if msg is None:
        return "closed the connection before authenticating"
    if msg.get("op") != "auth" or not isinstance(msg.get("nonce"), str) or not isinstance(msg.get("mac"), str):
        why = f"unauthenticated request {str(msg.get('op'))[:40]!r} (TRANSOM_CKPT_SECRET is set on this daemon)"
        send_msg(sock, {"error": "authentication required: set TRANSOM_CKPT_SECRET (or _FILE) to the "
                                 "daemons' shared secret"})
        return why
    want = ckpt_proof(key, "client", nonce, msg["nonce"])
    if not hmac.compare_digest(want, msg["mac"]):
        send_msg(sock, {"error": "authentication failed: wrong TRANSOM_CKPT_SECRET"})
        return "wrong secret (HMAC does not verify)"
    send_msg(sock, {"ok": True, "mac": ckpt_proof(key, "server", nonce, msg["nonce"])})
    return None


def handshake_client(sock: socket.socket, addr: str, key: bytes | None) -> None:
    """Client side of the greeting; DaemonError naming the daemon and the cause when it fails."""
    from transom.security import ckpt_proof

    hello = recv_msg(sock)
    if not hello or hello.get("transom") != GREETING:
        raise DaemonError(f"{addr} is not a TCE daemon speaking {GREETING} (greeting {hello!r:.80})")
    if hello.get("auth") is None:
        if key is not None:
            raise DaemonError(f"TCE daemon at {addr} does not authenticate but TRANSOM_CKPT_SECRET is set "
                              f"here: refusing it (set the same secret on the daemon)")
        return
    if key is None:
        raise DaemonError(f"TCE daemon at {addr} requires authentication: set TRANSOM_CKPT_SECRET (or "
                          f"TRANSOM_CKPT_SECRET_FILE) to the daemons' shared secret")
    nonce = secrets.token_hex(16)
    send_msg(sock, {"op": "auth", "nonce": nonce, "mac": ckpt_proof(key, "client", hello["nonce"], nonce)})
    reply = recv_msg(sock)
    if not reply or reply.get("error"):
        raise DaemonError(f"TCE daemon at {addr} refused this client: {reply and reply.get('error')}")
    if not hmac.compare_digest(str(reply.get("mac")), ckpt_proof(key, "server", hello["nonce"], nonce)):
        raise DaemonError(f"TCE daemon at {addr} could not prove the shared secret: refusing it")


class Conn:
    """One request/response connection to a daemon at ``addr`` ("host:port")."""

    def __init__(self, addr: str, timeout: float | None = 30.0, key: bytes | None | bool = True) -> None:
        host, port = addr.rsplit(":", 1)
        self.addr = addr
        self.lock = threading.Lock()
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise DaemonError(f"cannot reach the TCE daemon at {addr}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.settimeout(timeout if timeout is not None else _HANDSHAKE_S)
            handshake_client(self.sock, addr, client_key() if key is True else key or None)
        except (DaemonError, ConfigError):
            self.close()
            raise
        except (OSError, ValueError) as exc:
            self.close()
            raise DaemonError(f"TCE daemon at {addr}: handshake failed: {exc}") from None
        self.sock.settimeout(None)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.send(msg)
            return self.answer(msg.get("op"))

    def send(self, msg: dict[str, Any]) -> None:
        """Send a request without waiting for its answer (read it later with :meth:`answer`)."""
        try:
            send_msg(self.sock, msg)
        except OSError as exc:
            raise DaemonError(f"TCE daemon at {self.addr}: {msg.get('op')} failed: {exc}") from None

    def answer(self, op: str | None) -> dict[str, Any]:
        """The daemon's answer to the request ``op`` sent last; DaemonError when it refused or went away."""
        try:
            reply = recv_msg(self.sock)
        except OSError as exc:
            raise DaemonError(f"TCE daemon at {self.addr}: {op} failed: {exc}") from None
        if reply is None:
            raise DaemonError(f"TCE daemon at {self.addr} closed the connection during {op}")
        if reply.get("error"):
            raise DaemonError(f"TCE daemon at {self.addr}: {op}: {reply['error']}")
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
