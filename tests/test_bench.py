"""benchmarks/bench.py's bookkeeping, on the CPU (its timings need a GPU, so they are stubbed here):
with --rounds the systems of a cell are timed in turn and each row keeps the median of its rounds;
a system that cannot express the variant, fails to build or fails while timed gets a note row."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load_bench():
    """benchmarks/bench.py as a module of its own, with its `variants` and `report`: the tests have a
    `variants` module too, which neither may replace in sys.modules or on sys.path."""
    saved = {name: sys.modules.pop(name, None) for name in ("variants", "report")}
    path = list(sys.path)
    try:
        sys.path.insert(0, str(BENCHMARKS))
        spec = importlib.util.spec_from_file_location("attncc_benchmarks_bench", BENCHMARKS / "bench.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        for name, mod in saved.items():
            sys.modules.pop(name, None)
            if mod is not None:
                sys.modules[name] = mod
    return module


bench = _load_bench()

# per system and round: (fwd, bwd, fwd+bwd) ms, the medians neither the first, the last nor the
# mean of a system's rounds; sdpa-cudnn fails in its second round
TIMES = {"attncc": [(1.0, 10.0, 11.0), (2.0, 20.0, 22.0), (4.0, 40.0, 44.0)],
         "flex": [(4.0, 40.0, 44.0), (5.0, 50.0, 55.0), (9.0, 90.0, 99.0)],
         "sdpa-flash": [(7.0, 70.0, 77.0), (9.0, 90.0, 99.0), (8.0, 80.0, 88.0)],
         "sdpa-cudnn": [(1.0, 1.0, 1.0), ValueError("lost the device")]}


@pytest.fixture
def stubbed(monkeypatch):
    order = []

    def build(system, case, N, training=True, kernel_options=None):
        if system == "fa4":
            return None  # cannot express the variant
        if system == "flex-flash":
            return RuntimeError("cannot build")

        def fn(q, k, v):
            return q
        fn.system = system
        fn.tiles = kernel_options
        return fn

    def time_fwd_bwd(fn, q, k, v, leaves, grad_out, warmup, rep):
        if fn.system == "flex" and OVERFLOW and fn.tiles is None:  # its autotuner's tiles overflow shared memory
            raise RuntimeError("No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex")
        got = TIMES[fn.system][sum(s == fn.system for s in order)]
        order.append(fn.system)
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "build", build)
    monkeypatch.setattr(bench, "time_fwd_bwd", time_fwd_bwd)
    monkeypatch.setattr(bench, "check", lambda *args: {"out": 1e-3, "dq": 2e-3})
    monkeypatch.setattr(sys.modules[__name__], "OVERFLOW", False)
    return order


OVERFLOW = False  # the stubbed flex fails with its own tiles


def test_flex_runs_with_small_tiles_where_its_own_overflow(stubbed, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "OVERFLOW", True)
    case = bench.make_cases(2, 64, "cpu")["causal"]
    rows = {r["system"]: r for r in bench.bench_case(case, (1, 2, 64, 16), 1, 1, ("attncc", "flex"), rounds=2)}
    assert stubbed == ["attncc", "flex", "flex", "attncc"]  # every other round in reverse order
    assert rows["flex"]["fwd_ms"] == 4.5 and "kernel_options" in rows["flex"]["note"]
    assert "overflow shared memory" in rows["flex"]["note"] and rows["attncc"]["note"] is None


def test_rounds_time_in_turn_and_keep_medians(stubbed):
    case = bench.make_cases(2, 64, "cpu")["causal"]
    rows = {r["system"]: r for r in bench.bench_case(case, (1, 2, 64, 16), 1, 1, bench.SYSTEMS, rounds=3)}
    turn = ["attncc", "flex", "sdpa-flash", "sdpa-cudnn"]
    # in turn, every other round in reverse order; sdpa-cudnn, failed in round 2, is not timed again
    assert stubbed == turn + turn[::-1] + turn[:3]
    assert (rows["attncc"]["fwd_ms"], rows["attncc"]["bwd_ms"], rows["attncc"]["fwdbwd_ms"]) == (2.0, 20.0, 22.0)
    assert (rows["flex"]["fwd_ms"], rows["sdpa-flash"]["bwd_ms"]) == (5.0, 80.0)
    assert rows["attncc"]["rounds"] == 3 and rows["attncc"]["check_ok"] is True
    assert rows["attncc"]["check_ref"] == "sdpa-flash"
    assert rows["sdpa-cudnn"]["fwd_ms"] is None and "lost the device" in rows["sdpa-cudnn"]["note"]
    assert rows["flex-flash"]["fwd_ms"] is None and "cannot build" in rows["flex-flash"]["note"]
    assert rows["fa4"]["fwd_ms"] is None and rows["fa4"]["note"].startswith("n/a")


def test_one_round_by_default(stubbed):
    case = bench.make_cases(2, 64, "cpu")["causal"]
    rows = {r["system"]: r for r in bench.bench_case(case, (1, 2, 64, 16), 1, 1, ("attncc", "flex"))}
    assert stubbed == ["attncc", "flex"] and rows["attncc"]["fwd_ms"] == 1.0 and rows["attncc"]["rounds"] == 1


def test_rounds_must_be_positive(capsys):
    assert bench.parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "0"])
    assert "--rounds must be at least 1" in capsys.readouterr().err
