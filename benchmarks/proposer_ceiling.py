"""How much can any proposer that reads only the target's last hidden state (and the tokens after it)
accept? A measured ceiling for the MLP and Medusa recipes' τ on the embedded target (an estimate: the
best of the predictors fitted here, at the data scale given, not a proof).

vLLM's MLP speculator and Medusa heads see the target's post-norm hidden state h_t at the last accepted
position, and the MLP speculator also the token(s) after it. Whatever their architecture, their first
draft can only be as good as the best predictor of the target's greedy x_{t+2} from those inputs. This
script fits predictors of growing capacity, freer than the vLLM formats, and measures that ceiling:

- `medusa`   : h_t                          → x_{t+2}   (Medusa head 0)
- `mlp`      : h_t, x_{t+1}                 → x_{t+2}   (MLP-speculator stage 0)
- `mlp+1`    : h_t, x_{t+1}, x_{t+2}        → x_{t+3}   (stage 1 given that stage 0 was right, with the
                                                          true state: an optimistic conditional ceiling)

Each predictor is p = A·[h, e(x…), 1] + MLP([h, e(x…)]) read out through the target's frozen lm head
(the target's own logits are W·h_{t+1}): width 0 is the least-squares linear map alone; wider ones add
a trained GELU MLP (width × depth) with trainable token embeddings, KL to the target's distribution on
the 16384 most frequent tokens, AdamW with warm-up and cosine decay. They train on ShareGPT rows (the
recipes' data) and are scored on the target's own greedy answers to MT-Bench prompts (the eval's
prompts, never trained on): top-1 agreement with the target's next greedy token, which is the first
draft's greedy acceptance when every input is the target's.

The implied chain ceiling at k drafts, τ ≤ 1 + a0·(1 + c1 + … + c1^(k-1)), takes a0 from the best `mlp`
and every later stage as good as c1, the best `mlp+1`'s agreement at the positions where that stage 0 was
right (later stages see less than the true state, so this is generous).

    python benchmarks/proposer_ceiling.py                          # 1262 usable of 1600 rows, 300 steps: 23 min on 2 cores
    python benchmarks/proposer_ceiling.py --rows 6000 --widths 0 1152 --steps 900   # the long recipe's rows: 26 min
"""

import argparse
import math
import time

import torch
import torch.nn.functional as F
from torch import nn
from teacher_forced_tau import greedy_outputs
from tqdm import tqdm

from speculators.data import build_dataset
from speculators.stage_data import cache_target_hidden
from speculators.target import Target

STUDIES = {"medusa": 0, "mlp": 1, "mlp+1": 2}  # name -> how many tokens after h_t it reads


def training_positions(rows: list[dict]):
    """From each ShareGPT row, at every position t whose next two tokens are assistant text: h_t,
    [x_{t+1}, x_{t+2}], and [h_{t+1}, h_{t+2}] (whose readouts are the target's distributions over
    x_{t+2} and x_{t+3}, the tokens the studies predict)."""
    H, X, Y = [], [], []
    for r in rows:
        h, ids = r["hidden"].float(), torch.tensor(r["input_ids"])
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        n = len(ids) - 2  # positions t that have x_{t+1}, x_{t+2}, and h_{t+2}
        keep = mask[1 : 1 + n] & mask[2 : 2 + n]
        H.append(h[:n][keep])
        X.append(torch.stack([ids[1 + j : 1 + j + n] for j in range(2)], 1)[keep])
        Y.append(torch.stack([h[1 + j : 1 + j + n] for j in range(2)], 1)[keep])
    return torch.cat(H), torch.cat(X), torch.cat(Y)


@torch.no_grad()
def eval_positions(target: Target, n_prompts: int, max_new_tokens: int):
    """The target's greedy answers to MT-Bench prompts: h_t, x_{t+1}, x_{t+2} and the label x_{t+3}
    for every answer position t (x_{t+2} is the label of the one-token studies)."""
    H, X = [], []
    for prompt_len, seq in greedy_outputs(target, "mt-bench", n_prompts, max_new_tokens):
        hidden = target(seq[None], logits=False).hidden[0].float()
        t = torch.arange(prompt_len - 1, len(seq) - 3)
        H.append(hidden[t])
        X.append(torch.stack([seq[t + 1 + j] for j in range(3)], 1))
    return torch.cat(H), torch.cat(X)


class Predictor(nn.Module):
    """p = A·[h, e(x_1..n), 1] (started from least squares) + a zero-started GELU MLP of the same inputs."""

    def __init__(self, A: torch.Tensor, embed: torch.Tensor, n_tokens: int, width: int, depth: int):
        super().__init__()
        D = embed.shape[1]
        self.A = nn.Parameter(A.clone())
        self.ls_embed = embed  # the least-squares map reads the target's fixed embeddings
        self.embs = nn.ModuleList(nn.Embedding.from_pretrained(embed.clone(), freeze=False) for _ in range(n_tokens))
        dims = [D * (1 + n_tokens)] + [width] * depth if width else []
        self.mlp = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.out = nn.Linear(width, D) if width else None
        if self.out is not None:
            nn.init.zeros_(self.out.weight)
            nn.init.zeros_(self.out.bias)

    def forward(self, h, x):
        p = features(h, x, self.ls_embed) @ self.A
        if self.out is None:
            return p
        z = torch.cat([h, *(emb(x[:, j]) for j, emb in enumerate(self.embs))], 1)
        for layer in self.mlp:
            z = F.gelu(layer(z))
        return p + self.out(z)


