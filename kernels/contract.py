"""What the Triton kernels and the PyTorch reference path agree on: sites, event kinds, the counter
block, the exp check's constants and the seed derivation of injected faults.

Both sides import this module; it imports nothing from the library, so ``kernels/`` stays a leaf.

A *counter block* is an int32 tensor of shape ``COUNTER_SHAPE = (len(SITES), len(KINDS))`` that
kernels add into on the device. Row ``SITE_INDEX[site]``, column ``KIND_INDEX[kind]`` counts the
events of that kind found at that site; inside a kernel the flat slot is ``site · len(KINDS) + kind``.

A *fault plan* is what a kernel takes as ``plan``: any object with ``for_site(site, shape, dtype,
device)`` returning ``None`` or the flips of that site for this call (``positions``: (count, ndim)
int64 coordinates in the site's logical shape, or ``None`` in BER mode; ``seed``; ``spec.bit`` /
``spec.ber``). The library's `ft_transformers.injection.FaultPlan` is one.
"""

from __future__ import annotations

import hashlib
import math
import struct

import torch

SITES: tuple[str, ...] = (
    # the values of EFTA's key loop, in the order one key block produces them (docs/algorithms.md)
    "attn.scores",  # S = Q·Kᵀ, fp32 accumulator of GEMM I
    "attn.masked_scores",  # S after step 2 (bias added, −inf where masked), as the row max and x read it
    "attn.rowmax",  # running row max m of the online softmax (after the block)
    "attn.exponent",  # x = S − m, the exponent fed to exp
    "attn.probs",  # P = exp(x), fp32
    "attn.probs_lp",  # P in the input dtype, as GEMM II reads it
    "attn.alpha",  # α = exp(m_old − m_new), the rescale of the running state
    "attn.rowsum",  # running row sum l of the online softmax (after the block)
    "attn.acc",  # the output accumulator O between key blocks (after the block)
    "attn.rowmax_carry",  # the running max m carried out of a block into the next (after the block)
    "attn.output",  # normalised output O / l, before it is stored
    "attn.checksum",  # checksum operands: GEMM I's Sc1 = Q·Kc1ᵀ and GEMM II's running Oc1
    "attn.kv_cache",  # a stored K/V cache entry, between the step that wrote it and the call that reads it
    "linear.output",  # y = x·Wᵀ + b, as the GEMM produces it
)
ATTENTION_SITES: tuple[str, ...] = (
    "attn.scores", "attn.masked_scores", "attn.rowmax", "attn.exponent", "attn.probs", "attn.probs_lp",
    "attn.alpha", "attn.rowsum", "attn.acc", "attn.rowmax_carry", "attn.output", "attn.checksum",
)
# Sites of an attention call's inputs in memory, flipped by the caller before the kernel reads them (the
# kernels' injection tables hold ATTENTION_SITES only)
CACHE_SITES: tuple[str, ...] = ("attn.kv_cache",)
LINEAR_SITES: tuple[str, ...] = ("linear.output",)
assert sorted(ATTENTION_SITES + CACHE_SITES + LINEAR_SITES) == sorted(SITES), "every site belongs to one kernel"

# Logical shape of each attention site in a call (B, Hq, M, ·): the last dim is keys (N), key blocks
# (nblocks), key blocks × head dim (one slice of D per block) or key blocks × the 2s checksum columns
# of a block (s = the checksum stride; Sc1 in columns [0, s), Oc1 in [s, 2s)), or the head dim (D).
_SITE_LAST_DIM = {
    "attn.scores": "keys", "attn.masked_scores": "keys", "attn.exponent": "keys", "attn.probs": "keys",
    "attn.probs_lp": "keys",
    "attn.rowmax": "blocks", "attn.alpha": "blocks", "attn.rowsum": "blocks", "attn.rowmax_carry": "blocks",
    "attn.acc": "blocks_d", "attn.checksum": "blocks_cs", "attn.output": "d",
}
# the sites whose fault positions count key blocks (of the reference's 64 keys), not keys or head dims
BLOCK_SITES: tuple[str, ...] = tuple(s for s, last in _SITE_LAST_DIM.items() if last.startswith("blocks"))


def kernel_head_dim(d: int) -> bool:
    """Whether the EFTA kernel (and its stored KV tables) takes head dim ``d``: a multiple of the checksum
    stride 16 (the head-dim checksum groups and ``tl.dot``'s minimum) up to 128 (one register tile)."""
    return 16 <= d <= 128 and d % 16 == 0


