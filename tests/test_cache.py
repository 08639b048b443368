"""The kernel source cache: in process, on disk under ATTNCC_CACHE_DIR, across processes; and
snapshot-style checks of what the generated source contains."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import attncc
from conftest import check, randn_qkv
from variants import BUILDERS, causal_mask


def _alibi_kernel(H=4):
    return attncc.compile(attncc.Variant(*BUILDERS["alibi"](1, H, 0, 0, "cpu")))


def _paths_of(kernel) -> list[Path]:
    """Forward sources generated in this process for the kernel's variant (any Spec)."""
    return [Path(p) for (key, kind, _), (p, _) in attncc.api._loaded.items()
            if key == kernel.variant.ir_key and kind == "fwd"]


def test_second_call_generates_nothing():
    torch.manual_seed(0)
    kernel = _alibi_kernel()
    q, k, v = randn_qkv(1, 4, 4, 40, 40, 16)
    first = kernel(q, k, v)
    stats = dict(attncc.cache.stats)
    second = kernel(q, k, v)
    assert attncc.cache.stats == stats
    assert torch.equal(first, second)
    # a new Variant of the same structure, reading other tensors, shares the kernel
    again = _alibi_kernel()
    check(q, k, v, again.variant.score_mod, again.variant.mask_mod, kernel=again)
    assert attncc.cache.stats["codegen"] == stats["codegen"]


def test_new_specialisation_generates_new_source():
    torch.manual_seed(1)
    kernel = attncc.compile(attncc.Variant(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 3))
    q, k, v = randn_qkv(1, 2, 2, 20, 20, 16)
    kernel(q, k, v)
    codegen = attncc.cache.stats["codegen"]
    kernel(q.half(), k.half(), v.half())  # dtype
    kernel(*randn_qkv(1, 2, 2, 20, 20, 32))  # head dim
    kernel(*randn_qkv(1, 4, 2, 20, 20, 16), enable_gqa=True)  # GQA group
    assert attncc.cache.stats["codegen"] == codegen + 3
    assert len(set(_paths_of(kernel))) == 4


def test_source_lands_under_cache_dir(attncc_cache_dir):
    torch.manual_seed(2)
    kernel = _alibi_kernel(H=2)
    kernel(*randn_qkv(1, 2, 2, 10, 10, 16))
    root = Path(attncc_cache_dir).resolve()
    assert attncc.cache.folder().resolve().is_relative_to(root)
    paths = _paths_of(kernel)
    assert paths
    for p in paths:
        assert p.resolve().is_relative_to(root), f"{p} is outside ATTNCC_CACHE_DIR={root}"
        assert p.is_file() and p.suffix == ".py"
        assert "def attn_fwd" in p.read_text() or "def attn_bwd_dkdv" in p.read_text()
    assert str(paths[0]) in kernel.explain()
    assert not list(attncc.cache.folder().glob("*.tmp")), "temporary files left in the cache folder"


def test_source_text():
    kernel = _alibi_kernel()
    src = kernel.source("fwd", dtype=torch.bfloat16, head_dim=128)
    assert "@triton.jit" in src and "def attn_fwd(" in src and "def launch(" in src
    assert "bfloat16" in src and "head_dim=128" in src
    compile(src, "<generated>", "exec")  # valid Python
    interp = kernel.source("fwd", dtype=torch.float32, head_dim=64, target="interpreter")
    assert "def attn_fwd(" in interp and "float32" in interp and "target=interpreter" in interp


def _loop_split(src: str) -> tuple[str, str]:
    """(before the tile loop, the loop and after) of a generated forward kernel."""
    start = src.index("def attn_fwd(")
    end = src.index("\ndef launch(", start)
    loop = re.search(r"\n    for (start_n|j) in ", src[start:end]).start() + start
    return src[start:loop], src[loop:end]


def test_snapshot_causal_mask_line():
    src = attncc.compile(attncc.Variant(mask_mod=causal_mask)).source("fwd", dtype=torch.float16, head_dim=64)
    _, loop = _loop_split(src)
    assert re.search(r"^\s+keep = \(q_idx >= kv_idx\)$", loop, re.M), loop
    assert re.search(r'^\s+qk = tl\.where\(col_ok & keep, qk, float\("-inf"\)\)', loop, re.M)
    # the identity score_mod folds the scale into exp2: no score tile is formed, and with a
    # positive scale the row max is taken on q.k and scaled once, p = exp2 of one FMA
    assert "qk_scale = sm_scale * 1.4426950408889634" in src and "score = qk * sm_scale" not in src
    assert "tl.max(qk, 1) * qk_scale" in loop and "p = tl.exp2(qk * qk_scale - m_safe[:, None])" in loop


