"""to-maxtext: tree paths, shapes and dtypes as MaxText expects, restored through Orbax with target shardings
onto a simulated 4-device CPU mesh, and logits of a JAX forward written from MaxText's conventions
(tests/maxtext_reference.py) against the PyTorch model (fp32: per-token KL <= 1e-5, argmax equal).

Tiny models per family are built from configs in code with sharpened q/k and random norms, so that a
wrong RoPE order or a missing query scale moves the KL far above the bar (negative controls below).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.checkpoint.maxtext import ModelDims, partition_spec, plan_leaves, write_maxtext

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from maxtext_reference import ReferenceConfig, forward  # noqa: E402

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


def convert(model, family, out, scan_layers=True, dtype="float32"):
    """HF parameters (deduplicated, as a universal checkpoint holds them) -> MaxText, as to-maxtext does."""
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    family = get_family(family) if isinstance(family, str) else family
    dims = ModelDims.from_config(config)
    shapes = {name: array.shape for name, array in params.items()}
    items = write_maxtext(lambda name, state="fp32": params[name], shapes, family, dims, out,
                          scan_layers=scan_layers, dtype=dtype, progress=False, model_config=config)
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


LLAMA_SCANNED = {
    "token_embedder/embedding": (256, 64),
    "decoder/decoder_norm/scale": (64, ),
    "decoder/logits_dense/kernel": (64, 256),
    "decoder/layers/pre_self_attention_layer_norm/scale": (64, 2),
    "decoder/layers/post_self_attention_layer_norm/scale": (64, 2),
    "decoder/layers/self_attention/query/kernel": (64, 2, 4, 16),
    "decoder/layers/self_attention/key/kernel": (64, 2, 2, 16),
    "decoder/layers/self_attention/value/kernel": (64, 2, 2, 16),
    "decoder/layers/self_attention/out/kernel": (4, 2, 16, 64),
    "decoder/layers/mlp/wi_0/kernel": (64, 2, 128),
    "decoder/layers/mlp/wi_1/kernel": (64, 2, 128),
    "decoder/layers/mlp/wo/kernel": (128, 2, 64),
}


def _stored(items) -> dict[str, tuple[tuple[int, ...], str]]:
    metadata = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    flat = ocp.tree.to_flat_dict(metadata["params"]["params"], sep="/")
    return {name: (tuple(m.shape), str(np.dtype(m.dtype))) for name, m in flat.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llama_tree_paths_shapes_and_dtypes_are_maxtexts(tmp_path, dtype):
    items, _ = convert(hf_model("llama"), "llama", tmp_path / "out", dtype=dtype)
    assert items == tmp_path / "out" / "0" / "items"
    assert _stored(items) == {name: (shape, dtype) for name, shape in LLAMA_SCANNED.items()}
    custom = ocp.StandardCheckpointer().metadata(tmp_path / "out" / "0").custom_metadata
    assert custom["scan_layers"] is True and custom["deepspeed_ext"]["family"] == "llama"


def test_llama_unscanned_tree(tmp_path):
    items, _ = convert(hf_model("llama"), "llama", tmp_path / "out", scan_layers=False)
    stored = _stored(items)
    expected = {}
    for name, shape in LLAMA_SCANNED.items():
        if "/layers/" in name:
            for layer in range(2):
                expected[name.replace("/layers/", f"/layers_{layer}/")] = (shape[0], *shape[2:])
        else:
            expected[name] = shape
    assert stored == {name: (shape, "float32") for name, shape in expected.items()}
    assert ocp.StandardCheckpointer().metadata(tmp_path / "out" / "0").custom_metadata["scan_layers"] is False


@pytest.mark.parametrize("family, scan_layers", [("llama", True), ("llama", False), ("llama3.1", True),
                                                 ("mistral", True), ("qwen3", True), ("qwen3", False),
                                                 ("qwen3-moe", True)])
def test_jax_forward_on_a_4_device_mesh_matches_pytorch(tmp_path, family, scan_layers):
    model = hf_model(family)
    items, leaves = convert(model, family, tmp_path / "out", scan_layers=scan_layers)
    restored = restore_on_mesh(items, leaves)
    sharded = 0
    for leaf in leaves:
        node = restored["params"]["params"]
        for key in leaf.path:
            node = node[key]
        assert node.shape == leaf.shape and node.dtype == np.float32
        assert node.sharding.spec == PartitionSpec(*partition_spec(leaf, MESH_SHAPE))
        sharded += any(axis is not None for axis in node.sharding.spec)
    assert sharded >= len(leaves) // 2, "the mesh should split most arrays"
    logits = forward(restored, np.array(TOKENS), reference_config(model, family, scan_layers))
    reference = torch_logits(model)
    assert max_kl(reference, logits) <= 1e-5
    assert np.array_equal(np.asarray(logits).argmax(-1), reference.argmax(-1).numpy())


@pytest.mark.parametrize("mistake", ["no_query_scale", "no_rope_interleave"])
def test_negative_controls_fail_the_kl_bar(tmp_path, mistake):
    """The check above can fail: converting with a convention left out moves the KL far above 1e-5."""
    family_name = "llama3.1" if mistake == "no_rope_interleave" else "llama"
    family = get_family(family_name)
    wrong = dataclasses.replace(family, **({"query_scaled": False} if mistake == "no_query_scale" else
                                           {"rope_interleaved": False}))
    model = hf_model(family_name)
    items, leaves = convert(model, wrong, tmp_path / "out")
    logits = forward(restore_on_mesh(items, leaves), np.array(TOKENS), reference_config(model, family_name, True))
    assert max_kl(torch_logits(model), logits) > 1e-3


@pytest.mark.e2e
def test_deepspeed_checkpoint_to_maxtext_directly_and_via_universal(scenarios, tmp_path):
    """A TP=2 ZeRO-1 DeepSpeed checkpoint converts on the fly (no universal copy) to the same arrays as its
    universal form, and the JAX forward on them matches the PyTorch model holding the trained fp32 weights."""
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    from deepspeed_ext.demo.models import build_model
    from deepspeed_ext.demo.runner import cli

    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    outputs = {}
    for kind, source in (("deepspeed", tp2.save_dir), ("universal", tp2.universal_dir)):
        out = tmp_path / kind
        cli(["to-maxtext", str(source), "-o", str(out), "--dtype", "float32", "--quiet"], tmp_path / f"{kind}.log")
        outputs[kind] = out / "0" / "items"

    model = build_model("llama")
    universal = UniversalCheckpoint(tp2.universal_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(universal.load(name))
    config = json.loads(model.config.to_json_string(use_diff=False))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    leaves = plan_leaves(get_family("llama"), ModelDims.from_config(config), shapes, True)
    restored = {kind: restore_on_mesh(items, leaves) for kind, items in outputs.items()}
    flat = {kind: ocp.tree.to_flat_dict(tree, sep="/") for kind, tree in restored.items()}
    assert flat["deepspeed"].keys() == flat["universal"].keys()
    for name, array in flat["deepspeed"].items():
        assert np.array_equal(np.asarray(array), np.asarray(flat["universal"][name])), name
    logits = forward(restored["deepspeed"], np.array(TOKENS) % 101, reference_config(model, "llama", True))
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([TOKENS]) % 101).logits[0]
    assert max_kl(reference, logits) <= 1e-5


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


@pytest.mark.parametrize("family, scan_layers", [("llama", True), ("llama3.1", False), ("mistral", True),
                                                 ("qwen3", True), ("qwen3-moe", True), ("qwen3-moe", False)])
def test_round_trip_is_exact_but_the_scaled_query(tmp_path, family, scan_layers):
    """HF/universal tensors -> MaxText (fp32) -> back: bit-exact, except the query kernel of families that
    bake in 1/sqrt(D), within 1 ulp (head_dim 8 here: sqrt(8) is not a power of two)."""
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint, stored_model_info
    model = hf_model(family, head_dim=8)
    items, _ = convert(model, family, tmp_path / "out", scan_layers=scan_layers)
    stored = stored_model_info(items)
    assert stored["family"] == family and stored["model_config"]["head_dim"] == 8
    source = MaxTextCheckpoint(items, get_family(family), stored["model_config"])
    original = {name: p.detach().numpy() for name, p in model.named_parameters()}
    assert list(source.layouts) and sorted(source.layouts) == sorted(original)
    inexact = []
    for name, expected in original.items():
        got = source.hf_tensor(name)
        assert got.shape == expected.shape and got.dtype == np.float32, name
        if not np.array_equal(got, expected):
            inexact.append(name)
            assert name.endswith("q_proj.weight") and get_family(family).query_scaled, name
            assert _ulps(got, expected) <= 1, name
    if get_family(family).query_scaled:
        assert inexact, "the query kernel should have met a rounding (else this test proves less than it says)"


@pytest.mark.e2e
def test_deepspeed_to_maxtext_and_back_resumes_at_tp1(scenarios, tmp_path):
    """DeepSpeed TP=2 training -> to-maxtext --with-optimizer -> from-maxtext -> DeepSpeed resume at TP=1:
    weights, Adam moments and step counts make the trip (fp32 storage), so the loss continues."""
    from deepspeed_ext.demo.runner import cli
    from e2e import assert_losses_continue
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    cli(["to-maxtext", str(tp2.save_dir), "-o", str(tmp_path / "maxtext"), "--dtype", "float32", "--with-optimizer",
         "--quiet"], tmp_path / "to.log")
    back = tmp_path / "universal"
    cli(["from-maxtext", str(tmp_path / "maxtext" / "0" / "items"), "-o", str(back), "--quiet"], tmp_path / "from.log")
    # universal -> MaxText -> universal, file by file: exact (head_dim 4: the query scale 1/2 is exact too).
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    original, returned = UniversalCheckpoint(tp2.universal_dir), UniversalCheckpoint(back)
    assert sorted(original.names) == sorted(returned.names)
    for name in original.names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            assert torch.equal(original.load(name, state), returned.load(name, state)), (name, state)
        assert int(original.step(name)) == int(returned.step(name))
    assert_losses_continue(tp2, tp2.resume(1, load_dir=back))


def test_orbax_internals_we_rely_on_are_still_there():
    """Fails loudly on an Orbax upgrade that moves the internals behind shard-aligned writes."""
    from deepspeed_ext.checkpoint.orbax_private import TESTED_ORBAX, check_orbax_internals
    check_orbax_internals()
    assert ocp.__version__ == TESTED_ORBAX, "new Orbax: re-check orbax_private.py, then update TESTED_ORBAX"


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_mesh_aligned_chunks_are_one_device_shard(tmp_path, family):
    """--mesh: every array's storage chunk is one device's shard on that mesh (one layer thick for scanned
    stacks, which are written a layer at a time), and the arrays are the same as without --mesh."""
    from deepspeed_ext.checkpoint.maxtext import shard_shape, storage_chunk
    model = hf_model(family)
    plain, leaves = convert(model, family, tmp_path / "plain")
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    mesh = {"fsdp": 2, "tensor": 2, "expert": 2} if family == "qwen3-moe" else MESH_SHAPE
    aligned = write_maxtext(lambda name, state="fp32": params[name], {n: a.shape for n, a in params.items()},
                            get_family(family), ModelDims.from_config(config), tmp_path / "aligned", dtype="float32",
                            progress=False, mesh=mesh)
    import tensorstore as ts
    split = 0
    for leaf in leaves:
        # Orbax records no storage metadata for numpy leaves: ask the zarr3 array in the OCDBT store itself.
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{aligned}"},
                         "path": "params.params." + ".".join(leaf.path)}).result()
        expected = storage_chunk(leaf, mesh)
        assert all(c <= s for c, s in zip(expected, shard_shape(leaf, mesh), strict=True))
        layout = array.chunk_layout
        assert tuple(array.shape) == leaf.shape
        assert tuple(layout.write_chunk.shape) == expected and tuple(layout.read_chunk.shape) == expected, leaf.name
        split += expected != leaf.shape
    assert split >= len(leaves) // 2
    a, b = (ocp.tree.to_flat_dict(restore_on_mesh(items, leaves), sep="/") for items in (plain, aligned))
    for name in a:
        assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name


def _torch_adam_state(model, steps: int = 2, lr: float = 1e-2):
    """Train a couple of steps with torch Adam (as DeepSpeed's Adam runs, no weight decay); return the
    optimizer so its exp_avg / exp_avg_sq / step can be converted."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    for step in range(steps):
        tokens = torch.tensor([[(t * (step + 2)) % 256 for t in TOKENS]])
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("family", ["llama3.1", "qwen3-moe"])
def test_with_optimizer_momentum_continues_on_the_jax_side(tmp_path, family):
    """--with-optimizer: Adam moments go into optax adamw's state (MaxText's default optimizer), so one
    optax Adam step in JAX from the converted state equals one more torch Adam step, mapped to MaxText's
    layout. The query kernel is the exception by construction: MaxText trains it pre-scaled by 1/sqrt(D),
    so Adam's update differs there; what must hold is that its gradient and moments scale consistently
    (x sqrt(D) for the gradient and first moment, x D for the second)."""
    import optax
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint, to_maxtext
    optax_state = optax.ScaleByAdamState
    model = hf_model(family, head_dim=8)
    optimizer = _torch_adam_state(model)
    params = dict(model.named_parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))
    fam, dims = get_family(family), ModelDims.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in params.items()}

    def load(name, state="fp32"):
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    step = int(optimizer.state[params["model.norm.weight"]]["step"])
    items = write_maxtext(load, shapes, fam, dims, tmp_path / "out", dtype="float32", progress=False,
                          model_config=config, with_optimizer=True, optimizer_step=step)
    leaves = plan_leaves(fam, dims, shapes, True)

    # Read back: the universal-side view of the moments is the original (query within 1 ulp).
    source = MaxTextCheckpoint(items, fam, config)
    assert source.has_optimizer and source.optimizer_step == step
    for name in params:
        for state in ("exp_avg", "exp_avg_sq"):
            got, want = source.hf_tensor(name, state), load(name, state)
            assert _ulps(got, want) <= (1 if fam.query_scaled and "q_proj" in name else 0), (name, state)

    # One more step on each side from the same state.
    restored = ocp.PyTreeCheckpointer().restore(items)
    mt_params = jax.tree_util.tree_map(lambda a: jax.numpy.asarray(a, jax.numpy.float32), restored["params"])
    adam = restored["opt_state"][0]
    assert int(adam["count"]) == step and int(restored["opt_state"][2]["count"]) == step
    tx = optax.adam(1e-2, b1=0.9, b2=0.999, eps=1e-8)
    state = (optax_state(count=jax.numpy.asarray(adam["count"], jax.numpy.int32), mu=adam["mu"], nu=adam["nu"]),
             optax.EmptyState())
    tokens = np.array([(t * 5) % 256 for t in TOKENS])
    cfg = reference_config(model, family, True)

    def loss_fn(p):
        logits = forward({"params": p}, tokens, cfg)
        return -jax.numpy.mean(jax.nn.log_softmax(logits[:-1])[np.arange(len(tokens) - 1), tokens[1:]])

    grads = jax.grad(loss_fn)(mt_params)
    updates, _ = tx.update(grads, state, mt_params)
    jax_new = ocp.tree.to_flat_dict(optax.apply_updates(mt_params, updates)["params"], sep="/")
    jax_grads = ocp.tree.to_flat_dict(grads["params"], sep="/")

    optimizer.zero_grad()
    model(input_ids=torch.tensor([tokens]), labels=torch.tensor([tokens])).loss.backward()
    torch_grads = {name: p.grad.detach().numpy().copy() for name, p in params.items()}
    optimizer.step()
    for leaf in leaves:
        if leaf.stacked:
            per_layer = [leaf.rule.hf.replace("{layer}", str(layer)) for layer in leaf.layers]
        else:
            per_layer = [leaf.rule.hf]
        if leaf.rule.kind == "query":
            expected = np.stack([to_maxtext("query", torch_grads[n], dims, fam, "exp_avg") for n in per_layer], 1)
            np.testing.assert_allclose(np.asarray(jax_grads[leaf.name]), expected, rtol=2e-4, atol=1e-7)
            continue
        expected = [to_maxtext(leaf.rule.kind, params[n].detach().numpy(), dims, fam) for n in per_layer]
        expected = np.stack(expected, 1) if leaf.stacked else expected[0]
        np.testing.assert_allclose(np.asarray(jax_new[leaf.name]), expected, rtol=1e-5, atol=1e-6,
                                   err_msg=leaf.name)


