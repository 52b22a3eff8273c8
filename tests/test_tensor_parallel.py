"""Protection under transformers' tensor parallelism (``tp_plan="auto"``), on two CPU processes (gloo).

The multi-process tests launch ``torchrun --standalone --nproc-per-node 2`` on this file (its ``__main__``
is the worker) and on ``scripts/tp_check.py``; each worker writes what it saw to a JSON file, and the
assertions run here. The unsharded model the sharded one is compared with is loaded from the same saved
checkpoint without ``tp_plan``: transformers' own forward, an independent reference. The other tests need no
second process (rank targeting, the merged report).

The one-launch sibling GEMMs (Q/K/V, gate/up; `ft_transformers.siblings`) take fp16/bf16 on CUDA only; the
worker runs them on the CPU under the Triton interpreter (``TRITON_INTERPRET=1``, ``siblings._ON_CPU``), on an
fp16 Qwen2 whose K/V projections are as wide as Q (each rank's shards a multiple of the kernel's 64 columns),
and checks each member's local output against float64 products of the unsharded weights' rows.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ft_transformers as ftt
from ft_transformers.distributed import tp_forward_of, whole_rows, with_inner_forward
from ft_transformers.events import FaultEvent, FTReport

ROOT = Path(__file__).resolve().parents[1]
PROMPT, NEW = 12, 5
RANK1_SITES = (("linear.output", "model.layers.0.self_attn.o_proj"), ("attn.scores", 0))
FAULT_CALL = 1  # the first decode step: its one row reaches the logits (a prefill row may fall outside the window)
GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def _gloo() -> str | None:
    """Why two gloo processes cannot run here, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    if not torch.distributed.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    return None


def _torchrun(args: list[str], cwd: Path, timeout: int = 240, **env_vars: str) -> subprocess.CompletedProcess:
    # (no GPU: transformers' tensor parallelism takes the accelerator it finds)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **env_vars,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _failed(proc: subprocess.CompletedProcess) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"


# -- the worker (one process per rank, under torchrun) ------------------------------------------------

def _generate(model, ids: torch.Tensor, new: int = NEW) -> tuple[list[int], torch.Tensor]:
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:].tolist(), torch.cat(out.logits).float()


def _events(report: FTReport) -> list[list]:
    return [[e.step, e.layer, e.module, e.site, e.kind, e.count, e.rank] for e in report.events]


def _checksum_shape(module: torch.nn.Module) -> list[int] | None:
    """(N, K) of the weight the module's cached checksums were built from, or None."""
    cache = module.__dict__.get("_ftt_vabft_checksums")
    return None if not cache else [cache[None][3].n, cache[None][3].k]


