"""NumPy reference backend: exact, deterministic semantics of every operation, without a GPU.

``ReferenceOracle`` (``oracle.py``) is what ``Buffer`` drives when no GPU kernel runs; it is also
the oracle the GPU kernels are tested against. ``normal.py`` holds the layout/dispatch/combine math
(``internode.py`` its handle across NVLink domains),
``low_latency.py`` the low-latency dispatch/combine, ``quant.py`` the FP8, UE8M0 and LogFMT formats.
"""

from . import internode, low_latency, normal, quant
from .oracle import ReferenceOracle

__all__ = ["ReferenceOracle", "internode", "low_latency", "normal", "quant"]
