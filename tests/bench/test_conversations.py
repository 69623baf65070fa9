"""The cluster scenario's workload generator: conversation structure, determinism, working set."""

import pytest

from epd_proxy.bench.conversations import (
    ChatSpec,
    conversation_bodies,
    image_pool,
    make_conversations,
    turn_body,
    working_set,
)
from epd_proxy.sim import expected_text, prompt_tokens


def _spec(**kw) -> ChatSpec:
    base = dict(conversations=6, turns=3, system_prompts=2, system_words=40, user_words=10, max_tokens=8,
                image_share=0.5, image_pool=3, image_kb=2, think_s=0.5, seed=7)
    base.update(kw)
    return ChatSpec(**base)


def test_structure():
    spec = _spec()
    convs = make_conversations(spec)
    assert len(convs) == 6 and all(len(c.turns) == 3 for c in convs)
    assert len({c.id for c in convs}) == 6
    # A few shared system prompts: every conversation uses one of them, by index.
    assert {c.system for c in convs} <= {0, 1}
    by_index = {c.system: c.system_text for c in convs}
    assert all(c.system_text == by_index[c.system] for c in convs)
    # The first turn does not wait; later ones think.
    assert all(c.turns[0].think_s == 0 for c in convs)
    assert any(t.think_s > 0 for c in convs for t in c.turns[1:])
    # Images come from the pool, so they repeat.
    picks = [t.image for c in convs for t in c.turns if t.image is not None]
    assert picks and set(picks) <= {0, 1, 2} and len(picks) > len(set(picks))
    assert len(image_pool(spec)) == 3


def test_next_prompt_carries_the_answers_in_order():
    spec = _spec()
    conv = make_conversations(spec)[0]
    images = image_pool(spec)
    body = turn_body(spec, conv, 2, ["first answer", "second answer"], images)
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == "first answer"
    assert body["messages"][4]["content"] == "second answer"
    assert body["stream"] is True and body["max_tokens"] == 8
    # Turn t's prompt starts with turn t-1's whole prompt plus its answer: a cacheable prefix.
    prev = turn_body(spec, conv, 1, ["first answer"], images)
    assert body["messages"][:len(prev["messages"])] == prev["messages"]
    with pytest.raises(ValueError):
        turn_body(spec, conv, 2, ["only one"], images)


def test_deterministic_for_a_seed():
    a, b = make_conversations(_spec()), make_conversations(_spec())
    assert a == b
    assert image_pool(_spec()) == image_pool(_spec())
    assert make_conversations(_spec(seed=8)) != a


def test_text_only_and_no_shared_prefix_variants():
    spec = _spec()
    assert all(t.image is None for c in make_conversations(spec.text_only()) for t in c.turns)
    assert image_pool(spec.text_only()) == []
    own = make_conversations(_spec(system_prompts=0))
    assert all(c.system is None for c in own)
    assert len({c.system_text.split()[0] for c in own}) == len(own)  # no two share even a first word


def test_working_set_counts_distinct_blocks():
    # One role token + 31 words = two full blocks of 16 for the system prompt, one role token
    # + 15 words = one block for the user message: N one-turn conversations sharing one
    # system prompt have 2 + N distinct blocks.
    spec = _spec(conversations=5, turns=1, system_prompts=1, system_words=31, user_words=15, image_share=0)
    convs = make_conversations(spec)
    ws = working_set(spec, convs, [], 16)
    assert ws["blocks"] == 2 + 5
    assert ws["requests"] == 5 and ws["prompt_tokens"] == 5 * 48
    # No shared system prompt: nothing is shared, each prompt's 3 full blocks are its own.
    own = _spec(conversations=5, turns=1, system_prompts=0, system_words=31, user_words=15, image_share=0)
    assert working_set(own, make_conversations(own), [], 16)["blocks"] == 3 * 5


def test_working_set_of_multi_turn_conversations_shares_the_history():
    spec = _spec(conversations=3, turns=3, image_share=0)
    convs = make_conversations(spec)
    ws = working_set(spec, convs, [], 16)
    bodies = [b for c in convs for b in conversation_bodies(spec, c, [], expected_text)]
    assert ws["prompt_tokens"] == sum(prompt_tokens(b) for b in bodies)
    every_prompts_blocks = sum(prompt_tokens(b) // 16 for b in bodies)
    # Later turns reuse the earlier turns' blocks: far fewer distinct blocks than the sum.
    assert ws["blocks"] < every_prompts_blocks
    assert ws["blocks"] >= max(prompt_tokens(b) // 16 for b in bodies)


def test_working_set_counts_the_distinct_images():
    spec = _spec(image_share=1.0, image_pool=2, conversations=4, turns=2)
    convs = make_conversations(spec)
    ws = working_set(spec, convs, image_pool(spec), 16)
    assert ws["distinct_images"] == 2
    assert ws["image_tokens"] > 0
