"""What a deployment target is: the one object generic code asks about a runtime.

A target bundles everything that differs between the runtimes people deploy with: how an
artifact is exported and laid out, how its manifest describes its shapes, which driver runs it
in this package, which standalone decoder runs it on a device without this package, which
distribution must be installed, and the checks and benchmark cells that only it has (ONNX's
shared-weight check, ExecuTorch's stock LLM runner, the phone path). Generic code — the export
pipeline, ``verify``, ``bench``, the manifest reader, the run report — never compares a runtime
name; it calls the target's methods, whose defaults here describe a target with no extras.

This module is standard library only: manifests are read on devices, and listing targets must
not import torch or a runtime. Heavy parts are named as ``"module:attribute"`` and imported on
first use.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import PitError


def resolve(ref: str) -> Any:
    """The attribute named by ``"module:attribute"`` (imported on first use)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def plain_relative(rel: Any) -> bool:
    """Whether ``rel`` is a plain relative path: a non-empty string of ``/``-separated names,
    none empty, ``.`` or ``..``, no backslash, no drive or leading ``/``. Manifest paths must
    be (a ``..`` that goes out and back in still names another place, and becomes a ``../``
    member name in a bundle). Every path a manifest or an artifact's own config names must be."""
    if not isinstance(rel, str) or not rel or "\\" in rel or rel.startswith("/") or ":" in rel.split("/")[0]:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))


@dataclass(frozen=True)
class WeightGrid:
    """How a target's exporter rounds the weights of one artifact, as far as the *expected*
    quantization error measured at export reproduces it in PyTorch
    (:mod:`pit_deploy.exporters.expected_error`). The bits of the body linears, the group size and
    the linears kept at 8 bits come from the scheme; what differs between targets is here.

    Attributes:
        symmetric: symmetric codes with one scale a group (XNNPACK), or asymmetric codes with an
            integer zero point (onnxruntime's ``MatMulNBits``).
        per_channel_8bit: 8-bit *linears* (body, and a quantized head) take one scale per output
            channel instead of one per group.
        head_bits: bits of the table the head reads; 0 keeps it float32.
        embed_bits: bits of the table the embedding gathers; 0 keeps it float32.
        conv1d: whether GPT-2's ``Conv1D`` linears are quantized too (or kept float32).
        full_range: symmetric codes scaled so that ``max|w|`` reaches ``2^(b−1)`` (onnxruntime's
            symmetric ``MatMulNBits`` blocks, which the onnxruntime-genai builder writes) instead
            of ``2^(b−1) − 1`` (XNNPACK).
        table_symmetric: how the token tables are rounded where it differs from the body
            (``None``: as the body).
    """

    symmetric: bool
    per_channel_8bit: bool
    head_bits: int
    embed_bits: int
    conv1d: bool = True
    full_range: bool = False
    table_symmetric: bool | None = None

    @property
    def tables_symmetric(self) -> bool:
        """How the token tables are rounded (``table_symmetric``, or as the body)."""
        return self.symmetric if self.table_symmetric is None else self.table_symmetric


@dataclass(frozen=True)
class EmulatedEngine:
    """The aarch64 build of a runtime that ``verify --isa aarch64`` runs under user-mode emulation
    (:mod:`pit_deploy.runtime.emulated`): the runner that drives it inside the emulated Python,
    what of the set-up it needs beyond the shared arm64 Python and wheels, and how it is named.
    A target declares the engine that runs its artifacts (:attr:`Target.aarch64_engine`).

    Attributes:
        key: names its emulated processes and groups the artifacts one process runs.
        title: how messages name it (``"onnxruntime"``, ``"the ExecuTorch runtime"``).
        runner: the module whose file runs in the emulated Python (it imports nothing of this
            package; it is copied into the job folder beside :mod:`pit_deploy.runtime.standalone`).
        describe: the versions line of a result, formatted with the set-up's ``setup.json``.
        site: the ``setup.json`` key of a folder of wheels it needs ahead of the shared ones.
        library_path: the ``setup.json`` key of a folder its native libraries load from.
        armv8_0: whether it runs on the ARMv8.0 CPU profiles
            (:data:`pit_deploy.runtime.emulated.ARMV8_0_CPUS`).
        kleidiai: whether ``--kleidiai on|off`` is a setting of its sessions.
        slow: its processes run longest and are started first.
    """

    key: str
    title: str
    runner: str
    describe: str
    site: str | None = None
    library_path: str | None = None
    armv8_0: bool = True
    kleidiai: bool = False
    slow: bool = False


