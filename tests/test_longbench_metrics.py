"""LongBench metrics against hand-computed cases (ft_transformers/longbench/metrics).

Every metric of the published scorer, its aggregation (first-line rule, best answer, rounding,
LongBench-E buckets), the known pitfalls (ROUGE on long texts, classification with overlapping
class names, fuzzywuzzy's rounding and backend), and the `evaluate` modules loaded offline.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

import ft_transformers.longbench.metrics as metrics_pkg
from ft_transformers.longbench.metrics import longbench_core as C

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "longbench"
METRICS_DIR = Path(metrics_pkg.__file__).resolve().parent
EPS = 1e-8  # the `rouge` package's F denominator guard


def rouge_f(p: float, r: float) -> float:
    return 2.0 * ((p * r) / (p + r + EPS))


# ---------------------------------------------------------------------------------------------
# normalisation and QA F1
# ---------------------------------------------------------------------------------------------

def test_normalize_answer():
    # lower -> strip ASCII punctuation -> drop articles -> squeeze spaces
    assert C.normalize_answer("The  Cat's, hat!") == "cats hat"
    assert C.normalize_answer("An apple a day") == "apple day"
    assert C.normalize_answer("Theatre") == "theatre"  # articles only as whole words
    assert C.normalize_answer("“quoted”") == "“quoted”"  # non-ASCII punctuation is kept


def test_qa_f1_hand_cases():
    # pred {cat, sat, on, mat} vs ref {cat, on, mat}: P = 3/4, R = 1, F1 = 6/7
    assert C.qa_f1_score("The cat sat on the mat", "A cat on a mat") == pytest.approx(6 / 7)
    # multiset overlap: "cat cat" vs "cat": P = 1/2, R = 1 -> 2/3
    assert C.qa_f1_score("cat cat", "cat") == pytest.approx(2 / 3)
    assert C.qa_f1_score("Paris.", "paris") == 1.0
    assert C.qa_f1_score("London", "Paris") == 0.0
    assert C.qa_f1_score("", "Paris") == 0.0
    assert C.qa_f1_score("the", "a") == 0.0  # both normalise to nothing


def test_qa_f1_zh_hand_cases():
    pytest.importorskip("jieba")
    assert C.jieba_cut("我爱北京天安门") == ["我", "爱", "北京", "天安门"]
    # 4 predicted words, 1 reference word, 1 shared: P = 1/4, R = 1 -> 0.4
    assert C.qa_f1_zh_score("我爱北京天安门", "北京") == pytest.approx(0.4)
    # punctuation tokens normalise to "" and are dropped
    assert C.qa_f1_zh_score("北京。", "北京") == 1.0
    assert C.normalize_zh_answer("Ａ，b c！") == "ａbc"


# ---------------------------------------------------------------------------------------------
# ROUGE-L
# ---------------------------------------------------------------------------------------------

def test_rouge_l_hand_cases():
    # one sentence each; LCS "the cat": P = R = 2/3
    assert C.rouge_score("the cat sat", "the cat ate") == pytest.approx(rouge_f(2 / 3, 2 / 3), abs=1e-15)
    # unique words: "a a a b" has 2 distinct words, LCS covers both -> P = R = 1
    assert C.rouge_score("a a a b", "a b") == pytest.approx(rouge_f(1, 1), abs=1e-15)
    # sentences split on ".": LCS("a b", "b a") backtracks to "b" (ties go left), the second
    # sentence "b" adds nothing new to the union -> 1 of 2 words: P = R = 1/2
    assert C.rouge_score("b a. b", "a b") == pytest.approx(rouge_f(0.5, 0.5), abs=1e-15)
    # the union over sentences: "b a" -> {b}, "c" -> {c}; 3 distinct words each side
    assert C.rouge_score("b a. c", "a b c") == pytest.approx(rouge_f(2 / 3, 2 / 3), abs=1e-15)
    # what the published scorer scores 0 (it raises inside, then catches)
    assert C.rouge_score("", "a b") == 0.0
    assert C.rouge_score("...", "a b") == 0.0
    assert C.rouge_score("a b", "") == 0.0
    assert C.rouge_score("x y", "a b") == 0.0


def test_rouge_l_long_text_pitfall():
    """The `rouge` package reconstructs the LCS recursively: a reference sentence plus a
    predicted sentence of more than ~1000 words overflow Python's recursion limit and the
    published scorer scores 0. The default (faithful) backend does the same; `lcs` (a named
    deviation) gets the true value."""
    words = [f"w{i}" for i in range(1200)]
    # one sentence each (no "."), 700 distinct words each, the first 200 shared: P = R = 2/7.
    # The recursive backtracking walks 700 + 700 - 200 = 1200 steps deep.
    pred, ref = " ".join(words[:700]), " ".join(words[:200] + words[700:1200])
    assert C.rouge_score(pred, ref) == 0.0  # default: as published
    assert C.rouge_score(pred, ref, rouge_backend="lcs") == pytest.approx(rouge_f(2 / 7, 2 / 7), abs=1e-15)
    assert C.rouge_score("the cat sat", "the cat ate", rouge_backend="lcs") == \
        C.rouge_score("the cat sat", "the cat ate")
    rouge = pytest.importorskip("rouge")
    assert C.rouge_score(pred, ref, rouge_backend="rouge-package") == 0.0  # RecursionError -> 0
    with pytest.raises(RecursionError):  # the overflow is real, not an artefact of our emulation
        rouge.Rouge().get_scores([pred], [ref], avg=True)


def _official_like_scorer(metric: str):
    """The official eval.py's call chain to the `rouge` package, frame for frame (module level
    -> scorer -> [rouge_zh_score ->] rouge_score -> Rouge.get_scores), run in a fresh
    interpreter so that pytest's own stack does not shift the recursion limit."""
    return f"""
import json, sys
from rouge import Rouge
def rouge_score(prediction, ground_truth, **kwargs):
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:
        return 0.0
    return scores["rouge-l"]["f"]
def rouge_zh_score(prediction, ground_truth, **kwargs):
    return rouge_score(prediction, ground_truth)
fn = {{"rouge": rouge_score, "rouge_zh": rouge_zh_score}}["{metric}"]
def scorer(cases):
    out = []
    for p, g in cases:  # a loop, as published (a comprehension would add a frame)
        out.append(max(0.0, fn(p, g, all_classes=None)))
    return out
cases = json.load(sys.stdin)
print(json.dumps(scorer(cases)))
"""


