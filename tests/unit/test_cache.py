"""Feature cache: round trip vs the target, online == offline, validation, corruption,
estimate, bounded writer memory, resume. Uses a tiny random checkpoint and synthetic regen
records (cache does not care who wrote the answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from draftsmith.data.cache import (
    MANIFEST,
    CacheConfig,
    FeatureCache,
    directory_bytes,
    plan_shards,
    run_cache,
)
from draftsmith.data.features import (
    FeatureExtractor,
    FeatureProvider,
    OnlineFeatures,
    default_layer_ids,
    parse_layer_ids,
)
from draftsmith.errors import DraftsmithError

TOL = {"fp32": 1e-5, "fp16": 2e-3, "bf16": 1.6e-2}  # relative to the value (plus the same absolute)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen3", seed=5)  # 3 layers, H=96


@pytest.fixture(scope="module")
def target(tiny):
    from draftsmith.models.target import load_target

    return load_target(str(tiny), device="cpu")


def _records(target, n: int, seed: int = 0, lengths=(9, 40)) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    recs = []
    for i in range(n):
        T = int(torch.randint(lengths[0], lengths[1], (1,), generator=g))
        ids = torch.randint(0, 256, (T,), generator=g).tolist()
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        recs.append({"id": f"r/{seed}/{i}", "source": "test", "split": "train" if i % 4 else "heldout",
                     "input_ids": ids, "loss_mask": mask,
                     "target": {"id": target.target_id, "weights_hash": target.weights_hash}, "format_version": 1})
    return recs


def _write(path: Path, recs) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _direct(target, ids: list[int], layers) -> tuple[dict, torch.Tensor]:
    """Hidden states straight from the decoder: one full forward on a fresh cache."""
    m = target.model
    out = m(torch.tensor([ids]), m.new_cache(1, len(ids)), layer_ids=tuple(layers), compute_logits=False)
    return {i: out.hidden[i][0] for i in layers}, out.final_hidden[0]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: str) -> bool:
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= TOL[dtype] * (1 + b.abs())).all())


def test_default_layers():
    assert default_layer_ids(30) == (1, 14, 27)  # the default target
    assert default_layer_ids(32) == (1, 15, 29)
    assert default_layer_ids(3) == (0, 1, 2)
    assert default_layer_ids(30, 5) == (1, 8, 14, 21, 27)
    assert parse_layer_ids("default", 30) == (1, 14, 27) and parse_layer_ids("27,1", 30) == (1, 27)
    for bad in ("1,30", "1,1", "a"):
        with pytest.raises(DraftsmithError):
            parse_layer_ids(bad, 30)


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_round_trip_equals_target_hidden_states(tiny, target, tmp_path, dtype):
    recs = _records(target, 7, seed=1)
    data = _write(tmp_path / "regen.jsonl", recs)
    out = tmp_path / "cache"
    s = run_cache(CacheConfig(target=str(tiny), data=data, out=out, layers="0,2", dtype=dtype, shard_tokens=40))
    assert s["num_samples"] == 7 and s["shards"] == len(plan_shards([len(r["input_ids"]) for r in recs], 40)) > 2
    fc = FeatureCache(out).validate(target.target_id, target.weights_hash, (0, 2), 96)
    got = {x.id: x for x in fc}
    assert list(got) == [r["id"] for r in recs]  # order kept, every sample once
    for r in recs:
        x = got[r["id"]]
        assert x.input_ids.tolist() == r["input_ids"] and x.loss_mask.tolist() == [bool(v) for v in r["loss_mask"]]
        assert x.split == r["split"] and x.final_hidden.dtype == {"fp32": torch.float32, "fp16": torch.float16,
                                                                   "bf16": torch.bfloat16}[dtype]
        hid, fin = _direct(target, r["input_ids"], (0, 2))
        assert _close(x.final_hidden, fin, dtype)
        assert all(_close(x.hidden[i], hid[i], dtype) for i in (0, 2))
    m = json.loads((out / MANIFEST).read_text())
    assert m["splits"] == {"train": 5, "heldout": 2} and m["split"] == "mixed" and m["complete"]
    assert m["num_tokens"] == sum(len(r["input_ids"]) for r in recs)
    assert m["num_loss_tokens"] == sum(sum(r["loss_mask"]) for r in recs)


def test_layer_convention_matches_hf_hidden_states(tiny, target):
    """Layer i is HF's hidden_states[i + 1]; final_hidden is HF's (normed) hidden_states[-1]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    ids = list(range(5, 40))
    (hid, fin), = FeatureExtractor(target.model, (0, 1), chunk_tokens=16)([ids])  # chunked prefill
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert torch.allclose(hid[0], hs[1][0], atol=1e-4) and torch.allclose(hid[1], hs[2][0], atol=1e-4)
    assert torch.allclose(fin, hs[-1][0], atol=1e-4)


