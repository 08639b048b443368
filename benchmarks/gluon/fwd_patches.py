"""Text patches of the rendered Gluon forward (templates/sm90/attn_fwd.py.jinja) that
gluon_fwd_probe.py times against the kernel as rendered: name -> [(old text, new text)]. Each
was measured on an H100 or H200 (benchmarks/gluon/NOTES.md) unless its comment says it waits for
a GPU; those that won went into the template (P rounded in pairs, the tile order's sections), and
cvt-one and section-1 undo them.
tests/test_gluon_tier.py checks that every old text still occurs once in the rendered kernels."""


# old texts that only some kernels render (a flag set either way, P's rounding either way, the third
# consumer warp group at head dim 64): the probe and tests/test_gluon_tier.py let them be missing
OPTIONAL = ("\nPERSISTENT", "\nDYNAMIC_KV", "    p_op = ", "        p_op = ", "        (consumer, (p, 2))")

RESCALE = "gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)"


def _emu_asm(pack):
    """PTX for inline_asm_elementwise(pack=pack): outputs $0..$(pack-1), inputs $pack..; the last
    element of each pack by a cubic (relative error 7.5e-5), exactly 0 below -126."""
    hw = "".join(f"ex2.approx.f32 ${i}, ${pack + i};\n\t" for i in range(pack - 1))
    x, out = f"${2 * pack - 1}", f"${pack - 1}"
    return ("{\n\t.reg .f32 f, fl, r, p;\n\t.reg .b32 e, o;\n\t.reg .pred z;\n\t" + hw +
            f"max.ftz.f32 f, {x}, 0fC2FE0000;\n\t"
            "add.rm.ftz.f32 r, f, 0f4B400000;\n\t"  # 1.5 * 2^23 + floor(f): floor in the low bits
            "sub.rn.ftz.f32 fl, r, 0f4B400000;\n\t"
            "sub.rn.ftz.f32 f, f, fl;\n\t"  # the fraction, in [0, 1)
            "fma.rn.ftz.f32 p, f, 0f3D9FCAB4, 0f3E677DF5;\n\t"
            "fma.rn.ftz.f32 p, p, f, 0f3F322240;\n\t"
            "fma.rn.ftz.f32 p, p, f, 0f3F7FFB14;\n\t"
            "mov.b32 e, r;\n\tshl.b32 e, e, 23;\n\tmov.b32 o, p;\n\tadd.s32 o, o, e;\n\t"
            f"setp.lt.f32 z, {x}, 0fC2FC0000;\n\tselp.b32 {out}, 0, o, z;\n\t}}")


def _emu_patch(pack):
    cons = ",".join(["=r"] * pack + ["r"] * pack)
    fn = f"""

@gluon.jit
def _exp2_mix(x):
    return gl.inline_asm_elementwise({_emu_asm(pack)!r}, "{cons}", [x], dtype=gl.float32, is_pure=True, pack={pack})
"""
    return [("\n\n@gluon.jit\ndef _softmax_step", fn + "\n\n@gluon.jit\ndef _softmax_step"),
            ("    probs = gl.exp2(", "    probs = _exp2_mix(")]


# name -> [(old text, new text)] applied to the rendered source
# arrive-free's edits (arrive-free-split takes those that do not pass the GEMM turn)
PATCHES_ARRIVE_FREE = [
    ("    mbarrier.arrive(p.sched.index((WG + 1) % p.WGS), count=1)  # round robin",
     "    mbarrier.expect(p.sched.index((WG + 1) % p.WGS), 0)  # round robin"),
    ("    mbarrier.arrive(p.k_empty.index(k_slot), count=1)\n    probs",
     "    mbarrier.expect(p.k_empty.index(k_slot), 0)\n    probs"),
    ("    mbarrier.arrive(p.v_empty.index(v_slot), count=1)\n    o = o",
     "    mbarrier.expect(p.v_empty.index(v_slot), 0)\n    o = o"),
    ("        mbarrier.arrive(p.k_empty.index(k_slot), count=1)\n        m_i",
     "        mbarrier.expect(p.k_empty.index(k_slot), 0)\n        m_i"),
    ("        mbarrier.arrive(p.q_empty.index(WG), count=1)",
     "        mbarrier.expect(p.q_empty.index(WG), 0)"),
    ("        mbarrier.arrive(p.v_empty.index(v_slot), count=1)\n\n",
     "        mbarrier.expect(p.v_empty.index(v_slot), 0)\n\n"),
]
_SECTION = "    return max(1, min(16, _props(device).L2_cache_size // 4 // max(kv_bytes, 1)))\n"


