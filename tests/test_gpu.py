"""Compiled (non-interpreted) kernels on a CUDA GPU: every example variant at realistic shapes in
fp16 and bf16 (and fp32 at one shape) against the float64 reference computed on the GPU, and no
recompilation when only sequence lengths change.

Run on a GPU machine with ``python -m pytest -m gpu tests/test_gpu.py``. (In one process attncc
runs CUDA tensors compiled and CPU tensors only through the interpreter, which must be chosen
before triton is imported, so run the CPU tests separately there.) Everything here is skipped
without CUDA; triton is imported inside the tests only, never at collection, so that collecting
this file on a CPU machine cannot switch the interpreter off for the other tests.
"""
from __future__ import annotations

import json
import zlib

import pytest
import torch

import attncc
from attncc.launcher import Launcher
from conftest import assert_close_to_reference
from variants import BUILDERS, NAMES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (B, Hq, Hkv, Lq, Lkv, D, Dv)
SHAPES = {
    "2x8x1000x128": (2, 8, 8, 1000, 1000, 128, 128),
    "1x4x4096x64": (1, 4, 4, 4096, 4096, 64, 64),
    "gqa8:2-2x8x1000x128": (2, 8, 2, 1000, 1000, 128, 128),
    "D80-2x4x777": (2, 4, 4, 777, 777, 80, 80),
    "D256-1x4x1024": (1, 4, 4, 1024, 1024, 256, 256),
    "Lq300-Lkv1500-D64": (2, 4, 4, 300, 1500, 64, 64),
    "Lq1500-Lkv300-D128-Dv64": (1, 6, 2, 1500, 300, 128, 64),
}
FP32_SHAPE = "Lq300-Lkv1500-D64"

MAX_REFERENCE_ELEMENTS = 2 ** 26  # float64 scores per reference chunk (0.5 GiB)


def _shift_heads(score_mod, mask_mod, h0: int):
    """The mods as seen from a slice of heads starting at h0 (so captured per-head data lines up)."""
    if h0 == 0:
        return score_mod, mask_mod
    sm = None if score_mod is None else (lambda score, b, h, q_idx, kv_idx: score_mod(score, b, h + h0, q_idx, kv_idx))
    mm = None if mask_mod is None else (lambda b, h, q_idx, kv_idx: mask_mod(b, h + h0, q_idx, kv_idx))
    return sm, mm


def reference_on_gpu(q, k, v, score_mod, mask_mod, enable_gqa=False):
    """attncc.reference in float64 on the GPU, over slices of query heads small enough to fit."""
    B, Hq, Lq, _ = q.shape
    Hkv, Lkv = k.shape[1], k.shape[2]
    group = Hq // Hkv
    heads_per_chunk = max(group, (MAX_REFERENCE_ELEMENTS // max(1, B * Lq * Lkv)) // group * group)
    outs, lses = [], []
    for h0 in range(0, Hq, heads_per_chunk):
        h1 = min(Hq, h0 + heads_per_chunk)
        sm, mm = _shift_heads(score_mod, mask_mod, h0)
        out, lse = attncc.reference.attention(
            q[:, h0:h1].double(), k[:, h0 // group:h1 // group].double(), v[:, h0 // group:h1 // group].double(),
            sm, mm, enable_gqa=group > 1, return_lse=True)
        outs.append(out)
        lses.append(lse)
        del out, lse
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


@pytest.fixture(autouse=True)
def _tier(request, monkeypatch):
    """These tests check the Triton tier's kernels (tests/test_gpu_gluon.py has the Gluon tier's),
    but for the reference test, which runs each case on both tiers (a case the Gluon tier does not
    take runs the Triton tier there too)."""
    params = getattr(request.node, "callspec", None)
    monkeypatch.setenv("ATTNCC_TIER", params.params.get("tier", "triton") if params else "triton")


def _cases():
    cases = []
    for name in NAMES:
        for shape in SHAPES:
            for dt in ("bf16", "fp16"):
                cases.append(pytest.param(name, shape, dt, id=f"{name}-{shape}-{dt}"))
        cases.append(pytest.param(name, FP32_SHAPE, "fp32", id=f"{name}-{FP32_SHAPE}-fp32"))
    return cases


@pytest.mark.parametrize("tier", ["triton", "gluon"])
@pytest.mark.parametrize("name,shape,dt", _cases())
def test_variant_on_gpu_matches_reference(name, shape, dt, tier):
    B, Hq, Hkv, Lq, Lkv, D, Dv = SHAPES[shape]
    dtype = DTYPES[dt]
    torch.manual_seed(zlib.crc32(f"{name}-{shape}-{dt}".encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cuda")
    q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype)
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype)
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv, return_lse=True)
    assert out.is_cuda and lse.is_cuda
    assert out.shape == (B, Hq, Lq, Dv) and lse.shape == (B, Hq, Lq)
    ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)


def test_blhd_layout_on_gpu():
    """(B, L, H, D) tensors passed as transposed views; the output follows the query's layout."""
    torch.manual_seed(1)
    B, L, H, D = 2, 1000, 8, 128
    score_mod, mask_mod = BUILDERS["alibi"](B, H, L, L, "cuda")
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.float16).transpose(1, 2) for _ in range(3))
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, return_lse=True)
    assert out.transpose(1, 2).is_contiguous()
    ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.float16)


