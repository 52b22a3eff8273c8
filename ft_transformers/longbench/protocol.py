"""LongBench v1 prediction protocol: prompt templates, generation budgets, prompt building.

The templates and the per-task ``max_new_tokens`` are the benchmark's published ones (they are
part of the protocol: changing a character changes the scores). Prompt building follows the
reference harness:

1. fill the task template with the row's ``context`` and ``input``;
2. tokenise it whole; if it is longer than ``max_length`` tokens, keep the first and the last
   ``max_length // 2`` tokens, decoded back to text (*middle* truncation: instructions sit at
   both ends);
3. wrap it in the model's chat template, except for the few-shot and code tasks (trec,
   triviaqa, samsum, lsht, lcc, repobench-p), whose prompts already end where the answer starts;
4. tokenise again (without a second BOS where the chat template already wrote one).

Generation is greedy (one beam, no sampling). samsum stops at the first newline as well as at
EOS and generates at least one token (its few-shot prompt otherwise invites "\\nDialogue: ...").
"""

from __future__ import annotations

from dataclasses import dataclass

from .metrics.longbench_core import LONGBENCH_E_TASKS, LONGBENCH_TASKS, TASK_METRIC, base_task

__all__ = [
    "CATEGORIES",
    "LEADERBOARD",
    "LONGBENCH_E_TASKS",
    "LONGBENCH_TASKS",
    "MAX_NEW_TOKENS",
    "NO_CHAT_TASKS",
    "PROMPTS",
    "TASK_METRIC",
    "NOMINAL_WINDOWS",
    "PROMPT_BUDGET_MARGIN",
    "BuiltPrompt",
    "PromptBudget",
    "base_task",
    "build_prompt",
    "middle_truncate",
    "prompt_budget",
]

_QA_PASSAGES = ("Answer the question based on the given passages. Only give me the answer and do not "
                "output any other words.\n\nThe following are given passages.\n{context}\n\n"
                "Answer the question based on the given passages. Only give me the answer and do not "
                "output any other words.\n\nQuestion: {input}\nAnswer:")

_QASPER_RULES = ("as concisely as you can, using a single phrase or sentence if possible. If the question "
                 "cannot be answered based on the information in the article, write \"unanswerable\". "
                 "If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". "
                 "Do not provide any explanation.")

# "asconcisely" (no space) is the published template's text: it is part of the protocol.
_NARRATIVE_RULES = ("asconcisely as you can, using a single phrase if possible. "
                    "Do not provide any explanation.")

#: Prompt template per task (``str.format`` with the row's fields).
PROMPTS: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. "
        f"Answer the question {_NARRATIVE_RULES}\n\nStory: {{context}}\n\n"
        f"Now, answer the question based on the story {_NARRATIVE_RULES}\n\nQuestion: {{input}}\n\nAnswer:"
    ),
    "qasper": (
        f"You are given a scientific article and a question. Answer the question {_QASPER_RULES}\n\n"
        f"Article: {{context}}\n\n Answer the question based on the above article {_QASPER_RULES}\n\n"
        "Question: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\n"
        "Now, answer the following question based on the above text, only give me the answer and do "
        "not output any other words.\n\nQuestion: {input}\nAnswer:"
    ),
    "multifieldqa_zh": (
        "阅读以下文字并用中文简短回答：\n\n{context}\n\n"
        "现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答："
    ),
    "hotpotqa": _QA_PASSAGES,
    "2wikimqa": _QA_PASSAGES,
    "musique": _QA_PASSAGES,
    "dureader": ("请基于给定的文章回答下述问题。\n\n文章：{context}\n\n"
                 "请基于上述文章回答下面的问题。\n\n问题：{input}\n回答："),
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
        "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the "
        "query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the "
        "above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\n"
        "News:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    ),
    "vcsum": ("下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n"
              "会议记录：\n{context}\n\n会议总结："),
    "trec": ("Please determine the type of the question below. Here are some examples of questions.\n\n"
             "{context}\n{input}"),
    "triviaqa": ("Answer the question based on the given passage. Only give me the answer and do not output "
                 "any other words. The following are some examples.\n\n{context}\n\n{input}"),
    "samsum": ("Summarize the dialogue into a few short sentences. The following are some examples.\n\n"
               "{context}\n\n{input}"),
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
        "carefully read these paragraphs and determine how many unique paragraphs there are after removing "
        "duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\n"
        "Please enter the final count of unique paragraphs after removing duplicates. The output format "
        "should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph "
        "the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\n"
        "Please enter the number of the paragraph that the abstract is from. The answer format must be "
        "like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: "
    ),
    "passage_retrieval_zh": (
        "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
        "下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是："
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

#: Generation budget (new tokens) per task.
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}

