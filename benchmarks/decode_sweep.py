"""Sweep the decode kernel's tiles and split-KV settings on one GPU (bf16, GQA 8:1, D=128, one query
token): prints, per shape, the time of a decode step replayed from a CUDA graph (the kernels
alone, as a serving loop runs them) and its share of copy bandwidth, best first.

    python benchmarks/decode_sweep.py [--shapes 1x16384,1x131072,8x16384,64x16384] [--paged 64]
                                      [--tiles 16x64x4x3] [--resident 1,2,4] [--min-tiles 2,4]

``--resident`` overrides the programs per SM the split count assumes (default: the estimate of
attncc.inference.resident_programs); ``--min-tiles`` the fewest key tiles per split.
"""
import argparse
import json
import os

import torch

import attncc
from attncc import api, inference
from decode import bench_graph

TILES = [(16, 64, 4, 3), (16, 32, 4, 3), (16, 32, 4, 4), (16, 64, 4, 2), (16, 64, 8, 4), (16, 128, 4, 2)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="1x16384,1x65536,1x131072,8x16384,8x131072,64x16384,64x131072")
    p.add_argument("--paged", type=int, default=0, help="page size (0: contiguous)")
    p.add_argument("--tiles", default="", help="only these decode tiles, e.g. 16x64x4x3")
    p.add_argument("--resident", default="0", help="programs per SM for the split count (0: estimate), e.g. 1,2,4")
    p.add_argument("--min-tiles", default=str(inference.SPLIT_MIN_TILES), help="fewest key tiles per split, e.g. 2,4")
    args = p.parse_args()
    from triton.testing import do_bench
    src = torch.empty(2**31, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    peak = 2 * src.numel() * 2 / do_bench(lambda: dst.copy_(src)) / 1e6
    del src, dst
    print(f"copy bandwidth {peak:.0f} GB/s")
    compiled = attncc.compile(attncc.Variant())
    tile_list = [tuple(map(int, s.split("x"))) for s in args.tiles.split(",")] if args.tiles else TILES
    estimate = inference.resident_programs
    settings = [(int(r), int(m)) for r in args.resident.split(",") for m in args.min_tiles.split(",")]
    for shape in args.shapes.split(","):
        B, L = map(int, shape.split("x"))
        q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
        if args.paged:
            cache = attncc.PagedKVCache(B * -(-L // args.paged), args.paged, 4, 128, torch.bfloat16, "cuda", seed=0)
        else:
            cache = attncc.KVCache(B, L, 4, 128, torch.bfloat16, "cuda")
        cache.append(*(torch.randn(B, L, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
        kv_bytes = B * L * 4 * 256 * 2
        results = []
        for tiles in tile_list:
            os.environ["ATTNCC_TILES"] = json.dumps({"attn_kv_decode": tiles})
            api._loaded.clear()
            inference._setups.clear()
            for resident, min_tiles in settings:
                inference.resident_programs = (lambda *a, r=resident: r) if resident else estimate
                inference.SPLIT_MIN_TILES = min_tiles
                ms = bench_graph(lambda: compiled.with_kvcache(q, cache))
                results.append((ms, tiles, resident or "est", min_tiles))
        results.sort()
        print(f"\nB={B} Lkv={L} ({'paged ' + str(args.paged) if args.paged else 'contiguous'})")
        for ms, tiles, resident, min_tiles in results:
            print(f"  {1e3 * ms:8.1f} us  {kv_bytes / ms / 1e6 / peak:5.0%} of copy BW  tiles={tiles} "
                  f"programs/SM={resident} min tiles/split={min_tiles}")
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
