"""What the supervisor keeps: the durable SQLite state, the run dir, the tenant registry and its audit."""

__all__: list[str] = []
