"""What an instance serves, the cluster's catalog, and routing within a model's instances."""

import msgspec
import pytest

from epd_proxy.config import InstanceSpec, parse_instance, split_instances
from epd_proxy.instances.catalog import ModelDirectory
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.models import Served, catalog_of, paired_key, parse_models, pinned, serves
from epd_proxy.instances.pool import InstancePool
from epd_proxy.wire.errors import ProxyError


def card(name, parent=None):
    return {"id": name, "object": "model", "created": 1, "owned_by": "vllm", "root": f"/m/{name}",
            "parent": parent, "max_model_len": 512, "permission": []}


def listing(*cards):
    return msgspec.json.encode({"object": "list", "data": list(cards)})


def served(*names, adapters=()):
    return parse_models(listing(*[card(n) for n in names], *[card(a, p) for a, p in adapters]))


# -- one instance ------------------------------------------------------------------------------
def test_parse_models_keeps_ids_and_parents():
    s = served("base", adapters=[("sql", "base")])
    assert s.parents == {"base": None, "sql": "base"}
    assert [c["id"] for c in s.cards] == ["base", "sql"]


def test_parse_models_within_the_models_attribute_keeps_their_adapters():
    body = listing(card("a"), card("b"), card("sql", "a"), card("chat", "b"))
    assert parse_models(body, ("a",)).parents == {"a": None, "sql": "a"}


@pytest.mark.parametrize("body", [b"nope", b"[]", b'{"object":"list"}'])
def test_parse_models_refuses_what_is_not_a_model_list(body):
    with pytest.raises(ValueError):
        parse_models(body)


def test_serves_unknown_instance_serves_anything():
    assert serves(None, "x") and serves(None, ("sql", "a"))


def test_serves_an_adapter_only_on_the_same_base():
    s = served("a", adapters=[("sql", "a")])
    assert serves(s, "sql") and serves(s, ("sql", "a"))
    assert not serves(s, ("sql", "b")) and not serves(s, "b")


def test_paired_key_carries_the_adapter_base_to_the_other_leg():
    s = served("a", adapters=[("sql", "a")])
    assert paired_key("sql", s) == ("sql", "a")
    assert paired_key("a", s) == "a"
    assert paired_key("sql", None) == "sql"


def test_models_attribute_in_the_instance_spec():
    assert parse_instance("http://h:1;models=a|b", "decode").models == ("a", "b")
    assert split_instances(["http://h:1;models=a,b,http://g:2", "k:3"]) == ["http://h:1;models=a,b", "http://g:2",
                                                                              "k:3"]
    with pytest.raises(ValueError, match="models"):
        parse_instance("http://h:1;models=", "decode")


# -- the catalog -------------------------------------------------------------------------------
def test_one_model_everywhere_needs_no_filter():
    cat = catalog_of([served("a"), served("a")])
    assert cat.uniform and not cat.open
    assert cat.route("a") is None and cat.route(None) is None


def test_an_adapter_is_keyed_even_when_every_instance_has_it():
    """Its placement (LoRA affinity) reads the key; the base model still needs none."""
    cat = catalog_of([served("a", adapters=[("sql", "a")]), served("a", adapters=[("sql", "a")])])
    assert cat.uniform
    assert cat.route("a") is None
    assert cat.route("sql") == {"decode": "sql", "prefill": "sql", "encode": "a"}


def test_unknown_model_is_404_model_not_found():
    with pytest.raises(ProxyError) as err:
        catalog_of([served("a")]).route("b")
    assert err.value.status == 404 and err.value.code == "model_not_found"
    assert err.value.envelope()["error"]["param"] == "model"


def test_two_models_filter_by_model():
    cat = catalog_of([served("a"), served("b")])
    assert not cat.uniform
    assert cat.route("a") == {"decode": "a", "prefill": "a", "encode": "a"}


def test_an_adapter_routes_its_encoders_by_its_base():
    cat = catalog_of([served("a", adapters=[("sql", "a")]), served("b")])
    assert cat.route("sql") == {"decode": "sql", "prefill": "sql", "encode": "a"}


