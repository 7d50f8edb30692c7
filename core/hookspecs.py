"""The plugin contract, readable in one file.

A plugin is any object or module carrying ``@hookimpl`` functions, published under
the entry-point group ``polyaccel.plugins`` and carrying ``POLYACCEL_API_VERSION``
(the contract version it was written for). Implementations may accept fewer
arguments than a spec lists: arguments added to a spec later never break them.

Hooks run at set-up time only (discovery, selection, op registration, comm set-up).
What concerns one accelerator (its comm hooks, its report facts) is a method of its
:class:`polyaccel.Accelerator` subclass, not a hook: the comm and report hooks are for a
plugin that overrides, or adds to, what concerns another plugin's accelerator.
Each plugin's hooks are called for that plugin alone where a failure must stay its own
(:func:`polyaccel.discovery.plugin_hook`). Nothing on a per-tensor path goes through
pluggy: results are resolved once and then called directly.

The other two contracts, what an engine and a model layer provide, are typed Protocols in
:mod:`polyaccel.contracts`.
"""

from __future__ import annotations

import pluggy

PROJECT = "polyaccel"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Attribute an emulated runtime sets to True on every stand-in module and object it installs
#: (``getattr(obj, EMULATED_MARKER, False) is True``), so a plugin can tell its vendor runtime's
#: stand-in from the real one without importing the testing kit.
EMULATED_MARKER = "__polyaccel_emulated__"


@hookspec
def polyaccel_accelerators():
    """Return the accelerator classes this plugin provides (a list, or one class).

    Each class derives from :class:`polyaccel.accelerator.Accelerator`, has a unique
    ``name`` and declares ``api_version``. Return ``[]`` (or nothing) from op-only
    plugins. Must not initialise a device runtime: probing happens later, through
    ``Accelerator.probe()``.
    """


@hookspec
def polyaccel_op_builders():
    """Return the op builders this plugin contributes: a list of :class:`polyaccel.ops.OpBuilder`.

    Called once per process for each loaded plugin, at discovery (after the probes, before
    selection). Any plugin may serve any device type: a third party's faster CUDA quantizer
    simply returns a builder with a higher priority than ours. All or nothing: if the hook
    raises, or returns something that is not a builder or a builder whose name its op
    already has, none of the plugin's builders is used and the plugin is isolated (status
    ``failed``, with the reason, in ``polyaccel report`` and ``polyaccel.ops.explain``).
    """


@hookspec
def polyaccel_register_ops(registry):
    """The contract-1.0 form of :func:`polyaccel_op_builders`, still honoured.

    ``registry.add(OpBuilder(...))`` (or ``registry.register(op, name, device_types, loader,
    **kw)``) contributes a builder; the same all-or-nothing rule applies, and if the hook
    raises, the builders it had added are listed as dropped.
    """


@hookspec(firstresult=True)
def polyaccel_comm_hooks(accelerator):
    """Override the :class:`polyaccel.comm.CommHooks` of ``accelerator`` (any plugin's), or return None.

    An accelerator states its own comm hooks with :meth:`polyaccel.Accelerator.comm_hooks`;
    this hook is for a plugin that changes another's (a vendor collective library, a test
    harness). The first non-None answer wins over the accelerator's own.
    """


@hookspec
def polyaccel_report(accelerator):
    """Return a dict of facts for ``polyaccel report`` about the selected ``accelerator`` (None if none), or None.

    An accelerator reports on itself with :meth:`polyaccel.Accelerator.report_facts`; this
    hook is for what a plugin knows about whichever accelerator is selected (an op-only
    plugin's library versions, for instance). The answer is shown under the plugin's name.
    """


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


@hookspec
def polyaccel_emulated_runtimes():
    """Return the emulated runtimes this plugin ships (a list, or one class), for tests on any machine.

    Each is a :class:`polyaccel.testing.emulation.EmulatedRuntime` subclass: a CPU-backed
    stand-in for a vendor runtime that records calls and reproduces the runtime's documented
    behaviour and failures. Its ``name`` is the accelerator it stands in for (usually the
    plugin's own; any plugin may offer one for any accelerator); ``accelerator`` is that
    accelerator's class, which keeps its tensors on the host while the runtime is active.
    ``polyaccel conformance --emulate``, ``polyaccel.testing.emulation.emulate(name)`` and the
    tests find emulated runtimes only through this hook; where two plugins offer one for the
    same name, the first in discovery order wins. Called only by those testing tools, never
    during discovery or selection; import the emulation module inside the implementation. A
    hook that raises or returns something else is isolated: its plugin offers no emulated
    runtime, and the reason is shown when one is asked for.
    """
