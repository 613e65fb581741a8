"""Strict conversion of a rendered Envoy config (plain dicts) into envoy-data-plane's typed classes.

`gorgo envoy-config` renders dicts (readable, and what YAML dumps) and converts them here before
writing, so a wrong field, type, enum value or oneof fails at render time with the field's path,
where no Envoy binary runs (`static_resources.clusters[2].connect_timeot: unknown field`).
betterproto2's own ``from_dict`` rejects unknown keys too, but without saying where, and resolves an
Any's ``@type`` only once the payload's module is imported; this walker keeps the path, imports
the payload's module from the type URL and checks the payload (the filters' ``typed_config``) as
strictly. Rendering is off the hot path: converting a full bootstrap takes a few hundred ms, most
of it importing the classes. ``envoy --mode validate`` stays the final judge in the tests (it also
checks what protos cannot say: references between clusters and routes, PGV bounds).
"""

from __future__ import annotations

import importlib
import keyword
import warnings
from collections.abc import Mapping
from typing import Any

import betterproto2
from betterproto2.casing import safe_snake_case

from gorgo.errors import UserError

TYPE_URL_PREFIX = "type.googleapis.com/"
_PACKAGE = "envoy_data_plane"
_INT_TYPES = frozenset({
    betterproto2.TYPE_INT32, betterproto2.TYPE_INT64, betterproto2.TYPE_UINT32,
    betterproto2.TYPE_UINT64, betterproto2.TYPE_SINT32, betterproto2.TYPE_SINT64,
    betterproto2.TYPE_FIXED32, betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED32,
    betterproto2.TYPE_SFIXED64,
})
_INT64_TYPES = frozenset({
    betterproto2.TYPE_INT64, betterproto2.TYPE_UINT64, betterproto2.TYPE_SINT64,
    betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64,
})
_FLOAT_TYPES = frozenset({betterproto2.TYPE_FLOAT, betterproto2.TYPE_DOUBLE})


class EnvoyConfigError(UserError):
    """A rendered Envoy config that the typed classes reject; the message starts with the path."""


def message_class(type_name: str) -> type[betterproto2.Message]:
    """The typed class of a full proto name (``envoy.config.bootstrap.v3.Bootstrap``) or type URL,
    importing its module so that it (and every Any payload it names) is registered."""
    name = type_name.removeprefix(TYPE_URL_PREFIX)
    parts = name.split(".")
    split = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    package = ".".join(p + "_" if keyword.iskeyword(p) else p for p in parts[:split])
    pool = importlib.import_module(f"{_PACKAGE}.message_pool").default_message_pool
    try:
        with warnings.catch_warnings():  # the generated classes use a pydantic-deprecated form
            warnings.simplefilter("ignore", DeprecationWarning)
            importlib.import_module(f"{_PACKAGE}.{package}")
    except ImportError:
        raise KeyError(name) from None
    try:
        return pool.url_to_type[TYPE_URL_PREFIX + name]
    except KeyError:
        raise KeyError(name) from None


def to_typed(type_name: str, data: Any, path: str = "") -> betterproto2.Message:
    """``data`` as an instance of ``type_name``, or an EnvoyConfigError naming the field at fault
    (``path`` prefixes every path, e.g. the file's name)."""
    return _message(message_class(type_name), data, path)


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _fail(path: str, what: str) -> EnvoyConfigError:
    return EnvoyConfigError(f"{path or '<root>'}: {what}")


def _message(cls: type[betterproto2.Message], data: Any, path: str) -> betterproto2.Message:
    if cls.__name__ == "Any" and cls.__module__.endswith("google.protobuf"):
        return _any(cls, data, path)
    if cls.__module__.endswith("google.protobuf"):
        # Well-known types with their own JSON forms (Duration "2s", Struct, wrappers).
        try:
            return cls.from_dict(data)
        except Exception:
            raise _fail(path, f"expected a {cls.__name__}, got {data!r}") from None
    if not isinstance(data, Mapping):
        raise _fail(path, f"expected a mapping ({cls.__name__}), got {type(data).__name__}")
    meta = cls._betterproto
    groups = {f.name: g for g, fields in meta.oneof_field_by_group.items() for f in fields}
    chosen: dict[str, str] = {}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        where = _at(path, str(key))
        # A proto field name as written (consecutive_5xx), else its JSON camelCase form.
        name = str(key) if str(key) in meta.meta_by_field_name else safe_snake_case(str(key))
        if name not in meta.meta_by_field_name:
            raise _fail(where, f"unknown field (in {cls.__name__})")
        group = groups.get(name)
        if group is not None:
            if group in chosen:
                raise _fail(where, f"{chosen[group]!r} is already set: only one of "
                                   f"{sorted(f for f, g in groups.items() if g == group)} may be")
            chosen[group] = str(key)
        if value is None:
            continue
        kwargs[name] = _field(meta.meta_by_field_name[name], meta.cls_by_field[name],
                              cls, name, value, where)
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise _fail(path, f"invalid {cls.__name__}: {_reason(exc)}") from None