# (B, Hq, Hkv, Lq, Lkv, D, Dv) at head dim 64 or 128: keys in whole tiles of 128 take the
# warp-specialised loop
WS_SHAPES = {"2x8x1024": (2, 8, 8, 1024, 1024, 128, 128), "gqa8:2-Lq1000-Lkv2048": (2, 8, 2, 1000, 2048, 128, 128),
             "1x16x4096": (1, 16, 16, 4096, 4096, 128, 128), "Lq200-Lkv384-Dv64": (3, 4, 4, 200, 384, 128, 64),
             "Lkv128": (2, 4, 4, 640, 128, 128, 128), "Lq_odd": (2, 4, 4, 999, 512, 128, 128),
             "3x384-odd-tiles": (1, 3, 3, 384, 384, 128, 128), "D64-2x8x1024": (2, 8, 8, 1024, 1024, 64, 64),
             "D64-gqa8:2-Lq1000": (2, 8, 2, 1000, 1024, 64, 64), "D48-3x384": (1, 3, 3, 384, 384, 48, 48)}


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("shape", list(WS_SHAPES))
def test_warp_specialized_forward_on_gpu(shape, dt, layout):
    """Plain attention at head dims 64 (48 padded) and 128 (the persistent warp-specialised kernel
    on Hopper where Lkv % 128 == 0 and Lq % 4 == 0) against the float64 reference, with
    contiguous (B, H, L, D) tensors (one descriptor per tensor where the queries fill whole
    tiles) and with (B, L, H, D) query views (one per head); on sm90 the kernel must be
    warp-specialised."""
    B, Hq, Hkv, Lq, Lkv, D, Dv = WS_SHAPES[shape]
    dtype = DTYPES[dt]
    torch.manual_seed(zlib.crc32(f"ws-{shape}-{dt}-{layout}".encode()))
    q = torch.randn(B, Lq, Hq, D, device="cuda", dtype=dtype).transpose(1, 2)
    if layout == "bhld":
        q = q.contiguous()
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype)
    kernel = attncc.compile(attncc.Variant())
    out, lse = kernel(q, k, v, enable_gqa=Hq != Hkv, return_lse=True)
    ref, ref_lse = reference_on_gpu(q, k, v, None, None, enable_gqa=Hq != Hkv)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    if torch.cuda.get_device_capability()[0] == 9 and Lkv % 128 == 0 and Lq % 4 == 0:
        _assert_warp_specialised(kernel, D)


def _assert_warp_specialised(kernel, head_dim=128):
    """The variant has a forward module at head_dim whose attn_fwd_ws Triton compiled warp-specialised."""
    modules = [m for (key, kind, spec), (_, m) in attncc.api._loaded.items()
               if key == kernel.variant.ir_key and kind == "fwd" and m is not None and m.WARP_SPECIALIZED
               and spec.head_dim == head_dim]
    assert modules, "no warp-specialised forward module was generated on sm90"
    ptx = [k.asm["ptx"] for m in modules for entry in m.attn_fwd_ws.fn.device_caches.values()
           for k in entry[0].values()]
    assert any("setmaxnreg" in p for p in ptx), "Triton did not warp-specialise the forward loop"


