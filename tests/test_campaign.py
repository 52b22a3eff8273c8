"""Fault-injection campaigns: classification, trial planning, JSONL resume after a kill, reproducibility,
reports. Everything runs on the random tiny Llama (no download), a few seconds in all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ft_transformers.campaign as C
from ft_transformers.campaign.runner import _comparable

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what the CLI uses; keeps numerics identical to a CLI run
    model, tok = C.load_model("tiny-llama")
    yield model, tok
    torch.set_num_threads(threads)


def _config(**kw) -> C.CampaignConfig:
    base = dict(model="tiny-llama",
                prompts=[{"prompt": "hello world"}, {"prompt": "a b c d e f", "answer": "7"}],
                sites=["attn.scores", "linear.output"], bits=[30, 22], trials=12, max_new_tokens=5, seed=3)
    base.update(kw)
    return C.CampaignConfig(**base)


def _strip(rec: dict) -> dict:
    """A trial record without wall-clock fields and provenance (the source hash changes whenever the
    library's files do)."""
    out = {k: v for k, v in rec.items() if k not in ("seconds", "versions")}
    for arm in C.ARMS:
        if arm in out:
            out[arm] = {k: v for k, v in out[arm].items() if k != "seconds"}
    return out


def _quiet(msg: str) -> None:
    pass


def _run(cfg, path, tiny, **kw):
    model, tok = tiny
    return C.run_campaign(cfg, path, model=model, tokenizer=tok, progress=False, log=_quiet, **kw)


def _trial_lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()
            if line.strip() and json.loads(line)["type"] == "trial"]


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """An uninterrupted run of the campaign every resume test is compared with."""
    path = tmp_path_factory.mktemp("ref") / "ref.jsonl"
    return [_strip(r) for r in _run(_config(), path, tiny)], path


# -- classification ---------------------------------------------------------------------------------

CLEAN = [5, 6, 7, 8]


@pytest.mark.parametrize("kw, expected", [
    (dict(tokens=[5, 6, 7, 8]), "masked"),
    (dict(tokens=[5, 6, 9, 8]), "sdc"),
    (dict(tokens=[5, 6, 7]), "sdc"),                                  # early EOS is an SDC too
    (dict(tokens=None, error="RuntimeError: boom"), "crash"),
    (dict(tokens=[5, 6, 7, 8], finite=False), "crash"),               # NaN logits, even if argmax agrees
    (dict(tokens=[5, 6, 7, 8], totals={"detected": 1, "corrected": 1}), "detected_corrected"),
    (dict(tokens=[5, 6, 7, 8], totals={"detected": 2, "recomputed": 2}), "detected_corrected"),
    (dict(tokens=[5, 6, 9, 8], totals={"detected": 1, "corrected": 1}), "sdc"),   # miscorrection is silent
    (dict(tokens=[5, 6, 7, 8], totals={"detected": 1, "uncorrectable": 1}), "detected_uncorrectable"),
    (dict(tokens=[5, 6, 9, 8], totals={"detected": 1, "uncorrectable": 1}), "detected_uncorrectable"),
    (dict(tokens=[1, 2], finite=False, totals={"detected": 1, "uncorrectable": 1}), "crash"),
    (dict(tokens=[5, 6, 7, 8], totals={"detected": 0, "nonfinite_input": 0}), "masked"),
])
def test_classify_hand_made_cases(kw, expected):
    assert C.classify(clean_tokens=CLEAN, **kw) == expected


def test_token_agreement_and_answers():
    assert C.token_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert C.token_agreement([1, 9, 3, 4], [1, 2, 3, 4]) == 0.75
    assert C.token_agreement([1, 2], [1, 2, 3, 4]) == 0.5
    assert C.token_agreement(None, [1]) == 0.0
    assert C.answer_correct("The capital is Paris.", ["paris"]) is True
    assert C.answer_correct("Lyon", ["Paris"]) is False
    assert C.answer_correct("x", None) is None


def test_bit_fields_and_selectors():
    assert C.bit_fields(torch.float32) == {"sign": (31,), "exponent": tuple(range(23, 31)),
                                           "mantissa": tuple(range(23))}
    assert C.bit_fields(torch.bfloat16)["exponent"] == tuple(range(7, 15))
    assert C.bit_fields(torch.float16)["exponent"] == tuple(range(10, 15))
    assert C.bit_class(30, torch.float32) == "exponent" and C.bit_class(22, torch.float32) == "mantissa"
    assert C.bit_class(15, torch.float16) == "sign"
    assert C.parse_bits(["exponent", "28-30", "3", 1]) == ["exponent", 28, 29, 30, 3, 1]
    with pytest.raises(ValueError):
        C.CampaignConfig(bits=[31], sites=["linear.output"], dtype="bfloat16")
    with pytest.raises(ValueError):
        C.CampaignConfig(bits=[3], ber=[1e-6])
    with pytest.raises(ValueError):
        C.CampaignConfig(sites=["attn.nowhere"])