def _field(meta: Any, field_cls: Any, owner: type, name: str, value: Any, path: str) -> Any:
    if meta.proto_type == betterproto2.TYPE_MAP:
        if not isinstance(value, Mapping):
            raise _fail(path, f"expected a mapping, got {type(value).__name__}")
        value_cls = owner._betterproto.cls_by_field[f"{name}.value"]
        key_meta, value_meta = meta.map_meta
        return {_scalar(key_meta, type(None), k, f"{path}.{k}"):
                _one(value_meta, value_cls, v, f"{path}.{k}") for k, v in value.items()}
    if meta.repeated:
        if not isinstance(value, list):
            raise _fail(path, f"expected a list, got {type(value).__name__}")
        return [_one(meta, field_cls, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return _one(meta, field_cls, value, path)


def _one(meta: Any, field_cls: Any, value: Any, path: str) -> Any:
    if meta.proto_type != betterproto2.TYPE_MESSAGE:
        return _scalar(meta, field_cls, value, path)
    if meta.unwrap is not None:  # Duration, UInt32Value...: a plain Python value in the class
        msg = _message(meta.unwrap(), value, path)
        return msg.to_wrapped()
    return _message(field_cls, value, path)


def _scalar(meta: Any, field_cls: Any, value: Any, path: str) -> Any:
    kind = meta.proto_type
    if kind == betterproto2.TYPE_ENUM:
        if isinstance(value, str):
            names = field_cls.betterproto_renamed_proto_names_to_value()
            known = {*names, *(m.proto_name or m.name for m in field_cls)}
            if value not in known:
                raise _fail(path, f"unknown {field_cls.__name__} value {value!r}")
            return betterproto2._value_from_dict(value, meta, field_cls, False)
        if isinstance(value, int) and not isinstance(value, bool):
            return field_cls(value)
        raise _fail(path, f"expected an enum name, got {value!r}")
    if kind == betterproto2.TYPE_BOOL:
        ok = isinstance(value, bool)
    elif kind in _INT_TYPES:
        ok = (isinstance(value, int) and not isinstance(value, bool)) or (
            kind in _INT64_TYPES and isinstance(value, str) and value.lstrip("-").isdigit())
    elif kind in _FLOAT_TYPES:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind in (betterproto2.TYPE_STRING, betterproto2.TYPE_BYTES):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise _fail(path, f"expected a {kind}, got {value!r}")
    return betterproto2._value_from_dict(value, meta, field_cls, False)


def _any(cls: type[betterproto2.Message], data: Any, path: str) -> betterproto2.Message:
    if not isinstance(data, Mapping) or not isinstance(data.get("@type"), str):
        raise _fail(_at(path, "@type"), "required (the typed payload's type URL)")
    url = data["@type"]
    try:
        payload_cls = message_class(url)
    except KeyError:
        raise _fail(_at(path, "@type"), f"unknown type {url!r}") from None
    rest = {k: v for k, v in data.items() if k != "@type"}
    if payload_cls.to_dict != betterproto2.Message.to_dict:  # a well-known type: {"value": ...}
        rest = rest.get("value")
    payload = _message(payload_cls, rest, path)
    return cls(type_url=url, value=bytes(payload))


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split("\n")[0:3])


def check_bootstrap(boot: Mapping[str, Any]) -> betterproto2.Message:
    """The rendered bootstrap as envoy.config.bootstrap.v3.Bootstrap (raises EnvoyConfigError)."""
    return to_typed("envoy.config.bootstrap.v3.Bootstrap", boot)


def check_discovery_file(doc: Mapping[str, Any]) -> betterproto2.Message:
    """A filesystem xDS file (``resources:`` of Any, e.g. the clusters Envoy's CDS watches) as
    envoy.service.discovery.v3.DiscoveryResponse, every resource checked by its ``@type``."""
    return to_typed("envoy.service.discovery.v3.DiscoveryResponse", doc)
