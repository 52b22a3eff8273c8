"""Prepared calls: the checked GEMM's launches of one call signature, replayed without the host work that
chose them, and the fast path of one protected layer built on them.

Two layers, no module-level state:

* `PreparedCall` — kept by the kernel in the weight's ``WeightChecksums.launches`` (at most
  PREPARED_PER_WEIGHT signatures; cleared when full, and gone with the checksums when the weight
  changes). Its key (`api._checked_gemm`'s ``prep_key``) holds shapes, strides, alignment, the
  weight, the counters, the settings and the `options()` object.
* `FastPath` — the last call signature of one layer and its `PreparedCall`, returned to the caller
  (`api.linear_forward`), which owns it (``ft_transformers.checked_linear`` keeps one per protected
  module and tries it before anything else). Its key (`module_key`) adds what the library's own checks
  depend on; a call with another signature replaces it.
"""

from __future__ import annotations

import torch

from ..gemm_checksums import autocast_dtype, tensor_version
from ..launch import DirectLauncher, record_launches, replay_launches
from ..options import options
from ..tl_common import call_flag, capturing
from .calls import _CALL_ID_AT, _ensure_scratch_allocator, _launcher

PREPARED_PER_WEIGHT = 64  # prepared call signatures kept per weight (`PreparedCall`)


class PreparedCall:
    """A verified call's launches with everything resolved but its own tensors: a later call of the same
    signature allocates y and the stats buffer, takes a call id and launches the compiled kernels directly
    (`DirectLauncher.bind`: the signature fixes their specialisation), skipping the host work that decided
    the form, the config, the thresholds and the arguments. It holds none of the call's own tensors (x, y,
    the stats buffer, the counters are put in at each call)."""

    __slots__ = ("launches", "bound", "y_shape", "dtype", "device", "p_numel", "flagged", "scratch")

    @classmethod
    def record(cls, launches, x2d, y, P, counters, call_id) -> PreparedCall:
        """``launches``: the call's ``(which, grid, args, kwargs)``; ``P``: its scratch buffer (group sums, or the
        decode kernel's split-K partials), or None; ``call_id``: None for the decode kernel, which takes none."""
        self = cls()
        per_call = tuple(t for t in (x2d, y, P, counters) if t is not None)
        self.launches = record_launches(launches, per_call, call_id, _CALL_ID_AT, _launcher)
        # every Triton step bound (the cuBLAS form's product step is a plain function: it has nothing to
        # bind, and counting it would send the verification through its launcher's per-call key building)
        self.bound = all(entry[-1] is not None for entry in self.launches if isinstance(entry[-2], DirectLauncher))
        self.scratch = any(entry[0] == 3 for entry in launches)  # the persistent form: TMA descriptor scratch
        self.flagged = call_id is not None
        self.y_shape, self.dtype, self.device = tuple(y.shape), y.dtype, y.device
        self.p_numel = P.numel() if P is not None else 0
        return self

    def __call__(self, x2d: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """y (M, N) of x2d (M, K), events into counters (sites, kinds)."""
        if self.device.type == "cuda" and self.device.index != torch.cuda.current_device():
            with torch.cuda.device(self.device):  # launches go to the current device's stream
                return self(x2d, counters)
        y = torch.empty(self.y_shape, dtype=self.dtype, device=self.device)
        per_call = (x2d, y, counters)
        direct = self.bound and y.data_ptr() & 15 == 0
        if self.p_numel:
            P = torch.empty(self.p_numel, dtype=torch.float32, device=self.device)
            per_call = (x2d, y, P, counters)
            direct = direct and P.data_ptr() & 15 == 0
        # (the bound kernels were specialised on 16-byte aligned y and P: fresh allocations always are)
        call_id = call_flag(self.device)[1] if self.flagged else None  # the recorded call's cell
        if self.scratch:
            _ensure_scratch_allocator()
        replay_launches(self.launches, per_call, call_id, _launcher, direct)
        return y


def keep(cache: dict, key: tuple, prepared: PreparedCall) -> None:
    """Keep ``prepared`` under ``key`` in a weight's ``launches`` (emptied when full, e.g. by prefills of many
    lengths)."""
    if len(cache) >= PREPARED_PER_WEIGHT:
        cache.clear()
    cache[key] = prepared


def module_key(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
               settings: tuple) -> tuple:
    """What a layer call's prepared launches depend on beyond `api._checked_gemm`'s key: the input's
    metadata (and whether it requires grad), the weight's and bias's identity, storage and version,
    grad and autocast modes (a call the full path would refuse or cast never matches a recorded one),
    the caller's ``settings`` and the `options()` in force."""
    dev = x.device
    return (x.shape, x.stride(), x.dtype, dev, x.data_ptr() % 16 == 0, x.requires_grad,
            id(weight), weight.data_ptr(), tensor_version(weight),
            None if bias is None else (id(bias), bias.data_ptr(), tensor_version(bias)),
            counters.data_ptr(), settings, options(), torch.is_grad_enabled(), autocast_dtype(dev.type),
            capturing(dev))


def _no_fast_path() -> None:
    return None


class FastPath:
    """The last call signature of one layer (`module_key`) and its `PreparedCall`.

    A call with the same signature goes straight to the prepared launches, skipping validation, backend
    choice, the checksum cache lookup and `api._checked_gemm`'s own key (all of which would find the same
    answers again). Copies and pickles of its holder carry none."""

    __slots__ = ("key", "prepared", "k", "n")

    def __init__(self, key: tuple, prepared: PreparedCall, k: int, n: int) -> None:
        self.key, self.prepared, self.k, self.n = key, prepared, k, n

    def __deepcopy__(self, memo) -> None:
        return None

    def __reduce__(self):
        return (_no_fast_path, ())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 counters: torch.Tensor | None, settings: tuple) -> torch.Tensor | None:
        """y (..., N) for x (..., K), or None when this call's signature is not the recorded one."""
        if counters is None or module_key(x, weight, bias, counters, settings) != self.key:
            return None
        return self.prepared(x.reshape(-1, self.k), counters).view(*x.shape[:-1], self.n)
