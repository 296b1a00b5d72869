"""Deploy files against the code: docker-compose, the Dockerfile and the kustomize base for Kubernetes.

Each test reads what the code does (environment variables it reads, its command line, the
topics' partitions, the Kubernetes calls of the controller's backend) and fails where a deploy
file disagrees.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from transom import config, contracts
from transom.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
CODE = ("transom", "agents", "streams", "controller", "checkpoint")

#: Set by the controller's backends for the ranks they launch (never by an operator).
LAUNCHER_SET = {"TRANSOM_JOB", "TRANSOM_GENERATION", "TRANSOM_RESUME_STEP", "TRANSOM_AGENT_ADDR", "TRANSOM_AGENTS",
                "TRANSOM_HOST_IP", "TRANSOM_SPARE"}
#: Read by the training API (transom/elastic.py) inside the user's ranks, from the job's environment (the
#: submitter's, which `transom run` passes on): settings of a job, not of a deployed service.
JOB_SIDE = {"TRANSOM_ELASTIC", "TRANSOM_PG_TIMEOUT_S", "TRANSOM_REFORM_TIMEOUT_S", "TRANSOM_STEP_TIMEOUT_S"}
#: Given per node or per pod, not in the shared settings: the node id (a flag or the pod's node name),
#: the address a node's services advertise (the pod's IP, from the downward API), the InfluxDB token (a secret).
PER_NODE = {"TRANSOM_NODE", "TRANSOM_ADVERTISE_ADDR"}
SECRET = {"TRANSOM_INFLUX_TOKEN"}
#: Read only by benchmarks, the corpus generator and the test bed, never by a deployed service.
BENCH_ONLY = {"TRANSOM_FAULT_TRACE", "TRANSOM_TESTBED_DIR"}


def code_env() -> dict[str, set[str]]:
    """Every TRANSOM_* variable the code reads or sets -> the files that name it."""
    found: dict[str, set[str]] = {}
    for top in CODE:
        for path in (ROOT / top).rglob("*.py"):
            for name in re.findall(r"""["'](TRANSOM_[A-Z0-9_]*[A-Z0-9])["']""", path.read_text()):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for name in config.ENV:
        if "<" not in name:      # a pattern (TRANSOM_AGENT__<KEY>), optional by nature
            found.setdefault(name, set()).add("transom/config.py")
    return {k: v for k, v in found.items()
            if "_TEST_" not in k and k not in BENCH_ONLY}     # test hooks and bench inputs are not settings


def operator_env() -> set[str]:
    return set(code_env()) - LAUNCHER_SET - JOB_SIDE


def test_launcher_set_variables_are_set_by_a_launcher():
    env = code_env()
    for name in LAUNCHER_SET:
        assert any(f.startswith("controller/") for f in env.get(name, ())), \
            f"{name} is no longer set by the controller's backends: move it out of LAUNCHER_SET"


# --------------------------------------------------------------------------- docker compose

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _transom_services(compose: dict) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items() if str(s.get("image", "")).startswith("transom:")}


