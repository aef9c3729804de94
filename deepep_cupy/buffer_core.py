"""What both halves of the public ``Buffer`` stand on: its state (group, sizes, backend, plans) and the one
frame every op runs in.

``Buffer`` (``buffer.py``: layout, dispatch, combine) derives from ``LowLatencyOps``
(``buffer_low_latency.py``), which derives from :class:`BufferCore`: each half uses only what this class
defines.
"""

from __future__ import annotations

import os
import socket
import weakref

from . import checks
from .backends import choose_backend, make_backend
from .custom_ops import outside, tracing_check
from .custom_ops import register as register_for_compile
from .device.group import make_group
from .frameworks import plain_torch

__all__ = ["BufferCore", "OpFrame"]

# torch.compile: True only while dynamo traces a call (then the call goes to deepep_cupy.custom_ops's custom ops).
_compiling = tracing_check(globals())


class OpFrame:
    """The frame of every op call, entered as ``with self._frames.<op>:`` around the op's plan lookup and run.

    On entry: torch calls without Python-level torch-function modes (``plain_torch``), a destroyed Buffer
    refused, and the agreement checks still in flight looked at. On a failure: the backend hears of it (the
    reference backend hands it to the peers waiting in the op's exchange) before it propagates. One frame
    object per op and Buffer, made once: entering it allocates nothing. It holds its Buffer through a weak
    proxy, so that a Buffer its user drops is freed at once, with no reference cycle for the collector.
    """

    __slots__ = ("_buffer", "_op", "_torch")

    def __init__(self, buffer: BufferCore, op: str) -> None:
        self._buffer, self._op, self._torch = weakref.proxy(buffer), op, None

    def __enter__(self) -> None:
        self._torch = plain = plain_torch()
        plain.__enter__()
        buffer = self._buffer
        if buffer._destroyed or buffer._pending:
            try:
                buffer._alive()
                buffer.runtime.poll_agreements()
            except BaseException as exc:
                self.__exit__(type(exc), exc, exc.__traceback__)
                raise

    def __exit__(self, kind, exc, traceback) -> bool:
        self._torch.__exit__(kind, exc, traceback)
        if isinstance(exc, Exception):
            self._buffer.runtime.report_failure(self._op, exc)
        return False


class _Frames:
    """The Buffer's frames, one attribute per op (its name in errors and in the backend's exchanges)."""

    __slots__ = ("layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine")

    def __init__(self, buffer: BufferCore) -> None:
        for op in self.__slots__:
            setattr(self, op, OpFrame(buffer, "get_dispatch_layout" if op == "layout" else op))


