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

Output: ``<out-dir>/<model-tag>/<run-name>/<task>.jsonl`` (LongBench's prediction rows plus
bookkeeping; see shards.py), appended row by row, resumed without redoing rows, with the fault
report beside it (``<task>.fault_report.json``, ``fault_report.json``) in library modes.

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

if __package__ in (None, ""):  # run as a file: make `longbench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import longbench  # noqa: F401

    __package__ = "longbench"  # noqa: A001

import _common  # noqa: E402  (scripts/ is on sys.path: run as a file, or as `longbench.pred`)

from .data import load_rows, row_keys, split_name  # noqa: E402
from .pack import is_pack, pack_tag, unpack  # noqa: E402
from .protocol import (  # noqa: E402
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    MAX_NEW_TOKENS,
    NEWLINE_STOP_TASKS,
    build_prompt,
    newline_token_id,
)
from .shards import TaskFiles, row_events, shard, write_run_report, write_task_report  # noqa: E402

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
                   help="prompt budget in tokens before middle truncation (default: the model's "
                        "max_position_embeddings - 500, as LongBench's model2maxlen)")
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
            from accelerate import PartialState

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
    model = _common.load_model(path, dtype=dtype, attn_implementation=attn_implementation, device=device,
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


def max_prompt_length(model, requested: int | None) -> int:
    if requested is not None:
        return int(requested)
    n = getattr(model.config, "max_position_embeddings", None)
    if not n:
        raise ValueError("the model config has no max_position_embeddings: give --max-length")
    return max(int(n) - 500, 1)


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

    def predict(self, task: str, name: str, row: dict, key: str, index: int) -> tuple[dict, dict | None]:
        import torch

        built = build_prompt(self.tok, task, row, self.max_length, chat=self.chat)
        dev = self.model.device
        ids = torch.tensor([built.input_ids], dtype=torch.long, device=dev)
        budget = MAX_NEW_TOKENS[task]
        if self.max_new_tokens is not None:
            budget = min(budget, self.max_new_tokens)
        kw = self.generate_kwargs(task, budget)
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


def run_task(predictor: Predictor, task: str, rows: list[dict], run_dir: str | os.PathLike, *,
             longbench_e: bool = False, rank: int = 0, world: int = 1, barrier=lambda: None,
             progress: bool = True, report_extra: dict | None = None) -> TaskFiles:
    """Predict this process's share of ``rows`` of ``task`` (resuming), then (rank 0) merge.

    Every process must call it (``barrier`` synchronises them): rank 0 first folds shards left
    by an interrupted run into the final file, then every process reads the same final file,
    so all agree on the rows still to do before anyone writes.
    """
    from tqdm.auto import tqdm

    name = split_name(task, longbench_e)
    files = TaskFiles(run_dir, name, rank, world)
    if rank == 0:
        files.dir.mkdir(parents=True, exist_ok=True)
        files.merge()
        files.prune_events()
    barrier()
    keys = row_keys(rows)
    done = files.done_keys()
    todo = [i for i, k in enumerate(keys) if k not in done]
    mine = shard(todo, rank, world)
    barrier()  # nobody appends before everybody has read what is done
    files.open_for_append()
    bar = tqdm(total=len(mine), desc=f"{name} r{rank}/{world}" if world > 1 else name,
               position=rank if world > 1 else None, disable=not progress, leave=True, dynamic_ncols=True)
    if rank == 0 and len(todo) < len(keys):
        bar.write(f"{name}: {len(keys) - len(todo)} of {len(keys)} rows already predicted")
    for i in mine:
        record, events = predictor.predict(task, name, rows[i], keys[i], i)
        files.append(record, events)
        bar.update(1)
    bar.close()
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
    run_dir = Path(args.out_dir) / tag / run_name
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
    max_length = max_prompt_length(model, args.max_length)
    config = {
        "model": args.model, "model_tag": tag, "mode": mode, "requested_mode": args.mode,
        "fault": fault, "max_length": max_length, "max_new_tokens": args.max_new_tokens, "chat": args.chat,
        "dtype": str(dtype).replace("torch.", ""),
        "ft_scope": args.ft_scope if mode in LIBRARY_MODES else None,
        "attn_implementation": getattr(model.config, "_attn_implementation", attn),
        "device": str(model.device), "device_map": args.device_map, "layer_devices": layer_devices(model),
        "world_size": dist.world,
        "longbench_e": args.longbench_e, "limit": args.limit, "versions": _common.versions(),
    }
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        check_run_config(run_dir / "run_config.json", config, args.overwrite)
        if args.overwrite:
            for task in args.tasks:
                TaskFiles(run_dir, split_name(task, args.longbench_e)).remove()
        (run_dir / "run_config.json").write_text(json.dumps(config, indent=1))
    dist.barrier()

    predictor = Predictor(model, tok, mode=mode, max_length=max_length, chat=args.chat, fault=fault,
                          max_new_tokens=args.max_new_tokens)
    extra = {"mode": mode, "fault": fault, "model": args.model}
    for task in args.tasks:
        rows = load_rows(task, data_dir=args.data_dir, dataset=args.dataset, longbench_e=args.longbench_e,
                         revision=args.revision)
        if args.limit is not None:
            rows = rows[: args.limit]
        run_task(predictor, task, rows, run_dir, longbench_e=args.longbench_e, rank=dist.rank,
                 world=dist.world, barrier=dist.barrier, progress=not args.no_progress, report_extra=extra)
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


if __name__ == "__main__":
    main()
