"""A compact, self-contained copy of a causal LM for carrying to a machine without network access.

The embedded SmolLM2-135M-Instruct GGUF is ~94 MiB and an fp16 safetensors copy of it ~260 MiB,
both over the 64 MiB that one device call can carry. A *pack* is a folder holding the model's
``config.json``, ``generation_config.json``, tokenizer files and ``pack.safetensors``, in which every
2-D weight is quantised group-wise (asymmetric, ``bits`` per weight, an fp16 scale and minimum per
``group`` consecutive weights of a row, the codes bit-packed) and everything else is kept as it is.
Tied weights (the LM head of SmolLM2) are stored once. ``pack.json`` says how each tensor was stored.

`unpack` turns a pack back into an ordinary Hugging Face model folder (fp32 safetensors), cached, so
that ``from_pretrained`` (``device_map="auto"`` included) works on it unchanged. `pred.model_source`
does that for any ``--model`` folder holding a ``pack.json``.

A pack is lossy: it is a requantisation of the model it was made from (for SmolLM2, of the
dequantised Q4_1 GGUF), so its predictions are not those of the source model. It is meant for
runs that compare modes or process counts with one another on the same pack.

Made and checked from a clone with ``scripts/longbench/pack.py`` (it loads models through `pred`,
which reads packs through this module).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

FORMAT = "ftt-longbench-pack/1"
PACK_JSON = "pack.json"
WEIGHTS = "pack.safetensors"


# --------------------------------------------------------------------------------------------
# Group-wise quantisation and bit packing (numpy; no torch needed to read or write codes)
# --------------------------------------------------------------------------------------------

def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """The low ``bits`` bits of each uint8 code, concatenated little-endian into bytes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must lie in [1, 8], got {bits}")
    codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
    if bits == 8:
        return codes.copy()
    planes = np.unpackbits(codes[:, None], axis=1, bitorder="little")[:, :bits]
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of `pack_bits`: ``n`` uint8 codes."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must lie in [1, 8], got {bits}")
    packed = np.ascontiguousarray(packed, dtype=np.uint8).reshape(-1)
    if bits == 8:
        if packed.size != n:
            raise ValueError(f"expected {n} codes, got {packed.size}")
        return packed.copy()
    need = -(-n * bits // 8)
    if packed.size != need:
        raise ValueError(f"expected {need} bytes for {n} codes of {bits} bits, got {packed.size}")
    planes = np.unpackbits(packed, bitorder="little")[: n * bits].reshape(n, bits)
    return (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)


def quantize(w: np.ndarray, bits: int, group: int) -> dict[str, np.ndarray]:
    """Asymmetric group-wise quantisation of a 2-D float array along its rows.

    Each row is cut into groups of ``group`` values (the last one may be shorter; it is padded
    with the group's first value, which changes neither its minimum nor its maximum). Returns the
    bit-packed ``codes`` and per-group fp16 ``scale`` and ``min``; the value is
    ``code * scale + min``, with scale and min rounded to fp16 *before* the codes are chosen.
    """
    if w.ndim != 2:
        raise ValueError(f"quantize takes a 2-D array, got shape {w.shape}")
    if group < 1:
        raise ValueError(f"group must be positive, got {group}")
    rows, cols = w.shape
    ng = -(-cols // group)
    x = np.asarray(w, dtype=np.float32)
    pad = ng * group - cols
    if pad:
        x = np.concatenate([x, np.repeat(x[:, -1:], pad, axis=1)], axis=1)
    x = x.reshape(rows, ng, group)
    lo = x.min(axis=2).astype(np.float16)
    hi = x.max(axis=2)
    levels = (1 << bits) - 1
    scale = ((hi - lo.astype(np.float32)) / levels).astype(np.float16)
    s32 = scale.astype(np.float32)
    s32[s32 == 0] = 1.0
    q = np.rint((x - lo.astype(np.float32)[..., None]) / s32[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)[:, :, :group].reshape(rows, ng * group)[:, :cols]
    return {"codes": pack_bits(q, bits), "scale": scale, "min": lo}


def dequantize(codes: np.ndarray, scale: np.ndarray, lo: np.ndarray, shape: tuple[int, int],
               bits: int, group: int) -> np.ndarray:
    """The float32 array `quantize` encoded."""
    rows, cols = shape
    ng = -(-cols // group)
    q = unpack_bits(codes, bits, rows * cols).reshape(rows, cols).astype(np.float32)
    if ng * group != cols:
        q = np.concatenate([q, np.zeros((rows, ng * group - cols), np.float32)], axis=1)
    q = q.reshape(rows, ng, group)
    out = q * scale.astype(np.float32)[..., None] + lo.astype(np.float32)[..., None]
    return out.reshape(rows, ng * group)[:, :cols]


# --------------------------------------------------------------------------------------------
# Packs
# --------------------------------------------------------------------------------------------

def is_pack(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a pack folder."""
    return (Path(path) / PACK_JSON).is_file()


def _tied_names(model) -> set[str]:
    """State-dict names that share storage with an earlier name (stored once)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, t in model.state_dict().items():
        ptr = t.data_ptr()
        if ptr in seen:
            tied.add(name)
        else:
            seen[ptr] = name
    return tied


def make_pack(model, tokenizer, out: str | os.PathLike, *, bits: int = 3, group: int = 64,
              embed_bits: int = 4, embed_group: int = 128, min_numel: int = 4096,
              source: str = "", progress: bool = True) -> dict:
    """Write a pack of ``model`` (any float ``PreTrainedModel``) and its tokenizer to ``out``.

    2-D weights with at least ``min_numel`` elements are quantised (input embeddings with
    ``embed_bits``/``embed_group``, the rest with ``bits``/``group``); other tensors are stored
    as they are. Returns the pack's manifest (also written to ``pack.json``).
    """
    import torch
    from safetensors.numpy import save_file
    from tqdm.auto import tqdm

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    emb = model.get_input_embeddings()
    emb_names = {n + ".weight" for n, m in model.named_modules() if m is emb}
    tied = _tied_names(model)
    tensors: dict[str, np.ndarray] = {}
    manifest: dict[str, dict] = {}
    err2, n_q = 0.0, 0
    sd = model.state_dict()
    for name, t in tqdm(sd.items(), desc="pack", disable=not progress):
        if name in tied:
            continue
        arr = t.detach().to(torch.float32).cpu().numpy() if t.is_floating_point() else t.cpu().numpy()
        if t.is_floating_point() and t.dim() == 2 and t.numel() >= min_numel:
            b, g = (embed_bits, embed_group) if name in emb_names else (bits, group)
            enc = quantize(arr, b, g)
            back = dequantize(enc["codes"], enc["scale"], enc["min"], arr.shape, b, g)
            err2 += float(((back - arr) ** 2).sum())
            n_q += arr.size
            for k, v in enc.items():
                tensors[f"{name}.{k}"] = v
            manifest[name] = {"kind": "q", "bits": b, "group": g, "shape": list(arr.shape),
                              "dtype": str(t.dtype).replace("torch.", ""),
                              "rel_rmse": float(np.sqrt(((back - arr) ** 2).mean()) / (arr.std() + 1e-30))}
        else:
            tensors[name] = np.ascontiguousarray(arr)
            manifest[name] = {"kind": "raw", "shape": list(arr.shape), "dtype": str(t.dtype).replace("torch.", "")}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "np"})
    model.config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {
        "format": FORMAT, "source": source, "bits": bits, "group": group, "embed_bits": embed_bits,
        "embed_group": embed_group, "tied": sorted(tied), "quantized_numel": n_q,
        "weights_sha256": hashlib.sha256((out / WEIGHTS).read_bytes()).hexdigest(),
        "tensors": manifest,
    }
    (out / PACK_JSON).write_text(json.dumps(meta, indent=1))
    return meta


def pack_size(path: str | os.PathLike) -> int:
    """Bytes of every file in a pack folder."""
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def _cache_root() -> Path:
    base = os.environ.get("FTT_LONGBENCH_CACHE") or os.environ.get("XDG_CACHE_HOME") or \
        os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ft_transformers_longbench" / "unpacked"


def unpack(pack_dir: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """An ordinary Hugging Face model folder (fp32 safetensors) of the pack, made once.

    ``dest`` defaults to a cache folder named after the pack's weights hash
    (``$FTT_LONGBENCH_CACHE``, else ``$XDG_CACHE_HOME``, else ``~/.cache``). Safe when several
    processes unpack the same pack at once: each writes a private folder and renames it in.
    """
    import torch
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    pack_dir = Path(pack_dir)
    meta_path = pack_dir / PACK_JSON
    if not meta_path.is_file():
        raise FileNotFoundError(f"{pack_dir} is not a pack (no {PACK_JSON})")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: unknown pack format {meta.get('format')!r} (expected {FORMAT})")
    dest = Path(dest) if dest is not None else _cache_root() / meta["weights_sha256"][:16]
    if (dest / "model.safetensors").is_file():
        return dest
    raw = (pack_dir / WEIGHTS).read_bytes()
    if hashlib.sha256(raw).hexdigest() != meta["weights_sha256"]:
        raise ValueError(f"{pack_dir / WEIGHTS} does not match its hash in {PACK_JSON}: a damaged copy?")
    del raw
    arrays = load_file(str(pack_dir / WEIGHTS))
    state = {}
    for name, info in meta["tensors"].items():
        if info["kind"] == "q":
            w = dequantize(arrays[f"{name}.codes"], arrays[f"{name}.scale"], arrays[f"{name}.min"],
                           tuple(info["shape"]), info["bits"], info["group"])
            state[name] = torch.from_numpy(np.ascontiguousarray(w))
        else:
            state[name] = torch.from_numpy(np.ascontiguousarray(arrays[name]))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".tmp", dir=dest.parent))
    try:
        for p in pack_dir.iterdir():
            if p.is_file() and p.name not in (WEIGHTS, PACK_JSON):
                shutil.copy2(p, tmp / p.name)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.copy2(meta_path, tmp / "source_pack.json")
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "model.safetensors").is_file():  # not a concurrent unpack: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def pack_tag(pack_dir: str | os.PathLike) -> str:
    """Default output-folder name of a pack's model: its folder name."""
    return Path(pack_dir).resolve().name


# --------------------------------------------------------------------------------------------
# Fidelity check: next-token agreement and KL against the source model on real text
# --------------------------------------------------------------------------------------------

def compare_models(a, b, tokenizer, texts: list[str], max_tokens: int = 512) -> dict:
    """Top-1 agreement and mean KL(a || b) of next-token distributions over ``texts``."""
    import torch

    agree, total, kl = 0, 0, 0.0
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]
            la = a(input_ids=ids).logits.float().log_softmax(-1)
            lb = b(input_ids=ids).logits.float().log_softmax(-1)
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
            total += ids.numel()
            kl += float((la.exp() * (la - lb)).sum())
    return {"tokens": total, "top1_agreement": agree / max(total, 1), "mean_kl": kl / max(total, 1)}
