"""Helpers shared by tests/unit/test_maxtext.py and tests/e2e/test_maxtext_e2e.py: tiny HF models per family,
conversion as to-maxtext does it, restoring through Orbax onto a simulated 4-device CPU mesh, and the KL bar."""

from __future__ import annotations

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.checkpoint.maxtext import ModelDims, partition_spec, plan_leaves, write_maxtext
from deepspeed_ext.checkpoint.tensor import persistent_buffers
from harness.maxtext_reference import ReferenceConfig

MESH_SHAPE = {"fsdp": 2, "tensor": 2}
TOKENS = [3, 17, 250, 42, 42, 7, 99, 128, 5, 61, 200, 13]

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def hf_model(family: str, head_dim: int = 16) -> torch.nn.Module:
    import transformers
    COMMON = {**globals()["COMMON"], "head_dim": head_dim, "num_attention_heads": 64 // head_dim,
              "num_key_value_heads": 32 // head_dim}
    if family in ("llama", "llama3.1"):
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if family == "llama3.1":  # the constants MaxText's llama3.1 RoPE uses
            rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        config = transformers.LlamaConfig(**{**COMMON, "max_position_embeddings": 16384}, rope_parameters=rope,
                                          rms_norm_eps=1e-5)
    elif family == "mistral":
        config = transformers.MistralConfig(**COMMON, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None)
    elif family == "qwen3":
        config = transformers.Qwen3Config(**COMMON, tie_word_embeddings=True, rms_norm_eps=1e-6)
    elif family == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             decoder_sparse_step=1, norm_topk_prob=True, rms_norm_eps=1e-6)
    elif family == "qwen2":  # no head_dim in Qwen2's config: hidden / heads
        config = transformers.Qwen2Config(**{k: v for k, v in COMMON.items() if k != "head_dim"},
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6)
    elif family == "mixtral":
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5)
    elif family == "gemma3":  # 7 layers: five local, one global, and one past the cycle (MaxText's remainder)
        config = transformers.Gemma3TextConfig(**{**COMMON, "num_hidden_layers": 7}, query_pre_attn_scalar=head_dim,
                                               sliding_window=8)
    elif family == "gpt-oss":  # sliding window 8 < the 12 tokens, so the local layers differ from the global ones
        config = transformers.GptOssConfig(**{**COMMON, "max_position_embeddings": 131072}, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=8)
    elif family.startswith("deepseek-v3"):  # one dense layer, two MoE layers; 8 experts in 2 groups, top-1 group
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if family == "deepseek-v3-yarn":  # DeepSeek-V3's own RoPE: yarn, 40x context, attention rescaled
            rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
        config = transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            first_k_dense_replace=1, num_attention_heads=64 // head_dim, num_key_value_heads=64 // head_dim,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
            max_position_embeddings=163840 if family == "deepseek-v3-yarn" else 64, rms_norm_eps=1e-6,
            rope_parameters=rope)
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(6.0)  # peaky attention: RoPE / scaling mistakes become visible
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("bias", "sinks")):  # transformers initializes these to zero: make them count
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: steers the expert choice
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
    return model


def reference_config(model: torch.nn.Module, family: str, scan_layers: bool) -> ReferenceConfig:
    c = model.config
    rope_theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
    return ReferenceConfig(num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=float(rope_theta),
                           eps=c.rms_norm_eps, scan_layers=scan_layers,
                           rope="llama3.1" if family == "llama3.1" else "rotate_half",
                           qk_norm=family.startswith("qwen3"), tied=bool(c.tie_word_embeddings),
                           num_experts_per_tok=getattr(c, "num_experts_per_tok", 0) if family == "qwen3-moe" else 0)


