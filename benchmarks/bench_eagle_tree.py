"""EAGLE tree shape against speed: `python benchmarks/bench_eagle_tree.py [--drafter DIR] [--shapes 5x4x16,4x3x8]`.

For each dynamic-tree shape depth x top_k x nodes, the same drafter (default: the one shipped for the model) decodes
the same prompts greedily; printed side by side with autoregressive decoding from the same run: tau, tokens/s and
the wall-clock speedup. Every run is warmed up first (compilation excluded). Bigger trees raise tau but cost more
per verification (see bench_verify.py); this shows where the balance lies on this device.
"""

from __future__ import annotations

import argparse

from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.methods import MethodOptions, build_method
from jaxspec.prompts import load_prompt_set
from jaxspec.tokenizer import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--method", default="eagle3", choices=("eagle2", "eagle3"))
    parser.add_argument("--drafter", default=None, help="drafter folder (default: the shipped one)")
    parser.add_argument("--shapes", default="5x4x16,4x3x8,6x4x24,6x2x12",
                        help="comma list of depth x top_k x nodes")
    parser.add_argument("--prompt-sets", default="mt-bench,humaneval")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    model = load_model(args.model)
    prompts = [encode_prompt(model.tokenizer, text) for name in args.prompt_sets.split(",")
               for text in load_prompt_set(name, args.limit)]

    def timed(method):
        method.generate(prompts[:1], max_new_tokens=args.max_new_tokens)  # compiles (one shape bucket)
        tokens, seconds, accepted = 0, 0.0, []
        for ids in prompts:
            result = method.generate([ids], max_new_tokens=args.max_new_tokens)
            tokens += len(result.token_ids[0])
            seconds += result.seconds
            accepted += result.accepted[0] if hasattr(result, "accepted") else []  # speculative results only
        tau = (sum(accepted) + len(accepted)) / len(accepted) if accepted else float("nan")
        return tokens / seconds, tau

    base, _ = timed(build_method("autoregressive", model))
    print(f"{'shape (D x K x N)':<18} {'tau':>6} {'tok/s':>8} {'speedup':>8}")
    print(f"{'autoregressive':<18} {'-':>6} {base:>8.1f} {1.0:>7.2f}x", flush=True)
    for shape in args.shapes.split(","):
        depth, top_k, nodes = (int(x) for x in shape.split("x"))
        method = build_method(args.method, model, MethodOptions(drafter=args.drafter, num_draft_tokens=depth,
                                                                tree_width=top_k, tree_nodes=nodes))
        rate, tau = timed(method)
        print(f"{shape:<18} {tau:>6.2f} {rate:>8.1f} {rate / base:>7.2f}x", flush=True)


if __name__ == "__main__":
    main()
