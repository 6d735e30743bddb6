"""Worker of tests/test_rope_scaling.py: a Llama 3.1-style model (rope_type llama3) through import, training and
export, against transformers' own logits past the original context.

    python tests/workers/rope_scaling.py run ROOT          # everything below; ROOT/result.pt
    python tests/workers/rope_scaling.py t4 T4_DIR OUT.pt HF_DIR    # an export's logits under transformers 4.x,
                                                                    # once HF_DIR/../result.pt exists

`run`, in one process: a tiny LlamaForCausalLM (random weights, noisy enough for sharp attention) whose RoPE is
scaled as Llama 3.1's with original context 32, factor 4, low 1, high 4 (so its rotary frequencies fall in all three
bands: kept, interpolated, divided), saved by transformers; imported with no training flags (the placeholders) and
as a SATFormer (`--arch satformer`, `--upcycle-gate-std 0`: a zero gate); the trainer's arguments of the import's
printed next step (with the placeholders chosen) build the trainer's model, which loads the weights, takes 2 steps
at 3.5x the original context and is saved and exported. The logits compared: Megatron's import and the SATFormer
vs transformers, the export vs the trained Megatron model, each at SEQ = 112 positions; and transformers without
the scaling, to show the comparison sees it; the scaled frequencies at Llama 3.2's values against transformers' own;
then the refusals (REFUSED, and the tool's exit code). `t4` imports only torch and transformers (transformers 4.x
first on sys.path).
"""

import os
import sys

import torch

VOCAB, SEQ, ORIGINAL, POSITIONS = 128, 112, 32, 128
SCALING = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=ORIGINAL)
LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=POSITIONS, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)
CHOSEN = {"LR": "1e-4", "TRAIN_ITERS": "2", "SEQ_LENGTH": str(SEQ)}
# rope_scaling entries an import refuses (the test matches each message), written in transformers 4.x's key
REFUSED = {
    "yarn": dict(rope_type="yarn", factor=4.0),
    "dynamic": dict(type="dynamic", factor=2.0),
    "linear": dict(rope_type="linear", factor=2.0),
    "llama3 without its numbers": dict(rope_type="llama3", factor=8.0),
    "factor below 1": dict(SCALING, factor=0.5),
    "low not below high": dict(SCALING, low_freq_factor=4.0),
    "no original context": dict(SCALING, original_max_position_embeddings=0),
}


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def hf_logits(folder: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens()).logits.float()


def megatron_logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(tokens(), torch.arange(SEQ)[None].expand(2, SEQ), None).float()


def imported_logits(save: str) -> torch.Tensor:
    """The Megatron model of a checkpoint, built and loaded as the export builds it."""
    from megatron_sat.conversion import megatron_io

    iter_dir, run_dir = megatron_io.find_checkpoint(save)
    args, _ = megatron_io.recorded_config(iter_dir, run_dir)
    metadata = megatron_io.tensor_metadata(iter_dir)
    spec = megatron_io.spec_from_args(args, metadata)
    _, chunks = megatron_io.make_model(spec, torch.float32)
    megatron_io.load_weights(chunks[0], iter_dir, metadata)
    return megatron_logits(chunks[0])


def write_llama(folder: str) -> dict:
    """The scaled Llama saved by transformers; returns its logits and those of the same weights unscaled."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, rope_scaling=dict(SCALING)))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random everything, so that attention is sharp and a wrong frequency shows
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    plain = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        unscaled = plain(tokens()).logits.float()
    return dict(reference=hf_logits(folder), unscaled=unscaled)


def train_next_step(next_step: str, run: str) -> torch.Tensor:
    """The trainer's arguments of the import's printed next step (placeholders chosen, mock data for DATA), the
    trainer's model with the pretrained weights, 2 steps at SEQ, saved in `run`; returns the trained logits."""
    from megatron_sat.model.args import model_args, record
    from megatron_sat.model.gpt import build_model
    from megatron_sat.parallel.layout import initialize
    from megatron_sat.training import checkpointing as ckpt
    from megatron_sat.training.arguments import parse_args
    from megatron_sat.training.run_folder import model_differences
    from megatron_sat.training.setup import model_config, precision_and_layout, scheduler
    from megatron_sat.training.step import build_optimizer, train_step, wrap_ddp

    argv = next_step.split("megatron_sat.train ", 1)[1].split()
    argv = [CHOSEN.get(a, run if a == "RUN" else a) for a in argv]
    at = argv.index("--data-path")
    argv[at:at + 2] = ["--mock-data", "--vocab-size", str(VOCAB), "--micro-batch-size", "1", "--global-batch-size",
                       "1"]
    args = parse_args(argv)
    layout = precision_and_layout(args).layout
    config = model_config(args, layout)
    initialize(layout, seed=args.seed)
    chunks = build_model(config, vocab_size=VOCAB, max_sequence_length=args.seq_length, rotary_base=args.rotary_base,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=False)
    opt = build_optimizer(chunks, lr=args.lr, use_distributed_optimizer=False)
    sched = scheduler(opt, args)
    point = ckpt.find_resume_point(args.pretrained_checkpoint)
    assert model_differences(point.model_fields(), record(model_args(args))) == [], "the import's model differs"
    ckpt.load_weights(point, chunks)
    opt.reload_model_params()
    g = torch.Generator().manual_seed(5)
    for _ in range(args.train_iters):
        data = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
        batch = dict(tokens=data[:, :-1], labels=data[:, 1:], loss_mask=torch.ones(1, SEQ),
                     position_ids=torch.arange(SEQ)[None])
        train_step(chunks, opt, config, iter([batch]), num_microbatches=1, seq_length=SEQ, micro_batch_size=1)
        sched.step(increment=1)
    ckpt.save_checkpoint(run, args.train_iters, chunks, opt, sched, consumed_samples=args.train_iters, args=vars(args))
    return megatron_logits(chunks[0].module)


