"""``manifest.json`` of an export directory: what was exported, from what, and its digests.

Layout of an export directory::

    manifest.json                     this file (written last: its presence means "complete")
    reference/                        the PIT checkpoint the artifacts were made from
    <target>-<mode>[-<scheme>]/...    one folder per artifact (e.g. onnx-factorized/model.onnx,
                                      onnx-factorized-int4-compact/model.onnx)

The manifest records, per artifact: target, mode, dtype, quantization scheme, shapes, files with
their sha256 and size, export time; globally: the source model's description and digest, the sha256 of the
reference weights, library versions, and — after ``pit-deploy verify`` — the verification
results. Updates (verification results) are written to a temporary file and renamed over the
old one (``os.replace`` is atomic on POSIX and Windows).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from ..errors import PitError
from ..targets.base import plain_relative  # noqa: F401 — the manifest's rule for every path, kept importable here
from .fs import confined, json_text, sha256_file, write_json_atomic

MANIFEST_NAME = "manifest.json"
REFERENCE_DIR = "reference"
FORMAT = "pit-deploy-export"
FORMAT_VERSION = 1
_LIBRARIES = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime", "executorch", "pit-deploy")


def library_versions() -> dict[str, str | None]:
    """Installed versions of the libraries that shape an artifact."""
    out: dict[str, str | None] = {}
    for name in _LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def artifact_key(target: str, mode: str, scheme: str = "float32") -> str:
    """An artifact's name (and folder): ``onnx-factorized`` for fp32, ``onnx-factorized-int4``
    for the int4 scheme, ``onnx-factorized-int4-compact`` for another int4 scheme."""
    return f"{target}-{mode}" if scheme == "float32" else f"{target}-{mode}-{scheme}"


def file_table(root: Path, folder: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {sha256, bytes}}`` of every file under ``folder`` (sorted)."""
    table = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        table[path.relative_to(root).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    return table


@dataclass
class Artifact:
    """One exported artifact (a target × mode × scheme)."""

    #: the target's name (``onnx``, ``executorch``, …); manifests written before this field was
    #: named so call it ``runtime``, which :meth:`Manifest.read` accepts
    target: str
    mode: str
    dtype: str
    path: str  #: folder relative to the export directory
    files: dict[str, dict[str, Any]]
    shapes: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    export_seconds: float = 0.0
    tying: str = "pit"  #: ``pit``, or ``tied`` for a transpose-tied baseline (``export --keep-tying``)
    #: the quantization scheme (``pit_deploy/schemes.py``); empty in manifests written before
    #: schemes, whose scheme is their dtype
    scheme: str = ""

    @property
    def runtime(self) -> str:
        """The older name of :attr:`target`."""
        return self.target

    @property
    def scheme_name(self) -> str:
        return self.scheme or self.dtype

    @property
    def rounding(self) -> str:
        """How the artifact's body was rounded (``rtn`` for manifests that do not say)."""
        return str(((self.details or {}).get("scheme") or {}).get("rounding", "rtn"))

    @property
    def key(self) -> str:
        return artifact_key(self.target, self.mode, self.scheme_name)

    @property
    def quantized(self) -> bool:
        return self.dtype != "float32"

    @property
    def bytes(self) -> int:
        return sum(f["bytes"] for f in self.files.values())


@dataclass
class Manifest:
    """The whole ``manifest.json``."""

    source: dict[str, Any]
    reference: dict[str, Any]
    artifacts: list[Artifact]
    versions: dict[str, str | None]
    recipe: dict[str, Any] = field(default_factory=dict)
    verification: dict[str, Any] | None = None
    #: quantized parity's held-out token ids (``{"source": ..., "blocks": [[id, ...], ...]}``)
    heldout: dict[str, Any] | None = None
    format: str = FORMAT
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write(self, directory: Path) -> Path:
        """Write atomically to ``directory/manifest.json``."""
        return write_json_atomic(directory / MANIFEST_NAME, self.to_dict())

    @classmethod
    def read(cls, directory: str | os.PathLike) -> "Manifest":
        """Read and validate ``directory/manifest.json``.

        Raises:
            PitError: no such directory, no manifest (not an export or an interrupted one),
                a file that is not JSON text, an unknown format, a path that is not plain and
                relative, or two artifacts with one key or folder.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise PitError(f"{directory} is not a directory; pass an export directory written by `pit-deploy export`")
        path = directory / MANIFEST_NAME
        if not path.is_file():
            raise PitError(
                f"{directory} has no {MANIFEST_NAME}: it is not an export directory (or the export "
                "did not finish); run `pit-deploy export MODEL --out DIR` first"
            )
        data = read_manifest_json(path)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PitError(f"{path} is not a pit-deploy export manifest (format {found!r})")
        if data.get("format_version") != FORMAT_VERSION:
            raise PitError(
                f"{path} has format_version {data.get('format_version')}, this pit-deploy reads "
                f"{FORMAT_VERSION}; re-export with this version"
            )
        _validate(path, data)
        try:
            arts = [Artifact(**a) for a in data.pop("artifacts")]
            manifest = cls(artifacts=arts, **data)
        except TypeError as exc:
            raise PitError(f"{path} is malformed ({exc}); re-run the export") from None
        for art in manifest.artifacts:
            confined(directory, art.path, f"{path}: artifact {art.key} path")
        for rel in manifest.all_files():
            confined(directory, rel, f"{path}: file")
        return manifest

    def all_files(self) -> list[str]:
        """Every file path the manifest records (reference and artifacts), relative."""
        files = list((self.reference or {}).get("files", {}))
        for art in self.artifacts:
            files += list(art.files)
        return files

    def artifact(self, target: str, mode: str, scheme: str = "float32") -> Artifact | None:
        """The artifact of ``target``, ``mode`` and ``scheme`` (a dtype names its own scheme)."""
        for art in self.artifacts:
            if art.key == artifact_key(target, mode, scheme):
                return art
        return None


_ARTIFACT_TYPES = {"target": str, "mode": str, "dtype": str, "path": str, "files": dict, "shapes": dict}


def read_manifest_json(path: Path) -> Any:
    """The parsed JSON of the manifest file ``path``.

    Raises:
        PitError: the file cannot be read, is not UTF-8 text (a binary file) or not JSON.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise PitError(f"{path} is not text (not UTF-8: a binary or corrupted file); re-run the export") from None
    except json.JSONDecodeError as exc:
        raise PitError(f"{path} is not valid JSON ({exc}); re-run the export") from None


def pin_sha256(directory: str | os.PathLike) -> str:
    """The sha256 that ``verify --expect-sha256`` pins: of ``manifest.json`` without the results
    ``verify`` records (its ``verification`` set to ``null``), serialized as pit-deploy writes it.
    Recording results therefore keeps a pin valid, and on a fresh export it is the file's own
    sha256 (``sha256sum manifest.json``).

    Raises:
        PitError: the manifest cannot be read as JSON.
    """
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return "missing"
    data = read_manifest_json(path)
    if isinstance(data, dict):
        data["verification"] = None
    return hashlib.sha256((json_text(data, indent=2) + "\n").encode("utf-8")).hexdigest()


def _check_path(path: Path, where: str, rel: Any) -> None:
    if not plain_relative(rel):
        raise PitError(f"{path}: {where} {rel!r} is not a plain relative path (no '..', '.', empty or absolute "
                       "part); the manifest was edited or tampered — re-export")


def _validate(path: Path, data: dict[str, Any]) -> None:
    """Name the key of a manifest that is missing or of the wrong type (exit 2, not a traceback)."""
    from ..targets import target_names

    for key, kind in (("artifacts", list), ("reference", dict), ("source", dict)):
        if key not in data:
            raise PitError(f"{path}: missing key {key!r}; the manifest is incomplete or tampered — re-export")
        if not isinstance(data[key], kind):
            raise PitError(f"{path}: {key!r} must be a {kind.__name__}, got {type(data[key]).__name__}")
    for i, art in enumerate(data["artifacts"]):
        if not isinstance(art, dict):
            raise PitError(f"{path}: artifacts[{i}] must be an object")
        _older_target_key(path, i, art)
        for key, kind in _ARTIFACT_TYPES.items():
            if key not in art:
                raise PitError(f"{path}: artifacts[{i}] has no {key!r}; the manifest is incomplete or tampered")
            if not isinstance(art[key], kind):
                raise PitError(f"{path}: artifacts[{i}].{key} must be a {kind.__name__}, got {type(art[key]).__name__}")
        if art["target"] not in target_names():
            raise PitError(f"{path}: artifacts[{i}].target {art['target']!r} is not a target this pit-deploy "
                           f"knows ({', '.join(target_names())})")
        _check_path(path, f"artifacts[{i}].path", art["path"])
        for rel, info in art["files"].items():
            _check_path(path, f"artifacts[{i}].files key", rel)
            if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
                raise PitError(f"{path}: artifacts[{i}].files[{rel!r}] needs a sha256 string")
        _check_scheme(path, i, art)
    ref_files = data["reference"].get("files", {})
    if not isinstance(ref_files, dict):
        raise PitError(f"{path}: reference.files must be a dict, got {type(ref_files).__name__}")
    for rel, info in ref_files.items():
        _check_path(path, "reference.files key", rel)
        if not isinstance(info, dict) or not isinstance(info.get("sha256"), str):
            raise PitError(f"{path}: reference.files[{rel!r}] needs a sha256 string")
    _check_unique(path, data["artifacts"])


def _older_target_key(path: Path, i: int, art: dict[str, Any]) -> None:
    """Read an artifact written before its target was recorded as ``target``: its ``runtime`` key
    is the same value under the older name (moved in place). One artifact with both keys must
    agree."""
    if "runtime" not in art:
        return
    older = art.pop("runtime")
    if "target" in art and art["target"] != older:
        raise PitError(f"{path}: artifacts[{i}] names two targets, target {art['target']!r} and runtime {older!r}; "
                       "the manifest was edited or tampered — re-export")
    art["target"] = older


def _check_scheme(path: Path, i: int, art: dict[str, Any]) -> None:
    """Refuse an artifact whose scheme the manifest records inconsistently. The scheme picks the
    bounds ``verify`` judges the artifact by (int8's scaled KL factor is 10, int4's 4), so it must
    agree with everything else that records it: ``scheme`` names a known scheme whose dtype is
    the artifact's ``dtype``; ``details.scheme`` (the settings the export recorded) carries the
    same ``name`` and ``dtype``; and an artifact that carries what only GPTQ rounding records
    (``details.calibration``, ``details.weight_codes``) says ``rounding: gptq`` (its own, tighter
    bounds). Editing one of them alone is a tampered manifest (exit 2), not another scheme."""
    from ..schemes import registered
    from .weight_codes import CODES_FIELD

    where = f"{path}: artifacts[{i}]"
    tampered = "the manifest was edited or tampered — re-export"
    scheme, dtype = art.get("scheme", ""), art["dtype"]
    if not isinstance(scheme, str):
        raise PitError(f"{where}.scheme must be a str, got {type(scheme).__name__}")
    name = scheme or dtype
    known = registered().get(name)
    if known is not None and known.dtype != dtype:
        raise PitError(f"{where}: scheme {name!r} stores {known.dtype} weights, but the artifact's dtype is "
                       f"{dtype!r}; {tampered}")
    details = art.get("details")
    settings = details.get("scheme") if isinstance(details, dict) else None
    if settings is None:
        return
    if not isinstance(settings, dict):
        raise PitError(f"{where}.details.scheme must be an object, got {type(settings).__name__}; {tampered}")
    for key, want in (("name", name), ("dtype", dtype)):
        if key in settings and settings[key] != want:
            raise PitError(f"{where}.details.scheme.{key} is {settings[key]!r}, the artifact's "
                           f"{'scheme' if key == 'name' else 'dtype'} {want!r}; {tampered}")
    calibrated = [key for key in ("calibration", CODES_FIELD) if key in details]
    if calibrated and settings.get("rounding") != "gptq":
        raise PitError(f"{where}.details.scheme.rounding is {settings.get('rounding')!r}, but the artifact records "
                       f"GPTQ rounding (details.{calibrated[0]}); {tampered}")


def _check_unique(path: Path, artifacts: list[dict[str, Any]]) -> None:
    """Two artifacts with one key (target, mode, scheme) or one folder are ambiguous: which of
    them a verification result, a benchmark row or a bundle folder belongs to is undecidable."""
    keys: dict[str, int] = {}
    folders: dict[str, int] = {}
    for i, art in enumerate(artifacts):
        key = artifact_key(art["target"], art["mode"], art.get("scheme") or art["dtype"])
        for seen, value, what in ((keys, key, "key"), (folders, art["path"], "path")):
            if value in seen:
                raise PitError(f"{path}: artifacts[{seen[value]}] and artifacts[{i}] have the same {what} "
                               f"{value!r}; an artifact appears once — the manifest was edited or tampered, re-export")
            seen[value] = i


def check_digests(directory: Path, manifest: Manifest) -> list[str]:
    """Compare every recorded sha256 with the files on disk.

    Returns:
        one message per problem (missing file, digest mismatch); empty when all match.
    """
    problems = []
    tables = [("reference", manifest.reference.get("files", {}))] + [
        (art.key, art.files) for art in manifest.artifacts
    ]
    for owner, files in tables:
        for rel, info in files.items():
            path = confined(directory, rel, "manifest file")
            if not path.is_file():
                problems.append(f"{rel} ({owner}) is missing")
                continue
            actual = sha256_file(path)
            if actual != info["sha256"]:
                problems.append(
                    f"{rel} ({owner}) has sha256 {actual[:16]}…, the manifest records "
                    f"{info['sha256'][:16]}… — the file was modified or corrupted"
                )
    return problems
