"""Load a target from a local HF-format directory (config.json + safetensors + tokenizer).

The directory layout is what `save_pretrained` writes and what every hub checkpoint of the
Llama / Qwen2 / Qwen3 family ships. Errors name the file and what to do about it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from draftsmith.errors import DraftsmithError
from draftsmith.fileio import read_json
from draftsmith.models.decoder import Decoder, DecoderConfig
from draftsmith.models.rope import rope_inv_freq


@dataclass
class LoadedTarget:
    """A target model ready to run, plus what the rest of Draftsmith needs to know about it."""

    model: Decoder
    tokenizer: object  # transformers tokenizer (chat template included when the model has one)
    target_id: str  # alias or directory name
    path: Path
    weights_hash: str  # short hash of the safetensors index (names, shapes, file sizes)


def read_config(path: Path) -> DecoderConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DraftsmithError(f"{path} has no config.json; expected an HF-format model directory")
    return DecoderConfig.from_hf(read_json(cfg_file, "model config"))


def weights_fingerprint(path: Path) -> str:
    """Cheap, stable id of a checkpoint: hash of file names, sizes and the first MiB of each."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DraftsmithError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise DraftsmithError(
                f"cannot read weights {f}: {_one_line(e)}; the file is corrupt or incomplete, re-create it"
            ) from None
    return state


def load_decoder(
    path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
    linear_backend: str = "auto",
) -> Decoder:
    """The decoder of an HF-format directory, ready for inference (`prepare_inference_`, whose
    `linear_backend` is models/linear.py's: "auto" = oneDNN-prepacked on a CPU)."""
    path = Path(path)
    cfg = read_config(path)
    state = load_state_dict(path)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Decoder(cfg)
    missing = [k for k in model.state_dict() if k not in state and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise DraftsmithError(
            f"weights in {path} are missing {len(missing)} tensors (first: {missing[0]}); "
            "the checkpoint is incomplete or not a Llama/Qwen2/Qwen3 decoder"
        )
    unexpected = [k for k in state if k not in model.state_dict()]
    if unexpected:
        raise DraftsmithError(
            f"weights in {path} have unexpected tensors (first: {unexpected[0]}); "
            "not a Llama/Qwen2/Qwen3 decoder checkpoint"
        )
    expected = model.state_dict()
    wrong = [k for k, v in state.items() if tuple(v.shape) != tuple(expected[k].shape)]
    if wrong:
        k = wrong[0]
        raise DraftsmithError(
            f"weights in {path} do not match its config.json: {k} has shape {tuple(state[k].shape)}, the config "
            f"implies {tuple(expected[k].shape)} ({len(wrong)} tensors differ); fix config.json or use the "
            "checkpoint's own"
        )
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Buffers are not in the checkpoint: rebuild them on the real device. The RoPE
    # frequencies stay float32 whatever the weight dtype (as in HF transformers).
    inv, _ = rope_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    model.inv_freq = inv
    model = model.to(device=device, dtype=dtype).eval()
    model.inv_freq = inv.to(model.device)
    return model.prepare_inference_(linear_backend)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer  # here: importing transformers takes ~2 s, and most importers never load one

    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise DraftsmithError(
            f"cannot load the tokenizer from {path}: none of {', '.join(TOKENIZER_FILES)} is there; "
            "copy the tokenizer files of the checkpoint into that directory"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many types for a broken tokenizer dir
        raise DraftsmithError(f"cannot load the tokenizer from {path}: {_one_line(e)}") from None
