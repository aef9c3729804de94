"""Every refusal the GPU path makes from a call's arguments alone, made the same way by the reference backend.

Each case of ``CASES`` is one refusal of the GPU path (its engines and plans, through
``deepep_cupy/ops/limits.py``, or the Buffer itself) with arguments that trigger it. A case runs on
thread-ranks twice: on the reference backend, and on the GPU path's own code without a GPU (the real
``Buffer``, ``CudaBackend`` constructor and methods and plan constructors, over engine stand-ins that hold
only what a plan reads before it would touch the device). Both must raise the listed type with the same
message, which matches the listed pattern, on every rank.

Not enumerable here: the layout kernel's ``num_tokens * top-k < 2**31`` (an input of 2**31 entries), and the
internode channel bounds and ``channels x domains <= 256`` (no handle a dispatch makes exceeds them). The GPU's SM count is not an argument: the reference backend skips
that check alone (:func:`test_sm_count_is_the_one_gpu_only_refusal`).
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import pytest
from thread_group import run_ranks

from deepep_cupy import Buffer, Config
from deepep_cupy import backends as backends_module
from deepep_cupy import buffer_core as buffer_core_module
from deepep_cupy.backends import cuda as cuda_backend
from deepep_cupy.backends import make_backend
from deepep_cupy.ops.internode.engine import InternodeEngine
from deepep_cupy.ops.low_latency.engine import LowLatencyEngine
from deepep_cupy.reference import normal

# The GPU path's refusals are made by its own code (backend, engines, plans), which imports CuPy even where
# no GPU is there; the suite runs these where CuPy is installed (the cuda12 / cuda13 extras).
pytest.importorskip("cupy", reason="the GPU path's own code imports CuPy")

BF16, FP8 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn
BIG = 1 << 30  # bytes that fit every case's config: the reference backend allocates nothing
GPU_SMS = 132  # the stand-in GPU's SM count (an H100 / H200)
CFG = Config(20, 6, 256, 6, 256)


# ---------------------------------------------------------------------------------------------------- calls
def _routing(rng, n, k, num_experts):
    """``k`` distinct experts per token."""
    return np.argsort(rng.random((n, num_experts)), axis=1)[:, :k].astype(np.int64)


def _x(rng, n, hidden, fp8=False):
    data = rng.standard_normal((n, hidden)).astype(np.float32)
    if not fp8:
        return data.astype(BF16)
    return data.astype(FP8), (rng.random((n, hidden // 128)) + 0.5).astype(np.float32)


def dispatch(buf, rng, *, n=6, hidden=128, num_experts=8, k=2, config=CFG, fp8=False, x=None):
    """A dispatch with top-k; the layout comes from the NumPy formulas (some cases exceed the layout
    kernel's own limits on purpose)."""
    idx = _routing(rng, n, min(k, num_experts), num_experts)
    if k > num_experts:
        idx = np.concatenate([idx, -np.ones((n, k - num_experts), np.int64)], axis=1)
    per_rank, per_rdma, per_expert, in_rank = normal.dispatch_layout(idx, num_experts, buf.group_size,
                                                                     buf.num_nvl_ranks)
    w = rng.random(idx.shape).astype(np.float32)
    return buf.dispatch(_x(rng, n, hidden, fp8) if x is None else x, num_tokens_per_rank=per_rank,
                        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, config=config)


def combine(buf, rng, ref, *, config, hidden=128):
    """A combine with ``config`` of the handle a reference dispatch (default config) made."""
    recv_x, _, recv_w, _, handle, _ = dispatch(ref, rng, hidden=hidden)
    return buf.combine(recv_x, handle, topk_weights=recv_w, config=config)


def layout(buf, rng, *, n=5, k=2, num_experts=8):
    return buf.get_dispatch_layout(_routing(rng, n, k, num_experts), num_experts)


def ll_dispatch(buf, rng, *, t=8, hidden=128, num_experts=8, k=2):
    n = min(t, 4)
    return buf.low_latency_dispatch(_x(rng, n, hidden), _routing(rng, n, k, num_experts), t, num_experts)


def ll_hint(t=8, hidden=128, ranks=1, experts=8):
    return Buffer.get_low_latency_rdma_size_hint(t, hidden, ranks, experts)


@dataclass
class Case:
    name: str
    ranks: int
    kwargs: dict
    call: object  # fn(buf, rng, ref) -> the refused call; None: the constructor itself is refused
    exc: type
    match: str
    needs_ref: bool = field(default=False)
    #: Run on rank 0 of a stand-in group of ``ranks`` ranks that takes part in no exchange (the refusal comes
    #: before any), for rank counts beyond what threads make sensible.
    stand_in: bool = field(default=False)


def _ll(**kw):
    return dict(low_latency_mode=True, num_rdma_bytes=kw.pop("num_rdma_bytes", BIG), **kw)


CASES = [
    # Buffer constructor: what the engines refuse before they allocate.
    Case("intranode engine over 8 ranks", 9, dict(num_nvl_bytes=BIG), None, ValueError,
         r"^intranode kernels support up to 8 ranks per NVLink domain, got 9$"),
    Case("low-latency mode without NVSHMEM bytes", 1, dict(low_latency_mode=True), None, ValueError,
         r"^low-latency mode needs num_rdma_bytes > 0 \(see Buffer.get_low_latency_rdma_size_hint\)$"),
    Case("internode domain over 8 ranks", 18, dict(num_nvl_ranks=9, num_nvl_bytes=BIG, num_rdma_bytes=BIG), None,
         ValueError, r"^internode kernels support 1..8 ranks per domain, got 9$"),
    Case("low-latency mode over 1024 ranks", 1025, dict(num_nvl_ranks=1025, low_latency_mode=True,
                                                         num_rdma_bytes=BIG), None, ValueError,
         r"^low-latency mode supports up to 1024 ranks, got 1025$", stand_in=True),
    Case("internode over 32 domains", 33, dict(num_nvl_ranks=1, num_nvl_bytes=BIG, num_rdma_bytes=BIG), None,
         ValueError, r"^internode kernels need 2..32 domains, got 33$"),
    # get_dispatch_layout (the layout kernel).
    Case("layout top-k over 128", 1, {}, lambda b, r, _: layout(b, r, k=129, num_experts=256), ValueError,
         r"^top-k must be between 1 and 128, got 129$"),
    Case("layout counters beyond shared memory", 1, {}, lambda b, r, _: layout(b, r, num_experts=48 * 1024),
         ValueError, r"^num_experts \+ num_ranks \(49152 \+ 1\) is too large for the layout kernel: at most 49151 "),
    # Intranode dispatch and combine.
    Case("dispatch without NVLink buffer", 2, {}, lambda b, r, _: dispatch(b, r), RuntimeError,
         r"^dispatch: this Buffer has no NVLink buffer: create it with num_nvl_bytes > 0 "),
    Case("dispatch with a 1 KiB NVLink buffer", 2, dict(num_nvl_bytes=1024), lambda b, r, _: dispatch(b, r),
         ValueError, r"^dispatch needs \d+ bytes of NVL buffer for this config and hidden size, but the Buffer has "
                     r"num_nvl_bytes=1024 \(Config.get_nvl_buffer_size_hint gives \d+\)"),
    Case("dispatch with an odd config.num_sms", 1, dict(num_nvl_bytes=BIG),
         lambda b, r, _: dispatch(b, r, config=Config(7, 6, 256, 6, 256)), ValueError,
         r"^config.num_sms must be an even number >= 2 \(one sender and one receiver SM per channel\), got 7$"),
    Case("dispatch of empty rows", 1, dict(num_nvl_bytes=BIG), lambda b, r, _: dispatch(b, r, hidden=0),
         ValueError, r"^a token row must be a positive multiple of 16 bytes \(8 bf16 / 16 fp8 elements\), got 0 x 2"),
    Case("dispatch beyond the direct mode's shared memory", 1, dict(num_nvl_bytes=BIG),
         lambda b, r, _: dispatch(b, r, n=25600 * 32 + 1, hidden=8, config=Config(2, 1, 8, 6, 256)), ValueError,
         r"^dispatch of 819201 tokens over 1 channels needs 204808 bytes of shared memory per block "),
    Case("combine with a ring larger than the NVLink buffer", 2, dict(num_nvl_bytes=4 << 20),
         lambda b, r, ref: combine(b, r, ref, config=Config(20, 6, 4096, 6, 256)), ValueError,
         r"^combine needs \d+ bytes of NVL buffer for this config and hidden size, but the Buffer has "
         r"num_nvl_bytes=4194304", needs_ref=True),
    # Internode (two domains of one rank).
    Case("internode dispatch without NVSHMEM bytes", 2, dict(num_nvl_ranks=1, num_nvl_bytes=BIG),
         lambda b, r, _: dispatch(b, r), RuntimeError,
         r"^internode_dispatch: this Buffer spans 2 NVLink domains and has no internode buffers: "),
    Case("internode dispatch with a 1 KiB NVSHMEM buffer", 2,
         dict(num_nvl_ranks=1, num_nvl_bytes=BIG, num_rdma_bytes=1024), lambda b, r, _: dispatch(b, r), ValueError,
         r"^internode ops need \d+ bytes of RDMA buffer for this config and hidden size, the Buffer has "
         r"num_rdma_bytes=1024 \(Config.get_rdma_buffer_size_hint\)$"),
    Case("internode dispatch with a 1 KiB NVLink buffer", 2,
         dict(num_nvl_ranks=1, num_nvl_bytes=1024, num_rdma_bytes=BIG), lambda b, r, _: dispatch(b, r), ValueError,
         r"^internode ops need \d+ bytes of NVLink buffer for this config and hidden size, the Buffer has "
         r"num_nvl_bytes=1024 \(Config.get_nvl_buffer_size_hint\)$"),
    Case("internode dispatch of top-129", 2, dict(num_nvl_ranks=1, num_nvl_bytes=BIG, num_rdma_bytes=BIG),
         lambda b, r, _: dispatch(b, r, k=129), ValueError,
         r"^internode rows carry at most 128 top-k entries and 128 scales$"),
    Case("internode FP8 dispatch of 129 scales", 2, dict(num_nvl_ranks=1, num_nvl_bytes=BIG, num_rdma_bytes=BIG),
         lambda b, r, _: dispatch(b, r, hidden=129 * 128, fp8=True), ValueError,
         r"^internode rows carry at most 128 top-k entries and 128 scales$"),
    Case("internode dispatch of 1025 experts per rank", 2,
         dict(num_nvl_ranks=1, num_nvl_bytes=BIG, num_rdma_bytes=BIG),
         lambda b, r, _: dispatch(b, r, num_experts=2050), ValueError,
         r"^internode notify supports up to 1024 experts per rank$"),
    # Domains of one rank have no NVLink stage, so the NVLink ring's size only matters with 2 or more.
    Case("internode combine with fewer NVLink slots than domains", 4,
         dict(num_nvl_ranks=2, num_nvl_bytes=BIG, num_rdma_bytes=BIG),
         lambda b, r, ref: combine(b, r, ref, config=Config(20, 1, 4, 6, 256)), ValueError,
         r"^the internode combine needs at least 2 NVLink ring slots per channel \(one per domain\), got 1: ",
         needs_ref=True),
    # Low latency.
    Case("low-latency dispatch beyond num_rdma_bytes", 2, _ll(num_rdma_bytes=ll_hint(ranks=2) - 128),
         lambda b, r, _: ll_dispatch(b, r), ValueError,
         rf"^num_rdma_bytes={ll_hint(ranks=2) - 128} is too small for the low-latency kernels with T=8, hidden=128, "
         rf"2 ranks, 8 experts: need {ll_hint(ranks=2)} \(Buffer.get_low_latency_rdma_size_hint\)$"),
    Case("low-latency clean beyond num_rdma_bytes", 1, _ll(num_rdma_bytes=ll_hint(t=64) - 1),
         lambda b, r, _: b.clean_low_latency_buffer(64, 128, 8), ValueError,
         r"^num_rdma_bytes=\d+ is too small for the low-latency kernels with T=64, hidden=128, 1 ranks, 8 experts"),
    Case("low-latency T over 8192", 1, _ll(), lambda b, r, _: ll_dispatch(b, r, t=8193), ValueError,
         r"^num_max_dispatch_tokens_per_rank must be at most 8192, got 8193$"),
    Case("low-latency experts over 8192", 1, _ll(), lambda b, r, _: ll_dispatch(b, r, num_experts=8193),
         ValueError, r"^low-latency mode supports up to 8192 experts, got 8193$"),
    Case("low-latency op without low_latency_mode", 1, dict(num_rdma_bytes=BIG), lambda b, r, _: ll_dispatch(b, r),
         RuntimeError, r"^low_latency_dispatch needs a Buffer created with low_latency_mode=True$"),
]


# ---------------------------------------------------------------------------------------------------- the GPU path
class _NoDevice(Exception):
    """Where the GPU backend's constructor would first touch the device."""


def _no_device():
    raise _NoDevice


class _EngineStandIn:
    """What a high-throughput plan reads of its engine before it touches the device."""

    broken = None

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)

    def check_usable(self) -> None:
        pass

    def channels_per_block(self, num_sms=None) -> int:  # internode plans: the engine's tuning, as the real one
        return InternodeEngine.channels_per_block(self, num_sms)


