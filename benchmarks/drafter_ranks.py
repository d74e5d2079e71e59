"""How well an EAGLE-3 head predicts the target along regenerated text: on samples it was trained on and on samples
of prompts it never saw (an overfit head shows a large gap).

    python benchmarks/drafter_ranks.py --data data/regen-smollm2-135m-b64 --seen 0:12 --unseen-from-prompt 2000
    python benchmarks/drafter_ranks.py --prompt-sets mt-bench,gsm8k,humaneval --limit 8 --depth 4

With --prompt-sets the target first answers the evaluation prompts (greedy, into a temporary folder that is deleted
after: measurement only, never training data), and the head is measured on each set's answers.

For each row the head runs teacher-forced (`jaxspec.drafters.eagle.draft_ranks`, what a round drafts while it is
accepted); printed: P(the head's top choice is the target's token at every depth up to j) and the tau of a chain of
`--depth` drafted tokens at T=0. The default drafter is the one shipped for SmolLM2-135M, trained on the answers to
the first 2000 ShareGPT prompts.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.data import RegeneratedDataset
from jaxspec.drafters.eagle import draft_ranks, draft_to_target
from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.methods import MethodOptions, build_method


def chain_acceptance(method, target, dataset, indices, depth: int) -> tuple[np.ndarray, float, int]:
    """(P(top-1 hit at depths 0..j) [depth], chain tau, measured positions) over dataset samples `indices`."""
    rows = [dataset.sample(i) for i in indices]
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int64)  # [R, S]
    for r, x in enumerate(rows):
        tokens[r, : len(x)] = x
    ranks = draft_ranks(method.params, target.weights, target.config, method.drafter.target_layers, tokens,
                        np.array([len(x) for x in rows]), dataset.prompt_lengths[list(indices)], depth,
                        head_cfg=method.drafter.head_config(target.config))  # [P, depth]
    hits = np.cumprod(ranks == 0, axis=1)  # [P, depth]
    return hits.mean(0), float((1 + hits.sum(1)).mean()), len(ranks)


def sampled_first_draft(method, target, dataset, indices) -> tuple[float, float, int]:
    """At temperature 1, the probability that the target keeps a round's first draft, two ways, along the samples:
    (the head's top choice drafted as a point mass: E p(argmax q), what jaxspec's rounds draft today; a draft sampled
    from the head's q and kept with probability min(1, p/q): E sum_x min(p(x), q(x)), the standard rule), and the
    number of positions. p: the target's softmax, q: the head's (over its draft vocabulary)."""
    from jaxspec.drafters.eagle import _chain_logits

    d2t = np.asarray(draft_to_target(method.params)).astype(np.int64)  # [Vd]
    point, sampled, positions = 0.0, 0.0, 0
    for i in indices:
        row = dataset.sample(i)
        start = int(dataset.prompt_lengths[i])
        head_logits, target_logits = _chain_logits(
            method.params, target.weights, target.config, method.drafter.head_config(target.config),
            tuple(method.drafter.target_layers), row[None].astype(np.int32), 1, target_logits=True)
        q = np.asarray(jax.nn.softmax(head_logits[0, 0].astype(jnp.float32), axis=-1), np.float64)  # [S, Vd]
        p = np.asarray(jax.nn.softmax(target_logits[0].astype(jnp.float32), axis=-1), np.float64)  # [S, V]
        cols = np.arange(max(start - 1, 0), len(row) - 2)  # column t: the head predicts token t + 2
        p_next = p[cols + 1][:, d2t]  # [P, Vd] the target's distribution of token t + 2, on the draft vocabulary
        q_cols = q[cols]  # [P, Vd]
        point += float(np.take_along_axis(p_next, q_cols.argmax(-1)[:, None], axis=-1).sum())
        sampled += float(np.minimum(p_next, q_cols).sum())
        positions += len(cols)
    return point / positions, sampled / positions, positions


def vocabulary_coverage(method, dataset, indices) -> float:
    """The fraction of the samples' response tokens that the head's draft vocabulary holds (it can draft no other)."""
    in_vocabulary = np.zeros(method.target.config.vocab_size, bool)  # [V]
    in_vocabulary[np.asarray(draft_to_target(method.params)).astype(np.int64)] = True
    responses = np.concatenate([dataset.sample(i)[int(dataset.prompt_lengths[i]):] for i in indices])  # [N]
    return float(in_vocabulary[responses].mean())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--drafter", default=None, help="an EAGLE-3 drafter folder (default: the shipped one)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a folder written by `jaxspec regenerate` with this target")
    source.add_argument("--prompt-sets", help="comma-separated evaluation sets (mt-bench, gsm8k, humaneval): the "
                        "target answers their prompts first and the head is measured on each set's answers")
    p.add_argument("--limit", type=int, default=8, help="--prompt-sets: prompts a set")
    p.add_argument("--max-new-tokens", type=int, default=128, help="--prompt-sets: tokens of each answer")
    p.add_argument("--seen", default="0:12",
                   help="sample range start:end the head was trained on ('none': --data holds held-out samples only)")
    p.add_argument("--unseen-from-prompt", type=int, default=2000,
                   help="samples whose prompt index is at least this were never trained on")
    p.add_argument("--count", type=int, default=12, help="unseen samples to measure")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--sampled", action="store_true",
                   help="also the first draft's acceptance at T=1: the head's top choice as a point mass against a "
                        "draft sampled from its distribution")
    args = p.parse_args()

    target = load_model(args.model)
    method = build_method("eagle3", target, MethodOptions(drafter=args.drafter, num_draft_tokens=args.depth,
                                                          tree_width=1, tree_nodes=args.depth))
    if args.prompt_sets:
        measure_prompt_sets(method, target, args)
        return
    dataset = RegeneratedDataset(args.data, verify=False)
    dataset.check_target(target.fingerprint())
    start, end = (0, 0) if args.seen == "none" else (int(x) for x in args.seen.split(":"))
    unseen = np.flatnonzero(dataset.source_index >= args.unseen_from_prompt)[: args.count]
    if len(unseen) == 0:
        raise SystemExit(f"no sample of '{args.data}' comes from prompt {args.unseen_from_prompt} or later yet")
    for name, indices in ((f"seen samples {start}:{end}", list(range(start, end))),
                          (f"unseen samples (prompt >= {args.unseen_from_prompt})", unseen.tolist())):
        if not indices:
            continue
        hits, tau, positions = chain_acceptance(method, target, dataset, indices, args.depth)
        print(f"{name}: {positions} positions, P(top-1 through depth j) {np.round(hits, 3).tolist()}, "
              f"chain-of-{args.depth} tau {tau:.2f}, {vocabulary_coverage(method, dataset, indices):.1%} of the "
              "response tokens in the draft vocabulary")


def measure_prompt_sets(method, target, args) -> None:
    """The head on the target's greedy answers to each evaluation set's first `--limit` prompts."""
    from jaxspec.data import regenerate
    from jaxspec.prompts import load_prompt_set

    with tempfile.TemporaryDirectory() as scratch:
        for name in args.prompt_sets.split(","):
            folder = os.path.join(scratch, name)
            regenerate(target, load_prompt_set(name, limit=args.limit), folder, max_prompt_tokens=4096,
                       max_new_tokens=args.max_new_tokens, batch_size=min(args.limit, 8), progress=False,
                       prompt_source=f"{name} (measurement only)")
            dataset = RegeneratedDataset(folder, verify=False)
            indices = list(range(dataset.num_samples))
            hits, tau, positions = chain_acceptance(method, target, dataset, indices, args.depth)
            print(f"{name} ({len(indices)} answers, {positions} positions): P(top-1 through depth j) "
                  f"{np.round(hits, 3).tolist()}, chain-of-{args.depth} tau {tau:.2f}, "
                  f"{vocabulary_coverage(method, dataset, indices):.1%} of the response tokens in the draft vocabulary")
            if args.sampled:
                point, sampled, positions = sampled_first_draft(method, target, dataset, indices)
                print(f"  T=1, first draft kept: top choice as a point mass {point:.3f}, sampled from the head's q "
                      f"{sampled:.3f} ({positions} positions)")


if __name__ == "__main__":
    main()
