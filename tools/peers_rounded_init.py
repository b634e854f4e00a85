"""Whether a loss gap between `bin/bench peers` rows is the mechanism or the initial weights.

The plain reference (torch AdamW, fp32 weights, bf16 autocast) from the fp32 draw and from the same draw rounded
to bf16, beside ours (bf16 weights, fp32 masters, f=1), same data and seed, one lr per argument:

    python3 tools/peers_rounded_init.py 1e-6 1e-4          # CPU, 4 x 512, seq 256, ~10 s an lr
    python3 tools/peers_rounded_init.py --shape 24,2048,16,2048,4 1e-6   # the 1.2 B bench shape on a GPU
"""

from __future__ import annotations

import argparse

from engine.bench.peers import runner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lrs", nargs="+", type=float)
    p.add_argument("--shape", default="4,512,8,256,4", help="layers,hidden,heads,seq,micro_batch")
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    layers, hidden, heads, seq, mb = (int(x) for x in a.shape.split(","))
    base = dict(
        model="gpt",
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq=seq,
        micro_batch=mb,
        iters=a.steps - 1,
        warmup=1,
        seed=1234,
        weight_decay=0.0,
        clip=1.0,
        cpu_threads=2,
        threads=None,
        data_bytes=2_000_000,
    )
    print(f"{'lr':>7} {'run':28} losses per step (the last minus plain-bf16-start's)")
    for lr in a.lrs:
        reference = None  # the first run's last loss: plain from the bf16 start
        for name, peer, bf16_start in (("plain, bf16 start", "plain", True), ("plain, fp32 start", "plain", False),
                                       ("ours f=1, bf16 start", "ours", True)):  # fmt: skip
            fraction = 1.0 if peer == "ours" else 0.0
            r = runner.train(dict(base, peer=peer, lr=lr, fraction=fraction, bf16_start=bf16_start))
            reference = r["losses"][-1] if reference is None else reference
            delta = r["losses"][-1] - reference
            print(f"{lr:7.0e} {name:28}", " ".join(f"{x:.4f}" for x in r["losses"]), f"({delta:+.4f})", flush=True)


if __name__ == "__main__":
    main()
