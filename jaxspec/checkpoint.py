"""Checkpoints: training state with Orbax (resume exactly), and drafter checkpoints that users ship and load.

Training checkpoints (`TrainCheckpointer`) hold everything a resumed run needs: `params`, `opt_state` (any
optax state), `step`, `data_position` and optionally `rng` (a typed PRNG key or its key data), plus a JSON item
(`metadata`: the config and whatever else the loop records). Orbax writes each step into
`<step>.orbax-checkpoint-tmp` and renames it to `<step>` only once every file is written, so a run killed while
saving leaves the previous checkpoints intact; the unfinished directory is ignored when listing steps and is
replaced by the next save of that step.

Drafter checkpoints (`save_drafter` / `load_drafter`) are a directory with two files:
- `params.safetensors`: the parameters, one tensor per pytree leaf named by its path (`heads/0/w`).
  Safetensors rather than Orbax because a drafter is a small artefact to ship: one self-describing file that
  loads without Orbax's machinery, reads lazily, and that other tools (the HF hub, torch) understand.
- `jaxspec_drafter.json`: format version, method, drafter config, the target's fingerprint and source, every
  tensor's path, shape and dtype, and the SHA-256 of the params file, so a truncated or altered file is
  reported as corrupt instead of loading wrong numbers.
A drafter belongs to one target: loading it with another target's fingerprint is refused.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxspec.data import file_sha256
from jaxspec.errors import UserError

DRAFTER_META_FILE = "jaxspec_drafter.json"
DRAFTER_PARAMS_FILE = "params.safetensors"
DRAFTER_FORMAT = "jaxspec-drafter"
DRAFTER_FORMAT_VERSION = 1

_STATE = "state"
_METADATA = "metadata"


# ---------------------------------------------------------------------------------------------- training state


def _abstract(tree: Any) -> Any:
    """Arrays (also donated or deleted ones) -> ShapeDtypeStruct with their sharding; other leaves unchanged."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, np.ndarray):
            return jax.ShapeDtypeStruct(x.shape, x.dtype)
        return x

    return jax.tree.map(leaf, tree)


class TrainCheckpointer:
    """Periodic, asynchronous training checkpoints in `directory`, the newest `keep` kept.

    `save` is called every step and writes only at multiples of `save_every` (or when forced); it returns once the
    arrays are copied off the device, so the caller may donate them to the next step, and the files are written
    in the background. The state is a dict pytree, typically
    `{"params", "opt_state", "step", "data_position", "rng"}`; `restore` needs the same structure (fresh state or
    `jax.eval_shape` of it) so optax's named tuples and typed keys come back as they were.
    """

    def __init__(self, directory: str | os.PathLike, save_every: int = 1, keep: int | None = None, *,
                 config: Mapping[str, Any] | None = None):
        """Opens (creating if needed) the checkpoint directory.

        Args:
            directory: where the step directories go.
            save_every: save only steps that are multiples of this (unless forced).
            keep: how many of the newest checkpoints to keep; None keeps all.
            config: a JSON-able dict (`to_dict(train_config)`) written with every checkpoint.
        """
        if save_every < 1:
            raise UserError(f"run.save_every must be >= 1, got {save_every}.")
        if keep is not None and keep < 1:
            raise UserError(f"run.keep_checkpoints must be >= 1, got {keep}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.config = dict(config) if config is not None else None
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(_STATE, _METADATA))

    def save(self, step: int, state: Mapping[str, Any], force: bool = False,
             metadata: Mapping[str, Any] | None = None) -> bool:
        """Saves `state` at `step` if the interval says so (or `force`).

        Args:
            step: the training step (optimizer updates so far).
            state: the pytree dict to save.
            force: save even off the interval (the last step, before stopping).
            metadata: JSON-able extras stored beside `config` in the metadata item.

        Returns:
            Whether a checkpoint was started (False off the interval, or when `step` is already saved).
        """
        step = int(step)
        # The interval is applied here rather than by Orbax, which also saves the first step it is handed.
        if not (force or step % self.save_every == 0) or step in self._manager.all_steps():
            return False
        meta = {"config": self.config, "step": step, **(metadata or {})}
        return self._manager.save(
            step,
            args=ocp.args.Composite(**{_STATE: ocp.args.StandardSave(dict(state)), _METADATA: ocp.args.JsonSave(meta)}),
            force=True,
        )

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or None when there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of the finished checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def _check_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise UserError(f"There is no finished training checkpoint in {self.directory}.")
            return steps[-1]
        if step not in steps:
            have = ", ".join(map(str, steps)) or "none"
            raise UserError(f"There is no checkpoint for step {step} in {self.directory} (steps there: {have}).")
        return step

    def restore(self, step: int | None = None, *, abstract_state: Mapping[str, Any]) -> dict[str, Any]:
        """Reads the state saved at `step` (the newest by default).

        Args:
            step: which checkpoint; None for the newest.
            abstract_state: the state's structure: a fresh state (its arrays may have been donated) or
                `jax.eval_shape` of one. Arrays are restored with its shapes, dtypes and shardings.

        Returns:
            The state, with the same structure as `abstract_state`.

        Raises:
            UserError: no such checkpoint, or it does not match `abstract_state` (another drafter or optimizer).
        """
        step = self._check_step(step)
        self._manager.wait_until_finished()
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(_abstract(dict(abstract_state)))})
            )
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"The checkpoint at step {step} in {self.directory} does not match this run's training state (was it "
                f"written with another drafter config or optimizer?); use a new run.out_dir. Details: {e}"
            ) from None
        return out[_STATE]

    def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata item saved at `step` (the newest by default): `config`, `step` and extras."""
        step = self._check_step(step)
        self._manager.wait_until_finished()
        out = self._manager.restore(step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()}))
        return dict(out[_METADATA])

    def wait_until_finished(self) -> None:
        """Blocks until background writes are done."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finishes pending writes and releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------- drafter checkpoints


