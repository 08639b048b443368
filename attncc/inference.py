"""Inference entry points on the generated attn_kv kernel: decoding (split-KV), KV caches,
ragged (varlen) batches, and merging partial attention results.

Layouts follow FlashAttention's inference API: queries (batch, q_len, heads, dim) or packed
(total, heads, dim) with ``cu_seqlens``; outputs in the layout of the queries; log-sum-exp with
the output's shape minus its last dim. Queries are a sequence's newest tokens: query i of a
sequence with q_len queries and kv_len keys sits at position kv_len - q_len + i.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import runtime
from .autograd import check_inputs_stored, needs_grad
from .checks import DTYPES, check_capture_indices, check_captures, check_index_ranges, check_qkv
from .errors import AttnccError
from .kvcache import KV_LENS_CU, KV_LENS_FIXED, _Cache, _count, cu_seqlens_lengths
from .spec import Spec

DECODE_MAX_Q = 16  # attncc.attention switches to the decode kernel up to this many queries ...
DECODE_MIN_KV = 256  # ... when there are at least this many keys (and no gradient or dropout)
MAX_HEAD_DIM, MAX_HEAD_DIM_V = 1024, 512  # the inference kernel splits D in two pieces; Dv is one accumulator
_INTERPRETER_SMS = 4  # the interpreter has no SMs; pretend a few so split-KV runs in CPU tests


# fewer keys: no split in eager calls, where the split path's buffer and merge launch cost ~48 us
# more host time per call than the 9 us of GPU time it saves at 1024 keys (H200 machine, B=1,
# 32 query heads over 4 K/V heads: host 65 -> 113 us per call; GPU 22.8 -> 13.8 us). While a
# CUDA graph is being captured, that host time is spent once, not per replay: splits start at
# SPLIT_MIN_KV_CAPTURED keys (B=8 at 1024 keys 24.0 -> 17.3 us per replay)
SPLIT_MIN_KV = 2048
SPLIT_MIN_KV_CAPTURED = 512
SPLIT_MIN_TILES = 4  # each split reads at least this many key tiles, so that merging stays cheap
SMEM_PER_SM = 227 * 1024  # shared memory a Hopper SM gives its resident programs
PAGED_STAGES = 5  # decode kernel pipeline depth for paged caches (decode_sweep.py --paged 64, H200)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class _Setup:
    """What a call needs besides its tensors, found once per (variant, dtype, dims, device)."""
    module: object
    group: int
    sms: int
    interpret: bool
    dummy: torch.Tensor  # stands for absent int32 pointer arguments


_setups: dict = {}


def _setup(compiled, dtype, d, dv, group, device, positive_scale=True) -> _Setup:
    key = (compiled.variant.ir_key, dtype, d, dv, group, device, positive_scale)
    s = _setups.get(key)
    if s is None:
        target = runtime.target_for(device)
        spec = Spec(_DTYPE_NAMES[dtype], d, dv, group, target, positive_scale=positive_scale)
        interpret = target == "interpreter"
        sms = _INTERPRETER_SMS if interpret else torch.cuda.get_device_properties(device).multi_processor_count
        s = _setups[key] = _Setup(compiled.module("kv", spec), group, sms, interpret,
                                  torch.zeros(1, dtype=torch.int32, device=device))
    return s


def resident_programs(block_n: int, d: int, dv: int, stages: int, itemsize: int) -> int:
    """Decode programs one SM holds at once: its shared memory over the K/V tiles of the pipeline
    (the decode kernel is small in registers; 4 programs is Triton's usual cap at 4 warps)."""
    return max(1, min(4, SMEM_PER_SM // max(1, stages * block_n * (d + dv) * itemsize)))


def num_splits(programs: int, max_kv_len: int, block_n: int, slots: int, interpret: bool = False,
               min_kv: int = SPLIT_MIN_KV) -> tuple:
    """(splits, keys per split) for flash-decoding. ``slots``: programs the GPU runs at once (SMs
    times resident programs). The splits fill one wave of slots, no more: a second, partly filled
    wave costs a whole split's time (H200, B=1, 128k keys: 264 programs 66.6 us, 512 programs
    76.1 us). Each split keeps at least SPLIT_MIN_TILES key tiles so that merging stays cheap;
    below ``min_kv`` keys, or when the rows alone fill the GPU, one program per row tile. The
    interpreter splits from one tile on, so that CPU tests run the split path."""
    min_tiles = 1 if interpret else SPLIT_MIN_TILES
    if (max_kv_len < min_kv and not interpret) or programs >= slots:
        return 1, None
    tiles = -(-max(max_kv_len, 1) // block_n)
    splits = max(1, min(slots // max(programs, 1), tiles // min_tiles, 256))
    if splits == 1:
        return 1, None
    split_len = -(-tiles // splits) * block_n
    return -(-max_kv_len // split_len), split_len


def _packed4(t: torch.Tensor, batch: int, lead: int = 0) -> torch.Tensor:
    """A packed (..., total, heads, dim) tensor as (..., batch, heads, total, dim), batch stride 0."""
    t = t.unsqueeze(lead)
    shape = list(t.shape)
    shape[lead] = batch
    return t.expand(shape).transpose(lead + 1, lead + 2)


def _padded4(t: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """(..., batch, len, heads, dim) as (..., batch, heads, len, dim)."""
    return t.transpose(lead + 1, lead + 2)


def _kernel_setup(compiled, dtype, device, hq: int, d: int, hkv: int, dv: int) -> tuple:
    """(setup, scale) of a call with hq query heads of dim d over hkv K/V heads with values of
    dim dv, after checking that the kernel takes them (before a KV cache changes)."""
    if not (1 <= d <= MAX_HEAD_DIM and 1 <= dv <= MAX_HEAD_DIM_V):
        raise AttnccError(f"head dims {d} (query/key) and {dv} (value) must be at most {MAX_HEAD_DIM} and "
                          f"{MAX_HEAD_DIM_V} for the inference kernel (MLA's 576/512 fit)")
    if hkv == 0 or hq % hkv:
        raise AttnccError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    variant = compiled.variant
    scale = variant.scale if variant.scale is not None else 1.0 / math.sqrt(d)
    return _setup(compiled, dtype, d, dv, hq // hkv, device, scale > 0), scale


def run(compiled, q, k4, v4, *, batch, packed, max_q_len, max_kv_len, cu_q=None, kv_lens=None,
        kv_mode=KV_LENS_FIXED, block_table=None, page_size=1, bottom_right=1, return_lse=False,
        heads_last=True, covered=None, setup=None):
    """Attention of a compiled variant through attn_kv. q: (B, Lq, H, D), packed (total, H, D), or
    with heads_last=False (B, H, Lq, D); k4, v4: the kernel's 4-d key/value views. max_q_len and
    max_kv_len must be the true maxima (split-KV covers max_kv_len keys, no more). ``covered``:
    packed rows that cu_q assigns to a sequence; the rows after them get 0 and lse -inf.
    ``setup``: what _kernel_setup returned for this call, when the caller checked it already."""
    hq, d = (q.shape[-2], q.shape[-1]) if heads_last else (q.shape[1], q.shape[3])
    hkv, dv = k4.shape[1], v4.shape[3]
    s, scale = setup or _kernel_setup(compiled, q.dtype, q.device, hq, d, hkv, dv)
    captures = [c.tensor for c in compiled.variant.captures]  # inference: dropout never applies here
    check_inputs_stored(compiled.variant, q, k4, v4, captures)

    out = q.new_empty(q.shape[:-1] + (dv,))
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if packed:
        view, q4 = (lambda t, lead=0: _packed4(t, batch, lead)), _packed4(q, batch)
    elif heads_last:
        view, q4 = _padded4, _padded4(q)
    else:
        view, q4 = (lambda t, lead=0: t), q
    if out.numel() == 0 or batch == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return (out, lse) if return_lse else out

    if s.interpret:  # the interpreter computes on bf16's raw bits: run in float32
        q4, k4, v4 = (t.float() if t.dtype == torch.bfloat16 else t for t in (q4, k4, v4))
        captures = runtime.interp_captures(captures)
    rows = max_q_len * s.group
    block_m, block_n, _, stages = s.module.tiles(rows)
    programs = -(-rows // block_m) * batch * hkv
    paged = block_table is not None
    # the split count must not depend on the cache's layout: contiguous and paged caches give
    # bit-identical results (a paged cache alone would run faster with one more program per SM:
    # H200, B=8, 128k keys, 64-token pages 537.7 -> 489.5 us)
    resident = resident_programs(block_n, d, dv, stages, q.element_size())
    captured = not s.interpret and torch.cuda.is_current_stream_capturing()
    splits, split_len = num_splits(programs, max_kv_len, block_n, s.sms * resident, s.interpret,
                                   SPLIT_MIN_KV_CAPTURED if captured else SPLIT_MIN_KV)
    dummy = s.dummy
    args = dict(batch=batch, max_q_len=max_q_len, cu_q=dummy if cu_q is None else cu_q, q_lens=cu_q is not None,
                kv_lens=dummy if kv_lens is None else kv_lens, kv_mode=kv_mode,
                block_table=dummy if block_table is None else block_table, paged=paged,
                page_size=page_size, bottom_right=bottom_right)
    if paged and not s.interpret and max(d, dv) <= 128:
        # Triton pipelines a block-table read in the key loop as one more async copy, and at 3
        # stages it then waits for all copies before each tile: K/V tiles stream one ahead instead
        # of two. At 5 stages they stream two ahead again (H200, 64-token pages, from a CUDA
        # graph: B=64, 16k keys 603 -> 508 us; B=8, 128k 539 -> 490 us, contiguous 486 us; B=1,
        # 128k 86.0 -> 82.6 us). Splits that read their block-table entries up front keep 3.
        args["paged_stages"] = PAGED_STAGES
    o_run = out.float() if s.interpret and out.dtype == torch.bfloat16 else out
    if splits == 1:
        runtime.launch(s.module, q4, k4, v4, view(o_run), view(lse.unsqueeze(-1))[..., 0], captures, scale, **args)
    else:  # each split writes a normalised partial (o, lse); merge combines them
        # one buffer for both (one allocation less per call): splits x (outputs, then lse)
        n_o, n_l = out.numel(), lse.numel()
        part = torch.empty((splits, n_o + n_l), dtype=torch.float32, device=q.device)
        part_o = part[:, :n_o].view((splits,) + out.shape)
        part_lse = part[:, n_o:].view((splits,) + lse.shape)
        runtime.launch(s.module, q4, k4, v4, view(part_o, 1), view(part_lse.unsqueeze(-1), 1)[..., 0], captures,
                       scale, split_len=split_len, num_splits=splits, **args)
        s.module.merge(part_o.view(splits, -1, dv), part_lse.view(splits, -1), o_run.view(-1, dv), lse.view(-1))
    if o_run is not out:
        out.copy_(o_run)
    if covered is not None and covered < out.shape[0]:  # padding after the last sequence: no kernel wrote it
        out[covered:] = 0
        lse[covered:] = float("-inf")
    return (out, lse) if return_lse else out


def _check_q(q, packed: bool, name="query"):
    if not isinstance(q, torch.Tensor):
        raise AttnccError(f"{name} must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in DTYPES:
        raise AttnccError(f"{name} has dtype {q.dtype}; attncc kernels support float16, bfloat16 and float32")
    want = 3 if packed else 4
    if q.dim() != want:
        layout = "packed (total, heads, head_dim)" if packed else "(batch, q_len, heads, head_dim)"
        raise AttnccError(f"{name} must be {layout}{' with cu_seqlens_q' if packed else ''}, got shape {tuple(q.shape)}")


def _cu(cu: torch.Tensor, device, name: str, total: int):
    """cu_seqlens checked, as contiguous int32 on the device, and its sequences' lengths (read on
    the host: one sync for a CUDA tensor; the KV cache's append and the capture index checks
    need them too)."""
    lens = cu_seqlens_lengths(cu, name, total)
    return cu.to(device=device, dtype=torch.int32).contiguous(), lens


def _longest(lens: list, given, name: str) -> int:
    """The longest of ``lens``, which the host holds. FlashAttention's ``max_seqlen_*`` hint,
    when given, must not be below it: the kernel would leave the rest of the rows unwritten (a
    larger hint is fine; the launch uses the true maximum)."""
    longest = max(lens, default=0)
    if given is not None and _count(given, name) < longest:
        raise AttnccError(f"{name}={given} is below the longest sequence: sequence {lens.index(longest)} has "
                          f"{longest} tokens. Pass the true maximum, int((cu[1:] - cu[:-1]).max()), or leave "
                          f"{name} out: attncc takes it from the offsets")
    return longest


def with_kvcache(compiled, q, cache, k=None, v=None, *, cu_seqlens_q=None, max_seqlen_q=None, return_lse=False):
    """Attend queries to a KV cache after appending their keys and values (when given). Every
    check runs before the append, so that a refused call leaves the cache as it was."""
    if not isinstance(cache, _Cache):
        raise AttnccError(f"cache must be an attncc.KVCache or attncc.PagedKVCache, got {type(cache).__name__}")
    packed = cu_seqlens_q is not None
    _check_q(q, packed)
    if q.dtype != cache.dtype or q.device != cache.device:
        raise AttnccError(f"query is {q.dtype} on {q.device} but the cache holds {cache.dtype} on {cache.device}")
    if q.shape[-1] != cache.head_dim:
        raise AttnccError(f"query head dim {q.shape[-1]} differs from the cache's head_dim {cache.head_dim}")
    if v is not None and k is None:
        raise AttnccError("v was given without k: pass both new keys and values, or neither")
    _no_grad(q, *[c.tensor for c in compiled.variant.captures])
    check_captures(compiled.variant.captures, q.device)
    check_inputs_stored(compiled.variant, q, *((k, v) if k is not None else (q, q)),
                        [c.tensor for c in compiled.variant.captures])  # before the append reads k, v
    if packed:
        cu_q, lens = _cu(cu_seqlens_q, q.device, "cu_seqlens_q", q.shape[0])
        max_q = _longest(lens, max_seqlen_q, "max_seqlen_q")
    else:
        cu_q, lens = None, [q.shape[1]] * q.shape[0]
        max_q = _longest(lens[:1], max_seqlen_q, "max_seqlen_q")  # (every sequence has q.shape[1] queries)
    batch = len(lens)
    # every check before the append, so that a refused call leaves the cache as it was
    if packed and isinstance(k, torch.Tensor) and k.dim() == 3 and sum(lens) != k.shape[0]:
        raise AttnccError(f"cu_seqlens_q ends at {sum(lens)} but the new keys have {k.shape[0]} packed tokens: with "
                          "k and v, cu_seqlens_q gives each sequence's new tokens, the keys' as well as the queries'")
    after = cache.lengths() if k is None else cache.lengths_after(k, v, cu_seqlens_q)
    if batch > len(after):
        raise AttnccError(f"the queries have {batch} sequences but the cache holds {len(after)}")
    short = [b for b, n in enumerate(lens) if n > after[b]]
    if short:
        raise AttnccError(f"sequence {short[0]} has {lens[short[0]]} queries but only {after[short[0]]} "
                          "cached tokens: append the queries' keys first (pass k and v)")
    kv_lens = after[:batch]
    _check_positions(compiled, q.shape[-2], batch, lens, kv_lens)
    setup = _kernel_setup(compiled, q.dtype, q.device, q.shape[-2], q.shape[-1], cache.num_kv_heads, cache.head_dim_v)
    if k is not None:
        cache._write(k, v, after)  # (out of pages or max_len is refused before anything is written)
    args = cache.kernel_args()
    return run(compiled, q, args.pop("k"), args.pop("v"), batch=batch, packed=packed, max_q_len=max_q,
               max_kv_len=max(kv_lens, default=0), cu_q=cu_q, return_lse=return_lse,
               covered=sum(lens) if packed else None, setup=setup, **args)


def varlen(compiled, q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q=None, max_seqlen_kv=None, *,
           return_lse=False):
    """Attention over packed sequences: q (total_q, Hq, D), k/v (total_kv, Hkv, D) with cu_seqlens."""
    _check_q(q, True)
    _check_q(k, True, "key")
    _check_q(v, True, "value")
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        raise AttnccError("query, key and value must share one dtype and device")
    if k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise AttnccError(f"shapes do not fit: query {tuple(q.shape)}, key {tuple(k.shape)}, value {tuple(v.shape)}")
    _no_grad(q, k, v, *[c.tensor for c in compiled.variant.captures])
    check_captures(compiled.variant.captures, q.device)
    cu_q, lens_q = _cu(cu_seqlens_q, q.device, "cu_seqlens_q", q.shape[0])
    cu_kv, lens_kv = _cu(cu_seqlens_kv, q.device, "cu_seqlens_kv", k.shape[0])
    if len(lens_q) != len(lens_kv):
        raise AttnccError(f"cu_seqlens_q has {len(lens_q)} sequences but cu_seqlens_kv {len(lens_kv)}")
    batch = len(lens_q)
    max_q, max_kv = _longest(lens_q, max_seqlen_q, "max_seqlen_q"), _longest(lens_kv, max_seqlen_kv, "max_seqlen_kv")
    _check_positions(compiled, q.shape[-2], batch, lens_q, lens_kv)
    return run(compiled, q, _packed4(k, batch), _packed4(v, batch), batch=batch, packed=True, max_q_len=max_q,
               max_kv_len=max_kv, cu_q=cu_q, kv_lens=cu_kv, kv_mode=KV_LENS_CU, return_lse=return_lse,
               covered=sum(lens_q))


def decode(compiled, q, k, v, enable_gqa=False, return_lse=False):
    """attncc.attention's decode path: q (B, Hq, Lq, D) with few queries, k/v (B, Hkv, Lkv, D);
    positions as in prefill (q_idx from 0)."""
    check_qkv(q, k, v, enable_gqa)
    check_captures(compiled.variant.captures, q.device)
    check_capture_indices(compiled.variant, q, k)
    return run(compiled, q, k, v, batch=q.shape[0], packed=False, max_q_len=q.shape[2], max_kv_len=k.shape[2],
               bottom_right=0, return_lse=return_lse, heads_last=False)


def use_decode(q, k, v, dropout: bool, captures=()) -> bool:
    """attncc.attention takes the decode kernel for few queries over many keys, in inference
    (no gradient needed for q, k, v or a captured tensor, no dropout, not inside torch.compile,
    which sees one custom op)."""
    if dropout or torch.compiler.is_compiling():  # first: no guards on lengths in compiled graphs
        return False
    if not (type(q) is type(k) is type(v) is torch.Tensor and q.dim() == k.dim() == v.dim() == 4):
        return False  # (subclasses and bad inputs take the prefill path, whose checks name the problem)
    if q.shape[2] > DECODE_MAX_Q or k.shape[2] < DECODE_MIN_KV:  # the common prefill call returns here
        return False
    return not needs_grad((q, k, v, *captures))


def _check_positions(compiled, heads: int, batch: int, q_lens: list, kv_lens: list) -> None:
    """Captured tensors must be large enough for the positions this call gives the mods: query
    i of sequence b is at kv_lens[b] - q_lens[b] + i."""
    firsts = [kv - q for q, kv in zip(q_lens, kv_lens) if q]
    leaves = {"b": (0, batch - 1), "h": (0, heads - 1),
              "q_idx": (min(firsts, default=0), max(kv_lens, default=0) - 1),
              "kv_idx": (0, max(kv_lens, default=0) - 1)}
    check_index_ranges(compiled.variant, leaves)


def _no_grad(*tensors):
    """The inference kernels have no backward: refuse inputs or captured tensors that want one."""
    if needs_grad(tensors):
        raise AttnccError("attncc's KV-cache and varlen kernels are forward-only (inference), but an input or a "
                          "captured tensor requires grad: call them under torch.no_grad() / "
                          "torch.inference_mode(), or use attncc.attention for training")


def merge_states(o_a, lse_a, o_b=None, lse_b=None):
    """Combine attention results over disjoint key sets exactly (cascade or shared-prefix
    attention, context parallelism): ``merge_states(o_a, lse_a, o_b, lse_b)`` or
    ``merge_states([o_1, ...], [lse_1, ...])``. o_i (..., Dv), lse_i (...) natural-log
    log-sum-exp (-inf: no keys); returns (o, lse) with o in o_1's dtype. Decoding merges its
    split-KV partials with the same kernel."""
    if isinstance(o_a, (list, tuple)):
        outs, lses = list(o_a), list(lse_a)
        if o_b is not None or lse_b is not None:
            raise AttnccError("merge_states takes (o_a, lse_a, o_b, lse_b) or two lists, not both")
    else:
        outs, lses = [o_a, o_b], [lse_a, lse_b]
    if not outs or len(outs) != len(lses) or any(o is None for o in outs) or any(s is None for s in lses):
        raise AttnccError("merge_states needs one log-sum-exp per output, and at least one of each")
    shape, dev = outs[0].shape, outs[0].device
    for o, s in zip(outs, lses):
        if o.shape != shape or tuple(s.shape) != tuple(shape[:-1]) or o.device != dev or s.device != dev:
            raise AttnccError(f"merge_states: every output must be {tuple(shape)} with lse {tuple(shape[:-1])} "
                              f"on {dev}, got {tuple(o.shape)} and {tuple(s.shape)}")
    dv = shape[-1]
    part_o = torch.stack([o.reshape(-1, dv) for o in outs]).float()
    part_lse = torch.stack([s.reshape(-1) for s in lses]).float().contiguous()
    out, lse = merge_stacked(part_o, part_lse, outs[0].dtype)
    return out.to(outs[0].dtype).view(shape), lse.view(shape[:-1])


def merge_stacked(part_o, part_lse, dtype):
    """(out (R, Dv), lse (R,)) of S partials stacked as part_o (S, R, Dv) and part_lse (S, R),
    contiguous, in one pass of the merge kernel; out in ``dtype`` (float32 in the interpreter,
    which would store bf16 as raw bits: convert after)."""
    target = runtime.target_for(part_o.device)
    out = torch.empty(part_o.shape[1:], dtype=torch.float32 if target == "interpreter" else dtype,
                      device=part_o.device)
    lse = torch.empty(part_o.shape[1], dtype=torch.float32, device=part_o.device)
    if out.numel():
        from .api import CompiledAttention
        from .variant import Variant
        module = CompiledAttention(Variant()).module("kv", Spec("float32", 16, 16, 1, target))
        module.merge(part_o, part_lse, out, lse)
    return out, lse
