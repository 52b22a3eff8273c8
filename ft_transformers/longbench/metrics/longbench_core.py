"""LongBench v1 / LongBench-E scoring: the per-row metrics and the per-task aggregation.

This file has no package-relative imports so that the `evaluate` metric modules next to it can
pull it in as a local import (``from .longbench_core import ...``) and load offline.

The metrics reproduce LongBench's published scorer (its ``metrics.py`` / ``eval.py``) so that
scores are comparable with published numbers. Where the published scorer has quirks, the
faithful behaviour is the default and the quirk is documented next to the code:

* ``classification_score``: the official filter removes items from the list it is iterating
  over, so after a removal the next candidate is skipped (``faithful=False`` applies the
  intended filter instead).
* ``rouge_l``: the official scorer calls the ``rouge`` package (1.0.1), whose ROUGE-L counts
  *unique* words, splits sentences on every ASCII ``"."`` and reconstructs the LCS recursively.
  The recursion overflows Python's stack when the backtracking path of a (reference sentence,
  predicted sentence) pair passes roughly 1,000 steps (long summaries; Chinese text, which has no
  ASCII ``"."``, is one sentence), and the official bare ``try/except`` then scores the row 0.0.
  The default ``backend="official"`` reproduces that: it computes the same LCS iteratively,
  counts the recursive calls the package would make, and scores 0.0 where they would overflow
  the official ``eval.py`` (see `_official_overflows`). ``backend="lcs"`` is a *deviation*: the
  true score, also for long texts. ``backend="rouge-package"`` calls the ``rouge`` package itself
  under the same ``try/except`` (its overflow point then depends on the caller's stack depth).
* ``code_sim_score``: ``fuzzywuzzy.fuzz.ratio`` without ``python-Levenshtein`` (LongBench's
  requirements) is ``difflib.SequenceMatcher`` (autojunk on) rounded to an integer percentage;
  that is the default. ``backend="indel"`` gives the Levenshtein-backed variant's numbers.
"""

from __future__ import annotations

import difflib
import math
import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

# --------------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------------

#: The 21 LongBench v1 tasks, in the benchmark's usual order.
LONGBENCH_TASKS: tuple[str, ...] = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh",
    "hotpotqa", "2wikimqa", "musique", "dureader",
    "gov_report", "qmsum", "multi_news", "vcsum",
    "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh",
    "lcc", "repobench-p",
)

#: The 13 tasks that have a LongBench-E split (``<task>_e``).
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)

#: Metric name per task.
TASK_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1",
    "multifieldqa_zh": "qa_f1_zh", "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1",
    "dureader": "rouge_zh", "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge",
    "vcsum": "rouge_zh", "trec": "classification", "triviaqa": "qa_f1", "samsum": "rouge",
    "lsht": "classification", "passage_count": "count", "passage_retrieval_en": "retrieval",
    "passage_retrieval_zh": "retrieval_zh", "lcc": "code_sim", "repobench-p": "code_sim",
}

#: Few-shot tasks whose prediction is cut to its first non-empty-leading line before scoring.
FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

#: LongBench-E length buckets (``length`` is LongBench's word count of the row).
LENGTH_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def base_task(name: str) -> str:
    """``"hotpotqa_e"`` -> ``"hotpotqa"`` (LongBench-E files carry the ``_e`` suffix)."""
    return name[:-2] if name.endswith("_e") and name[:-2] in TASK_METRIC else name


def length_bucket(length: int | float) -> str:
    if length < 4000:
        return "0-4k"
    if length < 8000:
        return "4-8k"
    return "8k+"


# --------------------------------------------------------------------------------------------
# Normalisation and tokenisation
# --------------------------------------------------------------------------------------------

_ASCII_PUNCT = frozenset(string.punctuation)
# Full-width and CJK punctuation that the Chinese normaliser strips in addition to ASCII.
_CJK_PUNCT = ("！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】"
              "〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏.")
_ZH_PUNCT = _ASCII_PUNCT | frozenset(_CJK_PUNCT)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, drop ASCII punctuation, drop a/an/the, squeeze spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ASCII_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lower case, drop ASCII and CJK punctuation, drop all whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _ZH_PUNCT)
    return "".join(text.split())


_JIEBA = None


