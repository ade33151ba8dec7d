"""Chat formats: how a message list becomes token ids, turn by turn, without re-tokenising sampled text.

The agent keeps a token ledger. The first prompt is `render(messages)`; after each sampled assistant output,
only `continuation(new_messages, output_text)` is tokenised and appended: the text that closes the assistant
turn (unless the sampled stop token already did), the new messages, and the next assistant header. The
sampled tokens themselves are never decoded and re-encoded (docs/DESIGN.md §3.2, docs/ALGORITHMS.md §2.4).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: str


class ChatFormat:
    name = "base"
    stop_strings: tuple[str, ...] = ()  # special-token texts that end an assistant turn
    assistant_close = ""  # text that ends an assistant turn in the canonical rendering

    def render_message(self, message: Message) -> str:
        raise NotImplementedError

    def generation_prompt(self) -> str:
        raise NotImplementedError

    def prefix(self) -> str:
        return ""

    def render(self, messages: list[Message], add_generation_prompt: bool = True) -> str:
        text = self.prefix() + "".join(self.render_message(m) for m in messages)
        return text + self.generation_prompt() if add_generation_prompt else text

    def continuation(self, new_messages: list[Message], output_text: str,
                     add_generation_prompt: bool = False) -> str:
        """Text to append after a sampled assistant output (`output_text` decoded with special tokens kept)."""
        text = self.assistant_close + "".join(self.render_message(m) for m in new_messages)
        if add_generation_prompt:
            text += self.generation_prompt()
        for stop in self.stop_strings:  # the sampled stop token already opened/closed part of this text
            if output_text.endswith(stop):
                if text.startswith(stop):
                    return text[len(stop):]
                break
        return text

    def stop_token_ids(self, tokenizer) -> list[int]:
        ids = []
        for s in self.stop_strings:
            tid = tokenizer.convert_tokens_to_ids(s)
            if isinstance(tid, int) and tid != tokenizer.unk_token_id:
                ids.append(tid)
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
            ids.append(tokenizer.eos_token_id)
        return ids


class ChatMLFormat(ChatFormat):
    """<|im_start|>role\\ncontent<|im_end|>\\n (SmolLM2, Qwen). Tool results go in a user turn wrapped in
    <tool_response>, the convention of ChatML models trained on tool use."""

    name = "chatml"
    stop_strings = ("<|im_end|>",)
    assistant_close = "<|im_end|>\n"

    def render_message(self, m: Message) -> str:
        if m.role == "tool":
            return f"<|im_start|>user\n<tool_response>\n{m.content}\n</tool_response><|im_end|>\n"
        return f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n"

    def generation_prompt(self) -> str:
        return "<|im_start|>assistant\n"


class GLMFormat(ChatFormat):
    """GLM-4.5 / GLM-5 family: [gMASK]<sop><|system|>…<|user|>…<|assistant|>…<|observation|>… The model ends its
    turn by emitting the next role tag (<|observation|> after a tool call, <|user|> otherwise)."""

    name = "glm"
    stop_strings = ("<|observation|>", "<|user|>", "<|endoftext|>")
    assistant_close = ""

    def prefix(self) -> str:
        return "[gMASK]<sop>"

    def render_message(self, m: Message) -> str:
        if m.role == "tool":
            return f"<|observation|><tool_response>{m.content}</tool_response>"
        tag = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}[m.role]
        return f"{tag}\n{m.content}"

    def generation_prompt(self) -> str:
        return "<|assistant|>\n"


CHAT_FORMATS = {f.name: f for f in (ChatMLFormat, GLMFormat)}


def make_chat_format(name: str) -> ChatFormat:
    try:
        return CHAT_FORMATS[name]()
    except KeyError:
        raise ValueError(f"unknown chat format {name!r}; known: {sorted(CHAT_FORMATS)}") from None
