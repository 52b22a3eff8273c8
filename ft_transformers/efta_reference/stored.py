"""The checksum tables of a KV cache in the reference path's form, made when tokens enter the cache
(``docs/algorithms.md``, "Stored checksum tables").

Per key block j of block_n keys (s = stride, L = block_n/s): ``[Kc1 | Kc2]`` (2s, D) and
``max_d Σ_l |K|`` (s,); per key ``[Vc1 | Vc2]`` (2s,); per block ``max_n Σ_l |V|`` (s,). Everything is
fp32 and unsplit, so the tables are their own running sums: a token added to a block adds its terms in
the order `checksums.ordered_sums` adds them for a whole block, and an extended table holds the bits a
table built at once holds. The one extra running sum is ``Σ_l |K|`` per (residue, head dim) of the last,
partly filled block (its maximum over the head dim is the table's entry).

The tables cover keys [0, N) of a cache of N keys; keys past the filled ones must be zeros (a static
cache's unwritten slots, or no key at all), which is what they add.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .checksums import key_checksums, value_sums


class StoredReference(NamedTuple):
    """The tables of a cache of N keys as `efta_reference` takes them (``stored=``), nb = ⌈N/block_n⌉.

    kc (B, Hkv, nb, 2s, D) ``[Kc1 | Kc2]``; kabs (B, Hkv, nb, s) ``max_d Σ_l |K|``; vc (B, Hkv, nb·block_n,
    2s) ``[Vc1 | Vc2]`` per key (0 past N); vtile (B, Hkv, nb, s) ``max_n Σ_l |V|`` per block.
    """

    kc: torch.Tensor
    kabs: torch.Tensor
    vc: torch.Tensor
    vtile: torch.Tensor


class ReferenceTables:
    """One cache's tables (`StoredReference`), grown as keys are appended.

    Args:
        block_n, stride: the reference's key block and checksum stride.
    """

    def __init__(self, block_n: int = 64, stride: int = 16) -> None:
        self.block_n, self.stride = block_n, stride
        self._kc = self._kabs = self._vc = self._vtile = self._kabs_rd = None
        self._cap = 0  # blocks the tables hold

    def _reserve(self, B: int, Hkv: int, D: int, nb: int, device: torch.device) -> None:
        """Room for nb blocks (zeros past what the tables held: the sums of blocks not started yet)."""
        if nb <= self._cap:
            return
        cap = max(nb, 2 * self._cap)
        s, bn, f32 = self.stride, self.block_n, torch.float32
        new = (torch.zeros(B, Hkv, cap, 2 * s, D, dtype=f32, device=device),
               torch.zeros(B, Hkv, cap, s, dtype=f32, device=device),
               torch.zeros(B, Hkv, cap * bn, 2 * s, dtype=f32, device=device),
               torch.zeros(B, Hkv, cap, s, dtype=f32, device=device))
        if self._cap:
            new[0][:, :, :self._cap] = self._kc
            new[1][:, :, :self._cap] = self._kabs
            new[2][:, :, :self._cap * bn] = self._vc
            new[3][:, :, :self._cap] = self._vtile
        self._kc, self._kabs, self._vc, self._vtile = new
        self._cap = cap
        if self._kabs_rd is None:
            self._kabs_rd = torch.zeros(B, Hkv, s, D, dtype=f32, device=device)

    def build(self, k: torch.Tensor, v: torch.Tensor, filled: int) -> None:
        """The tables of k, v (B, Hkv, N, D) at once: keys [0, filled) written, the rest zeros."""
        B, Hkv, N, D = k.shape
        bn, s = self.block_n, self.stride
        nb = -(-N // bn)
        self._cap = 0
        self._kabs_rd = None
        self._reserve(B, Hkv, D, nb, k.device)
        Np = nb * bn
        kp = torch.nn.functional.pad(k.to(torch.float32), (0, 0, 0, Np - N))
        kc, kabs = key_checksums(kp, nb, s)
        self._kc[:, :, :nb] = kc
        self._kabs[:, :, :nb] = kabs
        vc, vabs = value_sums(v.to(torch.float32), s)
        self._vc[:, :, :N] = vc
        vabs = torch.nn.functional.pad(vabs, (0, 0, 0, Np - N))
        self._vtile[:, :, :nb] = vabs.view(B, Hkv, nb, bn, s).amax(3)
        if filled % bn:  # the running Σ_l |K| of the partly filled block
            j = filled // bn
            L = bn // s
            kb = kp[:, :, j * bn:(j + 1) * bn].reshape(B, Hkv, L, s, D).abs()
            self._kabs_rd.copy_(kb[:, :, 0])
            for i in range(1, L):
                self._kabs_rd.add_(kb[:, :, i])

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int, count: int) -> None:
        """Keys [start, start + count) of k, v (B, Hkv, N, D) were just written; the tables cover [0, start)."""
        B, Hkv, N, D = k.shape
        bn, s = self.block_n, self.stride
        end = start + count
        self._reserve(B, Hkv, D, -(-N // bn), k.device)
        kn = k[:, :, start:end].to(torch.float32)
        vc, vabs = value_sums(v[:, :, start:end].to(torch.float32), s)
        self._vc[:, :, start:end] = vc
        for j in range(start // bn, (end - 1) // bn + 1):
            lo, hi = max(start, j * bn), min(end, (j + 1) * bn)
            if lo == j * bn:  # a block that starts here: its sums start from zero
                self._kc[:, :, j].zero_()
                self._kabs_rd.zero_()
                self._vtile[:, :, j].zero_()
            for g in range((lo - j * bn) // s, (hi - 1 - j * bn) // s + 1):  # groups l of the block, in order
                p0, p1 = max(lo, j * bn + g * s), min(hi, j * bn + g * s + s)
                r0, r1 = p0 - (j * bn + g * s), p1 - (j * bn + g * s)
                x = kn[:, :, p0 - start:p1 - start]
                self._kc[:, :, j, r0:r1] += x
                self._kc[:, :, j, s + r0:s + r1] += x * float(g + 1)
                self._kabs_rd[:, :, r0:r1] += x.abs()
            self._kabs[:, :, j] = self._kabs_rd.amax(-1)
            self._vtile[:, :, j] = torch.maximum(self._vtile[:, :, j], vabs[:, :, lo - start:hi - start].amax(2))

    def view(self, n_keys: int) -> StoredReference:
        """The tables of the cache's first n_keys keys (views, nb = ⌈n_keys/block_n⌉ blocks)."""
        nb = -(-n_keys // self.block_n)
        return StoredReference(self._kc[:, :, :nb], self._kabs[:, :, :nb], self._vc[:, :, :nb * self.block_n],
                               self._vtile[:, :, :nb])
