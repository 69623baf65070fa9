"""docs/deploy/gateway.yaml: the InferencePool, the endpoint picker's Deployment and Service, and
the Envoy Gateway wiring fit together, and the picker's arguments pass its own parser."""

from __future__ import annotations

import pathlib

from yaml_subset import load_all

from epd_proxy.cli import build_parser

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "docs" / "deploy"


def _objects(name: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in load_all((DEPLOY / name).read_text())}


def test_the_pool_the_picker_and_the_route_fit_together():
    objs = _objects("gateway.yaml")
    instances = _objects("instances.yaml")
    pool = objs[("InferencePool", "vllm-pool")]["spec"]
    epp = objs[("Deployment", "epd-proxy-epp")]
    service = objs[("Service", "epd-proxy-epp")]["spec"]
    pod = epp["spec"]["template"]
    container = pod["spec"]["containers"][0]
    args = build_parser().parse_args(container["args"])  # exits on a flag epp does not take
    assert args.command == "epp"
    # The route's backend is the pool; the pool's picker is the picker's Service and gRPC port.
    route = objs[("HTTPRoute", "vllm")]["spec"]
    assert route["rules"][0]["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                 "name": "vllm-pool"}]
    ref = pool["endpointPickerRef"]
    assert ref["name"] == "epd-proxy-epp" and ref["failureMode"] in ("FailOpen", "FailClose")
    assert service["selector"] == epp["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    grpc_port = {p["name"]: p for p in service["ports"]}["grpc"]
    assert grpc_port["port"] == ref["port"]["number"] and grpc_port["targetPort"] == args.grpc_port
    assert args.grpc_port in [p["containerPort"] for p in container["ports"]]
    # The picker reaches the pool's pods through the headless Service over the same selector.
    [decode] = args.decode
    host, port = decode.removeprefix("dns+http://").split(":")
    headless = instances[("Service", host.split(".")[0])]["spec"]
    assert headless["clusterIP"] == "None" and headless["selector"] == pool["selector"]["matchLabels"]
    assert [{"number": int(port)}] == pool["targetPorts"]
    # gRPC health: readiness and liveness by their service names; the grace outlasts the shutdown.
    assert container["readinessProbe"]["grpc"] == {"port": args.grpc_port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": args.grpc_port, "service": "liveness"}
    assert pod["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
    assert epp["spec"]["replicas"] > objs[("PodDisruptionBudget", "epd-proxy-epp")]["spec"]["maxUnavailable"]


def test_the_sidecar_listens_on_the_pools_port_in_front_of_the_pods_vllm():
    """llm-d's routing-sidecar convention: the sidecar on the pod's served port, vLLM on another."""
    pool = _objects("gateway.yaml")[("InferencePool", "vllm-pool")]["spec"]
    instances = _objects("instances.yaml")
    decode = _objects("gateway-sidecar.yaml")[("Deployment", "vllm-decode")]
    labels = decode["spec"]["template"]["metadata"]["labels"]
    assert labels == pool["selector"]["matchLabels"] == instances[("Service", "vllm-decode")]["spec"]["selector"]
    sidecar, vllm = decode["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(sidecar["args"])  # exits on a flag the sidecar does not take
    assert args.command == "sidecar" and args.allowed_targets
    assert [{"number": args.port}] == pool["targetPorts"]
    assert [p["containerPort"] for p in sidecar["ports"]] == [args.port]
    assert sidecar["readinessProbe"]["httpGet"]["path"] == "/ready"
    vllm_args = vllm["args"]
    vllm_port = int(vllm_args[vllm_args.index("--port") + 1])
    assert vllm_port != args.port and args.decode == [f"http://127.0.0.1:{vllm_port}"]
    assert vllm_args[vllm_args.index("--host") + 1] == "127.0.0.1"  # only the sidecar reaches it
    assert decode["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.shutdown_timeout