# -- trial planning -----------------------------------------------------------------------------------

TARGETS = {0: {"attention": "m.layers.0.attn", "linear": ["m.layers.0.q", "m.layers.0.mlp"]},
           1: {"attention": "m.layers.1.attn", "linear": ["m.layers.1.q", "m.layers.1.mlp"]},
           -1: {"attention": None, "linear": ["lm_head"]}}


def test_plan_is_deterministic_stratified_and_prefix_stable():
    four = [{"prompt": f"p{i}"} for i in range(4)]
    cfg = C.CampaignConfig(prompts=four, sites=["attn.probs", "linear.output"],
                           bits=["exponent", "mantissa", 7], trials=60, seed=11)
    a = [C.plan_trial(cfg, i, [4, 6, 3, 5], TARGETS) for i in range(60)]
    b = [C.plan_trial(cfg, i, [4, 6, 3, 5], TARGETS) for i in range(60)]
    assert a == b
    assert len({t.trial_id for t in a}) == 60
    combos = cfg.combos()
    for t in a:
        site, sel = combos[t.index % len(combos)]
        assert t.site == site
        if sel == 7:
            assert t.bit == 7
        else:
            assert t.bit_class == sel and t.bit in C.bit_fields(torch.float32)[sel]
        assert 0 <= t.step < [4, 6, 3, 5][t.prompt_index]
        assert t.layer in (0, 1)  # default: the blocks only, never lm_head
        assert t.module == (TARGETS[t.layer]["attention"] if site.startswith("attn.") else t.module)
        assert t.fault_spec().calls == (t.step,)
    other_cfg = C.CampaignConfig(prompts=four, sites=cfg.sites, bits=cfg.bits, seed=12)
    other = [C.plan_trial(other_cfg, i, [4, 6, 3, 5], TARGETS)
             for i in range(60)]
    assert [t.seed for t in other] != [t.seed for t in a]
    # a longer campaign begins with the same trials (extending --trials keeps what was done)
    longer = C.CampaignConfig(prompts=four, sites=cfg.sites, bits=cfg.bits, trials=500, seed=11)
    assert C.plan_trial(longer, 5, [4, 6, 3, 5], TARGETS) == a[5]
    assert cfg.fingerprint() == longer.fingerprint()


def test_plan_layers_steps_and_ber():
    one = [{"prompt": "x"}]
    cfg = C.CampaignConfig(prompts=one, sites=["linear.output"], bits=None, ber=[1e-3], layers=[-1],
                           steps=[-1], seed=1)
    t = C.plan_trial(cfg, 0, [4], TARGETS)
    assert t.module == "lm_head" and t.step is None and t.bit is None and t.ber == 1e-3
    assert t.fault_spec().calls is None and t.bit_class == "ber=0.001"
    cfg = C.CampaignConfig(prompts=one, sites=["attn.scores"], bits=[30], steps=[0, 2, 9], seed=1)
    assert {C.plan_trial(cfg, i, [4], TARGETS).step for i in range(40)} == {0, 2}  # step 9 is never reached
    with pytest.raises(ValueError):
        no_attn = C.CampaignConfig(prompts=one, sites=["attn.scores"], bits=[30], layers=[-1])
        C.plan_trial(no_attn, 0, [4], TARGETS)


# -- running a campaign --------------------------------------------------------------------------------


