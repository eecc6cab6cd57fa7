"""Checkpoints a user can take elsewhere (issue 9, section 4): tiny Hugging Face models trained through Lightning with
ZeroStrategy, exported with ``python -m zeroshard.consolidate --hf`` and loaded by ``from_pretrained``; Lightning's own
load paths on a sharded checkpoint; ``load_pretrained`` of a ``save_pretrained`` file at stage 3.

One two-rank launch (scripts/export_runs.py) trains and loads everything; the tests below check its outputs against
the trained model's own logits and losses, and run the export in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from ckpt_tools import version_dir  # noqa: E402
from hf_causal_lm import FIXED_BATCH, HFCausalLM, build_hf_model  # noqa: E402
from launch import run_ranks  # noqa: E402

from zeroshard.checkpoint.sharded_checkpoint import INDEX, verify  # noqa: E402
from zeroshard.consolidate import export_hf  # noqa: E402

SCRIPT = Path(__file__).parent / "scripts" / "export_runs.py"
REPO = Path(__file__).resolve().parents[2]
RUNS = {"gpt2_s3": "gpt2", "llama_s2": "llama", "gpt2_lora_s2": "gpt2"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, torch.Tensor]:
    out = tmp_path_factory.mktemp("export")
    pretrained = out / "pretrained"
    torch.manual_seed(0)
    model = build_hf_model("gpt2")
    model.save_pretrained(pretrained)
    with torch.no_grad():
        ref = model(input_ids=FIXED_BATCH).logits
    run_ranks(SCRIPT, [str(out), str(pretrained)], timeout=600)
    return out, pretrained, ref


def consolidate_cli(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [sys.executable, "-m", "zeroshard.consolidate", *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.parametrize("name", list(RUNS))
def test_hf_export_loads_with_from_pretrained_and_gives_the_trained_logits(runs, tmp_path, name):
    """consolidate --hf -> AutoModelForCausalLM.from_pretrained: the trained model's logits (GPT-2 at stage 3 with
    its tied head, Llama with rotary buffers, GPT-2 + LoRA merged into the weights)."""
    from transformers import AutoModelForCausalLM

    out = runs[0] / name
    consolidate_cli(str(out / "ckpt"), str(tmp_path / "hf"), "--hf")
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors"], files
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == RUNS[name] and config["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == config["architectures"][0]
    ref = torch.load(out / "ref.pt")["logits"]
    with torch.no_grad():
        got = model(input_ids=FIXED_BATCH).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    if "lora" in name:  # a plain model whose attention weights took the trained adapters in
        from zeroshard.consolidate import iter_parameters

        base = dict(iter_parameters(out / "ckpt"))[
            "model.base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"
        ]
        merged = model.transformer.h[0].attn.c_attn.weight
        assert not hasattr(model, "peft_config") and (merged - base).abs().max() > 1e-3


def test_hf_export_in_bf16(runs, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    out = runs[0] / "gpt2_s3"
    export_hf(out / "ckpt", tmp_path / "hf", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" not in f.keys()  # tied to the embedding, as save_pretrained leaves it out
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        got = model(input_ids=FIXED_BATCH).logits.float()
    torch.testing.assert_close(got, torch.load(out / "ref.pt")["logits"], rtol=0.05, atol=0.05)


def test_non_persistent_buffers_are_not_saved(runs, tmp_path):
    """Llama's rotary inv_freq is not in state_dict(): not saved, so a strict load into a fresh HF model works."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    ckpt = runs[0] / "llama_s2" / "ckpt"
    with safe_open(str(version_dir(ckpt) / "rank00000.safetensors"), "pt") as f:
        assert not [k for k in f.keys() if "inv_freq" in k]
    consolidate_cli(str(ckpt), str(tmp_path / "plain"))
    plain = load_file(str(tmp_path / "plain" / "model.safetensors"))
    assert plain.keys() == HFCausalLM("llama").state_dict().keys()
    export_hf(ckpt, tmp_path / "hf")
    fresh = build_hf_model("llama")
    fresh.load_state_dict(load_file(str(tmp_path / "hf" / "model.safetensors")), strict=True)