def _section_patch(size):
    """The forward's tile order (a program per Q tile: causal-like masks) with sections of ``size``
    (batch, head) pairs instead of the launcher's L2-sized ones; 1 is head after head."""
    return [(_SECTION, f"    return {size}\n")]


PATCHES = {
    "base": [],
    # P rounded to bf16 a pair of columns at a time (one cvt.rn.bf16x2 a register of the P V product's
    # A operand) instead of one by one, which ptxas pairs in the opposite order and swaps back (64 PRMT
    # a key step at head dim 128: 536 -> 485 instructions). H100, in turn, ms one by one / in pairs:
    # full 1x16x16384x128 3.432 / 3.556, causal 1.744 / 1.809 (before the row max tree);
    # 1x32x16384x64 full 4.513 / 4.132 (fewer spills), causal 2.259 / 2.297; H200 (2026-11-28) head
    # dim 64 causal 4x32x4096 0.754 / 0.702, 1x32x16384 2.428 / 2.260: every kernel rounds in pairs
    # since (plan.probs_in_pairs; float16 too: 64 PRMT a step there as well); cvt-one turns it back
    "cvt-one": [("    p_op = gl.convert_layout(_round_pairs(probs), p_layout)\n    return",
                 "    p_op = gl.convert_layout(probs.to(p.q_desc.dtype), p_layout)\n    return"),
                ("        p_op = gl.convert_layout(_round_pairs(probs), p_layout)\n        o = gl.zeros",
                 "        p_op = gl.convert_layout(probs.to(dtype), p_layout)\n        o = gl.zeros")],
    # the tile order of a program per Q tile (causal-like masks), sections of (batch, head) pairs of
    # fixed sizes against the launcher's (a quarter of L2 holds their K and V, at most 16: taken on
    # 2026-11-28, the figures at _section); 1 is the order before, head after head
    "section-1": _section_patch(1),
    "section-4": _section_patch(4),
    "section-16": _section_patch(16),
    "persistent": [("\nPERSISTENT = False", "\nPERSISTENT = True")],  # a program per SM (static order)
    "single": [("\nPERSISTENT = True", "\nPERSISTENT = False")],  # a program per Q tile
    # exp2 of one element in every PACK on the FMA pipes (a cubic for 2^frac, the integer part
    # added to the exponent bits) and of the others on the MUFU: MUFU.EX2 issues 16 per clock per
    # SM, which at head dim 64 is as slow as the tensor cores' part of a step (measured 15-20 % slower)
    "exp-emu2": _emu_patch(2),
    "exp-emu4": _emu_patch(4),
    "exp-emu8": _emu_patch(8),
    # FA3/FA4's warp scheduler: the GEMM turn passes over hardware named barriers (bar.sync by the
    # warp group taking it, bar.arrive by the one passing it: 256 threads each) instead of mbarriers
    # (Gluon's arrive syncs the warp group first, its wait is a try-wait loop); measured no different.
    # H200, four rounds in palindromes, ms base / same / named-turn: head dim 128 full 4x16x4096 0.878 /
    # 0.885 / 0.896, causal 0.484 / 0.494 / 0.492, 1x16x16384 3.516 / 3.512 / 3.456, 1.759 / 1.781 / 1.762;
    # head dim 64 full 4x32x4096 1.122 / 1.130 / 1.116, causal 0.644 / 0.641 / 0.641, GQA 4:1 0.602 /
    # 0.596 / 0.586, 1x32x16384 4.202 / 4.203 / 4.177, 2.220 / 2.192 / 2.188: within base / same's spread
    "named-turn": [
        ("""    if WG == 0:
        mbarrier.wait(p.sched.index(0), (turn & 1) ^ 1)
    else:
        mbarrier.wait(p.sched.index(WG), turn & 1)
""", "".join(f"""    {'if' if w == 0 else 'elif'} WG == {w}:
        gl.inline_asm_elementwise("bar.sync {12 + w}, 256;\\n\\tmov.u32 $0, 0;", "=r,r", [turn], dtype=gl.int32,
                                  is_pure=False, pack=1)
""" for w in range(3))),
        ("""    mbarrier.arrive(p.sched.index((WG + 1) % p.WGS), count=1)  # round robin
""", """    NEXT: gl.constexpr = (WG + 1) % p.WGS
""" + "".join(f"""    {'if' if w == 0 else 'elif'} NEXT == {w}:
        gl.inline_asm_elementwise("bar.arrive {12 + w}, 256;\\n\\tmov.u32 $0, 0;", "=r,r", [gl.program_id(0)],
                                  dtype=gl.int32, is_pure=False, pack=1)
""" for w in range(3))),
        ("""    g0 = 0  # ring position of the tile's first key tile
""", """    if WG == p.WGS - 1:  # warp group 0 takes the first turn
        gl.inline_asm_elementwise("bar.arrive 12, 256;\\n\\tmov.u32 $0, 0;", "=r,r", [gl.program_id(0)], dtype=gl.int32,
                                  is_pure=False, pack=1)
    g0 = 0  # ring position of the tile's first key tile
"""),
    ],
    # Gluon 3.6's mbarrier.arrive syncs the warp group (a BAR.SYNC) before one thread arrives; its
    # expect (arrive.expect_tx) with 0 bytes arrives from the same thread without it. Where the arrive
    # follows a wgmma wait (K, V and Q released, the GEMM turn passed) no sync is needed: CUTLASS's
    # consumer_release (FA3) signals from one thread of the warp group. ncu (full 4x16x4096x128, H100):
    # 8.2 % of a consumer loop's stall samples at the arrives' barriers, FA4's loop 1.1 %. Measured
    # no faster (H100, five rounds, ms base / patch): full 4x16x4096x128 0.869 / 0.892, causal 0.510 /
    # 0.515, sliding window 0.264 / 0.265, full 1x16x16384x128 3.466 / 3.435, causal 1.779 / 1.795;
    # head dim 64 full 4x32x4096 1.148 / 1.134, causal 0.769 / 0.751, 16k 4.172 / 4.225, 2.413 / 2.372
    "arrive-free": PATCHES_ARRIVE_FREE,
    # arrive-free with each warp group's turn barrier its own allocation, passed to it by
    # warp_specialize (the one it waits on, the one it passes the turn with): Triton's membar puts a
    # warp-group BAR.SYNC between a wait and an arrive on the same allocation (sched.index(w) and
    # sched.index(w + 1) are one), which kept the sync before the turn's hand-over (7 % of a loop's
    # stall samples on the H100) and at the loop's top. Two consumer warp groups only (head dim 128).
    # No BAR.SYNC left in the key loops but one; measured slower (same run as arrive-free): 0.907,
    # 0.526, 0.264, 3.464, 1.794 ms. The warp-group syncs are not what the forward waits for
    "arrive-free-split": [
        ("def _take_turn(p: Pipeline, WG: gl.constexpr, turn):", "def _take_turn(mine, WG: gl.constexpr, turn):"),
        ("        mbarrier.wait(p.sched.index(0), (turn & 1) ^ 1)", "        mbarrier.wait(mine, (turn & 1) ^ 1)"),
        ("        mbarrier.wait(p.sched.index(WG), turn & 1)", "        mbarrier.wait(mine, turn & 1)"),
        ("def _pass_turn(p: Pipeline, WG: gl.constexpr):\n    mbarrier.arrive(p.sched.index((WG + 1) % p.WGS), count=1)  # round robin",
         "def _pass_turn(nxt, WG: gl.constexpr):\n    mbarrier.expect(nxt, 0)  # round robin"),
        ("def _kv_step(p: Pipeline, WG: gl.constexpr, it,", "def _kv_step(p: Pipeline, WG: gl.constexpr, mine, nxt, it,"),
        ("    _take_turn(p, WG, turn + it)", "    _take_turn(mine, WG, turn + it)"),
        ("        _take_turn(p, WG, turn)\n", "        _take_turn(mine, WG, turn)\n"),
        ("        _take_turn(p, WG, turn + n_blocks)", "        _take_turn(mine, WG, turn + n_blocks)"),
        ("    _pass_turn(p, WG)\n    qk = warpgroup_mma_wait(num_outstanding=1", "    _pass_turn(nxt, WG)\n    qk = warpgroup_mma_wait(num_outstanding=1"),
        ("        _pass_turn(p, WG)\n        qk = warpgroup_mma_wait", "        _pass_turn(nxt, WG)\n        qk = warpgroup_mma_wait"),
        ("        _pass_turn(p, WG)\n        o, p_op = warpgroup_mma_wait", "        _pass_turn(nxt, WG)\n        o, p_op = warpgroup_mma_wait"),
        ("def consumer(p: Pipeline, WG: gl.constexpr", "def consumer(p: Pipeline, WG: gl.constexpr, mine, nxt"),
        ("        for it in range(1, n_masked):  # key tiles the mask cuts (and a ragged last one)\n            kb = _block(it, hi, full_lo, full_hi, n_hi, n_masked)\n            o, p_op, alpha, m_i, l_i = _kv_step(p, WG, it,",
         "        for it in range(1, n_masked):  # key tiles the mask cuts (and a ragged last one)\n            kb = _block(it, hi, full_lo, full_hi, n_hi, n_masked)\n            o, p_op, alpha, m_i, l_i = _kv_step(p, WG, mine, nxt, it,"),
        ("        for it in range(gl.maximum(n_masked, 1), n_blocks):  # key tiles every row attends: no mask code\n            kb = _block(it, hi, full_lo, full_hi, n_hi, n_masked)\n            o, p_op, alpha, m_i, l_i = _kv_step(p, WG, it,",
         "        for it in range(gl.maximum(n_masked, 1), n_blocks):  # key tiles every row attends: no mask code\n            kb = _block(it, hi, full_lo, full_hi, n_hi, n_masked)\n            o, p_op, alpha, m_i, l_i = _kv_step(p, WG, mine, nxt, it,"),
        ("    sched = gl.allocate_shared_memory(gl.int64, [WGS, 1], bar_layout)\n",
         "    sched = gl.allocate_shared_memory(gl.int64, [WGS, 1], bar_layout)\n"
         "    sched0 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)\n"
         "    sched1 = gl.allocate_shared_memory(gl.int64, [1], bar_layout)\n"
         "    mbarrier.init(sched0, count=1)\n    mbarrier.init(sched1, count=1)\n"),
        ("        (consumer, (p, 0", "        (consumer, (p, 0, sched0, sched1"),
        ("        (consumer, (p, 1", "        (consumer, (p, 1, sched1, sched0"),
    ] + [(old, new) for old, new in PATCHES_ARRIVE_FREE if "sched" not in old],
    # FA4's row sums: each thread keeps the sum of its own columns of a row ([BLOCK_M, 4]: the four
    # lanes sharing a row) and the lanes add theirs once a tile, after the last key tile: the two
    # shuffle rounds and their adds leave the key step (SASS: 485 -> 477 instructions, 4 SHFL.BFLY of 8).
    # H100, five rounds, base / patch: full 4x16x4096x128 0.899 / 0.889, causal 0.529 / 0.518, full
    # 16k 3.496 / 3.547, causal 1.797 / 1.758; head dim 64 full 4k 1.160 / 1.147, causal 0.763 /
    # 0.756, 16k 4.290 / 4.280, 2.416 / 2.421: within the spread
    "sum-late": [
        ("    l_i = l_i * alpha + gl.sum(probs, axis=1)\n",
         "    part = gl.sum(gl.sum(gl.reshape(probs, [probs.shape[0], probs.shape[1] // 8, 4, 2]), axis=3), axis=1)\n"
         "    l_i = l_i * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, part.type.layout)), 1) + part\n"),
        ("        l_i = gl.zeros([BLOCK_M], gl.float32, row_s)\n",
         "        l_i = gl.zeros([BLOCK_M, 4], gl.float32, gl.SliceLayout(1, gl.SliceLayout(3, gl.reshape(s_zero, [BLOCK_M, BLOCK_N // 8, 4, 2]).type.layout)))\n"),
        ("        # Delayed normalisation: divide once;", "        l_i = gl.convert_layout(gl.sum(l_i, axis=1), row_s)\n        # Delayed normalisation: divide once;"),
    ],
    # FA4's order at a key step's start: wait for K's slot, then take the GEMM turn (ours takes the
    # turn first and may hold it while K is still loading, keeping the other warp group from its
    # products). H200, five rounds, base / patch ms: 4x16x4096x128 full 0.898 / 0.886, causal 0.535 /
    # 0.520, sliding window 0.270 / 0.271; 16k full 3.495 / 3.510, causal 1.797 / 1.774; head dim 64
    # full 4k 1.132 / 1.132, causal 16k 2.436 / 2.442. Within the spread; not taken
    "k-before-turn": [
        ("""    _take_turn(p, WG, turn + it)
    mbarrier.wait(p.k_ready.index(k_slot), (g // p.STAGES) & 1)
""", """    mbarrier.wait(p.k_ready.index(k_slot), (g // p.STAGES) & 1)
    _take_turn(p, WG, turn + it)
"""),
        ("""        _take_turn(p, WG, turn)
        mbarrier.wait(p.k_ready.index(k_slot), (g0 // STAGES) & 1)
""", """        mbarrier.wait(p.k_ready.index(k_slot), (g0 // STAGES) & 1)
        _take_turn(p, WG, turn)
"""),
    ],
    # FA3's order: O is rescaled by the previous tile's alpha right before its P V is issued (while
    # S = Q K^T runs), not after the P V wait; measured no different
    "rescale-early": [
        ("    mbarrier.arrive(p.v_empty.index(v_slot), count=1)\n    o = o * %s\n" % RESCALE,
         "    mbarrier.arrive(p.v_empty.index(v_slot), count=1)\n"),
        ("    mbarrier.wait(p.v_ready.index(v_slot), ((g - 1) // p.STAGES) & 1)\n",
         "    o = o * %s\n    mbarrier.wait(p.v_ready.index(v_slot), ((g - 1) // p.STAGES) & 1)\n" % RESCALE),
        ("        mbarrier.wait(p.v_ready.index(v_slot), (gv // STAGES) & 1)\n",
         "        o = o * %s\n        mbarrier.wait(p.v_ready.index(v_slot), (gv // STAGES) & 1)\n" % RESCALE),
    ],
    # waits for a GPU: ptxas puts the P V wait above the whole softmax (benchmarks/gluon/wait_order.py);
    # a wgmma.fence threaded through each probability before the wait keeps 32-58 of the 66 exp2
    # of a head-dim-128 key step under the P V in the SASS (0 without), at 64 WARPGROUP.ARRIVEs
    "fence-probs": [
        ("    o, p_op, probs, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, probs, alpha, m_i, l_i))\n",
         '    probs = gl.inline_asm_elementwise("wgmma.fence.sync.aligned;\\n\\tmov.b32 $0, $1;", "=r,r", [probs], dtype=gl.float32,\n'
         "                                      is_pure=False, pack=1)\n"
         "    o, p_op, probs, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, probs, alpha, m_i, l_i))\n"),
    ],
}

