"""The numpy twin of ``sdk/examples/c/transformer.c``: its inputs, and what its ``forward`` must equal.

Used by ``twt demo`` (the C-built guest in the main job) and by tests/sdk/test_examples.py. The
guest's layouts: ``wq``/``wk``/``wv`` are ``[heads, c, d]`` (head ``h``'s slice of a ``[c, heads*d]``
projection), ``wo`` is ``[heads*d, c]``. Weights are drawn like a trained block's (scaled by
``1/sqrt(fan_in)``), so activations stay of order 1 and a tolerance means the same at any size.

``wdtype`` "f32" is the guest's float32 path; "f16" / "bf16" its mixed-precision one: the six weight
matrices stored in that dtype, attention computed from them widened to float32, the MLP's GEMMs on
activations rounded to that dtype with float32 accumulation (``twt_gemm_ex``). The reference does the
same roundings at the same points, so the guest differs from it only by float32 summation order
(and the rare activation whose rounding that flips).
"""

from __future__ import annotations

from typing import Any

__all__ = ["DTYPE_CODES", "TOLERANCE", "WEIGHT_NAMES", "transformer_inputs", "transformer_reference"]

#: the ABI's dtype codes (TWT_F32, TWT_F16, TWT_BF16)
DTYPE_CODES = {"f32": 0, "f16": 1, "bf16": 2}
#: (rtol, atol) the guest's output must meet against :func:`transformer_reference`, per ``wdtype``
TOLERANCE = {"f32": (1e-4, 1e-4), "f16": (2e-3, 2e-3), "bf16": (1e-2, 1e-2)}
#: the guest's buffer arguments, in order (``out`` last)
WEIGHT_NAMES = ("tok", "emb", "pos", "ln1_g", "ln1_b", "wq", "wk", "wv", "wo", "ln2_g", "ln2_b", "w1", "b1", "w2",
                "b2")
_LOW = ("wq", "wk", "wv", "wo", "w1", "w2")


def _np_dtype(wdtype: str) -> Any:
    import numpy as np

    if wdtype == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float16 if wdtype == "f16" else np.float32


def transformer_inputs(t: int, c: int, heads: int, f: int, vocab: int, *, seed: int = 0,
                       wdtype: str = "f32") -> dict[str, Any]:
    """The guest's inputs as contiguous arrays (token ids int32, the six matrices in ``wdtype``)."""
    import numpy as np

    r = np.random.default_rng(seed)
    d = c // heads

    def w(*shape: int, fan_in: int) -> Any:
        return (r.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(fan_in))).astype(np.float32)

    p = {
        "tok": r.integers(0, vocab, t, dtype=np.int32),
        "emb": r.standard_normal((vocab, c), dtype=np.float32),
        "pos": r.standard_normal((t, c), dtype=np.float32) * np.float32(0.1),
        "ln1_g": (1 + 0.1 * r.standard_normal(c)).astype(np.float32),
        "ln1_b": (0.1 * r.standard_normal(c)).astype(np.float32),
        "wq": w(heads, c, d, fan_in=c), "wk": w(heads, c, d, fan_in=c), "wv": w(heads, c, d, fan_in=c),
        "wo": w(heads * d, c, fan_in=heads * d),
        "ln2_g": (1 + 0.1 * r.standard_normal(c)).astype(np.float32),
        "ln2_b": (0.1 * r.standard_normal(c)).astype(np.float32),
        "w1": w(c, f, fan_in=c), "b1": (0.1 * r.standard_normal(f)).astype(np.float32),
        "w2": w(f, c, fan_in=f), "b2": (0.1 * r.standard_normal(c)).astype(np.float32),
    }
    for name in _LOW:
        p[name] = np.ascontiguousarray(p[name].astype(_np_dtype(wdtype)))
    return p


def _layernorm(x: Any, g: Any, b: Any) -> Any:
    import numpy as np

    mean = x.mean(axis=1, keepdims=True, dtype=np.float32)
    dev = x - mean
    var = (dev * dev).mean(axis=1, keepdims=True, dtype=np.float32)
    return dev / np.sqrt(var + np.float32(1e-5)) * g + b


def _gelu(x: Any) -> Any:
    import numpy as np

    return np.float32(0.5) * x * (np.float32(1) + np.tanh(np.float32(0.7978845608028654)
                                                           * (x + np.float32(0.044715) * x * x * x)))


def transformer_reference(p: dict[str, Any], heads: int, wdtype: str = "f32") -> Any:
    """``out`` [t, c] of the block on inputs ``p`` (float32 numpy, the guest's roundings)."""
    import numpy as np

    f32 = {k: (v.astype(np.float32) if k in _LOW else v) for k, v in p.items()}  # widening is exact
    tok = p["tok"]
    t = tok.size
    c = p["emb"].shape[1]
    d = c // heads
    with np.errstate(all="ignore"):
        x = p["emb"][tok] + p["pos"][:t]
        a = _layernorm(x, p["ln1_g"], p["ln1_b"])
        q = a @ f32["wq"]  # [heads, t, d]: one activation against every head's projection
        k = a @ f32["wk"]
        v = a @ f32["wv"]
        s = (q @ k.transpose(0, 2, 1)) * np.float32(1 / np.sqrt(np.float32(d)))
        s[:, np.triu(np.ones((t, t), dtype=bool), 1)] = -np.inf
        e = np.exp(s - s.max(axis=2, keepdims=True))
        attn = e / e.sum(axis=2, keepdims=True)
        o = attn @ v  # [heads, t, d]
        x = x + o.transpose(1, 0, 2).reshape(t, heads * d) @ f32["wo"]
        a2 = _layernorm(x, p["ln2_g"], p["ln2_b"])
        if wdtype != "f32":
            a2 = a2.astype(_np_dtype(wdtype)).astype(np.float32)
        hidden = _gelu(a2 @ f32["w1"] + p["b1"])
        if wdtype != "f32":
            hidden = hidden.astype(_np_dtype(wdtype)).astype(np.float32)
        return (x + hidden @ f32["w2"] + p["b2"]).astype(np.float32)
