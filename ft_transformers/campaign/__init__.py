"""Fault-injection campaigns: what a soft error does to a model, and what ft_transformers saves.

A *campaign* runs N trials. A trial is one fault — (prompt, site, bit or BER, layer/module,
generation step, seed) — injected into a greedy generation twice: once with protection off
(``FTConfig(detect=False, correct=False)``) and once with full protection (``FTConfig()``).
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

Modules, in import order: `config` (the campaign's configuration and outcome vocabulary),
`models` (tiny random models, loading, prompt encoding), `store` (the JSONL file and provenance),
`trials` (planning and running trials, the campaign loop), `report` (tables, plots, event
exports), `cli` (``ftt-campaign`` / ``scripts/campaign.py``). See docs/reliability.md.
"""

from __future__ import annotations

from .cli import main
from .config import (
    ARM_CONFIGS,
    ARMS,
    CLASS_LABELS,
    CLASSES,
    DEFAULT_PROMPTS,
    CampaignConfig,
    bit_class,
    bit_fields,
    parse_bits,
    site_dtype,
)
from .models import TINY_MODELS, ToyTokenizer, encode_prompt, load_model
from .report import (
    events_by_step_layer,
    false_positives,
    per_bit_markdown,
    plot_events,
    plot_outcomes,
    plot_sdc_per_bit,
    summarize,
    summary_markdown,
    trial_report,
    wilson,
    write_events,
    write_report,
)
from .store import FORMAT_VERSION, CampaignStore, load_campaign, source_hash, versions
from .trials import (
    Trial,
    answer_correct,
    classify,
    model_targets,
    plan_trial,
    replay_trial,
    run_campaign,
    run_clean,
    run_trial,
    token_agreement,
    trial_from_record,
    trial_id,
)

__all__ = [
    "ARMS", "ARM_CONFIGS", "CLASSES", "CLASS_LABELS", "DEFAULT_PROMPTS", "FORMAT_VERSION", "TINY_MODELS",
    "CampaignConfig", "CampaignStore", "ToyTokenizer", "Trial", "answer_correct", "bit_class", "bit_fields",
    "classify", "encode_prompt", "events_by_step_layer", "false_positives", "load_campaign", "load_model",
    "main", "model_targets", "parse_bits", "per_bit_markdown", "plan_trial", "plot_events", "plot_outcomes",
    "plot_sdc_per_bit", "replay_trial", "run_campaign", "run_clean", "run_trial", "site_dtype", "source_hash",
    "summarize", "summary_markdown", "token_agreement", "trial_from_record", "trial_id", "trial_report",
    "versions", "wilson", "write_events", "write_report",
]
