"""Distilling a drafter from the frozen target: `jaxspec train --config configs/<method>-<target>.yaml`.

One loop for every learned drafter. A method plugs in through a `Trainable` (its config dataclass, how to build
the drafter and fresh parameters, which target features it needs, and its loss); the loop owns the rest: the
target's features (read from the regeneration when it saved them, else computed once into a cache or inside the
jitted step), Optax, the data
axis of a mesh, Orbax checkpoints with exact resume, progress, JSON Lines metrics, a loss-curve PNG, periodic
tau on held-out prompts, and the final drafter checkpoint tied to the target's fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxspec.config_files import from_dict, to_dict
from jaxspec.errors import UserError
from jaxspec.model import Weights, forward
from jaxspec.training.config import TrainConfig, make_optimizer


@dataclasses.dataclass(frozen=True)
class Trainable:
    """How the training loop handles one method."""

    config_cls: type
    make_drafter: Any  # (method config) -> Drafter
    init_params: Any  # (method config, target LoadedModel, key) -> params
    target_layers: Any  # (method config, target config) -> tuple of hidden layer indices needed ((): last only)
    # (params, method config, target weights, target cfg, features, loss_mask, loss config, key) -> (loss, metrics)
    loss: Any
    init_uses_data: bool = False  # init_params also receives the RegeneratedDataset (EAGLE-3's draft vocabulary)
    config_defaults: Any = None  # a dict the config's drafter section overrides (EAGLE-1's settings), or None


TRAINABLES: dict[str, Trainable] = {}


def register(method: str, trainable: Trainable) -> None:
    TRAINABLES[method] = trainable


def trainable_for(method: str) -> Trainable:
    _register_builtin()
    if method not in TRAINABLES:
        known = ", ".join(sorted(TRAINABLES))
        raise UserError(f"Method '{method}' cannot be trained here; trainable methods: {known}.")
    return TRAINABLES[method]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Features:
    """The frozen target on a batch. last_hidden: [B, S, d] residual stream after the last layer (before the final
    norm; a loss applies `jaxspec.model.lm_head` to it, on its draft vocabulary or at the positions it needs: the
    full [B, S, V] logits are never made); hidden: [n, B, S, d] the layers the method asked for (or None);
    tokens: int32[B, S] the batch itself (drafters that embed the text, EAGLE-3)."""

    last_hidden: jax.Array
    hidden: jax.Array | None
    tokens: jax.Array | None = None


def target_features(weights: Weights, cfg, tokens: jax.Array, layers: tuple[int, ...]) -> Features:
    """tokens: int32[B, S] -> Features, under stop_gradient (the target is frozen)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = forward(weights, cfg, tokens, positions, hidden_layers=layers, compute_logits=False)
    return jax.lax.stop_gradient(Features(last_hidden=out.last_hidden, hidden=out.hidden, tokens=tokens))


def make_train_step(trainable: Trainable, method_cfg, target_cfg, loss_cfg, optimizer, layers):
    """The pure step: (params, opt_state, target_weights, tokens [B, S], loss_mask [B, S], key, cached) ->
    (params, opt_state, metrics). `cached` is None (the target runs inside the step) or (last_hidden [B, S, d],
    hidden [n, B, S, d] or None) read from the feature cache."""

    def step(params, opt_state, target_weights, tokens, loss_mask, key, cached=None):
        if cached is None:
            features = target_features(target_weights, target_cfg, tokens, layers)
        else:
            last_hidden, hidden = cached
            features = jax.lax.stop_gradient(Features(last_hidden=last_hidden, hidden=hidden, tokens=tokens))

        def loss_fn(p):
            return trainable.loss(p, method_cfg, target_weights, target_cfg, features, loss_mask, loss_cfg, key)

        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
        return params, opt_state, metrics

    return step