def test_online_equals_offline_and_batching(tiny, target, tmp_path):
    recs = _records(target, 5, seed=2)
    out = tmp_path / "c"
    run_cache(CacheConfig(target=str(tiny), data=_write(tmp_path / "d.jsonl", recs), out=out, dtype="fp32",
                          layers="1"))
    fc = FeatureCache(out)
    with pytest.raises(DraftsmithError, match=r"lack the requested \[0\]"):
        FeatureCache(out, layer_ids=(0, 1))
    on = OnlineFeatures(target, layer_ids=fc.layer_ids).validate(fc.target_id, fc.weights_hash, fc.layer_ids,
                                                                 fc.hidden_size)
    assert isinstance(fc, FeatureProvider) and isinstance(on, FeatureProvider)  # one interface
    batched = {x.id: x for x in on.iter_samples(recs, batch_size=3)}  # right-padded batches
    for r in recs:
        off = fc.features(r)
        for o in (on.features(r), batched[r["id"]]):
            assert torch.equal(o.input_ids, off.input_ids) and torch.equal(o.loss_mask, off.loss_mask)
            assert torch.allclose(o.final_hidden, off.final_hidden, atol=1e-5)
            assert torch.allclose(o.hidden[1], off.hidden[1], atol=1e-5)
    with pytest.raises(DraftsmithError, match="not in the feature cache"):
        fc.features("nope")


def test_manifest_mismatch_and_corrupt_shard_are_clear_errors(tiny, target, tmp_path):
    out = tmp_path / "c"
    run_cache(CacheConfig(target=str(tiny), data=_write(tmp_path / "d.jsonl", _records(target, 6, seed=3)),
                          out=out, dtype="fp16", layers="0,1", shard_tokens=50))
    fc = FeatureCache(out)
    with pytest.raises(DraftsmithError, match=r"target is 'tiny.*', expected 'other'"):
        fc.validate(target_id="other")
    with pytest.raises(DraftsmithError, match="weights hash"):
        fc.validate(weights_hash="0123456789abcdef")
    with pytest.raises(DraftsmithError, match=r"lack the requested \[2\]"):
        fc.validate(layer_ids=(1, 2))
    with pytest.raises(DraftsmithError, match="hidden size is 96, expected 64"):
        fc.validate(hidden_size=64)
    fc.validate(target.target_id, target.weights_hash, (1,), 96)  # a subset of layers is fine
    assert set(next(iter(fc)).hidden) == {1}

    shard = out / "shard-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-10] ^= 0xFF  # flip bits in the data
    shard.write_bytes(bytes(raw))
    fc = FeatureCache(out)
    with pytest.raises(DraftsmithError, match=r"shard shard-00001\.safetensors is corrupt"):
        list(fc)
    shard.unlink()
    with pytest.raises(DraftsmithError, match=r"shard-00001\.safetensors is missing"):
        FeatureCache(out).verify_all()
    (out / MANIFEST).unlink()
    with pytest.raises(DraftsmithError, match="manifest.json is missing"):
        FeatureCache(out)


