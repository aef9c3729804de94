"""Tuning attributes of the high-throughput engines (intranode, internode), set through one method.

A plan fixes what the engine's tuning attributes said when it was made (block shapes, batches, modes, the
wait budget), so after a change no call may be served by a plan made with the old values. Hence the one
way to change them, :meth:`Tunable.tune`: it sets the attributes, then calls ``on_tuning_change`` (the
backend sets it; a Buffer's backend drops the Buffer's plans of the normal ops). Plans made without a Buffer
(``direct_dispatch`` / ``direct_combine``) have the tuning values in their keys.

Assigning a tuning attribute directly raises :class:`AttributeError` naming :meth:`Tunable.tune`, since it
would leave the plans made with the old value in place.
"""

from __future__ import annotations

__all__ = ["Tunable"]


class Tunable:
    """Mixin: the subclass lists its tuning attributes in ``TUNING`` and sets their first values with
    :meth:`tune` too."""

    #: Attributes plans are built from.
    TUNING: tuple = ()
    #: Called with no arguments after :meth:`tune` set something (None: nobody holds plans of this engine).
    on_tuning_change = None

    def tune(self, **settings) -> None:
        """Set tuning attributes, then drop the plans made with the old values (``on_tuning_change``).

        Arguments:
            settings: attribute name -> new value, each name one of ``TUNING``. All ranks must pass the
                same values: the kernels of an op run on every rank with the same shapes and protocol.

        Raises:
            TypeError: a name that is not a tuning attribute of this engine (nothing is set then).
        """
        unknown = [name for name in settings if name not in self.TUNING]
        if unknown:
            raise TypeError(f"{type(self).__name__}.tune() got unknown tuning attributes {', '.join(unknown)}; "
                            f"they are {', '.join(self.TUNING)}")
        if not settings:
            return
        for name, value in settings.items():
            object.__setattr__(self, name, value)
        if self.on_tuning_change is not None:
            self.on_tuning_change()

    def __setattr__(self, name, value) -> None:
        if name in self.TUNING:
            raise AttributeError(f"{name} is a tuning attribute: set it with {type(self).__name__}.tune({name}=...), "
                                 "which also drops the plans made with the old value")
        object.__setattr__(self, name, value)
