"""Qwen3-MoE and Gemma 3 (text) targets: parity with HF transformers, batched rows, the engine.

As in test_decoder.py, the reference is HF's own model over the whole sequence without a
cache, in float32, and our side runs the way the engine runs it: a prefill, single-token
decode steps, then multi-token verify blocks on top of the KV cache. The tiny configs
(conftest `_TINY_DEFAULTS`) make each family feature matter: Qwen3-MoE has 4 experts, top-2,
renormalised, and one dense layer; Gemma 3 has a window of 4 keys on three of its four
layers, a separate local RoPE base, a linearly scaled global RoPE and an attention scale
that is not head_dim ** -0.5, and sequences run well past the window.

Each family has negative controls: the same parity check, with one feature of *our* model
switched off after loading (top-k, renormalisation, the window, the local RoPE, (1 + w), the
embedding scale), must fail, so the check can tell.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from draftsmith import LLM, SamplingParams
from draftsmith.errors import DraftsmithError
from draftsmith.models.decoder import DecoderConfig, SparseMoE, rms_norm
from draftsmith.models.loading import load_decoder

TOL = 1e-4
CONTROL = 100 * TOL  # what a switched-off feature must move the logits by, at least


from test_decoder import _hf, _hf_reference, _ids, _maxdiff  # tests/unit/test_decoder.py: the HF parity helpers

pytestmark = pytest.mark.usefixtures("one_thread")


def _legacy_gemma3_config(path) -> None:
    """Rewrite a saved gemma3_text config.json in the transformers 4.x spelling of the Hub's
    Gemma 3 files: rope_theta + rope_scaling (global layers) + rope_local_base_freq, and
    sliding_window_pattern instead of layer_types (every 2nd layer global here)."""
    cfg = json.loads((path / "config.json").read_text())
    ropes = cfg.pop("rope_parameters")
    full = dict(ropes["full_attention"])
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_scaling"] = full
    cfg["rope_local_base_freq"] = ropes["sliding_attention"]["rope_theta"]
    cfg.pop("layer_types")
    cfg.pop("_sliding_window_pattern", None)
    cfg["sliding_window_pattern"] = 2
    (path / "config.json").write_text(json.dumps(cfg))


# name: (model_type, config overrides, config.json rewrite or None)
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", {}, None),
    # sparse every 2nd layer only (layer 1), top-3 of 4, probabilities not renormalised
    "qwen3_moe-step2-top3-raw": ("qwen3_moe", dict(mlp_only_layers=[], decoder_sparse_step=2,
                                                   num_experts_per_tok=3, norm_topk_prob=False), None),
    # use_sliding_window: every layer sees its last 5 keys
    "qwen3_moe-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=5), None),
    "gemma3_text": ("gemma3_text", {}, None),
    # the Hub's 4.x config spelling; untied head; final logit soft-capping
    "gemma3_text-4x-config-softcap": ("gemma3_text", dict(tie_word_embeddings=False, final_logit_softcapping=2.0),
                                      _legacy_gemma3_config),
}
FAMILIES = ("qwen3_moe", "gemma3_text")


def _make(tiny_model_dir, variant: str, seed: int = 0):
    mt, overrides, rewrite = VARIANTS[variant]
    path = tiny_model_dir(mt, seed=seed, **overrides)
    if rewrite is not None:
        rewrite(path)
    return path


# prefill 9 (past the window of 4), 4 decode steps, a 5-token verify (longer than the window)
# and a 3-token verify: 21 tokens
CHUNKS = [(0, 9)] + [(i, i + 1) for i in range(9, 13)] + [(13, 18), (18, 21)]
SEQ = CHUNKS[-1][1]


def _engine_like_run(dec, ids: torch.Tensor, layer_ids: tuple[int, ...] = ()):
    """Our decoder over `ids` in CHUNKS on one KV-cache row; yields ((a, b), output)."""
    cache = dec.new_cache(1, 64)
    for a, b in CHUNKS:
        out = dec(ids[:, a:b], cache, layer_ids=layer_ids)
        assert cache.lengths[0].item() == a, "forward must not advance cache lengths"
        cache.lengths[0] = b
        yield (a, b), out


def _logit_maxdiff(dec, ids: torch.Tensor, ref_logits: torch.Tensor) -> float:
    return max(_maxdiff(out.logits, ref_logits[:, a:b]) for (a, b), out in _engine_like_run(dec, ids))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity_with_hf_prefill_decode_verify(tiny_model_dir, variant):
    path = _make(tiny_model_dir, variant)
    hf, dec = _hf(path), load_decoder(path)
    L = dec.config.num_layers
    ids = _ids(SEQ, dec.config.vocab_size, seed=1)
    ref_logits, ref_hidden, ref_last = _hf_reference(hf, ids)
    for (a, b), out in _engine_like_run(dec, ids, layer_ids=tuple(range(L))):
        where = f"{variant} tokens {a}:{b}"
        assert _maxdiff(out.logits, ref_logits[:, a:b]) <= TOL, where
        assert _maxdiff(out.final_hidden, ref_hidden[-1][:, a:b]) <= TOL, where
        for i in range(L - 1):  # HF's hidden_states[i + 1] is layer i's output ...
            assert _maxdiff(out.hidden[i], ref_hidden[i + 1][:, a:b]) <= TOL, (where, i)
        # ... except the last entry, which HF replaces by the normed state (= final_hidden).
        assert _maxdiff(out.hidden[L - 1], ref_last[:, a:b]) <= TOL, where


def test_tiny_configs_exercise_the_family_features(tiny_model_dir):
    """The parity variants above really contain what they claim to test."""
    moe = load_decoder(_make(tiny_model_dir, "qwen3_moe")).config
    assert moe.moe_layers == (0, 2) and moe.num_experts == 4 and moe.num_experts_per_tok == 2 and moe.norm_topk_prob
    step2 = load_decoder(_make(tiny_model_dir, "qwen3_moe-step2-top3-raw")).config
    assert step2.moe_layers == (1,) and step2.num_experts_per_tok == 3 and not step2.norm_topk_prob
    win = load_decoder(_make(tiny_model_dir, "qwen3_moe-window")).config
    assert win.sliding_window == 5 and win.sliding_layers == (0, 1, 2) and win.local_rope is None
    g = load_decoder(_make(tiny_model_dir, "gemma3_text")).config
    assert g.sliding_window == 4 < SEQ and g.sliding_layers == (0, 1, 3) and g.tie_word_embeddings
    assert g.local_rope.theta == 1000.0 and (g.rope.type, g.rope.factor, g.rope.theta) == ("linear", 2.0, 100_000.0)
    assert g.attn_scale == pytest.approx(24 ** -0.5) and g.hidden_act == "gelu_pytorch_tanh"
    legacy = load_decoder(_make(tiny_model_dir, "gemma3_text-4x-config-softcap")).config
    assert legacy.sliding_layers == (0, 2) and legacy.final_softcap == 2.0 and not legacy.tie_word_embeddings
    assert legacy.local_rope == g.local_rope and legacy.rope == g.rope


# -------------------------------------------------------------- negative controls


def _set_config(dec, **changes) -> None:
    dec.config = dataclasses.replace(dec.config, **changes)
    dec._local_rope_cache = None  # rebuilt from the (changed) config


def _moe_top_k_1(dec):
    for layer in dec.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.top_k = 1


def _moe_no_renormalisation(dec):
    for layer in dec.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.norm_topk_prob = False


def _moe_dense_layer_sparse(dec):
    """Layer 1 (dense per mlp_only_layers) run with layer 0's experts instead."""
    dec.model.layers[1].mlp = dec.model.layers[0].mlp
    dec.set_fused_ops_(True)  # a swapped module is re-prepared (the one-call layer holds its weights)


