"""Direct launches of compiled Triton kernels: the host cost of a call, without Triton's per-call binding.

`JITFunction.run` binds every argument of every call, specialises each one and hashes the result
with the compile options before it finds the compiled kernel; with the 40-90 arguments of our
kernels that took 20-30 µs per launch on the H100's host, against 8 µs for the compiled kernel's
own launcher (``docs/benchmarks.md``, host time). An eager decode step or a small GEMM takes less
GPU time than that.

`DirectLauncher` wraps one ``@triton.jit`` function. The first call of each *specialisation*
goes through Triton (which compiles or finds the kernel, and returns it); later calls with the same
specialisation launch that compiled kernel directly. The specialisation key holds everything
Triton specialises a compiled kernel on, for the argument kinds our kernels take:

* per tensor argument: its dtype and whether its address is 16-byte aligned;
* per int argument: whether it is 1, whether it is a multiple of 16, whether it fits in int32;
* per argument: its Python type (a bool, an int and a float at one position compile differently);
* the constexpr and option keywords (values), and the current CUDA device.

The key can only be finer than Triton's (it may separate calls Triton would share a kernel for,
never the reverse), so a direct launch always runs the kernel Triton itself would have run. Any
other argument kind (e.g. a TMA tensor descriptor) makes that call go through Triton every time.

``Options.direct_launch`` off (``FTT_DIRECT_LAUNCH=0``) sends every call through Triton (diagnosis,
benchmarks of the difference). A
Triton whose compiled-kernel launcher does not take these arguments (a TypeError) gets a warning
and every later call through its own path.
Under the interpreter (``TRITON_INTERPRET=1``) every call goes through Triton.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import torch

from .options import options

__all__ = ["BoundLaunch", "DirectLauncher", "record_launches", "replay_launches"]

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_SCALAR_TYPES = (float, bool, type(None))
_DTYPE = attrgetter("dtype")
_DATA_PTR = torch.Tensor.data_ptr


class _IntClasses(dict):
    """int → Triton's specialisation class of it: 0 for 1, 1 + (multiple of 16) + 2·(outside int32).
    A dict, so that classifying a call's ints is one C-level ``map`` over lookups; a value seen for
    the first time is classified here (the table is emptied when it grows large: call ids and
    decode lengths keep adding values)."""

    def __missing__(self, v: int) -> int:
        if len(self) > 65536:
            self.clear()
        c = self[v] = 0 if v == 1 else 1 + (v & 15 == 0) + 2 * (v < _I32_MIN or v > _I32_MAX)
        return c


_INT_CLASS = _IntClasses()


def _getter(positions: Sequence[Any]) -> Callable[[Any], tuple]:
    """args → the tuple of args at ``positions`` (indices of a tuple or keys of a dict; itemgetter,
    which returns a bare item for one)."""
    if len(positions) >= 2:
        return itemgetter(*positions)
    if len(positions) == 1:
        i = positions[0]
        return lambda a: (a[i],)
    return lambda a: ()


def _cuda_device() -> int:
    return torch.cuda.current_device()


def _cuda_stream(device: int) -> int:
    """The current stream's handle, as Triton's own launch takes it (a capturing stream included)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw is not None else torch.cuda.current_stream(device).cuda_stream


try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - triton < 3.4 has no knobs: no launch hooks either
    _knobs = None


def _hooks() -> tuple[Any, Any]:
    """Triton's launch enter/exit hooks when a profiler set any, else (None, None). Triton 3.6 keeps
    them as (possibly empty) hook chains; an empty chain is passed as None, which the launcher skips."""
    if _knobs is None:
        return None, None
    enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
    if not getattr(enter, "calls", enter) and not getattr(leave, "calls", leave):
        return None, None
    return enter, leave


