"""The routing policies and the request's routing keys, as pure units."""

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rendezvous import rendezvous_order

import epd_proxy
from epd_proxy.encode.multimodal import collect_media
from epd_proxy.instances.load_signals import LoadSignals
from epd_proxy.placement.choose import choose
from epd_proxy.routing import make_policy
from epd_proxy.routing.cache_aware import OPEN_SLACK_MIN, OPEN_SLACK_REL, OPEN_WINDOW, CacheAware
from epd_proxy.routing.policies import LeastLoaded, LoadAware, PowerOfTwo, RoundRobin
from epd_proxy.routing.view import EMPTY_VIEW, MEDIA_CHARS, RequestView, anchored_view, key_of
from epd_proxy.wire.blobs import Blob, decode_chat_body
from epd_proxy.wire.errors import ProxyError


class Inst:
    """What a policy reads of an instance."""

    def __init__(self, url, inflight=0):
        self.url = url
        self.inflight = inflight
        self.requests = 0  # served so far: load-aware ties go to the fewest
        self.signals = LoadSignals()

    def __repr__(self):
        return self.url


def insts(n):
    return [Inst(f"http://10.0.0.{i}:8000") for i in range(n)]


def Keyed(anchor):
    """A request known only by its anchor (all history: the full slack)."""
    return anchored_view(anchor)


class Item:
    def __init__(self, uuid):
        self.uuid = uuid


def chat(*turns, system="You are a helpful assistant who answers briefly."):
    """A conversation: user, assistant, user, ... texts."""
    msgs = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": msgs}


def view_of(body, chat_path=True):
    items = collect_media(body) if chat_path else []
    return RequestView(body, items, chat_path)


# -- rendezvous: stability and agreement ----------------------------------------------------------

def test_an_instance_leaving_moves_only_its_own_keys():
    pool = insts(5)
    policy = CacheAware()
    keys = [key_of(f"conversation-{k}") for k in range(2000)]
    before = {k: policy.choose(pool, Keyed(k)) for k in keys}
    gone = pool[2]
    rest = [i for i in pool if i is not gone]
    after = {k: policy.choose(rest, Keyed(k)) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(before[k] is gone for k in moved)  # only the leaver's keys move ...
    assert sum(before[k] is gone for k in keys) == len(moved)  # ... all of them ...
    assert len({after[k] for k in moved}) == 4  # ... spread over the others, not piled on one
    # and it coming back takes exactly its keys back
    assert {k: policy.choose(pool, Keyed(k)) for k in keys} == before


def test_an_instance_joining_takes_keys_only_for_itself():
    pool = insts(4)
    policy = CacheAware()
    keys = [key_of(f"c{k}") for k in range(1000)]
    before = {k: policy.choose(pool, Keyed(k)) for k in keys}
    new = Inst("http://10.0.0.9:8000")
    after = {k: policy.choose(pool + [new], Keyed(k)) for k in keys}
    moved = [k for k in keys if before[k] is not after[k]]
    assert moved and all(after[k] is new for k in moved)
    assert 100 < len(moved) < 300  # about a fifth


def test_the_order_of_the_candidates_does_not_matter():
    pool = insts(4)
    policy = CacheAware()
    for k in range(200):
        key = key_of(str(k))
        assert policy.choose(pool, Keyed(key)) is policy.choose(pool[::-1], Keyed(key))
        assert policy.choose(pool, Keyed(key)).url == rendezvous_order([i.url for i in pool], key)[0]


def test_separate_processes_agree_whatever_their_hash_seed():
    """Replicas and --workers share nothing: the pick is a function of the URLs and the body."""
    body = chat("Tell me about the moon.", "It is far.", "How far?")
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    code = ("import sys, msgspec; from epd_proxy.routing.view import RequestView, instance_seed, mix64;"
            "b = msgspec.json.decode(sys.argv[1]); v = RequestView(b, [], True);"
            "print(max(sys.argv[2:], key=lambda u: mix64(v.anchor ^ instance_seed(u))), v.anchor)")
    src = str(Path(epd_proxy.__file__).resolve().parents[1])
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=src)
        out = subprocess.run([sys.executable, "-c", code, msgspec.json.encode(body).decode(), *urls], env=env,
                             capture_output=True, text=True, check=True, timeout=30).stdout
        outs.add(out.strip())
    here = view_of(body).anchor
    assert outs == {f"{rendezvous_order(urls, here)[0]} {here}"}


