"""The media content key's hash: BLAKE3 (``encode/multimodal.py``) against sha256, as a ratio.

Both hash the same bytes (base64 text, as a ``data:`` URL carries) in one process, in
interleaved samples: each sample times ``--reps``-scaled repetitions of one and then the other,
the order alternating, and the ratio of the pair is kept. On a shared machine absolute times
move with the load; the median of the pairs' ratios does much less. The sizes are a URL
(64 bytes), 1 KiB, the 150 KiB image of the ``mm`` workload and 1 MiB.

    /work/main/.venv/bin/python scripts/content_key_hash.py [--samples 300]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import statistics
import sys
import time

import blake3

from epd_proxy.encode.multimodal import _digest_hex

SIZES = {"64 B (a URL)": 64, "1 KiB": 1 << 10, "150 KiB": 150 << 10, "1 MiB": 1 << 20}


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def ratios(data: memoryview, samples: int) -> tuple[list[float], float, float]:
    """Per sample, BLAKE3's time over sha256's; and each one's fastest time per call, in µs."""
    reps = max(5, 300_000 // max(len(data), 1000))
    out, fastest = [], {sha256_hex: float("inf"), _digest_hex: float("inf")}
    for n in range(samples):
        took = {}
        for f in (sha256_hex, _digest_hex) if n % 2 == 0 else (_digest_hex, sha256_hex):
            start = time.perf_counter_ns()
            for _ in range(reps):
                f(data)
            took[f] = (time.perf_counter_ns() - start) / reps / 1000
            fastest[f] = min(fastest[f], took[f])
        out.append(took[_digest_hex] / took[sha256_hex])
    return out, fastest[sha256_hex], fastest[_digest_hex]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=300)
    args = parser.parse_args()
    print(f"Python {sys.version.split()[0]}, blake3 {blake3.__version__}")
    for name, size in SIZES.items():
        data = memoryview(base64.b64encode(os.urandom(size))[:size])
        got, sha_us, b3_us = ratios(data, args.samples)
        low, _, high = statistics.quantiles(got, n=4)
        print(f"{name:>14}: blake3/sha256 {statistics.median(got):.3f} (quartiles {low:.3f}-{high:.3f}); "
              f"fastest call: sha256 {sha_us:.1f} µs, blake3 {b3_us:.1f} µs")


if __name__ == "__main__":
    main()
