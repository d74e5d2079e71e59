"""Proxy over-score of the top path of parallel draft heads (DFlash, JetSpec): draft score minus target log-prob.

```
python benchmarks/bench_overscore.py \
    --heads dflash=runs/dflash-smollm2-135m/drafter,jetspec=runs/jetspec-smollm2-135m/drafter \
    --prompt-sets mt-bench,gsm8k,humaneval --limit 4 --positions 4 --length 4 [--model smollm2-135m] \
    [--out bench_out/overscore.json]
python benchmarks/bench_overscore.py --model tests/fixtures/tiny-llama3 --heads dflash=untrained,jetspec=untrained \
    --prompt-ids 1,5,9,13,17,21 --positions 2 --length 3        # a smoke run on token ids (no tokenizer needed)
```

What is measured (the JetSpec paper's "proxy over-score"). A parallel head ranks paths by a draft score; the score of
its top path, minus the target's log-probability of that same path, says how far the proxy over-rates it (in nats;
0 = calibrated, > 0 = the head thinks the path likelier than the target does):

- **marginal** path (every head): one all-mask block forward with the head's own attention (bidirectional for a
  dflash checkpoint, tree-causal for jetspec), `jaxspec.drafters.block_head.marginal_log_probs`; the path is the
  argmax of each of the first `--length` per-depth marginals and its draft score the sum of those maxima. This is
  the top path under the product of marginals that DDTree's best-first tree ranks by. The marginals of a block head
  are each averaged over what came before, so their argmaxes can form an incoherent path whose product of marginals
  far exceeds its real probability.
- **conditioned** path (tree-causal heads only): greedy along the path, one tree-causal `block_forward` per depth
  over [root, path so far] (`tree_block_mask` of a chain, real tokens at positions L-1+depth), taking the argmax of
  the last slot; draft score = the sum of the chosen path-conditional log-probs, the score JetSpec's refresh
  (`refresh_tree`) ranks by.
- **target log-prob**: one target forward over context + path, the sum of log-softmax (full vocabulary) at the path
  tokens (draft ids map to target ids through `draft_to_target`).

Besides over-score = draft score - target log-prob, each sample records whether the path's first token is the
target's greedy token and the matched prefix: the number of leading path tokens equal to the target's argmax given
the context and the path before them (the chain's accepted length under greedy verification).

Where. Each prompt (chat template applied) is first decoded greedily by the target (`--max-new-tokens`, default
8 x positions); at `--positions` evenly spaced cut points k of that continuation (k = 0 included) the context is
prompt + continuation[:k] and the root is its last token. The head's context cache holds the pairs (f_t, x_{t+1})
for t < L-1 (projected with the head's `_project`), the root pair is (f_{L-1}, x_L) with x_L the context's last
token, exactly as `JetSpecDrafter` builds it while decoding.

Heads: `--heads LABEL=PATH,...`; LABEL starts with the method (dflash, ddtree or jetspec; e.g. `jetspec-sft`),
PATH is a drafter folder written by `jaxspec train` or `untrained` (freshly initialised weights). Prints one row per
head, path kind and prompt set plus an `all` row per head and kind; `--out` gets every per-sample value as JSON.
`--prompt-ids` (token ids, `;` between prompts, no chat template) replaces the prompt sets for models without a
tokenizer, such as the tiny test model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shlex
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxspec.cache import KVCache
from jaxspec.config import ModelConfig
from jaxspec.drafters.block_head import ParallelHeadParams, block_forward, marginal_log_probs, tree_block_mask
from jaxspec.drafters.eagle import _project, draft_to_target, fuse_features
from jaxspec.errors import UserError
from jaxspec.generate import generate
from jaxspec.loading import DEFAULT_MODEL, LoadedModel, load_model
from jaxspec.model import Weights, forward, lm_head

HEAD_METHODS = ("dflash", "ddtree", "jetspec")
CONTEXT_BUCKET = 64  # sequences are right-padded to a multiple of this, so few lengths compile


@dataclasses.dataclass
class Head:
    """A loaded parallel head: label (from --heads), method, path, attention, block_size, layers (the target's
    feature layers it fuses), params, d2t: int32[Vd] numpy map from draft ids to target ids."""

    label: str
    method: str
    path: str
    attention: str
    block_size: int
    layers: tuple[int, ...]
    params: ParallelHeadParams
    d2t: np.ndarray  # int32[Vd]

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("marginal", "conditioned") if self.attention == "tree_causal" else ("marginal",)


# ---------------------------------------------------------------------------------------------- jitted pieces


def _bucket(n: int) -> int:
    return -(-n // CONTEXT_BUCKET) * CONTEXT_BUCKET


@functools.partial(jax.jit, static_argnames=("cfg", "layers"))
def _target_hidden(weights: Weights, cfg: ModelConfig, tokens: jax.Array, layers: tuple[int, ...]) -> jax.Array:
    """tokens: int32[1, S] (right padding changes nothing before it: causal) -> [n, 1, S, d] after `layers`."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return forward(weights, cfg, tokens, positions, hidden_layers=layers, compute_logits=False).hidden


