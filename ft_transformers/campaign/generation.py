"""Greedy generation for campaigns: a greedy loop over a KV cache, the clean run of a prompt kept whole
(tokens, logits, cache, events), and a faulty run that starts from the clean state at the faulted step.

A faulty run with its fault at step s (0 = prefill) repeats nothing the clean run already computed:
steps before s are fault-free, so it starts from the clean cache of the first ``P + s − 1`` positions
(P prompt tokens) and the clean token of step s − 1. After step s, if the token and the cache entries
that step wrote are bitwise the clean ones (the fault was masked or repaired exactly), every later step
would repeat the clean run bit for bit (same inputs, same deterministic CPU kernels, no fault left), so
the run stops there and takes the clean tokens — unless the clean run recorded events after step s,
which the faulty run would then have to reproduce. `run_from` with ``shortcut=False`` runs every step;
the tests check both give the same record.

Logits are those of the last position only (``logits_to_keep=1``, as ``generate`` asks for), so
``lm_head`` sees one row per step.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..events import FTReport
from ..protect import _state, fault_report, inject_faults


def event_rows(report: FTReport) -> list[list]:
    """A report's events as JSON rows ``[step, layer, module, site, kind, count]``."""
    return [[e.step, e.layer, e.module, e.site, e.kind, e.count] for e in report.events]


@dataclass
class CleanRun:
    """The fault-free greedy generation of one prompt in one protection arm.

    Attributes:
        ids: (1, P) prompt token ids.
        tokens: the n generated token ids.
        logits: (n, V) fp32 logits of every step (last position).
        cache: per layer ``(keys, values)``, each (1, Hkv, P + n − 1, D): what the run's cache held
            after its last step (the last token is never fed back).
        events: event rows ``[step, layer, module, site, kind, count]`` (false positives).
        finite: every logit finite.
        seconds: wall time of the run.
    """

    ids: torch.Tensor
    tokens: list[int]
    logits: torch.Tensor
    cache: list[tuple[torch.Tensor, torch.Tensor]]
    events: list[list]
    finite: bool
    seconds: float
    last_event_step: int = field(init=False)

    def __post_init__(self) -> None:
        self.last_event_step = max((int(r[0]) for r in self.events), default=-1)

    @property
    def prompt_len(self) -> int:
        return int(self.ids.shape[1])


@dataclass
class FaultyRun:
    """A run with faults: its tokens, and how its logits compare with the clean run's.

    Attributes:
        tokens: generated ids (None when the run raised).
        finite: every computed logit finite.
        error: the exception text, or None.
        events: event rows, steps counted from the start of the generation (the clean run's events
            before the faulted step included: the skipped prefix would have recorded them).
        first_diff: first step whose token differs from the clean run's (a shorter or longer output
            differs at the first step one of them lacks), or None.
        logit_dev: largest |logit − clean logit| over the steps up to and including ``first_diff``
            (all computed steps when the tokens agree); later steps follow other tokens.
        steps_run: model calls made (the skipped clean prefix and the shortcut tail excluded).
        records: what `inject_faults` logged, ``(module name, call, FaultPlan)`` per targeted call.
    """

    tokens: list[int] | None
    finite: bool
    error: str | None
    events: list[list]
    first_diff: int | None
    logit_dev: float
    steps_run: int
    records: list


def first_difference(tokens: Sequence[int] | None, clean: Sequence[int]) -> int | None:
    """Index of the first position where ``tokens`` and ``clean`` differ (length included), or None."""
    if tokens is None:
        return 0
    for k, (a, b) in enumerate(zip(tokens, clean, strict=False)):
        if a != b:
            return k
    return None if len(tokens) == len(clean) else min(len(tokens), len(clean))


