"""The Gluon tier on a machine without a GPU: where it is chosen and why, and that every rendered
Gluon kernel compiles for sm90 (Triton compiles Gluon down to ptxas without a device), so a
template error fails here and not at a user's first call; a few rendered kernels are kept whole
as snapshots (tests/snapshots/sm90/). Their schedules and steps run in Python in
tests/test_gluon_python.py; correctness on the GPU: tests/test_gpu_gluon.py."""
from __future__ import annotations

import difflib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

import attncc
from attncc import codegen, plan, runtime, tiers
from attncc.spec import Spec
from variants import BUILDERS, NAMES

# The generated Gluon modules these tests load import triton; where that import is the process's
# first, the CPU tests after them would find triton without its interpreter: import it as attncc's
# CPU calls do (interpreter on, on a machine without CUDA)
runtime._triton(for_cpu=True)

GLUON_VARIANTS = [n for n in NAMES if n != "document"]


def _variant(name, H=4, L=1000):
    if name == "row_biases":  # learnable: gated biases per (head, query) and per key
        qb, kb = torch.randn(H, L), torch.randn(L)
        return attncc.Variant(lambda s, b, h, q, k: s + torch.tanh(s) * (qb[h, q] + kb[k]),
                              BUILDERS["causal"](2, H, L, L, "cpu")[1])
    if name == "trig":
        return attncc.Variant(lambda s, b, h, q, k: s + torch.sin(s) * torch.cos(0.5 * s)
                              + torch.sigmoid(s), BUILDERS["causal"](2, H, L, L, "cpu")[1])
    return attncc.Variant(*BUILDERS[name](2, H, L, L, "cpu"))


def test_tier_choice(monkeypatch):
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    causal = _variant("causal")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False)[0] == "gluon"
    assert tiers.choose(causal, "cuda-sm90", "float16", 128, 128, False)[0] == "gluon"
    for args, why in [(("cuda-sm90", "bfloat16", 64, 64, False), "measured slower"),
                      (("cuda-sm90", "float32", 128, 128, False), "float16 and bfloat16"),
                      (("cuda-sm90", "bfloat16", 128, 128, True), "dropout"),
                      (("cuda-sm90", "bfloat16", 128, 64, False), "equal head dims"),
                      (("cuda-sm80", "bfloat16", 128, 128, False), "sm90"),
                      (("cuda-sm100", "bfloat16", 128, 128, False), "sm90"),
                      (("interpreter", "bfloat16", 128, 128, False), "sm90")]:
        tier, reason = tiers.choose(causal, *args)
        assert tier == "triton" and why in reason, (args, reason)
    # a mask reading tensors: the forward's key loops run from tile lists (attncc.blocks); at head dim 64
    # its loads spill three warp groups' registers, and two measured slower than the Triton tier
    document = _variant("document")
    assert tiers.choose(document, "cuda-sm90", "bfloat16", 128, 128, False, length=8192)[0] == "gluon"
    tier, reason = tiers.choose(document, "cuda-sm90", "bfloat16", 128, 128, False, length=8191)
    assert tier == "triton" and "(< 8192)" in reason
    tier, reason = tiers.choose(document, "cuda-sm90", "bfloat16", 64, 64, False, length=16384)
    assert tier == "triton" and "three consumer warp groups" in reason
    tier, reason = tiers.choose(attncc.Variant(lambda s, b, h, q, k: s + torch.atan(s)), "cuda-sm90", "bfloat16",
                                128, 128, False)
    assert tier == "triton" and "atan" in reason
    rows = torch.randn(1000, 16)
    tier, reason = tiers.choose(attncc.Variant(lambda s, b, h, q, k: s + torch.dot(rows[q], rows[k])), "cuda-sm90",
                                "bfloat16", 128, 128, False)
    assert tier == "triton" and "tile product" in reason
    # head dim 64: three consumer warp groups (the identity score_mod, a mask that does not band
    # the keys), from 4096 queries and keys
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, length=4096)[0] == "gluon"
    long, short = (torch.zeros(1, 2, n, 64, dtype=torch.bfloat16) for n in (4096, 4095))
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, (long, long, long))[0] == "gluon"
    for tensors in [(long, short, short), (short, long, long)]:
        tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, tensors)
        assert tier == "triton" and "4095 queries or keys (< 4096)" in reason, reason
    # ... and from 2048 where no mask cuts the keys (every query tile runs all key tiles)
    full = attncc.Variant()
    assert tiers.choose(full, "cuda-sm90", "bfloat16", 64, 64, False, length=2048)[0] == "gluon"
    tier, reason = tiers.choose(full, "cuda-sm90", "bfloat16", 64, 64, False, length=2047)
    assert tier == "triton" and "2047 queries or keys (< 2048)" in reason, reason
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, length=2048)[0] == "triton"
    # ... and from 2048 where GQA's query heads share the tiles (tiles.packs_gqa: a group dividing 64,
    # a mask that does not read h; not on chunks of a longer sequence)
    q, kv = torch.zeros(1, 8, 2048, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 2048, 64, dtype=torch.bfloat16)
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, (q, kv, kv))[0] == "gluon"
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 64, 64, False, (q, kv, kv))[0] == "triton"
    by_head = attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (h < 4))
    assert tiers.choose(by_head, "cuda-sm90", "bfloat16", 64, 64, False, (q, kv, kv))[0] == "triton"
    q6, kv2 = torch.zeros(1, 6, 2048, 64, dtype=torch.bfloat16), torch.zeros(1, 2, 2048, 64, dtype=torch.bfloat16)
    tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, (q6, kv2, kv2))  # 3 does not divide 64
    assert tier == "triton" and "2048 queries or keys (< 4096)" in reason, reason
    q, kv = q[:, :, :2047], kv[:, :, :2047]
    tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False, (q, kv, kv))
    assert tier == "triton" and "2047 queries or keys (< 2048)" in reason, reason
    # ... and at head dim 128 a score_mod other than the identity from 2048
    for name in ("alibi", "softcap"):
        assert tiers.choose(_variant(name), "cuda-sm90", "bfloat16", 128, 128, False, length=2048)[0] == "gluon"
        tier, reason = tiers.choose(_variant(name), "cuda-sm90", "bfloat16", 128, 128, False, length=2047)
        assert tier == "triton" and "2047 queries or keys (< 2048)" in reason, reason
    # ... and one that gathers a table by position from 512
    assert tiers.choose(_variant("rel_bias"), "cuda-sm90", "bfloat16", 128, 128, False, length=512)[0] == "gluon"
    tier, reason = tiers.choose(_variant("rel_bias"), "cuda-sm90", "bfloat16", 128, 128, False, length=511)
    assert tier == "triton" and "(< 512)" in reason, reason
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False, length=17)[0] == "gluon"
    # ... and with two warp groups at head dim 64: a score_mod from 16384, one that gathers a table
    # by position from 1024 (ALiBi's slopes are read per head: not a gather), a banded mask from 1024
    key_bias = torch.randn(4096)  # read per key: not a gather per score
    per_key = attncc.Variant(lambda s, b, h, q_idx, kv_idx: s + key_bias[kv_idx], BUILDERS["causal"](2, 4, 8, 8, "cpu")[1])
    for variant, shortest in ((_variant("alibi"), 16384), (_variant("softcap"), 16384), (per_key, 16384),
                              (_variant("rel_bias"), 1024), (_variant("sliding_window"), 1024)):
        tier, reason = tiers.choose(variant, "cuda-sm90", "bfloat16", 64, 64, False, length=shortest)
        assert tier == "gluon" and "two consumer warp groups" in reason, (variant, reason)
        tier, reason = tiers.choose(variant, "cuda-sm90", "bfloat16", 64, 64, False, length=shortest - 1)
        assert tier == "triton" and f"(< {shortest})" in reason, (variant, reason)
    q = torch.zeros(1, 2, 8, 256, dtype=torch.bfloat16)[..., ::2]  # head-dim stride 2: no TMA box
    tier, reason = tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False, (q, q, q))
    assert tier == "triton" and "TMA" in reason
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 64, 64, False)[0] == "gluon"
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 80, 80, False)[0] == "triton"
    monkeypatch.setenv("ATTNCC_TIER", "triton")
    assert tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False) == ("triton", "ATTNCC_TIER=triton")
    monkeypatch.setenv("ATTNCC_TIER", "fast")
    with pytest.raises(attncc.AttnccError, match="ATTNCC_TIER='fast' is not one of auto, triton, gluon"):
        tiers.choose(causal, "cuda-sm90", "bfloat16", 128, 128, False)


