"""Bit flips, fault placement, counters, the recorder and the report (no model needed)."""

from __future__ import annotations

import struct

import pytest
import torch

from ft_transformers.counters import FaultStats, add_count, new_counters
from ft_transformers.events import EventRecorder, FTReport
from ft_transformers.injection import FaultPlan, FaultSpec, SiteFaults, flip_bits
from ft_transformers.pasa import optimal_beta


def _flip_ref32(v: float, bit: int) -> float:
    (i,) = struct.unpack("<I", struct.pack("<f", v))
    return struct.unpack("<f", struct.pack("<I", i ^ (1 << bit)))[0]


def _flip_ref16(v: float, bit: int) -> float:
    (i,) = struct.unpack("<H", struct.pack("<e", v))
    return struct.unpack("<e", struct.pack("<H", i ^ (1 << bit)))[0]


@pytest.mark.parametrize("bit", [0, 5, 22, 23, 27, 30, 31])
def test_flip_bits_fp32_matches_struct(bit):
    vals = [0.0, 1.0, -2.5, 3.1e-5, 7.25e3]
    x = torch.tensor(vals, dtype=torch.float32)
    got = flip_bits(x, torch.ones(len(vals), dtype=torch.bool), bit)
    for g, v in zip(got.tolist(), vals):
        r = _flip_ref32(v, bit)
        assert (g == r) or (g != g and r != r)


@pytest.mark.parametrize("bit", [0, 9, 10, 14, 15])
def test_flip_bits_fp16_matches_struct(bit):
    vals = [0.0, 1.0, -2.5, 0.0031, 700.0]
    x = torch.tensor(vals, dtype=torch.float16)
    got = flip_bits(x, torch.ones(len(vals), dtype=torch.bool), bit)
    for g, v in zip(got.tolist(), x.tolist()):
        r = _flip_ref16(v, bit)
        assert (g == r) or (g != g and r != r)


def test_flip_bits_bf16_sign_and_mask():
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    got = flip_bits(x, torch.tensor([True, False, True]), 15)
    assert got.tolist() == [-1.0, 2.0, -3.0]


def test_site_faults_bit_mode_blocks_cover_positions_exactly_once():
    spec = FaultSpec(site="attn.scores", bit=30, count=5, seed=3)
    shape = (2, 3, 7, 50)
    sf = SiteFaults(spec, shape, seed=123, dtype=torch.float32, device="cpu")
    full = torch.full(shape, 0.5)
    pieces = []
    for start in range(0, 64, 16):  # blocks of 16, the last one padded past 50
        blk = torch.full((2, 3, 7, 16), 0.5)
        pieces.append(sf.apply(blk, dim=-1, start=start))
    out = torch.cat(pieces, dim=-1)[..., :50]
    changed = (out != full).nonzero()
    assert sf.injected == changed.shape[0] == sf.positions.shape[0]
    assert sorted(map(tuple, changed.tolist())) == sorted(map(tuple, sf.positions.tolist()))
    # deterministic from the seed
    sf2 = SiteFaults(spec, shape, seed=123, dtype=torch.float32, device="cpu")
    assert torch.equal(sf.positions, sf2.positions)


def test_site_faults_ber_mode_rate_and_padding():
    spec = FaultSpec(site="attn.probs", ber=0.05, seed=1)
    sf = SiteFaults(spec, (4, 100), seed=9, dtype=torch.float32, device="cpu")
    x = torch.full((4, 128), 0.25)
    y = sf.apply(x, dim=-1, start=0)
    assert (y[:, 100:] == 0.25).all()  # never past the logical extent
    n = int((y != x).sum())
    assert n == sf.injected and 5 <= n <= 45  # 400 elements at 5%


def test_bit_out_of_range_for_storage():
    spec = FaultSpec(site="linear.output", bit=20)
    with pytest.raises(ValueError, match="out of range"):
        SiteFaults(spec, (2, 2), seed=0, dtype=torch.float16, device="cpu")


def test_fault_plan_site_filter():
    plan = FaultPlan([FaultSpec(site="attn.scores", bit=3)])
    with pytest.raises(ValueError, match="no fault site"):
        plan.check_sites(["linear.output"], "checked_linear")
    assert plan.for_site("attn.probs", (2, 2), torch.float32, "cpu") is None
    assert plan.for_site("attn.scores", (2, 2), torch.float32, "cpu") is not None


def test_fault_stats_and_counters():
    c = new_counters("cpu")
    add_count(c, "attn.scores", "detected", torch.tensor([1, 1, 0]))
    add_count(c, "attn.scores", "corrected", 2)
    add_count(c, "linear.output", "detected", torch.tensor(3))
    st = FaultStats(c)
    assert st["detected"] == 5 and st["corrected"] == 2 and st["uncorrectable"] == 0
    assert dict(st)["recomputed"] == 0
    assert st.by_site() == {
        "attn.scores": {"detected": 2, "corrected": 2, "recomputed": 0, "uncorrectable": 0,
                        "nonfinite_input": 0},
        "linear.output": {"detected": 3, "corrected": 0, "recomputed": 0, "uncorrectable": 0,
                          "nonfinite_input": 0},
    }


def test_recorder_steps_and_report(tmp_path):
    rec = EventRecorder(policy="ignore")
    a = rec.add_slot("model.layers.0.self_attn", 0)
    b = rec.add_slot("model.layers.1.mlp.up_proj", 1)
    add_count(rec.counters(a, torch.device("cpu")), "attn.scores", "detected", 1)
    add_count(rec.counters(a, torch.device("cpu")), "attn.scores", "corrected", 1)
    rec.end_step()
    rec.end_step()
    add_count(rec.counters(b, torch.device("cpu")), "linear.output", "detected", 2)
    add_count(rec.counters(b, torch.device("cpu")), "linear.output", "recomputed", 2)
    rec.end_step()
    rep = FTReport(rec.events(), rec, steps=rec.step)
    assert [(e.step, e.layer, e.kind, e.count) for e in rep.events] == [
        (0, 0, "detected", 1), (0, 0, "corrected", 1), (2, 1, "detected", 2), (2, 1, "recomputed", 2)]
    assert rep.summary()[(1, "linear.output")]["recomputed"] == 2
    assert rep.by_step()[(0, 0)]["corrected"] == 1
    assert "attn.scores" in str(rep) and "3 model call(s)" in str(rep)
    rep.reset()
    assert rec.events() == [] and rec.step == 0


def test_pasa_optimal_beta_matches_seed():
    # the PASA paper, Appendix C: fp16, block 128, from 1-2^-4, 1-2^-5, 1-2^-6
    got = [optimal_beta(128, torch.float16, 1 - 2.0**-i) for i in (4, 5, 6)]
    assert got == pytest.approx([0.937500, 0.968994, 0.984497], abs=1e-6)


def test_count_gives_distinct_positions():
    spec = FaultSpec(site="attn.scores", bit=3, count=6)
    sf = SiteFaults(spec, (2, 3), seed=0, dtype=torch.float32, device="cpu")
    assert len({tuple(p) for p in sf.positions.tolist()}) == 6  # all of a 6-element site
