"""Text patches of the rendered Gluon backward (templates/sm90/attn_bwd.py.jinja) that
gluon_bwd_probe.py times: each switches a part of the schedule off or tries another one. Kept
apart from the probe so that tests/test_gluon_tier.py can check every patch still applies (each
old text occurs exactly once in the rendered full and causal kernels)."""

_CHUNK = "    chunk = max(1, _sm_count(q.device) // n_kv)  # pairs of a chunk: about one wave of programs (see _program)\n"

# K's and V's wgmma descriptors in the step (the template's descs_in_step): the kernels with them
# made in the step, dQ's K hoisted as before the seventeenth session, or dQ's K made in the step at head
# dim 64 (where the warp groups split dQ's rows)
_K_TILE = "    k_tile = p.k_smem.index(j >> 30)\n"
_KV_ROWS = "    k_rows = k_tile.slice(WG * BLOCK_N, BLOCK_N)\n    v_rows = p.v_smem.index(j >> 30).slice(WG * BLOCK_N, BLOCK_N)\n"
_DO = "    do_smem = p.do_smem.index(slot)\n"

# name -> [(old text, new text)] applied to the rendered source (the probe joins names with +)
PATCHES = {
    "base": [],
    "kv-in-step": [(_K_TILE, _K_TILE + _KV_ROWS)],
    "dq-k-hoisted": [("k_tile.slice(WG * DQ_N, DQ_N, dim=1)", "p.k_smem.index(0).slice(WG * DQ_N, DQ_N, dim=1)")],
    "dq-k-in-step-64": [(_DO, _DO + _K_TILE), ("p.k_smem.index(0),  # query rows", "k_tile,  # query rows")],
    "no-dq-add": [("        _tma_add(p.dq_desc, [(block + wg) * (DQ_N // 4), 0], p.dq_smem.index(wg))\n", "")],
    "no-ds-sync": [("    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)\n", "")],
    "stages-3": [("STAGES=2", "STAGES=3")],
    # the masked steps run without their mask code (timing only: what the mask costs a step)
    "mask-off": [("                       s_layout, op_layout, dq_layout, True", "                       s_layout, op_layout, dq_layout, False")],
    # every K/V tile starts its whole query tiles at the first one
    "no-rotation": [("    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0)", "    return full_lo * 0")],
    # what parts of the step cost (timing only): the exponential, the dK and the dQ products
    "no-exp2": [("        pT = gl.exp2(sT)  # sT is the exponent already\n", "        pT = sT\n")],
    "no-dk-mma": [("    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)\n", "    dk_tok = dk\n")],
    "no-dq-mma": [("""    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), k_tile.slice(WG * DQ_N, DQ_N, dim=1),  # columns DQ_N WG + [0, DQ_N)
                           gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
""", "    dq_tok = gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout)\n")],
    # the masked steps' dP^T starts from -Delta too, as the whole tiles' (before the C7517 fix)
    "dp-fold-masked": [("    if MASKED:  # Delta is subtracted below", "    if False:  # Delta is subtracted below"),
                       ("    if MASKED:\n        dpT = dpT - ", "    if False:\n        dpT = dpT - ")],
    # dS^T from P^T as rounded for the dV product (the input dtype), not from float32: 32 registers
    # fewer through the dP^T wait, dS^T's rounding error about sqrt(2) times (compiled: more spills)
    "p-lowp": [("    pT_op = gl.convert_layout(pT.to(p.q_desc.dtype), op_layout)\n",
                "    pT_lp = pT.to(p.q_desc.dtype)\n    pT_op = gl.convert_layout(pT_lp, op_layout)\n"),
               ("    dsT = pT * dpT  # dS' = P * (dP - Delta)\n",
                "    pT = pT_lp.to(gl.float32)\n    dsT = pT * dpT  # dS' = P * (dP - Delta)\n")],
    # the grid's order (_program): chunks of one (batch, K/V head) pair (head major), of four, of all
    # of them (K/V tile major), instead of about one wave of programs per chunk
    "chunk1": [(_CHUNK, "    chunk = 1\n")],
    "chunk4": [(_CHUNK, "    chunk = 4\n")],
    "kv-major": [(_CHUNK, "    chunk = B * H // heads\n")],
    # GQA: the query heads of a K/V head in one program (dK, dV summed in registers), or one per program
    "heads-together": [("SPLIT_HEADS_FROM = ", "SPLIT_HEADS_FROM = 1 << 40  # ")],
    "heads-split": [("SPLIT_HEADS_FROM = ", "SPLIT_HEADS_FROM = 0  # ")],
    # dK and dV computed and staged but not stored (their stores predicated off; timing only): what the writes cost
    "no-dkv-store": [("                 k_rows.load(out), mask=ok)\n", "                 k_rows.load(out), mask=ok & (p.N_CTX_KV < 0))\n"),
                     ("                 v_rows.load(out), mask=ok)\n", "                 v_rows.load(out), mask=ok & (p.N_CTX_KV < 0))\n")],
    # dK, dV stored from the accumulators' registers (32-bit stores of value pairs across 8 rows), as
    # before they went through K's and V's buffers (7436af1)
    "dkv-regs": [("""        mbarrier.arrive(p.kv_done.index(0), count=1)
        mbarrier.wait(p.kv_done.index(0), 0)
        k_rows.store((dk * p.sm_scale).to(p.q_desc.dtype))
        v_rows.store(dv.to(p.q_desc.dtype))
        out: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [4, 1], [1, 0])
        rows = gl.expand_dims(row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, out)), 1)
        cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out)), 0)
        ok = rows < p.N_CTX_KV
        gl.store(DK + b.to(gl.int64) * stride_dkb + h_kv * stride_dkh + rows * stride_dkn + cols * stride_dkd,
                 k_rows.load(out), mask=ok)
        gl.store(DV + b.to(gl.int64) * stride_dvb + h_kv * stride_dvh + rows * stride_dvn + cols * stride_dvd,
                 v_rows.load(out), mask=ok)
""", """        rows = gl.expand_dims(row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout)), 1)
        cols = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout)), 0)
        ok = rows < p.N_CTX_KV
        gl.store(DK + b.to(gl.int64) * stride_dkb + h_kv * stride_dkh + rows * stride_dkn + cols * stride_dkd,
                 (dk * p.sm_scale).to(DK.dtype.element_ty), mask=ok)
        gl.store(DV + b.to(gl.int64) * stride_dvb + h_kv * stride_dvh + rows * stride_dvn + cols * stride_dvd,
                 dv.to(DV.dtype.element_ty), mask=ok)
""")],
    # GQA's float32 sums (a program per query head): dK, then dV staged as float32 rows in this warp group's
    # buffer (K's for warp group 0, V's for 1; 32 KB each) once both are done with K and V, then added 16
    # bytes at a time (red.global.add.v4.f32) instead of a float at a time from the accumulators' registers
    "gqa-stage": [("""        # one query head of several: added into float32 buffers (zeroed by the launcher), rounded after
        gl.atomic_add(dk_ptrs, dk * p.sm_scale, mask=ok, sem="relaxed")  # sums: no ordering wanted
        gl.atomic_add(dv_ptrs, dv, mask=ok, sem="relaxed")
""", """        mbarrier.arrive(p.kv_done.index(0), count=1)
        mbarrier.wait(p.kv_done.index(0), 0)
        stage = (p.k_smem if WG == 0 else p.v_smem).index(0)._reinterpret(gl.float32, [BLOCK_N, HEAD_DIM],
                                                                gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        vec: gl.constexpr = gl.BlockedLayout([1, 4], [128 // HEAD_DIM, HEAD_DIM // 4], [4, 1], [1, 0])
        rows4 = gl.expand_dims(row0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, vec)), 1)
        cols4 = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, vec)), 0)
        ok4 = rows4 < p.N_CTX_KV
        stage.store(dk * p.sm_scale)
        gl.atomic_add(DK + b.to(gl.int64) * stride_dkb + h_kv * stride_dkh + rows4 * stride_dkn + cols4 * stride_dkd,
                      stage.load(vec), mask=ok4, sem="relaxed")
        stage.store(dv)
        gl.atomic_add(DV + b.to(gl.int64) * stride_dvb + h_kv * stride_dvh + rows4 * stride_dvn + cols4 * stride_dvd,
                      stage.load(vec), mask=ok4, sem="relaxed")
""")],
}

