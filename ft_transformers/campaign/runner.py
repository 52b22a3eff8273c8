"""Running a campaign: the clean runs of every prompt (kept in memory, cache included), the probes that
tell where a flip can land unseen, one trial in each protection arm, the resumable loop, and replay.

A run starts by (1) generating every prompt cleanly in both arms, (2) measuring the numerical noise
of each step against a float32 eager copy of the model (teacher-forced on the clean tokens), (3) probing
which of the last block's modules leave their non-last prefill rows unread (`positions.probe_unused_rows`),
which mask the attention receives (`positions.MaskFormProbe`) and which sites a flip reaches at all.
What the probes found is written as a ``setup`` line of the campaign file.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from ..injection import FaultSpec
from ..kernels.contract import KINDS
from ..protect import disable_fault_tolerance, enable_fault_tolerance, inject_faults
from .config import ARM_CONFIGS, ARMS, CampaignConfig
from .generation import CleanRun, Greedy
from .models import encode_prompt, load_model
from .positions import MaskFormProbe, masked_position, probe_unused_rows
from .store import FORMAT_VERSION, CampaignStore, load_campaign, versions
from .trials import (
    Trial,
    answer_correct,
    classify,
    flip_landings,
    model_targets,
    plan_trial,
    token_agreement,
    token_outcome,
    trial_from_record,
    trial_id,
)

_LOG = logging.getLogger("ft_transformers")


def _totals(rows: Iterable[Sequence]) -> dict[str, int]:
    tot = dict.fromkeys(KINDS, 0)
    for r in rows:
        tot[r[4]] += int(r[5])
    return tot


def _margins(logits: torch.Tensor) -> list[float]:
    """Top-1 minus top-2 logit of each step, (n, V) → n floats."""
    top = logits.topk(2, dim=-1).values
    return [float(x) for x in (top[:, 0] - top[:, 1])]


def _eos_ids(model: torch.nn.Module) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def _window(model: torch.nn.Module) -> int | None:
    cfg = model.config
    w = getattr(cfg, "sliding_window", None)
    if w is None or getattr(cfg, "use_sliding_window", True) is False:
        return None
    return int(w)


class StoreMismatch(ValueError):
    """The campaign file cannot take this run: it holds another campaign, or its clean runs do not reproduce
    here. The command line reports it as a usage error, without a traceback."""


class Session:
    """A model set up for a campaign: encoded prompts, clean runs per (arm, prompt), noise, probes.

    Args:
        model, tok: the model (protected or not; it is protected per arm here) and its tokenizer.
        config: the campaign.
        shortcut: let faulty runs stop once their state is the clean one again (`generation`).
    """

    def __init__(self, model, tok, config: CampaignConfig, *, shortcut: bool = True) -> None:
        self.model = model
        self.tok = tok
        self.config = config
        self.shortcut = shortcut
        self.greedy = Greedy(model, config.max_new_tokens, _eos_ids(model))
        self.inputs = [encode_prompt(tok, p["prompt"], config.chat_template).to(config.device)
                       for p in config.prompts]
        self.cleans: dict[tuple[str, int], CleanRun] = {}
        self.noise: dict[int, list[float]] = {}
        self.arm: str | None = None
        self.unused_rows: list[str] = []
        self.mask_form = "unknown"
        self.window = _window(model)
        self.sites_used: list[str] = list(config.sites)
        self.targets: dict[int, dict] = {}

    def use(self, arm: str) -> None:
        """Protect the model as ``arm`` asks (only when it is not already)."""
        if self.arm != arm:
            enable_fault_tolerance(self.model, ARM_CONFIGS[arm])
            self.arm = arm

    def text(self, tokens: Sequence[int] | None) -> str | None:
        if tokens is None:
            return None
        return self.tok.decode(tokens, skip_special_tokens=True).strip()

    # -- clean runs -----------------------------------------------------------------------------
    def _reference(self) -> torch.nn.Module:
        """A float32 copy of the model with eager attention and plain Linear layers (no protection)."""
        disable_fault_tolerance(self.model)
        self.arm = None
        ref = copy.deepcopy(self.model)
        torch.nn.Module.float(ref)  # (a GGUF-loaded model refuses transformers' own .float())
        ref.set_attn_implementation("eager")
        return ref.eval()

    @staticmethod
    def _teacher_forced(ref: torch.nn.Module, ids: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """(n, V) fp32 logits of ``ref`` at the n positions that choose ``tokens`` after prompt ``ids``."""
        full = torch.cat([ids, torch.tensor([list(tokens[:-1])], dtype=ids.dtype, device=ids.device)], dim=1)
        with torch.inference_mode():
            out = ref(input_ids=full, use_cache=False)
        return out.logits[0, ids.shape[1] - 1:].float()

    def run_cleans(self) -> list[dict]:
        """Generate every prompt cleanly in both arms (the trial plan needs the unprotected lengths even
        when only one arm runs), measure each step's noise, and return the ``clean`` records."""
        recs = []
        forms: set[str] = set()
        for arm in ARMS:
            self.use(arm)
            probe = MaskFormProbe(self.model, model_targets_names(self.model))
            try:
                for i, ids in enumerate(self.inputs):
                    self.cleans[(arm, i)] = self.greedy.clean(ids)
            finally:
                probe.close()
            forms.add(probe.form)
        self.mask_form = forms.pop() if len(forms) == 1 else "unknown"
        ref = self._reference()
        for i, ids in enumerate(self.inputs):
            per_arm = [self.cleans[(arm, i)] for arm in ARMS]
            noise = torch.zeros(len(per_arm[0].tokens))
            for c in per_arm:
                r = self._teacher_forced(ref, ids, c.tokens).cpu()  # (the noise is kept on the host)
                n = min(len(noise), r.shape[0])
                noise[:n] = torch.maximum(noise[:n], (c.logits[:n].cpu() - r[:n]).abs().amax(-1))
            self.noise[i] = [float(x) for x in noise]
            recs.append(self._clean_record(i))
        del ref
        return recs

    def _clean_record(self, i: int) -> dict:
        rec: dict = {"type": "clean", "prompt_index": i, "prompt": self.config.prompts[i],
                     "prompt_tokens": int(self.inputs[i].shape[1]), "noise": self.noise[i]}
        for arm in ARMS:
            c = self.cleans[(arm, i)]
            text = self.text(c.tokens)
            rec[arm] = {"tokens": c.tokens, "text": text, "finite": c.finite, "events": c.events,
                        "totals": _totals(c.events), "margin": _margins(c.logits),
                        "answer_correct": answer_correct(text, self.config.prompts[i].get("answer")),
                        "seconds": round(c.seconds, 3)}
        rec["false_positives"] = rec["protected"]["totals"]["detected"]  # every detection in a clean run
        rec["arms_agree"] = rec["unprotected"]["tokens"] == rec["protected"]["tokens"]
        return rec

    # -- probes ---------------------------------------------------------------------------------
    def _prefill(self, ids: torch.Tensor):
        cache = self.greedy.new_cache()
        logits = self.greedy.forward(ids, cache)
        return logits, [(k.clone(), v.clone()) for k, v in self.greedy.layers(cache)]

    def probe(self) -> dict:
        """Run the probes and return the ``setup`` record.

        Unread rows are probed without protection (the data flow of the model). Sites are probed with
        protection on, whatever the campaign's arms: the checks' own operands (``attn.checksum``) exist
        only there, and the trial plan must not depend on the arms. With protection off a flip at such
        a site then finds nothing to hit (``not_injected``).
        """
        self.use("unprotected")
        self.targets = model_targets(self.model)
        blocks = [layer for layer in self.targets if layer >= 0]
        last = self.targets[max(blocks)] if blocks else {"attention": None, "linear": []}
        candidates = [n for n in [last["attention"], *last["linear"]] if n]
        self.unused_rows = probe_unused_rows(self.model, self._prefill, self.inputs[0], candidates)
        used, unused = [], []
        self.use("protected")
        for site in self.config.sites:
            (used if self._site_reached(site) else unused).append(site)
        self.sites_used = used
        if unused:
            _LOG.warning(f"campaign: no flip lands at site(s) {', '.join(unused)} in this model's computation"
                         + ("; a uniform campaign leaves them out" if self.config.sampling == "uniform" else ""))
        return {"type": "setup", "sites_used": used, "sites_unused": unused, "unused_rows": self.unused_rows,
                "mask_form": self.mask_form, "window": self.window,
                "noise_reference": "float32 copy, eager attention, unprotected Linear (teacher-forced)",
                "shortcut": self.shortcut, "eos": sorted(self.greedy.eos)}

    def _site_reached(self, site: str) -> bool:
        """Whether a flip at ``site`` of the first module that has it lands in a prefill."""
        attn = site.startswith("attn.")
        for _layer, d in self.targets.items():
            names = [d["attention"]] if attn and d["attention"] else ([] if attn else d["linear"])
            if names:
                spec = FaultSpec(site=site, bit=0, count=1, layers=[names[0]], calls=[0], seed=0)
                with inject_faults(self.model, spec) as log:
                    self.greedy.forward(self.inputs[0], self.greedy.new_cache())
                return log.injected > 0
        return False

    # -- trials ---------------------------------------------------------------------------------
    def run_trial(self, trial: Trial, ver: dict | None = None) -> dict:
        """Run one trial in the campaign's arms and return its JSON record."""
        cfg = self.config
        spec = trial.fault_spec()
        rec: dict = {"type": "trial", "trial_id": trial.trial_id, **asdict(trial), "model": cfg.model,
                     "dtype": cfg.dtype, "device": cfg.device, "max_new_tokens": cfg.max_new_tokens,
                     "campaign_seed": cfg.seed, "versions": ver or versions()}
        answers = cfg.prompts[trial.prompt_index].get("answer")
        start = trial.step if trial.step is not None else 0
        for arm in cfg.arms:
            self.use(arm)
            clean = self.cleans[(arm, trial.prompt_index)]
            t0 = time.perf_counter()
            run = self.greedy.run_from(clean, start, spec, shortcut=self.shortcut)
            seconds = time.perf_counter() - t0
            # per arm: the checks' own operands (attn.checksum) exist only with protection on
            flips, lands = flip_landings(trial, run.records, unused_rows=self.unused_rows,
                                         mask_form=self.mask_form, window=self.window)
            tot = _totals(run.events)
            hit_step = (lambda s: True) if trial.step is None else (lambda s: s == trial.step)
            elsewhere = sum(int(r[5]) for r in run.events
                            if r[4] == "detected" and not (r[2] == trial.module and hit_step(r[0])))
            text = self.text(run.tokens)
            margins = _margins(clean.logits)
            rec[arm] = {
                "class": classify(tokens=run.tokens, clean_tokens=clean.tokens, finite=run.finite, error=run.error,
                                  totals=tot),
                **token_outcome(run.tokens, clean.tokens, tot, first_diff=run.first_diff, margins=margins,
                                noise=self.noise[trial.prompt_index]),
                "tokens": run.tokens, "text": text, "finite": run.finite, "error": run.error,
                "injected": sum(f["injected"] for f in flips), "flips": flips,
                "exact_match": run.tokens is not None and list(run.tokens) == list(clean.tokens),
                "token_agreement": round(token_agreement(run.tokens, clean.tokens), 6),
                "answer_correct": answer_correct(text, answers),
                "events": run.events, "totals": tot, "detected_elsewhere": elsewhere,
                "landings": lands, "masked_position": masked_position(lands),
                "logit_dev": run.logit_dev, "steps_run": run.steps_run, "seconds": round(seconds, 3),
            }
        return rec


