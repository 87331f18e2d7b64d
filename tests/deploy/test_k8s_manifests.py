"""The KubeRay manifests in deploy/k8s/: valid against the KubeRay CRD schemas (in
`<repo>/../shared/kuberay/`) and Kubernetes' own schemas (kubernetes-validate), and they keep the
promises docs/deploy.md makes (non-root, limits, /dev/shm in memory, GPUs, metrics port, the
Prometheus wiring). No API server runs here: schema validation is what `kubectl apply
--validate=strict` would do first."""
from __future__ import annotations

import copy
import json
import functools
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUBERAY = REPO.parent / "shared" / "kuberay"
K8S_VERSION = "1.33.0"  # the oldest Kubernetes release KubeRay's current operator supports well
OPERATOR_NAMESPACE = "kuberay-system"  # where docs/deploy.md installs the KubeRay operator's chart
MONITORING_NAMESPACE = "monitoring"  # and kube-prometheus-stack


def load(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((K8S / name).read_text()) if doc]


def the(name: str) -> dict:
    (doc,) = load(name)
    return doc


def _to_json_schema(node):
    """OpenAPI v3 (Kubernetes structural schema) -> JSON Schema, strict about unknown fields the
    way `kubectl --validate=strict` is: an object that lists its properties and does not preserve
    unknown fields allows no others."""
    if isinstance(node, list):
        return [_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(crd_file: str, version: str = "v1") -> jsonschema.Draft7Validator:
    path = KUBERAY / crd_file
    if not path.is_file():
        pytest.skip(f"KubeRay CRD {path} is absent (expected the shared/ folder beside the repo)")
    return _crd_validator(path, version)


@functools.lru_cache(maxsize=None)
def _crd_validator(path: Path, version: str) -> jsonschema.Draft7Validator:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 40k lines
    (spec,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _to_json_schema(spec["schema"]["openAPIV3Schema"])
    # apiVersion/kind/metadata are the API server's; only the spec is the CRD's to judge.
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict, crd_file: str) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in crd_validator(crd_file).iter_errors(doc)]


def pod_templates(cluster_spec: dict) -> dict[str, dict]:
    groups = {"head": cluster_spec["headGroupSpec"]["template"]}
    groups.update({g["groupName"]: g["template"] for g in cluster_spec["workerGroupSpecs"]})
    return groups


# ------------------------------------------------------------------ schema validity


@pytest.mark.parametrize(("manifest", "crd"), [("raycluster.yaml", "ray.io_rayclusters.yaml"),
                                               ("rayjob.yaml", "ray.io_rayjobs.yaml")])
def test_kuberay_manifests_match_the_crd_schema(manifest, crd):
    doc = the(manifest)
    assert doc["apiVersion"] == "ray.io/v1"
    assert crd_errors(doc, crd) == []


@pytest.mark.parametrize(("path", "bad"), [
    (("spec", "headGroupSpec"), {"rayStartParms": {}}),  # misspelled KubeRay field
    (("spec", "workerGroupSpecs", 1, "template", "spec", "containers", 0), {"resource": {}}),  # pod spec field
    (("spec", "workerGroupSpecs", 0), {"replicas": "one"}),  # wrong type
    (("spec", "authOptions"), {"mode": "on"}),  # not one of KubeRay's auth modes (disabled, token)
])
def test_a_misspelled_or_mistyped_field_fails_the_crd_schema(path, bad):
    doc = copy.deepcopy(the("raycluster.yaml"))
    node = doc
    for part in path:
        node = node[part]
    node.update(bad)
    errors = crd_errors(doc, "ray.io_rayclusters.yaml")
    assert errors and any(next(iter(bad)) in e for e in errors), errors


def test_a_misspelled_field_fails_the_rayjob_schema():
    doc = copy.deepcopy(the("rayjob.yaml"))
    doc["spec"]["entrypoint_"] = doc["spec"].pop("entrypoint")
    assert any("entrypoint_" in e for e in crd_errors(doc, "ray.io_rayjobs.yaml"))


