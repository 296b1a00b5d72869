"""The Kubernetes backend: one pod per rank, through the official ``kubernetes`` client.

- ``launch``: a headless Service ``JOB-gG`` and pods ``JOB-gG-rR`` pinned to the chosen nodes
  (``spec.nodeName``), labelled ``transom.io/job``, ``transom.io/generation``, ``transom.io/rank``;
  rank 0 is the rendezvous (``MASTER_ADDR`` = its DNS name through the Service). A pod that exists
  already (HTTP 409) is adopted, so a launch repeated after a controller restart creates nothing twice.
  Each pod requests ``gpus`` of ``nvidia.com/gpu``, mounts the shared checkpoint volume (the PVC
  ``ckpt_pvc``) at ``TRANSOM_CKPT_DIR`` and the node's TCE runtime directory (a host path the
  checkpoint daemon of deploy/kustomize shares) at ``TRANSOM_CKPT_RUNTIME``, and reaches the node's
  agent at ``status.hostIP`` (downward API) and ``agent_port``, unless ``agents`` names the node.
- ``stop``: deletes the generation's pods and its Service and waits until the pods are gone.
- ``cordon``: ``spec.unschedulable`` and a ``transom.io/evicted=<reason>:NoExecute`` taint, so
  nothing of anyone's lands there any more and what runs there is evicted (Transom's own
  DaemonSets tolerate that taint: deploy/kustomize/agent-daemonset.yaml).
- ``status``: from the pods' phase and their container's terminated exit code. The Service records
  the world size: a rank whose pod has vanished (deleted, evicted, its node gone) while the
  Service exists is reported exited with ``-SIGKILL``, so the controller sees a failed generation.
- ``health``: the node's ``Ready`` condition and whether it is cordoned.
- no collective test: it would need pods of its own (the pre-check rests on the agents' health).
- warm spares (in-job recovery): ``start_spare`` creates a waiting pod ``JOB-gG-sNODE-K`` pinned to
  the spare node, labelled ``transom.io/spare=NODE`` and no rank (``TRANSOM_SPARE=1``, no ``RANK``
  nor ``MASTER_*``: the user's script waits at the elastic API's join point). ``heal`` takes the
  failed rank's label off its pod and deletes it, relabels the spare pod ``transom.io/rank=R`` (so
  status and stop follow it; for rank 0 the Service selects it), and names the new group's
  rendezvous: rank 0's pod DNS name through the Service and a fresh port ``PORT + 1 + heals`` (gloo
  cannot re-form on the old one), recorded on the spare pod (annotation ``transom.io/master``), so
  a heal repeated after a controller restart returns it and changes nothing. The API server is the
  record: nothing is kept on the controller's disk.
"""

from __future__ import annotations

import re
import signal
import time
from typing import Any, Mapping, Sequence

from transom.log import get

from .backend import Backend, RankStatus, register_backend

__all__ = ["KubernetesBackend", "TAINT_KEY"]

log = get("controller.kubernetes")
TAINT_KEY = "transom.io/evicted"
PORT = 29500
WORLD_KEY = "transom.io/world-size"
SPARE_KEY = "transom.io/spare"
MASTER_KEY = "transom.io/master"
HEALS_KEY = "transom.io/heals"
GPU_RESOURCE = "nvidia.com/gpu"


def _label_value(text: str) -> str:
    """A Kubernetes label/taint value: at most 63 of [A-Za-z0-9._-], starting and ending alphanumeric."""
    value = re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:63].strip("-._")
    return value or "evicted"


