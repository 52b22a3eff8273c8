"""The checked GEMM's block-size tuner: it times the candidate configs (`configs`) of a call's form once per
shape key on CUDA, in the form the call runs, and keeps the fastest.

Cache: `_TUNE_CACHE`, key (dtype, weight layout, TMA, bias, detect, verification mode, M bucket (exact M for
sibling launches), N, K, decode kernel, sibling widths, ``Options.gemm_split``)
→ config (5 entries, or 6 with a last ``False``: no split-K). Kept for the process (a shape's best config
does not change), and the timed picks also across processes in a `tune_store.TuneStore` per GPU model
and kernel version; a forced ``Options.gemm_config`` and the interpreter's fixed configs bypass both.
"""

from __future__ import annotations

import dataclasses

import torch

from ..contract import new_counters
from ..gemm_checksums import GROUP_COLS, GROUP_CONSTS, xvar_in_use
from ..options import options
from ..tl_common import call_flag, capturing, gpu_time
from ..tl_common import cdiv as _cdiv
from . import forms
from .calls import (
    _call_buffer,
    _grouped_buffer,
    _grouped_call,
    _Launch,
    _launch_gemm,
    _launcher,
    _Verify,
)
from .configs import (
    CONFIG_INTERPRET,
    CONFIG_INTERPRET_GROUPED,
    CONFIGS_FP32,
    CONFIGS_GROUPED,
    CONFIGS_LARGE,
    CONFIGS_MID,
    CONFIGS_NARROW,
    CONFIGS_SMALL,
    NARROW_N,
)
from .forms import GROUPED_MAX_ROWS, forced_config, grouped, grouped_split, split_plan
from .tune_store import TuneStore, device_tag

# The tuner times a decode call (M ≤ GROUPED_MAX_ROWS) over copies of its weight, up to TUNE_STREAM_COPIES and past
# TUNE_STREAM_BYTES (more than an H100's or H200's L2), as a model streams its layers' weights: timed on one
# L2-resident weight, its picks were up to 15 % slower than the first config at decode shapes
TUNE_STREAM_BYTES = 120_000_000
TUNE_STREAM_COPIES = 8
_TUNE_CACHE: dict[tuple, tuple] = {}
_STORES: dict[tuple, TuneStore] = {}


def _store(dev: torch.device) -> TuneStore | None:
    """The tuning store of CUDA device ``dev`` under the options' directory (None: off, or not CUDA)."""
    directory = options().tune_cache_dir
    if directory is None or dev.type != "cuda":
        return None
    tag = device_tag(dev.index if dev.index is not None else torch.cuda.current_device())
    st = _STORES.get((directory, tag))
    if st is None:
        st = _STORES[(directory, tag)] = TuneStore(directory, tag)
    return st


def _bucket(m: int) -> int:
    return 16 if m <= 16 else 64 if m <= 64 else 1 << min(max(int(m - 1).bit_length(), 7), 13)


def _candidates(dtype: torch.dtype, m: int, n: int) -> list[tuple[int, int, int, int, int]]:
    if dtype == torch.float32:
        return CONFIGS_FP32
    if m <= 16:
        return CONFIGS_SMALL
    if m <= 64:
        return CONFIGS_MID
    return CONFIGS_LARGE + CONFIGS_NARROW if n <= NARROW_N else CONFIGS_LARGE