#: Tasks prompted without the chat template (few-shot and code completion).
NO_CHAT_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

#: Tasks that also stop at a newline (and generate at least one token).
NEWLINE_STOP_TASKS: frozenset[str] = frozenset({"samsum"})

#: LongBench's six task categories (for category averages).
CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "Summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "Few-shot Learning": ("trec", "triviaqa", "samsum", "lsht"),
    "Synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "Code": ("lcc", "repobench-p"),
}

#: The leaderboard's categories per language (its "Avg" is the mean of these category means).
#: The code tasks are language-neutral and count in both tables, as on the leaderboard.
LEADERBOARD: dict[str, dict[str, tuple[str, ...]]] = {
    "en": {
        "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
        "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique"),
        "Summarization": ("gov_report", "qmsum", "multi_news"),
        "Few-shot Learning": ("trec", "triviaqa", "samsum"),
        "Synthetic": ("passage_count", "passage_retrieval_en"),
        "Code": ("lcc", "repobench-p"),
    },
    "zh": {
        "Single-Doc QA": ("multifieldqa_zh",),
        "Multi-Doc QA": ("dureader",),
        "Summarization": ("vcsum",),
        "Few-shot Learning": ("lsht",),
        "Synthetic": ("passage_retrieval_zh",),
        "Code": ("lcc", "repobench-p"),
    },
}

assert set(PROMPTS) == set(MAX_NEW_TOKENS) == set(LONGBENCH_TASKS) == set(TASK_METRIC)


# --------------------------------------------------------------------------------------------
# Prompt budget (LongBench's model2maxlen)
# --------------------------------------------------------------------------------------------

#: Tokens left for the answer: LongBench's ``model2maxlen`` is the nominal window minus 500.
PROMPT_BUDGET_MARGIN = 500

#: Nominal context windows in tokens, as LongBench names them ("8k" = 8,000, not 8,192).
#: The first eight are the models of the official ``config/model2maxlen.json`` (whose values
#: are these minus 500); the rest are models this project runs, with the window their model
#: card states, named the same way. Keys match a model tag or id case-insensitively, as a
#: substring (longest key first).
NOMINAL_WINDOWS: dict[str, int] = {
    "llama2-7b-chat-4k": 4000,
    "longchat-v1.5-7b-32k": 32000,
    "xgen-7b-8k": 8000,
    "internlm-7b-8k": 8000,
    "chatglm2-6b": 32000,
    "chatglm2-6b-32k": 32000,
    "chatglm3-6b-32k": 32000,
    "vicuna-v1.5-7b-16k": 16000,
    "smollm2": 8000,  # SmolLM2 (135M/360M/1.7B): an 8k window (max_position_embeddings 8,192)
}


@dataclass(frozen=True)
class PromptBudget:
    tokens: int    #: the prompt budget (``max_length`` of middle truncation)
    source: str    #: "table", "fallback" or "--max-length" (how it was chosen)
    rule: str      #: one line saying how, for run_config.json and the log