@functools.partial(jax.jit, static_argnames=("cfg", "length"))
def _target_path_scores(weights: Weights, cfg: ModelConfig, tokens: jax.Array, root_index: jax.Array, length: int):
    """The target on P paths after one context.

    Args:
        tokens: int32[P, S] context + path + padding; root_index: int32[] N - 1, the context's last index.
    Returns:
        (float32[P, K] log-probs of the path tokens, int32[P, K] the target's argmax at each path slot, given the
        context and the path before it).
    """
    p, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (p, s))
    x = forward(weights, cfg, tokens, positions, compute_logits=False).last_hidden  # [P, S, d]
    window = jax.lax.dynamic_slice_in_dim(x, root_index, length, axis=1)  # [P, K, d]: predicts path slot k
    log_probs = jax.nn.log_softmax(lm_head(weights, cfg, window), axis=-1)  # [P, K, V]
    path = jax.lax.dynamic_slice_in_dim(tokens, root_index + 1, length, axis=1)  # [P, K]
    own = jnp.take_along_axis(log_probs, path[..., None], axis=-1)[..., 0]
    return own, jnp.argmax(log_probs, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head_context(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, hidden: jax.Array,
                  tokens: jax.Array, n: jax.Array):
    """The head's state at a context of N tokens x_0 .. x_{N-1} (L = N - 1 committed, root x_L = x_{N-1}).

    Args:
        embed: [V, d]; hidden: [n, 1, S, d] the target's feature layers; tokens: int32[1, S] the context, padded;
        n: int32[] N.
    Returns:
        (KVCache of the pairs (f_t, x_{t+1}) at positions t < L - 1 (lengths L - 1), root_feature [1, d] f_{L-1},
        root int32[1] x_L).
    """
    feats = fuse_features(params.head, hidden)  # [1, S, d]
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]  # [1, S]
    nxt = jnp.roll(tokens, -1, axis=1)  # x_{t+1} at t; the wrapped last slot lies beyond the length, never seen
    _, k, v = _project(params.head, cfg, jnp.take(embed, nxt, axis=0), feats, positions)  # [1, S, Hkv, h] x2
    cache = KVCache(k=k.transpose(0, 2, 1, 3)[None], v=v.transpose(0, 2, 1, 3)[None],
                    lengths=jnp.reshape(n - 2, (1,)).astype(jnp.int32))
    root_feature = jax.lax.dynamic_index_in_dim(feats, n - 2, axis=1, keepdims=False)  # [1, d]
    root = jax.lax.dynamic_index_in_dim(tokens, n - 1, axis=1, keepdims=False)  # [1]
    return cache, root_feature, root


