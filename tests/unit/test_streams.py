"""CuPy stream objects over raw stream handles: no deprecated CuPy API on CuPy 14, the handle kept as
given, and CuPy 13's ExternalStream where Stream.from_external does not exist (no GPU needed: CuPy only
wraps the handle)."""

from __future__ import annotations

import warnings

import pytest

from deepep_cupy.device import streams

cupy = pytest.importorskip("cupy")


def test_wraps_the_handle_without_deprecated_api():
    if not hasattr(cupy.cuda.Stream, "from_external"):
        pytest.skip("this CuPy has no Stream.from_external (CuPy < 14)")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = streams.external_stream(0x7F00_1234_5670, 0)
    assert isinstance(s, cupy.cuda.Stream) and s.ptr == 0x7F00_1234_5670


def test_falls_back_to_external_stream_on_older_cupy(monkeypatch):
    made = []

    class Old:  # CuPy 13: no from_external
        pass

    monkeypatch.setattr(cupy.cuda, "Stream", Old)
    monkeypatch.setattr(cupy.cuda, "ExternalStream", lambda ptr, dev: made.append((ptr, dev)) or "stream")
    assert streams.external_stream(42, 3) == "stream" and made == [(42, 3)]


def test_the_legacy_stream_is_never_asked_whether_it_is_capturing(monkeypatch):
    """Stream 0 (torch's and CuPy's default) cannot be captured: no driver call for it; others are asked."""
    asked = []
    monkeypatch.setattr(cupy.cuda.runtime, "streamIsCapturing", lambda s: asked.append(s) or (1 if s == 7 else 0))
    assert not streams.stream_is_capturing(0) and asked == []
    assert streams.stream_is_capturing(7) and not streams.stream_is_capturing(8) and asked == [7, 8]
