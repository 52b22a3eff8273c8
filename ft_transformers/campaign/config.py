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
from ..kernels import contract

CLASSES: tuple[str, ...] = ("masked", "sdc", "detected_corrected", "detected_uncorrectable", "crash")
CLASS_LABELS: dict[str, str] = {
    "masked": "masked",
    "sdc": "SDC",
    "detected_corrected": "detected & corrected",
    "detected_uncorrectable": "detected, uncorrectable",
    "crash": "crash / non-finite",
}
ARMS: tuple[str, ...] = ("unprotected", "protected")
ARM_LABELS: dict[str, str] = {"unprotected": "off", "protected": "on"}
SAMPLING: tuple[str, ...] = ("stratified", "uniform")
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


def bit_choices(selector: str | int, dtype: torch.dtype) -> tuple[int, ...]:
    """The bits a selector denotes for values stored as ``dtype``: a class name (``sign``, ``exponent``,
    ``mantissa``), ``any`` (every bit of the storage width) or one int."""
    if isinstance(selector, int):
        return (selector,)
    if selector == "any":
        return tuple(range(torch.finfo(dtype).bits))
    return bit_fields(dtype)[selector]


def bit_class(bit: int, dtype: torch.dtype) -> str:
    """``"sign"``, ``"exponent"`` or ``"mantissa"`` for a bit of ``dtype``."""
    for name, bits in bit_fields(dtype).items():
        if bit in bits:
            return name
    raise ValueError(f"bit {bit} out of range for {dtype}")


def site_dtype(site: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage format of the values at a site: the GEMM output dtype for Linear; for attention what the
    contract says (``contract.site_dtype``: fp32 except values held in the input dtype), fp32 where the
    contract does not say."""
    if not site.startswith("attn."):
        return model_dtype
    of_site = getattr(contract, "site_dtype", None)
    return torch.float32 if of_site is None else of_site(site, model_dtype)


def parse_bits(tokens: Iterable[str | int]) -> list[str | int]:
    """Bit selectors: ``sign`` / ``exponent`` / ``mantissa`` / ``any`` (a bit of that class, or of the
    whole storage width, drawn per trial), an int, or a range ``a-b`` (expanded to ints, both ends
    included)."""
    out: list[str | int] = []
    for tok in tokens:
        if isinstance(tok, int):
            out.append(tok)
            continue
        t = str(tok).strip().lower()
        if t in ("sign", "exponent", "mantissa", "any"):
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
        sites: fault sites. None = ``attn.scores`` and ``linear.output`` when stratified, every site of
            the contract (`ft_transformers.kernels.contract.SITES`, read when the config is made) when
            uniform. Stratified trials cycle over ``sites × bits`` (or ``sites × ber``).
        bits: bit selectors (see `parse_bits`); a class name draws a bit of that class per trial,
            ``any`` a bit of the whole storage width.
        sampling: ``"stratified"`` (trial i takes stratum ``i mod len(combos())``, then a layer and a
            module at random) or ``"uniform"``: every (site, module) pair the model offers (an
            attention site of one block's attention, or ``linear.output`` of one protected Linear,
            ``lm_head`` included) is equally likely, and the bit is drawn uniformly from the bits the
            selectors denote at that site's storage width.
        arms: the protection arms each trial runs (`ARMS`: ``unprotected``, ``protected``); the trials
            themselves do not depend on it, so two campaigns that differ only here run the same faults.
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
    sites: list[str] | None = None
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
    sampling: str = "stratified"
    arms: list[str] = field(default_factory=lambda: list(ARMS))

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
        if self.sampling not in SAMPLING:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLING)}, got {self.sampling!r}")
        if self.sites is None:  # the contract's sites as of now: the config (and its file) keeps them
            self.sites = list(contract.SITES) if self.sampling == "uniform" else ["attn.scores", "linear.output"]
        self.sites = list(self.sites)
        for s in self.sites:
            if s not in contract.SITES:
                raise ValueError(f"unknown fault site {s!r}; choose from {', '.join(contract.SITES)}")
        if not self.arms or any(a not in ARMS for a in self.arms):
            raise ValueError(f"arms must be a non-empty subset of {', '.join(ARMS)}, got {self.arms}")
        self.arms = [a for a in ARMS if a in self.arms]  # one order, whatever order they were given in
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
        """Everything that defines the trials and their results (not their number). ``sampling`` and
        ``arms`` enter only when they differ from their defaults, so files written before they
        existed keep their fingerprint."""
        d = asdict(self)
        d.pop("trials")
        if d["sampling"] == "stratified":
            d.pop("sampling")
        if d["arms"] == list(ARMS):
            d.pop("arms")
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
        """The strata stratified trials cycle over: (site, bit selector or BER)."""
        sel = self.bits if self.bits is not None else self.ber
        return [(s, b) for s in self.sites for b in sel]

