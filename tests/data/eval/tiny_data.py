"""The tiny tasks' data, read beside this file (`custom_dataset: !function tiny_data.beside` in tiny_mc.yaml and
tiny_gen.yaml): lm-eval hands `dataset_kwargs.data_files` to datasets.load_dataset as given, and a relative path there
is read from the working folder, so `lm_eval ... --include_path tests/data/eval` would work from one folder only.
lm-eval calls this with the task's metadata and dataset_kwargs; a relative data file is taken relative to this folder
(an absolute one, as megatron_sat.analysis.evaluation writes it, as it is)."""

import os

import datasets

HERE = os.path.dirname(os.path.abspath(__file__))


def beside(data_files=None, **_):
    files = {split: os.path.join(HERE, path) for split, path in (data_files or {}).items()}
    return datasets.load_dataset("json", data_files=files)
