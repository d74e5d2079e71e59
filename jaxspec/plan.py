"""`jaxspec plan`: will a target's generation fit a mesh, before the rental starts.

Compiles the real jitted generation program (`jaxspec.generate.generate_tokens`, the loop `jaxspec generate` runs)
for abstract arrays (`jax.ShapeDtypeStruct` with the shardings the mesh gives them: no weights are read, nothing is
allocated) on a (data, model) mesh, and reads XLA's memory and cost analysis of the compiled program, which are
per device for a partitioned program. On CPU the mesh is made of fake devices (`jaxspec plan` restarts itself with
`--xla_force_host_platform_device_count` when the machine has fewer). The temporaries are what this machine's
compiler counts: run the plan on the accelerator's host for that compiler's figure; on CPU a bfloat16 plan compiles
in float32 (XLA:CPU would otherwise count float32 copies of every weight), an upper bound for bfloat16's.

    plan = plan_generation(LLAMA3_8B, make_mesh(1, 8), batch_size=8, cache_length=4096, dtype=jnp.bfloat16)
    plan.per_device["total_bytes"]

What it covers: generation, autoregressive or speculative (`method`: the speculative loop with that method's drafter,
its parameters replicated on every device, at the drafter's default tree), the target's weights, its KV cache and
every temporary of the loop; and one drafter training step (`plan_training`, with the optimizer state).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.config import LLAMA3_8B, QWEN3_8B, ModelConfig
from jaxspec.errors import UserError

# Configs that need no file: `jaxspec plan --model llama3-8b`.
BUILTIN_CONFIGS = {"llama3-8b": LLAMA3_8B, "qwen3-8b": QWEN3_8B}

# Memory per chip of common accelerators, for --hbm NAME.
CHIP_MEMORY = {
    "v4": 32 * 2**30, "v5e": 16 * 2**30, "v5p": 95 * 2**30, "v6e": 32 * 2**30,
    "a100-40gb": 40 * 2**30, "a100-80gb": 80 * 2**30, "h100": 80 * 2**30, "h200": 141 * 2**30,
}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """"16GiB", "80GB", "1.5TiB" or a chip name ("v5e", "h100"; `CHIP_MEMORY`) -> bytes."""
    key = text.strip().lower()
    if key in CHIP_MEMORY:
        return CHIP_MEMORY[key]
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", key)
    if not m or m.group(2) not in _UNITS:
        raise UserError(f"Cannot read memory size '{text}': write e.g. 16GiB, 80GB, or a chip name "
                        f"({', '.join(CHIP_MEMORY)}).")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def plan_config(name_or_path: str) -> ModelConfig:
    """A model config without its weights: a built-in name (`BUILTIN_CONFIGS`), a Hugging Face config.json or the
    folder holding one, or a GGUF file or known model name (its metadata only; the tensors are not read)."""
    import os

    from jaxspec.loading import KNOWN_MODELS, resolve_model_path

    if name_or_path in BUILTIN_CONFIGS:
        return BUILTIN_CONFIGS[name_or_path]
    if name_or_path.endswith(".json") or os.path.isdir(name_or_path):
        return ModelConfig.from_hf_config(name_or_path)
    if name_or_path.endswith(".gguf") or name_or_path in KNOWN_MODELS:
        from jaxspec.loading import open_gguf

        return ModelConfig.from_gguf(open_gguf(resolve_model_path(name_or_path)))
    raise UserError(f"jaxspec plan needs a model config: '{name_or_path}' is neither a built-in name "
                    f"({', '.join(BUILTIN_CONFIGS)}), a known model ({', '.join(KNOWN_MODELS)}), a .gguf file, nor "
                    "a config.json or a folder holding one.")


@dataclasses.dataclass
class Plan:
    """Per-device figures of one compiled program. per_device: weights_bytes (this device's shards of the weights),
    cache_bytes (its shard of the KV cache), optimizer_bytes (0: no training step planned), temp_bytes (XLA's
    temporaries, the cache included, since the loop creates it), total_bytes (arguments + outputs + temporaries, as
    XLA counts them); flops: XLA's cost analysis of the program per device, which counts a loop's body once: the
    prefill plus one decoding step, not the whole generation."""

    config: ModelConfig
    mesh_shape: dict[str, int]
    batch_size: int
    cache_length: int
    dtype: str
    per_device: dict[str, int]
    flops: float
    hbm_bytes: int | None = None
    compiled_dtype: str = "float32"  # the dtype the program was compiled in (float32 on CPU, see plan_generation)
    platform: str = "cpu"  # whose compiler counted the temporaries
    program: str = "generation"  # what was compiled: "generation" or "one METHOD training step"

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes is None else self.per_device["total_bytes"] <= self.hbm_bytes

    def suggestion(self) -> str:
        """What to grow when it does not fit."""
        pd = self.per_device
        if pd["weights_bytes"] >= pd["total_bytes"] - pd["weights_bytes"]:
            return ("the weights take most of it: grow the model axis (weights, heads and the FFN split over it), "
                    "or use bfloat16")
        return ("the cache and temporaries take most of it: grow the data axis (the batch splits over it), or plan "
                "a smaller batch or cache length")

    def to_json(self) -> dict[str, Any]:
        return {"program": self.program, "mesh": self.mesh_shape, "batch_size": self.batch_size,
                "cache_length": self.cache_length, "dtype": self.dtype, "per_device": dict(self.per_device),
                "flops": self.flops,
                "hbm_bytes": self.hbm_bytes, "fits": self.fits, "compiled_dtype": self.compiled_dtype,
                "platform": self.platform}


def _shard_bytes(abstract) -> int:
    """Bytes one device holds of abstract arrays with shardings (the largest shard: they are equal here)."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _compiled_dtype(dtype):
    """The dtype a plan compiles in: float32 on CPU (XLA:CPU would count float32 copies of bfloat16 weights as
    temporaries; the float32 program's bound a bfloat16 run's from above), the asked dtype elsewhere."""
    return jnp.float32 if jax.default_backend() == "cpu" else dtype


def _abstract_key(sharding) -> jax.ShapeDtypeStruct:
    key = jax.eval_shape(lambda: jax.random.key(0))
    return jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding)


