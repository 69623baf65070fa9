"""The [tenants] table: keys over the default field by field, classes, every mistake at once."""

import pytest

from epd_proxy.config import ConfigErrors
from epd_proxy.tenants.policy import read_tenants


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


def test_each_part_of_the_table_is_a_dataclass_naming_its_own_mistakes():
    from epd_proxy.tenants.policy import KeyPolicy, TenantTable, TrafficClass

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
