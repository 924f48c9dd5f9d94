"""Load a target from a local HF-format directory (config.json + safetensors + tokenizer).

The directory layout is what `save_pretrained` writes and what every hub checkpoint of the
Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Gemma 3 (text) families ships. Errors name the file and what to do about it.
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
from draftsmith.fileio import file_sha256, read_json, write_json_atomic
from draftsmith.models.decoder import Decoder, DecoderConfig
from draftsmith.models.registry import draftsmith_home
from draftsmith.models.rope import rope_inv_freq


@dataclass
class LoadedTarget:
    """A target model ready to run, plus what the rest of Draftsmith needs to know about it."""

    model: Decoder
    tokenizer: object  # transformers tokenizer (chat template included when the model has one)
    target_id: str  # alias or directory name
    path: Path
    weights_hash: str  # content hash of the weights files (`weights_fingerprint`)
    legacy_weights_hash: str | None = None  # the pre-2026-12 first-MiB fingerprint, to read older files


def read_config(path: Path) -> DecoderConfig:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DraftsmithError(f"{path} has no config.json; expected an HF-format model directory")
    return DecoderConfig.from_hf(read_json(cfg_file, "model config"))


HASH_PREFIX = "sha256:"


def weights_fingerprint(path: Path) -> str:
    """The identity of a model's weights: "sha256:" + 32 hex digits of a sha256 over every
    *.safetensors file's name and full content (the sha256 of each file), so any changed byte
    changes it. A file's sha256 is remembered in $DRAFTSMITH_HOME/weights-sha256.json under its
    path, size, mtime and inode, so an unchanged target is hashed once (~0.5 s per GB)."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode() + b"\0" + _file_sha256(f).encode() + b"\0")
    return HASH_PREFIX + h.hexdigest()[:32]


def same_weights(stored: str | None, current: str | None, legacy: str | None = None) -> bool | None:
    """Whether a stored weights hash names the current weights; None when either is unknown.
    A stored hash of the older kind (no "sha256:" prefix) is compared with `legacy`."""
    if not stored or not current:
        return None
    if stored.startswith(HASH_PREFIX) or legacy is None:
        return stored == current
    return stored == legacy


def _file_sha256(f: Path) -> str:
    st = f.stat()
    key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    memo_file = draftsmith_home() / "weights-sha256.json"
    try:
        memo = json.loads(memo_file.read_text())
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    if key in memo:
        return memo[key]
    memo[key] = file_sha256(f)
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(memo_file, {k: v for k, v in memo.items() if Path(k.split("|")[0]).exists()})
    except OSError:  # a read-only home: hash again next time
        pass
    return memo[key]


def legacy_weights_fingerprint(path: Path) -> str:
    """The fingerprint files written before the content hash carry: names, sizes and the first
    MiB of each file (blind to a change past the first MiB; kept only to recognise them)."""
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
    expected = model.state_dict()  # (once: it was rebuilt for every tensor of the checkpoint)
    missing = [k for k in expected if k not in state and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing:
        raise DraftsmithError(
            f"weights in {path} are missing {len(missing)} tensors (first: {missing[0]}); "
            "the checkpoint is incomplete or not a decoder of a supported family (decoder.SUPPORTED_MODEL_TYPES)"
        )
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        raise DraftsmithError(
            f"weights in {path} have unexpected tensors (first: {unexpected[0]}); "
            "not a decoder of a supported family (decoder.SUPPORTED_MODEL_TYPES) checkpoint"
        )
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
