"""The states of a parameter, in the names DeepSpeed's universal layout uses: fp32 master weights, the Adam
moments, and the optimizer step. A module of its own so that the tensor and source layers share them."""

MASTER_WEIGHTS = "fp32"
ADAM_STATES = ("exp_avg", "exp_avg_sq")
STEP = "step"
