"""Small models and a torch reference trainer shared by the engine tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TinyGPT(nn.Module):
    """Embedding, a stack of blocks, final norm, head tied to the embedding."""

    def __init__(self, vocab: int = 64, d: int = 32, n_blocks: int = 3, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class Boom(torch.autograd.Function):
    """Identity whose backward raises while `Boom.armed` is set (a failure injected part-way
    through backward)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise RuntimeError("injected failure in backward")
        return g


def make_model(seed: int = 0, dtype=torch.float32, **kw) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kw).to(dtype)


def batches(n: int, vocab: int = 64, b: int = 4, t: int = 8, seed: int = 1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, vocab, (b, t), generator=g).to(device),
            torch.randint(0, vocab, (b, t), generator=g).to(device),
        )
        for _ in range(n)
    ]


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa.detach().float() - pb.detach().float()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters())
    )


def train_torch(model, opt, data, *, accumulation: int = 1, max_grad_norm=None, scheduler=None, steps=None):
    """A plain torch training loop over `data` (list of batches), grouped into `accumulation`
    micro-batches per step. Returns the losses."""
    losses = []
    n = len(data) // accumulation if steps is None else steps
    for i in range(n):
        for j in range(accumulation):
            x, y = data[i * accumulation + j]
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    return losses


def train_master_reference(model, data, lr=1e-3, weight_decay=1e-2, betas=(0.9, 0.999)):
    """torch's fused CPU AdamW on fp32 host masters of a low-precision model (the working copy
    is the master cast to the model's dtype after every step). Returns the fp32 masters."""
    masters = [p.detach().float().cpu().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, betas=betas, fused=True)
    for x, y in data:
        model(x, y).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float().cpu()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return masters


def gpu_profile(free_mib: int):
    """An injected GPU profile with `free_mib` MiB free and the H200 machine's rates (plans made on
    it are applied by the CPU engine in tests)."""
    from ramstream.planner.profile import HardwareProfile

    gib = 2**30
    return HardwareProfile(
        device="cuda", vram_total=4 * gib, vram_free=free_mib << 20, ram_total=64 * gib,
        ram_available=64 * gib, pin_budget=32 * gib, h2d_gbps=54.9, d2h_gbps=55.0, duplex_gbps=49.5,
        adamw_gbps=127.7, matmul_tflops=790.0, source="given",
    )  # fmt: skip


def open_files_in(folder: str) -> list[str]:
    """Files this process holds open under `folder` (an unlinked scratch file included)."""
    import os

    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            p = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if p.startswith(folder + os.sep):
            out.append(p)
    return out


def scratch_folder(tmp_path, monkeypatch, prefix: str):
    """A fixture body (`yield from scratch_folder(...)`): a folder for a disk tier's scratch file,
    on tmpfs when there is one, RAMSTREAM_NVME_DIR unset; after the test nothing may be left open
    or named in it."""
    import gc
    import os
    import tempfile

    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    monkeypatch.delenv("RAMSTREAM_NVME_DIR", raising=False)
    d = tempfile.mkdtemp(dir=shm, prefix=prefix) if shm else str(tmp_path)
    yield d
    gc.collect()
    assert open_files_in(d) == [] and os.listdir(d) == []
    if shm:
        os.rmdir(d)


class no_runtime_warning:
    """A context in which a RuntimeWarning is an error (a test that something stays quiet)."""

    def __enter__(self):
        import warnings

        self.cm = warnings.catch_warnings()
        self.cm.__enter__()
        warnings.simplefilter("error", RuntimeWarning)

    def __exit__(self, *exc):
        self.cm.__exit__(*exc)
