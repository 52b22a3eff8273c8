"""Helpers shared by the kernels: a Triton dot, the host-side per-call non-finite flag, the launch
device guard, the tuners' timer, and whether a kernel runs in Triton's CPU interpreter."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["call_flag", "cdiv", "dot", "gpu_time", "on_tensor_device", "runs_interpreted", "shared_memory",
           "sm_count"]


@triton.jit
def dot(a, b, acc, F32: tl.constexpr):
    """acc + a·b. F32: both operands in fp32 with IEEE products (fp32 inputs, or dtypes the
    interpreter's matmul cannot take); otherwise the tensor-core dot in the operands' dtype."""
    if F32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host (``triton.cdiv`` costs microseconds per call on the launch path)."""
    return -(-a // b)


_SMS: dict[torch.device, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the property query costs microseconds)."""
    sms = _SMS.get(device)
    if sms is None:
        sms = _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return sms


_SMEM: dict[torch.device, int] = {}
HOPPER_SHARED_MEMORY = 232_448  # bytes of shared memory a block may use on an H100 / H200 (sm_90)


def shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on a CUDA device (the opt-in maximum, as Triton checks a
    kernel against it when it loads it); cached per device."""
    smem = _SMEM.get(device)
    if smem is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        smem = _SMEM[device] = int(props["max_shared_mem"])
    return smem


def gpu_time(fn, quantiles=None):
    """Milliseconds of GPU time per call of ``fn`` (CUDA, not capturing), for the block-size tuners.

    Replays a CUDA graph of repeated calls (Triton's ``do_bench_cudagraph``; ``quantiles`` as
    there). An eager timing (``do_bench``) brackets each call with events, so for a call whose host
    work outlasts its kernel (decode, or a 2048³ GEMM, on the H100 host) it measures the host's
    launch work, about the same for every candidate, and the pick is left to noise. Under a graph
    the candidates' kernels run back to back, which is also how a compiled model replays them.

    Triton times on a new stream that does not wait for the current one, so the device is
    synchronised first: else the candidates ran beside kernels still queued before the tuning call,
    and the autotuner's ``restore_value`` copy of the EFTA counters could be taken before a
    queued ``zero_()`` of them and restored over it (garbage counts, seen on an H200), while the
    GEMM tuner's launches shared the one-launch cells with a GEMM still running."""
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=20, quantiles=quantiles)


def runs_interpreted(fn) -> bool:
    """True when the jit function ``fn`` runs through Triton's CPU interpreter: ``TRITON_INTERPRET=1``
    was set before triton itself was imported. Triton decides at its own import, for its library
    functions too, so both must be interpreted; setting the variable later leaves them compiled."""
    try:
        import triton.language.standard as std
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old or very new triton
        return False
    return isinstance(fn, InterpretedFunction) and isinstance(std.cdiv, InterpretedFunction)


def on_tensor_device(fn):
    """Run ``fn(t, ...)`` with ``t``'s GPU as the current CUDA device.

    Triton launches on the current device's stream. A model spread over several GPUs
    (``device_map``) calls layers whose tensors live on another GPU than the current one; without
    this guard their kernels would run on the wrong GPU. The device switch happens only when the
    devices differ.
    """
    @functools.wraps(fn)
    def wrapper(t, *args, **kwargs):
        dev = t.device
        if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):
                return fn(t, *args, **kwargs)
        return fn(t, *args, **kwargs)
    return wrapper


# ------------------------------------------------------------------------------------------------
# Host side: the per-call non-finite flag
# ------------------------------------------------------------------------------------------------

_FLAGS: dict[tuple[torch.device, bool], torch.Tensor] = {}
_CALL_ID = [0]


def capturing(device: torch.device | None = None) -> bool:
    """Whether the current CUDA stream is capturing a graph (False for a non-CUDA ``device``): launches
    recorded for replay, scratch buffers and tuning differ inside a capture."""
    return (device is None or device.type == "cuda") and torch.cuda.is_current_stream_capturing()


def call_flag(device: torch.device, self_reset: bool = False) -> tuple[torch.Tensor, int]:
    """Per-device int32 cell + an id for this kernel call, for "once per call" non-finite handling.

    A program that finds non-finite inputs raises the cell to the call id (``atomic_max``); the
    first to do so counts the event (EFTA), or later programs of the same call compare the cell with
    the id (the checked GEMM switches its checks off). Eager calls get increasing ids, so the cell
    never needs a reset (it wraps). A call captured into a CUDA graph would replay with a frozen id
    (1), so there the cell must be 0 when the call starts:

    * ``self_reset=False``: the cell is zeroed inside the graph (a captured memset before the call);
    * ``self_reset=True`` (the launch's last program stores 0 into the cell when it is done: the
      one-launch checked GEMM): the call gets a second cell, used only by such calls, which is 0
      between calls, and no memset (a memset node per checked Linear call costs 0.9-1.1 µs per call
      of a 16-call graph on an H200, docs/vabft.md).
    """
    key = (device, capturing(device) and self_reset)
    flag = _FLAGS.get(key)
    if flag is None:
        # both cells at once, on the device's first call (an eager one, normally): a cell first made
        # during a capture would live in the graph's memory pool (torch.compile's CUDA graphs refuse
        # a live tensor there that is not a graph output)
        both = torch.zeros(2, dtype=torch.int32, device=device)
        _FLAGS[(device, False)], _FLAGS[(device, True)] = both[0:1], both[1:2]
        flag = _FLAGS[key]
    if capturing:
        if not self_reset:
            flag.zero_()
        return flag, 1
    _CALL_ID[0] += 1
    if _CALL_ID[0] >= 2**31 - 1:  # wrap: reset the cell (stream-ordered, no sync)
        flag.zero_()
        _CALL_ID[0] = 2
    return flag, _CALL_ID[0]