def model_targets_names(model: torch.nn.Module) -> list[str]:
    """Names of a protected model's attention modules."""
    return [d["attention"] for d in model_targets(model).values() if d["attention"]]


# --------------------------------------------------------------------------------------------
# The campaign loop
# --------------------------------------------------------------------------------------------


def _same_outputs(a: dict, b: dict) -> bool:
    return all(a[arm]["tokens"] == b[arm]["tokens"] and a[arm]["totals"] == b[arm]["totals"] for arm in ARMS)


def _postfix(counts: dict[str, list[int]]) -> str:
    return " / ".join(f"silent {'off' if arm == 'unprotected' else 'on'} {k}/{n}" for arm, (k, n) in counts.items())


def run_campaign(config: CampaignConfig, path: str | os.PathLike, *, model=None, tokenizer=None,
                 progress: bool = True, on_trial: Callable[[dict], None] | None = None,
                 log: Callable[[str], None] | None = None, shortcut: bool = True,
                 workers: int = 1) -> list[dict]:
    """Run (or resume) a campaign into the JSONL file ``path``; return every trial record, in order.

    Trials already in the file are skipped, a partial last line is dropped; the clean runs are
    recomputed and must reproduce the stored ones (same numerics), else ValueError.
    ``on_trial(record)`` is called after each trial is written (tests use it to simulate a kill).
    ``shortcut``: see `generation` (False runs every step of every faulty generation).
    ``workers`` > 1 runs the trials in that many spawned processes, each loading the model itself (so
    ``model`` must be None); records are written as they finish, in any order.
    """
    if workers > 1 and model is not None:
        raise ValueError("workers > 1 load the model in each process: pass model=None")
    say = log or _LOG.info
    warn = log or _LOG.warning
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    store = CampaignStore(path).load()
    if store.dropped_bytes:
        warn(f"campaign: dropped a partial last line ({store.dropped_bytes} bytes) of {path}")
    fp = config.fingerprint()
    if store.header is not None and store.header["fingerprint"] != fp:
        raise StoreMismatch(f"{path} holds another campaign (fingerprint {store.header['fingerprint']}, "
                         f"this one {fp}); use another output file or `resume` it")
    ver = versions()
    if store.header is not None and store.header.get("versions", {}).get("source") != ver["source"]:
        warn("campaign: warning: the library sources changed since this campaign started "
             f"(source hash {store.header.get('versions', {}).get('source')} -> {ver['source']}); "
             "every trial records the versions it ran with")
    if model is None:
        say(f"campaign: loading {config.model} ...")
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    session = Session(model, tokenizer, config, shortcut=shortcut)
    if store.header is None or store.header["config"].get("trials") != config.trials:
        store.append({"type": "header", "format": FORMAT_VERSION, "fingerprint": fp,
                      "config": config.to_dict(),
                      "versions": ver, "threads": torch.get_num_threads(), "started": time.time()})

    say(f"campaign: clean runs of {len(config.prompts)} prompt(s) ...")
    for rec in session.run_cleans():
        i = rec["prompt_index"]
        old = store.clean.get(i)
        if old is None:
            store.append(rec)
        elif not _same_outputs(old, rec):
            raise StoreMismatch(f"clean run of prompt {i} does not reproduce the stored one "
                             "(different numerics: device, threads, library versions?); start a new file")
        if rec["false_positives"] or not rec["arms_agree"]:
            warn(f"campaign: prompt {i}: clean protected run had {rec['false_positives']} detection(s); "
                 f"clean outputs {'agree' if rec['arms_agree'] else 'DIFFER'} across arms")
    setup = session.probe()
    store.append({**setup, "versions": ver, "time": time.time()})
    lengths = [len(session.cleans[("unprotected", i)].tokens) for i in range(len(config.prompts))]

    todo = [i for i in range(config.trials) if trial_id(config.seed, i) not in store.trials]
    done = config.trials - len(todo)
    if done:
        say(f"campaign: resuming, {done} of {config.trials} trials already in {path}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.trials, initial=done, unit="trial", desc="campaign", dynamic_ncols=True,
                   smoothing=0.05)
    counts = {arm: [sum(bool(r.get(arm, {}).get("silent")) for r in store.trials.values()),
                    sum(arm in r for r in store.trials.values())] for arm in config.arms}
    if workers > 1:
        records = _in_workers(config, todo, workers, shortcut,
                              [session.cleans[("unprotected", i)].tokens for i in range(len(config.prompts))])
    else:
        records = (session.run_trial(plan_trial(config, i, lengths, session.targets, session.sites_used), ver)
                   for i in todo)
    try:
        for rec in records:
            store.append(rec)
            for arm in config.arms:
                counts[arm][0] += bool(rec[arm]["silent"])
                counts[arm][1] += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(_postfix(counts))
            if on_trial is not None:
                on_trial(rec)
    finally:
        if bar is not None:
            bar.close()
        close = getattr(records, "close", None)
        if close is not None:
            close()  # stops the workers
    return [store.trials[trial_id(config.seed, i)] for i in range(config.trials)]


