"""tilemm's own CuTe-DSL block-scaled GEMM for Blackwell datacenter GPUs (sm_100a, tcgen05).

    out[m, n] = alpha * sum_k (A[m, k] * SFA[m, k // block]) * (B[n, k] * SFB[n, k // block])

with A (M, K) row-major, B the (N, K) weight (K-major), SFA / SFB in tilemm's 32x4x4 layout
(``swizzle.swizzle_32_4_4``) and the sum accumulated in fp32 in tensor memory (TMEM). This is the
cross-check path for the cuTile kernels: it shares no code with them (the scale layout, the MMA and the
epilogue are all built from CuTe-DSL parts), so agreement between the two is evidence for both.

This module imports ``cutlass``; ``tilemm.cute`` imports it lazily. The public entry points,
``tilemm.cute.block_scaled_matmul`` and ``tilemm.cute.compile_for_sm100``, validate their arguments
there and call :func:`compile_kernel` / :func:`launch` here.

Section names in comments ("guide: ...") refer to the tcgen05 MMA programming guide of the CuTe DSL
(``tcgen05-mma-programming-guide.rst``, "Block-scaled MMA" and "Complete Workflow").

One CTA of 128 threads (four warps) computes one 128 x 128 output tile:

    warp 0      TMA producer: A, B, SFA, SFB tiles, GMEM -> SMEM, NUM_STAGES deep ring
    warp 1      MMA issuer:   SFA, SFB SMEM -> TMEM (tcgen05.cp), then tcgen05.mma.block_scale
    warps 0-3   epilogue:     accumulator TMEM -> registers (tcgen05.ld), * alpha, masked store

Each k-tile is 128 bytes of K per row (128 fp8 or 256 fp4 elements): four MMA instructions of
K = 32 (MXF8F6F4) or K = 64 (MXF4, MXF4NVF4). Tails in M, N and K need no special code: TMA fills
out-of-bounds A / B elements with zeros, the scale tensors are padded to whole 128 x 4 tiles by
tilemm's swizzle (padding is zero bytes), and the store is masked.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_utils
import cuda.bindings.driver as cuda
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_ptr
from cutlass.memory import SmemAllocator, TmemAllocator

__all__ = ["KernelFormat", "KERNEL_FORMATS", "OUT_DTYPES", "BlockScaledGemmSm100", "CompiledGemm",
           "compile_kernel", "launch", "scale_factor_offsets", "GPU_ARCH"]

GPU_ARCH = "sm_100a"

TILE_M = 128  # rows of A per CTA: one tcgen05 MMA with M = 128 (cta_group::1)
TILE_N = 128  # rows of B per CTA: the MMA's N
MMAS_PER_K_TILE = 4  # MMA instructions per k-tile: 4 x 32 B of K = one 128-byte (SW128) row
NUM_STAGES = 4  # depth of the SMEM ring between the TMA warp and the MMA warp
THREADS = 128  # four warps; the TMEM accumulator has 128 lanes, one per thread in the epilogue
TMA_WARP = 0
MMA_WARP = 1
# TMEM columns to allocate (a power of two): the 128 fp32 accumulator columns, then SFA and SFB.
TMEM_COLUMNS = 256


@dataclasses.dataclass(frozen=True)
class KernelFormat:
    """What the kernel needs to know about one of tilemm's block-scaled formats.

    ``name`` is the ``tilemm.formats.Format`` name; everything else is the CuTe-DSL spelling of the
    same facts (element type, scale type, elements per scale) plus the MMA instruction's K.
    """

    name: str
    element: type
    scale: type
    block: int  # sf_vec_size: K elements per scale
    mma_k: int  # K of one tcgen05.mma.block_scale instruction
    ptx_kind: str  # the instruction's ``.kind`` in PTX, checked in the compiled code by the tests

    @property
    def k_tile(self) -> int:
        """K elements per pipeline stage."""
        return self.mma_k * MMAS_PER_K_TILE


KERNEL_FORMATS = {
    f.name: f
    for f in (
        KernelFormat("mxfp8_e4m3", cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU, 32, 32, "mxf8f6f4"),
        KernelFormat("mxfp8_e5m2", cutlass.Float8E5M2, cutlass.Float8E8M0FNU, 32, 32, "mxf8f6f4"),
        # MXF4 is emitted as kind::mxf4nvf4 with block32 (ue8m0) scales, the same operation.
        KernelFormat("mxfp4", cutlass.Float4E2M1FN, cutlass.Float8E8M0FNU, 32, 64, "mxf4nvf4"),
        KernelFormat("nvfp4", cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, 16, 64, "mxf4nvf4"),
    )
}

# torch dtype name -> CuTe numeric type of the output.
OUT_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def scale_factor_layout(rows, k, block: int):
    """The CuTe layout of one operand's scales: (row, k element, batch) -> byte offset.

    Built from the tcgen05 scale-factor atom (PTX ISA "tcgen05 block scaling", the 32x4x4 "K-major"
    layout): 32 lanes x 4 sub-tiles of rows by 4 scales, each scale broadcast over ``block`` K
    elements (stride 0), the atom repeated K-fastest, then over 128-row tiles. The CPU test checks
    that this equals ``swizzle.swizzle_index`` at every coordinate.
    """
    return blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), block)


class BlockScaledGemmSm100:
    """A block-scaled GEMM for one (format, output dtype) pair; M, N, K are runtime values."""

    def __init__(self, fmt: KernelFormat, out_dtype: type):
        self.fmt = fmt
        self.out_dtype = out_dtype
        self.mma_tiler = (TILE_M, TILE_N, fmt.k_tile)

    # ----------------------------------------------------------------------------------------------
    # Host side: tensors, MMA, SMEM layouts, TMA descriptors, launch (guide: "Complete Workflow").
    # ----------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, a_ptr: cute.Pointer, b_ptr: cute.Pointer, sfa_ptr: cute.Pointer,
                 sfb_ptr: cute.Pointer, out_ptr: cute.Pointer, alpha_ptr: cute.Pointer,
                 m: cutlass.Int32, n: cutlass.Int32, k: cutlass.Int32, stream: cuda.CUstream):
        fmt = self.fmt
        # K is a multiple of 32 (checked by the caller), so every row of A and B starts on a 16-byte
        # boundary, as TMA requires; saying so lets the DSL prove it.
        k32 = cute.assume(k, divby=32)
        mA = cute.make_tensor(a_ptr, cute.make_layout((m, k32), stride=(k32, 1)))
        mB = cute.make_tensor(b_ptr, cute.make_layout((n, k32), stride=(k32, 1)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((m, n), stride=(n, 1)))
        # The scale helpers speak (rows, K, batch); tilemm's scales here have no batch: take batch 0.
        mSFA = cute.make_tensor(sfa_ptr, scale_factor_layout(m, k32, fmt.block))[(None, None, 0)]
        mSFB = cute.make_tensor(sfb_ptr, scale_factor_layout(n, k32, fmt.block))[(None, None, 0)]
        mAlpha = cute.make_tensor(alpha_ptr, cute.make_layout(1))

        # guide "Block-scaled MMA" 1: the op is chosen from (element type, scale type, block):
        # MXF8F6F4 for fp8 with e8m0 / 32, MXF4 for fp4 with e8m0 / 32, MXF4NVF4 for fp4 with e4m3 / 16.
        # Both operands K-major, A read from SMEM, one CTA per MMA.
        tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            fmt.element, fmt.element, OperandMajorMode.K, OperandMajorMode.K, fmt.scale, fmt.block,
            tcgen05.CtaGroup.ONE, self.mma_tiler[:2])

        # guide "Creating SMEM layouts for A and B" and "Block-scaled MMA" 2: staged SMEM layouts,
        # 128-byte swizzled for A / B, the 32x4x4 atom for the scales.
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, fmt.element, NUM_STAGES)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, fmt.element, NUM_STAGES)
        sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, fmt.block, NUM_STAGES)
        sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, fmt.block, NUM_STAGES)

        # guide "Block-scaled MMA" 3: four TMA descriptors, one stage's box each. The scales move as
        # 16-bit items (internal_type), the narrowest element TMA's box layout takes for them.
        cluster = cute.make_layout((1, 1, 1, 1)).shape  # no clusters: (V, M, N, K) all 1
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        one_stage = (None, None, None, 0)
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mA, cute.slice_(a_smem, one_stage), self.mma_tiler, tiled_mma, cluster)
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mB, cute.slice_(b_smem, one_stage), self.mma_tiler, tiled_mma, cluster)
        tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(
            g2s, mSFA, cute.slice_(sfa_smem, one_stage), self.mma_tiler, tiled_mma, cluster,
            internal_type=cutlass.Int16)
        tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, mSFB, cute.slice_(sfb_smem, one_stage), self.mma_tiler, tiled_mma, cluster,
            internal_type=cutlass.Int16)
        # Bytes one stage's four loads deliver: the "full" barrier of a stage completes on this count.
        stage_bytes = (cute.size_in_bytes(fmt.element, cute.slice_(a_smem, one_stage))
                       + cute.size_in_bytes(fmt.element, cute.slice_(b_smem, one_stage))
                       + cute.size_in_bytes(fmt.scale, cute.slice_(sfa_smem, one_stage))
                       + cute.size_in_bytes(fmt.scale, cute.slice_(sfb_smem, one_stage)))

        grid = (cute.ceil_div(m, TILE_M), cute.ceil_div(n, TILE_N), 1)
        self.kernel(tiled_mma, tma_a, tma_mA, tma_b, tma_mB, tma_sfa, tma_mSFA, tma_sfb, tma_mSFB,
                    mOut, mAlpha, a_smem, b_smem, sfa_smem, sfb_smem, stage_bytes).launch(
            grid=grid, block=(THREADS, 1, 1), cluster=(1, 1, 1), stream=stream)

    # ----------------------------------------------------------------------------------------------
    # Device side.
    # ----------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma,
               tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
               tma_sfa: cute.CopyAtom, mSFA: cute.Tensor, tma_sfb: cute.CopyAtom, mSFB: cute.Tensor,
               mOut: cute.Tensor, mAlpha: cute.Tensor,
               a_smem: cute.ComposedLayout, b_smem: cute.ComposedLayout,
               sfa_smem: cute.Layout, sfb_smem: cute.Layout, stage_bytes: cutlass.Constexpr):
        fmt = self.fmt
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tile_m, tile_n, _ = cute.arch.block_idx()
        tile_coord = (tile_m, tile_n, None)  # (M tile, N tile, every k-tile)

        # --- SMEM: the staged operand buffers and the two pipelines' mbarriers ----------------------
        smem = SmemAllocator()
        sA = smem.allocate_tensor(element_type=fmt.element, layout=a_smem.outer, byte_alignment=128,
                                  swizzle=a_smem.inner)  # (MMA, MMA_M, MMA_K, STAGE)
        sB = smem.allocate_tensor(element_type=fmt.element, layout=b_smem.outer, byte_alignment=128,
                                  swizzle=b_smem.inner)  # (MMA, MMA_N, MMA_K, STAGE)
        sSFA = smem.allocate_tensor(element_type=fmt.scale, layout=sfa_smem, byte_alignment=128)
        sSFB = smem.allocate_tensor(element_type=fmt.scale, layout=sfb_smem, byte_alignment=128)

        # Operand ring: TMA (one elected thread of the TMA warp) fills a stage; the MMA warp's
        # tcgen05.commit empties it once the MMAs that read it are done.
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        load_ring, mma_ring = pipeline.PipelineTmaUmma.create(
            num_stages=NUM_STAGES, producer_group=one_thread, consumer_group=one_thread,
            tx_count=stage_bytes).make_participants()
        # Accumulator hand-off: the MMA warp commits once; all 128 threads wait before reading TMEM.
        acc_ready_producer, acc_ready_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1, producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS),
        ).make_participants()

        # --- This CTA's tiles: (tile, k-tile) views of the GMEM tensors (guide "Partitioning") --------
        thr_mma = tiled_mma.get_slice(0)  # one CTA per MMA: the whole tile is ours
        gA = cute.local_tile(mA, self.mma_tiler, tile_coord, proj=(1, None, 1))  # (128, Kt, k)
        gB = cute.local_tile(mB, self.mma_tiler, tile_coord, proj=(None, 1, 1))  # (128, Kt, k)
        gSFA = cute.local_tile(mSFA, self.mma_tiler, tile_coord, proj=(1, None, 1))
        gSFB = cute.local_tile(mSFB, self.mma_tiler, tile_coord, proj=(None, 1, 1))
        tCgA = thr_mma.partition_A(gA)  # (MMA, MMA_M, MMA_K, k)
        tCgB = thr_mma.partition_B(gB)  # (MMA, MMA_N, MMA_K, k)
        tCgSFA = thr_mma.partition_A(gSFA)
        tCgSFB = thr_mma.partition_B(gSFB)
        num_k_tiles = cute.size(gA, mode=[2])

        # TMA views: ((atom_v, rest_v), STAGE) in SMEM and ((atom_v, rest_v), k) in GMEM. The scale
        # views repeat each byte over `block` K elements (stride 0); filter_zeros drops those modes.
        def tma_views(atom, s, g):
            s_view, g_view = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(s, 0, 3), cute.group_modes(g, 0, 3))
            return cute.filter_zeros(s_view), cute.filter_zeros(g_view)

        tAsA, tAgA = tma_views(tma_a, sA, tCgA)
        tBsB, tBgB = tma_views(tma_b, sB, tCgB)
        tAsSFA, tAgSFA = tma_views(tma_sfa, sSFA, tCgSFA)
        tBsSFB, tBgSFB = tma_views(tma_sfb, sSFB, tCgSFB)

        # --- TMEM: accumulator, then SFA and SFB (guide "Making Fragments" 2, "Block-scaled MMA" 4) ---
        tCrA = tiled_mma.make_fragment_A(sA)  # SMEM descriptors, (MMA, MMA_M, MMA_K, STAGE)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_layout = tiled_mma.make_fragment_C(tiled_mma.partition_shape_C(self.mma_tiler[:2])).layout
        sfa_tmem_layout = blockscaled_utils.make_tmem_layout_sfa(
            tiled_mma, self.mma_tiler, fmt.block, cute.slice_(sfa_smem, (None, None, None, 0)))
        sfb_tmem_layout = blockscaled_utils.make_tmem_layout_sfb(
            tiled_mma, self.mma_tiler, fmt.block, cute.slice_(sfb_smem, (None, None, None, 0)))

        tmem = TmemAllocator(barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=THREADS),
                             allocator_warp_id=TMA_WARP)
        tmem_pool = tmem.reserve(TMEM_COLUMNS)  # the TMA warp allocates; everyone waits for the address
        tCtAcc = tmem_pool.allocate_tensor(acc_layout, cutlass.Float32)  # (MMA, MMA_M, MMA_N)
        tCtSFA = tmem_pool.allocate_tensor(sfa_tmem_layout, fmt.scale)  # (MMA, MMA_M, MMA_K)
        tCtSFB = tmem_pool.allocate_tensor(sfb_tmem_layout, fmt.scale)  # (MMA, MMA_N, MMA_K)

        # SMEM -> TMEM copies of the scales (tcgen05.cp.4x32x128b: one 32x4x4 atom per instruction),
        # issued by the MMA warp just before the MMAs that read them.
        s2t_atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), fmt.scale)

        def s2t_views(sSF, tCtSF):
            tCtSF_compact = cute.filter_zeros(tCtSF)
            s2t = tcgen05.make_s2t_copy(s2t_atom, tCtSF_compact)
            thr_s2t = s2t.get_slice(0)
            src = tcgen05.get_s2t_smem_desc_tensor(s2t, thr_s2t.partition_S(cute.filter_zeros(sSF)))
            return s2t, src, thr_s2t.partition_D(tCtSF_compact)

        s2t_sfa, s2t_sSFA, s2t_tSFA = s2t_views(sSFA, tCtSFA)
        s2t_sfb, s2t_sSFB, s2t_tSFB = s2t_views(sSFB, tCtSFB)

        # --- Warp 0: TMA producer --------------------------------------------------------------------
        if warp == TMA_WARP:
            for k_tile in cutlass.range(num_k_tiles):
                stage = load_ring.acquire_and_advance()  # wait until the MMAs freed this stage
                src, dst = (None, k_tile), (None, stage.index)
                cute.copy(tma_a, tAgA[src], tAsA[dst], tma_bar_ptr=stage.barrier)
                cute.copy(tma_b, tBgB[src], tBsB[dst], tma_bar_ptr=stage.barrier)
                cute.copy(tma_sfa, tAgSFA[src], tAsSFA[dst], tma_bar_ptr=stage.barrier)
                cute.copy(tma_sfb, tBgSFB[src], tBsSFB[dst], tma_bar_ptr=stage.barrier)
            # Wait until the MMA warp's last releases (asynchronous tcgen05.commit arrives) have
            # landed, so that none reaches an mbarrier after the CTA has exited.
            load_ring.tail()

        # --- Warp 1: MMA issuer (guide "Executing the GEMM" with the block-scaled changes) -----------
        if warp == MMA_WARP:
            acc_slot = acc_ready_producer.acquire_and_advance()
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)  # the first MMA overwrites the accumulator
            for k_tile in cutlass.range(num_k_tiles):
                stage = mma_ring.wait_and_advance()  # A, B, SFA, SFB of this k-tile are in SMEM
                s2t_stage = (None, None, None, None, stage.index)
                cute.copy(s2t_sfa, s2t_sSFA[s2t_stage], s2t_tSFA)
                cute.copy(s2t_sfb, s2t_sSFB[s2t_stage], s2t_tSFB)
                for kb in cutlass.range_constexpr(MMAS_PER_K_TILE):
                    # Each instruction reads its own K slice of the operands and of the scales.
                    tiled_mma.set(tcgen05.Field.SFA, tCtSFA[(None, None, kb)].iterator)
                    tiled_mma.set(tcgen05.Field.SFB, tCtSFB[(None, None, kb)].iterator)
                    cute.gemm(tiled_mma, tCtAcc, tCrA[(None, None, kb, stage.index)],
                              tCrB[(None, None, kb, stage.index)], tCtAcc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                stage.release()  # tcgen05.commit: the stage is free once these MMAs complete
            acc_slot.commit()  # tcgen05.commit: the accumulator is final once all MMAs complete

        # --- All warps: epilogue (guide "Reading the accumulator from TMEM") -------------------------
        # tcgen05.ld.32x32b: warp w reads TMEM lanes 32w..32w+31, i.e. thread t owns output row t of
        # the tile, all 128 columns.
        t2r = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32), tCtAcc)
        thr_t2r = t2r.get_slice(tidx)
        gOut = cute.local_tile(mOut, self.mma_tiler, tile_coord, proj=(1, 1, None))  # (128, 128)
        cOut = cute.local_tile(cute.make_identity_tensor(mOut.shape), self.mma_tiler, tile_coord,
                               proj=(1, 1, None))  # the (m, n) coordinate of every element
        tTR_tAcc = thr_t2r.partition_S(tCtAcc)
        tTR_gOut = thr_t2r.partition_D(thr_mma.partition_C(gOut))
        tTR_cOut = thr_t2r.partition_D(thr_mma.partition_C(cOut))
        tTR_rAcc = cute.make_rmem_tensor(tTR_gOut.shape, cutlass.Float32)
        tTR_rOut = cute.make_rmem_tensor(tTR_gOut.shape, self.out_dtype)

        tmem.relinquish_alloc_permit()
        alpha = mAlpha[0]  # fp32; for NVFP4 it already holds global_scale_a * global_scale_b
        acc_ready = acc_ready_consumer.wait_and_advance()
        cute.copy(t2r, tTR_tAcc, tTR_rAcc)
        cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the registers hold the values now
        acc_ready.release()
        # One rounding, RNE, after the fp32 multiply by alpha (docs/numerics.md, "Matmuls").
        tTR_rOut.store((tTR_rAcc.load() * alpha).to(self.out_dtype))
        rows, cols = mOut.shape[0], mOut.shape[1]
        for i in cutlass.range(cute.size(tTR_rOut), unroll_full=True):
            crd = tTR_cOut[i]
            if crd[0] < rows and crd[1] < cols:  # rows / columns past M / N are not ours to write
                tTR_gOut[i] = tTR_rOut[i]

        cute.arch.barrier()  # every warp has read TMEM before it is freed
        tmem.free(tmem_pool.base_ptr)


# --------------------------------------------------------------------------------------------------
# Compilation and launch
# --------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CompiledGemm:
    """A kernel compiled for sm_100a, with the artefacts the compile-only tests inspect."""

    fmt: KernelFormat
    out_dtype: str
    arch: str
    function: object  # the DSL's compiled callable
    ptx: str
    cubin: bytes
    seconds: float


def _fake_ptr(dtype, align: int):
    """A typed GMEM pointer that only fixes the kernel's signature (value 0 is never dereferenced)."""
    return make_ptr(dtype, 0, cute.AddressSpace.gmem, assumed_align=align)


