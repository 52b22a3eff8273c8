"""LongBench v1 / LongBench-E predictions for any causal LM, clean, protected, or under faults.

Modes (``--mode``):

* ``eager`` / ``sdpa``: the baseline, the plain Transformers model with that attention
  implementation, without ft_transformers.
* ``efta``: protected, ``ftt.enable_fault_tolerance(model, ftt.FTConfig())`` (EFTA attention and
  V-ABFT checked GEMMs, detection and correction on).
* ``unprotected``: the same library computation with ``FTConfig(detect=False, correct=False)``,
  i.e. where faults can be injected but nothing checks them.

``--fault-site`` with ``--fault-bit`` (and ``--fault-count``) or ``--fault-ber`` injects faults
into every row's generation (``ftt.inject_faults``); ``eager``/``sdpa`` then run as
``unprotected`` (faults need the library's computation to land in), ``efta`` stays protected.
The faults of a row are seeded from ``--seed``, the task and the row, so the unprotected and the
protected runs see the same faults and a resumed run the same as an uninterrupted one.

Output: ``<out-dir>/<model-tag>/<run-name>/<task>.jsonl`` for LongBench v1 and, as LongBench's
own layout has it (``pred_e/<model>/<task>.jsonl``), ``<out-dir>/pred_e/<model-tag>/<run-name>/
<task>.jsonl`` for LongBench-E: LongBench's prediction rows plus bookkeeping (see shards.py),
appended row by row, resumed without redoing rows, with the fault report beside it
(``<task>.fault_report.json``, ``fault_report.json``) and the per-row events in ``ft_events/``
in library modes. Ctrl-C stops after writing the fault reports of what is done; rerunning the
same command resumes.

Prompt budget (``--max-length`` unless given): LongBench's rule, the model's nominal window
minus 500 (`protocol.prompt_budget`; a named deviation for models outside its table).

Run it as ``ftt-longbench-pred`` (installed with the ``longbench`` extra) or, from a clone, as
``python scripts/longbench_pred.py``.

Data parallel: ``accelerate launch --multi_gpu --num_processes N scripts/longbench_pred.py ...``
(or ``torchrun --nproc_per_node N``): each process takes a strided shard of the rows still to do
and writes its own shard file; rank 0 merges them into the one prediction file (same rows, same
order as one process would write) and the fault events of every process into one report.
``--device-map auto`` spreads one model over the visible GPUs; with N processes each process
spreads its copy over its own group of ``GPUs // N`` GPUs.

``--model`` also takes a pack folder (``pack.json``, see pack.py): a compact requantised copy
made for carrying a model where it cannot be downloaded.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import time
import warnings
from pathlib import Path

from . import runtime
from .data import load_rows, row_keys, split_name
from .pack import is_pack, pack_tag, unpack
from .protocol import (
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    MAX_NEW_TOKENS,
    NEWLINE_STOP_TASKS,
    NO_CHAT_TASKS,
    PromptBudget,
    build_prompt,
    newline_token_id,
    prompt_budget,
)
from .shards import (
    TaskFiles,
    read_jsonl_tolerant,
    row_events,
    shard,
    write_run_report,
    write_task_report,
)

MODES = ("eager", "sdpa", "efta", "unprotected")
LIBRARY_MODES = ("efta", "unprotected")
PROTOCOL_KEYS = ("model", "mode", "fault", "max_length", "max_new_tokens", "chat", "dtype", "ft_scope")
SMOLLM2 = "smollm2"


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=SMOLLM2,
                   help="'smollm2' (embedded SmolLM2-135M-Instruct GGUF, default), a Hub id, a local "
                        "directory, or a .gguf file")
    g.add_argument("--model-tag", default=None, help="name of the model's output folder")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: accelerate's choice)")
    g.add_argument("--device-map", default=None, choices=["auto", "balanced", "sequential"],
                   help="spread one model over the visible GPUs (with N processes: over this "
                        "process's group of GPUs // N GPUs)")
    g.add_argument("--max-length", type=int, default=None,
                   help="prompt budget in tokens before middle truncation (default: LongBench's "
                        "model2maxlen rule, the model's nominal window - 500, e.g. 7500 for an 8k "
                        "model; for a model outside the table, a deviation: the window read from "
                        "max_position_embeddings)")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="cap on the per-task generation budget (smoke tests only: not the protocol)")
    g.add_argument("--chat", default="auto", choices=["auto", "always", "never"],
                   help="chat template for the non-few-shot tasks (auto: where the tokenizer has one)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    g.add_argument("--dist-timeout", type=float, default=180.0,
                   help="minutes a process waits at a barrier for the others (data parallel)")

    g = p.add_argument_group("data")
    g.add_argument("--data-dir", default=None,
                   help="folder of <task>.jsonl (LongBench's data.zip layout), data.zip itself, or a "
                        "folder with the Parquet export (<task>/test/*.parquet)")
    g.add_argument("--dataset", default=None,
                   help="Hub dataset id when online (THUDM/LongBench loads from its Parquet export)")
    g.add_argument("--revision", default=None, help="Hub revision of --dataset")
    g.add_argument("--tasks", default=None,
                   help="comma-separated tasks (default: all 21, or the 13 of LongBench-E with --e)")
    g.add_argument("--e", "--longbench-e", dest="longbench_e", action="store_true",
                   help="LongBench-E splits (<task>_e)")
    g.add_argument("--limit", type=int, default=None, help="first N rows of each task")

    g = p.add_argument_group("mode and faults")
    g.add_argument("--mode", default="eager", choices=MODES)
    g.add_argument("--ft-scope", default="all", choices=["all", "attention", "linear"],
                   help="what the library wraps in library modes (FTConfig attention/linear)")
    g.add_argument("--fault-site", default=None,
                   help="attn.scores | attn.rowmax | attn.probs | attn.rowsum | attn.output | linear.output")
    g.add_argument("--fault-bit", type=int, default=None, help="bit to flip (0 = mantissa LSB)")
    g.add_argument("--fault-count", type=int, default=1, help="flips per targeted call (with --fault-bit)")
    g.add_argument("--fault-ber", type=float, default=None, help="per-element flip probability")
    g.add_argument("--fault-layers", default=None,
                   help="comma-separated block indices or module names (default: all)")
    g.add_argument("--fault-calls", default=None,
                   help="comma-separated forward-call indices per module and row (0 = prefill; "
                        "default: all)")
    g.add_argument("--seed", type=int, default=0, help="fault seed (mixed with task and row)")

    g = p.add_argument_group("output")
    g.add_argument("--out-dir", default="out/longbench")
    g.add_argument("--run-name", default=None, help="default: the mode, plus the fault spec")
    g.add_argument("--overwrite", action="store_true",
                   help="discard earlier predictions of the selected tasks in this run folder")
    g.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    if (args.fault_bit is None) != (args.fault_ber is None) and args.fault_site is None:
        p.error("--fault-bit/--fault-ber need --fault-site")
    if args.fault_site is not None and (args.fault_bit is None) == (args.fault_ber is None):
        p.error("--fault-site needs exactly one of --fault-bit or --fault-ber")
    if args.dist_timeout <= 0:
        p.error("--dist-timeout must be positive")
    if args.limit is not None and args.limit < 0:
        p.error("--limit must be >= 0")
    if args.data_dir is None and args.dataset is None:
        p.error("give --data-dir (local LongBench files) or --dataset (Hub id, online)")
    pool = LONGBENCH_E_TASKS if args.longbench_e else LONGBENCH_TASKS
    if args.tasks:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        bad = [t for t in tasks if t not in pool]
        if bad:
            p.error(f"unknown task(s) {bad} for LongBench{'-E' if args.longbench_e else ''}; "
                    f"choose from {', '.join(pool)}")
        args.tasks = tasks
    else:
        args.tasks = list(pool)
    return args


def _int_or_name(s: str):
    s = s.strip()
    return int(s) if s.lstrip("-").isdigit() else s


def fault_config(args) -> dict | None:
    """The run's fault model as plain data (None for a clean run)."""
    if args.fault_site is None:
        return None
    return {
        "site": args.fault_site,
        "bit": args.fault_bit,
        "count": args.fault_count if args.fault_bit is not None else None,
        "ber": args.fault_ber,
        "layers": [_int_or_name(x) for x in args.fault_layers.split(",")] if args.fault_layers else None,
        "calls": [int(x) for x in args.fault_calls.split(",")] if args.fault_calls else None,
        "seed": args.seed,
    }