def test_snapshot_alibi_hoists_slopes_load():
    src = _alibi_kernel().source("fwd", dtype=torch.float16, head_dim=64)
    before, loop = _loop_split(src)
    load = re.search(r"^\s+(\w+) = tl\.load\(cap0_ptr \+ \(h\)\.to\(tl\.int64\) \* cap0_stride0", before, re.M)
    assert load, f"slopes[h] is not loaded before the tile loop:\n{before}"
    assert "tl.load(cap0_ptr" not in loop, "slopes are (also) loaded inside the tile loop"
    assert re.search(rf"score_mod = .*\b{load.group(1)}\b", loop), "the loop does not use the hoisted slope"
    assert "keep = (q_idx >= kv_idx)" in loop
    # the backward's distance is a float subtraction of position tiles converted once, not an
    # integer subtraction converted per score (the forward keeps the latter, see plan.build)
    bwd = _alibi_kernel().source("bwd", dtype=torch.float16, head_dim=64)
    assert "q_idx_f = q_idx.to(tl.float32)" in bwd and "kv_idx_f = kv_idx.to(tl.float32)" in bwd
    assert re.search(r"bias = .*\(kv_idx_f - q_idx_f\)", bwd)


def test_snapshot_document_mask_hoists_query_ids_only():
    kernel = attncc.compile(attncc.Variant(*BUILDERS["document"](1, 2, 40, 40, "cpu")))
    before, loop = _loop_split(kernel.source("fwd", dtype=torch.float16, head_dim=64))
    assert "tl.load(cap0_ptr + (q_idx)" in before and "tl.load(cap0_ptr" not in loop  # doc_q[q_idx]: once per program
    assert "tl.load(cap1_ptr + (kv_idx)" in loop and "tl.load(cap1_ptr" not in before  # doc_kv[kv_idx]: per tile


def _masked_loops(src: str) -> list[bool]:
    """For each loop of a generated kernel that runs mask or bounds-check code: whether it sits
    under an `if not EVEN_...` (compiled out when the lengths are whole tiles)."""
    lines = src.splitlines()
    indent = lambda line: len(line) - len(line.lstrip())  # noqa: E731
    guarded = []
    for i, line in enumerate(lines):
        if re.match(r"\s+for .*:  # .*(mask cuts|ragged)", line):
            outer = next(prev for prev in reversed(lines[:i]) if prev.strip() and indent(prev) < indent(line))
            guarded.append(outer.strip().startswith("if not EVEN_"))
    return guarded


def test_masked_loops_compile_out_for_whole_tiles_only_when_the_mask_bounds_nothing():
    # no mask: the masked loops only ever hold a ragged tile, so each is guarded
    for kind in ("fwd", "bwd"):
        guarded = _masked_loops(attncc.compile(attncc.Variant()).source(kind, dtype=torch.float16, head_dim=64))
        assert guarded and all(guarded), (kind, guarded)
    # a sliding window cuts tiles on both sides of its band at every length: no loop is guarded
    # (guarded, the backward measured slower on an H200)
    window = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < 64)  # noqa: E731
    for kind, n in (("fwd", 2), ("bwd", 4)):
        guarded = _masked_loops(attncc.compile(attncc.Variant(mask_mod=window)).source(kind, dtype=torch.float16,
                                                                                      head_dim=64))
        assert guarded == [False] * n, (kind, guarded)