def jieba_cut(text: str) -> list[str]:
    """jieba's precise mode (``cut_all=False``, HMM on), as LongBench uses it."""
    global _JIEBA
    if _JIEBA is None:
        try:
            import jieba
        except ImportError as e:  # pragma: no cover - message only
            raise ImportError("the Chinese LongBench metrics need jieba: "
                              "pip install 'ft-transformers[longbench]'") from e
        jieba.setLogLevel(60)  # no "Building prefix dict" chatter
        _JIEBA = jieba
    return list(_JIEBA.cut(text, cut_all=False))


# --------------------------------------------------------------------------------------------
# QA F1
# --------------------------------------------------------------------------------------------

def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    overlap = sum((Counter(prediction_tokens) & Counter(reference_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(reference_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    def toks(s: str) -> list[str]:
        return [t for t in (normalize_zh_answer(w) for w in jieba_cut(s)) if t]
    return token_f1(toks(prediction), toks(ground_truth))


# --------------------------------------------------------------------------------------------
# ROUGE-L (the `rouge` 1.0.1 package's summary-level variant, as LongBench scores it)
# --------------------------------------------------------------------------------------------

def _rouge_sentences(text: str) -> list[list[str]]:
    """Split like the `rouge` package: on every ".", keep non-empty pieces, squeeze whitespace,
    then split on single spaces (a whitespace-only piece becomes one empty word)."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if len(piece) > 0]


def _lcs_words(ref: Sequence[str], hyp: Sequence[str]) -> tuple[list[str], int]:
    """One longest common subsequence of ``ref`` and ``hyp``, chosen by the same backtracking
    rule as the `rouge` package (match -> diagonal; strictly longer above -> up; else left),
    computed iteratively so that long texts cannot overflow the stack; and the number of
    recursive calls the package's reconstruction makes for it (steps + 1)."""
    n, m = len(ref), len(hyp)
    table = [[0] * (m + 1)]
    for i in range(1, n + 1):
        prev = table[i - 1]
        row = [0] * (m + 1)
        x = ref[i - 1]
        for j in range(1, m + 1):
            if x == hyp[j - 1]:
                row[j] = prev[j - 1] + 1
            else:
                up, left = prev[j], row[j - 1]
                row[j] = up if up > left else left
        table.append(row)
    out: list[str] = []
    i, j = n, m
    calls = 1
    while i > 0 and j > 0:
        calls += 1
        if ref[i - 1] == hyp[j - 1]:
            out.append(ref[i - 1])
            i -= 1
            j -= 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    out.reverse()
    return out, calls


#: CPython's default recursion limit, under which the official scorer runs.
_RECURSION_LIMIT = 1000
#: The official ``eval.py``, run as a script, holds 8 Python frames below the first recursive
#: ``_recon`` call (<module>, scorer, rouge_score, Rouge.get_scores, Rouge._get_avg_scores,
#: rouge_l_summary_level, _union_lcs, _recon_lcs; rouge_zh_score adds one), and CPython raises
#: once the depth reaches the limit. Measured with rouge 1.0.1 on CPython 3.11: a path of 991
#: calls scores, 992 overflow (990 / 991 for rouge_zh); other Python versions may shift the
#: cut-off by a frame.
_OFFICIAL_FRAMES = {"rouge": 9, "rouge_zh": 10}


def _official_overflows(calls: int, metric: str = "rouge") -> bool:
    """Whether the official scorer's recursive LCS reconstruction of ``calls`` calls overflows."""
    return calls + _OFFICIAL_FRAMES[metric] > _RECURSION_LIMIT


def rouge_l_scores(prediction: str, ground_truth: str, *, overflow_metric: str | None = None
                   ) -> dict[str, float] | None:
    """``{"p", "r", "f"}`` of the summary-level ROUGE-L, or None where the official scorer fails:
    an empty prediction or reference after the split, or (with ``overflow_metric`` "rouge" or
    "rouge_zh") a recursion overflow of the official scorer run as that metric."""
    hyp = _rouge_sentences(prediction)
    ref = _rouge_sentences(ground_truth)
    if not hyp or not ref:
        return None
    if overflow_metric is not None:
        # Every backtracking path takes at least min(len) steps: such pairs overflow without
        # building their table.
        if any(_official_overflows(min(len(r), len(h)) + 1, overflow_metric) for r in ref for h in hyp):
            return None
    hyp_vocab = {w for s in hyp for w in s}
    ref_vocab = {w for s in ref for w in s}
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            words, calls = _lcs_words(r, h)
            if overflow_metric is not None and _official_overflows(calls, overflow_metric):
                return None
            union.update(words)
    llcs = len(union)
    r_lcs = llcs / len(ref_vocab)
    p_lcs = llcs / len(hyp_vocab)
    f_lcs = 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))
    return {"p": p_lcs, "r": r_lcs, "f": f_lcs}


def _package_rouge_l(prediction: str, ground_truth: str) -> float:
    try:
        from rouge import Rouge
    except ImportError as e:  # pragma: no cover - message only
        raise ImportError("rouge backend 'rouge-package' needs rouge: pip install 'ft-transformers[longbench]'") from e
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:  # the published scorer's bare except (RecursionError included) -> 0
        return 0.0


#: ROUGE backends: "official" (default, faithful), "lcs" (deviation: the true score on long
#: texts), "rouge-package" (the `rouge` package itself, for cross-checks).
ROUGE_BACKENDS: tuple[str, ...] = ("official", "lcs", "rouge-package")


def _rouge(prediction: str, ground_truth: str, backend: str, metric: str) -> float:
    if backend == "rouge-package":
        return _package_rouge_l(prediction, ground_truth)
    if backend not in ROUGE_BACKENDS:
        raise ValueError(f"rouge_backend must be one of {', '.join(ROUGE_BACKENDS)}, got {backend!r}")
    s = rouge_l_scores(prediction, ground_truth, overflow_metric=metric if backend == "official" else None)
    return 0.0 if s is None else s["f"]


def rouge_score(prediction: str, ground_truth: str, *, rouge_backend: str = "official", **_) -> float:
    """ROUGE-L F of LongBench (0.0 where the official scorer raises, under the default backend)."""
    return _rouge(prediction, ground_truth, rouge_backend, "rouge")


def rouge_zh_score(prediction: str, ground_truth: str, *, rouge_backend: str = "official", **_) -> float:
    """ROUGE-L over jieba words (joined by spaces)."""
    return _rouge(" ".join(jieba_cut(prediction)), " ".join(jieba_cut(ground_truth)), rouge_backend,
                  "rouge_zh")


# --------------------------------------------------------------------------------------------
# Classification, retrieval, count
# --------------------------------------------------------------------------------------------

def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str],
                         faithful: bool = True, **_) -> float:
    """1/k if the true class is among the k class names found in the prediction, else 0.

    Class names found in the prediction that are substrings of the (longer) true class are
    discarded first, so that e.g. "location" does not dilute a correct "Other location".
    The published loop removes items from the list it iterates over, which skips the candidate
    right after each removal; ``faithful=True`` reproduces that, ``False`` filters them all.
    (The published code also has a fuzzy-match fallback guarded by ``list != 0``, which is
    always true, so the fallback never runs; it is not reproduced.)
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes")
    found = [c for c in all_classes if c in prediction]
    if faithful:
        pos = 0
        while pos < len(found):
            term = found[pos]
            if term in ground_truth and term != ground_truth:
                found.remove(term)  # the element now at `pos` is the one the iterator skips
            pos += 1
    else:
        found = [c for c in found if not (c in ground_truth and c != ground_truth)]
    if ground_truth in found:
        return 1.0 / len(found)
    return 0.0


_DIGITS = re.compile(r"\d+")


def _fraction_equal(numbers: list[str], target: str) -> float:
    if not numbers:
        return 0.0
    return sum(1 for x in numbers if x == target) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the true count."""
    return float(_fraction_equal(_DIGITS.findall(prediction), str(ground_truth)))


