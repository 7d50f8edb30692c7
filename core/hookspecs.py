"""The plugin contract, readable in one file.

A plugin is any object or module carrying ``@hookimpl`` functions, published under
the entry-point group ``polyaccel.plugins`` and carrying ``POLYACCEL_API_VERSION``
(the contract version it was written for). Implementations may accept fewer
arguments than a spec lists: arguments added to a spec later never break them.

Hooks run at set-up time only (discovery, selection, op registration, comm set-up).
Nothing on a per-tensor path goes through pluggy: results are resolved once and
then called directly.
"""

from __future__ import annotations

import pluggy

PROJECT = "polyaccel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def polyaccel_accelerators():
    """Return the accelerator classes this plugin provides (a list, or one class).

    Each class derives from :class:`polyaccel.accelerator.Accelerator`, has a unique
    ``name`` and declares ``api_version``. Return ``[]`` (or nothing) from op-only
    plugins. Must not initialise a device runtime: probing happens later, through
    ``Accelerator.probe()``.
    """


@hookspec
def polyaccel_register_ops(registry):
    """Add op builders to ``registry`` with ``registry.add(OpBuilder(...))``.

    Called once per process, at discovery (after the probes, before selection). Any plugin
    may serve any device type: a third party's faster CUDA quantizer simply registers a
    builder with a higher priority than ours. All or nothing: if the hook raises, the
    builders it added are dropped and the plugin is isolated (status ``failed``, with the
    error, in ``polyaccel report`` and ``polyaccel.ops.explain``).
    """


@hookspec(firstresult=True)
def polyaccel_comm_hooks(accelerator):
    """Return the :class:`polyaccel.comm.CommHooks` to use with ``accelerator``, or None.

    The first non-None answer wins. Plugins answer for their own accelerator
    (``accelerator.name``); with no answer the core's defaults are used
    (``accelerator.communication_backend``, device tensors allowed, no staging).
    """


@hookspec
def polyaccel_report(accelerator):
    """Return a dict of extra facts for ``polyaccel report`` (versions, runtime notes), or None."""


@hookspec(firstresult=True)
def polyaccel_collective(op, group, tensors, call):
    """Optional wrapper around each collective and p2p call of ``polyaccel.comm``.

    Implement with ``@hookimpl(wrapper=True)`` and ``yield`` to run the call (the yield
    returns its result: None for a blocking call, a ``CommHandle`` for an async one); ``op``
    is the collective's name, ``group`` the process group (None = world), ``tensors`` the
    tensors this rank sends or reduces (a receive's buffer for recv/irecv) and ``call`` a
    zero-argument callable that performs it (core supplies the innermost implementation).
    Used for tracing and profiling; collectives cost far more than the hook. ``polyaccel.comm``
    looks for wrappers when it is initialised and when a ``CommTracer`` is entered; after
    registering one later, call ``polyaccel.comm.refresh()``. With no wrapper registered,
    calls do not go through pluggy at all.
    """
