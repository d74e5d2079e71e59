"""The peers of `jaxspec bench`: transformers' greedy `generate` and its prompt lookup, timed on the same prompts.

An optional script, loaded by `jaxspec bench` from a source checkout when peers are requested: torch is imported
here only, never by the library (pip install torch==2.13.0 accelerate to run it).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

import torch
import transformers
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from jaxspec.bench import PEER_THREADS, _finite, method_label
from jaxspec.loading import LoadedModel


def run_peers(target: LoadedModel, prompt_sets: Mapping[str, Sequence[Sequence[int]]], *, max_new_tokens: int,
              eos_ids: Sequence[int], prompt_lookup_ks: Sequence[int], ngram: int = 3,
              threads: int = PEER_THREADS, progress: bool = True) -> tuple[list[dict], dict]:
    """Times transformers' greedy `generate` and its prompt lookup at batch 1 on the same token-id prompts.

    The model is `target.source` loaded in float32: a GGUF file through
    `from_pretrained(folder, gguf_file=name)`, or a Hugging Face folder.

    Args:
        target: The jaxspec target (only `source` is used).
        prompt_sets: Set name -> token-id prompts.
        max_new_tokens: New tokens per prompt at most.
        eos_ids: Stop tokens (empty: the model's generation config decides).
        prompt_lookup_ks: `prompt_lookup_num_tokens` values to run.
        ngram: `max_matching_ngram_size` of the prompt lookup.
        threads: torch threads.
        progress: Show a tqdm progress bar.

    Returns:
        (rows shaped like `run_bench` rows with method "hf-generate" / "hf-prompt-lookup", info dict).
    """
    torch.set_num_threads(threads)
    source = target.source
    if os.path.isdir(source):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source),
                                                     dtype=torch.float32)
    model.eval()
    eos = [int(e) for e in eos_ids]
    pad = eos[0] if eos else 0
    variants = [("hf-generate", None)] + [("hf-prompt-lookup", int(k)) for k in dict.fromkeys(prompt_lookup_ks)]

    def generate(ids: Sequence[int], k: int | None) -> tuple[list[int], float]:
        input_ids = torch.tensor([list(ids)], dtype=torch.long)  # [1, P]
        kwargs = {"attention_mask": torch.ones_like(input_ids), "max_new_tokens": max_new_tokens,
                  "do_sample": False, "temperature": None, "top_p": None, "top_k": None, "pad_token_id": pad}
        if eos:
            kwargs["eos_token_id"] = eos
        if k is not None:
            kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=ngram)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids, **kwargs)  # [1, P + new]
        return out[0, len(ids):].tolist(), time.perf_counter() - start

    rows = []
    warmed: set = set()
    total = len(prompt_sets) * len(variants)
    with tqdm(total=total, desc="peers", unit="run", disable=not progress, file=sys.stderr) as bar:
        for set_name, prompts in prompt_sets.items():
            for name, k in variants:
                bar.set_postfix_str(f"{method_label(name, k)} | {set_name}")
                warmup = 0.0
                if (name, k) not in warmed:
                    warmup = generate(prompts[0], k)[1]
                    warmed.add((name, k))
                token_ids, seconds = [], 0.0
                for ids in prompts:
                    tokens, s = generate(ids, k)
                    token_ids.append(tokens)
                    seconds += s
                new_tokens = sum(len(t) for t in token_ids)
                rows.append({
                    "method": name, "num_draft_tokens": k, "label": method_label(name, k), "prompt_set": set_name,
                    "temperature": 0.0, "batch_size": 1, "num_prompts": len(prompts), "num_batches": len(prompts),
                    "tree_width": None, "new_tokens": new_tokens, "seconds": seconds, "warmup_seconds": warmup,
                    "tokens_per_second": _finite(new_tokens / seconds if seconds > 0 else float("nan")),
                    "speedup": None, "tau": None, "rounds": None, "acceptance_by_position": None,
                    "accepted_length_histogram": None, "matches_autoregressive": None, "mismatched_prompts": [],
                    "token_ids": token_ids, "peer": True,
                })
                bar.update()
    info = {"ran": [method_label(n, k) for n, k in variants], "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "torch_threads": threads, "source": source,
            "dtype": "float32", "batch_size": 1, "temperature": 0.0,
            "speedup": "tokens/s relative to jaxspec autoregressive on the same set at T=0, batch 1"}
    return rows, info
