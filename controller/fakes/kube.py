"""FakeKubeAPI: a Kubernetes API server for tests, speaking the REST paths the official client calls.

Served (JSON, ``apiVersion: v1``)::

    GET    /api/v1/nodes                              NodeList
    GET    /api/v1/nodes/{name}                       Node
    PATCH  /api/v1/nodes/{name}                       merge patch (dicts merge, lists replace)
    POST   /api/v1/namespaces/{ns}/services           201, or 409 AlreadyExists
    GET    /api/v1/namespaces/{ns}/services/{name}    Service
    DELETE /api/v1/namespaces/{ns}/services/{name}
    POST   /api/v1/namespaces/{ns}/pods               201, or 409 AlreadyExists
    GET    /api/v1/namespaces/{ns}/pods?labelSelector=k=v,k2=v2
    GET    /api/v1/namespaces/{ns}/pods/{name}
    DELETE /api/v1/namespaces/{ns}/pods/{name}        the kubelet stops the process, the pod goes

The fake kubelet runs each pod's first container ``command`` as a local process with the
container's ``env`` (``valueFrom.fieldRef`` of ``spec.nodeName``/``status.hostIP`` and ``$(VAR)``
references resolved as the kubelet does). The cluster network is mapped onto 127.0.0.1:
``MASTER_ADDR`` becomes 127.0.0.1, ``MASTER_PORT`` a free local port per Service, ``status.hostIP``
127.0.0.1. Volumes are "mounted" by path: an environment value under a volume mount's path is
rewritten to a directory of the fake (``LOG_DIR/volumes/pvc-CLAIM`` for a PersistentVolumeClaim,
``LOG_DIR/volumes/NODE/PATH`` for a hostPath, so two nodes' host paths differ).
``delete_pods(selector)`` deletes pods as an outside actor would (a node drained by an operator). A pod bound to a node that has a
``NoExecute`` taint it does not tolerate is failed at once (``reason: Taint``), as the real
kubelet evicts it. ``created`` counts pod creations by name (409s excluded) and ``history`` keeps
every pod as created, so tests can count launches after the pods are gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from transom.broker import free_port

__all__ = ["FakeKubeAPI"]


def _merge(base: dict, patch: dict) -> dict:
    for k, v in patch.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        elif v is None:
            base.pop(k, None)
        else:
            base[k] = v
    return base


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "code": code}


class FakeKubeAPI:
    def __init__(self, nodes: list[str], log_dir: str | os.PathLike) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self.nodes = {n: {"apiVersion": "v1", "kind": "Node", "metadata": {"name": n, "labels": {}, "annotations": {}},
                          "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True",
                                                                 "reason": "KubeletReady"}]}} for n in nodes}
        self.pods: dict[tuple[str, str], dict] = {}
        self.procs: dict[tuple[str, str], subprocess.Popen] = {}
        self.services: dict[tuple[str, str], dict] = {}
        self.ports: dict[tuple[str, str], int] = {}
        self.created: dict[str, int] = {}
        self.history: list[dict] = []          # every pod as created, deleted ones included
        self.requests: list[tuple[str, str]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "FakeKubeAPI":
        t = threading.Thread(target=self.server.serve_forever, daemon=True, name="fake-kube-api")
        t.start()
        w = threading.Thread(target=self._kubelet, daemon=True, name="fake-kubelet")
        w.start()
        self._threads = [t, w]
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for key in list(self.procs):
                self._kill(key)

    def __enter__(self) -> "FakeKubeAPI":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the fake kubelet
    def _kubelet(self) -> None:
        while True:
            time.sleep(0.2)
            with self.lock:
                for key, proc in list(self.procs.items()):
                    code = proc.poll()
                    if code is None or key not in self.pods:
                        continue
                    pod = self.pods[key]
                    pod["status"] = {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
                        {"name": "rank", "ready": False, "restartCount": 0, "image": "", "imageID": "",
                         "state": {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}}}]}
                    del self.procs[key]

    def _run(self, ns: str, pod: dict) -> None:
        node = self.nodes.get(pod["spec"].get("nodeName", ""))
        if node is None:
            pod["status"] = {"phase": "Pending", "reason": "NodeNotFound"}
            return
        tolerated = {t.get("key") for t in pod["spec"].get("tolerations") or []}
        if any(t.get("effect") == "NoExecute" and t.get("key") not in tolerated for t in node["spec"].get("taints") or []):
            pod["status"] = {"phase": "Failed", "reason": "Taint", "message": "node has a NoExecute taint"}
            return
        c = pod["spec"]["containers"][0]
        env = dict(os.environ)
        fields = {"spec.nodeName": pod["spec"]["nodeName"], "status.hostIP": "127.0.0.1",
                  "metadata.name": pod["metadata"]["name"]}
        for e in c.get("env") or []:
            if "valueFrom" in e:
                env[e["name"]] = fields.get(e["valueFrom"].get("fieldRef", {}).get("fieldPath", ""), "")
            else:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e.get("value", ""))
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        for m in c.get("volumeMounts") or []:
            v = volumes[m["name"]]
            local = self.log_dir / "volumes" / (f"pvc-{v['persistentVolumeClaim']['claimName']}"
                                                if "persistentVolumeClaim" in v else
                                                f"{pod['spec']['nodeName']}{v.get('hostPath', {}).get('path', '/' + m['name'])}")
            local.mkdir(parents=True, exist_ok=True)
            for k, value in env.items():
                if k.startswith("TRANSOM_") and (value == m["mountPath"] or value.startswith(m["mountPath"] + "/")):
                    env[k] = str(local) + value[len(m["mountPath"]):]
        svc = pod["spec"].get("subdomain")
        if svc and "TRANSOM_SPARE" not in env:      # a warm spare learns its group when it takes a rank
            env["MASTER_ADDR"] = "127.0.0.1"
            env["MASTER_PORT"] = str(self.ports.setdefault((ns, svc), free_port()))
        name = pod["metadata"]["name"]
        out = open(self.log_dir / f"{name}.log", "ab")
        self.procs[(ns, name)] = subprocess.Popen(list(c["command"]) + list(c.get("args") or []), env=env,
                                                  stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                  start_new_session=True)
        pod["status"] = {"phase": "Running", "hostIP": "127.0.0.1", "containerStatuses": [
            {"name": "rank", "ready": True, "restartCount": 0, "image": "", "imageID": "", "state": {"running": {}}}]}

    def _kill(self, key: tuple[str, str]) -> None:
        proc = self.procs.pop(key, None)
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    # ------------------------------------------------------------------ REST
    def _handler(self):
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_a: Any) -> None:
                return

            def _send(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}")

            def _route(self, method: str) -> None:
                url = urllib.parse.urlparse(self.path)
                parts = [p for p in url.path.split("/") if p]
                query = urllib.parse.parse_qs(url.query)
                with api.lock:
                    api.requests.append((method, url.path))
                    code, body = api.handle(method, parts, query, self._body() if method in ("POST", "PATCH") else {})
                self._send(code, body)

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

            def do_PATCH(self) -> None:
                self._route("PATCH")

            def do_DELETE(self) -> None:
                self._route("DELETE")

        return Handler

    def handle(self, method: str, parts: list[str], query: dict, body: dict) -> tuple[int, dict]:
        if parts[:2] != ["api", "v1"]:
            return 404, _status(404, "NotFound", f"no such path /{'/'.join(parts)}")
        rest = parts[2:]
        if rest[:1] == ["nodes"]:
            if len(rest) == 1 and method == "GET":
                return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": list(self.nodes.values())}
            node = self.nodes.get(rest[1]) if len(rest) == 2 else None
            if node is None:
                return 404, _status(404, "NotFound", f'nodes "{rest[1:]}" not found')
            if method == "PATCH":
                _merge(node, body)
            return 200, node
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            ns, kind = rest[1], rest[2]
            if kind == "services" and method == "POST":
                name = body["metadata"]["name"]
                if (ns, name) in self.services:
                    return 409, _status(409, "AlreadyExists", f'services "{name}" already exists')
                body["metadata"]["namespace"] = ns
                self.services[(ns, name)] = body
                return 201, body
            if kind == "services" and len(rest) == 4 and method in ("GET", "DELETE", "PATCH"):
                svc = self.services.get((ns, rest[3]))
                if svc is None:
                    return 404, _status(404, "NotFound", f'services "{rest[3]}" not found')
                if method == "DELETE":
                    del self.services[(ns, rest[3])]
                elif method == "PATCH":
                    _merge(svc, body)
                return 200, svc
            if kind == "pods":
                return self._pods(method, ns, rest[3] if len(rest) > 3 else None, query, body)
        return 404, _status(404, "NotFound", f"no such path /{'/'.join(parts)}")

    def _pods(self, method: str, ns: str, name: str | None, query: dict, body: dict) -> tuple[int, dict]:
        if name is None and method == "POST":
            name = body["metadata"]["name"]
            if (ns, name) in self.pods:
                return 409, _status(409, "AlreadyExists", f'pods "{name}" already exists')
            body["metadata"].update(namespace=ns, uid=f"uid-{name}", creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ"))
            self.pods[(ns, name)] = body
            self.created[name] = self.created.get(name, 0) + 1
            self.history.append(json.loads(json.dumps(body)))
            self._run(ns, body)
            return 201, body
        if name is None and method == "GET":
            want = {}
            for sel in (query.get("labelSelector") or [""])[0].split(","):
                if "=" in sel:
                    k, v = sel.split("=", 1)
                    want[k] = v
            items = [p for (n, _), p in self.pods.items() if n == ns and
                     all(p["metadata"].get("labels", {}).get(k) == v for k, v in want.items())]
            return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
        pod = self.pods.get((ns, name or ""))
        if pod is None:
            return 404, _status(404, "NotFound", f'pods "{name}" not found')
        if method == "DELETE":
            self._kill((ns, name))
            del self.pods[(ns, name)]
        elif method == "PATCH":                 # a JSON merge patch (labels, annotations)
            _merge(pod, body)
        return 200, pod

    def delete_pods(self, prefix: str, ns: str = "default") -> list[str]:
        """Delete the pods whose name starts with ``prefix`` behind the controller's back (as an operator would)."""
        with self.lock:
            gone = [name for (n, name) in self.pods if n == ns and name.startswith(prefix)]
            for name in gone:
                self._kill((ns, name))
                del self.pods[(ns, name)]
        return gone


def main() -> int:
    """``python -m transom.controller.fakes.kube --nodes node0,node1 --log-dir D``: serve until killed."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m transom.controller.fakes.kube", description=__doc__.split("\n")[0])
    p.add_argument("--nodes", required=True, help="comma-separated node names")
    p.add_argument("--log-dir", default=".", help="where the pods' output goes")
    args = p.parse_args()
    api = FakeKubeAPI(args.nodes.split(","), args.log_dir).start()
    print(api.url, flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        api.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
