"""The documentation matches the code: docs/api.md's names import and its signatures are the real ones, and the
README's architecture table names files that exist (and every module). No model is loaded."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(ROOT, "docs", "api.md")
README = os.path.join(ROOT, "README.md")

HEADING = re.compile(r"^### `([A-Za-z_][\w.]*)`\s*$")
CODE_BLOCK = re.compile(r"```python\n(.*?)```", re.S)
ALSO_AS = re.compile(r"Also as (`[\w.]+`(?:(?:, | and )`[\w.]+`)*)")

# The names the issue asks the reference to cover.
REQUIRED = (
    "jaxspec.load_model", "jaxspec.methods.build_method", "jaxspec.methods.MethodOptions", "jaxspec.generate.generate",
    "jaxspec.speculative.speculative_generate", "jaxspec.pipeline.pipeline_generate", "jaxspec.sharding.make_mesh",
    "jaxspec.sharding.forward_on_mesh", "jaxspec.model.forward", "jaxspec.sampling.SamplingConfig",
    "jaxspec.verification.accept", "jaxspec.checkpoint.save_drafter", "jaxspec.checkpoint.load_drafter",
    "jaxspec.bench.run_bench", "jaxspec.metrics.tau", "jaxspec.training.distill.train",
)


@dataclasses.dataclass
class Entry:
    name: str
    body: str

    @property
    def signature(self) -> str | None:
        m = CODE_BLOCK.search(self.body)
        return " ".join(m.group(1).split()) if m else None

    @property
    def aliases(self) -> list[str]:
        return [a for m in ALSO_AS.finditer(self.body) for a in re.findall(r"`([\w.]+)`", m.group(1))]


def api_entries() -> list[Entry]:
    entries, current, body = [], None, []
    with open(API_MD) as f:
        for line in f:
            m = HEADING.match(line)
            if m or line.startswith("## ") or line.startswith("# "):
                if current is not None:
                    entries.append(Entry(current, "".join(body)))
                current, body = (m.group(1) if m else None), []
            elif current is not None:
                body.append(line)
    if current is not None:
        entries.append(Entry(current, "".join(body)))
    return entries


def resolve(dotted: str):
    """(owner, object) of a dotted name read as `from <module> import <name>`: the longest importable module prefix
    short of the last part, then attributes (`jaxspec.generate` is the function that the package exports, not the
    module of that name). `owner` is the object the last attribute was read from (a class for a method)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # only "this prefix is not a module": an import error inside a real module must surface
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue
            raise
        break
    else:
        raise ImportError(f"no module in {dotted}")
    owner = None
    for attr in parts[i:]:
        owner, obj = obj, getattr(obj, attr)
    return owner, obj


