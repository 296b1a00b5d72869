"""Agent configuration: TOML file, environment (wins over the file), flags (win over both), errors that
name the key and list the valid ones; the collector runner's interval and tags; --list-collectors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from transom import contracts
from transom.agents.collectors import CollectorError, RunningCollector, create_collector, register_collector
from transom.agents.config import load_config
from transom.agents.nic import NICSettings
from transom.config import ConfigError

TRANSOM = [sys.executable, "-m", "transom.cli"]

TOML = """
[agent]
node = "from-file"
interval = 2.0
collectors = ["host", "nic", "agent"]
spool_max_mb = 64
[agent.tags]
rack = "r12"

[collectors.nic]
interval = 10
exclude = ["lo", "docker0"]
tags = { fabric = "ib" }

[collectors.host]
io = false
"""


def test_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_text(TOML)
    cfg = load_config(str(path), env={})
    a = cfg.agent
    assert (a.node, a.interval, a.collectors, a.spool_max_mb, a.tags) == ("from-file", 2.0, ["host", "nic", "agent"], 64.0, {"rack": "r12"})
    assert cfg.settings("nic").exclude == ["lo", "docker0"] and cfg.settings("host").io is False
    assert cfg.common["nic"] == {"interval": 10.0, "tags": {"fabric": "ib"}}
    env = {"TRANSOM_AGENT__INTERVAL": "0.5", "TRANSOM_AGENT__NIC__EXCLUDE": "lo,veth0", "TRANSOM_NODE": "env-node",
           "TRANSOM_AGENT__HOST__IO": "true", "TRANSOM_AGENT__TAGS": "rack=r1,row=3",
           "TRANSOM_AGENT_ADDR": "127.0.0.1:9"}  # the training side's variable is not a setting
    cfg = load_config(str(path), env=env)
    assert (cfg.agent.interval, cfg.settings("nic").exclude, cfg.settings("host").io) == (0.5, ["lo", "veth0"], True)
    assert cfg.agent.node == "from-file" and cfg.agent.tags == {"rack": "r1", "row": "3"}  # the file names the node
    cfg = load_config(str(path), env=env, overrides={"interval": 3.0, "node": "flag-node", "gpus": None})
    assert (cfg.agent.interval, cfg.agent.node, cfg.agent.gpus) == (3.0, "flag-node", 2)
    assert load_config(env={"TRANSOM_NODE": "env-node"}).agent.node == "env-node"


@pytest.mark.parametrize("toml, env, message", [
    ("[agent]\nintervall = 1", {}, "unknown key 'intervall'; valid keys: bootstrap, collectors, delivery_timeout_s"),
    ("[collectors.nvidia]\nx = 1", {}, "unknown collector 'nvidia'; valid: agent, gpu, host, nic, train"),
    ("[collectors.nic]\nroot_dir = '/x'", {}, "unknown key 'root_dir'; valid keys: exclude, include, infiniband, root, source, totals, virtual, interval, tags"),
    ("[agnet]\n", {}, "unknown section 'agnet'; valid sections: agent, collectors"),
    ("[agent]\ncollectors = ['host', 'gpus']", {}, "unknown collector 'gpus'; valid: agent, gpu, host, nic, train"),
    ("[agent]\ninterval = 'fast'", {}, "agent config .* \\[agent\\].interval: expected a number, got 'fast'"),
    ("", {"TRANSOM_AGENT__GPU__XID_WAIT": "5"}, "environment \\[collectors.gpu\\]: unknown key 'xid_wait'; valid keys: xid_wait_ms"),
    ("", {"TRANSOM_AGENT__SPOOL_MAX_MB": "-1"}, "agent.spool_max_mb: must be positive, got -1.0"),
    ("", {"TRANSOM_AGENT__GPU_SOURCE": "cuda"}, "agent.gpu_source: 'cuda' is unknown; expected one of: nvml, simulated, none"),
    ("[agent]\nscenario = 'x.toml'", {}, "a fault scenario is played only by gpu_source = \"simulated\""),
    ("[agent\n", {}, "is not valid TOML"),
])
def test_bad_config_names_the_key_and_the_valid_ones(tmp_path, toml, env, message):
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path), env=env)


def test_registry_refuses_duplicate_and_unknown_names():
    with pytest.raises(CollectorError, match="already registered"):
        register_collector("host", lambda ctx, s: None)
    with pytest.raises(CollectorError, match="unknown collector 'nope'; valid: agent, gpu, host"):
        create_collector("nope", ctx=None)
    nic = create_collector("nic", ctx=None, settings=NICSettings(root="/nonexistent"))
    assert nic.name == "nic" and nic.collect() == []


class _Counting:
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def collect(self):
        self.calls += 1
        if self.calls == 2:
            raise OSError("sensor unplugged")
        return [contracts.Sample(contracts.Source.HOST, {"n": float(self.calls), "bad": float("nan")},
                                 tags={"rack": "own"})]


def test_runner_applies_interval_tags_and_error_policy_once(caplog):
    c = _Counting()
    rc = RunningCollector(c, every=2, tags={"rack": "r12", "row": "3"})
    out = []
    for _ in range(6):
        if rc.due():
            out.append(rc.collect())
    assert c.calls == 3 and rc.errors == 1 and out[1] == []
    (s,) = out[0]
    assert dict(s.fields) == {"n": 1.0} and dict(s.tags) == {"rack": "own", "row": "3"}  # the collector's tag wins
    assert rc.dropped_fields == 2
    assert sum("sensor unplugged" in r.getMessage() for r in caplog.records) == 1


def test_list_collectors_and_bad_config_from_the_command(tmp_path):
    done = subprocess.run(TRANSOM + ["agent", "--list-collectors"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for text in ("[collectors.gpu]", "xid_wait_ms (int) = 500", "[collectors.nic]", "root (str) = '/sys'",
                 "interval: seconds between collects", "collectors run by default, in batch order: host, gpu, nic, train, agent"):
        assert text in done.stdout
    bad = tmp_path / "agent.toml"
    bad.write_text("[collectors.nic]\nroot_dir = '/x'\n")
    done = subprocess.run(TRANSOM + ["agent", "--config", str(bad), "--list-collectors"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "unknown key 'root_dir'" in done.stderr and "Traceback" not in done.stderr


def test_deploy_files_keep_nvml_visible_and_the_spool_on_disk(tmp_path):
    import configparser

    import yaml

    root = Path(__file__).resolve().parents[1] / "deploy"
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(root / "systemd" / "transom-agent.service")
    svc = unit["Service"]
    assert svc["User"] == "transom-agent" and svc["Restart"] == "on-failure"
    assert svc["StateDirectory"] == "transom-agent" and "PrivateDevices" not in svc  # it would hide /dev/nvidia*
    assert "transom agent --config" in svc["ExecStart"] and svc["KillSignal"] == "SIGTERM"
    docs = {d["kind"]: d for d in yaml.safe_load_all((root / "kustomize" / "agent-daemonset.yaml").read_text())}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    agent = next(c for c in pod["containers"] if c["name"] == "agent")
    env = {e["name"]: e for e in agent["env"]}
    assert env["TRANSOM_NODE"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert "nvidia.com/gpu" not in str(agent["resources"])  # it must not take a GPU from the jobs
    # the shipped agent.toml (deploy/systemd) is a valid config, its state dir the unit's StateDirectory
    path = root / "systemd" / "agent.toml"
    cfg = load_config(str(path), env={"TRANSOM_NODE": "gpu-node-1"})
    assert cfg.agent.gpu_source == "nvml" and cfg.agent.state_dir == f"/var/lib/{svc['StateDirectory']}"


def test_the_agent_process_imports_nothing_heavy():
    """RSS target 80 MB: the `transom agent` path (the CLI with every component's parser, and the agent)
    must not pull in torch, numpy, faust and the like; a component's cli.py imports them in its command."""
    code = ("import sys; import transom.cli as c; c.build_parser(); import transom.agents.agent, transom.broker; "
            "heavy = ('torch', 'numpy', 'faust', 'aiokafka', 'scipy', 'sklearn', 'pyod', 'influxdb_client', 'pandas'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & set(heavy)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"heavy modules on the agent's import path: {done.stdout}"