# the two warp groups meet over dS^T at a hardware named barrier (bar.sync 12, 256: one instruction;
# named-dq takes ids 8-11 of 160 threads, and one id with two thread counts is an illegal instruction)
# instead of an mbarrier (Gluon's arrive is a warp-group bar.sync, a fence and an elected arrive,
# then a try-wait loop)
PATCHES["named-ds"] = [("""    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
""", """    gl.inline_asm_elementwise("bar.sync 12, 256;\\n\\tmov.u32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)
""")]

# dQ leaves the step unscaled and attn_bwd_dq multiplies by sm_scale when it rounds dq: 32 FMULs per
# step and thread fewer in the window where both warp groups have waited for their products and
# the tensor cores idle (ncu, full 4x16x4096x128 on an H100: tensor pipe 64.7 % busy against FA4's
# 74.5 %; SASS of the unmasked loop: 474 instructions per step, 96 of them FMUL)
PATCHES["dq-scale-late"] = [
    ("    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, DQ_N // 8, 4, 2])", "    dq = gl.reshape(dq, [4, 2, 8, DQ_N // 8, 4, 2])"),
    ("def attn_bwd_dq(DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, H, N_CTX_Q,",
     "def attn_bwd_dq(DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, H, N_CTX_Q, sm_scale,"),
    ("    gl.store(ptrs, dq.to(DQ.dtype.element_ty),", "    gl.store(ptrs, (dq * sm_scale).to(DQ.dtype.element_ty),"),
    ("    attn_bwd_dq[(n_q, B * H)](dq_acc, dq, *dq.stride(), H, N_CTX_Q, BLOCK_M=",
     "    attn_bwd_dq[(n_q, B * H)](dq_acc, dq, *dq.stride(), H, N_CTX_Q, sm_scale, BLOCK_M="),
]


