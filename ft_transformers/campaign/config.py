"""What a campaign is: its configuration, the outcome classes, and the bit layout faults are drawn from.

A `CampaignConfig` names the model, the prompts and the fault model (sites × bits or BERs); the
trials a campaign runs are drawn from it in `.trials`. The outcome vocabulary (`CLASSES`, `ARMS`) is
shared by the trials, the store and the reports.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from ..config import FTConfig
from ..kernels.contract import SITES

CLASSES: tuple[str, ...] = ("masked", "sdc", "detected_corrected", "detected_uncorrectable", "crash")
CLASS_LABELS: dict[str, str] = {
    "masked": "masked",
    "sdc": "SDC",
    "detected_corrected": "detected & corrected",
    "detected_uncorrectable": "detected, uncorrectable",
    "crash": "crash / non-finite",
}
ARMS: tuple[str, ...] = ("unprotected", "protected")
ARM_CONFIGS: dict[str, FTConfig] = {
    "unprotected": FTConfig(detect=False, correct=False, on_uncorrectable="ignore"),
    "protected": FTConfig(on_uncorrectable="ignore"),
}

DEFAULT_PROMPTS: tuple[dict, ...] = (  # short questions SmolLM2-135M-Instruct answers within ~10 tokens
    {"prompt": "What is the capital of France?", "answer": ["Paris"]},
    {"prompt": "What is the capital of Japan?", "answer": ["Tokyo"]},
    {"prompt": "What is the chemical symbol for gold?", "answer": ["Au"]},
    {"prompt": "Who painted the Mona Lisa?", "answer": ["Leonardo"]},
    {"prompt": "What is the largest ocean on Earth?", "answer": ["Pacific"]},
    {"prompt": "Who wrote Romeo and Juliet?", "answer": ["Shakespeare"]},
)


def bit_fields(dtype: torch.dtype) -> dict[str, tuple[int, ...]]:
    """``{"sign": bits, "exponent": bits, "mantissa": bits}`` of a float storage format (bit 0 = LSB)."""
    fi = torch.finfo(dtype)
    nbits = fi.bits
    mant = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7, torch.float64: 52}.get(dtype)
    if mant is None:
        raise TypeError(f"no bit layout for {dtype}")
    return {
        "sign": (nbits - 1,),
        "exponent": tuple(range(mant, nbits - 1)),
        "mantissa": tuple(range(mant)),
    }


def bit_class(bit: int, dtype: torch.dtype) -> str:
    """``"sign"``, ``"exponent"`` or ``"mantissa"`` for a bit of ``dtype``."""
    for name, bits in bit_fields(dtype).items():
        if bit in bits:
            return name
    raise ValueError(f"bit {bit} out of range for {dtype}")


def site_dtype(site: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage format of the values at a site: fp32 for attention, the GEMM output dtype for Linear."""
    return torch.float32 if site.startswith("attn.") else model_dtype


def parse_bits(tokens: Iterable[str | int]) -> list[str | int]:
    """Bit selectors: ``sign`` / ``exponent`` / ``mantissa`` (a bit drawn per trial), an int, or a
    range ``a-b`` (expanded to ints, both ends included)."""
    out: list[str | int] = []
    for tok in tokens:
        if isinstance(tok, int):
            out.append(tok)
            continue
        t = str(tok).strip().lower()
        if t in ("sign", "exponent", "mantissa"):
            out.append(t)
        elif "-" in t.lstrip("-"):
            a, b = t.split("-", 1)
            lo, hi = int(a), int(b)
            out.extend(range(min(lo, hi), max(lo, hi) + 1))
        else:
            out.append(int(t))
    return out


# --------------------------------------------------------------------------------------------
# The campaign's configuration
# --------------------------------------------------------------------------------------------


@dataclass
class CampaignConfig:
    """A campaign: model, prompts, fault model, size.

    Attributes:
        model: ``"smollm2"`` (embedded), ``"tiny-llama"`` / ``"tiny-gpt2"`` (random tiny models,
            no download), a local path, a ``.gguf`` file or a Hugging Face id.
        prompts: list of ``{"prompt": str, "answer": [str, ...] | None}`` (answer optional: a
            trial's output is task-correct if it contains one of them, case-insensitive).
        sites: fault sites; trials cycle over ``sites × bits`` (or ``sites × ber``).
        bits: bit selectors (see `parse_bits`); a class name draws a bit of that class per trial.
        ber: bit error rates instead of ``bits`` (each trial one rate).
        count: flips per targeted call (bit mode).
        layers: block indices to draw from (None = every block; -1 = modules outside the blocks,
            e.g. ``lm_head``, for ``linear.output``).
        steps: generation steps (0 = prefill) to draw from (None = any step of the clean run);
            ``[-1]`` hits every step of the generation.
        trials: number of trials.
        max_new_tokens: generation length (greedy).
        seed: campaign seed.
        dtype, device: of the model.
        chat_template: wrap prompts with the tokenizer's chat template when it has one.
    """

    model: str = "smollm2"
    prompts: list[dict] = field(default_factory=lambda: [dict(p) for p in DEFAULT_PROMPTS])
    sites: list[str] = field(default_factory=lambda: ["attn.scores", "linear.output"])
    bits: list[str | int] | None = field(default_factory=lambda: ["exponent", "mantissa"])
    ber: list[float] | None = None
    count: int = 1
    layers: list[int] | None = None
    steps: list[int] | None = None
    trials: int = 100
    max_new_tokens: int = 16
    seed: int = 0
    dtype: str = "float32"
    device: str = "cpu"
    chat_template: bool = True

    def __post_init__(self) -> None:
        self.prompts = [p if isinstance(p, dict) else {"prompt": str(p)} for p in self.prompts]
        for p in self.prompts:
            if "prompt" not in p:
                raise ValueError(f"prompt entry without 'prompt': {p}")
            ans = p.get("answer")
            if isinstance(ans, str):
                p["answer"] = [ans]
        if not self.prompts:
            raise ValueError("a campaign needs at least one prompt")
        for s in self.sites:
            if s not in SITES:
                raise ValueError(f"unknown fault site {s!r}; choose from {', '.join(SITES)}")
        if not self.sites:
            raise ValueError("a campaign needs at least one site")
        if (self.bits is None or not self.bits) == (self.ber is None or not self.ber):
            raise ValueError("give exactly one of bits or ber")
        if self.bits:
            self.bits = parse_bits(self.bits)
            mdt = getattr(torch, self.dtype)
            for s in self.sites:
                nb = torch.finfo(site_dtype(s, mdt)).bits
                for b in self.bits:
                    if isinstance(b, int) and not 0 <= b < nb:
                        raise ValueError(f"bit {b} out of range for {s} ({nb}-bit values)")
            self.ber = None
        else:
            self.ber = [float(x) for x in self.ber]
            self.bits = None
        if self.trials < 0 or self.max_new_tokens < 1 or self.count < 1:
            raise ValueError("trials >= 0, max_new_tokens >= 1 and count >= 1 required")

    def fault_dict(self) -> dict:
        """Everything that defines the trials and their results (not their number)."""
        d = asdict(self)
        d.pop("trials")
        return d

    def fingerprint(self) -> str:
        blob = json.dumps(self.fault_dict(), sort_keys=True, default=str).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CampaignConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def combos(self) -> list[tuple[str, str | int | float]]:
        """The strata trials cycle over: (site, bit selector or BER)."""
        sel = self.bits if self.bits is not None else self.ber
        return [(s, b) for s in self.sites for b in sel]

