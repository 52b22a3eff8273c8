"""The models a campaign runs on: random tiny models (no download, a byte-level toy tokenizer) or a
real causal LM (the embedded SmolLM2, a local path, a ``.gguf`` file or a hub id), and prompt encoding.

The tiny models are part of the CLI (``--model tiny-llama`` and the ``*-config`` shapes run where
no weights can be downloaded, e.g. a GPU host without network), so they live here and not in tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TINY_MODELS = ("tiny-llama", "tiny-gpt2", "qwen2-0.5b-config", "gpt2-124m-config")  # random init, no download


class ToyTokenizer:
    """Byte-level stand-in tokenizer for the random tiny models (ids 3..vocab-1, no chat template)."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = None

    def __init__(self, vocab: int = 512) -> None:
        self.vocab = vocab

    def __call__(self, text: str, return_tensors: str = "pt") -> dict:
        ids = [3 + (b % (self.vocab - 3)) for b in text.encode()]
        return {"input_ids": torch.tensor([ids], dtype=torch.long)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def _tiny_model(name: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    vocab = 512
    widen = True
    if name == "tiny-llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          bos_token_id=1, eos_token_id=None, pad_token_id=0)
    elif name == "tiny-gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=256, n_embd=128, n_layer=2, n_head=4,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=None,
                         pad_token_id=0)
    elif name == "qwen2-0.5b-config":  # Qwen2-0.5B's shapes (GQA 14:2, head dim 64); default init
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        vocab = cfg.vocab_size
        widen = False  # at hidden size 896 the default std 0.02 already gives peaked attention
    elif name == "gpt2-124m-config":  # GPT-2 small's shapes (12 layers, 12 heads, hidden 768); default init
        cfg = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=None, pad_token_id=0)
        vocab = cfg.vocab_size
        widen = False
    else:
        raise ValueError(f"unknown tiny model {name!r}; choose from {', '.join(TINY_MODELS)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="efta", dtype=dtype)
    with torch.no_grad():  # std 0.02 gives near-uniform attention in the tiny models; widen it there
        for pname, p in model.named_parameters():
            if widen and p.dim() == 2 and "embed" not in pname and "wte" not in pname:
                p.normal_(0.0, 0.08)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), ToyTokenizer(vocab)


def load_model(name: str, dtype: str = "float32", device: str = "cpu"):
    """``(model, tokenizer)`` with attention on EFTA: a tiny random model, the embedded SmolLM2,
    a local path, a ``.gguf`` file or a hub id."""
    tdt = getattr(torch, dtype)
    if name in TINY_MODELS:
        model, tok = _tiny_model(name, tdt)
        return model.to(device), tok
    from ..embedded import load_causal_lm

    return load_causal_lm(name, dtype=tdt, attn_implementation="efta", device=device)


def encode_prompt(tok, prompt: str, chat_template: bool) -> torch.Tensor:
    if chat_template and getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(prompt, return_tensors="pt")["input_ids"]