#: onnxruntime's aarch64 wheel, which runs both ONNX targets' graphs
#: (:mod:`pit_deploy.runtime.emulated_runner`; MLAS picks its kernels by the emulated CPU's features)
ONNXRUNTIME_AARCH64 = EmulatedEngine(
    key="onnxruntime", title="onnxruntime", runner="pit_deploy.runtime.emulated_runner",
    describe="qemu {qemu_version}, onnxruntime {onnxruntime} (aarch64), numpy {numpy}", kleidiai=True)


@dataclass
class VerifyContext:
    """What a target's extra verification needs besides the artifact: the export directory,
    the PyTorch reference and its tokenizer, the verification prompts, and a cache shared by
    every artifact of one ``verify`` run (e.g. reference texts computed once).

    The reference is loaded when an extra reads :attr:`reference` (``load_reference``, which
    ``verify`` lets go of while a runtime runs): a check that never reads it never holds it."""

    directory: Path
    load_reference: Callable[[], Any]
    tokenizer: Any
    text_prompts: tuple[str, ...]
    greedy_tokens: int
    cache: dict[str, Any]
    #: transformers.js clients to run each web-ready artifact in (``verify --web``)
    web_clients: tuple[str, ...] = ()
    #: the recipe's bound overrides by scheme (``bounds_for(scheme, overrides.get(scheme))``)
    bound_overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def reference(self) -> Any:
        """The PyTorch reference model (loaded again if ``verify`` had let it go)."""
        return self.load_reference()


