"""Microseconds per routing decision (timeit), for docs/architecture.md's "Cost per request".

    PYTHONPATH=src python scripts/routing_cost.py

A chat body of about 7.5 KB (a 1.1 KB system prompt and 13 messages: a later turn) and the
same conversation's opening turn; candidates are plain objects with what a policy reads.
Run it for two checkouts on a quiet machine and compare within one run: timeit figures on
a shared machine move by tens of percent.
"""

import timeit

from epd_proxy.instances.load_signals import LoadSignals
from epd_proxy.routing.cache_aware import CacheAware
from epd_proxy.routing.policies import LoadAware
from epd_proxy.routing.view import RequestView


class Inst:
    def __init__(self, url):
        self.url = url
        self.inflight = 0
        self.requests = 0
        self.signals = LoadSignals()


SYSTEM = "You are a meticulous assistant. " * 35  # about 1.1 KB
LATER = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}] + [
    {"role": "user" if k % 2 == 0 else "assistant", "content": f"message {k} " + "lorem ipsum dolor " * 28}
    for k in range(13)]}
OPENING = {"model": "m", "messages": LATER["messages"][:2]}


def per_call_us(fn, number=20000):
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def main():
    for n in (1, 3, 8):
        pool = [Inst(f"http://10.0.0.{i}:8000") for i in range(n)]
        ca, la = CacheAware(), LoadAware()
        for name, body in (("later turn", LATER), ("opening", OPENING)):
            prefill = per_call_us(lambda ca=ca, pool=pool, body=body: ca.choose(pool, RequestView(body, (), True)))
            pd = per_call_us(lambda ca=ca, la=la, pool=pool, body=body:
                             (ca.choose(pool, RequestView(body, (), True)), la.choose(pool)))
            print(f"{n} instance(s), {name}: view + cache-aware {prefill:.2f} us; "
                  f"+ load-aware decode {pd:.2f} us")


if __name__ == "__main__":
    main()
