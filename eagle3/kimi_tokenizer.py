"""A slow tiktoken tokenizer shaped like Kimi-K2.5's, for the rehearsal verifier.

Written for this project from the public description of Kimi-K2.5's tokenizer (no Moonshot
code): a `PreTrainedTokenizer` subclass over a byte-level BPE file `tiktoken.model` (one line
per rank: `base64(token bytes) rank`), Kimi's pre-tokenization regex, and 256 reserved special
ids after the BPE ranks with Kimi's chat markers at Kimi's offsets (`[BOS]` +0, `[EOS]` +1,
`<|im_end|>` +2, `<|im_user|>` +3, `<|im_assistant|>` +4, `<|im_system|>` +10,
`<|im_middle|>` +17, `<|media_pad|>` +21, `<think>` +22, `</think>` +23, `[UNK]` +254,
`[PAD]` +255). It has no fast counterpart and no offset mapping, which is exactly what the
pipeline must cope with on Kimi. `eagle3.verifiers` copies this file into the rehearsal
verifier as `tokenization_kimi.py`, loaded with `trust_remote_code`.
"""

from __future__ import annotations

import base64
import os
import shutil
from typing import Any, Optional

from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Kimi's pre-tokenization: Han runs; words with their leading punctuation and English
# contractions (cased and uncased variants, Han excluded by class intersection); digits in
# groups of three; punctuation runs; newlines; spaces.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_RESERVED = 256
# Named special tokens by offset after the last BPE rank (Kimi-K2.5's layout).
SPECIAL_OFFSETS = {
    0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
    6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
    17: "<|im_middle|>", 18: "<|media_begin|>", 19: "<|media_content|>", 20: "<|media_end|>",
    21: "<|media_pad|>", 22: "<think>", 23: "</think>", 254: "[UNK]", 255: "[PAD]",
}


def read_ranks(path: str) -> dict[bytes, int]:
    """`tiktoken.model`: one `base64(token) rank` line per BPE token."""
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def special_tokens(num_ranks: int) -> dict[str, int]:
    """Every reserved id after the ranks: the named ones, the rest `<|reserved_token_N|>`."""
    return {SPECIAL_OFFSETS.get(i, f"<|reserved_token_{num_ranks + i}|>"): num_ranks + i
            for i in range(NUM_RESERVED)}


class TikTokenTokenizer(PreTrainedTokenizer):
    """Slow tokenizer over a tiktoken BPE: `_tokenize` encodes with tiktoken and returns the
    byte-level (GPT-2 style) strings of the ids; special tokens are the added tokens."""

    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]",
                 unk_token: str = "[UNK]", pad_token: str = "[PAD]", **kwargs: Any) -> None:
        import tiktoken

        ranks = read_ranks(vocab_file)
        self.special = special_tokens(len(ranks))
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special)
        self.vocab_file = vocab_file
        byte_char = bytes_to_unicode()
        self.decoder = {rank: "".join(byte_char[b] for b in token)
                        for token, rank in ranks.items()}
        self.decoder.update({i: name for name, i in self.special.items()})
        self.encoder = {s: i for i, s in self.decoder.items()}
        self.char_byte = {c: b for b, c in byte_char.items()}
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special tokens were split off by the base class; what is left is plain text.
        return [self.decoder[i] for i in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.special["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index, "[UNK]")

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out, buf = [], bytearray()
        for t in tokens:
            if t in self.special:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(t)
            else:
                buf.extend(self.char_byte[c] for c in t)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def save_vocabulary(self, save_directory: str,
                        filename_prefix: Optional[str] = None) -> tuple[str]:
        out = os.path.join(save_directory, (filename_prefix or "") + "tiktoken.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, out)
        return (out,)
