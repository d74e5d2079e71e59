"""Autoregressive generation: prefill, one-token decode steps, and the jitted loop around them.

Rows of a batch have their own prompt lengths: prompts are right-padded to a common width, every row's
cache length starts at its own prompt length, and each row decodes at its own position. Rows that reached
EOS stop advancing their cache and emit `PAD` (-1). Shapes are bucketed (prompt width to a multiple of 32 and at
least 64, cache to a multiple of 128), so a generation never recompiles and most new prompts reuse a compilation.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxspec.cache import KVCache, commit_recurrent, init_cache, replace_rows
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.model import Weights, draws_through_screen, execution_weights, greedy_tokens, lm_head, output_matrix
from jaxspec.sampling import GREEDY, SamplingConfig, gumbel_noise, sample_token
from jaxspec.sharding import forward_on_mesh, place_inputs, to_host

PAD = -1  # emitted after a row's EOS
# prompt widths: 64, 96, 128, 160, ... The prefill computes every padded position, so finer steps waste less of it (an
# 88-token GSM8K prompt: 96 positions, not 128); shorter prompts share one width, so short tests and chats reuse one
# compilation.
PROMPT_BUCKET = 32
MIN_PROMPT_WIDTH = 64
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
                mesh: Mesh | None = None, hidden_layers: tuple[int, ...] = (), greedy: bool = False,
                noise: jax.Array | None = None):
    """Feeds one token per row at position lengths[b]; returns (logits [B, V], cache), and with `hidden_layers`
    also the residual stream after those layers at the fed token, [n, B, d]: (logits, cache, hidden).

    token: int32[B]; advance: bool[B], rows whose cache length moves on (finished rows stay put).
    greedy: return each row's next token, the argmax int32[B], in place of the logits (`greedy_tokens`, which on
        CPU finds it from the bfloat16 screen of the LM head).
    noise: float32[B, V] added to the logits before that argmax: with temperature x Gumbel noise
        (`jaxspec.sampling.gumbel_noise`) the token is a draw at that temperature.
    """
    screen = greedy and mesh is None
    out = forward_on_mesh(mesh, weights, cfg, token[:, None], cache.lengths[:, None], cache,
                          hidden_layers=hidden_layers, compute_logits=not screen)
    cache = dataclasses.replace(out.cache, lengths=cache.lengths + advance.astype(jnp.int32))
    cache = commit_recurrent(cache, out.pending, jnp.zeros_like(token)[:, None], advance.astype(jnp.int32))
    if screen:
        scores = greedy_tokens(weights, cfg, out.last_hidden, None if noise is None else noise[:, None])[:, 0]  # [B]
    elif greedy:
        logits = out.logits[:, 0] if noise is None else out.logits[:, 0] + noise  # [B, V]
        scores = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]
    else:
        scores = out.logits[:, 0]  # [B, V]
    if hidden_layers:
        return scores, cache, out.hidden[:, :, 0]
    return scores, cache


def _decode_keeping_features(weights: Weights, cfg: ModelConfig, last: jax.Array, cache: KVCache, done: jax.Array,
                             features: jax.Array | None, mesh: Mesh | None, hidden_layers: tuple[int, ...],
                             hidden_dtype, greedy: bool = False, noise: jax.Array | None = None):
    """A decoding step of the rows not `done` (bool[B]) that also stores, with `hidden_layers`, the residual stream
    after those layers at the fed token `last` (int32[B]) in `features` [n, B, S, d] (the bits of hidden_dtype) at the
    token's position. Returns (logits [B, V], or with `greedy` the next tokens int32[B], cache, features); greedy and
    noise as `decode_step`'s."""
    if not hidden_layers:
        logits, cache = decode_step(weights, cfg, last, cache, ~done, mesh, greedy=greedy, noise=noise)
        return logits, cache, features
    position = cache.lengths  # [B]: where `last` goes
    logits, cache, hidden = decode_step(weights, cfg, last, cache, ~done, mesh, hidden_layers, greedy=greedy,
                                        noise=noise)
    where = jnp.where(done, features.shape[2], position)  # finished rows write out of range, which is dropped
    rows = jnp.arange(last.shape[0])
    return logits, cache, features.at[:, rows, where].set(_to_bits(hidden, hidden_dtype), mode="drop")


