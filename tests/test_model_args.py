"""One model description (megatron_sat/model/args.py): ModelArgs is what the trainer's flags, the model config, the
recorded model, the resume check and the conversion's spec are made of, and layer_parameters is the one place the
parameter formulas are written (the planner and sizes.py read it; the built model has what they say).

Unit tests (no process group): a few seconds, plus one subprocess (~10 s) that adds a switch to a copy of the package
as a developer would and follows it everywhere, and fake-world builds (meta device) of every arch at four layouts.
"""

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import asdict, fields

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_sat import compat
from megatron_sat.archs import ARCHS
from megatron_sat.compat import FAKE_BACKEND
from megatron_sat.model import args as model_args
from megatron_sat.model.args import NAMES, RESUME_FIELDS, ModelArgs, chunk_parameters, from_record, record
from megatron_sat.model.config import SATConfig, make_config
from megatron_sat.model.gpt import build_model
from megatron_sat.model.sizes import count_parameters
from megatron_sat.parallel.layout import Layout, destroy, initialize
from megatron_sat.training import planner
from megatron_sat.training.arguments import build_parser
from megatron_sat.training.run_folder import model_differences
from megatron_sat.training.setup import model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_model_args_are_what_the_model_config_takes_and_records():
    """SATConfig = TransformerConfig + exactly ModelArgs' fields it lacks; every ModelArgs field is a config field
    with ModelArgs' value; the record (checkpoints, config.json) is asdict(ModelArgs) of the trainer's flags."""
    transformer = {f.name for f in fields(TransformerConfig)}
    assert {f.name for f in fields(SATConfig)} - transformer == set(NAMES) - transformer
    assert set(NAMES) <= {f.name for f in fields(SATConfig)}
    for argv in ([], ["--arch", "muddformer", "--num-query-groups", "2", "--no-muddformer-param-realloc",
                      "--output-layer-init", "unscaled", "--qk-norm-eps", "1e-6"]):
        args = build_parser().parse_args(argv)
        described = model_args.model_args(args)
        config = model_config(args)
        assert record(config) == asdict(described), "the model config differs from its description"
        assert list(record(config)) == list(NAMES)
        # the derived sizes are resolved as Megatron resolves them
        assert (described.num_query_groups, described.ffn_hidden_size, described.kv_channels) == (
            config.num_query_groups, config.ffn_hidden_size, config.kv_channels)
    # make_config's Llama-style block is ModelArgs' fixed fields
    plain = make_config("transformer", num_layers=2, hidden_size=8, num_attention_heads=2)
    assert record(plain) == asdict(ModelArgs(arch="transformer", num_layers=2, hidden_size=8, num_attention_heads=2))
    assert (plain.normalization, plain.layernorm_epsilon, plain.gated_linear_unit, plain.add_bias_linear) == (
        "RMSNorm", 1e-6, True, False)


def test_flags_are_the_flagged_fields_with_their_defaults():
    """One trainer flag per flagged field, under the field's name, with the field's default; the fixed fields have
    none of their own (Megatron-LM's spelling may check them: training/megatron_lm_flags.py); REQUIRED_SHAPE
    derives from the fields marked required."""
    from megatron_sat.training import arguments

    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for f in model_args.FIELDS:
        if f.metadata["flag"]:
            action = actions[f.name]
            assert f.metadata["flag"] in action.option_strings and action.default == f.default, f.name
            assert action.names_run is f.metadata["names_run"]
        elif f.name in actions:  # a fixed field: only Megatron-LM's spelling, which checks it and sets nothing
            assert actions[f.name].option_strings == [f.metadata["megatron"]], f"{f.name} is fixed but has a flag"
            assert f.name not in model_args.FLAGGED  # model_args(args) never reads it: the model keeps the default
    assert arguments.REQUIRED_SHAPE == ("num_layers", "hidden_size", "num_attention_heads")
    assert model_args.SHAPE == arguments.REQUIRED_SHAPE + ("num_query_groups", "ffn_hidden_size")
    args = parser.parse_args(["--hc-static", "--value-residual-last-k", "2", "--qk-norm-eps", "1e-6"])
    assert (args.hc_dynamic, args.value_residual_last_k, args.qk_norm_eps) == (False, 2, 1e-6)


