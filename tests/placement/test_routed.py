"""The instance for a routed endpoint (placement/routed.py): the least loaded of the pools'
candidates, tokenizer work across every pool, model work in the first pool that has one."""

import pytest

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.routed import another_routed, place_routed
from epd_proxy.routing.policies import LeastLoaded
from epd_proxy.wire.errors import ProxyError


def pools(**sizes):
    port = iter(range(9100, 9200))
    return {role: InstancePool(role, [InstanceSpec(f"http://127.0.0.1:{next(port)}", role) for _ in range(n)])
            for role, n in sizes.items()}


async def test_model_work_goes_to_the_first_pool_with_an_instance_the_least_loaded_there():
    p = pools(decode=2, prefill=1)
    a, b = p["decode"].instances
    a.inflight = 3
    chosen = place_routed(p, ("decode", "prefill"), LeastLoaded(), spread=False)
    assert chosen is b  # the decode pool first, even with an idle prefill
    b.inflight = 5
    assert place_routed(p, ("decode", "prefill"), LeastLoaded(), spread=False) is a


async def test_tokenizer_work_competes_on_load_across_every_pool():
    p = pools(decode=1, prefill=1)
    p["decode"].instances[0].inflight = 2
    prefill = p["prefill"].instances[0]
    assert place_routed(p, ("decode", "prefill"), LeastLoaded(), spread=True) is prefill


async def test_a_pool_whose_instances_all_failed_the_request_comes_after_one_that_has_not():
    p = pools(decode=1, prefill=1)
    failed = p["decode"].instances[0]
    assert place_routed(p, ("decode", "prefill"), LeastLoaded(), spread=False,
                        exclude={failed}) is p["prefill"].instances[0]
    assert another_routed(p, ("decode", "prefill"), {failed}, None)
    assert not another_routed(p, ("decode", "prefill"), {failed, p["prefill"].instances[0]}, None)
    # Every one failed it: still an instance (the pools' own rules), never nothing.
    assert place_routed(p, ("decode",), LeastLoaded(), spread=False, exclude={failed}) is failed


async def test_no_pool_with_an_instance_is_503_naming_the_roles_and_the_path():
    p = pools(decode=0, prefill=0)
    with pytest.raises(ProxyError) as err:
        place_routed(p, ("decode", "prefill"), LeastLoaded(), spread=True, path="/tokenize")
    assert err.value.status == 503 and err.value.retryable
    assert err.value.message == "no decode or prefill instance can answer /tokenize"
