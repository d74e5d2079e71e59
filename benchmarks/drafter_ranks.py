"""How well an EAGLE-3 head predicts the target along regenerated text: on samples it was trained on and on samples
of prompts it never saw (an overfit head shows a large gap).

    python benchmarks/drafter_ranks.py --data data/regen-smollm2-135m-b64 --seen 0:12 --unseen-from-prompt 2000
    python benchmarks/drafter_ranks.py --prompt-sets mt-bench,gsm8k,humaneval --limit 8 --depth 4
    python benchmarks/drafter_ranks.py --prompt-sets mt-bench,gsm8k,humaneval --limit 10 --depth 1 --sampled

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


def sampled_first_draft(method, target, dataset, indices, noise_draws: int = 64, seed: int = 0) -> dict:
    """At temperature 1, the probability that the target keeps a round's first draft, along the samples, four ways:
    - "point": the head's top choice drafted as a point mass, E p(argmax q) (a chain of 1 at T=1);
    - "top2": its top 2 side by side (a depth-1 tree of 2), E p(top 2 of q);
    - "coupled": drafted from the head's q with the Gumbel noise the target's own draw uses, argmax(log q + g)
      against the target's argmax(log p + g), the match rate over `noise_draws` draws a position (lossless either
      way: the committed token is the target's draw);
    - "sampled": a draft sampled from q and kept with probability min(1, p/q), E sum_x min(p(x), q(x)) (the standard
      rule; it needs the target's full distribution, which the greedy screen avoids computing).
    Also "positions". p: the target's softmax, q: the head's (over its draft vocabulary)."""
    from jaxspec.drafters.eagle import _chain_logits

    rng = np.random.default_rng(seed)
    d2t = np.asarray(draft_to_target(method.params)).astype(np.int64)  # [Vd]
    sums = dict(point=0.0, top2=0.0, coupled=0.0, sampled=0.0)
    positions = 0
    for i in indices:
        row = dataset.sample(i)
        start = int(dataset.prompt_lengths[i])
        head_logits, target_logits = _chain_logits(
            method.params, target.weights, target.config, method.drafter.head_config(target.config),
            tuple(method.drafter.target_layers), row[None].astype(np.int32), 1, target_logits=True)
        log_q = np.asarray(jax.nn.log_softmax(head_logits[0, 0].astype(jnp.float32), axis=-1), np.float64)  # [S, Vd]
        log_p = np.asarray(jax.nn.log_softmax(target_logits[0].astype(jnp.float32), axis=-1), np.float64)  # [S, V]
        cols = np.arange(max(start - 1, 0), len(row) - 2)  # column t: the head predicts token t + 2
        p_next = np.exp(log_p[cols + 1])  # [P, V] the target's distribution of token t + 2
        q_cols = np.exp(log_q[cols])  # [P, Vd]
        top2 = np.argsort(-log_q[cols], axis=-1)[:, :2]  # [P, 2] draft ids
        sums["point"] += float(np.take_along_axis(p_next, d2t[top2[:, :1]], axis=-1).sum())
        sums["top2"] += float(np.take_along_axis(p_next, d2t[top2], axis=-1).sum())
        sums["sampled"] += float(np.minimum(p_next[:, d2t], q_cols).sum())
        for col in cols:
            g = rng.gumbel(size=(noise_draws, p_next.shape[1]))  # [G, V]
            drawn = np.argmax(log_p[col + 1][None] + g, axis=-1)  # [G] the target's draws
            drafted = d2t[np.argmax(log_q[col][None] + g[:, d2t], axis=-1)]  # [G] the head's, with the same noise
            sums["coupled"] += float(np.mean(drawn == drafted))
        positions += len(cols)
    return {**{k: v / positions for k, v in sums.items()}, "positions": positions}


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
                   help="also the first draft's acceptance at T=1: the head's top choice as a point mass, its top 2, "
                        "a draft with the target's own Gumbel noise, and one sampled from its distribution")
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
                kept = sampled_first_draft(method, target, dataset, indices)
                print(f"  T=1, first draft kept: top choice as a point mass {kept['point']:.3f}, top 2 side by side "
                      f"{kept['top2']:.3f}, drafted with the target's Gumbel noise {kept['coupled']:.3f}, sampled "
                      f"from the head's q {kept['sampled']:.3f} ({kept['positions']} positions)")


if __name__ == "__main__":
    main()
