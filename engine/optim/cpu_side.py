"""The CPU-stepped part: host master weights and states, gradient D2H, the CPU step, weight H2D.

Lifecycle of one step for the parameters it owns:
  ship(name, grad)   main thread, as soon as a gradient is final (a backward hook in overlap mode):
                     copies it on the D2H stream into a pinned host buffer and records an event;
                     the first ship of a step starts the step's job on the driver thread.
  speculation        driver thread, overlap mode, while backward still runs: each layer unit whose
                     gradients are all shipped is stepped out of place (second bank of master/m/v)
                     as if unclipped, with the hyperparameters of that moment.
  launch(...)        main thread, once the clip factor is known: tells the driver to go.
  commit             driver thread, per unit in forward order: a guess made with the final clip
                     factor (1.0), scale and hyperparameters is committed by swapping banks; any other
                     unit is stepped in place now (the fused pass on `threads` worker threads, GIL
                     released in the C call). Then the unit's weights go to the GPU on the H2D stream.
  wait_unit(unit)    main thread, from the unit's forward pre-hook: the next forward waits for the
                     layer it is about to run, and only on the GPU (an event wait), not on the host.
Without CUDA the copies are plain host copies and events are absent; the code path is the same.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.optim import fused_kernel
from engine.optim.adam_math import Hyper, adamw_scalars, adamw_torch_, apply_hypers
from engine.optim.gpu_assist import GpuAssist
from engine.optim.host_buffers import FlatViews

_MIN_SLICE = 1 << 16  # elements: below this a slice costs more in dispatch than it saves


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
    ) -> None:
        """entries: (name, param, group index, unit) in forward order.

        speculate: step each unit as soon as its gradients are on the host, before the clip factor is
        known, out of place into a second bank of master/m/v buffers; the result is committed (the banks
        swap) only if the step turns out unclipped and unscaled with the same hyperparameters
        (hyper_source() read at that time), and is otherwise recomputed in place: exact either way.

        gpu_assist: the GPU steps some units too (gpu_assist.py), taking them from the same queue as
        the CPU threads once the clip factor is known; their states stay in (then pinned) host memory."""
        self.kind = kind
        self.params = {n: p for n, p, _, _ in entries}
        self.group_of = {n: gi for n, _, gi, _ in entries}
        self.units: dict[str, list[str]] = {}
        for n, _, _, u in entries:
            self.units.setdefault(u, []).append(n)
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in self.params.values())
        self.pin_grads = pin_grads and self.cuda
        layout, off = {}, 0
        for n, p, _, _ in entries:
            layout[n] = (off, p.shape)
            off += p.numel()
        self.layout = layout
        half = {p.dtype for p in self.params.values() if p.dtype != torch.float32}
        if len(half) > 1:
            raise ValueError(f"CPU-stepped parameters mix half dtypes {sorted(map(str, half))}; use one")
        # fp32 weights travel back from the master itself, so it is the pinned buffer then
        self.half = bool(half)
        if gpu_assist and (use_torch or kind != "adam"):
            raise ValueError("gpu_assist=True works with the engine's own AdamW only; set it to False for SGD or "
                             "use_torch_optimizer_for_cpu_offload=True")  # fmt: skip
        # the assist copies master, m and v both ways: pinned, or the copies run at pageable speed
        pin_states = gpu_assist and self.cuda
        self.master = FlatViews(layout, torch.float32, (pin_params and self.cuda and not half) or pin_states)
        self.upload = FlatViews(layout, half.pop(), pin_params and self.cuda) if half else None
        with torch.no_grad():
            for n, p in self.params.items():
                self.master[n].copy_(p.detach().reshape(-1))
        self.grads: dict[torch.dtype, FlatViews] = {}  # transfer dtype -> pinned buffer, allocated on first use
        self.steps = dict.fromkeys(self.params, 0)
        self.lib = None if (use_torch or kind != "adam") else fused_kernel.load()
        self.inner: dict[str, torch.optim.Optimizer] = {}
        if self.lib is None and (use_torch or kind != "adam"):
            self._build_inner()
        elif kind == "adam":
            self.m = FlatViews(layout, torch.float32, pin_states)
            self.v = FlatViews(layout, torch.float32, pin_states)
            self.m.flat.zero_()
            self.v.flat.zero_()
        # cur[name] = (master, m, v) views in use; alt[name] the other bank, where speculation writes
        self.cur = {n: (self.master[n], getattr(self, "m", None) and self.m[n], getattr(self, "v", None) and self.v[n])
                    for n in self.params}  # fmt: skip
        self.speculate = bool(speculate and kind == "adam" and not self.inner and speculation_buffer_bytes > 0)
        self.hyper_source = hyper_source
        self.alt: dict[str, tuple] = {}
        if self.speculate:
            pin2 = (pin_params and self.cuda and not half) or pin_states
            self.banks2 = [FlatViews(layout, torch.float32, pin2) for _ in range(3)]
            self.alt = {n: tuple(b[n] for b in self.banks2) for n in self.params}
        self.spec_ok = True  # speculate this step: the last one was not clipped
        self.q: queue.Queue = queue.Queue()
        self.open = False  # a step's driver job is running and has not been told to go or stop
        self.unit_left: dict[str, int] = {}
        self.unit_of = {n: u for u, ns in self.units.items() for n in ns}
        self.go = threading.Event()
        self.g32: FlatViews | None = None
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="cpu-adam")
        self.driver = ThreadPoolExecutor(1, thread_name_prefix="cpu-opt-driver")
        self.job: Future | None = None
        self.ready = {u: threading.Event() for u in self.units}
        for e in self.ready.values():
            e.set()
        self.h2d_event: dict[str, torch.cuda.Event | None] = dict.fromkeys(self.units)
        self.d2h_event: dict[str, torch.cuda.Event | None] = {}
        self.shipped: dict[str, torch.Tensor] = {}
        self.timing = {"run_s": 0.0, "compute_s": 0.0}  # last step: whole driver run, and the arithmetic alone
        if self.cuda:
            self.d2h_stream = torch.cuda.Stream()
            self.h2d_stream = torch.cuda.Stream()
        self.assist: GpuAssist | None = None
        if gpu_assist:
            device = next(iter(self.params.values())).device
            self.assist = GpuAssist(max(p.numel() for p in self.params.values()), device, host_lib=self.lib)
            self.assist_thread = ThreadPoolExecutor(1, thread_name_prefix="cpu-opt-assist")

    # ---- torch.optim for the CPU part (use_torch_optimizer_for_cpu_offload, or SGD) ----
    def _build_inner(self) -> None:
        """One torch optimizer per unit, so units still step and travel back one by one."""
        for u, names in self.units.items():
            by_group: dict[int, list[torch.Tensor]] = {}
            for n in names:
                by_group.setdefault(self.group_of[n], []).append(self.master[n])
            groups = [{"params": ps, "gi": gi} for gi, ps in by_group.items()]
            if self.kind == "adam":
                self.inner[u] = torch.optim.AdamW(groups, lr=0.0, fused=True)
            else:
                self.inner[u] = torch.optim.SGD(groups, lr=0.0, momentum=0.0)

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
        if grad.dtype not in self.grads:
            self.grads[grad.dtype] = FlatViews(self.layout, grad.dtype, self.pin_grads)
        buf = self.grads[grad.dtype][name]
        if self.cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.d2h_stream):
                buf.copy_(grad.reshape(-1), non_blocking=True)
                self.d2h_event[name] = self.d2h_stream.record_event()
            grad.record_stream(self.d2h_stream)  # its memory returns to the pool only after the copy
        else:
            buf.copy_(grad.reshape(-1))
        first = name not in self.shipped
        self.shipped[name] = buf
        u = self.unit_of[name]
        if first:
            self.unit_left[u] -= 1
            if self.unit_left[u] == 0 and self.speculate and self.spec_ok:
                self.q.put(("spec", u, dict(self.shipped)))

    def launch(self, hypers: list[Hyper], inv_scale: float, coef: float) -> None:
        """Step every shipped parameter on the driver thread; returns at once."""
        bwd_done = torch.cuda.current_stream().record_event() if self.cuda else None
        for e in self.ready.values():
            e.clear()
        self._open_step()
        shipped, self.shipped = self.shipped, {}
        self.go.set()  # the driver stops speculating at the next unit boundary
        self.q.put(("go", shipped, hypers, inv_scale, coef, bwd_done))
        self.open = False
        self.spec_ok = coef == 1.0 and inv_scale == 1.0  # a clipped step predicts a clipped next one

    def discard(self) -> None:
        """Drop shipped gradients without stepping (non-finite step, or zero_grad with no step)."""
        self.shipped = {}
        if self.open:
            self.go.set()
            self.q.put(("stop",))
            self.open = False

    def wait_unit(self, unit: str) -> None:
        if not self.ready[unit].is_set():
            self.ready[unit].wait()
        ev = self.h2d_event[unit]
        if ev is not None:
            torch.cuda.current_stream().wait_event(ev)
            self.h2d_event[unit] = None

    def wait_job(self) -> None:
        if self.job is not None:
            job, self.job = self.job, None
            job.result()  # re-raises an error from the driver thread here, on the main thread

    def wait_all(self) -> None:
        self.wait_job()
        for u in self.units:
            self.wait_unit(u)

    def host_bytes(self) -> int:
        views = [self.master, *self.grads.values(), *getattr(self, "banks2", [])]
        views += [self.upload] if self.upload is not None else []
        views += [self.m, self.v] if hasattr(self, "m") else []
        views += [self.g32] if self.g32 is not None else []
        n = sum(v.nbytes for v in views)
        for opt in self.inner.values():
            n += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
        return n

    # ---- driver thread ----
    def _run(self) -> None:
        """One step on the driver thread: speculate on units as they arrive, then commit or compute in order."""
        spec: dict[str, dict[str, Hyper]] = {}  # unit -> the hyperparameters each of its params was stepped with
        compute = 0.0
        try:
            while True:
                msg = self.q.get()
                if msg[0] == "stop":
                    return
                if msg[0] == "go":
                    break
                _, u, shipped = msg
                if self.go.is_set():
                    continue  # the clip factor is known: no more guessing
                hypers = self.hyper_source()
                names = [n for n in self.units[u] if n in shipped]
                self._wait_d2h(names)
                t = time.perf_counter()
                self._step_fused(names, shipped, hypers, 1.0, 1.0, out_of_place=True)
                compute += time.perf_counter() - t
                spec[u] = {n: hypers[self.group_of[n]] for n in names}
            _, shipped, hypers, inv_scale, coef, bwd_done = msg
            t_run = time.perf_counter()
            # units in forward order, taken one at a time by the CPU threads (here) and the GPU assist
            queue_ = deque(self.units)
            lock = threading.Lock()

            def take() -> str | None:
                with lock:
                    return queue_.popleft() if queue_ else None

            work = (shipped, hypers, inv_scale, coef, bwd_done, spec)
            assisted = self.assist_thread.submit(self._work, take, work, True) if self.assist else None
            compute += self._work(take, work, False)
            n_assisted = 0
            if assisted is not None:
                n_assisted = assisted.result()
                self.assist.drain()  # host states are final before the next step or a state_dict reads them
            self.timing = {"run_s": time.perf_counter() - t_run, "compute_s": compute, "speculated": len(spec),
                           "assisted": n_assisted}  # fmt: skip
        finally:
            for e in self.ready.values():
                e.set()

    def _work(self, take: Callable[[], str | None], work: tuple, on_gpu: bool) -> float | int:
        """Step units from `take` until none are left; returns CPU arithmetic seconds, or (on_gpu) units stepped."""
        shipped, hypers, inv_scale, coef, bwd_done, spec = work
        compute, assisted = 0.0, 0
        while (u := take()) is not None:
            todo = [n for n in self.units[u] if n in shipped]
            if todo:
                self._wait_d2h(todo)
                guess = spec.get(u)
                t = time.perf_counter()
                if (guess is not None and coef == 1.0 and inv_scale == 1.0 and set(guess) == set(todo)
                        and all(guess[n] == hypers[self.group_of[n]] for n in todo)):  # fmt: skip
                    for n in todo:  # commit: the speculative bank becomes the current one
                        self.cur[n], self.alt[n] = self.alt[n], self.cur[n]
                    self._upload(u, todo, bwd_done)
                elif on_gpu:
                    self.h2d_event[u] = self.assist.step_unit(
                        todo, self.cur, shipped, {n: hypers[self.group_of[n]] for n in todo}, self.steps,
                        self.params, inv_scale, coef, bwd_done,
                    )  # fmt: skip
                    assisted += 1
                else:
                    if self.inner:
                        self._step_torch(u, todo, shipped, hypers, inv_scale, coef)
                    else:
                        self._step_fused(todo, shipped, hypers, inv_scale, coef, out_of_place=False)
                    compute += time.perf_counter() - t
                    self._upload(u, todo, bwd_done)
                for n in todo:
                    self.steps[n] += 1
            self.ready[u].set()
        return assisted if on_gpu else compute

    def _wait_d2h(self, names: list[str]) -> None:
        for n in names:
            ev = self.d2h_event.get(n)
            if ev is not None:
                ev.synchronize()

    def _upload_view(self, n: str) -> torch.Tensor:
        return self.upload[n] if self.upload is not None else self.cur[n][0]

    def _step_fused(self, names, shipped, hypers, inv_scale, coef, out_of_place: bool) -> None:
        """AdamW on names from the current bank into the other bank (out of place) or the current one."""
        futs = []
        for n in names:
            s = adamw_scalars(hypers[self.group_of[n]], self.steps[n] + 1, inv_scale, coef)
            p, m, v = self.cur[n]
            po, mo, vo = self.alt[n] if out_of_place else (p, m, v)
            g = shipped[n]
            half = self.upload[n] if self.upload is not None else None
            if self.lib is None:
                if out_of_place:
                    po.copy_(p), mo.copy_(m), vo.copy_(v)
                adamw_torch_(po, mo, vo, g, None, s)
                if half is not None:
                    half.copy_(po)
                continue
            numel = p.numel()
            chunk = max(_MIN_SLICE, -(-numel // self.threads))
            for a in range(0, numel, chunk):
                b = min(numel, a + chunk)
                futs.append(
                    self.pool.submit(fused_kernel.adamw_slice, self.lib, a, b, p, m, v, g, None, po, mo, vo, half, s)
                )
        for f in futs:
            f.result()

    def _step_torch(self, unit, names, shipped, hypers, inv_scale, coef) -> None:
        opt = self.inner[unit]
        if self.g32 is None:
            self.g32 = FlatViews(self.layout, torch.float32, False)
        for n in self.units[unit]:
            self.master[n].grad = None
        for n in names:
            g = self.g32[n]
            g.copy_(shipped[n])
            if inv_scale != 1.0:
                g.mul_(inv_scale)
            if coef != 1.0:
                g.mul_(coef)
            self.master[n].grad = g
        apply_hypers(opt, hypers, self.kind)
        opt.step()
        for n in names:
            self.master[n].grad = None
            if self.upload is not None:
                self.upload[n].copy_(self.master[n])

    def _upload(self, unit: str, names: list[str], bwd_done) -> None:
        if self.cuda:
            with torch.cuda.stream(self.h2d_stream):
                self.h2d_stream.wait_event(bwd_done)  # the last backward may still read these weights
                for n in names:
                    p = self.params[n]
                    p.data.copy_(self._upload_view(n).view(p.shape), non_blocking=True)
                self.h2d_event[unit] = self.h2d_stream.record_event()
        else:
            with torch.no_grad():
                for n in names:
                    p = self.params[n]
                    p.data.copy_(self._upload_view(n).view(p.shape))

    # ---- state (called with no step in flight) ----
    def export(self, name: str) -> dict:
        shape = self.params[name].shape
        p, m, v = self.cur[name]
        st: dict = {"step": self.steps[name], "master": p.view(shape).clone()}
        if self.inner:
            opt = self.inner[self._unit(name)]
            s = opt.state.get(self.master[name], {})
            for k in ("exp_avg", "exp_avg_sq", "momentum_buffer"):
                if torch.is_tensor(s.get(k)):
                    st[k] = s[k].view(shape).clone()
        elif self.kind == "adam":
            st["exp_avg"] = m.view(shape).clone()
            st["exp_avg_sq"] = v.view(shape).clone()
        return st

    def load(self, name: str, st: dict) -> None:
        self.steps[name] = int(st["step"])
        p, m, v = self.cur[name]
        p.copy_(st["master"].reshape(-1))
        if self.upload is not None:
            self.upload[name].copy_(p)
        if self.inner:
            opt = self.inner[self._unit(name)]
            key = self.master[name]
            new = {
                k: st[k].reshape(-1).clone().float() for k in ("exp_avg", "exp_avg_sq", "momentum_buffer") if k in st
            }
            if self.kind == "adam" and new:
                new["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
            opt.state[key] = new
        elif self.kind == "adam":
            m.copy_(st.get("exp_avg", torch.zeros(1)).reshape(-1).expand_as(m))
            v.copy_(st.get("exp_avg_sq", torch.zeros(1)).reshape(-1).expand_as(v))

    def _unit(self, name: str) -> str:
        return next(u for u, ns in self.units.items() if name in ns)

    def close(self) -> None:
        self.discard()
        self.wait_job()
        self.pool.shutdown(wait=False)
        self.driver.shutdown(wait=False)
        if self.assist is not None:
            self.assist_thread.shutdown(wait=False)
