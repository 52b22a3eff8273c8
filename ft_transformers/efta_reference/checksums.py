"""The checksum algebra of EFTA's two GEMMs (``docs/algorithms.md`` steps 1, 5 and 7).

Checksums run with stride s: over the keys of a block for GEMM I (L = block_n/s groups) and over
the head dim for GEMM II (Lv = Dp/s groups, D padded with zeros to Dp). Group (row i, residue r)
of a row x holds the L members ``x[l·s+r]``. Here:

* the tables of one call: ``[Kc1 | Kc2]`` and ``max_d Σ_l |K|`` per key block (`key_checksums`),
  V augmented with ``[Vc1 | Vc2 | 1]`` and ``max_n Σ_l |V|`` (`value_checksums`);
* the group sums ``Σ_l x[l·s+r]`` and ``Σ_l (l+1)·x[l·s+r]`` they are compared with (`group_sums`);
* the location of a single fault from ``D2/D1`` (`locate`) and its rebuild from the checksum and
  the other members of its group (`rebuild`);
* the rounding bounds γ_k every threshold is built from (`g`, `g16`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

U = 2.0**-24  # fp32 unit roundoff
U16 = 2.0**-11  # fp16 unit roundoff
FP16_ETA = 2.0**-25  # fp16 absolute rounding error bound in the subnormal range


def g(k: float) -> float:
    """The γ_k rounding bound 1.01·k·u (fp32)."""
    return 1.01 * k * U


def g16(k: float) -> float:
    """The γ_k rounding bound 1.01·k·u for fp16 (u = 2^-11)."""
    return 1.01 * k * U16


def key_checksums(kp: torch.Tensor, nblocks: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM I's checksum operands, every key block at once (step 1).

    Args:
        kp: (B, Hkv, nblocks·block_n, D) fp32 keys, zero-padded to whole blocks (in PASA the shifted
            keys K').
        nblocks: number of key blocks; stride: s.
    Returns:
        ``kc`` (B, Hkv, nblocks, 2s, D): ``[Kc1 | Kc2]`` with ``Kc1[r] = Σ_l K[l·s+r]`` and
        ``Kc2[r] = Σ_l (l+1)·K[l·s+r]``; ``kabs`` (B, Hkv, nblocks, s): ``max_d Σ_l |K[l·s+r, d]|``,
        the key factor of the threshold T_s.
    """
    B, Hkv, Np, D = kp.shape
    L = Np // nblocks // stride
    wk = torch.arange(1, L + 1, dtype=torch.float32, device=kp.device)
    k6 = kp.view(B, Hkv, nblocks, L, stride, D)
    kc = torch.cat([k6.sum(3), (k6 * wk.view(L, 1, 1)).sum(3)], dim=3)
    kabs = k6.abs().sum(3).amax(-1)
    return kc, kabs


def value_checksums(vp: torch.Tensor, n_keys: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM II's augmented operand and the magnitude bound of step 7.

    Args:
        vp: (B, Hkv, Np, D) fp32 values, zero-padded to whole key blocks (Np ≥ n_keys).
        n_keys: N, the real keys; stride: s.
    Returns:
        ``vaug`` (B, Hkv, Np, D + 2s + 1): ``[V | Vc1 | Vc2 | 1]`` with ``Vc1[n, r] = Σ_l V[n, l·s+r]``,
        ``Vc2[n, r] = Σ_l (l+1)·V[n, l·s+r]`` over the zero-padded head dim; the ones column
        accumulates ``lc``, the row sum's independent twin (step 6). ``vmax`` (B, Hkv, 1, s):
        ``max_n Σ_l |V[n, l·s+r]|`` over the real keys.
    """
    B, Hkv, Np, D = vp.shape
    Dp = -(-D // stride) * stride
    Lv = Dp // stride
    dev = vp.device
    wv = torch.arange(1, Lv + 1, dtype=torch.float32, device=dev)
    vpd = F.pad(vp, (0, Dp - D)) if Dp != D else vp
    v5 = vpd.view(B, Hkv, Np, Lv, stride)
    vc1 = v5.sum(3)
    vc2 = (v5 * wv.view(Lv, 1)).sum(3)
    vaug = torch.cat([vp, vc1, vc2, torch.ones(B, Hkv, Np, 1, dtype=torch.float32, device=dev)], dim=-1)
    vmax = v5[:, :, :n_keys].abs().sum(3).amax(2).unsqueeze(2)
    return vaug, vmax


def group_sums(x: torch.Tensor, ngroups: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_l x[..., l·s+r] and Σ_l (l+1)·x[..., l·s+r] over the last dim → two (..., s) tensors.

    The weighted sum is accumulated as the sum of the suffix sums (Σ_k Σ_{l≥k} x_l = Σ_l (l+1)·x_l),
    which costs 2(L−1) slice additions instead of a weighted copy and two reductions.
    """
    xg = x.unflatten(-1, (ngroups, stride))
    suf = xg[..., ngroups - 1, :]
    wsum = suf
    for i in range(ngroups - 2, -1, -1):
        suf = suf + xg[..., i, :]
        wsum = wsum + suf
    return suf, wsum


def locate(d1: torch.Tensor, d2: torch.Tensor, bad: torch.Tensor, ngroups: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The member of a faulty group from ``t = D2/D1 ≈ l+1`` (steps 1 and 7).

    Args:
        d1, d2: (..., s) differences between the checksums and the group sums.
        bad: (..., s) bool, the groups that failed the check.
        ngroups: L, members per group.
    Returns:
        ``loc`` (..., s) long, the 0-based member l (0 where not located), and ``ok`` (..., s) bool,
        where the location is valid: a failed group, t finite and within 0.25 of an integer in [1, L].
    """
    t = d2 / d1
    tr = torch.round(t)
    ok = bad & torch.isfinite(t) & ((t - tr).abs() <= 0.25) & (tr >= 1) & (tr <= ngroups)
    loc = torch.where(ok, tr - 1, torch.zeros_like(tr)).to(torch.long)
    return loc, ok


def rebuild(grp: torch.Tensor, idx: torch.Tensor, loc: torch.Tensor, csum: torch.Tensor) -> torch.Tensor:
    """New values of located elements: the checksum minus the sum of the other members of their group.

    Equal to ``value + D1`` in exact arithmetic, but when the fault made the value huge (exponent
    flips reach 3e38) D1 has absorbed the other members and ``value + D1`` cancels to ~0.

    Args:
        grp: (..., Lg, s) grouped values (member l of residue r at [..., l, r]).
        idx: (K, nd) indices of (..., r) of the located groups.
        loc: (K,) member index; csum: (K,) the groups' checksums.
    Returns:
        (K,) the rebuilt values.
    """
    r = idx[:, -1]
    members = grp[tuple(idx[:, :-1].t())]  # (K, Lg, s)
    members = members.gather(2, r.view(-1, 1, 1).expand(-1, members.shape[1], 1)).squeeze(2)  # (K, Lg)
    keep = torch.arange(members.shape[1], device=members.device).unsqueeze(0) != loc.unsqueeze(1)
    others = torch.where(keep, members, torch.zeros_like(members)).sum(dim=1)
    return csum - others
