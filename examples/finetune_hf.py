"""Fine-tune a Hugging Face causal LM with a Lightning Trainer and zeroshard, then hand it back to Hugging Face.

    python examples/finetune_hf.py                                  # tiny GPT-2 from a config, ZeRO-3, 2 CPU ranks
    python examples/finetune_hf.py --init_from runs/finetune_hf/hf --lora --out runs/lora   # LoRA on that export
    python examples/finetune_hf.py --arch llama --stage 2

The model is built from a config (no hub access needed) in ``configure_model``, so at ZeRO stage 3 it is built on the
meta device and each rank allocates only its shards. ``--init_from DIR`` (a ``save_pretrained`` or ``--hf`` export
directory) loads weights with ``zeroshard.load_pretrained``: at stage 3 each rank reads only its shards' slices.
``--lora`` trains ``peft`` LoRA adapters only. Tokens are bytes (vocabulary 256) of real text: this Python's own
standard library, as in ``train_gpt.py`` (``--data FILE`` for another text).

At the end: ``trainer.save_checkpoint(OUT/ckpt)`` (sharded, each rank its own shards), then rank 0 runs
``python -m zeroshard.consolidate OUT/ckpt OUT/hf --hf`` (LoRA merged into the weights), reloads ``OUT/hf`` with
``transformers.AutoModelForCausalLM.from_pretrained``, checks its logits against the trained model's and prints a
sample from it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # data.py, train_gpt.py sit beside this file, any cwd

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data import ByteTextDataModule  # noqa: E402
from lit_gpt import WarmupCosine  # noqa: E402
from train_gpt import full_parameters  # noqa: E402

ARCHS = {"gpt2": ("c_attn",), "llama": ("q_proj", "v_proj")}  # LoRA targets: the attention input projections


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    m = p.add_argument_group("model")
    m.add_argument("--arch", choices=sorted(ARCHS), default="gpt2")
    m.add_argument("--n_layer", type=int, default=4)
    m.add_argument("--n_head", type=int, default=4)
    m.add_argument("--n_embd", type=int, default=128)
    m.add_argument("--block_size", type=int, default=128)
    m.add_argument("--init_from", default=None, help="a from_pretrained directory (its config.json sets the model)")
    m.add_argument("--lora", action="store_true", help="train peft LoRA adapters only (base weights frozen)")
    m.add_argument("--lora_r", type=int, default=8)
    m.add_argument("--lora_alpha", type=int, default=16)
    t = p.add_argument_group("training")
    t.add_argument("--batch_size", type=int, default=16, help="per rank")
    t.add_argument("--max_steps", type=int, default=150)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup_steps", type=int, default=15)
    t.add_argument("--seed", type=int, default=1337)
    t.add_argument("--data", default=None, help="a text file; default: this Python's stdlib sources")
    t.add_argument("--max_bytes", type=int, default=2 * 1024 * 1024, help="corpus cap in bytes")
    s = p.add_argument_group("hardware and strategy")
    s.add_argument("--accelerator", default="cpu")
    s.add_argument("--devices", type=int, default=2)
    s.add_argument("--precision", default="32-true")
    s.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    o = p.add_argument_group("output")
    o.add_argument("--out", default="runs/finetune_hf", help="OUT/ckpt (sharded) and OUT/hf (from_pretrained)")
    o.add_argument("--export_dtype", default=None, choices=["fp32", "bf16", "fp16"], help="--dtype of the export")
    o.add_argument("--sample_tokens", type=int, default=200)
    o.add_argument("--prompt", default="def ")
    return p.parse_args(argv)


def make_config(args: argparse.Namespace):
    """A tiny config of ``--arch`` over byte tokens (vocabulary 256; token 0, NUL, never occurs in text: BOS/EOS)."""
    from transformers import AutoConfig

    if args.init_from:
        return AutoConfig.from_pretrained(args.init_from)
    common = {"vocab_size": 256, "bos_token_id": 0, "eos_token_id": 0}
    if args.arch == "gpt2":
        return AutoConfig.for_model(
            "gpt2", n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, n_positions=args.block_size,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common,
        )  # fmt: skip
    return AutoConfig.for_model(
        "llama", num_hidden_layers=args.n_layer, num_attention_heads=args.n_head, num_key_value_heads=args.n_head,
        hidden_size=args.n_embd, intermediate_size=4 * args.n_embd, max_position_embeddings=args.block_size,
        pad_token_id=0, **common,
    )  # fmt: skip


def block_class(config) -> type:
    """The transformer block of the config's model type: the ZeRO-3 unit."""
    if config.model_type == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return GPT2Block
    if config.model_type == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer
    raise ValueError(f"no ZeRO-3 unit known for model_type {config.model_type!r}: add its block class here")