def _path_entry(k) -> list:
    if isinstance(k, jax.tree_util.DictKey):
        return ["key", k.key]
    if isinstance(k, jax.tree_util.GetAttrKey):
        return ["attr", k.name]
    if isinstance(k, jax.tree_util.SequenceKey):
        return ["index", k.idx]
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return ["index", k.key]
    raise TypeError(f"Unsupported pytree key {k!r}")


def _flatten(tree: Any) -> tuple[list[tuple[str, list, Any]], Any]:
    """[(name, path entries, leaf)], treedef; names are the path parts joined with '/'."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out, seen = [], set()
    for path, leaf in leaves:
        entries = [_path_entry(k) for k in path]
        name = "/".join(str(e[1]) for e in entries) or "value"
        if name in seen:
            raise ValueError(f"Two parameters would both be named '{name}'; rename a key containing '/'.")
        seen.add(name)
        out.append((name, entries, leaf))
    return out, treedef


def _build(items: list[tuple[list, Any]]) -> Any:
    """Nested dicts/lists from (path entries, value): index entries make lists, key and attr entries dicts."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    groups: dict[tuple, list] = {}
    for entries, value in items:
        kind, key = entries[0]
        groups.setdefault((kind == "index", key), []).append((entries[1:], value))
    if all(is_index for is_index, _ in groups):
        return [_build(groups[k]) for k in sorted(groups, key=lambda k: k[1])]
    return {key: _build(sub) for (_, key), sub in groups.items()}


