"""What media a client may ask the encoders (and consumers) to fetch.

Encoders fetch ``http(s)`` media themselves and read ``file://`` paths when
they run with ``--allowed-local-media-path``. A client that names
``http://169.254.169.254/`` or ``http://127.0.0.1:8200/`` would make them
request a cloud metadata service or another instance's API from inside the
cluster. The proxy is the front door, so it refuses at once (400) a scheme
the operator did not allow, a host that is a literal loopback, private,
link-local, unspecified, reserved or multicast address (in any spelling a URL
library resolves: ``0x7f000001``, ``2130706433``, ``127.1``,
``[::ffff:127.0.0.1]``), ``localhost``, and more media items than the limit.
Host names are not resolved: DNS is the fetcher's business (vLLM has its own
domain allow-list).

Pure: built once from the configuration, called with a request's items.
"""

from __future__ import annotations

import ipaddress
import socket
import unicodedata
from typing import Iterable, Sequence
from urllib.parse import unquote, urlsplit

from epd_proxy.config import MediaConfig
from epd_proxy.encode.multimodal import MediaItem, media_url
from epd_proxy.wire.blobs import Blob
from epd_proxy.wire.errors import bad_request

_IPV4_CHARS = frozenset("0123456789abcdefx.")
_NO_HOST_SCHEMES = frozenset(("data", "file"))

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def literal_address(host: str) -> Address | None:
    """The IP address a URL host denotes literally, or None for a name.

    IPv4 is read the way ``inet_aton`` (and so ``getaddrinfo``) reads it:
    ``127.1``, ``0x7f000001``, ``2130706433`` and ``0177.0.0.1`` are all
    loopback. A percent-encoded or full-width spelling is decoded first, as
    URL libraries do.
    """
    if "%" in host and ":" not in host:
        host = unquote(host)
    if not host.isascii():
        host = unicodedata.normalize("NFKC", host)
    host = host.lower().rstrip(".")
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            return None
    if host and host[0].isdigit() and set(host) <= _IPV4_CHARS:
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _embedded_v4(addr: Address) -> ipaddress.IPv4Address | None:
    if isinstance(addr, ipaddress.IPv6Address):
        return addr.ipv4_mapped or addr.sixtofour
    return None


def is_internal(addr: Address) -> bool:
    """Loopback, private, link-local, unspecified, reserved or multicast: not a
    public unicast address (or one that embeds such an IPv4 address)."""
    if not addr.is_global or addr.is_multicast:
        return True
    inner = _embedded_v4(addr)
    return inner is not None and is_internal(inner)


def check_config(media: MediaConfig) -> None:
    """``--allowed-media-hosts`` and friends, beside the policy that parses them."""
    MediaPolicy.of(media)


class MediaPolicy:
    """The media rules of one proxy: item limit, URL schemes, and internal hosts
    allowed by name or network."""

    def __init__(self, *, max_items: int, schemes: Iterable[str], allowed_hosts: Iterable[str] = ()) -> None:
        self.max_items = max_items
        self.schemes = frozenset(s.strip().lower().rstrip(":") for s in schemes if s.strip())
        self._schemes_text = ", ".join(sorted(self.schemes)) or "none"
        self._names: set[str] = set()
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in allowed_hosts:
            entry = entry.strip().lower().rstrip(".")
            if not entry:
                continue
            try:
                self._networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry or " " in entry:
                    raise ValueError(f"--allowed-media-hosts {entry!r} is neither a host name nor a CIDR") from None
                self._names.add(entry)

    @classmethod
    def of(cls, media: MediaConfig) -> MediaPolicy:
        """The policy of the config's media section."""
        return cls(max_items=media.max_media_items, schemes=media.allowed_media_schemes,
                   allowed_hosts=media.allowed_media_hosts)

    def check(self, items: Sequence[MediaItem]) -> None:
        """Raise a 400 for the first item the policy refuses."""
        if len(items) > self.max_items:
            raise bad_request(f"too many media items: {len(items)} (this proxy accepts at most "
                              f"{self.max_items} per request, --max-media-items)", "messages")
        for item in items:
            url = media_url(item.part)
            if url is not None:
                reason = self.refusal(url)
                if reason is not None:
                    raise bad_request(reason, f"messages[{item.message_index}].content[{item.part_index}]")

    def refusal(self, url: str | Blob) -> str | None:
        """Why a media URL is refused, or None if it may be fetched."""
        if isinstance(url, Blob) or url[:5].lower() == "data:":
            # A lifted literal (blobs.py) is always a data: URL.
            return None if "data" in self.schemes else self._scheme_refused("data")
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            return "media URL is not a valid URL"
        scheme = parts.scheme
        if scheme not in self.schemes:
            return self._scheme_refused(scheme)
        if scheme in _NO_HOST_SCHEMES or not host:
            if scheme not in _NO_HOST_SCHEMES:
                return "media URL has no host"
            return None
        return self._host_refusal(host)

    def _scheme_refused(self, scheme: str) -> str:
        shown = repr(scheme) if scheme else "(none)"
        return f"media URL scheme {shown} is not allowed (allowed: {self._schemes_text})"

    def _host_refusal(self, host: str) -> str | None:
        name = host.lower().rstrip(".")
        if name in self._names:
            return None
        addr = literal_address(host)
        if addr is None:
            if name == "localhost" or name.endswith(".localhost"):
                return "media URL names the loopback host; it is not allowed (see --allowed-media-hosts)"
            return None
        if not is_internal(addr):
            return None
        inner = _embedded_v4(addr)
        for net in self._networks:
            if addr in net or (inner is not None and inner in net):
                return None
        return (f"media URL names an internal address ({addr}: loopback, private, link-local, "
                "unspecified, reserved or multicast); it is not allowed (see --allowed-media-hosts)")
