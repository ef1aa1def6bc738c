"""The ``export`` pipeline: a model in, an export directory with a manifest out.

``export_model`` resolves the source (a PIT directory, a plain/TT model or anything
:func:`pit_deploy.io.sources.load_source` accepts — plain models are converted first), saves the
PIT reference checkpoint, applies the materialize/factorize passes, runs the per-runtime
exporters and writes ``manifest.json`` last. Everything happens in a temporary sibling
directory that is renamed into place only when complete
(:func:`pit_deploy.io.fs.atomic_directory`), so an interrupted export leaves nothing
that looks complete.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch

from ..io.checkpoint import WEIGHTS_NAME, save_model
from ..io.fs import atomic_directory, check_output_dir
from ..converters.conversion import convert_model
from ..model.families import body_linears
from ..model.inspect import find_interface
from ..errors import PitError
from ..io.heap import give_back_freed_memory
from .calibrated_rounding import rounding_progress
from .passes import prepare
from ..io.manifest import REFERENCE_DIR, Artifact, Manifest, artifact_key, file_table, library_versions
from .recipes import Recipe
from .residual_rotation import rotate_residual, rotation_blocker
from ..io.weight_codes import CODES_FIELD
from .calibrated_rounding import calibrated_codes_field
from ..io.sources import LoadedModel, load_source
from ..schemes import Scheme
from ..targets import get_target
from ..targets.base import WeightGrid

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


def load_pit_source(model: str, t_init: str | None = None, progress: Progress | None = None) -> LoadedModel:
    """Load ``model`` and convert it to PIT if it is a plain (tied or untied) model.

    ``t_init`` ``None`` picks ``preserve`` where the family allows it, else ``output``.
    """
    from ..model.choices import CONVERSIONS

    if t_init is not None and t_init not in CONVERSIONS:
        raise PitError(f"unknown --t-init {t_init!r}; choose one of {', '.join(CONVERSIONS)}")
    loaded = load_source(model)
    if find_interface(loaded.model) is None:
        if t_init is None:
            from ..converters.conversion import default_conversion

            t_init = default_conversion(loaded.model.config)
        if progress:
            progress(f"{model} is not a PIT model: converting (T init: {t_init})")
        convert_model(loaded.model, t_init, source=loaded.source, tokenizer=loaded.tokenizer)
        loaded.source = {**loaded.source, "converted_at_export": True, "t_init": t_init}
    return loaded


def export_model(
    loaded: LoadedModel,
    out: str | Path,
    recipe: Recipe,
    force: bool = False,
    progress: Progress | None = None,
    opset: int | None = None,
    keep_tying: bool = False,
) -> Manifest:
    """Export a loaded PIT model as the recipe says; returns the written manifest.

    ``keep_tying`` exports a plain (transpose-tied) model without conversion, through the same
    exporters, as the baseline PIT is compared with: one artifact per runtime, mode ``tied``.

    Raises:
        PitError: not a PIT model, an existing non-empty ``out`` without ``force``, a static
            cache longer than the model supports.
    """
    say = progress or (lambda _m: None)
    model = loaded.model
    if keep_tying:
        if find_interface(model) is not None:
            raise PitError("--keep-tying exports the source model as it is; pass a plain (tied) model, "
                           "not a PIT checkpoint")
        modes: tuple[str, ...] = ("tied",)
    elif find_interface(model) is None:
        raise PitError("export_model needs a PIT model; use load_pit_source() to convert first")
    else:
        modes = recipe.modes
    out = check_output_dir(out, force, protect=(loaded.source.get("path") or "",))  # never the source
    recipe = recipe.for_model(model.config, say, tokenizer=loaded.tokenizer)  # `--runtime all`: the targets that export it
    wanted = [(r, m) for m in modes for r in recipe.runtimes]
    for runtime in dict.fromkeys(r for r, _ in wanted):
        get_target(runtime).precheck(model.config, recipe)
        get_target(runtime).precheck_tokenizer(loaded.tokenizer)
    recipe.check_model(model.config, body_linears(model))
    from ..converters.conversion import check_tokenizer_fits

    check_tokenizer_fits(loaded.tokenizer, model.config)  # every id a runtime is fed has a row
    dtype = torch.float32  # the reference and the prepared models; quantization is the exporters'
    model = model.to(dtype).eval()
    schemes = recipe.schemes(model.config)
    quantized = [s for s in schemes if s.quantized]

    with atomic_directory(out, force, lock="export", owned=False) as tmp:  # a second export of out is refused
        say(f"saving the {'tied' if keep_tying else 'PIT'} reference checkpoint to {REFERENCE_DIR}/")
        save_model(model, tmp / REFERENCE_DIR, loaded.tokenizer)
        reference = {
            "path": REFERENCE_DIR,
            "files": file_table(tmp, tmp / REFERENCE_DIR),
            "weights": f"{REFERENCE_DIR}/{WEIGHTS_NAME}",
        }
        artifacts: list[Artifact] = []
        heldout = None
        if quantized:
            from ..data.heldout import heldout_blocks

            heldout = heldout_blocks(loaded.tokenizer, model.config, recipe)
            say(f"held-out set for quantized parity: {len(heldout['blocks'])} × {len(heldout['blocks'][0])} "
                f"tokens ({heldout['source']})")
        calibration = _Calibration(loaded.tokenizer, model.config, say)
        for mode in modes:
            runtimes = [r for r in recipe.runtimes if (r, mode) in wanted]
            if not runtimes:
                continue
            # the tables a part at a time where every target of this mode writes them so
            by_rows = mode == "materialized" and all(get_target(r).streams_tables(schemes) for r in runtimes)
            prepared = prepare(model, mode, dtype, tables_by_rows=by_rows)
            for runtime in runtimes:
                target = get_target(runtime)
                for scheme in schemes:
                    name = artifact_key(runtime, mode, scheme.name)
                    if scheme.rounding != "rtn" and "rounding" not in target.scheme_settings:
                        scheme = scheme.with_settings(rounding="rtn")  # this target rounds by its own quantizer
                    if scheme.rotate_residual and "rotate_residual" not in target.scheme_settings:
                        scheme = scheme.with_settings(rotate_residual=False)  # a body this target does not rotate
                    if scheme.rotate_residual and (why := rotation_blocker(prepared)) is not None:
                        say(f"  {name}: the residual stream is not rotated: {why}")
                        scheme = scheme.with_settings(rotate_residual=False)
                    scheme = target.scheme_for(scheme)
                    start = time.perf_counter()
                    grid = target.weight_grid(scheme, mode)
                    body = calibration.rotated(prepared, mode) if scheme.rotate_residual else prepared
                    source = calibration.model(body, mode, scheme, grid) if scheme.rounding == "gptq" else body
                    say(f"exporting {name}")
                    with rounding_progress(lambda line: say(f"    {line}")):  # a token table's GPTQ, chunk by chunk
                        details = target.export(source, tmp / name, tokenizer=loaded.tokenizer, recipe=recipe,
                                                scheme=scheme, opset=opset)
                    if scheme.quantized:
                        details["scheme"] = scheme.settings()
                        if scheme.rounding == "gptq":
                            details["calibration"] = calibration.source
                            codes = calibrated_codes_field(source, target.splits_fused)  # what verify's weight-level check compares
                            if codes is not None:
                                details[CODES_FIELD] = codes
                    seconds = time.perf_counter() - start
                    if scheme.quantized:
                        _record_expected_error(details, source, model, heldout, scheme, grid, say)
                    art = Artifact(
                        target=runtime, mode=mode, dtype=scheme.dtype, path=name,
                        files=file_table(tmp, tmp / name), shapes=target.shapes(prepared.config, mode, recipe),
                        details=details, export_seconds=round(seconds, 3),
                        tying="tied" if keep_tying else "pit", scheme=scheme.name,
                    )
                    say(f"  {name}: {art.bytes / 2**20:.2f} MiB in {seconds:.1f} s")
                    artifacts.append(art)
                    # the next artifact starts from the models' own memory, not on top of the free
                    # heap pages this one's tables and codes left (0.6 GB after a q8_0 GGUF file at
                    # a 262k-token vocabulary)
                    del details, source, body
                    give_back_freed_memory()
            del prepared
            calibration.forget(mode)
        _normalize_permissions(tmp)
        manifest = Manifest(
            source=loaded.source, reference=reference, artifacts=artifacts,
            versions=library_versions(), recipe=recipe.to_dict(), heldout=heldout,
        )
        manifest.write(tmp)  # last: a manifest means every file above is complete
    return manifest


class _Calibration:
    """Calibrated (GPTQ) models of one export (:mod:`.calibrated_rounding`): the codes are
    computed once per grid and shared by the modes (the body is the same in both) and the
    targets of that grid; the calibration text is read on first use."""

    def __init__(self, tokenizer, config, say: Progress):
        self.tokenizer, self.config, self.say = tokenizer, config, say
        self.blocks: list[torch.Tensor] | None = None
        self.source = ""
        self.codes: dict[tuple, dict] = {}
        self.models: dict[tuple, torch.nn.Module] = {}
        self.rotations: dict[str, torch.nn.Module] = {}

    def rotated(self, prepared: torch.nn.Module, mode: str) -> torch.nn.Module:
        """``prepared`` with its residual stream rotated (:mod:`.residual_rotation`), made once per mode."""
        if mode not in self.rotations:
            self.rotations[mode] = rotate_residual(prepared)
            self.say("  residual stream rotated by a randomized Hadamard matrix before rounding")
        return self.rotations[mode]

    def _read_text(self) -> None:
        if self.blocks is None:
            from ..data.calibration import calibration_blocks
            from ..model.families import max_positions

            limit = max_positions(self.config)
            length = min(256, (limit - 1) if limit else 256)
            self.blocks, self.source = calibration_blocks(self.tokenizer, self.config, length)
            self.say(f"calibration text for GPTQ rounding: {self.source}")

    def model(self, prepared: torch.nn.Module, mode: str, scheme: Scheme, grid: WeightGrid) -> torch.nn.Module:
        from .calibrated_rounding import calibrated_model, rounded_weights
        from .gptq_cache import codes_key, load_codes, store_codes

        key = (scheme.dtype, scheme.group_size, scheme.int4_8bit_layers, grid.symmetric, grid.per_channel_8bit,
               scheme.rotate_residual)
        if (mode, *key) in self.models:
            return self.models[(mode, *key)]
        what = (f"({scheme.dtype}, group {scheme.group_size}, "
                f"{'symmetric' if grid.symmetric else 'asymmetric'})")
        start = time.perf_counter()
        cache_key = None
        if key not in self.codes:
            self._read_text()
            # the grid's own fields with the scheme's (the grid decides the rounding, the key which body)
            cache_key = codes_key(prepared, self.blocks or [], repr((key, grid)))
            cached = load_codes(cache_key)
            if cached is not None:
                self.codes[key] = cached
                self.say(f"  GPTQ codes of the body {what} read from the cache ({cache_key[:12]}) "
                         f"in {time.perf_counter() - start:.1f} s")
        model = calibrated_model(prepared, scheme, grid, self.blocks or [], self.codes.get(key),
                                 log=lambda line: self.say(f"    {line}"))
        if key not in self.codes:
            self.codes[key] = rounded_weights(model)
            self.say(f"  GPTQ rounding of the body {what} in {time.perf_counter() - start:.0f} s")
            store_codes(cache_key, self.codes[key])
        self.models[(mode, *key)] = model
        return model

    def forget(self, mode: str) -> None:
        """Drop the calibrated models of ``mode`` (the codes stay for the next mode)."""
        self.models = {k: v for k, v in self.models.items() if k[0] != mode}
        self.rotations.pop(mode, None)


def _record_expected_error(details: dict, prepared: torch.nn.Module, reference: torch.nn.Module, heldout: dict,
                           scheme: Scheme, grid: WeightGrid | None, say: Progress) -> None:
    """Add ``details["expected"]``: the KL that the scheme's rounding of ``prepared``'s weights
    alone costs on the held-out blocks, measured in PyTorch without the artifact
    (:mod:`.expected_error`), which ``verify`` scales its bound by. A target that declares no
    weight grid records none."""
    if grid is None:
        return
    from .expected_error import expected_error

    expected = expected_error(prepared, reference, heldout["blocks"], scheme, grid)
    if expected is None:
        say("  expected quantization error: not finite, not recorded (verify keeps the absolute bounds)")
        return
    details["expected"] = expected
    say(f"  expected quantization error (weights rounded in PyTorch): kl_mean {expected['kl_mean']:.4g}, "
        f"kl_p99 {expected['kl_p99']:.4g}")


def _normalize_permissions(root: Path) -> None:
    """Temp files/dirs are created private (0600/0700); an export is meant to be shared."""
    root.chmod(0o755)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