# The launcher's choice between a program per tile and a program per SM drawing tiles from a
# counter (DYNAMIC_KV, fwd_launch.py.jinja), forced either way. The counter used to be drawn at the
# start of a tile (the first form, measured 2026-11-28: causal 16x16x1024x128 0.182 -> 0.166 ms,
# 4x16x4096 0.516 -> 0.501, 1x16x16384 1.764 -> 1.936: a program that drew at the start of a long
# tile held its next one back while others ran dry); now once a tile's loads are issued.
PATCHES["static"] = [("\nDYNAMIC_KV = 4096\n", "\nDYNAMIC_KV = 0\n")]
PATCHES["static-3"] = [("\nDYNAMIC_KV = 1 << 31\n", "\nDYNAMIC_KV = 0\n")]  # three consumer warp groups
PATCHES["drawn"] = [("\nDYNAMIC_KV = 4096\n", "\nDYNAMIC_KV = 1 << 31\n")]

# What a tile's epilogue costs (timing only, outputs left unwritten): its lse stores predicated off,
# and its output's TMA store dropped (the backward's dK, dV stores from registers held about 4 us a
# program: docs/performance-notes.md, 2026-11-28, eighth session)
PATCHES["no-lse-store"] = [("lse, mask=rows < p.N_CTX_Q)\n", "lse, mask=rows < 0)\n")]
PATCHES["no-o-store"] = [("        _tma_store(p.o_desc, ", "        pass  # _tma_store(p.o_desc, ")]

