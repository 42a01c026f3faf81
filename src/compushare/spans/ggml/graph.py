"""One decoder layer as a ggml graph, op for op as llama.cpp builds it.

Read against llama.cpp's src/llama-graph.cpp (build_norm, build_qkv, build_attn_mha
with flash attention, build_ffn, build_moe_ffn) and src/models/{llama,qwen2,qwen3,
gemma2,gemma3,phi3,qwen3moe,openai-moe}.cpp. The order matters to the last bit: the same ops in the same order on the
same types is what makes a span's answer equal llama.cpp's.
"""

from __future__ import annotations

import dataclasses

from .lib import ggml
from .recipe import SOFTMAX_WEIGHT, Recipe
from .weights import Weights


@dataclasses.dataclass
class Inputs:
    positions: object  # I32 [tokens]
    slots: object  # I64 [tokens]: the KV cache rows the new keys and values go to
    masks: dict  # window (None: full) -> F16 [n_kv, tokens]
    n_kv: int  # cache rows attention reads
    tokens: int
    # Each MoE layer's chosen experts (I32 [used, tokens]), kept as outputs: what the
    # span reads of its experts is counted from them (GgmlSpan.reads).
    routes: list = dataclasses.field(default_factory=list)


def rms(ctx, x, weight, eps: float):
    return ggml.ggml_mul(ctx, ggml.ggml_rms_norm(ctx, x, eps), weight)


def product(ctx, weights: Weights, name: str, x):
    """W x (+ bias), and with an adapter's factors for `name` (adapter.AdaptedWeights)
    + s · B (A x) after them, as PEFT adds its update to the layer's output."""
    out = ggml.ggml_mul_mat(ctx, weights[name + ".weight"], x)
    bias = weights.get(name + ".bias")
    out = ggml.ggml_add(ctx, out, bias) if bias is not None else out
    factors = weights.lora(name)
    if factors is None:
        return out
    a, b, scale = factors
    update = ggml.ggml_mul_mat(ctx, b, ggml.ggml_mul_mat(ctx, a, x))
    return ggml.ggml_add(ctx, out, ggml.ggml_scale(ctx, update, scale))


def _qkv(ctx, w: Weights, p: str, h, r: Recipe, tokens: int):
    if r.fused:  # Phi-3: one product, q/k/v views of its rows
        qkv = product(ctx, w, p + "self_attn.qkv_proj", h)
        row, q_rows = qkv.contents.nb[1], r.heads * r.head_dim
        size = ggml.ggml_row_size(qkv.contents.type, r.head_dim)

        def view(heads: int, offset: int):
            return ggml.ggml_view_3d(ctx, qkv, r.head_dim, heads, tokens, size, row,
                                     ggml.ggml_row_size(qkv.contents.type, offset))
        # llama.cpp then makes each contiguous (rope and the cache writes want it).
        return (ggml.ggml_cont_3d(ctx, view(r.heads, 0), r.head_dim, r.heads, tokens),
                ggml.ggml_cont_3d(ctx, view(r.kv_heads, q_rows), r.head_dim, r.kv_heads, tokens),
                ggml.ggml_cont_3d(ctx, view(r.kv_heads, q_rows + r.kv_dim), r.head_dim, r.kv_heads, tokens))
    q = ggml.ggml_reshape_3d(ctx, product(ctx, w, p + "self_attn.q_proj", h), r.head_dim, r.heads, tokens)
    k = ggml.ggml_reshape_3d(ctx, product(ctx, w, p + "self_attn.k_proj", h), r.head_dim, r.kv_heads, tokens)
    v = ggml.ggml_reshape_3d(ctx, product(ctx, w, p + "self_attn.v_proj", h), r.head_dim, r.kv_heads, tokens)
    return q, k, v