def test_campaign_records_are_complete_and_consistent(reference):
    recs, path = reference
    assert [r["index"] for r in recs] == list(range(12))
    classes = {r[arm]["class"] for r in recs for arm in C.ARMS}
    assert classes <= set(C.CLASSES)
    header, cleans, trials = C.load_campaign(path)
    assert header["fingerprint"] == _config().fingerprint()
    assert header["versions"]["torch"] == torch.__version__
    assert len(cleans) == 2 and all(c["false_positives"] == 0 and c["arms_agree"] for c in cleans)
    for r, stored in zip(recs, trials, strict=True):
        # everything needed to reproduce the trial
        for k in ("seed", "site", "bit", "layer", "module", "step", "prompt_index", "versions", "model",
                  "campaign_seed", "max_new_tokens"):
            assert k in stored
        up, pr = r["unprotected"], r["protected"]
        assert up["injected"] == pr["injected"] == 1
        assert up["flips"][0]["positions"] == pr["flips"][0]["positions"]  # the same fault in both arms
        assert up["flips"][0]["call"] == r["step"] and up["flips"][0]["module"] == r["module"]
        assert up["events"] == [] and up["class"] in ("masked", "sdc", "crash")
        # protected events land exactly where the fault was injected (step = generation step)
        for step, _layer, module, site, _kind, _n in pr["events"]:
            assert (step, module, site) == (r["step"], r["module"], r["site"])
        assert pr["detected_elsewhere"] == 0
        if r["bit"] == 30:  # an exponent MSB flip is always caught and repaired
            assert pr["class"] == "detected_corrected"
    # the fault model actually bites on this model: some unprotected exponent flips corrupt the output
    assert any(r["unprotected"]["class"] in ("sdc", "crash") for r in recs)


def test_same_seed_same_trials_other_seed_other_trials(tiny, reference, tmp_path):
    ref, _ = reference
    again = [_strip(r) for r in _run(_config(), tmp_path / "again.jsonl", tiny)]
    assert again == ref
    other = _run(_config(seed=4), tmp_path / "other.jsonl", tiny)
    assert [r["seed"] for r in other] != [r["seed"] for r in ref]


class _Kill(KeyboardInterrupt):
    pass


def test_resume_after_interrupt_neither_repeats_nor_loses(tiny, reference, tmp_path):
    ref, _ = reference
    path = tmp_path / "c.jsonl"
    seen = []

    def kill_after_5(rec):
        seen.append(rec["trial_id"])
        if len(seen) == 5:
            raise _Kill

    with pytest.raises(_Kill):
        _run(_config(), path, tiny, on_trial=kill_after_5)
    assert len(_trial_lines(path)) == 5
    ran = []
    recs = _run(_config(), path, tiny, on_trial=lambda r: ran.append(r["trial_id"]))
    assert ran == [r["trial_id"] for r in ref[5:]]  # only the missing ones ran
    lines = _trial_lines(path)
    assert sorted(r["trial_id"] for r in lines) == [r["trial_id"] for r in ref]  # no repeat, none lost
    assert [_strip(r) for r in recs] == ref
    assert sum(json.loads(x)["type"] == "clean" for x in path.read_text().splitlines()) == 2