def _gpu_backend(kind, group, **options):
    """The GPU backend: its real constructor (which makes the argument refusals first, then would open the
    device), then the state it would have, with engine stand-ins."""
    if kind != "cuda":
        return make_backend(kind, group, **options)
    try:
        cuda_backend.CudaBackend(group, **options)
    except _NoDevice:
        pass
    b = object.__new__(cuda_backend.CudaBackend)
    nvl, rdma, lsize = options["num_nvl_bytes"], options["num_rdma_bytes"], options["num_nvl_ranks"]
    b.group, b.num_ranks, b.rank, b.num_nvl_ranks = group, group.size, group.rank, lsize
    b.num_nvl_bytes, b.num_rdma_bytes, b.device_id = nvl, rdma, 0
    b.comm_stream, b._layout_errors = types.SimpleNamespace(ptr=0), object()
    b._agreed, b.pending_agreements, b.spans_domains = set(), [], lsize < group.size
    b.intranode = b.internode = b.low_latency = None
    common = dict(rank=group.rank, num_nvl_bytes=nvl, num_rdma_bytes=rdma, num_device_sms=GPU_SMS)
    if nvl > 0 and not b.spans_domains:
        b.intranode = _EngineStandIn(num_ranks=group.size, **common)
    if options["low_latency_mode"] or rdma > 0:
        b.low_latency = object.__new__(LowLatencyEngine)
        b.low_latency.num_ranks, b.low_latency.num_rdma_bytes = group.size, rdma
        b.low_latency._buffer_maps = {}
    if b.spans_domains and nvl > 0 and rdma > 0:
        b.internode = _EngineStandIn(num_nvl_ranks=lsize, num_domains=group.size // lsize, sub_channels=None,
                                     **common)
    return b