def test_pod_templates_are_valid_kubernetes_pod_templates():
    """The pods inside the Ray CRDs, checked again by Kubernetes' own PodTemplate schema."""
    job = the("rayjob.yaml")
    templates = dict(pod_templates(the("raycluster.yaml")["spec"]), submitter=job["spec"]["submitterPodTemplate"])
    for group, template in templates.items():
        doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": template}
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("manifest", ["storage.yaml", "etarl-config.yaml", "networkpolicy.yaml"])
def test_builtin_kinds_are_valid(manifest):
    for doc in load(manifest):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_rejects_a_misspelled_builtin_field():
    doc = copy.deepcopy(load("storage.yaml")[0])
    doc["spec"]["acessModes"] = doc["spec"].pop("accessModes")
    with pytest.raises(kubernetes_validate.ValidationError, match="acessModes"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ------------------------------------------------------------------ what the manifests promise


def test_rayjob_runs_the_same_cluster_as_raycluster():
    assert the("rayjob.yaml")["spec"]["rayClusterSpec"] == the("raycluster.yaml")["spec"]


def test_every_pod_is_non_root_and_limited():
    job = the("rayjob.yaml")
    templates = dict(pod_templates(the("raycluster.yaml")["spec"]), submitter=job["spec"]["submitterPodTemplate"])
    for group, template in templates.items():
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, group
        assert pod["securityContext"]["runAsUser"] != 0, group
        for container in pod["containers"]:
            sec = container["securityContext"]
            assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"], group
            res = container["resources"]
            for kind in ("cpu", "memory"):
                assert kind in res["requests"] and kind in res["limits"], (group, kind)


def _bytes(quantity) -> int:
    """A Kubernetes memory quantity (4Gi, 512Mi, 1000000) in bytes."""
    text = str(quantity)
    for suffix, scale in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40)):
        if text.endswith(suffix):
            return int(float(text[:-2]) * scale)
    return int(text)