def _gemma_no_window(dec):
    _set_config(dec, sliding_window=None)


def _gemma_global_rope_everywhere(dec):
    _set_config(dec, local_rope=None)


def _gemma_plain_norm_weight(dec):
    for layer in dec.model.layers:
        layer.norm_fn = rms_norm  # scale by w instead of (1 + w)


def _gemma_no_embed_scale(dec):
    _set_config(dec, embed_scale=False)


def _gemma_default_attn_scale(dec):
    for layer in dec.model.layers:
        layer.self_attn.scale = None


CONTROLS = {
    "moe-top-k-1": ("qwen3_moe", _moe_top_k_1),
    "moe-no-renormalisation": ("qwen3_moe", _moe_no_renormalisation),
    "moe-dense-layer-as-sparse": ("qwen3_moe", _moe_dense_layer_sparse),
    "gemma-no-window": ("gemma3_text", _gemma_no_window),
    "gemma-global-rope-on-sliding-layers": ("gemma3_text", _gemma_global_rope_everywhere),
    "gemma-norm-w-not-1+w": ("gemma3_text", _gemma_plain_norm_weight),
    "gemma-no-embed-scale": ("gemma3_text", _gemma_no_embed_scale),
    "gemma-head_dim-attn-scale": ("gemma3_text", _gemma_default_attn_scale),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_parity_check_fails_without_each_family_feature(tiny_model_dir, control):
    variant, switch_off = CONTROLS[control]
    path = _make(tiny_model_dir, variant)
    hf, dec = _hf(path), load_decoder(path)
    ids = _ids(SEQ, dec.config.vocab_size, seed=1)
    ref_logits = _hf_reference(hf, ids)[0]
    assert _logit_maxdiff(dec, ids, ref_logits) <= TOL  # the same check passes as loaded ...
    switch_off(dec)
    assert _logit_maxdiff(dec, ids, ref_logits) > CONTROL, control  # ... and fails without the feature


def test_window_control_differs_only_past_the_window(tiny_model_dir):
    """Without the window Gemma's logits still match HF for the first W positions (every key
    is inside every window there) and differ after: the window is what the check detects."""
    path = _make(tiny_model_dir, "gemma3_text")
    hf, dec = _hf(path), load_decoder(path)
    W = dec.config.sliding_window
    ids = _ids(SEQ, dec.config.vocab_size, seed=1)
    ref = _hf_reference(hf, ids)[0]
    _gemma_no_window(dec)
    out = dec(ids, dec.new_cache(1, 64)).logits
    assert _maxdiff(out[:, :W], ref[:, :W]) <= TOL
    assert _maxdiff(out[:, W:], ref[:, W:]) > CONTROL


# -------------------------------------------------------------- batched rows


@pytest.fixture(scope="module")
def family_decoders(tiny_model_dir):
    return {mt: load_decoder(tiny_model_dir(mt, seed=3)) for mt in FAMILIES}


def _solo(dec, prefix: list[int], new: list[int]) -> torch.Tensor:
    """Logits of `new` after `prefix`, run alone in row 0 of a fresh cache."""
    cache = dec.new_cache(1, 64)
    if prefix:
        dec(torch.tensor([prefix]), cache, compute_logits=False)
        cache.lengths[0] = len(prefix)
    return dec(torch.tensor([new]), cache).logits[0]


# consecutive rows, unsorted rows (three runs), and the gather path (GPUs) forced on this CPU;
# prefix lengths with an empty row (window start 0) and all past the window (keys skipped)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rows, gather, prefix_lens", [
    ([1, 2, 3], False, (5, 11, 0)),
    ([3, 0, 2], False, (9, 14, 6)),
    ([0, 2, 4, 6, 8, 10], True, (9, 14, 6)),
])
def test_batched_rows_with_independent_lengths_match_solo_runs(family_decoders, family, rows, gather, prefix_lens,
                                                               monkeypatch):
    import draftsmith.models.decoder as decoder_module

    if gather:
        monkeypatch.setattr(decoder_module, "_row_runs", lambda *a, **k: None)
    dec = family_decoders[family]
    V = dec.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prefix_len = {r: prefix_lens[i % 3] for i, r in enumerate(rows)}
    valid = {r: (6, 2, 1)[i % 3] for i, r in enumerate(rows)}  # the rest is padding; 6 > the window
    S = max(valid.values())
    prefixes = {r: torch.randint(0, V, (n,), generator=g).tolist() for r, n in prefix_len.items()}
    new = {r: torch.randint(0, V, (S,), generator=g).tolist() for r in rows}

    cache = dec.new_cache(max(rows) + 1, 64)
    for r in rows:
        if prefixes[r]:
            dec(torch.tensor([prefixes[r]]), cache, rows=torch.tensor([r]), compute_logits=False)
            cache.lengths[r] = len(prefixes[r])
    out = dec(torch.tensor([new[r] for r in rows]), cache, rows=torch.tensor(rows))
    for b, r in enumerate(rows):
        n = valid[r]
        assert _maxdiff(out.logits[b, :n], _solo(dec, prefixes[r], new[r][:n])) <= TOL, f"row {r}"

    # Commit the valid tokens only; the padding written past them must not leak into the next step.
    for r in rows:
        cache.lengths[r] = prefix_len[r] + valid[r]
    nxt = torch.randint(0, V, (len(rows), 1), generator=g)
    out2 = dec(nxt, cache, rows=torch.tensor(rows))
    for b, r in enumerate(rows):
        solo = _solo(dec, prefixes[r] + new[r][: valid[r]], nxt[b].tolist())
        assert _maxdiff(out2.logits[b], solo) <= TOL, f"row {r} after commit"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("S", [1, 3])
