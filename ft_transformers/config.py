"""`FTConfig`: what `enable_fault_tolerance` protects and how.

Also the checks of user-given settings that `FaultSpec` and `checked_linear` share (`_integer`,
`_real`, `_indices`): a wrong type or value raises a TypeError / ValueError naming the field.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

_POLICIES = ("warn", "raise", "ignore")
_FLAGS = ("attention", "linear", "detect", "correct", "pasa", "record_events")


def _integer(name: str, value: object) -> int:
    """``value`` as an int (Python or NumPy integer; never a bool, float or string), else TypeError."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _real(name: str, value: object, *, positive: bool = False) -> float:
    """``value`` as a finite float (an int or float, never a bool or string), else TypeError / ValueError.

    ``positive``: also require ``value > 0``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number (int or float), got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _indices(name: str, value: object, *, names: bool = False) -> tuple:
    """A selector of blocks (or calls) as a tuple: one int, or a sequence of ints.

    A bare int is one index (``layers=5`` is ``layers=(5,)``). With ``names``, strings (qualified
    module names) are allowed too, a bare string being one name. Anything else raises TypeError.
    """
    if isinstance(value, str) and names:
        return (value,)
    if isinstance(value, bool) or isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        try:
            return (_integer(name, value),)
        except TypeError:
            what = "an int, a module name or a sequence of them" if names else "an int or a sequence of ints"
            raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}") from None
    out = []
    for i, item in enumerate(value):
        if names and isinstance(item, str):
            out.append(item)
        else:
            out.append(_integer(f"{name}[{i}]", item))
    return tuple(out)


@dataclass(frozen=True)
class FTConfig:
    """Settings of a protected model.

    Every field is checked when the config is made: a wrong type raises TypeError, a value out of
    range ValueError, each naming the field.

    Attributes:
        attention: run every attention through EFTA (fault-tolerant fused attention).
        linear: verify every ``nn.Linear`` (and GPT-2 ``Conv1D``) with a V-ABFT checksum. At least one of
            ``attention`` and ``linear`` must be on.
        detect: verify checksums and range checks. ``False`` runs the same computation unchecked
            (useful as the unprotected arm of an injection experiment).
        correct: repair what was detected (locate + correct, else recompute). ``False`` only counts.
        pasa: run the score GEMM with PASA's pseudo-average shift (FP16 without overflow).
        pasa_beta: PASA shift factor in (0, 1); ``None`` picks the optimal one for the dtype and block.
        emax: V-ABFT unit error bound, finite and positive, for every term of the threshold; ``None`` takes
            the calibrated table for device and dtype (whose entry may give the variance terms a unit
            error of their own, `ft_transformers.vabft.default_emax_var`).
        csigma: V-ABFT variance coefficient (c_sigma of the threshold formula), finite and positive.
        layers: transformer block indices (0-based ints) to protect; a bare int is one block;
            ``None``: all. Modules outside the blocks (e.g. ``lm_head``) are protected only with
            ``None``. `enable_fault_tolerance` raises ValueError for an index the model does not have.
        record_events: keep per-step, per-module event counters for `fault_report`.
        on_uncorrectable: ``"warn"`` (a warning once the counters reach the host), ``"raise"``
            (raises `UncorrectableFaultError`; costs one host synchronisation per protected call)
            or ``"ignore"``.
    """

    attention: bool = True
    linear: bool = True
    detect: bool = True
    correct: bool = True
    pasa: bool = False
    pasa_beta: float | None = None
    emax: float | None = None
    csigma: float = 2.5
    layers: Sequence[int] | int | None = None
    record_events: bool = True
    on_uncorrectable: str = "warn"

    def __post_init__(self) -> None:
        for name in _FLAGS:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"FTConfig.{name} must be a bool, got {type(value).__name__} {value!r}")
        if not self.attention and not self.linear:
            raise ValueError("FTConfig(attention=False, linear=False) protects nothing and injects nowhere: keep "
                             "one of them, or leave the model unprotected")
        if not isinstance(self.on_uncorrectable, str) or self.on_uncorrectable not in _POLICIES:
            raise ValueError(f"on_uncorrectable must be one of {_POLICIES}, got {self.on_uncorrectable!r}")
        if self.correct and not self.detect:
            # Correction needs detection; treat "correct without detect" as "nothing checked".
            object.__setattr__(self, "correct", False)
        if self.emax is not None:
            object.__setattr__(self, "emax", _real("FTConfig.emax", self.emax, positive=True))
        object.__setattr__(self, "csigma", _real("FTConfig.csigma", self.csigma, positive=True))
        if self.pasa_beta is not None:
            beta = _real("FTConfig.pasa_beta", self.pasa_beta)
            if not 0.0 < beta < 1.0:
                raise ValueError(f"FTConfig.pasa_beta must lie in (0, 1), got {beta}")
            object.__setattr__(self, "pasa_beta", beta)
        if self.layers is not None:
            layers = _indices("FTConfig.layers", self.layers)
            if not layers:
                raise ValueError("FTConfig.layers is empty, which protects nothing: use None for every block, "
                                 "or FTConfig(detect=False, correct=False) for an unprotected run")
            if any(i < 0 for i in layers):
                raise ValueError(f"FTConfig.layers must be non-negative block indices, got {layers}")
            object.__setattr__(self, "layers", layers)

    def _check_layers(self, blocks: Collection[int]) -> None:
        """Raise ValueError if ``layers`` names a block outside ``blocks`` (the model's block indices)."""
        if self.layers is None:
            return
        missing = sorted(set(self.layers) - set(blocks))
        if not missing:
            return
        have = sorted(blocks)
        valid = f"0..{have[-1]}" if have == list(range(len(have))) and have else (str(have) if have else "none")
        raise ValueError(f"FTConfig.layers has block indices {missing} that the model does not have "
                         f"(its blocks: {valid}); this config would protect nothing there")


class UncorrectableFaultError(RuntimeError):
    """Raised under ``on_uncorrectable="raise"`` when a fault could not be corrected."""