def _bar(op, ids, arg, indent, cond=None):
    """Inline asm of bar.sync / bar.arrive on a named barrier of 160 threads (a consumer warp group
    and the producer warp), its id ids[0] or, under `if cond == 0` / else, ids[1]."""
    asm = lambda i: f'{indent}gl.inline_asm_elementwise("bar.{op} {i}, 160;\\n\\tmov.u32 $0, 0;", "=r,r", [{arg}], dtype=gl.int32, is_pure=False, pack=1)\n'  # noqa: E731,E501
    if cond is None:
        return asm(ids[0])
    return f"{indent}if {cond} == 0:\n    {asm(ids[0])}{indent}else:\n    {asm(ids[1])}"


# FA3/FA4's dQ handover: hardware named barriers between a consumer warp group and the producer warp
# (bar.arrive by the 128 consumer threads after their stores and fence, bar.sync by the producer;
# the other way once the add has read the buffer) instead of the dq_bars mbarriers, whose Gluon
# arrive is a warp-group BAR.SYNC, an elected arrive and another BAR.SYNC (four per step in the SASS)
PATCHES["named-dq"] = [
    ("""    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer
    p.dq_smem.index(WG).store(dq)
    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))
    # handed over once dK's product has read Q: the producer refills the slot once the adds are issued.
    # (The fence before this wait instead of after it crashed ptxas 12.8 (triton 3.6), error -11)
    fence_async_shared()
    mbarrier.arrive(p.dq_bars.index(WG), count=1)
""", _bar("sync", (10, 11), "j", "    ", "WG") + """    p.dq_smem.index(WG).store(dq)
    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))
    fence_async_shared()
""" + _bar("arrive", (8, 9), "j", "    ", "WG")),
    ("""        mbarrier.wait(p.dq_bars.index(wg), i & 1)
""", _bar("sync", (8, 9), "i", "        ", "wg")),
    ("""    tma.store_wait(pendings=0)
    for wg in gl.static_range(2):
        mbarrier.arrive(p.dq_bars.index(2 + wg), count=1)
""", """    tma.store_wait(pendings=0)
""" + _bar("arrive", (10,), "i", "    ") + _bar("arrive", (11,), "i", "    ")),
    ("""    q_box: gl.constexpr = [1, 1, BLOCK_M, p.HEAD_DIM]
    for j in range(n_blocks * HEADS):
""", """    q_box: gl.constexpr = [1, 1, BLOCK_M, p.HEAD_DIM]
""" + _bar("arrive", (10,), "b", "    ") + _bar("arrive", (11,), "b", "    ") + """    for j in range(n_blocks * HEADS):
"""),
]

