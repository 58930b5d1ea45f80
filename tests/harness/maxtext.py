"""Helpers shared by tests/unit/test_maxtext.py and tests/e2e/test_maxtext_e2e.py: tiny HF models per family,
conversion as to-maxtext does it, restoring through Orbax onto a simulated 4-device CPU mesh, and the KL bar."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.checkpoint.maxtext import ModelDims, partition_spec, plan_leaves, write_maxtext
from deepspeed_ext.checkpoint.model_config import persistent_buffers
from deepspeed_ext.demo.models import VARIANTS, tiny_config
from harness.maxtext_reference import ReferenceConfig

MESH_SHAPE = {"fsdp": 2, "tensor": 2}
TOKENS = [3, 17, 250, 42, 42, 7, 99, 128, 5, 61, 200, 13]


def hf_model(family: str, head_dim: int = 16, num_layers: int | None = None) -> torch.nn.Module:
    """The family's tiny model at the MaxText sizes (deepspeed_ext.demo.models.tiny_config), its weights made to
    show mistakes: peaky attention, norms away from 1, nonzero biases and router bias. ``num_layers``: another
    decoder depth than the family's tiny one (the per-layer attention types follow from it)."""
    import transformers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(sized_config(family, head_dim, num_layers),
                                                          attn_implementation="eager").float().eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(6.0)  # peaky attention: RoPE / scaling mistakes become visible
            elif name.endswith("self_attn.kv_norm.weight"):  # DeepSeek-V4's: its queries are unit-RMS, so its
                param.copy_(3 + 0.3 * torch.randn(param.shape, generator=generator))  # key norm sets the peaks
            elif "norm" in name or name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's: scales
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif name.endswith("position_bias") or (name.endswith("sinks") and family.startswith("deepseek-v4")):
                # DeepSeek-V4's compressors' window biases and its sinks: zero at init; beside its peaked attention
                # (its key norm, above) small ones would hide a misplaced one
                param.copy_(2.0 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("bias", "sinks")):  # transformers initializes these to zero: make them count
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("_hc.base", "hc_head.hc_base")):  # DeepSeek-V4's hyper-connections: zero at init,
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif name.endswith(("_hc.scale", "hc_head.hc_scale")):  # their scales one, their projections tiny,
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))
            elif name.endswith(("_hc.fn", "hc_head.hc_fn")):  # so the streams' mixes would barely move
                param.mul_(10.0)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's router bias: steers the expert choice
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=generator))
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash table: zero at init, every token on expert 0 twice
                vocab, top_k = buffer.shape
                experts = torch.rand(vocab, model.config.n_routed_experts, generator=generator)
                buffer.copy_(experts.argsort(dim=-1)[:, :top_k])
            elif name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (a buffer, 1 at init)
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))
    return model


def sized_config(family: str, head_dim: int, num_layers: int | None = None):
    """tiny_config at the MaxText sizes, ``num_layers`` deep when given."""
    config = tiny_config(family, maxtext_head_dim=head_dim)
    if num_layers is None:
        return config
    settings = {key: value for key, value in config.to_dict().items() if key != "model_type"}
    settings["num_hidden_layers"] = num_layers
    for derived in ("layer_types", "mlp_layer_types", "no_rope_layers", "moe_layers"):  # rebuilt for the new depth
        if derived in settings:
            settings[derived] = None
    return type(config)(**settings)


def reference_config(model: torch.nn.Module, family: str, scan_layers: bool) -> ReferenceConfig:
    c = model.config
    rope_theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") or c.rope_theta
    return ReferenceConfig(num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rope_theta=float(rope_theta),
                           eps=c.rms_norm_eps, scan_layers=scan_layers,
                           rope="llama3.1" if family == "llama3.1" else "rotate_half",
                           qk_norm=family.startswith("qwen3"), tied=bool(c.tie_word_embeddings),
                           num_experts_per_tok=getattr(c, "num_experts_per_tok", 0) if family == "qwen3-moe" else 0)


def convert(model, family, out, scan_layers=True, dtype="float32", mesh=None, **writer):
    """HF parameters (deduplicated, as a universal checkpoint holds them) and persistent buffers -> MaxText, as
    to-maxtext does; ``writer``: more of write_maxtext's options (``ocdbt``, ``compression``)."""
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    params.update((name, b.detach().float().numpy()) for name, b in persistent_buffers(model).items())
    config = json.loads(model.config.to_json_string(use_diff=False))
    family = get_family(base_family(family)) if isinstance(family, str) else family
    dims = ModelDims.from_config(config)
    shapes = {name: array.shape for name, array in params.items()}
    items = write_maxtext(lambda name, state="fp32": params[name], shapes, family, dims, out,
                          scan_layers=scan_layers, dtype=dtype, progress=False, model_config=config, mesh=mesh,
                          **writer)
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
    return VARIANTS.get(name, name)