@functools.lru_cache(maxsize=None)
def compile_kernel(fmt_name: str, out_dtype: str, arch: str = GPU_ARCH) -> CompiledGemm:
    """Compile (once per process) the kernel for ``fmt_name`` and ``out_dtype`` for ``arch``.

    Needs no GPU: the pointers are placeholders and the target is given explicitly. M, N and K are
    runtime arguments, so one compile serves every shape.
    """
    fmt = KERNEL_FORMATS[fmt_name]
    out = OUT_DTYPES[out_dtype]
    gemm = BlockScaledGemmSm100(fmt, out)
    args = (_fake_ptr(fmt.element, 16), _fake_ptr(fmt.element, 16), _fake_ptr(fmt.scale, 16),
            _fake_ptr(fmt.scale, 16), _fake_ptr(out, 16), _fake_ptr(cutlass.Float32, 4),
            cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(32), cuda.CUstream(0))
    start = time.perf_counter()
    compiled = cute.compile(gemm, *args, options=f"--gpu-arch={arch} --keep-ptx --keep-cubin "
                                                 f"--dump-dir={_dump_dir()}")
    seconds = time.perf_counter() - start
    artifacts = compiled.artifacts
    return CompiledGemm(fmt, out_dtype, arch, compiled, artifacts.PTX or "", artifacts.CUBIN or b"",
                        seconds)


