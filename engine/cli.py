"""`bin/train` and `bin/bench` (console scripts `offload-train`, `offload-bench`): the command lines.

The scripts in bin/ and the console scripts pyproject.toml declares are thin callers of `train_main` and
`bench_main`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from engine import checkpoint, dist, locks, signals
from engine.config import Config, ConfigError, load_config
from engine.engine import Engine, initialize
from engine.metrics import MetricsLog, MetricsWriteError, format_bytes, run_header
from engine.planning import preflight
from engine.planning.budget import Budgets, parse_gib, peak_rss_bytes
from engine.resources import config_file, data_path
from engine.signals import GracefulStop, Stopped
from engine.skips import TrainingDiverged

DEFAULT_CONFIG = data_path("configs", "default.json")  # inside the wheel, or configs/ in a checkout


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Train with offload-engine. CONFIG is a JSON file (default: configs/default.json); "
        "key=value overrides use the schema's dotted names, e.g. optimizer.optimizer_offload_fraction=0.5.",
    )
    p.add_argument("args", nargs="*", metavar="CONFIG | key=value", help="a config file, then overrides")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--env", action="store_true", help="print an environment report and exit")
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    p.add_argument("--plan", action="store_true", help="print the memory plan (bytes per device, by part) and exit")
    p.add_argument("--json", action="store_true", help="with --plan: print it as JSON")
    p.add_argument("--gpu-memory", metavar="GIB", help="plan against this much GPU memory (assumes CUDA)")
    p.add_argument("--host-memory", metavar="GIB", help="plan against this much host memory")
    return p


def _budgets(args: argparse.Namespace) -> Budgets:
    try:
        gpu = None if args.gpu_memory is None else parse_gib("--gpu-memory", args.gpu_memory)
        host = None if args.host_memory is None else parse_gib("--host-memory", args.host_memory)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    return Budgets(gpu, host)


def show_plan(cfg: Config, budgets: Budgets, as_json: bool) -> int:
    """`bin/train CONFIG --plan [--json]`: the plan, "auto" resolved; exit 2 (one line) when it does not fit."""
    from engine.planning import NothingFits, format_plan, planner, resolve
    from engine.planning.preflight import refusal

    p = planner(cfg, gpu_budget_bytes=budgets.gpu_bytes, host_budget_bytes=budgets.host_bytes)
    try:
        result = resolve(p)
    except NothingFits as e:
        raise ConfigError([str(e)]) from None
    print(json.dumps(result.to_json(), indent=2) if as_json else format_plan(result, p.settings))
    if not result.fits:
        print(f"error: {refusal(p, result)}", file=sys.stderr)
        return 2
    return 0


def _split_args(args: list[str]) -> tuple[str, list[str]]:
    if args and "=" not in args[0]:
        return config_file(args[0]), args[1:]
    return str(DEFAULT_CONFIG), args


BENCHES = {
    "optimizer": "engine.bench.optimizer",
    "activations": "engine.bench.activations",
    "scale": "engine.bench.scale",
    "cpass": "engine.bench.cpass",
    "floors": "engine.bench.floors",
    "peers": "engine.bench.peers",
}


def bench_main(argv: list[str] | None = None) -> int:
    """`bin/bench <name> [options]`: runs one of engine/bench's modules (each prints its table and command)."""
    argv = sys.argv[1:] if argv is None else argv
    usage = f"usage: {os.path.basename(sys.argv[0])} {{{'|'.join(BENCHES)}}} [options]  (NAME --help: its options)"
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in BENCHES:
        print(usage, file=sys.stderr)
        return 2
    return importlib.import_module(BENCHES[argv[0]]).main(argv[1:])


def _checkpoint_to_load(cfg: Config) -> str | None:
    """checkpoint.load when it holds a checkpoint; None to start fresh (only with checkpoint.load_if_exists)."""
    load = cfg.checkpoint.load
    if load is None:
        return None
    try:
        checkpoint.resolve(load)
    except checkpoint.NoCheckpointError as e:
        if not cfg.checkpoint.load_if_exists:
            raise ConfigError([str(e)]) from None
        dist.log(f"checkpoint.load={load!r} holds no checkpoint yet: starting from iteration 0 "
                 "(checkpoint.load_if_exists=true)")  # fmt: skip
        return None
    return load


def _lock_run_files(cfg: Config, stack: contextlib.ExitStack) -> None:
    """One run per checkpoint folder and metrics file: a second run fails here, before any work."""
    if cfg.checkpoint.save and dist.is_main():  # rank 0 writes the checkpoints
        stack.enter_context(locks.holding(cfg.checkpoint.save, "checkpoint.save", directory=True))
    metrics = dist.rank_path(cfg.logging.metrics_file)
    if metrics:
        stack.enter_context(locks.holding(metrics, "logging.metrics_file", directory=False))


def _stopped(signum: int, eng: Engine, save: str | None, saved: str | None) -> Stopped:
    what = f"stopped by {signals.name(signum)} after iteration {eng.iteration}"
    if saved:
        return Stopped(128 + signum, f"{what}: checkpoint saved in {saved}; resume with checkpoint.load={save}")
    why = "checkpoint.save is not set" if not save else "no step was taken in this run"
    return Stopped(128 + signum, f"{what}: nothing saved ({why})")


