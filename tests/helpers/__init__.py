"""Test helpers (import from here, never from a conftest)."""
