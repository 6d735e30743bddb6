"""lm-eval model backend `megatron_sat`: this project's Megatron model, any of the six archs, scored
straight from a dist checkpoint or on the model being trained, with no Hugging Face export.

    python tools/evaluate.py --checkpoint runs/denseformer --suite zeroshot --output evals/denseformer-z
    python tools/evaluate.py --checkpoint runs/satformer/iter_0001000 --tasks megatron_sat_tiny_mc \\
        --include-path tests/data/eval --device cpu --batch-size 4

In Python: importing this module registers the backend with lm-eval, so
    lm_eval.simple_evaluate(model="megatron_sat", model_args={"checkpoint": "runs/x"}, tasks=[...])
works; the trainer's --eval-tasks passes an instance built on its own model (model=..., tokenizer=...).

What it computes, request by request, as lm-eval's own HF backend (models/huggingface.py) does, so the
scores of a checkpoint equal those of its export:
  loglikelihood          (context + continuation)[-(max_length + 1):][:-1] in, the continuation's log-probs
                         summed and whether each of its tokens is the argmax. Batched: rows sorted by length,
                         padded on the right (the model is causal: no position sees the padding after it).
  loglikelihood_rolling  lm-eval's disjoint rolling windows of max_length tokens, summed.
  generate_until         greedy only (do_sample false / temperature 0, else refused), until the stop strings
                         or max_gen_toks; the context left-truncated to max_length - max_gen_toks. There is NO
                         KV cache: every new token reruns the whole padded batch (recomputation), which costs
                         about max_gen_toks full forwards per batch (48 for the retrieval suite's based_* tasks;
                         fine on a GPU, slow on a CPU for long contexts). Each row decodes independently of the
                         padding: its next token is read at its own last position.

Layouts: a checkpoint saved at any TP/PP/VPP is loaded at TP1/PP1 in one process (the converter's
megatron_io reshards it), or at TP N under `torchrun --nproc-per-node N` (tensor_parallel=N; PP1; every
rank scores every request). On a model built by the trainer, any TP (vocab-parallel logits are gathered
over the tensor-parallel group; sequence-parallel inputs padded to a multiple of TP) with PP1 and CP1;
every data-parallel replica scores every request (the trainer refuses PP > 1 and CP > 1 for --eval-tasks).
"""
# ruff: noqa: E402  (megatron-core is imported after quiet(), below)

import os
import sys
from typing import List, Optional, Sequence, Tuple

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from megatron_sat.compat.known_warnings import quiet

