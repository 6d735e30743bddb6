"""Worker for tests/test_evaluate.py::test_checkpoint_backend (one rank, through dist_utils.run_distributed).

    check_all_archs(root)  per arch (all six): a tiny trainer checkpoint with random weights and the word-level
                           tokenizer recorded; the megatron_sat lm-eval backend built from it answers
                           loglikelihood (batched, right-padded), loglikelihood_rolling and generate_until
                           requests, compared with direct unpadded full-sequence forwards of the model that was
                           saved; then tools/evaluate.py --checkpoint on the local tasks (tests/data/eval), and for
                           the archs with an HF format, the same tasks on their export through lm-eval's HF backend.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from conversion import SIZES, VOCAB, write_tokenizer  # noqa: E402

TASKS_DIR = os.path.join(os.path.dirname(HERE), "data", "eval")
TASKS = ["megatron_sat_tiny_mc", "megatron_sat_tiny_gen"]
LL_REQUESTS = [([5, 9, 13], [7]), ([3, 4, 5, 6, 7, 8, 9, 10], [11, 12]), ([20], [21, 22, 23]),
               ([0] * 40, [30, 31])]  # the last one is longer than seq_length (32): left-truncated
ROLLING = [40 + i % 60 for i in range(45)]  # two windows of 32
GEN_PROMPTS = [[2, 3, 4], [10, 11, 12, 13, 14, 15]]
GEN_TOKENS = 5


def _model(arch: str, tok: str):
    """(args, model, trainer chunks, optimizer, scheduler): the trainer's build at TP1, random weights."""
    from conversion import _wrap

    from megatron_sat.model.gpt import build_model
    from megatron_sat.parallel.layout import Layout, initialize
    from megatron_sat.training.arguments import build_parser
    from megatron_sat.training.setup import model_config

    args = build_parser().parse_args(SIZES + ["--arch", arch, "--tokenizer-model", tok])
    initialize(Layout(), seed=args.seed)
    config = model_config(args)
    chunks = build_model(config, vocab_size=VOCAB, max_sequence_length=args.seq_length, rotary_base=args.rotary_base)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    model = chunks[0]
    chunks, opt, sched = _wrap(config, chunks, args)
    return args, model, chunks, opt, sched


def _logp(model, tokens):
    """[len, vocab] log-probs of one unpadded sequence, a full forward."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)  # [1, s, vocab]
    return logits[0].float().log_softmax(-1)


def _references(model, seq: int):
    model.eval()
    ll = []
    for ctx, cont in LL_REQUESTS:
        whole = (ctx + cont)[-(seq + 1):]
        logp = _logp(model, whole[:-1])[-len(cont):]
        ll.append((sum(logp[i, t].item() for i, t in enumerate(cont)),
                   all(logp[i].argmax().item() == t for i, t in enumerate(cont))))
    rolling = 0.0  # window 1: eot + the first 31 tokens predicts 32; window 2: the last 32 tokens' context
    first = _logp(model, [0] + ROLLING[:seq - 1])
    rolling += sum(first[i, t].item() for i, t in enumerate(ROLLING[:seq]))
    rest = ROLLING[seq:]
    second = _logp(model, ROLLING[len(ROLLING) - seq - 1:-1])[-len(rest):]
    rolling += sum(second[i, t].item() for i, t in enumerate(rest))
    greedy = []
    for prompt in GEN_PROMPTS:
        row, out = list(prompt), []
        for _ in range(GEN_TOKENS):
            token = _logp(model, row)[-1].argmax().item()
            if token == 0:
                break
            row.append(token)
            out.append(token)
        greedy.append(out)
    return ll, rolling, greedy


class _Req:
    def __init__(self, *args):
        self.args = args


def check_all_archs(root: str) -> dict:
    from lm_eval.api.registry import get_model
    from lm_eval.models.huggingface import HFLM

    from megatron_sat.analysis.evaluation import evaluate
    from megatron_sat.analysis.lm_eval_backend import MegatronLM
    from megatron_sat.conversion import export_checkpoint
    from megatron_sat.conversion.mapping import CONVERTIBLE
    from megatron_sat.training.checkpointing import save_checkpoint
    from tools.evaluate import main as evaluate_cli

    tok = os.path.join(root, "tok", "tokenizer.json")
    write_tokenizer(tok)
    quiet = lambda *a, **k: None  # noqa: E731
    out = {"registered": get_model("megatron_sat") is MegatronLM}
    for arch in ("transformer", "resformer", "satformer", "denseformer", "muddformer", "hyperconnections"):
        args, model, chunks, opt, sched = _model(arch, tok)
        run = os.path.join(root, arch)
        save_checkpoint(run, 1, chunks, opt, sched, consumed_samples=2, args=vars(args))
        ll_ref, rolling_ref, greedy_ref = _references(model, args.seq_length)

        lm = MegatronLM(checkpoint=run, batch_size=3)
        ll = lm._loglikelihood_tokens([(None, c, t) for c, t in LL_REQUESTS])
        rolling = lm.loglikelihood_rolling([_Req(" ".join(f"w{t - 2}" for t in ROLLING))])[0]
        words = lambda ids: " ".join(f"w{t - 2}" for t in ids)  # noqa: E731 (token id t is the word w{t-2})
        gen_requests = [_Req(words(p), {"until": ["never"], "max_gen_toks": GEN_TOKENS, "do_sample": False})
                        for p in GEN_PROMPTS]
        gens = lm.generate_until(gen_requests)
        text_requests = [_Req(words(c), " " + words(t)) for c, t in LL_REQUESTS[:3]] + [_Req("", words([50, 51]))]
        res = dict(ll=ll, ll_ref=ll_ref, rolling=rolling, rolling_ref=rolling_ref, gens=gens,
                   gens_ref=[lm.tokenizer.decode(g) for g in greedy_ref])
        if arch == "denseformer":  # the command line, once
            code = evaluate_cli(["--checkpoint", run, "--tasks", *TASKS, "--include-path", TASKS_DIR, "--device",
                                 "cpu", "--batch-size", "2", "--output", os.path.join(root, "eval_" + arch)])
            res["cli_code"] = code
            res["scores"] = json.load(open(os.path.join(root, "eval_" + arch, "results.json")))["table"]
        else:
            res["scores"] = evaluate(None, TASKS, checkpoint=run, include_paths=[TASKS_DIR], batch_size=2,
                                     log=quiet)["table"]
        if arch in CONVERTIBLE:
            hf = os.path.join(root, arch + "_hf")
            export_checkpoint(run, hf, log=quiet)
            res["hf_scores"] = evaluate(hf, TASKS, include_paths=[TASKS_DIR], batch_size=2, log=quiet)["table"]
            hflm = HFLM(pretrained=hf, trust_remote_code=True, dtype="float32", batch_size=2, device="cpu")
            res["hf_gens"] = hflm.generate_until(gen_requests)
            res["hf_ll"] = hflm.loglikelihood(text_requests)
            res["text_ll"] = lm.loglikelihood(text_requests)
        out[arch] = res
    return out
