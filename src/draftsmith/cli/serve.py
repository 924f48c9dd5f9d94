"""`draftsmith serve`: the OpenAI-compatible HTTP server (completions, chat, /metrics)."""

from __future__ import annotations

import json
import os
import sys

from draftsmith.cli.options import (add_job, add_prefix_caching, add_speculation_args, add_target_args, positive_int,
                                    speculative_config)
from draftsmith.errors import DraftsmithError
from draftsmith.models.generation_config import sampling_defaults

HELP = "OpenAI-compatible HTTP server (completions, chat, /metrics)"
EXAMPLE = "draftsmith serve --drafter dspark:runs/smollm2-135m-dspark --policy prefix-scheduler --port 8000"


def add_parser(sub) -> None:
    s = add_job(sub, "serve", HELP, EXAMPLE)
    s.add_argument("model", nargs="?", default=None, metavar="MODEL",
                   help="the target, as `vllm serve MODEL` takes it (the same as --target; default smollm2-135m)")
    add_target_args(s)
    s.set_defaults(target=None)  # (smollm2-135m where neither MODEL nor --target is given: cmd_serve)
    add_speculation_args(s)
    add_prefix_caching(s, "a shared system prompt, the conversation so far, a repeated prompt", on=False)
    s.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=positive_int, default=8,
                   help="KV rows = requests running at once (vLLM's --max-num-seqs)")
    s.add_argument("--max-len", "--max-model-len", dest="max_len", type=positive_int, default=2048,
                   help="context limit per request, prompt + output (vLLM's --max-model-len)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--served-model-name", default=None, help="model id clients send (default: the target id)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="server log level")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes (default: $DRAFTSMITH_API_KEY, else none)")
    s.add_argument("--max-choices-per-request", type=positive_int, default=None,
                   help="prompts x n one request may ask for (default 256)")
    s.add_argument("--max-prompt-bytes", type=positive_int, default=None,
                   help="UTF-8 bytes of prompt text per request (default 1 MiB)")
    s.add_argument("--max-queued-tokens", type=positive_int, default=None,
                   help="prompt + max_tokens of all unfinished requests; past it, 429 (default 32 x max-batch x max-len)")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) in place of the target's own")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser')
    s.add_argument("--tool-call-parser", default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>, as Qwen2.5 and Hermes)")
    s.add_argument("--reasoning-parser", default=None,
                   help="split chat answers into reasoning and content: qwen3 or deepseek_r1 (<think> ... </think>); "
                        "a request's grammar then starts after the reasoning")
    s.add_argument("--structured-outputs-in-reasoning", action="store_true",
                   help="with --reasoning-parser: a request's grammar constrains the reasoning too (vLLM's "
                        "enable_in_reasoning)")
    s.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's variables for every chat request, a JSON object (vLLM's), e.g. "
                        """'{"enable_thinking": false}' for Qwen3; a request's chat_template_kwargs win key by key""")
    s.add_argument("--enable-per-request-metrics", action="store_true",
                   help="vLLM's: each response carries `metrics` (queue, TTFT, generation time, mean ITL, tokens/s) "
                        "for a one-choice request; streams on their usage chunk")
    s.add_argument("--per-request-spec-decode-metrics", default="none", choices=["none", "summary", "detailed"],
                   help="vLLM's: `metrics.speculative_decoding` in each one-choice response (steps, drafted and "
                        "accepted tokens, mean acceptance length, acceptance histograms; detailed: per step)")
    s.add_argument("--enable-force-include-usage", action="store_true",
                   help="vLLM's: every stream ends with its usage chunk (and per-request metrics), as if it sent "
                        "stream_options.include_usage")
    s.add_argument("--enable-request-id-headers", action="store_true",
                   help="vLLM's: every response carries an X-Request-Id header (the request's own, else a fresh id)")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="vLLM's: logprobs name tokens token_id:N where a request does not say "
                        "(its return_tokens_as_token_ids wins)")
    s.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="vLLM's: what a request leaves unset defaults to: auto = the target's generation_config.json "
                        "recommendation (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens caps "
                        "max_tokens), vllm = none (temperature 1, ...), DIR = the generation_config.json in DIR")
    s.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="""vLLM's: fields that replace the generation config's, a JSON object, e.g. '{"temperature": 0.5}'""")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: requests start in arrival order; priority: a request's `priority` field orders "
                        "admission (lower first; running requests are not preempted)")
    s.set_defaults(func=cmd_serve)


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a Jinja template; its
    syntax checked here, not at the first request."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # HF's own Jinja environment

    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DraftsmithError(f"--chat-template {value}: cannot read it as UTF-8 text ({e})") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise DraftsmithError(f"--chat-template {value!r} is neither a file nor a Jinja template (one with {{{{ }}}} "
                              "or {% %}); give the template file's path or the template itself")
    try:
        _compile_jinja_template(text)  # (its loop controls and {% generation %} tag included)
    except jinja2.TemplateSyntaxError as e:
        raise DraftsmithError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


def read_json_object(flag: str, value: str | None, example: str) -> dict | None:
    """A flag's JSON object (None if not given), else an error that shows `example`."""
    if value is None:
        return None
    try:
        obj = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        obj = None
    if not isinstance(obj, dict):
        raise DraftsmithError(f"{flag} {value!r} is not a JSON object; give one such as '{example}'")
    return obj


