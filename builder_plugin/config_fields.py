"""Config attributes declared as rows: where each checkpoint layout stores a value, its default and its type.

A key is a dotted path whose first part names a section, one of the JSON objects a layout hands to `read_fields`
(e.g. ``"audio.nemo_conv_settings.conv_channels"``). A null or empty object on the way counts as ``{}``. A tuple of
keys is searched in order, and the first key present wins, even when its value is null.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from builder_plugin.errors import InputError

Layout = Literal["original", "native"]
Key = str | tuple[str, ...]


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED: Any = _Marker("REQUIRED")  # as a default: an absent or null value is an InputError
SAME: Any = _Marker("SAME")  # as the native key or default: the original layout's
_ABSENT: Any = _Marker("ABSENT")


def as_stored(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Field:
    """One attribute of a parsed config: its key in each layout (None: not stored there), default and converter.

    A callable default is computed from the attributes read before this one (rows are read in order). The converter
    also applies to the default.
    """

    name: str
    original: Key | None
    native: Key | None = SAME
    default: Any = REQUIRED
    convert: Callable[[Any], Any] = int
    native_default: Any = SAME
    falsy_is_absent: bool = False  # 0, "" and null also mean "use the default"

    def key(self, layout: Layout) -> Key | None:
        return self.original if layout == "original" or self.native is SAME else self.native

    def default_for(self, layout: Layout) -> Any:
        return self.default if layout == "original" or self.native_default is SAME else self.native_default


@dataclass(frozen=True)
class Check:
    """A check on the sections and the attributes read so far; it runs where it stands among the rows."""

    run: Callable[[Mapping[str, Any], dict[str, Any]], None]


def read_fields(
    rows: tuple[Field | Check, ...], layout: Layout, sections: Mapping[str, Any], section_names: Mapping[str, str]
) -> dict[str, Any]:
    """{attribute: converted value}, rows read in order; `section_names` name a section in a missing-key error."""
    values: dict[str, Any] = {}
    for field in rows:
        if isinstance(field, Check):
            field.run(sections, values)
            continue
        keys = field.key(layout)
        default = field.default_for(layout)
        value = _ABSENT if keys is None else _lookup(sections, keys)
        if value is _ABSENT or (value is None and default is REQUIRED) or (field.falsy_is_absent and not value):
            if default is REQUIRED:
                section, _, key = (keys if isinstance(keys, str) else keys[0]).partition(".")
                raise InputError(f"{section_names[section]} lacks the required key {key!r}")
            value = default(values) if callable(default) else default
        values[field.name] = field.convert(value)
    return values


def _lookup(sections: Mapping[str, Any], keys: Key) -> Any:
    for key in (keys,) if isinstance(keys, str) else keys:
        section, *path = key.split(".")
        node = sections[section]
        for part in path[:-1]:
            node = node.get(part) or {}
        value = node.get(path[-1], _ABSENT)
        if value is not _ABSENT:
            return value
    return _ABSENT