def _decode_next(weights: Weights, cfg: ModelConfig, last: jax.Array, cache: KVCache, done: jax.Array,
                 features: jax.Array | None, mesh: Mesh | None, hidden_layers: tuple[int, ...], hidden_dtype,
                 keys: jax.Array, sampling: SamplingConfig):
    """`_decode_keeping_features` and each row's next token int32[B]: the argmax when greedy; with a temperature alone
    where the LM head's bfloat16 screen runs (`draws_through_screen`), the argmax of logits + temperature x Gumbel
    noise, which needs no full logits; otherwise a draw from the processed logits. keys: one PRNG key for the step, or
    one per row [B] (continuous batching: a row's draws do not depend on its batch). Returns (tokens, cache,
    features)."""
    by_argmax = sampling.greedy or (mesh is None and draws_through_screen(weights, sampling, last.shape[0]))
    vocab = output_matrix(weights).shape[0]
    noise = None
    if by_argmax and not sampling.greedy:
        noise = (gumbel_noise(keys, (last.shape[0], vocab), sampling) if keys.ndim == 0 else
                 jax.vmap(lambda k: gumbel_noise(k, (vocab,), sampling))(keys))  # [B, V]
    scores, cache, features = _decode_keeping_features(weights, cfg, last, cache, done, features, mesh, hidden_layers,
                                                       hidden_dtype, greedy=by_argmax, noise=noise)
    return (scores if by_argmax else _sample_with_keys(keys, scores, sampling)), cache, features


def _prompt_feature_bits(hidden: jax.Array, prompt_lengths: jax.Array, hidden_dtype) -> jax.Array:
    """A prefill's features hidden [n, B, P, d] as the bits of hidden_dtype, zero past each row's prompt length."""
    in_prompt = jnp.arange(hidden.shape[2])[None, :] < prompt_lengths[:, None]  # [B, P]
    return _to_bits(jnp.where(in_prompt[None, :, :, None], hidden, 0), hidden_dtype)


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
        # kept as the bits of hidden_dtype (unsigned integers of its width): XLA:CPU widened a bfloat16 buffer to
        # float32 and back around every step's scatter, whole-buffer conversions that cost more than the step
        features = jnp.zeros((len(hidden_layers), b, p + max_new_tokens, cfg.hidden_size), _bits_dtype(hidden_dtype))
        features = features.at[:, :, :p].set(_prompt_feature_bits(prefill_out.hidden, prompt_lengths,
                                                                  hidden_dtype))  # [n, B, P + N, d]

    def cond(state):
        step, _, _, _, done, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, cache, out, last, done, features = state
        new, cache, features = _decode_next(weights, cfg, last, cache, done, features, mesh, hidden_layers,
                                            hidden_dtype, jax.random.fold_in(rng, step), sampling)  # [B]
        new = jnp.where(done, PAD, new)
        out = jax.lax.dynamic_update_slice(out, new[:, None], (0, step))
        return step + 1, cache, out, jnp.maximum(new, 0), done | _is_eos(new, eos_ids), features

    _, _, out, _, _, features = jax.lax.while_loop(cond, body, (jnp.int32(1), cache, out, first, done, features))
    counts = jnp.sum(out != PAD, axis=1).astype(jnp.int32)
    if hidden_layers:
        return out, counts, jax.lax.bitcast_convert_type(features, hidden_dtype)
    return out, counts


_prefill_jit = jax.jit(prefill, static_argnames=("cfg",), donate_argnames=("cache",))
_sample_jit = jax.jit(sample_token)


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _stream_step(weights: Weights, cfg: ModelConfig, last: jax.Array, cache: KVCache, done: jax.Array, key: jax.Array,
                 sampling: SamplingConfig):
    """`stream_generate`'s step: (next tokens int32[B], cache), as `generate_tokens`' loop body draws them."""
    new, cache, _ = _decode_next(weights, cfg, last, cache, done, None, None, (), None, key, sampling)
    return new, cache