def site_shape(site: str, B: int, Hq: int, M: int, N: int, D: int, nblocks: int, stride: int = 16,
               Hkv: int | None = None) -> tuple[int, int, int, int]:
    """The logical shape of attention ``site`` in a call: (B, Hq, M, last) (see ``_SITE_LAST_DIM``);
    ``attn.kv_cache``: (B, Hkv, N, 2·D), key n of kv head h with its key in columns [0, D) and its value
    in [D, 2·D) (``Hkv`` required)."""
    if site == "attn.kv_cache":
        if Hkv is None:
            raise ValueError("site_shape('attn.kv_cache', ...) needs Hkv")
        return (B, Hkv, N, 2 * D)
    last = {"keys": N, "blocks": nblocks, "blocks_d": nblocks * D, "blocks_cs": nblocks * 2 * stride,
            "d": D}[_SITE_LAST_DIM[site]]
    return (B, Hq, M, last)


def site_dtype(site: str, input_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the values at attention ``site`` (the bits a flip can hit): the input dtype
    for ``attn.probs_lp`` (P as GEMM II reads it) and ``attn.kv_cache`` (the cache's K and V), fp32
    everywhere else."""
    return input_dtype if site in ("attn.probs_lp", "attn.kv_cache") else torch.float32

KINDS: tuple[str, ...] = ("detected", "corrected", "recomputed", "uncorrectable", "nonfinite_input")

SITE_INDEX: dict[str, int] = {s: i for i, s in enumerate(SITES)}
KIND_INDEX: dict[str, int] = {k: i for i, k in enumerate(KINDS)}
COUNTER_SHAPE: tuple[int, int] = (len(SITES), len(KINDS))

DETECTED, CORRECTED, RECOMPUTED, UNCORRECTABLE, NONFINITE = range(len(KINDS))


def new_counters(device: torch.device | str) -> torch.Tensor:
    """A zeroed (sites, kinds) int32 counter block on ``device``."""
    return torch.zeros(COUNTER_SHAPE, dtype=torch.int32, device=device)


def derive_seed(*parts: object) -> int:
    """A stable 63-bit seed from any printable parts (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


# EFTA step 4, the product check of ``P = exp(x)`` per group (row i, residue r) of L keys: it compares
# ``log2 Π P`` with ``log2(e)·Σ x`` within ``EXP_ULPS·u·log2(e)·(3L + |Σ x|)`` (u = 2^-24) plus the room of
# two roundings named below. P is taken as GEMM II reads it (rounded to the input dtype; for bf16 the fp32 P
# instead, with no room for the rounding, and the rounded P must be its rounding bit for bit), Σ x from the
# scores the row max read (``Σ max(S, base + x_min) − L·base``), so faults in x and in the rounded P are
# seen. x below ``x_min`` (masked keys included) counts as ``x_min`` and P below ``P_min = exp(x_min)`` as
# ``P_min`` (a NaN-propagating fp32 max, so a NaN stays NaN and a negative P becomes ``P_min``). The
# product of ``EXP_MAX_GROUP`` clamped values stays a normal fp32 number (≥ e^-80 > 2^-126), so it is
# formed directly in fp32. (x_min, P_min) depend on the dtype P is held in (`exp_clamp`).
EXP_ULPS = 64.0
EXP_XMIN = -20.0
EXP_MAX_GROUP = 4  # keys per group (L = block / stride = 64 / 16) for which P_MIN^L is still normal
LOG2E = 1.4426950408889634
P_MIN = struct.unpack("<f", struct.pack("<f", math.exp(EXP_XMIN)))[0]  # exp(−20) rounded to fp32
# fp16 holds values below 2^-14 as subnormals, whose rounding is not relative: its clamp sits above
# them, x_min = −9.5, P_min = exp(−9.5) ≈ 7.5e-5 > 2^-14 (fp32 and bf16 keep −20). Rounding to the input
# dtype moves each log2 P by at most 1.01·LOWP_U·log2(e), so the group test gets
# ``L·1.01·LOWP_U·log2(e)`` more room (0 for fp32, and for bf16, whose test reads the fp32 P).
EXP_XMIN_FP16 = -9.5


def exp_clamp(dtype: torch.dtype) -> tuple[float, float]:
    """Step 4's clamp for P held in ``dtype`` (the dtype GEMM II reads P in): (x_min, P_min = exp(x_min)
    rounded to fp32)."""
    xmin = EXP_XMIN_FP16 if dtype == torch.float16 else EXP_XMIN
    return xmin, struct.unpack("<f", struct.pack("<f", math.exp(xmin)))[0]


# Unit roundoff of the dtype GEMM II reads P in: rounding P to it (to nearest, normal range) moves P by at
# most ``LOWP_U·P`` (step 4's room for it, above).
LOWP_U: dict[torch.dtype, float] = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
