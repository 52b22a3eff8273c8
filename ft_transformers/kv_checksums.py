"""EFTA's checksum tables of a KV cache, made when tokens enter the cache and reused by every later call.

A decode step's attention reads the whole cache; with tables made per call, every step sums the whole
cache again (the kernels' pre-pass), and a fault that strikes a stored entry between steps enters those
tables too, so no check can see it. `KVChecksums` keeps the tables of one cache layer instead: each
update adds the new tokens' terms to the tables (the blocks they enter; the entries written before are
not read again), and each attention call over that cache reads them, skipping the pre-pass. A flip of a
stored K or V entry since (the ``attn.kv_cache`` site) then fails step 1 or step 7 and, located, is
corrected in the output (``docs/algorithms.md``, "Stored checksum tables").

`track_kv_cache` keeps tables for the layers of a transformers ``Cache`` (``DynamicCache``,
``StaticCache``, and both halves of an ``EncoderDecoderCache``; the layers whose ``update`` is
``DynamicLayer``'s or ``StaticLayer``'s). It wraps the cache's ``update`` and the layers' ``crop`` and
``reset``, and tags the key tensor an update returns, which the attention function receives: the
``"efta"`` attention finds the tables there (`kv_checksums_of`).

Tables are never used stale. A call gets them only while the key and value tensors are the ones the last
update returned, unchanged since (same objects, same version counters, same shape); otherwise it makes
its own tables, as without a cache. An update extends the tables only when the cache held, before it,
exactly what the tables describe; otherwise the tables are rebuilt from the cache's content where that
is sound (nothing past the written tokens, or zeros there: a dynamic layer, a static layer after
``reset``), and stay unused until then otherwise (a static layer after ``crop``, a static layer first
seen already filled). A rebuild reads the cache as it is then. Under ``torch.compile`` updates are not
extended: a cache updated there is marked, and its tables are rebuilt (dynamic) or wait for ``reset``
(static). Tensors made under ``torch.inference_mode`` carry no version counter; for them the check is
by identity and shape only (in-place writes by code other than the cache's own go unseen).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from .efta_reference.stored import ReferenceTables
from .kernels.contract import kernel_head_dim, site_shape
from .kernels.gemm_checksums import tensor_version

__all__ = ["KVChecksums", "flip_kv_cache", "kv_checksums_of", "track_forward_cache", "track_kv_cache",
           "untrack_kv_cache"]

_TAG = "_ftt_kv"  # attribute of a cache layer and of the key tensor its update returned
_FORMS = ("auto", "triton", "reference")


def _triton_tables() -> Any:
    """`kernels.efta.CacheTables`, or None where triton does not import."""
    try:
        from .kernels.efta import CacheTables
    except ImportError:
        return None
    return CacheTables


class KVChecksums:
    """The checksum tables of one KV cache (B, Hkv, N, D), made as tokens are written to it.

    Args:
        backend: the tables' form: ``"triton"`` (the kernel's, `kernels.efta.CacheTables`),
            ``"reference"`` (`efta_reference.stored.ReferenceTables`), or ``"auto"``: the kernel's for a
            CUDA cache whose head dim the kernel handles (16–128, a multiple of 16), the reference's
            otherwise. A call whose backend reads the other form makes its own tables.
        zero_tail: the cache's slots past the tokens written so far hold zeros (a fresh or reset static
            cache; a dynamic cache has none): the tables may then be built from the cache's content.

    ``stored_calls`` / ``own_calls`` count the attention calls that read these tables and those that made
    their own (stale tables, another form); host-side ints.
    """

    def __init__(self, backend: str = "auto", *, zero_tail: bool = True, owner: Any = None) -> None:
        if backend not in _FORMS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, _FORMS))}, got {backend!r}")
        self.backend = backend
        self.form: str | None = None  # "triton" or "reference" once built
        self.n = 0  # tokens written
        self.stored_calls = 0
        self.own_calls = 0
        self._impl: Any = None
        self._layout: tuple | None = None  # (B, Hkv, D, dtype, device)
        self._valid = False
        self._zero_tail = zero_tail
        self._stamp: tuple | None = None
        self._owner = owner  # a tracked cache's `_Tracking` (its ``compiled`` flag), or None

    @property
    def valid(self) -> bool:
        """Whether the tables describe the cache as its last update left it."""
        return self._valid

    # -- what the cache's owner reports --------------------------------------------------------------

    def extend(self, keys: torch.Tensor, values: torch.Tensor, start: int, count: int) -> bool:
        """``count`` tokens were just written at [start, start + count) of the cache ``keys``, ``values``
        (B, Hkv, N, D), the whole cache (a static cache's whole buffer).

        Extends the tables when they describe tokens [0, start) of this cache; else builds them from the
        cache's content when nothing lies past the written tokens (N = start + count) or zeros do (see
        ``zero_tail``); else they stay invalid until `reset`. Returns whether they are valid.
        """
        end = start + count
        N = keys.shape[2]
        layout = (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype, keys.device)
        if count == 0:  # nothing written: the same cache (a new tensor, maybe)
            if self._valid and start == self.n and layout == self._layout and N == self._stamp[4][2]:
                self.restamp(keys, values)
                return True
            return False
        try:
            if self._valid and start == self.n and layout == self._layout and end <= N:
                self._impl.append(keys, values, start, count)
            elif end == N or (self._zero_tail and end <= N):
                self._build(keys, values, end)
            else:
                self.invalidate()
                return False
        except ValueError:  # a cache the tables' form cannot hold (e.g. a head dim the kernel does not take)
            self.invalidate()
            return False
        self.n, self._layout, self._valid = end, layout, True
        self.restamp(keys, values)
        return True

    def _build(self, keys: torch.Tensor, values: torch.Tensor, filled: int) -> None:
        D = keys.shape[3]
        kernel_form = self.backend == "triton" or (
            self.backend == "auto" and keys.is_cuda and kernel_head_dim(D))
        tables = _triton_tables() if kernel_form else None
        if tables is None and self.backend == "triton":
            raise ImportError("KVChecksums(backend='triton') needs ft_transformers.kernels.efta (triton)")
        self.form = "triton" if tables is not None else "reference"
        self._impl = tables() if tables is not None else ReferenceTables()
        self._impl.build(keys, values, filled)

    def invalidate(self) -> None:
        """The cache changed in a way the tables do not follow: they stay unused until `reset` or a rebuild."""
        self._valid = False
        self._zero_tail = False
        self._stamp = None

    def reset(self) -> None:
        """The cache was emptied (a static cache's slots zeroed): the next update builds the tables afresh."""
        self._valid = False
        self._zero_tail = True
        self._stamp = None
        self.n = 0

    def restamp(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Record ``keys``, ``values`` as the cache the tables describe (their identity, version and shape)."""
        self._stamp = (weakref.ref(keys), tensor_version(keys), weakref.ref(values), tensor_version(values),
                       tuple(keys.shape), tuple(values.shape))

    # -- what an attention call asks --------------------------------------------------------------

    def current(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether the tables describe ``keys``, ``values`` as they are now."""
        st = self._stamp
        if self._owner is not None and self._owner.compiled:  # updated under torch.compile since
            return False
        return (self._valid and st is not None and st[0]() is keys and st[2]() is values
                and st[1] == tensor_version(keys) and st[3] == tensor_version(values)
                and st[4] == tuple(keys.shape) and st[5] == tuple(values.shape))

    def tables(self, keys: torch.Tensor, values: torch.Tensor, form: str) -> Any:
        """The tables for an attention call over ``keys``, ``values`` whose backend reads ``form``
        (``"triton"``: `kernels.efta.StoredTables`; ``"reference"``: `StoredReference`), or None: the
        call makes its own (counted in ``own_calls``)."""
        if self.form != form or not self.current(keys, values):
            self.own_calls += 1
            return None
        self.stored_calls += 1
        return self._impl.tables if form == "triton" else self._impl.view(keys.shape[2])


def kv_checksums_of(key: torch.Tensor) -> KVChecksums | None:
    """The tables a tracked cache's update attached to the key tensor it returned, or None."""
    return getattr(key, _TAG, None)


# ------------------------------------------------------------------------------------------------
# transformers caches
# ------------------------------------------------------------------------------------------------


@functools.cache
def _appending_updates() -> dict:
    from transformers.cache_utils import DynamicLayer, StaticLayer

    return {DynamicLayer.update: "dynamic", StaticLayer.update: "static"}


def _layer_kind(layer: Any) -> str | None:
    """"dynamic" / "static" for layers whose update appends like DynamicLayer's / StaticLayer's, else None
    (read at every cache update: the classes are looked up once)."""
    return _appending_updates().get(getattr(type(layer), "update", None))


class _Tracking:
    """A tracked cache's state: the tables' form, the original ``update``, whether an update ran under
    ``torch.compile`` (untracked there; set as a side effect that the compiled code replays)."""

    def __init__(self, backend: str, update: Any) -> None:
        self.backend = backend
        self.update = update
        self.compiled = False


def track_kv_cache(cache: Any, backend: str = "auto") -> Any:
    """Keep EFTA checksum tables for the layers of a transformers ``Cache``, made as tokens enter it.

    Args:
        cache: a ``DynamicCache``, ``StaticCache`` or ``EncoderDecoderCache`` (both halves are tracked;
            a cross-attention cache written once serves every step from its tables); its layers whose
            ``update`` is ``DynamicLayer``'s or ``StaticLayer``'s get tables (sliding-window, quantized
            and other layers make theirs per call).
        backend: the tables' form (`KVChecksums`).
    Returns:
        ``cache`` itself (tracked in place; tracking it again changes nothing). `untrack_kv_cache` undoes it.
    """
    if backend not in _FORMS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, _FORMS))}, got {backend!r}")
    if torch.compiler.is_compiling():  # (a compiled forward's caches are updated untracked anyway)
        return cache
    for part in ("self_attention_cache", "cross_attention_cache"):
        sub = getattr(cache, part, None)
        if sub is not None:
            track_kv_cache(sub, backend)
    if not hasattr(cache, "layers") or "_ftt_tracking" in vars(cache):
        return cache
    tracking = _Tracking(backend, cache.update)
    cache._ftt_tracking = tracking
    cache.update = functools.partial(_tracked_update, cache, tracking)
    return cache