# ---------------------------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Batch:
    """Prompts padded for the device. tokens: int32[B, P]; lengths: int32[B]."""

    tokens: np.ndarray
    lengths: np.ndarray
    cache_size: int


def step_seconds(runs: dict[str, Callable[[int], float]], steps: int = 9, repeats: int = 2) -> dict[str, float]:
    """Seconds per decoding step of each variant, timed in turn in this process (the host's speed drifts between
    processes): `runs[name](n)` decodes n new tokens and returns its wall seconds. Each variant first runs `steps`
    tokens and one token (compiling both), then `repeats` rounds time them all; the best time of each length is kept
    and their difference per step taken, the prefill subtracted. (The best of differences would reward a run of one
    step slowed by another process: a step "measured" at 7 ms against 350 once chose the slower layout for a whole
    regeneration on a busy machine.) A busy host can still give a difference of 0 or less: callers check."""
    for run in runs.values():
        run(steps)
        run(1)
    long_runs = {name: float("inf") for name in runs}
    short_runs = dict(long_runs)
    for _ in range(repeats):
        for name, run in runs.items():
            long_runs[name] = min(long_runs[name], run(steps))
            short_runs[name] = min(short_runs[name], run(1))
    return {name: (long_runs[name] - short_runs[name]) / (steps - 1) for name in runs}


def fastest_layout(weights: Weights, cfg: ModelConfig, batch_size: int, cache_size: int,
                   hidden_layers: tuple[int, ...] = (), steps: int = 9, repeats: int = 2) -> tuple[str, dict]:
    """The CPU weight layout ("stacked" or "unstacked") that decodes a `batch_size`-row step faster on this machine.

    Which one wins differs between machines and batch sizes (docs/cpu-performance.md: per-layer buffers on an AMD
    EPYC at batch 64, the stacked scan on an Intel Xeon), so it is measured: `generate_tokens` over `cache_size`
    slots (keeping `hidden_layers`, as regeneration does) in each layout, timed in turn in this process (the host's
    speed drifts between processes), prefill subtracted, the best of `repeats`. Off CPU the stacked scan is the
    only layout (accelerators fuse its slice into the product) and nothing is timed.

    Returns:
        (the layout, {layout: seconds per decoding step}); the dict is empty off CPU.
    """
    if jax.default_backend() != "cpu":
        return "stacked", {}
    from jaxspec.model import feature_major_layers

    layouts = {"stacked": weights, "unstacked": feature_major_layers(weights)}
    tokens = jnp.zeros((batch_size, 16), jnp.int32)  # [B, 16]
    lengths = jnp.full((batch_size,), 8, jnp.int32)  # [B]: an 8-token context per row

    def decoder(layer_weights):
        def run(n: int) -> float:
            start = time.perf_counter()
            jax.block_until_ready(generate_tokens(layer_weights, cfg, tokens, lengths, jax.random.key(0),
                                                  max_new_tokens=n, cache_size=cache_size,
                                                  hidden_layers=hidden_layers))
            return time.perf_counter() - start
        return run

    best = step_seconds({name: decoder(w) for name, w in layouts.items()}, steps, repeats)
    if min(best.values()) <= 0:
        raise UserError(f"Timing the CPU layouts gave a decoding step of {min(best.values()) * 1e3:.1f} ms (prefill "
                        "subtracted): the machine was too busy to measure. Rerun when it is quieter, or choose the "
                        "layout with --layers stacked|unstacked.")
    return min(best, key=best.get), best


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
    width = max(MIN_PROMPT_WIDTH, round_up(longest, PROMPT_BUCKET))
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
            last, cache = _stream_step(weights, cfg, last, cache, jnp.asarray(done), jax.random.fold_in(rng, step),
                                       sampling)
        tokens = np.where(done, PAD, np.asarray(last))
        yield tokens
        done |= np.isin(tokens, eos)
        if done.all():
            return


