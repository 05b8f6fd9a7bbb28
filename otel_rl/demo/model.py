"""The policy: a tiny causal transformer (rotary positions) over the task's vocabulary (~100k parameters)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .task import ACTION_IDS, PAD, VOCAB_SIZE


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (RoPE) of queries or keys, shape (batch, heads, time, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, *rope), _rotate(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.ff(self.ln2(x))


class TinyPolicy(nn.Module):
    """Decoder-only transformer; `action_logits` restricts the output to what the policy may emit."""

    # buffers (register_buffer)
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    action_ids: torch.Tensor
    action_index: torch.Tensor

    def __init__(self, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, d_ff: int = 256, max_len: int = 32):
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(VOCAB_SIZE, d_model)
        half = d_model // n_heads // 2
        angles = torch.arange(max_len).unsqueeze(-1) * (10000.0 ** (-torch.arange(half) / half))
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, len(ACTION_IDS))
        self.register_buffer("action_ids", torch.tensor(ACTION_IDS), persistent=False)
        # token id -> index in the action head (-1: not an action)
        index = torch.full((VOCAB_SIZE,), -1, dtype=torch.long)
        index[torch.tensor(ACTION_IDS)] = torch.arange(len(ACTION_IDS))
        self.register_buffer("action_index", index, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits over `ACTION_IDS` at every position, shape (batch, time, actions)."""
        t = ids.shape[1]
        rope = (self.rope_cos[:t], self.rope_sin[:t])
        x = self.tok(ids)
        for blk in self.blocks:
            x = blk(x, rope)
        return self.head(self.ln(x))


def pad_batch(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (causal attention: padding never reaches real tokens) and lengths."""
    lengths = torch.tensor([len(s) for s in seqs])
    out = torch.full((len(seqs), int(lengths.max())), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return out, lengths


def token_log_probs(
    model: TinyPolicy, ids: torch.Tensor, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(ids[:, t+1] | ids[:, :t+1]) for every t (non-action targets get 0) and the entropy."""
    logits = model(ids[:, :-1]).float()
    logp_all = torch.log_softmax(logits, dim=-1)
    target = model.action_index[ids[:, 1:]]
    logp = logp_all.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target >= 0)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    return logp, entropy
