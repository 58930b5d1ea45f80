"""torchrun worker: build an AutoTP engine and compare our layouts with DeepSpeed's own tags.

Writes JSON (rank 0), one file per family (``--family`` several times: one engine after the other in this process,
as the pooled training workers build theirs, so a TP degree's torchrun starts once): per parameter, whether our layout, the layout read from DeepSpeed's
``ds_autotp_universal_checkpoint_meta``, and our layout computed from the shard-size rule alone
(ignoring the sizes the layers froze) cut identical slices for every TP rank.
"""

import argparse
import json
import os

import torch


def same_slices(a, b) -> bool:
    if a.shape != b.shape or a.tp_size != b.tp_size:
        return False
    full = torch.arange(a.numel, dtype=torch.int64).reshape(a.shape)
    return all(torch.equal(a.slice(full, r), b.slice(full, r)) for r in range(a.tp_size))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--family", action="append", required=True)
    p.add_argument("--out", required=True, help="a directory: <family>.json each")
    args = p.parse_args()
    for family in args.family:
        compare(family, os.path.join(args.out, f"{family}.json"))
    from deepspeed_ext.demo.models import finish_distributed
    finish_distributed()


def compare(family: str, out: str) -> None:
    import deepspeed.comm as dist

    import deepspeed_ext
    from deepspeed_ext.demo.models import build_model, ds_config
    from deepspeed_ext.module_inject import (LAYOUT_ATTR, layouts_from_universal_checkpoint_info, tag_autotp_model,
                                            upstream_layouts)

    tp = int(os.environ["WORLD_SIZE"])
    model = build_model(family)
    engine, *_ = deepspeed_ext.initialize(model=model,
                                          model_parameters=model.parameters(),
                                          config=ds_config(tp=tp, family=family))
    ours = engine.deepspeed_ext_uc_info.layouts
    theirs = upstream_layouts(engine.module)
    by_rule = tag_autotp_model(engine.module, use_layer_sizes=False)
    # The converter's path for checkpoints saved without deepspeed-ext: DeepSpeed's model-level
    # universal_checkpoint_info plus every TP rank's local shapes.
    local = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
    all_local = [None] * tp
    dist.all_gather_object(all_local, local)
    from_info = layouts_from_universal_checkpoint_info(engine.module.universal_checkpoint_info,
                                                       {name: [r[name] for r in all_local] for name in local})
    result = {}
    for name, layout in ours.items():
        param = dict(engine.module.named_parameters())[name]
        result[name] = {
            "ours": layout.to_json(),
            "upstream": theirs[name].to_json(),
            "has_upstream_meta": hasattr(param, "ds_autotp_universal_checkpoint_meta"),
            "tagged": getattr(param, LAYOUT_ATTR, None) is not None,
            "same_as_upstream": same_slices(layout, theirs[name]),
            "same_as_rule": same_slices(layout, by_rule[name]),
            "same_as_uc_info": same_slices(layout, from_info[name]),
        }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    main()
