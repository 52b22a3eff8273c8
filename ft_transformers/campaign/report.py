"""Campaign reports: summary tables (markdown, JSON), per-bit tables, plots and per-step × layer
event exports. matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from ..events import FaultEvent, FTReport
from ..kernels.contract import KINDS, SITES
from .config import ARM_LABELS, ARMS, CLASS_LABELS, CLASSES
from .store import load_campaign


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a rate k/n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def wilson_upper(k: int, n: int, z: float = 1.96) -> float:
    """Upper end of the Wilson score interval of k/n (z = 1.96: 95 %); for k = 0 it is z²/(n + z²)."""
    return wilson(k, n, z)[1]


def _arms(trials: Sequence[dict]) -> list[str]:
    """The protection arms the trials ran, in `ARMS` order."""
    return [a for a in ARMS if any(a in t for t in trials)]


def summarize(trials: Sequence[dict], by: Sequence[str] = ("site", "bit_class")) -> list[dict]:
    """Rows per group × protection arm: counts of each class, SDC rate (+ 95 % CI), scores."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for t in trials:
        groups[tuple(t[k] for k in by)].append(t)

    def order(key):
        out = []
        for k, v in zip(by, key, strict=True):
            if k == "site":
                out.append(SITES.index(v) if v in SITES else 99)
            elif k == "bit_class":
                out.append({"sign": 0, "exponent": 1, "mantissa": 2}.get(v, 3))
                out.append(str(v))
            else:
                out.append(-1 if v is None else v)
        return out

    rows = []
    arms = _arms(trials)
    for key in sorted(groups, key=order):
        ts = groups[key]
        for arm in arms:
            counts = dict.fromkeys(CLASSES, 0)
            for t in ts:
                counts[t[arm]["class"]] += 1
            n = len(ts)
            ans = [t[arm]["answer_correct"] for t in ts if t[arm].get("answer_correct") is not None]
            lo, hi = wilson(counts["sdc"], n)
            rows.append({**dict(zip(by, key, strict=True)), "arm": arm, "n": n, **counts,
                         "sdc_rate": counts["sdc"] / n if n else 0.0, "sdc_ci": (lo, hi),
                         "failure_rate": (counts["sdc"] + counts["crash"]) / n if n else 0.0,
                         "exact_match": sum(t[arm]["exact_match"] for t in ts) / n if n else 0.0,
                         "token_agreement": sum(t[arm]["token_agreement"] for t in ts) / n if n else 0.0,
                         "task_accuracy": (sum(ans) / len(ans)) if ans else None,
                         "injected": sum(t[arm]["injected"] for t in ts),
                         "detected_elsewhere": sum(t[arm].get("detected_elsewhere", 0) for t in ts)})
    return rows


