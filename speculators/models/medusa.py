"""Medusa heads, as vLLM's `medusa` loader computes them.

Head h reads the target's post-final-norm hidden state h_t and predicts token t+h+2:

    x = h_t;  for each ResBlock layer: x = x + SiLU(layer(x))   (Linear with bias)
    logits_h = lm_head_h(x)        # per-head lm head, or the target's frozen one shared
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from speculators.kernels.medusa_proposal import medusa_propose
from speculators.kernels.tree import TreeBatch, medusa_tree, medusa_tree_tokens

from .base import SpeculatorModel, default_hybrid_settings, input_major

# A 9-node tree for CPU-sized verification forwards (Medusa's own 63-node trees pay off on GPUs, where
# 64 query tokens cost about what 4 do): choice c takes the c[d]-th best token of head d at depth d.
DEFAULT_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@dataclass
class MedusaConfig:
    """Fields as vLLM's MedusaConfig. Never add keys containing both "num" and "heads" (or
    "num" and "layers") here: vLLM renames them to num_heads / num_hidden_layers."""

    MODEL_TYPE = "medusa"
    IGNORED_KEYS = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version")

    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_hidden_layers: int = 1  # ResBlocks per head
    truncated_vocab_size: int | None = None
    medusa_fc_bias: bool = True
    logit_scale: float = 1.0
    original_lm_head: bool = False  # True: one shared lm head (the target's, frozen)
    speculators_draft_vocab_size: int = 0  # tokens the heads propose (draft_vocab); 0: all; vLLM ignores it
    speculators_target: dict = field(default_factory=dict)
    speculators_hybrid: dict = field(default_factory=default_hybrid_settings)  # vLLM's loaders ignore it

    def __post_init__(self):
        if self.truncated_vocab_size is None:
            self.truncated_vocab_size = self.vocab_size

    def to_json(self) -> dict:
        return {"architectures": ["MedusaModel"], "model_type": self.MODEL_TYPE, **asdict(self)}


class ResBlockStack(nn.Module):
    def __init__(self, hidden: int, n_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(n_layers))
        for layer in self.layers:  # zero init: each head starts as the identity on h_t
            nn.init.zeros_(layer.weight)
            if bias:
                nn.init.zeros_(layer.bias)

    def forward(self, x):
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class Medusa(SpeculatorModel):
    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = c = config
        self.blocks = nn.ModuleList(
            ResBlockStack(c.hidden_size, c.num_hidden_layers, c.medusa_fc_bias) for _ in range(c.num_heads)
        )
        # One [n, V, D] tensor: the fused loss and the proposal kernel take the heads stacked.
        # Saved as vLLM's lm_heads.{h}.weight (or lm_head.weight when shared and frozen).
        n_lm = 1 if c.original_lm_head else c.num_heads
        self.lm_head_weight = nn.Parameter(torch.empty(n_lm, c.vocab_size, c.hidden_size),
                                           requires_grad=not c.original_lm_head)
        nn.init.normal_(self.lm_head_weight, std=1 / c.hidden_size**0.5)

    def head_weights(self) -> torch.Tensor:
        """[V, D] when the lm head is shared, else [num_heads, V, D]."""
        return self.lm_head_weight[0] if self.config.original_lm_head else self.lm_head_weight

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Head states [num_heads, B, T, D]; head h at position t predicts token t+h+2."""
        return torch.stack([block(hidden) for block in self.blocks])

    def vocab_heads(self) -> torch.Tensor:
        return self.lm_head_weight

    def widest_topk(self) -> int:
        return 1 + max(i for choice in DEFAULT_CHOICES for i in choice)

    def _heads(self, k: int):
        """(ResBlock weights [k, L, D, D], biases or None, lm head(s), vocabulary ids of the head rows or
        None) of the first k heads, as the kernel takes them: only the proposal_vocab rows when the heads
        keep a draft vocabulary, input-major on the CPU (base.input_major). Rebuilt when k or any
        parameter changes (an optimizer step or a load bumps its version)."""
        if k > self.config.num_heads:
            raise ValueError(f"k={k} exceeds the number of Medusa heads ({self.config.num_heads})")
        key = (k, *((p.data_ptr(), p._version) for p in self.parameters()))
        if getattr(self, "_heads_key", None) != key:
            blocks = self.blocks[:k]
            weights = torch.stack([torch.stack([layer.weight for layer in b.layers]) for b in blocks]).detach()
            bias = (torch.stack([torch.stack([layer.bias for layer in b.layers]) for b in blocks]).detach()
                    if self.config.medusa_fc_bias else None)
            lm_head = self.head_weights() if self.config.original_lm_head else self.lm_head_weight[:k]
            vocab_ids = self.proposal_vocab()
            if vocab_ids is not None:
                lm_head = lm_head.index_select(-2, vocab_ids)
            if lm_head.device.type == "cpu":
                weights, lm_head = input_major([weights, lm_head])
            self._heads_cache, self._heads_key = (weights, bias, lm_head.detach(), vocab_ids), key
        return self._heads_cache

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Top-1 chain of k drafts [B, k] (vLLM's V1 Medusa proposer; a positive logit_scale does not
        change an argmax); `tokens` is unused. The fused kernel on CUDA, its reference elsewhere."""
        *weights, vocab_ids = self._heads(k)
        return medusa_propose(hidden, *weights, top_k=1, vocab_ids=vocab_ids)[1][:, :, 0]

    @torch.no_grad()
    def propose_tree(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int | None = None) -> TreeBatch:
        """Medusa's candidate tree: the static tree of DEFAULT_CHOICES no deeper than `depth` (and the
        number of heads), filled with each head's top-k tokens; the root is `tokens` (the token just emitted)."""
        depth = min(depth or self.config.num_heads, self.config.num_heads)
        tree = medusa_tree([c for c in DEFAULT_CHOICES if len(c) <= depth], hidden.device)
        *weights, vocab_ids = self._heads(tree.num_heads)
        _, idx = medusa_propose(hidden, *weights, top_k=tree.max_topk, vocab_ids=vocab_ids)
        B, N = hidden.shape[0], tree.num_nodes
        return TreeBatch(medusa_tree_tokens(tree, tokens, idx), tree.parents.expand(B, N), tree.depth.expand(B, N),
                         tree.attn_mask.expand(B, N, N), torch.full((B,), N), torch.empty(B, 0, 0, dtype=torch.int64))

    def init_from_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        with torch.no_grad():
            self.lm_head_weight.copy_(lm_head.expand_as(self.lm_head_weight))

    # vLLM names: blocks.{h}.layers.{l}.weight/.bias, lm_heads.{h}.weight, or lm_head.weight if shared
    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v for k, v in self.state_dict().items() if k.startswith("blocks.")}
        if self.config.original_lm_head:
            sd["lm_head.weight"] = self.lm_head_weight.data[0]
        else:
            sd.update({f"lm_heads.{h}.weight": w for h, w in enumerate(self.lm_head_weight.data)})
        return sd

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        tensors = {k.replace("medusa_heads.", ""): v for k, v in tensors.items()}
        self._check_and_copy(tensors, self.vllm_state_dict())
        self._load_draft_vocab(tensors)
