"""Static checks of the deployment files under ops/: they parse, the probes point at the
right endpoints, and alerts and dashboards only use metrics a running gateway exports.

`yaml` (PyYAML) is needed for everything but the JSON checks; it is skipped only when it is not
installed. promtool checks run when promtool is on PATH (Debian package `prometheus`).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

OPS = Path(__file__).resolve().parents[2] / "ops"

NOT_YET_EXPORTED = {"svc_deliveries_pending"}
"""Named by a rule and a panel ahead of the delivery subsystem, both marked as such; nothing
else the ops files name may be missing from /metrics."""
PROMETHEUS_OWN = {"up"}


@pytest.fixture
async def exported(database_url: str) -> set[str]:
    """Every metric a gateway exports, read from the `# TYPE` lines of its real /metrics
    (labelled counters show there before their first sample)."""
    from aiohttp.test_utils import TestServer

    from gateway.app import create_app
    from gateway.settings import Settings

    server = TestServer(create_app(Settings({"SVC_DATABASE_URL": database_url})), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(server.make_url("/metrics")) as resp:
                assert resp.status == 200
                text = await resp.text()
    finally:
        await server.close()
    return set(re.findall(r"^# TYPE (\S+) ", text, re.M))


HISTOGRAMS = {"svc_store_append_seconds", "svc_turn_duration_seconds"}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")

PROMQL_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "bool", "offset", "inf", "nan",
}  # fmt: skip


def _yaml() -> Any:
    return pytest.importorskip("yaml")


def _yaml_files() -> list[Path]:
    return sorted(p for p in OPS.rglob("*") if p.suffix in {".yaml", ".yml"})


def _load_yaml(path: Path) -> list[Any]:
    return [doc for doc in _yaml().safe_load_all(path.read_text()) if doc is not None]


def _one_yaml(path: Path) -> Any:
    (doc,) = _load_yaml(path)
    return doc


def _dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((OPS / "grafana" / "svc-dashboard.json").read_text())
    return data


def _rules() -> list[dict[str, Any]]:
    doc = _one_yaml(OPS / "prometheus" / "svc-rules.yaml")
    return [rule for group in doc["groups"] for rule in group["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names, durations or grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    grouping = r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    expr = re.sub(grouping, "", expr)
    expr = re.sub(r"\$\w+", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        name, is_call = match.group(1), match.group(2)
        if is_call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def _base_name(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        base = name.removesuffix(suffix)
        if base != name and base in HISTOGRAMS:
            return base
    return name


def test_metric_names_parser() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(svc_turn_duration_seconds_bucket{le!="x"}'
        '[5m]))) > 60 and on (instance) up{job="svc-gateway"} == 0'
    )
    assert metric_names(expr) == {"svc_turn_duration_seconds_bucket", "up"}


def test_every_yaml_file_parses() -> None:
    files = _yaml_files()
    assert len(files) >= 8, files
    for path in files:
        assert _load_yaml(path), f"{path} is empty"


def test_every_json_file_parses() -> None:
    files = sorted(OPS.rglob("*.json"))
    assert files
    for path in files:
        json.loads(path.read_text())


def test_dockerfile_runs_svc_as_non_root_with_healthz_check() -> None:
    text = (OPS / "docker" / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", text, re.M)
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert re.search(r"^USER 10001", text, re.M)
    assert re.search(r"^EXPOSE 8780$", text, re.M)
    healthcheck = re.search(r"^HEALTHCHECK .*?(?<!\\)$", text, re.M | re.S)
    assert healthcheck and "/healthz" in healthcheck.group(0)
    assert 'ENTRYPOINT ["svc"]' in text and 'CMD ["serve"]' in text


def test_dockerignore_note_matches_live_ignore_file() -> None:
    def patterns(name: str) -> list[str]:
        lines = (OPS / "docker" / name).read_text().splitlines()
        return [line for line in lines if line.strip() and not line.startswith("#")]

    live = patterns("Dockerfile.dockerignore")
    assert patterns(".dockerignore") == live
    assert ".svc" in live and ".git" in live  # a live database and history stay out
    # `pip install .` needs these, and the Dockerfile copies svc-ray-node.sh.
    needed = [
        "pyproject.toml",
        "README.md",
        "gateway",
        "actors",
        "eventstore",
        "projections",
        "schemas",
    ]
    excluded = [p for p in live if not p.startswith("!")]
    for path in needed:
        assert not any(fnmatch.fnmatch(path, pattern) for pattern in excluded), path
    assert "!ops/docker/svc-ray-node.sh" in live


def test_compose_stack() -> None:
    compose = _one_yaml(OPS / "docker" / "compose.yaml")
    services = compose["services"]
    assert {"postgres", "migrate", "ray-head", "ray-worker", "gateway"} <= set(services)

    postgres = services["postgres"]
    assert int(postgres["image"].split(":")[1].split("-")[0]) >= 16
    settings = " ".join(postgres["command"])
    for durable in ("fsync=on", "synchronous_commit=on", "full_page_writes=on"):
        assert durable in settings
    assert "idle_in_transaction_session_timeout" in settings

    head = services["ray-head"]
    assert head["entrypoint"] == ["ray"]
    assert {"start", "--head", "--block"} <= set(head["command"])
    worker = services["ray-worker"]
    assert worker["deploy"]["replicas"] == 2
    assert "--address=ray-head:6379" in worker["command"]

    gateway = services["gateway"]
    env = gateway["environment"]
    assert env["SVC_ACTOR_RUNTIME"] == "ray"
    assert env["SVC_RAY_HEAD"] == "ray-head:6379"
    assert env["SVC_DATABASE_URL"].startswith("postgresql://")
    assert "8780:8780" in gateway["ports"]
    conditions = {name: dep["condition"] for name, dep in gateway["depends_on"].items()}
    assert conditions == {
        "postgres": "service_healthy",
        "migrate": "service_completed_successfully",
        "ray-head": "service_healthy",
        "ray-worker": "service_healthy",
    }
    for name in ("postgres", "ray-head", "ray-worker"):
        assert services[name]["healthcheck"]["test"], name


def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in (OPS / "kubernetes").glob("*.yaml"):
        for doc in _load_yaml(path):
            if "kind" in doc and "metadata" in doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_gateway_probes_and_security() -> None:
    objects = _k8s_objects()
    deployment = objects[("Deployment", "svc-gateway")]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["resources"]["requests"] and container["resources"]["limits"]
    refs = {next(iter(ref.values()))["name"] for ref in container["envFrom"]}
    assert refs == {"svc-settings", "svc-secrets"}

    config = objects[("ConfigMap", "svc-settings")]["data"]
    assert "SVC_DATABASE_URL" not in config
    assert config["SVC_ACTOR_RUNTIME"] == "ray"
    assert config["SVC_RAY_HEAD"] == "svc-ray-head-svc:6379"
    assert "SVC_DATABASE_URL" in objects[("Secret", "svc-secrets")]["stringData"]
    service = objects[("Service", "svc-gateway")]
    assert service["spec"]["ports"][0]["port"] == 8780


def test_raycluster() -> None:
    cluster = _k8s_objects()[("RayCluster", "svc-ray")]
    assert cluster["apiVersion"] == "ray.io/v1"
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["resources"]["limits"]
    # Field names of KubeRay's ray.io/v1 RayClusterSpec (ray-operator/apis/ray/v1).
    assert set(spec) <= {
        "headGroupSpec", "workerGroupSpecs", "rayVersion", "enableInTreeAutoscaling",
        "autoscalerOptions", "headServiceAnnotations", "suspend",
    }  # fmt: skip
    assert set(spec["autoscalerOptions"]) <= {
        "resources", "image", "imagePullPolicy", "env", "envFrom", "volumeMounts",
        "securityContext", "idleTimeoutSeconds", "upscalingMode",
    }  # fmt: skip
    assert set(spec["headGroupSpec"]) <= {
        "serviceType", "headService", "enableIngress", "rayStartParams", "template",
    }  # fmt: skip
    (group,) = spec["workerGroupSpecs"]
    assert set(group) <= {
        "groupName", "replicas", "minReplicas", "maxReplicas", "numOfHosts", "rayStartParams",
        "template", "scaleStrategy",
    }  # fmt: skip
    # KubeRay's default probes call wget, which the slim image lacks: ours must be explicit.
    for pod in (spec["headGroupSpec"]["template"], group["template"]):
        (container,) = pod["spec"]["containers"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert "wget" not in json.dumps(container[probe])
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]
    for container in (head, worker):
        refs = {next(iter(ref.values()))["name"] for ref in container["envFrom"]}
        # The ConfigMap only: hosts get the database URL and model keys from the gateway, and
        # a pod that reaches Ray's unauthenticated head must not find the secrets in it.
        assert refs == {"svc-settings"}


def test_kustomization_lists_every_manifest_but_the_secrets_example() -> None:
    """The Secret is created from a secret manager: an apply that carried the example would
    overwrite the real database URL with a placeholder."""
    kustomization = _one_yaml(OPS / "kubernetes" / "kustomization.yaml")
    manifests = {
        p.name
        for p in (OPS / "kubernetes").glob("*.yaml")
        if p.name not in ("kustomization.yaml", "secret.example.yaml")
    }
    assert set(kustomization["resources"]) == manifests
    applied = [doc for name in manifests for doc in _load_yaml(OPS / "kubernetes" / name)]
    assert not [doc for doc in applied if doc.get("kind") == "Secret"]


def test_only_the_namespaces_pods_reach_the_ray_pods() -> None:
    policy = _k8s_objects()[("NetworkPolicy", "svc-ray-same-namespace-only")]["spec"]
    assert policy["podSelector"] == {"matchLabels": {"ray.io/cluster": "svc-ray"}}
    assert policy["ingress"] == [{"from": [{"podSelector": {}}]}, {"ports": [{"port": 8080}]}]


def test_every_alert_has_a_runbook() -> None:
    alerts = [rule for rule in _rules() if "alert" in rule]
    names = {rule["alert"] for rule in alerts}
    expected = {
        "SvcTurnLatencyHigh",
        "SvcTurnErrorRateHigh",
        "SvcDeliveriesPendingRising",
        "SvcProjectionLagEvents",
        "SvcProjectionLagSeconds",
        "SvcOldestOpenTransactionOld",
        "SvcNotReady",
        "SvcDbPoolExhausted",
        "SvcProjectionStalled",
    }
    assert expected <= names
    operations = (OPS.parent / "docs" / "operations.md").read_text()
    headings = {
        re.sub(r"[^\w-]", "", heading.strip().lower().replace(" ", "-"))
        for heading in re.findall(r"^#+ (.*)$", operations, re.M)
    }
    for rule in alerts:
        annotations = rule["annotations"]
        assert annotations["summary"] and annotations["description"], rule["alert"]
        anchor = re.search(r"docs/operations\.md#([\w-]+)", annotations["description"])
        assert anchor, f"{rule['alert']} names no runbook"
        assert anchor.group(1) in headings, f"{rule['alert']}: no heading for {anchor.group(1)}"


def test_alert_rules_use_exported_metrics_only(exported: set[str]) -> None:
    rules = _rules()
    recorded = {rule["record"] for rule in rules if "record" in rule}
    known = exported | recorded | PROMETHEUS_OWN | NOT_YET_EXPORTED
    for rule in rules:
        for name in metric_names(rule["expr"]):
            assert _base_name(name) in known, (rule.get("alert"), name)


def test_dashboard_uses_exported_metrics_only(exported: set[str]) -> None:
    dashboard = _dashboard()
    assert dashboard["schemaVersion"] >= 39
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 15
    used = set()
    for expr in exprs:
        used |= {_base_name(name) for name in metric_names(expr)}
    known = exported | PROMETHEUS_OWN | NOT_YET_EXPORTED
    assert used <= known, used - known
    for metric in (
        "svc_turn_duration_seconds",
        "svc_turn_errors_total",
        "svc_projection_lag_events",
        "svc_projection_lag_seconds",
        "svc_store_oldest_open_tx_age_seconds",
        "svc_store_append_seconds",
        "svc_db_pool_connections",
        "svc_actor_active",
        "svc_ready",
    ):
        assert metric in used, metric
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package `prometheus`)")
    return promtool


def test_promtool_check_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(OPS / "prometheus" / "svc-rules.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_rule_unit_tests(tmp_path: Path) -> None:
    """Runs ops/prometheus/svc-rules.test.yaml. promtool compares annotations verbatim, so the
    rules are copied without them: the tests are about when each alert fires."""
    promtool = _promtool()
    yaml = _yaml()
    rules = _one_yaml(OPS / "prometheus" / "svc-rules.yaml")
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "svc-rules.yaml").write_text(yaml.safe_dump(rules))
    shutil.copy(OPS / "prometheus" / "svc-rules.test.yaml", tmp_path / "svc-rules.test.yaml")
    result = subprocess.run(
        [promtool, "test", "rules", "svc-rules.test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
