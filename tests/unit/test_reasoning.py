"""Reasoning parsers (server/reasoning.py, server/answer.py): `<think> ... </think>` read into the
message's `reasoning`, the same streamed (every split) as whole, where the prompt opened the block
or the answer opens it; with tool calls after it; on the server (tiny model) whole and streamed,
`include_reasoning`, a thinking prompt's grammar refused, earlier reasoning back to the template."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from test_server_unit import _assert_openai_error, tiny_dir, tiny_server  # noqa: F401 (fixtures)
from test_tool_calls import merged

from draftsmith.api import LLM
from draftsmith.errors import DraftsmithError
from draftsmith.core.sampling import SamplingParams
from draftsmith.core.structured import Grammars
from draftsmith.core.structured import StructuredOutputsParams as SO
from draftsmith.server.answer import AnswerReader
from draftsmith.server.reasoning import ReasoningReader, leaves_open, opens_thinking
from draftsmith.server.tool_calls import HermesReader


def test_opens_thinking():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking turned off
    assert not opens_thinking("<|im_start|>assistant\n")
    assert not opens_thinking("user: why <think>?<|im_end|>\n<|im_start|>assistant\n")  # a user's words
    assert leaves_open("<think>so far") and not leaves_open("<think>x</think>answer") and not leaves_open("hi")


READ = [  # (prompt opened <think>, answer, reasoning, content)
    (False, "<think>\nplan\n</think>\n\nAnswer.", "\nplan\n", "\n\nAnswer."),
    (False, "  <think>plan</think>x", "plan", "x"),
    (False, "Just an answer.", "", "Just an answer."),
    (False, "No <think> here</think>", "", "No <think> here</think>"),  # only a leading tag opens it
    (False, "<thi", "", "<thi"),  # a tag that never completes is text
    (False, "<think>cut by max_tokens", "cut by max_tokens", ""),
    (True, "plan</think>Answer", "plan", "Answer"),
    (True, "still thinking </thi", "still thinking </thi", ""),
    (True, "<think>\nx\n</think>\n\ny", "\nx\n", "\n\ny"),  # the model opens it again: the tag dropped
    (True, "  plan</think>a", "  plan", "a"),
    (True, "<thi", "<thi", ""),
    (True, "", "", ""),
]


def _read(thinking: bool, pieces: list[str]) -> tuple[str, str]:
    r = ReasoningReader(thinking)
    out = [r.push(p) for p in pieces[:-1]] + [r.finish(pieces[-1])]
    return "".join(a for a, _ in out), "".join(b for _, b in out)


@pytest.mark.parametrize("thinking,text,reasoning,content", READ)
def test_reasoning_reader_whole_and_every_split(thinking, text, reasoning, content):
    assert _read(thinking, [text]) == (reasoning, content)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert _read(thinking, [text[:i], text[i:j], text[j:]]) == (reasoning, content), (i, j)


def test_reasoning_then_tool_calls():
    text = '<think>need weather</think>Ok.<tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>'

    def make():
        return AnswerReader(ReasoningReader(False), HermesReader())

    msg = make().message(text)
    assert msg["reasoning"] == msg["reasoning_content"] == "need weather" and msg["content"] == "Ok."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("w", '{"c": 1}')]
    r = make()
    deltas = [r.push(ch) for ch in text] + [r.finish("")]
    assert "".join(d.get("reasoning", "") for d in deltas) == "need weather"
    assert merged(deltas) == ("Ok.", [("w", '{"c": 1}')]) and r.finish_reason("stop") == "tool_calls"
    quiet = AnswerReader(ReasoningReader(False), None, include_reasoning=False).message(text)
    assert quiet["reasoning"] is None and quiet["content"].startswith("Ok.<tool_call>")
    for include in (True, False):  # all reasoning: content null either way
        assert AnswerReader(ReasoningReader(True), None, include).message("still thinking")["content"] is None


MSGS = [{"role": "user", "content": "think first"}]


def _stream(h: httpx.Client, body: dict) -> tuple[str, str, str]:
    """A streamed chat answer as a client accumulates it: reasoning, content, finish_reason."""
    thought, content, finish = "", "", None
    with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                (ch,) = json.loads(line[6:])["choices"]
                assert ch["delta"].get("reasoning") == ch["delta"].get("reasoning_content")
                thought += ch["delta"].get("reasoning") or ""
                content += ch["delta"].get("content") or ""
                finish = ch["finish_reason"] or finish
    return thought, content, finish


def test_reasoning_on_the_server(tiny_dir, tiny_server):
    """serve --reasoning-parser qwen3: an answer that opens <think> (the tiny model's text forced
    by a regex, on a server whose grammars constrain the reasoning too) has its reasoning apart,
    whole and streamed; include_reasoning false leaves it out; a server without the parser shows
    the text as it is."""
    body = {"messages": MSGS, "max_tokens": 80, "temperature": 0,
            "structured_outputs": {"regex": r"<think>\nplan [a-z]{1,4}\n</think>\n\nDone\."}}
    url = tiny_server(reasoning_parser="qwen3", structured_outputs_in_reasoning=True)
    with httpx.Client(base_url=url, timeout=60) as h:
        msg = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning"] == msg["reasoning_content"] and msg["reasoning"].startswith("\nplan ")
        assert msg["content"] == "\n\nDone."
        assert _stream(h, body) == (msg["reasoning"], "\n\nDone.", "stop")
        quiet = h.post("/v1/chat/completions", json={**body, "include_reasoning": False}).json()
        assert quiet["choices"][0]["message"]["reasoning"] is None
        assert quiet["choices"][0]["message"]["content"] == "\n\nDone."
        assert _stream(h, {**body, "include_reasoning": False}) == ("", "\n\nDone.", "stop")
        asks = {**body, "messages": [{"role": "user", "content": "Why does R1 begin with <think>"}]}
        msg = h.post("/v1/chat/completions", json=asks).json()["choices"][0]["message"]  # a user's <think>
        assert msg["reasoning"].startswith("\nplan ") and msg["content"] == "\n\nDone."
    with httpx.Client(base_url=tiny_server(), timeout=60) as h:
        msg = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert "reasoning" not in msg and msg["content"].startswith("<think>\nplan ")


THINKING_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                     "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}|{% endfor %}"
                     "{% if add_generation_prompt %}assistant:<think>\n{% endif %}")


def test_a_thinking_prompt(tiny_dir, tiny_server):
    """A template that opens <think> (as Qwen3 thinking models' and DeepSeek-R1's do): the answer is
    reasoning from its first token (here never closed: all reasoning, content null, = LLM.chat's
    text); a grammar (response_format, a forced tool call) starts after the reasoning, as
    vLLM's: the answer = LLM.chat's under the grammar with reasoning="open", and with the block
    closed by a continued assistant message, reasoning="optional"; an assistant's earlier
    reasoning reaches the template as reasoning_content."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=256)
    (ref,) = llm.chat(MSGS, SamplingParams(max_tokens=12, temperature=0.0), chat_template=THINKING_TEMPLATE)
    assert "</think>" not in ref.text
    url = tiny_server(reasoning_parser="deepseek_r1", chat_template=THINKING_TEMPLATE)
    body = {"messages": MSGS, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=url, timeout=60) as h:
        msg = h.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning"] == ref.text and msg["content"] is None
        assert _stream(h, body) == (ref.text, "", "length")
        def want(msgs, spec, **kw) -> dict:
            sp = SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=spec)
            text = llm.chat(msgs, sp, chat_template=THINKING_TEMPLATE, **kw)[0].text
            return AnswerReader(ReasoningReader("add_generation_prompt" not in kw), None).message(text)

        r = h.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert r.json()["choices"][0]["message"] == want(MSGS, SO(json_object=True, reasoning="open"))
        closed = MSGS + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
        r = h.post("/v1/chat/completions", json={**body, "messages": closed, "add_generation_prompt": False,
                                                 "continue_final_message": True, "structured_outputs": {"regex": "ok"}})
        assert r.json()["choices"][0]["message"] == want(closed, SO(regex="ok", reasoning="optional"),
                                                          add_generation_prompt=False, continue_final_message=True)
        tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}
        assert h.post("/v1/chat/completions", json={**body, **tools}).status_code == 200
    # --structured-outputs-in-reasoning: the grammar decides the whole answer, read from its start
    url = tiny_server(reasoning_parser="deepseek_r1", chat_template=THINKING_TEMPLATE,
                      structured_outputs_in_reasoning=True)
    with httpx.Client(base_url=url, timeout=60) as h:
        r = h.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        (plain,) = llm.chat(MSGS, SamplingParams(max_tokens=12, temperature=0.0, structured_outputs=SO(json_object=True)),
                            chat_template=THINKING_TEMPLATE)
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": plain.text, "reasoning": None,
                                                     "reasoning_content": None}
        earlier = MSGS + [{"role": "assistant", "content": "4", "reasoning": "2+2"}]
        r = h.post("/tokenize", json={"messages": earlier, "add_generation_prompt": False}).json()
        assert llm.tokenizer.decode(r["tokens"]) == "user:think first|assistant:4[2+2]|"