def _rope(ctx, x, inputs: Inputs, r: Recipe, index: int, factors):
    rope = r.ropes[index]
    if rope.yarn is not None:
        y = rope.yarn
        return ggml.ggml_rope_ext(ctx, x, inputs.positions, factors, r.head_dim, r.rope_mode, y.original_context,
                                  rope.base, rope.scale, y.ext_factor, y.attn_factor, y.beta_fast, y.beta_slow)
    return ggml.ggml_rope_ext(ctx, x, inputs.positions, factors, r.head_dim, r.rope_mode, 0, rope.base, rope.scale,
                              0.0, 1.0, 32.0, 1.0)


def attention(ctx, graph, w: Weights, p: str, h, r: Recipe, index: int, k_cache, v_cache, inputs: Inputs):
    """The attention block's output (before any post-norm or residual)."""
    tokens = inputs.tokens
    q, k, v = _qkv(ctx, w, p, h, r, tokens)
    if r.qk_norm:
        q = rms(ctx, q, w[p + "self_attn.q_norm.weight"], r.eps)
    factors = w.get("rope_freqs.weight")
    q = _rope(ctx, q, inputs, r, index, factors)
    if r.qk_norm:
        k = rms(ctx, k, w[p + "self_attn.k_norm.weight"], r.eps)
    k = _rope(ctx, k, inputs, r, index, factors)
    if r.q_scale is not None:
        q = ggml.ggml_scale(ctx, q, r.q_scale)
    # The new keys and values into the cache, by slot; then attention reads the cache.
    ggml.ggml_build_forward_expand(graph, ggml.ggml_set_rows(
        ctx, k_cache, ggml.ggml_reshape_2d(ctx, k, r.kv_dim, tokens), inputs.slots))
    ggml.ggml_build_forward_expand(graph, ggml.ggml_set_rows(
        ctx, v_cache, ggml.ggml_reshape_2d(ctx, v, r.kv_dim, tokens), inputs.slots))
    row = ggml.ggml_row_size(ggml.GGML_TYPE_F16, r.head_dim)
    keys = ggml.ggml_view_3d(ctx, k_cache, r.head_dim, r.kv_heads, inputs.n_kv, row, row * r.kv_heads, 0)
    values = ggml.ggml_view_3d(ctx, v_cache, r.head_dim, r.kv_heads, inputs.n_kv, row, row * r.kv_heads, 0)
    out = ggml.ggml_flash_attn_ext(ctx, ggml.ggml_permute(ctx, q, 0, 2, 1, 3), ggml.ggml_permute(ctx, keys, 0, 2, 1, 3),
                                   ggml.ggml_permute(ctx, values, 0, 2, 1, 3), inputs.masks[r.window_for(index)],
                                   r.attention_scale, 0.0, r.softcap)
    if r.sinks:
        ggml.ggml_flash_attn_ext_add_sinks(out, w[p + "self_attn.sinks"])
    ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
    out = ggml.ggml_reshape_2d(ctx, out, r.head_dim * r.heads, tokens)
    return product(ctx, w, p + "self_attn.o_proj", out)


def mlp(ctx, w: Weights, p: str, h, r: Recipe):
    if r.fused:  # Phi-3: gate and up one product, SwiGLU over its halves
        return product(ctx, w, p + "mlp.down_proj", ggml.ggml_swiglu(ctx, product(ctx, w, p + "mlp.gate_up_proj", h)))
    up = product(ctx, w, p + "mlp.up_proj", h)
    gate = product(ctx, w, p + "mlp.gate_proj", h)
    gated = ggml.ggml_geglu_split(ctx, gate, up) if r.gelu else ggml.ggml_swiglu_split(ctx, gate, up)
    return product(ctx, w, p + "mlp.down_proj", gated)


def _biased_id(ctx, w: Weights, name: str, x, selected):
    bias = w.get(name)
    return ggml.ggml_add_id(ctx, x, bias, selected) if bias is not None else x


