"""The pretraining loop: setup, steps, evaluation, checkpoints, signals, logging.

Per step (every rank):
    forward/backward over num_microbatches = global_batch / (micro_batch x DP) micro-batches
    (Megatron's schedule for the layout, V1 carried across stages: parallel/pipeline.py)
    -> one world all-reduce of [loss sum, token count, stop flag]  (same loss and decision on all ranks)
    -> stop with an error on a NaN/Inf loss (before the optimizer touches the weights)
    -> optimizer step (clipping inside), LR scheduler step
    -> log / evaluate / save; save and exit 0 on SIGTERM/SIGUSR1, --exit-duration-in-mins, --exit-interval.

Before step 1 every input is checked, so that a mistake costs a second, never a run: the layout, the
data (data/checks.py), and what --load holds: the checkpoint to resume (run_folder.py: never a silent
restart from scratch), its files (manifest), and its model against the one asked for.
Exit codes: 0 done or stopped cleanly, 2 bad input (one line that says what to do), 3 NaN/Inf loss,
4 a checkpoint could not be written (the previous one is intact).
"""

import contextlib
import math
import os
import time

import torch

from megatron_sat import compat
from megatron_sat.training.signals import StopSignal


# resolved model fields recorded in config.json (next to the arguments)
MODEL_FIELDS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                "ffn_hidden_size", "normalization", "layernorm_epsilon", "qk_layernorm", "gated_linear_unit",
                "add_bias_linear", "init_method_std", "value_residual_gate", "value_residual_last_k",
                "resformer_lambdas", "mixing_layers", "hc_expansion_rate", "hc_dynamic", "muddformer_param_realloc",
                "params_dtype", "sequence_parallel", "recompute_granularity")


class NonFiniteLoss(RuntimeError):
    pass


