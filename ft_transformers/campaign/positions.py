"""Where a flip landed, and whether the generation ever reads the value it hit.

A flip's position is a coordinate in its site's logical shape for that call (`ft_transformers.injection`):
every attention site is (B, Hq, M, ·) with query row i = dim 2 (the contract,
`ft_transformers.kernels.contract`); the key-indexed ones (``attn.scores``, ``attn.probs``, ...) are
(B, Hq, M, N) over keys j. ``linear.output`` is (tokens, out features). Query i sits at absolute
position ``i + N − M`` (bottom-right aligned), so causality hides key j from it iff ``j > i + N − M``.

What each *landing* means, on the PyTorch reference path (CPU) with one unpadded sequence (a campaign
feeds no padding, so padded keys and padded query rows do not occur):

- ``masked_key``: a score of a key its query does not see. With causality passed as EFTA's own flag
  (no mask tensor, `mask_form` ``"causal"``) the score is overwritten with −inf before the softmax
  reads it: never used (the score check still sees it and may flag it). With a mask tensor the mask
  is *added*, so a flip to +inf or NaN would survive: then only sign and mantissa flips (which keep a
  finite value finite) are ``masked_key``, an exponent flip is ``undecided``.
- ``masked_key_used``: the masked score, the exponent x, the probability P or its rounded copy that GEMM
  II reads (``attn.masked_scores``, ``attn.exponent``, ``attn.probs``, ``attn.probs_lp``) of such a key. S
  and x are −inf and P is 0 there,
  and the flipped value still feeds exp, the row sum and P·V (the path does not mask again), so it is
  *used*: it is reported apart, not counted as never used.
- ``unused_row``: a prefill row other than the last in a module whose other rows `probe_unused_rows`
  found unread (in a decoder the last block's per-token work: only the last position reaches
  ``lm_head``, and that block's keys and values come from its input). Every attention site is
  row-local in the query, so the attention module's result decides its sites' rows.
- ``not_injected``: the call never reached the position (nothing flipped).
- ``undecided``: a site that is not an attention site of the contract nor ``linear.output``; a masked
  key of a key-indexed site whose masked-key handling is not known here (`_KEY_SITES`); BER mode (no
  positions); an unknown mask form; a key outside a sliding window. Counted neither as used nor as
  never used.
- ``used``: anything else, among it every ``attn.rowmax`` / ``attn.alpha`` / ``attn.rowsum`` /
  ``attn.acc`` / ``attn.rowmax_carry`` / ``attn.checksum`` / ``attn.output`` value of a row that is read
  (the checksum operands only feed the checks, and through a correction they could still move the output;
  the max carried out of the last key block feeds the checks and a split-key merge).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ..kernels import contract

LANDINGS: tuple[str, ...] = ("used", "masked_key", "masked_key_used", "unused_row", "not_injected", "undecided")
NEVER_USED: frozenset[str] = frozenset({"masked_key", "unused_row", "not_injected"})
# Key-indexed attention sites and what the reference path does with the value at a masked key:
# "overwritten" (replaced by the mask before anything reads it) or "used" (read as it is: x = −inf
# flipped feeds exp, P = 0 flipped feeds the row sum and P·V). A key-indexed site of the contract
# missing here is undecided at masked keys.
_KEY_SITES: dict[str, str] = {"attn.scores": "overwritten", "attn.masked_scores": "used", "attn.exponent": "used",
                              "attn.probs": "used", "attn.probs_lp": "used"}
_ROW_SITES = ("linear.output",)  # (tokens, features): row = token


def _by_key(site: str) -> bool:
    """Whether attention ``site``'s last dim is the key index (from the contract's `site_shape`)."""
    n = 7919  # a key count no other extent of the probe shape equals
    return contract.site_shape(site, 1, 1, 1, n, 3, 5)[3] == n


def landing(site: str, pos: Sequence[int], shape: Sequence[int], *, module: str, unused_rows: Iterable[str],
            mask_form: str, window: int | None, exponent_bit: bool) -> str:
    """The landing (see the module docstring) of one flip at ``pos`` in a call of ``module`` whose
    ``site`` has logical shape ``shape``.

    Args:
        mask_form: ``"causal"`` (causality passed as a flag, masked scores overwritten), ``"tensor"``
            (an additive mask) or ``"unknown"``.
        window: the model's sliding window, or None.
        exponent_bit: the flipped bit is an exponent bit (it can turn a finite value into inf / NaN).
    """
    unused = module in set(unused_rows)
    if site in contract.ATTENTION_SITES:
        i, M = int(pos[2]), int(shape[2])
        if unused and i < M - 1:
            return "unused_row"
        if not _by_key(site):  # indexed by key block, head dim or checksum column
            return "used"
        if mask_form not in ("causal", "tensor"):
            return "undecided"
        j, N = int(pos[3]), int(shape[3])
        last_seen = i + N - M
        if j > last_seen:
            if site not in _KEY_SITES:
                return "undecided"
            if _KEY_SITES[site] == "used":
                return "masked_key_used"
            return "masked_key" if mask_form == "causal" or not exponent_bit else "undecided"
        if window is not None and j <= last_seen - window:
            return "undecided"
        return "used"
    if site in _ROW_SITES:
        if unused and int(pos[0]) < int(shape[0]) - 1:
            return "unused_row"
        return "used"
    return "undecided"


def masked_position(landings: Sequence[str]) -> bool | None:
    """True when every flip of a trial landed on a never-used value, False when one is used, None when
    the rest is undecided (or there are no flips to judge)."""
    if not landings:
        return None
    if any(x not in NEVER_USED and x != "undecided" for x in landings):
        return False
    if any(x == "undecided" for x in landings):
        return None
    return True


def _nan_rows(module: torch.nn.Module, args, out):
    """Forward hook: every row but the last of the module's (B, T, ·) result becomes NaN."""
    t = out[0] if isinstance(out, tuple) else out
    t = t.clone()
    t[:, :-1] = float("nan")
    return (t, *out[1:]) if isinstance(out, tuple) else t


