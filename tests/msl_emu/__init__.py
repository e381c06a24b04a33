"""Run kernel bodies written for mx.fast.metal_kernel on the CPU (see metal/README.md)."""

from .emulator import (
    CompileError,
    EmulatorError,
    Tensor,
    find_compiler,
    kernel_source,
    metal_kernel,
    run,
)

__all__ = [
    "CompileError",
    "EmulatorError",
    "Tensor",
    "find_compiler",
    "kernel_source",
    "metal_kernel",
    "run",
]
