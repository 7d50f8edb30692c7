"""The plugin module polyaccel loads through the ``polyaccel.plugins`` entry point.

It carries the contract version it was written for and the hook implementations;
everything heavy is imported inside the hooks, so discovery stays cheap. What concerns
the accelerator itself (its report facts, its comm hooks) is a method of its class.
"""

from polyaccel.hookspecs import hookimpl

#: the polyaccel contract version this plugin was written for (major must match the core's;
#: 1.1 brought the polyaccel_op_builders hook, 1.2 HostAccelerator)
POLYACCEL_API_VERSION = "1.2"


@hookimpl
def polyaccel_accelerators():
    from .accelerator import ExampleAccelerator

    return [ExampleAccelerator]


@hookimpl
def polyaccel_op_builders():
    from .ops import builders

    return builders()


@hookimpl
def polyaccel_emulated_runtimes():
    """The stand-in runtime for tests without the device; imported only when a test asks for it."""
    from .emulation import ExampleRuntime

    return [ExampleRuntime]