# -- the load bound --------------------------------------------------------------------------------

def test_a_loaded_preferred_instance_is_passed_over_in_rendezvous_order():
    pool = insts(4)
    policy = CacheAware(balance_abs=2, balance_rel=1.5)
    key = key_of("hot")
    order = rendezvous_order([i.url for i in pool], key)
    by_url = {i.url: i for i in pool}
    first, second = by_url[order[0]], by_url[order[1]]
    assert policy.choose(pool, Keyed(key)) is first
    first.inflight = 2  # within min 0 + 2
    assert policy.choose(pool, Keyed(key)) is first
    assert policy.spills == 0
    first.inflight = 3  # beyond it: the next in rendezvous order
    assert policy.choose(pool, Keyed(key)) is second
    assert policy.spills == 1
    second.inflight = 3
    assert policy.choose(pool, Keyed(key)).url == order[2]
    for i in pool:  # everyone busy alike: back to the first
        i.inflight = 10
    assert policy.choose(pool, Keyed(key)) is first
    first.inflight = 14  # 10 + 2 < 14 but 14 <= 10 x 1.5: still within the relative bound
    assert policy.choose(pool, Keyed(key)) is first
    first.inflight = 16
    assert policy.choose(pool, Keyed(key)) is second


def test_scraped_load_counts_in_the_bound():
    pool = insts(2)
    policy = CacheAware(balance_abs=1, balance_rel=1.0)
    key = key_of("k")
    first = next(i for i in pool if i.url == rendezvous_order([p.url for p in pool], key)[0])
    first.signals.update(running=5, waiting=3, kv_usage=0.2, own_inflight=0, now=0.0)
    assert policy.choose(pool, Keyed(key)) is not first
    first.signals.forget()
    assert policy.choose(pool, Keyed(key)) is first


def test_reuse_is_the_history_share_after_the_preamble():
    assert view_of(chat("hello there")).reuse == 0.0  # an opening turn: nothing of its own cached yet
    two = view_of(chat("a" * 30, "b" * 50, "c" * 20)).reuse
    assert two == pytest.approx(80 / 100)  # 80 characters of history, 20 new: the system prompt not counted
    four = view_of(chat("a" * 30, "b" * 50, "c" * 20, "d" * 50, "e" * 20)).reuse
    assert four == pytest.approx(150 / 170) and four > two  # grows with the history
    assert view_of(chat("hello", system="s" * 10_000)).reuse == 0.0  # however long the preamble
    with_image = {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]},
        {"role": "assistant", "content": "a cat"},
        {"role": "user", "content": "and now?"}]}
    assert view_of(with_image).reuse == pytest.approx((4 + MEDIA_CHARS + 5) / (4 + MEDIA_CHARS + 5 + 8))
    # Nothing to call the new turn, or a prompt: all of it may be cached (the slack as before).
    assert view_of({"model": "m", "messages": [{"role": "system", "content": "x"}]}).reuse == 1.0
    assert RequestView({"prompt": "p" * 100}, [], False).reuse == 1.0


