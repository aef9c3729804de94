"""DeepEP V2's API: ``EPBuffer`` (2.5), ``ElasticBuffer`` (2.1), ``EPHandle``, over V1's ``Buffer``.

``buffer.py`` holds the one implementation, ``elastic.py`` the two public classes, ``handle.py`` the handle,
``recv_rows.py`` where the received rows go, ``epilogue.py`` V2's combine order, ``events.py`` the event
with a hook, ``arrays.py`` the array operations of the caller's framework, ``args.py`` the argument checks.
"""

from __future__ import annotations

from .domains import get_logical_domain_size, get_physical_domain_size
from .elastic import ElasticBuffer, EPBuffer
from .events import EventHandle, EventOverlap
from .handle import EPHandle

__all__ = ["ElasticBuffer", "EPBuffer", "EPHandle", "EventOverlap", "EventHandle", "get_physical_domain_size",
           "get_logical_domain_size"]