def test_estimate_within_5_percent_and_bounded_writer(tiny, target, tmp_path, capsys):
    recs = _records(target, 12, seed=4)
    data = _write(tmp_path / "d.jsonl", recs)
    out = tmp_path / "c"
    est = run_cache(CacheConfig(target=str(tiny), data=data, out=out, dtype="bf16", shard_tokens=64, estimate=True))
    assert "bytes" in capsys.readouterr().out and not out.exists()  # nothing written
    s = run_cache(CacheConfig(target=str(tiny), data=data, out=out, dtype="bf16", shard_tokens=64))
    written = directory_bytes(out)
    assert abs(est["estimate"]["total_bytes"] - written) / written < 0.05
    assert est["estimate"]["feature_bytes"] == s["num_tokens"] * 4 * 96 * 2  # 3 layers + final, H=96, bf16
    # Memory: the writer never held more than one shard of tokens.
    assert s["peak_buffered_tokens"] <= 64 and s["shards"] > 4


def test_resume_continues_after_last_complete_shard(tiny, target, tmp_path):
    recs = _records(target, 10, seed=6)
    data = tmp_path / "d.jsonl"
    out = tmp_path / "c"
    cfg = dict(target=str(tiny), data=data, out=out, dtype="fp16", layers="2", shard_tokens=70)
    _write(data, recs[:4])
    run_cache(CacheConfig(**cfg))
    n_shards = len(json.loads((out / MANIFEST).read_text())["shards"])
    # leftovers of a killed run: a temp shard and a renamed shard never listed in the manifest
    (out / ".shard-00099.safetensors.tmp").write_bytes(b"partial")
    (out / f"shard-{n_shards:05d}.safetensors").write_bytes(b"unlisted")
    with pytest.raises(DraftsmithError, match="--resume"):
        run_cache(CacheConfig(**cfg))
    _write(data, recs)
    s = run_cache(CacheConfig(**cfg, resume=True))
    assert s["new_tokens"] == sum(len(r["input_ids"]) for r in recs[4:])
    assert not (out / ".shard-00099.safetensors.tmp").exists()
    with pytest.raises(DraftsmithError, match="cannot resume"):
        run_cache(CacheConfig(**{**cfg, "layers": "1"}, resume=True))
    fresh = tmp_path / "fresh"
    run_cache(CacheConfig(**{**cfg, "out": fresh}))
    a, b = list(FeatureCache(out)), list(FeatureCache(fresh))
    assert [x.id for x in a] == [r["id"] for r in recs] == [x.id for x in b]
    assert all(torch.equal(x.hidden[2], y.hidden[2]) for x, y in zip(a, b))


def test_a_cache_that_fails_before_caching_anything_leaves_nothing_behind(tiny, target, tmp_path):
    """Issue 15 item 6: a failed first run must not leave a manifest that the next run reads as
    an interrupted cache ("not empty; pass --resume")."""
    good = _records(target, 3, seed=4)
    bad = [dict(good[0], id="broken")]
    del bad[0]["input_ids"]
    out = tmp_path / "cache"
    with pytest.raises(DraftsmithError, match="lacks 'input_ids'"):
        run_cache(CacheConfig(target=str(tiny), data=_write(tmp_path / "bad.jsonl", bad), out=out, dtype="fp32"))
    assert not out.exists()  # this run created it: gone
    out.mkdir()  # a directory the user made is kept, emptied of what the job wrote
    with pytest.raises(DraftsmithError):
        run_cache(CacheConfig(target=str(tiny), data=_write(tmp_path / "bad.jsonl", bad), out=out, dtype="fp32"))
    assert out.is_dir() and not any(out.iterdir())
    s = run_cache(CacheConfig(target=str(tiny), data=_write(tmp_path / "good.jsonl", good), out=out, dtype="fp32"))
    assert s["num_samples"] == 3  # no --overwrite or --resume needed


