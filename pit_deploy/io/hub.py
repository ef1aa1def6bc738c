"""What a Hugging Face Hub id looks like: ``name`` or ``namespace/name`` of letters, digits,
``_``, ``.`` and ``-`` (https://huggingface.co/docs/hub/repositories). One pattern for model
sources (which need a namespace here, so that a mistyped local path is not sent to the hub) and
datasets (where canonical ids such as ``wikitext`` have none). Standard library only."""

from __future__ import annotations

import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_hub_id(text: str, need_namespace: bool = False) -> bool:
    """Whether ``text`` has the shape of a hub id (and a ``namespace/`` when asked)."""
    if text.startswith((".", "~")) or not _HUB_ID.match(text):
        return False
    return "/" in text or not need_namespace
