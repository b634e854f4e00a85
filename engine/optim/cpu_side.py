"""The CPU-stepped part's step scheduler: gradient D2H, the driver thread's order of work, weight H2D.

Host tensors live in host_state.py, the arithmetic is cpu_arith.py, the copies cpu_transfer.py; this module
decides when each runs.
Lifecycle of one step for the parameters it owns:
  ship(name, grad)   main thread, as soon as a gradient is final (a backward hook in overlap mode):
                     copies it on the D2H stream into the host's gradient staging and records an event;
                     the first ship of a step starts the step's job on the driver thread.
  speculation        driver thread, overlap mode, while backward still runs: each layer unit whose
                     gradients are all shipped is stepped out of place into a free spare bank of its size
                     (host_state.SparePool, sized by optimizer.speculation_buffer_mb) as if unclipped, with
                     the hyperparameters of that moment; a unit that finds no spare waits for the clip factor.
  launch(...)        main thread, once the clip factor is known: tells the driver to go.
  commit             driver thread, per unit in forward order: a guess made with the final clip factor
                     (1.0), scale and hyperparameters is committed by swapping the unit's bank with the
                     spare; any other unit is stepped in place now (the fused pass on worker threads, GIL
                     released in the C call). Then the unit's weights go to the GPU on the H2D stream.
                     With the remainder master, the next unit's weights (unless it has a guess) come back
                     into the other weight-ring slot on the D2H stream while this unit steps.
  wait_unit(unit)    main thread, from the unit's forward pre-hook: the next forward waits for the
                     layer it is about to run, and only on the GPU (an event wait), not on the host.
                     Timing events around that wait measure how long the GPU stood still for the update
                     (StepTiming.gpu_wait_s, added to the step's timing when the next step launches).
Messages to the driver are the dataclasses Speculate, Go and Stop. Without CUDA the copies are plain host
copies and events are absent; the code path is the same.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.messages import assist_needs_engine_adamw
from engine.optim import affinity, device_arith, fused_kernel
from engine.optim.adam_math import Hyper
from engine.optim.cpu_arith import CpuArith, FusedAdamW, TorchOptimizers, UnitStep
from engine.optim.cpu_transfer import Transfers
from engine.optim.gpu_assist import GpuAssist
from engine.optim.host_buffers import FlatViews
from engine.optim.host_state import HostState, Layout, RingSlot, Spare


@dataclass(frozen=True)
class Speculate:
    """Every gradient of `unit` is shipped: step it out of place if a spare is free."""

    unit: str
    grads: dict[str, torch.Tensor]  # the gradients shipped so far (name -> host staging view)


@dataclass(frozen=True)
class Go:
    """The clip factor is known: step every shipped gradient."""

    grads: dict[str, torch.Tensor]
    hypers: list[Hyper]  # by param group
    inv_scale: float
    coef: float  # the clip factor
    bwd_done: torch.cuda.Event | None  # the last backward, which may still read the weights being replaced


@dataclass(frozen=True)
class Stop:
    """Drop the step (non-finite gradients, or zero_grad without a step)."""


@dataclass(frozen=True)
class Guess:
    """A unit stepped out of place into `spare`, and the hyperparameters each of its parameters used."""

    spare: Spare
    hypers: dict[str, Hyper]


@dataclass
class StepTiming:
    """One CPU step, measured where it runs (seconds; host clocks on the driver thread, CUDA events on the GPU).

    speculated_s  arithmetic done before the clip factor was known (units stepped out of place during backward)
    compute_s     all arithmetic of the step, speculated_s included
    run_s         from the clip factor's arrival (Go) to the last unit's update written
    gpu_wait_s    how long the GPU's compute stream stood at a CPU-stepped unit waiting for this update (the
                  next forward's pre-hooks, or a delayed update landing): the part of the step not hidden
    speculated, committed, assisted: units guessed during backward, guesses used, units the GPU assist stepped
    stepped_params  parameters compute_s stepped (a guess not used counts twice: it is stepped again in place)
    pass_bytes      bytes per parameter that arithmetic moves through host memory (fused_kernel.pass_bytes), 0 for
                    torch's optimizers, whose passes are not counted here
    """

    speculated_s: float = 0.0
    compute_s: float = 0.0
    run_s: float = 0.0
    gpu_wait_s: float = 0.0
    speculated: int = 0
    committed: int = 0
    assisted: int = 0
    stepped_params: int = 0
    pass_bytes: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Step:
    """What the workers of one step share: the Go message, the guesses, and the queue of units."""

    go: Go
    guesses: dict[str, Guess]
    units: deque[str]
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed: int = 0

    def take(self) -> str | None:
        with self.lock:
            return self.units.popleft() if self.units else None

    def has_guess(self, unit: str) -> bool:
        with self.lock:
            return unit in self.guesses

    def take_guess(self, unit: str) -> Guess | None:
        with self.lock:
            return self.guesses.pop(unit, None)


def _timing_event() -> torch.cuda.Event:
    """A timing event recorded on the current stream now."""
    return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))


class CpuPart:
    def __init__(
        self,
        entries: list[tuple[str, torch.nn.Parameter, int, str]],
        *,
        kind: str,
        use_torch: bool,
        pin_grads: bool,
        pin_params: bool,
        threads: int,
        speculate: bool = False,
        hyper_source: Callable[[], list[Hyper]] | None = None,
        gpu_assist: bool = False,
        speculation_buffer_bytes: int = 2048 << 20,
        pin_threads: bool = False,
        moment_dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        remainders: bool = False,
    ) -> None:
        """entries: (name, param, group index, unit) in forward order, each unit's names contiguous.

        speculate: step units before the clip factor is known, out of place into spare banks (at most
        speculation_buffer_bytes of them); the result is committed only if the step turns out unclipped and
        unscaled with the same hyperparameters (hyper_source() read at that time), and is otherwise
        recomputed in place: exact either way.

        gpu_assist: the GPU steps some units too (gpu_assist.py), taking them from the same queue as
        the CPU threads once the clip factor is known; their states stay in (then pinned) host memory.

        pin_threads: bind the worker threads and the driver to cores (affinity.py).

        remainders: hold the master as the int16 remainders of the bf16 weights (remainder.py): each unit's
        weights are read back from the model into the weight ring before its step (while the unit before it
        steps; or into its spare's half weights before a speculative one),
        stepped there with the remainders and uploaded from there."""
        self.kind = kind
        self.params = {n: p for n, p, _, _ in entries}
        self.group_of = {n: gi for n, _, gi, _ in entries}
        self.layout = Layout.of([(n, p.shape, u) for n, p, _, u in entries])
        self.units = self.layout.units
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in self.params.values())
        halves = {p.dtype for p in self.params.values() if p.dtype != torch.float32}
        if len(halves) > 1:
            raise ValueError(f"CPU-stepped parameters mix half dtypes {sorted(map(str, halves))}; use one")
        half = halves.pop() if halves else None
        if remainders and half != torch.bfloat16:
            raise ValueError(f"store_param_remainders (optimizer.store_param_remainders) keeps the fp32 master as "
                             f"the bf16 weight plus a remainder; the CPU-stepped parameters are {half or torch.float32}"
                             "; use bf16 weights or store_param_remainders=False")  # fmt: skip
        if gpu_assist and (why := assist_needs_engine_adamw(kind, use_torch)) is not None:
            raise ValueError(f"gpu_assist=True {why}")
        with_torch = use_torch or kind != "adam"
        self.speculate = bool(speculate and not with_torch and speculation_buffer_bytes > 0)  # FusedAdamW guesses
        # the assist copies master, m and v both ways: pinned, or the copies run at pageable speed;
        # fp32 weights travel back from the master itself, so it is the pinned buffer then
        pin_states = gpu_assist and self.cuda
        self.host = HostState(
            self.layout, moments=not with_torch, half=half,
            pin_master=(pin_params and self.cuda and half is None) or pin_states, pin_moments=pin_states,
            pin_half=pin_params and self.cuda, pin_grads=pin_grads and self.cuda,
            spare_budget_bytes=speculation_buffer_bytes if self.speculate else 0, grad_scratch=with_torch,
            moment_dtypes=moment_dtypes, remainders=remainders,
        )  # fmt: skip
        with torch.no_grad():
            for n, p in self.params.items():
                if not remainders:  # remainders start at zero: the master is the bf16 weight as it is
                    self.host.state(n)[0].copy_(p.detach().reshape(-1))
        workers_init, driver_init = affinity.initializers(pin_threads)
        self.arith: CpuArith
        if with_torch:
            self.arith = TorchOptimizers(kind, self.host, self.group_of)
        else:
            # on CUDA in the GPU's fused arithmetic, so an offloaded parameter steps as it would on the GPU (fp32
            # states in any of torch's; the narrow forms in the current one, device_arith.py); the GPU
            # assist steps in the single-tensor one (adam_math.adamw_torch_), so with it the pass keeps that one
            device = next(iter(self.params.values())).device
            same_as_gpu = device_arith.find(device) if self.cuda and not gpu_assist else None
            self.arith = FusedAdamW(fused_kernel.load(), threads, self.host, self.group_of, initializer=workers_init,
                                    device=same_as_gpu)  # fmt: skip
        self.hyper_source = hyper_source
        self.spec_ok = True  # speculate this step: the last one was not clipped
        self.q: queue.Queue[Speculate | Go | Stop] = queue.Queue()
        self.open = False  # a step's driver job is running and has not been told to go or stop
        self.unit_left: dict[str, int] = {}
        self.go = threading.Event()
        self.driver = ThreadPoolExecutor(1, thread_name_prefix="cpu-opt-driver", initializer=driver_init)
        self.job: Future | None = None
        self.ready = {u: threading.Event() for u in self.units}
        for e in self.ready.values():
            e.set()
        self.copies = Transfers(self.cuda, list(self.units))
        self.shipped: dict[str, torch.Tensor] = {}
        self.dest: dict[str, torch.Tensor] = {}  # launch's: where updated weights go instead of the parameters
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (GPU reached the unit, unit ready)
        self._last = StepTiming()  # the last finished step; the GPU's waits are added when the next step launches
        self.assist: GpuAssist | None = None
        self.assist_thread: ThreadPoolExecutor | None = None
        if gpu_assist:
            device = next(iter(self.params.values())).device
            self.assist = GpuAssist(max(p.numel() for p in self.params.values()), device, host_lib=self.lib)
            self.assist_thread = ThreadPoolExecutor(1, thread_name_prefix="cpu-opt-assist")

    @property
    def timing(self) -> dict[str, float]:
        """The last finished step's StepTiming fields (its GPU waits once the next step has launched)."""
        return self._last.as_dict()

    # ---- what the arithmetic runs on (read by tests and tools) ----
    @property
    def lib(self):
        """The compiled AdamW pass, or None (torch's ops or torch.optim step the host part)."""
        return self.arith.lib

    @property
    def inner(self) -> dict[str, torch.optim.Optimizer]:
        """unit -> its torch.optim optimizer, when torch.optim steps the host part (else empty)."""
        return getattr(self.arith, "opt", {})

    @property
    def master(self) -> FlatViews:
        return self.host.master

    @property
    def m(self) -> FlatViews | None:
        return self.host.m

    # ---- main thread ----
    def _open_step(self) -> None:
        if not self.open:
            self.wait_job()  # the previous step must be done reading the host buffers
            self.unit_left = {u: len(ns) for u, ns in self.units.items()}
            self.go.clear()
            self.job = self.driver.submit(self._run)
            self.open = True

    def ship(self, name: str, grad: torch.Tensor) -> None:
        """Start the copy of a final gradient to host memory (grad: the parameter's shape, any float dtype)."""
        self._open_step()
        buf = self.host.grad_buffer(name, grad.dtype)
        self.copies.to_host(name, grad, buf)
        first = name not in self.shipped
        self.shipped[name] = buf
        u = self.layout.unit_of[name]
        if first:
            self.unit_left[u] -= 1
            if self.unit_left[u] == 0 and self.speculate and self.spec_ok:
                self.q.put(Speculate(u, dict(self.shipped)))

    def launch(self, hypers: list[Hyper], inv_scale: float, coef: float,
               dest: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
        """Step every shipped parameter on the driver thread; returns at once. dest: where the updated
        weights go by name (the delayed update's shadow, delayed.py) instead of the parameters themselves."""
        self.dest = dest or {}  # read by the driver after the Go message below
        bwd_done = self.copies.backward_done()
        for e in self.ready.values():
            e.clear()
        self._open_step()  # the last step's driver job has finished: its timing is final but for the GPU's waits
        self._settle_waits()
        shipped, self.shipped = self.shipped, {}
        self.go.set()  # the driver stops speculating at the next unit boundary
        self.q.put(Go(shipped, hypers, inv_scale, coef, bwd_done))
        self.open = False
        self.spec_ok = coef == 1.0 and inv_scale == 1.0  # a clipped step predicts a clipped next one

    def discard(self) -> None:
        """Drop shipped gradients without stepping (non-finite step, or zero_grad with no step)."""
        self.shipped = {}
        if self.open:
            self.go.set()
            self.q.put(Stop())
            self.open = False

    def wait_unit(self, unit: str) -> None:
        """The compute stream waits for the unit's update (a host wait first while the driver has not written it)."""
        timed = self.cuda and not (self.ready[unit].is_set() and self.copies.h2d_event[unit] is None)
        reached = _timing_event() if timed else None
        if not self.ready[unit].is_set():
            self.ready[unit].wait()
        self.copies.wait_unit(unit)
        if reached is not None:
            self._stalls.append((reached, _timing_event()))

    def _settle_waits(self) -> None:
        """Add the GPU's waits for the last finished update to its timing (their events are past by now: the
        step's synchronisation came after the backward that followed them)."""
        if self._stalls:
            self._last.gpu_wait_s += sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3
            self._stalls = []

    def wait_job(self) -> None:
        if self.job is not None:
            job, self.job = self.job, None
            job.result()  # re-raises an error from the driver thread here, on the main thread

    def wait_all(self) -> None:
        self.wait_job()
        for u in self.units:
            self.wait_unit(u)

    def host_bytes(self) -> int:
        """Bytes of the host tensors this part holds (walked, not counted): host_plan.cpu_side_host_bytes."""
        held = self.host.tensors() + self.arith.tensors()
        return sum(t.numel() * t.element_size() for t in held)

    # ---- driver thread ----
    def _run(self) -> None:
        """One step on the driver thread: speculate on units as they arrive, then commit or compute in order."""
        guesses: dict[str, Guess] = {}
        compute, stepped = 0.0, 0
        try:
            while True:
                msg = self.q.get()
                if isinstance(msg, Stop):
                    for g in guesses.values():
                        self.host.spares.give_back(g.spare)
                    return
                if isinstance(msg, Go):
                    break
                if self.go.is_set():
                    continue  # the clip factor is known: no more guessing
                guess, seconds = self._speculate(msg)
                compute += seconds
                if guess is not None:
                    guesses[msg.unit] = guess
                    stepped += self.layout.numel[msg.unit]
            t_run = time.perf_counter()
            n_speculated, speculated_s = len(guesses), compute
            # units in forward order, taken one at a time by the CPU threads (here) and the GPU assist
            step = _Step(msg, guesses, deque(self.units))
            assisted = self.assist_thread.submit(self._assist_units, step) if self.assist_thread else None
            seconds, params = self._cpu_units(step)
            compute, stepped = compute + seconds, stepped + params
            n_assisted = 0
            if assisted is not None:
                n_assisted = assisted.result()
                self.assist.drain()  # host states are final before the next step or a state_dict reads them
            for g in step.guesses.values():  # guesses for units with nothing to step
                self.host.spares.give_back(g.spare)
            self._last = StepTiming(speculated_s, compute, time.perf_counter() - t_run, 0.0, n_speculated,
                                    step.committed, n_assisted, stepped, self.pass_bytes())  # fmt: skip
        finally:
            for e in self.ready.values():
                e.set()

    def _speculate(self, msg: Speculate) -> tuple[Guess | None, float]:
        """Step msg.unit out of place into a free spare, as if unclipped; None when no spare is free. Also returns
        the seconds of arithmetic (the wait for the unit's gradients to arrive is not arithmetic)."""
        spare = self.host.spares.take(self.layout.numel[msg.unit])
        if spare is None:
            return None, 0.0
        hypers = self.hyper_source()
        names = self.units[msg.unit]  # a unit is speculated only once all of its gradients are shipped
        self.copies.wait_d2h(names)
        t = time.perf_counter()
        out = self.host.spare_views(spare, msg.unit)
        half = self.host.half_views(spare.half, msg.unit) if spare.half is not None else None
        if self.host.remainders:  # the weights the guess starts from: ordered after the unit's forward, which the
            # D2H stream follows since this unit's gradients were shipped on it
            self.copies.weights_to_host([self.params[n] for n in names], [half[n] for n in names], None)
        self.arith.guess(msg.unit, names, msg.grads, out, half, hypers)
        return Guess(spare, {n: hypers[self.group_of[n]] for n in names}), time.perf_counter() - t

    def _commit(self, unit: str, todo: list[str], step: _Step) -> bool:
        """Commit the unit's guess if it is the step the clip factor asks for (then upload); give back its spare."""
        guess = step.take_guess(unit)
        if guess is None:
            return False
        go = step.go
        ok = (go.coef == 1.0 and go.inv_scale == 1.0 and set(guess.hypers) == set(todo)
              and all(h == go.hypers[self.group_of[n]] for n, h in guess.hypers.items()))  # fmt: skip
        if ok:
            with step.lock:
                step.committed += 1
            self.host.commit(unit, guess.spare)  # the spare's bank is the unit's now, its old bank the spare's
            half = guess.spare.half
            src = self.host.half_views(half, unit) if half is not None else self._masters(todo)
            guess.spare.read_by = self._upload(unit, todo, src, go.bwd_done)
        self.host.spares.give_back(guess.spare)
        return ok

    def _cpu_units(self, step: _Step) -> tuple[float, int]:
        """The CPU threads' share: step units from the queue until none are left; returns arithmetic seconds (the
        waits for a unit's weights to come back included) and the parameters stepped."""
        go, compute, stepped = step.go, 0.0, 0
        # the remainder form reads each unit's weights back before stepping it: the next unit's read-back runs over
        # PCIe while this unit steps (a unit with a guess is left to its commit, which needs no read-back)
        ahead = self.host.remainders and len(self.host.ring) >= 2
        nxt = self._claim(step, ahead, None)
        while nxt is not None:
            u, todo, slot, back = nxt
            nxt = self._claim(step, ahead, slot)
            if todo:
                self.copies.wait_d2h(todo)
                t = time.perf_counter()
                if not self._commit(u, todo, step):
                    if slot is None and self.host.ring:  # not claimed ahead: the slot the next unit does not hold
                        slot = self.host.take_ring(avoid=nxt[2] if nxt is not None else None)
                        if self.host.remainders:
                            back = self._weights_back(u, todo, slot, go.bwd_done, wait=True)
                    half = self.host.half_views(slot.half, u) if slot is not None else None
                    if back is not None:
                        back.synchronize()
                    self.arith.step_unit(UnitStep(u, todo, go.grads, go.hypers, go.inv_scale, go.coef, half))
                    compute += time.perf_counter() - t
                    stepped += sum(self.params[n].numel() for n in todo)
                    ev = self._upload(u, todo, half if half is not None else self._masters(todo), go.bwd_done)
                    if slot is not None:
                        slot.read_by = ev
                for n in todo:
                    self.host.steps[n] += 1
            self.ready[u].set()
        return compute, stepped

    def pass_bytes(self) -> float:
        """Bytes per parameter the C pass moves through host memory for this part's state forms, with the gradients'
        staging dtype (fused_kernel.pass_bytes); 0 for torch's optimizers, or before a gradient has arrived."""
        if not isinstance(self.arith, FusedAdamW) or self.arith.lib is None or not self.host.grads:
            return 0.0
        grad = max(self.host.grads, key=lambda d: d.itemsize)
        m, v = self.host.moment_dtypes
        return fused_kernel.pass_bytes(m, v, grad, self.host.half, self.host.remainders)

    def _claim(
        self, step: _Step, ahead: bool, held: RingSlot | None
    ) -> tuple[str, list[str], RingSlot | None, torch.cuda.Event | None] | None:
        """The next unit from the queue (None when none is left) and the names it steps; with ahead and no guess for
        it, also its ring slot (not `held`, the unit before's) with its weights' read-back under way (the event the
        host waits for before it steps the unit)."""
        u = step.take()
        if u is None:
            return None
        todo = [n for n in self.units[u] if n in step.go.grads]
        if not (ahead and todo) or step.has_guess(u):
            return u, todo, None, None
        slot = self.host.take_ring(wait=False, avoid=held)
        return u, todo, slot, self._weights_back(u, todo, slot, step.go.bwd_done, wait=False)

    def _weights_back(self, u: str, todo: list[str], slot: RingSlot, bwd_done, wait: bool) -> torch.cuda.Event | None:
        """Read the unit's weights (the masters' high halves) back into its ring slot, ordered on the GPU after the
        slot's last upload where the host has not waited for it (take_ring(wait=False)); with wait, returns once
        they are there, else returns the copy's event."""
        half = self.host.half_views(slot.half, u)
        free, slot.read_by = slot.read_by, None
        return self.copies.weights_to_host([self.params[n] for n in todo], [half[n] for n in todo], bwd_done,
                                           buffer_free=free, wait=wait)  # fmt: skip

    def _assist_units(self, step: _Step) -> int:
        """The GPU assist's share of the same queue; returns the number of units it stepped."""
        go, assisted = step.go, 0
        while (u := step.take()) is not None:
            todo = [n for n in self.units[u] if n in go.grads]
            if todo:
                self.copies.wait_d2h(todo)
                if not self._commit(u, todo, step):
                    ev = self.assist.step_unit(
                        todo, {n: self.host.state(n) for n in todo}, go.grads,
                        {n: go.hypers[self.group_of[n]] for n in todo}, self.host.steps, self.params,
                        go.inv_scale, go.coef, go.bwd_done,
                    )  # fmt: skip
                    self.copies.set_unit_event(u, ev)
                    assisted += 1
                for n in todo:
                    self.host.steps[n] += 1
            self.ready[u].set()
        return assisted

    def _masters(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.host.state(n)[0] for n in names}

    def _upload(self, unit: str, names: list[str], src: dict[str, torch.Tensor], bwd_done) -> torch.cuda.Event | None:
        dst = [self.dest.get(n, self.params[n]) for n in names]
        return self.copies.upload(unit, dst, [src[n] for n in names], bwd_done)

    # ---- state (called with no step in flight) ----
    def export(self, name: str, high_half: torch.Tensor | None = None) -> dict:
        """The state of one parameter. high_half: where the remainder form's bf16 half of the master is when
        not the parameter (a pending delayed update's shadow, while the model's weight lags it)."""
        return self.host.export(name, self.params[name] if high_half is None else high_half) | self.arith.export(name)

    def load(self, name: str, st: dict, high_half: torch.Tensor | None = None) -> None:
        """The state of one parameter; with the remainder form its weight too (the master's high half), set into
        the parameter or into `high_half` (a resumed pending update's shadow: the model keeps its loaded weight)."""
        weight = self.host.load(name, st)
        if weight is not None:
            dst = self.params[name] if high_half is None else high_half
            with torch.no_grad():
                dst.copy_(weight.view(dst.shape))
        self.arith.load(name, st)

    def close(self) -> None:
        self.discard()
        self.wait_job()
        self.arith.close()
        self.driver.shutdown(wait=False)
        if self.assist_thread is not None:
            self.assist_thread.shutdown(wait=False)
