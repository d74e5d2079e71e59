"""The `jaxspec` command line.

    jaxspec generate --prompt "What is the capital of France?"
    jaxspec generate --model path/to/model.gguf --prompts-file prompts.jsonl --json
    jaxspec generate --mesh data=4,model=2 --method eagle3 --prompts-file prompts.jsonl --json --batch-size 8

With --mesh the batch rows split over the mesh's data axis; a batch that the data axis does not divide is padded
with copies of its last prompt, whose outputs are dropped.

Mistakes a user can fix (a missing model, a bad file, a prompt that does not fit) print one line on stderr and
exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from jaxspec.arguments import (
    add_layers_arg,
    add_method_args,
    add_model_args,
    check_mesh_arg,
    dtype_from_name,
    initialize_distributed,
    method_options,
)
from jaxspec.data import read_prompts_file
from jaxspec.errors import UserError


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", help="JSON Lines file, one object with a \"prompt\" field per line")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the chat template (default when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="feed the prompt as plain text")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cache-length", type=int, default=None,
                   help="cache slots per row (default: the model's context length)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts decoded together with --json")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    p.add_argument("--speedup", action="store_true",
                   help="speculative methods: also decode the same prompts autoregressively and print the wall-clock "
                        "speedup (both timed after a warm-up run, so compilation is excluded)")


def _mesh_rows(method) -> int:
    """Rows the method's batch must be a multiple of: the size of its mesh's data axis (1 without one)."""
    mesh = method.mesh
    return dict(mesh.shape).get("data", 1) if mesh is not None else 1


def _generate_padded(method, rows, **options):
    """method.generate on `rows`, padded with copies of the last row up to a multiple of the mesh's data axis;
    the padding rows' outputs are dropped (the timing covers the padded batch)."""
    pad = -len(rows) % _mesh_rows(method)
    result = method.generate(list(rows) + [rows[-1]] * pad, **options)
    if pad:
        trimmed = {name: getattr(result, name)[:len(rows)] for name in ("token_ids", "rounds", "accepted")
                   if isinstance(getattr(result, name, None), list)}
        result = dataclasses.replace(result, **trimmed)
    return result


def build_parser() -> argparse.ArgumentParser:
    from jaxspec.methods import METHODS
    from jaxspec.registry import METHOD_SPECS

    parser = argparse.ArgumentParser(prog="jaxspec", description="Speculative decoding for LLMs in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    methods = "\n".join(f"  {s.name:15} {s.summary}" + (f" ({', '.join(s.flags())})" if s.options else "")
                         for s in METHOD_SPECS.values())
    gen = sub.add_parser("generate", help="generate text with a target model",
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         epilog=f"methods (the options each takes in parentheses):\n{methods}")
    add_model_args(gen)
    add_layers_arg(gen)
    _add_generation_args(gen)
    gen.add_argument("--method", choices=METHODS, default="autoregressive", help="decoding method")
    add_method_args(gen)
    from jaxspec.bench import add_bench_parser
    from jaxspec.training.distill import add_train_parser
    from jaxspec.training.regenerate import add_regenerate_parser

    export = sub.add_parser("export", help="copy a trained drafter for shipping (smaller dtype) or as a Hugging Face "
                            "EAGLE-3 folder that vLLM and SGLang load")
    export.add_argument("--drafter", required=True, help="a drafter folder written by `jaxspec train`")
    export.add_argument("--out", required=True, help="the folder to write")
    export.add_argument("--format", choices=("jaxspec", "hf"), default="jaxspec",
                        help="jaxspec: the same checkpoint with its matrices in --dtype; hf: EAGLE-3 in the public "
                             "Hugging Face layout (config.json + model.safetensors, d2t/t2d), Medusa in the Medusa "
                             "repository's (config.json + medusa_lm_head.safetensors)")
    export.add_argument("--storage-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                        help="dtype of the written matrices (norms and token ids keep theirs)")
    add_model_args(export)
    add_bench_parser(sub)
    add_regenerate_parser(sub)
    add_train_parser(sub)
    from jaxspec.plan import add_plan_parser

    add_plan_parser(sub)
    return parser


def cmd_generate(args) -> None:
    from jaxspec.budget import chosen_layout
    from jaxspec.generate import pad_prompts
    from jaxspec.loading import load_model
    from jaxspec.methods import check_method_options
    from jaxspec.model import layers_layout
    from jaxspec.sampling import SamplingConfig
    from jaxspec.tokenizer import encode_prompt

    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        raise UserError("Give a prompt with --prompt TEXT or --prompts-file FILE.")
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}.")
    if args.speedup and args.method == "autoregressive":
        raise UserError("--speedup compares a speculative method with autoregressive decoding; add e.g. "
                        "--method eagle3.")
    mesh = check_mesh_arg(args)
    check_method_options(args.method, method_options(args))  # before the model is loaded
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    model = load_model(args.model, dtype=dtype_from_name(args.dtype), mesh=mesh)
    if model.tokenizer is None:
        raise UserError(
            f"'{model.source}' has no tokenizer (tokenizer.json); add one to the folder to prompt with text."
        )
    try:
        prompt_ids = [encode_prompt(model.tokenizer, p, args.chat) for p in prompts]
    except ValueError as e:
        raise UserError(str(e)) from None
    pad_prompts(prompt_ids, args.max_new_tokens, model.config, args.max_cache_length)  # fits the cache: checked now
    layout = "stacked"  # a mesh runs the stacked layers (jaxspec.model.execution_weights)
    if mesh is None:
        layout, why = chosen_layout(model, min(len(prompt_ids), args.batch_size) if args.json else 1, args.layers)
        if why:
            print(f"[{why}]", file=sys.stderr)
    with layers_layout(layout):
        _generate(args, model, prompts, prompt_ids, sampling)


