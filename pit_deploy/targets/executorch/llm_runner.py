"""ExecuTorch's stock LLM runner over a ``.pte`` artifact folder.

The ``executorch`` wheel ships the C++ runner behind ``llama_main`` (``TextLLMRunner``,
``extension/llm/runner``) as Python bindings (``executorch.extension.llm.runner``). It reads
the program's metadata methods, tokenizes with its own C++ tokenizer, prefills, decodes and
reports ``Stats`` — the numbers a phone's ``llama_main`` prints. ``verify`` uses it to check
that a stock consumer of the artifact generates what PyTorch generates (the tokenizer file
included) and ``bench`` uses its ``Stats`` as a row.

The runner always runs in a child process (``python -m pit_deploy.targets.executorch.llm_runner SPEC
RESULT``): the C++ code prints to the process's own stdout, and a crash (a tokenizer it cannot
parse, a program it cannot load) must not take the caller down. This module imports nothing of
this package at module level, so the child starts fast.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

RUNNER_TOKENIZER = "tokenizer.json"
RUNNER_NAME = "executorch-llm-runner"


class LLMRunnerError(RuntimeError):
    """The stock runner could not load or run the artifact; the message holds its last output."""


#: the runner's ``Stats`` fields, named as in the JSON line ``llama_main`` prints after
#: ``PyTorchObserver `` (``extension/llm/runner/stats.h``)
STATS_FIELDS = ("model_load_start_ms", "model_load_end_ms", "inference_start_ms", "token_encode_end_ms",
                "model_execution_start_ms", "model_execution_end_ms", "prompt_eval_end_ms", "first_token_ms",
                "inference_end_ms", "aggregate_sampling_time_ms", "SCALING_FACTOR_UNITS_PER_SECOND")


def stats_dict(stats: Any) -> dict[str, Any]:
    """The Python binding's ``Stats`` as the dict of the runner's printed stats line."""
    data = {name: getattr(stats, name) for name in STATS_FIELDS}
    data.update(prompt_tokens=stats.num_prompt_tokens, generated_tokens=stats.num_generated_tokens)
    return data


#: the stats line's timestamps in the order the runner takes them (each ≥ the one before), and the
#: token counts
_ORDERED_STAMPS = (("model_load_start_ms", "model_load_end_ms"),
                   ("inference_start_ms", "prompt_eval_end_ms", "inference_end_ms"),
                   ("inference_start_ms", "first_token_ms"))
_COUNTS = ("prompt_tokens", "generated_tokens")


def stats_problem(stats: Any) -> str | None:
    """What makes a stats line impossible (``None``: nothing): a missing or non-numeric field,
    a non-finite or negative value, a token count that is not a positive integer (at least one
    prompt token; the generated count may be 0 only if the runner stopped at once), a time
    that runs backwards, or a scaling factor that is not positive. Figures computed from such a
    line (a time to first token of −1e308 ms) would be nonsense."""
    if not isinstance(stats, dict):
        return "the stats line is not a JSON object"
    stamps = {name for group in _ORDERED_STAMPS for name in group}
    for name in sorted(stamps) + list(_COUNTS) + ["SCALING_FACTOR_UNITS_PER_SECOND"]:
        value = stats.get(name)
        if value is None and name == "SCALING_FACTOR_UNITS_PER_SECOND":
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"{name} is {value!r}, not a number"
        if not math.isfinite(value) or value < 0:
            return f"{name} is {value!r}; it must be finite and non-negative"
    for name in _COUNTS:
        if stats[name] != int(stats[name]):
            return f"{name} is {stats[name]!r}, not a whole number"
    if stats["prompt_tokens"] < 1:
        return f"prompt_tokens is {stats['prompt_tokens']}; the runner read no prompt"
    if stats.get("SCALING_FACTOR_UNITS_PER_SECOND") == 0:
        return "SCALING_FACTOR_UNITS_PER_SECOND is 0"
    for group in _ORDERED_STAMPS:
        for earlier, later in zip(group, group[1:]):
            if stats[later] < stats[earlier]:
                return f"{later} ({stats[later]!r}) precedes {earlier} ({stats[earlier]!r})"
    return None


def pass_figures(stats: dict[str, Any]) -> dict[str, float]:
    """One invocation's figures from its stats line. The runner's timestamps are whole
    milliseconds (``SCALING_FACTOR_UNITS_PER_SECOND`` per second): prefill runs from
    ``inference_start_ms`` (which includes encoding the prompt) to ``prompt_eval_end_ms``;
    its last logits give the first token (``first_token_ms``); the decode loop runs from
    ``prompt_eval_end_ms`` to ``inference_end_ms`` and makes ``generated_tokens`` tokens
    (the prefill's token not among them). An interval of 0 units is below the clock's
    resolution: its rate is NaN, not infinite.

    Raises:
        ValueError: an impossible stats line (:func:`stats_problem`).
    """
    problem = stats_problem(stats)
    if problem:
        raise ValueError(f"impossible runner stats: {problem}")
    unit = float(stats.get("SCALING_FACTOR_UNITS_PER_SECOND") or 1000)

    def seconds(a: str, b: str) -> float:
        return (float(stats[b]) - float(stats[a])) / unit

    prefill_s = seconds("inference_start_ms", "prompt_eval_end_ms")
    decode_s = seconds("prompt_eval_end_ms", "inference_end_ms")
    generated, prompt = int(stats["generated_tokens"]), int(stats["prompt_tokens"])
    return {
        "prefill_tok_s": prompt / prefill_s if prefill_s > 0 else math.nan,
        "decode_tok_s": generated / decode_s if decode_s > 0 and generated > 0 else math.nan,
        "decode_ms_per_token": decode_s * 1e3 / generated if generated > 0 else math.nan,
        "ttft_ms": seconds("inference_start_ms", "first_token_ms") * 1e3,
        "load_s": seconds("model_load_start_ms", "model_load_end_ms"),
        "prompt_tokens": prompt, "generated_tokens": generated,
    }


def generate_in_process(pte: str, tokenizer: str, prompts: Sequence[str], max_new_tokens: int,
                        threads: int | None = None, reps: int = 1) -> list[dict[str, Any]]:
    """Greedy generation of each prompt (temperature 0, no BOS added, prompt not echoed).

    Each prompt runs ``reps`` times (the runner's KV cache reset between runs); the pieces of
    the first run and the ``Stats`` figures of every run are returned. The binding hands pieces
    over as ``str``, so a generated piece that is not whole UTF-8 ends the prompt's generation
    with a ``UnicodeDecodeError``: its result then has ``"partial_utf8": True`` and the pieces
    before it, and its remaining runs are not made.
    """
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    from pit_deploy.runtime.standalone import load_llm_custom_ops, pte_data_file, set_executorch_threads

    load_llm_custom_ops()  # the decoders of Llama-style families call llama::update_cache/custom_sdpa
    set_executorch_threads(threads)
    data = pte_data_file(pte)  # model.ptd beside model.pte: a program whose constants live outside it
    runner = TextLLMRunner(pte, tokenizer, None if data is None else str(data))
    results = []
    for prompt in prompts:
        pieces: list[str] = []
        runs: list[dict[str, float]] = []
        partial = False
        for rep in range(reps):
            got: list[str] = []
            stats: list[Any] = []
            runner.reset()
            config = GenerationConfig(echo=False, max_new_tokens=int(max_new_tokens), temperature=0.0)
            try:
                runner.generate(prompt, config, token_callback=got.append, stats_callback=stats.append)
            except UnicodeDecodeError:
                partial = True
            if rep == 0:
                pieces = got
            if stats:
                runs.append(stats_dict(stats[-1]))
            if partial:
                break
        result: dict[str, Any] = {"prompt": prompt, "pieces": pieces, "text": "".join(pieces), "runs": runs}
        if partial:
            result["partial_utf8"] = True
        results.append(result)
    return results


def generate(folder: str | Path, prompts: Sequence[str], max_new_tokens: int, threads: int | None = None,
             reps: int = 1, timeout: float = 1800.0) -> dict[str, Any]:
    """:func:`generate_in_process` in a child process over ``folder/model.pte`` and
    ``folder/tokenizer.json``: ``{"results": [one per prompt], "peak_rss_mb": the child's peak
    resident memory}``.

    Raises:
        FileNotFoundError: the folder has no ``model.pte`` or no tokenizer file.
        LLMRunnerError: the runner failed (its last output lines in the message) or timed out.
    """
    folder = Path(folder)
    pte, tokenizer = folder / "model.pte", folder / RUNNER_TOKENIZER
    for path in (pte, tokenizer):
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
    with tempfile.TemporaryDirectory(prefix="pit-llm-runner-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec = {"pte": str(pte), "tokenizer": str(tokenizer), "prompts": list(prompts),
                "max_new_tokens": int(max_new_tokens), "threads": threads, "reps": int(reps)}
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        try:
            proc = subprocess.run([sys.executable, "-m", __name__, str(spec_path), str(result_path)],
                                  capture_output=True, text=True, timeout=timeout, env=_child_env())
        except subprocess.TimeoutExpired:
            raise LLMRunnerError(f"the ExecuTorch LLM runner did not finish within {timeout:.0f} s") from None
        if proc.returncode != 0 or not result_path.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise LLMRunnerError(f"the ExecuTorch LLM runner failed (exit {proc.returncode}):\n{tail}")
        return json.loads(result_path.read_text(encoding="utf-8"))


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # the child imports this module by name: make the package importable from where it lives
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def main(argv: Sequence[str]) -> int:
    """Child-process entry point: ``SPEC.json RESULT.json``."""
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    results = generate_in_process(spec["pte"], spec["tokenizer"], spec["prompts"], spec["max_new_tokens"],
                                  spec.get("threads"), spec.get("reps", 1))
    from pit_deploy.runtime.standalone import peak_rss_mb

    Path(argv[1]).write_text(json.dumps({"results": results, "peak_rss_mb": peak_rss_mb()}), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