def test_resume_after_partial_last_line(tiny, reference, tmp_path):
    ref, ref_path = reference
    lines = ref_path.read_text().splitlines(keepends=True)
    first_trial = next(i for i, x in enumerate(lines) if json.loads(x)["type"] == "trial")
    keep = first_trial + 7
    path = tmp_path / "c.jsonl"
    path.write_text("".join(lines[:keep]) + lines[keep][: len(lines[keep]) // 2])  # killed mid-write
    ran = []
    recs = _run(_config(), path, tiny, on_trial=lambda r: ran.append(r["index"]))
    assert ran == list(range(7, 12))
    assert [_strip(r) for r in recs] == ref
    assert all(line.endswith("}") for line in path.read_text().splitlines())  # no fragment left
    assert sorted(r["index"] for r in _trial_lines(path)) == list(range(12))


def test_extend_and_refuse_another_campaign(tiny, reference, tmp_path):
    ref, _ = reference
    path = tmp_path / "c.jsonl"
    _run(_config(trials=4), path, tiny)
    recs = _run(_config(), path, tiny)  # --trials raised: continues with trials 4..11
    assert [_strip(r) for r in recs] == ref
    with pytest.raises(ValueError, match="another campaign"):
        _run(_config(bits=[29]), path, tiny)
    with pytest.raises(ValueError, match="corrupt"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(path.read_text().replace('"type":"trial"', '"type":"trial"}{', 1))
        C.CampaignStore(bad).load()


def test_ber_and_every_step(tiny, tmp_path):
    cfg = _config(sites=["linear.output"], bits=None, ber=[2e-2], steps=[-1], trials=3)
    recs = _run(cfg, tmp_path / "ber.jsonl", tiny)
    for r in recs:
        assert r["step"] is None and r["bit"] is None
        assert r["unprotected"]["injected"] == r["protected"]["injected"] > 0
        assert len(r["protected"]["flips"]) == cfg.max_new_tokens  # every generation step hit
        assert r["unprotected"]["flips"][0]["positions"] is None


def test_report_tables_plots_and_events(reference, tmp_path):
    recs, path = reference
    _, cleans, trials = C.load_campaign(path)
    rows = C.summarize(trials)
    assert {(r["site"], r["bit_class"], r["arm"]) for r in rows} == {
        (s, b, a) for s in ("attn.scores", "linear.output") for b in ("exponent", "mantissa") for a in C.ARMS}
    for r in rows:
        assert r["n"] == sum(r[c] for c in C.CLASSES) == 3
        assert 0.0 <= r["sdc_ci"][0] <= r["sdc_rate"] <= r["sdc_ci"][1] <= 1.0
    md = C.summary_markdown(trials, cleans)
    assert md.count("\n| attn.scores") == 4 and "False positives: 0 detection(s) in 2 clean" in md
    files = C.write_report(path, tmp_path / "rep", "t")
    for k in ("summary_md", "summary_json", "sdc_per_bit", "outcomes", "events_json", "events_csv",
              "events_png"):
        assert files[k].exists() and files[k].stat().st_size > 0, k
    grouped = C.events_by_step_layer(trials)
    ev = json.loads(files["events_json"].read_text())
    assert ev["totals"]["detected"] == sum(t["protected"]["totals"]["detected"] for t in trials)
    assert len(files["events_csv"].read_text().splitlines()) == 1 + len(grouped)
    one = next(t for t in trials if t["protected"]["events"])
    rep = C.trial_report(one)
    assert rep.by_step() == C.events_by_step_layer([one])
    files1 = C.write_report(path, tmp_path / "rep", "t", trial=one["trial_id"])
    assert files1["events_png"].name == f"t_events_{one['trial_id']}.png"


def test_replay_reproduces_a_stored_trial(tiny, reference):
    recs, path = reference
    tid = next(r["trial_id"] for r in recs if r["unprotected"]["class"] != "masked")
    model, tok = tiny
    stored, fresh = C.replay_trial(path, tid, model=model, tokenizer=tok)
    assert _comparable(stored) == _comparable(fresh)
    assert C.trial_from_record(stored).fault_spec() == C.trial_from_record(fresh).fault_spec()


def test_cli_killed_with_sigkill_resumes(tmp_path):
    """A real kill: SIGKILL the CLI mid-campaign, then `resume` continues without repeat or loss."""
    out = tmp_path / "k.jsonl"
    args = ["--model", "tiny-llama", "--trials", "40", "--max-new-tokens", "5", "--bits", "30", "22",
            "--prompts", "hello world", "--seed", "9", "--no-progress"]
    cmd = [sys.executable, str(ROOT / "scripts" / "campaign.py"), "run", "--out", str(out), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if out.exists() and len(_trial_lines_safe(out)) >= 4:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "campaign finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    n_before = len(_trial_lines_safe(out))
    assert 4 <= n_before < 40
    assert C.main(["resume", str(out), "--no-progress"]) == 0
    lines = _trial_lines(out)
    assert sorted(r["index"] for r in lines) == list(range(40))  # no repeat, none lost
    ref = tmp_path / "ref.jsonl"
    assert C.main(["run", "--out", str(ref), *args]) == 0
    resumed = [_strip(r) for r in sorted(lines, key=lambda r: r["index"])]
    assert resumed == [_strip(r) for r in _trial_lines(ref)]


def _trial_lines_safe(path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines(keepends=True):
        if line.endswith("\n") and '"type":"trial"' in line:
            out.append(json.loads(line))
    return out


# -- token-level outcome: silent token changes, near-ties, Wilson bound ---------------------------------


def test_wilson_upper_hand_checked():
    # k = 0: the upper end is z²/(n + z²) = 3.8416 / 10003.8416
    assert C.wilson_upper(0, 10000) == pytest.approx(3.8401e-4, rel=1e-4)
    # k = 5, n = 100 by hand: centre (0.05 + 0.019208) / 1.038416 = 0.066648,
    # half width 1.96·sqrt(0.000475 + 0.00009604) / 1.038416 = 0.045104
    assert C.wilson_upper(5, 100) == pytest.approx(0.111752, abs=2e-6)
    assert C.wilson_upper(0, 0) == 1.0


@pytest.mark.parametrize("tokens, totals, silent", [
    ([5, 6, 9, 8], {}, True),                                            # changed, no event at all
    ([5, 6, 9, 8], dict.fromkeys(("detected", "corrected"), 0), True),  # zero counts are no event
    ([5, 6, 9, 8], {"detected": 1, "corrected": 1}, False),              # a miscorrection: SDC, not silent
    ([5, 6, 9, 8], {"nonfinite_input": 1}, False),                       # any kind of event counts
    ([5, 6, 7], {}, True),                                               # an early EOS changes the tokens
    ([5, 6, 7, 8], {}, False),                                           # unchanged
    (None, {}, False),                                                   # a raised generation is loud
])
def test_silent_token_change_cases(tokens, totals, silent):
    assert C.silent_token_change(tokens, CLEAN, totals) is silent


def test_token_outcome_near_tie():
    first = C.first_difference([5, 6, 9, 8], CLEAN)
    assert first == 2 and C.first_difference([5, 6], CLEAN) == 2 and C.first_difference(CLEAN, CLEAN) is None
    tie = C.token_outcome([5, 6, 9, 8], CLEAN, {}, first_diff=first, margins=[3.0, 2.0, 1e-6, 4.0],
                          noise=[1e-5] * 4)
    assert tie["silent"] and tie["near_tie"] and tie["first_diff"] == 2 and tie["margin"] == 1e-6
    clear = C.token_outcome([5, 6, 9, 8], CLEAN, {}, first_diff=first, margins=[3.0, 2.0, 0.5, 4.0],
                            noise=[1e-5] * 4)
    assert clear["silent"] and clear["near_tie"] is False
    same = C.token_outcome(CLEAN, CLEAN, {}, first_diff=None, margins=[1.0] * 4, noise=[0.0] * 4)
    assert not same["token_change"] and same["near_tie"] is None


# -- where a flip landed ------------------------------------------------------------------------------


def test_landing_rules():
    kw = dict(module="m.attn", unused_rows=(), mask_form="causal", window=None, exponent_bit=True)
    # prefill, M = N = 5: query 1 sees keys 0..1
    assert C.landing("attn.scores", (0, 0, 1, 3), (1, 4, 5, 5), **kw) == "masked_key"
    assert C.landing("attn.scores", (0, 0, 1, 1), (1, 4, 5, 5), **kw) == "used"
    assert C.landing("attn.probs", (0, 0, 1, 3), (1, 4, 5, 5), **kw) == "masked_key_used"
    assert C.landing("attn.exponent", (0, 0, 1, 3), (1, 4, 5, 5), **kw) == "masked_key_used"
    assert C.landing("attn.probs_lp", (0, 0, 1, 3), (1, 4, 5, 5), **kw) == "masked_key_used"
    assert C.landing("attn.acc", (0, 0, 1, 3), (1, 4, 5, 128), **kw) == "used"  # key blocks x D: no key index
    # decode, M = 1, N = 6: the one query sees every key
    assert C.landing("attn.scores", (0, 2, 0, 5), (1, 4, 1, 6), **kw) == "used"
    # an additive mask keeps +inf / NaN: an exponent flip there is undecided, a mantissa flip is not
    tensor = dict(kw, mask_form="tensor")
    assert C.landing("attn.scores", (0, 0, 1, 3), (1, 4, 5, 5), **tensor) == "undecided"
    assert C.landing("attn.scores", (0, 0, 1, 3), (1, 4, 5, 5), **dict(tensor, exponent_bit=False)) == "masked_key"
    assert C.landing("attn.scores", (0, 0, 1, 3), (1, 4, 5, 5), **dict(kw, mask_form="unknown")) == "undecided"
    # a sliding window of 2 hides key 0 from query 3 (N = M = 5)
    assert C.landing("attn.scores", (0, 0, 3, 0), (1, 4, 5, 5), **dict(kw, window=2)) == "undecided"
    # rows other than the last of a module found unread
    rows = dict(kw, unused_rows=("m.attn", "m.mlp"))
    assert C.landing("attn.output", (0, 1, 3, 7), (1, 4, 5, 16), **rows) == "unused_row"
    assert C.landing("attn.output", (0, 1, 4, 7), (1, 4, 5, 16), **rows) == "used"
    assert C.landing("attn.rowsum", (0, 1, 4, 0), (1, 4, 5, 1), **kw) == "used"
    assert C.landing("linear.output", (2, 9), (5, 64), **dict(rows, module="m.mlp")) == "unused_row"
    assert C.landing("linear.output", (4, 9), (5, 64), **dict(rows, module="m.mlp")) == "used"
    assert C.landing("linear.output", (2, 9), (5, 64), **dict(rows, module="m.k")) == "used"
    assert C.landing("no.such.site", (0, 0), (1, 1), **kw) == "undecided"
    assert C.masked_position(["masked_key", "unused_row"]) is True
    assert C.masked_position(["masked_key", "used"]) is False
    assert C.masked_position(["masked_key", "undecided"]) is None
    assert C.masked_position(["masked_key_used"]) is False
    assert C.masked_position([]) is None


def _masked_flip_logits(tiny, site: str) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Prefill logits of the clean run and of a run with one bit-30 flip at ``site`` of block 0's
    attention that lands on a causally masked key (the seed is searched for such a position)."""
    from ft_transformers import enable_fault_tolerance
    from ft_transformers.protect import inject_faults

    model, tok = tiny
    enable_fault_tolerance(model, C.ARM_CONFIGS["unprotected"])
    ids = C.encode_prompt(tok, "hello world", False)
    with torch.inference_mode():
        clean = model(ids).logits
    attn = C.model_targets(model)[0]["attention"]
    for seed in range(200):
        spec = C.Trial(0, "x", 0, site, 30, "exponent", None, 1, 0, attn, 0, seed).fault_spec()
        with inject_faults(model, spec) as log, torch.inference_mode():
            out = model(ids).logits
        sf = log.records[0][2].sites[site]
        _, _, i, j = sf.positions[0].tolist()
        if j > i:  # M = N: key j is hidden from query i
            return clean, out, [sf.positions[0].tolist(), list(sf.shape)]
    raise AssertionError("no seed put the flip on a masked key")


def test_masked_score_flip_is_never_used_but_a_masked_probability_is(tiny):
    clean, out, (pos, shape) = _masked_flip_logits(tiny, "attn.scores")
    assert C.landing("attn.scores", pos, shape, module="", unused_rows=(), mask_form="causal", window=None,
                     exponent_bit=True) == "masked_key"
    assert torch.equal(clean, out)  # overwritten by the mask: not one logit bit moved
    # x = −inf flipped to −1 feeds exp; P = 0 (fp32 or as GEMM II reads it) flipped to 2 enters P·V
    for site in ("attn.exponent", "attn.probs", "attn.probs_lp"):
        clean, out, (pos, shape) = _masked_flip_logits(tiny, site)
        assert C.landing(site, pos, shape, module="", unused_rows=(), mask_form="causal", window=None,
                         exponent_bit=True) == "masked_key_used"
        assert not torch.equal(clean, out), site  # used


def test_masked_flag_holds_in_a_campaign(tiny, tmp_path):
    """Prefill flips in the last block: every trial flagged as masked left every logit unchanged with
    protection off, and the unused-row probe found the last block's per-token modules but not k/v."""
    cfg = _config(sampling="uniform", sites=["attn.scores", "attn.output", "linear.output"], bits=["any"],
                  layers=[1], steps=[0], trials=40, max_new_tokens=3)
    recs = _run(cfg, tmp_path / "m.jsonl", tiny)
    setup = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines() if '"setup"' in x][-1]
    assert "model.layers.1.self_attn" in setup["unused_rows"] and "model.layers.1.mlp.down_proj" in setup["unused_rows"]
    assert not any(n.endswith(("k_proj", "v_proj")) for n in setup["unused_rows"])
    assert setup["mask_form"] == "causal"
    masked = [r for r in recs if r["unprotected"]["masked_position"] is True]
    assert masked and any(r["unprotected"]["masked_position"] is False for r in recs)
    for r in recs:  # the same flips land the same way in both arms at these sites
        assert r["unprotected"]["landings"] == r["protected"]["landings"]
    for r in masked:
        assert set(r["unprotected"]["landings"]) <= C.NEVER_USED
        assert r["unprotected"]["logit_dev"] == 0.0 and not r["unprotected"]["token_change"]
    for r in recs:
        for arm in C.ARMS:
            a = r[arm]
            assert a["silent"] == (a["token_change"] and not any(a["totals"].values()))
        assert r["unprotected"]["silent"] == r["unprotected"]["token_change"]  # no events without protection
    md = C.silent_markdown(recs)
    assert f"0 of {len(masked)} trials whose flips all landed on never-used values changed a logit" in md
    rows = C.silent_summary(recs)
    off_all = next(r for r in rows if r["arm"] == "unprotected" and r["scope"] == "all")
    off_ex = next(r for r in rows if r["arm"] == "unprotected" and r["scope"] == "excluding masked")
    assert off_all["n"] == 40 and off_ex["n"] == 40 - len(masked) and off_all["masked"] == len(masked)
    assert off_all["silent"] == sum(r["unprotected"]["silent"] for r in recs)
    assert off_all["upper"] == pytest.approx(C.wilson_upper(off_all["silent"], 40))


# -- uniform sampling ---------------------------------------------------------------------------------


def test_uniform_sampling_covers_every_site_module_and_bit():
    from ft_transformers.kernels import contract

    cfg = C.CampaignConfig(prompts=[{"prompt": "p"}], sampling="uniform", bits=["any"], dtype="bfloat16", seed=5)
    assert cfg.sites == list(contract.SITES)  # every site of the contract, read when the config is made
    assert "sampling" in cfg.fault_dict() and "sampling" not in _config().fault_dict()  # old files keep theirs
    pool = C.uniform_targets(cfg, TARGETS)
    attn_sites = [s for s in contract.SITES if s.startswith("attn.")]
    assert len(pool) == 2 * len(attn_sites) + 5  # attention sites x 2 blocks, 5 Linears with lm_head
    n = 4000
    trials = [C.plan_trial(cfg, i, [4], TARGETS) for i in range(n)]
    seen = {(t.site, t.module) for t in trials}
    assert seen == {(s, m) for s, _l, m in pool}
    assert ("linear.output", "lm_head") in seen
    for t in trials:
        assert t.bit in range(torch.finfo(C.site_dtype(t.site, torch.bfloat16)).bits)
    lin_bits = {t.bit for t in trials if t.site == "linear.output"}
    assert lin_bits == set(range(16))  # bf16 storage: 16 bits
    fp32_sites = [s for s in attn_sites if C.site_dtype(s, torch.bfloat16) == torch.float32]
    assert {t.bit for t in trials if t.site in fp32_sites} == set(range(32))
    # equally likely (site, module) pairs: every count within 5 standard deviations of n / len(pool)
    counts = {k: 0 for k in seen}
    for t in trials:
        counts[(t.site, t.module)] += 1
    mean = n / len(pool)
    assert all(abs(c - mean) < 5 * mean ** 0.5 for c in counts.values())
    # restricted to the sites a model's computation reaches
    only = [C.plan_trial(cfg, i, [4], TARGETS, sites=["attn.scores", "linear.output"]) for i in range(200)]
    assert {t.site for t in only} == {"attn.scores", "linear.output"}


# -- running: the greedy loop, the shortcut, arms -------------------------------------------------------


def test_greedy_loop_matches_generate(tiny):
    from ft_transformers import enable_fault_tolerance

    model, tok = tiny
    enable_fault_tolerance(model, C.ARM_CONFIGS["protected"])
    ids = C.encode_prompt(tok, "a b c d e f", False)
    run = C.Greedy(model, 6).clean(ids)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert run.tokens == ref[0, ids.shape[1]:].tolist()
    assert run.logits.shape == (6, 512) and run.cache[0][0].shape[2] == ids.shape[1] + 5


def test_shortcut_gives_the_same_records(tiny, tmp_path):
    cfg = _config(sampling="uniform", bits=["any"], sites=None, trials=16)
    fast = _run(cfg, tmp_path / "fast.jsonl", tiny)
    slow = _run(cfg, tmp_path / "slow.jsonl", tiny, shortcut=False)

    def same(rec):
        out = _strip(rec)
        for arm in C.ARMS:
            out[arm] = {k: v for k, v in out[arm].items() if k != "steps_run"}
        return out

    assert [same(r) for r in fast] == [same(r) for r in slow]
    assert sum(r["protected"]["steps_run"] for r in fast) < sum(r["protected"]["steps_run"] for r in slow)


def test_one_arm_runs_the_same_trials(tiny, reference, tmp_path):
    ref, _ = reference
    only_on = _run(_config(arms=["protected"]), tmp_path / "on.jsonl", tiny)
    assert all("unprotected" not in r for r in only_on)
    for a, b in zip(only_on, ref, strict=True):
        assert {k: a[k] for k in ("site", "bit", "module", "step", "seed")} == \
               {k: b[k] for k in ("site", "bit", "module", "step", "seed")}
        assert _strip(a)["protected"] == b["protected"]
    assert "| on | 12 | all |" in C.silent_markdown(only_on)
    files = C.write_report(tmp_path / "on.jsonl", tmp_path / "rep_on", "on")
    assert files["events_json"].exists() and "| on | 12 | all |" in files["summary_md"].read_text()
    only_off = _run(_config(arms=["unprotected"], trials=3), tmp_path / "off.jsonl", tiny)
    assert [_strip(r)["unprotected"] for r in only_off] == [r["unprotected"] for r in ref[:3]]
    files = C.write_report(tmp_path / "off.jsonl", tmp_path / "rep_off", "off")  # no events to export
    assert "events_json" not in files and "| off | 3 | all |" in files["summary_md"].read_text()
    with pytest.raises(ValueError, match="arms"):
        _config(arms=["both"])


@pytest.mark.slow  # two spawned processes import torch and transformers: ~20-50 s on 2 busy cores
def test_workers_write_the_same_records(tmp_path):
    cfg = _config(sampling="uniform", bits=["any"], sites=None, trials=6, max_new_tokens=3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = C.run_campaign(cfg, tmp_path / "one.jsonl", progress=False, log=_quiet)
        two = C.run_campaign(cfg, tmp_path / "two.jsonl", progress=False, log=_quiet, workers=2)
    finally:
        torch.set_num_threads(threads)
    assert [_strip(r) for r in two] == [_strip(r) for r in one]
    assert sorted(r["index"] for r in _trial_lines(tmp_path / "two.jsonl")) == list(range(6))
    with pytest.raises(ValueError, match="model=None"):
        C.run_campaign(cfg, tmp_path / "x.jsonl", model=object(), workers=2)


def test_workers_spread_over_the_visible_gpus():
    from ft_transformers.campaign.runner import _worker_gpu

    assert [_worker_gpu("cuda", w, 4) for w in range(6)] == [0, 1, 2, 3, 0, 1]
    assert [_worker_gpu("cuda", w, 1) for w in range(3)] == [None] * 3  # one GPU: its default device
    assert _worker_gpu("cuda:1", 2, 4) is None  # a named device keeps every worker there
    assert _worker_gpu("cpu", 1, 0) is None


def test_a_faulty_run_keeps_the_clean_prefix_events(tiny):
    """Steps before the faulted one are not re-run; events the clean run recorded there still belong
    to the trial (a trial with any event is not silent)."""
    from ft_transformers import enable_fault_tolerance

    model, tok = tiny
    enable_fault_tolerance(model, C.ARM_CONFIGS["protected"])
    greedy = C.Greedy(model, 4)
    clean = greedy.clean(C.encode_prompt(tok, "hello world", False))
    assert clean.events == []
    prefix_event = [0, 0, "model.layers.0.self_attn", "attn.scores", "detected", 1]
    clean = C.CleanRun(clean.ids, clean.tokens, clean.logits, clean.cache, [prefix_event], clean.finite, 0.0)
    attn = C.model_targets(model)[1]["attention"]
    spec = C.Trial(0, "x", 0, "attn.output", 0, "mantissa", None, 1, 1, attn, 2, 7).fault_spec()
    run = greedy.run_from(clean, 2, spec)
    assert run.events[0] == prefix_event and run.steps_run >= 1
    assert all(r[0] >= 2 for r in run.events[1:])
    assert run.records and run.records[0][1] == 2  # the module's call index is the generation step


def test_checksum_site_exists_only_with_protection(tiny, tmp_path):
    """The checks' own operands are probed and sampled with protection on; with protection off a flip
    there finds nothing (not injected: never used), per arm."""
    cfg = _config(sampling="uniform", sites=["attn.checksum", "linear.output"], bits=["any"], trials=8,
                  max_new_tokens=3)
    recs = _run(cfg, tmp_path / "cs.jsonl", tiny)
    setup = [json.loads(x) for x in (tmp_path / "cs.jsonl").read_text().splitlines() if '"setup"' in x][-1]
    assert setup["sites_used"] == ["attn.checksum", "linear.output"]
    cs = [r for r in recs if r["site"] == "attn.checksum"]
    assert cs
    for r in cs:
        assert r["protected"]["injected"] == 1 and r["protected"]["masked_position"] is not True
        assert r["unprotected"]["injected"] == 0 and r["unprotected"]["landings"] == ["not_injected"]
        assert r["unprotected"]["masked_position"] is True and not r["unprotected"]["token_change"]


def test_cli_refuses_a_file_of_another_campaign_without_a_traceback(tmp_path, capsys):
    """`ftt-campaign run` into a file that holds another campaign exits 2 with one error line (a usage error,
    like argparse's), and leaves the file as it was."""
    out = tmp_path / "c.jsonl"
    common = ["--out", str(out), "--model", "tiny-llama", "--sites", "linear.output", "--max-new-tokens", "2",
              "--prompts", "hello", "--no-progress"]
    assert C.main(["run", *common, "--trials", "2", "--seed", "1"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert C.main(["run", *common, "--trials", "2", "--seed", "2"]) == 2
    err = capsys.readouterr().err
    assert "ftt-campaign: error:" in err and "holds another campaign" in err and "Traceback" not in err
    assert out.read_bytes() == before
