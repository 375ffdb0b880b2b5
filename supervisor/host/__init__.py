"""What the supervisor asks of the host it runs on: NVIDIA MPS, file descriptors, secret files' modes."""

__all__: list[str] = []
