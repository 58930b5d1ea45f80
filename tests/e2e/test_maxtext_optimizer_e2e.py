"""--with-optimizer on the JAX side: one optax Adam step from to-maxtext's state equals one more torch Adam step.

A JAX computation (a jit of MaxText's forward and its gradient per family, 20-30 s each on a 2-core machine): moved
out of the fast tier (tests/unit/test_maxtext.py holds the conversions themselves), run by the whole suite.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.checkpoint.maxtext import ModelDims, plan_leaves, write_maxtext
from harness.environments import require

jax = require("jax", "the [maxtext] extra")
ocp = require("orbax.checkpoint", "the [maxtext] extra")
from harness.maxtext import TOKENS, hf_model, reference_config, torch_adam_state  # noqa: E402
from harness.maxtext_reference import forward  # noqa: E402


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


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
    optimizer = torch_adam_state(model)
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
        # Adam divides by sqrt(v): where a gradient is tiny, the fp32 difference between the two forwards (CPU
        # kernel dependent) shows as up to ~1e-4 of the step; a moment in the wrong place moves it by the step.
        np.testing.assert_allclose(np.asarray(jax_new[leaf.name]), expected, rtol=1e-5, atol=1e-3 * 1e-2,
                                   err_msg=leaf.name)