@pytest.mark.parametrize("metric", ["rouge", "rouge_zh"])
def test_rouge_faithful_overflow_point(metric):
    """Around the overflow point, the default backend scores 0.0 exactly where the official
    call chain does (CPython 3.11: the cut-off may move by a frame on other versions)."""
    import subprocess

    pytest.importorskip("rouge")
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the overflow point is measured on CPython 3.11")
    # reference "w0" against w0 .. w(m-1): the backtracking walks left m-1 times, then matches:
    # m + 1 recursive calls
    cases = [(" ".join(f"w{k}" for k in range(m)), "w0") for m in range(985, 996)]
    res = subprocess.run([sys.executable, "-c", _official_like_scorer(metric)], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=120, check=True)
    want = json.loads(res.stdout)
    assert 0.0 in want and any(w > 0 for w in want)  # the cut-off lies inside the range
    core = C.rouge_score if metric == "rouge" else (lambda p, g: C._rouge(p, g, "official", "rouge_zh"))
    assert [core(p, g) for p, g in cases] == want


def test_rouge_l_matches_rouge_package_on_short_texts():
    rouge = pytest.importorskip("rouge")
    rng = random.Random(0)
    vocab = ["a", "b", "c", "the", "cat", ".", " ", "..", "x.", "\n", "dog"]
    r = rouge.Rouge()
    for _ in range(300):
        hyp = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 15)))
        ref = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 15)))
        try:
            want = r.get_scores([hyp], [ref], avg=True)["rouge-l"]["f"]
        except Exception:
            want = 0.0
        assert C.rouge_score(hyp, ref) == want, (hyp, ref)
        assert C.rouge_score(hyp, ref, rouge_backend="lcs") == want, (hyp, ref)


def test_rouge_zh_hand_case():
    pytest.importorskip("jieba")
    assert C.jieba_cut("今天天气很好") == ["今天天气", "很", "好"]
    assert C.jieba_cut("今天天气不错") == ["今天天气", "不错"]
    # LCS {今天天气}: P = 1/3, R = 1/2
    assert C.rouge_zh_score("今天天气很好", "今天天气不错") == pytest.approx(rouge_f(1 / 3, 1 / 2), abs=1e-15)


def test_rouge_rejects_unknown_backend():
    with pytest.raises(ValueError):
        C.rouge_score("a", "a", rouge_backend="nope")


# ---------------------------------------------------------------------------------------------
# classification
# ---------------------------------------------------------------------------------------------

TREC_CLASSES = ["City", "Country", "Other location", "State"]


def test_classification_hand_cases():
    assert C.classification_score("City", "City", all_classes=TREC_CLASSES) == 1.0
    assert C.classification_score("City or Country?", "City", all_classes=TREC_CLASSES) == 0.5
    assert C.classification_score("State", "City", all_classes=TREC_CLASSES) == 0.0
    assert C.classification_score("", "City", all_classes=TREC_CLASSES) == 0.0
    assert C.classification_score("city", "City", all_classes=TREC_CLASSES) == 0.0  # case-sensitive
    with pytest.raises(ValueError):
        C.classification_score("City", "City", all_classes=None)


