import ipaddress

import pytest

from epd_proxy.encode.media_policy import MediaPolicy, is_internal, literal_address
from epd_proxy.encode.multimodal import collect_media
from epd_proxy.wire.blobs import decode_chat_body
from epd_proxy.wire.errors import ProxyError

DEFAULT = MediaPolicy(max_items=999, schemes=("http", "https", "data"))


@pytest.mark.parametrize("host, want", [
    ("127.0.0.1", "127.0.0.1"),
    ("0x7f000001", "127.0.0.1"),
    ("2130706433", "127.0.0.1"),
    ("127.1", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0x7f.1", "127.0.0.1"),
    ("127.0.0.1.", "127.0.0.1"),
    ("%31%32%37.0.0.1", "127.0.0.1"),
    ("\uff11\uff12\uff17.0.0.1", "127.0.0.1"),  # full-width digits
    ("::ffff:127.0.0.1", "::ffff:7f00:1"),
    ("fe80::1%eth0", "fe80::1"),
    ("::1", "::1"),
    ("example.com", None),
    ("cafe", None),
    ("1.2.3.4.5", None),
    ("[::1", None),
])
def test_literal_address_reads_hosts_like_a_resolver(host, want):
    got = literal_address(host)
    assert (str(got) if got is not None else None) == want


@pytest.mark.parametrize("addr, internal", [
    ("127.0.0.1", True), ("10.0.0.1", True), ("172.16.0.1", True), ("192.168.1.1", True),
    ("169.254.169.254", True), ("0.0.0.0", True), ("100.64.0.1", True), ("224.0.0.1", True),
    ("255.255.255.255", True), ("::1", True), ("::", True), ("fe80::1", True), ("fc00::1", True),
    ("ff02::1", True), ("::ffff:10.0.0.1", True), ("2002:7f00:1::", True),
    ("8.8.8.8", False), ("93.184.216.34", False), ("2606:4700::1111", False),
])
def test_is_internal(addr, internal):
    assert is_internal(ipaddress.ip_address(addr)) is internal


@pytest.mark.parametrize("url", ["https://example.com/a.png", "http://8.8.8.8/a.png", "data:image/png;base64,AA",
                                 "DATA:image/png;base64,AA", "HTTPS://EXAMPLE.COM/A.PNG", "http://[2606:4700::1111]/"])
def test_public_media_urls_pass(url):
    assert DEFAULT.refusal(url) is None


@pytest.mark.parametrize("url, fragment", [
    ("file:///etc/passwd", "scheme 'file'"),
    ("gopher://x/", "scheme 'gopher'"),
    ("ftp://example.com/a.png", "scheme 'ftp'"),
    ("a.png", "scheme (none)"),
    ("http:///a.png", "no host"),
    ("http://[::1/", "not a valid URL"),
    ("http://localhost:8000/", "loopback"),
    ("http://x.localhost/", "loopback"),
    ("http://[::ffff:127.0.0.1]/", "internal address"),
    ("http://0x7f000001/", "internal address"),
    ("http://169.254.169.254/latest/meta-data/", "internal address"),
])
def test_refused_media_urls_say_why(url, fragment):
    reason = DEFAULT.refusal(url)
    assert reason is not None and fragment in reason


def test_allowed_hosts_take_names_and_networks():
    policy = MediaPolicy(max_items=9, schemes=("http", "https"),
                         allowed_hosts=("127.0.0.0/8", "LocalHost.", "fd00::/8", "10.1.2.3"))
    for url in ("http://127.0.0.1/", "http://2130706433/", "http://localhost/", "http://[fd00::1]/",
                "http://[::ffff:127.0.0.9]/", "http://10.1.2.3/"):
        assert policy.refusal(url) is None, url
    for url in ("http://10.1.2.4/", "http://[::1]/", "http://192.168.0.1/"):
        assert policy.refusal(url) is not None, url


def test_a_bad_allowed_host_entry_is_a_start_up_error():
    with pytest.raises(ValueError, match="neither a host name nor a CIDR"):
        MediaPolicy(max_items=1, schemes=("http",), allowed_hosts=("10.0.0.0/33",))


def _items(*urls):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return collect_media({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]})


def test_check_names_the_item_and_the_limit():
    with pytest.raises(ProxyError) as exc:
        DEFAULT.check(_items("https://x/a.png", "http://10.0.0.1/b.png"))
    assert exc.value.status == 400 and exc.value.param == "messages[0].content[2]"
    small = MediaPolicy(max_items=2, schemes=("https",))
    small.check(_items("https://x/a.png", "https://x/b.png"))
    with pytest.raises(ProxyError) as exc:
        small.check(_items("https://x/a.png", "https://x/b.png", "https://x/c.png"))
    assert exc.value.status == 400 and "--max-media-items" in exc.value.message and "2" in exc.value.message


def test_a_lifted_data_url_is_judged_by_its_scheme():
    url = "data:image/png;base64," + "A" * 4096
    raw = ('{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"%s"}}]}]}' % url).encode()
    items = collect_media(decode_chat_body(raw))
    DEFAULT.check(items)
    with pytest.raises(ProxyError, match="'data'"):
        MediaPolicy(max_items=9, schemes=("https",)).check(items)
