"""The chart's scale-out modes (helm/wick): vLLM's router in front of the model-server pods, one
model over several nodes as a LeaderWorkerSet, and the Gateway API Inference Extension's
InferencePool. Rendered with the Helm v4 SDK; built-in kinds validated against Kubernetes 1.30's
schemas (kubernetes-validate, strict), the custom resources against their projects' CRDs (kept in
tests/deploy/crds/), and the pod templates inside the LeaderWorkerSet against 1.30's
PodTemplateSpec."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import Any

import helm_python
import jsonschema
import kubernetes_validate
import pytest
import yaml

from model_server.config import EngineConfig
from model_server.entrypoints.cli import build_parser
from model_server.settings import ServerSettings
from model_server.settings_spec import SETTINGS
from tests.deploy.conftest import CHART, find, one, overlay, render

CRDS = Path(__file__).parent / "crds"
KUBE_VERSION = "1.30"
CRD_FILES = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): (
        "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
    ),
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "inference.networking.k8s.io_inferencepools.yaml"
    ),
}
MULTI_NODE = {
    "multiNode": {"enabled": True, "nodes": 2},
    "modelServer": {
        "replicas": 3,
        "config": {
            "LLM_MODEL": "/data/Qwen3-8B",
            "LLM_TP_SIZE": 4,
            "LLM_DTYPE": "bfloat16",
            "LLM_MAX_MODEL_LEN": 8192,
            "LLM_KV_CACHE_MEMORY": "8GiB",
            "LLM_ENABLE_PREFIX_CACHING": False,
            "LLM_BLOCK_SIZE": 32,
        },
    },
}


def strict(schema: Any) -> Any:
    """A CRD's structural schema as JSON Schema that also refuses unknown fields (the API
    server would prune them silently: a typo in the chart would vanish)."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    crd = yaml.safe_load((CRDS / CRD_FILES[(doc["apiVersion"], doc["kind"])]).read_text())
    group, version = doc["apiVersion"].split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == doc["kind"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return strict(served["schema"]["openAPIV3Schema"])


def validate(docs: list[dict[str, Any]]) -> None:
    """Every object: a CRD kind against its CRD, the rest against Kubernetes 1.30."""
    for doc in docs:
        body = {k: v for k, v in doc.items() if k != "_template"}
        if (doc["apiVersion"], doc["kind"]) in CRD_FILES:
            jsonschema.validate(body, crd_schema(doc))
        else:
            kubernetes_validate.validate(body, KUBE_VERSION, strict=True)


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@pytest.fixture(scope="module")
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


# ---------------------------------------------------------------------------------- router


def test_the_router_fronts_the_model_servers(chart: helm_python.Chart) -> None:
    docs = render(chart, {"router": {"enabled": True}, "modelServer": {"replicas": 3}})
    validate(docs)
    deployment = one(docs, "Deployment", "wick-router")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert "--policy=cache_aware" in args and "--service-discovery" in args
    selector = args[args.index("--selector") + 1 : args.index("--service-discovery-port=8008")]
    model_server = one(docs, "Deployment", "wick-model-server")
    pod_labels = model_server["spec"]["template"]["metadata"]["labels"]
    # The router's selector picks exactly the model-server pods.
    assert dict(s.split("=") for s in selector).items() <= pod_labels.items()
    assert dict(s.split("=") for s in selector)["app.kubernetes.io/component"] == "model-server"
    assert "--service-discovery-namespace=ai" in args
    # It may list and watch pods, and nothing else.
    role = one(docs, "Role", "wick-router")
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    binding = one(docs, "RoleBinding", "wick-router")
    assert (
        binding["subjects"][0]["name"]
        == deployment["spec"]["template"]["spec"]["serviceAccountName"]
    )
    # The microservice calls the router.
    config = one(docs, "ConfigMap", "wick-microservice")["data"]
    service = one(docs, "Service", "wick-router")
    assert config["LLM_MODEL_SERVER_ENDPOINT"] == "http://wick-router:8008"
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    # Off by default: nothing of it, and the microservice calls the model servers' Service.
    plain = render(chart)
    assert not [d for d in plain if d["metadata"]["name"].startswith("wick-router")]
    assert one(plain, "ConfigMap", "wick-microservice")["data"]["LLM_MODEL_SERVER_ENDPOINT"] == (
        "http://wick-model-server:8008"
    )


def test_the_router_sends_the_model_servers_key(chart: helm_python.Chart) -> None:
    docs = render(chart, {"router": {"enabled": True}, "secrets": {"apiKey": "k1"}})
    validate(docs)
    (container,) = one(docs, "Deployment", "wick-router")["spec"]["template"]["spec"]["containers"]
    assert "--api-key=$(LLM_API_KEY)" in container["args"]
    (env,) = container["env"]
    assert env["name"] == "LLM_API_KEY" and env["valueFrom"]["secretKeyRef"]["key"] == "LLM_API_KEY"


def test_router_values_are_checked(chart: helm_python.Chart) -> None:
    for bad in ({"router": {"policy": "fastest"}}, {"router": {"enabeld": True}}):
        report = helm_python.lint(CHART, bad, strict=True)
        assert report["errors"], bad


# ------------------------------------------------------------------------ LeaderWorkerSet


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_multi_node_renders_a_leaderworkerset(chart: helm_python.Chart, device: str) -> None:
    values = merge(overlay(device), MULTI_NODE)
    if device == "cuda":
        values = merge(values, {"accelerator": {"count": 2}})
    docs = render(chart, values)
    validate(docs)
    assert not find(docs, "Deployment", "wick-model-server")
    lws = one(docs, "LeaderWorkerSet", "wick-model-server")
    spec = lws["spec"]
    assert spec["replicas"] == 3 and spec["leaderWorkerTemplate"]["size"] == 2
    leader = spec["leaderWorkerTemplate"]["leaderTemplate"]
    worker = spec["leaderWorkerTemplate"]["workerTemplate"]
    for template in (leader, worker):
        kubernetes_validate.validate(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "t"},
                "template": template,
            },
            KUBE_VERSION,
            strict=True,
        )
    (lead,) = leader["spec"]["containers"]
    (work,) = worker["spec"]["containers"]
    # Readiness (and the other probes) only on the leader, which serves HTTP.
    assert lead["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & work.keys()
    assert lead["args"] == ["serve"] and work["args"][0] == "worker"
    # The Service sends traffic to the leaders only.
    service = one(docs, "Service", "wick-model-server")
    assert service["spec"]["selector"].items() <= leader["metadata"]["labels"].items()
    assert not service["spec"]["selector"].items() <= worker["metadata"]["labels"].items()
    # Both get MASTER_PORT; the operator's LWS_* stand in for the rest (rendezvous.py).
    for c in (lead, work):
        assert {"name": "MASTER_PORT", "value": "29500"} in c["env"]
    if device == "cuda":
        # Each pod holds LLM_TP_SIZE / nodes = 2 ranks: 2 GPUs.
        assert work["resources"]["limits"]["nvidia.com/gpu"] == 2


def test_a_worker_pod_runs_the_leaders_engine(
    chart: helm_python.Chart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's flags, parsed by the real CLI, give the engine config the leader builds from
    the ConfigMap's LLM_* variables."""
    docs = render(chart, merge(overlay("cpu"), MULTI_NODE))
    lws = one(docs, "LeaderWorkerSet", "wick-model-server")
    (work,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    worker_config = EngineConfig.from_attrs(build_parser("worker").parse_args(work["args"]))
    for name in list(os.environ):
        if name.startswith(("LLM_", "VLLM_")):
            monkeypatch.delenv(name)
    for name, value in one(docs, "ConfigMap", "wick-model-server")["data"].items():
        monkeypatch.setenv(name, value)
    leader_config = ServerSettings().engine_config()
    # WICK_* kernel settings are read from the environment by every command: the worker pod has
    # the same ConfigMap, so those left unset in its flags decide the same way.
    everywhere = {s.name for s in SETTINGS if s.everywhere}
    assert {n: getattr(worker_config, n) for n in everywhere} == dict.fromkeys(everywhere)
    leader_config = dataclasses.replace(leader_config, **dict.fromkeys(everywhere))
    assert worker_config == leader_config
    assert worker_config.tensor_parallel_size == 4 and not worker_config.enable_prefix_caching


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"modelServer": {"config": {"LLM_TP_SIZE": 3}}}, "must be a multiple of multiNode.nodes"),
        ({"modelServer": {"config": {"LLM_TP_SIZE": 1}}}, "must be a multiple of multiNode.nodes"),
    ],
)
def test_a_split_the_nodes_cannot_hold_is_refused(
    chart: helm_python.Chart, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception, match=message):
        render(chart, merge(MULTI_NODE, extra))