def _load(ckpt: str, dtype: torch.dtype, tp_plan: str | dict | None = None):
    """The checkpoint's model with EFTA attention, sharded by ``tp_plan`` (None: whole), generating exactly the
    asked length."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    kw = {} if tp_plan is None else {"distributed_config": DistributedConfig(tp_plan=tp_plan)}
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation="efta", **kw).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _worker(ckpt: str, ckpt16: str, out: str) -> None:
    from ft_transformers.distributed import rank

    sharded, whole = _load(ckpt, torch.float32, "auto"), _load(ckpt, torch.float32)
    r = rank()
    res: dict = {"rank": r}
    o_proj = sharded.model.layers[0].self_attn.o_proj
    q_proj = sharded.model.layers[0].self_attn.q_proj
    tp_fwd = tp_forward_of(o_proj)
    res["whole_rows"] = {"q_proj.weight": whole_rows(q_proj.weight), "q_proj.bias": whole_rows(q_proj.bias),
                         "o_proj.weight": whole_rows(o_proj.weight)}
    res["tp_forward_found"] = tp_fwd is not None
    ids = torch.randint(3, sharded.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))

    ftt.enable_fault_tolerance(sharded)
    ftt.enable_fault_tolerance(whole)
    res["groups"] = _sibling_groups(sharded)
    res["tokens"], logits = _generate(sharded, ids)
    res["ref_tokens"], ref_logits = _generate(whole, ids)
    res["max_dlogit"] = float((logits - ref_logits).abs().max())
    res["checksum_shapes"] = {"o_proj": _checksum_shape(o_proj),
                              "q_proj": _checksum_shape(sharded.model.layers[0].self_attn.q_proj)}
    cached = o_proj.__dict__["_ftt_vabft_checksums"][None][3]
    _generate(sharded, ids, 2)
    res["checksums_kept"] = o_proj.__dict__["_ftt_vabft_checksums"][None][3] is cached
    clean = ftt.fault_report(sharded, all_ranks=True)
    res["clean"] = {"events": _events(clean), "ranks": list(clean.ranks), "steps": clean.steps}
    ftt.fault_report(sharded).reset()

    # transformers' compiled decode step (static cache) on the shards: the graph hands the checked op a fresh
    # view of each shard on every call, which must still find the shard's checksum cache entry
    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=False)
    cc._compile_all_devices = True  # (transformers compiles on CUDA only unless told)
    torch._dynamo.utils.counters.clear()
    with torch.inference_mode():
        seq = sharded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                               do_sample=False, cache_implementation="static", compile_config=cc)
    res["compiled_graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    res["compiled_tokens"] = seq[0, PROMPT:].tolist()
    res["compiled_checksums_kept"] = o_proj.__dict__["_ftt_vabft_checksums"][None][3] is cached
    res["compiled_events"] = _events(ftt.fault_report(sharded, all_ranks=True))
    ftt.fault_report(sharded).reset()

    res["faults"] = {}
    for site, target in RANK1_SITES:
        spec = ftt.FaultSpec(site=site, bit=30, layers=[target], calls=[FAULT_CALL], ranks=[1], seed=3)
        with ftt.inject_faults(sharded, spec) as log:
            tokens, flipped = _generate(sharded, ids)
        rep = ftt.fault_report(sharded, all_ranks=True)
        ftt.fault_report(sharded).reset()
        res["faults"][site] = {"tokens": tokens, "injected": int(log.injected), "events": _events(rep),
                               "dlogit_vs_clean": float((flipped - logits).abs().max()), "table": str(rep)}
    try:
        with ftt.inject_faults(sharded, ftt.FaultSpec(site="linear.output", bit=30, ranks=[2])):
            pass
        res["rank2_refused"] = ""
    except ValueError as exc:
        res["rank2_refused"] = str(exc)
    g = torch.Generator().manual_seed(5)
    _, stats = ftt.checked_linear(torch.randn(4, 64, generator=g), torch.randn(96, 64, generator=g),
                                  inject=ftt.FaultSpec(site="linear.output", bit=30, ranks=[1]))
    res["kernel_level_detected"] = stats["detected"]

    # the same rowwise flip with the checks off: it must move the output (else the test above proves nothing)
    ftt.enable_fault_tolerance(sharded, ftt.FTConfig(detect=False, correct=False))
    site, target = RANK1_SITES[0]
    with ftt.inject_faults(sharded, ftt.FaultSpec(site=site, bit=30, layers=[target], calls=[FAULT_CALL],
                                                  ranks=[1], seed=3)):
        _, flipped = _generate(sharded, ids)
    res["unprotected_dlogit"] = float((flipped - logits).abs().max())

    ftt.disable_fault_tolerance(sharded)
    ftt.disable_fault_tolerance(whole)
    res["tp_forward_restored"] = o_proj.__dict__.get("forward") is tp_fwd
    res["plain_tokens"], _ = _generate(sharded, ids)
    res["plain_ref_tokens"], _ = _generate(whole, ids)
    res["siblings"] = _sibling_worker(ckpt16, ids)
    Path(out, f"rank{r}.json").write_text(json.dumps(res))


def _sibling_groups(model) -> dict:
    """Per sibling parent of block 0 (``self_attn``, ``mlp``): the group's in_features, sizes and whether it
    reads local shards, or None where the parent was left alone."""
    from ft_transformers._states import static_of

    block = model.model.layers[0]
    out = {}
    for parent in GROUPS:
        key = getattr(block, parent).__dict__.get("_ftt_sibling_key")
        gs = None if key is None else static_of(key)
        out[parent] = None if gs is None else {"names": list(gs.names), "k": gs.k, "sizes": list(gs.sizes),
                                               "sharded": gs.sharded}
    return out


def _sibling_worker(ckpt: str, ids: torch.Tensor) -> dict:
    """The sibling launches on this rank's shards (fp16, Triton interpreter): what each group computed, the
    local outputs against float64 products of the unsharded weights, tokens, events, injection, disabling."""
    from ft_transformers.kernels import abft_gemm
    from ft_transformers.kernels.gemm_checksums import GROUP_COLS

    from ft_transformers import protect, siblings
    from ft_transformers.distributed import rank

    r = rank()
    siblings._ON_CPU = True  # (read when protection is enabled: the sibling kernel under the interpreter)
    sharded, whole = _load(ckpt, torch.float16, "auto"), _load(ckpt, torch.float16)
    block = sharded.model.layers[0]
    members = {n: getattr(getattr(block, p), n) for p, names in GROUPS.items() for n in names}
    tp_forwards = {n: tp_forward_of(m) for n, m in members.items()}
    res: dict = {}

    # spies: the group calls (shapes of the weights they read), the one-launch kernel, members' own checked GEMMs
    group_calls, launches, own_calls = [], [], []
    real_group, real_launch, real_own = siblings._siblings_forward, abft_gemm.siblings_forward, \
        protect._checked_forward_eager
    names_of = {id(m): n for n, m in members.items()}

    def group_spy(x, weights, *args):
        group_calls.append([list(x.shape), [list(w.shape) for w in weights]])
        return real_group(x, weights, *args)

    def launch_spy(x2d, weights, *args):
        launches.append(len(weights))
        return real_launch(x2d, weights, *args)

    def own_spy(module, x, *args):
        if id(module) in names_of:
            own_calls.append([names_of[id(module)], x.shape[-2] if x.dim() > 1 else 1])
        return real_own(module, x, *args)

    siblings._siblings_forward, abft_gemm.siblings_forward = group_spy, launch_spy
    protect._checked_forward_eager = own_spy
    ftt.enable_fault_tolerance(sharded)
    ftt.enable_fault_tolerance(whole)
    res["groups"] = _sibling_groups(sharded)
    res["classes"] = sorted({type(getattr(block, p)).__name__ for p in GROUPS})

    # the members' local outputs in the prefill of block 0, against the unsharded weights' rows in float64
    seen: dict = {}

    def keep_first(name: str):
        def hook(module, args, y):
            seen.setdefault(name, (args[0], y))
        return hook

    hooks = [m.register_forward_hook(keep_first(n)) for n, m in members.items()]
    group_calls.clear()
    res["tokens"], logits = _generate(sharded, ids)
    for h in hooks:
        h.remove()
    res["group_calls"], res["launches"], res["own_calls"] = list(group_calls), list(launches), list(own_calls)
    wblock = whole.model.layers[0]
    res["slices"] = {}
    for n, (x, y) in seen.items():
        full = getattr(getattr(wblock, "self_attn" if n in GROUPS["self_attn"] else "mlp"), n)
        rows = y.shape[-1]
        w = full.weight.detach()[r * rows:(r + 1) * rows].double()
        b = 0.0 if full.bias is None else full.bias.detach()[r * rows:(r + 1) * rows].double()
        ref = x.double() @ w.t() + b
        res["slices"][n] = {"shape": list(y.shape), "err": float((y.double() - ref).abs().max()),
                            "scale": float(ref.abs().max()), "k": x.shape[-1]}
    res["ref_tokens"], ref_logits = _generate(whole, ids)
    res["max_dlogit"] = float((logits - ref_logits).abs().max())
    clean = ftt.fault_report(sharded, all_ranks=True)
    res["clean_events"] = _events(clean)
    ftt.fault_report(sharded).reset()

    # one checksum cache entry per shard, whichever path reads it: the group (decode) and the member's own
    # call (a 20-row prefill, over the kernel's 16 rows)
    k_proj = members["k_proj"]
    cached = k_proj.__dict__["_ftt_vabft_checksums"][None]
    res["cache_on_local_shard"] = cached[0]() is k_proj.weight._local_tensor
    own_calls.clear()
    long_ids = torch.randint(3, sharded.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(8))
    _generate(sharded, long_ids, 2)
    res["long_prefill_own_calls"] = sorted({n for n, rows in own_calls if rows == 20})
    res["cache_kept"] = k_proj.__dict__["_ftt_vabft_checksums"][None][3] is cached[3]
    ftt.fault_report(sharded).reset()

    # a wrong group checksum of k_proj's shard on rank 1: its rows are recomputed and reported there, as k_proj's
    group_calls.clear()
    consts = cached[3].groups[GROUP_COLS][1]  # (made under inference mode: changed there)
    with torch.inference_mode():
        consts[0, 0] += 100.0 * (r == 1)
    res["bad_checksum_tokens"], _ = _generate(sharded, ids, 1)
    with torch.inference_mode():
        consts[0, 0] -= 100.0 * (r == 1)
    res["bad_checksum_group_calls"] = len(group_calls)
    res["bad_checksum_events"] = _events(ftt.fault_report(sharded, all_ranks=True))
    ftt.fault_report(sharded).reset()

    # injection by module name: rank 1 runs each member's own call while the spec is open, rank 0 the groups
    group_calls.clear()
    spec = ftt.FaultSpec(site="linear.output", bit=14, layers=["model.layers.0.self_attn.v_proj"],
                         calls=[FAULT_CALL], ranks=[1], seed=3)
    with ftt.inject_faults(sharded, spec) as log:
        res["injected_tokens"], _ = _generate(sharded, ids)
    res["injected"] = int(log.injected)
    res["injection_group_calls"] = len(group_calls)
    res["injection_events"] = _events(ftt.fault_report(sharded, all_ranks=True))

    ftt.disable_fault_tolerance(sharded)
    ftt.disable_fault_tolerance(whole)
    siblings._siblings_forward, abft_gemm.siblings_forward = real_group, real_launch
    protect._checked_forward_eager = real_own
    res["classes_after"] = sorted({type(getattr(block, p)).__name__ for p in GROUPS})
    res["restored"] = all(m.__dict__.get("forward") is tp_forwards[n] and type(m) is torch.nn.Linear
                          for n, m in members.items())
    res["keys_left"] = [n for n, m in sharded.named_modules()
                        if "_ftt_sibling_key" in m.__dict__ or "_ftt" in m.__dict__]

    # gate/up split by their input instead (``rowwise_split_input``, outputs all-reduced): their shards hold no
    # whole rows, so the MLP keeps one checked call per layer, and the tokens stay the unsharded model's
    # (the whole plan: transformers 5.17 takes a dict as the plan, 5.24 as changes to the model's)
    plan = {**{f"model.layers.*.self_attn.{n}_proj": "colwise" for n in "qkv"},
            "model.layers.*.self_attn.o_proj": "rowwise",
            **{f"model.layers.*.mlp.{n}": "rowwise_split_input" for n in ("gate_proj", "up_proj", "down_proj")}}
    rowwise = _load(ckpt, torch.float16, plan)
    ftt.enable_fault_tolerance(rowwise)
    res["rowwise_mlp_groups"] = _sibling_groups(rowwise)
    res["rowwise_mlp_tokens"], _ = _generate(rowwise, ids)
    ftt.disable_fault_tolerance(rowwise)
    return res


# -- two processes ------------------------------------------------------------------------------------

def _wide_kv_qwen2():
    """The tiny Qwen2 with 4 KV heads (K/V projections 128 wide, as Q's) and random Q/K/V biases: at tp = 2
    each rank's Q/K/V shards are 64 rows, what the one-launch kernel takes (every member but the last a
    multiple of its 64-column groups; 32-row K/V shards would send the group to one call per layer)."""
    from tiny_models import qwen2_config
    from transformers import AutoModelForCausalLM

    cfg = qwen2_config()
    cfg.num_key_value_heads = 4
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # (tiny_models' widening: attention that depends on its input)
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
            elif name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    why = _gloo()
    if why:
        pytest.skip(why)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_model

    tmp = tmp_path_factory.mktemp("tp")
    make_model("qwen2").save_pretrained(tmp / "ckpt")
    _wide_kv_qwen2().save_pretrained(tmp / "ckpt16")
    proc = _torchrun([str(Path(__file__).resolve()), str(tmp / "ckpt"), str(tmp / "ckpt16"), str(tmp)], cwd=ROOT,
                     TRITON_INTERPRET="1")
    assert proc.returncode == 0, _failed(proc)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_sharded_protected_tokens_match_the_unsharded_model(ranks):
    for res in ranks:
        assert res["tp_forward_found"]
        assert res["tokens"] == res["ref_tokens"]
        assert len(set(res["ref_tokens"])) > 1  # a model whose tokens depend on something
        # the all-reduce sums the two partial products in another order: fp32 rounding, nothing more
        assert res["max_dlogit"] < 1e-4
        assert res["plain_tokens"] == res["plain_ref_tokens"] == res["ref_tokens"]
    assert ranks[0]["tokens"] == ranks[1]["tokens"]


def test_each_rank_checks_its_own_shard(ranks):
    for res in ranks:
        # tiny qwen2: hidden 128, 4 heads of 32; o_proj is rowwise (K split), q_proj colwise (N split)
        assert res["checksum_shapes"] == {"o_proj": [128, 64], "q_proj": [64, 128]}
        assert res["checksums_kept"]  # built once per weight version, not at every call


def test_clean_sharded_run_has_no_events_on_any_rank(ranks):
    for res in ranks:
        assert res["clean"] == {"events": [], "ranks": [0, 1], "steps": NEW + 2}


def test_compiled_decode_on_shards(ranks):
    """transformers' compiled decode step runs the checked ops on each rank's shards: the eager tokens, no
    event, and each shard's weight checksums built once (kept across the compiled calls)."""
    for r in ranks:
        assert r["compiled_graphs"] > 0
        assert r["compiled_tokens"] == r["tokens"]
        assert r["compiled_events"] == []
        assert r["compiled_checksums_kept"]


