"""`scripts/bench_efta_floor.py`'s kernel (a study of what EFTA's checks cost at the least, timed only on
a GPU): every check level's output against float64 attention, no row flagged on clean inputs, and the
checks live: a key changed after the checksum tables were built (a GEMM I fault) is flagged from level 1
on, a value so changed (a GEMM II fault) at level 3 only. Without CUDA they run under the Triton
interpreter (set before triton is imported; when another module imported triton first, the file
re-runs itself in a fresh process)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from float64_attention import ref_attention
from interpreted import interpreted_tests

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from ft_transformers.kernels.tl_common import runs_interpreted  # noqa: E402

_scripts = Path(__file__).resolve().parents[1] / "scripts"
sys.path.insert(0, str(_scripts))
_spec = importlib.util.spec_from_file_location("bench_efta_floor", _scripts / "bench_efta_floor.py")
floor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floor)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SUBPROCESS = DEV == "cpu" and not runs_interpreted(floor._floor_kernel)
_interpreter_available, test_interpreted_in_subprocess = interpreted_tests(__file__, SUBPROCESS, timeout=600)

BH, S, D = 2, 128, 32  # two query blocks and two key blocks of 64
CFG = (64, 64, 4, 1)


def _run(variant, causal, k_fault=False, v_fault=False):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(BH, S, D, generator=g).half().to(DEV) for _ in range(3))
    tabs = {64: floor.tables(k, v, 64)}  # built from the clean k and v
    if k_fault:
        k = k.clone()
        k[:, 5] += 4.0
    if v_fault:
        v = v.clone()
        v[:, 5] += 4.0
    flags = torch.zeros(BH * S, dtype=torch.int32, device=DEV)
    o = floor.floor_attention(q, k, v, 1.0 / math.sqrt(D), causal, variant, CFG, tabs, flags)
    ref = ref_attention(q[None], k[None], v[None], causal=causal)[0]
    return o, ref, flags


_HOPPER = DEV == "cuda" and torch.cuda.get_device_capability()[0] == 9
# the Gluon floor (`efta_gluon_floor`) has no interpreter: on a Hopper GPU only (CI compiles it, test_kernel_compile)
_NAMES = [pytest.param(n, marks=pytest.mark.skipif(not _HOPPER, reason="the Gluon floor runs on a Hopper GPU only"))
          if v.gluon else n for n, v in floor.LEVELS.items()]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", _NAMES)
def test_floor_levels_compute_attention_and_flag_only_faults(name, causal):
    variant = floor.LEVELS[name]
    level = variant.level
    o, ref, flags = _run(variant, causal)
    assert (o.double().cpu() - ref).abs().max().item() < 2e-3
    assert int(flags.sum()) == 0
    if level == 0:
        return
    _, _, flags = _run(variant, causal, k_fault=True)
    # rows that see key 5 (every row, or rows ≥ 5 when causal) in both heads
    assert int((flags != 0).sum()) >= BH * (S - 5) - 4
    _, _, flags = _run(variant, causal, v_fault=True)
    if level >= 3:
        assert int((flags != 0).sum()) > BH * (S - 5) // 2
    else:
        assert int(flags.sum()) == 0


def test_cli_dry_run_plot_and_bad_configs(tmp_path, monkeypatch):
    """The script end to end on two tiny shapes (`--dry-run`): the asked variant and the ratios' bases
    come back with outputs near float64 attention's, no clean row flagged and the planted key fault
    flagged; `--plot-from` draws the CSV; a malformed `--configs` or an unknown variant is refused."""
    import csv

    monkeypatch.setattr(sys, "argv", ["bench_efta_floor.py", "--dry-run", "--variants", "lean3t",
                                      "--out", str(tmp_path)])
    assert floor.main() == 0
    rows = list(csv.DictReader(open(tmp_path / "bench_efta_floor.csv")))
    assert {r["variant"] for r in rows} == {"ours_off", "floor0", "lean3t"} and len(rows) == 6
    assert all(r["error"] == "" and float(r["max_abs_err"]) < 2e-3 for r in rows), rows
    lean = [r for r in rows if r["variant"] == "lean3t"]
    assert all(int(r["flagged_rows"]) == 0 and int(r["flagged_k_fault"]) > 0 for r in lean)
    pytest.importorskip("matplotlib")
    plot = ["bench_efta_floor.py", "--out", str(tmp_path / "img"), "--plot-from"]
    monkeypatch.setattr(sys, "argv", [*plot, str(tmp_path / "bench_efta_floor.csv")])
    with pytest.raises(SystemExit, match="no timed rows"):  # a dry run times nothing
        floor.main()
    for i, r in enumerate(rows):  # as a timed run writes them (no SDPA flash: ratios to floor0)
        r["x_vs_floor0"] = "1.0" if r["variant"] == "floor0" else str(1.2 + 0.1 * i)
    with open(tmp_path / "timed.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    monkeypatch.setattr(sys, "argv", [*plot, str(tmp_path / "timed.csv")])
    assert floor.main() == 0 and (tmp_path / "img" / "bench_efta_floor.png").stat().st_size > 0
    for bad in (["--configs", "64,64,4"], ["--configs", "a,b,c,d"], ["--variants", "floor9"]):
        monkeypatch.setattr(sys, "argv", ["bench_efta_floor.py", "--dry-run", "--out", str(tmp_path), *bad])
        with pytest.raises(SystemExit):
            floor.main()
