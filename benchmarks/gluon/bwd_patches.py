"""Text patches of the rendered Gluon backward (templates/sm90/attn_bwd.py.jinja) that
gluon_bwd_probe.py times: each switches a part of the schedule off or tries another one. Kept
apart from the probe so that tests/test_gluon_tier.py can check every patch still applies (each
old text occurs exactly once in the rendered full and causal kernels). Patches measured and not
taken whose text the template no longer has were dropped (2026-11-28, the K/V tile loop): named-dq,
dq-next, s-ahead, dq-alt, one-ready, rows-ahead, delta-ahead, ds-split, sync-expect; NOTES.md keeps
their figures, git history their text."""

_CHUNK = "    chunk = max(1, sms // n_kv)  # pairs of a chunk: about one wave of tiles (see _program)\n"

# name -> [(old text, new text)] applied to the rendered source (the probe joins names with +)
PATCHES = {
    "base": [],
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
    "no-dq-mma": [("""    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem.slice(WG * DQ_N, DQ_N, dim=1),  # columns DQ_N WG + [0, DQ_N)
                           gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
""", "    dq_tok = gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout)\n")],
    # FA4's order: dQ's product before dK's, and dQ stored for the producer while dK's runs
    "dq-first": [
        ("""    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)
    # dQ needs both warp groups' dS^T: this one's is written, wait for the other's
""", ""),
        ("""    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))
""", """    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)
    dv, dq, pT_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dq_tok, pT_op))
"""),
        ("""    mbarrier.arrive(p.dq_bars.index(WG), count=1)
    return dk, dv
""", """    mbarrier.arrive(p.dq_bars.index(WG), count=1)
    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))
    return dk, dv
""")],
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
    # a program per K/V tile, or a program per SM drawing its tiles (the launcher's DYNAMIC_KV)
    "per-tile": [("DYNAMIC_KV = ", "DYNAMIC_KV = 0  # ")],
    "drawn": [("DYNAMIC_KV = ", "DYNAMIC_KV = 1 << 40  # ")],
}

_DV_ISSUE = "    dv_tok = warpgroup_mma(pT_op, do_smem, dv, is_async=True)\n"
_DP_WAIT = "    dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dp_tok, ))"
_DK_ISSUE = "    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)\n"
_WAIT_ALL = "    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))\n"
_RETURN = "    mbarrier.arrive(p.dq_bars.index(WG), count=1)\n    return dk, dv\n"
# dV's product issued after dS^T is stored (with dK's), so dP^T's wait is the only one in the softmax
PATCHES["dv-late"] = [(_DV_ISSUE, ""), (_DP_WAIT, _DP_WAIT.replace("=1", "=0")), (_DK_ISSUE, _DV_ISSUE + _DK_ISSUE)]
# FA4's sm90 order: dS^T stored, dV issued, both warp groups meet, dQ issued, dK issued once dV is
# in, dQ stored while dK runs
PATCHES["fa4-order"] = [
    (_DV_ISSUE, ""), (_DP_WAIT, _DP_WAIT.replace("=1", "=0")), (_DK_ISSUE, _DV_ISSUE),
    (_WAIT_ALL, "    dv, pT_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, pT_op))\n" + _DK_ISSUE
     + "    dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq_tok, ))\n"),
    (_RETURN, "    mbarrier.arrive(p.dq_bars.index(WG), count=1)\n"
     "    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))\n    return dk, dv\n")]
# the two warp groups meet over dS^T at a hardware named barrier (bar.sync 8, 256: one instruction)
# instead of an mbarrier (Gluon's arrive is a warp-group bar.sync, a fence and an elected arrive,
# then a try-wait loop)
PATCHES["named-ds"] = [("""    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
""", """    gl.inline_asm_elementwise("bar.sync 8, 256;\\n\\tmov.u32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)
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


# Each warp group computes its dQ part over its own keys only (dS_w K_w: all of the head dim), so
# the warp groups never meet over dS^T and drift apart as the forward's ping-pong does; both add
# both halves of the step's dQ (twice the reduce-adds). dS^T needs one buffer (no other reader),
# dQ's shared memory doubles (a warp group's [64, 128] float32).
_OWN_MEET = """    # dQ needs both warp groups' dS^T: this one's is written, wait for the other's
    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem.slice(WG * DQ_N, DQ_N, dim=1),  # columns DQ_N WG + [0, DQ_N)
                           gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))