SPARSE = ("index-order", )  # patches of a data-dependent mask's kernel (block-sparse: tile lists)
# a data-dependent mask's tiles in index order (sections of heads, the last Q tile first: the order of the
# other masks, and of these before attncc.blocks.longest_first) instead of by their key tiles, longest first
PATCHES["index-order"] = [("""    pairs = p.n_tiles // p.n_m
    bh = t % pairs
    m0 = gl.load(p.cls_order + t // pairs) * (p.WGS * p.BLOCK_M // p.PACK)
""", """    sec_tiles = p.section * p.n_m
    size = gl.minimum(p.n_tiles // p.n_m - t // sec_tiles * p.section, p.section)
    r = t % sec_tiles
    bh = t // sec_tiles * p.section + r % size
    m0 = (p.n_m - 1 - r // size) * (p.WGS * p.BLOCK_M // p.PACK)
""")]

# FA4's lazy rescale (its sm100 softmax; its sm90 forward rescales every step): a row's max moves only
# where the tile's is more than 8 (log2 units) above it, so P stays below 2^8 and O, l stay exact for
# the max they were taken at; the warp group skips O *= alpha (64 FMUL a thread at head dim 128) where no
# row of it moved, which after a row's first key tiles is nearly always. The decision is a reduction
# over the warp group's rows (shared memory and two barriers), made before the P V wait. SASS (full, 128):
# the unmasked step 484 -> 514 instructions of which 64 FMUL branched over. H200, three rounds in turn,
# ms base / lazy-rescale, 4x16x4096 / 1x16x16384 at 128: full 0.902 / 0.893, 3.515 / 3.532; causal
# 0.501 / 0.500, 1.808 / 1.789; GQA 4:1 0.498 / 0.494, 1.804 / 1.778; 4x32x4096 / 1x32x16384 at 64 (three
# warp groups: stack 37 -> 59 bytes): full 1.132 / 1.375, 4.192 / 5.125; causal 0.648 / 0.668, 2.206 /
# 2.273; GQA 0.594 / 0.613, 2.159 / 2.198. Within 1.5 % at 128, 2-22 % slower at 64: not taken
PATCHES["lazy-rescale"] = [
    ("    m_safe = gl.where(m_new == -float(\"inf\"), 0.0, m_new)  # rows with nothing unmasked yet\n",
     "    m_new = gl.where(m_new > m_i + 8.0, m_new, m_i)  # lazy-rescale\n"
     "    m_safe = gl.where(m_new == -float(\"inf\"), 0.0, m_new)  # rows with nothing unmasked yet\n"),
    ("""    o, p_op, probs, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, probs, alpha, m_i, l_i))
    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
    o = o * """ + RESCALE + "\n",
     """    moved = gl.min(alpha, axis=0) < 1.0
    o, p_op, probs, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, probs, alpha, m_i, l_i))
    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
    if moved:
        o = o * """ + RESCALE + "\n"),
]


