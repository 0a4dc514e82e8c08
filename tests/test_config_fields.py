import pytest

from builder_plugin.config_fields import REQUIRED, Check, Field, as_stored, read_fields
from builder_plugin.errors import InputError

NAMES = {"main": "config.json"}


def test_keys_defaults_and_converters_per_layout() -> None:
    rows = (
        Field("size", "main.size"),
        Field("width", "main.width", default=lambda v: v["size"] * 2),
        Field("depth", "main.nested.depth", "main.depth", 3, native_default=5),
        Field("heads", ("main.first", "main.second"), default=1, falsy_is_absent=True),
        Field("mode", None, "main.mode", "a", str),
        Field("raw", "main.raw", default=None, convert=as_stored),
    )
    sections = {"main": {"size": "4", "nested": None, "second": 0, "mode": "b"}}
    assert read_fields(rows, "original", sections, NAMES) == {
        "size": 4, "width": 8, "depth": 3, "heads": 1, "mode": "a", "raw": None
    }  # fmt: skip
    sections = {"main": {"size": 4, "depth": 7, "first": 6, "second": 2, "mode": "b"}}
    assert read_fields(rows, "native", sections, NAMES) == {
        "size": 4, "width": 8, "depth": 7, "heads": 6, "mode": "b", "raw": None
    }  # fmt: skip
    assert read_fields(rows[2:3], "native", {"main": {}}, NAMES) == {"depth": 5}


def test_required_key_absent_or_null_names_its_section() -> None:
    rows = (Field("size", "main.size", default=REQUIRED),)
    for section in ({}, {"size": None}):
        with pytest.raises(InputError, match="config.json lacks the required key 'size'"):
            read_fields(rows, "original", {"main": section}, NAMES)


def test_checks_run_in_row_order() -> None:
    seen = []
    rows = (Field("a", "main.a"), Check(lambda s, v: seen.append(dict(v))), Field("b", "main.b"))
    read_fields(rows, "original", {"main": {"a": 1, "b": 2}}, NAMES)
    assert seen == [{"a": 1}]
