"""The plugin module polyaccel loads through the ``polyaccel.plugins`` entry point.

It carries the contract version it was written for and the hook implementations;
everything heavy is imported inside the hooks, so discovery stays cheap.
"""

from polyaccel.hookspecs import hookimpl

#: the polyaccel contract version this plugin was written for (major must match the core's)
POLYACCEL_API_VERSION = "1.0"


@hookimpl
def polyaccel_accelerators():
    from .accelerator import ExampleAccelerator

    return [ExampleAccelerator]


@hookimpl
def polyaccel_register_ops(registry):
    from .ops import register

    register(registry)


@hookimpl
def polyaccel_report(accelerator):
    from .accelerator import ExampleAccelerator

    return {"graphs": "recorded op replay on the host", "selected": isinstance(accelerator, ExampleAccelerator)}


@hookimpl
def polyaccel_emulated_runtimes():
    """The stand-in runtime for tests without the device; imported only when a test asks for it."""
    from .emulation import ExampleRuntime

    return [ExampleRuntime]