def _lazy_asm(n, bar):
    """PTX of O *= alpha for a thread's n accumulator values (pack=n: outputs $0.., tied to the o inputs
    $n.., alpha broadcast $2n..; a thread's values 4 k + (0, 1) are its first row's, 4 k + (2, 3) its
    second's), skipped by the whole warp group where none of its rows moved: bar.red.or over the 128
    threads on named barrier `bar`."""
    muls = "".join(f"mul.f32 ${i}, ${n + i}, ${2 * n + i};\n\t" for i in range(n))
    return ("{\n\t.reg .pred p, q;\n\t"
            f"setp.lt.f32 p, ${2 * n}, 0f3F800000;\n\tsetp.lt.or.f32 p, ${2 * n + 2}, 0f3F800000, p;\n\t"
            f"bar.red.or.pred q, {bar}, 128, p;\n\t@!q bra.uni SKIP;\n\t" + muls + "SKIP:\n\t}")


def _lazy_fn(n):
    cons = ",".join(["=r"] * n + [str(i) for i in range(n)] + ["r"] * n)
    return f"""

@gluon.jit
def _rescale_lazy(o, alpha, WG: gl.constexpr):
    if WG == 0:
        return gl.inline_asm_elementwise({_lazy_asm(n, 12)!r}, "{cons}", [o, alpha], dtype=gl.float32, is_pure=True, pack={n})
    else:
        return gl.inline_asm_elementwise({_lazy_asm(n, 13)!r}, "{cons}", [o, alpha], dtype=gl.float32, is_pure=True, pack={n})
"""


