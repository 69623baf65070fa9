"""docs/deploy/instances.yaml against vLLM itself: every Deployment's arguments pass the
`vllm serve` argument parser and its checks in the e2e environment's vLLM (the version the
rest of this suite runs), the connector configs parse into vLLM's own config classes with the
roles the manifests mean, and the NIXL variables the manifests set are ones vLLM reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import vllm_e2e as E  # noqa: E402
from yaml_subset import load_all  # noqa: E402

pytestmark = pytest.mark.vllm

INSTANCES = os.path.join(E.REPO, "docs", "deploy", "instances.yaml")

# Runs in vLLM's environment: argv lists in, what vLLM made of them out.
_CHECK = r"""
import json, sys
import vllm.envs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
out = {"env": sorted(vllm.envs.environment_variables), "roles": {}}
for role, argv in json.load(sys.stdin).items():
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)  # exits 2 on an unknown flag
    validate_parsed_serve_args(args)
    kv, ec = args.kv_transfer_config, args.ec_transfer_config
    out["roles"][role] = {
        "model": args.model_tag, "port": args.port, "prefix_caching": args.enable_prefix_caching,
        "kv": kv and [kv.kv_connector, kv.kv_role, kv.kv_load_failure_policy],
        "ec": ec and [ec.ec_connector, ec.ec_role, ec.ec_connector_extra_config.get("shared_storage_path")],
    }
print(json.dumps(out))
"""


def test_the_manifests_vllm_arguments_are_what_vllm_accepts(vllm_env_ready):
    pods = {}
    for doc in load_all(open(INSTANCES).read()):
        if doc["kind"] == "Deployment":
            pods[doc["spec"]["template"]["metadata"]["labels"]["role"]] = doc["spec"]["template"]["spec"]
    argv = {role: pod["containers"][0]["args"] for role, pod in pods.items()}
    out = subprocess.run([os.path.join(E.VENV, "bin", "python"), "-c", _CHECK], input=json.dumps(argv),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    roles = result["roles"]
    assert set(roles) == {"encode", "prefill", "decode"}
    assert roles["encode"]["kv"] is None and roles["decode"]["ec"] is None
    assert roles["encode"]["ec"] == ["ECExampleConnector", "ec_producer", "/ec-cache"]
    assert roles["prefill"]["ec"] == ["ECExampleConnector", "ec_consumer", "/ec-cache"]
    assert roles["prefill"]["kv"] == ["NixlConnector", "kv_producer", "fail"]
    assert roles["decode"]["kv"] == ["NixlConnector", "kv_consumer", "fail"]
    assert roles["encode"]["prefix_caching"] is False
    assert {r["port"] for r in roles.values()} == {8000}
    for role in ("prefill", "decode"):
        names = {e["name"] for e in pods[role]["containers"][0]["env"]}
        assert names <= set(result["env"]), names - set(result["env"])
