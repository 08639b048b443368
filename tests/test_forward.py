"""Forward results of every example variant against the float64 reference, on CPU through the
Triton interpreter, plus layouts, masking edge cases, scale, lse and runtime-argument reuse."""
from __future__ import annotations

import random
import zlib

import pytest
import torch

import attncc
from attncc import ir
from conftest import LSE_TOL, REL_TOL, check, randn_qkv, reference, rel_err
from variants import BUILDERS, NAMES, alibi_slopes, causal_mask

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
BATCHES = [1, 2]
HEADS = [(4, 4), (4, 1), (6, 2)]
LENGTHS = [1, 17, 64, 200]
HEAD_DIMS = [16, 64, 80]
CASES_PER_PAIR = 4  # per (variant, dtype)


def launch_spec(compiled, q, k, v):
    """The Spec of an eager forward call of ``compiled`` on q, k, v (with its own captures)."""
    from attncc import autograd
    captures = [c.tensor for c in compiled.variant.captures]
    return autograd._launch(compiled, q, k, v, captures, None, None, 0.0, False).spec


def _spread(rng: random.Random, values: list, n: int) -> list:
    """n values in which every one of ``values`` appears (n >= len(values)), shuffled."""
    out = [values[i % len(values)] for i in range(n)]
    rng.shuffle(out)
    return out


def _cases() -> list:
    """A fixed sample of the shape x dtype x variant product: every (variant, dtype) pair
    CASES_PER_PAIR times, every value of every axis at least once."""
    rng = random.Random(20240611)
    pairs = [(name, dt) for name in NAMES for dt in DTYPES] * CASES_PER_PAIR
    n = len(pairs)
    axes = {
        "B": _spread(rng, BATCHES, n), "heads": _spread(rng, HEADS, n),
        "Lq": _spread(rng, LENGTHS, n), "Lkv": _spread(rng, LENGTHS, n),
        "D": _spread(rng, HEAD_DIMS, n),
        # a quarter of the cases get a value head dim different from D
        "dv_differs": _spread(rng, [True, False, False, False], n),
    }
    cases = []
    for i, (name, dt) in enumerate(pairs):
        D = axes["D"][i]
        Dv = rng.choice([x for x in (16, 32, 48, 64, 80) if x != D]) if axes["dv_differs"][i] else D
        Hq, Hkv = axes["heads"][i]
        cases.append((name, dt, axes["B"][i], Hq, Hkv, axes["Lq"][i], axes["Lkv"][i], D, Dv))
    return cases


CASES = _cases()


def _param(case):
    name, dt, B, Hq, Hkv, Lq, Lkv, D, Dv = case
    cid = f"{name}-{dt}-B{B}-H{Hq}x{Hkv}-L{Lq}x{Lkv}-D{D}" + (f"-Dv{Dv}" if Dv != D else "")
    return pytest.param(*case, id=cid)


def test_case_sample_covers_every_axis():
    """The sampled forward cases keep the coverage promised in _cases()."""
    pairs = {(c[0], c[1]) for c in CASES}
    assert pairs == {(n, d) for n in NAMES for d in DTYPES}
    assert {c[2] for c in CASES} == set(BATCHES)
    assert {(c[3], c[4]) for c in CASES} == set(HEADS)
    assert {c[5] for c in CASES} == set(LENGTHS)
    assert {c[6] for c in CASES} == set(LENGTHS)
    assert {c[7] for c in CASES} == set(HEAD_DIMS)
    assert any(c[8] != c[7] for c in CASES)
    assert any(c[5] != c[6] for c in CASES)
    assert 60 <= len(CASES) <= 80


