"""EFTA: fault-tolerant flash-attention forward, one fused Triton kernel.

Implements ``docs/algorithms.md`` (steps 1–8) with the same checks, thresholds, counters and
injection sites as the PyTorch reference (`ft_transformers.efta_reference`, the oracle), including
its documented deviations (stable rebuild ``checksum − Σ others`` instead of ``value += D1``,
location restricted to real keys / head-dim columns, ``τ_m`` capped at 1, the all-−inf base rule,
step 7 skipping the rows step 6 already flagged, −inf in q/k/v counting as non-finite).

The modules, by role (the reference path is split by the same names):

* `checksums` — the pre-pass that builds the K/V checksum tables once per key block, the launch that
  extends a KV cache's tables as tokens enter it, and the input-dtype slices the checksum dots read them as;
* `stored` — a KV cache's checksum tables (`CacheTables`), made as tokens enter the cache, read instead of
  the pre-pass;
* `masks` — step 2: causal, sliding window, padding, bool and additive masks, additive bias;
* `scores` — step 1: GEMM I and its tensor-checksum test;
* `softmax` — steps 3–5: SNVR row max, the exp product check, the row sum;
* `output` — steps 6–8: row-sum check, normalisation, GEMM II's unified verification, recompute, store;
* `kernel` — the forward program `_efta_fwd` and its key loop (clean pass, repair pass);
* `decode` — GQA decode packing and the split-key decode's merge;
* `configs` — bounds, block configs and the autotuner, tile choices;
* `host` — `efta_triton_forward`: validation, replay, tuning, allocation, launches, injection table;
* `common` — counter slots, NaN-propagating max, fault injection (device side).

Layout of one program (query block × (batch, head)): the Q block (BLOCK_M × D) stays in SRAM; K/V
blocks of BLOCK_N keys are streamed; online softmax in fp32. GQA in the kernel (kv head = h //
(Hq/Hkv); in q_len-1 decode the query heads of one kv head are the rows of one program); causal and
sliding window bottom-right aligned, with key blocks that are fully masked for the whole query block
skipped; bool or additive masks and an additive bias read through (possibly zero) strides; key
padding at N. The checked kernel uses key blocks of 64 (``CS_BLOCK_N``, the reference's block).

Non-finite inputs are found without an extra pass over q/k/v: q when its block is loaded, a bias or
additive mask tile when it is loaded, K with its block checksums, and V through its running max
Σ|V| (NaN-propagating, inspected once after the loop); with a KV cache's stored tables, as K and V
were when they entered the cache. Keys that no program visits (outside every
row's sliding window) are not inspected.

Counters: atomics into the caller's (sites, kinds) int32 block (`contract.COUNTER_SHAPE`, any strides),
site rows as in `ft_transformers.kernels.contract`: step 1 → ``attn.scores``, 3 → ``attn.rowmax``, 4 →
``attn.probs``, 5 (the α check) → ``attn.alpha``, 6 → ``attn.rowsum``, 7 → ``attn.output``; non-finite
inputs count one ``nonfinite_input`` at ``attn.scores`` per call. Injection reaches every attention site
of the contract (``docs/algorithms.md``, "Fault model of the key loop"); its code compiles away when no
site is injected (the ``INJ_*`` constexprs are 0), so the clean kernel does not change.

Interpreter (``TRITON_INTERPRET=1``, CPU tensors): one fixed small config; a few helpers take an
``INTERP`` switch (tl.log2 and tl.exp instead of the PTX ``lg2.approx`` and ``ex2.approx.ftz``; a
sum of logs for the group product and NaN-propagating maxima written with tl.max, because the
interpreter runs custom reductions element by element; bf16 dots in fp32).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only where triton is missing
    raise ImportError("ft_transformers.kernels.efta needs triton") from exc

from .configs import BOUNDS, CS_BLOCK_N, Bounds
from .host import PASA_SUPPORTED, EftaUnsupported, PasaShift, efta_triton_forward, interpreting
from .stored import CacheTables, StoredTables

__all__ = ["efta_triton_forward", "Bounds", "BOUNDS", "CS_BLOCK_N", "CacheTables", "EftaUnsupported",
           "PASA_SUPPORTED", "PasaShift", "StoredTables", "interpreting"]