def save_drafter(directory: str | os.PathLike, *, method: str, drafter_config: Mapping[str, Any], params: Any,
                 target_fingerprint: str, target_source: str, extra: Mapping[str, Any] | None = None) -> str:
    """Writes a drafter checkpoint: `params.safetensors` and `jaxspec_drafter.json`.

    The params file is written first and the JSON last, each through a temporary file and a rename, so a reader
    never sees a half-written file under the final name.

    Args:
        directory: the checkpoint directory (created if needed; its two files are replaced).
        method: the drafter's method name (`medusa`, `eagle3`, ...).
        drafter_config: the method's config as a JSON-able dict (`to_dict(method_config)`).
        params: the drafter's parameter pytree (dicts, lists, registered dataclasses of arrays).
        target_fingerprint: `LoadedModel.fingerprint()` of the target it was trained for.
        target_source: where that target came from (`LoadedModel.source`), for messages.
        extra: more JSON-able facts (training steps, final loss, tau, ...).

    Returns:
        The directory.
    """
    from safetensors.numpy import save_file

    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    leaves, _ = _flatten(params)
    arrays = {name: np.asarray(jax.device_get(leaf), order="C") for name, _, leaf in leaves}  # keeps 0-d
    params_path = os.path.join(directory, DRAFTER_PARAMS_FILE)
    tmp = params_path + ".tmp"
    save_file(arrays, tmp, metadata={"format": DRAFTER_FORMAT, "method": method})
    os.replace(tmp, params_path)
    meta = {
        "format": DRAFTER_FORMAT,
        "format_version": DRAFTER_FORMAT_VERSION,
        "method": method,
        "config": dict(drafter_config),
        "target": {"fingerprint": target_fingerprint, "source": target_source},
        "params": {
            "file": DRAFTER_PARAMS_FILE,
            "sha256": file_sha256(params_path),
            "tensors": [{"name": name, "path": entries, "shape": list(arrays[name].shape),
                         "dtype": str(arrays[name].dtype)} for name, entries, _ in leaves],
        },
        "extra": dict(extra or {}),
    }
    meta_path = os.path.join(directory, DRAFTER_META_FILE)
    with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    return directory


def read_drafter_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The drafter checkpoint's `jaxspec_drafter.json`, checked for format, without reading the params.

    Raises:
        UserError: the directory or file is missing, or the file is not a jaxspec drafter description.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise UserError(f"Drafter checkpoint {directory} does not exist (expected a directory written by training).")
    path = os.path.join(directory, DRAFTER_META_FILE)
    if not os.path.isfile(path):
        raise UserError(f"{directory} is not a jaxspec drafter checkpoint: {DRAFTER_META_FILE} is missing.")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(
            f"Drafter checkpoint {directory} is corrupt: {DRAFTER_META_FILE} cannot be read ({e})."
        ) from None
    required = ("format_version", "method", "config", "target", "params")
    if not isinstance(meta, dict) or meta.get("format") != DRAFTER_FORMAT or any(k not in meta for k in required):
        raise UserError(f"Drafter checkpoint {directory} is corrupt: {DRAFTER_META_FILE} is not a jaxspec drafter "
                        "description.")
    if meta["format_version"] > DRAFTER_FORMAT_VERSION:
        raise UserError(f"Drafter checkpoint {directory} has format version {meta['format_version']}, newer than this "
                        f"jaxspec reads ({DRAFTER_FORMAT_VERSION}); upgrade jaxspec.")
    return meta