@pytest.mark.parametrize("site,target", RANK1_SITES)
def test_a_flip_on_rank_1_is_repaired_and_reported_with_rank_1(ranks, site, target):
    r0, r1 = ranks[0]["faults"][site], ranks[1]["faults"][site]
    assert (r0["injected"], r1["injected"]) == (0, 1)
    for res, got in ((ranks[0], r0), (ranks[1], r1)):
        events = got["events"]  # each rank received the gathered report
        assert events == r1["events"]
        assert events and {e[6] for e in events} == {1}
        assert {(e[0], e[1], e[3]) for e in events} == {(FAULT_CALL, 0, site)}
        kinds = {e[4]: e[5] for e in events}
        assert kinds["detected"] == 1 and kinds.get("corrected", 0) + kinds.get("recomputed", 0) == 1
        assert "uncorrectable" not in kinds
        assert got["tokens"] == res["tokens"]
        assert got["dlogit_vs_clean"] < 1e-4
        assert "rank" in got["table"].splitlines()[1]
    if site == "linear.output":  # the rowwise o_proj: found on rank 1 before its all-reduce
        assert {e[2] for e in r1["events"]} == {target}


def test_the_rank_1_flip_matters_without_protection(ranks):
    for res in ranks:
        assert res["unprotected_dlogit"] > 1e-2