def test_an_opening_turn_goes_where_it_waits_least_and_a_long_history_stays():
    """Moving an opening turn costs its next turn only the opening's text; moving a long
    history costs all of it: the slack scales with the history share."""
    pool = insts(3)
    policy = CacheAware(balance_abs=4, balance_rel=1.5)
    opening = view_of(chat("what is the capital of France?"))
    later = view_of(chat("what is the capital of France?", "Paris. " * 40, "and of Spain?"))
    assert later.anchor == opening.anchor
    first = next(i for i in pool if i.url == rendezvous_order([p.url for p in pool], opening.anchor)[0])
    assert policy.choose(pool, opening) is first  # all idle: the preferred instance
    first.inflight = 1
    opened = policy.choose(pool, opening)
    assert opened is not first and opened.inflight == 0  # busy: the least loaded instead of waiting
    # A replica that did not route the opening sends the history to the preferred instance,
    # within the slack ...
    other = CacheAware(balance_abs=4, balance_rel=1.5)
    assert other.choose(pool, later) is first
    first.inflight = 4
    assert CacheAware(balance_abs=4, balance_rel=1.5).choose(pool, later) is not first  # ... and no further
    for i in pool:  # equally busy: nothing to gain by moving
        i.inflight = 3
    assert policy.choose(pool, opening) is first


def test_the_views_marks_chain_a_conversations_turns():
    one = view_of(chat("hi"))
    two = view_of(chat("hi", "hello!", "how are you?"))
    three = view_of(chat("hi", "hello!", "how are you?", "fine.", "good"))
    assert one.previous == 0 and one.mark
    assert two.previous == one.mark and three.previous == two.mark
    assert len({one.mark, two.mark, three.mark}) == 3
    assert view_of(chat("hi", "hello!", "how are you, then?")).previous == one.mark  # the new turn is free
    assert view_of(chat("hi", "HELLO", "how are you?")).previous == one.mark  # so is the answer
    assert view_of(chat("hey")).mark != one.mark  # another conversation's opening
    # A tool call answers the messages before it: the turn after it continues the one before.
    tool = {"model": "m", "messages": [*chat("weather?")["messages"],
                                      {"role": "assistant", "tool_calls": [{"id": "c1"}]},
                                      {"role": "tool", "content": "12 C"}]}
    assert view_of(tool).previous == view_of(chat("weather?")).mark
    final = {"model": "m", "messages": [*tool["messages"], {"role": "assistant", "content": "12 C."},
                                       {"role": "user", "content": "thanks"}]}
    assert view_of(final).previous == view_of(tool).mark
    assert RequestView({"prompt": "p"}, [], False).mark == 0 == EMPTY_VIEW.mark == Keyed(5).mark


def test_a_conversation_stays_where_this_proxy_sent_its_previous_turn():
    """Openings are spread by load and counts; the turns after follow the opening wherever it
    went, so the level shares hold for the conversations' lives."""
    pool = insts(3)
    policy = CacheAware()
    turns = [chat(*[f"turn {k} of c{c}" for k in range(2 * t + 1)]) for t in range(5) for c in range(60)]
    homes = {}
    for body in turns:  # each round: one turn of each of 60 conversations
        view = view_of(body)
        inst = policy.choose(pool, view)
        homes.setdefault(view.anchor, inst)
        assert inst is homes[view.anchor]
    per = Counter(i.url for i in homes.values())
    assert max(per.values()) - min(per.values()) <= OPEN_SLACK_MIN  # the openings' level shares
    # Some openings went elsewhere than their rendezvous-first instance, and their later turns
    # followed them there.
    assert sum(homes[a].url != rendezvous_order([i.url for i in pool], a)[0] for a in homes) >= 1