def _generate(args, model, prompts: list[str], prompt_ids: list[list[int]], sampling) -> None:
    """`jaxspec generate` once the model is loaded and the prompts encoded (cmd_generate), in the chosen layout."""
    from jaxspec.generate import stream_generate
    from jaxspec.methods import MethodOptions, build_method
    from jaxspec.metrics import tau

    options = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                   max_cache_length=args.max_cache_length)
    eos = set(model.config.eos_token_ids)
    method = build_method(args.method, model, method_options(args))

    if args.speedup and method.drafter is None:
        raise UserError("--speedup compares a speculative method with autoregressive decoding; add e.g. "
                        "--method eagle3.")
    baseline = build_method("autoregressive", model, MethodOptions(mesh=args.mesh)) if args.speedup else None
    if method.cost_model is not None:  # --budget auto: show the choice and the model behind it
        rows = min(len(prompt_ids), args.batch_size) if args.json else 1
        chosen, table, _ = method.auto_table(rows, greedy=sampling.temperature == 0)
        print(f"[--budget auto at batch {rows}: {chosen}]\n{table}", file=sys.stderr)
    if args.json or method.drafter is not None or method.mesh is not None:  # streaming: one device, no drafter
        for start in range(0, len(prompts), args.batch_size if args.json else 1):
            rows = prompt_ids[start: start + (args.batch_size if args.json else 1)]
            ar_result = None
            if baseline is not None:  # warm-up runs compile both; the timed runs follow
                _generate_padded(method, rows, **options)
                _generate_padded(baseline, rows, **options)
                ar_result = _generate_padded(baseline, rows, **options)
            result = _generate_padded(method, rows, **options)
            for i, ids in enumerate(result.token_ids):
                text_ids = [t for t in ids if t not in eos]
                text = model.tokenizer.decode(text_ids, skip_special_tokens=True)
                stats = {
                    "tokens": len(ids),
                    "seconds": round(result.seconds, 4),
                    "tokens_per_second": round(len(ids) / result.seconds, 2),
                    "batch_size": len(rows),
                    "method": method.name,
                }
                if method.is_pipeline:  # counters of the whole batch
                    stats.update(num_stages=result.num_stages, pipeline_steps=result.steps, bubbles=result.bubbles,
                                 rejections=result.rejections, sibling_promotions=result.promotions,
                                 alpha=round(result.alpha, 4),
                                 equivalent_acceptance=round(result.equivalent_acceptance, 3))
                elif method.drafter is not None:
                    row_accepted = result.accepted[i]
                    stats.update(rounds=result.rounds[i], tau=round(tau([row_accepted]), 3) if row_accepted else None,
                                 accepted_per_round=row_accepted,
                                 draft_nodes_per_round=result.num_draft_nodes)
                if ar_result is not None:
                    ar_rate = sum(map(len, ar_result.token_ids)) / ar_result.seconds  # the whole batch's rate
                    rate = sum(map(len, result.token_ids)) / result.seconds
                    stats.update(autoregressive_tokens_per_second=round(ar_rate, 2), speedup=round(rate / ar_rate, 3))
                    if sampling.temperature == 0:  # greedy: lossless means the very same tokens
                        stats["same_tokens_as_autoregressive"] = ids == ar_result.token_ids[i]
                if not args.json:
                    print(text, flush=True)
                    extra = f", tau {stats['tau']}" if "tau" in stats else ""
                    if method.is_pipeline:
                        extra = (f", {result.num_stages} stages: L'acc {stats['equivalent_acceptance']} "
                                 f"({result.exits} tokens in {result.steps} pipeline steps, {result.bubbles} bubbles)")
                    rate = stats["tokens_per_second"]
                    print(f"[{method.name}: {len(ids)} tokens in {result.seconds:.2f} s, {rate} tokens/s{extra}]",
                          file=sys.stderr)
                    if ar_result is not None:
                        same = {True: ", identical tokens", False: ", DIFFERENT tokens", None: ""}[
                            stats.get("same_tokens_as_autoregressive")]
                        print(f"[speedup {stats['speedup']:.2f}x over autoregressive decoding "
                              f"({stats['autoregressive_tokens_per_second']} tokens/s{same}; compilation "
                              "excluded)]", file=sys.stderr)
                    continue
                record = {
                    "prompt": prompts[start + i],
                    "prompt_ids": rows[i],
                    "token_ids": ids,
                    "text": text,
                    "stats": stats,
                }
                print(json.dumps(record, ensure_ascii=False), flush=True)
        return

    for ids in prompt_ids:
        generated: list[int] = []
        printed = ""
        start = time.perf_counter()
        first_token_at = None
        for step_tokens in stream_generate(model.weights, model.config, [ids], **options):
            first_token_at = first_token_at or time.perf_counter()
            token = int(step_tokens[0])
            if token in eos or token < 0:
                break
            generated.append(token)
            text = model.tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
        end = time.perf_counter()
        sys.stdout.write("\n")
        # the first token waits for compilation and prefill; the rate after it is the decoding speed
        rate = (len(generated) - 1) / (end - first_token_at) if len(generated) > 1 else float("nan")
        print(f"[{len(generated)} tokens in {end - start:.2f} s (first token after {first_token_at - start:.2f} s, "
              f"compilation included); {rate:.1f} tokens/s after it]", file=sys.stderr)


