"""The XLA flags of the test processes, set by tests/conftest.py before JAX is imported.

Compiling is most of the suite's time on CPU: each test builds programs of its
own shapes and settings, and XLA's back end (LLVM) optimises each one. The tests
run at back-end optimisation level 0: the same HLO passes and the same
arithmetic (no fast math at either level), generated code that runs slower but
compiles in about 60% of the time. Programs that run long enough for the level
to matter are few here. Set XLA_FLAGS yourself to run the suite at another
level (tests/conftest.py keeps a value it finds).
"""

BACKEND_OPTIMIZATION = "--xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process: `devices` CPU devices at the suite's optimisation level."""
    return f"--xla_force_host_platform_device_count={devices} {BACKEND_OPTIMIZATION}"