def _retrieval(prediction: str, ground_truth: str, pattern: str) -> float:
    ids = re.findall(pattern, ground_truth)
    if not ids:
        raise ValueError(f"reference {ground_truth!r} does not name a paragraph ({pattern})")
    return float(_fraction_equal(_DIGITS.findall(prediction), ids[0]))


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the id in "Paragraph <id>"."""
    return _retrieval(prediction, ground_truth, r"Paragraph (\d+)")


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """Share of the numbers in the prediction that equal the id in "段落<id>"."""
    return _retrieval(prediction, ground_truth, r"段落(\d+)")


# --------------------------------------------------------------------------------------------
# Code similarity
# --------------------------------------------------------------------------------------------

def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) with no backtick, ``#`` or ``//``; "" if none."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def fuzz_ratio(a: str, b: str, backend: str = "difflib") -> int:
    """``fuzzywuzzy.fuzz.ratio``: equal strings 100, an empty one 0, else the rounded percentage."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    if backend == "difflib":
        return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))
    if backend == "indel":
        total = len(a) + len(b)
        return int(round(100 * (total - _indel_distance(a, b)) / total))
    raise ValueError(f"code_sim backend must be 'difflib' or 'indel', got {backend!r}")


def _indel_distance(a: str, b: str) -> int:
    try:
        from rapidfuzz.distance import Indel
        return int(Indel.distance(a, b))
    except ImportError:
        lcs = 0
        prev = [0] * (len(b) + 1)
        for ca in a:
            row = [0]
            for j, cb in enumerate(b, 1):
                row.append(prev[j - 1] + 1 if ca == cb else max(prev[j], row[j - 1]))
            prev = row
        lcs = prev[-1]
        return len(a) + len(b) - 2 * lcs