def test_resume_remakes_a_truncated_or_unreadable_shard(tiny, target, tmp_path, capsys):
    """--resume checks every listed shard (size, header, the bytes the header describes): a
    truncated one, or one whose header was overwritten, is dropped and its samples cached again
    (it used to report "0 new tokens", and train then died on a SafetensorError). The result
    equals a cache built in one go; the re-made shard takes a new name."""
    recs = _records(target, 8, seed=7)
    data = _write(tmp_path / "d.jsonl", recs)
    cfg = dict(target=str(tiny), data=data, dtype="fp16", layers="1", shard_tokens=60)
    fresh, out = tmp_path / "fresh", tmp_path / "c"
    run_cache(CacheConfig(**cfg, out=fresh))
    run_cache(CacheConfig(**cfg, out=out))
    m0 = json.loads((out / MANIFEST).read_text())
    assert len(m0["shards"]) >= 4
    first, second = out / m0["shards"][1]["file"], out / m0["shards"][2]["file"]
    with open(first, "r+b") as f:
        f.truncate(1000)
    with open(second, "r+b") as f:
        f.write(b"\xff" * 8)  # a header length past the end of the file
    capsys.readouterr()
    s = run_cache(CacheConfig(**cfg, out=out, resume=True))
    err = capsys.readouterr().err
    assert f"{first} has 1000 bytes, the manifest says {m0['shards'][1]['bytes']}" in err
    assert f"{second} has no readable safetensors header" in err
    lost = m0["shards"][1]["num_tokens"] + m0["shards"][2]["num_tokens"]
    assert s["new_tokens"] == lost and s["num_samples"] == len(recs)
    m = json.loads((out / MANIFEST).read_text())
    assert m["complete"] and len({e["file"] for e in m["shards"]}) == len(m["shards"])
    want = json.loads((fresh / MANIFEST).read_text())
    assert {k: m[k] for k in ("num_samples", "num_tokens", "num_loss_tokens", "splits")} == \
        {k: want[k] for k in ("num_samples", "num_tokens", "num_loss_tokens", "splits")}
    got = {x.id: x for x in FeatureCache(out)}  # every shard's sha256 checked
    assert sorted(got) == sorted(r["id"] for r in recs)
    assert all(torch.equal(got[x.id].hidden[1], x.hidden[1]) for x in FeatureCache(fresh))
    s = run_cache(CacheConfig(**cfg, out=out, resume=True))
    assert s["new_tokens"] == 0  # nothing left to re-make


def test_regen_data_that_is_not_utf8_is_one_error(tiny, target, tmp_path):
    """cache / calibrate --data FILE read it with iter_records: a line that is not UTF-8 was a
    UnicodeDecodeError traceback ('utf-16-le' when json.loads guessed that encoding from a zero
    byte); now an error naming the line. A last line cut inside a character (a killed regen) is
    still skipped as incomplete."""
    import re

    from draftsmith.data.regen_records import iter_records

    good = json.dumps(_records(target, 1)[0]).encode() + b"\n"
    data = tmp_path / "bin.json"
    for bad, why in ((b"caf\xe9\n", "not UTF-8 text; give the JSONL file `draftsmith regen` wrote"),
                     (b"\x9d\x00\x01\x02\n", "not UTF-8 text"), (b"a\x00b\x00\n", "not valid JSON")):
        data.write_bytes(good + bad + good)
        with pytest.raises(DraftsmithError, match=r"bin\.json:2: " + re.escape(why)):
            list(iter_records(data))
    data.write_bytes(good + b"caf\xe9\n")
    with pytest.raises(DraftsmithError, match=r"bin\.json:2: not UTF-8 text"):
        run_cache(CacheConfig(target=str(tiny), data=data, out=tmp_path / "c", dtype="fp32"))
    assert not (tmp_path / "c").exists()
    data.write_bytes(good + good[:-1].replace(b'"', b'"\xc3', 1)[:20])
    assert len(list(iter_records(data))) == 1


