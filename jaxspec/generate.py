"""Autoregressive generation: prefill, one-token decode steps, and the jitted loop around them.

Rows of a batch have their own prompt lengths: prompts are right-padded to a common width, every row's
cache length starts at its own prompt length, and each row decodes at its own position. Rows that reached
EOS stop advancing their cache and emit `PAD` (-1). Shapes are bucketed (prompt width to a multiple of 64,
cache to a multiple of 128), so a generation never recompiles and most new prompts reuse a compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.cache import KVCache, commit_recurrent, init_cache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.model import Weights, execution_weights, lm_head
from jaxspec.sampling import GREEDY, SamplingConfig, sample_token
from jaxspec.sharding import forward_on_mesh, place_inputs, to_host

PAD = -1  # emitted after a row's EOS
PROMPT_BUCKET = 64
CACHE_BUCKET = 128


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ---------------------------------------------------------------------------------------------- steps


def prefill(weights: Weights, cfg: ModelConfig, tokens: jax.Array, prompt_lengths: jax.Array, cache: KVCache,
            mesh: Mesh | None = None, **forward_kwargs):
    """Runs the prompts and commits them to the cache.

    Args:
        tokens: int32[B, P] right-padded prompts; prompt_lengths: int32[B] (>= 1).
        cache: a freshly made cache (`init_cache`): its slots are never read, the prompts start at position 0.
        mesh: a (data, model) mesh to run the forward on (`jaxspec.sharding.forward_on_mesh`), or None.
    Returns:
        (last_logits [B, V] at each row's last prompt token, ForwardOutput (logits None: only the last
        positions go through the LM head), cache with lengths = prompt_lengths).
    """
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    out = forward_on_mesh(mesh, weights, cfg, tokens, positions, cache, None, compute_logits=False,  # causal
                          read_cache=False, **forward_kwargs)
    last_hidden = jnp.take_along_axis(out.last_hidden, (prompt_lengths - 1)[:, None, None], axis=1)  # [B, 1, d]
    last = lm_head(weights, cfg, last_hidden)[:, 0]  # [B, V]: the LM head only where it is needed
    cache = dataclasses.replace(out.cache, lengths=prompt_lengths.astype(jnp.int32))
    cache = commit_recurrent(cache, out.pending, positions, prompt_lengths)  # a hybrid model's states (else as is)
    return last, out, cache


def decode_step(weights: Weights, cfg: ModelConfig, token: jax.Array, cache: KVCache, advance: jax.Array,
                mesh: Mesh | None = None, hidden_layers: tuple[int, ...] = ()):
    """Feeds one token per row at position lengths[b]; returns (logits [B, V], cache), and with `hidden_layers`
    also the residual stream after those layers at the fed token, [n, B, d]: (logits, cache, hidden).

    token: int32[B]; advance: bool[B], rows whose cache length moves on (finished rows stay put).
    """
    out = forward_on_mesh(mesh, weights, cfg, token[:, None], cache.lengths[:, None], cache,
                          hidden_layers=hidden_layers)
    cache = dataclasses.replace(out.cache, lengths=cache.lengths + advance.astype(jnp.int32))
    cache = commit_recurrent(cache, out.pending, jnp.zeros_like(token)[:, None], advance.astype(jnp.int32))
    if hidden_layers:
        return out.logits[:, 0], cache, out.hidden[:, :, 0]
    return out.logits[:, 0], cache


def _bits_dtype(dtype):
    """The unsigned integer type as wide as `dtype`."""
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _to_bits(x: jax.Array, dtype) -> jax.Array:
    """x cast to `dtype`, returned as its bit patterns (`_bits_dtype`); bitcast_convert_type undoes it."""
    return jax.lax.bitcast_convert_type(x.astype(dtype), _bits_dtype(dtype))


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, jnp.bool_)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "cache_size", "eos_ids", "mesh",
                                             "hidden_layers", "hidden_dtype"))
def generate_tokens(
    weights: Weights,
    cfg: ModelConfig,
    tokens: jax.Array,
    prompt_lengths: jax.Array,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    cache_size: int,
    sampling: SamplingConfig = GREEDY,
    eos_ids: tuple[int, ...] = (),
    mesh: Mesh | None = None,
    hidden_layers: tuple[int, ...] = (),
    hidden_dtype=jnp.bfloat16,
):
    """Jitted autoregressive generation for a batch of right-padded prompts.

    Args:
        tokens: int32[B, P]; prompt_lengths: int32[B]; rng: a PRNG key (unused when greedy).
        mesh: run every target forward on this (data, model) mesh (inputs placed with `jaxspec.sharding`).
        hidden_layers: also keep the residual stream after these layers at every position the target reads
            (the prompt, then each generated token but the last), as computed while generating: the features
            drafters train on, with no second pass of the target. Stored in `hidden_dtype`.
    Returns:
        (new_tokens int32[B, max_new_tokens] with PAD after each row's EOS, num_new int32[B] including the EOS),
        and with `hidden_layers` a third array, hidden [n, B, P + max_new_tokens, d]: row b's position i holds
        the feature of its token i (prompt then response); positions past a row's last fed token are zeros.
    """
    b, p = tokens.shape
    cache = init_cache(cfg, b, cache_size, weights.embed.dtype, per_layer=isinstance(weights.layers, tuple))
    logits, prefill_out, cache = prefill(weights, cfg, tokens, prompt_lengths, cache, mesh,
                                         hidden_layers=hidden_layers)
    first = sample_token(jax.random.fold_in(rng, 0), logits, sampling)
    out = jnp.full((b, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    done = _is_eos(first, eos_ids)
    features = None
    if hidden_layers:
        in_prompt = jnp.arange(p)[None, :] < prompt_lengths[:, None]  # [B, P]
        prompt_features = jnp.where(in_prompt[None, :, :, None], prefill_out.hidden, 0)
        # kept as the bits of hidden_dtype (unsigned integers of its width): XLA:CPU widened a bfloat16 buffer to
        # float32 and back around every step's scatter, whole-buffer conversions that cost more than the step
        features = jnp.zeros((len(hidden_layers), b, p + max_new_tokens, cfg.hidden_size), _bits_dtype(hidden_dtype))
        features = features.at[:, :, :p].set(_to_bits(prompt_features, hidden_dtype))  # [n, B, P + N, d]
    rows = jnp.arange(b)

    def cond(state):
        step, _, _, _, done, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, cache, out, last, done, features = state
        position = cache.lengths  # [B]: where `last` goes
        if hidden_layers:
            logits, cache, hidden = decode_step(weights, cfg, last, cache, ~done, mesh, hidden_layers)
            # finished rows write out of range, which is dropped
            where = jnp.where(done, features.shape[2], position)
            features = features.at[:, rows, where].set(_to_bits(hidden, hidden_dtype), mode="drop")
        else:
            logits, cache = decode_step(weights, cfg, last, cache, ~done, mesh)
        new = sample_token(jax.random.fold_in(rng, step), logits, sampling)
        new = jnp.where(done, PAD, new)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
        return step + 1, cache, out, jnp.maximum(new, 0), done | _is_eos(new, eos_ids), features

    _, _, out, _, _, features = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, first, done, features))
    counts = jnp.sum(out != PAD, axis=1).astype(jnp.int32)
    if hidden_layers:
        return out, counts, jax.lax.bitcast_convert_type(features, hidden_dtype)
    return out, counts


_prefill_jit = jax.jit(prefill, static_argnames=("cfg",), donate_argnames=("cache",))
_decode_step_jit = jax.jit(decode_step, static_argnames=("cfg",), donate_argnames=("cache",))
_sample_jit = jax.jit(sample_token)


# ---------------------------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Batch:
    """Prompts padded for the device. tokens: int32[B, P]; lengths: int32[B]."""

    tokens: np.ndarray
    lengths: np.ndarray
    cache_size: int


def pad_prompts(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, cfg: ModelConfig,
                max_cache_length: int | None = None, draft_slots: int = 0) -> Batch:
    """Right-pads token id lists into a bucketed batch and picks the cache size; checks everything fits.

    draft_slots: extra cache slots a speculative round may write beyond the last kept token (T + 1).
    Raises UserError if a prompt is empty or a prompt plus max_new_tokens (plus draft_slots) does not fit the cache.
    """
    if not prompt_ids:
        raise UserError("No prompts were given.")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    if lengths.min() == 0:
        raise UserError("A prompt is empty after tokenization; give at least one token.")
    limit = max_cache_length or cfg.max_position_embeddings
    longest = int(lengths.max())
    needed = longest + max_new_tokens + draft_slots
    if needed > limit:
        drafts = f" and {draft_slots} slots for a round's draft tree" if draft_slots else ""
        raise UserError(
            f"A prompt of {longest} tokens plus max_new_tokens={max_new_tokens}{drafts} needs {needed} "
            f"cache slots, more than the {limit} available; shorten the prompt, lower max_new_tokens, or raise "
            "max_cache_length (at most the model's context length)."
        )
    width = round_up(longest, PROMPT_BUCKET)
    tokens = np.zeros((len(prompt_ids), width), np.int32)
    for row, ids in enumerate(prompt_ids):
        tokens[row, : len(ids)] = ids
    cache_size = min(round_up(width + max_new_tokens + draft_slots, CACHE_BUCKET), round_up(limit, CACHE_BUCKET))
    return Batch(tokens=tokens, lengths=lengths, cache_size=cache_size)


@dataclasses.dataclass
class GenerationResult:
    """Per row: the new token ids (EOS included when reached), plus timing for the whole batch."""

    token_ids: list[list[int]]
    seconds: float
    prefill_seconds: float = float("nan")
    # with `hidden_layers`: per row, the features of every token the target read (prompt, then each new token but
    # the last), bfloat16 [n, prompt_length + len(token_ids) - 1, d]
    features: list[np.ndarray] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("nan")


def generate(
    weights: Weights,
    cfg: ModelConfig,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    max_cache_length: int | None = None,
    mesh: Mesh | None = None,
    hidden_layers: Sequence[int] = (),
) -> GenerationResult:
    """Generates for a batch of token-id prompts of any lengths; returns the new ids of every row.

    mesh: a (data, model) mesh (`jaxspec.sharding.make_mesh`) to run on; the batch must split over its data axis.
    hidden_layers: also return the residual stream after these layers at every token the target read, computed
        while generating (`GenerationResult.features`).
    """
    batch = pad_prompts(prompt_ids, max_new_tokens, cfg, max_cache_length)
    eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    weights, tokens, lengths, rng = place_inputs(mesh, cfg, weights, batch.tokens, batch.lengths, seed)
    start = time.perf_counter()
    results = generate_tokens(
        weights, cfg, tokens, lengths, rng, max_new_tokens=max_new_tokens, cache_size=batch.cache_size,
        sampling=sampling, eos_ids=eos, mesh=mesh, hidden_layers=tuple(hidden_layers),
    )
    out, counts = to_host(results[0]), to_host(results[1])
    features = None
    if hidden_layers:
        hidden = to_host(results[2])  # [n, B, P + N, d]
        fed = batch.lengths + counts - 1  # [B]: the last new token is never fed back
        features = [np.ascontiguousarray(hidden[:, r, : fed[r]]) for r in range(len(out))]
    seconds = time.perf_counter() - start
    return GenerationResult(token_ids=[out[r, : counts[r]].tolist() for r in range(len(out))], seconds=seconds,
                            features=features)


def stream_generate(
    weights: Weights,
    cfg: ModelConfig,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    max_cache_length: int | None = None,
) -> Iterator[np.ndarray]:
    """Yields int32[B] each step as tokens come (PAD for rows already finished).

    Same tokens as `generate` for the same arguments: the same prefill, decode step and per-step keys.
    """
    batch = pad_prompts(prompt_ids, max_new_tokens, cfg, max_cache_length)
    eos = np.asarray(tuple(cfg.eos_token_ids if eos_ids is None else eos_ids), np.int32)
    rng = jax.random.key(seed)
    weights = execution_weights(weights)
    cache = init_cache(cfg, len(batch.lengths), batch.cache_size, weights.embed.dtype,
                       per_layer=isinstance(weights.layers, tuple))
    logits, _, cache = _prefill_jit(weights, cfg, jnp.asarray(batch.tokens), jnp.asarray(batch.lengths), cache)
    last = _sample_jit(jax.random.fold_in(rng, 0), logits, sampling)
    done = np.zeros(len(batch.lengths), bool)
    for step in range(max_new_tokens):
        if step > 0:
            logits, cache = _decode_step_jit(weights, cfg, last, cache, jnp.asarray(~done))
            last = _sample_jit(jax.random.fold_in(rng, step), logits, sampling)
        tokens = np.where(done, PAD, np.asarray(last))
        yield tokens
        done |= np.isin(tokens, eos)
        if done.all():
            return