def test_classification_overlapping_class_names():
    # "Other" and "location" are found inside the prediction "Other location" and are
    # substrings of the true class: both should be discarded. The published loop removes
    # "Other" from the list it iterates over, so it skips "location", which stays: 1/2.
    classes = ["Other", "location", "Other location", "City"]
    assert C.classification_score("Other location", "Other location", all_classes=classes) == 0.5
    assert C.classification_score("Other location", "Other location", all_classes=classes,
                                  faithful=False) == 1.0
    # a shorter true class inside a longer predicted one is *not* filtered (it is the truth):
    # predicting "Country" when the truth is "Count" still earns 1/2 in both variants.
    classes = ["Count", "Country"]
    assert C.classification_score("Country", "Count", all_classes=classes) == 0.5
    assert C.classification_score("Country", "Count", all_classes=classes, faithful=False) == 0.5


def test_classification_on_real_trec_row():
    row = json.loads((FIXTURES / "trec.jsonl").read_text().splitlines()[0])
    classes, truth = row["all_classes"], row["answers"][0]
    assert truth == "Other location" and len(classes) == 50
    assert C.score_row("trec", "Other location\nQuestion: ...", row["answers"], all_classes=classes) == 1.0
    # "Other location" and "Other number" named: 1/2
    assert C.score_row("trec", "Other location or Other number", row["answers"], all_classes=classes) == 0.5


# ---------------------------------------------------------------------------------------------
# retrieval and count
# ---------------------------------------------------------------------------------------------

def test_retrieval_hand_cases():
    assert C.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert C.retrieval_score("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert C.retrieval_score("It is 12, one of 2 candidates", "Paragraph 12") == 0.5
    assert C.retrieval_score("Paragraph 120", "Paragraph 12") == 0.0  # whole numbers only
    assert C.retrieval_score("no idea", "Paragraph 12") == 0.0
    assert C.retrieval_zh_score("段落5", "段落5") == 1.0
    assert C.retrieval_zh_score("答案是段落5和段落15", "段落5") == 0.5
    with pytest.raises(ValueError):
        C.retrieval_score("1", "12")


def test_count_hand_cases():
    assert C.count_score("There are 12 unique paragraphs", "12") == 1.0
    assert C.count_score("12 of 30", "12") == 0.5
    assert C.count_score("twelve", "12") == 0.0
    assert C.count_score("12", 12) == 1.0


# ---------------------------------------------------------------------------------------------
# code similarity
# ---------------------------------------------------------------------------------------------

def test_first_code_line():
    assert C.first_code_line("\n\n# comment\n    x = foo(1)\nmore") == "    x = foo(1)"
    assert C.first_code_line("```java\nint a = 1;\n```") == "int a = 1;"
    assert C.first_code_line("// c\n# d") == ""
    assert C.first_code_line("") == ""


def test_code_sim_hand_cases():
    # difflib: 3 matching characters of 8 -> 0.75
    assert C.code_sim_score("abcd", "abce") == 0.75
    assert C.code_sim_score("x = 1", "x = 1") == 1.0
    assert C.code_sim_score("# only a comment", "x = 1") == 0.0  # no code line -> "" -> 0
    assert C.code_sim_score("", "") == 1.0  # fuzzywuzzy: equal strings first, then empties
    # 1 of 16 characters matches: 12.5 rounds half to even -> 12, as fuzzywuzzy's round does
    assert C.fuzz_ratio("abcdefgh", "aijklmno") == 12
    assert C.code_sim_score("abcdefgh", "aijklmno") == 0.12
    # the Levenshtein-backed variant (indel distance) on the same hand case
    assert C.code_sim_score("abcd", "abce", code_sim_backend="indel") == 0.75


def test_code_sim_matches_fuzzywuzzy():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    from fuzzywuzzy import fuzz as fz  # noqa: F811

    if fz.SequenceMatcher.__module__ != "difflib":
        pytest.skip("fuzzywuzzy uses python-Levenshtein here (not LongBench's setup)")
    rng = random.Random(1)
    for _ in range(300):
        a = "".join(rng.choice("ab c(){};\t=") for _ in range(rng.randint(0, 30)))
        b = "".join(rng.choice("ab c(){};\t=") for _ in range(rng.randint(0, 30)))
        assert C.fuzz_ratio(a, b) == fuzz.ratio(a, b)


def test_code_sim_on_real_lcc_row():
    row = json.loads((FIXTURES / "lcc.jsonl").read_text().splitlines()[0])
    truth = row["answers"][0]
    assert C.score_row("lcc", "\n" + truth + "\n}", row["answers"]) == 1.0
    assert C.score_row("lcc", "// comment\n" + truth, row["answers"]) == 1.0


# ---------------------------------------------------------------------------------------------
# aggregation
# ---------------------------------------------------------------------------------------------

def test_task_metric_table():
    assert len(C.LONGBENCH_TASKS) == 21 and set(C.TASK_METRIC) == set(C.LONGBENCH_TASKS)
    assert set(C.LONGBENCH_E_TASKS) <= set(C.LONGBENCH_TASKS) and len(C.LONGBENCH_E_TASKS) == 13
    assert C.metric_for("hotpotqa_e")[0] == "qa_f1"
    assert C.metric_for("vcsum")[0] == "rouge_zh"
    with pytest.raises(KeyError):
        C.metric_for("nope")


def test_first_line_rule_and_best_answer():
    # few-shot tasks keep the first line (after leading newlines) only
    assert C.score_row("triviaqa", "\nParis\nQuestion: x", ["Paris"]) == 1.0
    assert C.score_row("hotpotqa", "\nParis\nQuestion: x", ["Paris"]) == pytest.approx(0.5)
    # best score over the reference answers
    assert C.score_row("triviaqa", "United States", ["USA", "United States"]) == 1.0


def test_score_task_rounding_and_buckets():
    preds = ["x", "x", "y", "x", "y", "x"]
    answers = [["x"]] * 6
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    res = C.score_task("hotpotqa_e", preds, answers, lengths=lengths)
    assert res["score"] == round(100 * 4 / 6, 2) == 66.67
    assert res["bucket_n"] == {"0-4k": 2, "4-8k": 2, "8k+": 2}
    assert res["buckets"] == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 50.0}
    res = C.score_task("hotpotqa", ["x"], [["x"]], lengths=[100])
    assert math.isnan(res["buckets"]["8k+"]) and res["buckets"]["0-4k"] == 100.0


