"""jaxspec.gguf_file.GGUFFile reads what gguf.GGUFReader (the gguf package's reader) reads: every metadata value and
every tensor's type, shape and bytes, on a file written by gguf.GGUFWriter with every kind of value and on the real
SmolLM2 file; and a damaged file is an error, not garbage."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from jaxspec.gguf_file import GGUFFile


def _reference(path) -> tuple[dict, list]:
    reader = gguf.GGUFReader(path, "r")
    meta = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return meta, reader.tensors


def _assert_same(path):
    meta, tensors = _reference(path)
    ours = GGUFFile(path)
    assert ours.metadata == meta
    assert [t.name for t in ours.tensors] == [t.name for t in tensors]
    for mine, theirs in zip(ours.tensors, tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in theirs.shape), mine.name
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape, mine.name
        np.testing.assert_array_equal(mine.data, theirs.data, err_msg=mine.name)
    return ours


def _write(path, alignment: int | None = None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 65000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁world")
    writer.add_array("t.ints", [3, -1, 7])
    writer.add_array("t.floats", [0.5, 1.5])
    writer.add_array("t.strs", ["a", "", "ü", "▁the"])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 2, 3)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
    ours = _assert_same(_write(tmp_path / "all.gguf", alignment))
    assert ours.get("t.strs") == ["a", "", "ü", "▁the"] and ours.get("t.u64") == 2**63 + 5
    assert ours.get("missing", "default") == "default"
    q8 = next(t for t in ours.tensors if t.name == "q8")
    assert gguf.quants.dequantize(q8.data, q8.tensor_type).shape == (2, 64)


def test_the_smollm2_file_reads_as_the_gguf_package_reads_it(smollm2):
    ours = _assert_same(smollm2.source)
    assert len(ours.get("tokenizer.ggml.tokens")) == smollm2.config.vocab_size


@pytest.mark.parametrize("damage", ["magic", "version", "header", "tensor data"])
def test_a_damaged_file_is_an_error(tmp_path, damage):
    data = bytearray(_write(tmp_path / "ok.gguf").read_bytes())
    if damage == "magic":
        data[:4] = b"GGML"
    elif damage == "version":
        data[4:8] = (7).to_bytes(4, "little")
    elif damage == "header":
        data = data[:60]
    else:
        data = data[:-40]  # the last tensor runs past the end
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    message = {"magic": "not a GGUF file", "version": "version 7", "header": "truncated",
               "tensor data": "'q8' runs past the end"}[damage]
    with pytest.raises(ValueError, match=message):
        GGUFFile(path)


def _part_packages(root, prefix, chunks):
    """Fake part packages as the Qwen2.5-Coder ones are built: module `{prefix}{i}` with `get_part_path()`."""
    for i, chunk in enumerate(chunks, start=1):
        package = root / f"{prefix}{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / "part.bin").write_bytes(chunk)
        (package / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            "    return os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'part.bin')\n")


def test_a_model_split_over_part_packages_is_joined_once_in_order(tmp_path, monkeypatch):
    from jaxspec import loading
    from jaxspec.errors import UserError

    chunks = [bytes([i]) * (1000 + 7 * i) for i in range(1, 4)]
    _part_packages(tmp_path / "site", "fakepart_", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("JAXSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setitem(loading.KNOWN_MODELS, "fake-model", (
        ("fakepart_1", "fakepart_2", "fakepart_3"), "fake.gguf", "pip install fake-parts"))
    path = loading.resolve_model_path("fake-model")
    assert open(path, "rb").read() == b"".join(chunks)
    assert path.startswith(str(tmp_path / "cache"))
    first_write = os.stat(path).st_mtime_ns
    assert loading.resolve_model_path("fake-model") == path  # reused, not joined again
    assert os.stat(path).st_mtime_ns == first_write

    # a joined file of the wrong size (an earlier, different set of parts) is joined again
    open(path, "ab").write(b"x")
    assert open(loading.resolve_model_path("fake-model"), "rb").read() == b"".join(chunks)

    # a missing part names the package and the install command
    monkeypatch.setitem(loading.KNOWN_MODELS, "fake-model", (
        ("fakepart_1", "fakepart_9"), "fake2.gguf", "pip install fake-parts"))
    with pytest.raises(UserError, match="fakepart_9.*pip install fake-parts"):
        loading.resolve_model_path("fake-model")