class DirectLauncher:
    """``launcher(grid, args, kwargs)`` runs ``fn[grid](*args, **kwargs)``, directly once seen.

    Args:
        fn: a ``@triton.jit`` function whose runtime parameters all come first (``args``, in order)
            and whose constexpr parameters all come after them (``kwargs``, every one given).
        interpreted: True when ``fn`` runs in Triton's interpreter (every call goes through it).

    ``kwargs`` also carries the launch options (``num_warps``, ``num_stages``, ...). ``grid`` is a
    tuple of 1-3 ints (a callable grid goes through Triton every time).
    """

    def __init__(self, fn: Any, interpreted: bool = False) -> None:
        self.fn = fn
        self.names: tuple[str, ...] = tuple(getattr(fn, "arg_names", ()))
        self.enabled = not interpreted and bool(self.names)
        self._layouts: dict[tuple, tuple | None] = {}
        self._kernels: dict[tuple, Any] = {}
        self.direct_launches = 0  # calls that skipped Triton's binding (tests and diagnosis read it)

    def _layout(self, classes: tuple[type, ...], kwargs: dict[str, Any]) -> tuple | None:
        """(getter of the tensor arguments, getter of the int arguments, getter of the constexpr values
        after the runtime ones from the keywords), or None when this call's kind of arguments cannot be
        keyed (it then always goes through Triton)."""
        tensors, ints = [], []
        for i, c in enumerate(classes):
            if issubclass(c, torch.Tensor):
                tensors.append(i)
            elif c is int:
                ints.append(i)
            elif c not in _SCALAR_TYPES:
                return None
        tail = self.names[len(classes):]
        if any(n not in kwargs for n in tail) or len(self.names) < len(classes):
            return None
        return _getter(tensors), _getter(ints), _getter(tail)

    def _key(self, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
        """(specialisation key, the constexpr values after the runtime arguments), or None (not keyable)."""
        classes = tuple(map(type, args))
        lkey = (classes, tuple(kwargs))
        layout = self._layouts.get(lkey, False)
        if layout is False:
            layout = self._layouts[lkey] = self._layout(classes, kwargs)
        if layout is None:
            return None
        tensors, ints, tail = layout
        ts = tensors(args)
        key = (_cuda_device(), lkey, tuple(kwargs.values()), tuple(map(_DTYPE, ts)),
               tuple([p & 15 == 0 for p in map(_DATA_PTR, ts)]), tuple(map(_INT_CLASS.__getitem__, ints(args))))
        return key, tail(kwargs)

    def _active(self, grid: Sequence[int] | Callable) -> bool:
        """Whether this call may launch directly (not interpreted, not given up, a fixed grid, not
        switched off by `Options.direct_launch`)."""
        return self.enabled and not callable(grid) and options().direct_launch

    def __call__(self, grid: Sequence[int] | Callable, args: tuple, kwargs: dict[str, Any]) -> None:
        keyed = self._key(args, kwargs) if self._active(grid) else None
        if keyed is None:
            self.fn[grid](*args, **kwargs)
            return
        key, tail = keyed
        kernel = self._kernels.get(key)
        if kernel is None:  # first call of this specialisation: Triton compiles (or finds) the kernel
            kernel = self.fn[grid](*args, **kwargs)
            if kernel is not None and hasattr(kernel, "run") and not hasattr(kernel, "result"):
                self._kernels[key] = kernel
            return
        self._launch(kernel, key[0], grid, args, kwargs, tail)

    def _launch(self, kernel: Any, device: int, grid: Sequence[int], args: tuple, kwargs: dict[str, Any],
                tail: tuple) -> None:
        """Launch ``kernel`` directly (``tail``: the constexpr values after ``args``); through Triton
        instead, from now on, if this Triton's compiled-kernel launcher refuses the arguments."""
        try:
            _run(kernel, device, grid, (*args, *tail))
        except TypeError as exc:  # a Triton whose compiled-kernel launcher takes other arguments
            self.enabled = False
            warnings.warn(f"direct launches of {'/'.join(self.names[:1]) or 'a kernel'}'s Triton kernel failed "
                          f"({type(exc).__name__}: {exc}); launching through Triton from now on", RuntimeWarning,
                          stacklevel=3)
            self.fn[grid](*args, **kwargs)
            return
        self.direct_launches += 1

    def bind(self, grid: Sequence[int], args: tuple, kwargs: dict[str, Any]) -> BoundLaunch | None:
        """The compiled kernel of this call's specialisation, bound to ``grid`` and ``kwargs``: it then
        launches any arguments of the *same* specialisation without computing the key (the caller
        guarantees that). None when there is no such kernel yet (or the call is not keyable)."""
        if not self._active(grid):
            return None
        keyed = self._key(args, kwargs)
        kernel = self._kernels.get(keyed[0]) if keyed is not None else None
        if kernel is None:
            return None
        key, tail = keyed
        return BoundLaunch(self, kernel, key[0], tuple(grid), kwargs, tail)


class BoundLaunch:
    """`DirectLauncher.bind`'s result: ``bound(args)`` launches the bound kernel (same device, grid,
    constexprs, options; the arguments must specialise as the bound call's did)."""

    __slots__ = ("launcher", "kernel", "device", "grid", "kwargs", "tail")

    def __init__(self, launcher: DirectLauncher, kernel: Any, device: int, grid: tuple, kwargs: dict,
                 tail: tuple) -> None:
        self.launcher, self.kernel, self.device, self.grid = launcher, kernel, device, grid
        self.kwargs, self.tail = kwargs, tail

    def __call__(self, args: tuple) -> None:
        launcher = self.launcher
        if not launcher.enabled:  # given up (see `DirectLauncher._launch`)
            launcher.fn[self.grid](*args, **self.kwargs)
            return
        launcher._launch(self.kernel, self.device, self.grid, args, self.kwargs, self.tail)


def _run(kernel: Any, device: int, grid: Sequence[int], full: tuple) -> None:
    """Launch ``kernel`` on the current stream of ``device`` with all its arguments ``full`` (in order)."""
    stream = _cuda_stream(device)
    enter, leave = _hooks()
    meta = kernel.launch_metadata(grid, stream, *full) if enter is not None else None
    g = tuple(grid) + (1, 1)
    kernel.run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *full)


