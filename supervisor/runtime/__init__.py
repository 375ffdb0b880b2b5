"""The loop's clock, timers and stall guard, and the runtime records it owns (tenants, workers, requests)."""

__all__: list[str] = []
