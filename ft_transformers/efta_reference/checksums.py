"""The checksum algebra of EFTA's two GEMMs (``docs/algorithms.md`` steps 1, 5 and 7).

Checksums run with stride s: over the keys of a block for GEMM I (L = block_n/s groups) and over
the head dim for GEMM II (Lv = Dp/s groups, D padded with zeros to Dp). Group (row i, residue r)
of a row x holds the L members ``x[l·s+r]``. Here:

* the tables of one call: ``[Kc1 | Kc2]`` and ``max_d Σ_l |K|`` per key block (`key_checksums`),
  V augmented with ``[Vc1 | Vc2 | 1 | 1]`` and ``max_n Σ_l |V|`` (`value_checksums`), all summed in one
  order (`ordered_sums`);
* the group sums ``Σ_l x[l·s+r]`` and ``Σ_l (l+1)·x[l·s+r]`` they are compared with (`group_sums`);
* the location of a single fault from ``D2/D1`` (`locate`) and its rebuild from the checksum and
  the other members of its group (`rebuild`);
* the rounding bounds γ_k every threshold is built from (`g`, `g16`).
"""

from __future__ import annotations

import math

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


def ordered_sums(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Σ_l x_l``, ``Σ_l (l+1)·x_l`` and ``Σ_l |x_l|`` over ``dim``, each added in the order l = 0, 1, …

    One fixed order, the kernels' too: tables extended a token at a time (`efta_reference.stored`) add
    the same terms in the same order as tables built at once, so both hold the same bits.
    """
    x0 = x.select(dim, 0)
    s1, s2, sa = x0.clone(), x0.clone(), x0.abs()
    for i in range(1, x.shape[dim]):
        xi = x.select(dim, i)
        s1 = s1 + xi
        s2 = s2 + xi * float(i + 1)
        sa = sa + xi.abs()
    return s1, s2, sa


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
    kc1, kc2, ka = ordered_sums(kp.view(B, Hkv, nblocks, L, stride, D), 3)
    return torch.cat([kc1, kc2], dim=3), ka.amax(-1)


def value_sums(vp: torch.Tensor, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per key, the head-dim checksums of GEMM II and their magnitude.

    Args:
        vp: (B, Hkv, n, D) fp32 values; stride: s (D is zero-padded to Dp, a multiple of s).
    Returns:
        ``vc`` (B, Hkv, n, 2s): ``[Vc1 | Vc2]`` with ``Vc1[n, r] = Σ_l V[n, l·s+r]`` and
        ``Vc2[n, r] = Σ_l (l+1)·V[n, l·s+r]``; ``vabs`` (B, Hkv, n, s): ``Σ_l |V[n, l·s+r]|``.
    """
    B, Hkv, n, D = vp.shape
    Dp = -(-D // stride) * stride
    vpd = F.pad(vp, (0, Dp - D)) if Dp != D else vp
    vc1, vc2, va = ordered_sums(vpd.reshape(B, Hkv, n, Dp // stride, stride), 3)
    return torch.cat([vc1, vc2], dim=-1), va


def value_checksums(vp: torch.Tensor, n_keys: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM II's augmented operand and the magnitude bound of step 7.

    Args:
        vp: (B, Hkv, Np, D) fp32 values, zero-padded to whole key blocks (Np ≥ n_keys).
        n_keys: N, the real keys; stride: s.
    Returns:
        ``vaug`` (B, Hkv, Np, D + 2s + 2): ``[V | Vc1 | Vc2 | 1 | 1]`` (`value_sums`); the ones columns
        accumulate the row sum ``l`` and its twin ``lc`` (step 6). ``vmax`` (B, Hkv, 1, s):
        ``max_n Σ_l |V[n, l·s+r]|`` over the real keys.
    """
    vc, va = value_sums(vp, stride)
    return augment_values(vp, vc), va[:, :, :n_keys].amax(2).unsqueeze(2)


def augment_values(vp: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """``[V | Vc1 | Vc2 | 1 | 1]`` (B, Hkv, Np, D + 2s + 2) from vp (B, Hkv, Np, D) and vc (B, Hkv, Np, 2s)."""
    ones = torch.ones(*vp.shape[:3], 2, dtype=torch.float32, device=vp.device)
    return torch.cat([vp, vc, ones], dim=-1)


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


def scaled_d2(checksum2: torch.Tensor, x: torch.Tensor, ngroups: int, stride: int) -> torch.Tensor:
    """``D2·2^-e`` (2^e ≥ L the smallest power of two): the weighted checksum difference with weights
    (l+1)/2^e ≤ 1, for `locate`. Unscaled, ``(l+1)·x`` overflows when a fault made one member huge
    (a flipped exponent bit takes a score or an output past 1e38), t = D2/D1 is lost and the group is
    recomputed, which repeats a fault that sits in a stored KV-cache entry. Scaling by a power of two is
    exact, so where nothing overflows this is D2·2^-e bit for bit.

    Args:
        checksum2: (..., s) the weighted checksum (Sc2, or Oc2 normalised); x: (..., L·s) the values.
    Returns:
        (..., s) fp32.
    """
    f = 2.0 ** -math.ceil(math.log2(ngroups))
    return checksum2 * f - group_sums(x * f, ngroups, stride)[1]


def locate(d1: torch.Tensor, d2s: torch.Tensor, bad: torch.Tensor, ngroups: int, members: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The member of a faulty group (steps 1 and 7): the group's only non-finite member if it has exactly
    one, else from ``t = D2/D1 ≈ l+1``.

    A fault that makes a value ±inf or NaN (an exponent flip to all ones, or an inf or NaN that entered a
    stored KV-cache entry, which every score or output it meets inherits) leaves D1 and D2 non-finite and
    t undefined; the member itself shows it, and the checksum minus the other members rebuilds it
    (`rebuild`). (A non-finite input never reaches this: it switches the checks off.)

    Args:
        d1: (..., s) differences between the checksums and the group sums; d2s: (..., s) the weighted
            ones, scaled (`scaled_d2`).
        bad: (..., s) bool, the groups that failed the check.
        ngroups: L, members per group.
        members: (..., L, s) the grouped values (member l of residue r at [..., l, r]).
    Returns:
        ``loc`` (..., s) long, the 0-based member l (0 where not located), and ``ok`` (..., s) bool,
        where the location is valid: a failed group whose only non-finite member is l, or t finite and
        within 0.25 of an integer in [1, L].
    """
    t = d2s / d1 * 2.0 ** math.ceil(math.log2(ngroups))
    tr = torch.round(t)
    ok = bad & torch.isfinite(t) & ((t - tr).abs() <= 0.25) & (tr >= 1) & (tr <= ngroups)
    loc = torch.where(ok, tr - 1, torch.zeros_like(tr)).to(torch.long)
    nonfinite = ~torch.isfinite(members)
    single = bad & (nonfinite.sum(-2) == 1)
    loc = torch.where(single, nonfinite.to(torch.uint8).argmax(-2), loc)
    return loc, ok | single


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
