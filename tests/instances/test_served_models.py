"""What each instance of one role serves (instances/served_models.py): its /v1/models answer
within its models attribute, the attribute alone until it answers again, which adapter a
model key names, the adapters' homes."""

import json

from epd_proxy.config import InstanceSpec
from epd_proxy.instances.model_directory import ModelDirectory
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
from epd_proxy.routing.lora_affinity import AdapterAffinity


def card(name, parent=None, **extra):
    return {"id": name, "object": "model", "owned_by": "vllm", "root": name, "parent": parent, **extra}


def vllm_answer(*cards, now=1):
    return json.dumps({"object": "list", "data": [dict(c, created=now) for c in cards]}).encode()


def make_pool(*models, affinity=None):
    directory = ModelDirectory()
    pool = InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(len(models))],
                        models=directory, affinity=affinity)
    for inst, names in zip(pool.instances, models):
        if names is not None:
            pool.served.learned(inst, vllm_answer(*[card(n) for n in names]))
    return pool, directory


async def test_repeated_answers_do_not_rebuild_the_catalog_and_the_table_stays_bounded():
    pool, directory = make_pool(["a"], ["a"])
    one, two = pool.instances
    catalog = directory.current
    for now in range(2, 6):
        pool.served.learned(one, vllm_answer(card("a"), now=now))
        pool.served.learned(two, vllm_answer(card("a"), now=now))
    assert directory.current is catalog  # the same models: nothing rebuilt, nothing logged
    for k in range(500):  # adapters come and go on one instance
        pool.served.learned(one, vllm_answer(card("a"), card(f"lora-{k}", "a"), now=k))
    assert set(directory.current.parents) == {"a", "lora-499"}
    assert len(directory.cards) <= 2 * 2 + 64  # the cards held now, not every one seen


async def test_a_model_key_names_its_adapter_and_a_base_none():
    pool, _ = make_pool(None)
    pool.served.learned(pool.instances[0], vllm_answer(card("a"), card("sql", "a")))
    served = pool.served
    assert served.adapter_of("sql") == "sql" and served.adapter_of(("sql", "a")) == "sql"
    assert served.adapter_of("a") is None and served.adapter_of("unheard-of") is None


async def test_a_changed_models_attribute_pins_what_it_serves_until_it_answers_again():
    pool, directory = make_pool(["a"], ["b"])
    first = pool.instances[0]
    assert {choose(pool, model="b") for _ in range(4)} == {pool.instances[1]}
    first.spec = InstanceSpec(first.url, "decode", models=("b",))
    pool.served.pin(first)
    assert first.served is not None and first.served.names == ["b"]
    assert {choose(pool, model="b") for _ in range(8)} == set(pool.instances)  # the host lists follow
    assert set(directory.current.parents) == {"b"}


async def test_the_adapters_homes_are_computed_once_per_change():
    affinity = AdapterAffinity()
    pool, _ = make_pool(["a"], ["a"], affinity=affinity)
    one, two = pool.instances
    pool.served.learned(one, vllm_answer(card("a"), card("sql", "a")))
    assert pool.served.adapters_served() == {"sql": [one.url]}
    pool.served.rehome()
    assert affinity.homes == {"sql": one.url}
    affinity.homes = {}
    pool.served.rehome()  # nothing changed since: not again
    assert affinity.homes == {}
    pool.served.learned(two, vllm_answer(card("a"), card("sql", "a"), card("fin", "a")))
    pool.served.rehome()
    assert set(affinity.homes) == {"sql", "fin"} and affinity.homes["fin"] == two.url
