"""Protection under transformers' tensor parallelism (``tp_plan="auto"``), on two CPU processes (gloo).

The multi-process tests launch ``torchrun --standalone --nproc-per-node 2`` on this file (its ``__main__``
is the worker) and on ``scripts/tp_check.py``; each worker writes what it saw to a JSON file, and the
assertions run here. The unsharded model the sharded one is compared with is loaded from the same saved
checkpoint without ``tp_plan``: transformers' own forward, an independent reference. The other tests need no
second process (rank targeting, the merged report).
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
from ft_transformers.distributed import tp_forward_of, with_inner_forward
from ft_transformers.events import FaultEvent, FTReport

ROOT = Path(__file__).resolve().parents[1]
PROMPT, NEW = 12, 5
RANK1_SITES = (("linear.output", "model.layers.0.self_attn.o_proj"), ("attn.scores", 0))
FAULT_CALL = 1  # the first decode step: its one row reaches the logits (a prefill row may fall outside the window)


def _gloo() -> str | None:
    """Why two gloo processes cannot run here, or None."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    if not torch.distributed.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    return None


def _torchrun(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    # (no GPU: transformers' tensor parallelism takes the accelerator it finds)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
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


def _worker(ckpt: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, DistributedConfig

    from ft_transformers.distributed import rank

    sharded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="efta",
                                                   distributed_config=DistributedConfig(tp_plan="auto")).eval()
    whole = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="efta").eval()
    for m in (sharded, whole):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    r = rank()
    res: dict = {"rank": r}
    o_proj = sharded.model.layers[0].self_attn.o_proj
    tp_fwd = tp_forward_of(o_proj)
    res["tp_forward_found"] = tp_fwd is not None
    ids = torch.randint(3, sharded.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(7))

    ftt.enable_fault_tolerance(sharded)
    ftt.enable_fault_tolerance(whole)
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
    Path(out, f"rank{r}.json").write_text(json.dumps(res))


# -- two processes ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    why = _gloo()
    if why:
        pytest.skip(why)
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import make_model

    tmp = tmp_path_factory.mktemp("tp")
    make_model("qwen2").save_pretrained(tmp / "ckpt")
    proc = _torchrun([str(Path(__file__).resolve()), str(tmp / "ckpt"), str(tmp)], cwd=ROOT)
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


def test_tp_check_script_on_two_cpu_ranks(tmp_path):
    why = _gloo()
    if why:
        pytest.skip(why)
    script = str(ROOT / "scripts" / "tp_check.py")
    common = ["--tiny", "--device", "cpu", "--no-timing", "--out", str(tmp_path)]
    one = subprocess.run([sys.executable, script, *common], cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert one.returncode == 0, _failed(one)
    ref = tmp_path / "tp_check_qwen2-7b_float32_tp1.json"
    two = _torchrun([script, *common, "--reference", str(ref)], cwd=ROOT)
    assert two.returncode == 0, _failed(two)
    res = json.loads((tmp_path / "tp_check_qwen2-7b_float32_tp2.json").read_text())
    reference = json.loads(ref.read_text())
    assert res["tp"] == 2 and all(res["checks"].values())
    assert res["variants"]["protected"]["tokens"] == reference["variants"]["protected"]["tokens"]
    assert res["comparison"]["protected"]["verdict"] == "identical"
    for inj in res["injection"]["protected"]:
        assert inj["injected_per_rank"] == [0, 1]
        assert sum(inj["by_rank"]["0"].values()) == 0 and inj["by_rank"]["1"]["detected"] == 1
    assert (tmp_path / "tp_check_qwen2-7b_float32_tp2.md").read_text().count("| OK |") == len(res["checks"])


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


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
