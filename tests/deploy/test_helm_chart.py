"""The Helm chart (helm/tokenmill): lint, schema, and rendered manifests checked by kubernetes-validate.

Uses the real helm binary from .tools/bin (installed by `make tools`, i.e. scripts/install_tools.sh)
and kubernetes-validate from the virtualenv, both offline.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tokenmill"
HELM = ROOT / ".tools" / "bin" / "helm"
KUBERNETES_VERSION = "1.31.0"
RELEASE = "tm"


def _kubernetes_validate() -> str:
    beside_python = Path(sys.executable).parent / "kubernetes-validate"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("kubernetes-validate")
    if found is None:
        pytest.fail("kubernetes-validate is not installed (it is in the dev extra: make install)")
    return found


def helm(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(HELM), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def template(env: dict[str, str], *flags: str, chart: Path = CHART) -> str:
    result = subprocess.run(
        [str(HELM), "template", RELEASE, str(chart), "--namespace", "serving", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"helm template {' '.join(flags)} failed:\n{result.stderr}"
    return result.stdout


def template_error(env: dict[str, str], *flags: str) -> str:
    result = subprocess.run(
        [str(HELM), "template", RELEASE, str(CHART), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0, f"helm template {' '.join(flags)} rendered, expected a rejection"
    return result.stderr


def documents(rendered: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def by_kind(rendered: str, kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents(rendered) if doc["kind"] == kind]


def deployment(rendered: str) -> dict[str, Any]:
    (found,) = by_kind(rendered, "Deployment")
    return found


def cluster_service(rendered: str) -> dict[str, Any]:
    """The ClusterIP Service (beside it, the headless one)."""
    (found,) = [s for s in by_kind(rendered, "Service") if s["spec"].get("clusterIP") != "None"]
    return found


def container(rendered: str) -> dict[str, Any]:
    (found,) = deployment(rendered)["spec"]["template"]["spec"]["containers"]
    return found


def env_of(rendered: str) -> dict[str, str]:
    return {item["name"]: item.get("value", "") for item in container(rendered)["env"]}


def assert_valid_kubernetes(rendered: str, tmp_path: Path) -> None:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(rendered)
    result = subprocess.run(
        [_kubernetes_validate(), "-k", KUBERNETES_VERSION, "--strict", str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, f"kubernetes-validate rejected the manifests:\n{result.stdout}{result.stderr}"
    # Every rendered document was checked (and none was skipped as unknown).
    kinds = [doc["kind"] for doc in documents(rendered)]
    assert result.stdout.count("passed for resource") == len(kinds), result.stdout


GPU_FLAGS = ("--set", "gpu=2", "--set", "tensorParallel=2")
HPA_FLAGS = ("--set", "autoscaling.enabled=true")
TLS_FLAGS = ("--set", "server.tls.secretName=tokenmill-tls", "--set", "server.tls.requireClientCert=true")
PVC_FLAGS = (
    "--set",
    "model.source=pvc",
    "--set",
    "model.pvc.claimName=llm-models",
    "--set",
    "model.pvc.subPath=smollm2",
    "--set",
    "model.file=SmolLM2-135M-Instruct.Q4_1.gguf",
)


def test_helm_lint_passes(helm_env: dict[str, str]) -> None:
    result = helm(helm_env, "lint", str(CHART), "--strict")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param((), id="defaults"),
        pytest.param(GPU_FLAGS, id="gpu-2-tensor-parallel-2"),
        pytest.param(("--set", "gpu=1", "--set", "tensorParallel=2"), id="gpu-1-tensor-parallel-2"),
        pytest.param(("--set", "gpu=1"), id="gpu-1"),
        pytest.param(HPA_FLAGS, id="autoscaling"),
        pytest.param(TLS_FLAGS, id="mutual-tls"),
        pytest.param(PVC_FLAGS, id="model-from-pvc"),
        pytest.param(("--set", "server.httpPort=8080", "--set", "service.httpPort=80"), id="http-port"),
        pytest.param(("--set", "server.httpPort=0"), id="http-off"),
        pytest.param(("--set", "server.chatTemplate=hello"), id="chat-template"),
        pytest.param(
            (
                "--set",
                "model.source=hostPath",
                "--set",
                "model.hostPath.path=/srv/models",
            ),
            id="hostpath",
        ),
    ],
)
def test_rendered_manifests_pass_strict_kubernetes_validation(
    helm_env: dict[str, str], tmp_path: Path, flags: tuple[str, ...]
) -> None:
    assert_valid_kubernetes(template(helm_env, *flags), tmp_path)


def test_default_render_has_deployment_services_serviceaccount_and_pdb_only(
    helm_env: dict[str, str],
) -> None:
    kinds = sorted(doc["kind"] for doc in documents(template(helm_env)))
    # Two Services: the ClusterIP one and the headless one (every pod's address, for gRPC round_robin).
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "Service", "ServiceAccount"]


def test_default_render_uses_the_cpu_image_tagged_with_the_app_version(
    helm_env: dict[str, str],
) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    rendered = template(helm_env)
    assert container(rendered)["image"] == f"ghcr.io/tokenmill/tokenmill:{app_version}"
    env = env_of(rendered)
    assert env["TOKENMILL_DEVICE"] == "cpu"
    assert env["TOKENMILL_WORKERS"] == "1"
    assert "nvidia.com/gpu" not in container(rendered)["resources"].get("limits", {})


def test_default_render_has_native_grpc_startup_readiness_and_liveness_probes(
    helm_env: dict[str, str],
) -> None:
    c = container(template(helm_env))
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert grpc_port == 50051
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe
        assert "httpGet" not in c[probe] and "exec" not in c[probe] and "tcpSocket" not in c[probe]
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600, "model load needs >= 10 minutes"


def test_startup_probe_budget_is_configurable(helm_env: dict[str, str]) -> None:
    flags = (
        "--set",
        "probes.startup.failureThreshold=180",
        "--set",
        "probes.startup.periodSeconds=20",
    )
    startup = container(template(helm_env, *flags))["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] == 3600


def test_gpu_render_requests_nvidia_gpus_sets_device_cuda_and_one_worker_per_replica(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env, "--set", "gpu=4", "--set", "tensorParallel=2")
    c = container(rendered)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    env = env_of(rendered)
    assert env["TOKENMILL_DEVICE"] == "cuda"
    assert env["TOKENMILL_TENSOR_PARALLEL"] == "2"
    assert env["TOKENMILL_WORKERS"] == "2"
    assert env["TOKENMILL_DTYPE"] == "auto"
    assert c["image"].endswith("-cuda")


def test_gpu_render_keeps_the_configured_memory_limits(
    helm_env: dict[str, str],
) -> None:
    limits = container(template(helm_env, *GPU_FLAGS))["resources"]["limits"]
    assert limits == {"memory": "6Gi", "nvidia.com/gpu": 2}


def test_gpu_1_tensor_parallel_2_renders_and_requests_the_gpu(
    helm_env: dict[str, str],
) -> None:
    # The acceptance render: it must pass; the pod asks for what its replica's two ranks use.
    c = container(template(helm_env, "--set", "gpu=1", "--set", "tensorParallel=2"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    assert env.get("TOKENMILL_TENSOR_PARALLEL") == "2" and env.get("TOKENMILL_DEVICE") == "cuda"


def test_a_pod_requests_one_gpu_per_rank_of_every_replica_and_shm_for_nccl(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, "--set", "gpu=2", "--set", "tensorParallel=2", "--set", "server.workers=3")
    assert container(rendered)["resources"]["limits"]["nvidia.com/gpu"] == 6
    pod = deployment(rendered)["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "6Gi"
    cpu = deployment(template(helm_env))["spec"]["template"]["spec"]
    assert next(v for v in cpu["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "2Gi"


def test_device_cuda_without_gpus_is_rejected(helm_env: dict[str, str]) -> None:
    assert "needs gpu > 0" in template_error(helm_env, "--set", "server.device=cuda")


def test_dev_shm_is_a_memory_backed_emptydir(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, *GPU_FLAGS, "--set", "shm.sizeLimit=8Gi")
    pod = deployment(rendered)["spec"]["template"]["spec"]
    mount = next(m for m in container(rendered)["volumeMounts"] if m["mountPath"] == "/dev/shm")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_autoscaling_render_has_an_hpa_and_the_deployment_omits_replicas(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env, *HPA_FLAGS, "--set", "autoscaling.maxReplicas=6")
    (hpa,) = by_kind(rendered, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment(rendered)["metadata"]["name"],
    }
    assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 6
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    assert "replicas" not in deployment(rendered)["spec"]


def test_without_autoscaling_the_deployment_sets_replicas(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env, "--set", "replicaCount=3")
    assert deployment(rendered)["spec"]["replicas"] == 3
    assert by_kind(rendered, "HorizontalPodAutoscaler") == []


def test_termination_grace_period_exceeds_drain_seconds(
    helm_env: dict[str, str],
) -> None:
    for drain in ("30", "120"):
        rendered = template(helm_env, "--set", f"server.drainSeconds={drain}")
        pod = deployment(rendered)["spec"]["template"]["spec"]
        assert env_of(rendered)["TOKENMILL_DRAIN_SECONDS"] == drain
        assert pod["terminationGracePeriodSeconds"] > int(drain)


def test_termination_grace_period_not_above_drain_seconds_is_rejected(
    helm_env: dict[str, str],
) -> None:
    stderr = template_error(
        helm_env,
        "--set",
        "server.drainSeconds=60",
        "--set",
        "terminationGracePeriodSeconds=60",
    )
    assert "must be greater than server.drainSeconds" in stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        pytest.param(
            ("--set-string", "gpu=two"),
            "gpu: Invalid type. Expected: integer",
            id="gpu-string",
        ),
        pytest.param(
            ("--set", "gpu=-1"),
            "gpu: Must be greater than or equal to 0",
            id="gpu-negative",
        ),
        pytest.param(
            ("--set-string", "autoscaling.enabled=yes"),
            "autoscaling.enabled: Invalid type",
            id="hpa-string",
        ),
        pytest.param(("--set", "server.device=tpu"), "server.device", id="unknown-device"),
        pytest.param(("--set", "server.kvCacheDtype=bfloat16"), "server.kvCacheDtype", id="unknown-kv-cache-dtype"),
        pytest.param(("--set", "server.speculativeTokens=-1"), "server.speculativeTokens", id="negative-drafts"),
        pytest.param(
            ("--set", "gpus=2"),
            "Additional property gpus is not allowed",
            id="misspelt-key",
        ),
    ],
)
def test_wrong_values_are_rejected_by_the_schema(
    helm_env: dict[str, str], flags: tuple[str, ...], message: str
) -> None:
    stderr = template_error(helm_env, *flags)
    assert "values don't meet the specifications of the schema" in stderr
    assert message in stderr


def test_pvc_model_source_mounts_the_claim_read_only_and_points_the_server_at_the_file(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env, *PVC_FLAGS)
    pod = deployment(rendered)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    assert volume["persistentVolumeClaim"]["claimName"] == "llm-models"
    mount = next(m for m in container(rendered)["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True
    assert mount["subPath"] == "smollm2"
    assert env_of(rendered)["TOKENMILL_MODEL"] == f"{mount['mountPath']}/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_pvc_model_source_without_a_claim_name_is_rejected(
    helm_env: dict[str, str],
) -> None:
    assert "model.pvc.claimName" in template_error(helm_env, "--set", "model.source=pvc")


def test_hostpath_model_source_mounts_the_node_directory(
    helm_env: dict[str, str],
) -> None:
    rendered = template(
        helm_env,
        "--set",
        "model.source=hostPath",
        "--set",
        "model.hostPath.path=/srv/models",
        "--set",
        "model.file=m",
    )
    pod = deployment(rendered)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if "hostPath" in v)
    assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}
    assert env_of(rendered)["TOKENMILL_MODEL"] == "/models/m"


def test_embedded_model_source_leaves_the_model_to_the_image_default(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env)
    assert "TOKENMILL_MODEL" not in env_of(rendered)
    pod = deployment(rendered)["spec"]["template"]["spec"]
    assert sorted(v["name"] for v in pod["volumes"]) == ["dshm", "tmp"]


def test_server_settings_reach_the_container_as_tokenmill_env_and_args(
    helm_env: dict[str, str],
) -> None:
    rendered = template(
        helm_env,
        "--set",
        "server.maxQueue=64",
        "--set",
        "server.maxBatchSize=4",
        "--set",
        "server.maxNewTokens=256",
        "--set",
        "server.kvCacheMemory=512MiB",
        "--set",
        "server.backend=triton",
        "--set",
        "server.quantization=int8",
        "--set",
        "server.kvCacheDtype=float16",
        "--set",
        "server.compile=auto",
        "--set",
        "server.speculativeTokens=0",
        "--set",
        "server.extraArgs={--max-queue,32}",
        "--set",
        "server.extraEnv[0].name=EXTRA",
        "--set",
        "server.extraEnv[0].value=1",
    )
    env = env_of(rendered)
    assert env["TOKENMILL_HOST"] == "0.0.0.0"
    assert env["TOKENMILL_PORT"] == "50051"
    assert env["TOKENMILL_MAX_QUEUE"] == "64"
    assert env["TOKENMILL_MAX_BATCH_SIZE"] == "4"
    assert env["TOKENMILL_MAX_BATCH_TOKENS"] == "512"
    assert env["TOKENMILL_LOG_LEVEL"] == "info"
    assert env["TOKENMILL_MAX_NEW_TOKENS_LIMIT"] == "256"
    assert env["TOKENMILL_KV_CACHE_MEMORY"] == "512MiB"
    assert env["TOKENMILL_BACKEND"] == "triton"
    assert env["TOKENMILL_QUANTIZATION"] == "int8"
    assert env["TOKENMILL_KV_CACHE_DTYPE"] == "float16"
    assert env["TOKENMILL_COMPILE"] == "auto"
    assert env["TOKENMILL_SPECULATIVE_TOKENS"] == "0"
    assert env["TOKENMILL_LOG_FORMAT"] == "json"
    assert env["TOKENMILL_METRICS_PORT"] == "9090"
    assert env["EXTRA"] == "1"
    assert container(rendered)["args"] == ["--max-queue", "32"]


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param((), id="defaults"),
        pytest.param(("--set", "gpu=2"), id="gpu-2"),
        pytest.param(PVC_FLAGS, id="pvc"),
    ],
)
def test_every_tokenmill_variable_the_chart_sets_is_a_valid_server_setting(
    helm_env: dict[str, str], flags: tuple[str, ...]
) -> None:
    from tokenmill_service.contract.config import Settings, env_name, load_settings

    env = {k: v for k, v in env_of(template(helm_env, *flags)).items() if k.startswith("TOKENMILL_")}
    known = {env_name(f) for f in Settings.__dataclass_fields__}
    assert set(env) <= known, f"unknown to tokenmill-server: {sorted(set(env) - known)}"
    settings = load_settings([], environ=env)  # parses and validates, as the server does at start
    assert settings.host == "0.0.0.0" and settings.port == 50051
    assert settings.metrics_port == 9090 and settings.log_format == "json"
    assert settings.device == ("cuda" if "gpu=2" in flags else "cpu")


def test_context_name_and_chat_template_reach_the_server(helm_env: dict[str, str], tmp_path: Path) -> None:
    from tokenmill_service.contract.config import load_settings

    defaults = env_of(template(helm_env))
    assert defaults["TOKENMILL_MAX_MODEL_LEN"] == "0"
    assert "TOKENMILL_SERVED_MODEL_NAME" not in defaults and "TOKENMILL_CHAT_TEMPLATE" not in defaults
    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump({"server": {"maxModelLen": 2048, "servedModelName": "smol", "chatTemplate": chat_template}})
    )
    rendered = template(helm_env, "-f", str(values))
    env = env_of(rendered)
    assert env["TOKENMILL_MAX_MODEL_LEN"] == "2048" and env["TOKENMILL_SERVED_MODEL_NAME"] == "smol"
    (config_map,) = [d for d in documents(rendered) if d["kind"] == "ConfigMap"]
    path = Path(env["TOKENMILL_CHAT_TEMPLATE"])
    assert config_map["data"] == {path.name: chat_template}
    pod = deployment(rendered)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in container(rendered)["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["mountPath"] == str(path.parent) and mount["readOnly"] is True
    assert "checksum/chat-template" in deployment(rendered)["spec"]["template"]["metadata"]["annotations"]
    # What the server makes of them (the template from a local copy of the file the pod would mount).
    local = tmp_path / path.name
    local.write_text(chat_template)
    settings = load_settings([], environ={**env, "TOKENMILL_CHAT_TEMPLATE": str(local)})
    assert (settings.max_model_len, settings.served_model_name) == (2048, "smol")
    assert settings.chat_template_source() == chat_template


def test_auth_token_comes_from_an_existing_secret_only_when_named(
    helm_env: dict[str, str],
) -> None:
    assert "TOKENMILL_AUTH_TOKEN" not in env_of(template(helm_env))
    rendered = template(helm_env, "--set", "server.authTokenSecret.name=tokenmill-auth")
    (item,) = [e for e in container(rendered)["env"] if e["name"] == "TOKENMILL_AUTH_TOKEN"]
    assert item == {
        "name": "TOKENMILL_AUTH_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "tokenmill-auth", "key": "token"}},
    }


def test_empty_kv_cache_memory_leaves_the_size_to_the_server(
    helm_env: dict[str, str],
) -> None:
    assert env_of(template(helm_env))["TOKENMILL_KV_CACHE_MEMORY"] == "1GiB"
    assert "TOKENMILL_KV_CACHE_MEMORY" not in env_of(template(helm_env, "--set", "server.kvCacheMemory="))


def test_pod_runs_non_root_with_a_read_only_root_filesystem_and_a_writable_tmp(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env)
    pod = deployment(rendered)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(rendered)["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    tmp = next(m for m in container(rendered)["volumeMounts"] if m["mountPath"] == "/tmp")
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp["name"])
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == by_kind(rendered, "ServiceAccount")[0]["metadata"]["name"]


def test_service_is_cluster_ip_with_grpc_and_metrics_ports(
    helm_env: dict[str, str],
) -> None:
    rendered = template(helm_env)
    service = cluster_service(rendered)
    assert service["spec"]["type"] == "ClusterIP"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 50051 and ports["grpc"]["targetPort"] == "grpc"
    assert ports["metrics"]["port"] == 9090 and ports["metrics"]["targetPort"] == "metrics"
    pod_labels = deployment(rendered)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_metrics_port_zero_drops_the_metrics_ports(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, "--set", "server.metricsPort=0")
    service = cluster_service(rendered)
    assert [p["name"] for p in service["spec"]["ports"]] == ["grpc", "http"]
    assert [p["name"] for p in container(rendered)["ports"]] == ["grpc", "http"]
    assert env_of(rendered)["TOKENMILL_METRICS_PORT"] == "0"


def test_the_openai_http_port_is_a_container_and_service_port(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, "--set", "server.httpPort=8080", "--set", "service.httpPort=80")
    service = cluster_service(rendered)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["http"]["port"] == 80 and ports["http"]["targetPort"] == "http"
    assert {p["name"]: p["containerPort"] for p in container(rendered)["ports"]}["http"] == 8080
    assert env_of(rendered)["TOKENMILL_HTTP_PORT"] == "8080"
    off = template(helm_env, "--set", "server.httpPort=0")
    assert "http" not in [p["name"] for p in by_kind(off, "Service")[0]["spec"]["ports"]]
    assert env_of(off)["TOKENMILL_HTTP_PORT"] == "0"


def test_pod_disruption_budget_selects_the_pods(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env)
    (pdb,) = by_kind(rendered, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment(rendered)["spec"]["selector"]["matchLabels"]


def test_servicemonitor_is_off_by_default_and_renders_when_enabled(
    helm_env: dict[str, str],
) -> None:
    assert by_kind(template(helm_env), "ServiceMonitor") == []
    rendered = template(
        helm_env,
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "serviceMonitor.labels.release=prom",
    )
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    # It selects both Services, but only the ClusterIP one has the metrics port: each pod is scraped once.
    services = by_kind(rendered, "Service")
    assert all(monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items() for s in services)
    assert [s["metadata"]["name"] for s in services if "metrics" in [p["name"] for p in s["spec"]["ports"]]] == [
        f"{RELEASE}-tokenmill"
    ]


def test_with_an_auth_token_the_service_monitor_sends_it_unless_metrics_are_left_open(
    helm_env: dict[str, str],
) -> None:
    secret = ("--set", "server.authTokenSecret.name=tokenmill-auth", "--set", "serviceMonitor.enabled=true")
    rendered = template(helm_env, *secret)
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "tokenmill-auth", "key": "token"}}
    assert env_of(rendered)["TOKENMILL_METRICS_WITHOUT_AUTH"] == "false"

    rendered = template(helm_env, *secret, "--set", "server.metricsWithoutAuth=true")
    (monitor,) = by_kind(rendered, "ServiceMonitor")
    assert "authorization" not in monitor["spec"]["endpoints"][0]
    assert env_of(rendered)["TOKENMILL_METRICS_WITHOUT_AUTH"] == "true"
    from tokenmill_service.contract.config import load_settings

    assert load_settings([], {"TOKENMILL_METRICS_WITHOUT_AUTH": "true"}).metrics_without_auth

    (monitor,) = by_kind(template(helm_env, "--set", "serviceMonitor.enabled=true"), "ServiceMonitor")
    assert "authorization" not in monitor["spec"]["endpoints"][0]  # no token, nothing to send


def test_scheduling_values_reach_the_pod(helm_env: dict[str, str]) -> None:
    rendered = template(
        helm_env,
        *GPU_FLAGS,
        "--set-string",
        "nodeSelector.nvidia\\.com/gpu\\.present=true",
        "--set",
        "tolerations[0].key=nvidia.com/gpu",
        "--set",
        "tolerations[0].operator=Exists",
        "--set",
        "tolerations[0].effect=NoSchedule",
    )
    pod = deployment(rendered)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def test_notes_tell_how_to_call_the_service_with_grpcurl_and_tokenmill_client(
    helm_env: dict[str, str], tmp_path: Path
) -> None:
    # helm template does not render NOTES.txt: render it as a named template in a copy of the chart.
    chart = tmp_path / "tokenmill"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text('{{- define "test.notes" -}}\n' + notes + "{{- end }}\n")
    (chart / "templates" / "notes.yaml").write_text('notes: {{ include "test.notes" . | toJson }}\n')
    rendered = template(helm_env, "--show-only", "templates/notes.yaml", chart=chart)
    text = yaml.safe_load(rendered)["notes"]
    assert f"port-forward svc/{RELEASE}-tokenmill 50051:50051" in text
    assert "grpcurl -plaintext" in text and "grpc.health.v1.Health/Check" in text
    assert "tokenmill.v1.Generation/Generate" in text
    assert "tokenmill-client" in text


def _values_leaves(values: dict[str, Any], documented: set[str], prefix: str = "") -> dict[str, Any]:
    leaves: dict[str, Any] = {}
    for key, value in values.items():
        path = prefix + key
        if isinstance(value, dict) and value and path not in documented:
            leaves.update(_values_leaves(value, documented, path + "."))
        else:
            leaves[path] = value
    return leaves


def test_readme_values_table_matches_values_yaml() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = re.findall(
        r"^\| `([^`]+)` \| [^|]+ \| `(.*)` \| .+ \|$",
        (CHART / "README.md").read_text(),
        re.MULTILINE,
    )
    table = {key: json.loads(default) for key, default in rows}
    assert table, "README.md has no values table"
    assert _values_leaves(values, set(table)) == table


def test_values_schema_accepts_the_default_values_keys() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    assert {"gpu", "tensorParallel", "autoscaling"} <= set(values)
    assert values["gpu"] == 0 and values["tensorParallel"] == 1 and values["autoscaling"]["enabled"] is False


def test_tls_mounts_the_certificate_secret_and_probes_use_the_plaintext_health_port(
    helm_env: dict[str, str],
) -> None:
    plain = template(helm_env)
    assert "TOKENMILL_TLS_CERT" not in env_of(plain)
    assert container(plain)["readinessProbe"]["grpc"]["port"] == 50051
    rendered = template(helm_env, *TLS_FLAGS)
    env = env_of(rendered)
    assert env["TOKENMILL_TLS_CERT"] == "/etc/tokenmill/tls/tls.crt"
    assert env["TOKENMILL_TLS_KEY"] == "/etc/tokenmill/tls/tls.key"
    assert env["TOKENMILL_TLS_CLIENT_CA"] == "/etc/tokenmill/tls/ca.crt"
    assert env["TOKENMILL_HEALTH_PORT"] == "50052"
    c = container(rendered)
    assert {"name": "tls", "mountPath": "/etc/tokenmill/tls", "readOnly": True} in c["volumeMounts"]
    volumes = deployment(rendered)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "tls", "secret": {"secretName": "tokenmill-tls"}} in volumes
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == 50052
