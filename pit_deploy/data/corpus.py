"""Training text: where it comes from, how it is split, tokenized and packed into blocks.

Sources (``--data``):

* ``default``: the ``*.py`` files of the running interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``), sorted by relative path.
* a local file or directory: ``.txt``/``.md``/``.py`` (one document per file), ``.jsonl``
  (one document per line) and ``.parquet`` (one per row; needs ``pyarrow``).
* anything else is taken as a Hugging Face Hub dataset id (needs ``datasets`` and the
  network), with ``config``/``split`` and optional streaming, e.g.
  ``HuggingFaceFW/fineweb-edu`` with config ``sample-10BT``.

A record is plain text (field ``text``) or an instruction pair (fields ``prompt`` and
``completion``); for pairs only the completion tokens are learned (loss mask).

Train/validation split is deterministic: a document belongs to validation when the sha256 of
its key (relative path, ``path#line`` for multi-record files, the text itself for hub
records) falls below ``val_fraction``. Training order is a seeded permutation per epoch;
validation order is fixed.

Packing: documents are tokenized, each followed by EOS, and concatenated; a block holds
``seq_len + 1`` tokens (inputs ``block[:-1]``, targets ``block[1:]``) and consecutive blocks
overlap by one token, so every token is a target exactly once. Ids are ``int64`` (vocabularies
beyond 65 535 do not fit ``uint16``).

The train stream's position (epoch, cursor, not-yet-used tokens) is a small JSON-able dict:
a resumed run continues from it without re-reading what came before.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import PitError
from ..io.hub import is_hub_id

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
RECORD_SUFFIXES = (".jsonl", ".parquet")


@dataclass
class DataConfig:
    """What ``--data`` and its options say."""

    spec: str = "default"
    seq_len: int = 256
    seed: int = 0
    val_fraction: float = 0.05
    hub_config: str | None = None
    hub_split: str = "train"
    streaming: bool = True
    text_field: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"


@dataclass
class Document:
    """One training document: plain ``text``, or a ``prompt``/``completion`` pair."""

    text: str | None = None
    prompt: str | None = None
    completion: str | None = None


# --------------------------------------------------------------------------------------
# Split
# --------------------------------------------------------------------------------------


def is_validation(key: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of ``sha256(key)`` as a fraction of 2⁶⁴."""
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def record_to_document(record: dict[str, Any], cfg: DataConfig) -> Document | None:
    """A record (dict) as a :class:`Document`, or ``None`` when it holds no usable text."""
    if cfg.prompt_field in record and cfg.completion_field in record:
        prompt, completion = record[cfg.prompt_field], record[cfg.completion_field]
        if isinstance(prompt, str) and isinstance(completion, str) and completion:
            return Document(prompt=prompt, completion=completion)
        return None
    text = record.get(cfg.text_field)
    return Document(text=text) if isinstance(text, str) and text.strip() else None


# --------------------------------------------------------------------------------------
# Local sources: a list of document references, read lazily
# --------------------------------------------------------------------------------------


@dataclass
class _Ref:
    key: str
    path: Path
    doc: Document | None = None  # records of JSONL/Parquet files are held in memory
    strict: bool = True  # user data must be UTF-8 text; the default corpus is read leniently

    def load(self) -> Document | None:
        if self.doc is not None:
            return self.doc
        try:
            raw = self.path.read_bytes()
        except OSError:
            return None
        text = decode_text(raw, self.path) if self.strict else raw.decode("utf-8", errors="replace")
        return Document(text=text) if text.strip() else None


