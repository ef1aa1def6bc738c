"""The Python API: one function per pipeline command, with the command's options and defaults.

``pit_deploy.convert``, ``train``, ``export``, ``verify``, ``bench`` and ``run`` are these
functions (``import pit_deploy`` loads this module on first use). Each takes the command's
positional arguments positionally and its flags as keyword arguments named like the flags
(``--calib-tokens`` is ``calib_tokens=``; a flag that takes a comma list takes a list or that
text), so what ``docs/python-api.md`` and the command docs say of a flag holds for the keyword.
The ``pit-deploy`` commands are thin wrappers over these functions: both surfaces validate
alike and raise the same errors.

* A user's mistake (a path, a model, an option) raises :class:`~pit_deploy.errors.PitError`
  before any slow work, with the message the command prints (it names the flag); the command
  turns it into exit code 2.
* Progress lines go to ``say``: by default :func:`log_progress` (the ``pit_deploy`` logger at
  INFO: nothing shows until logging is configured); :func:`print_progress` prints them on stderr
  as the commands do; ``say=None`` is silent, any callable taking one string receives them.
* The return value is what a program reads: the conversion's figures, the training result,
  the export manifest, the verify report, the bench rows, the run's exit code and report.

Nothing here changes the process's signal handlers or logging: the command line does that.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, ParamSpec, Sequence, TypeVar, overload

from .errors import PitError, speak_python
from .evaluate.bench import BenchOptions
from .model.choices import MAX_LOSS_RISE
from .options import PARSERS, check_types, describe_value, field_default, flag_name, is_int, type_problem

if TYPE_CHECKING:  # the result types, imported where they are used (they pull in torch)
    from .evaluate.bench import BenchResult
    from .evaluate.verify import VerifyReport
    from .io.manifest import Manifest
    from .workflow.pipeline import RunResult
    from .training.loop import TrainResult

__all__ = ["Conversion", "Say", "bench", "bench_adb", "bench_bundle", "bench_ingest", "convert", "export",
           "log_progress", "print_progress", "run", "train", "verify"]

Say = Callable[[str], None]
PathLike = str | os.PathLike
log = logging.getLogger(__name__)


def print_progress(message: str) -> None:
    """A progress line on stderr, time-stamped as the commands print it (stdout stays clean)."""
    print(f"[pit-deploy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def log_progress(message: str) -> None:
    """A progress line to the ``pit_deploy`` logger at INFO: the calls' default, so a library
    user sees nothing unless they configure logging (``logging.basicConfig(level=logging.INFO)``);
    the commands print the lines themselves."""
    logging.getLogger("pit_deploy").info(message)


def _sayer(say: Say | None) -> Say:
    return say if say is not None else (lambda _message: None)


def _closest(name: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {match[0]!r}?" if match else ""


_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")


def _keyword_terms(call: Callable[_P, _R]) -> Callable[_P, _R]:
    """A public call whose :class:`PitError` messages name keyword arguments, not flags, when
    Python called it (``calib_tokens must be at least 1``, ``pass force=True``); under the command
    line (:func:`pit_deploy.errors.command_line`) they keep the flags."""
    import functools
    import inspect

    switches = frozenset(name for name, p in inspect.signature(call).parameters.items()
                         if isinstance(p.default, bool))

    @functools.wraps(call)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return call(*args, **kwargs)
        except PitError as exc:
            speak_python(exc, switches)
            raise

    return wrapper


# --------------------------------------------------------------------------------------
# the arguments' types, checked at the boundary (a wrong type is the caller's mistake: PitError)
# --------------------------------------------------------------------------------------


@overload
def _path_arg(call: str, name: str, value: Any, optional: Literal[False] = False) -> str: ...


@overload
def _path_arg(call: str, name: str, value: Any, optional: Literal[True]) -> str | None: ...


def _path_arg(call: str, name: str, value: Any, optional: bool = False) -> str | None:
    """``value`` of path argument ``name`` as text: a ``str`` or ``os.PathLike`` (``None`` where
    ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise PitError(f"{call}(): {name} must be a path (str or os.PathLike), got {describe_value(value)}")
    if not value:
        raise PitError(f"{call}(): {name} must not be empty; pass a path")
    return value


def _alias(call: str, name: str, value: _T, alias: str, alias_value: _T) -> _T:
    """The value of a keyword given under its name or its alias (``target`` for ``runtime``,
    ``scheme`` for ``dtype``: one option, two names).

    Raises:
        PitError: both were given.
    """
    if alias_value is None:
        return value
    if value is not None:
        raise PitError(f"{call}(): pass {name} or {alias}, not both (they are the same option)")
    return alias_value


def _bool_args(call: str, **values: Any) -> None:
    """Every switch a real ``bool``: ``"no"`` is truthy, and would switch the option on."""
    for name, value in values.items():
        if not isinstance(value, bool):
            raise PitError(f"{call}(): {name} must be True or False, got {describe_value(value)}")


def _text_arg(call: str, name: str, value: Any, optional: bool = False) -> None:
    """A name or other text (its value is checked where it is used, naming the flag)."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise PitError(f"{call}(): {name} must be text (a str){' or None' if optional else ''}, got "
                       f"{describe_value(value)}")


def _names_arg(call: str, name: str, value: Any) -> None:
    """A selection: ``None``, a comma list, or a list of names."""
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise PitError(f"{call}(): {name} must be a name, a comma list or a list of names, got {describe_value(value)}")


def _int_arg(call: str, name: str, value: Any) -> None:
    if not is_int(value):
        raise PitError(f"{call}(): {name} must be an integer, got {describe_value(value)}")


def _number_arg(call: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PitError(f"{call}(): {name} must be a number, got {describe_value(value)}")


def _say_arg(call: str, say: Any) -> None:
    if say is not None and not callable(say):
        raise PitError(f"{call}(): say must be None or a callable taking one string, got {describe_value(say)}")


def _coerce(cls: type, name: str, value: Any) -> Any:
    """``value`` for field ``name`` of options dataclass ``cls``: a path as its text, the text of a
    list-valued flag (``"onnx,executorch"``, ``"0.9,0.95"``) parsed as the command line parses it;
    anything else as given (the dataclass validates it)."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    f = next(f for f in fields(cls) if f.name == name)
    kind = f.metadata.get("parse") or str(f.type).replace(" | None", "")
    if not isinstance(value, str) or kind not in ("list[str]", "tuple[str, ...]", "tuple[float, float]"):
        return value
    try:
        return PARSERS[kind](value)
    except argparse.ArgumentTypeError as exc:
        raise PitError(f"{f.metadata.get('flag') or flag_name(name)}: {exc}") from None


# --------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------


@dataclass
class Conversion:
    """What :func:`convert` wrote and measured."""

    out: Path  #: the PIT checkpoint directory written
    t_init: str  #: the conversion used (``preserve`` where the family allows it, unless asked otherwise)
    delta_ti: float  #: ``‖W_out E − I‖_F`` of the converted model (float32 rounding: ~1e-7)
    #: held-out NLL on the default corpus (8×256 tokens, nats/token) before and after; ``None``
    #: without a tokenizer
    source_nll: float | None = None
    converted_nll: float | None = None
    source: dict[str, Any] = field(default_factory=dict)  #: where the model came from (recorded in config.json)


@_keyword_terms
def convert(model: PathLike, out: PathLike, *, t_init: str | None = None, calib: str = "default",
            calib_tokens: int = 4096, diagonal: str = "softplus", train_z: bool = False, force: bool = False,
            max_loss_rise: float = MAX_LOSS_RISE, accept_loss: bool = False,
            trust_remote_code: bool = False, say: Say | None = log_progress) -> Conversion:
    """Convert a causal LM into a PIT checkpoint in ``out`` (``pit-deploy convert``, docs/conversion.md).

    ``model`` is ``"default"``, a GGUF file, a Hugging Face directory or a hub id; ``t_init``
    ``None`` picks ``preserve`` where the family allows it (the source's logits kept), else
    ``output``. The held-out loss is measured before and after, so a program sees what the
    conversion cost without loading the checkpoint again; a rise of more than ``max_loss_rise``
    nats/token is refused (nothing written) unless ``accept_loss`` keeps it (a paper init that
    training will bring back, a Gemma 2/3 model to train).

    Raises:
        BoundError: (exit 1) the held-out loss rose by more than ``max_loss_rise`` and
            ``accept_loss`` is off; ``figures`` holds ``source_nll``, ``converted_nll``, ``bound``.
        PitError: an unknown ``t_init`` or ``diagonal``, ``calib_tokens`` < 1, a negative
            ``max_loss_rise``, an ``out`` that exists without ``force``, an unusable source, a
            source that is already PIT.
    """
    from .model.choices import CONVERSIONS, DIAGONAL_MAPS

    model, out = _path_arg("convert", "model", model), _path_arg("convert", "out", out)
    _bool_args("convert", train_z=train_z, force=force, accept_loss=accept_loss, trust_remote_code=trust_remote_code)
    _number_arg("convert", "max_loss_rise", max_loss_rise)
    _text_arg("convert", "t_init", t_init, optional=True)
    calib = _path_arg("convert", "calib", calib)  # "default" or a text file or folder
    _text_arg("convert", "diagonal", diagonal)
    _int_arg("convert", "calib_tokens", calib_tokens)
    _say_arg("convert", say)
    say = _sayer(say)
    if t_init is not None and t_init not in CONVERSIONS:
        raise PitError(f"unknown --t-init {t_init!r}; choose one of {', '.join(CONVERSIONS)}")
    if calib_tokens < 1:  # its type is checked above
        raise PitError(f"--calib-tokens must be at least 1, got {calib_tokens}")
    if diagonal not in DIAGONAL_MAPS:
        raise PitError(f"unknown --diagonal {diagonal!r}; choose one of {', '.join(DIAGONAL_MAPS)}")
    if not max_loss_rise >= 0:  # NaN included
        raise PitError(f"--max-loss-rise must be a number of nats/token ≥ 0, got {max_loss_rise}")
    from .io.fs import check_output_dir

    check_output_dir(out, force, protect=(model,))  # fail before the slow load
    from .converters.conversion import convert_model, default_conversion
    from .io.checkpoint import save_model
    from .io.sources import load_source
    from .model.core import PITSpec
    from .model.inspect import interface_delta_ti

    say(f"loading {model}")
    loaded = load_source(model, trust_remote_code=trust_remote_code)
    if loaded.is_pit:
        raise PitError(f"{model} is already a PIT model; nothing to convert")
    chosen = t_init or default_conversion(loaded.model.config)
    why = "" if t_init or chosen == "preserve" else f"; {loaded.model.config.model_type} is not covered by preserve"
    say(f"converting to PIT (T init: {chosen}{why})")
    before = _heldout(loaded)
    converted = convert_model(loaded.model, chosen, PITSpec(diagonal=diagonal, train_z=train_z), loaded.source,
                              tokenizer=loaded.tokenizer, calib=calib, calib_tokens=calib_tokens)
    after = _heldout(loaded)
    if before is not None and after is not None:
        say(f"held-out NLL (default corpus, 8×256 tokens): source {before:.3f}, converted {after:.3f} "
            f"({after - before:+.3f} nats/token)")
        check_loss_rise(before, after, max_loss_rise, accept_loss, chosen, source=model)
    delta_ti = interface_delta_ti(converted)
    say(f"delta_ti = {delta_ti:.3e}; saving to {out}")
    path = save_model(converted, out, loaded.tokenizer, force=force)
    say("done")
    return Conversion(out=Path(path), t_init=chosen, delta_ti=delta_ti, source_nll=before, converted_nll=after,
                      source=dict(loaded.source))


def check_loss_rise(before: float, after: float, bound: float, accept: bool, t_init: str,
                    source: str = "SRC") -> None:
    """Refuse a conversion whose held-out NLL rose by more than ``bound`` (or became non-finite),
    unless ``accept``: a model that lost what it knew is not shipped without being asked for.

    Raises:
        BoundError: with the figures, exit 1.
    """
    rise = after - before
    if accept or rise <= bound:  # a NaN rise fails the comparison and is refused
        if accept and not rise <= bound:
            log.warning("the held-out NLL rose by %+.3f nats/token (bound %g), kept as asked (--accept-loss)",
                        rise, bound)
        return
    from .errors import BoundError

    if t_init == "preserve":  # only a family without the rotation symmetry (post-norms) gets here
        why = " (this family's conversion cannot keep what the source computes: docs/conversion.md)"
        then = (f"To convert and train it back in one step, distill it from the source: pit-deploy train --model "
                f"{source} --distill --distill-weight 1 (docs/conversion.md, 'Post-normalized blocks'); to keep "
                "this checkpoint anyway, pass --accept-loss")
    else:
        why, then = "", ("To keep it anyway, pass --accept-loss and train the model from this checkpoint "
                         "(docs/training.md)")
    raise BoundError(
        f"the conversion raised the held-out NLL from {before:.3f} to {after:.3f} nats/token ({rise:+.3f}), past "
        f"the bound of {bound:g} (--max-loss-rise){why}; nothing was written. {then}", source_nll=before,
        converted_nll=after, bound=bound)


def _heldout(loaded: Any) -> float | None:
    """Held-out NLL on the default corpus (what a conversion cost), when there is a tokenizer."""
    if loaded.tokenizer is None:
        return None
    from .training.evaluation import heldout_nll

    return heldout_nll(loaded.model, loaded.tokenizer, "default", 256, 8)


# --------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------


@_keyword_terms
def train(model: PathLike | None = None, out: PathLike | None = None, *, config: PathLike | None = None,
          say: Say | None = log_progress, **options: Any) -> TrainResult:
    """Train as ``pit-deploy train`` does (docs/training.md); returns the run's result.

    ``options`` are the fields of :class:`~pit_deploy.training.config.TrainConfig`, the flags of
    ``pit-deploy train`` by their field names (``tying="pit"``, ``data="default"``,
    ``steps=20``; ``--interface-only`` is ``train_body=False``, ``--no-progress``
    ``progress=False``); ``model`` defaults to ``"default"``, ``out`` (the run directory) is
    required. ``config`` reads every option from a JSON file instead (what ``pit-deploy run``
    hands a ``torchrun`` child). Under ``torchrun`` every rank returns the run's result (rank 0's,
    which wrote the model), and only rank 0 reports it through ``say``.

    Returns:
        :class:`~pit_deploy.training.loop.TrainResult`: ``out``, ``steps``, ``tokens``,
        ``final_train_loss``, ``initial_val_loss``/``final_val_loss`` (``None`` without
        evaluation), ``median_step_time_s``, ``tokens_per_s``.

    Raises:
        PitError: an unknown or out-of-range option, unusable data or model, a non-finite loss;
            its subclass ``IdentityLost`` (exit 1 on the command line) when ``delta_ti`` exceeds
            ``max_delta_ti``.
    """
    from .training.config import TrainConfig, read_config
    from .training.loop import train as run_training

    _say_arg("train", say)
    say = _sayer(say)
    model = _path_arg("train", "model", model, optional=True)
    out = _path_arg("train", "out", out, optional=True)
    config = _path_arg("train", "config", config, optional=True)
    if config is not None:
        if model is not None or out is not None or options:
            raise PitError("config= reads every training option from its file; pass no other option")
        cfg = read_config(config)
    else:
        known = [f.name for f in fields(TrainConfig)]
        for name in options:
            if name not in known:
                raise PitError(f"unknown training option {name!r}{_closest(name, known)} (the options are the "
                               "fields of TrainConfig, the flags of `pit-deploy train`)")
        given = {name: _coerce(TrainConfig, name, value) for name, value in options.items()}
        for name, value in (("model", model), ("out", out)):
            if value is not None:
                given[name] = value
        check_types(TrainConfig, given, lambda name: f"train(): {name}")
        cfg = TrainConfig(**given)
    result = run_training(cfg, say=say)
    if int(os.environ.get("RANK", "0")) == 0:
        say(f"done: {result.steps} steps"
            + (f", final train loss {result.final_train_loss:.4f}" if result.final_train_loss is not None else "")
            + (f", validation loss {result.final_val_loss:.4f}" if result.final_val_loss is not None else ""))
    return result


# --------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------

#: recipe fields that :func:`export` takes under their flag's name
_RECIPE_FLAG_NAMES = {"runtimes": "runtime", "modes": "mode"}


@_keyword_terms
def export(model: PathLike, out: PathLike, *, recipe: PathLike | Any | None = None,
           runtime: str | Sequence[str] | None = None, mode: str | Sequence[str] | None = None,
           dtype: str | Sequence[str] | None = None, t_init: str | None = None, keep_tying: bool = False,
           force: bool = False, say: Say | None = log_progress, target: str | Sequence[str] | None = None,
           scheme: str | Sequence[str] | None = None, **recipe_fields: Any) -> Manifest:
    """Export a model for its runtimes as ``pit-deploy export`` does (docs/export.md).

    ``model`` is a PIT directory or a plain model (converted first, ``t_init`` as in
    :func:`convert`). ``recipe`` names an export recipe (or is a path, or an
    :class:`~pit_deploy.exporters.recipes.Recipe`); the keywords override it: ``runtime``, ``mode``
    and ``dtype`` take a list or a comma list (``runtime="onnx"``, ``dtype=["float32", "int4"]``;
    ``target`` and ``scheme`` are the same keywords as ``runtime`` and ``dtype``, as ``--target``
    and ``--scheme`` are on the command line), and ``recipe_fields`` are the recipe's other fields
    by name (``max_seq_len=64``, ``group_size=32``, ``pit_correction=False`` for
    ``--no-pit-correction``, …). A keyword left
    ``None`` keeps the recipe's value. ``keep_tying`` exports the source unconverted (mode
    ``tied``), the baseline PIT is compared with.

    Returns:
        the written :class:`~pit_deploy.io.manifest.Manifest` (``artifacts``: runtime, mode,
        dtype, scheme, path, files with their sha256 and size, ``bytes``).

    Raises:
        PitError: an unknown runtime, mode, scheme or recipe field, an inconsistent recipe, an
            ``out`` that exists without ``force``, an unusable model.
    """
    from .exporters.recipes import Recipe, load_recipe
    from .exporters.recipes import recipe_fields as names

    model, out = _path_arg("export", "model", model), _path_arg("export", "out", out)
    runtime = _alias("export", "runtime", runtime, "target", target)
    dtype = _alias("export", "dtype", dtype, "scheme", scheme)
    _bool_args("export", keep_tying=keep_tying, force=force)
    _text_arg("export", "t_init", t_init, optional=True)
    for name, value in (("runtime", runtime), ("mode", mode), ("dtype", dtype)):
        _names_arg("export", name, value)
    if recipe is not None and not isinstance(recipe, (str, os.PathLike, Recipe)):
        raise PitError(f"export(): recipe must be a recipe name, a path or a Recipe, got {describe_value(recipe)}")
    _say_arg("export", say)
    say = _sayer(say)
    allowed = [n for n in names() if n not in _RECIPE_FLAG_NAMES and n != "dtype"]
    for name in recipe_fields:
        if name not in allowed:
            hint = (f"; pass {_RECIPE_FLAG_NAMES[name]}= (the flag's name)" if name in _RECIPE_FLAG_NAMES
                    else _closest(name, allowed + ["runtime", "mode", "dtype"]))
            raise PitError(f"unknown export option {name!r}{hint}")
    if recipe is None or isinstance(recipe, Recipe):
        base = recipe or Recipe()
    else:
        base = load_recipe(os.fspath(recipe))
    changes = {"runtimes": runtime, "modes": mode, "dtype": dtype, **recipe_fields}
    check_types(Recipe, {k: v for k, v in recipe_fields.items() if v is not None}, lambda name: f"export(): {name}")
    built = base.override(**{k: _coerce(Recipe, k, v) for k, v in changes.items()})
    from .io.fs import check_output_dir

    check_output_dir(out, force, protect=(model,))  # fail before the slow load
    from .exporters.pipeline import export_model, load_pit_source

    say(f"loading {model}")
    if keep_tying:
        from .io.sources import load_source

        loaded = load_source(model)
    else:
        loaded = load_pit_source(model, t_init, progress=say)
    manifest = export_model(loaded, out, built, force=force, progress=say, keep_tying=keep_tying)
    total = sum(a.bytes for a in manifest.artifacts)
    say(f"done: {len(manifest.artifacts)} artifact(s), {total / 2**20:.1f} MiB in {out}; run `pit-deploy verify {out}`")
    return manifest


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


@_keyword_terms
def verify(directory: PathLike, *, runtime: str | Sequence[str] | None = None, mode: str | Sequence[str] | None = None,
           dtype: str | Sequence[str] | None = None, record: bool = True, expect_sha256: str | None = None,
           web: str | Sequence[str] | None = None, isa: str | Sequence[str] | None = None,
           arm_cpu: str | Sequence[str] | None = None, kleidiai: str | Sequence[str] | None = None,
           full: bool = False, say: Say | None = log_progress, target: str | Sequence[str] | None = None,
           scheme: str | Sequence[str] | None = None) -> VerifyReport:
    """Run every artifact of an export directory on its runtime against the PyTorch reference,
    as ``pit-deploy verify`` does (docs/verify.md).

    ``runtime``, ``mode``, ``dtype`` select artifacts (a list or a comma list; default: all;
    ``target`` and ``scheme`` are the same keywords as ``runtime`` and ``dtype``);
    ``record=False`` is ``--no-record`` (the manifest is left as it is); ``expect_sha256`` pins
    the manifest; ``web`` also runs the onnx folders through transformers.js (``"node"``,
    ``"chromium"``); ``isa`` ``"aarch64"`` (or ``"x86_64,aarch64"``) runs the ONNX and ``.pte``
    artifacts on their runtimes' aarch64 kernels under emulation, on each ``arm_cpu`` profile and
    ``kleidiai`` setting (``--isa``, ``--arm-cpu``, ``--kleidiai``): the compact cross-ISA check,
    or with ``full=True`` the whole verification (``--full``).

    Returns:
        :class:`~pit_deploy.evaluate.verify.VerifyReport`: ``passed`` (every selected artifact
        within its bounds: what the command's exit code 0 or 1 says), ``artifacts`` (one
        :class:`~pit_deploy.evaluate.verify.ArtifactResult` each, with its figures, ``passed``
        and ``failures``), ``manifest_sha256``, ``to_dict()``; ``str(report)`` is the command's
        table. A failed bound is a report with ``passed`` false, not an exception.

    Raises:
        PitError: not an export directory, a digest mismatch, a pin that does not match, an
            unknown runtime/mode/dtype, a selection of no artifact, a read-only directory with
            ``record``.
    """
    from .evaluate.verify import verify_directory

    directory = _path_arg("verify", "directory", directory)
    runtime = _alias("verify", "runtime", runtime, "target", target)
    dtype = _alias("verify", "dtype", dtype, "scheme", scheme)
    _bool_args("verify", record=record, full=full)
    _text_arg("verify", "expect_sha256", expect_sha256, optional=True)
    for name, value in (("runtime", runtime), ("mode", mode), ("dtype", dtype), ("web", web), ("isa", isa),
                        ("arm_cpu", arm_cpu), ("kleidiai", kleidiai)):
        _names_arg("verify", name, value)
    _say_arg("verify", say)
    say = _sayer(say)
    say(f"verifying {directory}")
    isas = {k: v for k, v in (("isa", isa), ("arm_cpu", arm_cpu), ("kleidiai", kleidiai), ("full", full or None))
            if v is not None}
    return verify_directory(directory, runtime, mode, record=record, expect_sha256=expect_sha256, dtypes=dtype,
                            web=web, **isas)


# --------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------

_BENCH = {f.name: field_default(BenchOptions, f.name) for f in fields(BenchOptions)}


def _bench_options(call: str, threads: Any, prompt_len: Any, gen_len: Any, reps: Any) -> BenchOptions:
    """The measuring options of a bench call, checked (their defaults: :class:`BenchOptions`')."""
    from .evaluate.bench import int_list

    for name, value in (("threads", threads), ("prompt_len", prompt_len)):
        problem = type_problem(value, "tuple[int, ...]")
        if problem:
            raise PitError(f"{call}(): {name} {problem}, got {describe_value(value)}")
    _int_arg(call, "gen_len", gen_len)
    _int_arg(call, "reps", reps)
    return BenchOptions(threads=int_list(threads, "--threads"), prompt_lens=int_list(prompt_len, "--prompt-len"),
                        gen_len=gen_len, reps=reps)


def _bench_outputs(call: str, out: Any, plot: Any, inputs: tuple) -> tuple[str | None, str | None]:
    """``out`` and ``plot`` checked before any measuring: writable, not one of the ``inputs``."""
    from .analysis.plotting import check_image_path
    from .io.fs import check_output_file

    out, plot = _path_arg(call, "out", out, optional=True), _path_arg(call, "plot", plot, optional=True)
    if out is not None:
        check_output_file(out, "--out", inputs=inputs)
    if plot is not None:
        check_image_path(plot, "--plot", inputs=inputs)
    return out, plot


def _bench_write(result: BenchResult, out: str | None, plot: str | None, say: Say) -> BenchResult:
    if out:
        from .io.fs import write_text_atomic

        write_text_atomic(out, result.to_json(indent=2) + "\n")
    if plot:
        say(f"wrote {result.plot(plot)}")
    return result


def _directories(call: str, directories: tuple) -> tuple[str, ...]:
    return tuple(_path_arg(call, f"directory {i + 1}", d) for i, d in enumerate(directories))


@_keyword_terms
def bench(*directories: PathLike, torch: str | None = _BENCH["torch_model"],
          threads: int | str | Sequence[int] = _BENCH["threads"],
          prompt_len: int | str | Sequence[int] = _BENCH["prompt_lens"], gen_len: int = _BENCH["gen_len"],
          reps: int = _BENCH["reps"], out: PathLike | None = None, plot: PathLike | None = None,
          say: Say | None = log_progress) -> BenchResult:
    """Latency, memory and size of every artifact of ``directories`` on this machine, as
    ``pit-deploy bench`` does (docs/bench.md); the defaults are
    :class:`~pit_deploy.evaluate.bench.BenchOptions`'.

    ``torch`` also measures a model in PyTorch eager; ``threads`` and ``prompt_len`` take an
    integer, a list or a comma list; each cell runs in its own process. ``out`` also writes the
    rows as JSON, ``plot`` a chart. The command's other modes are calls of their own:
    :func:`bench_bundle`, :func:`bench_ingest`, :func:`bench_adb`.

    Returns:
        :class:`~pit_deploy.evaluate.bench.BenchResult`: ``rows`` (one dict per cell: artifact,
        runtime, mode, dtype, tying, threads, prompt_len, gen_len, ``prefill_tok_s``,
        ``decode_tok_s``, ``ttft_ms``, ``decode_ms_p50``/``p90``, ``load_s``, ``peak_rss_mb``,
        ``size_mb``, ``verified``, …; a figure that was not measured is NaN), ``ratios()``
        (PIT/TT), ``warnings``, ``machine``, ``to_json()``, ``plot(path)``.

    Raises:
        PitError: options out of range, an unwritable ``out``/``plot``, an unusable export
            directory.
    """
    from dataclasses import replace

    from .evaluate.bench import bench_directories

    directories = _directories("bench", directories)
    _text_arg("bench", "torch", torch, optional=True)
    _say_arg("bench", say)
    say = _sayer(say)
    opts = replace(_bench_options("bench", threads, prompt_len, gen_len, reps), torch_model=torch)
    out, plot = _bench_outputs("bench", out, plot, directories)
    return _bench_write(bench_directories(directories, opts, progress=say), out, plot, say)


@_keyword_terms
def bench_bundle(*directories: PathLike, out: PathLike, threads: int | str | Sequence[int] = _BENCH["threads"],
                 prompt_len: int | str | Sequence[int] = _BENCH["prompt_lens"], gen_len: int = _BENCH["gen_len"],
                 reps: int = _BENCH["reps"], force: bool = False, say: Say | None = log_progress) -> Path:
    """Pack the artifacts of ``directories`` with a self-contained benchmark for another device
    into the archive ``out`` (``pit-deploy bench --bundle``; ``force`` replaces an existing
    archive). On the device: ``tar xzf ARCHIVE && python pit-bench/run_bench.py --out
    rows.json``; read the rows back with :func:`bench_ingest`.

    Returns:
        the :class:`~pathlib.Path` of the archive written.

    Raises:
        PitError: options out of range, an existing ``out`` without ``force``, an unusable
            export directory.
    """
    from .evaluate.bench import write_bundle

    directories = _directories("bench_bundle", directories)
    out = _path_arg("bench_bundle", "out", out)
    _bool_args("bench_bundle", force=force)
    _say_arg("bench_bundle", say)
    say = _sayer(say)
    opts = _bench_options("bench_bundle", threads, prompt_len, gen_len, reps)
    path = write_bundle(out, directories, opts, progress=say, force=force)
    say(f"wrote {path}: on the device, `tar xzf {path.name} && python pit-bench/run_bench.py --out rows.json`, "
        "then `pit-deploy bench --ingest rows.json`")
    return path


@_keyword_terms
def bench_ingest(*rows: PathLike, out: PathLike | None = None, plot: PathLike | None = None,
                 say: Say | None = log_progress) -> BenchResult:
    """The rows a bundle's ``run_bench.py`` measured on a device (``pit-deploy bench --ingest``),
    as a :class:`~pit_deploy.evaluate.bench.BenchResult`; ``out``/``plot`` as :func:`bench`'s.

    Raises:
        PitError: no rows file, or one that is not a bundle's rows.
    """
    from .evaluate.bench import ingest_rows

    files = [_path_arg("bench_ingest", f"rows {i + 1}", r) for i, r in enumerate(rows)]
    if not files:
        raise PitError("bench_ingest() needs at least one rows file (what a bundle's run_bench.py wrote)")
    _say_arg("bench_ingest", say)
    say = _sayer(say)
    out, plot = _bench_outputs("bench_ingest", out, plot, tuple(files))
    return _bench_write(ingest_rows(files), out, plot, say)


@_keyword_terms
def bench_adb(*directories: PathLike, runner: PathLike, serial: str | None = None, device_dir: str | None = None,
              threads: int | str | Sequence[int] = _BENCH["threads"],
              prompt_len: int | str | Sequence[int] = _BENCH["prompt_lens"], gen_len: int = _BENCH["gen_len"],
              reps: int = _BENCH["reps"], out: PathLike | None = None, plot: PathLike | None = None,
              say: Say | None = log_progress) -> BenchResult:
    """The ``.pte`` artifacts of ``directories`` timed on an Android phone over ``adb`` by
    ExecuTorch's ``llama_main`` (``runner``: that binary built for the phone; ``serial``: the
    device, where more than one is attached; ``device_dir``: its working folder), as
    ``pit-deploy bench --adb`` does (docs/bench.md, "Phones over adb"); ``out``/``plot`` as
    :func:`bench`'s.

    Raises:
        PitError: options out of range, no usable runner, device or artifact.
    """
    from .targets.executorch.bench_adb import DEFAULT_DEVICE_DIR, AdbOptions
    from .targets.executorch.bench_adb import bench_adb as measure_on_phone

    directories = _directories("bench_adb", directories)
    runner = _path_arg("bench_adb", "runner", runner)
    for name, value in (("serial", serial), ("device_dir", device_dir)):
        _text_arg("bench_adb", name, value, optional=True)
    _say_arg("bench_adb", say)
    say = _sayer(say)
    opts = _bench_options("bench_adb", threads, prompt_len, gen_len, reps)
    out, plot = _bench_outputs("bench_adb", out, plot, directories)
    result = measure_on_phone(directories, opts, AdbOptions(runner=runner, serial=serial,
                                                             device_dir=device_dir or DEFAULT_DEVICE_DIR), progress=say)
    return _bench_write(result, out, plot, say)


# --------------------------------------------------------------------------------------
# run
# --------------------------------------------------------------------------------------


@_keyword_terms
def run(recipe: PathLike = "default", *, model: PathLike | None = None, data: PathLike | None = None,
        out: PathLike | None = None, overrides: Mapping[str, Any] | Sequence[str] | str | None = None,
        from_stage: str | None = None, force: bool = False, say: Say | None = log_progress) -> RunResult:
    """convert → train → export → verify → bench → report in one run directory, as
    ``pit-deploy run`` does (docs/run.md).

    ``recipe`` is a shipped run recipe (``default``, ``smoke``, ``gpu-cpt``, ``lora``) or a
    ``.toml`` file; ``out`` defaults to ``runs/<recipe>``. ``overrides`` are ``--set``: a list
    of ``"TABLE.KEY=VALUE"`` texts (the value read as TOML) or a mapping
    ``{"train.steps": 5, "bench.enabled": False}``; ``from_stage`` is ``--from``.

    Returns:
        :class:`~pit_deploy.workflow.pipeline.RunResult`: ``exit_code`` (0, or the failed stage's:
        1 a verification bound, 2 unusable input, 3 an internal error), ``failed_stage`` and
        ``message``, ``stages`` (each stage's ``ran``/``skipped``/``failed``…), ``report`` (the
        path of ``report.md``, ``None`` if none was written), ``out``. A failed stage is a result,
        not an exception: the run still writes its report.

    Raises:
        PitError: an unknown recipe, table, key or value (before any stage runs), an unknown
            ``from_stage``, a run directory that belongs to another recipe (without ``force``) or
            that another run holds.
    """
    from .workflow.pipeline import run_pipeline
    from .workflow.recipe import load_run_recipe

    recipe = _path_arg("run", "recipe", recipe)
    model, data = _path_arg("run", "model", model, optional=True), _path_arg("run", "data", data, optional=True)
    out = _path_arg("run", "out", out, optional=True)
    _bool_args("run", force=force)
    _text_arg("run", "from_stage", from_stage, optional=True)
    _say_arg("run", say)
    say = _sayer(say)
    assignments = _assignments(overrides)
    if model is not None:
        assignments.append(f"run.model={_toml_value(model)}")
    if data is not None:
        assignments.append(f"run.data={_toml_value(data)}")
    loaded = load_run_recipe(recipe, assignments)
    where = out if out else f"runs/{loaded.name}"
    say(f"run {loaded.name} → {where}")
    return run_pipeline(loaded, where, from_stage=from_stage, force=force, say=say)


def _assignments(overrides: Mapping[str, Any] | Sequence[str] | str | None) -> list[str]:
    """``--set`` texts from a list of them, one of them, or a mapping of ``TABLE.KEY`` to values."""
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        bad = [key for key in overrides if not isinstance(key, str)]
        if bad:
            raise PitError(f"run(): overrides keys must be 'TABLE.KEY' texts, got {describe_value(bad[0])}")
        return [f"{key}={_toml_value(value)}" for key, value in overrides.items()]
    items = _sequence_arg("run", "overrides", overrides)
    bad = [o for o in items if not isinstance(o, str)]
    if bad:
        raise PitError(f"run(): overrides must be 'TABLE.KEY=VALUE' texts or a mapping of 'TABLE.KEY' to values, "
                       f"got {describe_value(bad[0])}")
    return list(items)


def _sequence_arg(call: str, name: str, value: Any) -> list[Any]:
    """The items of a list argument (a list or tuple; ``None`` or ``()`` for none)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise PitError(f"{call}(): {name} must be a list, got {describe_value(value)}")
    return list(value)


def _toml_value(value: Any) -> str:
    """A Python value as TOML text (what ``--set`` reads)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")) if not math.isfinite(value) else repr(value)
    if isinstance(value, (str, os.PathLike)):  # a JSON string is a TOML basic string
        return json.dumps(os.fspath(value), ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    raise PitError(f"cannot pass {value!r} as a run recipe value; use a number, text, true/false or a list")
