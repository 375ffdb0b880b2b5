"""The admin operations (register, evict, scale, quotas) and the service operations they drive."""

__all__: list[str] = []