def test_interpreted_calls_keep_the_triton_tier(monkeypatch):
    """CPU tensors run the Triton tier's kernels whatever ATTNCC_TIER asks (Gluon has no interpreter)."""
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    q = torch.randn(1, 2, 17, 16)
    out = attncc.attention(q, q, q, mask_mod=BUILDERS["causal"](1, 2, 17, 17, "cpu")[1])
    ref = attncc.reference.attention(q.double(), q.double(), q.double(), None, BUILDERS["causal"](1, 2, 17, 17, "cpu")[1])
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert all(spec.tier == "triton" for (_, kind, spec) in attncc.api._loaded if kind == "fwd")


def test_explain_and_source_name_the_tier(monkeypatch):
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    kernel = attncc.compile(_variant("alibi"))
    text = kernel.explain()
    # a score_mod other than the identity: the Gluon forward from 2048 queries and keys at head dim 128
    assert ("forward, sm90, bfloat16, head dim 128: triton (head dim 128, an unknown length (< 2048): the Gluon "
            "forward measured slower (tiers.gluon_pays)); from 2048 queries and keys: gluon") in text, text
    assert ("head dim 64: triton (head dim 64, an unknown length (< 16384): the Gluon forward measured slower "
            "(tiers.gluon_pays)); from 16384 queries and keys: gluon (sm90, bfloat16, head dim 64: measured faster "
            "(two consumer warp groups))") in text, text
    src = kernel.source("fwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    assert "Gluon tier" not in src  # source() shows what a call of unknown length runs
    src = attncc.compile(_variant("causal")).source("fwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    assert "Gluon tier (Hopper)" in src and "def producer(" in src and "def consumer(" in src
    assert "Gluon tier" not in kernel.source("fwd", dtype=torch.bfloat16, head_dim=64, target="cuda-sm90")
    # the Gluon backward runs from the K/V length where it measured faster (tiers.gluon_bwd_pays);
    # source() shows what a call of unknown length runs
    assert ("backward, sm90, bfloat16, head dim 128: triton (head dim 128, an unknown number of keys (< 1024): "
            "the Gluon backward measured slower") in text
    assert "; from 1024 keys: gluon (sm90, bfloat16, head dim 128, 1024 keys: measured faster)" in text
    assert "head dim 64, an unknown number of keys (< 1024)" in text and "; from 1024 keys: gluon" in text
    assert "Gluon tier" not in kernel.source("bwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    softcap = attncc.compile(_variant("softcap"))
    assert "head dim 128: triton (head dim 128, an unknown" in softcap.explain()
    assert "; from 1024 keys: gluon" in softcap.explain()
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    bwd = kernel.source("bwd", dtype=torch.bfloat16, head_dim=128, target="cuda-sm90")
    assert "Gluon tier (Hopper)" in bwd and "def attn_bwd(" in bwd and "_tma_add(" in bwd
    assert "backward, sm90, bfloat16, head dim 128: gluon (ATTNCC_TIER=gluon)" in softcap.explain()


def test_backward_tier_choice_follows_the_measurements(monkeypatch):
    """Auto: the Gluon backward from 1024 keys at head dims 64 and 128 (any score_mod), from 2048
    under GQA; ATTNCC_TIER=gluon anywhere it fits."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    causal, softcap = _variant("causal"), _variant("softcap")

    def tier(variant, d, group, kv_len):
        spec = Spec("bfloat16", d, d, group, "cuda-sm90", tier="gluon")
        return tiers.choose_backward(variant, spec, (), False, kv_len)

    assert tier(causal, 128, 1, 1024)[0] == "gluon" and tier(causal, 128, 1, None)[0] == "triton"
    assert tier(softcap, 128, 1, 1024)[0] == "gluon" and tier(causal, 128, 4, 16384)[0] == "gluon"
    assert tier(causal, 64, 4, 2048)[0] == "gluon" and tier(softcap, 64, 1, 1024)[0] == "gluon"
    plain = attncc.Variant()
    assert tier(plain, 128, 1, 1024)[0] == "gluon" and tier(plain, 128, 1, 1023)[0] == "triton"
    assert tier(plain, 64, 1, 1024)[0] == "gluon" and tier(softcap, 128, 1, 1023)[0] == "triton"
    # GQA with a mask that reads h: each query head's programs bound their own tiles
    per_head = attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 96 * (h + 1)))
    assert tier(per_head, 64, 4, 4096)[0] == "gluon"
    spec = Spec("bfloat16", 64, 64, 4, "cuda-sm90", tier="gluon")
    assert "SPLIT_HEADS_FROM = 0\n" in codegen.render(plan.build("bwd", per_head.analysis, spec, per_head.captures))
    assert "SPLIT_HEADS_FROM = 8192\n" in codegen.render(plan.build("bwd", causal.analysis, spec, causal.captures))
    spec = Spec("bfloat16", 128, 128, 4, "cuda-sm90", tier="gluon")
    assert "SPLIT_HEADS_FROM = 4096\n" in codegen.render(plan.build("bwd", causal.analysis, spec, causal.captures))
    for args, why in [((causal, 128, 1, 1023), "128, 1023 keys (< 1024)"), ((causal, 64, 1, 1000), "(< 1024)"),
                      ((causal, 128, 4, 1023), "128, GQA, 1023 keys (< 1024)"), ((causal, 64, 2, 1000), "GQA"),
                      ((causal, 80, 1, 16384), "equal head dims of 64 or 128")]:
        got, reason = tier(*args)
        assert got == "triton" and why in reason, (args, reason)
    assert tiers.choose_backward(causal, Spec("bfloat16", 128, 128, 1, "cuda-sm90"), (), True, None)[0] == "triton"
    # a mask reading tensors (tile lists): from 4096 keys at head dim 128, 16384 at 64
    document = _variant("document")
    assert tier(document, 128, 1, 4096)[0] == "gluon" and tier(document, 64, 1, 16384)[0] == "gluon"
    for args, why in [((document, 128, 1, 4095), "a mask reading tensors, 4095 keys (< 4096)"),
                      ((document, 64, 1, 16383), "(< 16384)")]:
        got, reason = tier(*args)
        assert got == "triton" and why in reason, (args, reason)
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    assert tier(causal, 128, 4, 100) == ("gluon", "ATTNCC_TIER=gluon")


def test_backward_tier_choice_for_learnable_tables(monkeypatch):
    """Learnable captures keep the Triton tier's backward under auto, except relative-position tables
    (read at q_idx - kv_idx only: their diagonal sums measured faster on the Gluon tier), which need
    triton 3.6's padded shared-memory views; a table read at both positions otherwise never runs there."""
    monkeypatch.delenv("ATTNCC_TIER", raising=False)
    rel, alibi = _variant("rel_bias"), _variant("alibi")
    table = rel.captures[0].tensor
    grid = attncc.Variant(lambda s, b, h, q, k: s + table[h, q + k])  # both positions, not their difference

    def tier(variant):
        spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon")
        return tiers.choose_backward(variant, spec, (0,), False, 4096)

    monkeypatch.setattr(tiers, "padded_views", lambda: True)
    assert tier(rel)[0] == "gluon"
    assert tier(alibi)[0] == "triton" and "measured slower" in tier(alibi)[1]
    assert tier(grid)[0] == "triton" and "other than through q_idx - kv_idx" in tier(grid)[1]
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    assert tier(alibi)[0] == "gluon" and tier(grid)[0] == "triton"
    monkeypatch.setattr(tiers, "padded_views", lambda: False)
    assert tier(rel)[0] == "triton" and "padded view" in tier(rel)[1]


# Rendered Gluon kernels kept whole under tests/snapshots/sm90/: a change to the templates, the plan
# or the printer that alters one shows here as a diff to read (pytest --update-snapshots rewrites them)
SNAPSHOTS = Path(__file__).parent / "snapshots" / "sm90"
SNAPSHOT_CASES = [("fwd", "causal", 128, 1, "bfloat16"), ("fwd", "full", 64, 1, "bfloat16"),  # two / three warp groups
                  ("fwd", "alibi", 128, 4, "float16"),  # a captured tensor, GQA
                  ("fwd", "causal", 64, 4, "bfloat16"),  # GQA's query heads packed into the tile (plan.pack_gqa)
                  ("fwd", "document", 128, 1, "bfloat16"),  # a mask reading tensors: tile lists drive the loops
                  ("bwd", "softcap", 128, 1, "bfloat16"), ("bwd", "sliding_window", 64, 2, "bfloat16"),
                  ("fwd-cp", "causal", 128, 1, "bfloat16"), ("bwd-cp", "prefix_lm", 128, 1, "bfloat16"),
                  ("bwd-learn", "rel_bias", 128, 1, "bfloat16")]  # a relative-position table's diagonal sums


@pytest.mark.parametrize("kind,name,d,group,dtype", SNAPSHOT_CASES,
                         ids=[f"{k}-{n}-d{d}-g{g}-{t}" for k, n, d, g, t in SNAPSHOT_CASES])
def test_rendered_gluon_source_matches_snapshot(kind, name, d, group, dtype, request):
    variant = _variant(name, H=2 * group)
    learnable = tuple(range(len(variant.captures))) if kind.endswith("-learn") else ()
    spec = Spec(dtype, d, d, group, "cuda-sm90", tier="gluon", offsets=kind.endswith("-cp"), learnable=learnable)
    source = codegen.render(plan.build(kind.split("-")[0], variant.analysis, spec, variant.captures))
    path = SNAPSHOTS / f"{kind}_{name}_d{d}_g{group}_{dtype}.py"
    if request.config.getoption("--update-snapshots"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    want = path.read_text() if path.exists() else ""
    if source != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), source.splitlines(True), str(path), "rendered", n=2))
        pytest.fail(f"the rendered kernel differs from {path} (if the change is meant, rerun with --update-snapshots "
                    f"and commit the file):\n{diff[:6000]}")


def test_context_parallel_tier_choice():
    """context_parallel's chunk kernels: the Gluon tier where it fits, its kernels rendered with
    Q_OFF and KV_OFF (plan.offsets, which the Triton tier leaves off: it takes them always), and
    the backward's Spec inherits them."""
    causal = _variant("causal")
    chunks = tuple(torch.zeros(1, 2, 512, 128, dtype=torch.bfloat16) for _ in range(3))
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, False, chunks)[0] == "gluon"
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, True, chunks)[0] == "triton"  # dropout
    strided = tuple(torch.zeros(1, 2, 512, 129, dtype=torch.bfloat16)[..., :128] for _ in range(3))
    assert tiers.choose_chunks(causal, "cuda-sm90", "bfloat16", 128, 128, False, strided)[0] == "triton"
    for tier in ("gluon", "triton"):
        spec = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier=tier, offsets=True)
        for kind in ("fwd", "bwd"):
            built = plan.build(kind, causal.analysis, spec, causal.captures)
            assert built.offsets == (tier == "gluon")
            if tier == "gluon":
                src = codegen.render(built)
                assert re.search(r"q_idx = gl\.expand_dims\(.*\) \+ p\.Q_OFF$", src, re.M), kind
                assert "q_off=0, kv_off=0" in src, kind
    compiled = attncc.compile(causal)
    fwd = Spec("bfloat16", 128, 128, 1, "cuda-sm90", tier="gluon", offsets=True)
    bwd = compiled.bwd_spec(fwd, (), False, 4096)
    assert bwd.tier == "gluon" and bwd.offsets


