"""The chart on Kubernetes' inference stack: the headless Service for gRPC clients, the Gateway API
Inference Extension (InferencePool, endpoint picker, HTTPRoute), KEDA on queue depth and a
LeaderWorkerSet, rendered by `helm template` and validated offline: built-in kinds by
kubernetes-validate, the custom resources against the upstream CRDs' schemas vendored in
tests/deploy/crd_schemas (scripts/vendor_crd_schemas.py; each names its release in `$comment`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.test_helm_chart import (
    CHART,
    assert_valid_kubernetes,
    by_kind,
    documents,
    template,
    template_error,
)

SCHEMAS = Path(__file__).parent / "crd_schemas"
# The releases the vendored schemas come from (each schema's $comment says it too).
RELEASES = {
    "InferencePool": "kubernetes-sigs/gateway-api-inference-extension v1.3.0",
    "HTTPRoute": "kubernetes-sigs/gateway-api v1.6.1",
    "ScaledObject": "kedacore/keda v2.20.2",
    "LeaderWorkerSet": "kubernetes-sigs/lws v0.10.0",
}
STACK = (
    "--set",
    "inferencePool.enabled=true",
    "--set",
    "keda.enabled=true",
    "--set",
    "leaderWorkerSet.enabled=true",
    "--set",
    "serviceMonitor.enabled=true",
)


def crd_schema(doc: dict[str, Any]) -> dict[str, Any]:
    group, version = doc["apiVersion"].split("/")
    return json.loads((SCHEMAS / f"{group}_{doc['kind']}_{version}.json").read_text())


def crd_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(crd_schema(doc))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def assert_valid(rendered: str, tmp_path: Path) -> list[str]:
    """Every document valid: custom resources against their CRD's schema, the rest by kubernetes-validate.
    Returns the custom kinds checked."""
    docs = documents(rendered)
    custom = [d for d in docs if d["kind"] in RELEASES]
    for doc in custom:
        assert crd_errors(doc) == [], (doc["kind"], crd_errors(doc))
    builtin = [d for d in docs if d["kind"] not in RELEASES and d["kind"] != "ServiceMonitor"]
    assert_valid_kubernetes(yaml.safe_dump_all(builtin), tmp_path)
    return sorted(d["kind"] for d in custom)


def test_the_vendored_schemas_name_their_upstream_releases() -> None:
    for kind, release in RELEASES.items():
        (schema,) = [json.loads(p.read_text()) for p in SCHEMAS.glob(f"*_{kind}_*.json")]
        assert schema["$comment"].startswith(f"{kind} ") and release in schema["$comment"]
        assert release.split()[-1] in (CHART / "README.md").read_text(), f"the chart's README names {release}"


def test_gateway_keda_and_lws_render_and_validate_against_the_upstream_crds(
    helm_env: dict[str, str], tmp_path: Path
) -> None:
    rendered = template(helm_env, *STACK)
    assert assert_valid(rendered, tmp_path) == sorted(RELEASES)
    # The LeaderWorkerSet replaces the Deployment; the only Deployment left is the endpoint picker's.
    (picker,) = by_kind(rendered, "Deployment")
    assert picker["metadata"]["name"] == "tm-tokenmill-epp"


def test_the_schemas_catch_what_the_api_server_would_refuse(helm_env: dict[str, str]) -> None:
    docs = {d["kind"]: d for d in documents(template(helm_env, *STACK))}
    pool = json.loads(json.dumps(docs["InferencePool"]))
    pool["spec"]["targetPorts"] = [{"number": 70000}]
    assert any("targetPorts" in e for e in crd_errors(pool))
    lws = json.loads(json.dumps(docs["LeaderWorkerSet"]))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    assert any("imagePullPolcy" in e for e in crd_errors(lws))
    scaled = json.loads(json.dumps(docs["ScaledObject"]))
    del scaled["spec"]["scaleTargetRef"]["name"]
    assert crd_errors(scaled)


def test_the_inference_pool_serves_the_server_pods_on_the_http_port(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, "--set", "inferencePool.enabled=true")
    (pool,) = by_kind(rendered, "InferencePool")
    deployments = {d["metadata"]["name"]: d for d in by_kind(rendered, "Deployment")}
    server, picker = deployments["tm-tokenmill"], deployments["tm-tokenmill-epp"]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    http = next(p for p in server["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    # The picker is told the pool, answers on the port the pool names, through its Service.
    args = picker["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    assert args[args.index("--pool-namespace") + 1] == "serving"
    ref = pool["spec"]["endpointPickerRef"]
    (service,) = [s for s in by_kind(rendered, "Service") if s["metadata"]["name"] == ref["name"]]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (route,) = by_kind(rendered, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def test_keda_scales_the_pods_on_the_requests_waiting(helm_env: dict[str, str]) -> None:
    rendered = template(helm_env, "--set", "keda.enabled=true", "--set", "keda.threshold=8")
    (scaled,) = by_kind(rendered, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tm-tokenmill"}
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "8"
    assert trigger["metadata"]["query"] == 'sum(tokenmill_queue_size{namespace="serving", service="tm-tokenmill"})'
    (server,) = by_kind(rendered, "Deployment")
    assert "replicas" not in server["spec"]  # the autoscaler owns the count
    lws = template(helm_env, "--set", "keda.enabled=true", "--set", "leaderWorkerSet.enabled=true")
    (scaled,) = by_kind(lws, "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"
    assert "replicas" not in by_kind(lws, "LeaderWorkerSet")[0]["spec"]


def test_the_leader_worker_set_runs_the_server_pod_and_restarts_groups_whole(helm_env: dict[str, str]) -> None:
    plain = template(helm_env)
    rendered = template(helm_env, "--set", "leaderWorkerSet.enabled=true", "--set", "replicaCount=3")
    assert by_kind(rendered, "Deployment") == []
    (lws,) = by_kind(rendered, "LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 1 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert group["workerTemplate"] == by_kind(plain, "Deployment")[0]["spec"]["template"]


def test_the_headless_service_resolves_to_every_pod_for_grpc_round_robin(helm_env: dict[str, str]) -> None:
    services = {s["metadata"]["name"]: s for s in by_kind(template(helm_env), "Service")}
    headless, cluster = services["tm-tokenmill-headless"], services["tm-tokenmill"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == cluster["spec"]["selector"]
    assert [p["name"] for p in headless["spec"]["ports"]] == ["grpc", "http"]  # no metrics: scraped once
    off = template(helm_env, "--set", "service.headless.enabled=false")
    assert [s["metadata"]["name"] for s in by_kind(off, "Service")] == ["tm-tokenmill"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--set", "keda.enabled=true", "--set", "autoscaling.enabled=true"), "set only one of autoscaling.enabled"),
        (
            ("--set", "leaderWorkerSet.enabled=true", "--set", "leaderWorkerSet.size=2"),
            "tensorParallel must be at least 2",
        ),
        (
            ("--set", "leaderWorkerSet.enabled=true", "--set", "leaderWorkerSet.size=2", "--set", "gpu=1")
            + ("--set", "tensorParallel=3"),
            "size must divide tensorParallel",
        ),
        (("--set", "inferencePool.enabled=true", "--set", "server.httpPort=0"), "inferencePool.enabled needs"),
        (("--set", "inferencePool.endpointPicker.failureMode=Sometimes"), "failureMode"),
    ],
)
def test_combinations_that_cannot_work_are_refused_with_a_reason(
    helm_env: dict[str, str], flags: tuple[str, ...], message: str
) -> None:
    assert message in template_error(helm_env, *flags)


def test_a_group_of_pods_runs_one_replica_over_them(helm_env: dict[str, str], tmp_path: Path) -> None:
    from tokenmill_service.contract.config import load_settings

    flags = ("--set", "leaderWorkerSet.enabled=true", "--set", "leaderWorkerSet.size=2", "--set", "tensorParallel=3")
    rendered = template(helm_env, *flags, "--set", "inferencePool.enabled=true")
    assert "LeaderWorkerSet" in assert_valid(rendered, tmp_path)
    (lws,) = by_kind(rendered, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2
    (leader,) = group["leaderTemplate"]["spec"]["containers"]
    (worker,) = group["workerTemplate"]["spec"]["containers"]
    # The leader serves and is probed; the other pod runs its rank only.
    assert {"startupProbe", "readinessProbe", "livenessProbe", "ports"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe", "ports"} & set(worker)
    assert worker["env"] == leader["env"] and worker["image"] == leader["image"]
    # What the server makes of each pod's environment once LWS adds its variables.
    env = {e["name"]: e["value"] for e in leader["env"] if "value" in e and e["name"].startswith("TOKENMILL_")}
    lws_env = {"LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": "tm-tokenmill-0.tm-tokenmill.serving"}
    node0 = load_settings([], {**env, **lws_env, "LWS_WORKER_INDEX": "0"})
    node1 = load_settings([], {**env, **lws_env, "LWS_WORKER_INDEX": "1"})
    assert (node0.nnodes, node0.node_rank, node0.node_ranks()) == (2, 0, [0, 1])
    assert (node1.node_rank, node1.node_ranks(), node1.master_addr) == (1, [2], "tm-tokenmill-0.tm-tokenmill.serving")
    assert node0.resolved_workers() == 1 and node0.resolved_master_port() == 29500
    # Only leaders take traffic.
    for service in by_kind(rendered, "Service"):
        if "epp" not in service["metadata"]["name"]:
            assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    (pool,) = by_kind(rendered, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
