"""bench/gpu_check.py's memory plan: raytrain_lm.plan's estimate for one worker against the
max_memory_allocated each gpt2 measurement reached (bench/gpu_throughput.py's loop, and the gpt2
rows through step.TrainStep), and the summary lines it prints."""

from __future__ import annotations


def memory_plan(result: dict, kind: str) -> list[dict]:
    from gpu_check_layout import config
    from raytrain_lm.plan.estimate import estimate
    from raytrain_lm.plan.hardware import GB

    gpu = kind == "gpu"
    rows = []
    throughput = result.get("gpt2", {})
    model = config(kind, {"model": "gpt2"}).model
    for r in throughput.get("results", []):
        if r.get("status") == "ok":
            m = model
            if kind == "smoke":  # gpu_throughput's smoke model, not gpt2
                from gpu_throughput import SMOKE
                from raytrain_lm.models.family import ModelConfig

                m = ModelConfig(**SMOKE["model"])
                m.vocab_size = throughput["model"]["vocab_size"]
            plan = estimate(m, 1, "ddp", "none", r["batch_size"], throughput["model"]["seq_len"],
                            gpu=gpu)
            rows.append(_row(f"gpu_throughput {r['mode']}", r["batch_size"], plan.total / GB,
                             r["peak_mem_gb"]))
    for r in result["layouts"]:
        if r.get("settings", {}).get("model") == "gpt2" and r["status"] == "ok":
            cfg = config(kind, r["settings"])
            plan = estimate(cfg.model, 1, "ddp", "none", cfg.batch_size, cfg.seq_len, gpu=gpu)
            rows.append(_row(r["layout"], cfg.batch_size, plan.total / GB, r["peak_mem_gb"]))
    return rows


def _row(what: str, batch: int, plan_gb: float, measured_gb: float) -> dict:
    return {"what": what, "batch_size": batch, "plan_gb": plan_gb, "measured_gb": measured_gb,
            "ratio": plan_gb / measured_gb if measured_gb else None}


def lines(result: dict) -> list[str]:
    out = []
    for r in result.get("gpt2", {}).get("results", []):
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        out.append(f"gpu_throughput gpt2 {r['mode']} batch {r['batch_size']}: "
                   f"{r.get('tokens_per_second', 0):,.0f} tok/s, MFU {mfu}")
    for r in result["layouts"]:
        if r.get("settings", {}).get("model") == "gpt2" and r["status"] == "ok":
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
            out.append(f"TrainStep {r['layout']}: {r['tokens_per_second']:,.0f} tok/s, MFU {mfu}")
    for r in result.get("memory_plan", []):
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        out.append(f"memory plan, {r['what']} batch {r['batch_size']}: planned {r['plan_gb']:.3f} "
                   f"GB, max_memory_allocated {r['measured_gb']:.3f} GB ({ratio})")
    return out
