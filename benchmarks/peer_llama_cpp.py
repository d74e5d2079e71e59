"""The llama.cpp peer of `jaxspec bench`: llama.cpp's greedy decoding of the same model in float32, on the same prompts.

An optional script, loaded by `jaxspec bench` from a source checkout when peers are requested and `llama_cpp` imports
(`pip install llama-cpp-python`, which builds llama.cpp from source: about 6 minutes on 2 cores; never a dependency).
The target must come from a GGUF file: its tensors are dequantized once into a float32 GGUF beside jaxspec's cache
(`jaxspec.budget.cache_folder()`), metadata copied, so both run the same weights at the same precision.

    python benchmarks/peer_llama_cpp.py             # writes the float32 GGUF of the default model, times one prompt
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

import gguf
import numpy as np
from tqdm import tqdm

from jaxspec.bench import PEER_THREADS, _finite
from jaxspec.errors import UserError
from jaxspec.loading import LoadedModel

NAME = "llama-cpp"


def float32_gguf(source: str, out: str) -> str:
    """Writes `source` (a GGUF file) with every tensor dequantized to float32 into `out` (skipped if it exists);
    the metadata is copied, the file type set to all-F32. Returns `out`."""
    if os.path.exists(out):
        return out
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    os.makedirs(os.path.dirname(out), exist_ok=True)
    partial = out + ".partial"
    writer = gguf.GGUFWriter(partial, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)  # [rows, columns]
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, out)
    return out


def run_llama_cpp(target: LoadedModel, prompt_sets: Mapping[str, Sequence[Sequence[int]]], *, max_new_tokens: int,
                  eos_ids: Sequence[int], threads: int = PEER_THREADS,
                  progress: bool = True) -> tuple[list[dict], dict]:
    """Times llama.cpp's greedy decoding at batch 1 on the same token-id prompts (prefill included, one untimed
    warm-up). Returns (rows shaped like `run_bench` rows with method "llama-cpp", info dict)."""
    import llama_cpp

    from jaxspec.budget import cache_folder

    source = target.source
    if not source.endswith(".gguf"):
        raise UserError(f"the llama.cpp peer needs a GGUF target; {source} is not one")
    path = float32_gguf(source, os.path.join(cache_folder(), "llama-cpp",
                                             os.path.basename(source).removesuffix(".gguf") + ".F32.gguf"))
    longest = max(len(p) for prompts in prompt_sets.values() for p in prompts)
    model = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                            n_ctx=longest + max_new_tokens + 8, n_batch=512, verbose=False)
    stop = {int(e) for e in eos_ids} or {int(model.token_eos())}

    def generate(ids: Sequence[int]) -> tuple[list[int], float]:
        tokens: list[int] = []
        start = time.perf_counter()
        for token in model.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                    reset=True):
            if token in stop:
                break
            tokens.append(int(token))
            if len(tokens) == max_new_tokens:
                break
        return tokens, time.perf_counter() - start

    rows = []
    first = next(iter(prompt_sets.values()))[0]
    warmup = generate(first)[1]
    for set_name, prompts in tqdm(prompt_sets.items(), desc="llama.cpp", unit="set", disable=not progress,
                                  file=sys.stderr):
        token_ids, seconds = [], 0.0
        for ids in prompts:
            tokens, s = generate(ids)
            token_ids.append(tokens)
            seconds += s
        new_tokens = sum(len(t) for t in token_ids)
        rows.append({
            "method": NAME, "num_draft_tokens": None, "label": NAME, "prompt_set": set_name, "temperature": 0.0,
            "batch_size": 1, "num_prompts": len(prompts), "num_batches": len(prompts), "tree_width": None,
            "new_tokens": new_tokens, "seconds": seconds, "warmup_seconds": warmup,
            "tokens_per_second": _finite(new_tokens / seconds if seconds > 0 else float("nan")),
            "speedup": None, "tau": None, "rounds": None, "acceptance_by_position": None,
            "accepted_length_histogram": None, "matches_autoregressive": None, "mismatched_prompts": [],
            "token_ids": token_ids, "peer": True,
        })
        warmup = 0.0
    info = {"ran": [NAME], "llama_cpp_python_version": llama_cpp.__version__, "threads": threads, "source": path,
            "dtype": "float32", "batch_size": 1, "temperature": 0.0,
            "speedup": "tokens/s relative to jaxspec autoregressive on the same set at T=0, batch 1"}
    return rows, info


if __name__ == "__main__":
    from jaxspec.loading import DEFAULT_MODEL, load_model
    from jaxspec.tokenizer import encode_prompt

    target = load_model(DEFAULT_MODEL)
    ids = encode_prompt(target.tokenizer, "Write a Python function that checks whether a number is prime.", chat=True)
    rows, info = run_llama_cpp(target, {"one prompt": [ids]}, max_new_tokens=128, eos_ids=())
    print(f"llama.cpp ({info['source']}, {info['threads']} threads): {rows[0]['new_tokens']} tokens at "
          f"{rows[0]['tokens_per_second']:.1f} tok/s (prefill included)")
    print(target.tokenizer.decode(rows[0]["token_ids"][0]))