@functools.partial(jax.jit, static_argnames=("cfg", "block_size", "attention"))
def _marginals(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, cache: KVCache,
               root_feature: jax.Array, root: jax.Array, block_size: int, attention: str) -> jax.Array:
    """float32[D, Vd]: the all-mask block's log marginals, depth d + 1 at index d."""
    return marginal_log_probs(params, cfg, embed, cache, root_feature, root, block_size, attention)[0]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _chain_log_probs(params: ParallelHeadParams, cfg: ModelConfig, embed: jax.Array, cache: KVCache,
                     root_feature: jax.Array, tokens: jax.Array) -> jax.Array:
    """tokens: int32[1, K] the root then a chain of target ids -> float32[K, Vd], slot j's path-conditioned
    log-probs of depth j + 1. Tree-causal: slot j sees slots <= j only, so unfilled later slots change nothing."""
    k = tokens.shape[1]
    parents = jnp.arange(-1, k - 2, dtype=jnp.int32)[None]  # [1, K-1]: node j's parent is node j - 1
    positions = cache.lengths[:, None] + jnp.arange(k, dtype=jnp.int32)[None]  # [1, K]: L-1 + depth
    logits = block_forward(params, cfg, embed, cache, root_feature, tokens, jnp.ones((1, k), jnp.bool_), positions,
                           tree_block_mask(parents))
    return jax.nn.log_softmax(logits, axis=-1)[0]


# ---------------------------------------------------------------------------------------------- one cut point


def _top_paths(head: Head, cfg: ModelConfig, embed: jax.Array, cache: KVCache, root_feature: jax.Array,
               root: jax.Array, length: int) -> dict[str, tuple[list[int], list[float]]]:
    """kind -> (draft ids of the head's top path, their draft log-probs), for each path kind of the head."""
    paths = {}
    marg = np.asarray(_marginals(head.params, cfg, embed, cache, root_feature, root, head.block_size,
                                 head.attention))[:length]  # [K, Vd]
    ids = marg.argmax(axis=-1)
    paths["marginal"] = (ids.tolist(), marg[np.arange(length), ids].tolist())
    if "conditioned" in head.kinds:
        tokens = np.zeros((1, length), np.int32)
        tokens[0, 0] = int(np.asarray(root)[0])
        ids, scores = [], []
        for j in range(length):
            lp = np.asarray(_chain_log_probs(head.params, cfg, embed, cache, root_feature, jnp.asarray(tokens)))[j]
            best = int(lp.argmax())
            ids.append(best)
            scores.append(float(lp[best]))
            if j + 1 < length:
                tokens[0, j + 1] = head.d2t[best]
        paths["conditioned"] = (ids, scores)
    return paths


def measure_context(target: LoadedModel, heads: list[Head], context: list[int], length: int) -> list[dict[str, Any]]:
    """Top paths of every head after `context` (root: its last token) and the target's view of them.

    Args:
        context: token ids x_0 .. x_{N-1}, N >= 2.
        length: K, the path length (at most each head's block size).
    Returns:
        One record per head and path kind: path (target ids), draft / target per-token log-probs, draft_score,
        target_logprob, over_score, first_match and matched (leading tokens equal to the target's argmax).
    """
    if len(context) < 2:
        raise UserError(f"A context needs at least 2 tokens (the root and one before it); got {len(context)}.")
    cfg, weights = target.config, target.weights
    n = len(context)
    padded = np.zeros((1, _bucket(n + length)), np.int32)
    padded[0, :n] = context
    layers = tuple(sorted({i for h in heads for i in h.layers}))
    hidden = _target_hidden(weights, cfg, jnp.asarray(padded), layers)  # [n, 1, S, d]
    found = []  # (head, kind, draft ids, draft log-probs)
    for head in heads:
        own = hidden[np.asarray([layers.index(i) for i in head.layers])]
        cache, root_feature, root = _head_context(head.params, cfg, weights.embed, own, jnp.asarray(padded),
                                                  jnp.int32(n))
        for kind, (ids, scores) in _top_paths(head, cfg, weights.embed, cache, root_feature, root, length).items():
            found.append((head, kind, ids, scores))
    rows = np.repeat(padded, len(found), axis=0)  # [P, S]
    for r, (head, _, ids, _) in enumerate(found):
        rows[r, n: n + length] = head.d2t[np.asarray(ids)]
    target_lp, greedy = (np.asarray(x) for x in _target_path_scores(weights, cfg, jnp.asarray(rows), jnp.int32(n - 1),
                                                                     length))
    records = []
    for r, (head, kind, _, scores) in enumerate(found):
        path = rows[r, n: n + length]
        hits = path == greedy[r]
        draft_score, target_logprob = float(np.sum(scores)), float(np.sum(target_lp[r]))
        records.append(dict(head=head.label, kind=kind, path=path.tolist(), draft_logprobs=[float(s) for s in scores],
                            target_logprobs=target_lp[r].tolist(), target_greedy=greedy[r].tolist(),
                            draft_score=draft_score, target_logprob=target_logprob,
                            over_score=draft_score - target_logprob, first_match=bool(hits[0]),
                            matched=int(np.argmin(hits)) if not hits.all() else length))
    return records


