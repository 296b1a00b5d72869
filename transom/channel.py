"""A small authenticated request/response channel over TCP, for the controller and its node launchers.

One request per connection. Every frame is a 4-byte big-endian length and a JSON object. A
request is ``{"op", "args", "ts", "nonce", "mac"}``; the answer is ``{"ok", "result" | "error",
"nonce", "mac"}``, where ``nonce`` repeats the request's (an answer cannot be replayed for another
request). ``mac`` is hex HMAC-SHA256 under the cluster key over::

    b"transom-channel-v1\\n" + b"req\\n" or b"ans\\n" + the frame's JSON without "mac" (sorted keys, no spaces)

The server refuses (and logs, one line naming the peer) a request whose MAC does not verify, whose
``ts`` is more than ``window_s`` seconds from its clock, or whose nonce it has seen within the
window (a replay). It answers a refused request with ``{"ok": false, "refused": REASON}``, unsigned.

The cluster key is the same trust as fault events: ``TRANSOM_CLUSTER_KEY`` (or
``TRANSOM_CLUSTER_KEY_FILE``), at least 16 characters; when neither is set, the key the fault
producers sign with (``TRANSOM_SIGNING_KEY[_FILE]``) is used. :func:`cluster_key` returns None when
there is none; a launcher then refuses to start, since it starts processes for whoever asks.

Exception tree::

    ChannelError(RuntimeError)       any failure of a call
        Unreachable(ChannelError)    no connection or no answer within the timeout
        Refused(ChannelError)        the server refused the request (authentication, replay, clock)
        RemoteError(ChannelError)    the handler raised; the message is its error
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import socketserver
import struct
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Mapping

from .config import ConfigError
from .log import get
from .security import MIN_KEY_CHARS, _secret

__all__ = ["ChannelServer", "call", "cluster_key", "ChannelError", "Unreachable", "Refused", "RemoteError",
           "WINDOW_S", "MAX_FRAME"]

log = get("channel")
WINDOW_S = 30.0
MAX_FRAME = 16 << 20
_DOMAIN = b"transom-channel-v1\n"


class ChannelError(RuntimeError):
    """A call failed."""


class Unreachable(ChannelError):
    """No connection, or no answer in time."""


class Refused(ChannelError):
    """The server refused the request."""


class RemoteError(ChannelError):
    """The server's handler raised."""


