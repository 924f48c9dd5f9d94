"""Preallocated KV cache: a batch of rows with independent lengths.

Layout per layer: k, v = [rows, kv_heads, max_len, head_dim]. A row's committed length is
`lengths[row]`; entries past it are stale and simply overwritten by the next write.
Rollback therefore never copies: it truncates a row's length (gpt-fast's static cache idea,
extended to rows that advance at different speeds).

A free row may `remember` the token ids whose KV it still holds, for automatic prefix caching
(engine/prefix_cache.py). The record lives with the cache, not the engine, so engines that share
one cache see what the others left; anything that hands the row out again (`reset`, `reuse`)
drops it.
"""

from __future__ import annotations

import torch

from draftsmith.errors import DraftsmithError


def free_memory(device: torch.device | str) -> int | None:
    """Bytes a new allocation may take on `device`: CUDA's free memory plus what torch holds
    cached; else the host's MemAvailable (Linux), or less where a cgroup (a container) limits this
    process; None where neither can be read (then nothing is refused)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev)
                       - torch.cuda.memory_allocated(dev))
        except (RuntimeError, AssertionError):
            return None
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_room()
    return room if free is None else free if room is None else min(free, room)


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup memory limit (v2 memory.max, v1
    memory.limit_in_bytes), reclaimable page cache counted as free; None without a limit."""
    def num(path: str) -> int | None:
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            return None
        return int(v) if v.isdigit() else None

    def inactive_file(path: str, key: str) -> int:
        try:
            with open(path) as f:
                for line in f:
                    name, _, v = line.partition(" ")
                    if name == key:
                        return int(v)
        except (OSError, ValueError):
            pass
        return 0

    for limit, usage, stat, key in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current",
                                     "/sys/fs/cgroup/memory.stat", "inactive_file"),
                                    ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                     "/sys/fs/cgroup/memory/memory.usage_in_bytes",
                                     "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        cap, used = num(limit), num(usage)
        if cap is not None and used is not None and cap < 1 << 60:  # (v1 writes "no limit" as a huge number)
            return max(0, cap - used + inactive_file(stat, key))
    return None


class KVCache:
    def __init__(
        self,
        num_layers: int,
        max_rows: int,
        num_kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (max_rows, num_kv_heads, max_len, head_dim)
        need = 2 * num_layers * max_rows * num_kv_heads * max_len * head_dim * torch.empty((), dtype=dtype).element_size()
        free = free_memory(device)
        if free is not None and need > free:
            raise DraftsmithError(
                f"the KV cache for {max_rows} rows (max batch) of {max_len} tokens (max len) needs "
                f"{need / 2**30:.1f} GiB; {torch.device(device).type} memory has {free / 2**30:.1f} GiB free: "
                "lower --max-batch or --max-len (regen: --batch-size or --max-len; profile: --max-batch or "
                "--context-len; LLM(...): max_batch or max_len)")
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = torch.zeros(max_rows, dtype=torch.long)  # [rows], kept on CPU
        self.max_rows = max_rows
        self.max_len = max_len
        self._held: dict[int, torch.Tensor] = {}  # free row -> ids whose KV it holds, oldest first
        self._salt: dict[int, str] = {}  # free row -> the cache_salt its KV was computed under

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def truncate(self, row: int, length: int) -> None:
        """Roll a row back (or forward over already-written entries) to `length` tokens."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside [0, {self.max_len}]")
        self.lengths[row] = length

    def reset(self, row: int) -> None:
        self.lengths[row] = 0
        self._held.pop(row, None)
        self._salt.pop(row, None)

    def remember(self, row: int, ids: list[int], salt: str | None = None) -> None:
        """Row `row` is free and its first len(ids) entries hold the KV of `ids`, computed for a
        request with this `cache_salt` (only a request with the same salt may reuse them)."""
        if len(ids) > self.max_len:
            raise ValueError(f"{len(ids)} ids do not fit a row of {self.max_len}")
        self.reset(row)
        if ids:
            self._held[row] = torch.tensor(ids, dtype=torch.int32)
            if salt is not None:
                self._salt[row] = salt

    def forget(self) -> None:
        """Drop every free row's record: the next requests start with nothing cached."""
        for row in list(self._held):
            self.reset(row)

    def remembered(self, row: int) -> torch.Tensor | None:
        """The ids whose KV a free row holds (int32), or None."""
        return self._held.get(row)

    def salt(self, row: int) -> str | None:
        """The cache_salt of the request whose KV a free row holds (None: none)."""
        return self._salt.get(row)

    def remembered_order(self) -> list[int]:
        """Rows with a record, least recently remembered first."""
        return list(self._held)

    def reuse(self, row: int, n: int) -> None:
        """Hand the row out again keeping its first n entries (n <= what it remembers)."""
        held = self._held.pop(row, None)
        self._salt.pop(row, None)
        if n > (0 if held is None else held.numel()):
            raise ValueError(f"row {row} holds {0 if held is None else held.numel()} remembered tokens, not {n}")
        self.lengths[row] = n

    def check_room(self, rows: torch.Tensor, num_new: int) -> None:
        self.check_need(int(self.lengths[rows].max()) + num_new)

    def check_need(self, need: int) -> None:
        """Raise the user-facing context-limit error if a row would reach `need` tokens."""
        if need > self.max_len:
            raise DraftsmithError(
                f"sequence would reach {need} tokens, over the context limit of {self.max_len}; "
                "shorten the prompt or lower max_tokens"
            )
