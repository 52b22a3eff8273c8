"""Which modules of a model protection manages, found from the model itself.

* **Attention**: a module whose class's ``forward`` looks up transformers' attention interface
  (``ALL_ATTENTION_FUNCTIONS``): that is the call ``attn_implementation="efta"`` reroutes, with the
  module itself as the interface's ``module`` argument, so it is where EFTA runs and reports.
* **Checked GEMMs**: every module whose type is exactly ``nn.Linear`` (weight (N, K)) or GPT-2's
  ``Conv1D`` (weight (K, N)).
* **Siblings** (`ft_transformers.siblings`): in a module's ``forward``, the calls
  ``self.<linear>(<first argument>)`` made unconditionally, when two or more Linear children read
  that argument unchanged (Q/K/V, gate/up). A wrong guess costs time only: a sibling whose input is
  not the parked one runs its own checked GEMM.
* **Layer index**: the first all-digit component of the module's qualified name
  (``model.layers.3.self_attn`` → 3; T5's ``encoder.block.1.layer.0.SelfAttention`` → 1), -1 outside.

What discovery cannot see is registered per family (`ft_transformers.patches`, `register_family`).
Parameters that feed a product outside these modules (MoE experts stored as fused 3-D tensors, a
router's bare weight) run unchecked: they are listed in `ModelLayout.unchecked`, and
`enable_fault_tolerance` warns about them.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import warnings

import torch
from transformers.pytorch_utils import Conv1D

from .patches import FamilyAdapter, adapter_for

__all__ = ["ModelLayout", "discover", "warn_unchecked"]

_INTERFACE = "ALL_ATTENTION_FUNCTIONS"
# Attention settings EFTA does not compute: (module or config attribute, what it is).
_REFUSED = (("attn_logit_softcapping", "attention logit softcapping (tanh on the scores)"),)


def _code_names(code) -> set[str]:
    """Global and attribute names a code object refers to, nested functions included."""
    names = set(code.co_names)
    for c in code.co_consts:
        if inspect.iscode(c):
            names |= _code_names(c)
    return names


@functools.cache
def calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` dispatches through transformers' attention interface."""
    fn = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(fn, "__code__", None)
    return code is not None and _INTERFACE in _code_names(code)


def _class(module: torch.nn.Module) -> type:
    """The module's class; under protection, the class it had before (``_ftt_base`` of the swapped one)."""
    return type(module).__dict__.get("_ftt_base", type(module))


def linear_layout(module: torch.nn.Module) -> str | None:
    """``"nk"`` for ``nn.Linear`` (weight (N, K)), ``"kn"`` for GPT-2 ``Conv1D``, else None."""
    cls = _class(module)
    if cls is Conv1D:
        return "kn"
    if cls is torch.nn.Linear:
        return "nk"
    return None


def layer_of(name: str) -> int:
    """Transformer block index from a qualified module name (-1 outside the blocks)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return -1


_CONDITIONAL = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.BoolOp, ast.Lambda,
                ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ListComp, ast.SetComp, ast.DictComp,
                ast.GeneratorExp)


def _unconditional_calls(node: ast.AST):
    """The ``ast.Call`` nodes under ``node`` that run on every pass (not under if/loop/try/lambda)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _CONDITIONAL):
            continue
        if isinstance(child, ast.Call):
            yield child
        yield from _unconditional_calls(child)


@functools.cache
def _sibling_calls(cls: type) -> tuple[str, tuple[str, ...]] | None:
    """``(argument, attribute names)`` of the ``self.<attr>(<argument>)`` calls in ``cls.forward``
    that read its first argument unchanged, or None (no source, argument reassigned, fewer than two)."""
    try:
        src = textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))
        fdef = ast.parse(src).body[0]
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return None
    if not isinstance(fdef, ast.FunctionDef):
        return None
    params = [a.arg for a in (*fdef.args.posonlyargs, *fdef.args.args)]
    if len(params) < 2:
        return None
    self_name, arg = params[0], params[1]
    if any(isinstance(n, ast.Name) and n.id == arg and not isinstance(n.ctx, ast.Load) for n in ast.walk(fdef)):
        return None  # the argument is rebound somewhere: calls on it may read another tensor
    names: list[str] = []
    for call in _unconditional_calls(ast.Module(body=fdef.body, type_ignores=[])):
        f = call.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == self_name
                and len(call.args) == 1 and not call.keywords and isinstance(call.args[0], ast.Name)
                and call.args[0].id == arg and f.attr not in names):
            names.append(f.attr)
    return (arg, tuple(names)) if len(names) >= 2 else None


def _siblings_of(module: torch.nn.Module) -> tuple[str, str, tuple[str, ...]] | None:
    found = _sibling_calls(_class(module))
    if found is None:
        return None
    arg, names = found
    members = [n for n in names if linear_layout(getattr(module, n, None)) == "nk"]
    return (_class(module).__name__, arg, tuple(members)) if len(members) >= 2 else None