def test_a_rank_the_run_lacks_is_refused(ranks):
    assert "ranks [2] do not exist" in ranks[0]["rank2_refused"]


def test_kernel_level_injection_follows_the_ranks(ranks):
    assert [res["kernel_level_detected"] for res in ranks] == [0, 1]


def test_protection_leaves_transformers_tp_forward_in_place(ranks):
    assert all(res["tp_forward_restored"] for res in ranks)


def _group(names, k, sizes):
    return {"names": list(names), "k": k, "sizes": list(sizes), "sharded": True}


def test_sibling_groups_are_sized_by_the_local_shards(ranks):
    for res in ranks:
        assert res["whole_rows"] == {"q_proj.weight": True, "q_proj.bias": True, "o_proj.weight": False}
        # tiny qwen2 (hidden 128, intermediate 256, 4 heads and 2 KV heads of 32), colwise over 2 ranks:
        # Q 128 -> 64 rows, K/V 64 -> 32, gate/up 256 -> 128; in_features stay whole
        assert res["groups"] == {"self_attn": _group(GROUPS["self_attn"], 128, (64, 32, 32)),
                                 "mlp": _group(GROUPS["mlp"], 128, (128, 128))}
        # 4 KV heads: K/V 128 -> 64
        assert res["siblings"]["groups"] == {"self_attn": _group(GROUPS["self_attn"], 128, (64, 64, 64)),
                                             "mlp": _group(GROUPS["mlp"], 128, (128, 128))}
        assert res["siblings"]["rowwise_mlp_groups"] == {
            "self_attn": _group(GROUPS["self_attn"], 128, (64, 64, 64)), "mlp": None}