def train(cfg: Config, budgets: Budgets | None = None) -> MetricsLog:
    """Runs `cfg` to `train.train_iters`, logging metrics and saving checkpoints as configured.

    After a SIGTERM or SIGINT it finishes the step in progress, saves (with checkpoint.save) and raises
    signals.Stopped; `train.max_skipped_steps` consecutive non-finite steps raise TrainingDiverged."""
    with contextlib.ExitStack() as stack:
        _lock_run_files(cfg, stack)
        load = _checkpoint_to_load(cfg)
        stop = stack.enter_context(GracefulStop())
        with stop.aborting():  # a signal while building, planning or loading stops at once: nothing to save yet
            eng, _, _ = initialize(config=cfg, memory_budgets=budgets)
            resumed = None
            if load:
                eng.load_checkpoint(load)
                resumed = {"checkpoint": str(checkpoint.resolve(load)), "iteration": eng.iteration}
                dist.log(f"resumed from {load} at iteration {eng.iteration}")
            eng.data_iter = eng.data_iter or eng.default_data()  # data errors surface before the progress bar
        tensorboard = cfg.logging.tensorboard_dir if dist.is_main() else None
        planned = eng.planned[1].choice() if eng.planned is not None else None  # the mix "auto" chose, once
        header = run_header(cfg.to_dict(), resumed, planned)
        log = MetricsLog(dist.rank_path(cfg.logging.metrics_file), header, tensorboard)
        stack.callback(log.close)
        tokens_per_iter = cfg.train.global_batch_size * cfg.model.seq_length
        save, every = cfg.checkpoint.save, cfg.checkpoint.save_interval
        bar = tqdm(
            total=cfg.train.train_iters,
            initial=eng.iteration,
            unit="it",
            dynamic_ncols=True,
            disable=not (cfg.logging.progress_bar and dist.is_main()),
        )  # rank 0 only
        stack.callback(bar.close)
        first, saved, saved_at, signum = eng.iteration, None, None, None
        while eng.iteration < cfg.train.train_iters and not (signum := stop.requested(eng.device)):
            lr = eng.optimizer.param_groups[0]["lr"]  # the step below uses it; the schedule then moves on
            start = time.perf_counter()
            diverged = None
            try:
                loss = eng.train_batch()
            except TrainingDiverged as e:  # its iteration is recorded, then the run ends
                diverged, loss = e, e.loss
            seconds = time.perf_counter() - start
            record = {
                "iteration": eng.iteration,
                "loss": loss,
                "lr": lr,
                "grad_norm": float(eng.last_grad_norm),
                "iteration_ms": 1000.0 * seconds,
                "tokens_per_s": tokens_per_iter / seconds,
                "peak_memory_bytes": eng.peak_memory_bytes(),
                "host_offload_bytes": eng.host_bytes(),
                "activation_offload_bytes": eng.activation_offload_bytes(),
                "skipped": eng.last_step_skipped,
                "skipped_steps": eng.skips.total,  # this run's, non-finite or fp16 overflow
                "peak_host_rss_bytes": peak_rss_bytes(),  # VmHWM: the whole process, pinned buffers included
                "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if eng.device.type == "cuda" else 0,
                # the memory plan's choices ("auto" resolved by initialize)
                "optimizer_offload_fraction": eng.config.optimizer.optimizer_offload_fraction,
                "cpu_offloading_num_layers": eng.config.model.cpu_offloading_num_layers,
                "delayed_update": eng.last_step_delayed,
            }
            if eng.iteration % cfg.logging.log_interval == 0 or eng.iteration == cfg.train.train_iters or diverged:
                log.write(record)
            if diverged:
                raise diverged
            bar.set_postfix(
                loss=f"{loss:.4f}",
                tok_s=f"{record['tokens_per_s']:,.0f}",
                mem=format_bytes(record["peak_memory_bytes"]),
                **({"skipped": eng.skips.total} if eng.skips.total else {}),
                refresh=False,
            )
            bar.update(1)
            if save and every and eng.iteration % every == 0:
                saved, saved_at = eng.save_checkpoint(save), eng.iteration
        if save and eng.iteration > first and saved_at != eng.iteration:
            saved, saved_at = eng.save_checkpoint(save), eng.iteration
        if signum:
            bar.close()
            dist.log(log.summary())
            raise _stopped(signum, eng, save, saved if saved_at == eng.iteration else None)
        bar.close()
        for line in eng.offload_report():  # what offloading moved and saved, per layer stack and for the optimizer
            dist.log(line)
    return log


def train_main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)  # flags may come between or after the overrides
    try:
        if args.env:
            from engine.envreport import env_report

            print(env_report())
            return 0
        config_path, overrides = _split_args(args.args)
        cfg = load_config(config_path, overrides)
        budgets = _budgets(args)
        if args.print_config:
            print(json.dumps(cfg.to_dict(), indent=2))
            return 0
        if args.plan or args.json:
            return show_plan(cfg, budgets, args.json)
        log = train(cfg, budgets)
        dist.log(log.summary())
        dist.shutdown()
        return 0
    except Stopped as e:  # a signal: the checkpoint is saved; the line says where
        print(e, file=sys.stderr)
        dist.shutdown()
        return e.code
    except ConfigError as e:
        if args.debug:
            raise
        for line in e.errors:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except torch.OutOfMemoryError as e:  # what the plan said, what failed, which keys to change
        if args.debug:
            raise
        print(f"error: {dist.report_failure(preflight.oom_line(e))}", file=sys.stderr)
        return 1
    except Exception as e:  # one line for users; --debug shows the traceback
        if args.debug:
            raise
        # raised with a message naming the key
        ours = isinstance(e, (ValueError, FileNotFoundError, checkpoint.CheckpointError, TrainingDiverged,
                              locks.LockedError, locks.LockFileError, MetricsWriteError))  # fmt: skip
        message = f"{e if ours else f'{type(e).__name__}: {e}'}".splitlines()[0]
        print(f"error: {dist.report_failure(message)}", file=sys.stderr)  # the other ranks exit with it too
        return 1
