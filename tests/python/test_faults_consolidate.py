"""``consolidate`` against hostile checkpoints and kills (issue 18, cases 4 and 11).

4. No regular expression from a checkpoint is compiled: a peft ``alpha_pattern`` key that is not a plain name (the
   catastrophic ``(a+)+b``) is refused in well under a second, naming the key; plain-name keys give peft's own
   per-layer scaling (``peft.utils.other.get_pattern_key`` and the ``scaling`` of the layers peft builds).
11. A ``consolidate`` SIGKILLed at any point of its write (``ZEROSHARD_TEST_KILL_AT``) leaves no partial
    ``model.safetensors``, no shard without its index and no ``--hf`` weights without ``config.json``; the next run
    removes the leftovers and writes the whole output. Checks (LoRA shapes edited in a re-sealed index) fail before
    the first byte is written.

One tiny GPT-2 + LoRA checkpoint is saved in this process (one gloo rank, stage 2); hostile variants are re-sealed as
an attacker with write access would (``ckpt_tools.edit_index``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("peft")

from ckpt_tools import edit_index  # noqa: E402
from hf_causal_lm import FIXED_BATCH, build_hf_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from zeroshard.checkpoint.atomic_write import TAG  # noqa: E402
from zeroshard.checkpoint.hf_export import hf_tensor_plan  # noqa: E402
from zeroshard.checkpoint.peft_patterns import pattern_value  # noqa: E402
from zeroshard.consolidate import export_hf, full_state_dict  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
INDEX_JSON = "model.safetensors.index.json"
SHARDED = ["--max_shard_size", "20KB"]  # the tiny GPT-2 (about 0.2 MB in fp32) in several files


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A sharded checkpoint of a tiny GPT-2 with LoRA on ``c_attn`` (B non-zero, so the merge moves the weights);
    ``ref_logits.pt`` beside it: the LoRA model's logits on ``FIXED_BATCH``."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from zeroshard import ZeroStrategy
    from zeroshard.checkpoint.sharded_checkpoint import save_sharded

    out = tmp_path_factory.mktemp("consolidate")
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        holder = nn.Module()
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
        holder.model = get_peft_model(build_hf_model("gpt2"), config)
        with torch.no_grad():
            for name, p in holder.named_parameters():
                if "lora_B" in name:
                    p.normal_()
            holder.model.eval()
            torch.save(holder.model(input_ids=FIXED_BATCH).logits, out / "ref_logits.pt")
        optimizer = torch.optim.AdamW([p for p in holder.parameters() if p.requires_grad], lr=1e-3)
        engine = ZeroStrategy(stage=2)._core.build_engine(holder, [optimizer], compute_dtype=None, local_world_size=1)
        save_sharded(engine, out / "ckpt")
    finally:
        dist.destroy_process_group()
    return out / "ckpt"


def _cli(*args: str, kill: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    env.pop("ZEROSHARD_TEST_KILL_AT", None)
    if kill:
        env["ZEROSHARD_TEST_KILL_AT"] = kill
    cmd = [sys.executable, "-m", "zeroshard.consolidate", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def _hostile(ckpt: Path, tmp_path: Path, edit) -> Path:
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    edit_index(bad, edit, seal=True)
    return bad


def _set_alpha_pattern(patterns: dict) -> callable:
    def edit(index: dict) -> None:
        index["hf_models"][0]["lora"]["alpha_pattern"] = patterns

    return edit


# -- case 4: no regular expressions from a checkpoint ----------------------------------------------------------------


def _lora_model(patterns: dict) -> dict:
    lora = {"adapter": "default", "peft_type": "LORA", "r": 4, "lora_alpha": 8, "alpha_pattern": patterns}
    return {"prefix": "m.", "tied": [], "lora": lora}


def test_catastrophic_alpha_pattern_is_refused_in_under_a_second():
    """``(a+)+b`` against a 26-character run of ``a``: the old ``re.match`` took seconds (doubling per character)."""
    layer = "a" * 26
    names = [f"m.{layer}.base_layer.weight", f"m.{layer}.lora_A.default.weight", f"m.{layer}.lora_B.default.weight"]
    shapes = dict(zip(names, [[16, 8], [4, 8], [16, 4]]))
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"alpha_pattern key '\(a\+\)\+b'.*not a plain layer name.*save") as e:
        hf_tensor_plan(names, shapes, _lora_model({"(a+)+b": 2}))
    assert time.perf_counter() - start < 1.0
    assert "regular expressions" in str(e.value)


def test_consolidate_hf_refuses_a_resealed_regex_pattern_fast(ckpt, tmp_path):
    """The CLI on a re-sealed index whose pattern backtracks exponentially on GPT-2's own layer names: a clear error,
    nothing written (the old code ran past the deadline)."""
    evil = "(([a-z_.0-9]+)+)+!"  # about 3x the time per character: 5 s at 16, days at GPT-2's 27-character names
    bad = _hostile(ckpt, tmp_path, _set_alpha_pattern({"h.0.attn.c_attn": 2, evil: 3}))
    # the deadline tells a refusal (seconds, most of it importing torch and Lightning on a loaded CI core) from the
    # backtracking (days); 60 s was once too short for the imports alone under two pytest workers
    proc = _cli(str(bad), str(tmp_path / "hf"), "--hf", timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"ValueError: LoRA alpha_pattern key {evil!r} in the checkpoint's index is not a plain" in proc.stderr
    assert not (tmp_path / "hf").exists()
    start = time.perf_counter()
    with pytest.raises(ValueError, match="not a plain layer name"):
        export_hf(bad, tmp_path / "hf")
    assert time.perf_counter() - start < 30.0  # verify + plan + refusal: well under a second; the pattern takes days
    assert not (tmp_path / "hf").exists()


def _peft_key(keys: list[str], layer: str) -> str:
    from peft.utils.other import get_pattern_key

    return get_pattern_key(keys, layer)


def test_plain_name_matcher_equals_peft_get_pattern_key():
    """Every plain-name key form (dotted names whose ``.`` is a wildcard in peft's regex, ``^``, ``$``, suffixes that
    stop mid-name) against random layer names: the same choice as peft's ``get_pattern_key``, first key first."""
    rng = random.Random(0)
    alphabet = "ab1._\n"
    for _ in range(3000):
        layer = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        keys = []
        for _ in range(rng.randint(1, 3)):
            key = "".join(rng.choice("ab1._") for _ in range(rng.randint(1, 5)))
            keys.append(rng.choice(["", "^"]) + key + rng.choice(["", "", "$"]))
        keys = list(dict.fromkeys(keys))
        patterns = {k: i + 1 for i, k in enumerate(keys)}
        expected = patterns.get(_peft_key(keys, layer), 0)
        assert pattern_value(patterns, layer, 0, "alpha_pattern") == expected, (keys, layer)
    for layer, key, hit in [("transformer.h11", "h.1", True), ("transformer.h.1", "h.1", True), ("xh.1", "h.1", False)]:
        assert (pattern_value({key: 5}, layer, 0, "alpha_pattern") == 5) is hit is bool(_peft_key([key], layer) == key)