def test_a_home_holds_within_the_bound_and_follows_a_spill():
    pool = insts(3)
    policy = CacheAware(balance_abs=4, balance_rel=1.5)
    t1 = view_of(chat("q1"))
    home = policy.choose(pool, t1)
    home.inflight = 3  # within the slack: the history stays
    t2 = view_of(chat("q1", "a1" * 50, "q2"))
    assert policy.choose(pool, t2) is home
    assert policy.choose(pool, t2) is home  # the same turn sent again (a retry) too
    home.inflight = 9  # past it: the turn spills, and the conversation's home moves with it
    t3 = view_of(chat("q1", "a1" * 50, "q2", "a2" * 50, "q3"))
    moved = policy.choose(pool, t3)
    assert moved is not home
    home.inflight = 0
    t4 = view_of(chat("q1", "a1" * 50, "q2", "a2" * 50, "q3", "a3" * 50, "q4"))
    assert policy.choose(pool, t4) is moved  # where the whole history now is
    # The home left the candidates: rendezvous among the rest, and the home is that now.
    rest = [i for i in pool if i is not moved]
    t5 = view_of(chat("q1", "a1" * 50, "q2", "a2" * 50, "q3", "a3" * 50, "q4", "a4", "q5"))
    there = policy.choose(rest, t5)
    assert there.url == rendezvous_order([i.url for i in rest], t5.anchor)[0]


def test_a_turn_another_replica_served_hands_the_conversation_to_rendezvous():
    """Two replicas, turns alternating: from the first turn a replica did not see, both send
    the conversation to the instance they compute alike."""
    pool = insts(3)
    a, b = CacheAware(), CacheAware()
    opening = view_of(chat("q1"))
    preferred = next(i for i in pool if i.url == rendezvous_order([p.url for p in pool], opening.anchor)[0])
    preferred.inflight = 1
    assert a.choose(pool, opening) is not preferred  # the opening, moved for load
    preferred.inflight = 0
    history = ["q1"]
    for turn in range(2, 8):
        history += [f"a{turn - 1}" * 30, f"q{turn}"]
        replica = b if turn % 2 == 0 else a
        assert replica.choose(pool, view_of(chat(*history))) is preferred


def test_a_new_instance_takes_openings_not_the_conversations_this_proxy_holds():
    pool = insts(3)
    policy = CacheAware()
    convs = [[f"c{c}"] for c in range(90)]
    homes = {c: policy.choose(pool, view_of(chat(*h))) for c, h in enumerate(convs)}
    new = Inst("http://10.0.0.9:8000")
    grown = pool + [new]
    for c, h in enumerate(convs):  # their next turns stay where their histories are
        h += [f"answer {c}" * 20, "more"]
        assert policy.choose(grown, view_of(chat(*h))) is homes[c]
    fresh = Counter(policy.choose(grown, view_of(chat(f"new {k}"))).url for k in range(40))
    assert fresh[new.url] >= 10  # the new instance fills with openings
    # A replica that routed none of those turns sends about a quarter of them to the new one.
    other = CacheAware()
    moved = sum(other.choose(grown, view_of(chat(*h))) is new for h in convs)
    assert 10 <= moved <= 35


def test_the_homes_are_bounded(monkeypatch):
    monkeypatch.setattr("epd_proxy.routing.cache_aware.HOMES", 50)
    pool = insts(3)
    policy = CacheAware()
    for c in range(200):
        policy.choose(pool, view_of(chat(f"c{c}")))
    assert len(policy._homes) == 50
    assert view_of(chat("c199")).anchor in policy._homes and view_of(chat("c0")).anchor not in policy._homes


def test_openings_keep_the_instances_shares_level():
    """Single prompts share nothing: rendezvous alone would scatter them like dice; the
    openings' counts keep every instance within the slack of the fewest."""
    pool = insts(3)
    policy = CacheAware()
    for k in range(300):
        policy.choose(pool, view_of(chat(f"prompt {k}", system=f"own system prompt {k}")))
    counts = sorted(policy._openings.values())
    assert sum(counts) == 300 and counts[-1] - counts[0] <= max(OPEN_SLACK_MIN, OPEN_SLACK_REL * counts[-1]) + 1
    # whereas their preferred instances alone are lumpy (this is what the counts even out)
    firsts = Counter(rendezvous_order([i.url for i in pool], view_of(chat(f"prompt {k}",
                     system=f"own system prompt {k}")).anchor)[0] for k in range(300))
    assert max(firsts.values()) - min(firsts.values()) > counts[-1] - counts[0]


