"""Model aliases: resolution before routing, the default for unknown names, /v1/models' cards."""

import pytest

from epd_proxy.config import ConfigErrors
from epd_proxy.instances.models import ModelCatalog
from epd_proxy.tenants.aliases import read_aliases

SERVED = ModelCatalog(parents={"m": None, "lora": "m"}, cards=({"id": "m", "root": "m"}, {"id": "lora", "parent": "m"}),
                 open=False)


def test_resolve():
    aliases = read_aliases({"default": "m", "names": {"claude-sonnet-4": "m", "gpt-4o": "lora"}})
    assert aliases.resolve("claude-sonnet-4", SERVED) == "m" and aliases.resolve("gpt-4o", SERVED) == "lora"
    assert aliases.resolve("m", SERVED) == "m" and aliases.resolve("nope", SERVED) == "m"
    assert aliases.resolve("nope", ModelCatalog()) == "nope"  # nothing known yet: nothing is unknown
    assert aliases.resolve(None, SERVED) is None


def test_listed_cards():
    names = {"claude-sonnet-4": "m", "dangling": "x"}
    assert read_aliases({"names": names}).cards(SERVED.cards) == list(SERVED.cards)
    assert [c["id"] for c in read_aliases({"names": names, "listed": "aliases"}).cards(SERVED.cards)] == \
        ["claude-sonnet-4"]
    both = read_aliases({"names": names, "listed": "both"}).cards(SERVED.cards)
    assert [c["id"] for c in both] == ["m", "lora", "claude-sonnet-4"] and both[2]["root"] == "m"


def test_mistakes_at_once():
    with pytest.raises(ConfigErrors) as err:
        read_aliases({"names": {"a": "b", "b": "c", "d": 3}, "listed": "all", "dflt": 1})
    assert len(err.value.errors) == 4