@pytest.mark.parametrize("name,dt,B,Hq,Hkv,Lq,Lkv,D,Dv", [_param(c) for c in CASES])
def test_variant_matches_reference(name, dt, B, Hq, Hkv, Lq, Lkv, D, Dv):
    torch.manual_seed(zlib.crc32(repr((name, dt, B, Hq, Hkv, Lq, Lkv, D, Dv)).encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cpu")
    q, k, v = randn_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype=DTYPES[dt])
    out, lse, _ = check(q, k, v, score_mod, mask_mod, enable_gqa=Hq != Hkv)
    assert out.shape == (B, Hq, Lq, Dv)
    assert lse.shape == (B, Hq, Lq)


_FIRST_PER_PAIR: dict = {}
for _case in CASES:
    _FIRST_PER_PAIR.setdefault(_case[:2], _case)
TMA_CASES = list(_FIRST_PER_PAIR.values())  # the first sampled case of each (variant, dtype)


@pytest.mark.parametrize("name,dt,B,Hq,Hkv,Lq,Lkv,D,Dv", [_param(c) for c in TMA_CASES])
def test_tma_forward_matches_reference(monkeypatch, name, dt, B, Hq, Hkv, Lq, Lkv, D, Dv):
    """The forward that reads K and V through tensor descriptors (TMA, the default on Hopper GPUs),
    forced on in the interpreter: every variant once per dtype, ragged lengths, GQA, padded D."""
    monkeypatch.setenv("ATTNCC_TMA", "on")
    torch.manual_seed(zlib.crc32(repr(("tma", name, dt, B, Hq, Hkv, Lq, Lkv, D, Dv)).encode()))
    score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cpu")
    q, k, v = randn_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype=DTYPES[dt])
    compiled = attncc.compile(attncc.Variant(score_mod, mask_mod))
    assert compiled.module("fwd", launch_spec(compiled, q, k, v)).TMA
    check(q, k, v, score_mod, mask_mod, kernel=compiled, enable_gqa=Hq != Hkv)


# (B, Hq, Hkv, Lq, Lkv, D, Dv): keys in whole interpreter tiles (32) and Lq % 4 == 0 take the
# warp-specialised kernel, the others the general loops of the same module
WS_CASES = [(2, 4, 4, 64, 96, 64, 64), (1, 6, 2, 20, 64, 80, 80), (2, 4, 1, 52, 32, 40, 24),
            (1, 3, 3, 4, 128, 16, 16), (1, 4, 4, 33, 45, 64, 64), (2, 2, 2, 64, 17, 32, 32), (1, 2, 2, 17, 64, 16, 16),
            (3, 2, 1, 96, 64, 32, 32), (1, 9, 9, 96, 64, 16, 16)]


