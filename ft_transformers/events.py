"""Per-module, per-step event recording and the `FTReport` built from it.

A protected model owns one `EventRecorder`. Each protected module has a slot; during a model
forward call (one generation *step*) every module adds its kernel counters into its slot of
the step's counter tensor ``(modules, sites, kinds)``, on the module's device. At the end of the
step a copy of that tensor is filed away, still on the device, and the tensor is zeroed for the
next step. Only `fault_report` copies the history to the host, so recording costs no
synchronisation on the hot path.

Calls of protected modules that ran *outside* protection (attention switched away from EFTA, a
Linear swapped out; `ft_transformers.bypass` notices them) are counted per module name in a Python
dict, one int addition per call, and reported as `FTReport.unprotected`.

The per-device step tensors are allocated once and reused for every step (their addresses never
change), so a compiled model (``torch.compile``, also with CUDA graphs) adds into the same
buffers on every replay; filing and zeroing happen outside the compiled region, in the model's
forward hook (`EventRecorder.end_step` is excluded from tracing).
"""

from __future__ import annotations

import csv
import json
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .config import UncorrectableFaultError
from .distributed import rank as _rank
from .kernels.contract import COUNTER_SHAPE, KIND_INDEX, KINDS, SITES


@dataclass(frozen=True)
class FaultEvent:
    """``count`` events of one ``kind`` at one ``site`` of one module during one model call.

    ``step`` is the model forward-call index since protection was enabled (or the report was
    reset): in ``generate`` that is the generation step (0 = prefill). ``layer`` is the
    transformer block index (-1 for modules outside the blocks, e.g. ``lm_head``). ``rank`` is the
    torch.distributed rank of the process whose computation it was (0 when not distributed): under
    tensor parallelism, the shard the fault was found in.
    """

    step: int
    layer: int
    module: str
    site: str
    kind: str
    count: int
    rank: int = 0


@dataclass(frozen=True)
class ModuleSlot:
    index: int
    name: str
    layer: int


def _event_order(e: FaultEvent) -> tuple:
    return (e.step, e.layer, e.module, SITES.index(e.site), KINDS.index(e.kind), e.rank)