def features(h, x, embed):
    return torch.cat([h, *(embed[x[:, j]] for j in range(x.shape[1])), torch.ones_like(h[:, :1])], 1)


def least_squares(h, x, y, embed) -> torch.Tensor:
    xtx = torch.zeros(h.shape[1] * (1 + x.shape[1]) + 1, h.shape[1] * (1 + x.shape[1]) + 1, dtype=torch.float64)
    xty = torch.zeros(xtx.shape[0], h.shape[1], dtype=torch.float64)
    for i in range(0, len(h), 16384):
        f = features(h[i : i + 16384], x[i : i + 16384], embed).double()
        xtx += f.T @ f
        xty += f.T @ y[i : i + 16384].double()
    ridge = 1e-4 * xtx.diagonal().mean()
    return torch.linalg.solve(xtx + ridge * torch.eye(len(xtx), dtype=xtx.dtype), xty).float()


def hits(model, h, x, label, head) -> torch.Tensor:
    with torch.no_grad():
        return (model(h, x) @ head.T).argmax(-1) == label


def train(model, h, x, y, head, steps: int, batch: int, lr: float, seed: int, desc: str):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for step in tqdm(range(steps), desc=desc, unit="step", leave=False):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / steps))
        idx = torch.randint(0, len(h), (batch,), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                teacher = (y[idx] @ head.T).float().log_softmax(-1)
            student = (model(h[idx], x[idx]) @ head.T).float().log_softmax(-1)
        loss = (teacher.exp() * (teacher - student)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=1600, help="ShareGPT rows to train the predictors on")
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--widths", type=int, nargs="+", default=[0, 1152, 4096],
                   help="MLP widths (0: the least-squares linear map alone)")
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=2048, help="positions per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--k", type=int, nargs="+", default=[3, 4])
    args = p.parse_args()
    torch.manual_seed(0)

    target = Target.load(args.target, torch.bfloat16)
    ds = build_dataset("sharegpt", target.tokenizer, 256, max_samples=args.rows, seed=0)
    rows = cache_target_hidden(target, ds, 8, torch.device("cpu"), True)
    H, X, Y = training_positions(rows)
    del rows
    eH, eX = eval_positions(target, args.num_prompts, args.max_new_tokens)
    W = target.lm_head.weight.float()
    embed = target.model.get_input_embeddings().weight.float()
    counts = torch.bincount(X[:, 0], minlength=W.shape[0])
    vocab = counts.sort(descending=True, stable=True).indices[:16384]
    head = W[vocab]  # the KL runs on the frequent tokens; top-1 is scored over the whole vocabulary
    print(f"{len(H)} training positions from {len(ds)} ShareGPT rows; {len(eH)} MT-Bench answer positions")

    results = {}
    for name, n_tok in STUDIES.items():
        x, y = X[:, :n_tok], Y[:, max(n_tok - 1, 0)]
        ex, label = eX[:, :n_tok], eX[:, max(n_tok, 1)]
        A = least_squares(H, x, y, embed)
        for width in args.widths:
            t0 = time.time()
            model = Predictor(A, embed, n_tok, width, args.depth)
            if width:
                train(model, H, x, y, head, args.steps, args.batch, args.lr, seed=0, desc=f"{name} width {width}")
            results[name, width] = hit = hits(model, eH, ex, label, W)
            acc = hit.float().mean().item()
            print(f"{name:7s} width {width:5d}{' x ' + str(args.depth) if width else '':4s}  top-1 {acc:.3f}  "
                  f"({time.time() - t0:.0f} s)", flush=True)

    print("\n| inputs | " + " | ".join(f"width {w}" for w in args.widths) + " |")
    print("|---|" + "---|" * len(args.widths))
    for name in STUDIES:
        print(f"| {name} | " + " | ".join(f"{results[name, w].float().mean():.3f}" for w in args.widths) + " |")
    # c1 is conditional: stage 1's agreement where the best stage 0 was right (those positions are easier).
    best0 = max((results["mlp", w] for w in args.widths), key=lambda hit: hit.float().mean())
    a0 = best0.float().mean().item()
    c1 = max(results["mlp+1", w][best0].float().mean().item() for w in args.widths)
    for k in args.k:
        print(f"chain ceiling at k = {k}: tau <= 1 + {a0:.3f} * sum(c1^j, j < {k}) = "
              f"{1 + a0 * sum(c1**j for j in range(k)):.2f}   (c1 = {c1:.3f})")


if __name__ == "__main__":
    from speculators.runtime import configure_process

    configure_process()  # what the `speculators` CLI sets: MKL_CBWR before the first GEMM, an offline Hub
    main()