def decode_text(raw: bytes, path: Path) -> str:
    """``raw`` as UTF-8 text, or a clear error: training on replacement characters (a latin-1
    file) or on a binary file read as text would teach the model noise without a word.

    Raises:
        PitError: not UTF-8, or binary (NUL bytes).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PitError(f"{path} is not UTF-8 text (invalid byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                       "convert it, e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`, or remove it from --data") from None
    if "\x00" in text:
        raise PitError(f"{path} looks binary (it holds NUL bytes), not text; remove it from --data")
    return text


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _local_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    suffixes = TEXT_SUFFIXES + RECORD_SUFFIXES
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in suffixes)


def _read_records(path: Path) -> Iterator[dict[str, Any]]:
    if path.suffix.lower() == ".jsonl":
        for lineno, line in enumerate(decode_text(path.read_bytes(), path).split("\n"), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PitError(f"{path}:{lineno} is not valid JSON ({exc.msg}); fix or remove that line") from None
            if not isinstance(record, dict):
                raise PitError(f"{path}:{lineno} is not a JSON object; each line must be one record")
            yield record
    else:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PitError(f"reading {path.name} needs pyarrow: pip install pyarrow") from None
        yield from pq.read_table(path).to_pylist()


def local_refs(spec: str, cfg: DataConfig) -> tuple[list[_Ref], list[_Ref]]:
    """``(train, validation)`` document references of ``default`` or a local path."""
    if spec == "default":
        root = stdlib_root()
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    else:
        root = Path(spec).expanduser()
        files = _local_files(root)
    base = root if root.is_dir() else root.parent
    train: list[_Ref] = []
    val: list[_Ref] = []
    for path in files:
        rel = path.relative_to(base).as_posix()
        if path.suffix.lower() in RECORD_SUFFIXES:
            for i, record in enumerate(_read_records(path)):
                doc = record_to_document(record, cfg)
                if doc is not None:
                    key = f"{rel}#{i}"
                    (val if is_validation(key, cfg.val_fraction) else train).append(_Ref(key, path, doc))
        else:
            ref = _Ref(rel, path, strict=spec != "default")
            if ref.load() is not None:  # skip empty files (read once here, lazily later)
                (val if is_validation(rel, cfg.val_fraction) else train).append(ref)
    if not train and not val:
        raise PitError(
            f"--data {spec}: found no text (looked for {', '.join(TEXT_SUFFIXES + RECORD_SUFFIXES)} "
            f"files with a {cfg.text_field!r} or {cfg.prompt_field!r}/{cfg.completion_field!r} field)"
        )
    return train, val


# --------------------------------------------------------------------------------------
# Tokenize and pack
# --------------------------------------------------------------------------------------


def encode(doc: Document, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids of ``doc`` followed by EOS, and a mask of which ids are learned (1)."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if doc.text is not None:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"] + eos
        return ids, [1] * len(ids)
    p = tokenizer(doc.prompt, add_special_tokens=False)["input_ids"]
    c = tokenizer(doc.completion, add_special_tokens=False)["input_ids"] + eos
    return p + c, [0] * len(p) + [1] * len(c)


@dataclass
class Block:
    """``ids`` ``(B, L+1)`` int64 and ``mask`` ``(B, L+1)`` float (1 where a token is learned)."""

    ids: torch.Tensor
    mask: torch.Tensor

    @property
    def inputs(self) -> torch.Tensor:
        return self.ids[:, :-1]

    @property
    def targets(self) -> torch.Tensor:
        return self.ids[:, 1:]

    @property
    def target_mask(self) -> torch.Tensor:
        return self.mask[:, 1:]


def block_lead(tokenizer) -> int | None:
    """The id every block starts with: the tokenizer's BOS when it puts one before every text it
    encodes (Gemma, Llama 3), so that blocks cut from the middle of packed documents look to
    the model as its pretraining did (a Gemma model without its BOS is far from itself at every
    position); ``None`` for a tokenizer that adds none (GPT-2 style, SmolLM2)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    probe = tokenizer("a")["input_ids"]
    return bos if probe and probe[0] == bos else None


