"""The Helm chart (helm/wick), checked with the Helm v4 SDK (helm-python-sdk): strict lint, the
values schema, a render for every device and toggle, every rendered object validated against
the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate, strict), and what each device renders."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from microservice.settings import MicroserviceSettings
from model_server.settings import ServerSettings
from tests.deploy.conftest import (
    ACCELERATOR_RESOURCES,
    CHART,
    DEVICES,
    find,
    one,
    overlay,
    render,
)

KUBE_VERSION = "1.30"
MS, USVC = "wick-model-server", "wick-microservice"
SECRET_KEYS = ("HF_TOKEN", "LLM_API_KEY", "LLM_USVC_API_KEY")
# Kinds that come from CRDs: no schema in kubernetes-validate, skipped on SchemaNotFoundError.
CRD_KINDS = {"ServiceMonitor"}

TOGGLES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "servicemonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}},
    "no-hpa": {"microservice": {"autoscaling": {"enabled": False}, "replicas": 3}},
    "no-pdb": {"podDisruptionBudget": {"enabled": False}},
    "emptydir": {"modelCache": {"persistence": {"enabled": False}}},
    "existing-claim": {"modelCache": {"persistence": {"existingClaim": "models"}}},
    "secrets": {"secrets": {"hfToken": "hf_x", "apiKey": "k1", "usvcApiKey": "k2"}},
    "existing-secret": {"secrets": {"existingSecret": "wick-keys"}},
    "no-tests": {"tests": {"enabled": False}},
    "registry": {"image": {"registry": "registry.example/", "tag": "1.2.3"}},
    "dashboard": {
        "grafanaDashboard": {"enabled": True, "folder": "LLM", "namespace": "monitoring"}
    },
    "rag": {"rag": {"enabled": True}, "secrets": {"apiKey": "k1"}},
}


def merge(*layers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def container(doc: dict[str, Any]) -> dict[str, Any]:
    containers = doc["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env_refs(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e.get("valueFrom", {}) for e in c.get("env", [])}


def settings_env_names(cls: type) -> set[str]:
    names = set()
    for field in cls.model_fields.values():
        names.update(str(c) for c in field.validation_alias.choices)
    return names


# ------------------------------------------------------------------------ lint and schema


@pytest.mark.parametrize("device", [None, *DEVICES])
def test_lint_strict_is_clean(device: str | None) -> None:
    values = overlay(device) if device else None
    report = helm_python.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == [], problems


def test_lint_reports_schema_violations() -> None:
    """Lint is not vacuous: values the schema forbids are lint errors."""
    report = helm_python.lint(CHART, {"device": "tpu"}, strict=True)
    assert report["errors"] and any("device" in e for e in report["errors"])


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"device": "tpu"}, "device"),
        ({"device": "CUDA"}, "device"),
        ({"accelerator": {"count": 0}}, "count"),
        ({"modelServer": {"config": {"LLM_API_KEY": "s3cret"}}}, "LLM_API_KEY"),
        ({"modelServer": {"config": {"HF_TOKEN": "hf_x"}}}, "HF_TOKEN"),
        ({"modelServer": {"extraEnv": {"HF_TOKEN": "hf_x"}}}, "HF_TOKEN"),
        ({"microservice": {"extraEnv": {"LLM_USVC_API_KEY": "k"}}}, "LLM_USVC_API_KEY"),
        ({"modelServer": {"config": {"LLM_DTYPE": "int3"}}}, "LLM_DTYPE"),
        ({"modelServer": {"config": {"LLM_MAX_MODEL_LEN": -1}}}, "LLM_MAX_MODEL_LEN"),
        ({"modelServer": {"config": {"LLM_GPU_MEMORY_UTILIZATION": 1.5}}}, "UTILIZATION"),
        ({"microservice": {"config": {"LLM_CONNECTOR": "openai"}}}, "LLM_CONNECTOR"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"podSecurityContext": {"runAsUser": 0}}, "runAsUser"),
        ({"modelServer": {"updateStrategy": "BlueGreen"}}, "updateStrategy"),
        ({"modelCache": {"persistence": {"size": "lots"}}}, "size"),
        ({"serviceMonitor": {"interval": "often"}}, "interval"),
        ({"modelserver": {}}, "modelserver"),
    ],
)
def test_schema_rejects_bad_values(
    chart: helm_python.Chart, values: dict[str, Any], where: str
) -> None:
    with pytest.raises(helm_python.HelmValuesError) as err:
        chart.validate_schema(values)
    assert where in str(err.value)


@pytest.mark.parametrize("device", DEVICES)
def test_schema_accepts_overlays(chart: helm_python.Chart, device: str) -> None:
    chart.validate_schema(overlay(device))
    chart.validate_schema(merge(overlay(device), *TOGGLES.values()))


def _value_lines(text: str) -> list[tuple[int, str]]:
    return [
        (i, line)
        for i, line in enumerate(text.splitlines())
        if re.match(r"^\s*[A-Za-z_][\w.-]*:", line)
    ]


@pytest.mark.parametrize("name", ["values.yaml", *(f"values-{d}.yaml" for d in DEVICES)])
def test_every_values_key_is_documented(name: str) -> None:
    """Each key line has a comment on the line above (its own, or the section's) or inline."""
    lines = (CHART / name).read_text().splitlines()
    undocumented = []
    for i, line in _value_lines("\n".join(lines)):
        above = lines[i - 1].strip() if i else ""
        if not (above.startswith("#") or " # " in line):
            undocumented.append(line.strip())
    assert undocumented == []


def _schema_paths(values: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Keys of `values` that the schema does not name (free-form maps excepted)."""
    missing = []
    if not isinstance(values, dict) or "properties" not in schema:
        return missing
    for key, value in values.items():
        sub = schema["properties"].get(key)
        if sub is None:
            missing.append(f"{path}{key}")
        else:
            missing += _schema_paths(value, sub, f"{path}{key}.")
    return missing


def test_schema_names_every_values_key() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert _schema_paths(values, schema) == []
    assert schema["additionalProperties"] is False


def test_config_keys_are_the_services_own_env_names() -> None:
    """The ConfigMaps carry the same LLM_* names the services read (one set of names)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    ms_names = settings_env_names(ServerSettings) | {"HF_HUB_OFFLINE"}
    usvc_names = settings_env_names(MicroserviceSettings)
    assert set(values["modelServer"]["config"]) <= ms_names
    assert set(values["microservice"]["config"]) <= usvc_names


# ------------------------------------------------------------------------ manifests


def test_validation_is_strict() -> None:
    """kubernetes-validate really checks: an unknown field or a wrong type fails."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "eighty"}], "bogusField": 1}}  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("toggle", TOGGLES)
@pytest.mark.parametrize("device", DEVICES)
def test_every_rendered_object_is_valid_kubernetes(
    chart: helm_python.Chart, device: str, toggle: str
) -> None:
    docs = render(chart, merge(overlay(device), TOGGLES[toggle]))
    skipped = []
    for doc in docs:
        obj = {k: v for k, v in doc.items() if k != "_template"}
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            skipped.append(doc["kind"])
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['_template']} {doc['kind']}: {exc}")
    assert set(skipped) <= CRD_KINDS
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= kinds
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "duplicate objects"


@pytest.mark.parametrize("device", DEVICES)
def test_device_selects_image_resources_and_env(chart: helm_python.Chart, device: str) -> None:
    for values in ({"device": device}, overlay(device)):
        docs = render(chart, values)
        c = container(one(docs, "Deployment", MS))
        assert c["image"] == f"wick/model-server-{device}:0.1.0"
        resources = c["resources"]
        extended = {k for part in resources.values() for k in part if k not in ("cpu", "memory")}
        if device == "cpu":
            assert extended == set()
        else:
            name = ACCELERATOR_RESOURCES[device]
            assert extended == {name}
            assert resources["limits"][name] == resources["requests"][name] == 1
        config = one(docs, "ConfigMap", MS)["data"]
        assert config["LLM_DEVICE"] == device
        assert ("HABANA_VISIBLE_DEVICES" in config) == (device == "hpu")
        # The microservice is the same image everywhere.
        assert container(one(docs, "Deployment", USVC))["image"] == "wick/llm-microservice:0.1.0"


def test_accelerator_count_and_registry(chart: helm_python.Chart) -> None:
    docs = render(
        chart,
        {"device": "hpu", "accelerator": {"count": 8},
         "image": {"registry": "registry.example/", "tag": "1.2.3"}},
    )  # fmt: skip
    c = container(one(docs, "Deployment", MS))
    assert c["resources"]["limits"]["habana.ai/gaudi"] == 8
    assert c["image"] == "registry.example/wick/model-server-hpu:1.2.3"
    usvc = container(one(docs, "Deployment", USVC))
    assert usvc["image"] == "registry.example/wick/llm-microservice:1.2.3"


@pytest.mark.parametrize("device", DEVICES)
def test_probes(chart: helm_python.Chart, device: str) -> None:
    docs = render(chart, overlay(device))
    ms = container(one(docs, "Deployment", MS))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert ms[probe]["httpGet"] == {"path": "/health", "port": "http"}
    startup = ms["startupProbe"]
    # Long enough for loading and warmup: 30 min, an hour on Gaudi.
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= (3600 if device == "hpu" else 1800)
    usvc = container(one(docs, "Deployment", USVC))
    assert usvc["readinessProbe"]["httpGet"] == {"path": "/v1/health_check", "port": "http"}
    # Liveness must not follow the model server's readiness (that would restart the pods).
    assert "httpGet" not in usvc["livenessProbe"] and usvc["livenessProbe"]["tcpSocket"]
    assert ms["ports"] == [{"name": "http", "containerPort": 8008, "protocol": "TCP"}]
    assert usvc["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]


@pytest.mark.parametrize("device", DEVICES)
def test_security_context_everywhere(chart: helm_python.Chart, device: str) -> None:
    docs = render(chart, overlay(device))
    pods = [d["spec"]["template"]["spec"] for d in find(docs, "Deployment")]
    pods += [d["spec"] for d in find(docs, "Pod")]
    assert len(pods) == 3  # two deployments and the helm test pod
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 1000
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
    # A read-only root needs writable /tmp (and /dev/shm, the cache) in the model server.
    mounts = {m["mountPath"] for m in container(one(docs, "Deployment", MS))["volumeMounts"]}
    assert mounts == {"/data", "/tmp", "/dev/shm"}


def _configmap_text(docs: list[dict[str, Any]]) -> str:
    return json.dumps([d for d in docs if d["kind"] == "ConfigMap"])


def test_secrets_come_from_a_secret_never_a_configmap(chart: helm_python.Chart) -> None:
    docs = render(chart, TOGGLES["secrets"])
    secret = one(docs, "Secret", "wick-secrets")
    decoded = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert decoded == {"HF_TOKEN": "hf_x", "LLM_API_KEY": "k1", "LLM_USVC_API_KEY": "k2"}
    ms_env = env_refs(container(one(docs, "Deployment", MS)))
    usvc_env = env_refs(container(one(docs, "Deployment", USVC)))
    assert set(ms_env) == {"HF_TOKEN", "LLM_API_KEY"}
    assert set(usvc_env) == {"LLM_API_KEY", "LLM_USVC_API_KEY"}  # no HF_TOKEN
    for refs in (ms_env, usvc_env):
        for name, ref in refs.items():
            assert ref["secretKeyRef"] == {"name": "wick-secrets", "key": name}
    text = _configmap_text(docs)
    for word in ("hf_x", "k1", "k2", *SECRET_KEYS):
        assert f'"{word}"' not in text
    test_pod = find(docs, "Pod")[0]["spec"]["containers"][0]
    assert set(env_refs(test_pod)) >= {"LLM_USVC_API_KEY"}


def test_existing_secret_is_referenced_optionally(chart: helm_python.Chart) -> None:
    docs = render(chart, TOGGLES["existing-secret"])
    assert find(docs, "Secret") == []
    ms_env = env_refs(container(one(docs, "Deployment", MS)))
    assert ms_env["HF_TOKEN"]["secretKeyRef"] == {
        "name": "wick-keys", "key": "HF_TOKEN", "optional": True,
    }  # fmt: skip
    assert set(ms_env) == {"HF_TOKEN", "LLM_API_KEY"}


def test_no_secret_without_secrets(chart: helm_python.Chart) -> None:
    docs = render(chart)
    assert find(docs, "Secret") == []
    for name in (MS, USVC):
        assert "env" not in container(one(docs, "Deployment", name))


def test_configmaps_carry_llm_settings(chart: helm_python.Chart) -> None:
    docs = render(
        chart,
        {"modelServer": {"config": {"LLM_MAX_MODEL_LEN": 4096, "LLM_MODEL": "/data/m.gguf",
                                    "LLM_GPU_MEMORY_UTILIZATION": 0.85, "LLM_SKIP_WARMUP": True},
                         "extraEnv": {"LLM_ATTENTION_BACKEND": "torch"}},
         "microservice": {"config": {"LLM_CONNECTOR": "langchain"}}},
    )  # fmt: skip
    ms = one(docs, "ConfigMap", MS)["data"]
    assert ms["LLM_MAX_MODEL_LEN"] == "4096" and ms["LLM_MODEL"] == "/data/m.gguf"
    assert ms["LLM_GPU_MEMORY_UTILIZATION"] == "0.85" and ms["LLM_SKIP_WARMUP"] == "true"
    assert ms["LLM_ATTENTION_BACKEND"] == "torch"
    assert ms["LLM_MODEL_SERVER_PORT"] == "8008" and ms["HF_HOME"] == "/data/huggingface"
    # Null and empty settings stay out, so the server's own defaults apply.
    assert "LLM_MAX_NUM_SEQS" not in ms and "LLM_SERVED_MODEL_NAME" not in ms
    assert all(isinstance(v, str) for v in ms.values())
    usvc = one(docs, "ConfigMap", USVC)["data"]
    assert usvc["LLM_CONNECTOR"] == "langchain"
    assert usvc["LLM_MODEL_SERVER_ENDPOINT"] == "http://wick-model-server:8008"
    assert usvc["LLM_USVC_PORT"] == "9000"
    for name in (MS, USVC):
        c = container(one(docs, "Deployment", name))
        assert c["envFrom"] == [{"configMapRef": {"name": name}}]
    # A settings change rolls the pods (the checksum annotation changes).
    before = one(render(chart), "Deployment", MS)["spec"]["template"]["metadata"]["annotations"]
    after = one(docs, "Deployment", MS)["spec"]["template"]["metadata"]["annotations"]
    assert before["checksum/config"] != after["checksum/config"]


def test_model_cache_pvc_or_emptydir(chart: helm_python.Chart) -> None:
    def cache_volume(docs: list[dict[str, Any]]) -> dict[str, Any]:
        volumes = one(docs, "Deployment", MS)["spec"]["template"]["spec"]["volumes"]
        return next(v for v in volumes if v["name"] == "model-cache")

    docs = render(chart)
    pvc = one(docs, "PersistentVolumeClaim", "wick-model-cache")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert cache_volume(docs)["persistentVolumeClaim"] == {"claimName": "wick-model-cache"}

    docs = render(chart, TOGGLES["existing-claim"])
    assert find(docs, "PersistentVolumeClaim") == []
    assert cache_volume(docs)["persistentVolumeClaim"] == {"claimName": "models"}

    docs = render(chart, TOGGLES["emptydir"])
    assert find(docs, "PersistentVolumeClaim") == []
    assert cache_volume(docs)["emptyDir"] == {"sizeLimit": "20Gi"}


def test_hpa_toggle(chart: helm_python.Chart) -> None:
    docs = render(chart)
    hpa = one(docs, "HorizontalPodAutoscaler", USVC)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": USVC}  # fmt: skip
    assert "replicas" not in one(docs, "Deployment", USVC)["spec"]  # the HPA owns it
    docs = render(chart, TOGGLES["no-hpa"])
    assert find(docs, "HorizontalPodAutoscaler") == []
    assert one(docs, "Deployment", USVC)["spec"]["replicas"] == 3


def _pod_labels(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    return one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_selectors_match_their_pods_only(chart: helm_python.Chart) -> None:
    docs = render(chart, TOGGLES["servicemonitor"])
    ms_pods, usvc_pods = _pod_labels(docs, MS), _pod_labels(docs, USVC)
    for name, own, other in ((MS, ms_pods, usvc_pods), (USVC, usvc_pods, ms_pods)):
        selector = one(docs, "Service", name)["spec"]["selector"]
        assert _selects(selector, own) and not _selects(selector, other)
        deploy_selector = one(docs, "Deployment", name)["spec"]["selector"]["matchLabels"]
        assert _selects(deploy_selector, own) and not _selects(deploy_selector, other)
        pdb = one(docs, "PodDisruptionBudget", name)
        assert _selects(pdb["spec"]["selector"]["matchLabels"], own)
        assert pdb["spec"]["maxUnavailable"] == 1


def test_pdb_toggle(chart: helm_python.Chart) -> None:
    assert len(find(render(chart), "PodDisruptionBudget")) == 2
    assert find(render(chart, TOGGLES["no-pdb"]), "PodDisruptionBudget") == []


def test_servicemonitors_scrape_both_services(chart: helm_python.Chart) -> None:
    assert find(render(chart), "ServiceMonitor") == []
    docs = render(chart, TOGGLES["servicemonitor"])
    monitors = find(docs, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {MS, USVC}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["labels"]["release"] == "prom"
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
        service = one(docs, "Service", monitor["metadata"]["name"])
        assert _selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_helm_test_pod_sends_a_chat_request(chart: helm_python.Chart) -> None:
    docs = render(chart)
    (pod,) = find(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    c = pod["spec"]["containers"][0]
    assert c["image"] == "wick/llm-microservice:0.1.0"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["WICK_CHAT_URL"] == f"http://{USVC}:9000/v1/chat/completions"
    script = c["args"][0]
    compile(script, "helm-test", "exec")  # valid Python
    assert '"streaming": False' in script and "max_new_tokens" in script
    assert find(render(chart, TOGGLES["no-tests"]), "Pod") == []


def test_tensor_parallel_size_needs_that_many_accelerators(chart: helm_python.Chart) -> None:
    values = {"device": "cuda", "modelServer": {"config": {"LLM_TP_SIZE": 4}}}
    with pytest.raises(Exception, match=r"LLM_TP_SIZE=4 .* accelerator\.count gives the pod 1"):
        render(chart, values)
    docs = render(chart, merge(values, {"accelerator": {"count": 4}}))
    c = container(one(docs, "Deployment", MS))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    config = one(docs, "ConfigMap", MS)
    assert config["data"]["LLM_TP_SIZE"] == "4"
    # CPU ranks share the pod's cores: no accelerator count applies.
    render(chart, {"device": "cpu", "modelServer": {"config": {"LLM_TP_SIZE": 2}}})


def test_grafana_dashboard_configmap_is_off_by_default_and_carries_the_sidecar_label(
    chart: helm_python.Chart,
) -> None:
    assert [
        c for c in find(render(chart), "ConfigMap") if "dashboard" in c["metadata"]["name"]
    ] == []
    docs = render(chart, TOGGLES["dashboard"])
    (config_map,) = [c for c in find(docs, "ConfigMap") if "dashboard" in c["metadata"]["name"]]
    meta = config_map["metadata"]
    assert meta["labels"]["grafana_dashboard"] == "1"
    assert meta["namespace"] == "monitoring"
    assert meta["annotations"] == {"grafana_folder": "LLM"}
    # The very file compose's monitoring profile mounts.
    shipped = json.loads((CHART / "dashboards" / "wick.json").read_text())
    assert json.loads(config_map["data"]["wick.json"]) == shipped
    custom = render(
        chart, {"grafanaDashboard": {"enabled": True, "label": "dash", "labelValue": "y"}}
    )
    (config_map,) = [c for c in find(custom, "ConfigMap") if "dashboard" in c["metadata"]["name"]]
    assert config_map["metadata"]["labels"]["dash"] == "y"
    assert "namespace" not in config_map["metadata"]


def test_rag_adds_embedding_and_reranking_servers_and_microservices(
    chart: helm_python.Chart,
) -> None:
    assert not [d for d in render(chart, {}) if "embedding" in d["metadata"]["name"]]  # off
    docs = render(chart, merge(overlay("cuda"), TOGGLES["rag"]))
    for kind, model, port in (("embedding", "BAAI/bge-base-en-v1.5", 6000),
                              ("reranking", "BAAI/bge-reranker-base", 8000)):  # fmt: skip
        server = one(docs, "Deployment", f"wick-{kind}-model-server")
        c = container(server)
        env = {e["name"]: e.get("value") for e in c["env"]}
        # The CPU image whatever the LLM's device; the LLM's settings do not reach it.
        assert c["image"].startswith("wick/model-server-cpu:")
        assert (env["LLM_DEVICE"], env["LLM_MODEL"]) == ("cpu", model)
        assert "LLM_API_KEY" in env_refs(c) and "resources" in c
        assert "envFrom" not in c
        usvc = container(one(docs, "Deployment", f"wick-{kind}-microservice"))
        assert usvc["command"] == ["python3", "-m", f"microservice.{kind}"]
        uenv = {e["name"]: e.get("value") for e in usvc["env"]}
        upper = kind.upper()
        assert uenv[f"{upper}_MODEL_SERVER_ENDPOINT"] == f"http://wick-{kind}-model-server:8008"
        assert uenv[f"{upper}_USVC_PORT"] == str(port)
        assert usvc["readinessProbe"]["httpGet"]["path"] == "/v1/health_check"
        for pod_owner in (server, one(docs, "Deployment", f"wick-{kind}-microservice")):
            pod = pod_owner["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["automountServiceAccountToken"] is False
            assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
            name = pod_owner["metadata"]["name"]
            selector = one(docs, "Service", name)["spec"]["selector"]
            labels = pod_owner["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= labels.items()
            others = [
                d["spec"]["template"]["metadata"]["labels"]
                for d in find(docs, "Deployment")
                if d["metadata"]["name"] != name
            ]
            assert not any(selector.items() <= o.items() for o in others)
        assert one(docs, "Service", f"wick-{kind}-microservice")["spec"]["ports"][0]["port"] == port