# ---------------------------------------------------------------------------------------------- continuous batching


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowsState:
    """The device state of a continuous batch of B rows, each answering its own prompt.

    cache: the rows' KV cache (S slots); last: int32[B], each row's last token (fed next); out: int32[B, N], its new
    tokens (PAD after); count: int32[B], how many it has; done: bool[B], finished (EOS or N tokens) or free;
    sample: int32[B], the index of the prompt it answers (its sampling keys derive from it); features: the bits of
    the residual stream after the saved layers at every slot a row's tokens fill, [n, B, S, d] (or None).
    """

    cache: KVCache
    last: jax.Array  # int32[B]
    out: jax.Array  # int32[B, N]
    count: jax.Array  # int32[B]
    done: jax.Array  # bool[B]
    sample: jax.Array  # int32[B]
    features: jax.Array | None  # [n, B, S, d], unsigned integers holding hidden_dtype bits


def _row_keys(rng: jax.Array, sample: jax.Array, count: jax.Array) -> jax.Array:
    """[B] PRNG keys fixed by (rng, each row's prompt index, its token index), so a row's answer does not depend on
    which rows it shares the batch with."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.fold_in(rng, s), c))(sample, count)


def _sample_with_keys(keys: jax.Array, logits: jax.Array, sampling: SamplingConfig) -> jax.Array:
    """int32[B]: `sample_token` on logits [B, V] with one key for the batch, or with each row's own key [B]."""
    if keys.ndim == 0:
        return sample_token(keys, logits, sampling)
    return jax.vmap(lambda k, row: sample_token(k, row[None], sampling)[0])(keys, logits)


def _sample_rows(rng: jax.Array, sample: jax.Array, count: jax.Array, logits: jax.Array,
                 sampling: SamplingConfig) -> jax.Array:
    """int32[B]: each row's next token from logits [B, V], drawn with its `_row_keys` key."""
    if sampling.greedy:
        return sample_token(rng, logits, sampling)
    return _sample_with_keys(_row_keys(rng, sample, count), logits, sampling)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_ids", "hidden_layers", "hidden_dtype"),
                   donate_argnames=("state",))
def _start_rows(weights: Weights, cfg: ModelConfig, state: RowsState, rng: jax.Array, rows: jax.Array,
                tokens: jax.Array, prompt_lengths: jax.Array, sample: jax.Array, sampling: SamplingConfig,
                eos_ids: tuple[int, ...], *, hidden_layers: tuple[int, ...], hidden_dtype):
    """Prefills R prompts into rows `rows` of a continuous batch and samples their first tokens.

    rows: int32[R] (the batch size B for a padding entry: dropped); tokens: int32[R, P] right-padded prompts;
    prompt_lengths: int32[R]; sample: int32[R], their prompt indices.
    """
    r, p = tokens.shape
    n = state.out.shape[1]
    fresh = init_cache(cfg, r, state.cache.max_length, weights.embed.dtype, per_layer=state.cache.per_layer)
    logits, prefilled, fresh = prefill(weights, cfg, tokens, prompt_lengths, fresh, hidden_layers=hidden_layers)
    first = _sample_rows(rng, sample, jnp.zeros_like(sample), logits, sampling)  # [R]
    features = state.features
    if hidden_layers:
        prompt = _prompt_feature_bits(prefilled.hidden, prompt_lengths, hidden_dtype)  # [n, R, P, d]
        width = features.shape[2]
        prompt = jnp.pad(prompt, ((0, 0), (0, 0), (0, width - p), (0, 0)))  # [n, R, S, d]: the rest zeroed
        features = features.at[:, rows].set(prompt, mode="drop")
    return RowsState(
        cache=replace_rows(state.cache, rows, fresh),
        last=state.last.at[rows].set(first, mode="drop"),
        out=state.out.at[rows].set(jnp.full((r, n), PAD, jnp.int32).at[:, 0].set(first), mode="drop"),
        count=state.count.at[rows].set(1, mode="drop"),
        done=state.done.at[rows].set(_is_eos(first, eos_ids) | (n <= 1), mode="drop"),
        sample=state.sample.at[rows].set(sample, mode="drop"),
        features=features)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_ids", "steps", "hidden_layers", "hidden_dtype"),
                   donate_argnames=("state",))
