"""A scaling ladder that runs on one CPU machine: `{arch}_ladder1`, `_ladder2`, `_ladder3` for every arch, on the
embedded corpus (Python's own documentation, BPE vocabulary 4096, cached in runs/demo/data like `make demo`).

    python tools/submit_grid.py --archs transformer,resformer,satformer --scales ladder1,ladder2,ladder3 \\
        --sweep ladder --submit                                         # Slurm (a local one: tests/slurm_cluster.py)
    python -m megatron_sat.train --recipe satformer_ladder2             # or one run locally
    python tools/collect_grid.py runs --sweep ladder --out docs/ladder  # then the table, fits and figures

Three shapes, width and depth growing together (d_model 64 -> 128 -> 192, 2 -> 3 -> 4 layers, head dim 32, FFN
3 x d_model), one token budget (150 steps x 32 sequences x 128 tokens = 614k tokens, about 1.4 passes over the
training split) and the paper's schedule shape (AdamW 0.9/0.95, wd 0.1, clip 1, warmup then cosine to 0.1 lr), the
peak lr falling with size as in the paper's grid. The validation set (4 x 32 sequences, the same for every run
and seed: megatron_sat/training/data.py) is scored every 25 steps and at the end. Sized for 2 idle cores: about
0.5, 1 and 1.5 minutes per run; the loss falls clearly with size (docs/sweeps.md, "A scaling ladder on one CPU").
Narrower shapes (d_model 32) were tried and dropped: at this budget they end where d_model 64 does.
"""

from functools import partial

from megatron_sat.archs import ARCHS
from recipes import base, model, register

LADDER = {  # name: (shape, peak lr); head dim 32 throughout
    "ladder1": (dict(num_layers=2, hidden_size=64, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=192), 4e-3),
    "ladder2": (dict(num_layers=3, hidden_size=128, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=384),
                3e-3),
    "ladder3": (dict(num_layers=4, hidden_size=192, num_attention_heads=6, num_query_groups=6, ffn_hidden_size=576),
                2.5e-3),
}
STEPS = 150


def ladder(arch: str, size: str) -> dict:
    shape, lr = LADDER[size]
    return dict(**base(lr=lr), **model(arch, "tiny", **shape), embedded_data="runs/demo/data", vocab_size=4096,
                seq_length=128, micro_batch_size=8, global_batch_size=32, train_iters=STEPS, lr_warmup_iters=15,
                log_interval=10, eval_interval=25, eval_iters=4, save_interval=STEPS, split="98,2,0")


for _arch in ARCHS:
    for _size in LADDER:
        register(f"{_arch}_{_size}")(partial(ladder, _arch, _size))
