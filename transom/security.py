"""Kafka client security and fault-event signatures, each from one set of settings.

**Kafka clients.** :class:`KafkaSecurity` reads ``TRANSOM_KAFKA_*`` (see :data:`transom.config.ENV`)
once, checks it, and hands the same settings to both client libraries:

* :meth:`KafkaSecurity.librdkafka` -> the ``security.protocol`` / ``sasl.*`` / ``ssl.*`` dict that
  every confluent-kafka producer, consumer and admin client is built with
  (:func:`transom.kafka.client_config`);
* :meth:`KafkaSecurity.faust_credentials` -> ``faust.SSLCredentials`` / ``faust.SASLCredentials``
  for the Faust apps (TEE, sink), which pass them on to every aiokafka client they make;
  :meth:`KafkaSecurity.aiokafka` gives the same as aiokafka keyword arguments.

A bad value raises :class:`~transom.config.ConfigError` naming the key and what was expected; a
setting that the chosen protocol would ignore (a SASL user over ``SSL``, a CA file over
``PLAINTEXT``) is refused too, so a half-done configuration never runs silently in plaintext.

**Checkpoint daemons** (off by default; see docs/security.md). With ``TRANSOM_CKPT_SECRET`` or
``TRANSOM_CKPT_SECRET_FILE`` set, every connection to a TCE daemon starts with an HMAC
challenge-response both ways (:func:`ckpt_proof`; the protocol is in :mod:`transom.checkpoint.wire`).

**Fault signatures** (off by default). A producer of fault events with a signing key
(``TRANSOM_FAULT_PRINCIPAL`` + ``TRANSOM_SIGNING_KEY``) attaches two Kafka headers to every fault:
``transom-principal`` (its name) and ``transom-signature``: hex HMAC-SHA256 under its key over::

    b"transom-fault-v1\\n" + topic + b"\\n" + principal + b"\\n" + len(key) as 8 bytes big-endian + key + value

A verifier (the controller) built from ``TRANSOM_FAULT_PRINCIPALS`` (``name=key`` pairs) accepts
a fault only if its principal is listed and its signature verifies under that principal's key;
:meth:`FaultVerifier.check` returns the reason otherwise. When authentication is off,
:func:`fault_verifier` returns None and every fault is accepted, signed or not.

Exceptions: :class:`~transom.config.ConfigError` (settings), nothing else; a bad signature is a
reason string, not an exception, because the caller dead-letters it and carries on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import ssl
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .config import ConfigError

__all__ = ["KafkaSecurity", "PROTOCOLS", "MECHANISMS", "FaultSigner", "FaultVerifier", "fault_signer",
           "fault_verifier", "PRINCIPAL_HEADER", "SIGNATURE_HEADER", "MIN_KEY_CHARS", "valid_name", "ckpt_secret",
           "ckpt_proof"]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
PRINCIPAL_HEADER = "transom-principal"
SIGNATURE_HEADER = "transom-signature"
MIN_KEY_CHARS = 16
_DOMAIN = b"transom-fault-v1\n"


def _env(environ: Mapping[str, str], key: str) -> str | None:
    value = environ.get(key)
    return None if value is None or value.strip() == "" else value.strip()


def _secret(environ: Mapping[str, str], key: str) -> str | None:
    """``KEY`` or the first line of the file named by ``KEY_FILE`` (not both)."""
    direct, path = _env(environ, key), _env(environ, key + "_FILE")
    if direct and path:
        raise ConfigError(f"{key} and {key}_FILE are both set: give one")
    if path is None:
        return direct
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{key}_FILE={path!r}: cannot read it ({exc.strerror or exc})") from None
    value = text.splitlines()[0].strip() if text.strip() else ""
    if not value:
        raise ConfigError(f"{key}_FILE={path!r}: the file is empty; expected the secret on its first line")
    return value


def _readable(key: str, path: str | None) -> str | None:
    if path is not None and not os.access(path, os.R_OK):
        raise ConfigError(f"{key}={path!r}: no such readable file; expected a PEM file")
    return path


def valid_name(name: str) -> bool:
    """A principal or node name: letters, digits, ``.``, ``_``, ``-``; 1-253 characters, no leading dash."""
    return 0 < len(name) <= 253 and name[0] != "-" and all(ch.isascii() and (ch.isalnum() or ch in "._-")
                                                          for ch in name)


@dataclass(frozen=True)
class KafkaSecurity:
    """How every Kafka client authenticates and encrypts; :meth:`from_env` builds and checks it."""

    protocol: str = "PLAINTEXT"          # PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
    mechanism: str | None = None         # SASL: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
    username: str | None = None          # SASL user
    password: str | None = field(default=None, repr=False)
    cafile: str | None = None            # SSL: CA bundle that signed the brokers' certificates (PEM)
    certfile: str | None = None          # SSL: this client's certificate (PEM), for brokers that require one
    keyfile: str | None = None           # SSL: this client's private key (PEM)
    check_hostname: bool = True          # SSL: the broker certificate must name the host connected to

    @property
    def ssl(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "KafkaSecurity":
        env = os.environ if environ is None else environ
        key = "TRANSOM_KAFKA_SECURITY_PROTOCOL"
        protocol = (_env(env, key) or "PLAINTEXT").upper()
        if protocol not in PROTOCOLS:
            raise ConfigError(f"{key}={_env(env, key)!r}: expected one of {', '.join(PROTOCOLS)}")
        sasl, tls = protocol.startswith("SASL_"), protocol in ("SSL", "SASL_SSL")
        mechanism = _env(env, "TRANSOM_KAFKA_SASL_MECHANISM")
        username = _env(env, "TRANSOM_KAFKA_SASL_USERNAME")
        password = _secret(env, "TRANSOM_KAFKA_SASL_PASSWORD")
        files = {k: _env(env, f"TRANSOM_KAFKA_SSL_{k}") for k in ("CAFILE", "CERTFILE", "KEYFILE")}
        check = (_env(env, "TRANSOM_KAFKA_SSL_CHECK_HOSTNAME") or "true").lower()
        if check not in ("true", "false"):
            raise ConfigError(f"TRANSOM_KAFKA_SSL_CHECK_HOSTNAME={check!r}: expected true or false")
        if sasl:
            if mechanism is None:
                raise ConfigError(f"TRANSOM_KAFKA_SASL_MECHANISM is not set; {key}={protocol} needs one of "
                                  f"{', '.join(MECHANISMS)}")
            mechanism = mechanism.upper()
            if mechanism not in MECHANISMS:
                raise ConfigError(f"TRANSOM_KAFKA_SASL_MECHANISM={mechanism!r}: expected one of "
                                  f"{', '.join(MECHANISMS)}")
            for name, value in (("TRANSOM_KAFKA_SASL_USERNAME", username), ("TRANSOM_KAFKA_SASL_PASSWORD", password)):
                if value is None:
                    raise ConfigError(f"{name} is not set; {key}={protocol} needs it"
                                      + (" (or TRANSOM_KAFKA_SASL_PASSWORD_FILE)" if "PASSWORD" in name else ""))
        else:
            stray = [n for n, v in (("TRANSOM_KAFKA_SASL_MECHANISM", mechanism),
                                    ("TRANSOM_KAFKA_SASL_USERNAME", username),
                                    ("TRANSOM_KAFKA_SASL_PASSWORD", password)) if v is not None]
            if stray:
                raise ConfigError(f"{stray[0]} is set but {key}={protocol} does not use SASL; expected "
                                  f"{key}=SASL_PLAINTEXT or SASL_SSL")
        if not tls:
            stray = [f"TRANSOM_KAFKA_SSL_{k}" for k, v in files.items() if v is not None]
            if stray:
                raise ConfigError(f"{stray[0]} is set but {key}={protocol} does not use TLS; expected "
                                  f"{key}=SSL or SASL_SSL")
        if (files["CERTFILE"] is None) != (files["KEYFILE"] is None):
            raise ConfigError("TRANSOM_KAFKA_SSL_CERTFILE and TRANSOM_KAFKA_SSL_KEYFILE go together (client "
                              "certificate and its key); expected both or neither")
        for k, v in files.items():
            _readable(f"TRANSOM_KAFKA_SSL_{k}", v)
        return cls(protocol, mechanism if sasl else None, username, password, files["CAFILE"], files["CERTFILE"],
                   files["KEYFILE"], check == "true")

    # ------------------------------------------------------------------ confluent-kafka
    def librdkafka(self) -> dict[str, str]:
        """Settings for a confluent-kafka (librdkafka) client; empty for plain PLAINTEXT."""
        if self.protocol == "PLAINTEXT":
            return {}
        conf = {"security.protocol": self.protocol.lower()}
        if self.sasl:
            conf.update({"sasl.mechanism": self.mechanism, "sasl.username": self.username,
                         "sasl.password": self.password})
        if self.ssl:
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.check_hostname else "none"
            if self.cafile:
                conf["ssl.ca.location"] = self.cafile
            if self.certfile:
                conf.update({"ssl.certificate.location": self.certfile, "ssl.key.location": self.keyfile})
        return conf

    # ------------------------------------------------------------------ aiokafka / Faust
    def ssl_context(self) -> ssl.SSLContext | None:
        """A client TLS context (system CAs, or ``cafile``; client certificate when given); None without TLS."""
        if not self.ssl:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.cafile)
        ctx.check_hostname = self.check_hostname
        if self.certfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx

    def aiokafka(self) -> dict[str, Any]:
        """Keyword arguments for an aiokafka client."""
        kw: dict[str, Any] = {"security_protocol": self.protocol}
        if self.ssl:
            kw["ssl_context"] = self.ssl_context()
        if self.sasl:
            kw.update(sasl_mechanism=self.mechanism, sasl_plain_username=self.username,
                      sasl_plain_password=self.password)
        return kw

    def faust_credentials(self) -> Any:
        """``broker_credentials`` for ``faust.App``: None for PLAINTEXT."""
        import faust

        if self.sasl:
            return faust.SASLCredentials(username=self.username, password=self.password, mechanism=self.mechanism,
                                         ssl_context=self.ssl_context())
        if self.ssl:
            return faust.SSLCredentials(self.ssl_context())
        return None


# --------------------------------------------------------------------------- fault signatures

def _message(topic: str, principal: str, key: bytes | None, value: bytes) -> bytes:
    k = key or b""
    return b"".join((_DOMAIN, topic.encode(), b"\n", principal.encode(), b"\n", struct.pack(">Q", len(k)), k, value))


def _key(name: str, raw: str) -> bytes:
    if len(raw) < MIN_KEY_CHARS:
        raise ConfigError(f"{name}: the key is {len(raw)} characters; expected at least {MIN_KEY_CHARS} "
                          "(e.g. `openssl rand -hex 32`)")
    return raw.encode()


@dataclass(frozen=True)
class FaultSigner:
    """Signs fault events as ``principal``; :meth:`headers` gives the two Kafka headers to attach."""

    principal: str
    key: bytes = field(repr=False)

    def headers(self, topic: str, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        mac = hmac.new(self.key, _message(topic, self.principal, key, value), hashlib.sha256).hexdigest()
        return [(PRINCIPAL_HEADER, self.principal.encode()), (SIGNATURE_HEADER, mac.encode())]


@dataclass(frozen=True)
class FaultVerifier:
    """Accepts faults signed by one of ``principals`` (name -> key)."""

    principals: Mapping[str, bytes] = field(repr=False)

    def check(self, topic: str, key: bytes | None, value: bytes | None,
              headers: list[tuple[str, bytes]] | None) -> str | None:
        """None when the message is signed by an allowed principal; else why it is refused."""
        found = {}
        for name, raw in headers or ():
            if name in (PRINCIPAL_HEADER, SIGNATURE_HEADER):
                if name in found:
                    return f"unsigned or malformed: header {name} appears twice"
                found[name] = raw or b""
        if PRINCIPAL_HEADER not in found or SIGNATURE_HEADER not in found:
            return (f"unsigned fault event (no {PRINCIPAL_HEADER}/{SIGNATURE_HEADER} headers) while fault "
                    "authentication is on")
        principal = found[PRINCIPAL_HEADER].decode("utf-8", "replace")
        secret = self.principals.get(principal)
        if secret is None:
            return f"principal {principal[:64]!r} is not in TRANSOM_FAULT_PRINCIPALS"
        want = hmac.new(secret, _message(topic, principal, key, value or b""), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want.encode(), found[SIGNATURE_HEADER]):
            return f"signature of principal {principal!r} does not verify (wrong key, or the event was altered)"
        return None


def fault_signer(environ: Mapping[str, str] | None = None) -> FaultSigner | None:
    """The signer of this producer from ``TRANSOM_FAULT_PRINCIPAL`` and ``TRANSOM_SIGNING_KEY[_FILE]``, or None."""
    env = os.environ if environ is None else environ
    raw = _secret(env, "TRANSOM_SIGNING_KEY")
    principal = _env(env, "TRANSOM_FAULT_PRINCIPAL")
    if raw is None:
        if principal is not None:
            raise ConfigError("TRANSOM_FAULT_PRINCIPAL is set but TRANSOM_SIGNING_KEY (or _FILE) is not; "
                              "expected both to sign fault events, or neither")
        return None
    if principal is None:
        raise ConfigError("TRANSOM_SIGNING_KEY is set but TRANSOM_FAULT_PRINCIPAL is not; expected the name "
                          "this producer signs as (one of the controller's TRANSOM_FAULT_PRINCIPALS)")
    if not valid_name(principal):
        raise ConfigError(f"TRANSOM_FAULT_PRINCIPAL={principal!r}: expected letters, digits, '.', '_' or '-'")
    return FaultSigner(principal, _key("TRANSOM_SIGNING_KEY", raw))


def fault_verifier(environ: Mapping[str, str] | None = None) -> FaultVerifier | None:
    """The verifier from ``TRANSOM_FAULT_PRINCIPALS[_FILE]`` (``name=key`` pairs, comma- or line-separated);
    None when neither is set: fault authentication is off."""
    env = os.environ if environ is None else environ
    raw = _env(env, "TRANSOM_FAULT_PRINCIPALS")
    path = _env(env, "TRANSOM_FAULT_PRINCIPALS_FILE")
    if raw and path:
        raise ConfigError("TRANSOM_FAULT_PRINCIPALS and TRANSOM_FAULT_PRINCIPALS_FILE are both set: give one")
    name = "TRANSOM_FAULT_PRINCIPALS"
    if path:
        name += "_FILE"
        try:
            raw = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{name}={path!r}: cannot read it ({exc.strerror or exc})") from None
    if raw is None:
        return None
    principals: dict[str, bytes] = {}
    for item in raw.replace(",", "\n").splitlines():
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        who, sep, secret = item.partition("=")
        who, secret = who.strip(), secret.strip()
        if not sep or not valid_name(who):
            raise ConfigError(f"{name}: entry {who[:40]!r}: expected NAME=KEY with NAME of letters, digits, "
                              "'.', '_' or '-'")
        if who in principals:
            raise ConfigError(f"{name}: principal {who!r} is listed twice")
        principals[who] = _key(f"{name} (principal {who!r})", secret)
    if not principals:
        raise ConfigError(f"{name} is set but lists no principal; expected NAME=KEY[,NAME=KEY...]")
    return FaultVerifier(principals)


# --------------------------------------------------------------------------- checkpoint daemons

_CKPT_DOMAIN = b"transom-ckpt-v1\n"


def ckpt_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The checkpoint daemons' shared secret from ``TRANSOM_CKPT_SECRET[_FILE]``, or None (auth off)."""
    env = os.environ if environ is None else environ
    raw = _secret(env, "TRANSOM_CKPT_SECRET")
    return None if raw is None else _key("TRANSOM_CKPT_SECRET", raw)


def ckpt_proof(key: bytes, role: str, server_nonce: str, client_nonce: str) -> str:
    """Hex HMAC-SHA256 proving ``role`` ("client" or "server") holds ``key`` for this pair of nonces."""
    msg = b"".join((_CKPT_DOMAIN, role.encode(), b"\n", server_nonce.encode(), b"\n", client_nonce.encode()))
    return hmac.new(key, msg, hashlib.sha256).hexdigest()