# ---------------------------------------------------------------------------------------------
# evaluate modules (local files, offline)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def evaluate_mod():
    return pytest.importorskip("evaluate")


@pytest.mark.parametrize("metric,pred,refs,kwargs,want", [
    ("qa_f1", "The cat sat on the mat", ["A cat on a mat"], {}, 6 / 7),
    ("qa_f1_zh", "我爱北京天安门", ["北京"], {}, 0.4),
    ("rouge", "the cat sat", ["the cat ate"], {}, rouge_f(2 / 3, 2 / 3)),
    ("rouge_zh", "今天天气很好", ["今天天气不错"], {}, rouge_f(1 / 3, 1 / 2)),
    ("classification", "City or Country", ["City"], {"all_classes": TREC_CLASSES}, 0.5),
    ("retrieval", "Paragraph 12 or Paragraph 3", ["Paragraph 12"], {}, 0.5),
    ("retrieval_zh", "段落5", ["段落5"], {}, 1.0),
    ("count", "12 of 30", ["12"], {}, 0.5),
    ("code_sim", "abcd", ["abce"], {}, 0.75),
])
def test_evaluate_modules(evaluate_mod, metric, pred, refs, kwargs, want):
    if metric.endswith("_zh") and metric != "retrieval_zh":
        pytest.importorskip("jieba")
    m = evaluate_mod.load(str(METRICS_DIR / f"longbench_{metric}.py"), keep_in_memory=True)
    out = m.compute(predictions=[pred, "zzz"], references=[refs, refs], **kwargs)
    assert out["scores"][0] == pytest.approx(want, abs=1e-12)
    assert out["n"] == 2 and out["score"] == round(100 * (out["scores"][0] + out["scores"][1]) / 2, 2)


def test_evaluate_task_module(evaluate_mod):
    m = evaluate_mod.load(str(METRICS_DIR / "longbench_score.py"), config_name="trec_e", keep_in_memory=True)
    out = m.compute(predictions=["\nCity\nCountry", "State"], references=[["City"], ["City"]],
                    all_classes=TREC_CLASSES, lengths=[100, 9000])
    assert out["task"] == "trec" and out["metric"] == "classification"
    assert out["score"] == 50.0 and out["buckets"]["0-4k"] == 100.0 and out["buckets"]["8k+"] == 0.0
    assert math.isnan(out["buckets"]["4-8k"])
    # single-string references are accepted too
    m = evaluate_mod.load(str(METRICS_DIR / "longbench_qa_f1.py"), keep_in_memory=True)
    assert m.compute(predictions=["Paris"], references=["Paris"])["score"] == 100.0
