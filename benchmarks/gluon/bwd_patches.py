"""Text patches of the rendered Gluon backward (templates/sm90/attn_bwd.py.jinja) that
gluon_bwd_probe.py times: each switches a part of the schedule off or tries another one. Kept
apart from the probe so that tests/test_gluon_tier.py can check every patch still applies (each
old text occurs exactly once in the rendered full and causal kernels)."""

# name -> [(old text, new text)] applied to the rendered source (the probe joins names with +)
PATCHES = {
    "base": [],
    "no-dq-add": [("    _tma_add(p.dq_desc, [block * (HALF_D // 4), 0], dq_smem)\n", "")],
    "no-ds-sync": [("    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)\n", "")],
    "stages-3": [("STAGES=2", "STAGES=3")],
    # two dQ buffers per consumer: the wait before writing one is for the add of two steps ago
    "dq-double": [("    dq_smem = p.dq_smem.index(WG)\n    tma.store_wait(pendings=0)",
                   "    dq_smem = p.dq_smem.index(j % 2 * 2 + WG)\n    tma.store_wait(pendings=1)"),
                  ("gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM // 8, 256], dq_layout)",
                   "gl.allocate_shared_memory(gl.float32, [4, HEAD_DIM // 8, 256], dq_layout)")],
    # no wait for the previous add to have read its buffer (races: timing only)
    "no-dq-wait": [("    tma.store_wait(pendings=0)  # the previous step's add has read the buffer by now\n", "")],
    # every K/V tile starts its whole query tiles at the first one
    "no-rotation": [("    return gl.maximum(kv_lo // BLOCK_M - full_lo, 0)", "    return full_lo * 0")],
    # dQ's MMA before dK's, so that dK runs on the tensor cores while dQ goes to shared memory (FA4's order)
    "dq-first": [("""    dsT_op = gl.convert_layout(dsT, op_layout)
    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)
    # dQ needs both warp groups' dS^T: this one's is written, wait for the other's
    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem.slice(WG * HALF_D, HALF_D, dim=1),
                           gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    dv, dk, pT_op, dsT_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dk_tok, pT_op, dsT_op))
    mbarrier.arrive(p.q_empty.index(slot), count=1)  # Q and dO of this slot are read
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ))
""", """    fence_async_shared()
    mbarrier.arrive(p.ds_ready.index(j % 2), count=1)
    mbarrier.wait(p.ds_ready.index(j % 2), (j // 2) & 1)
    dq_tok = warpgroup_mma(ds_smem.permute((1, 0)), p.k_smem.slice(WG * HALF_D, HALF_D, dim=1),
                           gl.zeros([BLOCK_M, HALF_D], gl.float32, dq_layout), use_acc=False, is_async=True)
    dsT_op = gl.convert_layout(dsT, op_layout)
    dk_tok = warpgroup_mma(dsT_op, q_smem, dk, is_async=True)
    dv, dq, pT_op = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dq_tok, pT_op))
"""), ("""    _tma_add(p.dq_desc, [block * (HALF_D // 4), 0], dq_smem)
    return dk, dv""", """    _tma_add(p.dq_desc, [block * (HALF_D // 4), 0], dq_smem)
    dk, dsT_op = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok, dsT_op))
    mbarrier.arrive(p.q_empty.index(slot), count=1)
    return dk, dv""")],
    # the producer warp issues the dQ reduce-adds (FA3/FA4's dQ writer): after step j's loads it adds
    # step j - 1's halves; consumers store theirs and arrive on dq_bars (written: 0, 1; free: 2, 3)
    "dq-writer": [
        ("    dq_smem: gl.shared_memory_descriptor   # [2, HEAD_DIM // 8, 256]: each consumer's half of the step's dQ\n",
         "    dq_smem: gl.shared_memory_descriptor   # [2, HEAD_DIM // 8, 256]: each consumer's half of the step's dQ\n"
         "    dq_bars: gl.shared_memory_descriptor\n"),
        ("q_empty, ds_ready, dq_smem,\n", "q_empty, ds_ready, dq_smem, dq_bars,\n"),
        ("        self.dq_smem = dq_smem\n", "        self.dq_smem = dq_smem\n        self.dq_bars = dq_bars\n"),
        ("""    dq_smem = p.dq_smem.index(WG)
    tma.store_wait(pendings=0)  # the previous step's add has read the buffer by now
    dq_smem.store(dq)
    fence_async_shared()
    block = ((b * p.H + h) * gl.cdiv(p.N_CTX_Q, BLOCK_M) + m0 // BLOCK_M) * 2 + WG
    _tma_add(p.dq_desc, [block * (HALF_D // 4), 0], dq_smem)
""", """    mbarrier.wait(p.dq_bars.index(2 + WG), (j & 1) ^ 1)
    p.dq_smem.index(WG).store(dq)
    fence_async_shared()
    mbarrier.arrive(p.dq_bars.index(WG), count=1)
"""),
        ("    tma.store_wait(pendings=0)  # the last dQ add has read its buffer before the program's memory is reused\n", ""),
        ("""@gluon.jit
def producer(p: Pipeline):
""", """@gluon.jit
def _dq_add(p: Pipeline, i, b, h_kv, full_lo, full_hi, hi, n_hi, n_masked, rot):
    HALF_D: gl.constexpr = p.HEAD_DIM // 2
    tile = _q_block(i // p.GROUP, full_lo, full_hi, hi, n_hi, n_masked, rot)
    block = ((b * p.H + h_kv * p.GROUP + i % p.GROUP) * gl.cdiv(p.N_CTX_Q, p.BLOCK_M) + tile) * 2
    for wg in gl.static_range(2):
        mbarrier.wait(p.dq_bars.index(wg), i & 1)
        _tma_add(p.dq_desc, [(block + wg) * (HALF_D // 4), 0], p.dq_smem.index(wg))
    tma.store_wait(pendings=0)
    for wg in gl.static_range(2):
        mbarrier.arrive(p.dq_bars.index(2 + wg), count=1)


@gluon.jit
def producer(p: Pipeline):
"""),
        ("""        _rows_to_smem(p.delta_ptr, row, n_rows, p.delta_smem.index(slot), bar, BLOCK_M)
""", """        _rows_to_smem(p.delta_ptr, row, n_rows, p.delta_smem.index(slot), bar, BLOCK_M)
        if j > 0:
            _dq_add(p, j - 1, b, h_kv, full_lo, full_hi, hi, n_hi, n_masked, rot)
    if n_blocks * GROUP > 0:
        _dq_add(p, n_blocks * GROUP - 1, b, h_kv, full_lo, full_hi, hi, n_hi, n_masked, rot)
"""),
        ("    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)\n",
         "    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)\n"
         "    dq_bars = gl.allocate_shared_memory(gl.int64, [4, 1], bar_layout)\n"
         "    for i in gl.static_range(4):\n        mbarrier.init(dq_bars.index(i), count=1)\n"),
        ("gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM // 8, 256], dq_layout),\n",
         "gl.allocate_shared_memory(gl.float32, [2, HEAD_DIM // 8, 256], dq_layout), dq_bars,\n")],
    "kv-major": [("    bh_kv = gl.program_id(0) // n_kv\n", "    bh_kv = gl.program_id(0) % p.BH_KV\n"),
                 ("    kv_lo = gl.program_id(0) % n_kv * (2 * p.BLOCK_N)", "    kv_lo = gl.program_id(0) // p.BH_KV * (2 * p.BLOCK_N)")],
}