def _measure(compiled, weights, program_weights, *, cache_bytes: int, optimizer_bytes: int) -> tuple[dict, float]:
    """(per_device, flops) of a compiled program whose arguments held `program_weights`; the weights are counted
    in the dtype asked for (`weights`), the rest as XLA counts it."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    weights_bytes = _shard_bytes(weights)
    arguments = memory.argument_size_in_bytes - _shard_bytes(program_weights) + weights_bytes
    per_device = {
        "weights_bytes": weights_bytes,
        "cache_bytes": cache_bytes,
        "optimizer_bytes": optimizer_bytes,
        "temp_bytes": int(memory.temp_size_in_bytes),
        "total_bytes": int(arguments + memory.output_size_in_bytes + memory.temp_size_in_bytes
                           - memory.alias_size_in_bytes),
    }
    return per_device, float((cost or {}).get("flops", 0.0))


def plan_generation(cfg: ModelConfig, mesh, *, batch_size: int, cache_length: int, dtype=jnp.bfloat16,
                    max_new_tokens: int | None = None, hbm_bytes: int | None = None,
                    method: str = "autoregressive") -> Plan:
    """Compiles generation for abstract inputs on `mesh` and returns its per-device plan.

    Args:
        cfg: the target's config; mesh: a (data, model) mesh (`jaxspec.sharding.make_mesh`).
        batch_size: rows (split over the data axis); cache_length: KV cache slots per row (prompt + new tokens,
            and a speculative round's drafted nodes).
        dtype: the weights' and cache's dtype. max_new_tokens: default a quarter of the cache, the rest prompt.
        hbm_bytes: memory per device, to say whether it fits.
        method: "autoregressive", or a speculative method: the loop `jaxspec generate --method` runs, with that
            method's drafter at its default tree (a learned drafter's parameters as freshly initialised ones: the
            same shapes as a trained one's), counted in per_device["drafter_bytes"].
    Raises:
        UserError: a batch or model dimension the mesh does not divide, a cache too short, a method that cannot be
            planned (a separate draft model, a pipeline).
    """
    from jaxspec.cache import init_cache
    from jaxspec.generate import generate_tokens
    from jaxspec.model import init_weights
    from jaxspec.sampling import GREEDY
    from jaxspec.sharding import batch_sharding, cache_shardings, check_divisible, replicated, weight_shardings

    check_divisible(cfg, batch_size, mesh)
    if cfg.is_hybrid and mesh.size > 1:
        raise UserError(f"A hybrid model ({cfg.architecture}) runs on one device in jaxspec for now; plan it without "
                        "--mesh.")
    new = max_new_tokens if max_new_tokens is not None else max(cache_length // 4, 1)
    drafter, drafter_params = _plan_drafter(method, cfg, dtype)
    round_slots = drafter.num_nodes + 1 if drafter is not None else 0  # a round writes its nodes past the end
    prompt = cache_length - new - round_slots
    if prompt < 1:
        raise UserError(f"A cache of {cache_length} slots leaves no room for a prompt before {new} new tokens"
                        + (f" and a round's {round_slots} drafted slots." if round_slots else "."))

    def place(abstract, shardings):
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def abstract(dt):
        weights = jax.eval_shape(lambda k: init_weights(cfg, k, dtype=dt), jax.random.key(0))
        cache = jax.eval_shape(lambda: init_cache(cfg, batch_size, cache_length, dt))
        if cfg.is_hybrid:  # per-layer weights and recurrent states, on the one device
            one = replicated(mesh)
            return (place(weights, jax.tree.map(lambda _: one, weights)),
                    place(cache, jax.tree.map(lambda _: one, cache)))
        return place(weights, weight_shardings(weights, mesh)), place(cache, cache_shardings(cache, mesh))

    weights, cache = abstract(dtype)
    # the program compiles in _compiled_dtype; the weights and the cache are counted in the dtype asked for
    compiled_dtype = _compiled_dtype(dtype)
    program_weights = weights if compiled_dtype == dtype else abstract(compiled_dtype)[0]
    tokens = jax.ShapeDtypeStruct((batch_size, prompt), jnp.int32, sharding=batch_sharding(mesh, 2))
    lengths = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=batch_sharding(mesh, 1))
    key = _abstract_key(replicated(mesh))
    loop_mesh = None if cfg.is_hybrid else mesh
    if drafter is None:
        compiled = generate_tokens.lower(program_weights, cfg, tokens, lengths, key, max_new_tokens=new,
                                         cache_size=cache_length, sampling=GREEDY, eos_ids=(),
                                         mesh=loop_mesh).compile()
    else:
        from jaxspec.speculative import speculative_generate_tokens

        one = replicated(mesh)
        params = place(drafter_params, jax.tree.map(lambda _: one, drafter_params))
        compiled = speculative_generate_tokens.lower(program_weights, cfg, drafter, params, tokens, lengths, key,
                                                     max_new_tokens=new, cache_size=cache_length, sampling=GREEDY,
                                                     eos_ids=(), mesh=loop_mesh).compile()
    per_device, flops = _measure(compiled, weights, program_weights, cache_bytes=_shard_bytes(cache),
                                 optimizer_bytes=0)
    if drafter is not None:
        per_device["drafter_bytes"] = _shard_bytes(params)
    return Plan(config=cfg, mesh_shape=dict(mesh.shape), batch_size=batch_size, cache_length=cache_length,
                dtype=jnp.dtype(dtype).name, per_device=per_device, flops=flops, hbm_bytes=hbm_bytes,
                compiled_dtype=jnp.dtype(compiled_dtype).name, platform=jax.default_backend(),
                program="generation" if drafter is None else f"{method} generation")


def _plan_drafter(method: str, cfg: ModelConfig, dtype):
    """(drafter, abstract parameters) of a speculative method for a target of `cfg` (None, None: autoregressive).
    A learned drafter's parameters are those of a fresh one (jax.eval_shape: nothing is allocated)."""
    from jaxspec.loading import LoadedModel
    from jaxspec.methods import MethodOptions, build_method, load_learned_drafter
    from jaxspec.model import init_weights
    from jaxspec.registry import method_spec

    if method == "autoregressive":
        return None, None
    spec = method_spec(method)
    if spec.family == "pipeline":
        raise UserError(f"'{method}' runs its stages on a device mesh of its own; jaxspec plan does not cover it yet.")
    if not spec.learned and method != "prompt-lookup":
        raise UserError(f"jaxspec plan covers autoregressive decoding, prompt lookup and the learned drafters; "
                        f"'{method}' (a separate draft model or the target's own early layers) is not planned yet.")
    drafter = {}

    def make(weights):
        target = LoadedModel(config=cfg, weights=weights, tokenizer=None, source="plan")
        if not spec.learned:
            drafter["it"] = build_method(method, target, MethodOptions()).drafter
            return None
        drafter["it"], params = load_learned_drafter(method, target, "untrained", MethodOptions(drafter="untrained"))
        return params

    params = jax.eval_shape(make, jax.eval_shape(lambda k: init_weights(cfg, k, dtype=dtype), jax.random.key(0)))
    return drafter["it"], params


def plan_training(config, mesh, *, hbm_bytes: int | None = None) -> Plan:
    """One drafter training step (`jaxspec.training.distill.make_train_step`, the target run inside the step) for a
    training config, compiled for abstract arrays with the shardings the trainer gives them (drafter and optimizer
    state replicated; the batch split over the data axis; the frozen target split over the model axis, as
    `mesh.model` makes the trainer do, else replicated): per device, the target's weights, the drafter's parameters
    and optimizer state (`optimizer_bytes`: both), temporaries and total.

    Args:
        config: a `TrainConfig` (`jaxspec.training.config`); mesh: a (data, model) mesh, the run's
            (mesh.data, mesh.model).
    """
    import types

    from jax.sharding import NamedSharding, PartitionSpec

    from jaxspec.config_files import from_dict
    from jaxspec.model import init_weights
    from jaxspec.sharding import DATA, MODEL, check_divisible, weight_shardings
    from jaxspec.training.config import make_optimizer
    from jaxspec.training.distill import make_train_step, trainable_for

    cfg = plan_config(config.target)
    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
    compiled_dtype = _compiled_dtype(dtype)
    trainable = trainable_for(config.method)
    method_cfg = from_dict(trainable.config_cls, {**(trainable.config_defaults or {}), **dict(config.drafter)},
                           path="drafter")
    method_cfg = method_cfg.for_target(cfg) if hasattr(method_cfg, "for_target") else method_cfg
    b, s = config.run.batch_size, config.data.seq_len
    if b % mesh.shape[DATA]:
        raise UserError(f"run.batch_size={b} is not a multiple of the data axis ({mesh.shape[DATA]}).")
    replicated, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(DATA))

    def place(tree, sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

    split_target = dict(mesh.shape).get(MODEL, 1) > 1
    if split_target:
        check_divisible(cfg, None, mesh)

    def target_weights(dt):
        abstract = jax.eval_shape(lambda k: init_weights(cfg, k, dtype=dt), jax.random.key(0))
        if not split_target:
            return place(abstract, replicated)
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), abstract,
                            weight_shardings(abstract, mesh))

    weights = target_weights(dtype)
    program_weights = weights if compiled_dtype == dtype else target_weights(compiled_dtype)
    key = jax.random.key(0)
    params = jax.eval_shape(lambda w: trainable.init_params(method_cfg, types.SimpleNamespace(config=cfg, weights=w),
                                                            key), program_weights)
    optimizer = make_optimizer(config.optim, config.run.steps)
    opt_state = jax.eval_shape(optimizer.init, params)
    params, opt_state = place(params, replicated), place(opt_state, replicated)
    layers = tuple(trainable.target_layers(method_cfg, cfg))
    step = jax.jit(make_train_step(trainable, method_cfg, cfg, config.loss, optimizer, layers),
                   donate_argnums=(0, 1))
    tokens = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((b, s), jnp.bool_, sharding=rows)
    abstract_key = _abstract_key(replicated)
    compiled = step.lower(params, opt_state, program_weights, tokens, mask, abstract_key, None).compile()
    per_device, flops = _measure(compiled, weights, program_weights, cache_bytes=0,
                                 optimizer_bytes=_shard_bytes(params) + _shard_bytes(opt_state))
    return Plan(config=cfg, mesh_shape=dict(mesh.shape), batch_size=b, cache_length=s, dtype=jnp.dtype(dtype).name,
                per_device=per_device, flops=flops, hbm_bytes=hbm_bytes,
                compiled_dtype=jnp.dtype(compiled_dtype).name, platform=jax.default_backend(),
                program=f"one {config.method} training step")


