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
from typing import Callable, Sequence

from .errors import PitError

Handler = Callable[[argparse.Namespace], int]


def stage(message: str) -> None:
    """A progress line on stderr (stdout stays clean for ``--json``)."""
    print(f"[pit-deploy {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------


def add_convert(sub: argparse._SubParsersAction) -> None:
    from .core import DIAGONAL_MAPS, T_INITS

    p = sub.add_parser("convert", help="convert a causal LM into a PIT model")
    p.add_argument("--model", required=True, help="default | GGUF file | HF directory | hub id")
    p.add_argument("--out", required=True, help="output directory (PIT checkpoint)")
    p.add_argument("--t-init", default="identity", help=f"T initialization: {' | '.join(T_INITS)}")
    p.add_argument("--diagonal", default="softplus", help=f"map to L's diagonal: {' | '.join(DIAGONAL_MAPS)}")
    p.add_argument("--train-z", action="store_true", help="mark Z trainable (retracted after each step)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code (off by default)")
    p.set_defaults(handler=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from .checkpoint import check_output_dir, save_model
    from .core import DIAGONAL_MAPS, T_INITS, PITSpec
    from .convert import convert_model
    from .diagnostics import diagnose_model
    from .sources import load_source

    if args.t_init not in T_INITS:
        raise PitError(f"unknown --t-init {args.t_init!r}; choose one of {', '.join(T_INITS)}")
    if args.diagonal not in DIAGONAL_MAPS:
        raise PitError(f"unknown --diagonal {args.diagonal!r}; choose one of {', '.join(DIAGONAL_MAPS)}")
    check_output_dir(args.out, args.force)  # fail before the slow load
    stage(f"loading {args.model}")
    loaded = load_source(args.model, trust_remote_code=args.trust_remote_code)
    if loaded.is_pit:
        raise PitError(f"{args.model} is already a PIT model; nothing to convert")
    stage(f"converting to PIT (T init: {args.t_init})")
    model = convert_model(
        loaded.model, args.t_init, PITSpec(diagonal=args.diagonal, train_z=args.train_z), loaded.source
    )
    report = diagnose_model(model)
    stage(f"delta_ti = {report.delta_ti:.3e}; saving to {args.out}")
    save_model(model, args.out, loaded.tokenizer, force=args.force)
    stage("done")
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
    from .diagnostics import diagnose_model
    from .sources import load_source

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

    from .probe import logit_lens
    from .sources import load_source

    stage(f"loading {args.model}")
    loaded = load_source(args.model, trust_remote_code=args.trust_remote_code)
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
    p = sub.add_parser("export", help="export a PIT model to ONNX and/or ExecuTorch (.pte)")
    p.add_argument("model", help="PIT directory | default | GGUF file | HF directory | hub id (plain models are converted first)")
    p.add_argument("--out", required=True, help="export directory (written atomically)")
    p.add_argument("--recipe", help="recipe name in export/ or a .toml/.json path (flags override it)")
    p.add_argument("--runtime", help="comma list of onnx, executorch (default: all)")
    p.add_argument("--mode", help="comma list of materialized, factorized (default: all)")
    p.add_argument("--dtype", help="float32 (default)")
    p.add_argument("--max-seq-len", type=int, help="static KV cache length of the .pte (default 256)")
    p.add_argument("--t-init", default="identity", help="T initialization when a plain model is converted first")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> int:
    import signal

    from .checkpoint import check_output_dir
    from .recipes import Recipe, load_recipe

    recipe = load_recipe(args.recipe) if args.recipe else Recipe()
    recipe = recipe.override(runtimes=args.runtime, modes=args.mode, dtype=args.dtype,
                             max_seq_len=args.max_seq_len)
    check_output_dir(args.out, args.force)  # fail before the slow load

    def _terminate(signum, _frame):  # SIGTERM cleans up like Ctrl-C: no partial directory
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    from .export import export_model, load_pit_source

    stage(f"loading {args.model}")
    loaded = load_pit_source(args.model, args.t_init, progress=stage)
    manifest = export_model(loaded, args.out, recipe, force=args.force, progress=stage)
    total = sum(a.bytes for a in manifest.artifacts)
    stage(f"done: {len(manifest.artifacts)} artifact(s), {total / 2**20:.1f} MiB in {args.out}; "
          f"run `pit-deploy verify {args.out}`")
    return 0


# --------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check an export directory's artifacts on their runtimes")
    p.add_argument("directory", help="export directory written by `pit-deploy export`")
    p.add_argument("--runtime", help="comma list of runtimes to verify (default: all in the manifest)")
    p.add_argument("--mode", help="comma list of modes to verify (default: all in the manifest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-record", action="store_true", help="do not write the results into manifest.json")
    p.set_defaults(handler=run_verify)


def run_verify(args: argparse.Namespace) -> int:
    from .verify import verify_directory

    stage(f"verifying {args.directory}")
    report = verify_directory(args.directory, args.runtime, args.mode, record=not args.no_record)
    print(report.to_json() if args.json else report)
    return 0 if report.passed else 1


# --------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------

COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_convert, add_diagnose, add_probe, add_export, add_verify
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pit-deploy",
        description="Pseudo-Inverse Tying for compact LMs: convert, train, export, verify.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show library warnings")
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
        return int(args.handler(args) or 0)
    except PitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; nothing partial was left behind", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
