"""Turn a Hugging Face causal LM into a PIT model (the paper's inits), or give a fresh model a
random PIT interface.

A converted model is still the same ``PreTrainedModel`` class (``generate`` and the rest keep
working): its input embedding is replaced by :class:`~pit_deploy.model.modules.PITEmbedding`,
its head by :class:`~pit_deploy.model.modules.PITHead`, both sharing one
:class:`~pit_deploy.model.core.PITInterface` registered on the model as ``pit_interface``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from transformers import PreTrainedModel

from ..errors import PitError
from ..model.choices import CONVERSIONS
from ..model.core import T_INITS, PITSpec, init_from_embedding, init_random
from ..model.families import adapter_for
from ..model.inspect import check_finite, effective_interface, is_pit, tying_of
from ..model.pit_model import install_interface, pit_config_block

log = logging.getLogger(__name__)


def default_conversion(config: Any) -> str:
    """The conversion a plain model gets when none is named: ``preserve`` where the family
    allows it (it keeps what the source knew), else ``output``, the paper init that disturbs
    least (``docs/conversion.md``)."""
    from .preserve import supports_preserve

    return "preserve" if supports_preserve(config) else "output"


def check_tokenizer_fits(tokenizer: Any, config: Any) -> None:
    """Refuse a tokenizer with more ids than the model has embedding rows: the ids above would
    index past the table (conversion, verification) or be dropped from an exported file.

    Raises:
        PitError: ``len(tokenizer)`` exceeds ``config.vocab_size`` by other than special tokens.
    """
    if tokenizer is None:
        return
    try:
        ids = len(tokenizer)
    except TypeError:
        return
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab and ids > vocab and not _special_only(tokenizer, vocab, ids):
        raise PitError(f"the tokenizer has {ids} ids and the model's vocabulary {vocab}: ids {vocab}–{ids - 1} have no "
                       "embedding row; use the tokenizer the model was trained with (or resize the model's embeddings)")


#: the tokenizers already warned about special tokens past the vocabulary
_WARNED: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _special_only(tokenizer: Any, vocab: int, ids: int) -> bool:
    """Whether every id past the vocabulary is a special added token (Gemma 3's text models keep
    the multimodal ``<image_soft_token>`` one id past their table): plain text never encodes to
    it, so the model is used as its makers ship it, with a warning."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    extra = [added.get(i) for i in range(vocab, ids)]
    if not extra or any(token is None or not getattr(token, "special", False) for token in extra):
        return False
    try:
        if tokenizer in _WARNED:  # convert checks the tokenizer three times; say it once
            return True
        _WARNED.add(tokenizer)
    except TypeError:  # not weakly referenceable: warn every time
        pass
    log.warning("the tokenizer's special token%s %s (id%s %s) ha%s no embedding row: text that spells %s out "
                "cannot be run", "s" if len(extra) > 1 else "", ", ".join(str(t) for t in extra),
                "s" if len(extra) > 1 else "", ", ".join(str(i) for i in range(vocab, ids)),
                "ve" if len(extra) > 1 else "s", "them" if len(extra) > 1 else "it")
    return True


def convert_model(
    model: PreTrainedModel,
    t_init: str = "identity",
    spec: PITSpec = PITSpec(),
    source: dict[str, Any] | None = None,
    tokenizer: Any = None,
    calib: str = "default",
    calib_tokens: int = 4096,
) -> PreTrainedModel:
    """Convert a plain causal LM (tied or untied) into a PIT model, in place.

    ``Z`` is the polar factor of the *effective* input embedding ``E0`` and ``T`` follows
    ``t_init`` (see :func:`pit_deploy.model.core.init_from_embedding`). An untied source converts
    from its input embedding; its separate head is discarded, which is logged and recorded
    in the ``pit`` config block as ``source_tying: untied``.

    ``t_init="preserve"`` is the source-preserving conversion (:mod:`.preserve`): the body is
    rotated and the final gain refitted on calibration text (``calib``, ``calib_tokens``,
    tokenized with ``tokenizer``) so the converted model stays close to the source.

    Raises:
        PitError: unsupported architecture, a vocabulary smaller than the hidden size,
            non-finite or rank-deficient embedding, a model that is already PIT.
    """
    if is_pit(model):
        raise PitError("the model is already a PIT model; nothing to convert")
    try:
        adapter = adapter_for(model.config)
    except KeyError as exc:
        raise PitError(str(exc.args[0])) from None
    # the source's own tables, checked as stored: a float64 effective copy of each (1.3 GB apiece
    # for a 262k-token vocabulary) is made only by the paper inits, which need it
    embedding = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings()
    tying = tying_of(model)
    vocab, hidden = embedding.shape
    if vocab < hidden:
        raise PitError(f"the vocabulary ({vocab} tokens, vocab_size) is smaller than the hidden size ({hidden}, "
                       "hidden_size): PIT's token memory Z (vocab_size × hidden_size) has orthonormal columns, which "
                       "needs at least as many tokens as hidden dimensions; this model cannot be converted to PIT")
    check_finite("the input embedding", embedding)
    if tying == "untied":
        check_finite("the output head", head.weight.detach())
        log.warning(
            "source model has an untied head: converting from its input embedding; the "
            "separate head weights are discarded"
        )
    if t_init not in CONVERSIONS:
        raise PitError(f"unknown --t-init {t_init!r}; choose one of {', '.join(CONVERSIONS)}")
    check_tokenizer_fits(tokenizer, model.config)
    extra: dict[str, Any] = {}
    if t_init == "preserve":
        from .preserve import preserve_convert

        for name, param in model.named_parameters():
            check_finite(name, param.detach())
        interface, fit = preserve_convert(model, tokenizer, spec, calib, calib_tokens)
        extra = {"preserve": fit.to_dict()}
    else:
        e_eff, _, _ = effective_interface(model)
        try:
            interface = init_from_embedding(e_eff, t_init, spec)
        except ValueError as exc:
            raise PitError(f"cannot convert the embedding: {exc}") from None
    interface = interface.to(model.get_input_embeddings().weight.dtype)
    block = pit_config_block(
        spec, t_init=t_init, init="polar-rotated" if t_init == "preserve" and not adapter.post_norms else "polar",
        source_tying=tying, source=source, adapter=adapter,
    )
    block.update(extra)
    install_interface(model, interface, adapter, block)
    interface.to(next(model.parameters()).device)
    return model


def from_scratch(model: PreTrainedModel, generator: torch.Generator | None = None,
                 spec: PITSpec = PITSpec(), method: str = "qr") -> PreTrainedModel:
    """Give a freshly initialized model a random-Stiefel PIT interface (``T = I``), in place."""
    adapter = adapter_for(model.config)
    v, d = model.get_input_embeddings().weight.shape
    interface = init_random(v, d, generator, method, spec)  # type: ignore[arg-type]
    block = pit_config_block(spec, t_init="identity", init=f"random-{method}",
                             source_tying="none", source=None, adapter=adapter)
    return install_interface(model, interface, adapter, block)
