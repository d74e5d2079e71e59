"""Writes tests/fixtures/tiny-qwen3_5.gguf and tiny-qwen3_5_moe.gguf with llama.cpp's own converter, so the
Qwen3.5 and Qwen3.5-MoE GGUF loaders are checked against files jaxspec did not write.

    python scripts/make_qwen35_gguf.py --converter PATH/TO/llama.cpp/convert_hf_to_gguf.py

Needs torch, transformers and the gguf package (not jaxspec's dependencies: an optional script, like
make_reference.py). The fixture was made with convert_hf_to_gguf.py of ggml-org/llama.cpp at commit
0024aa7417efd50a7c2a79e049dfbbbceb0beaaf, gguf 0.19.0, torch 2.13.0+cpu, transformers 5.25.0.

The tiny folders carry no tokenizer, and the converter's Qwen3.5 classes insist on a real one (they hash the
pre-tokenizer). The one change made here: their vocabulary step is replaced by the converter's own "no vocabulary"
step (tokenizer.ggml.model = "none"); every tensor goes through the converter untouched.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--converter", required=True, help="llama.cpp's convert_hf_to_gguf.py")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", args.converter)
    converter = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = converter
    spec.loader.exec_module(converter)
    converter.Qwen3_5TextModel.set_vocab = converter.TextModel._set_vocab_none
    converter.Qwen3_5MoeTextModel.set_vocab = converter.TextModel._set_vocab_none
    for name in ("tiny-qwen3_5", "tiny-qwen3_5_moe"):
        folder = ROOT / "tests" / "fixtures" / name
        sys.argv = [args.converter, str(folder), "--outtype", "f32", "--outfile", f"{folder}.gguf"]
        converter.main()


if __name__ == "__main__":
    main()