def code_sim_score(prediction: str, ground_truth: str, *, code_sim_backend: str = "difflib", **_) -> float:
    return fuzz_ratio(first_code_line(prediction), ground_truth, code_sim_backend) / 100


# --------------------------------------------------------------------------------------------
# Registry and aggregation
# --------------------------------------------------------------------------------------------

METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}


def metric_for(task_or_metric: str) -> tuple[str, Callable[..., float]]:
    """``(metric name, function)`` for a task (``_e`` suffix allowed) or a metric name."""
    name = TASK_METRIC.get(base_task(task_or_metric), task_or_metric)
    if name not in METRICS:
        raise KeyError(f"unknown LongBench task or metric {task_or_metric!r}; tasks: "
                       f"{', '.join(LONGBENCH_TASKS)}; metrics: {', '.join(METRICS)}")
    return name, METRICS[name]


def score_row(task: str, prediction: str, answers: Iterable[str], *, all_classes=None,
              **options) -> float:
    """Best score over the reference answers (0..1), with the few-shot first-line rule."""
    _, fn = metric_for(task)
    if base_task(task) in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    best = 0.0
    for ref in answers:
        best = max(best, fn(prediction, ref, all_classes=all_classes, **options))
    return best


def _pct_total(values: Sequence[float]) -> float:
    """The task score as the published scorer computes it: ``round(100 * sum / n, 2)``."""
    if not values:
        return math.nan
    total = 0.0
    for v in values:
        total += v
    return round(100 * total / len(values), 2)


def _pct_mean(values: Sequence[float]) -> float:
    """A LongBench-E bucket score: ``round(100 * numpy.mean, 2)``; NaN for an empty bucket."""
    if not values:
        return math.nan
    import numpy as np
    return round(100 * float(np.mean(np.asarray(values, dtype=np.float64))), 2)


