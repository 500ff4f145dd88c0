"""One configuration schema read from flags, environment variables and a YAML file.

A component describes its configuration once, as a dataclass whose fields carry metadata made
by :func:`setting`. :func:`build_parser` turns it into command-line flags and
:func:`load_settings` fills it, with precedence *defaults < YAML file < environment < flags*::

    @dataclass
    class RouterConfig:
        port: int = setting(8000, "port to listen on")
        affinity: float = setting(0.9, "affinity strength", minimum=0.0, maximum=1.0)
        workers: list[str] = setting(list, "worker URL (repeatable)", flag="--worker")

    cfg = load_settings(RouterConfig, argv, env_prefix="PREFIXLB_ROUTER_")

The YAML file is named by ``--config FILE`` (or ``<ENV_PREFIX>CONFIG``); its keys are the field
names (dashes or underscores). Environment variables are ``<ENV_PREFIX><FIELD>`` in upper case;
lists in the environment are comma-separated.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import types
import typing
from typing import Any, Callable, Mapping, Sequence, TypeVar

import yaml

T = TypeVar("T")

_MISSING = dataclasses.MISSING


class SettingsError(ValueError):
    """A configuration value is invalid (wrong type, out of range, unknown YAML key)."""


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    env: str | None = None,
    secret: bool = False,
    size: bool = False,
) -> Any:
    """A dataclass field with the metadata :func:`build_parser` and :func:`load_settings` use.

    A ``size`` (an int of bytes) is also accepted as text with a unit: ``16MiB``, ``2GB``
    (:func:`parse_size`), from flags, environment and YAML alike.
    ``default`` may be a zero-argument callable (``list``, ``dict``) for mutable defaults.
    ``choices`` may be a zero-argument callable, asked each time a value is checked or a parser
    is built: the names of a registry that grows at run time (the routing policies).
    ``secret`` values are masked by :func:`describe`.
    """
    meta = {
        "help": help,
        "flag": flag,
        "choices": choices if choices is None or callable(choices) else tuple(choices),
        "minimum": minimum,
        "maximum": maximum,
        "env": env,
        "secret": secret,
        "size": size,
    }
    if default is list or default is dict or default is set:
        return dataclasses.field(default_factory=default, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """(scalar type, optional?) of a field annotation; list[X] gives (list, optional)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner, _ = _base_type(args[0])
        return inner, True
    if origin in (list, Sequence):
        return list, False
    return tp, False


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("help") is not None]


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
          "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
          "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4}