def llama32_frequencies() -> dict:
    """megatron_sat's scaled frequencies and transformers' own (its llama3 RoPE init) at Llama 3.2's factor 32 with
    low 2 and high 8 (none at Megatron-Core's fixed values), head dim 128, theta 5e5, original context 8192; and the
    unscaled ones."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_sat.model.rope import llama3_inv_freq

    scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=2.0, high_freq_factor=8.0,
                   original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=2048, num_attention_heads=16, head_dim=128, max_position_embeddings=131072,
                         rope_parameters=dict(scaling, rope_theta=5e5))
    theirs, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (5e5 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))  # Megatron-Core's unscaled ones
    return dict(ours=llama3_inv_freq(plain, 32.0, 2.0, 8.0, 8192), theirs=theirs, plain=plain,
                attention_factor=attention_factor)


def run(root: str) -> None:
    import json

    from megatron_sat.conversion import ConversionError, export_checkpoint, import_hf

    out = dict(write_llama(os.path.join(root, "hf")), llama32=llama32_frequencies())
    logs = []
    info = import_hf(os.path.join(root, "hf"), os.path.join(root, "import"), [], log=logs.append)
    out.update(import_log=logs, next=info["next"], imported=imported_logits(os.path.join(root, "import")),
               import_config=json.load(open(os.path.join(root, "import", "config.json"))))
    sat = os.path.join(root, "sat")
    import_hf(os.path.join(root, "hf"), sat, ["--arch", "satformer", "--upcycle-gate-std", "0", "--lr", "3e-5",
                                               "--train-iters", "5", "--seq-length", str(SEQ)], log=lambda *a: None)
    out.update(satformer=imported_logits(sat), sat_config=json.load(open(os.path.join(sat, "config.json"))))
    try:
        export_checkpoint(sat, os.path.join(root, "hf_sat"), no_tokenizer=True, log=lambda *a: None)
    except ConversionError as e:
        out["sat_export"] = str(e)
    out["trained"] = train_next_step(info["next"], os.path.join(root, "run"))
    export_checkpoint(os.path.join(root, "run"), os.path.join(root, "hf_run"), no_tokenizer=True, log=lambda *a: None)
    out.update(exported=hf_logits(os.path.join(root, "hf_run")),
               export_config=json.load(open(os.path.join(root, "hf_run", "config.json"))))
    out.update(refused=refusals(root))
    torch.save(out, os.path.join(root, "result.pt"))


def refusals(root: str) -> dict:
    """{case: message} of REFUSED through import_hf (config.json alone: refused before any weight is read), and the
    tool's exit code for a transformers 5.x spelling of yarn (it ends the process group: last)."""
    import json

    from megatron_sat.conversion import ConversionError, import_hf
    from tools.convert_from_hf import main

    out, save = {}, os.path.join(root, "refused")

    def folder(name: str, **rope) -> str:
        path = os.path.join(root, "configs", name)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(dict(LLAMA, model_type="llama", **rope), f)
        return path

    for i, (case, scaling) in enumerate(REFUSED.items()):
        try:
            import_hf(folder(str(i), rope_scaling=scaling), save, [], log=lambda *a: None)
        except ConversionError as e:
            out[case] = str(e)
    yarn = folder("yarn5", rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4))
    out["tool exit"] = main(["--hf", yarn, "--save", save])
    out["written"] = os.path.exists(save)
    return out


def t4(t4_dir: str, out: str, folder: str) -> None:
    """Started beside `run` (its imports overlap the run), it measures the export once `run` has finished."""
    import time

    sys.path.insert(0, t4_dir)  # transformers 4.x (and its tokenizers, huggingface-hub) before the venv's
    import transformers
    from transformers import AutoModelForCausalLM  # noqa: F401 - imported while `run` works

    done = os.path.join(os.path.dirname(folder), "result.pt")
    deadline = time.time() + 600
    while not os.path.isfile(done):
        if time.time() > deadline:
            raise TimeoutError(f"{done} was not written")
        time.sleep(0.2)
    torch.save(dict(version=transformers.__version__, logits=hf_logits(folder)), out)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "t4":
        t4(*sys.argv[2:5])
    else:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        run(sys.argv[2])
