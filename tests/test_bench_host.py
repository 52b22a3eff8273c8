"""`scripts/bench_host.py` on the CPU: a smoke run (the protected kernels interpreted; figures meaningless)."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_smoke_run_writes_every_variant(tmp_path):
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and "triton" in sys.modules:
        pytest.skip("triton was imported without the interpreter: the checked GEMM cannot run on CPU here")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import bench_host  # noqa: PLC0415

    rows = bench_host.main(["--device", "cpu", "--dtype", "float32", "--gemm", "4x32x16", "--attention",
                            "1x4x2x1x32", "--rounds", "1", "--calls", "1", "--out", str(tmp_path)])
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("gemm", v) for v in ("cublas", "checked/direct", "checked/triton", "module/direct",
                                         "module/triton")} | {
        ("attention", v) for v in ("sdpa", "efta_off/direct", "efta_off/triton", "efta/direct", "efta/triton")}
    assert all(r["host_us"] > 0 and r["wall_us"] >= r["host_us"] * 0.5 for r in rows)
    assert all(r["host_ratio"] == 1.0 for r in rows if r["variant"] in ("cublas", "sdpa"))
    with open(tmp_path / "bench_host.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (tmp_path / "bench_host.md").read_text().count("| gemm |") == 5
