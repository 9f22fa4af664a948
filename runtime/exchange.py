"""Execute a gradient plan: one fused collective per planned group, launched from gradient hooks.

    exchange = GradientExchange(model, plan)          # or GradientExchange.from_file(model, "plan.json")
    for batch in loader:
        loss = model(batch).sum()
        loss.backward()        # hooks launch each group's collective as soon as it is complete
        exchange.synchronize() # wait for them, write the averaged gradients into .grad
        optimizer.step()
        optimizer.zero_grad()

Design (DESIGN.md, "Runtime principles"):

- Every planned parameter gets a `register_post_accumulate_grad_hook`. A group whose parameters are
  all ready is *prepared* at once, inside the hook on the compute stream: its gradients are gathered
  into the group's flat fp32 buffer and, for top-k, selected with error feedback and packed. Prepared
  groups are *launched* (async collective) strictly in plan order: a group prepared early waits until
  every earlier group is launched, so all ranks issue the same collectives in the same order.
- Buffers are allocated once. After a step each fp32 parameter's `.grad` is a view into its group's
  flat buffer (as DDP's `gradient_as_bucket_view`): the result of the collective is the gradient, with
  no copy back. If the next backward accumulates into that view (`zero_grad(set_to_none=False)`) the
  copy into the buffer is skipped too; if `.grad` was replaced (the default `set_to_none=True`) it is
  copied in. Parameters of other dtypes are copied in and out.
- A planned parameter with no gradient this step (unused in the forward) counts as zeros: its group
  is prepared and launched by `synchronize()`, and afterwards its `.grad` holds the average over ranks
  (zeros if no rank had a gradient). Exception: a dense plan on world size 1 leaves gradients untouched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from planner.plan import Group, Plan
from planner.types import DistributedError, PlanMismatchError, Strategy
from runtime.compress import all_gather_flat, decode, pack, select_topk
from runtime.retune import resolve_plan

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["GradientExchange"]

STATE_KIND = "runtime.gradient_exchange"



def _world_size(process_group: Any) -> int:
    """Size of `process_group`, of the default group if None, or 1 when torch.distributed is not initialised."""
    if process_group is not None:
        return dist.get_world_size(process_group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _name_list(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


class _GroupState:
    """Buffers and per-step progress of one planned group."""

    __slots__ = (
        "as_view",
        "flat",
        "index",
        "k",
        "names",
        "num_ready",
        "numel",
        "params",
        "prepared",
        "ready",
        "recv",
        "residual",
        "send",
        "views",
        "work",
    )

    def __init__(self, index: int, group: Group, params: list[nn.Parameter], topk: bool, world_size: int) -> None:
        self.index = index
        self.names = group.params
        self.params = params
        self.numel = group.numel
        self.k = group.k if topk else None
        device = params[0].device
        needs_buffer = topk or world_size > 1
        self.flat: Tensor | None = torch.zeros(self.numel, dtype=torch.float32, device=device) if needs_buffer else None
        self.views: list[Tensor] = []
        if self.flat is not None:
            offset = 0
            for p in params:
                self.views.append(self.flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self.as_view = [p.dtype == torch.float32 for p in params]
        self.residual: Tensor | None = None
        self.send: Tensor | None = None
        self.recv: Tensor | None = None
        if topk:
            assert self.k is not None
            self.residual = torch.zeros(self.numel, dtype=torch.float32, device=device)
            self.send = torch.empty(2 * self.k, dtype=torch.float32, device=device)
            if world_size > 1:
                self.recv = torch.empty(world_size * 2 * self.k, dtype=torch.float32, device=device)
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.prepared = False
        self.work: Any = None

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.num_ready = 0
        self.prepared = False
        self.work = None


class GradientExchange:
    """Averages gradients across ranks as a plan says: fused dense allreduce or top-k allgather per group.

    Call order per step: `loss.backward()` (hooks prepare and launch groups), `synchronize()` (launch
    what is left, wait, write back), `optimizer.step()`. Use `no_sync()` around backward passes that
    only accumulate gradients locally.

    Args:
        model: the module the plan was made for (same trainable parameter names, shapes and dtypes).
        plan: the plan; its model fingerprint and world size must match.
        process_group: the group to average over; default: the default group, or none (world size 1)
            when torch.distributed is not initialised.
        model_name: name used for the model in error messages; default: the plan's model name.
        auto_retune: when the plan was made for another world size, backend or kind of device, re-plan
            from its stored profile and a quick probe of the group's network (rank 0 solves and
            broadcasts; see `runtime.retune`) instead of refusing. The plan in use is `self.plan`.
        profile: the per-layer profile to re-plan from (a Profile or a path); default the plan's source.

    Raises:
        PlanMismatchError: the plan was made for another model, or for another world size, backend or
            kind of device without `auto_retune`, or its parameters do not match the model's trainable
            parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        process_group: Any = None,
        model_name: str | None = None,
        auto_retune: bool = False,
        profile: Any = None,
    ) -> None:
        plan = resolve_plan(plan, model, process_group=process_group, model_name=model_name,
                            auto_retune=auto_retune, profile=profile)
        self.plan = plan
        self.process_group = process_group
        self.world_size = _world_size(process_group)
        self._topk = plan.strategy is Strategy.TOPK
        params = self._check_params(model, plan)
        self._groups = [
            _GroupState(i, g, [params[n] for n in g.params], self._topk, self.world_size)
            for i, g in enumerate(plan.groups)
        ]
        self._next_launch = 0
        self._active = False
        self._enabled = True
        self._lock = threading.Lock()
        self._hooks: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, st.index, j))
            for st in self._groups
            for j, p in enumerate(st.params)
        ]

    @classmethod
    def from_file(cls, model: nn.Module, path: str | os.PathLike[str], **kwargs: Any) -> GradientExchange:
        """Load the plan at `path` (validated, see `Plan.load`) and build the exchange."""
        return cls(model, Plan.load(path), **kwargs)

    @staticmethod
    def _check_params(model: nn.Module, plan: Plan) -> dict[str, nn.Parameter]:
        """The model's parameters by name, after checking they are exactly the planned trainable ones."""
        params = dict(model.named_parameters())
        planned = plan.param_order
        replan = f"re-plan: {plan.replan_command()}"
        unknown = [n for n in planned if n not in params]
        if unknown:
            raise PlanMismatchError(
                f"the plan names parameter(s) the model does not have: {_name_list(unknown)}; {replan}"
            )
        frozen = [n for n in planned if not params[n].requires_grad]
        if frozen:
            raise PlanMismatchError(
                f"the plan names frozen parameter(s) (requires_grad=False): {_name_list(frozen)}; {replan}"
            )
        planned_set = set(planned)
        missing = [n for n, p in params.items() if p.requires_grad and n not in planned_set]
        if missing:
            raise PlanMismatchError(f"trainable parameter(s) missing from the plan: {_name_list(missing)}; {replan}")
        for i, g in enumerate(plan.groups):
            numel = sum(params[n].numel() for n in g.params)
            if numel != g.numel:
                raise PlanMismatchError(
                    f"plan group {i} says numel={g.numel}, but its parameters hold {numel} elements; {replan}"
                )
            devices = {params[n].device for n in g.params}
            if len(devices) > 1:
                raise ValueError(f"plan group {i} spans several devices {sorted(map(str, devices))}; one is needed")
        return params

    # -- hooks and launching ---------------------------------------------------------------------
    def _on_grad_ready(self, group_index: int, param_index: int, param: Tensor) -> None:
        """Post-accumulate-grad hook: count the parameter; prepare its group when complete, launch in order."""
        if not self._enabled:
            return
        with self._lock:
            st = self._groups[group_index]
            if st.prepared:
                raise DistributedError(
                    f"the gradient of {st.names[param_index]} became ready again after its group was sent; "
                    "call synchronize() after every backward, or accumulate inside `with exchange.no_sync():`"
                )
            self._active = True
            if not st.ready[param_index]:
                st.ready[param_index] = True
                st.num_ready += 1
            if st.num_ready == len(st.params):
                self._prepare(st)
                self._launch_prepared()

    def _prepare(self, st: _GroupState) -> None:
        """Gather the group's gradients into its flat buffer (missing ones as zeros); top-k: select and pack."""
        if st.flat is not None:
            for p, view, as_view in zip(st.params, st.views, st.as_view, strict=True):
                grad = p.grad
                if grad is None:
                    view.zero_()
                elif not (as_view and grad.data_ptr() == view.data_ptr() and grad.stride() == view.stride()):
                    view.copy_(grad)
            if self._topk:
                assert st.send is not None and st.k is not None
                values, indices = select_topk(st.flat, st.residual, st.k)
                pack(values, indices, out=st.send)
        st.prepared = True

    def _launch_prepared(self) -> None:
        """Launch every prepared group that directly follows the launched ones, in plan order."""
        while self._next_launch < len(self._groups) and self._groups[self._next_launch].prepared:
            st = self._groups[self._next_launch]
            st.work = self._start_collective(st)
            self._next_launch += 1

    def _start_collective(self, st: _GroupState) -> Any:
        """Start the group's async collective and return its work handle (None on world size 1)."""
        if self.world_size == 1:
            return None
        if self._topk:
            return all_gather_flat(st.recv, st.send, group=self.process_group, async_op=True)
        return dist.all_reduce(st.flat, group=self.process_group, async_op=True)

    # -- the step --------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Launch the groups not yet launched, wait for all, write the averaged gradients into `.grad`.

        A no-op when no gradient became ready since the last call.
        """
        with self._lock:
            if not self._active:
                return
            for st in self._groups:
                if not st.prepared:
                    self._prepare(st)
            self._launch_prepared()
            try:
                for st in self._groups:
                    if st.work is not None:
                        st.work.wait()
                    self._finish(st)
            finally:
                for st in self._groups:
                    st.reset()
                self._next_launch = 0
                self._active = False

    def _finish(self, st: _GroupState) -> None:
        """Turn the collective's result into the averaged gradient and make it each parameter's `.grad`."""
        if st.flat is None:  # dense on world size 1: the local gradient already is the average
            return
        if self._topk:
            assert st.k is not None and st.send is not None
            gathered = st.send if st.recv is None else st.recv
            decode(gathered, st.k, st.numel, self.world_size, out=st.flat)
        else:
            st.flat.div_(self.world_size)
        for p, view, as_view in zip(st.params, st.views, st.as_view, strict=True):
            if as_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr() or p.grad.stride() != view.stride():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                p.grad.copy_(view)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into `.grad`; the next backward outside communicates."""
        previous, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = previous

    # -- state -----------------------------------------------------------------------------------
    def _layout_digest(self) -> str:
        h = hashlib.sha256(self.plan.strategy.value.encode())
        for g in self.plan.groups:
            h.update(f"{','.join(g.params)}:{g.k}\n".encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: this rank's top-k residuals by group index, tied to the plan (copies)."""
        return {
            "kind": STATE_KIND,
            "model_fingerprint": self.plan.model.fingerprint,
            "layout": self._layout_digest(),
            "residuals": {st.index: st.residual.detach().clone() for st in self._groups if st.residual is not None},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore residuals saved by `state_dict` for the same model and plan groups (PlanMismatchError else)."""
        kind = state.get("kind") if isinstance(state, dict) else type(state).__name__
        if kind != STATE_KIND:
            raise PlanMismatchError(f"not a GradientExchange state: kind is {kind!r}, expected {STATE_KIND!r}")
        replan = "load the state saved with this plan, or start without one"
        if state.get("model_fingerprint") != self.plan.model.fingerprint:
            raise PlanMismatchError(
                f"this exchange state was saved for model fingerprint {state.get('model_fingerprint')}, but the plan "
                f"is for {self.plan.model.describe()}; {replan}"
            )
        if state.get("layout") != self._layout_digest():
            raise PlanMismatchError(
                f"this exchange state was saved for other plan groups (layout {state.get('layout')}, this plan "
                f"{self._layout_digest()}); {replan}"
            )
        residuals = {int(i): t for i, t in state.get("residuals", {}).items()}
        expected = {st.index for st in self._groups if st.residual is not None}
        if set(residuals) != expected:
            raise PlanMismatchError(
                f"the state holds residuals for groups {sorted(residuals)}, but the plan's top-k groups are "
                f"{sorted(expected)}; {replan}"
            )
        for st in self._groups:
            if st.residual is None:
                continue
            saved = residuals[st.index]
            if saved.shape != st.residual.shape:
                raise PlanMismatchError(
                    f"residual of group {st.index} has shape {tuple(saved.shape)}, expected "
                    f"{tuple(st.residual.shape)}; {replan}"
                )
            st.residual.copy_(saved)

    # -- teardown --------------------------------------------------------------------------------
    def remove_hooks(self) -> None:
        """Remove the gradient hooks; the exchange no longer reacts to backward passes."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    close = remove_hooks

    def __enter__(self) -> GradientExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
