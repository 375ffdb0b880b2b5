"""What the supervisor learns from the host it runs on: whether an NVIDIA MPS daemon is alive."""

__all__: list[str] = []
