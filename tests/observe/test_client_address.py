"""The client's address (client_address.py): the peer, or X-Forwarded-For's walked right to
left past trusted proxies, as nginx's real_ip_recursive does."""

from epd_proxy.observe.client_address import client_address, peer_host, trusted_networks

LB = trusted_networks(["10.0.0.0/8", "fd00::/8"])


def test_without_trusted_proxies_the_peer_is_the_client():
    assert client_address("10.1.1.1", b"203.0.113.7", ()) == "10.1.1.1"
    assert client_address("10.1.1.1", None, LB) == "10.1.1.1"


def test_an_untrusted_peer_is_the_client_whatever_it_forwards():
    assert client_address("198.51.100.9", b"203.0.113.7", LB) == "198.51.100.9"


def test_the_chain_is_walked_right_to_left_past_trusted_addresses():
    assert client_address("10.1.1.1", b"203.0.113.7", LB) == "203.0.113.7"
    # A client-written entry left of the real client is not believed.
    assert client_address("10.1.1.1", b"1.1.1.1, 203.0.113.7, 10.2.2.2", LB) == "203.0.113.7"
    assert client_address("10.1.1.1", b"203.0.113.7,10.2.2.2 ,  10.3.3.3", LB) == "203.0.113.7"
    # Every hop trusted: the leftmost.
    assert client_address("10.1.1.1", b"10.9.9.9, 10.2.2.2", LB) == "10.9.9.9"
    assert client_address("fd00::1", b"2001:db8::5, fd00::2", LB) == "2001:db8::5"
    # Ports and brackets as some proxies write them.
    assert client_address("10.1.1.1", b"203.0.113.7:5123", LB) == "203.0.113.7"
    assert client_address("10.1.1.1", b"[2001:db8::5]:443", LB) == "2001:db8::5"


def test_an_entry_that_is_not_an_address_stops_at_the_peer():
    assert client_address("10.1.1.1", b"203.0.113.7, unknown", LB) == "10.1.1.1"
    assert client_address("10.1.1.1", b" , ", LB) == "10.1.1.1"


def test_peer_host():
    assert peer_host(("127.0.0.1", 5000)) == "127.0.0.1"
    assert peer_host(("::1", 5000, 0, 0)) == "::1"
    assert peer_host(("::ffff:10.1.1.1", 5000, 0, 0)) == "10.1.1.1"
    assert peer_host(None) == "-" and peer_host("") == "-"
    # A mapped peer is matched as its IPv4 address.
    assert client_address(peer_host(("::ffff:10.1.1.1", 1, 0, 0)), b"203.0.113.7", LB) == "203.0.113.7"
