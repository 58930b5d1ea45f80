"""A forward pass in JAX written from MaxText's conventions (as docs/maxtext.md describes them), not from
deepspeed-ext's code: it reads a restored MaxText parameter tree and computes logits.

Conventions used: kernels are (in, out); attention kernels per head (H, N, D) / (N, D, H); the query
kernel of llama-style families already holds 1/sqrt(D) and attention runs with scale 1.0, while Qwen3
normalises q/k per head (query_norm / key_norm) and scales by D**-0.5 at run time; RoPE is rotate-half,
or adjacent pairs with llama3.1 frequency scaling (factor 8, low 1, high 4, original 8192); scanned
leaves carry the layer on axis 1; MoE experts are (E, [L,] ...); tied models take logits from the
embedding, unnormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class ReferenceConfig:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    scan_layers: bool
    rope: str = "rotate_half"  # or "llama3.1"
    qk_norm: bool = False
    tied: bool = False
    num_experts_per_tok: int = 0  # > 0: MoE block
    norm_topk_prob: bool = True


def _rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * scale


def _llama31_inv_freq(inv_freq):
    factor, low, high, original = 8.0, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    middle = (wavelen <= original / low) & (wavelen >= original / high)
    return jnp.where(middle, smoothed, out)


def _rope(x, positions, cfg: ReferenceConfig):
    """x: (T, heads, D)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (cfg.rope_theta**(jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    if cfg.rope == "llama3.1":
        inv_freq = _llama31_inv_freq(inv_freq)
    angles = positions[:, None].astype(jnp.float32) * inv_freq[None, :]  # (T, D/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if cfg.rope == "llama3.1":  # adjacent pairs (x[2i], x[2i+1])
        even, odd = x[..., 0::2], x[..., 1::2]
        return jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(x.shape)
    first, second = x[..., :d // 2], x[..., d // 2:]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _layer(tree: dict[str, Any], layer: int, cfg: ReferenceConfig) -> dict[str, Any]:
    """The per-layer sub-tree, sliced out of the scanned stacks when needed."""
    decoder = tree["decoder"]
    if not cfg.scan_layers:
        return decoder[f"layers_{layer}"]
    return jax.tree_util.tree_map(lambda a: a[:, layer], decoder["layers"])


def forward(params: dict[str, Any], tokens, cfg: ReferenceConfig):
    """Logits (T, V) for one sequence of token ids (T,), in fp32."""
    tree = params["params"]["params"] if "params" in params else params
    embedding = jnp.asarray(tree["token_embedder"]["embedding"], jnp.float32)
    positions = jnp.arange(tokens.shape[0])
    x = embedding[tokens]
    group = cfg.num_heads // cfg.num_kv_heads
    causal = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
    for layer in range(cfg.num_layers):
        p = jax.tree_util.tree_map(lambda a: jnp.asarray(a, jnp.float32), _layer(tree, layer, cfg))
        h = _rms_norm(x, p["pre_self_attention_layer_norm"]["scale"], cfg.eps)
        attn = p["self_attention"]
        q = jnp.einsum("th,hnd->tnd", h, attn["query"]["kernel"])
        k = jnp.einsum("th,hkd->tkd", h, attn["key"]["kernel"])
        v = jnp.einsum("th,hkd->tkd", h, attn["value"]["kernel"])
        if cfg.qk_norm:
            q = _rms_norm(q, attn["query_norm"]["scale"], cfg.eps)
            k = _rms_norm(k, attn["key_norm"]["scale"], cfg.eps)
        q, k = _rope(q, positions, cfg), _rope(k, positions, cfg)
        if cfg.qk_norm:
            q = q * cfg.head_dim**-0.5  # Qwen3: query_pre_attn_scalar at run time
        k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("tnd,snd->nts", q, k)  # scale 1.0: llama-style kernels are pre-scaled
        scores = jnp.where(causal[None], scores, -jnp.inf)
        o = jnp.einsum("nts,snd->tnd", jax.nn.softmax(scores, axis=-1), v)
        x = x + jnp.einsum("tnd,ndh->th", o, attn["out"]["kernel"])
        h = _rms_norm(x, p["post_self_attention_layer_norm"]["scale"], cfg.eps)
        if cfg.num_experts_per_tok:
            moe = p["moe_block"]
            probs = jax.nn.softmax(h @ moe["gate"]["kernel"], axis=-1)  # (T, E)
            top, index = jax.lax.top_k(probs, cfg.num_experts_per_tok)
            if cfg.norm_topk_prob:
                top = top / jnp.sum(top, axis=-1, keepdims=True)
            weights = jnp.zeros_like(probs).at[jnp.arange(probs.shape[0])[:, None], index].set(top)
            gate = jax.nn.silu(jnp.einsum("th,ehi->tei", h, moe["wi_0"]))
            up = jnp.einsum("th,ehi->tei", h, moe["wi_1"])
            experts = jnp.einsum("tei,eih->teh", gate * up, moe["wo"])
            x = x + jnp.einsum("te,teh->th", weights, experts)
        else:
            mlp = p["mlp"]
            x = x + (jax.nn.silu(h @ mlp["wi_0"]["kernel"]) * (h @ mlp["wi_1"]["kernel"])) @ mlp["wo"]["kernel"]
    x = _rms_norm(x, jnp.asarray(tree["decoder"]["decoder_norm"]["scale"], jnp.float32), cfg.eps)
    if cfg.tied:
        return x @ embedding.T
    return x @ jnp.asarray(tree["decoder"]["logits_dense"]["kernel"], jnp.float32)
