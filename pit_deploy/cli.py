"""The ``pit-deploy`` command line.

Each sub-command is one ``add_<name>`` function that declares its arguments and one
``run_<name>`` function that does the work. User mistakes surface as
:class:`~pit_deploy.errors.PitError`: one line on stderr, exit code 2, nothing written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

from .errors import PitError, as_write_error, command_line

Handler = Callable[[argparse.Namespace], int]


def terminate_like_interrupt() -> None:
    """Handle SIGTERM (a job scheduler, ``kill``, ``torchrun`` stopping its workers) like
    Ctrl-C: the ``KeyboardInterrupt`` unwinds through the atomic writers, which remove their
    temporary directories, so a stopped command leaves no partial output behind."""
    import signal

    def _interrupt(signum, _frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
    # A blocked signal mask is inherited across exec (from a launcher, or a parent thread that
    # had SIGTERM blocked while it started us): unblock, or the handler would never run.
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def stage(message: str) -> None:
    """A progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"[pit-deploy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------


def add_convert(sub: argparse._SubParsersAction) -> None:
    from .model.choices import DIAGONAL_MAPS

    p = sub.add_parser("convert", help="convert a causal LM into a PIT model")
    p.add_argument("--model", required=True, help="default | GGUF file | HF directory | hub id")
    p.add_argument("--out", required=True, help="output directory (PIT checkpoint)")
    from .model.choices import CONVERSIONS, MAX_LOSS_RISE

    p.add_argument("--t-init", default=None,
                   help=f"{' | '.join(CONVERSIONS)} (default: preserve where the family allows it, else output)")
    p.add_argument("--calib", default="default", help="calibration text for --t-init preserve (default: the default corpus)")
    p.add_argument("--calib-tokens", type=int, default=4096, help="calibration tokens for --t-init preserve (default 4096)")
    p.add_argument("--diagonal", default="softplus", help=f"map to L's diagonal: {' | '.join(DIAGONAL_MAPS)}")
    p.add_argument("--train-z", action="store_true", help="mark Z trainable (retracted after each step)")
    p.add_argument("--max-loss-rise", type=float, default=None, metavar="NATS",
                   help="refuse (exit 1, nothing written) a conversion whose held-out NLL rises by more than this "
                        f"(default {MAX_LOSS_RISE:g} nats/token)")
    p.add_argument("--accept-loss", action="store_true",
                   help="keep a conversion past --max-loss-rise (a paper init or a Gemma 2/3 model you will train)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code (off by default)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from .api import convert

    terminate_like_interrupt()
    bound = {} if args.max_loss_rise is None else {"max_loss_rise": args.max_loss_rise}
    convert(args.model, args.out, t_init=args.t_init, calib=args.calib, calib_tokens=args.calib_tokens,
            diagonal=args.diagonal, train_z=args.train_z, force=args.force, accept_loss=args.accept_loss,
            trust_remote_code=args.trust_remote_code, say=stage, **bound)
    return 0


# --------------------------------------------------------------------------------------
# diagnose
# --------------------------------------------------------------------------------------


def add_diagnose(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("diagnose", help="token-interface metrics of a model (PIT, tied or untied)")
    p.add_argument("model", help="default | GGUF file | HF directory | PIT directory | hub id")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--extended", action="store_true", help="also the polar-factor distance (slower)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(handler=run_diagnose)


def run_diagnose(args: argparse.Namespace) -> int:
    from .analysis.diagnostics import diagnose_model
    from .io.sources import load_source

    stage(f"loading {args.model}")
    loaded = load_source(args.model, trust_remote_code=args.trust_remote_code, with_tokenizer=False)
    stage("computing interface metrics (float64)")
    report = diagnose_model(loaded.model, extended=args.extended)
    report.extra["source"] = loaded.source
    print(report.to_json() if args.json else report)
    return 0


# --------------------------------------------------------------------------------------
# probe
# --------------------------------------------------------------------------------------


def add_probe(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="logit-lens trace: each layer read through the head and both token interfaces")
    p.add_argument("model", help="default | GGUF file | HF directory | PIT directory | hub id")
    p.add_argument("--prompt", default="def fibonacci(n):\n    return", help="text to trace (needs a tokenizer)")
    p.add_argument("--ids", help="comma-separated token ids instead of --prompt")
    p.add_argument("--position", type=int, default=-1, help="which position to trace (default: last)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--plot", help="write a PNG of the trace here")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(handler=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    import torch

    from .analysis.probe import logit_lens
    from .io.sources import load_source

    if args.top_k < 1:
        raise PitError(f"--top-k must be at least 1, got {args.top_k}")
    if args.plot:
        from .analysis.plotting import check_image_path

        check_image_path(args.plot, "--plot", inputs=(args.model,))
    stage(f"loading {args.model}")
    loaded = load_source(args.model, trust_remote_code=args.trust_remote_code)
    vocab = loaded.model.config.vocab_size
    if args.top_k > vocab:
        raise PitError(f"--top-k {args.top_k} exceeds the vocabulary of {vocab} tokens")
    if args.ids:
        try:
            ids = [int(x) for x in args.ids.split(",")]
        except ValueError:
            raise PitError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
        vocab = loaded.model.config.vocab_size
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise PitError(f"--ids must be non-empty and within [0, {vocab})")
        input_ids = torch.tensor([ids])
    elif loaded.tokenizer is None:
        raise PitError(f"{args.model} has no tokenizer; pass --ids instead of --prompt")
    else:
        input_ids = loaded.tokenizer(args.prompt, return_tensors="pt").input_ids
    length = input_ids.shape[1]
    if not -length <= args.position < length:
        raise PitError(f"--position {args.position} is outside the {length}-token prompt")
    trace = logit_lens(loaded.model, input_ids, loaded.tokenizer, args.position, args.top_k)
    if args.plot:
        stage(f"plot: {trace.plot(args.plot)}")
    print(trace.to_json() if args.json else trace)
    return 0


# --------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------


def add_export(sub: argparse._SubParsersAction) -> None:
    """The recipe flags are generated from :class:`~pit_deploy.exporters.recipes.Recipe`'s fields;
    a flag that is not given leaves the recipe's value (or the scheme's) as it is."""
    from .exporters.recipes import Recipe
    from .options import dataclass_flags

    from .targets import get_target, target_names

    targets = ", ".join(f"{n} ({get_target(n).title})" for n in target_names())
    p = sub.add_parser("export", help=f"export a PIT model for deployment targets: {', '.join(target_names())}",
                       description=f"Export a PIT model to the targets: {targets}. `pit-deploy list` shows the "
                       "targets, schemes and recipes.")
    p.add_argument("model", help="PIT directory | default | GGUF file | HF directory | hub id (plain models are converted first)")
    p.add_argument("--out", required=True, help="export directory (written atomically)")
    from .exporters.recipes import available_recipes

    p.add_argument("--recipe", help=f"export recipe: {' | '.join(available_recipes())}, a name in ./export/ or a "
                   ".toml/.json path (flags override it)")
    for flag in dataclass_flags(Recipe, defaults=False):
        p.add_argument(*flag.names, dest=flag.dest, **flag.kwargs)
    from .model.choices import CONVERSIONS

    p.add_argument("--t-init", default=None,
                   help=f"conversion of a plain model: {' | '.join(CONVERSIONS)} (default: preserve where allowed, else output)")
    p.add_argument("--keep-tying", action="store_true",
                   help="export the source model without conversion (the transpose-tied baseline; mode 'tied')")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    from .api import export
    from .exporters.recipes import recipe_fields

    recipe = {name: getattr(args, name) for name in recipe_fields() if hasattr(args, name)}
    terminate_like_interrupt()
    export(args.model, args.out, recipe=args.recipe, runtime=recipe.pop("runtimes"), mode=recipe.pop("modes"),
           dtype=recipe.pop("dtype"), t_init=args.t_init, keep_tying=args.keep_tying, force=args.force, say=stage,
           **recipe)
    return 0


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check an export directory's artifacts on their runtimes")
    p.add_argument("directory", help="export directory written by `pit-deploy export`")
    p.add_argument("--runtime", "--target", dest="runtime", metavar="TARGETS",
                   help="comma list of targets to verify (default: all in the manifest)")
    p.add_argument("--mode", help="comma list of modes to verify (default: all in the manifest)")
    p.add_argument("--dtype", "--scheme", dest="dtype", metavar="SCHEMES",
                   help="comma list of schemes to verify (default: all in the manifest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-record", action="store_true", help="do not write the results into manifest.json")
    p.add_argument("--expect-sha256", default=None, metavar="HASH",
                   help="refuse unless manifest.json, without its recorded results, has this sha256 (pin an "
                   "export you trust: sha256sum of the fresh manifest, or the pin verify prints)")
    p.add_argument("--web", default=None, metavar="CLIENTS",
                   help="also run each onnx folder through transformers.js and judge it by the same bounds: "
                   "comma list of node (onnxruntime-node), chromium (onnxruntime-web in headless Chromium); "
                   "needs `bash scripts/setup_web.sh` once")
    p.add_argument("--isa", default=None, metavar="ISAS",
                   help="whose runtime kernels run the artifacts: x86_64 (default), aarch64 (the ONNX and .pte "
                   "artifacts on onnxruntime's and ExecuTorch's aarch64 builds under qemu emulation; needs `bash "
                   "scripts/setup_aarch64.sh` once; only x86_64 results are recorded), or x86_64,aarch64")
    p.add_argument("--arm-cpu", default=None, metavar="CPUS",
                   help="with --isa aarch64: comma list of emulated CPU profiles (default: cortex-a53,cortex-a76,max: "
                   "plain NEON, dotprod, dotprod + i8mm)")
    p.add_argument("--kleidiai", default=None, metavar="SETTINGS",
                   help="with --isa aarch64: on (default), off, or on,off: onnxruntime's KleidiAI kernels (ONNX artifacts)")
    p.add_argument("--full", action="store_true",
                   help="with --isa aarch64: run the whole verification emulated (about an hour of a core per "
                   "artifact and profile for a 135M model) instead of the compact check that the artifact computes "
                   "on aarch64 what it computes on x86 (minutes; docs/verify.md)")
    p.set_defaults(handler=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from .api import verify

    report = verify(args.directory, runtime=args.runtime, mode=args.mode, dtype=args.dtype, record=not args.no_record,
                    expect_sha256=args.expect_sha256, web=args.web, isa=args.isa, arm_cpu=args.arm_cpu,
                    kleidiai=args.kleidiai, full=args.full, say=stage)
    print(report.to_json() if args.json else report)
    return 0 if report.passed else 1


# --------------------------------------------------------------------------------------
# train
# --------------------------------------------------------------------------------------


def add_train(sub: argparse._SubParsersAction) -> None:
    """The flags are generated from :class:`~pit_deploy.training.config.TrainConfig`: each field's
    default, help text, group and (where it differs from ``--field-name``) flag live there."""
    from .training.config import GROUPS, config_flags

    p = sub.add_parser(
        "train",
        help="continued / from-scratch pretraining or LoRA, with PIT or transpose tying",
        description="Train a causal LM with PIT or transpose tying (TT). Runs on CPU or CUDA; "
        "under `torchrun --nproc-per-node N` it trains with DDP. See docs/training.md.",
    )
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    for flag in config_flags():
        groups[flag.group].add_argument(*flag.names, dest=flag.dest, **flag.kwargs)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="read every option from a JSON file of them (what `pit-deploy run` hands a torchrun child)")
    p.set_defaults(handler=run_train)


def run_train(args: argparse.Namespace) -> int:
    import dataclasses

    from .api import train
    from .io.fs import json_text
    from .training.config import TrainConfig

    terminate_like_interrupt()
    if args.config:
        result = train(config=args.config, say=stage)
    else:
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        result = train(say=stage, **{k: v for k, v in vars(args).items() if k in fields})
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every rank has the result; one prints it
        print(json_text(dataclasses.asdict(result)))
    return 0


# --------------------------------------------------------------------------------------
# plot
# --------------------------------------------------------------------------------------


def add_plot(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plot", help="overlay the loss curves of training runs (PIT vs TT)")
    p.add_argument("runs", nargs="+", help="run directories written by `pit-deploy train`")
    p.add_argument("--out", default="loss.png", help="PNG file to write")
    p.add_argument("--title", default=None)
    p.set_defaults(handler=run_plot)


def run_plot(args: argparse.Namespace) -> int:
    from .analysis.plotting import RunLog, check_image_path, plot_runs

    check_image_path(args.out, "--out", inputs=tuple(args.runs), make_parents=True)
    runs = [RunLog.load(r) for r in args.runs]
    path = plot_runs(runs, args.out, args.title)
    for run in runs:
        print(run.summary())
    stage(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------
# bench
# --------------------------------------------------------------------------------------


def add_bench(sub: argparse._SubParsersAction) -> None:
    """The measurement flags are generated from :class:`~pit_deploy.evaluate.bench.BenchOptions`."""
    from .evaluate.bench import BenchOptions
    from .options import dataclass_flags

    p = sub.add_parser("bench", help="latency, memory and size of exported artifacts on this machine")
    p.add_argument("directories", nargs="*", help="export directories written by `pit-deploy export`")
    for flag in dataclass_flags(BenchOptions):  # --torch, --threads, --prompt-len, --gen-len, --reps
        p.add_argument(*flag.names, dest=flag.dest, **flag.kwargs)
    p.add_argument("--json", action="store_true", help="print one JSON object with a `rows` list")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--plot", default=None, help="write a PNG chart")
    p.add_argument("--bundle", default=None, metavar="OUT.tar.gz",
                   help="instead of measuring here, pack the artifacts with a standalone run_bench.py "
                   "(needs only numpy + onnxruntime or the executorch runtime) for another device")
    p.add_argument("--force", action="store_true", help="with --bundle: replace an existing OUT.tar.gz")
    p.add_argument("--ingest", action="append", default=[], metavar="ROWS.json",
                   help="instead of measuring, read the rows a bundle's run_bench.py wrote (repeatable)")
    p.add_argument("--adb", action="store_true",
                   help="measure the .pte artifacts on an Android phone over adb with ExecuTorch's llama_main")
    p.add_argument("--serial", default=None, help="with --adb: the device's serial (see `adb devices`)")
    p.add_argument("--runner", default=None, metavar="PATH", help="with --adb: llama_main built for the phone")
    p.add_argument("--device-dir", default=None,
                   help="with --adb: working directory on the device (default /data/local/tmp/pit-bench)")
    p.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """``bench``'s four modes, one API call each (measure here, ``--bundle``, ``--ingest``,
    ``--adb``), after the checks of which flags combine."""
    from . import api

    if args.force and not args.bundle:
        raise PitError("--force applies to --bundle only (--out and --plot are replaced as they are)")
    if args.bundle and args.ingest:
        raise PitError("--bundle packs a benchmark for another device and --ingest reads its rows back: "
                       "use one at a time")
    if args.adb:
        clash = [f for f, v in (("--bundle", args.bundle), ("--ingest", args.ingest), ("--torch", args.torch_model)) if v]
        if clash:
            raise PitError(f"--adb measures on a phone; it does not combine with {', '.join(clash)}")
        if not args.runner:
            raise PitError("--adb needs --runner PATH: ExecuTorch's llama_main built for the phone (docs/bench.md)")
    elif args.serial or args.runner or args.device_dir:
        raise PitError("--serial, --runner and --device-dir apply to --adb only")
    if args.ingest and (args.directories or args.torch_model):
        raise PitError("--ingest reads rows measured elsewhere; do not also pass directories or --torch")
    shape = dict(threads=args.threads, prompt_len=args.prompt_lens, gen_len=args.gen_len, reps=args.reps)
    if args.bundle:
        if args.torch_model:
            raise PitError("--bundle packs exported artifacts only; a --torch row needs this package (run it here)")
        if args.out or args.plot:
            raise PitError("--bundle writes an archive and measures nothing: --out and --plot do not apply")
        api.bench_bundle(*args.directories, out=args.bundle, force=args.force, say=stage, **shape)
        return 0
    if args.adb:
        result = api.bench_adb(*args.directories, runner=args.runner, serial=args.serial, device_dir=args.device_dir,
                               out=args.out, plot=args.plot, say=stage, **shape)
    elif args.ingest:
        result = api.bench_ingest(*args.ingest, out=args.out, plot=args.plot, say=stage)
    else:
        result = api.bench(*args.directories, torch=args.torch_model, out=args.out, plot=args.plot, say=stage,
                           **shape)
    print(result.to_json(indent=2) if args.json else result)
    return 0


# --------------------------------------------------------------------------------------
# run: the one command
# --------------------------------------------------------------------------------------


def add_run(sub: argparse._SubParsersAction) -> None:
    from .workflow.recipe import available_run_recipes

    p = sub.add_parser("run", help="convert → train → export → verify → bench → report, in one run directory")
    p.add_argument("recipe", nargs="?", default="default",
                   help=f"run recipe: {' | '.join(available_run_recipes())}, or a .toml file (default: default)")
    p.add_argument("--model", default=None, help="source model (overrides run.model): default | GGUF | HF dir | hub id")
    p.add_argument("--data", default=None, help="training/evaluation data (overrides run.data)")
    p.add_argument("--out", default=None, help="run directory (default: runs/<recipe>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="TABLE.KEY=VALUE",
                   help="override a recipe key, e.g. --set train.steps=50 (repeatable)")
    from .workflow.recipe import STAGES

    p.add_argument("--from", dest="from_stage", default=None,
                   help=f"redo this stage and every later one: {' | '.join(STAGES)}")
    p.add_argument("--force", action="store_true", help="reuse a run directory made by another recipe")
    p.set_defaults(handler=run_run)


def run_run(args: argparse.Namespace) -> int:
    from .api import run

    terminate_like_interrupt()
    result = run(args.recipe, model=args.model, data=args.data, out=args.out, overrides=args.overrides,
                 from_stage=args.from_stage, force=args.force, say=stage)
    if result.report:
        print(f"report: {result.report} (and {Path(result.report).with_suffix('.html')})")
    if result.exit_code:
        print(f"error: stage {result.failed_stage} failed: {result.message}", file=sys.stderr)
    return result.exit_code


# --------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------


def add_list(sub: argparse._SubParsersAction) -> None:
    from .workflow.catalog import KINDS

    p = sub.add_parser("list", help=f"what the registries hold: {', '.join(KINDS)}")
    p.add_argument("kind", nargs="?", default=None, help=f"{' | '.join(KINDS)} (default: all four)")
    p.set_defaults(handler=run_list)


def run_list(args: argparse.Namespace) -> int:
    from .workflow.catalog import KINDS, listing

    print(listing([args.kind] if args.kind else KINDS))
    return 0


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------

COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_run, add_convert, add_diagnose, add_probe, add_train, add_plot, add_export, add_verify, add_bench, add_list
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pit-deploy",
        description="Pseudo-Inverse Tying for compact LMs: convert, train, export, verify.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def _quiet_libraries() -> None:
    """Keep third-party chatter (deprecations, progress bars) off the user's terminal."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="warning: %(message)s")
    for noisy in ("huggingface_hub", "urllib3", "torchao", "torch.utils._pytree", "torch._dynamo"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        _quiet_libraries()
    try:
        with command_line():  # the API's messages keep naming flags
            return int(args.handler(args) or 0)
    except PitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130
    except Exception as exc:  # an internal error: exit 3, one line (docs/conventions.md)
        mapped = as_write_error(exc)
        if mapped is not None:  # a full disk, a size limit, a read-only target: the user's to fix (exit 2)
            print(f"error: {mapped}", file=sys.stderr)
            return 2
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"error: internal error ({type(exc).__name__}: {exc}); this is a bug in pit-deploy or a "
              "library it uses — rerun with --debug for the traceback", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
