"""MLflow through the Kubeflow gateway: the VirtualService's route, and a real ``mlflow server`` started with the
arguments and ConfigMap that ``kubectl kustomize`` renders (only its stores, address and worker count are the
test's), asked what the gateway, the kubelet's probe and Tidal's pods would ask.

The Istio gateway itself is not here: the route forwards the path unchanged (no rewrite), so the requests below
carry the public path and the gateway's Host header, as Envoy would forward them."""

import re
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
import requests
import yaml

from tests.crd_schema import load_crd, schema_errors
from tests.test_kube_manifests import GATEWAY_OVERLAYS, OVERLAYS, ROOT, build_overlay, by_kind, kustomize_on_top_of
from tidal.kube import cluster
from tidal.transport.server import free_port


def check_virtual_service(vs: dict) -> list[str]:
    """Unknown or mistyped fields, by path, against Istio 1.22's VirtualService CRD (networking.istio.io/v1)."""
    return schema_errors(vs, load_crd("istio-api-1.22.0-virtualservices.json"))


@pytest.mark.parametrize("name", OVERLAYS)
def test_the_gateway_routes_mlflows_prefix_to_its_service_on_kubeflow_clusters_only(name):
    objects = build_overlay(name)
    services = by_kind(objects, "VirtualService")
    config = by_kind(objects, "ConfigMap")["tidal-mlflow-config"]["data"]
    assert config["STATIC_PREFIX"] == cluster.MLFLOW_STATIC_PREFIX and cluster.MLFLOW_URL.endswith(cluster.MLFLOW_STATIC_PREFIX)
    if name not in GATEWAY_OVERLAYS:
        assert services == {} and not config["CORS_ALLOWED_ORIGINS"]
        return
    vs = services["tidal-mlflow"]
    assert vs["apiVersion"] == "networking.istio.io/v1" and vs["metadata"]["namespace"] == "tidal"
    assert check_virtual_service(vs) == []
    assert vs["spec"]["gateways"] == ["kubeflow/kubeflow-gateway"]
    redirect, route = vs["spec"]["http"]
    assert redirect == {"match": [{"uri": {"exact": cluster.MLFLOW_STATIC_PREFIX}}], "redirect": {"uri": cluster.MLFLOW_STATIC_PREFIX + "/"}}
    assert route["match"] == [{"uri": {"prefix": cluster.MLFLOW_STATIC_PREFIX + "/"}}] and "rewrite" not in route
    service = by_kind(objects, "Service")["tidal-mlflow"]
    (destination,) = route["route"]
    assert destination["destination"] == {"host": service["metadata"]["name"], "port": {"number": service["spec"]["ports"][0]["port"]}}
    # the host the gateway forwards is one MLflow accepts, and its origin may POST (the UI's requests)
    origin = config["CORS_ALLOWED_ORIGINS"]
    assert urlparse(origin).hostname in config["ALLOWED_HOSTS"].split(",")


def test_the_virtual_service_check_catches_a_typo():
    vs = by_kind(build_overlay("gpu"), "VirtualService")["tidal-mlflow"]
    vs["spec"]["http"][1]["route"][0]["destination"]["prot"] = {"number": 5000}
    assert check_virtual_service(vs) == ["spec.http[1].route[0].destination.prot: unknown field"]


