"""Workers for tests/test_conversion.py (run through tests/dist_utils.run_distributed).

    make_originals(root)   1 rank:  per variant, a trainer checkpoint A (random weights + one real
                           step) at TP1, the reference logits, export A -> HF_A, import HF_A -> C,
                           export C -> HF_C; and checkpoints that must be refused.
    reshard(root)          4 ranks, TP2 x PP2 (RESHARDED variants): load A with the trainer's
                           load_checkpoint, save it as B; load C the same way, compare it with A,
                           take one training step from it.
                           Also satformer A -> B_vpp at PP2 x VPP2 x DP2.
    export_resharded(root) 1 rank: export every B -> HF_B (satformer sharded), B_vpp; checkpoints that
                           export must refuse.

    write_tiny_export(folder, arch, num_layers)  an export with random weights, no trainer run
                           (tests/test_evaluate.py, tests/test_gate_report.py).

Folder layout under root: tok/tokenizer.json, {variant}/{A,B,C} (run folders), {variant}/{HF_A,HF_B,HF_C}.
"""

import os

import torch

VOCAB, SEQ, BATCH = 128, 32, 2
SIZES = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "128", "--seq-length", str(SEQ), "--mock-data", "--vocab-size", str(VOCAB),
         "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3", "--train-iters", "10"]
VARIANTS = {
    "transformer": ["--arch", "transformer"],
    "resformer": ["--arch", "resformer"],
    "resformer_fixed_last2": ["--arch", "resformer", "--resformer-lambdas", "fixed", "--value-residual-last-k", "2"],
    "resformer_last2": ["--arch", "resformer", "--value-residual-last-k", "2"],
    "satformer": ["--arch", "satformer"],
    "satformer_last2_sigmoid": ["--arch", "satformer", "--value-residual-last-k", "2",
                                "--value-residual-gate", "sigmoid"],
    "hyperconnections": ["--arch", "hyperconnections"],
    "denseformer": ["--arch", "denseformer"],
    "muddformer": ["--arch", "muddformer"],
}

RESHARDED = ["transformer", "resformer", "satformer", "satformer_last2_sigmoid",  # also saved at TP2 x PP2
             "hyperconnections", "muddformer"]


def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def write_tokenizer(path: str) -> None:
    """A word-level tokenizer with exactly VOCAB tokens: <|endoftext|>, <unk>, w0 ... w125."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tok.save(path)


def write_tiny_export(folder: str, arch: str, num_layers: int, num_query_groups: int = 2) -> str:
    """An HF export with random weights (hidden 32, 4 heads, vocab 128, 64 positions) and the word-level
    tokenizer, written by the converter's own writer, without a trainer run (tests of the tools on exports)."""
    from transformers import PreTrainedTokenizerFast

    from megatron_sat.conversion.hf_io import write_hf_folder
    from megatron_sat.conversion.mapping import ModelSpec, hf_config, hf_shapes

    spec = ModelSpec(arch=arch, num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                     num_query_groups=num_query_groups, ffn_hidden_size=64, kv_channels=8, vocab_size=128,
                     max_position_embeddings=64)
    g = torch.Generator().manual_seed(0)
    weights = {k: (torch.ones(s) if k.endswith("norm.weight") else 0.3 * torch.randn(s, generator=g))
               for k, s in hf_shapes(spec).items()}
    tok_file = os.path.join(folder + "_tokenizer", "tokenizer.json")
    write_tokenizer(tok_file)
    tok = PreTrainedTokenizerFast(tokenizer_file=tok_file, eos_token="<|endoftext|>")
    return write_hf_folder(folder, spec, hf_config(spec, torch.float32, eos=0), weights, tokenizer=tok)


def _args(variant: str, tp: int = 1, pp: int = 1, vpp=None, tokenizer=None, **override):
    from megatron_sat.training.arguments import build_parser

    argv = SIZES + VARIANTS[variant] + ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size",
                                        str(pp)]
    if vpp:
        argv += ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    if tokenizer:
        argv += ["--tokenizer-model", tokenizer]
    args = build_parser().parse_args(argv)
    vars(args).update(override)
    return args