def cache_target_features(target, dataset, layers: tuple[int, ...], seq_len: int, directory: str,
                          batch_size: int = 8, progress: bool = True) -> dict[str, np.ndarray]:
    """The frozen target's hidden states for every sample, computed once and kept on disk as .npy files.

    Returns memory-mapped arrays: `last_hidden` float32[N, S, d] and, when `layers` is not empty, `hidden`
    float32[n, N, S, d] (rows in dataset order, cut and padded to seq_len like the training batches). A finished
    cache for the same target, data, layers and seq_len is reused; anything else is recomputed.
    """
    key = {"target": target.fingerprint(), "data": dataset.fingerprint, "samples": dataset.num_samples,
           "layers": list(layers), "seq_len": seq_len}
    meta_path = os.path.join(directory, "features.json")
    files = {"last_hidden": os.path.join(directory, "last_hidden.npy"), "hidden": os.path.join(directory, "hidden.npy")}
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            if json.load(f) == {**key, "complete": True}:
                out = {"last_hidden": np.load(files["last_hidden"], mmap_mode="r")}
                if layers:
                    out["hidden"] = np.load(files["hidden"], mmap_mode="r")
                return out
    os.makedirs(directory, exist_ok=True)
    n, d = dataset.num_samples, target.config.hidden_size
    last = np.lib.format.open_memmap(files["last_hidden"], "w+", np.float32, (n, seq_len, d))
    hidden = np.lib.format.open_memmap(files["hidden"], "w+", np.float32, (len(layers), n, seq_len, d)) if layers \
        else None
    compute = jax.jit(lambda w, t: target_features(w, target.config, t, layers))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n, desc="caching target features", unit="sample")
    for start in range(0, n, batch_size):
        rows = list(range(start, min(start + batch_size, n)))
        tokens = np.zeros((batch_size, seq_len), np.int32)  # [B, S]; a short last batch is zero-padded
        for i, row in enumerate(rows):
            sample = dataset.sample(row)[:seq_len]
            tokens[i, : len(sample)] = sample
        feats = jax.device_get(compute(target.weights, jnp.asarray(tokens)))
        last[rows] = feats.last_hidden[: len(rows)]
        if hidden is not None:
            hidden[:, rows] = feats.hidden[:, : len(rows)]
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.close()
    last.flush()
    if hidden is not None:
        hidden.flush()
    with open(meta_path, "w") as f:
        json.dump({**key, "complete": True}, f)
    return cache_target_features(target, dataset, layers, seq_len, directory, batch_size, progress=False)


def _shardings(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec.sharding import DATA

    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(DATA))