def _nominal_from_positions(n: int) -> int:
    """The nominal window of ``max_position_embeddings`` ``n``: a multiple of 1,024 tokens
    reads as "k" (8,192 -> "8k" -> 8,000), as LongBench names windows; anything else is taken
    as it is."""
    return (n // 1024) * 1000 if n % 1024 == 0 else n


def prompt_budget(names: list[str] | tuple[str, ...], max_position_embeddings: int | None,
                  requested: int | None = None) -> PromptBudget:
    """The prompt budget of a model: ``requested`` when given; else nominal window - 500 with
    the window from `NOMINAL_WINDOWS` (matched against ``names``: model tag, id, path); else,
    a deviation from the official harness, which has no rule for a model outside its table,
    the window read from ``max_position_embeddings`` (`_nominal_from_positions`)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--max-length must be >= 1, got {requested}")
        return PromptBudget(int(requested), "--max-length", f"--max-length {requested}")
    low = [str(n).lower() for n in names if n]
    for key in sorted(NOMINAL_WINDOWS, key=len, reverse=True):
        if any(key in n for n in low):
            w = NOMINAL_WINDOWS[key]
            return PromptBudget(w - PROMPT_BUDGET_MARGIN, "table",
                                f"LongBench rule: nominal window {w} ({key}) - {PROMPT_BUDGET_MARGIN}")
    if not max_position_embeddings:
        raise ValueError(f"no nominal window known for {names} and the config has no "
                         "max_position_embeddings: give --max-length")
    w = _nominal_from_positions(int(max_position_embeddings))
    if w <= PROMPT_BUDGET_MARGIN:
        raise ValueError(f"max_position_embeddings {max_position_embeddings} leaves no prompt budget: "
                         "give --max-length")
    return PromptBudget(w - PROMPT_BUDGET_MARGIN, "fallback",
                        f"deviation (model not in LongBench's table): nominal window {w} read from "
                        f"max_position_embeddings {max_position_embeddings}, - {PROMPT_BUDGET_MARGIN}")


@dataclass
class BuiltPrompt:
    text: str              #: the final prompt text (after truncation and chat template)
    input_ids: list[int]   #: its token ids, as fed to the model
    raw_tokens: int        #: tokens of the filled template before truncation
    truncated: bool        #: whether middle truncation cut it
    chat: bool             #: whether the chat template was applied


def fill_template(task: str, row: dict) -> str:
    return PROMPTS[base_task(task)].format(context=row.get("context", ""), input=row.get("input", ""))


def _ids(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    return list(tokenizer(text, truncation=False, add_special_tokens=add_special_tokens)["input_ids"])


def middle_truncate(tokenizer, text: str, max_length: int) -> tuple[str, int, bool]:
    """``(text, tokens before, truncated)``: keep the first and last ``max_length // 2`` tokens."""
    ids = _ids(tokenizer, text)
    if len(ids) <= max_length:
        return text, len(ids), False
    half = int(max_length / 2)
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True) if half > 0 else ""
    return head + tail, len(ids), True


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def build_prompt(tokenizer, task: str, row: dict, max_length: int, *, chat: str = "auto") -> BuiltPrompt:
    """The model input of one row (see the module docstring).

    ``chat``: "auto" (the tokenizer's chat template where it has one, for the tasks that use it),
    "always" (error when the tokenizer has none), or "never".
    """
    if chat not in ("auto", "always", "never"):
        raise ValueError(f"chat must be auto|always|never, got {chat!r}")
    text, raw, truncated = middle_truncate(tokenizer, fill_template(task, row), max_length)
    use_chat = False
    if base_task(task) not in NO_CHAT_TASKS and chat != "never":
        if has_chat_template(tokenizer):
            use_chat = True
        elif chat == "always":
            raise ValueError("--chat always, but the tokenizer has no chat template")
    add_special = True
    if use_chat:
        text = apply_chat(tokenizer, text)
        bos = getattr(tokenizer, "bos_token", None)
        # A template that writes its own BOS must not get a second one from the tokenizer.
        if bos and text.startswith(bos):
            add_special = False
    return BuiltPrompt(text, _ids(tokenizer, text, add_special), raw, truncated, use_chat)


def newline_token_id(tokenizer) -> int | None:
    """The id that a bare newline encodes to (its last token), or None if it encodes to nothing."""
    ids = tokenizer.encode("\n", add_special_tokens=False)
    return int(ids[-1]) if len(ids) else None
