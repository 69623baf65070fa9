"""The KV block index at a realistic size: memory and lookup time.

16 instances x 100,000 blocks of 16 tokens (by default): each instance's blocks are
prompts of 64 blocks (1,024 tokens), every prompt opened by one of 8 shared system
prompts of 8 blocks, the rest its own. Memory by tracemalloc; a lookup is a 2,048-token
prompt (128 blocks) whose first 64 blocks one instance holds.

    python scripts/kv_index_size.py [--memory] [--instances 16] [--blocks 100000] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from epd_proxy.kvcache.index import BlockIndex


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-blocks", type=int, default=64)
    ap.add_argument("--memory", action="store_true", help="count memory with tracemalloc (slows the build)")
    args = ap.parse_args()
    bs, per = args.block_size, args.prompt_blocks
    rng = random.Random(1)
    systems = [[rng.randrange(1, 150_000) for _ in range(8 * bs)] for _ in range(8)]
    index = BlockIndex(max_blocks=args.instances * args.blocks + 1)
    held: list[list[int]] = []
    if args.memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    events = 0
    for inst in range(args.instances):
        name = f"http://10.0.0.{inst}:8000"
        engine = inst << 40
        for _ in range(args.blocks // per):
            tokens = systems[rng.randrange(8)] + [rng.randrange(1, 150_000) for _ in range((per - 8) * bs)]
            hashes = [engine + rng.getrandbits(39) for _ in range(per)]
            # as vLLM sends them: the prompt's blocks, then a few more per decode step batch
            index.stored(name, hashes[:per // 2], None, tokens[:per // 2 * bs], bs)
            index.stored(name, hashes[per // 2:], hashes[per // 2 - 1], tokens[per // 2 * bs:], bs)
            events += 2
            if len(held) < 50:
                held.append(tokens)  # about 1.5 MB of the memory counted: a lookup's prompts
    build = time.perf_counter() - t0
    current, peak = tracemalloc.get_traced_memory() if args.memory else (0, 0)
    tracemalloc.stop()
    pairs, keys = len(index), index.keys
    lookups = [held[rng.randrange(len(held))] + [rng.randrange(1, 150_000) for _ in range(per * bs)]
               for _ in range(1000)]
    t0 = time.perf_counter()
    for prompt in lookups:
        index.longest_prefix(prompt)
    lookup = (time.perf_counter() - t0) / len(lookups)
    t0 = time.perf_counter()
    for prompt in lookups:
        index.longest_prefix(prompt, now=0.0)
    lookup_spec = (time.perf_counter() - t0) / len(lookups)
    print(f"instances {args.instances}  blocks/instance {args.blocks}  block size {bs}")
    print(f"pairs {pairs:,}  distinct blocks {keys:,}")
    if args.memory:
        print(f"memory {current / 1e6:.1f} MB ({current / pairs:.0f} B per pair), peak {peak / 1e6:.1f} MB")
    else:
        print(f"events applied {events:,} in {build:.1f} s ({build / events * 1e6:.1f} us each, "
              f"{build / pairs * 1e6:.2f} us per block, token generation included)")
    print(f"lookup of a {len(lookups[0])}-token prompt: {lookup * 1e6:.0f} us "
          f"({lookup_spec * 1e6:.0f} us with speculation on)")


if __name__ == "__main__":
    main()