def _worker_gpu(device: str, worker: int, gpus: int) -> int | None:
    """The GPU worker ``worker`` runs on when a campaign on ``device`` has ``gpus`` visible: a bare "cuda"
    spreads the workers over them in turn; a named device ("cuda:1") or a single GPU keeps them together."""
    return worker % gpus if device == "cuda" and gpus > 1 else None


def _worker(config: dict, indices: list[int], shortcut: bool, threads: int, clean_tokens: list[list[int]],
            queue, gpu: int | None = None) -> None:
    """A worker process: set the model up as the parent did (on GPU ``gpu``, the current CUDA device, when
    given), run ``indices``, send each record."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        if gpu is not None:
            torch.cuda.set_device(gpu)  # "cuda" then means this GPU for the model, the inputs and the kernels
        cfg = CampaignConfig.from_dict(config)
        model, tok = load_model(cfg.model, cfg.dtype, cfg.device)
        session = Session(model, tok, cfg, shortcut=shortcut)
        session.run_cleans()
        session.probe()
        mine = [session.cleans[("unprotected", i)].tokens for i in range(len(cfg.prompts))]
        if mine != clean_tokens:
            raise RuntimeError("a worker's clean runs differ from the parent's (different numerics)")
        lengths = [len(t) for t in mine]
        ver = versions()
        for i in indices:
            queue.put(("trial", session.run_trial(plan_trial(cfg, i, lengths, session.targets, session.sites_used),
                                                  ver)))
        queue.put(("done", None))
    except BaseException:  # the parent re-raises it
        import traceback

        queue.put(("error", traceback.format_exc()))


def _in_workers(config: CampaignConfig, todo: list[int], workers: int, shortcut: bool,
                clean_tokens: list[list[int]]):
    """Records of the trials ``todo`` run by ``workers`` spawned processes (each loads the model and
    redoes the clean runs and probes, ~1 min), in the order they finish; on ``--device cuda`` with several
    GPUs visible, worker w runs on GPU w mod their number (`_worker_gpu`). Closing the generator stops them."""
    import multiprocessing
    import queue as queue_mod

    gpus = torch.cuda.device_count() if config.device == "cuda" else 0
    ctx = multiprocessing.get_context("spawn")  # fork after torch has run is not safe
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(config.to_dict(), todo[w::workers], shortcut, torch.get_num_threads(), clean_tokens,
                               q, _worker_gpu(config.device, w, gpus))) for w in range(workers)]
    for p in procs:
        p.start()
    try:
        running = len(procs)
        while running:
            try:
                kind, payload = q.get(timeout=10)
            except queue_mod.Empty:
                if not all(p.is_alive() for p in procs) and q.empty():
                    dead = [p.exitcode for p in procs if not p.is_alive()]
                    if any(code != 0 for code in dead):
                        raise RuntimeError(f"a campaign worker died (exit codes {dead})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"a campaign worker failed:\n{payload}")
            if kind == "done":
                running -= 1
            else:
                yield payload
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def _comparable(rec: dict) -> dict:
    out = {k: v for k, v in rec.items() if k not in ("seconds", "versions")}
    for arm in ARMS:
        if arm in out:
            out[arm] = {k: v for k, v in out[arm].items() if k != "seconds"}
    return out


def replay_trial(path: str | os.PathLike, tid: str, *, model=None, tokenizer=None,
                 shortcut: bool = True) -> tuple[dict, dict]:
    """Re-run one stored trial from its campaign file; ``(stored, fresh)`` records (compare them
    without ``seconds`` / ``versions``: identical when the environment reproduces the numerics)."""
    header, _cleans, trials = load_campaign(path)
    if header is None:
        raise ValueError(f"{path} has no campaign header")
    stored = next((t for t in trials if t["trial_id"] == tid), None)
    if stored is None:
        raise ValueError(f"no trial {tid!r} in {path}")
    config = CampaignConfig.from_dict(header["config"])
    if model is None:
        model, tokenizer = load_model(config.model, config.dtype, config.device)
    session = Session(model, tokenizer, config, shortcut=shortcut)
    session.run_cleans()
    session.probe()
    return stored, session.run_trial(trial_from_record(stored))