# (B, Hq, Hkv, Lq, Lkv, layout) at head dim 128 under a mask: up to WS_MASKED_KV keys in whole
# tiles of 128 take the warp-specialised kernel on Hopper when Q, K, V and the output are stacks
# of rows in whole query tiles; the others (ragged queries, (B, L, H, D) views) the general loops
WS_MASKED_SHAPES = {"2x8x1024": (2, 8, 8, 1024, 1024, "bhld"), "gqa8:2": (3, 8, 2, 1024, 1024, "bhld"),
                    "9heads-Lq512": (1, 9, 9, 512, 512, "bhld"), "Lq256-Lkv1024": (2, 4, 4, 256, 1024, "bhld"),
                    "gqa8:2-Lq1000": (3, 8, 2, 1000, 1024, "bhld"), "blhd": (3, 8, 8, 1024, 1024, "blhd"),
                    "9x384-odd-tiles": (1, 9, 9, 384, 384, "bhld"), "2x4x4096": (2, 4, 4, 4096, 4096, "bhld")}


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["causal", "prefix_lm", "alibi", "sliding_window"])
@pytest.mark.parametrize("shape", list(WS_MASKED_SHAPES))
def test_warp_specialized_masked_forward_on_gpu(shape, name, dt, monkeypatch):
    """Causal-like masks, with and without a score_mod, in the persistent warp-specialised kernel
    (mask code on every tile, Q tiles in long-short pairs, 27 tiles: one alone) against the
    float64 reference; the sliding window runs it under ATTNCC_WS=on only. On sm90 the kernel
    must be warp-specialised where the launch takes it; ragged queries and (B, L, H, D) views
    run the general loops."""
    if name == "sliding_window":
        monkeypatch.setenv("ATTNCC_WS", "on")
    B, Hq, Hkv, Lq, Lkv, layout = WS_MASKED_SHAPES[shape]
    dtype = DTYPES[dt]
    torch.manual_seed(zlib.crc32(f"ws-masked-{shape}-{name}-{dt}".encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cuda")
    q = torch.randn(B, Lq, Hq, 128, device="cuda", dtype=dtype).transpose(1, 2)
    if layout == "bhld":
        q = q.contiguous()
    k = torch.randn(B, Hkv, Lkv, 128, device="cuda", dtype=dtype)
    v = torch.randn(B, Hkv, Lkv, 128, device="cuda", dtype=dtype)
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
    out, lse = kernel(q, k, v, enable_gqa=Hq != Hkv, return_lse=True)
    ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    if torch.cuda.get_device_capability()[0] == 9 and Lq % 128 == 0 and layout == "bhld":
        _assert_warp_specialised(kernel)


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["causal", "document", "alibi"])
def test_direct_relaunch_matches_tritons_launch_on_gpu(name, dt):
    """attncc.launcher: the first call of a shape goes through Triton's launch, the second relaunches
    the compiled kernel directly and must give the same bits; a query 2 bytes off a 16-byte
    boundary specialises differently, goes through Triton again and still matches the reference."""
    dtype = DTYPES[dt]
    # head dim 80: the misaligned query adds a forward Spec (no descriptors); kept apart from the
    # head-dim-128 modules that test_new_sequence_lengths_do_not_recompile counts
    B, H, L, D = 2, 4, 1000, 80
    torch.manual_seed(zlib.crc32(f"relaunch-{name}-{dt}".encode()))
    score_mod, mask_mod = BUILDERS[name](B, H, L, L, "cuda")
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))

    def recorded():  # compiled kernels the forward Launchers of this variant keep (Specs may share a module)
        launchers = {id(m): m.attn_fwd for (key, kind, _), (_, m) in attncc.api._loaded.items()
                     if key == kernel.variant.ir_key and kind == "fwd" and m is not None}.values()
        assert launchers and all(isinstance(f, Launcher) for f in launchers)
        return sum(len(f._kernels) for f in launchers)

    first = kernel(q, k, v)
    keys = recorded()
    assert keys >= 1, "the first launch recorded no compiled kernel"
    assert torch.equal(kernel(q, k, v), first)
    assert recorded() == keys
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(q)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16
    out, lse = kernel(shifted, k, v, return_lse=True)
    assert recorded() == keys + 1
    ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("name", ["causal", "document"])
