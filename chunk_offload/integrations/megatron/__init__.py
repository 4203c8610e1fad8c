"""Megatron-core integration.

`cpu_compat` runs megatron-core on a CPU-only host (tests, CPU development); import it explicitly,
it is not imported here because importing megatron-core is slow.
"""

__all__: list[str] = []