def load_drafter(directory: str | os.PathLike, *, expected_method: str | None = None,
                 target_fingerprint: str | None = None, target_source: str | None = None,
                 abstract_params: Any = None) -> tuple[dict[str, Any], Any]:
    """Reads a drafter checkpoint, refusing one made for another method or another target.

    Args:
        directory: the checkpoint directory.
        expected_method: refuse a drafter of another method (None: any).
        target_fingerprint: the running target's `LoadedModel.fingerprint()`; refuse a drafter trained for a
            different one (None: no check).
        target_source: the running target's source, named in the refusal.
        abstract_params: the parameter structure to fill (fresh params or `jax.eval_shape` of them): the result
            then has its pytree types, dtypes (values are cast) and shardings. None returns nested dicts and lists
            rebuilt from the saved paths (a registered dataclass comes back as a dict of its fields).

    Returns:
        (the JSON description: method, config, target, params, extra; the params pytree of jax arrays).

    Raises:
        UserError: missing or corrupt files, another method, another target, or params that do not match
            `abstract_params`.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    directory = os.fspath(directory)
    meta = read_drafter_meta(directory)
    if expected_method is not None and meta["method"] != expected_method:
        raise UserError(f"Drafter checkpoint {directory} is a '{meta['method']}' drafter, not '{expected_method}'; "
                        f"pass --method {meta['method']} or a {expected_method} checkpoint.")
    saved_fp = meta["target"].get("fingerprint")
    if target_fingerprint is not None and saved_fp != target_fingerprint:
        saved_src = meta["target"].get("source", "?")
        running = target_source or "the loaded target"
        raise UserError(f"This drafter was trained for target {saved_src} (fingerprint {saved_fp}), not for {running} "
                        f"(fingerprint {target_fingerprint}); train one for this target or pass the right --model.")
    params_path = os.path.join(directory, meta["params"].get("file", DRAFTER_PARAMS_FILE))
    if not os.path.isfile(params_path):
        raise UserError(f"Drafter checkpoint {directory} is incomplete: {os.path.basename(params_path)} is missing.")
    if file_sha256(params_path) != meta["params"].get("sha256"):
        raise UserError(f"Drafter checkpoint {directory} is corrupt: {os.path.basename(params_path)} does not match "
                        f"the checksum in {DRAFTER_META_FILE} (truncated or altered); copy or train it again.")
    try:
        arrays = load_file(params_path)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"Drafter checkpoint {directory} is corrupt: {os.path.basename(params_path)} cannot be read "
                        f"({e}).") from None
    tensors = meta["params"]["tensors"]
    names = [t["name"] for t in tensors]
    if set(names) != set(arrays) or any(list(arrays[t["name"]].shape) != t["shape"] for t in tensors):
        raise UserError(f"Drafter checkpoint {directory} is corrupt: its tensors do not match {DRAFTER_META_FILE}.")
    if abstract_params is None:
        params = _build([(t["path"], jnp.asarray(arrays[t["name"]])) for t in tensors])
        return meta, params
    return meta, _fill(directory, abstract_params, arrays)


def _fill(directory: str, abstract_params: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    leaves, treedef = _flatten(abstract_params)
    wanted = {name for name, _, _ in leaves}
    missing, unexpected = sorted(wanted - set(arrays)), sorted(set(arrays) - wanted)
    problems = []
    if missing:
        problems.append(f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    for name, _, leaf in leaves:
        if name in arrays and tuple(arrays[name].shape) != tuple(leaf.shape):
            problems.append(f"{name} has shape {tuple(arrays[name].shape)}, expected {tuple(leaf.shape)}")
    if problems:
        raise UserError(f"Drafter checkpoint {directory} does not fit this drafter's parameters "
                        f"({'; '.join(problems)}); was it saved with another drafter config?")
    out = []
    for name, _, leaf in leaves:
        value = jnp.asarray(arrays[name], dtype=leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        out.append(jax.device_put(value, sharding) if sharding is not None else value)
    return jax.tree_util.tree_unflatten(treedef, out)


def convert_drafter_dtype(source: str | os.PathLike, destination: str | os.PathLike, dtype: str = "bfloat16") -> str:
    """Copies a drafter checkpoint with its matrices (tensors of 2 or more dimensions) stored in `dtype`, for
    shipping: vectors (norms, EAGLE's d2t token ids) keep their dtype so ids stay exact. Loading casts back to the
    drafter's own dtype, so only the stored values are rounded.

    Returns:
        The destination directory.
    """
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    store = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}.get(dtype)
    if store is None:
        raise UserError(f"Cannot store a drafter as '{dtype}'; choose bfloat16, float16 or float32.")
    meta, params = load_drafter(source)  # checked: format, checksum, tensors
    del params
    arrays = load_file(os.path.join(os.fspath(source), meta["params"].get("file", DRAFTER_PARAMS_FILE)))
    converted = {name: (a.astype(store) if a.ndim >= 2 and np.issubdtype(a.dtype, np.floating) else a)
                 for name, a in arrays.items()}
    destination = os.fspath(destination)
    os.makedirs(destination, exist_ok=True)
    params_path = os.path.join(destination, DRAFTER_PARAMS_FILE)
    save_file(converted, params_path + ".tmp", metadata={"format": DRAFTER_FORMAT, "method": meta["method"]})
    os.replace(params_path + ".tmp", params_path)
    meta = dict(meta, params=dict(meta["params"], file=DRAFTER_PARAMS_FILE, sha256=file_sha256(params_path),
                                  tensors=[dict(t, dtype=str(converted[t["name"]].dtype))
                                           for t in meta["params"]["tensors"]]))
    meta_path = os.path.join(destination, DRAFTER_META_FILE)
    with open(meta_path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    return destination
