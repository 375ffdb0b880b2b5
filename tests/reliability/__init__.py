"""Reliability suite: faults, kills, hostile and slow clients; nothing lost, nothing leaked (docs/RELIABILITY.md)."""
