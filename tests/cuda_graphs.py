"""Capturing a call into a CUDA graph for the GPU tests."""

from __future__ import annotations

from collections.abc import Callable

import torch


def captured(call: Callable[[], torch.Tensor], warmups: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``(graph, output)``: ``call`` run ``warmups`` times on a side stream (tuning, prepared launches:
    the warm-up torch advises before a capture), then captured once; replaying the graph rewrites
    the output tensor."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out
