"""Calls from several threads give each thread its own right answer.

Triton's interpreter keeps a launch's grid in process-wide state, so interpreted launches take
turns (attncc.launcher.INTERPRETER_LOCK); tracing keeps its state per thread; the caches that
threads share (loaded modules, tile lists, launcher keys) stay consistent under concurrent use.
"""
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import attncc
from conftest import assert_close_to_reference, randn_qkv, reference

SHAPES = [(1, 2, 2, 17, 33), (2, 4, 2, 40, 40), (1, 2, 1, 1, 64), (1, 4, 4, 33, 17)]  # B, Hq, Hkv, Lq, Lkv


def _cases(device, dtype=torch.float32, rounds=2):
    torch.manual_seed(0)
    docs = torch.arange(64, device=device) // 24  # a data-dependent mask: tile lists per call
    bias = torch.randn(4, 64, device=device)
    score_mod = lambda s, b, h, qi, ki: s + bias[h, ki] * 0.5
    mask_mod = lambda b, h, qi, ki: (docs[qi] == docs[ki]) | (ki == 0)
    inputs = [randn_qkv(*shape, 16, dtype=dtype, device=device) for shape in SHAPES for _ in range(rounds)]
    return score_mod, mask_mod, inputs


def _check_all(results, inputs, score_mod, mask_mod, dtype, rel_tol=None):
    for (out, lse), (q, k, v) in zip(results, inputs):
        gqa = q.shape[1] != k.shape[1]
        ref, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), _on_cpu(score_mod), _on_cpu(mask_mod), enable_gqa=gqa)
        assert_close_to_reference(out.cpu(), lse.cpu(), ref, ref_lse, dtype, rel_tol=rel_tol)


def _on_cpu(mod):
    """The same mod reading CPU copies of its captured tensors (for the reference)."""
    cells = tuple(types.CellType(c.cell_contents.cpu() if isinstance(c.cell_contents, torch.Tensor)
                                 else c.cell_contents) for c in mod.__closure__ or ())
    return types.FunctionType(mod.__code__, mod.__globals__, mod.__name__, mod.__defaults__, cells)


def _run_threads(fn, inputs, threads=8):
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(fn, inputs))


def test_one_kernel_from_eight_threads():
    score_mod, mask_mod, inputs = _cases("cpu")
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))
    call = lambda qkv: kernel(*qkv, enable_gqa=qkv[0].shape[1] != qkv[1].shape[1], return_lse=True)
    _check_all(_run_threads(call, inputs * 2), inputs * 2, score_mod, mask_mod, torch.float32)


def test_tracing_from_eight_threads():
    """attncc.attention traces its mods on every call: each thread's trace sees its own mods and
    the tensors they capture."""
    torch.manual_seed(1)
    tables = [torch.randn(4, 64) for _ in range(4)]
    mods = []
    for i, table in enumerate(tables):
        mods.append((lambda t: lambda s, b, h, qi, ki: s + t[h, ki] * 0.5)(table))
    inputs = [randn_qkv(*SHAPES[i % 4][:3], 17, 33, 16) for i in range(16)]

    def call(i):
        q, k, v = inputs[i]
        return attncc.attention(q, k, v, mods[i % 4], enable_gqa=q.shape[1] != k.shape[1], return_lse=True)

    results = _run_threads(call, range(16))
    for i, (out, lse) in enumerate(results):
        q, k, v = inputs[i]
        ref, ref_lse = reference(q, k, v, mods[i % 4], enable_gqa=q.shape[1] != k.shape[1])
        assert_close_to_reference(out, lse, ref, ref_lse, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_kernel_from_eight_threads_on_the_gpu(dtype):
    score_mod, mask_mod, inputs = _cases("cuda", dtype, rounds=4)
    kernel = attncc.compile(attncc.Variant(score_mod, mask_mod))

    def call(qkv):
        out, lse = kernel(*qkv, enable_gqa=qkv[0].shape[1] != qkv[1].shape[1], return_lse=True)
        torch.cuda.current_stream().synchronize()
        return out, lse

    _check_all(_run_threads(call, inputs * 2), inputs * 2, score_mod, mask_mod, dtype)