def cluster_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster key from ``TRANSOM_CLUSTER_KEY[_FILE]``, else ``TRANSOM_SIGNING_KEY[_FILE]``; None if neither."""
    env = os.environ if environ is None else environ
    for name in ("TRANSOM_CLUSTER_KEY", "TRANSOM_SIGNING_KEY"):
        raw = _secret(env, name)
        if raw is not None:
            if len(raw) < MIN_KEY_CHARS:
                raise ConfigError(f"{name}: the key is {len(raw)} characters; expected at least {MIN_KEY_CHARS} "
                                  "(e.g. `openssl rand -hex 32`)")
            return raw.encode()
    return None


def _mac(key: bytes, kind: bytes, frame: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in frame.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, _DOMAIN + kind + b"\n" + body.encode(), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, frame: Mapping[str, Any]) -> None:
    data = json.dumps(frame, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> dict[str, Any]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
    frame = json.loads(_recv_exact(sock, size))
    if not isinstance(frame, dict):
        raise ValueError("a frame must be a JSON object")
    return frame


def call(addr: str, key: bytes, op: str, args: Mapping[str, Any] | None = None, *, timeout: float = 10.0,
         connect_timeout: float = 3.0) -> Any:
    """Send ``op(**args)`` to the server at ``HOST:PORT``; its result, or a :class:`ChannelError`.

    ``connect_timeout`` bounds the connection (a host cut off the network fails fast), ``timeout``
    the wait for the answer (an operation such as a launch may take long).
    """
    host, _, port = addr.rpartition(":")
    req = {"op": op, "args": dict(args or {}), "ts": time.time(), "nonce": secrets.token_hex(16)}
    req["mac"] = _mac(key, b"req", req)
    try:
        with socket.create_connection((host, int(port)), timeout=min(timeout, connect_timeout)) as sock:
            sock.settimeout(timeout)
            _send(sock, req)
            ans = _recv(sock)
    except (OSError, ConnectionError, ValueError) as exc:
        raise Unreachable(f"{op} to {addr}: {type(exc).__name__}: {exc}") from None
    if "refused" in ans:
        raise Refused(f"{op} to {addr} refused: {ans['refused']}")
    if ans.get("nonce") != req["nonce"] or not hmac.compare_digest(str(ans.get("mac", "")), _mac(key, b"ans", ans)):
        raise Refused(f"{op} to {addr}: the answer is not signed with the cluster key (a different key, or not a "
                      "Transom launcher)")
    if not ans.get("ok"):
        raise RemoteError(f"{op} on {addr}: {ans.get('error')}")
    return ans.get("result")


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        owner = self.server.owner
        peer = f"{self.client_address[0]}:{self.client_address[1]}"
        self.request.settimeout(owner.io_timeout)
        try:
            req = _recv(self.request)
        except (OSError, ConnectionError, ValueError, struct.error) as exc:
            log.warning("channel: bad request from %s: %s", peer, exc)
            return
        why = owner.check(req)
        if why:
            log.warning("channel: refused %r from %s: %s", str(req.get("op"))[:40], peer, why)
            self._reply({"ok": False, "refused": why})
            return
        ans: dict[str, Any]
        try:
            handler = owner.handlers[req["op"]]
            ans = {"ok": True, "result": handler(**dict(req.get("args") or {}))}
        except KeyError as exc:
            ans = {"ok": False, "error": f"unknown op {req.get('op')!r}" if req.get("op") not in owner.handlers
                   else f"KeyError: {exc}"}
        except Exception as exc:       # noqa: BLE001 - the caller hears of every failure
            log.warning("channel: %s from %s failed: %s: %s", req.get("op"), peer, type(exc).__name__, exc)
            ans = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ans["nonce"] = req["nonce"]
        ans["mac"] = _mac(owner.key, b"ans", ans)
        self._reply(ans)

    def _reply(self, frame: Mapping[str, Any]) -> None:
        try:
            _send(self.request, frame)
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: "ChannelServer"


class ChannelServer:
    """Serves ``handlers`` (op name -> callable taking the request's args as keywords, returning JSON-able)."""

    def __init__(self, key: bytes | None, handlers: Mapping[str, Callable[..., Any]], host: str = "127.0.0.1",
                 port: int = 0, *, window_s: float = WINDOW_S, io_timeout: float = 30.0) -> None:
        if not key:
            raise ConfigError("no cluster key: set TRANSOM_CLUSTER_KEY (or TRANSOM_CLUSTER_KEY_FILE), the same on "
                              "the controller and every node; a channel without one would obey anyone")
        self.key, self.handlers = key, dict(handlers)
        self.window_s, self.io_timeout = window_s, io_timeout
        self._seen: OrderedDict[str, float] = OrderedDict()     # nonce -> ts, for the window
        self._lock = threading.Lock()
        self._server = _Server((host, port), _Handler)
        self._server.owner = self
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def check(self, req: Mapping[str, Any]) -> str | None:
        """None when ``req`` is signed with the cluster key, fresh and not seen before; else why not."""
        for field, kind in (("op", str), ("ts", (int, float)), ("nonce", str), ("mac", str)):
            if not isinstance(req.get(field), kind):
                return f"unauthenticated or malformed request (no valid {field!r})"
        if not hmac.compare_digest(req["mac"], _mac(self.key, b"req", req)):
            return "MAC does not verify (no cluster key, or a different one: check TRANSOM_CLUSTER_KEY)"
        now = time.time()
        if abs(now - req["ts"]) > self.window_s:
            return f"timestamp {now - req['ts']:+.0f}s from this host's clock, outside the {self.window_s:.0f}s window"
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < now - 2 * self.window_s:
                self._seen.popitem(last=False)
            if req["nonce"] in self._seen:
                return "replayed request (nonce already seen)"
            self._seen[req["nonce"]] = now
        return None

    def start(self) -> "ChannelServer":
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="channel", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()