class Target:
    """One runtime an artifact can be exported to and run on (see the module docstring).

    Subclasses set the class attributes and override the hooks they need; one instance is
    registered per target (:func:`pit_deploy.targets.register_target`).
    """

    #: the manifest's ``runtime`` value and the artifact folder's prefix
    name: str = ""
    #: one line for ``--help`` and the docs
    title: str = ""
    #: the Python module that must import for the driver to work, and the distribution that provides it
    module: str = ""
    package: str = ""
    #: dtypes the exporter produces (quantization schemes of other dtypes are refused)
    dtypes: tuple[str, ...] = ("float32",)
    #: whether the artifact has a static KV cache of ``recipe.max_seq_len`` positions
    static_cache: bool = False
    #: the ``config.model_type`` values the exporter builds (``None``: every supported family),
    #: the modes of a PIT model it writes, the schemes it takes (``None``: every scheme of its
    #: dtypes); what ``pit-deploy list`` shows, :meth:`precheck` enforces
    model_types: tuple[str, ...] | None = None
    #: whether the artifact holds each part of an equal-split fused linear (Phi-3's
    #: ``gate_up_proj``) as a tensor of its own, so its recorded codes are by part
    #: (:func:`~pit_deploy.exporters.calibrated_rounding.split_fused`)
    splits_fused: bool = False
    modes: tuple[str, ...] = ("materialized", "factorized")
    schemes: tuple[str, ...] | None = None
    #: the quantization schemes only this target writes, as data: :class:`~pit_deploy.schemes.Scheme`'s
    #: keyword arguments, ``bounds`` a dict of the bound fields or the name of a shared scheme whose
    #: bounds apply (:func:`pit_deploy.schemes.target_scheme`); the scheme registry adds them, for
    #: this target only, on its first lookup
    own_schemes: tuple[dict[str, Any], ...] = ()
    #: ``"module:function"`` ``(model, out_dir, *, tokenizer, recipe, scheme, opset) -> details``
    exporter: str = ""
    #: ``"module:Class"`` of the :class:`~pit_deploy.runtime.base.Driver`
    driver: str = ""
    #: the file of the artifact folder that the standalone decoder opens
    primary_file: str = ""
    #: ``("module", "Class")`` of a decoder that imports nothing of this package (bench bundles),
    #: and the ``pip install`` words a device needs for it; ``None``: the target cannot be bundled
    standalone: tuple[str, str] | None = None
    bundle_install: str = ""
    #: whether ``bench --adb`` can run the artifact on a phone (ExecuTorch's ``llama_main``)
    phone: bool = False
    #: whether an export that names no runtime includes this target (an opt-in target, whose
    #: exporter needs an extra distribution or supports fewer families, says ``False``)
    default_export: bool = True
    #: whether the artifact folder loads in transformers.js as it is (``verify --web`` runs it there)
    web_ready: bool = False
    #: ``verify --isa aarch64``: the runtime build that runs the artifact emulated, and the layout
    #: its runner reads the artifact in (``"plain"`` or ``"batched"`` ONNX graphs,
    #: :mod:`pit_deploy.runtime.emulated_runner`; a target's own runner, its own); ``None``: the
    #: artifact does not run emulated, for the reason :attr:`aarch64_blocker` gives
    aarch64_engine: EmulatedEngine | None = None
    aarch64_layout: str | None = None
    #: ``"module:function"`` ``(directory, art, reference) -> WeightCheck`` that reads a quantized
    #: artifact's weights back for ``verify``'s weight-level check
    #: (:mod:`pit_deploy.evaluate.weight_check`); ``None``: not checked, for the reason below
    weight_check: str | None = None
    weight_check_blocker: str = "no reader of this runtime's stored weights"
    aarch64_blocker: str = "no aarch64 build of its runtime is set up for emulation"
    #: which artifact a user ships first when an export holds several (lower first)
    ship_priority: int = 50
    #: the quantization-scheme settings this target's exporter reads (an override of another
    #: one is refused rather than silently ignored)
    scheme_settings: tuple[str, ...] = ("group_size", "table_bits", "int4_8bit_layers", "pit_correction")

    # ----------------------------------------------------------------------------------
    # export
    # ----------------------------------------------------------------------------------

    def streams_tables(self, schemes: Sequence[Any]) -> bool:
        """Whether the exporter writes a materialized model's token table and head a part of rows
        at a time from the model's ``pit_table_rows``
        (:func:`pit_deploy.exporters.passes.materialize_by_rows`) for every one of ``schemes``, so
        that an export whose every target of the mode does so never holds either table whole.
        Nothing may run such a model's forward: a scheme rounded by calibration cannot stream."""
        return False

    def precheck(self, config: Any, recipe: Any) -> None:
        """Raise :class:`PitError` before any slow work if the model cannot be exported."""

    def precheck_tokenizer(self, tokenizer: Any) -> None:
        """Raise :class:`PitError` before any slow work if the artifact cannot hold the model's
        ``tokenizer`` (``None``: the source has none); called after :meth:`precheck`."""

    def supports_family(self, model_type: str | None) -> bool:
        """Whether the exporter builds models of ``model_type``."""
        return self.model_types is None or model_type in self.model_types

    def supports_scheme(self, scheme: Any) -> bool:
        """Whether the exporter writes ``scheme`` (a :class:`~pit_deploy.schemes.Scheme`)."""
        if self.schemes is not None:
            return scheme.name in self.schemes
        return scheme.dtype in self.dtypes and (scheme.runtimes is None or self.name in scheme.runtimes)

    def export(self, model: Any, out_dir: Path, **kwargs: Any) -> dict[str, Any]:
        """Write the artifact of the prepared fp32 ``model`` into ``out_dir``; returns the
        details recorded in the manifest. Quantization to ``kwargs["scheme"]`` is the exporter's."""
        return resolve(self.exporter)(model, out_dir, **kwargs)

    def scheme_for(self, scheme: Any) -> Any:
        """The scheme this target's artifact is made with, given the export's ``scheme``: the
        same one unless a setting of this target's own (``genai_group_size``) replaces a shared
        one for it. Calibration, the expected error and the manifest all see what this returns."""
        return scheme

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid | None:
        """How this target's exporter rounds a quantized artifact's weights (``scheme``: a
        :class:`~pit_deploy.schemes.Scheme`), for the expected error the export records; ``None``
        (the default) records none, and ``verify`` keeps only the scheme's absolute bounds."""
        return None

    #: the modes whose quantized artifacts, with the scheme's PIT correction, keep ``W_out E = I``
    #: to float32 rounding on the runtime (``verify`` then bounds ``delta_ti``)
    exact_interface_modes: tuple[str, ...] = ("factorized",)

    def interface_exact(self, pit_correction: bool, mode: str) -> bool:
        """Whether a quantized ``mode`` artifact of a scheme with ``pit_correction`` has an exact
        interface (from the scheme and the target, not from a manifest field)."""
        return bool(pit_correction) and mode in self.exact_interface_modes

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        """The manifest's ``shapes`` entry of an artifact of this target."""
        v, d = config.vocab_size, config.hidden_size
        shapes: dict[str, Any] = {"vocab_size": v, "hidden_size": d, "num_layers": config.num_hidden_layers}
        if mode == "factorized":
            shapes["interface"] = {"Zt": [d, v], "T": [d, d], "T_inv": [d, d]}
        elif mode == "tied":
            shapes["interface"] = {"E": [v, d], "W_out": "Eᵀ (transpose tying)"}
        else:
            shapes["interface"] = {"E": [v, d], "W_out": [d, v]}
        if self.static_cache:
            shapes["max_seq_len"] = recipe.max_seq_len
        return shapes

    # ----------------------------------------------------------------------------------
    # running
    # ----------------------------------------------------------------------------------

    def installed(self) -> bool:
        """Whether the runtime's library can be imported here (without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def primary_path(self, folder: Path) -> str:
        """The file of ``folder`` the standalone decoder opens, relative to it (a target whose
        file name depends on the artifact's dtype finds it)."""
        return self.primary_file

    def aarch64_graphs(self, folder: Path) -> tuple[Path, Path]:
        """The decoder and interface graphs of ``folder`` that ``verify --isa aarch64`` runs
        emulated (targets with an :attr:`aarch64_layout` say which files they are)."""
        raise NotImplementedError(f"the {self.name} target does not run on aarch64 here: {self.aarch64_blocker}")

    def aarch64_job(self) -> dict[str, Any]:
        """What the emulated runner needs of this target's artifacts beyond the files and the
        recorded calls (the job's fields; default none)."""
        return {}

    def driver_class(self) -> Callable[..., Any]:
        """The driver class.

        Raises:
            PitError: the runtime's library is not installed.
        """
        module_name, cls_name = self.driver.split(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise PitError(f"the {self.name} runtime is not installed ({exc}); install it with "
                           f"`pip install {self.package or self.module}`") from None
        return getattr(module, cls_name)

    # ----------------------------------------------------------------------------------
    # the files a runtime opens
    # ----------------------------------------------------------------------------------

    #: files (relative to the artifact folder) the runtime needs to load the folder, each a tuple
    #: of alternatives; ``verify`` and ``bench`` refuse a folder without one (exit 2)
    required_files: tuple[tuple[str, ...], ...] = ()

    def config_references(self, folder: Path) -> list[tuple[str, str, Any]]:
        """``(config file, key, value)`` of every file path the artifact's own config names
        (the files its runtime opens besides :attr:`primary_file`); checked by :meth:`check_files`.

        Raises:
            PitError: the config cannot be read.
        """
        return []

    def check_files(self, directory: Path, art: Any) -> None:
        """Refuse (exit 2, naming the file and key) an artifact whose runtime would open what its
        digests do not cover: a path its own config names that is not a plain relative path to a
        regular file of the folder that the manifest lists (absolute, ``..``, a symbolic link, an
        unlisted file), or a folder without a file its runtime needs (:attr:`required_files`)."""
        folder = Path(directory) / art.path
        listed = set(art.files)
        for config, key, value in self.config_references(folder):
            where = f"{folder / config}: {key}"
            if not plain_relative(value):
                raise PitError(f"{where} is {value!r}, not a plain relative path inside the artifact (no absolute "
                               "path, no '..'); the file was edited or tampered — re-export")
            path = folder / value
            if f"{art.path}/{value}" not in listed:
                raise PitError(f"{where} names {value!r}, which is not a file of the artifact that its manifest "
                               "lists (no digest covers it); the file was edited or tampered — re-export")
            inside = all(not p.is_symlink() for p in [path, *path.parents][: value.count("/") + 1])
            if not inside or not path.is_file():
                raise PitError(f"{where} names {value!r}, which is {'a symbolic link' if not inside else 'not a regular file'}; "
                               "the runtime must open the file the manifest's digest covers — re-export")
        for names in self.required_files:
            if not any(f"{art.path}/{n}" in listed and (folder / n).is_file() for n in names):
                raise PitError(f"{folder} has no {' or '.join(names)} (listed in its manifest), which the {self.name} "
                               "runtime needs to load the folder; re-export")

    # ----------------------------------------------------------------------------------
    # verify and bench extras (defaults: none)
    # ----------------------------------------------------------------------------------

    def interface_checks(self, folder: Path, dim: int) -> tuple[bool | None, list[str]]:
        """``(weights_shared, notes)``: whether the artifact's interface graph reads the very
        weight bytes its decoder reads (``None``: not applicable), and notes for the report."""
        return None, []

    def verify_extras(self, ctx: VerifyContext, art: Any, result: Any, quantized: bool) -> None:
        """Checks only this target has, recorded on ``result`` (an ``ArtifactResult``) before
        it is judged; ``quantized`` says whether the artifact is judged by KL bounds."""

    def bench_cells(self, cell: dict[str, Any], tokenizer: Any, vocab: int, prompt_len: int,
                    threads: tuple[int, ...], folder: Path) -> list[dict[str, Any]]:
        """Extra benchmark cells beside the generic one (``cell``), each with a ``variant``
        that :meth:`measure_variant` measures."""
        return []

    def measure_variant(self, cell: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, list[str]]:
        """Measure one of this target's extra cells: ``(row, warnings)``; ``row`` is ``None`` when
        the cell could not be timed, and the last warning says why."""
        raise PitError(f"the {self.name} target has no benchmark variant {cell.get('variant')!r}")