def check_listen(host: str, port: int) -> None:
    """Refuse, before the model loads, an address this machine cannot listen on (a port another
    server holds, a host that is not this machine's)."""
    import socket

    import errno

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise DraftsmithError(f"--host {host!r} is not an address of this machine ({e}); use e.g. 127.0.0.1 or "
                              "0.0.0.0") from None
    try:
        sock = socket.socket(family, kind, proto)
    except OSError:
        return  # (this kernel lacks that family: uvicorn picks its own, and says what fails)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn binds)
        try:
            sock.bind(addr)
        except OSError as e:
            why = {errno.EADDRINUSE: "another server is using the port; choose another --port",
                   errno.EADDRNOTAVAIL: "the host is not an address of this machine; use e.g. 127.0.0.1 or 0.0.0.0",
                   errno.EACCES: "a port under 1024 needs privileges; choose another --port"}.get(e.errno, "")
            raise DraftsmithError(f"cannot listen on {host}:{port}: {e.strerror or e}" + (f"; {why}" if why else "")) \
                from None


def cmd_serve(args) -> int:
    from draftsmith.api import LLM

    if args.model is not None and args.target is not None and args.model != args.target:
        raise DraftsmithError(f"the target is given twice: {args.model!r} and --target {args.target!r}; give one")
    args.target = args.model or args.target or "smollm2-135m"
    if not 0 <= args.port <= 65535:
        raise DraftsmithError(f"--port must be in 0..65535, got {args.port}")
    check_listen(args.host, args.port)
    # (the server's modules load fastapi: here, not at startup)
    from draftsmith.server.reasoning import REASONING_PARSERS
    from draftsmith.server.tools import TOOL_CALL_PARSERS

    for flag, value, known in (("--tool-call-parser", args.tool_call_parser, TOOL_CALL_PARSERS),
                               ("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS)):
        if value not in (None, *known):
            raise DraftsmithError(f"{flag} {value!r} is not known; known: {', '.join(known)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise DraftsmithError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls, "
                              "e.g. hermes)")
    for flag, needs, given in (("--tool-call-parser", "--enable-auto-tool-choice", args.enable_auto_tool_choice),
                               ("--structured-outputs-in-reasoning", "--reasoning-parser", args.reasoning_parser)):
        if getattr(args, flag[2:].replace("-", "_")) and not given:
            print(f"draftsmith: warning: {flag} does nothing without {needs}", file=sys.stderr)
    chat_template = read_chat_template(args.chat_template) if args.chat_template else None
    template_kwargs = read_json_object("--default-chat-template-kwargs", args.default_chat_template_kwargs,
                                       '{"enable_thinking": false}')
    override = read_json_object("--override-generation-config", args.override_generation_config,
                                '{"temperature": 0.5}')
    # (a bad directory or field is refused before the model loads; "auto" reads the target's own file later)
    sampling_defaults("", "vllm" if args.generation_config == "auto" else args.generation_config, override)
    spec_config = speculative_config(args)
    llm = LLM(
        args.target, drafter=args.drafter, speculative_config=spec_config,
        drafter_dtype=args.drafter_dtype,
        enable_prefix_caching=args.enable_prefix_caching, threads=args.threads,
        num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy, max_batch=args.max_batch, max_len=args.max_len, device=args.device, dtype=args.dtype,
        reproducible_seeds=args.reproducible_seeds, forced_drafts=args.forced_drafts,
        generation_config=args.generation_config, override_generation_config=override,
    )
    if llm.default_sampling:  # (vLLM says so too: a recommendation changes every request that leaves a field unset)
        print(f"draftsmith: requests default to the generation config's {json.dumps(llm.default_sampling)} where "
              "they leave a field unset (--generation-config vllm: none)", file=sys.stderr)
    if args.per_request_spec_decode_metrics != "none" and args.drafter == "none" and not spec_config:
        print("draftsmith: warning: --per-request-spec-decode-metrics without a drafter: "
              "metrics.speculative_decoding is null", file=sys.stderr)
    if template_kwargs and (chat_template or getattr(llm.tokenizer, "chat_template", None)):
        # (a name the template cannot take is refused now, not at the first request)
        llm.apply_chat_template([{"role": "user", "content": "hi"}], chat_template_kwargs=template_kwargs,
                                chat_template=chat_template)
    from draftsmith.server.app import Limits, ServeOptions, serve

    given = {"max_choices": args.max_choices_per_request, "max_prompt_bytes": args.max_prompt_bytes,
             "max_queued_tokens": args.max_queued_tokens}
    limits = Limits(**{k: v for k, v in given.items() if v is not None})
    api_key = args.api_key or os.environ.get("DRAFTSMITH_API_KEY") or None
    print(
        f"draftsmith: serving {args.served_model_name or llm.target.target_id} (drafter {llm.drafter_spec}, "
        f"max batch {args.max_batch}, context {llm.engine.max_len}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr, flush=True,
    )
    serve(llm, host=args.host, port=args.port, log_level=args.log_level, model_name=args.served_model_name,
          api_key=api_key, limits=limits,
          options=ServeOptions(chat_template=chat_template,
                               tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                               reasoning_parser=args.reasoning_parser,
                               structured_outputs_in_reasoning=args.structured_outputs_in_reasoning,
                               scheduling_policy=args.scheduling_policy,
                               default_chat_template_kwargs=template_kwargs,
                               per_request_metrics=args.enable_per_request_metrics,
                               per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
                               force_include_usage=args.enable_force_include_usage,
                               request_id_headers=args.enable_request_id_headers,
                               return_tokens_as_token_ids=args.return_tokens_as_token_ids))
    return 0
