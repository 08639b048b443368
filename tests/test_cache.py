"""The kernel source cache: in process, on disk under ATTNCC_CACHE_DIR, across processes; and
snapshot-style checks of what the generated source contains."""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
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
    causal = attncc.compile(attncc.Variant(mask_mod=BUILDERS["causal"](1, 4, 0, 0, "cpu")[1]))
    # sm90, a call of unknown length: the Gluon tier at head dim 128, but with a score_mod from 2048
    # queries and keys only (tiers.gluon_pays)
    for k, d, decorator in ((causal, 128, "@gluon.jit"), (kernel, 128, "@triton.jit"), (kernel, 64, "@triton.jit")):
        src = k.source("fwd", dtype=torch.bfloat16, head_dim=d, target="cuda-sm90")
        assert decorator in src and "def attn_fwd(" in src and "def launch(" in src
        assert "bfloat16" in src and f"head_dim={d}" in src
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
    assert re.search(r"^\s+keep = \(kv_idx <= q_idx\)$", loop, re.M), loop  # the loop index compared with its row's end
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
    assert "keep = (kv_idx <= q_idx)" in loop
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


def _fake_triton(root: Path, calls: list):
    """A stand-in for the triton package: a folder of files and runtime.cache.triton_key, whose
    key has the form of Triton's (its version, then sha256 digests joined by '-')."""
    import functools
    import hashlib
    import types

    @functools.lru_cache()
    def triton_key():
        calls.append(1)
        digests = [hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(root.iterdir())]
        return "9.9.9" + "-".join(digests)
    cache_module = types.SimpleNamespace(triton_key=triton_key)
    return types.SimpleNamespace(__file__=str(root / "__init__.py"), __version__="9.9.9",
                                 runtime=types.SimpleNamespace(cache=cache_module))


def _triton_files(tmp_path: Path) -> Path:
    root = tmp_path / "triton"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "libtriton.so").write_text("build 1")
    return root


def _new_triton_process(monkeypatch, root: Path, calls: list) -> str:
    """A fresh Triton import and a fresh attncc: nothing computed yet; Triton's key as it sees it."""
    from attncc import cache
    monkeypatch.setattr(cache, "_triton_key_tried", False)
    triton = _fake_triton(root, calls)
    cache.remember_triton_key(triton)
    return triton.runtime.cache.triton_key()


def test_triton_key_is_kept_until_tritons_files_change(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    root, calls = _triton_files(tmp_path), []
    key1 = _new_triton_process(monkeypatch, root, calls)
    assert key1.startswith("9.9.9") and len(calls) == 1  # computed once, then kept
    assert _new_triton_process(monkeypatch, root, calls) == key1 and len(calls) == 1  # the next process reads it
    (root / "libtriton.so").write_text("build 22")  # another Triton build: a new key
    key22 = _new_triton_process(monkeypatch, root, calls)
    assert key22 != key1 and len(calls) == 2
    monkeypatch.setenv("ATTNCC_TRITON_KEY", "0")
    assert _new_triton_process(monkeypatch, root, calls) == key22 and len(calls) == 3  # off: Triton computes it


@pytest.mark.parametrize("damage", ["garbage", "another Triton's", "owned by another user", "writable by others"])
def test_a_kept_triton_key_is_used_only_when_it_is_this_users_and_has_its_form(damage, tmp_path, monkeypatch,
                                                                                caplog):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    root, calls = _triton_files(tmp_path), []
    key = _new_triton_process(monkeypatch, root, calls)
    (kept,) = (attncc.cache.folder() / "triton_key").iterdir()
    assert kept.read_text() == key
    if damage == "garbage":
        kept.write_text("9.9.9 x" * 3)
    elif damage == "another Triton's":
        kept.write_text(key.replace("9.9.9", "1.0.0"))
    elif damage == "owned by another user":
        os.chown(kept, NOBODY, NOBODY)
    else:
        kept.chmod(0o666)
    caplog.set_level(logging.WARNING, logger="attncc")
    assert _new_triton_process(monkeypatch, root, calls) == key and len(calls) == 2  # computed again
    assert any(str(kept) in m for m in _warnings(caplog))
    assert kept.read_text() == key and kept.stat().st_uid == os.getuid()  # and kept again
    assert _new_triton_process(monkeypatch, root, calls) == key and len(calls) == 2


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


# ---------------------------------------------------------------- the cache runs only what attncc wrote

NOBODY = 65534  # another user's uid (the tests run as root or as a user who may chown to it)


def _probe(c: float):
    """A causal variant with a bias no other test uses (``c`` differs per test)."""
    return attncc.compile(attncc.Variant(lambda s, b, h, q_idx, kv_idx: s + c * (kv_idx - q_idx), causal_mask))


def _new_process(monkeypatch):
    """Forget the kernels this process loaded, as a new process would."""
    monkeypatch.setattr(attncc.api, "_loaded", {})
    monkeypatch.setattr(attncc.runtime, "_modules", {})


def _private_cache(monkeypatch, root: Path) -> Path:
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(root))
    _new_process(monkeypatch)
    return root