def test_reshard_orbax_rechunks_array_by_array_and_keeps_everything_else(tmp_path):
    """reshard-orbax: a checkpoint written whole (no --mesh, with Adam state) re-chunked for fsdp=2 x
    tensor=2: same arrays, scalars and custom metadata; every param and moment chunk is one device's shard."""
    import tensorstore as ts
    from deepspeed_ext.checkpoint.maxtext import shard_shape
    from deepspeed_ext.demo.runner import cli
    model = hf_model("llama3.1", head_dim=8)
    optimizer = _torch_adam_state(model, steps=1)
    params = dict(model.named_parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))
    fam, dims = get_family("llama3.1"), ModelDims.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in params.items()}

    def load(name, state="fp32"):
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    source = write_maxtext(load, shapes, fam, dims, tmp_path / "whole", dtype="bfloat16", progress=False,
                           model_config=config, step=7, with_optimizer=True, optimizer_step=1)
    out = tmp_path / "resharded"
    proc = cli(["reshard-orbax", str(source), "-o", str(out), "--mesh", "fsdp=2,tensor=2", "--quiet"],
               tmp_path / "reshard.log")
    assert proc.stderr.count("kept whole") == 0
    resharded = out / "0" / "items"
    before, after = (ocp.PyTreeCheckpointer().restore(items) for items in (source, resharded))
    flat_before, flat_after = (ocp.tree.to_flat_dict(t, sep="/") for t in (before, after))
    assert flat_before.keys() == flat_after.keys()
    for name, value in flat_before.items():
        assert np.asarray(value).dtype == np.asarray(flat_after[name]).dtype, name
        assert np.array_equal(np.asarray(value), np.asarray(flat_after[name])), name
    assert int(after["step"]) == 7 and int(after["opt_state"][0]["count"]) == 1
    custom = (ocp.StandardCheckpointer().metadata(p.parent).custom_metadata for p in (source, resharded))
    assert next(custom) == next(custom)
    for leaf in plan_leaves(fam, dims, shapes, True):
        for root in ("params.params.", "opt_state.0.mu.params.", "opt_state.0.nu.params."):
            array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{resharded}"},
                             "path": root + ".".join(leaf.path)}).result()
            assert tuple(array.chunk_layout.write_chunk.shape) == shard_shape(leaf, MESH_SHAPE), (root, leaf.name)
