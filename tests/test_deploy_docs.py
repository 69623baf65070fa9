"""docs/deploy/*.yaml: the example Kubernetes manifests parse, and what they tell the proxy
holds (its arguments and cluster file pass the proxy's own parser and checks).

PyYAML is not a dependency, so the manifests are written in the strict subset of YAML
that yaml_subset.py reads; anything outside the subset is an error, so a manifest that
passes is valid YAML that means what the test read.
"""

from __future__ import annotations

import json
import pathlib
import re
import tomllib

import pytest
from yaml_subset import YamlError, load_all

from epd_proxy.cli import build_parser
from epd_proxy.cli.cluster_file import read_cluster_file
from epd_proxy.cli.serve import ServeSettings, file_options

REPO = pathlib.Path(__file__).resolve().parents[1]
DEPLOY = REPO / "docs" / "deploy"
ALERTS = REPO / "docs" / "monitoring" / "alerts.yaml"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))


# -- the parser itself ----------------------------------------------------------------------
def test_the_subset_parser_reads_what_yaml_means_and_rejects_the_rest():
    docs = load_all("a: 1\nb:\n  - x\n  - k: 'it''s'\n    v: [1, \"two\"]\nc: |\n  line 1\n  line 2\n---\nd: null\n")
    assert docs == [{"a": 1, "b": ["x", {"k": "it's", "v": [1, "two"]}], "c": "line 1\nline 2\n"}, {"d": None}]
    for bad in ["a: 1\na: 2", "a:\n\tb: 1", "a: b: c", "a: 1\n   b: 2", "a: [1,"]:
        with pytest.raises(YamlError):
            load_all(bad)


# -- the manifests ----------------------------------------------------------------------------
def _docs():
    return [(path.name, doc) for path in MANIFESTS for doc in load_all(path.read_text())]


def test_there_are_manifests():
    assert {p.name for p in MANIFESTS} >= {"instances.yaml", "proxy-dns.yaml", "proxy-registration.yaml",
                                           "monitoring.yaml"}


@pytest.mark.parametrize("name, doc", _docs(), ids=lambda v: v if isinstance(v, str) else "")
def test_each_object_is_well_formed(name, doc):
    assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), name
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"] == "llm"


def _proxy_containers():
    for name, doc in _docs():
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] == "epd-proxy":
            yield name, doc["spec"]["template"]["spec"], doc["spec"]["template"]["spec"]["containers"][0]


def test_every_proxy_pod_takes_its_arguments_ready_probe_and_termination_time():
    found = list(_proxy_containers())
    assert len(found) == 2
    for name, pod, container in found:
        args = [re.sub(r"\$\((\w+)\)", "from-env", a) for a in container["args"]]
        parsed = build_parser().parse_args(args)  # exits (SystemExit) on an unknown flag
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        # Kubernetes kills at terminationGracePeriodSeconds: the proxy must have ended its streams by then.
        assert pod["terminationGracePeriodSeconds"] > parsed.shutdown_timeout, name


def test_the_dns_cluster_file_passes_check_config(tmp_path):
    (config_map,) = [doc for name, doc in _docs() if doc["kind"] == "ConfigMap"]
    text = config_map["data"]["cluster.toml"]
    values = read_cluster_file(text, file_options())
    assert all(v.startswith("dns+http://") for role in ("encode", "prefill", "decode") for v in values[role])
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    argv = ["serve", "--config", str(path)]
    cfg = ServeSettings(argv, build_parser().parse_args(argv)).config()
    assert {s.role for s in cfg.discover} == {"encode", "prefill", "decode"}


def test_the_proxy_finds_the_headless_services_the_manifests_define():
    services = {doc["metadata"]["name"]: doc for _, doc in _docs() if doc["kind"] == "Service"}
    (config_map,) = [doc for _, doc in _docs() if doc["kind"] == "ConfigMap"]
    names = re.findall(r"dns\+http://([a-z0-9-]+)\.llm\.svc\.cluster\.local:(\d+)", config_map["data"]["cluster.toml"])
    assert len(names) == 3
    for name, port in names:
        spec = services[name]["spec"]
        assert spec["clusterIP"] == "None" and int(port) in [p["port"] for p in spec["ports"]]


def test_the_proxy_image_is_the_one_the_dockerfile_builds_at_this_version():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["epd-proxy"\]$', dockerfile, re.M)
    for name, _, container in _proxy_containers():
        assert container["image"] == f"epd-proxy:{version}", name
        assert "command" not in container, f"{name}: the image's ENTRYPOINT is epd-proxy"
        assert container["securityContext"]["runAsNonRoot"] is True


# -- the vLLM instances -------------------------------------------------------------------
def _instances() -> dict[str, dict]:
    """role -> the pod template of its Deployment."""
    out = {}
    for name, doc in _docs():
        if name == "instances.yaml" and doc["kind"] == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"] == labels
            out[labels["role"]] = doc["spec"]["template"]["spec"]
    return out


def _flag(args: list[str], flag: str):
    return args[args.index(flag) + 1] if flag in args else None