class Greedy:
    """Greedy decoding of ``model`` for ``max_new_tokens`` steps (stopping after an EOS token).

    Args:
        model: a causal LM (protected or not).
        max_new_tokens: steps per generation.
        eos: token ids that end a generation (may be empty).
    """

    def __init__(self, model: torch.nn.Module, max_new_tokens: int, eos: Sequence[int] = ()) -> None:
        self.model = model
        self.max_new_tokens = int(max_new_tokens)
        self.eos = {int(e) for e in eos}

    def new_cache(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None, length: int = 0):
        """A KV cache holding copies of the first ``length`` positions of ``layers`` (empty by default)."""
        from transformers import DynamicCache

        if not layers or length == 0:
            return DynamicCache(config=self.model.config)
        return DynamicCache(ddp_cache_data=[(k[:, :, :length].clone(), v[:, :, :length].clone()) for k, v in layers],
                            config=self.model.config)

    @staticmethod
    def layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(keys, values)`` of each layer of a cache, each (1, Hkv, length, D)."""
        return [(layer.keys, layer.values) for layer in cache.layers]

    def forward(self, inp: torch.Tensor, cache) -> torch.Tensor:
        """One model call on ``inp`` (1, T) appending to ``cache``; the (V,) fp32 logits of the last position."""
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model(input_ids=inp, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def clean(self, ids: torch.Tensor) -> CleanRun:
        """The fault-free run of prompt ``ids`` (1, P) with the model's current protection."""
        report = fault_report(self.model)
        report.reset()
        t0 = time.perf_counter()
        cache = self.new_cache()
        tokens: list[int] = []
        logits = []
        inp = ids
        for _ in range(self.max_new_tokens):
            lg = self.forward(inp, cache)
            tok = int(lg.argmax())
            tokens.append(tok)
            logits.append(lg)
            if tok in self.eos:
                break
            inp = torch.tensor([[tok]], device=ids.device)
        seconds = time.perf_counter() - t0
        stacked = torch.stack(logits)
        return CleanRun(ids=ids, tokens=tokens, logits=stacked, cache=[(k.clone(), v.clone()) for k, v in
                                                                      self.layers(cache)],
                        events=event_rows(fault_report(self.model)), finite=bool(torch.isfinite(stacked).all()),
                        seconds=seconds)

    def run_from(self, clean: CleanRun, start: int, spec, *, shortcut: bool = True) -> FaultyRun:
        """Run with the faults of ``spec`` (a `FaultSpec` whose ``calls`` count generation steps), from
        step ``start`` on (the clean state before it is reused; ``start = 0`` for a fault at every step).

        ``shortcut``: stop after step ``start`` when the state is bitwise the clean one (module docstring).
        """
        report = fault_report(self.model)
        report.reset()
        P = clean.prompt_len
        if start == 0:
            cache, inp = self.new_cache(), clean.ids
        else:
            cache = self.new_cache(clean.cache, P + start - 1)
            inp = torch.tensor([[clean.tokens[start - 1]]], device=clean.ids.device)
        tokens: list[int] = list(clean.tokens[:start])
        finite, error = True, None
        dev = 0.0
        diverged = False
        steps_run = 0
        may_shortcut = shortcut and spec.calls is not None and clean.last_event_step <= start
        with inject_faults(self.model, spec) as log:
            for ctx in _state(self.model).contexts:  # module call k is generation step k
                ctx.calls = start
            try:
                for k in range(start, self.max_new_tokens):
                    before = cache.get_seq_length()
                    lg = self.forward(inp, cache)
                    steps_run += 1
                    tok = int(lg.argmax())
                    finite = finite and bool(torch.isfinite(lg).all())
                    tokens.append(tok)
                    if not diverged and k < len(clean.tokens):
                        d = (lg - clean.logits[k]).abs().max()
                        dev = max(dev, float(d) if torch.isfinite(d) else float("inf"))
                    diverged = diverged or k >= len(clean.tokens) or tok != clean.tokens[k]
                    if tok in self.eos:
                        break
                    if (may_shortcut and k == start and not diverged
                            and self._same_entries(cache, clean, before)):
                        tokens = list(clean.tokens)
                        break
                    inp = torch.tensor([[tok]], device=clean.ids.device)
            except Exception as e:  # a crash is an outcome, not a campaign failure
                error = f"{type(e).__name__}: {e}"
                tokens = None
        try:
            # the skipped clean prefix's events (false positives, if any) happened in this trial too
            rows = [list(r) for r in clean.events if r[0] < start]
            rows += [[r[0] + start, *r[1:]] for r in event_rows(fault_report(self.model))]
        except Exception as e:  # pragma: no cover - the report itself failing is a crash too
            rows, error = [], error or f"report: {type(e).__name__}: {e}"
        return FaultyRun(tokens=tokens, finite=finite, error=error, events=rows,
                         first_diff=first_difference(tokens, clean.tokens), logit_dev=dev, steps_run=steps_run,
                         records=list(log.records))

    def _same_entries(self, cache, clean: CleanRun, before: int) -> bool:
        """Whether the cache entries written since length ``before`` equal the clean run's, bit for bit
        (NaN ≠ NaN, so a NaN entry never passes)."""
        after = cache.get_seq_length()
        for (k, v), (ck, cv) in zip(self.layers(cache), clean.cache, strict=True):
            if not (torch.equal(k[:, :, before:after], ck[:, :, before:after])
                    and torch.equal(v[:, :, before:after], cv[:, :, before:after])):
                return False
        return True
