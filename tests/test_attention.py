"""Grouped-query attention: SDPA's own path (``enable_gqa``) and the copied-heads fallback agree."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hetctl.train import model  # noqa: E402


def _qkv(heads=8, groups=2):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 16, 8, generator=g)
    k, v = (torch.randn(2, groups, 16, 8, generator=g) for _ in range(2))
    return q, k, v


def test_native_gqa_equals_the_copied_heads(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(model, "_GQA_NATIVE", [True])
    native = model._attention(q, k, v, 4)
    monkeypatch.setattr(model, "_GQA_NATIVE", [False])
    copied = model._attention(q, k, v, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1),
                                                           is_causal=True)
    torch.testing.assert_close(native, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(copied, ref, rtol=0, atol=0)


def test_a_torch_without_enable_gqa_falls_back_once(monkeypatch):
    """An SDPA that rejects ``enable_gqa`` (torch < 2.5, a plugin) is asked once, then the heads are copied."""
    real = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def old_sdpa(q, k, v, **kw):
        calls.append(sorted(kw))
        if "enable_gqa" in kw:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword argument 'enable_gqa'")
        return real(q, k, v, **kw)

    monkeypatch.setattr(model.F, "scaled_dot_product_attention", old_sdpa)
    monkeypatch.setattr(model, "_GQA_NATIVE", [True])
    q, k, v = _qkv()
    first, second = model._attention(q, k, v, 4), model._attention(q, k, v, 4)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert calls == [["enable_gqa", "is_causal"], ["is_causal"], ["is_causal"]]
