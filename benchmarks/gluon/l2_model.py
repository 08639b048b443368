"""A model of the Gluon backward's L2 traffic, to weigh query-tile orders without a GPU: programs
(one per K/V tile and head) run in waves of one per SM, in lock-step through their query tiles; L2
is an LRU cache of whole tiles (Q, dO, the float32 dQ tile, K and V) of a given capacity. Prints the
DRAM megabytes read (misses) and written (dirty dQ tiles evicted; dK, dV and the final dQ flush not
counted) per order and capacity.

    python benchmarks/gluon/l2_model.py

Calibrated against ncu (full 4x16x4096x128, H200, eighteenth session): at 40 MB the model gives
FA4's order 403 MB read (measured 415) and ours with the rotation 485 (measured 528); the writes
120 + 134 / 159 + 134 (measured 255 / 323)."""
from collections import OrderedDict

SMS = 132


def grid(pairs, n_kv, chunk, fa4):
    """(pair, K/V tile) per program id: FA4's (K/V tile, head, batch) order, or ours (chunks of
    `chunk` pairs, K/V tile major inside a chunk: attn_bwd.py.jinja's _program)."""
    if fa4:
        return [(pair, kv) for pair in range(pairs) for kv in range(n_kv)]
    progs = []
    for pid in range(pairs * n_kv):
        c, r = pid // (chunk * n_kv), pid % (chunk * n_kv)
        size = min(pairs - c * chunk, chunk)
        progs.append((c * chunk + r % size, r // size))
    return progs


def traffic(B, H, N, rotation, chunk, cap_mb, fa4=False, block_m=64, block_kv=128, D=128):
    """(MB read, MB written back) for query tile (step + rotation(kv)) % n_q at each step."""
    n_kv, n_q = N // block_kv, N // block_m
    sizes = {"q": block_m * D * 2, "do": block_m * D * 2, "dq": block_m * D * 4, "kv": block_kv * D * 4}
    cache, used, read, written = OrderedDict(), 0, 0, 0

    def touch(key, dirty=False):
        nonlocal used, read, written
        if key in cache:
            cache[key] = cache.pop(key) or dirty
            return
        read += sizes[key[0]]
        cache[key] = dirty
        used += sizes[key[0]]
        while used > cap_mb * 2**20:
            old, old_dirty = cache.popitem(last=False)
            used -= sizes[old[0]]
            written += sizes[old[0]] if old_dirty else 0

    progs = grid(B * H, n_kv, chunk, fa4)
    for w in range(0, len(progs), SMS):
        wave = progs[w:w + SMS]
        for pair, kv in wave:
            touch(("kv", pair, kv))
        for step in range(n_q):
            for pair, kv in wave:
                tile = (step + rotation(kv)) % n_q
                touch(("q", pair, tile))
                touch(("do", pair, tile))
                touch(("dq", pair, tile), dirty=True)
    return read / 1e6, written / 1e6


ORDERS = {
    "FA4's order": (True, lambda kv: 0),
    "ours, no rotation": (False, lambda kv: 0),
    "ours, rotation": (False, lambda kv: 2 * kv),
    "rot-16": (False, lambda kv: 2 * kv % 16),
    "rot-32": (False, lambda kv: 2 * kv % 32),
}

if __name__ == "__main__":
    print("| shape | L2 MB | " + " | ".join(ORDERS) + " |")
    print("|---|---|" + "---|" * len(ORDERS))
    for B, H, N, chunk in [(4, 16, 4096, 4), (1, 16, 16384, 1)]:
        for cap in (50, 40, 30):
            cells = [traffic(B, H, N, rot, chunk, cap, fa4) for fa4, rot in ORDERS.values()]
            print(f"| {B}x{H}x{N}x128 | {cap} | " + " | ".join(f"{r:.0f} / {w:.0f}" for r, w in cells) + " |",
                  flush=True)
