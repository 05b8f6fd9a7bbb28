"""A tiny randomly initialised causal LM and its tokenizer, built on the spot (no hub, CPU, seconds)."""

from __future__ import annotations

from typing import Any

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+= "


def tokenizer() -> Any:
    """A character-level tokenizer made with the `tokenizers` library, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for c in ALPHABET:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>")
    hf.padding_side = "left"
    return hf


def model(tok: Any, seed: int = 0) -> Any:
    """A one-layer Llama with a 16-wide hidden state, randomly initialised from its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return LlamaForCausalLM(cfg)


def prompts(n: int) -> list[str]:
    return [f"{i % 7}+{(3 * i) % 5}=" for i in range(n)]


def lm_dataset(tok: Any, n: int) -> Any:
    """Token sequences for `transformers.Trainer` (labels = input ids)."""
    from datasets import Dataset

    texts = [p + str(eval(p[:-1])) for p in prompts(n)]  # noqa: S307 - our own "a+b" strings
    enc = tok(texts, padding="max_length", max_length=8, truncation=True)
    return Dataset.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                              "labels": enc["input_ids"]})
