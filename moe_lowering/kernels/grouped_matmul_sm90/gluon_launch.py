"""Launching the Hopper grouped GEMM (:mod:`.gluon_kernels`): tile configurations, descriptors, and an
offline ``sm_90`` compile for register / shared-memory checks on a machine without a GPU.

The launch here is Triton's own launcher on torch tensors (the probe ``benchmarks/gluon_gmm_probe.py``);
:mod:`.jax_launch` launches the same compiled kernels from JAX. Descriptors are host-side (``TensorDescriptor``): the launcher
encodes each into a kernel parameter, so no global scratch is allocated per launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
from triton.experimental.gluon import language as gl

from moe_lowering.kernels.grouped_matmul_sm90.gluon_kernels import (
    grouped_gemm_sm90_kernel,
    grouped_gemm_sm90_pingpong_kernel,
)
from moe_lowering.kernels.grouped_matmul_sm90.gluon_tgmm_kernels import (
    tgmm_sm90_kernel,
    tgmm_sm90_pingpong_kernel,
    tgmm_sm90_resident_kernel,
)

SM90 = (90, 128)
"""(compute capability, warp size x 4 lanes) of ``GPUTarget("cuda", 90, ...)``: Hopper."""
SHARED_LIMIT = 232448
"""Shared memory one block may use on an H100 or H200 (227 KB)."""
REGISTER_FILE = 65536


class _WarpSpecialised:
    """What both kernels' configs share: the partitions (``num_warps`` consumer warps, or with
    ``pingpong`` two warp groups of them, and a one-warp producer), their register split, the store
    path and the shared memory of the ring and the staging buffers (``staging_rows x block_n`` each)."""

    @property
    def schedule_store(self) -> str:
        """The name's tail: the consumers' split and the store path."""
        return f"{'pingpong' if self.pingpong else f'w{self.num_warps}'}-{'tma' if self.tma_store else 'direct'}"

    @property
    def maxnreg(self) -> int:
        """Registers a thread at launch: the register file over all warps (the one-warp producer takes a
        whole warp group's slots), a multiple of 8; the consumers get what the producer gives up."""
        warps = self.num_warps * (2 if self.pingpong else 1) + 4
        return min(255, REGISTER_FILE // (32 * warps)) // 8 * 8

    def register_constexprs(self) -> dict:
        return {"PRODUCER_REGS": self.producer_regs} | ({"CONSUMER_REGS": self.consumer_regs} if self.pingpong else {})

    def ring_and_staging_bytes(self, stage_bytes: int, staging_rows: int, staging_buffers: int = 1) -> int:
        """Shared memory the ring, the staging buffers (``staging_buffers`` a consumer) and the barriers
        take (bf16)."""
        buffers = (staging_buffers if self.tma_store else 1) * (2 if self.pingpong else 1)
        staging = 2 * (staging_rows if self.tma_store else 8) * self.block_n * buffers
        return self.stages * stage_bytes + staging + 16 * self.stages + 16


@dataclass(frozen=True)
class GluonTileConfig(_WarpSpecialised):
    """One launch shape: ``block_m x block_n`` output tiles reduced ``block_k`` at a time through a ring of
    ``stages``; a one-warp producer held to ``producer_regs`` registers a thread; ``tma_store``: whole
    tiles leave through shared memory and a TMA store (a ``block_m x block_n`` staging buffer per
    consumer), else every tile by masked stores.

    Cooperative (``pingpong`` false): ``num_warps`` consumer warps (4 per warp group) share every tile.
    Ping-pong: two consumer warp groups of ``num_warps`` = 4 take whole tiles in turn, each held to
    ``consumer_regs``, so one's epilogue overlaps the other's mainloop."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    stages: int = 3
    tma_store: bool = True
    pingpong: bool = False
    group_m: int = 8
    num_warps: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}-s{self.stages}-{self.schedule_store}"

    @property
    def kernel(self):
        return grouped_gemm_sm90_pingpong_kernel if self.pingpong else grouped_gemm_sm90_kernel

    def shared_bytes(self) -> int:
        return self.ring_and_staging_bytes(2 * self.block_k * (self.block_m + self.block_n), self.block_m)


CONFIGS = {c.name: c for c in (
    GluonTileConfig(128, 256, 64, stages=3, tma_store=True),
    GluonTileConfig(128, 256, 64, stages=4, tma_store=False),
    GluonTileConfig(128, 128, 64, stages=4, tma_store=True, pingpong=True, num_warps=4),
    GluonTileConfig(64, 256, 64, stages=4, tma_store=True, pingpong=True, num_warps=4),
    GluonTileConfig(128, 128, 64, stages=6, tma_store=False, pingpong=True, num_warps=4),
)}
"""The configurations the probe times; the first is the usual Hopper choice (two 64-row warp groups on
every tile), the ping-pong ones overlap each tile's epilogue with the next tile's MMAs."""


def _next_power_of_two(value: int) -> int:
    return 1 << max(0, (value - 1).bit_length())


def shared_layouts(config: GluonTileConfig, transpose_b: bool = False):
    """NVMMA shared layouts of the ``lhs``, weight and output boxes (the weight's ``[block_n, block_k]`` with
    ``transpose_b``)."""
    b_box = [config.block_n, config.block_k] if transpose_b else [config.block_k, config.block_n]
    return (gl.NVMMASharedLayout.get_default_for([config.block_m, config.block_k], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for(b_box, gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([config.block_m, config.block_n], gl.bfloat16))


@dataclass(frozen=True)
class GemmForm:
    """What a forward-kernel launch computes besides its tiles: ``transpose_b``, weights ``[E, N, K]`` read
    transposed (the input gradient); ``products``, 1 or 2 (the sum of two products over one accumulator);
    ``zero_outside``, the kernel writes zeros to the rows past the groups."""

    transpose_b: bool = False
    products: int = 1
    zero_outside: bool = False

    def __post_init__(self):
        if self.products not in (1, 2):
            raise ValueError(f"products must be 1 or 2, got {self.products}")


def constexprs(config: GluonTileConfig, num_groups: int, form: GemmForm = GemmForm()) -> dict:
    return dict(GROUPS_PAD=max(32, _next_power_of_two(num_groups)), GROUP_M=config.group_m, STAGES=config.stages,
                TMA_STORE=config.tma_store, TRANSPOSE_B=form.transpose_b, PRODUCTS=form.products,
                ZERO_OUTSIDE=form.zero_outside) | config.register_constexprs()


def check_shapes(k: int, config: GluonTileConfig, form: GemmForm = GemmForm()):
    if k % config.block_k and not form.transpose_b:
        raise ValueError(f"K = {k} is not a multiple of block_k = {config.block_k}: a weight block would read "
                         "the next group's rows")


GEMM_DESCRIPTORS = ("a_desc", "b_desc", "a2_desc", "b2_desc", "out_desc")
"""The forward kernels' descriptor parameters, in order (the second product's read only with ``products = 2``)."""


def compile_offline(config: GluonTileConfig, num_groups: int, form: GemmForm = GemmForm()):
    """The kernel compiled for ``sm_90`` without a GPU (bf16 descriptors, 16-byte aligned ``int`` sizes)."""
    a_layout, b_layout, c_layout = shared_layouts(config, form.transpose_b)
    a_box = ("bf16", [config.block_m, config.block_k], a_layout)
    b_box = ("bf16", [config.block_n, config.block_k] if form.transpose_b else [config.block_k, config.block_n],
             b_layout)
    boxes = dict(zip(GEMM_DESCRIPTORS, (a_box, b_box, a_box, b_box,
                                        ("bf16", [config.block_m, config.block_n], c_layout))))
    return _compile_sm90(config, boxes, constexprs(config, num_groups, form))


def _compile_sm90(config: _WarpSpecialised, boxes: dict, fixed: dict):
    """``config.kernel`` (arguments: the descriptors ``boxes`` names, then ``out_ptr, group_sizes_ptr, M, N, K,
    E``, the streaming weight gradient's ``min_group_rows``, and the constexprs ``fixed``) compiled for
    ``sm_90``; ``boxes``: each descriptor's ``(type, box, layout)`` by parameter name, ``out_desc``'s type also
    ``out_ptr``'s; pointers, ``N`` and ``K`` taken 16-byte aligned."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature = {name: f"tensordesc<{dtype}{box},{layout!r}>" for name, (dtype, box, layout) in boxes.items()}
    signature |= {"out_ptr": f"*{boxes['out_desc'][0]}", "group_sizes_ptr": "*i32", "M": "i32", "N": "i32",
                  "K": "i32", "E": "i32"}
    names = config.kernel.arg_names
    if "min_group_rows" in names:  # the streaming weight gradient: the groups it leaves to the resident kernel
        signature["min_group_rows"] = "i32"
    signature |= {name: "constexpr" for name in fixed}
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in ("out_ptr", "group_sizes_ptr", "N", "K")}
    source = GluonASTSource(fn=config.kernel, signature=signature, constexprs=fixed, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", *SM90),
                          options={"num_warps": config.num_warps, "maxnreg": config.maxnreg})


def make_launch(lhs, rhs, group_sizes, out, config: GluonTileConfig, num_sms: int | None = None,
                form: GemmForm = GemmForm(), lhs2=None, rhs2=None):
    """A callable that runs ``out[r] = lhs[r] @ rhs[group(r)]`` on torch CUDA tensors (``lhs [M, K]`` bf16,
    ``rhs [E, K, N]`` bf16 (``[E, N, K]`` with ``form.transpose_b``), ``group_sizes [E]`` int32, ``out [M, N]``
    bf16; with ``form.products = 2`` plus ``lhs2[r] @ rhs2[group(r)]``), its descriptors built once; rows past
    ``sum(group_sizes)`` keep what ``out`` held."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_rows, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if form.transpose_b else rhs.shape[2]
    check_shapes(k, config, form)
    if num_rows == 0:
        return lambda: None
    a_layout, b_layout, c_layout = shared_layouts(config, form.transpose_b)
    b_box = [config.block_n, config.block_k] if form.transpose_b else [config.block_k, config.block_n]

    def operand_descriptors(a, b):
        return (TensorDescriptor.from_tensor(a, [config.block_m, config.block_k], a_layout),
                TensorDescriptor.from_tensor(b.reshape(num_groups * b.shape[1], b.shape[2]), b_box, b_layout))

    descriptors = operand_descriptors(lhs, rhs)
    descriptors += descriptors if form.products == 1 else operand_descriptors(lhs2, rhs2)
    out_desc = TensorDescriptor.from_tensor(out, [config.block_m, config.block_n], c_layout)
    num_sms = num_sms or torch.cuda.get_device_properties(lhs.device).multi_processor_count
    max_tiles = (triton.cdiv(num_rows, config.block_m) + num_groups) * triton.cdiv(n, config.block_n)
    grid = (max(1, min(num_sms, max_tiles)), )
    fixed = constexprs(config, num_groups, form)

    def launch():
        config.kernel[grid](*descriptors, out_desc, out, group_sizes, num_rows, n, k, num_groups, **fixed,
                            num_warps=config.num_warps, maxnreg=config.maxnreg)

    return launch


def gmm(lhs, rhs, group_sizes, config: GluonTileConfig = CONFIGS[next(iter(CONFIGS))], num_sms: int | None = None,
        out=None):
    """``out[r] = lhs[r] @ rhs[group(r)]`` (see :func:`make_launch`), into a new ``out`` unless one is given."""
    import torch

    if out is None:
        out = torch.empty((lhs.shape[0], rhs.shape[2]), dtype=lhs.dtype, device=lhs.device)
    make_launch(lhs, rhs, group_sizes, out, config, num_sms)()
    return out


# ------------------------------------------------------------------------------ the weight gradient


@dataclass(frozen=True)
class GluonTgmmConfig(_WarpSpecialised):
    """One launch shape of ``tgmm_sm90_kernel``: ``block_k x block_n`` tiles of a group's ``[K, N]``
    weight gradient, reduced over the group's rows ``block_m`` at a time through a ring of ``stages``;
    ``num_warps`` consumer warps (a warp group per 64 of ``block_k``), a one-warp producer held to
    ``producer_regs``; ``tma_store``: tiles leave through a ``block_k x block_n`` staging buffer and a
    TMA store (bf16 output with ``K % block_k == 0`` only: the launch falls back to masked stores
    otherwise); ``group_m``: k tiles per band of the swizzle (programs at once share row blocks).
    ``pingpong``: two consumer warp groups of ``num_warps`` = 4 take whole tiles in turn, each held to
    ``consumer_regs`` (as :class:`GluonTileConfig`'s).

    ``tail_rows``: a group's last, partial row block is multiplied in chunks of this many rows, only
    those holding the group's rows, and zeroed past the group in one chunk (``None``: the whole block,
    zeroed past the group); small groups take such a block every tile. ``staging``: the TMA store's
    staging buffers (cooperative only), taken in turn so a tile's store drains under the next ones.

    ``resident_blocks``: keep a group's ``dout`` columns (up to this many ``block_m``-row blocks) in shared
    memory over ``k_chunk`` consecutive k tiles and stream only ``lhs`` (``tgmm_sm90_resident_kernel``,
    cooperative, one staging buffer), for the groups that fit them; the longer groups take a second launch
    of :data:`LONG_GROUPS_TGMM_CONFIG` (:meth:`launches`). 0: one launch, both operands every tile."""

    block_k: int = 128
    block_n: int = 256
    block_m: int = 64
    stages: int = 3
    tma_store: bool = True
    pingpong: bool = False
    group_m: int = 8
    num_warps: int = 8
    producer_regs: int = 40
    consumer_regs: int = 232
    tail_rows: int | None = None
    staging: int = 1
    resident_blocks: int = 0
    k_chunk: int = 8

    def __post_init__(self):
        if self.resident_blocks and (self.pingpong or self.staging != 1 or self.tail_rows is None):
            raise ValueError("a resident dout: cooperative, one staging buffer, tail chunks")
        if self.tail_rows is not None and (self.tail_rows % 16 or self.block_m % self.tail_rows):
            raise ValueError(f"tail_rows = {self.tail_rows}: a multiple of 16 (a wgmma's K) dividing block_m")
        if self.staging not in (1, 2) or (self.pingpong and self.staging != 1):
            raise ValueError(f"staging = {self.staging}: 1 or 2 buffers, 1 with ping-pong")

    @property
    def name(self) -> str:
        tail = "" if self.tail_rows is None else f"-t{self.tail_rows}"
        staging = "" if self.staging == 1 else f"-c{self.staging}"
        resident = f"-d{self.resident_blocks}x{self.k_chunk}" if self.resident_blocks else ""
        return (f"tgmm-{self.block_k}x{self.block_n}-r{self.block_m}-s{self.stages}{tail}{staging}{resident}-"
                f"{self.schedule_store}")

    @property
    def kernel(self):
        if self.resident_blocks:
            return tgmm_sm90_resident_kernel
        return tgmm_sm90_pingpong_kernel if self.pingpong else tgmm_sm90_kernel

    @property
    def resident_rows(self) -> int:
        """The longest group the resident kernel takes (0: no resident ``dout``)."""
        return self.resident_blocks * self.block_m

    def launches(self) -> tuple[tuple[GluonTgmmConfig, int | None], ...]:
        """The kernels a weight gradient on this configuration launches, in order, each with its
        ``min_group_rows`` (``None``: the resident kernel, which takes the groups of at most
        :attr:`resident_rows`): every group is written by exactly one of them, decided on the device."""
        if not self.resident_blocks:
            return ((self, 0), )
        return ((self, None), (LONG_GROUPS_TGMM_CONFIG, self.resident_rows + 1))

    def work_items(self, num_groups: int, k: int, n: int) -> int:
        """The kernel's work items: output tiles, or with a resident ``dout`` ``(group, k chunk, n tile)``."""
        k_tiles = triton.cdiv(k, self.block_k)
        if self.resident_blocks:
            k_tiles = triton.cdiv(k_tiles, self.k_chunk)
        return num_groups * k_tiles * triton.cdiv(n, self.block_n)

    def shared_bytes(self) -> int:
        if self.resident_blocks:  # a ring of lhs boxes, the resident dout blocks and their two barriers
            resident = self.resident_blocks * 2 * self.block_m * self.block_n
            return self.ring_and_staging_bytes(2 * self.block_m * self.block_k, self.block_k) + resident + 16
        return self.ring_and_staging_bytes(2 * self.block_m * (self.block_k + self.block_n), self.block_k,
                                           self.staging)


TGMM_CONFIGS = {c.name: c for c in (
    GluonTgmmConfig(128, 256, 64, stages=3, tma_store=True),
    GluonTgmmConfig(128, 256, 64, stages=4, tma_store=False),
    GluonTgmmConfig(128, 128, 128, stages=3, tma_store=True),
    GluonTgmmConfig(128, 128, 64, stages=6, tma_store=True),
    GluonTgmmConfig(128, 128, 64, stages=4, tma_store=True, pingpong=True, num_warps=4),
    GluonTgmmConfig(64, 256, 64, stages=4, tma_store=True, pingpong=True, num_warps=4),
    GluonTgmmConfig(128, 256, 64, stages=3, tma_store=True, tail_rows=16),
    GluonTgmmConfig(128, 256, 64, stages=2, tma_store=True, tail_rows=16, staging=2),
    GluonTgmmConfig(128, 256, 32, stages=4, tma_store=True, tail_rows=16, staging=2),
    GluonTgmmConfig(128, 256, 32, stages=4, tma_store=True, tail_rows=16),
    GluonTgmmConfig(128, 128, 64, stages=4, tma_store=True, tail_rows=16, staging=2),
    GluonTgmmConfig(128, 256, 64, stages=4, tma_store=True, tail_rows=16, resident_blocks=3, k_chunk=8),
    GluonTgmmConfig(128, 256, 64, stages=4, tma_store=True, tail_rows=16, resident_blocks=3, k_chunk=4),
    GluonTgmmConfig(128, 256, 64, stages=6, tma_store=True, tail_rows=16, resident_blocks=2, k_chunk=8),
)}
"""The weight-gradient configurations the probe times: ``tgmm_kernel``'s 128 x 256 tile over 64-row
blocks (the first), 128 x 128 tiles over longer row blocks or a deeper ring, ping-pong ones (a
tile's epilogue under the other warp group's MMAs), 16-row tail chunks and two staging buffers, and a
resident ``dout`` (``-d<blocks>x<k tiles>``) for small groups."""

LONG_GROUPS_TGMM_CONFIG = TGMM_CONFIGS["tgmm-128x256-r64-s3-t16-w8-tma"]
"""The groups past a resident configuration's rows: the streaming kernel, which the probe measured best at
every group size it ran (``gluon_gmm_probe_tgmm_H200_2026-11-28``)."""


def tgmm_shared_layouts(config: GluonTgmmConfig, out_dtype=gl.bfloat16):
    """NVMMA shared layouts of the ``lhs``, ``dout`` and output boxes."""
    return (gl.NVMMASharedLayout.get_default_for([config.block_m, config.block_k], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([config.block_m, config.block_n], gl.bfloat16),
            gl.NVMMASharedLayout.get_default_for([config.block_k, config.block_n], out_dtype))


def tgmm_constexprs(config: GluonTgmmConfig) -> dict:
    if config.resident_blocks:
        return dict(STAGES=config.stages, TMA_STORE=config.tma_store, TAIL_ROWS=config.tail_rows,
                    RES_BLOCKS=config.resident_blocks, K_CHUNK=config.k_chunk) | config.register_constexprs()
    staging = {} if config.pingpong else {"STAGING": config.staging}  # ping-pong: a buffer per warp group
    return dict(GROUP_M=config.group_m, STAGES=config.stages, TMA_STORE=config.tma_store,
                TAIL_ROWS=config.tail_rows or config.block_m) | staging | config.register_constexprs()


def compile_tgmm_offline(config: GluonTgmmConfig, out_dtype: str = "bf16"):
    """``tgmm_sm90_kernel`` compiled for ``sm_90`` without a GPU (bf16 operands, ``out_dtype`` ``"bf16"`` or
    ``"fp32"`` output, 16-byte aligned ``int`` sizes)."""
    a_layout, b_layout, c_layout = tgmm_shared_layouts(config, gl.bfloat16 if out_dtype == "bf16" else gl.float32)
    boxes = {"a_desc": ("bf16", [config.block_m, config.block_k], a_layout),
             "b_desc": ("bf16", [config.block_m, config.block_n], b_layout),
             "out_desc": (out_dtype, [config.block_k, config.block_n], c_layout)}
    return _compile_sm90(config, boxes, tgmm_constexprs(config))


def launched_tgmm_config(config: GluonTgmmConfig, k: int, out_dtype_is_bf16: bool) -> GluonTgmmConfig:
    """``config`` as launched: masked stores where a TMA store cannot go (a float32 staging buffer would
    not fit beside the ring; a ``block_k`` tile past ``K`` would write the next group's rows)."""
    from dataclasses import replace

    if config.tma_store and (k % config.block_k or not out_dtype_is_bf16):
        return replace(config, tma_store=False)
    return config


def make_tgmm_launch(lhs, dout, group_sizes, out, config: GluonTgmmConfig, num_sms: int | None = None):
    """A callable that writes ``out[g] = lhs[rows of g]^T @ dout[rows of g]`` on torch CUDA tensors (``lhs
    [M, K]`` bf16, ``dout [M, N]`` bf16, ``group_sizes [E]`` int32, ``out [E, K, N]`` bf16 or float32),
    its descriptors built once; every group's ``out[g]`` is written (zeros for empty groups), by the
    kernels of ``config.launches()``."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_rows, k = lhs.shape
    num_groups, _, n = out.shape
    if dout.shape[0] != num_rows or out.shape[1] != k or dout.shape[1] != n:
        raise ValueError(f"tgmm: lhs {tuple(lhs.shape)}, dout {tuple(dout.shape)} and out {tuple(out.shape)} disagree")
    if k % 8 or n % 8:
        raise ValueError(f"tgmm: K = {k} and N = {n} must be multiples of 8 (16-byte TMA strides)")
    if num_groups == 0:
        return lambda: None
    if num_rows == 0:
        return out.zero_
    num_sms = num_sms or torch.cuda.get_device_properties(lhs.device).multi_processor_count
    out_gl = gl.bfloat16 if out.dtype == torch.bfloat16 else gl.float32
    launches = []
    for launch_config, min_group_rows in config.launches():
        launch_config = launched_tgmm_config(launch_config, k, out.dtype == torch.bfloat16)
        a_layout, b_layout, c_layout = tgmm_shared_layouts(launch_config, out_gl)
        descriptors = (
            TensorDescriptor.from_tensor(lhs, [launch_config.block_m, launch_config.block_k], a_layout),
            TensorDescriptor.from_tensor(dout, [launch_config.block_m, launch_config.block_n], b_layout),
            TensorDescriptor.from_tensor(out.view(num_groups * k, n), [launch_config.block_k, launch_config.block_n],
                                         c_layout))
        grid = (max(1, min(num_sms, launch_config.work_items(num_groups, k, n))), )
        scalars = (num_rows, n, k, num_groups) + (() if min_group_rows is None else (min_group_rows, ))
        launches.append((launch_config, grid, descriptors, scalars, tgmm_constexprs(launch_config)))

    def launch():
        for launch_config, grid, descriptors, scalars, fixed in launches:
            launch_config.kernel[grid](*descriptors, out, group_sizes, *scalars, **fixed,
                                       num_warps=launch_config.num_warps, maxnreg=launch_config.maxnreg)

    return launch


def tgmm(lhs, dout, group_sizes, config: GluonTgmmConfig = next(iter(TGMM_CONFIGS.values())),
         num_sms: int | None = None, out=None, out_dtype=None):
    """``out[g] = lhs[rows of g]^T @ dout[rows of g]`` (see :func:`make_tgmm_launch`), into a new ``[E, K, N]``
    ``out`` of ``out_dtype`` (``lhs``'s, as ``grouped_matmul.triton_launch.tgmm`` returns) unless one is given."""
    import torch

    if out is None:
        out = torch.empty((group_sizes.shape[0], lhs.shape[1], dout.shape[1]), dtype=out_dtype or lhs.dtype,
                          device=lhs.device)
    make_tgmm_launch(lhs, dout, group_sizes, out, config, num_sms)()
    return out
