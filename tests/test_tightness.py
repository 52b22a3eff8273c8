"""`scripts/tightness.py`: its flip measurements find a planted undetected change when the thresholds are
huge and none beyond the target when they are not, its E/T probes agree with the checks' verdicts, and
its outputs have the documented columns (tiny shapes and a tiny random model, on the CPU)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ft_transformers.kernels.contract import ATTENTION_SITES

import ft_transformers as ftt
from ft_transformers.efta_reference import output as ref_output
from ft_transformers.efta_reference import scores as ref_scores

_spec = importlib.util.spec_from_file_location(
    "tightness", Path(__file__).resolve().parents[1] / "scripts" / "tightness.py")
tightness = importlib.util.module_from_spec(_spec)
sys.modules["tightness"] = tightness  # dataclasses look their module up there
_spec.loader.exec_module(tightness)

HIGH_EXPONENT = 30  # fp32: flips 2^±128 into the value


@pytest.fixture(autouse=True)
def _one_thread():
    """Single-threaded, as the script runs by default: many tiny GEMMs run fastest so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _layer(n: int = 192, k: int = 96, m: int = 8, chunks: int = 2, bias: bool = True) -> tightness.LinearLayer:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(n, k, generator=g) / math.sqrt(k)
    b = torch.randn(n, generator=g) if bias else None
    xs = [torch.randn(m, k, generator=g) + 0.5 for _ in range(chunks)]
    return tightness.LinearLayer("blocks.0.mlp.up_proj", "up", w, b, xs)


def _call(m: int = 24, n: int = 24, d: int = 32) -> tightness.AttentionCall:
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, s, d, generator=g) for h, s in ((4, m), (2, n), (2, n)))
    return tightness.AttentionCall("blocks.0.attn", q, k, v, dict(scale=d ** -0.5, causal=True, bias=None,
                                                                  attn_mask=None, window=None))


def test_linear_call_is_the_public_checked_linear():
    lay = _layer()
    x = lay.inputs[0]
    for bit in (3, 22, 27, HIGH_EXPONENT, 31):
        spec = ftt.FaultSpec(site="linear.output", bit=bit, count=1, seed=bit)
        y, det = tightness._linear_call(lay, x, spec, emax=None, csigma=2.5, backend="reference")
        y_pub, st = ftt.checked_linear(x, lay.weight, lay.bias, inject=spec, correct=False, backend="reference")
        torch.testing.assert_close(y, y_pub, rtol=0, atol=0, equal_nan=True)  # bit 30 of ~1.0 gives NaN
        assert det == st["detected"]


