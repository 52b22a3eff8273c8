"""`FTConfig`: what `enable_fault_tolerance` protects and how."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_POLICIES = ("warn", "raise", "ignore")


@dataclass(frozen=True)
class FTConfig:
    """Settings of a protected model.

    Attributes:
        attention: run every attention through EFTA (fault-tolerant fused attention).
        linear: verify every ``nn.Linear`` (and GPT-2 ``Conv1D``) with a V-ABFT checksum.
        detect: verify checksums and range checks. ``False`` runs the same computation unchecked
            (useful as the unprotected arm of an injection experiment).
        correct: repair what was detected (locate + correct, else recompute). ``False`` only counts.
        pasa: run the score GEMM with PASA's pseudo-average shift (FP16 without overflow).
        pasa_beta: PASA shift factor; ``None`` picks the optimal one for the dtype and block.
        emax: V-ABFT unit error bound; ``None`` takes the calibrated table for device and dtype.
        csigma: V-ABFT variance coefficient (c_sigma of the threshold formula).
        layers: transformer block indices to protect (``None``: all).
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
    layers: Sequence[int] | None = None
    record_events: bool = True
    on_uncorrectable: str = "warn"

    def __post_init__(self) -> None:
        if self.on_uncorrectable not in _POLICIES:
            raise ValueError(f"on_uncorrectable must be one of {_POLICIES}, got {self.on_uncorrectable!r}")
        if self.correct and not self.detect:
            # Correction needs detection; treat "correct without detect" as "nothing checked".
            object.__setattr__(self, "correct", False)
        if self.emax is not None and not self.emax > 0:
            raise ValueError(f"emax must be positive, got {self.emax}")
        if not self.csigma > 0:
            raise ValueError(f"csigma must be positive, got {self.csigma}")
        if self.pasa_beta is not None and not 0.0 < self.pasa_beta < 1.0:
            raise ValueError(f"pasa_beta must lie in (0, 1), got {self.pasa_beta}")
        if self.layers is not None:
            layers = tuple(int(i) for i in self.layers)
            if any(i < 0 for i in layers):
                raise ValueError(f"layers must be non-negative block indices, got {layers}")
            object.__setattr__(self, "layers", layers)


class UncorrectableFaultError(RuntimeError):
    """Raised under ``on_uncorrectable="raise"`` when a fault could not be corrected."""