def convert(model, family, out, scan_layers=True, dtype="float32", mesh=None):
    """HF parameters (deduplicated, as a universal checkpoint holds them) and persistent buffers -> MaxText, as
    to-maxtext does."""
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    params.update((name, b.detach().float().numpy()) for name, b in persistent_buffers(model).items())
    config = json.loads(model.config.to_json_string(use_diff=False))
    family = get_family(base_family(family)) if isinstance(family, str) else family
    dims = ModelDims.from_config(config)
    shapes = {name: array.shape for name, array in params.items()}
    items = write_maxtext(lambda name, state="fp32": params[name], shapes, family, dims, out,
                          scan_layers=scan_layers, dtype=dtype, progress=False, model_config=config, mesh=mesh)
    return items, plan_leaves(family, dims, shapes, scan_layers)


def restore_on_mesh(items, leaves):
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    abstract: dict = {}
    for leaf in leaves:
        node = abstract
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        sharding = NamedSharding(mesh, PartitionSpec(*partition_spec(leaf, MESH_SHAPE)))
        node[leaf.path[-1]] = jax.ShapeDtypeStruct(leaf.shape, np.float32, sharding=sharding)
    abstract = {"params": {"params": abstract}}
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    return checkpointer.restore(items, args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract), partial_restore=True))


def max_kl(reference_logits: torch.Tensor, logits) -> float:
    p = torch.log_softmax(reference_logits.double(), -1)
    q = torch.log_softmax(torch.from_numpy(np.asarray(logits, dtype=np.float64)), -1)
    return float((p.exp() * (p - q)).sum(-1).max())


def torch_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([TOKENS])).logits[0]


def torch_adam_state(model, steps: int = 2, lr: float = 1e-2):
    """Train a couple of steps with torch Adam (as DeepSpeed's Adam runs, no weight decay); return the
    optimizer so its exp_avg / exp_avg_sq / step can be converted."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for step in range(steps):
        tokens = torch.tensor([[(t * (step + 2)) % 256 for t in TOKENS]])
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    return optimizer


def maxtext_settings(model, family: str, scan_layers: bool) -> list[str]:
    """The MaxText config (KEY=VALUE, for tests/harness/workers/maxtext_forward.py) of the tiny HF ``model``:
    what deepspeed-ext tells users to load the checkpoint with."""
    from deepspeed_ext.checkpoint.maxtext import maxtext_settings as settings_for, settings_text
    config = json.loads(model.config.to_json_string(use_diff=False))
    return settings_text(settings_for(get_family(base_family(family)), config, scan_layers)).split(" ")


def base_family(name: str) -> str:
    """The family of a test model variant (``deepseek-v3-yarn`` is a deepseek-v3 with yarn RoPE)."""
    return name.removesuffix("-yarn")


def maxtext_logits(items, model, family: str, scan_layers: bool, workdir, sharded: bool = False,
                   tokens=None) -> np.ndarray:
    """MaxText's own forward (its model code and its checkpoint loader, in .venv-maxtext) on TOKENS.

    ``sharded``: restored onto MaxText's own sharding of a 4-device CPU mesh (fsdp=2 x tensor=2); most arrays
    must come out split."""
    import subprocess
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    python = repo / ".venv-maxtext" / "bin" / "python"
    tokens_file, logits = Path(workdir) / "tokens.npy", Path(workdir) / "maxtext_logits.npy"
    np.save(tokens_file, np.array([TOKENS if tokens is None else list(tokens)], dtype=np.int32))
    cmd = [str(python), str(Path(__file__).parent / "workers" / "maxtext_forward.py"), "--items", str(items),
           "--tokens", str(tokens_file), "--logits", str(logits), "--output-dir", str(Path(workdir) / "maxtext_out")]
    for setting in maxtext_settings(model, family, scan_layers):
        cmd += ["--setting", setting]
    if sharded:
        cmd.append("--sharded")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={"PATH": "/usr/bin:/bin",
                                                                                "JAX_PLATFORMS": "cpu"})
    if proc.returncode != 0:
        raise RuntimeError(f"MaxText's forward failed:\n{proc.stderr[-4000:]}")
    if sharded:
        split, arrays = (int(n) for n in proc.stdout.split("MAXTEXT_SPLIT_ARRAYS ")[1].split()[:2])
        assert split >= arrays // 2, f"MaxText split only {split} of {arrays} arrays over the mesh"
    return np.load(logits)[0]
