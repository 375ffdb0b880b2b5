"""Requests in flight and their replies, held-byte budgets, device placement and shared-memory regions."""

__all__: list[str] = []
