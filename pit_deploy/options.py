"""Options as dataclass fields that carry their own flag, help text and group, so a command's
flags are generated from the dataclass and every default lives in exactly one place.

Used by the training config (``pit-deploy train``) and the export recipe (``pit-deploy
export``); the run recipe's tables are these same dataclasses, so ``pit-deploy run --set
TABLE.KEY=VALUE`` reaches every field (``docs/design.md``, "Configuration").

Standard library only.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any


def opt(default: Any, help: str = "", *, group: str = "options", flag: str | None = None,
        choices: tuple[str, ...] | None = None, cli: bool = True, parse: str | None = None,
        metavar: str | None = None) -> Any:
    """A dataclass field with what its command-line flag needs.

    ``flag`` names a flag other than ``--field-name`` (e.g. ``--no-progress`` for a field that
    defaults to true); ``cli=False`` keeps a field off the command line; ``parse`` names the
    parser of :data:`PARSERS` when the field's annotation does not say it; ``metavar`` names the
    flag's value in ``--help`` (default: the field name in capitals)."""
    meta = {"help": help, "group": group, "flag": flag, "choices": choices, "cli": cli, "parse": parse,
            "metavar": metavar}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``cls`` (``None`` when it has none)."""
    f = next((f for f in fields(cls) if f.name == name), None)
    if f is None:
        return None
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Flag:
    """One flag derived from a dataclass field (``argparse`` keywords)."""

    flag: str
    dest: str
    group: str
    kwargs: dict[str, Any]


def comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def float_pair(text: str) -> tuple[float, float]:
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 2:
        raise argparse.ArgumentTypeError(f"expected two comma-separated numbers, got {text!r}")
    return values  # type: ignore[return-value]


PARSERS = {"str": str, "int": int, "float": float, "list[str]": comma_list, "tuple[str, ...]": comma_list,
           "tuple[float, float]": float_pair}


def dataclass_flags(cls: type, *, defaults: bool = True, required: tuple[str, ...] = ()) -> list[Flag]:
    """The flags of every command-line field of dataclass ``cls``, in field order.

    Booleans that default to false are ``store_true``; those that default to true take the
    field's ``flag`` (``--no-…``) as ``store_false``; ``X | None`` fields parse as ``X``. With
    ``defaults=False`` every flag defaults to ``None`` (an override that was not given), so a
    recipe's own value stands unless the flag is passed."""
    flags = []
    for f in fields(cls):
        meta = f.metadata
        if not meta.get("cli", True):
            continue
        default = field_default(cls, f.name)
        kwargs: dict[str, Any] = {"help": meta.get("help") or None}
        kind = meta.get("parse") or str(f.type).replace(" | None", "")
        if kind == "bool":
            negated = default or (default is None and (meta.get("flag") or "").startswith("--no-"))
            kwargs["action"] = "store_false" if negated else "store_true"
            if not defaults:
                kwargs["default"] = None
        else:
            kwargs["type"] = PARSERS[kind]
            kwargs["default"] = default if defaults else None
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            if f.name in required:
                kwargs["required"] = True
        flags.append(Flag(flag=meta.get("flag") or flag_name(f.name), dest=f.name, group=meta["group"], kwargs=kwargs))
    return flags