def test_layer_classes_from_module_names():
    names = ("model.layers.0.self_attn.q_proj", "model.layers.3.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
             "lm_head", "h.0.attn.c_attn")
    assert [tightness.linear_class(n) for n in names] == ["q", "o", "gate", "lm_head", "c_attn"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ulp_is_the_spacing_of_the_dtype(dtype):
    ity = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    x = (torch.rand(200, generator=torch.Generator().manual_seed(3)) * 100).to(dtype)
    x = torch.cat([x, torch.tensor([1.0, 2.0, 0.5], dtype=dtype)])
    nxt = (x.view(ity) + 1).view(dtype)  # the next representable value above x (x > 0)
    for v, n in zip(x.tolist(), nxt.tolist()):
        assert tightness._ulp(v, dtype) == n - v
        assert tightness._ulp(-v, dtype) == n - v
    assert tightness._ulp(0.0, dtype) == torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


def test_linear_flips_find_a_planted_undetected_change_only_when_thresholds_are_huge():
    lay = _layer()
    flips = 4 * 32  # every bit four times
    exponent = range(23, HIGH_EXPONENT)  # flips that leave y finite (bit 30 of |y| < 2 gives inf/NaN)
    loose = tightness.linear_flips([lay], flips, emax=1e6, backend="reference")
    assert sorted(loose) == list(range(32)) and all(s.flips == 4 for s in loose.values())
    assert sum(loose[b].undetected for b in exponent) >= 20  # most pass a threshold of 1e6·e_max
    assert loose[HIGH_EXPONENT].detected == 4  # a non-finite checksum difference is always flagged
    assert max(loose[b].max_rel for b in exponent) > 0.5  # y scaled by 2^±16 … 2^±64: a planted change
    assert sum(loose[b].over_target for b in exponent) >= 8
    tight = tightness.linear_flips([lay], flips, backend="reference")
    assert all(tight[b].detected == 4 for b in range(20, 32))
    assert sum(s.detected for s in tight.values()) > 0.5 * flips
    assert sum(s.undetected for s in tight.values()) > 0  # low mantissa bits stay below the threshold
    assert max(s.max_rel for s in tight.values()) < tightness.REL_TARGET
    assert sum(s.over_target for s in tight.values()) == 0
    # an absolute target: the same flips measured against 0.05 (the lm_head target)
    lm = tightness.linear_flips([lay], flips, emax=1e6, backend="reference", target=("abs", 0.05))
    assert sum(lm[b].over_target for b in exponent) >= 8
    assert max(lm[b].max_change for b in exponent) > 0.05


def test_linear_clean_ratio_is_below_one_and_fails_with_a_tiny_emax():
    lay = _layer(n=200)  # a ragged last column group
    x = torch.cat(lay.inputs)
    ratio, source = tightness.linear_clean_ratio(x, lay.weight, lay.bias, emax=None, backend="reference")
    assert 0.0 < ratio < 1.0 and source == "group_residuals"
    tiny, _ = tightness.linear_clean_ratio(x, lay.weight, lay.bias, emax=1e-12, backend="reference")
    assert tiny > 1.0
    # the ratio scales inversely with e_max
    half, _ = tightness.linear_clean_ratio(x, lay.weight, lay.bias, emax=2e-6, backend="reference")
    base, _ = tightness.linear_clean_ratio(x, lay.weight, lay.bias, emax=1e-6, backend="reference")
    assert half == pytest.approx(base / 2, rel=1e-5)


def test_attention_ratios_agree_with_the_checks():
    call = _call()
    clean = tightness.attention_clean_ratios(call)
    assert set(clean) == {"attn.scores", "attn.output"}
    assert all(0.0 < r < 1.0 for r in clean.values())
    verdicts = []
    for site in ("attn.scores", "attn.output"):
        for bit in (6, 8, 10, 12, 14, 20, 26):  # around the thresholds and far beyond them
            for seed in range(2):
                spec = ftt.FaultSpec(site=site, bit=bit, count=1, seed=seed)
                ratio = tightness.attention_clean_ratios(call, inject=spec)[site]
                _, st = ftt.efta_attention(call.q, call.k, call.v, **call.kwargs, backend="reference", correct=False,
                                           inject=spec)
                flagged = st.by_site().get(site, {}).get("detected", 0) > 0
                assert (ratio > 1.0) == flagged, (site, bit, seed, ratio)
                verdicts.append(flagged)
    assert any(verdicts) and not all(verdicts)
    # the probes are removed again
    assert ref_scores.check_scores.__name__ == "check_scores"
    assert ref_output.verify_output.__name__ == "verify_output"


def test_attention_flips_unchecked_show_the_change_checked_keep_it_small():
    call = _call()
    assert tightness.site_bits(call, "attn.output", "reference") == 32
    flips = 2 * 32
    off = tightness.attention_flips([call], "attn.output", flips, backend="reference", detect=False)
    assert all(s.detected == 0 for s in off.values())
    assert off[HIGH_EXPONENT].max_change > 1e3 and off[HIGH_EXPONENT].over_target == 2
    on = tightness.attention_flips([call], "attn.output", flips, backend="reference")
    assert on[HIGH_EXPONENT].detected == 2
    assert max(s.max_rel for s in on.values()) < tightness.REL_TARGET


def test_main_writes_the_tables(tmp_path):
    out = tmp_path / "run"
    res = tightness.main(["--dims", "tiny", "--layers", "1", "--prompts", "1", "--tokens", "20", "--flips", "48",
                          "--backend", "reference", "--out", str(out), "--no-plot"])
    with open(out / "flips.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == tightness.FLIP_COLUMNS
    classes = {r["layer_class"] for r in rows}
    assert classes == {"q", "k", "v", "o", "gate", "up", "down", "lm_head", *ATTENTION_SITES}
    for cls in classes:
        assert sum(int(r["flips"]) for r in rows if r["layer_class"] == cls) == 48
    assert {int(r["bit"]) for r in rows if r["layer_class"] == "q"} == set(range(32))
    with open(out / "clean.csv", newline="") as fh:
        clean = list(csv.DictReader(fh))
    assert tuple(clean[0]) == tightness.CLEAN_COLUMNS
    assert len([r for r in clean if r["kind"] == "linear"]) == 8  # 7 per block + lm_head
    assert {r["check"] for r in clean if r["kind"] == "attention"} == {"attn.scores", "attn.output"}
    assert all(0.0 < float(r["max_ratio"]) < 1.0 for r in clean)
    md = (out / "summary.md").read_text()
    assert "| lm_head |" in md and "| attn.output |" in md
    assert res["run"]["skipped_sites"] == []
    assert tightness.read_csv(str(out / "flips.csv")) == res["flips"]  # what --redraw reads back
    assert tightness.read_csv(str(out / "clean.csv")) == [{c: r[c] for c in tightness.CLEAN_COLUMNS}
                                                          for r in res["clean"]]
    assert tightness.redraw(str(out), plot_too=False) == md


def test_capture_records_every_linear_input_and_attention_call():
    model = tightness.dims_model("tiny", 2, torch.float32, "cpu")
    prompts = tightness.random_prompts(model.config.vocab_size, 2, 10)
    layers, calls = tightness.capture(model, prompts, max_rows=4)
    assert len(layers) == 2 * 7 + 1
    assert all(len(lay.inputs) == 2 * 3 for lay in layers)  # 10 rows in chunks of 4, 4, 2 per prompt
    assert [c.name for c in calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"] * 2
    assert calls[0].q.shape == (1, 4, 10, 32) and calls[0].k.shape == (1, 2, 10, 32)
    assert calls[0].kwargs["causal"] is True
    # the captured lm_head input reproduces the model's logits
    with torch.no_grad():
        logits = model(input_ids=prompts[1]).logits[0]
    lm = next(lay for lay in layers if lay.layer_class == "lm_head")
    torch.testing.assert_close(torch.cat(lm.inputs[3:]) @ lm.weight.t(), logits)


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = tightness.flip_rows(dict(model="m", dtype="float32", device="cpu", backend="reference"), "linear", "q",
                               {5: tightness.BitStats(flips=3, undetected=3, undetected_changed=3, max_change=1e-4,
                                                      rms_at_max=1.0, max_rel=1e-4)}, ("rel", 0.01))
    path = tmp_path / "p.png"
    tightness.plot(rows, str(path), "t")
    assert path.read_bytes()[:4] == b"\x89PNG"


_TRITON_SNIPPET = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import tightness as t
g = torch.Generator().manual_seed(1)
w = torch.randn(130, 64, generator=g) / 8  # two full column groups and a ragged one
b = torch.randn(130, generator=g)
lay = t.LinearLayer("l", "up", w, b, [torch.randn(4, 64, generator=g) + 0.5])
ratio, source = t.linear_clean_ratio(lay.inputs[0], w, b, emax=None, backend="triton")
tiny, _ = t.linear_clean_ratio(lay.inputs[0], w, b, emax=1e-12, backend="triton")
tight = t.linear_flips([lay], 32, backend="triton")
loose = t.linear_flips([lay], 32, emax=1e6, backend="triton")
print(json.dumps(dict(ratio=ratio, source=source, tiny=tiny,
                      tight={b: [s.detected, s.max_rel, s.over_target] for b, s in tight.items()},
                      loose={b: [s.detected, s.max_rel, s.over_target] for b, s in loose.items()})))
"""


def test_triton_backend_under_the_interpreter():
    """The Triton path the GPU runs take (``gemm_residuals`` for E/T, the kernel's checked GEMM for flips), on
    the CPU under ``TRITON_INTERPRET=1`` in a fresh process (triton picks the interpreter at import)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _TRITON_SNIPPET, str(Path(tightness.__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["source"] == "gemm_residuals" and 0.0 < res["ratio"] < 1.0 < res["tiny"]
    tight = {int(b): v for b, v in res["tight"].items()}
    loose = {int(b): v for b, v in res["loose"].items()}
    assert sorted(tight) == list(range(32))
    assert all(tight[b][0] == 1 for b in range(16, 32))  # every large flip detected
    assert max(v[1] for v in tight.values()) < tightness.REL_TARGET and sum(v[2] for v in tight.values()) == 0
    assert sum(v[2] for v in loose.values()) >= 5  # the planted misses with thresholds 1e6 times too wide
