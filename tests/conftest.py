"""Shared test setup: a private kernel cache, the float64 oracle comparison, the gpu marker.

``check(q, k, v, score_mod, mask_mod, **kw)`` runs attncc and ``attncc.reference.attention``
on float64 copies of the same inputs and asserts, per input dtype:

    out   ||out - ref|| / ||ref|| below REL_TOL (0 when the reference is all zeros)
    lse   max |lse - ref| below LSE_TOL where the reference is finite, and the same -inf pattern
    rows  out exactly 0 on rows that are fully masked (lse = -inf)
    NaN   none, anywhere

Test modules import the helpers directly (``from conftest import check``): pytest puts this
folder on sys.path because tests/ is not a package.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LSE_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-3}

_OWNER = "_ATTNCC_TEST_CACHE_OWNER"


def pytest_addoption(parser):
    parser.addoption("--update-snapshots", action="store_true",
                     help="rewrite tests/snapshots/ from the templates (then read the diff before committing)")


def pytest_configure(config):
    """Point ATTNCC_CACHE_DIR at a fresh folder before attncc generates anything.

    The pytest-xdist controller makes the folder; its workers inherit the variable (they are
    started after this hook runs) and keep it, so all processes of one run share one cache."""
    if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get(_OWNER):
        return
    folder = tempfile.mkdtemp(prefix="attncc-test-cache-")
    config._attncc_cache_dir = folder
    os.environ["ATTNCC_CACHE_DIR"] = folder
    os.environ[_OWNER] = str(os.getpid())


def pytest_unconfigure(config):
    folder = getattr(config, "_attncc_cache_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _interpreter_forced() -> bool:
    return any(os.environ.get(v, "") not in ("", "0") for v in ("TRITON_INTERPRET", "ATTNCC_INTERPRET"))


def pytest_collection_modifyitems(config, items):
    """gpu tests need CUDA; the other tests run CPU tensors through the Triton interpreter, which
    attncc switches on by itself only on machines without CUDA. On a GPU machine run the two sets
    separately: ``pytest -m gpu`` and ``ATTNCC_INTERPRET=1 pytest -m "not gpu"``."""
    if not torch.cuda.is_available():
        skip_gpu, skip_cpu = "needs a CUDA GPU", None
    elif _interpreter_forced():
        skip_gpu, skip_cpu = "the Triton interpreter is forced on (TRITON_INTERPRET/ATTNCC_INTERPRET)", None
    else:
        skip_gpu, skip_cpu = None, ("CUDA machine without the interpreter: run the CPU tests with "
                                    "ATTNCC_INTERPRET=1 pytest -m 'not gpu'")
    for item in items:
        reason = skip_gpu if "gpu" in item.keywords else skip_cpu
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def attncc_cache_dir():
    """The kernel cache folder of this test run (set in pytest_configure)."""
    folder = os.environ.get("ATTNCC_CACHE_DIR")
    assert folder and os.path.isdir(folder), "conftest.pytest_configure did not set ATTNCC_CACHE_DIR"
    return folder


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (||out|| when ref is all zeros); fails on NaN/inf."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(out).all(), f"non-finite values in output: {(~torch.isfinite(out)).sum().item()}"
    assert torch.isfinite(ref).all(), "non-finite values in the reference"
    den = ref.norm()
    num = (out - ref).norm()
    return (num / den).item() if den > 0 else num.item()


def assert_close_to_reference(out, lse, ref, ref_lse, dtype, rel_tol=None, lse_tol=None):
    """The comparison ``check`` makes, for results computed some other way."""
    rel_tol = REL_TOL[dtype] if rel_tol is None else rel_tol
    lse_tol = LSE_TOL[dtype] if lse_tol is None else lse_tol
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected the input dtype {dtype}"
    err = rel_err(out, ref)
    assert err < rel_tol, f"relative error {err:.3g} >= {rel_tol:g} ({dtype})"

    lse, ref_lse = lse.detach().cpu(), ref_lse.detach().cpu()
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}, expected float32"
    assert lse.shape == out.shape[:3], f"lse shape {tuple(lse.shape)} != {tuple(out.shape[:3])}"
    assert not torch.isnan(lse).any(), "NaN in lse"
    assert not torch.isnan(ref_lse).any(), "NaN in the reference lse"
    assert not (lse == float("inf")).any(), "+inf in lse"
    ref_masked = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), ref_masked), (
        f"-inf pattern of lse differs: {torch.isneginf(lse).sum().item()} rows vs "
        f"{ref_masked.sum().item()} fully masked rows in the reference")
    finite = ~ref_masked
    if finite.any():
        lse_err = (lse.double()[finite] - ref_lse.double()[finite]).abs().max().item()
        assert lse_err < lse_tol, f"lse max abs error {lse_err:.3g} >= {lse_tol:g} ({dtype})"
    if ref_masked.any():
        masked_out = out.detach().cpu()[ref_masked]
        assert (masked_out == 0).all(), "output is not exactly 0 on fully masked rows"
    return err


def reference(q, k, v, score_mod=None, mask_mod=None, **kw):
    """The float64 golden result (out, lse) of attncc.reference on float64 copies."""
    import attncc
    return attncc.reference.attention(q.double(), k.double(), v.double(), score_mod, mask_mod,
                                      return_lse=True, **kw)


def check(q, k, v, score_mod=None, mask_mod=None, *, kernel=None, rel_tol=None, lse_tol=None, **kw):
    """Run attncc (``attncc.attention``, or ``kernel`` when given) and the float64 reference on
    the same inputs, assert they agree (see the module docstring); return (out, lse, rel_err).

    ``kw`` (scale, enable_gqa) goes to both; with ``kernel`` the mods and scale are the
    kernel's own and are only passed to the reference."""
    import attncc
    enable_gqa = kw.get("enable_gqa", False)
    if kernel is None:
        out, lse = attncc.attention(q, k, v, score_mod, mask_mod, return_lse=True, **kw)
    else:
        out, lse = kernel(q, k, v, enable_gqa=enable_gqa, return_lse=True)
    ref, ref_lse = reference(q, k, v, score_mod, mask_mod, **kw)
    err = assert_close_to_reference(out, lse, ref, ref_lse, q.dtype, rel_tol, lse_tol)
    return out, lse, err


def randn_qkv(B, Hq, Hkv, Lq, Lkv, D, Dv=None, dtype=torch.float32, device="cpu"):
    """Fresh random q (B, Hq, Lq, D), k (B, Hkv, Lkv, D), v (B, Hkv, Lkv, Dv)."""
    Dv = D if Dv is None else Dv
    q = torch.randn(B, Hq, Lq, D, device=device).to(dtype)
    k = torch.randn(B, Hkv, Lkv, D, device=device).to(dtype)
    v = torch.randn(B, Hkv, Lkv, Dv, device=device).to(dtype)
    return q, k, v
