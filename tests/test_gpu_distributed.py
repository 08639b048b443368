"""Context parallelism's kernels on one GPU: the ranks of a group run one after another in one
process (attncc.distributed.ThreadGroup, no torch.distributed), so the compiled kernels' global
offset paths (mods, tile bounds, tile classes, dropout at Q_OFF / KV_OFF) are checked on the
device in bf16 and fp16: out, lse and every gradient against single-GPU attncc on the whole
sequence. On a machine with several GPUs, test_nccl_ranks_equal_single_gpu runs the same cases
with one process per GPU under NCCL (2, 4 and 8 ranks, as many as there are GPUs).

    python -m pytest -m gpu -q tests/test_gpu_distributed.py
    python -m pytest -m gpu -q tests/test_gpu_distributed.py -k "causal-bf16"   # one variant, ~2 min
    python -m pytest -m gpu -q tests/test_gpu_distributed.py -k nccl            # several GPUs only
"""
from __future__ import annotations

import time

import pytest
import torch

import attncc
from attncc.distributed import ThreadGroup, attention, shard, unshard
from test_distributed import NAMES, _case, _inputs, _single

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# relative error (norm of the difference / norm of single-GPU attncc's) per dtype: the ranks merge
# partial outputs in float32 and round once, single-GPU attncc rounds once too
TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}
# every variant in bf16, the ones with their own code paths (tile classes, capture gradients,
# dropout) in fp16 too: compiling the kernels dominates the run time (each (variant, dtype) pair
# compiles single-GPU and context-parallel forward and backward kernels), not the runs
CASES = [(name, "bf16") for name in ("causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap",
                                     "rel_bias", "gqa", "dropout", "band", "holes")]
CASES += [(name, "fp16") for name in ("causal", "document", "rel_bias", "dropout")]


def _rank(kernel, comm, q, k, v, do, dl, learn, gqa, layout, method, specs=None):
    """One rank's forward and backward, as kernel.context_parallel and its autograd node run them,
    but calling the backward directly: autograd runs every CUDA backward on one worker thread per
    device, where the ranks' ring backwards would wait for each other. ``specs``: a list that gets
    the forward's Spec."""
    qs, ks, vs, dos, dls = (shard(t, comm, layout=layout) for t in (q, k, v, do, dl))
    torch.manual_seed(99)
    how, _ = attention.prepare(kernel, qs, ks, vs, group=comm, layout=layout, method=method, enable_gqa=gqa,
                               training=True, generator=None)
    if specs is not None:
        specs.append(how[0].spec)
    caps = [c.tensor.detach() for c in kernel.variant.captures]
    out, lse = attention.forward(how, qs, ks, vs, caps)
    learnable = tuple(i for i, c in enumerate(kernel.variant.captures) if any(c.tensor is t for t in learn))
    dq, dk, dv, dcaps = attention.backward(how, qs, ks, vs, out, lse, caps, dos, dls, learnable)
    return (*(unshard(t.contiguous(), comm, layout=layout) for t in (out, lse, dq, dk, dv)), *dcaps)


RUNS = [(w, layout, method) for w in (2, 4) for layout in ("contiguous", "zigzag") for method in ("ring", "allgather")]


@pytest.mark.parametrize("world,layout,method", RUNS, ids=[f"{w}x{lay}-{m}" for w, lay, m in RUNS])
@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_ranks_one_after_another_equal_single_gpu(name, dtype, world, layout, method):
    dtype = DTYPES[dtype]
    L = 1024  # 4 ranks, zigzag: 8 chunks of 128 rows
    variant, H, Hkv, learn = _case(name, L, H=4, device="cuda")
    kernel = attncc.compile(variant)
    q, k, v, do, dl = _inputs(H, Hkv, L, batch=2, dim=128, dtype=dtype, device="cuda")
    want = _single(kernel, q, k, v, do, dl, learn, H != Hkv)
    got = ThreadGroup(world).run(lambda comm: _rank(kernel, comm, q, k, v, do, dl, learn, H != Hkv, layout,
                                                    method))[0]
    _assert_matches(got, want, dtype, f"{name} {layout} {method} W={world}")


# The Gluon tier's kernels at chunk positions (plan.offsets), which context_parallel takes where the
# tier fits: forced on (ATTNCC_TIER=gluon, so that the backward takes them at these short chunks
# too) for the variants the tier runs
GLUON_CASES = [(name, "bf16") for name in ("causal", "sliding_window", "prefix_lm", "alibi", "softcap", "gqa", "band",
                                           "holes", "document")]
GLUON_CASES += [(name, "fp16") for name in ("causal", "alibi")]


