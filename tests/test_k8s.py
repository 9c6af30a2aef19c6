"""The KubeRay manifests (k8s/raycluster.yaml, k8s/rayjob.yaml) and their image (k8s/Dockerfile),
checked without a Kubernetes cluster: they parse as KubeRay's kinds, the job's cluster is the
cluster's, the job's command is one the CLI itself accepts, the pods offer Ray what their limits
give them, the image installs what cluster.yaml's setup installs, no credential is written in
them, every pod is least-privilege and k8s/networkpolicy.yaml keeps Ray's ports to its pods."""

from __future__ import annotations

import re
import shlex

import yaml

from conftest import ROOT
from raytrain_lm.cli.train import parse_train_args

K8S = ROOT / "k8s"


def manifest(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


def containers(spec: dict) -> list[dict]:
    """Every container of a RayCluster spec: the head's, then each worker group's."""
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def pyproject_pin(package: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(rf'"{re.escape(package)}(?:\[[^\]]*\])?==([^"]+)"', text).group(1)


def test_the_manifests_are_kuberays_kinds_and_the_job_runs_the_same_cluster():
    cluster, job = manifest("raycluster.yaml"), manifest("rayjob.yaml")
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["spec"]["rayClusterSpec"] == cluster["spec"]
    assert job["spec"]["shutdownAfterJobFinishes"] is True  # the cluster goes with the job
    assert cluster["spec"]["rayVersion"] == pyproject_pin("ray")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True


def test_the_jobs_command_is_one_the_cli_accepts():
    """`python .../cli.py train FLAGS`: the flags parsed by `train` itself (an unknown or
    misspelt flag raises here), with GPU workers."""
    args = shlex.split(manifest("rayjob.yaml")["spec"]["entrypoint"])
    assert args[0] == "python" and args[1].endswith("/cli.py") and args[2] == "train"
    parsed = parse_train_args(args[2:])
    assert parsed["use_gpu"] is True and parsed["workers"] == 4
    image_dir = manifest("raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["workingDir"]
    assert args[1] == f"{image_dir}/cli.py"


def test_the_head_trains_nothing_and_each_gpu_pod_offers_ray_its_limits():
    spec = manifest("raycluster.yaml")["spec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    for group in spec["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["maxReplicas"]
        (pod,) = group["template"]["spec"]["containers"]
        limits, offered = pod["resources"]["limits"], group["rayStartParams"]
        assert int(limits["nvidia.com/gpu"]) == int(offered["num-gpus"]) >= 1
        assert int(limits["cpu"]) == int(offered["num-cpus"])
        assert pod["resources"]["requests"] == limits  # guaranteed: never evicted mid-run


def test_no_credential_is_written_in_the_manifests():
    """Every variable that holds a credential (the Ray token, the trackers' keys) comes from a
    Secret, and no Secret is defined here; every pod that talks to the cluster has the token."""
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = manifest(name)
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        pods = containers(spec)
        if doc["kind"] == "RayJob":
            pods += doc["spec"]["submitterPodTemplate"]["spec"]["containers"]
        for pod in pods:
            env = {e["name"]: e for e in pod["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token"
            for var in env.values():
                if re.search(r"TOKEN|KEY|PASSWORD|SECRET", var["name"]):
                    assert "value" not in var and "secretKeyRef" in var["valueFrom"], (name, var)
        assert "kind: Secret" not in (K8S / name).read_text()


def test_the_image_installs_what_cluster_yamls_setup_installs():
    """The same pinned requirements and extras, on Ray's image of the pinned Ray and Python."""
    docker = (K8S / "Dockerfile").read_text()
    setup = " ".join(yaml.safe_load((ROOT / "cluster.yaml").read_text())["setup_commands"])
    vm_install = re.search(r"uv pip install --python \S+ (-r requirements.txt [^\s]+)", setup).group(1)
    assert f"pip install --no-cache-dir {vm_install}\n" in docker
    assert f"FROM rayproject/ray:{pyproject_pin('ray')}-py311-gpu" in docker
    image = {c["image"] for c in containers(manifest("raycluster.yaml")["spec"])}
    assert len(image) == 1


def pod_specs(doc: dict) -> dict[str, dict]:
    """Every pod template's spec of a manifest by its role: head, each worker group, a RayJob's
    submitter."""
    spec = doc["spec"].get("rayClusterSpec", doc["spec"])
    pods = {"head": spec["headGroupSpec"]["template"]}
    pods.update({f"worker {g['groupName']}": g["template"] for g in spec["workerGroupSpecs"]})
    if doc["kind"] == "RayJob":
        pods["submitter"] = doc["spec"]["submitterPodTemplate"]
    return pods


def test_every_pod_runs_least_privileged():
    """Not as root, no privilege escalation, no Linux capability, the runtime's seccomp filter: for
    every container (KubeRay's autoscaler beside the head too); the service-account token only
    where something calls the Kubernetes API (the head, whose autoscaler adds and removes pods)."""
    for name in ("raycluster.yaml", "rayjob.yaml"):
        doc = manifest(name)
        spec = doc["spec"].get("rayClusterSpec", doc["spec"])
        pods = pod_specs(doc)
        assert set(pods) >= {"head", "worker gpu"}
        for role, template in pods.items():
            pod = template["spec"]
            context = pod["securityContext"]
            assert context["runAsNonRoot"] is True and context["runAsUser"] > 0, (name, role)
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, (name, role)
            assert pod["automountServiceAccountToken"] is (role == "head"), (name, role)
            for container in pod["containers"]:
                own = container["securityContext"]
                assert own["allowPrivilegeEscalation"] is False and own.get("privileged") is not True
                assert own["capabilities"]["drop"] == ["ALL"] and not own["capabilities"].get("add")
                assert own.get("runAsUser", 1) > 0 and own.get("runAsNonRoot", True) is True
        autoscaler = spec["autoscalerOptions"]["securityContext"]
        assert autoscaler["allowPrivilegeEscalation"] is False and autoscaler["capabilities"]["drop"] == ["ALL"]


def test_rays_ports_answer_only_the_ray_pods():
    """k8s/networkpolicy.yaml selects every pod of both manifests (by the label each template
    carries) and lets in only those pods, on any port, and KubeRay's operator on the dashboard's."""
    policy = manifest("networkpolicy.yaml")
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for name in ("raycluster.yaml", "rayjob.yaml"):
        for role, template in pod_specs(manifest(name)).items():
            labels = template["metadata"]["labels"]
            assert selected.items() <= labels.items(), (name, role)
    ours, operator = policy["spec"]["ingress"]
    assert ours == {"from": [{"podSelector": {"matchLabels": selected}}]}  # no ports: all, only these pods
    [source] = operator["from"]
    assert set(source) == {"namespaceSelector", "podSelector"}  # both: that operator's pods only
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    head = manifest("raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "dashboard", "containerPort": 8265} in head["ports"]