def format_plan(plan: Plan) -> str:
    """The plan as the lines `jaxspec plan` prints."""
    gib = 2.0 ** 30
    mesh = " x ".join(f"{k}={v}" for k, v in plan.mesh_shape.items())
    pd = plan.per_device
    training = not plan.program.endswith("generation")
    length = f"sequences of {plan.cache_length} tokens" if training else f"cache {plan.cache_length} slots"
    lines = [f"{plan.program}: {plan.config.architecture}, {plan.config.num_layers} layers, "
             f"d={plan.config.hidden_size}, {plan.dtype}; mesh {mesh}; batch {plan.batch_size}; {length}",
             "per device:",
             f"  weights      {pd['weights_bytes'] / gib:9.3f} GiB" + (
                 ("   (the frozen target, split over the model axis)" if plan.mesh_shape.get("model", 1) > 1
                  else "   (the frozen target, replicated)") if training else ""),
             *([f"  drafter      {pd['drafter_bytes'] / gib:9.3f} GiB   (its parameters, replicated)"]
               if "drafter_bytes" in pd else []),
             f"  KV cache     {pd['cache_bytes'] / gib:9.3f} GiB" + ("" if training else
                                                                       "   (part of the temporaries: the loop "
                                                                       "creates it)"),
             f"  optimizer    {pd['optimizer_bytes'] / gib:9.3f} GiB" + ("   (the drafter's parameters and "
                                                                         "optimizer state)" if training else
                                                                         "   (no training step planned)"),
             f"  temporaries  {pd['temp_bytes'] / gib:9.3f} GiB"
             + (f"   (compiled in {plan.compiled_dtype} by the {plan.platform} compiler: an upper bound for "
                f"{plan.dtype})" if plan.compiled_dtype != plan.dtype else ""),
             f"  total        {pd['total_bytes'] / gib:9.3f} GiB",
             f"  FLOPs        {plan.flops:.3g}" + (" per step" if training else
                                                   " (XLA's count: the prefill plus one " + (
                                                       "decoding step)" if plan.program == "generation" else
                                                       "round)"))]
    if plan.hbm_bytes is not None:
        if plan.fits:
            lines.append(f"fits in {plan.hbm_bytes / gib:.1f} GiB per device "
                         f"({pd['total_bytes'] / plan.hbm_bytes:.0%} used)")
        else:
            lines.append(f"does NOT fit in {plan.hbm_bytes / gib:.1f} GiB per device "
                         f"({pd['total_bytes'] / plan.hbm_bytes:.0%}): {plan.suggestion()}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- command line


FAKE_DEVICES_ENV = "JAXSPEC_PLAN_FAKE_DEVICES"  # set in the restarted process, so it never restarts twice


def add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="will a model's generation fit a mesh? per-device memory and FLOPs, compiled "
                       "for abstract arrays (no weights read)")
    p.add_argument("--model", help=f"a config: {', '.join(BUILTIN_CONFIGS)}, a Hugging Face config.json or a "
                   "folder holding one, a .gguf file or a known model name (no weights are read)")
    p.add_argument("--method", default="autoregressive", help="the generation to plan: autoregressive, prompt-lookup "
                   "or a learned drafter's method (eagle3, medusa, jetspec, ...; its default tree, the drafter "
                   "replicated)")
    p.add_argument("--train-config", default=None, help="plan one training step of this drafter training config "
                   "(its target, batch and sequence length) instead of generation")
    p.add_argument("--mesh", default="data=1,model=1", help="data=N,model=M (fake CPU devices when this machine "
                   "has fewer)")
    p.add_argument("--batch-size", type=int, default=1, help="rows (split over the data axis)")
    p.add_argument("--cache-length", type=int, default=4096, help="KV cache slots per row: prompt + new tokens")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: a quarter of the cache")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="weights and cache")
    p.add_argument("--hbm", default=None, help="memory per device (16GiB, 80GB, or a chip: "
                   f"{', '.join(CHIP_MEMORY)}); exit status 2 when it does not fit")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def cmd_plan(args, argv: list[str]) -> int:
    """Runs the plan; restarts itself with fake CPU devices when the mesh needs more than this machine has.
    Returns the exit status: 0, or 2 when --hbm is given and it does not fit."""
    import json
    import os
    import subprocess
    import sys

    from jaxspec.sharding import make_mesh, parse_mesh

    data, model = parse_mesh(args.mesh)
    hbm = parse_memory(args.hbm) if args.hbm else None
    if (args.model is None) == (args.train_config is None):
        raise UserError("jaxspec plan needs --model (a generation) or --train-config (a training step), not both.")
    if args.model:
        cfg = plan_config(args.model)
    if jax.default_backend() == "cpu" and len(jax.devices()) < data * model:
        if os.environ.get(FAKE_DEVICES_ENV):
            raise UserError(f"The mesh needs {data * model} devices and only {len(jax.devices())} could be made.")
        env = dict(os.environ, JAX_PLATFORMS="cpu", **{FAKE_DEVICES_ENV: "1"})
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={data * model}"])
        return subprocess.run([sys.executable, "-m", "jaxspec", *argv], env=env, check=False).returncode
    mesh = make_mesh(data, model, jax.devices()[: data * model])
    if args.train_config:
        from jaxspec.config_files import load_config
        from jaxspec.training.config import TrainConfig

        plan = plan_training(load_config(args.train_config, TrainConfig), mesh, hbm_bytes=hbm)
    else:
        plan = plan_generation(cfg, mesh, batch_size=args.batch_size, cache_length=args.cache_length,
                               dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
                               max_new_tokens=args.max_new_tokens, hbm_bytes=hbm, method=args.method)
    print(json.dumps(plan.to_json()) if args.json else format_plan(plan))
    return 2 if plan.fits is False else 0


__all__ = ["BUILTIN_CONFIGS", "CHIP_MEMORY", "Plan", "add_plan_parser", "cmd_plan", "format_plan", "parse_memory",
           "plan_config", "plan_generation", "plan_training"]
