"""The TCE daemons' wire: length-prefixed JSON messages and raw byte streams over TCP.

A message is a 4-byte big-endian length and a JSON object. Bulk bytes (a shard) follow a
message that announces their size and are sent as they are (``socket.sendfile`` from a
shared-memory file where possible). :class:`Conn` is one client connection with a lock, so a
rank's training thread and its background thread can share it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any

from .errors import CheckpointError

__all__ = ["encode_msg", "send_msg", "recv_msg", "recv_exact_into", "send_file", "Conn", "DaemonError"]

_LEN = struct.Struct(">I")
_CHUNK = 8 << 20


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


def send_file(sock: socket.socket, path: str, size: int) -> None:
    with open(path, "rb") as f:
        sent = 0
        while sent < size:
            k = sock.sendfile(f, offset=sent, count=size - sent)
            if k == 0:
                raise ConnectionError(f"{path}: short file, sent {sent} of {size} bytes")
            sent += k


class Conn:
    """One request/response connection to a daemon at ``addr`` ("host:port")."""

    def __init__(self, addr: str, timeout: float | None = 30.0) -> None:
        host, port = addr.rsplit(":", 1)
        self.addr = addr
        self.lock = threading.Lock()
        try:
            self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise DaemonError(f"cannot reach the TCE daemon at {addr}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.settimeout(None)

    def call(self, msg: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            try:
                send_msg(self.sock, msg)
                reply = recv_msg(self.sock)
            except OSError as exc:
                raise DaemonError(f"TCE daemon at {self.addr}: {msg.get('op')} failed: {exc}") from None
        if reply is None:
            raise DaemonError(f"TCE daemon at {self.addr} closed the connection during {msg.get('op')}")
        if reply.get("error"):
            raise DaemonError(f"TCE daemon at {self.addr}: {msg.get('op')}: {reply['error']}")
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
