"""The wire contract written out for readers: docs/PROTOCOL.md's generated parts and shared/protocol.schema.json."""

__all__: list[str] = []