def test_causal_loops_that_can_only_be_empty_or_ragged():
    """Under a causal mask the forward and dQ kernels start at key 0 with whole tiles, so they have
    no masked loop before them (only the diagonal's, after); the dK/dV kernel's whole query tiles
    reach the last query, so its loop after them holds only a ragged tile and is guarded. The
    diagonal's loops stay unguarded."""
    kernel = attncc.compile(attncc.Variant(mask_mod=causal_mask))
    fwd, bwd = (kernel.source(kind, dtype=torch.float16, head_dim=64) for kind in ("fwd", "bwd"))
    assert _masked_loops(fwd) == [False]
    assert "range(lo, full_lo, BLOCK_N)" not in fwd and "range(full_hi, hi, BLOCK_N)" in fwd
    dkdv, dq = bwd[bwd.index("def attn_bwd_dkdv("):bwd.index("def attn_bwd_dq(")], bwd[bwd.index("def attn_bwd_dq("):]
    assert _masked_loops(dkdv) == [False, True]  # the diagonal, then the ragged last query tile
    assert "if not EVEN_Q:  # whole tiles reach the end" in dkdv
    assert _masked_loops(dq) == [False] and "range(lo, full_lo, BLOCK_N)" not in dq


_SUBPROCESS = textwrap.dedent("""
    import json, sys, torch, attncc

    def cache_probe(score, b, h, q_idx, kv_idx):  # a structure no other test uses
        return score - slopes[h] * torch.abs(kv_idx - q_idx) * 0.25

    torch.manual_seed(0)
    slopes = torch.rand(4)
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    out = attncc.attention(q, k, v, cache_probe, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    ref = attncc.reference.attention(q.double(), k.double(), v.double(), cache_probe,
                                     lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(json.dumps({**attncc.cache.stats, "err": err, "folder": str(attncc.cache.folder())}))
""")


