"""What the supervisor shows: lifecycle events and their log, metrics hooks, health, the Prometheus exporter."""

__all__: list[str] = []
