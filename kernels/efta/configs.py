"""EFTA's constants and choices: the checks' rounding bounds, the block configs and their autotuner, and
the per-call tile choices as small pure functions (`_num_splits`, `_fold`, `_tma`, `_pow2_bucket`).

Thresholds are exactly the contract's (``docs/algorithms.md``; `Bounds`, one place), except that on
CUDA the bounds covering tensor-core accumulation (T_s, τ_l, T_o) get a guard factor
``gemm_slack_cuda``; in the interpreter it is ``gemm_slack_interp`` = 1, so interpreted counters equal
the reference's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..contract import EXP_ULPS
from ..options import options
from ..tl_common import HOPPER_SHARED_MEMORY, gpu_time, shared_memory, sm_count
from .kernel import _efta_fwd


@dataclass(frozen=True)
class Bounds:
    """Constants of the checks' thresholds.

    ``g(k) = gamma·k·u``. ``gemm_slack`` multiplies every bound that covers tensor-core
    accumulation (T_s of step 1, τ_l of step 6, T_o of step 7): the contract's values assume
    IEEE round-to-nearest sequential fp32 sums; Hopper's MMA accumulates k-chunks with truncation
    (not IEEE), so on CUDA the bounds get a guard factor. 1.0 in the interpreter (numpy is IEEE),
    so interpreted runs use exactly the reference's thresholds.
    """

    u: float = 2.0**-24  # fp32 unit roundoff
    gamma: float = 1.01  # g(k) = gamma·k·u
    snvr_rel: float = 2.0**-20  # step 3: τ_m = min(snvr_rel·(1 + |m_new|), snvr_cap)
    snvr_cap: float = 1.0
    exp_ulps: float = EXP_ULPS  # step 4: |Σ log2 P − log2(e)·Σ x| ≤ exp_ulps·u·log2(e)·(3L + |Σ x|) per group
    # (+ the room of `exp_base`, and of P's rounding; its clamp x_min by the dtype: `contract.exp_clamp`)
    gemm_slack_cuda: float = 2.0
    gemm_slack_interp: float = 1.0

    def gemm_slack(self, interpreted: bool) -> float:
        return self.gemm_slack_interp if interpreted else self.gemm_slack_cuda

    def exp_base(self, L: int, rz_adds: int = 0) -> float:
        """Step 4's room for exponents taken from the scores, per unit of |base|: ``g(L+3)·L`` (the
        rounding of ``base + x_min``, of a sum of L scores of size |base| and of subtracting L·base), and
        ``g(2)·L`` more per add that step 2's second evaluation rounds toward zero (`masks._add_again`:
        < 1 ulp, 2u, from step 2's own add, on each of the L scores)."""
        return self.gamma * (L + 3 + 2 * rz_adds) * self.u * L


BOUNDS = Bounds()

STRIDE = 16  # checksum stride s (keys and head dim); tl.dot's minimum N
INJECT_BLOCK_N = 64  # = efta_reference's block_n: rowmax/rowsum positions index blocks of this size
CS_BLOCK_N = 64  # key block of the checked kernel (its checksum tables and counters match the reference's)
FP16_MMA_K = 16  # k-depth of one fp16 tensor-core MMA (m16n8k16): PASA's GEMM I rounds its fp16 sum once per 16
SPLIT_BLOCKS = 1 << 16  # row blocks a split-key call may have (one arrival cell each, `host._arrival_cells`)

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
# D > 64: BLOCK_N = 64 only, but for the wide clean pass (`_wide`). (128, 64, 8, 4): the checked kernel at
# D = 128 takes 4.55 ms on an H200 against 4.91 with 3 stages (4 × 32 heads × 4k); at D = 64, (64, 64, 4, 3)
# is the fastest. (128, 128, 8, 2): the wide clean pass at D = 128 (H100, fp16: 0.94 of the 64-key
# kernel's time at 1k, 4k and 16k keys without a mask, 0.99 causal at 4k, 1.03 causal at 1k).
CONFIGS_PREFILL = [(128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)]
# M ≤ 16 (decode, q_len 1). Two warps and two stages: checked calls only (`_prune`). Their programs
# walk a long key range with little to overlap: at batch 16 × 32 heads × 4k keys (D = 128, no split)
# two warps take 1,313 µs against four warps' 1,423 on an H200 (317 against 383 µs at 16 heads,
# D = 64), though ptxas spills there (Triton 3.6). With three stages a bf16 program at D = 128 takes
# 152 KB of shared memory (its checksum operands have three slices), so one program per SM; two
# stages take 86 KB (fp16: 111 and 62 KB). The autotuner keeps whichever is faster; in the H200's decode
# benchmark runs it picked (16, 64, 2, 2) at every shape it reached.
CONFIGS_DECODE = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 2, 3), (16, 64, 2, 2), (16, 64, 4, 2)]
CONFIG_INJECT = (64, INJECT_BLOCK_N, 4, 2)  # fixed config while injecting (BLOCK_N = reference's)
CONFIG_INTERPRET = (32, INJECT_BLOCK_N, 4, 1)  # TRITON_INTERPRET=1: small and fixed (the interpreter is slow)


