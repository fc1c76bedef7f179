"""A sharded checkpoint turned into the layouts other tools load, one file at a time.

- `export_pretrained`: ``save_pretrained``'s layout (safetensors shards, their index, ``config.json``),
  which ``AutoModel*.from_pretrained`` loads; for a peft model, the adapter alone
  (``adapter_model.safetensors``, ``adapter_config.json``), which ``PeftModel.from_pretrained`` loads.
- `consolidate`: today's single-file Lightning checkpoint, for a small model or a move to a local run.

Both read the checkpoint's files one at a time (`export_pretrained` never holds more than one
stage's file; `consolidate` gathers everything by definition). The command line::

    lrmp-checkpoint export checkpoints/last.ckpt exported/ --module model
    lrmp-checkpoint consolidate checkpoints/last.ckpt last-full.ckpt

The sharded layout is `lightning_remote_mp.driver.checkpoint`'s; its manifest names the files.
"""

from __future__ import annotations

import argparse
import json
import logging
import pickle
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_remote_mp.errors import WeightsError
from lightning_remote_mp.model.weights import (
    HF_INDEX,
    HF_SINGLE,
    SHARDED_MANIFEST,
    FileTensor,
    TensorFiles,
    iter_tensors,
    read_metadata,
    write_tensors,
)

log = logging.getLogger(__name__)

#: Beside the shards, a split module's HuggingFace config and peft adapter config, by its key.
CONFIG = "{key}.config.json"
ADAPTER_CONFIG = "{key}.adapter_config.json"
_PEFT_HEAD = "base_model.model."


def _manifest(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / SHARDED_MANIFEST).read_text())
    except (OSError, ValueError) as err:
        raise WeightsError(f"{checkpoint} is not an lrmp sharded checkpoint ({SHARDED_MANIFEST}: {err})") from None


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


#: ``save_pretrained``'s default shard size (transformers 5).
MAX_SHARD_SIZE = "50GB"


def export_pretrained(
    checkpoint: str | Path,
    output: str | Path,
    module: str = "model",
    adapter_only: bool | None = None,
    max_shard_size: int | str = MAX_SHARD_SIZE,
) -> list[str]:
    """Write the split module ``module`` of sharded checkpoint ``checkpoint`` as ``save_pretrained``
    writes it, into ``output``; a peft model's adapter alone unless ``adapter_only=False`` (then its
    base model, under its pretrained names). The weights are cut into shards of at most
    ``max_shard_size`` (a shard holds at least one tensor) by huggingface_hub's own splitter, with
    the index's ``total_size`` the tensors' bytes, as transformers writes them; each shard is read
    from the stages' files as it is written, so no more than one is in memory. Returns the files written."""
    started = time.monotonic()
    checkpoint, output = Path(checkpoint), Path(output)
    manifest = _manifest(checkpoint)
    head = "" if module == "<root>" else module + "."
    files = [f for f in manifest["files"] if f["key"] == module]
    if not files:
        keys = sorted({f["key"] for f in manifest["files"]})
        raise WeightsError(f"{checkpoint} holds no split module {module!r}; it holds {keys}")
    peft = (checkpoint / ADAPTER_CONFIG.format(key=module)).is_file()
    adapter = peft if adapter_only is None else adapter_only and peft
    base = (manifest.get("bases") or {}).get(module)
    if base is not None and not adapter:
        raise WeightsError(
            f"{checkpoint} holds no frozen base of {module!r}: a QLoRA checkpoint holds what training changes; its "
            f"4-bit base is in {base.get('pretrained') or 'the files the model was loaded from'}. Export the adapter "
            "(without --with-base) and load it over that base with PeftModel.from_pretrained"
        )
    output.mkdir(parents=True, exist_ok=True)
    stored = TensorFiles.of(checkpoint, [f["file"] for f in files])
    sources = {  # the name it is exported under -> where it is in the checkpoint
        k[len(head) :]: stored.tensors[k]
        for k, file in manifest["tensors"].items()
        if k.startswith(head) and k in stored.tensors and any(f["file"] == file for f in files)
    }
    if adapter:
        names = _adapter_names(checkpoint, module)
        tensors = dict(_read({out: sources[k] for k, out in names.items() if k in sources}))
        write_tensors(str(output), "adapter_model.safetensors", tensors, {"format": "pt"})
        shutil.copyfile(checkpoint / ADAPTER_CONFIG.format(key=module), output / "adapter_config.json")
        written = ["adapter_model.safetensors", "adapter_config.json"]
    else:
        if peft:
            sources = {
                k.replace(".base_layer.", ".").removeprefix(_PEFT_HEAD): v
                for k, v in sources.items()
                if "lora_" not in k
            }
        written = _write_shards(sources, output, max_shard_size, started)
        config = checkpoint / CONFIG.format(key=module)
        if config.is_file():
            shutil.copyfile(config, output / "config.json")
            written.append("config.json")
    log.info("exported %r of %s to %s in %.1f s: %s", module, checkpoint, output, time.monotonic() - started, written)
    return written


def _read(sources: Mapping[str, FileTensor]) -> Iterator[tuple[str, torch.Tensor]]:
    return iter_tensors({name: (t.path, t.name) for name, t in sources.items()})