@pytest.mark.parametrize("rslora", [False, True])
def test_plain_alpha_pattern_gives_peft_scaling(rslora):
    """A GPT-2 with several plain-name alpha_pattern keys (a full name, a suffix, a ``^``-anchored name, a key that
    matches no layer): each layer's scaling is the one peft gave that layer."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from zeroshard.checkpoint.hf_export import describe_hf_models

    patterns = {"^transformer.h.1.attn.c_attn": 3, "attn.c_proj": 5, "h.9.attn.c_attn": 7}
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True, use_rslora=rslora,
        alpha_pattern=patterns,
    )  # fmt: skip
    holder = nn.Module()
    holder.model = get_peft_model(build_hf_model("gpt2"), config)
    state = holder.state_dict()
    [entry] = describe_hf_models(holder)
    plan, _ = hf_tensor_plan(list(state), {k: list(v.shape) for k, v in state.items()}, entry)
    got = {t.name.removesuffix(".weight"): t.scaling for t in plan if t.lora_a}
    base = holder.model.base_model.model
    peft_scaling = {
        name: m.scaling["default"] for name, m in base.named_modules() if isinstance(getattr(m, "scaling", 0), dict)
    }
    assert got == pytest.approx(peft_scaling, rel=1e-12) and len(got) == 6  # c_attn, attn/mlp c_proj x 2 layers
    assert len(set(got.values())) == 3  # the patterns did change some layers' scaling


@pytest.mark.parametrize(
    "patterns",
    [{"h.(0|1).attn": 2}, {"h\\.0": 2}, {"c_attn*": 2}, {"": 2}, {"[ab]": 2}, {"ok": "2"}, {"ok": float("nan")}],
)
def test_non_plain_or_non_numeric_patterns_name_the_key(patterns):
    names = ["m.x.base_layer.weight", "m.x.lora_A.default.weight", "m.x.lora_B.default.weight"]
    shapes = dict(zip(names, [[16, 8], [4, 8], [16, 4]]))
    [key] = patterns
    with pytest.raises(ValueError, match=re.escape(repr(key)[:20])):
        hf_tensor_plan(names, shapes, _lora_model(patterns))


# -- case 11: a killed consolidate leaves no partial output -----------------------------------------------------------

KILL_STEPS = ["consolidate_tensor", "consolidate_file", "consolidate_commit"]


@pytest.fixture(scope="module")
def kills(ckpt, tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """Every kill scenario in one launch of scripts/consolidate_kills.py (each job a forked child): per scenario, a
    killed run then a clean one into the same ``OUT``, and what each left on disk."""
    base = tmp_path_factory.mktemp("kills")
    jobs: dict[str, list[dict]] = {}

    def job(work: Path, *args: str, kill: str | None = None) -> dict:
        return {"argv": [str(ckpt), str(work / "out"), *args], "kill": kill, "snap": str(work)}

    for step in KILL_STEPS:
        for layout, extra in (("single", []), ("sharded", SHARDED)):
            work = base / f"{step}-{layout}"
            jobs[f"{step}-{layout}"] = [job(work, *extra, kill=step), job(work, *extra)]
    for step in ("consolidate_file", "consolidate_commit"):
        work = base / f"{step}-hf"
        jobs[f"{step}-hf"] = [job(work, "--hf", kill=step), job(work, "--hf")]
    work = base / "torch"
    jobs["torch"] = [job(work, "--format", "torch", kill="consolidate_commit"), job(work, "--format", "torch")]
    work = base / "in-place"
    (work / "out").mkdir(parents=True)
    (work / "out" / "tokenizer.json").write_text("{}")  # a user's file beside the output
    jobs["in-place"] = [
        job(work),
        job(work, *SHARDED, kill="consolidate_commit"),
        job(work, *SHARDED, kill="consolidate_renamed"),
        job(work, *SHARDED),
        job(work),
    ]
    for work in {Path(j["snap"]) for steps in jobs.values() for j in steps}:
        work.mkdir(exist_ok=True)
    (base / "jobs.json").write_text(json.dumps(jobs))
    run_script = REPO / "tests" / "python" / "scripts" / "consolidate_kills.py"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"), OMP_NUM_THREADS="1")
    env.pop("ZEROSHARD_TEST_KILL_AT", None)
    cmd = [sys.executable, str(run_script), str(base / "jobs.json"), str(base / "results.json")]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return base, json.loads((base / "results.json").read_text())


def _finals(files: dict[str, str]) -> list[str]:
    """Paths without a temporary component: what a reader of the output would see."""
    return sorted(f for f in files if TAG not in f)


def _assert_whole(out: Path, ckpt: Path, sharded: bool) -> None:
    names = _names(out)
    ref = full_state_dict(ckpt)
    if sharded:
        index = json.loads((out / INDEX_JSON).read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 2 and names == sorted([*shards, INDEX_JSON])
        got = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    else:
        assert names == ["model.safetensors"]
        got = load_file(str(out / "model.safetensors"))
    assert got.keys() == ref.keys()
    for k, v in ref.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("step", KILL_STEPS)
def test_killed_consolidate_leaves_no_partial_output(ckpt, kills, step, layout):
    """SIGKILL inside the first file, after the first complete file (one shard of several), and with every file
    written but none renamed: no file under a final name (no partial model.safetensors, no shard without index); the
    next run removes the leftovers and writes the whole output."""
    base, results = kills
    killed, clean = results[f"{step}-{layout}"]
    assert killed["rc"] == -9
    assert _finals(killed["files"]) == []  # not even OUT: the output is staged beside it
    assert any(TAG in f for f in killed["files"])  # the killed run's staging directory is what is left
    assert clean["rc"] == 0
    assert not [f for f in clean["files"] if TAG in f]
    _assert_whole(base / f"{step}-{layout}" / "out", ckpt, layout == "sharded")


@pytest.mark.parametrize("step", ["consolidate_file", "consolidate_commit"])
def test_killed_hf_export_leaves_no_output(ckpt, kills, step):
    """``--hf``: a kill with the weights written leaves no weights and no config.json; the next run's directory
    loads with from_pretrained and gives the LoRA model's logits."""
    from transformers import AutoModelForCausalLM

    base, results = kills
    killed, clean = results[f"{step}-hf"]
    assert killed["rc"] == -9 and _finals(killed["files"]) == []
    assert clean["rc"] == 0
    assert _finals(clean["files"]) == [
        "out", "out/config.json", "out/generation_config.json", "out/model.safetensors"
    ]  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base / f"{step}-hf" / "out")
    with torch.no_grad():
        got = model(input_ids=FIXED_BATCH).logits
    torch.testing.assert_close(got, torch.load(ckpt.parent / "ref_logits.pt"), rtol=1e-5, atol=1e-5)


