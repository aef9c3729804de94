"""What the normal-mode GPU tests (intranode, internode) share: routing and token data, output poisoning,
the combine check and the cached-dispatch and combine rounds. Imported by the test files next to it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gpu_common import COMM, FP8, bf16, bits, to_dev, to_np


def cupy_holds(dtype) -> bool:
    from deepep_cupy.frameworks import cupy_holds as holds

    return holds(np.dtype(dtype))


def skip_unless_framework_holds(fw, *dtypes):
    if fw == "cupy":
        for dt in dtypes:
            if not cupy_holds(dt):
                pytest.skip(f"this CuPy cannot hold {np.dtype(dt)} arrays")


def routing(rng, n, num_experts, k, rank, size, only_rank0=False):
    scores = np.abs(rng.standard_normal((n, num_experts))).astype(np.float32) + 1
    if only_rank0:
        scores[:, num_experts // size:] = 0  # every token goes to rank 0's experts only
    topk = np.argsort(-scores, axis=1, kind="stable")[:, :k].astype(np.int64)
    if n > 0:
        for _ in range(min(10, n)):  # a few masked slots, as DeepEP's test does
            topk[rng.integers(n), rng.integers(k)] = -1
    weights = rng.random((n, k), dtype=np.float32)
    return topk, weights


def fp8_tokens(rng, n, hidden, column_major):
    raw = rng.integers(0, 0x7F, size=(n, hidden), dtype=np.uint8) | (rng.integers(0, 2, (n, hidden), dtype=np.uint8) << 7)
    x = raw.view(FP8)
    scales = rng.random((n, hidden // 128), dtype=np.float32) + 0.5
    if column_major:
        scales = np.asfortranarray(scales)
    return x, scales


def inputs(env, fw, rng, n, hidden, fp8, column_major):
    """Fresh tokens: ``(x, scales or None)`` in NumPy and the dispatch's ``x`` argument on the device."""
    if fp8:
        x_np, s_np = fp8_tokens(rng, n, hidden, column_major)
        return x_np, s_np, (to_dev(x_np, fw, env), to_dev(s_np, fw, env))
    x_np = bf16(rng, (n, hidden))
    return x_np, None, to_dev(x_np, fw, env)


def poison(env, fw, nbytes_list):
    """Fill pool blocks of the outputs' sizes with 0xAB so rows a kernel forgets to write show up; the free
    space of the Buffer's output pool too (direct-mode dispatch outputs come from there)."""
    import cupy

    from deepep_cupy.device.streams import current_stream

    with current_stream(fw, env["dev"]):
        blocks = []
        for nb in nbytes_list:
            if nb > 0:
                b = cupy.empty(int(nb), dtype=cupy.uint8)
                b.fill(0xAB)
                blocks.append(b)
        del blocks
        pool = output_pool(env.get("buf"))
        if pool is not None:
            stream = cupy.cuda.get_current_stream().ptr
            for start, end in pool.free_ranges():
                cupy.cuda.runtime.memsetAsync(pool.base_ptr + start, 0xAB, end - start, stream)


def output_pool(buf):
    """The intranode output pool of a Buffer, or None."""
    engine = getattr(getattr(buf, "runtime", None), "intranode", None)
    return getattr(engine, "output_pool", None)


def in_output_pool(buf, tensor) -> bool:
    """Whether ``tensor``'s memory lies in the Buffer's output pool."""
    pool = output_pool(buf)
    if pool is None:
        return False
    p = tensor.data_ptr() if hasattr(tensor, "data_ptr") else tensor.data.ptr
    return pool.base_ptr <= p < pool.base_ptr + pool.size


def check_combine(ours, refs, num_tokens):
    cx, cw = to_np(ours[0]), to_np(ours[1]) if ours[1] is not None else None
    rx, rw = refs
    assert cx.shape == rx.shape
    a, b = cx.astype(np.float32), rx.astype(np.float32)
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)
    exact = float(np.mean(bits(cx) == bits(rx))) if cx.size else 1.0
    assert exact > 0.999, f"only {exact:.4%} of combined values are bit-identical to the reference"
    if rw is not None:
        np.testing.assert_allclose(cw, rw, rtol=1e-6, atol=1e-6)
    assert cx.shape[0] == num_tokens


