"""The notebooks in notebooks/: each runs top to bottom in a fresh kernel (small settings), and the repository holds
them with outputs stripped and the Colab install cell first.

Executing a notebook starts a Jupyter kernel (nbclient, ipykernel) with JAXSPEC_NOTEBOOK_SMALL=1, which every
notebook reads to shrink its work (a few prompts, ~16 new tokens, one prompt set), and JAXSPEC_NOTEBOOK_OUT, a
scratch folder for anything a notebook writes. The kernel is the current interpreter's ("python3" resolves to
sys.executable), so it sees the same installed packages as pytest.
"""

import glob
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
CELL_TIMEOUT = 600  # seconds per cell


def _names(paths):
    return [os.path.splitext(os.path.basename(p))[0] for p in paths]


def _jupyter():
    """(nbformat, nbclient), or a skip naming what is missing (they come with the test extras)."""
    modules = []
    for name in ("nbformat", "nbclient", "ipykernel"):
        modules.append(pytest.importorskip(name, reason=f"executing notebooks needs {name}: pip install -e '.[test]'"))
    return modules[0], modules[1]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_is_stripped_and_starts_with_colab_setup(path):
    with open(path) as f:
        nb = json.load(f)  # plain JSON: this check needs no Jupyter package
    name = os.path.basename(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{name} has no code cell"
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{name}: cells {dirty} hold outputs or execution counts; check notebooks in stripped "
                       "(Jupyter: Edit > Clear All Outputs, or `jupyter nbconvert --clear-output --inplace`)")
    first = "".join(code[0]["source"])
    assert "google.colab" in first, f"{name}: the first code cell must be the Colab install cell (google.colab)"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=_names(NOTEBOOKS))
def test_notebook_runs(path, tmp_path, monkeypatch):
    """Runs the notebook top to bottom in a fresh kernel; any cell that raises fails the test."""
    nbformat, nbclient = _jupyter()
    from nbclient.exceptions import CellExecutionError

    # the kernel process inherits this process's environment
    monkeypatch.setenv("JAXSPEC_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("JAXSPEC_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT,
                                     resources={"metadata": {"path": ROOT}})  # cwd: the repository root, as on Colab
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{os.path.basename(path)} failed in a cell:\n{e}", pytrace=False)


def test_kernel_is_this_interpreter():
    """The "python3" kernel the notebooks run in is this interpreter (its packages are the ones under test)."""
    nbformat, nbclient = _jupyter()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import sys; print(sys.executable)")])
    nbclient.NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT).execute()
    printed = "".join(o.get("text", "") for o in nb.cells[0].outputs).strip()
    assert printed == sys.executable, (
        f"the python3 kernel runs {printed}, not {sys.executable}; a user-level kernelspec may shadow the "
        "environment's (`jupyter kernelspec list`)")