def test_load_from_checkpoint_through_lightning_format(runs, tmp_path):
    """consolidate --format lightning keeps hyper_parameters and Lightning's version key: load_from_checkpoint."""
    out = runs[0] / "gpt2_s3"
    consolidate_cli(str(out / "ckpt"), str(tmp_path / "model.ckpt"), "--format", "lightning")
    module = HFCausalLM.load_from_checkpoint(tmp_path / "model.ckpt")
    assert module.hparams.arch == "gpt2" and module.hparams.lr == 1e-2
    with torch.no_grad():
        got = module(FIXED_BATCH)
    torch.testing.assert_close(got, torch.load(out / "ref.pt")["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(RUNS))
def test_lightning_load_paths_on_a_sharded_directory(runs, name):
    """validate/test/predict(ckpt_path=DIR) on a fresh Trainer, and validate after init_module(empty_init=True)."""
    out = runs[0] / name
    ref = torch.load(out / "ref.pt")
    for rank in (0, 1):
        got = json.loads((out / f"loads_rank{rank}.json").read_text())
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-6)
        assert got["validate_ckpt"] == pytest.approx(ref["val_loss"], rel=1e-6)
        assert got["test_ckpt"] == pytest.approx(ref["val_loss"], rel=1e-6)
        assert got["predict_ckpt_max_diff"] < 1e-5
        assert got["built_on_meta"]
        assert got["validate_meta_ckpt"] == pytest.approx(ref["val_loss"], rel=1e-6)
        # an untrained model: about ln(64) = 4.16, and (except LoRA, which barely moved) not the trained loss
        assert 3.5 < got["validate_meta"] < 5.0
        assert abs(got["validate_meta"] - ref["val_loss"]) > 0.05 or "lora" in name


@pytest.mark.parametrize("name", list(RUNS))
def test_saving_over_a_last_link_leaves_no_stray_link(runs, name):
    ckpts = runs[0] / name / "ckpts"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert not (ckpts / "last.ckpt").is_symlink() and (ckpts / INDEX).parent.is_dir()
    verify(ckpts / "last.ckpt")
    verify(ckpts / "epoch=0-step=8.ckpt")  # the link's target is untouched


def test_load_pretrained_of_a_save_pretrained_file_at_stage_3(runs):
    """configure_model builds GPT-2 on the meta device and calls zeroshard.load_pretrained on a save_pretrained
    directory: through fit each rank reads only its shards' slices; through predict alone every rank reads it whole.
    Both give the saved model's logits."""
    _, pretrained, ref = runs
    for rank in (0, 1):
        got = torch.load(pretrained / f"pretrained_rank{rank}.pt")
        mine = ref[rank::2]  # predict's distributed sampler gives each rank every other sample
        torch.testing.assert_close(got["fit"], mine, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["predict"], mine, rtol=1e-5, atol=1e-5)
        [(mode, read, total, missing, unexpected)] = got["report"]
        assert mode == "sharded" and not missing and not unexpected
        assert read < 0.75 * total, (read, total)  # about half of the file per rank


def test_export_errors_name_the_fix(runs, tmp_path):
    from zeroshard.checkpoint.hf_export import hf_tensor_plan

    index = verify(runs[0] / "gpt2_lora_s2" / "ckpt")
    [model] = index["hf_models"]
    assert model["prefix"] == "model.base_model.model." and model["lora"]["r"] == 4
    with pytest.raises(ValueError, match="use_dora=True.*merge_and_unload"):
        hf_tensor_plan([], {}, {**model, "lora": {**model["lora"], "use_dora": True}})
    bare = tmp_path / "bare"
    import shutil

    shutil.copytree(runs[0] / "gpt2_s3" / "ckpt", bare)
    from ckpt_tools import edit_index

    edit_index(bare, lambda index: index.update(hf_models=[]), seal=True)  # re-sealed: the checksums cover the index
    with pytest.raises(ValueError, match="records no Hugging Face model.*--format safetensors"):
        export_hf(bare, tmp_path / "out")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lora_merge_equals_peft_merge_and_unload(arch):
    """hf_tensor_plan + merge_lora against peft's own merge: Conv1D (fan_in_fan_out) or Linear and Embedding layers,
    rsLoRA scaling and a per-layer alpha_pattern."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from zeroshard.checkpoint.hf_export import describe_hf_models, hf_tensor_plan, merge_lora

    torch.manual_seed(0)
    targets = ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj", "embed_tokens"]
    layer = "h.1.attn.c_attn" if arch == "gpt2" else "layers.1.self_attn.q_proj"
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets,
        fan_in_fan_out=arch == "gpt2",
        use_rslora=True,
        alpha_pattern={layer: 3},
    )
    holder = nn.Module()
    holder.model = get_peft_model(build_hf_model(arch), config)
    with torch.no_grad():
        for name, p in holder.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_()  # peft starts B at zero: give the merge something to add
    state = {k: v.detach().clone() for k, v in holder.state_dict().items()}
    [entry] = describe_hf_models(holder)
    plan, left_out = hf_tensor_plan(list(state), {k: list(v.shape) for k, v in state.items()}, entry)
    assert not left_out
    ours = {
        t.name: merge_lora(state[t.source], state[t.lora_a], state[t.lora_b], t.scaling, t.transpose)
        if t.lora_a
        else state[t.source]
        for t in plan
    }
    reference = holder.model.merge_and_unload().state_dict()
    tied = set(entry["tied"])
    assert ours.keys() == {k for k in reference if k not in tied}
    for k, v in ours.items():
        torch.testing.assert_close(v, reference[k], rtol=1e-6, atol=1e-6, msg=k)
    assert sum(t.lora_a is not None for t in plan) == (2 if arch == "gpt2" else 5)


def test_recorded_load_pretrained_follows_a_later_peft_wrap(tmp_path):
    """load_pretrained on a meta GPT-2, then get_peft_model (c_attn.weight moves to c_attn.base_layer.weight), then
    materialisation: the base weights come from the file, the adapters keep their own init."""
    from hf_causal_lm import with_lora
    from safetensors.torch import load_file

    from zeroshard import load_pretrained
    from zeroshard.meta_init import init_meta_context, materialize_module_
    from zeroshard.pretrained import apply_recorded_whole

    torch.manual_seed(0)
    build_hf_model("gpt2").save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    with init_meta_context():
        model = build_hf_model("gpt2")
    assert load_pretrained(model, tmp_path).mode == "recorded"
    wrapped = with_lora(model, "gpt2")
    materialize_module_(wrapped, "cpu", param_init_fn=build_hf_model("gpt2")._init_weights)
    [report] = apply_recorded_whole(wrapped)
    assert report.mode == "plain" and not report.missing and not report.unexpected
    base = wrapped.base_model.model
    assert torch.equal(base.transformer.h[0].attn.c_attn.base_layer.weight, saved["transformer.h.0.attn.c_attn.weight"])
    assert torch.equal(base.lm_head.weight, saved["transformer.wte.weight"])
    assert base.transformer.h[0].attn.c_attn.lora_A["default"].weight.abs().sum() > 0  # not from the file