def test_every_role_has_a_deployment_its_headless_service_selects():
    services = {doc["metadata"]["name"]: doc["spec"] for name, doc in _docs()
                if name == "instances.yaml" and doc["kind"] == "Service"}
    pods = _instances()
    assert set(pods) == {"encode", "prefill", "decode"}
    for role, pod in pods.items():
        spec = services[f"vllm-{role}"]
        assert spec["clusterIP"] == "None" and spec["selector"] == {"app": "vllm", "role": role}
        port = spec["ports"][0]["port"]
        assert port in [p["containerPort"] for p in pod["containers"][0]["ports"]]
        assert _flag(pod["containers"][0]["args"], "--port") == str(port)


def test_each_role_gets_its_connector_roles():
    pods = _instances()
    args = {role: pod["containers"][0]["args"] for role, pod in pods.items()}
    kv = {role: json.loads(_flag(a, "--kv-transfer-config") or "null") for role, a in args.items()}
    ec = {role: json.loads(_flag(a, "--ec-transfer-config") or "null") for role, a in args.items()}
    # E+P+D: encode writes encoder outputs, prefill reads them and produces the KV, decode consumes it.
    assert kv["encode"] is None
    assert (kv["prefill"]["kv_connector"], kv["prefill"]["kv_role"]) == ("NixlConnector", "kv_producer")
    assert (kv["decode"]["kv_connector"], kv["decode"]["kv_role"]) == ("NixlConnector", "kv_consumer")
    assert (ec["encode"]["ec_connector"], ec["encode"]["ec_role"]) == ("ECExampleConnector", "ec_producer")
    assert (ec["prefill"]["ec_connector"], ec["prefill"]["ec_role"]) == ("ECExampleConnector", "ec_consumer")
    assert ec["decode"] is None
    assert "--no-enable-prefix-caching" in args["encode"]  # as vLLM's EPD examples run encoders
    # One model everywhere (the positional argument).
    assert len({a[0] for a in args.values()}) == 1 and not args["encode"][0].startswith("-")


def test_encoders_and_their_consumers_share_the_ec_storage_on_a_read_write_many_volume():
    (claim,) = [doc for name, doc in _docs() if doc["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for role in ("encode", "prefill"):
        pod = _instances()[role]
        container = pod["containers"][0]
        path = json.loads(_flag(container["args"], "--ec-transfer-config"))["ec_connector_extra_config"][
            "shared_storage_path"]
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"], role


def test_prefill_and_decode_advertise_their_pod_ip_for_the_nixl_side_channel():
    for role in ("prefill", "decode"):
        container = _instances()[role]["containers"][0]
        env = {e["name"]: e for e in container["env"]}
        host = env["VLLM_NIXL_SIDE_CHANNEL_HOST"]
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", role
        port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert port in [p["containerPort"] for p in container["ports"]], role


def test_every_vllm_container_is_probed_on_health():
    for role, pod in _instances().items():
        container = pod["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/health" and ports.get(get["port"], get["port"]) == 8000, (role, probe)
        # The startup probe covers loading the model; liveness does not kill a loading engine.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, role
        assert container["resources"]["limits"], role


# -- disruption budget and monitoring ------------------------------------------------------
def _by_file(kind: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for name, doc in _docs():
        if doc["kind"] == kind:
            out.setdefault(name, []).append(doc)
    return out


def _selects(selector: dict, labels: dict | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def test_each_proxy_variant_has_a_disruption_budget_that_selects_its_pods():
    budgets = _by_file("PodDisruptionBudget")
    for name, doc in _docs():
        if doc["kind"] in ("Deployment", "StatefulSet") and doc["metadata"]["name"] == "epd-proxy":
            (pdb,) = budgets[name]
            assert _selects(doc["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])
            assert _selects(pdb["spec"]["selector"]["matchLabels"], doc["spec"]["template"]["metadata"]["labels"])
            assert pdb["spec"]["maxUnavailable"] < doc["spec"]["replicas"], name


def test_the_service_monitor_scrapes_the_proxy_service_once_per_pod():
    (monitor,) = _by_file("ServiceMonitor")["monitoring.yaml"]
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == ["llm"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert "jobLabel" not in monitor["spec"]  # the job is the Service's name: what the alerts select
    for name, services in _by_file("Service").items():
        if name not in ("proxy-dns.yaml", "proxy-registration.yaml"):
            continue
        # Exactly one Service per variant: a second (epd-proxy-peers) would scrape every pod twice.
        (service,) = [s for s in services if _selects(monitor["spec"]["selector"]["matchLabels"],
                                                      s["metadata"].get("labels"))]
        assert service["metadata"]["name"] == "epd-proxy"
        assert f'job="{service["metadata"]["name"]}"' in ALERTS.read_text()
        assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
        assert service["spec"]["selector"] == {"app": "epd-proxy"}


def test_the_prometheus_rule_carries_the_alert_rules_file_unchanged():
    (rule,) = _by_file("PrometheusRule")["monitoring.yaml"]
    (plain,) = load_all(ALERTS.read_text())
    assert set(plain) == {"groups"}
    assert rule["spec"] == {"groups": plain["groups"]}
    assert len(plain["groups"][0]["rules"]) >= 8
