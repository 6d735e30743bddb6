"""Workers for tests/test_conversion_published.py (run through tests/dist_utils.run_distributed).

    imports(root)   1 rank: official-shaped Qwen3 and Llama folders made with transformers' own classes (free head
                    dim, GQA, untied embeddings, rope theta 5e5; Llama without q/k norms and eps 1e-5), their
                    logits; each imported as the Transformer (T, for TP2 x PP2) and as a SATFormer (S, --arch
                    satformer), and both exported back (HF_T, HF_S).
    train(root)     4 ranks, TP2 x PP2: T (and qwen3's S) loaded from its config.json with the trainer's parts,
                    3 steps; T saved as T3.
    exports(root)   1 rank: T3 -> HF_T3 with --verify (Megatron vs transformers on the trained weights).

Folder layout under root: tok/, {name}/{hf,T,S,HF_T,HF_S,T3,HF_T3} for name in SOURCES.
"""

import os

import torch
from conversion import VOCAB, write_tokenizer

SEQ, BATCH = 32, 2
SOURCES = ("qwen3", "llama")
IMPORT_FLAGS = ["--lr", "1e-3", "--train-iters", "3", "--seq-length", str(SEQ), "--mock-data", "--vocab-size",
                str(VOCAB), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def tokens():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def hf_source(name: str):
    """(config, model class) of a tiny model at an official shape ratio: head dim 16 != hidden 48 / 4 heads (as
    Qwen3-0.6B: 128 != 1024 / 16), 2 KV heads, untied embeddings, rope theta 5e5."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, tie_word_embeddings=False,
                 rope_theta=500000.0, eos_token_id=0, bos_token_id=None, pad_token_id=None)
    if name == "qwen3":
        return Qwen3Config(rms_norm_eps=1e-6, **shape), Qwen3ForCausalLM
    return LlamaConfig(rms_norm_eps=1e-5, **shape), LlamaForCausalLM


def imports(root: str) -> dict:
    from transformers import PreTrainedTokenizerFast

    from megatron_sat.conversion import export_checkpoint, import_hf

    quiet = lambda *a, **k: None  # noqa: E731
    write_tokenizer(os.path.join(root, "tok", "tokenizer.json"))
    tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(root, "tok", "tokenizer.json"), eos_token="<|endoftext|>")
    out = {}
    for name in SOURCES:
        d = os.path.join(root, name)
        config, cls = hf_source(name)
        torch.manual_seed(0)
        model = cls(config).eval()
        with torch.no_grad():  # norms away from 1, so a norm mapped to the wrong place shows
            for key, p in model.named_parameters():
                if "norm" in key:
                    p.add_(0.2 * torch.randn(p.shape))
        model.save_pretrained(os.path.join(d, "hf"))
        tok.save_pretrained(os.path.join(d, "hf"))
        with torch.no_grad():
            out[name] = model(tokens()).logits.float()
        import_hf(os.path.join(d, "hf"), os.path.join(d, "T"), IMPORT_FLAGS, log=quiet)
        # --upcycle-gate-std 0: exactly the Transformer (its first loss is checked to 1e-5)
        import_hf(os.path.join(d, "hf"), os.path.join(d, "S"),
                  IMPORT_FLAGS + ["--arch", "satformer", "--upcycle-gate-std", "0"], log=quiet)
        for run, hf in (("T", "HF_T"), ("S", "HF_S")):  # --verify: the Megatron model's logits vs the export's
            out[f"{name}/{run}"] = export_checkpoint(os.path.join(d, run), os.path.join(d, hf), verify=True,
                                                     log=quiet)["max_rel_diff"]
    return out


def train(root: str) -> dict:
    """Each import at TP2 x PP2: its recorded arguments (config.json), the trainer's model, optimizer, schedule and
    checkpoint loader; 3 steps on one fixed batch; saved as T3."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from conversion import _step, _wrap

    from megatron_sat.model.gpt import build_model
    from megatron_sat.parallel.layout import initialize
    from megatron_sat.training.arguments import parse_args
    from megatron_sat.training.checkpointing import load_checkpoint, save_checkpoint
    from megatron_sat.training.setup import model_config, precision_and_layout

    out = {}
    for name, run in [(name, "T") for name in SOURCES] + [("qwen3", "S")]:  # S: fused gate, V1 over the pipeline
        d = os.path.join(root, name)
        args = parse_args(["--config", os.path.join(d, run, "config.json"), "--tensor-model-parallel-size", "2",
                           "--pipeline-model-parallel-size", "2"])
        layout = precision_and_layout(args).layout
        config = model_config(args, layout)
        initialize(layout, seed=args.seed)
        chunks = build_model(config, vocab_size=VOCAB, max_sequence_length=SEQ, rotary_base=args.rotary_base,
                             share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
        chunks, opt, sched = _wrap(config, chunks, args)
        loaded = load_checkpoint(os.path.join(d, run), chunks, opt, sched)
        losses = [_step(chunks, opt, config, num_micro=2).loss for _ in range(3)]
        if run == "T":
            save_checkpoint(os.path.join(d, "T3"), loaded["iteration"] + 3, chunks, opt, sched, consumed_samples=6,
                            args=vars(args))
        out[name if run == "T" else f"{name}/{run}"] = dict(
            losses=losses, head_dim=config.kv_channels, qk_layernorm=config.qk_layernorm, arch=config.arch,
            fused_gate=config.arch == "satformer" and config.fused_value_residual_gate, rotary_base=args.rotary_base,
            untied=not chunks[0].module.share_embeddings_and_output_weights)
    return out


def exports(root: str) -> dict:
    """T3 -> HF_T3 (--verify), and every arch at a published shape (see all_archs)."""
    from megatron_sat.conversion import export_checkpoint

    quiet = lambda *a, **k: None  # noqa: E731
    out = {name: export_checkpoint(os.path.join(root, name, "T3"), os.path.join(root, name, "HF_T3"), verify=True,
                                   log=quiet)["max_rel_diff"] for name in SOURCES}
    return dict(out, archs=all_archs(os.path.join(root, "archs")))


def all_archs(root: str) -> dict:
    """Each of the six archs with head dim 16 != 48 / 4, GQA, untied, norm eps 1e-5, with and without q/k norms:
    built by the converter (TP1), random weights, exported; {arch/qk: (relative max logit difference Megatron vs
    transformers, HF -> Megatron gives the weights back)}."""
    from megatron_sat.archs import ARCHS
    from megatron_sat.conversion import hf_io, megatron_io
    from megatron_sat.conversion.export import verify_export
    from megatron_sat.conversion.mapping import ModelSpec, hf_config, hf_to_megatron, megatron_to_hf

    out = {}
    for arch in ARCHS:
        for qk in (True, False):
            spec = ModelSpec(arch=arch, num_layers=3, hidden_size=48, num_attention_heads=4, num_query_groups=2,
                             kv_channels=16, ffn_hidden_size=96, vocab_size=VOCAB, max_position_embeddings=16,
                             tied=False, qk_layernorm=qk, layernorm_epsilon=1e-5, rotary_base=500000)
            _, chunks = megatron_io.make_model(spec, torch.float32)
            g = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in chunks[0].parameters():
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            state = megatron_io.full_state(chunks[0])
            weights = megatron_to_hf(state, spec)
            path = hf_io.write_hf_folder(os.path.join(root, f"{arch}_{qk}"), spec, hf_config(spec, torch.float32),
                                         weights)
            back = hf_to_megatron(weights, spec)
            out[f"{arch}/{qk}"] = (verify_export(chunks[0], path, spec), all(torch.equal(back[k], v)
                                                                             for k, v in state.items()))
    return out
