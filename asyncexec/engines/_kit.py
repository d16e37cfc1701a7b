"""A tiny Llama-family model and its tokenizer, made locally from a seed: a real model for tests
and examples where nothing can be downloaded (no hub here, nor in CI).

The tokenizer reads one character a token (digits, lowercase letters, a few signs), so a prompt's
tokens are its characters and a reward can be computed from the token ids alone. The model is a
``LlamaForCausalLM`` with random weights (the same for the same seed) whose head size is 64: the
CPU attention kernels of vLLM refuse a head size of 16.

Imports transformers, tokenizers and torch when called, never when imported.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["TinyLlama", "build_tiny_llama"]

#: Special tokens first (their ids are their places), then one token per character.
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = "0123456789abcdefghijklmnopqrstuvwxyz =+-*/.,:;?!()"


@dataclass(frozen=True)
class TinyLlama:
    """A tiny Llama's shape. ``vocab_size`` is padded past the tokenizer's vocabulary (a
    multiple of 8): the ids above it are never in a prompt, but the model may sample them."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    vocab_size: int = 64
    max_position_embeddings: int = 512
    seed: int = 0

    def config(self) -> Any:
        """The ``transformers.LlamaConfig``."""
        from transformers import LlamaConfig

        shape = asdict(self)
        shape.pop("seed")
        return LlamaConfig(
            **shape,
            num_key_value_heads=self.num_attention_heads,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        )


def _tokenizer() -> Any:
    """One character a token, specials first; decodes by joining the characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARACTERS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_llama(path: str | os.PathLike[str], shape: TinyLlama = TinyLlama()) -> str:
    """Write a tiny Llama (random weights from ``shape.seed``) and its tokenizer to the folder
    ``path``, as ``from_pretrained`` and vLLM read them; return the folder. A folder that holds
    the same shape already is left as it is (made once per machine, shared by processes).

    Args:
        path: the folder (made if missing).
        shape: the model's sizes and seed.
    """
    folder = os.fspath(path)
    os.makedirs(folder, exist_ok=True)
    # One builder at a time (processes that share the folder wait, then find it made).
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _build(folder, shape)
    return folder


def _build(folder: str, shape: TinyLlama) -> None:
    import torch
    from transformers import LlamaForCausalLM

    marker = os.path.join(folder, "asyncexec_tiny_llama.json")
    wanted = json.dumps(asdict(shape), sort_keys=True)
    if os.path.exists(marker):
        with open(marker) as f:
            if f.read() == wanted:
                return
    with torch.random.fork_rng():
        torch.manual_seed(shape.seed)
        model = LlamaForCausalLM(shape.config())
    model.save_pretrained(folder, safe_serialization=True)
    _tokenizer().save_pretrained(folder)
    # Written last, atomically: a folder with the marker is whole.
    with open(marker + ".tmp", "w") as f:
        f.write(wanted)
    os.replace(marker + ".tmp", marker)
