"""IBM's MLP speculator, exactly as vLLM's `mlp_speculator` loader computes it.

Stage i reads a state (stage 0: the target's post-final-norm hidden state h_t) and
the embedding of the token chosen one step earlier, and predicts token t+i+2:

    s = proj[i](state) + emb[i](tok) * (emb_weight / state_weight)
    s = GELU(ln[i](s))            # RMS-style norm with weight and bias, exact GELU
    logits_i = head[i](s);  next stage: state = s, tok = argmax(logits_i)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from speculators.kernels.mlp_proposal import mlp_speculator_propose, mlp_speculator_propose_topk
from speculators.kernels.tree import TreeBatch, mlp_candidate_paths, paths_to_tree

from .base import SpeculatorModel, default_hybrid_settings, input_major

EPS = 1e-6


@dataclass
class MLPSpeculatorConfig:
    """Fields and defaults as vLLM's MLPSpeculatorConfig; `speculators_target` records the target it fits."""

    MODEL_TYPE = "mlp_speculator"
    IGNORED_KEYS = ("architectures", "model_type", "torch_dtype", "dtype", "transformers_version")

    vocab_size: int
    emb_dim: int  # the target's hidden size
    inner_dim: int = 0  # 0 means emb_dim
    n_predict: int = 3
    top_k_tokens_per_head: list = field(default_factory=lambda: [5, 4, 3])
    n_candidates: int = 5
    tie_weights: bool = False
    scale_input: bool = False
    speculators_draft_vocab_size: int = 0  # tokens the heads propose (draft_vocab); 0: all; vLLM ignores it
    speculators_target: dict = field(default_factory=dict)
    speculators_hybrid: dict = field(default_factory=default_hybrid_settings)  # vLLM's loaders ignore it

    def __post_init__(self):
        if self.inner_dim == 0:
            self.inner_dim = self.emb_dim
        if self.tie_weights and self.n_predict < 2:
            raise ValueError("tie_weights needs n_predict >= 2")
        if len(self.top_k_tokens_per_head) != self.n_predict:
            self.top_k_tokens_per_head = (list(self.top_k_tokens_per_head) + [1] * self.n_predict)[: self.n_predict]

    def to_json(self) -> dict:
        return {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": self.MODEL_TYPE, **asdict(self)}


class RMSNormWithBias(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight + bias — no mean subtraction (vLLM's MLPSpeculatorLayerNorm)."""

    def __init__(self, dim: int, affine: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return x * self.weight + self.bias if self.weight is not None else x


class MLPSpeculator(SpeculatorModel):
    config_class = MLPSpeculatorConfig

    def __init__(self, config: MLPSpeculatorConfig):
        super().__init__()
        self.config = c = config
        n_emb = 1 if c.tie_weights else c.n_predict
        n_proj = 2 if c.tie_weights else c.n_predict
        self.emb = nn.ModuleList(nn.Embedding(c.vocab_size, c.inner_dim) for _ in range(n_emb))
        self.proj = nn.ModuleList(
            nn.Linear(c.emb_dim if i == 0 else c.inner_dim, c.inner_dim, bias=False) for i in range(n_proj)
        )
        self.ln = nn.ModuleList(RMSNormWithBias(c.inner_dim) for _ in range(n_emb))
        # One [n, V, inner] tensor rather than n Linears: the fused loss takes the heads stacked, and
        # stacking copies every step would cost n*V*inner floats. Saved as vLLM's head.{i}.weight.
        self.head_weight = nn.Parameter(torch.empty(n_emb, c.vocab_size, c.inner_dim))
        self.input_norm = RMSNormWithBias(c.emb_dim, affine=False)
        self.state_weight = 0.5 ** (0.5 / c.n_predict)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (c.inner_dim / 2))
        self.reset_parameters()

    def reset_parameters(self):
        # IBM's init: unit-variance embeddings and heads scaled to the inner width, so the
        # state and the token embedding enter each stage at comparable magnitudes.
        for emb in self.emb:
            nn.init.normal_(emb.weight, std=1 / math.sqrt(self.config.inner_dim))
        for lin in self.proj:
            nn.init.normal_(lin.weight, std=1 / math.sqrt(lin.in_features))
        nn.init.normal_(self.head_weight, std=1 / math.sqrt(self.config.inner_dim))

    def stage(self, i: int) -> tuple[nn.Embedding, nn.Linear, RMSNormWithBias, torch.Tensor]:
        j = 0 if self.config.tie_weights else i
        return self.emb[j], self.proj[min(i, 1) if self.config.tie_weights else i], self.ln[j], self.head_weight[j]

    def head_weights(self) -> torch.Tensor:
        """[V, inner] when tied, else [n_predict, V, inner] (the layout the fused loss takes)."""
        return self.head_weight[0] if self.config.tie_weights else self.head_weight

    def step(self, i: int, state: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        emb, proj, ln, _ = self.stage(i)
        if i == 0 and self.config.scale_input:
            state = self.input_norm(state) / math.sqrt(2)
        s = proj(state) + emb(tokens) * (self.emb_weight / self.state_weight)
        return F.gelu(ln(s))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training states [n_predict, B, T, inner].

        hidden[b, t] is the target's state at position t; stage i is fed token t+i+1 and
        predicts token t+i+2. Positions whose inputs run past the sequence read token 0;
        the loss masks them out.
        """
        states, state = [], hidden
        for i in range(self.config.n_predict):
            tokens = F.pad(input_ids[:, i + 1 :], (0, i + 1))
            state = self.step(i, state, tokens)
            states.append(state)
        return torch.stack(states)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
        """Greedy chain of k draft tokens [B, k] from hidden [B, D] and the just-sampled tokens [B]
        (the fused proposal kernel on CUDA, its PyTorch reference elsewhere)."""
        if k > self.config.n_predict:
            raise ValueError(f"k={k} exceeds the speculator's n_predict={self.config.n_predict}")
        weights, signed, vocab_ids = self._proposal_weights()
        return mlp_speculator_propose(hidden, tokens, *weights, scale_input=self.config.scale_input, num_tokens=k,
                                      signed_head=signed, vocab_ids=vocab_ids)

    @torch.no_grad()
    def propose_tree(self, hidden: torch.Tensor, tokens: torch.Tensor, depth: int | None = None) -> TreeBatch:
        """IBM's tree drafting: every stage expands each branch with its top-k tokens
        (`top_k_tokens_per_head`, the first `depth` stages), the `n_candidates` paths with the highest
        cumulative log-probability are kept and merged into one tree per request (shared prefixes share
        nodes); the root is `tokens`."""
        c = self.config
        depth = c.n_predict if depth is None else depth
        if depth > c.n_predict:
            raise ValueError(f"a tree of depth {depth} exceeds the speculator's n_predict={c.n_predict}")
        weights, signed, vocab_ids = self._proposal_weights()
        outs = mlp_speculator_propose_topk(hidden, tokens, *weights, scale_input=c.scale_input,
                                           top_k_per_head=c.top_k_tokens_per_head[:depth], signed_head=signed,
                                           vocab_ids=vocab_ids)
        paths, _, _ = mlp_candidate_paths(outs, c.n_candidates)
        return paths_to_tree(tokens, paths)

    def _proposal_weights(self) -> tuple[tuple[list, ...], bool, torch.Tensor | None]:
        """(emb, proj, ln weight, ln bias, head) lists over all n_predict stages, as the proposal ops take
        them; whether the heads are the signed readout's W (see signed_readout); and the vocabulary ids
        of the head rows kept (see proposal_vocab), or None for all of them. Rebuilt once per version of
        the head tensor: any in-place change (an optimizer step, a load) makes the next call look again."""
        w = self.head_weight
        key = (w.data_ptr(), w._version)
        if getattr(self, "_proposal_key", None) != key:
            stages = [self.stage(i) for i in range(self.config.n_predict)]
            signed = self.signed_readout()
            heads = signed if signed is not None else [s[3] for s in stages]
            vocab_ids = self.proposal_vocab()
            if vocab_ids is not None:
                heads = [h[vocab_ids].contiguous() for h in heads]
            projs = [s[1].weight for s in stages]
            if w.device.type == "cpu":
                heads, projs = input_major(heads), input_major(projs)
            self._proposal = (([s[0].weight for s in stages], projs,
                               [s[2].weight for s in stages], [s[2].bias for s in stages], heads),
                              signed is not None, vocab_ids)
            self._proposal_key = key
        return self._proposal

    def signed_readout(self) -> list[torch.Tensor] | None:
        """Per stage W [V, inner/2] when every head is exactly [W, -W] (init: regression trains it so,
        with W the target's frozen lm head), else None. Such a head's logits are W·(s[:half] - s[half:]),
        so proposing reads half the bytes."""
        w = self.head_weight
        half = w.shape[-1] // 2
        pos, neg = w[..., :half], w[..., half:]
        if w.shape[-1] % 2 or not torch.equal(pos, -neg):
            return None
        return [pos[0 if self.config.tie_weights else i] for i in range(self.config.n_predict)]

    def vocab_heads(self) -> torch.Tensor:
        return self.head_weight

    def widest_topk(self) -> int:
        return max([1, *self.config.top_k_tokens_per_head])

    def init_from_target(self, embed: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Start embeddings and heads from the target's (when inner_dim == hidden size)."""
        if self.config.inner_dim != embed.shape[1]:
            raise ValueError("init_from_target needs inner_dim equal to the target's hidden size")
        with torch.no_grad():
            for emb in self.emb:
                emb.weight.copy_(embed)
            self.head_weight.copy_(lm_head.expand_as(self.head_weight))

    def init_regression(self, A: torch.Tensor, token_vectors: torch.Tensor, lm_head: torch.Tensor,
                        scale: float) -> None:
        """Start every stage as the linear next-hidden-state predictor p = A·state + token_vectors[tok],
        normalised to `scale` and read out through the target's lm head W (kept frozen by the trainer).

        Needs inner_dim = 2·D. The pre-norm state is [p; -p]: its RMS is p's, so the norm gives
        y = scale·[p; -p]/rms(p); GELU(y) - GELU(-y) = y for every y, so the head [W, -W] yields
        W·y — the target's logits for the predicted hidden state — and a later stage recovers y from
        [GELU(y); GELU(-y)] with the same signed trick in its projection.
        """
        c = self.config
        D = c.emb_dim
        if c.inner_dim != 2 * D or c.scale_input:
            raise ValueError(f"init_regression needs inner_dim = 2 x {D} and scale_input false")
        with torch.no_grad():
            self.proj[0].weight.copy_(torch.cat([A, -A]))
            for proj in self.proj[1:]:
                proj.weight.copy_(torch.cat([torch.cat([A, -A], 1), torch.cat([-A, A], 1)]))
            # In place, half by half: [V, 2D] temporaries would be GBs for a 151,936-token vocabulary.
            for emb in self.emb:  # forward() scales embeddings by emb_weight / state_weight
                half = emb.weight[:, :D].copy_(token_vectors).mul_(self.state_weight / self.emb_weight)
                emb.weight[:, D:].copy_(half).neg_()
            for ln in self.ln:
                ln.weight.fill_(scale)
                ln.bias.zero_()
            for head in self.head_weight:
                head[:, :D].copy_(lm_head)
                head[:, D:].copy_(lm_head).neg_()

    # vLLM names: emb.{i}.weight, proj.{i}.weight, ln.{i}.weight/bias, head.{i}.weight
    def vllm_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v for k, v in self.state_dict().items() if k != "head_weight"}
        sd.update({f"head.{i}.weight": w for i, w in enumerate(self.head_weight.data)})
        return sd

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        # vLLM strips any "speculator." prefix; do the same so fms-extras checkpoints load too.
        tensors = {k.replace("speculator.", ""): v for k, v in tensors.items()}
        self._check_and_copy(tensors, dict(self.vllm_state_dict()))
        self._load_draft_vocab(tensors)
