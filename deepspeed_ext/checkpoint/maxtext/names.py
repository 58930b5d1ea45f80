"""Every on-disk name and key of a MaxText checkpoint in Orbax, in one place: the files and directories Orbax
writes, the keys of the train state MaxText saves, and our entries in the step's custom metadata.

Layout written (what MaxText loads with ``load_parameters_path=<out>/0/items``)::

    <out>/0/_CHECKPOINT_METADATA     custom_metadata {"scan_layers": bool,
                                                      "deepspeed_ext": {family, model_config, fingerprints}}
    <out>/0/items/_METADATA          the Orbax PyTree's metadata (OCDBT + zarr3, as MaxText writes it):
        {"step": N, "params": {"params": <MaxText parameter tree>},
         "opt_state": {} or optax adamw's [{"count", "mu", "nu"}, None, {"count"}]}
    <out>/0/items/<a.b.c>/           with --no-ocdbt, each array's own zarr3 directory (``zarr.json``, ``c/...``)
"""

from __future__ import annotations

from deepspeed_ext.checkpoint.fingerprint import FINGERPRINTS_KEY as FINGERPRINTS_KEY
from deepspeed_ext.checkpoint.locate import ORBAX_ITEM, ORBAX_METADATA
# Orbax's step metadata file (``<step>/_CHECKPOINT_METADATA``) and its key for the caller's entries: Orbax's
# private format, so named in orbax_private, which checks them against the installed Orbax.
from deepspeed_ext.checkpoint.orbax_private import CUSTOM_METADATA as CUSTOM_METADATA
from deepspeed_ext.checkpoint.orbax_private import STEP_METADATA as STEP_METADATA

# --------------------------------------------------------------------------- files and directories
#: The item directory (``<step>/items``): Orbax's PyTree, under the item name MaxText's checkpoint manager uses.
ITEM = ORBAX_ITEM
#: The PyTree's metadata file in the item directory (the tree's structure, each array's shape and dtype).
METADATA = ORBAX_METADATA
#: The step directory to-maxtext writes (and reshard-orbax): step 0 of an Orbax checkpoint manager.
STEP_DIR = "0"

# --------------------------------------------------------------------------- the step's custom metadata
#: MaxText's own entry: whether the decoder layers are stacked (``scan_layers``).
SCAN_LAYERS_KEY = "scan_layers"
#: Our entry in the step's custom metadata, and its keys: the family and HF model config the checkpoint was
#: written with, and the fingerprints of what a read returns.
METADATA_KEY = "deepspeed_ext"
FAMILY_KEY = "family"
MODEL_CONFIG_KEY = "model_config"

# --------------------------------------------------------------------------- MaxText's train state (the PyTree)
STEP_KEY = "step"
PARAMS_KEY = "params"
OPT_STATE_KEY = "opt_state"
#: optax adamw's state, MaxText's default optimizer:
#: ``[ScaleByAdamState(count, mu, nu), EmptyState, ScaleByScheduleState(count)]``.
COUNT_KEY = "count"
MU_KEY = "mu"
NU_KEY = "nu"
#: The variable collection of the parameters the optimizer steps (``params/<collection>/...``; others, such as
#: DeepSeek's router bias, have no moments).
PARAMS_COLLECTION = "params"
#: Where the parameter tree sits in the train state, relative to the item root (its leaves are
#: ``<collection>/<path>``: ``params/decoder/...``).
PARAMS_PREFIX = (PARAMS_KEY, )
#: optax adamw's ``ScaleByAdamState`` in the train state (the first state of its chain).
ADAM_STATE = (OPT_STATE_KEY, "0")
#: Where optax adamw's moments sit in the train state, relative to the item root.
MOMENT_PREFIX = {"exp_avg": (*ADAM_STATE, MU_KEY), "exp_avg_sq": (*ADAM_STATE, NU_KEY)}
#: The optimizer's step count in the train state.
OPTIMIZER_COUNT = (*ADAM_STATE, COUNT_KEY)
#: The trees that mirror the parameter tree (the weights, each moment), as flat ``/`` paths.
PARAM_ROOTS = tuple("/".join((*prefix, PARAMS_COLLECTION, "")) for prefix in (PARAMS_PREFIX, *MOMENT_PREFIX.values()))
#: Where MaxText's full train state keeps the model's persistent variables that are not parameters (NNX's
#: checkpoint layout: ``nnx_aux/model/<path>``; DeepSeek's router bias, RNG streams).
MODEL_AUX_KEY = "nnx_aux"
MODEL_AUX_MODEL = "model"
#: The decoder subtrees that hold scanned stacks (``decoder/<stack>/...``) in MaxText's families.
SCANNED_STACKS = ("layers", "dense_layers", "moe_layers", "scanned_blocks")
#: Stacks that MaxText scans inside a block (``.../<stack>/...``): Qwen3-Next's linear-attention layers and Gemma 4's
#: sliding-window ones, one more stack axis inside each cycle's stack (and the only one in ``layers_remainder``).
NESTED_STACKS = ("local_layers", )
