"""Programs built on the public API: the demo, the benchmarks and the chaos campaigns."""

__all__: list[str] = []
