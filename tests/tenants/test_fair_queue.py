"""The fair queue: classes first, keys by weight within a class, an idle key starting now."""

from epd_proxy.tenants.fair_queue import FairQueue


def test_one_flow_is_fifo():
    q = FairQueue()
    for i in range(5):
        q.push(i)
    assert [q.pop() for _ in range(5)] == [0, 1, 2, 3, 4] and q.pop() is None and len(q) == 0


def test_a_higher_class_goes_first_and_a_flood_does_not_starve_a_light_key():
    q = FairQueue()
    for i in range(10):
        q.push(("flood", i), "flood", rank=1)
    q.push(("light", 0), "light", rank=1)
    q.push(("vip", 0), "vip", rank=2)
    order = [q.pop() for _ in range(12)]
    assert order[0] == ("vip", 0)
    assert order.index(("light", 0)) <= 2  # behind at most one of the flood's, not ten


def test_weights_share_three_to_one():
    q = FairQueue()
    for _ in range(40):
        q.push("a", "a", weight=3)
        q.push("b", "b", weight=1)
    first = [q.pop() for _ in range(40)]
    assert first.count("a") == 30 and first.count("b") == 10


def test_an_idle_key_starts_at_the_present():
    q = FairQueue()
    for _ in range(20):
        q.push("a", "a")
    for _ in range(10):
        q.pop()  # a ran alone for a while
    q.push("b", "b")
    q.push("b", "b")
    nxt = [q.pop() for _ in range(4)]
    assert nxt.count("b") == 2  # b's missed turns are not owed to it, nor held against it


def test_remove_and_the_lowest_waiter_and_drain():
    q = FairQueue()
    q.push("x", "k", rank=0)
    q.push("y", "k", rank=0)
    q.push("z", "j", rank=1)
    assert q.lowest_below(2) == ("y", "k", 0) and q.lowest_below(0) is None
    assert q.remove("y", "k", 0) and not q.remove("y", "k", 0) and q.remove("x", "k", 0)
    assert q.lowest_below(2) == ("z", "j", 1) and len(q) == 1
    q.push("w", "k", rank=0)
    assert sorted(q.drain()) == ["w", "z"] and len(q) == 0 and q.pop() is None