def pick_config(L: _Launch, *, bias, detect, verify_output, dot_f32, decode: bool = False, siblings: tuple = ()):
    """The block sizes for this call: forced, interpreter, or timed once per shape key (CUDA).
    ``decode``: for the decode kernel (`forms.grouped`); ``siblings``: the weights after ``L.w`` in a
    `checked_gemm_siblings` launch, as `_grouped_call` takes them (timed per exact M: at 1 × 9728 × 896
    and 16 × 9728 × 896 different configs were fastest, 11.7 and 9.3 µs, H200)."""
    forced = forced_config()
    if forced is not None:
        return forced
    m, k = L.x.shape
    n = L.y.shape[1]
    if forms.INTERP:  # the plain GEMM of a decode shape takes the decode kernel's blocks: the same sums as its
        plain_decode = not detect and grouped(m, n, k, L.x.dtype, L.x.device, None)
        return CONFIG_INTERPRET_GROUPED if decode or plain_decode else CONFIG_INTERPRET
    # (the forms a decode call is timed in depend on the split-K setting)
    opts = options()
    key = (L.x.dtype, L.kn, L.tma, bias is not None, detect, verify_output, m if siblings else _bucket(m), n, k,
           decode, tuple(sib[0].shape[0] for sib in siblings), opts.gemm_split)
    cfg = _TUNE_CACHE.get(key)
    if cfg is not None:
        return cfg
    cands = CONFIGS_GROUPED if decode else _candidates(L.x.dtype, m, n)
    if detect and not decode:  # the epilogue sums whole 64-column check groups
        cands = [c for c in cands if c[1] % GROUP_COLS == 0]
    if len(cands) == 1 or not opts.gemm_tune:
        _TUNE_CACHE[key] = cands[0]
        return cands[0]
    store = _store(L.x.device)  # a pick timed by an earlier process on this GPU model and kernel version
    cfg = store.get(key) if store is not None else None
    if cfg is not None:
        _TUNE_CACHE[key] = cfg
        return cfg
    dev = L.x.device
    if capturing():
        return cands[0]  # a capture cannot time candidates: the first, not cached (an eager call tunes)
    y_scratch = torch.empty_like(L.y)
    Ls = dataclasses.replace(L, y=y_scratch)
    # a tile call is timed as its GEMM (the group verification after it does not depend on the config); a
    # decode call in the form it runs, verifying against an infinite threshold into scratch counters
    ver = _Verify(new_counters(dev), None, True, 1.0, False) if decode else None
    if decode:
        # the decode kernel on scratch group checksums whose threshold is infinite (bias_sd = inf): it runs
        # its clean path, checks included, and finds nothing to repair. (Timed with its checks switched
        # off instead, w_finite = 0, it picked configs 1.6-1.9× slower than the first one, on an H200.)
        ng = _cdiv(n, GROUP_COLS)
        groups = (torch.zeros((ng, k), dtype=torch.float32, device=dev),
                  torch.zeros((ng, GROUP_CONSTS), dtype=torch.float32, device=dev))
        groups[1][:, 6] = float("inf")
        sib_scratch, t0 = [], _cdiv(L.w.shape[0], GROUP_COLS)
        for w_s, b_s, *_ in siblings:  # each sibling weight's slice of the scratch groups
            t1 = t0 + _cdiv(w_s.shape[0], GROUP_COLS)
            sib_scratch.append((w_s, b_s, (groups[0][t0:t1], groups[1][t0:t1]), ver.counters))
            t0 = t1

    def splits(c) -> int:
        if decode:
            return grouped_split(m, n, k, c, dev)[0]
        return split_plan(m, n, k, c, detect, dev)[0]

    if opts.gemm_split is None:
        # each config with split-K (where the call's form splits, `forms.split_plan`) and without
        cands = [v for c in cands for v in ((c, (*c, False)) if splits(c) > 1 else (c,))]
    copies = [Ls]
    if m <= GROUPED_MAX_ROWS:  # a decode call: timed over copies of its weight, as a model streams its weights
        nbytes = L.w.numel() * L.w.element_size()
        for _ in range(min(TUNE_STREAM_COPIES, -(-TUNE_STREAM_BYTES // max(nbytes, 1))) - 1):
            w = torch.empty_strided(L.w.shape, L.w.stride(), dtype=L.w.dtype, device=dev).copy_(L.w)
            copies.append(dataclasses.replace(Ls, w=w))
    best, best_t = None, float("inf")
    for c in cands:
        if decode:
            P = _grouped_buffer(m, n, k, c, dev)

            def run(c=c, P=P):
                for Lc in copies:
                    _launcher(2)(*_grouped_call(c, Lc, bias=bias, groups=groups, P=P, inj=None, ver=ver, emax=1.0,
                                                csigma=1.0, verify_output=verify_output, dot_f32=dot_f32,
                                                xvar=xvar_in_use(dev.type, L.x.dtype, "accumulator"),
                                                siblings=tuple(sib_scratch), flag=call_flag(dev)))
        else:
            P = _call_buffer(m, n, k, c, detect, dev, y_scratch)

            def run(c=c, P=P):
                for Lc in copies:
                    _launch_gemm(c, Lc, bias=bias, P=P, inj=None, detect=detect, verify_output=verify_output,
                                 dot_f32=dot_f32)
        try:
            with torch.cuda.device(dev):
                ms = gpu_time(run)
        except Exception:  # noqa: BLE001 - a config that does not fit (shared memory, registers)
            continue
        if ms < best_t:
            best, best_t = c, ms
    if best is None:
        raise RuntimeError(f"no Triton config of the checked GEMM ran for {key}")
    _TUNE_CACHE[key] = best
    if store is not None:
        store.put(key, best)
    return best