def test_regen_data_nested_too_deeply_is_one_error(tiny, target, tmp_path):
    """cache / calibrate --data: a line of 5000 `[` was a RecursionError traceback."""
    from draftsmith.data.regen_records import iter_records, scan_output

    good = json.dumps(_records(target, 1)[0]) + "\n"
    data = tmp_path / "deep.jsonl"
    data.write_text(good + "[" * 5000 + "\n" + good)
    with pytest.raises(DraftsmithError, match=r"deep\.jsonl:2: JSON nested too deeply to read"):
        list(iter_records(data))
    with pytest.raises(DraftsmithError, match=r"deep\.jsonl:2 is not a complete regen record"):
        scan_output(data)  # regen --resume's reading of its output
    data.write_text(good + "[" * 5000)  # an incomplete last line: skipped, as before
    assert len(list(iter_records(data))) == 1


def test_the_rebuild_command_repeats_every_option_that_decides_what_the_cache_holds(tiny, target, tmp_path):
    """The `draftsmith cache --resume` command a damaged shard's error gives (train, the reader)
    named only --target / --data / --layers / --dtype: a cache built with --split, --model-dtype,
    --shard-tokens or --allow-target-mismatch was re-made as another cache (heldout samples in a
    train cache, features of another precision) or refused. It is now the full command, read from
    the manifest; run as given, it re-makes the same cache."""
    import shlex

    from draftsmith.cli import main
    from draftsmith.data.cache import rebuild_command

    recs = _records(target, 8, seed=9)
    recs[1]["target"] = {"id": "other", "weights_hash": "0" * 16}
    data = _write(tmp_path / "my data.jsonl", recs)
    cfg = dict(target=str(tiny), data=data, dtype="fp32", layers="1", shard_tokens=60, split="train",
               model_dtype="bfloat16", allow_target_mismatch=True)
    fresh, out = tmp_path / "fresh", tmp_path / "c"
    run_cache(CacheConfig(**cfg, out=fresh))
    run_cache(CacheConfig(**cfg, out=out))
    m = json.loads((out / MANIFEST).read_text())
    assert m["options"] == {"split": "train", "model_dtype": "bfloat16", "allow_target_mismatch": True,
                            "target": str(target.path)}
    (out / m["shards"][1]["file"]).unlink()
    with pytest.raises(DraftsmithError) as e:
        list(FeatureCache(out))
    cmd = rebuild_command(out, m)
    assert f"re-make it with `{cmd}`" in str(e.value)
    argv = shlex.split(cmd)
    assert argv[:2] == ["draftsmith", "cache"] and "--split" in argv and "--shard-tokens" in argv
    assert main(argv[1:]) == 0
    got, want = json.loads((out / MANIFEST).read_text()), json.loads((fresh / MANIFEST).read_text())
    keys = ("num_samples", "num_tokens", "num_loss_tokens", "splits", "split", "shard_tokens", "dtype", "options")
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert sorted(x.id for x in FeatureCache(out)) == sorted(x.id for x in FeatureCache(fresh))


def test_resume_with_other_options_is_refused_with_the_command_that_resumes_it(tiny, target, tmp_path):
    """--resume with another --split, --shard-tokens or --model-dtype went on and mixed two caches
    in one (a train cache with heldout samples; features of two precisions). It is refused,
    naming what differs and the command that resumes it; --allow-target-mismatch may be added."""
    recs = _records(target, 6, seed=10)
    data = _write(tmp_path / "d.jsonl", recs[:3])
    out = tmp_path / "c"
    cfg = dict(target=str(tiny), data=data, out=out, dtype="fp16", layers="1", shard_tokens=60, split="train")
    run_cache(CacheConfig(**cfg))
    before = (out / MANIFEST).read_bytes()
    for change, what in (({"split": None}, "--split train (this run: all)"),
                         ({"shard_tokens": 100}, "--shard-tokens 60 (this run: 100)"),
                         ({"model_dtype": "bfloat16"}, "computed with the target in float32, this run loads it "
                                                       "in bfloat16")):
        with pytest.raises(DraftsmithError, match="cannot resume") as e:
            run_cache(CacheConfig(**{**cfg, **change}, resume=True))
        assert what in str(e.value) and "--split train --shard-tokens 60 --out" in str(e.value), str(e.value)
        assert (out / MANIFEST).read_bytes() == before
    _write(data, recs)
    s = run_cache(CacheConfig(**cfg, resume=True, allow_target_mismatch=True))
    assert s["num_samples"] == sum(r["split"] == "train" for r in recs)
    assert json.loads((out / MANIFEST).read_text())["options"]["allow_target_mismatch"] is True