# Run in a process of its own: with the interpreter on (as in the CPU tests) Triton's own library
# functions are interpreter objects that Gluon cannot compile, and a fresh TRITON_CACHE_DIR makes
# it compile rather than find an earlier result.
COMPILE = """
import json, sys
from pathlib import Path
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature
from attncc import runtime
path, d, group, dtype, shapes, kind = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), getattr(torch, sys.argv[4]),
                                      json.loads(sys.argv[5]), sys.argv[6])
module = runtime.load(Path(path), False, Path(path).read_text())
B, H, Lq, Lkv = 2, 2 * group, 300, 777
q, out = (torch.zeros(B, H, Lq, d, dtype=dtype) for _ in range(2))
k = torch.zeros(B, H // group, Lkv, d, dtype=dtype)
rows = torch.zeros(B, H, Lq)
caps = []
for shape in shapes:
    c = torch.zeros(shape)
    caps += [c] + [x for dim in range(c.dim()) for x in (c.shape[dim], c.stride(dim))]
    if kind == "bwd-learn":  # every capture learnable: its float32 gradient and strides follow it
        caps += [torch.zeros(shape)] + list(c.stride())
target = GPUTarget("cuda", 90, 128)
backend = make_backend(target)


def compile_for_sm90(fn, args, kwargs):
    fn = fn.fn  # the module's kernels are attncc.launcher.Launchers: the Gluon JITFunction inside
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


offsets = [1024, 513] if kind.endswith("-cp") else []  # Q_OFF, KV_OFF: a chunk of a longer sequence
# a data-dependent mask's tile lists (attncc.blocks): counts and indices of partial and full tiles, CLS_OUTER, CLS_INNER
lists = [torch.zeros(64, dtype=torch.int32) for _ in range(4)] + [5, 7] if module.BLOCK_SPARSE else []
if kind.startswith("fwd"):
    block_m, block_n, _, stages = module.LAUNCH_TILES["attn_fwd"]
    pack = module.PACK  # query heads packed into a tile's rows (GQA)
    args = [module._descriptor(q, block_m, pack), module._descriptor(k, block_n), module._descriptor(k, block_n),
            module._descriptor(out, block_m, pack), rows, *caps, *lists,
            *([torch.zeros(64, dtype=torch.int32)] if module.BLOCK_SPARSE else []),  # the tiles' order (LONGEST_FIRST)
            torch.zeros(1, dtype=torch.int32), H,
            B * H // pack, Lq, Lkv, 4, 0.125, *offsets]  # sections of 4
    dynamic = not module.PERSISTENT  # tiles of unequal work: the tile counter's code (static for the others)
    compiled = compile_for_sm90(module.attn_fwd, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                                                            GROUP=group, WGS=module.WGS, PACK=pack, DYNAMIC=dynamic,
                                                            num_warps=4,
                                                            maxnreg=168 if module.WGS == 2 else 128))
else:
    block_m, block_n, _, stages = module.LAUNCH_TILES["attn_bwd"]
    # as the launcher: query heads per program (bwd-split: a program per query head, as from SPLIT_HEADS_FROM keys)
    heads = 1 if Lkv >= module.SPLIT_HEADS_FROM or kind == "bwd-split" else group
    dkv = k if heads == group else k.float()  # float32 sums where programs share a K/V head
    dq = module._dq_accumulator(B * H * triton.cdiv(Lq, block_m), "cpu")[1]
    args = [module._descriptor(q, block_m), module._descriptor(k, 2 * block_n), module._descriptor(k, 2 * block_n),
            module._descriptor(out, block_m), rows, rows, dq, dkv, dkv, *dkv.stride(), *dkv.stride(), *caps,
            H, B * H // heads, Lq, Lkv, 0.125, -5.5, 3, *offsets, *lists]
    adds = dict(ADD_DKV=True) if offsets else {}  # chunk kernels: the path that adds to earlier pairs' sums
    compiled = compile_for_sm90(module.attn_bwd, args, dict(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, STAGES=stages,
                                                             GROUP=group, HEADS=heads,
                                                             FOLD_LSE=kind != "bwd-nofold", num_warps=4, maxnreg=168,
                                                             ptx_options=module.PTXAS_OPTIONS,
                                                             **adds))
    compile_for_sm90(module.attn_bwd_preprocess, [out, out, rows, rows, rows, rows, torch.zeros(B, H, Lq, d),
                                                  *out.stride(), *out.stride(), H, Lq],
                     dict(HEAD_DIM=d, BLOCK_M=64, HAS_DLSE=True, num_warps=4))
    compile_for_sm90(module.attn_bwd_dq, [torch.zeros(B * H * triton.cdiv(Lq, block_m) * block_m * d), q, *q.stride(), H, Lq],
                     dict(BLOCK_M=block_m, HEAD_DIM=d, num_warps=4))
assert 0 < compiled.metadata.shared <= 232448, compiled.metadata.shared  # an H100's / H200's 227 KiB a block
if kind.startswith("bwd"):  # the module's ptxas options reached ptxas (--register-usage-level=0 at head dim 64)
    assert compiled.metadata.ptx_options == module.PTXAS_OPTIONS == ("--register-usage-level=0" if d <= 64 else None)
assert "wgmma" in compiled.asm["ptx"]
adds = [line for line in compiled.asm["ptx"].splitlines() if "red.global" in line or "atom.global" in line]
print("atomics", sum(".add.f32" in line for line in adds), "vector", sum(".add.v" in line for line in adds),
      "ordered", sum("relaxed" not in line for line in adds))
print("compiled", compiled.metadata.shared, "triton", triton.__version__)
"""
# A folder holding Triton 3.6, the GPU machines' version (.ci/run installs one there): every case
# compiles with it too, since Gluon's API moves between releases (3.9 took a global constexpr tuple
# that 3.6 refused)
TRITON_36 = os.environ.get("ATTNCC_TRITON_36")