def _cfg(c):
    return triton.Config({"BLOCK_M": c[0], "BLOCK_N": c[1]}, num_warps=c[2], num_stages=c[3])


def _shallow_twins(configs: list, smem: int, fp32: bool) -> list:
    """``configs``, and on a device with less shared memory per block than an H100 (``smem`` bytes) also
    each one with at most two pipeline stages, and for fp32 inputs with one (in that order, without
    duplicates). The list's stage counts are the H100's; on an sm_86 / sm_89 GPU (99 KB) no checked
    prefill config at D = 128 fits them (fp16 (64, 64, 4, 3): 114,688 B), and with none that loads the
    autotuner would launch one that fails. Two stages fit there in fp16 and bf16 (fp16, D = 128: 65,536 B
    at (64, 64, 4, 2), 81,920 B at (128, 64, 8, 2)); fp32 at D = 128 needs one (98,304 B at (64, 64, 4, 1);
    `scripts/kernel_resources.py --arch 86`). The autotuner drops the ones that do not load."""
    if smem >= HOPPER_SHARED_MEMORY:
        return list(configs)
    out, seen = [], set()
    for depth in (None, 2, *((1,) if fp32 else ())):
        for c in configs:
            key = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps,
                   c.num_stages if depth is None else min(c.num_stages, depth))
            if key not in seen:
                seen.add(key)
                out.append(c if depth is None else _cfg(key))
    return out


def _prune(configs, named_args, **kwargs):
    keep = _prune_shapes(configs, {**named_args, **kwargs})
    q = named_args["Q"]
    if q.device.type != "cuda":
        return keep
    return _shallow_twins(keep, shared_memory(q.device), q.dtype == torch.float32)


def _prune_shapes(configs, args: dict) -> list:
    """The configs that suit the call's shape and checks (``args``: the kernel's arguments by name)."""
    m_key, d = args["M_KEY"], args["BLOCK_D"]
    # the wide clean pass where it gained with pointer loads (D = 128; at D = 64 only with TMA, which is off)
    wide = d > 64 and _wide(args["DETECT"], args["PHASE"] == 1, args["PASA"], args["KC2_TABLE"])
    if m_key <= 16:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] == 16
                and (args["DETECT"] or (c.num_warps >= 4 and c.num_stages >= 3))]  # see CONFIGS_DECODE
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] > 16 and c.kwargs["BLOCK_M"] <= max(64, m_key)]
        if d > 64 and not wide:  # register pressure: the checked kernel holds S, O and checksum state
            keep = [c for c in keep if c.kwargs["BLOCK_N"] == 64] or keep
    if args["DETECT"] or args["PASA"]:  # the checksum tables are laid out for key blocks of CS_BLOCK_N
        keep = [c for c in keep if c.kwargs["BLOCK_N"] == CS_BLOCK_N
                or (wide and c.kwargs["BLOCK_N"] == 2 * CS_BLOCK_N and c.num_warps == 8)]
    return keep or [c for c in configs if c.kwargs["BLOCK_N"] == CS_BLOCK_N][:1]


