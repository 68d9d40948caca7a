"""Real chat templates for tests: the original templates the `trl` package ships (read from the installed package,
never copied here), and for each family a byte-level tokenizer carrying its special tokens, so that any text the
template renders round-trips exactly and a tiny model can be rendered, sampled and trained with it.

    family = FAMILIES["qwen2_5"]
    tokenizer = family.tokenizer()               # chat_template set to the original template
    family.call("add", {"a": 1, "b": 2})         # a call in the family's own format, as the model writes it
    family.stop                                  # the token that ends an assistant turn (ppo.stop_token)

Used by tests/test_conversation.py and by other multi-turn tests (a ChatML template with a stop token: "qwen2_5").
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass, field
from typing import Callable, Optional

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast


def trl_template(name: str) -> str:
    """The original chat template `name` (e.g. "qwen2_5") as the installed trl package ships it."""
    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text(encoding="utf-8")


def byte_tokenizer(special: list[str], added: list[str] = (), *, eos: str, pad: str, bos: Optional[str] = None,
                   unk: Optional[str] = None, chat_template: Optional[str] = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the 256-byte alphabet with no merges (every text is one token per byte: any template text
    round-trips exactly), plus `special` tokens (registered as special) and `added` ones (added, not special: Qwen's
    `<tool_call>`, `<think>`)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    names = dict(eos_token=eos, pad_token=pad, **({"bos_token": bos} if bos else {}), **({"unk_token": unk} if unk else {}))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **names)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def hermes_call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def qwen3_coder_call(name: str, arguments: dict) -> str:
    parameters = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


def llama3_call(name: str, arguments: dict) -> str:
    return '{"name": "' + name + '", "parameters": ' + json.dumps(arguments) + "}"


def harmony_call(name: str, arguments: dict) -> str:
    return (f"<|channel|>analysis<|message|>I call {name}.<|end|><|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>"
            f"{json.dumps(arguments)}")


def mistral_call(name: str, arguments: dict) -> str:
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}"


def pythonic_call(name: str, arguments: dict) -> str:
    return "[" + name + "(" + ", ".join(f"{k}={v!r}" for k, v in arguments.items()) + ")]"


# A tool file the chat tests write out: a typed signature and a docstring for its schema.
ADD = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b
'''

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                 "<|python_tag|>", "<|finetune_right_pad_id|>"]
DEEPSEEK_SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
                    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"]
HARMONY_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>"]
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]


@dataclass(frozen=True)
class Family:
    """A chat-model family: its original template (trl's file), the tokens its tokenizer registers, the token that ends an
    assistant turn, the tool-call format `auto` should choose (None: its template renders no tools), and how the model
    writes a call. `reasoning`: the template drops earlier turns' reasoning when it re-renders them."""

    template: str
    special: list[str]
    added: list[str]
    stop: str
    pad: str
    bos: Optional[str] = None
    parser: Optional[str] = None
    call: Optional[Callable[[str, dict], str]] = None
    reasoning: bool = False
    template_kwargs: dict = field(default_factory=dict)
    eos: Optional[str] = None  # the tokenizer's EOS when it is not the stop token

    def tokenizer(self, **kw) -> PreTrainedTokenizerFast:
        return byte_tokenizer(self.special, self.added, eos=self.eos or self.stop, pad=self.pad, bos=self.bos,
                              chat_template=trl_template(self.template), **kw)

    def answer(self, text: str, thought: str = "Let me think.") -> str:
        """A final answer as the model writes it after the generation prompt (a reasoning family thinks first)."""
        if self.template == "gptoss":
            return f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant<|channel|>final<|message|>{text}"
        if self.reasoning and self.template_kwargs.get("enable_thinking", True) is not False:
            prefix = "" if self.template in ("qwen3_5_think", "deepseek_r1_distill") else "<think>\n"  # the prompt opened it
            return f"{prefix}{thought}\n</think>\n\n{text}"
        return text

    def calling(self, name: str, arguments: dict, thought: str = "I need a tool.") -> str:
        """A turn that calls one tool, as the model writes it after the generation prompt."""
        call = self.call(name, arguments)
        if self.template == "gptoss":
            return call
        if self.reasoning and self.template_kwargs.get("enable_thinking", True) is not False:
            prefix = "" if self.template in ("qwen3_5_think", "deepseek_r1_distill") else "<think>\n"
            return f"{prefix}{thought}\n</think>\n\n{call}"
        return call


FAMILIES: dict[str, Family] = {
    "qwen2_5": Family("qwen2_5", QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>", "<|endoftext|>", parser="hermes", call=hermes_call),
    "qwen3": Family("qwen3", QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>", "<|endoftext|>", parser="hermes", call=hermes_call, reasoning=True),
    "qwen3_nothink": Family("qwen3", QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>", "<|endoftext|>", parser="hermes", call=hermes_call,
                            reasoning=True, template_kwargs={"enable_thinking": False}),
    "qwen3_5_think": Family("qwen3_5_think", QWEN_SPECIAL, QWEN_ADDED, "<|im_end|>", "<|endoftext|>", parser="qwen3_coder",
                            call=qwen3_coder_call, reasoning=True),
    "llama3_1": Family("llama3_1", LLAMA_SPECIAL, [], "<|eot_id|>", "<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                       parser="llama3_json", call=llama3_call),
    "llama3_2": Family("llama3_2", LLAMA_SPECIAL, [], "<|eot_id|>", "<|finetune_right_pad_id|>", bos="<|begin_of_text|>",
                       parser="llama3_json", call=llama3_call),
    "deepseek_r1_distill": Family("deepseek_r1_distill", DEEPSEEK_SPECIAL, ["<think>", "</think>"], "<｜end▁of▁sentence｜>",
                                  "<｜▁pad▁｜>", bos="<｜begin▁of▁sentence｜>", reasoning=True),
    "gptoss": Family("gptoss", HARMONY_SPECIAL, [], "<|call|>", "<|endoftext|>", parser="openai", call=harmony_call, reasoning=True,
                     eos="<|return|>"),
    "gemma3": Family("gemma3", GEMMA_SPECIAL, [], "<end_of_turn>", "<pad>", bos="<bos>"),
}