def record_launches(launches: Sequence[tuple], per_call: tuple, call_id: int | None,
                    call_id_at: Sequence[int | None], launcher_of: Callable[[int], Any]) -> list[tuple]:
    """Steps to replay one call's launches for a later call of the same signature (`replay_launches`).

    ``launches``: the call's ``(which, grid, args, kwargs)``, ``which`` naming its launcher
    (``launcher_of(which)``); ``per_call``: the call's own tensors, found in the arguments by identity (a
    later call puts its own there); ``call_id_at[which]``: where that launch takes the call id, or None.
    Each step keeps the compiled kernel bound (`DirectLauncher.bind`) when there is one: the later
    call's arguments specialise alike (the caller's signature guarantees it)."""
    steps = []
    index = {id(obj): j for j, obj in enumerate(per_call)}  # (ids of live objects are unique)
    for which, grid, args, kwargs in launches:
        where: list[list[int]] = [[] for _ in per_call]
        template = list(args)
        for i, a in enumerate(args):  # one pass over the ~90 arguments, not one per per-call tensor
            j = index.get(id(a))
            if j is not None and per_call[j] is a:
                where[j].append(i)
                template[i] = None
        id_at = call_id_at[which]
        assert id_at is None or args[id_at] == call_id
        launcher = launcher_of(which)
        bound = launcher.bind(grid, args, kwargs) if isinstance(launcher, DirectLauncher) else None
        steps.append((which, grid, template, kwargs, where, id_at, launcher, bound))
    return steps


def replay_launches(steps: Sequence[tuple], per_call: tuple, call_id: int | None,
                    launcher_of: Callable[[int], Any], direct: bool = True) -> None:
    """Launch `record_launches`' steps with this call's tensors ``per_call`` (in the recorded order) and
    call id. A step launches its bound kernel when ``direct`` and its launcher is still the recorded one
    (tests may replace launchers), else through the launcher."""
    for which, grid, template, kwargs, where, id_at, launcher, bound in steps:
        args = template.copy()
        for obj, positions in zip(per_call, where):
            for i in positions:
                args[i] = obj
        if id_at is not None:
            args[id_at] = call_id
        now = launcher_of(which)
        if bound is not None and direct and now is launcher:
            bound(tuple(args))
        else:
            now(grid, tuple(args), kwargs)
