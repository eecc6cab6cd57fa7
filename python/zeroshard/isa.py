"""Which instruction set the fused CPU Adam runs with.

The extension ships scalar, AVX2 (+FMA+F16C) and AVX-512 (F+BW+VL+DQ) builds of one kernel and picks the best one
this CPU and OS support at run time (CPUID + XGETBV). Set ``ZEROSHARD_CPU_ISA=scalar|avx2|avx512`` to force one;
forcing an ISA the machine cannot run, or an unknown name, raises ``ValueError`` at the next step.
"""

from __future__ import annotations

from zeroshard import _C

__all__ = ["cpu_isa", "supported_cpu_isas"]


def cpu_isa() -> str:
    """Return the ISA a step without an ``isa=`` override uses now: ``"scalar"``, ``"avx2"`` or ``"avx512"``.

    Honours ``ZEROSHARD_CPU_ISA``. Raises ``ValueError`` if that variable names an unknown or unsupported ISA.
    """
    return _C.cpu_isa()


def supported_cpu_isas() -> list[str]:
    """Return the ISAs this CPU and OS can run, ascending, e.g. ``["scalar", "avx2"]`` (always has ``"scalar"``)."""
    return list(_C.supported_cpu_isas())