class EventRecorder:
    """Owns the device counter tensors of one protected model."""

    def __init__(self, policy: str = "warn", record: bool = True) -> None:
        self.policy = policy
        self.record = record
        self.slots: list[ModuleSlot] = []
        self.step = 0
        # Devices whose step tensor was used in the current step -> that tensor (a persistent buffer).
        self._current: dict[torch.device, torch.Tensor] = {}
        # The persistent (modules, sites, kinds) int32 step buffer of each device.
        self._buffers: dict[torch.device, torch.Tensor] = {}
        # (slot index, device) -> that slot's view of the device's buffer: made once, not at every call
        # (an indexing op, a few µs of host time per protected call)
        self._views: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._history: list[tuple[int, dict[torch.device, torch.Tensor]]] = []
        self._pending_warn: list[tuple[int, torch.Tensor, object]] = []
        self._warned = 0
        # module name -> calls that ran outside protection; -> the route they took; -> its block index
        self.unprotected: dict[str, int] = {}
        self.unprotected_routes: dict[str, str] = {}
        self.unprotected_layers: dict[str, int] = {}

    # -- slots -------------------------------------------------------------------------------
    def add_slot(self, name: str, layer: int) -> ModuleSlot:
        slot = ModuleSlot(len(self.slots), name, layer)
        self.slots.append(slot)
        return slot

    def prepare(self, devices: Iterable[torch.device]) -> None:
        """Allocate the step buffers of ``devices`` now (outside any compiled region)."""
        for dev in devices:
            self._buffer(torch.device(dev))

    def _buffer(self, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None:
            buf = torch.zeros((len(self.slots), *COUNTER_SHAPE), dtype=torch.int32, device=device)
            if not torch.compiler.is_compiling():
                # A fixed address: CUDA graphs may mutate it in place across replays.
                torch._dynamo.mark_static_address(buf)
            self._buffers[device] = buf
        return buf

    def step_block(self, device: torch.device) -> torch.Tensor:
        """The (modules, sites, kinds) int32 counter tensor of the current step on ``device``."""
        cur = self._current.get(device)
        if cur is None:
            cur = self._buffer(device)
            self._current[device] = cur
        return cur

    def counters(self, slot: ModuleSlot, device: torch.device) -> torch.Tensor:
        """The (sites, kinds) int32 block of ``slot`` for the current step on ``device``."""
        buf = self.step_block(device)
        if torch.compiler.is_compiling():
            return buf[slot.index]
        view = self._views.get((slot.index, device))
        if view is None or view._base is not buf:  # (a copied or unpickled recorder: made again)
            view = self._views[(slot.index, device)] = buf[slot.index]
        return view

    def note_unprotected(self, slot: ModuleSlot, route: str, calls: int = 1) -> None:
        """Count ``calls`` of the protected module of ``slot`` that ran outside protection, by ``route``."""
        self.unprotected[slot.name] = self.unprotected.get(slot.name, 0) + calls
        self.unprotected_routes[slot.name] = route
        self.unprotected_layers[slot.name] = slot.layer

    # -- steps ---------------------------------------------------------------------------------
    @torch.compiler.disable
    def end_step(self) -> None:
        """File a copy of the current step's counters (no host sync) and start the next step."""
        self._poll_warnings()
        if self._current:
            filed = {dev: buf.clone() for dev, buf in self._current.items()}
            for buf in self._current.values():
                buf.zero_()
            if self.record:
                self._history.append((self.step, filed))
            if self.policy == "warn":
                self._queue_warning(self.step, filed)
        self._current = {}
        self.step += 1

    def _queue_warning(self, step: int, tensors: dict[torch.device, torch.Tensor]) -> None:
        k = KIND_INDEX["uncorrectable"]
        for dev, t in tensors.items():
            total = t[:, :, k].sum()
            if dev.type == "cuda":
                host = torch.empty((), dtype=total.dtype, pin_memory=True)
                host.copy_(total, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                self._pending_warn.append((step, host, ev))
            else:
                self._pending_warn.append((step, total, None))
        self._poll_warnings()

    def _poll_warnings(self, wait: bool = False) -> None:
        keep = []
        for step, host, ev in self._pending_warn:
            if ev is not None and not wait and not ev.query():
                keep.append((step, host, ev))
                continue
            if ev is not None:
                ev.synchronize()
            n = int(host)
            if n:
                self._warned += n
                warnings.warn(
                    f"ft_transformers: {n} uncorrectable fault(s) in model call {step}; "
                    "see fault_report(model)", RuntimeWarning, stacklevel=3)
        self._pending_warn = keep

    @staticmethod
    def raise_if_uncorrectable(counters: torch.Tensor, module: str) -> None:
        """The ``on_uncorrectable="raise"`` check (synchronises)."""
        n = int(counters[:, KIND_INDEX["uncorrectable"]].sum())
        if n:
            raise UncorrectableFaultError(f"{n} uncorrectable fault(s) in {module}")

    # -- report --------------------------------------------------------------------------------
    def events(self) -> list[FaultEvent]:
        self._poll_warnings(wait=True)
        out: list[FaultEvent] = []
        entries = list(self._history)
        if self._current:
            entries.append((self.step, self._current))
        here = _rank()
        for step, tensors in entries:
            for t in tensors.values():
                host = t.detach().cpu()
                for idx in host.nonzero().tolist():
                    mod, site, kind = idx
                    slot = self.slots[mod]
                    out.append(FaultEvent(step, slot.layer, slot.name, SITES[site], KINDS[kind],
                                          int(host[mod, site, kind]), here))
        out.sort(key=_event_order)
        return out

    def reset(self) -> None:
        self._poll_warnings(wait=True)
        self._history.clear()
        for buf in self._buffers.values():
            buf.zero_()
        self._current = {}
        self.step = 0
        self.unprotected.clear()
        self.unprotected_routes.clear()
        self.unprotected_layers.clear()


class FTReport:
    """What the protection saw: a list of `FaultEvent` and views of it.

    ``str(report)`` is a table per layer × site; `summary` the same as a dict; `by_step` per
    generation step × layer; `to_json` / `to_csv` export the events.

    ``unprotected`` is ``{module name: calls}``: the protected modules that ran outside protection
    (attention switched away from EFTA by any route, a Linear swapped out) and how many of their calls
    did; empty when everything ran protected. ``unprotected_routes`` names the route of each,
    ``unprotected_layers`` its transformer block (-1 outside the blocks).

    ``unchecked`` is ``{module name: why}``: modules whose products no check covers at all (MoE
    experts stored as fused 3-D parameters, a router's bare weight; `ft_transformers.discovery`).

    ``ranks`` lists the torch.distributed ranks whose events the report holds: this process's rank for
    a report of its own recorder, every rank for a gathered one (`merge`); the table then has a rank
    column. A report pickles without its recorder (a detached copy, e.g. to send it to another rank).
    """

    def __init__(self, events: list[FaultEvent], recorder: EventRecorder | None = None,
                 steps: int = 0, unprotected: dict[str, int] | None = None,
                 unprotected_routes: dict[str, str] | None = None,
                 unprotected_layers: dict[str, int] | None = None, unchecked: dict[str, str] | None = None,
                 ranks: Iterable[int] | None = None) -> None:
        self.events = events
        self.steps = steps
        self._recorder = recorder
        if ranks is None:
            ranks = (_rank(),) if recorder is not None else ({e.rank for e in events} or (0,))
        self.ranks: tuple[int, ...] = tuple(sorted(set(ranks)))
        rec = recorder
        self.unprotected: dict[str, int] = dict(
            unprotected if unprotected is not None else (rec.unprotected if rec is not None else {}))
        self.unprotected_routes: dict[str, str] = dict(
            unprotected_routes if unprotected_routes is not None else (rec.unprotected_routes if rec else {}))
        self.unprotected_layers: dict[str, int] = dict(
            unprotected_layers if unprotected_layers is not None else (rec.unprotected_layers if rec else {}))
        self.unchecked: dict[str, str] = dict(unchecked or {})

    @classmethod
    def merge(cls, reports: Iterable[FTReport]) -> FTReport:
        """One report of several ranks' reports (what ``fault_report(model, all_ranks=True)`` returns).

        Events are kept apart by their ``rank``; ``steps`` is the most model calls any rank made;
        ``unprotected`` calls are summed per module name over the ranks and ``unchecked`` joined. The
        result has no recorder: its `reset` forgets only the merged report."""
        reports = list(reports)
        if not reports:
            raise ValueError("FTReport.merge needs at least one report")
        unprotected: dict[str, int] = {}
        for r in reports:
            for name, n in r.unprotected.items():
                unprotected[name] = unprotected.get(name, 0) + n
        return cls(sorted((e for r in reports for e in r.events), key=_event_order), None,
                   steps=max(r.steps for r in reports), unprotected=unprotected,
                   unprotected_routes={k: v for r in reports for k, v in r.unprotected_routes.items()},
                   unprotected_layers={k: v for r in reports for k, v in r.unprotected_layers.items()},
                   unchecked={k: v for r in reports for k, v in r.unchecked.items()},
                   ranks=[x for r in reports for x in r.ranks])

    def __getstate__(self) -> dict:
        # the recorder holds device tensors and belongs to this process's model
        return {**self.__dict__, "_recorder": None}

    def totals(self) -> dict[str, int]:
        tot = dict.fromkeys(KINDS, 0)
        for e in self.events:
            tot[e.kind] += e.count
        return tot

    def summary(self) -> dict[tuple[int, str], dict[str, int]]:
        """``{(layer, site): {kind: count}}`` summed over steps and modules.

        Calls that ran outside protection appear as ``(layer, "unprotected"): {"calls": n}`` (summed
        over the layer's modules), after the layer's sites; absent when everything ran protected.
        """
        out = self._event_summary()
        if not self.unprotected:
            return out
        calls: dict[int, int] = defaultdict(int)
        for name, n in self.unprotected.items():
            calls[self.unprotected_layers.get(name, -1)] += n
        for layer, n in calls.items():
            out[(layer, "unprotected")] = {"calls": n}
        order = {site: i for i, site in enumerate((*SITES, "unprotected"))}
        return dict(sorted(out.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])))

    def _event_summary(self, by_rank: bool = False) -> dict[tuple, dict[str, int]]:
        """``{(layer, site): {kind: count}}``; with ``by_rank`` ``{(rank, layer, site): ...}``."""
        acc: dict[tuple, dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
        for e in self.events:
            acc[(e.rank, e.layer, e.site) if by_rank else (e.layer, e.site)][e.kind] += e.count
        return dict(sorted(acc.items(), key=lambda kv: (*kv[0][:-1], SITES.index(kv[0][-1]))))

    def by_rank(self) -> dict[int, dict[str, int]]:
        """``{rank: {kind: count}}`` summed over steps, modules and sites, for every rank of the report."""
        acc: dict[int, dict[str, int]] = {r: dict.fromkeys(KINDS, 0) for r in self.ranks}
        for e in self.events:
            acc.setdefault(e.rank, dict.fromkeys(KINDS, 0))[e.kind] += e.count
        return dict(sorted(acc.items()))

    def by_step(self) -> dict[tuple[int, int], dict[str, int]]:
        """``{(step, layer): {kind: count}}`` summed over modules and sites."""
        acc: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
        for e in self.events:
            acc[(e.step, e.layer)][e.kind] += e.count
        return dict(sorted(acc.items()))

    def reset(self) -> None:
        """Forget every event recorded so far (and restart the step count)."""
        if self._recorder is not None:
            self._recorder.reset()
        self.events = []
        self.steps = 0
        self.unprotected = {}
        self.unprotected_routes = {}
        self.unprotected_layers = {}

    def to_json(self, path: str | Path) -> None:
        data = {"steps": self.steps, "ranks": list(self.ranks), "totals": self.totals(),
                "events": [asdict(e) for e in self.events], "unchecked": self.unchecked,
                "unprotected": [{"module": name, "layer": self.unprotected_layers.get(name, -1), "calls": n,
                                 "route": self.unprotected_routes.get(name, "")}
                                for name, n in self.unprotected.items()]}
        Path(path).write_text(json.dumps(data, indent=1))

    def to_csv(self, path: str | Path) -> None:
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "layer", "module", "site", "kind", "count", "rank"])
            for e in self.events:
                w.writerow([e.step, e.layer, e.module, e.site, e.kind, e.count, e.rank])

    def __str__(self) -> str:
        by_rank = len(self.ranks) > 1
        summ = self._event_summary(by_rank)
        head = f"ft_transformers fault report: {self.steps} model call(s), "
        if by_rank:
            head = head[:-2] + f" on {len(self.ranks)} ranks, "
        if not summ:
            return head + "no events" + self._unprotected_table() + self._unchecked_line()
        tot = self.totals()
        head += ", ".join(f"{tot[k]} {k}" for k in KINDS if tot[k]) + "\n"
        keys = ["rank", "layer", "site"] if by_rank else ["layer", "site"]
        cols = [*keys, *KINDS]
        rows = [[*map(str, key[:-2]), ("-" if key[-2] < 0 else str(key[-2])), key[-1], *(str(c[k]) for k in KINDS)]
                for key, c in summ.items()]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(cols)]
        fmt = "  ".join(f"{{:<{w}}}" if i < len(keys) else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*cols), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in rows]
        return head + "\n".join(lines) + self._unprotected_table() + self._unchecked_line()

    def _unchecked_line(self) -> str:
        """The line of `__str__` on modules no check covers ("" when there are none)."""
        if not self.unchecked:
            return ""
        return (f"\nUNCHECKED: {len(self.unchecked)} module(s) compute outside checked GEMMs "
                f"(e.g. {next(iter(self.unchecked))}); see .unchecked")

    def _unprotected_table(self) -> str:
        """The lines of `__str__` on calls that ran outside protection ("" when there were none)."""
        if not self.unprotected:
            return ""
        total = sum(self.unprotected.values())
        rows = [[name, str(n), self.unprotected_routes.get(name, "")] for name, n in self.unprotected.items()]
        cols = ["module", "calls", "route"]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(cols)]
        fmt = "  ".join(("{:>%d}" if i == 1 else "{:<%d}") % w for i, w in enumerate(widths))
        lines = [f"\nWARNING: {total} call(s) of {len(rows)} protected module(s) ran UNPROTECTED:",
                 fmt.format(*cols).rstrip(), "  ".join("-" * w for w in widths)]
        lines += [fmt.format(*r).rstrip() for r in rows]
        return "\n".join(lines)

    def __repr__(self) -> str:
        extra = f", unprotected={sum(self.unprotected.values())}" if self.unprotected else ""
        extra += f", ranks={list(self.ranks)}" if len(self.ranks) > 1 else ""
        return f"FTReport(steps={self.steps}, events={len(self.events)}, totals={self.totals()}{extra})"
