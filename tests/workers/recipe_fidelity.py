"""Optimizer groups and output-projection init under both settings (tests/test_recipes.py).

    python tests/workers/recipe_fidelity.py OUT.json

One rank, one process group. For every arch: which parameters get weight decay under
--weight-decay-params matrices / all, and the std of the attention-output and MLP-down projections under
--output-layer-init scaled / unscaled (a model wide enough for the std to be measured to a few percent).
"""

import json
import math
import sys

import torch


def main(out: str) -> None:
    from megatron_sat.archs import ARCHS
    from megatron_sat.model.config import make_config
    from megatron_sat.parallel.layout import Layout, initialize
    from megatron_sat.parallel.process_group import init_from_env
    from megatron_sat.training.step import setup_model_and_optimizer

    init_from_env(single_only=True)
    initialize(Layout(), seed=1)
    result = {}
    for arch in ARCHS:
        for wd in ("matrices", "all"):
            config = make_config(arch, num_layers=3, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
            chunks, _, optimizer = setup_model_and_optimizer(config, vocab_size=64, max_sequence_length=16, lr=1e-3,
                                                             weight_decay=0.1, weight_decay_params=wd)
            group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
            result[f"{arch}/{wd}"] = {name: dict(ndim=p.dim(), wd_mult=group_of[id(p)].get("wd_mult", 1.0))
                                      for name, p in chunks[0].module.named_parameters()}
        for init in ("scaled", "unscaled"):
            layers = 4
            config = make_config(arch, num_layers=layers, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024,
                                 output_layer_init=init)
            torch.manual_seed(0)
            chunks, _, _ = setup_model_and_optimizer(config, vocab_size=64, max_sequence_length=16, lr=1e-3)
            stds = {}
            for name, p in chunks[0].module.named_parameters():
                if name.endswith(("linear_proj.weight", "linear_fc2.weight", "linear_qkv.weight")):
                    stds[name] = p.detach().float().std().item()
            result[f"{arch}/{init}"] = dict(stds=stds, expected_scaled=0.02 / math.sqrt(2 * layers))
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