def _global_batch(array: np.ndarray, sharding) -> jax.Array:
    """The global batch as one array sharded over the data axis. Every host reads the same global batch (same
    seed, same order) and contributes the rows its devices hold, so this also works across hosts."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


def local_rows(sharding, batch_size: int, axis: int = 0, ndim: int = 1) -> np.ndarray:
    """int64[r]: the global batch rows the devices of this process hold under `sharding` (rows split along `axis`
    of an `ndim`-dimensional array), in increasing order."""
    shape = tuple(batch_size if i == axis else 1 for i in range(ndim))
    indices = sharding.addressable_devices_indices_map(shape).values()
    return np.unique(np.concatenate([np.arange(batch_size)[index[axis]] for index in indices]))


def _global_rows(local: np.ndarray, rows: np.ndarray, shape: tuple[int, ...], sharding, axis: int) -> jax.Array:
    """A global array of `shape` sharded over the data axis from this process's `rows` only: local holds them
    along `axis` (in `rows`' order); no process needs the others' rows."""
    where = {int(r): i for i, r in enumerate(rows)}

    def part(index):
        wanted = [where[int(r)] for r in np.arange(shape[axis])[index[axis]]]
        picked = np.take(local, wanted, axis=axis)
        return picked[tuple(slice(None) if i == axis else index[i] for i in range(len(shape)))]

    return jax.make_array_from_callback(shape, sharding, part)


def maybe_initialize_distributed() -> None:
    """Multi-host runs (TPU pods, several GPU hosts): `jax.distributed.initialize()` when the environment asks
    for it (JAX_COORDINATOR_ADDRESS set, or JAXSPEC_DISTRIBUTED=1 on a TPU pod where JAX finds the rest)."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("JAXSPEC_DISTRIBUTED") == "1":
        from jaxspec.arguments import join_distributed

        join_distributed()  # the process count and id from JAX_NUM_PROCESSES and JAX_PROCESS_ID where set


def _initial_params(directory: str, method: str, method_cfg, target, params, rebuild_vocab: bool = False):
    """The parameters of the drafter in `directory`, checked to be this run's method, target and drafter settings.
    An EAGLE-3 head may come from another draft vocabulary size: it is moved to this run's vocabulary
    (`jaxspec.drafters.eagle.with_draft_vocabulary`), so a head can be fine-tuned into a larger or smaller one;
    with `rebuild_vocab` it is moved at the same size too (to the vocabulary of this run's data)."""
    from jaxspec.checkpoint import load_drafter, read_drafter_meta
    from jaxspec.drafters.eagle import Eagle3Params, with_draft_vocabulary

    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    saved_vocab = read_drafter_meta(directory)["config"].get("draft_vocab_size")
    resized = isinstance(params, Eagle3Params) and saved_vocab not in (None, params.d2t.shape[0])
    if rebuild_vocab and not isinstance(params, Eagle3Params):
        raise UserError(f"run.rebuild_draft_vocab applies to EAGLE-3 heads; a {method} drafter has no draft "
                        "vocabulary to move. Remove the key.")
    moved = isinstance(params, Eagle3Params) and (resized or (rebuild_vocab and saved_vocab is not None))
    if resized:  # read the saved head with its own vocabulary's shapes
        d = params.lm_head.shape[0]
        abstract = dataclasses.replace(abstract, lm_head=jax.ShapeDtypeStruct((d, saved_vocab), params.lm_head.dtype),
                                       d2t=jax.ShapeDtypeStruct((saved_vocab,), params.d2t.dtype))
    meta, loaded = load_drafter(directory, expected_method=method, target_fingerprint=target.fingerprint(),
                                target_source=target.source, abstract_params=abstract)
    ours = to_dict(method_cfg)
    differing = sorted(k for k in ours if k in meta["config"] and meta["config"][k] != ours[k]
                       and not (resized and k == "draft_vocab_size"))
    if differing:
        saved = meta["config"]
        listed = ", ".join(f"{k}: {saved[k]} there, {ours[k]} here" for k in differing)
        raise UserError(f"run.init_from '{directory}' was trained with other drafter settings ({listed}); "
                        "use the same drafter settings or start from scratch (remove run.init_from).")
    return with_draft_vocabulary(loaded, params) if moved else loaded


def train(config: TrainConfig, *, progress: bool = True, stop_after: int | None = None) -> dict:
    """Runs (or resumes) a training run; returns a summary. `stop_after` ends early after that many steps of this
    call (used by tests to simulate an interruption)."""
    from jaxspec.checkpoint import TrainCheckpointer, save_drafter
    from jaxspec.data import RegeneratedDataset
    from jaxspec.loading import load_model
    from jaxspec.sharding import make_mesh

    trainable = trainable_for(config.method)
    method_cfg = from_dict(trainable.config_cls, {**(trainable.config_defaults or {}), **dict(config.drafter)},
                           path="drafter")
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(config.dtype)
    devices = config.mesh.data * config.mesh.model
    if devices > len(jax.devices()):
        raise UserError(f"mesh.data={config.mesh.data} x mesh.model={config.mesh.model} needs {devices} devices; "
                        f"this run has {len(jax.devices())}.")
    mesh = make_mesh(data=config.mesh.data, model=config.mesh.model, devices=jax.devices()[:devices])
    split_target = config.mesh.model > 1  # the target's weights loaded straight onto their shards
    target = load_model(config.target, dtype=dtype, with_tokenizer=True, mesh=mesh if split_target else None)
    dataset = RegeneratedDataset(config.data.path)
    dataset.check_target(target.fingerprint())

    run = config.run
    main_process = jax.process_index() == 0  # on many hosts, files are written once (checkpoints: by Orbax)
    os.makedirs(run.out_dir, exist_ok=True)
    if main_process:
        with open(os.path.join(run.out_dir, "config.json"), "w") as f:
            json.dump(to_dict(config), f, indent=2)
    if hasattr(method_cfg, "for_target"):  # settings whose defaults depend on the target (EAGLE-3's layers)
        method_cfg = method_cfg.for_target(target.config)
    key = jax.random.key(run.seed)
    init_data = (dataset,) if trainable.init_uses_data else ()
    params = trainable.init_params(method_cfg, target, jax.random.fold_in(key, 1), *init_data)
    if run.init_from:
        params = _initial_params(run.init_from, config.method, method_cfg, target, params, run.rebuild_draft_vocab)
    optimizer = make_optimizer(config.optim, run.steps)
    opt_state = optimizer.init(params)
    layers = tuple(trainable.target_layers(method_cfg, target.config))

    eval_mesh = mesh if split_target else None  # a split target evaluates where it lies (every process takes part)
    if eval_mesh is not None and run.eval_every:
        from jaxspec.pipeline import PipelineDrafter

        if isinstance(trainable.make_drafter(method_cfg), PipelineDrafter):
            raise UserError("run.eval_every: a pipeline drafter's evaluation does not run with the target split over "
                            "the model axis (mesh.model > 1); set run.eval_every=0 and evaluate the saved drafter "
                            "with `jaxspec bench --drafter ...`.")
    if run.batch_size % config.mesh.data:
        raise UserError(f"run.batch_size={run.batch_size} is not a multiple of mesh.data={config.mesh.data}.")
    replicated, batch_sharded = _shardings(mesh)
    target_sharding = replicated
    if split_target:
        from jaxspec.sharding import weight_shardings

        target_sharding = weight_shardings(target.weights, mesh)
    cache = None
    cached_shardings = None
    last_layer = target.config.num_layers - 1
    saved_features = dataset.has_features((*layers, last_layer))  # saved while regenerating: the target never runs
    if saved_features or config.data.cache_features:
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxspec.sharding import DATA

        cached_shardings = (batch_sharded, NamedSharding(mesh, PartitionSpec(None, DATA)) if layers else None)
    if config.data.cache_features and not saved_features:
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxspec.sharding import DATA

        cache = cache_target_features(target, dataset, layers, config.data.seq_len,
                                      os.path.join(run.out_dir, "features"), run.batch_size, progress)
    step_fn = jax.jit(
        make_train_step(trainable, method_cfg, target.config, config.loss, optimizer, layers),
        in_shardings=(replicated, replicated, target_sharding, batch_sharded, batch_sharded, replicated,
                      cached_shardings),
        out_shardings=(replicated, replicated, replicated),
        donate_argnums=(0, 1),
    )

    checkpointer = TrainCheckpointer(os.path.join(run.out_dir, "checkpoints"), run.save_every, run.keep_checkpoints)
    state = {"params": params, "opt_state": opt_state, "step": 0, "data_position": 0}
    start_step = 0
    if checkpointer.latest_step() is not None:
        state = checkpointer.restore(abstract_state=state)
        start_step = int(state["step"])
    params, opt_state, position = state["params"], state["opt_state"], int(state["data_position"])

    metrics_path = os.path.join(run.out_dir, "metrics.jsonl")
    held_out = config.data.num_held_out(dataset.num_samples) if run.eval_every else 0
    batches = dataset.batches(run.batch_size, config.data.seq_len, run.seed, start=position, held_out=held_out)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=run.steps, initial=start_step, desc=f"train {config.method}", unit="step")
    tokens_seen, started = 0, time.perf_counter()
    step = start_step
    steps_this_call = 0
    while step < run.steps:
        batch = next(batches)
        tokens, loss_mask = (_global_batch(batch[name], batch_sharded) for name in ("tokens", "loss_mask"))
        cached = None
        if saved_features:  # each process reads the features of the rows its devices hold, no others
            rows = local_rows(batch_sharded, run.batch_size)
            feats = dataset.features(np.asarray(batch["indices"])[rows], (*layers, last_layer),
                                     config.data.seq_len)  # [n+1, r, S, d]
            n, _, s, d = feats.shape
            cached = (_global_rows(feats[-1], rows, (run.batch_size, s, d), batch_sharded, 0),
                      _global_rows(feats[:-1], rows, (n - 1, run.batch_size, s, d), cached_shardings[1], 1)
                      if layers else None)
        elif cache is not None:
            rows = np.asarray(batch["indices"])
            cached = (_global_batch(np.asarray(cache["last_hidden"][rows]), batch_sharded),
                      _global_batch(np.asarray(cache["hidden"][:, rows]), cached_shardings[1]) if layers else None)
        params, opt_state, metrics = step_fn(params, opt_state, target.weights, tokens, loss_mask,
                                             jax.random.fold_in(key, step), cached)
        step += 1
        steps_this_call += 1
        position = int(batch["position"])
        tokens_seen += int(np.sum(batch["lengths"]))
        if step % run.log_every == 0 or step == run.steps:
            record = {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}
            elapsed = time.perf_counter() - started
            record.update(step=step, tokens_per_second=tokens_seen / elapsed, data_position=position)
            if main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
        # saved before the evaluation, so a failing evaluation loses no training
        checkpointer.save(step, {"params": params, "opt_state": opt_state, "step": step, "data_position": position},
                          force=step == run.steps)
        if run.eval_every and (step % run.eval_every == 0 or step == run.steps):
            eval_prompts = dataset.held_out_prompts(held_out)[: run.eval_prompts]
            if eval_mesh is not None:  # rows split over the data axis: a multiple of its size
                eval_prompts = eval_prompts[: len(eval_prompts) // config.mesh.data * config.mesh.data]
            tau_value = evaluate_tau(trainable, method_cfg, params if eval_mesh else _this_process(params), target,
                                     eval_prompts, eval_mesh)
            if main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps({"step": step, "eval_tau": tau_value}) + "\n")
            if bar is not None:
                bar.write(f"step {step}: tau {tau_value:.3f} on {len(eval_prompts)} held-out prompts")
        if bar is not None:
            bar.update(1)
        if stop_after is not None and steps_this_call >= stop_after:
            break
    checkpointer.wait_until_finished()
    if bar is not None:
        bar.close()
    summary = {"steps": step, "data_position": position, "out_dir": run.out_dir}
    if step >= run.steps:
        drafter_dir = os.path.join(run.out_dir, "drafter")
        if main_process:
            save_drafter(drafter_dir, method=config.method, drafter_config=to_dict(method_cfg),
                         params=_this_process(params), target_fingerprint=target.fingerprint(),
                         target_source=target.source)
            plot_loss_curve(metrics_path, os.path.join(run.out_dir, "loss.png"))
        summary["drafter"] = drafter_dir
    checkpointer.close()
    summary["params"] = params
    return summary


