"""scripts/multigpu_check.py on the CPU: both passes run, faults land, and the comparison is real
(a changed event is reported as a mismatch). The placement itself is checked on two GPUs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import multigpu_check as MG  # noqa: E402


def test_cpu_passes_agree_and_count_events(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = MG.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--prompt", "16", "--new-tokens", "3",
                  "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and all(res["checks"].values())
    # one attention flip per attention call and one Linear flip per Linear call, every one detected
    assert res["flips"][0] == res["flips"][1] > 0
    assert res["totals"][0]["detected"] == res["flips"][0] and res["totals"][0]["uncorrectable"] == 0
    dev = res["events_by_device"]
    assert dev["cpu"]["layers"] == [0, 1]
    assert sum(d["events"].get("detected", 0) for d in dev.values()) == res["flips"][0]
    assert capsys.readouterr().out.rstrip().endswith("OK")


def test_per_device_sums_by_placement():
    events = [[0, 0, "m.layers.0.self_attn", "attn.scores", "detected", 2],
              [1, 1, "m.layers.1.mlp.up_proj", "linear.output", "detected", 3],
              [1, -1, "lm_head", "linear.output", "corrected", 1]]
    got = MG.events_per_device(events, {"cuda:0": [0], "cuda:1": [1]})
    assert got == {"cuda:0": {"layers": [0], "events": {"detected": 2}},
                   "cuda:1": {"layers": [1], "events": {"detected": 3}},
                   "outside the blocks": {"layers": [], "events": {"corrected": 1}}}


def test_a_moved_event_is_a_mismatch(monkeypatch, capsys):
    real = MG.generate
    calls = []

    def second_pass_moves_an_event(*a, **k):
        res = real(*a, **k)
        calls.append(1)
        if len(calls) == 2:  # the spread pass: one event attributed to another block
            res["events"][0][1] = 1 - res["events"][0][1]
        return res

    monkeypatch.setattr(MG, "generate", second_pass_moves_an_event)
    rc = MG.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--prompt", "16", "--new-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 1 and "events identical: MISMATCH" in out and "tokens identical: OK" in out
