"""The checksum tables of a KV cache in the kernel's layout, made when tokens enter the cache and read by
every later call instead of the per-call pre-pass (``docs/algorithms.md``, "Stored checksum tables").

`CacheTables` holds, for a cache of K/V (B, Hkv, N, D), the rows the pre-pass would write for it
(`checksums._efta_checksums`: KC, VC, KA, VA, SC, row (b·Hkv + hk)·nb + j, nb = ⌈N/64⌉) plus the fp32
weighted key checksum Kc2 per block (KC2), with which step 1 locates a fault in the stored keys (Kc2 made
from the keys a call reads would follow the fault). Tokens appended at [start, end) cost one launch
(`checksums._efta_checksums_append`, grid (Hkv, B)) for the blocks they enter in part, plus one pre-pass
launch over the blocks they fill whole (a prefill); the keys written before are not read again. A cache
that grows by whole blocks (dynamic caches) reallocates its tables to the new row count once per 64
tokens (a copy of the tables, about a third of the cache's bytes, every 64 steps), so that the forward
kernel indexes them exactly as the pre-pass's.

Memory per key and kv head, D = 128: the tables 260 B (fp16) / 388 B (bf16) and Kc2 128 B, against 512 B
of K and V; with the per (batch, kv head) running sums of the last block (24 KiB + 8 KiB at D = 128).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from ..contract import kernel_head_dim
from ..launch import DirectLauncher
from ..tl_common import runs_interpreted
from .checksums import _efta_checksums, _efta_checksums_append, vc_rows
from .configs import CS_BLOCK_N, _pow2_bucket

_INTERP = runs_interpreted(_efta_checksums_append)
_PREPASS = DirectLauncher(_efta_checksums, _INTERP)
_APPEND = DirectLauncher(_efta_checksums_append, _INTERP)
_PARTS = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 1}


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``t``'s GPU as the current CUDA device while launching (Triton launches on the current device)."""
    dev = t.device
    if dev.type == "cuda" and dev.index is not None and dev.index != torch.cuda.current_device():
        return torch.cuda.device(dev)
    return contextlib.nullcontext()