@pytest.fixture
def gpu_path(monkeypatch):
    monkeypatch.setattr(backends_module, "gpu_count", lambda: 1)
    monkeypatch.setattr(buffer_core_module, "make_backend", _gpu_backend)
    monkeypatch.setattr(cuda_backend, "current_device_id", _no_device)
    monkeypatch.setattr(cuda_backend.CudaBackend, "frame", lambda self, obj: None)


def _outcomes(case: Case, backend: str) -> list:
    """``(type, message)`` of the exception each rank raised (None where none)."""

    def body(group):
        rng = np.random.default_rng(7 + group.rank)
        try:
            buf = Buffer(comm=group, backend=backend, **case.kwargs)
            if case.call is not None:
                ref = Buffer(comm=group, backend="reference", **case.kwargs) if case.needs_ref else None
                case.call(buf, rng, ref)
        except Exception as exc:  # noqa: BLE001 - compared by the test
            return type(exc), str(exc)
        return None

    if case.stand_in:
        return [body(_StandInGroup(case.ranks))]
    return run_ranks(case.ranks, body)


class _StandInGroup:
    """Rank 0 of ``size`` ranks, for refusals made before any exchange (an exchange would fail the test)."""

    rank = 0

    def __init__(self, size: int) -> None:
        self.size = size

    def allgather_object(self, obj, op=None):
        raise AssertionError("a refusal from the arguments alone came after an exchange")

    alltoall_object = barrier = allgather_object


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_refuses_what_the_gpu_path_refuses(case, gpu_path):
    gpu = _outcomes(case, "cuda")
    reference = _outcomes(case, "reference")
    for outcomes in (gpu, reference):
        assert all(o is not None for o in outcomes), outcomes
        assert all(o[0] is case.exc for o in outcomes), outcomes
        assert all(o[1] == outcomes[0][1] for o in outcomes), outcomes
    assert gpu[0][1] == reference[0][1]
    assert re.search(case.match, gpu[0][1]), gpu[0][1]


