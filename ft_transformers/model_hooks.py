"""The hooks a protected model runs around its forward, kept out of ``torch.compile``'s frames.

A protected model has a forward pre-hook (the KV cache ``generate`` hands it keeps checksum tables,
`kv_checksums.track_forward_cache`) and a forward hook (the step's counters are filed,
`EventRecorder.end_step`). transformers' ``generate`` compiles ``model.__call__`` for its decode steps;
dynamo does not trace ``nn.Module.__call__`` itself there, so it meets each hook as a frame of its own,
compiles it, and on every decode step looks the hook up and evaluates its guards (the module, the cache
and the call's arguments) before running it: on Qwen2-7B dims 1.3 ms of host time per token on one GPU and
1.7 ms at tensor parallel 4, while the GPU waits, and a graph break in the forward hook (`end_step` is host
code). Both hooks do nothing a graph could hold, so their frames run as plain Python instead; where they
are inlined into a traced frame (a compiled module that contains the model) dynamo still traces them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .events import EventRecorder
from .kv_checksums import track_forward_cache

__all__ = ["end_step_hook", "track_cache_hook"]


def _eager_frame(fn: Callable) -> Callable:
    """``fn`` with its code marked so that dynamo runs a frame of it, and every frame it calls, as plain
    Python, never compiling them as frames of their own (inlining into a traced frame is unaffected). With a
    torch that cannot mark code (before 2.6) the hooks stay compiled frames: correct, only slower."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return fn
    set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    return fn


def end_step_hook(recorder: EventRecorder) -> Callable[..., None]:
    """A forward hook for ``model.register_forward_hook``: ends ``recorder``'s step when the forward returns."""

    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        recorder.end_step()

    return _eager_frame(hook)


track_cache_hook = _eager_frame(track_forward_cache)
"""A forward pre-hook (``register_forward_pre_hook(track_cache_hook, with_kwargs=True)``): the cache the
forward is given keeps EFTA's checksum tables (`kv_checksums.track_forward_cache`)."""