class KubernetesBackend(Backend):
    name = "kubernetes"
    warm_spares = True

    def __init__(self, namespace: str = "default", image: str = "transom:latest", *, kubeconfig: str | None = None,
                 api_url: str | None = None, bootstrap: str | None = None, ckpt_dir: str | None = None,
                 agents: Mapping[str, str] | None = None, api_client: Any = None, gpus: int = 1,
                 ckpt_pvc: str | None = "transom-ckpt", ckpt_runtime: str = "/dev/shm/transom",
                 agent_port: int = 7100) -> None:
        from kubernetes import client, config

        if api_client is None:
            if api_url:
                conf = client.Configuration()
                conf.host = api_url
                api_client = client.ApiClient(conf)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config(config_file=kubeconfig)
                api_client = client.ApiClient()
        self.api = client.CoreV1Api(api_client)
        self.client = client
        self.namespace = namespace
        self.image = image
        self.bootstrap = bootstrap
        self.ckpt_dir = ckpt_dir or "/mnt/transom-ckpt"
        self.agents = dict(agents or {})
        if gpus < 0:
            raise ValueError(f"gpus: expected 0 or more GPUs per rank pod, got {gpus}")
        self.gpus = gpus
        self.ckpt_pvc = ckpt_pvc or None
        self.ckpt_runtime = ckpt_runtime
        self.agent_port = agent_port

    @staticmethod
    def _names(job: str, generation: int) -> tuple[str, str]:
        base = re.sub(r"[^a-z0-9-]+", "-", job.lower()).strip("-")[:40] or "job"
        return f"{base}-g{generation}", f"transom.io/job={_label_value(job)},transom.io/generation={generation}"

    def _conflict(self, exc: Exception) -> bool:
        return isinstance(exc, self.client.ApiException) and exc.status == 409

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> list[str]:
        out = []
        for node in self.api.list_node().items:
            if node.spec and node.spec.unschedulable:
                continue
            out.append(node.metadata.name)
        return out

    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        out = {}
        for name in nodes:
            try:
                node = self.api.read_node(name)
            except self.client.ApiException as exc:
                out[name] = f"node not readable from the API server ({exc.status} {exc.reason})"
                continue
            if node.spec and node.spec.unschedulable:
                out[name] = "cordoned (spec.unschedulable)"
                continue
            ready = [c for c in (node.status.conditions or []) if c.type == "Ready"] if node.status else []
            if not ready or ready[0].status != "True":
                why = ready[0].reason if ready else "no Ready condition"
                out[name] = f"not Ready ({why})"
        return out

    def cordon(self, node: str, reason: str) -> None:
        current = self.api.read_node(node)
        taints = [t.to_dict() if hasattr(t, "to_dict") else t for t in (current.spec.taints or [])]
        taints = [{k: v for k, v in t.items() if v is not None} for t in taints]
        if not any(t.get("key") == TAINT_KEY for t in taints):
            taints.append({"key": TAINT_KEY, "value": _label_value(reason), "effect": "NoExecute"})
        body = {"spec": {"unschedulable": True, "taints": taints},
                "metadata": {"annotations": {TAINT_KEY: reason[:1000]}}}
        self.api.patch_node(node, body)
        log.info("cordoned and tainted node %s: %s", node, reason)

    # ------------------------------------------------------------------ ranks
    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        user_env = dict(env or {})        # the image's working directory stays: the submitter's is not in it
        svc, selector = self._names(job, generation)
        labels = {"transom.io/job": _label_value(job), "transom.io/generation": str(generation)}
        try:
            self.api.create_namespaced_service(self.namespace, {
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": svc, "labels": labels, "annotations": {WORLD_KEY: str(len(nodes))}},
                "spec": {"clusterIP": "None", "selector": {**labels, "transom.io/rank": "0"},
                         "ports": [{"name": "rendezvous", "port": PORT}]}})
        except Exception as exc:
            if not self._conflict(exc):
                raise
        pods = []
        for rank, node in enumerate(nodes):
            body = self.pod_spec(job, generation, rank, nodes, command, resume_step, user_env)
            try:
                self.api.create_namespaced_pod(self.namespace, body)
            except Exception as exc:
                if not self._conflict(exc):
                    raise
                log.info("pod %s exists already: adopting it", body["metadata"]["name"])
            pods.append(body["metadata"]["name"])
        log.info("launched job %s generation %d as pods %s on %s", job, generation, ",".join(pods), ",".join(nodes))
        return {"pods": pods, "service": svc, "nodes": list(nodes), "resume_step": resume_step}

    def pod_spec(self, job: str, generation: int, rank: int, nodes: Sequence[str], command: Sequence[str],
                 resume_step: int | None, user_env: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The pod of ``rank`` (a V1Pod as a dict; tests validate it against the client's models).

        ``user_env``: the submitter's environment (``JobSpec.env``); Transom's own variables win."""
        svc, _ = self._names(job, generation)
        node = nodes[rank]
        env: list[dict[str, Any]] = [
            # the node's address, for the agent (hostNetwork DaemonSet) on this pod's node
            {"name": "TRANSOM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]
        plain = {**(user_env or {}), "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(len(nodes)),
                 "MASTER_ADDR": f"{svc}-r0.{svc}.{self.namespace}.svc", "MASTER_PORT": str(PORT),
                 "TRANSOM_JOB": job, "TRANSOM_NODE": node, "TRANSOM_GENERATION": str(generation),
                 "TRANSOM_CKPT_DIR": self.ckpt_dir, "TRANSOM_CKPT_RUNTIME": self.ckpt_runtime,
                 "TRANSOM_AGENT_ADDR": self.agents.get(node) or f"$(TRANSOM_HOST_IP):{self.agent_port}",
                 "PYTHONUNBUFFERED": "1"}
        if self.bootstrap:
            plain["TRANSOM_BOOTSTRAP"] = self.bootstrap
        if resume_step is not None:
            plain["TRANSOM_RESUME_STEP"] = str(resume_step)
        env += [{"name": k, "value": v} for k, v in plain.items()]
        mounts = [{"name": "ckpt-runtime", "mountPath": self.ckpt_runtime}]
        volumes: list[dict[str, Any]] = [
            {"name": "ckpt-runtime", "hostPath": {"path": self.ckpt_runtime, "type": "DirectoryOrCreate"}}]
        if self.ckpt_pvc:
            mounts.append({"name": "ckpt", "mountPath": self.ckpt_dir})
            volumes.append({"name": "ckpt", "persistentVolumeClaim": {"claimName": self.ckpt_pvc}})
        container: dict[str, Any] = {"name": "rank", "image": self.image, "command": list(command), "env": env,
                                     "volumeMounts": mounts,
                                     "ports": [{"containerPort": PORT}] if rank == 0 else []}
        if self.gpus:
            container["resources"] = {"limits": {GPU_RESOURCE: str(self.gpus)}}
        labels = {"transom.io/job": _label_value(job), "transom.io/generation": str(generation),
                  "transom.io/rank": str(rank)}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"{svc}-r{rank}", "labels": labels},
                "spec": {"nodeName": node, "restartPolicy": "Never", "hostname": f"{svc}-r{rank}",
                         "subdomain": svc, "containers": [container], "volumes": volumes,
                         # a GPU node's usual taint; never the eviction taint: evicted ranks must go
                         "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]}}

    # ------------------------------------------------------------------ in-job healing
    def start_spare(self, job: str, generation: int, node: str, command: tuple[str, ...], *,
                    workdir: str | None = None, env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        svc, _ = self._names(job, generation)
        world = self._world(job, generation)
        if world is None:
            raise RuntimeError(f"job {job} generation {generation} is not launched (no Service {svc})")
        node_label = _label_value(node)
        k = len([p for p in self._pods(job, generation) if (p.metadata.name or "").startswith(f"{svc}-s{node_label}-")])
        body = self.pod_spec(job, generation, 0, [node], command, None, env)
        name = f"{svc}-s{re.sub(r'[^a-z0-9-]+', '-', node.lower())[:12]}-{k}"
        c = body["spec"]["containers"][0]
        drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRANSOM_RESUME_STEP")
        c["env"] = [e for e in c["env"] if e["name"] not in drop] + [{"name": "TRANSOM_SPARE", "value": "1"}]
        c["ports"] = [{"containerPort": PORT}]                 # it may become rank 0
        labels = body["metadata"]["labels"]
        labels.pop("transom.io/rank")
        labels[SPARE_KEY] = node_label
        body["metadata"]["name"] = body["spec"]["hostname"] = name
        self.api.create_namespaced_pod(self.namespace, body)
        log.info("started a warm spare of job %s generation %d on %s (pod %s)", job, generation, node, name)
        return {"pod": name, "node": node}

    def heal(self, job: str, generation: int, rank: int, node: str, nodes: Sequence[str]) -> str:
        svc, _ = self._names(job, generation)
        pods = self._pods(job, generation)
        mine = [p for p in pods if (p.metadata.labels or {}).get("transom.io/rank") == str(rank)]
        done = [p for p in mine if (p.metadata.annotations or {}).get(MASTER_KEY)
                and (p.metadata.labels or {}).get(SPARE_KEY + "-took") == _label_value(node)]
        if done:
            return done[0].metadata.annotations[MASTER_KEY]      # carried out already (a controller restarted)
        spares = [p for p in pods if (p.metadata.labels or {}).get(SPARE_KEY) == _label_value(node)
                  and (p.status is None or p.status.phase in (None, "Pending", "Running"))]
        if not spares:
            raise RuntimeError(f"no waiting spare pod of job {job} generation {generation} on {node}")
        spare = spares[0]
        for old in mine:                                   # off the rank first, so status never sees two
            self.api.patch_namespaced_pod(old.metadata.name, self.namespace,
                                          {"metadata": {"labels": {"transom.io/rank": None}}})
            try:
                self.api.delete_namespaced_pod(old.metadata.name, self.namespace, grace_period_seconds=0)
            except self.client.ApiException as exc:
                if exc.status != 404:
                    raise
        service = self.api.read_namespaced_service(svc, self.namespace)
        heals = int((service.metadata.annotations or {}).get(HEALS_KEY) or 0) + 1
        self.api.patch_namespaced_service(svc, self.namespace, {"metadata": {"annotations": {HEALS_KEY: str(heals)}}})
        if rank == 0:
            host = spare.metadata.name
        else:
            zero = [p for p in pods if (p.metadata.labels or {}).get("transom.io/rank") == "0"]
            host = (zero[0].spec.hostname or zero[0].metadata.name) if zero else f"{svc}-r0"
        master = f"{host}.{svc}.{self.namespace}.svc:{PORT + heals}"
        self.api.patch_namespaced_pod(spare.metadata.name, self.namespace, {"metadata": {
            "labels": {"transom.io/rank": str(rank), SPARE_KEY: None, SPARE_KEY + "-took": _label_value(node)},
            "annotations": {MASTER_KEY: master}}})
        log.info("job %s generation %d: rank %d -> the warm spare pod %s on %s; new group at %s", job, generation,
                 rank, spare.metadata.name, node, master)
        return master

    def _pods(self, job: str, generation: int) -> list[Any]:
        _, selector = self._names(job, generation)
        return list(self.api.list_namespaced_pod(self.namespace, label_selector=selector).items)

    def _world(self, job: str, generation: int) -> int | None:
        """The generation's world size from its Service; None when it was never launched (or was stopped)."""
        svc, _ = self._names(job, generation)
        try:
            service = self.api.read_namespaced_service(svc, self.namespace)
        except self.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        value = (service.metadata.annotations or {}).get(WORLD_KEY)
        return int(value) if value and value.isdigit() else None

    def status(self, job: str, generation: int) -> list[RankStatus]:
        out = {}
        for pod in self._pods(job, generation):
            if "transom.io/rank" not in (pod.metadata.labels or {}):
                continue                       # a warm spare, or a rank's pod being replaced
            rank = int(pod.metadata.labels["transom.io/rank"])
            phase = pod.status.phase if pod.status else "Pending"
            if phase in ("Pending", "Running", None):
                out[rank] = RankStatus(rank, True, None)
                continue
            code = 0 if phase == "Succeeded" else 1
            for cs in (pod.status.container_statuses or []):
                if cs.state and cs.state.terminated is not None:
                    code = cs.state.terminated.exit_code
            out[rank] = RankStatus(rank, False, code)
        world = self._world(job, generation)
        vanished = [r for r in range(world or 0) if r not in out]
        if vanished:
            log.warning("job %s generation %d: pods of rank(s) %s vanished: reported killed", job, generation,
                        ",".join(map(str, vanished)))
            out.update({r: RankStatus(r, False, -int(signal.SIGKILL)) for r in vanished})
        return [out[r] for r in sorted(out)]

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        pods = self._pods(job, generation)
        for pod in pods:
            try:
                self.api.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=5)
            except self.client.ApiException as exc:
                if exc.status != 404:
                    raise
        deadline = time.monotonic() + timeout
        while pods and time.monotonic() < deadline:
            pods = self._pods(job, generation)
            time.sleep(0.2)
        svc, _ = self._names(job, generation)
        try:
            self.api.delete_namespaced_service(svc, self.namespace)
        except self.client.ApiException as exc:
            if exc.status != 404:
                raise
        if pods:
            log.warning("job %s generation %d: %d pod(s) still terminating after %.0fs", job, generation,
                        len(pods), timeout)
        else:
            log.info("stopped job %s generation %d (pods and service deleted)", job, generation)


register_backend("kubernetes", KubernetesBackend)