def _write_shards(
    sources: Mapping[str, FileTensor], output: Path, max_shard_size: int | str, started: float
) -> list[str]:
    """``save_pretrained``'s layout of ``sources``: ``model.safetensors``, or shards and their index."""
    try:
        from huggingface_hub import split_torch_state_dict_into_shards
    except ImportError:  # one shard of everything, as a small model's save_pretrained writes it
        shards = {HF_SINGLE: list(sources)}
        index = None
    else:
        meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in sources.items()}
        split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size)
        shards = split.filename_to_tensors
        index = {"metadata": split.metadata, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        if not split.is_sharded:
            index = None
    written = []
    for n, (name, members) in enumerate(shards.items(), 1):
        size = write_tensors(str(output), name, dict(_read({m: sources[m] for m in members})), {"format": "pt"})
        log.info("%s (%.1f MB, %d of %d): %.1f s", name, size / 1e6, n, len(shards), time.monotonic() - started)
        written.append(name)
    if index is not None:
        (output / HF_INDEX).write_text(json.dumps(index, indent=2))
        written.append(HF_INDEX)
    return written


def _adapter_names(checkpoint: Path, module: str) -> dict[str, str]:
    """The tensors of the split peft model ``module`` of ``checkpoint`` that peft's own
    ``save_pretrained`` writes (LoRA's, ``modules_to_save``, resized embeddings), by state-dict key,
    to the names it writes them under: asked of peft, over the model built on the meta device from
    the configs beside the shards."""
    import peft
    import transformers
    from peft.utils import get_peft_model_state_dict

    config = transformers.AutoConfig.from_pretrained(checkpoint / CONFIG.format(key=module))
    adapter = json.loads((checkpoint / ADAPTER_CONFIG.format(key=module)).read_text())
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    if architecture is None:
        raise WeightsError(
            f"{checkpoint}: the config of {module!r} names no transformers architecture ({config.architectures}), "
            "which exporting its adapter needs; export the whole model with adapter_only=False (--with-base)"
        )
    base = str(adapter.get("base_model_name_or_path") or "")
    config._name_or_path = base  # not the config file's path, which peft would record and look at
    peft_config = peft.PeftConfig.from_peft_type(**adapter)
    with torch.device("meta"):
        model = peft.get_peft_model(architecture(config), peft_config)
    state = model.state_dict()
    keys = {id(v): k for k, v in state.items()}
    # peft saves a resized embedding ("auto"), which it sees against the base model's config: here
    # only when that is a local directory (a hub name would be looked up over the network).
    embeddings = "auto" if Path(base).is_dir() else False
    adapter_state = get_peft_model_state_dict(model, state_dict=state, save_embedding_layers=embeddings)
    return {keys[id(v)]: out for out, v in adapter_state.items()}


def consolidate(checkpoint: str | Path, output: str | Path, trust_pickle: bool = False) -> None:
    """Write sharded checkpoint ``checkpoint`` as one ordinary Lightning checkpoint file ``output``
    (every weight under its ``state_dict`` key, the workers' optimizer state under the local
    optimizer's parameter positions), as a full checkpoint would have been written. Lightning's part
    is loaded with ``weights_only``; ``trust_pickle`` loads one that holds other Python objects."""
    checkpoint = Path(checkpoint)
    manifest = _manifest(checkpoint)
    lightning_state = checkpoint / manifest["lightning_state"]
    try:  # Lightning's own state: tensors and plain values, unless the user's hyperparameters hold objects
        state = torch.load(lightning_state, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as err:
        raise WeightsError(
            f"{lightning_state} holds Python objects besides tensors and plain values (hyperparameters?), which "
            f"loading would run as code: if you trust it, pass trust_pickle=True (--trust-pickle). {err}"
        ) from None
    optimizers = state.get("optimizer_states", [])
    positions = manifest.get("optimizers", {})
    for entry in manifest["files"]:
        scalars = (read_metadata(str(checkpoint / entry["file"])) or {}).get("scalars", {})
        for key, value in [*_load(checkpoint / entry["file"]).items(), *scalars.items()]:
            if key.startswith("optimizer."):
                _, index, rest = key.split(".", 2)
                name, _, field = rest.rpartition(".")
                at = positions.get(index, {}).get(name)
                if at is not None and int(index) < len(optimizers):
                    optimizers[int(index)]["state"].setdefault(at, {})[field] = value
            elif manifest["tensors"].get(key) == entry["file"]:
                state["state_dict"][key] = value
    for alias, key in manifest.get("aliases", {}).items():  # a tied weight, under each of its names
        state["state_dict"][alias] = state["state_dict"][key]
    torch.save(state, output)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lrmp-checkpoint", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a split module as save_pretrained does (a peft model: its adapter)")
    export.add_argument("checkpoint")
    export.add_argument("output")
    export.add_argument("--module", default="model", help="the split module's name (default: model)")
    export.add_argument("--with-base", action="store_true", help="a peft model: its base weights, not the adapter")
    export.add_argument(
        "--max-shard-size",
        default=MAX_SHARD_SIZE,
        help=f"the largest shard (default {MAX_SHARD_SIZE}, as save_pretrained)",
    )
    merge = sub.add_parser("consolidate", help="write one single-file Lightning checkpoint")
    merge.add_argument("checkpoint")
    merge.add_argument("output")
    merge.add_argument("--trust-pickle", action="store_true", help="load Lightning's state even if it holds objects")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "export":
            export_pretrained(
                args.checkpoint,
                args.output,
                args.module,
                adapter_only=False if args.with_base else None,
                max_shard_size=args.max_shard_size,
            )
        else:
            consolidate(args.checkpoint, args.output, trust_pickle=args.trust_pickle)
    except WeightsError as err:
        parser.exit(2, f"lrmp-checkpoint: {err}\n")


if __name__ == "__main__":
    main()