@pytest.mark.parametrize("rows", [[0, 1], [2, 0]])
def test_batched_rows_with_equal_lengths_match_solo(family_decoders, family, S, rows):
    """Rows at one length past the window: the mask-free decode (S=1) and shared-mask paths."""
    dec = family_decoders[family]
    g = torch.Generator().manual_seed(10)
    V = dec.config.vocab_size
    prefixes = torch.randint(0, V, (2, 7), generator=g)
    new = torch.randint(0, V, (2, S), generator=g)
    cache = dec.new_cache(3, 32)
    rows_t = torch.tensor(rows)
    dec(prefixes, cache, rows=rows_t, compute_logits=False)
    cache.lengths[rows_t] = 7
    out = dec(new, cache, rows=rows_t)
    for b in range(2):
        assert _maxdiff(out.logits[b], _solo(dec, prefixes[b].tolist(), new[b].tolist())) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_ragged_batched_prefill_matches_solo(family_decoders, family):
    dec = family_decoders[family]
    g = torch.Generator().manual_seed(5)
    lens = [7, 3, 12]
    ids = torch.randint(0, dec.config.vocab_size, (len(lens), max(lens)), generator=g)
    out = dec(ids, dec.new_cache(3, 32))
    for b, n in enumerate(lens):
        assert _maxdiff(out.logits[b, :n], _solo(dec, [], ids[b, :n].tolist())) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_by_truncating_lengths_equals_fresh_run(family_decoders, family):
    dec = family_decoders[family]
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


