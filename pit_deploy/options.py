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
from typing import Any, Callable


def opt(default: Any, help: str = "", *, group: str = "options", flag: str | None = None,
        choices: tuple[str, ...] | None = None, cli: bool = True, parse: str | None = None,
        metavar: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with what its command-line flag needs.

    ``flag`` names a flag other than ``--field-name`` (e.g. ``--no-progress`` for a field that
    defaults to true); ``cli=False`` keeps a field off the command line; ``parse`` names the
    parser of :data:`PARSERS` when the field's annotation does not say it; ``metavar`` names the
    flag's value in ``--help`` (default: the field name in capitals); ``aliases``: other spellings
    of the flag that argparse takes as the same option (``--scheme`` for ``--dtype``)."""
    meta = {"help": help, "group": group, "flag": flag, "choices": choices, "cli": cli, "parse": parse,
            "metavar": metavar, "aliases": tuple(aliases)}
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
    #: other spellings of the flag (``argparse`` option strings after the first)
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every option string of the flag, the main one first."""
        return (self.flag, *self.aliases)


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


PARSERS: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float, "list[str]": comma_list, "tuple[str, ...]": comma_list,
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
        flags.append(Flag(flag=meta.get("flag") or flag_name(f.name), dest=f.name, group=meta["group"], kwargs=kwargs,
                          aliases=tuple(meta.get("aliases") or ())))
    return flags


def is_int(value: Any) -> bool:
    """An integer, and not a ``bool`` (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _all(value: Any, test: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(test(v) for v in value)


#: annotation (without ``| None``) → (test of a value, what a fitting value is)
_KINDS: dict[str, tuple[Any, str]] = {
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "int": (is_int, "an integer"),
    "float": (_is_number, "a number"),
    "str": (lambda v: isinstance(v, str), "text (a str)"),
    "list[str]": (lambda v: isinstance(v, str) or _all(v, lambda x: isinstance(x, str)),
                  "a list of names or a comma list"),
    "tuple[str, ...]": (lambda v: isinstance(v, str) or _all(v, lambda x: isinstance(x, str)),
                        "a list of names or a comma list"),
    "tuple[int, ...]": (lambda v: is_int(v) or isinstance(v, str) or _all(v, is_int),
                        "an integer, a list of integers or a comma list"),
    "tuple[float, float]": (lambda v: isinstance(v, str) or (_all(v, _is_number) and len(v) == 2),
                            "two numbers (a pair, or a comma list like '0.9,0.95')"),
}


def type_problem(value: Any, annotation: str) -> str | None:
    """What is wrong with ``value`` as the value of a field annotated ``annotation`` (its text:
    ``int``, ``float | None``, ``tuple[str, ...]``), or ``None`` when it fits. Text fits a
    list-valued field (a comma list, as on the command line); an int fits a float; a bool fits
    only a bool. An annotation not listed here (a table of bounds) is left to its dataclass."""
    optional = annotation.endswith(" | None")
    kind = annotation[: -len(" | None")] if optional else annotation
    if value is None:
        return None if optional else f"must be {_KINDS[kind][1]}, not None" if kind in _KINDS else None
    if kind.startswith("dict["):
        return None if isinstance(value, dict) else "must be a table (a dict)"
    if kind not in _KINDS:
        return None
    test, what = _KINDS[kind]
    if test(value):
        return None
    if optional:
        what = "True, False or None" if kind == "bool" else f"{what} or None"
    return f"must be {what}"


def check_types(cls: type, values: dict[str, Any], name_of: Any = flag_name) -> None:
    """Refuse a value of the wrong type for a field of dataclass ``cls`` (before the dataclass
    compares or computes with it), naming the field by ``name_of(field name)``.

    Raises:
        PitError: ``<name> must be …, got <value> (<type>)``.
    """
    from .errors import PitError

    annotations = {f.name: str(f.type) for f in fields(cls)}
    for name, value in values.items():
        problem = type_problem(value, annotations[name]) if name in annotations else None
        if problem:
            raise PitError(f"{name_of(name)} {problem}, got {describe_value(value)}")


def describe_value(value: Any) -> str:
    """``value`` as an error message shows it: its repr (cut to 60 characters) and its type."""
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({type(value).__name__})"
