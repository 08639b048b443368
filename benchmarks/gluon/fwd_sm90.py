"""FA3-style attention forward for Hopper (sm90), written in Gluon (triton.experimental.gluon,
checked against triton 3.6.0).  out, lse = attention(q, k, v, causal, sm_scale).

Work unit: a tile of NUM_WG * BLOCK_M query rows (default 2 * 64) of one (batch, head).

  * producer partition (1 warp, 24 registers): per tile, loads the Q tile (one TMA box per
    consumer warpgroup, after the first K block, once the previous tile's consumers released Q),
    then walks the KV blocks from the last to the first, loading K and V into two STAGES-deep
    shared-memory rings.  Every slot has a `ready` mbarrier (TMA transaction bytes) and an `empty`
    mbarrier (NUM_WG arrivals, one per consumer warpgroup).
  * NUM_WG consumer warpgroups (4 warps, 240 registers each; the default partition is consumer 0):
    warpgroup w owns query rows [w * BLOCK_M, (w + 1) * BLOCK_M) of the tile.  Per KV block j, with
    FA3's intra-warpgroup overlap:
        issue S_j = Q K_j^T            (async wgmma, A and B from shared memory)
        issue O  += P_{j-1} V_{j-1}    (async wgmma, A = P in registers, B = V in shared memory)
        wait for S_j only; release K_j; mask / mods (hook); online softmax in registers (exp2, the
        scale folded into one FMA); wait for the PV GEMM; release V_{j-1}; O *= alpha; P -> 16 bit.
    Ping-pong (PINGPONG=1): the warpgroups take turns to issue their GEMMs, handing the turn on
    through mbarriers `sched`, so one warpgroup's softmax runs under the other's GEMMs.
  * KV blocks are visited from the last to the first, so the blocks that need the mask (causal
    diagonal, ragged end of the KV sequence) come first (the first one peeled, always masked), then
    the unmasked ones; both loops call one step function with a constexpr MASK flag.
  * epilogue: O / l in the input dtype -> the warpgroup's O buffer in shared memory -> TMA store
    through a 3-D descriptor (B*H, L, D), so rows past L are clipped; lse (natural log) per row.
  * PERSISTENT (default for non-causal): grid = #SMs, each CTA loops over tiles t = pid, pid + grid,
    ...; rings, phases and the ping-pong turn carry over, so the next tile's loads overlap the
    epilogue.  Causal runs one CTA per tile (a static persistent split is unbalanced for causal).

Knobs kept for experiments (see NOTES.md for the measurements): PINGPONG 0/1/2 (off / mbarriers /
named barriers via inline asm), NUM_WG 2/3, FENCE and RESCALE_EARLY (schedule of the softmax
against the PV wait), HG (heads per group in the tile order), STAGES, BLOCK_N, PERSISTENT.

Template hook: `apply_mods` is where a score_mod / mask_mod will be inlined.  It receives the raw
tile S = Q K^T (fp32, not yet scaled) with its absolute q / kv indices.
"""
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (
    tma,
    mbarrier,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------------------------------
# score_mod / mask_mod hook
# --------------------------------------------------------------------------------------------------
@gluon.jit
def apply_mods(s, q_idx, kv_idx, Lkv, CAUSAL: gl.constexpr):
    # ==== SCORE_MOD / MASK_MOD HOOK =============================================================
    # s:      [BLOCK_M, BLOCK_N] fp32 raw scores Q K^T (sm_scale NOT applied yet)
    # q_idx:  [BLOCK_M] absolute query positions  (SliceLayout(1, s.layout))
    # kv_idx: [BLOCK_N] absolute key positions    (SliceLayout(0, s.layout))
    # Return the modified scores; masked entries must be -inf.  Today: key-length bound + causal
    # (top-left aligned, q_idx >= kv_idx, as torch SDPA's is_causal).  A template will render the
    # variant's score_mod (on s * sm_scale, then fold only log2(e) in the softmax) and mask_mod here.
    keep = gl.expand_dims(kv_idx < Lkv, 0)
    if CAUSAL:
        keep = keep & (gl.expand_dims(q_idx, 1) >= gl.expand_dims(kv_idx, 0))
    return gl.where(keep, s, -float("inf"))
    # ==== END HOOK ==============================================================================


# --------------------------------------------------------------------------------------------------
# shared state handed to every partition
# --------------------------------------------------------------------------------------------------
@aggregate
class AttnCtx:
    q_desc: tma.tensor_descriptor
    k_desc: tma.tensor_descriptor
    v_desc: tma.tensor_descriptor
    o_desc: tma.tensor_descriptor
    lse_ptr: gl.tensor
    q_smem: gl.shared_memory_descriptor
    o_smem: gl.shared_memory_descriptor
    k_smem: gl.shared_memory_descriptor
    v_smem: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor
    sched: gl.shared_memory_descriptor
    Lq: gl.tensor
    Lkv: gl.tensor
    n_m: gl.tensor
    n_tiles: gl.tensor
    BH: gl.tensor
    HG: gl.tensor
    qk_scale: gl.tensor
    BLOCK_M: gl.constexpr
    BLOCK_N: gl.constexpr
    HEAD_DIM: gl.constexpr
    NUM_WG: gl.constexpr
    STAGES: gl.constexpr
    CAUSAL: gl.constexpr
    PINGPONG: gl.constexpr
    FENCE: gl.constexpr
    RESCALE_EARLY: gl.constexpr

    @gluon.constexpr_function
    def __init__(self, q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty,
                 k_ready, k_empty, v_ready, v_empty, sched, Lq, Lkv, n_m, n_tiles, BH, HG, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                 NUM_WG, STAGES, CAUSAL, PINGPONG, FENCE, RESCALE_EARLY):
        self.q_desc = q_desc
        self.k_desc = k_desc
        self.v_desc = v_desc
        self.o_desc = o_desc
        self.lse_ptr = lse_ptr
        self.q_smem = q_smem
        self.o_smem = o_smem
        self.k_smem = k_smem
        self.v_smem = v_smem
        self.q_ready = q_ready
        self.q_empty = q_empty
        self.k_ready = k_ready
        self.k_empty = k_empty
        self.v_ready = v_ready
        self.v_empty = v_empty
        self.sched = sched
        self.Lq = Lq
        self.Lkv = Lkv
        self.n_m = n_m
        self.n_tiles = n_tiles
        self.BH = BH
        self.HG = HG
        self.qk_scale = qk_scale
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.BLOCK_N = gl.constexpr(BLOCK_N)
        self.HEAD_DIM = gl.constexpr(HEAD_DIM)
        self.NUM_WG = gl.constexpr(NUM_WG)
        self.STAGES = gl.constexpr(STAGES)
        self.CAUSAL = gl.constexpr(CAUSAL)
        self.PINGPONG = gl.constexpr(PINGPONG)
        self.FENCE = gl.constexpr(FENCE)
        self.RESCALE_EARLY = gl.constexpr(RESCALE_EARLY)


@gluon.jit
def _tile_info(ctx: AttnCtx, t):
    # tile t -> (batch*head, first query row, KV blocks to visit, how many of them need the mask).
    # Heads are taken in groups of HG (K/V of a group stay in L2); inside a group the query tiles go
    # from the last (the longest, if causal) to the first, the HG heads interleaved, so that a
    # persistent CTA's static share (t = pid, pid + grid, ...) is balanced.  HG = 1: head by head.
    BLOCK_Q: gl.constexpr = ctx.BLOCK_M * ctx.NUM_WG
    per_group = ctx.n_m * ctx.HG
    grp = t // per_group
    r = t - grp * per_group
    hg = gl.minimum(ctx.HG, ctx.BH - grp * ctx.HG)
    pid_m = ctx.n_m - 1 - r // hg
    bh = grp * ctx.HG + r % hg
    m0 = pid_m * BLOCK_Q
    if ctx.CAUSAL:
        kv_end = gl.minimum(ctx.Lkv, m0 + BLOCK_Q)
        n_full = gl.minimum((m0 + 1) // ctx.BLOCK_N, ctx.Lkv // ctx.BLOCK_N)
    else:
        kv_end = ctx.Lkv
        n_full = ctx.Lkv // ctx.BLOCK_N
    n_blocks = gl.cdiv(kv_end, ctx.BLOCK_N)
    return bh, m0, n_blocks, n_blocks - n_full


# --------------------------------------------------------------------------------------------------
# ping-pong between the consumer warpgroups
# --------------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _bar_asm(kind, bar_id, n_threads):
    return f"bar.{kind} {bar_id}, {n_threads};\n\tmov.u32 $0, 0;"


@gluon.jit
def _named_barrier(dummy, KIND: gl.constexpr, BAR_ID: gl.constexpr):
    # hardware named barrier over the 2 consumer warpgroups (256 threads); ids 8/9 are not used by
    # Triton's warp specialization (it uses 0..1 + one per partition)
    gl.inline_asm_elementwise(_bar_asm(KIND, BAR_ID, 256), "=r,r", [dummy], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _sched_wait(ctx: AttnCtx, WG: gl.constexpr, t):
    # The warpgroups take turns to issue their GEMMs, so one's softmax runs under the other's GEMMs.
    # PINGPONG=1: mbarriers sched[w] (arrived on by the other warpgroup after it issued; warpgroup 0
    # starts, a fresh mbarrier passes a parity-1 wait).  PINGPONG=2: named barriers (FA3's way).
    if ctx.PINGPONG == 1:
        if WG == 0:
            mbarrier.wait(ctx.sched.index(0), (t & 1) ^ 1)
        else:
            mbarrier.wait(ctx.sched.index(WG), t & 1)
    elif ctx.PINGPONG == 2:
        _named_barrier(t, "sync", 8 + WG)


@gluon.jit
def _sched_arrive(ctx: AttnCtx, WG: gl.constexpr, t):
    # round robin: warpgroup WG hands the turn to warpgroup (WG + 1) % NUM_WG
    if ctx.PINGPONG == 1:
        mbarrier.arrive(ctx.sched.index((WG + 1) % ctx.NUM_WG), count=1)
    elif ctx.PINGPONG == 2:
        _named_barrier(t, "arrive", 8 + (WG + 1) % ctx.NUM_WG)


# --------------------------------------------------------------------------------------------------
# consumer warpgroups
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _softmax_step(ctx: AttnCtx, s, m_i, l_i, q_idx, kb, MASK: gl.constexpr):
    s_layout: gl.constexpr = s.type.layout
    if MASK:
        kv_idx = kb * ctx.BLOCK_N + gl.arange(0, ctx.BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = apply_mods(s, q_idx, kv_idx, ctx.Lkv, ctx.CAUSAL)
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * ctx.qk_scale)
    # rows that saw only masked keys so far keep m = -inf; use 0 there so that exp2 gives 0, not NaN
    m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(gl.fma(s, ctx.qk_scale, -gl.expand_dims(m_use, 1)))
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _kv_step(ctx: AttnCtx, WG: gl.constexpr, it, g0, sched_t, q_phase, n_blocks, o, p_op, alpha, m_i, l_i, q_smem,
             q_idx, s_zero, o_layout: gl.constexpr, p_layout: gl.constexpr, MASK: gl.constexpr):
    # visit KV block number `it` of the tile (block index n_blocks-1-it), overlapping the PV GEMM of
    # block it-1.  g0: position of the tile's first block in the K/V rings.
    kb = n_blocks - 1 - it
    g = g0 + it
    k_slot = g % ctx.STAGES
    k_phase = (g // ctx.STAGES) & 1
    v_slot = (g - 1) % ctx.STAGES
    v_phase = ((g - 1) // ctx.STAGES) & 1

    _sched_wait(ctx, WG, sched_t + it)
    mbarrier.wait(ctx.k_ready.index(k_slot), k_phase)
    s_tok = warpgroup_mma(q_smem, ctx.k_smem.index(k_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if ctx.RESCALE_EARLY:
        # O *= alpha of the previous block, just before the PV GEMM that accumulates into it
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    mbarrier.wait(ctx.v_ready.index(v_slot), v_phase)
    o_tok = warpgroup_mma(p_op, ctx.v_smem.index(v_slot), o, is_async=True)
    _sched_arrive(ctx, WG, sched_t + it)

    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    mbarrier.arrive(ctx.k_empty.index(k_slot), count=1)
    p, m_i, l_i, alpha = _softmax_step(ctx, s, m_i, l_i, q_idx, kb, MASK)

    # FENCE: a wait on an mbarrier that has already completed (this tile's Q) is a try-wait loop,
    # a basic-block boundary, which ptxas hardly schedules across.  Without it ptxas hoists the PV
    # wait below (with the bar.sync + arrive after it) above the exp2s in the unmasked loop, so this
    # warpgroup's softmax does not overlap its own PV GEMM (SASS checked).  Measured: no gain (the
    # other warpgroup fills the tensor cores anyway), so it is off by default.
    if ctx.FENCE:
        mbarrier.wait(ctx.q_ready.index(WG), q_phase)
    # Wait for the PV GEMM.  p_op (its register A operand) must stay alive until here.  The softmax
    # results go through the wait as deps too, which keeps LLVM from sinking the softmax below the
    # wait (ptxas may still do so, see FENCE).  P is converted to 16 bits after the wait, as in
    # FA3: converting before it needs 32 more registers and ptxas then waits early to reuse the
    # in-flight A-operand registers.
    o, p_op, p, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, p, alpha, m_i, l_i))
    mbarrier.arrive(ctx.v_empty.index(v_slot), count=1)
    if not ctx.RESCALE_EARLY:
        o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p_op = gl.convert_layout(p.to(ctx.q_desc.dtype), p_layout)
    return o, p_op, alpha, m_i, l_i


@gluon.jit
def consumer_partition(ctx: AttnCtx, WG: gl.constexpr):
    BLOCK_M: gl.constexpr = ctx.BLOCK_M
    BLOCK_N: gl.constexpr = ctx.BLOCK_N
    HEAD_DIM: gl.constexpr = ctx.HEAD_DIM
    STAGES: gl.constexpr = ctx.STAGES
    dtype: gl.constexpr = ctx.q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = ctx.q_smem.index(WG)
    o_smem = ctx.o_smem.index(WG)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    if ctx.PINGPONG == 2:
        if WG == ctx.NUM_WG - 1:
            _named_barrier(ctx.Lq, "arrive", 8)  # let warpgroup 0 issue first

    g0 = 0  # ring position of the tile's first K/V block
    sched_t = 0  # GEMM-issue turns taken so far (n_blocks + 1 per tile)
    tile_i = 0
    for t in range(gl.program_id(0), ctx.n_tiles, gl.num_programs(0)):
        bh, m0, n_blocks, n_masked = _tile_info(ctx, t)
        q_row0 = m0 + WG * BLOCK_M
        q_idx = q_row0 + gl.arange(0, BLOCK_M, layout=row_s)

        # ---- prologue: first visited KV block (always masked: cheap, once per tile) ----
        q_phase = tile_i & 1
        mbarrier.wait(ctx.q_ready.index(WG), q_phase)
        k_slot = g0 % STAGES
        _sched_wait(ctx, WG, sched_t)
        mbarrier.wait(ctx.k_ready.index(k_slot), (g0 // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, ctx.k_smem.index(k_slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        _sched_arrive(ctx, WG, sched_t)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
        mbarrier.arrive(ctx.k_empty.index(k_slot), count=1)
        m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
        p, m_i, l_i, alpha = _softmax_step(ctx, s, m_i, l_i, q_idx, n_blocks - 1, True)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

        # ---- masked blocks (causal diagonal / ragged KV end), then unmasked blocks ----
        for it in range(1, n_masked):
            o, p_op, alpha, m_i, l_i = _kv_step(ctx, WG, it, g0, sched_t, q_phase, n_blocks, o, p_op, alpha, m_i,
                                                l_i, q_smem, q_idx, s_zero, o_layout, p_layout, True)
        for it in range(gl.maximum(n_masked, 1), n_blocks):
            o, p_op, alpha, m_i, l_i = _kv_step(ctx, WG, it, g0, sched_t, q_phase, n_blocks, o, p_op, alpha, m_i,
                                                l_i, q_smem, q_idx, s_zero, o_layout, p_layout, False)
        # every S GEMM of this tile has completed: the producer may load the next Q tile
        mbarrier.arrive(ctx.q_empty.index(WG), count=1)

        # ---- last PV GEMM ----
        gv = g0 + n_blocks - 1
        v_slot = gv % STAGES
        _sched_wait(ctx, WG, sched_t + n_blocks)
        mbarrier.wait(ctx.v_ready.index(v_slot), (gv // STAGES) & 1)
        if ctx.RESCALE_EARLY:
            o = o * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        o_tok = warpgroup_mma(p_op, ctx.v_smem.index(v_slot), o, is_async=True)
        _sched_arrive(ctx, WG, sched_t + n_blocks)
        o, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op))
        mbarrier.arrive(ctx.v_empty.index(v_slot), count=1)

        # ---- epilogue: normalise, lse, O through shared memory + TMA store (left in flight) ----
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = o * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
        lse = gl.where(l_i == 0.0, -float("inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(ctx.lse_ptr + bh.to(gl.int64) * ctx.Lq + q_idx, lse, mask=q_idx < ctx.Lq)
        tma.store_wait(pendings=0)  # the previous tile's O store has read o_smem
        gl.thread_barrier()
        o_smem.store(o.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(ctx.o_desc, [bh, q_row0, 0], o_smem.reshape([1, BLOCK_M, HEAD_DIM]))

        g0 += n_blocks
        sched_t += n_blocks + 1
        tile_i += 1
    tma.store_wait(pendings=0)


# --------------------------------------------------------------------------------------------------
# producer warp
# --------------------------------------------------------------------------------------------------
@gluon.jit
def _load_kv(desc, smem, ready, empty, g, row, bh, STAGES: gl.constexpr):
    slot = g % STAGES
    mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)
    bar = ready.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [bh, row, 0], bar,
                                    smem.index(slot).reshape([1, desc.block_type.shape[1], desc.block_type.shape[2]]))


@gluon.jit
def producer_partition(ctx: AttnCtx):
    BLOCK_M: gl.constexpr = ctx.BLOCK_M
    BLOCK_N: gl.constexpr = ctx.BLOCK_N
    HEAD_DIM: gl.constexpr = ctx.HEAD_DIM
    g0 = 0
    tile_i = 0
    for t in range(gl.program_id(0), ctx.n_tiles, gl.num_programs(0)):
        bh, m0, n_blocks, n_masked = _tile_info(ctx, t)
        for it in range(n_blocks):
            kb = n_blocks - 1 - it
            _load_kv(ctx.k_desc, ctx.k_smem, ctx.k_ready, ctx.k_empty, g0 + it, kb * BLOCK_N, bh, ctx.STAGES)
            if it == 0:
                # Q after the first K: the previous tile's consumers release Q only after their last S GEMM
                for w in gl.static_range(ctx.NUM_WG):
                    mbarrier.wait(ctx.q_empty.index(w), (tile_i & 1) ^ 1)
                    bar = ctx.q_ready.index(w)
                    mbarrier.expect(bar, ctx.q_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(ctx.q_desc, [bh, m0 + w * BLOCK_M, 0], bar,
                                                    ctx.q_smem.index(w).reshape([1, BLOCK_M, HEAD_DIM]))
            _load_kv(ctx.v_desc, ctx.v_smem, ctx.v_ready, ctx.v_empty, g0 + it, kb * BLOCK_N, bh, ctx.STAGES)
        g0 += n_blocks
        tile_i += 1


@gluon.jit(do_not_specialize=["Lq", "Lkv", "BH", "HG"])
def attn_fwd_sm90_kernel(q_desc, k_desc, v_desc, o_desc, lse_ptr, Lq, Lkv, BH, HG, qk_scale,  #
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,  #
                         NUM_WG: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,  #
                         PINGPONG: gl.constexpr, FENCE: gl.constexpr, RESCALE_EARLY: gl.constexpr,  #
                         CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    gl.static_assert(NUM_WG == 2 or NUM_WG == 3, "two or three consumer warpgroups")
    dtype: gl.constexpr = q_desc.dtype
    n_m = gl.cdiv(Lq, BLOCK_M * NUM_WG)
    n_tiles = n_m * BH

    qo_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_WG, BLOCK_M, HEAD_DIM], qo_layout)
    o_smem = gl.allocate_shared_memory(dtype, [NUM_WG, BLOCK_M, HEAD_DIM], qo_layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    sched = gl.allocate_shared_memory(gl.int64, [NUM_WG, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_WG):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_WG)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=NUM_WG)
    for i in gl.static_range(NUM_WG):
        mbarrier.init(sched.index(i), count=1)

    ctx = AttnCtx(q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  k_empty, v_ready, v_empty, sched, Lq, Lkv, n_m, n_tiles, BH, HG, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM,
                  NUM_WG, STAGES, CAUSAL, PINGPONG, FENCE, RESCALE_EARLY)
    if NUM_WG == 2:
        gl.warp_specialize([
            (consumer_partition, (ctx, 0)),
            (consumer_partition, (ctx, 1)),
            (producer_partition, (ctx, )),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (consumer_partition, (ctx, 0)),
            (consumer_partition, (ctx, 1)),
            (consumer_partition, (ctx, 2)),
            (producer_partition, (ctx, )),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------------
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def default_config(head_dim, causal):
    """BLOCK_M: query rows per consumer warpgroup (2 warpgroups per CTA); smem bytes =
    (2 * NUM_WG * BLOCK_M + 2 * STAGES * BLOCK_N) * D * 2 (Q and O buffers, K and V rings).
    PINGPONG: 0 off, 1 mbarriers, 2 named barriers (bar.sync / bar.arrive).  PERSISTENT: one CTA per SM
    looping over tiles (the next tile's loads overlap the epilogue)."""
    cfg = dict(BLOCK_M=64, BLOCK_N=128, STAGES=2, PINGPONG=1, PERSISTENT=not causal, FENCE=False,
               RESCALE_EARLY=False)
    if head_dim <= 64:
        cfg["STAGES"] = 3
    return cfg


_NUM_SMS = {}


def _num_sms(device):
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def make_args(q, k, v, causal=False, sm_scale=None, out=None, lse=None, **cfg):
    """Builds (grid, args, kwargs, out, lse) of one launch; needs no GPU (used for CPU compiles too)."""
    assert q.dim() == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2] and q.shape[3] == k.shape[3]
    assert q.dtype == k.dtype == v.dtype and q.dtype in _GL_DTYPES
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    B, H, Lq, D = q.shape
    Lkv = k.shape[2]
    assert D in (64, 128) and Lq >= 1 and Lkv >= 1
    c = default_config(D, causal)
    c.update(cfg)
    BLOCK_M, BLOCK_N, STAGES = c["BLOCK_M"], c["BLOCK_N"], c["STAGES"]
    NUM_WG = c.get("NUM_WG", 2)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    gdt = _GL_DTYPES[q.dtype]
    o = torch.empty_like(q) if out is None else out
    if lse is None:
        lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous()
    assert lse.shape == (B, H, Lq) and lse.dtype == torch.float32 and lse.is_contiguous()
    q3, k3, v3, o3 = (t.view(B * H, t.shape[2], D) for t in (q, k, v, o))
    q_lay = gl.NVMMASharedLayout.get_default_for([1, BLOCK_M, D], gdt)
    kv_lay = gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, D], gdt)
    q_desc = TensorDescriptor.from_tensor(q3, [1, BLOCK_M, D], q_lay)
    o_desc = TensorDescriptor.from_tensor(o3, [1, BLOCK_M, D], q_lay)
    k_desc = TensorDescriptor.from_tensor(k3, [1, BLOCK_N, D], kv_lay)
    v_desc = TensorDescriptor.from_tensor(v3, [1, BLOCK_N, D], kv_lay)
    n_tiles = triton.cdiv(Lq, BLOCK_M * NUM_WG) * B * H
    grid = (min(n_tiles, _num_sms(q.device)) if c["PERSISTENT"] else n_tiles, )
    HG = 1
    if causal:  # heads per group: K+V of a group within ~24 MB of L2
        HG = max(1, min(B * H, (24 << 20) // (Lkv * D * q.element_size() * 2)))
    HG = c.get("HG", HG)
    args = (q_desc, k_desc, v_desc, o_desc, lse, Lq, Lkv, B * H, HG, float(sm_scale * LOG2E))
    kwargs = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, NUM_WG=NUM_WG, STAGES=STAGES, CAUSAL=bool(causal),
                  PINGPONG=int(c["PINGPONG"]), FENCE=bool(c["FENCE"]),
                  RESCALE_EARLY=bool(c["RESCALE_EARLY"]), CONSUMER_REGS=c.get("CONSUMER_REGS", 240 if NUM_WG == 2 else 160),
                  PRODUCER_REGS=c.get("PRODUCER_REGS", 24), num_warps=4,
                  # registers at entry for 4 * (NUM_WG + 1) warps; the default partition (consumer 0)
                  # gets what the workers leave: 168*3*128 - (240+24)*128 -> 240, 128*4*128 - (160*2+24)*128 -> 168
                  maxnreg=c.get("maxnreg", 168 if NUM_WG == 2 else 128))
    return grid, args, kwargs, o, lse


def attention(q, k, v, causal=False, sm_scale=None, out=None, lse=None, **cfg):
    """q, k, v: (B, H, L, D) bf16/fp16 contiguous (same B, H, D; Lq may differ from Lkv).
    Returns (out (B, H, Lq, D), lse (B, H, Lq) float32, natural log).  `out`/`lse` may be passed in
    (written in place); cfg overrides default_config (BLOCK_N, STAGES, PINGPONG, CONSUMER_REGS, ...)."""
    grid, args, kwargs, o, lse = make_args(q, k, v, causal, sm_scale, out, lse, **cfg)
    attn_fwd_sm90_kernel[grid](*args, **kwargs)
    return o, lse
