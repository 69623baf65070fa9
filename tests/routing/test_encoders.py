"""Encoder placement as a pure unit: new media level by estimated work, repeats on their home,
replicas meeting on the rendezvous-top encoder; and the work estimate."""

import base64
from collections import Counter

import msgspec
import pytest
from rendezvous import rendezvous_order

from epd_proxy.encode.multimodal import collect_media
from epd_proxy.instances.load_signals import LoadSignals
from epd_proxy.routing import encoders
from epd_proxy.routing.cache_aware import CacheAware
from epd_proxy.routing.encoders import WORK_DEFAULT, WORK_MAX, WORK_MIN, item_work
from epd_proxy.routing.view import key_of
from epd_proxy.wire.blobs import decode_chat_body


class Inst:
    def __init__(self, url):
        self.url = url
        self.inflight = 0
        self.requests = 0
        self.signals = LoadSignals()

    def __repr__(self):
        return self.url


class Item:
    def __init__(self, uuid, part=None):
        self.uuid = uuid
        self.part = part


def insts(n):
    return [Inst(f"http://10.0.1.{i}:8000") for i in range(n)]


def image(url):
    return {"type": "image_url", "image_url": {"url": url}}


def data_url(nbytes):
    return "data:image/jpeg;base64," + base64.b64encode(b"\xff" * nbytes).decode()


def spread(policy, pool, items):
    return Counter(policy.assign(pool, [it])[0].url for it in items)


def test_thirty_new_images_spread_exactly_level():
    pool = insts(3)
    got = spread(CacheAware(), pool, [Item(f"img-{k}") for k in range(30)])
    assert sorted(got.values()) == [10, 10, 10]
    # ... and in one request too (its items count against each other)
    many = CacheAware().assign(pool, [Item(f"img-{k}") for k in range(30)])
    assert sorted(Counter(many).values()) == [10, 10, 10]


def test_a_repeat_goes_home_and_counts_as_a_hit():
    pool = insts(3)
    policy = CacheAware()
    for k in range(7):  # some history, so the home is not simply the least loaded
        policy.assign(pool, [Item(f"other-{k}")])
    got = spread(policy, pool, [Item("same")] * 10)
    assert list(got.values()) == [10]
    (url,) = got
    placement = policy.encoders
    assert placement.hits == {url: 9}
    assert sum(placement.items.values()) == 17
    assert sum(placement.work.values()) == 8 * WORK_DEFAULT  # repeats add no work


def test_a_repeat_leaves_a_home_loaded_past_the_bound_and_its_home_moves():
    pool = insts(3)
    policy = CacheAware()
    (home,) = policy.assign(pool, [Item("hot")])
    home.inflight = 5  # past --balance-abs 4 above the least loaded
    (moved,) = policy.assign(pool, [Item("hot")])
    assert moved is not home
    home.inflight = 0
    assert policy.assign(pool, [Item("hot")]) == [moved]


def test_a_home_that_left_places_the_item_anew():
    pool = insts(3)
    policy = CacheAware()
    (home,) = policy.assign(pool, [Item("img")])
    rest = [i for i in pool if i is not home]
    assert policy.assign(rest, [Item("img")])[0] in rest


def test_work_not_requests_levels_the_encoders():
    pool = insts(3)
    policy = CacheAware()
    big = Item("big", image(data_url(int(WORK_DEFAULT * 160 * 4))))  # four typical images' work
    (heavy,) = policy.assign(pool, [big])
    got = spread(policy, pool, [Item(f"small-{k}") for k in range(14)])
    assert got[heavy.url] == 2 and sorted(got.values()) == [2, 6, 6]
    assert policy.encoders.work[heavy.url] == pytest.approx(6 * WORK_DEFAULT, abs=0.1)


def test_the_same_item_twice_in_a_request_is_placed_once():
    pool = insts(3)
    policy = CacheAware()
    got = policy.assign(pool, [Item("a"), Item("b"), Item("a")])
    assert got[0] is got[2] and got[1] is not got[0]
    assert sum(policy.encoders.items.values()) == 2


def test_new_items_prefer_the_rendezvous_top_encoder_when_level():
    pool = insts(3)
    urls = [i.url for i in pool]
    policy = CacheAware()
    top = 0
    for k in range(3000):
        (got,) = policy.assign(pool, [Item(f"t{k}")])
        top += got.url == rendezvous_order(urls, key_of(f"t{k}"))[0]
    counts = sorted(policy.encoders.items.values())
    assert counts[-1] / counts[0] <= 1.05  # level within the 5 % slack ...
    assert top >= 0.9 * 3000  # ... and mostly where any replica would look first
    assert policy.encoders.off_top == 3000 - top