def init_distributed() -> None:
    """torch.distributed from torchrun's env, srun's, or a lone process (world size 1)."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env:
        env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"], LOCAL_RANK=env.get("SLURM_LOCALID", "0"))
        env.setdefault("MASTER_ADDR", env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1"))
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    if "RANK" not in env:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend=compat.dist_backend())


def _describe_checkpoint(save):
    from megatron_sat.training.run_folder import checkpoint_dir, latest_iteration

    last = latest_iteration(save) if save and os.path.isdir(save) else None
    return f"{checkpoint_dir(save, last)} (iteration {last})" if last is not None else "none"


def train(args, stop: StopSignal = None) -> int:
    """Run the whole training job; returns the process exit code."""
    stop = stop or StopSignal()
    compat.ensure_cpu_compat()
    t_start = time.time()
    init_distributed()
    from megatron.core import parallel_state
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import Float16Module

    from megatron_sat.analysis.gates import GateTelemetry
    from megatron_sat.model.config import make_config
    from megatron_sat.model.gpt import build_model
    from megatron_sat.model.specs import te_available
    from megatron_sat.parallel.layout import Layout, initialize, validate
    from megatron_sat.profiling.flops import flops_per_token, peak_flops_per_device
    from megatron_sat.training import checkpointing as ckpt
    from megatron_sat.training.arguments import model_config_fields
    from megatron_sat.data.checks import DataError
    from megatron_sat.training.data import build_iterators, tokenizer_and_data
    from megatron_sat.training.run_folder import clean_stale
    from megatron_sat.training.monitor import Monitor
    from megatron_sat.training.step import (build_optimizer, gpt_forward_step, loss_sum_and_count,
                                            run_forward_backward, wrap_ddp)

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    log = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    gpu = torch.cuda.is_available()
    bf16 = gpu if args.bf16 is None else args.bf16
    dist_opt = gpu if args.use_distributed_optimizer is None else args.use_distributed_optimizer
    dtype = torch.bfloat16 if bf16 else torch.float32
    layout = Layout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                    vpp=args.num_virtual_stages_per_pipeline_rank, cp=args.context_parallel_size,
                    sp=args.sequence_parallel)
    backend = {"local": "local", "transformer_engine": "te"}.get(args.transformer_impl) or (
        "te" if te_available() else "local")
    problem = ("--transformer-impl transformer_engine needs Transformer Engine on a GPU"
               if backend == "te" and not te_available() else
               "--fp8-format needs Transformer Engine on a GPU" if args.fp8_format and backend != "te" else None)
    if problem:
        log(f"megatron-sat-train: error: {problem}")
        return 2
    dp = layout.dp(world)
    num_micro = args.global_batch_size // (args.micro_batch_size * dp) if dp else None  # None: validate says why
    recompute = {}
    if args.recompute_granularity == "full":
        recompute = dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        recompute = dict(recompute_granularity="selective")
    try:  # the model config and the layout are checked before any data is prepared
        config = make_config(
            args.arch, num_layers=args.num_layers, hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
            ffn_hidden_size=args.ffn_hidden_size, **model_config_fields(args),
            bf16=bf16, params_dtype=dtype, fp8=args.fp8_format, **layout.config_fields(dtype), **recompute,
        )
        validate(layout, config, world, seq_length=args.seq_length, num_microbatches=num_micro, backend=backend)
    except ValueError as err:  # every rank sees the same error: report it once, build nothing
        log(f"megatron-sat-train: error: {err}")
        return 2
    model_fields = {k: getattr(config, k) for k in MODEL_FIELDS}
    try:  # what --load (or --pretrained-checkpoint) holds, checked before anything is built
        resume, pretrained = _checkpoints_to_load(args, model_fields, log)
        tokenizer, data = tokenizer_and_data(args, log)
    except (ckpt.CheckpointError, DataError) as err:
        log(f"megatron-sat-train: error: {err}")
        return 2
    if resume is not None and resume.iteration >= args.train_iters:
        log(f"nothing to do: {resume.directory} is at iteration {resume.iteration} of --train-iters "
            f"{args.train_iters} (the run is complete; raise --train-iters to train on)")
        return 0
    if rank == 0 and os.path.isdir(args.save):
        stale = clean_stale(args.save)
        if stale:
            log(f"removed what interrupted saves left in {args.save}: {', '.join(stale)}")
    multiple = args.make_vocab_size_divisible_by * layout.tp  # as Megatron-LM: embedding rows split over TP
    vocab_size = -(-tokenizer.vocab_size // multiple) * multiple
    initialize(layout, seed=args.seed)

    # model [chunks] -> (Float16Module) -> DDP; optimizer; scheduler
    chunks = build_model(config, vocab_size=vocab_size, max_sequence_length=args.seq_length,
                         rotary_base=args.rotary_base, backend=backend)
    num_params = sum(p.numel() for c in chunks for p in c.parameters()  # this rank's unique share
                     if not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p))
    if bf16:
        chunks = [Float16Module(config, c) for c in chunks]
    chunks = wrap_ddp(chunks, config, use_distributed_optimizer=dist_opt, overlap_grad_reduce=args.overlap_grad_reduce)
    optimizer = build_optimizer(chunks, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                clip_grad=args.clip_grad, betas=(args.adam_beta1, args.adam_beta2),
                                eps=args.adam_eps, bf16=bf16, use_distributed_optimizer=dist_opt)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters, lr_decay_steps=args.lr_decay_iters or args.train_iters,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters, wd_incr_style="constant")
    iteration, consumed = 0, 0
    loaded = None
    try:
        if resume is not None:
            loaded = ckpt.restore(resume, chunks, optimizer, scheduler)
            iteration, consumed = loaded["iteration"], loaded["consumed_train_samples"]
            saved = loaded["layout"]
            log(f"resumed from {loaded['directory']} (iteration {iteration}, saved at TP{saved['tp']} x "
                f"PP{saved['pp']}{'' if loaded['rng_restored'] else '; RNG state not restored: layout changed'}"
                f"{'' if resume.verified else '; files not verified: no manifest' if args.verify_checkpoint else ''})")
        elif args.load:
            log(f"no checkpoint in {args.load}: starting {'anew' if pretrained else 'from scratch'}")
        if pretrained is not None:  # a resumed run already holds weights that came from it
            directory = ckpt.load_weights(pretrained, chunks)
            optimizer.reload_model_params()  # the optimizer's main (fp32) copies were made from the initial weights
            log(f"initialised from the weights of {directory}: new optimizer state, LR schedule and data order")
    except ckpt.CheckpointError as err:
        log(f"megatron-sat-train: error: {err}")
        return 2
    train_iter, valid_iters = build_iterators(args, tokenizer, data, consumed)

    # per-token FLOPs over global params (num_params above is this rank's share)
    flops_tok = flops_per_token(config, args.seq_length, vocab_size)
    peak = peak_flops_per_device(args.peak_tflops)
    total_params = torch.tensor([float(num_params)], dtype=torch.float64)
    if parallel_state.get_data_parallel_rank() == 0:
        torch.distributed.all_reduce(total_params, group=parallel_state.get_model_parallel_group())
    run_config = dict(vars(args), world_size=world, data_parallel_size=dp, num_microbatches=num_micro,
                      layout=layout.describe(world), vocab_size=vocab_size,
                      tokenizer_vocab_size=tokenizer.vocab_size, bf16=bf16, use_distributed_optimizer=dist_opt,
                      num_parameters=int(total_params.item()), flops_per_token=flops_tok, device=str(compat.device()),
                      data=data, tokenizer=str(getattr(tokenizer, "name", tokenizer)),
                      model=model_fields)
    monitor = Monitor(args, run_config, iteration, resumed=loaded is not None, is_logger=rank == 0)
    log(f"megatron-sat: {args.arch}, {run_config['num_parameters']:,} parameters, {layout.describe(world)}, "
        f"{num_micro} micro-batches x {args.micro_batch_size} x {args.seq_length} tokens per rank, "
        f"{'bf16' if bf16 else 'fp32'} on {world} x {compat.device().type}")
    gates = GateTelemetry(chunks, config.num_layers, compat.device()) if args.arch == "satformer" else None

    def forward_step(data_iterator, model):
        output, loss_func = gpt_forward_step(data_iterator, model)
        if args.debug_inject_nan_at_step == iteration + 1:
            def nan_loss(output_tensor):
                total, count, report = loss_func(output_tensor)
                return total * float("nan"), count, {"lm loss": report["lm loss"] * float("nan")}
            return output, nan_loss
        return output, loss_func

    def evaluate() -> float:
        it = valid_iters()
        if it is None:
            return None
        for c in chunks:
            c.eval()
        total = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad(), (gates.paused() if gates else contextlib.nullcontext()):
            for _ in range(args.eval_iters):
                dicts = run_forward_backward(chunks, optimizer, config, it, num_microbatches=num_micro,
                                             seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                             forward_only=True)
                total += loss_sum_and_count(dicts, compat.device()).cpu()
        for c in chunks:
            c.train()
        return (total[0] / total[1]).item()

    saver = ckpt.Saver(args.save, chunks, optimizer, scheduler, async_save=args.async_save,
                       retain_interval=args.save_retain_interval, log=log,
                       debug_delay_s=args.debug_save_delay, debug_fail_at=args.debug_fail_save_at)

    def save(it):
        saver.save(it, consumed_samples=consumed, args=dict(vars(args)), model=model_fields)
        return it

    last_saved = iteration if loaded else None
    window = dict(time=0.0, steps=0, loss=0.0, grad=0.0)
    val_loss, exit_reason, start_iteration = None, None, iteration
    t_train, step_time_total = time.time(), 0.0
    try:
        while iteration < args.train_iters:
            saver.poll()  # commits an asynchronous save whose files are written
            t0 = time.time()
            dicts = run_forward_backward(chunks, optimizer, config, train_iter, num_microbatches=num_micro,
                                         seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                                         forward_step_func=forward_step)
            timed_out = (args.exit_duration_in_mins is not None and rank == 0
                         and time.time() - t_start > 60 * args.exit_duration_in_mins)
            flag = (1.0 if stop.received else 0.0) + (1000.0 if timed_out else 0.0)  # summed over ranks
            loss_sum, count, flags = loss_sum_and_count(dicts, compat.device(), flag).tolist()
            loss = loss_sum / max(count, 1.0)
            if not math.isfinite(loss):
                raise NonFiniteLoss(f"loss is {loss} at iteration {iteration + 1}")
            lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
            success, grad_norm, _ = optimizer.step()
            if grad_norm is not None and not math.isfinite(grad_norm):
                raise NonFiniteLoss(f"gradient norm is {grad_norm} at iteration {iteration + 1}")
            scheduler.step(increment=1)
            iteration += 1
            consumed += args.global_batch_size
            dt = time.time() - t0
            window["time"] += dt
            step_time_total += dt
            window["steps"] += 1
            window["loss"] += loss
            window["grad"] += grad_norm or 0.0
            monitor.advance()
            if flags > 0:  # 1 per rank that got a signal, 1000 from rank 0 at the time limit
                exit_reason = "signal " + (stop.received or "from another rank") if flags % 1000 \
                    else f"--exit-duration-in-mins {args.exit_duration_in_mins}"
            elif args.exit_interval and iteration % args.exit_interval == 0 and iteration < args.train_iters:
                exit_reason = f"--exit-interval {args.exit_interval}"
            if iteration % args.log_interval == 0 or iteration == args.train_iters or exit_reason:
                step_time = window["time"] / window["steps"]
                tps = args.global_batch_size * args.seq_length / step_time
                record = dict(step=iteration, loss=window["loss"] / window["steps"],
                              lr=lr, grad_norm=window["grad"] / window["steps"],
                              tokens_per_s=tps, mfu=None if peak is None else flops_tok * tps / (peak * world),
                              step_time_s=step_time, consumed_samples=consumed)
                if gates is not None:
                    record.update(gates.collect() or {})
                monitor.log_train(record, eta_s=step_time * (args.train_iters - iteration))
                window = dict(time=0.0, steps=0, loss=0.0, grad=0.0)
            if args.eval_interval and iteration % args.eval_interval == 0 and iteration < args.train_iters:
                val_loss = evaluate()
                if val_loss is not None:
                    monitor.log_eval(iteration, val_loss)
            if exit_reason:
                break
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                last_saved = save(iteration)
        train_time = time.time() - t_train
        if args.save and last_saved != iteration and (args.save_final or exit_reason):
            last_saved = save(iteration)
        saver.finalize()
    except NonFiniteLoss as e:
        monitor.close()
        saver.finalize()  # a pending asynchronous save holds a good step
        log(f"error: {e}; stopping without saving. Last good checkpoint: {_describe_checkpoint(args.save)}")
        return 3
    except ckpt.SaveFailed as e:
        monitor.close()
        log(f"megatron-sat-train: error: {e}")
        return 4
    if exit_reason:
        monitor.close()
        log(f"stopping at iteration {iteration}/{args.train_iters} ({exit_reason}); "
            f"resume with --load {args.save}")
        return 0
    val_loss = evaluate() if (args.eval_interval or args.eval_iters) else None
    if val_loss is not None:
        monitor.log_eval(iteration, val_loss)
    monitor.close()
    steps = iteration - start_iteration
    tps = steps * args.global_batch_size * args.seq_length / max(step_time_total, 1e-9)
    log(f"done: {iteration} steps in {train_time:.0f} s | {tps:,.0f} tokens/s (training steps only) | "
        f"final validation loss "
        f"{'n/a' if val_loss is None else f'{val_loss:.4f}'}")
    if args.save:
        log(f"checkpoint: {_describe_checkpoint(args.save)}\nmetrics: {monitor.metrics_path}\n"
            f"config: {os.path.join(args.save, 'config.json')}")
    return 0


def _checkpoints_to_load(args, model_fields: dict, log):
    """(resume point of --load or None, --pretrained-checkpoint's point or None), each checked against the
    model asked for. CheckpointError (exit 2) names every differing field at once."""
    from megatron_sat.training import checkpointing as ckpt
    from megatron_sat.training.run_folder import model_differences

    def find(root, step=None):
        return ckpt.find_resume_point(root, step, verify=args.verify_checkpoint, fallback=args.ckpt_fallback, log=log)

    def check(point, flag):
        if point is None:
            return None
        differs = model_differences(point.model_fields(), model_fields)
        if differs:
            raise ckpt.CheckpointError(f"{flag} {point.directory} holds another model: {'; '.join(differs)}. Pass the "
                                       "checkpoint's model flags (or its recipe), or a new --save to start afresh")
        return point

    resume = check(find(args.load, args.ckpt_step), "--load") if args.load else None
    if resume is not None or not args.pretrained_checkpoint:
        return resume, None
    pretrained = find(args.pretrained_checkpoint)
    if pretrained is None:
        raise ckpt.CheckpointError(f"--pretrained-checkpoint {args.pretrained_checkpoint} holds no complete checkpoint")
    return None, check(pretrained, "--pretrained-checkpoint")
