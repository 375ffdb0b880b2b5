"""Worker processes and tenant instances: the worker set, backend selection, config reload plans."""

__all__: list[str] = []
