"""Every shell command in README.md and docs/*.md, and what the tests do with it (tests/test_docs_commands.py).

`commands()` reads each page's shell code: fenced blocks (```bash, sh, shell, console or none-but-commands) and
indented blocks, one command per line with its `\\` continuation lines and heredoc joined, comments and `$ `
prompts dropped. `classify()` gives each command the first rule of RULES whose page and pattern match it:

    RUN      cheap on a CPU (seconds): run for real, as typed, from a scratch folder (python and the console scripts of
             the venv first on PATH, tools/ read from the repository): the shell ones by bash first, then the Python
             ones in one interpreter (tests/doc_batch.py), each in page order; a command may read what an earlier
             one wrote (docs/dry_run.md's exp.yaml is the heredoc of docs/ecosystem.md)
    COVERED  a training, conversion or Slurm command an existing test already runs: the rule names that test
             (`tests/test_x.py::test_name`) and the test fails if the named test is gone
    GPU      needs a GPU (a GPU layout, CUDA, Transformer Engine)
    CLUSTER  needs a cluster, a container runtime, a network download or root
    SLURM    submits to Slurm (a local one runs the covering tests; a real cluster for the rest)
    SLOW     runs on a CPU, but for minutes: left to its own test or to the person who runs it

A command that no rule matches fails the test: a new docs command is classified here when it is written
(docs/development.md says how).
"""

import os
import re
from dataclasses import dataclass
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# the first word of a command in an indented block (indented blocks also hold error messages and tables)
COMMAND_WORD = re.compile(r"^(\$ )?(python[0-9.]*|\.venv/bin/\S+|megatron-sat-[a-z-]+|make|bash|sbatch|srun|lm_eval|"
                          r"tensorboard|pip|docker|enroot|apptainer|hf|jq|wandb|cp|export|cat|sleep|for|done|"
                          r"[A-Z_]+=\S*)(\s|$)")


@dataclass
class Command:
    page: str
    line: int
    text: str  # one line: continuations joined, comment dropped (a heredoc keeps its lines)

    def __str__(self):
        return f"{self.page}:{self.line}: {self.text}"


