"""Small mlx-lm models with random weights, and the cache lists they decode with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from impl.models import make_prompt_cache
from impl.paged import BlockPool, PagedKVCache
from impl.rotating import RotatingKVCache
from impl.turbo import DelegatedKVCache, TurboKVCache

VOCAB = 256


HIDDEN = 64


WEIGHT_SCALE = 2.0


# Scale of the main model's later layers' residual writes in the speculative
# scenario: the one-layer early-exit draft then has about 40% of its tokens
# accepted, so rounds end in every way (0 to NUM_DRAFT accepted).
LATE_LAYER_SCALE = 0.3


NUM_DRAFT = 3


MODEL_KEY = "kvspec-tiny"


def _finish(model: Any, dtype: mx.Dtype = mx.float16) -> Any:
    model.update(tree_map(lambda p: p * WEIGHT_SCALE, model.parameters()))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_llama(seed: int, *, layers: int = 2, layer_types: list[str] | None = None,
               sliding_window: int | None = None, late_scale: float = 1.0, dtype: mx.Dtype = mx.float16,
               head_dim: int | None = None) -> Any:
    """A llama (float16 unless ``dtype``) (hidden 64, 4 query / 2 kv heads, vocab 256) with
    random weights from ``mx.random.seed(seed)``. ``layer_types`` /
    ``sliding_window`` make sliding-window layers; ``late_scale`` scales the
    residual writes of layers 1.. (so an early-exit draft can agree);
    ``head_dim`` (default 16) widens the heads (mlx's quantizer needs 32)."""
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=2 * HIDDEN,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        tie_word_embeddings=False, layer_types=layer_types, sliding_window=sliding_window,
        **({} if head_dim is None else {"head_dim": head_dim}),
    )
    model = llama.Model(args)
    for layer in model.model.layers[1:]:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * late_scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * late_scale
    return _finish(model, dtype)


def early_exit_draft(model: Any) -> Any:
    """A one-layer draft sharing the llama ``model``'s embedding, first layer,
    final norm and head (self-speculative decoding by early exit)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(**{**model.args.__dict__, "num_hidden_layers": 1, "layer_types": None})
    draft = llama.Model(args)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = model.model.layers[:1]
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    return draft


def tiny_gemma3(seed: int, window: int, *, layers: int = 3, pattern: int = 3, dtype: mx.Dtype = mx.float16,
                head_dim: int = 16) -> Any:
    """A gemma3 (float16 unless ``dtype``) whose layers ``i % pattern != pattern - 1`` use a
    sliding window of ``window`` tokens (mlx-lm gives them a RotatingKVCache)."""
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=HIDDEN, num_hidden_layers=layers, intermediate_size=2 * HIDDEN,
        num_attention_heads=4, head_dim=head_dim, num_key_value_heads=2, vocab_size=VOCAB, query_pre_attn_scalar=16,
        sliding_window=window, sliding_window_pattern=pattern, max_position_embeddings=4096,
    )
    return _finish(gemma3_text.Model(args), dtype)


def _scale_post_norms(layer: Any, scale: float) -> None:
    """Scale a gemma3 block's residual writes by ``scale``: its post-norms
    multiply by ``1 + weight``, so ``weight -> scale * (1 + weight) - 1``
    (0 makes the block the identity)."""
    for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
        norm.weight = (scale * (1.0 + norm.weight.astype(mx.float32)) - 1.0).astype(norm.weight.dtype)


def speculative_gemma3(seed: int, window: int, late_scale: float = LATE_LAYER_SCALE) -> tuple[Any, Any]:
    """A gemma3 main model (two sliding-window layers of ``window`` tokens,
    one global) whose later blocks write ``late_scale`` of their residual,
    and its early-exit draft: the same embedding, first block, norm and
    head, with blocks 1 and 2 made the identity (so the draft has the same
    layer kinds, hence rings of its own)."""
    from mlx_lm.models import gemma3_text

    model = tiny_gemma3(seed, window)
    for layer in model.layers[1:]:
        _scale_post_norms(layer, late_scale)
    draft = gemma3_text.Model(model.args)
    draft.set_dtype(mx.float16)
    for layer in draft.layers[1:]:
        _scale_post_norms(layer, 0.0)
    draft.model.embed_tokens = model.model.embed_tokens
    draft.model.layers = [model.layers[0], *draft.model.layers[1:]]
    draft.model.norm = model.model.norm
    draft.lm_head = model.lm_head
    mx.eval(model.parameters(), draft.parameters())
    return model, draft


def token_ids(seed: int, n: int) -> mx.array:
    """``n`` token ids drawn from a seeded NumPy generator, as uint32."""
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, n), dtype=mx.uint32)


Factories = dict[str, Callable[..., Any]] | None


def build_caches(model: Any, mode: str = "fp16", step: int = 256, inplace: bool | None = True,
                 factories: dict[str, Callable[..., Any]] | None = None, undo: int = 0,
                 num_draft_tokens: int = 0) -> list[Any]:
    """``impl.models.make_prompt_cache``, building each kind's layers from
    ``factories[kind]`` (an injected bug's classes) when given; ``undo`` is
    every ring's undo depth, ``num_draft_tokens`` sizes it for speculative
    decoding."""
    return make_prompt_cache(model, mode=mode, step=step, inplace=inplace, classes=factories, undo=undo,
                             num_draft_tokens=num_draft_tokens)


def mlx_lm_caches(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache as lm_make_prompt_cache

    return lm_make_prompt_cache(model)


#: the Turbo modes and their cache parameters in the e2e runs (Delegated with
#: small thresholds so that handoff and block folds happen within a stretch)
TURBO_E2E: dict[str, dict[str, int]] = {
    "turbo4asym": {}, "turbo4": {}, "turbo3asym": {}, "turbo4delegated": {"hot_threshold": 6, "fold_block": 3},
}


def turbo_caches(model: Any, mode: str, factories: Factories = None) -> list[Any]:
    """``make_prompt_cache`` in a Turbo ``mode`` (step 4), built from
    ``factories["dense"]`` when that is a Turbo class of this mode (an
    injected Turbo bug; a bug of the Fp16/Int8 cache does not apply)."""
    bug = (factories or {}).get("dense")
    cls = DelegatedKVCache if mode == "turbo4delegated" else TurboKVCache
    fits = isinstance(bug, type) and issubclass(bug, cls)
    return make_prompt_cache(model, mode=mode, step=4, classes={"dense": bug} if fits else None, **TURBO_E2E[mode])


def paged_caches(model: Any, block_size: int, factories: Factories = None) -> list[Any]:
    """One block pool per layer (``factories["paged"]``, an injected bug,
    when given), each holding the ``main`` sequence: ``PagedKVCache``."""
    pool_class = (factories or {}).get("paged", BlockPool)
    return [PagedKVCache(pool_class(block_size, chunk=4)) for _ in model.layers]


def prefill(model: Any, caches: list[Any], tokens: mx.array) -> None:
    """Run ``tokens`` through the model in one chunk (a system prompt)."""
    model(tokens[None], cache=caches)
    mx.eval([c.state for c in caches])


def _rotating(caches: list[Any]) -> list[RotatingKVCache]:
    return [c for c in caches if isinstance(c, RotatingKVCache)]