def test_compose_has_the_live_system(compose):
    services = compose["services"]
    for name in ("kafka", "influxdb", "grafana", "tee", "sink", "controller"):
        assert name in services, f"compose lacks service {name}"
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert set(kafka["environment"]["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}   # KRaft
    assert not any("zookeeper" in n for n in services)
    assert services["influxdb"]["image"].startswith("influxdb:2")
    assert services["influxdb"]["environment"]["DOCKER_INFLUXDB_INIT_MODE"] == "setup"
    agents = [s for s in _transom_services(compose).values() if s["command"][0] == "agent"]
    assert agents and all(s["command"][s["command"].index("--gpu-source") + 1] == "simulated" for s in agents)


def test_compose_commands_parse_with_the_real_cli(compose):
    parser = build_parser()
    commands = set()
    for name, s in _transom_services(compose).items():
        try:
            parser.parse_args(s["command"])
        except SystemExit:
            pytest.fail(f"compose service {name}: `transom {' '.join(s['command'])}` does not parse")
        commands.add(s["command"][0])
        assert s["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]).resolve().is_file()
    assert {"tee", "sink", "controller", "agent", "ckpt-server"} <= commands


def test_compose_sets_every_variable_the_code_reads(compose):
    wanted = operator_env()
    for name, s in _transom_services(compose).items():
        env = s["environment"]
        missing = wanted - set(env) - PER_NODE
        assert not missing, f"compose service {name} does not set {sorted(missing)} (read by the code)"
        stale = {k for k in env if k.startswith("TRANSOM_")} - set(code_env())
        assert not stale, f"compose service {name} sets {sorted(stale)}, which no code reads"


def test_compose_addresses_and_ports_agree(compose):
    services = compose["services"]
    kenv = services["kafka"]["environment"]
    listeners = dict(re.findall(r"(\w+)://([^,]+)", kenv["KAFKA_ADVERTISED_LISTENERS"]))
    ports = {name: hp.rsplit(":", 1)[1] for name, hp in re.findall(r"(\w+)://([^,]+)", kenv["KAFKA_LISTENERS"])}
    assert listeners["PLAINTEXT"].endswith(":" + ports["PLAINTEXT"])
    influx_port = "8086"        # InfluxDB's own default http bind port
    assert f"{influx_port}:{influx_port}" in services["influxdb"]["ports"]
    for name, s in _transom_services(compose).items():
        assert s["environment"]["TRANSOM_BOOTSTRAP"] == listeners["PLAINTEXT"], name
        assert s["environment"]["TRANSOM_INFLUX_URL"] == f"http://influxdb:{influx_port}", name
    # the controller reaches each agent's intake on 127.0.0.1: the agents share its network namespace
    ctl = services["controller"]["command"]
    nodes = dict(ctl[i + 1].split("=", 1) for i, a in enumerate(ctl) if a == "--node")
    agents = {s["command"][s["command"].index("--node") + 1]: s for s in _transom_services(compose).values()
              if s["command"][0] == "agent"}
    assert set(nodes) == set(agents)
    for node, addr in nodes.items():
        s = agents[node]
        assert s["network_mode"] == "service:controller"
        assert addr == f"127.0.0.1:{s['command'][s['command'].index('--intake-port') + 1]}"
    daemons = {s["command"][s["command"].index("--node") + 1]: s for s in _transom_services(compose).values()
               if s["command"][0] == "ckpt-server"}
    assert set(daemons) == set(nodes)        # a TCE daemon per node, in the ranks' IPC namespace
    assert all(d["ipc"] == "service:controller" for d in daemons.values())


def test_compose_grafana_is_provisioned(compose):
    g = compose["services"]["grafana"]
    mounts = {Path(src): dst.split(":")[0] for src, dst in (v.split(":", 1) for v in g["volumes"])}
    for src in mounts:
        assert (DEPLOY / src).is_dir(), f"grafana mounts {src}, which does not exist"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/transom.yaml").read_text())["providers"][0]
    assert mounts[Path("grafana/dashboards")] == provider["options"]["path"]
    assert list((DEPLOY / "grafana/dashboards").glob("*.json"))
    ds_text = (DEPLOY / "grafana/provisioning/datasources/transom.yaml").read_text()
    needed = set(re.findall(r"\$\{(\w+)\}", ds_text))
    assert needed and needed <= set(g["environment"]), f"grafana lacks {needed - set(g['environment'])}"
    assert g["environment"]["TRANSOM_INFLUX_URL"] == compose["services"]["sink"]["environment"]["TRANSOM_INFLUX_URL"]
    assert g["environment"]["TRANSOM_INFLUX_DB"] == compose["services"]["influxdb"]["environment"][
        "DOCKER_INFLUXDB_INIT_BUCKET"] == compose["services"]["sink"]["environment"]["TRANSOM_INFLUX_DB"]
    init = [v.split(":")[0] for v in compose["services"]["influxdb"]["volumes"] if "initdb" in v]
    assert init and (DEPLOY / init[0]).is_file()
    assert "v1 dbrp create" in (DEPLOY / init[0]).read_text()      # InfluxQL on InfluxDB 2 needs the mapping


# --------------------------------------------------------------------------- Dockerfile

def test_dockerfile_installs_every_package_and_the_pinned_torch():
    text = (DEPLOY / "Dockerfile").read_text()
    copied = {src.rstrip("/") for src in re.findall(r"^COPY (\S+) \S+$", text, re.M)}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dirs = set(project["tool"]["setuptools"]["package-dir"].values())
    assert dirs <= copied, f"the Dockerfile does not copy {sorted(dirs - copied)}"
    for src in copied:
        assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which does not exist"
    (torch,) = [d for d in project["project"]["dependencies"] if d.startswith("torch")]
    assert f"TORCH_VERSION={torch.split('==')[1]}" in text
    assert 'ENTRYPOINT ["transom"]' in text


# --------------------------------------------------------------------------- Kubernetes (kustomize)

@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: test_deploy renders deploy/kustomize with `kubectl kustomize`",
                    pytrace=False)
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kustomize")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _one(objs: list[dict], kind: str, name: str) -> dict:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"kustomize output has {len(found)} {kind} {name}"
    return found[0]


def _containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


def test_k8s_commands_parse_with_the_real_cli(k8s):
    parser = build_parser()
    seen = set()
    for obj in k8s:
        if obj["kind"] not in ("DaemonSet", "Deployment"):
            continue
        for c in _containers(obj):
            args = [a.replace("$(TRANSOM_NODE)", "node0") for a in c["args"]]
            try:
                parser.parse_args(args)
            except SystemExit:
                pytest.fail(f"{obj['metadata']['name']}/{c['name']}: `transom {' '.join(args)}` does not parse")
            seen.add(args[0])
            assert c["image"].startswith("transom:")
    assert {"agent", "ckpt-server", "tee", "sink", "controller"} <= seen


def test_k8s_agent_daemonset_runs_on_gpu_nodes_without_taking_a_gpu(k8s):
    ds = _one(k8s, "DaemonSet", "transom-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    containers = {c["name"]: c for c in spec["containers"]}
    assert set(containers) == {"agent", "ckpt-server"}
    for c in containers.values():
        for part in ("requests", "limits"):
            assert not any("gpu" in k for k in c.get("resources", {}).get(part, {})), f"{c['name']} requests a GPU"
        env = {e["name"]: e for e in c.get("env", [])}
        assert env["TRANSOM_NODE"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    agent_env = {e["name"]: e.get("value") for e in containers["agent"]["env"]}
    assert agent_env["NVIDIA_VISIBLE_DEVICES"] == "all" and spec["runtimeClassName"] == "nvidia"
    assert containers["agent"]["args"][containers["agent"]["args"].index("--gpu-source") + 1] == "nvml"


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_k8s_rank_pods_reach_their_nodes_agent_daemon_and_checkpoint_volume(k8s):
    """What the controller's backend puts in rank pods meets what the DaemonSet and the PVC provide."""
    from transom.controller.kubernetes import KubernetesBackend

    ctl = _containers(_one(k8s, "Deployment", "transom-controller"))[0]["args"]
    spec = _one(k8s, "DaemonSet", "transom-agent")["spec"]["template"]["spec"]
    containers = {c["name"]: c for c in spec["containers"]}
    agent = containers["agent"]
    assert _arg(agent["args"], "--intake-port") == _arg(ctl, "--k8s-agent-port")
    host = {e["name"]: e for e in agent["env"]}["TRANSOM_AGENT__INTAKE_HOST"]
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"      # what the rank pods send to
    runtime = _arg(ctl, "--k8s-ckpt-runtime")
    assert _one(k8s, "ConfigMap", "transom-env")["data"]["TRANSOM_CKPT_RUNTIME"] == runtime
    volumes = {v["name"]: v for v in spec["volumes"]}
    mount = [m for m in containers["ckpt-server"]["volumeMounts"] if m["mountPath"] == runtime]
    assert mount and volumes[mount[0]["name"]]["hostPath"]["path"] == runtime   # the rank pods mount that path
    pvc = _one(k8s, "PersistentVolumeClaim", _arg(ctl, "--k8s-ckpt-pvc"))
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    backend = KubernetesBackend(api_url="http://127.0.0.1:1", gpus=int(_arg(ctl, "--k8s-gpus")),
                                ckpt_pvc=_arg(ctl, "--k8s-ckpt-pvc"), ckpt_runtime=runtime,
                                agent_port=int(_arg(ctl, "--k8s-agent-port")))
    pod = backend.pod_spec("job", 0, 0, ["node0"], ["python", "train.py"], None)
    claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [pvc["metadata"]["name"]]
    assert {"name": "TRANSOM_AGENT_ADDR", "value": f"$(TRANSOM_HOST_IP):{_arg(agent['args'], '--intake-port')}"} \
        in pod["spec"]["containers"][0]["env"]


def _deploy_daemonsets(k8s: list[dict]) -> list[tuple[str, dict]]:
    """Every DaemonSet Transom ships: the rendered kustomize base and any YAML elsewhere in deploy/."""
    out = [("deploy/kustomize", d) for d in k8s if d["kind"] == "DaemonSet"]
    for path in DEPLOY.rglob("*.y*ml"):
        if "kustomize" not in path.parts:
            out += [(str(path.relative_to(ROOT)), d) for d in yaml.safe_load_all(path.read_text())
                    if isinstance(d, dict) and d.get("kind") == "DaemonSet"]
    return out


def test_every_transom_daemonset_tolerates_the_eviction_taint(k8s):
    from transom.controller.kubernetes import TAINT_KEY

    daemonsets = _deploy_daemonsets(k8s)
    assert [(w, d["metadata"]["name"]) for w, d in daemonsets] == [("deploy/kustomize", "transom-agent")], \
        "one agent DaemonSet (the agent with its checkpoint daemon) is shipped"
    for where, ds in daemonsets:
        tolerations = ds["spec"]["template"]["spec"].get("tolerations", [])
        assert any(t.get("key") in (TAINT_KEY, None) and t.get("effect") in ("NoExecute", None)
                   and (t.get("operator") == "Exists" or t.get("key") == TAINT_KEY) for t in tolerations), \
            f"{where} {ds['metadata']['name']}: cordoning a node ({TAINT_KEY}:NoExecute) would evict it"


def test_k8s_objects_validate_against_the_kubernetes_models(k8s):
    from k8s_models import validate

    for obj in k8s:
        validate(obj)


def test_k8s_tee_is_one_worker_for_the_peers_detector_and_one_controller(k8s):
    partitions = next(t.partitions for t in contracts.TOPICS if t.name == contracts.METRICS)
    tee = _one(k8s, "Deployment", "transom-tee")
    assert 1 <= tee["spec"]["replicas"] <= partitions
    # metrics are keyed by node: W workers split a job's nodes W ways, and the peers detector needs 3+
    # nodes of a job on one worker (docs/tee.md); the base ships one worker
    assert tee["spec"]["replicas"] == 1, "more TEE workers split jobs below the peers detector's 3 nodes"
    assert _one(k8s, "Deployment", "transom-controller")["spec"]["replicas"] == 1


_K8S_CALLS = {   # kubernetes client method -> (resource, verb, namespaced)
    "create_namespaced_pod": ("pods", "create", True), "delete_namespaced_pod": ("pods", "delete", True),
    "list_namespaced_pod": ("pods", "list", True), "read_namespaced_pod": ("pods", "get", True),
    "create_namespaced_service": ("services", "create", True),
    "read_namespaced_service": ("services", "get", True),
    "delete_namespaced_service": ("services", "delete", True),
    "patch_namespaced_pod": ("pods", "patch", True), "patch_namespaced_service": ("services", "patch", True),
    "list_node": ("nodes", "list", False), "read_node": ("nodes", "get", False), "patch_node": ("nodes", "patch", False),
}


def test_k8s_controller_rbac_is_what_the_backend_calls(k8s):
    source = (ROOT / "controller/kubernetes.py").read_text()
    calls = set(re.findall(r"\.((?:create|delete|list|read|patch|replace)_\w+)\(", source))
    unknown = calls - set(_K8S_CALLS)
    assert not unknown, f"controller/kubernetes.py calls {sorted(unknown)}: add them to _K8S_CALLS and the RBAC"
    need = {True: set(), False: set()}
    for call in calls:
        resource, verb, namespaced = _K8S_CALLS[call]
        need[namespaced].add((resource, verb))

    def granted(kind: str, name: str) -> set[tuple[str, str]]:
        rules = _one(k8s, kind, name)["rules"]
        assert all(r["apiGroups"] == [""] for r in rules)
        return {(res, verb) for r in rules for res in r["resources"] for verb in r["verbs"]}

    assert granted("Role", "transom-controller") == need[True]
    assert granted("ClusterRole", "transom-controller-nodes") == need[False]
    ctl = _containers(_one(k8s, "Deployment", "transom-controller"))[0]
    assert ctl["args"][ctl["args"].index("--backend") + 1] == "kubernetes"
    sa = _one(k8s, "Deployment", "transom-controller")["spec"]["template"]["spec"]["serviceAccountName"]
    bindings = [b for b in k8s if b["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert bindings and all(b["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": "transom"}]
                            or b["subjects"][0]["name"] == sa for b in bindings)


def test_k8s_config_sets_every_variable_the_code_reads(k8s):
    cm = _one(k8s, "ConfigMap", "transom-env")["data"]
    secret = _one(k8s, "Secret", "transom-influx")["data"]
    missing = operator_env() - set(cm) - PER_NODE - SECRET
    assert not missing, f"deploy/kustomize/config.env does not set {sorted(missing)} (read by the code)"
    stale = set(cm) - set(code_env())
    assert not stale, f"deploy/kustomize/config.env sets {sorted(stale)}, which no code reads"
    assert SECRET <= set(secret)
    for obj in k8s:
        if obj["kind"] in ("DaemonSet", "Deployment"):
            for c in _containers(obj):
                refs = [e.get("configMapRef", {}).get("name") for e in c.get("envFrom", [])]
                assert "transom-env" in refs, f"{obj['metadata']['name']}/{c['name']} misses transom-env"
    sink = _containers(_one(k8s, "Deployment", "transom-sink"))[0]
    assert {"name": "transom-influx"} in [e.get("secretRef") for e in sink["envFrom"]]
    assert re.fullmatch(r"[\w.-]+:\d+(,[\w.-]+:\d+)*", cm["TRANSOM_BOOTSTRAP"])
    assert re.fullmatch(r"https?://[\w.-]+:8086", cm["TRANSOM_INFLUX_URL"])


# --------------------------------------------------------------------------- systemd, examples, references

def _units() -> dict[str, dict[str, list[str]]]:
    """deploy/systemd/*.service -> [Service] key -> values (repeated keys kept in order)."""
    out = {}
    for path in sorted((DEPLOY / "systemd").glob("*.service")):
        entries: dict[str, list[str]] = {}
        section = None
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("["):
                section = line
            elif section == "[Service]" and "=" in line and not line.startswith("#"):
                key, value = line.split("=", 1)
                entries.setdefault(key, []).append(value.strip())
        out[path.name] = entries
    return out


def _exec_args(unit: dict[str, list[str]]) -> list[str]:
    argv = unit["ExecStart"][-1].split()
    assert argv[0].endswith("/bin/transom"), argv
    env = dict(e.split("=", 1) for e in unit.get("Environment", []))
    # systemd specifiers and variables: %H the host name, $VAR from the environment files (none here)
    return [a.replace("%H", "node0") for a in argv[1:] if not a.startswith("$") or a[1:] in env]


def test_systemd_has_a_unit_for_every_long_running_service(compose):
    parser = build_parser()
    long_running = {s["command"][0] for s in _transom_services(compose).values()}
    units = _units()
    commands = {}
    for name, unit in units.items():
        args = _exec_args(unit)
        try:
            parser.parse_args(args)
        except SystemExit:
            pytest.fail(f"deploy/systemd/{name}: `transom {' '.join(args)}` does not parse")
        commands[args[0]] = name
        assert unit["User"][-1] not in ("root", "0") and unit["NoNewPrivileges"][-1] == "yes", name
        assert unit["Restart"][-1] == "on-failure" and unit["KillSignal"][-1] == "SIGTERM", name
        assert "-/etc/transom/transom.env" in unit["EnvironmentFile"], f"{name} misses the shared settings"
    assert set(commands) == long_running, \
        f"systemd units for {sorted(commands)}, long-running services (compose) {sorted(long_running)}"
    ckpt = _exec_args(units[commands["ckpt-server"]])
    runtime = (DEPLOY / "kustomize/config.env").read_text().split("TRANSOM_CKPT_RUNTIME=")[1].split()[0]
    assert _arg(ckpt, "--runtime") == runtime


def test_systemd_units_run_at_the_services_default_cpu_priority():
    from transom import priority

    want = priority.parse(priority.DEFAULT)
    for name, unit in _units().items():
        assert unit.get("Nice") == [str(want.nice)], f"deploy/systemd/{name}: Nice= is not {want.nice}"
        assert unit.get("CPUSchedulingPolicy") == [want.policy], \
            f"deploy/systemd/{name}: CPUSchedulingPolicy= is not {want.policy} (TRANSOM_SERVICE_PRIORITY={priority.DEFAULT})"


def test_the_slurm_example_reaches_the_agents_and_rank_zero():
    """docs/controller.md's Slurm command: node addresses others can reach, the agents' intake port."""
    from transom.agents.config import AgentSettings
    from transom.controller.rankwrap import local_agent

    text = (ROOT / "docs/controller.md").read_text()
    example = text[text.index("transom controller --backend slurm"):]
    example = example[:example.index("```")]
    nodes = dict(n.split("=", 1) for n in re.findall(r"--node (\S+)", example))
    assert len(nodes) >= 2
    agent = _units()["transom-agent.service"]
    env = dict(e.split("=", 1) for e in agent["Environment"])
    port = env["TRANSOM_AGENT__INTAKE_PORT"]
    assert tomllib.loads((DEPLOY / "systemd/agent.toml").read_text())["agent"]["intake_port"] == int(port)
    intake_host = env.get("TRANSOM_AGENT__INTAKE_HOST", AgentSettings().intake_host)
    for node, addr in nodes.items():
        host, _, p = addr.rpartition(":")
        assert host not in ("127.0.0.1", "localhost", "0.0.0.0"), f"{node}: MASTER_ADDR would be {host}"
        assert p == port, f"{node}: intake port {p}, the agent unit listens on {port}"
        assert local_agent(addr) == f"{intake_host}:{port}"     # where a rank on that node sends its reports


def test_deploy_and_docs_name_only_files_that_exist():
    texts = [p for p in DEPLOY.rglob("*") if p.is_file() and p.suffix not in (".json",)]
    texts += [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    missing = []
    for path in texts:
        text = path.read_text(errors="replace")
        for ref in re.findall(r"(?<![\w/.-])((?:deploy|docs)/[\w./-]*\w)", text):
            if not (ROOT / ref).exists():
                missing.append(f"{path.relative_to(ROOT)} names {ref}")
        if re.search(r"\bhelm\b", text, re.I) and not list(DEPLOY.rglob("Chart.yaml")):
            missing.append(f"{path.relative_to(ROOT)} mentions a Helm chart; deploy/ has none")
        if path.parent == DEPLOY / "systemd":
            for ref in re.findall(r"install -m \d+ (\S+) /etc/", text):
                if not (path.parent / ref).exists():
                    missing.append(f"{path.relative_to(ROOT)} installs {ref}, which is not in deploy/systemd")
    assert not missing, "\n".join(missing)