def _unchecked_reason(module: torch.nn.Module) -> str | None:
    """Why a module's weights feed a product no check covers, or None."""
    if linear_layout(module) is not None or isinstance(module, torch.nn.Embedding):
        return None
    if isinstance(module, (torch.nn.Linear, Conv1D)):
        return f"{type(module).__name__}, a subclass of {type(module).__mro__[1].__name__}, is not checked"
    shapes = [f"{n} {tuple(p.shape)}" for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
    if not shapes:
        return None
    return f"{type(module).__name__} computes with weights outside nn.Linear: {', '.join(shapes)}"


class ModelLayout:
    """What `enable_fault_tolerance` protects in one model (what `discover` found).

    Attributes:
        family: the registered family's name, or ``"discovered"``.
        siblings: ``(parent class name, input argument, Linear attribute names)`` per sibling group.
        unchecked: qualified module name -> why its product runs unchecked.
    """

    linear_layout = staticmethod(linear_layout)
    layer_of = staticmethod(layer_of)

    def __init__(self, family: str, attention: list[torch.nn.Module],
                 siblings: tuple[tuple[str, str, tuple[str, ...]], ...], unchecked: dict[str, str]) -> None:
        self.family = family
        self._attention = {id(m) for m in attention}
        self.siblings = siblings
        self.unchecked = unchecked

    def is_attention(self, module: torch.nn.Module) -> bool:
        return id(module) in self._attention


def _refusal(model: torch.nn.Module, attention: list[tuple[str, torch.nn.Module]]) -> str | None:
    for attr, what in _REFUSED:
        for name, m in attention:
            value = getattr(m, attr, None)
            if value is None:
                value = getattr(getattr(m, "config", None), attr, None)
            if value is not None:
                return f"{name} ({type(m).__name__}) uses {what}: {attr}={value!r}"
    return None


def discover(model: torch.nn.Module, *, require_attention: bool = True) -> ModelLayout:
    """Find the attention modules, checked GEMMs and sibling groups of ``model``.

    Raises:
        ValueError: ``require_attention`` and no module calls the attention interface (neither
            discovered nor named by a registered family), or the attention uses a feature EFTA does
            not compute (logit softcapping), or the registered family refuses the configuration.
    """
    config = getattr(model, "config", None)
    adapter: FamilyAdapter | None = adapter_for(model)
    extra = set(adapter.attention_classes) if adapter else set()
    attention, siblings, unchecked = [], {}, {}
    for name, module in model.named_modules():
        cls = _class(module)
        if cls.__name__ in extra or calls_attention_interface(cls):
            attention.append((name, module))
        if (reason := _unchecked_reason(module)) is not None:
            unchecked[name] = reason
        if cls.__name__ not in siblings and (group := _siblings_of(module)) is not None:
            siblings[cls.__name__] = group
    if adapter is not None:
        siblings.update({s[0]: s for s in adapter.siblings})
        reason = adapter.unsupported(config) if adapter.unsupported is not None else None
        if reason:
            raise ValueError(f"ft_transformers cannot protect this {adapter.family} model: {reason}")
    if require_attention and not attention:
        model_type = getattr(config, "model_type", None)
        raise ValueError(
            f"ft_transformers found no attention module in {type(model).__name__} (model_type {model_type!r}): "
            f"it protects modules whose forward calls transformers' attention interface ({_INTERFACE}), "
            "and none does here. For a custom model, name its attention classes with "
            "ft_transformers.register_family(model_types, attention_classes=...), or protect only its "
            "Linear layers with FTConfig(attention=False)")
    if require_attention and (why := _refusal(model, attention)):
        raise ValueError(f"ft_transformers cannot protect this model's attention: {why}. EFTA verifies the "
                         "raw scores and does not compute this; protect only the Linear layers with "
                         "FTConfig(attention=False) (attention then runs unprotected, as loaded)")
    return ModelLayout(adapter.family if adapter else "discovered", [m for _, m in attention],
                       tuple(siblings.values()), unchecked)


def warn_unchecked(unchecked: dict[str, str]) -> None:
    """One UserWarning naming the modules whose products protection does not check (none: silent)."""
    if not unchecked:
        return
    by_reason: dict[str, list[str]] = {}
    for name, why in unchecked.items():
        by_reason.setdefault(why, []).append(name)
    lines = [f"{len(names)}x {why} (e.g. {names[0]!r})" for why, names in by_reason.items()]
    warnings.warn(f"ft_transformers: {len(unchecked)} module(s) run UNCHECKED (their GEMMs have no "
                  "checksum; fault_report(model).unchecked lists them):\n  " + "\n  ".join(lines),
                  UserWarning, stacklevel=3)
