"""`DirectLauncher`: which calls reuse a compiled kernel, and what they pass to its launcher.

A stand-in for a ``@triton.jit`` function records what Triton's path would be asked to do (and
returns a stand-in compiled kernel); the test checks that a direct launch happens exactly when the
call's specialisation (dtypes, 16-byte alignment, int classes, Python types, constexprs, options) is
one seen before, and that the launcher gets the arguments in the kernel's signature order. On a
GPU the real kernels run through it in every other test (`tests/test_abft_gemm.py`,
`tests/test_efta_triton.py`), and `test_gpu_direct_launch_respecialises` checks it against Triton's
own launch.
"""

from __future__ import annotations

import pytest
import torch
from ft_transformers.kernels import launch as L
from ft_transformers.kernels.options import override


class _Compiled:
    def __init__(self, tag):
        self.tag = tag
        self.function = f"fn{tag}"
        self.packed_metadata = ("meta", tag)
        self.runs: list[tuple] = []

    def run(self, *a):
        self.runs.append(a)

    def launch_metadata(self, grid, stream, *args):
        return {"grid": grid}


class _FakeJit:
    """Parameters (A, B, n, x, FLAG: constexpr, BLOCK: constexpr); every Triton-path call compiles."""

    arg_names = ["A", "B", "n", "x", "FLAG", "BLOCK"]

    def __init__(self):
        self.compiled: list[_Compiled] = []
        self.calls: list[tuple] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            k = _Compiled(len(self.compiled))
            self.compiled.append(k)
            return k
        return launch


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(L, "_cuda_device", lambda: 0)
    monkeypatch.setattr(L, "_cuda_stream", lambda dev: 1234)
    fn = _FakeJit()
    with override(direct_launch=True):
        yield fn, L.DirectLauncher(fn)


def _buf(n=64, dtype=torch.float16, offset=0):
    return torch.zeros(n + offset, dtype=dtype)[offset:]


def test_second_call_launches_directly_in_signature_order(fake):
    fn, launch = fake
    a, b = _buf(), _buf()
    kw = dict(BLOCK=32, FLAG=True, num_warps=4)
    launch((3, 2), (a, b, 48, 0.5), kw)
    assert len(fn.calls) == 1 and launch.direct_launches == 0
    a2, b2 = _buf(), _buf()  # other tensors, same dtypes and alignment; another multiple of 16
    launch((5,), (a2, b2, 64, 2.5), kw)
    assert len(fn.calls) == 1 and launch.direct_launches == 1
    k = fn.compiled[0]
    (run,) = k.runs
    assert run[:9] == (5, 1, 1, 1234, "fn0", ("meta", 0), None, None, None)
    # the runtime arguments, then the constexprs in the signature's order (FLAG before BLOCK)
    assert run[9:11] == (a2, b2) and run[11:] == (64, 2.5, True, 32)


@pytest.mark.parametrize("change", [
    "int_not_multiple_of_16", "int_one", "int_beyond_int32", "misaligned_tensor", "dtype",
    "bool_for_int", "float_for_int", "constexpr", "option",
])
def test_any_change_of_specialisation_goes_through_triton(fake, change):
    fn, launch = fake
    base_args = (_buf(), _buf(), 48, 0.5)
    base_kw = dict(FLAG=True, BLOCK=32, num_warps=4)
    launch((1,), base_args, base_kw)
    args, kw = list(base_args), dict(base_kw)
    if change == "int_not_multiple_of_16":
        args[2] = 40
    elif change == "int_one":
        args[2] = 1
    elif change == "int_beyond_int32":
        args[2] = 2**32
    elif change == "misaligned_tensor":
        args[0] = _buf(offset=1)  # 2 bytes past a 16-byte boundary
        assert args[0].data_ptr() % 16 != 0
    elif change == "dtype":
        args[1] = _buf(dtype=torch.bfloat16)
    elif change == "bool_for_int":
        args[2] = True
    elif change == "float_for_int":
        args[2] = 48.0
    elif change == "constexpr":
        kw["BLOCK"] = 64
    elif change == "option":
        kw["num_warps"] = 8
    launch((1,), tuple(args), kw)
    assert len(fn.calls) == 2 and launch.direct_launches == 0
    launch((1,), tuple(args), kw)  # and the new specialisation is then direct too
    assert len(fn.calls) == 2 and launch.direct_launches == 1
    assert fn.compiled[1].runs and not fn.compiled[0].runs