def _continue_rows(weights: Weights, cfg: ModelConfig, state: RowsState, rng: jax.Array, sampling: SamplingConfig,
                   eos_ids: tuple[int, ...], *, steps: int, hidden_layers: tuple[int, ...], hidden_dtype):
    """Up to `steps` decoding steps of every unfinished row (stops early once all rows are done)."""
    b, n = state.out.shape
    rows = jnp.arange(b)

    def cond(carry):
        step, state = carry
        return (step < steps) & ~jnp.all(state.done)

    def body(carry):
        step, s = carry
        new, cache, features = _decode_next(weights, cfg, s.last, s.cache, s.done, s.features, None, hidden_layers,
                                            hidden_dtype, _row_keys(rng, s.sample, s.count), sampling)  # [B]
        new = jnp.where(s.done, PAD, new)
        out = s.out.at[rows, jnp.where(s.done, n, s.count)].set(new, mode="drop")
        count = s.count + (~s.done).astype(jnp.int32)
        done = s.done | _is_eos(new, eos_ids) | (count >= n)
        return step + 1, RowsState(cache=cache, last=jnp.maximum(new, 0), out=out, count=count, done=done,
                                   sample=s.sample, features=features)

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]


def _take_similar_prompts(waiting: list[int], lengths: Sequence[int], size: int, window: int) -> list[int]:
    """Removes `size` prompts from `waiting` (prompt indices, oldest first) for one prefill group and returns them:
    the oldest, and the `size - 1` of the next `window - 1` whose lengths are nearest its own (ties to the older).

    A group's prefill computes every position up to its longest prompt: in prompt order, the HumanEval-form code
    prompts of `scripts/make_prompts.py` (64-256 tokens) filled 54% of the positions of their groups of 16, nearest
    lengths within 128 prompts 83% (a third less prefill, which took 44% of a regeneration of such prompts).
    The oldest always goes, so no prompt waits for more than `window` others to start."""
    front = waiting[0]
    nearest = sorted(waiting[1:window], key=lambda i: (abs(lengths[i] - lengths[front]), i))[: max(size - 1, 0)]
    taken = [front, *nearest]
    chosen = set(taken)
    waiting[:] = [i for i in waiting if i not in chosen]
    return taken