def _run(kernel) -> float:
    """Run the kernel's forward on small inputs; its error against the float64 reference."""
    torch.manual_seed(0)
    q, k, v = randn_qkv(1, 2, 2, 24, 24, 16)
    out = kernel(q, k, v)
    ref = attncc.reference.attention(q.double(), k.double(), v.double(), kernel.variant.score_mod,
                                     kernel.variant.mask_mod)
    return ((out.double() - ref).norm() / ref.norm()).item()


def _fwd_file() -> Path:
    (path,) = attncc.cache.folder().glob("fwd_*.py")
    return path


def _evil(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('ran')\n"


def _plant(path: Path, text: str) -> None:
    """Put ``text`` at ``path`` with the digest attncc would write beside it (someone who knows
    the scheme and can write the folder)."""
    path.write_text(text)
    path.with_suffix(".sha256").write_text(attncc.cache._digest(path.name, text.encode()) + "\n")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "attncc" and r.levelno == logging.WARNING]


def _modes(top: Path) -> dict:
    return {str(p): stat.S_IMODE(os.lstat(p).st_mode) for p in [top, *top.rglob("*")]}


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "edited", "no digest"])
def test_a_damaged_kernel_file_is_reported_and_generated_again(damage, tmp_path, monkeypatch, caplog):
    _private_cache(monkeypatch, tmp_path / "cache")
    kernel = _probe(0.0101)
    assert _run(kernel) < 1e-5
    path, marker = _fwd_file(), tmp_path / "ran"
    good = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": good[:len(good) // 2], "garbage": bytes(range(256)) * 4,
                      "edited": good + _evil(marker).encode(), "no digest": good + _evil(marker).encode()}[damage])
    if damage == "no digest":
        path.with_suffix(".sha256").unlink()
    _new_process(monkeypatch)
    caplog.set_level(logging.WARNING, logger="attncc")
    codegen = attncc.cache.stats["codegen"]
    assert _run(kernel) < 1e-5 and not marker.exists()
    assert attncc.cache.stats["codegen"] == codegen + 1 and path.read_bytes() == good
    assert [m for m in _warnings(caplog) if m.startswith(f"kernel cache file {path} ")], caplog.text


@pytest.mark.parametrize("target", ["absolute path", "parent folder", "not a .py file", "not a kernel name"])
def test_an_alias_runs_only_a_kernel_file_of_its_folder(target, tmp_path, monkeypatch, caplog):
    _private_cache(monkeypatch, tmp_path / "cache")
    kernel = _probe(0.0202)
    assert _run(kernel) < 1e-5
    (alias,) = (attncc.cache.folder() / "aliases").iterdir()
    real, marker = alias.read_text().strip(), tmp_path / "ran"
    for evil in (tmp_path / "x" / "evil.py", tmp_path / "evil.py", attncc.cache.folder() / "notes.txt",
                 attncc.cache.folder() / "evil.py"):
        evil.parent.mkdir(exist_ok=True)
        _plant(evil, _evil(marker))
    alias.write_text({"absolute path": str(tmp_path / "x" / "evil.py"), "parent folder": "../../evil.py",
                      "not a .py file": "notes.txt", "not a kernel name": "evil.py"}[target])
    _new_process(monkeypatch)
    caplog.set_level(logging.WARNING, logger="attncc")
    assert _run(kernel) < 1e-5 and not marker.exists()
    assert [m for m in _warnings(caplog) if m.startswith(f"kernel cache alias {alias} names ")], caplog.text
    assert alias.read_text().strip() == real  # written again


