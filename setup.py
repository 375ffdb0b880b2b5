"""Builds the one C extension, ``shared._atomics``; all metadata is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shared._atomics",
            sources=["shared/_atomics.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"],
        )
    ]
)
