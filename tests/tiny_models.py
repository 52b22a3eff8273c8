"""Tiny random-init models of the five families, from their real configs shrunk.

Shapes follow the published configs (gpt2, bert-base-uncased, t5-small, Qwen2-0.5B,
Llama-3.2-1B / SmolLM2) with fewer layers, narrower hidden sizes and a small vocabulary.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    Qwen2Config,
    T5Config,
)

VOCAB = 512


def gpt2_config() -> GPT2Config:
    # gpt2: n_layer 12, n_embd 768, n_head 12, gelu_new, layer_norm_epsilon 1e-5
    return GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=128, n_layer=2, n_head=4,
                      activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)


def bert_config() -> BertConfig:
    # bert-base-uncased: 12 layers, hidden 768, 12 heads, intermediate 3072, gelu
    return BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=256, max_position_embeddings=128, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_token_id=0)


def t5_config() -> T5Config:
    # t5-small: d_model 512, d_kv 64, d_ff 2048, 6+6 layers, 8 heads, 32 relative buckets
    return T5Config(vocab_size=VOCAB, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2,
                    num_heads=4, relative_attention_num_buckets=32, relative_attention_max_distance=128,
                    dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def qwen2_config(sliding: bool = True) -> Qwen2Config:
    # Qwen2-0.5B: hidden 896, 14 heads, 2 kv heads, intermediate 4864, 24 layers, rope_theta 1e6
    return Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rope_theta=1e6, use_sliding_window=sliding, sliding_window=6 if sliding else None,
                       max_window_layers=1, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)


def llama_config() -> LlamaConfig:
    # SmolLM2-135M / Llama: hidden 576, 9 heads, 3 kv heads, head_dim 64, silu MLP
    return LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


FAMILIES = {
    "gpt2": (gpt2_config, AutoModelForCausalLM),
    "bert": (bert_config, AutoModel),
    "t5": (t5_config, AutoModelForSeq2SeqLM),
    "qwen2": (qwen2_config, AutoModelForCausalLM),
    "llama": (llama_config, AutoModelForCausalLM),
}


def make_model(family: str, attn: str = "eager", seed: int = 0, dtype: torch.dtype = torch.float32):
    cfg_fn, auto = FAMILIES[family]
    torch.manual_seed(seed)
    cfg = cfg_fn()
    model = auto.from_config(cfg, attn_implementation=attn, dtype=dtype)
    # Random init with std 0.02 gives near-uniform attention; widen it so that attention matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name and "wte" not in name and "shared" not in name:
                p.normal_(0.0, 0.08)
    return model.eval()


def padded_batch(seed: int = 0, lengths: tuple[int, ...] = (12, 7), left: bool = True):
    """input_ids (B, S) and attention_mask (B, S) with padding on the left (or right)."""
    g = torch.Generator().manual_seed(seed)
    S = max(lengths)
    ids = torch.zeros(len(lengths), S, dtype=torch.long)
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        sl = slice(S - n, S) if left else slice(0, n)
        ids[b, sl] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[b, sl] = 1
    return ids, mask


# -- families protected through discovery: even smaller (hidden 64, 2 layers, vocab 100) ---------------
SMALL_VOCAB = 100
_DEC = dict(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1,
            eos_token_id=2, pad_token_id=0)


def _cfg(cls_name: str, **kw):
    import transformers  # noqa: PLC0415 (config classes looked up by name)

    return getattr(transformers, cls_name)(**kw)


def small_configs() -> dict:
    """model name -> (config, auto class) for the families discovery serves, each a few-MB model."""
    llama3_rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                       high_freq_factor=4.0, original_max_position_embeddings=64)
    moe = dict(num_experts_per_tok=2)
    two = ["sliding_attention", "full_attention"]
    causal = {
        "llama3": _cfg("LlamaConfig", **_DEC, rope_scaling=llama3_rope),
        "mistral": _cfg("MistralConfig", **_DEC, head_dim=16, sliding_window=6),
        "mixtral": _cfg("MixtralConfig", **_DEC, num_local_experts=4, **moe),
        "qwen2": _cfg("Qwen2Config", **_DEC, use_sliding_window=True, sliding_window=6, max_window_layers=1),
        "qwen3": _cfg("Qwen3Config", **_DEC, head_dim=16),
        "qwen2_moe": _cfg("Qwen2MoeConfig", **_DEC, num_experts=4, moe_intermediate_size=32,
                          shared_expert_intermediate_size=64, **moe),
        "gemma": _cfg("GemmaConfig", **_DEC, head_dim=16),
        "gemma2": _cfg("Gemma2Config", **_DEC, head_dim=16, sliding_window=6, layer_types=two,
                       attn_logit_softcapping=None),
        "gemma3": _cfg("Gemma3TextConfig", **_DEC, head_dim=16, sliding_window=6, layer_types=two),
        "phi3": _cfg("Phi3Config", **_DEC),
        "gpt_neox": _cfg("GPTNeoXConfig", vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "opt": _cfg("OPTConfig", vocab_size=SMALL_VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=128, word_embed_proj_dim=64,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, dropout=0.0, attention_dropout=0.0),
        "gpt2": _cfg("GPT2Config", vocab_size=SMALL_VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0),
    }
    enc = dict(vocab_size=SMALL_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=128, max_position_embeddings=130, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0, pad_token_id=0)
    out = {k: (c, AutoModelForCausalLM) for k, c in causal.items()}
    out["bert"] = (_cfg("BertConfig", **enc), AutoModel)
    out["roberta"] = (_cfg("RobertaConfig", **enc, bos_token_id=1, eos_token_id=2), AutoModel)
    out["t5"] = (_cfg("T5Config", vocab_size=SMALL_VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                      num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=16,
                      relative_attention_max_distance=64, dropout_rate=0.0, decoder_start_token_id=0,
                      pad_token_id=0, eos_token_id=1), AutoModelForSeq2SeqLM)
    return out


def make_small(name: str, attn: str = "eager", seed: int = 0, **overrides):
    """A random-init model of `small_configs` ``name`` in eval mode (weights widened: std 0.08)."""
    cfg, auto = small_configs()[name]
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = auto.from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2 and "embed" not in pname and "wte" not in pname and "shared" not in pname:
                p.normal_(0.0, 0.08)
    return model.eval()