def test_killed_single_file_format_leaves_no_output(ckpt, kills):
    """``--format torch`` (one file): killed with the file written under its temporary name, nothing is at ``OUT``;
    the next run removes the temporary and writes a file ``torch.load`` reads whole."""
    base, results = kills
    killed, clean = results["torch"]
    assert killed["rc"] == -9 and _finals(killed["files"]) == [] and len(killed["files"]) == 1
    assert clean["rc"] == 0 and list(clean["files"]) == ["out"]
    got = torch.load(base / "torch" / "out")
    ref = full_state_dict(ckpt)
    assert got.keys() == ref.keys() and all(torch.equal(got[k], v) for k, v in ref.items())


def test_leftovers_of_a_live_writer_are_kept_and_links_never_followed(tmp_path):
    """The next run removes a dead run's temporaries (their flock is free), never a live writer's, and removes a
    planted link of our naming without touching its target."""
    from zeroshard.checkpoint.atomic_write import StagedDir, clean_leftovers

    out = tmp_path / "out"
    live = StagedDir(out, lambda n: False, set())
    dead = tmp_path / f".out.{TAG}{'0' * 16}"
    dead.mkdir()
    (dead / "model.safetensors").write_bytes(b"partial")
    target = tmp_path / "precious"
    target.write_text("keep")
    (tmp_path / f".out.{TAG}{'1' * 16}").symlink_to(target)
    removed = clean_leftovers(tmp_path, "out")
    assert sorted(removed) == [dead.name, f".out.{TAG}{'1' * 16}"]
    assert live.stage.is_dir() and target.read_text() == "keep"
    live.write("model.safetensors", b"x")
    assert live.commit() == [out / "model.safetensors"] and _names(tmp_path) == ["out", "precious"]


