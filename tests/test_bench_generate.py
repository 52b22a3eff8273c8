"""`scripts/bench_generate.py` on the CPU: the interleaved timing mode (tiny GPT-2, reference path)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_generate as bg  # noqa: E402


def test_interleaved_run_writes_every_variant(tmp_path):
    out = tmp_path / "bg"
    rc = bg.main(["--device", "cpu", "--quick", "--interleave", "--models", "gpt2", "--prefill", "16",
                  "--decode-batch", "1", "--new-tokens", "3", "--repeats", "3", "--variants", "full",
                  "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader((out / "bench_generate.csv").open()))
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("prefill", "sdpa"), ("prefill", "full"), ("decode", "sdpa"), ("decode", "full")}
    for r in rows:
        assert r["error"] == "" and float(r["ms"]) > 0 and r["events"] == "0", r
        if r["variant"] == "sdpa":
            assert float(r["time_ratio"]) == 1.0
    assert (out / "bench_generate.md").read_text().count("| gpt2 |") == 2


def test_interleaved_compiled_decode_compiles_every_copy(tmp_path, monkeypatch):
    """``--interleave --compile``: each model copy decodes through its own compiled step (a static
    cache and transformers' compile config reach every copy's ``generate``), the variants alternate,
    and every row is measured."""
    seen = []
    calls = bg._workload_calls

    def spy(model, wl, device, timer, vocab, gen_kwargs):
        seen.append((wl.kind, id(model), None if gen_kwargs is None else gen_kwargs.get("cache_implementation")))
        return calls(model, wl, device, timer, vocab, gen_kwargs)

    monkeypatch.setattr(bg, "_workload_calls", spy)
    from transformers import PreTrainedModel  # noqa: PLC0415

    compiled = []
    get_compiled = PreTrainedModel.get_compiled_call

    def compiled_call(self, compile_config):
        compiled.append(id(self))
        return get_compiled(self, compile_config)

    monkeypatch.setattr(PreTrainedModel, "get_compiled_call", compiled_call)
    out = tmp_path / "bg"
    rc = bg.main(["--device", "cpu", "--quick", "--interleave", "--compile", "default", "--compile-backend", "eager",
                  "--models", "gpt2", "--prefill", "16", "--decode-batch", "1", "--new-tokens", "3", "--repeats", "2",
                  "--warmup", "1", "--variants", "full", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = list(csv.DictReader((out / "bench_generate.csv").open()))
    assert {(r["kind"], r["variant"]) for r in rows} == {("prefill", "sdpa"), ("prefill", "full"), ("decode", "sdpa"),
                                                          ("decode", "full")}
    for r in rows:
        assert r["error"] == "" and float(r["ms"]) > 0 and r["events"] == "0", r
    decode = [s for s in seen if s[0] == "decode"]
    assert len({m for _, m, _ in decode}) == 2 and all(c == "static" for *_, c in decode), seen
    assert set(compiled) == {m for _, m, _ in decode}  # both copies decoded through their compiled step
    assert all(c is None for k, _, c in seen if k == "prefill"), seen  # prefill stays eager


def test_run_interleaved_alternates_variants(monkeypatch):
    order = []

    def calls(model, wl, device, timer, vocab, gen_kwargs):
        return (lambda: order.append(("warm", model)), lambda: order.append(("time", model)) or 1.0)

    monkeypatch.setattr(bg, "_workload_calls", calls)
    import torch  # noqa: PLC0415

    class _M:
        def __init__(self, name):
            self.name = name

        def parameters(self):
            return []

        def buffers(self):
            return []

        def __repr__(self):
            return self.name

    models = {v: _M(v) for v in ("sdpa", "attn_only", "full")}
    between = {v: (lambda: None) for v in models}
    res = bg.run_interleaved(models, bg.Workload("prefill", 1, 8), torch.device("cpu"), bg.Timer(torch.device("cpu")),
                             1, 3, 100, between)
    timed = [repr(m) for kind, m in order if kind == "time"]
    assert timed == ["sdpa", "attn_only", "full", "attn_only", "full", "sdpa", "full", "sdpa", "attn_only"]
    assert [kind for kind, _ in order[:3]] == ["warm"] * 3
    assert all(r[0] == 1.0 for r in res.values())


def test_profile_writes_a_table_per_variant_and_workload(tmp_path):
    out = tmp_path / "bg"
    rc = bg.main(["--device", "cpu", "--quick", "--models", "gpt2", "--prefill", "16", "--decode-batch", "1",
                  "--new-tokens", "2", "--repeats", "1", "--warmup", "1", "--variants", "full", "--profile",
                  "--no-progress", "--out", str(out)])
    assert rc == 0
    tables = sorted(p.name for p in out.glob("profile_*.txt"))
    assert len(tables) == 4, tables  # (sdpa, full) × (prefill 16, decode b1)
    text = (out / [t for t in tables if "full" in t and "prefill" in t][0]).read_text()
    assert "Self CPU" in text and "aten::" in text
    with pytest.raises(SystemExit, match="--interleave"):
        bg.resolve(bg.parse_args(["--device", "cpu", "--interleave", "--profile"]))


def test_failed_measurement_keeps_its_message(tmp_path, monkeypatch):
    """A variant whose measurement raises: the CSV says what failed (type and the message's first
    line), the markdown table the type, and the other variants are still measured."""
    real = bg.run_workload
    calls = []

    def flaky(model, wl, *args, **kwargs):
        calls.append(wl.kind)
        if len(calls) == 2:  # the second variant (full; sdpa runs first)
            raise RuntimeError("Detected 3 tensor(s) in the pool\nsecond line")
        return real(model, wl, *args, **kwargs)

    monkeypatch.setattr(bg, "run_workload", flaky)
    out = tmp_path / "bg"
    rc = bg.main(["--device", "cpu", "--quick", "--models", "gpt2", "--prefill", "16", "--decode-batch",
                  "--repeats", "1", "--variants", "full", "--no-progress", "--out", str(out)])
    assert rc == 0
    rows = {r["variant"]: r for r in csv.DictReader((out / "bench_generate.csv").open())}
    assert rows["sdpa"]["error"] == "" and float(rows["sdpa"]["ms"]) > 0
    assert rows["full"]["error"] == "RuntimeError: Detected 3 tensor(s) in the pool"
    table = (out / "bench_generate.md").read_text()
    assert "| RuntimeError |" in table and "second line" not in table


def _write_run(path: Path, model: str, rows: list[tuple[str, float]]) -> Path:
    """A bench_generate.csv of one prefill workload of ``model`` with ``(variant, ms)`` rows."""
    wl = bg.Workload("prefill", 1, 16)
    res = [bg.Result(model, "fp32", wl, v, ms=ms, ms_std=0.1, peak_mib=100.0 + ms) for v, ms in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    bg.write_csv(path, res)
    return path


def test_merge_joins_runs_and_keeps_each_runs_ratios(tmp_path):
    """``--merge``: the rows of every file, each ratio to the baseline of its own run, one table
    row per model; the same workload in two runs is refused (its ratios would mix runs)."""
    a = _write_run(tmp_path / "a" / "bench_generate.csv", "gpt2", [("sdpa", 2.0), ("full", 3.0)])
    b = _write_run(tmp_path / "b" / "bench_generate.csv", "qwen2-0.5b", [("sdpa", 4.0), ("full", 5.0)])
    out = tmp_path / "m"
    assert bg.main(["--merge", str(a), str(b), "--out", str(out)]) == 0
    rows = {(r["model"], r["variant"]): r for r in csv.DictReader((out / "bench_generate.csv").open())}
    assert set(rows) == {("gpt2", "sdpa"), ("gpt2", "full"), ("qwen2-0.5b", "sdpa"), ("qwen2-0.5b", "full")}
    assert float(rows[("gpt2", "full")]["time_ratio"]) == pytest.approx(1.5)
    assert float(rows[("qwen2-0.5b", "full")]["time_ratio"]) == pytest.approx(1.25)
    assert float(rows[("qwen2-0.5b", "full")]["mem_ratio"]) == pytest.approx(105.0 / 104.0, abs=1e-4)
    table = (out / "bench_generate.md").read_text()
    assert "| gpt2 | fp32 | prefill 16 | 2.000 ms | 3.000 ms | 1.50× |" in table
    assert "| qwen2-0.5b | fp32 | prefill 16 | 4.000 ms | 5.000 ms | 1.25× |" in table
    again = _write_run(tmp_path / "c" / "bench_generate.csv", "gpt2", [("sdpa", 1.0), ("full", 1.0)])
    with pytest.raises(SystemExit, match="gpt2 fp32 prefill 16 is in both"):
        bg.main(["--merge", str(a), str(again), "--out", str(tmp_path / "m2")])
    with pytest.raises(SystemExit, match="other than the inputs"):
        bg.main(["--merge", str(a), str(b), "--out", str(a.parent)])
    with pytest.raises(SystemExit, match="no file"):
        bg.main(["--merge", str(tmp_path / "none.csv"), "--out", str(tmp_path / "m3")])


def test_smollm2_gguf_that_is_not_a_gguf_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        bg.load_model("smollm2", bg.torch.float32, bg.torch.device("cpu"), tiny=True, max_positions=64,
                      smollm2_gguf=str(tmp_path / "missing.gguf"))


def test_compiled_decode_rows_say_so_and_old_files_read_as_eager(tmp_path):
    """A decode workload timed through compiled steps is labelled so in the CSV, table and merge;
    a CSV written before the ``compile`` column existed reads as eager."""
    wl = bg.Workload("decode", 1, 512, 128, "reduce-overhead")
    assert wl.label == "decode b1 (512+128, compiled reduce-overhead)"
    res = [bg.Result("gpt2", "fp16", wl, v, ms=ms, ms_std=0.0, peak_mib=10.0) for v, ms in
           (("sdpa", 2.0), ("full", 2.2))]
    new = tmp_path / "new" / "bench_generate.csv"
    new.parent.mkdir()
    bg.write_csv(new, res)
    back = bg.read_csv(new)
    assert [r.workload for r in back] == [wl, wl]
    old = tmp_path / "old" / "bench_generate.csv"
    old.parent.mkdir()
    rows = list(csv.DictReader(new.open()))
    with old.open("w", newline="") as f:  # the same rows without the column, eager decode
        w = csv.DictWriter(f, [k for k in bg.CSV_FIELDS if k != "compile"], extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    assert [r.workload.label for r in bg.read_csv(old)] == ["decode b1 (512+128)"] * 2
    out = tmp_path / "m"
    bg.merge([new, old], out)  # the same model and batch, eager and compiled: two rows, not a clash
    table = (out / "bench_generate.md").read_text()
    assert "| gpt2 | fp16 | decode b1 (512+128, compiled reduce-overhead) | 2.000 ms/tok | 2.200 ms/tok | 1.10× |" \
        in table
    assert "| gpt2 | fp16 | decode b1 (512+128) | 2.000 ms/tok |" in table


def test_qwen2_7b_is_chosen_by_name_with_its_published_dims():
    """``--models qwen2-7b`` (issue 39's end-to-end model) parses, is left out of the default set, and its config
    has Qwen2-7B's published dims with its own lm_head."""
    args = bg.parse_args(["--models", "qwen2-7b"])
    assert args.models == ["qwen2-7b"] and "qwen2-7b" not in bg.DEFAULT_MODELS
    cfg = bg.model_config("qwen2-7b", tiny=False, max_positions=4096)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (3584, 18944, 28)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (28, 4, 152064)
    assert not cfg.tie_word_embeddings


def test_step_clock_times_the_steps_after_a_skip():
    """``per_token_ms(skip)`` divides the time from the mark after the first ``skip`` decode steps to the last
    by the steps in between; too few marks for the skip raise instead of dividing by zero."""
    clock = bg.StepClock(torch.device("cpu"), 1)
    clock.marks = [0.0, 1.0, 1.5, 1.6, 1.7, 1.8]  # prefill ends at 0 s; two slow steps, then 0.1 s each
    assert clock.per_token_ms() == pytest.approx(1800 / 5)
    assert clock.per_token_ms(skip=2) == pytest.approx(300 / 3)
    with pytest.raises(RuntimeError, match="at least 7"):
        clock.per_token_ms(skip=5)


def test_full_loop_variant_switches_the_checksum_programs_off_around_each_call():
    """``full_loop`` is ``full`` with ``Options.gemm_fused`` False while its calls run (the checked GEMM reads
    that switch per call, so setting it only while protection is enabled would not reach them); ``full``
    leaves the default."""
    from ft_transformers.kernels.options import options

    seen = []

    class Model:
        def __call__(self, **kwargs):
            seen.append(options().gemm_fused)

    model = Model()
    wl = bg.Workload("prefill", 1, 4)
    timer = bg.Timer(torch.device("cpu"))
    for opts in ({"gemm_fused": False}, {}):
        model._bench_options = opts
        run, _ = bg._workload_calls(model, wl, torch.device("cpu"), timer, 50, None)
        run()
    assert seen == [False, None] and options().gemm_fused is None
    assert bg.variant_config("full_loop") == bg.variant_config("full") and "full_loop" in bg.ALL_VARIANTS
