"""Fine-tune a pretrained HuggingFace causal LM from a local directory, the way a model too big for
any one machine is fine-tuned: the driver holds no weights.

    python examples/finetune_pretrained.py                         # a tiny Llama it saves itself, two local workers
    python examples/finetune_pretrained.py --lora                  # train a LoRA adapter only (peft)
    python examples/finetune_pretrained.py --qlora                 # QLoRA: LoRA over a 4-bit NF4 base (bitsandbytes)
    python examples/finetune_pretrained.py --model /models/llama --hosts tcp://10.0.0.5:5555 tcp://10.0.0.6:5555

What happens:

1. With no ``--model``, the script saves a tiny Llama with ``save_pretrained`` (sharded safetensors and
   their index, as a real checkpoint from the hub is laid out) and uses that directory: nothing is
   downloaded.
2. The LightningModule builds the model **on the meta device** from the directory's config: the
   driver allocates no weight. (``AutoModelForCausalLM.from_pretrained(path)`` works too; it maps the
   files into the driver's memory instead.) With ``--lora``, peft adds its adapters. With
   ``--qlora``, the model is ``from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
   ...), device_map="meta")``: its linear layers are bitsandbytes' 4-bit ones, still without weights,
   and each worker quantizes its stage's weights to NF4 as it reads them.
3. ``RemoteModelParallelStrategy(split=["model"], pretrained=path)`` traces the model and each worker
   reads **only its own stage's tensors** from the files, by name. Every worker must see the files
   at that path (the same machine, a shared file system, or a copy). The adapters, which the files
   do not hold, come from the driver.
4. ``state_dict_type="sharded"``: every checkpoint is a directory each worker writes its stage into;
   ``ModelCheckpoint(save_last=True)`` keeps ``checkpoints/last.ckpt``.
5. ``trainer.predict`` writes a few answers with the model's own ``generate()``, through the
   workers: each keeps the key/value cache of its own layers (docs/generation.md).
6. At the end, ``lightning_remote_mp.model.convert.export_pretrained`` turns the last checkpoint into
   ``save_pretrained``'s layout (or, with ``--lora`` and ``--qlora``, the adapter alone), one file at a
   time, and the script loads it back with ``from_pretrained`` (``PeftModel.from_pretrained``, over the
   4-bit base with ``--qlora``) to show it works.

Needs ``pip install -e ".[hf]"`` (transformers; peft for ``--lora``; bitsandbytes too for ``--qlora``:
``pip install -e ".[qlora]"``).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_remote_mp import RemoteModelParallelStrategy
from lightning_remote_mp.model.convert import export_pretrained

VOCAB, SEQ = 128, 16


def save_tiny_llama(directory: str) -> str:
    """A tiny Llama saved as a pretrained model is: sharded safetensors with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="100KB")
    return directory


class Counting(Dataset):
    """Sequences where each token is the previous plus one: a pattern a tiny model learns in seconds."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(SEQ) + i * 7) % VOCAB
        return {"input_ids": ids, "labels": ids}


def four_bit() -> object:
    """QLoRA's base: NF4 with double quantization, computed in float32 (bfloat16 on a GPU)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )


class FineTune(L.LightningModule):
    def __init__(self, path: str, lora: bool, qlora: bool = False) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        if qlora:  # bitsandbytes' 4-bit layers, on the meta device: each worker quantizes its stage
            import peft

            model = AutoModelForCausalLM.from_pretrained(path, quantization_config=four_bit(), device_map="meta")
            model = peft.prepare_model_for_kbit_training(model)
        else:
            with torch.device("meta"):  # the shapes only: the workers read the weights
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        if lora or qlora:
            import peft

            config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
            model = peft.get_peft_model(model, config)
            # The adapters were made on the meta device too: give them values here (they are small).
            for module in model.modules():
                if hasattr(module, "lora_A"):
                    for part in (module.lora_A, module.lora_B):
                        part.to_empty(device="cpu")
                    module.reset_lora_parameters("default", True)
        model.train()  # from_config/from_pretrained return eval mode
        self.model = model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Continue each prompt: transformers' own generate(), the key/value cache on the workers."""
        return self.model.generate(batch["input_ids"][:, :4], max_new_tokens=8, do_sample=False, pad_token_id=0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3)


def main(
    model: str | None = None,
    hosts: Sequence[str] | None = None,
    lora: bool = False,
    epochs: int = 2,
    workdir: str | None = None,
    qlora: bool = False,
) -> str:
    workdir = workdir or tempfile.mkdtemp(prefix="lrmp-finetune-")
    path = model or save_tiny_llama(os.path.join(workdir, "pretrained"))
    strategy = RemoteModelParallelStrategy(
        hosts=list(hosts) if hosts else None,
        split=["model"],
        microbatches=2,
        pretrained=path,
        state_dict_type="sharded",
    )
    checkpoints = ModelCheckpoint(dirpath=os.path.join(workdir, "checkpoints"), save_last=True)
    trainer = L.Trainer(
        strategy=strategy,
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        callbacks=[checkpoints],
        enable_model_summary=False,
    )
    module = FineTune(path, lora, qlora)
    trainer.fit(module, DataLoader(Counting(), batch_size=8))
    # A few answers, written by the workers from the trained weights, which are only in the checkpoint:
    # the model is on the meta device here (the data counts up by one).
    prompts = DataLoader([Counting()[i] for i in (0, 3)], batch_size=2)
    last = os.path.join(workdir, "checkpoints", "last.ckpt")
    for row in torch.cat(trainer.predict(module, prompts, ckpt_path=last)).tolist():
        print(f"prompt {row[:4]} -> {row[4:]}")
    exported = os.path.join(workdir, "exported")
    export_pretrained(os.path.join(workdir, "checkpoints", "last.ckpt"), exported)

    from transformers import AutoModelForCausalLM

    if lora or qlora:
        import peft

        kwargs = {"quantization_config": four_bit()} if qlora else {}
        reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, **kwargs), exported)
    else:
        reloaded = AutoModelForCausalLM.from_pretrained(exported)
    with torch.no_grad():
        batch = Counting()[0]
        loss = reloaded(batch["input_ids"][None], labels=batch["labels"][None]).loss
    print(f"exported to {exported}; reloaded with from_pretrained, its loss on a sample: {loss.item():.3f}")
    return exported


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a save_pretrained directory (default: a tiny Llama saved here)")
    parser.add_argument("--hosts", nargs="+", help="worker addresses (default: two local workers)")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter only")
    parser.add_argument("--qlora", action="store_true", help="train a LoRA adapter over a 4-bit NF4 base")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workdir", help="where checkpoints and the export go (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main(args.model, args.hosts, args.lora, args.epochs, args.workdir, args.qlora)