def test_sibling_launches_run_on_each_ranks_shards(ranks):
    """Prefill (12 rows) and the 4 decode steps: every group of both blocks in one launch of the kernel on
    this rank's (rows, 128) shards, and no member's own checked GEMM (transformers' colwise forward handed
    each member the parent's input tensor itself, and it returned its parked slice)."""
    calls = 2 * len(GROUPS) * NEW
    for res in ranks:
        s = res["siblings"]
        assert len(s["group_calls"]) == calls and s["launches"] == [3, 2] * (calls // 2)
        assert [ws for _, ws in s["group_calls"][:2]] == [[[64, 128]] * 3, [[128, 128]] * 2]
        assert {tuple(x) for x, _ in s["group_calls"]} == {(1, PROMPT, 128), (1, 1, 128)}
        assert s["own_calls"] == []


def test_sibling_outputs_are_the_local_slices_of_the_unsharded_products(ranks):
    """Each member's output (after transformers' colwise forward) in block 0's prefill equals its rank's
    rows of the unsharded weight and bias applied in float64, to fp16 rounding."""
    for r, res in enumerate(ranks):
        slices = res["siblings"]["slices"]
        assert sorted(slices) == sorted(n for names in GROUPS.values() for n in names)
        for name, got in slices.items():
            rows = 128 if name in GROUPS["mlp"] else 64
            assert got["shape"] == [1, PROMPT, rows] and got["k"] == 128
            assert got["scale"] > 0.5
            assert got["err"] <= (4 * 2.0**-10 + 4 * 128**0.5 * 2.0**-24) * got["scale"], (r, name, got)


def test_sibling_sharded_tokens_match_the_unsharded_model(ranks):
    for res in ranks:
        s = res["siblings"]
        assert s["tokens"] == s["ref_tokens"] == s["rowwise_mlp_tokens"] and len(set(s["ref_tokens"])) > 1
        assert s["max_dlogit"] < 2e-2  # fp16 rounding of two partial products and their all-reduce
        assert s["clean_events"] == []
    assert ranks[0]["siblings"]["tokens"] == ranks[1]["siblings"]["tokens"]


def test_sibling_and_own_calls_share_the_shards_checksums(ranks):
    """The group and the member's own call (a 20-row prefill) read the same local shard: one cache entry,
    built on it and kept."""
    for res in ranks:
        s = res["siblings"]
        assert s["cache_on_local_shard"] and s["cache_kept"]
        assert s["long_prefill_own_calls"] == sorted(n for names in GROUPS.values() for n in names)


def test_sibling_events_stay_with_their_member_and_rank(ranks):
    """A wrong group checksum of k_proj's shard on rank 1, hit by the one-launch group: every prefill row
    is recomputed and reported for k_proj on rank 1, nothing elsewhere."""
    events = [[0, 0, "model.layers.0.self_attn.k_proj", "linear.output", kind, PROMPT, 1]
              for kind in ("detected", "recomputed")]
    for res in ranks:
        s = res["siblings"]
        assert s["bad_checksum_group_calls"] == 2 * len(GROUPS)
        assert sorted(s["bad_checksum_events"]) == events
        assert s["bad_checksum_tokens"] == s["tokens"][:1]


def test_sibling_groups_step_aside_for_injection_on_the_targeted_rank(ranks):
    r0, r1 = ranks[0]["siblings"], ranks[1]["siblings"]
    assert (r0["injected"], r1["injected"]) == (0, 1)
    # the spec is rank 1's: rank 0 keeps its groups, rank 1 runs every member's own call
    assert (r0["injection_group_calls"], r1["injection_group_calls"]) == (2 * len(GROUPS) * NEW, 0)
    for s in (r0, r1):
        events = s["injection_events"]
        assert {(e[0], e[1], e[2], e[3], e[6]) for e in events} == {
            (FAULT_CALL, 0, "model.layers.0.self_attn.v_proj", "linear.output", 1)}
        kinds = {e[4]: e[5] for e in events}
        assert kinds["detected"] == 1 and kinds.get("corrected", 0) + kinds.get("recomputed", 0) == 1
        assert s["injected_tokens"] == s["tokens"]


def test_disabling_restores_sibling_parents_and_tp_forwards(ranks):
    for res in ranks:
        s = res["siblings"]
        assert s["classes"] == ["_SiblingsQwen2Attention", "_SiblingsQwen2MLP"]
        assert s["classes_after"] == ["Qwen2Attention", "Qwen2MLP"]
        assert s["restored"] and s["keys_left"] == []


def test_tp_check_script_on_two_cpu_ranks(tmp_path):
    why = _gloo()
    if why:
        pytest.skip(why)
    script = str(ROOT / "scripts" / "tp_check.py")
    common = ["--tiny", "--device", "cpu", "--no-timing", "--out", str(tmp_path)]
    one = subprocess.run([sys.executable, script, *common, "--no-injection"], cwd=ROOT, capture_output=True,
                         text=True, timeout=240, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert one.returncode == 0, _failed(one)
    ref = tmp_path / "tp_check_qwen2-7b_float32_tp1.json"
    two = _torchrun([script, *common, "--per-layer", "--reference", str(ref)], cwd=ROOT)
    assert two.returncode == 0, _failed(two)
    res = json.loads((tmp_path / "tp_check_qwen2-7b_float32_tp2.json").read_text())
    reference = json.loads(ref.read_text())
    # the reference ran without its flips (--no-injection): no flip was made, none is checked
    assert reference["injection"] == {"protected": [], "unprotected": []}
    assert not any("flip" in name for name in reference["checks"]) and reference["checks"]
    assert res["tp"] == 2 and all(res["checks"].values())
    assert res["variants"]["protected"]["tokens"] == reference["variants"]["protected"]["tokens"]
    # the sharded model's Q/K/V and gate/up parents are grouped (on CPU fp32 their calls run one by one)
    assert res["sibling_groups"] == reference["sibling_groups"] == 2 * 2 and not res["siblings"]
    per_layer = res["variants"]["protected_per_layer"]
    assert per_layer["tokens"] == res["variants"]["protected"]["tokens"]
    assert "0 events when clean, one launch per layer" in res["checks"]
    assert res["comparison"]["protected"]["verdict"] == "identical"
    for inj in res["injection"]["protected"]:
        assert inj["injected_per_rank"] == [0, 1]
        assert sum(inj["by_rank"]["0"].values()) == 0 and inj["by_rank"]["1"]["detected"] == 1
    assert (tmp_path / "tp_check_qwen2-7b_float32_tp2.md").read_text().count("| OK |") == len(res["checks"])


def test_compiled_step_on_shards_breaks_as_the_unsharded_one(tmp_path):
    """``tp_check.py --compile``: the protected model's compiled decode step on two ranks becomes the graphs of
    the unsharded one, with the same breaks, so a sharded Linear or attention adds no graph break, and none
    at all: the model's hooks (the event recorder's step end among them) run as plain Python beside the
    compiled forward (`ft_transformers.model_hooks`); ``--profile`` writes every rank's tables."""
    why = _gloo()
    if why:
        pytest.skip(why)
    script = str(ROOT / "scripts" / "tp_check.py")
    common = ["--tiny", "--device", "cpu", "--no-injection", "--compile", "default", "--warmup", "0",
              "--repeats", "1", "--out", str(tmp_path)]
    one = subprocess.run([sys.executable, script, *common], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert one.returncode == 0, _failed(one)
    ref = tmp_path / "tp_check_qwen2-7b_float32_tp1.json"
    two = _torchrun([script, *common, "--reference", str(ref), "--profile"], cwd=ROOT, timeout=300)
    assert two.returncode == 0, _failed(two)
    res = json.loads((tmp_path / "tp_check_qwen2-7b_float32_tp2.json").read_text())
    for r in range(2):  # --profile: every rank's table of every workload, the checked ops among the rows
        table = (tmp_path / f"profile_tp2_rank{r}_protected_decode_compiled.txt").read_text()
        assert "ftt::checked_linear_module" in table
        assert (tmp_path / f"profile_tp2_rank{r}_unprotected_prefill.txt").is_file()
    reference = json.loads(ref.read_text())
    for name in ("unprotected", "protected"):
        sharded, whole = (r["variants"][name]["timing"]["decode_compiled"] for r in (res, reference))
        assert sharded["graphs"] == whole["graphs"] >= 1, (name, sharded, whole)
        assert sharded["graph_breaks"] == whole["graph_breaks"], (name, sharded, whole)
        assert 0 < whole["ms_after_record"] and 0 < sharded["ms_after_record"], (name, sharded, whole)
    assert "after its warm-up and CUDA-graph record" in (tmp_path / "tp_check_qwen2-7b_float32_tp2.md").read_text()
    breaks = res["variants"]["protected"]["timing"]["decode_compiled"]["graph_breaks"]
    assert breaks == {}, breaks
    assert res["variants"]["protected"]["tokens"] == reference["variants"]["protected"]["tokens"]
    assert all(res["checks"].values())


# -- one process ----------------------------------------------------------------------------------------

def test_fault_spec_ranks_are_validated():
    assert ftt.FaultSpec(site="attn.scores", bit=3, ranks=1).ranks == (1,)
    assert ftt.FaultSpec(site="attn.scores", bit=3, ranks=[0, 2]).ranks == (0, 2)
    assert ftt.FaultSpec(site="attn.scores", bit=3).ranks is None
    with pytest.raises(ValueError, match="non-negative"):
        ftt.FaultSpec(site="attn.scores", bit=3, ranks=[-1])
    with pytest.raises(ValueError, match="at least one rank"):
        ftt.FaultSpec(site="attn.scores", bit=3, ranks=[])
    with pytest.raises(TypeError, match="FaultSpec.ranks"):
        ftt.FaultSpec(site="attn.scores", bit=3, ranks="1")
    with pytest.raises(TypeError, match=r"FaultSpec.ranks\[0\]"):
        ftt.FaultSpec(site="attn.scores", bit=3, ranks=[1.0])


def test_rank_targeting_without_torch_distributed():
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_model

    model = ftt.enable_fault_tolerance(make_model("llama"))
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"ranks \[1\] do not exist: this run has 1 rank"):
        with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, ranks=[1])):
            pass
    with ftt.inject_faults(model, ftt.FaultSpec(site="linear.output", bit=30, layers=[0], calls=[0],
                                                ranks=[0])) as log, torch.no_grad():
        model(ids)
    assert log.injected > 0
    report = ftt.fault_report(model, all_ranks=True)  # no process group: this process's report
    assert report.events and {e.rank for e in report.events} == {0} and report.ranks == (0,)
    assert "rank" not in str(report).splitlines()[1]
    with pytest.raises(TypeError, match="all_ranks must be a bool"):
        ftt.fault_report(model, all_ranks=1)
    x, w = torch.randn(3, 64), torch.randn(64, 64)
    with pytest.raises(ValueError, match=r"ranks \[2\] do not exist"):
        ftt.checked_linear(x, w, inject=ftt.FaultSpec(site="linear.output", bit=30, ranks=[2]))
    _, stats = ftt.checked_linear(x, w, inject=ftt.FaultSpec(site="linear.output", bit=30, ranks=0))
    assert stats["detected"] == 1 and stats["corrected"] == 1


