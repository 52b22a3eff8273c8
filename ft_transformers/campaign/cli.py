"""``ftt-campaign run|resume|report|replay``: the command line over `run_campaign`, `replay_trial` and
`write_report`."""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import torch

from ..kernels import contract
from .config import ARM_LABELS, DEFAULT_PROMPTS, CampaignConfig
from .models import TINY_MODELS
from .report import silent_markdown, summary_markdown, write_report
from .runner import StoreMismatch, _comparable, replay_trial, run_campaign
from .store import CampaignStore, load_campaign

_ARM_OF = {label: arm for arm, label in ARM_LABELS.items()}


def _add_campaign_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (embedded, offline), 'tiny-llama' / 'tiny-gpt2' (random, no download), "
                        "a local path, a .gguf file or a hub id")
    p.add_argument("--prompts", nargs="+", default=None,
                   help="prompts (default: six short factual questions)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line, or JSONL with {'prompt': ..., 'answer': [...]} per line")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts raw (no chat template)")
    p.add_argument("--sites", nargs="+", default=None, choices=contract.SITES,
                   help="fault sites (default: attn.scores linear.output; with --uniform every site)")
    p.add_argument("--uniform", action="store_true",
                   help="draw (site, module) uniformly over every attention site of every block and every "
                        "protected Linear (lm_head included), and the bit uniformly over the site's storage "
                        "width (or over --bits); default: cycle over sites x bits")
    p.add_argument("--arms", nargs="+", choices=sorted(_ARM_OF), default=["off", "on"],
                   help="protection arms each trial runs (default: off on)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--bits", nargs="+", default=None,
                   help="bit selectors: sign | exponent | mantissa | any (a bit drawn per trial), ints, ranges "
                        "a-b (default: exponent mantissa; with --uniform: any)")
    g.add_argument("--ber", nargs="+", type=float, default=None, help="bit error rates instead of --bits")
    p.add_argument("--count", type=int, default=1, help="flips per targeted call (bit mode)")
    p.add_argument("--layers", nargs="+", type=int, default=None,
                   help="blocks to draw from (default all blocks, and with --uniform also -1: lm_head etc. "
                        "for linear.output)")
    p.add_argument("--steps", nargs="+", type=int, default=None,
                   help="generation steps to draw from (0 = prefill; default: any step the clean run "
                        "reaches; -1 = hit every step)")
    p.add_argument("--trials", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")


def _prompts_from(args) -> list[dict] | None:
    if args.prompts_file:
        out = []
        for line in Path(args.prompts_file).read_text().splitlines():
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                out.append(json.loads(line))
            else:
                out.append({"prompt": line.strip()})
        return out
    if args.prompts:
        return [{"prompt": p} for p in args.prompts]
    return None


def _common_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a loaded machine one thread is much faster)")
    p.add_argument("--workers", type=int, default=1,
                   help="run the trials in this many processes (each loads the model; default 1); with "
                        "--device cuda and several GPUs visible, the workers take them in turn")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-shortcut", action="store_true",
                   help="run every step of every faulty generation (default: stop once the state is bitwise "
                        "the clean run's again; the results are the same)")
    p.add_argument("--report-dir", default=None, help="also write the report (tables, plots, events) here")
    p.add_argument("--prefix", default=None, help="file name prefix of the report (default: the JSONL stem)")


def _sigterm_to_interrupt(signum, frame):  # pragma: no cover - signal path
    raise KeyboardInterrupt


def _run_and_report(config: CampaignConfig, args) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        old_handler = signal.signal(signal.SIGTERM, _sigterm_to_interrupt)
    except ValueError:  # pragma: no cover - not in the main thread
        old_handler = None
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    t0 = time.perf_counter()
    try:
        records = run_campaign(config, args.out, progress=not args.no_progress, log=_say,
                               shortcut=not args.no_shortcut, workers=max(1, args.workers))
    except StoreMismatch as e:
        print(f"ftt-campaign: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted; every finished trial is in {args.out}. Re-run the same command (or "
              f"`ftt-campaign resume {args.out}`) to continue.", file=sys.stderr)
        return 130
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    print(f"campaign: {len(records)} trials in {args.out} ({time.perf_counter() - t0:.0f} s this run)",
          file=sys.stderr)
    _, cleans, trials = load_campaign(args.out)
    print(silent_markdown(trials))
    print()
    print(summary_markdown(trials, cleans))
    if args.report_dir:
        files = write_report(args.out, args.report_dir, args.prefix or Path(args.out).stem)
        for k, v in files.items():
            print(f"  {k}: {v}", file=sys.stderr)
    return 0