def _build(args):
    """(config, model chunks) at the args' layout, as the trainer builds them (fp32)."""
    from megatron_sat.model.gpt import build_model
    from megatron_sat.parallel.layout import initialize
    from megatron_sat.training.setup import model_config, precision_and_layout

    layout = precision_and_layout(args).layout
    config = model_config(args, layout)
    initialize(layout, seed=args.seed)
    chunks = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ, rotary_base=args.rotary_base)
    return config, chunks


def _wrap(config, chunks, args, dist_opt=False):
    from megatron_sat.training.setup import scheduler
    from megatron_sat.training.step import build_optimizer, wrap_ddp

    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=dist_opt)
    opt = build_optimizer(chunks, lr=args.lr, use_distributed_optimizer=dist_opt)
    return chunks, opt, scheduler(opt, args)  # the trainer's, from args (cosine over --train-iters, no warmup)


def _step(chunks, opt, config, num_micro):
    from megatron_sat.training.step import train_step

    g = torch.Generator().manual_seed(5)

    def batches():
        for _ in range(num_micro):
            data = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
            yield dict(tokens=data[:, :-1], labels=data[:, 1:], loss_mask=torch.ones(1, SEQ),
                       position_ids=torch.arange(SEQ)[None])

    return train_step(chunks, opt, config, batches(), num_microbatches=num_micro, seq_length=SEQ,
                      micro_batch_size=1)


def make_originals(root: str) -> dict:
    from megatron_sat.conversion import export_checkpoint, import_hf
    from megatron_sat.training.checkpointing import save_checkpoint

    tok = os.path.join(root, "tok", "tokenizer.json")
    write_tokenizer(tok)
    quiet = lambda *a, **k: None  # noqa: E731
    out = {}
    for variant in VARIANTS:
        d = os.path.join(root, variant)
        args = _args(variant, tokenizer=tok)
        config, chunks = _build(args)
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # random everything (norms and lambdas too), so a wrong mapping shows
            for name, p in chunks[0].named_parameters():
                # Hyper-Connections' n streams, mixed by strongly random weights, amplify float32 rounding (at 0.3 the
                # export's float64-exact logits differ by 1e-5 relative): its connection weights get less noise
                p.add_((0.1 if "_hc." in name else 0.3) * torch.randn(p.shape, generator=g))
        chunks, opt, sched = _wrap(config, chunks, args)
        _step(chunks, opt, config, num_micro=2)
        model = chunks[0].module
        model.eval()
        with torch.no_grad():
            out[variant] = model(tokens(), torch.arange(SEQ)[None].expand(BATCH, SEQ), None).float()
        save_checkpoint(os.path.join(d, "A"), 1, chunks, opt, sched, consumed_samples=2, args=vars(args))
        if variant == "transformer":  # recorded arch that cannot be converted
            save_checkpoint(os.path.join(root, "bad_arch"), 1, chunks, opt, sched, consumed_samples=2,
                            args=dict(vars(args), arch="mamba"))
        if variant == "satformer":  # SATFormer weights recorded as a Transformer; a gate the authors define apart
            save_checkpoint(os.path.join(root, "bad_mismatch"), 1, chunks, opt, sched, consumed_samples=2,
                            args=dict(vars(args), arch="transformer"))
            save_checkpoint(os.path.join(root, "gate"), 1, chunks, opt, sched, consumed_samples=2,
                            args=dict(vars(args), value_residual_gate="softmax_sigmoid"))
        export_checkpoint(os.path.join(d, "A"), os.path.join(d, "HF_A"), log=quiet)
        import_hf(os.path.join(d, "HF_A"), os.path.join(d, "C"),
                  ["--lr", "1e-3", "--train-iters", "10", "--mock-data", "--vocab-size", str(VOCAB),
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], log=quiet)
        export_checkpoint(os.path.join(d, "C"), os.path.join(d, "HF_C"), log=quiet)
    return out