# -------------------------------------------------------------- the MoE block alone


def test_sparse_moe_equals_every_expert_weighted_by_its_routing(family_decoders):
    """The grouped-by-expert forward equals the plain definition (every expert on every token,
    zero weight where it was not picked) on a batch of many tokens."""
    moe = family_decoders["qwen3_moe"].model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    x = torch.randn(3, 40, moe.gate.in_features, generator=torch.Generator().manual_seed(11))
    h = x.reshape(-1, x.shape[-1])
    weights, chosen = moe.route(h)
    dense_w = torch.zeros(h.shape[0], len(moe.experts)).scatter(1, chosen, weights)
    want = sum(dense_w[:, e, None] * expert.forward(h) for e, expert in enumerate(moe.experts))
    assert torch.bincount(chosen.flatten(), minlength=4).min() > 0  # every expert has tokens
    assert _maxdiff(moe.forward(x), want.view(x.shape)) <= 1e-5


# -------------------------------------------------------------- configs


def test_hub_and_save_pretrained_spellings_of_qwen3_moe_config(tiny_model_dir):
    """The Hub's config.json says num_experts; transformers 5's save_pretrained num_local_experts."""
    cfg = json.loads((_make(tiny_model_dir, "qwen3_moe") / "config.json").read_text())
    assert "num_local_experts" in cfg
    hub = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert DecoderConfig.from_hf(hub) == DecoderConfig.from_hf(cfg)