# lazy-rescale with the warp group's decision as one bar.red.or (no reduction through shared memory) and the
# multiplies branched over in PTX; head dim 128 (64 accumulator values a thread). SASS (full): BAR.RED.OR and
# a branch over the 64 FMUL, the unmasked step 497 instructions with them (433 without). H200, three rounds,
# ms base / lazy-rescale-bar, 4x16x4096 / 1x16x16384: full 0.912 / 0.906, 3.625 / 3.506; causal 0.503 /
# 0.514, 1.829 / 1.859; GQA 4:1 0.503 / 0.505, 1.805 / 1.849; sliding window 0.268 / 0.272, 0.283 / 0.288;
# ALiBi 0.598 / 0.613, 2.213 / 2.176; softcap 0.634 / 0.650, 2.326 / 2.330. -3 % to +2.5 %, most cells
# slower: a tenth of the step's instructions fewer is not time saved (the key step waits on the tensor
# cores and the other warp group's turn, not on issue). Not taken
PATCHES["lazy-rescale-bar"] = PATCHES["lazy-rescale"][:1] + [
    ("\n\n@gluon.jit\ndef _kv_step", _lazy_fn(64) + "\n\n@gluon.jit\ndef _kv_step"),
    ("""    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
    o = o * """ + RESCALE + "\n",
     """    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
    o = _rescale_lazy(o, gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1), WG)
"""),
]

