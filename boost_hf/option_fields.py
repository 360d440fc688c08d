"""Options and training-argument fields generated from a settings dataclass, where each setting is declared once.

:class:`~boost_hf.parallel.config.ParallelConfig`, :class:`~boost_hf.precision_config.PrecisionConfig` and
:class:`~boost_hf.data_parallel_config.DataParallelConfig` declare each setting as one field: its type (``Literal``
choices, ``bool``, ``int``, ``X | None``), its default and its help (:func:`setting`). From those fields,

* :func:`add_field_options` adds ``argparse`` options (``--name`` and ``--name-with-dashes``, ``dest`` the field's
  name) to a command (``boost-hf plan``, ``boost-hf estimate``);
* :func:`training_fields` gives ``BoostTrainingArguments`` the same fields (``HfArgumentParser`` parses them from the
  command line and from recipes);
* :func:`settings_of` reads them back from training arguments or an ``argparse`` namespace.

Plain data: it imports no other boost-hf module.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Callable
from dataclasses import Field, field, fields
from typing import Literal, get_args, get_origin


def setting(default, help_text: str) -> Field:
    """A settings dataclass's field: its ``default`` and ``help_text`` (the help of every option made from it)."""
    return field(default=default, metadata={"help": help_text})


def field_types(cls) -> dict[str, object]:
    """Every field's type, resolved (the settings modules write their annotations as strings)."""
    return typing.get_type_hints(cls)


def _optional_inner(kind):
    """``X`` for ``X | None``, else ``kind``."""
    if get_origin(kind) in (typing.Union, types.UnionType):
        return next(arg for arg in get_args(kind) if arg is not type(None))
    return kind


def _choices_of(cls, name: str) -> tuple | None:
    """The ``Literal`` choices of field ``name`` (of ``X`` in ``X | None``), or ``None``."""
    kind = _optional_inner(field_types(cls)[name])
    return get_args(kind) if get_origin(kind) is Literal else None


def _option_help(f: Field, note: str = "") -> str:
    """The help of field ``f`` (plus ``note``), escaped for ``argparse``'s %-formatting."""
    return (f.metadata["help"] + note).replace("%", "%%")


def _parse_bool(text: str) -> bool:
    """``true``/``yes``/``1`` or ``false``/``no``/``0`` (any case) from the command line."""
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _dashed(name: str) -> list[str]:
    """``--name`` and, for a name with underscores, ``--name-with-dashes``."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def add_field_options(cls, parser, *, exclude: tuple[str, ...] = (), defaults: dict | None = None,
                      notes: dict | None = None, several: tuple[str, ...] = (),
                      short_names: dict[str, tuple[str, ...]] | None = None,
                      parsers: dict[str, Callable[[str], object]] | None = None,
                      metavars: dict[str, str] | None = None) -> None:
    """Add every field of settings dataclass ``cls`` but ``exclude`` to ``parser`` (or an argument group) as an option
    whose ``dest`` is the field's name. The command's own: ``defaults``, ``notes`` (appended to the help), ``several``
    (fields that take several values, a search: ``nargs="+"``), ``short_names`` (more spellings of a field) and
    ``parsers`` (a field's own text parser, e.g. a comma-separated list, shown as ``metavars`` says). A ``bool`` field takes ``--name``,
    ``--name true|false``, and, defaulting to true, ``--no_name``."""
    defaults, notes, short_names, parsers, metavars = defaults or {}, notes or {}, short_names or {}, parsers or {}, metavars or {}
    kinds = field_types(cls)
    for f in fields(cls):
        if f.name in exclude:
            continue
        spellings = [option for name in (f.name, *short_names.get(f.name, ())) for option in _dashed(name)]
        options = dict(dest=f.name, default=defaults.get(f.name, f.default), help=_option_help(f, notes.get(f.name, "")))
        kind, choices = _optional_inner(kinds[f.name]), _choices_of(cls, f.name)
        if f.name in several:
            parser.add_argument(*spellings, nargs="+", choices=choices, **options)
        elif f.name in parsers:
            parser.add_argument(*spellings, type=parsers[f.name], metavar=metavars.get(f.name), **options)
        elif kind is bool:
            parser.add_argument(*spellings, type=_parse_bool, nargs="?", const=True, **options)
            if f.default is True:
                parser.add_argument(*_dashed(f"no_{f.name}"), dest=f.name, action="store_false", help=f"--{f.name} false.")
        elif choices is not None:
            parser.add_argument(*spellings, choices=choices, **options)
        else:
            parser.add_argument(*spellings, type=kind, **options)


def training_fields(cls, *, names: dict[str, str] | None = None, kinds: dict[str, object] | None = None,
                    defaults: dict | None = None, notes: dict | None = None) -> list[tuple[str, object, Field]]:
    """``BoostTrainingArguments``' fields for settings dataclass ``cls``, for ``dataclasses.make_dataclass``:
    ``(name, type, field)``; ``names``, ``kinds``, ``defaults`` and ``notes`` (appended to the help) are where a training
    argument differs from the declaration."""
    names, kinds, defaults, notes = names or {}, kinds or {}, defaults or {}, notes or {}
    declared = field_types(cls)
    return [(names.get(f.name, f.name), kinds.get(f.name, declared[f.name]),
             field(default=defaults.get(f.name, f.default), metadata={"help": _option_help(f, notes.get(f.name, ""))}))
            for f in fields(cls)]


def settings_of(cls, args):
    """The ``cls`` settings that ``args`` (training arguments, an ``argparse`` namespace) holds; a field ``args`` lacks
    takes its default."""
    return cls(**{f.name: getattr(args, f.name, f.default) for f in fields(cls)})


__all__ = [
    "add_field_options",
    "field_types",
    "setting",
    "settings_of",
    "training_fields",
]
