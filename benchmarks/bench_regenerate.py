"""Where regeneration's time goes: continuous batching (`jaxspec.generate.continuous_generate`, what `jaxspec
regenerate` runs) over a prompt file, its prefill calls (`_start_rows`) and decoding calls (`_continue_rows`)
timed apart, twice in one process (the second pass is warm: no compilation):

    python benchmarks/bench_regenerate.py --prompts data/prompts-code-all.jsonl --first 3500 --count 192 --batch-size 64

The prompt file is one {"prompt": ...} per line (`scripts/make_prompts.py`); prompts over --max-prompt-tokens are
skipped, as `jaxspec regenerate` skips them. Features of --feature-layers are saved while generating, as there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import jax

from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.tokenizer import encode_prompt

generation = importlib.import_module("jaxspec.generate")  # the module (the package exports its function `generate`)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", required=True, help="a JSON Lines file of {\"prompt\": ...}")
    parser.add_argument("--first", type=int, default=0, help="the first prompt of the file to answer")
    parser.add_argument("--count", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--feature-layers", default="2,15,27,29")
    args = parser.parse_args()
    os.environ.setdefault("JAXSPEC_LAYERS", "unstacked")  # the layout `jaxspec regenerate` runs on CPU
    model = load_model(args.model)
    with open(args.prompts, encoding="utf-8") as f:
        texts = [json.loads(line)["prompt"] for line in f][args.first: args.first + args.count]
    prompts = [ids for ids in (encode_prompt(model.tokenizer, t) for t in texts) if len(ids) <= args.max_prompt_tokens]
    layers = tuple(int(i) for i in args.feature_layers.split(",") if i)

    seconds = {"prefill": 0.0, "decode": 0.0}
    calls = {"prefill": 0, "decode": 0}

    def timed(function, name):
        def run(*a, **k):
            start = time.perf_counter()
            out = jax.block_until_ready(function(*a, **k))
            seconds[name] += time.perf_counter() - start
            calls[name] += 1
            return out
        return run

    start_rows, continue_rows = generation._start_rows, generation._continue_rows
    generation._start_rows, generation._continue_rows = timed(start_rows, "prefill"), timed(continue_rows, "decode")
    try:
        for run in ("cold", "warm"):
            seconds.update(prefill=0.0, decode=0.0)
            calls.update(prefill=0, decode=0)
            start, tokens = time.perf_counter(), 0
            for _, answer, _ in generation.continuous_generate(
                    model.weights, model.config, prompts, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, hidden_layers=layers):
                tokens += len(answer)
            total = time.perf_counter() - start
            print(f"{run}: {len(prompts)} answers, {tokens} tokens in {total:.1f} s, {tokens / total:.1f} tok/s; "
                  f"prefill {seconds['prefill']:.1f} s ({calls['prefill']} calls), decoding {seconds['decode']:.1f} s "
                  f"({calls['decode']} calls), host {total - seconds['prefill'] - seconds['decode']:.1f} s",
                  flush=True)
    finally:
        generation._start_rows, generation._continue_rows = start_rows, continue_rows


if __name__ == "__main__":
    main()