def score_task(task: str, predictions: Sequence[str], answers: Sequence[Sequence[str]], *,
               all_classes=None, lengths: Sequence[int] | None = None, **options) -> dict:
    """Per-task result: ``score`` (0..100, 2 decimals), ``n``, per-row ``scores`` and, when
    ``lengths`` are given, LongBench-E ``buckets`` ({"0-4k", "4-8k", "8k+"} -> score or NaN)."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    rows = [score_row(task, p, a, all_classes=all_classes, **options)
            for p, a in zip(predictions, answers, strict=True)]
    out: dict = {"task": base_task(task), "metric": metric_for(task)[0], "n": len(rows),
                 "score": _pct_total(rows), "scores": rows}
    if lengths is not None:
        if len(lengths) != len(rows):
            raise ValueError(f"{len(lengths)} lengths for {len(rows)} predictions")
        groups: dict[str, list[float]] = {b: [] for b in LENGTH_BUCKETS}
        for s, n in zip(rows, lengths, strict=True):
            groups[length_bucket(n)].append(s)
        out["buckets"] = {b: _pct_mean(v) for b, v in groups.items()}
        out["bucket_n"] = {b: len(v) for b, v in groups.items()}
    return out


# --------------------------------------------------------------------------------------------
# `evaluate` glue (used by the metric modules in this folder)
# --------------------------------------------------------------------------------------------

_CITATION = """\
@inproceedings{bai2024longbench,
  title={LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding},
  author={Bai, Yushi and Lv, Xin and Zhang, Jiajie and Lyu, Hongchang and Tang, Jiankai and Huang, Zhidian
          and Du, Zhengxiao and Liu, Xiao and Zeng, Aohan and Hou, Lei and Dong, Yuxiao and Tang, Jie
          and Li, Juanzi},
  booktitle={Proceedings of the 62nd Annual Meeting of the Association for Computational Linguistics},
  year={2024}
}
"""

_DESCRIPTIONS = {
    "qa_f1": "Token F1 after SQuAD normalisation (English QA tasks).",
    "qa_f1_zh": "Token F1 over jieba words after Chinese normalisation (multifieldqa_zh).",
    "rouge": "Summary-level ROUGE-L F of the `rouge` package (unique words, '.'-split sentences).",
    "rouge_zh": "ROUGE-L F over jieba words (dureader, vcsum).",
    "classification": "1/k when the true class is among the k class names found (trec, lsht).",
    "retrieval": "Share of the numbers in the prediction equal to the true paragraph id.",
    "retrieval_zh": "Share of the numbers in the prediction equal to the true paragraph id (段落N).",
    "count": "Share of the numbers in the prediction equal to the true count (passage_count).",
    "code_sim": "fuzzywuzzy ratio of the first code line of the prediction (lcc, repobench-p).",
    "task": "A whole LongBench task: its metric, the first-line rule of the few-shot tasks, the "
            "best score over the reference answers, and LongBench-E length buckets.",
}

_INPUTS = """
Args:
    predictions: list of generated strings.
    references: list of reference answers per prediction (a list of strings, or one string).
    all_classes: the task's class names (classification; the same for every row of a task).
    lengths: LongBench word counts of the rows; adds LongBench-E buckets (task module only).
    rouge_backend: "official" (default: as published, 0.0 where its recursion overflows), "lcs"
        (deviation: the true score on long texts) or "rouge-package" (the `rouge` package).
    code_sim_backend: "difflib" (default, fuzzywuzzy without python-Levenshtein) or "indel".
    faithful: classification filter as published (default True).
Returns:
    score: mean score in percent, rounded to 2 decimals as LongBench reports it;
    scores: per-row scores in [0, 1] (best over the references); n: number of rows;
    buckets / bucket_n: LongBench-E "0-4k", "4-8k", "8k+" (task module, with lengths).
"""


def evaluate_info(kind: str, config_name: str | None = None):
    """The `evaluate.MetricInfo` of a LongBench metric module (``kind`` = metric name or "task")."""
    import datasets
    import evaluate

    string_refs = datasets.Features({"predictions": datasets.Value("string"),
                                     "references": datasets.Value("string")})
    list_refs = datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))})
    return evaluate.MetricInfo(
        module_type="metric",
        description=_DESCRIPTIONS[kind] + (f" Config: {config_name}." if config_name else ""),
        citation=_CITATION,
        inputs_description=_INPUTS,
        features=[list_refs, string_refs],
        homepage="https://github.com/THUDM/LongBench",
    )


def _as_lists(references) -> list[list[str]]:
    return [[r] if isinstance(r, str) else list(r) for r in references]


def evaluate_compute(kind: str, predictions, references, *, config_name: str | None = None,
                     lengths=None, **options) -> dict:
    """What a LongBench metric module returns (see `_INPUTS`)."""
    refs = _as_lists(references)
    if kind == "task":
        task = config_name if config_name not in (None, "default") else options.pop("task", None)
        if task is None:
            raise ValueError("the longbench_score module needs the task: "
                             "evaluate.load(path, config_name='<task>') or compute(task=...)")
        res = score_task(task, list(predictions), refs, lengths=lengths, **options)
        return res
    if lengths is not None:
        raise ValueError("lengths (LongBench-E buckets) go to the task module longbench_score")
    fn = METRICS[kind]
    rows = [max([fn(p, r, **options) for r in a], default=0.0)
            for p, a in zip(predictions, refs, strict=True)]
    return {"metric": kind, "n": len(rows), "score": _pct_total(rows), "scores": rows}