def expand(arg: str, env: dict) -> str:
    """The kubelet's $(VAR) expansion of container args."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


class RenderedMlflow:
    """``mlflow server`` as the overlay's Deployment runs it: its args, with envFrom ConfigMap tidal-mlflow-config."""

    LOCAL = ("--host", "--port", "--backend-store-uri", "--artifacts-destination")

    def __init__(self, overlay: str, tmp_path: Path):
        objects = build_overlay(overlay)
        self.config = by_kind(objects, "ConfigMap")["tidal-mlflow-config"]["data"]
        container = by_kind(objects, "Deployment")["tidal-mlflow"]["spec"]["template"]["spec"]["containers"][0]
        assert container["envFrom"] == [{"configMapRef": {"name": "tidal-mlflow-config"}}]
        self.probe_path = container["readinessProbe"]["httpGet"]["path"]
        args = [expand(a, self.config) for a in container["args"]]
        assert not [a for a in args if "$(" in a], args
        self.port = free_port()
        local = {
            "--host": "127.0.0.1",
            "--port": str(self.port),
            "--backend-store-uri": f"sqlite:///{tmp_path}/mlflow.db",
            "--artifacts-destination": str(tmp_path / "artifacts"),
        }
        kept = [a for a in args if a.split("=")[0] not in self.LOCAL]
        assert len(kept) == len(args) - len(self.LOCAL)
        self.args = kept
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [str(mlflow), *container["command"][1:], *kept, *(f"{k}={v}" for k, v in local.items()), "--workers=1"]
        self.log = tmp_path / "mlflow.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.time() + 240
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if requests.get(self.url(self.probe_path), timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.time() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.5)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def gpu_mlflow(tmp_path_factory):
    server = RenderedMlflow("gpu", tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def gateway_host(server: RenderedMlflow) -> str:
    return urlparse(server.config["CORS_ALLOWED_ORIGINS"]).hostname


def test_mlflow_serves_every_route_under_the_prefix_the_gateway_routes(gpu_mlflow):
    assert f"--static-prefix={cluster.MLFLOW_STATIC_PREFIX}" in gpu_mlflow.args
    assert gpu_mlflow.probe_path == f"{cluster.MLFLOW_STATIC_PREFIX}/health"
    # the kubelet probes the pod's IP: health is exempt from the Host check
    assert requests.get(gpu_mlflow.url(gpu_mlflow.probe_path), headers={"Host": "10.42.0.17:5000"}, timeout=10).status_code == 200
    search = "/api/2.0/mlflow/experiments/search"
    assert requests.post(gpu_mlflow.url(search), json={"max_results": 1}, timeout=10).status_code == 404  # no API outside the prefix
    assert requests.post(gpu_mlflow.url(cluster.MLFLOW_STATIC_PREFIX + search), json={"max_results": 1}, timeout=10).status_code == 200


def test_the_ui_through_the_gateway_loads_and_may_post_and_other_hosts_and_origins_are_refused(gpu_mlflow):
    host = gateway_host(gpu_mlflow)
    origin = gpu_mlflow.config["CORS_ALLOWED_ORIGINS"]
    ui = requests.get(gpu_mlflow.url(cluster.MLFLOW_STATIC_PREFIX + "/"), headers={"Host": host}, timeout=10)
    assert ui.status_code == 200 and "<html" in ui.text.lower()
    create = cluster.MLFLOW_STATIC_PREFIX + "/ajax-api/2.0/mlflow/experiments/create"
    # what the browser sends for a POST from the UI's own page: Host and Origin of the gateway
    made = requests.post(gpu_mlflow.url(create), json={"name": "from-the-ui"}, headers={"Host": host, "Origin": origin}, timeout=10)
    assert made.status_code == 200, made.text
    foreign_host = requests.post(gpu_mlflow.url(create), json={"name": "x"}, headers={"Host": "evil.example", "Origin": origin}, timeout=10)
    assert foreign_host.status_code == 403 and "Invalid Host header" in foreign_host.text
    foreign_origin = requests.post(gpu_mlflow.url(create), json={"name": "y"}, headers={"Host": host, "Origin": "https://evil.example"}, timeout=10)
    assert foreign_origin.status_code == 403 and "Cross-origin request blocked" in foreign_origin.text


def test_tidals_pods_log_runs_and_proxied_artifacts_at_the_prefixed_tracking_uri(gpu_mlflow, tmp_path):
    from mlflow.tracking import MlflowClient

    for service_host in ("tidal-mlflow:5000", "tidal-mlflow.team-a.svc.cluster.local:5000"):  # the Service, short and full names
        search = cluster.MLFLOW_STATIC_PREFIX + "/api/2.0/mlflow/experiments/search"
        assert requests.post(gpu_mlflow.url(search), json={"max_results": 1}, headers={"Host": service_host}, timeout=10).status_code == 200
    # MLFLOW_URL with this server's address (the Python client sends Host 127.0.0.1:<port>, allowed like a port-forward)
    uri = cluster.MLFLOW_URL.replace("tidal-mlflow:5000", f"127.0.0.1:{gpu_mlflow.port}")
    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(client.create_experiment("pods"))
    client.log_metric(run.info.run_id, "accuracy", 0.5)
    client.log_text(run.info.run_id, "hello", "notes/hello.txt")  # through the server's artifact proxy
    assert client.get_run(run.info.run_id).data.metrics == {"accuracy": 0.5}
    assert Path(client.download_artifacts(run.info.run_id, "notes/hello.txt", str(tmp_path))).read_text() == "hello"


def test_without_the_gateway_host_mlflow_refuses_the_gateways_requests(tmp_path):
    """cpu-dev has no gateway: its MLflow refuses a gateway Host, which is the 403 docs/kubernetes.md's table names."""
    server = RenderedMlflow("cpu-dev", tmp_path)
    try:
        host = urlparse(by_kind(build_overlay("gpu"), "ConfigMap")["tidal-mlflow-config"]["data"]["CORS_ALLOWED_ORIGINS"]).hostname
        refused = requests.get(server.url(cluster.MLFLOW_STATIC_PREFIX + "/"), headers={"Host": host}, timeout=10)
        assert refused.status_code == 403 and "Invalid Host header" in refused.text
    finally:
        server.stop()


def test_the_docs_overlay_sets_ones_own_gateway_host(tmp_path):
    """The overlay docs/kubernetes.md shows under "MLflow through the Kubeflow gateway", built on top of gpu."""
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    section = docs[docs.index("### MLflow through the Kubeflow gateway") :]
    (block,) = re.findall(r"```yaml\n(.*?)```", section[: section.index("\n### ")], re.S)
    shown = yaml.safe_load(block)
    assert shown["resources"] == ["../manifests/overlays/gpu"]
    objects = kustomize_on_top_of("gpu", tmp_path, patches=shown["patches"])
    config = by_kind(objects, "ConfigMap")["tidal-mlflow-config"]["data"]
    assert "kubeflow.mycorp.com" in config["ALLOWED_HOSTS"].split(",") and config["CORS_ALLOWED_ORIGINS"] == "https://kubeflow.mycorp.com"
    assert config["STATIC_PREFIX"] == cluster.MLFLOW_STATIC_PREFIX  # the rest of the ConfigMap stays
