"""Builds the C extensions, ``shared._atomics`` and ``worker._stubexec``; all metadata is in pyproject.toml."""

from setuptools import Extension, setup

_FLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"]

setup(
    ext_modules=[
        Extension("shared._atomics", sources=["shared/_atomics.c"], extra_compile_args=_FLAGS),
        # the stub's device thread (worker/backends/stub_executor.py); a build without it runs the stub's
        # queued ops on the Python device thread, as before
        Extension("worker._stubexec", sources=["worker/_stubexec.c"], extra_compile_args=_FLAGS,
                  extra_link_args=["-pthread"], optional=True),
    ]
)