@pytest.mark.parametrize("world,layout,method", RUNS, ids=[f"{w}x{lay}-{m}" for w, lay, m in RUNS])
@pytest.mark.parametrize("name,dtype", GLUON_CASES, ids=[f"{n}-{d}" for n, d in GLUON_CASES])
def test_gluon_tier_chunks_equal_single_gpu(name, dtype, world, layout, method, monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon tier runs on sm90")
    monkeypatch.setenv("ATTNCC_TIER", "gluon")
    dtype = DTYPES[dtype]
    L = 1024
    variant, H, Hkv, learn = _case(name, L, H=4, device="cuda")
    kernel = attncc.compile(variant)
    q, k, v, do, dl = _inputs(H, Hkv, L, batch=2, dim=128, dtype=dtype, device="cuda")
    want = _single(kernel, q, k, v, do, dl, learn, H != Hkv)
    specs = []
    got = ThreadGroup(world).run(lambda comm: _rank(kernel, comm, q, k, v, do, dl, learn, H != Hkv, layout,
                                                    method, specs))[0]
    assert specs and all(s.tier == "gluon" and s.offsets for s in specs), specs  # the Gluon kernels ran
    _assert_matches(got, want, dtype, f"{name} {layout} {method} W={world} Gluon tier")


def _assert_matches(got, want, dtype, what_run):
    """Context-parallel results (out, lse, dq, dk, dv, capture gradients) against single-GPU attncc's."""
    for what, a, b in zip(NAMES, got, want):
        a, b = a.float(), b.float()
        assert not a.isnan().any(), f"{what_run} {dtype}: {what} has NaN"
        if what == "lse":
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a)), f"{what_run} {dtype}: {what}: -inf rows differ"
            worst = (a[finite] - b[finite]).abs().max()
            assert worst < 2e-3, f"{what_run} {dtype}: {what}: {worst}"
            continue
        err = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        tol = TOL[dtype] * (2 if what != "out" else 1)  # gradients sum W partials in float32 first
        assert err < tol, f"{what_run} {dtype}: {what} relative error {err:.2e} >= {tol}"


# Several GPUs: one process per GPU under NCCL (torch.multiprocessing, as test_distributed.py spawns
# gloo ranks on the CPU), each rank on its own device, through kernel.context_parallel and autograd
# as a training step runs it; rank 0 compares with single-GPU attncc on the whole sequence. Leave
# NCCL's own settings as the machine has them (NVLink multicast off: NCCL_NVLS_ENABLE=0).
WORLDS = [w for w in (2, 4, 8) if torch.cuda.is_available() and torch.cuda.device_count() >= w]
RUN_ALL = tuple((layout, method) for layout in ("contiguous", "zigzag") for method in ("ring", "allgather"))


def _nccl_worker(rank, world, port, cases):
    import torch.distributed as dist

    from attncc.distributed.comm import Comm
    from test_distributed import _sharded
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    failures = []
    try:
        comm = Comm()
        L = 1024  # 8 ranks, zigzag: 16 chunks of 64 rows (dropout's 16 x 32 grid holds)
        for name, dtype in cases:
            dtype = DTYPES[dtype]
            variant, H, Hkv, learn = _case(name, L, H=4, device=device)
            kernel = attncc.compile(variant)
            q, k, v, do, dl = _inputs(H, Hkv, L, batch=2, dim=128, dtype=dtype, device=device)
            want = _single(kernel, q, k, v, do, dl, learn, H != Hkv) if rank == 0 else None
            for layout, method in RUN_ALL:
                start = time.perf_counter()
                got = _sharded(kernel, comm, q, k, v, do, dl, learn, H != Hkv, layout, method)
                if rank == 0:
                    what = f"{name} {str(dtype)[6:]} {layout} {method} NCCL W={world}"
                    try:
                        _assert_matches(got, want, dtype, what)
                        print(f"{what}: ok ({time.perf_counter() - start:.1f} s)", flush=True)  # seen with -s
                    except AssertionError as e:
                        failures.append(str(e).splitlines()[0])
                        print(failures[-1], flush=True)
    finally:
        dist.destroy_process_group()
    assert not failures, f"{len(failures)} context-parallel runs differ from single-GPU attncc:\n" + "\n".join(failures)


@pytest.mark.skipif(not WORLDS, reason="needs at least two CUDA GPUs")
@pytest.mark.parametrize("world", WORLDS or [2], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{d}" for n, d in CASES])
def test_nccl_ranks_equal_single_gpu(name, dtype, world):
    """Every variant of the CPU list in bf16 (those with code paths of their own in fp16 too), both
    layouts, ring and all-gather, forward and backward, dropout: out, lse and every gradient."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_nccl_worker, args=(world, port, [(name, dtype)]), nprocs=world, join=True)
