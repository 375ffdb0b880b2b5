"""Who may send what, how much and in which order: the ipc and TCP frontends, peers, fairness, fd budget."""

__all__: list[str] = []
