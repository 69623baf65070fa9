"""The encoders of a request's media items, as pure logic: the policy's placement among the
candidates, never an encoder that failed the items or timed out, only encoders with room."""

from epd_proxy.config import InstanceSpec
from epd_proxy.encode.multimodal import MediaItem
from epd_proxy.instances.pool import InstancePool
from epd_proxy.placement.media import place_items


def _items(n):
    return [MediaItem(i, 0, i, "image_url", {"type": "image_url", "image_url": {"url": f"http://x/{i}"}}, f"u{i}")
            for i in range(n)]


def _encoders(n):
    return InstancePool("encode", [InstanceSpec(f"http://127.0.0.1:{9300 + i}", "encode") for i in range(n)],
                        policy="round-robin")


async def test_each_item_gets_the_policys_encoder_in_order():
    pool = _encoders(2)
    items = _items(3)
    placed_items, encoders = place_items(pool, items)
    assert placed_items == items and encoders == [pool.instances[0], pool.instances[1], pool.instances[0]]


async def test_never_an_encoder_that_failed_the_items_or_timed_out_and_none_left_is_none():
    pool = _encoders(2)
    a, b = pool.instances
    assert set(place_items(pool, _items(2), failed={a})[1]) == {b}
    assert set(place_items(pool, _items(2), timed_out={b})[1]) == {a}
    assert place_items(pool, _items(2), failed={a}, timed_out={b}) is None


async def test_only_encoders_with_room_and_items_past_it_wait():
    pool = _encoders(2)
    a, b = pool.instances
    assert place_items(pool, _items(2), outstanding={a.url: 2, b.url: 2}, bound=2) == ([], [])
    items = _items(3)
    placed_items, encoders = place_items(pool, items, outstanding={a.url: 2, b.url: 1}, bound=2)
    assert encoders == [b] and len(placed_items) == 1  # one slot left, on b; the rest wait for room