# Ceilings (timing only, outputs wrong): the key step without the softmax's parts, to learn what of the
# step the tensor cores wait for. `diag-no-exp` drops the 64 exp2 of a step (P is the exponent),
# `diag-no-max` the row max (m stays at 0), `diag-gemm-only` both and the row sum. H200 (nineteenth
# session), ms base / no-exp / no-max / gemm-only, FA4: full 4x16x4096x128 0.887 / 0.835 / 0.835 / 0.769,
# 0.862; 1x16x16384x128 3.623 / 3.222 / 3.362 / 2.941, 3.291 (lighter kernels also draw less power)
_EXP = "    probs = gl.exp2(gl.fma(qk, qk_scale, -gl.expand_dims(m_safe, 1)))\n"
_MAX = "    m_new = gl.maximum(m_i, gl.convert_layout(_row_max(qk), m_i.type.layout) * qk_scale)\n"
_SUM = "    l_i = l_i * alpha + gl.sum(probs, axis=1)\n"
PATCHES["diag-no-exp"] = [(_EXP, "    probs = gl.fma(qk, qk_scale, -gl.expand_dims(m_safe, 1))\n")]
PATCHES["diag-no-max"] = [(_MAX, "    m_new = gl.maximum(m_i, 0.0)\n")]
PATCHES["diag-gemm-only"] = PATCHES["diag-no-exp"] + PATCHES["diag-no-max"] + [(_SUM, "    l_i = l_i * alpha\n")]