def test_merged_report_keeps_ranks_apart(tmp_path):
    a = FTReport([FaultEvent(0, 1, "m.layers.1.mlp.down_proj", "linear.output", "detected", 2, 0)], steps=3,
                 ranks=[0], unprotected={"m.layers.0.self_attn": 1})
    b = FTReport([FaultEvent(0, 1, "m.layers.1.mlp.down_proj", "linear.output", "detected", 1, 1),
                  FaultEvent(0, 1, "m.layers.1.mlp.down_proj", "linear.output", "corrected", 1, 1)], steps=4,
                 ranks=[1], unprotected={"m.layers.0.self_attn": 2})
    merged = FTReport.merge(pickle.loads(pickle.dumps(r)) for r in (a, b))
    assert merged.ranks == (0, 1) and merged.steps == 4
    assert merged.totals()["detected"] == 3
    assert merged.by_rank() == {0: {"detected": 2, "corrected": 0, "recomputed": 0, "uncorrectable": 0,
                                    "nonfinite_input": 0},
                                1: {"detected": 1, "corrected": 1, "recomputed": 0, "uncorrectable": 0,
                                    "nonfinite_input": 0}}
    assert merged.summary()[(1, "linear.output")]["detected"] == 3
    assert merged.unprotected == {"m.layers.0.self_attn": 3}
    lines = str(merged).splitlines()
    assert "on 2 ranks" in lines[0] and lines[1].split()[:3] == ["rank", "layer", "site"]
    assert [ln.split()[:2] for ln in lines[3:5]] == [["0", "1"], ["1", "1"]]
    merged.to_csv(tmp_path / "r.csv")
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert rows[0].endswith(",rank") and {r.rsplit(",", 1)[1] for r in rows[1:]} == {"0", "1"}
    merged.to_json(tmp_path / "r.json")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ranks"] == [0, 1] and {e["rank"] for e in data["events"]} == {0, 1}
    with pytest.raises(ValueError, match="at least one report"):
        FTReport.merge([])


