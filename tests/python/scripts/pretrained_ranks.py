"""Rank worker for the rank-relevant loading tests: MiniLM built on meta, sharded by ZeroEngine, pretrained weights
loaded per shard, sentence embeddings computed with whole parameters.

Usage (one process per rank, started by ``launch.run_ranks``):
    pretrained_ranks.py OUT_DIR

Cases (one process group, one after the other):
    s3_direct: stage 3 (units: encoder layers), ``load_pretrained(model, dir)`` after the engine is built.
    s3_recorded: stage 3, ``load_pretrained`` on the meta model (records); ZeroEngine applies it when it shards.
    s3_recorded_sub: stage 3 over a wrapper holding the MiniLM as ``.model``; recorded on ``.model``.
    s2_direct: stage 2, ``load_pretrained(model, dir)`` after the engine is built.
Writes ``rank{r}.json``: per case the report's mode, bytes_read, bytes_total, loaded count and the embeddings of
the fixed sentences; rank 0 adds ``reference``: the embeddings of an eager model loaded plainly.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from minilm import Layer, MiniLM, Wrapped, load_config, package_dir, token_ids

import zeroshard
from zeroshard.meta_init import init_meta_context
from zeroshard.pretrained import apply_recorded_pretrained, load_pretrained

SENTENCES = ["a cat sat on the mat", "a dog sat on the mat", "the stock market fell sharply today"]


def inputs(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    ids = [token_ids(model_dir, s) for s in SENTENCES]
    t = max(map(len, ids))
    x = torch.tensor([i + [0] * (t - len(i)) for i in ids])
    return x, (x != 0).long()


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_dir = package_dir()
    cfg = load_config(model_dir)
    x, mask = inputs(model_dir)
    result: dict = {}

    for case in ("s3_direct", "s3_recorded", "s3_recorded_sub", "s2_direct"):
        torch.manual_seed(0)
        with init_meta_context():
            model = Wrapped(cfg) if case.endswith("_sub") else MiniLM(cfg)
        assert all(p.is_meta for p in model.parameters())
        if "recorded" in case:
            target = model.model if case.endswith("_sub") else model
            recorded = load_pretrained(target, model_dir)
            assert recorded.mode == "recorded" and recorded.bytes_read == 0, recorded
        stage = 3 if case.startswith("s3") else 2
        engine = zeroshard.ZeroEngine(
            model,
            torch.optim.AdamW(model.parameters()),
            zeroshard.ZeroConfig(stage=stage, wrap_policy=Layer if stage == 3 else None),
        )
        if "recorded" in case:
            reports = engine.pretrained_reports  # the engine applied the record right after sharding the model
            assert len(reports) == 1, reports
            report = reports[0]
            assert apply_recorded_pretrained(engine) == [], "the record must be consumed"
        else:
            report = load_pretrained(model, model_dir)
        model.eval()
        with torch.no_grad(), zeroshard.gathered_parameters(model):
            emb = model(x, mask)
        result[case] = {
            "mode": report.mode,
            "bytes_read": report.bytes_read,
            "bytes_total": report.bytes_total,
            "loaded": len(report.loaded),
            "skipped": report.skipped,
            "embeddings": emb.tolist(),
        }
        engine.remove_hooks()
        dist.barrier()

    if rank == 0:
        ref = MiniLM(cfg).eval()
        load_pretrained(ref, model_dir)
        with torch.no_grad():
            result["reference"] = ref(x, mask).tolist()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
