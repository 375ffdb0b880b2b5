"""Programs built on the public API: the demo, the benchmarks, the chaos campaigns, and the module builder (``twt build``)."""

__all__: list[str] = []