def test_only_transformers_tp_forward_is_recognised():
    lin = torch.nn.Linear(4, 4)
    assert tp_forward_of(lin) is None  # no instance forward
    lin.forward = lambda x: x
    assert tp_forward_of(lin) is None  # an instance forward that is not a TP closure

    def install(module):  # the form of transformers' TensorParallelLayer.install_forward
        original_forward = module.forward
        calls = []

        def tp_forward(*args, **kwargs):
            calls.append(module)
            return original_forward(*args, **kwargs) * 2

        module.forward = tp_forward
        return calls

    lin = torch.nn.Linear(4, 4)
    calls = install(lin)
    fn = tp_forward_of(lin)
    assert fn is lin.forward
    x = torch.randn(2, 4)
    wrapped = with_inner_forward(fn, lambda t: t + 1)
    assert torch.equal(wrapped(x), (x + 1) * 2) and len(calls) == 1  # the outer steps run, the inner is ours
    with torch.no_grad():
        assert torch.equal(fn(x), torch.nn.functional.linear(x, lin.weight, lin.bias) * 2)  # original untouched


def test_tp_check_records_why_inductor_skipped_cuda_graphs():
    """tp_check's recorder keeps inductor's own skip messages, first line, counted, and only while active."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import tp_check
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    skips = tp_check._CudagraphSkips()
    with skips:
        for _ in range(2):
            log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)\nmore")
        log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to cpu device (primals_1)")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to something after the run")
    assert skips.reasons == {"skipping cudagraphs due to mutated inputs (1 instances)": 2,
                             "skipping cudagraphs due to cpu device (primals_1)": 1}


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