def cut_points(continuation: list[int], positions: int) -> list[int]:
    """`positions` evenly spaced k in [0, len(continuation)) (k = 0 included; duplicates of short ones dropped)."""
    if not continuation:
        return [0]
    return sorted({int(round(x)) for x in np.linspace(0, len(continuation), positions, endpoint=False)})


# ---------------------------------------------------------------------------------------------- the command


def parse_heads(spec: str) -> list[tuple[str, str, str]]:
    """'LABEL=PATH,...' -> [(label, method, path)], checking labels and that each folder is a drafter checkpoint."""
    from jaxspec.checkpoint import read_drafter_meta

    heads = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        label, sep, path = item.partition("=")
        method = label.split("-", 1)[0]
        if not sep or not path or method not in HEAD_METHODS:
            raise UserError(f"--heads takes LABEL=PATH items whose LABEL starts with {', '.join(HEAD_METHODS)} "
                            f"(e.g. dflash=runs/dflash-smollm2-135m/drafter or jetspec-sft=untrained); got '{item}'.")
        if label in [h[0] for h in heads]:
            raise UserError(f"--heads names '{label}' twice; give each head its own label (e.g. {label}-2).")
        if path != "untrained":
            if not os.path.isdir(path):
                raise UserError(f"The head folder '{path}' (for {label}) does not exist; pass a drafter folder written "
                                "by `jaxspec train` (RUN_DIR/drafter) or 'untrained'.")
            read_drafter_meta(path)  # a clear error for a folder that is not a drafter checkpoint
        heads.append((label, method, path))
    if not heads:
        raise UserError("--heads names no head; pass e.g. dflash=runs/dflash-smollm2-135m/drafter.")
    return heads


def load_heads(target: LoadedModel, specs: list[tuple[str, str, str]], length: int) -> list[Head]:
    from jaxspec.methods import load_learned_drafter

    heads = []
    for label, method, path in specs:
        drafter, params = load_learned_drafter(method, target, path)
        if length > drafter.block_size:
            raise UserError(f"--length {length} exceeds the block size of {label} ({drafter.block_size}): its "
                            "all-mask block gives that many marginals. Pass --length <= the block size.")
        heads.append(Head(label=label, method=method, path=path, attention=drafter.attention,
                          block_size=drafter.block_size, layers=tuple(drafter.target_layers), params=params,
                          d2t=np.asarray(draft_to_target(params.head))))
    return heads


