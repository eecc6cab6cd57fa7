"""Finding Hugging Face and peft models loads nothing: transformers is a lazy module that Lightning imports whenever it
is installed, and touching ``transformers.PreTrainedModel`` would load hundreds of modules in every rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")

PROBE = """
import sys
import torch
import transformers  # the lazy top-level module, as `import lightning` leaves it
from zeroshard.checkpoint.hf_export import describe_hf_models
from zeroshard.init.hf_init import is_init_owner
model = torch.nn.Sequential(torch.nn.Linear(4, 4))
assert not any(is_init_owner(m) for m in model.modules())
assert describe_hf_models(model) == []
print(sorted(m for m in sys.modules if m in ("transformers.modeling_utils", "accelerate") or m.startswith("peft")))
from transformers import GPT2Config, GPT2LMHeadModel
hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
print([type(m).__name__ for m in hf.modules() if is_init_owner(m)], [d["class"] for d in describe_hf_models(hf)])
"""


def test_non_hf_models_load_no_transformers_module_and_hf_models_are_still_found_outermost_only():
    env = {"PYTHONPATH": str(REPO / "python"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, found = proc.stdout.strip().splitlines()[-2:]
    assert loaded == "[]", f"looking for HF models loaded {loaded}"
    assert found == "['GPT2LMHeadModel', 'GPT2Model'] ['GPT2LMHeadModel']", found
