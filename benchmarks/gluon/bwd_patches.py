"""Text patches of the rendered Gluon backward (templates/sm90/attn_bwd.py.jinja) that
gluon_bwd_probe.py times: each switches a part of the schedule off or tries another one. Kept
apart from the probe so that tests/test_gluon_tier.py can check every patch still applies (each
old text occurs exactly once in the rendered full and causal kernels)."""

_CHUNK = "    chunk = max(1, _sm_count(q.device) // n_kv)  # pairs of a chunk: about one wave of programs (see _program)\n"

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
    # dK and dV computed and staged but not stored (their stores predicated off; timing only): what the writes cost
    "no-dkv-store": [("                 k_rows.load(out), mask=ok)\n", "                 k_rows.load(out), mask=ok & (p.N_CTX_KV < 0))\n"),
                     ("                 v_rows.load(out), mask=ok)\n", "                 v_rows.load(out), mask=ok & (p.N_CTX_KV < 0))\n")],
    # GQA's float32 sums (a program per query head): dK, then dV staged as float32 rows in this warp group's
    # buffer (K's for warp group 0, V's for 1; 32 KB each) once both are done with K and V, then added 16
    # bytes at a time (red.global.add.v4.f32) instead of a float at a time from the accumulators' registers
    "gqa-stage": [("""        # one query head of several: added into float32 buffers (zeroed by the launcher), rounded after
        gl.atomic_add(dk_ptrs, dk * p.sm_scale, mask=ok, sem="relaxed")  # sums: no ordering wanted
        gl.atomic_add(dv_ptrs, dv, mask=ok, sem="relaxed")
""", """        mbarrier.arrive(p.kv_done.index(0), count=1)
        mbarrier.wait(p.kv_done.index(0), 0)
        stage = (p.k_smem if WG == 0 else p.v_smem)._reinterpret(gl.float32, [BLOCK_N, HEAD_DIM],
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
    fence_async_shared()
    mbarrier.arrive(p.dq_bars.index(WG), count=1)
""", _bar("sync", (10, 11), "j", "    ", "WG") + """    p.dq_smem.index(WG).store(dq)
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

# dQ one step late (head dim 128): step j issues step j - 1's dQ product before its own S^T, and
# hands it to the producer while S^T runs; the step then ends waiting only for its dV and dK, so
# the warp-group meeting over dS^T (now at the next step's start) and dQ's store leave the window
# where the tensor cores idle between one step's last product and the next step's first. At j == 0
# the product runs on the unused dS^T buffer and is dropped; the consumer issues the last step's
# after its loops.
_DQ_NEXT_FNS = '''@gluon.jit
def _dq_issue(p: Pipeline, WG: gl.constexpr, j, dq_layout: gl.constexpr):
    """Issue step j - 1's dQ product (nothing waited for at j == 0: its result is dropped)."""
    DQ_N: gl.constexpr = p.BLOCK_M * p.HEAD_DIM // 128
    mbarrier.wait(p.ds_ready.index((j + 1) % 2), ((j + 1) // 2 + 1) & 1, pred=j > 0)
    return warpgroup_mma(p.ds_smem.index((j + 1) % 2).permute((1, 0)), p.k_smem.slice(WG * DQ_N, DQ_N, dim=1),
                         gl.zeros([p.BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)


@gluon.jit
def _dq_hand(p: Pipeline, WG: gl.constexpr, j, dq):
    """Step j - 1's dQ half to shared memory for the producer's add (not handed over at j == 0)."""
    DQ_N: gl.constexpr = p.BLOCK_M * p.HEAD_DIM // 128
    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, DQ_N // 8, 4, 2])  # (warp, i, t // 4, k, t % 4, j)
    dq = gl.reshape(gl.permute(dq, [3, 0, 2, 4, 1, 5]), [DQ_N // 4, 256])
    mbarrier.wait(p.dq_bars.index(2 + WG), j & 1, pred=j > 0)  # step j - 2's add has read the buffer
    p.dq_smem.index(WG).store(dq)
    fence_async_shared()
    mbarrier.arrive(p.dq_bars.index(WG), count=1, pred=j > 0)


@gluon.jit
def _step('''
_DQ_TAIL = """    # dQ's half goes to shared memory, from which the producer warp adds it into dq_acc by a TMA
    # reduce-add (register atomics cost H100, full 4x16x4096x128: 2.85 -> 3.95 ms, and 4.12 issued
    # by a warp of their own). In the accumulator's own order: thread t holds rows
    # 16 warp + 8 i + t // 4 and columns 8 k + 2 (t % 4) + j, and those go to floats
    # (128 k + t) * 4 + 2 i + j, so nothing moves between threads and every store is 128 bits
    dq = gl.reshape(dq * p.sm_scale, [4, 2, 8, DQ_N // 8, 4, 2])  # (warp, i, t // 4, k, t % 4, j)
    dq = gl.reshape(gl.permute(dq, [3, 0, 2, 4, 1, 5]), [DQ_N // 4, 256])
    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer
    p.dq_smem.index(WG).store(dq)
    fence_async_shared()
    mbarrier.arrive(p.dq_bars.index(WG), count=1)
    return dk, dv
"""
PATCHES["dq-next"] = [
    ("@gluon.jit\ndef _step(", _DQ_NEXT_FNS),
    ("""    mbarrier.wait(p.q_ready.index(slot), phase)
    s_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        s_acc += gl.expand_dims(lse2 * p.lse_to_acc, 0)
    s_tok = warpgroup_mma(k_rows, q_smem.permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)
""", """    dq_tok = _dq_issue(p, WG, j, dq_layout)
    mbarrier.wait(p.q_ready.index(slot), phase)
    s_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        s_acc += gl.expand_dims(lse2 * p.lse_to_acc, 0)
    s_tok = warpgroup_mma(k_rows, q_smem.permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)
    dq = warpgroup_mma_wait(num_outstanding=1, deps=(dq_tok, ))
    _dq_hand(p, WG, j, dq)
"""),
    (_OWN_MEET + _DQ_TAIL, """    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)  # step j + 1 issues this step's dQ
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
    return dk, dv
"""),
    ("""                       s_layout, op_layout, dq_layout, False)

""", """                       s_layout, op_layout, dq_layout, False)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(_dq_issue(p, WG, n_blocks * HEADS, dq_layout), ))
    _dq_hand(p, WG, n_blocks * HEADS, dq)

"""),
]
# head dim 64 (query tiles of 128, dQ split by rows): the same one step late
PATCHES["dq-next-64"] = [
    (PATCHES["dq-next"][0][0], PATCHES["dq-next"][0][1].replace(
        """    return warpgroup_mma(p.ds_smem.index((j + 1) % 2).permute((1, 0)), p.k_smem.slice(WG * DQ_N, DQ_N, dim=1),
                         gl.zeros([p.BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)""",
        """    return warpgroup_mma(p.ds_smem.index((j + 1) % 2).slice(WG * 64, 64, dim=1).permute((1, 0)), p.k_smem,
                         gl.zeros([64, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)""")),
    PATCHES["dq-next"][1],
    (PATCHES["dq-next"][2][0].replace(
        """    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem.slice(WG * DQ_N, DQ_N, dim=1),  # columns DQ_N WG + [0, DQ_N)
                           gl.zeros([BLOCK_M, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)""",
        """    dq_tok = warpgroup_mma(ds_smem.slice(WG * 64, 64, dim=1).permute((1, 0)), p.k_smem,  # query rows 64 WG + [0, 64)
                           gl.zeros([64, DQ_N], gl.float32, dq_layout), use_acc=False, is_async=True)"""),
     PATCHES["dq-next"][2][1]),
    PATCHES["dq-next"][3],
]


def _calls(new_head):
    """Edits of the consumer's two _step calls (the masked loop's and the whole tiles'), each once:
    `dk, dv = _step(p, WG, j, m0,` becomes new_head."""
    return [(f"""        dk, dv = _step(p, WG, j, m0, b, h0 + j % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, {masked})""",
             f"""{new_head} b, h0 + j % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, {masked})""") for masked in ("True", "False")]


# Step j + 1's S^T issued as soon as step j's products are in, before step j's dQ goes to shared
# memory and is handed over: both warp groups, which the dS^T meeting keeps in step, otherwise leave
# the tensor cores idle from that wait to the next step's first product (dQ's scale, its stores,
# the fence and arrive, the next slot's waits and S^T's start from -lse2). Past the last step it
# issues one S^T on a stale slot without waiting for it (drained after the loops).
_S_ISSUE = """    mbarrier.wait(p.q_ready.index(slot), phase)
    s_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        s_acc += gl.expand_dims(lse2 * p.lse_to_acc, 0)
    s_tok = warpgroup_mma(k_rows, q_smem.permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)
"""
_S_AHEAD_FN = '''@gluon.jit
def _issue_s(p: Pipeline, j, n, k_rows, s_layout: gl.constexpr):
    """S^T of step j (of n), issued at the end of step j - 1."""
    slot = j % p.STAGES
    mbarrier.wait(p.q_ready.index(slot), (j // p.STAGES) & 1, pred=j < n)
    s_acc = gl.zeros([p.BLOCK_N, p.BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        s_acc += gl.expand_dims(lse2 * p.lse_to_acc, 0)
    return warpgroup_mma(k_rows, p.q_smem.index(slot).permute((1, 0)), s_acc, use_acc=p.FOLD_LSE, is_async=True)


@gluon.jit
def _step('''
PATCHES["s-ahead"] = [
    ("@gluon.jit\ndef _step(", _S_AHEAD_FN),
    ("def _step(p: Pipeline, WG: gl.constexpr, j, m0,", "def _step(p: Pipeline, WG: gl.constexpr, j, n, s_tok, m0,"),
    (_S_ISSUE, ""),
    (_WAIT_ALL, _WAIT_ALL + "    s_next = _issue_s(p, j + 1, n, k_rows, s_layout)\n"),
    (_RETURN, _RETURN.replace("return dk, dv", "return dk, dv, s_next")),
    ("    mbarrier.wait(p.kv_ready.index(0), 0)\n",
     "    mbarrier.wait(p.kv_ready.index(0), 0)\n    s_tok = _issue_s(p, 0, n_blocks * HEADS, k_rows, s_layout)\n"),
    *_calls("        dk, dv, s_tok = _step(p, WG, j, n_blocks * HEADS, s_tok, m0,"),
    ("\n    h_kv = (h0 // p.GROUP).to(gl.int64)\n",
     "\n    warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))  # the one issued past the last step\n"
     "    h_kv = (h0 // p.GROUP).to(gl.int64)\n"),
]
# ptxas serialises every wgmma of `s-ahead` (a product in flight across the loops' back edges); here
# step j waits for step j + 1's S^T after handing over its dQ, and step j + 1 starts from it
_S_WAITED = "    s_next = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, ))\n"
PATCHES["s-ahead-wait"] = [
    (old, new.replace("    return dk, dv, s_next\n", _S_WAITED + "    return dk, dv, s_next\n").replace(
        "    s_tok = _issue_s(p, 0, n_blocks * HEADS, k_rows, s_layout)\n",
        "    s_tok = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_s(p, 0, n_blocks * HEADS, k_rows, s_layout), ))\n"))
    for old, new in PATCHES["s-ahead"] if "the one issued past" not in new] + [
    ("        qkT, q_idx = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, q_idx))\n", "        qkT = s_tok\n"),
    ("        qkT = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))\n", "        qkT = s_tok\n"),
]

# Each step's whole dQ (64 queries x the head dim, N = 128) by one warp group, warp group j % 2:
# it alone waits for both dS^T; the other goes on to the next step, where it is the one that waits,
# so the two drift half a step apart (one's softmax under the other's dQ product) and the dQ
# product reads 48 KB of shared memory instead of twice 32. Each warp group's dQ buffer holds a
# whole tile (both halves of dq_acc's block pair, adjacent); shared memory 198 -> 230 KB.
# Head dim 128 (dQ split by columns) only.
PATCHES["dq-alt"] = [
    (_OWN_MEET, """    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    if j % 2 != WG:  # the other warp group's turn for this step's dQ
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
        return dk, dv
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem, gl.zeros([BLOCK_M, p.HEAD_DIM], gl.float32, dq_layout),
                           use_acc=False, is_async=True)
    dv, dk, dq, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok, pT_op, dsT_op))
"""),
    ("    DQ_N: gl.constexpr = p.BLOCK_M * p.HEAD_DIM // 128  # columns of this warp group's dQ (64 rows)\n",
     "    DQ_N: gl.constexpr = p.HEAD_DIM  # the whole dQ tile, every other step\n"),
    ("    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)  # the previous step's add has read the buffer\n",
     "    mbarrier.wait(p.dq_bars.index(2 + WG), ((j // 2) & 1) ^ 1)  # its previous add has read the buffer\n"),
    ("    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M * HEAD_DIM // 128, 16])",
     "    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])"),
    ("""    for wg in gl.static_range(2):
        mbarrier.wait(p.dq_bars.index(wg), i & 1)
        _tma_add(p.dq_desc, [(block + wg) * (DQ_N // 4), 0], p.dq_smem.index(wg))
    tma.store_wait(pendings=0)
    for wg in gl.static_range(2):
        mbarrier.arrive(p.dq_bars.index(2 + wg), count=1)
""", """    mbarrier.wait(p.dq_bars.index(i % 2), (i // 2) & 1)
    for half in gl.static_range(2):
        _tma_add(p.dq_desc, [(block + half) * (DQ_N // 4), 0], p.dq_smem.index(i % 2).slice(half * (DQ_N // 4), DQ_N // 4))
    tma.store_wait(pendings=0)
    mbarrier.arrive(p.dq_bars.index(2 + i % 2), count=1)
"""),
    ("gl.allocate_shared_memory(gl.float32, [2, BLOCK_M * HEAD_DIM // 512, 256], dq_layout)",
     "gl.allocate_shared_memory(gl.float32, [2, BLOCK_M * HEAD_DIM // 256, 256], dq_layout)"),
]
# ptxas serialises every wgmma of `dq-alt` (the products issued before the branch on j % 2 are
# waited for inside it); `dq-alt2` makes the turn a constexpr: two steps a loop turn, with a step
# before the loop for an odd start and one after it for an odd count
_DQ_ALT_LOOPS = '''@gluon.jit
def _run(p: Pipeline, WG: gl.constexpr, j, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx, k_rows,
         v_rows, s_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr, MASKED: gl.constexpr,
         DQ: gl.constexpr):
    m0 = _q_block(j // p.HEADS, full_lo, full_hi, hi, n_hi, n_masked, rot) * p.BLOCK_M
    return _step(p, WG, j, m0, b, h0 + j % p.HEADS, dk, dv, kv_idx, k_rows, v_rows, s_layout, op_layout, dq_layout,
                 MASKED, DQ)


@gluon.jit
def _steps(p: Pipeline, WG: gl.constexpr, lo, end, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx,
           k_rows, v_rows, s_layout: gl.constexpr, op_layout: gl.constexpr, dq_layout: gl.constexpr,
           MASKED: gl.constexpr):
    """Steps [lo, end); step j's dQ is warp group j % 2's."""
    lo = end * 0 + lo  # a run-time value (the first call's lo is the constant 0)
    if (lo % 2 == 1) & (lo < end):
        dk, dv = _run(p, WG, lo, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx, k_rows, v_rows,
                      s_layout, op_layout, dq_layout, MASKED, WG == 1)
        lo += 1
    for j in range(lo, end - 1, 2):
        dk, dv = _run(p, WG, j, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx, k_rows, v_rows,
                      s_layout, op_layout, dq_layout, MASKED, WG == 0)
        dk, dv = _run(p, WG, j + 1, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx, k_rows, v_rows,
                      s_layout, op_layout, dq_layout, MASKED, WG == 1)
    if (end - lo) % 2 == 1:
        dk, dv = _run(p, WG, end - 1, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx, k_rows, v_rows,
                      s_layout, op_layout, dq_layout, MASKED, WG == 0)
    return dk, dv


@gluon.jit
def consumer('''
PATCHES["dq-alt2"] = [
    (old, new.replace("""    if j % 2 != WG:  # the other warp group's turn for this step's dQ
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
        return dk, dv
    mbarrier.wait""", """    if not DQ:  # the other warp group's turn for this step's dQ
        dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, pT_op, dsT_op))
        return dk, dv
    mbarrier.wait""")) for old, new in PATCHES["dq-alt"]] + [
    ("dq_layout: gl.constexpr, MASKED: gl.constexpr):\n", "dq_layout: gl.constexpr, MASKED: gl.constexpr, DQ: gl.constexpr):\n"),
    ("@gluon.jit\ndef consumer(", _DQ_ALT_LOOPS),
    ("""    for j in range(0, n_masked * HEADS):  # query tiles the mask cuts (and a ragged last one), with the mask
        m0 = _q_block(j // HEADS, full_lo, full_hi, hi, n_hi, n_masked, rot) * BLOCK_M
        dk, dv = _step(p, WG, j, m0, b, h0 + j % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, True)
    for j in range(n_masked * HEADS, n_blocks * HEADS):  # query tiles the K/V tile keeps in full: no mask code
        m0 = _q_block(j // HEADS, full_lo, full_hi, hi, n_hi, n_masked, rot) * BLOCK_M
        dk, dv = _step(p, WG, j, m0, b, h0 + j % HEADS, dk, dv, kv_idx, k_rows, v_rows,
                       s_layout, op_layout, dq_layout, False)
""", """    dk, dv = _steps(p, WG, 0, n_masked * HEADS, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv, kv_idx,
                    k_rows, v_rows, s_layout, op_layout, dq_layout, True)
    dk, dv = _steps(p, WG, n_masked * HEADS, n_blocks * HEADS, b, h0, full_lo, full_hi, hi, n_hi, n_masked, rot, dk, dv,
                    kv_idx, k_rows, v_rows, s_layout, op_layout, dq_layout, False)
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

# The next step's row statistics read from shared memory at the end of this step (after its
# products are in, under dQ's scale, store and hand-over) and carried into it in registers, so that
# S^T and dP^T start without waiting for an LDS (ncu: 11 % + 4.6 % of a consumer loop's stall
# samples there, `dp-late` above). Past the last step the reads hit a stale slot, not waited for.
# Masked steps, which subtract Delta after dP^T, read it there as before: the carried copy, kept
# through their softmax and mask code, made ptxas spill in their loop.
# H100, five rounds, ms base / patch: full 1x16x16384x128 9.806 / 9.830, causal 4.956 / 4.910,
# sliding window 0.945 / 0.936; head dim 64 full 4x32x4096 2.917 / 3.057, causal 1.695 / 1.678,
# sliding window 1.012 / 1.026, full 16k 11.105 / 11.746, causal 5.934 / 5.869: no gain, not taken
_ROWS_FN = '''@gluon.jit
def _rows(p: Pipeline, j, n, s_layout: gl.constexpr):
    """Step j's (of n) S^T start (-lse2 / (sm_scale log2 e); FOLD_LSE) and Delta, once its slot landed."""
    slot = j % p.STAGES
    mbarrier.wait(p.q_ready.index(slot), (j // p.STAGES) & 1, pred=j < n)
    mbarrier.wait(p.do_ready.index(slot), (j // p.STAGES) & 1, pred=j < n)
    s_start = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * p.lse_to_acc
    return s_start, p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))


@gluon.jit
def _step('''
PATCHES["rows-ahead"] = [
    ("@gluon.jit\ndef _step(", _ROWS_FN),
    ("def _step(p: Pipeline, WG: gl.constexpr, j, m0,", "def _step(p: Pipeline, WG: gl.constexpr, j, n, s_start, delta, m0,"),
    ("""    mbarrier.wait(p.q_ready.index(slot), phase)
    s_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        lse2 = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        s_acc += gl.expand_dims(lse2 * p.lse_to_acc, 0)
""", """    s_acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
    if p.FOLD_LSE:
        s_acc += gl.expand_dims(s_start, 0)
"""),
    ("    mbarrier.wait(p.do_ready.index(slot), phase)\n", ""),
    ("""        delta = p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        dp_acc = gl.zeros""", """        dp_acc = gl.zeros"""),
    (_WAIT_ALL, _WAIT_ALL + "    s_next, delta_next = _rows(p, j + 1, n, s_layout)\n"),
    (_RETURN, _RETURN.replace("return dk, dv", "return dk, dv, s_next, delta_next")),
    ("    mbarrier.wait(p.kv_ready.index(0), 0)\n",
     "    mbarrier.wait(p.kv_ready.index(0), 0)\n    s_start, delta = _rows(p, 0, n_blocks * HEADS, s_layout)\n"),
    *_calls("        dk, dv, s_start, delta = _step(p, WG, j, n_blocks * HEADS, s_start, delta, m0,"),
]
# Delta alone carried (S^T still starts from lse2 read at the step's start): half the registers
PATCHES["delta-ahead"] = [
    ("@gluon.jit\ndef _step(", _ROWS_FN.replace(
        '''    s_start = p.lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * p.lse_to_acc
    return s_start, p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))''',
        '''    return p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))''').replace(
        '''    mbarrier.wait(p.q_ready.index(slot), (j // p.STAGES) & 1, pred=j < n)
''', "").replace("S^T start (-lse2 / (sm_scale log2 e); FOLD_LSE) and Delta", "Delta")),
    ("def _step(p: Pipeline, WG: gl.constexpr, j, m0,", "def _step(p: Pipeline, WG: gl.constexpr, j, n, delta, m0,"),
    ("    mbarrier.wait(p.do_ready.index(slot), phase)\n", ""),
    ("""        delta = p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        dp_acc = gl.zeros""", """        dp_acc = gl.zeros"""),
    ("        dpT = dpT - gl.expand_dims(p.delta_smem.index(slot).load(gl.SliceLayout(0, s_layout)), 0)\n",
     "        dpT = dpT - gl.expand_dims(delta, 0)\n"),
    (_WAIT_ALL, _WAIT_ALL + "    delta_next = _rows(p, j + 1, n, s_layout)\n"),
    (_RETURN, _RETURN.replace("return dk, dv", "return dk, dv, delta_next")),
    ("    mbarrier.wait(p.kv_ready.index(0), 0)\n",
     "    mbarrier.wait(p.kv_ready.index(0), 0)\n    delta = _rows(p, 0, n_blocks * HEADS, s_layout)\n"),
    *_calls("        dk, dv, delta = _step(p, WG, j, n_blocks * HEADS, delta, m0,"),
]

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