# FA4's P^T: S^T from zero and exp2(S^T * scale - lse2) (an FFMA each) instead of S^T started from
# -lse2 / scale and scaled after (16 FFMA, 16 MOV and 32 FMUL a step). ncu, causal 4x16x4096x128
# (H100): attncc executes 70.8 M FP32 instructions (8.7 M fused) where FA4 executes 53.0 M (17.3 M
# fused), 13 % more instructions in all. `-early` reads lse2 right after S^T is issued, as FA4 does.
PATCHES["no-fold"] = [("FOLD_LSE=fold_lse,", "FOLD_LSE=False,")]
PATCHES["no-fold-early"] = PATCHES["no-fold"] + [
    ("    s_tok = warpgroup_mma(k_rows, q_smem.permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)\n",
     "    s_tok = warpgroup_mma(k_rows, q_smem.permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)\n"
     "    lse2_early = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))\n"),
    ("""    else:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        pT = gl.exp2(sT - gl.expand_dims(lse2, 0))""", """    else:
        pT = gl.exp2(sT - gl.expand_dims(lse2_early, 0))"""),
]

# One `ready` barrier a slot for Q, dO and their row statistics (three arrivals: the TMA's expect
# of both tiles, lse's and Delta's stores) instead of two: a wait fewer a step, and with it a
# warp-group bar.sync fewer (Gluon 3.6 puts one before every mbarrier wait and arrive:
# benchmarks/gluon/arrive_sync.py); dP^T issues right behind S^T.
PATCHES["one-ready"] = [
    ("        mbarrier.init(q_ready.index(i), count=2)  # the TMA's expect and the row statistics' arrive\n",
     "        mbarrier.init(q_ready.index(i), count=3)  # the TMA's expect and both row statistics' arrives\n"),
    ("        mbarrier.expect(bar, p.q_desc.block_type.nbytes)\n",
     "        mbarrier.expect(bar, p.q_desc.block_type.nbytes + p.do_desc.block_type.nbytes)\n"),
    ("        bar = p.do_ready.index(slot)\n        mbarrier.expect(bar, p.do_desc.block_type.nbytes)\n", ""),
    ("    mbarrier.wait(p.do_ready.index(slot), phase)\n", ""),
]

# The whole tiles' dP^T from zero with Delta subtracted after its wait, as the masked steps do:
# ncu's stall sampling (full 4x16x4096x128, H100) put 11 % of a consumer loop's samples on the
# FADDs that start dP^T from -Delta, waiting for Delta's LDS (short scoreboard: shared memory busy
# with the other warp group's operand reads) while no product of the step is issued yet, and 4.6 %
# on the FFMAs that start S^T from -lse2. With `-s`, S^T too (lse2 read after S^T is issued).
PATCHES["dp-late"] = [
    ("    if MASKED:  # Delta is subtracted below", "    if True:  # Delta is subtracted below"),
    ("    if MASKED:\n        dpT = dpT - gl.expand_dims(p.delta_smem", "    if True:\n        dpT = dpT - gl.expand_dims(p.delta_smem"),
]
PATCHES["dp-late-s"] = PATCHES["dp-late"] + PATCHES["no-fold-early"]