def probe_unused_rows(model: torch.nn.Module, prefill, ids: torch.Tensor, candidates: Sequence[str]) -> list[str]:
    """The ``candidates`` (module names) whose prefill rows other than the last are never read.

    Each candidate's result rows ``[:-1]`` are set to NaN in a prefill of ``ids`` (1, P), P ≥ 2; the
    module is listed when the logits and the whole cache still equal those of a clean prefill bit for
    bit. ``prefill(ids)`` runs one prefill and returns ``(logits (V,), [(keys, values) per layer])``.
    """
    if ids.shape[1] < 2:
        return []
    ref_logits, ref_cache = prefill(ids)
    modules = dict(model.named_modules())
    out = []
    for name in candidates:
        handle = modules[name].register_forward_hook(_nan_rows)
        try:
            logits, cache = prefill(ids)
        finally:
            handle.remove()
        if torch.equal(logits, ref_logits) and all(
                torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(cache, ref_cache, strict=True)):
            out.append(name)
    return out


class MaskFormProbe:
    """Forward pre-hooks on the attention modules that see which mask each call receives.

    `form` is ``"causal"`` when every call got ``attention_mask=None`` (EFTA then applies causality
    itself and overwrites masked scores), ``"tensor"`` when every call got a mask tensor, else
    ``"unknown"`` (mixed, or the keyword never seen).
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[str]) -> None:
        self.seen: set[str] = set()
        modules = dict(model.named_modules())
        self.handles = [modules[n].register_forward_pre_hook(self._hook, with_kwargs=True) for n in names]

    def _hook(self, module, args, kwargs):
        if "attention_mask" not in kwargs:
            self.seen.add("absent")
        else:
            self.seen.add("none" if kwargs["attention_mask"] is None else "tensor")

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    @property
    def form(self) -> str:
        if self.seen == {"none"}:
            return "causal"
        if self.seen == {"tensor"}:
            return "tensor"
        return "unknown"