def test_cache_folders_are_private_under_any_umask(tmp_path, monkeypatch):
    _private_cache(monkeypatch, tmp_path / "made" / "cache")
    umask = os.umask(0)
    try:
        assert _run(_probe(0.0303)) < 1e-5
    finally:
        os.umask(umask)
    modes = _modes(tmp_path / "made")
    assert {m for p, m in modes.items() if os.path.isdir(p)} == {0o700}, modes
    assert {m for p, m in modes.items() if not os.path.isdir(p)} == {0o600}, modes


def _other_users(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        os.chown(p, NOBODY, NOBODY, follow_symlinks=False)


UNSAFE = {  # how the cache dir (or a folder in it) comes to be someone else's: the refusal it gets
    "cache dir of another user": (lambda root, real: _other_users(root), r"is owned by .*uid 65534"),
    "cache dir writable by others": (lambda root, real: root.chmod(0o777), r"chmod go-w"),
    "cache dir writable by its group": (lambda root, real: root.chmod(0o770), r"chmod go-w"),
    "symlink to another user's folder": (lambda root, real: (root.rename(real), _other_users(real),
                                                              root.symlink_to(real)), r"is owned by .*uid 65534"),
    "symlink of another user": (lambda root, real: (root.rename(real), root.symlink_to(real),
                                                     os.chown(root, NOBODY, NOBODY, follow_symlinks=False)),
                                r"is a symbolic link owned by .*uid 65534"),
    "version folder of another user": (lambda root, real: _other_users(attncc.cache.folder()),
                                       r"is owned by .*uid 65534"),
    "alias folder writable by others": (lambda root, real: (attncc.cache.folder() / "aliases").chmod(0o757),
                                        r"chmod go-w"),
    "a file, not a folder": (lambda root, real: (shutil.rmtree(root), root.write_text("")), r"is not a folder"),
}


@pytest.mark.parametrize("setup", list(UNSAFE))
def test_a_cache_folder_others_can_write_is_refused(setup, tmp_path, monkeypatch):
    """A kernel file planted, with its digest, by whoever else can write the folder never runs:
    attncc names the folder and the fix instead."""
    root = _private_cache(monkeypatch, tmp_path / "cache")
    kernel = _probe(0.0404)
    assert _run(kernel) < 1e-5
    marker = tmp_path / "ran"
    _plant(_fwd_file(), _evil(marker))
    make_unsafe, refusal = UNSAFE[setup]
    make_unsafe(root, tmp_path / "elsewhere")
    _new_process(monkeypatch)
    with pytest.raises(attncc.AttnccError, match=refusal) as info:
        _run(kernel)
    assert "ATTNCC_CACHE_DIR" in str(info.value) and not marker.exists()
    if setup.startswith("cache dir") or setup.startswith("symlink"):
        assert f"the folder {root} " in str(info.value)
    with pytest.raises(attncc.AttnccError, match=refusal):
        kernel.source("fwd", torch.float32, head_dim=16, target="interpreter")


def test_a_symlink_to_a_folder_of_yours_is_used(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    _private_cache(monkeypatch, tmp_path / "link")
    assert _run(_probe(0.0505)) < 1e-5
    assert list(real.glob("attncc-*/fwd_*.py"))


@pytest.mark.parametrize("how", ["owned by another user", "writable by others", "a symlink"])
def test_a_kernel_file_attncc_did_not_write_does_not_run(how, tmp_path, monkeypatch, caplog):
    _private_cache(monkeypatch, tmp_path / "cache")
    kernel = _probe(0.0606)
    assert _run(kernel) < 1e-5
    path, marker = _fwd_file(), tmp_path / "ran"
    good = path.read_bytes()
    _plant(path, _evil(marker))
    if how == "owned by another user":
        os.chown(path, NOBODY, NOBODY)
    elif how == "writable by others":
        path.chmod(0o666)
    else:
        path.rename(tmp_path / "evil.py")
        path.symlink_to(tmp_path / "evil.py")
    _new_process(monkeypatch)
    caplog.set_level(logging.WARNING, logger="attncc")
    assert _run(kernel) < 1e-5 and not marker.exists()
    assert [m for m in _warnings(caplog) if m.startswith(f"kernel cache file {path} ")], caplog.text
    assert path.read_bytes() == good and not path.is_symlink() and path.stat().st_uid == os.getuid()


def test_edited_kernels_run_from_the_override_dir_only(tmp_path, monkeypatch, caplog):
    """An edited file in the cache is generated again; a copy in ATTNCC_OVERRIDE_DIR runs."""
    _private_cache(monkeypatch, tmp_path / "cache")
    kernel = _probe(0.0707)
    assert _run(kernel) < 1e-5
    path = _fwd_file()
    line = "s = score_mod * 1.4426950408889634"
    edited = path.read_text().replace(line, line.replace("score_mod", "(score_mod * 0.0)"))
    assert line in path.read_text()
    path.write_text(edited)
    _new_process(monkeypatch)
    assert _run(kernel) < 1e-5  # generated again
    edits = tmp_path / "edits"
    edits.mkdir(mode=0o700)
    (edits / path.name).write_text(edited)
    monkeypatch.setenv("ATTNCC_OVERRIDE_DIR", str(edits))
    _new_process(monkeypatch)
    caplog.set_level(logging.WARNING, logger="attncc")
    assert _run(kernel) > 1e-2  # uniform causal weights now, far from the reference
    running = f"running {edits / path.name} in place of the generated {path.name} (ATTNCC_OVERRIDE_DIR)"
    assert running in _warnings(caplog)
    (edits / path.name).chmod(0o666)
    _new_process(monkeypatch)
    with pytest.raises(attncc.AttnccError, match=r"refusing the edited kernel .* writable by group or others"):
        _run(kernel)
    (edits / path.name).write_text("def attn_fwd(:\n")
    (edits / path.name).chmod(0o600)
    with pytest.raises(attncc.AttnccError, match=rf"the kernel file {re.escape(str(edits / path.name))} does not "
                                                 r"load \(SyntaxError"):
        _run(kernel)


def test_a_kernel_file_removed_before_it_is_imported_still_runs(tmp_path, monkeypatch):
    """A clear (another process's `attncc cache clear` or rm -rf) between writing a kernel file
    and importing it: the verified text in memory runs, and Triton reads its source from it."""
    _private_cache(monkeypatch, tmp_path / "cache")
    write_alias = attncc.cache.write_alias

    def then_clear(*args):
        write_alias(*args)
        shutil.rmtree(attncc.cache.folder())
    monkeypatch.setattr(attncc.cache, "write_alias", then_clear)
    assert _run(_probe(0.0808)) < 1e-5
    assert attncc.cache.entries() == []


_CLEARER = textwrap.dedent("""
    import os, sys, time
    import attncc.cache
    ready, stop = sys.argv[1:]
    open(ready, "w").close()
    while not os.path.exists(stop):
        attncc.cache.clear()
        time.sleep(0.001)
""")


def test_generation_survives_a_concurrent_clear(tmp_path, monkeypatch):
    """Another process clears the cache again and again while this one generates kernels: every
    call succeeds, and the clearing process never trips over a file that vanished."""
    _private_cache(monkeypatch, tmp_path / "cache")
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    child = subprocess.Popen([sys.executable, "-c", _CLEARER, str(ready), str(stop)], stderr=subprocess.PIPE,
                             text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and child.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        errors = [_run(_probe(0.1 + i / 1000)) for i in range(30)]
    finally:
        stop.touch()
        _, stderr = child.communicate(timeout=60)
    assert max(errors) < 1e-5
    assert child.returncode == 0, stderr[-3000:]


_CHURN = textwrap.dedent("""
    import os, sys
    folder, stop = sys.argv[1:]
    while not os.path.exists(stop):
        try:
            os.makedirs(folder, exist_ok=True)
            for i in range(50):
                p = os.path.join(folder, f"fwd_{i}.py.x{i}.tmp")
                open(p, "w").close()
                os.unlink(p)
        except OSError:
            pass
""")


def test_clear_tolerates_files_that_vanish(tmp_path, monkeypatch):
    """`attncc cache clear` while writers create and rename temporary files."""
    _private_cache(monkeypatch, tmp_path / "cache")
    (tmp_path / "cache").mkdir(mode=0o700)
    stop = tmp_path / "stop"
    churn = subprocess.Popen([sys.executable, "-c", _CHURN, str(attncc.cache.folder()), str(stop)])
    try:
        deadline = time.time() + 3
        while time.time() < deadline:
            attncc.cache.clear()
            attncc.cache.entries()
    finally:
        stop.touch()
        churn.wait(timeout=60)
