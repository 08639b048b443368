"""attncc logs through ``logging.getLogger("attncc")``: INFO for what costs time on a first call
(sympy passes, kernel generation on a cache miss, the first launch of each generated module),
DEBUG for cache hits and tile choices. ATTNCC_LOG=info|debug sets the level and a stderr handler."""
from __future__ import annotations

import importlib
import logging
import random
import re
import types

import pytest

import attncc
from attncc import cache, config, plan, runtime
from attncc.tiles import Tiles, choose_tiles
from conftest import check, randn_qkv

LOGGER = "attncc"


def messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_first_call_logs_analysis_codegen_and_first_launch(caplog):
    """A variant nobody generated before: INFO lines for the sympy passes, the cache miss (with
    the generation time) and the first launch; a second call logs nothing at INFO."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    scale = 1.0 + random.random()  # a constant no other test (or earlier run) compiled
    mod = lambda score, b, h, q_idx, kv_idx: score * scale  # noqa: E731
    q, k, v = randn_qkv(1, 2, 2, 8, 8, 16)
    check(q, k, v, mod)
    info = messages(caplog, logging.INFO)
    assert any(re.fullmatch(r"analysed variant '\S+' \(sympy passes\) in \d+ ms", m) for m in info), info
    miss = [m for m in info if m.startswith("kernel cache miss: generated ")]
    assert len(miss) == 1 and re.search(r"fwd_[0-9a-f]+\.py in \d+ ms$", miss[0]), info
    first = [m for m in info if m.startswith("first launch of fwd_")]
    assert len(first) == 1 and re.search(r"\(attn_fwd\) in \d+\.\d\d s in the Triton interpreter", first[0]), info

    caplog.clear()
    attncc.attention(q, k, v, mod)
    assert messages(caplog, logging.INFO) == []


def test_cache_hit_and_miss(tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    path = tmp_path / "fwd_test.py"
    calls = []

    def generate():
        calls.append(1)
        return "# generated\n"
    assert cache.get_or_create(path, generate) == path
    assert cache.get_or_create(path, generate) == path
    assert len(calls) == 1 and path.read_text() == "# generated\n"
    misses = [m for m in messages(caplog, logging.INFO) if "cache miss" in m]
    assert len(misses) == 1 and re.fullmatch(rf"kernel cache miss: generated {re.escape(str(path))} in \d+ ms", misses[0])
    assert f"kernel cache hit: {path}" in messages(caplog, logging.DEBUG)


def _fake_module(name: str, launch):
    module = types.ModuleType(f"attncc_generated.{name}")
    module.__file__ = f"/cache/{name}.py"
    module.TILES = {"attn_fwd": (128, 64)}
    module.launch = launch
    return module


def test_compile_time_logged_once_per_module(caplog):
    """On a GPU Triton compiles a module's kernels on its first launch: that launch is logged
    as the compile time, later launches are not."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    launches = []
    module = _fake_module(f"fwd_test{random.getrandbits(32):08x}", lambda *a, **k: launches.append(a) or "done")
    assert runtime.launch(module, 1, 2) == "done"
    assert runtime.launch(module, 3) == "done"
    assert launches == [(1, 2), (3,)]
    info = messages(caplog, logging.INFO)
    assert len(info) == 1, info
    assert re.fullmatch(rf"compiled {module.__name__[17:]} \(attn_fwd\) in \d+\.\d\d s \(first launch: "
                        r"Triton compile \+ launch\)", info[0]), info


def _tile_log(caplog, fn, spec, sparse=False):
    caplog.clear()
    tiles = choose_tiles(fn, spec, sparse)
    logs = [m for m in messages(caplog, logging.DEBUG) if m.startswith(f"tiles of {fn} ")]
    assert len(logs) == 1, logs
    return tiles, logs[0]