def test_an_instance_new_to_the_openings_takes_a_level_share_not_a_flood():
    pool = insts(3)
    policy = CacheAware()
    for k in range(300):
        policy.choose(pool, view_of(chat(f"prompt {k}")))
    new = Inst("http://10.0.0.9:8000")
    got = Counter(policy.choose(pool + [new], view_of(chat(f"later {k}"))).url for k in range(40))
    slack = OPEN_SLACK_REL * 110  # the counts are about 100 each
    assert got[new.url] <= 40 // 4 + slack + 1  # its catch-up is at most one slack ...
    assert got[new.url] >= 40 // 4  # ... and its share at least level


def test_the_openings_window_forgets_instances_that_left():
    pool = insts(3)
    policy = CacheAware()
    for k in range(OPEN_WINDOW * 3):
        policy.choose(pool if k < OPEN_WINDOW else pool[:2], view_of(chat(f"prompt {k}")))
    assert set(policy._openings) == {pool[0].url, pool[1].url}
    assert max(policy._openings.values()) < OPEN_WINDOW


def test_no_anchor_falls_back_to_load():
    pool = insts(3)
    pool[0].inflight = pool[1].inflight = 2
    assert CacheAware().choose(pool, EMPTY_VIEW) is pool[2]


# -- encoders: per item --------------------------------------------------------------------------

def test_the_same_item_goes_to_the_same_encoder_and_a_request_spreads_its_items():
    pool = insts(3)
    policy = CacheAware()
    a = [policy.assign(pool, [Item("img-a")])[0] for _ in range(5)]
    assert len(set(a)) == 1
    many = policy.assign(pool, [Item(f"img-{k}") for k in range(30)])
    assert len(set(many)) == 3
    # the same item twice in a request stays on one encoder (it encodes it once) ...
    assert len(set(policy.assign(pool, [Item("img-a")] * 12))) == 1
    # ... a request's distinct items count against each other, and a hot item spills once its
    # encoder is loaded past the bound
    home = a[0]
    home.inflight = 5
    assert policy.assign(pool, [Item("img-a")])[0] is not home


def test_round_robin_assign_is_the_reference_cursor():
    pool = insts(3)
    rr = RoundRobin()
    got = [rr.assign(pool, [Item("x")] * n) for n in (1, 2, 4)]
    assert got == [[pool[0]], [pool[1], pool[2]], [pool[0], pool[1], pool[2], pool[0]]]


def test_least_loaded_assign_counts_the_requests_own_items():
    pool = insts(3)
    pool[0].inflight = 1
    got = LeastLoaded().assign(pool, [Item("x")] * 5)
    assert sorted(got.count(i) for i in pool) == [1, 2, 2] and got.count(pool[0]) == 1


# -- load-aware ----------------------------------------------------------------------------------------

def test_load_aware_reads_the_scraped_queue_and_kv_usage():
    pool = insts(3)
    policy = LoadAware()
    pool[0].signals.update(running=4, waiting=2, kv_usage=0.1, own_inflight=0, now=0.0)
    pool[1].signals.update(running=0, waiting=0, kv_usage=0.95, own_inflight=0, now=0.0)
    assert {policy.choose(pool) for _ in range(3)} == {pool[2]}
    pool[2].inflight = 7  # scores: 4 + 2 = 6 (0.1 is far from full); 8 x 0.2 / 0.25 = 6.4; 7
    assert policy.choose(pool) is pool[0]


