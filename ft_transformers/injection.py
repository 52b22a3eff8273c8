"""Fault injection: `FaultSpec`, bit flips, and where flips land in a kernel call.

A `FaultSpec` names a site (see `ft_transformers.kernels.contract.SITES`) and either a fixed ``bit`` flipped
at ``count`` random positions, or a bit error rate ``ber`` (each element of the site flips one
random bit with that probability). Kernel-level functions take it as ``inject=``;
`ft_transformers.protect.inject_faults` applies it to the protected modules of a model.

Inside a kernel call every site has a *logical shape* (the whole tensor the site would be if it
were materialised), e.g. ``attn.scores`` is ``(B, Hq, M, N)``. `SiteFaults` draws the flip
positions in that shape once per call, and `SiteFaults.apply` flips those falling inside the
block a blocked implementation is working on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .config import _indices, _integer, _real
from .distributed import rank, world_size
from .kernels.contract import SITE_INDEX, SITES, derive_seed

_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
}


@dataclass(frozen=True)
class FaultSpec:
    """What to inject.

    Every field is checked when the spec is made: a wrong type raises TypeError, a value out of
    range ValueError, each naming the field.

    Attributes:
        site: one of the contract's ``SITES`` (``docs/algorithms.md``): in attention's key loop
            ``attn.scores`` (S), ``attn.masked_scores`` (S after the bias and masks, as the row max and
            the exponent read it), ``attn.rowmax`` (the running max), ``attn.exponent`` (x = S − m, fed to
            exp), ``attn.probs`` (P = exp(x)), ``attn.probs_lp`` (P in the input dtype, as the P·V GEMM
            reads it), ``attn.alpha`` (the rescale exp(m_old − m_new)), ``attn.rowsum`` (the running
            row sum), ``attn.acc`` (the output accumulator between key blocks), ``attn.rowmax_carry``
            (the running max as it is carried out of a key block into the next), ``attn.output`` (the
            normalised output), ``attn.checksum`` (the checksum operands Sc1 and Oc1); the stored
            KV cache, ``attn.kv_cache`` (an entry of the K or V the call reads, flipped in place before
            the call: the flip stays in the cache for later steps); and ``linear.output``.
        bit: bit to flip (an int), 0 = mantissa LSB of the value's storage format at the site
            (fp32 for the attention sites but ``attn.probs_lp`` and ``attn.kv_cache``, which have the
            input dtype's bits; the GEMM output dtype for ``linear.output``).
        count: number of flips per targeted call (random positions), with ``bit``.
        ber: per-element flip probability in (0, 1] (random bit), instead of ``bit``.
        layers: transformer block indices (0-based ints; -1 = the modules outside the blocks) or
            qualified module names; a bare int or string is one entry; ``None`` = all.
        calls: forward-call indices (0-based) of each targeted module; a bare int is one call;
            ``None`` = all.
        seed: seeds positions and bits (an int); the same seed gives the same faults.
        ranks: the torch.distributed ranks (0-based ints; a bare int is one rank) whose processes inject
            the spec, e.g. one shard of a tensor-parallel model; ``None`` = every rank. Other ranks take it
            as no fault (`inject_faults`, and ``inject=`` of the kernel-level calls alike); a rank the run
            does not have is refused there (`check_ranks`).
    """

    site: str
    bit: int | None = None
    count: int = 1
    ber: float | None = None
    layers: Sequence[int | str] | int | str | None = None
    calls: Sequence[int] | int | None = None
    seed: int = 0
    ranks: Sequence[int] | int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.site, str) or self.site not in SITE_INDEX:
            raise ValueError(f"unknown fault site {self.site!r}; choose one of {', '.join(SITES)}")
        if (self.bit is None) == (self.ber is None):
            raise ValueError("FaultSpec needs exactly one of `bit` (with `count`) or `ber`")
        if self.bit is not None:
            bit = _integer("FaultSpec.bit", self.bit)
            if not 0 <= bit < 32:
                raise ValueError(f"FaultSpec.bit must lie in [0, 32) (0 = mantissa LSB), got {bit}")
            object.__setattr__(self, "bit", bit)
        if self.ber is not None:
            ber = _real("FaultSpec.ber", self.ber)
            if not 0.0 < ber <= 1.0:
                raise ValueError(f"FaultSpec.ber must lie in (0, 1], got {ber}")
            object.__setattr__(self, "ber", ber)
        count = _integer("FaultSpec.count", self.count)
        if count < 1:
            raise ValueError(f"FaultSpec.count must be >= 1, got {count}")
        object.__setattr__(self, "count", count)
        object.__setattr__(self, "seed", _integer("FaultSpec.seed", self.seed))
        if self.layers is not None:
            object.__setattr__(self, "layers", _indices("FaultSpec.layers", self.layers, names=True))
        if self.calls is not None:
            calls = _indices("FaultSpec.calls", self.calls)
            if any(c < 0 for c in calls):
                raise ValueError(f"FaultSpec.calls must be non-negative, got {calls}")
            object.__setattr__(self, "calls", calls)
        if self.ranks is not None:
            ranks = _indices("FaultSpec.ranks", self.ranks)
            if not ranks:  # (a spec that injects nowhere would pass unnoticed)
                raise ValueError("FaultSpec.ranks must name at least one rank (None = every rank), got none")
            if any(r < 0 for r in ranks):
                raise ValueError(f"FaultSpec.ranks must be non-negative, got {ranks}")
            object.__setattr__(self, "ranks", ranks)

    @property
    def is_attention(self) -> bool:
        return self.site.startswith("attn.")


def check_ranks(spec: FaultSpec) -> bool:
    """Whether ``spec`` injects on this process's rank; ValueError if it names a rank this run lacks."""
    if spec.ranks is None:
        return True
    n = world_size()
    absent = [r for r in spec.ranks if r >= n]
    if absent:
        raise ValueError(f"FaultSpec(site={spec.site!r}) ranks {absent} do not exist: this run has {n} rank(s) "
                         f"(torch.distributed ranks 0..{n - 1})")
    return rank() in spec.ranks


def storage_bits(dtype: torch.dtype) -> int:
    if dtype not in _INT_VIEW:
        raise TypeError(f"cannot flip bits of a {dtype} tensor")
    return torch.finfo(dtype).bits


def flip_bits(x: torch.Tensor, flip: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Return a copy of ``x`` with ``bits`` flipped where ``flip`` is True.

    Args:
        x: floating tensor of any shape.
        flip: bool tensor broadcastable to ``x``.
        bits: bit index per element (int tensor broadcastable to ``x``) or one int.
    """
    ity = _INT_VIEW.get(x.dtype)
    if ity is None:
        raise TypeError(f"cannot flip bits of a {x.dtype} tensor")
    nbits = torch.finfo(x.dtype).bits
    bits_t = torch.as_tensor(bits, device=x.device, dtype=torch.int64)
    # Build the xor mask in int64, then wrap it into the signed storage type (bit nbits-1 = sign).
    mask64 = torch.bitwise_left_shift(torch.ones_like(bits_t), bits_t)
    mask64 = torch.where(mask64 >= (1 << (nbits - 1)), mask64 - (1 << nbits), mask64)
    mask = torch.where(flip, mask64.to(ity), torch.zeros((), dtype=ity, device=x.device))
    return torch.bitwise_xor(x.contiguous().view(ity), mask).view(x.dtype)


class SiteFaults:
    """The flips of one site during one kernel call.

    Args:
        spec: the fault model (its ``site`` must be this site).
        shape: logical shape of the site for this call.
        seed: per-call seed (already mixed with module and call index by the caller).
        dtype: storage dtype of the values at the site (sets the bit range).
        device: device of the tensors `apply` will see.
    """

    def __init__(self, spec: FaultSpec, shape: Sequence[int], seed: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.spec = spec
        self.shape = tuple(int(s) for s in shape)
        self.seed = int(seed)
        self.nbits = storage_bits(dtype)
        self.device = torch.device(device)
        self.injected = 0  # flips applied so far (host int; in BER mode counting synchronises)
        if spec.bit is not None and spec.bit >= self.nbits:
            raise ValueError(
                f"bit {spec.bit} is out of range for {spec.site}, stored as {dtype} ({self.nbits} bits)"
            )
        self._coords: torch.Tensor | None = None
        numel = 1
        for s in self.shape:
            numel *= s
        if spec.bit is not None and numel > 0:
            g = torch.Generator().manual_seed(self.seed)
            want = min(int(spec.count), numel)
            picked: list[int] = []
            seen: set[int] = set()
            while len(picked) < want:  # distinct positions, in draw order
                for i in torch.randint(0, numel, (want - len(picked),), generator=g).tolist():
                    if i not in seen and len(picked) < want:
                        seen.add(i)
                        picked.append(i)
            flat = torch.tensor(picked, dtype=torch.int64)
            self._coords = torch.stack(torch.unravel_index(flat, self.shape), dim=1)  # (count, ndim)

    @property
    def positions(self) -> torch.Tensor | None:
        """(count, ndim) int64 coordinates of the flips in the logical shape (``bit`` mode)."""
        return self._coords

    def apply(self, x: torch.Tensor, dim: int = -1, start: int = 0) -> torch.Tensor:
        """Flip the faults that fall in ``x``.

        ``x`` is the slice ``[start, start + x.shape[dim])`` along ``dim`` of the site's logical
        tensor, whole along every other dim; positions past the logical extent (padding) never
        flip. Returns ``x`` itself when nothing lands in it.
        """
        dim = dim % x.dim()
        if tuple(x.shape[:dim]) != self.shape[:dim] or tuple(x.shape[dim + 1:]) != self.shape[dim + 1:]:
            raise ValueError(f"slice {tuple(x.shape)} does not match the site shape {self.shape} off dim {dim}")
        width = x.shape[dim]
        if self.spec.bit is not None:
            if self._coords is None:
                return x
            c = self._coords
            sel = (c[:, dim] >= start) & (c[:, dim] < start + width)
            if not bool(sel.any()):
                return x
            c = c[sel].clone()
            c[:, dim] -= start
            flip = torch.zeros(x.shape, dtype=torch.bool)
            flip[tuple(c.t())] = True
            self.injected += int(c.shape[0])
            return flip_bits(x, flip.to(x.device), int(self.spec.bit))
        # BER mode: a generator per (call seed, block start) keeps the pattern reproducible.
        g = torch.Generator().manual_seed(derive_seed(self.seed, start))
        flip = torch.rand(x.shape, generator=g) < float(self.spec.ber)
        valid = self.shape[dim] - start
        if valid < width:
            idx = [slice(None)] * x.dim()
            idx[dim] = slice(max(valid, 0), None)
            flip[tuple(idx)] = False
        bits = torch.randint(0, self.nbits, x.shape, generator=g)
        n = int(flip.sum())
        if n == 0:
            return x
        self.injected += n
        return flip_bits(x, flip.to(x.device), bits.to(x.device))


class FaultPlan:
    """Resolves a kernel-level ``inject=`` argument into per-site `SiteFaults`.

    ``inject`` may be ``None``, a `FaultSpec`, or a sequence of them; `for_site` returns the
    faults for one site (or ``None``) given the site's logical shape and dtype. ``seed`` is mixed
    into every spec's own seed (the model-level injector passes module and call index). ``specs`` holds
    the specs of this process's rank (`FaultSpec.ranks`); `check_sites` checks them all.
    """

    def __init__(self, inject: FaultSpec | Sequence[FaultSpec] | None, *, seed: int | None = None) -> None:
        if inject is None:
            specs: tuple[FaultSpec, ...] = ()
        elif isinstance(inject, FaultSpec):
            specs = (inject,)
        else:
            specs = tuple(inject)
            for s in specs:
                if not isinstance(s, FaultSpec):
                    raise TypeError(f"inject must be FaultSpec(s), got {type(s).__name__}")
        self._given = specs
        self.specs = tuple(s for s in specs if check_ranks(s))
        self.seed = seed
        self.sites: dict[str, SiteFaults] = {}

    def __bool__(self) -> bool:
        return bool(self.specs)

    def for_site(self, site: str, shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str) -> SiteFaults | None:
        for spec in self.specs:
            if spec.site == site:
                seed = spec.seed if self.seed is None else derive_seed(spec.seed, self.seed)
                sf = SiteFaults(spec, shape, derive_seed(seed, site), dtype, device)
                self.sites[site] = sf
                return sf
        return None

    @property
    def injected(self) -> int:
        return sum(sf.injected for sf in self.sites.values())

    def check_sites(self, allowed: Sequence[str], where: str) -> None:
        for spec in self._given:
            if spec.site not in allowed:
                raise ValueError(f"{where} has no fault site {spec.site!r}; its sites are {', '.join(allowed)}")