def test_sm_count_is_the_one_gpu_only_refusal(gpu_path):
    """A config needing more SMs than the GPU has is refused on the GPU; the reference backend cannot know
    the GPU's SM count and runs it."""
    case = Case("dispatch over 132 SMs", 1, dict(num_nvl_bytes=BIG),
                lambda b, r, _: dispatch(b, r, config=Config(2 * GPU_SMS + 2, 6, 256, 6, 256)), ValueError, "")
    (gpu,) = _outcomes(case, "cuda")
    assert gpu == (ValueError, f"{GPU_SMS + 1} channels need {2 * GPU_SMS + 2} SMs, but the GPU has {GPU_SMS}; "
                               "lower config.num_sms")
    assert _outcomes(case, "reference") == [None]


def test_buffers_sized_by_the_hints_are_accepted(gpu_path):
    """The other side of each size refusal: sizes from the hints pass the GPU path's checks up to its first
    device call (the stand-in engines then stop it) and run on the reference backend."""
    hidden, ranks = 128, 2
    nvl = CFG.get_nvl_buffer_size_hint(hidden * 2, ranks)
    case = Case("hinted", ranks, dict(num_nvl_bytes=nvl), lambda b, r, _: dispatch(b, r, hidden=hidden), None, "")
    assert _outcomes(case, "reference") == [None, None]
    for name, _ in _outcomes(case, "cuda"):
        assert name is AttributeError  # past every refusal, where the stand-in engine has no more to give
