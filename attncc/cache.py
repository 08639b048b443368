"""Kernel source cache: on disk under config.cache_dir(), and in process.

The key hashes everything the generated source depends on: the variant's canonical analysis
key, the Spec, the kernel kind, and the bytes of attncc's own modules and templates (so a
changed printer or template never serves stale source), under a folder named by the attncc and
Triton versions. Files are written atomically (temp file + rename), so concurrent processes may
race to write but never read a torn file; a folder removed meanwhile (``attncc cache clear``)
is made again.

The cache is code: attncc runs the files it finds there. So its folders are made 0700 and used
only while they belong to this user and group and others cannot write them (as ssh and git
check theirs), and a kernel file runs only when its bytes match the digest attncc wrote beside
it (``fwd_<key>.sha256``); anything else is logged and generated again. Edited kernels run from
ATTNCC_OVERRIDE_DIR, never from the cache.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import tempfile
import time
from functools import lru_cache
from pathlib import Path

from importlib.metadata import version

from . import __version__, config
from .codegen import template_dir
from .errors import AttnccError
from .log import logger

# Counters for tests and logs: how often sources were generated vs found.
stats = {"codegen": 0, "disk_hits": 0}

MAX_FILE_BYTES = 64 << 20  # a cache file larger than this is not one attncc wrote
WRITE_ATTEMPTS = 10  # writes retried after a concurrent clear removed the folder


@lru_cache(maxsize=1)
def _code_hash() -> str:
    h = hashlib.sha256()
    pkg = Path(__file__).resolve().parent
    files = sorted(pkg.rglob("*.py")) + sorted(template_dir().rglob("*.jinja"))
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


# ---------------------------------------------------------------- folders and files of this user

def _check_dir(path: Path, knob: str) -> None:
    """Raise AttnccError unless ``path`` is a folder of this user that group and others cannot
    write, or a symlink (of this user or root) to one; FileNotFoundError when it is missing."""
    def refuse(problem: str, fix: str = "Remove it"):
        return AttnccError(f"refusing the folder {path} ({knob}): it {problem}. attncc runs the Python files it "
                           "keeps there, so it uses only folders that you own and that group and others cannot "
                           f"write. {fix}, or point {knob} at a folder of your own.")
    uid = os.getuid()
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as e:
        raise refuse(f"cannot be looked at ({e.strerror})", "Fix its permissions") from None
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid not in (uid, 0):
            raise refuse(f"is a symbolic link owned by uid {st.st_uid}")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise refuse(f"is a symbolic link to {os.readlink(path)}, which does not exist",
                         "Create that folder (mkdir -m 700)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise refuse("is not a folder")
    if st.st_uid != uid:
        raise refuse(f"is owned by uid {st.st_uid}, not by you (uid {uid})", "Use another folder: remove it")
    if st.st_mode & 0o022:
        raise refuse(f"is writable by group or others (mode {stat.filemode(st.st_mode)})", f"Run chmod go-w {path}")


def _safe_dir(path: Path, create: bool, knob: str = "ATTNCC_CACHE_DIR") -> bool:
    """Whether ``path`` exists as a safe folder (_check_dir): it and every folder between it and
    the cache dir, the cache dir included. ``create`` makes missing folders first, mode 0700;
    else a missing folder returns False. Unsafe folders raise AttnccError. A few lstat calls,
    made when a file is read or written, never on a call whose kernel is loaded already."""
    root = config.cache_dir()
    chain = [path]
    if path.is_relative_to(root):
        parts = path.relative_to(root).parts
        chain = [root] + [root.joinpath(*parts[:i + 1]) for i in range(len(parts))]
    if create:
        missing, made = [], []
        d = path
        while not os.path.lexists(d) and d != d.parent:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:  # another process made it: checked below when it is ours to check
                continue
            if d not in chain:
                made.append(d)  # above the cache dir: attncc made it, so it is checked too
        chain = made + chain
    try:
        for d in chain:
            _check_dir(d, knob)
    except FileNotFoundError:
        if create:
            raise  # removed again meanwhile: _write tries again
        return False
    return True


class _NotOurs(Exception):
    """A cache file that is not what attncc wrote there (the message says why)."""


def _read_ours(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of this user that group and others cannot
    write (not a symlink, not huge); None when it does not exist; else _NotOurs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        raise _NotOurs(f"cannot be opened as a plain file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _NotOurs("is not a regular file")
        if st.st_uid != os.getuid():
            raise _NotOurs(f"is owned by uid {st.st_uid}")
        if st.st_mode & 0o022:
            raise _NotOurs(f"is writable by group or others (mode {stat.filemode(st.st_mode)})")
        if st.st_size > MAX_FILE_BYTES:
            raise _NotOurs(f"has {st.st_size} bytes")
        return f.read(MAX_FILE_BYTES + 1)


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (0600), making its folders (0700) when missing, or
    again when a concurrent clear removed them. Other OSErrors pass through."""
    data = text.encode()
    for attempt in range(WRITE_ATTEMPTS):
        try:
            _safe_dir(path.parent, create=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            return
        except FileNotFoundError:
            if attempt == WRITE_ATTEMPTS - 1:
                raise
            logger.debug("cache folder of %s removed while writing; making it again", path)


# ---------------------------------------------------------------- kernel sources

def _digest_path(path: Path) -> Path:
    return path.with_suffix(".sha256")


def _digest(name: str, data: bytes) -> str:
    """What the .sha256 file beside a kernel file holds: its name and bytes, hashed."""
    return hashlib.sha256(name.encode() + b"\0" + data).hexdigest()


def _verified(path: Path, quiet: bool = False) -> str | None:
    """The text of a kernel file if it is the one attncc wrote (owner, mode, digest); None when it
    is missing, or (logged at WARNING unless ``quiet``) when it is not."""
    try:
        data = _read_ours(path)
        if data is None:
            return None
        digest = _read_ours(_digest_path(path))
        if digest is None:
            raise _NotOurs(f"has no digest file {_digest_path(path).name} beside it")
        if not data:
            raise _NotOurs("is empty")
        if digest.strip() != _digest(path.name, data).encode():
            raise _NotOurs(f"does not match its digest {_digest_path(path).name} (truncated, damaged or edited; "
                           "to run an edited kernel, put it in ATTNCC_OVERRIDE_DIR)")
        return data.decode()
    except _NotOurs as e:
        if not quiet:
            logger.warning("kernel cache file %s %s: generating it again", path, e)
        return None


def _write_source(path: Path, text: str) -> None:
    """The digest first: a reader sees either no kernel file or one whose digest is in place
    (written again if a concurrent clear removed it in between)."""
    digest = _digest_path(path)
    for _ in range(WRITE_ATTEMPTS):
        _write(digest, _digest(path.name, text.encode()) + "\n")
        _write(path, text)
        if os.path.exists(digest):
            return


def _override(path: Path) -> tuple[Path, str] | None:
    """(file, text) of the user's edited copy of a kernel file in ATTNCC_OVERRIDE_DIR, if any."""
    where = config.override_dir()
    if where is None:
        return None
    knob = "ATTNCC_OVERRIDE_DIR"
    if not _safe_dir(where, create=False, knob=knob):
        raise AttnccError(f"{knob}={where} does not exist: create it (mkdir -m 700) and copy the kernel files to "
                          "edit there from `attncc cache list`, or unset it")
    mine = where / path.name
    try:
        data = _read_ours(mine)
        text = None if data is None else data.decode()
    except (_NotOurs, UnicodeDecodeError) as e:
        raise AttnccError(f"refusing the edited kernel {mine} ({knob}): it {e}; make it a UTF-8 text file of "
                          "yours that group and others cannot write (chmod go-w), or remove it") from None
    if text is None:
        return None
    logger.warning("running %s in place of the generated %s (%s)", mine, path.name, knob)
    return mine, text


def kernel_source(path: Path, generate) -> tuple[Path, str]:
    """(file, text) of the kernel file ``path``: its edited copy in ATTNCC_OVERRIDE_DIR, else
    its verified text, else ``generate()``, written there first (also over a file that is not
    what attncc wrote, which is logged)."""
    found = _override(path)
    if found:
        return found
    text = _verified(path) if _safe_dir(path.parent, create=False) else None
    if text is not None:
        stats["disk_hits"] += 1
        logger.debug("kernel cache hit: %s", path)
        return path, text
    start = time.perf_counter()
    text = generate()
    stats["codegen"] += 1
    try:
        _write_source(path, text)
    except OSError as e:
        raise AttnccError(f"cannot write the generated kernel file {path} ({e.strerror or e}): make "
                          f"{path.parent} writable or point ATTNCC_CACHE_DIR at a folder of yours") from e
    logger.info("kernel cache miss: generated %s in %.0f ms", path, 1e3 * (time.perf_counter() - start))
    return path, text


def get_or_create(path: Path, generate) -> Path:
    """The file that kernel_source(path, generate) found or wrote."""
    return kernel_source(path, generate)[0]


def _small_file(path: Path, what: str) -> str | None:
    """The text of a small file attncc keeps beside its kernels (an alias, the Triton key): None
    when it or its folder is missing, or (logged at WARNING) when it is not this user's file."""
    if not _safe_dir(path.parent, create=False):
        return None
    try:
        data = _read_ours(path)
    except _NotOurs as e:
        logger.warning("ignoring the %s %s: it %s", what, path, e)
        return None
    return None if data is None else data.decode(errors="replace")


def _alias(kernel: str, ir_key: str, spec) -> Path:
    return folder() / "aliases" / f"{kernel}_{key(kernel, 'ir:' + ir_key, spec)}"


def lookup_alias(kernel: str, ir_key: str, spec) -> tuple[Path, str] | None:
    """(file, text) of the kernel generated earlier for this exact IR (before sympy
    canonicalisation), so a warm process finds its kernel without running the passes. The alias
    must name a ``<kernel>_<key>.py`` file of its own folder, and that file must verify."""
    alias = _alias(kernel, ir_key, spec)
    text = _small_file(alias, "kernel cache alias")
    if text is None:
        return None
    name = text.strip()
    if not re.fullmatch(rf"{re.escape(kernel)}_[0-9a-f]{{24}}\.py", name):
        logger.warning("kernel cache alias %s names %r, not a %s_<key>.py file of its folder: ignoring it",
                       alias, name[:100], kernel)
        return None
    path = alias.parent.parent / name
    found = _override(path)
    if found is None:
        text = _verified(path, quiet=True)  # a bad file is reported once, when it is generated again
        found = None if text is None else (path, text)
    if found:
        stats["disk_hits"] += 1
        logger.debug("kernel cache hit (by IR): %s", found[0])
    return found


def write_alias(kernel: str, ir_key: str, spec, path: Path) -> None:
    try:
        _write(_alias(kernel, ir_key, spec), path.name + "\n")
    except OSError as e:  # only a shortcut: the next process runs the passes again
        logger.warning("cannot write a kernel cache alias for %s (%s)", path, e)


# ---------------------------------------------------------------- listing and clearing

def _version_folders() -> list[Path]:
    """attncc's folders in the cache dir, of this and of earlier attncc / Triton versions (the
    cache dir must be safe, as for kernels: else AttnccError)."""
    root = config.cache_dir()
    if not _safe_dir(root, create=False):
        return []
    try:
        with os.scandir(root) as it:
            return sorted(Path(e.path) for e in it
                          if re.fullmatch(r"attncc-.+-triton-.+", e.name) and e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def entries() -> list[tuple[Path, int]]:
    """(path, size in bytes) of every file in the kernel cache, all versions, sorted by path.
    Only attncc's own folders are looked at, so a shared ATTNCC_CACHE_DIR is safe; files that
    vanish meanwhile (another process's temporary files, a concurrent clear) are left out."""
    found = []
    for d in _version_folders():
        for dirpath, _, filenames in os.walk(d):
            for name in filenames:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((Path(dirpath, name), st.st_size))
    return sorted(found)


def clear() -> tuple[int, int]:
    """Delete every file of the kernel cache (all versions); returns (files, bytes) removed.
    A running process keeps the kernels it has already loaded, and one generating kernels
    meanwhile makes its folder again."""
    found = entries()
    for d in _version_folders():
        shutil.rmtree(d, ignore_errors=True)
    return len(found), sum(size for _, size in found)


# ---------------------------------------------------------------- Triton's key

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


def _is_triton_key(value: str, triton_version: str) -> bool:
    """The form of triton.runtime.cache.triton_key(): the version, then sha256 hex digests
    joined by '-'."""
    rest = value[len(triton_version):] if value.startswith(triton_version) else ""
    return re.fullmatch(r"[0-9a-f]{64}(-[0-9a-f]{64})*", rest) is not None


def _kept_triton_key(path: Path, triton_version: str) -> str | None:
    """The key kept at ``path`` if the file is this user's and has the form of a Triton key."""
    value = _small_file(path, "kept Triton key")
    if value is not None and not _is_triton_key(value, triton_version):
        logger.warning("ignoring the kept Triton key %s: not a Triton %s key (%r...)", path, triton_version,
                       value[:40])
        return None
    return value


_triton_key_tried = False


def remember_triton_key(triton) -> None:
    """Triton keys its kernel cache by a hash of its own compiler, libtriton.so included
    (triton.runtime.cache.triton_key): once per process, before its first kernel launch, even
    when every kernel is found on disk; 0.27 s of a 0.45 s warm first call on an H200 host.
    attncc keeps that hash in its cache folder under a fingerprint of Triton's files (path,
    size, mtime, inode) and of this user, and gives it back to Triton while the fingerprint is
    unchanged and the file is this user's and has the form of a Triton key: the key is the one
    Triton computed, so Triton finds the same kernels. Off with ATTNCC_TRITON_KEY=0; skipped
    where Triton's cache module differs from the one this was written for."""
    global _triton_key_tried
    if _triton_key_tried or not config.remember_triton_key():
        return
    _triton_key_tried = True
    module = getattr(getattr(triton, "runtime", None), "cache", None)
    compute = getattr(module, "triton_key", None)
    triton_version = getattr(triton, "__version__", None)
    if not callable(getattr(compute, "cache_info", None)) or compute.cache_info().currsize or not triton_version:
        return  # not the lru_cache'd function this expects, or already computed in this process
    try:
        fingerprint = _triton_files_fingerprint(Path(triton.__file__).resolve().parent)
        name = hashlib.sha256(f"{os.getuid()} {fingerprint}".encode()).hexdigest()[:32]
        path = folder() / "triton_key" / name
        value = _kept_triton_key(path, triton_version)
        if value is None:
            value = compute()
            if not _is_triton_key(value, triton_version):
                return  # another Triton's form: not kept
            _write(path, value)
    except (OSError, AttnccError) as e:  # a read-only, full or refused cache folder: Triton computes its key
        logger.debug("Triton key not kept: %s", e)
        return

    def memo():
        return value
    module.triton_key = memo
