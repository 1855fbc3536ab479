"""Hugging Face models under wrap() on the CPU engine, as users train them: tiny configs with
random weights (no downloads), HF's own loss, peft LoRA, activation paging with padding and HF
gradient checkpointing, causal_lm_loss against HF's loss. Each result is checked against plain
torch (AdamW(foreach=False), HF's loss and gradients)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ramstream
from ramstream.activations import find_blocks

transformers = pytest.importorskip("transformers")
# transformers and peft announce renames (gradient -> activation checkpointing) with FutureWarning
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

TOL = 1e-5
VOCAB = 128


def _llama(seed: int = 0, attn: str = "sdpa"):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(seed: int = 0):
    """Tied head, fused qkv (Conv1D), dropout 0.1 everywhere (RNG must replay identically)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    return transformers.GPT2LMHeadModel(cfg)


def _lora(seed: int = 0):
    """peft LoRA on q_proj/v_proj of the tiny Llama; lora_B random (not zero) so that every
    adapter gets a gradient from the first step."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        _llama(seed),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _batches(n: int, b: int = 2, t: int = 16, seed: int = 1):
    """(input_ids, attention_mask, labels): row 0 left-padded by a varying amount (mask 0,
    label -100), the rest full."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (b, t), generator=g)
        mask = torch.ones_like(ids)
        mask[0, : 3 + i % 4] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, mask, labels))
    return out


def _train(model, opt, data, *, accumulation: int = 1, max_grad_norm=None):
    """HF-style loop: loss from labels=; with accumulation, num_items_in_batch counts the
    window's predicted tokens (labels[..., 1:] != -100) as transformers' Trainer does. Clips
    with clip_grad_norm_ for a torch optimizer (wrap() clips itself). Returns the losses."""
    losses = []
    for i in range(0, len(data), accumulation):
        window = data[i : i + accumulation]
        kw = {}
        if accumulation > 1:
            kw["num_items_in_batch"] = sum((lab[..., 1:] != -100).sum() for _, _, lab in window)
        for ids, mask, labels in window:
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
            loss.backward()
            losses.append(loss.item())
        if max_grad_norm is not None and not isinstance(opt, ramstream.OffloadAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
    if isinstance(opt, ramstream.OffloadAdamW):
        opt.synchronize()
    return losses


def _max_diff(a, b) -> float:
    return max(
        (pa.detach() - pb.detach()).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())
    )


def _checkpointing(model, reentrant: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed activation_checkpointing_*
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})


# ---- 1. full fine-tuning -------------------------------------------------------------------------
# max_grad_norm 0.5 clips (the norm is 2-4) without pushing the gradients down to AdamW's eps,
# where torch's own AdamW(foreach=False) and AdamW(fused=True) drift apart by more than TOL
@pytest.mark.parametrize("max_grad_norm, accumulation", [(None, 1), (0.5, 1), (0.5, 2)])
def test_llama_full_finetune_matches_torch_adamw(max_grad_norm, accumulation):
    ref = _llama()
    model = copy.deepcopy(ref)
    data = _batches(10 * accumulation)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    ref_losses = _train(ref, ropt, data, accumulation=accumulation, max_grad_norm=max_grad_norm)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05),
        device="cpu",
        max_grad_norm=max_grad_norm,
        accumulation_steps=accumulation,
    )
    losses = _train(model, opt, data, accumulation=accumulation, max_grad_norm=max_grad_norm)
    assert _max_diff(ref, model) < TOL
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert _max_diff(model, _llama()) > 1e-2  # it trained
    if max_grad_norm is not None:  # the clipping path ran and did clip
        assert opt._engine.last_grad_norm > max_grad_norm