# plain `lm_eval --model megatron_sat` comes in here: the known harmless warnings (compat/known_warnings.py) are
# filtered before megatron-core is imported, which warns at import (hence the imports below this call)
quiet()
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_sat.analysis.lm_eval_registration import MODEL_ARGS
from megatron_sat.conversion import megatron_io
from megatron_sat.conversion.mapping import ConversionError
from megatron_sat.data import load_tokenizer
from megatron_sat.model.gpt import build_model
from megatron_sat.parallel.layout import Layout, initialize
from megatron_sat.parallel.process_group import init_from_env
from megatron_sat.parallel.world import world_from_env
from megatron_sat.training import run_paths
from megatron_sat.training.arguments import build_parser
from megatron_sat.training.setup import described_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_checkpoint_model(path: str, dtype: str = "auto", tensor_parallel: int = 1, verify: bool = True):
    """(model, HF tokenizer, max length) of a trainer checkpoint (run folder or iter_XXXXXXX), any arch, at TP1/PP1
    in one process, or at TP `tensor_parallel` with as many processes (torchrun; this rank's shard).

    The model is built from the arguments the trainer recorded in the checkpoint, read as the converter reads them
    (megatron_io.spec_from_args: model/args.py's from_record) and built as the trainer builds it
    (training/setup.py), so every arch and switch the trainer knows loads here. Its files are
    checked against its manifest first (megatron_io.find_checkpoint; verify=False: --no-verify-checkpoint)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ConversionError(f"unknown dtype {dtype!r}; choose auto or one of {', '.join(DTYPES)}")
    iter_dir, run_dir = megatron_io.find_checkpoint(path, verify=verify)
    if tensor_parallel == 1:
        megatron_io.init_single_process()
    else:
        _init_tensor_parallel(tensor_parallel)
    recorded, run_config = megatron_io.recorded_config(iter_dir, run_dir)
    metadata = megatron_io.tensor_metadata(iter_dir)
    if megatron_io.EMBEDDING_KEY not in metadata:
        raise ConversionError(f"{iter_dir} has no {megatron_io.EMBEDDING_KEY}: not a megatron_sat model checkpoint")
    spec = megatron_io.spec_from_args(recorded, metadata)  # the converter's reading of the recorded arguments
    params_dtype = DTYPES.get(dtype) or metadata[megatron_io.EMBEDDING_KEY].dtype
    layout = Layout(tp=tensor_parallel)
    initialize(layout, seed=recorded.get("seed", build_parser().get_default("seed")))
    config = described_config(spec, layout, params_dtype)
    if spec.vocab_size % tensor_parallel:
        raise ConversionError(f"the checkpoint's vocabulary ({spec.vocab_size} rows) does not split over TP "
                              f"{tensor_parallel}")
    model = build_model(config, vocab_size=spec.vocab_size, max_sequence_length=spec.max_position_embeddings,
                        backend="local", rotary_base=spec.rotary_base, share_embeddings_and_output_weights=spec.tied)[0]
    megatron_io.load_weights(model, iter_dir, metadata)
    try:  # from any working folder (training/run_paths.py)
        source = run_paths.find_tokenizer(recorded, run_config, run_dir)
    except run_paths.TokenizerNotFound as e:
        raise ConversionError(f"{iter_dir}: {e}: lm-eval needs it to turn text into tokens; copy it back there") \
            from None
    if source is None:
        raise ConversionError(f"{iter_dir} records no tokenizer (trained on mock data): lm-eval needs one to turn "
                              "text into tokens")
    try:
        tokenizer = load_tokenizer(source).hf
    except (OSError, ValueError) as e:
        raise ConversionError(f"the run's tokenizer {source} cannot be loaded ({str(e).splitlines()[0]})") from None
    return model.eval(), tokenizer, spec.max_position_embeddings


def _init_tensor_parallel(tp: int) -> None:
    """The process group of a torchrun (or srun) launch of exactly `tp` processes (ConversionError otherwise)."""
    world = world_from_env()
    if world != tp:
        raise ConversionError(f"tensor parallel size {tp} needs exactly {tp} processes (torchrun --nproc-per-node "
                              f"{tp}); this launch has {world}")
    init_from_env()


@register_model("megatron_sat")
class MegatronLM(TemplateLM):
    """lm-eval LM on a megatron_sat GPT model (see the module docstring).

    checkpoint: a trainer run folder or iter_XXXXXXX folder (built at TP1/PP1 here, or at TP tensor_parallel
    under torchrun with that many processes, each scoring every request; its manifest checked unless
    verify_checkpoint=False), or
    model + tokenizer: a built model chunk (PP1; DDP-wrapped or not) and an HF tokenizer, with max_length.
    """

    def __init__(self, checkpoint: Optional[str] = None, batch_size=1, max_length: Optional[int] = None,
                 dtype: str = "auto", max_gen_toks: int = 256, device=None, tensor_parallel: int = 1, *, model=None,
                 tokenizer=None, verify_checkpoint: bool = True, max_batch_size=None, trust_remote_code=None,
                 **unknown):
        # device, max_batch_size, trust_remote_code: what lm-eval's CLI passes to every backend; unused here
        if unknown:  # lm_eval_registration.MODEL_ARGS lists these arguments for the command line
            raise ValueError(f"megatron_sat: unknown model argument(s) {', '.join(sorted(unknown))}; it takes "
                             f"{', '.join(MODEL_ARGS)}")
        super().__init__()
        if model is None:
            if not checkpoint:
                raise ValueError("megatron_sat needs checkpoint=RUN_DIR (or a model and a tokenizer)")
            try:
                model, tokenizer, seq_length = load_checkpoint_model(checkpoint, dtype, int(tensor_parallel),
                                                                     verify=verify_checkpoint)
            except ConversionError as e:
                if _on_command_line():  # lm-eval's command line (lm_eval, megatron-sat-evaluate run):
                    print(f"error: --model_args checkpoint={checkpoint}: {e}", file=sys.stderr)  # one line, not
                    raise SystemExit(2) from None  # lm-eval's traceback around it; from Python: the exception
                raise
            max_length = max_length or seq_length
        if tokenizer is None or not max_length:
            raise ValueError("megatron_sat: a model needs its tokenizer and max_length")
        self.model, self.tokenizer, self.max_length = model, tokenizer, int(max_length)
        self.batch_size = 8 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.checkpoint = checkpoint
        self._device = next(model.parameters()).device

    # ---- tokens ---------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "megatron_sat").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> List[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- the model --------------------------------------------------------------------------------
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[b, s] token ids -> [b, s, vocab] logits over the full (padded) vocabulary, in the model's dtype."""
        b, s = tokens.shape
        tp = parallel_state.get_tensor_model_parallel_world_size()
        width = s + (-s) % tp  # sequence parallelism splits the sequence over TP ranks
        padded = torch.zeros(b, width, dtype=torch.long, device=self._device)
        padded[:, :s] = tokens
        position_ids = torch.arange(width, device=self._device)[None].expand(b, width)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                out = self.model(padded, position_ids, None)  # [b, width, vocab / tp]
                if tp > 1:
                    out = gather_from_tensor_model_parallel_region(out)  # [b, width, vocab]
        finally:
            self.model.train(was_training)
        return out[:, :s]

    def _batches(self, n: int, lengths: Sequence[int]):
        """Index batches, longest first (fewer padded positions), batch_size rows each."""
        order = sorted(range(n), key=lambda i: -lengths[i])
        for start in range(0, n, self.batch_size):
            yield order[start:start + self.batch_size]

    def _right_padded(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        out = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return out.to(self._device)  # [b, s]

    # ---- lm-eval requests -------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> List[Tuple[float, bool]]:
        inputs, conts = [], []
        for _, context_enc, continuation_enc in requests:
            whole = (list(context_enc) + list(continuation_enc))[-(self.max_length + 1):]
            inputs.append(whole[:-1])
            conts.append(list(continuation_enc))
        results: List[Optional[Tuple[float, bool]]] = [None] * len(requests)
        for batch in self._batches(len(requests), [len(x) for x in inputs]):
            logits = self.logits(self._right_padded([inputs[i] for i in batch]))  # [b, s, vocab]
            for row, i in enumerate(batch):
                n, cont = len(inputs[i]), torch.tensor(conts[i], dtype=torch.long, device=logits.device)
                scores = logits[row, n - len(cont):n].float().log_softmax(-1)  # [len(cont), vocab]
                picked = scores.gather(-1, cont[:, None])[:, 0]
                results[i] = (float(picked.sum()), bool((scores.argmax(-1) == cont).all()))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owner = [], []
        for k, req in enumerate(requests):
            (string,) = req.args
            for window in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *window))
                owner.append(k)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for k, (logp, _) in zip(owner, scores):
            totals[k] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, settings = [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ValueError("the megatron_sat backend decodes greedily only (do_sample: false)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise ValueError(f"max_gen_toks {max_gen_toks} must be below the model's max_length {self.max_length}")
            prompts.append(self.tok_encode(context)[-(self.max_length - max_gen_toks):])
            settings.append((until, max_gen_toks))
        outputs: List[Optional[str]] = [None] * len(requests)
        for batch in self._batches(len(requests), [len(p) for p in prompts]):
            for i, text in zip(batch, self._greedy([prompts[i] for i in batch], [settings[i] for i in batch])):
                outputs[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    def _greedy(self, prompts: List[List[int]], settings) -> List[str]:
        """Greedy continuations of a batch, recomputing the whole padded batch for every new token."""
        rows = [list(p) for p in prompts]
        generated: List[List[int]] = [[] for _ in rows]
        done = [False] * len(rows)
        while not all(done):
            active = [r for r in range(len(rows)) if not done[r]]  # finished rows leave the batch
            logits = self.logits(self._right_padded([rows[r] for r in active]))  # [active, s, vocab]
            for k, r in enumerate(active):
                row = rows[r]
                token = int(logits[k, len(row) - 1].float().argmax())
                row.append(token)
                generated[r].append(token)
                until, max_gen_toks = settings[r]
                text = self.tok_decode(generated[r])
                done[r] = (token == self.eot_token_id or len(generated[r]) >= max_gen_toks
                           or any(s and s in text for s in until))
        out = []
        for tokens, (until, _) in zip(generated, settings):
            if self.eot_token_id in tokens:
                tokens = tokens[:tokens.index(self.eot_token_id)]
            out.append(postprocess_generated_text(self.tok_decode(tokens), until, None))
        return out


def _on_command_line() -> bool:
    """Whether lm-eval's command line runs this process (plain `lm_eval`, `python -m lm_eval`, or
    megatron-sat-evaluate's lm-eval form), where a bad checkpoint is one line and exit 2; a Python caller (tools/
    evaluate.py's own form, a notebook) gets the exception."""
    cli = sys.modules.get("megatron_sat.analysis.lm_eval_cli")
    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    return (getattr(cli, "RUNNING", False) or os.path.basename(sys.argv[0] or "") in ("lm_eval", "lm-eval")
            or (main is not None and main.name.split(".")[0] == "lm_eval"))
