"""The Kubernetes manifests (deploy/k8s): every built-in object validated against the Kubernetes OpenAPI schemas of
``kubernetes-validate`` (strict: an unknown field fails), and the pieces checked against each other and against
the image (the gateway the only way in: Triton bound to the pod's loopback, the Service exposing the gateway's
port alone, probes on Triton's health endpoints from inside the pod, the non-root user of Dockerfile.triton, the
grace period against the supervisor's exit timeout, the HPA's metrics against the adapter's rules). That the
adapter's queries name metrics a live server exposes is checked in tests/live/test_hardening_live.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: The oldest and the newest Kubernetes release the manifests are validated against.
VERSIONS = ("1.29.0", "1.37.0")
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def _objects() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def _one(kind: str, name: str = "cosyvoice-triton") -> dict:
    found = [d for _, d in _objects() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def _container(name: str = "triton") -> dict:
    found = [c for c in _one("Deployment")["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name}: {len(found)} found"
    return found[0]


def _env(container: dict, name: str) -> str:
    return next(e["value"] for e in container["env"] if e["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_builtin_object_matches_the_kubernetes_schema(version):
    objects = _objects()
    kinds = {d["kind"] for _, d in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap",
            "PodDisruptionBudget", "ServiceMonitor"} <= kinds, kinds
    for name, doc in objects:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} is invalid for Kubernetes {version}: "
                        f"{exc.message} at {'/'.join(map(str, exc.path))}")


def test_the_schema_check_catches_a_mistake():
    bad = _one("Deployment")
    bad = yaml.safe_load(yaml.safe_dump(bad))
    gateway = next(c for c in bad["spec"]["template"]["spec"]["containers"] if c["name"] == "gateway")
    gateway["readinessProbe"]["httpGet"]["prot"] = 8080
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, VERSIONS[-1], strict=True)


def test_gpu_probes_and_ports(tmp_path):
    c = _container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert "ports" not in c  # Triton listens on the pod's loopback only
    # the kubelet cannot reach loopback: the probes run inside the container, on Triton's own health endpoints
    for probe, path in (("readinessProbe", "/v2/health/ready"), ("livenessProbe", "/v2/health/live")):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["python3", "-c"] and f"'http://127.0.0.1:8000{path}'" in command[2]
        assert c[probe]["timeoutSeconds"] > float(re.search(r"timeout=(\d+)", command[2]).group(1))
    # the startup probe waits for the supervisor's warm file, in the work dir container_start.sh gives it
    start = (ROOT / "export" / "container_start.sh").read_text()
    assert '--work-dir "$BUILD_DIR/triton"' in start
    build = next(e["value"] for e in c["env"] if e["name"] == "BUILD_DIR")
    assert c["startupProbe"]["exec"]["command"] == ["test", "-f", f"{build}/triton/warm"]
    from cosyvoice_triton.serving.launch.server import TritonServer
    from cosyvoice_triton.serving.launch.supervisor import Supervisor

    (tmp_path / "repo").mkdir()
    server = TritonServer(tmp_path / "repo", work_dir=tmp_path / "triton", model_control="explicit")
    assert Supervisor(server, warmup=None).warm_file == tmp_path / "triton" / "warm"
    # liveness must outlast a supervised restart of tritonserver (27 s measured, tests/live/test_hostile_server.py)
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 45


def test_service_exposes_only_the_gateway_and_selects_the_pods():
    svc, dep = _one("Service"), _one("Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(labels.get(k) == v for k, v in dep["spec"]["selector"]["matchLabels"].items())
    containers = dep["spec"]["template"]["spec"]["containers"]
    declared = {p["name"]: (c["name"], p["containerPort"]) for c in containers for p in c.get("ports", [])}
    assert declared == {"gateway": ("gateway", 8080), "gateway-grpc": ("gateway", 8081)}, declared
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http", 8080, "gateway"), ("grpc", 8081, "gateway-grpc")]
    assert not {8000, 8001, 8002} & {p["port"] for p in svc["spec"]["ports"]}
    page = (ROOT / "docs" / "operations" / "kubernetes.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `service.yaml`"))
    assert all(f"`{p['name']}` {p['port']}" in row for p in svc["spec"]["ports"]), row  # the page says what is exposed
    assert svc["spec"]["type"] == "ClusterIP"  # nothing leaves the cluster without an ingress in front


def test_triton_binds_loopback_and_the_gateway_reaches_it_there(tmp_path):
    triton, gateway = _container("triton"), _container("gateway")
    assert triton["image"] == gateway["image"]  # the image holds the gateway's entry point
    assert _env(triton, "TRITON_HOST") == "127.0.0.1"
    start = (ROOT / "export" / "container_start.sh").read_text()
    assert '--host "${TRITON_HOST:-127.0.0.1}"' in start  # the image binds loopback unless told otherwise
    assert re.search(r"--http-port 8000 --grpc-port 8001 --metrics-port 8002", start)
    from cosyvoice_triton.serving.launch.server import TritonServer, find_installation

    try:
        find_installation()
    except Exception as exc:  # no tritonserver here: its flags cannot be listed
        pytest.skip(f"no tritonserver: {exc}")
    (tmp_path / "repo").mkdir()
    cmd = TritonServer(tmp_path / "repo", work_dir=tmp_path / "triton", host="127.0.0.1", http_port=8000,
                       grpc_port=8001, metrics_port=8002).command()
    for flag in ("--http-address", "--grpc-address", "--metrics-address"):  # the supervisor's --host
        assert f"{flag}=127.0.0.1" in cmd, cmd
    command = gateway["command"] + gateway["args"]
    assert command[:3] == ["python3", "-m", "cosyvoice_triton.gateway"]
    from cosyvoice_triton.gateway.config import from_args

    config = from_args(gateway["args"])
    assert (config.host, config.port, config.grpc_port) == ("0.0.0.0", 8080, 8081)
    assert config.triton_grpc == "127.0.0.1:8001" and config.triton_metrics == "http://127.0.0.1:8002/metrics"
    assert config.triton_http == "127.0.0.1:8000"
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/health", "port": "gateway"}
    assert gateway["livenessProbe"]["tcpSocket"] == {"port": "gateway"}
    sec = gateway["securityContext"]
    assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
    if sec.get("readOnlyRootFilesystem"):  # uploads are spooled to /tmp
        assert "/tmp" in {m["mountPath"] for m in gateway["volumeMounts"]}
    assert {"8080", "8081"} <= set(re.search(r"^EXPOSE (.*)$", (ROOT / "Dockerfile.triton").read_text(),
                                             re.M).group(1).split())


def test_scrape_config_points_at_the_gateways_metrics():
    """One scrape target per pod: the gateway's /metrics, which carries Triton's metrics (read on loopback)."""
    dep, mon = _one("Deployment"), _one("ServiceMonitor")
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    gateway = next(p["containerPort"] for p in _container("gateway")["ports"] if p["name"] == "gateway")
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == gateway
    assert ann["prometheus.io/path"] == "/metrics"
    assert mon["spec"]["endpoints"][0]["port"] == _one("Service")["spec"]["ports"][0]["name"]
    assert mon["spec"]["endpoints"][0]["path"] == "/metrics"
    assert mon["spec"]["selector"]["matchLabels"] == _one("Service")["metadata"]["labels"]
    job = yaml.safe_load(_one("ConfigMap", "cosyvoice-triton-prometheus-scrape")["data"]["scrape-job.yml"])
    targets = {r.get("target_label") for r in job[0]["relabel_configs"]}
    assert {"namespace", "pod", "__address__", "__metrics_path__"} <= targets  # what the adapter's rules need


def test_runs_as_the_images_non_root_user():
    dockerfile = (ROOT / "Dockerfile.triton").read_text()
    users = re.findall(r"^USER\s+(\d+)(?::(\d+))?\s*$", dockerfile, re.M)
    assert users, "Dockerfile.triton has no numeric USER"
    uid, gid = users[-1]
    last_user = [ln for ln in dockerfile.splitlines() if ln.startswith("USER ")][-1]
    assert last_user == f"USER {uid}:{gid}" and int(uid) != 0
    pod = _one("Deployment")["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] and pod["runAsUser"] == int(uid) and pod["fsGroup"] == int(gid)
    sec = _container()["securityContext"]
    assert sec["allowPrivilegeEscalation"] is False and sec["capabilities"]["drop"] == ["ALL"]
    if sec.get("readOnlyRootFilesystem"):  # everything written must be a volume
        mounts = {m["mountPath"] for m in _container()["volumeMounts"]}
        assert {"/workspace/build", "/tmp", "/dev/shm"} <= mounts


def test_grace_period_covers_prestop_and_the_requests_in_flight():
    dep = _one("Deployment")["spec"]["template"]["spec"]
    c = _container()
    pre = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    exit_timeout = int(next(e["value"] for e in c["env"] if e["name"] == "SUPERVISOR_EXIT_TIMEOUT"))
    assert '--exit-timeout "${SUPERVISOR_EXIT_TIMEOUT:-30}"' in (ROOT / "export" / "container_start.sh").read_text()
    assert dep["terminationGracePeriodSeconds"] >= pre + exit_timeout + 20


def _created_secrets() -> dict[str, set[str]]:
    """name -> keys of every ``kubectl create secret generic NAME --from-literal=KEY=...`` the Kubernetes page shows."""
    page = (ROOT / "docs" / "operations" / "kubernetes.md").read_text()
    out: dict[str, set[str]] = {}
    for m in re.finditer(r"kubectl create secret generic (\S+)((?: --from-literal=[\w.-]+=\S+)+)", page):
        out.setdefault(m.group(1), set()).update(re.findall(r"--from-literal=([\w.-]+)=", m.group(2)))
    return out


def test_keys_come_from_the_secrets_the_user_creates():
    """The pod reads its keys from the Secrets the Kubernetes page has the user create, and no manifest holds a
    Secret: `kubectl apply -f deploy/k8s/` would replace the user's key with the manifest's placeholder."""
    assert not [(name, d["metadata"]["name"]) for name, d in _objects() if d["kind"] == "Secret"]
    created = _created_secrets()
    refs = [(c["name"], e["name"], e["valueFrom"]["secretKeyRef"]) for c in
            _one("Deployment")["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})]
    assert refs
    for container, env, ref in refs:
        assert ref["key"] in created.get(ref["name"], set()), (
            f"{container} {env}: Secret {ref['name']!r} key {ref['key']!r} is not one docs/operations/kubernetes.md "
            f"has the user create ({created})")
    c = _container()
    env = next(e for e in c["env"] if e["name"] == "COSYVOICE_TRITON_ADMIN_KEY")
    from cosyvoice_triton.admin import ADMIN_KEY_ENV

    assert env["name"] == ADMIN_KEY_ENV and not env["valueFrom"]["secretKeyRef"].get("optional")


def test_hpa_scales_the_deployment_on_metrics_the_adapter_serves():
    hpa, dep = _one("HorizontalPodAutoscaler"), _one("Deployment")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["kind"], ref["name"]) == (dep["kind"], dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    rules = yaml.safe_load(_one("ConfigMap", "cosyvoice-triton-prometheus-adapter")["data"]["config.yaml"])["rules"]
    served = {r["name"]["as"] for r in rules}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted <= served, f"the HPA asks for {wanted - served}, which no adapter rule serves"
    for r in rules:
        assert "<<.LabelMatchers>>" in r["metricsQuery"] and "<<.GroupBy>>" in r["metricsQuery"]
        assert set(r["resources"]["overrides"]) == {"namespace", "pod"}
    targets = {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa["spec"]["metrics"]}
    assert targets == {"cosyvoice_queue_seconds_per_request": "400m", "cosyvoice_pending_requests": "1"}
    assert "0.5 x 0.82 = 0.41 s -> 400m" in hpa_text() and "2.5 x 0.41" in hpa_text()  # the reasoning, next to it


def hpa_text() -> str:
    return (K8S / "hpa.yaml").read_text()


def adapter_metric_names() -> set[str]:
    """Every Triton metric the adapter's queries read (for the live check in test_hardening_live.py)."""
    rules = yaml.safe_load(_one("ConfigMap", "cosyvoice-triton-prometheus-adapter")["data"]["config.yaml"])["rules"]
    return {m for r in rules for m in re.findall(r"\b(nv_[a-z_]+)\b", r["metricsQuery"] + r["seriesQuery"])}


def test_the_adapter_reads_triton_metrics():
    assert adapter_metric_names() == {"nv_inference_queue_duration_us", "nv_inference_request_success",
                                      "nv_inference_pending_request_count"}
