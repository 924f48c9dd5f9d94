"""The one prompt encoder: text and chat messages -> the target's token ids, the way
`LLM.generate`, the server, eval and bench all send them (so their prompts are identical)."""

from __future__ import annotations

import inspect

from draftsmith.errors import DraftsmithError


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """A plain-text prompt, with the tokenizer's special tokens (BOS where it adds one) unless
    `add_special_tokens` is False (a prompt already rendered with them, as vLLM's option)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], target_id: str = "the target", *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                chat_template: str | None = None) -> list[int]:
    """The chat template (HF transformers' / vLLM's options: the assistant's turn opened, or the
    last message left open to be continued; extra variables for the template, e.g. Qwen3's
    enable_thinking; `tools`, the OpenAI tool definitions a tool-aware template lists;
    `chat_template`, a Jinja template in place of the target's own); an error when there is none."""
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise DraftsmithError(f"target {target_id!r} has no chat template; send plain prompts (or give a chat "
                              "template of your own: LLM.chat(chat_template=...), serve --chat-template)")
    if continue_final_message and add_generation_prompt:
        raise DraftsmithError("continue_final_message continues the last message: set add_generation_prompt "
                              "to false with it")
    kwargs = dict(chat_template_kwargs or {})
    # Only variables for the template: a parameter of apply_chat_template itself (chat_template: a
    # client's own Jinja; truncation, return_tensors, tools, ...) is not a client's to set.
    params = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    clash = sorted(set(kwargs) & (params | {"messages"}))
    if clash:
        raise DraftsmithError(f"chat_template_kwargs: {clash[0]} is not a template variable; only variables the "
                              "chat template reads may be set there (options such as add_generation_prompt have "
                              "fields of their own)")
    if tools:
        kwargs["tools"] = tools
    if chat_template:
        kwargs["chat_template"] = chat_template
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    """Messages for a target with or without a chat template: the template when there is one,
    else the contents joined by blank lines as plain text (eval / bench on base models)."""
    if getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, messages)
    return encode_text(tokenizer, "\n\n".join(m["content"] for m in messages))