def summarize(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (head, kind, prompt set), then an 'all' row per (head, kind); heads, kinds and sets in the order
    they were measured."""
    groups: dict[tuple[str, str], dict[str, list[dict]]] = {}
    for s in samples:
        groups.setdefault((s["head"], s["kind"]), {}).setdefault(s["set"], []).append(s)
    rows = []
    for (head, kind), by_set in groups.items():
        for name, group in [*by_set.items(), ("all", [s for g in by_set.values() for s in g])]:
            over = np.asarray([s["over_score"] for s in group])
            rows.append(dict(head=head, kind=kind, set=name, n=len(group), over_mean=float(over.mean()),
                             over_median=float(np.median(over)), over_max=float(over.max()),
                             draft_score=float(np.mean([s["draft_score"] for s in group])),
                             target_logprob=float(np.mean([s["target_logprob"] for s in group])),
                             first_match=float(np.mean([s["first_match"] for s in group])),
                             matched=float(np.mean([s["matched"] for s in group]))))
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head_w = max([4] + [len(r["head"]) for r in rows])
    set_w = max([3] + [len(r["set"]) for r in rows])
    lines = [f"{'head':<{head_w}}  {'path':<11} {'set':<{set_w}} {'n':>4} {'over mean':>9} {'median':>7} {'max':>7} "
             f"{'draft':>7} {'target lp':>9} {'1st ok':>6} {'matched':>7}"]
    for r in rows:
        lines.append(f"{r['head']:<{head_w}}  {r['kind']:<11} {r['set']:<{set_w}} {r['n']:>4} {r['over_mean']:>9.2f} "
                     f"{r['over_median']:>7.2f} {r['over_max']:>7.2f} {r['draft_score']:>7.2f} "
                     f"{r['target_logprob']:>9.2f} {r['first_match']:>6.2f} {r['matched']:>7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="LABEL=PATH,... (LABEL starts with dflash, ddtree or jetspec; "
                        "PATH a drafter folder or 'untrained')")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt-sets", default="mt-bench,gsm8k,humaneval")
    parser.add_argument("--prompt-ids", default=None,
                        help="debugging: token-id prompts ('1,2,3;4,5'), no chat template; replaces --prompt-sets")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set")
    parser.add_argument("--positions", type=int, default=4, help="cut points per prompt")
    parser.add_argument("--length", type=int, default=4, help="K, tokens per path")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="greedy continuation (default 8 x positions)")
    parser.add_argument("--out", default="bench_out/overscore.json", help="JSON of every sample ('' for none)")
    args = parser.parse_args(argv)
    for flag in ("limit", "positions", "length"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} must be at least 1, got {getattr(args, flag)}.")
    specs = parse_heads(args.heads)
    if args.prompt_ids is not None:
        try:
            id_prompts = [[int(t) for t in p.split(",")] for p in args.prompt_ids.split(";") if p.strip()]
        except ValueError:
            raise UserError(f"--prompt-ids takes comma-separated integers, ';' between prompts; got "
                            f"'{args.prompt_ids}'.") from None
        if not id_prompts or min(map(len, id_prompts)) < 2:
            raise UserError("--prompt-ids needs prompts of at least 2 tokens each.")
        sets = {"ids": id_prompts}
    else:
        from jaxspec.prompts import load_prompt_set

        sets = {name: load_prompt_set(name, args.limit) for name in filter(None, args.prompt_sets.split(","))}
        if not sets:
            raise UserError("--prompt-sets names no set; pass e.g. mt-bench,gsm8k,humaneval.")

    target = load_model(args.model)
    if args.prompt_ids is None:
        if target.tokenizer is None:
            raise UserError(f"{args.model} has no tokenizer; pass token ids with --prompt-ids.")
        from jaxspec.tokenizer import encode_prompt

        sets = {name: [encode_prompt(target.tokenizer, text) for text in texts] for name, texts in sets.items()}
    heads = load_heads(target, specs, args.length)
    max_new = args.max_new_tokens or 8 * args.positions
    eos = set(target.config.eos_token_ids)

    samples = []
    total = sum(len(p) for p in sets.values()) * args.positions
    with tqdm(total=total, desc="overscore", unit="point", file=sys.stderr) as bar:
        for name, prompts in sets.items():
            for index, prompt in enumerate(prompts):
                continuation = generate(target.weights, target.config, [prompt], max_new_tokens=max_new).token_ids[0]
                while continuation and continuation[-1] in eos:  # never root a draft at EOS
                    continuation = continuation[:-1]
                ks = cut_points(continuation, args.positions)
                for k in ks:
                    for record in measure_context(target, heads, prompt + continuation[:k], args.length):
                        samples.append(dict(set=name, prompt=index, cut=k, context_length=len(prompt) + k, **record))
                    bar.update(1)
                bar.update(args.positions - len(ks))

    rows = summarize(samples)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    print(f"proxy over-score of the top path (nats; draft score - target log-prob), {args.model}, K = {args.length}")
    print(format_table(rows))
    print(f"command: {command}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(command=command, model=args.model, length=args.length, positions=args.positions,
                           max_new_tokens=max_new,
                           heads=[dict(label=h.label, method=h.method, path=h.path, attention=h.attention,
                                       block_size=h.block_size, feature_layers=list(h.layers)) for h in heads],
                           summary=rows, samples=samples), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        print(f"bench_overscore: error: {e}", file=sys.stderr)
        sys.exit(2)