def test_without_model_the_only_one_or_400_naming_the_choices():
    assert catalog_of([served("a", adapters=[("sql", "a")]), served("a")]).route(None) == \
        {"decode": "a", "prefill": "a", "encode": "a"}
    with pytest.raises(ProxyError) as err:
        catalog_of([served("a"), served("b")]).route(None)
    assert err.value.status == 400 and "a, b" in err.value.message


def test_unknown_instances_serve_anything_until_known():
    cat = catalog_of([served("a"), None])
    assert cat.open and cat.route("a") is None
    assert cat.route("b") == {"decode": "b", "prefill": "b", "encode": "b"}  # only the unknown one
    assert catalog_of([]).route("x") is None  # no instance at all: the pools answer 503


def test_union_lists_each_id_once_in_order():
    cat = catalog_of([served("a", adapters=[("sql", "a")]), served("a", "b")])
    assert [c["id"] for c in cat.cards] == ["a", "sql", "b"]
    assert cat.card("sql")["parent"] == "a" and cat.card("zz") is None


def test_pinned_names_before_the_instance_answers():
    s = pinned(("a",))
    assert s.parents == {"a": None} and s.cards[0]["id"] == "a" and s.cards[0]["object"] == "model"


# -- the pool within a model ---------------------------------------------------------------------
def make_pools(*models):
    directory = ModelDirectory()
    pool = InstancePool("decode", [InstanceSpec(f"http://127.0.0.1:{9000 + i}", "decode") for i in range(len(models))],
                        outlier=OutlierSettings(fail_threshold=1), models=directory)
    for inst, names in zip(pool.instances, models):
        if names is not None:
            pool.learned(inst, listing(*[card(n) for n in names]))
    return pool, directory


async def test_pool_chooses_only_instances_serving_the_model():
    pool, directory = make_pools(["a"], ["b"], ["a", "b"])
    a, b, ab = pool.instances
    assert {pool.choose(model="a") for _ in range(8)} == {a, ab}
    assert {pool.choose(model="b") for _ in range(8)} == {b, ab}
    assert pool.choose() in pool.instances
    assert set(directory.current.parents) == {"a", "b"} and not directory.current.uniform


async def test_pool_panics_within_the_model_and_503_when_none_serves_it():
    pool, _ = make_pools(["a"], ["b"])
    a, b = pool.instances
    pool.record_failure(a, "down")  # a out: b in rotation, but it does not serve a
    assert not a.healthy and b.healthy
    assert pool.choose(model="a") is a  # panic routing within a's instances
    pool.drain(a)
    with pytest.raises(ProxyError) as err:
        pool.choose(model="a")
    assert err.value.status == 503 and "model `a`" in err.value.message


async def test_model_leaves_the_catalog_with_its_instance():
    pool, directory = make_pools(["a"], ["b"])
    pool.remove(pool.instances[1])
    assert set(directory.current.parents) == {"a"} and directory.current.uniform
    with pytest.raises(ProxyError):
        directory.current.route("b")


async def test_snapshot_says_what_each_instance_serves():
    pool, _ = make_pools(["a"], None)
    assert [s["models"] for s in pool.snapshot()] == [["a"], None]


def test_served_is_a_value():
    assert Served({"a": None}) == Served({"a": None})


def test_registration_may_carry_models():
    from epd_proxy.instances.roster import RegistrationError, parse_registration

    spec = parse_registration(b'{"role": "decode", "url": "http://h:1", "models": ["a", "b"]}')
    assert spec.models == ("a", "b")
    with pytest.raises(RegistrationError):
        parse_registration(b'{"role": "decode", "url": "http://h:1", "models": "a"}')


def test_cluster_file_models_list():
    from epd_proxy.cli.cluster_file import _instances

    assert _instances("decode", [{"url": "http://h:1", "models": ["a", "b"]}], "f") == ["http://h:1;models=a|b"]
