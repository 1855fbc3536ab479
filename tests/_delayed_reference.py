"""The delayed update's rule in plain torch (tests/test_delayed_update.py, test_delayed_gpu_shares.py):
DelayedReference and the loop both runs share."""

from __future__ import annotations

import torch

from ramstream.ops import _raw

LR, WD = 3e-3, 0.05


class DelayedReference:
    """The rule in plain torch: `model` is what the forward reads; fp32 masters (torch's
    AdamW(fused=True) on the host, or the host kernel with the engine's rounding stream for bf16
    moments) are updated at every step; the first `warmup` steps copy them into the model at
    once, later steps leave them pending until the next step() installs them first."""

    def __init__(
        self, model, warmup, *, max_grad_norm=None, bf16_offsets=None, groups=None, engine=None, **hyper
    ):
        self.model, self.warmup, self.max_grad_norm = model, warmup, max_grad_norm
        self.params = list(model.parameters())
        # the engine's GPU-updated ("mapped", "device") parameters are not delayed: index -> state
        # offset, followed at every step (the VRAM share after step 2, a relocate between steps)
        self.engine, self.undelayed = engine, {}
        assert engine is None or not (max_grad_norm or groups), "not modelled here"
        self.masters = [p.detach().cpu().float().clone().requires_grad_(p.requires_grad) for p in self.params]
        hyper = hyper or dict(lr=LR, weight_decay=WD)
        self.opt = torch.optim.AdamW(groups(self.masters) if groups else self.masters, fused=True, **hyper)
        self.hyper = hyper
        self.bf16_offsets = bf16_offsets  # per parameter: its element offset in the engine's state
        if bf16_offsets is not None:
            self.moments = [
                (torch.zeros(m.numel(), dtype=torch.bfloat16), torch.zeros(m.numel(), dtype=torch.bfloat16))
                for m in self.masters
            ]
        self.taken, self.pending = 0, False
        self.gpu_state = {}  # undelayed index -> (fp32 master or None, exp_avg, exp_avg_sq) on the device
        self._follow_placements()

    def _follow_placements(self):
        """Parameters whose bucket the GPU updates now: from here on the CUDA kernel, at once;
        those it no longer updates: the host AdamW again, delayed; each with the AdamW state it
        has (the engine's relocate copies it)."""
        if self.engine is None:
            return
        now = _gpu_offsets(self.engine)
        for i in sorted(set(self.undelayed) - set(now)):  # back to the host AdamW, state carried
            p, m = self.params[i], self.masters[i]
            master, ea, eas = self.gpu_state.pop(i)
            del self.undelayed[i]
            with torch.no_grad():
                m.copy_((p if master is None else master).detach().cpu().float())
            if self.bf16_offsets is not None:
                self.moments[i] = (ea.cpu().reshape(-1), eas.cpu().reshape(-1))
            else:
                step = torch.tensor(float(self.taken), dtype=torch.float32)
                self.opt.state[m] = {
                    "step": step,
                    "exp_avg": ea.cpu().view_as(m),
                    "exp_avg_sq": eas.cpu().view_as(m),
                }
        for i in sorted(set(now) - set(self.undelayed)):
            p, m = self.params[i], self.masters[i]
            if self.bf16_offsets is not None:
                ea, eas = self.moments[i]
            else:
                st = self.opt.state.get(m) or {}
                ea, eas = st.get("exp_avg", torch.zeros_like(m)), st.get("exp_avg_sq", torch.zeros_like(m))
            master = None if p.dtype == torch.float32 else m.detach().to(p.device).clone()
            self.undelayed[i] = now[i]
            self.gpu_state[i] = (master, ea.detach().to(p.device).clone(), eas.detach().to(p.device).clone())

    def install(self):
        with torch.no_grad():
            for i, (p, m) in enumerate(zip(self.params, self.masters)):
                if i not in self.undelayed:
                    p.copy_(m)

    def _gpu_step(self, i, g):
        """ramstream's CUDA AdamW (the mapped update's kernel) on parameter i, at once."""
        p, (master, ea, eas) = self.params[i], self.gpu_state[i]
        g = g.contiguous()
        _raw.cuda_adamw_ptr(
            param=(p if master is None else master).data_ptr(), grad=g.data_ptr(), grad_dtype=g.dtype,
            exp_avg=ea.data_ptr(), exp_avg_sq=eas.data_ptr(), moment_dtype=ea.dtype,
            out=0 if master is None else p.data_ptr(), out_dtype=p.dtype, n=p.numel(),
            offset=self.undelayed[i], lr=self.hyper["lr"], beta1=0.9, beta2=0.999, eps=1e-8,
            weight_decay=self.hyper["weight_decay"], step=self.taken, grad_scale=1.0, seed=0,
            stream=torch.cuda.current_stream(p.device).cuda_stream, device=p.device.index,
        )  # fmt: skip

    def step(self):
        """One step; afterwards the placements the engine's step() left (the VRAM share moves
        buckets at the end of step 2) rule the next one."""
        try:
            return self._step()
        finally:
            self._follow_placements()

    def _step(self):
        if self.pending:
            self.install()
        dev_grads = {
            i: self.params[i].grad.detach().clone() for i in self.undelayed if self.params[i].grad is not None
        }
        grads = [None if p.grad is None else p.grad.detach().cpu().float().clone() for p in self.params]
        for p in self.params:
            p.grad = None
        norm = None
        if self.max_grad_norm is not None:
            norm = torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads if g is not None]))
        if norm is not None and not torch.isfinite(norm):  # skipped: nothing applied
            self.pending = False
            return False
        self.taken += 1
        for i, g in dev_grads.items():
            self._gpu_step(i, g)
        for i, (m, g) in enumerate(zip(self.masters, grads)):
            m.grad = None if i in self.undelayed else g
        if self.max_grad_norm is not None:  # torch's coefficient on the norm summed in double
            coef = torch.clamp(
                torch.tensor(self.max_grad_norm, dtype=torch.float32) / (norm.float() + 1e-6), max=1.0
            )
            for m in self.masters:
                if m.grad is not None and coef < 1:
                    m.grad.mul_(coef)
        if self.bf16_offsets is None:
            self.opt.step()
        else:
            self._bf16_step()
        self.opt.zero_grad()
        self.pending = self.taken > self.warmup
        if not self.pending:
            self.install()
        return True

    def _bf16_step(self):
        """The host kernel (ramstream's AdamW, fp32 masters, bf16 moments rounded stochastically
        keyed by (seed 0, step, element index in the whole state)), parameter by parameter."""
        for m, (ea, eas), off in zip(self.masters, self.moments, self.bf16_offsets):
            if m.grad is None:  # no gradient, or updated on the GPU (_gpu_step)
                continue
            g = m.grad.reshape(-1).contiguous()
            flat = m.data.reshape(-1)
            _raw.adamw_ptr(
                param=flat.data_ptr(),
                grad=g.data_ptr(),
                grad_dtype=torch.float32,
                exp_avg=ea.data_ptr(),
                exp_avg_sq=eas.data_ptr(),
                moment_dtype=torch.bfloat16,
                n=m.numel(),
                step=self.taken,
                lr=self.hyper["lr"],
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=self.hyper["weight_decay"],
                offset=off,
            )


def _gpu_offsets(engine) -> dict:
    """{parameter index (the optimizer's order): its element offset in the whole state} of the
    engine's GPU-updated slots ("mapped", "device")."""
    index = {id(p): i for i, p in enumerate(p for g in engine.param_groups for p in g["params"])}
    return {
        index[id(s.param)]: s.bucket.state_offset + s.offset
        for s in engine.slots
        if s.bucket.placement in ("mapped", "device")
    }


def _train(model, opt, ref, data, accumulation=1):
    """The same loop on both; returns (losses, reference losses)."""
    losses, ref_losses = [], []
    for i in range(0, len(data), accumulation):
        for x, y in data[i : i + accumulation]:
            loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            rl = ref.model(x, y)
            rl.backward()
            ref_losses.append(rl.item())
        opt.step()
        opt.zero_grad()
        ref.step()
    return losses, ref_losses


def _assert_equal(model, opt, ref, losses, ref_losses):
    assert losses == ref_losses  # every forward read the same (stale) weights
    opt.synchronize()  # installs the last pending update
    ref.install()
    for i, (a, b) in enumerate(zip(model.parameters(), ref.params)):
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), f"parameter {i} differs"
