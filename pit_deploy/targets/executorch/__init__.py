"""The ``executorch`` target: a ``.pte`` program lowered to XNNPACK, with a static KV cache.

Artifact layout (``docs/export.md``): :data:`PTE_NAME` (``forward(tokens, input_pos)``, the
``embed``/``head`` methods verification reads the interface through, and the metadata methods
of ExecuTorch's LLM runner) and the stock runner's ``tokenizer.json``
(:mod:`pit_deploy.targets.executorch.runner_tokenizer`). Exporter:
:mod:`pit_deploy.targets.executorch.export`; driver: :mod:`pit_deploy.targets.executorch.driver`;
on a device: ``PteDecoder`` of :mod:`pit_deploy.runtime.standalone`, or ExecuTorch's own
``llama_main`` over adb (:mod:`pit_deploy.targets.executorch.bench_adb`).

What only this target has: ``verify`` also runs every program through ExecuTorch's stock LLM
runner (:mod:`pit_deploy.targets.executorch.stock_runner`), and ``bench`` times it there too.

Standard library only at import; the hooks import what they call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import register_target
from ..base import EmulatedEngine, Target, VerifyContext, WeightGrid, resolve

PTE_NAME = "model.pte"
#: the tag of a program's external constants: they go to ``DATA_TAG + ".ptd"`` beside the ``.pte``
#: (a shared token table: :func:`pit_deploy.targets.executorch.export.export_pte`)
DATA_TAG = "model"
PTD_NAME = DATA_TAG + ".ptd"
#: the most token ids one call of the program's ``embed`` interface method takes, and the most
#: hidden vectors one call of its ``head`` takes; verification calls them in chunks. Memory
#: planning sizes each method's buffers for its largest call, and the runtime allocates them when
#: the program is loaded: with all ``V`` ids at once the default model's ``embed`` planned 216 MiB
#: that every process loading the program held (``studies/pte-memory.md``).
INTERFACE_IDS = 1024
INTERFACE_HIDDEN_ROWS = 64
#: the ``variant`` of the benchmark cells timed through the stock runner
RUNNER_VARIANT = "stock runner"

#: ExecuTorch's aarch64 wheel (XNNPACK) with PyTorch's, which imports it: the program runs through
#: :mod:`pit_deploy.targets.executorch.emulated_pte_runner`. PyTorch's aarch64 wheel is a CUDA
#: build, so it loads on the set-up's stand-ins for the CUDA libraries (``stubs``); the wheels'
#: libraries use ARMv8.1+ instructions, so the ARMv8.0 profiles stop it with an illegal instruction
PTE_AARCH64 = EmulatedEngine(
    key="executorch", title="the ExecuTorch runtime", runner="pit_deploy.targets.executorch.emulated_pte_runner",
    describe="qemu {qemu_version}, executorch {executorch} (aarch64, XNNPACK), torch {torch}",
    site="executorch_site", library_path="stubs", armv8_0=False, slow=True)

#: int4 with one 4-bit token table for the gather and the head (studies/pte-head-and-table.md, "One token
#: table for the gather and the head"): the head a 4-bit linear behind the grid-exact S = T R, the gather
#: over its very codes, stored once in model.ptd; smaller than int4's .pte, at a higher KL. Rotated and
#: GPTQ-rounded (the table too) as int4 is: studies/table_gptq.py measured 0.055 / 0.115 / 0.111
#: (code / prose / chat) in eager.
INT4_SHARED = {"name": "int4-shared", "dtype": "int4", "bounds": "int4",
               "description": "the int4 scheme's body with one 4-bit token table that the .pte's gather and its "
                              "quantized head both read, stored once (model.ptd beside model.pte)",
               "table_bits": 4, "int4_8bit_layers": ("v_proj", "down_proj"), "pte_shared_table": True,
               "rounding": "gptq", "rotate_residual": True}


class ExecuTorchXnnpackTarget(Target):
    name = "executorch"
    title = "ExecuTorch .pte (XNNPACK, static KV cache)"
    module = "executorch"
    package = "executorch"
    dtypes = ("float32", "int8", "int4")
    static_cache = True
    exporter = "pit_deploy.targets.executorch.export:export_artifact"
    driver = "pit_deploy.targets.executorch.driver:ExecuTorchDriver"
    standalone = ("pit_deploy.runtime.standalone", "PteDecoder")
    bundle_install = "executorch"
    primary_file = PTE_NAME
    phone = True
    ship_priority = 10
    weight_check = "pit_deploy.targets.executorch.stored_weights:check_pte_weights"
    #: ``verify --isa aarch64`` runs the program on ExecuTorch's aarch64 wheel
    #: (:mod:`pit_deploy.targets.executorch.emulated_pte_runner`) through the same methods as the driver:
    #: ``forward``, and ``embed``/``head`` in chunks of these sizes
    own_schemes = (INT4_SHARED,)
    aarch64_engine = PTE_AARCH64
    aarch64_layout = "pte"
    aarch64_interface_chunks = (INTERFACE_IDS, INTERFACE_HIDDEN_ROWS)
    aarch64_blocker = ("ExecuTorch's aarch64 wheel executes ARMv8.1+ instructions (LSE atomics, dot products) "
                       "that ARMv8.0 cores lack: the emulated CPU stops it with an illegal instruction")
    scheme_settings = Target.scheme_settings + ("pte_head_bits", "pte_shared_table", "rounding", "rotate_residual")

    def aarch64_graphs(self, folder: Path) -> tuple[Path, Path]:
        """The program holds the decoder (``forward``) and the interface (``embed``/``head``)."""
        return folder / PTE_NAME, folder / PTE_NAME

    def aarch64_job(self) -> dict[str, Any]:
        """The chunk sizes of the interface calls (the driver's: the runner replays its calls)."""
        return {"interface_chunks": list(self.aarch64_interface_chunks)}

    def precheck(self, config: Any, recipe: Any) -> None:
        resolve("pit_deploy.targets.executorch.export:precheck")(config, recipe)

    def weight_grid(self, scheme: Any, mode: str) -> WeightGrid:
        """torchao ``8da4w``/``8da8w`` linears (symmetric; 8-bit ones per output channel), the
        gather's symmetric ``table_bits`` table, and a float32 head unless a factorized program
        asks for ``pte_head_bits``; torchao quantizes ``nn.Linear`` only, so GPT-2's ``Conv1D``
        body stays float32 (:mod:`pit_deploy.targets.executorch.export`)."""
        return WeightGrid(symmetric=True, per_channel_8bit=True,
                          head_bits=scheme.pte_quantized_head_bits if mode == "factorized" else 0,
                          embed_bits=scheme.table_bits, conv1d=False)

    def shapes(self, config: Any, mode: str, recipe: Any) -> dict[str, Any]:
        v = config.vocab_size
        return {**super().shapes(config, mode, recipe),
                "forward": {"tokens": [1, "S"], "input_pos": [1], "logits": [1, "S", v]}}

    def verify_extras(self, ctx: VerifyContext, art: Any, result: Any, quantized: bool) -> None:
        """The stock LLM runner's greedy texts must equal PyTorch's (fp32; recorded for quantized)."""
        check = resolve("pit_deploy.targets.executorch.stock_runner:check_stock_runner")(
            ctx.directory / art.path, ctx.reference, ctx.tokenizer, ctx.text_prompts, ctx.greedy_tokens,
            art.shapes.get("max_seq_len"), ctx.cache.setdefault("stock_runner", {}))
        result.stock_runner = check.to_dict()
        if check.skipped:
            result.notes.append(f"stock LLM runner not run: {check.skipped}")
        elif check.identical is False and quantized:
            result.notes.append("the stock LLM runner's greedy text differs from the fp32 reference's "
                                "(expected of a quantized artifact; judged by its KL bounds)")

    def bench_cells(self, cell: dict[str, Any], tokenizer: Any, vocab: int, prompt_len: int,
                    threads: tuple[int, ...], folder: Path) -> list[dict[str, Any]]:
        """The same ``.pte`` timed through ExecuTorch's stock LLM runner: its own tokenizer,
        prefill and decode loop, and its ``Stats`` — the figures ``llama_main`` prints on a phone."""
        if tokenizer is None or not (folder / resolve("pit_deploy.targets.executorch.llm_runner:RUNNER_TOKENIZER")).is_file():
            return []
        text, _ = resolve("pit_deploy.evaluate.bench:prompt_text")(tokenizer, vocab, prompt_len)
        runner = resolve("pit_deploy.targets.executorch.llm_runner:RUNNER_NAME")
        return [{**cell, "target": self.name, "variant": RUNNER_VARIANT, "threads": t, "prompt_text": text,
                 "meta": {**cell["meta"], "runtime": runner, "variant": RUNNER_VARIANT, "threads": t}}
                for t in threads]

    def measure_variant(self, cell: dict[str, Any], timeout: float) -> tuple[dict[str, Any] | None, list[str]]:
        row = resolve("pit_deploy.targets.executorch.stock_runner:measure_runner_cell")(cell, timeout)
        meta, warnings = cell["meta"], []
        if row is None:
            return None, [f"{meta['artifact']} (stock runner, {meta['threads']} threads): not timed — it generated a "
                          "piece that is not whole UTF-8, which its Python binding cannot hand over, so it "
                          "reported no figures"]
        if row["generated_tokens"] < meta["gen_len"] - 1:
            warnings.append(f"{meta['artifact']} (stock runner): stopped after {row['generated_tokens']} "
                            f"generated tokens (an end-of-sequence token), not {meta['gen_len']}")
        return row, warnings


TARGET = register_target(ExecuTorchXnnpackTarget())
