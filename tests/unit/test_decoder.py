"""Decoder specification: parity with HF transformers, batched rows, rollback, limits.

The reference is HF's own model run over the whole sequence without a cache (the ground
truth a cached implementation must reproduce). Our side is run the way the engine runs it:
a prefill, then single-token decode steps, then a multi-token verify block.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from draftsmith.errors import DraftsmithError
from draftsmith.kernels.build import cpu_kernels
from draftsmith.models.loading import load_decoder

TOL = 1e-4

VARIANTS = {
    "llama-untied": ("llama", {}),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen2-bias-tied": ("qwen2", {}),
    "qwen2-bias-untied": ("qwen2", dict(tie_word_embeddings=False)),
    "qwen3-qknorm-headdim": ("qwen3", {}),
    "rope-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=10000.0))),
    "rope-llama3": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16, rope_theta=10000.0))),
    "rope-yarn": ("qwen3", dict(max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0))),
}
ROPE_VARIANTS = ("rope-linear", "rope-llama3", "rope-yarn")


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@torch.no_grad()
def _hf_reference(hf, ids: torch.Tensor):
    """Logits, hidden_states and the raw output of the last layer (HF's hidden_states[-1] is normed)."""
    seen = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, a, out: seen.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        out = hf(ids, output_hidden_states=True)
    finally:
        hook.remove()
    return out.logits, out.hidden_states, seen["last"]


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, n), generator=g)


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_hf_prefill_decode_verify(tiny_model_dir, variant):
    mt, overrides = VARIANTS[variant]
    path = tiny_model_dir(mt, **overrides)
    hf, dec = _hf(path), load_decoder(path)
    L = dec.config.num_layers
    ids = _ids(17, dec.config.vocab_size, seed=1)
    ref_logits, ref_hidden, ref_last = _hf_reference(hf, ids)

    cache = dec.new_cache(1, 64)
    layers = tuple(range(L))
    # Prefill 9, then 5 single-token decode steps, then a 3-token verify block.
    chunks = [(0, 9)] + [(i, i + 1) for i in range(9, 14)] + [(14, 17)]
    for a, b in chunks:
        out = dec(ids[:, a:b], cache, layer_ids=layers)
        assert cache.lengths[0].item() == a, "forward must not advance cache lengths"
        cache.lengths[0] = b
        where = f"{variant} tokens {a}:{b}"
        assert _maxdiff(out.logits, ref_logits[:, a:b]) <= TOL, where
        assert _maxdiff(out.final_hidden, ref_hidden[-1][:, a:b]) <= TOL, where
        for i in range(L - 1):  # HF's hidden_states[i + 1] is layer i's output ...
            assert _maxdiff(out.hidden[i], ref_hidden[i + 1][:, a:b]) <= TOL, (where, i)
        # ... except the last entry, which HF replaces by the normed state (= final_hidden).
        assert _maxdiff(out.hidden[L - 1], ref_last[:, a:b]) <= TOL, where