def test_the_crd_check_is_not_vacuous(chart: helm_python.Chart) -> None:
    docs = render(chart, MULTI_NODE)
    lws = copy.deepcopy(one(docs, "LeaderWorkerSet", "wick-model-server"))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"
    with pytest.raises(jsonschema.ValidationError):
        validate([lws])
    lws = copy.deepcopy(one(docs, "LeaderWorkerSet", "wick-model-server"))
    lws["spec"]["leaderWorkerTemplate"]["sise"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate([lws])


# -------------------------------------------------------------------------- InferencePool


def test_the_inference_pool_selects_the_serving_pods(chart: helm_python.Chart) -> None:
    for values in ({}, MULTI_NODE):
        docs = render(chart, merge(values, {"inferencePool": {"enabled": True}}))
        validate(docs)
        pool = one(docs, "InferencePool", "wick")
        service = one(docs, "Service", "wick-model-server")
        assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
        assert pool["spec"]["targetPorts"] == [{"number": 8008}]
        assert pool["spec"]["endpointPickerRef"] == {
            "name": "wick-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
    bad = copy.deepcopy(pool)
    bad["spec"]["targetPorts"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate([bad])


@pytest.mark.parametrize(
    "values",
    [
        {"router": {"enabled": True}},
        MULTI_NODE,
        {"inferencePool": {"enabled": True}},
        merge(MULTI_NODE, {"router": {"enabled": True}, "inferencePool": {"enabled": True}}),
    ],
    ids=["router", "multi-node", "inference-pool", "all"],
)
def test_lint_strict_is_clean(values: dict[str, Any]) -> None:
    report = helm_python.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