def test_resume_keeps_the_allow_target_mismatch_the_cache_was_built_with(tiny, target, tmp_path):
    """A cache built with --allow-target-mismatch and resumed without it was refused at a record
    it had already cached (the data check read only this run's option, not the manifest's)."""
    recs = _records(target, 4, seed=11)
    recs[1]["target"] = {"id": "other", "weights_hash": "0" * 16}
    data = _write(tmp_path / "d.jsonl", recs[:2])
    out = tmp_path / "c"
    cfg = dict(target=str(tiny), data=data, out=out, dtype="fp16", layers="1")
    with pytest.raises(DraftsmithError, match="was regenerated by target 'other'"):
        run_cache(CacheConfig(**cfg))
    assert run_cache(CacheConfig(**cfg, overwrite=True, allow_target_mismatch=True))["num_samples"] == 2
    _write(data, recs)
    assert run_cache(CacheConfig(**cfg, resume=True))["num_samples"] == 4
    assert json.loads((out / MANIFEST).read_text())["options"]["allow_target_mismatch"] is True


def test_regen_data_that_is_a_directory_is_named_as_one(tiny, tmp_path):
    """cache / calibrate --data DIR said "does not exist" of a directory that does."""
    with pytest.raises(DraftsmithError, match="is a directory; give the JSONL file"):
        run_cache(CacheConfig(target=str(tiny), data=tmp_path, out=tmp_path / "c", dtype="fp32"))
    assert not (tmp_path / "c").exists()


def test_an_interrupted_cache_says_how_to_continue(tiny, target, tmp_path, monkeypatch, capsys):
    """Ctrl-C after some shards were written said only "interrupted": it now says what is kept
    and the command that continues it, which completes the same cache."""
    import shlex

    import draftsmith.data.cache as cache_mod
    from draftsmith.cli import main

    recs = _records(target, 8, seed=11)
    data = _write(tmp_path / "d.jsonl", recs)
    cfg = dict(target=str(tiny), data=data, dtype="fp32", layers="1", shard_tokens=40, split="train")
    real, calls = cache_mod.CacheWriter.add, []

    def interrupt_at_the_fifth(self, sample_id, *a):  # (the data is read once before: not record_tensors)
        calls.append(sample_id)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(self, sample_id, *a)

    monkeypatch.setattr(cache_mod.CacheWriter, "add", interrupt_at_the_fifth)
    out = tmp_path / "c"
    with pytest.raises(KeyboardInterrupt):
        run_cache(CacheConfig(**cfg, out=out))
    monkeypatch.setattr(cache_mod.CacheWriter, "add", real)
    err = capsys.readouterr().err
    assert "samples are kept in" in err and "continue with `draftsmith cache " in err
    cmd = err.split("continue with `")[1].split("`")[0]
    assert main(shlex.split(cmd)[1:]) == 0
    run_cache(CacheConfig(**cfg, out=tmp_path / "fresh"))
    assert sorted(x.id for x in FeatureCache(out)) == sorted(x.id for x in FeatureCache(tmp_path / "fresh"))