class _MaxTextServer:
    """One MaxText process (``workers/WORKER`` in .venv-maxtext: maxtext_forward.py, maxtext_train.py)
    answering every request of its kind this test process makes: starting JAX and importing MaxText is most of a
    one-request run. Restarted if it dies; a request it cannot answer in ``timeout`` seconds kills it and fails the
    test."""

    def __init__(self, worker: str, args: tuple[str, ...] = (), timeout: float = 600.0) -> None:
        import atexit
        self.worker, self.args, self.timeout = worker, args, timeout
        self.proc: subprocess.Popen | None = None
        self.stderr_log: Path | None = None
        atexit.register(self.close)

    def _start(self) -> subprocess.Popen:
        import tempfile

        from harness.environments import MAXTEXT_PYTHON
        handle, name = tempfile.mkstemp(prefix=f"{Path(self.worker).stem}_", suffix=".log")
        os.close(handle)
        self.stderr_log = Path(name)
        cmd = [str(MAXTEXT_PYTHON), str(Path(__file__).parent / "workers" / self.worker), *self.args]
        with open(self.stderr_log, "w") as stderr:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                    env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
        return proc

    def ask(self, request: dict) -> dict:
        import selectors
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            ready = selector.select(self.timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            tail = self.stderr_log.read_text()[-4000:] if self.stderr_log else ""
            raise RuntimeError(f"MaxText's {self.worker} process {'timed out' if not ready else 'died'}:\n{tail}")
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        if self.stderr_log is not None:
            self.stderr_log.unlink(missing_ok=True)
            self.stderr_log = None


#: This test process's MaxText processes, by worker and arguments (JAX's device count is fixed when it starts).
_SERVERS: dict[tuple[str, tuple[str, ...]], _MaxTextServer] = {}


def _server(worker: str, *args: str) -> _MaxTextServer:
    if (worker, args) not in _SERVERS:
        _SERVERS[(worker, args)] = _MaxTextServer(worker, args)
    return _SERVERS[(worker, args)]


def maxtext_logits(items, model, family: str, scan_layers: bool, workdir, sharded: bool = False,
                   tokens=None) -> np.ndarray:
    """MaxText's own forward (its model code and its checkpoint loader, in .venv-maxtext) on TOKENS.

    ``sharded``: restored onto MaxText's own sharding of a 4-device CPU mesh (fsdp=2 x tensor=2); most arrays
    must come out split."""
    tokens_file, logits = Path(workdir) / "tokens.npy", Path(workdir) / "maxtext_logits.npy"
    np.save(tokens_file, np.array([TOKENS if tokens is None else list(tokens)], dtype=np.int32))
    server = _server("maxtext_forward.py", *(("--sharded", ) if sharded else ()))
    answer = server.ask({"items": str(items), "tokens": str(tokens_file), "logits": str(logits),
                         "output_dir": str(Path(workdir) / "maxtext_out"),
                         "settings": maxtext_settings(model, family, scan_layers)})
    if not answer["ok"]:
        raise RuntimeError(f"MaxText's forward failed:\n{answer['error'][-4000:]}")
    if sharded:
        assert answer["split"] >= answer["arrays"] // 2, \
            f"MaxText split only {answer['split']} of {answer['arrays']} arrays over the mesh"
    return np.load(logits)[0]


def maxtext_train(settings: list[str], tokens: np.ndarray, workdir: Path) -> dict:
    """MaxText's own train_step (workers/maxtext_train.py, in .venv-maxtext) on ``tokens`` (int [steps, batch,
    length]: the token rows DeepSpeed trains on at each step, ``labels=tokens`` in transformers' sense), from the
    checkpoint ``settings`` name, saving the full state after every step with MaxText's checkpoint manager.

    transformers shifts the labels inside the model: position i predicts token i+1 and the last position predicts
    nothing. MaxText takes inputs and targets already shifted, so its batch is ``inputs = tokens[:, :-1]``,
    ``targets = tokens[:, 1:]`` (length - 1 positions from 0, one segment per row): the same loss over the same
    predictions. Returns ``{"start_step", "losses", "checkpoints"}`` (checkpoint ``i`` holds the state after
    ``losses[i]``'s step). One MaxText process of this test process's trains every run it asks for, each from a
    fresh config, model, optimizer and checkpoint manager."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    np.savez(workdir / "batches.npz", inputs=tokens[:, :, :-1], targets=tokens[:, :, 1:])
    request = {"settings": settings, "batches": str(workdir / "batches.npz"), "output_dir": str(workdir / "run"),
               "result": str(workdir / "result.json")}
    answer = _server("maxtext_train.py").ask(request)
    if not answer["ok"]:
        raise RuntimeError(f"MaxText's training failed:\n{answer['error'][-4000:]}")
    return json.loads((workdir / "result.json").read_text())