# Each warp group arrives on a dS^T barrier of its own and waits on the other's: Triton's membar puts
# a warp-group BAR.SYNC between an arrive and a wait, which the meeting had right after the arrive's
# own sync. Alone this leaves the step's four BAR.SYNC (membar syncs behind any arrive); with the
# expect below, three
PATCHES["ds-split"] = [
    ("    ds_ready: gl.shared_memory_descriptor  # per dS buffer: both consumers wrote their dS^T\n",
     "    ds_ready: gl.shared_memory_descriptor  # per dS buffer: both consumers wrote their dS^T\n"
     "    ds_ready1: gl.shared_memory_descriptor\n"),
    ("kv_ready, kv_done, q_ready, do_ready, ds_ready, dq_smem, dq_bars,",
     "kv_ready, kv_done, q_ready, do_ready, ds_ready, ds_ready1, dq_smem, dq_bars,"),
    ("        self.ds_ready = ds_ready\n", "        self.ds_ready = ds_ready\n        self.ds_ready1 = ds_ready1\n"),
    ("    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)\n",
     "    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)\n"
     "    ds_ready1 = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)\n"),
    ("        mbarrier.init(ds_ready.index(i), count=2)\n",
     "        mbarrier.init(ds_ready.index(i), count=1)\n        mbarrier.init(ds_ready1.index(i), count=1)\n"),
    ("                 kv_ready, kv_done, q_ready, do_ready, ds_ready,\n",
     "                 kv_ready, kv_done, q_ready, do_ready, ds_ready, ds_ready1,\n"),
    ("""    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
""", """    if WG == 0:
        mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
        mbarrier.wait(p.ds_ready1.index(j % 2), (j // 2) & 1)
    else:
        mbarrier.arrive(p.ds_ready1.index(j % 2), count=1)
        mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
"""),
]
# ... and the arrive as an explicit warp-group barrier (the stores and fence of all its threads are
# in) and an expect of 0 bytes, which membar does not count as a write to wait behind
PATCHES["ds-split-expect"] = PATCHES["ds-split"][:-1] + [(PATCHES["ds-split"][-1][0], """    _cta_barrier()
    if WG == 0:
        mbarrier.expect(p.ds_ready.index(j % 2), 0)
        mbarrier.wait(p.ds_ready1.index(j % 2), (j // 2) & 1)
    else:
        mbarrier.expect(p.ds_ready1.index(j % 2), 0)
        mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
""")]
# ... and the dQ hand-over the same way: no arrive left in the step for membar to sync behind (two
# BAR.SYNC a step, the two the stores need). H100, five rounds, ms base / ds-split-expect /
# sync-expect: full 4x16x4096x128 2.632 / 2.660 / 2.628, causal 1.496 / 1.507 / 1.508, full 16k 9.485
# / 9.805 / 9.726, causal 16k 4.989 / 4.982 / 5.009; head dim 64 full 4k 2.921 / 3.073 / 2.971, causal
# 1.736 / 1.726 / 1.768, full 16k 11.007 / 11.304 / 11.310, causal 16k 5.938 / 5.884 / 5.983: no gain
PATCHES["sync-expect"] = PATCHES["ds-split-expect"] + [
    ("    fence_async_shared()\n    mbarrier.arrive(p.dq_bars.index(WG), count=1)\n",
     "    fence_async_shared()\n    _cta_barrier()\n    mbarrier.expect(p.dq_bars.index(WG), 0)\n")]

# The producer's row statistics by cp.async with an mbarrier arrive on completion (each of the warp's
# 32 lanes arrives, .noinc: the slot barriers count 1 + 32) instead of a load the producer waits for
# before it issues the next TMA. Timing only: masked lanes leave the slot's old values where the load
# wrote 0. H200: 0.5-2 % slower (benchmarks/gluon/NOTES.md, tenth session)
PATCHES["rows-async"] = [
    ("""    smem.store(gl.load(ptr + rows, mask=rows < n_rows, other=0.0))
    mbarrier.arrive(bar, count=1)
""", """    async_copy.async_copy_global_to_shared(smem, ptr + rows, mask=rows < n_rows)
    async_copy.mbarrier_arrive(bar, increment_count=False)
"""),
    ("        mbarrier.init(q_ready.index(i), count=2)", "        mbarrier.init(q_ready.index(i), count=33)"),
    ("        mbarrier.init(do_ready.index(i), count=2)", "        mbarrier.init(do_ready.index(i), count=33)"),
    ("from triton.experimental.gluon.nvidia.hopper import TensorDescriptor\n",
     "from triton.experimental.gluon.nvidia.hopper import TensorDescriptor\n"
     "from triton.experimental.gluon.language.nvidia.ampere import async_copy\n"),
]