# Experiment: a key step issues the last tile's P V before this tile's S, waits for the P V first (so
# it releases V and may rescale O as soon as alpha is known) and runs the whole softmax after S's
# wait, with no product of its own in flight (ptxas moves the P V wait above every exp2 otherwise).
# H200, four rounds, base / pv-first ms: full 4x16x4096x128 0.905 / 0.938, causal 0.499 / 0.505; 16k
# full 3.595 / 3.684, causal 1.906 / 1.872. Not taken
PATCHES["pv-first"] = [("""    mbarrier.wait(p.k_ready.index(k_slot), (g // p.STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, p.k_smem.index(k_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(p.v_ready.index(v_slot), ((g - 1) // p.STAGES) & 1)
    o_tok = warpgroup_mma(p_op, p.v_smem.index(v_slot), o, is_async=True)
    _pass_turn(p, WG)
    qk = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
    mbarrier.arrive(p.k_empty.index(k_slot), count=1)
""", """    mbarrier.wait(p.v_ready.index(v_slot), ((g - 1) // p.STAGES) & 1)
    o_tok = warpgroup_mma(p_op, p.v_smem.index(v_slot), o, is_async=True)
    mbarrier.wait(p.k_ready.index(k_slot), (g // p.STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, p.k_smem.index(k_slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    _pass_turn(p, WG)
    o, p_op = warpgroup_mma_wait(num_outstanding=1, deps=(o_tok, p_op))
    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
    qk = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok, ))
    mbarrier.arrive(p.k_empty.index(k_slot), count=1)
"""), ("""    o, p_op, probs, alpha, m_i, l_i = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p_op, probs, alpha, m_i, l_i))
    mbarrier.arrive(p.v_empty.index(v_slot), count=1)
""", "")]

# The control: the kernel as rendered under a second name; its spread against `base` is the probe's noise
PATCHES["same"] = []

# Dropped after it measured slower: `spec-max` (commit 5f9a04c), unmasked key steps' exponents against the
# running max m_i with the rebase applied one step late, so that the exp2 need not wait for the tile's row
# max. H200, four rounds in palindromes, ms base / same / spec-max: full 4x16x4096x128 0.878 / 0.885 / 0.943,
# causal 0.484 / 0.494 / 0.503, GQA 4:1 causal 0.471 / 0.486 / 0.491; 1x16x16384x128 3.516 / 3.512 / 3.629,
# 1.759 / 1.781 / 1.790, 1.765 / 1.768 / 1.759 (benchmarks/gluon/NOTES.md, nineteenth and twentieth sessions)
# patches of the row max as a tree (plan.row_max_tree), which only two warp groups (head dim 128) use
HEAD_DIM_128 = ("diag-no-max", "diag-gemm-only")
