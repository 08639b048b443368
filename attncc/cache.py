"""Kernel source cache: on disk under config.cache_dir(), and in process.

The key hashes everything the generated source depends on: the variant's canonical analysis
key, the Spec, the kernel kind, and the bytes of attncc's own modules and templates (so a
changed printer or template never serves stale source), under a folder named by the attncc
and Triton versions. Files are written atomically (temp file + rename), so concurrent
processes may race to write but never read a torn file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from importlib.metadata import version

from . import __version__, config
from .codegen import template_dir
from .log import logger

# Counters for tests and logs: how often sources were generated vs found.
stats = {"codegen": 0, "disk_hits": 0}


@lru_cache(maxsize=1)
def _code_hash() -> str:
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    files = sorted(pkg.rglob("*.py")) + sorted(template_dir().glob("*.jinja"))
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def folder() -> Path:
    return config.cache_dir() / f"attncc-{__version__}-triton-{version('triton')}"


def key(kernel: str, variant_key: str, spec) -> str:
    text = "\n".join([kernel, variant_key, repr(spec), _code_hash(), repr(config.tile_overrides())])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def source_path(kernel: str, variant_key: str, spec) -> Path:
    """Named by content only: variants that differ just in name share one file."""
    return folder() / f"{kernel}_{key(kernel, variant_key, spec)}.py"


def _alias(kernel: str, ir_key: str, spec) -> Path:
    return folder() / "aliases" / f"{kernel}_{key(kernel, 'ir:' + ir_key, spec)}"


def lookup_alias(kernel: str, ir_key: str, spec) -> Path | None:
    """The source file generated earlier for this exact IR (before sympy canonicalisation), so a
    warm process finds its kernel without running the passes."""
    alias = _alias(kernel, ir_key, spec)
    if alias.is_file():
        target = folder() / alias.read_text().strip()
        if target.is_file():
            stats["disk_hits"] += 1
            logger.debug("kernel cache hit (by IR): %s", target)
            return target
    return None


def write_alias(kernel: str, ir_key: str, spec, path: Path) -> None:
    alias = _alias(kernel, ir_key, spec)
    _write(alias, path.name)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def get_or_create(path: Path, generate) -> Path:
    """Return ``path``, writing ``generate()`` there first if it does not exist yet."""
    if path.is_file():
        stats["disk_hits"] += 1
        logger.debug("kernel cache hit: %s", path)
        return path
    start = time.perf_counter()
    text = generate()
    stats["codegen"] += 1
    _write(path, text)
    logger.info("kernel cache miss: generated %s in %.0f ms", path, 1e3 * (time.perf_counter() - start))
    return path


def _version_folders() -> list[Path]:
    """attncc's folders in the cache dir, of this and of earlier attncc / Triton versions."""
    root = config.cache_dir()
    return sorted(p for p in root.glob("attncc-*-triton-*") if p.is_dir()) if root.is_dir() else []


def entries() -> list[tuple[Path, int]]:
    """(path, size in bytes) of every file in the kernel cache, all versions, sorted by path.
    Only attncc's own folders are looked at, so a shared ATTNCC_CACHE_DIR is safe."""
    return [(f, f.stat().st_size) for d in _version_folders() for f in sorted(d.rglob("*")) if f.is_file()]


def clear() -> tuple[int, int]:
    """Delete every file of the kernel cache (all versions); returns (files, bytes) removed.
    A running process keeps the kernels it has already loaded."""
    found = entries()
    for d in _version_folders():
        shutil.rmtree(d, ignore_errors=True)
    return len(found), sum(size for _, size in found)


def _triton_files_fingerprint(triton_dir: Path) -> str:
    """Path, size, mtime and inode of every file of the triton package: a superset of what
    Triton hashes into its key, read in milliseconds (nothing is opened)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(triton_dir):
        dirnames.sort()
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            h.update(f"{dirpath}/{name} {st.st_size} {st.st_mtime_ns} {st.st_ino}\n".encode())
    return h.hexdigest()[:32]


_triton_key_tried = False


def remember_triton_key(triton) -> None:
    """Triton keys its kernel cache by a hash of its own compiler, libtriton.so included
    (triton.runtime.cache.triton_key): once per process, before its first kernel launch, even
    when every kernel is found on disk; 0.27 s of a 0.45 s warm first call on an H200 host.
    attncc keeps that hash in its cache folder under a fingerprint of Triton's files (path,
    size, mtime, inode) and gives it back to Triton while the fingerprint is unchanged: the key
    is the one Triton computed, so Triton finds the same kernels. Off with ATTNCC_TRITON_KEY=0;
    skipped where Triton's cache module differs from the one this was written for."""
    global _triton_key_tried
    if _triton_key_tried or not config.remember_triton_key():
        return
    _triton_key_tried = True
    module = getattr(getattr(triton, "runtime", None), "cache", None)
    compute = getattr(module, "triton_key", None)
    if not callable(getattr(compute, "cache_info", None)) or compute.cache_info().currsize:
        return  # not the lru_cache'd function this expects, or already computed in this process
    try:
        path = folder() / "triton_key" / _triton_files_fingerprint(Path(triton.__file__).resolve().parent)
        if path.is_file():
            value = path.read_text()
        else:
            value = compute()
            _write(path, value)
    except OSError as e:  # a read-only or full cache folder: Triton computes its key as before
        logger.debug("Triton key not kept: %s", e)
        return

    def memo():
        return value
    module.triton_key = memo
