"""`bin/bench floors [kernel]`: floor measurements for the hybrid optimizer on the device.

Prints: pinned H2D/D2H bandwidth (alone and both ways at once), torch fused CPU AdamW and our fused
C pass in params/s at 15 and 16 threads (in place and out of place, alone and under copy traffic),
and the bench model's forward and backward time. `kernel`: the CPU AdamW rates only. (`bin/bench cpass`
compares the C pass with torch's fused CPU AdamW plus the casts it saves.)
"""

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.bench import no_cuda
from engine.models.gpt import GPT, gpt_loss
from engine.optim import fused_kernel


def t_cuda(fn, n=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def bandwidth():
    nbytes = 1 << 30
    host = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    host2 = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dev2 = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    h2d = t_cuda(lambda: dev.copy_(host, non_blocking=True))
    d2h = t_cuda(lambda: host.copy_(dev, non_blocking=True))
    copies = host, host2, dev, dev2, torch.cuda.Stream(), torch.cuda.Stream()
    bb = t_cuda(lambda: copy_both_ways(copies))
    print(
        f"H2D pinned {nbytes / h2d / 1e9:.1f} GB/s | D2H pinned {nbytes / d2h / 1e9:.1f} GB/s | "
        f"both at once {2 * nbytes / bb / 1e9:.1f} GB/s total"
    )
    return copies


def copy_both_ways(copies) -> None:
    """One H2D and one D2H copy at once, each on its own stream, waited for."""
    host, host2, dev, dev2, s1, s2 = copies
    with torch.cuda.stream(s1):
        dev.copy_(host, non_blocking=True)
    with torch.cuda.stream(s2):
        host2.copy_(dev2, non_blocking=True)
    s1.synchronize()
    s2.synchronize()


def cpu_adam(copies):
    n = 200_000_000
    p = torch.randn(n)
    g = torch.randn(n)
    m = torch.zeros(n)
    v = torch.zeros(n)
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            copy_both_ways(copies)

    for threads in (15, 16):
        for busy in (False, True):
            torch.set_num_threads(threads)
            th = None
            if busy:
                stop.clear()
                th = threading.Thread(target=traffic)
                th.start()
            p.grad = g
            opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m, "exp_avg_sq": v}
            ts = []
            for _ in range(4):
                t = time.perf_counter()
                opt.step()
                ts.append(time.perf_counter() - t)
            if th:
                stop.set()
                th.join()
            print(
                f"torch fused CPU AdamW fp32 threads={threads} copies={'on ' if busy else 'off'}: "
                f"{n / min(ts[1:]) / 1e9:.2f} G params/s"
            )
    torch.set_num_threads(16)
    lib = fused_kernel.load()
    print("fused C kernel loaded:", lib is not None)
    if lib is None:
        return
    gb = g.bfloat16()
    half = torch.empty(n, dtype=torch.bfloat16)
    p2, m2, v2 = torch.empty_like(p), torch.empty_like(m), torch.empty_like(v)
    sc = (1.0, 1.0, 1 - 1e-5, 0.1, 0.95, 0.05, 0.99, 1e-8, -1e-4)
    # the kernel as built by default, and with 512-bit vectors on AVX-512 machines
    flags512 = [*fused_kernel.FLAGS, "-mprefer-vector-width=512"]
    variants = {"default": lib, "w512": fused_kernel.bind(fused_kernel.build(flags512))}
    for (vname, vlib), threads in [(v, t) for v in variants.items() for t in (15, 16)]:
        pool = ThreadPoolExecutor(threads)
        chunk = (n + threads - 1) // threads
        for oop, stream in ((False, False), (False, True), (True, False), (True, True)):
            for busy in (False, True):
                th = None
                if busy:
                    stop.clear()
                    th = threading.Thread(target=traffic)
                    th.start()
                outs = (p2, m2, v2) if oop else (p, m, v)
                ts = []
                for _ in range(4):
                    t = time.perf_counter()
                    futs = [
                        pool.submit(
                            fused_kernel.adamw_slice,
                            vlib,
                            s,
                            min(n, s + chunk),
                            p,
                            m,
                            v,
                            gb,
                            None,
                            *outs,
                            half,
                            sc,
                            stream,
                        )
                        for s in range(0, n, chunk)
                    ]
                    for f in futs:
                        f.result()
                    ts.append(time.perf_counter() - t)
                if th:
                    stop.set()
                    th.join()
                where = "out-of-place" if oop else "in-place    "
                print(
                    f"our fused C AdamW ({vname}) bf16 grad+bf16 out threads={threads} {where} stream={stream:d} "
                    f"copies={'on ' if busy else 'off'}: {n / min(ts[1:]) / 1e9:.2f} G params/s"
                )
        pool.shutdown()


def model_time():
    torch.manual_seed(0)
    model = GPT(num_layers=24, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=256)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 256, (4, 2048), device="cuda")
    fwd = t_cuda(lambda: gpt_loss(model(tokens), tokens))

    def fb():
        gpt_loss(model(tokens), tokens).backward()

    fb_t = t_cuda(fb)
    print(
        f"GPT {n / 1e9:.3f} B params, mb 4 x seq 2048 bf16: forward {fwd * 1e3:.1f} ms, fwd+bwd {fb_t * 1e3:.1f} ms, "
        f"peak GPU {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    )


def main(argv: list[str]) -> int:
    if refusal := no_cuda("bin/bench floors"):
        print(refusal, file=sys.stderr)
        return 2
    print("cores:", os.cpu_count(), "affinity:", len(os.sched_getaffinity(0)), "torch", torch.__version__)
    copies = bandwidth()
    if "kernel" not in argv:  # `kernel`: the CPU AdamW rates only
        model_time()
    cpu_adam(copies)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
