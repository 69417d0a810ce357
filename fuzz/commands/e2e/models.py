"""Small mlx-lm models with random weights, and the cache lists they decode with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from kvspec.impl.models import make_prompt_cache
from kvspec.impl.paged import BlockPool, PagedKVCache
from kvspec.impl.rotating import RotatingKVCache
from kvspec.impl.turbo import DelegatedKVCache, TurboKVCache

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
    """``kvspec.impl.models.make_prompt_cache``, building each kind's layers from
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


# -- hybrid models: recurrent layers beside attention ---------------------------
#: The hybrid families of the e2e scenarios: mlx-lm 0.32's model modules whose
#: recurrent layers keep an ``ArraysCache`` (conv window, recurrent state).
HYBRID_FAMILIES = ("qwen3_next", "nemotron_h", "lfm2", "recurrent_gemma")


#: recurrent_gemma's local-attention window in the e2e runs: small, so its
#: ring wraps within a stretch
HYBRID_WINDOW = 8


#: each family's weight scale: the streams stay chaotic (no collapse into a
#: cycle) over the seeds of every size; recurrent_gemma 1.75 (at 1 or 2 some seed collapses)
HYBRID_SCALE = {"qwen3_next": 2.0, "nemotron_h": 2.0, "lfm2": 2.0, "recurrent_gemma": 1.75}


def _hybrid_args(family: str) -> tuple[Any, Any]:
    """(model module, ModelArgs) of a tiny ``family``: hidden 64, vocab 256,
    conv kernel 4 (lfm2: 3), attention head dim 16; qwen3_next: layers
    [GatedDeltaNet, attention] x 2; nemotron_h: Mamba2, attention, Mamba2;
    lfm2: short conv, attention, short conv; recurrent_gemma: RG-LRU, RG-LRU,
    local attention over ``HYBRID_WINDOW`` tokens."""
    import importlib

    if family not in HYBRID_FAMILIES:
        raise KeyError(f"no tiny hybrid family {family!r}; known: {list(HYBRID_FAMILIES)}")
    mod = importlib.import_module(f"mlx_lm.models.{family}")
    common = {"model_type": family, "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_attention_heads": 4}
    if family == "qwen3_next":
        args = mod.ModelArgs(
            **common, num_hidden_layers=4, intermediate_size=2 * HIDDEN, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            num_experts=0, num_experts_per_tok=1, decoder_sparse_step=1, shared_expert_intermediate_size=HIDDEN,
            mlp_only_layers=[], moe_intermediate_size=HIDDEN, rms_norm_eps=1e-5, num_key_value_heads=2,
            rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=4096, head_dim=16,
            full_attention_interval=2)
    elif family == "nemotron_h":
        # only mixer blocks ("M", "*"): mlx-lm's speculative loop splits the
        # cache list at len(model.layers), which counts MLP blocks too
        args = mod.ModelArgs(
            **common, intermediate_size=2 * HIDDEN, max_position_embeddings=4096, num_key_value_heads=2,
            attention_bias=False, mamba_num_heads=4, mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
            conv_kernel=4, n_groups=2, mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
            hybrid_override_pattern=["M", "*", "M"], head_dim=16)
    elif family == "lfm2":
        args = mod.ModelArgs(
            **common, num_hidden_layers=3, num_key_value_heads=2, max_position_embeddings=4096, norm_eps=1e-5,
            conv_bias=False, conv_L_cache=3, block_dim=HIDDEN, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
            block_auto_adjust_ff_dim=False, block_ff_dim=2 * HIDDEN, full_attn_idxs=[1])
    else:
        args = mod.ModelArgs(
            **common, attention_bias=False, conv1d_width=4, intermediate_size=2 * HIDDEN, logits_soft_cap=30.0,
            num_hidden_layers=3, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
            attention_window_size=HYBRID_WINDOW, block_types=["recurrent", "recurrent", "attention"])
    return mod, args


def tiny_hybrid(family: str, seed: int, dtype: mx.Dtype = mx.float32) -> Any:
    """A tiny random-weight model of an mlx-lm hybrid ``family`` (one of
    ``HYBRID_FAMILIES``; layers in ``_hybrid_args``), weights from
    ``mx.random.seed(seed)`` scaled by ``HYBRID_SCALE[family]``, float32
    unless ``dtype`` (float32: greedy decoding does not flip on the last-bit
    differences between a block call and one-token calls). Raises KeyError
    for an unknown family."""
    mod, args = _hybrid_args(family)
    mx.random.seed(seed)
    model = mod.Model(args)
    model.update(tree_map(lambda p: p * HYBRID_SCALE[family], model.parameters()))
    if family == "recurrent_gemma":
        _init_rg_lru(model)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _init_rg_lru(model: Any) -> None:
    """recurrent_gemma's recurrent blocks start with zeros (mlx-lm leaves the
    loading to the checkpoint): a zero conv makes the whole RG-LRU branch
    output 0 and its state never change. Draw them: the conv weights and
    biases and the gates' weights and biases normal (std 1/sqrt(fan-in)),
    ``recurrent_param`` uniform in [-4.5, -2] (a per-token decay a of about
    0.6 to 0.96, RG-LRU's range)."""
    for layer in model.layers:
        block = layer.temporal_block
        if layer.temporal_block_type != "recurrent":
            continue
        conv, lru = block.conv_1d, block.rg_lru
        k = conv.weight.shape[1]
        conv.weight = mx.random.normal(conv.weight.shape) / k ** 0.5
        conv.bias = 0.1 * mx.random.normal(conv.bias.shape)
        d = lru.head_dim
        lru.input_gate_weight = mx.random.normal(lru.input_gate_weight.shape) / d ** 0.5
        lru.recurrent_gate_weight = mx.random.normal(lru.recurrent_gate_weight.shape) / d ** 0.5
        lru.input_gate_bias = 0.1 * mx.random.normal(lru.input_gate_bias.shape)
        lru.recurrent_gate_bias = 0.1 * mx.random.normal(lru.recurrent_gate_bias.shape)
        lru.recurrent_param = mx.random.uniform(-4.5, -2.0, lru.recurrent_param.shape)


def hybrid_draft(family: str, seed: int, other: int, mix: float, dtype: mx.Dtype = mx.float32,
                 target: Any = None) -> Any:
    """A draft for ``tiny_hybrid(family, seed)``: the same architecture with
    weights ``(1 - mix) * target + mix * tiny_hybrid(family, other)``, so it
    agrees with the target on some tokens and not on others (mix 0: the
    target's weights; mix 1: a random model of seed ``other``). ``target``:
    that model when the caller built it already (read, never changed: its
    weights are those ``tiny_hybrid(family, seed)`` gives, float32); the draft
    is a model instance of its own either way."""
    if target is None:
        target = tiny_hybrid(family, seed)
    draft = tiny_hybrid(family, other)
    draft.update(tree_map(lambda a, b: (1.0 - mix) * a + mix * b, target.parameters(), draft.parameters()))
    draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    return draft


def twin(model: Any) -> Any:
    """A second instance of a tiny model (``tiny_hybrid``, ``hybrid_draft``)
    holding the same weight arrays (MLX arrays are values: no write reaches
    them): a step recorder installed on one instance (``kvspec.impl.recurrent.
    record_steps``, a recorder bug) never reaches the other. Built without
    drawing or evaluating weights of its own."""
    mod, args = _hybrid_args(model.args.model_type)
    # the module's own construction draws its initial weights lazily: never evaluated, they are replaced here
    out = mod.Model(args)
    out.update(model.parameters())
    return out
