"""The library's diagnostic switches, read once.

Every switch has a default that is right for users; the switches exist to diagnose and to time one
form of a kernel against another. They are read from ``FTT_*`` environment variables once, when this
module is imported, into one frozen `Options` object; code reads `options()` (an attribute lookup, no
environment access on the hot path). Tests and benchmarks change them for a block with `override`::

    from ft_transformers.kernels.options import override
    with override(gemm_tma=False, efta_config=(64, 64, 4, 2)):
        ...

Host caches that depend on a switch put the `Options` object itself in their keys: it hashes by
identity (cheap on the hot path), and there is one object per set of values (`override` interns what
it makes), so a cached launch is found again under the same settings and never under others.

=================================  ===========================  ============================================
variable                           field                        meaning
=================================  ===========================  ============================================
``FTT_DIRECT_LAUNCH=0``            ``direct_launch``            every launch through Triton's own ``run``
``FTT_EFTA_CONFIG=BM,BN,w,s``      ``efta_config``              one EFTA block config instead of autotuning
``FTT_EFTA_SPLIT=n``               ``efta_split``               split-key decode into n programs per block
``FTT_EFTA_FOLD=0/1``              ``efta_fold``                EFTA's exponent as one FFMA: off / on
``FTT_EFTA_TWO_LAUNCH=0``          ``efta_two_launch``          correction repairs in the clean pass's launch
``FTT_EFTA_TMA=0/1``                ``efta_tma``                 EFTA's prefill key loop reads K and V through
                                                                tensor descriptors: never / where possible
                                                                (auto: never, until its timings set a rule)
``FTT_ABFT_GEMM_CONFIG=BM,BN,BK,w,s`` ``gemm_config``           one checked-GEMM config instead of tuning
``FTT_ABFT_GEMM_TUNE=0``           ``gemm_tune``                the first candidate config, no timing
``FTT_ABFT_GEMM_TMA=0/1``          ``gemm_tma``                 tiles through pointers / TMA descriptors
``FTT_ABFT_GEMM_SPLIT=n``          ``gemm_split``               decode calls split K over n programs
``FTT_ABFT_GEMM_DECODE_ROWS=n``    ``gemm_decode_rows``         the decode kernel for calls of up to n rows
                                                                (several row blocks; default 16, one)
``FTT_ABFT_GEMM_PERSISTENT=0/1``   ``gemm_persistent``          never / always the persistent form
``FTT_ABFT_GEMM_CUBLAS=0/1``       ``gemm_cublas``              never / always the cuBLAS form (auto: CUDA
                                                                calls of M > 16 by `forms.cublas_auto`)
``FTT_ABFT_GEMM_FUSED=0/1``        ``gemm_fused``               the tile and persistent forms' group checksums
                                                                in the verification's launch / as checksum
                                                                programs of the GEMM's (auto: fp16/bf16 calls
                                                                of K ≥ 4096 or M ≤ 512)
``FTT_GEMM_XVAR=0/1``              ``gemm_xvar``                x's row variance in the checked GEMM's group
                                                                threshold: the bound / the outlier estimate
                                                                (auto: where the device's e_max table has
                                                                its entry, `gemm_checksums.xvar_in_use`)
``FTT_SIBLINGS=0``                 ``siblings``                 one checked launch per Linear, not per group
``FTT_KV_TABLES=0/1``              ``kv_tables``                a protected model's KV caches keep EFTA's
                                                                checksum tables: off / on (auto: CPU and CUDA)
``FTT_TUNE_CACHE=0``               ``tune_cache_dir``           no tuning results kept across processes
``FTT_CACHE_DIR=path``             ``tune_cache_dir``           where they are kept (`abft_gemm.tune_store`)
=================================  ===========================  ============================================

``None`` means "chosen per call" (the default); ``auto`` in a variable means the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping

__all__ = ["Options", "options", "override"]


def _ints(name: str, raw: str, n: int, form: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in raw.split(","))
    except ValueError:
        vals = ()
    if len(vals) != n or min(vals) <= 0:
        raise ValueError(f"{name} must be '{form}' (positive integers), got {raw!r}")
    return vals


def _switch(name: str, raw: str) -> bool | None:
    if raw in ("", "auto"):
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0, 1 or auto, got {raw!r}")
    return raw == "1"


def _count(name: str, raw: str) -> int | None:
    if raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name} must be a positive integer, got {raw!r}")
    return n


@dataclasses.dataclass(frozen=True, eq=False)
class Options:
    """The diagnostic switches (module docstring). Hashes by identity: a cache key, one per `override`."""

    direct_launch: bool = True
    efta_config: tuple[int, int, int, int] | None = None  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    efta_split: int | None = None
    efta_fold: bool | None = None
    efta_two_launch: bool = True
    efta_tma: bool | None = None  # `kernels.efta.configs._tma`
    gemm_config: tuple[int, int, int, int, int] | None = None  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    gemm_tune: bool = True
    gemm_tma: bool | None = None
    gemm_split: int | None = None
    gemm_decode_rows: int | None = None  # `abft_gemm.forms.grouped`
    gemm_persistent: bool | None = None
    gemm_cublas: bool | None = None  # the cuBLAS form of the checked GEMM (`abft_gemm.forms.cublas_ok`)
    gemm_xvar: bool | None = None  # `gemm_checksums.xvar_in_use`
    gemm_fused: bool | None = None  # the checksum tiles in the GEMM's launch (`abft_gemm.forms.fused_ok`)
    siblings: bool = True
    kv_tables: bool | None = None  # `ft_transformers.kv_checksums` tracking of a protected model's caches
    tune_cache_dir: str | None = None  # the checked GEMM's tuning store (None: off)

    def __post_init__(self) -> None:
        for f, n in (("efta_config", 4), ("gemm_config", 5)):
            v = getattr(self, f)
            if v is not None:
                v = tuple(int(x) for x in v)
                if len(v) != n or min(v) <= 0:
                    raise ValueError(f"{f} must be {n} positive integers, got {getattr(self, f)!r}")
                object.__setattr__(self, f, v)
        for f in ("efta_split", "gemm_split", "gemm_decode_rows"):
            v = getattr(self, f)
            if v is not None and (int(v) != v or v < 1):
                raise ValueError(f"{f} must be a positive integer or None, got {v!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> Options:
        """The switches as the ``FTT_*`` variables of ``env`` set them (unset: the default)."""

        def get(name: str) -> str:
            return env.get(name, "").strip()

        kw: dict[str, object] = {}
        if (raw := get("FTT_EFTA_CONFIG")):
            kw["efta_config"] = _ints("FTT_EFTA_CONFIG", raw, 4, "BLOCK_M,BLOCK_N,num_warps,num_stages")
        if (raw := get("FTT_ABFT_GEMM_CONFIG")):
            kw["gemm_config"] = _ints("FTT_ABFT_GEMM_CONFIG", raw, 5, "BLOCK_M,BLOCK_N,BLOCK_K,num_warps,num_stages")
        for name, field in (("FTT_EFTA_SPLIT", "efta_split"), ("FTT_ABFT_GEMM_SPLIT", "gemm_split"),
                            ("FTT_ABFT_GEMM_DECODE_ROWS", "gemm_decode_rows")):
            kw[field] = _count(name, get(name))
        for name, field in (("FTT_EFTA_FOLD", "efta_fold"), ("FTT_EFTA_TMA", "efta_tma"),
                            ("FTT_ABFT_GEMM_TMA", "gemm_tma"), ("FTT_ABFT_GEMM_PERSISTENT", "gemm_persistent"),
                            ("FTT_ABFT_GEMM_CUBLAS", "gemm_cublas"), ("FTT_KV_TABLES", "kv_tables"),
                            ("FTT_GEMM_XVAR", "gemm_xvar"), ("FTT_ABFT_GEMM_FUSED", "gemm_fused")):
            kw[field] = _switch(name, get(name))
        for name, field in (("FTT_DIRECT_LAUNCH", "direct_launch"), ("FTT_EFTA_TWO_LAUNCH", "efta_two_launch"),
                            ("FTT_ABFT_GEMM_TUNE", "gemm_tune"), ("FTT_SIBLINGS", "siblings")):
            kw[field] = get(name) != "0"  # on unless switched off
        if get("FTT_TUNE_CACHE") != "0":
            xdg = get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            kw["tune_cache_dir"] = get("FTT_CACHE_DIR") or os.path.join(xdg, "ft_transformers")
        return cls(**kw)


_INTERNED: dict[tuple, Options] = {}


def _interned(opts: Options) -> Options:
    """The one `Options` object with these values: equal settings give the same object, so caches keyed
    on it hit again when a block's `override` ends or repeats (its hash stays an identity hash)."""
    return _INTERNED.setdefault(dataclasses.astuple(opts), opts)


_current = _interned(Options.from_env())


def options() -> Options:
    """The switches in force now."""
    return _current


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Options]:
    """Change some switches for the block (fields of `Options`); the previous ones come back after."""
    global _current
    previous = _current
    _current = _interned(dataclasses.replace(previous, **changes))
    try:
        yield _current
    finally:
        _current = previous
