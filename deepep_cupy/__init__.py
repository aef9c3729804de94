"""deepep_cupy: expert-parallel MoE dispatch/combine, JIT-compiled from Python.

``import deepep_cupy as deep_ep`` runs code written against DeepEP's ``deep_ep.Buffer`` (V1) and, through
``ElasticBuffer`` / ``EPBuffer`` (``deepep_cupy.ep``), against V2's 2.1 and 2.5 APIs; for frameworks that
``import deep_ep`` themselves, ``DEEPEP_CUPY_AS_DEEP_EP=1`` or ``deepep_cupy.as_deep_ep()`` (``deepep_cupy.alias``).
Importing the package starts no CUDA context and needs no GPU.
"""

from .buffer import Buffer
from .config import Config
from .device.gpus import gpu_count
from .ep import ElasticBuffer, EPBuffer, EPHandle, get_logical_domain_size, get_physical_domain_size
from .errors import DeepEPError, DeepEPTimeoutError
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "DeepEPError", "DeepEPTimeoutError", "as_deep_ep",
           "gpu_count", "ElasticBuffer", "EPBuffer", "EPHandle", "get_physical_domain_size", "get_logical_domain_size",
           "topk_idx_t", "__version__"]
__version__ = "0.1.0"


def __getattr__(name):
    # Loaded on first use, so that ``python -m deepep_cupy.alias`` does not find its module imported already.
    if name == "as_deep_ep":
        from .alias import as_deep_ep

        return as_deep_ep
    # DeepEP exposes the top-k index dtype as a torch dtype; without torch it is NumPy's int64.
    if name == "topk_idx_t":
        try:
            import torch

            return torch.int64
        except ImportError:
            import numpy

            return numpy.dtype(numpy.int64)
    raise AttributeError(f"module 'deepep_cupy' has no attribute {name!r}")