class BufferCore:
    """The state of a ``Buffer`` and what every op of it uses; see ``Buffer`` for the public API.

    Attributes:
        rank: this process's rank in the group.
        group_size: number of ranks.
        group: the process group or communicator given.
        num_nvl_bytes: size of the NVLink buffer.
        num_rdma_bytes: size of the NVSHMEM (RDMA / low-latency) buffer.
        num_nvl_ranks: ranks per NVLink domain (GPUs per host unless overridden).
        backend: 'cuda' or 'reference'.
        runtime: the backend object the ops' plans come from.
    """

    #: SMs the high-throughput kernels use, class-wide (``Buffer.set_num_sms`` sets it).
    num_sms: int = 20
    _num_sms_set: bool = False  # set_num_sms was called: tuned configs keep that SM count

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, backend: str | None = None, num_nvl_ranks: int | None = None) -> None:
        """Create the buffers; collective over the group.

        Arguments:
            group: a ``torch.distributed.ProcessGroup`` (or None when ``comm`` is given).
            num_nvl_bytes: bytes of NVLink-shared memory per rank for the high-throughput kernels.
            num_rdma_bytes: bytes of NVSHMEM symmetric memory per rank (internode and low-latency kernels).
            low_latency_mode: enable the low-latency kernels.
            num_qps_per_rank: RDMA queue pairs per peer for NVSHMEM transports that use them.
            allow_nvlink_for_low_latency_mode: let low-latency kernels store over NVLink to peers that
                are reachable that way (otherwise every transfer goes through the NVSHMEM network transport).
            allow_mnnvl: allow multi-node NVLink in NVSHMEM.
            use_fabric: share NVLink buffers as fabric handles (multi-node NVLink) instead of file descriptors.
            explicitly_destroy: resources are released only by ``destroy()``, never by the destructor.
            enable_shrink: a rank that stops answering is masked instead of failing the low-latency kernels.
            comm: an ``mpi4py.MPI.Comm`` used when ``group`` is None.
            backend: 'cuda', 'reference' or None (``$DEEPEP_CUPY_BACKEND``, default: the GPU when one is visible).
            num_nvl_ranks: ranks per NVLink domain; default ``$DEEPEP_CUPY_NVL_RANKS`` or the ranks on this host.
        """
        self._group = make_group(group, comm)
        self.group = group if group is not None else comm
        self.rank = self._group.rank
        self.group_size = self._group.size
        self.num_nvl_bytes = checks.nonneg_int("num_nvl_bytes", num_nvl_bytes)
        self.num_rdma_bytes = checks.nonneg_int("num_rdma_bytes", num_rdma_bytes)
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = bool(explicitly_destroy)
        self.enable_shrink = bool(enable_shrink)
        self.num_qps_per_rank = checks.positive_int("num_qps_per_rank", num_qps_per_rank)
        self.num_nvl_ranks = self._nvl_domain_size(num_nvl_ranks)
        self.backend = choose_backend(backend)
        self._destroyed = False
        self._compiled_op_key = str(register_for_compile(self))  # how torch.compile's custom ops name it
        # Plans per op, keyed by the metadata of the tensors and the flags of a call.
        self._layout_plans: dict = {}
        self._dispatch_plans: dict = {}
        self._combine_plans: dict = {}
        self._ll_dispatch_plans: dict = {}
        self._ll_combine_plans: dict = {}
        self._default_configs: dict = {}  # the normal ops' default Config per table and SM count
        # Expert-id values are checked on the host only by the reference backend; GPU kernels check them.
        self._host_values = self.backend == "reference" and checks.values_enabled()
        self.runtime = make_backend(self.backend, self._group, num_nvl_bytes=self.num_nvl_bytes,
                                    num_rdma_bytes=self.num_rdma_bytes, num_nvl_ranks=self.num_nvl_ranks,
                                    low_latency_mode=self.low_latency_mode, num_qps_per_rank=self.num_qps_per_rank,
                                    allow_nvlink=bool(allow_nvlink_for_low_latency_mode),
                                    allow_mnnvl=bool(allow_mnnvl), use_fabric=bool(use_fabric),
                                    enable_shrink=self.enable_shrink,
                                    num_channels=max(self.num_sms // 2, 1))
        # Engine tuning (block shapes, batches; changed with the engines' tune) is part of what the normal ops'
        # plans fixed. A weak reference: the backend must not keep its Buffer alive (the destructor releases
        # what needs no peer).
        drop = weakref.WeakMethod(self._drop_normal_plans)
        self.runtime.plans_invalidated = lambda: (method := drop()) is not None and method()
        # Agreement checks across ranks still in flight (see CudaBackend.agree); looked at by every call
        # while there are any.
        self._pending: list = self.runtime.pending_agreements
        self._frames = _Frames(self)

    def _nvl_domain_size(self, requested: int | None) -> int:
        env = os.environ.get("DEEPEP_CUPY_NVL_RANKS")
        if requested is None and env:
            requested = int(env)
        if requested is None:
            hosts = self._group.allgather_object(socket.gethostname())
            requested = hosts.count(hosts[self.rank])
        requested = checks.positive_int("num_nvl_ranks", requested)
        if self.group_size % requested != 0:
            raise ValueError(f"num_nvl_ranks ({requested}) must divide the group size ({self.group_size})")
        return requested

    def _alive(self) -> None:
        if self._destroyed:
            raise RuntimeError("this Buffer was destroyed")

    @property
    def _num_rdma_ranks(self) -> int:
        return self.group_size // self.num_nvl_ranks

    def _drop_normal_plans(self) -> None:
        self._dispatch_plans.clear()
        self._combine_plans.clear()

    def _num_experts_ok(self, num_experts) -> int:
        return checks.num_experts_ok(num_experts, self.group_size)

    # ------------------------------------------------------------------ streams and raw memory
    def get_comm_stream(self):
        """The communication stream (torch stream for torch groups, CuPy stream otherwise); None on the reference backend."""
        if _compiling():  # torch.compile: a graph break
            return outside(self.get_comm_stream)
        self._alive()
        return self.runtime.get_comm_stream(torch_stream=self.group is not None and not hasattr(self.group, "Get_rank"))

    def get_local_buffer_tensor(self, dtype, size=None, offset: int = 0, use_rdma_buffer: bool = False):
        """A view of this rank's raw NVLink (or NVSHMEM, with ``use_rdma_buffer``) buffer.

        Arguments:
            dtype: element type (a torch dtype returns a torch tensor, a NumPy/ml_dtypes dtype a CuPy array).
            size: optional shape of the slice, in elements.
            offset: first element of the slice.
            use_rdma_buffer: view the NVSHMEM buffer instead of the NVLink one.
        """
        if _compiling():  # torch.compile: a graph break
            return outside(self.get_local_buffer_tensor, dtype, size, offset, use_rdma_buffer)
        self._alive()
        return self.runtime.local_buffer_tensor(dtype, size, checks.nonneg_int("offset", offset), use_rdma_buffer)

    # ------------------------------------------------------------------ lifetime
    def destroy(self) -> None:
        """Release every resource (collective). Required when ``explicitly_destroy=True``."""
        if _compiling():  # torch.compile: a graph break
            return outside(self.destroy)
        if self._destroyed:
            return
        self._destroyed = True
        self.runtime.destroy()

    def __del__(self) -> None:
        if getattr(self, "explicitly_destroy", True) or getattr(self, "_destroyed", True):
            return
        try:
            self.runtime.release_local()
        except Exception:
            pass
