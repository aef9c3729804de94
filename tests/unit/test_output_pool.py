"""The output pool's allocator (deepep_cupy/device/output_pool.py), on the CPU."""

import gc
import threading

import numpy as np
import pytest

from deepep_cupy.device import output_pool as P


def test_first_fit_alignment_and_coalescing():
    a = P.Allocator(4096, base_ptr=1 << 20)
    b1, b2, b3 = a.alloc(10), a.alloc(300), a.alloc(256)
    assert [b.offset for b in (b1, b2, b3)] == [0, 256, 768]
    assert [b.nbytes for b in (b1, b2, b3)] == [256, 512, 256]
    assert b2.ptr == (1 << 20) + 256 and a.in_use == 1024
    del b2
    assert a.free_ranges() == [(256, 768), (1024, 4096)]
    again = a.alloc(512)
    assert again.offset == 256  # the hole is reused first
    del again, b1
    assert a.free_ranges() == [(0, 768), (1024, 4096)]
    del b3
    assert a.free_ranges() == [(0, 4096)] and a.in_use == 0
    assert a.alloc(4097) is None and a.alloc(0).nbytes == P.ALIGN


def test_random_alloc_free_never_overlaps():
    rng = np.random.default_rng(3)
    a = P.Allocator(1 << 16)
    live = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            live.pop(rng.choice(list(live)))
        else:
            live[step] = a.alloc(int(rng.integers(0, 5000)))
            if live[step] is None:
                del live[step]
        spans = sorted((b.offset, b.offset + b.nbytes) for b in live.values())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False))
        free = sum(e - s for s, e in a.free_ranges())
        assert free + a.in_use == 1 << 16 and a.in_use == sum(b.nbytes for b in live.values())
    live.clear()
    gc.collect()
    assert a.free_ranges() == [(0, 1 << 16)]


def test_frees_from_many_threads():
    a = P.Allocator(1 << 20)
    blocks = [a.alloc(1000) for _ in range(512)]
    assert all(b is not None for b in blocks)
    chunks = [blocks[i::8] for i in range(8)]
    blocks.clear()

    def drop(chunk):
        chunk.clear()

    threads = [threading.Thread(target=drop, args=(c,)) for c in chunks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.in_use == 0 and a.free_ranges() == [(0, 1 << 20)]


def test_close_waits_for_the_last_block():
    events = []

    class FakeBuffer:
        def close(self):
            events.append("closed")

    pool = P.OutputPool.__new__(P.OutputPool)
    P.Allocator.__init__(pool, 4096)
    pool.buffer, pool._closing, pool.bases = FakeBuffer(), False, None
    held = pool.alloc(100)
    pool.close()
    assert events == []  # a tensor still holds a block
    del held
    assert events == ["closed"]


@pytest.mark.parametrize("raw,want", [("", P.DEFAULT_BYTES), ("0", 0), ("2e9", 2_000_000_000), ("4096", 4096)])
def test_default_pool_bytes(monkeypatch, raw, want):
    monkeypatch.setenv("DEEPEP_CUPY_OUTPUT_POOL_BYTES", raw)
    assert P.default_pool_bytes() == want


def test_default_pool_only_where_run_on_gpus(monkeypatch):
    monkeypatch.delenv("DEEPEP_CUPY_OUTPUT_POOL_BYTES", raising=False)
    assert P.default_pool_bytes(2) == P.DEFAULT_BYTES and P.default_pool_bytes(1) == P.DEFAULT_BYTES
    assert P.default_pool_bytes(4) == P.DEFAULT_BYTES and P.default_pool_bytes(5) == 0 and P.default_pool_bytes(8) == 0
    monkeypatch.setenv("DEEPEP_CUPY_OUTPUT_POOL_BYTES", "4096")
    assert P.default_pool_bytes(8) == 4096


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_default_pool_bytes_rejects(monkeypatch, raw):
    monkeypatch.setenv("DEEPEP_CUPY_OUTPUT_POOL_BYTES", raw)
    with pytest.raises(ValueError, match="DEEPEP_CUPY_OUTPUT_POOL_BYTES"):
        P.default_pool_bytes()


def test_framework_outputs_refuses_the_pool_on_its_thread_only():
    """torch.compile's ops run inside it: their outputs must come from the framework's allocator."""
    import threading

    from deepep_cupy.device.output_pool import framework_outputs, outputs_refused

    seen = []
    assert not outputs_refused()
    with framework_outputs():
        with framework_outputs():
            assert outputs_refused()
        assert outputs_refused()
        worker = threading.Thread(target=lambda: seen.append(outputs_refused()))
        worker.start()
        worker.join()
    assert not outputs_refused() and seen == [False]