TRIG = "trig"  # score_mod with sin, cos and sigmoid (printed as Gluon's functions or its helpers)
CASES = [("fwd", name, 128, 1, "bfloat16") for name in GLUON_VARIANTS + [TRIG, "document"]] + [
    ("fwd", "document", 64, 2, "bfloat16"), ("fwd-cp", "document", 128, 1, "float16"),  # tile lists (block-sparse)
    ("fwd", "causal", 128, 4, "float16"), ("fwd", "alibi", 64, 2, "bfloat16"), ("fwd", "full", 64, 1, "float16"),
    ("fwd", "full", 64, 1, "bfloat16"),  # P rounded in pairs (plan.probs_in_pairs)
    ("fwd", "causal", 64, 4, "bfloat16")] + [
    ("bwd", name, 128, 1, "bfloat16") for name in ("full", "causal", "alibi", "softcap", "rel_bias", TRIG)] + [
    ("bwd", "causal", 128, 4, "float16"), ("bwd", "sliding_window", 64, 2, "bfloat16"),
    ("bwd-split", "causal", 128, 4, "float16"),  # GQA's float32 sums of dK, dV (a program per query head)
    ("bwd", "softcap", 64, 1, "bfloat16"),
    ("bwd", "document", 128, 1, "bfloat16"), ("bwd", "document", 64, 2, "float16"),  # tile lists (block-sparse)
    ("bwd", "sliding_window", 128, 1, "bfloat16"), ("bwd", "prefix_lm", 128, 1, "bfloat16"),  # masks as row intervals
    ("bwd-nofold", "causal", 128, 1, "bfloat16"),  # lse2 read in the step (a scale of 0: FOLD_LSE=False)
    ("bwd-bias", "alibi", 128, 1, "bfloat16"), ("bwd-bias", "alibi", 64, 2, "float16"),  # plan.split_bias
    ("bwd-learn", "alibi", 128, 1, "bfloat16"), ("bwd-learn", "row_biases", 64, 2, "float16"),  # dcap atomics
    ("bwd-learn", "rel_bias", 128, 1, "bfloat16"), ("bwd-learn", "rel_bias", 64, 2, "float16")] + [  # per diagonal
    # context parallelism's kernels at chunk positions (Q_OFF, KV_OFF)
    ("fwd-cp", "causal", 128, 1, "bfloat16"), ("fwd-cp", "sliding_window", 128, 4, "float16"),
    ("fwd-cp", "alibi", 64, 1, "bfloat16"), ("fwd-cp", "full", 64, 2, "bfloat16"),
    ("bwd-cp", "causal", 128, 1, "bfloat16"), ("bwd-cp", "prefix_lm", 64, 2, "bfloat16"),
    ("bwd-cp", "softcap", 128, 4, "float16")]


