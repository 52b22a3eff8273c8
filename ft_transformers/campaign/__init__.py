"""Fault-injection campaigns: what a soft error does to a model, and what ft_transformers saves.

A *campaign* runs N trials. A trial is one fault — (prompt, site, bit or BER, layer/module,
generation step, seed) — injected into a greedy generation in each of the campaign's arms: protection
off (``FTConfig(detect=False, correct=False)``) and full protection (``FTConfig()``), both by default.
Each arm's generated tokens are compared with the clean (fault-free) generation of the same
configuration, and the trial is classified the way the field does:

- ``masked``: output identical to the clean run, nothing detected;
- ``sdc``: silent data corruption, the output differs and no uncorrectable fault was reported
  (a miscorrection counts here too);
- ``detected_corrected``: detections, all corrected or recomputed, output identical;
- ``detected_uncorrectable``: the protection reported a fault it could not repair (a DUE);
- ``crash``: an exception, or non-finite logits (crash / non-finite).

Results are appended to a JSONL file as each trial finishes (header line, one ``clean`` line
per prompt, one ``trial`` line per trial); a killed campaign resumes where it stopped. Trial
definitions are derived from the campaign seed and the trial index only (plus the clean
generation length of the drawn prompt), so a re-run with the same seed gives the same trials,
and raising ``--trials`` extends a finished campaign.

Besides its class, each arm of a trial records whether it is a *silent token change* (tokens differ
from the clean run and no event at all was recorded), whether that happened at a near-tie of the
clean logits, and each trial where its flips landed (``masked_position``: a masked, never-used value).

Modules, in import order: `config` (the campaign's configuration and outcome vocabulary),
`models` (tiny random models, loading, prompt encoding), `store` (the JSONL file and provenance),
`generation` (the greedy loop, clean runs kept whole, faulty runs from the clean state),
`positions` (where a flip landed), `trials` (planning trials, classifying an arm), `runner` (clean
runs, probes, one trial, the campaign loop, replay), `report` (tables, plots, event exports),
`cli` (``ftt-campaign`` / ``scripts/campaign.py``). See docs/reliability.md.
"""

from __future__ import annotations

from .cli import main
from .config import (
    ARM_CONFIGS,
    ARM_LABELS,
    ARMS,
    CLASS_LABELS,
    CLASSES,
    DEFAULT_PROMPTS,
    SAMPLING,
    CampaignConfig,
    bit_choices,
    bit_class,
    bit_fields,
    parse_bits,
    site_dtype,
)
from .generation import CleanRun, FaultyRun, Greedy, first_difference
from .models import TINY_MODELS, ToyTokenizer, encode_prompt, load_model
from .positions import LANDINGS, NEVER_USED, landing, masked_position, probe_unused_rows
from .report import (
    events_by_step_layer,
    false_positives,
    per_bit_markdown,
    plot_events,
    plot_outcomes,
    plot_sdc_per_bit,
    silent_markdown,
    silent_summary,
    summarize,
    summary_markdown,
    trial_report,
    wilson,
    wilson_upper,
    write_events,
    write_report,
)
from .runner import Session, replay_trial, run_campaign
from .store import FORMAT_VERSION, CampaignStore, load_campaign, source_hash, versions
from .trials import (
    Trial,
    answer_correct,
    classify,
    flip_landings,
    model_targets,
    plan_trial,
    silent_token_change,
    token_agreement,
    token_outcome,
    trial_from_record,
    trial_id,
    uniform_targets,
)

__all__ = [
    "ARMS", "ARM_CONFIGS", "ARM_LABELS", "CLASSES", "CLASS_LABELS", "CampaignConfig", "CampaignStore",
    "CleanRun", "DEFAULT_PROMPTS", "FORMAT_VERSION", "FaultyRun", "Greedy", "LANDINGS", "NEVER_USED",
    "SAMPLING", "Session", "TINY_MODELS", "ToyTokenizer", "Trial", "answer_correct", "bit_choices",
    "bit_class", "bit_fields", "classify", "encode_prompt", "events_by_step_layer", "false_positives",
    "first_difference", "flip_landings", "landing", "load_campaign", "load_model", "main", "masked_position",
    "model_targets", "parse_bits", "per_bit_markdown", "plan_trial", "plot_events", "plot_outcomes",
    "plot_sdc_per_bit", "probe_unused_rows", "replay_trial", "run_campaign", "silent_markdown",
    "silent_summary", "silent_token_change", "site_dtype", "source_hash", "summarize", "summary_markdown",
    "token_agreement", "token_outcome", "trial_from_record", "trial_id", "trial_report", "uniform_targets",
    "versions", "wilson", "wilson_upper", "write_events", "write_report",
]
