"""`scripts/bench_host.py` on the CPU: a smoke run (the protected kernels interpreted; figures meaningless).

It runs in a fresh process: the script sets ``TRITON_INTERPRET=1`` for ``--device cpu`` before triton
is imported, which this test process may already have done without it."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_writes_every_variant(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_host.py"), "--device", "cpu", "--dtype", "float32",
         "--gemm", "4x32x16", "--attention", "1x4x2x1x32", "--rounds", "1", "--calls", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "bench_host.csv") as f:
        rows = list(csv.DictReader(f))
    got = {(r["kind"], r["variant"]) for r in rows}
    assert got == {("gemm", v) for v in ("cublas", "checked/direct", "checked/triton", "module/direct",
                                         "module/triton")} | {
        ("attention", v) for v in ("sdpa", "efta_off/direct", "efta_off/triton", "efta/direct", "efta/triton")}
    assert all(float(r["host_us"]) > 0 and float(r["wall_us"]) >= float(r["host_us"]) * 0.5 for r in rows)
    assert all(float(r["host_ratio"]) == 1.0 for r in rows if r["variant"] in ("cublas", "sdpa"))
    assert (tmp_path / "bench_host.md").read_text().count("| gemm |") == 5