# the unmasked steps two a loop turn with the ring slot a constexpr (0, then 1; STAGES 2): Q's, dO's, the row
# statistics' and dS^T's buffers at offsets known when compiled, so the products' descriptors need no
# vector arithmetic and R2UR (ncu, full 4x16x4096x128: 45 R2UR a step); an odd first step before the
# pairs and an odd last one after them. Compiled (sm90, triton 3.6, full at head dim 128): stack 96 -> 504 bytes,
# 1189 instructions a pair of steps with 74 LDL (457 a step, 2 LDL, before): the constant descriptors are
# hoisted out of the loop into registers, which the step needs. Not timed
_UNMASKED = """    for j in range(n_masked * HEADS, n_blocks * HEADS):  # query tiles the K/V tile keeps in full: no mask code
        m0 = _q_block(j // HEADS, full_lo, full_hi, hi, n_hi, n_masked, rot) * BLOCK_M
        dk, dv = _step(p, WG, j, m0, b, h0 + j % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, False)
"""
_PAIR_STEP = """        m0 = _q_block({j} // HEADS, full_lo, full_hi, hi, n_hi, n_masked, rot) * BLOCK_M
        dk, dv = _step(p, WG, {j}, m0, b, h0 + {j} % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, False, {slot})
"""
PATCHES["pair-slots"] = [
    ("dq_layout: gl.constexpr, MASKED: gl.constexpr):", "dq_layout: gl.constexpr, MASKED: gl.constexpr, SLOT: gl.constexpr = -1):"),
    ("    slot = j % p.STAGES\n    phase = (j // p.STAGES) & 1\n",
     "    if SLOT >= 0:\n        slot: gl.constexpr = SLOT\n    else:\n        slot = j % p.STAGES\n    phase = (j // p.STAGES) & 1\n"),
    ("    ds_smem = p.ds_smem.index(j % 2)\n", "    ds_smem = p.ds_smem.index(slot)\n"),
    ("""    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
""", """    mbarrier.arrive(p.ds_ready.index(slot), count=1)
    mbarrier.wait(p.ds_ready.index(slot), (j // 2) & 1)
"""),
    (_UNMASKED, "    j0 = n_masked * HEADS\n    j1 = n_blocks * HEADS\n    if (j0 % 2 == 1) & (j0 < j1):\n"
     + _PAIR_STEP.format(j="j0", slot=1) + "        j0 += 1\n    for j in range(j0, j1 - 1, 2):\n"
     + _PAIR_STEP.format(j="j", slot=0) + _PAIR_STEP.format(j="(j + 1)", slot=1)
     + "    if (j1 - j0) % 2 == 1:\n" + _PAIR_STEP.format(j="(j1 - 1)", slot=0)),
]

# S^T = K Q^T with K from registers (an RS product, loaded once a program), dP^T = V dO^T likewise with
# `kv-regs`: 16 KB of shared-memory reads a step and warp group fewer each (at head dim 128 the step moves
# about 368 KB, benchmarks/gluon/NOTES.md), for 32 registers each at head dim 128 (16 at 64). H200, three
# rounds in turn, ms base / k-regs / kv-regs: full 4x16x4096x128 2.621 / 3.073 / 3.835, causal 1.407 / 1.674 /
# 2.040, full 1x16x16384x128 9.992 / 11.543 / 14.707; head dim 64 full 4x32x4096 2.979 / 5.438 / 3.369, causal
# 1.614 / 1.803 / 1.807 (SASS: unmasked step 457 -> 488 / 489 instructions at 128, 2 -> 10 / 28 LDL)
_K_OP = "    k_op = k_rows.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))\n"
_V_OP = "    v_op = v_rows.load(gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2))\n"
_KV_WAIT = "    mbarrier.wait(p.kv_ready.index(0), 0)\n    for j in range(0, n_masked * HEADS):"
_CALL = "% HEADS, dk, dv, kv_idx, k_rows, v_rows,\n                       s_layout, op_layout, dq_layout, {})"
PATCHES["k-regs"] = [(_KV_WAIT, _KV_WAIT.replace("    for j", _K_OP + "    for j"))] + [
    (_CALL.format(m), _CALL.format(m).replace("k_rows", "k_op")) for m in ("True", "False")]
PATCHES["kv-regs"] = [(_KV_WAIT, _KV_WAIT.replace("    for j", _K_OP + _V_OP + "    for j"))] + [
    (_CALL.format(m), _CALL.format(m).replace("k_rows, v_rows", "k_op, v_op")) for m in ("True", "False")]