def cmd_export(args) -> None:
    from jaxspec.checkpoint import convert_drafter_dtype, load_drafter, read_drafter_meta

    if args.format == "jaxspec":
        out = convert_drafter_dtype(args.drafter, args.out, args.storage_dtype)
    else:
        from jaxspec.loading import load_model
        from jaxspec.methods import _method_config

        meta = read_drafter_meta(args.drafter)
        method = meta["method"]
        if method not in ("eagle3", "medusa"):
            raise UserError(f"--format hf writes EAGLE-3 and Medusa drafters; {args.drafter} is a '{method}' "
                            "drafter.")
        target = load_model(args.model, dtype=dtype_from_name(args.dtype), with_tokenizer=False)
        cfg = _method_config(method, meta["config"])
        cfg = cfg.for_target(target.config) if hasattr(cfg, "for_target") else cfg
        _, params = load_drafter(args.drafter, expected_method=method, target_fingerprint=target.fingerprint(),
                                 target_source=target.source,
                                 abstract_params=cfg.init_params(target.config, target.weights))
        if method == "medusa":
            from jaxspec.drafters.medusa_hf import export_medusa_hf

            out = export_medusa_hf(args.out, params, target.weights, dtype=args.storage_dtype,
                                   base_model=target.source)
        else:
            from jaxspec.drafters.eagle_hf import export_eagle3_hf

            out = export_eagle3_hf(args.out, params, cfg, target.config, dtype=args.storage_dtype,
                                   target_fingerprint=target.fingerprint(), target_source=target.source)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"Wrote {out} ({size / 1e6:.1f} MB)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        initialize_distributed(args)
        from jaxspec.budget import enable_compilation_cache

        # not for `bench --phases`: JAX's persistent cache keys leave out op-name metadata, so a program that an
        # earlier jaxspec compiled to the same computation comes back with that version's scope names, and the phase
        # split follows them (measured: 3.2 ms of the verification shown as "accept" after the scopes moved)
        if not (args.command == "bench" and getattr(args, "phases", False)):
            enable_compilation_cache()
        if args.command == "generate":
            cmd_generate(args)
        elif args.command == "bench":
            from jaxspec.bench import cmd_bench

            cmd_bench(args)
        elif args.command == "export":
            cmd_export(args)
        elif args.command == "regenerate":
            from jaxspec.training.regenerate import cmd_regenerate

            cmd_regenerate(args)
        elif args.command == "train":
            from jaxspec.training.distill import cmd_train

            cmd_train(args)
        elif args.command == "plan":
            from jaxspec.plan import cmd_plan

            return cmd_plan(args, argv)
    except UserError as e:
        print(f"jaxspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