def effective_mode(mode: str, fault: dict | None) -> str:
    """eager/sdpa under faults run through the library unprotected."""
    if fault is not None and mode not in LIBRARY_MODES:
        return "unprotected"
    return mode


def default_run_name(mode: str, fault: dict | None) -> str:
    if fault is None:
        return mode
    what = f"b{fault['bit']}x{fault['count']}" if fault["bit"] is not None else f"ber{fault['ber']:g}"
    parts = [f"{mode}+{fault['site']}", what]
    if fault["layers"]:
        parts.append("L" + ".".join(str(x) for x in fault["layers"]))
    if fault["calls"]:
        parts.append("c" + ".".join(str(x) for x in fault["calls"]))
    parts.append(f"s{fault['seed']}")
    return "-".join(parts)


def row_seed(seed: int, name: str, key: str) -> int:
    digest = hashlib.blake2b(repr((seed, name, key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------

class Dist:
    """Rank, world size, device and a barrier: accelerate's PartialState when launched with
    ``accelerate launch`` (or torchrun), a trivial single process otherwise."""

    def __init__(self, rank: int = 0, world: int = 1, device=None, state=None) -> None:
        self.rank, self.world, self.device, self._state = rank, world, device, state

    @staticmethod
    def launched() -> bool:
        """Whether this process was started by ``accelerate launch`` or torchrun."""
        return int(os.environ.get("WORLD_SIZE", "1")) > 1 or "ACCELERATE_MIXED_PRECISION" in os.environ

    @classmethod
    def from_env(cls, device: str | None = None, timeout_min: float = 180.0) -> Dist:
        """The process group of this launch (``timeout_min``: how long a barrier waits)."""
        import datetime

        import torch

        if cls.launched():
            PartialState = runtime.require("accelerate", "a multi-process launch").PartialState

            # without cpu=True accelerate only forms a multi-process group on accelerators
            cpu = (device or "").startswith("cpu") or not torch.cuda.is_available()
            st = PartialState(cpu=cpu, timeout=datetime.timedelta(minutes=timeout_min))
            dev = device or str(st.device)
            if dev.startswith("cuda"):
                # kernels (Triton's included) launch on the current device: make it this rank's
                torch.cuda.set_device(torch.device(dev))
            return cls(st.process_index, st.num_processes, dev, st)

        return cls(0, 1, device or ("cuda" if torch.cuda.is_available() else "cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self._state is not None and self.world > 1:
            self._state.wait_for_everyone()

    def close(self) -> None:
        if self._state is not None and self.world > 1 and hasattr(self._state, "destroy_process_group"):
            self._state.destroy_process_group()


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def model_source(name: str) -> tuple[str, dict, str]:
    """``(path or id, from_pretrained kwargs, default tag)``."""
    if name == SMOLLM2:
        from ft_transformers.embedded import smollm2_path

        path, gguf = smollm2_path()
        return path, {"gguf_file": gguf}, Path(gguf).stem
    if os.path.isdir(name) and is_pack(name):
        return str(unpack(name)), {}, pack_tag(name)
    if name.endswith(".gguf"):
        path, gguf = os.path.split(os.path.abspath(name))
        return path, {"gguf_file": gguf}, Path(gguf).stem
    tag = Path(name).name if os.path.isdir(name) else name.replace("/", "__")
    return name, {}, tag


def resolve_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def gpu_group(rank: int, world: int, n_gpus: int) -> list[int]:
    """The GPUs process ``rank`` of ``world`` spreads its model over (``--device-map`` under data
    parallel): ``n_gpus // world`` consecutive ones; a clear error where there are too few."""
    if n_gpus < 1:
        raise SystemExit("--device-map needs GPUs; none is visible (run without --device-map on CPU)")
    if world > n_gpus:
        raise SystemExit(f"--device-map with {world} processes needs at least one GPU per process, "
                         f"but {n_gpus} are visible: launch at most {n_gpus} processes, or drop "
                         "--device-map to give each process one whole model on its own GPU")
    k = n_gpus // world
    return list(range(rank * k, (rank + 1) * k))


def load_model(name: str, *, dtype, attn_implementation: str, device: str | None,
               device_map: str | None = None, max_memory: dict | None = None):
    """``(model, tokenizer)`` in eval mode (``device_map``/``max_memory`` go to from_pretrained)."""
    from transformers import AutoTokenizer

    path, kwargs, _ = model_source(name)
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = runtime.load_model(path, dtype=dtype, attn_implementation=attn_implementation, device=device,
                               device_map=device_map, max_memory=max_memory, **kwargs)
    return model, tok


def apply_mode(model, mode: str, ft_scope: str = "all"):
    """Protect (``efta``), instrument without checks (``unprotected``) or leave the model alone."""
    if mode not in LIBRARY_MODES:
        return model
    import ft_transformers as ftt

    scope = {"attention": ft_scope in ("all", "attention"), "linear": ft_scope in ("all", "linear")}
    cfg = ftt.FTConfig(**scope) if mode == "efta" else ftt.FTConfig(detect=False, correct=False, **scope)
    return ftt.enable_fault_tolerance(model, cfg)


def layer_devices(model) -> dict[str, list[int]]:
    """Which device holds each block: ``{"cuda:0": [0, 1, ...], "cuda:1": [...]}`` (the blocks are the
    longest ``nn.ModuleList`` of the model, the indices the fault report's ``layer``)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    out: dict[str, list[int]] = {}
    if lists:
        for i, block in enumerate(max(lists, key=len)):
            p = next(block.parameters(), None)
            out.setdefault(str(p.device) if p is not None else "none", []).append(i)
    return out


def max_prompt_length(model, requested: int | None, names: tuple[str, ...] = ()) -> PromptBudget:
    """The prompt budget (`protocol.prompt_budget`) of ``model``, known by ``names`` (the
    ``--model`` argument, the tag) and its config's ``_name_or_path``."""
    names = (*names, getattr(model.config, "_name_or_path", "") or "")
    return prompt_budget(names, getattr(model.config, "max_position_embeddings", None), requested)


def run_folder(out_dir: str | os.PathLike, tag: str, run_name: str, longbench_e: bool) -> Path:
    """``<out-dir>/<tag>/<run>`` (v1) or ``<out-dir>/pred_e/<tag>/<run>`` (LongBench-E)."""
    base = Path(out_dir) / "pred_e" if longbench_e else Path(out_dir)
    return base / tag / run_name


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------

class Predictor:
    """Generates one LongBench row under the run's mode and fault model."""

    def __init__(self, model, tokenizer, *, mode: str, max_length: int, chat: str = "auto",
                 fault: dict | None = None, max_new_tokens: int | None = None) -> None:
        self.model = model
        self.tok = tokenizer
        self.mode = mode
        self.library = mode in LIBRARY_MODES
        self.max_length = max_length
        self.chat = chat
        self.fault = fault
        self.max_new_tokens = max_new_tokens
        if fault is not None and not self.library:
            raise ValueError("faults need a library mode (efta or unprotected)")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.newline_id = newline_token_id(tokenizer)
        gc = copy.deepcopy(model.generation_config)
        # Greedy decoding; neutral sampling knobs so that the model's defaults neither apply nor warn.
        gc.do_sample = False
        gc.num_beams = 1
        gc.temperature, gc.top_p, gc.top_k = 1.0, 1.0, 50
        if self.pad_id is not None:
            gc.pad_token_id = self.pad_id
        self.gen_config = gc
        if self.library:
            import ft_transformers as ftt

            self._ftt = ftt
            ftt.fault_report(model).reset()

    def _spec(self, seed: int):
        f = self.fault
        return self._ftt.FaultSpec(site=f["site"], bit=f["bit"], count=f["count"] or 1, ber=f["ber"],
                                   layers=f["layers"], calls=f["calls"], seed=seed)

    def generate_kwargs(self, task: str, max_new_tokens: int) -> dict:
        """``generate`` keyword arguments of a task: one GenerationConfig carrying everything."""
        gc = copy.deepcopy(self.gen_config)
        gc.max_new_tokens = max_new_tokens
        if task in NEWLINE_STOP_TASKS:
            eos = self.tok.eos_token_id
            if self.newline_id is None:
                warnings.warn("the tokenizer has no newline token: samsum runs without its newline stop",
                              stacklevel=2)
            gc.eos_token_id = [i for i in (eos, self.newline_id) if i is not None]
            gc.min_new_tokens = 1
        return {"generation_config": gc}

    def budget(self, task: str) -> int:
        """New tokens this run allows for ``task`` (the protocol's, or less under --max-new-tokens)."""
        b = MAX_NEW_TOKENS[task]
        return b if self.max_new_tokens is None else min(b, self.max_new_tokens)

    def predict(self, task: str, name: str, row: dict, key: str, index: int,
                on_token=None) -> tuple[dict, dict | None]:
        """One row: ``(prediction record, fault events or None)``. ``on_token(n)`` is called
        after every generation step with the number of new tokens so far."""
        import torch

        built = build_prompt(self.tok, task, row, self.max_length, chat=self.chat)
        dev = self.model.device
        ids = torch.tensor([built.input_ids], dtype=torch.long, device=dev)
        kw = self.generate_kwargs(task, self.budget(task))
        if on_token is not None:
            kw["stopping_criteria"] = _token_callback(on_token, ids.shape[1])
        flips = None
        t0 = time.perf_counter()
        with torch.inference_mode(), warnings.catch_warnings():
            # Uncorrectable faults are counted in the report; one warning per model call is noise here.
            warnings.filterwarnings("ignore", message=r"ft_transformers: .*uncorrectable")
            if self.fault is not None:
                spec = self._spec(row_seed(self.fault["seed"], name, key))
                with self._ftt.inject_faults(self.model, spec) as log:
                    out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
                flips = int(log.injected)
            else:
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1]:]
        pred = self.tok.decode(new, skip_special_tokens=True)
        record = {
            "pred": pred, "answers": row.get("answers"), "all_classes": row.get("all_classes"),
            "length": row.get("length"), "_id": key, "index": index, "dataset": name,
            "prompt_tokens": built.raw_tokens, "input_tokens": len(built.input_ids),
            "truncated": built.truncated, "chat": built.chat, "new_tokens": int(new.numel()),
            "seconds": round(seconds, 3),
        }
        events = None
        if self.library:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"ft_transformers: .*uncorrectable")
                rep = self._ftt.fault_report(self.model)
            events = row_events(rep, flips, key, index)
            record["ft"] = {**{k: v for k, v in events["totals"].items() if v}, "flips": flips}
            rep.reset()
        return record, events


def _token_callback(on_token, prompt_len: int):
    """A stopping criterion that never stops: it reports the new tokens after each step."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class _Tokens(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            on_token(int(input_ids.shape[1]) - prompt_len)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Tokens()])


class RunProgress:
    """Progress of a whole run: one bar over every row of every task (its ETA is the run's)
    and, below it, the new tokens of the row being generated."""

    def __init__(self, total_rows: int, done_rows: int = 0, enabled: bool = True, step: int = 1) -> None:
        from tqdm.auto import tqdm

        self.enabled = enabled
        self.step = step  # rows the whole run finishes per row of this process (data parallel)
        self.rows = tqdm(total=total_rows, initial=done_rows, desc="run", unit="row", disable=not enabled,
                         dynamic_ncols=True, position=0, smoothing=0.05)
        self.tokens = tqdm(total=0, desc="row", unit="tok", disable=not enabled, dynamic_ncols=True,
                           position=1, leave=False)

    def start_row(self, label: str, budget: int) -> None:
        self.tokens.reset(total=budget)
        self.tokens.set_description(label, refresh=False)

    def on_token(self, n: int) -> None:
        self.tokens.n = n
        self.tokens.refresh()

    def end_row(self) -> None:
        self.rows.update(min(self.step, self.rows.total - self.rows.n) if self.rows.total else self.step)

    def write(self, msg: str) -> None:
        self.rows.write(msg)

    def close(self) -> None:
        self.tokens.close()
        self.rows.close()


def run_task(predictor: Predictor, task: str, rows: list[dict], run_dir: str | os.PathLike, *,
             longbench_e: bool = False, rank: int = 0, world: int = 1, barrier=lambda: None,
             progress: bool | RunProgress = True, report_extra: dict | None = None) -> TaskFiles:
    """Predict this process's share of ``rows`` of ``task`` (resuming), then (rank 0) merge.

    Every process must call it (``barrier`` synchronises them): rank 0 first folds shards left
    by an interrupted run into the final file, then every process reads the same final file,
    so all agree on the rows still to do before anyone writes. ``progress``: a `RunProgress`
    of the whole run, True for one of this task alone, or False.
    """
    name = split_name(task, longbench_e)
    # LongBench's layout names a LongBench-E file by its task; the split is the run folder's.
    files = TaskFiles(run_dir, task, rank, world)
    if rank == 0:
        files.dir.mkdir(parents=True, exist_ok=True)
        files.adopt_events_beside()
        files.merge()
        files.prune_events()
    barrier()
    keys = row_keys(rows)
    done = files.done_keys()
    todo = [i for i, k in enumerate(keys) if k not in done]
    mine = shard(todo, rank, world)
    barrier()  # nobody appends before everybody has read what is done
    files.open_for_append()
    own = isinstance(progress, bool)
    bars = RunProgress(len(mine), 0, enabled=progress and rank == 0) if own else progress
    if rank == 0 and len(todo) < len(keys):
        bars.write(f"{name}: {len(keys) - len(todo)} of {len(keys)} rows already predicted")
    budget = predictor.budget(task) if hasattr(predictor, "budget") else 0
    try:
        for n, i in enumerate(mine):
            bars.start_row(f"{name} {n + 1}/{len(mine)}" + (f" r{rank}/{world}" if world > 1 else ""), budget)
            record, events = (predictor.predict(task, name, rows[i], keys[i], i, on_token=bars.on_token)
                              if bars.enabled else predictor.predict(task, name, rows[i], keys[i], i))
            files.append(record, events)
            bars.end_row()
    finally:
        if own:
            bars.close()
    barrier()
    if rank == 0:
        files.merge()
        if predictor.library:
            write_task_report(files, report_extra)
    barrier()
    return files


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def task_record(predictor: Predictor, task: str, rows: list[dict], n_all: int, args, run_dir: Path) -> dict:
    """What a task actually ran, for run_config.json: its split and file, the rows predicted of
    how many, the generation budget, the stop rule, and how many prompts were truncated or
    wrapped in the chat template."""
    files = TaskFiles(run_dir, task)
    got = [r for r in read_jsonl_tolerant(files.final) if str(r.get("_id")) in set(row_keys(rows))]
    return {
        "split": split_name(task, args.longbench_e), "file": files.final.name,
        "rows": len(got), "rows_selected": len(rows), "rows_in_split": n_all,
        "max_new_tokens": predictor.budget(task), "protocol_max_new_tokens": MAX_NEW_TOKENS[task],
        "stop_at_newline": task in NEWLINE_STOP_TASKS,
        "chat_template": task not in NO_CHAT_TASKS and args.chat != "never",
        "prompts_chat": sum(1 for r in got if r.get("chat")),
        "prompts_truncated": sum(1 for r in got if r.get("truncated")),
        "max_length": predictor.max_length,
        "new_tokens": sum(int(r.get("new_tokens") or 0) for r in got),
    }


def record_task(run_dir: Path, task: str, entry: dict) -> None:
    path = run_dir / "run_config.json"
    cfg = json.loads(path.read_text())
    cfg.setdefault("tasks", {})[task] = entry
    path.write_text(json.dumps(cfg, indent=1))


def interrupted(predictor: Predictor, run_dir: Path, task: str | None, data: dict, args,
                extra: dict) -> None:
    """After Ctrl-C (rank 0): record the rows done, write the fault reports of what was
    predicted, and say how to resume."""
    if task is not None:
        rows, n_all = data[task]
        files = TaskFiles(run_dir, task)
        files.merge()
        record_task(run_dir, task, {**task_record(predictor, task, rows, n_all, args, run_dir),
                                    "interrupted": True})
        if predictor.library:
            write_task_report(files, extra)
    if predictor.library:
        write_run_report(run_dir, extra)
    where = f" in {task}" if task else ""
    print(f"\n[longbench] interrupted{where}; the rows finished so far are saved in {run_dir}"
          + (" with their fault report" if predictor.library else "")
          + ". Rerun the same command to resume (finished rows are not redone).", file=sys.stderr)


def check_run_config(path: Path, config: dict, overwrite: bool) -> None:
    if not path.exists() or overwrite:
        return
    old = json.loads(path.read_text())
    diff = {k: (old.get(k), config.get(k)) for k in PROTOCOL_KEYS if old.get(k) != config.get(k)}
    if diff:
        raise SystemExit(f"{path.parent} holds predictions made with other settings {diff}; "
                         "pick another --run-name or pass --overwrite")


def main(argv=None) -> Path:
    args = parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device_map and args.device and not args.device.startswith("cuda"):
        raise SystemExit(f"--device-map spreads the model over GPUs; it does not go with --device {args.device}")
    dist = Dist.from_env(args.device, args.dist_timeout)
    max_memory = None
    if args.device_map:
        group = gpu_group(dist.rank, dist.world, torch.cuda.device_count())
        if dist.world > 1:
            # only this process's GPUs: the others hold the other processes' copies
            max_memory = {i: torch.cuda.mem_get_info(i)[1] for i in group}
            dist.device = f"cuda:{group[0]}"
            torch.cuda.set_device(group[0])
        if dist.is_main:
            print(f"[longbench] device map {args.device_map}: {dist.world} process(es), "
                  f"{len(group)} GPU(s) each", file=sys.stderr)
    fault = fault_config(args)
    mode = effective_mode(args.mode, fault)
    tag = args.model_tag or model_source(args.model)[2]
    run_name = args.run_name or default_run_name(mode, fault)
    run_dir = run_folder(args.out_dir, tag, run_name, args.longbench_e)
    dtype = resolve_dtype(args.dtype, dist.device)
    attn = args.mode if args.mode in ("eager", "sdpa") else "eager"

    if dist.is_main and mode != args.mode:
        print(f"[longbench] --mode {args.mode} under faults runs as '{mode}' "
              "(library computation, detection and correction off)", file=sys.stderr)
    if dist.world > 1 and dist.is_main:
        print(f"[longbench] data parallel: {dist.world} processes, rows split by index "
              "(rank r takes every world-th row still to do)", file=sys.stderr)
    model, tok = load_model(args.model, dtype=dtype, attn_implementation=attn,
                            device=None if args.device_map else dist.device, device_map=args.device_map,
                            max_memory=max_memory)
    model = apply_mode(model, mode, args.ft_scope)
    budget = max_prompt_length(model, args.max_length, (args.model, tag))
    max_length = budget.tokens
    if dist.is_main:
        print(f"[longbench] prompt budget {max_length} tokens ({budget.rule})", file=sys.stderr)
    config = {
        "model": args.model, "model_tag": tag, "mode": mode, "requested_mode": args.mode,
        "fault": fault, "max_length": max_length, "max_length_source": budget.source,
        "max_length_rule": budget.rule, "max_new_tokens": args.max_new_tokens, "chat": args.chat,
        "dtype": str(dtype).replace("torch.", ""),
        "ft_scope": args.ft_scope if mode in LIBRARY_MODES else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", attn),
        "device": str(model.device), "device_map": args.device_map, "layer_devices": layer_devices(model),
        "world_size": dist.world,
        "longbench_e": args.longbench_e, "limit": args.limit, "versions": runtime.versions(),
    }
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        check_run_config(run_dir / "run_config.json", config, args.overwrite)
        if args.overwrite:
            for task in args.tasks:
                TaskFiles(run_dir, task).remove()
        old_tasks = {} if args.overwrite or not (run_dir / "run_config.json").exists() else \
            json.loads((run_dir / "run_config.json").read_text()).get("tasks", {})
        config["tasks"] = old_tasks
        (run_dir / "run_config.json").write_text(json.dumps(config, indent=1))
    dist.barrier()

    predictor = Predictor(model, tok, mode=mode, max_length=max_length, chat=args.chat, fault=fault,
                          max_new_tokens=args.max_new_tokens)
    extra = {"mode": mode, "fault": fault, "model": args.model}
    data = {}
    for task in args.tasks:
        rows = load_rows(task, data_dir=args.data_dir, dataset=args.dataset, longbench_e=args.longbench_e,
                         revision=args.revision)
        data[task] = (rows[: args.limit] if args.limit is not None else rows, len(rows))
    total = sum(len(r) for r, _ in data.values())
    done = sum(len(TaskFiles(run_dir, t).done_keys() & set(row_keys(r))) for t, (r, _) in data.items())
    bars = RunProgress(total, done, enabled=dist.is_main and not args.no_progress, step=dist.world)
    current = None
    try:
        for task, (rows, n_all) in data.items():
            current = task
            run_task(predictor, task, rows, run_dir, longbench_e=args.longbench_e, rank=dist.rank,
                     world=dist.world, barrier=dist.barrier, progress=bars, report_extra=extra)
            if dist.is_main:
                record_task(run_dir, task, task_record(predictor, task, rows, n_all, args, run_dir))
        current = None
    except KeyboardInterrupt:
        bars.close()
        if dist.is_main:
            interrupted(predictor, run_dir, current, data, args, extra)
        raise SystemExit(130) from None
    bars.close()
    if dist.is_main:
        if predictor.library:
            rep = write_run_report(run_dir, extra)
            if rep:
                tot = ", ".join(f"{v} {k}" for k, v in rep["totals"].items() if v) or "no events"
                print(f"[longbench] fault report: {rep['flips_injected']} flips injected, {tot} "
                      f"-> {run_dir / 'fault_report.json'}", file=sys.stderr)
        print(f"[longbench] predictions in {run_dir}", file=sys.stderr)
    dist.close()
    return run_dir



def cli(argv=None) -> int:
    """Console-script entry point: `main` returns the run folder (for callers in Python), which a
    console script's ``sys.exit(main())`` would print and turn into exit status 1."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
