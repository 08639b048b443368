"""The command line (attncc/cli.py): main([...]) in process, and one `python -m attncc` subprocess.

Generating a kernel's source needs no compilation, so these run fast on the CPU."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attncc
from attncc import cli

MODS = '''
import torch
import attncc

doc_ids = torch.tensor([0] * 48 + [1] * 208)  # two documents in 256 positions

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)

def document(b, h, q_idx, kv_idx):
    return (doc_ids[q_idx] == doc_ids[kv_idx]) & (q_idx >= kv_idx)

def three(b, h, q_idx):
    return q_idx > 0

def either(*args):
    return args[-2] >= args[-1]

print("importing mods")  # must not reach the command's stdout
variant = attncc.Variant(softcap, causal, name="softcap_causal")
compiled = attncc.compile(variant)
number = 3
'''


@pytest.fixture
def mods(tmp_path) -> Path:
    path = tmp_path / "mods_cli.py"
    path.write_text(MODS)
    return path


def run(capsys, *argv):
    """(exit status, stdout, stderr) of cli.main(argv)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_line(capsys, *argv) -> str:
    """The single stderr line of a command that must fail with status 2 and print nothing."""
    code, out, err = run(capsys, *argv)
    assert code == 2, (code, err)
    lines = [line for line in err.strip().splitlines() if line != "importing mods"]  # printed by MODS
    assert len(lines) == 1 and lines[0].startswith("attncc: error: "), err
    assert "Traceback" not in err and out == ""
    return lines[0]


def test_show_variant_fwd_and_bwd(capsys, mods):
    code, fwd, err = run(capsys, "show", f"{mods}:variant")
    assert code == 0
    compile(fwd, "fwd.py", "exec")  # valid Python
    assert "def attn_fwd(" in fwd and "tanh" in fwd and "importing mods" not in fwd
    assert "importing mods" in err
    # the tier and why, on stderr (stdout is the source alone): without a GPU, sm90's choice for a
    # call of unknown length (a score_mod takes the Gluon forward from 2048 queries and keys)
    assert ("attncc show: the triton tier (head dim 128, an unknown length (< 2048): the Gluon forward measured "
            "slower (tiers.gluon_pays))") in err, err
    code, fwd, err = run(capsys, "show", f"{mods}:causal")
    assert code == 0 and "@gluon.jit" in fwd
    assert "attncc show: the gluon tier (sm90, bfloat16, head dim 128: measured faster)" in err, err
    code, bwd, _ = run(capsys, "show", f"{mods}:variant", "--kernel", "bwd", "--dtype", "fp16", "--head-dim", "64")
    assert code == 0
    compile(bwd, "bwd.py", "exec")
    assert "def attn_bwd_dq(" in bwd and "def attn_bwd_dkdv(" in bwd
    expected = attncc.compile(attncc.Variant(lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0),
                                             lambda b, h, q, k: q >= k))
    assert bwd == expected.source("bwd", torch.float16, 64)
    assert expected.tier("bwd", torch.float16, 64)[0] == "triton"  # a call of unknown length: short
    assert "the Gluon backward measured slower" in expected.tier("bwd", torch.float16, 64)[1]


def test_show_compiled_and_mods(capsys, mods):
    code, out, _ = run(capsys, "show", f"{mods}:compiled", "--gqa", "4", "--head-dim-v", "64")
    assert code == 0 and "def attn_fwd(" in out
    # a bare mask_mod, a bare score_mod, and the two joined with '+'
    code, mask_src, _ = run(capsys, "show", f"{mods}:causal")
    assert code == 0 and mask_src == attncc.compile(attncc.Variant(mask_mod=lambda b, h, q, k: q >= k)).source()
    code, score_src, _ = run(capsys, "show", f"{mods}:softcap", "--dtype", "fp32")
    assert code == 0 and "tanh" in score_src and score_src != mask_src
    code, joined, _ = run(capsys, "show", f"{mods}:softcap+causal")
    assert code == 0 and joined == run(capsys, "show", f"{mods}:variant")[1]


