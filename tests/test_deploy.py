"""deploy/kubernetes/: every manifest validates (strictly: unknown fields are errors) against the
newest Kubernetes schema kubernetes-validate ships, and the manifests agree with the daemon
configuration they carry (CPU limits = the workers' cores + 1, ports, key paths).

KServe's ServingRuntime and InferenceService are CRDs no Kubernetes schema knows: their
container and volume lists are validated as the Pod spec they become, and the references
between them (runtime name, protocol, model format) are checked here by hand; the rest of
their fields is not validated."""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest

from tests.helpers import ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install -e '.[deploy]')")
yaml = pytest.importorskip("yaml", reason="PyYAML is not installed (a kubernetes-validate dependency)")

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
KSERVE = "serving.kserve.io/"


def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def every_document() -> list[dict]:
    return [doc for path in MANIFESTS for doc in documents(path)]


def find(kind: str, name: str | None = None) -> dict:
    found = [doc for doc in every_document() if doc["kind"] == kind
             and (name is None or doc["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def as_pod(spec: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}


@pytest.mark.parametrize("path", MANIFESTS, ids=[path.name for path in MANIFESTS])
def test_every_manifest_validates_against_the_kubernetes_schema(path):
    docs = documents(path)
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith(KSERVE):
            continue  # CRDs: test_the_kserve_example_validates_what_a_schema_covers
        validate(doc)


def test_the_validator_rejects_a_broken_manifest():
    deployment = copy.deepcopy(find("Deployment"))
    validate(deployment)
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(find("Deployment"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


def test_the_kserve_example_validates_what_a_schema_covers():
    runtime = find("ServingRuntime")
    service = find("InferenceService")
    pod = {"containers": runtime["spec"]["containers"], "volumes": runtime["spec"].get("volumes", [])}
    validate(as_pod(pod))
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    formats = {entry["name"] for entry in runtime["spec"]["supportedModelFormats"]}
    assert model["modelFormat"]["name"] in formats
    container = runtime["spec"]["containers"][0]
    assert container["name"] == "kserve-container"  # the name KServe looks for
    gateway = daemon_config()["gateway"]
    assert container["ports"][0]["containerPort"] == port_of(gateway["http"])


def daemon_config() -> dict:
    return tomllib.loads(find("ConfigMap", "modelwarden-config")["data"]["modelwarden.toml"])


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def container() -> dict:
    return find("Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_cpu_and_memory_match_the_placement_and_are_guaranteed():
    config = daemon_config()
    cores = sum(model["workers"] * model["cores_per_worker"] for model in config["models"])
    resources = container()["resources"]
    assert resources["requests"] == resources["limits"]  # Guaranteed QoS: exclusive cores
    assert int(resources["limits"]["cpu"]) == cores + 1  # + the supervisor, gateway, I/O
    assert resources["limits"]["memory"].endswith("Gi")


def test_one_pod_per_node():
    spec = find("Deployment")["spec"]
    rule = spec["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_ports_probes_and_mounts_match_the_configuration():
    config = daemon_config()
    ports = {port["name"]: port["containerPort"] for port in container()["ports"]}
    tcp = [endpoint for endpoint in config["daemon"]["frontend"] if endpoint.startswith("tcp://")]
    assert ports == {"zmq": port_of(tcp[0]), "http": port_of(config["gateway"]["http"]),
                     "grpc": port_of(config["gateway"]["grpc"])}
    assert container()["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert "test $? -ne 3" in container()["livenessProbe"]["exec"]["command"][-1]
    mounts = {mount["name"]: mount["mountPath"] for mount in container()["volumeMounts"]}
    curve = config["daemon"]["curve"]
    assert Path(curve["server_secret_key"]).parent == Path(mounts["curve"])
    assert curve["client_keys"] == mounts["client-keys"]
    assert "server.key_secret" in find("Secret")["stringData"]
    services = {doc["metadata"]["name"]: doc for doc in every_document() if doc["kind"] == "Service"}
    assert services["modelwarden-pods"]["spec"]["clusterIP"] == "None"  # one address per pod
    assert {port["targetPort"] for port in services["modelwarden"]["spec"]["ports"]} == {"http", "grpc"}


def test_the_configmap_is_a_configuration_the_daemon_accepts(tmp_path):
    from modelwarden.shared.config import check_exposure, load_settings

    path = tmp_path / "modelwarden.toml"
    path.write_text(find("ConfigMap", "modelwarden-config")["data"]["modelwarden.toml"])
    settings = load_settings(path)
    check_exposure(settings)  # tcp on 0.0.0.0 is CURVE, the gateway's exposure is declared
    assert settings.daemon.curve is not None
    assert [model.name for model in settings.models] == ["mlp"]
