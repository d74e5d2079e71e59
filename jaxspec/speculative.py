"""The one speculative decoding loop: prefill, then rounds of propose -> verify -> accept -> commit -> update.

The round's phases are named scopes of the compiled loop (`ROUND_PHASES`), which `jaxspec.profiling` times.

Everything runs in one jitted `lax.while_loop`; a round never recompiles. Each batch row advances by its own
accepted length (its own cache length, history and output offset); rows that hit EOS or max_new_tokens stop
committing while the others go on.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxspec import metrics
from jaxspec.cache import commit_positions, commit_recurrent, init_cache
from jaxspec.config import ModelConfig
from jaxspec.drafters.base import Drafter, RoundInputs
from jaxspec.generate import PAD, GenerationResult, pad_prompts, prefill
from jaxspec.model import Weights, draws_through_screen, greedy_tokens, output_matrix
from jaxspec.sampling import GREEDY, SamplingConfig, gumbel_noise, sample_token
from jaxspec.sharding import place_inputs, replicate_on_mesh, to_host
from jaxspec.verification import accept_greedy, verify_and_accept, verify_forward

ROUND_PHASES = ("draft", "verify", "accept", "commit")  # the loop body's jax.named_scopes, in order


def _write_rows(buffer: jax.Array, block: jax.Array, offsets: jax.Array) -> jax.Array:
    """buffer[b, offsets[b]:offsets[b] + W] = block[b] for every row. buffer: [B, N]; block: [B, W]."""
    return jax.vmap(lambda row, new, at: jax.lax.dynamic_update_slice(row, new, (at,)))(buffer, block, offsets)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "max_new_tokens", "cache_size", "eos_ids",
                                             "mesh"))
def speculative_generate_tokens(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    drafter_params: Any,
    tokens: jax.Array,
    prompt_lengths: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    cache_size: int,
    sampling: SamplingConfig = GREEDY,
    eos_ids: tuple[int, ...] = (),
    mesh: Mesh | None = None,
):
    """Jitted speculative generation for a batch of right-padded prompts.

    Args:
        tokens: int32[B, P]; prompt_lengths: int32[B]; rng: PRNG key.
        cache_size: slots per row; must hold P + max_new_tokens + T + 1.
        mesh: a (data, model) mesh. The target's prefill and verification forwards and the acceptance run
            under shard_map (tensor-parallel, rows split over data); the drafter runs as it is, its arrays
            placed by jit's partitioner. No drafter has mesh code of its own.
    Returns:
        (new_tokens int32[B, max_new_tokens] with PAD after the end, num_new int32[B], rounds int32[B],
         accepted int32[B, max_new_tokens]: drafted tokens accepted in each of the row's rounds, -1 after them).
    """
    b = tokens.shape[0]
    num_nodes = drafter.num_nodes
    width = num_nodes + 1  # new tokens one round can yield
    eos = jnp.asarray(eos_ids if eos_ids else (-2,), jnp.int32)

    cache = init_cache(cfg, b, cache_size, weights.embed.dtype, per_layer=isinstance(weights.layers, tuple))
    logits, prefill_out, cache = prefill(weights, cfg, tokens, prompt_lengths, cache, mesh,
                                         hidden_layers=drafter.target_layers)
    first = sample_token(jax.random.fold_in(rng, 0), logits, sampling)  # [B]
    history = jnp.zeros((b, cache_size), jnp.int32).at[:, : tokens.shape[1]].set(tokens)
    history = _write_rows(history, first[:, None], prompt_lengths)
    state = drafter.init(drafter_params, cfg, tokens, prompt_lengths, prefill_out, cache_size, sampling)

    out = jnp.full((b, max_new_tokens + width), PAD, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (count >= max_new_tokens)
    accepted_log = jnp.full((b, max_new_tokens), -1, jnp.int32)
    rounds = jnp.zeros((b,), jnp.int32)

    def cond(carry):
        return ~jnp.all(carry["done"])

    def body(carry):
        cache, history, root, state = carry["cache"], carry["history"], carry["root"], carry["state"]
        active = ~carry["done"]
        key = jax.random.fold_in(rng, carry["step"])
        draft_key, accept_key, bonus_key = jax.random.split(key, 3)
        inputs = RoundInputs(target_weights=weights, target_cache=cache, history=history, lengths=cache.lengths,
                             root=root)
        with jax.named_scope("draft"):
            tree, state, cache = drafter.propose(drafter_params, state, inputs, cfg, sampling, draft_key)
        # The target's own token at the root and at every node decides (`accept_greedy`), with no full logits
        # (`greedy_tokens`): its argmax at T=0; with a temperature alone, deterministic drafts and the LM head's
        # screen, its draw by the Gumbel-max rule, which accepts a child exactly when the target drew that child's
        # token: child x with probability p(x), the bonus from p without the children tried, the rule of `accept`
        # for point masses. (Without the screen the full logits are computed anyway: `draws_through_screen`.)
        by_draw = mesh is None and (sampling.greedy or (tree.draft_probs is None
                                                        and draws_through_screen(weights, sampling, b * width)))
        with jax.named_scope("verify"):
            verification = verify_forward(weights, cfg, cache, root, tree, drafter.target_layers, mesh,
                                          compute_logits=not by_draw)
            if by_draw:
                noise = gumbel_noise(accept_key, (b, width, output_matrix(weights).shape[0]), sampling)  # [B, T+1, V]
                best = greedy_tokens(weights, cfg, verification.last_hidden, noise)  # [B, T+1]
        with jax.named_scope("accept"):
            if by_draw:
                acc = accept_greedy(tree, best)
            else:
                acc = verify_and_accept(tree, verification.logits, sampling,  # logits [B, T+1, V]
                                        jax.random.uniform(accept_key, (b, num_nodes)),
                                        jax.random.uniform(bonus_key, (b,)), mesh)
        with jax.named_scope("commit"):
            num_new = acc.num_accepted + 1  # [B]
            is_eos = jnp.isin(acc.tokens, eos) & (jnp.arange(width) < num_new[:, None])  # [B, T+1]
            hit_eos = jnp.any(is_eos, axis=1)
            num_new = jnp.where(hit_eos, jnp.argmax(is_eos, axis=1) + 1, num_new)
            num_new = jnp.where(active, jnp.minimum(num_new, max_new_tokens - carry["count"]), 0)
            block = jnp.where(jnp.arange(width) < num_new[:, None], acc.tokens, PAD)
            out = _write_rows(carry["out"], block, carry["count"])
            history = _write_rows(history, acc.tokens, cache.lengths + 1)
            committed = jnp.where(active, acc.num_accepted + 1, 0)
            cache = commit_positions(verification.cache, acc.path, committed, chain=drafter.chain)
            cache = commit_recurrent(cache, verification.pending, acc.path, committed)  # hybrid models only
            verification = dataclasses.replace(verification, cache=None, pending=None)
            state = drafter.update(drafter_params, state, inputs, verification, acc)
            accepted_log = _write_rows(carry["accepted_log"], jnp.where(active, acc.num_accepted, -1)[:, None],
                                       jnp.minimum(carry["rounds"], max_new_tokens - 1))
            count = carry["count"] + num_new
            done = carry["done"] | hit_eos | (count >= max_new_tokens)
        return dict(cache=cache, history=history, root=acc.bonus, state=state, out=out, count=count, done=done,
                    accepted_log=jnp.where(active[:, None], accepted_log, carry["accepted_log"]),
                    rounds=carry["rounds"] + active.astype(jnp.int32), step=carry["step"] + 1)

    init = dict(cache=cache, history=history, root=first, state=state, out=out, count=count, done=done,
                accepted_log=accepted_log, rounds=rounds, step=jnp.int32(1))
    final = jax.lax.while_loop(cond, body, init)
    new_tokens = final["out"][:, :max_new_tokens]
    return new_tokens, jnp.sum(new_tokens != PAD, axis=1).astype(jnp.int32), final["rounds"], final["accepted_log"]


@dataclasses.dataclass
class SpeculativeResult(GenerationResult):
    """GenerationResult plus per-row statistics. accepted[r]: drafted tokens accepted in each round of row r."""

    rounds: list[int] = dataclasses.field(default_factory=list)
    accepted: list[list[int]] = dataclasses.field(default_factory=list)
    num_draft_nodes: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens per verification round, bonus included (the prefill's first token excluded)."""
        return metrics.tau(self.accepted)

    def acceptance_by_position(self) -> list[float]:
        return metrics.acceptance_by_position(self.accepted, self.num_draft_nodes)


def speculative_generate(
    weights: Weights,
    cfg: ModelConfig,
    drafter: Drafter,
    drafter_params: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    max_cache_length: int | None = None,
    mesh: Mesh | None = None,
) -> SpeculativeResult:
    """Speculative generation for token-id prompts of any lengths: the same tokens as `generate` at T=0, the same
    distribution at T>0. mesh: a (data, model) mesh to run on (the batch must split over its data axis)."""
    args, kwargs = loop_arguments(weights, cfg, drafter, drafter_params, prompt_ids, max_new_tokens=max_new_tokens,
                                  sampling=sampling, seed=seed, eos_ids=eos_ids, max_cache_length=max_cache_length,
                                  mesh=mesh)
    start = time.perf_counter()
    out, counts, rounds, accepted = speculative_generate_tokens(*args, **kwargs)
    out, counts, rounds, accepted = (to_host(x) for x in (out, counts, rounds, accepted))
    seconds = time.perf_counter() - start
    return SpeculativeResult(
        token_ids=[out[r, : counts[r]].tolist() for r in range(len(out))],
        seconds=seconds,
        rounds=rounds.tolist(),
        accepted=[row[row >= 0].tolist() for row in accepted],
        num_draft_nodes=drafter.num_nodes,
    )


def loop_arguments(weights: Weights, cfg: ModelConfig, drafter: Drafter, drafter_params: Any,
                   prompt_ids: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: SamplingConfig,
                   seed: int, eos_ids: Sequence[int] | None, max_cache_length: int | None,
                   mesh: Mesh | None) -> tuple[tuple, dict]:
    """(args, kwargs) of `speculative_generate_tokens` for these prompts: padded, placed on the mesh, the draft
    model's weights in this backend's layout (what `speculative_generate` runs, and `jaxspec.profiling` traces)."""
    batch = pad_prompts(prompt_ids, max_new_tokens, cfg, max_cache_length, draft_slots=drafter.num_nodes + 1)
    eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    weights, tokens, lengths, rng = place_inputs(mesh, cfg, weights, batch.tokens, batch.lengths, seed)
    drafter_params = drafter.execution_params(replicate_on_mesh(mesh, drafter_params), mesh)
    return ((weights, cfg, drafter, drafter_params, tokens, lengths, rng),
            dict(max_new_tokens=max_new_tokens, cache_size=batch.cache_size, sampling=sampling, eos_ids=eos,
                 mesh=mesh))
