"""Speculative pipeline decoding (PPSD, SPD): the target's layers as n pipeline stages with one token per stage.

The L layers are split into n stages of L/n layers (stacked weights reshaped to [n, L/n, ...]). Slot j holds the
token about to run stage j: it has done j stages, and its position is the newest token's position minus j. One
pipeline step runs every stage on its own slot's token (all stages at once) and shifts every token one stage on.
The token leaving the last stage goes through the LM head; its distribution verifies the token behind it, drafted
n steps earlier (greedy match or the one-node rejection rule of `jaxspec.verification`).

- Accepted: that token is emitted and keeps flowing; a new drafted token enters stage 0.
- Rejected: the replacement is sampled from the corrected distribution and emitted, every in-flight token is
  flushed, and the replacement refills stage 0 alone (warm-up again: n - 1 steps without an exit).

The KV cache needs no copy on a flush: a stage writes a token's keys and values at the token's position, and
attention only looks at slots before it, so the entries of flushed tokens are simply overwritten later. A token
at stage j sees the entries of the token before it at stage j's layers because that token ran stage j one step
earlier (the pipeline invariant). Bubbles (slots without a token) write nothing.

Two executors run the stages, with the same stage function and the same results:
- one device: `jax.vmap` over the stage axis, then a roll of the outputs by one stage;
- a mesh with a 'stage' axis: `jax.shard_map` gives each device its block of stages (their layers and their slice
  of the KV cache) and `jax.lax.ppermute` passes the last stage's output of each block to the next device.

A hybrid target (Qwen3.5: Gated DeltaNet layers beside attention layers) runs its stages one after another on one
device (`run_hybrid_stages`; its stages differ in kind, so they are not one vmapped program). A linear-attention
layer's state is not a per-position entry that a flush can leave behind: every token moves it. Each such layer
keeps a ring of n states instead, the state after the token at position p at slot p % n; a token reads its
predecessor's slot and writes its own. The invariant of the KV cache carries over: after a rejection of the token
behind position p, the in-flight tokens wrote the slots of positions p + 1 .. p + n - 1 only, so slot p % n still
holds the state after the last kept token, where the replacement starts (docs/spd.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxspec.cache import init_cache
from jaxspec.config import ModelConfig
from jaxspec.errors import UserError
from jaxspec.gated_delta import conv_state_after, state_after
from jaxspec.generate import PAD, GenerationResult, pad_prompts, prefill
from jaxspec.model import (
    LayerWeights,
    Weights,
    _layer,
    _linear_layer,
    embed_tokens,
    lm_head,
    rope_inverse_frequencies,
    run_layers,
)
from jaxspec.sampling import GREEDY, SamplingConfig, sample_token, target_probs
from jaxspec.sharding import DATA, STAGE, place_inputs, replicate_on_mesh, to_host
from jaxspec.tree import DraftTree
from jaxspec.verification import accept

# ---------------------------------------------------------------------------------------------- stages


def check_num_stages(cfg: ModelConfig, num_stages: int) -> None:
    if num_stages < 2 or cfg.num_layers % num_stages:
        divisors = [n for n in range(2, cfg.num_layers + 1) if cfg.num_layers % n == 0]
        raise UserError(f"--num-stages must divide the target's {cfg.num_layers} layers into at least 2 equal stages; "
                        f"got {num_stages}. Choose one of {divisors}.")


def check_pipeline(cfg: ModelConfig, num_stages: int, tree_width: int = 1, stage_devices: int = 1) -> None:
    """Refuses, before any work, a pipeline this target cannot run: stages that do not divide its layers, and for
    a hybrid target siblings (W > 1) or stages on several devices, which jaxspec does not do for it yet."""
    check_num_stages(cfg, num_stages)
    if cfg.is_hybrid and tree_width > 1:
        raise UserError(f"A pipeline over a hybrid model ({cfg.architecture}) drafts one token per step: siblings "
                        f"(--tree-width {tree_width}) would each need their own recurrent state, which jaxspec does "
                        "not keep yet. Leave out --tree-width.")
    if cfg.is_hybrid and stage_devices != 1:
        raise UserError(f"A pipeline over a hybrid model ({cfg.architecture}) runs its stages on one device for now "
                        "(its stages differ in layer kinds); leave out --stage-devices.")


def stage_size(cfg: ModelConfig, num_stages: int) -> int:
    """s = L / n layers per stage."""
    return cfg.num_layers // num_stages


def split_stages(tree: Any, num_stages: int) -> Any:
    """Every array [L, ...] -> [n, L/n, ...] (layer weights, or the cache's k and v)."""
    return jax.tree.map(lambda a: a.reshape(num_stages, a.shape[0] // num_stages, *a.shape[1:]), tree)


def merge_stages(tree: Any) -> Any:
    """The inverse of `split_stages`."""
    return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StageCache:
    """The target's KV cache split into stages, plus the siblings' side entries (draft trees of width W > 1).

    k, v: [n, s, B, Hkv, S, h], the trunk (one token per position, what attention reads). side_k, side_v:
    [n, s, B, W-1, Hkv, n, h] or None (W = 1): the keys and values of the W - 1 siblings that travel with each
    in-flight token, at slot position % n (in-flight positions are n consecutive ones, so they never collide).
    """

    k: jax.Array
    v: jax.Array
    side_k: jax.Array | None = None
    side_v: jax.Array | None = None


def _write_rows(buffer: jax.Array, new: jax.Array, index: jax.Array, active: jax.Array, axis: int) -> jax.Array:
    """For every active row b: buffer[:, b, ..., index[b] (on `axis` of the row), ...] = new[:, b]. buffer:
    [s, B, ...]; new: [s, B, ...] with size 1 on `axis`; index: int32[B]; active: bool[B]."""

    def row(buf, entry, at, on):
        old = jax.lax.dynamic_slice_in_dim(buf, at, 1, axis=axis)
        return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(on, entry.astype(buf.dtype), old), at, axis=axis)

    return jax.vmap(row, in_axes=(1, 1, 0, 0), out_axes=1)(buffer, new, index, active)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridStageCache:
    """A hybrid target's cache in a pipeline: k, v [La, B, Hkv, S, h] of its La attention layers (entries written at
    each token's position, as in `StageCache`); conv [Lg, B, n, K-1, C] and state [Lg, B, n, H, Dk, Dv] float32 of
    its Lg linear-attention layers: the conv window and recurrent state after the token at position p, at ring slot
    p % n."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    state: jax.Array


def hybrid_stage_cache(flat, num_stages: int) -> HybridStageCache:
    """The pipeline's cache from a prefilled hybrid KVCache: every ring slot starts as the state after the prompt
    (the first token reads the slot of the last prompt position; the others are written before they are read)."""

    def ring(a):  # [Lg, B, ...] -> [Lg, B, n, ...]
        return jnp.broadcast_to(a[:, :, None], (a.shape[0], a.shape[1], num_stages, *a.shape[2:]))

    return HybridStageCache(k=flat.k, v=flat.v, conv=ring(flat.conv), state=ring(flat.state))


def run_hybrid_stages(cfg: ModelConfig, num_stages: int, layers: tuple[LayerWeights, ...], cache: HybridStageCache,
                      x, positions, active, snapshot: int | None = None):
    """Every stage of a hybrid target on its own slot, one stage after another (stages of different layer kinds).

    layers: every layer's LayerWeights (a tuple of L); x: [n, B, 1, d] the residual stream entering each stage;
    positions: int32[n, B]; active: bool[n, B] (False: a bubble, nothing is written). snapshot: as in
    `run_stage_block`. Returns (out [n, B, 1, d], snap [n, B, 1, d] or None, cache).
    """
    s = stage_size(cfg, num_stages)
    b = x.shape[1]
    inv_freq = rope_inverse_frequencies(cfg)
    linear = np.asarray(cfg.linear_layers, bool)
    index = np.where(linear, np.cumsum(linear) - 1, np.cumsum(~linear) - 1)  # each layer's index among its kind
    alone = jnp.ones((b, 1, 1), jnp.bool_)  # [B, T, T]: one token per slot
    one_path, one_kept = jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32)
    rows = jnp.arange(b)
    k, v, conv, state = cache.k, cache.v, cache.conv, cache.state
    outs, snaps = [], []
    for j in range(num_stages):
        h, position, on = x[j], positions[j], active[j]  # [B, 1, d], int32[B], bool[B]
        before, here = (position - 1) % num_stages, position % num_stages  # ring slots, int32[B]
        for i in range(j * s, (j + 1) * s):
            g = int(index[i])
            if linear[i]:
                conv_in, state_in = conv[g, rows, before], state[g, rows, before]  # [B, K-1, C], [B, H, Dk, Dv]
                h, pending = _linear_layer(cfg, h, layers[i], conv_in, state_in, alone)
                keep = on[:, None, None]
                new_conv = conv_state_after(conv_in, pending, one_path, one_kept).astype(conv.dtype)
                conv = conv.at[g, rows, here].set(jnp.where(keep, new_conv, conv[g, rows, here]))
                new_state = state_after(state_in, pending, one_path, one_kept)
                state = state.at[g, rows, here].set(jnp.where(keep[..., None], new_state, state[g, rows, here]))
            else:
                h, new_k, new_v = _layer(cfg, inv_freq, h, layers[i], k[g], v[g], position, position[:, None],
                                         alone)  # new_k, new_v: [B, Hkv, 1, h]
                k = k.at[g].set(_write_rows(k[g][None], new_k[None], position, on, axis=2)[0])
                v = v.at[g].set(_write_rows(v[g][None], new_v[None], position, on, axis=2)[0])
            if snapshot is not None and i == j * s + snapshot:
                snaps.append(h)
        outs.append(h)
    cache = HybridStageCache(k=k, v=v, conv=conv, state=state)
    return jnp.stack(outs), jnp.stack(snaps) if snapshot is not None else None, cache


def run_stage_block(cfg: ModelConfig, num_stages: int, layers: LayerWeights, cache: StageCache, x, positions,
                    active, layer_ids, snapshot: int | None = None):
    """Runs a block of m consecutive stages, each on its own slot (m = n on one device, n / devices on a mesh).

    layers: LayerWeights [m, s, ...]; cache: StageCache with m stages; x: [m, B, W, d], the residual stream entering
    each stage, W lanes per slot (lane 0 the trunk token, lanes 1.. its siblings: the same position, each seeing the
    trunk's cache and itself); positions: int32[m, B]; active: bool[m, B] (False: a bubble, nothing is written);
    layer_ids: int32[m, s], each stage's layers' indices in the model (see `run_layers`).
    snapshot: the layer within a stage (0 .. s-1) whose output is returned beside the stage's output, for a drafter
    that reads it (`PipelineDrafter.snapshot_layer`); None: none.
    Returns (out [m, B, W, d] each stage's output, snap [m, B, W, d] the output of each stage's `snapshot` layer or
    None, cache).
    """
    width = x.shape[2]

    def one_stage(lw, c: StageCache, x, position, on, ids):  # x: [B, W, d]; position: int32[B]; ids: int32[s]
        b = x.shape[0]
        lanes = jnp.broadcast_to(position[:, None], (b, width))
        alone = jnp.broadcast_to(jnp.eye(width, dtype=jnp.bool_), (b, width, width))  # siblings do not see each other
        out, new_k, new_v, hidden = run_layers(cfg, lw, x, lanes, c.k, c.v, position, alone,
                                               keep_hidden=snapshot is not None, layer_ids=ids)
        # new_k, new_v: [s, B, Hkv, W, h]
        c = dataclasses.replace(c, k=_write_rows(c.k, new_k[:, :, :, :1], position, on, axis=2),
                                v=_write_rows(c.v, new_v[:, :, :, :1], position, on, axis=2))
        if width > 1:
            ring = position % num_stages
            side = [jnp.moveaxis(new[:, :, :, 1:], 3, 2)[..., None, :] for new in (new_k, new_v)]  # [s,B,W-1,Hkv,1,h]
            c = dataclasses.replace(c, side_k=_write_rows(c.side_k, side[0], ring, on, axis=3),
                                    side_v=_write_rows(c.side_v, side[1], ring, on, axis=3))
        return out, None if snapshot is None else hidden[snapshot], c

    return jax.vmap(one_stage)(layers, cache, x, positions, active, layer_ids)


def pipeline_step(cfg: ModelConfig, num_stages: int, layers: LayerWeights, cache: StageCache, x, positions, active,
                  mesh: Mesh | None = None, snapshot: int | None = None):
    """One pipeline step: every stage runs its slot, then every output moves on one stage.

    layers: LayerWeights [n, s, ...]; cache: StageCache; x: [n, B, W, d] (slot j's input to stage j); positions:
    int32[n, B]; active: bool[n, B]. mesh: None (one device, stages by vmap) or a mesh whose 'stage' axis divides n
    (each device runs n / size consecutive stages). snapshot: see `run_stage_block`.
    Returns (shifted [n, B, W, d]: stage j-1's output at j and stage n-1's output (the finished token) at 0,
    shifted_snap [n, B, W, d] likewise for the `snapshot` layer's output, or None; cache).
    """
    if cfg.is_hybrid:  # one device (checked by `check_pipeline`)
        out, snap, cache = run_hybrid_stages(cfg, num_stages, layers, cache, x, positions, active, snapshot)
        return jnp.roll(out, 1, axis=0), None if snap is None else jnp.roll(snap, 1, axis=0), cache
    per_stage = layers.attn_norm.shape[1]
    layer_ids = jnp.arange(num_stages * per_stage, dtype=jnp.int32).reshape(num_stages, per_stage)  # [n, s]
    if mesh is None:
        out, snap, cache = run_stage_block(cfg, num_stages, layers, cache, x, positions, active, layer_ids, snapshot)
        return jnp.roll(out, 1, axis=0), None if snap is None else jnp.roll(snap, 1, axis=0), cache
    devices = mesh.shape[STAGE]
    ring = [(i, (i + 1) % devices) for i in range(devices)]

    def per_device(layers, cache, x, positions, active, layer_ids):
        out, snap, cache = run_stage_block(cfg, num_stages, layers, cache, x, positions, active, layer_ids,
                                           snapshot)
        # the last stage of each device's block feeds the first stage of the next device's block
        moving = [out] if snap is None else [out, snap]
        boundary = jax.lax.ppermute(jnp.stack([a[-1] for a in moving]), STAGE, ring)  # [1 or 2, B, W, d]
        moved = [jnp.concatenate([boundary[i][None], a[:-1]], axis=0) for i, a in enumerate(moving)]
        return moved[0], None if snap is None else moved[1], cache

    spec = PartitionSpec(STAGE)
    return jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 6,
                         out_specs=(spec, None if snapshot is None else spec, spec))(
        layers, cache, x, positions, active, layer_ids)


def promote_sibling(cache: StageCache, position: jax.Array, lane: jax.Array, promote: jax.Array) -> StageCache:
    """Copies sibling `lane` (1..W-1) of the token at `position` into the trunk, in every stage's layers, for rows
    where `promote`: its entries become the ones attention reads. position, lane: int32[B]; promote: bool[B]."""

    def copy(trunk, side):  # [n, s, B, Hkv, S, h], [n, s, B, W-1, Hkv, n, h]
        def row(t, sd, p, r, on):  # [n, s, Hkv, S, h], [n, s, W-1, Hkv, n, h]
            entry = jax.lax.dynamic_index_in_dim(sd, r - 1, axis=2, keepdims=False)  # [n, s, Hkv, n, h]
            entry = jax.lax.dynamic_slice_in_dim(entry, p % sd.shape[-2], 1, axis=3)  # [n, s, Hkv, 1, h]
            old = jax.lax.dynamic_slice_in_dim(t, p, 1, axis=3)
            return jax.lax.dynamic_update_slice_in_dim(t, jnp.where(on, entry, old), p, axis=3)

        return jax.vmap(row, in_axes=(2, 2, 0, 0, 0), out_axes=2)(trunk, side, position, lane, promote)

    return dataclasses.replace(cache, k=copy(cache.k, cache.side_k), v=copy(cache.v, cache.side_v))


def stage_mesh(num_stages: int, num_devices: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh with the 'stage' axis over `num_devices` devices (default: as many as divide n, up to n)."""
    devices = list(jax.devices() if devices is None else devices)
    if num_devices is None:
        num_devices = max(d for d in range(1, min(num_stages, len(devices)) + 1) if num_stages % d == 0)
    if num_devices > len(devices):
        raise UserError(f"A pipeline over {num_devices} devices needs {num_devices} devices; JAX sees {len(devices)}. "
                        "On CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting Python.")
    if num_stages % num_devices:
        raise UserError(f"{num_stages} stages cannot be split evenly over {num_devices} devices; use a device count "
                        f"that divides {num_stages}.")
    return Mesh(np.array(devices[:num_devices]), (STAGE,))


def place_on_stages(tree: Any, mesh: Mesh) -> Any:
    """Puts stage-split arrays ([n, ...]) on the mesh, sharded over 'stage'."""
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(STAGE)))


# ---------------------------------------------------------------------------------------------- drafters


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PipelineView:
    """What a pipeline drafter sees at one step (n slots, slot 0 newest; B rows).

    Before the step (the 'input state', what the target holds when the newest token enters stage 0): tokens,
    positions int32[n, B]; active bool[n, B]; hidden [n, B, d], the residual stream entering stage j (slot 0: the
    embedding); middle [n, B, d], the snapshot the drafter asked for (`PipelineDrafter.snapshot_layer`; slot 0: the
    embedding; None when it asked for none). After the step's stages ran (the 'output state'): out, out_middle
    [n, B, d], stage j's output and its snapshot layer's output for slot j's token (out_middle None likewise).
    committed: int32[B], tokens fully processed by every layer before the step.
    """

    tokens: jax.Array
    positions: jax.Array
    active: jax.Array
    hidden: jax.Array
    middle: jax.Array | None
    out: jax.Array
    out_middle: jax.Array | None
    committed: jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineDrafter:
    """Base class: drafts the token that enters stage 0 at the next step (static settings only, hashable)."""

    num_stages: int
    # W: the drafted token's top-W alternatives travel with it as siblings (deterministic top-W, see docs/spd.md)
    tree_width: int = 1
    name: str = "pipeline-drafter"
    # True: drafting starts from the input state and overlaps the step (SPD); False: it waits for the step
    hides_drafting: bool = False

    def init(self, params, target_weights: Weights, target_cfg: ModelConfig, prompt_tokens, prompt_lengths,
             prompt_hidden, cache_size: int) -> Any:
        """State after the prefill. prompt_hidden: [B, P, d], the target's last hidden state of every prompt token."""
        return None

    def propose(self, params, state, view: PipelineView, target_weights: Weights, target_cfg: ModelConfig,
                sampling: SamplingConfig, rng) -> tuple[jax.Array, jax.Array | None, Any]:
        """-> (drafts int32[B, W] (lane 0 the trunk token, then its siblings), q [B, V] the distribution a W = 1 draft
        was sampled from, or None for point masses; state)."""
        raise NotImplementedError

    def update(self, params, state, view: PipelineView, exiting: jax.Array, exit_token: jax.Array,
               exit_hidden: jax.Array) -> Any:
        """State after the step. exiting: bool[B], rows whose slot n-1 token left the pipeline (then committed);
        exit_token: int32[B]; exit_hidden: [B, d] its last hidden state."""
        return state

    def draft_cost_layers(self, target_cfg: ModelConfig) -> float:
        """Ls: drafting work per step in target-layer equivalents."""
        return 0.0

    def snapshot_layer(self, target_cfg: ModelConfig) -> int | None:
        """The layer within each stage (0 .. s-1) whose output the drafter reads beside the stages' outputs
        (`PipelineView.middle`, `out_middle`), or None (the default): the stages then keep no such snapshot."""
        return None

    def check_compatible(self, params, target_cfg: ModelConfig, target_tokenizer=None) -> None:
        check_num_stages(target_cfg, self.num_stages)


# ---------------------------------------------------------------------------------------------- decoding


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "max_new_tokens", "cache_size", "eos_ids",
                                             "mesh"))
def pipeline_generate_tokens(
    weights: Weights,
    cfg: ModelConfig,
    drafter: PipelineDrafter,
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
    """Jitted pipeline decoding of right-padded prompts (tokens int32[B, P], prompt_lengths int32[B]).

    Returns (new_tokens int32[B, max_new_tokens] with PAD after the end, num_new int32[B], stats: dict of int32[B]:
    steps (pipeline steps run), bubbles (steps whose last stage held no token), exits (tokens that left the
    pipeline), rejections (exits after which the pipeline was flushed), promotions (a sibling accepted instead of
    the trunk token); (cache, committed int32[B]) at the end).
    """
    n, width = drafter.num_stages, drafter.tree_width
    check_pipeline(cfg, n, width, 1 if mesh is None else mesh.shape[STAGE])  # at trace time, before any work
    b = tokens.shape[0]
    d = cfg.hidden_size
    eos = jnp.asarray(eos_ids if eos_ids else (-2,), jnp.int32)

    flat = init_cache(cfg, b, cache_size, weights.embed.dtype)
    logits, prefill_out, flat = prefill(weights, cfg, tokens, prompt_lengths, flat)
    first = sample_token(jax.random.fold_in(rng, 0), logits, sampling)  # [B]
    state = drafter.init(drafter_params, weights, cfg, tokens, prompt_lengths, prefill_out.last_hidden, cache_size)
    if cfg.is_hybrid:  # the stages run one after another over the per-layer weights (width 1, one device)
        layers, cache = weights.layers, hybrid_stage_cache(flat, n)
    else:
        layers = split_stages(weights.layers, n)  # [n, s, ...]
        cache = StageCache(*split_stages((flat.k, flat.v), n))  # [n, s, B, Hkv, S, h]
    if width > 1:
        side = (n, cfg.num_layers // n, b, width - 1, cfg.num_kv_heads, n, cfg.head_dim)
        cache = dataclasses.replace(cache, side_k=jnp.zeros(side, flat.k.dtype), side_v=jnp.zeros(side, flat.v.dtype))
    if mesh is not None:
        layers, cache = place_on_stages((layers, cache), mesh)

    def lanes_of(token):  # int32[B] -> [B, W]: a token that is not a draft (the first, a replacement) fills all lanes
        return jnp.broadcast_to(token[:, None], (b, width))

    def embed(lanes):  # int32[B, W] -> [B, W, d]
        return embed_tokens(weights, cfg, lanes)

    snapshot = drafter.snapshot_layer(cfg)  # the layer within a stage the drafter reads, or None
    first_lanes = lanes_of(first)
    zeros = jnp.zeros((n, b, width, d), weights.embed.dtype)
    slots = dict(
        tokens=jnp.zeros((n, b, width), jnp.int32).at[0].set(first_lanes),
        positions=jnp.zeros((n, b), jnp.int32).at[0].set(prompt_lengths),
        active=jnp.zeros((n, b), jnp.bool_).at[0].set(True),
        hidden=zeros.at[0].set(embed(first_lanes)),
        middle=None if snapshot is None else zeros.at[0].set(embed(first_lanes)),
        q=jnp.zeros((n, b, cfg.vocab_size), jnp.float32) if width == 1 and not sampling.greedy else None,
    )
    out = jnp.full((b, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    count = jnp.ones((b,), jnp.int32)
    done = jnp.isin(first, eos) | (count >= max_new_tokens)
    stats = {k: jnp.zeros((b,), jnp.int32) for k in ("steps", "bubbles", "exits", "rejections", "promotions")}
    slots["active"] = slots["active"] & ~done[None]
    star = jnp.full((b, width), -1, jnp.int32)  # every sibling is a child of the exiting token

    def cond(carry):
        return ~jnp.all(carry["done"])

    def body(carry):
        slots, state = carry["slots"], carry["state"]
        running = ~carry["done"]  # [B]
        key = jax.random.fold_in(rng, carry["step"])
        draft_key, accept_key, bonus_key = jax.random.split(key, 3)
        with jax.named_scope("stages"):
            shifted, shifted_middle, cache = pipeline_step(cfg, n, layers, carry["cache"], slots["hidden"],
                                                           slots["positions"], slots["active"], mesh, snapshot)
        trunk = slots["tokens"][:, :, 0]  # [n, B]
        has_snapshot = snapshot is not None
        view = PipelineView(tokens=trunk, positions=slots["positions"], active=slots["active"],
                            hidden=slots["hidden"][:, :, 0],
                            middle=slots["middle"][:, :, 0] if has_snapshot else None,
                            out=jnp.roll(shifted, -1, axis=0)[:, :, 0],
                            out_middle=jnp.roll(shifted_middle, -1, axis=0)[:, :, 0] if has_snapshot else None,
                            committed=carry["committed"])
        with jax.named_scope("draft"):
            draft, draft_q, state = drafter.propose(drafter_params, state, view, weights, cfg, sampling, draft_key)
        with jax.named_scope("verify"):
            # the token leaving the last stage verifies the slot behind it: its trunk token and siblings are the
            # children of a one-level tree (jaxspec.verification's rule)
            exiting = slots["active"][n - 1] & running  # [B]
            exit_hidden = shifted[0][:, 0]  # [B, d]
            probs = target_probs(lm_head(weights, cfg, exit_hidden[:, None]), sampling)  # [B, 1, V]
            has_candidate = slots["active"][n - 2]  # [B] (n >= 2)
            tree = DraftTree(tokens=slots["tokens"][n - 2], parents=star,
                             valid=jnp.broadcast_to(has_candidate[:, None], (b, width)),
                             draft_probs=None if slots["q"] is None else slots["q"][n - 2][:, None])
            acc = accept(tree, jnp.broadcast_to(probs, (b, width + 1, cfg.vocab_size)),
                         jax.random.uniform(accept_key, (b, width)), jax.random.uniform(bonus_key, (b,)))
            emitted = acc.tokens[:, 0]  # the accepted child, or the token drawn from the residual
            lane = acc.path[:, 1] - 1  # the accepted child's lane (-1: none)
            accepted = exiting & (acc.num_accepted == 1)
            promoted = accepted & (lane > 0)
            rejected = exiting & ~accepted
        with jax.named_scope("commit"):
            exit_position = slots["positions"][n - 1]
            candidate_position = exit_position + 1
            committed = jnp.where(exiting, candidate_position, carry["committed"])
            state = drafter.update(drafter_params, state, view, exiting, trunk[n - 1], exit_hidden)
            write = exiting & (carry["count"] < max_new_tokens)
            at = jnp.minimum(carry["count"], max_new_tokens - 1)
            out = carry["out"].at[jnp.arange(b), at].set(jnp.where(write, emitted, carry["out"][jnp.arange(b), at]))
            count = carry["count"] + write.astype(jnp.int32)
            done = carry["done"] | (write & jnp.isin(emitted, eos)) | (count >= max_new_tokens)
            # the next slots: everything moves on one stage and the draft enters stage 0 ...
            new = dict(
                tokens=jnp.roll(slots["tokens"], 1, axis=0).at[0].set(draft),
                positions=jnp.roll(slots["positions"], 1, axis=0).at[0].set(slots["positions"][0] + 1),
                active=jnp.roll(slots["active"], 1, axis=0).at[0].set(True),
                hidden=shifted.at[0].set(embed(draft)),
                middle=shifted_middle.at[0].set(embed(draft)) if has_snapshot else None,
                q=None if slots["q"] is None else jnp.roll(slots["q"], 1, axis=0).at[0].set(draft_q),
            )
            # ... except after a rejection: the replacement alone, at stage 0 ...
            stage0 = (jnp.arange(n) == 0)[:, None]  # [n, 1]
            flush = rejected[None]  # [1, B]
            new["tokens"] = jnp.where(flush[..., None], new["tokens"].at[0].set(lanes_of(emitted)), new["tokens"])
            new["positions"] = jnp.where(flush, new["positions"].at[0].set(candidate_position), new["positions"])
            emitted_emb = embed(lanes_of(emitted))
            streams = {"hidden": shifted, **({"middle": shifted_middle} if has_snapshot else {})}  # [n, B, W, d] each
            for name in streams:
                new[name] = jnp.where(flush[..., None, None], new[name].at[0].set(emitted_emb), new[name])
            # ... or after a sibling was accepted: it becomes the trunk token and goes on alone to the last stage
            last = (jnp.arange(n) == n - 1)[:, None]
            pick = jax.nn.one_hot(jnp.maximum(lane, 0), width, dtype=jnp.bool_)  # [B, W]
            sibling_token = jnp.sum(jnp.where(pick, slots["tokens"][n - 2], 0), axis=1)  # [B]
            new["tokens"] = jnp.where((last & promoted[None])[..., None], lanes_of(sibling_token)[None],
                                      new["tokens"])
            for name, source in streams.items():
                sibling = jnp.sum(jnp.where(pick[..., None], source[n - 1], 0), axis=1)  # [B, d]
                lanes = jnp.broadcast_to(sibling[:, None], (b, width, d))
                new[name] = jnp.where((last & promoted[None])[..., None, None], lanes[None], new[name])
            active = jnp.where(flush, stage0, new["active"])
            new["active"] = jnp.where(promoted[None], last, active) & ~done[None]
            if width > 1:
                cache = promote_sibling(cache, candidate_position, jnp.maximum(lane, 1), promoted)
            stats = dict(carry["stats"])
            stats["steps"] = stats["steps"] + running.astype(jnp.int32)
            stats["bubbles"] = stats["bubbles"] + (running & ~exiting).astype(jnp.int32)
            stats["exits"] = stats["exits"] + exiting.astype(jnp.int32)
            stats["rejections"] = stats["rejections"] + rejected.astype(jnp.int32)
            stats["promotions"] = stats["promotions"] + promoted.astype(jnp.int32)
        return dict(slots=new, state=state, cache=cache, committed=committed, out=out, count=count, done=done,
                    stats=stats, step=carry["step"] + 1)

    init = dict(slots=slots, state=state, cache=cache, committed=prompt_lengths.astype(jnp.int32), out=out,
                count=count, done=done, stats=stats, step=jnp.int32(1))
    final = jax.lax.while_loop(cond, body, init)
    return final["out"], final["count"], final["stats"], (final["cache"], final["committed"])


@dataclasses.dataclass
class PipelineResult(GenerationResult):
    """GenerationResult plus the pipeline's counters, summed over rows."""

    num_stages: int = 0
    steps: int = 0
    bubbles: int = 0
    exits: int = 0
    rejections: int = 0
    promotions: int = 0
    draft_cost_layers: float = 0.0
    hides_drafting: bool = True

    @property
    def tokens_generated(self) -> int:
        """Tokens decided by the pipeline (the prefill's first token excluded)."""
        return self.exits

    @property
    def alpha(self) -> float:
        """Tokens generated per pipeline step."""
        return self.exits / self.steps if self.steps else float("nan")

    @property
    def equivalent_acceptance(self) -> float:
        """L'acc = alpha * n (METHODS.md): tokens per L layers of sequential target work."""
        return self.alpha * self.num_stages


def pipeline_generate(
    weights: Weights,
    cfg: ModelConfig,
    drafter: PipelineDrafter,
    drafter_params: Any,
    prompt_ids: Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 128,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    max_cache_length: int | None = None,
    mesh: Mesh | None = None,
) -> PipelineResult:
    """Pipeline decoding for token-id prompts: the same tokens as `generate` at T=0, the same distribution at T>0.

    mesh: None (stages emulated on one device); a mesh from `stage_mesh` (stages on devices); or a (data, model)
    mesh from `jaxspec.sharding.make_mesh`: the rows split over data and the weights over model, with the stages
    emulated on each group of devices and jit's partitioner placing the collectives (no shard_map of its own).
    """
    stages_on_mesh = mesh is not None and STAGE in mesh.axis_names
    check_pipeline(cfg, drafter.num_stages, drafter.tree_width, mesh.shape[STAGE] if stages_on_mesh else 1)
    if cfg.is_hybrid and mesh is not None:
        raise UserError(f"A hybrid model ({cfg.architecture}) runs on one device in jaxspec for now; pass no mesh.")
    if stages_on_mesh and drafter.num_stages % mesh.shape[STAGE]:
        raise UserError(f"{drafter.num_stages} stages cannot be split evenly over the mesh's {mesh.shape[STAGE]} "
                        "stage devices.")
    batch = pad_prompts(prompt_ids, max_new_tokens, cfg, max_cache_length, draft_slots=drafter.num_stages + 1)
    eos = tuple(cfg.eos_token_ids if eos_ids is None else eos_ids)
    data_mesh = mesh if mesh is not None and DATA in mesh.axis_names else None
    weights, tokens, lengths, rng = place_inputs(data_mesh, cfg, weights, batch.tokens, batch.lengths, seed,
                                                 stacked=True)  # the stages are slices of the stacked layers
    # arrays committed to one device cannot enter a program laid out on the mesh
    weights, drafter_params = replicate_on_mesh(mesh if stages_on_mesh else None, (weights, drafter_params))
    drafter_params = replicate_on_mesh(data_mesh, drafter_params)
    start = time.perf_counter()
    out, counts, stats, _ = pipeline_generate_tokens(
        weights, cfg, drafter, drafter_params, tokens, lengths, rng, max_new_tokens=max_new_tokens,
        cache_size=batch.cache_size, sampling=sampling, eos_ids=eos, mesh=mesh if stages_on_mesh else None,
    )
    out, counts = to_host(out), to_host(counts)
    stats = {k: int(to_host(v).sum()) for k, v in stats.items()}
    seconds = time.perf_counter() - start
    return PipelineResult(
        token_ids=[out[r, : counts[r]].tolist() for r in range(len(out))], seconds=seconds,
        num_stages=drafter.num_stages, draft_cost_layers=drafter.draft_cost_layers(cfg),
        hides_drafting=drafter.hides_drafting, **stats,
    )
