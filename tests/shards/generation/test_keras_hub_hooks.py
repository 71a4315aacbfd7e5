"""The private keras_hub API the generation stages run through, checked against the installed
release. pyproject bounds keras-hub below its next minor; these tests say, naming the hook, that
a newer release moved or changed it (the greedy-equality tests would fail without saying why)."""

from __future__ import annotations

import inspect

_UPGRADE = "pin keras-hub in pyproject.toml or port shards/generation/stage.py to the new API"


def test_the_vllm_context_scope_takes_the_attention_function_positions_and_caches() -> None:
    from keras_hub.src.vllm import context

    scope = getattr(context, "vllm_context_scope", None)
    assert callable(scope), f"keras_hub.src.vllm.context.vllm_context_scope is gone; {_UPGRADE}"
    params = list(inspect.signature(scope).parameters)
    assert params == ["paged_attention_func", "positions", "kv_caches"], (
        f"vllm_context_scope{inspect.signature(scope)} changed; {_UPGRADE}"
    )


def test_the_bridge_calls_the_attention_function_as_stage_py_expects() -> None:
    from keras_hub.src.vllm import attention

    source = inspect.getsource(attention.vllm_paged_attention)
    call = (
        "ctx.paged_attention_func(\n        cache,\n        query,\n        key,\n        value,\n"
        "        scale,\n        head_dim,\n        num_heads,\n        kv_heads,"
    )
    assert call in source, (
        f"vllm_paged_attention no longer calls paged_attention_func(cache, query, key, value, "
        f"scale, head_dim, num_heads, kv_heads, ...); {_UPGRADE}"
    )
    assert "ctx.layer_index = cache_index + 1" in source, (
        f"vllm_paged_attention no longer takes the layers' caches in call order; {_UPGRADE}"
    )


def test_the_families_attention_layers_take_the_hook() -> None:
    from keras_hub.src.layers.modeling.cached_multi_head_attention import (
        CachedMultiHeadAttention,
    )
    from keras_hub.src.models.llama.llama_attention import LlamaAttention

    for layer in (CachedMultiHeadAttention, LlamaAttention):
        source = inspect.getsource(layer.call)
        assert "get_vllm_context()" in source and "_compute_vllm_attention" in source, (
            f"{layer.__name__}.call no longer hands attention to the vLLM hook; {_UPGRADE}"
        )
    rope = inspect.getsource(LlamaAttention._compute_vllm_attention)
    assert "vllm_context.positions" in rope, (
        f"LlamaAttention no longer applies RoPE at the hook's per-token positions; {_UPGRADE}"
    )
