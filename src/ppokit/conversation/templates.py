"""Chat rendering: message lists into the text the model sees, with the tokenizer's chat template
(or `PLAIN_CHAT_TEMPLATE` when it has none). docs/data.md describes the choice of template."""

from __future__ import annotations

import os

from pathlib import Path
from typing import Any, Optional, Union

from ppokit.errors import UserError

Messages = list[dict]
Text = Union[str, Messages]  # a string, or a chat as role/content messages

# The fallback chat template, for tokenizers without one: "role: content" lines, and
# "assistant:" as the generation prompt. Plain text, so any tokenizer can encode it.
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def is_messages(value: Any) -> bool:
    """A chat: a non-empty list of {role, content} objects with string values."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)
    )


def resolve_chat_template(tokenizer, requested: Optional[str]) -> str:
    """The template to use: null/`auto` -> the tokenizer's, else PLAIN_CHAT_TEMPLATE; `plain`;
    `tokenizer` (must exist); a path to a .jinja file; or the Jinja text itself."""
    own = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if requested in (None, "auto"):
        return own or PLAIN_CHAT_TEMPLATE
    if requested == "plain":
        return PLAIN_CHAT_TEMPLATE
    if requested == "tokenizer":
        if not own:
            raise UserError("data.chat_template is 'tokenizer' but the tokenizer has no chat template; use auto or plain")
        return own
    if requested.endswith(".jinja"):
        path = Path(requested).expanduser()
        if not path.is_file():
            raise UserError(f"data.chat_template: file {requested} not found")
        return path.read_text(encoding="utf-8")
    return requested


class Renderer:
    """Turns prompts and completions (strings, or message lists) into the text the model sees.

    Strings pass through unchanged. Message lists go through the chat template chosen by
    `resolve_chat_template`; a BOS token the template writes is removed when the tokenizer adds
    one itself, so it is not doubled. `template_used` is the template text once any chat was
    rendered (the stage records it in its config and saves it with the tokenizer).
    """

    def __init__(self, tokenizer=None, chat_template: Optional[str] = None, tools: Optional[list[dict]] = None,
                 template_kwargs: Optional[dict] = None):
        self.tokenizer = tokenizer
        self.requested = chat_template
        self.tools = tools  # JSON schemas the template gets as `tools=` (an environment's tools), or None
        self.template_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs, e.g. enable_thinking
        self.template_used: Optional[str] = None
        self._strip_bos: Optional[str] = None

    def render(self, messages: Messages, add_generation_prompt: bool, strip_bos: bool = True, with_tools: bool = True,
               tools: Optional[list[dict]] = None) -> str:
        """The template's text for `messages` (with `tools`, or the `tools` given: a row's own, unless not `with_tools`,
        and the template kwargs); a Jinja error is one UserError line."""
        if self.template_used is None:
            template = resolve_chat_template(self.tokenizer, self.requested)
            self._check_writes_content(template)
            self.template_used = template
            self._strip_bos = _bos_added_by(self.tokenizer)
        tools = self.tools if tools is None else tools
        extra = {**self.template_kwargs, **({"tools": tools} if tools and with_tools else {})}
        text = self._apply(self.template_used, messages, add_generation_prompt, extra)
        if strip_bos and self._strip_bos and text.startswith(self._strip_bos):
            text = text[len(self._strip_bos) :]
        return text

    def _apply(self, template: str, messages: Messages, add_generation_prompt: bool, extra: dict) -> str:
        if self.tokenizer is None:
            import jinja2

            return jinja2.Template(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
            )
        except Exception as e:  # a Jinja error in a user's template
            raise UserError(f"data.chat_template: rendering failed ({type(e).__name__}: {_first_line(e)})") from None

    def _check_writes_content(self, template: str) -> None:
        """A template that does not write a user message's content would train every prompt as its fixed text (a
        template's name given as Jinja text, `chatml`, renders as the word itself). A template that cannot render one
        user message alone is left to fail, or not, on the real ones."""
        try:
            text = self._apply(template, [{"role": "user", "content": CONTENT_PROBE}], True, dict(self.template_kwargs))
        except Exception:  # noqa: BLE001 - its own error comes with the real messages, if any
            return
        if CONTENT_PROBE not in text:
            asked = self.requested or "auto"
            # a file is named whole (the user must find it); Jinja text given inline is cut to a glance
            shown = asked if len(asked) <= 80 or asked.endswith(".jinja") or os.path.isfile(asked) else f"{asked[:77]}..."
            raise UserError(f"data.chat_template: {shown!r} writes no message's content (a user message renders as {text[:80]!r}); "
                            "give auto, plain, tokenizer, a .jinja file, or Jinja text that writes message['content']")

    def prompt(self, prompt: Text, tools: Optional[list[dict]] = None) -> str:
        """A prompt's text: a string as it is, messages rendered with the generation prompt (and `tools`: a row's own)."""
        return prompt if isinstance(prompt, str) else self.render(prompt, add_generation_prompt=True, tools=tools)

    def pair(self, prompt: Text, completion: Text, where: str = "") -> tuple[str, str]:
        """-> (prompt text, completion text); chat completions are the rendered conversation's tail."""
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt, completion
        prompt_messages = prompt if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]
        completion_messages = completion if not isinstance(completion, str) else [{"role": "assistant", "content": completion}]
        prompt_text = self.render(prompt_messages, add_generation_prompt=True)
        full = self.render(prompt_messages + completion_messages, add_generation_prompt=False)
        if not full.startswith(prompt_text):
            raise UserError(
                f"{where}: the chat template renders the conversation so that it does not begin with its "
                f"rendered prompt; the completion cannot be separated (set data.chat_template=plain or another template)"
            )
        return prompt_text, full[len(prompt_text) :]


CONTENT_PROBE = "ppokit-content-probe"  # a message content no template writes by itself


def describe_template(template: str) -> str:
    return "the plain fallback template (role: content lines)" if template == PLAIN_CHAT_TEMPLATE else "the chat template"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _bos_added_by(tokenizer) -> Optional[str]:
    """The BOS string when the tokenizer prepends BOS by itself, else None."""
    if tokenizer is None or tokenizer.bos_token is None or tokenizer.bos_token_id is None:
        return None
    ids = tokenizer("a")["input_ids"]
    return tokenizer.bos_token if ids[:1] == [tokenizer.bos_token_id] else None
