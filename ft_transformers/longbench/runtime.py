"""What a LongBench run is recorded with and runs on: the software `versions`; `load_model`, an
eval-mode ``AutoModelForCausalLM`` placed on one device or spread over GPUs; and `require`, the
import of an optional dependency that names the ``longbench`` extra when it is missing."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def versions() -> dict[str, str]:
    """Versions of python, torch, transformers, ft_transformers and triton (where installed), and of
    CUDA and cuDNN on a CUDA build."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "ft_transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:  # pragma: no cover - a partial environment still gets its other versions
            pass
    try:  # from the metadata: importing triton here would fix its interpreter setting too early
        out["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        pass
    if torch.version.cuda and torch.cuda.is_available():
        out["CUDA"] = torch.version.cuda
        out["cuDNN"] = str(torch.backends.cudnn.version())
    return out


def load_model(path: str, *, dtype: torch.dtype, attn_implementation: str = "sdpa", device: str | None = None,
               device_map: str | None = None, max_memory: dict | None = None, **from_pretrained):
    """An eval-mode ``AutoModelForCausalLM.from_pretrained(path)``.

    ``device_map`` (with ``max_memory``) spreads the model over the GPUs; without it the model goes
    to ``device`` (None: where ``from_pretrained`` put it). Further keywords go to ``from_pretrained``."""
    from transformers import AutoModelForCausalLM

    extra: dict = {"device_map": device_map} if device_map else {}
    if device_map and max_memory:
        extra["max_memory"] = max_memory
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 **from_pretrained, **extra)
    if not device_map and device is not None:
        model = model.to(device)
    return model.eval()


def require(module: str, purpose: str):
    """``import module``, or an ImportError that names the ``longbench`` extra which installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{purpose} needs the `{module}` package: pip install 'ft-transformers[longbench]'") from e
