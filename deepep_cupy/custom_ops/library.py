"""How this package's ops are registered with torch's dispatcher: a call crosses into Python once.

``torch.library.custom_op`` puts Python layers around every call: an autograd kernel that reads the
schema and builds metadata on each call, a redispatch to a backend kernel wrapped in a dynamo-disabling
context that checks the outputs' aliasing, and for an op with mutated arguments an ADInplaceOrView kernel
that redispatches once more: more host time per call than some of the Buffer calls they wrap. Here an
op is defined with ``torch.library.Library`` and has:

- a kernel at the Autograd key, the one every call starts in: when no input needs a gradient and only a
  backend (CPU, CUDA) lies below (no fake or functional tensors, no dispatch mode, no tracing), it calls
  the implementation itself; below a mode it redispatches (fake implementation, functionalization, the
  modes of ``torch.library.opcheck``); with gradients it runs the op in an ``autograd.Function`` with the
  registered backward formula (an op without one raises when differentiated, as a custom op does). An
  op whose tensors are all integer tensors, which never require gradients, has none: torch's own
  fallback (C++) passes its calls through;
- the implementation at CompositeExplicitAutograd, for the calls that come there by redispatch.

The implementation runs with dynamo off (a compiled region that calls an op eagerly must not trace its
Python) and bumps the version counters of the arguments it writes, as torch's in-place ops do. Fake
implementations are ``torch.library.register_fake``'s, as for any op.
"""

from __future__ import annotations

import inspect

import torch

__all__ = ["Op"]

NS = "deepep_cupy"
_LIB = torch.library.Library(NS, "DEF")  # held for the life of the process: dropping it deletes the ops

_infer_schema = getattr(torch.library, "infer_schema", None)
if _infer_schema is None:  # torch 2.4
    from torch._library.infer_schema import infer_schema as _infer_schema

_C = torch._C
_AFTER_AUTOGRAD = _C._after_autograd_keyset
_BELOW_VIEWS = _C._after_ADInplaceOrView_keyset
# Below autograd (and ADInplaceOrView, a fallthrough for these ops) only a backend: nothing between the
# Autograd kernel and the implementation has work to do.
_BACKENDS = (_C.DispatchKey.CPU, _C.DispatchKey.CUDA)
# Whether a call's key set (as an int: pybind enums and key-set operations cost more than the lookup) is plain.
_PLAIN: dict[int, bool] = {}
_grad_enabled, _any_requires_grad = _C.is_grad_enabled, _C._any_requires_grad
_bump = torch.autograd.graph.increment_version
try:  # what torch.compiler.disable does around a call, without its Python layers (a tenth of the time)
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:
    _set_eval_frame = None
_PT2 = tuple(t for t in (getattr(torch.Tag, "pt2_compliant_tag", None),) if t is not None)


class Op:
    """One op of the ``deepep_cupy`` namespace, from its implementation ``fn`` (type annotations give
    the schema). ``default`` is its overload; ``register_fake`` and ``register_autograd`` as torch's."""

    def __init__(self, name: str, fn, mutates_args=(), tags=(), integer_inputs: bool = False):
        self.name, self.qualname = name, f"{NS}::{name}"
        _LIB.define(name + _infer_schema(fn, mutates_args=tuple(mutates_args)), tags=(*tags, *_PT2))
        self.default = getattr(getattr(torch.ops, NS), name).default
        returns = self.default._schema.returns
        self._returns_list = len(returns) == 1 and returns[0].type.kind() == "ListType"
        self._backward = self._setup = None
        run = _kernel(fn, [list(inspect.signature(fn).parameters).index(a) for a in mutates_args])
        _LIB.impl(name, run, "CompositeExplicitAutograd")
        if not integer_inputs:
            _LIB.impl(name, _autograd_kernel(self, run), "Autograd", with_keyset=True)

    def __call__(self, *args):
        return self.default(*args)

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=_LIB)
        return fn

    def register_autograd(self, backward, setup_context) -> None:
        """``backward(ctx, *grads)`` (one list of grads for an op that returns a list) gives one gradient
        per argument (a list for a list of tensors); ``setup_context(ctx, inputs, output)``, as torch's."""
        self._backward, self._setup = backward, setup_context


