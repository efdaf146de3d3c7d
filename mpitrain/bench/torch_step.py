"""PyTorch's equivalents of ``mpitrain bench step``'s two models, timed in the same rounds
when PyTorch is importable: a tool to compare with, never a dependency of mpitrain. Eager
mode, float32, on ``threads`` threads, random data of the bench's shapes.

* GPT: nanoGPT's model (pre-LN blocks without biases, one QKV projection, causal
  attention by ``scaled_dot_product_attention`` as nanoGPT calls it, the head tied to
  the token embedding) with the tanh GELU that mpitrain uses; AdamW over the same decay
  groups (matrices decayed, vectors not), gradient clipping at 1.0.
* CNN: the same layers, SGD with momentum 0.9, in PyTorch's default layout (channels
  first, NCHW) and in channels-last (NHWC, the layout mpitrain computes in).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    return importlib.util.find_spec("torch") is not None


def steps(threads: int) -> dict:
    """{name: (step, title)}: PyTorch's GPT step, its CNN step channels-first and channels-last."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    return {"gpt_torch": (_gpt(torch), "GPT PyTorch eager"),
            "cnn_torch": (_cnn(torch, channels_last=False), "CNN PyTorch channels-first"),
            "cnn_torch_cl": (_cnn(torch, channels_last=True), "CNN PyTorch channels-last")}


def _gpt(torch):
    nn, F = torch.nn, torch.nn.functional

    V, T, L, H, C, B = 65, 64, 4, 4, 128, 12

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(C, bias=False), nn.LayerNorm(C, bias=False)
            self.qkv, self.proj = nn.Linear(C, 3 * C, bias=False), nn.Linear(C, C, bias=False)
            self.fc, self.fc_proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

        def forward(self, x):  # (B, T, C)
            q, k, v = self.qkv(self.ln_1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
            x = x + self.proj(y)
            return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln_f = nn.LayerNorm(C, bias=False)
            self.head = nn.Linear(C, V, bias=False)
            self.head.weight = self.wte.weight  # tied, as nanoGPT

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(T))
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(self.ln_f(x)).view(-1, V), targets.view(-1))

    model = GPT()
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.99))
    x, y = torch.randint(0, V, (2, B, T))

    def step():
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _cnn(torch, channels_last: bool):
    nn, F = torch.nn, torch.nn.functional

    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                          nn.MaxPool2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(64, 3, 32, 32)  # (B, C, H, W)
    y = torch.randint(0, 10, (64,))
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)

    def step():
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step
