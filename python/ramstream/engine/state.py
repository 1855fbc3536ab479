"""Optimizer state in torch's AdamW format: export from the flat host buffers, import into them.

Exported: {"state": {i: {"step": float32 scalar, "exp_avg": fp32, "exp_avg_sq": fp32}},
"param_groups": [{...hyper-parameters..., "params": [i, ...]}]}, keyed by the position of each
parameter in param_groups order, exactly as torch.optim.AdamW.state_dict() does, so either
loads into the other.
"""
from __future__ import annotations

import torch


def _moment_view(flat: torch.Tensor, s) -> torch.Tensor:
    v = flat[s.offset:s.offset + s.numel].view(s.param.shape)
    return v if v.dtype == torch.float32 else v.float()


def export_state(engine, param_groups: list[dict]) -> dict:
    engine.synchronize()
    state = {}
    for s in engine.slots:
        if s.step == 0:
            continue
        b = s.bucket
        state[s.index] = {
            "step": torch.tensor(float(s.step), dtype=torch.float32),
            "exp_avg": _moment_view(b.exp_avg, s),
            "exp_avg_sq": _moment_view(b.exp_avg_sq, s),
        }
    groups = []
    index = 0
    for g in param_groups:
        entry = {k: v for k, v in g.items() if k != "params"}
        entry["params"] = list(range(index, index + len(g["params"])))
        index += len(g["params"])
        groups.append(entry)
    return {"state": state, "param_groups": groups}


def import_state(engine, param_groups: list[dict], sd: dict) -> None:
    """Loads a torch-format AdamW state dict (ours or torch's); ValueError when it does not match."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"load_state_dict: the state dict has {len(saved_groups)} param groups, "
                         f"the optimizer {len(param_groups)}")
    for i, (sg, g) in enumerate(zip(saved_groups, param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(f"load_state_dict: param group {i} has {len(sg['params'])} parameters "
                             f"in the state dict, {len(g['params'])} in the optimizer")
    # saved ids -> our positional indices (torch keys state by the ids listed in param_groups)
    id_map = {}
    for sg in saved_groups:
        for pid in sg["params"]:
            id_map[pid] = len(id_map)
    by_index = {s.index: s for s in engine.slots}
    staged = []
    for pid, st in sd["state"].items():
        if pid not in id_map:
            raise ValueError(f"load_state_dict: state for unknown parameter id {pid!r}")
        s = by_index.get(id_map[pid])
        if s is None:
            continue  # an empty parameter: nothing to load
        for key in ("exp_avg", "exp_avg_sq", "step"):
            if key not in st:
                raise ValueError(f"load_state_dict: parameter {pid} has no '{key}' (only AdamW "
                                 "state can be loaded)")
        for key in ("exp_avg", "exp_avg_sq"):
            if st[key].numel() != s.numel:
                raise ValueError(f"load_state_dict: '{key}' of parameter {pid} has "
                                 f"{st[key].numel()} elements, the parameter {s.numel}")
        staged.append((s, st))
    engine.synchronize()
    for s, st in staged:
        b = s.bucket
        for key, flat in (("exp_avg", b.exp_avg), ("exp_avg_sq", b.exp_avg_sq)):
            src = st[key].detach().reshape(-1)
            dst = flat[s.offset:s.offset + s.numel]
            if src.data_ptr() != dst.data_ptr():
                dst.copy_(src)
        step = st["step"]
        s.step = int(step.item() if torch.is_tensor(step) else step)
    loaded = {s.index for s, _ in staged}
    for s in engine.slots:
        if s.index not in loaded:
            s.step = 0
            b = s.bucket
            b.exp_avg[s.offset:s.offset + s.numel].zero_()
            b.exp_avg_sq[s.offset:s.offset + s.numel].zero_()
    for sg, g in zip(saved_groups, param_groups):
        for k, v in sg.items():
            if k != "params":
                g[k] = v
