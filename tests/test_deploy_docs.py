"""docs/deploy/*.yaml: the example Kubernetes manifests parse, and what they tell the proxy
holds (its arguments and cluster file pass the proxy's own parser and checks).

PyYAML is not a dependency, so the manifests are written in the strict subset of YAML
that yaml_subset.py reads; anything outside the subset is an error, so a manifest that
passes is valid YAML that means what the test read.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from yaml_subset import YamlError, load_all

from epd_proxy.cli import build_parser
from epd_proxy.cluster_file import read_cluster_file
from epd_proxy.serve_command import ServeSettings, file_options

DEPLOY = pathlib.Path(__file__).resolve().parents[1] / "docs" / "deploy"
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
    assert {p.name for p in MANIFESTS} >= {"instances.yaml", "proxy-dns.yaml", "proxy-registration.yaml"}


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