# dQ added from the consumers' registers by vector reductions (REDG.E.ADD.F32x4, 8 a step and thread at
# head dim 128) into dq_acc, in its accumulator order, instead of staged in shared memory for the producer's
# TMA reduce-add: the step's 32 KB of dQ stores and the TMA's 32 KB of reads leave shared memory (of about
# 368 KB a step at head dim 128, where the step is bound by shared memory: benchmarks/gluon/NOTES.md), and
# the consumer no longer waits for the previous step's add. The launcher passes dq_acc itself in place of
# its descriptor (`_dq_accumulator`); the producer still waits for each consumer's hand-over, which frees
# the Q/dO slot. SASS (full, 128): the 8 STS.128 become 8 REDG.E.ADD.F32x4 off one base register, the
# unmasked step 479 -> 517 instructions (the consumer now computes the query tile's index, which the
# base kernel's unmasked step never needs; 10 -> 14 LDL). H200, three rounds in turn, ms base / red-dq,
# 4x16x4096 / 1x16x16384 at 128: full 2.531 / 2.758, 9.662 / 10.664; causal 1.369 / 1.495, 4.810 /
# 5.386; sliding window 0.785 / 0.827, 0.840 / 0.896; 4x32x4096 / 1x32x16384 at 64: full 2.932 / 3.177,
# 11.113 / 12.162; causal 1.580 / 1.745, 5.601 / 6.265; sliding window 0.871 / 0.974, 0.954 / 1.049.
# 5-12 % slower everywhere: the bulk TMA reduce-add from shared memory beats the consumers' reductions
PATCHES["red-dq"] = [
    ("    dq_desc: tma.tensor_descriptor  # float32 dq_acc as rows of 256, boxes of one warp group's block\n",
     "    dq_desc: gl.tensor  # float32 dq_acc as rows of 256 (red-dq: the tensor itself)\n"),
    ("    return dq_acc, TensorDescriptor.from_tensor(dq_acc, ", "    return dq_acc, dq_acc  # "),
    ("""    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer
    p.dq_smem.index(WG).store(dq)
""", """    block = ((b * p.H + h) * gl.cdiv(p.N_CTX_Q, BLOCK_M) + m0 // BLOCK_M) * 2 + WG
    rr = gl.arange(0, DQ_N // 4, layout=gl.SliceLayout(1, dq.type.layout))
    cc = gl.arange(0, 256, layout=gl.SliceLayout(0, dq.type.layout))
    gl.atomic_add(p.dq_desc + block.to(gl.int64) * (DQ_N * 64) + gl.expand_dims(rr * 256, 1) + gl.expand_dims(cc, 0), dq,
                  sem="relaxed")
"""),
    ("""        mbarrier.wait(p.dq_bars.index(wg), i & 1)
        _tma_add(p.dq_desc, [(block + wg) * (DQ_N // 4), 0], p.dq_smem.index(wg))
    tma.store_wait(pendings=0)
    for wg in gl.static_range(2):
        mbarrier.arrive(p.dq_bars.index(2 + wg), count=1)
""", """        mbarrier.wait(p.dq_bars.index(wg), i & 1)
"""),
]

# The rotation within a window of W query tiles (`rot-W`): a K/V tile of 128 keys starts 2 query tiles
# of 64 after the one before it (one of 128 at head dim 64), modulo W, so the K/V tiles of a head
# start at W / 2 places (W at 64) instead of one each (32 K/V tiles a head at 4096 keys, 128 at
# 16384), and at any time the head's programs read the W Q, dO and dQ tiles of a window instead of
# all of them. ncu, full 4x16x4096x128 on an H200 (eighteenth session): the main kernel misses L2 for
# 18.3 M sectors against FA4's 12.7 M (DRAM 528 / 323 MB read / written against 415 / 255), the extra
# being lines evicted between the head's programs' visits; `no-rotation` (every K/V tile from the
# first query tile) was 2-3 % slower at 16k (reduce-adds queued on the same addresses). Prepared, not
# timed: l2_model.py gives the windows more DRAM traffic than the full rotation at 4k and 16k, so what
# they could win is fewer reduce-adds queued on one address than without rotation
PATCHES["rot-16"] = [("    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0)", "    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0) % 16")]
PATCHES["rot-32"] = [("    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0)", "    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0) % 32")]

# The control: the kernel as rendered under a second name; its spread against `base` is the probe's noise
PATCHES["same"] = []