@pytest.mark.parametrize("variant", ROPE_VARIANTS)
def test_rope_scaling_parity_is_not_vacuous(tiny_model_dir, tmp_path, variant):
    """Negative control: the same weights with plain RoPE must visibly differ."""
    mt, overrides = VARIANTS[variant]
    path = tiny_model_dir(mt, **overrides)
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    cfg = json.loads((plain / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (plain / "config.json").write_text(json.dumps(cfg))
    ids = _ids(17, cfg["vocab_size"], seed=2)
    a, b = load_decoder(path), load_decoder(plain)
    la = a(ids, a.new_cache(1, 32)).logits
    lb = b(ids, b.new_cache(1, 32)).logits
    assert _maxdiff(la, lb) > 100 * TOL


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return load_decoder(tiny_model_dir("qwen3", seed=3))


def _solo(dec, prefix: list[int], new: list[int]) -> torch.Tensor:
    """Logits of `new` after `prefix`, run alone in row 0 of a fresh cache."""
    cache = dec.new_cache(1, 64)
    if prefix:
        dec(torch.tensor([prefix]), cache, compute_logits=False)
        cache.lengths[0] = len(prefix)
    return dec(torch.tensor([new]), cache).logits[0]


# consecutive rows (one cache view), a hole (two runs), unsorted (three runs), many runs, and
# the gather path (GPUs, more than MAX_ROW_RUNS runs) forced on this CPU
@pytest.mark.parametrize("rows, gather", [([1, 2, 3], False), ([0, 2, 3], False), ([3, 0, 2], False),
                                          ([0, 2, 4, 6, 8, 10, 12, 14, 16, 18], False),
                                          ([0, 2, 4, 6, 8, 10, 12, 14, 16, 18], True)])
def test_batched_rows_with_independent_lengths_match_solo_runs(qwen3, rows, gather, monkeypatch):
    import draftsmith.models.decoder as decoder_module

    if gather:
        monkeypatch.setattr(decoder_module, "_row_runs", lambda *a, **k: None)
    dec = qwen3
    V = dec.config.vocab_size
    g = torch.Generator().manual_seed(4)
    # different cache lengths (the third row starts empty) and numbers of valid new tokens
    prefix_len = {r: (5, 11, 0)[i % 3] for i, r in enumerate(rows)}
    valid = {r: (4, 2, 1)[i % 3] for i, r in enumerate(rows)}  # the rest is padding
    S = max(valid.values())
    prefixes = {r: torch.randint(0, V, (n,), generator=g).tolist() for r, n in prefix_len.items()}
    new = {r: torch.randint(0, V, (S,), generator=g).tolist() for r in rows}

    cache = dec.new_cache(max(rows) + 1, 64)
    for r in rows:
        if prefixes[r]:
            dec(torch.tensor([prefixes[r]]), cache, rows=torch.tensor([r]), compute_logits=False)
            cache.lengths[r] = len(prefixes[r])
    out = dec(torch.tensor([new[r] for r in rows]), cache, rows=torch.tensor(rows))
    assert [cache.lengths[r].item() for r in rows] == [prefix_len[r] for r in rows]
    for b, r in enumerate(rows):
        n = valid[r]
        solo = _solo(dec, prefixes[r], new[r][:n])
        assert _maxdiff(out.logits[b, :n], solo) <= TOL, f"row {r}"

    # Commit the valid tokens only; the padding written past them must not leak into the next step.
    for r in rows:
        cache.lengths[r] = prefix_len[r] + valid[r]
    nxt = torch.randint(0, V, (len(rows), 1), generator=g)
    out2 = dec(nxt, cache, rows=torch.tensor(rows))
    for b, r in enumerate(rows):
        solo = _solo(dec, prefixes[r] + new[r][: valid[r]], nxt[b].tolist())
        assert _maxdiff(out2.logits[b], solo) <= TOL, f"row {r} after commit"


def test_ragged_batched_prefill_matches_solo(qwen3):
    dec = qwen3
    g = torch.Generator().manual_seed(5)
    lens = [7, 3, 12]
    S = max(lens)
    ids = torch.randint(0, dec.config.vocab_size, (len(lens), S), generator=g)
    out = dec(ids, dec.new_cache(3, 32))
    for b, n in enumerate(lens):
        assert _maxdiff(out.logits[b, :n], _solo(dec, [], ids[b, :n].tolist())) <= TOL


def test_noncontiguous_rows_equal_contiguous(qwen3):
    dec = qwen3
    g = torch.Generator().manual_seed(6)
    V = dec.config.vocab_size
    pa, pb = torch.randint(0, V, (6,), generator=g), torch.randint(0, V, (9,), generator=g)
    step = torch.randint(0, V, (2, 3), generator=g)

    def run(row_a: int, row_b: int):
        cache = dec.new_cache(4, 32)
        for r, p in ((row_a, pa), (row_b, pb)):
            dec(p[None], cache, rows=torch.tensor([r]), compute_logits=False)
            cache.lengths[r] = len(p)
        out = dec(step, cache, rows=torch.tensor([row_a, row_b]), layer_ids=(0, 1))
        single = dec(step[:1, :1], cache, rows=torch.tensor([row_a]))  # one row, one token
        return out, single

    out_nc, single_nc = run(3, 1)
    out_c, single_c = run(0, 1)
    assert _maxdiff(out_nc.logits, out_c.logits) <= TOL
    assert _maxdiff(out_nc.final_hidden, out_c.final_hidden) <= TOL
    assert all(_maxdiff(out_nc.hidden[i], out_c.hidden[i]) <= TOL for i in (0, 1))
    assert _maxdiff(single_nc.logits, single_c.logits) <= TOL
    assert _maxdiff(single_nc.logits[0, 0], out_c.logits[0, 0]) <= TOL


def test_rollback_by_truncating_lengths_equals_fresh_run(qwen3):
    dec = qwen3
    g = torch.Generator().manual_seed(7)
    V = dec.config.vocab_size
    prompt = torch.randint(0, V, (1, 8), generator=g)
    draft = torch.randint(0, V, (1, 5), generator=g)
    cache = dec.new_cache(2, 32)
    row = torch.tensor([1])
    dec(prompt, cache, rows=row, compute_logits=False)
    cache.lengths[1] = 8
    dec(draft, cache, rows=row)  # verify a 5-token draft ...
    cache.truncate(1, 8 + 2)  # ... accept 2, roll the rest back
    correction = torch.randint(0, V, (1, 3), generator=g)
    after = dec(correction, cache, rows=row).logits[0]
    fresh = _solo(dec, prompt[0].tolist() + draft[0, :2].tolist(), correction[0].tolist())
    assert _maxdiff(after, fresh) <= TOL


def test_logit_index_and_compute_logits(qwen3):
    dec = qwen3
    ids = _ids(6, dec.config.vocab_size, seed=8).repeat(2, 1)
    full = dec(ids, dec.new_cache(2, 16))
    idx = torch.tensor([[5], [2]])
    picked = dec(ids, dec.new_cache(2, 16), logit_index=idx)
    assert picked.logits.shape == (2, 1, dec.config.vocab_size)
    assert _maxdiff(picked.logits[0, 0], full.logits[0, 5]) <= TOL
    assert _maxdiff(picked.logits[1, 0], full.logits[1, 2]) <= TOL
    none = dec(ids, dec.new_cache(2, 16), compute_logits=False, layer_ids=(1,))
    assert none.logits is None and set(none.hidden) == {1}
    assert none.final_hidden.shape == (2, 6, dec.config.hidden_size)


def test_context_limit_raises_clear_error(qwen3):
    dec = qwen3
    cache = dec.new_cache(1, 8)
    dec(_ids(6, 100, seed=9), cache, compute_logits=False)
    cache.lengths[0] = 6
    dec(_ids(2, 100, seed=9), cache)  # exactly fills the context: fine
    with pytest.raises(DraftsmithError, match="context limit of 8") as e:
        dec(_ids(3, 100, seed=9), cache)
    assert "\n" not in str(e.value)
    cache.lengths[0] = 8
    with pytest.raises(DraftsmithError, match="context limit"):
        dec(_ids(1, 100, seed=9), cache)


@pytest.mark.parametrize("bad", [272, 10_000, -1])
def test_token_id_outside_vocab_raises(qwen3, bad):
    dec = qwen3
    assert dec.config.vocab_size == 272
    ids = torch.tensor([[1, 2, bad]])
    with pytest.raises(DraftsmithError, match="vocabulary"):
        dec(ids, dec.new_cache(1, 8))


@pytest.mark.parametrize("S", [1, 3])
def test_batched_rows_with_equal_lengths_match_solo(qwen3, S):
    """Rows at the same length take the mask-free (S=1) / shared-mask path."""
    dec = qwen3
    g = torch.Generator().manual_seed(10)
    V = dec.config.vocab_size
    prefixes = torch.randint(0, V, (2, 7), generator=g)
    new = torch.randint(0, V, (2, S), generator=g)
    cache = dec.new_cache(3, 32)
    rows = torch.tensor([2, 0])
    dec(prefixes, cache, rows=rows, compute_logits=False)
    cache.lengths[rows] = 7
    out = dec(new, cache, rows=rows)
    for b in range(2):
        assert _maxdiff(out.logits[b], _solo(dec, prefixes[b].tolist(), new[b].tolist())) <= TOL


def test_positions_past_the_first_rope_table(tiny_model_dir):
    """The cos/sin table starts small and grows; positions past its first size stay exact."""
    path = tiny_model_dir("llama", seed=12, max_position_embeddings=1024)
    hf, dec = _hf(path), load_decoder(path)
    ids = _ids(300, dec.config.vocab_size, seed=12)
    ref_logits, _, _ = _hf_reference(hf, ids)
    cache = dec.new_cache(1, 400)
    dec(ids[:, :200], cache, compute_logits=False)
    cache.lengths[0] = 200
    out = dec(ids[:, 200:297], cache)
    assert _maxdiff(out.logits, ref_logits[:, 200:297]) <= TOL
    cache.lengths[0] = 297
    for t in range(297, 300):
        assert _maxdiff(dec(ids[:, t : t + 1], cache).logits, ref_logits[:, t : t + 1]) <= TOL
        cache.lengths[0] = t + 1


@pytest.mark.parametrize("backend", ["torch", "mkl"] + (["onednn"] if torch.backends.mkldnn.is_available() else [])
                         + (["kernels"] if cpu_kernels().ok else []))
def test_fused_layout_keeps_checkpoint_names_and_numbers(tiny_model_dir, backend):
    """load_decoder fuses q/k/v and gate/up and lays the linears out for `backend`; the state
    dict still has the checkpoint's names and shapes, a plain (unprepared) Decoder gives the same
    logits, and new weights loaded through load_state_dict reach the prepared linears (views of
    the fused weights for "torch" / "mkl"; "onednn" / "kernels" re-pack after the load)."""
    from safetensors.torch import load_file

    from draftsmith.models.decoder import Decoder

    path = tiny_model_dir("qwen2", seed=13, tie_word_embeddings=False)
    fused = load_decoder(path, linear_backend=backend)
    ckpt = load_file(str(path / "model.safetensors"))
    sd = fused.state_dict()
    assert set(sd) == set(ckpt)
    assert all(torch.equal(sd[k], ckpt[k]) for k in ckpt)

    plain = Decoder(fused.config)
    plain.load_state_dict(ckpt, strict=True)
    plain.eval()
    assert plain.model.layers[0].self_attn.qkv is None and plain.linear_backend is None
    ids = _ids(9, fused.config.vocab_size, seed=13)
    a = fused(ids, fused.new_cache(1, 16)).logits
    b = plain(ids, plain.new_cache(1, 16)).logits
    assert _maxdiff(a, b) <= TOL

    zeroed = {k: torch.zeros_like(v) if ".mlp.up_proj." in k or ".k_proj." in k else v for k, v in ckpt.items()}
    fused.load_state_dict(zeroed)
    plain.load_state_dict(zeroed)
    if backend in ("torch", "mkl"):  # the checkpoint parameters are views of the fused matrices
        gate_up = fused.model.layers[1].mlp.gate_up.weight
        assert (gate_up[:, -1] if backend == "mkl" else gate_up[-1]).abs().sum() == 0
    a2 = fused(ids, fused.new_cache(1, 16)).logits
    b2 = plain(ids, plain.new_cache(1, 16)).logits
    assert _maxdiff(a2, b2) <= TOL and _maxdiff(a2, a) > 1e-3  # the new weights are in use


def test_attention_segments_follow_row_runs_and_bound_padding():
    from draftsmith.models.attention import MAX_ROW_RUNS, SEGMENT_WASTE_KEYS, _row_runs

    assert _row_runs([0, 1, 2], [10, 10, 10], 1) == [(0, 3, 0, 11)]  # one view, no padding
    assert _row_runs([0, 1, 3], [10, 12, 10], 1) == [(0, 2, 0, 13), (2, 3, 3, 11)]  # a hole
    # similar lengths share a call; a row 2,000 keys longer gets its own
    segs = _row_runs([4, 5, 6, 7], [100, 120, 2100, 90], 1)
    assert segs == [(0, 2, 4, 121), (2, 3, 6, 2101), (3, 4, 7, 91)]
    for b0, b1, _, keys in segs:
        real = sum(s + 1 for s in [100, 120, 2100, 90][b0:b1])
        assert (b1 - b0) * keys - real <= SEGMENT_WASTE_KEYS
    assert _row_runs(list(range(0, 2 * (MAX_ROW_RUNS + 1), 2)), [5] * (MAX_ROW_RUNS + 1), 1) is None


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("model_type,dtype", [("llama", torch.float32), ("gemma3_text", torch.float32),
                                              ("gemma3_text", torch.bfloat16), ("qwen2", torch.bfloat16)])
def test_verify_block_logits_equal_one_token_steps_bit_for_bit(tiny_model_dir, model_type, dtype):
    """With Draftsmith's CPU kernels every op computes a token's row the same way whatever the
    number of tokens in the step: a verify block's logits equal decoding its tokens one by one,
    bit for bit, in bf16 too. Gemma's sliding layers (window 21 here) start their keys at a
    position that is not a multiple of the kernel's 16-key tile (the decoder aligns kv_lo down to one)."""
    path = tiny_model_dir(model_type, seed=21, **({"sliding_window": 21} if model_type == "gemma3_text" else {}))
    dec = load_decoder(path, dtype=dtype)
    assert dec.linear_backend == "kernels"
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, dec.config.vocab_size, (1, 53), generator=g)
    P = 45
    caches = [dec.new_cache(1, 64) for _ in range(2)]
    for c in caches:
        dec(ids[:, :P], c)
        c.lengths[0] = P
    block = dec(ids[:, P:], caches[0]).logits
    steps = []
    for t in range(P, ids.shape[1]):
        steps.append(dec(ids[:, t : t + 1], caches[1]).logits)
        caches[1].lengths[0] += 1
    assert torch.equal(block, torch.cat(steps, dim=1))


@pytest.mark.skipif(not cpu_kernels().ok, reason="Draftsmith's CPU kernels do not run here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_at_their_own_positions_attend_in_one_call_with_the_same_bits(tiny_model_dir, dtype, monkeypatch):
    """A step over cache rows of mixed lengths, not one contiguous run: each layer's attention is
    one kernel call (attend_rows) in which every row reads only its own keys, bit-identical to the
    per-run masked calls it replaces; a single row's step does not take it."""
    import draftsmith.models.decoder as decoder_module

    dec = load_decoder(tiny_model_dir("qwen3", seed=3), dtype=dtype)
    g = torch.Generator().manual_seed(8)
    V = dec.config.vocab_size
    cache = dec.new_cache(6, 96)
    for r, n in enumerate([40, 3, 17, 0, 75, 9]):
        if n:
            dec(torch.randint(0, V, (1, n), generator=g), cache, rows=torch.tensor([r]), compute_logits=False)
            cache.lengths[r] = n
    rows, step = torch.tensor([4, 1, 2, 5]), torch.randint(0, V, (4, 3), generator=g)
    calls = []
    real = decoder_module.attend_rows
    monkeypatch.setattr(decoder_module, "attend_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    one_call = dec(step, cache, rows=rows).logits
    assert len(calls) == dec.config.num_layers
    dec(step[:1], cache, rows=rows[:1])  # one row at its own start: the plain step path
    assert len(calls) == dec.config.num_layers
    monkeypatch.setattr(decoder_module, "use_step_kernel", lambda *a: False)  # the per-run masked calls
    per_run = dec(step, cache, rows=rows).logits
    assert torch.equal(one_call, per_run)
