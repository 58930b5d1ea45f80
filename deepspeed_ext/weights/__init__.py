"""Weights of a live engine, streamed: to each of its ranks (:func:`deepspeed_ext.hf_weights`) or to inference
processes outside the training job (:func:`deepspeed_ext.send_weights` / :func:`deepspeed_ext.receive_weights`),
under the model's HF names, from any layout the engine trains in. See docs/weight-streaming.md.

One module per concern: :mod:`.plan` (who holds what, buckets, assembly), :mod:`.engine_side` (the live engine's
pieces), :mod:`.naming` (names, dtypes, adapters), :mod:`.groups` (the process groups), :mod:`.transfer` (the
update on the wire), :mod:`.sinks` (what a receiver loads into).
"""
