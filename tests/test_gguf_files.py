"""GGUF files read once: the header scan agrees with gguf-py's full reader and refuses broken
files, and the converted-model cache is built once, reused, rebuilt when tampered with, and
skipped (with the GGUF read directly) when it is off or cannot be written."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from pit_deploy.io.gguf_files import CACHE_ENV, CACHE_META, GGUFFormatError, converted_gguf, gguf_tensor_names


def _write_gguf(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF file with metadata of every shape the scan must skip: strings, a string array
    (as a tokenizer's), numeric arrays, scalars."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_string("general.name", "scan me")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_token_list(["<s>", "</s>", "héllo", "wörld", ""] * 50)
    writer.add_token_scores([0.5] * 250)
    writer.add_array("tokenizer.ggml.merges", ["h e", "l l", "o w"])
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_scan_lists_the_tensors_the_full_reader_sees(tmp_path: Path) -> None:
    tensors = {"token_embd.weight": np.ones((8, 4), np.float32), "blk.0.attn_q.weight": np.ones((4, 4), np.float32),
               "output_norm.weight": np.ones(4, np.float32)}
    path = _write_gguf(tmp_path / "m.gguf", tensors)
    assert gguf_tensor_names(path) == [t.name for t in gguf.GGUFReader(str(path)).tensors] == list(tensors)
    assert gguf_tensor_names(_write_gguf(tmp_path / "empty.gguf", {})) == []


@pytest.mark.parametrize("damage", ["magic", "version", "truncated"])
def test_header_scan_refuses_broken_files(tmp_path: Path, damage: str) -> None:
    path = _write_gguf(tmp_path / "m.gguf", {"token_embd.weight": np.ones((8, 4), np.float32)})
    data = bytearray(path.read_bytes())
    if damage == "magic":
        data[:4] = b"GGUX"
    elif damage == "version":
        data[4:8] = (1).to_bytes(4, "little")
    else:
        data = data[:200]
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFFormatError):
        gguf_tensor_names(path)


def _builder(calls: list[Path]):
    def build(out: Path) -> None:
        calls.append(out)
        (out / "config.json").write_text(json.dumps({"n": len(calls)}))
        (out / "model.safetensors").write_bytes(b"weights")
    return build


def test_cache_is_built_once_then_reused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    first = converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls))
    again = converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls))
    assert first == again and len(calls) == 1
    meta = json.loads((first / CACHE_META).read_text())
    assert meta["gguf_sha256"] == "ab" * 32 and set(meta["files"]) == {"config.json", "model.safetensors"}
    other = converted_gguf(tmp_path / "m.gguf", "cd" * 32, _builder(calls))
    assert other != first and len(calls) == 2, "another file's digest is another entry"
    assert not [p for p in first.parent.iterdir() if ".partial" in p.name]


def test_an_entry_completed_meanwhile_by_another_process_is_kept(tmp_path: Path, monkeypatch) -> None:
    """Two commands converting the same file at once (two test workers, two terminals): the one
    that finishes second keeps the first one's entry, which that process may be reading, and
    discards its own."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    inner = _builder(calls)

    def racing(out: Path) -> None:
        # while this build runs, "another process" completes the entry
        assert converted_gguf(tmp_path / "m.gguf", "ab" * 32, inner) is not None
        inner(out)

    folder = converted_gguf(tmp_path / "m.gguf", "ab" * 32, racing)
    first_inode = (folder / "config.json").stat().st_ino
    assert len(calls) == 2 and json.loads((folder / "config.json").read_text()) == {"n": 1}, "the first entry stays"
    assert converted_gguf(tmp_path / "m.gguf", "ab" * 32, inner) == folder and len(calls) == 2
    assert (folder / "config.json").stat().st_ino == first_inode
    assert not [p for p in folder.parent.iterdir() if p.name != folder.name], "no partial or old copy left"


def test_tampered_or_incomplete_entry_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    calls: list[Path] = []
    folder = converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls))
    (folder / "model.safetensors").write_bytes(b"tampered")
    assert converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls)) == folder
    assert len(calls) == 2 and (folder / "model.safetensors").read_bytes() == b"weights"
    (folder / CACHE_META).unlink()  # as after a crash between writing files and the record
    converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls))
    assert len(calls) == 3


def test_failed_build_leaves_no_entry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    def broken(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        converted_gguf(tmp_path / "m.gguf", "ab" * 32, broken)
    assert not any((tmp_path / "cache" / "gguf").iterdir())


def test_cache_off_or_unwritable_falls_back_to_the_file(tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setenv(CACHE_ENV, "off")
    assert converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls)) is None and not calls
    blocker = tmp_path / "a-file"
    blocker.write_text("the cache cannot be a directory under a file")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    assert converted_gguf(tmp_path / "m.gguf", "ab" * 32, _builder(calls)) is None and not calls


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "F16", "BF16"])
def test_quantizing_and_dequantizing_by_rows_is_one_call_on_the_whole(kind: str, monkeypatch) -> None:
    """gguf-py's rounding works row by row: a table done a few rows at a time (here 7 of 30) has
    the bytes and the values of one call on the whole, the last short part included."""
    from gguf.quants import dequantize, quantize

    from pit_deploy.io import gguf_files

    monkeypatch.setattr(gguf_files, "GGML_ROWS", 7)
    qtype = gguf.GGMLQuantizationType[kind]
    array = np.random.default_rng(0).standard_normal((30, 256)).astype(np.float32)
    codes = gguf_files.quantize_by_rows(array, qtype)
    whole = quantize(array, qtype)
    assert codes.dtype == whole.dtype and np.array_equal(codes, whole)
    values = gguf_files.dequantize_by_rows(codes, qtype, 256)
    assert values.dtype == np.float32 and np.array_equal(values, np.asarray(dequantize(whole, qtype), np.float32))