def split_top_level(text: str) -> list[str]:
    """Splits at commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def parse_signature(text: str) -> tuple[str, list[tuple[str, str | None]], str | None]:
    """"name(a, b=1, *, c) -> R" -> ("name", [("a", None), ("b", "1"), ("*", None), ("c", None)], "R")."""
    m = re.match(r"(\w+)\(", text)
    assert m, f"not a signature: {text!r}"
    depth, close = 0, None
    for i in range(m.end() - 1, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            close = i
            break
    assert close is not None, f"unbalanced parentheses: {text!r}"
    rest = text[close + 1:].strip()
    ret = None
    if rest:
        assert rest.startswith("->"), f"unexpected text after the parameters: {rest!r}"
        ret = rest[2:].strip()
    params = []
    for token in split_top_level(text[m.end():close]):
        name, _, default = token.partition("=")
        name = name.split(":")[0].strip()
        params.append((name, default.strip() if default else None))
    return m.group(1), params, ret


def expected_signature(owner, obj) -> tuple[list[tuple[str, object]], str | None]:
    """The code's parameters as (name, default or inspect.Parameter.empty), with "*" where keyword-only ones start
    (unless a *args does), and the declared return type (None for classes or when undeclared)."""
    try:
        sig = inspect.signature(obj)
    except ValueError:
        if isinstance(obj, type) and issubclass(obj, BaseException):
            return [("*args", inspect.Parameter.empty)], None  # BaseException.__init__(*args)
        raise
    params = list(sig.parameters.values())
    # a plain function read from a class is a method: drop self (bound classmethods have no cls already)
    if inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, obj.__name__, None)):
        params = params[1:]
    defaults = {}
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        defaults = {f.name: f.default_factory() for f in dataclasses.fields(obj)
                    if f.default_factory is not dataclasses.MISSING}
    out, keyword_marker = [], False
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            out.append(("*" + p.name, p.empty))
            keyword_marker = True
            continue
        if p.kind == p.KEYWORD_ONLY and not keyword_marker:
            out.append(("*", p.empty))
            keyword_marker = True
        if p.kind == p.VAR_KEYWORD:
            out.append(("**" + p.name, p.empty))
            continue
        out.append((p.name, defaults.get(p.name, p.default)))
    positional_only = [i for i, p in enumerate(params) if p.kind == p.POSITIONAL_ONLY]
    if positional_only:  # "/" after the last one (no *args or keyword-only marker can come before it)
        out.insert(positional_only[-1] + 1, ("/", inspect.Parameter.empty))
    ret = None
    if not inspect.isclass(obj) and sig.return_annotation is not sig.empty:
        a = sig.return_annotation
        ret = a if isinstance(a, str) else inspect.formatannotation(a)
    return out, ret


def signature_problems(entry: Entry) -> list[str]:
    owner, obj = resolve(entry.name)
    text = entry.signature
    if text is None:
        if callable(obj):
            return [f"{entry.name}: callable, but the entry gives no signature"]
        return []
    name, doc_params, doc_ret = parse_signature(text)
    problems = []
    short = entry.name.rsplit(".", 1)[1]
    if name != short:
        problems.append(f"{entry.name}: the signature is named {name!r}, not {short!r}")
    code_params, code_ret = expected_signature(owner, obj)
    doc_names = [n for n, _ in doc_params]
    code_names = [n for n, _ in code_params]
    if doc_names != code_names:
        problems.append(f"{entry.name}: parameters {doc_names} in the doc, {code_names} in the code")
        return problems
    for (pname, doc_default), (_, code_default) in zip(doc_params, code_params):
        has_default = code_default is not inspect.Parameter.empty
        if (doc_default is not None) != has_default:
            problems.append(f"{entry.name}: parameter {pname} "
                            + ("has a default in the code but not in the doc" if has_default
                               else "has no default in the code but one in the doc"))
            continue
        if doc_default is None:
            continue
        try:
            value = ast.literal_eval(doc_default)
        except (ValueError, SyntaxError):
            continue  # a name or call (GREEDY, MethodOptions()): not compared
        if value != code_default:
            problems.append(f"{entry.name}: {pname}={doc_default} in the doc, {code_default!r} in the code")
    if doc_ret is not None and doc_ret != code_ret:
        problems.append(f"{entry.name}: returns {doc_ret!r} in the doc, {code_ret!r} in the code")
    if doc_ret is None and code_ret is not None:
        problems.append(f"{entry.name}: the code declares -> {code_ret}; the doc gives no return type")
    return problems


ENTRIES = api_entries()


def test_api_entries_are_unique_and_cover_the_main_calls():
    names = [e.name for e in ENTRIES]
    assert len(names) > 50
    duplicates = sorted({n for n in names if names.count(n) > 1})
    assert not duplicates, f"docs/api.md lists these twice: {duplicates}"
    missing = [n for n in REQUIRED if n not in names]
    assert not missing, f"docs/api.md lacks: {missing}"


def test_every_api_name_resolves():
    failures = []
    for entry in ENTRIES:
        try:
            resolve(entry.name)
        except (ImportError, AttributeError) as e:
            failures.append(f"{entry.name} ({type(e).__name__}: {e})")
    assert not failures, "docs/api.md names that do not resolve:\n" + "\n".join(failures)


def test_api_aliases_are_the_same_objects():
    failures = []
    for entry in ENTRIES:
        for alias in entry.aliases:
            try:
                same = resolve(alias)[1] is resolve(entry.name)[1]
            except (ImportError, AttributeError) as e:
                failures.append(f"{alias} ({type(e).__name__}: {e})")
                continue
            if not same:
                failures.append(f"{alias} is not {entry.name}")
    assert not failures, "docs/api.md 'Also as' names that are wrong:\n" + "\n".join(failures)


def test_api_signatures_match_the_code():
    problems = []
    for entry in ENTRIES:
        try:
            problems += signature_problems(entry)
        except (ImportError, AttributeError):
            pass  # reported by test_every_api_name_resolves
    assert not problems, "docs/api.md signatures that differ from the code:\n" + "\n".join(problems)


def test_signature_parser():
    name, params, ret = parse_signature("f(a, b=(1, 2), *, c='x,y', d=G(e=1), **kw) -> tuple[int, int]")
    assert name == "f" and ret == "tuple[int, int]"
    assert params == [("a", None), ("b", "(1, 2)"), ("*", None), ("c", "'x,y'"), ("d", "G(e=1)"), ("**kw", None)]


def architecture_rows() -> list[tuple[str, str]]:
    with open(README) as f:
        text = f.read()
    section = text.split("\n## Architecture\n", 1)
    assert len(section) == 2, "README.md has no '## Architecture' section"
    rows = []
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-: ") and cells[0] != "file":
            rows.append((cells[0], cells[1]))
    assert rows, "README.md's architecture table is empty"
    return rows


@pytest.fixture(scope="module")
def table_paths() -> list[str]:
    paths = []
    for first, second in architecture_rows():
        paths += re.findall(r"`([^`]+)`", first)
        # paths named in the description too (a `name` without a slash or extension is a function, not a path)
        paths += [p for p in re.findall(r"`([^`\s]+)`", second) if "/" in p and not p.startswith("--")]
    return paths


def test_architecture_table_paths_exist(table_paths):
    missing = [p for p in table_paths if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"README.md's architecture table names paths that do not exist: {missing}"


def test_architecture_table_names_every_module(table_paths):
    named = {os.path.normpath(p) for p in table_paths}
    modules = []
    for folder in ("jaxspec", os.path.join("jaxspec", "drafters"), os.path.join("jaxspec", "training")):
        for f in sorted(os.listdir(os.path.join(ROOT, folder))):
            if f.endswith(".py") and f not in ("__init__.py", "__main__.py"):
                modules.append(os.path.join(folder, f))
    unnamed = [m for m in modules if m not in named]
    assert not unnamed, f"README.md's architecture table does not name these modules: {unnamed}"