class _Packer:
    """Concatenates encoded documents and cuts ``seq_len + 1`` blocks overlapping by one; with a
    ``lead`` id, blocks of ``lead`` and the next ``seq_len`` ids, which do not overlap (the lead,
    never a target, takes the place of the previous block's last id)."""

    def __init__(self, seq_len: int, ids: list[int] | None = None, mask: list[int] | None = None,
                 lead: int | None = None):
        self.seq_len = seq_len
        self.ids = list(ids or [])
        self.mask = list(mask or [])
        self.lead = lead

    def add(self, ids: list[int], mask: list[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend(mask)

    def ready(self) -> bool:
        return len(self.ids) >= self.seq_len + (self.lead is None)

    def pop(self) -> tuple[list[int], list[int]]:
        if self.lead is not None:
            n = self.seq_len
            ids, mask = [self.lead] + self.ids[:n], [0] + self.mask[:n]
            del self.ids[:n]
            del self.mask[:n]
            return ids, mask
        n = self.seq_len + 1
        ids, mask = self.ids[:n], self.mask[:n]
        del self.ids[: n - 1]
        del self.mask[: n - 1]
        return ids, mask


# --------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------


class TrainStream:
    """Endless, resumable stream of training blocks (epochs of a seeded document order).

    ``state_dict()`` / ``load_state_dict()`` save and restore the exact position.
    """

    def __init__(self, source: "TextSource", tokenizer, cfg: DataConfig):
        self.source = source
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.epoch = 0
        self.cursor = 0  # documents of this epoch consumed (local) or hub state
        self.hub_state: dict | None = None
        self.packer = _Packer(cfg.seq_len, lead=block_lead(tokenizer))
        self._docs: Iterator[Document] | None = None
        self._epoch_had_tokens = False

    # -- position -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "hub_state": self.source.hub_state() if self.source.is_hub else None,
            "buffer_ids": list(self.packer.ids),
            "buffer_mask": list(self.packer.mask),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.hub_state = state.get("hub_state")
        self.packer = _Packer(self.cfg.seq_len, state["buffer_ids"], state["buffer_mask"],
                              lead=self.packer.lead)
        self._docs = None
        self._epoch_had_tokens = True

    # -- blocks ---------------------------------------------------------------------------
    def _next_document(self) -> Document:
        while True:
            if self._docs is None:
                self._docs = self.source.train_documents(self.epoch, self.cursor, self.hub_state)
                self.hub_state = None
            try:
                doc = next(self._docs)
                self.cursor += 1
                return doc
            except StopIteration:
                if not self._epoch_had_tokens:
                    raise PitError(
                        f"--data {self.cfg.spec}: the training split yields no text; pass more "
                        "data or lower --val-fraction"
                    ) from None
                self.epoch += 1
                self.cursor = 0
                self._docs = None
                self._epoch_had_tokens = False

    def next_block(self) -> tuple[list[int], list[int]]:
        while not self.packer.ready():
            ids, mask = encode(self._next_document(), self.tokenizer)
            if ids:
                self._epoch_had_tokens = True
            self.packer.add(ids, mask)
        return self.packer.pop()

    def next_batch(self, n: int) -> Block:
        """The next ``n`` blocks as one :class:`Block` ``(n, seq_len+1)``."""
        rows = [self.next_block() for _ in range(n)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.int64)
        mask = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        return Block(ids, mask)


class TextSource:
    """Documents of ``--data``: local (``default``, files, directories) or a hub dataset."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        spec = cfg.spec
        self.is_hub = not (spec == "default" or Path(spec).expanduser().exists())
        self._hub_iter = None
        if self.is_hub:
            if not is_hub_id(spec):
                raise PitError(f"--data {spec}: no such file or directory (and not a hub dataset id "
                               "like 'org/name')")
            self.train_refs: list[_Ref] = []
            self.val_refs: list[_Ref] = []
        else:
            self.train_refs, self.val_refs = local_refs(spec, cfg)

    # -- local ----------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(int(self.cfg.seed) * 1_000_003 + epoch)
        return torch.randperm(len(self.train_refs), generator=g).tolist()

    def train_documents(self, epoch: int, cursor: int, hub_state: dict | None) -> Iterator[Document]:
        """Training documents of ``epoch`` from position ``cursor`` on."""
        if self.is_hub:
            yield from self._hub_documents(train=True, epoch=epoch, state=hub_state)
            return
        for i in self._order(epoch)[cursor:]:
            doc = self.train_refs[i].load()
            if doc is not None:
                yield doc
            else:
                yield Document(text="")  # keep the cursor aligned with the order

    def val_documents(self) -> Iterator[Document]:
        if self.is_hub:
            yield from self._hub_documents(train=False, epoch=0, state=None)
            return
        for ref in self.val_refs:
            doc = ref.load()
            if doc is not None:
                yield doc

    # -- hub ------------------------------------------------------------------------------
    def _hub_dataset(self, train: bool):
        try:
            import datasets
        except ImportError:
            raise PitError(
                f"--data {self.cfg.spec} looks like a Hugging Face Hub dataset; that needs the "
                "package `datasets` (pip install datasets) and the network"
            ) from None
        cfg = self.cfg
        try:
            ds = datasets.load_dataset(
                cfg.spec, cfg.hub_config, split=cfg.hub_split, streaming=cfg.streaming
            )
        except Exception as exc:  # datasets raises many kinds for a bad id/config/network
            raise PitError(
                f"cannot open hub dataset {cfg.spec!r} (config {cfg.hub_config!r}, split "
                f"{cfg.hub_split!r}): {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            ) from None
        frac = cfg.val_fraction

        def keep(example: dict) -> bool:
            doc = record_to_document(example, cfg)
            if doc is None:
                return False
            key = doc.text if doc.text is not None else doc.prompt + "\x00" + doc.completion
            return is_validation(key, frac) != train

        ds = ds.filter(keep)
        if train:
            if cfg.streaming:
                ds = ds.shuffle(seed=cfg.seed, buffer_size=10_000)
            else:
                ds = ds.shuffle(seed=cfg.seed)
                ds = ds.to_iterable_dataset()
        return ds

    def _hub_documents(self, train: bool, epoch: int, state: dict | None) -> Iterator[Document]:
        ds = self._hub_dataset(train)
        if train:
            ds.set_epoch(epoch)
            if state is not None:
                ds.load_state_dict(state)
            self._hub_iter = ds
        for example in ds:
            doc = record_to_document(example, self.cfg)
            if doc is not None:
                yield doc

    def hub_state(self) -> dict | None:
        """Position of the hub stream (``datasets`` ≥ 2.18 ``IterableDataset.state_dict``)."""
        return self._hub_iter.state_dict() if self._hub_iter is not None else None


def validation_blocks(source: TextSource, tokenizer, cfg: DataConfig, n_blocks: int) -> Block | None:
    """The first ``n_blocks`` packed blocks of the validation split (fixed order), or ``None``
    when the split holds no text."""
    packer = _Packer(cfg.seq_len, lead=block_lead(tokenizer))
    rows: list[tuple[list[int], list[int]]] = []
    for doc in source.val_documents():
        packer.add(*encode(doc, tokenizer))
        while packer.ready() and len(rows) < n_blocks:
            rows.append(packer.pop())
        if len(rows) >= n_blocks:
            break
    if not rows:
        return None
    ids = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    mask = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    return Block(ids, mask)


__all__ = [
    "DataConfig",
    "Document",
    "Block",
    "TextSource",
    "TrainStream",
    "validation_blocks",
    "block_lead",
    "is_validation",
    "encode",
    "stdlib_root",
]
