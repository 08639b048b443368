"""Which ptxas assembles a generated module's kernels.

Triton assembles its PTX with the ptxas it bundles (CUDA 12.8's in Triton 3.6) unless
TRITON_PTXAS_PATH names another. A newer CUDA's ptxas schedules the Gluon backward better (H200,
triton 3.6, CUDA 13.0's against 12.8's, each timed first and second in turn: full, causal, sliding
window and GQA at head dim 128 1.5-4 % faster, softcap and head dim 64 level; the forward level).
So a module that asks for it (``PTXAS = "newest"`` in the generated file; sm90/bwd_launch.py.jinja)
compiles with the newest CUDA toolkit's ptxas found in the usual places, where it is newer than
Triton's own and the driver runs what it makes.

``ATTNCC_PTXAS`` = ``auto`` (default: as above) | ``triton`` (Triton's ptxas for everything) |
a path to a ptxas. TRITON_PTXAS_PATH, when set, is the user's choice for every Triton kernel and
attncc leaves it alone. The newer ptxas's cubins go to a Triton cache folder of their own
(``<Triton's cache>/ptxas-<version>``): Triton's cache key names the first ptxas a process used,
not the one each kernel was built with. Where the newer ptxas fails on a kernel, Triton's takes
over for the rest of the process, with a warning. A module's ptxas options (``PTXAS_OPTIONS``, the
Gluon backward's ``--register-usage-level=0`` at head dim 64) go to whichever ptxas assembles it,
as Triton's ``ptx_options``; the ptxas of CUDA 12.8 (Triton 3.6's) and later take them.
"""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import threading
from typing import NamedTuple

from . import config
from .errors import AttnccError
from .log import logger

SEARCHED = ("$CUDA_HOME/bin", "$CUDA_PATH/bin", "/usr/local/cuda/bin", "/usr/local/cuda-*/bin")
_LOCK = threading.RLock()  # the environment is the process's: one module compiles under it at a time
_refused: set = set()  # ptxas paths that failed on a kernel: Triton's from then on


class Ptxas(NamedTuple):
    path: str
    version: tuple  # (major, minor)


def _knobs():
    """triton.knobs, triton imported as attncc imports it (the interpreter on a CPU-only machine)."""
    from . import runtime
    return runtime._triton(for_cpu=True).knobs


def _tool(path: str) -> Ptxas | None:
    """The ptxas at ``path`` with its version, or None where that does not run as one."""
    tool = _knobs().NvidiaTool.from_path(path) if os.path.isfile(path) else None
    if tool is None:
        return None
    return Ptxas(tool.path, tuple(int(x) for x in tool.version.split(".")))


def _candidates() -> list[str]:
    """The ptxas binaries of the CUDA toolkits installed in the usual places."""
    found = []
    for pattern in SEARCHED:
        folder = os.path.expandvars(pattern)
        if "$" not in folder:  # an unset variable stays unexpanded
            found += sorted(glob.glob(os.path.join(folder, "ptxas")))
    return list(dict.fromkeys(os.path.realpath(p) for p in found))


def _triton_own() -> Ptxas | None:
    """The ptxas Triton bundles (knobs.nvidia.ptxas reads as the one in use: its descriptor has the path)."""
    knobs = _knobs()
    return _tool(vars(type(knobs.nvidia))["ptxas"].default_path)


def driver_version() -> tuple | None:
    """The CUDA version the installed driver supports, (major, minor), or None without one."""
    import ctypes
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(value)) != 0:
        return None
    return value.value // 1000, value.value % 1000 // 10


@functools.lru_cache(maxsize=8)
def choose(setting: str, triton_path: str | None) -> Ptxas | None:
    """The ptxas for modules that ask for the newest, or None for Triton's. ``setting`` is
    ATTNCC_PTXAS, ``triton_path`` TRITON_PTXAS_PATH (set: the user's choice wins)."""
    if triton_path or setting == "triton":
        return None
    if setting != "auto":
        tool = _tool(os.path.expanduser(setting))
        if tool is None:
            raise AttnccError(f"ATTNCC_PTXAS={setting!r} is not a ptxas (running it with --version failed); "
                              "set it to a CUDA toolkit's bin/ptxas, or to auto (default) or triton")
        return tool
    driver = driver_version()
    own = _triton_own() if driver is not None else None
    if own is None:
        return None
    usable = [t for t in map(_tool, _candidates()) if t is not None and own.version < t.version <= driver]
    best = max(usable, key=lambda t: t.version, default=None)
    if best is not None:
        logger.info("attncc assembles the Gluon backward with CUDA %d.%d's ptxas (%s), newer than Triton's %d.%d "
                    "(ATTNCC_PTXAS=triton keeps Triton's)", *best.version, best.path, *own.version)
    return best


def _chosen() -> Ptxas | None:
    return choose(config.ptxas(), os.environ.get("TRITON_PTXAS_PATH"))


def describe() -> str:
    """Which ptxas the modules asking for the newest get here, in words."""
    try:
        tool = _chosen()
    except AttnccError as e:
        return str(e)
    if tool is None:
        return "Triton's (TRITON_PTXAS_PATH, else the one Triton bundles)"
    if tool.path in _refused:
        return "Triton's (CUDA %d.%d's, %s, failed on a kernel in this process)" % (*tool.version, tool.path)
    return "CUDA %d.%d's, %s" % (*tool.version, tool.path)


def for_module(module) -> Ptxas | None:
    """The ptxas ``module``'s kernels compile with, None for Triton's."""
    if getattr(module, "PTXAS", "triton") != "newest":
        return None
    tool = _chosen()
    return None if tool is None or tool.path in _refused else tool


def launch(module, run):
    """``run()``, a Triton launch of ``module``'s kernel that may compile it, under the ptxas the
    module asks for. Where that ptxas fails on the kernel, it is not used again in this process and
    the launch runs again under Triton's own, with a warning: a faster assembler is not worth a
    failed call."""
    tool = for_module(module)
    if tool is None:
        return run()
    try:
        with compiling(tool):
            return run()
    except Exception as e:
        if type(e).__name__ != "PTXASError":
            raise
        _refused.add(tool.path)
        logger.warning("attncc: CUDA %d.%d's ptxas (%s) failed on %s (%s); Triton's ptxas assembles attncc's kernels "
                       "from now on (ATTNCC_PTXAS=triton says so from the start)", *tool.version, tool.path,
                       getattr(module, "__file__", module), (str(e).strip().splitlines() or [""])[-1])
        return run()


@contextlib.contextmanager
def compiling(tool: Ptxas):
    """TRITON_PTXAS_PATH and TRITON_CACHE_DIR set for ``tool`` (its cubins in a cache folder of
    their own), restored after."""
    with _LOCK:
        keys = ("TRITON_PTXAS_PATH", "TRITON_CACHE_DIR")
        saved = {key: os.environ.get(key) for key in keys}
        cache = os.path.join(_knobs().cache.dir, "ptxas-%d.%d" % tool.version)
        os.environ.update(zip(keys, (tool.path, cache)))
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