def test_kv_usage_far_from_full_does_not_break_ties():
    """Idle instances tie however full their KV caches were at the last scrape, as long as
    none is nearly full: requests rotate over them instead of all going to the emptiest."""
    pool = insts(3)
    for inst, kv in zip(pool, (0.05, 0.3, 0.6)):
        inst.signals.update(running=0, waiting=0, kv_usage=kv, own_inflight=0, now=0.0)
    policy = LoadAware()
    assert {policy.choose(pool) for _ in range(3)} == set(pool)
    pool[2].signals.update(running=0, waiting=0, kv_usage=0.9, own_inflight=0, now=1.0)
    assert pool[2] not in {policy.choose(pool) for _ in range(4)}


def test_the_scraped_queue_excludes_this_proxys_own_requests():
    s = LoadSignals()
    s.update(running=3, waiting=1, kv_usage=0.0, own_inflight=3, now=0.0)
    assert s.others == 1
    s.update(running=1, waiting=0, kv_usage=0.0, own_inflight=3, now=1.0)
    assert s.others == 0  # never negative (scrape and counts are not simultaneous)


def test_power_of_two_takes_the_lower_of_two():
    pool = insts(2)
    pool[0].inflight = 3
    policy = PowerOfTwo(seed=7)
    assert {policy.choose(pool) for _ in range(20)} == {pool[1]}
    three = insts(3)
    three[1].inflight = 9
    picks = [policy.choose(three) for _ in range(200)]
    assert set(picks) == {three[0], three[2]}  # the busiest always meets a less busy one


def test_make_policy_knows_every_name():
    for name in ("round-robin", "least-loaded", "load-aware", "power-of-two", "cache-aware"):
        assert make_policy(name).choose(insts(2)) is not None
    with pytest.raises(ValueError, match="known: round-robin"):
        make_policy("random")


# -- the request's keys -------------------------------------------------------------------------------

def test_every_turn_of_a_conversation_has_its_anchor():
    t1 = view_of(chat("What is the tallest mountain?"))
    t2 = view_of(chat("What is the tallest mountain?", "Everest.", "And the second?"))
    t3 = view_of(chat("What is the tallest mountain?", "Everest.", "And the second?", "K2.", "Third?"))
    assert t1.anchor == t2.anchor == t3.anchor != 0
    other = view_of(chat("What is the longest river?", "Everest.", "And the second?"))
    assert other.anchor != t1.anchor
    system = view_of(chat("What is the tallest mountain?", system="You are a pirate."))
    assert system.anchor != t1.anchor


def test_the_anchor_reads_parts_and_media_by_uuid():
    def body(url, text="Describe this"):
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "image_url", "image_url": {"url": url}}]}]}
    a, a2, b = view_of(body("https://x/a.png")), view_of(body("https://x/a.png")), view_of(body("https://x/b.png"))
    assert a.anchor == a2.anchor != b.anchor
    assert a.items == [collect_media(body("https://x/a.png"))[0].uuid]
    assert view_of(body("https://x/a.png", "Other")).anchor != a.anchor


def test_a_large_inline_image_is_keyed_by_its_uuid_without_its_bytes():
    data = "data:image/png;base64," + "QUJD" * 4096
    raw = msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": data}}]}]})
    body = decode_chat_body(raw)
    assert isinstance(body["messages"][0]["content"][1]["image_url"]["url"], Blob)
    view = view_of(body)
    plain = view_of(msgspec.json.decode(raw))
    assert view.anchor == plain.anchor != 0 and view.items == plain.items


def test_completions_anchor_on_the_prompts_beginning():
    base = "word " * 300  # 1500 characters: past the anchor's 1 KiB
    a = view_of({"prompt": base + "first question"}, chat_path=False)
    b = view_of({"prompt": base + "a different continuation"}, chat_path=False)
    assert a.anchor == b.anchor != 0
    assert view_of({"prompt": "short one"}, False).anchor != view_of({"prompt": "short two"}, False).anchor
    ids = view_of({"prompt": list(range(300))}, False)
    assert ids.anchor == view_of({"prompt": list(range(256)) + [7] * 50}, False).anchor != 0
    assert view_of({"prompt": [[1, 2, 3]]}, False).anchor == view_of({"prompt": [1, 2, 3]}, False).anchor
    assert view_of({"prompt": [1 << 70]}, False).anchor == 0  # not token ids: no anchor, no error
    assert view_of({"prompt": "x"}, False).items == []


