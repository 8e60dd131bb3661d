"""Blockwise FP8 GEMMs for AMD gfx950 in FlyDSL with A staged through LDS: ``C [M, N] = A [M, K] @ B [N, K]^T``
with fp32 promotion of every 128-wide K block, on the FP8 MFMA (``v_mfma_*_16x16x128_f8f6f4``).

Operands and scales (TE layouts, ``tensor.py``):

* A: FP8 ``[M, K]`` K-major, 1x128-scaled (scale entry ``[kb, m]``, row stride ``pad4(M)``).
* B, ``b_layout="preshuffle16"`` (fprop: W, dgrad: W^T from the weight cache): FP8 ``[N, K]`` in
  FlyDSL's (16, 16) preshuffled byte order (``preshuffle.py``), 128x128-scaled (entry ``[n // 128, kb]``).
  Each lane reads its 16 K-bytes of a 16x16 tile with one 128-bit load, straight into registers.
* B, ``b_layout="k_major"`` (wgrad: X^T): FP8 ``[N, K]`` K-major, 1x128-scaled (entry ``[kb, n]``),
  staged through LDS like A.

Tiling: a workgroup of ``waves`` waves (64 lanes each) computes a ``bm x bn`` tile; the waves form a
``waves_m x waves_n`` grid, wave ``(i, j)`` owning the 16x16 strips at rows ``16 (i + waves_m r)`` and
columns ``16 (j + waves_n c)``. Per 128-K step and per 16-row strip: fresh ``16 x 16`` partial
products on the MFMA, then ``acc += partial * (sa * sb)`` in fp32 (2-wide FMAs; ``sa * sb`` once per
strip and scale block). A (and a K-major B) goes global -> registers -> LDS (XOR-swizzled 16-byte
chunks, 2 stages): the loads of step ``k + 1`` are issued before the MFMAs of step ``k`` and written
to the other LDS stage after them, one barrier per step. A preshuffled B goes straight into
registers (``b_stages`` 2: double-buffered one step ahead; 1: loaded at the start of its step). The
fprop/dgrad K loop runs ``unroll`` steps per trip. With ``burst`` (all shipped configs) a strip's
MFMAs are issued back to back between scheduling barriers and its promotions follow: LLVM (flydsl
0.5's) unpacks a ``v_pk_*_f32`` issued in an MFMA's latency shadow into two VALU ops, so interleaving
each MFMA with its FMAs doubled them.

Addresses: every global load puts the lane's own offset (loop-invariant) in the buffer instruction's
``voffset`` and the wave-uniform rest in its ``soffset`` SGPR (SALU work, no VALU in the K loop): the
K step for A and a K-major B, the strip and K step for a preshuffled B (``b_soffset``). The bounds
check applies to ``voffset`` only, so the rows, which the bounds mask, always stay there, and so does
the K step of A's scales where the last M tile is ragged (``scale_a_split``).

Tile order: the 1-D grid is walked in L2 groups of ``group_m`` M-tiles (all N-tiles of a group of M
tiles before the next group), as Triton's grouped ordering.

Shapes: N (the output columns) a multiple of ``bn``; K a multiple of 128 (fprop/dgrad: static; wgrad:
the token count, dynamic; two steps per loop trip and a tail step for an odd count; ``blockwise_gemm_lds``
zero-pads a token count that is not a multiple of 128, ``pad_contraction``). M: any M >= 1, the rows
past M of the last M-tile read zeros and their stores are dropped by the buffer descriptors' bounds
(``make_buffer_tensor`` with the tensor's real extent); fprop/dgrad: M dynamic, one binary per
(N, K, tile); wgrad: M (the weight's N) static, one binary per weight shape.

Compile-only here (docs/AMD.md): never run on an MI355X; its index arithmetic is emulated on the CPU
(tests/backends/flydsl_emulation.py). The tiles that run: ``heuristics.py``. Not a translation of
Primus-Turbo's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

BK = 128
SCALE_BLOCK = 128
WAVE = 64


@dataclass(frozen=True)
class TileConfig:
    """One kernel variant: tile ``bm x bn`` (x 128 K), ``waves`` waves, B's layout and scaling."""

    bm: int
    bn: int
    waves: int
    b_layout: str  # "preshuffle16" (B 128x128-scaled) or "k_major" (B 1x128-scaled, wgrad)
    waves_m: int = 2  # waves along M (the rest along N)
    group_m: int = 8
    b_stages: int = 2  # preshuffled B: register stages (2: step k+1's B loads are issued during step k)
    unroll: int = 2  # preshuffled-B kernels: 128-K steps per trip of the K loop (even)
    burst: bool = False  # per 16-row strip: its MFMAs back to back, then its fp32 promotions (sched barriers)

    @property
    def waves_n(self) -> int:
        return self.waves // self.waves_m

    @property
    def threads(self) -> int:
        return WAVE * self.waves

    @property
    def rm(self) -> int:  # 16-row strips per wave
        return self.bm // (16 * self.waves_m)

    @property
    def rn(self) -> int:  # 16-column strips per wave
        return self.bn // (16 * self.waves_n)

    @property
    def lds_bytes(self) -> int:
        b = self.bn * BK * 2 if self.b_layout == "k_major" else 0
        return self.bm * BK * 2 + b

    def check(self) -> None:
        if self.b_layout not in ("preshuffle16", "k_major"):
            raise ValueError(f"b_layout must be 'preshuffle16' or 'k_major', got {self.b_layout!r}")
        if self.waves % self.waves_m or self.bm % (16 * self.waves_m) or self.bn % (16 * self.waves_n) or self.rn < 1:
            raise ValueError(f"tile {self.bm}x{self.bn} does not split into 16x16 strips over {self.waves} waves")
        step = 16 * self.waves_n
        if self.b_layout == "preshuffle16" and step % SCALE_BLOCK and SCALE_BLOCK % step:
            raise ValueError("a wave's columns must stay inside one 128-column scale block per strip")
        if (self.bm * BK) % (16 * self.threads) or (self.bn * BK) % (16 * self.threads):
            raise ValueError(f"the {self.bm}x{BK} A tile must split into 16-byte chunks over {self.threads} threads")


