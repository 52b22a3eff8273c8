"""What the scripts share: the provenance a result is written with, and loading a causal LM for
fixed-length greedy generation.

Scripts import it as a top-level module (``from _common import ...``): a script run as a file has
``scripts/`` on ``sys.path`` already, and the ``longbench`` package and the tests put it there.
"""

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


def device_label(device: torch.device | str | None = None) -> str:
    """The device results were measured on, in words; ``None``: the first GPU if there is one, else the CPU."""
    if device is None:
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return (f"{torch.cuda.get_device_name(device)} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                f"{p.total_memory / 2**30:.0f} GiB)")
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def environment(device: torch.device | str | None = None) -> str:
    """Two lines for the head of a result file: ``device: ...`` and the `versions`."""
    return f"device: {device_label(device)}\n" + ", ".join(f"{k} {v}" for k, v in versions().items())


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


def fixed_length(model):
    """Set ``model``'s generation config to greedy generation of exactly the requested length: no
    end-of-sequence token, pad id 0, no sampling settings (they would only warn). Returns ``model``."""
    gc = model.generation_config
    gc.eos_token_id = None
    gc.pad_token_id = 0
    gc.do_sample = False
    for attr in ("temperature", "top_p", "top_k"):
        if hasattr(gc, attr):
            setattr(gc, attr, None)
    return model

