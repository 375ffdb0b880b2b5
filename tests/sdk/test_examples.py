"""Every example of sdk/examples, in C and in Zig, built with ``twt build`` and run by the host.

In process: a real TenantContext over a real QuotaBlock and the stub
backend (tests/helpers/wasm_env.py). Checked against numpy (axpy+sum, the
MLP, which must also equal the bundled WAT guest bit for bit: the same host
ops in the same order) and against scikit-learn (the digits classifier).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from tests.helpers.sdk_build import SdkBuilder
from tests.helpers.wasm_env import MLP, Env, compiled_once, mlp_inputs, softmax, tenant_env
from worker.backends.stub import StubBackend

pytestmark = pytest.mark.timeout(300)  # the first build of a session compiles wasi-libc

MiB = 1 << 20
LANGS = ["c", "zig"]


@pytest.fixture
def env() -> Iterator[Env]:
    with tenant_env("sdk", StubBackend(), gpu_cap=64 * MiB, max_memory=4 * MiB, wasm_timeout_s=30.0) as e:
        yield e


@contextmanager
def client_buffers(env: Env, arrays: dict[str, Any], empty: dict[str, int] | None = None) -> Iterator[dict[str, int]]:
    """Client buffers holding ``arrays`` (and zeroed ones of ``empty`` bytes), freed on the way out."""
    alloc = env.ctx.allocator
    handles: dict[str, int] = {}
    try:
        for name, arr in arrays.items():
            handles[name] = alloc.alloc(arr.nbytes)
            alloc.write(handles[name], 0, memoryview(np.ascontiguousarray(arr).tobytes()))
        for name, nbytes in (empty or {}).items():
            handles[name] = alloc.alloc(nbytes)
        yield handles
    finally:
        for h in handles.values():
            alloc.free(h)


def read(env: Env, handle: int, dtype: Any, count: int) -> Any:
    return np.frombuffer(env.ctx.allocator.read(handle, 0, count * np.dtype(dtype).itemsize), dtype=dtype)


def run(env: Env, module: bytes, export: str, args: list[Any]) -> dict[str, Any]:
    """A run of an example, compiled once per process (several tests run each example; what they
    check is the runs' results)."""
    with compiled_once(env, module):
        return env.host.run(module, export, args, fuel=10**10, timeout_s=30.0)


# ------------------------------------------------------------------ axpy + sum


@pytest.mark.parametrize("lang", LANGS)
def test_axpy_sum_matches_numpy(sdk: SdkBuilder, env: Env, lang: str) -> None:
    module = sdk.example(lang, "axpy_sum")
    rng = np.random.default_rng(28)
    n = 100_003  # not a multiple of the examples' 64 KiB copy chunk
    x = rng.standard_normal(n, dtype=np.float32)
    y = rng.standard_normal(n, dtype=np.float32)
    with client_buffers(env, {"x": x, "y": y}) as h:
        reply = run(env, module, "run", [{"handle": h["x"]}, {"handle": h["y"]}, n, 0.3])
        ref = np.float32(0.3) * x + y
        np.testing.assert_array_equal(read(env, h["y"], np.float32, n), ref)
        (total,) = reply["results"]
        assert np.float32(total) == np.add.reduce(ref, dtype=np.float32)
        assert reply["gpu_peak_bytes"] == 4 * n and reply["exit_code"] is None
        assert len(reply["logs"]) == 1 and reply["logs"][0].startswith(f"axpy_sum: n={n}")
    assert env.counters() == (0, 0)


@pytest.mark.parametrize("lang", LANGS)
def test_axpy_sum_reports_a_quota_refusal(sdk: SdkBuilder, lang: str) -> None:
    module = sdk.example(lang, "axpy_sum")
    n = 1 << 18  # 1 MiB per vector: x and y fit the 2.5 MiB cap, the scratch copy does not
    with tenant_env("sdk", StubBackend(), gpu_cap=(5 * MiB) // 2, max_memory=4 * MiB) as env:
        with client_buffers(env, {}, {"x": 4 * n, "y": 4 * n}) as h:
            reply = run(env, module, "run", [{"handle": h["x"]}, {"handle": h["y"]}, n, 1.0])
            assert np.isnan(reply["results"][0])
            assert "GPU_QUOTA" in reply["logs"][0] or "GpuQuota" in reply["logs"][0]


# ------------------------------------------------------------------ the MLP


@pytest.mark.parametrize("lang", LANGS)
def test_the_mlp_matches_numpy_and_the_wat_guest(sdk: SdkBuilder, env: Env, lang: str) -> None:
    module = sdk.example(lang, "mlp")
    batch, d_in, hidden, d_out = 64, 32, 48, 10
    p = mlp_inputs(batch, d_in, hidden, d_out)
    outputs = []
    with client_buffers(env, p, {"out": 4 * batch * d_out}) as h:
        args = [{"handle": h[k]} for k in ("x", "w1", "b1", "w2", "b2", "out")]
        for guest in (module, MLP):
            reply = run(env, guest, "forward", [*args, batch, d_in, hidden, d_out])
            assert reply["results"] == [0]
            assert reply["gpu_peak_bytes"] == 4 * batch * hidden
            outputs.append(read(env, h["out"], np.float32, batch * d_out).reshape(batch, d_out).copy())
        ref = softmax(np.maximum(p["x"] @ p["w1"] + p["b1"], 0) @ p["w2"] + p["b2"])
        np.testing.assert_allclose(outputs[0], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(outputs[0], outputs[1])  # the same host ops as mlp.wat, in the same order
        classes = run(env, module, "classes", [args[-1], batch, d_out])
        assert classes["results"] == [int(outputs[0].argmax(axis=1).sum())]


@pytest.mark.parametrize("lang", LANGS)
def test_the_mlp_returns_the_quota_code(sdk: SdkBuilder, lang: str) -> None:
    module = sdk.example(lang, "mlp")
    batch, d_in, hidden, d_out = 16, 8, 64, 4
    p = mlp_inputs(batch, d_in, hidden, d_out)
    weights = sum(a.nbytes for a in p.values()) + 4 * batch * d_out
    with tenant_env("sdk", StubBackend(), gpu_cap=weights + 1024, max_memory=4 * MiB) as env:
        with client_buffers(env, p, {"out": 4 * batch * d_out}) as h:
            args = [{"handle": h[k]} for k in ("x", "w1", "b1", "w2", "b2", "out")]
            reply = run(env, module, "forward", [*args, batch, d_in, hidden, d_out])
            assert reply["results"] == [-5]  # TWT_GPU_QUOTA / error.GpuQuota for the hidden buffer


# ------------------------------------------------------------------ the digits classifier


@pytest.fixture(scope="module")
def digits_model() -> dict[str, Any]:
    """A multinomial logistic regression trained on scikit-learn's bundled digits (no download).

    Its weights are then rounded to multiples of 2**-8. Why: the pixels are
    integers 0..16, so with such weights every product and every partial sum
    of ``x @ w + b`` is a multiple of 2**-8 below 2**15: exact in float32
    and float64 alike, whatever the order of summation (BLAS, cuBLAS). The
    host's float32 scores are then the very numbers scikit-learn's float64
    ``decision_function`` computes, so the argmax (first index on ties, as
    numpy's) is the same on every image, on every backend. Unrounded float32
    weights would almost always agree too, but a near-tie could flip one
    image on one machine's BLAS; this way equality is a theorem, not luck.
    The model scikit-learn predicts with is the rounded one (coef_ and
    intercept_ replaced); the accuracy of both is reported.
    """
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from threadpoolctl import threadpool_limits

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    # one BLAS thread: on a small, busy machine OpenMP/BLAS threads spinning for cores make the fit 25x slower
    with threadpool_limits(limits=1), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lbfgs may report slow convergence on raw pixels; accuracy is checked
        clf = LogisticRegression(max_iter=3000, C=0.05).fit(x_train, y_train)
    float_accuracy = float(clf.score(x_test, y_test))
    scale = 2.0**8
    clf.coef_ = np.round(clf.coef_ * scale) / scale
    clf.intercept_ = np.round(clf.intercept_ * scale) / scale
    # the exactness argument's premise: |partial sums| < 2**15 (so < 2**24 steps of 2**-8)
    bound = np.abs(clf.coef_).sum(axis=1).max() * 16 + np.abs(clf.intercept_).max()
    assert bound < 2.0**15
    return {
        "x": x_test.astype(np.float32),
        "w": np.ascontiguousarray(clf.coef_.T, dtype=np.float32),
        "b": clf.intercept_.astype(np.float32),
        "labels": y_test.astype(np.int32),
        "predict": clf.predict(x_test).astype(np.int32),
        "float_accuracy": float_accuracy,
    }


@pytest.mark.parametrize("lang", LANGS)
def test_the_digits_classifier_equals_scikit_learn(sdk: SdkBuilder, env: Env, digits_model: dict[str, Any],
                                                   lang: str) -> None:
    module = sdk.example(lang, "digits")
    m = digits_model
    n, d = m["x"].shape
    k = m["w"].shape[1]
    with client_buffers(env, {name: m[name] for name in ("x", "w", "b", "labels")}, {"pred": 4 * n}) as h:
        args = [{"handle": h[name]} for name in ("x", "w", "b", "labels", "pred")]
        reply = run(env, module, "classify", [*args, n, d, k])
        pred = read(env, h["pred"], np.int32, n)
    mismatches = np.flatnonzero(pred != m["predict"])
    assert mismatches.size == 0, f"images {mismatches[:10].tolist()} differ from scikit-learn's predict"
    correct = int((m["predict"] == m["labels"]).sum())
    assert reply["results"] == [correct]
    accuracy = correct / n
    print(f"\n{lang} digits guest: {n} held-out images, predictions equal to scikit-learn's on all of them; "
          f"accuracy {accuracy:.4f} (unrounded float weights: {m['float_accuracy']:.4f})")
    assert accuracy > 0.9
    assert reply["logs"] == [f"digits: {correct} of {n} held-out images correct, accuracy {accuracy:.4f}"]
    assert reply["gpu_peak_bytes"] == 4 * n * k  # the scores buffer, freed with the run


def test_the_digits_classifier_on_the_cuda_backend(sdk: SdkBuilder, digits_model: dict[str, Any]) -> None:
    """The same C guest over the cuda backend (fake driver and fake cuBLAS, NVRTC kernels): the same predictions."""
    from tests.helpers.fake_cublas import FakeCublas
    from tests.helpers.fake_cuda import FakeDriver
    from worker.backends.cuda import CudaBackend

    module = sdk.example("c", "digits")
    m = digits_model
    n, d = m["x"].shape
    k = m["w"].shape[1]
    fake = FakeDriver(memory_bytes=1 << 30)
    backend = CudaBackend(driver=fake, nvrtc=fake, gpu_cap_bytes=64 * MiB, cublas=FakeCublas(fake))
    with tenant_env("sdk-gpu", backend, gpu_cap=64 * MiB, max_memory=4 * MiB, wasm_timeout_s=30.0) as env:
        with client_buffers(env, {name: m[name] for name in ("x", "w", "b", "labels")}, {"pred": 4 * n}) as h:
            args = [{"handle": h[name]} for name in ("x", "w", "b", "labels", "pred")]
            reply = run(env, module, "classify", [*args, n, d, k])
            pred = read(env, h["pred"], np.int32, n)
    np.testing.assert_array_equal(pred, m["predict"])
    assert reply["results"] == [int((m["predict"] == m["labels"]).sum())]


# ------------------------------------------------------------------ the transformer block


def _transformer(env: Env, module: bytes, p: dict[str, Any], t: int, c: int, heads: int, f: int,
                 wdtype: str) -> tuple[dict[str, Any], Any]:
    from supervisor.tools.transformer_ref import DTYPE_CODES, WEIGHT_NAMES

    with client_buffers(env, {name: p[name] for name in WEIGHT_NAMES}, {"out": 4 * t * c}) as h:
        args = [{"handle": h[name]} for name in (*WEIGHT_NAMES, "out")]
        reply = run(env, module, "forward", [*args, t, c, heads, f, DTYPE_CODES[wdtype]])
        return reply, read(env, h["out"], np.float32, t * c).reshape(t, c).copy()


@pytest.mark.parametrize("wdtype", ["f32", "f16", "bf16"])
def test_the_transformer_block_equals_numpy(sdk: SdkBuilder, env: Env, wdtype: str) -> None:
    """Embedding gather, layer norm, 4-head causal attention, residuals, a GELU MLP: equal to numpy to
    1e-4 in float32; the f16/bf16 weights variant within its documented tolerance."""
    from supervisor.tools.transformer_ref import TOLERANCE, transformer_inputs, transformer_reference

    module = sdk.example("c", "transformer")
    t, c, heads, f, vocab = 24, 32, 4, 64, 50
    p = transformer_inputs(t, c, heads, f, vocab, seed=4, wdtype=wdtype)
    reply, got = _transformer(env, module, p, t, c, heads, f, wdtype)
    assert reply["results"] == [0], reply["logs"]
    rtol, atol = TOLERANCE[wdtype]
    np.testing.assert_allclose(got, transformer_reference(p, heads, wdtype), rtol=rtol, atol=atol)
    assert reply["logs"] == [f"transformer: {t} tokens, d_model {c}, {heads} heads, {wdtype} weights"]
    assert env.counters() == (0, 0)  # every scratch buffer of the run freed
    if wdtype != "f32":  # and against the float32 block on the same (rounded) weights: mixed precision is close
        full = transformer_reference(p, heads, "f32")
        assert float(np.abs(got - full).max()) < 10 * atol


def test_the_transformer_block_on_the_cuda_backend(sdk: SdkBuilder) -> None:
    """The same guest over the cuda backend (fake driver and cuBLAS, the kernels' numpy twins)."""
    from supervisor.tools.transformer_ref import TOLERANCE, transformer_inputs, transformer_reference
    from tests.helpers.fake_cublas import FakeCublas
    from tests.helpers.fake_cuda import FakeDriver
    from worker.backends.cuda import CudaBackend

    module = sdk.example("c", "transformer")
    t, c, heads, f, vocab = 16, 32, 2, 48, 40
    fake = FakeDriver(memory_bytes=1 << 30)
    backend = CudaBackend(driver=fake, nvrtc=fake, gpu_cap_bytes=64 * MiB, cublas=FakeCublas(fake))
    with tenant_env("sdk", backend, gpu_cap=64 * MiB, max_memory=4 * MiB, wasm_timeout_s=30.0) as env:
        for wdtype in ("f32", "bf16"):
            p = transformer_inputs(t, c, heads, f, vocab, seed=6, wdtype=wdtype)
            reply, got = _transformer(env, module, p, t, c, heads, f, wdtype)
            assert reply["results"] == [0], reply["logs"]
            rtol, atol = TOLERANCE[wdtype]
            np.testing.assert_allclose(got, transformer_reference(p, heads, wdtype), rtol=rtol, atol=atol)


def test_the_transformer_block_refuses_a_token_past_the_vocabulary(sdk: SdkBuilder, env: Env) -> None:
    from supervisor.tools.transformer_ref import transformer_inputs

    module = sdk.example("c", "transformer")
    t, c, heads, f, vocab = 8, 16, 2, 32, 10
    p = transformer_inputs(t, c, heads, f, vocab, seed=1)
    p["tok"][3] = vocab
    reply, _ = _transformer(env, module, p, t, c, heads, f, "f32")
    assert reply["results"] == [-4]  # TWT_BUFFER_BOUNDS from the gather, returned by forward
    assert env.counters() == (0, 0)
