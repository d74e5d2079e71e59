"""Config files: YAML read into frozen, kw_only dataclasses, with `--set key.sub=value` overrides.

`load_config(path, cls, overrides)` reads a file into `cls`; `from_dict` converts a mapping (a drafter's own
settings, a checkpoint's saved config) the same way, refusing an unknown key with its dotted path, the valid keys
and the closest one; `to_dict` and `dump_config` go back. The training config (`jaxspec.training.config`) and the
drafters' configs are read with these; the model's own config is `jaxspec.config`.

    cfg = load_config("configs/medusa-smollm2.yaml", TrainConfig, overrides=["optim.learning_rate=3e-4"])
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar, Union

import yaml

from jaxspec.errors import UserError

T = TypeVar("T")



# ---------------------------------------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads `1e-4` as a float (YAML 1.1, PyYAML's default, wants `1.0e-4`; YAML 1.2 does not)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def parse_yaml(text: str, source: str = "<string>") -> Any:
    """Parses YAML text safely (no object construction), reading `1e-4` as a float.

    Args:
        text: the YAML document.
        source: where the text came from, for the error message.

    Returns:
        The parsed value (a dict for a config file).

    Raises:
        UserError: the text is not valid YAML.
    """
    try:
        return yaml.load(text, Loader=_Loader)  # _Loader is a SafeLoader: no object construction
    except yaml.YAMLError as e:
        raise UserError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None


def dump_config(obj: Any) -> str:
    """A config dataclass (or dict) as YAML text that `load_config` reads back to an equal config."""
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------------------------------------- dataclass <-> dict


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _type_name(tp: Any) -> str:
    """A phrase for a type hint, as a user would read it in an error message."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any value"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if tp is dict or origin is dict or origin is Mapping:
        return "a mapping"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        names = " or ".join(_type_name(a) for a in inner)
        return f"{names} or null" if len(inner) < len(args) else names
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {_plural(args[0])}"
        return f"a list of {len(args)} values ({', '.join(_type_name(a) for a in args)})"
    if dataclasses.is_dataclass(tp):
        return f"a mapping ({tp.__name__})"
    return getattr(tp, "__name__", str(tp))


def _plural(tp: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, _type_name(tp))


def _describe(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} ({text[:60] + '...' if len(text) > 60 else text})"


def _wrong_type(tp: Any, value: Any, path: str) -> UserError:
    return UserError(f"Config key '{path}' must be {_type_name(tp)}, got {_describe(value)}.")


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Checks `value` against the type hint `tp` and converts it (lists to tuples, mappings to dataclasses)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return copy.deepcopy(value)
    if origin in (Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise _wrong_type(tp, value, path)
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            if dataclasses.is_dataclass(inner[0]) or typing.get_origin(inner[0]) is tuple:
                return _convert(inner[0], value, path)  # its own message names the inner key
            try:
                return _convert(inner[0], value, path)
            except UserError:
                raise _wrong_type(tp, value, path) from None
        for a in inner:
            try:
                return _convert(a, value, path)
            except UserError:
                continue
        raise _wrong_type(tp, value, path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise UserError(f"Config key '{path}' must be {_type_name(tp)}, got {_describe(value)}.")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _wrong_type(tp, value, path)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _wrong_type(tp, value, path)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _wrong_type(tp, value, path)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _wrong_type(tp, value, path)
    if tp is dict or origin in (dict, Mapping):
        if isinstance(value, Mapping):
            return copy.deepcopy(dict(value))
        raise _wrong_type(tp, value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _wrong_type(tp, value, path)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _wrong_type(tp, value, path)
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    raise TypeError(f"from_dict cannot read a field of type {tp!r} ({path}); use int, float, str, bool, dict, "
                    "Literal, tuples, Optional or a nested dataclass")


def _unknown_key(key: Any, path: str, valid: Iterable[str]) -> UserError:
    valid = list(valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f" Did you mean '{_join(path, close[0])}'?" if close else ""
    where = f"under '{path}'" if path else "at the top level"
    return UserError(f"Unknown config key '{_join(path, key)}'.{hint} Valid keys {where}: {', '.join(valid)}.")


def from_dict(cls: type[T], data: Mapping[str, Any], path: str = "") -> T:
    """Builds the dataclass `cls` from a mapping (parsed YAML), checking every key and type.

    Nested dataclass fields read nested mappings; `X | None` accepts null; `tuple[int, ...]` and
    `tuple[float, ...]` read YAML lists; `Literal[...]` fields accept only their listed values; an int is accepted
    where a float is expected. Missing keys take the field's default. Values are then checked by the class's own
    `__post_init__`.

    Args:
        cls: a dataclass type whose fields are annotated with the types above.
        data: the mapping to read.
        path: the dotted key of `data` in the whole config (for messages), "" at the top level.

    Returns:
        An instance of `cls`.

    Raises:
        UserError: an unknown key (named with its dotted path, the valid keys and the closest one), a value of
            the wrong type, a missing required key, or a value the class refuses.
    """
    if not isinstance(data, Mapping):
        where = f"Config key '{path}'" if path else "A config"
        raise UserError(f"{where} must be a mapping of keys to values ({cls.__name__}), got {_describe(data)}.")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            raise _unknown_key(key, path, fields)
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"Missing config key '{_join(path, name)}' ({_type_name(hints[name])}); it has no "
                            "default, so the config must set it.")
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """The inverse of `from_dict`: dataclasses to dicts, tuples to lists, recursively (JSON and YAML ready)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------- files and overrides


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Applies `key.sub=value` overrides (the CLI's `--set`) to a parsed config, returning a new dict.

    The value is parsed as YAML (`3`, `1e-4`, `null`, `[1, 2]`, `true`; anything else is a string), and missing
    intermediate mappings are created, so an override naming an unknown key reaches `from_dict`, which refuses it
    with its dotted path.

    Args:
        data: the parsed config (not modified).
        overrides: strings `dotted.key=value`.

    Returns:
        A deep copy of `data` with the overrides applied in order.

    Raises:
        UserError: an override without `=` or with an empty key part, a value that is not valid YAML, or a path
            through a key whose value is not a mapping.
    """
    out = copy.deepcopy(dict(data))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        parts = key.split(".")
        if not sep or not key or any(not p for p in parts):
            raise UserError(f"Override '{item}' must look like key.sub=value (for example optim.learning_rate=3e-4).")
        value = parse_yaml(raw, source=f"The value of override '{item}'")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: i + 1])
                raise UserError(f"Override '{item}' goes through '{where}', which is {_describe(child)}, not a "
                                "mapping of keys.")
            node = child
        node[parts[-1]] = value
    return out


def load_config(path: str | os.PathLike, cls: type[T], overrides: Iterable[str] = ()) -> T:
    """Reads a YAML config file into `cls`, applying `key.sub=value` overrides first.

    Args:
        path: the YAML file.
        cls: the config dataclass (usually `TrainConfig`).
        overrides: `--set` strings, applied in order.

    Returns:
        The validated config.

    Raises:
        UserError: the file is missing or unreadable, is not valid YAML, is not a mapping, or fails `from_dict`.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"Config file {path} does not exist; pass the path of a YAML file (see configs/).") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"Cannot read config file {path}: {e}.") from None
    data = parse_yaml(text, source=f"Config file {path}")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"Config file {path} must hold a mapping of keys to values, got {_describe(data)}.")
    return from_dict(cls, apply_overrides(data, overrides))