def test_resume_check_and_legacy_defaults():
    """The fields marked resume are compared (the others may change between runs); a record without a field takes
    LEGACY_DEFAULTS' value (older runs), else today's default; from_record ignores what is not a field."""
    now = record(ModelArgs(num_layers=4))
    assert model_differences(now, now) == []
    assert model_differences(dict(now, num_layers=2), now) == ["num_layers 2 in the checkpoint, 4 now"]
    assert model_differences(dict(now, output_layer_init="unscaled", local_attention="dot_product"), now) == []
    assert {"arch", "num_layers", "kv_channels", "qk_norm_eps", "normalization"} <= set(RESUME_FIELDS)
    assert not {"value_residual_gate_impl", "output_layer_init", "local_attention", "init_method_std"} & set(
        RESUME_FIELDS)
    old = {k: v for k, v in now.items() if k != "qk_norm_eps"}
    assert model_differences(old, now) == ["qk_norm_eps 1e-06 in the checkpoint, 1e-05 now"]
    assert from_record(dict(old, seed=3, world_size=8)).qk_norm_eps == 1e-6
    assert from_record({"arch": "resformer", "num_query_groups": None, "hidden_size": 32}).num_query_groups == 4
    assert from_record(vars(build_parser().parse_args(["--arch", "transformer"]))) == ModelArgs(
        arch="transformer", qk_norm_eps=1e-5)


def test_no_other_list_names_model_fields():
    """By construction, adding a field is one edit: no module of the package (nor a tool) writes three or more model
    field names in one tuple, list or set literal (the hand lists that ModelArgs replaced)."""
    names = set(NAMES)
    found = []
    for top in ("megatron_sat", "tools"):
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                path = os.path.join(folder, name)
                if not name.endswith(".py") or path.endswith(os.path.join("model", "args.py")) or "hf_code" in path:
                    continue
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                        listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                        if len(listed) >= 3:
                            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {listed}")
    assert not found, "hand lists of model fields:\n" + "\n".join(found)


DUMMY_FIELD = '''    dummy_switch: bool = model_field(False, flag="--dummy-switch", help="a switch added by a test")
'''

FOLLOW_THE_SWITCH = textwrap.dedent('''
    import sys
    from types import SimpleNamespace

    from megatron_sat.conversion.megatron_io import EMBEDDING_KEY, spec_from_args
    from megatron_sat.conversion.importer import SHAPE_FLAGS
    from megatron_sat.model.args import record
    from megatron_sat.model.config import make_config
    from megatron_sat.training.arguments import build_parser
    from megatron_sat.training.config_file import config_dict
    from megatron_sat.training.run_folder import model_differences
    from megatron_sat.training.setup import model_config

    parser = build_parser()
    assert "--dummy-switch" in parser.format_help(), "no flag"
    args = parser.parse_args(["--dummy-switch"])
    config = model_config(args)
    assert config.dummy_switch is True, "not in the model config"
    recorded = record(config)  # what the trainer writes into config.json's "model" and every checkpoint
    assert recorded["dummy_switch"] is True, "not recorded"
    assert config_dict(args, parser)["dummy_switch"] is True, "not in config.json's arguments"
    assert model_differences(dict(recorded, dummy_switch=False), recorded) == [
        "dummy_switch False in the checkpoint, True now"], "not checked on resume"
    metadata = {EMBEDDING_KEY: SimpleNamespace(global_shape=(128, args.hidden_size))}
    spec = spec_from_args(vars(args), metadata)
    assert spec.dummy_switch is True, "not in the export spec"
    assert make_config(**record(spec)).dummy_switch is True, "not in the model the converter builds"
    assert "dummy_switch" in SHAPE_FLAGS, "the importer does not take it from the HF model"
    print("the switch reached everything")
''')


