"""Rank worker for tests/python/test_faults_checkpoint_paths.py: saves into hostile or damaged directories.

Usage:
    ckpt_paths.py saves OUT    in order, printing (rank 0) what each step left:
        1. a first save to OUT/first whose rank 1 fails writing (disk full, injected): ``FIRST_SAVE_ERROR <message>``
        2. save A to OUT/ck
        3. save B whose commit fails after ``LATEST.tmp`` is written (injected): ``COMMIT_ERROR <message>``,
           ``AFTER_FAILED_COMMIT <entries of OUT/ck>``, ``LOADS <tag>``
        4. save C: ``AFTER_NEXT_SAVE <entries>``, ``LOADS <tag>``
        5. plant OUT/ck/LATEST.tmp as a symbolic link to OUT/outside.txt, save D: ``OUTSIDE <its text>``,
           ``LATEST_IS_LINK <bool>``, ``LOADS <tag>``, ``AFTER_PLANTED <entries>``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from ckpt_faults import make_engine, train_step  # noqa: E402

from zeroshard.checkpoint import checkpoint_dir, sharded_checkpoint  # noqa: E402
from zeroshard.checkpoint.sharded_checkpoint import load_sharded, save_sharded  # noqa: E402


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


def entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def loads(path: Path) -> None:
    say(f"LOADS {load_sharded(make_engine(5), path)['tag']}")


def saves(out: Path) -> None:
    engine = make_engine(0)
    train_step(engine, 1)

    real_save_file = sharded_checkpoint.save_file
    if dist.get_rank() == 1:

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device (injected)")

        sharded_checkpoint.save_file = full
    try:
        save_sharded(engine, out / "first", {"tag": "first"})
        raise AssertionError("the save did not fail")
    except OSError as e:
        say(f"FIRST_SAVE_ERROR {e}")
    sharded_checkpoint.save_file = real_save_file

    ck = out / "ck"
    save_sharded(engine, ck, {"tag": "A"})
    train_step(engine, 2)

    real_write = checkpoint_dir.write_durable
    if dist.get_rank() == 0:

        def written_then_failed(path, data):  # LATEST.tmp complete, then os.replace fails
            real_write(path, data)
            raise OSError(5, "Input/output error (injected, after LATEST.tmp was written)")

        checkpoint_dir.write_durable = written_then_failed
    try:
        save_sharded(engine, ck, {"tag": "B"})
        raise AssertionError("the commit did not fail")
    except OSError as e:
        say(f"COMMIT_ERROR {e}")
    checkpoint_dir.write_durable = real_write
    say(f"AFTER_FAILED_COMMIT {entries(ck)}")
    loads(ck)

    save_sharded(engine, ck, {"tag": "C"})
    say(f"AFTER_NEXT_SAVE {entries(ck)}")
    loads(ck)

    outside = out / "outside.txt"
    if dist.get_rank() == 0:
        outside.write_text("precious, outside the checkpoint")
        (ck / "LATEST.tmp").symlink_to(outside)
    dist.barrier()
    save_sharded(engine, ck, {"tag": "D"})
    say(f"OUTSIDE {outside.read_text()}")
    say(f"LATEST_IS_LINK {(ck / 'LATEST').is_symlink()}")
    loads(ck)
    say(f"AFTER_PLANTED {entries(ck)}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"saves": saves}[mode](out)
    if dist.is_initialized():
        dist.destroy_process_group()
