"""A pure-Python (slow) tokenizer, built here: what a model without a Rust-backed ``tokenizers`` file serves with."""
from __future__ import annotations

from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

#: A plain chat template: each message as ``<role>content`` and a newline.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class ByteTokenizer(PreTrainedTokenizer):
    """One token per UTF-8 byte (ids 0-255, written as byte-level BPE writes them), then ``<eos>`` (256)."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        self._chars = bytes_to_unicode()  # byte -> its printable character
        self._bytes = {char: byte for byte, char in self._chars.items()}
        super().__init__(eos_token="<eos>", pad_token="<eos>", **kwargs)
        self.chat_template = TEMPLATE

    @property
    def vocab_size(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {**self._bytes, **self.added_tokens_encoder}

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self._chars[b] for b in text.encode()]

    def _convert_token_to_id(self, token: str) -> int:
        return self._bytes[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._chars[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self._bytes[char] for char in "".join(tokens)).decode(errors="replace")