def moe(ctx, graph, w: Weights, p: str, h, r: Recipe, tokens: int, routes: list):
    """A mixture of experts' MLP, as build_moe_ffn builds it: router logits, the top
    `used` experts per token, their weights, each chosen expert's SwiGLU by mul_mat_id
    (which reads only the experts some token chose), weighted, then summed in order."""
    e = r.experts
    router = "mlp.router" if r.sinks else "mlp.gate"
    logits = product(ctx, w, p + router, h)  # [count, tokens]
    probs = logits if e.gating == SOFTMAX_WEIGHT else ggml.ggml_soft_max(ctx, logits)
    selected = ggml.ggml_argsort_top_k(ctx, probs, e.used)  # [used, tokens]
    ggml.ggml_set_output(selected)
    routes.append((p, selected))
    weights = ggml.ggml_get_rows(ctx, ggml.ggml_reshape_3d(ctx, probs, 1, e.count, tokens), selected)
    if e.gating == SOFTMAX_WEIGHT:
        weights = ggml.ggml_reshape_3d(ctx, ggml.ggml_soft_max(ctx, ggml.ggml_reshape_2d(ctx, weights, e.used, tokens)),
                                       1, e.used, tokens)
    if e.normalise:
        flat = ggml.ggml_reshape_2d(ctx, weights, e.used, tokens)
        total = ggml.ggml_clamp(ctx, ggml.ggml_sum_rows(ctx, flat), 6.103515625e-5, float("inf"))
        weights = ggml.ggml_reshape_3d(ctx, ggml.ggml_div(ctx, flat, total), 1, e.used, tokens)
    ggml.ggml_build_forward_expand(graph, weights)
    x = ggml.ggml_reshape_3d(ctx, h, r.hidden, 1, tokens)
    experts = p + "mlp.experts."
    up = _biased_id(ctx, w, experts + "up_proj_bias",
                    ggml.ggml_mul_mat_id(ctx, w[experts + "up_proj"], x, selected), selected)
    gate = _biased_id(ctx, w, experts + "gate_proj_bias",
                      ggml.ggml_mul_mat_id(ctx, w[experts + "gate_proj"], x, selected), selected)
    if e.swiglu_oai:
        gated = ggml.ggml_swiglu_oai(ctx, gate, up, e.alpha, e.limit)
    else:
        gated = ggml.ggml_swiglu_split(ctx, gate, up)
    out = _biased_id(ctx, w, experts + "down_proj_bias",
                     ggml.ggml_mul_mat_id(ctx, w[experts + "down_proj"], gated, selected), selected)
    out = ggml.ggml_mul(ctx, out, weights)  # [hidden, used, tokens]
    ggml.ggml_build_forward_expand(graph, out)
    views = [ggml.ggml_view_2d(ctx, out, r.hidden, tokens, out.contents.nb[2], i * out.contents.nb[1])
             for i in range(e.used)]
    for view in views:
        ggml.ggml_build_forward_expand(graph, view)
    total = views[0]
    for view in views[1:]:
        total = ggml.ggml_add(ctx, total, view)
        ggml.ggml_build_forward_expand(graph, total)
    return ggml.ggml_cont(ctx, total) if e.used == 1 else total


def layer(ctx, graph, w: Weights, r: Recipe, index: int, x, k_cache, v_cache, inputs: Inputs):
    p = f"model.layers.{index}."
    h = rms(ctx, x, w[p + "input_layernorm.weight"], r.eps)
    attended = attention(ctx, graph, w, p, h, r, index, k_cache, v_cache, inputs)
    if r.sandwich:  # Gemma: post_attention_layernorm is the attention output's norm
        attended = rms(ctx, attended, w[p + "post_attention_layernorm.weight"], r.eps)
        x = ggml.ggml_add(ctx, attended, x)
        h = rms(ctx, x, w[p + "pre_feedforward_layernorm.weight"], r.eps)
        out = rms(ctx, mlp(ctx, w, p, h, r), w[p + "post_feedforward_layernorm.weight"], r.eps)
        return ggml.ggml_add(ctx, out, x)
    x = ggml.ggml_add(ctx, attended, x)
    h = rms(ctx, x, w[p + "post_attention_layernorm.weight"], r.eps)
    out = moe(ctx, graph, w, p, h, r, inputs.tokens, inputs.routes) if r.experts else mlp(ctx, w, p, h, r)
    return ggml.ggml_add(ctx, out, x)
