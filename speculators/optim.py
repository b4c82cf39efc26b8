"""AdamW with 8-bit optimizer state (`optimizer: adamw8bit` in a recipe).

fp32 AdamW keeps 8 bytes of state per parameter: 4 GB for a 0.5B draft, more than its fp32 weights
and gradients together. Here both moments live in blocks of 256 values, one byte each plus one fp32
scale per block: about 2.03 bytes per parameter, 3.9x less. Each step dequantizes one parameter's
moments into fp32 temporaries, does the exact AdamW update and quantizes them back, so the extra peak
is one parameter's worth of fp32, not the model's.

Uniform int8 codes would flush the many small entries of a block to zero next to its largest one, so
both moments are companded with a square root before rounding (four decades of range for m, eight
for v, at a relative step of 1/127 and 1/255 near the top):
- m: code = round(127 * sign(m) * sqrt(|m| / absmax)), int8.
- v: kept as w = sqrt(v); code = ceil(255 * sqrt(w / max)), uint8. Rounding up means a dequantized
  v is never smaller than the true one, so m / sqrt(v) cannot blow up where a tiny v would round to 0.
"""

from __future__ import annotations

import torch

BLOCK = 256
# A step walks each parameter in chunks of this many blocks (4 MB of fp32 per temporary): the dozen
# elementwise passes of dequantize-update-quantize then run in cache instead of over DRAM, and the
# extra memory is one chunk's, not one parameter's.
CHUNK_BLOCKS = 4096


def _blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)


def quantize_signed(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [blocks, BLOCK], fp32 scales [blocks]) of x, flattened and zero-padded."""
    b = _blocks(x.float())
    scale = b.abs().amax(1, keepdim=True).clamp(min=1e-30)
    code = torch.round(127 * b.sign() * (b.abs() / scale).sqrt()).to(torch.int8)
    return code, scale.squeeze(1)


def dequantize_signed(code: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """The first n values (flat fp32) of quantize_signed's blocks."""
    c = code.float() / 127
    return (c.sign() * c * c * scale[:, None]).view(-1)[:n]


def quantize_unsigned_sqrt(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, fp32 scales) of v >= 0, stored as sqrt(v), each code rounded up."""
    w = _blocks(v.float().sqrt())
    scale = w.amax(1, keepdim=True).clamp(min=1e-30)
    code = torch.ceil(255 * (w / scale).sqrt()).clamp(max=255).to(torch.uint8)
    return code, scale.squeeze(1)


def dequantize_unsigned_sqrt(code: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    c = code.float() / 255
    w = c * c * scale[:, None]
    return (w * w).view(-1)[:n]


class AdamW8bit(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, bias correction) on 8-bit moments. Its
    state is plain tensors, so training checkpoints save it to safetensors and resume exactly."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamW8bit does not take sparse gradients")
                st = self.state[p]
                if not st:
                    n_blocks = -(-p.numel() // BLOCK)
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["m_code"] = torch.zeros(n_blocks, BLOCK, dtype=torch.int8, device=p.device)
                    st["m_scale"] = torch.full((n_blocks,), 1e-30, device=p.device)
                    st["v_code"] = torch.zeros(n_blocks, BLOCK, dtype=torch.uint8, device=p.device)
                    st["v_scale"] = torch.full((n_blocks,), 1e-30, device=p.device)
                st["step"] += 1
                flat = p.data.reshape(-1)  # a view unless p is not contiguous (then written back below)
                grad = p.grad.reshape(-1)
                for b0 in range(0, st["m_code"].shape[0], CHUNK_BLOCKS):
                    b1 = b0 + CHUNK_BLOCKS
                    e0, e1 = b0 * BLOCK, min(b1 * BLOCK, flat.numel())
                    self._update(flat[e0:e1], grad[e0:e1], st, slice(b0, b1), group, float(st["step"]))
                if flat.data_ptr() != p.data.data_ptr():
                    p.data.copy_(flat.view_as(p))
        return loss

    @staticmethod
    def _update(param, grad, st, blocks: slice, group, t: float):
        beta1, beta2 = group["betas"]
        n = param.numel()
        g = grad.float()
        m = dequantize_signed(st["m_code"][blocks], st["m_scale"][blocks], n).lerp_(g, 1 - beta1)
        v = dequantize_unsigned_sqrt(st["v_code"][blocks], st["v_scale"][blocks], n).mul_(beta2).addcmul_(g, g, value=1 - beta2)
        param.mul_(1 - group["lr"] * group["weight_decay"])
        denom = (v / (1 - beta2**t)).sqrt_().add_(group["eps"])
        param.addcdiv_(m.to(param.dtype), denom.to(param.dtype), value=-group["lr"] / (1 - beta1**t))
        st["m_code"][blocks], st["m_scale"][blocks] = quantize_signed(m)
        st["v_code"][blocks], st["v_scale"][blocks] = quantize_unsigned_sqrt(v)

    def load_state_dict(self, state_dict):
        # Optimizer.load_state_dict casts every state tensor of a float parameter to its dtype; the codes stay bytes.
        super().load_state_dict(state_dict)
        for st in self.state.values():
            if st:
                st["m_code"], st["v_code"] = st["m_code"].to(torch.int8), st["v_code"].to(torch.uint8)


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in an optimizer's state tensors."""
    return sum(t.numel() * t.element_size() for st in optimizer.state.values() for t in st.values() if torch.is_tensor(t))