@pytest.mark.parametrize("kind,name,d,group,dtype", CASES, ids=[f"{k}-{n}-d{d}-g{g}-{t}" for k, n, d, g, t in CASES])
def test_rendered_gluon_kernel_compiles_for_sm90(kind, name, d, group, dtype, tmp_path):
    variant = _variant(name, H=2 * group)
    learnable = tuple(range(len(variant.captures))) if kind == "bwd-learn" else ()
    spec = Spec(dtype, d, d, group, "cuda-sm90", tier="gluon", learnable=learnable, offsets=kind.endswith("-cp"))
    with mock.patch.object(plan, "SPLIT_BIAS", kind == "bwd-bias"):
        built = plan.build(kind.split("-")[0], variant.analysis, spec, variant.captures)
    assert built.split_bias == (kind == "bwd-bias")
    source = codegen.render(built)
    path = tmp_path / f"{kind}_{name}.py"
    path.write_text(source)
    module = runtime.load(path, True, source)  # loads here too (as the interpreter's module: no compile)
    assert module.TIER == "gluon"
    if kind.startswith("fwd"):  # three consumer warp groups where tiles.wide_forward grants them
        assert module.WGS == (3 if d == 64 and name in ("full", "causal") else 2)
    # loaded without runtime.py's `from __future__ import annotations`: Gluon reads the annotations
    helper, param = (module._tile, "p") if kind.startswith("fwd") else (module._program, "p")
    assert not isinstance(inspect.signature(helper.fn).parameters[param].annotation, str)
    shapes = [list(c.tensor.shape) for c in variant.captures]
    # this Triton, then the GPU machines' 3.6 (a relative-position table's gradient: 3.6's Gluon only)
    local = [None] if kind != "bwd-learn" or name != "rel_bias" or tiers.padded_views() else []
    for triton_dir in local + ([TRITON_36] if TRITON_36 else []):
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ATTNCC_INTERPRET")}
        env["TRITON_CACHE_DIR"] = str(tmp_path / f"triton{'-3.6' if triton_dir else ''}")
        if triton_dir:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [triton_dir, env.get("PYTHONPATH")]))
        result = subprocess.run([sys.executable, "-c", COMPILE, str(path), str(d), str(group), dtype, json.dumps(shapes),
                                 kind], capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
        assert not triton_dir or "triton 3.6." in result.stdout, result.stdout  # the folder's Triton ran
        if kind == "bwd-learn":  # one atomic instruction per gradient, loop (masked, whole) and consumer: a
            # value the layout holds twice per thread would be added twice; a relative-position table's
            # diagonal sums two (a tile's query columns are 64)
            grads = plan.build("bwd", variant.analysis, spec, variant.captures).grads
            want = sum(4 * (2 if g.reduce == "diag" else 1) for g in grads)
            assert f"atomics {want} " in result.stdout, result.stdout
        if "atomics" in result.stdout:  # sums, not synchronisation: relaxed (an acq_rel atomic orders memory)
            assert " ordered 0" in result.stdout, result.stdout


def test_gluon_backward_query_tiles():
    """Head dim 64 takes query tiles of 128 where the score_mod's derivative is 1, it reads no table
    per score and the mask leaves whole tiles; a dscore tile (softcap) or a gathered bias (relative
    bias) beside them spilled, and a mask whose bounds leave no whole tile runs every 128-row step
    with its spilling mask code: those keep tiles of 64, as head dim 128."""
    def tiles(name, d):
        variant = name if isinstance(name, attncc.Variant) else _variant(name)
        spec = Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")
        return plan.build("bwd", variant.analysis, spec, variant.captures).tiles["attn_bwd"].block_m
    assert [tiles(n, 64) for n in ("full", "causal", "alibi", "softcap", "document")] == [128, 128, 128, 64, 64]
    # ... and so does a table gathered per score (the relative bias's 128-row step spilled); ALiBi's bias is computed
    assert tiles("rel_bias", 64) == 64
    stripes = attncc.Variant(mask_mod=lambda b, h, q, k: (q // 64) % 2 == (k // 64) % 2)  # no whole tile derivable
    assert tiles(stripes, 64) == 64
    assert [tiles(n, 128) for n in ("full", "softcap")] == [64, 64]


@pytest.mark.parametrize("d,lq,name", [(128, 128, "full"), (128, 100, "full"), (64, 17, "full"), (64, 256, "full"),
                                       (64, 300, "full"), (64, 100, "softcap")])
def test_gluon_dq_accumulator_order(d, lq, name, tmp_path):
    """The float32 dQ buffer holds each warp group's half of a query tile (64 rows x DQ_N columns:
    the columns split at query tiles of 64, the rows at tiles of 128) in the wgmma accumulator's
    register order: thread t = 32 warp + lane holds rows 16 warp + 8 i + lane // 4 and columns
    8 k + 2 (lane % 4) + j of its half at float (128 k + t) * 4 + 2 i + j of its block. The
    post-pass attn_bwd_dq reshapes a block to (warp group, k, warp, t // 4, t % 4, i, j), permutes
    it by DQ_ORDER and reads it as rows x columns (whole tiles and a ragged last one): that must
    invert exactly the order above. (Gluon does not run on the CPU: torch does the kernel's
    reshapes here; the GPU tests check dq itself.)"""
    variant = _variant(name)
    source = codegen.render(plan.build("bwd", variant.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon"),
                                       variant.captures))
    path = tmp_path / "bwd.py"
    path.write_text(source)
    module = runtime.load(path, True, source)
    assert f"    acc = gl.permute(acc, {module.DQ_ORDER})  # DQ_ORDER\n" in source  # the kernel's own order
    assert "    acc = gl.reshape(acc, [2, BLOCK_M * HEAD_DIM // 1024, 4, 8, 4, 2, 2])\n" in source
    block_m = module.LAUNCH_TILES["attn_bwd"][0]
    dq_n = block_m * d // 128
    B, H = 2, 3
    n_q = -(-lq // block_m)
    acc = torch.randn(B * H * n_q * block_m * d)
    r = torch.arange(n_q * block_m)[:, None]
    c = torch.arange(d)[None, :]
    if block_m == 128:  # the warp groups split the rows
        wg, rr, cc = (r % block_m) // 64, r % 64, c
    else:  # the columns
        wg, rr, cc = c // dq_n, r % 64, c % dq_n
    lane = 4 * (rr % 8) + (cc % 8) // 2
    t = 32 * (rr // 16) + lane
    f = (128 * (cc // 8) + t) * 4 + 2 * ((rr % 16) // 8) + cc % 2
    bh = torch.arange(B * H)[:, None, None]
    index = ((bh * n_q + r // block_m) * 2 + wg) * (64 * dq_n) + f
    want = acc[index].view(B, H, n_q * block_m, d)[:, :, :lq]
    order = module.DQ_ORDER
    blocks = acc.view(B * H * n_q, 2, block_m * d // 1024, 4, 8, 4, 2, 2).permute(0, *[1 + x for x in order])
    dq = blocks.reshape(B, H, n_q * block_m, d)[:, :, :lq]
    assert torch.equal(dq, want)


def _patch_table(table):
    """benchmarks/gluon/<table>.py, a probe's patches (not a package: loaded from its path)."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gluon" / f"{table}.py"
    spec = importlib.util.spec_from_file_location(table, path)
    patches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patches)
    return patches


def _assert_patches_apply(table, kernel, head_dims, optional=(), names=lambda patch: True, only_128=()):
    """Each old text of benchmarks/gluon/<table>.py (of the patches `names` takes; those in `only_128`
    at head dim 128 only) occurs exactly once in the rendered full and causal Gluon kernels at these
    head dims; texts starting with one of `optional` or of the table's OPTIONAL (switches whose other
    side some of these kernels render) at most once, and once in at least one of them."""
    patches = _patch_table(table)
    optional = tuple(optional) + getattr(patches, "OPTIONAL", ())  # the table's own list of such texts
    applied = set()
    for name in ("full", "causal"):
        variant = _variant(name)
        for d in head_dims:
            source = codegen.render(plan.build(kernel, variant.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90",
                                                                              tier="gluon"), variant.captures))
            for patch, edits in patches.PATCHES.items():
                if not names(patch) or (patch in only_128 and d != 128):
                    continue
                for old, _ in edits:
                    count = source.count(old)
                    if old.startswith(tuple(optional)):
                        assert count <= 1, (name, d, patch, old[:80], count)
                        applied |= {old} if count else set()
                    else:
                        assert count == 1, (name, d, patch, old[:80], count)
    missing = [old[:80] for patch, edits in patches.PATCHES.items() if names(patch) for old, _ in edits
               if old.startswith(tuple(optional)) and old not in applied]
    assert not missing, missing


def _assert_sparse_patches_apply(table, kernel):
    """Each old text of the patches in <table>.SPARSE occurs once in a document mask's kernel."""
    patches = _patch_table(table)
    document = _variant("document")
    source = codegen.render(plan.build(kernel, document.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90",
                                                                        tier="gluon"), document.captures))
    for patch in patches.SPARSE:
        assert all(source.count(old) == 1 for old, _ in patches.PATCHES[patch]), patch


def test_probe_patches_still_apply():
    """benchmarks/gluon/gluon_bwd_probe.py times text patches of the rendered Gluon backward: each
    old text must occur exactly once in the full and the causal kernel, or the probe measures a
    patch that did nothing (or fails on the GPU, after its compile time)."""
    _assert_patches_apply("bwd_patches", "bwd", (128, ), names=lambda patch: not patch.endswith("-64"))
    _assert_patches_apply("bwd_patches", "bwd", (64, ), names=lambda patch: patch.endswith("-64"))


def test_probe_plan_patches_set_the_warp_groups():
    """gluon_fwd_probe.py's plan patches `wide` / `narrow` build the head-dim-64 forward with three /
    two consumer warp groups whatever tiles.wide_forward grants, and leave head dim 128 at two."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gluon"))
    from probe_common import build_plan
    spec = lambda d: Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")  # noqa: E731
    for name, patch, d, groups in [("sliding_window", "", 64, 2), ("sliding_window", "wide", 64, 3),
                                   ("causal", "", 64, 3), ("causal", "narrow", 64, 2), ("causal", "wide", 128, 2),
                                   ("causal", "narrow+mask-kv", 64, 2)]:
        source = codegen.render(build_plan("fwd", _variant(name), spec(d), patch))
        assert f"WGS = {groups}" in source, (name, patch, d)


def test_probe_ptxas_patches():
    """The probes' `ptxopt=A:B` puts ptxas options "A B" (or none) into the main kernel's launch in
    place of the module's own, in the backward and the forward; `no-split-bias` / `split-bias` build
    the backward with the bias in the step / in S^T's start, whatever plan.SPLIT_BIAS says."""
    import ast
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gluon"))
    from probe_common import apply, build_plan
    spec = lambda d: Spec("bfloat16", d, d, 1, "cuda-sm90", tier="gluon")  # noqa: E731
    for kind, d in [("bwd", 64), ("bwd", 128), ("fwd", 128)]:
        source = codegen.render(build_plan(kind, _variant("causal"), spec(d)))
        for patch, value in [("ptxopt=--register-usage-level=3:-O2", '"--register-usage-level=3 -O2"'), ("ptxopt=", "None")]:
            patched = apply(source, patch, {})
            ast.parse(patched)
            assert patched.count("ptx_options=") == 1 and f"ptx_options={value}," in patched, (kind, d, patch)
    for patch, split in [("no-split-bias", False), ("split-bias", True)]:
        assert build_plan("bwd", _variant("alibi"), spec(128), patch).split_bias == split


def test_probe_rounds_run_the_kernels_in_palindromes(monkeypatch):
    """The probes time a cell's kernels in short measurements, in order and then in reverse, so that a
    clock that drifts linearly over a round moves every kernel's median alike (timed in long turns, the
    last place measured slow)."""
    import sys
    import triton.testing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gluon"))
    from probe_common import time_cell
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(fn()) or 1.0 + len(calls))
    fns = {key: (lambda key=key: key) for key in ("triton", "base", "patched")}
    tri, times = time_cell("cell", fns, {"base": 0.0, "patched": 0.0}, 1, 40)
    order = ["triton", "base", "patched"]
    assert calls == order + order[::-1] + order + order[::-1]
    assert (tri, times) == (7.5, {"base": 7.5, "patched": 7.5})  # (2, 7, 8, 13), (3, 6, 9, 12), (4, 5, 10, 11)


def test_forward_probe_patches_still_apply():
    """The same for gluon_fwd_probe.py's patches of the rendered Gluon forward, at both widths (two
    consumer warp groups at head dim 128, three at 64); the texts of fwd_patches.OPTIONAL (the
    persistence flag, P's rounding either way, the third consumer) need only occur in some kernels;
    those of fwd_patches.SPARSE (a data-dependent mask's tile order) once in a document mask's kernel."""
    table = _patch_table("fwd_patches")
    _assert_patches_apply("fwd_patches", "fwd", (128, 64), names=lambda patch: patch not in table.SPARSE,
                          only_128=table.HEAD_DIM_128)
    _assert_sparse_patches_apply("fwd_patches", "fwd")
