"""Chat fine-tuning data for `prepare --chat`: a conversation's ids through the tokenizer's own
chat template, and a loss mask that keeps the assistant turns.

A record is a JSON object whose `--text-field` (default `messages` under --chat) is a list of
{"role": "system" | "user" | "assistant" | "tool", "content": str}. Its ids are
`apply_chat_template(messages)` of the `transformers` tokenizer in the `--tokenizer` folder
(tokenizer.json + tokenizer_config.json with a `chat_template`, as Hugging Face chat checkpoints
ship them). Assistant turn i covers the ids from the end of
`apply_chat_template(messages[:i], add_generation_prompt=True)` (the prompt up to and including
the template's assistant header) to the end of `apply_chat_template(messages[:i + 1])` (its
content and end-of-turn tokens): those are mask 1, everything else 0. The rendering of each
shorter conversation must be a prefix of the longer one's ids (true of the ChatML, Llama, Qwen,
Mistral and DeepSeek templates); a template that rewrites earlier turns is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import DataError

__all__ = ["ROLES", "load_chat_tokenizer", "chat_ids", "check_messages"]

ROLES = ("system", "user", "assistant", "tool")


def load_chat_tokenizer(path: str | Path):
    """The `transformers` tokenizer of a folder with a chat template (or a clear error)."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    try:
        import transformers
    except ImportError:
        raise DataError("prepare --chat needs the transformers package (pip install "
                        "transformers) for the tokenizer's apply_chat_template") from None
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot load a transformers tokenizer from {str(folder)!r}: {e}") from e
    if not getattr(tok, "chat_template", None):
        raise DataError(f"the tokenizer in {str(folder)!r} has no chat_template (in "
                        f"tokenizer_config.json or chat_template.jinja); prepare --chat applies "
                        f"the tokenizer's own template")
    return tok


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """The record's messages, validated: a list of {role, content} with a known role and at
    least one assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages is {type(messages).__name__}"
                        f"{' (empty)' if messages == [] else ''}, not a non-empty list of "
                        f"{{role, content}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}: message {i} is {m!r}, not {{'role': ..., 'content': ...}}")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has the unknown role {m['role']!r}; valid: "
                            f"{', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise DataError(f"{where}: message {i} content is {type(m['content']).__name__}, "
                            f"not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to train "
                        f"on (roles: {[m['role'] for m in messages]})")
    return messages


def _render(tok, messages: list[dict[str, str]], prompt: bool, where: str) -> list[int]:
    try:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      add_generation_prompt=prompt)
    except Exception as e:  # jinja raises TemplateError and friends for a template's own checks
        raise DataError(f"{where}: the chat template rejects the conversation: {e}") from e
    return list(out["input_ids"])


def chat_ids(tok, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
    """(ids, mask) of one conversation: mask 1 on the ids of the assistant turns."""
    ids = _render(tok, messages, False, where)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = _render(tok, messages[:i], True, where) if i else []
        start = len(prompt)
        upto = _render(tok, messages[:i + 1], False, where)
        if ids[:len(upto)] != upto or upto[:start] != prompt:
            raise DataError(f"{where}: the chat template does not render turn {i} as a prefix "
                            f"of the whole conversation, so its assistant tokens cannot be "
                            f"located; use a template that renders turns in order")
        for j in range(start, len(upto)):
            mask[j] = 1
    return ids, mask
