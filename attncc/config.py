"""Every ATTNCC_* environment knob, read in one place."""
from __future__ import annotations

import logging
import os
from pathlib import Path

# os.environ.get encodes the name and raises and catches a KeyError for an unset variable: ~2 us,
# and the forward reads four knobs per call. On POSIX os.environ keeps its bytes mapping current
# (its __setitem__ and pop write both it and the process environment), so reading that mapping
# gives the same answer in ~0.1 us.
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None


def _env(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default), fast: the knobs are read on every call (host time)."""
    if _ENVIRON_BYTES is None:
        return os.environ.get(name, default)
    raw = _ENVIRON_BYTES.get(name.encode())
    return default if raw is None else os.fsdecode(raw)


def cache_dir() -> Path:
    """Where generated kernel sources live: $ATTNCC_CACHE_DIR, else the user cache dir."""
    explicit = _env("ATTNCC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = _env("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attncc"


def override_dir() -> Path | None:
    """$ATTNCC_OVERRIDE_DIR: a folder of edited kernel files. A file there named like a generated
    one (``fwd_<key>.py``, listed by ``attncc cache list``) runs in its place, unverified; the
    folder and the file must be yours and not writable by group or others. Read when a kernel
    file is loaded (attncc.cache.kernel_source)."""
    where = _env("ATTNCC_OVERRIDE_DIR")
    return Path(where).expanduser() if where else None


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def log_level() -> int | None:
    """$ATTNCC_LOG = debug | info | warning | error: the level of the ``attncc`` logger, which
    then prints to stderr (None, the default: leave logging to the application). INFO shows
    kernel generation and compile times, DEBUG also cache hits and tile choices."""
    name = _env("ATTNCC_LOG", "").strip().lower()
    if not name:
        return None
    if name not in LOG_LEVELS:
        import warnings
        warnings.warn(f"ATTNCC_LOG={name!r} is not a log level; use one of {', '.join(LOG_LEVELS)}", stacklevel=2)
        return None
    return LOG_LEVELS[name]


INDEX_CHECKS = ("plain", "all", "off")


def index_check() -> str:
    """$ATTNCC_INDEX_CHECK = plain | all | off: which captured-tensor indices each call checks
    against the tensors' shapes (attncc.checks.check_capture_indices). ``plain`` (default):
    bare b/h/q_idx/kv_idx indices and indices the mod bounds itself (clamp, %); ``all`` also
    the upper end of shifted indices such as ``kv_idx - 5``, which otherwise read 0 past the end."""
    mode = _env("ATTNCC_INDEX_CHECK")
    if mode is None:  # the common case, read on every call: keep it cheap
        return "plain"
    mode = mode.strip().lower() or "plain"
    if mode not in INDEX_CHECKS:
        from .errors import AttnccError
        raise AttnccError(f"ATTNCC_INDEX_CHECK={mode!r} is not one of {', '.join(INDEX_CHECKS)}")
    return mode


def force_interpreter() -> bool:
    """$ATTNCC_INTERPRET=1 runs CUDA tensors through the Triton interpreter too (debugging)."""
    return _env("ATTNCC_INTERPRET", "") not in ("", "0")


def direct_launch() -> bool:
    """$ATTNCC_DIRECT_LAUNCH=0 launches every kernel through Triton's own launch path instead of
    attncc.launcher's direct relaunch of an already compiled specialisation (read when a
    generated module is loaded)."""
    return _env("ATTNCC_DIRECT_LAUNCH", "1") != "0"


def atomic_dq() -> bool:
    """$ATTNCC_BWD_DQ=atomic accumulates dQ with atomics in the dK/dV kernel instead of running
    the separate dQ kernel (the default, which is deterministic); kept to measure both."""
    return _env("ATTNCC_BWD_DQ", "kernel") == "atomic"


DESCRIPTOR_MODES = ("auto", "on", "off")


def tma() -> str:
    """$ATTNCC_TMA = auto | on | off: how the forward kernel reads K and V tiles. ``auto``
    (default): tensor descriptors (TMA) on GPUs that have them (compute capability 9.0+) when the
    tensors' layout allows, pointers otherwise; ``on`` also in the Triton interpreter (tests);
    ``off``: always pointers."""
    return _descriptor_mode("ATTNCC_TMA")


def ws() -> str:
    """$ATTNCC_WS = auto | on | off: whether the forward runs the persistent kernel whose key
    loop is warp-specialised (Hopper: a producer warp streams K/V tiles through tensor
    descriptors while two consumer warp groups compute). ``auto`` (default): on sm90 GPUs where
    it measured faster (tiles.ws_pays, tiles.ws_kv); ``on`` wherever the variant allows it (no
    dropout, no data-dependent mask), at any length, also in the Triton interpreter (tests);
    ``off``: never."""
    return _descriptor_mode("ATTNCC_WS")


TIERS = ("auto", "triton", "gluon")


def tier() -> str:
    """$ATTNCC_TIER = auto | triton | gluon: which template set the forward kernel comes from.
    ``triton`` (the portable tier, every GPU and the interpreter); ``gluon`` (the Hopper tier,
    templates/sm90: warp-specialised, TMA and asynchronous wgmma) wherever the variant and the
    call fit it (attncc.tiers.choose says why not otherwise); ``auto`` (default): the Gluon tier
    where it measured faster."""
    return _descriptor_mode("ATTNCC_TIER", TIERS)


def ptxas() -> str:
    """$ATTNCC_PTXAS = auto | triton | PATH: which ptxas assembles the modules that ask for the newest
    (the Gluon backward): ``auto`` (default) the newest CUDA toolkit's found where it is newer than
    Triton's and the driver runs its code, ``triton`` Triton's own, or the ptxas at PATH
    (attncc.toolchain). Read when such a module's kernel compiles."""
    raw = _env("ATTNCC_PTXAS", "").strip()
    return raw if raw and raw.lower() not in ("auto", "triton") else (raw.lower() or "auto")