"""
_OWN_DQ = """    fence_async_shared()
    gl.thread_barrier()  # the warp group's dS^T rows are written
    dq_tok = warpgroup_mma(ds_smem.slice(WG * BLOCK_N, BLOCK_N).permute((1, 0)), k_rows,
                           gl.zeros([BLOCK_M, p.HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))
"""
_OWN_DQ_LATE = """    fence_async_shared()
    gl.thread_barrier()  # the warp group's dS^T rows are written
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
    dq_tok = warpgroup_mma(ds_smem.slice(WG * BLOCK_N, BLOCK_N).permute((1, 0)), k_rows,
                           gl.zeros([BLOCK_M, p.HEAD_DIM], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
"""
_OWN_COMMON = [
    ("    ds_smem = p.ds_smem.index(j % 2)\n", "    ds_smem = p.ds_smem.index(0)\n"),
    ("    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, DQ_N // 8, 4, 2])",
     "    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, p.HEAD_DIM // 8, 4, 2])"),
    ("    dq = gl.reshape(gl.permute(dq, [3, 0, 2, 4, 1, 5]), [DQ_N // 4, 256])",
     "    dq = gl.reshape(gl.permute(dq, [3, 0, 2, 4, 1, 5]), [p.HEAD_DIM // 4, 256])"),
    ("instr_shape=[16, BLOCK_M * HEAD_DIM // 128, 16])", "instr_shape=[16, HEAD_DIM, 16])"),
    ("        _tma_add(p.dq_desc, [(block + wg) * (DQ_N // 4), 0], p.dq_smem.index(wg))\n",
     "        _tma_add(p.dq_desc, [block * (DQ_N // 4), 0], p.dq_smem.index(wg).slice(0, DQ_N // 4))\n"
     "        _tma_add(p.dq_desc, [(block + 1) * (DQ_N // 4), 0], p.dq_smem.index(wg).slice(DQ_N // 4, DQ_N // 4))\n"),
    ("gl.allocate_shared_memory(dtype, [2, 2 * BLOCK_N, BLOCK_M], ds_layout)",
     "gl.allocate_shared_memory(dtype, [1, 2 * BLOCK_N, BLOCK_M], ds_layout)"),
    ("gl.allocate_shared_memory(gl.float32, [2, BLOCK_M * HEAD_DIM // 512, 256], dq_layout)",
     "gl.allocate_shared_memory(gl.float32, [2, BLOCK_M * HEAD_DIM // 256, 256], dq_layout)"),
]
PATCHES["own-dq"] = [(_OWN_MEET, _OWN_DQ)] + _OWN_COMMON  # ptxas serialises every wgmma (a wait after each)
PATCHES["own-dq-late"] = [(_OWN_MEET, _OWN_DQ_LATE)] + _OWN_COMMON
# head dim 64 (query tiles of 128, the warp groups split dQ's rows): its two row halves over the warp
# group's keys, one product each, added into the two row blocks of the tile
PATCHES["own-dq-late-64"] = [("""    # dQ needs both warp groups' dS^T: this one's is written, wait for the other's
    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.slice(WG * 64, 64, dim=1).permute((1, 0)), p.k_smem,  # query rows 64 WG + [0, 64)
                           gl.zeros([64, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))
""", """    fence_async_shared()
    gl.thread_barrier()  # the warp group's dS^T rows are written
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
    own = ds_smem.slice(WG * BLOCK_N, BLOCK_N)
    dq0_tok = warpgroup_mma(own.slice(0, 64, dim=1).permute((1, 0)), k_rows,
                            gl.zeros([64, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq1_tok = warpgroup_mma(own.slice(64, 64, dim=1).permute((1, 0)), k_rows,
                            gl.zeros([64, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq0_tok, ))
    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, DQ_N // 8, 4, 2])
    dq = gl.reshape(gl.permute(dq, [3, 0, 2, 4, 1, 5]), [DQ_N // 4, 256])
    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer
    p.dq_smem.index(WG).slice(0, DQ_N // 4).store(dq)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq1_tok, ))
"""), ("""    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer
    p.dq_smem.index(WG).store(dq)
""", """    p.dq_smem.index(WG).slice(DQ_N // 4, DQ_N // 4).store(dq)
""")] + [edit for edit in _OWN_COMMON if "HEAD_DIM // 8" not in edit[0] and "[DQ_N // 4, 256])" not in edit[0]
         and "instr_shape" not in edit[0]]

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