@pytest.mark.parametrize("layout", ["bhld", "blhd"])
@pytest.mark.parametrize("dt", ["fp32", "fp16"])
@pytest.mark.parametrize("name", ["full", "scaled_tanh", "causal", "sliding_window", "prefix_lm", "alibi"])
@pytest.mark.parametrize("B,Hq,Hkv,Lq,Lkv,D,Dv", WS_CASES)
def test_warp_specialized_forward_matches_reference(monkeypatch, name, dt, layout, B, Hq, Hkv, Lq, Lkv, D, Dv):
    """The warp-specialised forward (the default for plain attention at head dims 64 and 128 on
    Hopper, and for causal-like masks over up to 4096 keys), forced on in the interpreter: a
    persistent kernel on three programs, Q, K, V through descriptors built in the kernel, one per
    tensor for (B, H, L, D) stacks of rows and whole query tiles (ROWS), one per (b, h) otherwise
    ((B, L, H, D) views, ragged queries); masks on every tile of the derived range, only with
    ROWS; the Q tiles dealt in pairs, an odd count of tiles leaving one alone (3 and 27 tiles);
    GQA, padded and unequal head dims, a score_mod with a mask (ALiBi)."""
    monkeypatch.setenv("ATTNCC_WS", "on")
    torch.manual_seed(zlib.crc32(repr(("ws", name, dt, layout, B, Hq, Hkv, Lq, Lkv, D, Dv)).encode()))
    if name in ("full", "scaled_tanh"):
        score_mod = (lambda s, b, h, q_idx, kv_idx: 20.0 * torch.tanh(s / 20.0)) if name == "scaled_tanh" else None
        mask_mod = None
    else:
        score_mod, mask_mod = BUILDERS[name](B, Hq, Lq, Lkv, "cpu")
    q, k, v = randn_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv, dtype=DTYPES[dt])
    if layout == "blhd":  # the same values as (B, L, H, D) tensors viewed through .transpose(1, 2)
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    compiled = attncc.compile(attncc.Variant(score_mod, mask_mod))
    module = compiled.module("fwd", launch_spec(compiled, q, k, v))
    assert module.WARP_SPECIALIZED and not module.TMA and module.WS_KV == 0
    launches, jit = [], module.attn_fwd_ws

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: (launches.append((grid, kwargs["ROWS"])), jit[grid](*args, **kwargs))
    monkeypatch.setattr(module, "attn_fwd_ws", Spy())
    check(q, k, v, score_mod, mask_mod, kernel=compiled, enable_gqa=Hq != Hkv)
    rows = (layout == "bhld" or (Hq == 1 and Hkv == 1)) and Lq % 32 == 0
    if Lkv % 32 or Lq % 4 or (mask_mod is not None and not rows):  # under a mask: ROWS only
        assert launches == []
    else:
        assert launches == [((min(3, -(-Lq // 32) * B * Hq),), rows)]


def test_warp_specialized_plan_rules():
    """Dropout and data-dependent masks keep the general loops: the warp-specialised kernel runs
    one loop per Q tile. Under ATTNCC_WS=auto it runs only where it measured faster (Hopper,
    16-bit): at head dim 64 and 128 without a mask for the identity score_mod; at 128 under a
    causal-like mask up to WS_MASKED_KV keys, score mods included unless they gather a captured
    tensor per entry."""
    from attncc import plan
    from attncc.spec import Spec
    from attncc.tiles import WS_MASKED_KV
    rel_bias_causal = lambda *a: (BUILDERS["rel_bias"](*a)[0], BUILDERS["causal"](*a)[1])  # noqa: E731
    for name, d, dtype, target, want, limit in [
            ("full", 128, "bfloat16", "cuda-sm90", True, 0), ("full", 64, "bfloat16", "cuda-sm90", True, 0),
            ("full", 32, "bfloat16", "cuda-sm90", False, 0), ("causal", 64, "float16", "cuda-sm90", False, 0),
            ("full", 128, "float32", "cuda-sm90", False, 0), ("full", 128, "bfloat16", "cuda-sm100", False, 0),
            ("softcap", 128, "bfloat16", "cuda-sm90", False, 0), ("causal", 128, "bfloat16", "cuda-sm90", True, WS_MASKED_KV),
            ("prefix_lm", 128, "float16", "cuda-sm90", True, WS_MASKED_KV),
            ("alibi", 128, "bfloat16", "cuda-sm90", True, WS_MASKED_KV), ("alibi", 64, "bfloat16", "cuda-sm90", False, 0),
            ("rel_bias_causal", 128, "bfloat16", "cuda-sm90", False, 0),
            ("sliding_window", 128, "bfloat16", "cuda-sm90", False, 0), ("document", 128, "bfloat16", "cuda-sm90", False, 0)]:
        builder = rel_bias_causal if name == "rel_bias_causal" else BUILDERS[name]
        v = attncc.Variant(*builder(1, 4, 64, 64, "cpu"))
        got = plan.build("fwd", v.analysis, Spec(dtype, d, d, 1, target, tma="auto", ws="auto"), v.captures)
        assert (got.ws, got.ws_kv) == (want, limit), (name, d, dtype, target)
        # the general loops still run the lengths the warp-specialised kernel does not take
        assert bool(got.short_kv) == (name in ("causal", "prefix_lm", "alibi") and d == 128), name
    full, causal, document = (attncc.Variant(*BUILDERS[n](1, 4, 64, 64, "cpu")) for n in ("full", "causal", "document"))
    assert plan.build("fwd", full.analysis, Spec("float32", 64, 64, 1, "interpreter", ws="on")).ws
    assert plan.build("fwd", causal.analysis, Spec("float32", 64, 64, 1, "interpreter", ws="on")).ws
    assert not plan.build("fwd", document.analysis, Spec("float32", 64, 64, 1, "interpreter", ws="on"),
                          document.captures).ws
    assert not plan.build("fwd", full.analysis, Spec("float32", 64, 64, 1, "interpreter", dropout=True, ws="on")).ws
    assert not plan.build("bwd", full.analysis, Spec("float32", 64, 64, 1, "interpreter", ws="on")).ws


def test_short_tiles_rule():
    """Causal-like masks (neither banded nor data-dependent) at head dim 128 take 64x64 forward
    tiles up to 4096 keys (2048 for the identity score_mod under GQA or dropout, tiles.SHORT_KV);
    not full attention, windows, document masks, score mods that gather a table per entry, other
    head dims, float32, or tiles chosen by the autotuner."""
    from attncc import plan, tiles
    from attncc.spec import Spec
    short = {"causal": 4096, "prefix_lm": 4096, "alibi": 4096, "softcap": 0, "full": 0,  # softcap: no mask
             "sliding_window": 0, "document": 0, "rel_bias": 0}
    for name, want in short.items():
        v = attncc.Variant(*BUILDERS[name](1, 4, 64, 64, "cpu"))
        kernel = plan.build("fwd", v.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90", tma="auto"), v.captures)
        assert kernel.short_kv == want, name
        assert (kernel.tiles.get("attn_fwd_short") == tiles.Tiles(64, 64, 4, 3)) == bool(want), name
    table = torch.randn(4, 129)
    gathers = attncc.Variant(lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + 64], causal_mask)
    assert plan.build("fwd", gathers.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90"), gathers.captures).short_kv == 0
    causal = attncc.Variant(mask_mod=causal_mask)
    assert plan.build("fwd", causal.analysis, Spec("bfloat16", 128, 128, 4, "cuda-sm90")).short_kv == 2048  # GQA
    assert plan.build("fwd", causal.analysis, Spec("bfloat16", 128, 128, 1, "cuda-sm90", True)).short_kv == 2048
    alibi = attncc.Variant(*BUILDERS["alibi"](1, 4, 64, 64, "cpu"))
    assert plan.build("fwd", alibi.analysis, Spec("bfloat16", 128, 128, 4, "cuda-sm90"), alibi.captures).short_kv == 4096
    for spec in (Spec("bfloat16", 64, 64, 1, "cuda-sm90"), Spec("float32", 128, 128, 1, "cuda-sm90"),
                 Spec("bfloat16", 128, 128, 1, "cuda-sm90", tiles=(("attn_fwd", (128, 64, 8, 3)),))):
        assert plan.build("fwd", causal.analysis, spec).short_kv == 0, spec
    assert plan.build("fwd", causal.analysis, Spec("float32", 24, 24, 1, "interpreter")).short_kv == 64


@pytest.mark.parametrize("Lkv,rows", [(17, 16), (64, 16), (65, 32), (200, 32)])
def test_short_tiles_launch_by_key_count(monkeypatch, Lkv, rows):
    """The forward launches its short tiles (16 query rows in the interpreter) up to 64 keys and
    the general ones past that; both match the reference."""
    torch.manual_seed(Lkv)
    q, k, v = randn_qkv(2, 4, 2, 50, Lkv, 24)
    compiled = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    module = compiled.module("fwd", launch_spec(compiled, q, k, v))
    grids, jit = [], module.attn_fwd

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return jit[grid]
    monkeypatch.setattr(module, "attn_fwd", Spy())
    check(q, k, v, None, causal_mask, kernel=compiled, enable_gqa=True)
    assert grids == [(-(-50 // rows), 8)]


def test_tma_reads_transposed_views(monkeypatch):
    """(B, L, H, D) views through descriptors: strides in any order, no copies."""
    monkeypatch.setenv("ATTNCC_TMA", "on")
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, n, 3, 32).transpose(1, 2) for n in (45, 38, 38))
    check(q, k, v, None, causal_mask)


def test_tma_auto_rule_by_variant_class():
    """ATTNCC_TMA=auto (GPU default): descriptors for data-dependent and banded masks, and for
    score mods above head dim 64; plain full / causal / prefix-LM attention keeps pointer loads."""
    from attncc import plan
    from attncc.spec import Spec
    wanted = {"full": (False, False), "causal": (False, False), "prefix_lm": (False, False),
              "alibi": (True, False), "softcap": (True, False), "document": (True, True),
              "sliding_window": (True, True)}  # (head dim 128, head dim 64)
    for name, want in wanted.items():
        v = attncc.Variant(*BUILDERS[name](1, 4, 64, 64, "cpu"))
        got = tuple(plan.build("fwd", v.analysis, Spec("bfloat16", d, d, 1, "cuda-sm90", tma="auto"), v.captures).tma
                    for d in (128, 64))
        assert got == want, name
        assert plan.build("fwd", v.analysis, Spec("bfloat16", 64, 64, 1, "cuda-sm90", tma="on"), v.captures).tma


def test_descriptor_modes_need_a_layout_tma_can_address(monkeypatch):
    from attncc import runtime
    from attncc.errors import AttnccError
    tma = lambda target, k, v: runtime.descriptor_modes(target, k, k, v)[0]
    k = torch.randn(2, 4, 64, 64, dtype=torch.float16)
    assert runtime.descriptor_modes("interpreter", k, k, k) == ("off", "off")  # auto: GPUs only
    assert runtime.descriptor_modes("cuda-sm90", k, k, k) == ("auto", "auto")
    assert runtime.descriptor_modes("cuda-sm80", k, k, k) == ("off", "off")
    monkeypatch.setenv("ATTNCC_TMA", "on")
    assert runtime.descriptor_modes("interpreter", k, k, k) == ("on", "off")
    wide = torch.randn(2, 4, 64, 72, dtype=torch.float16)
    assert tma("interpreter", wide[..., 1:65], k) == "off"              # start not 16-byte aligned
    assert tma("interpreter", torch.randn(2, 4, 64, 4, dtype=torch.float16), k) == "off"  # 8-byte rows
    assert tma("interpreter", k.transpose(2, 3), k) == "off"            # head dim not unit stride
    assert tma("interpreter", k[:, :, :0], k[:, :, :0]) == "off"        # no keys: no descriptor
    monkeypatch.setenv("ATTNCC_TMA", "off")
    monkeypatch.setenv("ATTNCC_WS", "on")
    assert runtime.descriptor_modes("cuda-sm90", k, k, k) == ("off", "on")
    assert runtime.descriptor_modes("interpreter", k, k, k) == ("off", "on")
    assert runtime.descriptor_modes("interpreter", k, k.transpose(2, 3), k) == ("off", "off")
    assert runtime.descriptor_modes("interpreter", k.transpose(2, 3), k, k) == ("off", "off")  # Q too
    monkeypatch.setenv("ATTNCC_TMA", "sometimes")
    with pytest.raises(AttnccError, match="ATTNCC_TMA"):
        runtime.descriptor_modes("cuda-sm90", k, k, k)
    monkeypatch.setenv("ATTNCC_TMA", "auto")
    monkeypatch.setenv("ATTNCC_WS", "always")
    with pytest.raises(AttnccError, match="ATTNCC_WS"):
        runtime.descriptor_modes("cuda-sm90", k, k, k)


def test_bf16_on_cpu():
    torch.manual_seed(0)
    score_mod, mask_mod = BUILDERS["alibi"](2, 4, 50, 70, "cpu")
    q, k, v = randn_qkv(2, 4, 2, 50, 70, 64, dtype=torch.bfloat16)
    out, lse, _ = check(q, k, v, score_mod, mask_mod, enable_gqa=True)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["full", "causal", "alibi", "document"])
def test_blhd_transposed_inputs_match_contiguous(name):
    """(B, L, H, D) tensors passed as .transpose(1, 2) views (no copy) give the same result."""
    torch.manual_seed(1)
    B, H, Lq, Lkv, D = 2, 3, 45, 38, 32
    score_mod, mask_mod = BUILDERS[name](B, H, Lq, Lkv, "cpu")
    q = torch.randn(B, Lq, H, D).transpose(1, 2)
    k = torch.randn(B, Lkv, H, D).transpose(1, 2)
    v = torch.randn(B, Lkv, H, D).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    out, _, _ = check(q, k, v, score_mod, mask_mod)
    dense = attncc.attention(q.contiguous(), k.contiguous(), v.contiguous(), score_mod, mask_mod)
    torch.testing.assert_close(out, dense, rtol=1e-6, atol=1e-6)


def test_output_layout_follows_query():
    torch.manual_seed(2)
    B, H, L, D = 2, 4, 33, 16
    q = torch.randn(B, L, H, D).transpose(1, 2)
    k = torch.randn(B, L, H, D).transpose(1, 2)
    v = torch.randn(B, L, H, D).transpose(1, 2)
    out, _, _ = check(q, k, v, None, causal_mask)
    assert out.shape == (B, H, L, D)
    assert out.transpose(1, 2).is_contiguous(), f"output strides {out.stride()} do not follow the query's"
    out2 = attncc.attention(q.contiguous(), k, v, mask_mod=causal_mask)
    assert out2.is_contiguous()


def test_strided_inputs_with_padding():
    """Views whose rows are not packed (sliced from a wider buffer) read the right elements."""
    torch.manual_seed(3)
    base_q = torch.randn(2, 4, 40, 48)
    base_kv = torch.randn(2, 4, 50, 2, 48)
    q = base_q[..., 8:40]                    # head dim 32 out of 48
    k = base_kv[:, :, :, 0, :32]             # interleaved k/v
    v = base_kv[:, :, :, 1, 16:]
    check(q, k, v, None, causal_mask)


ROW_MASKS = {
    "every_third_row": lambda b, h, q_idx, kv_idx: q_idx % 3 != 0,
    "per_head_rows": lambda b, h, q_idx, kv_idx: (q_idx + h) % 4 != 0,
    "first_rows_of_batch_1": lambda b, h, q_idx, kv_idx: (b == 0) | (q_idx >= 5),
    "nothing": lambda b, h, q_idx, kv_idx: kv_idx < 0,
}


@pytest.mark.parametrize("mask_name", list(ROW_MASKS))
@pytest.mark.parametrize("dt", ["fp32", "fp16"])
def test_fully_masked_rows_give_zero_and_neg_inf(mask_name, dt):
    torch.manual_seed(4)
    B, H, Lq, Lkv, D = 2, 4, 40, 37, 16
    mask_mod = ROW_MASKS[mask_name]
    q, k, v = randn_qkv(B, H, H, Lq, Lkv, D, dtype=DTYPES[dt])
    out, lse, _ = check(q, k, v, None, mask_mod)
    _, ref_lse = reference(q, k, v, None, mask_mod)
    masked = torch.isneginf(ref_lse)
    assert masked.any(), "the mask should fully mask some rows"
    assert torch.isneginf(lse[masked]).all()
    assert (out[masked] == 0).all()
    if mask_name == "nothing":
        assert masked.all() and (out == 0).all()
    else:
        assert (~masked).any() and torch.isfinite(lse[~masked]).all()


def test_rows_masked_by_score_mod_minus_inf():
    """A score_mod that sends a whole row to -inf behaves like a fully masked row."""
    torch.manual_seed(5)
    q, k, v = randn_qkv(1, 2, 2, 30, 40, 16)

    def drop_odd_rows(score, b, h, q_idx, kv_idx):
        return score + torch.where(q_idx % 2 == 1, float("-inf"), 0.0)
    out, lse, _ = check(q, k, v, drop_odd_rows, None)
    assert torch.isneginf(lse[:, :, 1::2]).all() and (out[:, :, 1::2] == 0).all()
    assert torch.isfinite(lse[:, :, ::2]).all()


@pytest.mark.parametrize("Lkv", [1, 2, 3])
@pytest.mark.parametrize("name", ["full", "causal", "document"])
def test_tiny_kv_length(name, Lkv):
    torch.manual_seed(6)
    Lq = 50
    score_mod, mask_mod = BUILDERS[name](1, 2, Lq, Lkv, "cpu")
    q, k, v = randn_qkv(1, 2, 2, Lq, Lkv, 16)
    check(q, k, v, score_mod, mask_mod)


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
def test_return_lse_shape_and_dtype(dt):
    torch.manual_seed(7)
    q, k, v = randn_qkv(2, 6, 2, 21, 35, 16, 32, dtype=DTYPES[dt])
    out = attncc.attention(q, k, v, enable_gqa=True)
    assert isinstance(out, torch.Tensor)
    assert out.shape == (2, 6, 21, 32) and out.dtype == q.dtype
    res = attncc.attention(q, k, v, enable_gqa=True, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, lse = res
    assert lse.shape == (2, 6, 21) and lse.dtype == torch.float32
    assert torch.equal(out, out2)
    # natural-log units: lse = logsumexp(q.k / sqrt(D)) over each row
    qd, kd = q.double(), k.double().repeat_interleave(3, dim=1)
    expect = torch.logsumexp(qd @ kd.transpose(-1, -2) / 4.0, dim=-1)
    assert (lse.double() - expect).abs().max().item() < LSE_TOL[q.dtype]


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.7, -1.5])
def test_scale_is_honored(scale):
    torch.manual_seed(8)
    q, k, v = randn_qkv(1, 2, 2, 40, 40, 32)
    out, lse, _ = check(q, k, v, None, causal_mask, scale=scale)
    default = attncc.attention(q, k, v, mask_mod=causal_mask)
    assert rel_err(out, default) > 1e-3, "scale had no effect"
    if scale == 0.0:  # uniform weights over the causal prefix: the running mean of v
        mean = v.cumsum(dim=2) / torch.arange(1, 41).view(1, 1, 40, 1)
        assert rel_err(out, mean) < REL_TOL[torch.float32]


def test_scale_on_compiled_variant():
    torch.manual_seed(9)
    q, k, v = randn_qkv(1, 2, 2, 30, 30, 16)
    kernel = attncc.compile(attncc.Variant(mask_mod=causal_mask, scale=0.3))
    check(q, k, v, None, causal_mask, kernel=kernel, scale=0.3)


def test_capture_changed_in_place_changes_result_without_codegen():
    torch.manual_seed(10)
    B, H, L, D = 1, 4, 40, 16
    slopes = alibi_slopes(H, "cpu")

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    kernel = attncc.compile(attncc.Variant(alibi, causal_mask))
    q, k, v = randn_qkv(B, H, H, L, L, D)
    before, _, _ = check(q, k, v, alibi, causal_mask, kernel=kernel)
    codegen = attncc.cache.stats["codegen"]
    slopes.mul_(4.0)
    after, _, _ = check(q, k, v, alibi, causal_mask, kernel=kernel)  # the reference sees new slopes
    assert rel_err(after, before) > 1e-2, "in-place change of a captured tensor was ignored"
    assert attncc.cache.stats["codegen"] == codegen, "changing captured data generated new source"


def test_zero_dim_capture_is_a_runtime_scalar():
    torch.manual_seed(11)
    temp = torch.tensor(0.5)

    def temperature(score, b, h, q_idx, kv_idx):
        return score * temp
    kernel = attncc.compile(attncc.Variant(temperature))
    assert len(kernel.variant.captures) == 1 and kernel.variant.captures[0].tensor is temp
    q, k, v = randn_qkv(2, 2, 2, 33, 33, 16)
    first, _, _ = check(q, k, v, temperature, kernel=kernel)
    codegen = attncc.cache.stats["codegen"]
    temp.fill_(3.0)
    second, _, _ = check(q, k, v, temperature, kernel=kernel)
    assert rel_err(second, first) > 1e-2
    assert attncc.cache.stats["codegen"] == codegen
    # the same value given as scale instead
    torch.testing.assert_close(second, attncc.attention(q, k, v, scale=3.0 / 4.0), rtol=1e-5, atol=1e-6)


def test_zero_dim_int_capture_in_mask():
    torch.manual_seed(12)
    window = torch.tensor(5)

    def window_mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    kernel = attncc.compile(attncc.Variant(mask_mod=window_mask))
    q, k, v = randn_qkv(1, 2, 2, 40, 40, 16)
    narrow, _, _ = check(q, k, v, None, window_mask, kernel=kernel)
    codegen = attncc.cache.stats["codegen"]
    window.fill_(20)
    wide, _, _ = check(q, k, v, None, window_mask, kernel=kernel)
    assert rel_err(wide, narrow) > 1e-2
    assert attncc.cache.stats["codegen"] == codegen


def test_new_sequence_length_needs_no_new_source():
    torch.manual_seed(13)
    score_mod, mask_mod = BUILDERS["alibi"](1, 2, 0, 0, "cpu")  # captures only a per-head tensor
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
    q, k, v = randn_qkv(1, 2, 2, 40, 40, 16)
    check(q, k, v, score_mod, mask_mod, kernel=kernel)
    codegen = attncc.cache.stats["codegen"]
    for Lq, Lkv in [(70, 70), (5, 90), (90, 5), (1, 1)]:
        q, k, v = randn_qkv(1, 2, 2, Lq, Lkv, 16)
        check(q, k, v, score_mod, mask_mod, kernel=kernel)
    q, k, v = randn_qkv(2, 2, 2, 30, 30, 16)  # batch size is runtime too
    check(q, k, v, score_mod, mask_mod, kernel=kernel)
    assert attncc.cache.stats["codegen"] == codegen


def test_ir_written_variant_equals_traced():
    torch.manual_seed(14)
    B, H, Lq, Lkv, D = 2, 4, 40, 50, 16
    slopes = alibi_slopes(H, "cpu")
    doc = torch.sort(torch.randint(0, 3, (Lkv,))).values

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[q_idx] == doc[kv_idx])
    traced = attncc.Variant(alibi, causal_document)
    written = attncc.Variant(ir.score + ir.load(slopes, ir.h) * (ir.kv_idx - ir.q_idx),
                             (ir.q_idx >= ir.kv_idx) & ir.eq(ir.load(doc, ir.q_idx), ir.load(doc, ir.kv_idx)))
    assert written.ir_key == traced.ir_key
    assert written.analysis.key == traced.analysis.key
    q, k, v = randn_qkv(B, H, H, Lq, Lkv, D)
    out_traced, _, _ = check(q, k, v, alibi, causal_document, kernel=attncc.compile(traced))
    out_written, _, _ = check(q, k, v, written.score_mod, written.mask_mod, kernel=attncc.compile(written))
    assert torch.equal(out_traced, out_written)


def test_gqa_equals_repeated_kv():
    """enable_gqa with Hkv | Hq equals plain attention on K/V repeated per group."""
    torch.manual_seed(15)
    score_mod, mask_mod = BUILDERS["alibi"](1, 6, 33, 47, "cpu")
    q, k, v = randn_qkv(1, 6, 2, 33, 47, 16)
    out, _, _ = check(q, k, v, score_mod, mask_mod, enable_gqa=True)
    repeated = attncc.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), score_mod, mask_mod)
    torch.testing.assert_close(out, repeated, rtol=1e-5, atol=1e-6)


def test_out_of_range_capture_reads_are_zero():
    """Loads outside a captured tensor read 0, in the kernel and in the reference alike."""
    torch.manual_seed(16)
    bias = torch.randn(20) + 3.0  # shorter than Lkv: kv_idx >= 20 reads 0

    def short_bias(score, b, h, q_idx, kv_idx):
        return score + bias[kv_idx - 5]  # and kv_idx < 5 reads index < 0
    q, k, v = randn_qkv(1, 2, 2, 30, 40, 16)
    out, _, _ = check(q, k, v, short_bias)
    padded = torch.cat([torch.zeros(5), bias, torch.zeros(40)])[:40]
    expect, _ = reference(q, k, v, lambda s, b, h, qi, ki: s + padded[ki])
    assert rel_err(out, expect) < REL_TOL[torch.float32]
