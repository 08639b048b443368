"""Spec: what a generated kernel is specialised on. Kept apart from plan.py (sympy, the
passes) so that a call whose kernel is already generated never imports them."""
from __future__ import annotations

from dataclasses import dataclass


def sm(target: str) -> int:
    """Compute capability of a target as one number ("cuda-sm90" -> 90); 0 for the interpreter."""
    return int(target.removeprefix("cuda-sm")) if target.startswith("cuda-sm") else 0


@dataclass(frozen=True)
class Spec:
    """What a kernel is specialised on: everything else (B, lengths, strides, scale) is runtime."""
    dtype: str        # "float16" | "bfloat16" | "float32"
    head_dim: int
    head_dim_v: int
    group: int        # query heads per K/V head (1: MHA)
    target: str       # "interpreter" or "cuda-sm90" etc.
    dropout: bool = False    # dropout_p > 0 in training: the RNG is compiled in (else compiled out)
    learnable: tuple = ()    # bwd: numbers of the float captures that need a gradient
    atomic_dq: bool = False  # bwd: dq by atomics (measured alternative to the dq kernel)
    deterministic: bool = False  # bwd: capture gradients in order-independent fixed point
    shrink: int = 0          # > 0 after the chosen tiles ran out of shared memory: smaller tiles
    positive_scale: bool = True  # fwd, kv: scale > 0 (with an identity score_mod, plan.fold_scale)
    tma: str = "off"         # fwd: K/V tiles through tensor descriptors (TMA): "off", "auto" (where it
                             # measured faster, tiles.tma_pays), "on" (always)
    ws: str = "off"          # fwd: the persistent warp-specialised kernel (attn_fwd_ws): "off", "auto"
                             # (where it measured faster, tiles.ws_pays / ws_kv), "on" (where it fits)
    tiles: tuple = ()        # ((kernel function, (block_m, block_n, num_warps, num_stages)), ...):
                             # tiles the autotuner measured fastest (attncc.tune), replacing the table
    in_range: tuple = ()     # fwd, bwd: numbers of the captured tensors every index stays inside at the
                             # call's lengths (attncc.checks.captures_in_range): loaded without bounds masks
    tier: str = "triton"     # fwd: the template set, "triton" (templates/) or "gluon" (templates/sm90/),
                             # chosen by attncc.tiers.choose
    offsets: bool = False    # fwd, bwd, Gluon tier: the kernels take the positions of the call's first
                             # query and key (context parallelism's chunks; the Triton tier always does)
