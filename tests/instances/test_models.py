"""What an instance serves, the cluster's catalog, and routing within a model's instances."""

import msgspec
import pytest

from epd_proxy.config import InstanceSpec, parse_instance, split_instances
from epd_proxy.instances.health import OutlierSettings
from epd_proxy.instances.model_directory import ModelDirectory, model_readiness
from epd_proxy.instances.models import Served, catalog_of, paired_key, parse_models, pinned, serves
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.choose import choose
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


def test_a_model_nobody_listed_is_404_even_while_an_instance_has_not_answered():
    cat = catalog_of([served("a"), None])
    assert cat.open and cat.route("a") is None  # the unknown instance may take a's requests
    with pytest.raises(ProxyError) as err:
        cat.route("b")  # but b is nobody's: 404 at once, no instance tried
    assert err.value.status == 404 and err.value.code == "model_not_found"
    assert "This cluster serves: a (GET /v1/models lists them)" in err.value.message
    assert catalog_of([None, None]).route("x") is None  # nothing known at all: the instances answer
    assert catalog_of([]).route("x") is None  # no instance at all: the pools answer 503


def test_a_role_none_of_whose_instances_has_answered_is_not_ready_for_an_unlisted_model():
    cat = catalog_of([served("a"), None], waiting=("decode",))  # the prefill answered, no decode yet
    assert cat.route("a") is None
    with pytest.raises(ProxyError) as err:
        cat.route("b")
    assert err.value.status == 503 and "no decode instance has said which models it serves yet" in err.value.message


def test_the_404_names_at_most_twenty_models():
    cat = catalog_of([served(*[f"m{k}" for k in range(25)])])
    message = cat.not_found("x").message
    assert "m19 and 5 more (GET /v1/models lists them)" in message and "m20" not in message


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
            pool.served.learned(inst, listing(*[card(n) for n in names]))
    return pool, directory


async def test_pool_chooses_only_instances_serving_the_model():
    pool, directory = make_pools(["a"], ["b"], ["a", "b"])
    a, b, ab = pool.instances
    assert {choose(pool, model="a") for _ in range(8)} == {a, ab}
    assert {choose(pool, model="b") for _ in range(8)} == {b, ab}
    assert choose(pool) in pool.instances
    assert set(directory.current.parents) == {"a", "b"} and not directory.current.uniform


async def test_pool_panics_within_the_model_and_503_when_none_serves_it():
    pool, _ = make_pools(["a"], ["b"])
    a, b = pool.instances
    pool.outliers.record_failure(a, "down")  # a out: b in rotation, but it does not serve a
    assert not a.healthy and b.healthy
    assert choose(pool, model="a") is a  # panic routing within a's instances
    pool.outliers.drain(a)
    with pytest.raises(ProxyError) as err:
        choose(pool, model="a")
    assert err.value.status == 503 and "model `a`" in err.value.message


async def test_directory_says_which_deciding_roles_have_not_answered():
    directory = ModelDirectory()
    spec = InstanceSpec("http://127.0.0.1:9000", "decode")
    decode = InstancePool("decode", [spec], models=directory)
    prefill = InstancePool("prefill", [InstanceSpec("http://127.0.0.1:9001", "prefill")], models=directory)
    InstancePool("encode", [InstanceSpec("http://127.0.0.1:9002", "encode")], models=directory)
    assert directory.current.waiting == ("decode", "prefill")  # encoders never decide
    prefill.served.learned(prefill.instances[0], listing(card("a")))
    assert directory.current.waiting == ("decode",)
    decode.outliers.drain(decode.instances[0])  # a draining instance serves nothing new: no decode left to wait for
    assert directory.current.waiting == ()
    with pytest.raises(ProxyError) as err:
        directory.current.route("b")
    assert err.value.status == 404


async def test_panic_is_counted_only_over_instances_known_to_serve_the_model():
    """The decodes in rotation serve a, the one out has not said what it serves: a request for b
    (which a prefill lists, say) may try it, but no decode serving b is out: no panic."""
    pool, _ = make_pools(["a"], ["a"], None)
    unknown = pool.instances[2]
    pool.outliers.record_failure(unknown, "down")
    assert not unknown.healthy
    assert choose(pool, model="b") is unknown and pool.panics == 0
    for inst in pool.instances[:2]:  # a's own instances out too (failed probes: no cap): panic for a
        pool.outliers.probe_failed(inst, "connection", "health probe: refused")
    assert choose(pool, model="a") in pool.instances and pool.panics == 1
    assert choose(pool, model="b") is unknown and pool.panics == 2  # the whole role is out: panic, whatever the model


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


# -- memory: one card per model, whatever the number of instances reporting it ------------------
def vllm_answer(*cards, now=1):
    """As vLLM answers: ``created`` and each permission's id are new on every answer."""
    return listing(*[dict(c, created=now, permission=[{"id": f"modelperm-{now}-{c['id']}"}]) for c in cards])


def test_instances_reporting_the_same_models_share_their_cards():
    held: dict = {}
    cards = [card("base")] + [card(f"lora-{k}", "base") for k in range(50)]
    first = parse_models(vllm_answer(*cards, now=1), held=held)
    later = parse_models(vllm_answer(*cards, now=2), held=held)  # another instance, or the next probe
    assert later == first  # nothing new: no change to act on
    assert all(a is b for a, b in zip(first.cards, later.cards))
    assert all(a is b for a, b in zip(first.parents, later.parents))  # the id strings too
    moved = parse_models(vllm_answer(card("base"), dict(card("lora-0", "base"), max_model_len=64)), held=held)
    assert moved != first and moved.cards[1]["max_model_len"] == 64  # a real difference is one
    assert len(held) == 52


# -- per-model readiness (catalog.model_readiness, pure) ----------------------------------------
def inst(state="healthy", models=("a",)):
    return {"state": state, "healthy": state == "healthy", "models": None if models is None else list(models)}


def test_readiness_per_role_with_adapters_encoders_and_why():
    pools = {"encode": [inst(models=("a",)), inst("ejected", ("v",))],
             "prefill": [inst(models=("a", "sql")), inst("draining", ("v",))],
             "decode": [inst(models=("a", "sql")), inst("ejected", ("v",)), inst(models=None)]}
    got = model_readiness(pools, {"a": None, "sql": "a", "v": None}, ("encode", "prefill", "decode"))
    assert got["a"] == {"parent": None, "ready": True, "media": True, "why": None,
                        "roles": {"encode": {"in_rotation": 1, "out": 0}, "prefill": {"in_rotation": 1, "out": 0},
                                  "decode": {"in_rotation": 1, "out": 0}}}
    assert got["sql"]["ready"] and got["sql"]["media"]  # its encoders are its base's
    assert got["sql"]["roles"]["encode"] == {"in_rotation": 1, "out": 0}
    v = got["v"]  # its prefill is draining (not counted), its decode and encoder ejected
    assert not v["ready"] and v["media"] is False
    assert v["roles"] == {"encode": {"in_rotation": 0, "out": 1}, "decode": {"in_rotation": 0, "out": 1}}
    assert v["why"] == ("no prefill instance serves it; no decode instance serving it is in rotation (1 out); "
                        "no encode instance serving it is in rotation (1 out) (requests with media are refused); "
                        "instances that have not said what they serve yet may: 1 decode")


def test_readiness_without_an_encode_stage_says_nothing_of_media():
    got = model_readiness({"decode": [inst()]}, {"a": None}, ("decode",))
    assert got == {"a": {"parent": None, "ready": True, "media": None, "why": None,
                         "roles": {"decode": {"in_rotation": 1, "out": 0}}}}
