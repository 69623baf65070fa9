"""The [tenants] table: keys over the default field by field, classes, every mistake at once."""

import pytest

from epd_proxy.config import ConfigErrors
from epd_proxy.tenants.aliases import ModelAliases, may_use
from epd_proxy.tenants.table import read_tenants


def test_a_key_overrides_the_default_field_by_field_and_zero_lifts_a_limit():
    table = read_tenants({
        "default": {"requests_per_minute": 60, "tokens_per_day": 1000},
        "keys": [{"name": "a", "requests_per_second": 2, "tokens_per_day": 0, "class": "critical", "weight": 3,
                  "models": ["m"]},
                 {"name": "b"}],
    })
    a, b = table.policy("a"), table.policy("b")
    assert a.limits == {"requests_per_minute": 60, "requests_per_second": 2}
    assert a.traffic.name == "critical" and a.weight == 3 and a.models == frozenset({"m"}) and a.label == "a"
    assert b.limits == {"requests_per_minute": 60, "tokens_per_day": 1000} and b.traffic.name == "standard"
    assert table.policy("unknown").label == "default" and table.policy(None).label == "default"


def test_the_priority_header_may_lower_a_class_never_raise_it():
    table = read_tenants({"priority_header": "X-Priority", "keys": [{"name": "a", "class": "standard"}]})
    a = table.policy("a")
    assert table.priority_header == b"x-priority"
    assert table.traffic(a, b"sheddable").name == "sheddable"
    assert table.traffic(a, b"critical").name == "standard"
    assert table.traffic(a, b"nonsense").name == "standard"


def test_own_classes():
    table = read_tenants({"classes": {"gold": {"rank": 5}, "bronze": {"rank": 1, "sheddable": True}},
                          "default": {"class": "bronze"}})
    assert table.policy(None).traffic.sheddable and set(table.classes) == {"gold", "bronze"}


def test_every_mistake_is_reported_at_once():
    with pytest.raises(ConfigErrors) as err:
        read_tenants({"defualt": {}, "store_failure": "maybe", "store": "http://x",
                      "default": {"requests_per_minute": -1, "class": "vip"},
                      "keys": [{"requests_per_second": 1}, {"name": "a", "weight": 0, "bogus": 1},
                               {"name": "a"}, {"name": "b", "models": []}]})
    text = "\n".join(err.value.errors)
    for part in ("unknown key 'defualt'", "store_failure", "tenants.store must", "requests_per_minute must be",
                 "class must be one of", "needs a 'name'", "weight must be", "unknown key 'bogus'",
                 "'a': named twice", "models must be"):
        assert part in text, part
    assert len(err.value.errors) == 10


def test_the_engine_priority_of_each_class():
    table = read_tenants({"engine_priority": True})
    assert [table.priority_of(table.classes[c]) for c in ("critical", "standard", "sheddable")] == [0, 1, 2]
    own = read_tenants({"engine_priority": True, "classes": {"gold": {"rank": 5}, "tin": {"rank": -1}}})
    assert own.priority_of(own.classes["gold"]) == 0 and own.priority_of(own.classes["tin"]) == 6
    off = read_tenants({})
    assert off.priority_of(off.classes["sheddable"]) == 0  # instances without priority scheduling: 0 only
    with pytest.raises(ConfigErrors, match="engine_priority must be true or false"):
        read_tenants({"engine_priority": "yes"})


def test_a_key_list_is_checked_on_the_model_that_runs():
    aliases = ModelAliases({"claude": "qwen"}, default="qwen")
    allowed = frozenset({"claude", "retired"})
    assert may_use(allowed, aliases, "claude", "qwen")  # an alias on the list, run by its target
    assert not may_use(allowed, aliases, "retired", "qwen")  # the default's model is not on the list
    assert not may_use(allowed, aliases, "qwen", "qwen")
    assert may_use(frozenset({"qwen"}), aliases, "claude", "qwen") and may_use(frozenset({"x"}), None, "x", "x")
    assert not may_use(allowed, None, "claude", "qwen")


def test_each_part_of_the_table_is_a_dataclass_naming_its_own_mistakes():
    from epd_proxy.tenants.table import KeyPolicy, TenantTable, TrafficClass

    errors: list[str] = []
    classes = TrafficClass.read_all({"gold": {"rank": 5}, "lead": {"rank": "low"}}, "tenants", errors)
    assert classes == {"gold": TrafficClass("gold", 5)}
    assert errors == ["tenants.classes.lead.rank must be an integer, got 'low'"]
    errors.clear()
    base = KeyPolicy("default", {"requests_per_minute": 60}, classes["gold"])
    key = base.over({"concurrent": 2, "weight": 0}, classes, "tenants.keys 'a'", errors, named=True)
    assert key == KeyPolicy("default", {"requests_per_minute": 60, "concurrent": 2}, classes["gold"], 1.0)
    assert errors == ["tenants.keys 'a': weight must be a number in (0, 1000], got 0"]
    errors.clear()
    keys = KeyPolicy.read_keys([{"name": "a"}, {"requests_per_minute": 1}], base, classes, "tenants", errors)
    assert list(keys) == ["a"] and keys["a"].label == "a"
    assert errors == ["tenants.keys #2: needs a 'name' (the key's name in --api-key-file)"]
    assert TenantTable.read({"store_timeout": 1}).store_timeout == 1.0
    with pytest.raises(ConfigErrors, match="tenants.reserved_slots must be a whole number"):
        TenantTable.read({"reserved_slots": -1})
