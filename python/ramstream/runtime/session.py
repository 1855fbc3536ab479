"""The session: the plan history's only writer (TrainingSession), and the plan applied to a wrapped
model, revised while it trains (PlanSession).

Every OffloadAdamW holds a TrainingSession (opt._session; opt.plan_history is its history), whether
or not wrap() applied a plan. The decisions taken between steps are the planner's
(planner/revise.py revise_training): the runtime's deciders (optimizer_split.py maybe_switch and
maybe_share, refiner.py, watchdog.py, keep.py) measure, ask, apply the answer through the
mechanisms and return the history entries; the session records them (take(): the optimizer hands it
what each step hook returns). No other module writes the history (tests/test_layering.py).

PlanSession binds the planner's Plan to the model. It holds what the plan was made on (the model's
shape and the hardware profile), the options as applied now (read back from its levers: the blocks
that recompute, the blocks that stream), and the plan history that memory_report(model)["plan"]
shows. Measurements go to the planner (planner/revise.py revise(), pure: it decides), the session
applies the difference through its levers (runtime/apply.py RecomputeLever and StreamLever, over the
mechanisms in activations/, weights/ and engine/, which decide nothing) and writes the record: the
revised plan in memory_report(model)["plan"]["planner"] and an entry in the history."""

from __future__ import annotations

from ..planner.revise import Measured, Revision, revise
from .history import PlanHistory


class TrainingSession:
    """One optimizer's session: its plan history (memory_report(model)["plan"]["history"]) and the
    only code that records into it. history: the PlanHistory to record into (default: a new one)."""

    def __init__(self, history: PlanHistory | None = None) -> None:
        self.history = history if history is not None else PlanHistory()

    def record(self, entry: dict) -> dict:
        """Records one entry ({"change": str, ...}); returns it."""
        return self.history.record(entry)

    def take(self, entries) -> None:
        """Records what a decider returned: None (nothing decided), an entry, or a list of entries
        in the order they were made. TypeError for anything else."""
        if entries is None:
            return
        if isinstance(entries, dict):
            self.record(entries)
            return
        if not isinstance(entries, (list, tuple)):
            raise TypeError(
                "TrainingSession.take: a step hook returns None, a history entry (a dict with a 'change') "
                f"or a list of them; got {type(entries).__name__}"
            )
        for entry in entries:
            self.record(entry)


class PlanSession:
    """shape, profile: what the applied plan was made on; fixed: plan_training's options as wrap()
    applied them; history: the optimizer's TrainingSession that records (or a PlanHistory: a
    session over it), whose history memory_report(model)["plan"]["history"] reads; recompute,
    streams: the levers (None: that part cannot change); on_plan(plan): where a revised plan is
    recorded; disk(): the run's frozen-weight placement now (runtime/apply.py disk_applied; None:
    not known), plan_training's _disk_applied. loss_given: whether wrap(loss=...) named the loss
    (then the shape's loss is never changed); otherwise the loss is "open" until a chunked loss is
    seen (learn_loss) or assumed for a step that only fits with it (planner/revise.py loss_open),
    and on_loss(loss) records the loss the plan now counts."""

    def __init__(
        self, shape, profile, fixed: dict, log, history, *, recompute=None, streams=None, on_plan=None,
        disk=None, loss_given: bool = False, on_loss=None, pages=None,
    ) -> None:  # fmt: skip
        self.shape, self.profile, self.fixed = shape, profile, fixed
        # how the shape's loss is known: "given" (wrap(loss=)), "default" (rules.PLAN_LOSS),
        # "assumed" (a step fit only with the chunked loss), "seen" (a chunked loss ran on the head)
        self.loss_source = "given" if loss_given else "default"
        self.on_loss = on_loss or (lambda loss: None)
        self.recorder = history if isinstance(history, TrainingSession) else TrainingSession(history)
        self.log, self.history = log, self.recorder.history
        self.recompute_lever, self.stream_lever, self.page_lever = recompute, streams, pages
        self.on_plan = on_plan or (lambda plan: None)
        self.disk = disk

    def applied(self) -> dict:
        """plan_training's options as applied now (the recomputed and streamed blocks read from the
        levers, the frozen weights' placement from disk())."""
        now = dict(self.fixed)
        if self.disk is not None:
            now["_disk_applied"] = self.disk()
        if self.recompute_lever is None:
            return now
        now["activation_checkpointing"] = self.recompute_lever.recomputed()
        if self.stream_lever is not None:
            now["param_offload"] = self.stream_lever.streamed()
        if self.page_lever is not None and self.page_lever.paging():
            now["activation_offload"] = True
        return now

    def levers(self) -> tuple:
        if self.recompute_lever is None:
            return ()
        out = ("recompute",)
        if self.stream_lever is not None and self.stream_lever.usable():
            out += ("stream",)
        if self.page_lever is not None and not self.page_lever.paging():
            out += ("page",)
        return out

    def revise(self, measured: Measured, *, first: int, check_only: bool = False) -> Revision:
        """The planner's answer for `measured` (RevisionError when nothing fits); applies nothing."""
        levers = () if check_only else self.levers()
        return revise(
            self.shape, self.profile, self.applied(), measured, levers=levers, first=first,
            loss_open=self.loss_source == "default",
        )  # fmt: skip

    def set_loss(self, loss: str, source: str) -> bool:
        """The plan counts `loss` from now on (source: "assumed" or "seen"); False when nothing
        changed (the loss was given, or is known already)."""
        if self.loss_source in ("given", "seen") or (self.loss_source == source and self.shape.loss == loss):
            return False
        import dataclasses

        self.shape = dataclasses.replace(self.shape, loss=loss)
        self.loss_source = source
        self.on_loss(loss)
        return True

    def apply(self, rev: Revision) -> dict:
        """Applies a revision's changes (the streamed blocks first: a refusal of pinned memory, a
        MemoryError, leaves everything as it was), then activation paging, and records the revised
        plan; returns what changed ({"recompute", "was"(, "streamed", "streamed_was"(, "disk_weights":
        {"blocks", "store"}))(, "activation_offload": True))."""
        now = self.applied()
        ckpt = now.get("activation_checkpointing")
        before = list(ckpt) if isinstance(ckpt, (list, tuple)) else []
        after = rev.changed.get("activation_checkpointing", before)
        change = {"recompute": list(after), "was": before}
        streamed = rev.changed.get("param_offload")
        if streamed is not None and self.stream_lever is not None:
            was = self.stream_lever.streamed()
            if streamed != was:
                disk = self.stream_lever.stream(streamed, rev.plan)
                change.update(streamed=list(streamed), streamed_was=was)
                if disk:  # the new blocks whose frozen weights went to disk (the store "opened" or "grown")
                    change["disk_weights"] = disk
        if rev.changed.get("activation_offload") and self.page_lever is not None:
            self.page_lever.page()
            change["activation_offload"] = True
        if after != before:
            self.recompute_lever.recompute(after, rev.plan)
        self.shape = rev.shape
        self.on_plan(rev.plan)
        if rev.assumed:
            self.set_loss(rev.assumed, "assumed")
        return change

    def record(self, entry: dict) -> None:
        """An entry of the plan history (through the optimizer's TrainingSession)."""
        self.recorder.record(entry)