def test_multimodal_gemma3_config_is_refused_clearly():
    with pytest.raises(DraftsmithError, match="text model") as e:
        DecoderConfig.from_hf({"model_type": "gemma3", "text_config": {"hidden_size": 64}})
    assert "gemma3_text" in str(e.value) and "\n" not in str(e.value)


# -------------------------------------------------------------- through the engine

PROMPTS = ["abcabcabcabcabc", "hello world, hello world, hello"]


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_equals_hf_and_ngram_speculation_equals_plain(tiny_model_dir, family):
    path = tiny_model_dir(family, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain_llm = LLM(str(path), drafter="none", max_len=128)
    plain = plain_llm.generate(PROMPTS, params)
    hf = _hf(path)
    for prompt, out in zip(PROMPTS, plain):
        ids = torch.tensor([plain_llm.encode(prompt)])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert out.token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    spec_llm = LLM(str(path), drafter="ngram", policy="fixed", num_speculative_tokens=4, max_len=128)
    spec = spec_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert spec_llm.last_stats.draft_proposed > 0  # drafts were verified, not only plain steps


# -------------------------------------------------------------- a trained drafter on each


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_dspark_trains_and_drafts_losslessly(tiny_model_dir, family):
    """A tiny DSpark (as in test_trained_drafters.py) on each family: features from our
    decoder, 30 AdamW steps on sequences the target sampled, then greedy speculation equals
    plain greedy, with drafts accepted. The lm_head is scaled ×3 so the target is sharp
    enough to be learnable in 30 steps (untied for that)."""
    from safetensors.torch import load_file, save_file

    from draftsmith.drafters import dspark
    from draftsmith.models.target import load_target
    from test_trained_drafters import _batch

    path = tiny_model_dir(family, seed=0, tie_word_embeddings=False)
    state = load_file(str(path / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 3.0
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    target = load_target(str(path))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (6,), generator=g).tolist() for _ in range(32)]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    outs = LLM(target, max_batch=32, max_len=64).generate(  # half greedy continuations, half sampled
        prompts, [greedy] * 16 + [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
                                  for i in range(16)])
    batch = _batch(target, [o.prompt_token_ids + o.token_ids for o in outs], prompt_len=6)

    torch.manual_seed(0)
    model = dspark.build(target.model, dspark.DSparkConfig(block_size=4, num_layers=1, rank=32, max_anchors=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model.training_loss(batch, torch.Generator().manual_seed(len(losses))).total
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.8 * losses[0], losses
    model.eval()

    tests = prompts[:4] + PROMPTS  # greedy runs it has seen, and text it has not
    plain = LLM(target, max_batch=4, max_len=128).generate(tests, greedy)
    llm = LLM(target, drafter=model.make_drafter(target.model, 4, 128), policy="fixed", num_speculative_tokens=4, max_batch=4,
              max_len=128)
    spec = llm.generate(tests, greedy)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.last_stats.draft_accepted > 0
