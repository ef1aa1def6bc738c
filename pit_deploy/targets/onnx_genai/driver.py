"""Driver of the ``onnx-genai`` target (:mod:`pit_deploy.targets.onnx_genai`).

Prefill and step run the folder's ``model.onnx`` — the builder's fused decoder that
``onnxruntime_genai`` runs — in a plain ``onnxruntime.InferenceSession``
(:class:`~pit_deploy.runtime.standalone.OrtDecoder`, which bench bundles carry too): full logits of every
prompt position are needed for verification, and ``onnxruntime_genai``'s generator exposes the
logits of the last appended tokens only through its own shared-buffer KV cache. The session
feeds the graph's inputs the way genai does (``input_ids``, ``attention_mask`` of the total
length, ``past_key_values.N.key/value`` grown by each step's ``present.N.*``). The generator
itself is checked against this session by :func:`check_generator` (verify's extra for the
target), so both ways of running the folder are measured.

``interface()`` (and ``interface_defect()``) run ``interface.onnx``, the decoder's own embedding and head nodes reading the
decoder's weight bytes (:func:`shared_interface_weights` checks that).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...errors import PitError
from ...runtime.base import loading
from ...runtime.ort_driver import OrtDriver
from . import CONFIG_NAME, DECODER_NAME, INTERFACE_NAME

__all__ = ["GenaiDriver", "check_generator", "shared_interface_weights"]

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
#: the generator runs the very graph the decoder session runs: their logits agree to the fp32
#: parity bound, whatever the artifact's dtype
GENERATOR_REL_L2 = 1e-4


class GenaiDriver(OrtDriver):
    """The builder's decoder through :class:`~pit_deploy.runtime.standalone.OrtDecoder`, as the
    ``onnx`` target's driver runs optimum's; only the interface graph's batched inputs and output
    names differ."""

    runtime = "onnx-genai"

    def decoder_path(self) -> Path:
        return self.folder / DECODER_NAME

    def interface_path(self) -> Path:
        return self.folder / INTERFACE_NAME

    def interface_runner(self, vocab: int, dim: int) -> tuple[Callable[[np.ndarray, np.ndarray],
                                                                       tuple[np.ndarray, np.ndarray]], type]:
        import onnxruntime as ort

        path = self.interface_path()
        with loading(path, "onnxruntime"):
            sess = ort.InferenceSession(str(path), sess_options=self.session_options(),
                                        providers=["CPUExecutionProvider"])
        inputs = {i.name: i.type for i in sess.get_inputs()}
        outputs = {o.name for o in sess.get_outputs()}
        if set(inputs) != {"input_ids", "hidden"} or not {"embeddings", "head_logits"} <= outputs \
                or inputs["hidden"] not in _NP:
            raise PitError(f"{path} is not an interface graph (inputs {sorted(inputs)}, outputs {sorted(outputs)}; "
                           "expected input_ids and hidden in, embeddings and head_logits out); re-export")

        def run(ids: np.ndarray, hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            with loading(path, "onnxruntime"):
                emb, logits = sess.run(["embeddings", "head_logits"], {"input_ids": ids[None], "hidden": hidden[None]})
            emb, logits = np.asarray(emb), np.asarray(logits)
            if emb.shape != (1, len(ids), dim) or logits.shape != (1, len(hidden), vocab):
                raise PitError(f"{path} gives embeddings {emb.shape[1:]} and head logits {logits.shape[1:]} for "
                               f"{len(ids)} ids and {len(hidden)} basis rows, not {(len(ids), dim)} and "
                               f"{(len(hidden), vocab)}: it is not this artifact's interface graph; re-export")
            return emb[0], logits[0]

        return run, _NP[inputs["hidden"]]


def shared_interface_weights(folder: Path, min_elements: int) -> tuple[bool, str]:
    """Are ``interface.onnx``'s large initializers the decoder's very bytes?

    The exporter writes them as references into the decoder's external data file; here the
    bytes each one reads are hashed where they lie and looked up among the decoder's
    initializers (so a rewritten or re-pointed interface graph is caught, not just a renamed
    one), as for the ``onnx`` target's folders.
    """
    from ...runtime.onnx_shared_weights import shared_between

    return shared_between(folder / INTERFACE_NAME, folder / DECODER_NAME, min_elements)


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def check_generator(ctx: Any, art: Any, result: Any, quantized: bool) -> None:
    """Run the folder through ``onnxruntime_genai`` itself: the generator's logits of a prompt
    and of a few greedy steps against :class:`GenaiDriver`'s, a bound (:data:`GENERATOR_REL_L2`,
    in ``result.target_checks``): the runtime people use must run the graph verify measured.

    Raises:
        PitError: ``onnxruntime_genai`` cannot load or run the folder (the artifact would be
            useless to the people it is for).
    """
    folder = ctx.directory / art.path
    prompt = np.arange(3, 11, dtype=np.int64)
    steps = 4
    # the decoder session's logits of the prompt and the greedy steps first, the generator's after:
    # each loads the folder's weights, and opened together they held them twice
    refs: list[np.ndarray] = []
    refused = None
    driver = GenaiDriver(folder)
    try:
        refs.append(driver.prefill(torch.from_numpy(prompt)).numpy()[-1])
        for i in range(steps - 1):
            refs.append(driver.step(int(refs[-1].argmax()), len(prompt) + i).numpy())
    except RuntimeError as exc:  # the runtime refuses to run the folder: it fails the check
        refused = _first_line(exc)
    finally:
        driver.close()
    del driver
    with loading(folder / CONFIG_NAME, "onnxruntime_genai"):
        import onnxruntime_genai as og

        model = og.Model(str(folder))
    with loading(folder / "tokenizer.json", "onnxruntime_genai's tokenizer"):
        og.Tokenizer(model)  # what an app built on the folder loads beside the model
    errors: list[float] = []
    try:
        if refused is None:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(prompt) + steps, do_sample=False)
            generator = og.Generator(model, params)
            generator.append_tokens(prompt[None])
            for i, ref in enumerate(refs):
                got = np.asarray(generator.get_output("logits"), dtype=np.float32).reshape(-1, ref.shape[-1])[-1]
                errors.append(float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)))
                if i + 1 < steps:
                    generator.append_tokens(np.array([[int(ref.argmax())]], np.int64))
    except RuntimeError as exc:  # the runtime refuses to generate with this folder: it fails the check
        refused = _first_line(exc)
    worst, bound = (float(np.max(errors)) if refused is None else math.inf), GENERATOR_REL_L2  # NaN propagates
    fails = [] if worst <= bound else [
        f"onnxruntime_genai's generator cannot generate {steps} tokens after an {len(prompt)}-token prompt with this "
        f"folder ({refused})" if refused is not None else
        f"onnxruntime_genai's generator differs from the decoder session verify measured: max rel L2 {worst:.3e} > "
        f"{bound:g} (does {CONFIG_NAME} name another decoder?)"]
    result.target_checks = {**(result.target_checks or {}), "genai_generator": {
        "rel_l2": worst, "bound": bound, "steps": steps, "failures": fails}}
    result.notes.append(f"onnxruntime_genai generator vs decoder session: max rel L2 {worst:.2e} over "
                        f"prefill + {steps - 1} steps")
