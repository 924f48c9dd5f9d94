"""A target's recommended sampling (models/generation_config.py) as vLLM applies it: the defaults
of LLM.generate without sampling params and of every server request that leaves a field unset;
"vllm" turns it off, an override replaces fields, bad files and values are one clear error."""

from __future__ import annotations

import json

import pytest

from draftsmith import LLM, DraftsmithError, SamplingParams
from draftsmith.models.generation_config import sampling_defaults
from draftsmith.server.protocol import CompletionRequest
from draftsmith.server.sampling import sampling_params

QWEN = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
        "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}  # Qwen2.5-Instruct's file


def _dir(tmp_path, data, name="m"):
    d = tmp_path / name
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(data))
    return d


def test_the_files_sampling_fields_are_the_defaults_as_vllm_reads_them(tmp_path):
    """The six fields vLLM reads, a value equal to transformers' own default left out (top_k 50,
    temperature 1.0), max_new_tokens as max_tokens; other keys (do_sample, token ids) ignored."""
    d = _dir(tmp_path, QWEN)
    assert sampling_defaults(d) == {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    same = _dir(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 0.95, "max_new_tokens": 300, "min_p": 0.05},
                "hf-defaults")
    assert sampling_defaults(same) == {"top_p": 0.95, "max_tokens": 300, "min_p": 0.05}
    assert sampling_defaults(d, "vllm") == {}
    assert sampling_defaults(tmp_path / "m", str(same)) == sampling_defaults(same)  # another directory's file
    assert sampling_defaults(d, override={"temperature": 0.2, "top_k": -1}) == {
        "repetition_penalty": 1.05, "temperature": 0.2, "top_p": 0.8, "top_k": -1}
    assert sampling_defaults(d, "vllm", {"max_new_tokens": 9}) == {"max_tokens": 9}
    no_file = tmp_path / "bare"
    no_file.mkdir()
    assert sampling_defaults(no_file) == {}  # a target without the file: none, as vLLM
    assert sampling_defaults(no_file, override={"max_new_tokens": 9}) == {"max_tokens": 9}  # (renamed there too)


@pytest.mark.parametrize("source, override, says", [
    ("missing-dir", None, "not a directory"),
    ("bare", None, "generation_config.json does not exist"),
    ("auto", {"temprature": 0.5}, "temprature is not a sampling default"),
    ("auto", {"temperature": "hot"}, "temperature must be a number"),
    ("auto", {"temperature": -1}, "temperature must be a number >= 0"),
    ("auto", {"top_p": float("nan")}, "top_p must be a number"),
    ("auto", {"top_k": 2.5}, "top_k must be an integer >= -1"),
    ("auto", {"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ("auto", {"repetition_penalty": True}, "repetition_penalty must be a number"),
])
def test_bad_sources_and_values_are_one_clear_error(tmp_path, source, override, says):
    d = _dir(tmp_path, QWEN)
    (tmp_path / "bare").mkdir()
    src = str(tmp_path / source) if source not in ("auto", "vllm") else source
    with pytest.raises(DraftsmithError, match=says):
        sampling_defaults(d, src, override)


def test_a_file_that_is_not_an_object_or_not_json(tmp_path):
    for text, says in (("[1, 2]", "not a JSON object"), ("{oops", "not valid JSON"),
                       ('{"temperature": "warm"}', "temperature must be a number")):
        d = tmp_path / f"d{len(says)}"
        d.mkdir()
        (d / "generation_config.json").write_text(text)
        with pytest.raises(DraftsmithError, match=says):
            sampling_defaults(d)


def test_llm_generate_without_params_uses_the_targets_recommendation(tiny_model_dir):
    """A target whose file recommends greedy and 5 new tokens: generate() without sampling params
    gives exactly greedy's 5 tokens; "vllm" gives SamplingParams' own defaults; an override wins."""
    d = tiny_model_dir()
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5, "top_k": 3}))
    llm = LLM(str(d), max_batch=2, max_len=128)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=5, top_k=3)
    (o,) = llm.generate(["hello"])
    (greedy,) = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5))
    assert o.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) == 5
    assert LLM(llm.target, generation_config="vllm").get_default_sampling_params() == SamplingParams()
    over = LLM(llm.target, override_generation_config={"top_k": -1, "max_new_tokens": 7})
    assert over.get_default_sampling_params() == SamplingParams(temperature=0.0, max_tokens=7)  # top_k -1: all


def _req(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_a_server_requests_unset_fields_take_the_defaults_and_max_tokens_is_capped():
    """vLLM's rules: a field the request sets wins; one it leaves unset takes the default; the
    default max_tokens caps any request's (get_max_tokens: the minimum), after the context check."""
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                "max_tokens": 64}
    kw = dict(max_len=256, vocab_size=1000, defaults=defaults)
    p = sampling_params(_req(), None, 10, 0, "prompt", **kw)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.7, 0.8, 20, 0.05, 1.05, 64)
    p = sampling_params(_req(temperature=0, top_p=1.0, top_k=-1, min_p=0, repetition_penalty=1.0), 200, 10, 0,
                        "prompt", **kw)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (
        0.0, 1.0, 0, 0.0, 1.0, 64)
    assert sampling_params(_req(), 16, 10, 0, "prompt", **kw).max_tokens == 16
    none = sampling_params(_req(), None, 10, 0, "prompt", max_len=256, vocab_size=1000)
    assert (none.temperature, none.top_k, none.max_tokens) == (1.0, 0, 246)


def test_the_server_applies_the_targets_recommendation(tiny_model_dir):
    """Over HTTP with the official client: a completion that sets neither temperature nor
    max_tokens is the file's greedy 5 tokens; one asking for 50 is capped at 5, as vLLM."""
    from openai import OpenAI

    from draftsmith.server.app import create_app
    from test_server_unit import _ThreadServer

    d = tiny_model_dir()
    (d / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(str(d), max_batch=2, max_len=128)
    (greedy,) = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=5))
    server = _ThreadServer(create_app(llm, "tiny"))
    try:
        c = OpenAI(base_url=f"{server.start()}/v1", api_key="unused", max_retries=0, timeout=60)
        for asked in ({}, {"max_tokens": 50}):
            r = c.completions.create(model="tiny", prompt="hello", **asked)
            assert r.usage.completion_tokens == 5 and r.choices[0].text == greedy.outputs[0].text, asked
    finally:
        server.stop()
