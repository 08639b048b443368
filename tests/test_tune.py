"""Autotuning (ATTNCC_AUTOTUNE=1, attncc/tune.py): the tuned kernels still match the float64
reference, the candidate the tuner ranks first is what runs, the choice persists in a JSON
file that a second process reads instead of tuning again, and a candidate whose outputs
disagree with the table default's is never chosen."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import attncc
from attncc import runtime, tune
from attncc.errors import AttnccError
from conftest import check, reference, rel_err

from variants import alibi_slopes, causal_mask


@pytest.fixture
def tuning(monkeypatch, tmp_path):
    """ATTNCC_AUTOTUNE=1 with a cache folder of the test's own and an empty in-process memory.
    Nothing is timed: tune._time is replaced by a script whose n-th call reports 10 - n, which
    makes the tuner rank the last candidate first; the fixture returns the list of its calls."""
    monkeypatch.setenv("ATTNCC_AUTOTUNE", "1")
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tune, "_chosen", {})
    monkeypatch.setattr(tune, "_tables", {})
    monkeypatch.setattr(tune, "stats", {"tuned": 0, "file_hits": 0})
    timed = []

    def fake_time(fn, interpret):
        fn()
        timed.append(len(timed))
        return 10.0 - len(timed)
    monkeypatch.setattr(tune, "_time", fake_time)
    return timed


def _alibi_causal(H, device="cpu"):
    slopes = alibi_slopes(H, device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi, causal_mask


def _spy_tiles(monkeypatch) -> list:
    """LAUNCH_TILES of every module launched from now on."""
    seen = []
    launch = runtime.launch

    def spy(module, *args, **kwargs):
        seen.append(dict(module.LAUNCH_TILES))
        return launch(module, *args, **kwargs)
    monkeypatch.setattr(runtime, "launch", spy)
    return seen


def test_tuned_kernels_match_reference_and_run_the_choice(tuning, monkeypatch):
    B, Hq, Hkv, Lq, Lkv, D = 2, 4, 2, 33, 70, 24  # GQA, Lq != Lkv, ragged tiles, D not a power of two
    q = torch.randn(B, Hq, Lq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Lkv, D, requires_grad=True)
    v = torch.randn(B, Hkv, Lkv, D, requires_grad=True)
    score_mod, mask_mod = _alibi_causal(Hq)
    seen = _spy_tiles(monkeypatch)
    out, lse, _ = check(q, k, v, score_mod, mask_mod, enable_gqa=True)
    assert tune.stats == {"tuned": 1, "file_hits": 0}
    # the scripted timings make the interpreter's second candidate the fastest: it runs last
    assert seen[-1]["attn_fwd"] == tune._INTERPRETER["fwd"][0]["tiles"]["attn_fwd"]
    assert seen[0]["attn_fwd"] != seen[-1]["attn_fwd"]

    dout = torch.randn_like(out)
    out.backward(dout)
    ref = reference(q, k, v, score_mod, mask_mod, enable_gqa=True)[0]
    grads = torch.autograd.grad(ref, (q, k, v), dout.double())
    for got, want in zip((q.grad, k.grad, v.grad), grads):
        assert rel_err(got, want) < 1e-5
    assert tune.stats["tuned"] == 2
    assert seen[-1]["attn_bwd_dkdv"] == tune._INTERPRETER["bwd"][0]["tiles"]["attn_bwd_dkdv"]

    # the file holds both choices, with every candidate's time and no dropped one
    path = tune.table_path("interpreter", q.device)
    entries = json.loads(path.read_text())["entries"]
    assert sorted(e["kernel"] for e in entries.values()) == ["bwd", "fwd"]
    for e in entries.values():
        assert [t["choice"] for t in e["tried"]][0] == {}
        assert all("ms" in t for t in e["tried"]) and len(e["tried"]) == 2
        # record keeping: the choice is the candidate the fixture's scripted figures rank first,
        # and the entry stores the figures it was handed for it and for the table default
        assert e["choice"] == e["tried"][1]["choice"]
        assert (e["ms"], e["default_ms"]) == (e["tried"][1]["ms"], e["tried"][0]["ms"])

    # a second call of the same size class tunes nothing and times nothing
    timed_before = len(tuning)
    attncc.attention(q, k, v, score_mod, mask_mod, enable_gqa=True).sum().backward()
    assert tune.stats["tuned"] == 2 and len(tuning) == timed_before


def test_choice_is_read_back_from_the_file(tuning):
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    attncc.attention(q, k, v, mask_mod=causal_mask)
    assert tune.stats["tuned"] == 1
    tune._chosen.clear()  # as a new process: only the file remembers
    tune._tables.clear()
    timed_before = len(tuning)
    out = attncc.attention(q, k, v, mask_mod=causal_mask)
    assert tune.stats == {"tuned": 1, "file_hits": 1} and len(tuning) == timed_before
    assert rel_err(out, reference(q, k, v, None, causal_mask)[0]) < 1e-5


def test_a_second_process_does_not_tune_again(tmp_path):
    script = textwrap.dedent("""
        import json, torch, attncc
        from attncc import tune
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, 2, 48, 16, requires_grad=True) for _ in range(3))
        attncc.attention(q, k, v, mask_mod=lambda b, h, qi, ki: qi >= ki).sum().backward()
        print(json.dumps(tune.stats))
    """)
    env = {**os.environ, "ATTNCC_AUTOTUNE": "1", "ATTNCC_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first == {"tuned": 2, "file_hits": 0}
    assert second == {"tuned": 0, "file_hits": 2}


class _FakeCompiled:
    """Stands for a CompiledAttention: module(kernel, spec) gives a module whose outputs and
    time are scripted per choice of attn_fwd tiles (None: the table's)."""
    variant = "fake-variant"

    def __init__(self, outputs, ms=None):
        self.outputs, self.ms = outputs, ms or {}

    def module(self, kernel, spec):
        tiles = dict(spec.tiles).get("attn_fwd")
        return type("M", (), {"LAUNCH_TILES": {"attn_fwd": tiles}, "TMA": False, "WARP_SPECIALIZED": False,
                              "result": self.outputs[tiles], "ms": self.ms.get(tiles, 1.0)})


def _scripted_run(monkeypatch):
    """run(module) returning the module's outputs; tune._time reports the module's scripted ms."""
    last = []

    def run(module):
        last.append(module)
        return module.result

    def fake_time(fn, interpret):
        fn()
        return last[-1].ms
    monkeypatch.setattr(tune, "_time", fake_time)
    return run


def _spec():
    return attncc.spec.Spec("float16", 64, 64, 1, "interpreter")


@pytest.mark.parametrize("bad", ["perturbed", "nan", "lse pattern"])
def test_candidate_with_different_outputs_is_never_chosen(bad, monkeypatch):
    out = torch.randn(2, 3, 50, 8)
    lse = torch.randn(2, 3, 50)
    lse[0, 0, :5] = -float("inf")  # fully masked rows: equal infinities agree
    wrong_out, wrong_lse = out.clone(), lse.clone()
    if bad == "perturbed":
        wrong_out += 0.05 * torch.randn_like(out)
    elif bad == "nan":
        wrong_out[1, 2, 3, 4] = float("nan")
    else:
        wrong_lse[0, 0, 10] = -float("inf")  # a row masked that is not
    agrees, wrong = (64, 32, 1, 1), (32, 64, 1, 1)
    compiled = _FakeCompiled({None: (out, lse), agrees: (out.clone(), lse.clone()), wrong: (wrong_out, wrong_lse)},
                             ms={None: 3.0, agrees: 2.0, wrong: 1.0})
    choices = [{}, {"tiles": {"attn_fwd": agrees}}, {"tiles": {"attn_fwd": wrong}}]
    entry = tune.measure(compiled, "fwd", _spec(), _scripted_run(monkeypatch), choices)
    # the wrong candidate's scripted figure ranks first, but its outputs disagree: it is dropped
    assert entry["choice"] == {"tiles": {"attn_fwd": agrees}}
    assert "differ" in entry["tried"][2]["error"]
    assert [t.get("ms") for t in entry["tried"][:2]] == [3.0, 2.0]


def test_candidate_out_of_resources_is_dropped(monkeypatch):
    class OutOfResources(Exception):
        pass
    out = (torch.randn(4, 4), torch.randn(4))
    compiled = _FakeCompiled({None: out, (32, 64, 1, 1): out}, ms={None: 2.0, (32, 64, 1, 1): 1.0})
    scripted = _scripted_run(monkeypatch)

    def run(module):
        if module.LAUNCH_TILES["attn_fwd"] is not None:
            raise OutOfResources("out of resource: shared memory, Required: 300000, Hardware limit: 232448")
        return scripted(module)
    entry = tune.measure(compiled, "fwd", _spec(), run, [{}, {"tiles": {"attn_fwd": (32, 64, 1, 1)}}])
    assert entry["choice"] == {} and entry["tried"][1]["error"].startswith("OutOfResources")


def test_disagreement():
    a = torch.tensor([1.0, -float("inf"), 2.0])
    assert tune.disagreement([a], [a.clone()]) == 0.0
    assert tune.disagreement([a], [torch.tensor([1.0, 0.0, 2.0])]) == float("inf")
    assert tune.disagreement([a], [torch.tensor([1.0, -float("inf"), 2.5])]) == pytest.approx(0.5 / 7.25 ** 0.5)  # over the finite part of the second
    assert tune.disagreement([a], [a, a]) == float("inf")


def test_gpu_candidates_are_valid_tiles():
    """The candidate lists of every head-dim class: the table default first, then whole-warp
    tiles that the kernels accept (powers of two, multiples of the block-class grain of 32 for
    keys, 16 for queries), and the other way of reading K/V where descriptors apply."""
    class Module:
        TMA, WARP_SPECIALIZED = False, False
    for d in (64, 128, 256):
        for dtype in ("bfloat16", "float16", "float32"):
            spec = attncc.spec.Spec(dtype, d, d, 1, "cuda-sm90", tma="auto")
            for kernel in ("fwd", "bwd"):
                cands = tune.candidates(kernel, spec, Module)
                assert cands[0] == {} and len(cands) >= 4
                for c in cands[1:]:
                    for fn, (bm, bn, warps, stages) in c.get("tiles", {}).items():
                        assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0, c
                        assert warps in (4, 8) and 1 <= stages <= 4, c
                        tune.apply(spec, c)  # a valid Spec
                if kernel == "fwd":
                    assert {"tma": "on"} in cands
    ws = type("WS", (), {"TMA": False, "WARP_SPECIALIZED": True})
    cands = tune.candidates("fwd", attncc.spec.Spec("bfloat16", 128, 128, 1, "cuda-sm90", tma="auto", ws="auto"), ws)
    assert {"ws": "off"} in cands and all(set(c.get("tiles", {})) <= {"attn_fwd_ws"} for c in cands)


def test_malformed_file_is_measured_again(tuning, caplog):
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    path = tune.table_path("interpreter", q.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with caplog.at_level("WARNING", logger="attncc"):
        out = attncc.attention(q, k, v)
    assert "cannot read" in caplog.text and tune.stats["tuned"] == 1
    assert rel_err(out, reference(q, k, v)[0]) < 1e-5
    assert len(json.loads(path.read_text())["entries"]) == 1  # rewritten whole


def test_bad_autotune_value(monkeypatch):
    monkeypatch.setenv("ATTNCC_AUTOTUNE", "sometimes")
    q, k, v = (torch.randn(1, 1, 8, 16) for _ in range(3))
    with pytest.raises(AttnccError, match="ATTNCC_AUTOTUNE"):
        attncc.attention(q, k, v)


def test_tuned_backward_with_a_learnable_capture(tuning):
    """Candidates of a backward that accumulates a captured tensor's gradient by atomics run on
    fresh buffers each time: the tuned gradient equals the reference's, not a multiple of it."""
    torch.manual_seed(3)
    B, H, L, D = 1, 2, 40, 16
    table = (0.5 * torch.randn(H, 2 * L - 1)).requires_grad_()

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + L - 1]
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))
    out = attncc.attention(q, k, v, rel_bias, causal_mask)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert tune.stats["tuned"] == 2
    t64 = table.detach().double().requires_grad_()

    def rel_bias64(score, b, h, q_idx, kv_idx):
        return score + t64[h, q_idx - kv_idx + L - 1]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attncc.reference.attention(q64, k64, v64, rel_bias64, causal_mask)
    want = torch.autograd.grad(ref, (q64, k64, v64, t64), dout.double())
    for got, w in zip((q.grad, k.grad, v.grad, table.grad), want):
        assert rel_err(got, w) < 1e-4


