"""The injection table of an EFTA call: the attention sites of the contract (``ATTENTION_SITES``), at the
points it names, in the logical shapes and storage dtypes it gives (`contract.site_shape`,
`contract.site_dtype`: fp32, or the input dtype for ``attn.probs_lp``). Bit mode: positions from
``plan.for_site`` are handed to the kernel as a small int32 table sorted by (batch, head); each program
xors the ones in its tile (`common._inject`). BER mode: Philox (``tl.randint4x``) per logical element.
``attn.checksum`` only exists with the checks on (like the reference, a call without them injects nothing
there). A plan is duck-typed (the contract's docstring): anything with ``for_site``.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from ..contract import ATTENTION_SITES, site_dtype, site_shape
from .common import _HDR
from .configs import STRIDE

_SITE_MODE_NONE, _SITE_MODE_BIT, _SITE_MODE_BER = 0, 1, 2


def _seed32(seed: int) -> int:
    return (seed ^ (seed >> 31) ^ (seed >> 62)) & 0x7FFFFFFF


def _injection_table(plan: Any, B: int, Hq: int, M: int, N: int, D: int, nblocks: int, pv_dtype: torch.dtype,
                     detect: bool, device: torch.device) -> tuple[torch.Tensor | None, list[int]]:
    """int32 table: header (6 ints per site: mode, bit, seed, ber bits, csr offset, positions
    offset), then per bit-mode site a CSR over b·Hq + h (B·Hq + 1 offsets) and (row, col) pairs.
    ``plan``: a fault plan (contract's docstring) or None; ``pv_dtype``: the dtype GEMM II reads P in
    (``attn.probs_lp``'s storage); ``detect``: the checks run (else ``attn.checksum`` has no value)."""
    modes = [_SITE_MODE_NONE] * len(ATTENTION_SITES)
    if not plan:
        return None, modes
    header = [0] * (_HDR * len(ATTENTION_SITES))
    body: list[int] = []
    base = len(header)
    for si, site in enumerate(ATTENTION_SITES):
        if site == "attn.checksum" and not detect:
            continue
        sf = plan.for_site(site, site_shape(site, B, Hq, M, N, D, nblocks, STRIDE), site_dtype(site, pv_dtype),
                           device)
        if sf is None:
            continue
        if sf.spec.bit is not None:
            pos = sf.positions
            if pos is None or pos.numel() == 0:
                continue
            modes[si] = _SITE_MODE_BIT
            pos = pos.to(torch.int64).cpu()
            bh = pos[:, 0] * Hq + pos[:, 1]
            order = torch.argsort(bh, stable=True)
            counts = torch.bincount(bh, minlength=B * Hq)
            csr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
            pairs = pos[order][:, 2:4].reshape(-1)
            hdr = [_SITE_MODE_BIT, int(sf.spec.bit), 0, 0, base + len(body), base + len(body) + csr.numel()]
            body += csr.tolist() + pairs.tolist()
            sf.injected += int(pos.shape[0])
        else:
            modes[si] = _SITE_MODE_BER
            ber_bits = struct.unpack("<i", struct.pack("<f", float(sf.spec.ber)))[0]
            hdr = [_SITE_MODE_BER, 0, _seed32(sf.seed), ber_bits, 0, 0]
        header[si * _HDR:(si + 1) * _HDR] = hdr
    if not any(modes):
        return None, modes
    table = torch.tensor(header + body, dtype=torch.int32)
    return table.to(device), modes