def test_explain(capsys, mods):
    code, out, _ = run(capsys, "explain", f"{mods}:variant")
    assert code == 0
    for part in ("IR (as traced):", "Simplified (sympy):", "Backward", "Tile skipping:", "Kernel cache folder:"):
        assert part in out
    assert "#" not in out.split("Tile skipping:")[1].split("scale")[0]  # no picture unless asked


def _picture(out: str) -> list[str]:
    return [line for line in out.splitlines() if line and set(line) <= set(".+#")]


def test_mask_ascii_causal(capsys, mods):
    code, out, _ = run(capsys, "explain", f"{mods}:causal", "--mask-ascii", "--len", 256, "--tile", "32")
    assert code == 0
    assert _picture(out) == ["#" * i + "+" + "." * (7 - i) for i in range(8)]
    assert "batch 0, head 0" in out and "28 full, 8 partial, 28 empty" in out
    # the default tile is the forward kernel's at bf16, head dim 128, as its launch picks it:
    # lengths in whole tiles of 128 up to 4096 run the persistent kernel's 128x128 (tiles.ws_kv),
    # other lengths 64x64 up to 4096 keys (tiles.short_kv), 128x128 past that
    code, out, _ = run(capsys, "explain", f"{mods}:causal", "--mask-ascii", "--len", 256)
    assert "128x128 tiles" in out and _picture(out) == ["+.", "#+"]
    code, out, _ = run(capsys, "explain", f"{mods}:causal", "--mask-ascii", "--len", 255)
    assert "64x64 tiles" in out and _picture(out) == ["#" * i + "+" + "." * (3 - i) for i in range(4)]
    code, out, _ = run(capsys, "explain", f"{mods}:causal", "--mask-ascii", "--len", 4100)
    assert "128x128 tiles" in out and len(_picture(out)) == 33
    # a ragged length: the last tiles hold 16 positions; no mask: every tile is full
    code, out, _ = run(capsys, "explain", f"{mods}:softcap", "--mask-ascii", "--len", 80, "--tile", "32x16")
    assert _picture(out) == ["#####"] * 3


def test_mask_ascii_document(capsys, mods):
    """Documents [0, 48) and [48, 256), causal: tile row 1 holds both, so column 1 is partial."""
    code, out, _ = run(capsys, "explain", f"{mods}:document", "--mask-ascii", "--len", 256, "--tile", "32")
    assert code == 0
    assert _picture(out) == ["+.......", "++......", ".++.....", ".+#+....", ".+##+...", ".+###+..",
                             ".+####+.", ".+#####+"]
    # the mask reads a captured tensor: the kernels use 64x64 tiles for it
    code, out, _ = run(capsys, "explain", f"{mods}:document", "--mask-ascii", "--len", 256)
    assert "64x64 tiles" in out and _picture(out) == ["+...", "++..", "+#+.", "+##+"]


def test_mask_png(capsys, mods, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mask.png"
    code, out, _ = run(capsys, "explain", f"{mods}:document", "--mask-png", png, "--len", 256)  # doc_ids: 256
    assert code == 0 and f"wrote {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_mask_png_without_matplotlib(capsys, mods, tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.colors", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails
    assert "needs matplotlib" in error_line(capsys, "explain", f"{mods}:causal", "--mask-png", tmp_path / "m.png")


def test_cache_list_and_clear(capsys, mods, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path / "cache"))
    code, out, _ = run(capsys, "cache", "list")
    assert code == 0 and out.startswith("0 kernel sources")
    # a variant no other test generates, so this process has not loaded its source elsewhere
    (tmp_path / "unique.py").write_text("def bias(score, b, h, q_idx, kv_idx):\n    return score + 0.123456\n")
    assert run(capsys, "show", f"{tmp_path / 'unique.py'}:bias")[0] == 0
    files = attncc.cache.entries()
    sources = [p for p, _ in files if p.suffix == ".py"]
    assert len(sources) == 1 and all(p.is_relative_to(tmp_path / "cache") for p, _ in files)
    code, out, _ = run(capsys, "cache", "list")
    assert code == 0 and sources[0].name in out and "1 kernel sources" in out and str(tmp_path / "cache") in out
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith(f"removed {len(files)} files")
    assert attncc.cache.entries() == []