# ---- 2. LoRA ---------------------------------------------------------------------------------
def test_lora_trains_adapters_only_like_torch():
    ref = _lora()
    model = copy.deepcopy(ref)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    data = _batches(8)
    # the optimizer gets every parameter, frozen ones included, as torch allows
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.05, foreach=False)
    _train(ref, ropt, data)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05), device="cpu"
    )
    _train(model, opt, data)
    assert _max_diff(ref, model) < TOL
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p.detach(), base[n]), n
    start = dict(_lora().named_parameters())
    for n, p in model.named_parameters():  # every adapter trained
        if n in trainable:
            assert not torch.equal(p.detach(), start[n].detach()), n
    lora_numel = sum(p.numel() for n, p in model.named_parameters() if n in trainable)

    # host state: the adapters only (fp32 master + two fp32 moments), not the frozen base
    r = ramstream.memory_report(model)
    assert r["params"]["count"] == len(trainable)
    assert r["params"]["numel"] == lora_numel
    held = sum(r["params"]["bucket_numel"])
    assert r["optimizer"]["host_state_bytes"] == 12 * held
    assert held - lora_numel < 128 * len(trainable)  # alignment padding only
    assert held < sum(p.numel() for p in model.parameters()) / 10

    # the state dict is torch's: same keys (positions among all parameters) and values
    sd, rsd = opt.state_dict(), ropt.state_dict()
    assert sorted(sd["state"]) == sorted(rsd["state"])
    assert len(sd["state"]) == len(trainable)
    assert sd["param_groups"][0]["params"] == rsd["param_groups"][0]["params"]
    for k, st in rsd["state"].items():
        assert float(sd["state"][k]["step"]) == float(st["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][k][key] - st[key]).abs().max() <= TOL * max(1.0, st[key].abs().max())
    plain = copy.deepcopy(ref)
    topt = torch.optim.AdamW(plain.parameters(), lr=1.0, foreach=False)
    topt.load_state_dict(sd)
    assert topt.param_groups[0]["lr"] == 3e-3
    ids, mask, labels = _batches(1, seed=5)[0]
    for m, o in ((ref, ropt), (plain, topt)):  # one more step from each state: same result
        m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        o.step()
    assert _max_diff(ref, plain) < TOL


def test_lora_blocks_are_found_through_peft_and_paging_is_exact():
    base = _lora()
    blocks = find_blocks(base)
    assert blocks == list(base.base_model.model.model.layers)
    runs = []
    for paging in (False, True):
        model = copy.deepcopy(base)
        model, opt = ramstream.wrap(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            device="cpu",
            activation_offload=paging,
            min_offload_bytes=0,
        )
        losses = _train(model, opt, _batches(4))
        runs.append((model, losses, ramstream.memory_report(model)))
    (a, la, _), (b, lb, rb) = runs
    assert la == lb
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert rb["activations"]["paged_blocks"] == [0, 1, 2]
    assert rb["plan"]["activations"]["stats"]["bytes_d2h"] > 0


# ---- 3. finding the blocks, activation paging ----------------------------------------------------
def test_find_blocks_finds_llama_layers_and_gpt2_h():
    llama, gpt2 = _llama(), _gpt2()
    assert find_blocks(llama) == list(llama.model.layers)
    assert find_blocks(gpt2) == list(gpt2.transformer.h)


def _paged_run(make, paging, checkpoint, seed=3):
    model = make()
    if checkpoint is not None:
        _checkpointing(model, reentrant=checkpoint)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        device="cpu",
        activation_offload=paging,
        min_offload_bytes=0,
    )
    torch.manual_seed(seed)  # GPT-2's dropout masks: the same stream in both runs
    losses = _train(model, opt, _batches(4))
    return model, losses, ramstream.memory_report(model)


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("checkpoint", [None, False], ids=["plain", "checkpoint"])
def test_paging_every_block_is_bit_identical(make, checkpoint):
    """Padding (attention_mask) in every batch; with HF gradient checkpointing
    (use_reentrant=False) what pages is the layer inputs that checkpoint keeps."""
    a, la, ra = _paged_run(make, False, checkpoint)
    b, lb, rb = _paged_run(make, True, checkpoint)
    assert la == lb
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    assert ra["activations"]["paged_blocks"] == []
    assert rb["activations"]["paged_blocks"] == [0, 1, 2]
    stats = rb["plan"]["activations"]["stats"]
    assert stats["bytes_d2h"] > 0 and stats["bytes_h2d"] == stats["bytes_d2h"]
    if checkpoint is not None:  # and checkpointing changes nothing either
        c, lc, _ = _paged_run(make, False, None)
        assert lc == pytest.approx(la, rel=1e-6)
        assert _max_diff(a, c) < TOL


def test_reentrant_checkpointing_raises_a_clear_error():
    model = _llama()
    before = [p.detach().clone() for p in model.parameters()]
    _checkpointing(model, reentrant=True)
    model, opt = ramstream.wrap(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), device="cpu", eager_updates=False
    )
    ids, mask, labels = _batches(1)[0]
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.zero_grad()  # the failed pass is discarded, nothing was updated
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    _checkpointing(model, reentrant=False)
    _train(model, opt, _batches(2))  # and training goes on
    assert opt.stats()["steps"] == 2


# ---- 4. causal_lm_loss against HF's loss ---------------------------------------------------------
def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("num_items", [None, 37, "tensor"])
def test_causal_lm_loss_equals_hf_loss_and_gradients(num_items):
    model = _llama(attn="eager")
    ids, mask, labels = _batches(1, b=3)[0]
    labels[2, 9:] = -100  # right padding too
    if num_items == "tensor":  # the Trainer's count over a 2-batch window
        other = _batches(1, b=3, seed=9)[0][2]
        num_items = (labels[..., 1:] != -100).sum() + (other[..., 1:] != -100).sum()
    kw = {} if num_items is None else {"num_items_in_batch": num_items}
    ref = model(input_ids=ids, attention_mask=mask, labels=labels, **kw).loss
    ref.backward()
    ref_grads = _grads(model)
    model.zero_grad()
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    loss = ramstream.causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=7, num_items=num_items)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for g, r in zip(_grads(model), ref_grads):
        assert (g - r).abs().max() < TOL


def test_wrapped_llama_trained_with_causal_lm_loss_matches_hf_loss_in_torch():
    """The README's pattern: hidden states from model.model, causal_lm_loss on the head."""
    ref = _llama()
    model = copy.deepcopy(ref)
    data = _batches(6)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=False)
    _train(ref, ropt, data)
    model, opt = ramstream.wrap(
        model,
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        device="cpu",
        activation_offload=True,
        min_offload_bytes=0,
    )
    for ids, mask, labels in data:
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        ramstream.causal_lm_loss(hidden, model.lm_head.weight, labels, chunk_size=8).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    # the chunked loss's gradients equal the dense loss's to fp32 rounding (test_loss.py: about
    # 1e-6 relative, as torch's own fp32 dense loss against float64); six Adam steps at lr 3e-3
    # amplify that rounding to ~1e-5 in the weights (0.7e-5 and 1.0e-5 measured for two equally
    # exact orders of the same arithmetic), hence twice TOL here
    assert _max_diff(ref, model) < 2 * TOL