# Kernels are closures, not methods: on this path every attribute read and Python frame shows in the time.
def _kernel(fn, written: list):
    """``fn`` with dynamo off, then the version counters of the arguments at ``written`` bumped."""
    if _set_eval_frame is None:
        fn = torch.compiler.disable(fn)

    def run(*args):
        if _set_eval_frame is None:
            out = fn(*args)
        else:
            prior = _set_eval_frame(None)
            try:
                out = fn(*args)
            finally:
                _set_eval_frame(prior)
        for i in written:
            if args[i] is not None:
                _bump(args[i])
        return out

    return run


def _autograd_kernel(op: Op, run):
    overload, returns_list = op.default, op._returns_list

    def autograd(keyset, *args):
        if _grad_enabled() and _any_requires_grad(*args):
            flat, spec = _flatten(args)
            out = _Differentiable.apply(op, keyset, spec, *flat)
            return list(out) if returns_list else out
        plain = _PLAIN.get(keyset.raw_repr())
        if plain or (plain is None and _plain(keyset)):
            return run(*args)
        with _C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & _AFTER_AUTOGRAD, *args)

    return autograd


def _plain(keyset) -> bool:
    plain = (keyset & _BELOW_VIEWS).highestPriorityTypeId() in _BACKENDS
    if len(_PLAIN) < 256:  # a handful of sets in practice (backends, modes); never grows without bound
        _PLAIN[keyset.raw_repr()] = plain
    return plain


class _Differentiable(torch.autograd.Function):
    """An op call that autograd records: the op below autograd, then the op's formula as its backward.
    Lists of tensors travel flattened (a Function sees only tensors); the formulas see them as lists."""

    @staticmethod
    def forward(ctx, op, keyset, spec, *flat):
        args = _unflatten(flat, spec)
        with _C._AutoDispatchBelowAutograd():
            out = op.default.redispatch(keyset & _AFTER_AUTOGRAD, *args)
        ctx.deepep_op, ctx.deepep_spec = op, spec
        if op._setup is not None:
            op._setup(ctx, args, out)
        return tuple(out) if op._returns_list else out

    @staticmethod
    def backward(ctx, *grads):
        op, spec = ctx.deepep_op, ctx.deepep_spec
        if op._backward is None:
            raise RuntimeError(f"{op.qualname} has no backward formula: its inputs cannot get gradients through it")
        flat_needs = ctx.needs_input_grad
        ctx.needs_input_grad = _unflatten(flat_needs[3:], spec)  # per argument, as the formula names them
        try:
            result = op._backward(ctx, list(grads)) if op._returns_list else op._backward(ctx, *grads)
        finally:
            ctx.needs_input_grad = flat_needs
        if not isinstance(result, tuple):
            result = (result,)
        return (None, None, None, *_flatten_grads(result, spec))


def _flatten(args) -> tuple[list, tuple]:
    """``args`` with each non-empty list of tensors spread out, and per argument its list length (-1: not one)."""
    flat, spec = [], []
    for a in args:
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            flat.extend(a)
            spec.append(len(a))
        else:
            flat.append(a)
            spec.append(-1)
    return flat, tuple(spec)


def _unflatten(flat, spec) -> tuple:
    args, i = [], 0
    for n in spec:
        if n < 0:
            args.append(flat[i])
            i += 1
        else:
            args.append(list(flat[i:i + n]))
            i += n
    return tuple(args)


def _flatten_grads(grads, spec) -> list:
    if len(grads) != len(spec):
        raise RuntimeError(f"a backward formula returned {len(grads)} gradients for {len(spec)} arguments")
    flat = []
    for g, n in zip(grads, spec, strict=True):
        if n < 0:
            flat.append(g)
        else:
            flat.extend([None] * n if g is None else g)
    return flat
