"""Human byte sizes."""

from __future__ import annotations

from typing import Any

import pytest

from shared.sizes import MAX_SIZE, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        (MAX_SIZE, MAX_SIZE),
        ("0", 0),
        ("4096", 4096),
        ("4096B", 4096),
        ("1b", 1),
        ("1K", 1024),
        ("1k", 1024),
        ("1Ki", 1024),
        ("1KiB", 1024),
        ("1kB", 1000),
        ("1KB", 1000),
        ("512MiB", 512 << 20),
        ("512M", 512 << 20),
        ("1MB", 10**6),
        ("2GiB", 2 << 30),
        ("2g", 2 << 30),
        ("3GB", 3 * 10**9),
        ("1TiB", 1 << 40),
        ("1TB", 10**12),
        ("1.5G", (3 << 30) // 2),
        ("1.5GiB", (3 << 30) // 2),
        ("0.5KiB", 512),
        ("1.25MB", 1_250_000),
        ("0.1B", 0),  # fractions of a byte are truncated
        ("  8 GiB  ", 8 << 30),
        ("8\tGiB", 8 << 30),
        ("8388607TiB", 8388607 << 40),
    ],
)
def test_parse_size(text: int | str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", " ", "GiB", "-1", "-1GiB", "1.", ".5G", "1..5G", "1e9", "1 2", "1XB", "1PiB", "1GiBs", "0x10",
     "1,000", "٣GiB", "１GiB", "1_000", "8388608TiB", "9223372036854775808"],
)
def test_parse_size_rejects_bad_strings(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


@pytest.mark.parametrize("value", [-1, 1 << 63, 1 << 64])
def test_parse_size_rejects_out_of_range_ints(value: int) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


@pytest.mark.parametrize("value", [True, False, 1.5, None, b"1GiB", [1]])
def test_parse_size_rejects_other_types(value: Any) -> None:
    with pytest.raises(TypeError):
        parse_size(value)


def test_parse_size_names_what_in_messages() -> None:
    with pytest.raises(ValueError, match="gpu_memory_bytes_cap"):
        parse_size("lots", what="gpu_memory_bytes_cap")
    with pytest.raises(TypeError, match="gpu_memory_bytes_cap"):
        parse_size(1.0, what="gpu_memory_bytes_cap")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "-"),
        (0, "0B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (1536, "1.5KiB"),
        (512 << 20, "512MiB"),
        (8 << 30, "8GiB"),
        ((3 << 30) // 2, "1.5GiB"),
        (1 << 40, "1TiB"),
        (5 << 40, "5TiB"),
    ],
)
def test_format_size(n: int | None, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize("n", [0, 1, 1024, 4 << 10, 512 << 20, 8 << 30, 1 << 40, 123 << 20, 1023 << 30])
def test_exact_multiples_round_trip(n: int) -> None:
    assert parse_size(format_size(n)) == n