def continuous_generate(
    weights: Weights,
    cfg: ModelConfig,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    batch_size: int = 16,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    hidden_layers: Sequence[int] = (),
    hidden_dtype=jnp.bfloat16,
    steps_per_sync: int = 16,
    start_group: int | None = None,
    sample_ids: Sequence[int] | None = None,
) -> Iterator[tuple[int, list[int], np.ndarray | None]]:
    """Answers many prompts with `batch_size` rows kept busy: a row that finishes takes the next prompt.

    `generate` runs a batch until its longest answer ends, so rows that finish early idle; here the rows decode
    `steps_per_sync` steps at a time, and between such chunks the host hands the finished rows' answers back and
    prefills waiting prompts into their rows (in groups of `start_group` rows, default batch_size / 8, each group
    padded to a width of `pad_prompts`; a group is the oldest waiting prompt and those nearest its length among the
    next ones, `_take_similar_prompts`, and starts once it fills its rows, when no row is busy, or with the last
    prompts: a short group is computed at full size with copies). Greedy answers equal `generate`'s; sampled ones
    are drawn with keys fixed by (seed, the prompt's index, the token's index), so they do not depend on the batch
    either; `sample_ids`
    (int per prompt) replaces the prompt's index there, so that a caller answering a later part of a prompt list
    (a resumed regeneration) draws what a whole run would have.

    Yields (prompt index, new token ids with the EOS when reached, features) as answers finish, in any order.
    features (with `hidden_layers`): the residual stream after those layers at every token the target read (the
    prompt, then each new token but the last), computed while generating, [n, prompt length + new - 1, d] in
    `hidden_dtype`; else None.

    Raises UserError (before any work) if a prompt is empty or does not fit the cache with max_new_tokens.
    """
    if batch_size < 1 or steps_per_sync < 1:
        raise UserError(f"batch_size and steps_per_sync must be at least 1, got {batch_size} and {steps_per_sync}.")
    prompt_ids = [list(map(int, p)) for p in prompt_ids]
    sample_ids = list(range(len(prompt_ids))) if sample_ids is None else [int(i) for i in sample_ids]
    if len(sample_ids) != len(prompt_ids):
        raise UserError(f"sample_ids has {len(sample_ids)} entries for {len(prompt_ids)} prompts.")
    cache_size = pad_prompts(prompt_ids, max_new_tokens, cfg).cache_size  # checks every prompt fits
    eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    hidden_layers = tuple(hidden_layers)
    group = max(1, min(batch_size, start_group or batch_size // 8))
    weights = execution_weights(weights)
    rng = jax.random.key(seed)
    b, n = batch_size, max_new_tokens
    features = None
    if hidden_layers:
        features = jnp.zeros((len(hidden_layers), b, cache_size, cfg.hidden_size), _bits_dtype(hidden_dtype))
    state = RowsState(
        cache=init_cache(cfg, b, cache_size, weights.embed.dtype, per_layer=isinstance(weights.layers, tuple)),
        last=jnp.zeros((b,), jnp.int32), out=jnp.full((b, n), PAD, jnp.int32), count=jnp.zeros((b,), jnp.int32),
        done=jnp.ones((b,), jnp.bool_), sample=jnp.zeros((b,), jnp.int32), features=features)
    waiting = list(range(len(prompt_ids)))  # prompt indices, in order
    lengths = [len(p) for p in prompt_ids]
    free = list(range(b))
    busy: dict[int, int] = {}  # row -> prompt index
    while waiting or busy:
        while waiting and free and (len(free) >= min(group, len(waiting)) or not busy):
            taken = _take_similar_prompts(waiting, lengths, min(group, len(free)), window=8 * group)
            rows = [free.pop(0) for _ in taken]
            pad = group - len(rows)  # a short group is filled with copies of its last prompt, written to no row
            members = taken + taken[-1:] * pad  # [R] prompt indices
            batch = pad_prompts([prompt_ids[i] for i in members], max_new_tokens, cfg)  # tokens [R, P], lengths [R]
            state = _start_rows(
                weights, cfg, state, rng, jnp.asarray(rows + [b] * pad, jnp.int32), jnp.asarray(batch.tokens),
                jnp.asarray(batch.lengths), jnp.asarray([sample_ids[i] for i in members], jnp.int32),
                sampling, eos, hidden_layers=hidden_layers, hidden_dtype=hidden_dtype)
            busy.update(zip(rows, taken))
        state = _continue_rows(weights, cfg, state, rng, sampling, eos, steps=steps_per_sync,
                               hidden_layers=hidden_layers, hidden_dtype=hidden_dtype)
        done = np.asarray(state.done)  # [B]
        finished = [row for row in busy if done[row]]
        if not finished:
            continue
        # the finished rows padded to a power of two (repeating the first), so the gathers compile a few times only
        padded = 1 << (len(finished) - 1).bit_length()
        picked = jnp.asarray(finished + finished[:1] * (padded - len(finished)), jnp.int32)
        out, count = np.asarray(state.out[picked]), np.asarray(state.count[picked])  # [F', N], [F']
        hidden = None
        if hidden_layers:
            hidden = np.asarray(jax.lax.bitcast_convert_type(state.features[:, picked], hidden_dtype))  # [n, F', S, d]
        for j, row in enumerate(finished):
            index = busy.pop(row)
            free.append(row)
            fed = len(prompt_ids[index]) + int(count[j]) - 1  # the last new token is never fed back
            yield index, out[j, : count[j]].tolist(), (
                None if hidden is None else np.ascontiguousarray(hidden[:, j, :fed]))