def test_one_field_reaches_every_part(tmp_path):
    """A developer adds a switch as one field of ModelArgs (a copy of the package with that one line more): it
    reaches the trainer's flags, the model config, the record in config.json and checkpoints, the resume check,
    the conversion's spec and the model the converter builds, with no other edit."""
    copy = tmp_path / "src"
    for top in ("megatron_sat", "recipes"):
        shutil.copytree(os.path.join(ROOT, top), copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    path = copy / "megatron_sat" / "model" / "args.py"
    source = path.read_text()
    anchor = "    # the paper's Llama-style block"
    assert anchor in source
    path.write_text(source.replace(anchor, DUMMY_FIELD + anchor, 1))
    env = dict(os.environ, PYTHONPATH=str(copy))
    proc = subprocess.run([sys.executable, "-c", FOLLOW_THE_SWITCH], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "reached everything" in proc.stdout, proc.stdout + proc.stderr[-3000:]


# every arch at layouts (tp, pp, vpp) of a 4-layer, 4-head model; SATFormer's fused gate pads by TP size
LAYOUTS = [(1, 1, None), (2, 2, None), (1, 2, 2), (4, 1, None)]
SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
VOCAB = 256


def _config(arch, layout=None):
    return make_config(arch, **SHAPE, **(layout.config_fields(torch.float32) if layout else {}))


# the published shapes' head dim is not hidden / heads (Qwen3-0.6B: 1024 hidden, 16 heads of 128, 8 KV groups):
# half of it here, with grouped KV, so that a count that takes hidden / heads (or heads for groups) is off
HEAD_SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=32,
                  ffn_hidden_size=96)


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_counts_hold_when_the_head_dim_is_not_hidden_over_heads(arch):
    """sizes.count_parameters and the planner's stage at TP1 and TP2 equal the built model's parameters for a
    head dim of 32 != 64 / 4 with 2 KV groups."""
    compat.ensure_cpu_compat()
    try:
        for tp in (1, 2):
            layout = Layout(tp=tp)
            cfg = make_config(arch, **HEAD_SHAPE, **layout.config_fields(torch.float32))
            stages = planner.stage_estimates(cfg, layout, dp=1, micro_batch_size=1, num_microbatches=1, seq_length=8,
                                             vocab_size=VOCAB, bf16=False, distributed_optimizer=False,
                                             recompute=None, backend="local")
            sizes = count_parameters(make_config(arch, **HEAD_SHAPE), VOCAB, tp=tp)["total"]
            unique = 0.0
            for rank in range(tp):
                destroy()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
                torch.distributed.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=tp)
                initialize(layout, seed=1)
                with compat.meta_device():
                    chunks = build_model(cfg, vocab_size=VOCAB, max_sequence_length=8, backend="local")
                built = sum(p.numel() for c in chunks for p in c.parameters())
                assert built == stages[0]["params"], f"{arch} TP{tp} rank {rank}: built {built}, planner {stages[0]}"
                unique += sum(p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / tp
                              for c in chunks for p in c.parameters())
            assert unique == sizes, f"{arch} TP{tp}: built {unique}, sizes {sizes}"
    finally:
        destroy()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("arch", ARCHS)
def test_planner_parameters_are_sizes_parameters_and_the_built_models(arch):
    """At every layout: each rank built (fake process group, meta device) holds the planner's parameters for its
    stage, and the ranks' parameters (TP-split ones once, replicated ones once, the tied output copy left out) are
    sizes.count_parameters' total at that TP size; at TP1 the planner's stages add up to it too."""
    compat.ensure_cpu_compat()
    try:
        for tp, pp, vpp in LAYOUTS:
            layout = Layout(tp=tp, pp=pp, vpp=vpp)
            cfg = _config(arch, layout)
            stages = planner.stage_estimates(cfg, layout, dp=1, micro_batch_size=1, num_microbatches=4, seq_length=8,
                                             vocab_size=VOCAB, bf16=False, distributed_optimizer=False,
                                             recompute=None, backend="local")
            sizes = count_parameters(_config(arch), VOCAB, tp=tp)["total"]
            copies = (pp > 1) * VOCAB * SHAPE["hidden_size"] + (pp * (vpp or 1) - 1) * chunk_parameters(cfg)
            if tp == 1:  # less the tied output layer's copy and every chunk's copy of ResFormer's lambda1 but one
                assert sum(s["params"] for s in stages) - copies == sizes
            unique = 0.0
            for rank in range(tp * pp):
                destroy()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
                torch.distributed.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=tp * pp)
                initialize(layout, seed=1)
                with compat.meta_device():
                    chunks = build_model(cfg, vocab_size=VOCAB, max_sequence_length=8, backend="local")
                stage = rank // tp  # Megatron's rank order: TP fastest, then (DP 1) PP
                where = f"{arch} TP{tp} PP{pp} VPP{vpp} rank {rank}"
                assert sum(p.numel() for c in chunks for p in c.parameters()) == stages[stage]["params"], where
                for v, chunk in enumerate(chunks):
                    for name, p in chunk.named_parameters():
                        if (getattr(p, "shared_embedding", False) and stage == pp - 1 and pp > 1
                                or "value_residual_lambdas" in name and (stage, v) != (0, 0)):
                            continue  # a copy: of the word embedding (tied output layer), of ResFormer's lambda1
                        unique += p.numel() if getattr(p, "tensor_model_parallel", False) else p.numel() / tp
            assert unique == sizes, f"{arch} TP{tp} PP{pp} VPP{vpp}: built {unique}, sizes {sizes}"
    finally:
        destroy()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
