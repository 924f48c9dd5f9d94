"""A stand-in for the ~30-s GGUF conversion (models/registry._convert_gguf), shared by the
registry tests: it copies a tiny model directory into `out`, config.json first."""

from __future__ import annotations

from pathlib import Path


def copy_model(src: Path, out: Path, fail_after: int | None = None,
               exc: BaseException = RuntimeError("simulated crash half way")) -> None:
    """Copy src's files into out; `fail_after=n` copies n files, writes garbage weights and
    raises `exc`, like a conversion dying half way."""
    files = sorted(Path(src).iterdir(), key=lambda p: (p.name != "config.json", p.name))
    for i, f in enumerate(files):
        if i == fail_after:
            (out / "model.safetensors").write_bytes(b"\0" * 64)
            raise exc
        (out / f.name).write_bytes(f.read_bytes())
