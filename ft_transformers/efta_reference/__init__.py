"""PyTorch reference implementation of EFTA (FT-Transformer: end-to-end fault tolerant attention).

This is the CPU runtime of the library and the oracle of the Triton kernel (``kernels/efta``). It is
blocked the way the kernel is: a Python loop over key blocks of ``block_n`` keys, every query row
(all batches, heads and query blocks) processed at once with torch ops, the online softmax, and the
checks of ``docs/algorithms.md`` steps 1–8 with their counters and injection sites. Each step lives
in the module of the same name here and in ``kernels/efta/``:

* `checksums`: the K and V checksum tables, group sums, location and rebuild, rounding bounds;
* `masks`: bias, bool and additive masks, causal, sliding window, key padding (step 2);
* `scores`: GEMM I and its checksum check (step 1);
* `softmax`: running max and SNVR check, ``P = exp(x)`` and its product check, accumulation
  (steps 3–5);
* `output`: row-sum check, normalisation, unified verification of GEMM II, recompute of the rows a
  check flagged (steps 6–8);
* `common`: injection at a site and the event counters, used by every step;
* `forward`: `efta_reference`, the driver (and PASA's frame across blocks).

Shapes: q (B, Hq, M, D), k/v (B, Hkv, N, D), Hq a multiple of Hkv; query head h uses kv head
``h // (Hq // Hkv)`` (GQA/MQA without repeating k/v: q is viewed as (B, Hkv, G·M, D)).

Deviations from the letter of ``docs/algorithms.md`` (sound variants of the same checks; on
clean inputs none of them changes a check's verdict; the kernel makes the same ones):

* Steps 1 and 7, correction: a located element is rebuilt as ``checksum − Σ(other members of its
  group)`` instead of ``value += D1`` (`checksums.rebuild` says why).
* Steps 1 and 7, location: a key in the block padding (≥ N) or a column in the zero padding of D
  counts as "out of range" (the row is recomputed).
* Step 3: ``τ_m = min(2^-20·(1 + |m_new|), 1)``, and the 0 base of ``x`` only where ``m_new``,
  ``m`` and the block max are all −inf (`softmax.running_max` says why).
* Step 4: ``P = exp(x)`` is flushed to 0 where ``x < −87`` (results < 1.7e-38, which the check
  treats as exp(−87) anyway). CPU exp takes slow paths on −inf, 0 and subnormals.
* Non-finite inputs: −inf in q, k or v also counts as ``nonfinite_input`` (it is as bad as +inf
  there); in ``bias`` and an additive ``attn_mask`` −inf is a mask value, so only NaN and +inf count.
* Step 7 skips the rows flagged by step 6 (they are recomputed from scratch anyway), so one fault
  is not counted twice.
"""

from __future__ import annotations

from .forward import PASA_PRECISIONS, efta_reference
from .masks import broadcast_to_scores

__all__ = ["efta_reference", "broadcast_to_scores", "PASA_PRECISIONS"]
