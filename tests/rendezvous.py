"""The rendezvous order, written out for the tests: what ``cache-aware`` tries first to last
for a key when every instance is within the load bound, from the package's own seed and mix
(``routing/view.py``), so a test can name the instance a policy should pick."""

from collections.abc import Sequence

from epd_proxy.routing.view import instance_seed, mix64


def rendezvous_order(urls: Sequence[str], key: int) -> list[str]:
    return sorted(urls, key=lambda u: mix64(key ^ instance_seed(u)), reverse=True)
