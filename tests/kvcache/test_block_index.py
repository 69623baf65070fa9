"""The block index: keys on tokens, stores, removals, clears, the bound, speculation."""

from __future__ import annotations

from epd_proxy.kvcache.index import BlockIndex, adapter_root, prompt_keys

BS = 4


def _store(index: BlockIndex, name: str, tokens: list[int], parent=None, hashes=None, adapter=None, base=0):
    n = len(tokens) // BS
    hashes = hashes if hashes is not None else [base + 1000 + i for i in range(n)]
    index.stored(name, hashes, parent, tokens, BS, adapter)
    return hashes


def test_longest_prefix_per_instance():
    index = BlockIndex()
    prompt = list(range(1, 17))  # 4 blocks
    _store(index, "a", prompt)
    _store(index, "b", prompt[:8], base=50)
    assert index.longest_prefix(prompt + [99]) == {"a": 16, "b": 8}
    assert index.longest_prefix([7] + prompt) == {}
    # A divergence in the second block: both hold the first only.
    assert index.longest_prefix(prompt[:4] + [0, 0, 0, 0]) == {"a": 4, "b": 4}


def test_keys_independent_of_engine_hashes():
    """Two instances with different engine hashes for the same tokens hold the same keys."""
    index = BlockIndex()
    prompt = list(range(100, 116))
    _store(index, "a", prompt, hashes=[11, 12, 13, 14])
    _store(index, "b", prompt, hashes=[-5, b"x", "y", 9])
    assert index.keys == 4 and len(index) == 8
    assert index.longest_prefix(prompt) == {"a": 16, "b": 16}


def test_chained_store_and_idempotent_repeat():
    index = BlockIndex()
    prompt = list(range(1, 13))
    index.stored("a", [1], None, prompt[:4], BS)
    index.stored("a", [2, 3], 1, prompt[4:12], BS)  # continues from engine hash 1
    index.stored("a", [2, 3], 1, prompt[4:12], BS)  # the same again: nothing new
    assert len(index) == 3
    assert index.longest_prefix(prompt) == {"a": 12}


def test_orphan_not_indexed():
    index = BlockIndex()
    index.stored("a", [2], 77, [1, 2, 3, 4], BS)
    assert len(index) == 0 and index.sources()[0].orphans == 1


def test_removed_by_engine_hash_and_clear():
    index = BlockIndex()
    prompt = list(range(1, 13))
    hashes = _store(index, "a", prompt)
    _store(index, "b", prompt, base=10)
    index.removed("a", [hashes[1]])
    assert index.longest_prefix(prompt) == {"a": 4, "b": 12}
    index.clear("b")
    assert index.longest_prefix(prompt) == {"a": 4}
    index.drop("a")
    assert index.longest_prefix(prompt) == {} and len(index) == 0 and index.keys == 0


def test_adapter_is_its_own_namespace():
    index = BlockIndex()
    prompt = list(range(1, 9))
    _store(index, "a", prompt, adapter="sql")
    assert index.longest_prefix(prompt) == {}
    assert index.longest_prefix(prompt, "sql") == {"a": 8}
    assert adapter_root("sql") != adapter_root(None)


def test_extra_keys_never_match_a_text_lookup():
    index = BlockIndex()
    prompt = list(range(1, 9))
    index.stored("a", [1, 2], None, prompt, BS, None, [None, [["mm-1", 0]]])
    assert index.longest_prefix(prompt) == {"a": 4}


def test_bound_evicts_oldest_of_largest():
    index = BlockIndex(max_blocks=10)
    for i in range(6):
        _store(index, "a", [i * 10 + j for j in range(1, 5)], hashes=[i])
    for i in range(6):
        _store(index, "b", [500 + i * 10 + j for j in range(1, 5)], hashes=[i])
    assert len(index) <= 10 and index.evicted >= 2
    # The oldest of "a" went first; its newest block is still there.
    assert index.longest_prefix([51, 52, 53, 54]) == {"a": 4}
    assert index.longest_prefix([1, 2, 3, 4]) == {}


def test_speculative_entries_expire():
    index = BlockIndex(speculative_ttl=2.0)
    prompt = list(range(1, 13))
    _store(index, "a", prompt[:4])
    index.source("b")
    keys: dict[int, list[int]] = {}
    assert index.longest_prefix(prompt, now=0.0, keys=keys) == {"a": 4}
    index.speculate("b", keys[BS], now=0.0)
    assert index.longest_prefix(prompt, now=1.0) == {"a": 4, "b": 12}
    assert index.longest_prefix(prompt, now=2.5) == {"a": 4}
    assert keys[BS] == prompt_keys(prompt, BS)


def test_slot_reused_after_drop():
    index = BlockIndex()
    _store(index, "a", [1, 2, 3, 4])
    index.drop("a")
    _store(index, "c", [5, 6, 7, 8])
    assert index.source("c").slot == 0
    assert index.longest_prefix([1, 2, 3, 4]) == {}


def test_a_prompt_and_an_event_key_their_blocks_by_the_one_rule(monkeypatch):
    """``block_key`` is the rule: a prompt's keys and an event's come from it alone, so a
    change to it changes both alike and the index still finds what it stored."""
    from epd_proxy.kvcache import index as module

    calls = []

    def salted(parent, tokens):
        calls.append(len(tokens))
        return hash(("salt", parent, *tokens))

    monkeypatch.setattr(module, "block_key", salted)
    index = BlockIndex()
    prompt = list(range(1, 13))
    _store(index, "a", prompt)
    assert calls == [BS] * 3
    assert prompt_keys(prompt, BS) == [index.source("a").blocks[1000 + i] for i in range(3)]
    assert index.longest_prefix(prompt) == {"a": 12}