def _this_process(params):
    """Replicated parameters as arrays on this process's first device (on many hosts a replicated global array
    spans devices this process cannot read; every process holds a full copy)."""
    if jax.process_count() == 1:
        return params
    return jax.tree.map(lambda x: x.addressable_data(0), params)


def evaluate_tau(trainable, method_cfg, params, target, prompts: list[list[int]], mesh=None) -> float:
    """Greedy tau of the drafter on held-out prompts (never trained on); L'acc for a pipeline drafter. mesh: the
    training mesh when the target lies split over its model axis (the generation runs there, on every process)."""
    from jaxspec.speculative import speculative_generate

    if not prompts:
        return float("nan")
    drafter = trainable.make_drafter(method_cfg)
    from jaxspec.pipeline import PipelineDrafter, pipeline_generate

    if isinstance(drafter, PipelineDrafter):  # SPD: the equivalent acceptance length L'acc = alpha * n
        return pipeline_generate(target.weights, target.config, drafter, params, prompts,
                                 max_new_tokens=64).equivalent_acceptance
    result = speculative_generate(target.weights, target.config, drafter, params, prompts, max_new_tokens=64,
                                  mesh=mesh)
    return result.tau


def plot_loss_curve(metrics_path: str, out_png: str) -> None:
    """Loss (and eval tau when present) against step, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: leaves the caller's backend alone

    steps, losses, eval_steps, taus = [], [], [], []
    with open(metrics_path) as f:
        for line in f:
            record = json.loads(line)
            if "loss" in record:
                steps.append(record["step"])
                losses.append(record["loss"])
            if "eval_tau" in record:
                eval_steps.append(record["step"])
                taus.append(record["eval_tau"])
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    ax.plot(steps, losses, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if taus:
        twin = ax.twinx()
        twin.plot(eval_steps, taus, "o-", color="tab:orange", label="eval tau")
        twin.set_ylabel("tau")
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)


# ---------------------------------------------------------------------------------------------- built-in methods


def _register_builtin() -> None:
    if "medusa" in TRAINABLES:
        return
    from jaxspec.drafters.medusa import MedusaConfig, medusa_loss

    def loss(params, mcfg, target_weights, target_cfg, features, loss_mask, loss_cfg, key):
        total, per_head = medusa_loss(params, target_weights, target_cfg, features.last_hidden, loss_mask, key,
                                      kind=loss_cfg.kind, decay=loss_cfg.position_decay or 0.8,
                                      positions_per_row=mcfg.positions_per_row)
        return total, {f"loss_head{k}": per_head[k] for k in range(per_head.shape[0])}

    register("medusa", Trainable(
        config_cls=MedusaConfig,
        make_drafter=lambda c: c.make_drafter(),
        init_params=lambda c, target, key: c.init_params(target.config, target.weights),
        target_layers=lambda c, target_cfg: (),
        loss=loss,
    ))

    from jaxspec.drafters.eagle import EAGLE1_SETTINGS, Eagle3Config, eagle3_training_loss, response_token_counts

    eagle = Trainable(
        config_cls=Eagle3Config,
        make_drafter=lambda c: c.make_drafter(),
        init_params=lambda c, target, key, dataset=None: c.init_params(
            target.config, target.weights, key,
            None if dataset is None else response_token_counts(dataset, target.config.vocab_size)),
        target_layers=lambda c, target_cfg: c.for_target(target_cfg).feature_layers,
        loss=eagle3_training_loss,
        init_uses_data=True,
    )
    register("eagle3", eagle)
    from jaxspec.drafters.block_head import ParallelHeadConfig, parallel_training_loss

    # the same handling as EAGLE-3 (draft vocabulary from the data, fused layers, the target's logits); another loss
    parallel = dataclasses.replace(eagle, config_cls=ParallelHeadConfig, loss=parallel_training_loss)
    # DFlash's block head (bidirectional; `ddtree` drafts trees from it) and JetSpec's tree-causal head
    register("dflash", dataclasses.replace(parallel, config_defaults={"attention": "bidirectional"}))
    register("jetspec", dataclasses.replace(parallel, config_defaults={"attention": "tree_causal"}))
    # the EAGLE-1 head (also drafted by `eagle2`): the same module and loss with EAGLE-1's settings
    register("eagle", dataclasses.replace(eagle, config_defaults=EAGLE1_SETTINGS))
    from jaxspec.drafters.spd import SPDConfig, spd_training_loss

    # SPD's pipeline drafter: a draft vocabulary from the data as EAGLE-3; every layer's output (the snapshots of
    # every pipeline depth for every stage count), computed by the target inside the step
    register("spd", dataclasses.replace(eagle, config_cls=SPDConfig, loss=spd_training_loss,
                                        target_layers=lambda c, target_cfg: tuple(range(target_cfg.num_layers))))


# ---------------------------------------------------------------------------------------------- CLI


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="distil a drafter from the frozen target (see configs/README.md)")
    p.add_argument("--config", required=True, help="a YAML file in configs/")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set run.steps=200 (repeatable)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_train(args) -> None:
    from jaxspec.config_files import load_config

    config = load_config(args.config, TrainConfig, args.set)
    maybe_initialize_distributed()
    summary = train(config, progress=not args.no_progress)
    summary.pop("params", None)
    print(json.dumps(summary))