def track_forward_cache(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook (``register_forward_pre_hook(track_forward_cache, with_kwargs=True)`` on a
    model): tracks the cache the forward is given (`track_kv_cache`; the keyword ``cache``, or
    ``past_key_values`` in transformers releases before the rename), so that ``generate`` decodes on
    stored tables."""
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is not None and hasattr(cache, "update"):
        track_kv_cache(cache)


def untrack_kv_cache(cache: Any) -> Any:
    """Undo `track_kv_cache`: the cache's and its layers' own methods back, the tables dropped."""
    for part in ("self_attention_cache", "cross_attention_cache"):
        sub = getattr(cache, part, None)
        if sub is not None:
            untrack_kv_cache(sub)
    tracking = vars(cache).pop("_ftt_tracking", None)
    if tracking is None:
        return cache
    del cache.update
    for layer in getattr(cache, "layers", ()):
        if vars(layer).pop(_TAG, None) is not None:
            for name in ("crop", "reset"):
                vars(layer).pop(name, None)
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor) and _TAG in vars(t):
                delattr(t, _TAG)
    return cache


def _tracked_update(cache: Any, tracking: _Tracking, key_states: torch.Tensor, value_states: torch.Tensor,
                    layer_idx: int, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache.update`` of a tracked cache: the update, then the layer's tables extended (or rebuilt)."""
    if torch.compiler.is_compiling():
        tracking.compiled = True
        return tracking.update(key_states, value_states, layer_idx, *args, **kwargs)
    layers = cache.layers
    if tracking.compiled:  # updated under torch.compile: no layer's tables describe its cache now
        for lay in layers:
            if _TAG in vars(lay):
                vars(lay)[_TAG].invalidate()
        tracking.compiled = False
    layer = layers[layer_idx] if layer_idx < len(layers) else None
    fresh = layer is None or not getattr(layer, "is_initialized", False)
    kvc = vars(layer).get(_TAG) if layer is not None else None
    intact = kvc is not None and kvc.current(layer.keys, layer.values)
    keys, values = tracking.update(key_states, value_states, layer_idx, *args, **kwargs)
    layer = cache.layers[layer_idx]
    kind = _layer_kind(layer)
    if kind is None or keys is not layer.keys or values is not layer.values:  # not a whole-cache append
        if kvc is not None:
            kvc.invalidate()
        return keys, values
    if kvc is None or vars(layer).get(_TAG) is not kvc:
        kvc = KVChecksums(tracking.backend, zero_tail=kind == "dynamic" or fresh, owner=tracking)
        _attach(layer, kvc)
    elif kvc.valid and not intact:  # the cache changed behind the tables since the last update
        kvc.invalidate()
    count = key_states.shape[-2]
    start = keys.shape[-2] - count if kind == "dynamic" else kvc.n  # a static layer writes at its length
    kvc.extend(keys, values, start, count)
    setattr(keys, _TAG, kvc)
    return keys, values


def _attach(layer: Any, kvc: KVChecksums) -> None:
    """Give ``layer`` its tables and wrap its ``crop`` (the tables then stay unused until ``reset``; a
    dynamic layer's are rebuilt at its next update) and ``reset`` (the next update builds them afresh),
    where the layer has them."""
    setattr(layer, _TAG, kvc)
    for name, then in (("crop", kvc.invalidate), ("reset", kvc.reset)):
        method = getattr(layer, name, None)
        if method is not None:
            setattr(layer, name, functools.partial(_then, method, then))


def _then(method: Any, then: Any, *args, **kwargs) -> Any:
    out = method(*args, **kwargs)
    then()
    return out


def flip_kv_cache(plan: Any, keys: torch.Tensor, values: torch.Tensor, kvc: KVChecksums | None) -> None:
    """The ``attn.kv_cache`` faults of ``plan`` (a `FaultPlan`) for one attention call: bits of stored
    entries of ``keys``, ``values`` (B, Hkv, N, D) flipped in place, before the call reads them, as a soft
    error in the cache's memory between two steps would; they stay there for later calls. Site shape
    (B, Hkv, N, 2·D) (`contract.site_shape`), bits of the cache's dtype. A flip is not a write the tables
    follow: tables that described the cache before it still do (re-stamped), so the checks see the flip."""
    B, Hkv, N, D = keys.shape
    sf = plan.for_site("attn.kv_cache", site_shape("attn.kv_cache", B, 0, 0, N, D, 0, Hkv=Hkv), keys.dtype,
                       keys.device)
    if sf is None:
        return
    kv = torch.cat([keys, values], dim=-1)
    out = sf.apply(kv, dim=-1, start=0)
    if out is kv:
        return
    current = kvc is not None and kvc.current(keys, values)
    with torch.inference_mode(keys.is_inference()):
        keys.copy_(out[..., :D])
        values.copy_(out[..., D:])
    if current:
        kvc.restamp(keys, values)
