"""LoRA adapter affinity, as a pure unit: one home per adapter, the set grown only past the
load bound, active adapters preferred; and vLLM's lora_requests_info read."""

import random
from collections import Counter

from epd_proxy.instances.load_signals import LoadSignals, parse_adapters
from epd_proxy.routing.lora_affinity import AdapterAffinity, assign_homes
from epd_proxy.routing.policies import RoundRobin


class Inst:
    def __init__(self, url, inflight=0):
        self.url = url
        self.inflight = inflight
        self.requests = 0
        self.signals = LoadSignals()

    def __repr__(self):
        return self.url


def insts(n):
    return [Inst(f"http://10.0.1.{i}:8000") for i in range(n)]


def test_one_home_per_adapter_and_replicas_agree():
    cands = insts(4)
    a, b = AdapterAffinity(), AdapterAffinity()  # two proxy replicas
    homes = {}
    for name in (f"adapter-{i}" for i in range(40)):
        picks = {a.choose(cands, name).url for _ in range(10)}
        assert len(picks) == 1  # every request of an idle cluster on one instance
        homes[name] = picks.pop()
        assert b.choose(list(reversed(cands)), name).url == homes[name]  # order of candidates does not matter
        assert a.order([c.url for c in cands], name)[0] == homes[name]
    assert len(set(homes.values())) == 4  # adapters spread over the instances


def test_set_grows_only_past_the_load_bound():
    cands = insts(3)
    aff = AdapterAffinity(balance_abs=2, balance_rel=1.5)
    order = aff.order([c.url for c in cands], "sql")
    by_url = {c.url: c for c in cands}
    first, second = by_url[order[0]], by_url[order[1]]
    first.inflight = 2  # at the bound (0 + 2): still first
    assert aff.choose(cands, "sql") is first and aff.spills == 0
    first.inflight = 3  # past it: the second instance in the adapter's order, not any other
    assert aff.choose(cands, "sql") is second and aff.spills == 1
    second.inflight = 3
    assert aff.choose(cands, "sql").url == order[2]
    first.inflight = second.inflight = 0
    assert aff.choose(cands, "sql") is first  # the set shrinks back when the load goes


def test_past_the_bound_an_instance_with_the_adapter_active_comes_first():
    cands = insts(3)
    aff = AdapterAffinity(balance_abs=2)
    order = aff.order([c.url for c in cands], "fin")
    by_url = {c.url: c for c in cands}
    home, third = by_url[order[0]], by_url[order[2]]
    third.signals.adapters = frozenset({"fin", "x"})
    assert aff.choose(cands, "fin") is home  # within the bound the home wins: activity feeds on itself
    home.inflight = 3
    assert aff.choose(cands, "fin") is third  # past it: where the adapter is active, not the next in order
    third.inflight = 3
    assert aff.choose(cands, "fin").url == order[1]  # activity does not beat the load bound


def test_fewer_adapter_swaps_than_round_robin():
    """Eight adapters over four instances with two slots each (LRU): affinity keeps each
    adapter on its home, round-robin makes every instance cycle through all of them."""

    def swaps(pick) -> int:
        slots = {c.url: [] for c in cands}
        n = 0
        rng = random.Random(7)
        for _ in range(400):
            name = f"a{rng.randrange(8)}"
            url = pick(name).url
            active = slots[url]
            if name in active:
                active.remove(name)
            else:
                n += 1
                if len(active) >= 2:
                    active.pop(0)
            active.append(name)
        return n

    cands = insts(4)
    aff, rr = AdapterAffinity(), RoundRobin()
    homes = Counter(aff.choose(cands, f"a{i}").url for i in range(8))
    assert max(homes.values()) <= 4
    assert swaps(lambda name: aff.choose(cands, name)) < swaps(lambda name: rr.choose(cands)) / 2


def test_homes_are_balanced_deterministic_and_within_each_adapters_instances():
    urls = [f"http://10.0.2.{i}:8000" for i in range(4)]
    serving = {f"ad{k}": urls for k in range(10)}
    homes = assign_homes(serving)
    assert max(Counter(homes.values()).values()) == 3  # ceil(10 / 4)
    assert homes == assign_homes({k: list(reversed(v)) for k, v in reversed(serving.items())})
    serving["only"] = urls[:1]
    homes = assign_homes(serving)
    assert homes["only"] == urls[0]
    assert assign_homes({}) == {} and assign_homes({"x": []}) == {}


def test_rehomed_adapters_spread_where_rendezvous_alone_piles_up():
    cands = insts(2)
    urls = [c.url for c in cands]
    names = [f"a{k}" for k in range(40)]
    aff = AdapterAffinity()
    plain = Counter(aff.choose(cands, n).url for n in names)
    aff.rehome({n: urls for n in names})
    balanced = Counter(aff.choose(cands, n).url for n in names)
    assert sorted(balanced.values()) == [20, 20]
    assert max(plain.values()) >= max(balanced.values())
    home = next(c for c in cands if c.url == aff.homes["a0"])
    home.inflight = 9  # past the bound: the other instance
    assert aff.choose(cands, "a0") is not home
    assert aff.choose([c for c in cands if c is not home], "a0") is not home  # out of rotation: the next


def test_lora_requests_info_newest_sample_wins():
    text = (b'# HELP vllm:lora_requests_info Running stats on lora requests.\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="c",waiting_lora_adapters="d"} 1.8e9\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="e",waiting_lora_adapters=""} 1.75e9\n')
    assert parse_adapters(text) == frozenset({"c", "d"})
    assert parse_adapters(b"vllm:num_requests_running 1.0\n") == frozenset()