class StoredTables(NamedTuple):
    """A KV cache's checksum tables as `efta_triton_forward` takes them (``stored=``); rows = B·Hkv·nb.

    kc (rows, PARTS, 16, BLOCK_D) and vc (rows, 32·PARTS + 2, 64) (Vc1's slices, the ones columns of the row
    sum, Vc2's slices: `checksums.vc_rows`) in the input dtype, ka, va (rows, 16), sc (rows, 4) and kc2 (rows,
    16, BLOCK_D) fp32 (`checksums._store_block`)."""

    kc: torch.Tensor
    vc: torch.Tensor
    ka: torch.Tensor
    va: torch.Tensor
    sc: torch.Tensor
    kc2: torch.Tensor

    @staticmethod
    def shapes(B: int, Hkv: int, N: int, block_d: int, dtype: torch.dtype) -> tuple[tuple[int, ...], ...]:
        """The shapes of the tables of a cache of N keys, head dims padded to block_d."""
        rows, parts = B * Hkv * -(-N // CS_BLOCK_N), _PARTS[dtype]
        return ((rows, parts, 16, block_d), (rows, vc_rows(parts), CS_BLOCK_N), (rows, 16), (rows, 16), (rows, 4),
                (rows, 16, block_d))


class CacheTables:
    """The tables of one KV cache (`StoredTables`), built once and extended as tokens are appended.

    Keys past the filled ones must be zeros (a static cache's unwritten slots) or absent: they are what
    the tables add for them.
    """

    def __init__(self) -> None:
        self.tables: StoredTables | None = None
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None  # the last block's running sums (MK, MV)
        self._layout: tuple | None = None  # (B, Hkv, D, dtype, device) the tables are for
        self._nb = 0

    def _alloc(self, rows_per: int, B: int, Hkv: int, block_d: int, dtype: torch.dtype,
               device: torch.device) -> StoredTables:
        shapes = StoredTables.shapes(B, Hkv, rows_per * CS_BLOCK_N, block_d, dtype)
        dts = (dtype, dtype, torch.float32, torch.float32, torch.float32, torch.float32)
        return StoredTables(*(torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, dts)))

    def _meta(self, k: torch.Tensor) -> dict:
        D = k.shape[3]
        block_d = max(16, _pow2_bucket(D))
        return dict(BLOCK_D=block_d, PARTS=_PARTS[k.dtype], SCALE_CS=k.dtype == torch.float16, INTERP=_INTERP,
                    EVEN_D=D == block_d, BLOCK_N=CS_BLOCK_N, num_warps=4)

    def _prepass(self, k: torch.Tensor, v: torch.Tensor, j0: int, j1: int) -> None:
        """Rows of the key blocks [j0, j1), from the cache's keys and values."""
        B, Hkv, N, D = k.shape
        t = self.tables
        _PREPASS((j1 - j0, Hkv, B), (
            k, v, t.kc, t.vc, t.ka, t.va, t.sc, t.kc, t.kc2, *k.stride(), *v.stride(), Hkv, N, D,
            0.0, 0.0, 0.0, 0.0, 0.0, j0, self._nb,
        ), dict(self._kw, PASA=False, KC2_OUT=True))

    def _append(self, k: torch.Tensor, v: torch.Tensor, start: int, end: int) -> None:
        """Rows of the blocks that keys [start, end) enter in part, and the running sums of the last one."""
        B, Hkv, N, D = k.shape
        t = self.tables
        _APPEND((Hkv, B), (
            k, v, t.kc, t.vc, t.ka, t.va, t.sc, t.kc2, *self._sums, *k.stride(), *v.stride(), Hkv, D, self._nb,
            start, end,
        ), self._kw)

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.dtype not in _PARTS:
            raise ValueError(f"k, v must be (B, Hkv, N, D) of one dtype among float16, bfloat16, float32; got "
                             f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}")
        D = k.shape[3]
        if not kernel_head_dim(D):
            raise ValueError(f"the kernel's tables need a head dim that is a multiple of 16 in [16, 128], got {D}")

    def build(self, k: torch.Tensor, v: torch.Tensor, filled: int) -> None:
        """The tables of k, v (B, Hkv, N, D) at once, keys [0, filled) written (the rest zeros)."""
        self._check(k, v)
        with _on_device(k):
            self._build(k, v, filled)

    def _build(self, k: torch.Tensor, v: torch.Tensor, filled: int) -> None:
        B, Hkv, N, D = k.shape
        block_d = max(16, _pow2_bucket(D))
        self._layout = (B, Hkv, D, k.dtype, k.device)
        self._kw = self._meta(k)  # the table launches' constexprs: fixed by the layout
        self._nb = -(-N // CS_BLOCK_N)
        self.tables = self._alloc(self._nb, B, Hkv, block_d, k.dtype, k.device)
        self._sums = (torch.empty((B * Hkv, 3, 16, block_d), dtype=torch.float32, device=k.device),
                      torch.empty((B * Hkv, 2, CS_BLOCK_N, 16), dtype=torch.float32, device=k.device))
        if self._nb:
            self._prepass(k, v, 0, self._nb)
        if filled % CS_BLOCK_N:  # the running sums of the partly filled block
            self._append(k, v, filled - filled % CS_BLOCK_N, filled)

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int, count: int) -> None:
        """Keys [start, start + count) of k, v (B, Hkv, N, D) were just written; the tables cover [0, start)."""
        self._check(k, v)
        with _on_device(k):
            self._extend(k, v, start, count)

    def _extend(self, k: torch.Tensor, v: torch.Tensor, start: int, count: int) -> None:
        B, Hkv, N, D = k.shape
        if self._layout != (B, Hkv, D, k.dtype, k.device):
            raise ValueError(f"k of shape {tuple(k.shape)} ({k.dtype}, {k.device}) is not the cache these tables "
                             f"were built for {self._layout}")
        end = start + count
        if not 0 <= start < end <= N:
            raise ValueError(f"tokens [{start}, {end}) do not lie in a cache of {N} keys")
        nb = -(-N // CS_BLOCK_N)
        if nb > self._nb:  # the cache grew: its rows move to the new count of blocks per (batch, kv head)
            old, nb_old = self.tables, self._nb
            self._nb = nb
            self.tables = self._alloc(nb, B, Hkv, old.kc.shape[3], k.dtype, k.device)
            for dst, src in zip(self.tables, old):
                dst.view(B * Hkv, nb, -1)[:, :nb_old] = src.view(B * Hkv, nb_old, -1)
        whole0, whole1 = -(-start // CS_BLOCK_N), end // CS_BLOCK_N  # blocks the tokens fill whole
        if whole1 > whole0:
            self._prepass(k, v, whole0, whole1)
        if start % CS_BLOCK_N or end % CS_BLOCK_N:
            self._append(k, v, start, end)