def _deep(n):
    out = 64
    for _ in range(n):
        out = [out]
    return out


@pytest.mark.parametrize("choice", [
    {"tiles": {"attn_fwd": [-32, 64, 1, 1]}},  # NaN and 1e30 in the output
    None,
    {"tiles": {"attn_fwd": [0, 64, 1, 1]}},
    {"tiles": {"attn_fwd": [48, 64, 1, 1]}},
    {"tiles": {"attn_fwd": [64, 64, 1, 1]}},  # a valid tile, but not one of the tuner's candidates
    {"tiles": {"attn_fwd": [32.0, 64, 1, 1]}},
    {"tiles": {"attn_fwd": [32, 64, True, True]}},
    {"tiles": {"attn_bwd_dq": [32, 64, 1, 1]}},  # another kernel's function
    {"tiles": {"attn_fwd": _deep(200)}},
    {"tma": "on"},  # not a candidate of the interpreter
    {"tiles": {"attn_fwd": [32, 64, 1, 1]}, "extra": 1},
    "entry is a string",
], ids=lambda c: repr(c)[:40])
def test_entry_the_tuner_could_not_have_chosen_is_ignored(tuning, monkeypatch, caplog, choice):
    """A tuning file entry is used only if it is one of the candidates the tuner has for that
    kernel (tune.candidates); anything else is logged and the call runs attncc's table."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    attncc.attention(q, k, v, mask_mod=causal_mask)  # tunes: one entry in the file
    path = tune.table_path("interpreter", q.device)
    data = json.loads(path.read_text())
    (key, entry), = data["entries"].items()
    if choice == "entry is a string":
        data["entries"][key] = choice
    else:
        entry["choice"] = choice
    path.write_text(json.dumps(data))
    tune._chosen.clear()  # as a new process
    tune._tables.clear()
    seen = _spy_tiles(monkeypatch)
    want = reference(q, k, v, None, causal_mask)[0]
    for _ in range(2):  # the bad entry stays in the file: every later call goes on as well
        with caplog.at_level("WARNING", logger="attncc"):
            out = attncc.attention(q, k, v, mask_mod=causal_mask)
        assert rel_err(out, want) < 1e-5
    assert f"ignoring entry {key} of {path}" in caplog.text and "running attncc's table" in caplog.text
    assert tune.stats == {"tuned": 1, "file_hits": 0}
    assert all(t["attn_fwd"] == (32, 32, 1, 1) for t in seen)  # the interpreter table's tiles


def test_file_nested_too_deep_is_measured_again(tuning, caplog):
    q, k, v = (torch.randn(1, 2, 20, 16) for _ in range(3))
    path = tune.table_path("interpreter", q.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"format": 1, "entries": ' + "[" * 100000 + "]" * 100000 + "}")
    with caplog.at_level("WARNING", logger="attncc"):
        out = attncc.attention(q, k, v)
    assert "cannot read" in caplog.text and "RecursionError" in caplog.text and tune.stats["tuned"] == 1
    assert rel_err(out, reference(q, k, v)[0]) < 1e-5
    assert len(json.loads(path.read_text())["entries"]) == 1  # rewritten whole


def test_valid_choices_are_the_candidates():
    class Module:
        TMA, WARP_SPECIALIZED = True, False
    spec = attncc.spec.Spec("bfloat16", 128, 128, 1, "cuda-sm90", tma="auto")
    for kernel in ("fwd", "bwd"):
        for c in tune.candidates(kernel, spec, Module):
            assert tune.valid_choice({"choice": json.loads(json.dumps(c))}, kernel, spec, Module) == c
    assert tune.valid_choice({"choice": {"tma": "off"}}, "fwd", spec, Module) == {"tma": "off"}
    assert tune.valid_choice({"choice": {"tma": "on"}}, "fwd", spec, Module) is None  # the table's own way
    assert tune.valid_choice({"choice": {"tiles": {"attn_fwd": [128, 128, 8, 2]}}}, "bwd", spec, Module) is None
    assert tune.valid_choice({"choice": {"tiles": {"attn_fwd": [128, 128, 8, 2]}}}, "fwd", spec, Module) is not None