def false_positives(cleans: Sequence[dict], trials: Sequence[dict] = ()) -> dict:
    """Detections in fault-free work: the clean protected runs, and (in trials) detections in
    modules or steps the fault did not hit."""
    calls = sum(len(c["protected"]["tokens"]) for c in cleans)
    return {"clean_runs": len(cleans), "clean_model_calls": calls,
            "clean_detections": sum(c["false_positives"] for c in cleans),
            "clean_outputs_agree": all(c["arms_agree"] for c in cleans),
            "trial_detections_elsewhere": sum(t["protected"].get("detected_elsewhere", 0) for t in trials
                                              if "protected" in t)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def summary_markdown(trials: Sequence[dict], cleans: Sequence[dict] = (),
                     by: Sequence[str] = ("site", "bit_class")) -> str:
    """Markdown tables: outcome counts per group × protection, and the false-positive line."""
    rows = summarize(trials, by)
    head = [*by, "protection", "n", *(CLASS_LABELS[c] for c in CLASSES), "SDC rate [95 % CI]",
            "exact match", "token agr.", "task acc."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lo, hi = r["sdc_ci"]
        acc = "–" if r["task_accuracy"] is None else _pct(r["task_accuracy"])
        lines.append("| " + " | ".join([
            *(str(r[k]) for k in by), "off" if r["arm"] == "unprotected" else "on", str(r["n"]),
            *(str(r[c]) for c in CLASSES), f"{_pct(r['sdc_rate'])} [{100 * lo:.1f}, {100 * hi:.1f}]",
            _pct(r["exact_match"]), _pct(r["token_agreement"]), acc]) + " |")
    out = "\n".join(lines)
    if cleans:
        fp = false_positives(cleans, trials)
        out += (f"\n\nFalse positives: {fp['clean_detections']} detection(s) in {fp['clean_runs']} clean "
                f"protected generation(s) ({fp['clean_model_calls']} model calls); "
                f"{fp['trial_detections_elsewhere']} detection(s) in protected trials outside the "
                f"faulted module/step. Clean outputs identical with protection off and on: "
                f"{'yes' if fp['clean_outputs_agree'] else 'NO'}.")
        acc = [c["unprotected"].get("answer_correct") for c in cleans]
        acc = [a for a in acc if a is not None]
        if acc:
            out += f" Clean task accuracy (answer in the output): {sum(acc)}/{len(acc)}."
    return out


def masked_of(trial: dict, arm: str) -> bool | None:
    """``masked_position`` of one arm of a trial (files that kept it per trial: that one)."""
    return trial[arm]["masked_position"] if "masked_position" in trial[arm] else trial.get("masked_position")


def silent_summary(trials: Sequence[dict], by: Sequence[str] = ()) -> list[dict]:
    """Silent token changes per group × protection arm, over all trials and over the trials whose flips
    did not all land on a masked, never-used value (``masked_position`` True is left out there;
    undecided trials stay in).

    Row keys: the ``by`` fields, ``arm``, ``scope`` (``"all"`` / ``"excluding masked"``), ``n``,
    ``token_change``, ``silent`` (any silent token change), ``silent_near_tie`` (at a clean near-tie),
    ``silent_beyond_noise`` (the rest: what the target counts), ``rate`` and ``upper`` (Wilson 95 %) of
    ``silent`` and of ``silent_beyond_noise``, ``events`` (trials with any event), ``masked`` and
    ``undecided`` (the trials whose landing is never-used / undecided), ``max_silent_logit_dev`` (the
    largest logit deviation from the clean run among event-free trials whose flips were used).
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for t in trials:
        groups[tuple(t[k] for k in by)].append(t)
    rows = []
    for key in sorted(groups, key=lambda k: [str(x) for x in k]):
        ts_all = groups[key]
        for arm in _arms(ts_all):
            with_arm = [t for t in ts_all if arm in t]
            for scope, ts in (("all", with_arm),
                              ("excluding masked", [t for t in with_arm if masked_of(t, arm) is not True])):
                n = len(ts)
                silent = [t for t in ts if t[arm].get("silent")]
                near = sum(1 for t in silent if t[arm].get("near_tie"))
                beyond = len(silent) - near
                dev = [t[arm].get("logit_dev", 0.0) for t in ts
                       if not any(t[arm]["totals"].values()) and masked_of(t, arm) is not True]
                rows.append({**dict(zip(by, key, strict=True)), "arm": arm, "scope": scope, "n": n,
                             "token_change": sum(bool(t[arm].get("token_change")) for t in ts),
                             "silent": len(silent), "silent_near_tie": near, "silent_beyond_noise": beyond,
                             "rate": len(silent) / n if n else 0.0, "upper": wilson_upper(len(silent), n),
                             "rate_beyond_noise": beyond / n if n else 0.0,
                             "upper_beyond_noise": wilson_upper(beyond, n),
                             "events": sum(1 for t in ts if any(t[arm]["totals"].values())),
                             "masked": sum(1 for t in ts if masked_of(t, arm) is True),
                             "undecided": sum(1 for t in ts if masked_of(t, arm) is None),
                             "max_silent_logit_dev": max(dev, default=0.0)})
    return rows


def _sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def silent_markdown(trials: Sequence[dict], by: Sequence[str] = ()) -> str:
    """Markdown table of `silent_summary`, plus (ungrouped) the check of the masked flag: with protection
    off, a trial whose flips all landed on never-used values must leave every logit bit for bit unchanged."""
    rows = silent_summary(trials, by)
    head = [*by, "protection", "trials", "scope", "token changes", "silent token changes", "of which near-tie",
            "rate (beyond noise) [Wilson 95 % upper]", "trials with events", "masked / undecided",
            "largest event-free logit change"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            *(str(r[k]) for k in by), ARM_LABELS[r["arm"]], str(r["n"]), r["scope"], str(r["token_change"]),
            str(r["silent"]), str(r["silent_near_tie"]),
            f"{_sci(r['rate_beyond_noise'])} [{_sci(r['upper_beyond_noise'])}]", str(r["events"]),
            f"{r['masked']} / {r['undecided']}", f"{r['max_silent_logit_dev']:.3g}"]) + " |")
    off = [t for t in trials if "unprotected" in t and masked_of(t, "unprotected") is True]
    if off and not by:
        moved = sum(1 for t in off if t["unprotected"].get("logit_dev", 0.0) != 0.0
                    or t["unprotected"].get("token_change"))
        lines += ["", f"Masked-flag check (protection off): {moved} of {len(off)} trials whose flips all landed "
                      "on never-used values changed a logit."]
    return "\n".join(lines)


def per_bit_markdown(trials: Sequence[dict]) -> str:
    """Compact table, one row per site × bit: outcome counts with protection off and on (the arms run)."""
    bit_trials = [t for t in trials if t.get("bit") is not None]
    rows = summarize(bit_trials, ("site", "bit"))
    classes = {(t["site"], t["bit"]): t["bit_class"] for t in bit_trials}
    by: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[(r["site"], r["bit"])][r["arm"]] = r
    arms = _arms(bit_trials)
    cols = {"unprotected": [("SDC", "sdc"), ("crash", "crash")],
            "protected": [("SDC", "sdc"), ("crash", "crash"), ("uncorr.", "detected_uncorrectable"),
                          ("det.&corr.", "detected_corrected"), ("masked", "masked")]}
    head = ["site", "bit", "class", "n", *(f"{ARM_LABELS[a]}: {label}" for a in arms for label, _ in cols[a])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (site, bit), per_arm in by.items():
        n = next(iter(per_arm.values()))["n"]
        lines.append("| " + " | ".join(str(x) for x in (
            site, bit, classes[(site, bit)], n, *(per_arm[a][c] for a in arms for _, c in cols[a]))) + " |")
    return "\n".join(lines)


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("campaign plots need matplotlib: `pip install matplotlib` "
                          "(or `pip install 'ft-transformers[plot]'`)") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_sdc_per_bit(trials: Sequence[dict], path: str | os.PathLike, title: str | None = None) -> None:
    """Bar chart per site: SDC rate per flipped bit, protection off vs on.

    Solid bars are SDC, hatched bars stacked on them crash / non-finite (the other silent-ish
    failure); the x labels carry the number of trials per bit (95 % CIs are in the tables).
    """
    plt = _plt()
    bit_trials = [t for t in trials if t.get("bit") is not None]
    sites = [s for s in SITES if any(t["site"] == s for t in bit_trials)]
    if not sites:
        raise ValueError("no bit-mode trials to plot")
    fig, axes = plt.subplots(len(sites), 1, figsize=(11, 2.7 * len(sites)), squeeze=False)
    for ax, site in zip(axes[:, 0], sites, strict=True):
        ts = [t for t in bit_trials if t["site"] == site]
        bits = sorted({t["bit"] for t in ts})
        x = list(range(len(bits)))
        ns = [sum(t["bit"] == b for t in ts) for b in bits]
        for j, (arm, color) in enumerate((a, c) for a, c in (("unprotected", "tab:red"), ("protected", "tab:blue"))
                                         if a in _arms(ts)):
            sdc, crash = [], []
            for b, n in zip(bits, ns, strict=True):
                tb = [t for t in ts if t["bit"] == b]
                sdc.append(sum(t[arm]["class"] == "sdc" for t in tb) / n)
                crash.append(sum(t[arm]["class"] == "crash" for t in tb) / n)
            xs = [xi + (j - 0.5) * 0.4 for xi in x]
            onoff = "off" if arm == "unprotected" else "on"
            ax.bar(xs, sdc, width=0.4, color=color, alpha=0.85, label=f"SDC, protection {onoff}")
            if any(crash):
                ax.bar(xs, crash, width=0.4, bottom=sdc, color="white", edgecolor=color, hatch="////",
                       label=f"crash / non-finite, protection {onoff}")
        ax.set_xticks(x, [f"{b}\nn={n}" for b, n in zip(bits, ns, strict=True)], fontsize=7)
        ax.set_xlim(-0.7, len(bits) - 0.3)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("rate")
        ax.set_title(site, fontsize=10, loc="left")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[-1, 0].set_xlabel("flipped bit (0 = mantissa LSB; fp32: 23-30 exponent, 31 sign)")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_CLASS_COLORS = {"masked": "#9e9e9e", "sdc": "#d62728", "detected_corrected": "#2ca02c",
                 "detected_uncorrectable": "#ff7f0e", "crash": "#6a3d9a"}


def plot_outcomes(trials: Sequence[dict], path: str | os.PathLike, by: Sequence[str] = ("site", "bit_class"),
                  title: str | None = None) -> None:
    """Stacked bars: outcome shares per group, protection off and on side by side."""
    plt = _plt()
    rows = summarize(trials, by)
    labels = []
    fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(rows) + 3.5), 4.2))
    bottoms = [0.0] * len(rows)
    for c in CLASSES:
        vals = [r[c] / r["n"] if r["n"] else 0 for r in rows]
        ax.bar(range(len(rows)), vals, bottom=bottoms, color=_CLASS_COLORS[c], label=CLASS_LABELS[c],
               width=0.8)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for r in rows:
        labels.append("\n".join(str(r[k]) for k in by) + f"\n{'off' if r['arm'] == 'unprotected' else 'on'}")
    ax.set_xticks(range(len(rows)), labels, fontsize=6.5)
    ax.set_ylabel("share of trials")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trial_report(trial: dict, arm: str = "protected") -> FTReport:
    """The library's `FTReport` rebuilt from a stored trial (``.by_step()``, ``.to_json()``, ...)."""
    events = [FaultEvent(*r) for r in trial[arm]["events"]]
    steps = len(trial[arm]["tokens"] or []) if trial[arm].get("tokens") is not None else 0
    return FTReport(events, None, steps=steps)


def events_by_step_layer(trials: Sequence[dict],
                         arm: str = "protected") -> dict[tuple[int, int], dict[str, int]]:
    """``{(step, layer): {kind: count}}`` summed over the given trials (one trial: that trial)."""
    acc: dict[tuple[int, int], dict[str, int]] = defaultdict(lambda: dict.fromkeys(KINDS, 0))
    for t in trials:
        for step, layer, _module, _site, kind, count in t[arm]["events"]:
            acc[(int(step), int(layer))][kind] += int(count)
    return dict(sorted(acc.items()))


def write_events(grouped: dict[tuple[int, int], dict[str, int]], json_path: str | os.PathLike | None = None,
                 csv_path: str | os.PathLike | None = None, meta: dict | None = None) -> None:
    """Export `events_by_step_layer` as JSON (``{"meta", "totals", "rows"}``) and/or CSV."""
    rows = [{"step": s, "layer": l, **counts} for (s, l), counts in grouped.items()]
    if json_path is not None:
        tot = dict.fromkeys(KINDS, 0)
        for r in rows:
            for k in KINDS:
                tot[k] += r[k]
        Path(json_path).write_text(json.dumps({"meta": meta or {}, "totals": tot, "rows": rows}, indent=1))
    if csv_path is not None:
        with open(csv_path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "layer", *KINDS])
            for r in rows:
                w.writerow([r["step"], r["layer"], *(r[k] for k in KINDS)])


def plot_events(grouped: dict[tuple[int, int], dict[str, int]], path: str | os.PathLike,
                kinds: Sequence[str] = ("detected", "corrected", "recomputed"), n_layers: int | None = None,
                n_steps: int | None = None, title: str | None = None) -> None:
    """Heatmaps of event counts over generation steps (x) × layers (y), one panel per kind.
    Layer -1 (modules outside the blocks, e.g. lm_head) is drawn as the top row."""
    import numpy as np

    plt = _plt()
    steps = [s for s, _ in grouped] or [0]
    layers = [l for _, l in grouped] or [0]
    ns = max(n_steps or 0, max(steps) + 1)
    lo = min(-1, min(layers))
    nl = max(n_layers or 0, max(layers) + 1)
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 0.16 * (nl - lo) + 2.0), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        grid = np.zeros((nl - lo, ns))
        for (s, l), c in grouped.items():
            grid[l - lo, s] += c[kind]
        masked = np.ma.masked_equal(grid, 0)
        im = ax.imshow(masked, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest",
                       extent=(-0.5, ns - 0.5, lo - 0.5, nl - 0.5), vmin=0, vmax=max(1.0, float(grid.max())))
        ax.set_facecolor("#f4f4f4")
        ax.set_xlabel("generation step (0 = prefill)")
        ax.set_ylabel("layer (-1 = outside the blocks)")
        ax.set_title(f"{kind}: {int(grid.sum())}", fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(path: str | os.PathLike, out_dir: str | os.PathLike, prefix: str = "campaign",
                 trial: str | None = None, img_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Summary (markdown + JSON), per-bit table, plots and per-step × layer events of a campaign file.

    Tables and event exports go to ``out_dir``, PNGs to ``img_dir`` (default ``out_dir``); with
    ``trial`` the events (JSON, CSV, heatmap) are those of that trial only. A campaign with protection
    off only has no events to export.
    """
    header, cleans, trials = load_campaign(path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    img = Path(img_dir) if img_dir is not None else out
    img.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if not trials:
        raise ValueError(f"{path} holds no trials yet")
    cfg = (header or {}).get("config", {})
    md = [f"# Campaign {prefix}", "",
          f"model `{cfg.get('model')}`, {len(trials)} trials, seed {cfg.get('seed')}, "
          f"max_new_tokens {cfg.get('max_new_tokens')}, sites {', '.join(cfg.get('sites', []))}", "",
          "## Silent token changes", "", silent_markdown(trials), "",
          "### Per site", "", silent_markdown(trials, ("site",)), "",
          "## Per site × bit class", "", summary_markdown(trials, cleans, ("site", "bit_class")), ""]
    if any(t.get("bit") is not None for t in trials):
        md += ["## Per site × bit", "", per_bit_markdown(trials), ""]
    files["summary_md"] = out / f"{prefix}_summary.md"
    files["summary_md"].write_text("\n".join(md))
    files["summary_json"] = out / f"{prefix}_summary.json"
    files["summary_json"].write_text(json.dumps({
        "header": header, "by_site_bit_class": summarize(trials, ("site", "bit_class")),
        "by_site_bit": summarize([t for t in trials if t.get("bit") is not None], ("site", "bit")),
        "silent": silent_summary(trials), "silent_by_site": silent_summary(trials, ("site",)),
        "false_positives": false_positives(cleans, trials)}, indent=1))
    if any(t.get("bit") is not None for t in trials):
        files["sdc_per_bit"] = img / f"{prefix}_sdc_per_bit.png"
        plot_sdc_per_bit(trials, files["sdc_per_bit"],
                         title=f"SDC rate per flipped bit ({len(trials)} trials)")
    files["outcomes"] = img / f"{prefix}_outcomes.png"
    plot_outcomes(trials, files["outcomes"], title="outcome of each trial, protection off / on")
    sel = trials if trial is None else [t for t in trials if t["trial_id"] == trial]
    if not sel:
        raise ValueError(f"no trial {trial!r} in {path}")
    if "protected" not in _arms(sel):  # events exist only with protection on
        return files
    grouped = events_by_step_layer(sel)
    tag = "events" if trial is None else f"events_{trial}"
    files["events_json"] = out / f"{prefix}_{tag}.json"
    files["events_csv"] = out / f"{prefix}_{tag}.csv"
    write_events(grouped, files["events_json"], files["events_csv"],
                 meta={"campaign": str(path), "trials": len(sel), "arm": "protected", "trial": trial})
    n_layers = 1 + max((t["layer"] for t in trials), default=0)
    files["events_png"] = img / f"{prefix}_{tag}.png"
    plot_events(grouped, files["events_png"], n_layers=n_layers, n_steps=cfg.get("max_new_tokens"),
                title=("protected-arm events over steps × layers, "
                       + (f"trial {trial}" if trial else f"all {len(sel)} trials")))
    return files