def _strip_comment(line: str) -> str:
    """The line without a trailing `# comment` (a # inside quotes or a word is kept)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _commands_of(page: str, block: List[tuple], indented: bool) -> List[Command]:
    out, i = [], 0
    while i < len(block):
        number, raw = block[i]
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not line or line.startswith("#") or (indented and not COMMAND_WORD.match(line)):
            i += 1
            continue
        text = _strip_comment(line)
        heredoc = re.search(r"<<-?'?(\w+)'?", text)
        while text.endswith("\\") and i + 1 < len(block):  # continuation lines
            i += 1
            text = text[:-1].rstrip() + " " + _strip_comment(block[i][1].strip())
        if re.match(r"(for|while) .*; do$", text):  # a loop, to its `done`, as one command
            body = []
            while i + 1 < len(block) and body[-1:] != ["done"]:
                i += 1
                body.append(_strip_comment(block[i][1].strip()))
            text = "\n".join([text] + body)
        if heredoc:  # the heredoc's lines, up to its end word, as typed
            body = []
            while i + 1 < len(block):
                i += 1
                body.append(block[i][1].rstrip())
                if block[i][1].strip() == heredoc.group(1):
                    break
            text = "\n".join([text] + body)
        out.append(Command(page, number, text))
        i += 1
    return out


def commands(root: str = ROOT) -> List[Command]:
    """Every shell command of README.md and docs/*.md, in page order."""
    out = []
    for page in PAGES:
        lines = open(os.path.join(root, page)).read().split("\n")
        fence, block, indented, previous_blank = None, [], [], True
        for number, line in enumerate(lines, 1):
            m = re.match(r"^\s*(```+)\s*(\S*)", line)
            if fence is None and m:
                fence, lang, block = m.group(1), m.group(2).lower(), []
                continue
            if fence is not None:
                if line.strip() == fence:
                    # a block without a language holds commands when its first line is one
                    first = next((t for _, t in block if t.strip()), "")
                    if lang in SHELL_LANGS or (not lang and COMMAND_WORD.match(first.strip())):
                        out += _commands_of(page, block, indented=False)
                    fence = None
                else:
                    block.append((number, line))
                continue
            if line.startswith("    ") and (indented or previous_blank):
                indented.append((number, line))
            elif indented and not line.strip():
                indented.append((number, line))
            else:
                if indented:
                    out += _commands_of(page, indented, indented=True)
                indented = []
            previous_blank = not line.strip()
        if indented:
            out += _commands_of(page, indented, indented=True)
    return out


@dataclass
class Rule:
    kind: str  # RUN, COVERED, GPU, CLUSTER, SLURM, SLOW
    page: str  # a page name ("docs/dry_run.md"), or "*"
    pattern: str  # a regular expression searched in the command
    why: str  # COVERED: the test id; otherwise the reason

    def matches(self, command: Command) -> bool:
        return (self.page in ("*", command.page)) and re.search(self.pattern, command.text) is not None


def rule(kind, page, pattern, why):
    return Rule(kind, page, pattern, why)


R, C = "README.md", "docs/"
RULES = [
    # ---- README.md
    rule("SLOW", R, r"^make demo$", "3-4 minutes on CPU (the demo recipe: a tokenizer trained on the embedded corpus, "
         "then 400 steps; 2 steps alone took 3 minutes on the shared 2-core machine); no test runs the demo recipe: "
         "tests/test_train_run.py::test_debug_recipe_trains_on_the_embedded_corpus trains a debug recipe on that "
         "corpus"),
    rule("CLUSTER", R, r"^make slurm test$", "installs Slurm (root, apt-get) and runs the whole suite: what CI does"),
    rule("COVERED", R, r"^\.venv/bin/megatron-sat-convert-to-hf --load runs/demo --output hf/demo$",
         "tests/test_conversion.py::test_cli"),
    rule("COVERED", R, r"^\.venv/bin/megatron-sat-analyze-gates --model hf/demo --output runs/gates_demo$",
         "tests/test_gate_report.py::test_cli_writes_outputs_and_refuses_bad_input"),
    rule("CLUSTER", R, r"^bash docker/install.sh$", "installs megatron-core and the package into the current "
         "Python (tests/test_install.py::test_container_install_script_keeps_torch runs it into a scratch venv)"),
    rule("COVERED", R, r'^pip install "\.\[hf,train,eval\]"$',
         "tests/test_install.py::test_wheel_install_runs_outside_the_repository"),
    rule("CLUSTER", "*", r"^(docker|podman) build|^enroot import|^apptainer build",
         "a container build or import: Docker, enroot or Apptainer and NVIDIA's registry"),
    # the README's cluster walkthrough, run by bash as written on a local two-node Slurm
    rule("COVERED", R, r'^(cp "\$\(megatron-sat-submit-grid --slurm-dir\)/site.sh" site.sh|export MSAT_SITE=|'
         r'megatron-sat-preprocess-data --input "\$CORPUS"|megatron-sat-plan-layout --recipe satformer_760M$|'
         r"megatron-sat-submit-grid --archs transformer,satformer --scales 760M|"
         r"megatron-sat-collect-grid runs --sweep first|RUN=\$\(ls -d runs/satformer_760M_\*\)$|"
         r'megatron-sat-evaluate --checkpoint "\$RUN"|megatron-sat-convert-to-hf --load "\$RUN")',
         "tests/test_install.py::test_readme_cluster_walkthrough_as_written"),
    # ---- training (README.md and docs/training.md): the debug run for real, the rest covered or on GPUs
    rule("COVERED", "*", r"^python -m megatron_sat\.train --recipe debug_satformer$",
         "tests/test_run_tracking.py::test_tensorboard_has_every_scalar_once_per_step"),
    rule("COVERED", "*", r"^python -m megatron_sat\.train --recipe debug_hyperconnections$",
         "tests/test_slurm.py::test_submit_grid_job_array"),
    rule("COVERED", "*", r"^megatron-sat-torchrun --nproc-per-node 4 -m megatron_sat\.train --recipe debug_satformer "
         r"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2$",
         "tests/test_faults_signals.py::test_usr1_to_the_launchers_group_saves_on_every_rank"),
    rule("GPU", "*", r"^(python -m megatron_sat\.train|megatron-sat-train) --recipe satformer_760M --data-path "
         r"(?!.*--print-config)", "the 760M recipe: GPUs, its data and tokenizer (README.md, docs/training.md and "
         "docs/data.md)"),
    rule("RUN", "*", r"^python -m megatron_sat\.train --help$", "the trainer's every flag"),
    # ---- docs/benchmarks.md, docs/preprocessing_speed.md
    rule("SLOW", C + "benchmarks.md", r"^python tools/benchmark_preprocess\.py",
         "minutes, and a Megatron-LM checkout (MEGATRON_LM) beside a 200 MB corpus"),
    rule("SLOW", C + "preprocessing_speed.md", r"^python tools/benchmark_preprocess\.py",
         "minutes, and a Megatron-LM checkout beside a 200 MB corpus"),
    rule("COVERED", C + "preprocessing_speed.md", r"^python tools/preprocess_data\.py --input corpus\.jsonl "
         r"--tokenizer data/tokenizer", "tests/test_preprocess_fast.py::test_preprocess_fast_equals_plain_and_megatron_core"),
    rule("COVERED", C + "preprocessing_speed.md", r"^python tools/preprocess_data\.py \.\.\. --no-fast-bpe$",
         "tests/test_preprocess_fast.py::test_preprocess_fast_equals_plain_and_megatron_core"),
    # ---- docs/data.md
    rule("CLUSTER", C + "data.md", r"^hf download ", "downloads 100B tokens of FineWeb-Edu from the Hugging Face hub"),
    rule("RUN", C + "data.md", r"^slurm=\$\(megatron-sat-submit-grid --slurm-dir\)$", "prints the sbatch folder"),
    rule("SLURM", C + "data.md", r"^(jid=\$\(sbatch|sbatch --dependency)",
         "a Slurm array over a 100B-token corpus (tests/test_data.py runs the shards and the merge locally)"),
    rule("COVERED", C + "data.md", r"^megatron-sat-merge-datasets --shard-dir .* --blend-file",
         "tests/test_slurm.py::test_preprocess_array_and_merge"),
    # ---- docs/development.md
    rule("SLOW", C + "development.md", r"^\.venv/bin/mutmut (run|results)",
         "mutation testing: hours, by hand on one module"),
    # ---- docs/dry_run.md
    rule("COVERED", C + "dry_run.md", r"^python tools/dry_run\.py --recipe satformer_1\.3B --nodes 16 "
         r"--tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
         r"--sequence-parallel$", "tests/test_dry_run.py::test_larger_layouts_dry_run_clean"),
    rule("RUN", C + "dry_run.md", r"^python tools/dry_run\.py --recipe hyperconnections_760M$",
         "the recipe's default cluster and layout"),
    rule("RUN", C + "dry_run.md", r"^megatron-sat-dry-run --recipe satformer_1\.3B --nodes 8 --gpu H200 "
         r"--micro-batch-size 8$", "another GPU and micro-batch"),
    rule("RUN", C + "dry_run.md", r"^python tools/dry_run\.py --recipe debug_satformer --config exp\.yaml$",
         "exp.yaml: docs/ecosystem.md's config file"),
    rule("COVERED", C + "dry_run.md", r"^python tools/submit_grid\.py --dry-run --check-layouts --scales 1\.3B$",
         "tests/test_dry_run.py::test_paper_recipes_dry_run_clean"),
    rule("SLURM", C + "dry_run.md", r"^python tools/submit_grid\.py --submit --check-layouts",
         "submits to Slurm (its layout check is the command above)"),
    rule("COVERED", C + "dry_run.md", r"^(MSAT_DRY_RUN_FULL=1 )?\.venv/bin/python -m pytest -q tests/test_dry_run\.py$",
         "tests/test_dry_run.py::test_paper_recipes_dry_run_clean"),
    # ---- docs/ecosystem.md
    rule("RUN", C + "ecosystem.md", r"^cat > exp\.yaml <<'EOF'", "writes exp.yaml (the commands below read it)"),
    rule("COVERED", C + "ecosystem.md", r"^python -m megatron_sat\.train --config exp\.yaml --lr 5e-4$",
         "tests/test_ecosystem.py::test_precedence_recipe_config_command_line"),
    rule("RUN", C + "ecosystem.md", r"^python -m megatron_sat\.train --recipe satformer_760M --data-path DATA "
         r"--tokenizer-model TOK --print-config > run\.yaml$", "prints the resolved arguments, nothing checked on disk"),
    rule("COVERED", C + "ecosystem.md", r"^python -m megatron_sat\.train --config run\.yaml$",
         "tests/test_ecosystem.py::test_print_config_then_config_reproduces_the_losses"),
    rule("COVERED", C + "ecosystem.md", r"^python -m megatron_sat\.train --config runs/A/config\.json",
         "tests/test_ecosystem.py::test_a_runs_config_json_reproduces_the_run"),
    rule("COVERED", C + "ecosystem.md", r"^python -m megatron_sat\.train --arch transformer --num-layers 24",
         "tests/test_ecosystem.py::test_a_megatron_lm_training_command_runs"),
    rule("COVERED", C + "ecosystem.md", r"^python tools/preprocess_data\.py --input data\.jsonl",
         "tests/test_ecosystem.py::test_megatron_lm_preprocessing_gives_the_native_bytes"),
    rule("COVERED", "*", r"^(megatron-sat-evaluate run|lm_eval) --model (hf|megatron_sat)",
         "tests/test_evaluate.py::test_lm_eval_form_as_typed"),
    rule("COVERED", C + "ecosystem.md", r"^megatron-sat-evaluate run --checkpoint runs/satformer",
         "tests/test_evaluate.py::test_checkpoint_backend"),
    # ---- docs/evaluation.md
    rule("COVERED", "*", r"^python tools/convert_to_hf\.py --load runs/(demo|sat) --output hf/",
         "tests/test_conversion.py::test_cli"),
    rule("COVERED", "*", r"^python tools/convert_from_hf\.py --hf hf/(demo|satformer) --save",
         "tests/test_conversion.py::test_cli"),
    rule("COVERED", C + "evaluation.md", r"^python tools/convert_from_hf\.py --hf Qwen3-0\.6B",
         "tests/test_conversion_published.py::test_satformer_from_the_transformer_equals_it_at_step_0"),
    rule("COVERED", "*", r"^python tools/evaluate\.py (--model hf/demo|--checkpoint runs/sat )",
         "tests/test_evaluate.py::test_evaluate_cli_offline"),
    rule("SLOW", C + "evaluation.md", r"^for run in runs/\{transformer", "every run of a sweep, each for minutes "
         "(tests/test_evaluate.py::test_evaluate_cli_offline runs tools/evaluate.py's suites)"),
    rule("COVERED", C + "evaluation.md", r"^python -m megatron_sat\.train --config SAVE/config\.json "
         r"--pretrained-checkpoint SAVE ",
         "tests/test_rope_scaling.py::test_import_train_export_match_transformers_past_the_original_context"),
    rule("COVERED", C + "evaluation.md", r"^python tools/collect_grid\.py runs --sweep paper --output results/paper$",
         "tests/test_collect_grid.py::test_eval_scores_become_columns_and_suite_tables"),
    rule("COVERED", C + "evaluation.md", r"^for arch in transformer resformer satformer",
         "tests/test_evaluate.py::test_checkpoint_backend"),
    rule("COVERED", C + "evaluation.md", r"^python -m megatron_sat\.train --recipe debug_muddformer .*--eval-tasks",
         "tests/test_train_run.py::test_eval_tasks_during_training"),
    rule("GPU", C + "evaluation.md", r"^megatron-sat-torchrun --nproc-per-node 8 .*satformer_760M",
         "8 GPUs, the 760M recipe"),
    rule("GPU", C + "evaluation.md", r"^python tools/analyze_gates\.py .*--device cuda", "--device cuda"),
    rule("COVERED", C + "evaluation.md", r"^python tools/analyze_gates\.py --model hf/demo",
         "tests/test_gate_report.py::test_cli_writes_outputs_and_refuses_bad_input"),
    # ---- docs/install.md
    rule("CLUSTER", C + "install.md", r"^(bash docker/install\.sh$|PYTHON=/path/to/env/bin/python)",
         "installs into a Python environment of the cluster (tests/test_install.py runs the script into a scratch "
         "venv)"),
    rule("CLUSTER", C + "install.md", r"^MSAT_CONTAINER_", "site.sh settings for a container runtime on the cluster"),
    rule("CLUSTER", C + "install.md", r"^make gpu-wheels$", "downloads CUDA wheels (a machine with internet)"),
    rule("GPU", C + "install.md", r"^bash tools/gpu_check\.sh", "the GPU machine's check"),
    # ---- docs/profiling.md
    rule("RUN", C + "profiling.md", r"^python tools/param_counts\.py$", "exact counts, four scales"),
    rule("SLOW", C + "profiling.md", r"^python tools/benchmark_step\.py$", "minutes of steps of every arch"),
    rule("COVERED", C + "profiling.md", r"^python tools/profile_throughput\.py --(recipe debug_satformer|config exp)",
         "tests/test_profiling.py::test_writes_every_output"),
    rule("GPU", C + "profiling.md", r"^python tools/profile_throughput\.py --scale 760M .*--nproc 8", "a GPU node"),
    rule("COVERED", C + "profiling.md", r"^python -m megatron_sat\.train --recipe debug_satformer --profile ",
         "tests/test_megatron_lm_scripts.py::test_llama3_8b_script_trains_two_steps_and_profiles_one"),
    rule("COVERED", C + "profiling.md", r"^ls runs/debug_satformer/profile$",
         "tests/test_megatron_lm_scripts.py::test_llama3_8b_script_trains_two_steps_and_profiles_one"),
    # ---- docs/recipes_slurm.md
    rule("RUN", C + "recipes_slurm.md", r"^megatron-sat-plan-layout ", "the planner, no GPU"),
    rule("RUN", C + "recipes_slurm.md", r"^megatron-sat-submit-grid --dry-run$", "the grid's table, nothing submitted"),
    rule("COVERED", C + "recipes_slurm.md", r"^megatron-sat-submit-grid --archs satformer,resformer .*--submit$",
         "tests/test_collect_grid.py::test_sweep_through_slurm_is_collected"),
    rule("COVERED", C + "recipes_slurm.md", r'^sbatch --nodes 2 .*/train\.sbatch" satformer_760M$',
         "tests/test_slurm_multinode.py::test_two_node_pipeline_preempted_requeued_and_exact"),
    rule("RUN", C + "recipes_slurm.md", r'^cp "\$\(megatron-sat-submit-grid --slurm-dir\)/site\.sh" site\.sh && export',
         "copies the site settings"),
    # ---- docs/reliability_*.md
    rule("COVERED", C + "reliability_signals.md", r"^python -m megatron_sat\.torchrun --nproc-per-node 4",
         "tests/test_faults_signals.py::test_usr1_to_the_launchers_group_saves_on_every_rank"),
    rule("COVERED", C + "reliability_signals.md", r"^python -m megatron_sat\.train --recipe debug_satformer --save "
         r"runs/(a|imp) --load runs/(a|imp)", "tests/test_faults_signals.py::test_an_import_resumes_under_a_recipe_with_"
         "other_lr_values"),
    rule("SLURM", C + "reliability_signals.md", r"^\.venv/bin/python tests/chaos/chaos\.py",
         "the chaos run: root, a local Slurm, minutes (tests/test_chaos.py runs it at 10 faults)"),
    rule("COVERED", C + "reliability_signals.md", r"^\.venv/bin/pytest -q tests/test_chaos\.py$",
         "tests/test_chaos.py::test_ten_faults_over_a_sweep_end_bit_identical_to_a_fault_free_run"),
    # ---- docs/step_time.md
    rule("SLOW", C + "step_time.md", r"^python tools/check_steptime_cpu\.py", "3-5 minutes on an idle 2-core machine"),
    # ---- docs/sweeps.md, docs/sweeps_operations.md
    rule("SLURM", "*", r"^(MSAT_GPUS=0 MSAT_CPUS_PER_TASK=1 \.venv/bin/)?python tools/submit_grid\.py .*--submit$",
         "submits a sweep (tests/test_collect_grid.py::test_sweep_through_slurm_is_collected on a local Slurm)"),
    rule("SLURM", "*", r"^(\.venv/bin/)?python tools/collect_grid\.py runs( --sweep \w+)? --(status|wait|output)",
         "reads a sweep's Slurm jobs (tests/test_collect_grid.py on a local Slurm)"),
    rule("SLURM", C + "sweeps.md", r"^(sleep 3600 \| \.venv/bin/python tests/slurm_cluster\.py &|export SLURM_CONF=)",
         "starts a private Slurm (root, `make slurm`)"),
    rule("COVERED", C + "sweeps_operations.md", r"^python -m megatron_sat\.train --recipe debug_satformer --save runs/a "
         r"--load runs/a --wandb-project p --wandb-mode offline$",
         "tests/test_run_tracking.py::test_preempted_twice_is_one_wandb_run_with_every_step_once"),
    rule("COVERED", C + "sweeps_operations.md", r"^(jq \.wandb runs/a/config\.json|wandb sync runs/a/wandb/)",
         "tests/test_collect_grid.py::test_wandb_summary_run_and_the_trainers_group"),
    rule("COVERED", C + "sweeps_operations.md", r"^python -m megatron_sat\.train --recipe debug_satformer --save runs/b "
         r"--load runs/b --tensorboard-dir runs/b/tb$", "tests/test_run_tracking.py::test_tensorboard_has_every_"
         "scalar_once_per_step"),
    rule("COVERED", C + "sweeps_operations.md", r"^tensorboard --logdir runs$",  # a web server: it never exits
         "tests/test_run_tracking.py::test_tensorboard_has_every_scalar_once_per_step"),
]

KINDS = ("RUN", "COVERED", "GPU", "CLUSTER", "SLURM", "SLOW")


def classify(command: Command) -> Optional[Rule]:
    return next((r for r in RULES if r.matches(command)), None)
