"""Code that runs in the client's process: SupervisorClient, bulk data, launch, event following."""

__all__: list[str] = []