def strip_scale_block(cfg: TileConfig, rn: int) -> int:
    """Which 128-column scale block of the tile a wave's ``rn``-th strip falls in (any wave)."""
    return (rn * 16 * cfg.waves_n) // SCALE_BLOCK


def b_soffset(cfg: TileConfig, k: int, kt, rn: int):
    """Preshuffled B ([N, k] bytes): the offset of a wave's ``rn``-th 16-column strip at 128-K step ``kt``
    past its strip-0, step-0 address. The kernel passes it as the buffer load's ``soffset`` (an SGPR,
    SALU arithmetic) and keeps only the lane's own address, loop-invariant, in ``voffset``."""
    return kt * (BK * 16) + rn * (cfg.waves_n * 16 * k)


def pad_strip_set(cfg: TileConfig, pad_cols: int) -> frozenset[int]:
    """The strips ``rn`` a wave does not store in the last N tile when the output's last ``pad_cols`` columns
    (of the ``n`` the kernel computes) are padding: those whose 16 columns start at or past ``bn - pad_cols``
    for every wave (raises unless the padding is whole strips of every wave)."""
    if pad_cols == 0:
        return frozenset()
    step = 16 * cfg.waves_n
    if cfg.b_layout != "preshuffle16" or not 0 < pad_cols < cfg.bn or (cfg.bn - pad_cols) % step:
        raise ValueError(f"{pad_cols} padded columns of a {cfg.bn}-wide tile are not whole strips of every wave")
    return frozenset(rn for rn in range(cfg.rn) if rn * step >= cfg.bn - pad_cols)


