"""Bring your own arch (docs/architectures.md): a seventh arch is one module, and with no edit elsewhere it trains,
resumes, plans, dry-runs at TP2 x PP2, exports to Hugging Face (loaded by transformers, its config.json keys
written), imports back and appears in collect_grid.

The arch (SEVENTH below): SATFormer whose gate starts at layer 3 (layer 2 adds no V1), dropped into a copy of the
package as megatron_sat/archs/satformer3.py, as a developer would. Every step is the real tool in a subprocess
of that copy (`pytest -k seventh_arch`; about 2 minutes on an idle 2-core machine).
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # a dozen tool launches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SEVENTH = textwrap.dedent('''
    """SATFormer with the gate from layer 3: V1 from layer 1, mixed through the learned gate into layers 3..L."""

    from megatron_sat.archs.registry import register
    from megatron_sat.archs.satformer import SATFormer


    class SATFormer3(SATFormer):
        name = "satformer3"
        title = "SATFormer (gate from layer 3)"
        colour = "#17BECF"

        def mixing_layers(self, model):
            k = model.value_residual_last_k
            start = 3 if k is None else max(3, model.num_layers - k + 1)
            return list(range(start, model.num_layers + 1))

        def layout_errors(self, config):
            return [] if config.num_layers >= 3 else [f"satformer3 needs num_layers >= 3 (got {config.num_layers})"]

        def hf_config(self, spec, decoder, remote):  # the authors' code mixes the last k layers
            return dict(super().hf_config(spec, decoder, remote), value_residual_last_k=len(self.mixing_layers(spec)))

        def hf_extra_fields(self, cfg, need):
            return dict(super().hf_extra_fields(cfg, need), value_residual_last_k=None)


    ARCH = register(SATFormer3())
''')

FLAGS = ["--recipe", "debug_satformer3", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
         "--save-interval", "2"]

LOAD_IN_TRANSFORMERS = textwrap.dedent('''
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32)
    out = model(torch.arange(12).view(1, 12) % 256).logits
    mixing = [i + 1 for i, layer in enumerate(model.model.layers)
              if getattr(layer.attn, "value_residual_mixing", None) is not None]
    print(json.dumps(dict(shape=list(out.shape), finite=bool(torch.isfinite(out).all()), mixing=mixing)))
''')


def run(copy, *argv, timeout=300, expect=0, stderr=False):
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=copy, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(copy)))
    assert proc.returncode == expect, " ".join(map(str, argv)) + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + (proc.stderr if stderr else "")


def test_seventh_arch_end_to_end(tmp_path):
    copy = tmp_path / "src"
    for top in ("megatron_sat", "recipes", "tools"):
        shutil.copytree(os.path.join(ROOT, top), copy / top, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "megatron_sat" / "archs" / "satformer3.py").write_text(SEVENTH)
    runs = tmp_path / "runs"
    first, second = runs / "seed1", runs / "seed2"

    # the registry finds it, and the model, the parameter count and the FLOPs ask it
    facts = json.loads(run(copy, "-c", textwrap.dedent('''
        import json
        from megatron_sat import archs
        from megatron_sat.model.args import ModelArgs, model_parameters
        from megatron_sat.model.flops import flops_breakdown
        m = ModelArgs(arch="satformer3", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2)
        s = ModelArgs(**dict(vars(m), arch="satformer"))
        print(json.dumps(dict(archs=archs.ARCHS, mixing=m.mixing_layers, vr=m.uses_value_residual,
                              gate=[model_parameters(x, 256)["value_residual"] for x in (m, s)],
                              flops=[flops_breakdown(x, 32, 256)["gate"] for x in (m, s)])))
    ''')))
    assert facts["archs"][-1] == "satformer3" and facts["mixing"] == [3, 4] and facts["vr"]
    assert facts["gate"] == [2 * 2 * 64, 3 * 2 * 64]  # W_alpha [ng, h] in layers 3, 4 against 2..4
    assert facts["flops"][0] * 3 == facts["flops"][1] * 2

    # train 2 steps, resume to 4; a second seed for the grid
    run(copy, "-m", "megatron_sat.train", *FLAGS, "--train-iters", "4", "--exit-interval", "2", "--save", first)
    run(copy, "-m", "megatron_sat.train", *FLAGS, "--train-iters", "4", "--save", first, "--load", first)
    metrics = [json.loads(line) for line in open(first / "metrics.jsonl")]
    assert max(r["step"] for r in metrics if "loss" in r) == 4
    assert json.load(open(first / "config.json"))["arch"] == "satformer3"
    run(copy, "-m", "megatron_sat.train", *FLAGS, "--train-iters", "4", "--seed", "7", "--save", second)

    # plan and dry run at TP2 x PP2
    plan = run(copy, "tools/plan_layout.py", *FLAGS[:2], "--nodes", "1", "--gpus-per-node", "4",
               "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert "satformer3" in plan
    # The dry run builds the arch and checks the plan. Known planner gap at this size without this arch too
    # (docs/status.md): at TP2 x PP2 the debug recipes' first stage keeps 3-5% less than planned (transformer -4.77%,
    # resformer -4.73%, denseformer -4.48%, muddformer -3.38%, SATFormer with --value-residual-last-k 2 -4.87%), and
    # the dry run stops at that first rank. When the planner is fixed this fails: then expect 0 here.
    dry = run(copy, "tools/dry_run.py", *FLAGS[:2], "--nodes", "1", "--gpus-per-node", "4",
              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", expect=1, stderr=True)
    assert "dry run debug_satformer3: TP2xPP2xDP1 = 4 ranks" in dry and "layers 1-2" in dry, dry
    failures = {line.strip() for line in dry.splitlines() if "FAILED" in line}
    assert failures and all("rank 0 (PP 0, TP 0): saved activations per micro-batch" in f and "(-4.87%" in f
                            for f in failures), dry

    # export, load in transformers, import back
    hf = tmp_path / "hf"
    run(copy, "tools/convert_to_hf.py", "--load", first, "--output", hf, "--no-tokenizer", "--verify")
    cfg = json.load(open(hf / "config.json"))
    assert (cfg["model_type"], cfg["megatron_sat_arch"], cfg["value_residual_last_k"]) == ("SATFormer", "satformer3", 2)
    assert (hf / "modeling_satformer3.py").is_file() and (hf / "configuration_satformer3.py").is_file()
    loaded = json.loads(run(copy, "-c", LOAD_IN_TRANSFORMERS, hf).splitlines()[-1])
    assert loaded == dict(shape=[1, 12, 256], finite=True, mixing=[3, 4])
    back = tmp_path / "back"
    run(copy, "tools/convert_from_hf.py", "--hf", hf, "--save", back)
    assert json.load(open(back / "config.json"))["arch"] == "satformer3"

    # both runs in the grid, coloured as the arch module says
    out = tmp_path / "grid"
    run(copy, "tools/collect_grid.py", runs, "--out", out)
    table = (out / "grid.csv").read_text()
    assert table.count("satformer3") >= 2, table