@functools.cache
def _dump_dir() -> str:
    """Where the DSL writes the .ptx / .cubin it is asked to keep, and reads them back from: a folder of
    this process's own, since every format's kernel has the same name and two processes compiling at
    once (pytest-xdist workers) would otherwise read each other's files."""
    import tempfile

    return tempfile.mkdtemp(prefix="tilemm-cute-")


def launch(fmt_name: str, a, b, a_scale, b_scale, out, alpha, m: int, n: int, k: int, *,
           arch: str = GPU_ARCH) -> None:
    """Run the compiled kernel on validated CUDA tensors (see ``tilemm.cute.block_scaled_matmul``).

    ``a`` / ``b`` are the (M, K) / (N, K) data (fp8, or uint8 holding two fp4 per byte), ``a_scale``
    / ``b_scale`` the swizzled scales, ``out`` the (M, N) result and ``alpha`` a one-element fp32
    tensor, all contiguous on the current device.
    """
    import torch

    compiled = compile_kernel(fmt_name, str(out.dtype).removeprefix("torch."), arch)
    fmt = compiled.fmt
    out_type = OUT_DTYPES[compiled.out_dtype]
    ptrs = (make_ptr(fmt.element, a.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(fmt.element, b.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(fmt.scale, a_scale.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(fmt.scale, b_scale.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(out_type, out.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
            make_ptr(cutlass.Float32, alpha.data_ptr(), cute.AddressSpace.gmem, assumed_align=4))
    stream = cuda.CUstream(torch.cuda.current_stream(a.device).cuda_stream)
    compiled.function(*ptrs, cutlass.Int32(m), cutlass.Int32(n), cutlass.Int32(k), stream)


# --------------------------------------------------------------------------------------------------
# The scale layout, evaluated on the CPU
# --------------------------------------------------------------------------------------------------

_offsets: list = []


@cute.jit
def _trace_scale_offsets(rows: cutlass.Constexpr, k: cutlass.Constexpr, block: cutlass.Constexpr):
    # With static shapes the layout is evaluated while tracing: each call returns a Python int.
    layout = scale_factor_layout(rows, k, block)
    rows_pad = cute.size(layout, mode=[0])  # the layout's domain covers the padding too
    cols_pad = cute.size(layout, mode=[1]) // block
    for r in cutlass.range_constexpr(rows_pad):
        for c in cutlass.range_constexpr(cols_pad):
            _offsets.append((r, c, layout((r, c * block, 0))))


def scale_factor_offsets(rows: int, k: int, block: int):
    """Where the kernel's scale layout puts scale (r, c), for every r < round_up(rows, 128) and
    c < round_up(k // block, 4) (padding included), as an integer numpy array of that shape.

    Runs on the CPU: the layout is built with static shapes and evaluated while tracing.
    """
    import warnings

    import numpy as np

    _offsets.clear()
    with warnings.catch_warnings():  # the long static loops are the point here: they run in Python
        warnings.filterwarnings("ignore", message="This static loop has")
        _trace_scale_offsets(rows, k, block)
    if not _offsets:
        raise RuntimeError("scale_factor_offsets: the layout was not traced (a cached compile was reused)")
    r, c, offset = (np.array(v, dtype=np.int64) for v in zip(*_offsets))
    table = np.full((r.max() + 1, c.max() + 1), -1, dtype=np.int64)
    table[r, c] = offset
    return table
