"""AdamW8bit: the same update as torch's AdamW on 8-bit moments — it tracks AdamW, holds about a
quarter of the state, and its quantizers keep the ranges and the rounding direction they promise."""

import torch

from speculators.optim import (AdamW8bit, dequantize_signed, dequantize_unsigned_sqrt, quantize_signed,
                               quantize_unsigned_sqrt, state_bytes)


def fit(optimizer_cls, steps=400):
    torch.manual_seed(0)
    X = torch.randn(1024, 48)
    Y = torch.tanh(X @ torch.randn(48, 16)) + 0.1 * torch.randn(1024, 16)
    model = torch.nn.Sequential(torch.nn.Linear(48, 300), torch.nn.GELU(), torch.nn.Linear(300, 16))
    opt = optimizer_cls(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, len(X), (64,), generator=g)
        loss = (model(X[idx]) - Y[idx]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float((model(X) - Y).pow(2).mean())
    return final, state_bytes(opt)


def test_tracks_adamw_with_a_quarter_of_the_state():
    ref_loss, ref_bytes = fit(torch.optim.AdamW)
    loss, n_bytes = fit(AdamW8bit)
    assert ref_loss < 0.5 and abs(loss - ref_loss) < 0.05 * ref_loss, (loss, ref_loss)
    assert n_bytes < 0.27 * ref_bytes, (n_bytes, ref_bytes)


def test_quantizers_cover_their_range_and_round_v_up():
    torch.manual_seed(0)
    x = torch.randn(1000) * torch.logspace(-4, 0, 1000)  # four decades inside every block
    m = dequantize_signed(*quantize_signed(x), x.numel())
    big = x.abs() > 1e-2 * x.abs().max()
    assert ((m - x).abs()[big] / x.abs()[big]).max() < 0.1
    assert torch.equal(m.sign()[x.abs() > 1e-3], x.sign()[x.abs() > 1e-3])
    v = x.pow(2)
    vq = dequantize_unsigned_sqrt(*quantize_unsigned_sqrt(v), v.numel())
    assert (vq >= v * (1 - 1e-6)).all()  # never under: m / sqrt(v) cannot blow up
    top = v > 1e-3 * v.max()  # within three decades of the block's largest: at most 10% over
    assert (vq[top] <= 1.1 * v[top]).all()


def test_chunked_step_is_the_same_update(monkeypatch):
    """Chunks are whole blocks, so walking a parameter in chunks changes nothing; a non-contiguous
    parameter is updated in place too."""
    import speculators.optim as optim

    def run(chunk_blocks):
        monkeypatch.setattr(optim, "CHUNK_BLOCKS", chunk_blocks)
        torch.manual_seed(0)
        flat = torch.nn.Parameter(torch.randn(3 * 256 + 17))
        wide = torch.nn.Parameter(torch.randn(40, 30).t())  # not contiguous
        start = wide.detach().clone()
        opt = AdamW8bit([flat, wide], lr=1e-2, weight_decay=0.1)
        for _ in range(3):
            (flat.pow(3).sum() + (wide @ torch.arange(1.0, 41.0)).sum()).backward()
            opt.step()
            opt.zero_grad()
        assert (wide.detach() - start).abs().min() > 1e-3  # every entry moved
        return flat.detach().clone(), wide.detach().clone()

    (a, b), (c, d) = run(1), run(4096)
    assert torch.equal(a, c) and torch.equal(b, d)