def reshard(root: str) -> dict:
    """TP2 x PP2: A -> B through the trainer's load/save; C loaded and compared with A."""
    from megatron_sat.training.checkpointing import load_checkpoint, save_checkpoint

    results = {}
    for variant in RESHARDED:
        d = os.path.join(root, variant)
        args = _args(variant, tp=2, pp=2, tokenizer=os.path.join(root, "tok", "tokenizer.json"))
        config, chunks = _build(args)
        chunks, opt, sched = _wrap(config, chunks, args)
        loaded = load_checkpoint(os.path.join(d, "A"), chunks, opt, sched)
        save_checkpoint(os.path.join(d, "B"), loaded["iteration"] + 1, chunks, opt, sched,
                        consumed_samples=4, args=vars(args))
        a_params = {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}
        config2, chunks2 = _build(args)
        chunks2, opt2, sched2 = _wrap(config2, chunks2, args)
        loaded_c = load_checkpoint(os.path.join(d, "C"), chunks2, opt2, sched2)
        c_params = dict(chunks2[0].module.named_parameters())
        diff = max((a_params[n] - c_params[n]).abs().max().item() for n in a_params)
        lr = opt2.param_groups[0]["lr"]
        r = _step(chunks2, opt2, config2, num_micro=2)
        loss, grad_norm, ok = r.loss, r.grad_norm, r.success
        results[variant] = dict(c_vs_a=diff, c_iteration=loaded_c["iteration"], names=sorted(a_params) == sorted(c_params),
                                loss=loss, grad_norm=grad_norm, ok=ok, lr=lr)
    # interleaved pipeline: PP2 x VPP2 (x DP2) -> satformer/B_vpp
    d = os.path.join(root, "satformer")
    args = _args("satformer", pp=2, vpp=2, tokenizer=os.path.join(root, "tok", "tokenizer.json"))
    config, chunks = _build(args)
    chunks, opt, sched = _wrap(config, chunks, args)
    assert len(chunks) == 2
    loaded = load_checkpoint(os.path.join(d, "A"), chunks, opt, sched)
    save_checkpoint(os.path.join(d, "B_vpp"), loaded["iteration"] + 1, chunks, opt, sched, consumed_samples=4,
                    args=vars(args))
    return results


def export_resharded(root: str) -> dict:
    from megatron_sat.conversion import ConversionError, export_checkpoint

    quiet = lambda *a, **k: None  # noqa: E731
    for variant in RESHARDED:
        d = os.path.join(root, variant)
        shard = dict(max_shard_bytes=60_000) if variant == "satformer" else {}
        export_checkpoint(os.path.join(d, "B", "iter_0000002"), os.path.join(d, "HF_B"), log=quiet, **shard)
    export_checkpoint(os.path.join(root, "satformer", "B_vpp"), os.path.join(root, "satformer", "HF_B_vpp"), log=quiet)
    errors = {}
    cases = {
        "missing": (os.path.join(root, "nowhere"), {}),
        "no_tracker": (os.path.join(root, "tok"), {}),
        "bad_arch": (os.path.join(root, "bad_arch"), {}),
        "mismatch": (os.path.join(root, "bad_mismatch"), {}),
        "gate": (os.path.join(root, "gate"), {}),
        "exists": (os.path.join(root, "satformer", "A"), dict(output=os.path.join(root, "satformer", "HF_A"))),
        "dtype": (os.path.join(root, "satformer", "A"), dict(dtype="float8")),
    }
    for name, (load, kw) in cases.items():
        output = kw.pop("output", os.path.join(root, f"out_{name}"))
        try:
            export_checkpoint(load, output, log=quiet, **kw)
            errors[name] = None
        except ConversionError as e:
            errors[name] = str(e)
        errors[name + "/left_output"] = os.path.exists(output) and name not in ("exists", "gate")
    return errors