def test_inputs_on_another_gpu_than_the_current_one(name):
    """Forward, backward and decode of tensors on cuda:1 while cuda:0 is current (Triton launches
    on the current device; attncc.launcher switches to the inputs' GPU)."""
    assert torch.cuda.current_device() == 0
    dev = torch.device("cuda", 1)
    B, H, L, D = 2, 4, 2500, 64  # >= 2048 keys: decode splits them and merges
    torch.manual_seed(zlib.crc32(f"second-gpu-{name}".encode()))
    score_mod, mask_mod = BUILDERS[name](B, H, L, L, dev)
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
    q, k, v = (torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, lse = kernel(q, k, v, return_lse=True)
    ref, ref_lse = reference_on_gpu(q.detach(), k.detach(), v.detach(), score_mod, mask_mod)
    assert_close_to_reference(out, lse, ref, ref_lse, torch.bfloat16)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref64 = attncc.reference.attention(q64, k64, v64, score_mod, mask_mod)
    for got, want in zip((q.grad, k.grad, v.grad), torch.autograd.grad(ref64, (q64, k64, v64), dout.double())):
        assert got.device == dev
        assert ((got.double() - want).norm() / want.norm()).item() < 2e-2
    with torch.no_grad():  # one query over many keys: the split-KV decode kernel and its merge
        q1 = q[:, :, -1:].detach()
        out1, lse1 = kernel(q1, k.detach(), v.detach(), return_lse=True)
    ref1, ref_lse1 = reference_on_gpu(q1, k.detach(), v.detach(), score_mod, mask_mod)
    assert_close_to_reference(out1, lse1, ref1, ref_lse1, torch.bfloat16)
    assert torch.cuda.current_device() == 0


# ----------------------------------------------------------------------------------------------
# No recompilation for new sequence lengths


def _compiled_count(jit_fn):
    """Compiled kernels in a triton JITFunction's cache, across Triton versions; None if unknown."""
    caches = getattr(jit_fn, "device_caches", None)  # triton >= 3.0: device -> (kernel_cache, ...)
    if caches is not None and hasattr(caches, "values"):
        total = 0
        for entry in caches.values():
            kernel_cache = entry[0] if isinstance(entry, tuple) else entry
            if not hasattr(kernel_cache, "__len__"):
                return None
            total += len(kernel_cache)
        return total
    cache = getattr(jit_fn, "cache", None)  # triton 2.x: device -> {key: kernel}
    if isinstance(cache, dict):
        return sum(len(v) if isinstance(v, dict) else 1 for v in cache.values())
    return None


def _fwd_modules(kernel, dtype: str, head_dim: int):
    """{captures read in range (Spec.in_range): loaded forward module} of the kernel's variant for
    one dtype and head dim (MHA), under the default ATTNCC_WS (a test that forces it on loads a
    module of its own)."""
    return {spec.in_range: m for (key, kind, spec), (_, m) in attncc.api._loaded.items()
            if key == kernel.variant.ir_key and kind == "fwd" and m is not None
            and spec.dtype == dtype and spec.head_dim == spec.head_dim_v == head_dim and spec.group == 1
            and not getattr(spec, "dropout", False) and getattr(spec, "ws", "auto") != "on"}


# rel_bias bakes Lkv into its IR (bias[h, q_idx - kv_idx + Lkv]): each length is a new variant by design
@pytest.mark.parametrize("name", [n for n in NAMES if n != "rel_bias"])
@pytest.mark.parametrize("dt", ["fp16", "bf16"])
def test_new_sequence_lengths_do_not_recompile(name, dt):
    from attncc import autograd
    torch.manual_seed(2)
    dtype = DTYPES[dt]
    B, H, D = 2, 8, 128
    kernel = None
    counts, inside = [], []
    codegen = None
    # ragged lengths (no multiple of 64) and whole ones (multiples of 128, whole for every tile)
    lengths = (1000, 1500, 3000, 4500, 1024, 2048, 3072, 4096)
    for L in lengths:
        score_mod, mask_mod = BUILDERS[name](B, H, L, L, "cuda")
        if kernel is None:
            kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
        else:  # same structure, new captured tensors: the same kernel, fed new arguments
            again = attncc.Variant(score_mod, mask_mod)
            assert again.ir_key == kernel.variant.ir_key
            kernel = attncc.compile(again)
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
        out, lse = kernel(q, k, v, return_lse=True)
        ref, ref_lse = reference_on_gpu(q, k, v, score_mod, mask_mod)
        assert_close_to_reference(out, lse, ref, ref_lse, dtype)
        # captured tensors every index stays inside (document ids at whole lengths) load without
        # bounds masks: a second module, in the whole lengths' launch class
        captures = [c.tensor for c in kernel.variant.captures]
        inside.append(autograd._launch(kernel, q, k, v, captures, None, None, 0.0, False).spec.in_range)
        if codegen is None:
            codegen = attncc.cache.stats["codegen"]
        modules = _fwd_modules(kernel, {"fp16": "float16", "bf16": "bfloat16"}[dt], D)
        assert set(modules) == set(inside), "one specialisation must mean one generated module"
        # .fn: the Launcher's JITFunction; plain attention at whole lengths runs attn_fwd_ws
        fns = [f for m in modules.values()
               for f in [m.attn_fwd.fn] + ([m.attn_fwd_ws.fn] if m.WARP_SPECIALIZED else [])]
        counts.append(sum(_compiled_count(fn) or 0 for fn in fns) or None)
    assert attncc.cache.stats["codegen"] - codegen <= len(set(inside)) - 1, \
        "a new sequence length generated new source (other than for captures read in range)"
    # triton 3.6 and 3.9 keep JITFunction.device_caches: device -> (kernel cache, ...)
    assert counts[0] is not None, "this triton's JITFunction exposes no kernel cache to count"
    assert counts[0] >= 1
    # one kernel per launch class, no others: whole key tiles take the warp-specialised kernel
    # (under a mask up to WS_KV keys), causal-like masks launch short tiles up to SHORT_KV keys,
    # and lengths that are whole tiles compile without bounds checks
    m = modules[inside[0]]
    ws = [m.WARP_SPECIALIZED and L % 128 == 0 and (not m.WS_KV or L <= m.WS_KV) for L in lengths]
    classes = [(w, not w and bool(m.SHORT_KV) and L <= m.SHORT_KV, L % 128 == 0, ins)
               for w, L, ins in zip(ws, lengths, inside)]
    for i in range(1, len(lengths)):  # a new class may find its kernel compiled by an earlier test
        new = counts[i] - counts[i - 1]
        allowed = 0 if classes[i] in classes[:i] else 1
        assert 0 <= new <= allowed, (f"Triton recompiled for length {lengths[i]} (launch class {classes[i]}): "
                                     f"compiled kernels per call {counts}")


# ----------------------------------------------------------------------------------------------
# Autotuning: every candidate kernel compiles, fits or reports OutOfResources, and agrees with
# the table default; the tuned result matches the reference


@pytest.mark.parametrize("dt", ["bf16", "fp16"])
@pytest.mark.parametrize("name,shape", [("causal", "gqa8:2-2x8x1000x128"), ("document", "1x4x4096x64")])
def test_autotuned_kernels_on_gpu(name, shape, dt, monkeypatch, tmp_path):
    from attncc import tune
    monkeypatch.setenv("ATTNCC_AUTOTUNE", "1")
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_chosen", {})
    monkeypatch.setattr(tune, "_tables", {})
    B, Hq, Hkv, Lq, Lkv, D, Dv = SHAPES[shape]
    dtype = DTYPES[dt]
    torch.manual_seed(zlib.crc32(f"tune-{name}-{shape}-{dt}".encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cuda")
    q = torch.randn(B, Hq, Lq, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, Dv, device="cuda", dtype=dtype, requires_grad=True)
    out, lse = attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv, return_lse=True)
    ref, ref_lse = reference_on_gpu(q.detach(), k.detach(), v.detach(), score_mod, mask_mod, enable_gqa=Hq != Hkv)
    assert_close_to_reference(out, lse, ref, ref_lse, dtype)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref64 = attncc.reference.attention(q64, k64, v64, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    for got, want in zip((q.grad, k.grad, v.grad), torch.autograd.grad(ref64, (q64, k64, v64), dout.double())):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < (2e-2 if dtype == torch.bfloat16 else 3e-3), err
    entries = json.loads(tune.table_path("cuda", q.device).read_text())["entries"].values()
    assert sorted(e["kernel"] for e in entries) == ["bwd", "fwd"]
    for e in entries:
        errors = [t for t in e["tried"] if "error" in t and not t["error"].startswith("OutOfResources")]
        assert not errors, errors
        assert sum("ms" in t for t in e["tried"]) >= 3