async def test_an_ejected_instance_gives_up_only_its_conversations_and_takes_them_back():
    """Through the pool's health filter: ejection and re-admission move only the ejected
    instance's keys. The turns this proxy moved stay where their history now is."""
    from epd_proxy.config import InstanceSpec
    from epd_proxy.instances.health import OutlierSettings
    from epd_proxy.instances.pool import InstancePool

    pool = InstancePool("prefill", [InstanceSpec(f"http://10.0.0.{i}:8000", "prefill") for i in range(4)],
                        policy=CacheAware(), outlier=OutlierSettings(fail_threshold=1))
    # Later turns (an opening has nothing to keep and is placed by load and counts), first as
    # a replica that saw none of them sees them: by the anchor alone.
    views = [view_of(chat(f"Conversation number {k}", "an answer", "next")) for k in range(400)]
    keyed = [Keyed(v.anchor) for v in views]
    before = [choose(pool, view=v) for v in keyed]
    victim = pool.instances[1]
    pool.outliers.probe_failed(victim, "timeout", "probe")  # a failed probe ejects (uncapped)
    assert victim.state == "ejected"
    during = [choose(pool, view=v) for v in keyed]
    assert all(d is b for b, d in zip(before, during) if b is not victim)
    assert victim not in during and sum(b is victim for b in before) > 50
    pool.outliers.record_success(victim)  # it answers again
    assert victim.healthy
    assert [choose(pool, view=v) for v in keyed] == before
    # The same turns with their shapes: this proxy remembers where it sent each. Those it
    # moved off the ejected instance stay on the instance that now holds them.
    assert [choose(pool, view=v) for v in views] == before
    pool.outliers.probe_failed(victim, "timeout", "probe")
    during = [choose(pool, view=v) for v in views]
    pool.outliers.record_success(victim)
    assert [choose(pool, view=v) for v in views] == during
    await pool.close()


_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4), max_leaves=12)
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio", "image_embeds",
                                                        "refusal"])},
                              optional={"text": _json, "image_url": _json, "input_audio": _json, "uuid": _json})
_message = st.fixed_dictionaries({"role": _json}, optional={"content": _json | st.lists(_part, max_size=3)})


@settings(max_examples=50, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=4), prompt=_json)
def test_the_keys_of_any_accepted_body_never_raise(messages, prompt):
    """The keys are computed inside the policy's choice: an exception there would be a 500."""
    body = {"model": "m", "messages": messages}
    try:
        items = collect_media(decode_chat_body(msgspec.json.encode(body)))
    except ProxyError:
        items = None
    if items is not None:
        view = RequestView(body, items, True)
        assert isinstance(view.anchor, int) and isinstance(view.mark, int) and isinstance(view.previous, int)
        assert 0.0 <= view.reuse <= 1.0
    view = RequestView({"prompt": prompt}, [], False)
    assert isinstance(view.anchor, int) and isinstance(view.mark, int) and isinstance(view.previous, int)
    assert view.reuse == 1.0


def test_load_aware_ties_go_to_the_instance_that_served_fewest():
    """Under light load every instance is often idle: ties then level the request counts
    (an instance that served more, e.g. longer requests of the same rate, gets the next ones
    only when the others caught up)."""
    pool = insts(3)
    pool[0].requests, pool[1].requests, pool[2].requests = 5, 3, 4
    policy = LoadAware()
    picks = []
    for _ in range(6):
        inst = policy.choose(pool)
        inst.requests += 1
        picks.append(inst)
    assert picks[:3] == [pool[1], pool[1], pool[2]]
    assert sorted(i.requests for i in pool) == [6, 6, 6]