def test_replacing_a_previous_output_in_place(ckpt, kills):
    """Into a directory holding a user's file and a single-file output, a sharded one: a kill before the commit leaves
    the previous output unchanged; a kill inside the commit (renames only) leaves neither model.safetensors nor an
    index (nothing a loader takes for complete; the documented window); the next run writes the whole sharded output.
    A single file again removes every older shard and the index. The user's file is never touched."""
    base, results = kills
    single, before_commit, in_commit, sharded, single_again = results["in-place"]
    assert [r["rc"] for r in results["in-place"]] == [0, -9, -9, 0, 0]
    previous = single["files"]
    assert _finals(previous) == ["out", "out/model.safetensors", "out/tokenizer.json"]
    assert {f: h for f, h in before_commit["files"].items() if TAG not in f} == previous
    left = _finals(in_commit["files"])
    assert f"out/{INDEX_JSON}" not in left and "out/model.safetensors" not in left and "out/tokenizer.json" in left
    assert len([f for f in left if "-of-" in f]) == 1  # the first shard renamed in, its index not yet
    shards = [f for f in _finals(sharded["files"]) if "-of-" in f]
    assert len(shards) > 2 and _finals(sharded["files"]) == sorted(
        ["out", f"out/{INDEX_JSON}", *shards, "out/tokenizer.json"]
    )
    assert not [f for f in sharded["files"] if TAG in f]  # the killed runs' staging directories were removed
    assert _finals(single_again["files"]) == _finals(previous)
    assert single_again["files"]["out/model.safetensors"] == previous["out/model.safetensors"]
    assert single_again["files"]["out/tokenizer.json"] == previous["out/tokenizer.json"]


def test_checks_run_before_the_first_byte(ckpt, tmp_path):
    """A re-sealed index whose lora_A shape was changed with the same element count (so the layout checks pass):
    the export fails naming the layer before anything is written (the old code failed in the matmul, mid-file)."""

    def edit(index: dict) -> None:
        for entry in index["flat_params"]:
            for i, name in enumerate(entry["names"]):
                if name.endswith("h.1.attn.c_attn.lora_A.default.weight"):
                    r, n = entry["shapes"][i]
                    entry["shapes"][i] = [r * 2, n // 2]

    bad = _hostile(ckpt, tmp_path, edit)
    with pytest.raises(ValueError, match=r"LoRA layer transformer\.h\.1\.attn\.c_attn: .*shapes do not merge"):
        export_hf(bad, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert [n for n in _names(tmp_path) if TAG in n] == []  # the staging directory was not even created


def test_streamed_files_read_back_with_safetensors(ckpt, tmp_path):
    """The streamed writer's files (sharded, cast to bf16) read back with the safetensors library; the index names
    every shard and tensor."""
    from zeroshard.consolidate import consolidate

    out = tmp_path / "out"
    consolidate(ckpt, out, dtype=torch.bfloat16, max_shard_size=20_000)
    index = json.loads((out / INDEX_JSON).read_text())
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "pt") as f:
            assert f.get_tensor(name).dtype == torch.bfloat16
