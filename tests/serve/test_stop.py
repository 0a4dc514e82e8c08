"""builder_plugin.serve.stop: stop strings in streamed text."""

from __future__ import annotations

from builder_plugin.serve.stop import StopScanner


def test_stop_scanner_holds_back_what_may_start_a_stop_string():
    scanner = StopScanner(["END", "xy"])
    fed = [scanner.feed(piece) for piece in ("ab", "cE", "N", "x", "zE", "ND more")]
    assert fed == [("ab", False), ("c", False), ("", False), ("EN", False), ("xz", False), ("", True)]
    scanner = StopScanner(["abc"])
    assert (scanner.feed("xxab"), scanner.feed("d"), scanner.flush()) == (("xx", False), ("abd", False), "")