def test_bad_input_leaves_an_existing_cache_as_it_was(tiny, target, tmp_path):
    """--overwrite deleted the old cache before --data was read or the target loaded: a typo in
    --data, a file with nothing to cache or a bad --model-dtype lost it, then failed. Data with no
    record of --split made an empty 'complete' cache (exit 0). A fresh run whose target fails to
    load left a manifest, so the next run was told '--out is not empty; pass --resume'."""
    good = _records(target, 4, seed=8)
    data = _write(tmp_path / "good.jsonl", good)
    out = tmp_path / "cache"
    run_cache(CacheConfig(target=str(tiny), data=data, out=out, dtype="fp32"))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    train_only = _write(tmp_path / "train.jsonl", [dict(r, split="train") for r in good])
    for change, match in ((dict(data=tmp_path / "typo.jsonl"), "does not exist"),
                          (dict(data=_write(tmp_path / "empty.jsonl", [])), "has no records: nothing to cache"),
                          (dict(data=train_only, split="heldout"), r"no heldout-split records \(4 of other"),
                          (dict(model_dtype="float33"), "unknown dtype 'float33'")):
        with pytest.raises(DraftsmithError, match=match):
            run_cache(CacheConfig(**{"target": str(tiny), "data": data, "out": out, "dtype": "fp32",
                                     "overwrite": True, **change}))
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before, change
    with pytest.raises(DraftsmithError, match="unknown dtype"):
        run_cache(CacheConfig(target=str(tiny), data=data, out=tmp_path / "new", model_dtype="float33"))
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()  # a directory the user made stays, empty
    with pytest.raises(DraftsmithError, match="unknown dtype"):
        run_cache(CacheConfig(target=str(tiny), data=data, out=tmp_path / "mine", model_dtype="float33"))
    assert not any((tmp_path / "mine").iterdir())
    s = run_cache(CacheConfig(target=str(tiny), data=data, out=out, dtype="fp32", overwrite=True))
    assert s["num_samples"] == 4  # a good --overwrite still replaces it


def test_resume_of_a_directory_that_holds_no_cache_says_so(tiny, target, tmp_path):
    """It answered '--out is not empty; pass --resume to continue it' to a command given --resume."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    data = _write(tmp_path / "d.jsonl", _records(target, 2, seed=9))
    with pytest.raises(DraftsmithError, match=r"cannot resume \S+run: it holds no feature cache \(manifest\.json"):
        run_cache(CacheConfig(target=str(tiny), data=data, out=run, resume=True))
    assert [p.name for p in run.iterdir()] == ["config.json"]


def test_an_interrupt_in_a_shard_flush_never_lists_its_samples_twice(tiny, target, tmp_path, monkeypatch):
    """An interrupt (Ctrl-C, SIGTERM) while a shard's manifest entry is written, then close() as
    regen's --features-out does it: the samples were listed a second time in the next shard (the
    buffer was cleared only after the manifest write). Now the shard is left unlisted, the manifest
    holds each id once, and --resume completes the same cache."""
    import draftsmith.data.cache_writer as writer_mod
    from draftsmith.data.cache import open_writer

    recs = _records(target, 6, seed=12)
    data = _write(tmp_path / "d.jsonl", recs)
    cfg = dict(target=str(tiny), data=data, dtype="fp32", layers="1", shard_tokens=10_000)
    out = tmp_path / "c"
    run_cache(CacheConfig(**{**cfg, "data": _write(tmp_path / "first.jsonl", recs[:2])}, out=out))
    writer, done = open_writer(CacheConfig(**cfg, out=out, resume=True), target)
    assert done == {r["id"] for r in recs[:2]}
    for r in recs[2:]:
        hidden, final = _direct(target, r["input_ids"], (1,))
        writer.add(r["id"], r["split"], torch.tensor(r["input_ids"]), torch.tensor(r["loss_mask"]), hidden, final)
    real = writer_mod.write_json_atomic

    def interrupted(path, obj):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer_mod, "write_json_atomic", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writer.flush()
    monkeypatch.setattr(writer_mod, "write_json_atomic", real)
    writer.close(complete=False)
    manifest = json.loads((out / MANIFEST).read_text())
    listed = [i for s in manifest["shards"] for i in s["sample_ids"]]
    assert sorted(listed) == sorted(r["id"] for r in recs[:2]) and manifest["num_samples"] == 2
    run_cache(CacheConfig(**cfg, out=out, resume=True))
    run_cache(CacheConfig(**cfg, out=tmp_path / "fresh"))
    a, b = FeatureCache(out), FeatureCache(tmp_path / "fresh")
    assert sorted(a.sample_ids) == sorted(b.sample_ids) == sorted(r["id"] for r in recs)
    assert all(torch.equal(a.features(i).hidden[1], b.features(i).hidden[1]) for i in a.sample_ids)
