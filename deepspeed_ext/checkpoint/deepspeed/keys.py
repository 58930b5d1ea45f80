"""The names DeepSpeed gives its checkpoint files and the keys inside them, in one place.

They are DeepSpeed's on-disk format, so a DeepSpeed release that renames one changes it here only. Where
``deepspeed.checkpoint.constants`` defines a name, the value is the same (a unit test compares them); it
is not imported from there because reading a checkpoint must not pay for importing DeepSpeed.
"""

from __future__ import annotations

import re

# --------------------------------------------------------------------------- files of a save directory
LATEST = "latest"  # names the newest tag directory
#: ZeRO-0/1/2 (and BF16_Optimizer): one model-states file per TP rank.
MODEL_STATES_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
#: ZeRO-3: one model-states file per (DP, TP) rank.
ZERO3_MODEL_STATES_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: Matches the model-states files of either kind (for a quick look, without telling them apart).
MODEL_STATES_GLOB = "*mp_rank_*_model_states.pt"
#: ZeRO-1/2/3 and BF16_Optimizer: one optimizer file per (DP, TP) rank; groups: prefix, dp, tp.
OPTIM_STATES_RE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
#: DeepSpeed's expert-parallel (MoE, AutoEP) files: one model-states file per expert and TP rank, and, without ZeRO,
#: one optimizer file per EP rank.
EXPERT_MODEL_STATES_RE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
#: A pipeline engine's module: one file per layer (its index in the PipelineModule) and TP rank, the layer's own
#: state dict; the model-states files then hold no ``module``.
LAYER_MODEL_STATES_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
EXPERT_OPTIM_STATES_RE = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

# --------------------------------------------------------------------------- model states
MODULE = "module"  # the module state dict (low-precision weights; under ZeRO-3 empty placeholders)
BUFFER_NAMES = "buffer_names"
OPTIMIZER = "optimizer"  # without ZeRO the whole optimizer state; with ZeRO None
PARAM_SHAPES = "param_shapes"  # per param group, {name: TP-local shape} in flat-buffer order
FROZEN_PARAM_SHAPES = "frozen_param_shapes"
FROZEN_PARAM_FRAGMENTS = "frozen_param_fragments"
SHARED_PARAMS = "shared_params"
LR_SCHEDULER = "lr_scheduler"
DATA_SAMPLER = "data_sampler"
RANDOM_LTD = "random_ltd"
SPARSE_TENSOR_MODULE_NAMES = "sparse_tensor_module_names"
SKIPPED_STEPS = "skipped_steps"
GLOBAL_STEPS = "global_steps"
GLOBAL_SAMPLES = "global_samples"
DP_WORLD_SIZE = "dp_world_size"
MP_WORLD_SIZE = "mp_world_size"  # the TP degree
CHECKPOINT_PARALLEL_DIMS = "checkpoint_parallel_dimensions"
CHECKPOINT_PP_DEGREE = "pp_degree"
CHECKPOINT_TP_DEGREE = "tp_degree"
DS_CONFIG = "ds_config"
DS_VERSION = "ds_version"
UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"  # upstream AutoTP's TP metadata (>= 0.18.9)

#: Model-states keys that belong to DeepSpeed; everything else is the user's client state.
DEEPSPEED_STATE_KEYS = frozenset({
    MODULE, BUFFER_NAMES, OPTIMIZER, PARAM_SHAPES, FROZEN_PARAM_SHAPES, SHARED_PARAMS, FROZEN_PARAM_FRAGMENTS,
    LR_SCHEDULER, DATA_SAMPLER, RANDOM_LTD, SPARSE_TENSOR_MODULE_NAMES, SKIPPED_STEPS, GLOBAL_STEPS,
    GLOBAL_SAMPLES, DP_WORLD_SIZE, MP_WORLD_SIZE, CHECKPOINT_PARALLEL_DIMS, DS_CONFIG, DS_VERSION,
    UNIVERSAL_CHECKPOINT_INFO,
})

# --------------------------------------------------------------------------- optimizer files (ZeRO, BF16_Optimizer)
OPTIMIZER_STATE_DICT = "optimizer_state_dict"  # the file's payload; under ZeRO-3 also the wrapped torch state
ZERO_STAGE = "zero_stage"  # absent in BF16_Optimizer's files
PARTITION_COUNT = "partition_count"
LOSS_SCALER = "loss_scaler"
CLIP_GRAD = "clip_grad"
# ZeRO-1/2 and BF16_Optimizer
BASE_OPTIMIZER_STATE = "base_optimizer_state"  # the wrapped torch optimizer's state dict
SINGLE_PARTITION_OF_FP32_GROUPS = "single_partition_of_fp32_groups"  # this rank's flat fp32 master per group
PARAM_SLICE_MAPPINGS = "param_slice_mappings"  # per group, {name: (start, numel)} in that partition
GROUP_PADDINGS = "group_paddings"  # per group, the padding its master is saved without (its torch state keeps it)
# ZeRO-3
FP32_FLAT_GROUPS = "fp32_flat_groups"  # this rank's flat fp32 master per group

# --------------------------------------------------------------------------- stage-0 wrappers (in OPTIMIZER)
FP32_GROUPS_FLAT = "fp32_groups_flat"  # FP16_Optimizer: one flat fp32 master per group
FP32_GROUPS = "fp32_groups"  # FP16_UnfusedOptimizer: one fp32 master per parameter
WRAPPED_OPTIMIZER_STATE_DICT = OPTIMIZER_STATE_DICT  # both wrappers keep the torch optimizer's state here

# --------------------------------------------------------------------------- a torch optimizer's state dict
STATE = "state"
PARAM_GROUPS = "param_groups"
PARAMS = "params"

#: Keys of an optimizer state that hold tensors (or the per-tensor torch state): the universal form keeps
#: them per parameter, so ``zero/optimizer_state.pt`` leaves them out.
TENSOR_HOLDING_KEYS = (BASE_OPTIMIZER_STATE, PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS, FP32_FLAT_GROUPS,
                       OPTIMIZER_STATE_DICT, FP32_GROUPS_FLAT, FP32_GROUPS, STATE, PARAM_GROUPS)

# --------------------------------------------------------------------------- DeepSpeed's universal checkpoint
LATEST_UNIVERSAL = "latest_universal"  # names the newest universal tag directory
ZERO_DIR = "zero"  # <tag>_universal/zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt
UNIVERSAL_OPTIMIZER_STATE_FILE = "optimizer_state.pt"  # zero/optimizer_state.pt: hyper-parameters, no tensors
UNIVERSAL_TAG_SUFFIX = "_universal"
#: The keys of a universal per-parameter file (``zero/<param>/fp32.pt`` and the moments): the full tensor, the
#: dimension DeepSpeed's legacy restore chunks it along, and the mark of a vocabulary-parallel table (upstream's
#: legacy restore pads such a table to the target degree's padded vocabulary).
PARAM = "param"
CAT_DIM = "cat_dim"
VOCAB_TENSOR = "vocab_tensor"