def parse_size(text: str) -> int:
    """Bytes in a size like ``512MiB``, ``2G``, ``1.5GiB`` or ``1048576`` (SettingsError if not one)."""
    m = _SIZE.match(text or "")
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise SettingsError(f"invalid size {text!r}; use e.g. 512MiB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[unit])


def _convert(value: Any, tp: Any, name: str, size: bool = False) -> Any:
    base, optional = _base_type(tp)
    if size and base is int and isinstance(value, str) and value.strip().lower() not in ("", "none", "null"):
        try:
            return parse_size(value)
        except SettingsError as exc:
            raise SettingsError(f"{name}: {exc}") from None
    if value is None:
        if optional:
            return None
        raise SettingsError(f"{name}: a value is required")
    if optional and isinstance(value, str) and value.lower() in ("", "none", "null"):
        return None
    try:
        if base is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base is list:
            if isinstance(value, str):
                return [v.strip() for v in value.split(",") if v.strip()]
            if isinstance(value, (list, tuple)):
                return [str(v) for v in value]
            raise ValueError(value)
        if base is int:
            if isinstance(value, bool):
                raise ValueError(value)
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if base is str:
            if isinstance(value, (dict, list)):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{name}: invalid value {value!r}") from exc
    return value


def _choices(f: dataclasses.Field) -> tuple[Any, ...] | None:
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _check(f: dataclasses.Field, value: Any) -> None:
    choices = _choices(f)
    if choices is not None and value is not None and value not in choices:
        raise SettingsError(f"{f.name}: {value!r} is not one of {', '.join(map(str, choices))}")
    lo, hi = f.metadata.get("minimum"), f.metadata.get("maximum")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (lo is not None or hi is not None) and math.isnan(value):  # NaN compares false with any bound
            raise SettingsError(f"{f.name}: NaN is not a number in range")
        if lo is not None and value < lo:
            raise SettingsError(f"{f.name}: {value} is below the minimum {lo}")
        if hi is not None and value > hi:
            raise SettingsError(f"{f.name}: {value} is above the maximum {hi}")


def build_parser(
    cls: type,
    parser: argparse.ArgumentParser | None = None,
    env_prefix: str = "PREFIXLB_",
    groups: Mapping[str, Sequence[str]] | None = None,
    **parser_kwargs: Any,
) -> argparse.ArgumentParser:
    """Add one flag per field of ``cls`` (plus ``--config FILE``) to ``parser``.

    Flags default to "not given" so that :func:`load_settings` can layer YAML and env beneath.
    ``groups`` (title -> field names) sorts the flags of ``--help`` by topic; a field in no group
    is listed under "other options". A name that is no field is a ValueError.
    """
    if parser is None:
        parser = argparse.ArgumentParser(**parser_kwargs)
    parser.add_argument(
        "--config", default=argparse.SUPPRESS, metavar="FILE",
        help=f"YAML file with settings (keys = option names; env {env_prefix}CONFIG)",
    )
    group_of: dict[str, Any] = {}
    if groups:
        names = {f.name for f, _ in _fields(cls)}
        for title, members in groups.items():
            unknown = [m for m in members if m not in names]
            if unknown:
                raise ValueError(f"help group {title!r} names no setting of {cls.__name__}: {unknown}")
            group = parser.add_argument_group(title)
            group_of.update({m: group for m in members})
        other = parser.add_argument_group("other options")
    for f, tp in _fields(cls):
        target = group_of.get(f.name, other) if groups else parser
        base, _ = _base_type(tp)
        default = f.default if f.default is not _MISSING else (
            f.default_factory() if f.default_factory is not _MISSING else None)  # type: ignore[misc]
        env = f.metadata.get("env") or env_prefix + f.name.upper()
        help_text = f"{f.metadata['help']} (default: {default!r}; env {env})"
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if base is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif base is list:
            kwargs["action"] = "append"
            kwargs["metavar"] = f.name.rstrip("s").upper()
        elif f.metadata.get("size"):
            kwargs["metavar"] = "SIZE"
        else:
            kwargs["metavar"] = f.name.upper()
            choices = _choices(f)
            if choices:
                kwargs["choices"] = choices
                kwargs.pop("metavar")
        target.add_argument(_flag(f), **kwargs)
    return parser


def load_settings(
    cls: Callable[..., T],
    argv: Sequence[str] | argparse.Namespace | None = None,
    env_prefix: str = "PREFIXLB_",
    environ: Mapping[str, str] | None = None,
    yaml_data: Mapping[str, Any] | None = None,
) -> T:
    """Build ``cls`` from defaults, then the YAML file, then the environment, then flags."""
    environ = os.environ if environ is None else environ
    if isinstance(argv, argparse.Namespace):
        given = vars(argv)
    else:
        parser = build_parser(cls, env_prefix=env_prefix)  # type: ignore[arg-type]
        given = vars(parser.parse_args(list(argv or [])))
    config_file = given.get("config") or environ.get(env_prefix + "CONFIG")
    layered: dict[str, Any] = {}
    if yaml_data is None and config_file:
        try:
            with open(config_file, encoding="utf-8") as fh:
                yaml_data = yaml.safe_load(fh) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise SettingsError(f"cannot read config file {config_file}: {exc}") from exc
        if not isinstance(yaml_data, dict):
            raise SettingsError(f"config file {config_file}: expected a mapping at the top level")
    fields = {f.name: (f, tp) for f, tp in _fields(cls)}  # type: ignore[arg-type]
    for key, value in (yaml_data or {}).items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise SettingsError(f"unknown setting {key!r} in config file")
        layered[name] = _convert(value, fields[name][1], name, fields[name][0].metadata.get("size", False))
    for name, (f, tp) in fields.items():
        env = f.metadata.get("env") or env_prefix + name.upper()
        size = f.metadata.get("size", False)
        if env in environ:
            layered[name] = _convert(environ[env], tp, name, size)
        if name in given:
            layered[name] = _convert(given[name], tp, name, size)
    for name, value in layered.items():
        _check(fields[name][0], value)
    obj = cls(**layered)
    for name, (f, _) in fields.items():
        if name not in layered:
            _check(f, getattr(obj, name))
    return obj


def parse_setting(cls: type, name: str, value: Any) -> Any:
    """``value`` for the field ``name`` of ``cls``, converted and checked as a YAML value is.

    For settings that change at run time (``PUT /admin/config``, the config shared through
    Redis): the same types, choices and ranges as at start-up. Raises :class:`SettingsError`.
    """
    fields = {f.name: (f, tp) for f, tp in _fields(cls)}
    if name not in fields:
        raise SettingsError(f"unknown setting {name!r}")
    f, tp = fields[name]
    converted = _convert(value, tp, name, f.metadata.get("size", False))
    _check(f, converted)
    return converted


def describe(obj: Any) -> dict[str, Any]:
    """The settings as a dict, secrets masked (for logs and ``GET /admin/config``): ``secret``
    settings whole, and the password of any URL-valued one (``redis://:pw@host``)."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("secret") and value:
            value = "***"
        elif isinstance(value, str):
            value = redact_url(value)
        elif isinstance(value, list):
            value = [redact_url(v) if isinstance(v, str) else v for v in value]
        out[f.name] = value
    return out


_URL_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*:)(?P<password>[^/?#]*)@")
_SECRET_QUERY = re.compile(r"(?P<key>[?&][^=&#]*(?:password|secret|token)[^=&#]*=)[^&#]*", re.IGNORECASE)


def redact_url(value: str) -> str:
    """``value`` with the password of a URL masked (``redis://user:***@host``, and any
    ``password=``, ``...secret=`` or ``...token=`` query parameter); anything else unchanged."""
    if "://" not in value:
        return value
    value = _URL_USERINFO.sub(r"\g<head>***@", value, count=1)
    return _SECRET_QUERY.sub(r"\g<key>***", value)
