"""Every ATTNCC_* environment knob, read in one place."""
from __future__ import annotations

import logging
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where generated kernel sources live: $ATTNCC_CACHE_DIR, else the user cache dir."""
    explicit = os.environ.get("ATTNCC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attncc"


def log_level() -> int | None:
    """$ATTNCC_LOG = debug | info | warning: attncc's logging level (None: leave logging alone)."""
    name = os.environ.get("ATTNCC_LOG", "").strip().upper()
    return getattr(logging, name, None) if name else None


def force_interpreter() -> bool:
    """$ATTNCC_INTERPRET=1 runs CUDA tensors through the Triton interpreter too (debugging)."""
    return os.environ.get("ATTNCC_INTERPRET", "") not in ("", "0")


def atomic_dq() -> bool:
    """$ATTNCC_BWD_DQ=atomic accumulates dQ with atomics in the dK/dV kernel instead of running
    the separate dQ kernel (the default, which is deterministic); kept to measure both."""
    return os.environ.get("ATTNCC_BWD_DQ", "kernel") == "atomic"


def tile_overrides() -> dict:
    """$ATTNCC_TILES='{"attn_fwd": [128, 64, 8, 3]}': (block_m, block_n, num_warps, num_stages)
    per kernel function, replacing attncc's choice (for tuning experiments)."""
    import json
    text = os.environ.get("ATTNCC_TILES", "")
    return {k: tuple(v) for k, v in json.loads(text).items()} if text else {}