def _run_subprocess(cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # attncc switches it on itself
    env["ATTNCC_CACHE_DIR"] = cache_dir
    if torch.cuda.is_available():
        env["ATTNCC_INTERPRET"] = "1"  # CPU tensors in the child need the interpreter
    res = subprocess.run([sys.executable, "-c", _SUBPROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_second_process_reads_the_disk_cache(tmp_path):
    first = _run_subprocess(str(tmp_path))
    assert first["codegen"] >= 1 and first["disk_hits"] == 0
    assert Path(first["folder"]).resolve().is_relative_to(tmp_path.resolve())
    files = sorted(Path(first["folder"]).glob("fwd_*.py"))
    assert len(files) == first["codegen"]
    second = _run_subprocess(str(tmp_path))
    assert second["codegen"] == 0 and second["disk_hits"] >= 1
    assert sorted(Path(second["folder"]).glob("fwd_*.py")) == files
    assert first["err"] < 1e-5 and second["err"] < 1e-5


def test_second_process_shares_the_session_cache(attncc_cache_dir):
    """The subprocess variant, first generated here, is found on disk by a child process.
    (Source files are named by variant name too, so the probe's structure must be unique in
    this process: an identical variant under another name would reuse its loaded module.)"""
    torch.manual_seed(0)
    slopes = torch.rand(4)

    def cache_probe(score, b, h, q_idx, kv_idx):  # a structure no other test uses
        return score - slopes[h] * torch.abs(kv_idx - q_idx) * 0.25
    attncc.attention(*randn_qkv(1, 4, 4, 40, 40, 16), cache_probe, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    child = _run_subprocess(attncc_cache_dir)
    assert child["codegen"] == 0 and child["disk_hits"] >= 1 and child["err"] < 1e-5


def test_edited_cached_source_is_what_runs(tmp_path):
    """README: an edited copy of a generated kernel in the cache is what attncc runs."""
    first = _run_subprocess(str(tmp_path))
    (path,) = Path(first["folder"]).glob("fwd_*.py")
    src = path.read_text()
    line = "s = score_mod * 1.4426950408889634"
    assert line in src, src
    path.write_text(src.replace(line, line.replace("score_mod", "(score_mod * 0.0)")))
    edited = _run_subprocess(str(tmp_path))
    assert edited["codegen"] == 0
    assert edited["err"] > 1e-2  # uniform causal weights now, far from the reference


def _fake_triton(root: Path, calls: list):
    """A stand-in for the triton package: a folder of files and runtime.cache.triton_key."""
    import functools
    import types

    @functools.lru_cache()
    def triton_key():
        calls.append(1)
        return f"key-of-{(root / 'libtriton.so').read_text()}"
    cache_module = types.SimpleNamespace(triton_key=triton_key)
    return types.SimpleNamespace(__file__=str(root / "__init__.py"),
                                 runtime=types.SimpleNamespace(cache=cache_module))


def test_triton_key_is_kept_until_tritons_files_change(attncc_cache_dir, tmp_path, monkeypatch):
    from attncc import cache
    root = tmp_path / "triton"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "libtriton.so").write_text("build 1")
    calls = []

    def new_process():  # a fresh Triton import and a fresh attncc: nothing computed yet
        monkeypatch.setattr(cache, "_triton_key_tried", False)
        triton = _fake_triton(root, calls)
        cache.remember_triton_key(triton)
        return triton.runtime.cache.triton_key()

    assert new_process() == "key-of-build 1" and len(calls) == 1  # computed once, then kept
    assert new_process() == "key-of-build 1" and len(calls) == 1  # the next process reads it
    (root / "libtriton.so").write_text("build 22")  # another Triton build: a new key
    assert new_process() == "key-of-build 22" and len(calls) == 2
    monkeypatch.setenv("ATTNCC_TRITON_KEY", "0")
    assert new_process() == "key-of-build 22" and len(calls) == 3  # off: Triton computes it


def test_captures_in_range_rules(monkeypatch):
    """Which captured tensors the training kernels read without bounds masks: those every index
    stays inside over the lengths rounded up to whole tiles of 128, including indices inside a
    torch.where branch (both branches run) and never an index read from a tensor's values."""
    from attncc.checks import captures_in_range
    q = torch.randn(2, 4, 256, 16)
    slopes, short, docs = torch.randn(4), torch.randn(3), torch.arange(256)
    bias, gate = torch.randn(8), torch.randn(256)
    cases = [  # (score_mod, mask_mod, captures, in range)
        (lambda s, b, h, qi, k: s + slopes[h] * (k - qi), None, [slopes], (0,)),
        (lambda s, b, h, qi, k: s + short[h], None, [short], ()),            # 3 entries for 4 heads
        (None, lambda b, h, qi, k: docs[qi] == docs[k], [docs], (0,)),
        (lambda s, b, h, qi, k: s + bias[docs[qi] % 8], None, [bias, docs], (1,)),  # bias: a data index
        (lambda s, b, h, qi, k: torch.where(qi < 4, s + gate[qi + 200], s), None, [gate], ()),
    ]
    for score_mod, mask_mod, caps, want in cases:
        variant = attncc.Variant(score_mod, mask_mod)
        assert captures_in_range(variant, q, q, caps) == want
    variant = attncc.Variant(None, lambda b, h, qi, k: docs[qi] == docs[k])
    assert captures_in_range(variant, q[:, :, :200], q[:, :, :200], [docs[:200]]) == ()  # tiles reach 256
    assert captures_in_range(variant, q[:, :, :200], q[:, :, :200], [docs]) == (0,)
    assert variant.index_sites and len(variant.in_range) == 2  # memoised per lengths and shapes
    q = q[:, :, :128]  # whole tiles of 128, but not of the 256 keys an ATTNCC_TILES override asks for
    assert captures_in_range(variant, q, q, [docs[:128]]) == (0,)
    monkeypatch.setenv("ATTNCC_TILES", '{"attn_fwd": [64, 256, 8, 2]}')
    assert captures_in_range(variant, q, q, [docs[:128]]) == ()


def test_loads_of_captures_in_range_have_no_bounds_masks():
    """The generated source loads a captured tensor proven in range without a mask and says so
    in the capture's comment; the same variant at a ragged length keeps the masks."""
    from attncc import autograd
    sources = {}
    for L in (256, 200):
        table = torch.randn(2, 2 * L - 1)
        kernel = attncc.compile(attncc.Variant(lambda s, b, h, q, k: s + table[h, q - k + L - 1]))
        q = torch.randn(1, 2, L, 16)
        spec = autograd._launch(kernel, q, q, q, [table], None, None, 0.0, False).spec
        sources[L] = Path(kernel.module("fwd", spec).__file__).read_text()
    inside, ragged = sources[256], sources[200]
    assert "every index inside it at the call's lengths (no bounds masks)" in inside
    assert re.search(r"tl\.load\(cap0_ptr \+ [^\n]*\* cap0_stride1\)\.to\(tl\.float32\)", inside)
    assert "< cap0_size1" not in inside
    assert "every index inside it" not in ragged and ragged.count("< cap0_size1)") >= 2
