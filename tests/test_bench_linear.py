"""`scripts/_timing.py` (the benchmarks' interleaved rounds) and `scripts/bench_linear.py`'s shapes, on
the CPU (the benchmark itself needs CUDA)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
_spec = importlib.util.spec_from_file_location(
    "bench_linear", Path(__file__).resolve().parents[1] / "scripts" / "bench_linear.py")
bench_linear = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_linear)
import _timing  # noqa: E402  (scripts/ is on sys.path once bench_linear is loaded)


def test_rounds_rotate_the_order_and_keep_each_rounds_times():
    calls = []
    clock = iter(range(1, 100))

    def timer(fn):
        calls.append(fn())
        return float(next(clock))

    fns = {name: (lambda name=name: name) for name in ("a", "b", "c")}
    times = _timing.interleaved(fns, 4, timer)
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert times == {"a": [1.0, 6.0, 8.0, 10.0], "b": [2.0, 4.0, 9.0, 11.0], "c": [3.0, 5.0, 7.0, 12.0]}


def test_ratio_summary_pairs_times_of_the_same_round():
    # a drift that doubles every time of round 1: per-round ratios stay 2.0; medians of times would not pair up
    times = {"cublas": [1.0, 2.0, 1.0], "fused": [0.5, 1.0, 0.25]}
    med, lo, hi = _timing.ratio_summary(times, "cublas", "fused")
    assert (med, lo, hi) == (2.0, 2.0, 4.0)
    with pytest.raises(ValueError):
        _timing.ratio_summary({"cublas": [1.0], "fused": [1.0, 2.0]}, "cublas", "fused")


def test_shape_kinds():
    quick = bench_linear.shapes(True)
    assert {kind for kind, *_ in quick} == set(bench_linear.KINDS) - {"target"}  # the grid only when asked for
    assert ("square", 8192, 8192, 8192) in bench_linear.shapes(False, ("square",))


def test_target_grid_is_every_linear_of_the_four_models():
    """The 'target' kind: each model's q, k/v, o, gate/up, down at M ∈ {1, 16, 128, 512, 4096} and its lm_head
    at M ≤ 16, from the published configs; one model with --models."""
    grid = bench_linear.target_shapes()
    assert len(grid) == len(set(grid)) == 4 * (4 * 5 + 2)  # q and o share a shape (query heads × head dim = hidden)
    assert (4096, 18944, 3584) in grid and (512, 3584, 18944) in grid  # Qwen2-7B gate/up, down
    assert (1, 1024, 4096) in grid and (4096, 14336, 4096) in grid  # Llama-3-8B k/v, gate/up
    assert (16, 151936, 896) in grid and (128, 151936, 896) not in grid  # lm_head: decode rows only
    qwen05 = bench_linear.shapes(False, ("target",), ("qwen2-0.5b",))
    assert {(n, k) for _, _, n, k in qwen05} == {(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)}
    assert len(bench_linear.shapes(True, ("target",))) == len(range(0, len(grid), 4))


def test_multi_call_graphs_cycle_over_weight_copies_past_l2():
    """``--graph-calls``: enough weight copies to pass ~120 MB (at most 8), and call i of a graph goes
    through copy i mod n, each copy's function built once."""
    assert bench_linear.weight_copies(896 * 896 * 2) == 8  # small: capped
    assert bench_linear.weight_copies(4864 * 896 * 2) == 8  # 8.7 MB: 14 would pass 120 MB
    assert bench_linear.weight_copies(151936 * 896 * 2) == 1  # the lm_head alone is past L2
    assert bench_linear.weight_copies(8192 * 8192 * 2) == 1
    assert bench_linear.weight_copies(40_000_000) == 3
    built, calls = [], []

    def make(j):
        built.append(j)
        return lambda: calls.append(j)

    run = bench_linear._cycled(make, 3, 7)
    run()
    run()
    assert built == [0, 1, 2] and calls == [0, 1, 2, 0, 1, 2, 0] * 2
    with pytest.raises(SystemExit) as bad:
        bench_linear.main(["--graph-calls", "0"])
    assert bad.value.code == 2  # the argument error, before any CUDA check


def test_graphed_replay_keeps_the_captured_function_alive(monkeypatch):
    """`_graphed`'s replay holds the captured function: the graph reads tensors that only its closures
    keep (a module's cached weight checksums). A bare ``g.replay`` would let them be freed and their
    memory reused, so every replay of an earlier benchmark column would count false positives. CUDA stands in
    here: the capture and the streams are dummies, the replay is counted."""
    import contextlib
    import gc
    import weakref

    import torch

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())

    class Owner:  # stands for the module whose cached checksums the captured calls read
        pass

    owner = Owner()
    calls = []

    def fn(owner=owner):
        calls.append(owner is not None)

    alive = weakref.ref(owner)
    replay = bench_linear._graphed(fn)
    del fn, owner
    gc.collect()
    assert alive() is not None  # still held through the replay
    assert len(calls) == 3  # warm-up, side-stream warm-up, capture
    replay()
    assert Graph.replays == 1
    del replay
    gc.collect()
    assert alive() is None