class LitHFCausalLM(L.LightningModule):
    """Next-byte cross-entropy on a Hugging Face causal LM held as ``self.model`` (keys ``model.*``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.config = make_config(args)
        self.model = None

    def configure_model(self) -> None:
        if self.model is not None:  # the hook runs again for every fit/validate call
            return
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.config)  # on the meta device at stage 3
        if self.args.init_from:
            import zeroshard

            # on meta: recorded now, read when the strategy shards the model (each rank its shards' slices)
            zeroshard.load_pretrained(model, self.args.init_from)
        if self.args.lora:
            from peft import LoraConfig, get_peft_model

            targets = list(ARCHS[self.config.model_type])
            lora = LoraConfig(
                r=self.args.lora_r, lora_alpha=self.args.lora_alpha, target_modules=targets,
                fan_in_fan_out=self.config.model_type == "gpt2",  # GPT-2's Conv1D stores weights as (in, out)
            )  # fmt: skip
            model = get_peft_model(model, lora)
        self.model = model

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx).logits

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=self.args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        schedule = WarmupCosine(self.args.warmup_steps, self.trainer.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_strategy(args: argparse.Namespace, config):
    from zeroshard import ZeroStrategy

    return ZeroStrategy(stage=args.stage, wrap_policy=block_class(config) if args.stage == 3 else None)


def export_and_reload(args: argparse.Namespace, trained_logits: torch.Tensor, batch: torch.Tensor) -> None:
    """Rank 0: consolidate --hf, from_pretrained, compare logits, print a sample."""
    from transformers import AutoModelForCausalLM

    from zeroshard.consolidate import main as consolidate

    out = Path(args.out)
    cli = [str(out / "ckpt"), str(out / "hf"), "--hf"] + (["--dtype", args.export_dtype] if args.export_dtype else [])
    print(f"\n$ python -m zeroshard.consolidate {' '.join(cli)}")
    consolidate(cli)
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    with torch.no_grad():
        diff = (model(input_ids=batch).logits.float() - trained_logits.float()).abs().max().item()
    n = sum(p.numel() for p in model.parameters())
    print(
        f"from_pretrained({out / 'hf'}): {type(model).__name__}, {n / 1e6:.3f}M parameters, {model.dtype}; "
        f"max |logit difference| vs the trained model on a val batch: {diff:.2e}"
    )
    if args.sample_tokens > 0:
        torch.manual_seed(0)
        prompt = torch.tensor([list(args.prompt.encode() or b"\n")])
        with torch.no_grad():
            ids = model.generate(prompt, max_new_tokens=args.sample_tokens, do_sample=True, top_k=50, temperature=0.8)
        text = bytes(t for t in ids[0].tolist() if t).decode("utf-8", errors="replace")
        print(
            f"\n--- sample from the reloaded model ({args.sample_tokens} bytes after {args.prompt!r}) ---\n{text}\n---"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, cores // max(1, args.devices)))
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    L.seed_everything(args.seed, verbose=False)
    datamodule = ByteTextDataModule(
        args.block_size, args.batch_size, data_path=args.data, max_bytes=args.max_bytes, seed=args.seed
    )
    datamodule.setup("fit")
    module = LitHFCausalLM(args)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=make_strategy(args, module.config),
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=min(50, args.max_steps),
        check_val_every_n_epoch=None,
        limit_val_batches=5,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=10,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=datamodule)
    fit_s = time.perf_counter() - t0
    out = Path(args.out)
    trainer.save_checkpoint(out / "ckpt")  # sharded: a directory, each rank writes its own shards
    batch = next(iter(datamodule.val_dataloader()))[0][:2]
    with full_parameters(module), torch.no_grad():  # stage 3: every rank takes part in the all-gather
        trained_logits = module(batch) if trainer.is_global_zero else None
    if not trainer.is_global_zero:
        return
    val = trainer.callback_metrics.get("val_loss")
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    print(
        f"\n{module.config.model_type} ({'LoRA' if args.lora else 'full'} fine-tune, {trainable / 1e6:.3f}M of "
        f"{total / 1e6:.3f}M parameters trained), ZeRO stage {args.stage}, {trainer.world_size} ranks: "
        f"{args.max_steps} steps in {fit_s:.0f} s, val loss {float(val) if val is not None else float('nan'):.3f}"
    )
    export_and_reload(args, trained_logits, batch)


if __name__ == "__main__":
    main()
