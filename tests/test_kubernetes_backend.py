"""The Kubernetes backend's objects against the client's OpenAPI models, and its cleanup, on FakeKubeAPI.

No API server runs here: the pods the backend creates are validated against the ``kubernetes``
client's models (tests/k8s_models.py), and the fake API server records what was created and deleted.
"""

from __future__ import annotations

import signal

import pytest

from transom.controller.fakes.kube import FakeKubeAPI
from transom.controller.kubernetes import GPU_RESOURCE, TAINT_KEY, KubernetesBackend

from k8s_models import validate
from util import wait_until

NODES = ["node0", "node1", "node2"]


@pytest.fixture()
def kube(tmp_path):
    api = FakeKubeAPI(NODES, tmp_path / "pods").start()
    try:
        yield api
    finally:
        api.stop()


def test_rank_pods_validate_and_request_a_gpu_the_checkpoint_volume_and_the_nodes_agent(kube):
    backend = KubernetesBackend(api_url=kube.url, namespace="training", ckpt_dir="/mnt/ckpt", ckpt_pvc="lm-ckpt",
                                gpus=8, agents={"node1": "10.1.2.3:7100"}, bootstrap="kafka:9092")
    for rank in range(3):
        pod = backend.pod_spec("LM job", 2, rank, NODES, ("python", "train.py"), 40)
        model = validate(pod)
        (c,) = model.spec.containers
        assert c.resources.limits == {GPU_RESOURCE: "8"}
        assert model.spec.node_name == NODES[rank]
        assert not any(t.key == TAINT_KEY for t in model.spec.tolerations or [])   # evicted ranks must go
        env = {e.name: e for e in c.env}
        assert env["TRANSOM_HOST_IP"].value_from.field_ref.field_path == "status.hostIP"
        assert env["TRANSOM_AGENT_ADDR"].value == ("10.1.2.3:7100" if rank == 1 else "$(TRANSOM_HOST_IP):7100")
        names = [e.name for e in c.env]
        assert names.index("TRANSOM_HOST_IP") < names.index("TRANSOM_AGENT_ADDR")  # $(VAR) needs it defined first
        mounts = {m.mount_path: m.name for m in c.volume_mounts}
        volumes = {v.name: v for v in model.spec.volumes}
        assert volumes[mounts[env["TRANSOM_CKPT_DIR"].value]].persistent_volume_claim.claim_name == "lm-ckpt"
        assert volumes[mounts[env["TRANSOM_CKPT_RUNTIME"].value]].host_path.path == env["TRANSOM_CKPT_RUNTIME"].value
        assert env["MASTER_ADDR"].value == "lm-job-g2-r0.lm-job-g2.training.svc" and env["RANK"].value == str(rank)
    no_gpu = KubernetesBackend(api_url=kube.url, gpus=0, ckpt_pvc="").pod_spec("j", 0, 0, NODES, ("true",), None)
    model = validate(no_gpu)
    assert model.spec.containers[0].resources is None and [v.name for v in model.spec.volumes] == ["ckpt-runtime"]
    with pytest.raises(ValueError, match="gpus"):
        KubernetesBackend(api_url=kube.url, gpus=-1)


def test_vanished_pods_fail_the_generation_and_stop_deletes_every_object(kube):
    backend = KubernetesBackend(api_url=kube.url, gpus=1)
    backend.launch("job", 0, tuple(NODES), ("sleep", "300"), None)
    wait_until(lambda: [s.running for s in backend.status("job", 0)] == [True] * 3, 30, "the pods to run")
    assert set(kube.services) == {("default", "job-g0")}
    assert kube.delete_pods("job-g0-r1") == ["job-g0-r1"]            # deleted behind the controller's back
    assert [(s.rank, s.running, s.exit_code) for s in backend.status("job", 0)] == \
        [(0, True, None), (1, False, -int(signal.SIGKILL)), (2, True, None)]
    kube.delete_pods("job-g0")                                         # the whole generation vanishes
    assert [(s.running, s.exit_code) for s in backend.status("job", 0)] == [(False, -int(signal.SIGKILL))] * 3
    backend.stop("job", 0)
    assert not kube.pods and not kube.services                          # the Service too
    assert backend.status("job", 0) == []                               # stopped: nothing left to report
    assert ("DELETE", "/api/v1/namespaces/default/services/job-g0") in kube.requests


def test_warm_spares_wait_as_pods_and_take_a_failed_ranks_place(kube, tmp_path):
    backend = KubernetesBackend(api_url=kube.url, gpus=0, ckpt_pvc="")
    assert backend.warm_spares
    backend.launch("job", 0, ("node0", "node1"), ("sleep", "300"), None)
    spare = backend.start_spare("job", 0, "node2", ("sleep", "300"))
    wait_until(lambda: [s.running for s in backend.status("job", 0)] == [True, True], 30, "the rank pods to run")
    pod = kube.pods[("default", spare["pod"])]
    validate(pod)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["TRANSOM_SPARE"] == "1" and env["TRANSOM_NODE"] == "node2" and "RANK" not in env
    assert "MASTER_ADDR" not in env and pod["spec"]["nodeName"] == "node2"
    assert "transom.io/rank" not in pod["metadata"]["labels"]                      # not a rank: status skips it
    assert len(backend.status("job", 0)) == 2
    master = backend.heal("job", 0, 1, "node2", ("node0", "node2"))
    assert master == f"job-g0-r0.job-g0.default.svc:{29500 + 1}"                     # rank 0's pod, a fresh port
    assert backend.heal("job", 0, 1, "node2", ("node0", "node2")) == master          # repeated: the same, no change
    assert ("default", "job-g0-r1") not in kube.pods                                 # the failed rank's pod deleted
    assert kube.pods[("default", spare["pod"])]["metadata"]["labels"]["transom.io/rank"] == "1"
    assert [(s.rank, s.running) for s in backend.status("job", 0)] == [(0, True), (1, True)]
    # rank 0 replaced: the Service selects the spare pod, whose DNS name is the new rendezvous
    second = backend.start_spare("job", 0, "node1", ("sleep", "300"))
    assert backend.heal("job", 0, 0, "node1", ("node1", "node2")) == \
        f"{second['pod']}.job-g0.default.svc:{29500 + 2}"
    with pytest.raises(RuntimeError, match="no waiting spare pod"):
        backend.heal("job", 0, 1, "node0", ("node1", "node0"))
    backend.stop("job", 0)
    assert not kube.pods and not kube.services