def test_unkeyable_arguments_and_switch_go_through_triton(fake, monkeypatch):
    fn, launch = fake
    kw = dict(FLAG=False, BLOCK=16)
    desc = object()  # e.g. a TMA tensor descriptor: not keyable, always Triton's path
    for _ in range(2):
        launch((1,), (desc, _buf(), 16, 1.0), kw)
    assert len(fn.calls) == 2 and launch.direct_launches == 0
    launch((1,), (_buf(), _buf(), 16, 1.0), dict(FLAG=False))  # a constexpr left to its default
    launch((1,), (_buf(), _buf(), 16, 1.0), dict(FLAG=False))
    assert len(fn.calls) == 4 and launch.direct_launches == 0
    with override(direct_launch=False):
        for _ in range(2):
            launch((1,), (_buf(), _buf(), 16, 1.0), kw)
    assert len(fn.calls) == 6 and launch.direct_launches == 0
    launch(lambda meta: (1,), (_buf(), _buf(), 16, 1.0), kw)  # a callable grid
    assert len(fn.calls) == 7


def test_interpreted_functions_always_go_through_triton(monkeypatch):
    monkeypatch.setattr(L, "_cuda_device", lambda: 0)
    fn = _FakeJit()
    launch = L.DirectLauncher(fn, interpreted=True)
    for _ in range(3):
        launch((1,), (_buf(), _buf(), 16, 1.0), dict(FLAG=False, BLOCK=16))
    assert len(fn.calls) == 3 and launch.direct_launches == 0


def test_devices_are_keyed_apart(fake, monkeypatch):
    fn, launch = fake
    kw = dict(FLAG=False, BLOCK=16)
    launch((1,), (_buf(), _buf(), 16, 1.0), kw)
    monkeypatch.setattr(L, "_cuda_device", lambda: 1)
    launch((1,), (_buf(), _buf(), 16, 1.0), kw)
    assert len(fn.calls) == 2 and launch.direct_launches == 0


def test_launch_hooks_get_metadata(fake, monkeypatch):
    fn, launch = fake
    seen = []
    monkeypatch.setattr(L, "_hooks", lambda: (seen.append, seen.append))
    kw = dict(FLAG=False, BLOCK=16)
    launch((2, 3), (_buf(), _buf(), 16, 1.0), kw)
    launch((2, 3), (_buf(), _buf(), 16, 1.0), kw)
    run = fn.compiled[0].runs[0]
    assert run[6] == {"grid": (2, 3)} and run[7] == seen.append


def test_bind_launches_the_compiled_kernel_without_a_key(fake, monkeypatch):
    fn, launch = fake
    kw = dict(FLAG=True, BLOCK=32, num_warps=4)
    args = (_buf(), _buf(), 48, 0.5)
    assert launch.bind((2,), args, kw) is None  # nothing compiled for it yet
    launch((2,), args, kw)
    bound = launch.bind((2,), args, kw)
    assert bound is not None and bound.kernel is fn.compiled[0]
    other = (_buf(), _buf(), 64, 1.5)
    bound(other)
    assert fn.compiled[0].runs == [(2, 1, 1, 1234, "fn0", ("meta", 0), None, None, None, *other, True, 32)]
    assert launch.direct_launches == 1 and len(fn.calls) == 1
    assert launch.bind((2,), (_buf(offset=1), _buf(), 48, 0.5), kw) is None  # another specialisation
    with override(direct_launch=False):
        assert launch.bind((2,), args, kw) is None


def test_a_launcher_that_refuses_our_arguments_falls_back_to_triton(fake):
    """A Triton whose compiled-kernel launcher takes other arguments (TypeError) gets every call through
    its own path from then on, with a warning; a bound launch falls back too."""
    fn, launch = fake
    kw = dict(FLAG=True, BLOCK=32)
    args = (_buf(), _buf(), 48, 0.5)
    launch((1,), args, kw)
    bound = launch.bind((1,), args, kw)

    def refuse(*a):
        raise TypeError("function takes exactly 13 arguments")

    fn.compiled[0].run = refuse
    with pytest.warns(RuntimeWarning, match="launching through Triton"):
        launch((1,), args, kw)
    assert len(fn.calls) == 2 and launch.direct_launches == 0 and not launch.enabled
    bound(args)
    launch((1,), args, kw)
    assert len(fn.calls) == 4 and launch.direct_launches == 0