def scale_a_split(cfg: TileConfig, m: int | None) -> bool:
    """Whether A's scale loads put the K step in ``soffset`` (wgrad with every row in range: ``m`` a
    multiple of ``bm``). Otherwise it stays in the bounds-checked ``voffset``: ``soffset`` is not
    range-checked, and a ragged last tile's rows past M would read past the scale tensor's end."""
    return cfg.b_layout == "k_major" and m is not None and m % cfg.bm == 0


def tile_of(pid: int, num_pid_m: int, num_pid_n: int, group_m: int) -> tuple[int, int]:
    """The (M-tile, N-tile) workgroup ``pid`` computes: L2-grouped order (the kernel's arithmetic)."""
    per_group = group_m * num_pid_n
    group = pid // per_group
    first_m = group * group_m
    size_m = min(num_pid_m - first_m, group_m)
    in_group = pid % per_group
    return first_m + in_group % size_m, in_group // size_m


def build_kernel(cfg: TileConfig, n: int, k: int | None, *, m: int | None = None, out_bf16: bool, n_valid: int | None = None):
    """A FlyDSL launcher ``launch(A, B, C, SA, SB)`` for one shape class.

    fprop/dgrad (``cfg.b_layout == "preshuffle16"``): ``n``, ``k`` static, M dynamic (pass A, C and SA
    marked dynamic: ``dynamic_args``). wgrad (``"k_major"``): ``m`` and ``n`` static, K dynamic."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    cfg.check()
    pre = cfg.b_layout == "preshuffle16"
    if n % cfg.bn:
        raise ValueError(f"N = {n} must be a multiple of the tile's {cfg.bn} columns")
    if n_valid is not None and n_valid != n:
        pad_strip_set(cfg, n - n_valid)  # raises unless the padding is whole strips
    if pre and (k is None or k % BK):
        raise ValueError(f"K = {k} must be a static multiple of {BK} for the preshuffled-B kernel")
    if not pre and (m is None or m < 1):
        raise ValueError(f"wgrad's M = {m} must be given (static, >= 1; a ragged last M tile is masked)")
    bm, bn, threads, rm_n, rn_n, wm, wn = cfg.bm, cfg.bn, cfg.threads, cfg.rm, cfg.rn, cfg.waves_m, cfg.waves_n
    n_valid = n if n_valid is None else n_valid
    pad_cols = n - n_valid  # B padded with zero rows past n_valid; C holds n_valid columns
    pad_strips = pad_strip_set(cfg, pad_cols)
    f8 = fx.Float8E4M3FN
    out_ty = fx.BFloat16 if out_bf16 else fx.Float32
    num_pid_n = n // bn
    group_m = cfg.group_m
    sb_blocks = [strip_scale_block(cfg, rn) for rn in range(rn_n)]
    b_lds_offset = bm * BK * 2

    @flyc.kernel
    def fp8_blockwise_gemm_lds_kernel(
        A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor, mma: fx.TiledMma, g2s: fx.TiledCopy,
    ):  # fmt: skip
        tid = fx.thread_idx.x
        pid, _, _ = fx.block_idx
        # bounds-checked descriptors (the tensors' real extents): past-the-end loads read 0, stores drop
        A = fx.rocdl.make_buffer_tensor(A, max_size=False)
        B = fx.rocdl.make_buffer_tensor(B, max_size=False)
        if fx.const_expr(pad_cols == 0):
            C = fx.rocdl.make_buffer_tensor(C, max_size=False)
        else:  # C's real extent (its view has n columns at a row stride of n_valid)
            c_bytes = fx.Int64(fx.get_scalar(A.shape[0])) * (n_valid * (2 if out_bf16 else 4))
            C = fx.rocdl.make_buffer_tensor(C, num_records_bytes=c_bytes)
        SA = fx.rocdl.make_buffer_tensor(SA, max_size=False)
        SB = fx.rocdl.make_buffer_tensor(SB, max_size=False)
        m_rows = fx.get_scalar(A.shape[0])
        kt_n = fx.get_scalar(A.shape[1]) // BK
        # L2-grouped tile order (tile_of)
        num_pid_m = (m_rows + (bm - 1)) // bm
        per_group = group_m * num_pid_n
        first_m = (pid // per_group) * group_m
        size_m = fx.min(num_pid_m - first_m, group_m)
        in_group = pid % per_group
        pid_m = first_m + in_group % size_m
        pid_n = in_group // size_m

        gA = fx.flat_divide(A, (bm, BK))[None, None, pid_m, None]  # (bm, BK, K/BK)
        gB = fx.flat_divide(B, (bn, BK))[None, None, pid_n, None]  # (bn, BK, K/BK)
        gC = fx.flat_divide(C, (bm, bn))[None, None, pid_m, pid_n]
        thr = mma.thr_slice(tid)
        ld128 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), f8)
        lds128 = fx.make_copy_atom(fx.UniversalCopy128b(), f8)
        ld_s128 = fx.make_copy_atom(fx.rocdl.BufferCopy128b(), fx.Float32)
        ld_s32 = fx.make_copy_atom(fx.rocdl.BufferCopy32b(), fx.Float32)
        swz = fx.static(fx.SwizzleType.get(3, 4, 3))  # XOR the 16-byte chunk index with the row
        sA = fx.make_view(fx.get_dyn_shared(f8), fx.make_composed_layout(swz, fx.make_ordered_layout((bm, BK, 2), (1, 0, 2))))
        tg = g2s.get_slice(tid)
        ga_src = tg.partition_S(gA)
        sa_dst = tg.partition_D(sA)
        stage_a = fx.make_fragment_like(sa_dst[None, None, None, 0])
        s2r_a = fx.make_tiled_copy_A(lds128, mma).get_slice(tid)
        sA_src = s2r_a.partition_S(sA)
        frag_a = thr.make_fragment_A(sA[None, None, 0])
        a_r = s2r_a.retile(frag_a)
        if fx.const_expr(pre):
            g2r_b = fx.make_tiled_copy_B(ld128, mma).get_slice(tid)
            gb_src = g2r_b.partition_S(gB)
            frag_b = thr.make_fragment_B(gB, stages=cfg.b_stages)
            b_r = g2r_b.retile(frag_b)
        else:
            sB = fx.make_view(fx.get_dyn_shared(f8) + b_lds_offset,
                              fx.make_composed_layout(swz, fx.make_ordered_layout((bn, BK, 2), (1, 0, 2))))  # fmt: skip
            gb_src = tg.partition_S(gB)
            sb_dst = tg.partition_D(sB)
            stage_b = fx.make_fragment_like(sb_dst[None, None, None, 0])
            s2r_b = fx.make_tiled_copy_B(lds128, mma).get_slice(tid)
            sB_src = s2r_b.partition_S(sB)
            frag_b = thr.make_fragment_B(sB[None, None, 0])
            b_r = s2r_b.retile(frag_b)
        acc = thr.make_fragment_C(gC)
        part = thr.make_fragment_C(gC)
        zero = thr.make_fragment_C(gC)

        # A's scale [kb, m] as a C-shaped (bm, bn, KB) view with N-stride 0; one N strip of it holds a
        # lane's rows (4 consecutive rows per 16-row strip: one 128-bit load each)
        cpy_s128 = fx.make_tiled_copy_C(ld_s128, mma).get_slice(tid)
        sa_view = fx.make_view(fx.get_iter(SA) + pid_m * bm, fx.make_layout((bm, bn, kt_n), (1, 0, fx.get_scalar(SA.stride[0]))))
        src_sa = cpy_s128.partition_S(sa_view)
        frag_sa = fx.make_fragment_like(src_sa[None, None, 0, 0])
        if fx.const_expr(not pre):  # B's 1x128 scale [kb, n]: one value per lane and strip, M-stride 0
            cpy_s32 = fx.make_tiled_copy_C(ld_s32, mma).get_slice(tid)
            sbv = fx.make_view(fx.get_iter(SB) + pid_n * bn, fx.make_layout((bm, bn, kt_n), (0, 1, fx.get_scalar(SB.stride[0]))))
            src_sb = cpy_s32.partition_S(sbv)
            frag_sb = fx.make_fragment_like(src_sb[None, 0, None, 0])  # (4, RN): a strip's column, 4 times
        atom = fx.make_mma_atom(fx.rocdl.cdna4.MFMA_Scale(16, 16, 128, f8))

        def flat(t, size):  # a contiguous register slice as a rank-1 fragment (one MFMA operand)
            return fx.make_view(fx.get_iter(t), fx.make_layout(size, 1))

        zero.fill(0)
        acc.fill(0)
        nb0 = (pid_n * bn) // SCALE_BLOCK
        sb_stride = fx.get_scalar(SB.stride[0])
        sa_stride = fx.get_scalar(SA.stride[0])

        sa_split = scale_a_split(cfg, m)

        def load_b(kt, stage):  # lane-only voffset (loop-invariant), the strip and K step in soffset (SALU)
            for rn in fx.range_constexpr(rn_n):
                fx.copy(ld128, gb_src[None, 0, None, 0], b_r[None, rn, None, stage], soffset=b_soffset(cfg, k, fx.Int32(kt), rn))

        def prefetch(kn, s_next):  # A's rows stay in voffset (the bounds mask them), its K step goes to soffset
            fx.copy(ld128, ga_src[None, None, None, 0], stage_a, soffset=fx.Int32(kn) * BK)
            if fx.const_expr(pre):
                if fx.const_expr(cfg.b_stages == 2):
                    load_b(kn, s_next)
            else:
                fx.copy(ld128, gb_src[None, None, None, 0], stage_b, soffset=fx.Int32(kn) * BK)

        def commit(s_next):
            fx.copy(lds128, stage_a, sa_dst[None, None, None, s_next])
            if fx.const_expr(not pre):
                fx.copy(lds128, stage_b, sb_dst[None, None, None, s_next])

        def step(kt, s, last):
            if fx.const_expr(not last):
                prefetch(fx.Int32(fx.min(kt + 1, kt_n - 1)), 1 - s)
            if fx.const_expr(sa_split):  # every row in range: the K step in soffset
                fx.copy(ld_s128, src_sa[None, None, 0, 0], frag_sa, soffset=fx.Int32(kt) * (sa_stride * 4))
            else:  # ragged M: the rows' offsets and the K step stay in the bounds-checked voffset
                fx.copy(ld_s128, src_sa[None, None, 0, kt], frag_sa)
            if fx.const_expr(pre):
                sbs = [fx.rocdl.s_buffer_load(fx.get_iter(SB), (nb0 + blk) * sb_stride + kt).bitcast(fx.Float32)
                       for blk in sorted(set(sb_blocks))]  # fmt: skip
                if fx.const_expr(cfg.b_stages == 1):  # this step's B, issued before the A reads from LDS
                    load_b(kt, 0)
                bs = s if cfg.b_stages == 2 else 0
                fb = lambda rn: frag_b[None, rn, 0, bs]  # noqa: E731
            else:
                fx.copy(ld_s32, src_sb[None, 0, None, 0], frag_sb, soffset=fx.Int32(kt) * (sb_stride * 4))
                fx.copy(lds128, sB_src[None, None, None, s], b_r)
                fb = lambda rn: frag_b[None, rn, 0]  # noqa: E731

            def promote(rm, rn, sc):  # acc += part * sc, 2-wide FMAs
                a_s, p_s = acc[None, rm, rn], part[None, rm, rn]
                pv, av = fx.memref_load_vec(flat(p_s, 4)), fx.memref_load_vec(flat(a_s, 4))
                lo = fx.fma(pv.shuffle(pv, [0, 1]), sc.shuffle(sc, [0, 1]), av.shuffle(av, [0, 1]))
                hi = fx.fma(pv.shuffle(pv, [2, 3]), sc.shuffle(sc, [2, 3]), av.shuffle(av, [2, 3]))
                fx.memref_store_vec(lo.shuffle(hi, [0, 1, 2, 3]), flat(a_s, 4))

            def mma(rm, rn):
                fx.gemm(atom, flat(part[None, rm, rn], 4), flat(frag_a[None, rm, 0], 32), flat(fb(rn), 32),
                        flat(zero[None, rm, rn], 4))  # fmt: skip

            for rm in fx.range_constexpr(rm_n):
                fx.copy(lds128, sA_src[None, rm, None, s], a_r[None, rm, None])
                sa = fx.memref_load_vec(flat(frag_sa[None, rm], 4))  # the lane's 4 rows of this strip
                if fx.const_expr(pre):
                    sc_blocks = [sa * sb for sb in sbs]  # once per strip and scale block, shared by its N strips
                    scs = [sc_blocks[sb_blocks[rn] - min(sb_blocks)] for rn in range(rn_n)]
                else:  # 1x128 B: a scale per row and column
                    scs = [sa * fx.memref_load_vec(flat(frag_sb[None, rn], 4)) for rn in range(rn_n)]
                if fx.const_expr(cfg.burst):  # the strip's MFMAs back to back, then its promotions
                    fx.rocdl.sched_barrier(0)
                    for rn in fx.range_constexpr(rn_n):
                        mma(rm, rn)
                    fx.rocdl.sched_barrier(0)
                    for rn in fx.range_constexpr(rn_n):
                        promote(rm, rn, scs[rn])
                else:
                    for rn in fx.range_constexpr(rn_n):
                        mma(rm, rn)
                        promote(rm, rn, scs[rn])
            if fx.const_expr(not last):
                commit(1 - s)
                fx.gpu.barrier()

        prefetch(0, 0)  # (with b_stages == 1 this loads A only)
        commit(0)
        fx.gpu.barrier()
        if fx.const_expr(pre):  # K static: the loop runs `unroll` steps per trip, the rest after it
            kt_static = k // BK
            u = cfg.unroll
            for i in range(kt_static // u):
                for j in fx.range_constexpr(u):
                    step(u * i + j, j % 2, False)
            for j in fx.range_constexpr(kt_static % u):
                step((kt_static // u) * u + j, j % 2, j == kt_static % u - 1)
        else:  # K (tokens) dynamic, a multiple of 128: two steps per trip, an odd last step after the loop
            for i in range(kt_n // 2):
                step(2 * i, 0, False)
                step(2 * i + 1, 1, False)
            if kt_n % 2 == 1:  # its A and B are in stage 0 (the loop's last prefetch, or the prologue's)
                step(kt_n - 1, 0, True)

        store = fx.make_copy_atom(fx.rocdl.BufferCopy16b() if out_bf16 else fx.rocdl.BufferCopy32b(), out_ty)
        copy_out = fx.make_tiled_copy_C(store, mma).get_slice(tid)
        if fx.const_expr(out_bf16):
            out = fx.make_fragment_like(acc, fx.BFloat16)
            out.store(acc.load().to(fx.BFloat16))
        else:
            out = acc
        src_c, dst_c = copy_out.retile(out), copy_out.partition_S(gC)
        if fx.const_expr(pad_cols == 0):
            fx.copy(store, src_c, dst_c)
        else:  # the last N tile's strips in the padded columns are not stored (they would wrap to the next row)
            for rn in fx.range_constexpr(rn_n):
                if fx.const_expr(rn not in pad_strips):
                    fx.copy(store, src_c[None, None, rn], dst_c[None, None, rn])
            if pid_n < num_pid_n - 1:
                for rn in fx.range_constexpr(rn_n):
                    if fx.const_expr(rn in pad_strips):
                        fx.copy(store, src_c[None, None, rn], dst_c[None, None, rn])

    @flyc.jit
    def launch(A: fx.Tensor, B: fx.Tensor, C: fx.Tensor, SA: fx.Tensor, SB: fx.Tensor, stream: fx.Stream = fx.Stream(None)):  # noqa: B008
        if fx.const_expr(pre):  # (n, k) -> byte ((n//16)*(K/16) + k//16)*256 + (n%16)*16 + k%16
            B = fx.Tensor(fx.make_view(fx.get_iter(B), fx.make_layout(((16, n // 16), (16, k // 16)), ((16, 16 * k), (1, 256)))))
        if fx.const_expr(pad_cols):  # C [M, n_valid] seen as [M, n] with row stride n_valid
            C = fx.Tensor(fx.make_view(fx.get_iter(C), fx.make_layout((fx.get_scalar(C.shape[0]), n), (n_valid, 1))))
        mma_atom = fx.make_mma_atom(fx.rocdl.cdna4.MFMA_Scale(16, 16, 128, f8))
        mma = fx.make_tiled_mma(mma_atom, fx.make_layout((wm, wn, 1), (1, wm, 0)))
        cols = BK // 16  # 16-byte chunks per row
        rows = threads // cols
        g2s = fx.make_tiled_copy(
            fx.make_copy_atom(fx.UniversalCopy128b(), f8),
            fx.make_layout(((cols, rows), (1, 16)), ((rows * 16, 1), (1, rows))),
            fx.make_tile(rows, BK),
        )
        m_rows = fx.get_scalar(A.shape[0])
        grid = ((m_rows + (bm - 1)) // bm) * num_pid_n
        fp8_blockwise_gemm_lds_kernel(A, B, C, SA, SB, mma, g2s).launch(
            grid=(grid, 1, 1), block=(threads, 1, 1), smem=cfg.lds_bytes, stream=stream
        )

    return launch


def dynamic_args(cfg: TileConfig, a, b, c, sa, sb):
    """FlyDSL arguments for ``launch`` (torch tensors in): the dims a shape class leaves open marked dynamic."""
    import flydsl.compiler as flyc

    t = flyc.from_torch_tensor
    if cfg.b_layout == "preshuffle16":  # M dynamic
        return (t(a).mark_shape_dynamic(0), t(b), t(c).mark_shape_dynamic(0),
                t(sa).mark_layout_dynamic(leading_dim=1, divisibility=4), t(sb))  # fmt: skip
    # wgrad: K (tokens) dynamic in A, B; scales [KB, pad4(.)] with KB dynamic
    return (t(a).mark_layout_dynamic(leading_dim=1, divisibility=16), t(b).mark_layout_dynamic(leading_dim=1, divisibility=16),
            t(c), t(sa).mark_shape_dynamic(0), t(sb).mark_shape_dynamic(0))  # fmt: skip


def dgrad_operands(w):
    """dgrad's B for a preshuffled weight ``w`` [N, K]: ``(W^T data, W^T scales, n_valid, padded)``. Where the
    quantizer left W^T's storage padded to 256-multiple rows (K % 256 == 128: ``preshuffle.padded_rows``)
    the padded views (``padded``: a 256-wide tile then covers them), with ``n_valid = K``; otherwise the
    tensors as they are. The padded rows only feed output columns that are never stored, so their content
    does not matter (a view into a larger storage, such as one expert of a stacked weight, is served
    correctly too)."""
    from ...preshuffle import dgrad_padded_rows, padded_rows

    k = w.shape[1]
    kp = dgrad_padded_rows(k)
    if kp != k:
        data = padded_rows(w.columnwise_data, kp)
        scales = padded_rows(w.columnwise_scale_inv, kp // SCALE_BLOCK)
        if data is not None and scales is not None:
            return data, scales, k, True
    return w.columnwise_data, w.columnwise_scale_inv, k, False


def weight_fits(n: int, k: int) -> bool:
    """Whether a weight [N, K] is served by these kernels (fprop's and dgrad's outputs whole 128-column
    tiles, both contractions whole 128-K blocks); the weight cache then holds it preshuffled."""
    return n > 0 and k > 0 and n % SCALE_BLOCK == 0 and k % SCALE_BLOCK == 0


def wgrad_fits(cfg: TileConfig, n: int, k: int, tokens: int) -> bool:
    """Whether wgrad dW [N, K] over ``tokens`` runs the K-major tile ``cfg``: K (the output columns) a
    multiple of its width; any N >= 1 (a ragged last M tile is masked) and any token count >= 1 (padded
    with zeros to a multiple of 128 when it is not one: ``pad_contraction``)."""
    return n > 0 and tokens > 0 and k > 0 and k % cfg.bn == 0


def pad_contraction(t, mult: int = BK):
    """A K-major FP8 operand ``[R, T]`` with its contraction dim zero-padded to a multiple of ``mult``
    (``t`` itself when it is one). FP8 zero bytes are +0.0, so the padded columns add nothing; the 1x128
    scales ``[ceil(T / 128), pad4(R)]`` already cover the partial last block."""
    import torch

    r, c = t.shape
    pad = -c % mult
    if pad == 0:
        return t
    out = torch.zeros(r, c + pad, dtype=torch.uint8, device=t.device)
    out[:, :c] = t.view(torch.uint8)
    return out.view(t.dtype)


_launchers: dict = {}


def _launcher(cfg: TileConfig, n: int, k: int | None, m: int | None, out_bf16: bool, n_valid: int):
    key = (cfg, n, k, m, out_bf16, n_valid)
    if key not in _launchers:
        _launchers[key] = build_kernel(cfg, n, k, m=m, out_bf16=out_bf16, n_valid=n_valid)
    return _launchers[key]


def blockwise_gemm_lds(
    a, a_scale_inv, b, b_scale_inv, *, cfg: TileConfig, out_dtype, bias=None, accumulate_into=None, n_valid=None
):
    """``C = A @ B^T`` on the LDS kernel ``cfg`` (contract of the Triton ``blockwise_gemm``; B preshuffled
    for ``cfg.b_layout == "preshuffle16"``). One binary per (tile, N, K) for fprop/dgrad (any M) and
    per (M, N) for wgrad (any token count: padded to a multiple of 128 when needed). ``n_valid``
    (preshuffled B only): B's rows past it are zero padding (``preshuffle.padded_rows``); C then has
    ``n_valid`` columns."""
    import torch

    if cfg.b_layout == "k_major":  # wgrad: tokens (the contraction) to a multiple of 128
        a, b = pad_contraction(a), pad_contraction(b)
    m, k = a.shape
    n = b.shape[0]
    n_valid = n if n_valid is None else n_valid
    direct = bias is None and accumulate_into is None and out_dtype in (torch.bfloat16, torch.float32)
    c = torch.empty(m, n_valid, dtype=out_dtype if direct else torch.float32, device=a.device)
    bf16 = c.dtype == torch.bfloat16
    if cfg.b_layout == "preshuffle16":
        launch = _launcher(cfg, n, k, None, bf16, n_valid)
    else:
        launch = _launcher(cfg, n, None, m, bf16, n_valid)
    launch(*dynamic_args(cfg, a, b, c, a_scale_inv, b_scale_inv))
    if direct:
        return c
    if accumulate_into is not None:
        return accumulate_into.add_(c)
    return c.add_(bias.float()).to(out_dtype) if bias is not None else c.to(out_dtype)