_efta_fwd_tuned = triton.autotune(
    configs=[_cfg(c) for c in CONFIGS_PREFILL + CONFIGS_DECODE],
    key=["M_KEY", "N_KEY", "BLOCK_D", "CAUSAL", "HAS_WINDOW", "HAS_BIAS", "MASK_KIND", "DETECT", "CORRECT", "PASA",
         "HALF_STATE", "PHASE", "PACK"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=gpu_time,  # GPU time: an eager timing of a host-bound decode call measures the host
    # each shape key's timings kept in Triton's cache (keyed by the kernel's source, the target, the
    # configs and the key), so a new process does not time them again; FTT_TUNE_CACHE=0 as for the GEMM
    cache_results=options().tune_cache_dir is not None,
)(_efta_fwd)


def _num_splits(programs: int, M: int, N: int, cfg, no_skip: bool, device: torch.device, interp: bool,
                detect: bool = False, forced: int | None = None) -> int:
    """How many programs share the keys of one query block (split-key decode; 1 = no split).

    Decode (M ≤ 16) splits when the programs alone would not fill the GPU: up to two programs per
    SM, at least 256 keys each, or with the checks on 128 keys each up to 2,048 keys. Each checked
    key block takes longer, so on short caches shorter chains pay for the bigger merge; on long ones
    the merge's serial walk over the splits does not (batch 1, 14 query / 2 kv heads, H200: 528 keys
    19.7 µs with 4 splits against 23.5 with 2; 1,024 keys at D = 128, 23.9 against 27.4; 4,096 keys
    34.0 with 32 splits against 29.5 with 16; the unchecked kernel is not faster with more splits).
    Never while injecting (fault positions index the unsplit loop; output faults are fine, they strike
    after the merge). ``forced`` (`Options.efta_split`) is taken as it is (tests, tuning; with a fixed
    or forced config).
    """
    if no_skip:
        return 1
    if forced is not None:
        if cfg is None and M > 16:
            return 1
        return max(1, forced)
    if interp or M > 16 or (cfg is not None and cfg[0] != 16):
        return 1
    return max(1, min(2 * sm_count(device) // max(programs, 1), N // (128 if detect and N <= 2048 else 256)))


def _fold(interp: bool, scaled_scores: bool, forced: bool | None = None) -> bool:
    """Whether the kernel keeps the scores unscaled and makes the exponent one FFMA
    (`softmax._softmax_steps`, FOLD). Not where the scores need their scale (a bias or additive mask
    is added to them, PASA's frame, score faults injected into the scaled value). Default: on the GPU
    only; the interpreter keeps the reference's order of operations, so its counters equal the
    reference's bit for bit. ``forced`` (`Options.efta_fold`) turns it off or on (A/B timings; CPU
    tests of the folded path)."""
    if scaled_scores:
        return False
    return not interp if forced is None else forced


def _tma(k: torch.Tensor, v: torch.Tensor, M: int, nsplit: int, pasa: bool, forced: bool | None) -> bool:
    """Whether the key loop reads K and V through tensor descriptors (`kernel._key_loop`, TMA).

    Only where the descriptors can describe the tensors: unit last stride, every other stride and the
    base 16-byte aligned (TMA's rule), each stride positive. Prefill only (M > 16, no split-key): a
    decode program reads one key range once, with little for the descriptor's asynchronous copies to
    hide. Not with PASA (its keys are the shifted copy). ``forced`` (`Options.efta_tma`): None leaves
    it off until its timings set a rule; True asks for it wherever it is possible (CPU tests under the
    interpreter, A/B timings)."""
    if not forced or pasa or M <= 16 or nsplit > 1:
        return False
    for t in (k, v):
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(st <= 0 or (st * size) % 16 for st in t.stride()[:3]):
            return False
    return True


def _wide(detect: bool, phased: bool, pasa: bool, stored: bool) -> bool:
    """Whether a checked call may run key blocks of two checksum blocks (2·CS_BLOCK_N keys): only the clean
    launch of a prefill with correction (``phased``), which tests each half as the tables and the
    reference do (`kernel._key_loop`, NB) and only raises flags; the repairing launch runs the checksum
    blocks' own keys. Not with PASA (its recovery frame moves per checksum block) nor on a KV cache's
    stored tables."""
    return detect and phased and not pasa and not stored


def _pow2_bucket(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()