def test_cache_clear_leaves_other_files(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    (tmp_path / "notes.txt").write_text("not attncc's")
    (tmp_path / "attncc-0.0.1-triton-3.0.0").mkdir()
    (tmp_path / "attncc-0.0.1-triton-3.0.0" / "fwd_old.py").write_text("x = 1\n")
    assert attncc.cache.clear() == (1, 6)
    assert (tmp_path / "notes.txt").exists() and attncc.cache.entries() == []


@pytest.mark.parametrize("argv, message", [
    (["show", "{dir}/missing.py:causal"], "no such Python file"),
    (["show", "{mods}"], "expected FILE.py:NAME"),
    (["show", "{mods}:"], "expected FILE.py:NAME"),
    (["show", "{mods}:nothing"], "defines no 'nothing'; variants and mods defined there: causal, softcap"),
    (["show", "{mods}:number"], "number (int) is not an attncc.Variant"),
    (["show", "{mods}:three"], "is neither a score_mod"),
    (["show", "{mods}:either"], "could be either"),
    (["show", "{mods}:causal+causal"], "two mask_mods"),
    (["show", "{mods}:variant+causal"], "only mod functions can be joined"),
    (["show", "{mods}:causal", "--kernel", "dq"], "invalid choice: 'dq'"),
    (["show", "{mods}:causal", "--dtype", "fp8"], "invalid choice: 'fp8'"),
    (["show", "{mods}:causal", "--head-dim", "0"], "head dim 0 is outside 1..1024"),
    (["show", "{mods}:causal", "--head-dim", "2048"], "head dim 2048 is outside 1..1024"),
    (["show", "{mods}:causal", "--head-dim", "512"], "head dims 512 / 512 are outside what the fwd kernel takes"),
    (["show", "{mods}:causal", "--kernel", "kv", "--head-dim-v", "1024"], "head dim 1024 is outside 1..512"),
    (["show", "{mods}:causal", "--head-dim-v", "x"], "head dim must be an integer"),
    (["show", "{mods}:causal", "--gqa", "0"], "GQA group 0"),
    (["explain", "{mods}:causal", "--tile", "64x"], "tile must be"),
    (["cache", "drop"], "invalid choice: 'drop'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: COMMAND"),
    (["show", "{dir}/broken.py:f"], "running {dir}/broken.py failed: ZeroDivisionError"),
    (["show", "{dir}/badmod.py:f"], "f uses `if`"),  # an AttnccError from tracing, on one line
])
def test_bad_arguments(capsys, mods, tmp_path, argv, message):
    (tmp_path / "broken.py").write_text("1 / 0\n")
    (tmp_path / "badmod.py").write_text("def f(b, h, q_idx, kv_idx):\n    if q_idx > 0:\n        return True\n"
                                        "    return False\n")
    fill = lambda s: s.format(mods=mods, dir=tmp_path)  # noqa: E731
    assert fill(message) in error_line(capsys, *map(fill, argv))


def test_show_inference_kernel_for_mla_dims(capsys, mods):
    """The inference kernel takes MLA's head dims (576 = 512 + 64 for q/k, 512 for v)."""
    code, out, _ = run(capsys, "show", f"{mods}:causal", "--kernel", "kv", "--head-dim", "576", "--head-dim-v", "512",
                       "--gqa", "16")
    assert code == 0 and "def attn_kv(" in out and "BLOCK_D=512, BLOCK_D2=64" in out and "GROUP=16" in out


def test_help_has_examples(capsys):
    for command in ("show", "explain", "bench", "demo", "cache"):
        with pytest.raises(SystemExit) as e:
            cli.main([command, "--help"])
        assert e.value.code == 0 and "example" in capsys.readouterr().out


def test_demo_found_in_repository(capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(cli.runpy, "run_path", lambda path, run_name: ran.append((path, run_name, list(sys.argv))))
    assert run(capsys, "demo", "--full")[0] == 0
    path, run_name, argv = ran[0]
    assert Path(path) == Path(__file__).resolve().parents[1] / "examples" / "demo.py" and run_name == "__main__"
    assert argv == [path, "--full"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_bench_without_cuda(capsys, mods):
    assert "bench needs a CUDA GPU" in error_line(capsys, "bench", f"{mods}:causal")


def test_bench_compares_with_sdpa_honestly(mods):
    """SDPA runs the same function only for plain full and causal attention; else it is labelled."""
    import argparse
    args = argparse.Namespace(gqa=1, batch=1, heads=2)
    label = lambda name: [s[0] for s in cli._systems(cli.load_target(f"{mods}:{name}"), args)]  # noqa: E731
    assert label("causal") == ["attncc", "FlexAttention (compiled)", "SDPA flash, causal"]
    assert label("softcap")[2] == "SDPA flash, no mask (reference point only)"
    assert label("variant")[2] == "SDPA flash, causal (reference point only)"


@pytest.mark.gpu
def test_bench_on_gpu(capsys, mods):
    code, out, err = run(capsys, "bench", f"{mods}:causal", "--len", 256, "--batch", 1, "--heads", 2,
                         "--head-dim", 64, "--backward", "--reps", 2)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| 256 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["attncc", "FlexAttention (compiled)", "SDPA flash, causal"]
    for r in rows:  # the forward and backward cells are filled with numbers (their values are not checked)
        assert all(re.fullmatch(r"\d+\.\d+", c.strip()) for c in r.split("|")[3:5]), r
    assert "[" in err and "3/3" in err  # the progress bar


def test_python_m_attncc_help():
    result = subprocess.run([sys.executable, "-m", "attncc", "--help"], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0
    assert all(c in result.stdout for c in ("show", "explain", "bench", "demo", "cache"))
    assert result.stderr == ""


EXAMPLE_MODS = Path(__file__).resolve().parents[1] / "examples" / "mods.py"


def test_examples_mods_as_readme_names_them(capsys):
    """examples/mods.py defines the mods README's command-line examples and the help texts name."""
    code, out, _ = run(capsys, "show", f"{EXAMPLE_MODS}:softcap", "--kernel", "bwd", "--dtype", "fp16",
                       "--head-dim", "64")
    assert code == 0 and "def attn_bwd_dq(" in out and "tanh" in out
    code, joined, _ = run(capsys, "show", f"{EXAMPLE_MODS}:alibi+causal")
    assert code == 0 and joined == run(capsys, "show", f"{EXAMPLE_MODS}:alibi_causal")[1]
    code, out, _ = run(capsys, "show", f"{EXAMPLE_MODS}:causal")
    assert code == 0 and "def attn_fwd" in out
    # documents of 1000 tokens, causal: tile row 15 (queries 960..1023) crosses the first boundary
    code, out, _ = run(capsys, "explain", f"{EXAMPLE_MODS}:document", "--mask-ascii", "--len", 2048)
    assert code == 0 and "Tile skipping:" in out and "64x64 tiles" in out
    picture = _picture(out)
    assert len(picture) == 32 and picture[0] == "+" + "." * 31 and picture[15] == "+" * 16 + "." * 16
    assert picture[16] == "." * 15 + "++" + "." * 15  # tile row 16 holds keys 1000..1023 of document 1


def test_explain_len_beyond_captured_tensor(capsys, mods):
    """A picture longer than a captured tensor raises the kernel call's error, naming the tensor
    (reads past its end used to count as 0 and drew a wrong picture)."""
    line = error_line(capsys, "explain", f"{mods}:document", "--mask-ascii", "--len", 512)
    assert "`doc_ids` of shape (256,) is too small" in line and "Lq=512" in line
    with pytest.raises(attncc.AttnccError, match="doc_ids"):  # the same message as a kernel call
        attncc.attention(*(torch.randn(1, 1, 512, 16) for _ in range(3)), mask_mod=cli.load_target(
            f"{mods}:document").variant.mask_mod)
    assert error_line(capsys, "explain", f"{EXAMPLE_MODS}:document", "--mask-png", "x.png", "--len", 8193)
    assert run(capsys, "explain", f"{mods}:document", "--mask-ascii", "--len", 256)[0] == 0
