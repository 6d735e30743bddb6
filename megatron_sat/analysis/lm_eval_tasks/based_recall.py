"""Prompt and metric of the three recall tasks in the paper's retrieval suite that lm-eval 0.4.13 lacks.

based_triviaqa, based_nq_2048 and based_drop come from HazyResearch's Based evaluation harness (Arora et
al., 2024), where they are Python task classes; lm-eval 0.4.13 does not ship them (pull request
EleutherAI/lm-evaluation-harness#3507 would add them). They are restated here as plain lm-eval YAML
configs (based_*.yaml beside this file) over the functions below, with the same protocol:

    prompt    the passage, with a trailing copy of the question cut off and TriviaQA's [PAR] / [DOC] /
              [TLE] markers removed, then ". " and the cloze question
    answer    greedy generation until a newline, at most 48 tokens
    contains  1 when any reference answer occurs in the generation, ignoring case, else 0

The data sets are on the Hugging Face hub: hazyresearch/based_triviaqa, hazyresearch/based_nq_2048 and
hazyresearch/based_drop (validation split; fields context, question, answers). lm-eval imports this
file by its path (the YAMLs' `!function based_recall.<name>`), so it imports nothing from megatron_sat.
"""

import re
from typing import List, Sequence

_MARKERS = re.compile(r"\[(?:PAR|DOC|TLE)\]")


def _prompt(context: str, question: str) -> str:
    context, question = context.strip(), question.strip()
    while question and context.lower().endswith(question.lower()):  # the passage may end with the question
        context = context[: -len(question)]
    return context.strip().strip(".") + ". " + question


def prompt(doc: dict) -> str:
    """based_nq_2048, based_drop: passage, full stop, question."""
    return _prompt(doc["context"], doc["question"])


def triviaqa_prompt(doc: dict) -> str:
    """based_triviaqa: the same, after removing the [PAR] / [DOC] / [TLE] markers of its passages."""
    return _prompt(_MARKERS.sub("", doc["context"].strip()), doc["question"])


def target(doc: dict) -> str:
    """The first reference answer (only used to show few-shot examples; the suite runs 0-shot)."""
    return " " + (doc["answers"][0] if doc["answers"] else "unanswerable")


def contains(generation: str, answers: Sequence[str]) -> int:
    return int(any(re.search(re.escape(a), generation, re.IGNORECASE) for a in answers))


def process_results(doc: dict, results: List[str]) -> dict:
    return {"contains": contains(results[0], doc["answers"])}