def test_replicas_with_different_histories_agree_on_most_new_items():
    pool = insts(3)
    a, b = CacheAware(), CacheAware()
    for k in range(100):
        a.assign(pool, [Item(f"a{k}")])
        b.assign(pool, [Item(f"b{k}")])
    agree = sum(a.assign(pool, [Item(f"s{k}")]) == b.assign(pool, [Item(f"s{k}")]) for k in range(300))
    assert agree >= 0.85 * 300


def test_a_new_encoder_catches_up_by_at_most_the_slack():
    pool = insts(3)
    policy = CacheAware()
    for k in range(300):
        policy.assign(pool, [Item(f"old-{k}")])
    new = Inst("http://10.0.1.9:8000")
    got = spread(policy, pool + [new], [Item(f"new-{k}") for k in range(40)])
    # its level share, plus a catch-up of at most WORK_MAX (16 typical items)
    assert 10 <= got[new.url] <= 10 + 16 + 1


def test_the_homes_are_bounded(monkeypatch):
    monkeypatch.setattr(encoders, "ITEM_HOMES", 8)
    pool = insts(3)
    policy = CacheAware()
    for k in range(20):
        policy.assign(pool, [Item(f"img-{k}")])
    assert len(policy.encoders._homes) == 8
    assert key_of("img-19") in policy.encoders._homes and key_of("img-0") not in policy.encoders._homes


def test_the_shares_window_halves_and_forgets_encoders_that_left():
    pool = insts(3)
    policy = CacheAware()
    for k in range(2000):
        policy.assign(pool if k < 600 else pool[:2], [Item(f"img-{k}")])
    shares = policy.encoders._shares
    assert set(shares) == {pool[0].url, pool[1].url}
    assert max(shares.values()) < encoders.WORK_WINDOW


# -- the work estimate ------------------------------------------------------------------------------

def test_a_remote_url_counts_as_a_typical_item_and_a_video_as_several():
    assert item_work(Item("x", image("https://example.com/a.png"))) == WORK_DEFAULT
    assert item_work(Item("x", {"type": "video_url", "video_url": {"url": "https://e.com/v.mp4"}})) \
        == 8 * WORK_DEFAULT
    assert item_work(Item("x")) == WORK_DEFAULT  # nothing to read


def test_an_inline_item_counts_its_decoded_bytes_within_bounds():
    assert item_work(Item("x", image(data_url(160 * 2000)))) == pytest.approx(2000, abs=0.01)
    assert item_work(Item("x", image(data_url(100)))) == WORK_MIN
    assert item_work(Item("x", image(data_url(160 * 40000)))) == WORK_MAX
    raw = "data:text/plain," + "a" * (160 * 300)  # not base64: the bytes as written
    assert item_work(Item("x", image(raw))) == 300
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"\0" * 160 * 500).decode(),
                                                    "format": "wav"}}
    assert item_work(Item("x", audio)) == pytest.approx(500, abs=0.01)


def test_the_estimate_reads_a_lifted_blob_without_decoding_it():
    url = data_url(160 * 3000)
    body = {"model": "m", "messages": [{"role": "user", "content": [image(url), image(url[:64] + "x")]}]}
    items = collect_media(decode_chat_body(msgspec.json.encode(body)))
    assert type(items[0].part["image_url"]["url"]).__name__ == "Blob"
    assert item_work(items[0]) == pytest.approx(3000, abs=0.01)


def test_an_inline_image_counts_its_patches_whatever_its_file_size():
    from image_files import data_url as image_data_url
    from image_files import jpeg, png

    small, noisy = png(448, 448, seed=0), png(448, 448, seed=7)
    assert len(small) != len(noisy)
    for data in (small, noisy):
        assert item_work(Item("x", image(image_data_url(data)))) == 448 * 448 / (28 * 28)
    photo = image_data_url(jpeg(1024, 896, exif=20000, payload=200000), "image/jpeg")
    assert item_work(Item("x", image(photo))) == 1024 * 896 / (28 * 28)
    assert item_work(Item("x", image(image_data_url(png(20, 20))))) == WORK_MIN
    assert item_work(Item("x", image(image_data_url(png(8000, 8000))))) == WORK_MAX
    body = {"model": "m", "messages": [{"role": "user", "content": [image(photo)]}]}
    (item,) = collect_media(decode_chat_body(msgspec.json.encode(body)))
    assert type(item.part["image_url"]["url"]).__name__ == "Blob"  # read in place, too
    assert item_work(item) == 1024 * 896 / (28 * 28)


def test_images_of_one_size_and_different_file_sizes_spread_exactly_level():
    from image_files import data_url as image_data_url
    from image_files import jpeg

    pool = insts(3)
    images = [Item(f"img-{k}", image(image_data_url(jpeg(800, 600, payload=(5000 + 7919 * k) % 90000),
                                                    "image/jpeg"))) for k in range(30)]
    assert len({len(i.part["image_url"]["url"]) for i in images}) > 20
    assert sorted(spread(CacheAware(), pool, images).values()) == [10, 10, 10]