def digest(arrays, counts) -> str:
    """SHA-256 of device arrays' bytes and of a counts list: equal digests, bit-identical results."""
    import cupy

    h = hashlib.sha256()
    for a in arrays:
        h.update(cupy.ascontiguousarray(cupy.asarray(a)).view(cupy.uint8).get().tobytes())
    h.update(repr(counts).encode())
    return h.hexdigest()


def cached_dispatch_round(env, fw, rng, *, handle, ref_handle, n, hidden, fp8, column_major, align, num_recv, cfg,
                          own_copies=None):
    """A cached dispatch of fresh tokens with ``handle``, compared with the reference's on ``ref_handle``.
    ``own_copies``: whether this rank's own rows must go through device-to-device copies (None: not checked)."""
    buf, ref = env["buf"], env["ref"]
    x_np, s_np, x_dev = inputs(env, fw, rng, n, hidden, fp8, column_major)
    poison(env, fw, [num_recv * hidden * (1 if fp8 else 2), num_recv * hidden // 32])
    engine = getattr(getattr(buf, "runtime", None), "intranode", None)
    before = getattr(engine, "own_copies", 0)
    recv, idx, w, counts, new_handle, _ = buf.dispatch(x_dev, handle=handle, config=cfg)
    if own_copies is not None:
        assert (getattr(engine, "own_copies", 0) > before) == own_copies, "own rows did not take the expected path"
    assert idx is None and w is None and counts is None
    want = ref.dispatch(x_np, s_np, handle=ref_handle, num_tokens_per_rank=None, is_token_in_rank=None,
                        num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=align,
                        num_worst_tokens=0)
    got = to_np(recv[0] if fp8 else recv)
    np.testing.assert_array_equal(bits(got[:num_recv]), bits(want[0][:num_recv]))
    if fp8:
        np.testing.assert_array_equal(to_np(recv[1])[:num_recv], want[1][:num_recv])
    return new_handle


def poison_staging(env):
    """Fill this rank's staging area of the combine's copy mode with 0xAB, then wait for every rank to have
    done the same (peers copy into it as soon as they start their combine)."""
    import cupy

    pool = output_pool(env.get("buf"))
    if pool is None or not getattr(pool, "staging_bytes", 0):
        return
    with cupy.cuda.Device(env["dev"]):
        cupy.cuda.runtime.memset(pool.staging_ptrs[env["rank"]], 0xAB, pool.staging_bytes)
        cupy.cuda.Device(env["dev"]).synchronize()
    COMM.Barrier()


def combine_round(env, fw, rng, *, handle, ref_handle, n, hidden, k, rows, bias, cfg, copy_mode=None):
    """Combine fresh "expert outputs" for every received row (padding rows included), weights and ``bias``
    (0, 1 or 2 bias tensors), compared with the reference. ``copy_mode``: whether the intranode combine must
    take its copy mode (None: not checked)."""
    buf, ref = env["buf"], env["ref"]
    y_np = bf16(rng, (rows, hidden), scale=1.0 + env["rank"])
    yw_np = rng.random((rows, k), dtype=np.float32)
    b0 = bf16(rng, (n, hidden)) if bias >= 1 else None
    b1 = bf16(rng, (n, hidden)) if bias >= 2 else None
    bias_dev = None
    if bias == 1:
        bias_dev = to_dev(b0, fw, env)
    elif bias == 2:
        bias_dev = (to_dev(b0, fw, env), to_dev(b1, fw, env))
    poison(env, fw, [n * hidden * 2, n * k * 4])
    y_dev, yw_dev = to_dev(y_np, fw, env), to_dev(yw_np, fw, env)
    poison_staging(env)
    engine = getattr(getattr(buf, "runtime", None), "intranode", None)
    copies = getattr(engine, "copy_seq", 0)
    combined = buf.combine(y_dev, handle, topk_weights=yw_dev, bias=bias_dev, config=cfg)
    if copy_mode is not None:
        assert (getattr(engine, "copy_seq", 0) > copies) == copy_mode, "the combine did not take the expected mode"
    check_combine(combined[:2], ref.combine(y_np, ref_handle, topk_weights=yw_np, bias_0=b0, bias_1=b1), n)