def test_ray_pods_get_a_memory_backed_dev_shm_that_holds_the_object_store():
    """Ray's object store lives in /dev/shm: each group sets its size (Ray's default, 30% of the pod's
    memory, is more than the volume) and the volume holds at least that much, within the pod's memory."""
    spec = the("raycluster.yaml")["spec"]
    groups = {"head": spec["headGroupSpec"], **{g["groupName"]: g for g in spec["workerGroupSpecs"]}}
    for group, template in pod_templates(spec).items():
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        shm = volumes[mount["name"]]["emptyDir"]
        assert shm["medium"] == "Memory", group
        store = int(groups[group]["rayStartParams"]["object-store-memory"])
        assert store <= _bytes(shm["sizeLimit"]) < _bytes(pod["containers"][0]["resources"]["limits"]["memory"]), group
    (gpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu-workers"]
    assert int(gpu["rayStartParams"]["object-store-memory"]) >= 2 * 7e9 * 2  # two 7B versions in bfloat16


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_the_fast_interconnect_settings_are_documented_on_the_gpu_group(manifest):
    """IPC_LOCK and an RDMA resource are what NCCL over InfiniBand/RoCE needs; clusters name the RDMA
    device differently, so they are comments: the pods as shipped keep every capability dropped."""
    text = (K8S / manifest).read_text()
    gpu_part = text[text.index("groupName: gpu-workers"):]
    assert "IPC_LOCK" in gpu_part and "rdma/" in gpu_part and "NCCL_IB_HCA" in gpu_part
    for template in pod_templates(_cluster_specs()[manifest]).values():
        assert "add" not in template["spec"]["containers"][0]["securityContext"]["capabilities"]


def test_every_pod_writes_runs_to_the_shared_volume_by_default():
    """ETARL_RUN_ROOT (a run without run.run_dir goes there) is the path where every pod mounts the
    ReadWriteMany etarl-runs volume, and the shipped run's folder is under it."""
    _, config = _run_config()
    for group, template in pod_templates(the("raycluster.yaml")["spec"]).items():
        pod = template["spec"]
        (container,) = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
        mounts = {m["mountPath"]: claims.get(m["name"]) for m in container["volumeMounts"]}
        assert mounts.get(env["ETARL_RUN_ROOT"]) == "etarl-runs", group
    assert config["run"]["run_dir"].startswith(env["ETARL_RUN_ROOT"] + "/")
    (runs,) = [d for d in load("storage.yaml") if d["metadata"]["name"] == "etarl-runs"]
    assert runs["spec"]["accessModes"] == ["ReadWriteMany"]


def test_gpu_group_requests_gpus_and_tells_ray():
    spec = the("raycluster.yaml")["spec"]
    (gpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu-workers"]
    (container,) = gpu["template"]["spec"]["containers"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus and int(gpus) >= 1
    assert gpu["rayStartParams"]["num-gpus"] == gpus
    (cpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "cpu-workers"]
    assert "nvidia.com/gpu" not in cpu["template"]["spec"]["containers"][0]["resources"]["limits"]


def _run_config() -> dict:
    (cm,) = [d for d in load("etarl-config.yaml") if d["kind"] == "ConfigMap"]
    return cm, yaml.safe_load(cm["data"]["etarl.yaml"])


def test_the_metrics_port_is_wired_from_config_to_pod_to_podmonitor():
    _, config = _run_config()
    head = the("raycluster.yaml")["spec"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    assert ports["etarl-metrics"] == config["metrics"]["port"]
    assert config["metrics"]["host"] == "0.0.0.0"  # in the pod network; loopback would hide it
    assert ports["metrics"] == int(the("raycluster.yaml")["spec"]["headGroupSpec"]["rayStartParams"]["metrics-export-port"])

    (monitor,) = [d for d in load("monitoring.yaml") if d["kind"] == "PodMonitor"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= head["metadata"]["labels"].items()
    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert set(endpoints) <= set(ports)
    jobs = {e["relabelings"][0]["replacement"] for e in endpoints.values()}
    local = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert jobs <= {c["job_name"] for c in local["scrape_configs"]}  # same job labels as the local set-up


def test_the_configmap_is_mounted_where_the_entrypoint_reads_it():
    cm, _ = _run_config()
    job = the("rayjob.yaml")["spec"]
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head["volumes"] if v.get("configMap", {}).get("name") == cm["metadata"]["name"]]
    (mount,) = [m for m in head["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    assert f"--config {mount['mountPath']}/etarl.yaml" in job["entrypoint"]
    assert "ray.address=auto" in job["entrypoint"]


def test_the_real_model_config_is_a_valid_etarl_config():
    from services.config import build_config

    _, tree = _run_config()
    config = build_config(tree, source="deploy/k8s/etarl-config.yaml")
    assert config.ray.address == "auto"
    # float32 master weights and AdamW (an lr 1e-6 update is below bfloat16's rounding), bfloat16 compute
    assert (config.learner.dtype, config.learner.mixed_precision, config.learner.gradient_checkpointing) == (
        "float32", "bfloat16", True)
    assert config.run.model.startswith("/models/")
    assert config.run.run_dir.startswith("/runs/")


def test_prometheusrule_is_rules_yml():
    import importlib.util

    path = REPO / "deploy" / "prometheus" / "render_prometheusrule.py"
    spec = importlib.util.spec_from_file_location("render_prometheusrule", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (K8S / "prometheusrule.yaml").read_text() == module.render(), \
        "deploy/k8s/prometheusrule.yaml is stale: regenerate it from rules.yml (see its header)"


def test_the_network_policy_admits_the_run_the_operator_and_prometheus_only():
    """Ray's servers listen on the pod address in a cluster; the NetworkPolicy decides who reaches them."""
    policy = the("networkpolicy.yaml")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    job = the("rayjob.yaml")
    templates = dict(pod_templates(the("raycluster.yaml")["spec"]), submitter=job["spec"]["submitterPodTemplate"])
    for group, template in templates.items():  # every pod of the run is guarded, and is a peer
        assert policy["podSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items(), group
    rules = {}
    for rule in policy["ingress"]:
        (peer,) = rule["from"]
        rules[peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]] = rule
    assert set(rules) == {"etarl", "kuberay-operator", "prometheus"}
    # The run's own pods: every port (Ray's worker ports are random), from this namespace only.
    assert "ports" not in rules["etarl"] and "namespaceSelector" not in rules["etarl"]["from"][0]
    head = the("raycluster.yaml")["spec"]["headGroupSpec"]["template"]
    ports = {p["name"]: p["containerPort"] for p in head["spec"]["containers"][0]["ports"]}
    allowed = {name: {p["port"] for p in rule.get("ports", [])} for name, rule in rules.items()}
    assert allowed["kuberay-operator"] == {ports["dashboard"]}
    (monitor,) = [d for d in load("monitoring.yaml") if d["kind"] == "PodMonitor"]
    assert allowed["prometheus"] == {ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"]}


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_the_run_config_fills_the_gpus_the_raycluster_declares(manifest, tmp_path, capsys):
    """`etarl plan` on the shipped run config against the worker groups' declared GPUs and CPUs:
    it fits, and every declared GPU is used (no GPU idles, no actor shares one)."""
    from services.cli import main

    _, config = _run_config()
    run_yaml = K8S / "etarl-config.yaml"  # the ConfigMap itself: its one .yaml entry is the config
    assert main(["plan", "--config", str(run_yaml), "--raycluster", str(K8S / manifest)]) == 0, capsys.readouterr().err
    report = json.loads(capsys.readouterr().out)
    spec = the("raycluster.yaml")["spec"]
    declared = sum(int(g["rayStartParams"].get("num-gpus", 0)) * g["replicas"] for g in spec["workerGroupSpecs"])
    assert report["fits"] and report["total"]["GPU"] == report["cluster"]["total"]["GPU"] == declared
    roles = report["roles"]
    assert roles["rollout"]["per_actor"]["GPU"] == 1 and roles["learner"]["per_actor"]["GPU"] == 1
    assert "evaluator" not in roles  # the samplers evaluate between their requests
    assert report["layout"]["name"] == "separate"  # the counts the config names fit a GPU each

    # one sampler more does not fit, and `etarl plan` says so
    assert main(["plan", "--config", str(run_yaml), "--raycluster", str(K8S / manifest),
                 f"rollout.num_workers={config['rollout']['num_workers'] + 1}"]) == 2
    assert "rollout.num_workers" in capsys.readouterr().err
    # a manifest that carries no config (the cluster's own) is named as such
    assert main(["plan", "--config", str(K8S / manifest)]) == 2
    assert f"is a Kubernetes {the(manifest)['kind']} manifest, not an etarl config" in capsys.readouterr().err


# ------------------------------------------------------------------ who gets in (issue 30)


def _cluster_specs() -> dict[str, dict]:
    return {"raycluster.yaml": the("raycluster.yaml")["spec"], "rayjob.yaml": the("rayjob.yaml")["spec"]["rayClusterSpec"]}


@pytest.mark.parametrize("manifest", ["raycluster.yaml", "rayjob.yaml"])
def test_ray_token_authentication_is_on_and_nothing_turns_it_off(manifest):
    """KubeRay's authOptions: the operator makes the token's Secret and sets RAY_AUTH_MODE=token and
    RAY_AUTH_TOKEN in every Ray container and the submitter; the dashboard, on the pod address for
    the operator, then answers nobody without the token (its Jobs API runs code)."""
    spec = _cluster_specs()[manifest]
    assert spec.get("authOptions") == {"mode": "token"}  # enableK8sTokenAuth: not supported for RayJobs
    assert spec["headGroupSpec"]["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # hence the token
    templates = pod_templates(spec)
    if manifest == "rayjob.yaml":
        job = the(manifest)["spec"]
        templates["submitter"] = job["submitterPodTemplate"]
        assert not {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} & set(yaml.safe_load(job["runtimeEnvYAML"])["env_vars"])
    for group, template in templates.items():  # no container overrides the mode or holds a token
        for container in template["spec"]["containers"]:
            names = {e["name"] for e in container.get("env", [])}
            assert not names & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}, (group, names)


def _selects(selector: dict, labels: dict) -> bool:
    """A Kubernetes label selector of matchLabels only ({} selects everything)."""
    assert set(selector) <= {"matchLabels"}, f"this check reads matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= labels.items()


def _admits(policy: dict, policy_namespace: str, namespace: str, pod_labels: dict, port: int) -> bool:
    """Whether the NetworkPolicy admits a connection to `port` from a pod with `pod_labels` in
    `namespace` (labelled, as Kubernetes does, kubernetes.io/metadata.name=<namespace>)."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    for rule in policy["ingress"]:
        if rule.get("ports") and port not in {p["port"] for p in rule["ports"]}:
            continue
        for peer in rule.get("from", [{}]):
            in_namespace = (_selects(peer["namespaceSelector"], ns_labels) if "namespaceSelector" in peer
                            else namespace == policy_namespace)
            if in_namespace and _selects(peer.get("podSelector", {}), pod_labels):
                return True
    return False


def test_a_pod_that_copies_the_operators_or_prometheus_label_elsewhere_is_not_admitted():
    """The operator's and Prometheus's rules need their namespace AND their label (one `from`
    element): a label anyone who may create a pod can set, the namespace name Kubernetes sets."""
    policy = the("networkpolicy.yaml")["spec"]
    run_ns = "etarl-runs"
    operator = {"app.kubernetes.io/name": "kuberay-operator"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert _admits(policy, run_ns, OPERATOR_NAMESPACE, operator, 8265)
    assert _admits(policy, run_ns, MONITORING_NAMESPACE, prometheus, 9400)
    assert _admits(policy, run_ns, MONITORING_NAMESPACE, prometheus, 8080)
    for namespace in ("default", run_ns, "someone-else"):  # the same labels anywhere else: refused
        assert not _admits(policy, run_ns, namespace, operator, 8265), namespace
        assert not _admits(policy, run_ns, namespace, prometheus, 9400), namespace
    assert not _admits(policy, run_ns, OPERATOR_NAMESPACE, {"app": "other"}, 8265)  # the namespace alone: no
    assert not _admits(policy, run_ns, MONITORING_NAMESPACE, {"app.kubernetes.io/name": "grafana"}, 9400)
    assert not _admits(policy, run_ns, OPERATOR_NAMESPACE, operator, 6379)  # the operator: the dashboard only
    assert not _admits(policy, run_ns, MONITORING_NAMESPACE, prometheus, 8265)  # Prometheus: metrics only
    etarl = {"app.kubernetes.io/name": "etarl"}
    assert _admits(policy, run_ns, run_ns, etarl, 6379) and not _admits(policy, run_ns, "default", etarl, 6379)
    for rule in policy["ingress"]:  # the namespace is named exactly, never by a label one could copy
        for peer in rule["from"]:
            if "namespaceSelector" in peer:
                assert set(peer["namespaceSelector"]["matchLabels"]) == {"kubernetes.io/metadata.name"}, peer