def _descriptor_mode(var: str, modes=DESCRIPTOR_MODES) -> str:
    """A knob taking one of ``modes`` (default auto); AttnccError naming it otherwise."""
    raw = _env(var)
    if raw is None:  # every call reads it (host time): the unset case returns at once
        return "auto"
    mode = raw.strip().lower() or "auto"
    if mode not in modes:
        from .errors import AttnccError
        raise AttnccError(f"{var}={mode!r} is not one of {', '.join(modes)}")
    return mode


TILED_FUNCTIONS = ("attn_fwd", "attn_fwd_short", "attn_fwd_ws", "attn_bwd_dkdv", "attn_bwd_dq",
                   "attn_bwd_preprocess", "attn_kv", "attn_kv_decode")
_tile_overrides: dict = {}  # ATTNCC_TILES text -> its parsed value (every call reads the knob)


def tile_overrides() -> dict:
    """$ATTNCC_TILES='{"attn_fwd": [128, 64, 8, 3]}': (block_m, block_n, num_warps, num_stages)
    per kernel function, replacing attncc's choice (for tuning experiments). The backward is one
    launch: it takes num_warps and num_stages from attn_bwd_dkdv, and only block_m / block_n
    from attn_bwd_dq. A JSON object naming kernel functions (TILED_FUNCTIONS); block_m and
    block_n powers of two from 16, num_warps a power of two up to 32, num_stages from 1.
    Anything else raises AttnccError, as the other knobs' bad values do."""
    text = _env("ATTNCC_TILES", "")
    if not text:
        return {}
    parsed = _tile_overrides.get(text)
    if parsed is None:
        parsed = _parse_tiles(text)
        if len(_tile_overrides) >= 64:
            _tile_overrides.clear()
        _tile_overrides[text] = parsed
    return parsed


def _parse_tiles(text: str) -> dict:
    import json

    from .errors import AttnccError
    form = ("use a JSON object of kernel function -> [block_m, block_n, num_warps, num_stages], e.g. "
            "ATTNCC_TILES='{\"attn_fwd\": [128, 64, 8, 3]}', or unset it for attncc's table")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise AttnccError(f"ATTNCC_TILES={text!r} is not valid JSON ({e}); {form}") from None
    if not isinstance(data, dict):
        raise AttnccError(f"ATTNCC_TILES={text!r} is not a JSON object; {form}")
    out = {}
    for fn, tiles in data.items():
        if fn not in TILED_FUNCTIONS:
            raise AttnccError(f"ATTNCC_TILES={text!r} names {fn!r}, which is not a kernel function; "
                              f"use {', '.join(TILED_FUNCTIONS)}")
        ok = (isinstance(tiles, list) and len(tiles) == 4 and all(type(x) is int and x > 0 for x in tiles)
              and all(x >= 16 and x & (x - 1) == 0 for x in tiles[:2])
              and tiles[2] <= 32 and tiles[2] & (tiles[2] - 1) == 0)
        if not ok:
            raise AttnccError(f"ATTNCC_TILES={text!r}: {fn} has {json.dumps(tiles)}; give [block_m, block_n, "
                              "num_warps, num_stages] with block_m and block_n powers of two from 16, num_warps "
                              "a power of two up to 32 and num_stages from 1, e.g. [128, 64, 8, 3]")
        out[fn] = tuple(tiles)
    return out


def autotune() -> bool:
    """$ATTNCC_AUTOTUNE=1: the first call of a kernel under a new (variant, Spec, size class)
    times candidate tiles, TMA and warp-specialisation choices on the call's inputs and keeps the
    fastest in a JSON file per GPU in the cache folder, which later calls and processes read
    (attncc.tune). Unset or 0 (default): attncc's measured table, nothing timed or read."""
    raw = _env("ATTNCC_AUTOTUNE")
    if raw is None:  # every call reads it (host time): the unset case returns at once
        return False
    mode = raw.strip().lower()
    if mode in ("", "0", "off", "false"):
        return False
    if mode in ("1", "on", "true"):
        return True
    from .errors import AttnccError
    raise AttnccError(f"ATTNCC_AUTOTUNE={raw!r}: use 1 to tune kernels on first use, 0 (default) for attncc's table")


def remember_triton_key() -> bool:
    """$ATTNCC_TRITON_KEY=0 stops attncc from keeping Triton's compiler hash in its cache folder
    (attncc.cache.remember_triton_key); a warm process then hashes Triton's files again."""
    return _env("ATTNCC_TRITON_KEY", "1") != "0"