def _say(msg: str) -> None:
    """The command's own progress lines, to stderr (the library itself logs them)."""
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``ftt-campaign run|resume|report``."""
    p = argparse.ArgumentParser(
        prog="ftt-campaign", description="Fault-injection campaigns for ft_transformers: N trials with "
        "protection off and on, classified, stored in JSONL (resumable).")
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="run (or resume) a campaign into a JSONL file")
    _add_campaign_args(pr)
    pr.add_argument("--out", required=True, help="JSONL results file (appended; resumed if it exists)")
    _common_run_args(pr)
    pz = sub.add_parser("resume", help="resume (or extend with --trials) the campaign stored in a JSONL file")
    pz.add_argument("out", help="JSONL results file")
    pz.add_argument("--trials", type=int, default=None, help="new total number of trials")
    _common_run_args(pz)
    pp = sub.add_parser("report", help="tables, plots and per-step × layer events of a campaign file")
    pp.add_argument("file", help="JSONL results file")
    pp.add_argument("--out-dir", required=True, help="tables (markdown, JSON) and events (JSON, CSV)")
    pp.add_argument("--img-dir", default=None, help="plots (PNG; default: --out-dir)")
    pp.add_argument("--prefix", default=None)
    pp.add_argument("--trial", default=None, help="events of this trial id only (default: all trials)")
    pq = sub.add_parser("replay", help="re-run one stored trial and check that it reproduces")
    pq.add_argument("file", help="JSONL results file")
    pq.add_argument("trial", help="trial id, e.g. s0-t000042")
    pq.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's stack on stderr, to see where a long run is
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (AttributeError, ValueError, OSError):  # a stderr without a file descriptor (a notebook, a test)
            pass

    if args.cmd == "replay":
        torch.set_num_threads(max(1, args.threads))
        stored, fresh = replay_trial(args.file, args.trial)
        same = _comparable(stored) == _comparable(fresh)
        for arm in (a for a in ARM_LABELS if a in stored):
            print(f"{arm:>11}: stored {stored[arm]['class']:<22} replayed {fresh[arm]['class']:<22} "
                  f"text {fresh[arm]['text']!r}")
        print("reproduced exactly" if same else "DIFFERS from the stored record")
        return 0 if same else 1
    if args.cmd == "report":
        files = write_report(args.file, args.out_dir, args.prefix or Path(args.file).stem, trial=args.trial,
                             img_dir=args.img_dir)
        _, cleans, trials = load_campaign(args.file)
        print(silent_markdown(trials))
        print()
        print(summary_markdown(trials, cleans))
        for k, v in files.items():
            print(f"  {k}: {v}", file=sys.stderr)
        return 0
    if args.cmd == "resume":
        store = CampaignStore(args.out).load()
        if store.header is None:
            p.error(f"{args.out} has no campaign header")
        cfg = dict(store.header["config"])
        if args.trials is not None:
            cfg["trials"] = args.trials
        return _run_and_report(CampaignConfig.from_dict(cfg), args)
    prompts = _prompts_from(args)
    if prompts is None:  # the reference answers mean nothing to a random tiny model
        prompts = [dict(x) if args.model not in TINY_MODELS else {"prompt": x["prompt"]}
                   for x in DEFAULT_PROMPTS]
    default_bits = ["any"] if args.uniform else ["exponent", "mantissa"]
    config = CampaignConfig(
        model=args.model, prompts=prompts, sampling="uniform" if args.uniform else "stratified",
        arms=[_ARM_OF[a] for a in args.arms],
        sites=args.sites, bits=None if args.ber else (args.bits or default_bits), ber=args.ber,
        count=args.count, layers=args.layers, steps=args.steps, trials=args.trials,
        max_new_tokens=args.max_new_tokens, seed=args.seed, dtype=args.dtype, device=args.device,
        chat_template=not args.no_chat_template)
    return _run_and_report(config, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