def test_tile_choices_logged_with_their_reason(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    monkeypatch.delenv("ATTNCC_TILES", raising=False)
    spec = plan.Spec("bfloat16", 128, 128, 1, "cuda-sm90")

    tiles, log = _tile_log(caplog, "attn_fwd", spec)
    assert log == (f"tiles of attn_fwd (bfloat16, head dim 128/128, cuda-sm90): {tiles.block_m}x{tiles.block_n}, "
                   f"num_warps={tiles.num_warps}, num_stages={tiles.num_stages} (default table)")

    _, log = _tile_log(caplog, "attn_fwd", spec, sparse=True)
    assert log.endswith(": 64x64, num_warps=4, num_stages=3 (default table, then 64x64 for a data-dependent mask)")

    for fn in ("attn_bwd_dkdv", "attn_bwd_dq"):
        assert _tile_log(caplog, fn, spec, sparse=True)[1].endswith("then 64x64 for a data-dependent mask)")
        assert "data-dependent" not in _tile_log(caplog, fn, plan.Spec("bfloat16", 64, 64, 1, "cuda-sm90"), sparse=True)[1]

    dropout64 = plan.Spec("bfloat16", 64, 64, 1, "cuda-sm90", dropout=True)
    _, log = _tile_log(caplog, "attn_bwd_dkdv", dropout64)
    assert log.endswith(": 64x64, num_warps=4, num_stages=3 (default table, then 64x64 for dropout at head dim <= 64)")
    for other in (plan.Spec("bfloat16", 64, 64, 1, "cuda-sm90"), plan.Spec("bfloat16", 128, 128, 1, "cuda-sm90", dropout=True)):
        assert "for dropout" not in _tile_log(caplog, "attn_bwd_dkdv", other)[1]

    shrunk, log = _tile_log(caplog, "attn_fwd", plan.Spec("bfloat16", 128, 128, 1, "cuda-sm90", shrink=2))
    assert shrunk.num_stages == max(tiles.num_stages - 2, 1)
    assert log.endswith("(default table, shrunk 2 level(s) after running out of shared memory)")

    monkeypatch.setenv("ATTNCC_TILES", '{"attn_fwd": [64, 32, 4, 2]}')
    tiles, log = _tile_log(caplog, "attn_fwd", spec)
    assert (tiles.block_m, tiles.block_n, tiles.num_warps, tiles.num_stages) == (64, 32, 4, 2)
    assert log.endswith(": 64x32, num_warps=4, num_stages=2 (ATTNCC_TILES override)")

    _, log = _tile_log(caplog, "attn_fwd", plan.Spec("float32", 16, 16, 1, "interpreter"))
    assert log.endswith("(interpreter default)")


@pytest.mark.parametrize("text,level", [("info", logging.INFO), ("DEBUG", logging.DEBUG), (" warning ", logging.WARNING),
                                        ("", None)])
def test_log_level_knob(monkeypatch, text, level):
    monkeypatch.setenv("ATTNCC_LOG", text)
    assert config.log_level() == level


def test_log_level_knob_rejects_unknown_levels(monkeypatch):
    monkeypatch.setenv("ATTNCC_LOG", "verbose")
    with pytest.warns(UserWarning, match="ATTNCC_LOG='verbose' is not a log level; use one of debug, info"):
        assert config.log_level() is None


def test_attncc_log_installs_a_stderr_handler(monkeypatch, capsys):
    """ATTNCC_LOG=debug at import: the attncc logger gets the level and one stderr handler."""
    logger = logging.getLogger(LOGGER)
    level, handlers = logger.level, list(logger.handlers)
    monkeypatch.setenv("ATTNCC_LOG", "debug")
    try:
        logger.handlers.clear()
        importlib.reload(attncc.log)
        assert logger.level == logging.DEBUG and len(logger.handlers) == 1
        logger.propagate, propagate = False, logger.propagate
        try:
            logger.debug("hello %d", 42)
        finally:
            logger.propagate = propagate
        assert "[attncc DEBUG] hello 42" in capsys.readouterr().err
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    assert attncc.log.logger is logger


def test_warp_specialized_stages_capped(caplog, monkeypatch):
    """ATTNCC_TILES cannot ask the warp-specialised loop for 3 stages (wrong results on triton
    3.6, found by the autotuner): the request is capped at 2 with a warning."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    monkeypatch.setenv("ATTNCC_TILES", '{"attn_fwd_ws": [128, 64, 4, 3]}')
    tiles = choose_tiles("attn_fwd_ws", plan.Spec("bfloat16", 128, 128, 1, "cuda-sm90"))
    assert tiles == Tiles(128, 64, 4, 2)
    assert any("at most 2 stages" in m for m in messages(caplog, logging.WARNING))