@pytest.mark.parametrize("kind", [dict(json_object=True), dict(regex=r"\{[a-z]+\}"), dict(choice=["{a}", "{b}"]),
                                  dict(grammar='root ::= "{" [a-z]+ "}"'),
                                  dict(json={"type": "object", "properties": {"a": {"type": "string"}}})])
def test_a_grammar_after_the_reasoning(tiny_dir, kind):
    """StructuredOutputsParams(reasoning=...): "open" takes free text up to </think> (the prompt
    opened the block), then whitespace, then the grammar; "optional" the same block only where the
    answer opens it, else the grammar from the first token, and only for a tokenizer with <think>
    as a token (a thinking model's; with another, "optional" is the grammar alone); None, the
    grammar alone."""
    llm = LLM(str(tiny_dir), max_batch=1, max_len=64)
    grammars = Grammars(llm.tokenizer, llm.target.model.config.vocab_size, [llm.tokenizer.eos_token_id])

    def takes(spec: SO, text: str) -> tuple[bool, bool]:
        """(every token of `text` taken, the answer may end there)"""
        m = grammars.matcher(spec)
        ids = llm.encode(text, add_special_tokens=False)
        return m.try_consume_tokens(ids) == len(ids), m.is_accepting()

    answer = '{"a": "x"}' if "json" in kind or "json_object" in kind else "{a}"
    open_, optional, plain = (SO(**kind, reasoning="open"), SO(**kind, reasoning="optional"), SO(**kind))
    assert takes(open_, "any <b>text</b> here </think>\n\n" + answer) == (True, True)
    assert takes(open_, answer) == (True, False)  # still reasoning: the grammar has not begun
    assert takes(optional, answer) == (True, True)
    assert takes(optional, "<think>")[0] is False  # no <think> token: not a thinking model, no block
    assert takes(optional, "plan")[0] is False
    assert takes(plain, answer) == (True, True) and takes(plain, "<think>")[0] is False
    with pytest.raises(DraftsmithError, match="reasoning must be"):
        SO(**kind, reasoning="closed")

    # a tokenizer with <think> / </think> as added tokens (as Qwen3's and DeepSeek-R1's, special=False):
    # the grammar takes those single tokens, which llguidance never matches as text
    from tokenizers import AddedToken

    tok = copy.deepcopy(llm.tokenizer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    tagged = Grammars(tok, len(tok), [tok.eos_token_id])

    def takes_ids(spec: SO, ids: list[int]) -> tuple[bool, bool]:
        m = tagged.matcher(spec)
        return m.try_consume_tokens(ids) == len(ids), m.is_accepting()

    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert enc("<think>") == [think]
    assert takes_ids(open_, enc("hm a") + [end] + enc("\n\n" + answer)) == (True, True)
    assert takes_ids(open_, enc(answer)) == (True, False)
    assert takes_ids(optional, [think] + enc("x") + [end] + enc(answer)) == (True, True)
    assert takes_ids(optional, enc(" ") + [think] + enc("plan { } [") + [end] + enc("\n" + answer)) == (True, True)
    assert takes_ids(optional, enc(answer)) == (True, True)
    assert takes_ids(optional, enc("plan"))[0] is False  # neither a <think> block nor the grammar
